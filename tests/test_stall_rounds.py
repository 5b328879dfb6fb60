"""The stall detector in every round: ranks that call different collectives after a
re-formation are reported as in the first round (the ranks and their collectives
named, their stacks printed) and --stall-timeout ends the job."""
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from conftest import process_env

SCRIPT = Path(__file__).parent / "workers" / "stall_after_reform.py"
WARNING, TIMEOUT = 5, 12


def _timed_lines(stream, lines):
    for line in stream:
        lines.append((time.monotonic(), line.rstrip("\n")))


@pytest.mark.parametrize("backend", ["horovod", "dist_sync"])
def test_ranks_in_different_collectives_after_a_reformation_are_a_reported_stall(
        tmp_path, backend):
    """horovod: the survivor keeps its process (an in-process re-formation); dist_sync:
    both workers restart from the node's copy. Then rank 0 waits in a sum of its own
    and rank 1 in the commit's stop flag, each having submitted as many collectives
    (which the detector had taken for ranks computing): the stall is reported within
    --stall-warning + 5 s, naming both ranks and their keys with their stacks, and
    --stall-timeout ends the job with status 124."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "dist_gluon.launch", "--nnodes", "1:1", "-n", "2",
         "--backend", backend, "--max-restarts", "1", "--stall-warning", str(WARNING),
         "--stall-timeout", str(TIMEOUT), "--", sys.executable, str(SCRIPT)],
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
    text = "\n".join(line for _, line in lines)
    report = text[-6000:]
    assert "from the workers' last commit in memory" in text or "node's copy" in text \
        or "restarting" in text, report
    injected = next(t for t, line in lines if "sums a tensor of its own" in line)
    stalls = [(t, line) for t, line in lines if "stall: ranks 0, 1" in line]
    assert stalls, report
    first, line = stalls[0]
    assert first - injected <= WARNING + 5, report
    assert "'extra'" in line and "rank 0" in line and "rank 1" in line, report
    assert "Python stacks of rank 0" in text and "Python stacks of rank 1" in text, report
    assert f"stall timeout ({TIMEOUT} s)" in text, report
    assert proc.returncode == 124, report
    # the survivor's horovod error at the loss is followed by a line saying it is
    # expected (dist_gluon.launch.processes)
    texts = [line for _, line in lines]
    for at, line in enumerate(texts):
        if "Horovod background loop uncaught exception" in line:
            assert "dist_gluon: expected: the horovod error above" in texts[at + 1], report
