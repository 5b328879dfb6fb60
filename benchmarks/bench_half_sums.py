"""Worker: what a horovod sum of float16 costs against float32, per element count.

Run through the launcher, e.g. on loopback:

    OMP_NUM_THREADS=1 .venv/bin/python -m dist_gluon.launch -n 2 --backend horovod \\
        -- .venv/bin/python benchmarks/bench_half_sums.py

Over Gloo, horovod 0.28.1 as released sums float16 with Gloo's scalar conversions
(``gloo::sum<float16>``), so a float16 sum of half the bytes can take more time and CPU
than the float32 one; the build ``make setup`` installs (dist_gluon/build_horovod.py,
0.28.1+dg2) sums them with F16C, as horovod's own sum over MPI does. Rank 0 prints, per
dtype, the median wall time and CPU time of this process (all threads) of ``--reps``
in-place sums of ``--elements`` elements (default: ResNet-50's 25.6M parameters), float32
and float16 taking turns.
"""
from __future__ import annotations

import argparse
import statistics
import time

import mxnet as mx


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--elements", type=int, default=25_557_032)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    import horovod.mxnet as hvd

    hvd.init()
    arrays = {dtype: mx.nd.ones((args.elements,), dtype=dtype)
              for dtype in ("float32", "float16")}
    timings: dict = {dtype: [] for dtype in arrays}
    for rep in range(args.reps + 1):
        for dtype, array in arrays.items():
            cpu, wall = time.process_time(), time.perf_counter()
            hvd.allreduce_(array, name=f"half-sums.{dtype}", op=hvd.Sum)
            array.wait_to_read()
            if rep:      # the first is a warm-up
                timings[dtype].append((time.perf_counter() - wall,
                                       time.process_time() - cpu))
    if hvd.rank() == 0:
        for dtype, found in timings.items():
            print(f"{dtype}: {args.elements} elements on {hvd.size()} workers: sum "
                  f"{1000 * statistics.median(w for w, _ in found):.0f} ms, CPU of this "
                  f"process {1000 * statistics.median(c for _, c in found):.0f} ms "
                  f"(medians of {args.reps})", flush=True)


if __name__ == "__main__":
    main()
