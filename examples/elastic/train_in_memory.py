"""Elastic training in memory: a worker that dies is replaced, and training goes on from
the last step every worker committed, with no checkpoint written or read.

A small regression (a Dense layer on synthetic data, the same on every run) trained
with SGD and momentum. Its whole state (weights, optimizer states, the position in the
epoch) lives in a ``dist_gluon.elastic.State`` committed after every step; the training
loop runs under ``@dist_gluon.elastic.run``, which re-enters it after a re-formation
with the state of the last commit (a new worker gets it from a live peer).

On one machine, two workers; kill one while it trains and watch the job heal:

    python -m dist_gluon.launch -n 2 --max-restarts 3 \\
        -- python examples/elastic/train_in_memory.py --epochs 20
    pkill -KILL -f 'train_in_memory.py' --newest     # in another terminal

(``--max-restarts`` on one machine makes the job elastic, as ``--nnodes 1:1``; on
horovod the survivor keeps its process, on dist_sync every worker restarts from the
node's copy in /dev/shm.)
"""
import argparse
import time

import mxnet as mx
import numpy as np
from mxnet import autograd, gluon

import dist_gluon as dg

FEATURES, SAMPLES = 8, 512


def dataset(seed: int = 0):
    """Inputs and targets of a linear model with noise (the same on every rank)."""
    rng = np.random.RandomState(seed)
    x = rng.uniform(-1, 1, (SAMPLES, FEATURES)).astype("float32")
    w = rng.uniform(-1, 1, FEATURES).astype("float32")
    y = x @ w + 0.5 + 0.01 * rng.randn(SAMPLES).astype("float32")
    return x, y


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=5, help="epochs to train")
    parser.add_argument("--batch-size", type=int, default=16,
                        help="samples per worker and step")
    parser.add_argument("--lr", type=float, default=0.05, help="learning rate")
    parser.add_argument("--pace", type=float, default=0.0,
                        help="seconds to sleep after each step (time to kill a worker)")
    args = parser.parse_args()

    kv = dg.create()
    x, y = dataset()
    net = gluon.nn.Dense(1, in_units=FEATURES, weight_initializer=mx.init.Zero())
    net.initialize()
    trainer = dg.DistributedTrainer(net.collect_params(), "sgd",
                                    {"learning_rate": args.lr, "momentum": 0.9}, kv=kv)
    loss_fn = gluon.loss.L2Loss()
    # what a worker needs to go on where the job was: the model, the trainer, and the
    # position in the data (samples of the epoch every rank has trained on)
    state = dg.elastic.State(net=net, trainer=trainer, epoch=0, samples=0)

    @dg.elastic.run
    def train(state):
        # entered again after every re-formation: the world may have another size
        sampler = dg.ShardSampler(SAMPLES, kv, shuffle=True, last_batch="pad")
        while state.epoch < args.epochs:
            sampler.set_epoch(state.epoch, skip=state.samples)
            indices = list(sampler)
            total, steps = 0.0, 0
            for start in range(0, len(indices), args.batch_size):
                batch = indices[start:start + args.batch_size]
                data, label = mx.nd.array(x[batch]), mx.nd.array(y[batch])
                with autograd.record():
                    loss = loss_fn(net(data).reshape(-1), label)
                loss.backward()
                trainer.step(len(batch))
                total, steps = total + float(loss.mean().asscalar()), steps + 1
                state.samples = min(SAMPLES, state.samples + len(batch) * kv.num_workers)
                state.commit()          # a worker lost from here on costs nothing
                time.sleep(args.pace)
            if kv.rank == 0:
                print(f"epoch {state.epoch}: loss {total / max(1, steps):.5f} "
                      f"on {kv.num_workers} workers", flush=True)
            state.epoch, state.samples = state.epoch + 1, 0
            state.commit()

    train(state)
    if kv.rank == 0:
        bias = float(net.bias.data().asscalar())
        print(f"trained {args.epochs} epochs on {kv.num_workers} workers; bias "
              f"{bias:.6f} (the data's is 0.5)", flush=True)


if __name__ == "__main__":
    main()
