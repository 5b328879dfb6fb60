"""A restarted worker runs in a warm standby: a process the launcher started while the
round before trained, with MXNet and dist_gluon imported, that runs the worker's script
as `python script.py` would (argv, __main__, its environment, its exit status)."""
import os
import re
import sys

import pytest

from conftest import launch, worker_lines
from dist_gluon.launch import standby

SCRIPT = """
import os
import signal
import sys
import time

warm = "mxnet" in sys.modules           # imported before this script ran
# read when MXNet's engine starts, at the first operation: in a standby too
os.environ["MXNET_ENGINE_TYPE"] = "ThreadedEngine"
import mxnet as mx
import dist_gluon as dg

kv = dg.create()
restart = int(os.environ["DG_RESTART"])
with open("/proc/self/cmdline", "rb") as f:
    cmdline = f.read().replace(b"\\0", b" ").decode().strip()
print(f"round {restart} rank {kv.rank} warm {warm} handed {'DG_WARM_START' in os.environ} "
      f"name {__name__} argv {sys.argv[1:]} dir {os.path.basename(sys.path[0])} "
      f"cmdline {cmdline.endswith('worker.py --flag x')}", flush=True)
total = mx.nd.ones((3,)) * (kv.rank + 1)
for step in range(4):
    kv.pushpull("t", total, out=total)
    total.wait_to_read()
    if restart == 0 and kv.rank == 1 and step == 2:
        time.sleep(4.0)             # past standby.WARM_AFTER: the standbys started
        os.kill(os.getpid(), signal.SIGKILL)
if restart == 1 and kv.rank == 0:
    sys.exit(7)                     # the exit status is the script's
"""


def _rounds(proc, rank):
    return [line for line in worker_lines(proc.stdout, rank) if line.startswith("round ")]


@pytest.mark.parametrize("backend", ["horovod", "dist_sync"])
def test_a_restarted_worker_runs_its_script_in_a_warm_standby(tmp_path, backend):
    proc = launch(SCRIPT, tmp_path, backend=backend, args=["--flag", "x"],
                  launcher_args=["--max-restarts", "1"])
    report = proc.stdout[-3000:] + proc.stderr[-3000:]
    # the second round's rank 0 exits 7: the job fails with the script's status
    assert proc.returncode == 7, report
    assert re.search(r"rank 0 \(.*\) exited \(SystemExit: 7\)", proc.stderr), report
    assert "was killed by SIGKILL" in proc.stderr, report
    for rank in (0, 1):
        engines = [line for line in worker_lines(proc.stderr, rank)
                   if "MXNet start using engine" in line]
        assert len(engines) == 2 and all(line.endswith("engine: ThreadedEngine")
                                         for line in engines), report
        first, second = _rounds(proc, rank)
        assert first.startswith(f"round 0 rank {rank} warm False handed False"), report
        assert second == (f"round 1 rank {rank} warm True handed True name __main__ argv "
                          f"['--flag', 'x'] dir {tmp_path.name} cmdline True"), report


def test_no_warm_standby_starts_restarted_workers_afresh(tmp_path):
    proc = launch(SCRIPT, tmp_path, backend="dist_sync", args=["--flag", "x"],
                  launcher_args=["--max-restarts", "1", "--no-warm-standby"])
    assert proc.returncode == 7, proc.stderr[-3000:]
    assert all(line.split()[5] == "False" for rank in (0, 1) for line in _rounds(proc, rank))


def test_which_commands_a_standby_can_run(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("")
    python = sys.executable
    assert standby.takes_over([python, str(script), "--epochs", "3"])
    assert standby.takes_over([python, "-u", str(script)])
    assert standby.takes_over([python, "-m", "pkg.train", "--x"])
    assert not standby.takes_over([python, "-c", "print(1)"])
    assert not standby.takes_over([python, str(tmp_path / "missing.py")])
    assert not standby.takes_over(["/bin/sh", "-c", f"{python} {script}"])
    assert not standby.takes_over([python])
    # the per-round and per-rank variables are the worker's, set at the hand-over
    env = standby.standby_environment({"PATH": "/bin", "OMP_NUM_THREADS": "1",
                                       "DG_RANK": "1", "DG_LOCAL_RANK": "1",
                                       "DMLC_ROLE": "server", "HOROVOD_RANK": "1",
                                       "PS_VERBOSE": "1", "DG_BACKEND": "p3"})
    # what start-up code may read (a sitecustomize: tests/lean's reads DG_ variables)
    assert env == {"PATH": "/bin", "OMP_NUM_THREADS": "1", "DG_BACKEND": "p3"}
    assert os.path.basename(sys.executable).startswith("python")
