"""Who hosts an elastic job once its host is gone: no node is special after the start.

The host (node 0's launcher at first) hosts the launchers' channel, Gloo's rendezvous
and ps-lite's scheduler, and runs rank 0. Every round's spec lists every node's address
and the port its launcher listens on should it host the job (each elastic node's
launcher opens that port when it starts, on --master-port where it is free: until the
node hosts the job, a launcher that joins through it is sent on to the host, so a node
joining later can be given any node's address; ``open_door``, ``send_on``).

1. *Detection*: a node's launcher loses the host's (its link closed, or nothing heard for
   --silence-limit), or the host, preempted, hands the job over (``End(handover=True)``).
   It ends its processes at once.
2. *Election*: the next host is the lowest node rank of the last formation that remains
   (policy.successor). Each node tries the nodes of the last formation below its own
   rank, lowest first (policy.candidates), for up to twice --silence-limit each; the
   first that answers is the new host; a node that reaches none of them hosts the job.
3. *Takeover*: the new host gathers the last formation's other nodes for as long, then
   goes on only with a quorum of the last formation (policy.quorum: a strict majority,
   or exactly half holding its lowest rank) and at least MIN nodes; it renumbers the
   ranks over the new formation (itself first: rank 0 and the scheduler move to it) and
   every node resumes from the last checkpoint. A side without a quorum ends, saying
   why: two sides cut apart never both go on. A planned handover counts the quorum over
   the nodes that remain (the host left on purpose and does not go on).
"""
from __future__ import annotations

import socket
from dataclasses import dataclass

from . import policy
from .channel import JoinError, Link, Listener, connect_to_master
from .config import LaunchConfig
from .protocol import Redirect, RoundSpec


@dataclass
class Takeover:
    """What a node that takes over knows of the job: the ``spec`` of the last round,
    the newest ``checkpoint`` (epoch, step) the host told of, what it saw of the host's
    loss (``report``), whether the host handed the job over (``planned``) and the
    ``listener`` its launcher opened at the start."""

    spec: RoundSpec
    checkpoint: tuple[int, int] | None
    report: str
    planned: bool
    listener: Listener

    @staticmethod
    def gather_timeout(config: LaunchConfig) -> float:
        """Seconds a new host waits for the other nodes, and a node for a candidate."""
        return 2 * config.silence_limit


def open_door(config: LaunchConfig, say) -> Listener | None:
    """An elastic node's listener for the job, should it become the host, on every
    interface: on --master-port where that is free (so that a node joining later can be
    given any node's address with the job's --master-port), else on any free port (node
    0 on this very machine holds --master-port). None for a job of one node or a static
    one."""
    if not (config.elastic and config.several_nodes):
        return None
    backlog = config.max_nodes or 1
    if not _same_machine(config.master_addr):
        try:
            return Listener(config.master_port, config.job_secret, say, "", backlog,
                            config.half_open_limit)
        except JoinError:
            pass
    return Listener(0, config.job_secret, say, "", backlog, config.half_open_limit)


def _same_machine(master_addr: str) -> bool:
    try:
        master = socket.gethostbyname(master_addr)
        return own_address(master_addr) == master
    except OSError:
        return False


def send_on(listener: Listener, spec: RoundSpec | None, host: tuple[str, int, str],
            say) -> None:
    """A node that does not host the job answers at its door: a launcher that joins
    through it is sent on to the job's ``host`` (address, port, name); a node of the
    last formation (electing the next host, which may be this node) is kept there for
    this node to take over."""
    for link, hello in listener.poll():
        node = hello.get("node")
        if spec is not None and node in spec.nodes:
            listener.keep(link, hello)
            continue
        addr, port, name = host
        link.send(Redirect(addr, port, name))
        link.close()
        say(f"node {node} ({hello.get('host')}) joined through this node, which does not "
            f"host the job: sent it on to {name} at {addr}:{port}")


def own_address(master_addr: str) -> str:
    """The address the other nodes reach this one at (the one it reaches the host
    from)."""
    from .jobenv import route_source_addr
    return route_source_addr(socket.gethostbyname(master_addr))


def can_succeed(config: LaunchConfig, spec: RoundSpec | None) -> bool:
    """Whether this node can take part in electing a new host."""
    return bool(config.elastic and spec is not None and spec.addresses
                and config.node_rank in spec.nodes and config.node_rank != spec.host)


def hopeless(config: LaunchConfig, spec: RoundSpec, planned: bool) -> str | None:
    """Why the nodes left after the host's loss cannot go on even if all of them are
    alive (too few for MIN, or no quorum), if so."""
    rest = [n for n in spec.nodes if n != spec.host]
    if len(rest) < config.min_nodes:
        return (f"node {spec.host} hosts the job: its loss ends the job, since the "
                f"other nodes of the last formation ({policy.plural(len(rest), 'node')}) "
                f"are fewer than the minimum {config.min_nodes} of --nnodes "
                f"{config.min_nodes}:{config.max_nodes}")
    if not planned and not policy.quorum(rest, spec.nodes):
        return policy.minority([config.node_rank], spec.nodes)
    return None


def elect(config: LaunchConfig, spec: RoundSpec, hello: dict,
          say) -> tuple[Link, int] | None:
    """Reach the next host: a link to it and its node rank, or None when this node is
    to host the job."""
    me = config.node_rank
    for candidate in policy.candidates(spec.nodes, spec.host, me):
        if candidate == me:
            return None
        addr, port = spec.addresses[spec.nodes.index(candidate)]
        try:
            link = connect_to_master(addr, port, hello, Takeover.gather_timeout(config),
                                     config.job_secret)
        except JoinError:
            say(f"node {candidate} at {addr}:{port} did not answer within "
                f"{Takeover.gather_timeout(config):g} s: trying the next node")
            continue
        return link, candidate
    return None
