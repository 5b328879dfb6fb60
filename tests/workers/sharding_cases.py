"""Worker script of tests/test_sharding.py: DistributedTrainer(...,
shard_optimizer_states=True) against one process.

    python sharding_cases.py OUT_DIR

Every rank trains the sharded trainer on its share of each global batch and, alone, a
plain gluon.Trainer on the whole global batch (the one-process reference, from the same
initial weights), and checks that the weights agree; each case prints ``ok <case>``.
"""
import os
import pickle
import sys

import mxnet as mx
import numpy as np
from mxnet import autograd, gluon

import dist_gluon as dg

out_dir = sys.argv[1]
os.makedirs(out_dir, exist_ok=True)
kv = dg.create()
N, rank = kv.num_workers, kv.rank
STEPS, FEATURES, HIDDEN, CLASSES = 4, 10, 17, 3
GLOBAL = 6 * N + 1          # global batch: uneven shares (rank 0 gets one more sample)
rng = np.random.RandomState(0)
X = rng.randn(STEPS + 2, GLOBAL, FEATURES).astype("float32")
Y = rng.randint(0, CLASSES, (STEPS + 2, GLOBAL)).astype("float32")
loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
lo = [r * (GLOBAL // N) + min(r, GLOBAL % N) for r in range(N + 1)]


def make_net(dtype="float32"):
    # a bias of one element (Dense(1)): its parts are empty on every rank but rank 0
    net = gluon.nn.HybridSequential()
    net.add(gluon.nn.Dense(HIDDEN, activation="relu", in_units=FEATURES),
            gluon.nn.Dense(1, in_units=HIDDEN), gluon.nn.Dense(CLASSES, in_units=1))
    net.initialize(mx.init.Xavier())
    mx.random.seed(7)
    for p in net.collect_params().values():
        p.set_data(mx.nd.random.normal(0, 0.5, p.shape))
    net.cast(dtype)
    return net


def forward_backward(net, step, share, dtype):
    x = mx.nd.array(X[step, share], dtype=dtype)
    y = mx.nd.array(Y[step, share], dtype=dtype)
    with autograd.record():
        loss = loss_fn(net(x), y)
    loss.backward()
    return x.shape[0]


def weights(net):
    return [p.data().astype("float32").asnumpy() for p in net.collect_params().values()]


def check(case, got, want, rtol=1e-4, atol=1e-5):
    for i, (g, w) in enumerate(zip(got, want)):
        if not np.allclose(g, w, rtol=rtol, atol=atol):
            raise AssertionError(f"{case}: parameter {i} differs from one process by "
                                 f"{np.abs(g - w).max()}")
    print(f"ok {case}", flush=True)


def pair(opt, params, dtype="float32", **kw):
    """(sharded net, its trainer, reference net, its gluon.Trainer)."""
    net, ref = make_net(dtype), make_net(dtype)
    trainer = dg.DistributedTrainer(net.collect_params(), opt, dict(params),
                                    shard_optimizer_states=True, **kw)
    reference = gluon.Trainer(ref.collect_params(), opt, dict(params), kvstore=None)
    return net, trainer, ref, reference


def run_steps(net, trainer, ref, reference, steps, dtype="float32", clip=None):
    mine = slice(lo[rank], lo[rank + 1])
    for step in steps:
        n = forward_backward(net, step, mine, dtype)
        total = forward_backward(ref, step, slice(0, GLOBAL), dtype)
        if clip is None:
            trainer.step(n)
            reference.step(total)
        else:
            trainer.allreduce_grads()
            # every rank holds the whole sums: gluon's clipping works as unsharded
            norm = gluon.utils.clip_global_norm(
                [p.grad() for p in net.collect_params().values()], clip)
            trainer.update(n)
            want = gluon.utils.clip_global_norm(
                [p.grad() for p in ref.collect_params().values()], clip)
            assert abs(norm - want) <= 1e-4 * want, (norm, want)
            reference.update(total)


SCHEDULE = mx.lr_scheduler.FactorScheduler(step=2, factor=0.5, base_lr=0.05)
CASES = {
    "sgd": ("sgd", {"learning_rate": 0.1}),
    "momentum": ("sgd", {"learning_rate": 0.1, "momentum": 0.9, "wd": 1e-3}),
    "nag": ("nag", {"learning_rate": 0.1, "momentum": 0.9}),
    "adam": ("adam", {"learning_rate": 0.01, "wd": 1e-3, "clip_gradient": 0.5}),
    "rmsprop": ("rmsprop", {"learning_rate": 0.01, "centered": True}),
    "adam_schedule": ("adam", {"learning_rate": 0.05, "lr_scheduler": SCHEDULE}),
    # the trust ratio of each whole tensor, from the norms of every rank's rows
    "lamb": ("lamb", {"learning_rate": 0.02, "wd": 1e-2, "lower_bound": 1e-3,
                      "upper_bound": 10.0}),
}

for case, (opt, params) in CASES.items():
    net, trainer, ref, reference = pair(opt, params)
    assert trainer.shard_optimizer_states
    run_steps(net, trainer, ref, reference, range(STEPS))
    # every rank counts every tensor's updates, also those it holds no rows of
    assert trainer._optimizer._index_update_count == \
        reference._optimizer._index_update_count, case
    check(case, weights(net), weights(ref))
    if case == "adam" and N > 1:
        # each rank holds the states of its part only
        # about 1/N of the elements: at most one row more of each tensor's two states
        held = sum(s.size for state in trainer._updaters[0].states.values() for s in state)
        whole = sum(s.size for state in reference._updaters[0].states.values() for s in state)
        rows = sum(2 * p.data().size // p.shape[0] for p in net.collect_params().values())
        assert held <= whole / N + rows, (held, whole, rows)
        print(f"ok {case}_states_part {held} of {whole}", flush=True)

# allreduce_grads(), clip_global_norm() over every rank's parts, update()
net, trainer, ref, reference = pair("sgd", {"learning_rate": 0.1, "momentum": 0.9})
run_steps(net, trainer, ref, reference, range(STEPS), clip=0.3)
check("clip_global_norm", weights(net), weights(ref))

# multi_precision: float16 weights, float32 master copies in the parts' states (CPU has
# no float16 Dense: the gradients are given, each rank's own, the reference their sum)
def fp16_params():
    params = gluon.ParameterDict("mp_")
    for name, shape in (("w", (5, 7)), ("b", (2,))):
        p = params.get(name, shape=shape, dtype="float16")
        p.initialize(mx.init.Constant(0.5))
    return params


mine_params, ref_params = fp16_params(), fp16_params()
trainer = dg.DistributedTrainer(mine_params, "sgd", {"learning_rate": 0.1, "momentum": 0.9,
                                                      "multi_precision": True},
                                shard_optimizer_states=True)
reference = gluon.Trainer(ref_params, "sgd", {"learning_rate": 0.1, "momentum": 0.9,
                                              "multi_precision": True}, kvstore=None)
for step in range(STEPS):
    for p, q in zip(mine_params.values(), ref_params.values()):
        each = [np.random.RandomState(100 * step + r).randn(*p.shape) for r in range(N)]
        p.grad()[:] = mx.nd.array(each[rank], dtype="float16")
        q.grad()[:] = mx.nd.array(sum(each), dtype="float16")
        p.data()._fresh_grad = q.data()._fresh_grad = True
    trainer.step(1)
    reference.step(N)
check("multi_precision", [p.data().astype("float32").asnumpy() for p in mine_params.values()],
      [p.data().astype("float32").asnumpy() for p in ref_params.values()], rtol=1e-2, atol=2e-3)
if N > 1:
    masters = [state[0] for state in trainer._updaters[0].states.values()]
    assert all(m.dtype == np.float32 for m in masters), [m.dtype for m in masters]

# save_states writes the whole states in gluon.Trainer's layout: gluon.Trainer loads
# them and continues as the reference does; a sharded trainer loads them back
net, trainer, ref, reference = pair("adam", {"learning_rate": 0.01})
run_steps(net, trainer, ref, reference, range(2))
path = os.path.join(out_dir, "sharded.states")
trainer.save_states(path)
with open(path, "rb") as f:
    saved, saved_opt = pickle.loads(f.read())
want = reference._updaters[0].states
assert sorted(saved) == sorted(want), (sorted(saved), sorted(want))
for index in want:
    for got_leaf, want_leaf in zip(saved[index], want[index]):
        assert got_leaf.shape == want_leaf.shape
        assert np.allclose(got_leaf.asnumpy(), want_leaf.asnumpy(), rtol=1e-4, atol=1e-6)
assert saved_opt._index_update_count == reference._optimizer._index_update_count
print("ok save_states_whole", flush=True)
plain = make_net()
for p, q in zip(plain.collect_params().values(), net.collect_params().values()):
    p.set_data(q.data())
loaded = gluon.Trainer(plain.collect_params(), "adam", {"learning_rate": 0.01}, kvstore=None)
loaded.load_states(path)
resumed = make_net()
for p, q in zip(resumed.collect_params().values(), net.collect_params().values()):
    p.set_data(q.data())
again = dg.DistributedTrainer(resumed.collect_params(), "adam", {"learning_rate": 0.01},
                              shard_optimizer_states=True)
again.load_states(path)
mine = slice(lo[rank], lo[rank + 1])
for step in (2, 3):
    n = forward_backward(resumed, step, mine, "float32")
    again.step(n)
    total = forward_backward(plain, step, slice(0, GLOBAL), "float32")
    loaded.step(total)
    forward_backward(ref, step, slice(0, GLOBAL), "float32")
    reference.step(total)
check("load_states_into_gluon", weights(plain), weights(ref))
check("load_states_sharded", weights(resumed), weights(ref))
# a file of gluon.Trainer's loads into a sharded trainer with another world size's parts
path = os.path.join(out_dir, "gluon.states")
if rank == 0:
    reference.save_states(path)
kv.barrier()
again.load_states(path)
for step in (4, 5):
    n = forward_backward(resumed, step, mine, "float32")
    again.step(n)
    total = forward_backward(ref, step, slice(0, GLOBAL), "float32")
    reference.step(total)
check("gluon_states_into_sharded", weights(resumed), weights(ref))

# Checkpointer saves the whole states and restores each rank's part
ckpt = dg.Checkpointer(os.path.join(out_dir, "ckpt"))
ckpt.save(resumed, again, epoch=0, step=6)
restored = make_net()
third = dg.DistributedTrainer(restored.collect_params(), "adam", {"learning_rate": 0.01},
                              shard_optimizer_states=True)
ckpt.restore(restored, third)
check("checkpoint_restore_weights", weights(restored), weights(ref))
for step in (0, 1):
    n = forward_backward(restored, step, mine, "float32")
    third.step(n)
    total = forward_backward(ref, step, slice(0, GLOBAL), "float32")
    reference.step(total)
check("checkpoint_restore_continues", weights(restored), weights(ref))


# compression (residuals per worker) and stale gradients: sharded as unsharded
class TwoHeads(gluon.HybridBlock):
    def __init__(self):
        super().__init__()
        self.body = gluon.nn.Dense(HIDDEN, in_units=FEATURES, activation="relu")
        self.head_a = gluon.nn.Dense(CLASSES, in_units=HIDDEN)
        self.head_b = gluon.nn.Dense(CLASSES, in_units=HIDDEN)

    def hybrid_forward(self, F, x, use_b=False):
        h = self.body(x)
        return self.head_b(h) if use_b else self.head_a(h)


def twin(case, opt, params, stale=False, tolerance=1e-5, **kw):
    # head_b is never reached without stale: every rank skips it alike
    nets = []
    for shard in (True, False):
        net = TwoHeads()
        net.initialize(mx.init.Xavier())
        mx.random.seed(11)
        for p in net.collect_params().values():
            p.set_data(mx.nd.random.normal(0, 0.5, p.shape))
        trainer = dg.DistributedTrainer(net.collect_params(), opt, dict(params),
                                        shard_optimizer_states=shard, **kw)
        for step in range(STEPS):
            x = mx.nd.array(X[step, mine])
            y = mx.nd.array(Y[step, mine])
            # stale: head_b is reached on rank 0 only, on odd steps
            use_b = stale and step % 2 == 1 and rank == 0
            with autograd.record():
                loss = loss_fn(net(x, use_b), y)
            loss.backward()
            trainer.step(x.shape[0], ignore_stale_grad=True)
        nets.append(net)
    check(case, weights(nets[0]), weights(nets[1]), rtol=tolerance, atol=tolerance / 10)


twin("compression_2bit", "adam", {"learning_rate": 0.01},
     compression={"type": "2bit", "threshold": 0.01})
# float16 sums round in the order horovod's ring adds them, which its fusion changes
twin("compression_fp16", "sgd", {"learning_rate": 0.1, "momentum": 0.9}, compression="fp16",
     tolerance=1e-3)
twin("stale_gradients", "adam", {"learning_rate": 0.01}, stale=True)

# a hybridized convolutional model whose weights an inference forward leaves in
# MKLDNN's layout between steps: sharded as unsharded
def conv_run(shard):
    net = gluon.nn.HybridSequential()
    net.add(gluon.nn.Conv2D(8, 3, in_channels=3, activation="relu"),
            gluon.nn.Conv2D(5, 3, in_channels=8), gluon.nn.GlobalAvgPool2D(), gluon.nn.Flatten())
    net.initialize(mx.init.Xavier())
    mx.random.seed(13)
    for p in net.collect_params().values():
        p.set_data(mx.nd.random.normal(0, 0.3, p.shape))
    net.hybridize(static_alloc=True, static_shape=True)
    trainer = dg.DistributedTrainer(net.collect_params(), "adam", {"learning_rate": 0.01},
                                    shard_optimizer_states=shard)
    images = np.random.RandomState(rank).rand(STEPS, 2, 3, 8, 8).astype("float32")
    for step in range(STEPS):
        x = mx.nd.array(images[step])
        with autograd.record():
            loss = loss_fn(net(x), mx.nd.array([0, 1]))
        loss.backward()
        trainer.step(2)
        net(x).wait_to_read()          # inference: weights may be reordered in place
    return weights(net)


check("hybridized_conv_after_inference", conv_run(True), conv_run(False), rtol=1e-5,
      atol=1e-6)

# deferred initialisation: shapes, rows and rank 0's weights come with the first forward
def deferred(shard):
    mx.random.seed(100 + rank)                  # every rank initialises differently
    net = gluon.nn.HybridSequential()
    net.add(gluon.nn.Dense(HIDDEN, activation="relu"), gluon.nn.Dense(CLASSES))
    net.initialize(mx.init.Xavier())
    net.hybridize()
    trainer = dg.DistributedTrainer(net.collect_params(), "adam", {"learning_rate": 0.01},
                                    shard_optimizer_states=shard)
    for step in range(STEPS):
        forward_backward(net, step, mine, "float32")
        trainer.step(lo[rank + 1] - lo[rank])
    return weights(net)


check("deferred_init", deferred(True), deferred(False), rtol=1e-5, atol=1e-6)


# two devices per worker (CPU contexts standing in for GPUs): the worker sums its
# devices, updates its rows on the first and copies the whole weights to both
def two_devices(shard):
    contexts = [mx.cpu(0), mx.cpu(1)]
    net = make_net()
    net.collect_params().reset_ctx(contexts)
    trainer = dg.DistributedTrainer(net.collect_params(), "adam", {"learning_rate": 0.01},
                                    shard_optimizer_states=shard)
    for step in range(STEPS):
        xs = gluon.utils.split_and_load(mx.nd.array(X[step, mine]), contexts,
                                        even_split=False)
        ys = gluon.utils.split_and_load(mx.nd.array(Y[step, mine]), contexts,
                                        even_split=False)
        with autograd.record():
            losses = [loss_fn(net(x), y) for x, y in zip(xs, ys)]
        autograd.backward(losses)
        trainer.step(lo[rank + 1] - lo[rank])
    for p in net.collect_params().values():
        copies = [d.asnumpy() for d in p.list_data()]
        assert all(np.array_equal(copies[0], c) for c in copies[1:]), p.name
    return weights(net)


check("two_devices", two_devices(True), two_devices(False), rtol=1e-5, atol=1e-6)

# refused combinations name both features
try:
    dg.elastic.State(net=resumed, trainer=again)
except ValueError as err:
    assert "shard_optimizer_states" in str(err) and "State" in str(err), err
    print("ok refuses_elastic_state", flush=True)
else:
    raise AssertionError("dg.elastic.State accepted a sharded trainer")
try:
    dg.DistributedTrainer(make_net().collect_params(), "sgd", {"learning_rate": 0.1},
                          shard_optimizer_states=True, sync_every=4)
except ValueError as err:
    assert "shard_optimizer_states" in str(err) and "sync_every" in str(err), err
    print("ok refuses_local_sgd", flush=True)
else:
    raise AssertionError("sync_every was accepted with shard_optimizer_states=True")

# the backend's reducescatter and allgather split along the first axis (rows)
from dist_gluon.backends.base import shard_bounds, shard_counts  # noqa: E402

rows = 2 * N + 1                    # uneven: the first rank gets one row more
value = mx.nd.arange(rows * 3).reshape((rows, 3)) * (rank + 1)
part = kv.reducescatter("rs", value.copy())[0]
start, stop = shard_bounds(rows, N, rank)
want = np.arange(rows * 3).reshape((rows, 3))[start:stop] * (N * (N + 1) // 2)
assert np.array_equal(part.asnumpy(), want), (part.asnumpy(), want)
counts = shard_counts(1, N, first=N - 1)          # one row, held by the last rank
own = mx.nd.ones((counts[rank], 3)) * 7 if counts[rank] else mx.nd.empty((0, 3))
whole = kv.allgather(["ag", "ag2"], [own, part],
                     [counts, shard_counts(rows, N)])
assert whole[0].shape == (1, 3) and whole[0].asnumpy().tolist() == [[7, 7, 7]], whole[0]
assert np.array_equal(whole[1].asnumpy(),
                      np.arange(rows * 3).reshape((rows, 3)) * (N * (N + 1) // 2))
into = mx.nd.ones((rows, 3)) * -1                 # overwritten entirely
returned = kv.allgather("ag3", part, shard_counts(rows, N), out=into)
assert returned[0] is into
assert np.array_equal(into.asnumpy(), np.arange(rows * 3).reshape((rows, 3))
                      * (N * (N + 1) // 2))
print("ok backend_reducescatter_allgather", flush=True)

# optimizers that need whole tensors are refused at construction, named
for opt in ("lars", "lbsgd"):
    try:
        dg.DistributedTrainer(make_net().collect_params(), opt, {"learning_rate": 0.1},
                              shard_optimizer_states=True)
    except ValueError as err:
        assert opt.upper() in str(err), err
        print(f"ok refuses_{opt}", flush=True)
    else:
        raise AssertionError(f"{opt} was accepted with shard_optimizer_states=True")


# AMP (last: amp.init() patches MXNet's operators for the rest of the process): the
# loss scaler sees the whole summed gradients, so an overflow on one rank skips the
# step on every rank, sharded as unsharded
from mxnet.contrib import amp  # noqa: E402

amp.init(target_dtype="bfloat16")


def amp_run(shard):
    net = make_net()
    trainer = dg.DistributedTrainer(net.collect_params(), "adam", {"learning_rate": 0.01},
                                    shard_optimizer_states=shard)
    amp.init_trainer(trainer)
    for step in range(STEPS):
        x = X[step, mine].copy()
        if step == 1 and rank == N - 1:
            x[0, 0] = np.inf                    # this rank's gradients overflow
        with autograd.record():
            loss = loss_fn(net(mx.nd.array(x)), mx.nd.array(Y[step, mine]))
            with amp.scale_loss(loss, trainer) as scaled:
                autograd.backward(scaled)
        trainer.step(x.shape[0])
    return weights(net), trainer._amp_loss_scaler.loss_scale


sharded, scale = amp_run(True)
unsharded, unsharded_scale = amp_run(False)
assert scale == unsharded_scale < 2.0 ** 16, (scale, unsharded_scale)    # one skip
assert all(np.isfinite(w).all() for w in sharded)
check("amp", sharded, unsharded, rtol=1e-5, atol=1e-6)
