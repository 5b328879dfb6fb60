"""Who hosts an elastic job once its host is gone: no node is special after the start.

The host (node 0's launcher at first) hosts the launchers' channel, Gloo's rendezvous
and ps-lite's scheduler, and runs rank 0. Every round's spec lists every node's address
and the port its launcher listens on should it host the job (each elastic node's
launcher opens that port when it starts: ``Listener``, polled only once it hosts).

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
from .protocol import RoundSpec


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
    """An elastic node's listener for the job, should it become the host (any free
    port, every interface); None for a job of one node or a static one."""
    if not (config.elastic and config.several_nodes):
        return None
    return Listener(0, config.job_secret, say, "", config.max_nodes or 1)


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


def elect(config: LaunchConfig, spec: RoundSpec, hello: dict, say) -> Link | None:
    """Reach the next host: a link to it, or None when this node is to host the job."""
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
        return link
    return None
