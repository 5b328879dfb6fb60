"""A Gluon digit classifier written against BytePS's MXNet API, the way a BytePS user's
training script is written: ``import byteps.mxnet as bps`` and nothing of dist_gluon.

It is our own script in the style of the peers' examples (CI also runs BytePS's real
example). With the launcher's ``--compat byteps`` the import finds dist_gluon's BytePS
API, so the same file runs on every backend::

    python -m dist_gluon.launch -n 2 --backend dist_sync --compat byteps -- \\
        python tests/workers/byteps_style_mnist.py

What it uses of BytePS: init, size, rank, local_rank, broadcast_parameters of a dict of
the network's parameters, DistributedTrainer, and byteps_declare_tensor with
byteps_push_pull (summed and averaged) for the metrics of all workers. Each worker
trains on its own slice of the training images and scores its own slice of the
validation images; the accuracy printed is that of all workers together, and the script
fails when it ends below ``--min-accuracy``.
"""
import argparse
import sys
import time
from pathlib import Path

import byteps.mxnet as bps
import mxnet as mx
import numpy as np
from mxnet import autograd, gluon

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples" / "mnist"))
from digits import load_digits  # noqa: E402


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-size", type=int, default=32,
                        help="images per step on each worker (default: 32)")
    parser.add_argument("--epochs", type=int, default=5,
                        help="passes over each worker's slice of the data (default: 5)")
    parser.add_argument("--lr", type=float, default=0.03,
                        help="SGD learning rate of the first epoch (default: 0.03)")
    parser.add_argument("--lr-decay", type=float, default=0.6,
                        help="the learning rate is multiplied by this after every epoch "
                             "(default: 0.6)")
    parser.add_argument("--momentum", type=float, default=0.9,
                        help="SGD momentum (default: 0.9)")
    parser.add_argument("--wd", type=float, default=1e-4,
                        help="weight decay (default: 1e-4)")
    parser.add_argument("--val-fraction", type=float, default=0.2,
                        help="share of the digits kept for validation (default: 0.2)")
    parser.add_argument("--min-accuracy", type=float, default=0.96,
                        help="fail when the final validation accuracy is below this "
                             "(default: 0.96)")
    args = parser.parse_args()
    if args.batch_size < 1 or args.epochs < 1:
        parser.error("--batch-size and --epochs must be at least 1")
    if not 0 < args.val_fraction < 1:
        parser.error("--val-fraction must lie between 0 and 1")
    return args


# the training images' pixel mean and standard deviation (scaled to 0..1)
PIXEL_MEAN, PIXEL_STD = 0.225, 0.35


def worker_slice(images, labels, rank, size):
    """This worker's share, standardised: every size-th sample from the rank-th, the same
    number on every worker (the few left over are dropped), so that all workers take the
    same number of steps."""
    count = len(labels) // size
    picked = slice(rank, rank + count * size, size)
    x = (images[picked].astype(np.float32)[:, None, :, :] / 255.0 - PIXEL_MEAN) / PIXEL_STD
    return x, labels[picked].astype(np.float32)


def lenet():
    """Two convolutions and two dense layers, every input size given so that the
    parameters have their shapes before the broadcast."""
    net = gluon.nn.HybridSequential()
    with net.name_scope():
        net.add(gluon.nn.Conv2D(20, kernel_size=5, in_channels=1, activation="relu"),
                gluon.nn.MaxPool2D(pool_size=2, strides=2),
                gluon.nn.Conv2D(50, kernel_size=5, in_channels=20, activation="relu"),
                gluon.nn.MaxPool2D(pool_size=2, strides=2),
                gluon.nn.Flatten(),
                gluon.nn.Dense(256, in_units=50 * 4 * 4, activation="relu"),
                gluon.nn.Dense(10, in_units=256))
    return net


class Totals:
    """Sums over all workers through byteps_push_pull, one declared tensor per name."""

    def __init__(self, *names):
        for name in names:
            bps.byteps_declare_tensor(name)

    @staticmethod
    def sum(name, values):
        tensor = mx.nd.array(values, dtype="float64")
        bps.byteps_push_pull(tensor, name=name, is_average=False)
        return tensor.asnumpy()

    @staticmethod
    def mean(name, value):
        tensor = mx.nd.array([value], dtype="float64")
        bps.byteps_push_pull(tensor, name=name, is_average=True)
        return float(tensor.asnumpy()[0])


def evaluate(net, loader, ctx, totals):
    """Accuracy over every worker's validation slice: (correct, seen) summed."""
    correct = seen = 0
    for data, label in loader:
        predicted = net(data.as_in_context(ctx)).argmax(axis=1)
        correct += int((predicted == label.as_in_context(ctx)).sum().asscalar())
        seen += label.shape[0]
    correct, seen = totals.sum("val_counts", [correct, seen])
    return correct / seen


def main():
    args = parse_args()
    bps.init()
    rank, size = bps.rank(), bps.size()
    ctx = mx.cpu(bps.local_rank())

    train_x, train_y, val_x, val_y = load_digits(args.val_fraction, seed=0)
    train = gluon.data.ArrayDataset(*worker_slice(train_x, train_y, rank, size))
    val = gluon.data.ArrayDataset(*worker_slice(val_x, val_y, rank, size))
    train_loader = gluon.data.DataLoader(train, batch_size=args.batch_size, shuffle=True)
    val_loader = gluon.data.DataLoader(val, batch_size=256)
    if rank == 0:
        print(f"{size} workers, {len(train)} training and {len(val)} validation images "
              "each", flush=True)

    net = lenet()
    net.initialize(mx.init.Xavier(magnitude=2.0), ctx=ctx)
    net.hybridize()
    params = net.collect_params()
    # BytePS takes a plain dict here (a ParameterDict is for its DistributedTrainer)
    bps.broadcast_parameters({name: param for name, param in params.items()}, root_rank=0)

    trainer = bps.DistributedTrainer(params, "sgd", {"learning_rate": args.lr,
                                                     "momentum": args.momentum,
                                                     "wd": args.wd})
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    totals = Totals("train_counts", "train_loss", "val_counts")

    for epoch in range(args.epochs):
        started = time.time()
        trainer.set_learning_rate(args.lr * args.lr_decay ** epoch)
        loss_sum = correct = seen = 0.0
        for data, label in train_loader:
            data, label = data.as_in_context(ctx), label.as_in_context(ctx)
            with autograd.record():
                output = net(data)
                loss = loss_fn(output, label)
            loss.backward()
            trainer.step(data.shape[0])
            loss_sum += loss.sum().asscalar()
            correct += (output.argmax(axis=1) == label).sum().asscalar()
            seen += data.shape[0]
        mean_loss = totals.mean("train_loss", loss_sum / seen)
        correct, seen = totals.sum("train_counts", [correct, seen])
        val_accuracy = evaluate(net, val_loader, ctx, totals)
        if rank == 0:
            print(f"epoch {epoch + 1}/{args.epochs}: loss {mean_loss:.4f}, training "
                  f"accuracy {correct / seen:.4f}, validation accuracy {val_accuracy:.4f} "
                  f"({time.time() - started:.1f} s)", flush=True)

    if rank == 0:
        print(f"final validation accuracy {val_accuracy:.4f}", flush=True)
    if val_accuracy < args.min_accuracy:
        raise SystemExit(f"validation accuracy {val_accuracy:.4f} is below --min-accuracy "
                         f"{args.min_accuracy}")


if __name__ == "__main__":
    main()
