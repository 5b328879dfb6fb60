"""horovod's cycle time, tuned on a job's first steps (dist_gluon/backends/horovod_tuning.py):
the choice is made, printed once by rank 0, kept, the user's variables win, and the
launcher's --no-tune turns it off. The choice itself depends on the machine's timing, so
the jobs assert that a choice was made and held, never which one; the rule that turns
step times into a choice is checked with given times."""
from __future__ import annotations

import re
import subprocess
import sys

import pytest

from conftest import REPO, assert_ok, launch, process_env, worker_lines
from dist_gluon.backends import horovod_tuning
from dist_gluon.backends.horovod_tuning import CYCLE_ENV, Tuner

# A tiny model trained for enough steps to tune and then run on, each step made
# sys.argv[1] seconds longer (a step of a few milliseconds keeps the default cycle
# without trying another); every hvd.init() of the process is counted, so that "kept"
# means horovod was not started again after the choice. Prints the cycle horovod was
# last started with, on every rank.
SCRIPT = r"""
import os, sys, time
import horovod.mxnet as hvd
import mxnet as mx
from mxnet import autograd, gluon

starts = []
_init = hvd.init
def counted_init(*args, **kwargs):
    starts.append(os.environ.get("HOROVOD_CYCLE_TIME"))
    return _init(*args, **kwargs)
hvd.init = counted_init

import dist_gluon as dg

kv = dg.create()
net = gluon.nn.Dense(4, in_units=8)
net.initialize(mx.init.Constant(0.1))
trainer = dg.DistributedTrainer(net.collect_params(), "sgd", {"learning_rate": 0.01}, kv=kv)
x = mx.nd.ones((2, 8)) * (kv.rank + 1)

def steps(count):
    for _ in range(count):
        time.sleep(float(sys.argv[1]))
        with autograd.record():
            loss = net(x).sum()
        loss.backward()
        trainer.step(2)
    mx.nd.waitall()

steps(int(sys.argv[2]))             # the tuning's steps, and more
after_tuning = list(starts)
if sys.argv[3:] == ["syncbn"]:      # SyncBatchNorm's chained sums from here on
    net = gluon.nn.HybridSequential()
    net.add(gluon.nn.Dense(4, in_units=8), dg.SyncBatchNorm(in_channels=4))
    net.initialize(mx.init.Constant(0.1))
    trainer = dg.DistributedTrainer(net.collect_params(), "sgd", {"learning_rate": 0.01},
                                    kv=kv)
steps(10)
weight = next(iter(net.collect_params().values()))
print(f"STARTS {starts} AFTER_TUNING {after_tuning} "
      f"CYCLE {os.environ.get('HOROVOD_CYCLE_TIME')} "
      f"WEIGHTS {kv.allgather_object(float(weight.data().sum().asscalar()))}", flush=True)
"""


def _result(proc, rank: int) -> dict:
    line = next(line for line in worker_lines(proc.stdout, rank) if line.startswith("STARTS"))
    found = re.match(r"STARTS (\[.*?\]) AFTER_TUNING (\[.*?\]) CYCLE (\S+) WEIGHTS (\[.*\])",
                     line)
    starts, after, cycle, weights = (eval(found.group(i)) if i != 3 else found.group(i)
                                     for i in range(1, 5))
    return {"starts": starts, "after_tuning": after, "cycle": cycle, "weights": weights}


def _tuning_lines(proc) -> list[str]:
    return [line for line in proc.stderr.splitlines()
            if "dist_gluon: horovod" in line and "tuned" in line]


@pytest.mark.spawns
def test_the_cycle_is_chosen_on_the_first_steps_printed_once_and_kept(tmp_path):
    # steps of 0.11 s: long enough to try the long cycle (see the rule's tests below);
    # which cycle wins is the machine's business
    proc = launch(SCRIPT, tmp_path, args=["0.11", "24"], launcher_args=["--report", "off"])
    assert_ok(proc)
    lines = _tuning_lines(proc)
    assert len(lines) == 1 and lines[0].startswith("[0] "), proc.stderr[-3000:]
    found = re.search(rf"{CYCLE_ENV}=(\S+) \(ms\), kept for the rest of the run; "
                      r"step [\d.]+ ms at 1 ms, [\d.]+ ms at 5 ms(, [\d.]+ ms at 20 ms)?: ",
                      lines[0])
    assert found, lines[0]
    chosen = found.group(1)
    # horovod's default, then longer cycles while each is the choice so far, and back
    # to the choice if horovod runs with another; nothing after the choice
    expected = {"1": [None, "5", "1"], "5": [None, "5", "20", "5"], "20": [None, "5", "20"]}
    assert chosen in expected
    assert (found.group(2) is None) == (chosen == "1"), lines[0]
    for rank in range(2):
        result = _result(proc, rank)
        assert result["after_tuning"] == expected[chosen]
        assert result["starts"] == result["after_tuning"]
        assert result["cycle"] == chosen
        assert len(set(result["weights"])) == 1     # the ranks trained alike


@pytest.mark.spawns
def test_syncbatchnorm_from_step_10_brings_the_default_cycle_back(tmp_path):
    # steps of 0.11 s: 5 ms is timed from step 10 on (at 0.3 s per step under load, it
    # was rejected at step 8's end, or 20 ms is timed from step 10 on); SyncBatchNorm
    # runs from step 10, its sums through horovod (DG_SYNCBN_SIDE=0; its side channel,
    # where it serves, leaves horovod's cycle to the tuner)
    proc = launch(SCRIPT, tmp_path, args=["0.11", "9", "syncbn"],
                  launcher_args=["--report", "off"], env={"DG_SYNCBN_SIDE": "0"})
    assert_ok(proc)
    tuned = _tuning_lines(proc)
    back = [line for line in proc.stderr.splitlines() if "is horovod's default" in line]
    if tuned:
        assert "HOROVOD_CYCLE_TIME=1 (ms)" in tuned[0], tuned
        assert back == [], back           # chosen already, and no other start
    else:
        assert back == ["[0] dist_gluon: horovod's HOROVOD_CYCLE_TIME is horovod's default "
                        "(1 ms) from step 10 on, started again with it: SyncBatchNorm's "
                        "sums, two per layer and step, each waiting up to a cycle, so a "
                        "longer cycle cannot pay"], proc.stderr[-3000:]
    for rank in range(2):
        result = _result(proc, rank)
        assert result["starts"] in ([None, "5", "1"], [None, "5", "20", "1"])
        assert result["cycle"] == "1"
        assert len(set(result["weights"])) == 1     # the ranks trained alike


# A GAN's pattern: two trainers taking turns, each step made 0.11 s longer.
TWO_TRAINERS = r"""
import time
import mxnet as mx
from mxnet import autograd, gluon
import dist_gluon as dg

kv = dg.create()
nets = [gluon.nn.Dense(4, in_units=8) for _ in range(2)]
trainers = []
for net in nets:
    net.initialize(mx.init.Constant(0.1))
    trainers.append(dg.DistributedTrainer(net.collect_params(), "sgd",
                                          {"learning_rate": 0.01}, kv=kv))
x = mx.nd.ones((2, 8))
for _ in range(24):
    for net, trainer in zip(nets, trainers):
        time.sleep(0.11)
        with autograd.record():
            loss = net(x).sum()
        loss.backward()
        trainer.step(2)
mx.nd.waitall()
print("DONE", flush=True)
"""


@pytest.mark.spawns
def test_two_trainers_taking_turns_are_timed_in_whole_rounds(tmp_path):
    proc = launch(TWO_TRAINERS, tmp_path, launcher_args=["--report", "off"])
    assert_ok(proc)
    lines = _tuning_lines(proc)
    assert len(lines) == 1 and lines[0].startswith("[0] "), proc.stderr[-3000:]
    # the warm-up ends at step 3, when the first trainer steps again
    assert "tuned on steps 4-" in lines[0], lines[0]
    assert "whole rounds of the 2 trainers that take turns" in lines[0], lines[0]


@pytest.mark.spawns
def test_the_users_cycle_time_wins_and_is_named(tmp_path):
    proc = launch(SCRIPT, tmp_path, args=["0", "30"], launcher_args=["--report", "off"],
                  env={"HOROVOD_CYCLE_TIME": "3"})
    assert_ok(proc)
    lines = _tuning_lines(proc)
    assert len(lines) == 1 and lines[0].startswith("[0] ")
    assert "not tuned: HOROVOD_CYCLE_TIME=3 set by the user wins" in lines[0]
    for rank in range(2):
        result = _result(proc, rank)
        assert result["starts"] == ["3"] and result["cycle"] == "3"


@pytest.mark.spawns
def test_no_tune_leaves_horovods_default_silently(tmp_path):
    proc = launch(SCRIPT, tmp_path, args=["0", "30"],
                  launcher_args=["--report", "off", "--no-tune"])
    assert_ok(proc)
    assert _tuning_lines(proc) == []
    for rank in range(2):
        result = _result(proc, rank)
        assert result["starts"] == [None] and result["cycle"] == "None"


# ------------------------------------------------------------------ the rule, given times
class _Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _tune(monkeypatch, steps: dict[float, float], chained_at: int | None = None,
          owners=(None,), cold: float = 0.0, tell: bool = True) -> tuple[Tuner, list]:
    """Run a Tuner on rank 0 of a job whose steps take ``steps[cycle]`` seconds under
    each cycle (SyncBatchNorm's chained sums from step ``chained_at`` on), the trainers
    ``owners`` taking turns, each one's first step after horovod starts ``cold``
    seconds longer (``tell``: the tuner is told whose step ended); returns it and the
    settings it restarted horovod with."""
    clock = _Clock()
    monkeypatch.setattr(horovod_tuning.time, "monotonic", clock)
    restarts = []
    cycle = {"ms": 1.0}
    warm = set()

    def restart(settings):
        restarts.append(dict(settings))
        cycle["ms"] = float(settings[CYCLE_ENV])
        warm.clear()

    tuner = Tuner(restart, lambda: None, lambda obj: obj, rank=0, environ={})
    for step in range(1, 61):
        owner = owners[(step - 1) % len(owners)]
        clock.now += steps[cycle["ms"]] + (0.0 if owner in warm else cold)
        warm.add(owner)
        if step == chained_at:
            tuner.chained("SyncBatchNorm's sums")
        tuner.step_ended(owner if tell else None)
    return tuner, restarts


def _cycles(*cycles) -> list[dict]:
    return [{CYCLE_ENV: f"{cycle:g}"} for cycle in cycles]


def test_the_longest_cycle_is_kept_when_as_fast(monkeypatch):
    tuner, restarts = _tune(monkeypatch, {1.0: 0.300, 5.0: 0.302, 20.0: 0.301})
    assert tuner.done and tuner.settings == {CYCLE_ENV: "20"}
    assert restarts == _cycles(5, 20)
    assert "HOROVOD_CYCLE_TIME=20 (ms)" in tuner.summary()
    assert "step 300.0 ms at 1 ms, 302.0 ms at 5 ms, 301.0 ms at 20 ms: the longest " \
        "cycle within 2% of the fastest step" in tuner.summary()


def test_the_middle_cycle_is_kept_when_the_longest_is_slower(monkeypatch):
    # SyncBatchNorm over its side channel (FINDINGS.md 11d): 5 ms is the fastest, and
    # 20 ms delays the gradients' sums behind its chained ones
    tuner, restarts = _tune(monkeypatch, {1.0: 0.400, 5.0: 0.340, 20.0: 1.000})
    assert tuner.done and tuner.settings == {CYCLE_ENV: "5"}
    assert restarts == _cycles(5, 20, 5)
    assert "a longer one was slower" in tuner.summary()


def test_the_default_cycle_comes_back_when_the_next_one_is_slower(monkeypatch):
    # 20 ms is never tried once 5 ms was slower
    tuner, restarts = _tune(monkeypatch, {1.0: 0.110, 5.0: 0.130, 20.0: 0.090})
    assert tuner.done and tuner.settings == {CYCLE_ENV: "1"}
    assert restarts == _cycles(5, 1)
    assert tuner.step_times == {1.0: pytest.approx(0.110), 5.0: pytest.approx(0.130)}
    # 0.5 s per cycle at 0.11 s a step: 5 steps timed per cycle
    assert tuner.steps == (3, 2 + 1 + 5 + 1 + 5)
    assert "more than 2% slower" in tuner.summary()


def test_a_short_step_keeps_the_default_cycle_without_a_restart(monkeypatch):
    # the MNIST example's step
    tuner, restarts = _tune(monkeypatch, {1.0: 0.026, 5.0: 0.020, 20.0: 0.020})
    assert tuner.done and tuner.settings == {} and restarts == []
    assert "shorter than 5 cycles of 20 ms" in tuner.summary()
    assert tuner.steps == (3, 2 + 1 + 12)


@pytest.mark.parametrize("owners", [("G", "D"), ("a", "b", "c")])
def test_trainers_taking_turns_are_timed_in_whole_rounds_after_their_first_steps(
        monkeypatch, owners):
    # a GAN's two trainers, make bench's three models: after horovod starts again, each
    # one's first step negotiates its tensors afresh (0.1 s here); no window holds one,
    # and every window holds each trainer as often, so equal cycles choose the longest
    tuner, restarts = _tune(monkeypatch, {1.0: 0.3, 5.0: 0.3, 20.0: 0.3}, owners=owners,
                            cold=0.1)
    assert tuner.done and tuner.settings == {CYCLE_ENV: "20"}
    assert restarts == _cycles(5, 20)
    assert tuner.step_times == dict.fromkeys((1.0, 5.0, 20.0), pytest.approx(0.3))
    k = len(owners)
    # the warm-up ends when the first trainer steps again; a round left out, a round
    # (at least two steps) timed, per cycle
    per = -(-2 // k) * k
    assert tuner.steps == (k + 2, k + 1 + 3 * (k + per))
    assert f"whole rounds of the {k} trainers that take turns" in tuner.summary()


def test_told_nothing_of_the_trainers_the_tuner_would_keep_the_default(monkeypatch):
    # the same job with the trainers unnamed (as before they were): the window after
    # each restart holds a trainer's cold first step, and 5 ms looks slower
    tuner, restarts = _tune(monkeypatch, {1.0: 0.3, 5.0: 0.3, 20.0: 0.3},
                            owners=("G", "D"), cold=0.1, tell=False)
    assert tuner.settings == {CYCLE_ENV: "1"} and restarts == _cycles(5, 1)


def test_a_new_trainer_every_step_is_timed_one_step_at_a_time(monkeypatch):
    owners = [object() for _ in range(60)]
    tuner, restarts = _tune(monkeypatch, {1.0: 0.3, 5.0: 0.3, 20.0: 0.3},
                            owners=tuple(owners))
    assert tuner.done and tuner._round == 1
    assert tuner.steps[0] == horovod_tuning.MAX_ROUND + 2


# 0.3 s steps: warm-up steps 1-2, the default cycle timed on steps 4-5, 5 ms (horovod
# started again with it at step 5's end) on steps 7-8, 20 ms on steps 10-11, chosen at
# step 11's end
@pytest.mark.parametrize("chained_at, restarted", [
    (1, []),                                    # in the warm-up
    (5, []),                                    # while the default is timed
    (7, _cycles(5, 1)),                         # while 5 ms is timed
    (10, _cycles(5, 20, 1)),                    # while 20 ms is timed
    (30, _cycles(5, 20, 1)),                    # after it was chosen
])
def test_syncbatchnorms_chained_sums_keep_the_default_cycle_from_their_first_step(
        monkeypatch, capsys, chained_at, restarted):
    tuner, restarts = _tune(monkeypatch, {1.0: 0.3, 5.0: 0.3, 20.0: 0.3},
                            chained_at=chained_at)
    assert tuner.done and restarts == restarted
    assert tuner.settings.get(CYCLE_ENV, "1") == "1"
    said = capsys.readouterr().err
    assert f"HOROVOD_CYCLE_TIME is horovod's default (1 ms) from step {chained_at} on" \
        f"{', started again with it' if restarted else ''}: SyncBatchNorm's sums" in said


def test_chained_sums_after_the_default_was_chosen_change_nothing(monkeypatch, capsys):
    tuner, restarts = _tune(monkeypatch, {1.0: 0.110, 5.0: 0.130, 20.0: 0.130},
                            chained_at=40)
    assert restarts == _cycles(5, 1)        # the tuning's own, no third
    assert "from step" not in capsys.readouterr().err


def test_the_most_restarts_the_tuner_makes_is_four(monkeypatch):
    # up the climb, back to the middle cycle, and back to the default for chained sums:
    # horovod 0.28.1 starts again with the cycle alone at least seven times in a row
    _, restarts = _tune(monkeypatch, {1.0: 0.400, 5.0: 0.340, 20.0: 1.000}, chained_at=40)
    assert restarts == _cycles(5, 20, 5, 1)


@pytest.mark.parametrize("environ, reason", [
    ({"HOROVOD_FUSION_THRESHOLD": "0"}, "HOROVOD_FUSION_THRESHOLD=0 set by the user wins"),
    ({"HOROVOD_AUTOTUNE": "1"}, "horovod's own autotuner is on"),
])
def test_nothing_is_restarted_when_the_user_chose(environ, reason):
    restarts = []
    tuner = Tuner(restarts.append, lambda: None, lambda obj: obj, rank=1, environ=environ)
    for _ in range(30):
        tuner.step_ended()
    assert tuner.done and restarts == [] and reason in tuner.reason_not


def test_no_tune_reaches_every_node_and_reads_dg_tune(monkeypatch):
    from dist_gluon.launch import cli, ssh

    fan = cli.parse(["-H", "h1:1,h2:1", "--no-tune", "--", "python", "x.py"])
    assert not fan.tune and "--no-tune" in ssh.node_command(fan, 1, "h1")
    assert "--no-tune" not in ssh.node_command(
        cli.parse(["-H", "h1:1,h2:1", "--", "python", "x.py"]), 1, "h1")
    monkeypatch.setenv("DG_TUNE", "0")
    assert not cli.parse(["-n", "2", "--", "python", "x.py"]).tune


@pytest.mark.spawns
def test_an_in_memory_elastic_job_with_both_horovod_variables_is_refused_before_a_step(
        tmp_path):
    """horovod 0.28.1 segfaults in the hvd.init() of a process it started with both
    HOROVOD_CYCLE_TIME and HOROVOD_FUSION_THRESHOLD set, so the survivors of a fault
    would crash at the re-formation (reproduced: rank 0 "Segmentation fault: 11", the
    job lost). dist_gluon.elastic.run refuses it on entry, naming both and what to do;
    one of them alone heals (the guide's script in test_example_elastic)."""
    proc = subprocess.run(
        [sys.executable, "-m", "dist_gluon.launch", "--nnodes", "1:1", "-n", "2",
         "--backend", "horovod", "--", sys.executable,
         str(REPO / "examples" / "elastic" / "train_in_memory.py"),
         "--epochs", "1"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
        env=process_env(HOROVOD_CYCLE_TIME="2", HOROVOD_FUSION_THRESHOLD="33554432"))
    assert proc.returncode != 0, proc.stdout[-2000:]
    assert "epoch 0:" not in proc.stdout
    assert "dist_gluon.elastic.run: HOROVOD_CYCLE_TIME and HOROVOD_FUSION_THRESHOLD are " \
        "both set" in proc.stderr and "Set at most one of them" in proc.stderr, \
        proc.stderr[-3000:]
