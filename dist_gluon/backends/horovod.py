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

import atexit
import ctypes
import importlib.metadata
import os
import socket
import time
import urllib.error
import urllib.request
import warnings

import mxnet as mx
import numpy as np

from .. import build_horovod, jobcontrol, worker
from .._requirements import import_horovod as _import_horovod
from .base import Backend, interface_address, report_connect
from .horovod_tuning import CYCLE_ENV, FUSION_ENV, Tuner

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
# horovod builds whose Gloo sums float16 exactly: the local version labels
# dist_gluon/build_horovod.py gives the wheel `make setup` installs (0.28.1+dg2; dg1 had
# the fix without F16C). horovod 0.28.1 as released keeps one operand for some pairs
# (benchmarks/FINDINGS.md 9l, 9m).
EXACT_HALF_BUILDS = frozenset({"dg1", build_horovod.LABEL})


def horovod_build() -> str:
    """The local version label of the installed horovod ("dg2" for 0.28.1+dg2), or ""."""
    try:
        version = importlib.metadata.version("horovod")
    except importlib.metadata.PackageNotFoundError:
        return ""
    return version.partition("+")[2]


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


def _socket_links() -> dict[int, str]:
    """This process's open sockets: descriptor -> "socket:[inode]"."""
    links = {}
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return links
    for name in names:
        try:
            link = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if link.startswith("socket:"):
            links[int(name)] = link
    return links


class RoundEnded(RuntimeError):
    """The launcher ended this round before every rank reached the rendezvous."""


def _meet_at_rendezvous(poll: float = 0.02) -> None:
    """Wait until every rank of the round has reached the Gloo rendezvous, before
    ``hvd.init()``: an elastic job runs Gloo with a short timeout (the launcher's
    ELASTIC_GLOO_TIMEOUT), which would otherwise also bound how long a rank waits for a
    peer still starting (importing MXNet takes seconds). Each rank stores a key in the
    rendezvous' own store (dist_gluon.launch.rendezvous) and waits for all of them.
    Raises RoundEnded when the launcher ends the round meanwhile (a peer was lost)."""
    addr = os.environ.get("HOROVOD_GLOO_RENDEZVOUS_ADDR")
    port = os.environ.get("HOROVOD_GLOO_RENDEZVOUS_PORT")
    if not addr or not port:
        return
    rank, size = int(os.environ.get("HOROVOD_RANK", 0)), int(os.environ.get("HOROVOD_SIZE", 1))
    # the C++ client's URL form, token included (see rendezvous.py)
    base = f"http://{addr}:{port}/dg_ready"
    request = urllib.request.Request(f"{base}/{rank}", data=b"1", method="PUT")
    urllib.request.urlopen(request, timeout=10).close()
    reporter = jobcontrol.reporter()
    current = worker.context().restart
    waiting = set(range(size)) - {rank}
    while waiting:
        for peer in sorted(waiting):
            try:
                urllib.request.urlopen(f"{base}/{peer}", timeout=10).close()
                waiting.discard(peer)
            except (urllib.error.URLError, OSError):
                break
        if not waiting:
            return
        ended = reporter.round_aborted() if reporter is not None else None
        if ended is not None and ended >= current:
            raise RoundEnded(f"round {current} ended before ranks "
                             f"{', '.join(map(str, sorted(waiting)))} reached its rendezvous")
        time.sleep(poll)


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
        # the sockets of this process's Gloo contexts (their /proc link names), which
        # _abort breaks
        self._gloo_sockets: frozenset[str] = frozenset()
        # horovod 0.28.1 fixes a variable set at its first start for the process's life,
        # and its next hvd.init() segfaults once both of these are fixed
        # (benchmarks/FINDINGS.md 9i): an in-place re-formation could not start it again
        self._fixed_at_start = [name for name in (CYCLE_ENV, FUSION_ENV) if name in os.environ]
        if not self._hvd.is_initialized():
            report_connect(self._type)
            _tune_openmpi()
            self._init()
        super().__init__()
        # whether rank 0 has said that Gloo's float16 sums are inexact (or there is
        # nothing to say: over MPI)
        self._told_half = False
        self._tuner = Tuner(self._start_again, mx.nd.waitall, self.broadcast_object, self.rank,
                            enabled=worker.context().tune and self.num_workers > 1,
                            reason_not=self._why_not_tuned())

    def _init(self) -> None:
        if worker.context().elastic:
            _meet_at_rendezvous()
        before = set(_socket_links().values())
        self._hvd.init()
        # Gloo connects every pair of ranks inside hvd.init(): what opened there is its
        self._gloo_sockets = frozenset(set(_socket_links().values()) - before)

    def _can_reform(self) -> bool:
        # over Gloo, with a rendezvous the launcher renews each round; MPI's world is
        # fixed once the processes start
        return "HOROVOD_GLOO_RENDEZVOUS_ADDR" in os.environ

    def _why_not_tuned(self) -> str | None:
        """Why horovod's cycle time cannot be tuned in this process (horovod_tuning.py):
        the tuner starts horovod again in place, as a re-formation does; or None."""
        if not self._can_reform():
            return "over MPI horovod starts once per process (MPI_Init); horovod's default"
        if not worker.context().placed:
            return ("started without dist_gluon.launch, whose Gloo rendezvous lets horovod "
                    "start again in the process; horovod's default")
        if worker.context().elastic:
            return ("an elastic job starts horovod again at each re-formation, which "
                    "horovod 0.28.1 cannot combine with a cycle time set in the process; "
                    "horovod's default")
        return None

    def _reform_problem(self) -> str | None:
        if len(self._fixed_at_start) < 2:
            return None
        return (f"{' and '.join(self._fixed_at_start)} are both set: horovod 0.28.1 cannot "
                "start again in a process it started with both (hvd.init() ends with a "
                "segmentation fault), and dist_gluon.elastic.run re-forms the job inside "
                "its workers' processes at the first lost or joining node. Set at most one "
                "of them for this job (benchmarks/FINDINGS.md 9i; docs/elastic.md)")

    def _abort(self) -> None:
        """Break every collective pending on this process's Gloo connections: their
        sockets are shut down for reading, so horovod's background thread fails at once
        instead of waiting out Gloo's timeout for a peer that is gone (each live peer's
        launcher breaks its own). Called from another thread than the one blocked in
        the engine. Reading only: Gloo's I/O thread then sees one error per connection
        (end of file); shut down for writing too, a write of the same event could fail
        as well, and Gloo aborts the process at a connection's second error (a
        GLOO_ENFORCE in its I/O thread: SIGABRT)."""
        for fd, link in _socket_links().items():
            if link not in self._gloo_sockets:
                continue
            try:
                copy = os.dup(fd)
            except OSError:
                continue
            try:
                # horovod's threads may have closed the descriptor since the listing,
                # and another connection of this process may have its number now
                if os.readlink(f"/proc/self/fd/{copy}") != link:
                    continue
                with socket.socket(fileno=copy) as sock:
                    copy = None
                    sock.shutdown(socket.SHUT_RD)
            except OSError:
                pass
            finally:
                if copy is not None:
                    os.close(copy)

    def _leave(self) -> None:
        """Shut horovod down on every rank together: each rank's request reaches the
        others through horovod's own negotiation, so no collective is left waiting."""
        self._hvd.shutdown()

    def _announced_address(self) -> str | None:
        iface = os.environ.get("HOROVOD_GLOO_IFACE")
        return interface_address(iface) if iface else None

    def _reform(self, environ: dict[str, str]) -> None:
        """Leave this round's horovod and join the next one in the same process:
        ``hvd.shutdown()``, the next round's HOROVOD_* variables (rank, size, Gloo
        rendezvous), ``hvd.init()``, as horovod's elastic mode does for PyTorch."""
        self._start_again(environ)

    def _start_again(self, environ: dict[str, str]) -> None:
        """Leave horovod and join it again in this process with ``environ`` added to
        the environment, which ``hvd.init()`` reads (a re-formation's round; the
        tuner's HOROVOD_CYCLE_TIME, at the end of the same step on every rank, with
        nothing in flight)."""
        self._hvd.shutdown()
        os.environ.update(environ)
        self._in_flight.clear()
        report_connect(self._type)
        self._init()
        # hvd.init() registered horovod's shutdown at exit again: ours must run first
        # (it finishes what is in flight and waits for the launcher's verdict)
        atexit.unregister(self._atexit)
        atexit.register(self._atexit)

    def step_ended(self, owner: object = None) -> None:
        self._tuner.step_ended(owner)

    def _chained(self, why: str) -> None:
        self._tuner.chained(why)

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
        if not self._told_half:
            self._tell_half_sums(names, arrays)
        with self._submit_lock:
            for name, arr in zip(names, arrays):
                self._hvd.allreduce_(arr, name=f"dg.ar.{name}", priority=priority,
                                     op=self._hvd.Sum)

    def _reducescatter_(self, names, arrays, priority):
        if not self._told_half:
            self._tell_half_sums(names, arrays)
        return self._grouped("reducescatter", names, arrays, priority)

    def _tell_half_sums(self, names, arrays) -> None:
        """At the first float16 sum over Gloo, rank 0 warns that some will be wrong:
        horovod 0.28.1's float16 sum over Gloo returns one of the two values instead of
        their sum for some pairs of values (0.000428 + 3844 gives 0.000428, 26480 + 3844
        gives 26480, 1 + 6e-8 gives 6e-8; 4 of 5,007 gradient values of wide range per
        step in one test), where the same sums over MPI, in float32 and on ps-lite are
        right (benchmarks/FINDINGS.md 9l). Once per process; nothing over MPI, nor with
        the build `make setup` installs (:data:`EXACT_HALF_BUILDS`, FINDINGS 9m)."""
        if not self._hvd.gloo_enabled() or horovod_build() in EXACT_HALF_BUILDS:
            self._told_half = True
            return
        half = next((name for name, arr in zip(names, arrays) if arr.dtype == np.float16),
                    None)
        if half is None:
            return
        self._told_half = True
        if self.rank == 0:
            warnings.warn(
                f"dist_gluon: float16 sums over horovod's Gloo transport (the first: "
                f"{half!r}) can be wrong: horovod 0.28.1's Gloo float16 sum returns one "
                "of the two values instead of their sum for some pairs (0.000428 + 3844 "
                "gives 0.000428), so those gradient elements lose a worker's part. For "
                "exact float16 sums use --transport mpi, or dist_sync/p3; on Gloo, "
                "compression='2bit' or 'powersgd' (integer or float32 sums), or "
                "float32 gradients; or install the horovod that `python -m "
                "dist_gluon.build_horovod` builds (`make setup` does), whose Gloo sums "
                "float16 exactly (benchmarks/FINDINGS.md 9l, 9m)", stacklevel=4)

    def _allgather_(self, names, arrays, counts, outs, priority):
        if outs is not None:
            for out in outs:
                # a whole write: an array left in MKLDNN's layout by an inference
                # forward is plain again before horovod writes its bytes into it
                out[:] = 0
            # horovod names allgathers apart from sums: only another allgather under
            # the same key must be done first
            self._one_at_a_time([f"allgather {name}" for name in names], outs)
        return self._grouped("allgather", names, arrays, priority, outs)

    def _grouped(self, op: str, names, arrays, priority, outputs=None) -> list[mx.nd.NDArray]:
        """horovod.mxnet's grouped reducescatter (a sum) or allgather of ``arrays``,
        submitted under the submission lock: horovod's own functions wait while the
        caller would hold the lock, and a SyncBatchNorm backward that the inputs depend
        on submits its sums under it. Into ``outputs`` of the whole shape (which horovod
        writes in place), nothing waits: MXNet's engine orders what reads them.
        Without, the outputs start as (1,) arrays that horovod resizes, and are waited
        for outside the lock."""
        from horovod.mxnet import mpi_ops
        from mxnet.base import c_handle_array, c_str, check_call

        given = outputs is not None
        if not given:
            outputs = [mx.nd.empty((1,), ctx=a.context, dtype=a.dtype) for a in arrays]
        name = c_str(f"dg.{'rs' if op == 'reducescatter' else 'ag'}.{names[0]}.{len(names)}")
        process_set = ctypes.c_int(mpi_ops.global_process_set.process_set_id)
        lib = mpi_ops.MPI_MXNET_LIB_CTYPES
        with self._submit_lock:
            if op == "reducescatter":
                check_call(lib.horovod_mxnet_reducescatter_async(
                    c_handle_array(arrays), c_handle_array(outputs), name,
                    ctypes.c_int(priority), process_set, ctypes.c_int(len(arrays)),
                    ctypes.c_int(self._hvd.Sum), ctypes.c_double(1.0), ctypes.c_double(1.0)))
            else:
                check_call(lib.horovod_mxnet_allgather_async(
                    c_handle_array(arrays), c_handle_array(outputs), name,
                    ctypes.c_int(priority), process_set, ctypes.c_int(len(arrays))))
        if not given:
            for out in outputs:
                out.wait_to_read()
        return outputs

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
