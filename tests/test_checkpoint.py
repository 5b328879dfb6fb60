"""Checkpointer: atomic saves from rank 0, restores on every rank (also where only rank 0
sees the files, and on another number of workers), damaged checkpoints skipped with a
warning, and exact resume after a worker is SIGKILLed and the launcher restarts the job.

Single-process behaviour runs in this process on the local backend; distributed behaviour
runs tests/workers/checkpoint_*.py as 2 workers through the real launcher.
"""
import hashlib
import json
import os
import random
import socket
import subprocess
import sys
import warnings

import mxnet as mx
import numpy as np
import pytest
from mxnet import autograd, gluon

import dist_gluon as dg
import dist_gluon.checkpoint
import dist_gluon.trainer
from conftest import REPO, TRAINING_BACKENDS, assert_ok, process_env, worker_lines
from dist_gluon.checkpoint import FORMAT, FORMAT_VERSION, Checkpointer, CheckpointError

WORKERS = REPO / "tests" / "workers"
# the restart test runs 2 jobs per backend; P3 (the same ps-lite job with another van)
# is covered by the restore cases
RESTART_BACKENDS = ("horovod", "dist_sync")
FILES = ("params.npz", "trainer.states", "state.pkl", "meta.json")


def _run(argv, cwd, timeout=180):
    return subprocess.run(argv, cwd=cwd, env=process_env(), capture_output=True, text=True,
                          timeout=timeout)


# --------------------------------------------------------------------- one process
def _model(hidden=8, seed=0, deferred=False):
    mx.random.seed(seed)
    net = gluon.nn.HybridSequential()
    net.add(gluon.nn.Dense(hidden, activation="relu"), gluon.nn.Dense(3))
    net.initialize(mx.init.Xavier())
    if not deferred:
        net(mx.nd.ones((2, 5)))
    return net


def _trainer(net, lr=0.05):
    return dg.DistributedTrainer(net.collect_params(), "adam", {"learning_rate": lr},
                                 kv="local")


def _step(net, trainer, seed):
    rng = np.random.RandomState(seed)
    x = mx.nd.array(rng.randn(4, 5))
    y = mx.nd.array(rng.randint(0, 3, 4))
    with autograd.record():
        loss = gluon.loss.SoftmaxCrossEntropyLoss()(net(x), y)
    loss.backward()
    trainer.step(4)


def _values(net):
    return [p.data().asnumpy() for p in net.collect_params().values()]


def _same(a, b, tol=0.0):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.shape == y.shape
        assert float(np.abs(x - y).max()) <= tol


def _trained(directory, saves=2, keep=3):
    """A model trained one step per save, saved as epoch e, step 10*e; returns the
    Checkpointer and the parameter values at every save."""
    net = _model()
    trainer = _trainer(net)
    checkpoints = Checkpointer(directory, kv="local", keep=keep)
    saved = []
    for e in range(saves):
        _step(net, trainer, seed=e)
        checkpoints.save(net, trainer, epoch=e, step=10 * e, extra={"save": e})
        saved.append(_values(net))
    return checkpoints, saved


def test_save_writes_the_documented_files_with_metadata_and_checksums(tmp_path):
    checkpoints, saved = _trained(tmp_path, saves=1)
    path = tmp_path / "ckpt-000001"
    assert sorted(os.listdir(tmp_path)) == ["ckpt-000001"]
    assert sorted(os.listdir(path)) == sorted(FILES)
    meta = json.loads((path / "meta.json").read_text())
    assert (meta["format"], meta["version"]) == (FORMAT, FORMAT_VERSION)
    assert (meta["epoch"], meta["step"], meta["num_workers"], meta["backend"]) == \
        (0, 0, 1, "local")
    assert meta["versions"]["dist_gluon"] == dg.__version__
    assert meta["versions"]["mxnet"] == mx.__version__
    assert meta["versions"]["numpy"] == np.__version__
    assert [p["shape"] for p in meta["parameters"]] == [[8, 5], [8], [3, 8], [3]]
    assert sorted(meta["files"]) == sorted(set(FILES) - {"meta.json"})
    for name, record in meta["files"].items():
        data = (path / name).read_bytes()
        assert record == {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    params = np.load(path / "params.npz")
    _same([params[str(i)] for i in range(4)], saved[0])
    # trainer.states is gluon's own format
    net = _model()
    trainer = _trainer(net)
    trainer.load_states(str(path / "trainer.states"))
    assert trainer.optimizer.num_update == 1


def test_a_node_local_checkpointer_on_one_process_saves_and_restores_as_usual(tmp_path):
    net = _model()
    trainer = _trainer(net)
    _step(net, trainer, seed=0)
    checkpoints = Checkpointer(tmp_path, kv="local", node_local=True)
    assert checkpoints.save(net, trainer, epoch=1) == str(tmp_path / "ckpt-000001")
    other = _model(seed=1)
    state = checkpoints.restore(other, _trainer(other))
    assert (state["epoch"], state["path"]) == (1, str(tmp_path / "ckpt-000001"))
    _same(_values(other), _values(net))


def test_restore_returns_none_when_there_is_no_checkpoint(tmp_path):
    net = _model()
    assert Checkpointer(tmp_path / "missing", kv="local").restore(net) is None
    assert Checkpointer(tmp_path, kv="local").restore(net) is None


def test_restore_brings_back_parameters_optimizer_random_state_and_extra(tmp_path):
    net = _model(seed=1)
    trainer = _trainer(net)
    _step(net, trainer, seed=0)
    _step(net, trainer, seed=1)
    random.seed(5)
    np.random.seed(5)
    Checkpointer(tmp_path, kv="local").save(net, trainer, 2, step=7, extra={"best": 0.25})
    draws = (random.random(), np.random.rand())
    _step(net, trainer, seed=2)
    expected = _values(net)

    net = _model(seed=2, deferred=True)
    trainer = _trainer(net, lr=0.5)        # the saved optimizer (lr=0.05) comes back
    random.seed(0)
    np.random.seed(0)
    state = Checkpointer(tmp_path, kv="local").restore(net, trainer)
    assert state == {"epoch": 2, "step": 7, "extra": {"best": 0.25},
                     "path": str(tmp_path / "ckpt-000001"), "num_workers": 1}
    assert (random.random(), np.random.rand()) == draws
    _step(net, trainer, seed=2)
    _same(_values(net), expected)


def test_keep_deletes_all_but_the_newest_checkpoints(tmp_path):
    checkpoints, saved = _trained(tmp_path / "two", saves=4, keep=2)
    assert sorted(os.listdir(tmp_path / "two")) == ["ckpt-000003", "ckpt-000004"]
    net = _model(seed=9)
    assert checkpoints.restore(net)["epoch"] == 3
    _same(_values(net), saved[3])
    _trained(tmp_path / "all", saves=4, keep=None)
    assert len(os.listdir(tmp_path / "all")) == 4


CRASHING_SAVE = """
import os, signal, sys
from mxnet import gluon
import dist_gluon.checkpoint as checkpoint

def crash(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGKILL)

net = gluon.nn.Dense(3, in_units=5)
net.initialize()
checkpoints = checkpoint.Checkpointer(sys.argv[1], kv="local")
checkpoints.save(net, None, epoch=0)
if sys.argv[2] == "writing":      # killed after params.npz is written, before its fsync
    checkpoint._seal = crash
else:                             # killed with every file written, before the rename
    checkpoint.os.rename = crash
checkpoints.save(net, None, epoch=1)
"""


@pytest.mark.parametrize("when", ["writing", "renaming"])
@pytest.mark.spawns
def test_a_save_killed_midway_leaves_the_previous_checkpoint_and_a_temporary_directory(
        tmp_path, when):
    script = tmp_path / "crash.py"
    script.write_text(CRASHING_SAVE)
    directory = tmp_path / "ckpt"
    proc = _run([sys.executable, str(script), str(directory), when], tmp_path)
    assert proc.returncode == -9, proc.stderr
    leftovers = [n for n in os.listdir(directory) if n.startswith(".tmp-ckpt-")]
    assert sorted(os.listdir(directory)) == sorted(["ckpt-000001"] + leftovers)
    assert len(leftovers) == 1 and os.listdir(directory / leftovers[0])

    net = gluon.nn.Dense(3, in_units=5)
    net.initialize()
    checkpoints = Checkpointer(directory, kv="local")
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)     # nothing damaged, nothing to say
        assert checkpoints.restore(net)["epoch"] == 0
    checkpoints.save(net, None, epoch=1)                 # and the next save cleans up
    assert sorted(os.listdir(directory)) == ["ckpt-000001", "ckpt-000002"]


def test_a_save_that_fails_removes_its_partial_files_and_keeps_the_previous(tmp_path):
    checkpoints, saved = _trained(tmp_path, saves=1)
    net = _model(seed=3)
    with pytest.raises(CheckpointError, match="could not save.*pickle"):
        checkpoints.save(net, _trainer(net), epoch=5, extra=lambda: None)
    assert os.listdir(tmp_path) == ["ckpt-000001"]
    assert checkpoints.restore(net)["epoch"] == 0
    _same(_values(net), saved[0])


def _truncate(path):
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _garble(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("name, damage", [
    ("params.npz", _truncate), ("trainer.states", _garble), ("state.pkl", os.unlink),
    ("meta.json", _truncate), ("meta.json", os.unlink)])
def test_a_damaged_newest_checkpoint_is_skipped_with_a_warning_naming_the_file(
        tmp_path, name, damage):
    checkpoints, saved = _trained(tmp_path, saves=2)
    bad = tmp_path / "ckpt-000002" / name
    damage(bad)
    net = _model(seed=7)
    with pytest.warns(UserWarning, match=f"skipping damaged checkpoint .*{bad}"):
        state = checkpoints.restore(net, _trainer(net))
    assert state["extra"] == {"save": 0}
    _same(_values(net), saved[0])


def test_an_explicitly_requested_damaged_or_missing_checkpoint_raises(tmp_path):
    checkpoints, saved = _trained(tmp_path, saves=2)
    net = _model(seed=7)
    assert checkpoints.restore(net, path="ckpt-000001")["epoch"] == 0
    assert checkpoints.restore(net, path=tmp_path / "ckpt-000002")["epoch"] == 1
    _truncate(tmp_path / "ckpt-000002" / "params.npz")
    with pytest.raises(CheckpointError, match="ckpt-000002/params.npz is truncated"):
        checkpoints.restore(net, path="ckpt-000002")
    with pytest.raises(CheckpointError, match="no checkpoint at .*ckpt-000009"):
        checkpoints.restore(net, path="ckpt-000009")


def test_when_every_checkpoint_is_damaged_restore_raises_instead_of_starting_afresh(
        tmp_path):
    checkpoints, _ = _trained(tmp_path, saves=2)
    for number in (1, 2):
        _garble(tmp_path / f"ckpt-00000{number}" / "params.npz")
    with pytest.warns(UserWarning), pytest.raises(CheckpointError, match="delete the damaged"):
        checkpoints.restore(_model())


def test_a_checkpoint_from_a_newer_format_is_refused(tmp_path):
    checkpoints, _ = _trained(tmp_path, saves=1)
    meta_path = tmp_path / "ckpt-000001" / "meta.json"
    meta = json.loads(meta_path.read_text())
    meta["version"] = FORMAT_VERSION + 1
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match="newer dist_gluon"):
        checkpoints.restore(_model(), path="ckpt-000001")


def test_restoring_into_a_different_model_raises_naming_the_parameters(tmp_path):
    checkpoints, _ = _trained(tmp_path, saves=1)
    with pytest.raises(CheckpointError, match=r"parameter #0: the model has .* shape \(7, 5\)"):
        checkpoints.restore(_model(hidden=7))
    net = gluon.nn.Dense(3)
    net.initialize()
    with pytest.raises(CheckpointError, match="holds 4 parameters but the model has 2"):
        checkpoints.restore(net)


def _twelve_layers(shift=0):
    """12 Dense layers named m_dense<shift>... : gluon.Trainer's order (sorted names) is
    not the model's, and another shift sorts differently again."""
    net = gluon.nn.HybridSequential(prefix="m_")
    with net.name_scope():
        for _ in range(shift):
            gluon.nn.Dense(1)
        for _ in range(11):
            net.add(gluon.nn.Dense(4, in_units=4, activation="tanh"))
        net.add(gluon.nn.Dense(3, in_units=4))
    net.initialize(mx.init.Xavier())
    return net


def _make(kind, net):
    if kind == "gluon":
        return gluon.Trainer(net.collect_params(), "adam", {"learning_rate": 0.01})
    return dg.DistributedTrainer(net.collect_params(), "adam", {"learning_rate": 0.01},
                                 kv="local")


def _twelve_step(net, trainer, seed):
    rng = np.random.RandomState(seed)
    x, y = mx.nd.array(rng.randn(4, 4)), mx.nd.array(rng.randint(0, 3, 4))
    with autograd.record():
        loss = gluon.loss.SoftmaxCrossEntropyLoss()(net(x), y)
    loss.backward()
    trainer.step(4)


@pytest.mark.parametrize("saver, loader, shift", [
    ("dg", "dg", 3), ("gluon", "dg", 0), ("dg", "gluon", 0), ("gluon", "dg", 5)])
def test_optimizer_states_restore_onto_their_parameters_whatever_trainer_and_names(
        tmp_path, saver, loader, shift):
    mx.random.seed(0)
    net = _twelve_layers()
    trainer = _make(saver, net)
    for seed in range(2):
        _twelve_step(net, trainer, seed)
    Checkpointer(tmp_path, kv="local").save(net, trainer, epoch=1)
    _twelve_step(net, trainer, 2)

    other = _twelve_layers(shift)
    other_trainer = _make(loader, other)
    Checkpointer(tmp_path, kv="local").restore(other, other_trainer)
    _twelve_step(other, other_trainer, 2)
    _same(_values(other), _values(net))


def test_a_format_1_checkpoint_of_a_distributed_trainer_is_converted(tmp_path):
    """Format 1 (dist_gluon 0.2.0) indexed DistributedTrainer's states by model position;
    a restore puts each on its parameter."""
    import pickle
    mx.random.seed(0)
    net = _twelve_layers()
    trainer = _make("dg", net)
    for seed in range(2):
        _twelve_step(net, trainer, seed)
    Checkpointer(tmp_path, kv="local").save(net, trainer, epoch=1)
    _twelve_step(net, trainer, 2)
    # rewrite it as 0.2.0 wrote it: states keyed by model position, no trainer_positions
    path = tmp_path / "ckpt-000001"
    states, optimizer = pickle.loads((path / "trainer.states").read_bytes())
    by_position = dict(enumerate(trainer.optimizer_positions()))
    old = dist_gluon.trainer.remap_states((states, optimizer), by_position)
    (path / "trainer.states").write_bytes(pickle.dumps(old))
    meta = json.loads((path / "meta.json").read_text())
    data = (path / "trainer.states").read_bytes()
    meta["files"]["trainer.states"] = {"bytes": len(data),
                                       "sha256": hashlib.sha256(data).hexdigest()}
    meta["version"] = 1
    del meta["trainer_positions"]
    (path / "meta.json").write_text(json.dumps(meta))

    other = _twelve_layers()
    other_trainer = _make("dg", other)
    Checkpointer(tmp_path, kv="local").restore(other, other_trainer)
    _twelve_step(other, other_trainer, 2)
    _same(_values(other), _values(net))


def test_saving_a_deferred_model_before_its_first_forward_raises(tmp_path):
    net = _model(deferred=True)
    with pytest.raises(CheckpointError, match="not initialised yet.*first forward"):
        Checkpointer(tmp_path, kv="local").save(net, None, epoch=0)
    assert not [n for n in os.listdir(tmp_path) if n.startswith("ckpt-")]


@pytest.mark.parametrize("kwargs, complaint", [
    ({"keep": 0}, "keep must be an int >= 1 or None"),
    ({"keep": 2.5}, "keep must be an int >= 1 or None"),
    ({"directory": ""}, "directory must be a non-empty path"),
    ({"node_local": "yes"}, "node_local must be True or False")])
def test_bad_constructor_arguments_raise_a_value_error_naming_them(tmp_path, kwargs,
                                                                   complaint):
    kwargs = {"directory": tmp_path, **kwargs}
    with pytest.raises(ValueError, match=complaint):
        Checkpointer(kv="local", **kwargs)


def test_a_negative_epoch_or_step_raises(tmp_path):
    checkpoints = Checkpointer(tmp_path, kv="local")
    with pytest.raises(ValueError, match="epoch must be an int >= 0"):
        checkpoints.save(_model(), None, epoch=-1)
    with pytest.raises(ValueError, match="step must be an int >= 0"):
        checkpoints.save(_model(), None, epoch=0, step=1.5)


# --------------------------------------------------------------------- distributed
def _launch(backend, script, *args, cwd, launcher_args=()):
    return _run([sys.executable, "-m", "dist_gluon.launch", "-n", "2", "--backend", backend,
                 *launcher_args, "--", sys.executable, str(WORKERS / script), *args], cwd)


def _npz(path):
    data = np.load(path)
    return [data[str(i)] for i in range(len(data.files))]


@pytest.fixture(scope="module", params=TRAINING_BACKENDS)
def cases(request, tmp_path_factory):
    """checkpoint_cases.py as 2 workers, then its one-worker restore of their checkpoint."""
    out = tmp_path_factory.mktemp(f"cases_{request.param}")
    proc = _launch(request.param, "checkpoint_cases.py", str(out), cwd=out)
    assert_ok(proc)
    assert_ok(_run([sys.executable, str(WORKERS / "checkpoint_cases.py"), str(out),
                    "one_worker"], out))
    results = [json.loads((out / f"result_rank{r}.json").read_text()) for r in (0, 1)]
    return out, results, proc


def test_only_rank_0_writes_and_every_rank_gets_its_checkpoint_path(cases):
    out, results, _ = cases
    assert results[0]["saved_path"] == results[1]["saved_path"] == \
        str(out / "shared" / "ckpt-000002")
    assert not (out / "rank1_save_dir").exists()
    assert sorted(os.listdir(out / "shared")) == ["ckpt-000001", "ckpt-000002"]


def test_a_deferred_model_restores_on_every_rank_when_only_rank_0_sees_the_files(cases):
    out, results, _ = cases
    for rank in (0, 1):
        assert results[rank]["rank0_only"] == {
            "epoch": 1, "step": 0, "extra": {"note": "second"}, "num_workers": 2}
        # the loaded values, not an initializer's, reached both ranks at the first forward
        _same(_npz(out / f"rank0_only_restored_rank{rank}.npz"), _npz(out / "saved.npz"))
        # and the optimizer states too: the next step is the one the saved run took
        _same(_npz(out / f"rank0_only_continued_rank{rank}.npz"),
              _npz(out / "continued.npz"), tol=1e-6)


def test_restore_overwrites_initialised_parameters_on_every_rank(cases):
    out, results, _ = cases
    for rank in (0, 1):
        assert results[rank]["initialised"]["extra"] == {"note": "second"}
        _same(_npz(out / f"initialised_restored_rank{rank}.npz"), _npz(out / "saved.npz"))


def test_a_corrupt_newest_checkpoint_falls_back_to_the_previous_on_every_rank(cases):
    _, results, _ = cases
    for rank in (0, 1):
        assert results[rank]["fallback"] == {
            "epoch": 0, "step": 3, "extra": {"note": "first"}, "num_workers": 2}
    # rank 0 read the files, so rank 0 warns, naming the damaged file
    [warning] = results[0]["fallback_warnings"]
    assert "damaged/ckpt-000002/params.npz is corrupt" in warning
    assert results[1]["fallback_warnings"] == []


def test_an_explicitly_requested_corrupt_checkpoint_raises_on_every_rank(cases):
    _, results, _ = cases
    for rank in (0, 1):
        assert "damaged/ckpt-000002/params.npz is corrupt" in results[rank]["explicit_error"]


def test_a_model_that_does_not_match_the_checkpoint_raises_on_every_rank(cases):
    _, results, _ = cases
    for rank in (0, 1):
        assert "parameter #0: the model has" in results[rank]["mismatch_error"]
        assert "the checkpoint has 'dense0_weight' shape (8, 5)" in \
            results[rank]["mismatch_error"]


def test_a_save_that_fails_on_rank_0_raises_on_every_rank(cases):
    out, results, _ = cases
    for rank in (0, 1):
        assert "rank 0 could not save a checkpoint" in results[rank]["save_error"]
        assert "not initialised yet" in results[rank]["save_error"]
    assert sorted(os.listdir(out / "shared")) == ["ckpt-000001", "ckpt-000002"]


def test_a_two_worker_checkpoint_restores_and_continues_on_one_worker(cases):
    out, _, _ = cases
    result = json.loads((out / "result_one_worker.json").read_text())
    assert result["restored"] == {
        "epoch": 1, "step": 0, "extra": {"note": "second"}, "num_workers": 2}
    _same(_npz(out / "one_worker_restored.npz"), _npz(out / "saved.npz"))
    # one worker on the whole global batch takes the step two workers took on halves
    _same(_npz(out / "one_worker_continued.npz"), _npz(out / "continued.npz"), tol=1e-5)


@pytest.mark.parametrize("backend", RESTART_BACKENDS)
@pytest.mark.spawns
def test_resume_after_a_sigkilled_worker_matches_an_uninterrupted_run(tmp_path, backend):
    plain, killed = tmp_path / "uninterrupted", tmp_path / "killed"
    plain.mkdir()
    killed.mkdir()
    assert_ok(_launch(backend, "checkpoint_train.py", str(plain), str(plain / "ckpt"),
                      cwd=plain))

    # rank 1 kills itself after batch 3 of epoch 1 (of 5); the last checkpoint is at
    # batch 2 of epoch 1, so the restarted job resumes in the middle of the epoch
    proc = _launch(backend, "checkpoint_train.py", str(killed), str(killed / "ckpt"),
                   "--kill-rank", "1", "--kill-at", "1:3", cwd=killed,
                   launcher_args=("--max-restarts", "1"))
    assert_ok(proc)
    assert f"rank 1 ({socket.gethostname()}) was killed by SIGKILL" in proc.stderr
    assert "restarting the job on every node (1 of 1)" in proc.stderr
    assert worker_lines(proc.stdout, 0)[:2] == ["starting at epoch 0 step 0 (run 0)",
                                                "starting at epoch 1 step 2 (run 1)"]
    expected = _npz(plain / "final_rank0.npz")
    for rank in (0, 1):
        _same(_npz(killed / f"final_rank{rank}.npz"), expected, tol=1e-6)
    assert sorted(os.listdir(killed / "ckpt")) == ["ckpt-000008", "ckpt-000009"]  # keep=2
