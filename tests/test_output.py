"""The launcher never blocks on its own output: a stdout nobody reads neither stops the
workers (whose lines the launcher relays) nor supervision, and the launcher still exits
when its output stays blocked to the end."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from conftest import REPO, host_env, process_env

# every test launches a job of its own
pytestmark = pytest.mark.spawns

# Each worker prints about 6 MB (a pipe holds 64 KB), then sums a value with the other.
CHATTY = """
import os
import sys
import time

import mxnet as mx

import dist_gluon as dg

kv = dg.create()
for i in range(100000):
    print(f"line {i} of rank {kv.rank} " + "x" * 40)
sys.stdout.flush()
total = mx.nd.ones((1,))
kv.pushpull("after", total)
print(f"SUM {total.asscalar()}", flush=True)
with open(f"done{kv.rank}", "w") as f:
    f.write(repr(time.time()))
"""


def _start(tmp_path):
    (tmp_path / "chatty.py").write_text(textwrap.dedent(CHATTY))
    return subprocess.Popen([sys.executable, "-m", "dist_gluon.launch", "-n", "2",
                             "--backend", "horovod", "--transport", "gloo", "--",
                             sys.executable, str(tmp_path / "chatty.py")],
                            cwd=tmp_path, env=process_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)


def _wait_for(paths, timeout):
    limit = time.monotonic() + timeout
    while time.monotonic() < limit:
        if all(p.exists() for p in paths):
            return True
        time.sleep(0.2)
    return False


def test_workers_finish_while_nobody_reads_the_launchers_output(tmp_path):
    proc = _start(tmp_path)
    try:
        # nothing is read until both workers have finished their script
        done = _wait_for([tmp_path / "done0", tmp_path / "done1"], timeout=120)
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert done, "the workers blocked on their output while the launcher's was not read"
    assert proc.returncode == 0, err.decode()[-3000:]
    lines = out.decode().splitlines()
    assert sum(line.startswith("[0] line ") for line in lines) == 100000
    assert sum(line.startswith("[1] line ") for line in lines) == 100000
    assert "[0] SUM 2.0" in lines and "[1] SUM 2.0" in lines


def test_the_launcher_exits_though_its_output_stays_blocked(tmp_path):
    proc = _start(tmp_path)
    try:
        assert _wait_for([tmp_path / "done0", tmp_path / "done1"], timeout=120)
        # still nothing read: the launcher gives up writing after its drain deadline
        status = proc.wait(timeout=60)
    finally:
        proc.kill()
        proc.communicate()
    assert status == 0


def test_a_node_whose_output_is_blocked_keeps_its_place_in_the_job(tmp_path):
    sys.path.insert(0, str(REPO / "tools"))
    import emulated_cluster
    import pytest

    reason = emulated_cluster.skip_reason()
    if reason:
        pytest.skip(str(reason))
    (tmp_path / "chatty.py").write_text(textwrap.dedent(CHATTY))
    env = {**host_env(),
           "OMP_NUM_THREADS": "1", "DG_JOB_SECRET": "test-output-job"}
    with emulated_cluster.EmulatedCluster(num_hosts=2) as cluster:
        procs = [cluster.popen(i, [sys.executable, "-m", "dist_gluon.launch", "--nnodes", "2",
                                   "--node-rank", str(i), "--master-addr",
                                   cluster.hosts[0].address, "--master-port", "29581",
                                   "-n", "1", "--backend", "horovod", "--", sys.executable,
                                   str(tmp_path / "chatty.py")],
                               cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE)
                 for i in (0, 1)]
        try:
            # node 0's output is read as it comes; node 1's only after the job
            out0, err0 = procs[0].communicate(timeout=180)
            out1, err1 = procs[1].communicate(timeout=60)
        finally:
            for p in procs:
                p.kill()
    assert procs[0].returncode == 0, err0.decode()[-3000:]
    assert procs[1].returncode == 0, err1.decode()[-3000:]
    assert b"[1] SUM 2.0" in out1 and out1.count(b"[1] line ") == 100000


def test_a_worker_does_not_wait_forever_for_a_wedged_launcher(tmp_path):
    script = tmp_path / "finish.py"
    script.write_text(textwrap.dedent("""
        import os
        import time

        import dist_gluon as dg

        kv = dg.create()
        kv.barrier()
        with open(f"ready{kv.rank}", "w") as f:
            f.write(str(os.getpid()))
        time.sleep(2)        # the test stops the launcher meanwhile
    """))
    env = process_env(DG_LAUNCHER_SILENCE="3")
    proc = subprocess.Popen([sys.executable, "-m", "dist_gluon.launch", "-n", "2",
                             "--backend", "horovod", "--transport", "gloo", "--",
                             sys.executable, str(script)], cwd=tmp_path, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        ready = [tmp_path / "ready0", tmp_path / "ready1"]
        assert _wait_for(ready, timeout=120)
        os.kill(proc.pid, signal.SIGSTOP)          # a wedged launcher: alive, silent
        pids = [int(p.read_text()) for p in ready]
        limit = time.monotonic() + 30
        while time.monotonic() < limit and any(_alive(pid) for pid in pids):
            time.sleep(0.5)
        assert not any(_alive(pid) for pid in pids), "workers still wait for a verdict"
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        proc.kill()
        proc.wait()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"      # a zombie has ended
    except FileNotFoundError:
        return False
