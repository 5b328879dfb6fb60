"""``horovod.mxnet``'s API on every dist_gluon backend.

A script written for Horovod runs on one process, horovod, dist_sync or p3 with its
import line changed::

    import dist_gluon.compat.horovod as hvd      # was: import horovod.mxnet as hvd

    hvd.init()
    trainer = hvd.DistributedTrainer(net.collect_params(), opt)
    hvd.broadcast_parameters(net.collect_params(), root_rank=0)

The semantics are Horovod's (0.28): ``DistributedTrainer`` sums the gradients and
divides them by ``size()`` through ``rescale_grad`` (so ``step(batch_size)`` applies
``sum / (size * batch_size)``, with this rank's own batch size), and does not broadcast
the parameters itself; ``allreduce`` averages unless given ``op=Sum`` (or
``average=False``); ``allgather`` concatenates tensors whose first dimensions may
differ; ``broadcast_parameters`` of a dict matches values by key. Operations are keyed
by name (and shape), and every rank must call them in the same order, as with Horovod.
On one process every collective is the identity.

Not available, with an error saying what to use instead: process sets other than the
global one, ``op=Adasum``, ``init(comm=...)``, and the timeline off the horovod backend.
"""
from __future__ import annotations

import warnings

import mxnet as mx

from . import _collectives as _c
from ._training import (
    Compression,
    PeerOptimizer,
    PeerTrainer,
    broadcast_dict,
    broadcast_model,
    codec_of,
)

Average, Sum, Adasum, Min, Max, Product = (_c.AVERAGE, _c.SUM, _c.ADASUM, _c.MIN, _c.MAX,
                                           _c.PRODUCT)

_session = _c.Session("Horovod", "hvd")


# ------------------------------------------------------------------ process sets
_PROCESS_SETS = ("process sets other than the global one are not available on dist_gluon's "
                 "backends; every collective runs over all workers (global_process_set). "
                 "Start a job of just the ranks you need, or use horovod.mxnet itself with "
                 "--backend horovod")


class ProcessSet:
    """Horovod's process set. Only the global one (all workers) can be used here."""

    def __init__(self, ranks_or_comm=None):
        self.ranks = None if ranks_or_comm is None else list(ranks_or_comm)
        self.process_set_id = 0 if ranks_or_comm is None else None

    def size(self) -> int:
        return size()

    def rank(self) -> int:
        return rank()

    def included(self) -> bool:
        return True

    def __repr__(self) -> str:
        return "ProcessSet(process_set_id=0, ranks=all)" if self.ranks is None \
            else f"ProcessSet(ranks={self.ranks})"


global_process_set = ProcessSet()


def _check_process_set(process_set) -> None:
    if process_set is global_process_set:
        return
    if isinstance(process_set, ProcessSet) and process_set.ranks == list(range(size())):
        return                                  # all workers: the global set by another name
    raise NotImplementedError(f"process_set={process_set!r}: {_PROCESS_SETS}")


def add_process_set(process_set):
    raise NotImplementedError(f"add_process_set: {_PROCESS_SETS}")


def remove_process_set(process_set):
    raise NotImplementedError(f"remove_process_set: {_PROCESS_SETS}")


# ------------------------------------------------------------------ start and identity
def init(comm=None, process_sets=None) -> None:
    """Join the job the launcher started (``dist_gluon.create()``): one process, horovod,
    dist_sync or p3, whatever ``--backend`` was."""
    if comm is not None:
        raise NotImplementedError("init(comm=...): MPI communicators are not available on "
                                  "dist_gluon's backends; call init() to use all workers")
    if process_sets:
        raise NotImplementedError(f"init(process_sets=...): {_PROCESS_SETS}")
    _session.init()


def shutdown() -> None:
    """Finish the collectives in flight; ``is_initialized()`` is False afterwards. The
    backend closes at exit, with every other rank."""
    _session.shutdown()


def is_initialized() -> bool:
    return _session.initialized


size, rank = _session.size, _session.rank
local_rank, local_size = _session.local_rank, _session.local_size


def cross_rank() -> int:
    return _c.topology(_session.kv)[1]


def cross_size() -> int:
    return _c.topology(_session.kv)[2]


def is_homogeneous() -> bool:
    return True


def _horovod():
    """Horovod itself when this job runs on the horovod backend, else None."""
    return getattr(_session.kv, "_hvd", None)


def mpi_enabled() -> bool:
    hvd = _horovod()
    return bool(hvd is not None and hvd.mpi_enabled())


def gloo_enabled() -> bool:
    hvd = _horovod()
    return bool(hvd is not None and hvd.gloo_enabled())


def mpi_threads_supported() -> bool:
    """As in Horovod: whether MPI supports threads, a ValueError when the job does not
    run over MPI (only ``--backend horovod --transport mpi`` does)."""
    hvd = _horovod()
    if hvd is None or not hvd.mpi_enabled():
        raise ValueError(f"MPI is not enabled: this job runs on the {_session.kv.type!r} "
                         "backend without MPI (start it with --backend horovod --transport "
                         "mpi for MPI); check mpi_enabled() first")
    return bool(hvd.mpi_threads_supported())


def _built(flag: str, kind=bool):
    """Horovod's ``flag()`` (mpi_built, ...) where Horovod is installed, else False (0)."""
    def built():
        try:
            import horovod.mxnet as hvd
        except (ImportError, OSError):
            return kind(0)
        return kind(getattr(hvd, flag)())
    built.__name__ = built.__qualname__ = flag
    return built


mpi_built, gloo_built, ddl_built, ccl_built, cuda_built, rocm_built = (
    _built(flag) for flag in ("mpi_built", "gloo_built", "ddl_built", "ccl_built",
                              "cuda_built", "rocm_built"))


def nccl_built() -> int:
    """0: dist_gluon's DistributedTrainer averages as horovod.mxnet does without NCCL
    2.10 (``nccl_built() < 21000``): ``allreduce_grads()`` leaves the sum in the
    gradients and ``rescale_grad`` holds the ``1 / size()``. Scripts that read
    ``nccl_built()`` to know where the average happens get the answer that matches,
    whatever the installed horovod was built with."""
    return 0


def start_timeline(file_path, mark_cycles=False) -> None:
    hvd = _horovod()
    if hvd is None:
        raise NotImplementedError(
            f"start_timeline: Horovod's timeline exists on the horovod backend only, and "
            f"this job runs on {_session.kv.type!r}; use MXNet's profiler (mx.profiler) or "
            "--backend horovod")
    hvd.start_timeline(file_path, mark_cycles)


def stop_timeline() -> None:
    hvd = _horovod()
    if hvd is None:
        raise NotImplementedError(
            f"stop_timeline: Horovod's timeline exists on the horovod backend only, and this "
            f"job runs on {_session.kv.type!r}")
    hvd.stop_timeline()


# ------------------------------------------------------------------ tensor collectives
def _op(op, average, function: str) -> int:
    """Horovod's rule: ``op`` supersedes the deprecated ``average``; Average by default."""
    if op is not None:
        if average is not None:
            raise ValueError(f"{function}: the op parameter supersedes average; please "
                             "provide only one of them")
        return op
    if average is not None:
        warnings.warn("Parameter `average` has been replaced with `op` and will be removed "
                      "in v1.0", DeprecationWarning, stacklevel=3)
        return Average if average else Sum
    return Average


def allreduce_(tensor, average=None, name=None, priority=0, prescale_factor=1.0,
               postscale_factor=1.0, process_set=global_process_set, op=None):
    """Reduce ``tensor`` over all workers in place (Average unless ``op`` says otherwise)
    and return it."""
    _c.check_tensor(tensor, "allreduce_")
    _check_process_set(process_set)
    op = _op(op, average, "allreduce_")
    kv = _session.kv
    return _c.allreduce_(kv, _c.key("hvd", "ar", name, tensor), tensor, op, priority,
                         prescale_factor, postscale_factor)


def allreduce(tensor, average=None, name=None, priority=0, prescale_factor=1.0,
              postscale_factor=1.0, process_set=global_process_set, op=None):
    """A new tensor: ``tensor`` reduced over all workers; ``tensor`` is not modified."""
    _c.check_tensor(tensor, "allreduce")
    op = _op(op, average, "allreduce")
    return allreduce_(tensor.copy(), None, name, priority, prescale_factor, postscale_factor,
                      process_set, op)


def grouped_allreduce_(tensors, average=None, name=None, priority=0, prescale_factor=1.0,
                       postscale_factor=1.0, process_set=global_process_set, op=None):
    op = _op(op, average, "grouped_allreduce_")
    base = "grouped" if name is None else name
    return [allreduce_(t, None, f"{base}.{i}", priority, prescale_factor, postscale_factor,
                       process_set, op) for i, t in enumerate(tensors)]


def grouped_allreduce(tensors, average=None, name=None, priority=0, prescale_factor=1.0,
                      postscale_factor=1.0, process_set=global_process_set, op=None):
    op = _op(op, average, "grouped_allreduce")
    return grouped_allreduce_([t.copy() for t in tensors], None, name, priority,
                              prescale_factor, postscale_factor, process_set, op)


def broadcast_(tensor, root_rank, name=None, priority=0, process_set=global_process_set):
    """Overwrite ``tensor`` with ``root_rank``'s, in place, and return it."""
    _c.check_tensor(tensor, "broadcast_")
    _check_process_set(process_set)
    kv = _session.kv
    return _c.broadcast_(kv, _c.key("hvd", "bc", name, tensor), tensor, root_rank, priority)


def broadcast(tensor, root_rank, name=None, priority=0, process_set=global_process_set):
    """A new tensor holding ``root_rank``'s ``tensor``; ``tensor`` is not modified."""
    _c.check_tensor(tensor, "broadcast")
    return broadcast_(tensor.copy(), root_rank, name, priority, process_set)


def allgather(tensor, name=None, priority=0, process_set=global_process_set):
    """Every rank's ``tensor`` concatenated along the first dimension (which may differ
    between ranks), in rank order."""
    _c.check_tensor(tensor, "allgather")
    _check_process_set(process_set)
    return _c.allgather(_session.kv, tensor)


def grouped_allgather(tensors, name=None, priority=0, process_set=global_process_set):
    return [allgather(t, name, priority, process_set) for t in tensors]


def alltoall(tensor, splits=None, name=None, priority=0, process_set=global_process_set):
    """Send ``splits[j]`` consecutive rows of ``tensor`` to rank j (equal parts without
    ``splits``) and return the rows every rank sent here, in rank order; with
    ``splits``, also the int32 counts received from each rank."""
    _c.check_tensor(tensor, "alltoall")
    _check_process_set(process_set)
    received, counts = _c.alltoall(_session.kv, tensor, splits)
    if splits is None:
        return received
    return received, mx.nd.array(counts, ctx=mx.cpu(), dtype="int32")


def reducescatter(tensor, op=Average, name=None, priority=0, process_set=global_process_set,
                  prescale_factor=1.0, postscale_factor=1.0):
    """``tensor`` reduced over all workers (Average or Sum), of which this rank keeps its
    rows: the first dimension is split as evenly as possible, the first ranks getting one
    row more."""
    _c.check_tensor(tensor, "reducescatter")
    if op not in (Average, Sum):
        raise ValueError("reducescatter: op must be Average or Sum")
    if not tensor.shape:
        raise ValueError("reducescatter does not support scalar inputs")
    total = allreduce(tensor, name=name, priority=priority, prescale_factor=prescale_factor,
                      postscale_factor=postscale_factor, process_set=process_set, op=op)
    start, stop = _c.scatter_rows(tensor.shape[0], size(), rank())
    return total[start:stop].copy()


def grouped_reducescatter(tensors, op=Average, name=None, priority=0,
                          process_set=global_process_set, prescale_factor=1.0,
                          postscale_factor=1.0):
    base = "grouped" if name is None else name
    return [reducescatter(t, op, f"{base}.{i}", priority, process_set, prescale_factor,
                          postscale_factor) for i, t in enumerate(tensors)]


def broadcast_object(obj, root_rank=0, name=None, process_set=global_process_set):
    """``root_rank``'s ``obj`` on every rank (cloudpickled, as in Horovod)."""
    _check_process_set(process_set)
    return _c.broadcast_object(_session.kv, obj, root_rank)


def allgather_object(obj, name=None, process_set=global_process_set) -> list:
    """The list of every rank's ``obj``, in rank order."""
    _check_process_set(process_set)
    return _c.allgather_object(_session.kv, obj)


# ------------------------------------------------------------------ training
def broadcast_parameters(params, root_rank=0, prefix=None):
    """Overwrite every rank's parameters with ``root_rank``'s.

    ``params`` is a ``ParameterDict`` (``net.collect_params()``; in the model's order,
    deferred-initialised parameters are broadcast when they get their shapes) or a dict
    of Parameters or NDArrays (``Module.get_params()``; values matched by key, as in
    Horovod). ``prefix`` is accepted for Horovod's sake: keys never collide here.
    """
    kv = _session.kv
    if kv.num_workers == 1:
        return
    if isinstance(params, dict):
        broadcast_dict(params, root_rank, kv)
    elif isinstance(params, mx.gluon.ParameterDict):
        broadcast_model(params, root_rank, kv)
    else:
        raise ValueError(f"invalid params of type: {type(params)}")


def join(device=-1) -> int:
    """Called by a rank that has run out of data: take part in the other ranks' steps
    until every rank has called it (or left its ``dg.Join`` block); returns the last
    rank to join, the same on every rank.

    As ``hvd.join()`` of Horovod's TensorFlow and PyTorch APIs (horovod.mxnet 0.28 has
    none). The steps to take part in are those of the trainers of the ``dg.Join`` block
    the loop runs in, which announce themselves there::

        with dg.Join(trainer):
            for data, label in loader:      # another number of batches on each rank
                ...
                trainer.step(data.shape[0])
            last = hvd.join()

    Meanwhile this rank adds zero gradients to each of their steps and applies the same
    update, with their mean batch size (Horovod's trainer rescales by a rank's own), so
    the weights stay equal on every rank; broadcasting them from the returned rank, as
    one does after Horovod's join, changes nothing. Outside a block every rank must call
    it at the same point (it is a barrier there, and returns the highest rank).

    Parameters
    ----------
    device : int
        Accepted for Horovod's signature; unused.

    Returns
    -------
    int
        The rank that called ``join`` last (of several at the same step, the highest).
    """
    from .. import join as _join
    kv = _session.kv
    block = _join.current()
    if block is not None and block._kv is kv:
        return block.finish()
    # outside a block no step announces itself: every rank calls it at the same point,
    # none of them later than another
    kv.barrier()
    return kv.num_workers - 1


def _check_num_groups(num_groups) -> None:
    if isinstance(num_groups, bool) or not isinstance(num_groups, int) or num_groups < 0:
        raise ValueError(f"num_groups must be an integer >= 0, got {num_groups!r}")


class DistributedTrainer(PeerTrainer):
    """Horovod's DistributedTrainer: a ``gluon.Trainer`` whose gradients are summed over
    all workers and divided by ``size()``.

    As in Horovod 0.28 (without NCCL's averaging), the division is in ``rescale_grad``:
    ``step(batch_size)`` applies ``sum of the gradients / (size() * batch_size)`` with
    this rank's ``batch_size``, and after ``allreduce_grads()`` the gradients hold the sum
    divided by ``gradient_predivide_factor``. The parameters are not broadcast: call
    :func:`broadcast_parameters`.

    Parameters
    ----------
    params : ParameterDict, dict or list of Parameter
    optimizer : str or mx.optimizer.Optimizer
    optimizer_params : dict, optional
    compression : Compression.none or Compression.fp16
        fp16: gradients travel as float16.
    gradient_predivide_factor : float
        Gradients are divided by it before the sum, and ``rescale_grad`` is multiplied by
        it (``factor / size``).
    prefix : str, optional
        Keeps the keys of several trainers apart (they are numbered without one).
    num_groups : int
        Accepted: the sums already go tensor by tensor, in priority order, on every
        backend; grouping changes no result.
    process_set : global_process_set
    """

    _kind = "hvdt"

    def __init__(self, params, optimizer, optimizer_params=None,
                 compression=Compression.none, gradient_predivide_factor=1.0, prefix=None,
                 num_groups=0, process_set=global_process_set):
        _check_process_set(process_set)
        _check_num_groups(num_groups)
        if not gradient_predivide_factor > 0:
            raise ValueError("gradient_predivide_factor must be positive, got "
                             f"{gradient_predivide_factor}")
        kv = _session.kv
        super().__init__(params, optimizer, optimizer_params, kv,
                         codec_of(compression, "DistributedTrainer"), prefix,
                         owner="DistributedTrainer")
        self._predivide = float(gradient_predivide_factor)
        self._scale *= self._predivide / kv.num_workers

    def _allreduce_grads(self):
        # on one process too: Horovod skips the predivision there but keeps the factor
        # in rescale_grad, which scales the gradients by it
        self._sum_grads(1.0 / self._predivide)


class DistributedOptimizer(PeerOptimizer):
    """Horovod's DistributedOptimizer for the Module API: each ``update`` sums the
    gradients over all workers (divided by ``gradient_predivide_factor`` first), and the
    wrapped optimizer's ``rescale_grad`` is multiplied by ``factor / size()`` here, once.
    Install it with ``kvstore=None``: ``mod.fit(..., kvstore=None, optimizer=opt)``.
    """

    def __init__(self, optimizer, gradient_predivide_factor=1.0, num_groups=0,
                 process_set=global_process_set):
        _check_process_set(process_set)
        _check_num_groups(num_groups)
        if not gradient_predivide_factor > 0:
            raise ValueError("gradient_predivide_factor must be positive, got "
                             f"{gradient_predivide_factor}")
        kv = _session.kv
        super().__init__(optimizer, kv, prescale=1.0 / gradient_predivide_factor,
                         average=False)
        optimizer.rescale_grad *= gradient_predivide_factor / kv.num_workers


__all__ = [
    "init", "shutdown", "is_initialized", "size", "local_size", "cross_size", "rank",
    "local_rank", "cross_rank", "is_homogeneous", "mpi_threads_supported", "mpi_enabled",
    "mpi_built", "gloo_enabled", "gloo_built", "nccl_built", "ddl_built", "ccl_built",
    "cuda_built", "rocm_built", "start_timeline", "stop_timeline",
    "allreduce", "allreduce_", "grouped_allreduce", "grouped_allreduce_", "allgather",
    "grouped_allgather", "broadcast", "broadcast_", "alltoall", "reducescatter",
    "grouped_reducescatter", "broadcast_object", "allgather_object",
    "ProcessSet", "global_process_set", "add_process_set", "remove_process_set",
    "Average", "Sum", "Adasum", "Min", "Max", "Product",
    "Compression", "DistributedOptimizer", "DistributedTrainer", "broadcast_parameters",
    "join",
]
