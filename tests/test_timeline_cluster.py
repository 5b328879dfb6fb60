"""One timeline for a job of several hosts (--timeline across emulated hosts, each host a
network namespace; tools/emulated_cluster.py).

The hosts of an emulated cluster share the machine's CLOCK_MONOTONIC, which would hide
any error in placing one host's events on another's clock: here node 1's and node 2's
launchers (and so their workers) run in time namespaces whose monotonic clocks are
5000 s and 2000 s ahead of node 0's, as unrelated machines' clocks are.
"""
from __future__ import annotations

import itertools
import json
import subprocess
import sys
import time

import pytest

from conftest import REPO, host_env, worker_lines
from test_launch import _marker_env, assert_nothing_left

sys.path.insert(0, str(REPO / "tools"))
import emulated_cluster  # noqa: E402

pytestmark = pytest.mark.skipif(emulated_cluster.skip_reason() is not None,
                                reason=str(emulated_cluster.skip_reason()))

# each node's monotonic clock ahead of node 0's, seconds
CLOCK_AHEAD = (0, 5000, 2000)
STEPS = 10
SLOW = 0.1      # rank 2 (node 2) waits this long for each batch: it starts every step last
JOIN_LATE = 2.0     # node 0's launcher starts this long after the others
_ports = itertools.count(29650)

WORKER = f"""
import time
import mxnet as mx
from mxnet import autograd, gluon
import dist_gluon as dg
from dist_gluon import timeline

kv = dg.create()
net = gluon.nn.HybridSequential()
net.add(gluon.nn.Dense(32, activation="relu", in_units=16), gluon.nn.Dense(4, in_units=32))
net.initialize(mx.init.Xavier())
trainer = dg.DistributedTrainer(net.collect_params(), "sgd", {{"learning_rate": 0.1}})

def batches(n):
    for _ in range(n):
        if kv.rank == 2:
            time.sleep({SLOW})
        yield mx.nd.random.uniform(shape=(8, 16)), mx.nd.zeros((8, 4))

for x, y in timeline.data(batches({STEPS})):
    with autograd.record():
        loss = gluon.loss.L2Loss()(net(x), y)
    loss.backward()
    trainer.step(8)
    loss.mean().asscalar()
if kv.rank == 0:
    # the other nodes' records reach node 0 with their launchers' next status reports
    limit = time.monotonic() + 20
    while time.monotonic() < limit:
        seen = timeline.step_breakdown()
        if len(seen) == 3 and all(rows and rows[-1][0] == {STEPS} for rows in seen.values()):
            break
        time.sleep(0.2)
    last = [rows[-1][0] if rows else 0 for _, rows in sorted(seen.items())]
    print("BREAKDOWN", sorted(seen), last, flush=True)
"""


@pytest.fixture(scope="module")
def cluster():
    with emulated_cluster.EmulatedCluster(num_hosts=3) as c:
        yield c


@pytest.fixture(scope="module")
def job(cluster, tmp_path_factory):
    """A 3-node horovod job, one rank a node, with --timeline; returns the trace and
    node 0's output."""
    tmp_path = tmp_path_factory.mktemp("timeline_cluster")
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    port = str(next(_ports))
    marker = _marker_env()
    env = {**host_env(), "OMP_NUM_THREADS": "1", "DG_JOB_SECRET": f"timeline-{port}",
           **marker}
    procs = {}
    # nodes 1 and 2 start first: they retry until node 0 listens, and say when they
    # joined (on the timeline, their launchers' tracks)
    for node, ahead in reversed(list(enumerate(CLOCK_AHEAD))):
        if node == 0:
            time.sleep(JOIN_LATE)
        argv = [sys.executable, "-m", "dist_gluon.launch", "--nnodes", "3", "--node-rank",
                str(node), "--master-addr", cluster.hosts[0].address, "--master-port", port,
                "-n", "1", "--timeline", str(tmp_path / "job.json"), "--report", "json",
                "--", sys.executable, str(script)]
        if ahead:
            argv = ["unshare", "--time", "--monotonic", str(ahead), "--fork",
                    "--kill-child", *argv]
        procs[node] = cluster.popen(node, argv, cwd=tmp_path, env=env, text=True,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    procs = [procs[node] for node in range(len(CLOCK_AHEAD))]
    outputs = [p.communicate(timeout=240) for p in procs]
    log = "\n".join(f"--- node {i}\n{o[0][-3000:]}\n{o[1][-3000:]}"
                    for i, o in enumerate(outputs))
    assert [p.returncode for p in procs] == [0, 0, 0], log
    assert_nothing_left(marker["DG_TEST_MARKER"])
    return json.loads((tmp_path / "job.json").read_text()), outputs[0], log


def test_timeline_of_three_hosts_holds_every_ranks_steps(cluster, job):
    trace, _, log = job
    events = trace["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    for rank in range(3):
        assert names[rank] == f"rank {rank} ({cluster.hosts[rank].name})", names
        steps = [e for e in events if e["pid"] == rank and e["name"] == "step"]
        assert [e["args"]["step"] for e in steps] == list(range(1, STEPS + 1)), log
        assert any(e["pid"] == rank and e.get("cat") == "collective" for e in events)


def test_timeline_states_each_hosts_clock_offset_and_its_error_bound(cluster, job):
    trace, _, log = job
    clocks = {c["host"]: c for c in trace["otherData"]["clocks"]}
    assert set(clocks) == {cluster.hosts[1].name, cluster.hosts[2].name}, clocks
    for node in (1, 2):
        clock = clocks[cluster.hosts[node].name]
        assert clock["ranks"] == [node]
        # node 0's clock minus the node's: the namespace's offset, within the bound
        assert 0 < clock["error_bound_s"] < 0.05, clock
        assert abs(clock["offset_s"] + CLOCK_AHEAD[node]) <= clock["error_bound_s"], clock


def test_a_rank_that_starts_every_step_last_is_ordered_so_on_the_aligned_axis(job):
    """A step's header sum comes back to a rank only after every rank has begun the
    step: on one time axis, no rank's "wait for other ranks" ends before rank 2 (the
    slow one, on another host) began the step, and rank 0's ends soon after."""
    trace, _, log = job
    events = trace["traceEvents"]
    bound = {c["ranks"][0]: c["error_bound_s"] for c in trace["otherData"]["clocks"]}
    bound[0] = 0.0

    def spans(rank, name):
        return {e["args"]["step"]: e for e in events
                if e["pid"] == rank and e["name"] == name}

    slow_start = {k: e["ts"] for k, e in spans(2, "step").items()}
    lags = []
    for rank in (0, 1):
        for k, wait in spans(rank, "wait for other ranks").items():
            end = wait["ts"] + wait["dur"]
            slack = 1e6 * (bound[rank] + bound[2])
            assert end >= slow_start[k] - slack, (rank, k, end, slow_start[k], log)
            if rank == 0 and k > 1:
                lags.append(end - slow_start[k])
    # without the offsets node 2's events would sit 2000 s away
    assert sorted(lags)[len(lags) // 2] < 0.25e6, lags


def test_step_breakdown_on_node_0_sees_every_ranks_steps(job):
    _, (stdout, stderr), log = job
    lines = [line for line in worker_lines(stdout, 0) if line.startswith("BREAKDOWN")]
    assert lines == [f"BREAKDOWN [0, 1, 2] [{STEPS}, {STEPS}, {STEPS}]"], log


def test_report_of_three_hosts_names_the_slow_rank_on_its_host(cluster, job):
    _, (stdout, _), log = job
    got = json.loads(next(line for line in stdout.splitlines() if line.startswith("{")))
    assert [(r["rank"], r["host"]) for r in got["ranks"]] == \
        [(i, cluster.hosts[i].name) for i in range(3)], log
    assert got["straggler"]["rank"] == 2 and got["straggler"]["why"] == "data", log


def test_other_nodes_launchers_say_what_they_did_on_their_own_tracks_aligned(cluster, job):
    """Node 1's and node 2's launchers send what they said with their status reports:
    their "joined the job" (they started before node 0 listened) lies on the aligned
    axis after node 0's launcher started and before their rank's first step, though
    their own clocks are 5000 s and 2000 s ahead."""
    trace, _, log = job
    events = trace["traceEvents"]
    tracks = {e["args"]["name"]: e["pid"] for e in events if e["name"] == "process_name"}

    def said(node):
        pid = tracks[f"launcher ({cluster.hosts[node].name})"]
        return pid, [e for e in events if e["pid"] == pid and e["ph"] == "i"]

    pid, node0 = said(0)
    assert pid == -1 and node0[0]["name"] == "job started" and node0[0]["s"] == "g"
    for node in (1, 2):
        pid, mine = said(node)
        assert pid < -1 and all(e["cat"] == "launcher" and e["s"] == "p" for e in mine)
        joined = [e["ts"] for e in mine if e["name"].startswith("joined the job at")]
        first_step = min(e["ts"] for e in events if e["pid"] == node and e["name"] == "step")
        assert len(joined) == 1 and node0[0]["ts"] < joined[0] < first_step, \
            (node, mine, node0, log)
