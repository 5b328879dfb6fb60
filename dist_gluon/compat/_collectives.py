"""Named tensor collectives of the peers' APIs on a dist_gluon backend.

Horovod and BytePS key an operation by its name; dist_gluon's backends key it by a
string too, but a ps-lite key keeps the shape and dtype of its first use. So the key is
the name with the shape and dtype: a name used again with another shape (or no name at
all: horovod numbers those) gets a key of its own, and repeated calls reuse a few keys.
Every rank must call the collectives in the same order, as with the peers.

Sums and broadcasts are the backend's own; everything else is built from them:
averages divide the sum, Min/Max/Product and the gathers go through
``allgather_object`` (each rank receives every rank's array, which costs N times the
bytes of a dedicated all-gather; fine for the small tensors scripts gather).
"""
from __future__ import annotations

import pickle

import mxnet as mx
import numpy as np

from .. import worker
from ..backends import Backend, create

# horovod's reduction op values (horovod.common.basics)
AVERAGE, SUM, ADASUM, MIN, MAX, PRODUCT = 0, 1, 2, 3, 4, 5
_OP_NAMES = {AVERAGE: "Average", SUM: "Sum", ADASUM: "Adasum", MIN: "Min", MAX: "Max",
             PRODUCT: "Product"}
_ELEMENTWISE = {MIN: np.min, MAX: np.max, PRODUCT: np.prod}


class Session:
    """One API's view of the process's backend: ``init()`` creates it (``dg.create()``,
    chosen by the launcher), ``shutdown()`` forgets it; the peers' calls before ``init``
    raise their own ValueError."""

    def __init__(self, api: str, module: str):
        self._api, self._module = api, module
        self._kv: Backend | None = None

    def init(self) -> Backend:
        if self._kv is None:
            self._kv = create()
        return self._kv

    def shutdown(self) -> None:
        """Finish the work in flight and forget the backend. The backend itself is
        closed at exit, together with every other rank (dist_gluon's coordinated
        shutdown), so a rank that shuts down first never breaks the others."""
        if self._kv is not None:
            mx.nd.waitall()
        self._kv = None

    @property
    def initialized(self) -> bool:
        return self._kv is not None

    @property
    def kv(self) -> Backend:
        if self._kv is None:
            raise ValueError(f"{self._api} has not been initialized; use {self._module}.init().")
        return self._kv

    # the peers' size(), rank(), local_rank() and local_size(), bound once in each module
    def size(self) -> int:
        return self.kv.num_workers

    def rank(self) -> int:
        return self.kv.rank

    def local_rank(self) -> int:
        return self.kv.local_rank

    def local_size(self) -> int:
        return topology(self.kv)[0]


def key(api: str, kind: str, name, tensor: mx.nd.NDArray) -> str:
    """The backend key of ``api``'s ``kind`` operation ``name`` on ``tensor``."""
    shape = "x".join(map(str, tensor.shape))
    return f"{api}.{kind}.{'' if name is None else name}.{shape}.{np.dtype(tensor.dtype).name}"


def check_tensor(tensor, function: str) -> None:
    if not isinstance(tensor, mx.nd.NDArray):
        raise TypeError(f"{function} takes an mxnet NDArray, got {type(tensor).__name__}")


def allreduce_(kv: Backend, key_: str, tensor: mx.nd.NDArray, op: int, priority: int = 0,
               prescale: float = 1.0, postscale: float = 1.0) -> mx.nd.NDArray:
    """Reduce ``tensor`` over the workers in place with horovod's ``op``; horovod's
    order: prescale, reduce, postscale (and 1/size for Average)."""
    if op == ADASUM:
        raise NotImplementedError(
            "op=Adasum is not available on dist_gluon's backends; use op=Average (or "
            "horovod.mxnet itself, started with --backend horovod)")
    if op not in _OP_NAMES:
        raise ValueError(f"unknown reduction op {op!r}; use Average, Sum, Min, Max or Product")
    if prescale != 1.0:
        scale_(tensor, prescale)
    if op in (SUM, AVERAGE):
        kv.pushpull(key_, tensor, priority=priority)
    elif kv.num_workers > 1:
        every = kv.allgather_object(tensor.asnumpy())
        reduced = _ELEMENTWISE[op](np.stack(every), axis=0).astype(every[0].dtype)
        tensor[:] = mx.nd.array(reduced, ctx=tensor.context, dtype=tensor.dtype)
    factor = postscale / kv.num_workers if op == AVERAGE else postscale
    if factor != 1.0:
        scale_(tensor, factor)
    return tensor


def scale_(tensor: mx.nd.NDArray, factor: float) -> None:
    """``tensor *= factor`` in place as horovod scales: an integer tensor is multiplied
    in double precision and truncated toward zero (MXNet's own ``*=`` would cast the
    factor to the integer type first: 0.5 becomes 0)."""
    if np.dtype(tensor.dtype).kind in "iub":
        tensor[:] = (tensor.astype("float64") * factor).astype(tensor.dtype)
    else:
        tensor *= factor


def broadcast_(kv: Backend, key_: str, tensor: mx.nd.NDArray, root_rank: int,
               priority: int = 0) -> mx.nd.NDArray:
    """Overwrite ``tensor`` with ``root_rank``'s, in place."""
    kv.check_rank(root_rank, "root_rank")
    kv.broadcast_root(key_, tensor, tensor, root_rank, priority)
    return tensor


def gather_arrays(kv: Backend, tensor: mx.nd.NDArray, function: str) -> list[np.ndarray]:
    """Every rank's ``tensor`` as NumPy arrays, indexed by rank; all but the first
    dimension must agree."""
    every = kv.allgather_object(tensor.asnumpy())
    shapes = [a.shape for a in every]
    if any(len(s) != len(shapes[0]) or s[1:] != shapes[0][1:] for s in shapes):
        raise ValueError(f"{function}: the ranks' tensors may differ in their first dimension "
                         f"only, got shapes {shapes} (by rank)")
    return every


def allgather(kv: Backend, tensor: mx.nd.NDArray) -> mx.nd.NDArray:
    """Every rank's ``tensor`` concatenated along the first dimension, in rank order."""
    every = gather_arrays(kv, tensor, "allgather")
    return mx.nd.array(np.concatenate(every), ctx=tensor.context, dtype=tensor.dtype)


def equal_splits(rows: int, size: int, function: str) -> list[int]:
    if rows % size:
        raise ValueError(f"{function}: the first dimension ({rows}) must divide evenly by "
                         f"the number of workers ({size}) when no splits are given")
    return [rows // size] * size


def alltoall(kv: Backend, tensor: mx.nd.NDArray, splits) -> tuple[mx.nd.NDArray, list[int]]:
    """Rank r sends ``splits[j]`` rows (consecutive, in rank order) to each rank j and
    receives what every rank sent it, in rank order; returns those rows and how many came
    from each rank."""
    size = kv.num_workers
    rows = tensor.shape[0]
    if splits is None:
        splits = equal_splits(rows, size, "alltoall")
    else:
        if isinstance(splits, mx.nd.NDArray):
            splits = splits.asnumpy()
        splits = [int(s) for s in np.asarray(splits).reshape(-1)]
        if len(splits) != size or any(s < 0 for s in splits) or sum(splits) != rows:
            raise ValueError(f"alltoall: splits must hold {size} non-negative counts (one per "
                             f"rank) summing to the first dimension {rows}, got {splits}")
    every = kv.allgather_object((tensor.asnumpy(), splits))
    shapes = [a.shape for a, _ in every]
    if any(s[1:] != shapes[0][1:] for s in shapes):
        raise ValueError(f"alltoall: the ranks' tensors may differ in their first dimension "
                         f"only, got shapes {shapes} (by rank)")
    me = kv.rank
    parts = []
    for array, their_splits in every:
        start = sum(their_splits[:me])
        parts.append(array[start:start + their_splits[me]])
    received = mx.nd.array(np.concatenate(parts), ctx=tensor.context, dtype=tensor.dtype)
    return received, [len(p) for p in parts]


def scatter_rows(rows: int, size: int, rank: int) -> tuple[int, int]:
    """horovod's reducescatter split: the first ``rows % size`` ranks get one row more.
    Returns (start, stop) of ``rank``'s rows."""
    small, extra = divmod(rows, size)
    start = rank * small + min(rank, extra)
    return start, start + small + (rank < extra)


def topology(kv: Backend) -> tuple[int, int, int]:
    """(local_size, cross_rank, cross_size): the number of workers on this node, this
    node's index and the number of nodes. Horovod's own answer on the horovod backend;
    otherwise the launcher's (nodes of -n workers each); one node without the launcher."""
    hvd = getattr(kv, "_hvd", None)
    if hvd is not None:
        return hvd.local_size(), hvd.cross_rank(), hvd.cross_size()
    place = worker.context()
    nnodes = place.nnodes if kv.num_workers > 1 else 1
    node = place.node_rank if kv.num_workers > 1 else 0
    return kv.num_workers // nnodes, node, nnodes


def _dumps(obj) -> bytes:
    try:
        import cloudpickle  # what horovod uses: lambdas and local classes travel too
    except ImportError:
        return pickle.dumps(obj)
    return cloudpickle.dumps(obj)


def broadcast_object(kv: Backend, obj, root_rank: int):
    kv.check_rank(root_rank, "root_rank")
    payload = _dumps(obj) if kv.rank == root_rank else None
    return pickle.loads(kv.broadcast_object(payload, root_rank=root_rank))


def allgather_object(kv: Backend, obj) -> list:
    return [pickle.loads(p) for p in kv.allgather_object(_dumps(obj))]
