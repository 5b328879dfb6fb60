"""A small real distributed training run, used by `make demo` until the MNIST example
lands: every worker fits a linear model to its own shard of a synthetic regression."""
import mxnet as mx
import numpy as np

import dist_gluon as dg

kv = dg.create()
rng = np.random.RandomState(0)
true_w = rng.randn(8, 1).astype("float32")
X = rng.randn(512, 8).astype("float32")
y = X @ true_w + 0.01 * rng.randn(512, 1).astype("float32")
shard = slice(kv.rank, None, kv.num_workers)
data, label = mx.nd.array(X[shard]), mx.nd.array(y[shard])

w = mx.nd.random.normal(shape=(8, 1))
w.attach_grad()
for step in range(200):
    with mx.autograd.record():
        loss = ((mx.nd.dot(data, w) - label) ** 2).mean()
    loss.backward()
    kv.pushpull("w_grad", w.grad)
    w -= 0.1 * w.grad / kv.num_workers
err = float(np.abs(w.asnumpy() - true_w).max())
if kv.rank == 0:
    print(f"backend={kv.type} workers={kv.num_workers} max_weight_error={err:.4f}")
