"""BytePS's gradient-compression MNIST example (example/mxnet/train_gluon_mnist_byteps_gc.py
in BytePS) as a BytePS user runs it, on dist_gluon: the same flags and defaults, the
same network, optimizer, ``compression_params`` and accuracy check, with two changes:
the images are the embedded digits (examples/mnist/digits.py; nothing is downloaded)
and it runs on the CPU (no nvidia-smi). ``import byteps.mxnet as bps`` finds
dist_gluon's BytePS API through the launcher's ``--compat byteps``::

    python -m dist_gluon.launch -n 2 --backend dist_sync --compat byteps -- \\
        python tests/workers/byteps_gc_mnist.py --compressor onebit --ef vanilla \\
        --compress-momentum nesterov --scaling

As in the original, every worker trains on the whole training set in its own shuffled
order and scores the whole validation set; the accuracies are averaged over the workers
with byteps_push_pull, and rank 0 fails when the last epoch's is not above 0.96. The
digits are 1437 training images against MNIST's 60000, so an epoch here passes over
them ``--repeat`` times (default 3: 67 steps of 64 images per epoch, where an MNIST
epoch has 937).
"""
import argparse
import logging
import sys
import time
from pathlib import Path

import byteps.mxnet as bps
import mxnet as mx
import numpy as np
from mxnet import autograd, gluon, nd

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples" / "mnist"))
from digits import load_digits  # noqa: E402

parser = argparse.ArgumentParser(description="MXNet MNIST example with BytePS's gradient "
                                             "compression")
parser.add_argument("--batch-size", type=int, default=64,
                    help="training batch size (default: 64)")
parser.add_argument("--dtype", type=str, default="float32",
                    help="training data type (default: float32)")
parser.add_argument("--epochs", type=int, default=5,
                    help="number of training epochs (default: 5)")
parser.add_argument("--j", type=int, default=0,
                    help="number of cpu processes for the data loader (default: 0)")
parser.add_argument("--lr", type=float, default=0.01,
                    help="learning rate (default: 0.01)")
parser.add_argument("--wd", type=float, default=0.0001,
                    help="weight decay rate (default: 0.0001)")
parser.add_argument("--momentum", type=float, default=0.9,
                    help="SGD momentum (default: 0.9)")
parser.add_argument("--compressor", type=str, default="",
                    help="which compressor: onebit, topk, randomk or dithering")
parser.add_argument("--ef", type=str, default="",
                    help="which error feedback: vanilla")
parser.add_argument("--compress-momentum", type=str, default="",
                    help="which compression momentum: nesterov")
parser.add_argument("--scaling", action="store_true", default=False,
                    help="enable scaling for the onebit compressor")
parser.add_argument("--k", type=int, default=1,
                    help="k of topk and randomk, levels of dithering")
parser.add_argument("--fp16-pushpull", action="store_true", default=False,
                    help="use fp16 compression during pushpull")
parser.add_argument("--logging-file", type=str, default="baseline",
                    help="name of the training log file")
parser.add_argument("--repeat", type=int, default=3,
                    help="passes over the digits per epoch (default: 3)")
args = parser.parse_args()

bps.init()

logger = logging.getLogger("")
logger.setLevel(logging.INFO)
logger.addHandler(logging.FileHandler(f"mnist-{bps.size()}-cpu-{args.logging_file}.log"))
logger.addHandler(logging.StreamHandler(sys.stdout))
logger.info(args)


def as_images(images):
    """The original's transform: channels first, scaled to -0.5..0.5."""
    return (images.astype(args.dtype)[:, None, :, :] / 255 - 0.5).astype(args.dtype)


def data_loaders():
    train_x, train_y, val_x, val_y = load_digits(0.2, seed=0)
    train_set = gluon.data.ArrayDataset(as_images(np.concatenate([train_x] * args.repeat)),
                                        np.concatenate([train_y] * args.repeat)
                                        .astype("float32"))
    val_set = gluon.data.ArrayDataset(as_images(val_x), val_y.astype("float32"))
    train_iter = gluon.data.DataLoader(train_set, args.batch_size, True,
                                       num_workers=args.j, last_batch="discard")
    val_iter = gluon.data.DataLoader(val_set, args.batch_size, False, num_workers=args.j)
    return train_iter, val_iter, len(train_set)


def conv_nets():
    net = gluon.nn.HybridSequential()
    with net.name_scope():
        net.add(gluon.nn.Conv2D(channels=20, kernel_size=5, activation="relu"))
        net.add(gluon.nn.MaxPool2D(pool_size=2, strides=2))
        net.add(gluon.nn.Conv2D(channels=50, kernel_size=5, activation="relu"))
        net.add(gluon.nn.MaxPool2D(pool_size=2, strides=2))
        net.add(gluon.nn.Flatten())
        net.add(gluon.nn.Dense(512, activation="relu"))
        net.add(gluon.nn.Dense(10))
    return net


def evaluate(model, data_iter, context):
    metric = mx.metric.Accuracy()
    for batch in data_iter:
        output = model(batch[0].as_in_context(context))
        metric.update([batch[1].as_in_context(context)], [output])
    return metric.get()


train_data, val_data, train_size = data_loaders()
context = mx.cpu(bps.local_rank())
num_workers = bps.size()

model = conv_nets()
model.cast(args.dtype)
model.initialize(mx.init.MSRAPrelu(), ctx=context)
model.summary(nd.ones((1, 1, 28, 28), ctx=context))
model.hybridize()
params = model.collect_params()

optimizer_params = {"momentum": args.momentum, "wd": args.wd,
                    "learning_rate": args.lr * num_workers}
compression_params = {
    "compressor": args.compressor,
    "ef": args.ef,
    "momentum": args.compress_momentum,
    "scaling": args.scaling,
    "k": args.k,
    "fp16": args.fp16_pushpull,
}
trainer = bps.DistributedTrainer(params, "sgd", optimizer_params,
                                 compression_params=compression_params)

loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
metric = mx.metric.Accuracy()
total_time = 0
bps.byteps_declare_tensor("acc")
for epoch in range(args.epochs):
    tic = time.time()
    metric.reset()
    for i, batch in enumerate(train_data):
        data = batch[0].as_in_context(context)
        label = batch[1].as_in_context(context)
        with autograd.record():
            output = model(data)
            loss = loss_fn(output, label)
        loss.backward()
        trainer.step(args.batch_size)
        metric.update([label], [output])
        if i % 100 == 0:
            name, acc = metric.get()
            logger.info("[Epoch %d Batch %d] Training: %s=%f", epoch, i, name, acc)
    elapsed = time.time() - tic
    total_time += elapsed
    logger.info("Epoch[%d]\tSpeed=%.2f samples/s\tTime cost=%f", epoch,
                train_size * num_workers / elapsed, elapsed)

    _, train_acc = metric.get()
    name, val_acc = evaluate(model, val_data, context)
    acc = mx.nd.array([train_acc, val_acc], ctx=context)
    bps.byteps_push_pull(acc, name="acc", is_average=False)
    acc /= bps.size()
    train_acc, val_acc = acc[0].asscalar(), acc[1].asscalar()
    if bps.rank() == 0:
        logger.info("Epoch[%d]\tTrain: %s=%f\tValidation: %s=%f", epoch, name, train_acc,
                    name, val_acc)

if bps.rank() == 0 and epoch == args.epochs - 1:
    assert val_acc > 0.96, f"Achieved accuracy ({val_acc}) is lower than expected (0.96)"
    print(f"final validation accuracy {val_acc:.4f}", flush=True)
logger.info("total time=%.2f", total_time)
