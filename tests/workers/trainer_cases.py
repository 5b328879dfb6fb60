"""Worker script of tests/test_trainer.py: trains small models through
DistributedTrainer in several configurations and saves every rank's parameters.

    python trainer_cases.py OUT_DIR WORLD

Run as one plain process it is the single-process reference: it trains on the
concatenation of the WORLD workers' batches.
"""
import json
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
B, STEPS, FEATURES, CLASSES = 8, 4, 10, 4
rng = np.random.RandomState(0)
X = rng.randn(STEPS, 2, world * B, FEATURES).astype("float32")
Y = rng.randint(0, CLASSES, (STEPS, 2, world * B)).astype("float32")
loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()


def batch(step, micro=0):
    """This worker's share of the global batch (all of it on one process)."""
    share = world * B // N
    lo = rank * share
    return (mx.nd.array(X[step, micro, lo:lo + share]),
            mx.nd.array(Y[step, micro, lo:lo + share]))


def make_net(hybridize=False):
    # every rank gets a different random init; rank 1 also shifts MXNet's global name
    # counters, so its parameters are called dense2_... where rank 0 has dense0_...
    mx.random.seed(100 + rank)
    if rank == 1:
        gluon.nn.Dense(3)
        gluon.nn.Dense(3)
    net = gluon.nn.HybridSequential()
    net.add(gluon.nn.Dense(16, activation="relu"), gluon.nn.Dense(CLASSES))
    net.initialize(mx.init.Xavier())   # deferred: shapes come with the first forward
    if hybridize:
        net.hybridize()
    return net


def save(case, net, trainer=None):
    arrays = {str(i): p.data().asnumpy() for i, p in enumerate(net.collect_params().values())}
    np.savez(os.path.join(out_dir, f"{case}_rank{rank}.npz"), **arrays)


def train(case, opt, opt_params, hybridize=False, **kw):
    net = make_net(hybridize)
    trainer = dg.DistributedTrainer(net.collect_params(), opt, opt_params, **kw)
    for step in range(STEPS):
        x, y = batch(step)
        with autograd.record():
            loss = loss_fn(net(x), y)
        loss.backward()
        if step == 0:
            save(case + "_init", net)
        trainer.step(x.shape[0])
    save(case, net)
    return net, trainer


SGD = {"learning_rate": 0.1, "momentum": 0.9, "wd": 1e-3}

# 1. SGD with momentum and weight decay, deferred init, differing names, hybridized
net, trainer = train("sgd", "sgd", SGD, hybridize=True)

# 2. optimizer states round trip: rank 1 corrupts its momentum, load_states restores
#    rank 0's saved states on every rank
states = os.path.join(out_dir, "sgd.states")
trainer.save_states(states)
before = {k: v.asnumpy() for k, v in trainer._updaters[0].states.items()}
if rank == 1:
    for v in trainer._updaters[0].states.values():
        v[:] = 7.0
trainer.load_states(states)
after = {k: v.asnumpy() for k, v in trainer._updaters[0].states.items()}
np.savez(os.path.join(out_dir, f"states_rank{rank}.npz"),
         **{str(k): v for k, v in after.items()})
with open(os.path.join(out_dir, f"states_rank{rank}.json"), "w") as f:
    json.dump({"restored": all(np.array_equal(before[k], after[k]) for k in before)
               if rank == 0 else None, "num_update": trainer._optimizer.num_update}, f)

# 3. Adam
train("adam", "adam", {"learning_rate": 0.01})

# 4. two trainers in one program, kept apart by their prefixes, stepped alternately
net_a, net_b = make_net(), make_net()
trainer_a = dg.DistributedTrainer(net_a.collect_params(), "sgd", SGD, prefix="a")
trainer_b = dg.DistributedTrainer(net_b.collect_params(), "adam", {"learning_rate": 0.01},
                                  prefix="b")
for step in range(STEPS):
    for net_i, trainer_i, micro in ((net_a, trainer_a, 0), (net_b, trainer_b, 1)):
        x, y = batch(step, micro)
        with autograd.record():
            loss = loss_fn(net_i(x), y)
        loss.backward()
        trainer_i.step(x.shape[0])
save("two_a", net_a)
save("two_b", net_b)

# 5. grad_req='add': two micro-batches accumulated per step, one allreduce per step
net = make_net()
net(batch(0)[0])
net.collect_params().setattr("grad_req", "add")
trainer = dg.DistributedTrainer(net.collect_params(), "sgd", SGD)
for step in range(STEPS):
    for micro in range(2):
        x, y = batch(step, micro)
        with autograd.record():
            loss = loss_fn(net(x), y)
        loss.backward()
    trainer.step(2 * x.shape[0])
    net.collect_params().zero_grad()
save("accum", net)

# 6. allreduce_grads(), gradient clipping, update(): the reduced gradient is the
#    gradient of the whole global batch, so the same clipping threshold applies
net = make_net()
trainer = dg.DistributedTrainer(net.collect_params(), "sgd", {"learning_rate": 0.1})
for step in range(STEPS):
    x, y = batch(step)
    with autograd.record():
        loss = loss_fn(net(x), y)
    loss.backward()
    trainer.allreduce_grads()
    grads = [p.grad() for p in net.collect_params().values()]
    gluon.utils.clip_global_norm(grads, 2.0)
    trainer.update(x.shape[0])
save("clip", net)

# 7. fp16 compression and a gradient predivide factor
train("fp16", "sgd", SGD, compression="fp16", gradient_predivide_factor=2.0)
train("predivide", "sgd", SGD, gradient_predivide_factor=4.0)


# 8. uneven batch sizes: of each step's 8 samples rank 0 gets the first UNEVEN[step]
#    and rank 1 the rest (5 + 3, 4 + 4, 2 + 6, 7 + 1); one process gets all 8
UNEVEN = [5, 4, 2, 7]


def uneven_batch(step):
    lo, hi = 0, 8
    if N > 1:
        assert N == 2, "the uneven cases are written for 2 workers"
        lo, hi = (0, UNEVEN[step]) if rank == 0 else (UNEVEN[step], 8)
    return mx.nd.array(X[step, 0, lo:hi]), mx.nd.array(Y[step, 0, lo:hi])


for case in ("uneven_step", "uneven_update"):
    net = make_net()
    trainer = dg.DistributedTrainer(net.collect_params(), "sgd", SGD)
    for step in range(STEPS):
        x, y = uneven_batch(step)
        with autograd.record():
            loss = loss_fn(net(x), y)
        loss.backward()
        if case == "uneven_step":
            trainer.step(x.shape[0])
        else:
            trainer.allreduce_grads()
            trainer.update(x.shape[0])
    save(case, net)


# 9. a rank-dependent branch stepped with ignore_stale_grad=True: rank 0's samples go
#    through head A, rank 1's through head B on even steps and head A on odd ones; head C
#    is never used. A parameter fresh on any rank is updated on every rank with the sum
#    of the fresh gradients, one stale everywhere is skipped everywhere: one process
#    that sends each share of the batch through that share's head.
class Heads(gluon.nn.Block):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        with self.name_scope():
            self.trunk = gluon.nn.Dense(16, activation="relu", in_units=FEATURES)
            self.heads = gluon.nn.Sequential()
            for _ in range(3):
                self.heads.add(gluon.nn.Dense(CLASSES, in_units=16))

    def forward(self, x, head):
        return self.heads[head](self.trunk(x))


def head_of(share, step):
    return 0 if share == 0 else (1 if step % 2 == 0 else 0)


def heads_loss(net, step, micro=0):
    """The loss of this worker's shares (both shares on one process), each through its
    head; returns (loss, number of samples)."""
    shares = range(world) if N == 1 else [rank]
    total, count = None, 0
    for share in shares:
        size = world * B // world
        lo = share * size
        x = mx.nd.array(X[step, micro, lo:lo + size])
        y = mx.nd.array(Y[step, micro, lo:lo + size])
        part = loss_fn(net(x, head_of(share, step)), y).sum()
        total = part if total is None else total + part
        count += size
    return total, count


def heads_net():
    mx.random.seed(200 + rank)
    net = Heads()
    net.initialize(mx.init.Xavier())
    return net


def train_heads(case, accumulate=False, update=False, **kw):
    net = heads_net()
    if accumulate:
        net.collect_params().setattr("grad_req", "add")
    trainer = dg.DistributedTrainer(net.collect_params(), "sgd", SGD, **kw)
    save(case + "_init", net)
    for step in range(STEPS):
        count = 0
        for micro in range(2 if accumulate else 1):
            with autograd.record():
                loss, n = heads_loss(net, step, micro)
            loss.backward()
            count += n
        if update:
            trainer.allreduce_grads()
            trainer.update(count, ignore_stale_grad=True)
        else:
            trainer.step(count, ignore_stale_grad=True)
        if accumulate:
            net.collect_params().zero_grad()
    save(case, net)


train_heads("heads")
train_heads("heads_update", update=True)
train_heads("heads_accum", accumulate=True)
train_heads("heads_fp16", compression="fp16")
train_heads("heads_2bit", compression={"type": "2bit", "threshold": 0.01})

# 10. the same branch without ignore_stale_grad: one clear error on every rank
if N > 1:
    net = heads_net()
    trainer = dg.DistributedTrainer(net.collect_params(), "sgd", SGD)
    with autograd.record():
        loss, n = heads_loss(net, 0)
    loss.backward()
    try:
        trainer.step(n)
        message = "no error"
    except dg.StaleGradientError as err:
        message = str(err)
    with open(os.path.join(out_dir, f"stale_error_rank{rank}.txt"), "w") as f:
        f.write(message)
print("cases done", flush=True)
