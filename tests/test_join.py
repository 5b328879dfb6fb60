"""dg.Join: ranks with different numbers of batches train to the end, exactly as one
process on the concatenation of the batches present at each step."""
from __future__ import annotations

import subprocess
import sys

import mxnet as mx
import numpy as np
import pytest
from mxnet import autograd, gluon

import dist_gluon as dg
from conftest import REPO, assert_ok, launch, process_env, worker_lines

WORKERS = REPO / "tests" / "workers"
SCRIPT = WORKERS / "join_cases.py"
TOLERANCE = 1e-5


def _reference(tmp_path, world: int) -> dict:
    out = tmp_path / "reference"
    subprocess.run([sys.executable, str(SCRIPT), str(out), str(world)], check=True,
                   env=process_env(), cwd=tmp_path, timeout=120)
    return {case: dict(np.load(out / f"{case}-reference.npz"))
            for case in ("two", "sparse", "plain", "syncbn")}


@pytest.mark.parametrize("backend, transport, world", [
    ("horovod", "gloo", 2), ("horovod", "gloo", 3), ("horovod", "mpi", 2),
    ("dist_sync", None, 2), ("p3", None, 3)])
def test_ranks_with_fewer_batches_shadow_the_others_steps(tmp_path, backend, transport,
                                                          world):
    """Ranks with 10, 7 (and 4) batches in two epochs (trainer.step, then
    allreduce_grads + update, the block entered again), a plain network and one with
    SyncBatchNorm, two trainers in one block, row_sparse gradients, DG_CHECK_SYNC=1:
    every rank ends with the weights and running statistics of one process trained on
    the batches present at each step."""
    out = tmp_path / "out"
    result = launch(SCRIPT.read_text(), tmp_path, backend=backend, n=world,
                    args=[str(out), str(world)], env={"DG_CHECK_SYNC": "1"}, timeout=240,
                    launcher_args=["--transport", transport] if transport else [])
    assert_ok(result)
    reference = _reference(tmp_path, world)
    for case, expected in reference.items():
        for rank in range(world):
            got = dict(np.load(out / f"{case}-{rank}.npz"))
            assert got.keys() == expected.keys()
            for name in expected:
                np.testing.assert_allclose(got[name], expected[name], rtol=TOLERANCE,
                                           atol=TOLERANCE,
                                           err_msg=f"{case}, rank {rank}, parameter {name}")


def test_hvd_join_takes_part_in_the_peers_trainer_steps_and_returns_the_last_rank(tmp_path):
    """dist_gluon.compat.horovod: ranks with 3, 5 and 2 batches step Horovod's
    DistributedTrainer inside dg.Join; hvd.join() (one epoch through step()) and leaving
    the block (one through allreduce_grads + update) take part in the others' steps, so
    every rank ends with the weights of one process applying Horovod's arithmetic to
    the batches present (DG_CHECK_SYNC=1 compares the replicas at every step), and
    every rank hears that rank 1, with the most batches, joined last."""
    script = (WORKERS / "join_compat.py").read_text()
    result = launch(script, tmp_path, n=3, env={"DG_CHECK_SYNC": "1"}, timeout=180)
    assert_ok(result)
    for rank in range(3):
        lines = worker_lines(result.stdout, rank)
        assert "join returned 1" in lines and "block's last 1" in lines, lines
        # outside a block it is a barrier every rank calls at once: the highest rank
        assert "join outside a block returned 2" in lines, lines
        difference = float(lines[-1].rsplit(" ", 1)[1])
        assert lines[-1].startswith("largest difference") and difference <= TOLERANCE, lines


def test_the_module_api_trains_uneven_iterators_under_join_around_fit(tmp_path):
    """Module API on dist_sync: ``with dg.Join(opt): mod.fit(...)`` with a
    DistributedOptimizer and iterators of 3 and 5 batches, two epochs: both ranks end
    with the weights of one Gluon process on the batches present at each step (to 5e-5:
    Module's SoftmaxOutput and Gluon's loss alone differ by 3e-6 after these steps), and
    rank 1, with the most batches, left last. The same with Horovod's
    DistributedOptimizer (dist_gluon.compat) on horovod, with Horovod's arithmetic."""
    script = (WORKERS / "join_module.py").read_text()
    for backend, args in (("dist_sync", []), ("horovod", ["horovod"])):
        result = launch(script, tmp_path, backend=backend, n=2, args=args, timeout=180)
        assert_ok(result)
        for rank in range(2):
            lines = [line for line in worker_lines(result.stdout, rank)
                     if line.startswith(("epoch", "largest"))]
            assert lines[:2] == ["epoch 1: last to leave 1", "epoch 2: last to leave 1"], \
                (backend, lines)
            assert float(lines[2].rsplit(" ", 1)[1]) <= 5e-5, (backend, lines)


_ERROR_CASE = """
import sys
import mxnet as mx
from mxnet import autograd, gluon
import dist_gluon as dg

kv = dg.create()
net = gluon.nn.Dense(2, in_units=3)
net.initialize()
trainer = dg.DistributedTrainer(net.collect_params(), "sgd", {"learning_rate": 0.1})
case = sys.argv[1]
with dg.Join(trainer):
    for step in range(5 if kv.rank == 0 else 3):
        with autograd.record():
            loss = net(mx.nd.ones((4, 3))).sum()
        loss.backward()
        trainer.step(4)
        if case == "pushpull" and step == 3:
            kv.pushpull("my_counter", mx.nd.ones((1,)))
        if case == "barrier" and step == 3:
            kv.barrier()
        if case == "raise" and kv.rank == 1 and step == 1:
            raise RuntimeError("the data loader broke")
print("all steps taken", flush=True)
"""


def test_a_collective_a_joined_rank_cannot_shadow_ends_the_job_naming_it(tmp_path):
    """Rank 1 (3 batches) has left the loop when rank 0 (5 batches) sums a key of its
    own (or makes a barrier, here on dist_sync): the job ends, naming the key and the
    rank that had joined, instead of hanging;
    an exception leaving the block on one rank ends the job as any failure does."""
    result = launch(_ERROR_CASE, tmp_path, n=2, args=["pushpull"], timeout=120)
    assert result.returncode != 0
    output = result.stdout + result.stderr
    assert "'my_counter'" in output and "rank(s) [1]" in output, output[-3000:]
    assert "all steps taken" not in output

    result = launch(_ERROR_CASE, tmp_path, backend="dist_sync", n=2, args=["barrier"],
                    timeout=120)
    assert result.returncode != 0
    output = result.stdout + result.stderr
    assert "'barrier'" in output and "rank(s) [1]" in output, output[-3000:]

    result = launch(_ERROR_CASE, tmp_path, n=2, args=["raise"], timeout=120)
    assert result.returncode != 0
    output = result.stdout + result.stderr
    assert "the data loader broke" in output and "all steps taken" not in output, output[-3000:]


def test_on_dist_async_a_worker_that_ran_out_simply_stops_pushing(tmp_path):
    """dist_async: nobody waits for a worker that has left, so the block does nothing
    and both workers (5 and 3 batches) finish."""
    result = launch(_ERROR_CASE, tmp_path, backend="dist_async", n=2, args=["none"],
                    timeout=120)
    assert_ok(result)
    assert result.stdout.count("all steps taken") == 2, result.stdout[-3000:]


def test_a_joined_rank_sends_nothing_through_a_codec_and_keeps_its_feedback(tmp_path):
    """Through 2-bit, PowerSGD and BytePS's onebit and dithering with error feedback
    and momentum: the replicas stay equal at every step (DG_CHECK_SYNC=1), the weights
    stay finite, and the rank that left keeps its own codec state unchanged while it
    shadows the others' steps."""
    script = (WORKERS / "join_codecs.py").read_text()
    result = launch(script, tmp_path, n=2, env={"DG_CHECK_SYNC": "1"}, timeout=180)
    assert_ok(result)
    for codec in ("2bit", "powersgd", "onebit", "dithering"):
        lines = [line for rank in (0, 1) for line in worker_lines(result.stdout, rank)
                 if line.startswith(f"{codec}:")]
        assert len(lines) == 2, result.stdout[-3000:]
        assert all("changed [], finite True" in line for line in lines), lines
        assert "own state 0 arrays" not in lines[0], lines


def test_join_refuses_what_it_cannot_shadow_and_does_nothing_on_one_process():
    """dg.Join needs DistributedTrainers or the peers' (not gluon's, not Local SGD's
    rounds); on one
    process the block is free and the loop trains as without it."""
    net = gluon.nn.Dense(2, in_units=3)
    net.initialize()
    with pytest.raises(ValueError, match="needs the trainers"):
        dg.Join()
    with pytest.raises(TypeError, match="DistributedTrainer"):
        dg.Join(gluon.Trainer(net.collect_params(), "sgd"))
    rounds = dg.DistributedTrainer(net.collect_params(), "sgd", sync_every=4)
    with pytest.raises(ValueError, match="Local SGD"):
        dg.Join(rounds)
    trainer = dg.DistributedTrainer(net.collect_params(), "sgd", {"learning_rate": 0.1})
    before = net.weight.data().asnumpy()
    with dg.Join(trainer) as block:
        assert block.trainers == [trainer]
        with autograd.record():
            loss = net(mx.nd.ones((4, 3))).sum()
        loss.backward()
        trainer.step(4)
    # the gradient of the sum over 4 rows of ones is 4 per weight, divided by 4 samples
    np.testing.assert_allclose(net.weight.data().asnumpy(), before - 0.1, rtol=1e-6)
    assert block.last_joined == 0
    # a Module's optimizer is taken too (its steps announce themselves)
    with dg.Join(dg.DistributedOptimizer(mx.optimizer.SGD())) as module_block:
        pass
    assert module_block.last_joined == 0
