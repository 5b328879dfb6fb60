"""One process of a job: started in its own session, dies with the launcher, and has
every line it prints relayed with its label as a prefix (``[0]``, ``[server1]``)."""
from __future__ import annotations

import collections
import ctypes
import os
import re
import signal
import subprocess
import threading
import time

from . import output

TAIL_LINES = 20
# what horovod prints on every survivor when a peer of its Gloo ring is gone (its
# background thread's error): in an elastic job, the lost peer seen from this side
_LOST_PEER = re.compile(r"Horovod background loop uncaught exception.*gloo.*"
                        r"(Connection reset by peer|Connection closed by peer|"
                        r"Read error|Write error|Broken pipe|Timed out)", re.IGNORECASE)
EXPECTED = ("dist_gluon: expected: the horovod error above is this worker seeing a peer "
            "that was lost; the elastic job re-forms (from the workers' memory under "
            "dist_gluon.elastic.run), as the launcher says")

try:
    _prctl = ctypes.CDLL(None, use_errno=True).prctl
except (OSError, AttributeError):
    _prctl = None
_PR_SET_PDEATHSIG = 1


def _die_with_parent():
    """Runs in the child between fork and exec (so it only makes system calls): a new
    session, so the job can be signalled as a group, and death with the launcher."""
    os.setsid()
    if _prctl is not None:
        _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


class Process:
    """A child process, its output relay and the tail of its stderr."""

    def __init__(self, label: str, role: str, rank: int | None, argv, env,
                 stdin=subprocess.DEVNULL):
        self.label, self.role, self.rank = label, role, rank
        self.local_rank: int | None = None      # a worker's, on its node
        self.tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        # an elastic job's workers expect to lose peers (see _LOST_PEER)
        # (env None: the launcher's own environment, as for ssh's remote launchers)
        self.elastic = (os.environ if env is None else env).get("DG_ELASTIC") == "1"
        self.ended_at: float | None = None      # time.time() when it ended
        self.popen = subprocess.Popen(argv, env=env, stdin=stdin,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      preexec_fn=_die_with_parent)
        self.pgid = self.popen.pid
        self._relays = [
            threading.Thread(target=self._relay, args=(self.popen.stdout, False, False),
                             daemon=True),
            threading.Thread(target=self._relay, args=(self.popen.stderr, True, True),
                             daemon=True),
        ]
        for t in self._relays:
            t.start()
        threading.Thread(target=self._wait, daemon=True).start()

    def _relay(self, pipe, to_stderr: bool, keep_tail: bool):
        for raw in iter(pipe.readline, b""):
            line = raw.decode("utf-8", "replace").rstrip("\n")
            if keep_tail:
                self.tail.append(line)
            # read per line: a worker kept through a re-formation takes its new rank
            prefix = f"[{self.label}] " if self.label else ""
            output.emit(prefix + line + "\n", to_stderr)
            if self.elastic and _LOST_PEER.search(line):
                output.emit(prefix + EXPECTED + "\n", to_stderr)
        pipe.close()

    def _wait(self):
        self.popen.wait()
        self.ended_at = time.time()

    @property
    def returncode(self) -> int | None:
        return self.popen.returncode if self.ended_at is not None else None

    def signal_group(self, sig) -> None:
        try:
            os.killpg(self.pgid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def group_alive(self) -> bool:
        try:
            os.killpg(self.pgid, 0)
            return True
        except (ProcessLookupError, PermissionError):
            return False

    def flush_output(self, timeout: float = 2.0) -> None:
        for t in self._relays:
            t.join(timeout)


TERM_GRACE = 3.0        # seconds from SIGTERM to SIGKILL


def terminate(processes: list[Process], grace: float = TERM_GRACE) -> None:
    """SIGTERM every process group, then SIGKILL what is left after ``grace`` s."""
    for p in processes:
        p.signal_group(signal.SIGTERM)
    limit = time.monotonic() + grace
    # a short poll: a re-formation waits here on node 0, then on every other node
    while time.monotonic() < limit and any(p.group_alive() for p in processes):
        time.sleep(0.01)
    for p in processes:
        if p.group_alive():
            p.signal_group(signal.SIGKILL)
    for p in processes:
        try:
            p.popen.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        p.flush_output()
