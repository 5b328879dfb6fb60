"""A digit classifier on MXNet's Module API written against Horovod's MXNet API, the way
a Horovod user's Module script is written, with the import line pointing at dist_gluon.

It is our own script in the style of the peers' examples (CI also runs Horovod's real
example). It runs on one process or on any backend::

    python -m dist_gluon.launch -n 2 --backend p3 -- \\
        python tests/workers/hvd_style_mnist.py

What it uses of Horovod: init, size, rank, local_rank, broadcast_parameters of the
Module's arg_params and aux_params dicts (then set_params), DistributedOptimizer
installed with ``Module.fit(kvstore=None)``, and allreduce (summed and averaged) for
the metrics of all workers. Each worker trains on its own slice of the training images
and scores its own slice of the validation images; the accuracy printed is that of all
workers together, and the script fails when it ends below ``--min-accuracy``.
"""
import argparse
import sys
import time
from pathlib import Path

import mxnet as mx
import numpy as np

import dist_gluon.compat.horovod as hvd

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples" / "mnist"))
from digits import load_digits  # noqa: E402

# the training images' pixel mean and standard deviation (scaled to 0..1)
PIXEL_MEAN, PIXEL_STD = 0.225, 0.35


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-size", type=int, default=32,
                        help="images per step on each worker (default: 32)")
    parser.add_argument("--epochs", type=int, default=10,
                        help="passes over each worker's slice of the data (default: 10)")
    parser.add_argument("--lr", type=float, default=0.05,
                        help="SGD learning rate of the first epoch (default: 0.05)")
    parser.add_argument("--lr-decay", type=float, default=0.8,
                        help="the learning rate is multiplied by this after every epoch "
                             "(default: 0.8)")
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


def worker_slice(images, labels, rank, size):
    """This worker's share as flat standardised rows: every size-th sample from the
    rank-th, the same number on every worker (the few left over are dropped), so that
    all workers take the same number of steps."""
    count = len(labels) // size
    picked = slice(rank, rank + count * size, size)
    x = images[picked].reshape(count, -1).astype(np.float32) / 255.0
    return (x - PIXEL_MEAN) / PIXEL_STD, labels[picked].astype(np.float32)


def mlp_symbol():
    """Three hidden layers of rectified units and a softmax over the ten digits."""
    net = mx.sym.Variable("data")
    for i, width in enumerate((256, 128, 64)):
        net = mx.sym.FullyConnected(net, num_hidden=width, name=f"fc{i + 1}")
        net = mx.sym.Activation(net, act_type="relu", name=f"relu{i + 1}")
    net = mx.sym.FullyConnected(net, num_hidden=10, name="fc4")
    return mx.sym.SoftmaxOutput(net, name="softmax")


def all_workers_accuracy(metric, name):
    """Accuracy of every worker's samples together: (correct, seen) summed by allreduce."""
    counts = mx.nd.array([metric.sum_metric, metric.num_inst], dtype="float64")
    correct, seen = hvd.allreduce(counts, name=name, op=hvd.Sum).asnumpy()
    return correct / seen


def main():
    args = parse_args()
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    ctx = mx.cpu(hvd.local_rank())

    train_x, train_y, val_x, val_y = load_digits(args.val_fraction, seed=0)
    train_x, train_y = worker_slice(train_x, train_y, rank, size)
    val_x, val_y = worker_slice(val_x, val_y, rank, size)
    train_iter = mx.io.NDArrayIter(train_x, train_y, args.batch_size, shuffle=True)
    # the whole slice in one batch: no padded samples in the scores
    val_iter = mx.io.NDArrayIter(val_x, val_y, len(val_y))
    if rank == 0:
        print(f"{size} workers, {len(train_y)} training and {len(val_y)} validation images "
              "each", flush=True)

    mod = mx.mod.Module(mlp_symbol(), context=ctx)
    mod.bind(data_shapes=train_iter.provide_data, label_shapes=train_iter.provide_label)
    mod.init_params(mx.init.Xavier(magnitude=2.0))
    arg_params, aux_params = mod.get_params()
    hvd.broadcast_parameters(arg_params, root_rank=0)
    hvd.broadcast_parameters(aux_params, root_rank=0)
    mod.set_params(arg_params, aux_params)

    steps_per_epoch = (len(train_y) + args.batch_size - 1) // args.batch_size
    schedule = mx.lr_scheduler.FactorScheduler(step=steps_per_epoch, factor=args.lr_decay,
                                               base_lr=args.lr)
    # gradients are summed over the workers and divided by size() in DistributedOptimizer
    sgd = mx.optimizer.create("sgd", learning_rate=args.lr, momentum=args.momentum,
                              wd=args.wd, rescale_grad=1.0 / args.batch_size,
                              lr_scheduler=schedule)
    opt = hvd.DistributedOptimizer(sgd)

    epoch_started = [time.time()]

    def report_epoch(params):
        # called on every worker after each epoch's validation: the allreduce pairs up
        val_accuracy = all_workers_accuracy(params.eval_metric, "epoch_val")
        seconds = hvd.allreduce(mx.nd.array([time.time() - epoch_started[0]]),
                                name="epoch_seconds").asscalar()
        if rank == 0:
            print(f"epoch {params.epoch + 1}/{args.epochs}: validation accuracy "
                  f"{val_accuracy:.4f} ({seconds:.1f} s, the workers' mean)", flush=True)
        epoch_started[0] = time.time()

    mod.fit(train_iter, eval_data=val_iter, eval_metric="acc", kvstore=None,
            optimizer=opt, num_epoch=args.epochs, eval_end_callback=report_epoch)

    metric = mx.metric.Accuracy()
    mod.score(val_iter, metric)
    val_accuracy = all_workers_accuracy(metric, "final_val")
    if rank == 0:
        print(f"final validation accuracy {val_accuracy:.4f}", flush=True)
    if val_accuracy < args.min_accuracy:
        raise SystemExit(f"validation accuracy {val_accuracy:.4f} is below --min-accuracy "
                         f"{args.min_accuracy}")


if __name__ == "__main__":
    main()
