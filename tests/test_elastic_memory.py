"""Elastic jobs whose workers keep their processes (dg.elastic.State, @dg.elastic.run)
across emulated hosts: a lost node costs at most the step in flight, the survivors go
on in the same processes from their last commit in memory, and a node that joins gets
the state from a live peer. No checkpoint is written or read.

The job is tests/workers/elastic_memory_train.py on 3 emulated hosts (one launcher
each, --nnodes 2:3, horovod over Gloo); its final weights must equal
tests/test_elastic.py's NumPy replay of the same schedule of world sizes, which holds
only if no step was applied twice or skipped and no sample was trained twice in an
epoch.
"""
from __future__ import annotations

import sys
import time

import pytest
from test_elastic import ElasticJob, check_weights, make_jobs

from conftest import REPO
from test_launch import assert_nothing_left

sys.path.insert(0, str(REPO / "tools"))
import emulated_cluster  # noqa: E402

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(emulated_cluster.skip_reason() is not None,
                                 reason=str(emulated_cluster.skip_reason()))]

SCRIPT = REPO / "tests" / "workers" / "elastic_memory_train.py"
KEPT = "from the workers' last commit in memory (their processes stay"


class MemoryJob(ElasticJob):
    script = SCRIPT

    def starts(self) -> list[dict]:
        return [e for e in self.events() if e["event"] == "start"]


@pytest.fixture(scope="module")
def cluster():
    with emulated_cluster.EmulatedCluster(num_hosts=3) as c:
        yield c


@pytest.fixture
def memory_jobs(cluster, tmp_path):
    yield from make_jobs(MemoryJob, cluster, tmp_path)


def test_survivors_keep_their_processes_through_a_killed_host_and_heal_a_joiner(
        memory_jobs):
    job = memory_jobs("horovod")
    for host in range(3):
        job.start(host)
    job.wait_training(world=3, reformation=0)
    first = job.starts()[0]["pids"]

    # every process of host 2 killed: the survivors go on from memory
    killed = time.time()
    job.kill_host(2)
    job.wait_training(world=2, reformation=1, steps=1)
    resumed = job.progress()["at"]
    again = job.starts()[-1]
    assert again["pids"] == first[:2], job.report()
    assert "(re-formation 1; restart 1 of at most 3)" in job.output(0), job.report()
    assert KEPT in job.output(0) and KEPT in job.output(1), job.report()
    print(f"kill -> first step of the re-formed job: {resumed - killed:.2f} s")

    # host 2 comes back: admitted at a commit, its new worker heals from rank 0
    job.start(2)
    job.wait_training(world=3, reformation=2)
    grown = job.starts()[-1]["pids"]
    assert grown[:2] == first[:2] and grown[2] not in first, job.report()
    assert "(re-formation 2; planned: no restart used)" in job.output(0), job.report()

    job.finish()
    for host in range(3):
        assert job.wait_exit(host) == 0, job.report()
    check_weights(job)
    assert not list(job.dir.glob("ckpt*")), job.report()
    assert_nothing_left(job.marker["DG_TEST_MARKER"])
