"""Worker script of tests/test_syncbn.py: trains small convolutional networks with
SyncBatchNorm through DistributedTrainer and saves every rank's parameters and running
statistics.

    python syncbn_cases.py OUT_DIR

Run as one plain process it is the reference: the same networks with gluon.nn.BatchNorm
on the concatenation of the 2 workers' batches (and, to check that one process gets
exactly BatchNorm, with SyncBatchNorm too).
"""
import json
import os
import sys

import mxnet as mx
import numpy as np
from mxnet import autograd, gluon

import dist_gluon as dg
from dist_gluon import syncbn

out_dir = sys.argv[1]
os.makedirs(out_dir, exist_ok=True)
kv = dg.create()
N, rank = kv.num_workers, kv.rank
assert N in (1, 2), "written for 2 workers (and the 1-process reference)"
WORLD, B, STEPS, CLASSES = 2, 4, 5, 4
rng = np.random.RandomState(0)
# channels with a large mean next to their spread, as raw pixels have
X = (rng.randn(STEPS, WORLD * B, 3, 8, 8) * 2 + 5).astype("float32")
Y = rng.randint(0, CLASSES, (STEPS, WORLD * B)).astype("float32")
# of each step's 8 samples rank 0 takes the first UNEVEN[step], rank 1 the rest
UNEVEN = [5, 4, 2, 7, 1]
SGD = {"learning_rate": 0.1, "momentum": 0.9, "wd": 1e-4}
loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()


def even(step):
    lo, hi = rank * WORLD * B // N, (rank + 1) * WORLD * B // N
    return X[step, lo:hi], Y[step, lo:hi]


def uneven(step):
    lo, hi = 0, WORLD * B
    if N > 1:
        lo, hi = (0, UNEVEN[step]) if rank == 0 else (UNEVEN[step], WORLD * B)
    return X[step, lo:hi], Y[step, lo:hi]


def small_net(norm):
    # every rank starts from another random init (the trainer broadcasts rank 0's);
    # rank 1 also shifts MXNet's name counters, so its parameter names differ
    mx.random.seed(100 + rank)
    if rank == 1:
        gluon.nn.BatchNorm()
    net = gluon.nn.HybridSequential()
    net.add(gluon.nn.Conv2D(8, 3, padding=1), norm(), gluon.nn.Activation("relu"),
            gluon.nn.Conv2D(8, 3, strides=2, padding=1), norm(scale=False),
            gluon.nn.Activation("relu"), gluon.nn.Dense(16), norm(center=False),
            gluon.nn.Activation("relu"), gluon.nn.Dense(CLASSES))
    net.initialize(mx.init.Xavier())        # deferred: shapes come with the first forward
    return net


def save(case, net):
    arrays = {str(i): p.data().asnumpy() for i, p in enumerate(net.collect_params().values())}
    np.savez(os.path.join(out_dir, f"{case}_rank{rank}.npz"), **arrays)


# case -> the transports its SyncBatchNorm layers summed over
transports = {}


def _layers(block):
    if isinstance(block, dg.SyncBatchNorm):
        yield block
    for child in block._children.values():
        yield from _layers(child)


# case -> layer backwards run by SyncBatchNorm's compiled callback, per layer and step
compiled = {}


def train(case, net, batches, steps=STEPS):
    trainer = dg.DistributedTrainer(net.collect_params(), "sgd", SGD)
    calls = syncbn._compiled_backwards()
    for step in range(steps):
        x, y = (mx.nd.array(a, dtype=a.dtype) for a in batches(step))
        with autograd.record():
            loss = loss_fn(net(x), y)
        loss.backward()
        trainer.step(x.shape[0])
    save(case, net)
    layers = len(list(_layers(net)))
    if layers:
        compiled[case] = (syncbn._compiled_backwards() - calls) / (layers * steps)
    transports[case] = sorted({"side channel" if c.side is not None else "backend"
                               for layer in _layers(net) for c in layer._comms.values()})


def report(**values):
    with open(os.path.join(out_dir, f"report_rank{rank}.json"), "w") as f:
        json.dump(values, f)


norm = dg.SyncBatchNorm if N > 1 else gluon.nn.BatchNorm

# 1. equal batches, SyncBatchNorm layers built by the model (BatchNorm in the reference)
train("even", small_net(norm), even)

# 2. different batch sizes per rank in every step
train("uneven", small_net(norm), uneven)

# 3. a BatchNorm network that has run a forward (its parameters initialised) converted
#    in place; the reference keeps BatchNorm
net = small_net(gluon.nn.BatchNorm)
net(mx.nd.array(X[0, :2]))
if N > 1:
    dg.convert_sync_batchnorm(net)
train("converted", net, even)

# 4. gluoncv ResNet-18 (v1b) with norm_layer=SyncBatchNorm on 32x32 images, 2 per rank,
#    in float32 and in float64. With 4 samples per step its BatchNorm layers (down to
#    1x1 pixels) are so ill-conditioned that float32 rounding noise of 1e-7 in the input
#    moves the first output by 3e-5 and three SGD steps far apart (the reference alone
#    does that too); float64 shows that everything else is exact.
from gluoncv.model_zoo import resnet18_v1b  # noqa: E402

share = WORLD * 2 // N
for dtype in ("float32", "float64"):
    mx.random.seed(7 + rank)
    resnet = resnet18_v1b(classes=10, norm_layer=norm)
    resnet.initialize(mx.init.Xavier())
    resnet.cast(dtype)
    images = np.random.RandomState(1).randn(3, WORLD * 2, 3, 32, 32).astype(dtype)
    labels = np.random.RandomState(2).randint(0, 10, (3, WORLD * 2)).astype(dtype)
    train(f"resnet18_{dtype}", resnet,
          lambda step, x=images, y=labels: (x[step, rank * share:(rank + 1) * share],
                                            y[step, rank * share:(rank + 1) * share]),
          steps=3)

if N == 1:
    # 5. one process: SyncBatchNorm is BatchNorm, also hybridized
    train("sync_one_process", small_net(dg.SyncBatchNorm), even)
    for layer in (gluon.nn.BatchNorm, dg.SyncBatchNorm):
        hybrid = small_net(layer)
        hybrid.hybridize()
        train(f"hybrid_{layer.__name__}", hybrid, even)
    report()
else:
    # 6. several workers: hybridize() and converting a hybridized network refuse
    errors = []
    try:
        small_net(dg.SyncBatchNorm).hybridize()
    except RuntimeError as err:
        errors.append(str(err))
    hybrid = small_net(gluon.nn.BatchNorm)
    hybrid.hybridize()
    try:
        dg.convert_sync_batchnorm(hybrid)
    except RuntimeError as err:
        errors.append(str(err))
    report(errors=errors, transports=transports, compiled=compiled)
print("cases done", flush=True)
