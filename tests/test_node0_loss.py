"""An elastic job survives the loss of node 0, the node that hosts it at the start.

Each test runs one job of tests/workers/elastic_train_node_local.py (checkpoints on each
emulated host's own disk) on 3 emulated hosts, --nnodes 1:3, and takes node 0 away: the
other nodes elect the lowest node left as the job's new host (channel, rendezvous,
scheduler, rank 0), re-form with a quorum of the last formation and resume from the last
checkpoint; a side without a quorum ends naming why. The final weights equal a NumPy
replay of the schedule of world sizes (test_elastic.replay); nothing is left running.

Which backend meets which fault (one job per test, to keep the module short):
- horovod: node 0 SIGKILLed; then the new host loses node 2 (its link cut): 1 of 2
  with the lowest rank goes on.
- dist_sync: node 0's link cut: node 0 (1 of 3) ends as a minority, nodes 1 and 2 go on;
  node 0's machine joins again as node 3 through node 2, which sends it on to node 1.
- p3: node 0 preempted (SIGTERM): it hands the job over after a checkpoint; then the new
  host is SIGKILLed: node 2 alone (1 of 2 without the lowest rank) ends naming why.
"""
from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_elastic import ElasticJob, assert_replayed, make_jobs

from conftest import REPO, host_env
from test_launch import assert_nothing_left

sys.path.insert(0, str(REPO / "tools"))
import emulated_cluster  # noqa: E402

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(emulated_cluster.skip_reason() is not None,
                                 reason=str(emulated_cluster.skip_reason()))]

SCRIPT = REPO / "tests" / "workers" / "elastic_train_node_local.py"
SILENCE = 3


@pytest.fixture(scope="module")
def cluster():
    with emulated_cluster.EmulatedCluster(num_hosts=3) as c:
        yield c


class Node0Job(ElasticJob):
    """An elastic job (--nnodes 1:3, or ``nnodes``) whose node 0 goes away; nodes 1 and
    2 start first so that all three form the first round."""

    nnodes = "1:3"

    def start(self, host: int, where=None, script_args=(), node_rank: int | None = None,
              through: int = 0) -> subprocess.Popen:
        """Host ``host``'s launcher as node ``host`` (or ``node_rank``), given host
        ``through``'s address as --master-addr."""
        env = {**host_env(),
               "OMP_NUM_THREADS": "1", "DG_JOB_SECRET": f"node0-{self.port}",
               **self.marker}
        node_rank = host if node_rank is None else node_rank
        argv = [sys.executable, "-m", "dist_gluon.launch", "--nnodes", self.nnodes,
                "--node-rank", str(node_rank),
                "--master-addr", self.cluster.hosts[through].address,
                "--master-port", self.port, "-n", "1", "--backend", self.backend,
                "--max-restarts", "3", "--heartbeat", "0.3",
                "--silence-limit", str(SILENCE), "--last-call", "5", "--preempt-grace", "60",
                "--", sys.executable, str(SCRIPT), str(self.dir), *script_args]
        log = self.dir / f"node{host}-{len(self.logs.get(host, []))}.log"
        proc = self.cluster.popen(host, argv, cwd=self.dir, env=env, text=True,
                                  stdout=open(log, "w"), stderr=subprocess.STDOUT)
        self.procs.setdefault(host, []).append(proc)
        self.logs.setdefault(host, []).append(log)
        return proc

    def start_all(self) -> None:
        for host in (1, 2, 0):
            self.start(host)
        # past the first checkpoint (every SAVE_EVERY = 4 steps), to resume from it
        self.wait_training(world=3, reformation=0, steps=5)

    def wait_training(self, world: int, reformation: int, steps: int = 3,
                      since: float | None = None) -> None:
        """Until the round of ``reformation`` trains on ``world`` workers; with
        ``since`` (the fault's time.monotonic()), print how long after the fault that
        round's first step came (to within this poll's 0.1 s)."""
        limit = time.monotonic() + 120.0
        first = None
        while time.monotonic() < limit:
            p = self.progress()
            if p.get("reformation") == reformation and first is None:
                first = time.monotonic()
                if since is not None:
                    print(f"\n{self.backend}: fault -> first step of re-formation "
                          f"{reformation}: {first - since:.1f} s")
            if p.get("reformation") == reformation and p.get("steps", 0) >= steps:
                assert p["world"] == world, self.report()
                return
            if all(procs[-1].poll() is not None for procs in self.procs.values()):
                break
            time.sleep(0.1)
        pytest.fail(f"re-formation {reformation} never trained on {world} workers "
                    f"(progress {self.progress()})\n{self.report()}")

    def said_by(self, hosts, *lines) -> None:
        for host in hosts:
            for line in lines:
                assert line in self.output(host), f"{line!r} not said by node {host}\n" \
                                                  f"{self.report()}"


@pytest.fixture
def job_factory(cluster, tmp_path):
    yield from make_jobs(Node0Job, cluster, tmp_path)


def _host(job, n) -> str:
    return job.cluster.hosts[n].name


def test_horovod_goes_on_under_node_1_after_node_0_is_killed_and_then_without_node_2(
        job_factory):
    job = job_factory("horovod")
    job.start_all()
    fault = time.monotonic()
    job.kill_host(0)
    job.wait_training(world=2, reformation=1, since=fault)
    h0, h1, h2 = (_host(job, n) for n in range(3))
    job.said_by([1, 2], f"node 0 ({h0}) lost: its launcher's connection closed",
                f"node 1 ({h1}) takes over as the job's host at "
                f"{job.cluster.hosts[1].address}:",
                "re-forming with 2 nodes (2 workers) from checkpoint epoch",
                "(re-formation 1; restart 1 of at most 3)")
    # a second loss: the new host goes on alone, holding the last formation's lowest rank
    fault = time.monotonic()
    job.link(2, "down")
    job.wait_training(world=1, reformation=2, since=fault)
    job.said_by([1], f"node 2 ({h2}) lost: nothing heard from its launcher for {SILENCE} s",
                "(re-formation 2; restart 2 of at most 3)")
    job.finish()
    assert job.wait_exit(1) == 0, job.report()
    assert job.wait_exit(2) == 1, job.report()
    assert "not a majority (half of it without its lowest node rank, node 1)" in \
        job.output(2), job.report()
    job.said_by([1], "the job finished on 1 node (1 worker) after 2 re-formations and 2 "
                     "restarts of at most 3")
    events = job.events()
    assert_replayed(events, job.report())
    assert [e["world"] for e in events if e["event"] == "start"] == [3, 2, 1]
    assert_nothing_left(job.marker["DG_TEST_MARKER"])


def test_dist_sync_goes_on_without_node_0_cut_off_node_0_ends_as_a_minority_and_joins_again(
        job_factory):
    """Node 0 cut off: nodes 1 and 2 go on, node 0 ends as a minority. Its machine then
    joins again as a new node, given node 2's address: node 2 does not host the job and
    sends it on to node 1, which admits it."""
    job = job_factory("dist_sync")
    job.nnodes = "1:4"
    job.start_all()
    fault = time.monotonic()
    job.link(0, "down")
    job.wait_training(world=2, reformation=1, since=fault)
    h0, h1 = _host(job, 0), _host(job, 1)
    job.said_by([1, 2], f"node 0 ({h0}) lost: nothing heard from its launcher for "
                        f"{SILENCE} s",
                f"node 1 ({h1}) takes over as the job's host",
                "(re-formation 1; restart 1 of at most 3)")
    assert job.wait_exit(0) == 1, job.report()
    job.said_by([0], "only 1 of the last formation's 3 nodes remain here "
                     f"(node 0 ({h0})), not a majority: a node cannot tell dead peers from "
                     "a cut link")
    # node 0's machine back as node 3, through node 2 (which does not host the job)
    job.link(0, "up")
    job.start(0, node_rank=3, through=2)
    job.wait_training(world=3, reformation=2)
    a1, a2 = (job.cluster.hosts[n].address for n in (1, 2))
    job.said_by([2], f"node 3 ({h0}) joined through this node, which does not host the "
                     f"job: sent it on to node 1 ({h1}) at {a1}:{job.port}")
    job.said_by([0], f"{a2}:{job.port} does not host the job: joining its host, node 1 "
                     f"({h1}) at {a1}:{job.port}")
    job.finish()
    for host in range(3):
        assert job.wait_exit(host) == 0, job.report()
    job.said_by([1, 2, 0], "the job finished on 3 nodes (3 workers) after 2 re-formations")
    events = job.events()
    assert_replayed(events, job.report())
    assert [e["world"] for e in events if e["event"] == "start"] == [3, 2, 3]
    assert_nothing_left(job.marker["DG_TEST_MARKER"])


def test_p3_node_0_preempted_hands_the_job_over_and_a_lone_survivor_ends_naming_why(
        job_factory):
    job = job_factory("p3")
    job.start_all()
    fault = time.monotonic()
    job.procs[0][-1].send_signal(signal.SIGTERM)
    job.wait_training(world=2, reformation=1, since=fault)
    assert job.wait_exit(0) == 0, job.report()
    h0, h1 = _host(job, 0), _host(job, 1)
    job.said_by([0, 1, 2], f"node 0 ({h0}) was preempted (SIGTERM) and left the job; the "
                           "workers saved checkpoint epoch",
                f"node 1 ({h1}) takes over as the job's host and the other nodes go on")
    job.said_by([1, 2], "(re-formation 1; planned: no restart used)")
    # the second round resumed from the preemption's checkpoint, on node 1's disk
    events = job.events()
    second = [e for e in events if e["event"] == "start"][1]
    stop = [e for e in events if e["event"] == "stop"][-1]
    assert (second["epoch"], second["samples"]) == (stop["epoch"], stop["samples"])
    job.kill_host(1)
    assert job.wait_exit(2) == 1, job.report()
    job.said_by([2], f"lost the master launcher at {job.cluster.hosts[1].address}:",
                "only 1 of the last formation's 2 nodes remain here (node 2), not a "
                "majority (half of it without its lowest node rank, node 1)")
    assert_nothing_left(job.marker["DG_TEST_MARKER"])
    assert Path(job.dir, f"disk-{h1}", "ckpt").is_dir()
