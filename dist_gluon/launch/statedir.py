"""The node's directory for its workers' copy of the job's state in shared memory
(dist_gluon/elastic/nodecopy.py): where restarted ps-lite workers take their state
from, instead of a checkpoint.

One per launcher process and job, made at the job's first elastic round and removed
when the launcher exits (:func:`remove`). Its name says the job, the node and the
launcher's process (with the process's start time): two jobs, or two launchers of one
host, never share one. A launcher that was killed cannot remove its own: the next
launcher that makes one on the host removes the directories whose launcher is gone
(:func:`_remove_orphans`); the job-control records' directories likewise
(:func:`remove_orphan_controls`). Mode 0700, as the job's control records.

A launcher proves it is alive by a lock it holds for its lifetime (``flock`` on the
file ``LOCK`` in each of its directories; the kernel drops it when the process ends,
however it ends), not by its pid: launchers in containers with their own pid
namespaces may share one /dev/shm, where a pid says nothing about the other
namespace's processes, and each would take the other's live directories for orphans.
A directory is made under a hidden name, locked, then renamed into place, so no other
launcher ever sees it unlocked. Only a directory without ``LOCK`` (an older launcher's)
is judged by its pid and start time.
"""
from __future__ import annotations

import fcntl
import glob
import os
import re
import shutil
import tempfile

ROOT = "/dev/shm"
# what the workers are told (dist_gluon/elastic/nodecopy.py reads them)
ENV_DIR, ENV_JOB = "DG_STATE_DIR", "DG_JOB_ID"
_PREFIX = "dg-state-"
_NAME = re.compile(_PREFIX + r"[0-9a-f]+-node\d+-(\d+)-(\d+)$")
# the job-control records' directories (launch/node.py): one per round of a launcher
CONTROL_PREFIX = "dg-control-"
_CONTROL_NAME = re.compile(CONTROL_PREFIX + r"(\d+)-(\d+)-\w+$")
_made: str | None = None
LOCK = "LOCK"
# the open lock files of this launcher's directories: held until the process ends
_locks: dict[str, int] = {}


def _start_time(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks since boot), or None if it is gone
    (a zombie, killed and not yet reaped, is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()
        if fields[0] in ("Z", "X"):
            return None
        return int(fields[19])      # field 22 of proc(5); the split starts at field 3
    except (OSError, IndexError, ValueError):
        return None


def for_job(job: str, node_rank: int) -> str:
    """The directory of this launcher's node for ``job``: made at the first call."""
    global _made
    if _made is None:
        root = ROOT if os.path.isdir(ROOT) else os.environ.get("TMPDIR", "/tmp")
        _remove_orphans(root)
        pid = os.getpid()
        _made = _make_locked(root, f"{_PREFIX}{job}-node{node_rank}-{pid}-{_start_time(pid)}")
    return _made


def _make_locked(root: str, name: str) -> str:
    """Make ``root/name`` (mode 0700) holding this launcher's lock: made hidden, locked,
    then renamed, so that no launcher's orphan sweep sees it unlocked."""
    hidden = tempfile.mkdtemp(prefix=".dg-making-", dir=root)
    fd = os.open(os.path.join(hidden, LOCK), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    path = os.path.join(root, name)
    os.rename(hidden, path)
    _locks[path] = fd
    return path


def make_control_dir(root: str) -> str:
    """A new job-control directory of this launcher in ``root``, holding its lock."""
    suffix = os.urandom(4).hex()
    return _make_locked(root, control_prefix() + suffix)


def remove_dir(path: str) -> None:
    """Remove one of this launcher's directories and let its lock go."""
    shutil.rmtree(path, ignore_errors=True)
    fd = _locks.pop(path, None)
    if fd is not None:
        os.close(fd)


def remove() -> None:
    """Remove this launcher's directory (the launcher is exiting: its workers ended)."""
    global _made
    if _made is not None:
        remove_dir(_made)
        _made = None


def control_prefix() -> str:
    """The name's start of this launcher's job-control directories: it says the
    launcher's process (pid and start time), so that the next launcher of the host can
    tell them from a live launcher's once this one was killed (:func:`remove_orphan_controls`)."""
    pid = os.getpid()
    return f"{CONTROL_PREFIX}{pid}-{_start_time(pid)}-"


def remove_orphan_controls(root: str) -> None:
    """Remove this user's job-control directories whose launcher is gone (killed: a
    launcher that exits removes its own)."""
    _remove_orphans(root, CONTROL_PREFIX, _CONTROL_NAME)


def _remove_orphans(root: str, prefix: str = _PREFIX, name: re.Pattern = _NAME) -> None:
    """Remove this user's directories of ``prefix`` whose launcher is gone."""
    for path in glob.glob(os.path.join(root, prefix + "*")):
        match = name.search(os.path.basename(path))
        try:
            mine = os.stat(path).st_uid == os.getuid()
        except OSError:
            continue
        if match and mine and path not in _locks and not _alive(path, match):
            shutil.rmtree(path, ignore_errors=True)


def _alive(path: str, match: re.Match) -> bool:
    """Whether the launcher of directory ``path`` is alive: it holds the lock of
    ``path/LOCK`` (whatever its pid namespace); an older launcher's directory without
    one, by its pid and start time in the name."""
    try:
        fd = os.open(os.path.join(path, LOCK), os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        return os.path.exists(path) and _start_time(int(match[1])) == int(match[2])
    except OSError:
        return True     # cannot tell: never remove a directory that may be live
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)    # the lock taken, if any, goes with it
    return False
