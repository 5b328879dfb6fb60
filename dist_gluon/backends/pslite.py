"""ps-lite backends: MXNet's own parameter server (``dist_sync``, ``dist_async``) and P3.

P3 (priority-based parameter propagation, MXNet PR #15124) is the same job with the P3
van (``DMLC_PS_VAN_TYPE=p3``) in every process: large tensors are sliced and sent in
priority order. On both, updates run on the workers and the servers only sum. On
``dist_async`` the servers run the optimizer and no worker waits for another
(:class:`DistAsync`).

The launcher's side of a ps-lite job, its environment, is in dist_gluon/launch/jobenv.py
(which imports neither mxnet nor horovod); only this module reads ``DMLC_*`` variables.
"""
from __future__ import annotations

import collections
import ctypes
import gc
import os
import socket
import sys
import threading
import zlib

import mxnet as mx
import numpy as np
from mxnet.kvstore.base import KVStoreBase

from .. import _kernels, jobcontrol, worker
from ..async_updates import ServerOptimizer, collective_key, model_key, refuse_script_optimizer
from .base import Backend, report_connect

_MXNET_CREATE = mx.kvstore.create

# ps-lite servers only aggregate floating point values.
_SERVER_DTYPES = {np.dtype("float16"), np.dtype("float32"), np.dtype("float64")}
# ... and MXNet 1.9's servers sum float64 at float32 precision (1/3 + 1/3 comes back as
# 0.6666666865348816, 2**40 + 1 loses its 1). Other dtypes are summed by DistSync's
# _exact_sum instead.
_EXACT_ON_SERVERS = {np.dtype("float16"), np.dtype("float32")}
# The plain van moves a key as one message through one server, so the push, the sum and
# the pull of a large tensor run one after the other. Cut into slices of at most this
# many elements (1 MiB of float32), each its own key, they overlap: a 100 MiB sum takes
# a third of the time on loopback. The P3 van slices by itself.
_SLICE_ELEMENTS = 1 << 18
# ... but on one host only above this many elements (16 MiB of float32). A slice costs
# two copies, into a buffer of its own and back (0.3 ms a MiB of the worker's CPU here),
# and on loopback the overlap gains little below that: one tensor of 9 MiB took 21 ms
# sliced and 22 ms whole, 16 MiB 37.5 and 39.6 ms, 64 MiB 194 and 265 ms; ResNet-18
# (11.7M parameters, none above 9 MiB) spent 14 ms of copies a step and its step was
# 3-5% faster whole (benchmarks/FINDINGS.md 5b). Across hosts the link is the limit.
_WHOLE_ON_ONE_HOST = 1 << 22
# A tensor of at least this many elements is cut into at least one slice per server, so
# that its bytes cross every host's link instead of one server's: a 1 MiB sum over 4
# hosts at 1 Gbit/s took 48 ms as one key, 22 ms as four (benchmarks/FINDINGS.md).
_SPREAD_ELEMENTS = 1 << 16
# the key on which the workers agree on the keys they create (DistSync._agree_on_new_keys)
_NEW_KEYS = "__dg_new_keys"

CONNECT_TIMEOUT_VARIABLE = "DG_CONNECT_TIMEOUT"
DEFAULT_CONNECT_TIMEOUT = 60.0

_LAUNCH_HELP = (
    "start every process of the job with the launcher, e.g.\n"
    "    python -m dist_gluon.launch -n 2 --backend {backend} -- python your_script.py\n"
    "(a ps-lite job is 1 scheduler, S servers and N workers sharing DMLC_PS_ROOT_URI, "
    "DMLC_PS_ROOT_PORT, DMLC_NUM_SERVER, DMLC_NUM_WORKER and DMLC_ROLE)")


def started_by_pslite(environ=os.environ) -> bool:
    return environ.get("DMLC_ROLE") == "worker"


def asynchronous(environ=os.environ) -> bool:
    """Started by the launcher as a dist_async worker (``DG_BACKEND=dist_async``)."""
    return environ.get("DG_BACKEND") == "dist_async"


def uses_p3_van(environ=os.environ) -> bool:
    return environ.get("DMLC_PS_VAN_TYPE", "") == "p3"


# ps-lite starts once per process: a second dist kvstore in the same process blocks
# forever inside MXNet, so the first one is remembered and a second gets an error.
_native_owner: str | None = None
_SECOND_STORE = (
    "this process already runs a ps-lite kvstore ({owner}), and ps-lite allows one per "
    "process (a second one blocks forever). Share the first one: pass kv=dist_gluon.create()"
    " to dist_gluon, or kvstore=dist_gluon.create() with update_on_kvstore=False to a "
    "gluon.Trainer or Module, instead of kvstore='dist_sync'")


def claim_native_store(owner: str) -> None:
    """Record that ``owner`` creates this process's ps-lite kvstore, or raise if one
    exists already."""
    global _native_owner
    if _native_owner is not None:
        raise RuntimeError(_SECOND_STORE.format(owner=_native_owner))
    _native_owner = owner


def connect_timeout(environ=os.environ) -> float:
    """Seconds a worker waits to join its ps-lite job: ``DG_CONNECT_TIMEOUT``, default
    60."""
    text = environ.get(CONNECT_TIMEOUT_VARIABLE, "").strip()
    if not text:
        return DEFAULT_CONNECT_TIMEOUT
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0:
        raise ValueError(f"{CONNECT_TIMEOUT_VARIABLE} must be a positive number of seconds, "
                         f"got {text!r}")
    return value


def _connect(kind: str = "dist_sync"):
    """``mx.kv.create(kind)``, which blocks in C++ until the scheduler has
    registered every worker and server of the job. A watchdog thread ends the process
    (status 1, the reason on stderr) if that takes longer than ``connect_timeout()``:
    a wrong scheduler address would otherwise hang the worker forever, silently."""
    timeout = connect_timeout()
    connected = threading.Event()

    def watchdog():
        if not connected.wait(timeout):
            reason = _not_connected(timeout)
            reporter = jobcontrol.reporter()
            if reporter is not None:
                reporter.failed(f"ConnectTimeout: {reason}")
            sys.stderr.write(f"dist_gluon: {reason}\n")
            sys.stderr.flush()
            os._exit(1)

    threading.Thread(target=watchdog, name="dist_gluon-connect-watchdog", daemon=True).start()
    try:
        return _MXNET_CREATE(kind)
    finally:
        connected.set()


def _not_connected(timeout: float) -> str:
    host = os.environ.get("DMLC_PS_ROOT_URI", "")
    port = os.environ.get("DMLC_PS_ROOT_PORT", "")
    address = f"{host}:{port} (DMLC_PS_ROOT_URI:DMLC_PS_ROOT_PORT)"
    advice = (f"{CONNECT_TIMEOUT_VARIABLE} sets how long a worker waits (seconds, default "
              f"{DEFAULT_CONNECT_TIMEOUT:g})")
    try:
        with socket.create_connection((host, int(port)), timeout=5):
            pass
    except (OSError, ValueError) as err:
        return (f"this ps-lite worker could not reach the scheduler at {address} within "
                f"{timeout:g} s ({err}). Check that the scheduler runs and that this "
                f"address is reachable from this host; {advice}")
    return (f"this ps-lite worker reached the scheduler at {address}, but the job did not "
            f"start within {timeout:g} s: not all of its DMLC_NUM_WORKER="
            f"{os.environ.get('DMLC_NUM_WORKER')} workers and DMLC_NUM_SERVER="
            f"{os.environ.get('DMLC_NUM_SERVER')} servers joined. Check that every process "
            f"of the job was started with the same scheduler address; {advice}")


def _listed(names: list[str], most: int = 3) -> str:
    """``'a', 'b' and 2 more`` for an error message."""
    shown = ", ".join(repr(n) for n in names[:most])
    return shown + (f" and {len(names) - most} more" if len(names) > most else "")


def _rank_problems(values: list[str | None]) -> list[str]:
    """What is wrong with the DG_RANK values of a job's workers (one per worker)."""
    n = len(values)
    problems = []
    unset = sum(value is None for value in values)
    if unset:
        problems.append(f"DG_RANK is unset on {unset} of them")
    ranks = []
    for value in values:
        if value is None:
            continue
        try:
            ranks.append(int(value))
        except ValueError:
            problems.append(f"DG_RANK={value!r} is not an integer")
    counts = collections.Counter(ranks)
    for rank, count in sorted(counts.items()):
        if not 0 <= rank < n:
            problems.append(f"DG_RANK={rank} is out of range")
        elif count > 1:
            problems.append(f"DG_RANK={rank} is given to {count} workers")
    missing = [r for r in range(n) if r not in counts]
    if missing:
        problems.append("no worker has DG_RANK=" + ", ".join(map(str, missing)))
    return problems


class _WirePlan:
    """How one array is summed on the servers: under which keys, as which arrays (the
    array itself, or a buffer per slice that its slices are copied into and back from)."""

    __slots__ = ("array", "names", "wire", "slices")

    def __init__(self, array, names: list[str], wire: list, slices: list[tuple]):
        self.array, self.names, self.wire, self.slices = array, names, wire, slices

    def copy_in(self) -> None:
        for buffer, part in self.slices:
            part.copyto(buffer)

    def copy_out(self) -> None:
        for buffer, part in self.slices:
            buffer.copyto(part)

    def send(self, kv, priority: int) -> None:
        """Sum the array over the workers in place (queued on MXNet's engine)."""
        self.copy_in()
        if len(self.wire) == 1:
            kv.pushpull(self.names[0], self.wire[0], out=self.wire[0], priority=priority)
        else:
            kv.pushpull(self.names, self.wire, out=self.wire, priority=priority)
        self.copy_out()


class DistSync(Backend):
    """Synchronous data parallelism through MXNet's ps-lite kvstore.

    Keys are created on the servers the first time they are used (a collective: every
    worker must use keys in the same order, as with any collective). A key keeps the
    shape and dtype of its first use. The servers sum float16 and float32 arrays;
    float64 and integer arrays are summed exactly by :meth:`_exact_sum`.

    Creating it joins the job: a worker that has not joined after ``DG_CONNECT_TIMEOUT``
    seconds (default 60), e.g. because the scheduler address is wrong, prints why,
    naming the address it tried (``DMLC_PS_ROOT_URI:DMLC_PS_ROOT_PORT``), and exits with
    status 1. Then the workers' ``DG_RANK`` values (set by the launcher) are checked to
    be 0..N-1, each once: duplicated, missing or out-of-range values raise a
    RuntimeError on every worker. Without ``DG_RANK`` on any worker, ranks follow the
    order in which the workers connected.
    """

    _type = "dist_sync"
    _mxnet_type = "dist_sync"
    _byte_dtype = "float16"
    _sums_float64 = False
    _p3 = False

    def __init__(self):
        role = os.environ.get("DMLC_ROLE")
        if role is None:
            raise RuntimeError(f"the '{self._type}' backend runs inside a ps-lite job: "
                               + _LAUNCH_HELP.format(backend=self._type))
        if role != "worker":
            raise RuntimeError(f"DMLC_ROLE={role}: only workers create a kvstore; "
                               "schedulers and servers just `import mxnet`")
        if self._p3 and not uses_p3_van():
            raise RuntimeError("the 'p3' backend needs every process of the job started with "
                               "the P3 van (DMLC_PS_VAN_TYPE=p3, MXNET_UPDATE_ON_KVSTORE=0): "
                               + _LAUNCH_HELP.format(backend="p3"))
        if not self._p3 and uses_p3_van():
            raise RuntimeError("this job runs the P3 van (DMLC_PS_VAN_TYPE=p3): create the "
                               "'p3' backend, or dist_gluon.create() to choose from the "
                               "environment")
        claim_native_store(f"dist_gluon's {self._type!r} backend")
        report_connect(self._type)
        self._kv = _connect(self._mxnet_type)
        self._joined()
        # ps-lite numbers workers in the order they connect; the launcher's rank is
        # stable and matches its output prefixes, so it wins once it is checked.
        self._rank = self._kv.rank
        self._local_rank = worker.context().local_rank
        self._num_workers = self._kv.num_workers
        self._num_servers = int(os.environ.get("DMLC_NUM_SERVER", "1"))
        self._one_host = worker.context().nnodes == 1
        self._keys: dict[str, tuple] = {}
        # one creation of keys at a time, across threads (the workers must create them
        # in one order): _create_keys
        self._create_lock = threading.Lock()
        self._slice_buffers: dict[str, mx.nd.NDArray] = {}
        # name -> how the last array summed under it travels (_WirePlan)
        self._plans: dict[str, _WirePlan] = {}
        super().__init__()
        self._rank = self._launcher_rank()

    def _joined(self) -> None:
        """Called once connected, before the first collective: the key on which the
        workers agree on the keys they create (:meth:`_agree_on_new_keys`), created while
        every worker is here."""
        if self._kv.num_workers > 1:
            self._kv.init(_NEW_KEYS, mx.nd.zeros((self._kv.num_workers,)))

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def num_workers(self) -> int:
        return self._num_workers

    @property
    def local_rank(self) -> int:
        return self._local_rank

    def _launcher_rank(self) -> int:
        """This worker's DG_RANK, checked on every rank to number the workers 0..N-1
        once each, or ps-lite's connection-order rank when no worker has one.

        A duplicated rank would silently double one rank's share of broadcasts and
        samples and drop another's; so every worker places its DG_RANK at its unique
        ps-lite rank in an allgather, and every worker raises the same error."""
        given = os.environ.get("DG_RANK")
        if self._num_workers > 1:
            # part of joining the job: the launcher counts it in the 'connect' collective
            values = self._allgather_object(given)
        else:
            values = [given]
        if all(value is None for value in values):
            return self._rank
        problems = _rank_problems(values)
        if problems:
            n = len(values)
            raise RuntimeError(
                f"the DG_RANK values of this job's {n} workers must be 0..{n - 1}, each "
                f"once, but " + "; ".join(problems) + ". The launcher (python -m "
                "dist_gluon.launch) sets DG_RANK for every worker; when you start the "
                f"workers yourself, give each its own DG_RANK in 0..{n - 1}, or unset it "
                "on all of them to number them in the order they connect")
        return int(given)

    def _allreduce_(self, names, arrays, priority):
        if len(arrays) == 1:
            plan = self._plans.get(names[0])
            if plan is not None and plan.array is arrays[0]:
                # the same array as last time under this name (DistributedTrainer's
                # gradients, every step): its key exists, its dtype goes to the servers
                # and its slices are known, so none of that is worked out again
                with self._submit_lock:
                    plan.send(self._kv, priority)
                return
        exact = [np.dtype(a.dtype) not in _EXACT_ON_SERVERS for a in arrays]
        if any(exact):
            self._exact_sum([n for n, e in zip(names, exact) if e],
                            [a for a, e in zip(arrays, exact) if e], priority)
            names = [n for n, e in zip(names, exact) if not e]
            arrays = [a for a, e in zip(arrays, exact) if not e]
            if not names:
                return
        self._create_keys(names, arrays)
        with self._submit_lock:
            self._submit_sums(names, arrays, priority)

    def _submit_sums(self, names, arrays, priority):
        plans = [self._plan(name, arr) for name, arr in zip(names, arrays)]
        if len(plans) == 1:
            plans[0].send(self._kv, priority)
            return
        for plan in plans:
            plan.copy_in()
        self._kv.pushpull([n for plan in plans for n in plan.names],
                          [w for plan in plans for w in plan.wire],
                          out=[w for plan in plans for w in plan.wire], priority=priority)
        for plan in plans:
            plan.copy_out()

    def _plan(self, name, arr) -> _WirePlan:
        """How ``arr`` travels under ``name``, remembered for the next call with it when
        ``arr`` is the caller's own array, which pushpull keeps anyway (``_in_flight``):
        a plan holds its array, and a temporary one that pushpull does not keep (a
        broadcast's plain copy, an exact sum's pieces) must not outlive its call."""
        plan = self._plans.get(name)
        if plan is None or plan.array is not arr:
            names, wire, slices = [], [], []
            for wire_name, part in self._wire(name, arr):
                if part is not arr:
                    # Views of one array share its engine variable, so MXNet would run
                    # their pushes and pulls one after the other (a 100 MiB sum over 2
                    # hosts at 1 Gbit/s: 1.8 s instead of 0.95 s); a buffer of its own
                    # per slice lets them overlap.
                    buffer = self._slice_buffer(wire_name, part)
                    slices.append((buffer, part))
                    part = buffer
                names.append(wire_name)
                wire.append(part)
            plan = _WirePlan(arr, names, wire, slices)
            if self._in_flight.get(name) is arr:
                self._plans[name] = plan
            else:
                self._plans.pop(name, None)
        return plan

    def _exact_sum(self, names, arrays, priority) -> None:
        """Sum float64 and integer arrays exactly, which the servers cannot (they sum at
        float32 precision): each worker's values travel in a row of their own that the
        other workers leave at zero, as pieces that float32 holds exactly, so the
        servers' sum moves them bit for bit; every worker then adds the rows in rank
        order (float64, or int64). Exact and the same on every rank."""
        on_device = [np.dtype(a.dtype) == np.float64 for a in arrays]
        if any(on_device):
            self._exact_float64_sum([n for n, d in zip(names, on_device) if d],
                                    [a for a, d in zip(arrays, on_device) if d], priority)
        if not all(on_device):
            self._exact_integer_sum([n for n, d in zip(names, on_device) if not d],
                                    [a for a, d in zip(arrays, on_device) if not d],
                                    priority)

    def _exact_float64_sum(self, names, arrays, priority) -> None:
        """float64 on the device, with MXNet operators: a value is split into three
        float32 pieces ``hi + mid + lo`` (24 + 24 + 5 of its 53 bits), exactly while
        its magnitude is within float32's range (about 1e-23 to 3e38: the last piece of
        a smaller value falls below float32's smallest normal; infinities come back as
        NaN). 12 bytes per element and worker instead of 8, and no copy to the host."""
        wires = []
        for name, arr in zip(names, arrays):
            flat = arr.reshape((-1,))
            wire = self._exact_buffer(name, arr)
            wires.append(wire)
            if _kernels.serves(arr.dtype, arr.context):
                # the same pieces in one pass (dist_gluon/_kernels.cc)
                _kernels.push("dg_float64_split", [flat], [wire], priority,
                              workers=self._num_workers, rank=self.rank)
                continue
            hi = flat.astype("float32")
            rest = flat - hi.astype("float64")
            mid = rest.astype("float32")
            lo = (rest - mid.astype("float64")).astype("float32")
            mx.nd.broadcast_mul(self._own_row(arr.context),
                                mx.nd.stack(hi, mid, lo).expand_dims(0), out=wire)
        self._allreduce_([f"{name}.exact" for name in names], wires, priority)
        for arr, wire in zip(arrays, wires):
            if _kernels.serves(arr.dtype, arr.context):
                _kernels.push("dg_float64_combine", [wire], [arr.reshape((-1,))], priority)
                continue
            wide = wire.astype("float64")              # (workers, 3, size)
            rows = (wide[:, 0] + wide[:, 1]) + wide[:, 2]
            mx.nd.add_n(*[rows[r] for r in range(self._num_workers)],
                        out=arr.reshape((-1,)))

    def _exact_buffer(self, name, arr) -> mx.nd.NDArray:
        """The wire array of ``name``'s exact sum, the same in every call (the engine
        orders its uses; a new array per call would wait for the previous one)."""
        key = f"{name}.exact"
        buffer = self._slice_buffers.get(key)
        if buffer is None:
            buffer = mx.nd.zeros((self._num_workers, 3, arr.size), ctx=arr.context,
                                 dtype="float32")
            self._slice_buffers[key] = buffer
        return buffer

    def _own_row(self, ctx) -> mx.nd.NDArray:
        """``(workers, 1, 1)``: 1 at this worker's rank, 0 elsewhere."""
        key = f"__dg_own_row.{ctx}.{self.rank}"
        row = self._slice_buffers.get(key)
        if row is None:
            row = mx.nd.one_hot(mx.nd.full((1,), self.rank, ctx=ctx), self._num_workers,
                                dtype="float32").reshape((self._num_workers, 1, 1))
            self._slice_buffers[key] = row
        return row

    def _exact_integer_sum(self, names, arrays, priority) -> None:
        """Integers through the host: each worker's values as 16-bit pieces in float32
        (exact below 2**24), every worker adding the rows in int64. Integer sums are
        rare (no per-step path of dist_gluon sends one)."""
        rows = []
        for arr in arrays:
            values = arr.asnumpy().reshape(-1)
            wide = values.astype(np.int64)
            pieces = np.zeros((self._num_workers, 4 * wide.size), dtype=np.float32)
            pieces[self.rank] = wide.view(np.uint16)
            rows.append((arr, wide.dtype, mx.nd.array(pieces, dtype="float32")))
        self._allreduce_([f"{name}.exact" for name in names], [w for *_, w in rows],
                         priority)
        for arr, dtype, wire in rows:
            parts = wire.asnumpy().astype(np.uint16).view(dtype)     # (workers, size)
            total = parts[0].copy()
            for part in parts[1:]:
                total += part
            arr[:] = total.reshape(arr.shape).astype(arr.dtype)

    def _broadcast_(self, names, arrays, root_rank, priority):
        # A sum in which only the root contributes is a broadcast, and it reuses the
        # same server keys as every later call (a ps-lite key can be created once only).
        # Weights used by a hybridized forward may hold MKLDNN-layout data, which cannot
        # be sliced in place; broadcasts are rare, so go through plain-layout copies.
        plain = [mx.nd.zeros(a.shape, ctx=a.context, dtype=a.dtype) for a in arrays]
        if self.rank == root_rank:
            for arr, copy in zip(arrays, plain):
                arr.copyto(copy)
        self._allreduce_(names, plain, priority)
        for arr, copy in zip(arrays, plain):
            copy.copyto(arr)

    def _create_keys(self, names, arrays):
        """Create the keys of ``names`` that are new (a collective of every worker, on
        the script's thread: ps-lite creates a key with a barrier). Only the calls into
        the kvstore hold the submission lock: another thread's collective of a key that
        exists (SyncBatchNorm's, from MXNet's threads) must not wait behind a wait for
        the peers, who may need that very collective before they get here."""
        with self._create_lock:
            new_names, new_values, created = [], [], {}
            for name, arr in zip(names, arrays):
                spec = (arr.shape, np.dtype(arr.dtype))
                known = self._keys.get(name, created.get(name))
                if known is None:
                    created[name] = spec
                    for wire_name, part in self._wire(name, arr):
                        new_names.append(wire_name)
                        new_values.append(mx.nd.zeros(part.shape, dtype=arr.dtype))
                elif known != spec:
                    raise ValueError(
                        f"key {name!r} was created with shape {known[0]} and dtype "
                        f"{known[1]}, now used with shape {spec[0]} and dtype {spec[1]}; "
                        f"on {self._type} a key keeps its first shape")
            if new_names:
                self._agree_on_new_keys(list(created))
                with self._submit_lock:
                    self._init_keys(new_names, new_values)
                self._keys.update(created)

    def _init_keys(self, names, values) -> None:
        self._kv.init(names, values)

    def _agree_on_new_keys(self, names) -> None:
        """Check that every worker creates the same keys now, before they are created.

        MXNet numbers string keys in the order a process creates them, so the ranks'
        key numbers agree only while they create the same keys in the same order. Ranks
        that create different keys at once (a sync check on one rank while the other
        makes its first commit, a sum of rank 0's own...) would give both the same
        number on the servers, which then sum one rank's tensor into the other's (or
        abort on a shape mismatch, blaming themselves). Each worker writes a 24-bit
        hash of its names (exact in the servers' float32) into its own slot; every
        worker raises the same kind of error when the slots differ. A worker whose
        peers wait in a collective of a key that exists waits here, and the launcher
        reports the stall (the key it creates is in its record)."""
        n = self._kv.num_workers
        if n < 2:
            return
        digest = (zlib.crc32("\n".join(names).encode("utf-8")) & 0xFFFFFF) + 1
        slots = mx.nd.zeros((n,))
        slots[self._kv.rank] = digest
        with self._submit_lock:
            self._kv.pushpull(_NEW_KEYS, slots, out=slots)
        mine = slots.asnumpy()
        others = [r for r, value in enumerate(mine) if value != digest]
        if others:
            # the slots are ps-lite's connection-order ranks, not the launcher's
            raise RuntimeError(
                f"the ranks call different collectives: rank {self.rank} makes its first "
                f"collective of {_listed(names)} while {len(others)} other "
                f"worker{'s' if len(others) > 1 else ''} make{'' if len(others) > 1 else 's'}"
                " a first one of other keys at the same point. Every rank must call the "
                "same collectives in the same order (a sum, an evaluation's metric, a "
                "layer such as SyncBatchNorm or a DG_CHECK_SYNC interval on some ranks "
                "only breaks that)")

    def _wire(self, name, arr):
        """The (server key, array) pairs that carry ``arr``: itself, or views of equal
        slices of at most ``_SLICE_ELEMENTS`` elements (on one host only for a tensor of
        more than ``_WHOLE_ON_ONE_HOST``), at least one per server for a tensor of
        ``_SPREAD_ELEMENTS`` or more."""
        size = arr.size
        count = -(-size // _SLICE_ELEMENTS)
        if self._one_host and size <= _WHOLE_ON_ONE_HOST:
            count = 1
        if size >= _SPREAD_ELEMENTS:
            count = max(count, self._num_servers)
        if self._p3 or count == 1:
            return [(name, arr)]
        step = -(-size // count)
        flat = arr.reshape((-1,))
        return [(f"{name}#{j}", flat[start:start + step])
                for j, start in enumerate(range(0, size, step))]

    def _slice_buffer(self, wire_name, part):
        buffer = self._slice_buffers.get(wire_name)
        if buffer is None:
            buffer = mx.nd.empty(part.shape, ctx=part.context, dtype=part.dtype)
            self._slice_buffers[wire_name] = buffer
        return buffer

    def _barrier(self) -> None:
        with self._submit_lock:
            self._kv._barrier()

    def _abandon(self) -> None:
        # The kvstore's destructor runs ps-lite's exit barrier, which peers that are
        # being terminated never join: keep it alive until the process is gone.
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(self._kv))
        super()._abandon()

    def _announced_address(self) -> str | None:
        return os.environ.get("DMLC_NODE_HOST") or None

    def _shutdown(self) -> None:
        # Freeing the kvstore runs ps-lite's exit barrier and stops the servers; do it
        # now, while MXNet is alive, rather than during interpreter teardown.
        self._kv = None
        gc.collect()


class P3(DistSync):
    """``dist_sync`` over the P3 van: slices of large tensors are sent by priority."""

    _type = "p3"
    _p3 = True

    def _init_keys(self, names, values) -> None:
        """``kv.init`` one key at a time: MXNet 1.9's P3 kvstore can crash in an init of
        several.

        In ``kv.init`` ps-lite's rank 0 pushes each key's initial value, and
        P3StoreDist::PushDefault reads its own closure (the key's slices) after its last
        send; the server's reply can complete that push on ps-lite's thread and free the
        closure first while MXNet's engine worker, preempted, still runs it. Memory
        allocated meanwhile takes its place and the worker loops on garbage: SIGSEGV in
        SArray::segment, or in ThreadedEngine::OnComplete (benchmarks/FINDINGS.md 12b).
        An init of several keys allocates the next keys' pushes, closures of the same
        size, right then: creating keys 32 at a time crashed ps-lite's rank 0 in 7 of 8
        loaded runs, one at a time in 5 of 25. One init per key costs a barrier each."""
        for name, value in zip(names, values):
            self._kv.init(name, value)


class DistAsync(DistSync):
    """Asynchronous data parallelism through MXNet's ps-lite kvstore (``dist_async``).

    The servers run the optimizer (:class:`~dist_gluon.async_updates.ServerOptimizer`):
    a worker pushes its gradient, the servers apply it at once as one optimizer step,
    and the worker pulls the weights as they are then. No worker waits for another, so
    a slow worker does not slow the others. DistributedTrainer and DistributedOptimizer
    use this path on their own; see :mod:`dist_gluon.async_updates` for what it means
    for the learning rate, the batch size and checkpoints.

    dist_gluon's collectives (broadcast, pushpull sums, objects, barrier) still work, on
    keys the servers only store: each worker writes its value into its own slot, and
    after a barrier every worker reads all slots and sums them in rank order, so every
    rank gets the same result bit for bit. They exist for set-up and evaluation, not
    for gradients.
    """

    _type = "dist_async"
    _mxnet_type = "dist_async"

    def _joined(self) -> None:
        self._int_keys: dict[str, int] = {}
        self._int_specs: dict[str, tuple] = {}
        self._model_keys: set[int] = set()
        self._server_owner: str | None = None
        # before the first collective: the servers must know how to treat its keys
        if self._kv.rank == 0:
            self._kv.set_optimizer(ServerOptimizer())
        self._kv._barrier()

    # ------------------------------------------------------------ collectives
    def _collective_keys(self, names, arrays) -> list[int]:
        """The odd server key of each name, created (a collective) on first use."""
        new_keys, new_values, keys = [], [], []
        for name, arr in zip(names, arrays):
            spec = (arr.shape, np.dtype(arr.dtype))
            key = self._int_keys.get(name)
            if key is None:
                key = self._int_keys[name] = collective_key(len(self._int_keys))
                self._int_specs[name] = spec
                new_keys.append(key)
                new_values.append(mx.nd.zeros(arr.shape, dtype=arr.dtype))
            elif self._int_specs[name] != spec:
                known = self._int_specs[name]
                raise ValueError(f"key {name!r} was created with shape {known[0]} and dtype "
                                 f"{known[1]}, now used with shape {spec[0]} and dtype "
                                 f"{spec[1]}; on {self._type} a key keeps its first shape")
            keys.append(key)
        if new_keys:
            self._kv.init(new_keys, new_values)
        return keys

    def _allreduce_(self, names, arrays, priority):
        # whole, also when autograd's threads submit too (as on the other backends)
        with self._submit_lock:
            self._sum_in_slots(names, arrays, priority)

    def _sum_in_slots(self, names, arrays, priority):
        transit = [a if np.dtype(a.dtype) in _SERVER_DTYPES else a.astype("float64")
                   for a in arrays]
        n = self._num_workers
        slots = [self._collective_keys([f"{name}@{r}" for r in range(n)], [arr] * n)
                 for name, arr in zip(names, transit)]
        self._kv.push([keys[self.rank] for keys in slots], transit, priority=priority)
        mx.nd.waitall()         # every push applied on the servers
        self._kv._barrier()     # ... by every worker
        parts = [[mx.nd.empty(arr.shape, dtype=arr.dtype) for _ in range(n)]
                 for arr in transit]
        self._kv.pull([k for keys in slots for k in keys],
                      out=[p for row in parts for p in row], priority=priority)
        for arr, row in zip(transit, parts):
            mx.nd.add_n(*row, out=arr)
            arr.wait_to_read()
        self._kv._barrier()     # nobody overwrites a slot another still reads
        for arr, moved in zip(arrays, transit):
            if moved is not arr:
                moved.astype(arr.dtype).copyto(arr)

    def _broadcast_(self, names, arrays, root_rank, priority):
        with self._submit_lock:
            self._copy_from_root(names, arrays, root_rank, priority)

    def _copy_from_root(self, names, arrays, root_rank, priority):
        plain = [mx.nd.zeros(a.shape, ctx=a.context, dtype=a.dtype) for a in arrays]
        transit = [p if np.dtype(p.dtype) in _SERVER_DTYPES else p.astype("float64")
                   for p in plain]
        keys = self._collective_keys(names, transit)
        if self.rank == root_rank:
            moved = [a if np.dtype(a.dtype) in _SERVER_DTYPES else a.astype("float64")
                     for a in arrays]
            self._kv.push(keys, moved, priority=priority)
            mx.nd.waitall()
        self._kv._barrier()
        self._kv.pull(keys, out=transit, priority=priority)
        for t in transit:
            t.wait_to_read()
        self._kv._barrier()
        for arr, t in zip(arrays, transit):
            (t if t.dtype == arr.dtype else t.astype(arr.dtype)).copyto(arr)

    # ------------------------------------------------------------ updates on the servers
    def is_capable(self, capability: str) -> bool:
        """The servers run the optimizer (``KVStoreBase.OPTIMIZER``)."""
        if capability == KVStoreBase.OPTIMIZER:
            return True
        return super().is_capable(capability)

    def claim_server_updates(self, owner: str) -> None:
        """One trainer or optimizer per job updates on the servers: they hold a single
        optimizer, which a second one would replace."""
        if self._server_owner is not None:
            raise ValueError(f"{owner}: this dist_async job's servers already update for "
                             f"a {self._server_owner}, and they run one optimizer; use one "
                             "DistributedTrainer (or DistributedOptimizer) per job on "
                             "dist_async")
        self._server_owner = owner

    def set_optimizer(self, optimizer) -> None:
        """Refused: ``gluon.Trainer`` and ``Module`` call it for a kvstore that runs
        optimizers, then key weights and collectives their own way; dist_gluon's trainers
        send the optimizer themselves (:meth:`send_optimizer`)."""
        raise NotImplementedError(
            "gluon.Trainer and Module cannot update on dist_gluon's dist_async backend; use "
            "dist_gluon.DistributedTrainer (or DistributedOptimizer with kvstore=None), "
            "which run the optimizer on its servers, or MXNet's own kvstore='dist_async'")

    def send_optimizer(self, optimizer) -> None:
        """Send ``optimizer`` to the servers (from rank 0; every rank calls it and
        returns once the servers have it). It updates model key ``2 * i`` as its
        parameter ``i`` (see :class:`~dist_gluon.async_updates.ServerOptimizer`); its
        state starts empty."""
        if not isinstance(optimizer, mx.optimizer.Optimizer):
            raise TypeError(f"optimizer must be an mx.optimizer.Optimizer, got "
                            f"{type(optimizer).__name__}")
        refuse_script_optimizer(optimizer, "send_optimizer")
        self._progress("set_optimizer")
        if self.rank == 0:
            self._kv.set_optimizer(ServerOptimizer(optimizer))
        self._kv._barrier()

    def init_model(self, indices: list[int], arrays: list[mx.nd.NDArray]) -> None:
        """Create the server weights of parameters ``indices`` from rank 0's
        ``arrays`` (a collective)."""
        keys = [model_key(i) for i in indices]
        known = [i for i, k in zip(indices, keys) if k in self._model_keys]
        if known:
            raise ValueError(f"parameters {known} already have server weights")
        self._progress("init_model")
        plain = [mx.nd.zeros(a.shape, ctx=a.context, dtype=a.dtype) for a in arrays]
        for arr, copy in zip(arrays, plain):
            arr.copyto(copy)
        self._kv.init(keys, plain)
        self._model_keys.update(keys)

    def push_gradient(self, index: int, grad: mx.nd.NDArray, weight: mx.nd.NDArray,
                      priority: int = 0) -> None:
        """Push ``grad`` of parameter ``index`` (one optimizer step on the servers), then
        pull its current weights into ``weight``. Not a collective: nobody waits for
        anybody."""
        key = model_key(index)
        self._kv.push(key, grad, priority=priority)
        self._kv.pull(key, out=weight, priority=priority)

    def pull_weights(self, indices: list[int], outs: list[mx.nd.NDArray]) -> None:
        """Pull the servers' current weights of parameters ``indices`` into ``outs``."""
        self._kv.pull([model_key(i) for i in indices], out=outs)
        for out in outs:
            out.wait_to_read()

    def _barrier(self) -> None:
        # a barrier orders pushes too: every push a worker made before it is applied
        with self._submit_lock:
            mx.nd.waitall()
            self._kv._barrier()

    def set_gradient_compression(self, compression_params: dict) -> None:
        raise ValueError("the dist_async backend does not compress gradients: each push is "
                         "applied by the servers as it arrives, and dist_gluon's codecs "
                         "sum compressed values, which needs synchronous workers. Use "
                         "dist_sync or p3 (or horovod) for compression")
