"""The timeline of an elastic job that loses a host (--timeline across emulated hosts,
tools/emulated_cluster.py): what the lost node sent stays, the re-formation is on the
launchers' tracks, the survivors' steps go on."""
from __future__ import annotations

import itertools
import json
import sys
import time

import pytest
from test_elastic import ElasticJob, make_jobs

from conftest import REPO
from test_launch import assert_nothing_left

sys.path.insert(0, str(REPO / "tools"))
import emulated_cluster  # noqa: E402

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(emulated_cluster.skip_reason() is not None,
                                 reason=str(emulated_cluster.skip_reason()))]

_ports = itertools.count(29760)


class TimelineJob(ElasticJob):
    """tests/workers/elastic_train.py on --nnodes 2:3 with every launcher given
    DG_TIMELINE (node 0's writes the job's timeline)."""

    def __init__(self, cluster, directory, backend):
        super().__init__(cluster, directory, backend)
        self.port = str(next(_ports))
        self.timeline = directory / "job.json"
        # self.marker is merged into every launcher's environment (ElasticJob.start)
        self.marker = {**self.marker, "DG_TIMELINE": str(self.timeline)}


@pytest.fixture(scope="module")
def cluster():
    with emulated_cluster.EmulatedCluster(num_hosts=3) as c:
        yield c


@pytest.fixture
def job_factory(cluster, tmp_path):
    yield from make_jobs(TimelineJob, cluster, tmp_path)


def test_timeline_keeps_a_killed_hosts_steps_shows_the_reformation_and_the_survivors(
        job_factory):
    job = job_factory("horovod")
    for host in range(3):
        job.start(host)
    job.wait_training(world=3, reformation=0, steps=20)
    # the emulated hosts share the test's CLOCK_MONOTONIC: node 0's timeline axis
    killed = time.monotonic() * 1e6
    job.kill_host(2)
    job.wait_training(world=2, reformation=1, steps=5)
    job.finish()
    assert job.wait_exit(0) == 0, job.report()
    assert job.wait_exit(1) == 0, job.report()
    assert_nothing_left(job.marker["DG_TEST_MARKER"])

    events = json.loads(job.timeline.read_text())["traceEvents"]
    tracks = {e["args"]["name"]: e["pid"] for e in events if e["name"] == "process_name"}
    hosts = [h.name for h in job.cluster.hosts]
    assert tracks[f"rank 2 ({hosts[2]})"] == 2, tracks

    def steps(rank):
        return [e for e in events if e["pid"] == rank and e["name"] == "step"]

    # the lost node's steps, as its launcher sent them until the kill
    lost = steps(2)
    assert [e["args"]["step"] for e in lost] == list(range(1, len(lost) + 1)), lost
    assert len(lost) >= 10, (len(lost), job.report())
    last_end = lost[-1]["ts"] + lost[-1]["dur"]
    assert killed - 5e6 < last_end < killed, (last_end, killed)

    # the re-formation: node 0 says so, and node 1's launcher heard it
    def said(host):
        return [e for e in events if e["pid"] == tracks[f"launcher ({hosts[host]})"]
                and e["ph"] == "i"]

    loss = [e for e in said(0) if e["name"].startswith(f"node 2 ({hosts[2]}) lost")]
    assert len(loss) == 1 and loss[0]["ts"] > killed, (said(0), job.report())
    assert any("re-formation 1" in e["args"]["message"] for e in said(0)
               if e["ts"] > killed), said(0)
    assert any("re-formation 1" in e["args"]["message"] for e in said(1)
               if e["ts"] > killed), said(1)

    # the survivors' steps go on after it (a new round: their steps count from 1)
    for rank in (0, 1):
        after = [e for e in steps(rank) if e["ts"] > loss[0]["ts"]]
        assert len(after) >= 5 and after[0]["args"]["step"] == 1, (rank, after[:3])
        # before it, the lost rank's steps, but the last one perhaps: the step in flight
        # at the kill can end on the lost rank (its ring allreduce done) and fail on the
        # survivors, which then go back to their last commit (seen once in 3 CI runs)
        assert len(steps(rank)) - len(after) >= len(lost) - 1, (rank, len(lost))
    assert not [e for e in lost if e["ts"] > killed]
