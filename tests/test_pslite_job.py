"""Joining a ps-lite job: every worker's DG_RANK is checked to number the workers
0..N-1 once each, and a worker that cannot join gives up after DG_CONNECT_TIMEOUT
naming the scheduler address it tried.

The launcher always sets correct ranks, so these jobs are started by hand: a scheduler,
a server and the workers, as MXNet's own ps-lite tools would. The last test is the
launcher's own: its scheduler and servers run on MXNet's library alone.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest

from conftest import REPO, assert_ok, launch, process_env, worker_lines
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
    return {k: v for k, v in process_env(**extra).items()
            if k in extra or not k.startswith(("DMLC_", "DG_", "HOROVOD_", "OMPI_", "PMI_"))}


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


SERVICES_WORKER = """
import os
import mxnet as mx
import numpy as np
from mxnet import autograd, gluon

PORT = os.environ["DMLC_PS_ROOT_PORT"]
# other jobs may use the same port at once (the emulated hosts' tests, in their own
# network namespaces): this one's processes also carry the test's own token
TOKEN = os.environ["DG_TEST_JOB_TOKEN"]


def services():
    '''This job's scheduler and servers (found by their environment), each with whether
    MXNet's Python package is loaded in it (numpy's core is: the package imports it).'''
    found = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = dict(v.split(b"=", 1) for v in f.read().split(b"\\0") if b"=" in v)
            with open(f"/proc/{pid}/maps") as f:
                maps = f.read()
        except OSError:
            continue
        role = env.get(b"DMLC_ROLE", b"").decode()
        if role in ("scheduler", "server") and env.get(b"DMLC_PS_ROOT_PORT") == PORT.encode() \
                and env.get(b"DG_TEST_JOB_TOKEN") == TOKEN.encode():
            found[role] = "_multiarray_umath" in maps
    return dict(sorted(found.items()))


kv = mx.kv.create("dist_sync")
# neither worker sends its optimizer to the servers before rank 0 has looked
kv._barrier()
if kv.rank == 0:
    print("before", services(), flush=True)
kv._barrier()
net = gluon.nn.Dense(3, in_units=4)
net.initialize(mx.init.Constant(0.5))
# MXNet's defaults: the optimizer runs on the servers (update_on_kvstore)
trainer = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.1}, kvstore=kv)
x = mx.nd.ones((2, 4)) * (kv.rank + 1)
for _ in range(3):
    with autograd.record():
        loss = net(x).sum()
    loss.backward()
    trainer.step(2)
weight = net.weight.data().asnumpy()
print("weight", float(weight.min()), float(weight.max()), flush=True)
kv._barrier()
if kv.rank == 0:
    print("after", services(), flush=True)
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads /proc")
def test_the_launchers_scheduler_and_servers_load_mxnets_package_only_for_an_optimizer(
        tmp_path):
    """The launcher's ps-lite scheduler and servers (dist_gluon.launch.pslite_service) run on
    MXNet's library alone, and a server imports MXNet's package when a plain
    gluon.Trainer sends it its optimizer, which then trains as in one process."""
    proc = launch(SERVICES_WORKER, tmp_path, backend="dist_sync",
                  env={"DG_TEST_JOB_TOKEN": f"{os.getpid()}-{tmp_path.name}"})
    assert_ok(proc)
    # printed by ps-lite's rank 0, which the scheduler numbers in the order the workers
    # arrive (either of the launcher's ranks)
    lines = worker_lines(proc.stdout, 0) + worker_lines(proc.stdout, 1)
    assert "before {'scheduler': False, 'server': False}" in lines, proc.stdout
    assert "after {'scheduler': False, 'server': True}" in lines, proc.stdout
    # the servers sum both workers' gradients (2 * (rank + 1) per weight) and apply
    # SGD with rescale_grad 1 / batch size 2, three times
    expected = 0.5 - 3 * 0.1 * (2 * 1 + 2 * 2) / 2
    for rank in range(2):
        weights = [line.split()[1:] for line in worker_lines(proc.stdout, rank)
                   if line.startswith("weight ")]
        assert [[float(w) for w in pair] for pair in weights] == [
            [pytest.approx(expected), pytest.approx(expected)]], proc.stdout


def test_the_service_started_by_hand_as_a_worker_says_what_it_is_for():
    env = {k: v for k, v in os.environ.items() if not k.startswith("DMLC_")}
    proc = subprocess.run([sys.executable, "-m", "dist_gluon.launch.pslite_service"],
                          env=dict(env, DMLC_ROLE="worker"), cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "runs ps-lite's scheduler or a server: the launcher starts it with " \
           "DMLC_ROLE=scheduler or server" in proc.stderr
