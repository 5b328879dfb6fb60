"""The launcher of nodes 1..M-1 (an agent): joins node 0's launcher and runs each round
it is sent on this machine (the job loop is described in job.py)."""
from __future__ import annotations

import queue
import signal
import socket
import time

from .channel import STATUS_EVERY, JoinError, Link, connect_to_master
from .config import LaunchConfig
from .job import Interrupted, Preemption, check_multinode_host
from .node import Node
from .processes import TERM_GRACE
from .protocol import (
    End,
    Hello,
    Hint,
    Idle,
    News,
    Preempt,
    RoundSpec,
    StacksFound,
    StacksRequest,
    Start,
    Status,
    Stop,
    Stopped,
    Verdicts,
    from_master,
)


class Agent:
    """The launcher of node 1..M-1: joins node 0's, runs each round it is sent."""

    def __init__(self, config: LaunchConfig, out, preemption: Preemption | None):
        self.config, self.out, self.preemption = config, out, preemption
        self._told = False      # node 0 heard of this node's preemption

    def run(self) -> int:
        config = self.config
        error = check_multinode_host(config)
        if error:
            self.out.say(error)
            return 1
        hello = Hello(config.node_rank, socket.gethostname(), config.num_workers,
                      config.servers)
        try:
            link = connect_to_master(config.master_addr, config.master_port,
                                     hello.to_wire(), config.join_timeout,
                                     config.job_secret)
        except JoinError as err:
            self.out.say(str(err))
            return 1
        try:
            return self._idle(link)
        finally:
            link.close()

    def _idle(self, link: Link) -> int:
        """Between rounds: wait for a start (or the end), beating and watching."""
        config, next_beat = self.config, 0.0
        while True:
            self._tell_preemption(link)
            if self._preemption_overdue():
                return 128 + signal.SIGTERM
            now = time.monotonic()
            if now >= next_beat:
                next_beat = now + config.heartbeat
                link.send(Idle())
            try:
                wire = link.receive(timeout=0.05)
            except queue.Empty:
                if link.gone(config.silence_limit):
                    self.out.say(self._master_lost())
                    return 1
                continue
            if wire is None:
                self.out.say(link.refusal or self._master_lost())
                return 1
            message = from_master(wire)
            if isinstance(message, News):
                self.out.say(message.report)
            elif isinstance(message, End):
                if message.report:
                    self.out.say(message.report)
                return message.status
            elif isinstance(message, Start):
                status, again = self._round(message.spec, link)
                if not again:
                    return status

    def _master_lost(self) -> str:
        return (f"lost the master launcher at {self.config.master_addr}:"
                f"{self.config.master_port} (node 0 hosts the job: its loss ends the job)")

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
        node = Node(self.config, spec.nodes.index(self.config.node_rank), spec)
        try:
            node.start()
            return self._watch(node, link)
        except Interrupted as stop:
            self.out.say(f"interrupted by {signal.Signals(stop.signum).name}; terminated "
                         "this node's processes")
            return 128 + stop.signum, False
        finally:
            node.terminate()

    def _watch(self, node: Node, link: Link) -> tuple[int, bool]:
        """Report this node's ranks to node 0 and carry out what it asks, until the
        round ends."""
        config, hint, next_status = self.config, 0, 0.0
        while True:
            self._tell_preemption(link)
            if self._preemption_overdue():
                return 128 + signal.SIGTERM, False
            now = time.monotonic()
            if now >= next_status:
                next_status = now + STATUS_EVERY
                states = node.states(hint)
                running = any(s["returncode"] is None for s in states)
                link.send(Status(states, node.service_failure(running),
                                 node.services_ended()))
            try:
                wire = link.receive(timeout=0.05)
            except queue.Empty:
                if not link.gone(config.silence_limit):
                    continue
                wire = None
            if wire is None:
                self.out.say(self._master_lost() + "; terminated this node's processes")
                return 1, False
            message = from_master(wire)
            if isinstance(message, Hint):
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
                node.terminate(TERM_GRACE if message.grace is None else message.grace)
                link.send(Stopped())
                return message.status, message.again
