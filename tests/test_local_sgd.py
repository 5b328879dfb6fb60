"""Local SGD and DiLoCo (``DistributedTrainer(sync_every=H, outer_optimizer=...)``): 2
workers through the real launcher against a one-process replay of the algorithm
(plain gluon.Trainers per simulated worker, NumPy averaging and outer NAG), on every
backend; one job per backend runs every case (tests/workers/local_sgd_cases.py)."""
import json
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from conftest import REPO, assert_ok, launcher, process_env, run

WORKERS = REPO / "tests" / "workers"
SCRIPT = WORKERS / "local_sgd_cases.py"
# (backend, launcher arguments): horovod over Gloo and over MPI, ps-lite, P3
JOBS = {"horovod": ("horovod", []), "horovod_mpi": ("horovod", ["--transport", "mpi"]),
        "dist_sync": ("dist_sync", []), "p3": ("p3", [])}
# every case against its replay, within float32 rounding
EXACT = ["per_step", "sync1_outer_sgd", "local", "local_adam", "local_warmup",
         "diloco_sgd1", "diloco_nag", "heads", "local_overlap", "diloco_overlap"]
CHECKPOINTED = ["diloco_nag", "diloco_overlap", "diloco_2bit"]


def _mpi_ready() -> bool:
    if shutil.which("mpirun") is None:
        return False
    probe = subprocess.run([sys.executable, "-c", "import horovod.mxnet as h; "
                            "print(h.mpi_built())"], capture_output=True, text=True)
    return probe.stdout.strip() == "True"


@pytest.fixture(scope="module")
def replayed(tmp_path_factory):
    out = tmp_path_factory.mktemp("replay")
    assert_ok(run([sys.executable, str(SCRIPT), str(out), "replay", "2"], out))
    return out


@pytest.fixture(scope="module", params=list(JOBS))
def job(request, tmp_path_factory):
    if request.param == "horovod_mpi" and not _mpi_ready():
        pytest.skip("mpirun or horovod's MPI build is missing (make setup)")
    backend, extra = JOBS[request.param]
    out = tmp_path_factory.mktemp(request.param)
    argv = launcher(backend, SCRIPT, out, "train")
    argv[argv.index("--"):argv.index("--")] = extra
    # DG_CHECK_SYNC=1: the replicas are compared at every step that should leave them
    # equal (per-step averaging, the warm-up), never inside a worker's own local steps
    # (the check would end the job with a DivergenceError there)
    assert_ok(subprocess.run(argv, cwd=out, env=process_env(DG_CHECK_SYNC="1"),
                             capture_output=True, text=True, timeout=240))
    return out


def _params(path):
    with np.load(path) as data:
        return [data[str(i)] for i in range(len(data.files))]


def _error(a, b):
    return max(float(np.abs(x - y).max()) for x, y in zip(a, b))


def _case(out, case, rank):
    return _params(out / f"{case}_rank{rank}.npz")


@pytest.mark.parametrize("case", EXACT)
def test_local_sgd_and_diloco_equal_a_one_process_replay_of_the_algorithm(job, replayed,
                                                                          case):
    rank0 = _case(job, case, 0)
    assert _error(_case(job, case, 1), rank0) == 0.0          # ranks end identical
    assert _error(rank0, _params(replayed / f"{case}_replay.npz")) < 1e-5, case


def test_sync_every_1_with_outer_sgd_lr_1_is_per_step_averaging(job):
    # momentum and weight decay are linear: averaging the weights after every local
    # step is averaging the gradients
    assert _error(_case(job, "sync1_outer_sgd", 0), _case(job, "per_step", 0)) < 1e-6


def test_diloco_with_outer_sgd_lr_1_is_local_sgd(job):
    assert _error(_case(job, "diloco_sgd1", 0), _case(job, "local", 0)) == 0.0
    # and Local SGD is not per-step averaging: the test would see a difference
    assert _error(_case(job, "local", 0), _case(job, "per_step", 0)) > 1e-3


def test_pseudo_gradients_travel_in_fp16_close_to_float32(job, replayed):
    rank0 = _case(job, "local_fp16", 0)
    assert _error(_case(job, "local_fp16", 1), rank0) == 0.0
    assert _error(rank0, _params(replayed / "local_replay.npz")) < 1e-3


@pytest.mark.parametrize("case", ["local", "diloco_nag"])
def test_workers_of_two_devices_each_run_the_same_rounds(job, replayed, case):
    rank0 = _case(job, f"{case}_2dev", 0)
    assert _error(_case(job, f"{case}_2dev", 1), rank0) == 0.0
    assert _error(rank0, _params(replayed / f"{case}_replay.npz")) < 1e-5


@pytest.mark.parametrize("case", CHECKPOINTED)
def test_a_checkpoint_restored_mid_round_continues_exactly(job, case):
    # diloco_overlap: saved while the first round's sum waits to be applied
    for rank in (0, 1):
        assert _error(_case(job, f"resumed_{case}", rank),
                      _case(job, f"straight_{case}", rank)) == 0.0


def test_2bit_pseudo_gradients_leave_every_rank_the_same_weights(job, replayed):
    # each rank sends its delta plus what the last round left (a checkpoint resumes it
    # exactly: test_a_checkpoint_restored_mid_round_continues_exactly); the workers end
    # equal, and not equal to the uncompressed rounds (the codec ran)
    rank0 = _case(job, "diloco_2bit", 0)
    assert _error(_case(job, "diloco_2bit", 1), rank0) == 0.0
    assert _error(rank0, _params(replayed / "diloco_2bit_replay.npz")) > 1e-3


def test_an_overlapped_round_differs_from_the_waiting_one(job):
    assert _error(_case(job, "diloco_overlap", 0), _case(job, "diloco_nag", 0)) > 1e-4


def test_a_mid_round_checkpoint_restores_on_another_number_of_workers(job):
    # one process restores the 2-worker checkpoint: the position, the anchor and the
    # outer optimizer state, and saved rank 0's own weights and optimizer states
    assert_ok(run([sys.executable, str(SCRIPT), str(job), "restore"], job))
    got = json.loads((job / "restored_on_one.json").read_text())
    expected = {"steps": 6, "in_round": 2, "saved_workers": 2, "weights_are_rank0s": True,
                "anchors_equal": True, "inner_are_rank0s": True, "outer_updates": 1,
                "pending": None, "pending_restored": True,
                "pending_averaged_over_its_workers": None}
    assert got["diloco_nag"] == expected
    # the overlapped run's first outer step is still to come, its sum restored; applied
    # on one process, it is still the average over the 2 workers that made it
    assert got["diloco_overlap"] == dict(expected, outer_updates=0, pending="late",
                                         pending_averaged_over_its_workers=True)


ARGUMENTS = """
    import mxnet as mx
    from mxnet import autograd, gluon
    import dist_gluon as dg

    kv = dg.create("local")
    for kwargs in ({"sync_every": 0}, {"sync_every": 2.5},
                   {"outer_optimizer_params": {"learning_rate": 0.7}},
                   {"sync_every": 4, "sync_delay": 5}, {"local_sgd_warmup": 10},
                   {"sync_every": 4, "local_sgd_warmup": -1},
                   {"sync_every": 4, "outer_optimizer": "nosuch"},
                   {"sync_every": 4, "outer_optimizer": "nag",
                    "outer_optimizer_params": {"rescale_grad": 0.5}}):
        net = gluon.nn.Dense(2, in_units=3)
        net.initialize()
        try:
            dg.DistributedTrainer(net.collect_params(), "sgd", kv=kv, **kwargs)
            print("accepted", sorted(kwargs))
        except ValueError as err:
            print("refused", sorted(kwargs), " ".join(str(err).split()))
    # one process: a round averages one worker, so Local SGD is plain training
    results = []
    for kwargs in ({}, {"sync_every": 3}):
        mx.random.seed(1)
        net = gluon.nn.Dense(2, in_units=3)
        net.initialize()
        trainer = dg.DistributedTrainer(net.collect_params(), "sgd",
                                        {"learning_rate": 0.1, "momentum": 0.9}, kv=kv,
                                        **kwargs)
        for step in range(7):
            with autograd.record():
                loss = net(mx.nd.ones((4, 3)) * step).sum()
            loss.backward()
            trainer.allreduce_grads()
            trainer.update(4)
        trainer.sync_weights()
        results.append(net.weight.data().asnumpy())
    print("one process difference", float(abs(results[0] - results[1]).max()))
"""


@pytest.mark.spawns
def test_bad_round_arguments_are_value_errors_and_one_process_trains_plainly(tmp_path):
    script = tmp_path / "arguments.py"
    script.write_text(textwrap.dedent(ARGUMENTS))
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=process_env(),
                          capture_output=True, text=True, timeout=120)
    assert_ok(proc)
    lines = proc.stdout.splitlines()
    assert [line.split()[0] for line in lines[:8]] == ["refused"] * 8, proc.stdout
    assert "sync_every must be an int >= 1" in lines[0]
    assert "outer_optimizer_params was given without an outer_optimizer" in lines[2]
    assert "sync_delay must be an int from 0 to sync_every (4)" in lines[3]
    assert "local_sgd_warmup=10 needs sync_every > 1" in lines[4]
    assert "outer_optimizer='nosuch'" in lines[6]
    assert "leave its rescale_grad at 1" in lines[7]
    assert float(lines[8].split()[-1]) < 1e-6


ELASTIC = WORKERS / "local_sgd_elastic.py"


def _elastic_run(directory, *args):
    directory.mkdir()
    argv = [sys.executable, "-m", "dist_gluon.launch", "--nnodes", "1:1", "-n", "2",
            "--backend", "horovod", "--max-restarts", "1", "--timeout", "150", "--",
            sys.executable, str(ELASTIC), str(directory), *args]
    assert_ok(subprocess.run(argv, cwd=directory, env=process_env(), capture_output=True,
                             text=True, timeout=240))
    events = [json.loads(line) for line in (directory / "events.jsonl").open()]
    return [e for e in events if e["event"] == "start"], _params(directory / "weights.npz")


@pytest.mark.spawns
def test_a_worker_killed_mid_round_heals_from_its_peer_with_the_round(tmp_path):
    # one node, two workers under @dg.elastic.run: rank 1 is SIGKILLed after step 8,
    # rank 0 keeps its process and goes back to its last commit, a new rank 1 takes
    # rank 0's state from memory: the anchor, the outer Nesterov momentum and the
    # position in the round must travel for the weights to equal those of the run
    # without a fault (every rank trains on the same batches, so rank 0's state is
    # rank 1's)
    starts, straight = _elastic_run(tmp_path / "straight")
    assert len(starts) == 1
    starts, healed = _elastic_run(tmp_path / "healed", "--kill-rank-at", "1", "8")
    assert len(starts) == 2, starts
    assert starts[1]["pids"][0] == starts[0]["pids"][0]      # rank 0 kept its process
    assert starts[1]["pids"][1] != starts[0]["pids"][1]      # rank 1 is a new one
    assert starts[1]["step"] >= 8 and starts[1]["in_round"] > 0, starts   # mid-round
    assert _error(healed, straight) == 0.0
