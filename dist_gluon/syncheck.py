"""Silent divergence caught: every N steps the ranks compare a digest of their weights
and optimizer states, and a difference ends the job naming the parameter, the ranks
and the step.

Replicas of data-parallel training must hold the same weights bit for bit: every rank
applies the same summed gradient to the same weights. When they do not (a rank-dependent
branch trained rank by rank, a rank that loaded another checkpoint, a codec or a
custom update that differs per rank) training goes on without a word and the ranks
drift apart. :class:`SyncCheck` looks every ``DG_CHECK_SYNC`` steps:

1. On MXNet's engine, one ``multi_sum_sq`` per group of tensors reduces every
   trainable weight and every optimizer state to one float32 number, its sum of
   squares (the digest: a few hundred floats for ResNet-50, nothing gradient-sized
   leaves the engine). Replicas that differ by accident differ there: only a change
   that keeps every tensor's norm (a sign flip, a permutation) would pass.
2. Each rank writes its digest into its own row of an ``(num_workers, D)`` array of
   zeros, and one sum over the workers (one small collective, the lowest priority)
   gives every rank every rank's row, exactly (adding zeros rounds nothing).
3. Every rank compares the rows on the host and, on a difference, raises the same
   :class:`DivergenceError`, naming the first parameter that differs, the ranks that
   hold another value than rank 0, and the step.

``DG_CHECK_SYNC=N`` sets the interval (``0`` turns the check off); the default,
:data:`DEFAULT_EVERY`, was chosen by measurement so that it costs at most 0.5% of a
step (docs/observability.md). Nothing runs on one process, on ``dist_async`` (whose
workers hold different weights by design), or before the first step.

Every rank must check at the same steps (the check is a collective), so the count of
steps (:attr:`SyncCheck.steps`) is training state, not the process's: the trainer keeps
it in its ``extra_state()`` counters, so ``dg.elastic.State`` puts it back at a restore
and a worker that joins or heals from a peer takes the peers' count instead of counting
from 0 (which would leave it in another collective than theirs).
"""
from __future__ import annotations

import os
from collections.abc import Callable, Sequence

import mxnet as mx
import numpy as np

from . import timeline

ENV = "DG_CHECK_SYNC"
# Steps between two checks when DG_CHECK_SYNC is not set. Measured on ResNet-18 (2
# workers, horovod over Gloo, 64x64 inputs, batch 8, 2 shared cores; benchmarks/
# bench_observe.py, docs/observability.md): one check costs 28-37 ms (the digest's
# kernels, one small sum, the engine drained once) against a 220 ms step, so every
# 25-34 steps would cost 0.5%; every 100 costs ~0.17%, with room for models whose
# states are larger for their step time.
DEFAULT_EVERY = 100
# multi_sum_sq takes at most this many arrays per call
_GROUP = 60


class DivergenceError(RuntimeError):
    """The ranks hold different weights or optimizer states: the replicas diverged."""


def interval(environ=None) -> int:
    """Steps between two checks, from DG_CHECK_SYNC (0: never). ValueError for a value
    that is not a non-negative integer."""
    text = (environ if environ is not None else os.environ).get(ENV, "").strip()
    if not text:
        return DEFAULT_EVERY
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise ValueError(f"{ENV}={text!r}: give the number of steps between two checks "
                         f"of the ranks' weights (0 turns the check off, default "
                         f"{DEFAULT_EVERY})")
    return value


class SyncCheck:
    """Compares the ranks' weights and optimizer states every ``every`` steps.

    Parameters
    ----------
    kv : Backend
        Its ``pushpull`` sums the digests over the workers.
    key : str
        The communication key of the digests (the same on every rank).
    every : int, optional
        Steps between two checks; None reads DG_CHECK_SYNC (:func:`interval`).
    """

    def __init__(self, kv, key: str, every: int | None = None):
        self._kv = kv
        self._key = key
        self.every = interval() if every is None else int(every)
        # steps seen, counted by after_step: the trainer's state (module docstring)
        self.steps = 0

    @property
    def active(self) -> bool:
        return self.every > 0 and self._kv.num_workers > 1

    def after_step(self, params: Sequence, states: Callable[[], dict],
                   describe: Callable[[int], str]) -> None:
        """Count a step and, every ``every`` steps, compare the ranks (a collective:
        every rank calls it at the same steps).

        Parameters
        ----------
        params : list of Parameter
            In the model's order (the same on every rank).
        states : callable
            ``states()``: the optimizer state arrays of each parameter, by model
            position (called only when the ranks are compared).
        describe : callable
            ``describe(position)`` names a parameter in the error.
        """
        self.steps += 1
        if not self.active or self.steps % self.every:
            return
        with timeline.span("compare the ranks' weights", "check"):
            self.check(params, states, describe)

    def check(self, params: Sequence, states: Callable[[], dict],
              describe: Callable[[int], str]) -> None:
        """Compare the ranks now (a collective); DivergenceError on every rank if any
        rank's digest differs from rank 0's."""
        labels, arrays = [], []
        optimizer_states = states()
        for position, param in enumerate(params):
            if param.grad_req == "null" or param._data is None:
                continue
            tensors = [("weight", param.list_data()[0])] + [
                (f"optimizer state {n}", state)
                for n, state in enumerate(optimizer_states.get(position, ()))]
            for what, array in tensors:
                if array.stype == "default" and array.size:     # dense ones only
                    labels.append((position, what))
                    arrays.append(array)
        if not arrays:
            return
        rows = self._gather(_digest(arrays))
        differ = np.nonzero((~_same_as_rank_0(rows)).any(axis=0))[0]
        if differ.size:
            raise DivergenceError(self._message(rows, differ, labels, describe))

    def _gather(self, digest: mx.nd.NDArray) -> np.ndarray:
        """Every rank's digest, as a (num_workers, D) host array: one sum of an array
        of zeros in which each rank wrote its own row."""
        kv = self._kv
        table = mx.nd.zeros((kv.num_workers, digest.size), dtype="float32")
        table[kv.rank] = digest
        kv.pushpull(self._key, table, priority=-(1 << 20))
        return table.asnumpy()

    def _message(self, rows: np.ndarray, differ: np.ndarray, labels: list,
                 describe: Callable[[int], str]) -> str:
        column = int(differ[0])
        position, what = labels[column]
        same_as_0 = _same_as_rank_0(rows[:, column])
        others = [r for r in range(rows.shape[0]) if not same_as_0[r]]
        same = [r for r in range(rows.shape[0]) if r not in others]
        values = ", ".join(f"rank {r}: {rows[r, column]:.9g}" for r in range(rows.shape[0]))
        more = len({labels[c] for c in differ}) - 1
        more_text = f" (and {more} more tensors)" if more else ""
        return (f"the replicas diverged: at step {self.steps}, the {what} of "
                f"{describe(position)}{more_text} differs between ranks: ranks {others} "
                f"hold another value than ranks {same} (sum of squares {values}). The ranks no "
                "longer train one model; look for rank-dependent code that changes "
                "weights or optimizer states (checked every "
                f"{self.every} steps, {ENV})")


def _same_as_rank_0(rows: np.ndarray) -> np.ndarray:
    """Which ranks' digests (rows) equal rank 0's, column by column. A NaN equals a NaN:
    weights that became NaN on every rank (training that blew up, as it would in one
    process) are the same model on every rank, not replicas that diverged."""
    return (rows == rows[0]) | (np.isnan(rows) & np.isnan(rows[0]))


def _digest(arrays: list[mx.nd.NDArray]) -> mx.nd.NDArray:
    """One float32 number per array, on the engine: its sum of squares (one
    ``multi_sum_sq`` per :data:`_GROUP` arrays, a handful of kernels for a ResNet)."""
    squares = [mx.nd.multi_sum_sq(*chunk, num_arrays=len(chunk)).astype("float32")
               for chunk in (arrays[i:i + _GROUP] for i in range(0, len(arrays), _GROUP))]
    return mx.nd.concat(*squares, dim=0) if len(squares) > 1 else squares[0]
