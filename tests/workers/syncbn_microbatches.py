"""Worker script of tests/test_syncbn.py: SyncBatchNorm with gradients accumulated over
2 micro-batches per step (``grad_req='add'``), when a layer's backward passes of the two
micro-batches run in another order on one rank than on the other.

    python syncbn_microbatches.py OUT_DIR DEVICES [HOLD_SECONDS]

MXNet calls the backward functions in its own custom-operator threads as their inputs
are ready, so the second micro-batch's backward of a layer may run before the first's.
Rank 0 holds the first micro-batch's backward of one layer for HOLD_SECONDS in every
step (rank 1 does not), which makes that order likely there. Run as one plain process
it is the reference: nn.BatchNorm on the concatenation of the workers' micro-batches.
"""
import os
import sys
import time

import mxnet as mx
import numpy as np
from mxnet import autograd, gluon

import dist_gluon as dg
from dist_gluon import syncbn

out_dir = sys.argv[1]
DEVICES = int(sys.argv[2])
hold = float(sys.argv[3]) if len(sys.argv) > 3 else 0.0
os.makedirs(out_dir, exist_ok=True)
kv = dg.create()
N, rank = kv.num_workers, kv.rank
WORLD, B, STEPS, MICRO, CLASSES = 2, 4, 3, 2, 4
rng = np.random.RandomState(3)
X = (rng.randn(STEPS, MICRO, WORLD * B, 3, 8, 8) * 2 + 5).astype("float32")
Y = rng.randint(0, CLASSES, (STEPS, MICRO, WORLD * B)).astype("float32")
# every micro-batch's samples differ in their statistics, so a sum that pairs one rank's
# first micro-batch with the other's second is far from the right one
X[:, 1] = X[:, 1] * 3 - 4

current = {"micro": 0}
if N > 1 and rank == 0 and hold > 0:
    forward, backward = syncbn._GlobalAffine.forward, syncbn._GlobalAffine.backward

    def marked_forward(self, x, gb):
        self.micro = current["micro"]
        return forward(self, x, gb)

    def held_backward(self, dscale, dshift):
        # the first layer's backward comes last in a pass: hold its first micro-batch's
        # (on the first device)
        if (self._channel.forward_key == "syncbn.0.forward" and self.micro == 0
                and self._channel.ones.context == mx.cpu(0)):
            time.sleep(hold)
        return backward(self, dscale, dshift)

    syncbn._GlobalAffine.forward = marked_forward
    syncbn._GlobalAffine.backward = held_backward

norm = dg.SyncBatchNorm if N > 1 else gluon.nn.BatchNorm
mx.random.seed(11)
net = gluon.nn.HybridSequential()
net.add(gluon.nn.Conv2D(6, 3, padding=1), norm(), gluon.nn.Activation("relu"),
        gluon.nn.Conv2D(6, 3, strides=2, padding=1), norm(),
        gluon.nn.Activation("relu"), gluon.nn.Dense(CLASSES))
contexts = [mx.cpu(i) for i in range(DEVICES if N > 1 else 1)]
net.initialize(mx.init.Xavier(), ctx=contexts)
net(mx.nd.array(X[0, 0, :2], ctx=contexts[0]))
net.collect_params().setattr("grad_req", "add")
trainer = dg.DistributedTrainer(net.collect_params(), "sgd", {"learning_rate": 0.1})
loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
lo, hi = rank * WORLD * B // N, (rank + 1) * WORLD * B // N
for step in range(STEPS):
    for micro in range(MICRO):
        current["micro"] = micro
        xs = gluon.utils.split_and_load(X[step, micro, lo:hi], contexts)
        ys = gluon.utils.split_and_load(Y[step, micro, lo:hi], contexts)
        with autograd.record():
            losses = [loss_fn(net(x), y) for x, y in zip(xs, ys)]
        autograd.backward(losses)
    trainer.step(MICRO * (hi - lo))
    net.collect_params().zero_grad()
arrays = {str(i): p.data().asnumpy() for i, p in enumerate(net.collect_params().values())}
np.savez(os.path.join(out_dir, f"micro_rank{rank}.npz"), **arrays)
if N > 1:
    # which transport the layers' sums took (SyncBatchNorm's side channel or the backend)
    paths = {"side channel" if c.side is not None else "backend"
             for layer in net if isinstance(layer, dg.SyncBatchNorm)
             for c in layer._comms.values()}
    sides = [c.side for layer in net if isinstance(layer, dg.SyncBatchNorm)
             for c in layer._comms.values() if c.side is not None]
    print("sums over:", ", ".join(sorted(paths)),
          *(["between", ", ".join(sides[0].names)] if sides else []), flush=True)
print("micro-batches done", flush=True)
