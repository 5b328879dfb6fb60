"""Worker: throughput of Local SGD / DiLoCo rounds against per-step averaging.

Run by ``benchmarks/run_cluster.py`` (part ``slow``) on every host of an emulated
cluster. One model (gluoncv ``resnet50_v1b`` or ``vgg16``), one fixed random batch per
worker, SGD with momentum as the inner optimizer, and one trainer at a time
(``--impls``; each trainer is dropped before the next is built, since a round keeps a
copy of the parameters and of their deltas):

- ``compute``: ``gluon.Trainer(kvstore=None)`` while the other workers do the same: the
  step of perfect scaling on this machine. Every job also times it right before and
  right after its trainer (``compute_seconds``, their mean), so that each trainer's
  scaling compares two figures taken under the same load;
- ``per_step``: ``dg.DistributedTrainer`` averaging the gradients every step;
- ``diloco:H`` / ``diloco_fp16:H`` / ``diloco_2bit:H`` / ``diloco_powersgd:H``: DiLoCo
  (outer Nesterov, lr 0.7, momentum 0.9) every H steps, the pseudo-gradients in
  float32, float16, 2-bit (threshold 1e-3, error feedback) or PowerSGD (rank 4, error
  feedback). Local SGD puts the same bytes on the wire at the same moments (only the
  outer update differs), so it is not timed apart;
- ``diloco_fp16_overlap:H``: the same with ``sync_delay=H``: each round's sum runs
  during the next round, whose last step applies it.

A round is timed whole: H consecutive steps beginning right after a synchronisation,
the last of which synchronises, waiting for the engine only at the block's ends (so
the synchronisation's sum may overlap nothing but itself: the next forward needs its
result). The synchronisation alone (after one local step) is timed too. With the
overlap one untimed round comes first, so that the timed one begins with a sum in
flight and ends when the parameters are ready (its own sum still in flight): the
steady state.

Prints one ``BENCH {json}`` line on rank 0 (see ../_common.py).
"""
from __future__ import annotations

import argparse
import gc
import time

import mxnet as mx
from _common import launcher_backend, report
from mxnet import gluon
from train import MODELS, build_model, busy_share, machine_ticks

import dist_gluon as dg

INNER = ("sgd", {"learning_rate": 0.001, "momentum": 0.9, "wd": 1e-5})
# the pseudo-gradients' codec of each DiLoCo variant (the bytes on the wire do not
# depend on the 2-bit threshold)
CODECS = {"diloco": None, "diloco_fp16": "fp16",
          "diloco_2bit": {"type": "2bit", "threshold": 1e-3}, "diloco_powersgd": "powersgd"}
OUTER = {"learning_rate": 0.7, "momentum": 0.9}


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=tuple(MODELS), required=True)
    parser.add_argument("--impls", required=True,
                        help="comma-separated: compute, per_step, diloco:H, diloco_fp16:H, "
                             "diloco_2bit:H, diloco_powersgd:H, each DiLoCo one with "
                             "_overlap")
    parser.add_argument("--batch", type=int, default=16, help="batch size per worker")
    parser.add_argument("--image", type=int, default=112, help="input height and width")
    parser.add_argument("--steps", type=int, default=2,
                        help="timed steps of compute and per_step (one untimed before)")
    return parser.parse_args()


def main():
    args = parse_args()
    net, data, label, loss_fn = build_model(args)
    params = net.collect_params()
    kv = dg.create()

    def one_step(trainer):
        with mx.autograd.record():
            loss = loss_fn(net(data), label)
        loss.backward()
        trainer.step(args.batch)

    def timed(trainer, count, steady=False):
        """Seconds per step, CPU seconds per step and the machine's busy share. With
        ``steady`` whatever is in flight stays so, at both ends: the block ends when
        the parameters are ready."""
        if not steady:
            mx.nd.waitall()
        kv.barrier()
        t0, cpu0, machine0 = time.perf_counter(), time.process_time(), machine_ticks()
        for _ in range(count):
            one_step(trainer)
        if steady:
            for p in params.values():
                p.data().wait_to_read()
        else:
            mx.nd.waitall()
        return {"seconds": (time.perf_counter() - t0) / count,
                "cpu_seconds": (time.process_time() - cpu0) / count,
                "machine_busy": busy_share(machine0, machine_ticks())}

    compute = gluon.Trainer(params, *INNER, kvstore=None)
    one_step(compute)
    results = {}
    for impl in args.impls.split(","):
        before = timed(compute, args.steps)["seconds"]
        name, _, every = impl.partition(":")
        if name == "compute":
            trainer = gluon.Trainer(params, *INNER, kvstore=None)
        elif name == "per_step":
            trainer = dg.DistributedTrainer(params, INNER[0], dict(INNER[1]), kv=kv)
        else:
            trainer = dg.DistributedTrainer(
                params, INNER[0], dict(INNER[1]), kv=kv, sync_every=int(every),
                outer_optimizer="nag", outer_optimizer_params=dict(OUTER),
                compression=CODECS[name.removesuffix("_overlap")],
                sync_delay=int(every) if name.endswith("overlap") else 0)
        one_step(trainer)                   # untimed: the optimizer's states, the keys
        if name in ("compute", "per_step"):
            results[impl] = timed(trainer, args.steps)
        elif name.endswith("overlap"):
            trainer.sync_weights()
            for _ in range(int(every)):     # untimed: a round whose sum is in flight
                one_step(trainer)
            results[impl] = {"round": timed(trainer, int(every), steady=True),
                             "every": int(every), "sync_seconds": None}
        else:
            trainer.sync_weights()          # the first synchronisation, untimed
            results[impl] = {"round": timed(trainer, int(every)), "every": int(every)}
            one_step(trainer)
            mx.nd.waitall()
            kv.barrier()
            t0 = time.perf_counter()
            trainer.sync_weights()
            mx.nd.waitall()
            results[impl]["sync_seconds"] = time.perf_counter() - t0
        results[impl]["compute_seconds"] = (before + timed(compute, args.steps)["seconds"]) / 2
        del trainer
        gc.collect()
    plist = [p for p in params.values() if p.grad_req != "null"]
    report({"kind": "slow_links", "backend": launcher_backend(), "model": args.model,
            "batch": args.batch, "image": args.image,
            "parameters": int(sum(p.data().size for p in plist)), "results": results})


if __name__ == "__main__":
    main()
