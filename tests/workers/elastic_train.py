"""An elastic job's training script, for tests/test_elastic.py.

Linear regression on a fixed dataset with SGD and momentum, checkpointed every
SAVE_EVERY steps and at every stop the launcher asks for. It resumes from its newest
checkpoint on whatever number of workers the job has, at the exact position in the
epoch's order (ShardSampler's skip), so the job's weights depend only on which world
size trained which chunks of the data: tests/test_elastic.py replays that in NumPy.

Rank 0 appends what happened to ``<dir>/events.jsonl`` (start of a round, saves, stops,
the end) and keeps ``<dir>/progress.json`` current; training goes on epoch after epoch
until the file ``<dir>/finish`` exists at an epoch's end (the test decides when).

    python elastic_train.py DIR [--no-stop-check]

With --no-stop-check it never calls dg.stop_requested(), as a script written before
elastic jobs: the launcher then stops it right after a checkpoint.
"""
import json
import os
import sys
import time

import mxnet as mx
import numpy as np
from mxnet import autograd, gluon

import dist_gluon as dg

LENGTH, FEATURES, BATCH = 50, 4, 2       # samples, inputs, per-worker batch
LR, MOMENTUM, SAVE_EVERY, PACE = 0.05, 0.9, 4, 0.1


def dataset():
    rng = np.random.RandomState(0)
    x = rng.uniform(-1, 1, (LENGTH, FEATURES)).astype(np.float32)
    y = (x @ np.arange(1, FEATURES + 1, dtype=np.float32) + 0.5
         + 0.1 * rng.standard_normal(LENGTH).astype(np.float32))
    return x, y.astype(np.float32)


def main(directory, check_stop=True):
    kv = dg.create()
    x, y = dataset()
    net = gluon.nn.Dense(1, in_units=FEATURES, weight_initializer=mx.init.Zero())
    net.initialize()
    trainer = dg.DistributedTrainer(net.collect_params(), "sgd",
                                    {"learning_rate": LR, "momentum": MOMENTUM}, kv=kv)
    ckpt = dg.Checkpointer(os.path.join(directory, "ckpt"), kv, keep=3)
    state = ckpt.restore(net, trainer)
    epoch, done = (state["epoch"], state["extra"]["samples"]) if state else (0, 0)

    def note(event, **fields):
        if kv.rank == 0:
            with open(os.path.join(directory, "events.jsonl"), "a") as f:
                f.write(json.dumps(dict(event=event, world=kv.num_workers, **fields)) + "\n")

    def save(at_epoch, samples):
        ckpt.save(net, trainer, at_epoch, extra={"samples": samples})
        note("save", epoch=at_epoch, samples=samples)

    note("start", epoch=epoch, samples=done, reformation=kv.reformation,
         restart=kv.restart, elastic=os.environ.get("DG_ELASTIC"),
         nnodes=int(os.environ["DG_NNODES"]))
    sampler = dg.ShardSampler(LENGTH, kv, shuffle=False)
    loss_fn = gluon.loss.L2Loss()
    steps = 0
    while True:
        sampler.set_epoch(epoch, skip=done)
        indices = list(sampler)
        for start in range(0, len(indices), BATCH):
            batch = indices[start:start + BATCH]
            data, label = mx.nd.array(x[batch]), mx.nd.array(y[batch])
            with autograd.record():
                loss = loss_fn(net(data).reshape(-1), label)
            loss.backward()
            trainer.step(len(batch))
            # every rank trained the same number of positions of the order
            done = min(LENGTH, done + len(batch) * kv.num_workers)
            steps += 1
            if kv.rank == 0:
                with open(os.path.join(directory, "progress.json"), "w") as f:
                    json.dump({"world": kv.num_workers, "reformation": kv.reformation,
                               "restart": kv.restart, "steps": steps}, f)
            if check_stop and dg.stop_requested(kv):
                save(epoch, done)
                note("stop", epoch=epoch, samples=done)
                return
            if steps % SAVE_EVERY == 0:
                save(epoch, done)
            time.sleep(PACE)
        epoch, done = epoch + 1, 0
        finish = kv.broadcast_object(os.path.exists(os.path.join(directory, "finish")))
        save(epoch, 0)
        if finish:
            break
    weight = net.weight.data().asnumpy().ravel().tolist()
    bias = float(net.bias.data().asnumpy()[0])
    note("done", epoch=epoch, weight=weight, bias=bias)


if __name__ == "__main__":
    main(sys.argv[1], check_stop="--no-stop-check" not in sys.argv[2:])
