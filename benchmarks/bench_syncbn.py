"""Worker: the cost of dg.SyncBatchNorm per training step, against nn.BatchNorm.

Run by ``run.py`` through ``python -m dist_gluon.launch -n 2 --backend B``. Three copies of
gluoncv's ``resnet18_v1b``, each with its own ``dg.DistributedTrainer``, take turns step
by step (in an order rotated every round, so that load from other processes hits all
alike); a step is forward, backward, gradient sum and update, ended by
``mx.nd.waitall()``:

- ``batchnorm_hybrid``: ``nn.BatchNorm``, hybridized (what a training script does
  without SyncBatchNorm);
- ``batchnorm``: ``nn.BatchNorm``, not hybridized;
- ``syncbn``: ``norm_layer=dg.SyncBatchNorm``, not hybridized (it cannot be on several
  workers): one collective per BatchNorm layer in the forward and one in the backward
  pass.
"""
from __future__ import annotations

import argparse

import mxnet as mx
import numpy as np
from _common import Clock, launcher_backend, report, summarise
from mxnet import autograd, gluon

import dist_gluon as dg
from dist_gluon.backends import horovod_tuning

IMPLS = ("batchnorm_hybrid", "batchnorm", "syncbn")
# at most this many steps for horovod's tuner (its warm-up, then up to 1 + 12 a cycle)
TUNING_STEPS = (horovod_tuning.WARMUP_STEPS
                + len(horovod_tuning.CYCLES_MS) * (1 + horovod_tuning.MAX_STEPS))
OPTIMIZER_PARAMS = {"learning_rate": 0.001, "momentum": 0.9, "wd": 1e-5}


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8, help="batch size per worker")
    parser.add_argument("--image", type=int, default=64, help="input height and width")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per model")
    parser.add_argument("--steps", type=int, default=1, help="timed steps per round")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--wait-backward", action="store_true",
                        help="wait for the backward pass before trainer.step (every model):"
                             " SyncBatchNorm's backward sums then cannot queue behind the "
                             "gradients' (a variant, FINDINGS 11c/11d)")
    return parser.parse_args()


def build(impl, kv):
    from gluoncv.model_zoo import resnet18_v1b

    mx.random.seed(0)
    norm = dg.SyncBatchNorm if impl == "syncbn" else gluon.nn.BatchNorm
    net = resnet18_v1b(classes=1000, norm_layer=norm)
    net.initialize(mx.init.Xavier())
    if impl == "batchnorm_hybrid":
        net.hybridize()
    trainer = dg.DistributedTrainer(net.collect_params(), "sgd", dict(OPTIMIZER_PARAMS),
                                    kv=kv)
    layers = sum(isinstance(b, gluon.nn.BatchNorm) for b in _blocks(net))
    return net, trainer, layers


def _blocks(block):
    yield block
    for child in block._children.values():
        yield from _blocks(child)


def main():
    args = parse_args()
    kv = dg.create()
    rng = np.random.RandomState(kv.rank)
    data = mx.nd.array(rng.rand(args.batch, 3, args.image, args.image))
    label = mx.nd.array(rng.randint(0, 1000, size=args.batch))
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    models = {impl: build(impl, kv) for impl in IMPLS}

    def one_step(impl):
        net, trainer, _ = models[impl]
        with Clock(mx) as clock:
            with autograd.record():
                loss = loss_fn(net(data), label)
            loss.backward()
            if args.wait_backward:
                mx.nd.waitall()
            trainer.step(args.batch)
        return clock.seconds

    # horovod's cycle is tuned on the SyncBatchNorm model's steps alone, as in a job that
    # trains it (dist_gluon/backends/horovod_tuning.py): with the models taking turns,
    # each model's first steps after horovod starts again negotiate its tensors afresh,
    # so a window timed after a restart paid for that and the default cycle's did not
    # (FINDINGS 11e). Then the warm-up's steps take turns, every model's first untimed.
    tuner = getattr(kv, "_tuner", None)
    for _ in range(TUNING_STEPS):
        if tuner is None or tuner.done:
            break
        kv.barrier()
        one_step("syncbn")
    for _ in range(args.warmup):
        for impl in IMPLS:
            kv.barrier()
            one_step(impl)
    times = {impl: [] for impl in IMPLS}
    for r in range(args.rounds):
        shift = r % len(IMPLS)
        for impl in IMPLS[shift:] + IMPLS[:shift]:
            kv.barrier()
            times[impl].extend(one_step(impl) for _ in range(args.steps))
    report({"kind": "syncbn", "backend": launcher_backend(), "model": "resnet18_v1b",
            "batch": args.batch, "image": args.image, "layers": models["syncbn"][2],
            "times": {impl: summarise(t) for impl, t in times.items()}})


if __name__ == "__main__":
    main()
