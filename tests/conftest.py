"""Shared helpers: distributed tests run their worker script through the real launcher."""
from __future__ import annotations

import collections
import os
import shutil
import socket
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
DISTRIBUTED_BACKENDS = ("horovod", "dist_sync", "p3")
# The backends whose code differs above the collectives: horovod and ps-lite's
# dist_sync. P3 runs dist_sync's code (dist_gluon/backends/pslite.py) over another van,
# which slices large tensors itself and sends by priority; so P3 keeps the checks of the
# collectives (test_backends.py), of keys in flight together (test_backend_sharing.py),
# of the trainer's exact training step (test_trainer.py), of compression, of threads and
# of part of the fault matrix, and behaviours built on those run on these two.
TRAINING_BACKENDS = ("horovod", "dist_sync")
# PYTHONPATH of the processes the tests start: the checkout, after tests/lean, whose
# sitecustomize makes their start cheap (tests/lean/sitecustomize.py: it hides SciPy and
# OpenCV, except from the scripts that run gluoncv, and MXNet makes its operator
# functions on first use).
WORKER_PYTHONPATH = os.pathsep.join([str(REPO / "tests" / "lean"), str(REPO)])


def process_env(gluoncv: bool = False, **extra: str) -> dict[str, str]:
    """The environment of a process a test starts: this one's, OMP_NUM_THREADS=1, the
    checkout on PYTHONPATH after tests/lean, SciPy and OpenCV hidden unless it runs
    gluoncv (which needs them), and ``extra``."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=WORKER_PYTHONPATH, **extra)
    if gluoncv:
        env["DG_TESTS_WITH_SCIPY"] = "1"
    return env


def launch(script: str, tmp_path: Path, backend: str = "horovod", n: int = 2,
           args=(), launcher_args=(), timeout: float = 180, env=None,
           name: str = "worker.py") -> subprocess.CompletedProcess:
    """Write ``script`` to tmp_path and run it as ``n`` workers through
    ``python -m dist_gluon.launch``. Workers get OMP_NUM_THREADS=1 and run with
    tmp_path as their working directory. Returns the finished launcher process
    (stdout and stderr as text)."""
    path = tmp_path / name
    path.write_text(textwrap.dedent(script))
    full_env = process_env(**(env or {}))
    argv = [sys.executable, "-m", "dist_gluon.launch", "-n", str(n), "--backend", backend,
            *launcher_args, "--", sys.executable, str(path), *args]
    return subprocess.run(argv, cwd=tmp_path, env=full_env, capture_output=True, text=True,
                          timeout=timeout)


def read_pipes(proc: subprocess.Popen) -> tuple[list[str], list[str], list[threading.Thread]]:
    """Read ``proc``'s stdout and stderr (text) into two lists of lines as they come, one
    thread per pipe (nothing else may read them): (stdout lines, stderr lines, the
    started threads, to join once the process ended)."""
    out: list[str] = []
    err: list[str] = []
    readers = [threading.Thread(target=lambda: out.extend(proc.stdout)),
               threading.Thread(target=lambda: err.extend(proc.stderr))]
    for reader in readers:
        reader.start()
    return out, err, readers


def child_with(parent: int, needle: bytes) -> int | None:
    """The pid of ``parent``'s child process whose environment holds the variable
    ``needle`` (e.g. ``b"DG_RANK=1"``), or None."""
    children = subprocess.run(["pgrep", "-P", str(parent)], capture_output=True,
                              text=True).stdout.split()
    for pid in children:
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    return int(pid)
        except OSError:
            continue
    return None


def cannot_reset_connections() -> str | None:
    """Why this machine cannot reset a TCP connection from outside its processes
    (``ss -K``: root, and a kernel with INET_DIAG_DESTROY), or None."""
    if os.geteuid() != 0:
        return "resetting a worker's connections (ss -K) needs root"
    if shutil.which("ss") is None:
        return "resetting a worker's connections needs ss (iproute2; make setup installs it)"
    with socket.create_server(("127.0.0.1", 0)) as server, \
            socket.create_connection(server.getsockname()) as client:
        peer, _ = server.accept()
        with peer:
            port = client.getsockname()[1]
            subprocess.run(["ss", "-K", "-tn", "state", "established",
                            f"( sport = :{port} )"], capture_output=True)
            client.settimeout(2)
            try:
                client.recv(1)
            except OSError:
                return None             # aborted: the reset works
    return "this kernel cannot reset a connection from outside (ss -K: INET_DIAG_DESTROY)"


def reset_connections(pid: int, namespace: str | None = None) -> None:
    """Reset every established TCP connection of process ``pid`` (``ss -K``, as a network
    fault would: the process goes on), in network namespace ``namespace`` if given."""
    where = ["ip", "netns", "exec", namespace] if namespace else []
    listing = subprocess.run([*where, "ss", "-tnpH", "state", "established"],
                             capture_output=True, text=True, check=True).stdout
    ports = [line.split()[2].rsplit(":", 1)[1] for line in listing.splitlines()
             if f"pid={pid}," in line]
    assert ports, f"pid {pid} has no TCP connection to reset:\n{listing}"
    for port in ports:
        subprocess.run([*where, "ss", "-K", "-tn", "state", "established",
                        f"( sport = :{port} )"], capture_output=True, check=True)


def host_env() -> dict[str, str]:
    """The bare environment of a process a test starts on an emulated host, as a fresh
    login would have it (the system's PATH, WORKER_PYTHONPATH), plus make
    coverage's variables while it measures, so that those processes are counted too."""
    env = {"PATH": "/usr/bin:/bin:/usr/sbin:/sbin", "PYTHONPATH": WORKER_PYTHONPATH}
    env.update({name: os.environ[name] for name in ("COVERAGE_PROCESS_START", "COVERAGE_FILE")
                if name in os.environ})
    return env


def worker_lines(output: str, rank: int) -> list[str]:
    """The lines worker ``rank`` printed, without the launcher's ``[rank] `` prefix."""
    prefix = f"[{rank}] "
    return [line[len(prefix):] for line in output.splitlines() if line.startswith(prefix)]


def assert_ok(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, (f"job failed with {proc.returncode}\n--- stdout\n"
                                  f"{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-4000:]}")


@pytest.fixture(params=DISTRIBUTED_BACKENDS)
def backend(request) -> str:
    return request.param


def run(argv, cwd, timeout: float = 240, gluoncv: bool = False) -> subprocess.CompletedProcess:
    """Run ``argv`` (a plain process or a launcher command line) with the test
    environment: OMP_NUM_THREADS=1 and the checkout on PYTHONPATH; SciPy and OpenCV
    hidden unless the script runs ``gluoncv``, which needs them."""
    return subprocess.run(argv, cwd=cwd, env=process_env(gluoncv), capture_output=True,
                          text=True, timeout=timeout)


def launcher(backend: str, script, *args, n: int = 2) -> list[str]:
    """The launcher command line that runs ``script`` as ``n`` workers on ``backend``."""
    return [sys.executable, "-m", "dist_gluon.launch", "-n", str(n), "--backend", backend,
            "--", sys.executable, str(script), *map(str, args)]


# ``make test-fast`` runs ``pytest -m "not slow"``: the tests that start no MXNet process
# of their own (unit tests, the launcher's own processes) and the tests that read the
# shared horovod job of their module (one launched job that many tests check). Every
# process that imports MXNet costs about 4 s of CPU here, so that is what the fast tier
# leaves out. A test is slow when it is marked slow or ``spawns`` (it starts a job or a
# training process of its own), when it runs on the other backends or transports
# (dist_sync, p3, horovod over MPI: parameters of the test or of its fixtures), or when
# its whole file needs emulated hosts, an example's training run or fresh virtual
# environments.
_SLOW_FILES = {"test_multinode.py", "test_emulated_cluster.py", "test_mpi.py",
               "test_packaging.py", "test_examples.py", "test_pslite_job.py",
               "test_async.py", "test_server_hosts.py", "test_node0_loss.py",
               "test_elastic_memory.py"}
_SLOW_PARAMETERS = {"dist_sync", "p3", "mpi", "dist_async"}


def _slow_parameter(value) -> bool:
    if isinstance(value, (tuple, list)):
        return any(_slow_parameter(v) for v in value)
    return isinstance(value, str) and value in _SLOW_PARAMETERS


# ``make test`` runs three pytest processes side by side (pytest-xdist, ``--dist
# loadgroup``): the suite's jobs spend a third of their time waiting (for a silence
# limit, a stall report, a rate-limited link), so one alone leaves a core idle. Each test
# file is one group, run whole by one of them, so that a module's shared job is launched
# once; the files that build emulated hosts are one group together, since they share
# the machine's namespaces, bridges and the ports they give the launchers.
_HOST_FILES = {"test_multinode.py", "test_emulated_cluster.py", "test_mpi.py",
               "test_elastic.py", "test_node0_loss.py", "test_output.py",
               "test_server_hosts.py", "test_elastic_memory.py"}


# The groups handed out first, the longest first (the seconds per file that every run
# prints at its end, 2026-11-26): the processes end together when no long group is
# left for the end. The other groups follow, those with the most tests first (what
# pytest-xdist itself would do with them).
_LONG_GROUPS = ("hosts", "test_examples.py", "test_compat.py", "test_faults.py",
                "test_syncbn.py", "test_async.py", "test_threads.py")


def _group(item) -> str:
    name = item.path.name
    return "hosts" if name in _HOST_FILES else name


def pytest_configure(config):
    # the order of the groups is the one pytest_collection_modifyitems gives the tests
    config.option.loadscopereorder = False


# tryfirst: pytest-xdist's own hook reads the groups from these marks, so they must be
# there before it runs.
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    for item in items:
        name = item.path.name
        item.add_marker(pytest.mark.xdist_group(_group(item)))
        callspec = getattr(item, "callspec", None)
        if name in _SLOW_FILES or item.get_closest_marker("spawns") or (
                callspec is not None and any(
                    _slow_parameter(v) for v in callspec.params.values())):
            item.add_marker(pytest.mark.slow)
    sizes = collections.Counter(_group(item) for item in items)

    def rank(item):
        group = _group(item)
        if group in _LONG_GROUPS:
            return (0, _LONG_GROUPS.index(group), "")
        return (1, -sizes[group], group)
    items.sort(key=rank)        # stable: each group's tests keep their order


def pytest_collection_finish(session):
    """In a pytest-xdist process of ``--dist loadgroup``, every test must carry its group
    in its id: otherwise the tests of one file are spread over the processes and each
    launches the file's shared jobs again (as with pytest 9 and pytest-xdist 3.8, whose
    renaming pytest 9 ignores), silently doubling the suite's slowest parts."""
    config = session.config
    if not (hasattr(config, "workerinput") and config.getvalue("loadgroup")):
        return
    ungrouped = [item.nodeid for item in session.items if "@" not in item.nodeid]
    if ungrouped:
        raise pytest.UsageError(
            f"pytest-xdist's --dist loadgroup did not group {len(ungrouped)} tests (e.g. "
            f"{ungrouped[0]}; pytest {pytest.__version__}): install the versions "
            "constraints.txt pins (make setup does), or run with TEST_PROCESSES=1")


_FILE_SECONDS: dict[str, float] = {}


def pytest_runtest_logreport(report):
    """Add up each test file's time (setup, call and teardown): where the suite's
    minutes go, printed at the end of every run."""
    path = report.nodeid.split("::", 1)[0]
    _FILE_SECONDS[path] = _FILE_SECONDS.get(path, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter):
    if len(_FILE_SECONDS) < 2:
        return
    total = sum(_FILE_SECONDS.values())
    terminalreporter.section("seconds per test file (setup, call and teardown)")
    for path, seconds in sorted(_FILE_SECONDS.items(), key=lambda kv: -kv[1])[:25]:
        terminalreporter.write_line(f"{seconds:8.1f} s {100 * seconds / total:5.1f}%  {path}")
    terminalreporter.write_line(f"{total:8.1f} s in all")


# Where the machine can make emulated hosts (root, network namespaces: ``make test`` sets
# DG_REQUIRE_EMULATED_HOSTS=1 when root), the suites that need them (elastic, partitions,
# memory mode, timeline across hosts, MPI across hosts...) must run: a skip there would
# let a broken tools/emulated_cluster.py, or a missing sshd, pass the suite silently.
# Such a skip becomes a failure that gives the skip's reason. A suite needs emulated
# hosts when it uses tools/emulated_cluster.py.
REQUIRE_EMULATED_HOSTS = "DG_REQUIRE_EMULATED_HOSTS"


def _needs_emulated_hosts(path: Path) -> bool:
    try:
        return "emulated_cluster" in path.read_text()
    except OSError:
        return False


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if (report.skipped and os.environ.get(REQUIRE_EMULATED_HOSTS) == "1"
            and _needs_emulated_hosts(item.path)):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else report.longrepr
        report.outcome = "failed"
        report.longrepr = (f"skipped ({reason}), but {REQUIRE_EMULATED_HOSTS}=1: this machine "
                           "is expected to make emulated hosts (root, network namespaces: "
                           "tools/emulated_cluster.py); run `make setup` as root for sshd "
                           f"and OpenMPI, or set {REQUIRE_EMULATED_HOSTS}=0 where network "
                           "namespaces are not allowed")
