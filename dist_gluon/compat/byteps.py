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

BytePS's gradient compression works as in BytePS: ``compression_params`` of
DistributedTrainer takes ``compressor`` ('onebit' with ``scaling``, 'topk', 'randomk',
'dithering' with ``k``, ``partition``, ``normalize``), ``ef='vanilla'``,
``momentum='nesterov'`` (its mu is the optimizer's ``momentum``, which is then removed
from the optimizer, and with onebit the weight decay becomes BytePS's weight-decay
momentum), ``seed`` and ``fp16``; empty or false values mean "not set". The
compressors are dist_gluon's codecs of the same names
(:mod:`dist_gluon.compression.byteps_compressors`), and ``Compression.nag`` and
``Compression.wdmom`` are BytePS's adapters for the uncompressed tensors and the weight
decay (``byteps.mxnet.compression`` under ``--compat byteps``).

Not available, with an error saying what to use instead: per-tensor compressor settings
in ``byteps_declare_tensor``, asynchronous training (``BYTEPS_ENABLE_ASYNC``),
``suspend``/``resume`` and ``get_pushpull_speed``.
"""
from __future__ import annotations

import copy
import os
import warnings

import mxnet as mx
import numpy as np

from ..compression import CODECS
from . import _collectives as _c
from ._training import Compression as _PeerCompression
from ._training import PeerOptimizer, PeerTrainer, _Compressor, broadcast_dict, broadcast_model

_session = _c.Session("BytePS", "bps")
_declared: set[str] = set()
# BytePS's compressor names (its C++ registry), all dist_gluon codecs
_COMPRESSORS = ("onebit", "topk", "randomk", "dithering")
# as in BytePS: the number of tensors broadcast_parameters has sent (their names)
parameter_index = 0


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
    global parameter_index
    kv = _session.kv
    if isinstance(params, dict):
        broadcast_dict(params, root_rank, kv)
        parameter_index += len(params)
    elif isinstance(params, mx.gluon.ParameterDict):
        raise TypeError("For gluon users, you should not call this function. "
                        "DistributedTrainer will broadcast all parameters at "
                        "the first training step.")
    else:
        raise ValueError(f"Invalid params of type: {type(params)}")


# ------------------------------------------------------------------ compression
def _byte_size(shape) -> int:
    """BytePS's Python size of a tensor: 4 bytes an element, whatever its dtype."""
    return int(np.prod(shape)) * 4


class _NagAdapter(_Compressor):
    """BytePS's ``Compression.nag(compressor, mu, threshold)``: Nesterov momentum for the
    gradients that travel uncompressed (smaller than ``threshold`` bytes), after the sum;
    the compressed ones get theirs from the compressor, before it. ``decompress`` first
    runs the wrapped compressor's, then ``m = mu * (m + g)``, ``g += m``."""

    def __init__(self, compressor, mu, threshold, *args, **kwargs):
        self.compressor = compressor
        self.mu = mu
        self.threshold = threshold
        self.mom = None
        self.inited = False
        self.nag = False

    def compress(self, tensor, *args, **kwargs):
        return self.compressor.compress(tensor)

    def decompress(self, tensor, ctx, *args, **kwargs):
        tensor = self.compressor.decompress(tensor, ctx, *args, **kwargs)
        if not self.inited:
            self.nag = _byte_size(tensor.shape) < self.threshold
            if self.nag:
                self.mom = mx.nd.zeros_like(tensor)
            self.inited = True
        if self.nag:
            self.mom += tensor
            self.mom *= self.mu
            tensor += self.mom
        return tensor


class _WeightDecayMomentumAdapter(_Compressor):
    """BytePS's ``Compression.wdmom(compressor, mu, wd, threshold)`` (for onebit with
    momentum): the weight decay joins the gradient after the sum, with a momentum of its
    own on the compressed tensors (at least ``threshold`` bytes):
    ``m = mu * (m + wd * x)``; ``g += m + wd * x``. ``decompress`` needs the weight as
    ``x=``."""

    def __init__(self, compressor, mu, wd, threshold, *args, **kwargs):
        self.compressor = compressor
        self.mu = mu
        self.wd = wd
        self.threshold = threshold
        self.mom = None
        self.cache = None
        self.wdmom = False
        self.inited = False

    def compress(self, tensor, *args, **kwargs):
        return self.compressor.compress(tensor)

    def decompress(self, tensor, ctx, *args, **kwargs):
        if "x" not in kwargs:
            raise ValueError("x is missing")
        x = kwargs["x"].astype(tensor.dtype, copy=False)
        if not self.inited:
            self.cache = mx.nd.zeros_like(tensor)
            self.wdmom = _byte_size(tensor.shape) >= self.threshold
            if self.wdmom:
                self.mom = mx.nd.zeros_like(tensor)
            self.inited = True
        mx.nd._internal._mul_scalar(x, scalar=self.wd, out=self.cache)
        if self.wdmom:
            self.mom += self.cache
            self.mom *= self.mu
            tensor += self.mom
        tensor += self.cache
        return self.compressor.decompress(tensor, ctx, *args, **kwargs)


class Compression(_PeerCompression):
    """BytePS's gradient compression objects: ``none``, ``fp16`` (gradients travel as
    float16), and the adapters its DistributedTrainer wraps around them, ``wdmom``
    (weight-decay momentum, onebit) and ``nag`` (Nesterov momentum of the uncompressed
    tensors)."""

    wdmom = _WeightDecayMomentumAdapter
    nag = _NagAdapter


def _setting(params: dict, name: str):
    value = params.get(name)
    if value and not isinstance(value, str):
        raise TypeError(f"{name} should be str")
    return value or None


def _compression(compression_params, optimizer_params):
    """BytePS's DistributedTrainer._register_compressor: ``compression_params`` as
    (dist_gluon codec spec or None, the adapter every parameter gets a copy of, the
    optimizer_params without what the compression took over)."""
    adapter = Compression.none
    optimizer_params = dict(optimizer_params or {})
    if not compression_params:
        return None, adapter, optimizer_params
    if not isinstance(compression_params, dict):
        raise TypeError(f"compression_params must be a dict, got {compression_params!r}")
    fp16 = bool(compression_params.get("fp16"))
    if "compressor" not in compression_params:
        warnings.warn("Compressor is not defined", stacklevel=3)
        return ("fp16" if fp16 else None), adapter, optimizer_params
    compressor = _setting(compression_params, "compressor")
    ef = _setting(compression_params, "ef")
    momentum = _setting(compression_params, "momentum")
    if compressor is None:
        if ef or momentum:
            raise ValueError(f"compression_params: ef={ef!r} and momentum={momentum!r} act on "
                             "a compressor; set 'compressor' to one of "
                             f"{', '.join(map(repr, _COMPRESSORS))}")
        return ("fp16" if fp16 else None), adapter, optimizer_params
    if compressor not in _COMPRESSORS:
        raise ValueError(f"compression_params: unknown compressor {compressor!r}; BytePS's "
                         f"are {', '.join(map(repr, _COMPRESSORS))}")
    if fp16:
        raise NotImplementedError(
            "compression_params: 'fp16' together with a compressor is not available on "
            "dist_gluon's backends (the compressors work on the gradients' own dtype); "
            "drop one of them")
    spec = {"type": compressor, "ef": ef, "momentum": momentum,
            "momentum_uncompressed": False}
    if compressor == "onebit":
        spec["scaling"] = str(compression_params.get("scaling", False)) == "True"
    else:
        if "k" not in compression_params:
            raise KeyError(f"compression_params: the {compressor} compressor needs 'k'")
        spec["k"] = compression_params["k"]
    if compression_params.get("seed") is not None:
        spec["seed"] = compression_params["seed"]
    for name, choices in (("partition", ("linear", "natural")), ("normalize", ("max", "l2"))):
        value = compression_params.get(name)
        if value:
            if value not in choices:
                raise ValueError(f"compression_params: unsupported {name} {value!r}, use "
                                 f"one of {choices}")
            if compressor == "dithering":
                spec[name] = value
    if momentum:
        if "momentum" not in optimizer_params:
            raise KeyError("compression_params momentum='nesterov' takes its mu from "
                           "optimizer_params['momentum'], which is missing")
        mu = optimizer_params.pop("momentum")
        spec["momentum_mu"] = mu
        threshold = int(os.environ.get("BYTEPS_MIN_COMPRESS_BYTES", 65536))
        spec["min_compress_bytes"] = threshold
        if compressor == "onebit" and "wd" in optimizer_params:
            adapter = Compression.wdmom(adapter, mu, optimizer_params.pop("wd"), threshold)
        adapter = Compression.nag(adapter, mu, threshold)
    CODECS[compressor](**{k: v for k, v in spec.items() if k != "type"})   # checks them
    return spec, adapter, optimizer_params


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
        ``{'fp16': True}``: gradients travel as float16. ``{'compressor': 'onebit',
        'ef': 'vanilla', 'momentum': 'nesterov', 'scaling': True}`` and the other keys
        of BytePS (see the module's docstring): BytePS's compressors. Empty or false
        values are "not set"; with ``momentum`` the optimizer's ``momentum`` (and, for
        onebit, ``wd``) move into the compression, as in BytePS.
    """

    _kind = "bpst"

    def __init__(self, params, optimizer, optimizer_params=None, root_rank=0,
                 compression_params=None):
        kv = _session.kv
        kv.check_rank(root_rank, "root_rank")
        codec, adapter, optimizer_params = _compression(compression_params, optimizer_params)
        super().__init__(params, optimizer, optimizer_params, kv, codec, None,
                         owner="DistributedTrainer")
        self.root_rank = root_rank
        self._bps_size = kv.num_workers
        # each parameter's own copy of the adapters (their momentum is per tensor)
        self._adapters = None if adapter is Compression.none else \
            [copy.deepcopy(adapter) for _ in self._params]

    def step(self, batch_size, ignore_stale_grad=False):
        # the gradients are divided by the batch size before the sum (_allreduce_grads)
        self._scale = batch_size
        super().step(batch_size, ignore_stale_grad)

    def _allreduce_grads(self):
        # BytePS's trainer writes it to lr.s for the error feedback's ratio
        self._tell_codec_learning_rate()
        self._sum_grads(1.0 / self._scale / self._bps_size)
        if self._adapters is not None:
            for param, adapter in zip(self._params, self._adapters):
                if param.grad_req != "null":
                    grad = param.list_grad()[0]
                    result = adapter.decompress(grad, None, x=param.list_data()[0])
                    if result is not grad:
                        grad[:] = result

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
    "parameter_index",
]
