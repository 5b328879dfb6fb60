"""Horovod over MPI: ``--transport mpi`` keeps every launcher feature, and a plain
``mpirun -np N python train.py`` gets the horovod backend over MPI from dg.create().

``--transport mpi`` runs the ranks under OpenMPI's mpirun (dist_gluon/launch/mpi.py):
the trainer must train exactly as over Gloo, and the fault matrix of issue 11 must give
the same reports, in the same time, leaving nothing behind.
"""
from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
from test_faults import FAILURE_DEADLINE, FAULT_WORKER, HOW, STATUS, _run_fault
from test_sharding import CASES as SHARDING_CASES

from conftest import REPO, assert_ok, host_env, launch, run, worker_lines
from test_launch import SLEEPING_WORKER, _marker_env, _report, assert_nothing_left

sys.path.insert(0, str(REPO / "tools"))
import emulated_cluster  # noqa: E402
import test_multinode as multinode  # noqa: E402

WORKERS = REPO / "tests" / "workers"
MPI = ["--transport", "mpi"]
CLUSTER_SKIP = emulated_cluster.skip_reason(sshd=True)
needs_cluster = pytest.mark.skipif(CLUSTER_SKIP is not None, reason=str(CLUSTER_SKIP))


def _horovod_mpi_built() -> bool:
    probe = subprocess.run([sys.executable, "-c", "import horovod.mxnet as h; "
                            "print(h.mpi_built())"], capture_output=True, text=True)
    return probe.stdout.strip() == "True"


if shutil.which("mpirun") is None:
    pytestmark = pytest.mark.skip(reason="mpirun not found: install OpenMPI (make setup "
                                         "does it as root)")
elif not _horovod_mpi_built():
    pytestmark = pytest.mark.skip(reason="horovod was built without MPI: make setup "
                                         "rebuilds it once OpenMPI is installed")


def _mpirun(*argv) -> list[str]:
    root = ["--allow-run-as-root"] if os.geteuid() == 0 else []
    return ["mpirun", *root, "-np", "2", "--bind-to", "none", *map(str, argv)]


# ------------------------------------------------------------------ training
def _params(directory, case, rank):
    data = np.load(directory / f"{case}_rank{rank}.npz")
    return [data[str(i)] for i in range(len(data.files))]


def _max_error(a, b):
    return max(float(np.abs(x - y).max()) for x, y in zip(a, b))


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """trainer_cases.py as one process (the reference) and as 2 MPI ranks."""
    reference = tmp_path_factory.mktemp("reference")
    assert_ok(run([sys.executable, str(WORKERS / "trainer_cases.py"), reference, "2"],
                  reference))
    out = tmp_path_factory.mktemp("mpi")
    proc = run([sys.executable, "-m", "dist_gluon.launch", "-n", "2", *MPI, "--",
                sys.executable, WORKERS / "trainer_cases.py", out, "2"], out)
    assert_ok(proc)
    return reference, out, proc


def test_sharded_optimizer_states_over_mpi_train_like_one_process(tmp_path):
    """tests/workers/sharding_cases.py (shard_optimizer_states=True against one
    process, every case of test_sharding.py) on 2 MPI ranks."""
    proc = run([sys.executable, "-m", "dist_gluon.launch", "-n", "2", *MPI, "--",
                sys.executable, WORKERS / "sharding_cases.py", tmp_path], tmp_path)
    assert_ok(proc)
    for rank in (0, 1):
        passed = [line.split()[1] for line in worker_lines(proc.stdout, rank)
                  if line.startswith("ok ")]
        assert [c for c in passed if c != "adam_states_part"] == SHARDING_CASES, passed


@pytest.mark.parametrize("case", ["sgd", "adam", "two_a", "two_b", "accum", "clip",
                                  "predivide", "uneven_step", "uneven_update"])
def test_two_mpi_ranks_train_like_one_process_on_the_concatenated_batch(trained, case):
    reference, out, _ = trained
    expected = _params(reference, case, 0)
    for rank in (0, 1):
        assert _max_error(_params(out, case, rank), expected) < 1e-5, (case, rank)


def test_every_line_of_an_mpi_rank_carries_its_rank_prefix(trained):
    *_, proc = trained
    for rank in (0, 1):
        assert worker_lines(proc.stdout + proc.stderr, rank), _report(proc)
    unprefixed = [line for line in proc.stdout.splitlines() if not re.match(r"\[\d\] ", line)]
    assert not unprefixed, _report(proc)


PLAIN_MPIRUN_JOB = """
import os
import sys
import mxnet as mx
import horovod.mxnet as hvd
import dist_gluon as dg

kv = dg.create()
x = mx.nd.ones((3,)) * (kv.rank + 1)
kv.pushpull("x", x)
with open(os.path.join(sys.argv[1], f"rank{os.environ['OMPI_COMM_WORLD_RANK']}.txt"), "w") as f:
    f.write(f"{kv.type} {kv.rank} {kv.num_workers} {kv.local_rank} {hvd.mpi_enabled()} "
            f"{x.asnumpy().tolist()}")
"""


def test_a_plain_mpirun_job_gets_the_horovod_backend_over_mpi(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(PLAIN_MPIRUN_JOB)
    proc = run(_mpirun(sys.executable, script, tmp_path), tmp_path, timeout=120)
    assert_ok(proc)
    for rank in (0, 1):
        assert (tmp_path / f"rank{rank}.txt").read_text() == \
            f"horovod {rank} 2 {rank} True [3.0, 3.0, 3.0]", _report(proc)


@pytest.mark.parametrize("transport,expected", [(None, "mpi False gloo True"),
                                                ("mpi", "mpi True gloo False")])
def test_horovod_runs_over_gloo_by_default_and_over_mpi_on_request(
        tmp_path, transport, expected):
    proc = launch("import horovod.mxnet as hvd\nimport dist_gluon as dg\n"
                  "kv = dg.create()\n"
                  "print('mpi', hvd.mpi_enabled(), 'gloo', hvd.gloo_enabled(), flush=True)\n",
                  tmp_path, "horovod", n=2, timeout=120,
                  launcher_args=["--transport", transport] if transport else [])
    assert_ok(proc)
    assert worker_lines(proc.stdout, 0) == worker_lines(proc.stdout, 1) == [expected]


@pytest.mark.parametrize("users_value", [None, "0"])
def test_cpu_workers_ranks_yield_their_core_when_idle_unless_the_user_says_otherwise(
        tmp_path, users_value):
    # OpenMPI's waiting rank polls a whole core by default (benchmarks/FINDINGS.md 9c)
    env = {} if users_value is None else {"OMPI_MCA_mpi_yield_when_idle": users_value}
    proc = launch("import os\nprint(os.environ.get('OMPI_MCA_mpi_yield_when_idle'))\n",
                  tmp_path, "horovod", n=2, timeout=60, launcher_args=MPI, env=env)
    assert_ok(proc)
    expected = [users_value or "1"]
    assert worker_lines(proc.stdout, 0) == worker_lines(proc.stdout, 1) == expected


def test_only_hosts_without_a_visible_gpu_count_as_cpu_workers(tmp_path):
    from dist_gluon.launch.mpi import cpu_defaults, cpu_workers
    (tmp_path / "nvidiactl").touch()
    assert cpu_workers({}, str(tmp_path))
    (tmp_path / "nvidia0").touch()
    assert not cpu_workers({}, str(tmp_path))
    assert not cpu_workers({"CUDA_VISIBLE_DEVICES": "0,1"}, str(tmp_path))
    assert cpu_workers({"CUDA_VISIBLE_DEVICES": ""}, str(tmp_path))
    assert cpu_workers({"CUDA_VISIBLE_DEVICES": "-1"}, str(tmp_path))
    # this machine has no GPU
    assert cpu_defaults({}) == ["--mca", "mpi_yield_when_idle", "1"]
    assert cpu_defaults({"OMPI_MCA_mpi_yield_when_idle": "0"}) == []


def test_the_launchers_backend_wins_over_an_enclosing_mpi_job():
    from dist_gluon.backends.horovod import started_by_horovod

    assert started_by_horovod({"OMPI_COMM_WORLD_RANK": "0"})
    assert started_by_horovod({"PMIX_RANK": "1"})                     # srun --mpi=pmix
    assert started_by_horovod({"PMIX_RANK": "1", "DG_BACKEND": "horovod"})
    assert not started_by_horovod({"PMIX_RANK": "1", "DG_BACKEND": "dist_sync"})
    assert not started_by_horovod({})


# ------------------------------------------------------------------ failures
@pytest.mark.parametrize("faulty,mode", [(1, m) for m in HOW] + [(0, "raise"),
                                                                  (0, "sigkill")])
def test_an_mpi_rank_that_leaves_while_the_other_waits_is_named_as_the_cause(
        tmp_path, mode, faulty):
    proc, took = _run_fault(tmp_path, "horovod", mode, faulty, launcher_args=MPI)
    other = 1 - faulty
    assert proc.returncode == STATUS[mode], _report(proc)
    assert took < FAILURE_DEADLINE, f"took {took:.1f} s\n" + _report(proc)
    cause = (f"rank {faulty} ({socket.gethostname()}) {HOW[mode].format(r=faulty)} after 2 "
             f"collectives; rank {other} waits in collective #3 (key 'never').")
    assert cause in proc.stderr, _report(proc)
    assert f"rank {other} ({socket.gethostname()}) failed" not in proc.stderr.split(cause)[0]
    if mode == "systemexit":
        assert "data directory missing" in proc.stderr


def test_an_mpi_rank_stuck_outside_any_collective_is_reported_with_its_stack(tmp_path):
    proc, took = _run_fault(tmp_path, "horovod", "sleep", 1, launcher_args=[
        *MPI, "--stall-warning", "2", "--stall-timeout", "5"])
    assert proc.returncode == 124, _report(proc)
    assert took < 5 + FAILURE_DEADLINE, _report(proc)
    assert re.search(r"stall: rank 0 has waited \d+ s in collective #3 \(key 'never'\) "
                     r"that rank 1 \(.*\) has not reached", proc.stderr), _report(proc)
    assert "Python stacks of rank 1 (every thread):" in proc.stderr
    assert "in load_next_batch" in proc.stderr
    assert "stall timeout (5 s)" in proc.stderr


def test_max_restarts_reruns_mpirun_and_names_the_cause_each_time(tmp_path):
    proc, _ = _run_fault(tmp_path, "horovod", "systemexit", 1,
                         launcher_args=[*MPI, "--max-restarts", "1"])
    assert proc.returncode == 1, _report(proc)
    cause = f"rank 1 ({socket.gethostname()}) exited (SystemExit: data directory missing)"
    assert proc.stderr.count(cause) == 2, _report(proc)
    assert "restarting the job on every node (1 of 1)" in proc.stderr


def test_timeout_ends_an_mpi_job_and_leaves_nothing(tmp_path):
    env = _marker_env()
    started = time.monotonic()
    proc = launch(SLEEPING_WORKER, tmp_path, "horovod", n=2, env=env, timeout=60,
                  launcher_args=[*MPI, "--timeout", "4"])
    assert proc.returncode == 124, _report(proc)
    assert "timeout after 4 s. Ranks still running: 0, 1" in proc.stderr, _report(proc)
    assert time.monotonic() - started < 4 + FAILURE_DEADLINE
    assert_nothing_left(env["DG_TEST_MARKER"])


def test_a_command_that_cannot_start_is_reported_for_its_rank(tmp_path):
    proc = run([sys.executable, "-m", "dist_gluon.launch", "-n", "2", *MPI, "--",
                str(tmp_path / "missing-program")], tmp_path, timeout=60)
    assert proc.returncode == 127, _report(proc)
    assert re.search(r"rank \d \(.*\) exited with status 127", proc.stderr), _report(proc)
    assert "cannot start" in proc.stderr and "missing-program" in proc.stderr


def test_transport_mpi_is_for_horovod_only(tmp_path):
    proc = run([sys.executable, "-m", "dist_gluon.launch", "-n", "2", "--backend",
                "dist_sync", *MPI, "--", "true"], tmp_path, timeout=30)
    assert proc.returncode == 2
    assert "--transport mpi is for --backend horovod, not dist_sync" in proc.stderr


def test_transport_mpi_without_mpirun_says_how_to_install_it(tmp_path):
    env = dict(os.environ, PATH=str(tmp_path))
    proc = subprocess.run([sys.executable, "-m", "dist_gluon.launch", "-n", "2", *MPI,
                           "--", "true"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=30)
    assert proc.returncode == 2
    assert "needs OpenMPI's mpirun on PATH" in proc.stderr
    assert "--transport gloo" in proc.stderr


# ------------------------------------------------------------------ several nodes
# Node 0's mpirun starts the ranks of node 1 over ssh (the emulated hosts' sshd), while
# node 1's launcher still relays their output and reports their state.
@pytest.fixture(scope="module")
def cluster():
    with emulated_cluster.EmulatedCluster(num_hosts=2, sshd=True) as c:
        yield c


def _ssh(cluster) -> list[str]:
    return ["--ssh-port", str(cluster.ssh_port), "--ssh-identity-file",
            cluster.identity_file]


@needs_cluster
def test_mpi_ranks_on_two_nodes_train_exactly_like_one_process(cluster, tmp_path_factory,
                                                               tmp_path):
    reference = tmp_path_factory.mktemp("reference4")
    assert_ok(run([sys.executable, WORKERS / "cluster_train.py", reference, "4"], reference))
    result = multinode.run_nodes(cluster, [WORKERS / "cluster_train.py", tmp_path, 4],
                                 nproc=2, launcher_args=[*MPI, *_ssh(cluster)], cwd=tmp_path)
    assert result.returncodes == [0, 0], result.report()
    for node in (0, 1):
        for rank in (2 * node, 2 * node + 1):
            assert f"[{rank}] " in result.stdout[node] + result.stderr[node], result.report()
    for case in ("sgd", "adam"):
        expected = _params(reference, case, 0)
        for rank in range(4):
            assert _max_error(_params(tmp_path, case, rank), expected) < 1e-5, (case, rank)


@needs_cluster
def test_an_mpi_rank_killed_on_node_1_ends_node_0_naming_its_rank_and_host(cluster,
                                                                          tmp_path):
    script = tmp_path / "fault.py"
    script.write_text(FAULT_WORKER)
    marker = _marker_env()
    result = multinode.run_nodes(cluster, [script, "sigkill", "1"], cwd=tmp_path,
                                 env=marker, launcher_args=[*MPI, *_ssh(cluster)])
    failing_at = [float(line.split()[1]) for line in
                  worker_lines(result.stdout[1], 1) if line.startswith("FAILING_AT ")]
    assert failing_at, result.report()
    assert result.ended_at[0] - failing_at[0] < multinode.NODE_FAILURE_DEADLINE, \
        result.report()
    cause = f"rank 1 ({cluster.hosts[1].name}) was killed by SIGKILL after 2 collectives"
    for node in (0, 1):
        assert result.returncodes[node] == 137, result.report()
        assert cause in result.stderr[node], result.report()
    assert_nothing_left(marker["DG_TEST_MARKER"])


MPI_SUM_WORKER = """
import horovod.mxnet as hvd
import mxnet as mx
import dist_gluon as dg

kv = dg.create()
value = mx.nd.ones((3,)) * (kv.rank + 1)
kv.pushpull("x", value)
print(f"rank {kv.rank} of {kv.num_workers} local {kv.local_rank} mpi {hvd.mpi_enabled()} "
      f"sum {value.asnumpy().tolist()}", flush=True)
"""


@needs_cluster
def test_one_command_over_ssh_runs_mpi_ranks_on_every_host(cluster, tmp_path):
    script = tmp_path / "sum.py"
    script.write_text(MPI_SUM_WORKER)
    argv = [sys.executable, "-m", "dist_gluon.launch", "-H",
            ",".join(f"{h.name}:2" for h in cluster.hosts), *_ssh(cluster),
            "--master-port", str(next(multinode._ports)), *MPI, "--", sys.executable, str(script)]
    env = {**host_env(),
           "OMP_NUM_THREADS": "1"}
    proc = cluster.run(0, argv, cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for rank in range(4):
        assert worker_lines(proc.stdout, rank) == [
            f"rank {rank} of 4 local {rank % 2} mpi True sum [10.0, 10.0, 10.0]"]
