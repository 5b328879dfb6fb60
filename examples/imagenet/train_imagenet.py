"""Train a gluoncv image classifier (ResNet-50 by default) on ImageNet-style data.

The same script runs alone or under any dist_gluon backend:

    python examples/imagenet/train_imagenet.py --data-dir ~/data/imagenet
    python -m dist_gluon.launch -n 8 --backend horovod -- \\
        python examples/imagenet/train_imagenet.py --data-dir ~/data/imagenet --dtype float16
    python -m dist_gluon.launch -n 2 --backend dist_sync -- \\
        python examples/imagenet/train_imagenet.py --synthetic --epochs 1     # images/s

Data (``--data-dir``), one of:
- ``train.rec``/``train.idx`` and ``val.rec``/``val.idx`` (MXNet RecordIO, made with
  ``im2rec.py``), read by ``mx.io.ImageRecordIter``; each worker reads its own part
  (``dg.shard_kwargs``);
- ``train/<class>/*.jpg`` and ``val/<class>/*.jpg``, read by
  ``gluon.data.vision.ImageFolderDataset``; each worker samples its own share
  (``dg.ShardSampler``).
``--synthetic`` trains on random data instead, to measure throughput.
``make_tiny_rec.py`` (next to this script) writes a small dataset of either kind.

The recipe (Goyal et al., 2017; He et al., "Bag of Tricks", 2019): the learning rate
grows with the number of workers after a linear warmup, then follows a cosine or step
schedule; label smoothing; mixup; no weight decay on batch-norm parameters and biases;
float16 with float32 master weights (``--dtype float16``, GPU only). ``--syncbn``
normalises with the batch statistics of all workers together (``dg.SyncBatchNorm``),
which makes N workers train exactly like one process on the N-fold batch; it costs two
small collectives per BatchNorm layer and step, and the network is then not hybridized.
Validation accuracy is exact: each worker evaluates its part and ``dg.reduce_metric``
sums the counts. A checkpoint is written every epoch (``--checkpoint-dir``) and
``--resume`` continues from it.

Elastic jobs (``dist_gluon.launch --nnodes MIN:MAX``): after every step
``dg.stop_requested()`` tells every worker at once that the launcher wants to re-form
the job; the script saves a checkpoint at that step and exits, and the restarted
workers (``--resume``) continue inside the epoch with the images not yet trained on,
on their new number. Each worker keeps ``--batch-size``, so the global batch changes
with the number of workers, and so does the learning rate (``--scale-lr``). With image
folders the resumed epoch trains on exactly the rest of the epoch's sample order
(``ShardSampler.set_epoch(epoch, skip=...)``); ``mx.io.ImageRecordIter`` cannot skip,
so with .rec files it takes the epoch's remaining steps from a new pass over each
worker's part.
With ``--elastic-memory`` (horovod) the loop runs as a ``@dg.elastic.run`` function on
a ``dg.elastic.State`` committed after every step (with the images done in the epoch)
instead: a lost node costs the step in flight, the survivors go on in their processes
with this formation's data shards and learning rate (a reset callback), a joining
node's worker gets the state from rank 0, and no checkpoint is needed
(``--checkpoint-dir`` still serves restarts of the whole job).
"""
from __future__ import annotations

import argparse
import math
import os
import time

import mxnet as mx
import numpy as np
from mxnet import autograd, gluon
from mxnet.gluon.data.vision import transforms

import dist_gluon as dg
from dist_gluon import timeline

MEAN_RGB = (123.68, 116.779, 103.939)
STD_RGB = (58.393, 57.12, 57.375)
# Validation images are resized so that the centre crop keeps 87.5% of the side.
CROP_RATIO = 0.875


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Train a gluoncv classification model on ImageNet-style data with "
                    "dist_gluon.",
        epilog="example: python -m dist_gluon.launch -n 2 --backend horovod -- python "
               "examples/imagenet/train_imagenet.py --synthetic --model resnet18_v1b")
    data = parser.add_argument_group("data")
    data.add_argument("--data-dir", default=None,
                      help="directory with train.rec/train.idx/val.rec/val.idx, or with "
                           "train/ and val/ image folders (one sub-directory per class)")
    data.add_argument("--synthetic", action="store_true",
                      help="train on random data, without validation, to measure images/s")
    data.add_argument("--num-classes", type=int, default=None,
                      help="number of classes (default: from the image folders, else 1000)")
    data.add_argument("--input-size", type=int, default=224,
                      help="side of the square network input in pixels (default: 224)")
    data.add_argument("--data-threads", type=int, default=2,
                      help="decoding threads of each worker (default: 2)")

    model = parser.add_argument_group("model")
    model.add_argument("--model", default="resnet50_v1b",
                       help="any gluoncv.model_zoo model name (default: resnet50_v1b)")
    model.add_argument("--dtype", choices=("float32", "float16"), default="float32",
                       help="float16: half-precision training with float32 master weights "
                            "(needs a GPU; default: float32)")
    model.add_argument("--syncbn", action="store_true",
                       help="BatchNorm statistics over all workers' samples together "
                            "(dist_gluon.SyncBatchNorm) instead of each worker's own batch; "
                            "the network is not hybridized on more than one device; CPU "
                            "contexts standing in for GPUs need MXNET_CPU_TEMP_COPY=1024")

    train = parser.add_argument_group("training")
    train.add_argument("--epochs", type=int, default=90, help="training epochs (default: 90)")
    train.add_argument("--batch-size", type=int, default=32,
                       help="batch size of each worker; the global batch is this times the "
                            "number of workers, so it shrinks when an elastic job re-forms "
                            "with fewer workers (default: 32)")
    train.add_argument("--steps-per-epoch", type=int, default=None,
                       help="steps per epoch (default: the training set once; with "
                            "--synthetic 50)")
    train.add_argument("--lr", type=float, default=None,
                       help="learning rate of one worker (default: 0.1 x batch-size / 256)")
    train.add_argument("--scale-lr", action=argparse.BooleanOptionalAction, default=True,
                       help="N workers use N times --lr, for their N times larger global "
                            "batch (the linear scaling rule, reached by the warmup); "
                            "--no-scale-lr keeps --lr on any number of workers "
                            "(default: scale)")
    train.add_argument("--lr-mode", choices=("cosine", "step"), default="cosine",
                       help="learning rate schedule after the warmup (default: cosine)")
    train.add_argument("--lr-decay", type=float, default=0.1,
                       help="step schedule: factor at each decay epoch (default: 0.1)")
    train.add_argument("--lr-decay-epochs", default="30,60,80",
                       help="step schedule: comma-separated epochs (default: 30,60,80)")
    train.add_argument("--warmup-epochs", type=float, default=5.0,
                       help="epochs of linear warmup from --lr to the scaled rate "
                            "(default: 5)")
    train.add_argument("--momentum", type=float, default=0.9, help="SGD momentum (default: 0.9)")
    train.add_argument("--compression", default="none",
                       choices=("none", "fp16", "2bit", "powersgd"),
                       help="gradient compression: none, fp16, 2bit (MXNet's, threshold 0.5) "
                             "or powersgd "
                            "(rank 4) (default: none)")
    train.add_argument("--wd", type=float, default=1e-4,
                       help="weight decay, not applied to batch-norm parameters and biases "
                            "(default: 1e-4)")
    train.add_argument("--label-smoothing", type=float, default=0.1,
                       help="label smoothing epsilon, 0 to disable (default: 0.1)")
    train.add_argument("--mixup-alpha", type=float, default=0.0,
                       help="mixup: Beta(alpha, alpha) mixing weights, 0 to disable "
                            "(default: 0; 0.2 is usual)")
    train.add_argument("--mixup-off-epochs", type=int, default=0,
                       help="mixup: train the last this many epochs without it (default: 0)")
    train.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")

    run = parser.add_argument_group("logging and checkpoints")
    run.add_argument("--log-interval", type=int, default=20,
                     help="print progress every this many steps (default: 20)")
    run.add_argument("--checkpoint-dir", default=None,
                     help="write a checkpoint there after every epoch, and at the step "
                          "where an elastic launcher asks the job to stop")
    run.add_argument("--resume", action="store_true",
                     help="continue from the newest checkpoint in --checkpoint-dir, if any, "
                          "inside its epoch when it was saved at a stop (give it from the "
                          "first run of an elastic job)")
    run.add_argument("--elastic-memory", action="store_true",
                     help="elastic jobs on horovod: keep the training state in memory "
                          "(dg.elastic.State, committed after every step) so that the "
                          "workers keep their processes when a node is lost or joins, "
                          "losing at most the step in flight, with no checkpoint "
                          "(docs/elastic.md); elsewhere the same as without it")
    devices = parser.add_argument_group("devices")
    devices.add_argument("--devices", default=None,
                         help="the devices each worker drives: gpu (GPU number local rank: "
                              "one worker per GPU, the default with GPUs), gpu:0,1,2,3 (one "
                              "worker drives them all and splits its batch), cpu (the "
                              "default without GPUs), cpu:0,1")
    devices.add_argument("--gpus", default=None, metavar="LIST",
                         help="shorthand for --devices gpu:LIST, e.g. --gpus 0,1,2,3")
    args = parser.parse_args(argv)
    if args.gpus is not None:
        args.devices = f"gpu:{args.gpus}"
    if args.devices is None:
        args.devices = "gpu" if mx.context.num_gpus() > 0 else "cpu"

    if bool(args.data_dir) == args.synthetic:
        parser.error("give either --data-dir or --synthetic")
    if args.resume and not args.checkpoint_dir:
        parser.error("--resume needs --checkpoint-dir")
    for name in ("epochs", "batch_size", "input_size", "data_threads", "log_interval"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.steps_per_epoch is not None and args.steps_per_epoch < 1:
        parser.error("--steps-per-epoch must be at least 1")
    if not 0 <= args.label_smoothing < 1:
        parser.error(f"--label-smoothing must be in [0, 1), got {args.label_smoothing}")
    if args.mixup_alpha < 0:
        parser.error(f"--mixup-alpha must be >= 0, got {args.mixup_alpha}")
    try:
        args.lr_decay_epochs = [int(e) for e in args.lr_decay_epochs.split(",") if e.strip()]
    except ValueError:
        parser.error(f"--lr-decay-epochs must be comma-separated integers, got "
                     f"{args.lr_decay_epochs!r}")
    if args.dtype == "float16" and mx.context.num_gpus() == 0:
        parser.error("--dtype float16 needs a GPU: MXNet has no float16 matrix multiply "
                     "on CPU")
    if args.lr is None:
        args.lr = 0.1 * args.batch_size / 256
    return args


# ---------------------------------------------------------------------------- data
class RecordData:
    """train.rec/val.rec through ImageRecordIter, each worker reading its own part."""

    def __init__(self, args, kv):
        root = args.data_dir
        size = args.input_size
        self.num_train = _count_records(os.path.join(root, "train.idx"))
        self.num_val = _count_records(os.path.join(root, "val.idx"))
        self.num_classes = args.num_classes or 1000
        common = dict(batch_size=args.batch_size, data_shape=(3, size, size),
                      preprocess_threads=args.data_threads,
                      mean_r=MEAN_RGB[0], mean_g=MEAN_RGB[1], mean_b=MEAN_RGB[2],
                      std_r=STD_RGB[0], std_g=STD_RGB[1], std_b=STD_RGB[2],
                      **dg.shard_kwargs(kv))
        self._train = mx.io.ImageRecordIter(
            path_imgrec=os.path.join(root, "train.rec"),
            path_imgidx=os.path.join(root, "train.idx"),
            shuffle=True, seed=args.seed + kv.rank, rand_mirror=True,
            random_resized_crop=True, min_random_area=0.08, max_random_area=1.0,
            min_aspect_ratio=3 / 4, max_aspect_ratio=4 / 3,
            brightness=0.4, contrast=0.4, saturation=0.4, pca_noise=0.1, **common)
        self._val_args = dict(
            path_imgrec=os.path.join(root, "val.rec"),
            path_imgidx=os.path.join(root, "val.idx"),
            shuffle=False, resize=int(math.ceil(size / CROP_RATIO)), **common)

    def train_batches(self, epoch: int, skip: int = 0):
        """Batches of this worker's part, endlessly: parts differ in size by a few
        records, so the caller takes the same number of steps on every worker. The
        iterator cannot leave out the ``skip`` images done before a stop: a new pass."""
        self._train.reset()
        while True:
            for batch in self._train:
                yield batch.data[0], batch.label[0]
            self._train.reset()

    def val_batches(self):
        """This worker's validation part, each sample once (the padding is cut)."""
        # A new iterator every time: after a reset, ImageRecordIter skips the samples
        # it used to pad the previous pass's last batch.
        for batch in mx.io.ImageRecordIter(**self._val_args):
            keep = batch.data[0].shape[0] - batch.pad
            yield batch.data[0][:keep], batch.label[0][:keep]


class FolderData:
    """train/ and val/ image folders, each worker sampling its own share."""

    def __init__(self, args, kv):
        size = args.input_size
        normalize = transforms.Normalize([m / 255 for m in MEAN_RGB],
                                         [s / 255 for s in STD_RGB])
        train_set = gluon.data.vision.ImageFolderDataset(os.path.join(args.data_dir, "train"))
        val_set = gluon.data.vision.ImageFolderDataset(os.path.join(args.data_dir, "val"))
        if train_set.synsets != val_set.synsets:
            raise SystemExit(f"{args.data_dir}: train/ and val/ must have the same class "
                             "sub-directories")
        self.num_train, self.num_val = len(train_set), len(val_set)
        self.num_classes = len(train_set.synsets)
        if args.num_classes not in (None, self.num_classes):
            raise SystemExit(f"--num-classes {args.num_classes} but {args.data_dir}/train has "
                             f"{self.num_classes} class directories")
        train_tf = transforms.Compose([
            transforms.RandomResizedCrop(size), transforms.RandomFlipLeftRight(),
            transforms.RandomColorJitter(brightness=0.4, contrast=0.4, saturation=0.4),
            transforms.ToTensor(), normalize])
        val_tf = transforms.Compose([
            transforms.Resize(int(math.ceil(size / CROP_RATIO)), keep_ratio=True),
            transforms.CenterCrop(size), transforms.ToTensor(), normalize])
        # Compose hybridizes its run of HybridBlocks (ToTensor, Normalize), and a
        # hybridized block builds its cached graph at its first call, inside its name
        # scope, which two threads must not enter at once: the DataLoader's threads
        # would race there (AttributeError in gluon's _BlockScope.__exit__). Run the
        # transforms imperatively: thread-safe, and no slower for per-image work.
        train_tf.hybridize(False)
        val_tf.hybridize(False)
        self._train_sampler = dg.ShardSampler(self.num_train, kv=kv, seed=args.seed)
        self._val_sampler = dg.ShardSampler(self.num_val, kv=kv, shuffle=False)
        # Threads rather than processes: forking a process that runs a communication
        # backend is not safe.
        self._train = gluon.data.DataLoader(
            train_set.transform_first(train_tf), args.batch_size, sampler=self._train_sampler,
            last_batch="discard", num_workers=args.data_threads, thread_pool=True)
        self._val = gluon.data.DataLoader(
            val_set.transform_first(val_tf), args.batch_size, sampler=self._val_sampler,
            num_workers=args.data_threads, thread_pool=True)

    def train_batches(self, epoch: int, skip: int = 0):
        """Batches of this worker's share of the epoch's order after its first ``skip``
        positions (done before a stop, by any number of workers), then endlessly of
        whole epochs."""
        self._train_sampler.set_epoch(epoch, skip=skip)
        yield from self._train
        while True:
            self._train_sampler.set_epoch(epoch)
            yield from self._train

    def val_batches(self):
        return self._val_sampler.unpadded(self._val)


class SyntheticData:
    """One random batch, repeated: measures the training speed without any input cost."""

    def __init__(self, args, kv):
        self.num_classes = args.num_classes or 1000
        self.num_train = self.num_val = 0
        shape = (args.batch_size, 3, args.input_size, args.input_size)
        self._data = mx.nd.random.normal(shape=shape)
        self._label = mx.nd.array(np.random.RandomState(kv.rank).randint(
            0, self.num_classes, size=args.batch_size))

    def train_batches(self, epoch: int, skip: int = 0):
        while True:
            yield self._data, self._label

    def val_batches(self):
        return iter(())


def _count_records(idx_path: str) -> int:
    if not os.path.isfile(idx_path):
        raise SystemExit(f"{idx_path} is missing: --data-dir needs train.rec/train.idx and "
                         "val.rec/val.idx, or train/ and val/ image folders")
    with open(idx_path) as f:
        return sum(1 for line in f if line.strip())


def open_data(args, kv):
    if args.synthetic:
        return SyntheticData(args, kv)
    if os.path.isfile(os.path.join(args.data_dir, "train.rec")):
        return RecordData(args, kv)
    if os.path.isdir(os.path.join(args.data_dir, "train")):
        return FolderData(args, kv)
    raise SystemExit(f"--data-dir {args.data_dir!r} has neither train.rec nor a train/ "
                     "image folder")


# ---------------------------------------------------------------------------- model
def build_model(args, num_classes: int, ctx: list, kv):
    from gluoncv.model_zoo import get_model

    try:
        net = get_model(args.model, pretrained=False, classes=num_classes)
    except ValueError as err:
        if "not supported" not in str(err):
            raise
        raise SystemExit(f"unknown --model {args.model!r}; "
                         "gluoncv.model_zoo.get_model_list() lists the names") from None
    if args.syncbn:
        dg.convert_sync_batchnorm(net, kv=kv)
    net.initialize(mx.init.MSRAPrelu(), ctx=ctx)
    if args.dtype != "float32":
        net.cast(args.dtype)
    if not (args.syncbn and kv.num_workers * len(ctx) > 1):
        # SyncBatchNorm sums over the workers and devices from Python, which a cached
        # graph cannot do
        net.hybridize(static_alloc=True, static_shape=True)
    # Weight decay pulls batch-norm scales and biases towards zero, which only hurts.
    no_decay = net.collect_params(".*beta|.*gamma|.*bias")
    for param in no_decay.values():
        param.wd_mult = 0.0
    return net, len(no_decay.keys())


def lr_schedule(args, workers: int, steps_per_epoch: int) -> mx.lr_scheduler.LRScheduler:
    """Linear warmup from the one-worker rate to ``workers`` times it (``--scale-lr``),
    then cosine or step decay, per step. Laid out over this run's steps: after an
    elastic job re-forms with other workers an epoch has another number of them, and
    the restored step count is read on this run's schedule."""
    lr = args.lr * workers if args.scale_lr else args.lr
    total = args.epochs * steps_per_epoch
    warmup = min(int(args.warmup_epochs * steps_per_epoch), total - 1)
    if args.lr_mode == "cosine":
        return mx.lr_scheduler.CosineScheduler(
            max_update=total, base_lr=lr, final_lr=0.0, warmup_steps=warmup,
            warmup_begin_lr=args.lr)
    steps = sorted({e * steps_per_epoch for e in args.lr_decay_epochs
                    if warmup < e * steps_per_epoch < total})
    if not steps:  # no decay epoch inside the run: constant after the warmup
        return mx.lr_scheduler.FactorScheduler(
            step=total + 1, factor=1.0, base_lr=lr, warmup_steps=warmup,
            warmup_begin_lr=args.lr)
    return mx.lr_scheduler.MultiFactorScheduler(
        step=steps, factor=args.lr_decay, base_lr=lr, warmup_steps=warmup,
        warmup_begin_lr=args.lr)


def soft_targets(label: mx.nd.NDArray, num_classes: int, eta: float) -> mx.nd.NDArray:
    """One-hot labels with label smoothing ``eta``."""
    return mx.nd.one_hot(label, num_classes, on_value=1 - eta + eta / num_classes,
                         off_value=eta / num_classes)


def evaluate(net, data, ctx, dtype: str, num_classes: int, kv) -> dict:
    """Top-1 (and, with more than 5 classes, top-5) accuracy over the whole validation
    set, the same on every worker, and the number of images it holds."""
    metrics = [mx.metric.Accuracy()]
    if num_classes > 5:
        metrics.append(mx.metric.TopKAccuracy(5))
    metric = mx.metric.CompositeEvalMetric(metrics)
    for images, labels in data.val_batches():
        outputs = net(images.as_in_context(ctx).astype(dtype, copy=False))
        metric.update([labels], [outputs.astype("float32", copy=False)])
    reduced = dg.reduce_metric(metric, kv=kv).metrics
    result = {"val_acc": reduced[0].get()[1], "images": reduced[0].num_inst}
    if num_classes > 5:
        result["val_top5"] = reduced[1].get()[1]
    return result


class Progress:
    """Where the training loop is (epoch, images of it done, counters) when the job
    keeps nothing in memory: a restart resumes from a checkpoint instead.
    ``dg.elastic.State`` (--elastic-memory) has the same attributes and keeps them."""

    def __init__(self, **values):
        self.__dict__.update(values)

    def commit(self) -> None:
        """Nothing to keep between steps without --elastic-memory."""


def main(argv=None) -> None:
    args = parse_args(argv)
    started = time.time()
    kv = dg.create()

    def log(message: str) -> None:
        if kv.rank == 0:
            print(message, flush=True)

    try:
        devices = dg.parse_devices(args.devices, kv.local_rank)
    except ValueError as err:
        raise SystemExit(f"--devices: {err}") from None
    if args.batch_size < len(devices):
        raise SystemExit(f"--batch-size {args.batch_size} is smaller than the "
                         f"{len(devices)} devices of a worker; each needs a sample")
    mx.random.seed(args.seed + kv.rank)
    np.random.seed(args.seed + kv.rank)
    data = open_data(args, kv)
    classes = data.num_classes
    if args.synthetic:
        log(f"data: synthetic {args.input_size}x{args.input_size} images, {classes} classes, "
            "no validation")
    else:
        log(f"data: {data.num_train} training and {data.num_val} validation images, "
            f"{classes} classes, from {args.data_dir} ({type(data).__name__})")

    def steps_of(workers: int) -> int:
        """Steps per epoch of ``workers`` workers."""
        return args.steps_per_epoch or (
            50 if args.synthetic else max(1, data.num_train // (args.batch_size * workers)))

    steps_per_epoch = steps_of(kv.num_workers)
    net, num_no_decay = build_model(args, classes, devices, kv)
    schedule = lr_schedule(args, kv.num_workers, steps_per_epoch)
    workers = kv.num_workers
    lr = args.lr * workers if args.scale_lr else args.lr
    optimizer_params = {"learning_rate": lr, "momentum": args.momentum,
                        "wd": args.wd, "lr_scheduler": schedule,
                        "multi_precision": args.dtype == "float16"}
    trainer = dg.DistributedTrainer(net.collect_params(), "nag", optimizer_params, kv=kv,
                                    compression=args.compression)
    log(f"model: {args.model} ({args.dtype}) on {', '.join(map(str, devices))}, no weight "
        f"decay on {num_no_decay} batch-norm and bias parameters"
        + (f"; SyncBatchNorm: statistics over the samples of all {workers} worker(s) x "
           f"{len(devices)} device(s), not hybridized"
           if args.syncbn and workers * len(devices) > 1 else ""))

    def describe_training() -> None:
        workers = kv.num_workers
        lr = args.lr * workers if args.scale_lr else args.lr
        log(f"training: backend {kv.type}, {workers} worker(s) x batch {args.batch_size} = "
            f"{args.batch_size * workers}, {steps_per_epoch} steps per epoch; lr {args.lr:g} "
            f"{'x' if args.scale_lr else 'on'} {workers} = {lr:g}, {args.lr_mode} schedule, "
            f"{args.warmup_epochs:g} warmup "
            f"epochs, label smoothing {args.label_smoothing:g}, mixup alpha "
            f"{args.mixup_alpha:g}, compression {args.compression}")

    describe_training()
    checkpointer = dg.Checkpointer(args.checkpoint_dir, kv=kv) if args.checkpoint_dir else None
    # epoch: the epoch to train next; done: images of it already trained on (a stop or a
    # fault inside it); resumed: the checkpoint was looked for
    values = dict(epoch=0, done=0, best_acc=float("nan"), result={"val_acc": float("nan")},
                  train_images=0, train_time=0.0, resumed=False)
    if args.elastic_memory:
        state = dg.elastic.State(net=net, trainer=trainer, **values)

        def on_reset() -> None:
            # the job re-formed: this formation's shards of the data, steps per epoch and
            # rate, laid out over its own steps
            nonlocal data, steps_per_epoch, schedule
            data = open_data(args, kv)
            steps_per_epoch = steps_of(kv.num_workers)
            schedule = lr_schedule(args, kv.num_workers, steps_per_epoch)
            trainer.optimizer.lr_scheduler = schedule
            log(f"re-formed: {kv.num_workers} worker(s) go on from the last step every "
                "worker finished (its state kept in memory)")
            describe_training()

        state.register_reset_callbacks([on_reset])
    else:
        state = Progress(**values)

    def resume() -> None:
        """The newest checkpoint in --checkpoint-dir, if any, into the model, the trainer
        and the loop's position (a collective: inside train, so that a worker that joins
        an --elastic-memory job takes the state from its peers instead)."""
        restored = checkpointer.restore(net, trainer)
        if restored is None:
            log(f"resume: no checkpoint in {args.checkpoint_dir}, starting from scratch")
            return
        # The restored optimizer carries the saved run's schedule; this run's arguments
        # (e.g. more --epochs) decide, from the restored step count on.
        trainer.optimizer.lr_scheduler = schedule
        extra = restored.get("extra") or {}
        state.epoch = restored["epoch"]
        state.best_acc = extra.get("best_acc", state.best_acc)
        state.done = extra.get("done", 0)
        where = (f"inside epoch {state.epoch + 1} after {state.done} images (saved by "
                 f"{restored['num_workers']} worker(s))" if state.done
                 else f"after epoch {state.epoch}")
        log(f"resume: continuing {where} from {args.checkpoint_dir}")

    soft = args.label_smoothing > 0 or args.mixup_alpha > 0
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss(sparse_label=not soft)

    def train(state) -> bool:
        """The epochs from ``state.epoch`` on; False if the launcher asked the job to stop
        (a restart from the checkpoint follows)."""
        if args.resume and not state.resumed:
            resume()
            state.resumed = True
            state.commit()
        global_batch = args.batch_size * kv.num_workers
        # the launcher's progress line (on a terminal) shows the time left
        timeline.expect_steps((args.epochs - state.epoch) * steps_per_epoch)
        for epoch in range(state.epoch, args.epochs):
            mixup = args.mixup_alpha > 0 and epoch < args.epochs - args.mixup_off_epochs
            train_loss = mx.metric.Loss()
            skip = state.done
            # the steps of a resumed epoch start after the images done
            first = min(-(-skip // global_batch), steps_per_epoch)
            batches = data.train_batches(epoch, skip)
            tic = interval_tic = time.time()
            stop_at = None
            # timeline.data: the time each batch takes to arrive counts as waiting for
            # data in the launcher's report and timeline
            arriving = timeline.data(batches)
            for step in range(first + 1, steps_per_epoch + 1):
                images, labels = next(arriving)
                images = images.as_in_context(devices[0])
                labels = labels.as_in_context(devices[0])
                targets = (soft_targets(labels, classes, args.label_smoothing) if soft
                           else labels)
                if mixup:
                    lam = float(np.random.beta(args.mixup_alpha, args.mixup_alpha))
                    images = lam * images + (1 - lam) * images.flip(axis=0)
                    targets = lam * targets + (1 - lam) * targets.flip(axis=0)
                # each device takes a slice of the worker's batch
                parts = gluon.utils.split_and_load(images, devices, even_split=False)
                part_targets = gluon.utils.split_and_load(targets, devices, even_split=False)
                with autograd.record():
                    losses = [loss_fn(net(x.astype(args.dtype, copy=False))
                                      .astype("float32", copy=False), t)
                              for x, t in zip(parts, part_targets)]
                autograd.backward(losses)
                trainer.step(args.batch_size)
                train_loss.update(None, losses)
                state.done = skip + (step - first) * global_batch
                if step % args.log_interval == 0 or step == steps_per_epoch:
                    mx.nd.waitall()
                    interval = min(step % args.log_interval or args.log_interval, step - first)
                    speed = interval * global_batch / (time.time() - interval_tic)
                    log(f"epoch {epoch + 1}/{args.epochs} [{step:>4}/{steps_per_epoch}] "
                        f"loss {train_loss.get()[1]:.4f} lr {trainer.learning_rate:.5f} "
                        f"{speed:.1f} images/s")
                    interval_tic = time.time()
                if args.elastic_memory:
                    # a step boundary: a lost node costs at most the step after it, and a
                    # node joins or leaves here (the commit raises on every rank)
                    state.commit()
                elif dg.stop_requested(kv):       # the same answer on every worker
                    stop_at = step
                    break
            if stop_at is not None and stop_at < steps_per_epoch:
                if checkpointer is not None:
                    checkpointer.save(net, trainer, epoch, step=stop_at,
                                      extra={"best_acc": state.best_acc, "done": state.done})
                log("stop: the launcher asked the job to stop; "
                    + (f"checkpoint of epoch {epoch + 1} after {state.done} images saved, "
                       "exiting for the restart (--resume)" if checkpointer is not None else
                       "exiting without a checkpoint (no --checkpoint-dir): the restart "
                       "begins afresh"))
                return False
            mx.nd.waitall()
            elapsed = max(time.time() - tic, 1e-9)
            epoch_images = (steps_per_epoch - first) * global_batch
            loss_value = dg.reduce_metric(train_loss, kv=kv).get()[1]
            message = (f"epoch {epoch + 1}/{args.epochs}: train_loss={loss_value:.4f} "
                       f"time={elapsed:.1f}s images/s={epoch_images / elapsed:.1f}")
            if not args.synthetic:
                result = evaluate(net, data, devices[0], args.dtype, classes, kv)
                val_acc = result["val_acc"]
                state.result = result
                state.best_acc = (val_acc if math.isnan(state.best_acc)
                                  else max(state.best_acc, val_acc))
                message += "".join(f" {k}={v:.4f}" for k, v in result.items()
                                   if k != "images")
                message += f" ({result['images']} images)"
            state.train_images += epoch_images
            state.train_time += elapsed
            state.epoch, state.done = epoch + 1, 0
            state.commit()
            log(message)
            if checkpointer is not None:
                checkpointer.save(net, trainer, epoch + 1, extra={"best_acc": state.best_acc})
            if stop_at is not None and epoch + 1 < args.epochs:   # at the epoch's last step
                log(f"stop: the launcher asked the job to stop at the end of epoch "
                    f"{epoch + 1}; exiting for the restart (--resume)")
                return False
        return True

    if not (dg.elastic.run(train) if args.elastic_memory else train)(state):
        return
    result = state.result
    if state.train_time == 0:
        log(f"the checkpoint is at epoch {state.epoch}, --epochs is {args.epochs}: "
            "nothing to train")
        if not args.synthetic:
            result = evaluate(net, data, devices[0], args.dtype, classes, kv)
    speed = state.train_images / state.train_time if state.train_time else float("nan")
    accuracy = "".join(f"{k}={v:.4f} " for k, v in result.items() if k != "images")
    log(f"summary: {accuracy}best_val_acc={state.best_acc:.4f} "
        f"model={args.model} dtype={args.dtype} backend={kv.type} workers={kv.num_workers} "
        f"images/s={speed:.1f} time={time.time() - started:.1f}s")


if __name__ == "__main__":
    main()
