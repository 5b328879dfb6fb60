"""Worker: what observing a job costs (docs/observability.md), as ratios from one run.

    python -m dist_gluon.launch -n 2 --timeline /tmp/bench.json -- \\
        python benchmarks/bench_observe.py --model resnet18

Each round times ``--steps`` training steps (the loop a user writes: the next batch
through ``dist_gluon.timeline.data``, forward, backward, ``trainer.step``, the loss read
on the host) in each of four modes, their order rotated every round so that load from
other processes hits all alike:

- ``off``: no reporter (what a script run without the launcher, or ``--report off``
  without ``--timeline``, costs);
- ``report``: the per-step records the launcher's report reads (on by default);
- ``timeline``: ``--timeline``: the records and every trace event;
- ``check``: ``report`` with the ranks' weights compared after every step
  (``DG_CHECK_SYNC=1``): its extra time over ``report`` is the cost of one check, from
  which the default interval follows (the check may cost 0.5% of a step).

Rank 0 prints the median step time of each mode, the ratios to ``off`` (over all
steps, and the median of each round's ratio), and the interval at which the check costs
0.5%.
"""
from __future__ import annotations

import argparse
import math
import statistics
import time

import mxnet as mx
import numpy as np
from _common import report
from mxnet import autograd, gluon

import dist_gluon as dg
from dist_gluon import timeline

MODES = ("off", "report", "timeline", "check")


def build(args):
    mx.random.seed(0)
    if args.model.startswith("resnet"):
        from gluoncv.model_zoo import get_model
        net = get_model(f"{args.model}_v1b", pretrained=False, classes=1000)
        shape, classes = (args.batch, 3, args.image, args.image), 1000
    else:
        net = gluon.nn.HybridSequential()
        net.add(gluon.nn.Dense(256, activation="relu"), gluon.nn.Dense(10))
        shape, classes = (args.batch, 64), 10
    net.initialize(mx.init.Xavier())
    net.hybridize()
    rng = np.random.RandomState(0)
    batches = [(mx.nd.array(rng.rand(*shape)), mx.nd.array(rng.randint(0, classes,
                                                                       args.batch)))
               for _ in range(4)]
    with autograd.record():
        net(batches[0][0])
    return net, batches


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet18",
                        help="resnet18, resnet50 (gluoncv, *_v1b) or mlp")
    parser.add_argument("--batch", type=int, default=8, help="batch size per worker")
    parser.add_argument("--image", type=int, default=64, help="input height and width")
    parser.add_argument("--steps", type=int, default=8, help="timed steps per mode and round")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=4, help="untimed steps")
    args = parser.parse_args()

    kv = dg.create()
    net, batches = build(args)
    trainer = dg.DistributedTrainer(net.collect_params(), "sgd",
                                    {"learning_rate": 0.001, "momentum": 0.9})
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    reporter = timeline._get()
    if reporter is None or not reporter.events:
        raise SystemExit("run it through the launcher with --timeline FILE")
    never = trainer._sync_check.every

    def run(steps: int, mode: str) -> list[float]:
        timeline._reporter = None if mode == "off" else reporter
        reporter.events = mode == "timeline"
        trainer._sync_check.every = 1 if mode == "check" else never
        times, last = [], time.perf_counter()
        for x, y in timeline.data(batches[i % len(batches)] for i in range(steps)):
            with autograd.record():
                loss = loss_fn(net(x), y)
            loss.backward()
            trainer.step(args.batch)
            loss.mean().asscalar()
            now = time.perf_counter()
            times.append(now - last)
            last = now
        mx.nd.waitall()
        return times

    run(args.warmup, "report")
    measured = {mode: [] for mode in MODES}
    paired = {mode: [] for mode in MODES}     # each round: the mode's median / off's
    for r in range(args.rounds):
        this_round = {}
        for mode in MODES[r % len(MODES):] + MODES[:r % len(MODES)]:
            # the first step of a mode carries the previous mode's tail
            this_round[mode] = run(args.steps + 1, mode)[1:]
            measured[mode].extend(this_round[mode])
        for mode in MODES:
            paired[mode].append(statistics.median(this_round[mode])
                                / statistics.median(this_round["off"]))
    timeline._reporter = reporter
    medians = {m: statistics.median(t) for m, t in measured.items()}
    check_cost = medians["check"] - medians["report"]
    every = math.ceil(check_cost / (0.005 * medians["report"])) if check_cost > 0 else 1
    report({"bench": "observe", "model": args.model, "batch": args.batch,
            "workers": kv.num_workers, "steps_per_mode": len(measured["off"]),
            "median_step_s": medians,
            "ratio_to_off": {m: medians[m] / medians["off"] for m in MODES},
            # the same, round by round (load from other processes shifts whole rounds)
            "paired_ratio_median": {m: statistics.median(paired[m]) for m in MODES},
            "check_cost_s": check_cost, "check_every_for_half_percent": every})


if __name__ == "__main__":
    main()
