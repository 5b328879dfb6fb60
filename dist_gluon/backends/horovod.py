"""Horovod backend: horovod.mxnet collectives over Gloo or MPI.

Which one is horovod's choice at ``hvd.init()``: Gloo when the launcher gave the worker
a Gloo rendezvous (``--transport gloo``), MPI when mpirun started it (``dist_gluon.launch
--transport mpi``, or a plain ``mpirun -np N python train.py``, or ``srun --mpi=pmix``);
rank, size and local rank then come from MPI. The launcher's side of a Gloo job
(rendezvous, worker environment) is in dist_gluon/launch/rendezvous.py and
dist_gluon/launch/jobenv.py, of an MPI job in dist_gluon/launch/mpi.py; none imports
mxnet or horovod.
"""
from __future__ import annotations

import ctypes
import os

import mxnet as mx
import numpy as np

from .. import _kernels
from .._requirements import import_horovod as _import_horovod
from .base import Backend, report_connect

# horovodrun's Gloo mode, OpenMPI's mpirun, srun --mpi=pmix (and MPICH's PMI)
_HOROVODRUN_VARIABLES = ("HOROVOD_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK")


# OpenMPI 4.1's fixed choice for a large allreduce between two ranks is reduce-scatter +
# allgather, which mallocs a temporary buffer as large as the message on every call;
# glibc serves it with a fresh mmap and unmaps it on free, so each call page-faults it in
# again (14,500 faults and ~40% of the time of a 100 MiB sum here). The segmented ring
# works in segment-sized buffers that malloc reuses: 100 MiB in 30 ms instead of 48.
_OPENMPI_ALLREDUCE = {
    "OMPI_MCA_coll_tuned_use_dynamic_rules": "1",
    "OMPI_MCA_coll_tuned_allreduce_algorithm": "5",                 # segmented ring
    "OMPI_MCA_coll_tuned_allreduce_algorithm_segmentsize": str(1 << 20),
}
# A rank waiting in MPI polls at full speed, and horovod's background thread waits in MPI
# every cycle (1 ms) to agree on what is ready; that steals the CPU from the rank's own
# MXNet compute threads and from other ranks on the same cores (a ResNet-18 step without
# any collective took 3-4x as long as under Gloo here). Yielding gives it back.
_OPENMPI_YIELD = {"OMPI_MCA_mpi_yield_when_idle": "1"}


# Gloo sums float16 element by element in software (gloo::sum<float16>): 25.6M elements
# took 2.8x float32's time on 2 ranks, at half the bytes (benchmarks/FINDINGS.md 9f). A
# float16 array at least this large is summed in parts instead (_HalfSum).
_HALF_PARTS_MIN = 1 << 18


class _HalfSum:
    """A float16 sum over Gloo in horovod collectives that only move data: an alltoall
    hands each rank the workers' copies of its part of the array (1/N of it), the F16C
    kernel ``dg_fp16_sum`` adds them in float32 and rounds once, and an allgather puts
    the summed parts back together in place. The same bytes travel as in Gloo's ring
    allreduce; with two workers the result is Gloo's sum bit for bit, with more it is
    rounded once instead of at every step of the ring (and is the same on every rank).

    horovod.mxnet's Python alltoall and allgather wait for their results (horovod sizes
    their outputs when they run); their C entry points are called here with outputs of
    the final size, so nothing waits and the engine orders the steps. Horovod keeps a
    bare pointer to each output array until its collective has run, so the outputs are
    this object's own, alive as long as it is; the allgather's is copied into place."""

    def __init__(self, size: int, workers: int, rank: int, ctx):
        self.size, self.context = size, ctx
        self._workers = workers
        parts = [size // workers + (i < size % workers) for i in range(workers)]
        self._splits = mx.nd.array(parts, ctx=mx.cpu(), dtype="int32")
        self._received_splits = mx.nd.zeros((workers,), ctx=mx.cpu(), dtype="int32")
        self._received = mx.nd.empty((workers * parts[rank],), ctx=ctx, dtype="float16")
        self._mine = mx.nd.empty((parts[rank],), ctx=ctx, dtype="float16")
        self._total = mx.nd.empty((size,), ctx=ctx, dtype="float16")
        from horovod.mxnet import mpi_ops
        self._lib = mpi_ops.MPI_MXNET_LIB_CTYPES

    def push(self, name: str, array: mx.nd.NDArray, priority: int) -> None:
        flat = array.reshape((-1,))
        mx.base.check_call(self._lib.horovod_mxnet_alltoall_async(
            flat.handle, self._received.handle, mx.base.c_str(f"dg.a2a.{name}"),
            self._splits.handle, self._received_splits.handle, ctypes.c_int(priority),
            ctypes.c_int(0)))
        _kernels.push("dg_fp16_sum", [self._received], [self._mine], priority,
                      parts=self._workers)
        mine, total = self._mine.handle, self._total.handle
        mx.base.check_call(self._lib.horovod_mxnet_allgather_async(
            ctypes.byref(mine), ctypes.byref(total), mx.base.c_str(f"dg.ag.{name}"),
            ctypes.c_int(priority), ctypes.c_int(0), ctypes.c_int(1)))
        self._total.copyto(flat)


def _tune_openmpi(environ=os.environ) -> None:
    """Set OpenMPI's allreduce algorithm and idle policy before ``hvd.init()`` starts
    MPI (measured in benchmarks/FINDINGS.md). A job's own settings win (``mpirun --mca
    NAME VALUE`` reaches the ranks as OMPI_MCA_NAME); nothing changes over Gloo."""
    if environ.get("HOROVOD_CONTROLLER") == "gloo" or "HOROVOD_GLOO_RENDEZVOUS_ADDR" in environ:
        return
    if not any(name.startswith("OMPI_MCA_coll_tuned_") for name in environ):
        environ.update(_OPENMPI_ALLREDUCE)
    for name, value in _OPENMPI_YIELD.items():
        environ.setdefault(name, value)


def started_by_horovod(environ=os.environ) -> bool:
    """True when this process was started for horovod: by horovodrun, mpirun or
    ``srun --mpi=pmix``, or by ``dist_gluon.launch --backend horovod``.

    A worker of dist_gluon's launcher with another ``--backend`` (DG_BACKEND) is not: a
    launcher that itself runs under srun or mpirun passes their variables on to its
    dist_sync or p3 workers."""
    if environ.get("DG_BACKEND", "horovod") != "horovod":
        return False
    return any(name in environ for name in _HOROVODRUN_VARIABLES)


class Horovod(Backend):
    """Collectives of ``horovod.mxnet``; ``hvd.init()`` is called once per process.

    Once ``dist_gluon`` is imported, ``mx.kv.create('horovod')`` returns the process's
    one instance (``dist_gluon.create('horovod')``), so a plain ``gluon.Trainer(...,
    kvstore=mx.kv.create('horovod'), update_on_kvstore=False)`` works (MXNet RFC #16795).
    """

    _type = "horovod"
    # packed integer sums (2-bit compression): int32 words, 31 bits exact
    _exact_integers = ("int32", 31)

    def __init__(self):
        self._hvd = _import_horovod()
        if not self._hvd.is_initialized():
            report_connect(self._type)
            _tune_openmpi()
            self._hvd.init()
        super().__init__()
        self._halves: dict = {}     # name -> _HalfSum (Gloo only)
        self._gloo = self._hvd.gloo_enabled()

    @property
    def rank(self) -> int:
        return self._hvd.rank()

    @property
    def num_workers(self) -> int:
        return self._hvd.size()

    @property
    def local_rank(self) -> int:
        return self._hvd.local_rank()

    def _allreduce_(self, names, arrays, priority):
        with self._submit_lock:
            for name, arr in zip(names, arrays):
                half = self._half_sum(name, arr)
                if half is not None:
                    half.push(name, arr, priority)
                else:
                    self._hvd.allreduce_(arr, name=f"dg.ar.{name}", priority=priority,
                                         op=self._hvd.Sum)

    def _half_sum(self, name, arr) -> _HalfSum | None:
        """The parts-wise sum of a large float16 array on the CPU over Gloo, or None
        for horovod's allreduce."""
        if not (self._gloo and arr.dtype == np.float16 and arr.size >= _HALF_PARTS_MIN
                and self.num_workers > 1 and arr.context.device_type == "cpu"
                and _kernels.available()):
            return None
        half = self._halves.get(name)
        if half is None or half.size != arr.size or half.context != arr.context:
            half = self._halves[name] = _HalfSum(arr.size, self.num_workers, self.rank,
                                                 arr.context)
        return half

    def _broadcast_(self, names, arrays, root_rank, priority):
        # Weights used by a hybridized forward (static_alloc) may hold MKLDNN-layout
        # data, which horovod cannot read in place; broadcasts are rare, so always go
        # through a plain-layout copy.
        for name, arr in zip(names, arrays):
            plain = mx.nd.empty(arr.shape, ctx=arr.context, dtype=arr.dtype)
            arr.copyto(plain)
            with self._submit_lock:
                self._hvd.broadcast_(plain, root_rank=root_rank, name=f"dg.bc.{name}",
                                     priority=priority)
            plain.copyto(arr)

    def _barrier(self) -> None:
        token = mx.nd.zeros((1,))
        with self._submit_lock:
            self._hvd.allreduce_(token, name="dg.__barrier", op=self._hvd.Sum)
        token.wait_to_read()
