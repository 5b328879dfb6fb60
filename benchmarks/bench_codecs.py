"""Codec throughput on one core (part 5 of `make bench`): GB/s of float32 gradient that
each compression codec processes, beside MXNet's own C++ 2-bit and a memory copy.

    OMP_NUM_THREADS=1 python benchmarks/bench_codecs.py --shapes resnet50.json [--quick]

A codec's figure is the bytes of gradient given to ``codec.reduce`` divided by the wall
time of the call and everything it queued (``mx.nd.waitall()``), on a kvstore whose sum
does nothing (one process, no network): the codec's own work per step, what it adds to
a step's CPU time on every worker. 2-bit is quantise + pack + unpack, on the fused
kernels and on the stock-operator fallback; PowerSGD (rank 4) is P, the orthonormal
basis, Q and the approximation with its error; fp16 is the two casts; onebit is
BytePS's (scaling, error feedback and Nesterov momentum, as its example's flags), whose
packing and decompress-and-sum also run on fused kernels, with its fallback. MXNet's 2-bit is a
``device`` kvstore with ``set_gradient_compression({'type': '2bit'})``: its push
quantises and its pull dequantises, one key per tensor, in C++. Memory copy is a
one-thread ``NDArray.copyto`` of the largest case: bytes of gradient per second, so a
copy reads and writes each byte once.

Prints one ``BENCH {json}`` line (benchmarks/_common.py).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import mxnet as mx  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks._common import report  # noqa: E402
from dist_gluon import _kernels, compression  # noqa: E402


class NoNetwork:
    """A 2-worker kvstore whose sum leaves the arrays as they are: the codec alone."""

    type = "none"
    num_workers = 2
    rank = 0
    _exact_integers = ("int32", 31)      # as horovod's

    def pushpull(self, key, value, out=None, priority=0):
        pass


def timed(step, reps: int) -> float:
    """Median seconds of ``step()`` and the operations it queued, after one warm-up."""
    seconds = []
    for rep in range(reps + 1):
        mx.nd.waitall()
        start = time.perf_counter()
        step()
        mx.nd.waitall()
        if rep:
            seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)


def gradients(shapes, seed: int = 0) -> list[mx.nd.NDArray]:
    rng = np.random.RandomState(seed)
    return [mx.nd.array(rng.standard_normal(shape).astype(np.float32) * 0.5)
            for shape in shapes]


def codec_seconds(spec, shapes, reps: int, fused: bool = True) -> float:
    codec = compression.create(compression.parse(spec))
    grads = gradients(shapes)
    indices = list(range(len(grads)))
    keys = [f"g.{i}" for i in indices]
    kv = NoNetwork()
    saved = _kernels.serves
    if not fused:
        _kernels.serves = lambda dtype, ctx: False
    try:
        return timed(lambda: codec.reduce(kv, indices, keys, grads, 0), reps)
    finally:
        _kernels.serves = saved


def mxnet_2bit_seconds(shapes, reps: int) -> float:
    kv = mx.kv.create("device")
    kv.set_gradient_compression({"type": "2bit", "threshold": 0.5})
    grads = gradients(shapes)
    outs = [mx.nd.zeros(g.shape) for g in grads]
    for i, g in enumerate(grads):
        kv.init(i, mx.nd.zeros(g.shape))

    def step():
        for i, (g, o) in enumerate(zip(grads, outs)):
            kv.push(i, g, priority=-i)
            kv.pull(i, out=o, priority=-i)
    return timed(step, reps)


def copy_seconds(shapes, reps: int) -> float:
    src = [mx.nd.ones(s) for s in shapes]
    dst = [mx.nd.empty(s) for s in shapes]

    def step():
        for a, b in zip(src, dst):
            a.copyto(b)
    return timed(step, reps)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", type=Path, required=True,
                        help="JSON list of ResNet-50's gradient shapes")
    parser.add_argument("--quick", action="store_true",
                        help="a 1024 x 25088 matrix instead of 4096 x 25088, 2 repetitions")
    args = parser.parse_args(argv)
    reps = 2 if args.quick else 3
    matrix = [(1024 if args.quick else 4096, 25088)]
    cases = {"matrix": matrix, "resnet50": [tuple(s) for s in json.loads(
        args.shapes.read_text())]}
    twobit_spec = {"type": "2bit", "threshold": 0.5}
    powersgd_spec = {"type": "powersgd", "rank": 4}
    # BytePS's example's flags: scaling, error feedback, Nesterov momentum
    onebit_spec = {"type": "onebit", "scaling": True, "ef": "vanilla",
                   "momentum": "nesterov", "momentum_mu": 0.9}
    impls = {
        "2bit": lambda shapes: codec_seconds(twobit_spec, shapes, reps),
        "2bit operators": lambda shapes: codec_seconds(twobit_spec, shapes, reps,
                                                       fused=False),
        "powersgd": lambda shapes: codec_seconds(powersgd_spec, shapes, reps),
        "powersgd operators": lambda shapes: codec_seconds(powersgd_spec, shapes, reps,
                                                           fused=False),
        "fp16": lambda shapes: codec_seconds("fp16", shapes, reps),
        "onebit": lambda shapes: codec_seconds(onebit_spec, shapes, reps),
        "onebit operators": lambda shapes: codec_seconds(onebit_spec, shapes, reps,
                                                         fused=False),
        "mxnet 2bit": lambda shapes: mxnet_2bit_seconds(shapes, reps),
        "memory copy": lambda shapes: copy_seconds(shapes, reps),
    }
    results = {"cases": {}, "fused_kernels": _kernels.available(),
               "load_start": os.getloadavg()}
    for case, shapes in cases.items():
        size = sum(int(np.prod(s)) for s in shapes) * 4
        entry = results["cases"][case] = {"bytes": size, "tensors": len(shapes),
                                          "seconds": {}}
        for name, impl in impls.items():
            entry["seconds"][name] = impl(shapes)
            print(f"{case} {name}: {size / entry['seconds'][name] / 1e9:.2f} GB/s",
                  file=sys.stderr, flush=True)
    results["load_end"] = os.getloadavg()
    report(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
