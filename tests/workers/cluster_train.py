"""Worker script of tests/test_multinode.py: a small MLP (deferred initialisation,
per-rank seeds) trained by DistributedTrainer with SGD and momentum, then Adam, for a few
steps; every rank saves its parameters.

    python cluster_train.py OUT_DIR WORLD

Run as one plain process it is the reference: it trains on the concatenation of the
WORLD workers' batches.
"""
import os
import sys

import mxnet as mx
import numpy as np
from mxnet import autograd, gluon

import dist_gluon as dg

out_dir, world = sys.argv[1], int(sys.argv[2])
os.makedirs(out_dir, exist_ok=True)
kv = dg.create()
N, rank = kv.num_workers, kv.rank
B, STEPS, FEATURES, CLASSES = 4, 4, 12, 5
rng = np.random.RandomState(0)
X = rng.randn(STEPS, world * B, FEATURES).astype("float32")
Y = rng.randint(0, CLASSES, (STEPS, world * B)).astype("float32")
loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()

for name, optimizer, params in (("sgd", "sgd", {"learning_rate": 0.1, "momentum": 0.9}),
                                ("adam", "adam", {"learning_rate": 0.01})):
    mx.random.seed(1000 + rank)                 # rank 0's weights must win
    net = gluon.nn.HybridSequential()
    net.add(gluon.nn.Dense(16, activation="relu"), gluon.nn.Dense(CLASSES))
    net.initialize(mx.init.Xavier())
    trainer = dg.DistributedTrainer(net.collect_params(), optimizer, params, prefix=name)
    share = world * B // N
    for step in range(STEPS):
        x = mx.nd.array(X[step, rank * share:(rank + 1) * share])
        y = mx.nd.array(Y[step, rank * share:(rank + 1) * share])
        with autograd.record():
            loss = loss_fn(net(x), y)
        loss.backward()
        trainer.step(share)
    values = [p.data().asnumpy() for p in net.collect_params().values()]
    np.savez(os.path.join(out_dir, f"{name}_rank{rank}.npz"),
             **{str(i): v for i, v in enumerate(values)})
print(f"rank {rank} of {N} trained", flush=True)
