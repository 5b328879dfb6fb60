"""Data sharding and exact distributed evaluation.

:class:`ShardSampler` gives each worker its own equally long share of a dataset,
:func:`shard_kwargs` does the same for MXNet's ``mx.io`` iterators, and
:func:`reduce_metric` sums an ``mx.metric.EvalMetric`` over the workers, so that a
sharded evaluation reports exactly what one process evaluating everything would.
"""
from __future__ import annotations

import copy
import numbers
from collections.abc import Iterable, Iterator
from typing import Any

import mxnet as mx
import numpy as np

from .backends import Backend, resolve

_LAST_BATCH = ("pad", "drop")
# EvalMetric counters that are plain sums over samples (or batches): summing them over
# workers gives the counters of one process that saw every worker's samples.
_SUMMED = ("sum_metric", "num_inst", "global_sum_metric", "global_num_inst")
# Confusion counts of F1 and MCC with average='micro', from which they derive their
# sums; the derived values are not additive, the counts are.
_CONFUSION = ("true_positives", "false_negatives", "false_positives", "true_negatives")


def _check_int(value, name: str, low: int, high: int | None = None) -> int:
    """``value`` as an int in [low, high), or a ValueError naming ``name`` and the range."""
    allowed = f"an int >= {low}" if high is None else f"an int in [{low}, {high})"
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be {allowed}, got {type(value).__name__} {value!r}")
    value = int(value)
    if value < low or (high is not None and value >= high):
        raise ValueError(f"{name} must be {allowed}, got {value}")
    return value


class ShardSampler(mx.gluon.data.Sampler):
    """Samples the share of a dataset that belongs to this worker.

    Every worker gets the same number of indices, so no worker runs out of batches
    before the others (which would leave them waiting for it in a collective forever).

    For each epoch the indices ``0 .. length-1`` are put in one global order: a random
    permutation that depends only on ``seed`` and the epoch (``shuffle=True``), so every
    worker computes the same one without communicating, or ``0, 1, 2, ...``
    (``shuffle=False``). Worker ``rank`` of ``N`` takes the positions ``rank, rank + N,
    rank + 2N, ...`` of that order; with ``shuffle=False`` it gets the indices ``rank,
    rank + N, rank + 2N, ...``, as ``torch.utils.data.DistributedSampler`` does.

    ``last_batch`` decides what happens when ``length`` is not a multiple of ``N``:

    - ``'pad'``: the order is extended by repeating it from its start up to a multiple
      of ``N``, so every sample is seen at least once and each worker gets
      ``ceil(length / N)`` indices. The ``N * ceil(length / N) - length`` repeated
      (padded) indices are spread over the workers: each worker's padding is its last
      :attr:`num_padded` (0 or 1) indices. For exact evaluation, skip them with
      :meth:`unpadded` and sum the metric with :func:`reduce_metric`.
    - ``'drop'``: the last ``length % N`` positions of the order are dropped, so the
      shares are disjoint and each worker gets ``floor(length / N)`` indices.

    Call :meth:`set_epoch` at the start of every epoch, before iterating, to get a new
    order; otherwise every epoch repeats the first one.

    Resuming inside an epoch, on any number of workers: ``set_epoch(epoch, skip=S)``
    leaves out the first ``S`` positions of the epoch's order (those trained on before,
    by however many workers) and shares out the rest, ``order[S:]``, as above (padded or
    dropped to a multiple of ``N``). Since worker ``rank`` takes positions ``rank, rank +
    N, ...``, the workers' ``j``-th batches of ``B`` together are always the
    consecutive positions ``j*B*N .. (j+1)*B*N - 1`` of the shared order: after ``k``
    steps, ``S + k*B*N`` positions are done, whatever ``N`` was, and that is the
    ``skip`` to resume from (see :class:`Checkpointer`).

    Parameters
    ----------
    length : int
        Number of samples in the dataset (>= 0).
    kv : Backend, str or None, default None
        Where ``num_workers`` and ``rank`` come from when they are not given: a backend,
        a backend name, or None to create the backend from the environment.
    num_workers : int, optional
        Number of workers (>= 1). Given together with ``rank``, no backend is created.
    rank : int, optional
        This worker's rank, in ``[0, num_workers)``.
    shuffle : bool, default True
        Shuffle the order every epoch, identically on every worker.
    seed : int, default 0
        Seed of the shuffle (>= 0); must be the same on every worker.
    last_batch : {'pad', 'drop'}, default 'pad'
        How to make the shares equal when ``length`` is not a multiple of ``num_workers``.

    Examples
    --------
    >>> sampler = dg.ShardSampler(len(train_data), shuffle=True, seed=42)
    >>> loader = gluon.data.DataLoader(train_data, batch_size=64, sampler=sampler)
    >>> for epoch in range(epochs):
    ...     sampler.set_epoch(epoch)
    ...     for data, label in loader:
    ...         ...

    Without a job, the shares are easy to look at:

    >>> list(dg.ShardSampler(5, num_workers=2, rank=1, shuffle=False))
    [1, 3, 0]
    >>> dg.ShardSampler(5, num_workers=2, rank=1, shuffle=False).num_padded
    1
    >>> list(dg.ShardSampler(5, num_workers=2, rank=1, shuffle=False, last_batch='drop'))
    [1, 3]

    Resuming an epoch of which 3 workers trained the first 6 positions, on 2 workers:

    >>> sampler = dg.ShardSampler(10, num_workers=2, rank=0, shuffle=False)
    >>> sampler.set_epoch(0, skip=6)
    >>> list(sampler)
    [6, 8]
    """

    def __init__(self, length: int, kv: Backend | str | None = None,
                 num_workers: int | None = None, rank: int | None = None,
                 shuffle: bool = True, seed: int = 0, last_batch: str = "pad"):
        self._length = _check_int(length, "length", low=0)
        if num_workers is None or rank is None:
            backend = resolve(kv)
            num_workers = backend.num_workers if num_workers is None else num_workers
            rank = backend.rank if rank is None else rank
        self._num_workers = _check_int(num_workers, "num_workers", low=1)
        self._rank = _check_int(rank, "rank", low=0, high=self._num_workers)
        self._seed = _check_int(seed, "seed", low=0)
        if last_batch not in _LAST_BATCH:
            raise ValueError(f"last_batch must be 'pad' or 'drop', got {last_batch!r}")
        self._last_batch = last_batch
        self._shuffle = bool(shuffle)
        self._epoch = 0
        self._skip = 0

    @property
    def _remaining(self) -> int:
        """How many positions of the epoch's order this epoch shares out."""
        return max(0, self._length - self._skip)

    @property
    def _per_worker(self) -> int:
        if self._last_batch == "pad":
            return -(-self._remaining // self._num_workers)
        return self._remaining // self._num_workers

    @property
    def num_workers(self) -> int:
        return self._num_workers

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def epoch(self) -> int:
        return self._epoch

    @property
    def skip(self) -> int:
        """How many positions of the current epoch's order are left out (set_epoch)."""
        return self._skip

    def set_epoch(self, epoch: int, skip: int = 0) -> None:
        """Use the order of ``epoch`` (>= 0) from the next iteration on.

        Call it with the same values on every worker at the start of each epoch.

        Parameters
        ----------
        epoch : int
            The epoch (>= 0); it alone decides the shuffled order.
        skip : int, default 0
            How many positions at the start of this epoch's order were trained on
            already, by any number of workers (>= 0), e.g. ``S * B * N`` after a
            checkpoint saved at step ``S`` by ``N`` workers with per-worker batch ``B``
            that began the epoch at its start. Only the rest, ``order[skip:]``, is
            shared out, padded or dropped to a multiple of the workers as usual. It
            applies to this epoch only: the next ``set_epoch(e)`` is a whole epoch. A
            ``skip`` of ``length`` or more leaves nothing (the epoch is done: positions
            past the end are the padding of its last batches).
        """
        self._epoch = _check_int(epoch, "epoch", low=0)
        self._skip = _check_int(skip, "skip", low=0)

    @property
    def num_padded(self) -> int:
        """How many of the indices this worker yields are padding (always the last ones).

        They repeat samples another worker (or this one) also yields; they exist only in
        ``'pad'`` mode and depend on the ``skip`` of :meth:`set_epoch`, not on the epoch.
        """
        if self._last_batch == "drop":
            return 0
        # Position p of this worker is position rank + p*N of the padded shared order,
        # which is padding from position `remaining` on.
        real = max(0, -(-(self._remaining - self._rank) // self._num_workers))
        return self._per_worker - real

    def indices(self) -> np.ndarray:
        """The indices this worker yields in the current epoch, as an int64 array."""
        total = self._per_worker * self._num_workers
        if total == 0:
            return np.zeros((0,), dtype=np.int64)
        if self._shuffle:
            rng = np.random.default_rng([self._seed, self._epoch])
            order = rng.permutation(self._length)
        else:
            order = np.arange(self._length, dtype=np.int64)
        # repeats the rest from its own start when padding
        order = np.resize(order[self._skip:], total)
        return order[self._rank::self._num_workers].astype(np.int64)

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices().tolist())

    def __len__(self) -> int:
        return self._per_worker

    def unpadded(self, batches: Iterable) -> Iterator:
        """Iterate over ``batches`` with the padded samples removed, for evaluation.

        ``batches`` must come from this sampler in order, e.g. a
        ``gluon.data.DataLoader(dataset, batch_size, sampler=self)`` (with the default
        ``last_batch='keep'``). A batch is an array or a tuple/list of arrays (what the
        default batchify function makes); every array is cut along its first axis. A
        batch made only of padding is skipped, so workers may run different numbers of
        batches: use this for evaluation, not in a loop that communicates every batch.

        Raises
        ------
        RuntimeError
            After the last batch, when the batches did not hold exactly ``len(self)``
            samples (they were not made from this sampler).

        Examples
        --------
        >>> sampler = dg.ShardSampler(len(val_data), shuffle=False)
        >>> loader = gluon.data.DataLoader(val_data, batch_size=64, sampler=sampler)
        >>> metric = mx.metric.Accuracy()
        >>> for data, label in sampler.unpadded(loader):
        ...     metric.update(label, net(data))
        >>> name, accuracy = dg.reduce_metric(metric).get()   # the same on every worker
        """
        real = len(self) - self.num_padded
        seen = 0
        for batch in batches:
            size = _batch_size(batch)
            keep = min(size, max(0, real - seen))
            seen += size
            if keep == size:
                yield batch
            elif keep > 0:
                yield _cut(batch, keep)
        if seen != len(self):
            raise RuntimeError(
                f"unpadded: the batches held {seen} samples but this ShardSampler yields "
                f"{len(self)}; pass batches made from this sampler in order, e.g. "
                f"gluon.data.DataLoader(dataset, batch_size, sampler=sampler) with the "
                f"default last_batch='keep'")

    def __repr__(self) -> str:
        return (f"ShardSampler(length={self._length}, num_workers={self._num_workers}, "
                f"rank={self._rank}, shuffle={self._shuffle}, seed={self._seed}, "
                f"last_batch={self._last_batch!r}, epoch={self._epoch}"
                + (f", skip={self._skip})" if self._skip else ")"))


def _first_array(batch):
    while isinstance(batch, (tuple, list)):
        if not batch:
            raise ValueError("unpadded: got an empty tuple/list as a batch")
        batch = batch[0]
    return batch


def _batch_size(batch) -> int:
    first = _first_array(batch)
    shape = getattr(first, "shape", None)
    return int(shape[0]) if shape else len(first)


def _cut(batch, keep: int):
    if isinstance(batch, (tuple, list)):
        return type(batch)(_cut(part, keep) for part in batch)
    return batch[:keep]


def shard_kwargs(kv: Backend | str | None = None) -> dict[str, int]:
    """Arguments that make an ``mx.io`` iterator read only this worker's part.

    Parameters
    ----------
    kv : Backend, str or None, default None
        The backend (or its name); None creates it from the environment.

    Returns
    -------
    dict
        ``{'num_parts': kv.num_workers, 'part_index': kv.rank}``, the arguments of
        ``mx.io.MNISTIter`` and ``mx.io.ImageRecordIter`` that split the data.

    Examples
    --------
    >>> train_iter = mx.io.ImageRecordIter(path_imgrec='train.rec', data_shape=(3, 224, 224),
    ...                                    batch_size=32, **dg.shard_kwargs())
    """
    backend = resolve(kv)
    return {"num_parts": backend.num_workers, "part_index": backend.rank}


def reduce_metric(metric: mx.metric.EvalMetric,
                  kv: Backend | str | None = None) -> mx.metric.EvalMetric:
    """Sum a metric over all workers, as if one process had seen every worker's samples.

    Returns a copy of ``metric`` whose counters (``sum_metric``, ``num_inst``,
    ``global_sum_metric``, ``global_num_inst``, for every metric inside a
    ``CompositeEvalMetric`` too) are the sums over all workers; ``metric`` itself is
    unchanged, so it can keep accumulating and be reduced again later. All counters
    travel in one float64 ``pushpull``; on a single process nothing is sent. Every
    worker must call it, with the same kind of metric, and gets the same result.

    Metrics whose counters are sums over samples (Accuracy, TopKAccuracy, CrossEntropy,
    NegativeLogLikelihood, Perplexity, Loss, ...) then equal the single-process value
    exactly, provided each sample was counted once: skip padded samples with
    :meth:`ShardSampler.unpadded`. Counts (e.g. correct predictions) are exact up to
    2**53. Metrics that average per batch (MAE, MSE, RMSE, and F1 and MCC with
    ``average='macro'``) become the mean over all workers' batches. F1 and MCC with
    ``average='micro'`` are recomputed from the summed confusion counts, so they are
    exact too.

    Parameters
    ----------
    metric : mx.metric.EvalMetric
        The metric this worker updated with its own samples.
    kv : Backend, str or None, default None
        The backend (or its name); None creates it from the environment.

    Returns
    -------
    mx.metric.EvalMetric
        A reduced copy of ``metric``; call ``.get()`` on it.

    Raises
    ------
    ValueError
        For metrics whose state is not a sum (``PCC``, ``PearsonCorrelation`` with
        ``average='micro'``) or whose counters are not numbers.

    Examples
    --------
    >>> sampler = dg.ShardSampler(len(val_data), shuffle=False)
    >>> loader = gluon.data.DataLoader(val_data, batch_size=64, sampler=sampler)
    >>> metric = mx.metric.Accuracy()
    >>> for data, label in sampler.unpadded(loader):
    ...     metric.update(label, net(data))
    >>> name, accuracy = dg.reduce_metric(metric).get()
    """
    if not isinstance(metric, mx.metric.EvalMetric):
        raise TypeError(f"reduce_metric: metric must be an mx.metric.EvalMetric, got "
                        f"{type(metric).__name__}")
    backend = resolve(kv)
    reduced = copy.deepcopy(metric)
    if backend.num_workers == 1:
        return reduced
    nodes = list(_walk(reduced))
    slots = [slot for node in nodes for slot in _summed_slots(node)]
    values = mx.nd.array([_as_float(node, owner, attr) for node, owner, attr in slots],
                         dtype="float64")
    backend.pushpull(f"__dg_metric_{len(slots)}", values)
    for (_node, owner, attr), total in zip(slots, values.asnumpy().tolist(), strict=True):
        old = getattr(owner, attr)
        is_int = isinstance(old, numbers.Integral) and not isinstance(old, bool)
        setattr(owner, attr, int(total) if is_int else total)
    for node in nodes:
        _recompute_from_confusion(node)
    return reduced


def _walk(metric) -> Iterator[mx.metric.EvalMetric]:
    yield metric
    if isinstance(metric, mx.metric.CompositeEvalMetric):
        for child in metric.metrics:
            yield from _walk(child)


def _confusion(metric):
    """The confusion counts a micro-averaged F1 or MCC derives its counters from."""
    if isinstance(metric, mx.metric.F1) and metric.average == "micro":
        return metric.metrics
    if isinstance(metric, mx.metric.MCC) and metric._average == "micro":
        return metric._metrics
    return None


def _summed_slots(metric) -> list[tuple[Any, Any, str]]:
    """(metric, object, attribute) of every counter of ``metric`` that is summed."""
    name = type(metric).__name__
    if isinstance(metric, mx.metric.PCC) or (
            isinstance(metric, mx.metric.PearsonCorrelation) and metric.average == "micro"):
        raise ValueError(f"reduce_metric: {name} keeps state that is not a sum over "
                         f"samples and cannot be reduced exactly; gather predictions and "
                         f"labels with kv.allgather_object and compute it on one worker"
                         + (", or use average='macro'" if name == "PearsonCorrelation"
                            else ""))
    counts = _confusion(metric)
    if counts is not None:  # its counters are derived from these afterwards
        return [(metric, counts, prefix + attr) for prefix in ("", "global_")
                for attr in _CONFUSION]
    return [(metric, metric, attr) for attr in _SUMMED if hasattr(metric, attr)]


def _as_float(metric, owner, attr: str) -> float:
    value = getattr(owner, attr)
    if isinstance(value, mx.nd.NDArray):
        value = value.asnumpy()
    try:
        return float(np.asarray(value, dtype=np.float64).reshape(()))
    except (TypeError, ValueError) as err:
        raise ValueError(f"reduce_metric: {type(metric).__name__}.{attr} must be a number "
                         f"to be summed over workers, got {value!r}") from err


def _recompute_from_confusion(metric) -> None:
    counts = _confusion(metric)
    if counts is None:
        return
    if isinstance(metric, mx.metric.F1):
        local, global_ = counts.fscore, counts.global_fscore
    else:
        local, global_ = counts.matthewscc(), counts.matthewscc(use_global=True)
    metric.sum_metric = local * counts.total_examples
    metric.num_inst = counts.total_examples
    metric.global_sum_metric = global_ * counts.global_total_examples
    metric.global_num_inst = counts.global_total_examples


__all__ = ["ShardSampler", "shard_kwargs", "reduce_metric"]
