"""The job loop: node 0's launcher (the master, master.py) runs the job in rounds, and
every other node's launcher (an agent, agent.py) runs each round's processes on its
machine.

A round is one start of every worker (and ps-lite's scheduler and servers) on the
nodes of the current *formation* (formation.py). It ends when every worker has finished
(the job is done), when a rank fails, when a node is lost (its launcher's connection
closed or went silent for --silence-limit) or when the job stops at a step boundary for
a planned change (a node is preempted, or a node waits to join). Then the master
decides (policy.py):

- a static job (``--nnodes N``) restarts the same nodes after a failure, up to
  --max-restarts times, and ends when a node is lost (it cannot come back);
- an elastic job (``--nnodes MIN:MAX``) re-forms: the nodes that remain, with the nodes
  waiting to join (up to MAX), start the next round with the new world size, as long as
  MIN nodes remain. Failures and lost nodes use up one of --max-restarts; planned
  changes use none. The workers resume from their last checkpoint.

A planned change asks every worker to stop at its next step boundary: the launcher sets
a request in each worker's job-control record, ``dist_gluon.stop_requested()`` (a
collective: every rank answers the same at the same step) returns True, the script saves
a checkpoint and exits. A script that never asks is stopped right after its next
checkpoint instead; a preempted node waits at most --preempt-grace seconds for either,
then leaves anyway (the steps since the last checkpoint are lost).

Node 0 hosts the job at first (the launchers' channel, Gloo's rendezvous, ps-lite's
scheduler). A static job ends when it is lost, as torchrun's static rendezvous does. An
elastic job goes on without it: the lowest node left takes over as the host and the
job re-forms with a quorum of the last formation (succession.py); a preempted host
hands the job over after a checkpoint.

This module holds what both sides share: how a signal interrupts a launcher, and the
check of this host's name before a multi-node horovod job.
"""
from __future__ import annotations

import ipaddress
import signal
import socket
import time

from . import jobenv
from .config import LaunchConfig


class Interrupted(Exception):
    def __init__(self, signum):
        self.signum = signum


class Preemption:
    """SIGTERM to the launcher of an elastic job: the node leaves after a checkpoint
    (a second SIGTERM, or SIGINT, interrupts at once)."""

    def __init__(self):
        self.at: float | None = None

    def handler(self, signum, frame):
        if signum == signal.SIGTERM and self.at is None:
            self.at = time.monotonic()
            return
        raise Interrupted(signum)


def check_multinode_host(config: LaunchConfig) -> str | None:
    """Gloo across nodes needs this host's name to resolve to a reachable address,
    unless node 0's address is a loopback one: then every node runs on this machine
    (several launchers on one host, to try a multi-node job out)."""
    if config.backend != "horovod" or _on_loopback(config.master_addr):
        return None
    try:
        if jobenv.resolves_to_loopback():
            host = socket.gethostname()
            return jobenv.loopback_hostname_error(host, socket.gethostbyname(host))
    except OSError as err:
        return f"this host's name {socket.gethostname()!r} does not resolve: {err}"
    return None


def _on_loopback(addr: str | None) -> bool:
    """A literal loopback address, or 'localhost' (which no machine resolves to
    another)."""
    if addr == "localhost":
        return True
    try:
        return ipaddress.ip_address(addr).is_loopback
    except ValueError:
        return False
