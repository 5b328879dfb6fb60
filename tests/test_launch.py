"""The launcher: output prefixes, exit status, failures, --timeout, Ctrl-C and arguments.

Every job gets a unique DG_TEST_MARKER in its environment; every process of the job
(launcher, scheduler, servers, workers and their children) inherits it, so after the
launcher has ended, any process whose environment still holds the marker was left behind.
"""
from __future__ import annotations

import os
import re
import select
import signal
import socket
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest

from conftest import launch, process_env, worker_lines
from dist_gluon import launch as launch_module

FAILURE_DEADLINE = 15.0   # seconds from a worker's failure to the launcher's exit


def _marker_env() -> dict[str, str]:
    return {"DG_TEST_MARKER": uuid.uuid4().hex}


def _processes_with(marker: str) -> list[str]:
    """Command lines of live processes whose environment holds ``marker``."""
    needle = f"DG_TEST_MARKER={marker}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if needle not in (entry / "environ").read_bytes().split(b"\0"):
                continue
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            found.append(f"{entry.name}: {cmdline}")
    return found


def assert_nothing_left(marker: str) -> None:
    """No process of the job survives (zombies aside: init reaps orphans on its own
    schedule). A process being killed can take a moment to exit, hence the short grace."""
    limit = time.monotonic() + 1.0
    while (left := _processes_with(marker)) and time.monotonic() < limit:
        time.sleep(0.1)
    assert not left, "processes of the job were left behind:\n" + "\n".join(left)


def _launcher_argv(path: Path, backend: str, n: int = 2, launcher_args=(), args=()):
    return [sys.executable, "-m", "dist_gluon.launch", "-n", str(n), "--backend", backend,
            *launcher_args, "--", sys.executable, str(path), *args]


def _launcher_env(env: dict) -> dict:
    return process_env(**env)


def _report(proc) -> str:
    return f"--- stdout\n{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-3000:]}"


# ------------------------------------------------------------------ output and status
OUTPUT_WORKER = """
import os
import sys

rank = os.environ["DG_RANK"]
for i in range(3):
    print(f"out line {i} of rank {rank}", flush=True)
    print(f"err line {i} of rank {rank}", file=sys.stderr, flush=True)
"""


def test_every_line_a_worker_prints_is_prefixed_with_its_rank(tmp_path):
    proc = launch(OUTPUT_WORKER, tmp_path, "horovod", n=2)
    assert proc.returncode == 0, _report(proc)
    for rank in (0, 1):
        for i in range(3):
            assert f"[{rank}] out line {i} of rank {rank}" in proc.stdout.splitlines()
            assert f"[{rank}] err line {i} of rank {rank}" in proc.stderr.splitlines()
        assert worker_lines(proc.stdout, rank) == [f"out line {i} of rank {rank}"
                                                   for i in range(3)]


LATE_EXIT_WORKER = """
import os
import sys
import time

if os.environ["DG_RANK"] == "1":
    time.sleep(1)
    print("rank 1 gives up late", file=sys.stderr, flush=True)
    sys.exit(3)
print("rank 0 done", flush=True)
"""


def test_exit_status_is_non_zero_when_one_worker_fails_after_the_others_succeeded(
        tmp_path):
    proc = launch(LATE_EXIT_WORKER, tmp_path, "horovod", n=2)
    assert worker_lines(proc.stdout, 0) == ["rank 0 done"]
    assert proc.returncode == 3, _report(proc)
    assert f"rank 1 ({socket.gethostname()}) exited with status 3 after 0 collectives." \
        in proc.stderr, _report(proc)
    assert "rank 1 gives up late" in proc.stderr


# ------------------------------------------------------------------ failures
# argv[1]: 'raise' (rank 1 raises, rank 0 sleeps and has a child process of its own) or
# 'sigkill' (rank 1 kills itself, rank 0 sleeps): a rank that fails while the other is
# outside any collective. A rank failing while the other waits in a collective, in
# every way a script can fail, is tests/test_faults.py's matrix.
FAILING_WORKER = """
import os
import subprocess
import sys
import time

import mxnet as mx

import dist_gluon as dg

mode = sys.argv[1]
kv = dg.create()
if mode == "raise" and kv.rank == 0:
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
warm = mx.nd.ones((4,))
kv.pushpull("warm", warm)
warm.wait_to_read()
print("ready", flush=True)
if kv.rank == 1:
    print(f"FAILING_AT {time.time()!r}", flush=True)
    print(f"rank 1 is about to fail by {mode}", file=sys.stderr, flush=True)
    if mode == "sigkill":
        os.kill(os.getpid(), 9)
    raise RuntimeError(f"rank 1 fails on purpose ({mode})")
time.sleep(300)
print("rank 0 should never get here", flush=True)
"""

FAILURES = [("horovod", "raise"), ("horovod", "sigkill"), ("dist_sync", "raise"),
            ("dist_sync", "sigkill")]


@pytest.mark.parametrize("backend,mode", FAILURES)
@pytest.mark.spawns
def test_a_failing_rank_ends_the_whole_job_quickly_and_is_named_with_its_stderr(
        tmp_path, backend, mode):
    env = _marker_env()
    proc = launch(FAILING_WORKER, tmp_path, backend, n=2, args=[mode], env=env, timeout=90)
    ended = time.time()
    assert proc.returncode != 0, _report(proc)
    failing_at = [float(line.split()[1]) for line in worker_lines(proc.stdout, 1)
                  if line.startswith("FAILING_AT ")]
    assert failing_at, "rank 1 never reached its failure\n" + _report(proc)
    assert ended - failing_at[0] < FAILURE_DEADLINE, _report(proc)
    assert "rank 0 should never get here" not in proc.stdout

    how = {"sigkill": "was killed by SIGKILL"}.get(
        mode, f"failed (RuntimeError: rank 1 fails on purpose ({mode}))")
    cause = f"rank 1 ({socket.gethostname()}) {how} after 2 collectives"
    assert cause in proc.stderr, _report(proc)
    report = proc.stderr[proc.stderr.index(cause):]
    assert "last lines of rank 1's stderr" in report
    assert f"rank 1 is about to fail by {mode}" in report
    if mode != "sigkill":
        assert f"RuntimeError: rank 1 fails on purpose ({mode})" in report
    assert_nothing_left(env["DG_TEST_MARKER"])


# ------------------------------------------------------------------ timeout and Ctrl-C
SLEEPING_WORKER = """
import time

print("ready", flush=True)
time.sleep(300)
"""

SLEEPING_IN_A_JOB_WORKER = """
import time

import dist_gluon as dg

kv = dg.create()
kv.barrier()
print("ready", flush=True)
time.sleep(300)
"""


@pytest.mark.parametrize("backend", ["horovod", "dist_sync"])
@pytest.mark.spawns
def test_timeout_terminates_the_job_and_names_the_ranks_still_running(tmp_path, backend):
    env = _marker_env()
    started = time.monotonic()
    proc = launch(SLEEPING_WORKER, tmp_path, backend, n=2, launcher_args=["--timeout", "5"],
                  env=env, timeout=60)
    elapsed = time.monotonic() - started
    assert proc.returncode != 0, _report(proc)
    assert re.search(r"timeout after 5 s\. Ranks still running: 0, 1", proc.stderr), \
        _report(proc)
    assert elapsed < 5 + FAILURE_DEADLINE
    assert_nothing_left(env["DG_TEST_MARKER"])


def _read_until(proc: subprocess.Popen, wanted: set[str], timeout: float) -> list[str]:
    """Lines of ``proc.stdout`` until every line in ``wanted`` was seen."""
    seen, lines, buffer = set(), [], b""
    limit = time.monotonic() + timeout
    while not wanted <= seen:
        left = limit - time.monotonic()
        assert left > 0, f"never saw {wanted - seen}; output so far: {lines}"
        ready, _, _ = select.select([proc.stdout], [], [], left)
        if not ready:
            continue
        chunk = os.read(proc.stdout.fileno(), 65536)
        assert chunk, f"launcher closed its output early; output so far: {lines}"
        buffer += chunk
        *complete, buffer = buffer.split(b"\n")
        for raw in complete:
            line = raw.decode()
            lines.append(line)
            seen.add(line)
    return lines


@pytest.mark.parametrize("backend", ["horovod", "dist_sync"])
@pytest.mark.spawns
def test_sigint_to_the_launcher_terminates_every_process_of_the_job(tmp_path, backend):
    env = _marker_env()
    path = tmp_path / "worker.py"
    path.write_text(textwrap.dedent(SLEEPING_IN_A_JOB_WORKER))
    proc = subprocess.Popen(_launcher_argv(path, backend), cwd=tmp_path,
                            env=_launcher_env(env), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    try:
        _read_until(proc, {"[0] ready", "[1] ready"}, timeout=60)
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=FAILURE_DEADLINE)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode != 0
    assert "interrupted by SIGINT" in stderr.decode()
    assert_nothing_left(env["DG_TEST_MARKER"])


# ------------------------------------------------------------------ arguments
@pytest.mark.parametrize("argv,complaint", [
    (["-n", "0", "--", "python", "x.py"], "-n must be at least 1"),
    (["-n", "-2", "--", "python", "x.py"], "-n must be at least 1"),
    (["-n", "2"], "no command given"),
    (["-n", "2", "--"], "no command given"),
    (["-n", "2", "--backend", "mpi", "--", "python", "x.py"], "invalid choice: 'mpi'"),
    (["-n", "2", "--backend", "dist_sync", "--servers", "0", "--", "python", "x.py"],
     "--servers must be at least 1"),
    (["-n", "0", "--backend", "dist_sync", "--", "python", "x.py"],
     "-n must be at least 1"),
    (["-H", "a:2,b:0:1", "--", "python", "x.py"], "horovod has none"),
    (["-H", "a:2:0,b:2:0", "--backend", "dist_sync", "--", "python", "x.py"],
     "run no ps-lite server"),
])
def test_bad_arguments_are_a_usage_error_with_exit_status_2(argv, complaint, capsys):
    with pytest.raises(SystemExit) as stop:
        launch_module.main(argv)
    assert stop.value.code == 2
    stderr = capsys.readouterr().err
    assert stderr.startswith("usage:")
    assert complaint in stderr


def test_a_usage_error_exits_2_from_the_command_line():
    proc = subprocess.run([sys.executable, "-m", "dist_gluon.launch", "-n", "0", "--",
                           "python", "x.py"],
                          env=_launcher_env({}), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, _report(proc)
    assert proc.stderr.startswith("usage:")


SINGLE_WORKER = """
import mxnet as mx

import dist_gluon as dg

kv = dg.create()
value = mx.nd.array([1.0, 2.0])
kv.pushpull(0, value)
print(f"{kv.type} {kv.rank} {kv.num_workers} {value.asnumpy().tolist()}", flush=True)
"""


@pytest.mark.parametrize("backend", ["horovod", "p3"])
@pytest.mark.spawns
def test_one_worker_job_runs(tmp_path, backend):
    proc = launch(SINGLE_WORKER, tmp_path, backend, n=1, timeout=60)
    assert proc.returncode == 0, _report(proc)
    assert worker_lines(proc.stdout, 0) == [f"{backend} 0 1 [1.0, 2.0]"]


# ------------------------------------------------------------------ a fast supervisor
def test_the_launcher_imports_neither_mxnet_nor_horovod_and_answers_at_once(tmp_path):
    probe = ("import sys, dist_gluon.launch; "
             "print(sorted(m for m in sys.modules if m.split('.')[0] in "
             "('mxnet', 'horovod')))")
    proc = subprocess.run([sys.executable, "-c", probe], env=_launcher_env({}),
                          capture_output=True, text=True, timeout=60)
    assert proc.stdout.strip() == "[]", proc.stdout + proc.stderr
    # --help answers where importing either would fail (a launcher host without them)
    for name in ("mxnet", "horovod"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text(f"raise ImportError('{name} imported')")
    env = _launcher_env({})
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env["PYTHONPATH"]])
    proc = subprocess.run([sys.executable, "-m", "dist_gluon.launch", "--help"],
                          env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "--nnodes" in proc.stdout, _report(proc)


def test_version_is_the_package_version():
    from dist_gluon import __version__
    proc = subprocess.run([sys.executable, "-m", "dist_gluon.launch", "--version"],
                          env=_launcher_env({}), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0
    assert proc.stdout.strip() == f"dist_gluon {__version__}"


@pytest.mark.parametrize("argv,complaint", [
    (["--nnodes", "2", "-n", "1", "--", "python", "x.py"], "--nnodes > 1 needs --master-addr"),
    (["--nnodes", "2", "--node-rank", "2", "--master-addr", "10.0.0.1", "-n", "1", "--",
      "python", "x.py"], "--node-rank must be in [0, 2)"),
    (["-H", "a:2,b:1", "--", "python", "x.py"], "same number of slots"),
    (["-H", "a:2,a:2", "--", "python", "x.py"], "names a host twice"),
    (["-H", "a:x", "--", "python", "x.py"], "slots must be a whole number"),
    (["-H", "a:2", "--nnodes", "2", "--", "python", "x.py"], "do not add --nnodes"),
    (["-n", "1", "--stall-timeout", "0", "--", "python", "x.py"],
     "--stall-timeout must be positive"),
])
def test_bad_multi_node_arguments_are_usage_errors(argv, complaint, capsys):
    with pytest.raises(SystemExit) as stop:
        launch_module.main(argv)
    assert stop.value.code == 2
    assert complaint in capsys.readouterr().err


_NODE_1 = ["--nnodes", "2", "--node-rank", "1", "--master-addr", "10.0.0.1"]


@pytest.mark.parametrize("argv,complaint", [
    (["-n", "0", *_NODE_1], "horovod has none"),
    (["-n", "0", "--servers", "0", "--backend", "dist_async", *_NODE_1],
     "neither workers nor servers"),
    (["-n", "2", "--server-nodes", "1", *_NODE_1], "--server-nodes needs a ps-lite"),
    (["-n", "2", "--backend", "p3", "--server-nodes", "2", *_NODE_1],
     "--server-nodes must be in [1, 1]"),
    (["-n", "2", "--backend", "p3", "--server-nodes", "1", "--servers", "0", *_NODE_1],
     "--servers must be at least 1"),
    (["-H", "a:2,b:0:1", "--backend", "p3", "--server-nodes", "1"],
     "with -H/--hostfile give each server-only host 0 slots"),
])
def test_bad_server_only_layouts_are_usage_errors(argv, complaint, capsys, monkeypatch):
    _assert_usage_error(argv, complaint, capsys, monkeypatch)


def _assert_usage_error(argv, complaint, capsys, monkeypatch) -> None:
    """The launcher stops with status 2 and says ``complaint`` (a multi-node job has
    its secret)."""
    monkeypatch.setenv("DG_JOB_SECRET", "a-test-secret-of-enough-length-0123456789")
    with pytest.raises(SystemExit) as stop:
        launch_module.main([*argv, "--", "python", "x.py"])
    assert stop.value.code == 2
    assert complaint in capsys.readouterr().err


def test_server_nodes_picks_each_nodes_role_from_its_rank(monkeypatch):
    monkeypatch.setenv("DG_JOB_SECRET", "a-test-secret-of-enough-length-0123456789")
    roles = []
    for rank in range(4):
        args = launch_module._parse_args(
            ["--nnodes", "4", "--node-rank", str(rank), "--master-addr", "10.0.0.1", "-n",
             "3", "--servers", "2", "--server-nodes", "2", "--backend", "dist_sync", "--",
             "python", "x.py"])
        roles.append((args.num_workers, args.servers))
    assert roles == [(3, 0), (3, 0), (0, 2), (0, 2)]


def test_a_job_whose_nodes_all_refuse_servers_ends_with_a_clear_error(tmp_path):
    """Each node may run --servers 0, but not all of them: node 0 sees it once every
    node has joined and tells them all."""
    port = str(29400 + os.getpid() % 90)
    env = _launcher_env({"DG_JOB_SECRET": "a-test-secret-of-enough-length-0123456789"})
    procs = [subprocess.Popen(
        [sys.executable, "-m", "dist_gluon.launch", "--nnodes", "2", "--node-rank",
         str(rank), "--master-addr", "127.0.0.1", "--master-port", port, "-n", "1",
         "--servers", "0", "--backend", "dist_sync", "--", sys.executable, "-c", "pass"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for rank in (0, 1)]
    outputs = [p.communicate(timeout=60) for p in procs]
    assert [p.returncode for p in procs] == [2, 2], outputs
    for _, err in outputs:
        assert "no node of this job runs a ps-lite server" in err, outputs


def test_a_hostfile_lists_hosts_and_slots(tmp_path):
    from dist_gluon.launch import ssh
    path = tmp_path / "hosts"
    path.write_text("# the cluster\nnode1 slots=2\nnode2   slots=2  # second\n\n")
    assert ssh.read_hostfile(str(path)) == [("node1", 2, None), ("node2", 2, None)]
    assert ssh.parse_hosts("h1:4,h2:4") == [("h1", 4, None), ("h2", 4, None)]
    # server-only hosts: 0 slots, and each host's own ps-lite server count
    assert ssh.parse_hosts("w1:2:0,w2:2:0,s1:0:2") == [("w1", 2, 0), ("w2", 2, 0),
                                                      ("s1", 0, 2)]
    path.write_text("w1 slots=2 servers=0\nw2 slots=2\ns1 slots=0 servers=3\n")
    assert ssh.read_hostfile(str(path)) == [("w1", 2, 0), ("w2", 2, None), ("s1", 0, 3)]
    for bad, complaint in (("a:0,b:0", "no host runs workers"),
                           ("a:2,b:1,c:0", "same number of slots"),
                           ("a:2:x", "servers must be a whole number"),
                           ("a:-1", "slots must be at least 1")):
        with pytest.raises(ValueError, match=complaint):
            ssh.parse_hosts(bad)
    path.write_text("node1 cores=2\n")
    with pytest.raises(ValueError, match="expected 'host slots=N'"):
        ssh.read_hostfile(str(path))


@pytest.mark.parametrize("nodelist,hosts", [
    ("node[01-04,07]", ["node01", "node02", "node03", "node04", "node07"]),
    ("gpu5", ["gpu5"]),
    ("a[1-2],b[09-10],c", ["a1", "a2", "b09", "b10", "c"]),
    ("rack[1-2]-n[1-2]", ["rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2"]),
])
def test_slurm_node_lists_expand_in_order(nodelist, hosts):
    from dist_gluon.launch import slurm
    assert slurm.expand_nodelist(nodelist) == hosts


def test_under_srun_node_count_rank_and_master_default_from_slurm():
    from dist_gluon.launch import slurm
    env = {"SLURM_JOB_ID": "7", "SLURM_NODEID": "2", "SLURM_NNODES": "4",
           "SLURM_NTASKS": "4", "SLURM_JOB_NODELIST": "node[01-04]"}
    assert slurm.defaults(env) == {"nnodes": 4, "node_rank": 2, "master_addr": "node01"}
    assert slurm.defaults({}) is None
    with pytest.raises(ValueError, match="one launcher per node"):
        slurm.defaults(dict(env, SLURM_NTASKS="16"))


def test_srun_variables_reach_the_parsed_arguments(monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    monkeypatch.setenv("SLURM_NODEID", "1")
    monkeypatch.setenv("SLURM_NNODES", "2")
    monkeypatch.setenv("SLURM_NTASKS", "2")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "cn[3-4]")
    monkeypatch.setenv("DG_JOB_SECRET", "srun passes the environment on")
    args = launch_module._parse_args(["-n", "2", "--", "python", "x.py"])
    assert (args.nnodes, args.node_rank, args.master_addr) == (2, 1, "cn3")


# ------------------------------------------------------------------ elastic arguments
_ELASTIC = ["--master-addr", "10.0.0.1", "-n", "2"]


@pytest.mark.parametrize("argv, complaint", [
    (["--nnodes", "3:2", *_ELASTIC], "--nnodes MIN:MAX needs 1 <= MIN <= MAX, got '3:2'"),
    (["--nnodes", "two", *_ELASTIC], "--nnodes must be a number of nodes N or a range "
                                     "MIN:MAX (e.g. 2:4), got 'two'"),
    (["--nnodes", "2:3", "--node-rank", "3", *_ELASTIC], "--node-rank must be in [0, 3)"),
    (["--nnodes", "2:3", "--transport", "mpi", *_ELASTIC], "--nnodes MIN:MAX needs "
                                                          "--transport gloo"),
    (["--nnodes", "2:3", "--backend", "p3", "--master-addr", "10.0.0.1", "-n", "0"],
     "node 0 of an elastic job must run workers"),
    (["--nnodes", "2:3", "--node-rank", "1", "--backend", "p3", "--server-nodes", "1",
      *_ELASTIC], "give the server-only nodes -n 0 --servers S instead"),
    (["--nnodes", "2:3", "--preempt-grace", "0", *_ELASTIC],
     "--preempt-grace must be positive"),
    (["--nnodes", "2:3", "--last-call", "-1", *_ELASTIC], "--last-call must be >= 0"),
    (["-H", "a:1,b:1,c:1", "--nnodes", "2"], "do not add --nnodes or --node-rank"),
    (["-H", "a:1,b:1,c:1", "--nnodes", "1:2"], "names 3 hosts, more than the MAX 2"),
])
def test_bad_elastic_arguments_are_usage_errors(argv, complaint, capsys, monkeypatch):
    _assert_usage_error(argv, complaint, capsys, monkeypatch)


def test_nnodes_min_max_makes_an_elastic_job_also_over_ssh_and_under_srun(monkeypatch):
    monkeypatch.setenv("DG_JOB_SECRET", "a-test-secret-of-enough-length-0123456789")
    args = launch_module._parse_args(["--nnodes", "2:4", "--node-rank", "3", *_ELASTIC,
                                      "--", "python", "x.py"])
    assert (args.elastic, args.min_nodes, args.max_nodes, args.nnodes) == (True, 2, 4, 4)
    static = launch_module._parse_args(["--nnodes", "2", *_ELASTIC, "--", "python", "x.py"])
    assert (static.elastic, static.min_nodes, static.max_nodes) == (False, 2, 2)
    # one node, as torchrun's 1:1: a SIGTERM still checkpoints before the job ends
    alone = launch_module._parse_args(["--nnodes", "1:1", "-n", "2", "--", "python", "x.py"])
    assert (alone.elastic, alone.min_nodes, alone.max_nodes) == (True, 1, 1)

    from dist_gluon.launch import ssh
    fan = launch_module._parse_args(["-H", "h1:1,h2:1", "--nnodes", "1:3",
                                     "--preempt-grace", "7", "--", "python", "x.py"])
    command = ssh.node_command(fan, 1, "h1")
    assert "--nnodes 1:3 --node-rank 1" in command and "--preempt-grace 7" in command
    assert "--no-warm-standby" not in command
    cold = launch_module._parse_args(["-H", "h1:1,h2:1", "--max-restarts", "1",
                                      "--no-warm-standby", "--", "python", "x.py"])
    assert "--no-warm-standby" in ssh.node_command(cold, 1, "h1")
    # -H is several machines: --max-restarts alone does not make the job elastic there
    assert not cold.elastic and not cold.one_machine

    # under srun an explicit MIN:MAX still takes this node's rank and node 0 from SLURM
    for name, value in {"SLURM_JOB_ID": "7", "SLURM_NODEID": "1", "SLURM_NNODES": "2",
                        "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "cn[3-4]"}.items():
        monkeypatch.setenv(name, value)
    args = launch_module._parse_args(["--nnodes", "2:4", "-n", "2", "--", "python", "x.py"])
    assert (args.elastic, args.node_rank, args.master_addr, args.max_nodes) == \
        (True, 1, "cn3", 4)


# ------------------------------------------------------------------ nodes on one machine
LOOPBACK_WORKER = """
import os
import mxnet as mx
import dist_gluon as dg

kv = dg.create()
out = mx.nd.zeros((3,))
kv.pushpull(0, mx.nd.full((3,), kv.rank + 1.0), out=out)
print(f"world {kv.num_workers} node {os.environ['DG_NODE_RANK']} sum {out.asnumpy()[0]:g}",
      flush=True)
"""


@pytest.mark.spawns
def test_a_horovod_job_of_two_nodes_on_one_machine_needs_no_host_name_fix(tmp_path,
                                                                         monkeypatch):
    """With --master-addr on loopback every node runs on this machine, so a host name
    that resolves to loopback (Debian's 127.0.1.1) is no obstacle to Gloo, while with a
    real address it is named as the problem it is."""
    from dist_gluon.launch import job
    monkeypatch.setattr(job.jobenv, "resolves_to_loopback", lambda: True)
    monkeypatch.setenv("DG_JOB_SECRET", "a-test-secret-of-enough-length-0123456789")
    for addr, ok in (("127.0.0.1", True), ("localhost", True), ("10.0.0.1", False)):
        args = launch_module._parse_args(["--nnodes", "2", "--master-addr", addr,
                                          "--backend", "horovod", "-n", "1", "--",
                                          "python", "x.py"])
        problem = job.check_multinode_host(args)
        assert (problem is None) == ok, (addr, problem)
    monkeypatch.undo()

    script = tmp_path / "worker.py"
    script.write_text(LOOPBACK_WORKER)
    port = str(29300 + os.getpid() % 90)
    env = _launcher_env({"DG_JOB_SECRET": "a-test-secret-of-enough-length-0123456789",
                         **_marker_env()})
    procs = [subprocess.Popen(
        [sys.executable, "-m", "dist_gluon.launch", "--nnodes", "2", "--node-rank",
         str(rank), "--master-addr", "127.0.0.1", "--master-port", port, "-n", "1",
         "--backend", "horovod", "--", sys.executable, str(script)],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for rank in (0, 1)]
    outputs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    assert worker_lines(outputs[0][0], 0) == ["world 2 node 0 sum 3"], outputs
    assert worker_lines(outputs[1][0], 1) == ["world 2 node 1 sum 3"], outputs
    assert_nothing_left(env["DG_TEST_MARKER"])
