"""DistributedTrainer(..., shard_optimizer_states=True): each worker keeps the optimizer
state of its part of every tensor, and the workers still train like one process on the
concatenated batches; the state files are gluon.Trainer's, whole."""
import sys

import pytest

from conftest import REPO, assert_ok, launcher, run, worker_lines

WORKERS = REPO / "tests" / "workers"
# tests/workers/sharding_cases.py prints "ok <case>" for each of these on every rank
CASES = ["sgd", "momentum", "nag", "adam", "rmsprop", "adam_schedule", "lamb", "clip_global_norm",
         "multi_precision", "save_states_whole", "load_states_into_gluon",
         "load_states_sharded", "gluon_states_into_sharded", "checkpoint_restore_weights",
         "checkpoint_restore_continues", "compression_2bit", "compression_fp16",
         "stale_gradients", "hybridized_conv_after_inference", "deferred_init", "two_devices",
         "refuses_elastic_state",
         "refuses_local_sgd", "backend_reducescatter_allgather", "refuses_lars",
         "refuses_lbsgd", "amp"]


def _passed(output: str, rank: int) -> list[str]:
    return [line.split()[1] for line in worker_lines(output, rank) if line.startswith("ok ")]


def test_one_process_runs_every_case_unsharded(tmp_path):
    proc = run([sys.executable, str(WORKERS / "sharding_cases.py"), str(tmp_path)], tmp_path)
    assert_ok(proc)
    assert [line.split()[1] for line in proc.stdout.splitlines()
            if line.startswith("ok ")] == [c for c in CASES]


@pytest.mark.parametrize("backend,n", [("horovod", 2), ("horovod", 3), ("dist_sync", 2),
                                       ("p3", 3)])
def test_sharded_workers_train_like_one_process_and_save_whole_states(tmp_path, backend, n):
    proc = run(launcher(backend, WORKERS / "sharding_cases.py", tmp_path, n=n), tmp_path)
    assert_ok(proc)
    for rank in range(n):
        passed = _passed(proc.stdout, rank)
        assert [c for c in passed if c != "adam_states_part"] == CASES, passed
    # each rank held the Adam states of its part only (about 1/n of the elements)
    assert "adam_states_part" in _passed(proc.stdout, 0)
