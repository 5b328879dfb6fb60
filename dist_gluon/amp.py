"""MXNet's mixed precision (``mx.contrib.amp``) with distributed gradients.

``amp.init_trainer(trainer)`` gives a trainer a dynamic loss scaler
(``trainer._amp_loss_scaler``): the loss is multiplied by the scale, and gluon's update
skips a step whose gradients hold an inf or a NaN and halves the scale (after 2000
clean steps it doubles it). Gluon decides that from this process's gradients, with a
wait of its own. Across workers, with a codec, that is too late and in the wrong units:
a codec keeps state (error-feedback residuals, PowerSGD's Q) and quantises against
absolute thresholds, so it must see the unscaled gradients and must not run at all on
a step that overflowed anywhere. So, on several workers:

1. Each rank computes on MXNet's engine whether its fresh gradients are all finite
   (``multi_all_finite``) and sends ``1 - finite`` as the last value of the step's
   header (:meth:`~dist_gluon.averaging._GradientAverager.submit_step`), which already
   sums the batch sizes; the header's one wait tells every rank on how many ranks the
   step overflowed.
2. With a codec that header is read before any gradient is encoded: an overflowed step
   sends no gradient and leaves every codec's state as it was; otherwise the codec is
   given the gradients divided by the loss scale and multiplies the sums back (powers of
   two: exact).
3. Every rank then records the same verdict in its scaler (:func:`record`, the state
   changes of ``LossScaler.has_overflow``) and skips the same step, so the scale
   changes at the same steps as one process's.

On one process gluon's own check runs, unchanged.
"""
from __future__ import annotations

import contextlib
import logging

import mxnet as mx


def loss_scaler(trainer):
    """The trainer's AMP loss scaler, or None without ``amp.init_trainer``."""
    return getattr(trainer, "_amp_loss_scaler", None)


def overflow_flag(grads: list[mx.nd.NDArray]) -> mx.nd.NDArray:
    """A (1,) float32 array, on the engine: 1 if any of ``grads`` holds an inf or a NaN,
    else 0 (0 for no gradient)."""
    # a row_sparse gradient's rows (multi_all_finite takes dense arrays)
    grads = [g.data if g.stype == "row_sparse" else g for g in grads]
    if not grads:
        return mx.nd.zeros((1,), dtype="float32")
    finite = mx.nd.ones((1,), ctx=grads[0].context, dtype="float32")
    for start in range(0, len(grads), 200):     # gluon's chunk of multi_all_finite
        chunk = grads[start:start + 200]
        mx.nd.multi_all_finite(*chunk, num_arrays=len(chunk), init_output=False,
                               out=finite)
    return (1 - finite).as_in_context(mx.cpu())


def overflowed_alone(trainer) -> bool:
    """Where each worker steps alone (dist_async's pushes): gluon's own check of this
    worker's gradients, which also updates its scaler (one scalar wait); False without
    AMP."""
    scaler = loss_scaler(trainer)
    return scaler is not None and scaler.has_overflow(trainer._params)


def record(scaler, overflow: bool) -> None:
    """What ``LossScaler.has_overflow`` does to the scaler's state once it knows the
    verdict (the same verdict on every rank): the scale of the next step takes effect,
    an overflow halves the one after and a run of clean steps doubles it."""
    scaler._loss_scale = scaler._next_loss_scale
    if overflow:
        scaler._next_loss_scale = scaler._loss_scale / 2.
        scaler._unskipped = 0
        logging.info("AMP: decreasing loss scale to %f", scaler._next_loss_scale)
    else:
        scaler._unskipped += 1
    if scaler._unskipped == scaler._scale_seq_len:
        scaler._unskipped = 0
        scaler._next_loss_scale = min(scaler._max_loss_scale, scaler._loss_scale * 2.)
        logging.info("AMP: increasing loss scale to %f", scaler._next_loss_scale)


@contextlib.contextmanager
def decided(trainer, hide: bool = True):
    """Within it (if ``hide``), gluon's update does not check the gradients itself (the
    ranks' verdict is already recorded): the scaler is hidden from it."""
    scaler = trainer.__dict__.pop("_amp_loss_scaler", None) if hide else None
    try:
        yield
    finally:
        if scaler is not None:
            trainer._amp_loss_scaler = scaler


def state(scaler) -> dict | None:
    """The scaler's state (picklable), for checkpoints and ``dg.elastic.State``."""
    if scaler is None:
        return None
    return {"loss_scale": scaler._loss_scale, "next_loss_scale": scaler._next_loss_scale,
            "unskipped": scaler._unskipped}


def set_state(scaler, saved: dict | None) -> None:
    """Put back :func:`state` (nothing without a scaler or a saved state)."""
    if scaler is None or saved is None:
        return
    scaler._loss_scale = saved["loss_scale"]
    scaler._next_loss_scale = saved["next_loss_scale"]
    scaler._unskipped = saved["unskipped"]


class DynamicScale:
    """:class:`~dist_gluon.DistributedOptimizer`'s dynamic loss scaling
    (``loss_scale='dynamic'``): MXNet's ``LossScaler`` (scale 2**16, halved at an
    overflow, doubled after 2000 clean steps), decided for every rank at once.

    The Module API's updater calls the optimizer once per parameter (or group), so a
    step begins with a call whose index the step has seen already (or the first). At
    that call every gradient of the step is checked (the Module's), the flag travels
    with the step's batch sizes (:meth:`~dist_gluon.averaging._GradientAverager.start_step`,
    one scalar wait), and every call of an overflowed step is skipped on every rank.
    """

    def __init__(self):
        from mxnet.contrib.amp.loss_scaler import LossScaler
        self.scaler = LossScaler()
        self.step_scale = self.scaler.loss_scale    # the scale of this step's gradients
        self.skip = False                           # this step overflowed on some rank
        self._seen: set = set()

    @property
    def loss_scale(self) -> float:
        """The factor to multiply the next step's loss by."""
        return self.scaler.loss_scale

    def begin(self, indices: list, step_grads, averager, weight: float,
              alone: bool) -> bool:
        """Called at every update call with its indices; returns whether the step is
        skipped. At a step's first call: ``step_grads()`` (every gradient of the step)
        is checked and, unless ``alone`` (one process, or dist_async's own pushes),
        summed over the ranks with ``weight`` (this rank's batch size)."""
        if self._seen and indices[0] not in self._seen:
            self._seen.update(indices)
            return self.skip
        self._seen = set(indices)
        flag = overflow_flag(step_grads())
        overflows = float(flag.asscalar()) if alone else averager.start_step(weight, flag)
        self.step_scale = self.scaler.loss_scale
        self.skip = overflows > 0
        record(self.scaler, self.skip)
        return self.skip
