"""Observability through the real launcher: the ranks' weights compared every N steps
(DG_CHECK_SYNC), the job's timeline (--timeline) and the per-rank report with the
straggler named (--report)."""
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from conftest import assert_ok, launch, process_env
from dist_gluon.launch import report

# Rank 1 waits SLOW seconds for each batch (its data loader is slow); the others wait
# for rank 1 in every step's sums.
SLOW = 0.12
STRAGGLING = """
import sys, time
import mxnet as mx
from mxnet import autograd, gluon
import dist_gluon as dg
from dist_gluon import timeline

kv = dg.create()
net = gluon.nn.HybridSequential()
net.add(gluon.nn.Dense(32, activation="relu", in_units=16), gluon.nn.Dense(4, in_units=32))
net.initialize(mx.init.Xavier())
trainer = dg.DistributedTrainer(net.collect_params(), "sgd", {"learning_rate": 0.1},
                                compression=sys.argv[2] if len(sys.argv) > 2 else None)

def batches(n):
    for _ in range(n):
        if kv.rank == 1:
            time.sleep(float(sys.argv[1]))
        yield mx.nd.random.uniform(shape=(8, 16)), mx.nd.zeros((8, 4))

for x, y in timeline.data(batches(10)):
    with autograd.record():
        loss = gluon.loss.L2Loss()(net(x), y)
    loss.backward()
    trainer.step(8)
    loss.mean().asscalar()
"""


@pytest.fixture(scope="module")
def straggling_job(tmp_path_factory):
    """One job of 3 ranks, rank 1 slow to get its data, with the timeline and the
    report as JSON."""
    tmp_path = tmp_path_factory.mktemp("straggling")
    proc = launch(STRAGGLING, tmp_path, n=3, args=[str(SLOW), "fp16"],
                  launcher_args=["--timeline", str(tmp_path / "job.json"),
                                 "--report", "json"])
    assert_ok(proc)
    return proc, tmp_path / "job.json"


@pytest.mark.spawns
def test_timeline_is_one_chrome_trace_with_a_track_per_rank_and_its_steps(straggling_job):
    proc, path = straggling_job
    trace = json.loads(path.read_text())
    events = trace["traceEvents"]
    for event in events:
        assert event["ph"] in "XbeiM" and isinstance(event["pid"], int)
        assert event["ph"] == "M" or event["ts"] > 0
    names = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert [names[r].split(" (")[0] for r in (0, 1, 2)] == ["rank 0", "rank 1", "rank 2"]
    assert names[-1].startswith("launcher")
    for rank in (0, 1, 2):
        mine = [e for e in events if e["pid"] == rank]
        steps = [e for e in mine if e["name"] == "step"]
        assert [e["args"]["step"] for e in steps] == list(range(1, 11))
        assert all(e["dur"] > 0 for e in steps)
        kinds = {e["name"].split(" ")[0] for e in mine}
        assert {"data", "forward/backward", "wait", "sum", "codec", "optimizer"} <= kinds
        sums = [e for e in mine if e.get("cat") == "collective"]
        assert sorted(e["ph"] for e in sums).count("b") == len(sums) // 2
    # each gradient's sum holds the part "running" (its input was ready): on rank 0
    # its sums run while rank 1 waits for its data; rank 1's, submitted last, run short
    running = {}
    for rank in (0, 1, 2):
        spans = {}
        for e in events:
            if e["pid"] == rank and e.get("cat") == "collective":
                spans.setdefault((e["id"], e["name"] == "running"), {})[e["ph"]] = e["ts"]
        grads = [(outer, spans[(ident, True)]) for (ident, inner), outer in spans.items()
                 if not inner and not ident.endswith(".batch") and (ident, True) in spans]
        assert grads and all(o["b"] <= r["b"] <= r["e"] == o["e"] for o, r in grads)
        running[rank] = sorted(r["e"] - r["b"] for _, r in grads)[len(grads) // 2]
    assert running[0] > 0.5 * SLOW * 1e6 > running[1], running
    # rank 1's data waits are the slow loader's
    data = [e["dur"] for e in events if e["pid"] == 1 and e["name"] == "data"]
    assert min(data) >= SLOW * 1e6
    assert any(e["ph"] == "i" and e["pid"] == -1 for e in events)


@pytest.mark.spawns
def test_report_names_the_rank_slowed_by_its_data_as_the_straggler(straggling_job):
    proc, _ = straggling_job
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == 1
    got = json.loads(lines[0])
    assert [r["rank"] for r in got["ranks"]] == [0, 1, 2]
    assert all(r["steps"] == 10 and r["median"] >= SLOW for r in got["ranks"])
    assert got["straggler"]["rank"] == 1 and got["straggler"]["why"] == "data"
    assert got["straggler"]["ratio"] > 2
    assert got["ranks"][0]["shares"]["wait"] > 0.5
    assert got["ranks"][1]["shares"]["data"] > 0.5
    assert got["bound"]["kind"] == "input"


@pytest.mark.spawns
def test_report_of_two_nodes_names_the_straggler_on_the_other_node(tmp_path):
    """Node 1's launcher sends its rank's step records to node 0 with its status
    reports; node 0's report covers both ranks and names node 1's slow one."""
    script = tmp_path / "worker.py"
    script.write_text(textwrap.dedent(STRAGGLING))
    env = process_env(DG_JOB_SECRET="a-test-secret-of-enough-length-0123456789")
    port = str(29400 + os.getpid() % 90)
    procs = [subprocess.Popen(
        [sys.executable, "-m", "dist_gluon.launch", "--nnodes", "2", "--node-rank",
         str(node), "--master-addr", "127.0.0.1", "--master-port", port, "-n", "1",
         "--report", "json", "--", sys.executable, str(script), str(SLOW)],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for node in (0, 1)]
    outputs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    assert not any(line.startswith("{") for line in outputs[1][0].splitlines())
    got = json.loads(next(line for line in outputs[0][0].splitlines()
                          if line.startswith("{")))
    assert [(r["rank"], r["steps"]) for r in got["ranks"]] == [(0, 10), (1, 10)], got
    assert got["straggler"] and got["straggler"]["rank"] == 1, got
    assert got["straggler"]["why"] == "data"
    assert got["ranks"][0]["shares"]["wait"] > 0.5


def _rows(starts, ready, sums, data, period=0.1):
    """Step records of one rank: step k ends at k * period."""
    return [(k, s, s, k * period, r, m, d, 0.01 * k, 8, 4096)
            for k, (s, r, m, d) in enumerate(zip(starts, ready, sums, data), start=1)]


def test_report_of_a_rank_slowed_in_compute_names_it_and_the_table_says_so():
    # rank 2's backward ends 60 ms into each 100 ms step, the others' after 20 ms; the
    # sums arrive 10 ms after rank 2 is ready
    records = {r: _rows([0.1 * k - 0.09 for k in range(1, 9)],
                        [0.1 * k - (0.04 if r == 2 else 0.08) for k in range(1, 9)],
                        [0.1 * k - 0.03 for k in range(1, 9)], [0.0] * 8)
               for r in range(3)}
    got = report.build(records, {0: "h0", 1: "h0", 2: "h2"}, {"h0": 2, "h2": 2})
    assert got.straggler["rank"] == 2 and got.straggler["why"] == "compute"
    assert got.ranks[0].shares["wait"] == pytest.approx(0.4, abs=0.01)
    assert got.ranks[2].shares["comm"] == pytest.approx(0.1, abs=0.01)
    text = report.table(got)
    assert "straggler: rank 2 on h2: busy" in text and "compute" in text

def test_the_report_keeps_every_rank_across_an_in_memory_restart_with_steps_summed():
    """Round 0: ranks 0 and 1 make steps 1-5 (100 ms each); rank 1 is lost, a new rank
    1 joins round 1 and makes its steps 1-4 while rank 0, kept, goes on in its first
    round's file with steps 6-9. The report has both rows: rank 0 with its 9 steps,
    rank 1 with 5 + 4, and rank 0's round-1 records line up with the new rank's."""
    from dist_gluon.launch import observe

    def rows(first, count, at):
        return [(first + k, at + 0.1 * k - 0.09, at + 0.1 * k - 0.09, at + 0.1 * k,
                 at + 0.1 * k - 0.05, at + 0.1 * k - 0.02, 0.0, 0.01 * k, 8, 4096)
                for k in range(count)]

    rounds = {0: {0: rows(1, 5, 0.1) + rows(6, 4, 10.1), 1: rows(1, 5, 0.1)},
              1: {1: rows(1, 4, 10.1)}}
    records, kept_from, steps = observe.across_rounds(rounds)
    assert sorted(records) == [0, 1] and kept_from == {0: 0}
    assert [row[0] for row in records[0]] == [1, 2, 3, 4]
    assert [row[3] for row in records[0]] == [row[3] for row in records[1]]
    assert steps == {0: 9, 1: 9}
    got = report.build(records, {0: "h0", 1: "h0"})
    assert [r.rank for r in got.ranks] == [0, 1]
    assert got.ranks[0].shares == pytest.approx(got.ranks[1].shares)
    # a plain restart (every rank new in round 1) sums the steps of both rounds
    rounds = {0: {0: rows(1, 5, 0.1), 1: rows(1, 5, 0.1)},
              1: {0: rows(1, 4, 10.1), 1: rows(1, 4, 10.1)}}
    records, kept_from, steps = observe.across_rounds(rounds)
    assert kept_from == {} and steps == {0: 9, 1: 9}
    assert [row[3] for row in records[0]] == [row[3] for row in rows(1, 4, 10.1)]


def test_local_sgd_steps_without_a_sum_wait_for_no_one_and_name_no_straggler():
    """Under Local SGD the steps between two averagings make no sum (their records
    have none): ranks that run them half a step apart do not wait for each other, so
    neither is a straggler (the report had compared rank 1's whole step with the time
    rank 0 seemed to wait for it: "busy 94.9x the others'"). The averaging step, which
    sums, still counts the wait."""
    nan = float("nan")

    def rows(rank):
        out = []
        for k in range(1, 13):
            end = 0.1 * k + (0.0 if k % 4 == 0 else 0.05 * rank)
            sums = end - 0.002 if k % 4 == 0 else nan
            ready = end - (0.004 if k % 4 == 0 and rank == 1 else 0.02)
            out.append((k, end - 0.099, end - 0.099, end, ready, sums, 0.0, 0.01 * k, 8,
                        4096 if k % 4 == 0 else 0))
        return out

    got = report.build({0: rows(0), 1: rows(1)}, {0: "h0", 1: "h0"})
    assert got.straggler is None, report.table(got)
    assert got.ranks[0].busy == pytest.approx(got.ranks[1].busy, rel=0.2)
    assert 0 < got.ranks[0].shares["wait"] < 0.1


def test_check_sync_takes_nan_on_every_rank_for_the_same_model_and_nan_on_one_for_a_divergence():
    from dist_gluon.syncheck import _same_as_rank_0
    nan = float("nan")
    rows = np.array([[1.0, nan, nan, 2.0],
                     [1.0, nan, 3.0, 2.5],
                     [1.0, nan, nan, 2.0]])
    assert _same_as_rank_0(rows).tolist() == [[True] * 4,
                                              [True, True, False, False],
                                              [True] * 4]


# A small model trained a few steps with momentum (so that optimizer states are
# compared too); with "perturb", rank 1 changes one weight after its third step, as a
# rank-dependent bug would.
DIVERGING = """
import sys
import mxnet as mx
from mxnet import autograd, gluon
import dist_gluon as dg

kv = dg.create()
net = gluon.nn.HybridSequential()
net.add(gluon.nn.Dense(8, activation="relu", in_units=4), gluon.nn.Dense(2, in_units=8))
net.initialize(mx.init.Xavier())
trainer = dg.DistributedTrainer(net.collect_params(), sys.argv[1],
                                {"learning_rate": 0.1, **({"momentum": 0.9}
                                                          if sys.argv[1] == "sgd" else {})})
loss_fn = gluon.loss.L2Loss()
for step in range(1, 7):
    x = mx.nd.random.uniform(shape=(4, 4)) + kv.rank
    with autograd.record():
        loss = loss_fn(net(x), mx.nd.zeros((4, 2)))
    loss.backward()
    trainer.step(4)
    if "perturb" in sys.argv and kv.rank == 1 and step == 3:
        net[1].bias.data()[:] += 1e-3
print("trained", step, "steps", flush=True)
"""


@pytest.mark.spawns
def test_check_sync_ends_a_job_whose_ranks_differ_naming_parameter_ranks_and_step(tmp_path):
    proc = launch(DIVERGING, tmp_path, args=["sgd", "perturb"],
                  env={"DG_CHECK_SYNC": "2"})
    assert proc.returncode != 0
    out = proc.stdout + proc.stderr
    assert "DivergenceError" in out and "trained" not in out
    # rank 1 changed the second Dense layer's bias after step 3: the check at step 4
    assert "at step 4" in out
    assert "bias" in out and "parameter #3" in out
    assert "ranks [1] hold another value than ranks [0]" in out


@pytest.mark.spawns
@pytest.mark.parametrize("backend,optimizer", [("horovod", "adam"), ("dist_sync", "sgd")])
def test_check_sync_passes_replicas_that_agree_every_step(tmp_path, backend, optimizer):
    proc = launch(DIVERGING, tmp_path, backend=backend, args=[optimizer],
                  env={"DG_CHECK_SYNC": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "trained 6 steps" in proc.stdout


def test_progress_line_gives_rank_0s_rate_and_the_time_left(tmp_path, monkeypatch):
    from dist_gluon import timeline, worker
    from dist_gluon.launch import observe

    said = []
    watcher = observe.Observation(None, "text", None,
                                  type("Out", (), {"say": lambda self, t: said.append(t)})())
    for rank in (0, 1):     # 40 steps of 0.1 s, 32 samples each
        with open(timeline.steps_path(watcher.directory, rank, 0), "wb") as f:
            for k in range(1, 41):
                end = 100 + 0.1 * k
                f.write(timeline.STEP.pack(k, end - 0.08, end - 0.05, end, end - 0.06,
                                           end - 0.01, 0.01, 0.1 * k, 32, 1e6))
    monkeypatch.setattr(worker, "_context", worker.WorkerContext.from_environ(
        {timeline.ENV_DIR: watcher.directory, "DG_RANK": "0"}))
    timeline.expect_steps(460)
    watcher._progress()
    watcher.finish()
    assert said[0] == "progress: step 40 of 460, 10.00 steps/s, 640 samples/s, 42 s left"
    assert said[1].startswith("report: 10.00 steps/s, 640 samples/s")
    assert "bound: link: 50% of a step communicates, 1.0 MB of gradients a step" in said[1]
    assert not os.path.exists(watcher.directory)


def test_timeline_comes_from_dg_timeline_and_bad_flags_are_usage_errors(tmp_path,
                                                                        monkeypatch):
    from dist_gluon.launch import cli

    monkeypatch.setenv("DG_TIMELINE", str(tmp_path / "job.json"))
    config = cli.parse(["-n", "2", "--", "python", "x.py"])
    assert (config.timeline, config.report, config.report_every) == \
        (str(tmp_path / "job.json"), "text", None)
    for bad in (["--report-every", "0"], ["--report", "xml"],
                ["--timeline", str(tmp_path / "missing" / "job.json")]):
        with pytest.raises(SystemExit) as stop:
            cli.parse(["-n", "2", *bad, "--", "python", "x.py"])
        assert stop.value.code == 2


# Every trainer of dist_gluon is reported: 10 steps of a small model with each, through
# the launcher, with the timeline and the report as JSON; a step is step() or
# allreduce_grads() then update() (argument "split").
EVERY_TRAINER = """
import sys
import numpy as np
import mxnet as mx
from mxnet import autograd, gluon
import dist_gluon as dg

kind = sys.argv[1]
if kind == "module":
    kv = dg.create()
    net = mx.sym.FullyConnected(mx.sym.Variable("data"), num_hidden=4, name="fc")
    net = mx.sym.LinearRegressionOutput(net, name="out")
    mod = mx.mod.Module(net, label_names=["out_label"])
    data = mx.io.NDArrayIter(np.random.rand(80, 16), np.zeros((80, 4)), batch_size=8,
                             label_name="out_label")
    mod.fit(data, num_epoch=1, kvstore=None,
            optimizer=dg.DistributedOptimizer("sgd", learning_rate=0.1))
else:
    if kind == "horovod":
        import dist_gluon.compat.horovod as peer
    elif kind == "byteps":
        import dist_gluon.compat.byteps as peer
    else:
        peer = None
    net = gluon.nn.HybridSequential()
    net.add(gluon.nn.Dense(32, activation="relu", in_units=16), gluon.nn.Dense(4, in_units=32))
    net.initialize(mx.init.Xavier())
    if peer is None:
        kv = dg.create()
        trainer = dg.DistributedTrainer(net.collect_params(), "sgd", {"learning_rate": 0.1})
    else:
        peer.init()
        trainer = peer.DistributedTrainer(net.collect_params(), "sgd",
                                          {"learning_rate": 0.1})
    for _ in range(10):
        x, y = mx.nd.random.uniform(shape=(8, 16)), mx.nd.zeros((8, 4))
        with autograd.record():
            loss = gluon.loss.L2Loss()(net(x), y)
        loss.backward()
        if sys.argv[2:] == ["split"]:
            trainer.allreduce_grads()
            trainer.update(8)
        else:
            trainer.step(8)
    mx.nd.waitall()
"""


@pytest.mark.spawns
@pytest.mark.parametrize("kind,backend,how", [
    ("module", "horovod", "step"), ("module", "dist_sync", "step"),
    ("horovod", "horovod", "step"), ("byteps", "dist_sync", "step"),
    ("dist_async", "dist_async", "step"), ("horovod", "dist_sync", "split"),
    ("byteps", "horovod", "split"), ("dist_gluon", "horovod", "split")])
def test_every_trainer_is_reported_in_the_report_and_the_timeline(tmp_path, kind, backend,
                                                                   how):
    proc = launch(EVERY_TRAINER, tmp_path, backend=backend, args=[kind, how],
                  launcher_args=["--timeline", str(tmp_path / "job.json"),
                                 "--report", "json"], timeout=240)
    assert_ok(proc)
    got = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("{")))
    assert [(r["rank"], r["steps"]) for r in got["ranks"]] == [(0, 10), (1, 10)], got
    gradients = 4 * (16 * 4 + 4) if kind == "module" else 4 * (16 * 32 + 32 + 32 * 4 + 4)
    for r in got["ranks"]:
        assert r["samples_per_s"] > 0 and r["bytes_per_step"] == gradients, got
        if kind == "dist_async":
            # the ranks do not wait for each other: their time goes to compute and to
            # the servers' push and pull
            assert r["shares"]["wait"] == 0 and r["shares"]["comm"] > 0, got
    events = json.loads((tmp_path / "job.json").read_text())["traceEvents"]
    for rank in (0, 1):
        steps = [e["args"]["step"] for e in events if e["pid"] == rank and e["name"] == "step"]
        assert steps == list(range(1, 11)), (rank, steps)
        collectives = {e["name"].split(" ")[0] for e in events
                       if e["pid"] == rank and e.get("cat") == "collective"}
        assert collectives == {"push," if kind == "dist_async" else "sum", "running"}, \
            collectives


@pytest.mark.parametrize("events", [False, True])
def test_the_workers_reporter_closes_silently_at_exit(tmp_path, events):
    """A worker's reporter, with the timeline (two helper threads) or without it (one),
    ends with its process without a word on stderr (an 'Exception ignored in atexit
    callback' there reached every worker's output once)."""
    code = textwrap.dedent(f"""
        from dist_gluon import timeline, worker
        timeline._Reporter({str(tmp_path)!r}, worker.WorkerContext(), events={events})
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=process_env(), timeout=120)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
