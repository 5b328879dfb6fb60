"""Worker: training step time of a word-level LSTM language model whose embedding has
row_sparse gradients, per trainer, on synthetic token streams.

Run by ``benchmarks/run_cluster.py`` (part 4) on every host of an emulated cluster. The
model is sized like a small translation or language model (vocabulary ``--vocab``,
embedding and 2 LSTM layers of ``--dim``, a Dense decoder over the vocabulary: the
embedding and the decoder hold most of the parameters). Each worker feeds batches of
``--batch`` sequences of ``--bptt`` tokens drawn with a Zipf law, as words are, so a
batch touches a small part of the vocabulary. Trainers (``--impls``):

- ``sparse``: ``dg.DistributedTrainer`` with the embedding's row_sparse gradients;
- ``dense``: the same model built with ``sparse_grad=False`` (the whole embedding
  gradient travels);
- ``gluon``: ``gluon.Trainer(kvstore='dist_sync')`` on the sparse model: MXNet's own
  path (push of the row_sparse gradient, updates on the servers) (ps-lite jobs);
- ``compute``: the sparse model with no communication.

Prints one ``BENCH {json}`` line on rank 0 with the step times and the elements each
DistributedTrainer gives the backend's sums per step.
"""
from __future__ import annotations

import argparse
import time

import mxnet as mx
import numpy as np
from _common import launcher_backend, report, summarise
from mxnet import autograd, gluon

IMPLS = ("sparse", "dense", "gluon", "compute")


class LanguageModel(gluon.HybridBlock):
    def __init__(self, vocab: int, dim: int, sparse: bool, **kwargs):
        super().__init__(**kwargs)
        with self.name_scope():
            self.embedding = gluon.nn.Embedding(vocab, dim, sparse_grad=sparse)
            self.lstm = gluon.rnn.LSTM(dim, num_layers=2, layout="NTC", input_size=dim)
            self.decoder = gluon.nn.Dense(vocab, flatten=False, in_units=dim)

    def hybrid_forward(self, F, tokens):
        return self.decoder(self.lstm(self.embedding(tokens)))


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--impls", required=True, help="comma-separated, from " +
                        ", ".join(IMPLS))
    parser.add_argument("--vocab", type=int, default=50000, help="vocabulary size")
    parser.add_argument("--dim", type=int, default=256, help="embedding and LSTM size")
    parser.add_argument("--batch", type=int, default=8, help="sequences per worker")
    parser.add_argument("--bptt", type=int, default=20, help="tokens per sequence")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps per trainer")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per trainer")
    args = parser.parse_args()
    args.impls = args.impls.split(",")
    return args


def main():
    args = parse_args()
    rng = np.random.RandomState(int(time.time()) % 1000)
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    nets, steps, wire = {}, {}, {}
    kv = None
    for impl in args.impls:
        net = LanguageModel(args.vocab, args.dim, sparse=impl != "dense")
        mx.random.seed(0)
        net.initialize(mx.init.Uniform(0.05))
        nets[impl] = net
        if impl in ("sparse", "dense"):
            import dist_gluon as dg

            kv = dg.create()
            trainer = dg.DistributedTrainer(net.collect_params(), "sgd",
                                            {"learning_rate": 0.1}, kv=kv, prefix=impl)
        elif impl == "gluon":
            trainer = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.1},
                                    kvstore="dist_sync")
        else:
            trainer = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.1},
                                    kvstore=None)
        steps[impl] = trainer
    if kv is not None:
        pushpull = kv.pushpull
        current = {"impl": None}

        def counted(key, value, out=None, priority=0):
            for v in value if isinstance(value, list) else [value]:
                wire[current["impl"]] = wire.get(current["impl"], 0) + v.size
            return pushpull(key, value, out=out, priority=priority)

        kv.pushpull = counted
    else:
        current = {"impl": None}

    def batch():
        tokens = np.minimum(rng.zipf(1.2, (args.batch, args.bptt)), args.vocab) - 1
        return mx.nd.array(tokens), mx.nd.array(rng.randint(0, args.vocab,
                                                            (args.batch, args.bptt)))

    def run(impl, count):
        mx.nd.waitall()
        t0 = time.perf_counter()
        for _ in range(count):
            x, y = batch()
            with autograd.record():
                loss = loss_fn(nets[impl](x), y)
            loss.backward()
            current["impl"] = impl
            steps[impl].step(args.batch * args.bptt)
            current["impl"] = None
        mx.nd.waitall()
        return (time.perf_counter() - t0) / count

    times = {}
    for impl in args.impls:
        run(impl, args.warmup)
        sent = dict(wire)
        times[impl] = [run(impl, 1) for _ in range(args.steps)]
        if impl in wire:
            wire[impl] = (wire[impl] - sent.get(impl, 0)) / args.steps
    params = nets[args.impls[0]].collect_params().values()
    report({"kind": "lm", "backend": launcher_backend(), "vocab": args.vocab,
            "dim": args.dim, "batch": args.batch, "bptt": args.bptt,
            "parameters": int(sum(p.data().size for p in params)),
            "embedding": args.vocab * args.dim,
            "wire_elements": {k: v for k, v in wire.items() if k},
            "times": {impl: summarise(t) for impl, t in times.items()}})


if __name__ == "__main__":
    main()
