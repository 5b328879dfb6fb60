"""Gradient averaging shared by DistributedTrainer (Gluon) and DistributedOptimizer
(Module): one code path, so a fix or a feature reaches both.

Gradients are summed over the workers under keys ``'<prefix>.<index>'`` (the index is
the parameter's position, the same on every rank), with priority ``-index`` so that the
first layers, needed first by the next forward, travel first. Each step also sums one
tiny value over the workers, under ``'<prefix>.batch'`` and with the highest priority:
the batch sizes, so that ranks with different batch sizes (the last, partial batch of
an epoch) still train exactly like one process on the concatenated samples. Nothing is
sent on one process.
"""
from __future__ import annotations

import itertools

import mxnet as mx
import numpy as np

from . import compression as _compression
from . import timeline as _timeline
from .backends import Backend
from .sparse import sum_row_sparse

# Above every gradient's priority (-index <= 0): the batch sizes are needed first.
_BATCH_PRIORITY = 1

_prefixes_in_use: set[str] = set()
_auto_numbers = itertools.count(1)


def claim_prefix(prefix: str | None, kind: str, owner: str) -> str:
    """Reserve the key prefix of a new trainer or optimizer. None numbers it
    ``<kind><n>`` in construction order (the same on every rank); a prefix already used
    in this process is a ValueError, since two owners would mix their gradients."""
    if prefix is None:
        prefix = f"{kind}{next(_auto_numbers)}"
        while prefix in _prefixes_in_use:
            prefix = f"{kind}{next(_auto_numbers)}"
    elif not isinstance(prefix, str) or not prefix:
        raise ValueError(f"prefix must be a non-empty string, got {prefix!r}")
    elif prefix in _prefixes_in_use:
        raise ValueError(f"prefix {prefix!r} is already used by another DistributedTrainer "
                         f"or DistributedOptimizer in this process; give each {owner} "
                         "its own")
    _prefixes_in_use.add(prefix)
    return prefix


def check_compression(compression) -> dict | None:
    """A ``compression=`` argument checked (see :mod:`dist_gluon.compression`):
    ``{'type': name, **params}`` or None."""
    return _compression.parse(compression)


def check_predivide(factor, compression: dict | None = None) -> float:
    if not factor > 0:
        raise ValueError(f"gradient_predivide_factor must be positive, got {factor}")
    if factor != 1.0 and compression is not None and compression["type"] != "fp16":
        raise ValueError(f"gradient_predivide_factor={factor} works with compression=None "
                         f"or 'fp16' only; {compression['type']!r} compresses the raw "
                         "gradient sums (leave the factor at 1)")
    return float(factor)


class _GradientAverager:
    """Sums gradients over workers in place, and the batch sizes that go with them.

    Parameters
    ----------
    kv : Backend
    prefix : str
        From :func:`claim_prefix`.
    compression : dict or None
        From :func:`check_compression`; the codec (:mod:`dist_gluon.compression`) is
        created here and keeps its state (residuals...) for the averager's life.
    predivide : float
        Gradients are divided by it before the sum and multiplied back after (keeps fp16
        sums in range on many workers, as in Horovod).
    owner : str
        Named in error messages.
    """

    def __init__(self, kv: Backend, prefix: str, compression: dict | None = None,
                 predivide: float = 1.0, owner: str = "DistributedTrainer"):
        self.kv = kv
        self.prefix = prefix
        self.codec = None if compression is None else _compression.create(compression)
        self._predivide = predivide
        self._owner = owner
        self._plain = compression is None and predivide == 1.0
        self._grad_keys: dict[int, str] = {}    # of dense gradients, checked once
        self._batch_key = f"{prefix}.batch"
        self._step_indices: set[int] = set()
        self._total: mx.nd.NDArray | None = None      # this step's sum of the weights
        self._factors: dict[np.dtype, mx.nd.NDArray] = {}
        self._started = False       # start_step() began the step reduce() continues
        self._codec_checked: set = set()
        self._sizes: dict = {}      # bytes of each dense gradient, for the job's report
        # AMP's loss scale of this step's gradients: the codec sees them divided by it
        # (dist_gluon.amp), set by the owner before each step's reduce
        self.loss_scale = 1.0

    @property
    def distributed(self) -> bool:
        return self.kv.num_workers > 1

    # ------------------------------------------------------------ batch sizes
    def submit_batch_size(self, batch_size: float) -> mx.nd.NDArray:
        """Start summing ``batch_size`` over the workers; returns the (1,) float32 array
        that holds the total once the engine has run. Call it on every rank, once per
        step, before the step's gradients.

        float32 holds every integer up to 2**24 exactly, so a total of up to 16.7
        million samples per step is exact, on every backend's ordinary sum (no exact
        float64 path, nothing on the host). The value is made by an operator
        (``mx.nd.full``), and nobody waits for the sum here: the gradients are divided
        by it on the engine (:meth:`reduce`); a caller that needs the number itself
        (``DistributedTrainer.step``, where the batch sizes may differ between workers)
        waits for this one scalar."""
        total = mx.nd.full((1,), batch_size, dtype="float32")
        self.kv.pushpull(self._batch_key, total, priority=_BATCH_PRIORITY)
        return total

    def submit_step(self, batch_size: float, fresh: list[bool],
                    overflow: mx.nd.NDArray | None = None) -> mx.nd.NDArray:
        """:meth:`submit_batch_size` for a trainer, with this rank's freshness of each
        parameter (:mod:`dist_gluon.freshness`) in the same array: returns the
        ``(1 + len(fresh),)`` float32 array that holds, once the engine has run, the
        sum of the batch sizes and, for each parameter, the number of ranks where its
        gradient is fresh. The same key and length on every step of a trainer. Made by
        operators (no upload) unless some gradient is stale here.

        With AMP, ``overflow`` (a (1,) float32 array on the engine, 1 where this rank's
        gradients overflowed; :func:`dist_gluon.amp.overflow_flag`) is appended: the
        last value then counts the ranks that overflowed. It travels under a key of its
        own, so that the header's length never changes under one key."""
        if all(fresh):
            header = mx.nd.full((1 + len(fresh),), 1.0, dtype="float32")
            header[0] = batch_size
        else:
            header = mx.nd.array([batch_size] + [float(f) for f in fresh], dtype="float32")
        key = self._batch_key
        if overflow is not None:
            header = mx.nd.concat(header, overflow, dim=0)
            key = f"{key}.amp"
        self.kv.pushpull(key, header, priority=_BATCH_PRIORITY)
        _timeline.collective(key, header)
        return header

    def start_step(self, weight: float, overflow: mx.nd.NDArray) -> float:
        """With dynamic loss scaling and no step header (DistributedOptimizer): start
        this step's sum of the weights (see :meth:`reduce`) now, with this rank's
        overflow flag in the same array (:func:`dist_gluon.amp.overflow_flag`), and wait
        for it (the step's one wait): returns on how many ranks the step overflowed. The
        step's :meth:`reduce` calls with a weight then use this sum; a step that
        overflowed anywhere sends no gradient."""
        header = mx.nd.concat(mx.nd.full((1,), weight, dtype="float32"), overflow, dim=0)
        key = f"{self._batch_key}.amp"
        self.kv.pushpull(key, header, priority=_BATCH_PRIORITY)
        _timeline.collective(key, header)
        self._total, self._factors = header[0:1], {}
        self._step_indices, self._started = set(), True
        return float(header[1].asscalar())

    def total_batch_size(self, batch_size: float) -> float:
        """The sum of every worker's ``batch_size`` (``batch_size`` on one process)."""
        if not self.distributed:
            return batch_size
        return float(self.submit_batch_size(batch_size).asscalar())

    # ------------------------------------------------------------ gradients
    def reduce(self, indices: list[int], grads: list[mx.nd.NDArray], weight=None,
               describe=None) -> None:
        """Sum ``grads`` (of parameters ``indices``) over the workers, in place. Call it
        on every rank with the same indices in the same order; nothing is sent on one
        process.

        Parameters
        ----------
        weight : float, optional
            This rank's weight (its batch size): the sums are divided by the sum of
            every rank's weight. The weights travel with the first call of each step (a
            step ends when an index comes again), and the division runs on the engine,
            as the multiplication that undoes the predivision: the Python thread never
            waits for the weights and no kernel is added. Every rank computes the same
            result, bit for bit.
        describe : callable, optional
            ``describe(index)`` names a parameter in errors.
        """
        if self.codec is not None:
            self.check_input(indices, grads, describe)
        if not self.distributed:
            return
        if (weight is None and self._plain and len(grads) == 1
                and grads[0].stype == "default"):
            # DistributedTrainer's call per parameter, as its gradient is ready: the
            # short path of the common case (no compression, no predivision)
            index = indices[0]
            key = self._grad_keys.get(index) or self._grad_key(index, grads[0], describe)
            ready = _timeline.input_marker(grads[0])
            self.kv.pushpull(key, grads[0], priority=-index if isinstance(index, int) else 0)
            _timeline.collective(key, grads[0], self._nbytes(index, grads[0]), ready=ready)
            return
        if any(g.stype != "default" for g in grads):
            self._reduce_mixed(indices, grads, weight, describe)
            return
        keys = [self._grad_key(i, g, describe) for i, g in zip(indices, grads)]
        # optimizer indices are ints for Module and Gluon; an Updater takes any key
        priority = -indices[0] if isinstance(indices[0], int) else 0
        if weight is not None:
            self._track_step(indices, weight)
        ready = [_timeline.input_marker(g) for g in grads]
        if self._predivide != 1.0:
            for g in grads:
                g *= 1.0 / self._predivide
        if self.codec is not None:
            # AMP: the codec's thresholds and residuals are in the gradient's own units;
            # the scale is a power of two, so dividing and multiplying back is exact
            unscale = self.loss_scale != 1.0
            if unscale:
                for g in grads:
                    g *= 1.0 / self.loss_scale
            with _timeline.span(f"codec {self.codec.name}", "codec", tensors=len(keys)):
                self.codec.reduce(self.kv, indices, keys, grads, priority)
            if unscale:
                for g in grads:
                    g *= self.loss_scale
        elif len(keys) == 1:
            self.kv.pushpull(keys[0], grads[0], priority=priority)
        else:
            self.kv.pushpull(keys, grads, priority=priority)
        for index, key, grad, marker in zip(indices, keys, grads, ready):
            _timeline.collective(key, grad, self._nbytes(index, grad), ready=marker)
        if weight is not None:
            for g in grads:
                g *= self._factor(g.dtype)
        elif self._predivide != 1.0:
            for g in grads:
                g *= self._predivide

    def _reduce_mixed(self, indices, grads, weight, describe) -> None:
        """``reduce`` for a call holding row_sparse gradients: they are summed one by one
        (:mod:`dist_gluon.sparse`), the dense ones together, in the callers' order."""
        if weight is not None:
            self._track_step(indices, weight)
        dense = [(i, g) for i, g in zip(indices, grads) if g.stype == "default"]
        for index, grad in zip(indices, grads):
            if grad.stype != "default":
                self._reduce_sparse(index, grad, describe)
        if dense:
            self.reduce([i for i, _ in dense], [g for _, g in dense], None, describe)
        if weight is not None:
            # the division by the summed weights, which reduce() does with a weight
            for grad in grads:
                factor = self._factor(grad.dtype)
                if self._predivide != 1.0 and grad.stype == "default":
                    factor = factor / self._predivide     # reduce() multiplied it back
                if grad.stype == "default":
                    grad *= factor
                else:
                    scaled = grad.data * factor
                    mx.nd.sparse.row_sparse_array((scaled, grad.indices), shape=grad.shape,
                                                  ctx=grad.context).copyto(grad)

    def _reduce_sparse(self, index: int, grad: mx.nd.NDArray, describe=None) -> dict:
        """Sum the row_sparse ``grad`` of parameter ``index`` over the workers, in place,
        as one process on the concatenated batches would hold it (the union of the
        rows); see :mod:`dist_gluon.sparse`. No predivision; of the codecs only fp16
        applies (the rows travel as float16), 2-bit and PowerSGD refuse it."""
        if grad.stype != "row_sparse":
            what = describe(index) if describe else f"parameter #{index}"
            raise TypeError(f"{self._owner} averages dense and row_sparse gradients; {what} "
                            f"has a {grad.stype} gradient")
        wire_dtype = None
        if self.codec is not None and np.dtype(grad.dtype) != np.float16:
            wire_dtype = np.float16      # check_input let only fp16 through
        # AMP: the rows travel in float16 unscaled, as the dense gradients do
        unscale = self.codec is not None and self.loss_scale != 1.0
        if unscale:
            _scale_rows(grad, 1.0 / self.loss_scale)
        counts = sum_row_sparse(self.kv, f"{self.key(index)}.sparse", grad,
                                priority=-index if isinstance(index, int) else 0,
                                wire_dtype=wire_dtype)
        if unscale:
            _scale_rows(grad, self.loss_scale)
        return counts

    def check_input(self, indices, grads, describe) -> None:
        """Refuse, on any number of workers, a gradient the codec cannot compress (once
        per parameter): an integer one, or a row_sparse one for 2-bit and PowerSGD."""
        if self.codec is None:
            return
        for index, grad in zip(indices, grads):
            if index in self._codec_checked:
                continue
            what = describe(index) if describe else f"parameter #{index}"
            if np.dtype(grad.dtype).kind != "f":
                raise TypeError(f"compression {self.codec.name!r} works on float16, float32 "
                                f"and float64 gradients; {what} has a gradient of dtype "
                                f"{np.dtype(grad.dtype).name} (use compression=None for it)")
            if grad.stype != "default" and self.codec.name != "fp16":
                raise TypeError(
                    f"compression {self.codec.name!r} works on dense gradients; {what} has a "
                    f"{grad.stype} gradient (Embedding(..., sparse_grad=True)). Accepted for "
                    "row_sparse gradients: compression=None or 'fp16' (the rows travel as "
                    f"float16); or give the sparse parameters a {self._owner} of their own "
                    "without compression, or use sparse_grad=False")
            self._codec_checked.add(index)

    def _track_step(self, indices: list[int], weight: float) -> None:
        if self._started:           # start_step() sent this step's weights
            self._started = False
            self._step_indices = set(indices)
            return
        if self._step_indices and self._step_indices.isdisjoint(indices):
            self._step_indices.update(indices)
            return
        self._step_indices = set(indices)
        self._total = self.submit_batch_size(weight)
        self._factors = {}

    def _factor(self, dtype) -> mx.nd.NDArray:
        """``predivide / total`` in ``dtype``, on the engine: divided in float64 for
        float64 gradients, else in float32 (the quotient rounded once)."""
        dtype = np.dtype(dtype)
        factor = self._factors.get(dtype)
        if factor is None:
            wide = "float64" if dtype == np.float64 else "float32"
            factor = self._predivide / self._total.astype(wide)
            if factor.dtype != dtype:
                factor = factor.astype(dtype)
            self._factors[dtype] = factor
        return factor

    def _nbytes(self, index, grad: mx.nd.NDArray) -> int:
        """The bytes of a dense gradient (counted once per parameter)."""
        size = self._sizes.get(index)
        if size is None:
            size = self._sizes[index] = grad.size * np.dtype(grad.dtype).itemsize
        return size

    def key(self, index: int) -> str:
        """The communication key of parameter ``index``: ``'<prefix>.<index>'``."""
        return f"{self.prefix}.{index}"

    def _grad_key(self, index: int, grad: mx.nd.NDArray, describe) -> str:
        key = self._grad_keys.get(index)
        if key is None:
            if grad.stype != "default":
                what = describe(index) if describe else f"parameter #{index}"
                raise TypeError(f"{self._owner} averages dense and row_sparse gradients "
                                f"only; {what} has a {grad.stype} gradient")
            key = self._grad_keys[index] = self.key(index)
        return key


def _scale_rows(grad: mx.nd.NDArray, factor: float) -> None:
    """Multiply the rows of the row_sparse ``grad`` by ``factor``, in place."""
    mx.nd.sparse.row_sparse_array((grad.data * factor, grad.indices), shape=grad.shape,
                                  ctx=grad.context).copyto(grad)
