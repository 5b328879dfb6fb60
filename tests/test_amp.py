"""MXNet's AMP dynamic loss scaling (mx.contrib.amp) with DistributedTrainer and every
codec, through the launcher on horovod and dist_sync, 2 workers: an overflow on one rank
makes every rank skip the same step and change the loss scale at the same steps as one
process; the codecs see unscaled gradients and an overflowed step leaves their state
untouched (the weights are those of the run without AMP that leaves the step out); the
loss scaler's state survives a Checkpointer save and restore. The Module API's
DistributedOptimizer(loss_scale='dynamic') does the same.
tests/workers/amp_cases.py trains every case in one job per backend, with the sync
check on after every step."""
import json
import subprocess
import sys

import numpy as np
import pytest

from conftest import REPO, assert_ok, launch, process_env, worker_lines

CASES = REPO / "tests" / "workers" / "amp_cases.py"
NAMES = ["none", "fp16", "2bit", "powersgd", "onebit", "topk", "randomk", "dithering",
         "sharded", "2bit-split", "localsgd-2bit", "sparse-fp16", "module-none",
         "module-2bit", "compat-fp16"]


@pytest.fixture(scope="module", params=["horovod", "dist_sync"])
def job(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(f"amp-{request.param}")
    argv = [sys.executable, "-m", "dist_gluon.launch", "-n", "2", "--backend", request.param,
            "--", sys.executable, str(CASES), str(out)]
    # DG_CHECK_SYNC=1: the ranks compare their weights after every step they take; a
    # skipped step is skipped by all of them, so their counts stay together
    assert_ok(subprocess.run(argv, cwd=out, env=process_env(DG_CHECK_SYNC="1"),
                             capture_output=True, text=True, timeout=240))
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def _close(a, b, tol=1e-5):
    for x, y in zip(a, b):
        np.testing.assert_allclose(np.array(x), np.array(y), rtol=tol, atol=tol)


def test_the_one_process_reference_skips_the_overflowed_step(job):
    scales = job[0]["single"]["scales"]
    # MXNet's scaler: the halved scale takes effect one step later; step 3 updates nothing
    assert [s[2] for s in scales] == [1, 2, 2, 3, 4, 5]
    assert [s[1] for s in scales] == [65536.0, 65536.0] + [32768.0] * 4


@pytest.mark.parametrize("name", NAMES)
def test_every_rank_skips_the_step_and_changes_the_scale_as_one_process(job, name):
    single = job[0]["single"]["scales"]
    for rank in range(2):
        assert job[rank]["cases"][name]["scales"] == single, f"rank {rank}"


@pytest.mark.parametrize("name", NAMES)
def test_amp_weights_are_those_of_the_run_without_the_overflowed_step(job, name):
    for rank in range(2):
        case = job[rank]["cases"][name]
        assert np.all(np.isfinite(np.concatenate([np.ravel(w) for w in case["weights"]])))
        _close(case["weights"], case["plain"])
    _close(job[0]["cases"][name]["weights"], job[1]["cases"][name]["weights"], 1e-7)


@pytest.mark.parametrize("name", ["none", "sharded", "module-none"])
def test_uncompressed_amp_trains_as_one_process(job, name):
    _close(job[0]["cases"][name]["weights"], job[0]["single"]["weights"])


def test_a_restored_trainer_continues_with_the_same_loss_scale(job):
    for rank in range(2):
        ckpt = job[rank]["checkpoint"]
        assert ckpt["saved"] == [65536.0 / 2, 65536.0 / 2]
        assert ckpt["restored"] == ckpt["saved"]
        assert ckpt["continued_restored"] == ckpt["continued"]
        _close(ckpt["weights_restored"], ckpt["weights"])


def test_elastic_state_keeps_the_loss_scale(job):
    """The trainer's extra_state() counters (what dg.elastic.State keeps in memory and
    gives a new worker), and a State's commit and restore."""
    for rank in range(2):
        assert job[rank]["extra_state"] == job[rank]["checkpoint"]["saved"]
        assert job[rank]["elastic_state"]["committed"] == job[rank]["checkpoint"]["saved"]
        assert job[rank]["elastic_state"]["restored"] == job[rank]["checkpoint"]["saved"]


ASYNC = """
    import mxnet as mx, numpy as np
    from mxnet import autograd, gluon
    from mxnet.contrib import amp
    import dist_gluon as dg
    amp.init(target_precision_ops=[], conditional_fp32_ops=[], fp32_ops=[])
    kv = dg.create()
    net = gluon.nn.Dense(2, in_units=3)
    net.initialize(mx.init.One())
    trainer = dg.DistributedTrainer(net.collect_params(), "sgd", {"learning_rate": 0.1})
    amp.init_trainer(trainer)
    for step in range(4):
        x = mx.nd.ones((2, 3))
        if step == 1 and kv.rank == 1:
            x[0, 0] = np.inf
        with autograd.record():
            with amp.scale_loss(net(x).sum(), trainer) as loss:
                pass
        loss.backward()
        trainer.step(2)
    trainer.sync_weights()
    print("RESULT", trainer._amp_loss_scaler._next_loss_scale,
          float(net.weight.data().asnumpy().max()), float(net.weight.data().asnumpy().min()))
"""


def test_on_dist_async_an_overflowed_push_is_skipped_by_its_worker(tmp_path):
    """Each worker's push is its own step there: rank 1's overflowed one is not pushed
    (its inf would reach the servers' weights) and only rank 1 halves its scale; the
    servers apply the 7 other pushes (each 0.1 off every weight)."""
    proc = launch(ASYNC, tmp_path, backend="dist_async")
    assert_ok(proc)
    for rank, scale in ((0, 65536.0), (1, 32768.0)):
        result = next(line for line in worker_lines(proc.stdout, rank)
                      if line.startswith("RESULT")).split()[1:]
        assert float(result[0]) == scale
        np.testing.assert_allclose([float(v) for v in result[1:]], [0.3, 0.3], atol=1e-6)
