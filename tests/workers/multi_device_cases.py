"""Several devices per worker (tests/test_trainer.py): N workers of D devices, or one
process, train on a fixed global batch of 8 samples split evenly over every device.

    multi_device_cases.py OUT DEVICES [CASE ...]

DEVICES is how many CPU contexts this process drives (``mx.cpu(0)``... stand in for
GPUs). Each case trains 3 steps from the same start and writes rank r's final weights
to OUT/<case>_d<DEVICES>_rank<r>.npz. Cases: sgd (momentum), adam, sparse (an Embedding
with sparse_grad and a Dense, lazy Adam), fp16, 2bit, powersgd (compression).
"""
import os
import sys

import mxnet as mx
import numpy as np
from mxnet import autograd, gluon

import dist_gluon as dg

OUT, DEVICES = sys.argv[1], int(sys.argv[2])
CASES = sys.argv[3:] or ["sgd", "adam", "sparse"]
GLOBAL_BATCH = 8


def model(case):
    net = gluon.nn.HybridSequential()
    with net.name_scope():
        if case == "sparse":
            net.add(gluon.nn.Embedding(20, 6, sparse_grad=True), gluon.nn.Flatten())
            net.add(gluon.nn.Dense(3, in_units=18))
        else:
            net.add(gluon.nn.Dense(16, in_units=10, activation="tanh"),
                    gluon.nn.Dense(12, in_units=16, activation="tanh"),
                    gluon.nn.Dense(3, in_units=12))
    return net


def data(step, case):
    rng = np.random.RandomState(step)
    if case == "sparse":
        x = rng.randint(0, 20, (GLOBAL_BATCH, 3)).astype("float32")
    else:
        x = rng.randn(GLOBAL_BATCH, 10).astype("float32")
    y = rng.randint(0, 3, GLOBAL_BATCH).astype("float32")
    return x, y


def run(case, kv):
    contexts = [mx.cpu(i) for i in range(DEVICES)]
    net = model(case)
    mx.random.seed(42)
    net.initialize(mx.init.Xavier(), ctx=contexts)
    optimizer, params = ("sgd", {"learning_rate": 0.1, "momentum": 0.9})
    if case in ("adam", "sparse"):
        optimizer, params = "adam", {"learning_rate": 0.01, "lazy_update": case == "sparse"}
    compression = {"fp16": "fp16", "2bit": {"type": "2bit", "threshold": 0.01},
                   "powersgd": {"type": "powersgd", "rank": 2}}.get(case)
    trainer = dg.DistributedTrainer(net.collect_params(), optimizer, params, kv=kv,
                                    compression=compression)
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    share = GLOBAL_BATCH // kv.num_workers
    for step in range(3):
        x, y = data(step, case)
        mine = slice(kv.rank * share, (kv.rank + 1) * share)
        xs = gluon.utils.split_and_load(x[mine], contexts)
        ys = gluon.utils.split_and_load(y[mine], contexts)
        with autograd.record():
            losses = [loss_fn(net(a), b) for a, b in zip(xs, ys)]
        autograd.backward(losses)
        trainer.step(share)
    values = {}
    for i, p in enumerate(net.collect_params().values()):
        copies = [d.asnumpy() for d in p.list_data()]
        assert all(np.array_equal(copies[0], c) for c in copies[1:]), \
            f"{p.name}: the devices hold different weights"
        values[str(i)] = copies[0]
    np.savez(os.path.join(OUT, f"{case}_d{DEVICES}_rank{kv.rank}.npz"), **values)


if __name__ == "__main__":
    backend = dg.create()
    for name in CASES:
        run(name, backend)
    print("done")
