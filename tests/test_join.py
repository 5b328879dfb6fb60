"""dg.Join: ranks with different numbers of batches train to the end, exactly as one
process on the concatenation of the batches present at each step."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from conftest import REPO, assert_ok, launch, process_env

WORKERS = REPO / "tests" / "workers"
SCRIPT = WORKERS / "join_cases.py"
TOLERANCE = 1e-5


def _reference(tmp_path, world: int) -> dict:
    out = tmp_path / "reference"
    subprocess.run([sys.executable, str(SCRIPT), str(out), str(world)], check=True,
                   env=process_env(), cwd=tmp_path, timeout=120)
    return {case: dict(np.load(out / f"{case}-reference.npz"))
            for case in ("plain", "syncbn")}


@pytest.mark.parametrize("backend, world", [("horovod", 2), ("horovod", 3),
                                            ("dist_sync", 2), ("p3", 3)])
def test_ranks_with_fewer_batches_shadow_the_others_steps(tmp_path, backend, world):
    """Ranks with 10, 7 (and 4) batches in two epochs (trainer.step, then
    allreduce_grads + update, the block entered again), a plain network and one with
    SyncBatchNorm, DG_CHECK_SYNC=1: every rank ends with the weights and running
    statistics of one process trained on the batches present at each step."""
    out = tmp_path / "out"
    result = launch(SCRIPT.read_text(), tmp_path, backend=backend, n=world,
                    args=[str(out), str(world)], env={"DG_CHECK_SYNC": "1"}, timeout=240)
    assert_ok(result)
    reference = _reference(tmp_path, world)
    for case, expected in reference.items():
        for rank in range(world):
            got = dict(np.load(out / f"{case}-{rank}.npz"))
            assert got.keys() == expected.keys()
            for name in expected:
                np.testing.assert_allclose(got[name], expected[name], rtol=TOLERANCE,
                                           atol=TOLERANCE,
                                           err_msg=f"{case}, rank {rank}, parameter {name}")
