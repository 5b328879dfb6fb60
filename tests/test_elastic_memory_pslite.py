"""Elastic ps-lite jobs (dist_sync, p3) whose workers restart but keep their state in
memory: every dg.elastic.State.commit also lands in the node's shared memory
(dist_gluon/elastic/nodecopy.py); after a lost host, a preemption, a lost node 0 or a cut
link the restarted workers take the freshest commit of the job from there (a node that
joins gets it from a live peer), never from a checkpoint.

The distributed tests run tests/workers/elastic_memory_train.py (the same script as on
horovod) on 3 emulated hosts (one launcher each, --nnodes 2:3); its final weights must
equal tests/test_elastic.py's NumPy replay of the schedule of world sizes, which holds
only if no step was applied twice or skipped and no sample trained twice in an epoch.
The first tests check the node's copy itself, in one host's processes.
"""
from __future__ import annotations

import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from conftest import REPO, process_env
from test_launch import _marker_env, assert_nothing_left

sys.path.insert(0, str(REPO / "tools"))
import emulated_cluster  # noqa: E402

SCRIPT = REPO / "tests" / "workers" / "elastic_memory_train.py"
FROM_MEMORY = ("from the workers' last commit in memory (they restart and take the "
               "freshest from their nodes' shared memory")
distributed = [pytest.mark.slow,
               pytest.mark.skipif(emulated_cluster.skip_reason() is not None,
                                  reason=str(emulated_cluster.skip_reason()))]


# ---------------------------------------------------------------------- the node's copy
# A worker's side without a launcher: local kvstore, a model and momentum SGD, a State
# that commits to the copy in DIR for job JOB. Prints the state it started from and the
# one it ends with.
COPY_SCRIPT = """
import json, os, signal, sys
import mxnet as mx
from mxnet import autograd, gluon
import dist_gluon as dg
from dist_gluon.elastic.nodecopy import NodeCopy

directory, job, steps, how = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
mx.random.seed(len(sys.argv[5:]))
net = gluon.nn.Dense(3, in_units=4)
net.initialize(mx.init.Normal(1.0))
trainer = dg.DistributedTrainer(net.collect_params(), "sgd",
                                {"learning_rate": 0.1, "momentum": 0.9}, kv="local")
state = dg.elastic.State(net=net, trainer=trainer, step=0)
node_copy = NodeCopy(directory, job, writer=True)
state.use_node_copy(node_copy)
state.sync()

def values():
    moms = [trainer._updaters[0].states[i] for i in sorted(trainer._updaters[0].states)]
    return {"step": state.step, "serial": state._serial,
            "weight": net.weight.data().asnumpy().ravel().tolist(),
            "momentum": [m.asnumpy().ravel().tolist() for m in moms]}

print("START " + json.dumps(values()), flush=True)
x = mx.nd.arange(8).reshape((2, 4)) / 8
for _ in range(steps):
    with autograd.record():
        loss = (net(x) ** 2).sum()
    loss.backward()
    trainer.step(2)
    state.step += 1
    state.commit()
print("END " + json.dumps(values()), flush=True)
if how == "torn":
    # the next commit's copies are being written when the process dies: the slot the
    # copy's meta does not name gets garbage, and meta is never replaced
    keys, arrays = state._keyed_arrays()
    slot, copies = node_copy.allocate(keys, arrays)
    for c in copies.values():
        c[:] = 12345.0
    mx.nd.waitall()
if how in ("torn", "kill"):
    os.kill(os.getpid(), signal.SIGKILL)
"""


def _run_copy(tmp_path, directory, job, steps, how="exit"):
    script = tmp_path / "copy_worker.py"
    script.write_text(textwrap.dedent(COPY_SCRIPT))
    proc = subprocess.run([sys.executable, str(script), str(directory), job, str(steps), how],
                          env=process_env(), capture_output=True, text=True, timeout=120)
    lines = {line.split(" ", 1)[0]: json.loads(line.split(" ", 1)[1])
             for line in proc.stdout.splitlines() if line.startswith(("START ", "END "))}
    return proc, lines


@pytest.fixture
def copy_dir(tmp_path):
    directory = tmp_path / "copy"
    directory.mkdir(mode=0o700)
    return directory


@pytest.mark.parametrize("how", ["kill", "torn"])
def test_the_node_copy_outlives_a_killed_process_with_its_last_complete_commit(
        tmp_path, copy_dir, how):
    first, seen = _run_copy(tmp_path, copy_dir, "job-a", steps=3, how=how)
    assert first.returncode == -signal.SIGKILL, first.stderr[-3000:]
    assert seen["START"]["step"] == 0 and seen["END"]["step"] == 3, first.stdout
    # a new process (its model initialised differently) starts from that commit
    second, again = _run_copy(tmp_path, copy_dir, "job-a", steps=2, how="exit", )
    assert second.returncode == 0, second.stderr[-3000:]
    start = again["START"]
    # the sync that takes the copy commits it once more
    assert start["step"] == 3 and start["serial"] == seen["END"]["serial"] + 1, again
    assert start["weight"] == seen["END"]["weight"]
    assert start["momentum"] == seen["END"]["momentum"]
    assert again["END"]["step"] == 5


def test_a_copy_of_another_job_or_in_an_open_directory_is_refused(tmp_path, copy_dir):
    from dist_gluon.elastic.nodecopy import NodeCopy, NodeCopyError

    proc, _ = _run_copy(tmp_path, copy_dir, "job-a", steps=1)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with pytest.raises(NodeCopyError, match="belongs to job job-a, not to this job"):
        NodeCopy(str(copy_dir), "job-b", writer=False)
    assert NodeCopy(str(copy_dir), "job-a", writer=False).held().layout["extras"] == \
        {"step": 1}
    open_dir = tmp_path / "open"
    open_dir.mkdir(mode=0o755)
    os.chmod(open_dir, 0o755)
    with pytest.raises(NodeCopyError, match="mode 0700"):
        NodeCopy(str(open_dir), "job-a", writer=True)
    with pytest.raises(NodeCopyError, match="DG_JOB_ID"):
        NodeCopy(str(copy_dir), "", writer=True)


def test_the_launcher_makes_the_nodes_directory_closed_removes_it_and_dead_launchers_ones(
        tmp_path):
    # a directory left by a launcher that was SIGKILLed (its pid is gone)
    dead = subprocess.Popen(["true"])
    dead.wait()
    orphan = tmp_path / f"dg-state-0123abcd-node1-{dead.pid}-12345"
    orphan.mkdir(mode=0o700)
    code = textwrap.dedent(f"""
        import os, stat
        from dist_gluon.launch import statedir
        statedir.ROOT = {str(tmp_path)!r}
        path = statedir.for_job("00ff00ff", 2)
        assert path == statedir.for_job("00ff00ff", 2)
        mode = stat.S_IMODE(os.stat(path).st_mode)
        open(os.path.join(path, "meta"), "w").close()
        print(os.path.basename(path), oct(mode), sorted(os.listdir({str(tmp_path)!r})))
        statedir.remove()
        print(os.path.exists(path))
    """)
    proc = subprocess.run([sys.executable, "-c", code], env=process_env(),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    made, listing = proc.stdout.splitlines()
    name, mode, rest = made.split(" ", 2)
    assert name.startswith("dg-state-00ff00ff-node2-") and mode == "0o700"
    assert orphan.name not in rest, made          # the dead launcher's is gone
    assert listing == "False"


def test_a_killed_launchers_control_records_are_removed_by_the_next_launcher(tmp_path):
    """The job-control directories (one per round of a launcher, in /dev/shm) of a
    launcher that was SIGKILLed are removed by the next launcher of the host; a live
    launcher's and names of another kind are left."""
    from dist_gluon.launch import statedir
    dead = subprocess.Popen(["true"])
    dead.wait()
    orphan = tmp_path / f"dg-control-{dead.pid}-12345-x1y2"
    live = tmp_path / (statedir.control_prefix() + "a0b1")
    other = tmp_path / "dg-control-abc123"
    for path in (orphan, live, other):
        path.mkdir(mode=0o700)
    statedir.remove_orphan_controls(str(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([live.name, other.name])


@pytest.mark.parametrize("backend", ["dist_sync", "dist_async"])
def test_a_killed_worker_restarts_with_its_peers_from_the_nodes_memory(tmp_path, backend):
    """One node, two workers (--nnodes 1:1): rank 1 is SIGKILLed after 3 steps; both
    restart, take the node's copy (2 or 3 steps in: dist_sync; on dist_async rank 0
    may be one step further, its commits wait only for the stop flag's sum) and on
    dist_sync the weights equal the replay of the schedule (dist_async applies the
    gradients as they arrive: no replay is exact); the launcher removes the node's copy
    as it ends."""
    from test_elastic import assert_replayed

    marker = _marker_env()
    (tmp_path / "finish").touch()
    proc = subprocess.Popen(
        [sys.executable, "-m", "dist_gluon.launch", "--nnodes", "1:1", "-n", "2",
         "--backend", backend, "--max-restarts", "1", "--", sys.executable,
         str(SCRIPT), str(tmp_path), "--kill-rank-at", "1", "3"],
        cwd=tmp_path, env=process_env(**marker), stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True)
    stdout, stderr = proc.communicate(timeout=180)
    report = stdout[-3000:] + stderr[-3000:]
    assert proc.returncode == 0, report
    assert FROM_MEMORY in stderr, report
    events = [json.loads(line) for line in (tmp_path / "events.jsonl").open()]
    starts = [e for e in events if e["event"] == "start"]
    assert [s["world"] for s in starts] == [2, 2], report
    assert not set(starts[1]["pids"]) & set(starts[0]["pids"]), report   # restarted
    # 2 or 3 steps of 2 x 2 samples (dist_async: up to 4)
    assert starts[1]["samples"] in ((8, 12) if backend == "dist_sync" else (8, 12, 16)), \
        report
    if backend == "dist_sync":
        assert_replayed(events, report)
    else:
        assert [e["event"] for e in events].count("done") == 1, report
    assert not list(tmp_path.glob("ckpt*")), report
    assert not glob.glob(f"/dev/shm/dg-state-*-{proc.pid}-*"), report
    assert_nothing_left(marker["DG_TEST_MARKER"])


# ---------------------------------------------------------------------- across hosts
@pytest.fixture(scope="module")
def cluster():
    with emulated_cluster.EmulatedCluster(num_hosts=3) as c:
        yield c


@pytest.fixture
def memory_jobs(cluster, tmp_path):
    from test_elastic import make_jobs
    from test_elastic_memory import MemoryJob
    yield from make_jobs(MemoryJob, cluster, tmp_path)


def _state_dirs(job, host: int, which: int = -1) -> list[str]:
    """The node's copies made by that launcher of the job."""
    return glob.glob(f"/dev/shm/dg-state-*-node{host}-{job.procs[host][which].pid}-*")


def _restarted_from_memory(job, since: float | None = None) -> dict:
    """The newest round's start: its workers are new processes, it resumed where the
    round before was (a position > 0, from memory), and the job has no checkpoint."""
    starts = job.starts()
    new, old = starts[-1], starts[-2]
    assert not set(new["pids"]) & set(old["pids"]), job.report()
    assert (new["epoch"], new["samples"]) > (old["epoch"], old["samples"]), job.report()
    assert not list(job.dir.glob("ckpt*")), job.report()
    if since is not None:
        print(f"{new['world']} workers, first step {job.progress()['at'] - since:.2f} s "
              "after the fault")
    return new


@pytest.mark.parametrize("backend", ["dist_sync"])
@distributed[0]
@distributed[1]
def test_a_ps_lite_job_restarts_from_memory_after_a_killed_host_heals_a_joiner_and_a_cut_link(
        memory_jobs, backend):
    from test_elastic import check_weights

    job = memory_jobs(backend)
    job.start_hosts(3)
    killed_dir = _state_dirs(job, 2)
    assert len(killed_dir) == 1 and oct(os.stat(killed_dir[0]).st_mode & 0o777) == "0o700"

    # every process of host 2 killed: nodes 0 and 1 restart their workers from memory
    killed = time.time()
    job.kill_host(2)
    job.wait_training(world=2, reformation=1, steps=1)
    _restarted_from_memory(job, killed)
    assert "(re-formation 1; restart 1 of at most 3)" in job.output(0), job.report()
    assert FROM_MEMORY in job.output(0) and FROM_MEMORY in job.output(1), job.report()

    # host 2 comes back with no copy: admitted at a commit, it heals from a live peer;
    # its new launcher removed the copy its killed one left
    job.start(2)
    job.wait_training(world=3, reformation=2)
    _restarted_from_memory(job)
    assert "joined; the job re-forms with 3 nodes at the workers' next commit" \
        in job.output(0), job.report()
    assert "(re-formation 2; planned: no restart used)" in job.output(0), job.report()
    assert not os.path.exists(killed_dir[0]), job.report()

    # host 2's link goes down (a partition {0, 1} | {2}): the minority ends by itself
    cut = time.time()
    job.link(2, "down")
    job.wait_training(world=2, reformation=3, steps=1)
    _restarted_from_memory(job, cut)

    job.finish()
    assert job.wait_exit(0) == 0 and job.wait_exit(1) == 0, job.report()
    assert job.wait_exit(2) == 1, job.report()
    check_weights(job)
    assert not any(_state_dirs(job, host) for host in range(3)), job.report()
    assert_nothing_left(job.marker["DG_TEST_MARKER"])


@pytest.mark.parametrize("backend", ["p3"])
@distributed[0]
@distributed[1]
def test_a_ps_lite_job_restarts_from_memory_after_a_preemption_and_the_loss_of_node_0(
        memory_jobs, backend):
    from test_elastic import check_weights

    job = memory_jobs(backend)
    job.start_hosts(3)

    # node 2 preempted (SIGTERM to its launcher): the workers end at their next commit
    job.procs[2][-1].send_signal(signal.SIGTERM)
    assert job.wait_exit(2) == 0, job.report()
    assert "was preempted (SIGTERM) and left the job; the workers committed their state " \
           "at a step boundary" in job.output(2), job.report()
    job.wait_training(world=2, reformation=1, steps=1)
    _restarted_from_memory(job)
    assert "(re-formation 1; planned: no restart used)" in job.output(0), job.report()
    assert not _state_dirs(job, 2), job.report()      # removed as its launcher left
    job.start(2)
    job.wait_training(world=3, reformation=2)
    _restarted_from_memory(job)

    # node 0, the job's host (scheduler and a server), killed: node 1 takes over and
    # the workers of nodes 1 and 2 restart from their nodes' memory
    killed = time.time()
    job.kill_host(0)
    job.wait_training(world=2, reformation=3, steps=1)
    _restarted_from_memory(job, killed)
    assert "takes over as the job's host" in job.output(1), job.report()
    assert FROM_MEMORY in job.output(1) and FROM_MEMORY in job.output(2), job.report()

    job.finish()
    assert job.wait_exit(1) == 0 and job.wait_exit(2) == 0, job.report()
    check_weights(job)
    assert not _state_dirs(job, 1) and not _state_dirs(job, 2), job.report()
    for path in _state_dirs(job, 0):                  # its launcher was SIGKILLed
        shutil.rmtree(path)
    assert_nothing_left(job.marker["DG_TEST_MARKER"])
