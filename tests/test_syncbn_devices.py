"""SyncBatchNorm with several devices per worker (issue 29): the statistics cover every
device of every worker, so N workers x D devices train like one process with
nn.BatchNorm on the whole batch. CPU contexts stand in for GPUs (MXNET_CPU_TEMP_COPY
set as dist_gluon.syncbn asks)."""
from __future__ import annotations

import subprocess
import sys

import mxnet as mx
import numpy as np
import pytest

import dist_gluon as dg
from conftest import REPO, assert_ok, launcher, process_env

WORKER = REPO / "tests" / "workers" / "syncbn_devices.py"


def _run(argv, cwd, timeout=240, gluoncv=False):
    """``gluoncv``: the script runs gluoncv, which needs SciPy and OpenCV (conftest.py)."""
    env = process_env(gluoncv, MXNET_CPU_TEMP_COPY="1024")
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)


def _load(directory, name):
    with np.load(directory / f"{name}.npz") as f:
        return dict(f)


def _error(a, b):
    return max(float(np.abs(a[k] - b[k]).max()) for k in a)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One process, one device, nn.BatchNorm on all 8 samples; and SyncBatchNorm and
    nn.BatchNorm on two devices of one process."""
    out = tmp_path_factory.mktemp("syncbn_devices")
    for devices, norm in ((1, "plain"), (2, "sync"), (2, "plain")):
        assert_ok(_run([sys.executable, str(WORKER), str(out), str(devices), norm], out))
    return out


@pytest.mark.spawns
def test_one_process_on_two_devices_normalises_with_both_devices_statistics(reference):
    whole = _load(reference, "plain_d1_rank0")
    assert _error(_load(reference, "sync_d2_rank0"), whole) < 1e-5
    # nn.BatchNorm on two devices normalises each with its own half: the check can fail
    assert _error(_load(reference, "plain_d2_rank0"), whole) > 1e-3


@pytest.mark.spawns
@pytest.mark.parametrize("backend", ["horovod", "dist_sync", "p3"])
def test_two_workers_of_two_devices_train_like_one_process_on_the_whole_batch(
        reference, backend, tmp_path):
    assert_ok(_run(launcher(backend, WORKER, tmp_path, 2, "sync"), tmp_path))
    whole = _load(reference, "plain_d1_rank0")
    for rank in range(2):
        assert _error(_load(tmp_path, f"sync_d2_rank{rank}"), whole) < 1e-5


@pytest.mark.spawns
def test_a_device_running_ahead_of_the_others_is_refused_with_what_to_do(tmp_path):
    proc = _run([sys.executable, str(WORKER), str(tmp_path), "2", "misuse"], tmp_path)
    assert_ok(proc)
    assert "refused: SyncBatchNorm" in proc.stdout and "ran 2 training forwards while " \
        "cpu(1) ran 0" in proc.stdout and "split_and_load" in proc.stdout
    assert "finished" in proc.stdout


def test_several_cpu_contexts_without_enough_temp_space_say_what_to_set(monkeypatch):
    monkeypatch.setenv("MXNET_CPU_TEMP_COPY", "4")
    bn = dg.SyncBatchNorm(in_channels=2, kv="local")
    bn.initialize(ctx=[mx.cpu(0), mx.cpu(1)])
    with pytest.raises(RuntimeError, match="MXNET_CPU_TEMP_COPY=1024 or more"):
        with mx.autograd.record():
            bn(mx.nd.ones((2, 2, 3, 3)))


def test_a_syncbn_layer_on_several_devices_cannot_be_hybridized():
    bn = dg.SyncBatchNorm(in_channels=2, kv="local")
    bn.initialize(ctx=[mx.cpu(0), mx.cpu(1)])
    with pytest.raises(RuntimeError, match="cannot run in a hybridized graph on 2 devices"):
        bn.hybridize()


@pytest.mark.spawns
def test_the_imagenet_example_trains_with_syncbn_on_two_workers_of_two_devices(tmp_path):
    proc = _run(launcher("horovod", REPO / "examples" / "imagenet" / "train_imagenet.py",
                         "--synthetic", "--syncbn", "--devices", "cpu:0,1", "--model",
                         "resnet18_v1b", "--input-size", "32", "--num-classes", "10",
                         "--batch-size", "4", "--epochs", "1", "--steps-per-epoch", "3",
                         "--log-interval", "1"), tmp_path, gluoncv=True)
    assert_ok(proc)
    lines = [line[4:] for line in proc.stdout.splitlines() if line.startswith("[0] ")]
    assert any("SyncBatchNorm: statistics over the samples of all 2 worker(s) x 2 device(s)"
               in line for line in lines), lines
    assert lines[-1].startswith("summary:") and "workers=2" in lines[-1]
