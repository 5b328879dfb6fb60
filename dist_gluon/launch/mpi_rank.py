"""One rank of a ``--transport mpi`` job: what mpirun starts, once per rank.

    mpirun ... python /path/to/dist_gluon/launch/mpi_rank.py COMMAND...

mpirun gives every process it starts its MPI rank (``OMPI_COMM_WORLD_RANK``, or
``PMIX_RANK``), not dist_gluon's variables, and keeps what the launcher needs for
itself: one output stream for all ranks, one exit status for the job. This shim bridges
that gap. It sets ``DG_RANK`` (= the MPI rank), ``DG_LOCAL_RANK``, ``DG_NODE_RANK`` and
``DG_CONTROL_DIR`` (its node launcher's job-control directory, so the rank finds the
record its launcher made for it), and runs COMMAND as its child with

- stdout and stderr on the named pipes ``rank<R>.out`` and ``rank<R>.err`` of that
  directory, which the node launcher relays with the ``[R]`` prefix;
- its pid written to ``rank<R>.pid`` once started, and ``pid status time`` to
  ``rank<R>.exit`` when it ended (status as ``Popen.returncode``: negative for a
  signal), because only a parent can read a process's exit status.

COMMAND is the process that calls ``MPI_Init`` (through ``hvd.init()``): the MPI rank.
It runs in its own session (the launcher signals its group) and is killed when this
shim dies; the shim forwards SIGTERM, SIGINT and SIGHUP to it, exits with its status
(128 + N for signal N), and ends it if mpirun goes away.

Run by path, so that it imports nothing but the standard library (not even dist_gluon).
"""
from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import signal
import subprocess
import sys
import time

_PR_SET_PDEATHSIG = 1
_FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def mpi_rank(environ=os.environ) -> int:
    """The MPI rank of this process."""
    for name in ("OMPI_COMM_WORLD_RANK", "PMIX_RANK"):
        if name in environ:
            return int(environ[name])
    raise SystemExit("mpi_rank.py: not started by mpirun (no OMPI_COMM_WORLD_RANK or "
                     "PMIX_RANK)")


def _write(path: str, text: str) -> None:
    """Write ``text`` to ``path`` at once (the launcher polls it)."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def _open_pipe(path: str):
    """The write end of the launcher's named pipe, or None (then output is inherited)."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
    except OSError as err:
        if err.errno in (errno.ENOENT, errno.ENXIO):     # no pipe, or nobody reading
            return None
        raise
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    return fd


def _die_with_parent():
    """In the child before exec: die with this shim."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass


def main(argv: list[str]) -> int:
    if not argv:
        raise SystemExit("usage: mpi_rank.py COMMAND...")
    rank = mpi_rank()
    env = dict(os.environ)
    # the launcher maps ranks by slot: node I holds ranks I*N .. I*N+N-1
    per_node = max(1, int(env.get("DG_NUM_WORKERS", "1")) // int(env.get("DG_NNODES", "1")))
    node, local_rank = divmod(rank, per_node)
    directory = env.get("DG_MPI_CONTROL", "").replace("{node}", str(node))
    directory = os.path.realpath(directory) if directory else ""
    env.update({"DG_RANK": str(rank), "DG_LOCAL_RANK": str(local_rank),
                "DG_NODE_RANK": str(node)})
    if directory:
        env["DG_CONTROL_DIR"] = directory
    env.pop("DG_MPI_CONTROL", None)

    def path(suffix: str) -> str:
        return os.path.join(directory, f"rank{rank}.{suffix}")

    streams = [_open_pipe(path(s)) if directory else None for s in ("out", "err")]
    try:
        child = subprocess.Popen(argv, env=env, stdout=streams[0], stderr=streams[1],
                                 start_new_session=True, preexec_fn=_die_with_parent)
    except OSError as err:
        message = f"cannot start {argv[0]!r}: {err}\n".encode()
        os.write(streams[1] if streams[1] is not None else 2, message)
        if directory:
            _write(path("exit"), f"0 127 {time.time()!r}\n")
        return 127
    finally:
        for fd in streams:
            if fd is not None:
                os.close(fd)
    if directory:
        _write(path("pid"), f"{child.pid}\n")

    def forward(signum, frame):
        try:
            os.killpg(child.pid, signum)
        except ProcessLookupError:
            pass

    for signum in _FORWARDED:
        signal.signal(signum, forward)
    parent = os.getppid()
    while True:
        try:
            status = child.wait(timeout=0.5)
            break
        except subprocess.TimeoutExpired:
            if os.getppid() != parent:      # mpirun (or its daemon) is gone
                forward(signal.SIGKILL, None)
    if directory:
        _write(path("exit"), f"{child.pid} {status} {time.time()!r}\n")
    return 128 - status if status < 0 else status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
