"""The interface between the gradient averaging path and a compression codec."""
from __future__ import annotations

from typing import Any

import mxnet as mx
import numpy as np


class Codec:
    """Sums gradients over the workers in a compressed form, in place.

    :meth:`reduce` is called with every worker's gradients of the same parameters in the
    same order (a collective), only when there are several workers. Afterwards each
    gradient holds the sum over the workers of what the codec reconstructs, in the
    gradient's own dtype; the caller divides by the summed batch sizes as without
    compression.

    State that differs between workers (residuals) is :meth:`local_state`; state that is
    the same on every worker (PowerSGD's Q, step counts) is :meth:`shared_state`. Both
    are dicts of picklable values, saved by Checkpointer.

    The same state, kept in memory at every step by ``dg.elastic.State``, is
    :meth:`state_arrays` (the live arrays, by name, which the state copies on MXNet's
    engine and copies back) and :meth:`state_counters` (the picklable rest, and which
    arrays exist); :meth:`set_state_counters` puts the counters back, dropping arrays
    made after them and making those a new worker lacks. A codec declares its arrays in
    ``_array_fields`` (name -> the attribute holding a dict index -> array) and its
    counters in ``_counter_fields``; one whose state has another shape overrides the
    three methods. The fields whose arrays are each rank's own (error-feedback
    residuals: what this rank held back) are ``_private_fields`` (:meth:`is_private`): a
    worker that heals from a peer starts them at zero instead of copying the peer's,
    which would send the peer's held-back part twice.
    """

    name = "base"
    # reduce() takes a whole step's tensors in one call (packs and pipelines them)
    batched = True
    # Parameters (constructor keywords) as given, for checkpoints and messages.
    params: dict[str, Any]

    def reduce(self, kv, indices: list, keys: list[str], grads: list[mx.nd.NDArray],
               priority: int) -> None:
        raise NotImplementedError

    def local_state(self) -> dict:
        return {}

    def shared_state(self) -> dict:
        return {}

    def load_state(self, shared: dict, local: dict) -> None:
        """Restore state saved by :meth:`shared_state` and :meth:`local_state`."""

    # ------------------------------------------------------------ in memory
    _array_fields: dict[str, str] = {}
    _counter_fields: tuple[str, ...] = ()
    _private_fields: tuple[str, ...] = ()

    def is_private(self, name: str) -> bool:
        """Whether the array ``name`` of :meth:`state_arrays` is this rank's own (a
        residual), not the same on every rank."""
        return name.split(".", 1)[0] in self._private_fields

    def state_arrays(self) -> dict[str, mx.nd.NDArray]:
        """The state's live arrays by name (``'<field>.<index>'``); an array still held
        in NumPy since :meth:`load_state` becomes an NDArray here, on the CPU (the
        codec moves it to the gradient's device at its next step)."""
        arrays = {}
        for field, attribute in self._array_fields.items():
            held = getattr(self, attribute)
            for index, value in held.items():
                if isinstance(value, np.ndarray):
                    value = held[index] = mx.nd.array(value, dtype=value.dtype)
                arrays[f"{field}.{index}"] = value
        return arrays

    def state_counters(self) -> dict:
        """The counters (copies) and the layout of :meth:`state_arrays`."""
        layout = [(field, index, tuple(a.shape), np.dtype(a.dtype).name)
                  for field, attribute in self._array_fields.items()
                  for index, a in getattr(self, attribute).items()]
        return {"layout": layout,
                "counters": {name: dict(getattr(self, name)) for name in self._counter_fields}}

    def set_state_counters(self, saved: dict, ctx_of) -> None:
        """Put back :meth:`state_counters`: an array the layout lacks goes, one it names
        that this codec lacks is made (zeros, on ``ctx_of(index)``) for the caller to
        fill."""
        wanted: dict = {}
        for field, index, shape, dtype in saved["layout"]:
            wanted.setdefault(field, {})[index] = (shape, dtype)
        for field, attribute in self._array_fields.items():
            held, mine = getattr(self, attribute), wanted.get(field, {})
            for index in [i for i in held if i not in mine]:
                del held[index]
            for index, (shape, dtype) in mine.items():
                if index not in held:
                    held[index] = mx.nd.zeros(shape, ctx=ctx_of(index), dtype=dtype)
        for name, value in saved["counters"].items():
            setattr(self, name, dict(value))

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.params.items())
        return f"{type(self).__name__}({args})"


def exact_integers(kv) -> tuple[str, int]:
    """The dtype in which ``kv`` sums non-negative integers exactly, and how many bits of
    them: horovod sums int32 (31 bits); the ps-lite servers sum in float32 (24 bits)."""
    return getattr(kv, "_exact_integers", ("float32", 24))


def plain_sum(kv, keys: list[str], arrays: list[mx.nd.NDArray], priority: int) -> None:
    """Sum ``arrays`` over the workers in place, uncompressed (one call)."""
    if not arrays:
        return
    if len(arrays) == 1:
        kv.pushpull(keys[0], arrays[0], priority=priority)
    else:
        kv.pushpull(keys, arrays, priority=priority)


def check_number(name: str, value, low: float, integer: bool = False,
                 strict: bool = False) -> Any:
    """``value`` checked to be a number >= low (> low if strict); a ValueError names it."""
    kind = int if integer else float
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)) \
            or (integer and not float(value).is_integer()):
        raise ValueError(f"compression parameter {name!r} must be "
                         f"{'an integer' if integer else 'a number'}, got {value!r}")
    if value < low or (strict and value == low):
        raise ValueError(f"compression parameter {name!r} must be "
                         f"{'>' if strict else '>='} {low}, got {value!r}")
    return kind(value)
