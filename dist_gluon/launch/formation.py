"""The host's view of which nodes make up the job (node 0's launcher, or the node that
took over from it): the members of the current formation, the nodes waiting to join it
(elastic), how they are gathered before the first round (or after a takeover) and
admitted later. What to decide is policy.py's; this module holds the links."""
from __future__ import annotations

import queue
import signal
import socket
import time

from . import channel, policy
from .channel import JoinError, Link, Listener, refuse
from .config import LaunchConfig
from .job import Interrupted, Preemption
from .protocol import Hello, Preempt, Tick, Welcome, from_node


class Peer:
    """Another node's launcher: its link and what it said in its hello; ``addr`` is the
    address it reached this one from."""

    def __init__(self, node: int, link: Link, hello: Hello):
        self.node, self.link, self.hello = node, link, hello
        self.host = hello.host
        self.addr = hello.addr or link.peer.rpartition(":")[0]

    def __str__(self):
        return f"node {self.node} ({self.host})"


class Formation:
    """The nodes of the job besides its host (``rank``, node 0 until a takeover):
    ``members`` run the rounds, ``waiting`` (elastic) joined since and come in at the
    next re-formation."""

    def __init__(self, config: LaunchConfig, out, preemption: Preemption | None,
                 listener: Listener | None = None):
        self.config, self.out, self.preemption = config, out, preemption
        self.rank = config.node_rank
        self.hello = Hello(self.rank, socket.gethostname(), config.num_workers,
                           config.servers)
        self.members: dict[int, Peer] = {}
        # names of the nodes of earlier formations ("node 0 (h0)"), for reports
        self.known: dict[int, str] = {}
        self.waiting: dict[int, Peer] = {}
        # (who, why) of the launchers refused since the job last started or re-formed
        self.left_out: list[tuple[str, str]] = []
        self.listener = listener
        # the running round's workers keep their state in memory (policy.in_memory):
        # they re-form at a commit, not at a checkpoint
        self.in_memory = False

    # ------------------------------------------------------------------ who is in
    def peers(self) -> list[Peer]:
        return list(self.members.values()) + list(self.waiting.values())

    def who(self, node: int) -> str:
        if node == self.rank:
            return f"node {node} ({self.hello.host})"
        peer = self.members.get(node) or self.waiting.get(node)
        return str(peer) if peer else self.known.get(node, f"node {node}")

    def names(self) -> dict[int, str]:
        return {n: self.who(n) for n in {*self.known, self.rank, *self.members,
                                        *self.waiting}}

    def order(self) -> list[int]:
        """The formation's node ranks: the host, then the others by rank."""
        return [self.rank] + sorted(self.members)

    def addresses(self, addr: str, port: int) -> list[list] | None:
        """Where each node of :meth:`order` is reached and would host the job (the host
        at ``addr``:``port``); None when a node did not say (it cannot take over)."""
        peers = [self.members[n] for n in sorted(self.members)]
        if any(p.hello.port is None for p in peers):
            return None
        return [[addr, port]] + [[p.addr, p.hello.port] for p in peers]

    def layout(self) -> tuple[list[int], list[int]]:
        """The workers and the ps-lite servers of each node of the formation, in
        :meth:`order`. On horovod every node runs node 0's -n."""
        config = self.config
        hellos = [self.hello] + [self.members[n].hello for n in sorted(self.members)]
        if config.backend == "horovod":
            return [config.num_workers] * len(hellos), [0] * len(hellos)
        return ([h.nproc for h in hellos],
                [config.servers if h.servers is None else h.servers for h in hellos])

    def workers(self) -> int:
        return sum(self.layout()[0])

    # ------------------------------------------------------------------ joining
    def gather(self, listen_addr: str) -> None:
        """Wait for the other nodes: all of them (static), or MIN and then any more that
        join within --last-call of the previous one, up to MAX (elastic). An elastic job
        does not start while launchers are still saying hello (before --join-timeout),
        and says which launchers it left out and why."""
        config = self.config
        self.out.say(f"waiting for {self._wanted()} on port {config.master_port}")
        if not config.elastic:
            joined = channel.accept_nodes(config.master_port, config.nnodes,
                                          config.join_timeout, self.out.say,
                                          config.job_secret, listen_addr,
                                          config.half_open_limit, config.heartbeat)
            self.members = {n: Peer(n, link, Hello.from_wire(hello))
                            for n, (link, hello) in joined.items()}
            return
        self.listener = Listener(config.master_port, config.job_secret, self.out.say,
                                 listen_addr, config.max_nodes, config.half_open_limit)
        started = time.monotonic()
        limit = started + config.join_timeout
        last_join, next_tick = started, 0.0
        while True:
            if self.preemption is not None and self.preemption.at is not None:
                raise Interrupted(signal.SIGTERM)
            for n in [n for n, p in self.members.items() if p.link.closed
                      or p.link.gone(config.silence_limit)]:
                self.out.say(f"{self.members.pop(n)} left before the job started")
            if self.take_joiners(waiting=False):
                last_join = time.monotonic()
            now = time.monotonic()
            if now >= next_tick:
                next_tick = now + config.heartbeat
                channel.broadcast([p.link for p in self.members.values()], Tick())
            count = len(self.members) + 1
            arriving = self.listener.arriving
            if policy.ready_to_start(count, now - last_join, config.min_nodes,
                                     config.max_nodes, config.last_call, arriving):
                break
            if now > limit:
                if count < config.min_nodes:
                    self._too_few_joined(count)
                break
            time.sleep(0.05)
        self.out.say(self._starting(count, time.monotonic() - started, arriving,
                                    now > limit))

    def _starting(self, count: int, took: float, arriving: int, timed_out: bool) -> str:
        """What node 0 says as an elastic job starts: with how many nodes, and which
        launchers it left out and why."""
        config = self.config
        why = ("its maximum" if count >= config.max_nodes else
               f"--join-timeout {config.join_timeout:g} s passed" if timed_out else
               f"no other launcher joined for --last-call {config.last_call:g} s")
        lines = [f"starting with {policy.plural(count, 'node')} of at most "
                 f"{config.max_nodes} (--nnodes {config.min_nodes}:{config.max_nodes}) "
                 f"after {took:.1f} s: {why}"]
        lines += [f"left out {who}: {reason}" for who, reason in self.left_out]
        if arriving:
            lines.append(f"left out {policy.plural(arriving, 'connection')} still on "
                         f"{'its' if arriving == 1 else 'their'} way in: the job's "
                         "launchers among them join at the next re-formation")
        self.left_out = []
        return "\n".join(lines)

    def gather_survivors(self, expected: set[int], timeout: float) -> None:
        """After a takeover: the nodes of the last formation that reach this one, until
        all ``expected`` have or ``timeout`` seconds pass; a node not expected waits to
        join, as one that joins later would."""
        limit, next_tick = time.monotonic() + timeout, 0.0
        while not expected <= set(self.members) and time.monotonic() < limit:
            for link, wire in self.listener.poll():
                hello = Hello.from_wire(wire)
                if hello.node in expected and hello.node not in self.members:
                    self.members[hello.node] = peer = Peer(hello.node, link, hello)
                    link.send(Welcome())
                    self.out.say(f"{peer} joined the new host")
                    continue
                taken = {self.rank, *self.members, *self.waiting, *expected}
                refusal = policy.admission_refusal(hello.node, taken,
                                                   self.config.min_nodes,
                                                   self.config.max_nodes)
                if refusal:
                    refuse(link, refusal)
                else:
                    self.waiting[hello.node] = Peer(hello.node, link, hello)
                    link.send(Welcome(waiting=True))
            if time.monotonic() >= next_tick:
                next_tick = time.monotonic() + self.config.heartbeat
                channel.broadcast([p.link for p in self.members.values()], Tick())
            time.sleep(0.05)

    def _too_few_joined(self, count: int):
        config = self.config
        for peer in self.members.values():
            refuse(peer.link, f"only {policy.plural(count, 'node')} of at least "
                              f"{config.min_nodes} joined; the job did not start")
        raise JoinError(
            f"only {policy.plural(count, 'node')} joined within --join-timeout "
            f"{config.join_timeout:g} s, fewer than the minimum {config.min_nodes} of "
            f"--nnodes {config.min_nodes}:{config.max_nodes} (start the launcher on "
            f"more machines with --master-addr {config.master_addr} --master-port "
            f"{config.master_port})")

    def _wanted(self) -> str:
        config = self.config
        if not config.elastic:
            return f"{config.nnodes - 1} more node(s)"
        return (f"{config.min_nodes - 1} to {config.max_nodes - 1} more nodes (--nnodes "
                f"{config.min_nodes}:{config.max_nodes})")

    def take_joiners(self, waiting: bool = True) -> bool:
        """Elastic: the launchers that joined since the last look, added to the waiting
        nodes (or, before the first round, to the members) if the job has room and their
        node rank is free, and welcomed; the others are told why not (and node 0 says
        so). A node whose earlier link closed before the start (or while it waited) may
        join again under its rank."""
        if self.listener is None:
            return False
        config, took = self.config, False
        into = self.waiting if waiting else self.members
        for link, wire in self.listener.poll():
            hello = Hello.from_wire(wire)
            # (a member of a running round is not replaced here: the round ends on its
            # loss first)
            old = into.get(hello.node)
            if old is not None and old.link.closed:
                del into[hello.node]
                self.out.say(f"{old} joins again: its first connection closed")
            taken = {self.rank, *self.members, *self.waiting}
            refusal = policy.admission_refusal(hello.node, taken, config.min_nodes,
                                               config.max_nodes)
            if refusal:
                who = f"node {hello.node} ({hello.host}) at {link.peer}"
                self.out.say(f"refused {who}: {refusal}")
                if not waiting:
                    self.left_out.append((who, refusal))
                refuse(link, refusal)
                continue
            peer = into[hello.node] = Peer(hello.node, link, hello)
            link.send(Welcome(waiting=waiting, memory=self.in_memory or None))
            took = True
            count = len(taken) + 1
            if not waiting:
                self.out.say(f"{peer} joined ({count} of at most {config.max_nodes} nodes)")
            else:
                when = ("the workers' next commit (dist_gluon.elastic.State.commit)"
                        if self.in_memory else "the next step boundary the workers agree "
                        "on (dist_gluon.stop_requested()) or their next checkpoint")
                self.out.say(f"{peer} joined; the job re-forms with {count} nodes at {when}")
        return took

    def watch_waiting(self) -> None:
        """Drop the waiting nodes that went away or were preempted before admission."""
        for n in list(self.waiting):
            peer, ended, preempted = self.waiting[n], False, False
            while True:
                try:
                    wire = peer.link.inbox.get_nowait()
                except queue.Empty:
                    break
                ended = ended or wire is None
                preempted = preempted or (wire is not None
                                          and isinstance(from_node(wire), Preempt))
            if preempted:
                refuse(peer.link, f"{peer} was preempted before it was admitted; it "
                                  "leaves", status=0)
                self.out.say(f"{peer} was preempted before it was admitted")
                del self.waiting[n]
            elif ended or peer.link.closed or peer.link.gone(self.config.silence_limit):
                self.out.say(f"{peer} left before it could be admitted")
                peer.link.close(flush=0)
                del self.waiting[n]

    def tick_waiting(self) -> None:
        channel.broadcast([p.link for p in self.waiting.values()], Tick())

    def admit_waiting(self) -> None:
        """The waiting nodes the job has room for become members."""
        self.take_joiners()
        for n in policy.admitted(self.waiting, len(self.members), self.config.max_nodes):
            self.members[n] = self.waiting.pop(n)

    # ------------------------------------------------------------------ leaving
    def drop(self, node: int) -> Peer | None:
        return self.members.pop(node, None)

    def lost_reason(self, node: int) -> str:
        peer = self.members.get(node)
        if peer is None:
            return f"node {node} lost"
        if peer.link.closed:
            return f"{peer} lost: its launcher's connection closed"
        return (f"{peer} lost: nothing heard from its launcher for "
                f"{self.config.silence_limit:g} s")

    def end_waiting(self, status: int, report: str | None) -> None:
        for peer in self.waiting.values():
            refuse(peer.link, "the job ended before this node could be admitted"
                   + (f": {report.splitlines()[0]}" if report else " (it finished)"),
                   status=status)
        self.waiting.clear()

    def refuse_all(self, report: str, status: int = 2) -> None:
        for peer in self.peers():
            refuse(peer.link, report, status=status)

    def close(self) -> None:
        for peer in self.peers():
            peer.link.close()
        if self.listener is not None:
            self.listener.close()

