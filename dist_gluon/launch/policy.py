"""What the job's host (node 0's launcher, or the node that took over from it) decides,
as pure functions of what it knows: whether a node may join (admission), when the first
round starts, what follows a round (restart, re-formation or the end, with the reports
every node shows), which waiting nodes come in, when a requested stop has ended a round,
and who hosts the job once its host is gone (quorum and succession). No sockets, no
processes, no clock but the ``now`` given: tests/test_launch_policy.py checks them
directly.

A static job (``--nnodes N``) restarts the same nodes after a failure, up to
--max-restarts times, and ends when a node is lost. An elastic job (``--nnodes
MIN:MAX``) re-forms while MIN nodes remain: failures and lost nodes use up one of
--max-restarts, planned changes (a preemption, nodes waiting to join) use none.
"""
from __future__ import annotations

import enum
import signal
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import NamedTuple

from .processes import TERM_GRACE

KILL_GRACE = 0.5        # seconds between SIGTERM and SIGKILL when an elastic job re-forms
CHECKPOINT_EXIT = 5.0   # seconds workers get to exit after the checkpoint of a stop


class Outcome(enum.Enum):
    """How a round ended."""

    DONE = "done"                   # every worker finished
    FAILED = "failed"               # a rank (or a ps-lite service) failed
    LOST = "lost"                   # a node's launcher disconnected or went silent
    STOPPED = "stopped"             # the workers stopped at a step boundary (planned)
    TIMEOUT = "timeout"             # --timeout
    INTERRUPTED = "interrupted"     # SIGINT/SIGTERM to node 0's launcher
    ERROR = "error"                 # the round could not start


class RoundEnd(NamedTuple):
    """A round's outcome, its exit status and report; ``lost`` the nodes lost (LOST) or
    the preempted node (STOPPED); ``late``: the workers missed --preempt-grace."""

    outcome: Outcome
    status: int = 0
    report: str | None = None
    lost: tuple[int, ...] = ()
    late: bool = False


class Decision(NamedTuple):
    """What follows a round: the host's exit ``status``; whether a round runs ``again``;
    the ``report`` every node shows; ``leaving``: the parting report of each node that
    leaves while the others go on; ``restart``: whether it uses one of --max-restarts;
    ``handover``: the host leaves (preempted) and the others go on under the next host
    (:func:`successor`)."""

    status: int
    again: bool
    report: str | None
    leaving: dict[int, str]
    restart: bool = False
    handover: bool = False


@dataclass(frozen=True)
class Standing:
    """The job as its host sees it when it decides.

    ``nodes`` counts the formation's nodes (the host included), ``waiting`` the nodes
    waiting to join, ``workers`` the formation's workers; ``names`` says each node's
    name ("node 2 (host)"); ``checkpoint`` is the newest (epoch, step) rank 0 saved.
    ``host`` is the node rank of the job's host; ``formation`` the node ranks of the
    round that just ended when every node knows every other's address (then a loss
    re-forms only with a quorum of it, and a preempted host hands the job over); empty
    when they do not (the host's loss ends the job). ``preempted``: the nodes whose
    launchers got SIGTERM too (they leave as well; none takes the job over).
    ``memory``: the workers keep their state in memory (dist_gluon.elastic.run: in
    their processes, or in their nodes' shared memory), not in checkpoints.
    """

    elastic: bool
    min_nodes: int
    max_nodes: int
    max_restarts: int
    restarts: int = 0
    reformations: int = 0
    nodes: int = 1
    waiting: int = 0
    workers: int = 0
    checkpoint: tuple[int, int] | None = None
    preempt_grace: float = 20.0
    names: Mapping[int, str] | None = None
    host: int = 0
    formation: tuple[int, ...] = ()
    preempted: tuple[int, ...] = ()
    memory: bool = False

    def who(self, node: int) -> str:
        return (self.names or {}).get(node, f"node {node}")


def plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


# ---------------------------------------------------------------------- admission
def admission_refusal(node, taken: Iterable[int], min_nodes: int,
                      max_nodes: int) -> str | None:
    """Why a launcher that says it is node ``node`` cannot join an elastic job whose
    node ranks ``taken`` are in use (node 0 and waiting nodes included); None: it may."""
    taken = set(taken)
    # a full job first: then every node rank is taken, which would say less
    if len(taken) >= max_nodes:
        return (f"the job already has its maximum of {max_nodes} nodes "
                f"(--nnodes {min_nodes}:{max_nodes})")
    if not isinstance(node, int) or not 0 <= node < max_nodes or node in taken:
        return (f"node rank {node} is taken or out of range [1, {max_nodes}) (nodes now in "
                f"the job: {', '.join(map(str, sorted(taken)))}); give each machine its "
                "own --node-rank")
    return None


def ready_to_start(nodes: int, since_last_join: float, min_nodes: int, max_nodes: int,
                   last_call: float, arriving: int = 0) -> bool:
    """Elastic: the first round starts with MAX nodes at once, or with MIN or more once
    none has joined for --last-call seconds and no connection is ``arriving`` (still
    saying hello, or queued behind those that are: a burst of launchers that reached
    node 0 in time is taken in whole)."""
    return nodes >= max_nodes or (nodes >= min_nodes and since_last_join >= last_call
                                  and not arriving)


def admitted(waiting: Iterable[int], members: int, max_nodes: int) -> list[int]:
    """The waiting nodes that join the next formation (lowest node ranks first) when
    ``members`` nodes besides node 0 remain in it."""
    room = max_nodes - 1 - members
    return sorted(waiting)[:max(0, room)]


def round_problem(slots: list[int], server_counts: list[int], backend: str) -> str | None:
    """Why no round can start on this formation, if none can."""
    if sum(slots) < 1:
        return "no node of this job runs workers (every node was given -n 0)"
    if backend != "horovod" and sum(server_counts) < 1:
        return ("no node of this job runs a ps-lite server (every node was given "
                "--servers 0): give the server nodes --servers S")
    return None


# ---------------------------------------------------------------------- after a round
def decide(end: RoundEnd, job: Standing) -> Decision:
    """What follows a round that ended as ``end``."""
    kind = end.outcome
    if kind is Outcome.DONE:
        if not job.elastic:
            return Decision(0, False, None, {})
        restarts = (f" and {plural(job.restarts, 'restart')} of at most "
                    f"{job.max_restarts}" if job.max_restarts else "")
        return Decision(0, False, (
            f"the job finished on {plural(job.nodes, 'node')} "
            f"({plural(job.workers, 'worker')}) after "
            f"{plural(job.reformations, 're-formation')}{restarts}"), {})
    if kind in (Outcome.TIMEOUT, Outcome.INTERRUPTED, Outcome.ERROR):
        return Decision(end.status, False, end.report, {})
    if kind is Outcome.STOPPED:
        return _decide_stop(end, job)
    if kind is Outcome.LOST and not job.elastic:
        return Decision(1, False, (
            f"the launcher of node {end.lost[0]} disconnected or went silent (its machine, "
            "its network or its launcher died); its ranks are lost"), {})
    remaining = job.nodes + job.waiting - (len(end.lost) if kind is Outcome.LOST else 0)
    if job.elastic and remaining < job.min_nodes:
        return Decision(end.status or 1, False,
                        f"{end.report}\n{too_few(remaining, job)}", {})
    if kind is Outcome.LOST and job.formation:
        here = [n for n in job.formation if n not in end.lost]
        if not quorum(here, job.formation):
            return Decision(end.status or 1, False,
                            f"{end.report}\n{minority(here, job.formation, job.who)}", {})
    if job.restarts >= job.max_restarts:
        if kind is Outcome.LOST:
            return Decision(1, False, (f"{end.report}\nno restart left (--max-restarts "
                                       f"{job.max_restarts}): the job ends"), {})
        return Decision(end.status, False, end.report, {})
    return Decision(end.status, True, end.report, {}, restart=True)


def _decide_stop(end: RoundEnd, job: Standing) -> Decision:
    """A planned stop: a preempted node leaves, waiting nodes come in."""
    where = "their last commit" if job.memory else checkpoint_text(job.checkpoint)
    saved = (f"the workers did not stop within --preempt-grace {job.preempt_grace:g} s; "
             f"the steps since {where} are lost" if end.late else
             "the workers committed their state at a step boundary" if job.memory
             else f"the workers saved {where}")
    resume = ("the state they kept in memory ends with the job (a start of the whole job "
              "resumes from a checkpoint, if the script saves them)" if job.memory
              else "start the job again to resume from it")
    preempted = 128 + signal.SIGTERM
    if end.lost == (job.host,):
        others = [n for n in job.formation if n != job.host and n not in job.preempted]
        if others and len(others) >= job.min_nodes:
            heir = successor(job.formation, (job.host,))
            return Decision(0, True, (
                f"{job.who(job.host)} was preempted (SIGTERM) and left the job; {saved}; "
                f"{job.who(heir)} takes over as the job's host and the other nodes go on "
                "under it"), {}, handover=True)
        if others:
            return Decision(preempted, False, (
                f"{job.who(job.host)} preempted (the job's host); "
                f"{too_few(len(others), job)}; {saved}"), {})
        return Decision(preempted, False, (
            f"{job.who(job.host)} was preempted (SIGTERM): it hosts the job's rendezvous, "
            f"so the job ends on every node; {saved}: {resume}"), {})
    leaving = {n: (f"{job.who(n)} was preempted (SIGTERM) and left the job; {saved}; the "
                   "other nodes go on without it") for n in end.lost}
    remaining = job.nodes - len(leaving) + job.waiting
    if remaining < job.min_nodes:
        return Decision(preempted, False, (
            f"{' and '.join(job.who(n) for n in end.lost)} preempted; "
            f"{too_few(remaining, job)}; {saved}"), leaving)
    return Decision(0, True, None, leaving)


def terminated(end: RoundEnd, decision: Decision) -> bool:
    """Whether the round's processes were ended because something went wrong (the
    reports then say so)."""
    return decision.status != 0 and end.outcome is not Outcome.STOPPED and (
        not decision.again or end.outcome is Outcome.FAILED)


def kill_grace(end: RoundEnd, decision: Decision, elastic: bool) -> float:
    """Seconds between SIGTERM and SIGKILL for the round's processes. An elastic job
    re-forming after a loss has its checkpoint on disk: workers blocked in a collective
    with the lost node cannot run a SIGTERM handler, so they get SIGKILL soon."""
    if elastic and decision.again and end.outcome in (Outcome.LOST, Outcome.FAILED):
        return KILL_GRACE
    return TERM_GRACE


def formation_news(end: RoundEnd, job: Standing, changed: bool, keep: bool = False) -> str:
    """What every node says as the next round starts; ``job`` is the new formation;
    ``keep``: the workers keep their processes and state (dist_gluon.elastic.run);
    else ``job.memory``: they restart and take their state from their nodes' memory."""
    where = ("the workers' last commit in memory (their processes stay; new workers get "
             "the state from them)" if keep else
             "the workers' last commit in memory (they restart and take the freshest from "
             "their nodes' shared memory; a new node's workers get it from a live peer)"
             if job.memory else checkpoint_text(job.checkpoint))
    if not job.elastic:
        return f"restarting the job on every node ({job.restarts} of {job.max_restarts})"
    used = (f"restart {job.restarts} of at most {job.max_restarts}"
            if end.outcome in (Outcome.FAILED, Outcome.LOST) else "planned: no restart used")
    if changed:
        return (f"re-forming with {plural(job.nodes, 'node')} "
                f"({plural(job.workers, 'worker')}) from {where} "
                f"(re-formation {job.reformations}; {used})")
    if end.outcome is Outcome.STOPPED:
        return (f"the workers stopped at a step boundary (SIGTERM to the workers "
                f"themselves); restarting them on every node from {where} ({used})")
    return (f"restarting the job on every node ({job.restarts} of {job.max_restarts}) "
            f"from {where}")


# ---------------------------------------------------------------------- succession
def quorum(here: Iterable[int], formation: Iterable[int]) -> bool:
    """Whether the nodes ``here`` may go on as the job after the rest of the last
    ``formation`` (its node ranks) went silent: a strict majority of it, or exactly half
    that holds its lowest node rank. Two sides cut apart each count themselves: at
    most one holds a strict majority, and of two equal halves only one holds the lowest
    rank, so never do both go on (no split brain). A side cannot tell dead peers from a
    cut link, so a side without a quorum ends even when the others are in fact dead."""
    here, formation = set(here), set(formation)
    here &= formation
    if 2 * len(here) != len(formation):
        return 2 * len(here) > len(formation)
    return bool(formation) and min(formation) in here


def successor(formation: Iterable[int], gone: Iterable[int]) -> int | None:
    """The node that hosts the job once the nodes ``gone`` left the ``formation``: the
    lowest node rank that remains (None: none remains)."""
    gone = set(gone)
    return min((n for n in formation if n not in gone), default=None)


def candidates(formation: Iterable[int], host: int, me: int) -> list[int]:
    """The nodes a node ``me`` of the ``formation`` that lost its ``host`` tries, in
    order, as the next host: the lowest ranks first, down to itself (it hosts when
    every lower one is unreachable)."""
    return sorted(n for n in formation if n != host and n <= me)


def minority(here: Iterable[int], formation: Iterable[int], who=None) -> str:
    """Why the nodes ``here`` end the job: they are no quorum of ``formation``."""
    here, formation = sorted(set(here)), sorted(set(formation))
    who = who or (lambda n: f"node {n}")
    names = ", ".join(who(n) for n in here) or "none"
    tie = (" (half of it without its lowest node rank, node "
           f"{formation[0]})" if 2 * len(here) == len(formation) else "")
    return (f"only {len(here)} of the last formation's {plural(len(formation), 'node')} "
            f"remain here ({names}), not a majority{tie}: a node cannot tell dead peers "
            "from a cut link, and the others may go on as the job, so this side ends "
            "(no split brain)")


def too_few(count: int, job: Standing) -> str:
    return (f"{plural(count, 'node')} left, fewer than the minimum {job.min_nodes} "
            f"of --nnodes {job.min_nodes}:{job.max_nodes}: the job ends")


def in_memory(states: list[dict], before: bool = False) -> bool:
    """Whether every worker keeps its state in memory through a re-formation: in its
    process, or in its node's shared memory (dist_gluon.elastic.run). A worker that has
    not said yet (just started again after a re-formation: not attached, or no collective
    and no word) counts as it did in the round before (``before``)."""
    if not states:
        return False
    for s in states:
        said = s.get("keeps") or s.get("node_copy")
        if not said and (not s.get("attached", True) or s.get("count", 1) == 0):
            said = before
        if not said:
            return False
    return True


def checkpoint_text(checkpoint: tuple[int, int] | None) -> str:
    if checkpoint is None:
        return "the last checkpoint (none was saved since the launcher started)"
    return f"checkpoint epoch {checkpoint[0]} step {checkpoint[1]}"


# ---------------------------------------------------------------------- planned stops
@dataclass
class StopRequest:
    """A pending request that every worker stop at its next step boundary: ``reason``
    is "admit" (nodes wait to join) or "preempt" (``node`` got SIGTERM); ``saves`` the
    checkpoints rank 0 had saved when asked; ``deadline`` (monotonic) the end of
    --preempt-grace, if any; ``saved_at`` when the next checkpoint was seen."""

    number: int
    reason: str
    node: int | None
    saves: int
    deadline: float | None = None
    saved_at: float | None = None

    @property
    def leaving(self) -> tuple[int, ...]:
        return (self.node,) if self.reason == "preempt" else ()

    def ended(self, saves: int, acked: bool, now: float) -> RoundEnd | None:
        """The round's end once the stop is done: a script that never asks
        (``acked``: some rank agreed to stop) ends right after its checkpoint, one that
        asked gets CHECKPOINT_EXIT seconds to exit by itself; past the deadline the
        workers are late. None while the round goes on."""
        if saves > self.saves and self.saved_at is None:
            self.saved_at = now
        if self.saved_at is not None and (not acked or now - self.saved_at > CHECKPOINT_EXIT):
            return RoundEnd(Outcome.STOPPED, lost=self.leaving)
        if self.deadline is not None and now > self.deadline:
            return RoundEnd(Outcome.STOPPED, lost=self.leaving, late=True)
        return None
