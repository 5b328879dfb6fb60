"""Joining a ps-lite job: every worker's DG_RANK is checked to number the workers
0..N-1 once each, and a worker that cannot join gives up after DG_CONNECT_TIMEOUT
naming the scheduler address it tried.

The launcher always sets correct ranks, so these jobs are started by hand: a scheduler,
a server and the workers, as MXNet's own ps-lite tools would.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest

from conftest import REPO
from dist_gluon.backends import pslite
from dist_gluon.launch import jobenv

WORKER = """
import dist_gluon as dg
try:
    kv = dg.create()
    print("created", kv.rank, flush=True)
except RuntimeError as err:
    print("caught:", err, flush=True)
"""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _environment(extra: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("DMLC_", "DG_", "HOROVOD_", "OMPI_", "PMI_"))}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), **extra)
    return env


def _start(role: str, job: dict[str, str], argv: list[str], **extra) -> subprocess.Popen:
    env = _environment({**job, **jobenv.pslite_role_env(role), **extra})
    return subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def _stop(processes: list[subprocess.Popen]) -> None:
    for proc in processes:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()


@pytest.mark.parametrize("dg_ranks, problems", [
    (("0", "0"), ["DG_RANK=0 is given to 2 workers", "no worker has DG_RANK=1"]),
    (("0", "2"), ["DG_RANK=2 is out of range", "no worker has DG_RANK=1"]),
])
def test_wrong_dg_ranks_are_a_clear_error_on_every_worker(tmp_path, dg_ranks, problems):
    job = jobenv.pslite_env("127.0.0.1", _free_port(), num_workers=2, num_servers=1,
                             node_host="127.0.0.1", p3=False)
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    infrastructure = [_start(role, job, [sys.executable, "-c", "import mxnet"])
                      for role in ("scheduler", "server")]
    workers = [_start("worker", job, [sys.executable, str(script)], DG_RANK=rank)
               for rank in dg_ranks]
    try:
        outputs = [proc.communicate(timeout=90) for proc in workers]
        for proc in infrastructure:
            proc.wait(timeout=30)
    finally:
        _stop(workers + infrastructure)
    for proc, (stdout, stderr) in zip(workers, outputs):
        assert proc.returncode == 0, stderr
        assert stdout.startswith("caught: "), stdout + stderr
        assert "DG_RANK values of this job's 2 workers must be 0..1, each once" in stdout
        for problem in problems:
            assert problem in stdout
        assert "The launcher (python -m dist_gluon.launch) sets DG_RANK" in stdout
    # the job still ended in order: ps-lite's scheduler and server saw every worker leave
    assert [proc.returncode for proc in infrastructure] == [0, 0]


def test_a_worker_that_cannot_reach_the_scheduler_fails_in_time_naming_the_address(
        tmp_path):
    port = _free_port()                   # nobody listens there
    job = jobenv.pslite_env("127.0.0.1", port, num_workers=1, num_servers=1,
                             node_host="127.0.0.1", p3=False)
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    start = time.monotonic()
    worker = _start("worker", job, [sys.executable, str(script)], DG_CONNECT_TIMEOUT="5")
    try:
        stdout, stderr = worker.communicate(timeout=60)
    finally:
        _stop([worker])
    elapsed = time.monotonic() - start
    assert worker.returncode == 1, stdout + stderr
    assert f"could not reach the scheduler at 127.0.0.1:{port} " \
           "(DMLC_PS_ROOT_URI:DMLC_PS_ROOT_PORT) within 5 s" in stderr
    assert "DG_CONNECT_TIMEOUT" in stderr
    assert 5 <= elapsed < 30


@pytest.mark.parametrize("value", ["0", "-3", "soon", "nan"])
def test_a_connect_timeout_that_is_not_a_positive_number_is_a_clear_error(value):
    with pytest.raises(ValueError, match=f"DG_CONNECT_TIMEOUT must be a positive number of "
                                         f"seconds, got '{value}'"):
        pslite.connect_timeout({"DG_CONNECT_TIMEOUT": value})
    assert pslite.connect_timeout({}) == 60.0
    assert pslite.connect_timeout({"DG_CONNECT_TIMEOUT": "2.5"}) == 2.5
