"""The job's host: node 0's launcher, or the node's launcher that took over from a lost
host (succession.py). It gathers the nodes, runs the rounds and decides after each (the
job loop is described in job.py; the decisions are policy.py's)."""
from __future__ import annotations

import dataclasses
import queue
import secrets
import signal
import time

from . import channel, policy, secret
from .channel import Beating, JoinError, Link, refuse
from .config import LaunchConfig
from .formation import Formation
from .job import Interrupted, Preemption, check_multinode_host
from .node import Node, free_port
from .policy import Decision, Outcome, RoundEnd, Standing
from .protocol import End, News, Preempt, RoundSpec, Start, Stopped, Tick, from_node
from .rounds import PREEMPT_SETTLE, JobView, Ledger, RoundWatch
from .succession import Takeover

STATIC_CONFIRM = 15.0   # seconds the nodes of a static job get to confirm their end


class Master:
    """The job's host: gathers the nodes, runs the rounds, decides after each. With a
    ``takeover`` it is a node that took over from the lost host: its ``config`` names
    this node's address and port as the master's."""

    def __init__(self, config: LaunchConfig, out, preemption: Preemption | None,
                 takeover: Takeover | None = None, kept: Node | None = None,
                 memory: bool = False):
        self.config, self.out, self.preemption = config, out, preemption
        self.takeover = takeover
        self.formation = Formation(config, out, preemption,
                                   takeover.listener if takeover else None)
        self.ledger = Ledger()
        # the address the host listens on for the other nodes (and Gloo's rendezvous)
        self.listen_addr = ""
        # the node ranks of the last round, when each node knows every other's address
        self.last_formation: tuple[int, ...] = ()
        # this node's processes of the round before, kept for the next (keep_workers)
        self.kept = kept
        # the workers of the round before kept their state in memory
        # (dist_gluon.elastic.run): in their processes, or in their nodes' shared memory
        self.memory = memory
        # names each node's copy of the state in memory: the same for the whole job
        self.job = (takeover.spec.job if takeover is not None and takeover.spec.job
                    else secrets.token_hex(8))

    # ------------------------------------------------------------------ the job
    def run(self) -> int:
        config = self.config
        if self.takeover is not None:
            self.listen_addr = channel.listen_address(config.master_addr)
            status = self._take_over()
            if status is not None:
                if self.kept is not None:
                    self.kept.terminate()
                self.formation.close()
                return status
        elif config.several_nodes:
            problem = check_multinode_host(config)
            if problem:
                self.out.say(problem)
                return 1
            self.listen_addr = channel.listen_address(config.master_addr)
            try:
                self.formation.gather(self.listen_addr)
            except JoinError as err:
                self.out.say(str(err))
                return 1
        deadline = None if config.timeout is None else time.monotonic() + config.timeout
        try:
            while True:
                spec, problem = self._spec()
                if problem:
                    self.formation.refuse_all(problem)
                    self.out.say(problem)
                    time.sleep(0.5)     # the links' writers deliver it before they close
                    return 2 if self.ledger.runs == 0 else 1
                status = self._round(spec, deadline)
                if status is not None:
                    return status
                self.ledger.runs += 1
        finally:
            if self.kept is not None:
                self.kept.terminate()
            self.formation.close()

    def _standing(self) -> Standing:
        config, formation, ledger = self.config, self.formation, self.ledger
        return Standing(
            elastic=config.elastic, min_nodes=config.min_nodes, max_nodes=config.max_nodes,
            max_restarts=config.max_restarts, restarts=ledger.restarts,
            reformations=ledger.reformations, nodes=1 + len(formation.members),
            waiting=len(formation.waiting), workers=formation.workers(),
            checkpoint=ledger.checkpoint, preempt_grace=config.preempt_grace,
            names=formation.names(), host=formation.rank,
            formation=self.last_formation, memory=self.memory)

    # ------------------------------------------------------------------ a takeover
    def _take_over(self) -> int | None:
        """Host the job after its host was lost: gather the last formation's other
        nodes, and go on with a quorum of it (policy.decide); the exit status when the
        job ends here instead."""
        takeover, formation, ledger = self.takeover, self.formation, self.ledger
        spec, config = takeover.spec, self.config
        formation.known = {n: (f"node {n} ({h})" if h else f"node {n}")
                           for n, h in zip(spec.nodes, spec.hosts)}
        last = [n for n in spec.nodes if not (takeover.planned and n == spec.host)]
        formation.gather_survivors(set(last) - {formation.rank, spec.host},
                                   takeover.gather_timeout(config))
        ledger.runs, ledger.reformations = spec.restart + 1, spec.reformation
        ledger.restarts, ledger.checkpoint = spec.restarts or 0, takeover.checkpoint
        here = {formation.rank, *formation.members}
        lost = tuple(n for n in last if n not in here)
        reports = [] if takeover.planned else [takeover.report]
        reports += [f"{formation.who(n)} lost: it did not reach the new host within "
                    f"{takeover.gather_timeout(config):g} s" for n in lost
                    if n != spec.host]
        end = (RoundEnd(Outcome.LOST, 1, "\n".join(reports), lost=lost) if lost
               else RoundEnd(Outcome.STOPPED))
        self.last_formation = tuple(last)
        standing = dataclasses.replace(self._standing(), nodes=len(last))
        decision = policy.decide(end, standing)
        took = (f"{formation.who(formation.rank)} takes over as the job's host at "
                f"{config.master_addr}:{config.master_port} ({len(here)} of the last "
                f"formation's {policy.plural(len(last), 'node')} reached it)")
        if not decision.again:
            return self._end_job("\n".join(r for r in (took, decision.report) if r),
                                 decision.status, decision.report)
        if decision.restart:
            ledger.restarts += 1
        ledger.reformations += 1
        formation.admit_waiting()
        news = "\n".join(r for r in (decision.report, took,
                                     policy.formation_news(end, self._standing(), True,
                                                           keep=self.kept is not None))
                         if r)
        self.out.say(news)
        channel.broadcast([p.link for p in formation.members.values()], News(news))
        return None

    # ------------------------------------------------------------------ one round
    def _spec(self) -> tuple[RoundSpec, str | None]:
        """The next round's spec, the same on every node; or why no round can start."""
        config, formation = self.config, self.formation
        order = formation.order()
        slots, servers = formation.layout()
        port = free_port("" if config.several_nodes else "127.0.0.1")
        horovod = config.backend == "horovod"
        master_addr = config.master_addr or "127.0.0.1"
        addresses = formation.addresses(
            self.listen_addr or master_addr, config.master_port) if config.elastic \
            and config.several_nodes else None
        spec = RoundSpec(
            backend=config.backend, nnodes=len(order), nodes=order,
            nproc=config.num_workers, servers=config.servers, restart=self.ledger.runs,
            reformation=self.ledger.reformations, elastic=config.elastic,
            master_addr=master_addr, transport=config.transport,
            hosts=[formation.hello.host] + [formation.members[n].host for n in order[1:]],
            slots=slots, server_counts=servers,
            rendezvous_port=port if horovod else None,
            scheduler_port=None if horovod else port,
            addresses=addresses,
            restarts=self.ledger.restarts if addresses else None,
            keep=True if self.kept is not None else None,
            memory=True if self.memory and self.kept is None else None,
            job=self.job if config.elastic else None)
        return spec, policy.round_problem(slots, servers, config.backend)

    def _round(self, spec: RoundSpec, deadline: float | None) -> int | None:
        """Run one round; the launcher's exit status, or None to run another."""
        config, formation = self.config, self.formation
        rendezvous = None
        if spec.backend == "horovod":
            # here, not at the top: http.server (with http.client, ssl and email) is a
            # quarter of the launcher's start, and only the job's host serves it
            from .rendezvous import GlooRendezvous
            rendezvous = GlooRendezvous(
                (self.listen_addr or "0.0.0.0") if config.several_nodes else "127.0.0.1",
                spec.rendezvous_port, secret.rendezvous_token(config.job_secret,
                                                              spec.to_wire()),
                self.out.say)
            rendezvous.start()
        node, self.kept = Node(config, 0, spec, self.kept), None
        self.last_formation = tuple(spec.nodes) if spec.addresses else ()
        links = {n: p.link for n, p in formation.members.items()}
        view = JobView(node, links, self.out)
        view.preempted = [n for n in self.ledger.preempts if n in links]
        self.ledger.preempts = []
        watch = RoundWatch(config, formation, view, self.preemption, self.ledger)
        end = RoundEnd(Outcome.ERROR, 1)
        try:
            channel.broadcast(links.values(), Start(spec))
            node.start()
            end = watch.watch(deadline)
            if end.outcome is Outcome.STOPPED and formation.rank in end.lost:
                # whether the host hands the job over depends on who else is preempted
                view.await_preemptions(PREEMPT_SETTLE)
        except Interrupted as stop:
            end = RoundEnd(Outcome.INTERRUPTED, 128 + stop.signum,
                           f"interrupted by {signal.Signals(stop.signum).name}")
        finally:
            states = view.states()
            self.memory = config.elastic and policy.in_memory(states, self.memory)
            decision, end = self._decide(end, tuple(view.preempted))
            keep = keep_workers(config, spec, end, decision, states)
            unconfirmed = self._end_round(node, end, decision, keep)
            if rendezvous is not None:
                rendezvous.stop()
        if decision.handover:
            formation.end_waiting(1, "the job's host left; start this node again with "
                                     "the new host's address to join")
            return decision.status
        if not decision.again:
            formation.end_waiting(decision.status, decision.report)
            return decision.status
        return self._next_formation(unconfirmed, end)

    def _decide(self, end: RoundEnd,
                preempted: tuple[int, ...] = ()) -> tuple[Decision, RoundEnd]:
        """Apply policy.decide: count the restart, let the lost nodes go."""
        formation = self.formation
        if end.outcome is Outcome.LOST and self.config.elastic:
            end = end._replace(report="; ".join(formation.lost_reason(n) for n in end.lost))
        decision = policy.decide(end, dataclasses.replace(self._standing(),
                                                          preempted=preempted))
        if end.outcome is Outcome.LOST and self.config.elastic:
            for n in end.lost:
                formation.drop(n).link.close(flush=0)
        if decision.restart:
            self.ledger.restarts += 1
        return decision, end

    def _end_round(self, node: Node, end: RoundEnd, decision: Decision,
                   keep: bool = False) -> list[int]:
        """Tell every node how the round ends, end this node's processes (``keep``: but
        its workers that keep theirs, for the next round) and wait for the others' to
        end; the nodes that did not confirm."""
        config, formation = self.config, self.formation
        terminated = policy.terminated(end, decision)
        grace = policy.kill_grace(end, decision, config.elastic)
        for n, peer in formation.members.items():
            if n in decision.leaving:
                peer.link.send(End(0, False, decision.leaving[n]))
            else:
                peer.link.send(End(decision.status, decision.again, decision.report,
                                   terminated, grace, decision.handover or None,
                                   keep or None))
        if decision.report:
            # workers kept for the next round are not terminated (elastic.run's re-formation)
            self.out.say(decision.report + "\nterminated the rest of the job."
                         if terminated and not keep else decision.report)
        # a lost node cannot confirm anything: waiting for it held a static job's end
        # for the whole confirmation time
        gone = set(decision.leaving) | (set(end.lost) if end.outcome is Outcome.LOST
                                        else set())
        with Beating([p.link for p in formation.members.values()]
                     + [p.link for p in formation.waiting.values()], config.heartbeat, Tick()):
            # ending processes can take longer than --silence-limit (SIGTERM, then
            # SIGKILL after the grace): the other nodes go on hearing from the host
            if keep:
                node.end_round()
                self.kept = node
            else:
                node.terminate(grace)
            unconfirmed = _wait_stopped({n: p.link for n, p in formation.members.items()
                                         if n not in gone}, self.out,
                                        config.silence_limit if config.elastic
                                        else STATIC_CONFIRM, self.ledger.preempts, grace)
        for n in decision.leaving:
            formation.drop(n)
        return unconfirmed

    def _end_job(self, report: str, status: int, waiting_report: str | None) -> int:
        """End the job from this host: every member is told ``report`` and exits with
        ``status``, the waiting nodes are turned away (``waiting_report``, None: the
        job finished); the launcher's exit status."""
        for peer in self.formation.members.values():
            refuse(peer.link, report, status=status)
        self.formation.end_waiting(status, waiting_report)
        self.out.say(report)
        return status

    def _next_formation(self, unconfirmed: list[int], end: RoundEnd) -> int | None:
        """After a round that runs again: drop the nodes that did not confirm, admit
        the waiting ones, say what happens; or end the job when too few remain."""
        config, formation = self.config, self.formation
        if not config.elastic:
            self.out.say(policy.formation_news(end, self._standing(), changed=False))
            return None
        before = set(formation.members) | set(end.lost)
        for n in unconfirmed:
            self.out.say(f"{formation.drop(n)} did not confirm that its processes "
                         "ended: it leaves the job")
        here = {formation.rank, *formation.members}
        if unconfirmed and self.last_formation and \
                not policy.quorum(here, self.last_formation):
            # the nodes lost one after the other: the first loss left a quorum, the
            # silent ones dropped now do not, and they may be electing a host of their own
            report = policy.minority(here, self.last_formation, formation.who)
            return self._end_job(report, 1, report)
        formation.admit_waiting()
        count = 1 + len(formation.members)
        if count < config.min_nodes:
            return self._end_job(policy.too_few(count, self._standing()), 1, None)
        changed = set(formation.members) != before
        if changed:
            self.ledger.reformations += 1
        message = policy.formation_news(end, self._standing(), changed,
                                        keep=self.kept is not None)
        self.out.say(message)
        channel.broadcast([p.link for p in formation.members.values()], News(message))
        return None


def keep_workers(config: LaunchConfig, spec: RoundSpec, end: RoundEnd,
                 decision: Decision, states: list[dict]) -> bool:
    """Whether the next round keeps the workers' processes: an elastic horovod job over
    Gloo whose every worker runs under dist_gluon.elastic.run (its record says so)
    re-forms around the live ones after a lost node, a failed rank or a planned change;
    new workers then get the state from them. Other jobs restart every worker."""
    return bool(config.elastic and decision.again and not decision.handover
                and spec.backend == "horovod" and spec.transport == "gloo"
                and end.outcome in (Outcome.LOST, Outcome.FAILED, Outcome.STOPPED)
                and states and all(s.get("keeps") for s in states))


def _wait_stopped(links: dict[int, Link], out, timeout: float, preempted: list[int],
                  grace: float) -> list[int]:
    """Wait for each node to confirm its processes ended; the nodes that did not. A node
    that goes on beating while its processes end (SIGTERM, SIGKILL after ``grace``) gets
    up to ``grace`` + ``timeout``; one that falls silent for ``timeout`` is given up. A
    preemption reported meanwhile is added to ``preempted``."""
    limit = time.monotonic() + grace + timeout
    missing = []
    for n, link in links.items():
        confirmed = False
        while not confirmed and time.monotonic() < limit and not link.gone(timeout):
            try:
                wire = link.receive(timeout=0.2)
            except queue.Empty:
                continue
            if wire is None:
                break
            message = from_node(wire)
            if isinstance(message, Preempt) and n not in preempted:
                preempted.append(n)
            confirmed = isinstance(message, Stopped)
        if not confirmed:
            out.say(f"node {n} did not confirm that its processes ended")
            missing.append(n)
    return missing
