"""Worker: time sums over the workers on every rank, dist_gluon vs the raw library call.

The calls and their interleaving are ../bench_comm.py's (dist_gluon's
``pushpull(key, x, priority=-i)`` per tensor against ``hvd.allreduce_`` or MXNet's own
``kv.pushpull``, alternating repetition by repetition, each started from a barrier).
Across hosts the ranks do not finish together: on a parameter server a worker whose
keys sit on its own host's server has its sum as soon as the last push arrives, the
others wait for the pull to cross their link. So every rank times every repetition,
and a repetition's time is the slowest rank's: when the sum is complete everywhere.
Prints one ``BENCH {json}`` line on rank 0.
"""
from __future__ import annotations

import argparse
import json

import mxnet as mx
import numpy as np
from _common import Clock, launcher_backend, report, summarise
from bench_comm import DistGluon, RawHorovod, RawKVStore

import dist_gluon as dg


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", required=True,
                        help="JSON file: list of {'name': str, 'shapes': [[...], ...]}")
    parser.add_argument("--reps", type=int, default=3, help="timed repetitions per case")
    parser.add_argument("--warmup", type=int, default=1, help="untimed repetitions per case")
    return parser.parse_args()


def main():
    args = parse_args()
    with open(args.cases) as f:
        cases = json.load(f)
    kv = dg.create()
    impls = [DistGluon(kv)]
    impls.append(RawHorovod() if launcher_backend() == "horovod" else RawKVStore(kv))

    mine = []   # [case][impl name] -> this rank's seconds per timed repetition
    for c, case in enumerate(cases):
        shapes = [tuple(s) for s in case["shapes"]]
        arrays = {impl.name: [mx.nd.ones(s) for s in shapes] for impl in impls}
        keys = {impl.name: [f"{impl.name}.c{c}.{i}" for i in range(len(shapes))]
                for impl in impls}
        times = {impl.name: [] for impl in impls}
        for rep in range(args.warmup + args.reps):
            for impl in impls if rep % 2 == 0 else impls[::-1]:
                for arr in arrays[impl.name]:
                    arr[:] = 1.0
                impl.barrier()
                with Clock(mx) as clock:
                    impl.reduce(keys[impl.name], arrays[impl.name])
                if rep >= args.warmup:
                    times[impl.name].append(clock.seconds)
        for impl in impls:
            got = arrays[impl.name][0].asnumpy().ravel()[0]
            if got != kv.num_workers:
                raise RuntimeError(f"{impl.name} summed to {got}, expected {kv.num_workers}")
        mine.append(times)
    everyone = kv.allgather_object(mine)
    results = []
    for c, case in enumerate(cases):
        nbytes = sum(int(np.prod(s)) * 4 for s in case["shapes"])
        entry = {"case": case["name"], "bytes": nbytes, "tensors": len(case["shapes"]),
                 "times": {}, "rank0": {}}
        for impl in impls:
            per_rank = [rank_times[c][impl.name] for rank_times in everyone]
            slowest = [max(rep) for rep in zip(*per_rank)]
            entry["times"][impl.name] = summarise(slowest)
            entry["rank0"][impl.name] = summarise(per_rank[0])
        results.append(entry)
    report({"kind": "comm", "backend": launcher_backend(), "workers": kv.num_workers,
            "results": results})


if __name__ == "__main__":
    main()
