"""The interface every communication backend implements.

A backend is an ``mx.kv.KVStoreBase`` (MXNet RFC #16795), so a plain
``gluon.Trainer(..., kvstore=backend, update_on_kvstore=False)`` can use it. Subclasses
implement two in-place collectives on flat lists of NDArrays; everything else (key
normalisation, lists of keys, several device copies per key, ``out`` handling, Python
objects) is done once here.
"""
from __future__ import annotations

import atexit
import ctypes
import fcntl
import os
import pickle
import socket
import struct
import sys
import threading
from collections.abc import Callable
from typing import Any

import mxnet as mx
import numpy as np
from mxnet.kvstore.base import KVStoreBase

from .. import jobcontrol, worker
from .. import join as _join

# Python objects travel as arrays of bytes; buffers are rounded up to a power of two so
# that backends with fixed-shape keys (ps-lite) reuse a handful of keys.
_MIN_OBJECT_BUFFER = 256


def _as_list(x) -> list:
    return list(x) if isinstance(x, (list, tuple)) else [x]


def _key_name(key) -> str:
    if isinstance(key, (int, np.integer)):
        return str(int(key))
    if isinstance(key, str):
        return key
    raise TypeError(f"kvstore keys must be int or str, got {type(key).__name__}: {key!r}")


def _integer_keys(key) -> bool:
    keys = key if isinstance(key, (list, tuple)) else [key]
    return all(isinstance(k, (int, np.integer)) for k in keys)


def report_connect(backend_type: str) -> None:
    """Count joining the job (a rendezvous every worker must reach) as the first
    collective, so that the launcher sees a rank waiting for a peer that left before it
    ever connected."""
    reporter = jobcontrol.reporter()
    if reporter is not None and worker.context().num_workers > 1:
        reporter.submitted(f"connect ({backend_type})")


def _exit_now(status: int) -> None:
    """End a worker that failed with an uncaught exception (Python has printed it and set
    ``sys.last_value``). Its peers will never join the
    collectives it left pending, and the orderly shutdown (horovod's, ps-lite's exit
    barrier) is itself a collective: waiting for either hangs this process, or lets a
    peer fail first and be blamed by the launcher. So skip them."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):
            pass
    os._exit(status)


def interface_address(iface: str) -> str | None:
    """The first IPv4 address of network interface ``iface``, or None."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            packed = fcntl.ioctl(sock.fileno(), 0x8915,      # SIOCGIFADDR
                                 struct.pack("256s", iface.encode()[:15]))
        except OSError:
            return None
    return socket.inet_ntoa(packed[20:24])


def shard_counts(size: int, num_workers: int, first: int = 0) -> list[int]:
    """How many of ``size`` rows each rank holds when they are split over
    ``num_workers`` in consecutive parts: ``size // num_workers`` each, and one more
    for the ``size % num_workers`` ranks from rank ``first`` on (cyclically)."""
    base, extra = divmod(size, num_workers)
    return [base + (1 if (rank - first) % num_workers < extra else 0)
            for rank in range(num_workers)]


def shard_bounds(size: int, num_workers: int, rank: int, first: int = 0) -> tuple[int, int]:
    """The rows ``[start, stop)`` that ``rank`` holds of :func:`shard_counts`'s split
    (with ``first=0``, horovod's split: the first ranks hold one row more)."""
    counts = shard_counts(size, num_workers, first)
    start = sum(counts[:rank])
    return start, start + counts[rank]


def _rows(arr) -> int:
    """The first axis' length; MXNet 1.x writes an array of no rows as shape (0,)."""
    return arr.shape[0] if arr.size else 0


def _no_rows(shape, ctx, dtype):
    """An array of no rows of arrays of ``shape`` (which MXNet 1.x operators take for
    an unknown shape: only collectives and copies see it)."""
    return mx.nd.empty((0,) + tuple(shape[1:]), ctx=ctx, dtype=dtype)


class Backend(KVStoreBase):
    """Base class of dist_gluon's communication backends.

    Subclasses set ``_type`` and implement ``_allreduce_(names, arrays, priority)`` (sum in
    place over workers) and ``_broadcast_(names, arrays, root_rank, priority)`` (overwrite
    in place with ``root_rank``'s values). Both are only called when ``num_workers > 1``.
    """

    _type = "base"
    # dtype that carries the bytes of pickled objects through the sum collectives
    _byte_dtype = "uint8"
    # whether the transport sums float64 itself (else an exact path of our own does, at a
    # cost: SyncBatchNorm then gathers float32 rows instead)
    _sums_float64 = True

    def __init__(self):
        self._closed = False
        self._codec = None           # set_gradient_compression
        # Collectives are submitted from several threads (SyncBatchNorm's backward runs
        # in MXNet's autograd threads while the script's thread sums gradients): the
        # transports' submission calls and key creation are not thread-safe, so every
        # backend makes them under this lock. Never held while waiting for the engine.
        self._submit_lock = threading.RLock()
        self._in_flight: dict[str, mx.nd.NDArray] = {}
        self._reporter = jobcontrol.reporter()
        # what closes with the transport (SyncBatchNorm's side channel): at_shutdown
        self._shutdown_hooks: list[Callable[[], None]] = []
        # registered after the transport's own exit handlers (horovod's shutdown), so
        # it runs before them
        atexit.register(self._atexit)

    def _progress(self, name: str) -> None:
        """Tell the launcher a collective was submitted (job-control channel)."""
        if self._reporter is not None:
            self._reporter.submitted(name)

    # ----------------------------------------------------------------- identity
    @property
    def type(self) -> str:
        return self._type

    @property
    def rank(self) -> int:
        raise NotImplementedError

    @property
    def num_workers(self) -> int:
        raise NotImplementedError

    @property
    def local_rank(self) -> int:
        raise NotImplementedError

    @property
    def restart(self) -> int:
        """How many times the launcher has restarted this job's workers so far, for any
        reason (a failure with ``--max-restarts``, or a re-formation of an elastic
        job): 0 in the first run, and without a launcher (``DG_RESTART``, in the
        :class:`~dist_gluon.worker.WorkerContext`)."""
        return worker.context().restart

    @property
    def reformation(self) -> int:
        """How many times the set of nodes of an elastic job (``--nnodes MIN:MAX``) has
        changed so far: 0 until the first re-formation, and outside an elastic job
        (``DG_REFORMATION``, in the :class:`~dist_gluon.worker.WorkerContext`).
        ``num_workers`` is the size of the current set."""
        return worker.context().reformation

    def node_address(self) -> str:
        """The IPv4 address of this worker that the job's other workers reach (where a
        side channel of the package, such as SyncBatchNorm's, listens): loopback in a
        one-node job the launcher placed, else the address the transport announces."""
        if worker.context().placed and worker.context().nnodes == 1:
            return "127.0.0.1"
        return self._announced_address() or socket.gethostbyname(socket.gethostname())

    def _announced_address(self) -> str | None:
        """The address the transport announces to its peers, where the backend knows it
        (its variables), or None."""
        return None

    def at_shutdown(self, hook: Callable[[], None]) -> None:
        """Call ``hook`` at exit, once the work in flight has finished, before the
        transport shuts down (not when the job failed: the process then ends at once)."""
        self._shutdown_hooks.append(hook)

    def __repr__(self) -> str:
        return (f"<{type(self).__name__} type={self.type!r} rank={self.rank} "
                f"num_workers={self.num_workers}>")

    # ------------------------------------------------------------ tensor collectives
    def broadcast(self, key, value, out, priority: int = 0) -> None:
        """Broadcast ``value`` of rank 0 to ``out`` on every rank.

        Parameters
        ----------
        key : int, str, or list of them
        value : NDArray or list of NDArray
            One array per key. Only rank 0's values matter; other ranks' values are
            ignored.
        out : NDArray, list of NDArray, or list of lists of NDArray
            Where the result is written on every rank; several arrays per key are all
            filled (one per device). As in MXNet's kvstore, every value is read before
            any output is written (an output may be another key's value).
        priority : int
            Higher priorities are communicated first where the backend supports it.
        """
        if _join.current() is not None:
            _join.check_collective(self, key)
        self.broadcast_root(key, value, out, 0, priority)

    def broadcast_root(self, key, value, out, root_rank: int, priority: int = 0) -> None:
        """:meth:`broadcast` from ``root_rank`` instead of rank 0 (the same arguments)."""
        names, values, outs = self._normalise(key, value, out, "broadcast")
        targets = self._targets(values, outs)
        for vals, target in zip(values, targets):
            if target is not vals[0]:
                vals[0].copyto(target)
        if self.num_workers > 1:
            self._progress(names[0])
            self._one_at_a_time(names, targets)
            self._broadcast_(names, targets, root_rank, priority)
        self._write_outputs(targets, outs)

    def pushpull(self, key, value, out=None, priority: int = 0) -> None:
        """Sum ``value`` over all workers and write the result to ``out``.

        Parameters
        ----------
        key : int, str, or list of them
        value : NDArray, list of NDArray, or list of lists of NDArray
            Per key, one array or several copies (one per device) that are summed
            locally first.
        out : same structure as ``value``, optional
            Where to write the sum. Without it the sum is written back into ``value``.
            As in MXNet's kvstore, every key's sum is computed from the values as they
            were at the call before any output is written: an output may be another
            key's value, and an output given for several keys ends with the last one's.
        priority : int
            Higher priorities are communicated first where the backend supports it.
        """
        if _join.current() is not None:
            _join.check_collective(self, key)
        if self._codec is not None and self.num_workers > 1 and _integer_keys(key):
            self._compressed_pushpull(key, value, out, priority)
            return
        if out is None and type(value) is mx.nd.NDArray and isinstance(key, (int, str)):
            # DistributedTrainer's call, one key and one array summed in place, skips the
            # general normalisation (7 us of Python per call, 0.5 us this way)
            if self.num_workers > 1:
                names = [_key_name(key)]
                self._progress(names[0])
                self._one_at_a_time(names, [value])
                self._allreduce_(names, [value], priority)
            return
        names, targets, outs = self._local_sums(key, value, out)
        if self.num_workers > 1:
            self._progress(names[0])
            self._one_at_a_time(names, targets)
            self._allreduce_(names, targets, priority)
        self._write_outputs(targets, outs)

    def _local_sums(self, key, value, out):
        """pushpull's arguments checked, and each key's device copies summed into the
        array its collective runs on: (names, targets, outputs)."""
        names, values, outs = self._normalise(key, value, out, "pushpull")
        targets = self._targets(values, outs)
        for vals, target in zip(values, targets):
            if len(vals) == 1:
                if target is not vals[0]:
                    vals[0].copyto(target)
            else:
                mx.nd.add_n(*[v.as_in_context(target.context) for v in vals], out=target)
        return names, targets, outs

    @staticmethod
    def _targets(values: list[list], outs: list[list]) -> list[mx.nd.NDArray]:
        """Per key, the array its collective runs on: its first output, or a scratch
        array when an array is given for several keys (one output for several keys, an
        output that is another key's value). As in MXNet's kvstore, every key's result
        is computed from the values as they were at the call before any output is
        written, and an output given for several keys ends with the last key's."""
        shared = False
        if len(values) > 1:
            owner: dict[int, int] = {}
            for k, (vals, dsts) in enumerate(zip(values, outs)):
                for arr in vals + dsts:
                    if owner.setdefault(id(arr), k) != k:
                        shared = True
        if not shared:
            return [dsts[0] for dsts in outs]
        return [mx.nd.empty(dsts[0].shape, ctx=dsts[0].context, dtype=dsts[0].dtype)
                for dsts in outs]

    @staticmethod
    def _write_outputs(targets: list[mx.nd.NDArray], outs: list[list]) -> None:
        for target, dsts in zip(targets, outs):
            for dst in dsts:
                if dst is not target:
                    target.copyto(dst)

    def _one_at_a_time(self, names, arrays) -> None:
        """Let at most one array per key be in flight. MXNet's engine orders operations
        on the same array, but not two arrays sent under one key, and both ps-lite (the
        server merges them as one round) and Horovod (duplicate name) break on that."""
        for name, arr in zip(names, arrays):
            previous = self._in_flight.get(name)
            if previous is not None and previous is not arr:
                previous.wait_to_read()
            self._in_flight[name] = arr

    def _normalise(self, key, value, out, op: str):
        keys = _as_list(key)
        if isinstance(key, (list, tuple)):
            values = _as_list(value)
            outs = values if out is None else _as_list(out)
        else:
            values, outs = [value], [value if out is None else out]
        if len(values) != len(keys) or len(outs) != len(keys):
            raise ValueError(f"{op}: got {len(keys)} keys, {len(values)} values and "
                             f"{len(outs)} outputs; pass one value and one output per key")
        names = [_key_name(k) for k in keys]
        values = [_as_list(v) for v in values]
        outs = [_as_list(o) for o in outs]
        for name, vals, dsts in zip(names, values, outs):
            for arr in vals + dsts:
                if not isinstance(arr, mx.nd.NDArray):
                    raise TypeError(f"{op}: key {name!r} has a {type(arr).__name__}, "
                                    f"expected an mxnet NDArray")
                if arr.shape != vals[0].shape:
                    raise ValueError(f"{op}: key {name!r} mixes shapes {vals[0].shape} "
                                     f"and {arr.shape}")
        return names, values, outs

    # ------------------------------------------------------------ sharded collectives
    def reducescatter(self, key, value, priority: int = 0) -> list[mx.nd.NDArray]:
        """Sum arrays over the workers and return this rank's rows of each sum.

        Rank ``r`` gets the rows (first axis) ``shard_bounds(rows, num_workers, r)`` of
        each sum: the first ``rows % num_workers`` ranks one row more, as horovod
        splits; the parts of all ranks, in rank order, are the sum.

        Parameters
        ----------
        key : int, str, or list of them
        value : NDArray or list of NDArray
            One array per key, the same shape on every rank. It may be overwritten (a
            backend without a reduce-scatter of its own sums it in place).
        priority : int
            Higher priorities are communicated first where the backend supports it.

        Returns
        -------
        list of NDArray
            This rank's rows of each sum, in the order of ``key``.
        """
        names, values = self._sharded_arguments(key, value, "reducescatter")
        if self.num_workers == 1:
            return values
        self._progress(names[0])
        return self._reducescatter_(names, values, priority)

    def allgather(self, key, value, counts, out=None, priority: int = 0) -> list[mx.nd.NDArray]:
        """Concatenate every rank's rows of each array along the first axis, in rank
        order, on every rank.

        Parameters
        ----------
        key : int, str, or list of them
        value : NDArray or list of NDArray
            This rank's rows of each array (possibly none: a first axis of 0); the
            other axes are the same on every rank.
        counts : list of int, or list of such lists
            For each key, the number of rows of every rank, in rank order (the same
            on every rank; a backend without an allgather of its own places the rows
            by them).
        out : NDArray or list of NDArray, optional
            Where to write each whole array (of the whole shape, overwritten entirely).
            Then the backend may return before the rows arrive, as ``pushpull`` does:
            MXNet's engine makes later operations on ``out`` wait for them. A backend
            without an allgather of its own sums ``out`` in place under ``key``.
        priority : int
            Higher priorities are communicated first where the backend supports it.

        Returns
        -------
        list of NDArray
            Each whole array, the same on every rank (``out`` if given).
        """
        names, values = self._sharded_arguments(key, value, "allgather")
        counts = [list(c) for c in (counts if isinstance(key, (list, tuple)) else [counts])]
        if len(counts) != len(values):
            raise ValueError(f"allgather: got {len(values)} values and {len(counts)} "
                             "row counts")
        for name, arr, rows in zip(names, values, counts):
            if len(rows) != self.num_workers or _rows(arr) != rows[self.rank]:
                raise ValueError(f"allgather: key {name!r}: rank {self.rank} holds "
                                 f"{_rows(arr)} rows, and the counts of the "
                                 f"{self.num_workers} ranks are {rows}")
        outs = None if out is None else _as_list(out)
        if outs is not None:
            for name, arr, rows, whole in zip(names, values, counts, outs):
                if tuple(whole.shape) != (sum(rows),) + tuple(arr.shape[1:]) \
                        or whole.dtype != arr.dtype:
                    raise ValueError(f"allgather: key {name!r}: out is {whole.shape} "
                                     f"{np.dtype(whole.dtype).name}, the whole array "
                                     f"{(sum(rows),) + tuple(arr.shape[1:])} "
                                     f"{np.dtype(arr.dtype).name}")
        if self.num_workers == 1:
            if outs is None:
                return values
            for arr, whole in zip(values, outs):
                arr.copyto(whole)
            return outs
        self._progress(names[0])
        return self._allgather_(names, values, counts, outs, priority)

    def _sharded_arguments(self, key, value, op: str):
        names = [_key_name(k) for k in _as_list(key)]
        values = _as_list(value)
        if len(names) != len(values):
            raise ValueError(f"{op}: got {len(names)} keys and {len(values)} values")
        for name, arr in zip(names, values):
            if not isinstance(arr, mx.nd.NDArray) or arr.stype != "default":
                raise TypeError(f"{op}: key {name!r} needs a dense NDArray, got "
                                f"{getattr(arr, 'stype', type(arr).__name__)}")
        return names, values

    def _reducescatter_(self, names, arrays, priority) -> list[mx.nd.NDArray]:
        """A backend without a reduce-scatter of its own sums the whole arrays (the
        bytes of an allreduce instead of half of them) and keeps its rows."""
        self._one_at_a_time(names, arrays)
        self._allreduce_(names, arrays, priority)
        parts = []
        for arr in arrays:
            start, stop = shard_bounds(arr.shape[0], self.num_workers, self.rank)
            parts.append(arr[start:stop].copy() if stop > start else
                         _no_rows(arr.shape, arr.context, arr.dtype))
        return parts

    def _allgather_(self, names, arrays, counts, outs, priority) -> list[mx.nd.NDArray]:
        """A backend without an allgather of its own sums arrays that are zeros but
        for this rank's rows (``outs``, or new ones): exact, since adding zeros rounds
        nothing."""
        wholes = []
        for k, (arr, rows) in enumerate(zip(arrays, counts)):
            start = sum(rows[:self.rank])
            if outs is None:
                whole = mx.nd.zeros((sum(rows),) + tuple(arr.shape[1:]), ctx=arr.context,
                                    dtype=arr.dtype)
            else:
                whole = outs[k]
                whole[:] = 0
            if rows[self.rank]:
                whole[start:start + rows[self.rank]] = arr
            wholes.append(whole)
        self._one_at_a_time(names, wholes)
        self._allreduce_(names, wholes, priority)
        return wholes

    def _allreduce_(self, names: list[str], arrays: list[mx.nd.NDArray], priority: int):
        raise NotImplementedError

    def _broadcast_(self, names: list[str], arrays: list[mx.nd.NDArray], root_rank: int,
                    priority: int):
        raise NotImplementedError

    # ------------------------------------------------------------ synchronisation
    def barrier(self) -> None:
        """Block until every worker has reached this call."""
        if _join.current() is not None:
            _join.check_collective(self, "barrier")
        if self.num_workers > 1:
            self._progress("barrier")
            self._barrier()

    def _barrier(self) -> None:
        token = mx.nd.zeros((1,))
        self._allreduce_(["__dg_barrier"], [token], 0)
        token.wait_to_read()

    # ------------------------------------------------------------ object collectives
    def broadcast_object(self, obj: Any, root_rank: int = 0) -> Any:
        """Return ``root_rank``'s ``obj`` on every rank (pickled in transit).

        Every rank must call it; only the root's ``obj`` is used.
        """
        self.check_rank(root_rank, "root_rank")
        if self.num_workers == 1:
            return obj
        payload = pickle.dumps(obj) if self.rank == root_rank else b""
        size = mx.nd.array([len(payload)], dtype="float64")
        self._progress("broadcast_object")
        self._broadcast_(["__dg_object_size"], [size], root_rank, 0)
        length = int(size.asscalar())
        buf = self._object_buffer(1, length)
        if self.rank == root_rank:
            buf[0, :length] = np.frombuffer(payload, dtype=np.uint8)
        arr = mx.nd.array(buf, dtype=self._byte_dtype)
        self._broadcast_([f"__dg_object_{buf.shape[1]}"], [arr], root_rank, 0)
        return pickle.loads(arr.asnumpy()[0, :length].astype(np.uint8).tobytes())

    def allgather_object(self, obj: Any) -> list:
        """Return the list of every rank's ``obj``, indexed by rank."""
        if self.num_workers == 1:
            return [obj]
        self._progress("allgather_object")
        return self._allgather_object(obj)

    def _allgather_object(self, obj: Any) -> list:
        """allgather_object without a progress report, for a collective that is part of
        another one (joining the job)."""
        payload = pickle.dumps(obj)
        sizes = np.zeros((self.num_workers,), dtype="float64")
        sizes[self.rank] = len(payload)
        sizes_nd = mx.nd.array(sizes, dtype="float64")
        self._allreduce_([f"__dg_gather_sizes_{self.num_workers}"], [sizes_nd], 0)
        lengths = [int(n) for n in sizes_nd.asnumpy()]
        buf = self._object_buffer(self.num_workers, max(lengths))
        buf[self.rank, :len(payload)] = np.frombuffer(payload, dtype=np.uint8)
        arr = mx.nd.array(buf, dtype=self._byte_dtype)
        self._allreduce_([f"__dg_gather_{self.num_workers}_{buf.shape[1]}"], [arr], 0)
        rows = arr.asnumpy().astype(np.uint8)
        return [pickle.loads(rows[r, :n].tobytes()) for r, n in enumerate(lengths)]

    @staticmethod
    def _object_buffer(rows: int, length: int) -> np.ndarray:
        width = _MIN_OBJECT_BUFFER
        while width < length:
            width *= 2
        return np.zeros((rows, width), dtype=np.uint8)

    def check_rank(self, rank: int, what: str) -> None:
        """ValueError naming ``what`` unless ``rank`` is a rank of this job."""
        if not 0 <= rank < self.num_workers:
            raise ValueError(f"{what} must be in [0, {self.num_workers}), got {rank}")

    # ------------------------------------------------------------ KVStoreBase extras
    def is_capable(self, capability: str) -> bool:
        """Updates always run on the workers: no backend runs an optimizer itself."""
        if capability == KVStoreBase.OPTIMIZER:
            return False
        raise ValueError(f"Unknown capability: {capability}")

    def set_gradient_compression(self, compression_params: dict) -> None:
        """Compress what ``pushpull`` sums under integer keys, the keys of a plain
        ``gluon.Trainer(..., kvstore=backend, update_on_kvstore=False)`` (which calls this
        for its ``compression_params``), with MXNet's argument format:
        ``{'type': '2bit', 'threshold': 0.5}``; also 'fp16' and 'powersgd' (see
        :mod:`dist_gluon.compression`). dist_gluon's own collectives use string keys and
        are never compressed: DistributedTrainer and DistributedOptimizer take
        ``compression=`` instead.
        """
        from .. import compression

        spec = compression.parse(compression_params)
        self._codec = None if spec is None else compression.create(spec)

    def _compressed_pushpull(self, key, value, out, priority) -> None:
        names, targets, outs = self._local_sums(key, value, out)
        for name, target in zip(names, targets):
            if np.dtype(target.dtype).kind != "f" or target.stype != "default":
                raise TypeError(f"gradient compression works on dense float arrays; key "
                                f"{name!r} has a {target.stype} {np.dtype(target.dtype).name}"
                                " array")
        # the codec's own sums use string keys, so they are not compressed again
        self._codec.reduce(self, [int(n) for n in names], [f"__dg_kv.{n}" for n in names],
                           targets, priority)
        self._write_outputs(targets, outs)

    def set_optimizer(self, optimizer) -> None:
        raise NotImplementedError(
            f"the {self.type} backend does not run optimizers; use "
            "dist_gluon.DistributedTrainer, or gluon.Trainer(..., update_on_kvstore=False)")

    def save_optimizer_states(self, fname: str, dump_optimizer: bool = False) -> None:
        raise NotImplementedError(
            f"the {self.type} backend holds no optimizer state; use trainer.save_states")

    def load_optimizer_states(self, fname: str) -> None:
        raise NotImplementedError(
            f"the {self.type} backend holds no optimizer state; use trainer.load_states")

    def step_ended(self, owner: object = None) -> None:
        """The trainer ``owner`` ended a step (every rank, in step). horovod tunes its
        cycle time on the first ones (horovod_tuning.py); the other backends ignore it."""

    def _chained(self, why: str) -> None:
        """Collectives that each wait for the one before run in every step from this one
        on (SyncBatchNorm's, ``why`` names them): horovod keeps its default cycle
        (horovod_tuning.py); the other backends ignore it."""

    # ------------------------------------------------------------ re-formation
    def _can_reform(self) -> bool:
        """Whether this process can join the job's next round in place (_reform)."""
        return False

    def _reform_problem(self) -> str | None:
        """Why this process, though it can re-form in place, would fail to (said when a
        script enters dist_gluon.elastic.run, before any step), or None."""
        return None

    def _abort(self) -> None:
        """Break the collectives pending in this process (the launcher ended the round);
        see dist_gluon.elastic. Only a backend that can re-form in place does anything."""

    def _leave(self) -> None:
        """Leave the round cleanly, every rank at the same point (a planned
        re-formation); see dist_gluon.elastic."""

    def _reform(self, environ: dict[str, str]) -> None:
        """Join the next round of the job in this process, placed by ``environ``."""
        raise NotImplementedError(
            f"the {self.type} backend cannot join another round in the same process")

    # ------------------------------------------------------------ shutdown
    def _atexit(self) -> None:
        """Finish communication still in flight before the interpreter tears down
        MXNet, so a rank that reaches the end first does not break a slower rank's last
        collective. A script that died of an uncaught exception exits at once instead.

        Under the launcher, the collective shutdown waits for its verdict: it runs once
        every rank has finished its script, and is skipped when the job has failed
        (e.g. this rank left early and a peer waits in a collective it will never
        join), so that this process ends with its own exit status instead of blocking
        in a shutdown its peers never reach."""
        if self._closed:
            return
        self._closed = True
        if self.num_workers > 1 and hasattr(sys, "last_value"):
            _exit_now(1)
        if self.num_workers > 1 and self._reporter is not None:
            if self._reporter.wait_for_verdict() == jobcontrol.ABANDON:
                self._abandon()
                return
        try:
            mx.nd.waitall()
        finally:
            for hook in self._shutdown_hooks:
                hook()
            self._shutdown()

    def _abandon(self) -> None:
        """The job failed: leave without the collective shutdown, and without the
        native libraries' teardown at exit (their static destructors join threads that
        still wait for peers, and abort). glibc's on_exit hands the exit status to the
        function it registers: registered now, after every library object exists, it
        runs first and makes the process end right there with the script's own status,
        which the launcher reports."""
        try:
            libc = ctypes.CDLL(None)
            libc.on_exit(ctypes.cast(libc._exit, ctypes.c_void_p), None)
        except (OSError, AttributeError):
            pass

    def _shutdown(self) -> None:
        pass
