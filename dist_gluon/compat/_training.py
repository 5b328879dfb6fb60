"""The trainer, optimizer and compression pieces the peers' APIs share.

Both peers' DistributedTrainers are a ``gluon.Trainer`` whose gradients are summed over
the workers and divided by the number of workers; they differ in where the division
happens (horovod: through ``rescale_grad``; BytePS: on the gradients, before the sum)
and in when rank 0's weights are broadcast. The sums go through dist_gluon's gradient
path (:mod:`dist_gluon.averaging`: keys by position, priorities, fp16, row_sparse
gradients), never through a second implementation.
"""
from __future__ import annotations

import warnings

import mxnet as mx

from .. import join as _join
from .. import timeline as _timeline
from ..averaging import _GradientAverager, check_compression, claim_prefix
from ..backends import Backend
from ..broadcast import broadcast_parameters as _broadcast_parameters
from ..optimizer import DistributedOptimizer as _DistributedOptimizer
from ..trainer import TrainerBase


class _Compressor:
    """A horovod/BytePS compressor object; dist_gluon runs the codec it names."""

    spec: str | None = None

    @staticmethod
    def compress(tensor, *args, **kwargs):
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx, *args, **kwargs):
        return tensor


class _NoneCompressor(_Compressor):
    pass


class _FP16Compressor(_Compressor):
    """Gradients travel as float16 (dist_gluon's 'fp16' codec)."""

    spec = "fp16"

    @staticmethod
    def compress(tensor, *args, **kwargs):
        if tensor.dtype == "float16":
            return tensor, tensor.dtype
        return tensor.astype("float16", copy=False), tensor.dtype

    @staticmethod
    def decompress(tensor, ctx, *args, **kwargs):
        return tensor if ctx is None or tensor.dtype == ctx else tensor.astype(ctx, copy=False)


class Compression:
    """Optional gradient compression: ``Compression.none`` or ``Compression.fp16``."""

    none = _NoneCompressor()
    fp16 = _FP16Compressor()


def codec_of(compression, function: str) -> str | None:
    """The dist_gluon codec spec of a horovod compressor object."""
    if compression is None or isinstance(compression, _Compressor):
        return None if compression is None else compression.spec
    raise ValueError(
        f"{function}: compression must be Compression.none or Compression.fp16 of this "
        f"module, got {compression!r}; for 2-bit or PowerSGD use "
        "dist_gluon.DistributedTrainer(..., compression='2bit' or 'powersgd')")


class PeerTrainer(TrainerBase):
    """A ``gluon.Trainer`` whose ``_sum_grads()`` sums every gradient over the workers in
    place (dist_gluon's gradient path); subclasses scale as their peer does.

    As the peers' trainers (gluon.Trainer subclasses), the optimizer's indices follow
    gluon.Trainer's order (a dict sorted by name), so their state files load here and
    back; the gradients travel keyed by position in the model's own order, the same on
    every rank. With several devices per process the devices' gradients are summed
    first (see :class:`~dist_gluon.trainer.TrainerBase`).
    """

    _kind = "peer"

    def __init__(self, params, optimizer, optimizer_params, kv: Backend,
                 compression: str | None, prefix, owner: str):
        if isinstance(optimizer, _DistributedOptimizer):
            warnings.warn(f"{owner} does not take a DistributedOptimizer as its optimizer; "
                          "the wrapped optimizer is used", stacklevel=3)
            optimizer = optimizer._dg_wrapped_optimizer
        averager = _GradientAverager(kv, claim_prefix(prefix, self._kind, "trainer"),
                                     check_compression(compression), owner=owner)
        super().__init__(params, optimizer, optimizer_params, averager, owner=owner)

    def step(self, batch_size, ignore_stale_grad=False):
        """``gluon.Trainer.step``, reported as a step in the job's report and timeline."""
        _timeline.begin_step(self._last_grad_written)
        if self._averager.distributed:      # inside dg.Join, for a rank that has left
            _join.trainer_call(self, "step", ignore_stale_grad, batch_size)
        super().step(batch_size, ignore_stale_grad)
        _timeline.end_step(batch_size)
        self._step_ended()

    def allreduce_grads(self):
        """``gluon.Trainer.allreduce_grads``: a step begins (it ends with :meth:`update`)."""
        _timeline.begin_step(self._last_grad_written)
        if self._averager.distributed:
            _join.trainer_call(self, "allreduce_grads")
        super().allreduce_grads()

    def update(self, batch_size, ignore_stale_grad=False):
        """``gluon.Trainer.update``: the step :meth:`allreduce_grads` began ends."""
        if self._averager.distributed:
            _join.trainer_call(self, "update", ignore_stale_grad, batch_size)
        super().update(batch_size, ignore_stale_grad)
        _timeline.end_step(batch_size)
        self._step_ended()

    def _sum_grads(self, scale: float = 1.0) -> None:
        """Multiply every gradient by ``scale``, then sum it over the workers in place
        (after the step's header: a stale gradient counts zero on every rank)."""
        if self._kv.num_workers > 1:
            self._submit_header()
            if self._amp_skips_reduce():
                return      # AMP: overflowed on some rank, every rank skips this step
        for position, grad in self._grad_entries():
            if scale != 1.0:
                grad *= scale
            self._averager.reduce([position], [grad], describe=self._describe)
        self._spread_grads()


class PeerOptimizer(_DistributedOptimizer):
    """dist_gluon's DistributedOptimizer (Module API: forwarding, installation checks,
    pickling) with a peer's arithmetic: each gradient is multiplied by ``prescale``,
    summed over the workers, and divided by the number of workers if ``average``; the
    wrapped optimizer's ``rescale_grad`` is the user's, untouched by batch sizes."""

    def __init__(self, optimizer, kv: Backend, prescale: float, average: bool):
        if not isinstance(optimizer, mx.optimizer.Optimizer):
            raise TypeError(f"DistributedOptimizer wraps an mx.optimizer.Optimizer, got "
                            f"{type(optimizer).__name__}; e.g. mx.optimizer.create('sgd', "
                            "learning_rate=0.1)")
        super().__init__(optimizer, kv=kv)
        self._dg_prescale = prescale
        self._dg_average = average

    def _check_module(self, init_locals: dict) -> None:
        contexts = getattr(init_locals.get("self"), "_context", [])
        if len(contexts) > 1:
            raise ValueError(
                "the peers' DistributedOptimizer runs one device per worker, as horovod's "
                f"and BytePS's do, but the Module has {len(contexts)} contexts; use "
                "dist_gluon.DistributedOptimizer (it sums a worker's devices first) or "
                "one worker per device")
        super()._check_module(init_locals)

    def _update(self, update, index, weight, grad, state) -> None:
        if self._dg_averager is None:
            self._dg_averager = _GradientAverager(self.kv, self._dg_prefix,
                                                  owner="DistributedOptimizer")
        averager = self._dg_averager
        if averager.distributed:
            indices = list(index) if isinstance(index, (list, tuple)) else [index]
            grads = list(grad) if isinstance(grad, (list, tuple)) else [grad]
            for g in grads:
                if self._dg_prescale != 1.0:
                    g *= self._dg_prescale
            averager.reduce(indices, grads, describe=self._describe)
            if self._dg_average:
                for g in grads:
                    g /= self.kv.num_workers
        update(index, weight, grad, state)


def broadcast_dict(params, root_rank: int, kv: Backend) -> None:
    """The peers' ``broadcast_parameters`` of a dict: its values matched by key (sorted,
    as both peers do), so ranks whose dicts were filled in another order agree."""
    items = [params[k] for k in sorted(params)]
    _broadcast_parameters(items, root_rank=root_rank, kv=kv)


def broadcast_model(params, root_rank: int, kv: Backend) -> None:
    """A ParameterDict (or list) in the model's own order: names can differ between
    ranks in MXNet 1.x, positions do not."""
    _broadcast_parameters(params, root_rank=root_rank, kv=kv)
