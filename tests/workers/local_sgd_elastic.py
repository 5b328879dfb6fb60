"""Worker script of tests/test_local_sgd.py: DiLoCo rounds (sync_every=4, after 2 steps
synchronised every step, pseudo-gradients and warm-up gradients in float16) under
@dg.elastic.run with a dg.elastic.State committed after every step.

Every rank trains on the same batches (those of the step's number), so that rank 0's
state is every rank's: a new worker that heals from rank 0 holds what the one it
replaces held, and the final weights must equal those of a run without a fault
exactly, if the state kept the round (anchor, outer optimizer state, position). (A
codec with residuals would not be exact here: a healed worker starts its own at zero,
tests/test_elastic_memory.py.)

    python local_sgd_elastic.py DIR [--kill-rank-at RANK STEP]

Rank 0 appends to ``DIR/events.jsonl`` at every entry of the training function
(``start``: the step, the position in the round, the pids) and at the end (``done``)
and writes the final weights to ``DIR/weights.npz``. With --kill-rank-at, rank RANK of
the first run SIGKILLs its own process after its commit of step STEP.
"""
import json
import os
import signal
import sys

import mxnet as mx
import numpy as np
from mxnet import autograd, gluon

import dist_gluon as dg

STEPS, BATCH, FEATURES = 16, 8, 5


def batch(step):
    rng = np.random.RandomState(1000 + step)
    x = rng.uniform(-1, 1, (BATCH, FEATURES)).astype("float32")
    return mx.nd.array(x), mx.nd.array(x.sum(axis=1, keepdims=True) ** 2)


def main(directory, kill_at=None):
    kv = dg.create()
    mx.random.seed(3)
    net = gluon.nn.HybridSequential()
    net.add(gluon.nn.Dense(6, in_units=FEATURES, activation="tanh"),
            gluon.nn.Dense(1, in_units=6))
    net.initialize(mx.init.Xavier())
    trainer = dg.DistributedTrainer(
        net.collect_params(), "sgd", {"learning_rate": 0.05, "momentum": 0.9}, kv=kv,
        sync_every=4, local_sgd_warmup=2, outer_optimizer="nag",
        outer_optimizer_params={"learning_rate": 0.7, "momentum": 0.9},
        compression="fp16")
    state = dg.elastic.State(net=net, trainer=trainer, step=0)
    loss_fn = gluon.loss.L2Loss()

    def note(event, **fields):
        if kv.rank == 0:
            with open(os.path.join(directory, "events.jsonl"), "a") as f:
                f.write(json.dumps(dict(event=event, world=kv.num_workers, **fields)) + "\n")

    @dg.elastic.run
    def train(state):
        note("start", step=state.step, in_round=trainer._local_sgd.in_round,
             pids=kv.allgather_object(os.getpid()))
        while state.step < STEPS:
            data, label = batch(state.step)
            with autograd.record():
                loss = loss_fn(net(data), label)
            loss.backward()
            trainer.step(BATCH)
            state.step += 1
            state.commit()
            if kill_at == (kv.rank, state.step) and kv.restart == 0:
                os.kill(os.getpid(), signal.SIGKILL)

    train(state)
    trainer.sync_weights()
    weights = [p.data().asnumpy() for p in trainer.model_params]
    if kv.rank == 0:
        np.savez(os.path.join(directory, "weights.npz"),
                 **{str(i): w for i, w in enumerate(weights)})
    note("done", synchronisations=trainer._local_sgd.synchronisations)


if __name__ == "__main__":
    kill = sys.argv.index("--kill-rank-at") if "--kill-rank-at" in sys.argv else None
    main(sys.argv[1], None if kill is None else (int(sys.argv[kill + 1]),
                                                 int(sys.argv[kill + 2])))
