"""Elastic jobs (--nnodes MIN:MAX) across emulated hosts: a job that outlives its hosts.

Each test runs one job of tests/workers/elastic_train.py on 3 emulated hosts (network
namespaces, one launcher each, --nnodes 2:3) and puts it through a schedule of events:
a SIGTERM preemption, a late joiner, every process of a host SIGKILLed, a link that goes
down, too few nodes left. The job must re-form after each and finish (or end naming the
cause); its final weights must equal a NumPy replay of the same schedule of world sizes
from the same checkpoints; nothing may be left running on any host.
"""
from __future__ import annotations

import itertools
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import REPO, host_env
from test_launch import _marker_env, assert_nothing_left

sys.path.insert(0, str(REPO / "tools"))
sys.path.insert(0, str(REPO / "tests" / "workers"))
import elastic_train  # noqa: E402
import emulated_cluster  # noqa: E402

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(emulated_cluster.skip_reason(sshd=True) is not None,
                                 reason=str(emulated_cluster.skip_reason(sshd=True)))]

SCRIPT = REPO / "tests" / "workers" / "elastic_train.py"
WAIT = 120.0            # seconds any one event may take on a loaded machine
_ports = itertools.count(29700)


@pytest.fixture(scope="module")
def cluster():
    with emulated_cluster.EmulatedCluster(num_hosts=3, sshd=True) as c:
        yield c


class ElasticJob:
    """One elastic job's launchers on the cluster's hosts, started one by one."""

    script = SCRIPT
    nnodes = "2:3"
    env: dict[str, str] = {}        # the workers' own variables

    def __init__(self, cluster, directory: Path, backend: str):
        self.cluster, self.dir, self.backend = cluster, directory, backend
        self.port = str(next(_ports))
        self.marker = _marker_env()
        self.procs: dict[int, list[subprocess.Popen]] = {}
        self.logs: dict[int, list[Path]] = {}

    def start(self, host: int, where=None, script_args=()) -> subprocess.Popen:
        """Start host ``host``'s launcher as node ``host`` (again, after it left); or,
        with ``where`` (launcher options such as -H), one launcher for every host."""
        env = {**host_env(),
               "OMP_NUM_THREADS": "1", "DG_JOB_SECRET": f"elastic-{self.port}",
               **self.env, **self.marker}
        where = where or ["--node-rank", str(host), "--master-addr",
                          self.cluster.hosts[0].address]
        argv = [sys.executable, "-m", "dist_gluon.launch", "--nnodes", self.nnodes, *where,
                "--master-port", self.port, "-n", "1", "--backend", self.backend,
                "--max-restarts", "3", "--heartbeat", "0.3", "--silence-limit", "3",
                "--last-call", "2", "--preempt-grace", "60",
                "--", sys.executable, str(self.script), str(self.dir), *script_args]
        log = self.dir / f"node{host}-{len(self.logs.get(host, []))}.log"
        proc = self.cluster.popen(host, argv, cwd=self.dir, env=env, text=True,
                                  stdout=open(log, "w"), stderr=subprocess.STDOUT)
        self.procs.setdefault(host, []).append(proc)
        self.logs.setdefault(host, []).append(log)
        return proc

    def output(self, host: int, which: int = -1) -> str:
        return self.logs[host][which].read_text(errors="replace")

    def report(self) -> str:
        return "\n".join(f"--- {log.name}\n{log.read_text(errors='replace')[-4000:]}"
                         for logs in self.logs.values() for log in logs)

    def progress(self) -> dict:
        try:
            return json.loads((self.dir / "progress.json").read_text())
        except (OSError, ValueError):
            return {}

    def events(self) -> list[dict]:
        path = self.dir / "events.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] \
            if path.exists() else []

    def start_hosts(self, count: int) -> None:
        """Start the job's launcher on hosts 0 to ``count - 1`` and wait until its first
        round trains on all of them."""
        for host in range(count):
            self.start(host)
        self.wait_training(world=count, reformation=0)

    def wait_training(self, world: int, reformation: int, steps: int = 3) -> None:
        """Until the round of ``reformation`` trains on ``world`` workers."""
        limit = time.monotonic() + WAIT
        while time.monotonic() < limit:
            p = self.progress()
            if p.get("reformation") == reformation and p.get("steps", 0) >= steps:
                assert p["world"] == world, self.report()
                return
            if self.procs[0][-1].poll() is not None:
                break
            time.sleep(0.2)
        pytest.fail(f"re-formation {reformation} never trained on {world} workers "
                    f"(progress {self.progress()})\n{self.report()}")

    def wait_exit(self, host: int, timeout: float = WAIT) -> int:
        try:
            return self.procs[host][-1].wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"node {host}'s launcher did not end\n{self.report()}")

    def kill_host(self, host: int) -> None:
        """SIGKILL every process of the job on the host, its launcher included."""
        ns = os.stat(f"/run/netns/{self.cluster.hosts[host].namespace}").st_ino
        needle = f"DG_TEST_MARKER={self.marker['DG_TEST_MARKER']}".encode()
        for entry in os.scandir("/proc"):
            try:
                if entry.name.isdigit() and \
                        os.stat(f"/proc/{entry.name}/ns/net").st_ino == ns and \
                        needle in Path(entry.path, "environ").read_bytes().split(b"\0"):
                    os.kill(int(entry.name), signal.SIGKILL)
            except OSError:
                pass

    def link(self, host: int, state: str) -> None:
        subprocess.run(["ip", "-n", self.cluster.hosts[host].namespace, "link", "set",
                        "eth0", state], check=True)

    def finish(self) -> None:
        (self.dir / "finish").touch()

    def close(self) -> None:
        for procs in self.procs.values():
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()


def make_jobs(job_class, cluster, tmp_path):
    """A job_factory fixture's body: yields ``make(backend)``, which starts a
    ``job_class`` job; afterwards closes every job made and brings every link back up
    (partitions healed)."""
    jobs = []

    def make(backend):
        jobs.append(job_class(cluster, tmp_path, backend))
        return jobs[-1]

    yield make
    for job in jobs:
        job.close()
        for host in range(len(cluster.hosts)):
            job.link(host, "up")
    cluster.heal()


@pytest.fixture
def job_factory(cluster, tmp_path):
    yield from make_jobs(ElasticJob, cluster, tmp_path)


def replay(events: list[dict]) -> tuple[np.ndarray, float]:
    """The weights of the schedule in ``events``, computed in NumPy: each round trains
    from the position it restored to the position the next round restored (its last
    checkpoint), on its world size; one step on W workers is one step on the union of
    their batches (ShardSampler gives rank r positions r, r + W, ... of the epoch's
    remaining order, padded to a multiple of W)."""
    x, y = (a.astype(np.float64) for a in elastic_train.dataset())
    length, batch = elastic_train.LENGTH, elastic_train.BATCH
    w, b = np.zeros(x.shape[1]), 0.0
    mw, mb = np.zeros_like(w), 0.0
    starts = [e for e in events if e["event"] == "start"]
    done = next(e for e in events if e["event"] == "done")
    ends = [(s["epoch"], s["samples"]) for s in starts[1:]] + [(done["epoch"], 0)]
    for start, end in zip(starts, ends):
        world, epoch, skip = start["world"], start["epoch"], start["samples"]
        while (epoch, skip) != end:
            assert (epoch, skip) < end, f"the schedule passed {end} at {(epoch, skip)}"
            order = list(range(skip, length))
            pad = -len(order) % world
            order += order[:pad]
            per_rank = [order[r::world] for r in range(world)]
            first = 0
            while first < len(per_rank[0]) and (epoch, skip) != end:
                chunk = [i for rank in per_rank for i in rank[first:first + batch]]
                size = len(per_rank[0][first:first + batch])
                error = x[chunk] @ w + b - y[chunk]
                gw, gb = error @ x[chunk] / len(chunk), error.mean()
                mw = elastic_train.MOMENTUM * mw - elastic_train.LR * gw
                mb = elastic_train.MOMENTUM * mb - elastic_train.LR * gb
                w, b = w + mw, b + mb
                first += batch
                skip = min(length, skip + size * world)
            # a checkpoint saved at an epoch's last step restores to (epoch, length)
            if skip >= length and (epoch, skip) != end:
                epoch, skip = epoch + 1, 0
    return w, b


def assert_replayed(events: list[dict], report: str = "") -> None:
    """The job of ``events`` ended once, at the weights of its schedule in NumPy."""
    done = [e for e in events if e["event"] == "done"]
    assert len(done) == 1, report or events
    w, b = replay(events)
    np.testing.assert_allclose(done[0]["weight"], w, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(done[0]["bias"], b, rtol=1e-4, atol=1e-5)


def check_weights(job: ElasticJob) -> list[dict]:
    events = job.events()
    assert_replayed(events, job.report())
    return events


def test_a_job_outlives_preemption_a_killed_host_and_a_cut_link_and_admits_late_joiners(
        job_factory):
    job = job_factory("horovod")
    job.start_hosts(3)

    # 1. a preemption notice: node 2's workers checkpoint at the next step, it leaves
    job.procs[2][-1].send_signal(signal.SIGTERM)
    assert job.wait_exit(2) == 0, job.report()
    assert "node 2 " in job.output(2) and "was preempted (SIGTERM) and left the job; " \
        "the workers saved checkpoint epoch" in job.output(2), job.report()
    job.wait_training(world=2, reformation=1)

    # 2. it comes back: admitted at a step boundary
    job.start(2)
    job.wait_training(world=3, reformation=2)

    # 3. every process of host 2 killed
    job.kill_host(2)
    job.wait_training(world=2, reformation=3)

    # 4. back again, then its link goes down
    job.start(2)
    job.wait_training(world=3, reformation=4)
    job.link(2, "down")
    job.wait_training(world=2, reformation=5)

    job.finish()
    assert job.wait_exit(0) == 0, job.report()
    assert job.wait_exit(1) == 0, job.report()
    assert job.wait_exit(2) == 1, job.report()       # cut off: it lost node 0
    out0 = job.output(0)
    host2 = job.cluster.hosts[2].name
    # A worker that horovod itself crashes in a new round (a segmentation fault or an
    # abort inside Gloo, seen about once in 20 runs under load) is replaced like any
    # failed rank, at the cost of one restart more than the schedule's: the job must go
    # on all the same, and the restarts named below count it.
    crashes = len(re.findall(r"rank \d+ \(\S+\) was killed by SIG(?:SEGV|ABRT)", out0))
    for said in ("re-forming with 2 nodes (2 workers) from checkpoint epoch",
                 "(re-formation 1; planned: no restart used)",
                 f"node 2 ({host2}) joined; the job re-forms with 3 nodes",
                 "re-forming with 3 nodes (3 workers) from checkpoint epoch",
                 f"node 2 ({host2}) lost: its launcher's connection closed",
                 f"node 2 ({host2}) lost: nothing heard from its launcher for 3 s"):
        assert said in out0, f"{said!r} not said\n{job.report()}"
    for formation, restart in ((3, 1), (5, 2)):
        said = re.search(rf"\(re-formation {formation}; restart (\d) of at most 3\)", out0)
        assert said and restart <= int(said[1]) <= restart + crashes, job.report()
    # every node that stayed says the same, to the end
    for said in ("(re-formation 1; planned", "(re-formation 5; restart ",
                 "the job finished on 2 nodes (2 workers) after 5 re-formations and "
                 f"{2 + crashes} restarts of at most 3"):
        assert said in job.output(0) and said in job.output(1), job.report()
    events = check_weights(job)
    rounds = [(e["world"], e["reformation"], e["restart"], e["nnodes"], e["elastic"])
              for e in events if e["event"] == "start"]
    assert rounds == [(3, 0, 0, 3, "1"), (2, 1, 1, 2, "1"), (3, 2, 2, 3, "1"),
                      (2, 3, 3, 2, "1"), (3, 4, 4, 3, "1"), (2, 5, 5, 2, "1")], rounds
    assert_nothing_left(job.marker["DG_TEST_MARKER"])


def test_a_ps_lite_job_starts_with_min_nodes_admits_late_ones_survives_a_lost_link_and_a_preemption(
        job_factory):
    # a script that never calls dg.stop_requested(): the late node is admitted right
    # after the next checkpoint
    job = job_factory("dist_sync")
    job.start(0, script_args=["--no-stop-check"])
    job.start(1, script_args=["--no-stop-check"])
    job.wait_training(world=2, reformation=0)       # MIN is enough, after --last-call
    job.start(2, script_args=["--no-stop-check"])
    job.wait_training(world=3, reformation=1)
    assert not [e for e in job.events() if e["event"] == "stop"], job.report()
    job.link(2, "down")
    job.wait_training(world=2, reformation=2)
    assert job.wait_exit(2) == 1, job.report()      # cut off, it ends by itself
    assert "lost the master launcher" in job.output(2), job.report()
    job.link(2, "up")
    job.start(2, script_args=["--no-stop-check"])
    job.wait_training(world=3, reformation=3)
    job.procs[1][-1].send_signal(signal.SIGTERM)    # node 1 preempted: it leaves
    assert job.wait_exit(1) == 0, job.report()
    job.wait_training(world=2, reformation=4)
    job.finish()
    assert job.wait_exit(0) == 0, job.report()
    assert job.wait_exit(2) == 0, job.report()
    assert "(re-formation 2; restart 1 of at most 3)" in job.output(0), job.report()
    assert "(re-formation 4; planned: no restart used)" in job.output(2), job.report()
    check_weights(job)
    assert_nothing_left(job.marker["DG_TEST_MARKER"])


def test_below_min_nodes_the_job_ends_and_every_node_names_the_cause(job_factory):
    job = job_factory("p3")
    job.start_hosts(3)
    job.procs[2][-1].send_signal(signal.SIGTERM)
    assert job.wait_exit(2) == 0, job.report()
    job.wait_training(world=2, reformation=1)
    job.start(2)
    job.wait_training(world=3, reformation=2)
    job.kill_host(2)
    job.wait_training(world=2, reformation=3)
    job.link(1, "down")
    assert job.wait_exit(0) == 1, job.report()
    assert job.wait_exit(1) == 1, job.report()
    host1 = job.cluster.hosts[1].name
    said = (f"node 1 ({host1}) lost: nothing heard from its launcher for 3 s\n"
            "dist_gluon.launch[node 0]: 1 node left, fewer than the minimum 2 of --nnodes "
            "2:3: the job ends")
    assert said in job.output(0), job.report()
    assert "node 0 hosts the job: its loss ends the job" in job.output(1), job.report()
    # the second round resumed from the preemption's checkpoint, saved by 3 workers
    events = job.events()
    second = [e for e in events if e["event"] == "start"][1]
    last_of_three = [e for e in events[:events.index(second)] if e["event"] == "save"][-1]
    assert last_of_three["world"] == 3, job.report()
    assert (second["epoch"], second["samples"]) == \
        (last_of_three["epoch"], last_of_three["samples"]), job.report()
    assert_nothing_left(job.marker["DG_TEST_MARKER"])


def test_one_command_over_ssh_goes_on_without_a_killed_host(job_factory):
    job = job_factory("dist_sync")
    cluster = job.cluster
    job.start(0, where=["-H", ",".join(f"{h.name}:1" for h in cluster.hosts),
                        "--ssh-port", str(cluster.ssh_port),
                        "--ssh-identity-file", cluster.identity_file])
    job.wait_training(world=3, reformation=0)
    job.kill_host(2)
    job.wait_training(world=2, reformation=1)
    job.finish()
    assert job.wait_exit(0) == 0, job.report()
    host2 = cluster.hosts[2].name
    assert f"node 2 ({host2}) lost: its launcher's connection closed" in job.output(0)
    check_weights(job)
    assert_nothing_left(job.marker["DG_TEST_MARKER"])


def test_sigterm_to_every_process_checkpoints_ends_the_job_and_it_resumes_from_there(
        job_factory):
    # what SLURM and cloud preemption do: every process of every node gets SIGTERM
    job = job_factory("horovod")
    job.start_hosts(3)
    needle = f"DG_TEST_MARKER={job.marker['DG_TEST_MARKER']}".encode()
    for entry in os.scandir("/proc"):
        try:
            if entry.name.isdigit() and \
                    needle in Path(entry.path, "environ").read_bytes().split(b"\0"):
                os.kill(int(entry.name), signal.SIGTERM)
        except OSError:
            pass
    for host in range(3):
        assert job.wait_exit(host) == 128 + signal.SIGTERM, job.report()
    said = (f"node 0 ({job.cluster.hosts[0].name}) was preempted (SIGTERM): it hosts the "
            "job's rendezvous, so the job ends on every node; the workers saved checkpoint")
    for host in range(3):
        assert said in job.output(host), job.report()
    # the checkpoint of the step boundary after the signal: the workers' own, after
    # dg.stop_requested(), or a periodic one that came first (then they end right away)
    saves = [e for e in job.events() if e["event"] == "save"]
    assert saves and saves[-1]["world"] == 3, job.report()
    assert_nothing_left(job.marker["DG_TEST_MARKER"])

    (job.dir / "progress.json").unlink()
    for host in range(2):                            # the job again, on 2 nodes
        job.start(host)
    job.wait_training(world=2, reformation=0)
    starts = [e for e in job.events() if e["event"] == "start"]
    assert (starts[-1]["epoch"], starts[-1]["samples"]) == \
        (saves[-1]["epoch"], saves[-1]["samples"]), job.report()
    job.finish()
    assert job.wait_exit(0) == 0 and job.wait_exit(1) == 0, job.report()
    check_weights(job)
    assert_nothing_left(job.marker["DG_TEST_MARKER"])
