"""A warm standby's program (``python -m dist_gluon._standby``, started by the
launcher: dist_gluon/launch/standby.py): import MXNet, NumPy and dist_gluon's API, wait
for a worker's command line, environment and directory on stdin, and run that script
in this process as ``python script.py`` or ``python -m module`` would."""
from __future__ import annotations

import json
import os
import sys

# what a worker run by a standby finds set: when (time.time()) it was handed its
# command, where a cold worker's clock starts at its process's start
ENV_HANDED = "DG_WARM_START"


def script_arguments(argv) -> list[str]:
    """What follows the interpreter in a worker's command line ``python [-u] ...``: the
    script and its arguments, or ``-m module ...`` (``-u``: the launcher's workers are
    unbuffered anyway)."""
    rest = list(argv[1:])
    return rest[1:] if rest[:1] == ["-u"] else rest


def _set_cmdline(argv: list[str]) -> None:
    """Show ``argv`` as this process's command line (ps, pkill -f): written over the
    room the launcher left in the original one (/proc/self/mem, this process's own)."""
    try:
        with open("/proc/self/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        # arg_start and arg_end: fields 48 and 49 of proc(5); the list starts at field 3
        start, end = int(fields[45]), int(fields[46])
        data = b"\0".join(a.encode("utf-8", "replace") for a in argv) + b"\0"
        room = end - start
        if len(data) > room:
            data = data[:room - 1] + b"\0"
        with open("/proc/self/mem", "r+b", buffering=0) as mem:
            mem.seek(start)
            mem.write(data + b"\0" * (room - len(data)))
    except (OSError, ValueError, IndexError):
        pass                    # only what ps shows


def _run(order: dict) -> None:
    import runpy

    argv = list(order["argv"])
    os.environ.clear()
    os.environ.update(order["env"])
    os.chdir(order["cwd"])
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)         # as a worker started by the launcher: stdin /dev/null
    os.close(devnull)
    sys.stdin = open(0, closefd=False)   # noqa: SIM115 (fd 0, the process's own)
    _set_cmdline(argv)
    rest = script_arguments(argv)
    if rest[0] == "-m":
        sys.argv = [rest[1], *rest[2:]]
        sys.path[0] = os.getcwd()
        runpy.run_module(rest[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(rest)
        sys.path[0] = os.path.dirname(os.path.abspath(rest[0]))
        runpy.run_path(rest[0], run_name="__main__")


def main() -> None:
    import mxnet  # noqa: F401
    import numpy  # noqa: F401

    import dist_gluon
    dist_gluon._load()
    import dist_gluon.elastic  # noqa: F401
    from dist_gluon import jobcontrol, timeline, worker

    # the worker's place is read at first use, after the hand-over; were it read
    # during the imports, it would be the standby's (no rank, no record)
    assert worker._context is None and not jobcontrol._attached \
        and not timeline._started, "dist_gluon read the worker's place at import"
    line = sys.stdin.buffer.readline()
    if not line:
        return                  # the launcher ended without needing this standby
    _run(json.loads(line))


if __name__ == "__main__":
    main()
