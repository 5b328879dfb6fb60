"""A dg.elastic script whose ranks call different collectives after a re-formation,
for tests/test_stall_rounds.py: rank 1 SIGKILLs itself after 3 steps of the first
round; the job re-forms (horovod: rank 0 keeps its process; ps-lite: both restart from
the node's copy) and, 3 steps into the next round, rank 0 sums a tensor of its own
(``extra``) before its commit while rank 1 goes on to the commit's stop flag. Both then
wait, each in a collective the other never joins, with as many collectives submitted:
the launcher must report the stall and end it at --stall-timeout.

    python stall_after_reform.py
"""
import os
import signal
import sys

import mxnet as mx
from mxnet import autograd, gluon

import dist_gluon as dg


def main():
    kv = dg.create()
    net = gluon.nn.Dense(1, in_units=4)
    net.initialize(mx.init.Zero())
    trainer = dg.DistributedTrainer(net.collect_params(), "sgd", {"learning_rate": 0.01},
                                    kv=kv)
    state = dg.elastic.State(net=net, trainer=trainer, step=0)

    @dg.elastic.run
    def train(state):
        steps = 0
        while state.step < 1000:
            x = mx.nd.ones((2, 4)) * (kv.rank + 1)
            with autograd.record():
                loss = ((net(x) - 1) ** 2).sum()
            loss.backward()
            trainer.step(2)
            state.step += 1
            steps += 1
            if kv.restart == 0 and kv.rank == 1 and steps == 3:
                os.kill(os.getpid(), signal.SIGKILL)
            if kv.restart > 0 and kv.rank == 0 and steps == 3:
                print("stall_after_reform: rank 0 sums a tensor of its own", file=sys.stderr,
                      flush=True)
                extra = mx.nd.ones((1,))
                kv.pushpull("extra", extra)
                extra.wait_to_read()
            state.commit()

    train(state)


if __name__ == "__main__":
    main()
