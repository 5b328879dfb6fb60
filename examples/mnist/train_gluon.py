"""Train a LeNet on handwritten digits with Gluon, on one process or on N workers.

The same script runs alone or under any dist_gluon backend:

    python examples/mnist/train_gluon.py
    python -m dist_gluon.launch -n 2 --backend horovod -- \\
        python examples/mnist/train_gluon.py --plot runs/mnist.png

Data: ``--data-dir`` holding the four standard MNIST files (train-images-idx3-ubyte.gz,
train-labels-idx1-ubyte.gz, t10k-images-idx3-ubyte.gz, t10k-labels-idx1-ubyte.gz).
Without it, the 1,797 handwritten digits bundled with scikit-learn (copied beside this
script in digits.npz; 8x8 pixels, scaled to 28x28) are split into a training and a
validation set, so nothing is downloaded.

What makes it distributed (everything else is a plain Gluon training loop):
- ``dg.DistributedTrainer`` averages the gradients over the workers and starts every
  worker from rank 0's weights;
- ``dg.ShardSampler`` gives each worker its own share of the data, and
  ``sampler.unpadded`` with ``dg.reduce_metric`` makes the validation accuracy exactly
  that of one process evaluating the whole validation set;
- each worker keeps ``--batch-size``, so the global batch is that times the workers;
  the learning rate grows with the number of workers too (``--scale-lr``, the linear
  scaling rule), after a linear warmup, except in Local SGD or DiLoCo rounds, whose
  local steps each take one worker's batch at one worker's rate;
- ``dg.Checkpointer`` writes a checkpoint every epoch and ``--resume`` continues from it;
- over slow links, ``--sync-every H`` trains with Local SGD (each worker steps alone,
  the weights are averaged every H steps) and ``--outer-lr`` with DiLoCo (an outer
  Nesterov step on the workers' average every H steps); see docs/slow-links.md. The
  epochs' validation figures are then those of each worker's own weights in the middle
  of a round; the summary line's are those of the weights every worker agrees on, after
  a last synchronisation;
- elastic jobs (``dist_gluon.launch --nnodes MIN:MAX``): after every step
  ``dg.stop_requested()`` tells every worker at once that the launcher wants to re-form
  the job; the script then saves a checkpoint at that step and exits, and the restarted
  workers (``--resume``) continue inside the epoch on their new number, exactly where
  the others stopped (``ShardSampler.set_epoch(epoch, skip=...)``);
- or, with ``--elastic-memory`` (horovod), the loop runs as a ``@dg.elastic.run``
  function on a ``dg.elastic.State`` committed after every step (with the position in
  the epoch): a lost node costs the step in flight, the survivors go on in their
  processes, a joining node's worker gets the state from rank 0, and no checkpoint is
  needed (``--checkpoint-dir`` still serves restarts of the whole job);
- ``dist_gluon.timeline.data(train_loader)`` counts the time each batch takes to arrive
  as waiting for data in the launcher's report, and ``timeline.expect_steps`` lets its
  progress line (on a terminal) show the time left; with ``--plot``, rank 0 also draws
  each rank's step time split into data, compute, communication and waiting
  (``runs/mnist-steps.png``, docs/observability.md);
- ``--no-pad`` reads the training set as ``--files`` equal parts that each worker
  reads whole (as ``mx.io.ImageRecordIter`` with ``num_parts``/``part_index`` over
  files, or a stream's shards), with no padding: the workers hold different numbers of
  batches (``--files 5 --batch-size 88`` on 2 workers: 10 and 7), and the epoch's loop
  runs inside ``dg.Join``, so the worker that runs out first takes part in the others'
  remaining steps with zero samples, and all end with the same weights
  (docs/uneven-inputs.md). The summary line's ``replicas=equal`` says that every
  worker ends with the same weights, bit for bit.
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import os
import time

import mxnet as mx
import numpy as np
from digits import load_digits  # examples/mnist/digits.py, beside this script
from mxnet import autograd, gluon
from mxnet.gluon import nn

import dist_gluon as dg
from dist_gluon import timeline

MNIST_FILES = ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz",
               "t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz")
# Mean and standard deviation of MNIST pixels in [0, 1].
MEAN, STD = 0.1307, 0.3081


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Train a LeNet on MNIST (or scikit-learn's digits) with dist_gluon.",
        epilog="example: python -m dist_gluon.launch -n 2 --backend horovod -- "
               "python examples/mnist/train_gluon.py --plot runs/mnist.png")
    parser.add_argument("--data-dir", default=None,
                        help="directory with the four standard MNIST .gz files; default: "
                             "the handwritten digits bundled with scikit-learn")
    parser.add_argument("--epochs", type=int, default=12, help="training epochs (default: 12)")
    parser.add_argument("--batch-size", type=int, default=32,
                        help="batch size of each worker; the global batch is this times "
                             "the number of workers, so it shrinks when an elastic job "
                             "re-forms with fewer workers (default: 32)")
    parser.add_argument("--lr", type=float, default=None,
                        help="learning rate of one worker (default: 0.02, or 0.04 with "
                             "--compression 2bit every step, which runs without momentum)")
    parser.add_argument("--scale-lr", action=argparse.BooleanOptionalAction, default=None,
                        help="N workers use N times --lr, for their N times larger global "
                             "batch (the linear scaling rule, reached by the warmup); "
                             "--no-scale-lr keeps --lr on any number of workers. dist_async "
                             "always divides --lr by N instead, the staleness of a push "
                             "(default: scale, except with --sync-every > 1 or --outer-lr, "
                             "whose local steps each take one worker's batch: "
                             "docs/slow-links.md)")
    parser.add_argument("--compression", default="none",
                        choices=("none", "fp16", "2bit", "powersgd"),
                        help="gradient compression: none, fp16, 2bit (MXNet's, threshold "
                             "--threshold) or powersgd (rank 4); with --sync-every or "
                             "--outer-lr it compresses the pseudo-gradients (default: none)")
    parser.add_argument("--threshold", type=float, default=0.5,
                        help="--compression 2bit: values of at least this magnitude travel "
                             "as +-threshold, the rest waits in the residual; in rounds it is "
                             "in the units of a round's weight delta, far below a gradient's "
                             "(docs/slow-links.md) (default: 0.5, MXNet's)")
    parser.add_argument("--sync-every", type=int, default=1, metavar="H",
                        help="Local SGD: each worker steps on its own gradients and the "
                             "weights are averaged every H steps (default: 1, the gradients "
                             "are averaged every step)")
    parser.add_argument("--outer-lr", type=float, default=None,
                        help="DiLoCo: every --sync-every steps an outer Nesterov step of this "
                             "learning rate (momentum --outer-momentum) on the average of the "
                             "workers' weight deltas; 1 with --outer-momentum 0 is Local SGD "
                             "(default: none, Local SGD)")
    parser.add_argument("--outer-momentum", type=float, default=0.9,
                        help="momentum of the outer step with --outer-lr (default: 0.9)")
    parser.add_argument("--sync-delay", type=int, default=0, metavar="D",
                        help="overlap each synchronisation's sum with the next D local steps "
                             "(1 to --sync-every): its update arrives D steps late "
                             "(default: 0, no overlap)")
    parser.add_argument("--local-sgd-warmup", type=int, default=0, metavar="STEPS",
                        help="post-local SGD: average the gradients every step for this many "
                             "steps before the rounds of --sync-every start (default: 0)")
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
    parser.add_argument("--checkpoint-dir", default=None,
                        help="write a checkpoint there after every epoch, and at the step "
                             "where an elastic launcher asks the job to stop")
    parser.add_argument("--resume", action="store_true",
                        help="continue from the newest checkpoint in --checkpoint-dir, if "
                             "any, inside its epoch when it was saved at a stop (give it "
                             "from the first run of an elastic job)")
    parser.add_argument("--elastic-memory", action="store_true",
                        help="elastic jobs on horovod: keep the training state in memory "
                             "(dg.elastic.State, committed after every step) so that the "
                             "workers keep their processes when a node is lost or joins, "
                             "losing at most the step in flight, with no checkpoint "
                             "(docs/elastic.md); elsewhere the same as without it")
    parser.add_argument("--devices", default="cpu",
                        help="the devices each worker drives: cpu (default), gpu (GPU number "
                             "local rank: start one worker per GPU), gpu:0,1,2,3 (one "
                             "worker drives them all, splitting its batch), cpu:0,1")
    parser.add_argument("--gpus", default=None, metavar="LIST",
                        help="shorthand for --devices gpu:LIST, e.g. --gpus 0,1,2,3")
    parser.add_argument("--plot", default=None, metavar="PATH",
                        help="write a PNG of the loss and accuracy curves to PATH")
    parser.add_argument("--no-pad", action="store_true",
                        help="no padding: each worker reads whole parts of the training "
                             "set (--files), so the workers hold different numbers of "
                             "batches, and trains inside dg.Join")
    parser.add_argument("--files", type=int, default=3, metavar="K",
                        help="with --no-pad: the training set as K equal parts, worker r "
                             "reading parts r, r + N, ... (default: 3)")
    args = parser.parse_args(argv)
    if args.gpus is not None:
        args.devices = f"gpu:{args.gpus}"
    # 2-bit error feedback on every step's gradients: no momentum on top of it. In
    # rounds (--sync-every, --outer-lr) it compresses the pseudo-gradients instead, and
    # the inner optimizer keeps its defaults
    rounds = args.sync_every > 1 or args.outer_lr is not None
    two_bit = args.compression == "2bit" and not rounds
    if args.lr is None:
        args.lr = 0.04 if two_bit else 0.02
    if args.momentum is None:
        args.momentum = 0.0 if two_bit else 0.9
    if args.scale_lr is None:
        # a Local SGD or DiLoCo step is one worker's step on its own batch: the rate of
        # one worker, as DiLoCo and torchft keep it (docs/slow-links.md)
        args.scale_lr = not rounds
    if args.resume and not args.checkpoint_dir:
        parser.error("--resume needs --checkpoint-dir")
    if args.epochs < 1 or args.batch_size < 1 or args.log_interval < 1:
        parser.error("--epochs, --batch-size and --log-interval must be at least 1")
    if args.sync_every < 1 or args.local_sgd_warmup < 0:
        parser.error("--sync-every must be at least 1 and --local-sgd-warmup at least 0")
    if args.local_sgd_warmup and args.sync_every == 1 and args.outer_lr is None:
        parser.error("--local-sgd-warmup needs --sync-every > 1 or --outer-lr")
    if not 0 <= args.sync_delay <= args.sync_every:
        parser.error("--sync-delay must be from 0 to --sync-every")
    if args.no_pad and (rounds or args.elastic_memory):
        # dg.Join shadows the trainer's steps, not Local SGD rounds, and a commit of
        # dg.elastic.State is a collective a worker that ran out cannot shadow
        parser.error("--no-pad does not go with --sync-every, --outer-lr or "
                     "--elastic-memory")
    if args.files < 1:
        parser.error("--files must be at least 1")
    if not 0 < args.val_fraction < 1:
        parser.error(f"--val-fraction must be in (0, 1), got {args.val_fraction}")
    return args


def digits_datasets(val_fraction: float, seed: int):
    """The embedded digits as (N, 28, 28, 1) training and validation datasets."""
    train_x, train_y, val_x, val_y = load_digits(val_fraction, seed)
    return (gluon.data.ArrayDataset(train_x[..., None], train_y),
            gluon.data.ArrayDataset(val_x[..., None], val_y))


def load_mnist(data_dir: str):
    missing = [f for f in MNIST_FILES if not os.path.isfile(os.path.join(data_dir, f))]
    if missing:
        raise SystemExit(f"--data-dir {data_dir!r} lacks {', '.join(missing)}; put the four "
                         f"standard MNIST files there, or leave out --data-dir to train on "
                         f"the digits bundled with scikit-learn")
    return (gluon.data.vision.MNIST(root=data_dir, train=True),
            gluon.data.vision.MNIST(root=data_dir, train=False))


class FileParts(gluon.data.Sampler):
    """A worker's whole parts of a data set stored as ``files`` equal contiguous parts
    (worker ``rank`` of ``workers`` reads parts rank, rank + workers, ...), shuffled
    together each epoch. Nothing is padded: when ``files`` is not a multiple of the
    workers, they hold different numbers of samples, and of batches."""

    def __init__(self, length: int, files: int, rank: int, workers: int, seed: int):
        bounds = np.linspace(0, length, files + 1).astype(int)
        self._shares = [np.concatenate([np.arange(bounds[f], bounds[f + 1])
                                        for f in range(r, files, workers)] or [[]])
                        for r in range(workers)]
        self._mine = self._shares[rank].astype(int)
        self._seed, self._rank, self._epoch = seed, rank, 0

    def sizes(self) -> list[int]:
        """Every worker's number of samples, by rank."""
        return [len(share) for share in self._shares]

    def set_epoch(self, epoch: int, skip: int = 0) -> None:
        if skip:
            raise ValueError("--no-pad resumes at the start of an epoch only")
        self._epoch = epoch

    def __iter__(self):
        order = np.random.RandomState([self._seed, self._epoch, self._rank])
        return iter(order.permutation(self._mine).tolist())

    def __len__(self) -> int:
        return len(self._mine)


def weights_digest(net) -> str:
    """A hash of every parameter's bytes: equal digests, equal weights bit for bit."""
    digest = hashlib.sha256()
    for name, param in sorted(net.collect_params().items()):
        digest.update(name.encode())
        digest.update(param.data().asnumpy().tobytes())
    return digest.hexdigest()


def lenet() -> nn.HybridSequential:
    net = nn.HybridSequential()
    net.add(nn.Conv2D(20, kernel_size=5, activation="relu"),
            nn.MaxPool2D(pool_size=2, strides=2),
            nn.Conv2D(50, kernel_size=5, activation="relu"),
            nn.MaxPool2D(pool_size=2, strides=2),
            nn.Flatten(),
            nn.Dense(500, activation="relu"),
            nn.Dense(10))
    return net


def to_input(images: mx.nd.NDArray) -> mx.nd.NDArray:
    """uint8 (B, 28, 28, 1) images -> normalised float32 (B, 1, 28, 28)."""
    return ((images.astype("float32") / 255 - MEAN) / STD).transpose((0, 3, 1, 2))


def evaluate(net, loader, sampler, loss_fn, kv, ctx) -> tuple[float, float]:
    """Loss and accuracy over the whole validation set, the same on every worker."""
    metric = mx.metric.CompositeEvalMetric([mx.metric.Loss("loss"), mx.metric.Accuracy()])
    for images, labels in sampler.unpadded(loader):
        labels = labels.as_in_context(ctx)
        outputs = net(to_input(images.as_in_context(ctx)))
        metric.get_metric(0).update(None, [loss_fn(outputs, labels)])
        metric.get_metric(1).update([labels], [outputs])
    (_, loss), (_, acc) = (m.get() for m in dg.reduce_metric(metric, kv=kv).metrics)
    return loss, acc


def save_plot(history: list[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    epochs = [h["epoch"] for h in history]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.plot(epochs, [h["train_loss"] for h in history], "o-", label="train")
    left.plot(epochs, [h["val_loss"] for h in history], "o-", label="validation")
    left.set(xlabel="epoch", ylabel="cross-entropy loss", title="Loss")
    right.plot(epochs, [h["train_acc"] for h in history], "o-", label="train")
    right.plot(epochs, [h["val_acc"] for h in history], "o-", label="validation")
    right.set(xlabel="epoch", ylabel="accuracy", title="Accuracy")
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, format="png", dpi=100)
    plt.close(fig)


class Progress:
    """Where the training loop is (epoch, positions of it done, history, counters) when
    the job keeps nothing in memory: a restart resumes from a checkpoint instead.
    ``dg.elastic.State`` (--elastic-memory) has the same attributes and keeps them."""

    def __init__(self, **values):
        self.__dict__.update(values)

    def commit(self) -> None:
        """Nothing to keep between steps without --elastic-memory."""


def make_schedule(args, kv, steps_per_epoch: int):
    """(schedule, lr, warmup steps, total steps) for the current number of workers.

    N workers train on N times the batch, so they take N times the step (Goyal et al.,
    2017; --scale-lr), reached by a linear warmup from the one-worker rate, then a
    cosine decay. The schedule counts steps: after an elastic job re-forms with other
    workers, an epoch has another number of them, and the schedule of the new formation
    is laid out over its own steps from the optimizer's step count on.
    On dist_async each worker's push is one step of its own batch on the servers, which
    run the schedule and count the pushes of all workers (N times the steps). A push's
    gradient is about N updates old, so the one-worker rate is divided by that
    staleness (Zhang et al., 2016, staleness-aware async SGD): at 0.02 with momentum
    0.9, one run in six on 2 workers diverged; at 0.01 none did.
    """
    workers = kv.num_workers
    pushes = workers if kv.type == "dist_async" else 1
    total_steps = args.epochs * steps_per_epoch * pushes
    warmup_steps = min(int(args.warmup_epochs * steps_per_epoch) * pushes, total_steps - 1)
    if kv.type == "dist_async":
        lr = args.lr / workers
    else:
        lr = args.lr * workers if args.scale_lr else args.lr
    schedule = mx.lr_scheduler.CosineScheduler(
        max_update=total_steps, base_lr=lr, final_lr=lr * 0.01,
        warmup_steps=warmup_steps, warmup_begin_lr=min(args.lr, lr))
    return schedule, lr, warmup_steps, total_steps


def main(argv=None) -> None:
    args = parse_args(argv)
    started = time.time()
    kv = dg.create()

    def log(message: str) -> None:
        if kv.rank == 0:
            print(message, flush=True)

    if args.data_dir:
        train_data, val_data = load_mnist(args.data_dir)
        log(f"data: MNIST from {args.data_dir}")
    else:
        train_data, val_data = digits_datasets(args.val_fraction, args.seed)
        log("data: no --data-dir given, using the handwritten digits bundled with "
            "scikit-learn (copied in examples/mnist/digits.npz; 8x8 scaled to 28x28); nothing "
            "is downloaded")
    log(f"data: {len(train_data)} training and {len(val_data)} validation images; "
        f"backend {kv.type}, {kv.num_workers} worker(s), batch {args.batch_size} per worker")

    def loaders():
        """Each worker's share of the data, for the current formation of the job."""
        if args.no_pad:
            train_sampler = FileParts(len(train_data), args.files, kv.rank, kv.num_workers,
                                      args.seed)
        else:
            train_sampler = dg.ShardSampler(len(train_data), kv=kv, shuffle=True,
                                            seed=args.seed)
        val_sampler = dg.ShardSampler(len(val_data), kv=kv, shuffle=False)
        return (train_sampler, val_sampler,
                gluon.data.DataLoader(train_data, args.batch_size, sampler=train_sampler),
                gluon.data.DataLoader(val_data, args.batch_size, sampler=val_sampler))

    try:
        devices = dg.parse_devices(args.devices)
    except ValueError as err:
        raise SystemExit(f"--devices: {err}") from None
    mx.random.seed(args.seed)
    net = lenet()
    net.initialize(mx.init.Xavier(magnitude=2.24), ctx=devices)
    net.hybridize()

    if args.no_pad:
        # the steps of an epoch: those of the worker with the most batches, which the
        # others take part in with zero samples once they have run out
        batches = [-(-size // args.batch_size) for size in loaders()[0].sizes()]
        steps_per_epoch = max(batches)
        log(f"data: no padding, the training set in {args.files} parts; the workers "
            f"hold {', '.join(map(str, batches))} batches (dg.Join)")
    else:
        steps_per_epoch = len(loaders()[2])
    schedule, lr, warmup_steps, total_steps = make_schedule(args, kv, steps_per_epoch)
    rounds = {}
    if args.sync_every > 1 or args.outer_lr is not None:
        rounds = {"sync_every": args.sync_every, "local_sgd_warmup": args.local_sgd_warmup,
                  "sync_delay": args.sync_delay}
    if args.outer_lr is not None:
        rounds.update(outer_optimizer="nag", outer_optimizer_params={
            "learning_rate": args.outer_lr, "momentum": args.outer_momentum})
    trainer = dg.DistributedTrainer(
        net.collect_params(), "sgd",
        {"learning_rate": lr, "momentum": args.momentum, "wd": args.wd,
         "lr_scheduler": schedule}, kv=kv, **rounds,
        compression={"type": "2bit", "threshold": args.threshold}
        if args.compression == "2bit" else args.compression)
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()

    def describe_lr() -> None:
        scaling = "/" if kv.type == "dist_async" else "x" if args.scale_lr else "on"
        log(f"lr: {args.lr} {scaling} {kv.num_workers} worker(s) = {lr:g}, global batch "
            f"{args.batch_size * kv.num_workers}, momentum {args.momentum:g}, "
            f"{warmup_steps} warmup steps, "
            f"cosine decay over {total_steps} steps; compression: {args.compression}; "
            f"devices per worker: {', '.join(map(str, devices))}")

    describe_lr()
    if rounds:
        log(f"rounds: weights synchronised every {args.sync_every} steps after "
            f"{args.local_sgd_warmup} steps synchronised every step; "
            + (f"DiLoCo, outer Nesterov lr {args.outer_lr:g} momentum "
               f"{args.outer_momentum:g}" if args.outer_lr is not None else "Local SGD")
            + (f"; each sum overlaps the next {args.sync_delay} local steps"
               if args.sync_delay else ""))

    checkpointer = dg.Checkpointer(args.checkpoint_dir, kv=kv) if args.checkpoint_dir else None
    # epoch: the epoch to train next; done: positions of its sample order already trained
    # on (a stop or a fault inside it); resumed: the checkpoint was looked for
    values = dict(epoch=0, done=0, history=[], samples=0, train_time=0.0, resumed=False)
    if args.elastic_memory:
        state = dg.elastic.State(net=net, trainer=trainer, **values)

        def on_reset() -> None:
            # the job re-formed: this formation's rate, laid out over its own steps
            nonlocal schedule, lr, warmup_steps, total_steps
            schedule, lr, warmup_steps, total_steps = make_schedule(
                args, kv, len(loaders()[2]))
            trainer.optimizer.lr_scheduler = schedule
            log(f"re-formed: {kv.num_workers} worker(s) go on from the last step every "
                "worker finished (its state kept in memory)")
            describe_lr()

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
        state.history = list(extra.get("history", []))
        state.done = extra.get("done", 0)
        where = (f"inside epoch {state.epoch + 1} after {state.done} of its "
                 f"{len(train_data)} samples (saved by {restored['num_workers']} "
                 "worker(s))" if state.done else f"after epoch {state.epoch}")
        log(f"resume: continuing {where} from {args.checkpoint_dir}")

    def train(state) -> bool:
        """The epochs from ``state.epoch`` on; False if the launcher asked the job to stop
        (a restart from the checkpoint follows)."""
        if args.resume and not state.resumed:
            resume()
            state.resumed = True
            state.commit()
        workers = kv.num_workers
        train_sampler, val_sampler, train_loader, val_loader = loaders()
        # the launcher's progress line (on a terminal) shows the time left
        timeline.expect_steps((args.epochs - state.epoch) * steps_per_epoch)
        for epoch in range(state.epoch, args.epochs):
            skip = state.done
            train_sampler.set_epoch(epoch, skip=skip)
            batches = len(train_loader)
            metric = mx.metric.CompositeEvalMetric([mx.metric.Loss("loss"),
                                                    mx.metric.Accuracy()])
            tic = time.time()
            stop_at = None
            # --no-pad: the worker that runs out of batches first stays in dg.Join's exit
            # and takes part in the others' steps with zero samples until all have left
            join = dg.Join(trainer) if args.no_pad else contextlib.nullcontext()
            # timeline.data: the time each batch takes to arrive counts as waiting for
            # data in the launcher's report and timeline
            with join:
                for batch, (images, labels) in enumerate(timeline.data(train_loader),
                                                         start=1):
                    # each device takes a slice of the batch; a device left without one (a
                    # last batch smaller than the devices) must add nothing to the sum
                    used = devices[:images.shape[0]]
                    if len(used) < len(devices):
                        net.collect_params().zero_grad()
                    inputs = gluon.utils.split_and_load(to_input(images), used, even_split=False)
                    targets = gluon.utils.split_and_load(labels, used, even_split=False)
                    with autograd.record():
                        outputs = [net(x) for x in inputs]
                        losses = [loss_fn(out, y) for out, y in zip(outputs, targets)]
                    autograd.backward(losses)
                    trainer.step(images.shape[0])
                    metric.get_metric(0).update(None, losses)
                    metric.get_metric(1).update(targets, outputs)
                    if not args.no_pad:
                        state.samples += images.shape[0] * workers
                    # worker r's batch j held positions (j*B + i)*N + r of the order after
                    # `skip`, so the first skip + batch*B*N are done
                    state.done = min(len(train_data), skip + batch * args.batch_size * workers)
                    if batch % args.log_interval == 0 or batch == batches:
                        (_, batch_loss), (_, batch_acc) = (m.get() for m in metric.metrics)
                        log(f"epoch {epoch + 1}/{args.epochs} [{batch:>3}/{batches}] "
                            f"loss {batch_loss:.4f} acc {batch_acc:.4f} "
                            f"lr {trainer.learning_rate:.4f}")
                    if args.elastic_memory:
                        # a step boundary: a lost node costs at most the step after it, and a
                        # node joins or leaves here (the commit raises on every rank)
                        state.commit()
                    # (not with --no-pad: a collective that a worker which has run out
                    # cannot take part in; the job stops at the end of the epoch)
                    elif not args.no_pad and dg.stop_requested(kv):   # same on every worker
                        stop_at = batch
                        break
            if stop_at is not None and stop_at < batches:
                if checkpointer is not None:
                    checkpointer.save(net, trainer, epoch, step=stop_at,
                                      extra={"history": state.history, "done": state.done})
                log("stop: the launcher asked the job to stop; "
                    + (f"checkpoint of epoch {epoch + 1} after {state.done} of its "
                       f"{len(train_data)} samples saved, exiting for the restart (--resume)"
                       if checkpointer is not None else
                       "exiting without a checkpoint (no --checkpoint-dir): the restart "
                       "begins afresh"))
                return False
            mx.nd.waitall()
            elapsed = max(time.time() - tic, 1e-9)
            if args.no_pad:
                state.samples += len(train_data)    # every worker's parts, once
            if not rounds:
                # dist_async: every rank evaluates the servers' weights. (With rounds this
                # would cut the round short: each worker evaluates its own weights.)
                trainer.sync_weights()
            (_, train_loss), (_, train_acc) = (m.get() for m in
                                               dg.reduce_metric(metric, kv=kv).metrics)
            val_loss, val_acc = evaluate(net, val_loader, val_sampler, loss_fn, kv,
                                         devices[0])
            speed = (len(train_data) if args.no_pad
                     else len(train_sampler) * workers) / elapsed
            state.train_time += elapsed
            state.history = state.history + [{
                "epoch": epoch + 1, "train_loss": train_loss, "train_acc": train_acc,
                "val_loss": val_loss, "val_acc": val_acc}]
            state.epoch, state.done = epoch + 1, 0
            state.commit()
            log(f"epoch {epoch + 1}/{args.epochs}: train_loss={train_loss:.4f} "
                f"train_acc={train_acc:.4f} val_loss={val_loss:.4f} val_acc={val_acc:.4f} "
                f"time={elapsed:.1f}s samples/s={speed:.0f}")
            if checkpointer is not None:
                checkpointer.save(net, trainer, epoch + 1, extra={"history": state.history})
            if args.plot and kv.rank == 0:
                save_plot(state.history, args.plot)
                # beside the curves: each rank's step time, split (docs/observability.md)
                timeline.save_step_plot(timeline.steps_plot_path(args.plot))
            if stop_at is not None and epoch + 1 < args.epochs:   # at the epoch's last step
                log(f"stop: the launcher asked the job to stop at the end of epoch "
                    f"{epoch + 1}; exiting for the restart (--resume)")
                return False
        return True

    if not (dg.elastic.run(train) if args.elastic_memory else train)(state):
        return
    history = state.history
    val_sampler, val_loader = loaders()[1::2]
    if rounds and history:
        # the last round, cut short: the weights every worker agrees on
        trainer.sync_weights()
        val_loss, val_acc = evaluate(net, val_loader, val_sampler, loss_fn, kv, devices[0])
        history[-1].update(val_loss=val_loss, val_acc=val_acc)
        log(f"synchronised: val_loss={val_loss:.4f} val_acc={val_acc:.4f}")
    if not history or state.train_time == 0:
        log(f"the checkpoint is at epoch {state.epoch}, --epochs is {args.epochs}: "
            "nothing to train, evaluating it")
        val_loss, val_acc = evaluate(net, val_loader, val_sampler, loss_fn, kv, devices[0])
        history.append({"epoch": state.epoch, "val_loss": val_loss, "val_acc": val_acc})
    elif args.plot:
        steps = timeline.steps_plot_path(args.plot)
        log(f"plot: {args.plot}" + (f", step times by rank: {steps}"
                                    if os.path.exists(steps) else ""))
    # every worker's digest of its weights: the same everywhere, or the replicas drifted
    replicas = "equal" if len(set(kv.allgather_object(weights_digest(net)))) == 1 else "differ"
    final = history[-1]
    speed = state.samples / state.train_time if state.train_time else float("nan")
    log(f"summary: val_acc={final['val_acc']:.4f} val_loss={final['val_loss']:.4f} "
        f"epochs={final['epoch']} backend={kv.type} workers={kv.num_workers} "
        f"sync_every={args.sync_every} replicas={replicas} "
        f"samples/s={speed:.0f} time={time.time() - started:.1f}s")


if __name__ == "__main__":
    main()
