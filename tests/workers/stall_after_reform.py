"""A dg.elastic script whose ranks call different collectives after a re-formation,
for tests/test_stall_rounds.py: rank 1 SIGKILLs itself after 3 steps of the first
round; the job re-forms (horovod: rank 0 keeps its process; ps-lite: both restart from
the node's copy) and the next round injects the mismatch ``--kind``, each what a user's
mistake causes:

- ``sum``: rank 0 sums a tensor of its own (``extra``) before its commit, 3 steps into
  the round, while rank 1 goes on to the commit's stop flag.
- ``sync_check``: rank 1, a process started for the round, runs with another
  ``DG_CHECK_SYNC`` (1) than its peers (the default, 100), as a node whose environment
  exports it would: it compares the weights (``*.sync``) at the round's first step,
  where rank 0 goes on to its commit.
- ``local_sgd``: under Local SGD (``sync_every=8``) rank 0 evaluates alone, 3 steps into
  the round, and synchronises first as docs/slow-links.md says, but inside its
  ``if rank == 0``: it averages the round now while rank 1 waits until step 8.
- ``syncbn``: the model has a SyncBatchNorm; rank 0 computes a loss to log in training
  mode (``autograd.record()``, 3 steps into the round), whose forward sums the layer's
  statistics with peers that never run it.

Each rank then waits in a collective the other never joins, and the launcher must
report it; the line ``stall_after_reform: rank R ...`` says when the mismatch starts.

    python stall_after_reform.py --kind syncbn
"""
import argparse
import os
import signal
import sys

import mxnet as mx
from mxnet import autograd, gluon

import dist_gluon as dg

KINDS = ("sum", "sync_check", "local_sgd", "syncbn")


def say(text):
    print(f"stall_after_reform: {text}", file=sys.stderr, flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kind", choices=KINDS, default="sum",
                        help="the mismatch injected in the round after the first")
    kind = parser.parse_args().kind

    kv = dg.create()
    if kind == "sync_check" and kv.restart > 0 and kv.rank == 1:
        # this process's environment differs from its peers'
        os.environ["DG_CHECK_SYNC"] = "1"
    net = gluon.nn.HybridSequential()
    net.add(gluon.nn.Dense(4, in_units=4))
    if kind == "syncbn":
        net.add(dg.SyncBatchNorm(in_channels=4))
    net.add(gluon.nn.Dense(1, in_units=4))
    net.initialize(mx.init.Constant(0.1))
    sync_every = 8 if kind == "local_sgd" else 1
    trainer = dg.DistributedTrainer(net.collect_params(), "sgd", {"learning_rate": 0.01},
                                    kv=kv, sync_every=sync_every)
    state = dg.elastic.State(net=net, trainer=trainer, step=0)

    @dg.elastic.run
    def train(state):
        if kind == "sync_check" and kv.restart > 0 and kv.rank == 1:
            say("rank 1 compares the weights every step (DG_CHECK_SYNC=1), its peers "
                "every 100")
        steps = 0
        while state.step < 1000:
            x = mx.nd.arange(8).reshape((2, 4)) * (kv.rank + 1)
            with autograd.record():
                loss = ((net(x) - 1) ** 2).sum()
            loss.backward()
            trainer.step(2)
            state.step += 1
            steps += 1
            if kv.restart == 0 and kv.rank == 1 and steps == 3:
                os.kill(os.getpid(), signal.SIGKILL)
            if kv.restart > 0 and kv.rank == 0 and steps == 3:
                inject(kind)
            state.commit()

    def inject(what):
        if what == "sum":
            say("rank 0 sums a tensor of its own")
            extra = mx.nd.ones((1,))
            kv.pushpull("extra", extra)
            extra.wait_to_read()
        elif what == "local_sgd":
            say("rank 0 synchronises the Local SGD round alone")
            trainer.sync_weights()
            net[0].weight.data().wait_to_read()
        elif what == "syncbn":
            say("rank 0 runs a training-mode forward through SyncBatchNorm alone")
            with autograd.record():
                logged = net(mx.nd.ones((2, 4)))
            logged.wait_to_read()

    train(state)


if __name__ == "__main__":
    main()
