"""No host round trip in a steady training step: on horovod, dist_sync and dist_async
(P3 runs dist_sync's code: conftest.TRAINING_BACKENDS), the steps of plain training,
uneven batches, row_sparse gradients, SyncBatchNorm, the Module API (with and without
loss scaling) and an elastic job's stop_requested() copy no array of more than 64
elements between MXNet and NumPy (on a GPU, each such copy drains the device). One
launched job per backend runs every case (tests/workers/host_copy_cases.py)."""
from __future__ import annotations

import json

import pytest

from conftest import REPO, TRAINING_BACKENDS, assert_ok, launcher, run

CASES = REPO / "tests" / "workers" / "host_copy_cases.py"
SYNCHRONOUS = ["plain", "uneven", "elastic", "sparse", "syncbn", "module", "loss_scale"]
# dist_async: the servers run one optimizer, so a job has one trainer (plain training);
# SyncBatchNorm and the sums of the other cases need synchronous workers
ASYNCHRONOUS = ["plain"]


@pytest.fixture(scope="module", params=[*TRAINING_BACKENDS, "dist_async"])
def copies(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(request.param)
    argv = launcher(request.param, CASES, out)
    # horovod's cycle-time tuning (dist_gluon/backends/horovod_tuning.py) waits for the
    # engine and broadcasts its plan and times in the job's first steps, once, by design;
    # those steps are not steady ones, and this job's cases are a few steps each
    argv.insert(argv.index("--"), "--no-tune")
    proc = run(argv, out, timeout=300)
    assert_ok(proc)
    found = [json.loads((out / f"copies_rank{r}.json").read_text()) for r in (0, 1)]
    return request.param, found


@pytest.mark.parametrize("case", SYNCHRONOUS)
def test_a_steady_step_copies_nothing_between_mxnet_and_numpy(copies, case):
    backend, ranks = copies
    if backend == "dist_async" and case not in ASYNCHRONOUS:
        pytest.skip(f"{case}: one trainer per dist_async job (plain training)")
    for rank, found in enumerate(ranks):
        assert found[case]["count"] == 0, (backend, case, rank, found[case]["summary"])
