"""DistributedTrainer and rank-0 broadcast: N workers on B samples each train exactly
like one process on the N*B concatenated samples, on every backend."""
import json
import sys
import time

import numpy as np
import pytest

from conftest import (
    DISTRIBUTED_BACKENDS,
    REPO,
    TRAINING_BACKENDS,
    assert_ok,
    launcher,
    run,
    worker_lines,
)

WORKERS = REPO / "tests" / "workers"
EXACT_CASES = ["sgd", "adam", "two_a", "two_b", "accum", "clip", "predivide"]
# a rank-dependent branch stepped with ignore_stale_grad=True (trainer_cases.py, case 9)
BRANCH_CASES = ["heads", "heads_update", "heads_accum"]
# rank 0 and rank 1 have different batch sizes (5 + 3 samples...) in these
UNEVEN_CASES = ["uneven_step", "uneven_update"]



@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The single-process run on the concatenated batches (no launcher: local backend)."""
    out = tmp_path_factory.mktemp("reference")
    assert_ok(run([sys.executable, str(WORKERS / "trainer_cases.py"), str(out), "2"], out))
    return out


@pytest.fixture(scope="module", params=DISTRIBUTED_BACKENDS)
def distributed(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(request.param)
    proc = run(launcher(request.param, WORKERS / "trainer_cases.py", out, 2), out)
    assert_ok(proc)
    return out


def _params(directory, case, rank):
    data = np.load(directory / f"{case}_rank{rank}.npz")
    return [data[str(i)] for i in range(len(data.files))]


def _max_error(a, b):
    return max(float(np.abs(x - y).max()) for x, y in zip(a, b))


@pytest.mark.parametrize("case", EXACT_CASES)
def test_two_workers_train_like_one_process_on_the_concatenated_batch(
        distributed, reference, case):
    expected = _params(reference, case, 0)
    for rank in (0, 1):
        got = _params(distributed, case, rank)
        assert [g.shape for g in got] == [e.shape for e in expected]
        assert _max_error(got, expected) < 1e-5, (case, rank)


@pytest.mark.parametrize("case", UNEVEN_CASES)
def test_ranks_with_different_batch_sizes_train_like_one_process_on_the_concatenation(
        distributed, reference, case):
    expected = _params(reference, case, 0)
    rank0 = _params(distributed, case, 0)
    assert _max_error(rank0, expected) < 1e-5
    assert _max_error(_params(distributed, case, 1), rank0) == 0.0    # ranks stay identical


@pytest.mark.parametrize("case", BRANCH_CASES)
def test_a_branch_taken_by_some_ranks_updates_every_rank_like_one_process(
        distributed, reference, case):
    expected = _params(reference, case, 0)
    rank0 = _params(distributed, case, 0)
    assert _max_error(_params(distributed, case, 1), rank0) == 0.0    # ranks stay identical
    assert _max_error(rank0, expected) < 1e-5, case
    # head C (parameters #6 and #7), never used, is skipped on every rank: not even
    # weight decay touches it
    initial = _params(distributed, case + "_init", 0)
    assert all(np.array_equal(rank0[i], initial[i]) for i in (6, 7))


@pytest.mark.parametrize("case", ["heads_fp16", "heads_2bit"])
def test_a_branch_taken_by_some_ranks_keeps_ranks_identical_with_compression(
        distributed, reference, case):
    rank0 = _params(distributed, case, 0)
    assert _max_error(_params(distributed, case, 1), rank0) == 0.0
    if case == "heads_fp16":
        assert _max_error(rank0, _params(reference, case, 0)) < 1e-3


def test_a_gradient_stale_on_some_ranks_is_one_clear_error_on_every_rank(distributed):
    for rank in (0, 1):
        message = (distributed / f"stale_error_rank{rank}.txt").read_text()
        assert "has a fresh gradient on ranks [0] but a stale one" in message, message
        assert "on ranks [1]" in message and "ignore_stale_grad=True" in message
        assert "parameter #2" in message


def test_every_rank_starts_from_rank_0_weights_whatever_its_seed(distributed, reference):
    # rank 1 used another seed and other parameter names; deferred init broadcast
    # rank 0's values at the first forward
    for case in ("sgd_init", "adam_init"):
        rank0 = _params(distributed, case, 0)
        assert _max_error(_params(distributed, case, 1), rank0) == 0.0
        assert _max_error(rank0, _params(reference, case, 0)) == 0.0


def test_fp16_compression_keeps_ranks_identical_and_close_to_fp32(distributed, reference):
    rank0, rank1 = _params(distributed, "fp16", 0), _params(distributed, "fp16", 1)
    assert _max_error(rank0, rank1) == 0.0
    assert all(a.dtype == np.float32 for a in rank0)
    assert _max_error(rank0, _params(reference, "fp16", 0)) < 1e-3


def test_load_states_gives_every_rank_rank_0_optimizer_states(distributed):
    meta = [json.loads((distributed / f"states_rank{r}.json").read_text()) for r in (0, 1)]
    assert meta[0]["restored"] is True
    assert meta[0]["num_update"] == meta[1]["num_update"] > 0
    s0, s1 = (np.load(distributed / f"states_rank{r}.npz") for r in (0, 1))
    assert sorted(s0.files) == sorted(s1.files) and s0.files
    for key in s0.files:
        assert np.array_equal(s0[key], s1[key])
        assert not np.all(s1[key] == 7.0)


# What each case's error names: rank 1's second Dense differs in its weight (#2) or,
# when the weights are deferred, in its bias (#3); with rank 1's wider input only the
# first Dense's weight (#0) differs.
MISMATCHES = {
    "initialised": ("parameter #2: rank 0 has 'initialised_dense1_weight' shape (4, 8)",
                    "rank 1 has 'initialised_dense1_weight' shape (5, 8)"),
    "deferred": ("parameter #3: rank 0 has 'deferred_dense1_bias' shape (4,)",
                 "rank 1 has 'deferred_dense1_bias' shape (5,)"),
    "input": ("parameter #0: rank 0 has 'input_dense0_weight' shape (8, 3)",
              "rank 1 has 'input_dense0_weight' shape (8, 4)"),
}


# The check compares shapes gathered with allgather_object (tested on every backend in
# test_backends.py); what can differ between backends is how the ranks get there, so
# one job per backend of its own code (conftest.TRAINING_BACKENDS) runs the three cases
# one after the other.
@pytest.mark.parametrize("backend", TRAINING_BACKENDS)
@pytest.mark.spawns
def test_a_model_mismatch_raises_a_clear_error_on_every_rank(tmp_path, backend):
    start = time.monotonic()
    proc = run([sys.executable, "-m", "dist_gluon.launch", "-n", "2", "--backend", backend,
                 "--", sys.executable, str(WORKERS / "mismatch.py"), *MISMATCHES], tmp_path,
                timeout=60)
    assert time.monotonic() - start < 30
    assert proc.returncode == 3, proc.stdout + proc.stderr
    for rank in (0, 1):
        lines = worker_lines(proc.stdout, rank)
        for case, names in MISMATCHES.items():
            caught = [line for line in lines if line.startswith(f"caught {case}:")]
            assert len(caught) == 1, (case, proc.stdout + proc.stderr)
            assert all(name in caught[0] for name in names), caught[0]


@pytest.mark.spawns
def test_single_process_issues_no_collective(tmp_path):
    script = tmp_path / "single.py"
    script.write_text(
        "import mxnet as mx\nfrom mxnet import autograd, gluon\nimport dist_gluon as dg\n"
        "kv = dg.create('local')\n"
        "def boom(*a, **k):\n    raise AssertionError('collective issued')\n"
        "kv._allreduce_ = kv._broadcast_ = boom\n"
        "net = gluon.nn.Dense(2)\nnet.initialize()\n"
        "trainer = dg.DistributedTrainer(net.collect_params(), 'sgd', kv=kv)\n"
        "with autograd.record():\n    loss = net(mx.nd.ones((3, 4))).sum()\n"
        "loss.backward()\ntrainer.step(3)\ntrainer.save_states('s')\ntrainer.load_states('s')\n"
        "print('ok')\n")
    proc = run([sys.executable, str(script)], tmp_path)
    assert_ok(proc)
    assert proc.stdout.strip() == "ok"


@pytest.mark.spawns
def test_load_states_works_before_a_deferred_models_first_forward(tmp_path):
    script = tmp_path / "deferred_states.py"
    script.write_text(
        "import mxnet as mx\nfrom mxnet import autograd, gluon\nimport dist_gluon as dg\n"
        "def make():\n    net = gluon.nn.Dense(2)\n    net.initialize()\n"
        "    return net, dg.DistributedTrainer(net.collect_params(), 'sgd',"
        " {'learning_rate': 0.1, 'momentum': 0.9})\n"
        "net, trainer = make()\n"
        "with autograd.record():\n    loss = net(mx.nd.ones((3, 4))).sum()\n"
        "loss.backward()\ntrainer.step(3)\ntrainer.save_states('s')\n"
        "fresh, fresh_trainer = make()\nfresh_trainer.load_states('s')\n"
        "print(sorted(fresh_trainer._updaters[0].states))\n")
    proc = run([sys.executable, str(script)], tmp_path)
    assert_ok(proc)
    assert proc.stdout.strip() == "[0, 1]"


HYBRIDIZED_FIRST = """
    import json
    import mxnet as mx
    from mxnet import autograd, gluon
    import dist_gluon as dg

    kv = dg.create()
    mx.random.seed(kv.rank)
    net = gluon.nn.HybridSequential()
    net.add(gluon.nn.Conv2D(8, 3, in_channels=3), gluon.nn.BatchNorm(in_channels=8),
            gluon.nn.Dense(4, in_units=8 * 6 * 6))
    net.initialize()
    net.hybridize(static_alloc=True, static_shape=True)
    x = mx.nd.ones((2, 3, 8, 8)) * (kv.rank + 1)
    net(x)      # weights may now hold MKLDNN-layout data
    trainer = dg.DistributedTrainer(net.collect_params(), "sgd", {"learning_rate": 0.1})
    first = [p.data().asnumpy().sum().item() for p in net.collect_params().values()]
    with autograd.record():
        loss = net(x).sum()
    loss.backward()
    trainer.step(2)
    # BatchNorm running statistics follow each rank's own data (as in Horovod)
    after = [p.data().asnumpy().sum().item() for p in net.collect_params().values()
             if p.grad_req != "null"]
    print(json.dumps({"first": first, "after": after}))
"""


@pytest.mark.parametrize("backend", ["horovod", "dist_sync"])
@pytest.mark.spawns
def test_a_trainer_created_after_a_hybridized_forward_still_broadcasts(tmp_path, backend):
    from conftest import launch
    proc = launch(HYBRIDIZED_FIRST, tmp_path, backend=backend,
                  launcher_args=["--timeout", "60"])
    assert_ok(proc)
    rank0, rank1 = (json.loads(worker_lines(proc.stdout, r)[-1]) for r in (0, 1))
    assert rank0 == rank1


# ------------------------------------------------ state files shared with gluon.Trainer
def _arrays(path):
    with np.load(path) as npz:
        return [npz[f"arr_{i}"] for i in range(len(npz.files))]


@pytest.fixture(scope="module")
def state_files(tmp_path_factory):
    """One process: gluon.Trainer's, our trainers' and horovod.mxnet's state files and
    the runs continued from them (tests/workers/state_order_cases.py)."""
    out = tmp_path_factory.mktemp("state_order")
    assert_ok(run([sys.executable, str(WORKERS / "state_order_cases.py"), str(out),
                   "reference"], out))
    return out


@pytest.mark.parametrize("who", ["dg", "compat_horovod", "compat_byteps"])
def test_states_saved_by_gluon_trainer_load_onto_the_same_parameters(state_files, who):
    # 12 Dense layers: gluon.Trainer's sorted-name order is not the model's, so a
    # state on the wrong parameter shows as a shape error or as other weights
    reference = _arrays(state_files / "ref_final.npz")
    assert _max_error(_arrays(state_files / f"final_{who}.npz"), reference) == 0.0


@pytest.mark.parametrize("who", ["dg", "compat_horovod", "compat_byteps"])
def test_states_saved_by_our_trainers_load_into_gluon_trainer(state_files, who):
    reference = _arrays(state_files / "ref_final.npz")
    assert _max_error(_arrays(state_files / f"back_{who}.npz"), reference) == 0.0


def test_states_saved_by_horovod_mxnet_load_into_distributed_trainer(state_files):
    reference = _arrays(state_files / "ref_final_horovod.npz")
    assert _max_error(_arrays(state_files / "final_from_horovod.npz"), reference) == 0.0


@pytest.mark.parametrize("backend", TRAINING_BACKENDS)
@pytest.mark.spawns
def test_gluon_trainer_states_load_on_every_rank_whatever_its_names(state_files, tmp_path,
                                                                    backend):
    # rank 1 names its parameters m_dense3... (another sorted order than rank 0's):
    # rank 0's file reaches it mapped through the model positions
    for f in state_files.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    proc = run(launcher(backend, WORKERS / "state_order_cases.py", tmp_path,
                        "distributed"), tmp_path)
    assert_ok(proc)
    reference = _arrays(tmp_path / "ref_final.npz")
    for rank in (0, 1):
        assert _max_error(_arrays(tmp_path / f"final_rank{rank}.npz"), reference) < 1e-6


# ------------------------------------------------------ several devices per worker
MULTI_DEVICE_EXACT = ["sgd", "adam", "sparse"]


@pytest.fixture(scope="module")
def one_device(tmp_path_factory):
    """One process on one device: the global batch of 8 in one piece."""
    out = tmp_path_factory.mktemp("one_device")
    assert_ok(run([sys.executable, str(WORKERS / "multi_device_cases.py"), str(out), "1",
                   *MULTI_DEVICE_EXACT], out))
    return out


@pytest.fixture(scope="module")
def compressed_one_device(tmp_path_factory):
    """2 workers of one device each with 2-bit and PowerSGD: what a compressed job of 2
    workers of 2 devices must equal (one process compresses nothing)."""
    out = tmp_path_factory.mktemp("compressed_one_device")
    assert_ok(run(launcher("horovod", WORKERS / "multi_device_cases.py", out, 1, "2bit",
                           "powersgd"), out))
    return out


def _multi_device(directory, case, devices, rank=0):
    return dict(np.load(directory / f"{case}_d{devices}_rank{rank}.npz"))


def _dict_error(a, b):
    assert sorted(a) == sorted(b)
    return max(float(np.abs(a[k] - b[k]).max()) for k in a)


@pytest.mark.spawns
def test_one_process_on_two_devices_trains_like_one_device(one_device, tmp_path):
    assert_ok(run([sys.executable, str(WORKERS / "multi_device_cases.py"), str(tmp_path),
                   "2", *MULTI_DEVICE_EXACT], tmp_path))
    for case in MULTI_DEVICE_EXACT:
        assert _dict_error(_multi_device(tmp_path, case, 2),
                           _multi_device(one_device, case, 1)) < 1e-5, case


@pytest.mark.parametrize("backend", TRAINING_BACKENDS)
@pytest.mark.spawns
def test_two_workers_of_two_devices_train_like_one_process_on_the_four_shards(
        one_device, compressed_one_device, tmp_path, backend):
    # every device of every worker gets 2 of the 8 samples; each worker sums its
    # devices, sends one sum per tensor and copies the result to both devices (the
    # worker script checks that the devices' weights are identical)
    proc = run(launcher(backend, WORKERS / "multi_device_cases.py", tmp_path, 2,
                        *MULTI_DEVICE_EXACT, "fp16", "2bit", "powersgd"), tmp_path)
    assert_ok(proc)
    for rank in (0, 1):
        for case in MULTI_DEVICE_EXACT:
            assert _dict_error(_multi_device(tmp_path, case, 2, rank),
                               _multi_device(one_device, case, 1)) < 1e-5, case
        assert _dict_error(_multi_device(tmp_path, "fp16", 2, rank),
                           _multi_device(one_device, "sgd", 1)) < 1e-3
        for case in ("2bit", "powersgd"):
            assert _dict_error(_multi_device(tmp_path, case, 2, rank),
                               _multi_device(compressed_one_device, case, 1)) < 1e-5, case
