"""The launcher of nodes 1..M-1 (an agent): joins the host's launcher (node 0's, or the
node's that took over from it) and runs each round it is sent on this machine (the job
loop is described in job.py; what happens when the host is lost, in succession.py)."""
from __future__ import annotations

import dataclasses
import queue
import signal
import socket
import time

from . import succession
from .channel import STATUS_EVERY, Backoff, Beating, JoinError, Link, connect_to_master
from .config import LaunchConfig
from .job import Interrupted, Preemption, check_multinode_host
from .master import Master
from .node import Node
from .policy import KILL_GRACE
from .processes import TERM_GRACE
from .protocol import (
    End,
    Hello,
    Hint,
    Idle,
    News,
    Preempt,
    Redirect,
    RoundSpec,
    Saved,
    StacksFound,
    StacksRequest,
    Start,
    Status,
    Stop,
    Stopped,
    Tick,
    Verdicts,
    Welcome,
    from_master,
)


class HostLost(Exception):
    """The job's host is gone (``planned``: it was preempted and handed the job over);
    ``report`` says how, naming it."""

    def __init__(self, report: str, planned: bool = False):
        super().__init__(report)
        self.report, self.planned = report, planned


class Redirected(Exception):
    """The node this launcher joined through does not host the job: it named the host."""

    def __init__(self, message: Redirect):
        super().__init__(f"{message.name} at {message.addr}:{message.port}")
        self.message = message


class NotAdmitted(Exception):
    """The host dropped this launcher's link, or never answered on it, before it
    welcomed it (too busy to read its hello in time, or gone): the join may pass if
    tried again."""


MAX_REDIRECTS = 3


class Agent:
    """The launcher of node 1..M-1: joins the host's, runs each round it is sent; in an
    elastic job, elects the next host when the host is lost (succession.py)."""

    def __init__(self, config: LaunchConfig, out, preemption: Preemption | None,
                 observation=None):
        self.config, self.out, self.preemption = config, out, preemption
        # this node's step records travel to node 0 with each status (observe.py)
        self.observation = observation
        self._told = False      # the host heard of this node's preemption
        self.spec: RoundSpec | None = None      # the last round's, as the host sent it
        self.checkpoint: tuple[int, int] | None = None  # the newest the host told of
        self.host = (config.master_addr, config.master_port, "node 0")  # addr, port, name
        self.addr: str | None = None    # where the other nodes reach this one
        self.listener = None            # the door should this node host the job
        # joining: until --join-timeout, with jittered waits between attempts
        self._join_deadline = time.monotonic() + config.join_timeout
        self._backoff = Backoff()
        self._welcomed = False          # the host took this node in on the current link
        self.kept: Node | None = None   # this node's processes kept for the next round
        # this node's workers of the last round committed their state to the node's
        # shared memory (told to the host this node may become)
        self.memory = False

    @property
    def master_at(self) -> str:
        """"address:port" of the job's host, as this node reaches it."""
        return f"{self.host[0]}:{self.host[1]}"

    def run(self) -> int:
        config = self.config
        error = check_multinode_host(config)
        if error:
            self.out.say(error)
            return 1
        listener = None
        try:
            listener = succession.open_door(config, self.out.say)
            if listener is not None:
                self.addr = succession.own_address(config.master_addr)
        except (OSError, JoinError):
            listener = None     # this node cannot host the job: it goes on without
        hello = Hello(config.node_rank, socket.gethostname(), config.num_workers,
                      config.servers, self.addr if listener else None,
                      listener.port if listener else None)
        self.hello = hello.to_wire()
        self.listener = listener
        link = None
        try:
            link = self._join()
            redirects = 0
            while True:
                try:
                    return self._idle(link)
                except NotAdmitted as why:
                    link.close(flush=0)
                    link = None
                    link = self._join_again(str(why))
                except HostLost as lost:
                    link.close()
                    nxt = self._succeed(lost, listener)
                    if not isinstance(nxt, Link):
                        return nxt
                    link = nxt
                except Redirected as sent:
                    link.close()
                    link = None
                    redirects += 1
                    if redirects > MAX_REDIRECTS:
                        self.out.say(f"sent on {MAX_REDIRECTS} times without reaching the "
                                     "job's host: start this node with the current host's "
                                     "address as --master-addr")
                        return 1
                    to = sent.message
                    self.out.say(f"{self.master_at} does not host the job: joining its host, "
                                 f"{to.name} at {to.addr}:{to.port}")
                    self.host = (to.addr, to.port, to.name)
                    link = self._join()
        except JoinError as err:
            self.out.say(str(err))
            return 1
        finally:
            self._end_kept()
            if link is not None:
                link.close()
            if listener is not None:
                listener.close()

    # ------------------------------------------------------------------ joining
    def _join(self) -> Link:
        """A link to the job's host (``self.host``), its hello sent; tried again after
        jittered waits while that fails, until --join-timeout from this launcher's start."""
        addr, port, _ = self.host
        self._welcomed = False
        return connect_to_master(addr, port, self.hello, self.config.join_timeout,
                                 self.config.job_secret, self.out.say, self._backoff,
                                 self._join_deadline)

    def _join_again(self, why: str) -> Link:
        """After the host let a join go unanswered (``why``): wait, then join again."""
        left = self._join_deadline - time.monotonic()
        if left <= 0:
            raise JoinError(f"not admitted by the job's host at {self.master_at} within "
                            f"--join-timeout {self.config.join_timeout:g} s: {why}")
        wait = min(self._backoff.next(), left)
        self.out.say(f"not admitted yet: {why}; retrying in {wait:.1f} s (until "
                     f"--join-timeout, {left:.0f} s left)")
        time.sleep(wait)
        return self._join()

    def _not_admitted(self, link: Link) -> NotAdmitted | None:
        """The host let this join go (closed the link, or said nothing for
        --silence-limit) before it welcomed this node; None once it has, or when this
        node joins a host it elected (succession.py decides then)."""
        if self._welcomed or self.spec is not None or link.refusal:
            return None
        how = ("closed the connection" if link.closed else
               f"said nothing for {self.config.silence_limit:g} s")
        return NotAdmitted(f"the job's host at {self.master_at} {how} before it took this "
                           "node in (too busy to read its hello in time, or gone)")

    def _end_kept(self) -> None:
        if self.kept is not None:
            self.kept.terminate()
            self.kept = None

    # ------------------------------------------------------------------ succession
    def _lost(self, link: Link) -> HostLost | None:
        """The host's loss, to elect the next one; None when this node cannot."""
        if not succession.can_succeed(self.config, self.spec) or self._told:
            return None     # a preempted node leaves anyway
        how = ("its connection closed" if link.closed or link.silent_for()
               < self.config.silence_limit else
               f"nothing heard from it for {self.config.silence_limit:g} s")
        name = self.spec.name(self.spec.host)
        self.out.say(f"lost the master launcher at {self.master_at} ({name}): {how}; "
                     "terminated this node's processes")
        how = ("its launcher's connection closed" if how.startswith("its") else
               f"nothing heard from its launcher for {self.config.silence_limit:g} s")
        return HostLost(f"{name} lost: {how}")

    def _succeed(self, lost: HostLost, listener) -> Link | int:
        """Elect the next host (succession.py): a link to it, or this launcher's exit
        status once it has hosted the job (or found it cannot go on)."""
        config, spec = self.config, self.spec
        why = succession.hopeless(config, spec, lost.planned)
        if why:
            self.out.say(why)
            return 1
        rest = [spec.name(n) for n in spec.nodes if n != spec.host]
        self.out.say(f"electing the next host among {', '.join(rest)} (the lowest node "
                     "rank that answers hosts the job)")
        elected = succession.elect(config, spec, self.hello, self.out.say)
        if elected is not None:
            link, node = elected
            addr, port = spec.addresses[spec.nodes.index(node)]
            self.host = (addr, port, spec.name(node))
            return link
        host = dataclasses.replace(config, master_addr=self.addr, master_port=listener.port)
        takeover = succession.Takeover(spec, self.checkpoint, lost.report, lost.planned,
                                       listener)
        kept, self.kept = self.kept, None
        return Master(host, self.out, self.preemption, takeover, kept,
                      memory=self.memory).run()

    def _idle(self, link: Link) -> int:
        """Between rounds: wait for a start (or the end), beating and watching."""
        config, next_beat = self.config, 0.0
        while True:
            self._send_on()
            self._tell_preemption(link)
            if self._preemption_overdue():
                return 128 + signal.SIGTERM
            now = time.monotonic()
            if now >= next_beat:
                next_beat = now + config.heartbeat
                link.send(Idle())
            try:
                wire = link.receive(timeout=STATUS_EVERY)
            except queue.Empty:
                if link.gone(config.silence_limit):
                    lost = self._not_admitted(link) or self._lost(link)
                    if lost is not None:
                        raise lost from None
                    self.out.say(self._master_lost())
                    return 1
                continue
            if wire is None:
                lost = None if link.refusal else (self._not_admitted(link)
                                                  or self._lost(link))
                if lost is not None:
                    raise lost
                self.out.say(link.refusal or self._master_lost())
                return 1
            message = from_master(wire)
            if isinstance(message, Welcome):
                self._welcomed = True
                if message.waiting:
                    when = ("the workers' next commit" if message.memory else "the next "
                            "step boundary the workers agree on, or their next checkpoint")
                    self.out.say(f"joined the job at {self.master_at}: admitted at its "
                                 f"next re-formation ({when})")
                elif self._backoff.attempts:
                    self.out.say(f"joined the job at {self.master_at}")
            elif isinstance(message, Saved):
                self.checkpoint = (message.epoch, message.step)
            elif isinstance(message, News):
                self.out.say(message.report)
            elif isinstance(message, End):
                if message.report:
                    self.out.say(message.report)
                return message.status
            elif isinstance(message, Redirect):
                raise Redirected(message)
            elif isinstance(message, Start):
                self.spec = message.spec
                self.host = self.host[:2] + (message.spec.name(message.spec.host),)
                status, again = self._round(message.spec, link)
                if not again:
                    return status

    def _send_on(self) -> None:
        """Launchers that join through this node are sent on to the job's host."""
        if self.listener is not None:
            succession.send_on(self.listener, self.spec, self.host, self.out.say)

    def _master_lost(self) -> str:
        return (f"lost the master launcher at {self.master_at} (node 0 hosts the job: its "
                "loss ends the job)")

    def _tell_preemption(self, link: Link) -> None:
        if self.preemption is not None and self.preemption.at is not None \
                and not self._told:
            self._told = True
            link.send(Preempt())

    def _preemption_overdue(self) -> bool:
        """Node 0 did not let this preempted node go in time: leave anyway."""
        if not self._told:
            return False
        config = self.config
        if time.monotonic() - self.preemption.at < config.preempt_grace + config.silence_limit:
            return False
        self.out.say("preempted (SIGTERM), and node 0 did not release this node within "
                     "--preempt-grace and --silence-limit; terminated this node's "
                     "processes")
        return True

    def _round(self, spec: RoundSpec, link: Link) -> tuple[int, bool]:
        """Run one round of this node's processes: (exit status, whether another round
        follows)."""
        node = Node(self.config, spec.nodes.index(self.config.node_rank), spec, self.kept)
        self.kept = None
        grace = TERM_GRACE
        try:
            node.start()
            return self._watch(node, link)
        except HostLost:
            self.memory = node.commits_to_node()
            if spec.backend == "horovod" and spec.transport == "gloo" and node.keeps():
                # they go on under the next host (dist_gluon.elastic.run)
                node.end_round()
                self.kept = node
            # workers blocked in a collective with the lost host run no handler
            grace = KILL_GRACE
            raise
        except Interrupted as stop:
            self.out.say(f"interrupted by {signal.Signals(stop.signum).name}; terminated "
                         "this node's processes")
            return 128 + stop.signum, False
        finally:
            if self.kept is not node:
                node.terminate(grace)

    def _watch(self, node: Node, link: Link) -> tuple[int, bool]:
        """Report this node's ranks to node 0 and carry out what it asks, until the
        round ends. The ranks are looked at every STATUS_EVERY seconds and reported when
        something changed, else every --heartbeat: node 0's cost stays linear in the
        nodes with a small slope (a hundred idle nodes sent it a thousand reports a
        second)."""
        config, hint, next_status, next_beat, last = self.config, 0, 0.0, 0.0, None
        while True:
            self._send_on()
            self._tell_preemption(link)
            if self._preemption_overdue():
                return 128 + signal.SIGTERM, False
            now = time.monotonic()
            if now >= next_status:
                next_status = now + STATUS_EVERY
                states = node.states(hint)
                running = any(s["returncode"] is None for s in states)
                # step records (--timeline, the report) go out as they come; a status
                # that says nothing new waits for the next heartbeat
                steps = self.observation and self.observation.outgoing()
                status = Status(states, node.service_failure(running),
                                node.services_ended(), steps=steps).to_wire()
                if steps or status != last or now >= next_beat:
                    link.send(status)
                    last, next_beat = status, now + config.heartbeat
            try:
                wire = link.receive(timeout=STATUS_EVERY)
            except queue.Empty:
                if not link.gone(config.silence_limit):
                    continue
                wire = None
            if wire is None:
                lost = None if link.refusal else self._lost(link)
                if lost is not None:
                    raise lost
                self.out.say(self._master_lost() + "; terminated this node's processes")
                return 1, False
            message = from_master(wire)
            if isinstance(message, Tick) and self.observation is not None:
                # when the link's reader took it in (or a later message)
                self.observation.tick(message.clock, link.last_heard)
            elif isinstance(message, Saved):
                self.checkpoint = (message.epoch, message.step)
            elif isinstance(message, Hint):
                hint = message.low
            elif isinstance(message, Verdicts):
                node.set_verdicts(message.verdicts)
            elif isinstance(message, Stop):
                node.request_stop(message.number)
            elif isinstance(message, StacksRequest):
                found = node.stacks([r for r in message.ranks if r in node.ranks])
                link.send(StacksFound(found))
            elif isinstance(message, End):
                if message.report:
                    terminated = message.status != 0 if message.terminated is None \
                        else message.terminated
                    self.out.say(message.report + "\nterminated this node's processes."
                                 if terminated else message.report)
                # the host waits for Stopped while this node is heard from
                with Beating([link], config.heartbeat, Idle()):
                    if message.keep and message.again:
                        node.end_round()
                        self.kept = node
                    else:
                        node.terminate(TERM_GRACE if message.grace is None
                                       else message.grace)
                link.send(Stopped())
                if message.handover:
                    if self._told or not succession.can_succeed(self.config, self.spec):
                        return 0, False     # preempted too: it leaves with the host
                    raise HostLost(message.report or "", planned=True)
                return message.status, message.again
