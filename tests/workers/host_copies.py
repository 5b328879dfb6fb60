"""Counts the copies of arrays between MXNet and NumPy (the host) in a block of code.

The per-step path must stay on MXNet's engine: on a GPU every copy to NumPy drains the
device and every upload stalls the Python thread. A worker script imports this module
(``sys.path`` holding tests/workers, as the worker scripts here arrange) and wraps its
steady steps::

    with HostCopies() as copies:
        for _ in range(3):
            train_step()
        mx.nd.waitall()
    print("HOST_COPIES", copies.count, copies.summary())

Counted: ``NDArray.asnumpy`` (MXNet -> NumPy; ``asscalar`` and ``print`` go through it)
and ``NDArray._sync_copyfrom`` (NumPy -> MXNet: ``mx.nd.array(numpy)`` and
``arr[:] = numpy``), of arrays with more than ``min_size`` elements: a scalar read (one
batch size) is allowed, a gradient- or activation-sized copy is not.
"""
from __future__ import annotations

import traceback
from collections import Counter

import mxnet as mx

_NDArray = mx.nd.NDArray


class HostCopies:
    """A context manager that records every large copy between MXNet and NumPy."""

    def __init__(self, min_size: int = 64):
        self.min_size = min_size
        self.records: list[tuple[str, tuple, str]] = []
        self._saved = {}

    @property
    def count(self) -> int:
        return len(self.records)

    def summary(self, limit: int = 8) -> str:
        """The most frequent (direction, caller) pairs, for a failing test's message."""
        common = Counter((d, where) for d, _, where in self.records).most_common(limit)
        return "; ".join(f"{n}x {d} at {where}" for (d, where), n in common)

    def _record(self, direction: str, shape) -> None:
        size = 1
        for dim in shape:
            size *= dim
        if size <= self.min_size:
            return
        frames = [f for f in traceback.extract_stack()[:-2]
                  if "host_copies.py" not in f.filename]
        # the innermost frame of dist_gluon, else the innermost outside mxnet
        culprit = next((f for f in reversed(frames) if "dist_gluon" in f.filename), None) \
            or next((f for f in reversed(frames) if "/mxnet/" not in f.filename), None)
        where = f"{culprit.filename.rsplit('/', 2)[-1]}:{culprit.lineno}" if culprit else "?"
        self.records.append((direction, tuple(shape), where))

    def __enter__(self) -> HostCopies:
        asnumpy, copyfrom = _NDArray.asnumpy, _NDArray._sync_copyfrom
        self._saved = {"asnumpy": asnumpy, "_sync_copyfrom": copyfrom}
        counter = self

        def counted_asnumpy(array, *args, **kwargs):
            counter._record("to NumPy", array.shape)
            return asnumpy(array, *args, **kwargs)

        def counted_copyfrom(array, source, *args, **kwargs):
            counter._record("from NumPy", array.shape)
            return copyfrom(array, source, *args, **kwargs)

        _NDArray.asnumpy = counted_asnumpy
        _NDArray._sync_copyfrom = counted_copyfrom
        return self

    def __exit__(self, *exc) -> None:
        for name, original in self._saved.items():
            setattr(_NDArray, name, original)
