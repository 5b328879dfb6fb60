"""The peers' MXNet APIs on dist_gluon's backends (dist_gluon.compat, MXNet RFC #16795).

Their semantics are checked against NumPy by tests/workers/compat_cases.py, on one
process and on 2 workers of every backend. The peers' own MNIST examples
(tests/workers/byteps_mnist.py, horovod_mnist.py: only the dataset and the GPU context
changed, and horovod's import line) train through the real launcher to their own
accuracy checks, and every rank ends with rank 0's weights, although each rank starts
from weights of its own (tests/workers/record_weights.py seeds each rank differently).
"""
from __future__ import annotations

import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

from conftest import REPO, assert_ok, run, worker_lines

WORKERS = REPO / "tests" / "workers"
RECORD = WORKERS / "record_weights.py"
ACCURACY = re.compile(r"Validation: accuracy=([0-9.]+)")
# the examples' own check (their final `assert val_acc > 0.96`), read from rank 0's log
REQUIRED_ACCURACY = 0.96
# horovod's example shards the samples over the workers (BytePS's does not): a few more
# epochs on the small embedded set keep its accuracy clear of 0.96
HOROVOD_ARGS = ("--epochs", "8")
BYTEPS_ARGS = ("--j", "0")       # no data-loading processes beside the workers


def _launch(backend: str, tmp_path, script, *args, compat: str | None = None):
    argv = [sys.executable, "-m", "dist_gluon.launch", "-n", "2", "--backend", backend]
    if compat:
        argv += ["--compat", compat]
    argv += ["--", sys.executable, str(RECORD), str(tmp_path), str(script), *args]
    return run(argv, tmp_path, timeout=600)


def _final_accuracy(lines: list[str]) -> float:
    found = [float(m.group(1)) for line in lines for m in [ACCURACY.search(line)] if m]
    assert found, "no 'Validation: accuracy=' line:\n" + "\n".join(lines[-20:])
    return found[-1]


def _assert_rank0_weights_everywhere(tmp_path, n: int = 2) -> None:
    reference = np.load(tmp_path / "rank0.npz")
    assert len(reference.files) == 8          # the examples' 4 layers, weight and bias
    for rank in range(1, n):
        theirs = np.load(tmp_path / f"rank{rank}.npz")
        assert theirs.files == reference.files
        for name in reference.files:
            assert np.array_equal(theirs[name], reference[name]), \
                f"rank {rank}'s parameter {name} differs from rank 0's"


def test_peer_semantics_on_one_process(tmp_path):
    proc = run([sys.executable, str(WORKERS / "compat_cases.py")], tmp_path)
    assert_ok(proc)
    assert "identity: rank 0 of 1" in proc.stdout
    assert proc.stdout.rstrip().endswith("compat cases passed")


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
def test_unchanged_byteps_example_trains_with_launcher_compat_byteps(backend, tmp_path):
    """`import byteps.mxnet as bps` as written; --compat byteps makes it dist_gluon's."""
    assert "import byteps.mxnet as bps" in (WORKERS / "byteps_mnist.py").read_text()
    proc = _launch(backend, tmp_path, WORKERS / "byteps_mnist.py", *BYTEPS_ARGS,
                   compat="byteps")
    assert_ok(proc)
    assert _final_accuracy(worker_lines(proc.stderr, 0)) > REQUIRED_ACCURACY
    _assert_rank0_weights_everywhere(tmp_path)


@pytest.mark.slow
def test_horovod_example_with_compat_import_trains(backend, tmp_path):
    proc = _launch(backend, tmp_path, WORKERS / "horovod_mnist.py", *HOROVOD_ARGS)
    assert_ok(proc)
    assert _final_accuracy(worker_lines(proc.stderr, 0)) > REQUIRED_ACCURACY
    _assert_rank0_weights_everywhere(tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("example", ["byteps", "horovod"])
def test_examples_with_compat_import_train_as_one_process(example, tmp_path):
    if example == "byteps":
        source = (WORKERS / "byteps_mnist.py").read_text()
        script = tmp_path / "byteps_mnist.py"
        script.write_text(source.replace("import byteps.mxnet as bps",
                                         "import dist_gluon.compat.byteps as bps"))
        args = BYTEPS_ARGS
    else:
        script, args = WORKERS / "horovod_mnist.py", HOROVOD_ARGS
    proc = run([sys.executable, str(RECORD), str(tmp_path), str(script), *args], tmp_path,
               timeout=600)
    assert_ok(proc)
    assert _final_accuracy(proc.stderr.splitlines()) > REQUIRED_ACCURACY


def test_launcher_compat_option_names_the_choices():
    proc = subprocess.run([sys.executable, "-m", "dist_gluon.launch", "-n", "2", "--compat",
                           "tensorflow", "--", "true"], capture_output=True, text=True,
                          cwd=REPO, timeout=60)
    assert proc.returncode == 2
    assert "--compat" in proc.stderr and "'byteps'" in proc.stderr
