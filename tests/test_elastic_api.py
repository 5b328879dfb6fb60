"""Elastic training, the worker's side: dg.stop_requested() gives every rank the same
answer at the same step, the backends tell the restart and re-formation counts, the
Checkpointer reports each save to the launcher, and ShardSampler.set_epoch(epoch,
skip=...) resumes inside an epoch exactly on any number of workers.

Single-process behaviour runs here (the job-control record of a launcher is made by
hand in a subprocess); the collective runs as 2 workers through the real launcher.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
from test_elastic import assert_replayed

import dist_gluon as dg
from conftest import REPO, assert_ok, launch, process_env, worker_lines
from dist_gluon import jobcontrol, worker
from dist_gluon.data import ShardSampler
from test_launch import _marker_env, assert_nothing_left


# --------------------------------------------------------------------- one process
def test_without_a_launcher_no_stop_is_ever_requested():
    assert jobcontrol.reporter() is None
    kv = dg.create("local")
    assert [dg.stop_requested(kv) for _ in range(3)] == [False, False, False]
    assert dg.stop_requested() is False


def _run_with_record(tmp_path, script: str, env: dict) -> tuple[dict, subprocess.CompletedProcess]:
    """Run ``script`` as a worker whose launcher is played by this test: its record is
    made here and read back after the script ends."""
    control = tmp_path / "control"
    control.mkdir()
    jobcontrol.create_record(str(control), 0)
    (tmp_path / "script.py").write_text(textwrap.dedent(script))
    full_env = process_env(**{"DG_CONTROL_DIR": str(control), "DG_RANK": "0",
                              "DG_NUM_WORKERS": "1", **env})
    for name in ("DG_ELASTIC", "DG_RESTART", "DG_REFORMATION"):
        if name not in env:
            full_env.pop(name, None)
    proc = subprocess.run([sys.executable, str(tmp_path / "script.py")], cwd=tmp_path,
                          env=full_env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = jobcontrol.Record(jobcontrol.record_path(str(control), 0))
    return {"acknowledged": record.stop_acknowledged, "count": record.count,
            "saved": record.saved_position, "saves": record.saves}, proc


ONE_WORKER = """
    import dist_gluon as dg
    from dist_gluon import jobcontrol

    record = jobcontrol.reporter()._record
    answers = [dg.stop_requested()]
    record.request_stop(3)          # what the launcher writes
    answers += [dg.stop_requested(), dg.stop_requested()]
    print(answers)
"""


@pytest.mark.parametrize("elastic", [False, True], ids=["plain", "elastic"])
@pytest.mark.spawns
def test_one_worker_stops_at_its_records_request_and_acknowledges_it(tmp_path, elastic):
    env = {"DG_ELASTIC": "1"} if elastic else {}
    record, proc = _run_with_record(tmp_path, ONE_WORKER, env)
    assert proc.stdout.strip() == "[False, True, True]"
    assert record["acknowledged"]
    assert record["count"] == 0         # one worker: nothing was sent


SIGTERM_UNDER_A_TOOL = """
    import os
    import signal
    import sys

    def write_data_and_end(signum, frame):       # as coverage.py's sigterm option does
        print("tool wrote its data", flush=True)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)

    write_data_and_end.__module__ = "coverage.control"
    signal.signal(signal.SIGTERM, write_data_and_end)

    import dist_gluon as dg
    from dist_gluon import jobcontrol

    record = jobcontrol.reporter()._record
    os.kill(os.getpid(), signal.SIGTERM)         # preemption: stop at the step boundary
    print("first", dg.stop_requested(), flush=True)
    os.kill(os.getpid(), signal.SIGTERM)         # the second one ends the worker
    print("not reached", flush=True)
"""


@pytest.mark.spawns
def test_sigterm_stops_an_elastic_worker_under_a_tool_whose_handler_ends_it(tmp_path):
    """A worker measured by coverage.py (its SIGTERM handler writes the data, then ends
    the process) still takes the first SIGTERM as a request to stop at a step boundary;
    the second ends it through the tool's handler."""
    control = tmp_path / "control"
    control.mkdir()
    jobcontrol.create_record(str(control), 0)
    (tmp_path / "script.py").write_text(textwrap.dedent(SIGTERM_UNDER_A_TOOL))
    env = process_env(DG_CONTROL_DIR=str(control), DG_RANK="0", DG_NUM_WORKERS="1",
                      DG_ELASTIC="1")
    proc = subprocess.run([sys.executable, str(tmp_path / "script.py")], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGTERM, proc.stderr[-3000:]
    assert proc.stdout.splitlines() == ["first True", "tool wrote its data"], proc.stdout
    assert "stops at its next step boundary" in proc.stderr


@pytest.mark.spawns
def test_one_worker_without_a_request_is_not_acknowledged(tmp_path):
    script = """
        import dist_gluon as dg
        print([dg.stop_requested() for _ in range(3)])
    """
    record, proc = _run_with_record(tmp_path, script, {"DG_ELASTIC": "1"})
    assert proc.stdout.strip() == "[False, False, False]"
    assert not record["acknowledged"]


@pytest.mark.spawns
def test_a_checkpoint_save_is_reported_to_the_launcher(tmp_path):
    script = """
        import mxnet as mx
        from mxnet import gluon
        import dist_gluon as dg

        net = gluon.nn.Dense(2)
        net.initialize()
        net(mx.nd.ones((1, 3)))
        ckpt = dg.Checkpointer("ckpt")
        ckpt.save(net, None, epoch=1)
        ckpt.save(net, None, epoch=3, step=17)
    """
    record, _ = _run_with_record(tmp_path, script, {})
    assert record["saves"] == 2
    assert record["saved"] == (3, 17)


def test_backends_report_the_restart_and_reformation_counts_of_the_worker(monkeypatch):
    kv = dg.create("local")
    monkeypatch.setattr(worker, "_context", worker.WorkerContext.from_environ({}))
    assert (kv.restart, kv.reformation) == (0, 0)
    # a re-formation in this process updates the one context the backend reads
    worker.context().update({"DG_RESTART": "3", "DG_REFORMATION": "2"})
    assert (kv.restart, kv.reformation) == (3, 2)


# --------------------------------------------------------------------- ShardSampler skip
def _order(length, seed, epoch, shuffle=True):
    """The epoch's global order, computed independently of ShardSampler."""
    if not shuffle:
        return np.arange(length)
    return np.random.default_rng([seed, epoch]).permutation(length)


@pytest.mark.parametrize("num_workers", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("last_batch", ["pad", "drop"])
def test_after_a_skip_the_ranks_share_exactly_the_rest_of_the_order(num_workers, last_batch):
    length, seed, epoch = 53, 11, 4
    order = _order(length, seed, epoch)
    for skip in (0, 1, 6, 24, 50, 52):
        rest = order[skip:]
        if last_batch == "pad":
            expected = np.resize(rest, -(-len(rest) // num_workers) * num_workers)
        else:
            expected = rest[:len(rest) // num_workers * num_workers]
        shares = []
        for rank in range(num_workers):
            sampler = ShardSampler(length, num_workers=num_workers, rank=rank, seed=seed,
                                   last_batch=last_batch)
            sampler.set_epoch(epoch, skip=skip)
            shares.append(sampler.indices())
            assert len(sampler) == len(shares[-1]) == len(expected) // num_workers
            # the padding is the last num_padded indices, beyond the rest's end
            real = len(sampler) - sampler.num_padded
            assert np.array_equal(shares[-1][:real],
                                  rest[:len(expected)][rank::num_workers])
        # interleaved back by position, the shares are the rest of the order
        assert np.array_equal(np.stack(shares, axis=1).reshape(-1), expected)


@pytest.mark.parametrize("saved_workers,resumed_workers", [(3, 2), (2, 4), (4, 3), (1, 2)])
def test_resuming_on_another_worker_count_continues_with_consecutive_chunks(
        saved_workers, resumed_workers):
    """Batch j of every rank together is positions j*B*N .. (j+1)*B*N - 1 of the rest
    of the order, so steps * B * N after a skip is exactly what a resume must skip:
    one epoch run as 5 steps on one worker count, then the rest on another, trains on
    every sample once, in the order one worker with the global batch would."""
    length, seed, epoch, batch = 101, 3, 2, 4
    order = _order(length, seed, epoch)

    def run(num_workers, skip, steps=None):
        shares = []
        for rank in range(num_workers):
            sampler = ShardSampler(length, num_workers=num_workers, rank=rank, seed=seed)
            sampler.set_epoch(epoch, skip=skip)
            shares.append(sampler.indices())
        chunks = []
        for j in range(-(-len(shares[0]) // batch) if steps is None else steps):
            chunk = np.stack([s[j * batch:(j + 1) * batch] for s in shares], axis=1)
            chunks.append(chunk.reshape(-1))
        return chunks

    first = run(saved_workers, 0, steps=5)
    skip = 5 * batch * saved_workers
    second = run(resumed_workers, skip)
    assert np.array_equal(np.concatenate(first), order[:skip])
    seen = np.concatenate(first + second)
    assert np.array_equal(seen[:length], order)
    # what is beyond the order is padding: repeats of the rest's first samples
    assert np.array_equal(seen[length:], order[skip:skip + len(seen) - length])
    for j, chunk in enumerate(second[:-1]):
        start = skip + j * batch * resumed_workers
        assert np.array_equal(chunk, order[start:start + batch * resumed_workers])


def test_a_skip_applies_to_its_epoch_only_and_a_skip_past_the_end_is_an_empty_epoch():
    sampler = ShardSampler(10, num_workers=3, rank=2, shuffle=False)
    sampler.set_epoch(0, skip=4)
    assert (list(sampler), sampler.skip, sampler.num_padded) == ([6, 9], 4, 0)
    sampler.set_epoch(1)
    assert (list(sampler), sampler.skip, len(sampler)) == ([2, 5, 8, 1], 0, 4)
    for skip in (10, 12):          # e.g. steps * B * N counting the last batch's padding
        sampler.set_epoch(1, skip=skip)
        assert (list(sampler), len(sampler), sampler.num_padded) == ([], 0, 0)


@pytest.mark.parametrize("skip", [-1, 1.5, True, "3", None])
def test_a_bad_skip_raises_a_value_error_naming_it(skip):
    sampler = ShardSampler(10, num_workers=2, rank=0)
    with pytest.raises(ValueError, match="skip must be an int >= 0"):
        sampler.set_epoch(0, skip=skip)


# --------------------------------------------------------------------- distributed
STOP_WORKER = """
    import json
    import sys

    import mxnet as mx
    from mxnet import gluon
    import dist_gluon as dg
    from dist_gluon import jobcontrol, worker

    kv = dg.create()
    record = jobcontrol.reporter()._record
    result = {"restart": kv.restart, "reformation": kv.reformation,
              "acknowledged_before": record.stop_acknowledged}

    # outside an elastic job the answer is this rank's record alone: nothing is sent
    worker.context().elastic = False
    count = record.count
    result["plain_answer"] = dg.stop_requested()
    result["plain_sent"] = record.count - count
    worker.context().elastic = True

    stopped = None
    for step in range(1, 21):
        grad = mx.nd.ones((3,)) * (kv.rank + 1)
        kv.pushpull("grad", grad)           # the step's gradient sum
        assert grad.asnumpy().tolist() == [3.0, 3.0, 3.0]
        if kv.rank == 1 and step == 5:
            record.request_stop(1)          # what the launcher writes, on rank 1 only
        if dg.stop_requested():
            stopped = step
            break
    result["stopped"] = stopped
    result["acknowledged"] = record.stop_acknowledged
    result["saved_before"] = record.saved_position

    net = gluon.nn.Dense(2)
    net.initialize()
    net(mx.nd.ones((1, 3)))
    dg.Checkpointer(sys.argv[1]).save(net, None, epoch=0, step=stopped)
    result["saved"] = record.saved_position
    with open(f"result{kv.rank}.json", "w") as f:
        json.dump(result, f)
    sys.exit(0)                             # a normal exit, as after a stop
"""


# p3's stop is the one of tests/test_elastic.py's p3 job (a preemption)
@pytest.mark.parametrize("backend", ["horovod", "dist_sync", "dist_async"])
@pytest.mark.spawns
def test_a_stop_asked_of_one_rank_stops_every_rank_at_the_same_step(tmp_path, backend):
    proc = launch(STOP_WORKER, tmp_path, backend=backend, args=[str(tmp_path / "ckpt")],
                  env={"DG_ELASTIC": "1"})
    assert_ok(proc)
    results = [json.loads((tmp_path / f"result{r}.json").read_text()) for r in (0, 1)]
    for rank, result in enumerate(results):
        assert result["stopped"] == 5, (rank, result, worker_lines(proc.stdout, rank))
        assert result["acknowledged"] and not result["acknowledged_before"]
        assert result["plain_answer"] is False and result["plain_sent"] == 0
        assert (result["restart"], result["reformation"]) == (0, 0)
        assert result["saved_before"] is None
        assert result["saved"] == [0, 5]
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["ckpt-000001"]


# --------------------------------------------------------------------- the examples
# Runs an example as the launcher would, after rank 1's record was asked to stop before
# the first step (the launcher writes the request; here the worker plays that part).
STOPPED_EXAMPLE = """
    import os
    import runpy
    import sys

    from dist_gluon import jobcontrol

    example = sys.argv[1]
    if os.environ["DG_RANK"] == "1":
        jobcontrol.reporter()._record.request_stop(1)
    sys.path.insert(0, os.path.dirname(example))
    sys.argv = sys.argv[1:]
    runpy.run_path(example, run_name="__main__")
"""


@pytest.mark.slow
def test_the_mnist_example_stops_at_a_request_and_resumes_inside_the_epoch_on_one_worker(
        tmp_path):
    example = REPO / "examples" / "mnist" / "train_gluon.py"
    common = ["--epochs", "1", "--batch-size", "32", "--checkpoint-dir",
              str(tmp_path / "ckpt"), "--resume"]
    proc = launch(STOPPED_EXAMPLE, tmp_path, backend="horovod",
                  args=[str(example), *common], env={"DG_ELASTIC": "1"})
    assert_ok(proc)
    lines = worker_lines(proc.stdout, 0)
    # both workers stopped after their first batch of 32: 64 samples of 1438 are done
    assert lines[-1] == ("stop: the launcher asked the job to stop; checkpoint of epoch 1 "
                         "after 64 of its 1438 samples saved, exiting for the restart "
                         "(--resume)"), lines[-5:]
    assert not any(line.startswith("summary:") for line in lines)

    resumed = subprocess.run([sys.executable, str(example), *common], cwd=tmp_path,
                             env=process_env(),
                             capture_output=True, text=True, timeout=240)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    lines = resumed.stdout.splitlines()
    assert ("resume: continuing inside epoch 1 after 64 of its 1438 samples (saved by 2 "
            f"worker(s)) from {tmp_path / 'ckpt'}") in lines
    # one worker trains on the other 1374 samples: 43 batches of 32
    assert any(line.startswith("epoch 1/1 [ 43/43]") for line in lines), lines
    assert lines[-1].startswith("summary: ") and "workers=1" in lines[-1]


# --------------------------------------------------------------------- one node
@pytest.mark.spawns
def test_a_one_node_elastic_job_checkpoints_at_sigterm_and_resumes_there_on_fewer_workers(
        tmp_path):
    """--nnodes 1:1: SIGTERM to the launcher (a preemption notice) stops both workers at
    one step boundary with a checkpoint and ends the job with 143; the job started again
    on one worker resumes there and ends at the weights of that schedule in NumPy."""
    script = REPO / "tests" / "workers" / "elastic_train.py"
    marker = _marker_env()
    env = process_env(**marker)

    def start(n):
        return subprocess.Popen(
            [sys.executable, "-m", "dist_gluon.launch", "--nnodes", "1:1", "-n", str(n),
             "--backend", "horovod", "--", sys.executable, str(script), str(tmp_path)],
            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True)

    job = start(2)
    progress, deadline = tmp_path / "progress.json", time.monotonic() + 120
    while not (progress.exists() and progress.read_text()
               and json.loads(progress.read_text())["steps"] >= 2):
        assert job.poll() is None and time.monotonic() < deadline, job.communicate()[0]
        time.sleep(0.1)
    job.send_signal(signal.SIGTERM)
    output = job.communicate(timeout=60)[0]
    assert job.returncode == 128 + signal.SIGTERM, output
    assert "was preempted (SIGTERM)" in output and "the workers saved checkpoint" in output
    assert_nothing_left(marker["DG_TEST_MARKER"])
    events = [json.loads(line) for line in (tmp_path / "events.jsonl").open()]
    saved = [e for e in events if e["event"] == "save"][-1]
    assert saved["world"] == 2, events

    (tmp_path / "finish").touch()
    job = start(1)
    output = job.communicate(timeout=120)[0]
    assert job.returncode == 0, output
    events = [json.loads(line) for line in (tmp_path / "events.jsonl").open()]
    second = [e for e in events if e["event"] == "start"][1]
    assert (second["world"], second["epoch"], second["samples"]) == \
        (1, saved["epoch"], saved["samples"]), events
    assert_replayed(events, output)
    assert_nothing_left(marker["DG_TEST_MARKER"])
