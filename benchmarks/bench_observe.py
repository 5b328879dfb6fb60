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
steps, and the median of each round's ratio with its quartiles: many short rounds make
load from other processes hit the modes of a round alike, so the paired ratios resolve
what medians over whole runs cannot), and the interval at which the check costs 0.5%.

The wall-clock ratios are noisy on a shared machine, so the work the reporter adds is
also counted directly: the training thread's own CPU time per step
(``time.thread_time``, which other processes' load does not inflate), the process's CPU
time per step (the reporter's helper threads and the engine's work included), each of
the reporter's two helper threads' own CPU time per step (its CPU clock,
``time.pthread_getcpuclockid``: the mean over a mode's steps, since a helper writes
the trace in bursts), and the operations the reporter queues on MXNet's engine per step
(its one-element copies).
"""
from __future__ import annotations

import argparse
import math
import statistics
import time

import mxnet as mx
import numpy as np
from _common import report, summarise
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
    parser.add_argument("--steps", type=int, default=4, help="timed steps per mode and round")
    parser.add_argument("--rounds", type=int, default=40)
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

    # the reporter's operations on the engine, counted
    markers = [0]
    make_marker = timeline._marker

    def counted_marker(array):
        markers[0] += 1
        return make_marker(array)

    timeline._marker = counted_marker

    # the reporter's helper threads: each one's own CPU clock
    helpers = {"results": reporter._thread, "inputs": reporter._inputs_thread}
    clocks = {name: time.pthread_getcpuclockid(t.ident) for name, t in helpers.items()}

    def helper_cpu() -> dict[str, float]:
        return {name: time.clock_gettime(clock) for name, clock in clocks.items()}

    def run(steps: int, mode: str) -> tuple[list[float], list[float], list[float],
                                             list[dict[str, float]]]:
        timeline._reporter = None if mode == "off" else reporter
        reporter.events = mode == "timeline"
        trainer._sync_check.every = 1 if mode == "check" else never
        times, thread_cpu, process_cpu, helper = [], [], [], []
        last, last_thread, last_process = (time.perf_counter(), time.thread_time(),
                                           time.process_time())
        last_helper = helper_cpu()
        for x, y in timeline.data(batches[i % len(batches)] for i in range(steps)):
            with autograd.record():
                loss = loss_fn(net(x), y)
            loss.backward()
            trainer.step(args.batch)
            loss.mean().asscalar()
            now, thread, process = time.perf_counter(), time.thread_time(), time.process_time()
            times.append(now - last)
            thread_cpu.append(thread - last_thread)
            process_cpu.append(process - last_process)
            helpers_now = helper_cpu()
            helper.append({n: helpers_now[n] - last_helper[n] for n in clocks})
            last, last_thread, last_process, last_helper = now, thread, process, helpers_now
        mx.nd.waitall()
        return times, thread_cpu, process_cpu, helper

    run(args.warmup, "report")
    measured = {mode: [] for mode in MODES}
    thread_cpu = {mode: [] for mode in MODES}
    process_cpu = {mode: [] for mode in MODES}
    helper_cpu_per_step = {mode: [] for mode in MODES}
    engine_ops = {mode: 0 for mode in MODES}
    paired = {mode: [] for mode in MODES}     # each round: the mode's mean / off's
    for r in range(args.rounds):
        this_round = {}
        for mode in MODES[r % len(MODES):] + MODES[:r % len(MODES)]:
            before = markers[0]
            # the first step of a mode carries the previous mode's tail
            times, thread, process, helper = run(args.steps + 1, mode)
            engine_ops[mode] += markers[0] - before
            this_round[mode] = times[1:]
            measured[mode].extend(times[1:])
            thread_cpu[mode].extend(thread[1:])
            process_cpu[mode].extend(process[1:])
            helper_cpu_per_step[mode].extend(helper[1:])
        for mode in MODES:
            paired[mode].append(statistics.fmean(this_round[mode])
                                / statistics.fmean(this_round["off"]))
    timeline._reporter = reporter
    timeline._marker = make_marker
    medians = {m: statistics.median(t) for m, t in measured.items()}
    check_cost = medians["check"] - medians["report"]
    every = math.ceil(check_cost / (0.005 * medians["report"])) if check_cost > 0 else 1
    steps = len(measured["off"])
    thread_ms = {m: 1e3 * statistics.median(t) for m, t in thread_cpu.items()}
    report({"bench": "observe", "model": args.model, "batch": args.batch,
            "workers": kv.num_workers, "rounds": args.rounds, "steps_per_mode": steps,
            "median_step_s": medians,
            "ratio_to_off": {m: medians[m] / medians["off"] for m in MODES},
            # the same, round by round (load from other processes shifts whole rounds):
            # the median of the rounds' ratios and their quartiles
            "paired_ratio": {m: summarise(paired[m]) for m in MODES},
            # work added, counted: CPU of the training thread and of the process per step
            "thread_cpu_ms_per_step": thread_ms,
            "thread_cpu_added_vs_step": {m: (thread_ms[m] - thread_ms["off"])
                                         / (1e3 * medians["off"]) for m in MODES},
            "process_cpu_ms_per_step": {m: 1e3 * statistics.median(t)
                                        for m, t in process_cpu.items()},
            # each helper thread's own CPU, beside the training thread's: the mean per
            # step (a helper's work comes in bursts, a step's may fall in the next)
            "helper_cpu_ms_per_step": {
                m: {n: 1e3 * statistics.fmean(row[n] for row in rows) for n in clocks}
                for m, rows in helper_cpu_per_step.items()},
            "thread_cpu_ms_per_step_mean": {m: 1e3 * statistics.fmean(t)
                                            for m, t in thread_cpu.items()},
            "engine_ops_per_step": {m: engine_ops[m] / (args.rounds * (args.steps + 1))
                                    for m in MODES},
            "check_cost_s": check_cost, "check_every_for_half_percent": every})


if __name__ == "__main__":
    main()
