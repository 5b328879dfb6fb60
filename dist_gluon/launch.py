"""One launcher for every backend.

    python -m dist_gluon.launch -n 2 --backend horovod -- python train.py --epochs 3
    dist-gluon-run -n 4 --backend dist_sync --servers 2 -- python train.py

horovod starts N workers of a Gloo job on this host (``-H host:slots,...`` hands the job
to horovodrun for several machines). dist_sync and p3 start a ps-lite job on loopback:
1 scheduler, S servers and N workers. Every line a process prints is prefixed with its
rank (``[0]``, ``[1]``, ``[server0]``, ``[scheduler]``). The job fails as a whole: when
any process exits non-zero or dies by a signal, every other process of the job is
terminated, the launcher names the failed rank, how it ended and the last lines of its
stderr, and exits non-zero. ``--max-restarts`` restarts the whole job after a failure;
``--timeout`` bounds it.
"""
from __future__ import annotations

import argparse
import collections
import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

BACKENDS = ("horovod", "dist_sync", "p3")
_TAIL_LINES = 20
_TERM_GRACE = 3.0          # seconds between SIGTERM and SIGKILL
_SERVICE_GRACE = 10.0      # seconds scheduler/servers get to exit after the workers


def _parse_args(argv):
    parser = argparse.ArgumentParser(
        prog="python -m dist_gluon.launch",
        description="Run COMMAND as N data-parallel workers of a dist_gluon job.",
        epilog="example: python -m dist_gluon.launch -n 2 --backend dist_sync -- "
               "python train.py --epochs 3")
    parser.add_argument("-n", "--num-workers", type=int, required=True,
                        help="number of worker processes (>= 1)")
    parser.add_argument("--backend", default="horovod", choices=BACKENDS,
                        help="communication backend (default: horovod)")
    parser.add_argument("--servers", type=int, default=1,
                        help="ps-lite servers for dist_sync and p3 (default: 1)")
    parser.add_argument("-H", "--hosts", default=None,
                        help="horovod only: host:slots,... for several machines; the job "
                             "is handed to horovodrun")
    parser.add_argument("--timeout", type=float, default=None,
                        help="seconds the whole job may run; then everything is "
                             "terminated and the launcher exits non-zero")
    parser.add_argument("--max-restarts", type=int, default=0,
                        help="restart the whole job up to R times after a worker fails "
                             "(scripts resume from their last checkpoint)")
    parser.add_argument("command", nargs=argparse.REMAINDER,
                        help="the worker command, after --")
    args = parser.parse_args(argv)
    if args.command and args.command[0] == "--":
        args.command = args.command[1:]
    if args.num_workers < 1:
        parser.error(f"-n must be at least 1, got {args.num_workers}")
    if args.servers < 1:
        parser.error(f"--servers must be at least 1, got {args.servers}")
    if args.max_restarts < 0:
        parser.error(f"--max-restarts must be >= 0, got {args.max_restarts}")
    if args.timeout is not None and args.timeout <= 0:
        parser.error(f"--timeout must be positive, got {args.timeout}")
    if args.hosts and args.backend != "horovod":
        parser.error("-H/--hosts is for --backend horovod; for ps-lite on several "
                     "machines see README.md")
    if not args.command:
        parser.error("no command given: put the worker command after --, e.g. "
                     "-- python train.py")
    return args


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


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


class _Process:
    """One process of the job, its output relay and the tail of its stderr."""

    def __init__(self, label: str, role: str, rank: int | None, argv, env, out_lock):
        self.label, self.role, self.rank = label, role, rank
        self.tail = collections.deque(maxlen=_TAIL_LINES)
        self.ended_at: float | None = None
        self._lock = out_lock
        self.popen = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      preexec_fn=_die_with_parent)
        self.pgid = self.popen.pid
        self._relays = [
            threading.Thread(target=self._relay, args=(self.popen.stdout, sys.stdout, False),
                             daemon=True),
            threading.Thread(target=self._relay, args=(self.popen.stderr, sys.stderr, True),
                             daemon=True),
        ]
        for t in self._relays:
            t.start()
        threading.Thread(target=self._wait, daemon=True).start()

    def _relay(self, pipe, sink, keep_tail):
        prefix = f"[{self.label}] "
        for raw in iter(pipe.readline, b""):
            line = raw.decode("utf-8", "replace").rstrip("\n")
            if keep_tail:
                self.tail.append(line)
            with self._lock:
                sink.write(prefix + line + "\n")
                sink.flush()
        pipe.close()

    def _wait(self):
        self.popen.wait()
        self.ended_at = time.monotonic()

    @property
    def returncode(self):
        return self.popen.returncode if self.ended_at is not None else None

    def signal_group(self, sig):
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

    def flush_output(self, timeout=2.0):
        for t in self._relays:
            t.join(timeout)

    def describe_end(self) -> str:
        code = self.popen.returncode
        if code is None:
            return "still running"
        if code < 0:
            try:
                name = signal.Signals(-code).name
            except ValueError:
                name = f"signal {-code}"
            return f"killed by {name}"
        return f"exit code {code}"


class _Interrupted(Exception):
    def __init__(self, signum):
        self.signum = signum


class _Job:
    """All processes of one run of the job."""

    def __init__(self, args, restart: int):
        self.args = args
        self.restart = restart
        self.processes: list[_Process] = []
        self._gloo = None
        self._out_lock = threading.Lock()

    def start(self):
        args = self.args
        base = dict(os.environ)
        base.setdefault("PYTHONUNBUFFERED", "1")
        base.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // args.num_workers)))
        base.update({"DG_NUM_WORKERS": str(args.num_workers), "DG_BACKEND": args.backend,
                     "DG_RESTART": str(self.restart)})
        if args.backend == "horovod":
            from .backends.horovod import GlooJob
            self._gloo = GlooJob(args.num_workers)
            for rank in range(args.num_workers):
                env = dict(base, DG_RANK=str(rank), DG_LOCAL_RANK=str(rank))
                env.update(self._gloo.worker_env(rank))
                self._spawn(str(rank), "worker", rank, args.command, env)
        else:
            from .backends import pslite
            common = dict(base)
            common.update(pslite.job_env(args.num_workers, args.servers, _free_port(),
                                         p3=args.backend == "p3"))
            service = [sys.executable, "-c", "import mxnet"]
            self._spawn("scheduler", "scheduler", None, service,
                        dict(common, **pslite.role_env("scheduler")))
            for s in range(args.servers):
                self._spawn(f"server{s}", "server", None, service,
                            dict(common, **pslite.role_env("server")))
            for rank in range(args.num_workers):
                env = dict(common, DG_RANK=str(rank), DG_LOCAL_RANK=str(rank))
                env.update(pslite.role_env("worker"))
                self._spawn(str(rank), "worker", rank, args.command, env)

    def _spawn(self, label, role, rank, argv, env):
        try:
            self.processes.append(_Process(label, role, rank, argv, env, self._out_lock))
        except OSError as err:
            raise SystemExit(f"dist_gluon.launch: cannot start {argv[0]!r}: {err}") from err

    @property
    def workers(self):
        return [p for p in self.processes if p.role == "worker"]

    def run(self, deadline: float | None) -> int:
        """Wait for the job; returns the launcher's exit status."""
        services_done_by = None
        while True:
            failed = self._first_failure()
            if failed is not None:
                self.terminate()
                self._report_failure(failed)
                return failed.popen.returncode if failed.popen.returncode > 0 \
                    else 128 + (-failed.popen.returncode)
            if all(p.returncode == 0 for p in self.workers):
                services_done_by = services_done_by or time.monotonic() + _SERVICE_GRACE
                if all(p.returncode is not None for p in self.processes) \
                        or time.monotonic() > services_done_by:
                    self.terminate()
                    return 0
            if deadline is not None and time.monotonic() > deadline:
                running = [p.label for p in self.workers if p.returncode is None]
                self.terminate()
                self._say(f"timeout after {self.args.timeout:g} s; terminated the job. "
                          f"Ranks still running: {', '.join(running) or 'none'}")
                return 124
            time.sleep(0.05)

    def _first_failure(self):
        """The process that failed first: a worker that did not exit 0, or a scheduler or
        server that failed while workers still needed it (they exit 0 once the workers
        have finalised)."""
        workers_running = any(p.returncode is None for p in self.workers)
        ended = [p for p in self.processes if p.returncode is not None and (
            p.returncode != 0 and (p.role == "worker" or workers_running))]
        return min(ended, key=lambda p: p.ended_at) if ended else None

    def terminate(self):
        """SIGTERM every process group of the job, then SIGKILL what is left."""
        for p in self.processes:
            p.signal_group(signal.SIGTERM)
        limit = time.monotonic() + _TERM_GRACE
        while time.monotonic() < limit and any(p.group_alive() for p in self.processes):
            time.sleep(0.05)
        for p in self.processes:
            if p.group_alive():
                p.signal_group(signal.SIGKILL)
        for p in self.processes:
            try:
                p.popen.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
            p.flush_output()
        if self._gloo is not None:
            self._gloo.close()
            self._gloo = None

    def _report_failure(self, p):
        who = f"rank {p.rank}" if p.role == "worker" else p.label
        lines = [f"{who} failed ({p.describe_end()}); terminated the rest of the job."]
        if p.tail:
            lines.append(f"last lines of {who}'s stderr:")
            lines.extend(f"    {line}" for line in p.tail)
        else:
            lines.append(f"{who} wrote nothing to stderr.")
        self._say("\n".join(lines))

    def _say(self, text):
        with self._out_lock:
            sys.stderr.write("".join(f"dist_gluon.launch: {line}\n"
                                     for line in text.splitlines()))
            sys.stderr.flush()


def _run_horovodrun(args) -> int:
    """Several machines: horovodrun owns ssh, rendezvous and output."""
    exe = shutil.which("horovodrun")
    if exe is None:
        print("dist_gluon.launch: -H needs horovodrun on PATH; run `make setup`",
              file=sys.stderr)
        return 2
    argv = [exe, "-np", str(args.num_workers), "-H", args.hosts, "--gloo"] + args.command
    return subprocess.call(argv)


def main(argv=None) -> int:
    args = _parse_args(sys.argv[1:] if argv is None else argv)
    if args.hosts:
        return _run_horovodrun(args)

    def on_signal(signum, frame):
        raise _Interrupted(signum)

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    deadline = None if args.timeout is None else time.monotonic() + args.timeout
    try:
        for restart in range(args.max_restarts + 1):
            job = _Job(args, restart)
            try:
                job.start()
                status = job.run(deadline)
            except _Interrupted as stop:
                job.terminate()
                job._say(f"interrupted by {signal.Signals(stop.signum).name}; "
                         "terminated the job")
                return 128 + stop.signum
            except BaseException:
                job.terminate()
                raise
            if status in (0, 124) or restart == args.max_restarts:
                return status
            job._say(f"restarting the job ({restart + 1} of {args.max_restarts})")
        return status
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


if __name__ == "__main__":
    sys.exit(main())
