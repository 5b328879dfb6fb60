"""``byteps.mxnet``'s API on every dist_gluon backend.

BytePS itself needs CUDA and NCCL; its MXNet API runs here, on one process, horovod,
dist_sync or p3, with the script's import line changed::

    import dist_gluon.compat.byteps as bps       # was: import byteps.mxnet as bps

or with no change at all when the launcher is given ``--compat byteps``, which puts a
``byteps`` package that forwards here first on the workers' PYTHONPATH::

    python -m dist_gluon.launch -n 2 --backend dist_sync --compat byteps -- python train.py

The semantics are BytePS's: ``DistributedTrainer.step(batch_size)`` multiplies each
rank's gradients by ``1 / (batch_size * size())`` before they are summed (so every rank
applies the mean of the ranks' per-sample gradients) and broadcasts ``root_rank``'s
parameters at the first step; ``byteps_push_pull`` sums a declared tensor in place and
averages it with ``is_average=True``; ``broadcast_parameters`` takes a dict (values
matched by key) and refuses a ParameterDict, as BytePS does. Every rank must call the
collectives in the same order. On one process every collective is the identity.

Not available, with an error saying what to use instead: BytePS's compressors (onebit,
topk, randomk, dithering, error feedback; ``{'fp16': True}`` works), asynchronous
training (``BYTEPS_ENABLE_ASYNC``), ``suspend``/``resume`` and ``get_pushpull_speed``.
"""
from __future__ import annotations

import os
import warnings

import mxnet as mx

from . import _collectives as _c
from ._training import Compression, PeerOptimizer, PeerTrainer, broadcast_dict, broadcast_model

_session = _c.Session("BytePS", "bps")
_declared: set[str] = set()
# compression_params keys that configure one of BytePS's own compressors
_COMPRESSOR_KEYS = ("compressor", "ef", "momentum", "k", "scaling", "seed", "partition",
                    "normalize")


def init(lazy=True) -> None:
    """Join the job the launcher started (``dist_gluon.create()``): one process, horovod,
    dist_sync or p3, whatever ``--backend`` was."""
    _session.init()


def shutdown() -> None:
    """Finish the push_pulls in flight; the backend closes at exit, with every other
    rank."""
    _session.shutdown()


def suspend():
    raise NotImplementedError("suspend: elastic BytePS is not available on dist_gluon's "
                              "backends; restart the job instead (the launcher's "
                              "--max-restarts with dist_gluon.Checkpointer resumes exactly)")


def resume(num_workers, num_servers, global_rank, context=None):
    raise NotImplementedError("resume: elastic BytePS is not available on dist_gluon's "
                              "backends; restart the job instead (the launcher's "
                              "--max-restarts with dist_gluon.Checkpointer resumes exactly)")


def get_pushpull_speed():
    raise NotImplementedError("get_pushpull_speed: BytePS's speed counter is not available; "
                              "time the training step yourself")


size, rank = _session.size, _session.rank
local_rank, local_size = _session.local_rank, _session.local_size


# ------------------------------------------------------------------ push_pull
def byteps_declare_tensor(*args, **kwargs) -> None:
    """Declare the name of a tensor that ``byteps_push_pull`` will sum:
    ``byteps_declare_tensor(name)`` (BytePS >= 0.2) or ``byteps_declare_tensor(tensor,
    name)`` (earlier). Per-tensor compressor settings (``byteps_compressor_type=...``)
    are not available."""
    if len(args) == 2 and isinstance(args[0], mx.nd.NDArray):
        name = args[1]
    elif len(args) == 1:
        name = args[0]
    else:
        raise TypeError("byteps_declare_tensor takes a name: byteps_declare_tensor(name)")
    if not isinstance(name, str):
        raise TypeError(f"byteps_declare_tensor: the name must be a str, got {name!r}")
    if kwargs:
        raise NotImplementedError(
            f"byteps_declare_tensor({name!r}, {', '.join(sorted(kwargs))}=...): BytePS's "
            "per-tensor compressors are not available on dist_gluon's backends; use "
            "dist_gluon.DistributedTrainer(..., compression='fp16', '2bit' or 'powersgd')")
    _declared.add(name)


def byteps_push_pull(tensor, version=0, priority=0, name=None, is_average=True) -> None:
    """Sum ``tensor`` over all workers in place, and divide it by ``size()`` if
    ``is_average``. ``name`` must have been declared with ``byteps_declare_tensor``;
    ``version`` is accepted (BytePS uses it for asynchronous training only)."""
    _c.check_tensor(tensor, "byteps_push_pull")
    if name is None or name not in _declared:
        raise ValueError(f"byteps_push_pull: tensor name {name!r} has not been declared; call "
                         "byteps_declare_tensor(name) on every rank first")
    kv = _session.kv
    kv.pushpull(_c.key("bps", "pp", name, tensor), tensor, priority=priority)
    if is_average and kv.num_workers > 1:
        tensor /= kv.num_workers


# ------------------------------------------------------------------ training
def broadcast_parameters(params, root_rank=0) -> None:
    """Overwrite every rank's dict of NDArrays (``Module.get_params()``) with
    ``root_rank``'s, values matched by key. Gluon parameters are broadcast by
    :class:`DistributedTrainer` at its first step, so a ParameterDict is a TypeError, as
    in BytePS."""
    kv = _session.kv
    if isinstance(params, dict):
        broadcast_dict(params, root_rank, kv)
    elif isinstance(params, mx.gluon.ParameterDict):
        raise TypeError("For gluon users, you should not call this function. "
                        "DistributedTrainer will broadcast all parameters at "
                        "the first training step.")
    else:
        raise ValueError(f"Invalid params of type: {type(params)}")


def _codec(compression_params) -> str | None:
    if not compression_params:
        return None
    if not isinstance(compression_params, dict):
        raise TypeError(f"compression_params must be a dict, got {compression_params!r}")
    fp16 = "fp16" if compression_params.get("fp16") else None
    if "compressor" not in compression_params:
        warnings.warn("Compressor is not defined", stacklevel=3)
        return fp16
    given = {k: compression_params[k] for k in _COMPRESSOR_KEYS if k in compression_params}
    raise NotImplementedError(
        f"compression_params {given}: BytePS's compressors are not available on "
        "dist_gluon's backends; use compression_params={'fp16': True}, or "
        "dist_gluon.DistributedTrainer(..., compression='2bit' or 'powersgd') for "
        "compression with error feedback")


class DistributedTrainer(PeerTrainer):
    """BytePS's DistributedTrainer: a ``gluon.Trainer`` that broadcasts ``root_rank``'s
    parameters at the first step and averages the gradients over all workers.

    ``step(batch_size)`` multiplies this rank's gradients by ``1 / (batch_size *
    size())``, sums them over the workers and updates with ``rescale_grad = 1``: every
    rank applies the same mean of the ranks' per-sample gradients, also when their batch
    sizes differ. (``allreduce_grads()`` alone scales by the last step's batch size.)

    Parameters
    ----------
    params : ParameterDict (or dict or list of Parameter)
        In the model's own order, keyed by position.
    optimizer : str or mx.optimizer.Optimizer
    optimizer_params : dict, optional
    root_rank : int
        The rank whose parameters every rank starts from.
    compression_params : dict, optional
        ``{'fp16': True}``: gradients travel as float16. BytePS's compressors
        (``'compressor': 'onebit'``, ...) raise NotImplementedError.
    """

    _kind = "bpst"

    def __init__(self, params, optimizer, optimizer_params=None, root_rank=0,
                 compression_params=None):
        kv = _session.kv
        kv._check_rank(root_rank, "root_rank")
        super().__init__(params, optimizer, optimizer_params, kv, _codec(compression_params),
                         None, owner="DistributedTrainer")
        self.root_rank = root_rank
        self._bps_size = kv.num_workers

    def step(self, batch_size, ignore_stale_grad=False):
        # the gradients are divided by the batch size before the sum (_allreduce_grads)
        self._scale = batch_size
        super().step(batch_size, ignore_stale_grad)

    def _allreduce_grads(self):
        self._sum_grads(1.0 / self._scale / self._bps_size)

    def _init_params(self):
        # the first step: root_rank's parameters everywhere (deferred ones when they get
        # their shapes), through dist_gluon's model check and broadcast
        broadcast_model(self._model_params, self.root_rank, self._kv)
        self._params_to_init = []


class DistributedOptimizer(PeerOptimizer):
    """BytePS's DistributedOptimizer for the Module API: each ``update`` averages the
    gradients over all workers (sum / ``size()``), then runs the wrapped optimizer.
    Install it with ``kvstore=None``: ``mod.fit(..., kvstore=None, optimizer=opt)``."""

    def __init__(self, optimizer):
        if int(os.getenv("BYTEPS_ENABLE_ASYNC", 0)) != 0:
            raise NotImplementedError(
                "BYTEPS_ENABLE_ASYNC: asynchronous BytePS training is not available on "
                "dist_gluon's backends; unset BYTEPS_ENABLE_ASYNC to train synchronously")
        super().__init__(optimizer, _session.kv, prescale=1.0, average=True)


__all__ = [
    "init", "shutdown", "suspend", "resume", "size", "local_size", "rank", "local_rank",
    "get_pushpull_speed", "byteps_declare_tensor", "byteps_push_pull",
    "broadcast_parameters", "Compression", "DistributedOptimizer", "DistributedTrainer",
]
