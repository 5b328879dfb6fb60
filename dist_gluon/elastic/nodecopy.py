"""A node's copy of the job's :class:`~dist_gluon.elastic.State` in shared memory.

ps-lite starts once per process: after its job lost a scheduler, a server or a worker,
freeing the kvstore blocks in ``ps::Finalize`` and a second one blocks in
``ps::Van::Start`` (tools/pslite_restart.py shows both). So on ``dist_sync``, ``p3``
and ``dist_async`` a change of the job restarts every worker; the state outlives them
here, in the node's memory, never in the checkpoint directory.

The node's launcher makes one directory per job and node in ``/dev/shm`` (mode 0700,
named for the job, the node and the launcher's process; removed when the launcher
exits, and by the next launcher of the host once its owner is dead) and names it to its
workers in ``DG_STATE_DIR``, with the job's id in ``DG_JOB_ID``. The node's first
worker (local rank 0; the others hold the same replica) writes it:

- two slot files take turns, as the State's two sets of copies do: they *are* those
  copies (MXNet arrays over the mapped files, filled by the commit's copies on MXNet's
  engine), so keeping them on the node costs no copy of its own;
- ``meta`` names the slot of the newest complete commit, its serial (the job-wide
  number of the state, :attr:`State._serial`) and what a new process needs to take it
  (the layout: shapes, optimizer states, counters, the script's values). It is replaced
  (a rename) only after the commit's copies were waited for, and a commit only ever
  writes the slot ``meta`` does not name: a worker killed at any moment leaves the last
  complete commit readable.

After the restart every rank reads its node's ``meta``; :meth:`State.sync` takes the
freshest commit of the job from the rank that holds it (from memory, through the
backend), and a node without a copy (one that joined) gets it the same way.
"""
from __future__ import annotations

import glob
import mmap
import os
import pickle
import stat
from dataclasses import dataclass

import mxnet as mx
import numpy as np

ENV_DIR = "DG_STATE_DIR"
ENV_JOB = "DG_JOB_ID"
_META = "meta"
_VERSION = 1
_ALIGN = 64             # bytes: every array starts on a cache line


def _free_bytes(directory: str) -> int:
    """Bytes this user may still take in ``directory``'s file system."""
    info = os.statvfs(directory)
    return info.f_bavail * info.f_frsize


def _mib(size: int) -> str:
    return f"{size / 2**20:.1f} MiB"


class NodeCopyError(RuntimeError):
    """The node's copy cannot be used: a directory that is not the job's, or a copy
    another job wrote."""


@dataclass
class Held:
    """The newest complete commit in a node's copy."""

    serial: int
    slot: int
    file: str
    entries: dict       # key -> (offset in bytes, shape, dtype name)
    layout: dict        # State._layout() at that commit


class NodeCopy:
    """The copy of the State in the node's shared memory, in ``directory``, for job
    ``job``. Only the ``writer`` (the node's local rank 0) commits to it; every local
    rank reads it.

    Parameters
    ----------
    directory : str
        The node's directory for this job (``DG_STATE_DIR``); it must exist, be a
        directory of this user and let no one else in (mode 0700).
    job : str
        The job's id (``DG_JOB_ID``): a copy written by another job is refused.
    writer : bool
        Whether this process commits to the copy.
    """

    def __init__(self, directory: str, job: str, writer: bool):
        if not job:
            raise NodeCopyError("the node's state copy needs the job's id (DG_JOB_ID), set "
                                "by dist_gluon.launch; start the job with the launcher")
        try:
            info = os.stat(directory, follow_symlinks=False)
        except OSError as err:
            raise NodeCopyError(f"the node's state copy directory {directory!r} "
                                f"(DG_STATE_DIR) cannot be used: {err}; it is made by "
                                "dist_gluon.launch for each job") from err
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or \
                stat.S_IMODE(info.st_mode) & 0o077:
            raise NodeCopyError(f"{directory!r} (DG_STATE_DIR) is not a directory of this "
                                "user closed to others (mode 0700); the state of a job is "
                                "kept only in the directory its launcher made")
        self.directory, self.job, self.writer = directory, job, writer
        self._held = self._read()
        self._made = 0          # slot files this process made (their names count them)
        self._files: dict[int, tuple[str, dict]] = {}   # slot -> (file, entries), made here

    @classmethod
    def from_environment(cls, local_rank: int) -> NodeCopy | None:
        """The copy the launcher gave this worker (``DG_STATE_DIR``), or None."""
        directory = os.environ.get(ENV_DIR)
        if not directory:
            return None
        return cls(directory, os.environ.get(ENV_JOB, ""), writer=local_rank == 0)

    # ------------------------------------------------------------------ reading
    def held(self) -> Held | None:
        """The newest complete commit in the copy (None: nothing committed yet)."""
        return self._held

    def _read(self) -> Held | None:
        path = os.path.join(self.directory, _META)
        try:
            with open(path, "rb") as f:
                meta = pickle.load(f)
        except FileNotFoundError:
            return None
        if meta.get("version") != _VERSION:
            raise NodeCopyError(f"{path} was written by another version of dist_gluon")
        if meta["job"] != self.job:
            raise NodeCopyError(f"the state copy in {self.directory} belongs to job "
                                f"{meta['job']}, not to this job ({self.job}): a job only "
                                "takes its own state; start each job with its own launcher")
        return Held(meta["serial"], meta["slot"], meta["file"], meta["entries"],
                    meta["layout"])

    def arrays(self, held: Held) -> dict[tuple, mx.nd.NDArray]:
        """The arrays of ``held``, by key (MXNet arrays over the mapped slot file)."""
        return self._map(os.path.join(self.directory, held.file), held.entries)

    # ------------------------------------------------------------------ writing
    def allocate(self, keys: list[tuple], arrays: list[mx.nd.NDArray]
                 ) -> tuple[int, dict[tuple, mx.nd.NDArray]]:
        """A new slot file for one set of copies of ``arrays``: (the slot, the copies by
        key). It is the slot the copy's newest commit is not in; that slot's earlier
        files go."""
        slot = 0 if self._held is None else 1 - self._held.slot
        for old in glob.glob(os.path.join(self.directory, f"slot{slot}-*.bin")):
            os.unlink(old)
        entries, size = {}, 0
        for key, arr in zip(keys, arrays):
            dtype = np.dtype(arr.dtype)
            entries[key] = (size, tuple(arr.shape), dtype.name)
            size += -(-arr.size * dtype.itemsize // _ALIGN) * _ALIGN
        # the first commit checks room for both slots: the job fails at its start, not
        # at its second commit
        needed = size * (2 - len(set(self._files) - {slot}))
        free = _free_bytes(self.directory)
        if needed > free:
            raise NodeCopyError(self._no_room(size, needed, free))
        self._made += 1
        name = f"slot{slot}-{os.getpid()}-{self._made}.bin"
        path = os.path.join(self.directory, name)
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            # the pages are reserved now: a file only truncated to its size (a hole)
            # takes them as the commit's copies write, and a full /dev/shm then kills
            # the worker with SIGBUS inside one of MXNet's engine threads, wordlessly
            os.posix_fallocate(fd, 0, max(size, 1))
        except OSError as err:
            os.unlink(path)
            raise NodeCopyError(self._no_room(size, needed, _free_bytes(self.directory))
                                + f" ({err.strerror})") from err
        finally:
            os.close(fd)
        copies = self._map(os.path.join(self.directory, name), entries)
        self._files[slot] = (name, entries)
        return slot, copies

    def _no_room(self, size: int, needed: int, free: int) -> str:
        copies = "two copies" if needed > size else "a copy"
        return (f"the node's copy of the elastic State needs {_mib(needed)} in "
                f"{self.directory} ({copies} of {_mib(size)}: commits take turns in "
                f"two), but only {_mib(free)} are free there; give "
                "/dev/shm more room (a container's default is 64 MiB: docker run "
                "--shm-size, Kubernetes an emptyDir with medium: Memory) or make the "
                "model's state smaller")

    def publish(self, slot: int, serial: int, layout: dict) -> None:
        """The commit in ``slot`` is complete (its copies were waited for): name it in
        ``meta``, atomically."""
        name, entries = self._files[slot]
        held = Held(serial, slot, name, entries, layout)
        meta = {"version": _VERSION, "job": self.job, "serial": serial, "slot": slot,
                "file": name, "entries": entries, "layout": layout}
        path = os.path.join(self.directory, _META)
        tmp = f"{path}.{os.getpid()}"
        with open(tmp, "wb") as f:
            pickle.dump(meta, f, protocol=4)
        os.replace(tmp, path)
        self._held = held

    @staticmethod
    def _map(path: str, entries: dict) -> dict[tuple, mx.nd.NDArray]:
        with open(path, "r+b") as f:
            mapped = mmap.mmap(f.fileno(), 0)
        copies = {}
        for key, (offset, shape, dtype) in entries.items():
            count = int(np.prod(shape, dtype=np.int64))
            view = np.frombuffer(mapped, dtype=dtype, count=count, offset=offset)
            # an MXNet array over the mapped bytes (DLPack, no copy): the commit's
            # copies write the file on MXNet's engine
            copies[key] = mx.nd.from_numpy(view.reshape(shape), zero_copy=True)
        return copies
