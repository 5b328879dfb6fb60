"""Warm standbys: a restarted worker that does not pay for a new interpreter and its
imports.

A restart (``--max-restarts``, or a re-formation of an elastic job on ps-lite, whose
workers restart on every change) starts every worker again, and each new interpreter
imports MXNet, NumPy and dist_gluon before the script does anything: 4 s of CPU here per
worker, more while the node is busy, the largest part of a ps-lite recovery. So a
launcher whose job may restart keeps, beside the workers of a running round, one standby
process per local worker, started once those workers have trained for a few seconds (not
to slow their start, nor a job that ends sooner): the standby imports ``mxnet``,
``numpy`` and dist_gluon's API, then waits on its stdin. When the next round starts a
worker, the launcher hands the standby the worker's command line, environment and
directory instead of starting a process, and the standby runs the script in itself, as
``python script.py`` or ``python -m module`` would (``__main__``, ``sys.argv``,
``sys.path[0]``); ``ps`` and ``pkill -f`` then show the worker's command line.

Only a command that runs this launcher's Python on a script or a module can be taken
over (``python train.py ...``, ``python -u train.py``, ``python -m pkg.train``); any
other command (a shell wrapper, ``python -c``, another interpreter), ``--transport mpi``
(mpirun starts the workers) and ``--no-warm-standby`` start workers as usual.

What the standby imported read its environment then, not the worker's: the node's
environment minus the launcher's per-round and per-rank variables, which MXNet, ps-lite,
horovod and dist_gluon all read later (``mx.kv.create``, ``hvd.init``, at first use;
MXNet's engine starts at the script's first operation, so ``MXNET_ENGINE_TYPE`` set in
the script works). Only what libraries read as they load (OpenMP's and OpenBLAS's thread
counts) keeps the launcher's value if the script sets it before its imports.

The standby's program is ``python -m dist_gluon._standby`` (it runs in the worker's
process, so outside launch/, which imports neither MXNet nor NumPy).
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

from .._standby import ENV_HANDED, script_arguments
from .processes import Process, terminate

# the backends' variables and the worker's place: the worker's own, set when it is
# handed over (DMLC_ROLE=server in a standby's environment would even start a ps-lite
# server inside `import mxnet`). The launcher's other DG_ variables stay: they are the
# same in every round and a site's start-up code may read them.
_PER_ROUND = ("DMLC_", "HOROVOD_", "PS_", "DG_RANK", "DG_LOCAL_RANK")
# seconds a round's workers train past their first collective before the standbys
# start: short jobs (tests, a failure at the start) never pay for the imports
WARM_AFTER = 3.0
# room for the worker's command line in the standby's own (ps, pkill -f)
_CMDLINE_ROOM = 4096
_PADDING = "--standby-room=" + "." * _CMDLINE_ROOM


def takes_over(command: list[str] | tuple[str, ...]) -> bool:
    """Whether a standby can run ``command``: this launcher's Python on a script file
    (after at most ``-u``) or on ``-m module``."""
    if len(command) < 2 or not _same_python(command[0]):
        return False
    rest = script_arguments(command)
    if not rest:
        return False
    if rest[0] == "-m":
        return len(rest) > 1
    return not rest[0].startswith("-") and os.path.isfile(rest[0])


def _same_python(program: str) -> bool:
    found = shutil.which(program) if os.sep not in program else program
    if not found:
        return False
    try:
        return os.path.samefile(found, sys.executable)
    except OSError:
        return False


def standby_environment(base: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in base.items() if not k.startswith(_PER_ROUND)}


class Standbys:
    """This launcher's idle standby processes, kept across rounds (the launcher's
    whole life: they die with it)."""

    def __init__(self):
        self.idle: list[Process] = []
        self.taken = 0          # workers a standby became

    def fill(self, count: int, base: dict[str, str]) -> None:
        """Have ``count`` live standbys, starting the missing ones."""
        self.idle = [p for p in self.idle if p.returncode is None]
        env = standby_environment(base)
        argv = [sys.executable, "-m", "dist_gluon._standby", _PADDING]
        while len(self.idle) < count:
            try:
                p = Process("standby", "standby", None, argv, env, stdin=subprocess.PIPE)
            except OSError:
                return          # the worker starts cold, as without a standby
            self.idle.append(p)

    def take(self, label: str, rank: int, argv: list[str],
             env: dict[str, str]) -> Process | None:
        """A live standby running ``argv`` as the worker of ``rank`` (label ``label``),
        or None: start the worker as usual."""
        while self.idle:
            p = self.idle.pop(0)
            if p.returncode is not None:
                continue
            order = {"argv": argv, "env": dict(env, **{ENV_HANDED: repr(time.time())}),
                     "cwd": os.getcwd()}
            try:
                p.popen.stdin.write(json.dumps(order).encode("utf-8") + b"\n")
                p.popen.stdin.close()
            except OSError:
                terminate([p], 0.5)     # it died meanwhile: the next one, or cold
                continue
            p.label, p.role, p.rank = label, "worker", rank
            p.elastic = env.get("DG_ELASTIC") == "1"
            p.tail.clear()
            self.taken += 1
            return p
        return None

    def close(self) -> None:
        terminate(self.idle, 0.5)
        self.idle = []


_POOL: Standbys | None = None


def pool() -> Standbys:
    """This launcher's standbys (one set per launcher process)."""
    global _POOL
    if _POOL is None:
        _POOL = Standbys()
    return _POOL
