"""The job loop: node 0's launcher (the master) runs the job in rounds, and every other
node's launcher (an agent) runs each round's processes on its machine.

A round is one start of every worker (and ps-lite's scheduler and servers) on the
nodes of the current *formation*. It ends when every worker has finished (the job is
done), when a rank fails, when a node is lost (its launcher's connection closed or went
silent for --silence-limit) or when the job stops at a step boundary for a planned
change (a node is preempted, or a node waits to join). Then the master decides:

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

Node 0 hosts the rendezvous (the launchers' channel, Gloo's rendezvous, ps-lite's
scheduler), as torchrun's static rendezvous does: its loss ends the job on every node
(each node's launcher says so), and its preemption ends the job after a checkpoint.
"""
from __future__ import annotations

import ipaddress
import queue
import signal
import socket
import time

from . import channel, jobenv, secret
from .channel import JoinError, Link, Listener, connect_to_master, refuse
from .node import Node, free_port
from .processes import TERM_GRACE
from .rendezvous import GlooRendezvous
from .supervisor import Supervisor

SERVICE_GRACE = 10.0    # seconds ps-lite's scheduler and servers get after the workers
STATUS_EVERY = 0.1      # seconds between a node's status reports
CHECKPOINT_EXIT = 5.0   # seconds workers get to exit after the checkpoint of a stop
KILL_GRACE = 0.5        # seconds between SIGTERM and SIGKILL when an elastic job re-forms


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


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


class _Peer:
    """Another node's launcher: its link and what it said in its hello."""

    def __init__(self, node: int, link: Link, hello: dict):
        self.node, self.link, self.hello = node, link, hello
        self.host = hello["host"]

    def __str__(self):
        return f"node {self.node} ({self.host})"


class _Outcome:
    """How a round ended: kind is done, failed, lost, stopped, timeout, interrupted, or
    error (the round could not start)."""

    def __init__(self, kind: str, status: int = 0, report: str | None = None,
                 lost: list[int] | None = None, late: bool = False):
        self.kind, self.status, self.report = kind, status, report
        # stopped: whether the workers missed --preempt-grace
        self.lost, self.late = lost or [], late


class _Stop:
    """A pending request that every worker stop at its next step boundary."""

    def __init__(self, number: int, reason: str, node: int | None, grace: float | None,
                 saves: int):
        self.number, self.reason, self.node = number, reason, node
        self.deadline = None if grace is None else time.monotonic() + grace
        self.saves = saves              # checkpoints rank 0 had saved when asked
        self.saved_at: float | None = None


# ---------------------------------------------------------------------- node 0
class _JobView:
    """What the supervisor sees: this node's ranks and the latest reports of the
    others; and the way its verdicts and requests reach every node."""

    def __init__(self, node: Node, links: dict[int, Link], out):
        self.node, self.links, self.out = node, links, out
        self.remote: dict[int, dict] = {n: {"states": [], "service_failure": None,
                                            "services_ended": False} for n in links}
        self.lost: list[int] = []
        self.preempted: list[int] = []
        self.hint = 0
        self._stacks: dict[int, str] = {}

    def pump(self, timeout: float = 0.0) -> None:
        """Take in every message that has arrived from the other nodes."""
        limit = time.monotonic() + timeout
        while True:
            got = False
            for n, link in self.links.items():
                try:
                    message = link.inbox.get_nowait()
                except queue.Empty:
                    continue
                got = True
                if message is None:
                    if n not in self.lost:
                        self.lost.append(n)
                elif message["type"] == "status":
                    message["received"] = time.monotonic()
                    self.remote[n] = message
                elif message["type"] == "stacks":
                    self._stacks.update({int(r): t for r, t in message["found"].items()})
                elif message["type"] == "preempt" and n not in self.preempted:
                    self.preempted.append(n)
            if not got and time.monotonic() >= limit:
                return
            if not got:
                time.sleep(0.02)

    def states(self) -> list[dict]:
        """Every rank's state; ``left_at`` is when it left on this launcher's monotonic
        clock (the reporting host's age of the news, subtracted from when it arrived
        here): no two hosts' clocks are ever compared."""
        now = time.monotonic()
        states = self.node.states(self.hint)
        for s in states:
            s["left_at"] = None if s["left_age"] is None else now - s["left_age"]
        for n in sorted(self.remote):
            received = self.remote[n].get("received", now)
            for s in self.remote[n]["states"]:
                s["left_at"] = (None if s.get("left_age") is None
                                else received - s["left_age"])
                states.append(s)
        low = min((s["count"] for s in states), default=0)
        if low != self.hint:
            self.hint = low
            self.broadcast({"type": "hint", "low": low})
        return sorted(states, key=lambda s: s["rank"])

    def broadcast(self, message: dict) -> None:
        for link in self.links.values():
            link.send(message)

    def set_verdicts(self, verdicts: dict[int, int]) -> None:
        self.node.set_verdicts(verdicts)
        self.broadcast({"type": "verdicts", "verdicts": verdicts})

    def stacks(self, ranks: list[int]) -> dict[int, str]:
        self._stacks = {}
        self.broadcast({"type": "stacks", "ranks": ranks})
        found = self.node.stacks(ranks)
        remote = [r for r in ranks if r not in found
                  and r not in self.node.ranks]
        limit = time.monotonic() + 3.0
        while remote and time.monotonic() < limit and not all(r in self._stacks
                                                              for r in remote):
            self.pump(0.1)
        found.update({r: self._stacks[r] for r in remote if r in self._stacks})
        return found

    def service_failure(self, workers_running: bool) -> str | None:
        report = self.node.service_failure(workers_running)
        if report:
            return report
        return next((r["service_failure"] for r in self.remote.values()
                     if r.get("service_failure")), None)

    def services_ended(self) -> bool:
        return self.node.services_ended() and all(r.get("services_ended")
                                                  for r in self.remote.values())

    def say(self, text: str) -> None:
        self.out.say(text)


def check_multinode_host(args) -> str | None:
    """Gloo across nodes needs this host's name to resolve to a reachable address,
    unless node 0's address is a loopback one: then every node runs on this machine
    (several launchers on one host, to try a multi-node job out)."""
    if args.backend != "horovod" or _on_loopback(args.master_addr):
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


class Master:
    """Node 0's launcher: gathers the nodes, runs the rounds, decides after each."""

    def __init__(self, args, out, preemption: Preemption | None):
        self.args, self.out, self.preemption = args, out, preemption
        self.elastic = args.elastic
        self.members: dict[int, _Peer] = {}
        self.waiting: dict[int, _Peer] = {}
        self.listener: Listener | None = None
        self.hello = {"node": 0, "host": socket.gethostname(), "nproc": args.num_workers,
                      "servers": args.servers}
        self.runs = 0               # rounds started before this one (DG_RESTART)
        self.restarts = 0           # of --max-restarts, used by failures and lost nodes
        self.reformations = 0       # times the set of nodes changed (DG_REFORMATION)
        self.checkpoint: tuple[int, int] | None = None   # the newest, (epoch, step)
        self._stops = 0
        self._preempts: list[int] = []     # preemptions heard between rounds

    # ------------------------------------------------------------------ the job
    def run(self) -> int:
        args = self.args
        if args.max_nodes > 1:
            problem = check_multinode_host(args)
            if problem:
                self.out.say(problem)
                return 1
            args.listen_addr = channel.listen_address(args.master_addr)
            try:
                self._gather()
            except JoinError as err:
                self.out.say(str(err))
                return 1
        deadline = None if args.timeout is None else time.monotonic() + args.timeout
        try:
            while True:
                spec, problem = self._spec()
                if problem:
                    for peer in self._peers():
                        refuse(peer.link, problem)
                    self.out.say(problem)
                    time.sleep(0.5)     # the links' writers deliver it before they close
                    return 2 if self.runs == 0 else 1
                status = self._round(spec, deadline)
                if status is not None:
                    return status
                self.runs += 1
        finally:
            for peer in self._peers():
                peer.link.close()
            if self.listener is not None:
                self.listener.close()

    def _peers(self) -> list[_Peer]:
        return list(self.members.values()) + list(self.waiting.values())

    def _gather(self) -> None:
        """Wait for the other nodes: all of them (static), or MIN and then any more that
        join within --last-call of the previous one, up to MAX (elastic)."""
        args = self.args
        self.out.say(f"waiting for {self._wanted()} on port {args.master_port}")
        if not self.elastic:
            joined = channel.accept_nodes(args.master_port, args.nnodes, args.join_timeout,
                                          self.out.say, args.job_secret, args.listen_addr)
            self.members = {n: _Peer(n, link, hello) for n, (link, hello) in joined.items()}
            return
        self.listener = Listener(args.master_port, args.job_secret, self.out.say,
                                 args.listen_addr, args.max_nodes)
        limit = time.monotonic() + args.join_timeout
        last_join, next_tick = time.monotonic(), 0.0
        while True:
            if self.preemption is not None and self.preemption.at is not None:
                raise Interrupted(signal.SIGTERM)
            if self._take_joiners(self.members):
                last_join = time.monotonic()
            for n in [n for n, p in self.members.items() if p.link.closed
                      or p.link.gone(args.silence_limit)]:
                self.out.say(f"{self.members.pop(n)} left before the job started")
            now = time.monotonic()
            if now >= next_tick:
                next_tick = now + args.heartbeat
                for peer in self.members.values():
                    peer.link.send({"type": "tick"})
            count = len(self.members) + 1
            if count >= args.max_nodes or (count >= args.min_nodes
                                           and now - last_join >= args.last_call):
                return
            if now > limit:
                for peer in self.members.values():
                    refuse(peer.link, f"only {_plural(count, 'node')} of at least "
                                      f"{args.min_nodes} joined; the job did not start")
                raise JoinError(
                    f"only {_plural(count, 'node')} joined within --join-timeout "
                    f"{args.join_timeout:g} s, fewer than the minimum {args.min_nodes} of "
                    f"--nnodes {args.min_nodes}:{args.max_nodes} (start the launcher on "
                    f"more machines with --master-addr {args.master_addr} --master-port "
                    f"{args.master_port})")
            time.sleep(0.05)

    def _wanted(self) -> str:
        args = self.args
        if not self.elastic:
            return f"{args.nnodes - 1} more node(s)"
        return (f"{args.min_nodes - 1} to {args.max_nodes - 1} more nodes (--nnodes "
                f"{args.min_nodes}:{args.max_nodes})")

    def _take_joiners(self, into: dict[int, _Peer]) -> bool:
        """Elastic: the launchers that joined since the last look, added to ``into``
        if the job has room and their node rank is free."""
        if self.listener is None:
            return False
        took = False
        for link, hello in self.listener.poll():
            node, args = hello.get("node"), self.args
            taken = {0, *self.members, *self.waiting}
            # a full job first: then every node rank is taken, which would say less
            if len(taken) >= args.max_nodes:
                refuse(link, f"the job already has its maximum of {args.max_nodes} nodes "
                             f"(--nnodes {args.min_nodes}:{args.max_nodes})")
                continue
            if not isinstance(node, int) or not 0 < node < args.max_nodes or node in taken:
                refuse(link, f"node rank {node} is taken or out of range [1, "
                             f"{args.max_nodes}) (nodes now in the job: "
                             f"{', '.join(map(str, sorted(taken)))}); give each machine "
                             "its own --node-rank")
                continue
            peer = into[node] = _Peer(node, link, hello)
            took = True
            count = len(taken) + 1
            if into is self.members:
                self.out.say(f"{peer} joined ({count} of at most {args.max_nodes} nodes)")
            else:
                self.out.say(f"{peer} joined; the job re-forms with {count} nodes at the "
                             "next step boundary the workers agree on "
                             "(dist_gluon.stop_requested()) or their next checkpoint")
        return took

    # ------------------------------------------------------------------ one round
    def _spec(self) -> tuple[dict, str | None]:
        """The next round's spec, the same on every node; or why no round can start."""
        args = self.args
        order = [0] + sorted(self.members)
        slots, servers = self._layout()
        problem = None
        if sum(slots) < 1:
            problem = "no node of this job runs workers (every node was given -n 0)"
        elif args.backend != "horovod" and sum(servers) < 1:
            problem = ("no node of this job runs a ps-lite server (every node was given "
                       "--servers 0): give the server nodes --servers S")
        spec = {"backend": args.backend, "nnodes": len(order), "nodes": order,
                "nproc": args.num_workers, "servers": args.servers, "restart": self.runs,
                "reformation": self.reformations, "elastic": self.elastic,
                "master_addr": args.master_addr or "127.0.0.1",
                "transport": args.transport,
                "hosts": [None] + [self.members[n].host for n in order[1:]],
                "slots": slots, "server_counts": servers}
        port = free_port("" if args.max_nodes > 1 else "127.0.0.1")
        spec["rendezvous_port" if args.backend == "horovod" else "scheduler_port"] = port
        return spec, problem

    def _round(self, spec: dict, deadline) -> int | None:
        """Run one round; the launcher's exit status, or None to run another."""
        args = self.args
        rendezvous = None
        if spec["backend"] == "horovod":
            rendezvous = GlooRendezvous(
                (args.listen_addr or "0.0.0.0") if args.max_nodes > 1 else "127.0.0.1",
                spec["rendezvous_port"], secret.rendezvous_token(args.job_secret, spec),
                self.out.say)
            rendezvous.start()
        node = Node(args, 0, spec)
        links = {n: p.link for n, p in self.members.items()}
        view = _JobView(node, links, self.out)
        view.preempted = [n for n in self._preempts if n in links]
        self._preempts = []
        supervisor = Supervisor(view, args.stall_warning, args.stall_timeout)
        outcome = _Outcome("error", 1)
        try:
            for link in links.values():
                link.send({"type": "start", "spec": spec})
            node.start()
            outcome = self._supervise(view, supervisor, deadline)
        except Interrupted as stop:
            outcome = _Outcome("interrupted", 128 + stop.signum,
                               f"interrupted by {signal.Signals(stop.signum).name}")
        finally:
            status, again, report, leaving = self._decide(outcome)
            # the job's processes were ended because something went wrong
            terminated = status != 0 and outcome.kind != "stopped" and (
                not again or outcome.kind == "failed")
            # an elastic job re-forming after a loss has its checkpoint on disk: workers
            # blocked in a collective with the lost node cannot run a SIGTERM handler,
            # so they get SIGKILL soon instead of after the usual grace
            grace = KILL_GRACE if self.elastic and again and outcome.kind in (
                "lost", "failed") else TERM_GRACE
            for n, peer in self.members.items():
                if n in leaving:
                    peer.link.send({"type": "end", "status": 0, "again": False,
                                    "report": leaving[n]})
                else:
                    peer.link.send({"type": "end", "status": status, "again": again,
                                    "report": report, "terminated": terminated,
                                    "grace": grace})
            if report:
                self.out.say(report + "\nterminated the rest of the job." if terminated
                             else report)
            node.terminate(grace)
            unconfirmed = _wait_stopped({n: p.link for n, p in self.members.items()
                                         if n not in leaving}, self.out,
                                        args.silence_limit if self.elastic else 15.0,
                                        self._preempts)
            for n in leaving:
                self.members.pop(n, None)
            if rendezvous is not None:
                rendezvous.stop()
        if not again:
            self._end_waiting(status, report)
            return status
        return self._next_formation(unconfirmed, outcome)

    def _supervise(self, view: _JobView, supervisor: Supervisor, deadline) -> _Outcome:
        args = self.args
        services_by, next_tick, stop, saves = None, 0.0, None, 0
        while True:
            view.pump()
            now = time.monotonic()
            if now >= next_tick:
                next_tick = now + args.heartbeat
                view.broadcast({"type": "tick"})
                for peer in self.waiting.values():
                    peer.link.send({"type": "tick"})
            view.lost.extend(n for n, link in view.links.items()
                             if link.gone(args.silence_limit) and n not in view.lost)
            if view.lost:
                return _Outcome("lost", 1, lost=list(view.lost))
            if self.elastic:
                self._watch_waiting()
                if self._take_joiners(self.waiting) and stop is None and self.waiting:
                    stop = self._request_stop(view, "admit", None, None, saves)
                preempted = self._preempted(view)
                if preempted is not None and (stop is None or stop.reason == "admit"):
                    stop = self._request_stop(view, "preempt", preempted,
                                              args.preempt_grace, saves)
            states = view.states()
            saves = self._note_checkpoint(states, saves)
            running = any(s["returncode"] is None for s in states)
            failure = view.service_failure(running)
            if failure:
                return _Outcome("failed", 1, failure)
            decision = supervisor.check(states)
            if decision is not None and decision[0] == "fail":
                return _Outcome("failed", decision[1], decision[2])
            if decision is not None and decision[0] == "ok":
                services_by = services_by or time.monotonic() + SERVICE_GRACE
                if view.services_ended() or time.monotonic() > services_by:
                    if self.elastic and states and all(s["acked"] for s in states):
                        # asked by the launcher, or by SIGTERM to the workers themselves
                        return _Outcome("stopped", lost=_nodes(stop))
                    return _Outcome("done")
            if stop is not None:
                if saves > stop.saves and stop.saved_at is None:
                    stop.saved_at = time.monotonic()
                # a script that never asks (no rank agreed to stop) ends right after its
                # checkpoint; one that asked gets a moment to exit by itself
                if stop.saved_at is not None and (
                        not any(s["acked"] for s in states)
                        or time.monotonic() - stop.saved_at > CHECKPOINT_EXIT):
                    return _Outcome("stopped", lost=_nodes(stop))
                if stop.deadline is not None and time.monotonic() > stop.deadline:
                    return _Outcome("stopped", lost=_nodes(stop), late=True)
            if deadline is not None and time.monotonic() > deadline:
                still = [f"{s['rank']}" for s in states if s["returncode"] is None]
                return _Outcome("timeout", 124, f"timeout after {args.timeout:g} s. "
                                f"Ranks still running: {', '.join(still) or 'none'}")
            time.sleep(0.05)

    def _preempted(self, view: _JobView) -> int | None:
        """The node whose launcher got SIGTERM (node 0's own first), if any."""
        if self.preemption is not None and self.preemption.at is not None:
            return 0
        return view.preempted[0] if view.preempted else None

    def _request_stop(self, view: _JobView, reason: str, node: int | None,
                      grace: float | None, saves: int) -> _Stop:
        self._stops += 1
        stop = _Stop(self._stops, reason, node, grace, saves)
        view.node.request_stop(stop.number)
        view.broadcast({"type": "stop", "number": stop.number})
        if reason == "preempt":
            who = self._who(node)
            self.out.say(f"{who} is preempted (SIGTERM): asking every worker for a "
                         f"checkpoint at its next step boundary (within --preempt-grace "
                         f"{self.args.preempt_grace:g} s)")
        return stop

    def _note_checkpoint(self, states: list[dict], saves: int) -> int:
        """The newest checkpoint of the job, from rank 0's record; its save count."""
        first = states[0] if states else None
        if first is None or not first.get("saved") or first["saved"][0] <= saves:
            return saves
        count, epoch, step = first["saved"]
        self.checkpoint = (epoch, step)
        return count

    def _watch_waiting(self) -> None:
        """Drop the waiting nodes that went away or were preempted before admission."""
        for n in list(self.waiting):
            peer, ended, preempted = self.waiting[n], False, False
            while True:
                try:
                    message = peer.link.inbox.get_nowait()
                except queue.Empty:
                    break
                ended = ended or message is None
                preempted = preempted or (message or {}).get("type") == "preempt"
            if preempted:
                refuse(peer.link, f"{peer} was preempted before it was admitted; it "
                                  "leaves", status=0)
                self.out.say(f"{peer} was preempted before it was admitted")
                del self.waiting[n]
            elif ended or peer.link.closed or peer.link.gone(self.args.silence_limit):
                self.out.say(f"{peer} left before it could be admitted")
                peer.link.close(flush=0)
                del self.waiting[n]

    def _who(self, node: int) -> str:
        if node == 0:
            return f"node 0 ({self.hello['host']})"
        peer = self.members.get(node) or self.waiting.get(node)
        return str(peer) if peer else f"node {node}"

    # ------------------------------------------------------------------ deciding
    def _decide(self, outcome: _Outcome):
        """(status, run again, report for every node, {node: its parting report})."""
        args, kind = self.args, outcome.kind
        if kind == "done":
            if not self.elastic:
                return 0, False, None, {}
            count = 1 + len(self.members)
            restarts = (f" and {_plural(self.restarts, 'restart')} of at most "
                        f"{args.max_restarts}" if args.max_restarts else "")
            return 0, False, (
                f"the job finished on {_plural(count, 'node')} "
                f"({_plural(self._workers(), 'worker')}) after "
                f"{_plural(self.reformations, 're-formation')}{restarts}"), {}
        if kind in ("timeout", "interrupted", "error"):
            return outcome.status, False, outcome.report, {}
        if kind == "stopped":
            return self._decide_stop(outcome)
        if kind == "lost" and not self.elastic:
            return 1, False, (f"the launcher of node {outcome.lost[0]} disconnected or went "
                              "silent (its machine, its network or its launcher died); its "
                              "ranks are lost"), {}
        if kind == "lost":
            outcome.report = "; ".join(self._lost_reason(n) for n in outcome.lost)
            for n in outcome.lost:
                self.members.pop(n).link.close(flush=0)
        remaining = 1 + len(self.members) + len(self.waiting)
        if self.elastic and remaining < args.min_nodes:
            return outcome.status or 1, False, (
                f"{outcome.report}\n{self._too_few(remaining)}"), {}
        if self.restarts >= args.max_restarts:
            if kind == "lost":
                return 1, False, (f"{outcome.report}\nno restart left (--max-restarts "
                                  f"{args.max_restarts}): the job ends"), {}
            return outcome.status, False, outcome.report, {}
        self.restarts += 1
        return outcome.status, True, outcome.report, {}

    def _lost_reason(self, node: int) -> str:
        peer = self.members.get(node)
        if peer is None:
            return f"node {node} lost"
        if peer.link.closed:
            return f"{peer} lost: its launcher's connection closed"
        return (f"{peer} lost: nothing heard from its launcher for "
                f"{self.args.silence_limit:g} s")

    def _decide_stop(self, outcome: _Outcome):
        """A planned stop: a preempted node leaves, waiting nodes come in."""
        where = self._checkpoint_text()
        saved = (f"the workers did not stop within --preempt-grace "
                 f"{self.args.preempt_grace:g} s; the steps since {where} are lost"
                 if outcome.late else f"the workers saved {where}")
        if outcome.lost == [0]:
            return 128 + signal.SIGTERM, False, (
                f"node 0 ({self.hello['host']}) was preempted (SIGTERM): it hosts the "
                f"job's rendezvous, so the job ends on every node; {saved}: start the job "
                "again to resume from it"), {}
        leaving = {}
        for n in outcome.lost:
            leaving[n] = (f"{self._who(n)} was preempted (SIGTERM) and left the job; "
                          f"{saved}; the other nodes go on without it")
        remaining = 1 + len(self.members) - len(leaving) + len(self.waiting)
        if remaining < self.args.min_nodes:
            return 128 + signal.SIGTERM, False, (
                f"{' and '.join(self._who(n) for n in outcome.lost)} preempted; "
                f"{self._too_few(remaining)}; {saved}"), leaving
        return 0, True, None, leaving

    def _checkpoint_text(self) -> str:
        if self.checkpoint is None:
            return "the last checkpoint (none was saved since the launcher started)"
        return f"checkpoint epoch {self.checkpoint[0]} step {self.checkpoint[1]}"

    def _next_formation(self, unconfirmed: list[int], outcome: _Outcome) -> int | None:
        """After a round that runs again: drop the nodes that did not confirm, admit
        the waiting ones, say what happens; or end the job when too few remain."""
        args = self.args
        if not self.elastic:
            self.out.say(f"restarting the job on every node ({self.restarts} of "
                         f"{args.max_restarts})")
            return None
        before = set(self.members) | set(outcome.lost)
        for n in unconfirmed:
            self.out.say(f"{self.members.pop(n)} did not confirm that its processes "
                         "ended: it leaves the job")
        self._take_joiners(self.waiting)
        room = args.max_nodes - 1 - len(self.members)
        for n in sorted(self.waiting)[:max(0, room)]:
            self.members[n] = self.waiting.pop(n)
        count = 1 + len(self.members)
        if count < args.min_nodes:
            self._end_waiting(1, None)
            report = self._too_few(count)
            for peer in self.members.values():
                refuse(peer.link, report, status=1)
            self.out.say(report)
            return 1
        changed = set(self.members) != before
        if changed:
            self.reformations += 1
        workers = self._workers()
        used = (f"restart {self.restarts} of at most {args.max_restarts}"
                if outcome.kind in ("failed", "lost") else "planned: no restart used")
        if changed:
            message = (f"re-forming with {_plural(count, 'node')} "
                       f"({_plural(workers, 'worker')}) from {self._checkpoint_text()} "
                       f"(re-formation {self.reformations}; {used})")
        elif outcome.kind == "stopped":
            message = (f"the workers stopped at a step boundary (SIGTERM to the workers "
                       f"themselves); restarting them on every node from "
                       f"{self._checkpoint_text()} ({used})")
        else:
            message = (f"restarting the job on every node ({self.restarts} of "
                       f"{args.max_restarts}) from {self._checkpoint_text()}")
        self.out.say(message)
        for peer in self.members.values():
            peer.link.send({"type": "news", "report": message})
        return None

    def _layout(self) -> tuple[list[int], list[int]]:
        """The workers and the ps-lite servers of each node of the formation, node 0
        first, then the others by node rank. On horovod every node runs node 0's -n."""
        args = self.args
        hellos = [self.hello] + [self.members[n].hello for n in sorted(self.members)]
        if args.backend == "horovod":
            return [args.num_workers] * len(hellos), [0] * len(hellos)
        return ([h["nproc"] for h in hellos],
                [h.get("servers", args.servers) for h in hellos])

    def _workers(self) -> int:
        return sum(self._layout()[0])

    def _too_few(self, count: int) -> str:
        args = self.args
        return (f"{_plural(count, 'node')} left, fewer than the minimum {args.min_nodes} "
                f"of --nnodes {args.min_nodes}:{args.max_nodes}: the job ends")

    def _end_waiting(self, status: int, report: str | None) -> None:
        for peer in self.waiting.values():
            refuse(peer.link, "the job ended before this node could be admitted"
                   + (f": {report.splitlines()[0]}" if report else " (it finished)"),
                   status=status)
        self.waiting.clear()


def _nodes(stop: _Stop | None) -> list[int]:
    return [stop.node] if stop is not None and stop.reason == "preempt" else []


def _wait_stopped(links: dict[int, Link], out, timeout: float,
                  preempted: list[int]) -> list[int]:
    """Wait for each node to confirm its processes ended; the nodes that did not. A
    preemption reported meanwhile is added to ``preempted``."""
    limit = time.monotonic() + timeout
    missing = []
    for n, link in links.items():
        confirmed = False
        while not confirmed and time.monotonic() < limit:
            try:
                message = link.receive(timeout=0.2)
            except queue.Empty:
                continue
            if message is None:
                break
            if message.get("type") == "preempt" and n not in preempted:
                preempted.append(n)
            confirmed = message.get("type") == "stopped"
        if not confirmed:
            out.say(f"node {n} did not confirm that its processes ended")
            missing.append(n)
    return missing


# ---------------------------------------------------------------------- nodes 1..M-1
class Agent:
    """The launcher of node 1..M-1: joins node 0's, runs each round it is sent."""

    def __init__(self, args, out, preemption: Preemption | None):
        self.args, self.out, self.preemption = args, out, preemption
        self._told = False      # node 0 heard of this node's preemption

    def run(self) -> int:
        args = self.args
        error = check_multinode_host(args)
        if error:
            self.out.say(error)
            return 1
        hello = {"type": "hello", "node": args.node_rank, "host": socket.gethostname(),
                 "nproc": args.num_workers, "servers": args.servers}
        try:
            link = connect_to_master(args.master_addr, args.master_port, hello,
                                     args.join_timeout, args.job_secret)
        except JoinError as err:
            self.out.say(str(err))
            return 1
        try:
            return self._idle(link)
        finally:
            link.close()

    def _idle(self, link: Link) -> int:
        """Between rounds: wait for a start (or the end), beating and watching."""
        args, next_beat = self.args, 0.0
        while True:
            self._tell_preemption(link)
            if self._preemption_overdue():
                return 128 + signal.SIGTERM
            now = time.monotonic()
            if now >= next_beat:
                next_beat = now + args.heartbeat
                link.send({"type": "idle"})
            try:
                message = link.receive(timeout=0.05)
            except queue.Empty:
                if link.gone(args.silence_limit):
                    self.out.say(self._master_lost())
                    return 1
                continue
            if message is None:
                self.out.say(link.refusal or self._master_lost())
                return 1
            if message["type"] == "news":
                self.out.say(message["report"])
            elif message["type"] == "end":
                if message.get("report"):
                    self.out.say(message["report"])
                return message["status"]
            elif message["type"] == "start":
                status, again = self._round(message["spec"], link)
                if not again:
                    return status

    def _master_lost(self) -> str:
        return (f"lost the master launcher at {self.args.master_addr}:"
                f"{self.args.master_port} (node 0 hosts the job: its loss ends the job)")

    def _tell_preemption(self, link: Link) -> None:
        if self.preemption is not None and self.preemption.at is not None \
                and not self._told:
            self._told = True
            link.send({"type": "preempt"})

    def _preemption_overdue(self) -> bool:
        """Node 0 did not let this preempted node go in time: leave anyway."""
        if not self._told:
            return False
        args = self.args
        if time.monotonic() - self.preemption.at < args.preempt_grace + args.silence_limit:
            return False
        self.out.say("preempted (SIGTERM), and node 0 did not release this node within "
                     "--preempt-grace and --silence-limit; terminated this node's "
                     "processes")
        return True

    def _round(self, spec, link: Link):
        args = self.args
        node = Node(args, spec["nodes"].index(args.node_rank), spec)
        hint, next_status = 0, 0.0
        try:
            node.start()
            while True:
                self._tell_preemption(link)
                if self._preemption_overdue():
                    return 128 + signal.SIGTERM, False
                now = time.monotonic()
                if now >= next_status:
                    next_status = now + STATUS_EVERY
                    states = node.states(hint)
                    running = any(s["returncode"] is None for s in states)
                    link.send({"type": "status", "states": states,
                               "service_failure": node.service_failure(running),
                               "services_ended": node.services_ended()})
                try:
                    message = link.receive(timeout=0.05)
                except queue.Empty:
                    message = {"type": "silence"} if link.gone(args.silence_limit) else None
                    if message is None:
                        continue
                if message is None or message["type"] == "silence":
                    self.out.say(self._master_lost() + "; terminated this node's processes")
                    return 1, False
                kind = message["type"]
                if kind == "hint":
                    hint = message["low"]
                elif kind == "verdicts":
                    node.set_verdicts({int(r): v for r, v in message["verdicts"].items()})
                elif kind == "stop":
                    node.request_stop(message["number"])
                elif kind == "stacks":
                    found = node.stacks([r for r in message["ranks"] if r in node.ranks])
                    link.send({"type": "stacks", "found": found})
                elif kind == "end":
                    report, again = message.get("report"), message["again"]
                    if report:
                        self.out.say(report + "\nterminated this node's processes."
                                     if message.get("terminated", message["status"] != 0)
                                     else report)
                    node.terminate(message.get("grace", TERM_GRACE))
                    link.send({"type": "stopped"})
                    return message["status"], again
        except Interrupted as stop:
            self.out.say(f"interrupted by {signal.Signals(stop.signum).name}; terminated "
                         "this node's processes")
            return 128 + stop.signum, False
        finally:
            node.terminate()
