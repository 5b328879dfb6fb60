"""docs/elastic.md's first script, examples/elastic/train_in_memory.py, does what the
guide says: on one machine, a worker killed while it trains is replaced and the job
ends with the weights of a run that lost no worker, passing the sync check
(DG_CHECK_SYNC) after the heal."""
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import (
    cannot_reset_connections,
    child_with,
    process_env,
    read_pipes,
    reset_connections,
)

EXAMPLE = Path(__file__).parents[1] / "examples" / "elastic" / "train_in_memory.py"


def _run(tmp_path, backend, kill_rank=None, flags=(), reset_rank=None, stop_rank=None,
         restarts=1, env=None):
    proc = subprocess.Popen(
        [sys.executable, "-m", "dist_gluon.launch", *flags, "-n", "2",
         "--backend", backend, "--max-restarts", str(restarts), "--", sys.executable,
         str(EXAMPLE), "--epochs", "3", "--pace", "0.05"],
        # the ranks compare their weights every 7 steps: several times after the heal
        cwd=tmp_path, env=process_env(DG_CHECK_SYNC="7", **(env or {})),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    stopped = None
    out, err, readers = read_pipes(proc)
    try:
        if kill_rank is not None:
            _kill_worker_when_training(proc.pid, kill_rank, out)
        if reset_rank is not None:
            _reset_worker_when_training(proc.pid, reset_rank, out)
        if stop_rank is not None:
            stopped = _worker_in_second_epoch(proc.pid, stop_rank, out)
            os.kill(stopped, signal.SIGSTOP)
        proc.wait(timeout=180)
    except subprocess.TimeoutExpired:
        # the launcher's own report of the hang (the stall detector's) is in its stderr
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        finally:
            proc.kill()
            for reader in readers:
                reader.join()
        raise AssertionError("the job did not end in 180 s\n--- stdout\n"
                             + "".join(out)[-3000:] + "\n--- stderr\n"
                             + "".join(err)[-8000:]) from None
    finally:
        proc.kill()
        if stopped is not None:
            try:
                os.kill(stopped, signal.SIGKILL)    # if the launcher did not
            except ProcessLookupError:
                pass
        for reader in readers:
            reader.join()
    return proc.returncode, "".join(out), "".join(err)


def _kill_worker_when_training(launcher: int, rank: int, out: list[str]) -> None:
    """SIGKILL the launcher's worker of ``rank`` in the second epoch (as a user would
    from another terminal): once rank 0 has printed the first epoch's line, whenever
    the workers took to start."""
    os.kill(_worker_in_second_epoch(launcher, rank, out), signal.SIGKILL)


def _reset_worker_when_training(launcher: int, rank: int, out: list[str]) -> None:
    """Reset every TCP connection of the launcher's worker of ``rank`` in the second
    epoch (``ss -K``, as a network fault would: the process goes on)."""
    reset_connections(_worker_in_second_epoch(launcher, rank, out))


def _worker_in_second_epoch(launcher: int, rank: int, out: list[str]) -> int:
    """The pid of the launcher's worker of ``rank``, once rank 0 has printed the first
    epoch's line (whenever the workers took to start) and 0.3 s more."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not any("epoch 0:" in line for line in out):
        time.sleep(0.05)
    time.sleep(0.3)                     # into the second epoch
    pid = child_with(launcher, f"DG_RANK={rank}".encode())
    if pid is None:
        raise AssertionError(f"no worker of rank {rank} under launcher {launcher} in the "
                             f"second epoch; its output: {''.join(out)[-2000:]}")
    return pid


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


def test_a_connection_reset_between_live_workers_re_forms_the_job_around_them(tmp_path):
    """A network fault, not a lost process: every TCP connection of rank 1 is reset in
    the second epoch (``ss -K``) while both workers go on running. Their collectives fail
    and both leave the round; with no process lost, only the launcher can end the round,
    and it does (it had waited forever): the job re-forms around the same two processes
    and ends with the weights of a run without the fault, the sync check passing."""
    reason = cannot_reset_connections()
    if reason is not None:
        pytest.skip(reason)
    code, stdout, stderr = _run(tmp_path, "horovod")
    assert code == 0, stderr[-3000:]
    whole = re.search(r"trained 3 epochs on 2 workers; bias (\S+)", stdout)
    # a second restart for a worker Gloo aborts after the reset (a second error on one
    # connection in its I/O thread: SIGABRT, about 1 run in 8 here), replaced as a lost one
    code, stdout, stderr = _run(tmp_path, "horovod", reset_rank=1, restarts=2)
    report = stdout[-2000:] + stderr[-4000:]
    assert code == 0, report
    # or Gloo aborted the reset worker in that round already (seen across hosts, 1 run
    # in 4: test_elastic_memory), and it was replaced as a lost one
    assert ("failed while every worker still ran (no process was lost" in stderr
            or re.search(r"rank 1 \(\S+\) was killed by SIGABRT", stderr)), report
    assert "last commit in memory (their processes stay" in stderr, report
    assert "terminated the rest of the job" not in stderr, report
    healed = re.search(r"trained 3 epochs on 2 workers; bias (\S+)", stdout)
    assert healed and healed[1] == whole[1], report


def test_a_stopped_worker_is_killed_and_replaced_instead_of_holding_the_job(tmp_path):
    """A worker that stops running without dying (SIGSTOP in the second epoch: a hung
    process). Its peer's collectives time out and it leaves the round; the launcher ends
    the round 10 s later (its peers' collectives would fail by themselves; a stopped
    worker never leaves). The stopped worker is kept, as a live process, and handed the
    next round, which it cannot enter: after DG_ENTER_LIMIT seconds its launcher kills
    it, saying why, and the round after replaces it with a new worker that heals from
    its peer. The job ends with the weights of a run without the fault."""
    code, stdout, stderr = _run(tmp_path, "horovod")
    assert code == 0, stderr[-3000:]
    whole = re.search(r"trained 3 epochs on 2 workers; bias (\S+)", stdout)
    code, stdout, stderr = _run(tmp_path, "horovod", stop_rank=1, restarts=2,
                                env={"DG_ENTER_LIMIT": "3"})
    report = stdout[-2000:] + stderr[-4000:]
    assert code == 0, report
    assert "a peer stopped running" in stderr, report
    assert re.search(r"rank 1 \(\S+\) was killed by its launcher: it did not enter "
                     r"round 1 within 3 s of being handed it", stderr), report
    healed = re.search(r"trained 3 epochs on 2 workers; bias (\S+)", stdout)
    assert healed and healed[1] == whole[1], report
