"""SyncBatchNorm's side channel: its small per-layer sums over direct TCP connections
between the workers, beside the backend's transport.

A SyncBatchNorm layer sums a few hundred numbers over the workers twice per step, each
sum waiting for the one before. Through the backend those sums pay its latency
(horovod negotiates every collective in its background thread's cycle of 1 ms; ps-lite
goes through a server) and, in the backward pass, queue behind the trainer's gradient
sums on the same first-in first-out transport (benchmarks/FINDINGS.md, sections 11-11d).
Here every pair of workers keeps one TCP connection (TCP_NODELAY), made once with a
collective of the backend (an all-gather of the workers' listening addresses); a sum is
an asynchronous operation of MXNet's engine (``MXEnginePushAsyncND``, the compiled
``_sidesum.cc`` in the fused-kernel library), so the operators that read the array
wait for it as for any operator, and nothing waits on the script's thread: the
operation sends the array to every peer, and a receiver thread of the library writes
the sum, in rank order (the same bits on every rank), once every peer's part has come.

Failures reach the engine as errors of the operation, raised where the array is read
(the step, like a failed collective): a peer whose connection closes (it exited or
failed), a part of another size (the ranks' layers differ), and a peer silent for
:data:`TIMEOUT` seconds, each naming the peer and the key. The connections close at
exit, after the backend has finished the work in flight.

Used where the job does not re-form (not elastic), on horovod, dist_sync and p3, for
float32 and float64 arrays on the CPU; ``DG_SYNCBN_SIDE=0`` keeps every sum on the
backend.
"""
from __future__ import annotations

import ctypes
import hashlib
import ipaddress
import os
import secrets
import socket
import time
import warnings

import mxnet as mx
import numpy as np

from . import _kernels, worker
from .backends import Backend

# Seconds a sum waits for a silent peer (and a set-up for its connection) before it
# raises; DG_SYNCBN_SIDE_TIMEOUT sets it. Peers step together, so a sum waits at most for
# the slowest rank's step; evaluation or a checkpoint on one rank must stay below it.
TIMEOUT = 300.0
# Seconds the set-up waits for a peer's connection: every rank listens before the
# all-gather of the addresses, so a peer that cannot be reached by then never will be.
SETUP_TIMEOUT = 60.0
_BACKENDS = ("horovod", "dist_sync", "p3")
_DTYPES = {np.dtype("float32"): 0, np.dtype("float64"): 1}
_CPU_PRIORITIZED = 3        # MXNet's FnProperty::kCPUPrioritized: its own worker threads
_PRIORITY = 1
_channels: dict[int, SideChannel | None] = {}   # id(backend) -> its channel or None


class SideChannelError(RuntimeError):
    """The side channel could not be set up (raised on every rank)."""


def enabled(kv: Backend) -> bool:
    """Whether SyncBatchNorm's sums on ``kv`` may take the side channel: several workers
    of a job that does not re-form, on horovod, dist_sync or p3, ``DG_SYNCBN_SIDE`` not
    0. The same answer on every rank (it reads the job's settings only)."""
    return (os.environ.get("DG_SYNCBN_SIDE", "1") != "0" and kv.type in _BACKENDS
            and kv.num_workers > 1 and not worker.context().elastic)


def serves(array: mx.nd.NDArray) -> bool:
    """Whether the channel sums ``array``: float32 or float64 on the CPU."""
    return array.context.device_type == "cpu" and np.dtype(array.dtype) in _DTYPES


def channel(kv: Backend) -> SideChannel | None:
    """``kv``'s side channel, set up at the first call on every rank (a collective of
    ``kv``: call it on the script's thread, at the same point on every rank); None where
    a rank could not load the channel's library (every rank then keeps the backend)."""
    if id(kv) not in _channels:
        _channels[id(kv)] = SideChannel.connect(kv)
    return _channels[id(kv)]


def key_id(name: str) -> int:
    """The 64-bit id under which a key's parts travel (the same on every rank)."""
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little")


class SideChannel:
    """TCP connections from this worker to every other worker of ``kv``'s job, and the
    library's receiver thread. Made by :meth:`connect`."""

    def __init__(self, kv: Backend, handle: int, lib: ctypes.CDLL, names: list[str]):
        self.kv, self._handle, self._lib = kv, handle, lib
        # every rank as its errors name it: "rank r (address:port)"
        self.names = names
        self._named_keys: set[str] = set()
        self._closed = False
        kv.at_shutdown(self.close)

    @classmethod
    def connect(cls, kv: Backend) -> SideChannel | None:
        """Connect every pair of ``kv``'s workers: each listens on its address that the
        others reach (``kv.node_address()``), the addresses (and a token per rank, so a
        stray connection is refused) go round with ``kv.allgather_object``, each rank
        dials the ranks below it and accepts the ranks above. None on every rank if a
        rank cannot load the library, or knows only a loopback address of its own in a
        job of several nodes."""
        timeout = float(os.environ.get("DG_SYNCBN_SIDE_TIMEOUT", TIMEOUT))
        setup = min(timeout, SETUP_TIMEOUT)
        lib = _library()
        address = kv.node_address()
        if worker.context().nnodes > 1 and ipaddress.ip_address(address).is_loopback:
            warnings.warn(f"dist_gluon: SyncBatchNorm's side channel is off: this worker's "
                          f"address is {address} (a loopback address) in a job of "
                          f"{worker.context().nnodes} nodes; its sums go through the "
                          "backend", stacklevel=3)
            lib = None
        listener = token = None
        if lib is not None:
            listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            listener.bind((address, 0))
            listener.listen(kv.num_workers)
            token = secrets.token_hex(16)
        me = (listener.getsockname() if listener else None, token)
        everyone = kv.allgather_object(me)
        if any(address is None for address, _ in everyone):
            if listener is not None:
                listener.close()
            return None
        rank, size = kv.rank, kv.num_workers
        names = [f"rank {r} ({address[0]}:{address[1]})"
                 for r, (address, _) in enumerate(everyone)]
        sockets: dict[int, socket.socket] = {}
        try:
            for peer in range(rank):
                sockets[peer] = _dial(everyone[peer][0], rank, everyone[peer][1], names[peer],
                                      setup)
            deadline = time.monotonic() + setup
            while len(sockets) < size - 1:
                waiting = [names[r] for r in range(rank + 1, size) if r not in sockets]
                sockets.update([_accept(listener, token, size, waiting, deadline)])
        except (OSError, SideChannelError) as err:
            for sock in sockets.values():
                sock.close()
            raise SideChannelError(
                f"SyncBatchNorm's side channel could not connect rank {rank} with its "
                f"peers: {err}. Set DG_SYNCBN_SIDE=0 in the job's environment to sum over "
                "the backend instead") from err
        finally:
            listener.close()
        fds = [sockets[r].detach() if r in sockets else -1 for r in range(size)]
        handle = lib.dg_side_open(rank, size, (ctypes.c_int * size)(*fds),
                                  (ctypes.c_char_p * size)(*[n.encode() for n in names]),
                                  timeout, lib.free_handle)
        if not handle:
            raise SideChannelError("SyncBatchNorm's side channel could not start its "
                                   "receiver (pipe() failed)")
        return cls(kv, handle, lib, names)

    def name_key(self, name: str) -> None:
        """Give key ``name`` its name in the errors that concern it (on the script's
        thread, before its first sum)."""
        if name not in self._named_keys:
            self._named_keys.add(name)
            self._lib.dg_side_name_key(self._handle, key_id(name), name.encode())

    def sum(self, name: str, array: mx.nd.NDArray) -> None:
        """Queue the sum of ``array`` over the workers, in place, on MXNet's engine
        (from any thread: the engine takes pushes from several)."""
        lib = self._lib
        task = lib.dg_side_task(self._handle, key_id(name), _kernels.own_handle(array),
                                _DTYPES[np.dtype(array.dtype)], array.size, lib.get_data,
                                lib.free_handle)
        ctx = array.context
        context = _kernels._Context(ctx.device_typeid, ctx.device_id)
        prop = ctypes.c_int(_CPU_PRIORITIZED)
        mx.base.check_call(mx.base._LIB.MXEnginePushAsyncND(
            lib.side_run, ctypes.c_void_p(task), lib.side_free, ctypes.byref(context),
            None, 0, (mx.base.NDArrayHandle * 1)(array.handle), 1, ctypes.byref(prop),
            ctypes.c_int(_PRIORITY), b"dg_side_sum", ctypes.c_bool(False)))

    def close(self) -> None:
        """Fail what still waits, close the connections (at exit, after the work in
        flight: the backend's shutdown calls it)."""
        if not self._closed:
            self._closed = True
            self._lib.dg_side_close(self._handle)


def _library() -> ctypes.CDLL | None:
    try:
        lib = _kernels.tasks()
    except (OSError, RuntimeError) as err:
        warnings.warn(f"dist_gluon: SyncBatchNorm's side channel is off ({err}); its sums "
                      "go through the backend", stacklevel=4)
        return None
    if not hasattr(lib, "side_run"):
        lib.dg_side_open.restype = ctypes.c_void_p
        lib.dg_side_open.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.POINTER(ctypes.c_int),
                                     ctypes.POINTER(ctypes.c_char_p), ctypes.c_double,
                                     ctypes.c_void_p]
        lib.dg_side_task.restype = ctypes.c_void_p
        lib.dg_side_task.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_void_p,
                                     ctypes.c_int, ctypes.c_int64, ctypes.c_void_p,
                                     ctypes.c_void_p]
        lib.dg_side_name_key.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_char_p]
        lib.dg_side_close.argtypes = [ctypes.c_void_p]
        lib.side_run, lib.side_free = (ctypes.cast(f, ctypes.c_void_p)
                                       for f in (lib.dg_side_run, lib.dg_side_free_task))
    return lib


def _dial(address, rank: int, token: str, name: str, timeout: float) -> socket.socket:
    """Connect to ``address`` (the peer ``name``) and introduce this rank with the
    peer's token."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            sock = socket.create_connection(tuple(address), timeout=5)
            break
        except OSError as err:
            if time.monotonic() > deadline:
                raise SideChannelError(f"{name} refused the connection for "
                                       f"{timeout:.0f} s ({err})") from err
            time.sleep(0.1)
    sock.settimeout(None)
    sock.sendall(rank.to_bytes(4, "little") + token.encode())
    return sock


def _accept(listener: socket.socket, token: str, size: int, waiting: list[str],
            deadline: float) -> tuple[int, socket.socket]:
    """The next peer that connects with this rank's token: (its rank, socket)."""
    while True:
        left = deadline - time.monotonic()
        try:
            if left <= 0:
                raise TimeoutError
            listener.settimeout(left)
            sock, _ = listener.accept()
        except TimeoutError as err:
            raise SideChannelError(f"{', '.join(waiting)} did not connect within the "
                                   "timeout") from err
        sock.settimeout(10)
        try:
            hello = _read(sock, 4 + len(token))
        except OSError:
            sock.close()
            continue
        peer = int.from_bytes(hello[:4], "little")
        if hello[4:].decode(errors="replace") != token or not 0 <= peer < size:
            sock.close()            # not one of the job's workers
            continue
        sock.settimeout(None)
        return peer, sock


def _read(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionError("closed")
        data += chunk
    return data
