"""DistributedOptimizer and the Module API: N workers on B samples each train exactly like
one process on the N*B concatenated samples; everything but the gradient average is the
wrapped optimizer's; a kvstore besides it is refused."""
import json
import logging
import pickle
import sys
import textwrap
import warnings

import mxnet as mx
import numpy as np
import pytest
from mxnet import gluon

import dist_gluon as dg
from conftest import (
    REPO,
    TRAINING_BACKENDS,
    assert_ok,
    launch,
    launcher,
    run,
    worker_lines,
)
from dist_gluon.optimizer import DistributedOptimizer

WORKERS = REPO / "tests" / "workers"
EXACT_CASES = ["sgd", "aggregated", "adam", "full", "part", "resumed"]
# rank 0's Module is bound with batch size 5, rank 1's with 3
UNEVEN_CASES = ["uneven", "uneven_aggregated"]



# ---------------------------------------------------------------- distributed runs
@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The single-process run on the concatenated batches (no launcher: local backend)."""
    out = tmp_path_factory.mktemp("reference")
    assert_ok(run([sys.executable, str(WORKERS / "module_cases.py"), str(out), "2"], out))
    return out


@pytest.fixture(scope="module", params=TRAINING_BACKENDS)
def distributed(request, tmp_path_factory):
    """(output directory, launcher stdout) of 2 workers on ``request.param``."""
    out = tmp_path_factory.mktemp(request.param)
    proc = run(launcher(request.param, WORKERS / "module_cases.py", out, 2), out)
    assert_ok(proc)
    return out, proc.stdout


def _params(directory, case, rank):
    return dict(np.load(directory / f"{case}_rank{rank}.npz"))


def _max_error(a, b):
    assert sorted(a) == sorted(b)
    return max(float(np.abs(a[k] - b[k]).max()) for k in a)


def _record(directory, case, rank):
    return json.loads((directory / f"{case}_rank{rank}.json").read_text())


@pytest.mark.parametrize("case", EXACT_CASES)
def test_two_workers_train_like_one_process_on_the_concatenated_batch(
        distributed, reference, case):
    out, _ = distributed
    expected = _params(reference, case, 0)
    for rank in (0, 1):
        assert _max_error(_params(out, case, rank), expected) < 1e-5, (case, rank)


@pytest.mark.parametrize("case", UNEVEN_CASES)
def test_modules_with_different_batch_sizes_train_like_one_process_on_the_concatenation(
        distributed, reference, case):
    out, _ = distributed
    expected = _params(reference, case, 0)
    rank0 = _params(out, case, 0)
    assert _max_error(rank0, expected) < 1e-5
    assert _max_error(_params(out, case, 1), rank0) == 0.0       # ranks stay identical


def test_every_rank_starts_from_rank_0_arg_and_aux_params(distributed, reference):
    out, _ = distributed
    rank0 = _params(out, "sgd_init", 0)
    assert {"bn_moving_mean", "bn_moving_var", "fc1_weight"} <= set(rank0)
    assert _max_error(_params(out, "sgd_init", 1), rank0) == 0.0
    assert _max_error(rank0, _params(reference, "sgd_init", 0)) == 0.0


def test_updates_are_aggregated_or_not_as_mxnet_optimizer_aggregation_size_says(
        distributed, reference):
    out, _ = distributed
    for rank in (0, 1):
        assert _record(out, "sgd", rank)["aggregated"] is False
        assert _record(out, "aggregated", rank)["aggregated"] is True
        # created from a name: Module gave it rescale_grad = 1 / per-worker batch size
        assert _record(out, "aggregated", rank)["rescale_grad"] == 1 / 8
    assert _record(reference, "aggregated", 0)["rescale_grad"] == 1 / 16
    assert _record(out, "aggregated", 0)["num_update"] == 12     # 3 epochs of 4 steps
    assert _record(out, "aggregated", 0)["learning_rate"] == pytest.approx(0.1 * 0.5 ** 3)


def test_fp16_compression_keeps_ranks_identical_and_close_to_fp32(distributed, reference):
    out, _ = distributed
    rank0 = _params(out, "fp16", 0)
    assert _max_error(_params(out, "fp16", 1), rank0) == 0.0
    assert all(v.dtype == np.float32 for v in rank0.values())
    assert _max_error(rank0, _params(reference, "fp16", 0)) < 1e-3


def test_a_run_resumed_from_a_rank_0_checkpoint_ends_like_an_uninterruptedrun(
        distributed):
    out, _ = distributed
    full = _params(out, "full", 0)
    assert _max_error(_params(out, "part", 0), full) > 1e-2      # resuming had work to do
    for rank in (0, 1):
        assert _max_error(_params(out, "resumed", rank), full) < 1e-6
    assert (out / "ckpt-0002.states").exists() and (out / "ckpt-0002.params").exists()


def test_a_kvstore_besides_the_optimizer_is_refused_on_every_rank(distributed):
    _, stdout = distributed
    for rank in (0, 1):
        caught = [line for line in worker_lines(stdout, rank) if line.startswith("caught")]
        assert caught and "kvstore=None" in caught[0], stdout
        assert worker_lines(stdout, rank)[-1] == "cases done"


@pytest.mark.spawns
def test_the_readme_module_recipe_gives_every_worker_the_same_number_of_batches(tmp_path):
    # 65 samples: split with x[rank::2], rank 0 would run one batch more than rank 1
    # and wait for it forever on ps-lite
    readme = (REPO / "README.md").read_text()
    section = readme[readme.index("## The Module API"):]
    recipe = section[section.index("```python") + len("```python"):section.index("```\n\n")]
    script = textwrap.dedent("""
        import mxnet as mx
        import numpy as np
        rng = np.random.RandomState(0)
        x = rng.randn(65, 6).astype("float32")
        y = rng.randint(0, 3, 65).astype("float32")
        symbol = mx.sym.SoftmaxOutput(mx.sym.FullyConnected(
            mx.sym.Variable("data"), num_hidden=3, name="fc"), name="softmax")
        """) + recipe + textwrap.dedent("""
        import json
        print(json.dumps({k: v.asnumpy().ravel().tolist()
                          for k, v in mod.get_params()[0].items()}))
        """)
    proc = launch(script, tmp_path, "dist_sync", launcher_args=["--timeout", "90"],
                  timeout=120)
    assert_ok(proc)
    rank0, rank1 = (json.loads(worker_lines(proc.stdout, r)[-1]) for r in (0, 1))
    assert rank0 == rank1 and set(rank0) == {"fc_weight", "fc_bias"}


# ---------------------------------------------------------------- one process
def _symbol():
    data = mx.sym.Variable("data")
    weight = mx.sym.Variable("fc1_weight", lr_mult=0.3)
    net = mx.sym.FullyConnected(data, weight=weight, num_hidden=8, name="fc1")
    net = mx.sym.Activation(net, act_type="relu")
    net = mx.sym.FullyConnected(net, num_hidden=3, name="fc2")
    return mx.sym.SoftmaxOutput(net, name="softmax")


def _iter():
    rng = np.random.RandomState(0)
    return mx.io.NDArrayIter(rng.randn(32, 5).astype("float32"),
                             rng.randint(0, 3, 32).astype("float32"), 8)


def _module(context=None):
    it = _iter()
    mod = mx.mod.Module(_symbol(), context=context or mx.cpu())
    mod.bind(data_shapes=it.provide_data, label_shapes=it.provide_label)
    mx.random.seed(1)
    mod.init_params(mx.init.Xavier())
    return mod, it


def _fit(optimizer, optimizer_params=(), epochs=2, **kw):
    mod, it = _module()
    logging.getLogger().setLevel(logging.WARNING)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Parameters already initialized")
        warnings.filterwarnings("error", message="Optimizer created manually")
        mod.fit(it, optimizer=optimizer, optimizer_params=optimizer_params,
                num_epoch=epochs, **kw)
    return mod, {k: v.asnumpy() for k, v in mod.get_params()[0].items()}


@pytest.fixture
def no_collectives(monkeypatch):
    """The local backend, made to fail on any collective."""
    kv = dg.create("local")

    def boom(*args, **kwargs):
        raise AssertionError("collective issued")

    monkeypatch.setattr(kv, "_allreduce_", boom, raising=False)
    monkeypatch.setattr(kv, "_broadcast_", boom, raising=False)
    return kv


@pytest.mark.parametrize("aggregation", ["0", "4"])
def test_on_one_process_it_trains_exactly_like_the_wrapped_optimizer(
        no_collectives, monkeypatch, aggregation):
    monkeypatch.setenv("MXNET_OPTIMIZER_AGGREGATION_SIZE", aggregation)

    def sgd():
        opt = mx.optimizer.SGD(learning_rate=0.1, momentum=0.9, wd=0.01, rescale_grad=1 / 8,
                               lr_scheduler=mx.lr_scheduler.FactorScheduler(
                                   step=3, factor=0.5, base_lr=0.1))
        opt.set_lr_mult({"fc2_weight": 2.0})
        opt.set_wd_mult({"fc1_bias": 0.0})
        return opt

    _, plain = _fit(sgd(), kvstore=None)
    wrapped = DistributedOptimizer(sgd(), kv=no_collectives)
    mod, got = _fit(wrapped, kvstore=None)
    assert _max_error(got, plain) == 0.0
    assert mod._updater.aggregate_updates is (aggregation == "4")
    assert wrapped.num_update == 8 and wrapped.learning_rate == 0.1 * 0.5 ** 2


@pytest.mark.parametrize("saver", ["module", "distributed"])
def test_optimizer_states_move_between_module_and_distributed_optimizer(
        no_collectives, tmp_path, saver):
    # DistributedOptimizer keeps Module's own indices, so save_optimizer_states files of
    # either load into the other and the next epoch is the same
    def adam(distributed):
        opt = mx.optimizer.Adam(learning_rate=0.01, rescale_grad=1 / 8)
        return DistributedOptimizer(opt, kv=no_collectives) if distributed else opt

    first, _ = _fit(adam(saver == "distributed"), kvstore=None, epochs=1)
    first.save_optimizer_states(str(tmp_path / "states"))
    arg_params, aux_params = first.get_params()
    after = {}
    for loader in ("module", "distributed"):
        mod, it = _module()
        mod.set_params(arg_params, aux_params)
        mod.init_optimizer(kvstore=None, optimizer=adam(loader == "distributed"))
        mod.load_optimizer_states(str(tmp_path / "states"))
        for batch in it:
            mod.forward_backward(batch)
            mod.update()
        after[loader] = {k: v.asnumpy() for k, v in mod.get_params()[0].items()}
    assert _max_error(after["distributed"], after["module"]) == 0.0


def test_created_from_a_name_it_is_set_up_as_module_sets_up_that_name(no_collectives):
    params = {"learning_rate": 0.1, "momentum": 0.9, "wd": 0.1}
    module_made, expected = _fit("sgd", params, kvstore=None)
    opt = DistributedOptimizer("sgd", kv=no_collectives, **params)
    _, got = _fit(opt)                       # fit's default kvstore='local' is none on 1 device
    assert _max_error(got, expected) == 0.0
    assert opt.rescale_grad == 1 / 8
    assert opt.lr_mult == module_made._optimizer.lr_mult == {"fc1_weight": 0.3}
    assert opt.wd_mult == module_made._optimizer.wd_mult == {"fc1_bias": 0.0, "fc2_bias": 0.0}


def test_created_from_a_name_it_keeps_what_the_user_gave_or_set():
    opt = DistributedOptimizer("sgd", kv="local", learning_rate=0.1, rescale_grad=0.5)
    opt.set_lr_mult({"fc2_weight": 2.0})
    with pytest.warns(UserWarning, match="rescale_grad is not normalized"):
        mod, _ = _module()
        mod.init_optimizer(kvstore=None, optimizer=opt)
    assert opt.rescale_grad == 0.5
    assert opt.lr_mult == {"fc1_weight": 0.3, "fc2_weight": 2.0}


def test_everything_but_the_update_is_the_wrapped_optimizers():
    inner = mx.optimizer.Adam(learning_rate=0.01, wd=0.1, multi_precision=True)
    opt = DistributedOptimizer(inner, kv="local")
    assert (opt.lr, opt.wd, opt.multi_precision, opt.aggregate_num) == (0.01, 0.1, True, 0)
    opt.set_learning_rate(0.02)
    opt.lr_scheduler = None
    opt.idx2name = {0: "w"}
    opt.param_dict = {}
    opt.set_lr_mult({"w": 3.0})
    opt.set_wd_mult({"w": 0.5})
    assert inner.lr == opt.learning_rate == 0.02 and inner.idx2name == {0: "w"}
    assert inner._get_lr(0) == opt._get_lr(0) == pytest.approx(0.06)
    assert inner._get_wd(0) == opt._get_wd(0) == pytest.approx(0.05)
    assert isinstance(opt, mx.optimizer.Optimizer)
    assert "prefix='opt" in repr(opt) and "Adam" in repr(opt)


def test_multi_precision_keeps_a_float32_master_copy_of_float16_weights(no_collectives):
    def step(optimizer):
        updater = mx.optimizer.get_updater(optimizer)
        weight = mx.nd.array([[1.0, -2.0], [0.5, 0.25]], dtype="float16")
        for _ in range(3):
            updater(0, mx.nd.array([[0.1, 0.2], [-0.3, 0.4]], dtype="float16"), weight)
        return weight, updater.states[0]

    plain, _ = step(mx.optimizer.SGD(learning_rate=0.1, momentum=0.9, multi_precision=True))
    weight, state = step(DistributedOptimizer(
        mx.optimizer.SGD(learning_rate=0.1, momentum=0.9, multi_precision=True),
        kv=no_collectives))
    assert weight.dtype == np.float16 and state[0].dtype == np.float32
    assert np.array_equal(weight.asnumpy(), plain.asnumpy())


def test_optimizer_states_round_trip_through_save_and_load_optimizer_states(tmp_path):
    opt = DistributedOptimizer(mx.optimizer.SGD(learning_rate=0.1, momentum=0.9,
                                                rescale_grad=1 / 8), kv="local")
    mod, _ = _fit(opt, kvstore=None)
    fname = str(tmp_path / "opt.states")
    mod.save_optimizer_states(fname)
    saved = {k: v.asnumpy() for k, v in mod._updater.states.items()}
    for state in mod._updater.states.values():
        state[:] = 7.0
    mod.load_optimizer_states(fname)
    assert mod._updater.optimizer is opt
    for k, v in mod._updater.states.items():
        assert np.array_equal(v.asnumpy(), saved[k]) and not np.all(saved[k] == 7.0)


def test_a_pickled_copy_is_a_working_distributed_optimizer(no_collectives):
    opt = DistributedOptimizer("sgd", kv=no_collectives, learning_rate=0.3, momentum=0.9,
                               prefix="mlp", gradient_predivide_factor=2.0)
    mod, _ = _fit(opt, kvstore=None)
    # what an Updater saved with its optimizer (gluon's save_states) holds
    mod._updater.set_states(mod._updater.get_states(dump_optimizer=True))
    copy = mod._updater.optimizer
    assert isinstance(copy, DistributedOptimizer) and copy is not opt
    assert (copy.lr, copy.momentum, copy.num_update) == (0.3, 0.9, opt.num_update)
    assert (copy._dg_prefix, copy._dg_predivide) == ("mlp", 2.0)
    assert copy.kv is no_collectives              # found again on first use
    mod.fit(_iter(), kvstore=None, optimizer=opt, num_epoch=1, force_init=False)
    assert copy.num_update == opt.num_update + 4
    assert pickle.loads(pickle.dumps(opt)).rescale_grad == opt.rescale_grad


def test_a_key_prefix_is_used_by_one_trainer_or_optimizer_only():
    DistributedOptimizer("sgd", kv="local", prefix="shared.prefix")
    with pytest.raises(ValueError, match="'shared.prefix' is already used"):
        DistributedOptimizer("sgd", kv="local", prefix="shared.prefix")
    net = gluon.nn.Dense(2, in_units=3)
    net.initialize()
    with pytest.raises(ValueError, match="'shared.prefix' is already used"):
        dg.DistributedTrainer(net.collect_params(), "sgd", kv="local", prefix="shared.prefix")


def test_two_optimizers_get_their_own_keys_in_construction_order():
    first, second = (DistributedOptimizer("sgd", kv="local") for _ in range(2))
    assert int(second._dg_prefix[3:]) == int(first._dg_prefix[3:]) + 1
    assert DistributedOptimizer("sgd", kv="local", prefix="gan.d")._dg_prefix == "gan.d"


# ---------------------------------------------------------------- misuse
def test_installing_it_with_a_kvstore_raises_a_clear_error():
    opt = DistributedOptimizer("sgd", kv="local")
    for kvstore in (mx.kv.create("local"), dg.create("local")):
        mod, _ = _module()
        with pytest.raises(ValueError, match=r"kvstore=None.*mod.fit\(train_iter, "
                                             r"kvstore=None, optimizer=opt\)"):
            mod.init_optimizer(kvstore=kvstore, optimizer=opt)
        assert not mod.optimizer_initialized
    with pytest.raises(ValueError, match="given to a 'local' kvstore .set_optimizer."):
        mx.kv.create("local").set_optimizer(opt)

    def set_optimizer(self, optimizer):      # what a dist KVStore does for its servers
        return pickle.dumps(optimizer, 0)

    with pytest.raises(ValueError, match="given to a 'local' kvstore .set_optimizer."):
        set_optimizer(mx.kv.create("local"), opt)


def _fit_on(contexts, optimizer, epochs=2):
    """``_fit`` of a Module bound to ``contexts`` (the batch of 8 split over them)."""
    it = _iter()
    mod = mx.mod.Module(_symbol(), context=contexts)
    mod.bind(data_shapes=it.provide_data, label_shapes=it.provide_label)
    mx.random.seed(1)
    mod.init_params(mx.init.Xavier())
    logging.getLogger().setLevel(logging.WARNING)
    mod.fit(it, kvstore=None, optimizer=optimizer, num_epoch=epochs)
    return {k: v.asnumpy() for k, v in mod.get_params()[0].items()}


def test_a_module_on_several_devices_trains_like_one_device(no_collectives):
    # Module with kvstore=None does not sum its devices' gradients; the optimizer does
    def adam():
        return DistributedOptimizer(mx.optimizer.Adam(learning_rate=0.01, rescale_grad=1 / 8),
                                    kv=no_collectives)

    one = _fit_on([mx.cpu(0)], adam())
    two = _fit_on([mx.cpu(0), mx.cpu(1)], adam())
    assert _max_error(two, one) < 1e-6


def test_a_module_on_several_devices_with_a_kvstore_says_to_pass_none():
    mod, it = _module(context=[mx.cpu(0), mx.cpu(1)])
    with pytest.raises(ValueError, match=r"2 devices makes even kvstore='local' a kvstore"):
        mod.fit(it, optimizer=DistributedOptimizer("sgd", kv="local"), num_epoch=1)


MODULE_ON_DEVICES = """
    import json, sys
    import mxnet as mx
    import numpy as np
    import dist_gluon as dg

    kv = dg.create()
    devices = int(sys.argv[1])
    rng = np.random.RandomState(0)
    x, y = rng.randn(32, 5).astype("float32"), rng.randint(0, 3, 32).astype("float32")
    share = slice(kv.rank * 8 // kv.num_workers, (kv.rank + 1) * 8 // kv.num_workers)
    # batches of 8 (global): rank r takes its share of each
    rows = np.concatenate([np.arange(b, b + 8)[share] for b in range(0, 32, 8)])
    it = mx.io.NDArrayIter(x[rows], y[rows], 8 // kv.num_workers)
    data = mx.sym.Variable("data")
    net = mx.sym.FullyConnected(data, num_hidden=8, name="fc1")
    net = mx.sym.Activation(net, act_type="relu")
    net = mx.sym.FullyConnected(net, num_hidden=3, name="fc2")
    net = mx.sym.SoftmaxOutput(net, name="softmax")
    mod = mx.mod.Module(net, context=[mx.cpu(i) for i in range(devices)])
    mod.bind(data_shapes=it.provide_data, label_shapes=it.provide_label)
    mx.random.seed(1)
    mod.init_params(mx.init.Xavier())
    opt = dg.DistributedOptimizer(mx.optimizer.SGD(learning_rate=0.1, momentum=0.9,
                                                   rescale_grad=1.0 / it.batch_size))
    mod.fit(it, kvstore=None, optimizer=opt, num_epoch=2)
    print(json.dumps({k: v.asnumpy().ravel().tolist()
                      for k, v in mod.get_params()[0].items()}))
    """


@pytest.mark.parametrize("backend", TRAINING_BACKENDS)
@pytest.mark.spawns
def test_two_workers_of_two_devices_train_a_module_like_one_process(tmp_path, backend):
    one = run([sys.executable, "-c", textwrap.dedent(MODULE_ON_DEVICES), "1"], tmp_path)
    assert_ok(one)
    expected = json.loads(one.stdout.strip().splitlines()[-1])
    proc = launch(MODULE_ON_DEVICES, tmp_path, backend, args=["2"])
    assert_ok(proc)
    for rank in (0, 1):
        got = json.loads(worker_lines(proc.stdout, rank)[-1])
        assert sorted(got) == sorted(expected)
        for name in got:
            assert np.abs(np.array(got[name]) - np.array(expected[name])).max() < 1e-5, name


@pytest.mark.parametrize("args, kwargs, error, message", [
    ((42,), {}, TypeError, "mx.optimizer.Optimizer or the name"),
    ((mx.optimizer.SGD(),), {"learning_rate": 0.1}, TypeError, "go with an optimizer name"),
    (("sgd",), {"gradient_predivide_factor": 0}, ValueError, "must be positive"),
    (("sgd",), {"prefix": ""}, ValueError, "non-empty string"),
    (("sgd",), {"compression": "int8"}, ValueError, "unknown compression 'int8'; valid types"),
    (("nosuch",), {}, ValueError, "Cannot find optimizer nosuch"),
    (("sgd",), {"kv": "nosuch"}, ValueError, "unknown backend 'nosuch'"),
])
def test_bad_arguments_raise_clear_errors(args, kwargs, error, message):
    with pytest.raises(error, match=message):
        DistributedOptimizer(*args, **kwargs)


def test_wrapping_a_distributed_optimizer_again_raises():
    with pytest.raises(ValueError, match="already a DistributedOptimizer"):
        DistributedOptimizer(DistributedOptimizer("sgd", kv="local"), kv="local")


def test_distributed_trainer_unwraps_it_with_a_warning():
    inner = mx.optimizer.SGD(learning_rate=0.1)
    net = gluon.nn.Dense(2, in_units=3)
    net.initialize()
    with pytest.warns(UserWarning, match="given a DistributedOptimizer"):
        trainer = dg.DistributedTrainer(net.collect_params(),
                                        DistributedOptimizer(inner, kv="local"), kv="local")
    assert trainer._optimizer is inner


LOSS_SCALES = """
import json

import mxnet as mx
import numpy as np

import dist_gluon as dg

kv = dg.create()
rank = kv.rank
batch, scale = (5, 128.0) if rank == 0 else (3, 1024.0)    # per-rank dynamic scales
rng = np.random.RandomState(rank)
per_sample = rng.randn(batch, 4)
opt = dg.DistributedOptimizer(mx.optimizer.SGD(learning_rate=0.5,
                                               rescale_grad=1.0 / (batch * scale)),
                              kv=kv, loss_scale=scale)
updater = mx.optimizer.get_updater(opt)
weight = mx.nd.ones((4,))
for step in range(2):
    grad = mx.nd.array(per_sample.sum(axis=0) * scale)     # the scaled loss's gradient
    updater(0, grad, weight)
    if step == 0:
        opt.loss_scale = scale = scale / 2                   # the scaler backs off
        opt.rescale_grad = 1.0 / (batch * scale)
json.dump({"weight": weight.asnumpy().tolist(), "sent": per_sample.sum(axis=0).tolist()},
          open(f"rank{rank}.json", "w"))
"""


@pytest.mark.spawns
def test_ranks_with_different_loss_scales_are_weighed_by_their_batch_sizes(tmp_path):
    assert_ok(launch(LOSS_SCALES, tmp_path, "horovod", n=2))
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    mean = (np.array(ranks[0]["sent"]) + np.array(ranks[1]["sent"])) / (5 + 3)
    expected = 1.0 - 2 * 0.5 * mean
    for found in ranks:
        np.testing.assert_allclose(found["weight"], expected, rtol=1e-6)


def test_a_bad_loss_scale_is_a_clear_error():
    with pytest.raises(ValueError, match="loss_scale must be a positive number, got 0"):
        dg.DistributedOptimizer("sgd", kv="local", loss_scale=0)
