"""Worker: time the sum of tensors over the workers, dist_gluon vs the raw library call.

Run by ``run.py`` through ``python -m dist_gluon.launch -n 2 --backend B``. In one job it
measures, interleaved repetition by repetition (alternating which goes first) so that
load from other processes hits both alike:

- ``dist_gluon``: ``dg.create().pushpull(key, array, priority=-i)``, one call per tensor
  (what DistributedTrainer issues);
- ``raw``: on horovod ``hvd.allreduce_(array, op=hvd.Sum, priority=-i)``; on dist_sync
  and p3 ``kv.pushpull(key, array, out=array, priority=-i)`` on MXNet's own
  ``mx.kv.create('dist_sync')`` store (the one the dist_gluon backend wraps: ps-lite
  starts once per process, so a second store cannot be created next to it).

Each case is a list of float32 shapes (one tensor of N MiB, or ResNet-50's parameters).
Every timed repetition starts from a barrier and ends when every result is ready.
"""
from __future__ import annotations

import argparse
import json

import mxnet as mx
import numpy as np
from _common import Clock, launcher_backend, report, summarise

import dist_gluon as dg


class DistGluon:
    name = "dist_gluon"

    def __init__(self, kv):
        self.kv = kv

    def reduce(self, keys, arrays):
        for i, (key, arr) in enumerate(zip(keys, arrays)):
            self.kv.pushpull(key, arr, priority=-i)

    def barrier(self):
        self.kv.barrier()


class RawHorovod:
    name = "raw"

    def __init__(self):
        import horovod.mxnet as hvd
        self.hvd = hvd
        self._token = mx.nd.zeros((1,))

    def reduce(self, keys, arrays):
        for i, (key, arr) in enumerate(zip(keys, arrays)):
            self.hvd.allreduce_(arr, name=key, priority=-i, op=self.hvd.Sum)

    def barrier(self):
        self.hvd.allreduce_(self._token, name="raw.barrier", op=self.hvd.Sum)
        self._token.wait_to_read()


class RawKVStore:
    name = "raw"

    def __init__(self, backend):
        # MXNet's own kvstore object (mx.kv.create('dist_sync')) under the backend.
        self.kv = backend._kv
        self._known: set[str] = set()

    def reduce(self, keys, arrays):
        new = [(k, a) for k, a in zip(keys, arrays) if k not in self._known]
        if new:
            self.kv.init([k for k, _ in new], [mx.nd.zeros(a.shape) for _, a in new])
            self._known.update(k for k, _ in new)
        for i, (key, arr) in enumerate(zip(keys, arrays)):
            self.kv.pushpull(key, arr, out=arr, priority=-i)

    def barrier(self):
        self.kv._barrier()


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", required=True,
                        help="JSON file: list of {'name': str, 'shapes': [[...], ...]}")
    parser.add_argument("--reps", type=int, default=7, help="timed repetitions per case")
    parser.add_argument("--warmup", type=int, default=2, help="untimed repetitions per case")
    return parser.parse_args()


def main():
    args = parse_args()
    with open(args.cases) as f:
        cases = json.load(f)
    kv = dg.create()
    impls = [DistGluon(kv)]
    impls.append(RawHorovod() if launcher_backend() == "horovod" else RawKVStore(kv))

    results = []
    for c, case in enumerate(cases):
        shapes = [tuple(s) for s in case["shapes"]]
        nbytes = sum(int(np.prod(s)) * 4 for s in shapes)
        arrays = {impl.name: [mx.nd.ones(s) for s in shapes] for impl in impls}
        keys = {impl.name: [f"{impl.name}.c{c}.{i}" for i in range(len(shapes))]
                for impl in impls}
        times = {impl.name: [] for impl in impls}
        for rep in range(args.warmup + args.reps):
            # alternate which goes first, so neither always follows the other's traffic
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
        results.append({"case": case["name"], "bytes": nbytes, "tensors": len(shapes),
                        "times": {name: summarise(t) for name, t in times.items()}})
    report({"kind": "comm", "backend": launcher_backend(), "workers": kv.num_workers,
            "results": results})


if __name__ == "__main__":
    main()
