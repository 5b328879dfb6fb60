"""Worker script of tests/test_join.py: ranks with different numbers of batches train
inside ``dg.Join`` and save every rank's weights and running statistics.

    python join_cases.py OUT_DIR WORLD

Rank r has BATCHES[r] batches per epoch (10, 7 and, on 3 workers, 4). Cases: two
trainers in one block ("two"); row_sparse gradients ("sparse"); a plain network and one
with SyncBatchNorm, two epochs each (the block entered again), through step and through
allreduce_grads + update. Run as one plain process it is the reference: at each step
one process on the concatenation of the batches of the ranks that still have one.
"""
import os
import sys

import mxnet as mx
import numpy as np
from mxnet import autograd, gluon

import dist_gluon as dg

out_dir, WORLD = sys.argv[1], int(sys.argv[2])
os.makedirs(out_dir, exist_ok=True)
kv = dg.create()
N, rank = kv.num_workers, kv.rank
assert N in (1, WORLD)
BATCHES = [10, 7, 4][:WORLD]
STEPS, FEATURES, CLASSES = max(BATCHES), 6, 3
rng = np.random.RandomState(0)
# rank r's batch at step s has 4 + r samples (uneven sizes too)
X = [[(rng.randn(4 + r, FEATURES) * 2 + 3).astype("float32") for r in range(WORLD)]
     for _ in range(STEPS)]
Y = [[rng.randint(0, CLASSES, 4 + r).astype("float32") for r in range(WORLD)]
     for _ in range(STEPS)]
loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()


def batches():
    """This rank's batches of an epoch; the reference's: every step's concatenation."""
    if N > 1:
        for step in range(BATCHES[rank]):
            yield X[step][rank], Y[step][rank]
        return
    for step in range(STEPS):
        present = [r for r in range(WORLD) if step < BATCHES[r]]
        yield (np.concatenate([X[step][r] for r in present]),
               np.concatenate([Y[step][r] for r in present]))


def net_and_trainer(norm):
    mx.random.seed(7)
    net = gluon.nn.Sequential()
    net.add(gluon.nn.Dense(8, in_units=FEATURES))
    if norm:
        net.add(dg.SyncBatchNorm(in_channels=8))
    net.add(gluon.nn.Activation("tanh"), gluon.nn.Dense(CLASSES, in_units=8))
    net.initialize(mx.init.Xavier())
    trainer = dg.DistributedTrainer(net.collect_params(), "sgd",
                                    {"learning_rate": 0.1, "momentum": 0.9, "wd": 1e-3})
    return net, trainer


def train_epoch(net, trainer, split_update):
    with dg.Join(trainer):
        for data, label in batches():
            data, label = mx.nd.array(data), mx.nd.array(label)
            with autograd.record():
                loss = loss_fn(net(data), label)
            loss.backward()
            if split_update:
                trainer.allreduce_grads()
                trainer.update(data.shape[0])
            else:
                trainer.step(data.shape[0])


def train_two(nets, trainers):
    """Two trainers in one block (a GAN's shape): each batch steps the first model,
    then the second on the first's output."""
    first, second = nets
    with dg.Join(*trainers):
        for data, label in batches():
            data, label = mx.nd.array(data), mx.nd.array(label)
            with autograd.record():
                loss = loss_fn(first(data), label)
            loss.backward()
            trainers[0].step(data.shape[0])
            features = first(data).detach()
            with autograd.record():
                loss = loss_fn(second(features), label)
            loss.backward()
            trainers[1].step(data.shape[0])


def second_model():
    mx.random.seed(8)
    net = gluon.nn.Dense(CLASSES, in_units=CLASSES)
    net.initialize(mx.init.Xavier())
    return net, dg.DistributedTrainer(net.collect_params(), "adam", {"learning_rate": 0.01})


(first, first_trainer), (second, second_trainer) = net_and_trainer(False), second_model()
train_two((first, second), (first_trainer, second_trainer))
arrays = {f"{i}": p.data().asnumpy() for i, p in enumerate(
    list(first.collect_params().values()) + list(second.collect_params().values()))}
np.savez(os.path.join(out_dir, f"two-{rank if N > 1 else 'reference'}.npz"), **arrays)

# row_sparse gradients: an embedding of tokens made from the features
mx.random.seed(9)
embedding = gluon.nn.Sequential()
embedding.add(gluon.nn.Embedding(30, 4, sparse_grad=True),
              gluon.nn.Dense(CLASSES, in_units=FEATURES * 4))
embedding.initialize(mx.init.Xavier())
sparse_trainer = dg.DistributedTrainer(embedding.collect_params(), "sgd",
                                       {"learning_rate": 0.1, "lazy_update": True})
with dg.Join(sparse_trainer):
    for data, label in batches():
        tokens = mx.nd.array((np.abs(data) * 7).astype("int64") % 30)
        with autograd.record():
            loss = loss_fn(embedding(tokens), mx.nd.array(label))
        loss.backward()
        sparse_trainer.step(data.shape[0])
arrays = {f"{i}": p.data().asnumpy() for i, p in enumerate(embedding.collect_params().values())}
np.savez(os.path.join(out_dir, f"sparse-{rank if N > 1 else 'reference'}.npz"), **arrays)

for case, norm in (("plain", False), ("syncbn", True)):
    net, trainer = net_and_trainer(norm)
    # two epochs: the block is entered again; the second through allreduce_grads + update
    train_epoch(net, trainer, split_update=False)
    train_epoch(net, trainer, split_update=True)
    arrays = {f"{i}": p.data().asnumpy()
              for i, p in enumerate(net.collect_params().values())}
    np.savez(os.path.join(out_dir, f"{case}-{rank if N > 1 else 'reference'}.npz"), **arrays)
print(f"rank {rank} done", flush=True)
