"""Server-only hosts (BytePS's topology on ps-lite), across 3 emulated hosts: 2 hosts run
the workers and no server, 1 host runs the ps-lite servers and no worker.

The synchronous jobs train tests/workers/cluster_train.py (SGD with momentum, then Adam,
4 workers) and must end with the weights of one process on the concatenated batches; the
dist_async job, tests/test_async.py's, with one process's weights after all its pushes. Where the
servers run is read from the scheduler's own log (``PS_VERBOSE=1``: every node it admits,
with its role and address), not from the launcher.
"""
from __future__ import annotations

import itertools
import re
import sys
import textwrap

import numpy as np
import pytest
from test_async import STEPS, TRAINER_JOB, _one_process_reference, _results
from test_multinode import _max_error, _params, run_nodes

from conftest import REPO, assert_ok, host_env, run, worker_lines

sys.path.insert(0, str(REPO / "tools"))
import emulated_cluster  # noqa: E402

pytestmark = pytest.mark.skipif(emulated_cluster.skip_reason(sshd=True) is not None,
                                reason=str(emulated_cluster.skip_reason(sshd=True)))

WORKERS = REPO / "tests" / "workers"
WORLD = 4
_ports = itertools.count(29700)
# ps-lite's scheduler with PS_VERBOSE=1: "assign rank=8 to node role=server, ip=..."
_ADMITTED = re.compile(r"assign rank=\d+ to node role=(server|worker), ip=([\d.]+)")


@pytest.fixture(scope="module")
def cluster():
    with emulated_cluster.EmulatedCluster(num_hosts=3, sshd=True) as c:
        yield c


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("reference")
    assert_ok(run([sys.executable, str(WORKERS / "cluster_train.py"), str(out), str(WORLD)],
                  out))
    return out


def _admitted(text: str) -> dict[str, list[str]]:
    """The addresses of the servers and workers the scheduler admitted."""
    found: dict[str, list[str]] = {"server": [], "worker": []}
    for role, address in _ADMITTED.findall(text):
        found[role].append(address)
    return found


def _assert_trained_like_one_process(out_dir, reference) -> None:
    for case in ("sgd", "adam"):
        expected = _params(reference, case, 0)
        for rank in range(WORLD):
            assert _max_error(_params(out_dir, case, rank), expected) < 1e-5, (case, rank)


def test_a_server_only_host_first_in_the_host_list_serves_two_worker_hosts(
        cluster, reference, tmp_path):
    """-H with per-host slots and servers: host 0 (node 0, the scheduler's) runs 2
    servers and no worker; hosts 1 and 2 run 2 workers each and no server. Ranks are
    numbered over the worker hosts."""
    server, first, second = cluster.hosts
    hosts = f"{server.name}:0:2,{first.name}:2:0,{second.name}:2:0"
    argv = [sys.executable, "-m", "dist_gluon.launch", "-H", hosts, "--backend", "dist_sync",
            "--ssh-port", str(cluster.ssh_port), "--ssh-identity-file",
            cluster.identity_file, "--master-port", str(next(_ports)), "--",
            sys.executable, str(WORKERS / "cluster_train.py"), str(tmp_path), str(WORLD)]
    env = {**host_env(),
           "OMP_NUM_THREADS": "1", "PS_VERBOSE": "1"}
    proc = cluster.run(0, argv, cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    admitted = _admitted(proc.stdout + proc.stderr)
    assert admitted["server"] == [server.address] * 2, admitted
    assert sorted(admitted["worker"]) == [first.address] * 2 + [second.address] * 2
    for rank in range(WORLD):
        assert worker_lines(proc.stdout, rank)[-1] == f"rank {rank} of {WORLD} trained"
    _assert_trained_like_one_process(tmp_path, reference)


def test_server_nodes_makes_the_last_node_serve_with_one_command_on_every_node(
        cluster, reference, tmp_path):
    """--server-nodes 1, the same command on every node (as srun runs it, here on P3):
    nodes 0 and 1 run the workers and no server, node 2 the servers and no worker."""
    result = run_nodes(cluster, [WORKERS / "cluster_train.py", tmp_path, WORLD],
                       backend="p3", nproc=2, nodes=(0, 1, 2), nnodes=3,
                       launcher_args=["--servers", "2", "--server-nodes", "1"], cwd=tmp_path,
                       env={"PS_VERBOSE": "1"}, timeout=300)
    assert result.returncodes == [0, 0, 0], result.report()
    admitted = _admitted(result.stdout[0] + result.stderr[0])
    assert admitted["server"] == [cluster.hosts[2].address] * 2, admitted
    assert sorted(admitted["worker"]) == ([cluster.hosts[0].address] * 2
                                          + [cluster.hosts[1].address] * 2)
    assert not worker_lines(result.stdout[2], 0) and "[0] " in result.stdout[0]
    _assert_trained_like_one_process(tmp_path, reference)


def test_dist_async_runs_its_optimizer_on_a_server_only_host(cluster, tmp_path):
    """dist_async across hosts: the servers (and so the optimizer) on host 2 alone, one
    worker on each of hosts 0 and 1. Every push of the same gradient is one optimizer
    step there, so both ranks end with one process's weights after all 2 x STEPS."""
    script = tmp_path / "async_job.py"
    script.write_text(textwrap.dedent(TRAINER_JOB))
    first, second, server = cluster.hosts
    hosts = f"{first.name}:1:0,{second.name}:1:0,{server.name}:0:1"
    argv = [sys.executable, "-m", "dist_gluon.launch", "-H", hosts, "--backend",
            "dist_async", "--ssh-port", str(cluster.ssh_port), "--ssh-identity-file",
            cluster.identity_file, "--master-port", str(next(_ports)), "--",
            sys.executable, str(script)]
    env = {**host_env(),
           "OMP_NUM_THREADS": "1", "PS_VERBOSE": "1"}
    proc = cluster.run(0, argv, cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert _admitted(proc.stdout + proc.stderr)["server"] == [server.address]
    weight, bias = _one_process_reference(2 * STEPS)
    for rank in (0, 1):
        got = _results(proc, rank)
        np.testing.assert_allclose(got["weight"], weight, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(got["bias"], bias, rtol=1e-5, atol=1e-6)
