"""One round as node 0's launcher watches it: :class:`JobView` gathers every node's
rank states and carries the supervisor's verdicts and requests to them;
:class:`RoundWatch` runs the loop that ends the round (a failure, a lost node, a planned
stop, the job's end, --timeout) and says how (:class:`~dist_gluon.launch.policy.RoundEnd`)."""
from __future__ import annotations

import dataclasses
import queue
import time
from dataclasses import dataclass, field

from . import channel, policy
from .channel import Link
from .config import LaunchConfig
from .formation import Formation
from .job import Preemption
from .node import Node
from .policy import Outcome, RoundEnd, StopRequest
from .protocol import (
    Hint,
    Message,
    Preempt,
    Saved,
    StacksFound,
    StacksRequest,
    Status,
    Stop,
    Tick,
    Verdicts,
    from_node,
)
from .supervisor import Supervisor

SERVICE_GRACE = 10.0    # seconds ps-lite's scheduler and servers get after the workers
# seconds a preempted host waits for the other nodes to say they are preempted too
# (SLURM and cloud preemption signal every node at once) before it hands the job over
PREEMPT_SETTLE = 1.0
# seconds the launcher lets the other workers of an elastic round go on after one left
# it (its collectives failed) while every process still runs, before ending the round
PARKED_SETTLE = 10.0


@dataclass
class Ledger:
    """What node 0 counts over the whole job."""

    runs: int = 0               # rounds started before this one (DG_RESTART)
    restarts: int = 0           # of --max-restarts, used by failures and lost nodes
    reformations: int = 0       # times the set of nodes changed (DG_REFORMATION)
    checkpoint: tuple[int, int] | None = None   # the newest, (epoch, step)
    stops: int = 0              # stop requests made (each has its number)
    preempts: list[int] = field(default_factory=list)   # preemptions heard between rounds
    told_flag: bool = False     # said which flag recovers a State in memory


class JobView:
    """What the supervisor sees: this node's ranks and the latest reports of the
    others; and the way its verdicts and requests reach every node."""

    def __init__(self, node: Node, links: dict[int, Link], out):
        self.node, self.links, self.out = node, links, out
        self.remote: dict[int, Status] = {n: Status() for n in links}
        self.lost: list[int] = []
        self.preempted: list[int] = []
        self.hint = 0
        self._stacks: dict[int, str] = {}
        # where the other nodes' step records go: observe.Observation.incoming when the
        # launcher's output is the job's observation
        self._on_steps = getattr(out, "incoming", None)

    def pump(self, timeout: float = 0.0) -> None:
        """Take in every message that has arrived from the other nodes."""
        limit = time.monotonic() + timeout
        while True:
            got = False
            for n, link in self.links.items():
                try:
                    wire = link.inbox.get_nowait()
                except queue.Empty:
                    continue
                got = True
                message = None if wire is None else from_node(wire)
                if wire is None:
                    if n not in self.lost:
                        self.lost.append(n)
                elif isinstance(message, Status):
                    # when the link's reader took it in (or a later message): the
                    # arrival as close as it is known, for the clocks' offset (observe.py)
                    self.remote[n] = dataclasses.replace(message, received=link.last_heard)
                    if message.steps and self._on_steps is not None:
                        self._on_steps(message.steps, self.remote[n].received)
                elif isinstance(message, StacksFound):
                    self._stacks.update(message.found)
                elif isinstance(message, Preempt) and n not in self.preempted:
                    self.preempted.append(n)
            if not got and time.monotonic() >= limit:
                return
            if not got:
                time.sleep(0.02)

    def await_preemptions(self, seconds: float) -> None:
        """Take in messages for up to ``seconds``, until every other node has said it
        is preempted (or is lost): the host's own preemption can end a round (a
        checkpoint right after the signal) before the others' notices arrive."""
        limit = time.monotonic() + seconds
        while time.monotonic() < limit and \
                not set(self.links) <= set(self.preempted) | set(self.lost):
            self.pump(0.05)

    def states(self) -> list[dict]:
        """Every rank's state; ``left_at`` is when it left on this launcher's monotonic
        clock (the reporting host's age of the news, subtracted from when it arrived
        here): no two hosts' clocks are ever compared."""
        now = time.monotonic()
        states = self.node.states(self.hint)
        for s in states:
            s["left_at"] = None if s["left_age"] is None else now - s["left_age"]
        for n in sorted(self.remote):
            status = self.remote[n]
            received = now if status.received is None else status.received
            for s in status.states:
                s["left_at"] = (None if s.get("left_age") is None
                                else received - s["left_age"])
                states.append(s)
        low = min((s["count"] for s in states), default=0)
        if low != self.hint:
            self.hint = low
            self.broadcast(Hint(low))
        return sorted(states, key=lambda s: s["rank"])

    def broadcast(self, message: Message) -> None:
        channel.broadcast(self.links.values(), message)

    def set_verdicts(self, verdicts: dict[int, int]) -> None:
        self.node.set_verdicts(verdicts)
        self.broadcast(Verdicts(verdicts))

    def stacks(self, ranks: list[int]) -> dict[int, str]:
        self._stacks = {}
        self.broadcast(StacksRequest(ranks))
        found = self.node.stacks(ranks)
        remote = [r for r in ranks if r not in found
                  and r not in self.node.ranks]
        limit = time.monotonic() + 3.0
        while remote and time.monotonic() < limit and not all(r in self._stacks
                                                              for r in remote):
            self.pump(0.1)
        found.update({r: self._stacks[r] for r in remote if r in self._stacks})
        return found

    def process_report(self) -> list[str]:
        """Lines naming this node's processes of the job that do not run: stopped
        (SIGSTOP, a debugger) or in uninterruptible sleep (a stuck disk or mount)."""
        return self.node.process_report()

    def service_failure(self, workers_running: bool) -> str | None:
        report = self.node.service_failure(workers_running)
        if report:
            return report
        return next((r.service_failure for r in self.remote.values()
                     if r.service_failure), None)

    def services_ended(self) -> bool:
        return self.node.services_ended() and all(r.services_ended
                                                  for r in self.remote.values())

    def say(self, text: str) -> None:
        self.out.say(text)


class RoundWatch:
    """Node 0's loop over one running round, until it ends."""

    def __init__(self, config: LaunchConfig, formation: Formation, view: JobView,
                 preemption: Preemption | None, ledger: Ledger):
        self.config, self.formation, self.view = config, formation, view
        self.preemption, self.ledger = preemption, ledger
        self.supervisor = Supervisor(view, config.stall_warning, config.stall_timeout)
        self.stop: StopRequest | None = None
        self.saves = 0              # checkpoints rank 0 has saved, as its record counts
        self._parked_since: float | None = None    # a running worker left the round

    def watch(self, deadline: float | None) -> RoundEnd:
        config, view = self.config, self.view
        services_by, next_tick = None, 0.0
        while True:
            view.pump()
            now = time.monotonic()
            if now >= next_tick:
                next_tick = now + config.heartbeat
                view.broadcast(Tick(time.monotonic()))
                self.formation.tick_waiting()
            view.lost.extend(n for n, link in view.links.items()
                             if link.gone(config.silence_limit) and n not in view.lost)
            if view.lost:
                return RoundEnd(Outcome.LOST, 1, lost=tuple(view.lost))
            if config.elastic:
                self._planned_changes()
            states = view.states()
            self.formation.in_memory = policy.in_memory(states, self.formation.in_memory)
            if config.elastic and states and all(s["acked"] and s.get("parked")
                                                 for s in states):
                # workers that keep their processes agreed to stop at a commit and wait
                # for the next round (dist_gluon.elastic.run)
                return RoundEnd(Outcome.STOPPED, lost=self.stop.leaving if self.stop else ())
            if config.elastic:
                left = self._left_round(states, now)
                if left is not None:
                    return left
            self._note_checkpoint(states)
            self._tell_flag(states)
            running = any(s["returncode"] is None for s in states)
            failure = view.service_failure(running)
            if failure:
                return RoundEnd(Outcome.FAILED, 1, failure)
            verdict = self.supervisor.check(states)
            if verdict is not None and not verdict.ok:
                return RoundEnd(Outcome.FAILED, verdict.status, verdict.report)
            if verdict is not None and verdict.ok:
                services_by = services_by or time.monotonic() + SERVICE_GRACE
                if view.services_ended() or time.monotonic() > services_by:
                    if config.elastic and states and all(s["acked"] for s in states):
                        # asked by the launcher, or by SIGTERM to the workers themselves
                        return RoundEnd(Outcome.STOPPED,
                                        lost=self.stop.leaving if self.stop else ())
                    return RoundEnd(Outcome.DONE)
            if self.stop is not None:
                end = self.stop.ended(self.saves, any(s["acked"] for s in states),
                                      time.monotonic())
                if end is not None:
                    return end
            if deadline is not None and time.monotonic() > deadline:
                still = [f"{s['rank']}" for s in states if s["returncode"] is None]
                return RoundEnd(Outcome.TIMEOUT, 124, f"timeout after {config.timeout:g} s. "
                                f"Ranks still running: {', '.join(still) or 'none'}")
            time.sleep(0.05)

    def _left_round(self, states: list[dict], now: float) -> RoundEnd | None:
        """Workers that keep their processes leave a round when its collectives fail
        (dist_gluon.elastic.run parks them until the next round). When a worker died
        the supervisor ends the round; when every worker still runs (a connection
        between them was reset, say), nothing else would, and the parked workers would
        wait forever. So the round ends here as a failure, once every running worker
        has left it, or PARKED_SETTLE seconds after the first did (the launcher's end
        then breaks the others' collectives), and the job re-forms around the same
        processes from their last commits."""
        if not states or any(s["returncode"] is not None for s in states):
            self._parked_since = None
            return None
        number = self.view.node.spec.restart
        parked = [s for s in states if s.get("parked_round") == number and not s["acked"]]
        if not parked:
            self._parked_since = None
            return None
        if self._parked_since is None:
            self._parked_since = now
        if len(parked) < len(states) and now - self._parked_since < PARKED_SETTLE:
            return None
        ranks = ", ".join(str(s["rank"]) for s in parked)
        return RoundEnd(Outcome.FAILED, 1, (
            f"the collectives of rank{'s' if len(parked) > 1 else ''} {ranks} failed while "
            f"every worker still ran (no process was lost: a connection between the "
            f"workers broke, a peer stopped running, or a peer's collective library "
            f"failed); their last lines name the error"))

    def _tell_flag(self, states: list[dict]) -> None:
        """A script that holds a dist_gluon.elastic.State in a job that is not elastic
        would restart from its start at a failure, silently ignoring the State: say
        once, as its workers start, which flag recovers it in memory."""
        if self.ledger.told_flag or self.config.elastic:
            return
        holding = [s["rank"] for s in states if s.get("holds_state")]
        if not holding:
            return
        self.ledger.told_flag = True
        self.view.say(f"rank {holding[0]} keeps a dist_gluon.elastic.State under "
                      f"dist_gluon.elastic.run, but {state_not_recovered(self.config)}")

    def _planned_changes(self) -> None:
        """Elastic: nodes waiting to join, or a preempted node, ask the workers to stop
        at their next step boundary."""
        formation = self.formation
        formation.watch_waiting()
        if formation.take_joiners() and self.stop is None and formation.waiting:
            self._request_stop("admit", None, None)
        preempted = self._preempted()
        if preempted is not None and (self.stop is None or self.stop.reason == "admit"):
            self._request_stop("preempt", preempted, self.config.preempt_grace)

    def _preempted(self) -> int | None:
        """The node whose launcher got SIGTERM (the host's own first), if any."""
        if self.preemption is not None and self.preemption.at is not None:
            return self.formation.rank
        return self.view.preempted[0] if self.view.preempted else None

    def _request_stop(self, reason: str, node: int | None, grace: float | None) -> None:
        self.ledger.stops += 1
        self.stop = StopRequest(self.ledger.stops, reason, node, self.saves,
                                None if grace is None else time.monotonic() + grace)
        self.view.node.request_stop(self.stop.number)
        self.view.broadcast(Stop(self.stop.number))
        if reason == "preempt":
            what = ("to stop at its next commit" if self.formation.in_memory
                    else "for a checkpoint at its next step boundary")
            self.view.say(f"{self.formation.who(node)} is preempted (SIGTERM): asking every "
                          f"worker {what} (within --preempt-grace "
                          f"{self.config.preempt_grace:g} s)")

    def _note_checkpoint(self, states: list[dict]) -> None:
        """The newest checkpoint of the job, from rank 0's record; its save count."""
        first = states[0] if states else None
        if first is None or not first.get("saved") or first["saved"][0] <= self.saves:
            return
        count, epoch, step = first["saved"]
        self.ledger.checkpoint = (epoch, step)
        self.saves = count
        # the node that takes over, should this one be lost, names it
        self.view.broadcast(Saved(epoch, step))


def state_not_recovered(config: LaunchConfig) -> str:
    """Why a job that is not elastic does not recover a State in memory at a failure,
    and what does."""
    if config.transport == "mpi":
        return (f"--transport mpi {_restarts(config)}: mpirun starts a fixed set of ranks, "
                "which cannot re-form around live ones. Use --transport gloo (with "
                "--max-restarts R) for recovery in memory.")
    if not config.max_restarts:
        return ("without --max-restarts a failure ends the job. Start the launcher with "
                "--max-restarts R to recover from the State's last commit in memory.")
    return (f"this job is not elastic: {_restarts(config)}. Start the launchers with "
            "--nnodes MIN:MAX (e.g. --nnodes N:N for N nodes) for recovery in memory.")


def _restarts(config: LaunchConfig) -> str:
    if not config.max_restarts:
        return "a failure ends the job"
    return (f"--max-restarts {config.max_restarts} restarts every worker from the "
            "script's start (or its last checkpoint), not from the State's last commit")
