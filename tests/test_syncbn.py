"""SyncBatchNorm: N workers normalise with the statistics of all their samples, so they
train like one process with nn.BatchNorm on the concatenated batch; on one process it is
nn.BatchNorm."""
from __future__ import annotations

import json
import re
import subprocess
import sys

import mxnet as mx
import numpy as np
import pytest
from mxnet import autograd, gluon

import dist_gluon as dg
from conftest import REPO, TRAINING_BACKENDS, assert_ok, launch, launcher, process_env, run
from dist_gluon.backends import Backend

WORKERS = REPO / "tests" / "workers"
TOLERANCE = 1e-5


class OneOfTwoIdentical(Backend):
    """Rank 0 of a simulated pair of workers that hold the same batch: every sum is
    twice this rank's value. Counts the collectives."""

    _type = "fake"
    rank, num_workers, local_rank = 0, 2, 0

    def __init__(self):
        self.keys = []
        super().__init__()

    def _allreduce_(self, names, arrays, priority):
        self.keys.extend(names)
        for arr in arrays:
            arr *= 2


class OneOfTwoIdenticalWithoutFloat64(OneOfTwoIdentical):
    """The same pair on a transport without a float64 sum of its own (ps-lite), where
    SyncBatchNorm gathers one row per worker: the peer (rank 1) fills its row with this
    rank's values."""

    _sums_float64 = False

    def _allreduce_(self, names, arrays, priority):
        self.keys.extend(names)
        for arr in arrays:
            if arr.ndim == 2 and arr.shape[0] == 2:
                arr[1] = arr[0]
            else:
                arr *= 2


class NoCollectives(Backend):
    """One process whose collectives fail the test."""

    _type = "single"
    rank, num_workers, local_rank = 0, 1, 0

    def _allreduce_(self, names, arrays, priority):
        raise AssertionError(f"collective issued: {names}")

    _broadcast_ = _allreduce_


def _pair(shape, axis=1, kv=None, **kwargs):
    """A BatchNorm and a SyncBatchNorm with the same random gamma and beta."""
    channels = shape[axis]
    layers = (gluon.nn.BatchNorm(axis=axis, in_channels=channels, **kwargs),
              dg.SyncBatchNorm(axis=axis, in_channels=channels, kv=kv, **kwargs))
    rng = np.random.RandomState(1)
    gamma, beta = rng.rand(channels) + 0.5, rng.rand(channels)
    for layer in layers:
        layer.initialize()
        layer.gamma.set_data(mx.nd.array(gamma))
        layer.beta.set_data(mx.nd.array(beta))
    return layers


def _train_step(layer, x, dy):
    """Output, input gradient, gamma and beta gradients (those learnt) and running
    statistics of one recorded training forward and backward."""
    x = x.copy()
    x.attach_grad()
    with autograd.record():
        y = layer(x)
    y.backward(dy)
    grads = [p.grad() for p in (layer.gamma, layer.beta) if p.grad_req != "null"]
    return [a.asnumpy() for a in (y, x.grad, *grads, layer.running_mean.data(),
                                  layer.running_var.data())]


def test_on_one_process_it_is_batchnorm_bit_for_bit_and_communicates_nothing():
    rng = np.random.RandomState(0)
    x = mx.nd.array(rng.randn(4, 3, 5, 5) * 2 + 3)
    dy = mx.nd.array(rng.randn(4, 3, 5, 5))
    batchnorm, sync = _pair(x.shape, kv=NoCollectives())
    for _ in range(2):
        for expected, got in zip(_train_step(batchnorm, x, dy), _train_step(sync, x, dy)):
            assert np.array_equal(expected, got)
    assert np.array_equal(batchnorm(x).asnumpy(), sync(x).asnumpy())     # inference


@pytest.mark.parametrize("shape, axis, kwargs", [
    ((4, 3, 5, 5), 1, {}),
    ((6, 5), 1, {}),                           # after a Dense layer
    ((2, 4, 4, 3), 3, {}),                     # NHWC
    ((4, 3, 7), 1, {"scale": False}),
    ((4, 3, 5, 5), 1, {"center": False, "momentum": 0.7, "epsilon": 1e-3}),
])
@pytest.mark.parametrize("fake", [OneOfTwoIdentical, OneOfTwoIdenticalWithoutFloat64])
def test_the_synchronised_path_gives_batchnorms_values_when_the_workers_batches_are_equal(
        shape, axis, kwargs, fake):
    # two workers with the same batch: the global statistics are the local ones, and
    # each worker's gradients are those of BatchNorm on its batch
    rng = np.random.RandomState(0)
    x = mx.nd.array(rng.randn(*shape) * 3 + 5)
    dy = mx.nd.array(rng.randn(*shape))
    kv = fake()
    batchnorm, sync = _pair(shape, axis, kv=kv, **kwargs)
    for expected, got in zip(_train_step(batchnorm, x, dy), _train_step(sync, x, dy)):
        assert np.abs(expected - got).max() <= TOLERANCE * max(1.0, np.abs(expected).max())
    # the backward key is created at the first forward, then one collective each way
    layer = kv.keys[0].rsplit(".", 1)[0]
    assert kv.keys == [f"{layer}.backward", f"{layer}.forward", f"{layer}.backward"]


def test_gradients_accumulate_with_grad_req_add_as_with_batchnorm():
    rng = np.random.RandomState(0)
    x = mx.nd.array(rng.randn(4, 3, 5, 5))
    dy = mx.nd.array(rng.randn(4, 3, 5, 5))
    grads = []
    for layer in _pair(x.shape, kv=OneOfTwoIdentical()):
        layer.collect_params().setattr("grad_req", "add")
        data = x.copy()
        data.attach_grad(grad_req="add")
        for _ in range(2):
            with autograd.record():
                y = layer(data)
            y.backward(dy)
        grads.append([a.asnumpy() for a in (data.grad, layer.gamma.grad(), layer.beta.grad())])
    for expected, got in zip(*grads):
        assert np.abs(expected - got).max() <= TOLERANCE * np.abs(expected).max()


def test_gradients_reach_gamma_beta_and_the_input_when_the_other_needs_none():
    # the input straight from the data (no gradient) and frozen gamma and beta
    # (grad_req 'null'): whichever needs no gradient, the other still gets BatchNorm's
    rng = np.random.RandomState(0)
    x = mx.nd.array(rng.randn(4, 3, 5, 5) * 2 + 1)
    dy = mx.nd.array(rng.randn(4, 3, 5, 5))
    for frozen in (False, True):
        got = []
        for layer in _pair(x.shape, kv=OneOfTwoIdentical()):
            data = x.copy()
            if frozen:
                layer.collect_params().setattr("grad_req", "null")
                data.attach_grad()
            with autograd.record():
                y = layer(data)
            y.backward(dy)
            got.append([data.grad] if frozen else [layer.gamma.grad(), layer.beta.grad()])
        for expected, grad in zip(*got):
            expected, grad = expected.asnumpy(), grad.asnumpy()
            assert np.abs(expected).max() > 0
            assert np.abs(expected - grad).max() <= TOLERANCE * np.abs(expected).max()


def test_parameters_are_batchnorms_so_parameters_load_either_way(tmp_path):
    def net(norm):
        block = gluon.nn.HybridSequential()
        block.add(gluon.nn.Conv2D(4, 3, in_channels=3), norm(in_channels=4))
        block.initialize(mx.init.Uniform())
        return block

    batchnorm, sync = net(gluon.nn.BatchNorm), net(dg.SyncBatchNorm)
    names = [p.name.split("_", 1) for p in sync[1].collect_params().values()]
    assert [suffix for _, suffix in names] == ["gamma", "beta", "running_mean", "running_var"]
    assert all(re.fullmatch(r"batchnorm\d+", prefix) for prefix, _ in names)   # as BatchNorm's
    assert [p.grad_req for p in sync[1].collect_params().values()] == \
           [p.grad_req for p in batchnorm[1].collect_params().values()]
    for source, target in ((batchnorm, sync), (sync, batchnorm)):
        source[1].running_var.set_data(mx.nd.array([1.5, 2, 3, 4]))
        source.save_parameters(str(tmp_path / "p.params"))
        target.load_parameters(str(tmp_path / "p.params"))
        for a, b in zip(source.collect_params().values(), target.collect_params().values()):
            assert np.array_equal(a.data().asnumpy(), b.data().asnumpy())


def test_constructor_rejects_bad_arguments_naming_them():
    with pytest.raises(ValueError, match="momentum"):
        dg.SyncBatchNorm(momentum=1.5)
    with pytest.raises(ValueError, match="epsilon"):
        dg.SyncBatchNorm(epsilon=0)
    with pytest.raises(TypeError, match="kv"):
        dg.SyncBatchNorm(kv=object())


class _Stem(gluon.HybridBlock):
    def __init__(self):
        super().__init__()
        self.conv = gluon.nn.Conv2D(4, 3, in_channels=3)
        self.bn = gluon.nn.BatchNorm()
        self.fused = gluon.nn.BatchNormReLU()

    def hybrid_forward(self, F, x):
        return self.fused(self.bn(self.conv(x)))


def test_convert_sync_batchnorm_converts_in_place_keeping_parameters_and_values():
    net = gluon.nn.HybridSequential()
    net.add(_Stem(), gluon.nn.Conv2D(4, 1), gluon.nn.BatchNorm(scale=False, momentum=0.8))
    net.initialize(mx.init.Uniform())
    x = mx.nd.array(np.random.RandomState(0).randn(2, 3, 6, 6))
    with autograd.record():
        net(x).backward()       # running statistics move away from their initial values
    before = {name: (p, p.data().asnumpy()) for name, p in net.collect_params().items()}
    expected = net(x).asnumpy()
    stem_bn = net[0].bn

    assert dg.convert_sync_batchnorm(net, kv=NoCollectives()) is net
    assert net[0].bn is stem_bn and isinstance(stem_bn, dg.SyncBatchNorm)
    assert isinstance(net[2], dg.SyncBatchNorm)
    assert type(net[0].fused) is gluon.nn.BatchNormReLU          # not a plain BatchNorm
    assert net[2]._kwargs["momentum"] == 0.8 and net[2]._kwargs["fix_gamma"]
    after = net.collect_params()
    assert list(after) == list(before)
    for name, (param, value) in before.items():
        assert after[name] is param and np.array_equal(param.data().asnumpy(), value)
    assert np.array_equal(net(x).asnumpy(), expected)


def test_hybridize_works_on_one_process_and_raises_a_clear_error_on_several_workers():
    net = gluon.nn.HybridSequential()
    net.add(gluon.nn.Conv2D(4, 3), dg.SyncBatchNorm(kv=NoCollectives()))
    net.initialize()
    net.hybridize()
    with autograd.record():
        net(mx.nd.ones((2, 3, 6, 6))).backward()

    net = gluon.nn.HybridSequential()
    net.add(gluon.nn.Conv2D(4, 3), dg.SyncBatchNorm(kv=OneOfTwoIdentical()))
    with pytest.raises(RuntimeError, match=r"cannot run in a hybridized graph when training "
                                           r"on 2 workers.*Do not call hybridize\(\)"):
        net.hybridize()
    net.hybridize(False)

    plain = gluon.nn.HybridSequential()
    plain.add(gluon.nn.Conv2D(4, 3), gluon.nn.BatchNorm())
    plain.hybridize()
    with pytest.raises(RuntimeError, match=r"is hybridized: convert before hybridize\(\)"):
        dg.convert_sync_batchnorm(plain, kv=OneOfTwoIdentical())
    assert type(plain[1]) is gluon.nn.BatchNorm        # left as it was


# ---------------------------------------------------------------- through the launcher
@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One plain process: nn.BatchNorm on the concatenation of the workers' batches."""
    out = tmp_path_factory.mktemp("reference")
    assert_ok(run([sys.executable, str(WORKERS / "syncbn_cases.py"), str(out)], out,
                  gluoncv=True))
    return out


# The shared job trains gluoncv's ResNet-18 in float32 and float64 besides the small
# cases (about 40 s on horovod), so the tests that read it are in make test only; make
# test-fast keeps SyncBatchNorm's one-process tests.
@pytest.fixture(scope="module", params=TRAINING_BACKENDS)
def distributed(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(request.param)
    assert_ok(run(launcher(request.param, WORKERS / "syncbn_cases.py", out), out,
                  gluoncv=True))
    return request.param, out


def _params(directory, case, rank=0):
    data = np.load(directory / f"{case}_rank{rank}.npz")
    return [data[str(i)] for i in range(len(data.files))]


def _report(directory, rank):
    return json.loads((directory / f"report_rank{rank}.json").read_text())


def _max_error(a, b):
    assert [x.shape for x in a] == [y.shape for y in b]
    return max(float(np.abs(x - y).max()) for x, y in zip(a, b))


@pytest.mark.parametrize("case", ["even", "converted"])
@pytest.mark.slow
def test_two_workers_with_syncbn_train_like_one_process_with_batchnorm_on_the_whole_batch(
        distributed, reference, case):
    # parameters and running statistics after 5 SGD steps; rank 1 started from other
    # weights and other parameter names, 'converted' was a BatchNorm net until its
    # first forward
    _, out = distributed
    expected = _params(reference, case)
    for rank in (0, 1):
        assert _max_error(_params(out, case, rank), expected) < TOLERANCE, (case, rank)


CASES = ["even", "uneven", "converted", "resnet18_float32", "resnet18_float64"]


@pytest.mark.slow
def test_two_workers_sum_every_layers_statistics_over_the_side_channel(distributed):
    # one process per worker on horovod or dist_sync, nothing elastic: SyncBatchNorm's
    # sums leave the backend for the direct connections of dist_gluon/sidechannel.py
    _, out = distributed
    for rank in (0, 1):
        transports = _report(out, rank)["transports"]
        assert transports == dict.fromkeys(CASES, ["side channel"]), transports


@pytest.mark.slow
def test_every_layers_backward_runs_in_the_compiled_callback_over_the_side_channel(
        distributed):
    # the equality tests here read these very jobs: the compiled backward is what they
    # prove equal to one process
    _, out = distributed
    for rank in (0, 1):
        compiled = _report(out, rank)["compiled"]
        assert compiled == dict.fromkeys(CASES, 1.0), compiled


@pytest.mark.slow
def test_ranks_with_different_batch_sizes_train_like_one_process_on_the_concatenation(
        distributed, reference):
    _, out = distributed
    rank0 = _params(out, "uneven", 0)
    assert _max_error(rank0, _params(reference, "uneven")) < TOLERANCE
    assert _max_error(_params(out, "uneven", 1), rank0) == 0.0


@pytest.mark.slow
def test_gluoncv_resnet18_v1b_with_syncbn_norm_layer_keeps_every_rank_identical(distributed):
    _, out = distributed
    for dtype in ("float32", "float64"):
        rank0 = _params(out, f"resnet18_{dtype}", 0)
        assert all(np.isfinite(a).all() for a in rank0)
        assert _max_error(_params(out, f"resnet18_{dtype}", 1), rank0) == 0.0


@pytest.mark.slow
def test_gluoncv_resnet18_v1b_with_syncbn_trains_like_one_process_in_float64(
        distributed, reference):
    _, out = distributed
    assert _max_error(_params(out, "resnet18_float64"),
                      _params(reference, "resnet18_float64")) < 1e-8


def test_one_process_syncbn_trains_exactly_like_batchnorm_also_hybridized(reference):
    assert _max_error(_params(reference, "sync_one_process"), _params(reference, "even")) == 0
    assert _max_error(_params(reference, "hybrid_SyncBatchNorm"),
                      _params(reference, "hybrid_BatchNorm")) == 0


@pytest.mark.slow
def test_hybridizing_a_syncbn_network_on_two_workers_raises_a_clear_error_on_every_rank(
        distributed):
    _, out = distributed
    for rank in (0, 1):
        errors = _report(out, rank)["errors"]
        assert len(errors) == 2
        assert all("cannot run in a hybridized graph when training on 2 workers" in e
                   for e in errors)


@pytest.fixture(scope="module")
def micro_batch_reference(tmp_path_factory):
    """One plain process: nn.BatchNorm on both workers' micro-batches, accumulated."""
    out = tmp_path_factory.mktemp("micro_reference")
    assert_ok(run([sys.executable, str(WORKERS / "syncbn_microbatches.py"), str(out), "1"],
                  out))
    return _params(out, "micro")


# horovod's sums through the backend (DG_SYNCBN_SIDE=0; the shared job above takes the
# side channel), p3's over the side channel, and a worker's 2 devices through the backend
@pytest.mark.parametrize("backend,devices,side,transport", [
    ("horovod", 1, "0", "backend"), ("dist_sync", 2, "1", "backend"),
    ("p3", 1, "1", "side channel")])
@pytest.mark.spawns
def test_micro_batches_backward_out_of_order_on_one_rank_still_pair_by_micro_batch(
        tmp_path, micro_batch_reference, backend, devices, side, transport):
    # grad_req='add' over 2 micro-batches a step; rank 0 holds the first micro-batch's
    # backward of a layer 0.5 s, so the second's runs first there. With one backward key
    # per layer the two ranks summed each other's other micro-batch (0.71 from one
    # process on every backend; the combination matrix's row 03 failed so, 1 run in 4)
    argv = launcher(backend, WORKERS / "syncbn_microbatches.py", tmp_path, devices, 0.5)
    proc = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=240,
                          env=process_env(MXNET_CPU_TEMP_COPY="1024", DG_SYNCBN_SIDE=side))
    assert_ok(proc)
    for rank in (0, 1):
        assert _max_error(_params(tmp_path, "micro", rank), micro_batch_reference) \
            < TOLERANCE, rank
        assert f"[{rank}] sums over: {transport}" in proc.stdout, proc.stdout[-2000:]


@pytest.mark.spawns
def test_the_imagenet_example_trains_with_syncbn_on_two_workers(tmp_path):
    proc = run(launcher("dist_sync", REPO / "examples" / "imagenet" / "train_imagenet.py",
                        "--synthetic", "--syncbn", "--model", "resnet18_v1b", "--input-size",
                        "32", "--num-classes", "10", "--batch-size", "4", "--epochs", "1",
                        "--steps-per-epoch", "4", "--log-interval", "2"), tmp_path,
               gluoncv=True)
    assert_ok(proc)
    lines = [line[4:] for line in proc.stdout.splitlines() if line.startswith("[0] ")]
    assert any("SyncBatchNorm: statistics over the samples of all 2 worker(s) x 1 device(s), "
               "not hybridized" in line
               for line in lines), lines
    assert lines[-1].startswith("summary:") and "workers=2" in lines[-1]


@pytest.mark.spawns
def test_an_empty_batch_on_one_rank_is_a_clear_error_not_nan(tmp_path):
    script = """
    import mxnet as mx
    import numpy as np
    from mxnet import autograd

    import dist_gluon as dg

    kv = dg.create()
    bn = dg.SyncBatchNorm(in_channels=4)
    bn.initialize()
    x = mx.nd.array(np.ones((3, 4)) if kv.rank == 0 else np.ones((0, 4)))
    with autograd.record():
        y = bn(x)
    print("mean", float(y.mean().asscalar()), flush=True)
    """
    proc = launch(script, tmp_path, "horovod", n=2, timeout=120)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "rank 1 (" in proc.stderr
    assert "SyncBatchNorm got an empty batch (0, 4) on rank 1; every rank needs at least " \
        "one sample" in proc.stderr, proc.stderr[-3000:]
    assert "nan" not in proc.stdout


def test_amp_with_syncbn_on_horovod_is_refused_naming_both_and_composes_on_dist_sync(
        tmp_path):
    # horovod sums SyncBatchNorm's statistics in float64, which AMP's casts turn into
    # float64 MKLDNN operators: it trained wrong without a word (the combination matrix
    # found it); dist_sync's float32 all-gather composes with AMP
    script = """
    import mxnet as mx
    import numpy as np
    from mxnet import autograd
    from mxnet.contrib import amp

    import dist_gluon as dg

    amp.init()
    kv = dg.create()
    bn = dg.SyncBatchNorm(in_channels=4)
    bn.initialize()
    x = mx.nd.array(np.arange(12).reshape(3, 4) * (kv.rank + 1))
    with autograd.record():
        y = bn(x)
    y.backward()
    print("mean", float(y.mean().asscalar()), flush=True)
    """
    refused = launch(script, tmp_path, "horovod", n=2, timeout=120)
    assert refused.returncode == 1, refused.stderr[-3000:]
    assert "SyncBatchNorm cannot sum its statistics in float64 (horovod's exact sums) " \
        "after mx.contrib.amp.init()" in refused.stderr, refused.stderr[-3000:]
    composed = launch(script, tmp_path, "dist_sync", n=2, timeout=120)
    assert_ok(composed)
