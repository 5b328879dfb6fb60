"""The launcher's decisions as pure functions (dist_gluon.launch.policy), its messages
(protocol) and its configuration (cli -> LaunchConfig): no sockets, no processes."""
from __future__ import annotations

import dataclasses
import json
import signal
from types import SimpleNamespace

import pytest

from dist_gluon.launch import cli, policy, protocol
from dist_gluon.launch.config import LaunchConfig
from dist_gluon.launch.policy import Decision, Outcome, RoundEnd, Standing, StopRequest
from dist_gluon.launch.processes import TERM_GRACE
from dist_gluon.launch.rounds import PARKED_SETTLE, RoundWatch

NAMES = {0: "node 0 (h0)", 1: "node 1 (h1)", 2: "node 2 (h2)"}


def static(**kw) -> Standing:
    return Standing(elastic=False, min_nodes=2, max_nodes=2, max_restarts=kw.pop("max", 1),
                    nodes=2, workers=4, names=NAMES, **kw)


def elastic(**kw) -> Standing:
    values = dict(elastic=True, min_nodes=2, max_nodes=3, max_restarts=3, nodes=3,
                  workers=3, names=NAMES, checkpoint=(1, 20))
    values.update(kw)
    return Standing(**values)


# ------------------------------------------------------------------ after a round
def test_a_finished_static_job_exits_0_silently_an_elastic_one_sums_itself_up():
    assert policy.decide(RoundEnd(Outcome.DONE), static()) == Decision(0, False, None, {})
    decision = policy.decide(RoundEnd(Outcome.DONE),
                             elastic(nodes=2, workers=2, reformations=1, restarts=1))
    assert decision == Decision(0, False, "the job finished on 2 nodes (2 workers) after 1 "
                                "re-formation and 1 restart of at most 3", {})


def test_a_failure_restarts_while_restarts_remain_then_ends_with_the_ranks_status():
    failed = RoundEnd(Outcome.FAILED, 3, "rank 1 (h1) failed")
    assert policy.decide(failed, static(restarts=0)) == Decision(
        3, True, "rank 1 (h1) failed", {}, restart=True)
    assert policy.decide(failed, static(restarts=1)) == Decision(
        3, False, "rank 1 (h1) failed", {})


@pytest.mark.parametrize("outcome,status", [(Outcome.TIMEOUT, 124),
                                            (Outcome.INTERRUPTED, 130), (Outcome.ERROR, 1)])
def test_timeout_interrupt_and_errors_end_the_job_whatever_restarts_remain(outcome, status):
    end = RoundEnd(outcome, status, "why")
    assert policy.decide(end, static(restarts=0, max=5)) == Decision(status, False, "why", {})
    assert policy.decide(end, elastic()) == Decision(status, False, "why", {})


def test_a_static_job_that_loses_a_node_ends_with_restarts_left():
    decision = policy.decide(RoundEnd(Outcome.LOST, 1, lost=(1,)), static(max=5))
    assert decision.status == 1 and not decision.again
    assert decision.report.startswith("the launcher of node 1 disconnected or went silent")


def test_an_elastic_job_that_loses_a_node_re_forms_while_min_remain():
    lost = RoundEnd(Outcome.LOST, 1, "node 2 (h2) lost: its launcher's connection closed",
                    lost=(2,))
    assert policy.decide(lost, elastic()) == Decision(1, True, lost.report, {}, restart=True)
    # no restart left: the job ends, saying so
    ended = policy.decide(lost, elastic(restarts=3))
    assert not ended.again and ended.status == 1
    assert ended.report.endswith("no restart left (--max-restarts 3): the job ends")
    # below MIN: the job ends even with restarts left; a waiting node counts
    too_few = policy.decide(lost, elastic(nodes=2))
    assert not too_few.again and too_few.report.endswith(
        "1 node left, fewer than the minimum 2 of --nnodes 2:3: the job ends")
    assert policy.decide(lost, elastic(nodes=2, waiting=1)).again


def test_a_preempted_node_leaves_and_the_others_go_on_without_using_a_restart():
    decision = policy.decide(RoundEnd(Outcome.STOPPED, lost=(2,)), elastic())
    assert decision == Decision(0, True, None, {2: (
        "node 2 (h2) was preempted (SIGTERM) and left the job; the workers saved "
        "checkpoint epoch 1 step 20; the other nodes go on without it")})
    late = policy.decide(RoundEnd(Outcome.STOPPED, lost=(2,), late=True), elastic())
    assert "did not stop within --preempt-grace 20 s; the steps since checkpoint epoch 1 " \
        "step 20 are lost" in late.leaving[2]


def test_node_0_preempted_ends_the_job_and_below_min_every_node_hears_why():
    sigterm = 128 + signal.SIGTERM
    zero = policy.decide(RoundEnd(Outcome.STOPPED, lost=(0,)), elastic())
    assert zero.status == sigterm and not zero.again and not zero.leaving
    assert zero.report.startswith("node 0 (h0) was preempted (SIGTERM): it hosts the job's "
                                  "rendezvous")
    below = policy.decide(RoundEnd(Outcome.STOPPED, lost=(1,)), elastic(nodes=2))
    assert below.status == sigterm and not below.again and 1 in below.leaving
    assert below.report.startswith("node 1 (h1) preempted; 1 node left, fewer than")


def test_a_planned_stop_with_no_node_leaving_restarts_everyone():
    assert policy.decide(RoundEnd(Outcome.STOPPED), elastic()) == Decision(0, True, None, {})


def test_processes_are_reported_terminated_only_when_something_went_wrong():
    failed = RoundEnd(Outcome.FAILED, 1)
    again = Decision(1, True, "x", {}, True)
    ends = Decision(1, False, "x", {})
    assert policy.terminated(failed, again) and policy.terminated(failed, ends)
    lost = RoundEnd(Outcome.LOST, 1, lost=(2,))
    assert not policy.terminated(lost, again) and policy.terminated(lost, ends)
    assert not policy.terminated(RoundEnd(Outcome.STOPPED), Decision(143, False, "x", {}))
    assert not policy.terminated(RoundEnd(Outcome.DONE), Decision(0, False, None, {}))


def test_an_elastic_job_re_forming_after_a_loss_kills_blocked_workers_quickly():
    again = Decision(1, True, "x", {}, True)
    lost = RoundEnd(Outcome.LOST, 1, lost=(2,))
    assert policy.kill_grace(lost, again, elastic=True) == policy.KILL_GRACE
    assert policy.kill_grace(lost, again, elastic=False) == TERM_GRACE
    assert policy.kill_grace(RoundEnd(Outcome.STOPPED), Decision(0, True, None, {}),
                             elastic=True) == TERM_GRACE


# ------------------------------------------------------------------ admission
def test_a_joining_node_needs_a_free_rank_below_max_and_room_in_the_job():
    assert policy.admission_refusal(2, {0, 1}, 2, 3) is None
    assert policy.admission_refusal(1, {0, 1}, 2, 3).startswith(
        "node rank 1 is taken or out of range [1, 3) (nodes now in the job: 0, 1)")
    assert "out of range" in policy.admission_refusal(3, {0}, 2, 3)
    assert "out of range" in policy.admission_refusal(0, {0}, 2, 3)
    assert "out of range" in policy.admission_refusal("1", {0}, 2, 3)
    # a full job says so rather than that every rank is taken
    assert policy.admission_refusal(2, {0, 1, 2}, 2, 3) == (
        "the job already has its maximum of 3 nodes (--nnodes 2:3)")


def test_the_first_round_starts_at_max_or_after_the_last_call_with_min():
    assert policy.ready_to_start(3, 0.0, 2, 3, 10.0)
    assert not policy.ready_to_start(2, 9.9, 2, 3, 10.0)
    assert policy.ready_to_start(2, 10.0, 2, 3, 10.0)
    assert not policy.ready_to_start(1, 60.0, 2, 3, 10.0)


def test_the_first_round_waits_for_launchers_still_saying_hello_unless_max_joined():
    assert not policy.ready_to_start(2, 10.0, 2, 3, 10.0, arriving=1)
    assert policy.ready_to_start(3, 0.0, 2, 3, 10.0, arriving=5)


def test_waiting_nodes_come_in_lowest_rank_first_up_to_max():
    assert policy.admitted({3, 1, 2}, members=0, max_nodes=3) == [1, 2]
    assert policy.admitted({2}, members=2, max_nodes=3) == []
    assert policy.admitted({4, 2}, members=1, max_nodes=5) == [2, 4]


def test_what_every_node_hears_as_the_next_round_starts():
    changed = policy.formation_news(RoundEnd(Outcome.LOST, lost=(2,)),
                                    elastic(nodes=2, workers=2, restarts=1, reformations=1),
                                    changed=True)
    assert changed == ("re-forming with 2 nodes (2 workers) from checkpoint epoch 1 step 20 "
                       "(re-formation 1; restart 1 of at most 3)")
    planned = policy.formation_news(RoundEnd(Outcome.STOPPED), elastic(checkpoint=None),
                                    changed=False)
    assert planned.startswith("the workers stopped at a step boundary") and \
        "(none was saved since the launcher started) (planned: no restart used)" in planned
    assert policy.formation_news(RoundEnd(Outcome.FAILED), static(restarts=1),
                                 changed=False) == "restarting the job on every node (1 of 1)"


def test_a_round_needs_a_worker_and_on_ps_lite_a_server():
    assert policy.round_problem([2, 0], [1, 0], "dist_sync") is None
    assert policy.round_problem([0, 0], [1, 1], "p3").startswith("no node of this job runs "
                                                                 "workers")
    assert "ps-lite server" in policy.round_problem([1, 1], [0, 0], "dist_async")
    assert policy.round_problem([1, 1], [0, 0], "horovod") is None


# ------------------------------------------------------------------ planned stops
def test_a_stop_ends_right_after_a_checkpoint_unless_the_workers_agreed_to_stop():
    stop = StopRequest(1, "admit", None, saves=2)
    assert stop.ended(saves=2, acked=False, now=100.0) is None
    assert stop.ended(saves=3, acked=False, now=101.0) == RoundEnd(Outcome.STOPPED)
    asked = StopRequest(2, "preempt", 1, saves=2, deadline=200.0)
    assert asked.ended(saves=3, acked=True, now=101.0) is None          # exiting itself
    assert asked.ended(saves=3, acked=True, now=101.0 + policy.CHECKPOINT_EXIT + 0.1) == \
        RoundEnd(Outcome.STOPPED, lost=(1,))
    late = StopRequest(3, "preempt", 2, saves=0, deadline=200.0)
    assert late.ended(saves=0, acked=False, now=199.0) is None
    assert late.ended(saves=0, acked=False, now=201.0) == RoundEnd(Outcome.STOPPED, lost=(2,),
                                                                   late=True)


# ------------------------------------------------------------------ the wire
def test_every_message_reads_back_as_it_was_sent():
    spec = protocol.RoundSpec("horovod", 2, [0, 1], 2, 0, 3, 1, True, "10.0.0.1", "gloo",
                              [None, "h1"], [2, 2], [0, 0], rendezvous_port=4242)
    to_node = [protocol.Start(spec), protocol.Hint(5), protocol.Verdicts({1: 2}),
               protocol.StacksRequest([1, 3]), protocol.Stop(2), protocol.News("re-forming"),
               protocol.End(1, True, "why", True, 0.5), protocol.End(2, False, "no"),
               protocol.Tick(), protocol.Redirect("10.0.0.2", 29500, "node 1 (h1)")]
    for message in to_node:
        wire = json.loads(json.dumps(message.to_wire()))
        assert protocol.from_master(wire) == message
    to_master = [protocol.Status([{"rank": 0}], None, True), protocol.StacksFound({3: "st"}),
                 protocol.Stopped(), protocol.Idle(), protocol.Preempt(),
                 protocol.Hello(1, "h1", 2, 1)]
    for message in to_master:
        wire = json.loads(json.dumps(message.to_wire()))
        assert protocol.from_node(wire) == message
    assert protocol.from_node({"type": "something new"}) is None


def test_the_wire_form_is_the_one_launchers_have_always_exchanged():
    # a refusal carries no terminated/grace (the node decides from the status)
    assert protocol.End(2, False, "full").to_wire() == {
        "type": "end", "status": 2, "again": False, "report": "full"}
    spec = protocol.RoundSpec("p3", 1, [0], 1, 1, 0, 0, False, "127.0.0.1", "gloo", [None],
                              [1], [1], scheduler_port=9000)
    assert set(spec.to_wire()) == {
        "backend", "nnodes", "nodes", "nproc", "servers", "restart", "reformation",
        "elastic", "master_addr", "transport", "hosts", "slots", "server_counts",
        "scheduler_port"}
    # node 0 stamps a status on arrival; the stamp never travels
    status = dataclasses.replace(protocol.Status(), received=12.5)
    assert "received" not in status.to_wire()


# ------------------------------------------------------------------ the configuration
def test_the_command_line_becomes_one_frozen_configuration(monkeypatch):
    monkeypatch.delenv("DG_JOB_SECRET", raising=False)
    config = cli.parse(["-n", "2", "--backend", "p3", "--stall-warning", "0", "--",
                        "python", "x.py"])
    assert isinstance(config, LaunchConfig)
    assert (config.num_workers, config.backend, config.command) == (2, "p3",
                                                                   ("python", "x.py"))
    assert config.stall_warning is None and config.node_rank == 0 and not config.over_ssh
    assert config.job_secret and config.job_secret not in repr(config)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.num_workers = 3
    fan = cli.parse(["-H", "a:2,b:2", "--", "python", "x.py"])
    assert fan.over_ssh and fan.host_slots == (("a", 2, None), ("b", 2, None))
    assert fan.node_rank is None and fan.job_secret is None


# ------------------------------------------------------------------ succession
def test_a_quorum_is_a_strict_majority_of_the_last_formation_or_the_half_with_its_lowest_rank():
    assert policy.quorum([1, 2], [0, 1, 2])             # node 0 lost: 2 of 3
    assert not policy.quorum([0], [0, 1, 2])            # node 0 cut off: 1 of 3
    assert not policy.quorum([2], [1, 2])               # 1 of 2 without the lowest
    assert policy.quorum([1], [1, 2])                   # ... with it
    assert policy.quorum([0, 1], [0, 1, 2, 3]) and not policy.quorum([2, 3], [0, 1, 2, 3])
    assert not policy.quorum([5], [0, 1, 2])            # not a member: counts for nothing
    # no two disjoint sides of any formation both have a quorum (no split brain)
    formation = [0, 2, 3, 5]
    for mask in range(1 << len(formation)):
        side = [n for i, n in enumerate(formation) if mask >> i & 1]
        other = [n for n in formation if n not in side]
        assert not (policy.quorum(side, formation) and policy.quorum(other, formation))


class _Link:
    """A node's link as the host sees it, recording what it was sent."""

    def __init__(self):
        self.sent, self.closed, self.peer = [], False, "10.0.0.9:1"

    def send(self, message, text=None):
        self.sent.append(message)

    def close(self, flush=None):
        self.closed = True


def test_a_host_whose_nodes_fall_silent_one_after_the_other_ends_as_a_minority(
        monkeypatch):
    # node 0 cut off from nodes 1 and 2: node 1's silence ends the round (2 of 3 remain,
    # a quorum), node 2 then does not confirm its end; node 0 alone must not go on while
    # nodes 1 and 2 elect a host of their own (seen in CI under load)
    from dist_gluon.launch.formation import Peer
    from dist_gluon.launch.master import Master

    monkeypatch.setenv("DG_JOB_SECRET", "s" * 64)
    said = []
    out = type("Out", (), {"say": staticmethod(said.append)})()
    config = cli.parse(["--nnodes", "1:3", "--node-rank", "0", "--master-addr", "10.0.0.1",
                        "--master-port", "29500", "-n", "1", "--", "python", "x.py"])
    master = Master(config, out, None)
    link = _Link()
    master.formation.members = {2: Peer(2, link, protocol.Hello(2, "h2", 1, 0))}
    master.last_formation = (0, 1, 2)
    status = master._next_formation([2], RoundEnd(Outcome.LOST, 1, "", lost=(1,)))
    assert status == 1
    assert any("only 1 of the last formation's 3 nodes remain here" in s for s in said), said
    assert not any("re-forming" in s for s in said), said
    # with a quorum left the job goes on: the host and node 1 of 0, 1, 2
    master = Master(config, out, None)
    master.formation.members = {1: Peer(1, _Link(), protocol.Hello(1, "h1", 1, 0)),
                                2: Peer(2, _Link(), protocol.Hello(2, "h2", 1, 0))}
    master.last_formation = (0, 1, 2)
    assert master._next_formation([2], RoundEnd(Outcome.LOST, 1, "", lost=())) is None


def test_the_next_host_is_the_lowest_rank_left_and_each_node_tries_those_below_it():
    assert policy.successor([0, 1, 2], [0]) == 1
    assert policy.successor([1, 2], [1]) == 2
    assert policy.successor([0], [0]) is None
    assert policy.candidates([0, 1, 2], host=0, me=2) == [1, 2]
    assert policy.candidates([0, 1, 2], host=0, me=1) == [1]
    assert policy.candidates([1, 2, 4], host=1, me=4) == [2, 4]


def test_a_host_that_keeps_no_quorum_ends_the_job_naming_why():
    lost = RoundEnd(Outcome.LOST, 1, "node 1 (h1) lost; node 2 (h2) lost", lost=(1, 2))
    cut_off = policy.decide(lost, elastic(min_nodes=1, formation=(0, 1, 2)))
    assert not cut_off.again and cut_off.status == 1
    assert cut_off.report.endswith(
        "only 1 of the last formation's 3 nodes remain here (node 0 (h0)), not a majority: "
        "a node cannot tell dead peers from a cut link, and the others may go on as the "
        "job, so this side ends (no split brain)")
    # without the addresses (an older node) the job goes on as before
    assert policy.decide(lost, elastic(min_nodes=1)).again
    # MIN is checked first; the half with the lowest rank goes on
    one = RoundEnd(Outcome.LOST, 1, "node 2 (h2) lost", lost=(2,))
    assert policy.decide(one, elastic(min_nodes=1, nodes=2, host=1,
                                      formation=(1, 2))).again


def test_a_preempted_host_hands_the_job_over_to_the_lowest_node_left():
    handover = policy.decide(RoundEnd(Outcome.STOPPED, lost=(0,)),
                             elastic(formation=(0, 1, 2)))
    assert handover == Decision(0, True, (
        "node 0 (h0) was preempted (SIGTERM) and left the job; the workers saved "
        "checkpoint epoch 1 step 20; node 1 (h1) takes over as the job's host and the "
        "other nodes go on under it"), {}, handover=True)
    below = policy.decide(RoundEnd(Outcome.STOPPED, lost=(0,)),
                          elastic(nodes=2, formation=(0, 1)))
    assert below.status == 128 + signal.SIGTERM and not below.again
    assert "1 node left, fewer than the minimum 2" in below.report


def test_a_round_spec_lists_each_nodes_address_only_when_every_node_gave_one():
    spec = protocol.RoundSpec("horovod", 2, [1, 2], 1, 0, 4, 2, True, "10.0.0.2", "gloo",
                              ["h1", "h2"], [1, 1], [0, 0], rendezvous_port=4242,
                              addresses=[["10.0.0.2", 4001], ["10.0.0.3", 4002]],
                              restarts=1)
    assert protocol.from_master(json.loads(json.dumps(protocol.Start(spec).to_wire()))) \
        == protocol.Start(spec)
    assert spec.host == 1 and spec.name(2) == "node 2 (h2)"
    hello = protocol.Hello(2, "h2", 1, None, "10.0.0.3", 4002)
    assert protocol.from_node(json.loads(json.dumps(hello.to_wire()))) == hello
    assert "addr" not in protocol.Hello(2, "h2", 1).to_wire()
    for message in (protocol.Saved(3, 12), protocol.End(0, True, "over", handover=True)):
        assert protocol.from_master(json.loads(json.dumps(message.to_wire()))) == message


# ------------------------------------------------------------------ the end of a job
class _View:
    """What the supervisor sees of a job: verdicts given and lines said."""

    def __init__(self):
        self.verdicts, self.said = {}, []

    def set_verdicts(self, verdicts):
        self.verdicts.update(verdicts)

    def say(self, line):
        self.said.append(line)


def _departed(rank: int, returncode) -> dict:
    from dist_gluon import jobcontrol
    return {"rank": rank, "host": "h0", "attached": True, "count": 40,
            "phase": jobcontrol.DEPARTING, "departed_at": 1.0, "exception": None,
            "returncode": returncode, "tail": [], "left_at": 1.0, "key_next": None,
            "key_last": "w"}


def test_ranks_stuck_in_the_backends_shutdown_after_their_work_end_as_finished_in_time():
    """A rank that finished its script with every collective done but never returns
    from the backend's shutdown (ps-lite's final barrier lost its reply) does not hang
    the job: after SHUTDOWN_LIMIT it ends as finished, saying so."""
    from dist_gluon import jobcontrol
    from dist_gluon.launch import supervisor
    view = _View()
    judge = supervisor.Supervisor(view, stall_warning=None, stall_timeout=None)
    states = [_departed(0, 0), _departed(1, None)]
    assert judge.check(states, now=100.0) is None
    assert view.verdicts == {1: jobcontrol.FINALIZE}
    assert judge.check(states, now=100.0 + supervisor.SHUTDOWN_LIMIT - 1) is None
    assert view.said == []
    verdict = judge.check(states, now=100.0 + supervisor.SHUTDOWN_LIMIT)
    assert verdict is not None and verdict.ok
    assert view.said == [f"rank 1 finished the script but is still in the backend's "
                         f"shutdown after {supervisor.SHUTDOWN_LIMIT:g} s (every collective "
                         "of every rank had completed, so nothing is lost): ending it"]
    # one that exits in time needs no words
    judge = supervisor.Supervisor(_View(), None, None)
    assert judge.check(states, now=0.0) is None
    assert judge.check([_departed(0, 0), _departed(1, 0)], now=1.0).ok


def test_the_scheduler_of_a_p3_job_runs_the_plain_van():
    """ps-lite's P3 van can drop the scheduler's replies to the final barrier (equal
    priorities leave its queue in any order, its TERMINATE included): the scheduler,
    which sends only control messages, runs ZeroMQ's plain van; servers and workers P3."""
    from dist_gluon.launch import jobenv
    common = jobenv.pslite_env("10.0.0.1", 9000, 2, 1, "10.0.0.1", p3=True)
    assert common["DMLC_PS_VAN_TYPE"] == "p3"
    scheduler = jobenv.scheduler_env(common)
    assert "DMLC_PS_VAN_TYPE" not in scheduler and scheduler["DMLC_ROLE"] == "scheduler"
    assert scheduler["DMLC_PS_ROOT_URI"] == "10.0.0.1"
    assert common["DMLC_PS_VAN_TYPE"] == "p3"       # the others' environment unchanged


def test_a_node_that_does_not_host_sends_joiners_on_and_keeps_electing_nodes():
    """At an elastic node's door, a launcher that joins (a node rank not in the last
    formation) is sent on to the host; one of the formation (electing the next host)
    is kept for this node to take over."""
    from dist_gluon.launch import succession

    class Door:
        def __init__(self, hellos):
            self.hellos, self.kept = hellos, []

        def poll(self):
            hellos, self.hellos = self.hellos, []
            return hellos

        def keep(self, link, hello):
            self.kept.append((link, hello))

    joiner, elector = _Link(), _Link()
    door = Door([(joiner, {"node": 3, "host": "h3"}), (elector, {"node": 2, "host": "h2"})])
    spec = protocol.RoundSpec("horovod", 2, [1, 2], 1, 0, 4, 2, True, "10.0.0.2", "gloo",
                              [None, "h2"], [1, 1], [0, 0])
    said = []
    succession.send_on(door, spec, ("10.0.0.2", 29500, "node 1 (h1)"), said.append)
    assert joiner.sent == [protocol.Redirect("10.0.0.2", 29500, "node 1 (h1)")]
    assert joiner.closed and not elector.sent and not elector.closed
    assert door.kept == [(elector, {"node": 2, "host": "h2"})]
    assert said == ["node 3 (h3) joined through this node, which does not host the job: "
                    "sent it on to node 1 (h1) at 10.0.0.2:29500"]


def test_the_host_goes_on_ticking_while_it_ends_a_round(monkeypatch):
    """Ending this node's processes (SIGTERM, SIGKILL after the grace) and waiting for
    the others' can take longer than --silence-limit: the nodes must go on hearing from
    the host meanwhile, or they would take it for lost and elect another."""
    import time as _time

    from dist_gluon.launch.formation import Peer
    from dist_gluon.launch.master import Master

    monkeypatch.setenv("DG_JOB_SECRET", "s" * 64)
    config = cli.parse(["--nnodes", "1:3", "--node-rank", "0", "--master-addr", "10.0.0.1",
                        "--master-port", "29500", "-n", "1", "--heartbeat", "0.05",
                        "--silence-limit", "1", "--", "python", "x.py"])
    master = Master(config, type("Out", (), {"say": staticmethod(lambda line: None)})(),
                    None)

    class ConfirmingLink(_Link):
        def receive(self, timeout=None):
            return protocol.Stopped().to_wire()

        def gone(self, silence):
            return False

    member = ConfirmingLink()
    master.formation.members = {1: Peer(1, member, protocol.Hello(1, "h1", 1, 0))}
    slow = type("Node", (), {"terminate": lambda self, grace: _time.sleep(0.5)})()
    decision = Decision(1, True, "re-forming", {})
    assert master._end_round(slow, RoundEnd(Outcome.FAILED, 1, "x"), decision) == []
    ticks = [m for m in member.sent if isinstance(m, protocol.Tick)]
    assert len(ticks) >= 5, member.sent
    assert isinstance(member.sent[0], protocol.End)


def _spec3(host_first=(0, 1, 2)) -> protocol.RoundSpec:
    return protocol.RoundSpec("dist_sync", 3, list(host_first), 1, 1, 2, 1, True, "10.0.0.1",
                              "gloo", [None, "h1", "h2"], [1, 1, 1], [1, 1, 1],
                              scheduler_port=9000,
                              addresses=[["10.0.0.1", 29500], ["10.0.0.2", 29500],
                                         ["10.0.0.3", 29500]])


def _elastic_config(monkeypatch, node_rank: int, nnodes: str = "1:3"):
    monkeypatch.setenv("DG_JOB_SECRET", "s" * 64)
    return cli.parse(["--nnodes", nnodes, "--node-rank", str(node_rank), "--master-addr",
                      "10.0.0.1", "--master-port", "29500", "-n", "1", "--silence-limit",
                      "0.2", "--heartbeat", "0.05", "--", "python", "x.py"])


def test_which_nodes_may_elect_a_host_and_when_the_rest_cannot_go_on(monkeypatch):
    from dist_gluon.launch import succession
    spec = _spec3()
    node2 = _elastic_config(monkeypatch, 2)
    assert succession.can_succeed(node2, spec)
    assert not succession.can_succeed(node2, None)                      # never ran a round
    assert not succession.can_succeed(_elastic_config(monkeypatch, 0), spec)  # the host
    assert not succession.can_succeed(node2, dataclasses.replace(spec, addresses=None))
    # 2 of 3 left: a quorum, and MIN 1 allows it
    assert succession.hopeless(node2, spec, planned=False) is None
    # MIN 3: the 2 left are too few, whoever they are
    strict = _elastic_config(monkeypatch, 2, nnodes="3:3")
    assert "its loss ends the job, since the other nodes of the last formation (2 nodes) " \
           "are fewer than the minimum 3" in succession.hopeless(strict, spec, planned=False)
    # of a formation of 2, the one left without the lowest rank has no quorum, unless
    # the host left on purpose (a planned handover counts over the nodes that remain)
    pair = dataclasses.replace(spec, nodes=[0, 2], nnodes=2, hosts=[None, "h2"],
                               slots=[1, 1], server_counts=[1, 1],
                               addresses=[["10.0.0.1", 29500], ["10.0.0.3", 29500]])
    assert "not a majority" in succession.hopeless(node2, pair, planned=False)
    assert succession.hopeless(node2, pair, planned=True) is None


def test_a_node_that_reaches_no_lower_candidate_hosts_the_job_itself(monkeypatch):
    from dist_gluon.launch import channel, succession
    said = []
    tried = []

    def unreachable(addr, port, hello, timeout, secret):
        tried.append((addr, port))
        raise channel.JoinError("no answer")

    monkeypatch.setattr(succession, "connect_to_master", unreachable)
    node2 = _elastic_config(monkeypatch, 2)
    assert succession.elect(node2, _spec3(), {"node": 2}, said.append) is None
    assert tried == [("10.0.0.2", 29500)]               # node 1 only: node 0 is the lost host
    assert said == ["node 1 at 10.0.0.2:29500 did not answer within 0.4 s: trying the "
                    "next node"]
    # the first candidate that answers is the new host
    link = object()
    monkeypatch.setattr(succession, "connect_to_master", lambda *a: link)
    assert succession.elect(node2, _spec3(), {"node": 2}, said.append) == (link, 1)


def test_an_elastic_nodes_door_takes_the_master_port_unless_node_0_is_on_its_machine(
        monkeypatch):
    from dist_gluon.launch import node as node_module
    from dist_gluon.launch import succession
    port = node_module.free_port()
    monkeypatch.setenv("DG_JOB_SECRET", "s" * 64)
    here = cli.parse(["--nnodes", "1:3", "--node-rank", "1", "--master-addr", "127.0.0.1",
                      "--master-port", str(port), "-n", "1", "--", "python", "x.py"])
    door = succession.open_door(here, lambda line: None)
    try:
        assert door.port != port        # node 0 on this very machine holds --master-port
    finally:
        door.close()
    # elsewhere (node 0 at an address not on this machine) the door is on --master-port
    monkeypatch.setattr(succession, "_same_machine", lambda addr: False)
    door = succession.open_door(here, lambda line: None)
    try:
        assert door.port == port
        # taken: any free port instead
        other = succession.open_door(here, lambda line: None)
        assert other.port != port
        other.close()
    finally:
        door.close()
    static = cli.parse(["--nnodes", "2", "--node-rank", "1", "--master-addr", "127.0.0.1",
                        "-n", "1", "--", "python", "x.py"])
    assert succession.open_door(static, lambda line: None) is None


def test_a_preempted_host_hears_out_the_nodes_preempted_with_it():
    """SLURM signals every node at once; a checkpoint right after the signal can end
    the round on the host before the others' notices arrive, and the host would hand
    the job to a node that is leaving too. It waits (at most PREEMPT_SETTLE) for them."""
    import queue
    import threading
    import time as _time

    from dist_gluon.launch.rounds import JobView

    class Inbox:
        def __init__(self):
            self.inbox = queue.Queue()

    prompt, late, silent = Inbox(), Inbox(), Inbox()
    view = JobView(None, {1: prompt, 2: late}, None)
    prompt.inbox.put(protocol.Preempt().to_wire())
    threading.Timer(0.3, late.inbox.put, [protocol.Preempt().to_wire()]).start()
    began = _time.monotonic()
    view.await_preemptions(5.0)
    assert sorted(view.preempted) == [1, 2]
    assert 0.25 < _time.monotonic() - began < 2.0       # returns once all have said so
    view = JobView(None, {1: prompt, 3: silent}, None)   # node 3 is not preempted
    began = _time.monotonic()
    view.await_preemptions(0.4)
    assert view.preempted == [] and 0.35 < _time.monotonic() - began < 2.0


def test_the_host_waits_for_a_node_that_beats_while_its_processes_end():
    """A node whose processes take longer than --silence-limit to end (slow exit
    handlers, a server's shutdown) goes on beating and is waited for, up to the kill
    grace on top; a node that falls silent is given up after the silence limit."""
    import queue
    import threading
    import time as _time

    from dist_gluon.launch.master import _wait_stopped

    class Beating:
        """Idle beats every 0.05 s, Stopped after ``after`` seconds (None: never), or
        silence from the start when ``silent``."""

        def __init__(self, after, silent=False):
            self.inbox, self.heard = queue.Queue(), _time.monotonic()
            self.silent = silent
            if not silent:
                threading.Thread(target=self._beat, args=(after,), daemon=True).start()

        def _beat(self, after):
            began = _time.monotonic()
            while after is None or _time.monotonic() - began < after:
                self.inbox.put(protocol.Idle().to_wire())
                self.heard = _time.monotonic()
                _time.sleep(0.05)
            self.inbox.put(protocol.Stopped().to_wire())

        def receive(self, timeout=None):
            return self.inbox.get(timeout=timeout)

        def gone(self, silence):
            return _time.monotonic() - self.heard > silence

    said = []
    out = type("Out", (), {"say": staticmethod(said.append)})()
    began = _time.monotonic()
    # ends its processes in 0.6 s, twice the silence limit, within the grace
    assert _wait_stopped({1: Beating(0.6)}, out, 0.3, [], grace=1.0) == []
    assert said == [] and _time.monotonic() - began >= 0.55
    # beats for ever: given up at grace + silence limit
    began = _time.monotonic()
    assert _wait_stopped({1: Beating(None)}, out, 0.3, [], grace=0.5) == [1]
    assert 0.7 < _time.monotonic() - began < 1.5
    # silent: given up after the silence limit
    began = _time.monotonic()
    assert _wait_stopped({2: Beating(None, silent=True)}, out, 0.3, [], grace=5.0) == [2]
    assert _time.monotonic() - began < 1.0
    assert said == ["node 1 did not confirm that its processes ended",
                    "node 2 did not confirm that its processes ended"]


def test_workers_that_keep_their_state_in_memory_are_told_so_never_a_checkpoint():
    # dist_gluon.elastic.run: processes kept (horovod), or nodes' shared memory (ps-lite)
    assert policy.in_memory([{"keeps": True}, {"node_copy": True}])
    assert not policy.in_memory([{"node_copy": True}, {"keeps": False, "node_copy": False}])
    assert not policy.in_memory([])
    # workers started again after a re-formation that have not said yet (not attached,
    # or attached before any collective) count as the round before: a node joining in
    # that moment is told the job re-forms at their next commit, as it does
    starting = [{"attached": False}, {"attached": True, "count": 0, "node_copy": False}]
    assert policy.in_memory(starting, before=True)
    assert not policy.in_memory(starting, before=False)
    assert not policy.in_memory([*starting, {"attached": True, "count": 4}], before=True)
    memory = elastic(memory=True, nodes=2, workers=2, restarts=1, reformations=1)
    news = policy.formation_news(RoundEnd(Outcome.LOST, lost=(2,)), memory, changed=True)
    assert news == ("re-forming with 2 nodes (2 workers) from the workers' last commit in "
                    "memory (they restart and take the freshest from their nodes' shared "
                    "memory; a new node's workers get it from a live peer) (re-formation 1; "
                    "restart 1 of at most 3)")
    kept = policy.formation_news(RoundEnd(Outcome.LOST, lost=(2,)), memory, changed=True,
                                 keep=True)
    assert "(their processes stay; new workers get the state from them)" in kept
    leaving = policy.decide(RoundEnd(Outcome.STOPPED, lost=(2,)), elastic(memory=True))
    assert leaving.leaving[2] == ("node 2 (h2) was preempted (SIGTERM) and left the job; "
                                  "the workers committed their state at a step boundary; "
                                  "the other nodes go on without it")
    late = policy.decide(RoundEnd(Outcome.STOPPED, lost=(2,), late=True),
                         elastic(memory=True))
    assert "the steps since their last commit are lost" in late.leaving[2]
    alone = policy.decide(RoundEnd(Outcome.STOPPED, lost=(0,)),
                          elastic(memory=True, formation=(0,)))
    assert "the state they kept in memory ends with the job" in alone.report
    assert "checkpoint" not in news + leaving.leaving[2]


def _running(rank: int, count: int, key: str, recent: list[str] | None = None) -> dict:
    return {"rank": rank, "host": "h0", "attached": True, "count": count, "phase": 1,
            "departed_at": None, "exception": None, "returncode": None, "tail": [],
            "left_at": None, "key_next": None, "key_last": key, "keys_recent": recent}


class _StallView(_View):
    def stacks(self, ranks):
        return {rank: f"stack of {rank}" for rank in ranks}

    def process_report(self):
        return ["ps-lite server0 (pid 7 on h0) is stopped (SIGSTOP, or a debugger)"]


def test_ranks_with_as_many_collectives_but_different_last_keys_are_a_stall():
    """Two ranks that each submitted 12 collectives, the last ones different (rank 0 in
    a sum of its own, rank 1 in the step's), wait for each other forever: reported at
    --stall-warning with both keys and stacks, ended at --stall-timeout. Ranks whose
    last keys agree may be computing: after --stall-warning without a collective they
    are reported (they may as well all wait in one their transport does not complete,
    behind a stopped ps-lite server), with the job's processes that do not run and the
    stacks, but never ended."""
    from dist_gluon.launch import supervisor
    view = _StallView()
    judge = supervisor.Supervisor(view, stall_warning=10.0, stall_timeout=20.0)
    agree = [_running(0, 12, "t1.0"), _running(1, 12, "t1.0")]
    assert judge.check(agree, now=0.0) is None
    assert judge.check(agree, now=9.0) is None and view.said == []
    assert judge.check(agree, now=100.0) is None        # not ended at --stall-timeout
    assert len(view.said) == 1
    said = view.said[0]
    assert said.startswith("stall: no rank has submitted a collective for 100 s; every "
                           "rank's last was #12 (key 't1.0').")
    assert "ps-lite server0 (pid 7 on h0) is stopped" in said
    assert "stack of 0" in said and "stack of 1" in said
    view.said.clear()
    apart = [_running(0, 12, "extra"), _running(1, 12, "__dg_stop")]
    assert judge.check(apart, now=100.0) is None
    assert judge.check(apart, now=109.0) is None and view.said == []
    assert judge.check(apart, now=110.0) is None
    assert len(view.said) == 1
    said = view.said[0]
    assert said.startswith("stall: ranks 0, 1 have each submitted 12 collectives")
    assert "rank 0 (h0) in key 'extra'; rank 1 (h0) in key '__dg_stop'" in said
    assert "stack of 0" in said and "stack of 1" in said
    verdict = judge.check(apart, now=120.0)
    assert verdict is not None and not verdict.ok and verdict.status == 124
    assert verdict.report.endswith("stall timeout (20 s).")


def test_a_kept_worker_not_yet_in_its_round_is_no_stall():
    """A worker kept through a re-formation still shows the round before's collectives
    until it enters the new one: ranks that wait for it at the rendezvous are not
    reported as waiting for a collective it has not reached (its launcher kills it if
    it never enters); once it has entered, the counts are compared again."""
    from dist_gluon.launch import supervisor
    view = _StallView()
    judge = supervisor.Supervisor(view, stall_warning=1.0, stall_timeout=2.0)
    entering = [_running(0, 1, "connect (horovod)"), _running(1, 222, "__dg_stop")]
    entering[1]["entering"] = True
    assert judge.check(entering, now=0.0) is None
    assert judge.check(entering, now=30.0) is None and view.said == []
    entering[1]["entering"] = False
    assert judge.check(entering, now=30.0) is None
    assert judge.check(entering, now=31.0) is None and len(view.said) == 1


def test_a_stall_names_the_collectives_a_rank_submitted_that_the_others_did_not():
    """MXNet's engine may submit a step's SyncBatchNorm backward after the script's next
    forward: rank 0's last key is then the backward, which rank 1 has too. Among the
    last keys of each (the same collective numbers), the stall names those one rank has
    and the other has not: rank 0's extra forward, rank 1's stop flag."""
    from dist_gluon.launch import supervisor
    view = _StallView()
    judge = supervisor.Supervisor(view, stall_warning=1.0, stall_timeout=None)
    step = ["f", "b", "t1.0", "__dg_stop"]
    rank0 = step + ["f", "t1.0", "f", "b"]            # the forward, then last step's backward
    rank1 = step + step
    apart = [_running(0, 40, "b", rank0), _running(1, 40, "__dg_stop", rank1)]
    judge.check(apart, now=0.0)
    judge.check(apart, now=2.0)
    assert "rank 0 (h0) in key 'f'; rank 1 (h0) in key '__dg_stop'" in view.said[0]
    # a rank that did not report its keys (its count moved at the last look): last keys
    view.said.clear()
    judge = supervisor.Supervisor(view, stall_warning=1.0, stall_timeout=None)
    apart[1] = _running(1, 40, "__dg_stop")
    judge.check(apart, now=0.0)
    judge.check(apart, now=2.0)
    assert "rank 0 (h0) in key 'b'; rank 1 (h0) in key '__dg_stop'" in view.said[0]


# ------------------------------------------------- a round whose workers all still run
def _round_watch(restart: int):
    watch = RoundWatch.__new__(RoundWatch)      # the method reads the round's number only
    watch.view = SimpleNamespace(node=SimpleNamespace(spec=SimpleNamespace(restart=restart)))
    watch._parked_since = None
    return watch


def _worker(rank: int, parked_round=None, acked=False, returncode=None) -> dict:
    return {"rank": rank, "parked_round": parked_round, "acked": acked,
            "returncode": returncode}


def test_a_round_every_running_worker_left_ends_as_a_failure_at_once():
    watch = _round_watch(restart=2)
    end = watch._left_round([_worker(0, parked_round=2), _worker(1, parked_round=2)], 10.0)
    assert end is not None and end.outcome is Outcome.FAILED and end.status == 1
    assert "the collectives of ranks 0, 1 failed while every worker still ran" in end.report


def test_a_round_one_worker_left_ends_after_the_others_had_time_to_follow():
    watch = _round_watch(restart=2)
    states = [_worker(0), _worker(1, parked_round=2)]
    assert watch._left_round(states, 100.0) is None
    assert watch._left_round(states, 100.0 + PARKED_SETTLE - 0.1) is None
    end = watch._left_round(states, 100.0 + PARKED_SETTLE)
    assert end.outcome is Outcome.FAILED and "the collectives of rank 1 failed" in end.report


@pytest.mark.parametrize("states", [
    [_worker(0), _worker(1)],                                       # all in the round
    [_worker(0, parked_round=1), _worker(1, parked_round=1)],      # the round before's
    [_worker(0, parked_round=2, acked=True), _worker(1, parked_round=2, acked=True)],
    [_worker(0, parked_round=2), _worker(1, returncode=-9)],       # a death: supervisor's
])
def test_no_failure_while_a_worker_is_in_the_round_stopped_on_request_or_dead(states):
    watch = _round_watch(restart=2)
    assert watch._left_round(states, 0.0) is None
    assert watch._left_round(states, 1000.0) is None


def test_the_settling_time_starts_again_once_no_worker_has_left():
    watch = _round_watch(restart=2)
    one_left = [_worker(0), _worker(1, parked_round=2)]
    assert watch._left_round(one_left, 0.0) is None
    assert watch._left_round([_worker(0), _worker(1)], 1.0) is None
    assert watch._left_round(one_left, PARKED_SETTLE + 1.0) is None
