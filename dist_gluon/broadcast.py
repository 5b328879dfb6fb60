"""Rank 0's weights on every rank, checked model structure, and deferred initialisation.

Tensors are keyed by their position in the model's own parameter order: MXNet 1.x names
come from global counters (``dense0_``, ``dense2_``...) and differ between ranks that
built different numbers of blocks, so names are only used in messages.

Deferred-initialised Gluon parameters (shapes known at the first forward) are handled
as in Horovod PR #915: ``Parameter._init_impl`` is wrapped so that the broadcast runs
right after the parameter gets its value, on every rank, before it is used.
"""
from __future__ import annotations

import copy
import itertools
from collections.abc import Callable

import mxnet as mx
import numpy as np
from mxnet.gluon.parameter import Parameter

from . import worker
from .backends import Backend, resolve

_ORIGINAL_INIT = "_dg_original_init_impl"
_standalone_calls = itertools.count()


class ModelMismatchError(RuntimeError):
    """Ranks hold different models (parameter count, shape, dtype or grad_req)."""


def parameter_list(params) -> list:
    """Parameters (or NDArrays) in the model's own order.

    A ParameterDict or dict keeps its insertion order (the order the model defines
    them); names are never sorted ('dense10' < 'dense9').
    """
    if isinstance(params, (dict, mx.gluon.ParameterDict)):
        return list(params.values())
    if isinstance(params, (list, tuple)):
        return list(params)
    raise TypeError("params must be a ParameterDict, a dict or a list of Parameters, got "
                    f"{type(params).__name__}")


def optimizer_state_arrays(state) -> list[mx.nd.NDArray]:
    """The NDArrays of one optimizer state (an array, a tuple of them, nested, or None)."""
    if isinstance(state, mx.nd.NDArray):
        return [state]
    if isinstance(state, (tuple, list)):
        return [leaf for part in state for leaf in optimizer_state_arrays(part)]
    return []


def update_counters(optimizer: mx.optimizer.Optimizer) -> dict:
    """A copy of ``optimizer``'s update counts, which learning-rate schedules and Adam's
    bias correction follow: ``num_update``, each device's per-index counts
    (``tables``), which of them is current, and the lr scheduler (a deep copy: it
    counts too). :func:`set_update_counters` puts them back."""
    tables = optimizer._all_index_update_counts
    current = next((d for d, t in tables.items() if t is optimizer._index_update_count), 0)
    return {"num_update": optimizer.num_update, "current": current,
            "tables": {d: dict(t) for d, t in tables.items()},
            "lr_scheduler": copy.deepcopy(optimizer.lr_scheduler)}


def set_update_counters(optimizer: mx.optimizer.Optimizer, counters: dict) -> None:
    """Give ``optimizer`` the counts of :func:`update_counters` (copies of them)."""
    optimizer.num_update = counters["num_update"]
    optimizer._all_index_update_counts = {d: dict(t) for d, t in counters["tables"].items()}
    optimizer._index_update_count = optimizer._all_index_update_counts.setdefault(
        counters["current"], {})
    optimizer.lr_scheduler = copy.deepcopy(counters["lr_scheduler"])


def _spec(item, index: int) -> dict:
    if isinstance(item, Parameter):
        initialised = item._data is not None
        return {"index": index, "name": item.name,
                "shape": tuple(item.shape) if initialised else None,
                "dtype": np.dtype(item.dtype).name, "null": item.grad_req == "null"}
    return {"index": index, "name": None, "shape": tuple(item.shape),
            "dtype": np.dtype(item.dtype).name, "null": False}


def _describe(spec: dict) -> str:
    shape = "deferred (shape unknown)" if spec["shape"] is None else f"shape {spec['shape']}"
    name = f"{spec['name']!r} " if spec["name"] else ""
    return f"{name}{shape} {spec['dtype']}"


def check_same_model(kv: Backend, specs: list[dict], what: str = "model") -> None:
    """Compare ``specs`` with every other rank's and raise the same clear error on every
    rank when they differ. One collective."""
    everyone = kv.allgather_object(specs)
    reference = everyone[0]
    problems = []
    for rank, theirs in enumerate(everyone[1:], start=1):
        if len(theirs) != len(reference):
            problems.append(f"rank 0 has {len(reference)} parameters but rank {rank} has "
                            f"{len(theirs)}")
            continue
        for mine, other in zip(reference, theirs):
            fields = ("index", "shape", "dtype", "null")
            if any(mine[f] != other[f] for f in fields):
                problems.append(f"parameter #{mine['index']}: rank 0 has {_describe(mine)}, "
                                f"rank {rank} has {_describe(other)}"
                                + ("" if mine["null"] == other["null"] else
                                   " (grad_req='null' on one rank only)"))
    if problems:
        raise ModelMismatchError(
            f"the {what} differs between ranks; every rank must build the same model "
            "(same blocks in the same order, same shapes and dtypes):\n  "
            + "\n  ".join(problems[:10]))


class ParameterSync:
    """Broadcasts a list of Parameters from ``root_rank`` now, and again whenever one of
    them is (re)initialised, e.g. deferred parameters at the first forward.

    ``key(i)`` names the communication key of parameter ``i``.
    """

    def __init__(self, params: list, kv: Backend, key: Callable[[int], str],
                 root_rank: int = 0, what: str = "model"):
        self._params, self._kv, self._key = params, kv, key
        self._root, self._what = root_rank, what
        kv.check_rank(root_rank, "root_rank")

    def start(self) -> None:
        """Check the model across ranks, broadcast what is initialised, hook the rest."""
        if self._kv.num_workers == 1 or worker.context().heal:
            # a worker that joins a running job gets its state from a live peer in
            # dist_gluon.elastic.State.sync(), which the others run then, not this
            return
        specs = [_spec(p, i) for i, p in enumerate(self._params)]
        check_same_model(self._kv, specs, self._what)
        ready = [i for i, s in enumerate(specs) if s["shape"] is not None]
        self._broadcast(ready)
        for i, p in enumerate(self._params):
            if isinstance(p, Parameter):
                self._hook(i, p)

    def _broadcast(self, indices: list[int]) -> None:
        if not indices:
            return
        arrays = [self._array(i) for i in indices]
        self._kv.broadcast_root([self._key(i) for i in indices], arrays, arrays,
                                self._root, 0)
        for arr in arrays:
            arr.wait_to_read()
        for i in indices:
            item = self._params[i]
            if isinstance(item, Parameter):
                for extra in item.list_data()[1:]:
                    item.list_data()[0].copyto(extra)

    def _array(self, i: int) -> mx.nd.NDArray:
        item = self._params[i]
        return item.list_data()[0] if isinstance(item, Parameter) else item

    def _hook(self, index: int, param: Parameter) -> None:
        original = getattr(param, _ORIGINAL_INIT, None) or param._init_impl
        setattr(param, _ORIGINAL_INIT, original)

        def _init_impl(data, ctx_list):
            original(data, ctx_list)
            check_same_model(self._kv, [_spec(param, index)], self._what)
            self._broadcast([index])

        param._init_impl = _init_impl


def broadcast_parameters(params, root_rank: int = 0, kv=None) -> None:
    """Overwrite every rank's parameters with ``root_rank``'s.

    Parameters
    ----------
    params : ParameterDict, dict or list of Parameter, or dict of NDArray
        Gluon parameters (``net.collect_params()``), or the ``arg_params`` /
        ``aux_params`` dicts of ``Module.get_params()``; NDArrays are overwritten in
        place. Parameters whose initialisation is deferred are broadcast when they are
        initialised, at the first forward.
    root_rank : int
        The rank whose values every rank receives.
    kv : backend, backend name or None
        None picks the backend from the environment (``dist_gluon.create()``).

    Raises
    ------
    ModelMismatchError
        On every rank, when ranks hold different numbers, shapes or dtypes of parameters.

    Examples
    --------
    >>> net.initialize()            # any seed
    >>> dg.broadcast_parameters(net.collect_params())
    >>> arg_params, aux_params = mod.get_params()
    >>> dg.broadcast_parameters(arg_params); dg.broadcast_parameters(aux_params)
    >>> mod.set_params(arg_params, aux_params)
    """
    kv = resolve(kv)
    items = parameter_list(params)
    for item in items:
        if not isinstance(item, (Parameter, mx.nd.NDArray)):
            raise TypeError("params must hold gluon Parameters or NDArrays, got "
                            f"{type(item).__name__}")
    call = next(_standalone_calls)
    ParameterSync(items, kv, key=lambda i: f"bp{call}.{i}", root_rank=root_rank,
                  what="parameter set").start()
