"""An elastic job's training script whose workers keep their processes, for
tests/test_elastic_memory.py: tests/workers/elastic_train.py's regression (the same
data, model, optimizer and pace), written the way horovod elastic scripts are: the
state lives in a dg.elastic.State committed after every step, and the training
function runs under @dg.elastic.run. No checkpoint is ever written or read.

Rank 0 appends to ``<dir>/events.jsonl`` at every entry of the training function
(``start``: world size, position, the pids of every rank) and at the end (``done``: the
weights), in elastic_train.py's format, so that tests/test_elastic.py's replay checks
the weights; ``<dir>/progress.json`` says the round, its steps and when the last one
ended. Training goes on epoch after epoch until the file ``<dir>/finish`` exists at an
epoch's end.

    python elastic_memory_train.py DIR [--kill-rank-at RANK STEP] [--compression 2bit]

With --kill-rank-at, rank RANK of the first round SIGKILLs its own process after STEP
steps (a worker that dies on a node that stays). With --compression the gradients
travel through that codec, and every ``start`` event carries each rank's codec
residuals (``residuals``: the sum of squares of its 2-bit residuals).
"""
import json
import os
import signal
import sys
import time

import mxnet as mx
from elastic_train import BATCH, FEATURES, LENGTH, LR, MOMENTUM, PACE, dataset
from mxnet import autograd, gluon

import dist_gluon as dg


def residuals(trainer) -> float:
    """The sum of squares of this rank's 2-bit residuals (its error feedback)."""
    codec = trainer.codec
    if codec is None:
        return 0.0
    return sum(float((a.astype("float64") ** 2).sum().asscalar())
               for name, a in codec.state_arrays().items() if name.startswith("residual."))


def main(directory, kill_at=None, compression=None):
    kv = dg.create()
    x, y = dataset()
    net = gluon.nn.Dense(1, in_units=FEATURES, weight_initializer=mx.init.Zero())
    net.initialize()
    trainer = dg.DistributedTrainer(net.collect_params(), "sgd",
                                    {"learning_rate": LR, "momentum": MOMENTUM}, kv=kv,
                                    compression=compression)
    state = dg.elastic.State(net=net, trainer=trainer, epoch=0, samples=0)
    loss_fn = gluon.loss.L2Loss()

    def note(event, **fields):
        if kv.rank == 0:
            with open(os.path.join(directory, "events.jsonl"), "a") as f:
                f.write(json.dumps(dict(event=event, world=kv.num_workers, **fields)) + "\n")

    @dg.elastic.run
    def train(state):
        pids = kv.allgather_object(os.getpid())
        note("start", epoch=state.epoch, samples=state.samples, reformation=kv.reformation,
             restart=kv.restart, elastic=os.environ.get("DG_ELASTIC"),
             nnodes=int(os.environ["DG_NNODES"]), pids=pids, at=time.time(),
             residuals=kv.allgather_object(residuals(trainer)))
        sampler = dg.ShardSampler(LENGTH, kv, shuffle=False)
        steps = 0
        while True:
            sampler.set_epoch(state.epoch, skip=state.samples)
            indices = list(sampler)
            for start in range(0, len(indices), BATCH):
                batch = indices[start:start + BATCH]
                data, label = mx.nd.array(x[batch]), mx.nd.array(y[batch])
                with autograd.record():
                    loss = loss_fn(net(data).reshape(-1), label)
                loss.backward()
                trainer.step(len(batch))
                state.samples = min(LENGTH, state.samples + len(batch) * kv.num_workers)
                state.commit()
                steps += 1
                if kill_at == (kv.rank, steps) and kv.restart == 0:
                    os.kill(os.getpid(), signal.SIGKILL)
                if kv.rank == 0:
                    net.weight.data().wait_to_read()
                    with open(os.path.join(directory, "progress.json"), "w") as f:
                        json.dump({"world": kv.num_workers, "reformation": kv.reformation,
                                   "restart": kv.restart, "steps": steps,
                                   "at": time.time()}, f)
                time.sleep(PACE)
            state.epoch, state.samples = state.epoch + 1, 0
            finish = kv.broadcast_object(os.path.exists(os.path.join(directory, "finish")))
            state.commit()
            if finish:
                return

    train(state)
    weight = net.weight.data().asnumpy().ravel().tolist()
    bias = float(net.bias.data().asnumpy()[0])
    note("done", epoch=state.epoch, weight=weight, bias=bias)


if __name__ == "__main__":
    kill = sys.argv.index("--kill-rank-at") if "--kill-rank-at" in sys.argv else None
    codec = sys.argv.index("--compression") if "--compression" in sys.argv else None
    main(sys.argv[1], None if kill is None else (int(sys.argv[kill + 1]),
                                                 int(sys.argv[kill + 2])),
         None if codec is None else sys.argv[codec + 1])
