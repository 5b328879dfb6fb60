"""Train a LeNet on handwritten digits with MXNet's Module API, on one process or N workers.

The same script runs alone or under any dist_gluon backend:

    python examples/mnist/train_module.py
    python -m dist_gluon.launch -n 2 --backend dist_sync -- \\
        python examples/mnist/train_module.py

Data: ``--data-dir`` holding the four standard MNIST files (train-images-idx3-ubyte,
train-labels-idx1-ubyte, t10k-images-idx3-ubyte, t10k-labels-idx1-ubyte, gzipped or
not). Without it, the 1,797 handwritten digits bundled with scikit-learn (copied
beside this script in digits.npz; 8x8 pixels, scaled to 28x28) are split into a
training and a validation set, so nothing is downloaded.

What makes it distributed (everything else is a plain ``mod.fit``):
- each worker iterates over its own share of the data (``dg.ShardSampler`` picks it);
- every worker starts from rank 0's parameters (``dg.broadcast_parameters``);
- ``dg.DistributedOptimizer`` averages the gradients over the workers before each
  update, installed with ``mod.fit(..., kvstore=None, optimizer=opt)``;
- the learning rate grows with the number of workers, after a linear warmup;
- the validation accuracy is that of one process evaluating the whole validation set:
  each worker evaluates its share without padding and ``dg.reduce_metric`` sums;
- ``--no-pad``: each worker reads whole parts of the training set (``--files``), not
  padded, so the workers hold different numbers of batches, and each epoch's
  ``mod.fit`` runs inside ``with dg.Join(opt):`` (docs/uneven-inputs.md); the summary's
  ``replicas=equal`` says every worker ends with the same weights.
"""
from __future__ import annotations

import argparse
import gzip
import hashlib
import os
import time
import warnings

import mxnet as mx
import numpy as np
from digits import load_digits  # examples/mnist/digits.py, beside this script

import dist_gluon as dg

MNIST_FILES = {"train_images": "train-images-idx3-ubyte", "train_labels": "train-labels-idx1-ubyte",
               "val_images": "t10k-images-idx3-ubyte", "val_labels": "t10k-labels-idx1-ubyte"}
# Mean and standard deviation of MNIST pixels in [0, 1].
MEAN, STD = 0.1307, 0.3081


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Train a LeNet on MNIST (or scikit-learn's digits) with the Module API "
                    "and dist_gluon.",
        epilog="example: python -m dist_gluon.launch -n 2 --backend dist_sync -- "
               "python examples/mnist/train_module.py")
    parser.add_argument("--data-dir", default=None,
                        help="directory with the four standard MNIST files (.gz or not); "
                             "default: the handwritten digits bundled with scikit-learn")
    parser.add_argument("--epochs", type=int, default=12, help="training epochs (default: 12)")
    parser.add_argument("--batch-size", type=int, default=32,
                        help="batch size of each worker (default: 32)")
    parser.add_argument("--lr", type=float, default=None,
                        help="learning rate of one worker; N workers use N times this "
                             "(default: 0.02, or 0.04 with --compression 2bit, which runs "
                             "without momentum)")
    parser.add_argument("--compression", default="none",
                        choices=("none", "fp16", "2bit", "powersgd"),
                        help="gradient compression: none, fp16, 2bit (MXNet's, threshold 0.5) "
                             "or powersgd (rank 4) (default: none)")
    parser.add_argument("--warmup-epochs", type=float, default=1.0,
                        help="epochs of linear warmup from --lr to the scaled rate "
                             "(default: 1)")
    parser.add_argument("--momentum", type=float, default=None,
                        help="SGD momentum (default: 0.9, or 0 with --compression 2bit: its "
                             "error feedback already carries past gradients forward, and "
                             "momentum on top of it overshoots)")
    parser.add_argument("--wd", type=float, default=1e-4, help="weight decay (default: 1e-4)")
    parser.add_argument("--val-fraction", type=float, default=0.2,
                        help="share of the bundled digits held out for validation "
                             "(default: 0.2; ignored with --data-dir)")
    parser.add_argument("--seed", type=int, default=42,
                        help="seed of the shuffling and the initial weights (default: 42)")
    parser.add_argument("--log-interval", type=int, default=10,
                        help="print progress every this many batches (default: 10)")
    parser.add_argument("--no-pad", action="store_true",
                        help="no padding: each worker reads whole parts of the training "
                             "set (--files), so the workers hold different numbers of "
                             "batches, and each epoch's fit runs inside dg.Join")
    parser.add_argument("--files", type=int, default=3, metavar="K",
                        help="with --no-pad: the training set as K equal parts, worker r "
                             "reading parts r, r + N, ... (default: 3)")
    args = parser.parse_args(argv)
    two_bit = args.compression == "2bit"
    if args.lr is None:
        args.lr = 0.04 if two_bit else 0.02
    if args.momentum is None:
        args.momentum = 0.0 if two_bit else 0.9
    if args.epochs < 1 or args.batch_size < 1 or args.log_interval < 1:
        parser.error("--epochs, --batch-size and --log-interval must be at least 1")
    if args.files < 1:
        parser.error("--files must be at least 1")
    if not 0 < args.val_fraction < 1:
        parser.error(f"--val-fraction must be in (0, 1), got {args.val_fraction}")
    return args


def read_idx(path: str) -> np.ndarray:
    """An MNIST idx file (gzipped or not) as a uint8 array."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as f:
        raw = f.read()
    dims = raw[3]
    shape = tuple(int.from_bytes(raw[4 + 4 * i:8 + 4 * i], "big") for i in range(dims))
    return np.frombuffer(raw, np.uint8, offset=4 + 4 * dims).reshape(shape)


def load_mnist(data_dir: str):
    arrays = {}
    for key, name in MNIST_FILES.items():
        path = next((p for p in (os.path.join(data_dir, name), os.path.join(data_dir, name + ".gz"))
                     if os.path.isfile(p)), None)
        if path is None:
            raise SystemExit(f"--data-dir {data_dir!r} lacks {name} (or {name}.gz); put the "
                             "four standard MNIST files there, or leave out --data-dir to "
                             "train on the digits bundled with scikit-learn")
        arrays[key] = read_idx(path)
    return (arrays["train_images"], arrays["train_labels"].astype(np.int32),
            arrays["val_images"], arrays["val_labels"].astype(np.int32))


def to_input(images: np.ndarray) -> np.ndarray:
    """uint8 (N, 28, 28) images -> normalised float32 (N, 1, 28, 28)."""
    return ((images.astype(np.float32) / 255 - MEAN) / STD)[:, None]


def lenet() -> mx.sym.Symbol:
    data = mx.sym.var("data")
    net = mx.sym.Convolution(data, kernel=(5, 5), num_filter=20, name="conv1")
    net = mx.sym.Activation(net, act_type="relu")
    net = mx.sym.Pooling(net, pool_type="max", kernel=(2, 2), stride=(2, 2))
    net = mx.sym.Convolution(net, kernel=(5, 5), num_filter=50, name="conv2")
    net = mx.sym.Activation(net, act_type="relu")
    net = mx.sym.Pooling(net, pool_type="max", kernel=(2, 2), stride=(2, 2))
    net = mx.sym.FullyConnected(mx.sym.flatten(net), num_hidden=500, name="fc1")
    net = mx.sym.Activation(net, act_type="relu")
    net = mx.sym.FullyConnected(net, num_hidden=10, name="fc2")
    return mx.sym.SoftmaxOutput(net, name="softmax")


def file_parts(length: int, files: int, workers: int) -> list[np.ndarray]:
    """Each worker's indices when the data set is stored as ``files`` equal contiguous
    parts and worker r reads parts r, r + workers, ... whole: no padding, so the
    workers hold different numbers of samples when ``files`` is not a multiple of them."""
    bounds = np.linspace(0, length, files + 1).astype(int)
    return [np.concatenate([np.arange(bounds[f], bounds[f + 1])
                            for f in range(r, files, workers)] or [[]]).astype(int)
            for r in range(workers)]


def evaluate(mod, val_iter, kv) -> float:
    """Accuracy over the whole validation set, the same on every worker."""
    metric = mx.metric.Accuracy()
    if val_iter is not None:
        val_iter.reset()
        for batch in val_iter:
            mod.forward(batch, is_train=False)
            keep = batch.data[0].shape[0] - batch.pad  # the iterator pads the last batch
            metric.update([batch.label[0][:keep]], [mod.get_outputs()[0][:keep]])
    return dg.reduce_metric(metric, kv=kv).get()[1]


def main(argv=None) -> None:
    args = parse_args(argv)
    started = time.time()
    kv = dg.create()
    workers = kv.num_workers

    def log(message: str) -> None:
        if kv.rank == 0:
            print(message, flush=True)

    if args.data_dir:
        train_x, train_y, val_x, val_y = load_mnist(args.data_dir)
        log(f"data: MNIST from {args.data_dir}")
    else:
        train_x, train_y, val_x, val_y = load_digits(args.val_fraction, args.seed)
        log("data: no --data-dir given, using the handwritten digits bundled with "
            "scikit-learn (copied in examples/mnist/digits.npz; 8x8 scaled to 28x28); nothing "
            "is downloaded")
    log(f"data: {len(train_y)} training and {len(val_y)} validation images; "
        f"backend {kv.type}, {workers} worker(s), batch {args.batch_size} per worker")

    # Every worker gets a share of the same size, hence the same number of batches; the
    # iterator reshuffles its share every epoch. The validation share has no padding.
    np.random.seed(args.seed + kv.rank)
    if args.no_pad:
        shares = file_parts(len(train_y), args.files, workers)
        share = shares[kv.rank]
        # an epoch has the steps of the worker with the most batches, which the others
        # take part in with zero samples once they have run out
        batches = [-(-len(s) // args.batch_size) for s in shares]
        log(f"data: no padding, the training set in {args.files} parts; the workers hold "
            f"{', '.join(map(str, batches))} batches (dg.Join)")
    else:
        share = dg.ShardSampler(len(train_y), kv=kv, seed=args.seed).indices()
    train_iter = mx.io.NDArrayIter(to_input(train_x[share]), train_y[share], args.batch_size,
                                   shuffle=True, label_name="softmax_label")
    val_sampler = dg.ShardSampler(len(val_y), kv=kv, shuffle=False)
    val_share = val_sampler.indices()[:len(val_sampler) - val_sampler.num_padded]
    val_iter = mx.io.NDArrayIter(to_input(val_x[val_share]), val_y[val_share], args.batch_size,
                                 label_name="softmax_label") if len(val_share) else None

    mod = mx.mod.Module(lenet(), context=mx.cpu())
    mod.bind(data_shapes=train_iter.provide_data, label_shapes=train_iter.provide_label)
    mx.random.seed(args.seed)
    mod.init_params(mx.init.Xavier(magnitude=2.24))
    arg_params, aux_params = mod.get_params()
    dg.broadcast_parameters(arg_params, kv=kv)
    dg.broadcast_parameters(aux_params, kv=kv)

    # N workers train on N times the batch, so they take N times the step (Goyal et al.,
    # 2017), reached by a linear warmup from the one-worker rate, then a cosine decay.
    steps_per_epoch = max(batches) if args.no_pad else -(-len(share) // args.batch_size)
    total_steps = args.epochs * steps_per_epoch
    warmup_steps = min(int(args.warmup_epochs * steps_per_epoch), total_steps - 1)
    lr = args.lr * workers
    schedule = mx.lr_scheduler.CosineScheduler(
        max_update=total_steps, base_lr=lr, final_lr=lr * 0.01,
        warmup_steps=warmup_steps, warmup_begin_lr=args.lr)
    # rescale_grad = 1 / per-worker batch, as Module sets it for one process: the
    # DistributedOptimizer averages over the workers.
    opt = dg.DistributedOptimizer(
        mx.optimizer.SGD(learning_rate=lr, momentum=args.momentum, wd=args.wd,
                         lr_scheduler=schedule, rescale_grad=1.0 / args.batch_size), kv=kv,
        compression=args.compression)
    log(f"lr: {args.lr} x {workers} worker(s) = {lr:g}, momentum {args.momentum:g}, "
        f"compression {args.compression}, {warmup_steps} warmup steps, "
        f"cosine decay over {total_steps} steps")

    history = []
    epoch_tic = [time.time()]

    def progress(params: mx.model.BatchEndParam) -> None:
        batch = params.nbatch + 1
        if batch % args.log_interval == 0 or batch == steps_per_epoch:
            name, value = params.eval_metric.get()
            log(f"epoch {params.epoch + 1}/{args.epochs} [{batch:>3}/{steps_per_epoch}] "
                f"{name} {value:.4f} lr {opt.learning_rate:.4f}")

    def validate(epoch: int, symbol, arg, aux) -> None:
        elapsed = time.time() - epoch_tic[0]
        val_acc = evaluate(mod, val_iter, kv)
        samples = len(train_y) if args.no_pad else steps_per_epoch * args.batch_size * workers
        speed = samples / elapsed
        history.append({"epoch": epoch + 1, "val_acc": val_acc, "time": elapsed,
                        "samples": samples})
        log(f"epoch {epoch + 1}/{args.epochs}: val_acc={val_acc:.4f} time={elapsed:.1f}s "
            f"samples/s={speed:.0f}")
        epoch_tic[0] = time.time()

    # fit() binds and initialises the module again; forced to, it takes rank 0's values
    # (instead of warning that it is already bound and initialised).
    if not args.no_pad:
        mod.fit(train_iter, num_epoch=args.epochs, kvstore=None, optimizer=opt,
                arg_params=arg_params, aux_params=aux_params, force_rebind=True,
                force_init=True, eval_metric="acc", batch_end_callback=progress,
                epoch_end_callback=validate)
    else:
        # one fit per epoch inside dg.Join: the worker that runs out of batches first
        # takes part in the others' remaining updates; the validation (a collective the
        # block cannot shadow) runs after the block
        warnings.filterwarnings("ignore", "Parameters already initialized")
        for epoch in range(args.epochs):
            with dg.Join(opt):
                mod.fit(train_iter, begin_epoch=epoch, num_epoch=epoch + 1, kvstore=None,
                        optimizer=opt, arg_params=arg_params, aux_params=aux_params,
                        force_rebind=epoch == 0, force_init=epoch == 0, eval_metric="acc",
                        batch_end_callback=progress)
            validate(epoch, None, None, None)

    # every worker's digest of its weights: the same everywhere, or the replicas drifted
    digest = hashlib.sha256()
    for name, value in sorted(mod.get_params()[0].items()):
        digest.update(name.encode() + value.asnumpy().tobytes())
    replicas = "equal" if len(set(kv.allgather_object(digest.hexdigest()))) == 1 else "differ"

    final = history[-1]
    speed = sum(h["samples"] for h in history) / sum(h["time"] for h in history)
    log(f"summary: val_acc={final['val_acc']:.4f} epochs={final['epoch']} backend={kv.type} "
        f"workers={workers} replicas={replicas} samples/s={speed:.0f} "
        f"time={time.time() - started:.1f}s")


if __name__ == "__main__":
    main()
