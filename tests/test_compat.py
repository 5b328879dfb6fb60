"""The peers' MXNet APIs on dist_gluon's backends (dist_gluon.compat, MXNet RFC #16795).

Their semantics are checked against NumPy by tests/workers/compat_cases.py, on one
process and on 2 workers of every backend. Two training scripts of our own, written in
the style of the peers' MNIST examples (CI also runs the peers' real scripts), train
through the real launcher on horovod and dist_sync (conftest.TRAINING_BACKENDS) to
their own accuracy checks, and every rank ends with rank
0's weights, although each rank starts from weights of its own
(tests/workers/record_weights.py seeds each rank differently):
tests/workers/byteps_style_mnist.py, Gluon with ``import byteps.mxnet as bps`` as a
BytePS user writes it (the launcher's --compat byteps resolves it), and
tests/workers/hvd_style_mnist.py, the Module API with Horovod's DistributedOptimizer
and broadcast_parameters of arg_params and aux_params.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

from conftest import (
    REPO,
    TRAINING_BACKENDS,
    assert_ok,
    launcher,
    process_env,
    run,
    worker_lines,
)

WORKERS = REPO / "tests" / "workers"
RECORD = WORKERS / "record_weights.py"
BYTEPS_SCRIPT = WORKERS / "byteps_style_mnist.py"
BYTEPS_GC_SCRIPT = WORKERS / "byteps_gc_mnist.py"
HOROVOD_SCRIPT = WORKERS / "hvd_style_mnist.py"
# what --compat byteps puts first on the workers' PYTHONPATH
BYTEPS_SHIM = REPO / "dist_gluon" / "compat" / "_shims"
ACCURACY = re.compile(r"^final validation accuracy ([0-9.]+)$")
# the scripts' own check (--min-accuracy, default 0.96), read again from rank 0's output
REQUIRED_ACCURACY = 0.96
# the scripts' 4 layers, weight and bias: 2 convolutions and 2 dense layers (BytePS
# style), 4 fully connected layers (horovod style)
RECORDED_ARRAYS = 8


def _launch(backend: str, tmp_path, script, *args, compat: str | None = None):
    argv = [sys.executable, "-m", "dist_gluon.launch", "-n", "2", "--backend", backend]
    if compat:
        argv += ["--compat", compat]
    argv += ["--", sys.executable, str(RECORD), str(tmp_path), str(script), *args]
    return run(argv, tmp_path, timeout=600)


def _final_accuracy(lines: list[str]) -> float:
    found = [float(m.group(1)) for line in lines for m in [ACCURACY.search(line)] if m]
    assert found, "no 'final validation accuracy' line:\n" + "\n".join(lines[-20:])
    return found[-1]


def _assert_rank0_weights_everywhere(tmp_path, n: int = 2) -> None:
    reference = np.load(tmp_path / "rank0.npz")
    assert len(reference.files) == RECORDED_ARRAYS
    for rank in range(1, n):
        theirs = np.load(tmp_path / f"rank{rank}.npz")
        assert theirs.files == reference.files
        for name in reference.files:
            assert np.array_equal(theirs[name], reference[name]), \
                f"rank {rank}'s parameter {name} differs from rank 0's"


@pytest.mark.spawns
def test_peer_semantics_on_one_process(tmp_path):
    proc = run([sys.executable, str(WORKERS / "compat_cases.py")], tmp_path)
    assert_ok(proc)
    assert "identity: rank 0 of 1" in proc.stdout
    assert proc.stdout.rstrip().endswith("compat cases passed")


@pytest.mark.spawns
def test_the_peers_module_optimizer_refuses_several_devices_when_installed(tmp_path):
    script = tmp_path / "devices.py"
    script.write_text(
        "import mxnet as mx\nimport dist_gluon.compat.horovod as hvd\nhvd.init()\n"
        "net = mx.sym.FullyConnected(mx.sym.Variable('data'), num_hidden=2, name='fc')\n"
        "net = mx.sym.SoftmaxOutput(net, name='softmax')\n"
        "mod = mx.mod.Module(net, context=[mx.cpu(0), mx.cpu(1)])\n"
        "mod.bind(data_shapes=[('data', (4, 3))], label_shapes=[('softmax_label', (4,))])\n"
        "mod.init_params()\n"
        "opt = hvd.DistributedOptimizer(mx.optimizer.SGD(learning_rate=0.1))\n"
        "try:\n    mod.init_optimizer(kvstore=None, optimizer=opt)\n"
        "except ValueError as err:\n    print('refused:', err)\n")
    proc = run([sys.executable, str(script)], tmp_path)
    assert_ok(proc)
    assert ("refused: the peers' DistributedOptimizer runs one device per worker, as "
            "horovod's and BytePS's do, but the Module has 2 contexts") in proc.stdout


def test_peer_semantics_on_two_workers(backend, tmp_path):
    proc = run([sys.executable, "-m", "dist_gluon.launch", "-n", "2", "--backend", backend,
                "--", sys.executable, str(WORKERS / "compat_cases.py")], tmp_path)
    assert_ok(proc)
    for rank in range(2):
        lines = worker_lines(proc.stdout, rank)
        assert f"identity: rank {rank} of 2" in lines
        assert lines[-1] == "compat cases passed"


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("mpirun") is None, reason="mpirun not found: install "
                    "OpenMPI (make setup does it as root)")
def test_peer_semantics_over_mpi(tmp_path):
    """horovod's MPI-only calls (mpi_threads_supported) when the ranks run under mpirun."""
    proc = run([sys.executable, "-m", "dist_gluon.launch", "-n", "2", "--backend", "horovod",
                "--transport", "mpi", "--", sys.executable, str(WORKERS / "compat_cases.py")],
               tmp_path)
    assert_ok(proc)
    for rank in range(2):
        lines = worker_lines(proc.stdout, rank)
        assert "mpi_enabled: True" in lines and lines[-1] == "compat cases passed"


@pytest.mark.slow
@pytest.mark.parametrize("backend", TRAINING_BACKENDS)
def test_byteps_style_script_trains_with_launcher_compat_byteps(backend, tmp_path):
    """`import byteps.mxnet as bps` as a BytePS user writes it; --compat byteps makes it
    dist_gluon's. Gluon, DistributedTrainer, broadcast_parameters of a dict, push_pull."""
    assert "import byteps.mxnet as bps" in BYTEPS_SCRIPT.read_text()
    proc = _launch(backend, tmp_path, BYTEPS_SCRIPT, compat="byteps")
    assert_ok(proc)
    assert _final_accuracy(worker_lines(proc.stdout, 0)) > REQUIRED_ACCURACY
    _assert_rank0_weights_everywhere(tmp_path)


def test_byteps_compressors_equal_a_numpy_transcription_of_byteps(backend, tmp_path):
    """onebit, topk, randomk and dithering with error feedback and Nesterov momentum, a
    few steps on 2 workers, against BytePS's algorithm written out in NumPy (workers and
    server); no copy to the host from the third step on; the state restores."""
    proc = run(launcher(backend, WORKERS / "byteps_compressor_cases.py"), tmp_path)
    assert_ok(proc)
    for rank in range(2):
        lines = worker_lines(proc.stdout, rank)
        assert sum("steps equal BytePS's algorithm" in line for line in lines) == 8
        assert lines[-1] == "byteps compressor cases passed"


ONEBIT = ("--compressor", "onebit", "--ef", "vanilla", "--compress-momentum", "nesterov",
          "--scaling")


# 25-60 s per run, so each run goes where it can differ: the compressed run on horovod
# (the example's accuracy with its flags), the uncompressed defaults once (its
# compression_params of empty settings; a plain DistributedTrainer, which the BytePS-style
# script above trains on horovod and dist_sync). What the backends could change, the
# compressed messages over each backend's collectives (P3's sliced and reordered
# included), the transcription test above checks step by step on every backend: each
# codec, error feedback, Nesterov momentum and onebit's scaling, equal to BytePS's
# algorithm.
@pytest.mark.slow
@pytest.mark.parametrize("backend, flags", [("horovod", ONEBIT), ("dist_sync", ())],
                         ids=["horovod-onebit-ef-nesterov-scaling", "dist_sync-defaults"])
def test_byteps_gc_example_reaches_its_accuracy_check(backend, flags, tmp_path):
    """BytePS's train_gluon_mnist_byteps_gc.py (embedded digits, CPU), unchanged
    otherwise: its defaults (compression_params of empty settings: no compression) and
    its onebit flags train to its own check (validation accuracy above 0.96 on rank 0)
    in 3 epochs."""
    # 3 of its 5 epochs: 12 s each here, and onebit's validation accuracy was 0.978
    # after the third (0.967 after the second, 0.972 after the fifth)
    argv = [sys.executable, "-m", "dist_gluon.launch", "-n", "2", "--backend", backend,
            "--compat", "byteps", "--", sys.executable, str(BYTEPS_GC_SCRIPT), *flags,
            "--epochs", "3"]
    proc = run(argv, tmp_path, timeout=600)
    assert_ok(proc)
    assert _final_accuracy(worker_lines(proc.stdout, 0)) > REQUIRED_ACCURACY


@pytest.mark.slow
@pytest.mark.parametrize("backend", TRAINING_BACKENDS)
def test_horovod_style_module_script_trains(backend, tmp_path):
    """Module.fit(kvstore=None) with hvd.DistributedOptimizer, after broadcast_parameters
    of arg_params and aux_params; metrics summed with hvd.allreduce."""
    proc = _launch(backend, tmp_path, HOROVOD_SCRIPT)
    assert_ok(proc)
    assert _final_accuracy(worker_lines(proc.stdout, 0)) > REQUIRED_ACCURACY
    _assert_rank0_weights_everywhere(tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("script", [BYTEPS_SCRIPT, HOROVOD_SCRIPT], ids=["byteps", "horovod"])
def test_style_scripts_train_as_one_process(script, tmp_path):
    # the byteps shim on the path, as --compat byteps does for the workers
    env = process_env()
    env["PYTHONPATH"] = os.pathsep.join([str(BYTEPS_SHIM), env["PYTHONPATH"]])
    proc = subprocess.run([sys.executable, str(RECORD), str(tmp_path), str(script)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert_ok(proc)
    assert "1 workers" in proc.stdout
    assert _final_accuracy(proc.stdout.splitlines()) > REQUIRED_ACCURACY
    assert len(np.load(tmp_path / "rank0.npz").files) == RECORDED_ARRAYS


def test_launcher_compat_option_names_the_choices():
    proc = subprocess.run([sys.executable, "-m", "dist_gluon.launch", "-n", "2", "--compat",
                           "tensorflow", "--", "true"], capture_output=True, text=True,
                          cwd=REPO, timeout=60)
    assert proc.returncode == 2
    assert "--compat" in proc.stderr and "'byteps'" in proc.stderr


def test_the_build_queries_answer_as_the_installed_horovod_does():
    import horovod.mxnet as real

    from dist_gluon.compat import horovod as hvd
    for flag in ("mpi_built", "gloo_built", "ddl_built", "ccl_built", "cuda_built",
                 "rocm_built"):
        answer = getattr(hvd, flag)()
        assert answer is bool(getattr(real, flag)()), flag
    assert hvd.gloo_built() is True     # make setup builds horovod with Gloo always


def test_nccl_built_answers_for_the_average_in_rescale_grad():
    """horovod.mxnet's DistributedTrainer averages in the allreduce when nccl_built() >=
    21000 and in rescale_grad otherwise; ours always does the latter (checked on every
    backend by compat_cases.py: the gradient after allreduce_grads() is the sum), so
    nccl_built() says 0, whatever the installed horovod was built with."""
    from dist_gluon.compat import horovod as hvd
    assert hvd.nccl_built() == 0 and type(hvd.nccl_built()) is int
