"""hvd.join() and dg.Join with horovod's DistributedTrainer (dist_gluon.compat): ranks
with 3 and 5 batches of 4 samples (and 2 on a third rank), an epoch through step() that
ends with hvd.join() inside the block, then one through allreduce_grads() + update()
that ends by leaving the block; each rank compares its weights with one process that
applies Horovod's arithmetic (sum of the present ranks' gradients / (size x batch)) on
the batches present at each step, and prints the largest difference."""
import mxnet as mx
import numpy as np
from mxnet import autograd, gluon

import dist_gluon as dg
import dist_gluon.compat.horovod as hvd

hvd.init()
size, rank = hvd.size(), hvd.rank()
BATCHES, BATCH = [3, 5, 2][:size], 4
rng = np.random.RandomState(0)
X = rng.randn(2, max(BATCHES), size, BATCH, 6).astype("float32")
Y = rng.randint(0, 3, size=(2, max(BATCHES), size, BATCH)).astype("float32")
loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()


def model():
    mx.random.seed(3)
    net = gluon.nn.Sequential()
    net.add(gluon.nn.Dense(5, in_units=6, activation="tanh"), gluon.nn.Dense(3, in_units=5))
    net.initialize(mx.init.Xavier())
    return net


def backward(net, data, label):
    with autograd.record():
        loss = loss_fn(net(mx.nd.array(data)), mx.nd.array(label))
    loss.backward()


net = model()
hvd.broadcast_parameters(net.collect_params(), root_rank=0)
trainer = hvd.DistributedTrainer(net.collect_params(), "sgd",
                                 {"learning_rate": 0.5, "momentum": 0.9})
with dg.Join(trainer):
    for step in range(BATCHES[rank]):
        backward(net, X[0, step, rank], Y[0, step, rank])
        trainer.step(BATCH)
    last = hvd.join()
print(f"join returned {last}", flush=True)
with dg.Join(trainer) as block:
    for step in range(BATCHES[rank]):
        backward(net, X[1, step, rank], Y[1, step, rank])
        trainer.allreduce_grads()
        trainer.update(BATCH)
print(f"block's last {block.last_joined}", flush=True)
print(f"join outside a block returned {hvd.join()}", flush=True)

# one process, Horovod's arithmetic: the joined ranks add zeros, the sum is divided by
# size x batch
reference = model()
plain = gluon.Trainer(reference.collect_params(), "sgd",
                      {"learning_rate": 0.5, "momentum": 0.9})
for epoch in range(2):
    for step in range(max(BATCHES)):
        present = [r for r in range(size) if step < BATCHES[r]]
        backward(reference, np.concatenate([X[epoch, step, r] for r in present]),
                 np.concatenate([Y[epoch, step, r] for r in present]))
        plain.step(size * BATCH)
difference = max(float(np.abs(a.data().asnumpy() - b.data().asnumpy()).max())
                 for a, b in zip(net.collect_params().values(),
                                 reference.collect_params().values()))
print(f"largest difference from one process {difference:.2e}", flush=True)
