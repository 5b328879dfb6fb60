"""The stall detector in every round: ranks that call different collectives after a
re-formation are reported as in the first round (the ranks and their collectives
named, their stacks printed) and --stall-timeout ends the job, whatever made the
collectives differ: a user's own sum, a sync check on one rank, Local SGD's round
synchronised on one rank, a SyncBatchNorm forward on one rank
(tests/workers/stall_after_reform.py injects each)."""
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from conftest import process_env

SCRIPT = Path(__file__).parent / "workers" / "stall_after_reform.py"
WARNING, TIMEOUT = 4, 9
# kind -> (the line the worker prints as the mismatch starts, a key the report names)
KINDS = {
    "sum": ("rank 0 sums a tensor of its own", "'extra'"),
    "sync_check": ("rank 1 compares the weights every step", ".sync'"),
    "local_sgd": ("rank 0 synchronises the Local SGD round alone", ".outer."),
    "syncbn": ("rank 0 runs a training-mode forward through SyncBatchNorm alone",
               "'syncbn.0.forward'"),
}
# Every kind on both backends is 8 jobs of ~15 s: make test runs each kind once and
# each backend (the kinds that found bugs where they did); make test-stalls
# (DG_STALL_KINDS=all) runs every pair.
CASES = [(kind, backend) for kind in KINDS for backend in ("horovod", "dist_sync")]
SUBSET = [("sum", "horovod"), ("sum", "dist_sync"), ("syncbn", "horovod"),
          ("sync_check", "dist_sync"), ("local_sgd", "dist_sync")]


def _timed_lines(stream, lines):
    for line in stream:
        lines.append((time.monotonic(), line.rstrip("\n")))


def _run(tmp_path, backend, kind):
    proc = subprocess.Popen(
        [sys.executable, "-m", "dist_gluon.launch", "--nnodes", "1:1", "-n", "2",
         "--backend", backend, "--max-restarts", "1", "--stall-warning", str(WARNING),
         "--stall-timeout", str(TIMEOUT), "--", sys.executable, str(SCRIPT),
         "--kind", kind],
        cwd=tmp_path, env=process_env(), stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE, text=True)
    lines: list[tuple[float, str]] = []
    reader = threading.Thread(target=_timed_lines, args=(proc.stderr, lines))
    reader.start()
    try:
        proc.wait(timeout=180)
    finally:
        proc.kill()
        reader.join()
    return proc.returncode, lines


@pytest.mark.spawns
@pytest.mark.parametrize("kind,backend", CASES if os.environ.get("DG_STALL_KINDS") == "all"
                         else SUBSET)
def test_ranks_in_different_collectives_after_a_reformation_are_reported(
        tmp_path, kind, backend):
    """horovod: the survivor keeps its process (an in-process re-formation); dist_sync:
    both workers restart from the node's copy. Then the ranks call different
    collectives (``kind``): the stall is reported within --stall-warning + 5 s of the
    mismatch, naming both ranks and the mismatched collective with their stacks, and
    --stall-timeout ends the job with status 124. On dist_sync, ranks that create
    different keys at once (rank 1's first sync check against rank 0's first commit)
    fail at once instead, each with an error that says so (ps-lite would give both
    keys one number and sum one rank's tensor into the other's)."""
    status, lines = _run(tmp_path, backend, kind)
    text = "\n".join(line for _, line in lines)
    report = text[-6000:]
    assert "restarting the job on every node (1 of 1) from the workers' last commit in " \
        "memory" in text, report
    started, key = KINDS[kind]
    injected = next((t for t, line in lines if started in line), None)
    assert injected is not None, report
    if (kind, backend) == ("sync_check", "dist_sync"):
        errors = [(t, line) for t, line in lines if "the ranks call different collectives"
                  in line and line.startswith("dist_gluon.launch:")]
        assert errors and errors[0][0] - injected <= WARNING + 5, report
        assert key in text and "'__dg_stop'" in text, report
        assert status == 1, report
        return
    stalls = [(t, line) for t, line in lines
              if t >= injected and line.startswith("dist_gluon.launch: stall:")]
    assert stalls, report
    first, line = stalls[0]
    assert first - injected <= WARNING + 5, report
    assert key in line and "rank 0" in line and "rank 1" in line, report
    after = text[text.index(line):]
    assert "Python stacks of rank" in after and "File " in after, report
    assert f"stall timeout ({TIMEOUT} s)" in after, report
    assert status == 124, report
    # the survivor's horovod error at the loss is followed by a line saying it is
    # expected (dist_gluon.launch.processes)
    texts = [line for _, line in lines]
    for at, line in enumerate(texts):
        if "Horovod background loop uncaught exception" in line:
            assert "dist_gluon: expected: the horovod error above" in texts[at + 1], report
