"""SyncBatchNorm over several devices per worker (tests/test_syncbn_devices.py).

    syncbn_devices.py OUT DEVICES NORM

N workers of DEVICES CPU contexts each (``mx.cpu(i)`` stand in for GPUs), or one
process, train a small convolutional network with NORM ('sync': dg.SyncBatchNorm,
'plain': nn.BatchNorm) for 3 steps on a fixed global batch of 8 samples split evenly
over every device of every worker, and write rank r's final parameters (running
statistics included; device 0's copy, after checking under SyncBatchNorm that the
devices hold the same values) to OUT/<NORM>_d<DEVICES>_rank<r>.npz. With NORM 'misuse'
one process runs a training forward twice on cpu(0) before cpu(1) and prints the
error. CPU contexts need MXNET_CPU_TEMP_COPY=1024 or more (see dist_gluon/syncbn.py).
"""
import os
import sys

import mxnet as mx
import numpy as np
from mxnet import autograd, gluon

import dist_gluon as dg

OUT, DEVICES, NORM = sys.argv[1], int(sys.argv[2]), sys.argv[3]
assert NORM in ("sync", "plain", "misuse"), NORM
GLOBAL_BATCH = 8


def misuse():
    contexts = [mx.cpu(0), mx.cpu(1)]
    bn = dg.SyncBatchNorm(in_channels=2)
    bn.initialize(ctx=contexts)
    x = [mx.nd.ones((2, 2, 3, 3), ctx=c) for c in contexts]
    with autograd.record():
        bn(x[0])
        try:
            bn(x[0])
        except RuntimeError as e:
            print(f"refused: {e}")
        bn(x[1])        # device 1's turn lets device 0's first forward finish
    mx.nd.waitall()
    print("finished")


def main():
    if NORM == "misuse":
        misuse()
        return
    kv = dg.create()
    contexts = [mx.cpu(i) for i in range(DEVICES)]
    norm = dg.SyncBatchNorm if NORM == "sync" else gluon.nn.BatchNorm
    net = gluon.nn.HybridSequential()
    with net.name_scope():
        net.add(gluon.nn.Conv2D(4, 3, in_channels=2), norm(in_channels=4),
                gluon.nn.Activation("relu"), gluon.nn.Conv2D(3, 3, in_channels=4),
                norm(in_channels=3, momentum=0.8), gluon.nn.Flatten(),
                gluon.nn.Dense(3, in_units=3 * 2 * 2))
    mx.random.seed(7)
    net.initialize(mx.init.Xavier(), ctx=contexts)
    # non-trivial gamma and beta
    for name, p in net.collect_params().items():
        if name.endswith(("gamma", "beta")):
            rng = np.random.RandomState(len(name))
            p.set_data(mx.nd.array(rng.uniform(0.5, 1.5, p.shape)))
    trainer = dg.DistributedTrainer(net.collect_params(), "sgd",
                                    {"learning_rate": 0.1, "momentum": 0.9}, kv=kv)
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    share = GLOBAL_BATCH // kv.num_workers
    for step in range(3):
        rng = np.random.RandomState(step)
        # per-channel offsets and scales far from 0 and 1, as real activations have
        x = (rng.randn(GLOBAL_BATCH, 2, 6, 6) * [[[[3.0]], [[0.5]]]] + 2.0).astype("float32")
        y = rng.randint(0, 3, GLOBAL_BATCH).astype("float32")
        mine = slice(kv.rank * share, (kv.rank + 1) * share)
        xs = gluon.utils.split_and_load(x[mine], contexts)
        ys = gluon.utils.split_and_load(y[mine], contexts)
        with autograd.record():
            losses = [loss_fn(net(a), b) for a, b in zip(xs, ys)]
        autograd.backward(losses)
        trainer.step(share)
    values = {}
    for name, p in net.collect_params().items():
        copies = [d.asnumpy() for d in p.list_data()]
        assert NORM == "plain" or all(np.array_equal(copies[0], c) for c in copies[1:]), \
            f"{name}: the devices hold different values"
        values[name.split("_", 1)[1]] = copies[0]
    np.savez(os.path.join(OUT, f"{NORM}_d{DEVICES}_rank{kv.rank}.npz"), **values)
    print(f"rank {kv.rank}: done")


if __name__ == "__main__":
    main()
