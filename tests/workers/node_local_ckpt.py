"""Node-local checkpoints (tests/test_multinode.py): every node keeps its own copy in
OUT/node<DG_NODE_RANK> (its "local disk").

    node_local_ckpt.py OUT first    train 3 steps, save; 2 more, save; 2 more: the
                                    uninterrupted weights in OUT/continued.npz
    node_local_ckpt.py OUT resume   restore the newest checkpoint any node holds, 2 more
                                    steps (OUT/resumed_rank<r>.npz), then save again

The model has a BatchNorm whose running statistics differ per rank (each rank's data
differ): every node's copy must hold rank 0's.
"""
import json
import os
import sys

import mxnet as mx
import numpy as np
from mxnet import autograd, gluon

import dist_gluon as dg

OUT, MODE = sys.argv[1], sys.argv[2]
kv = dg.create()
node = os.environ.get("DG_NODE_RANK", "0")
mx.random.seed(0)
net = gluon.nn.HybridSequential()
net.add(gluon.nn.Dense(8, in_units=5), gluon.nn.BatchNorm(in_channels=8),
        gluon.nn.Dense(3, in_units=8))
net.initialize(mx.init.Xavier())
trainer = dg.DistributedTrainer(net.collect_params(), "adam", {"learning_rate": 0.01})
ckpt = dg.Checkpointer(os.path.join(OUT, f"node{node}"), node_local=True)
loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()


def step(number):
    rng = np.random.RandomState(100 * number + kv.rank)
    x, y = mx.nd.array(rng.randn(4, 5)), mx.nd.array(rng.randint(0, 3, 4))
    with autograd.record():
        loss = loss_fn(net(x), y)
    loss.backward()
    trainer.step(4)


def trained_values():
    return {str(i): p.data().asnumpy() for i, p in enumerate(net.collect_params().values())
            if p.grad_req != "null"}


if MODE == "first":
    for number in range(3):
        step(number)
    ckpt.save(net, trainer, epoch=0, step=3)
    for number in range(3, 5):
        step(number)
    ckpt.save(net, trainer, epoch=0, step=5)
    for number in range(5, 7):
        step(number)
    if kv.rank == 0:
        np.savez(os.path.join(OUT, "continued.npz"), **trained_values())
else:
    state = ckpt.restore(net, trainer)
    for number in range(state["step"], state["step"] + 2):
        step(number)
    np.savez(os.path.join(OUT, f"resumed_rank{kv.rank}.npz"), **trained_values())
    saved = ckpt.save(net, trainer, epoch=0, step=state["step"] + 2)
    print(json.dumps({"restored": state["step"], "path": state["path"], "saved": saved}))
