"""Optimizer state files move between gluon.Trainer, the peers' trainers and
DistributedTrainer (tests/test_trainer.py).

The model has 12 Dense layers, so gluon.Trainer's order (names sorted: m_dense0_bias,
m_dense0_weight, m_dense10_bias, ..., m_dense2_bias...) differs from the model's. In
the distributed run rank r first builds 3r throwaway blocks, so its names and their
sorted order differ from rank 0's (as ranks that build different numbers of blocks do
in MXNet 1.x).

    state_order_cases.py OUT reference   one process: gluon.Trainer trains 2 steps and
        writes gluon.states and w2.npz, then 2 more steps: ref_final.npz. The same
        continuation from gluon.states on DistributedTrainer and the horovod and
        BytePS compat trainers (final_<who>.npz), from horovod.mxnet's own trainer's
        file on DistributedTrainer (final_from_horovod.npz), and back from each of
        our trainers' files into gluon.Trainer (back_<who>.npz).
    state_order_cases.py OUT distributed   N workers (names differ per rank): every
        rank loads w2.npz and gluon.states into DistributedTrainer and trains 2 steps
        on its share of the batch: final_rank<r>.npz.
"""
import os
import sys

import mxnet as mx
import numpy as np
from mxnet import autograd, gluon

OUT, MODE = sys.argv[1], sys.argv[2]
BATCH = 8
ADAM = {"learning_rate": 0.01}


def build(shift: int = 0):
    """Parameters m_dense<shift>_weight ... m_dense<shift + 11>_bias, in model order."""
    net = gluon.nn.HybridSequential(prefix="m_")
    with net.name_scope():
        for _ in range(shift):
            gluon.nn.Dense(1)           # advances the name counter
        for _ in range(11):
            net.add(gluon.nn.Dense(4, in_units=4, activation="tanh"))
        net.add(gluon.nn.Dense(3, in_units=4))
    net.initialize()
    return net


def set_values(net, values):
    for p, v in zip(net.collect_params().values(), values):
        p.set_data(mx.nd.array(v))


def values(net):
    return [p.data().asnumpy() for p in net.collect_params().values()]


def save_values(net, name):
    np.savez(os.path.join(OUT, name), *values(net))


def load_values(name):
    with np.load(os.path.join(OUT, name)) as npz:
        return [npz[f"arr_{i}"] for i in range(len(npz.files))]


def batch(step: int, part: slice = slice(None)):
    rng = np.random.RandomState(100 + step)
    x = rng.randn(BATCH, 4).astype("float32")
    y = rng.randint(0, 3, BATCH).astype("float32")
    return mx.nd.array(x[part]), mx.nd.array(y[part])


def train(net, trainer, steps, first_step, part=slice(None)):
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    for step in range(first_step, first_step + steps):
        x, y = batch(step, part)
        with autograd.record():
            loss = loss_fn(net(x), y)
        loss.backward()
        trainer.step(x.shape[0])


def path(name):
    return os.path.join(OUT, name)


def continue_from(make_trainer, states, name):
    """A fresh net at w2 whose trainer loads ``states``, then 2 more steps."""
    net = build()
    set_values(net, load_values("w2.npz"))
    trainer = make_trainer(net)
    trainer.load_states(path(states))
    train(net, trainer, 2, first_step=2)
    save_values(net, name)
    return net, trainer


def reference():
    import dist_gluon as dg
    import dist_gluon.compat.byteps as bps
    import dist_gluon.compat.horovod as dg_hvd

    net = build()
    set_values(net, load_values("w0.npz"))
    trainer = gluon.Trainer(net.collect_params(), "adam", ADAM)
    train(net, trainer, 2, first_step=0)
    save_values(net, "w2.npz")
    trainer.save_states(path("gluon.states"))
    train(net, trainer, 2, first_step=2)
    save_values(net, "ref_final.npz")

    dg_hvd.init()
    bps.init()
    makers = {
        "dg": lambda n: dg.DistributedTrainer(n.collect_params(), "adam", ADAM, kv="local"),
        "compat_horovod": lambda n: dg_hvd.DistributedTrainer(n.collect_params(), "adam",
                                                              ADAM),
        "compat_byteps": lambda n: bps.DistributedTrainer(n.collect_params(), "adam", ADAM),
        "gluon": lambda n: gluon.Trainer(n.collect_params(), "adam", ADAM),
    }
    for who in ("dg", "compat_horovod", "compat_byteps"):
        # gluon's file into ours
        continue_from(makers[who], "gluon.states", f"final_{who}.npz")
        # and back: ours after 2 steps from w0 saves, gluon.Trainer loads and goes on
        net = build()
        set_values(net, load_values("w0.npz"))
        ours = makers[who](net)
        train(net, ours, 2, first_step=0)
        ours.save_states(path(f"{who}.states"))
        save_values(net, f"w2_{who}.npz")
        back = build()
        set_values(back, load_values(f"w2_{who}.npz"))
        gluon_trainer = makers["gluon"](back)
        gluon_trainer.load_states(path(f"{who}.states"))
        train(back, gluon_trainer, 2, first_step=2)
        save_values(back, f"back_{who}.npz")

    # horovod.mxnet's own DistributedTrainer (one process) writes, we load
    import horovod.mxnet as hvd
    hvd.init()
    net = build()
    set_values(net, load_values("w0.npz"))
    theirs = hvd.DistributedTrainer(net.collect_params(), "adam", ADAM)
    train(net, theirs, 2, first_step=0)
    theirs.save_states(path("horovod.states"))
    save_values(net, "w2_horovod.npz")
    train(net, theirs, 2, first_step=2)
    save_values(net, "ref_final_horovod.npz")
    net = build()
    set_values(net, load_values("w2_horovod.npz"))
    ours = makers["dg"](net)
    ours.load_states(path("horovod.states"))
    train(net, ours, 2, first_step=2)
    save_values(net, "final_from_horovod.npz")


def write_initial():
    """The starting weights of every run here: w0.npz."""
    mx.random.seed(0)
    save_values(build(), "w0.npz")


def distributed():
    import dist_gluon as dg

    kv = dg.create()
    net = build(3 * kv.rank)      # rank 1: m_dense3 ... m_dense14, another sorted order
    set_values(net, load_values("w2.npz"))
    trainer = dg.DistributedTrainer(net.collect_params(), "adam", ADAM)
    trainer.load_states(path("gluon.states"))
    share = BATCH // kv.num_workers
    train(net, trainer, 2, first_step=2, part=slice(kv.rank * share, (kv.rank + 1) * share))
    save_values(net, f"final_rank{kv.rank}.npz")


if __name__ == "__main__":
    if MODE == "reference":
        write_initial()
        reference()
    else:
        distributed()
    print("done")
