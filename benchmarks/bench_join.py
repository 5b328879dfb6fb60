"""The cost of ``dg.Join`` before any rank has left: ResNet-18 steps inside the block
against steps outside it, interleaved in rounds so that drift in the machine's load
affects both alike.

    flock /tmp/dg-heavy.lock python -m dist_gluon.launch -n 2 --backend horovod -- \\
        python benchmarks/bench_join.py --rounds 6 --steps 10

Rank 0 prints the median step time of each and the difference.
"""
import argparse
import statistics
import time

import mxnet as mx
from mxnet import autograd, gluon

import dist_gluon as dg


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6, help="rounds of each (default: 6)")
    parser.add_argument("--steps", type=int, default=10,
                        help="timed steps per round (default: 10)")
    parser.add_argument("--batch-size", type=int, default=8, help="per worker (default: 8)")
    parser.add_argument("--image", type=int, default=64, help="image side (default: 64)")
    parser.add_argument("--syncbn", action="store_true",
                        help="dg.SyncBatchNorm layers (20 announced forwards a step)")
    args = parser.parse_args()
    kv = dg.create()
    net = gluon.model_zoo.vision.resnet18_v1(classes=10)
    net.initialize(mx.init.Xavier())
    if args.syncbn:
        dg.convert_sync_batchnorm(net)      # a network with it is not hybridized
    else:
        net.hybridize(static_alloc=True, static_shape=True)
    trainer = dg.DistributedTrainer(net.collect_params(), "sgd",
                                    {"learning_rate": 0.01, "momentum": 0.9})
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    data = mx.nd.random.uniform(shape=(args.batch_size, 3, args.image, args.image))
    label = mx.nd.array([i % 10 for i in range(args.batch_size)])

    def step():
        with autograd.record():
            loss = loss_fn(net(data), label)
        loss.backward()
        trainer.step(args.batch_size)

    def timed_round() -> list[float]:
        times = []
        for _ in range(args.steps):
            start = time.perf_counter()
            step()
            mx.nd.waitall()
            times.append(time.perf_counter() - start)
        return times

    for _ in range(3):          # warm-up
        step()
    mx.nd.waitall()
    plain, joined = [], []
    for _ in range(args.rounds):
        plain += timed_round()
        with dg.Join(trainer):
            joined += timed_round()
    if kv.rank == 0:
        a, b = statistics.median(plain) * 1e3, statistics.median(joined) * 1e3
        model = "ResNet-18 (SyncBatchNorm)" if args.syncbn else "ResNet-18"
        print(f"{model}, {kv.num_workers} workers on {kv.type}, batch {args.batch_size} "
              f"of {args.image}x{args.image}: median step {a:.1f} ms without dg.Join, "
              f"{b:.1f} ms inside it ({(b - a) / a * 100:+.1f}%), "
              f"{len(plain)} steps each", flush=True)


if __name__ == "__main__":
    main()
