"""Worker script of tests/test_compression.py.

    python compression_cases.py OUT_DIR dg        # DistributedTrainer with every codec,
                                                  # then the copies MXNet <-> NumPy per step
    python compression_cases.py OUT_DIR mxnet     # MXNet's own dist_sync kvstore, 2-bit
    python compression_cases.py OUT_DIR reference # 2-bit in NumPy, uneven batches

Both modes train the same two-layer network from the same initial weights on the same
data (each worker its own half of every global batch) with plain SGD, and save every
rank's final weights; ``dg`` also counts the bytes each codec puts on the wire and checks
that a compressed run resumed from a checkpoint equals the uninterrupted one.
"""
import json
import os
import sys

import mxnet as mx
import numpy as np
from mxnet import autograd, gluon

out_dir, mode = sys.argv[1], sys.argv[2]
os.makedirs(out_dir, exist_ok=True)
B, STEPS, FEATURES, CLASSES, LR, THRESHOLD = 8, 6, 10, 4, 0.1, 0.05
rng = np.random.RandomState(0)
X = rng.randn(STEPS, 2 * B, FEATURES).astype("float32")
Y = rng.randint(0, CLASSES, (STEPS, 2 * B)).astype("float32")
INIT = [rng.randn(8, FEATURES) * 0.3, rng.randn(8) * 0.1, rng.randn(CLASSES, 8) * 0.3,
        rng.randn(CLASSES) * 0.1]
loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()


def make_net():
    net = gluon.nn.HybridSequential()
    net.add(gluon.nn.Dense(8, activation="relu", in_units=FEATURES),
            gluon.nn.Dense(CLASSES, in_units=8))
    net.initialize()
    for p, value in zip(net.collect_params().values(), INIT):
        p.set_data(mx.nd.array(value))
    return net


def train(net, trainer, rank, workers, steps):
    share = 2 * B // workers
    for step in steps:
        x = mx.nd.array(X[step, rank * share:(rank + 1) * share])
        y = mx.nd.array(Y[step, rank * share:(rank + 1) * share])
        with autograd.record():
            loss = loss_fn(net(x), y)
        loss.backward()
        trainer.step(x.shape[0])


def save(name, net, rank):
    arrays = {str(i): p.data().asnumpy() for i, p in enumerate(net.collect_params().values())}
    np.savez(os.path.join(out_dir, f"{name}_rank{rank}.npz"), **arrays)


if mode == "mxnet":
    # MXNet's own 2-bit compression works with push and pull (its pushpull refuses it)
    kv = mx.kv.create("dist_sync")
    kv.set_gradient_compression({"type": "2bit", "threshold": THRESHOLD})
    net = make_net()
    params = list(net.collect_params().values())
    for i, p in enumerate(params):
        kv.init(i, mx.nd.zeros(p.shape))
    share = 2 * B // kv.num_workers
    for step in range(STEPS):
        lo = kv.rank * share
        x, y = mx.nd.array(X[step, lo:lo + share]), mx.nd.array(Y[step, lo:lo + share])
        with autograd.record():
            loss = loss_fn(net(x), y)
        loss.backward()
        for i, p in enumerate(params):
            kv.push(i, p.grad(), priority=-i)
            kv.pull(i, out=p.grad(), priority=-i)
        for p in params:
            mx.nd.sgd_update(p.data(), p.grad(), lr=LR, wd=0.0, rescale_grad=1.0 / (2 * B),
                             out=p.data())
    save("mxnet_2bit", net, kv.rank)
    sys.exit(0)

UNEVEN = (5, 11)       # samples of rank 0 and rank 1 in every step of the uneven case


def uneven_batch(step, rank):
    lo = 0 if rank == 0 else UNEVEN[0]
    hi = lo + UNEVEN[rank]
    return mx.nd.array(X[step, lo:hi]), mx.nd.array(Y[step, lo:hi])


if mode == "reference":
    # MXNet's 2-bit written out in NumPy for 2 workers of uneven batches, in one process:
    # each worker's raw gradient plus its residual, quantised to +-t or 0, the residual
    # keeping the rest; the sum of the sent values divided by the summed batch sizes
    net = make_net()
    params = list(net.collect_params().values())
    residuals = [[np.zeros(p.shape, np.float32) for p in params] for _ in UNEVEN]
    t = np.float32(THRESHOLD)
    for step in range(STEPS):
        total = [np.zeros(p.shape, np.float32) for p in params]
        for worker in range(2):
            x, y = uneven_batch(step, worker)
            with autograd.record():
                loss = loss_fn(net(x), y)
            loss.backward()
            for i, p in enumerate(params):
                r = residuals[worker][i]
                r += p.grad().asnumpy()
                codes = (r >= t).astype(np.float32) - (r <= -t).astype(np.float32)
                r -= codes * t
                total[i] += codes * t
        for p, g in zip(params, total):
            mx.nd.sgd_update(p.data(), mx.nd.array(g), lr=LR, wd=0.0,
                             rescale_grad=1.0 / sum(UNEVEN), out=p.data())
    save("numpy_2bit_uneven", net, 0)
    sys.exit(0)

import dist_gluon as dg  # noqa: E402

kv = dg.create()
rank, workers = kv.rank, kv.num_workers

CODECS = {
    "none": None,
    "fp16": "fp16",
    "2bit": {"type": "2bit", "threshold": THRESHOLD},
    "powersgd1": {"type": "powersgd", "rank": 1},
    # rank min(n, m) = n for both weights (8x10, 4x8): the approximation is exact
    "powersgd_full": {"type": "powersgd", "rank": 8, "min_compression_rate": 0},
}


def count_host_copies():
    """Copies MXNet <-> NumPy per steady step of every codec, into
    host_copies_rank<r>.json (run last: it draws from ``rng``)."""
    # a hybridized conv net (conv kernels and dense matrices for PowerSGD, vectors that
    # ride along), 2 warm-up steps, then 3 steady steps counted, for every codec; 2-bit
    # also on its stock-operator path (the fallback where the fused kernels cannot load)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from host_copies import HostCopies

    from dist_gluon.compression import twobit

    def conv_net():
        net = gluon.nn.HybridSequential()
        net.add(gluon.nn.Conv2D(8, 3, in_channels=3, activation="relu"),
                gluon.nn.BatchNorm(in_channels=8), gluon.nn.Flatten(),
                gluon.nn.Dense(32, activation="relu", in_units=8 * 6 * 6),
                gluon.nn.Dense(CLASSES, in_units=32))
        net.initialize(mx.init.Xavier(rnd_type="gaussian"))
        net.hybridize()
        return net

    images = mx.nd.random.normal(shape=(4, 3, 8, 8))
    labels = mx.nd.array(rng.randint(0, CLASSES, 4))
    counts = {}
    for case, compression in [("fp16", "fp16"), ("2bit", CODECS["2bit"]),
                              ("2bit-operators", CODECS["2bit"]),
                              ("powersgd", {"type": "powersgd", "rank": 2})]:
        mx.random.seed(rank)
        net = conv_net()
        trainer = dg.DistributedTrainer(net.collect_params(), "sgd", {"learning_rate": LR},
                                        compression=compression, prefix=f"copies.{case}")
        fused = twobit.Packing.fused
        if case == "2bit-operators":
            twobit.Packing.fused = lambda self, grad: False
        try:
            for step in range(5):
                if step == 2:
                    mx.nd.waitall()
                    copies = HostCopies().__enter__()
                with autograd.record():
                    loss = loss_fn(net(images), labels)
                loss.backward()
                trainer.step(images.shape[0])
            mx.nd.waitall()
            copies.__exit__(None, None, None)
        finally:
            twobit.Packing.fused = fused
        counts[case] = {"count": copies.count, "summary": copies.summary()}
    with open(os.path.join(out_dir, f"host_copies_rank{rank}.json"), "w") as f:
        json.dump(counts, f)
wire = {}
original_pushpull = kv.pushpull


def counting_pushpull(key, value, out=None, priority=0):
    for k, v in zip(key if isinstance(key, list) else [key],
                    value if isinstance(value, list) else [value]):
        if not str(k).endswith(".batch"):
            wire[current] = wire.get(current, 0) + v.size * v.dtype(0).itemsize
    return original_pushpull(key, value, out=out, priority=priority)


kv.pushpull = counting_pushpull
for name, compression in CODECS.items():
    current = name
    net = make_net()
    trainer = dg.DistributedTrainer(net.collect_params(), "sgd", {"learning_rate": LR},
                                    compression=compression, prefix=name)
    train(net, trainer, rank, workers, range(STEPS))
    save(name, net, rank)
kv.pushpull = original_pushpull

# the RFC's low-level API: a plain gluon.Trainer on the backend object, with MXNet's
# compression_params (gluon calls kv.set_gradient_compression with them)
net = make_net()
trainer = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": LR}, kvstore=kv,
                        compression_params={"type": "2bit", "threshold": THRESHOLD},
                        update_on_kvstore=False)
share = 2 * B // workers
for step in range(STEPS):
    x = mx.nd.array(X[step, rank * share:(rank + 1) * share])
    y = mx.nd.array(Y[step, rank * share:(rank + 1) * share])
    with autograd.record():
        loss = loss_fn(net(x), y)
    loss.backward()
    trainer.step(2 * B)              # gluon rescales by 1/batch: the global batch
save("rfc_2bit", net, rank)
kv.set_gradient_compression(None)
if rank == 0:
    with open(os.path.join(out_dir, "wire.json"), "w") as f:
        json.dump({k: v / STEPS for k, v in wire.items()}, f)



def module_run(name, compression):
    """The same network and data through the Module API and DistributedOptimizer."""
    data = mx.sym.Variable("data")
    sym = mx.sym.FullyConnected(data, num_hidden=8, name="fc1")
    sym = mx.sym.Activation(sym, act_type="relu")
    sym = mx.sym.FullyConnected(sym, num_hidden=CLASSES, name="fc2")
    sym = mx.sym.SoftmaxOutput(sym, name="softmax")
    share = 2 * B // workers
    mod = mx.mod.Module(sym, context=mx.cpu())
    mod.bind(data_shapes=[("data", (share, FEATURES))],
             label_shapes=[("softmax_label", (share,))])
    names = ["fc1_weight", "fc1_bias", "fc2_weight", "fc2_bias"]
    mod.init_params(arg_params={n: mx.nd.array(v) for n, v in zip(names, INIT)})
    opt = dg.DistributedOptimizer("sgd", compression=compression, prefix=f"module.{name}",
                                  learning_rate=LR)
    mod.init_optimizer(kvstore=None, optimizer=opt)
    for step in range(STEPS):
        lo = rank * share
        mod.forward_backward(mx.io.DataBatch([mx.nd.array(X[step, lo:lo + share])],
                                             [mx.nd.array(Y[step, lo:lo + share])]))
        mod.update()
    arg_params, _ = mod.get_params()
    np.savez(os.path.join(out_dir, f"module_{name}_rank{rank}.npz"),
             **{str(i): arg_params[n].asnumpy() for i, n in enumerate(names)})


for name in ("none", "2bit", "powersgd_full"):
    module_run(name, CODECS[name])

# 2-bit with batch sizes that differ between the ranks (on 2 workers only)
if workers == 2:
    net = make_net()
    trainer = dg.DistributedTrainer(net.collect_params(), "sgd", {"learning_rate": LR},
                                    compression=CODECS["2bit"], prefix="2bit.uneven")
    for step in range(STEPS):
        x, y = uneven_batch(step, rank)
        with autograd.record():
            loss = loss_fn(net(x), y)
        loss.backward()
        trainer.step(x.shape[0])
    save("2bit_uneven", net, rank)

# resume: 3 steps, checkpoint, 3 steps == 3 steps, restore into a new trainer, 3 steps
for name in ("2bit", "powersgd1"):
    net = make_net()
    trainer = dg.DistributedTrainer(net.collect_params(), "sgd", {"learning_rate": LR},
                                    compression=CODECS[name], prefix=f"{name}.whole")
    ckpt = dg.Checkpointer(os.path.join(out_dir, f"ckpt_{name}"))
    train(net, trainer, rank, workers, range(3))
    ckpt.save(net, trainer, epoch=0, step=3)
    train(net, trainer, rank, workers, range(3, STEPS))
    save(f"{name}_whole", net, rank)
    net = make_net()
    trainer = dg.DistributedTrainer(net.collect_params(), "sgd", {"learning_rate": LR},
                                    compression=CODECS[name], prefix=f"{name}.resumed")
    state = ckpt.restore(net, trainer)
    assert state["step"] == 3, state
    train(net, trainer, rank, workers, range(3, STEPS))
    save(f"{name}_resumed", net, rank)
count_host_copies()
print("compression cases done", flush=True)
