"""No hang is silent, and every failure names the rank that caused it.

The fault matrix of issue 11: on every backend, rank 1 (and then rank 0) leaves in each
way a script can leave, while the other rank waits in a collective it will never join.
Each job must end within FAILURE_DEADLINE of the fault, exit non-zero, name the rank
that left first with how and why it left, and leave no process behind.
"""
from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import time

import pytest

from conftest import (
    DISTRIBUTED_BACKENDS,
    TRAINING_BACKENDS,
    child_with,
    launch,
    read_pipes,
    worker_lines,
)
from test_launch import _launcher_argv, _launcher_env, _marker_env, _report, assert_nothing_left

FAILURE_DEADLINE = 10.0

# argv: mode, faulty rank. Both ranks join two collectives ('connect' and 'warm'); then
# the faulty rank leaves in its way while the other submits collective #3, 'never'.
FAULT_WORKER = """
import os
import sys
import time

import mxnet as mx

import dist_gluon as dg

mode, faulty = sys.argv[1], int(sys.argv[2])
kv = dg.create()
warm = mx.nd.ones((4,))
kv.pushpull("warm", warm)
warm.wait_to_read()


def load_next_batch():
    time.sleep(300)          # a deadlocked data loader


if kv.rank == faulty:
    print(f"FAILING_AT {time.time()!r}", flush=True)
    print(f"rank {faulty} is about to fail by {mode}", file=sys.stderr, flush=True)
    if mode == "raise":
        raise RuntimeError(f"rank {faulty} fails on purpose")
    if mode == "systemexit":
        raise SystemExit("data directory missing")
    if mode == "exit3":
        sys.exit(3)
    if mode == "exit":
        exit()
    if mode == "sigkill":
        os.kill(os.getpid(), 9)
    if mode == "sleep":
        load_next_batch()
    if mode == "early":
        pass                 # returns: fewer steps than the other rank
else:
    never = mx.nd.ones((4,))
    kv.pushpull("never", never)
    never.wait_to_read()
    print("the other rank should never get here", flush=True)
"""

HOW = {
    "raise": "failed (RuntimeError: rank {r} fails on purpose)",
    "systemexit": "exited (SystemExit: data directory missing)",
    "exit3": "exited (SystemExit: 3)",
    "exit": "finished its script (exit status 0)",
    "early": "finished its script (exit status 0)",
    "sigkill": "was killed by SIGKILL",
}
STATUS = {"raise": 1, "systemexit": 1, "exit3": 3, "exit": 1, "early": 1, "sigkill": 137}


def _run_fault(tmp_path, backend, mode, faulty, launcher_args=()):
    env = _marker_env()
    proc = launch(FAULT_WORKER, tmp_path, backend, n=2, args=[mode, str(faulty)], env=env,
                  launcher_args=launcher_args, timeout=120)
    ended = time.time()
    failing_at = [float(line.split()[1]) for line in worker_lines(proc.stdout, faulty)
                  if line.startswith("FAILING_AT ")]
    assert failing_at, f"rank {faulty} never reached its fault\n" + _report(proc)
    assert "the other rank should never get here" not in proc.stdout
    assert_nothing_left(env["DG_TEST_MARKER"])
    return proc, ended - failing_at[0]


# Every way of leaving, by either rank, on horovod; on dist_sync (whose ranks play the
# same part in a failure) rank 0 leaves only without an error, the deadlock cases. P3 is
# dist_sync's job with another van: the launcher names the cause from the same records
# and exit statuses, so P3 runs one leaving with an error, one kill and one deadlock,
# the cases where its van could leave the waiting rank stuck differently.
_P3_LEAVING = {("raise", 1), ("sigkill", 1), ("early", 0)}
_LEAVING = [(b, mode, faulty) for b in DISTRIBUTED_BACKENDS for mode in HOW for faulty in (1, 0)
            if b == "horovod" or (b == "dist_sync" and (faulty == 1 or mode in ("exit", "early")))
            or (b == "p3" and (mode, faulty) in _P3_LEAVING)]


@pytest.mark.parametrize("backend, mode, faulty", _LEAVING)
@pytest.mark.spawns
def test_a_rank_that_leaves_while_the_other_waits_is_named_as_the_cause(
        tmp_path, backend, mode, faulty):
    proc, took = _run_fault(tmp_path, backend, mode, faulty)
    other = 1 - faulty
    assert proc.returncode == STATUS[mode], _report(proc)
    assert took < FAILURE_DEADLINE, f"took {took:.1f} s\n" + _report(proc)
    host = socket.gethostname()
    cause = (f"rank {faulty} ({host}) {HOW[mode].format(r=faulty)} after 2 collectives; "
             f"rank {other} waits in collective #3 (key 'never').")
    assert cause in proc.stderr, _report(proc)
    # the cause comes first; what the other rank hit afterwards is only a consequence
    assert f"rank {other} ({host}) failed" not in proc.stderr.split(cause)[0]
    if mode in ("raise", "exit3", "sigkill"):
        # the cause's report ends with the last lines the rank wrote to its stderr
        report = proc.stderr[proc.stderr.index(cause):]
        assert f"last lines of rank {faulty}'s stderr" in report, _report(proc)
        assert f"rank {faulty} is about to fail by {mode}" in report, _report(proc)
        if mode == "raise":
            assert f"RuntimeError: rank {faulty} fails on purpose" in report, _report(proc)
    if mode in ("exit", "early"):
        assert "tip: " in proc.stderr and "ShardSampler" in proc.stderr
    if mode == "systemexit":
        assert "data directory missing" in proc.stderr


# Either rank stuck on horovod, where rank 0 plays its own part (it coordinates); on
# ps-lite, whose ranks play the same part, rank 1.
@pytest.mark.parametrize("backend, faulty", [("horovod", 1), ("horovod", 0),
                                             ("dist_sync", 1), ("p3", 1)])
@pytest.mark.spawns
def test_a_rank_stuck_outside_any_collective_is_reported_with_its_stack(
        tmp_path, backend, faulty):
    proc, took = _run_fault(tmp_path, backend, "sleep", faulty,
                            launcher_args=["--stall-warning", "2", "--stall-timeout", "5"])
    other = 1 - faulty
    assert proc.returncode == 124, _report(proc)
    assert took < 5 + FAILURE_DEADLINE, _report(proc)
    warning = re.search(rf"stall: rank {other} has waited \d+ s in collective #3 "
                        rf"\(key 'never'\) that rank {faulty} \(.*\) has not reached "
                        rf"\(last submitted: #2, key 'warm'\)", proc.stderr)
    assert warning, _report(proc)
    stacks = proc.stderr[warning.end():]
    assert f"Python stacks of rank {faulty} (every thread):" in stacks
    assert "in load_next_batch" in stacks
    assert "The job keeps running" in proc.stderr      # the warning came first
    assert "stall timeout (5 s)" in proc.stderr


@pytest.mark.spawns
def test_a_stall_only_warns_without_stall_timeout(tmp_path):
    script = """
    import time
    import mxnet as mx
    import dist_gluon as dg

    kv = dg.create()
    if kv.rank == 0:
        time.sleep(4)        # rank 0 evaluates or saves while rank 1 waits
    kv.barrier()
    print("both passed the barrier", flush=True)
    """
    proc = launch(script, tmp_path, "horovod", n=2,
                  launcher_args=["--stall-warning", "1.5"], timeout=120)
    assert proc.returncode == 0, _report(proc)
    assert "stall: rank 1 has waited" in proc.stderr
    assert "in <module>" in proc.stderr
    assert worker_lines(proc.stdout, 0) == ["both passed the barrier"]


@pytest.mark.parametrize("backend", ["horovod", "dist_sync"])
@pytest.mark.spawns
def test_the_cause_is_named_on_every_attempt_with_max_restarts(tmp_path, backend):
    proc, _ = _run_fault(tmp_path, backend, "systemexit", 1,
                         launcher_args=["--max-restarts", "1"])
    assert proc.returncode == 1, _report(proc)
    cause = "rank 1 ({}) exited (SystemExit: data directory missing) after 2 collectives"
    assert proc.stderr.count(cause.format(socket.gethostname())) == 2, _report(proc)
    assert "restarting the job on every node (1 of 1)" in proc.stderr


@pytest.mark.parametrize("backend", TRAINING_BACKENDS)
@pytest.mark.spawns
def test_a_rank_that_never_creates_a_backend_is_the_cause(tmp_path, backend):
    script = """
    import os
    import sys
    import dist_gluon as dg

    if os.environ["DG_RANK"] == "1":
        sys.exit(0)          # never joins the job
    kv = dg.create()
    print("rank 0 should never get here", flush=True)
    """
    env = _marker_env()
    proc = launch(script, tmp_path, backend, n=2, env=env, timeout=120)
    assert proc.returncode == 1, _report(proc)
    assert (f"rank 1 ({socket.gethostname()}) exited with status 0 after 0 collectives; "
            f"rank 0 waits in collective #1 (key 'connect ({backend})')") in proc.stderr, \
        _report(proc)
    assert "never created a dist_gluon backend" in proc.stderr
    assert_nothing_left(env["DG_TEST_MARKER"])


@pytest.mark.spawns
def test_a_gluon_block_entered_by_two_threads_is_explained(tmp_path):
    # gluon's own failure, made deterministic: a Block's name scope entered twice and
    # left twice, which is what two DataLoader threads calling a hybridized transform
    # for the first time do (examples/imagenet had it in one run of four).
    script = """
    import mxnet as mx
    from mxnet import gluon

    import dist_gluon as dg

    kv = dg.create()
    kv.barrier()
    if kv.rank == 1:
        block = gluon.nn.HybridSequential()
        scope = block.name_scope()
        scope.__enter__()
        scope.__enter__()            # the second thread
        scope.__exit__(None, None, None)
        scope.__exit__(None, None, None)
    kv.barrier()
    """
    proc = launch(script, tmp_path, "horovod", n=2, timeout=120)
    assert proc.returncode == 1, _report(proc)
    assert "rank 1 (" in proc.stderr and "AttributeError: 'NoneType' object has no " \
        "attribute '__exit__' (a gluon Block was called from two threads at once" \
        in proc.stderr, _report(proc)
    assert "transform.hybridize(False)" in proc.stderr


@pytest.mark.spawns
def test_an_exception_in_a_scripts_thread_ends_the_job_and_names_the_thread(tmp_path):
    script = """
    import threading

    import mxnet as mx

    import dist_gluon as dg

    kv = dg.create()
    kv.barrier()

    def prefetch():
        raise OSError("shard 7 is unreadable")

    if kv.rank == 1:
        worker = threading.Thread(target=prefetch, name="prefetcher")
        worker.start()
        worker.join()
    never = mx.nd.ones((4,))
    kv.pushpull("never", never)          # rank 0 would wait here for rank 1 forever
    never.wait_to_read()
    print("rank 1 went on without its thread", flush=True)
    """
    proc = launch(script, tmp_path, "horovod", n=2, timeout=120)
    assert proc.returncode == 1, _report(proc)
    assert "rank 1 (" in proc.stderr and "failed (OSError in thread 'prefetcher': shard 7 " \
        "is unreadable)" in proc.stderr, _report(proc)
    assert "went on without its thread" not in proc.stdout


USER_HANDLER = """
import os
import signal
import sys
import time

import dist_gluon as dg

calls = []
signal.signal(signal.SIGUSR1, lambda signum, frame: calls.append("USR1"))
signal.signal(signal.SIGUSR2, lambda signum, frame: calls.append("USR2"))
kv = dg.create()
kv.barrier()
os.kill(os.getpid(), signal.SIGUSR1)        # what a scheduler's warning does
time.sleep(0.2)
if kv.rank == 1 and sys.argv[1] == "stall":
    time.sleep(8)                            # rank 0 waits: its stacks are asked for
kv.barrier()
print("handled", ",".join(calls), flush=True)
"""


@pytest.mark.spawns
def test_a_scripts_own_sigusr1_handler_keeps_working(tmp_path):
    proc = launch(USER_HANDLER, tmp_path, "horovod", n=2, args=["plain"], timeout=120)
    assert proc.returncode == 0, _report(proc)
    assert worker_lines(proc.stdout, 0) == ["handled USR1"]


@pytest.mark.spawns
def test_the_stacks_signal_is_configurable_and_chains_to_the_scripts_handler(tmp_path):
    proc = launch(USER_HANDLER, tmp_path, "horovod", n=2, args=["stall"],
                  launcher_args=["--stacks-signal", "SIGUSR2", "--stall-warning", "2"],
                  timeout=120)
    assert proc.returncode == 0, _report(proc)
    assert "Python stacks of rank 1 (every thread):" in proc.stderr, _report(proc)
    # the script's own SIGUSR2 handler ran too, after the stacks were written
    assert worker_lines(proc.stdout, 1) == ["handled USR1,USR2"]


def test_a_bad_stacks_signal_is_a_usage_error(tmp_path):
    proc = launch("print('never')", tmp_path, "horovod", n=1,
                  launcher_args=["--stacks-signal", "SIGKILL"], timeout=60)
    assert proc.returncode == 2
    assert "--stacks-signal: DG_STACKS_SIGNAL='SIGKILL' is not a signal" in proc.stderr


STEADY_WORKER = """
import sys
import time

import mxnet as mx

import dist_gluon as dg

kv = dg.create()
value = mx.nd.ones((4,))
for step in range(int(sys.argv[1])):
    kv.pushpull("steady", value)
    value.wait_to_read()
    if step == 5 and kv.rank == 0:
        print("TRAINING", flush=True)
    time.sleep(0.05)
print("done", flush=True)
"""


@pytest.mark.spawns
def test_a_stopped_ps_lite_server_is_reported_and_the_job_goes_on_once_it_continues(
        tmp_path):
    """The job's ps-lite server stops running without dying (SIGSTOP) while the workers
    train: every worker then waits in the same pushpull, with equal collective counts
    and the same last key, so no rank is behind another, and the launcher had said
    nothing, ever. Now it reports after --stall-warning seconds of no collective on any
    rank, names the stopped server and shows the ranks' stacks; the job goes on (a
    warning only), and finishes once the server continues (SIGCONT)."""
    env = _marker_env()
    script = tmp_path / "steady.py"
    script.write_text(STEADY_WORKER)
    proc = subprocess.Popen(_launcher_argv(script, "dist_sync", launcher_args=[
        "--stall-warning", "2"], args=["200"]), cwd=tmp_path, env=_launcher_env(env),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err, readers = read_pipes(proc)
    server = None
    try:
        deadline = time.monotonic() + 60
        while not any("TRAINING" in line for line in out) and time.monotonic() < deadline:
            time.sleep(0.05)
        server = child_with(proc.pid, b"DMLC_ROLE=server")
        assert server is not None, "".join(err)[-3000:]
        os.kill(server, signal.SIGSTOP)
        deadline = time.monotonic() + 30
        while not any("stall: no rank has submitted a collective" in line for line in err) \
                and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(0.5)                     # the rest of the report
        os.kill(server, signal.SIGCONT)
        proc.wait(timeout=60)
    finally:
        if server is not None:
            try:
                os.kill(server, signal.SIGCONT)     # if the test failed with it stopped
            except ProcessLookupError:
                pass
        proc.kill()
        for reader in readers:
            reader.join()
    report = "".join(out)[-2000:] + "".join(err)[-5000:]
    assert proc.returncode == 0, report
    stderr = "".join(err)
    assert re.search(r"stall: no rank has submitted a collective for \d+ s; every rank's "
                     r"last was #\d+ \(key 'steady'\)", stderr), report
    assert re.search(rf"ps-lite server\S* \(pid {server} on \S+\) is stopped \(SIGSTOP",
                     stderr), report
    assert "Python stacks of rank 0 (every thread):" in stderr, report
    assert "stall timeout" not in stderr, report
    assert worker_lines("".join(out), 0)[-1] == "done", report
    assert_nothing_left(env["DG_TEST_MARKER"])

