"""docs/elastic.md's first script, examples/elastic/train_in_memory.py, does what the
guide says: on one machine, a worker killed while it trains is replaced and the job
ends with the weights of a run that lost no worker."""
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from conftest import process_env

EXAMPLE = Path(__file__).parents[1] / "examples" / "elastic" / "train_in_memory.py"


def _run(tmp_path, backend, kill_rank=None, flags=()):
    # the sync check every 5 steps (48 in all): it runs after the heal too
    proc = subprocess.Popen(
        [sys.executable, "-m", "dist_gluon.launch", *flags, "-n", "2",
         "--backend", backend, "--max-restarts", "1", "--", sys.executable, str(EXAMPLE),
         "--epochs", "3", "--pace", "0.05"],
        cwd=tmp_path, env=process_env(DG_CHECK_SYNC="5"), stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    readers = [threading.Thread(target=lambda s=s: lines.extend(s), daemon=True)
               for s in (proc.stdout,)]
    for r in readers:
        r.start()
    stderr = []
    err = threading.Thread(target=lambda: stderr.extend(proc.stderr), daemon=True)
    err.start()
    try:
        if kill_rank is not None:
            _kill_worker_when_training(proc.pid, kill_rank, lines)
        proc.wait(timeout=180)
    finally:
        proc.kill()
        for r in (*readers, err):
            r.join(10)
    return proc.returncode, "".join(lines), "".join(stderr)


def _kill_worker_when_training(launcher: int, rank: int, lines: list[str]) -> None:
    """SIGKILL the launcher's worker of ``rank`` once the job has trained its first
    epoch (as a user would from another terminal)."""
    deadline = time.monotonic() + 120
    while not any(line.startswith("[0] epoch 0:") for line in list(lines)):
        assert time.monotonic() < deadline, "the job never finished its first epoch"
        time.sleep(0.05)
    children = subprocess.run(["pgrep", "-P", str(launcher)], capture_output=True,
                              text=True).stdout.split()
    for pid in children:
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                environ = f.read().split(b"\0")
        except OSError:
            continue
        if f"DG_RANK={rank}".encode() in environ:
            os.kill(int(pid), signal.SIGKILL)
            return
    raise AssertionError(f"no worker of rank {rank} under launcher {launcher}")


@pytest.mark.parametrize("backend,variants", [
    ("horovod", [(), ("--nnodes", "1:1")]), ("dist_sync", [(), ("--nnodes", "1:1")]),
    ("p3", [()])])
def test_the_guides_first_script_heals_a_killed_worker_to_the_uninterrupted_weights(
        tmp_path, backend, variants):
    """As the guide says to try it (-n 2 --max-restarts 1 on one machine), and with
    --nnodes 1:1, which it is the same as; the sync check runs before and after."""
    code, stdout, stderr = _run(tmp_path, backend)
    assert code == 0, stderr[-3000:]
    whole = re.search(r"trained 3 epochs on 2 workers; bias (\S+)", stdout)
    assert whole, stdout[-2000:]
    for flags in variants:
        code, stdout, stderr = _run(tmp_path, backend, kill_rank=1, flags=flags)
        report = f"{flags}\n" + stdout[-2000:] + stderr[-3000:]
        assert code == 0, report
        assert "was killed by SIGKILL" in stderr, report
        assert "last commit in memory" in stderr or "node's" in stderr, report
        assert "keeps a dist_gluon.elastic.State" not in stderr, report
        healed = re.search(r"trained 3 epochs on 2 workers; bias (\S+)", stdout)
        assert healed and healed[1] == whole[1], report
