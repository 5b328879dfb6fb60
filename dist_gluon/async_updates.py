"""Asynchronous updates on the parameter servers (the ``dist_async`` backend): one path
for DistributedTrainer (Gluon) and DistributedOptimizer (Module).

What it means, as MXNet's own ``dist_async`` (``kvstore='dist_async'`` with updates on
the kvstore):

- Each worker's ``step`` pushes its gradient, already divided by its own batch size,
  and the servers apply it at once as one optimizer step; the worker then pulls the
  weights as they are after it (which include every other worker's pushes that
  arrived before). No worker waits for another: a slow or paused worker delays only
  itself.
- So the learning rate is that of one process on the per-worker batch: N workers on B
  samples each make N optimizer steps of batch B where ``dist_sync`` makes one of N*B,
  and the learning rate is not scaled with N (the gradients are up to N-1 pushes
  stale, so the largest stable rate may be lower). ``batch_size`` in ``step`` is this
  worker's, and may differ between workers and steps.
- The optimizer (learning rate, schedule, momentum, weight decay, ``lr_mult`` and
  ``wd_mult`` of each parameter) is sent to the servers at the first step and runs
  there: its state (momentum, Adam's moments) lives on the servers and its update
  count is the servers' count of pushes, which a learning-rate schedule reads (so
  ``max_update`` counts the pushes of all workers). Changing the optimizer on a worker
  after the first step has no effect on the servers (``set_learning_rate`` then raises).
  The gradients are divided by the batch size in place before they are pushed.
- A checkpoint holds the weights rank 0 last pulled, the optimizer's settings and the
  loop's position; the optimizer's state stays on the servers and is not saved.
  Resuming restores the weights exactly, starts the servers' optimizer state afresh
  (zero momentum, update count 0) and so is not the uninterrupted run: asynchronous
  training is not deterministic in any case (which push arrives first decides).
- What needs workers in lockstep is refused with a clear error: gradient compression,
  ``gradient_predivide_factor``, ``allreduce_grads()``/``update()`` (the servers
  update, there is nothing to clip in between), row_sparse gradients and
  ``SyncBatchNorm``. dist_gluon's other collectives (broadcast of the initial weights,
  ``reduce_metric``, ``broadcast_object``, barriers) still work, with every worker
  taking part.
"""
from __future__ import annotations

import copy

import mxnet as mx
import numpy


def asynchronous(kv) -> bool:
    """True when ``kv`` is a dist_async backend with more than one worker."""
    return kv.type == "dist_async" and kv.num_workers > 1


def model_key(index: int) -> int:
    """The server key of parameter ``index``'s weights (even keys: see
    :class:`ServerOptimizer`)."""
    return 2 * index


def collective_key(number: int) -> int:
    """The server key of the ``number``-th collective slot (odd keys)."""
    return 2 * number + 1


def _is_model_key(key: int) -> bool:
    return key % 2 == 0


def refuse_script_optimizer(optimizer, owner: str) -> None:
    """The servers import the optimizer's class by module name: refuse one defined in
    the training script, which they do not run."""
    if isinstance(optimizer, mx.optimizer.Optimizer) and \
            type(optimizer).__module__ == "__main__":
        raise ValueError(
            f"{owner}: dist_async runs the optimizer on the servers, which import its class "
            f"by module name; {type(optimizer).__name__} is defined in the script "
            "(__main__), which the servers do not run. Define it in a module that is "
            "importable where the servers run (on their PYTHONPATH)")


def check_options(kv, compression, predivide: float, owner: str, optimizer=None) -> None:
    """Refuse what cannot work asynchronously, at construction."""
    if kv.type != "dist_async":
        return
    refuse_script_optimizer(optimizer, owner)
    if compression is not None:
        raise ValueError(f"{owner}: compression={compression['type']!r} does not work on "
                         "dist_async, whose servers apply each worker's push as it "
                         "arrives (dist_gluon's codecs sum compressed gradients in "
                         "lockstep); use compression=None, or dist_sync/p3/horovod")
    if predivide != 1.0:
        raise ValueError(f"{owner}: gradient_predivide_factor={predivide} has no meaning "
                         "on dist_async (no gradients are summed); leave it at 1")


def server_optimizer(optimizer: mx.optimizer.Optimizer, params=None):
    """A copy of ``optimizer`` for the servers: no rescaling (the worker divides by its
    batch size before the push) and the per-parameter ``lr_mult``/``wd_mult`` of Gluon
    ``params`` (a list, by position) written into its index-keyed tables, since
    ``param_dict`` does not travel."""
    sent = copy.copy(optimizer)
    sent.rescale_grad = 1.0
    sent.lr_mult = dict(optimizer.lr_mult)
    sent.wd_mult = dict(optimizer.wd_mult)
    for i, param in enumerate(params or []):
        sent.lr_mult[i] = param.lr_mult
        sent.wd_mult[i] = param.wd_mult
    return sent


class ServerOptimizer(mx.optimizer.Optimizer):
    """What the servers of a ``dist_async`` job run on every push. MXNet's kvstore
    server unpickles it inside ``import mxnet`` (where its loop runs), so this module
    imports nothing but (half-imported) MXNet.

    An asynchronous server applies each push at once through its optimizer and has no
    other mode, so dist_gluon's own collectives need keys that merely hold a value: even
    integer keys ``2 * i`` are model weights, updated by ``optimizer`` as its parameter
    ``i``; odd keys are collective slots, which keep the last value pushed.
    """

    def __init__(self, optimizer: mx.optimizer.Optimizer | None = None):
        super().__init__(learning_rate=0.0)
        self.optimizer = optimizer
        self.multi_precision = bool(optimizer is not None and optimizer.multi_precision)
        self.aggregate_num = 0

    def create_state_multi_precision(self, index, weight):
        if not _is_model_key(index) or self.optimizer is None:
            return None
        return self.optimizer.create_state_multi_precision(index // 2, weight)

    create_state = create_state_multi_precision

    def update_multi_precision(self, index, weight, grad, state):
        if not _is_model_key(index):
            grad.copyto(weight)
            return
        if self.optimizer is None:
            raise RuntimeError(f"dist_async server: a gradient for key {index} arrived "
                               "before the workers sent an optimizer")
        self.optimizer._set_current_context(weight.context.device_id)
        self.optimizer.update_multi_precision(index // 2, weight, grad, state)

    update = update_multi_precision


class ServerUpdates:
    """Pushes gradients to a dist_async job's servers and pulls the weights back.

    Parameters
    ----------
    kv : DistAsync
    owner : str
        Named in errors; one owner per job (the servers hold one optimizer).
    """

    def __init__(self, kv, owner: str):
        kv.claim_server_updates(owner)
        self.kv = kv
        self.owner = owner
        self.started = False
        self._known: set[int] = set()

    def step(self, indices: list[int], grads: list[mx.nd.NDArray],
             weights: list[mx.nd.NDArray], scale: float, optimizer, params=None,
             describe=None) -> None:
        """One asynchronous step for parameters ``indices``: send the optimizer at the
        first call, create the server weights of parameters not seen yet (from rank
        0's values, a collective, so every rank must call this with the same indices
        the first time), then push ``grads * scale`` and pull ``weights``."""
        for index, grad in zip(indices, grads):
            if grad.stype != "default":
                what = describe(index) if describe else f"parameter #{index}"
                raise TypeError(f"{self.owner} on dist_async: {what} has a {grad.stype} "
                                "gradient; the servers update dense gradients only (use "
                                "sparse_grad=False, or dist_sync/p3/horovod)")
        if not self.started:
            self.kv.send_optimizer(server_optimizer(optimizer, params))
            self.started = True
        new = [(i, w) for i, w in zip(indices, weights) if i not in self._known]
        if new:
            self.kv.init_model([i for i, _ in new], [w for _, w in new])
            self._known.update(i for i, _ in new)
        # here, not at the top: the servers unpickle this module half-way through
        # `import mxnet`, and it imports nothing else there
        from . import timeline
        for index, grad, weight in zip(indices, grads, weights):
            if scale != 1.0:
                grad *= scale
            ready = timeline.input_marker(grad)
            self.kv.push_gradient(index, grad, weight, priority=-index)
            timeline.collective(f"w{index}", weight,
                                grad.size * numpy.dtype(grad.dtype).itemsize, "push, pull",
                                ready)

    def sync_weights(self, indices: list[int], weights: list[mx.nd.NDArray]) -> None:
        """Wait until every worker's pushes so far are applied (a barrier, so every
        rank must call it), then pull the servers' weights: every rank holds the
        same."""
        self.kv.barrier()
        known = [(i, w) for i, w in zip(indices, weights) if i in self._known]
        if known:
            self.kv.pull_weights([i for i, _ in known], [w for _, w in known])
