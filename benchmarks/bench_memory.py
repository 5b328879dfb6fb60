"""Memory of a worker with and without ``shard_optimizer_states`` (run by run.py's
``memory`` part through dist_gluon.launch): Adam on a BERT-base-sized model or on
ResNet-50, a few steps; rank 0 prints one ``BENCH`` line with every rank's peak
resident memory, optimizer-state bytes and the median step time.

    python -m dist_gluon.launch -n 4 --backend horovod -- \\
        python benchmarks/bench_memory.py --model bert --shard 1

The BERT-base-sized model has BERT-base's parameter shapes (a 30522 x 768 embedding
and 12 layers of 768 -> 2304 -> 768 attention projections and a 768 -> 3072 -> 768
feed-forward, with LayerNorms: 109 M parameters) on a plain feed-forward path, since no
attention block ships with MXNet 1.9's Gluon; the optimizer's memory depends on the
shapes only.
"""
from __future__ import annotations

import argparse
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import report, summarise  # noqa: E402


def bert_sized(gluon):
    class Layer(gluon.HybridBlock):
        def __init__(self):
            super().__init__()
            self.qkv = gluon.nn.Dense(2304, in_units=768, flatten=False)
            self.out = gluon.nn.Dense(768, in_units=2304 // 3, flatten=False)
            self.norm1 = gluon.nn.LayerNorm(in_channels=768)
            self.ffn1 = gluon.nn.Dense(3072, in_units=768, activation="relu", flatten=False)
            self.ffn2 = gluon.nn.Dense(768, in_units=3072, flatten=False)
            self.norm2 = gluon.nn.LayerNorm(in_channels=768)

        def hybrid_forward(self, F, x):
            q = F.slice_axis(self.qkv(x), axis=-1, begin=0, end=768)
            x = self.norm1(x + self.out(q))
            return self.norm2(x + self.ffn2(self.ffn1(x)))

    class Model(gluon.HybridBlock):
        def __init__(self):
            super().__init__()
            self.embed = gluon.nn.Embedding(30522, 768)
            self.layers = gluon.nn.HybridSequential()
            for _ in range(12):
                self.layers.add(Layer())
            self.head = gluon.nn.Dense(2, in_units=768)

        def hybrid_forward(self, F, tokens):
            return self.head(F.mean(self.layers(self.embed(tokens)), axis=1))

    return Model()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("bert", "resnet50"), default="bert")
    parser.add_argument("--shard", type=int, default=1, help="1: shard_optimizer_states")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()

    import mxnet as mx
    import numpy as np
    from mxnet import autograd, gluon

    import dist_gluon as dg

    kv = dg.create()
    mx.random.seed(0)
    if args.model == "bert":
        net = bert_sized(gluon)
        data = mx.nd.array(np.random.RandomState(kv.rank).randint(0, 30522, (1, 8)))
    else:
        net = gluon.model_zoo.vision.resnet50_v1(classes=1000)
        data = mx.nd.random.uniform(shape=(2, 3, 64, 64))
    label = mx.nd.array([1] * data.shape[0])
    net.initialize(mx.init.Xavier())
    net.hybridize(static_alloc=True, static_shape=True)
    net(data)
    trainer = dg.DistributedTrainer(net.collect_params(), "adam", {"learning_rate": 1e-4},
                                    kv=kv, shard_optimizer_states=bool(args.shard))
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    times = []
    for step in range(args.warmup + args.steps):
        mx.nd.waitall()
        start = time.perf_counter()
        with autograd.record():
            loss = loss_fn(net(data), label)
        loss.backward()
        trainer.step(data.shape[0])
        mx.nd.waitall()
        if step >= args.warmup:
            times.append(time.perf_counter() - start)
    states = trainer._updaters[0].states
    state_bytes = sum(leaf.size * np.dtype(leaf.dtype).itemsize
                      for state in states.values()
                      for leaf in dg.broadcast.optimizer_state_arrays(state))
    params = sum(p.data().size for p in net.collect_params().values())
    mine = {"peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "state_bytes": state_bytes, "step": summarise(times)["median"]}
    every = kv.allgather_object(mine)
    report({"model": args.model, "shard": bool(args.shard), "workers": kv.num_workers,
            "backend": kv.type, "parameters": params, "ranks": every})


if __name__ == "__main__":
    main()
