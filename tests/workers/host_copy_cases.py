"""Worker script of tests/test_host_copies.py: runs steady training steps of several
features and counts the copies of arrays of more than 64 elements between MXNet and
NumPy (tests/workers/host_copies.py) that they make; writes every rank's counts.

    python host_copy_cases.py OUT_DIR

Each case builds its model and trainer, runs two warm-up steps (deferred
initialisation, broadcasts, key creation) and then counts three steady steps, ended by
``mx.nd.waitall()``. What the script itself does (its data is made by MXNet operators)
makes no copy, so every copy counted is one the library made.
"""
import json
import os
import sys

import mxnet as mx
from host_copies import HostCopies
from mxnet import autograd, gluon

import dist_gluon as dg
from dist_gluon.optimizer import DistributedOptimizer

out_dir = sys.argv[1]
kv = dg.create()
rank = kv.rank
WARMUP, STEADY = 2, 3
ASYNC = kv.type == "dist_async"
loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
counts = {}


def measure(case, step):
    for i in range(WARMUP):
        step(i)
    mx.nd.waitall()
    with HostCopies() as copies:
        for i in range(WARMUP, WARMUP + STEADY):
            step(i)
        mx.nd.waitall()
    counts[case] = {"count": copies.count, "summary": copies.summary()}
    print(f"HOST_COPIES {case} {copies.count} {copies.summary()}", flush=True)


def batch(samples, features=100, classes=10):
    """Random data and labels made on the engine (no upload from NumPy)."""
    return (mx.nd.random.normal(shape=(samples, features)),
            mx.nd.floor(mx.nd.random.uniform(0, classes, shape=(samples,))))


def gluon_case(case, net, data, trainer_kw=None, batch_size=None):
    net.initialize(mx.init.Xavier())
    trainer = dg.DistributedTrainer(net.collect_params(), "sgd",
                                    {"learning_rate": 0.01, "momentum": 0.9},
                                    **(trainer_kw or {}))

    def step(i):
        x, y = data(i)
        with autograd.record():
            loss = loss_fn(net(x), y)
        loss.backward()
        trainer.step(batch_size(i) if batch_size else x.shape[0])

    measure(case, step)


def mlp():
    net = gluon.nn.HybridSequential()
    net.add(gluon.nn.Dense(128, activation="relu"), gluon.nn.Dense(10))
    return net


# 1. plain training: a hybridized MLP, equal batches
net = mlp()
net.hybridize()
gluon_case("plain", net, lambda i: batch(16))

if ASYNC:
    # the servers of a dist_async job run one optimizer: one trainer per job, and the
    # other cases need synchronous workers (or a trainer of their own)
    with open(os.path.join(out_dir, f"copies_rank{rank}.json"), "w") as f:
        json.dump(counts, f)
    sys.exit(0)

# 2. uneven batches: rank 0 takes 16 samples per step, rank 1 9
gluon_case("uneven", mlp(), lambda i: batch(16 if rank == 0 else 9))

# 3. dg.stop_requested() after every step, as in an elastic job (DG_ELASTIC=1: one sum
#    of one number per call)
os.environ["DG_ELASTIC"] = "1"
net = mlp()
net.initialize(mx.init.Xavier())
trainer = dg.DistributedTrainer(net.collect_params(), "sgd", {"learning_rate": 0.01})


def elastic_step(i):
    x, y = batch(16)
    with autograd.record():
        loss = loss_fn(net(x), y)
    loss.backward()
    trainer.step(16)
    assert not dg.stop_requested()


measure("elastic", elastic_step)
del os.environ["DG_ELASTIC"]

# 4. row_sparse gradients: an embedding of 5000 words of 32 values, 200 words a step
def sparse_net():
    net = gluon.nn.HybridSequential()
    net.add(gluon.nn.Embedding(5000, 32, sparse_grad=True), gluon.nn.Flatten(),
            gluon.nn.Dense(10))
    return net

def words(i):
    x = mx.nd.floor(mx.nd.random.uniform(0, 5000, shape=(20, 10)))
    return x, mx.nd.floor(mx.nd.random.uniform(0, 10, shape=(20,)))

gluon_case("sparse", sparse_net(), words)

# 5. SyncBatchNorm: 64 channels (the statistics of a layer are 129 numbers)
def syncbn_net():
    net = gluon.nn.HybridSequential()
    net.add(gluon.nn.Conv2D(64, 3, padding=1), dg.SyncBatchNorm(),
            gluon.nn.Activation("relu"), gluon.nn.Conv2D(64, 3, padding=1),
            dg.SyncBatchNorm(), gluon.nn.Activation("relu"), gluon.nn.Dense(10))
    return net

gluon_case("syncbn", syncbn_net(),
           lambda i: (mx.nd.random.normal(shape=(4 if rank == 0 else 3, 3, 8, 8)),
                      mx.nd.floor(mx.nd.random.uniform(0, 10, shape=(4 if rank == 0
                                                                     else 3,)))))


# 6. the Module API through DistributedOptimizer, with and without loss scaling (ranks
#    bound with different batch sizes)
def module_case(case, loss_scale):
    share = 16 if rank == 0 else 9
    data = mx.sym.Variable("data")
    net = mx.sym.FullyConnected(data, num_hidden=128, name="fc1")
    net = mx.sym.Activation(net, act_type="relu")
    net = mx.sym.FullyConnected(net, num_hidden=10, name="fc2")
    net = mx.sym.SoftmaxOutput(net, name="softmax")
    mod = mx.mod.Module(net, context=mx.cpu())
    mod.bind(data_shapes=[("data", (share, 100))], label_shapes=[("softmax_label", (share,))])
    mod.init_params(mx.init.Xavier())
    opt = DistributedOptimizer(mx.optimizer.SGD(learning_rate=0.01, momentum=0.9,
                                                rescale_grad=1.0 / (share * loss_scale)),
                               loss_scale=loss_scale)
    mod.init_optimizer(kvstore=None, optimizer=opt)

    def step(i):
        x, y = batch(share)
        mod.forward_backward(mx.io.DataBatch([x], [y]))
        mod.update()

    measure(case, step)


module_case("module", 1.0)
module_case("loss_scale", 128.0)

with open(os.path.join(out_dir, f"copies_rank{rank}.json"), "w") as f:
    json.dump(counts, f)
print("cases done", flush=True)
