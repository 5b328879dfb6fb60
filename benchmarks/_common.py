"""Helpers shared by the benchmark worker scripts (run through dist_gluon.launch).

A worker reports by printing one ``BENCH {json}`` line on rank 0; ``run.py`` collects
those lines from the launcher's ``[0] `` prefixed output.
"""
from __future__ import annotations

import json
import os
import statistics
import time

RESULT_TAG = "BENCH "


def launcher_backend() -> str:
    """The backend the launcher started this job for: horovod, dist_sync or p3."""
    return os.environ.get("DG_BACKEND", "local")


def report(payload: dict) -> None:
    """Print the result line, on the launcher's rank 0 only."""
    if os.environ.get("DG_RANK", "0") == "0":
        print(RESULT_TAG + json.dumps(payload), flush=True)


def summarise(seconds: list[float]) -> dict:
    """Median and quartiles of a list of timings, in seconds."""
    ordered = sorted(seconds)
    if len(ordered) >= 4:
        q1, _, q3 = statistics.quantiles(ordered, n=4)
    else:
        q1, q3 = ordered[0], ordered[-1]
    return {"median": statistics.median(ordered), "q1": q1, "q3": q3, "n": len(ordered)}


class Clock:
    """Wall-clock seconds of a block that ends with every MXNet operation finished."""

    def __init__(self, mx):
        self._mx = mx

    def __enter__(self):
        self._mx.nd.waitall()
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self._mx.nd.waitall()
        self.seconds = time.perf_counter() - self.start
        return False
