"""Every feature composes: the combination matrix of tests/matrix_plan.py.

Each row of the covering array (every pair of axis values in at least one row; every
triple with DG_MATRIX_STRENGTH=3, ``make test-matrix``) trains 2 workers through the
real launcher (tests/workers/matrix_cases.py) and is compared with a one-process replay
of the same batches: to float tolerance where the math is exact, within the codec's
bound where the codec drops information, and the ranks (and a worker's devices) with
each other exactly. A row with fault=restart also resumes its mid-run checkpoint on one
process, which must end where the replay ends.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import matrix_plan
import numpy as np
import pytest

from conftest import REPO, process_env

STRENGTH = int(os.environ.get("DG_MATRIX_STRENGTH", "2"))
JOBS = matrix_plan.jobs(STRENGTH)
CASES = {name: (key, row) for key, rows in JOBS.items() for name, row in rows}
WORKER = REPO / "tests" / "workers" / "matrix_cases.py"
LAUNCH = {"gloo": ("--backend", "horovod"),
          "mpi": ("--backend", "horovod", "--transport", "mpi"),
          "dist_sync": ("--backend", "dist_sync"),
          "p3": ("--backend", "p3")}
# How far a lossy codec may leave the weights from the replay's, as a fraction of how
# far the replay moved them (Euclidean norms over all weights): fp16 rounds each
# gradient to 11 bits (measured here: under 1e-4); 2-bit (threshold 0.5), PowerSGD
# (rank 1) and top-k (half the elements) send an approximation and keep the rest in an
# error-feedback residual, sent later: each ends at least a quarter of the way nearer to
# one process than the start (measured on this model's 4 steps, every triple: 2-bit
# 0.18-0.67, PowerSGD 0.11-0.26, top-k 0.06-0.39). A tight bound would need a replay of
# each codec's own arithmetic.
CODEC_BOUND = {"fp16": 1e-2, "2bit": 0.75, "powersgd": 0.75, "topk": 0.75}
EXACT = {"rtol": 1e-5, "atol": 1e-6}      # float32 sums in another order


def _group_name(key) -> str:
    return "-".join(map(str, key))


@pytest.fixture(scope="module")
def matrix(tmp_path_factory):
    """Run every launched job, then the one-process replay of every row. Returns (out
    directory, {group key: finished launcher process})."""
    out = tmp_path_factory.mktemp("matrix")
    procs = {}
    for key, rows in JOBS.items():
        backend, observe, _ = key
        plan = out / f"plan_{_group_name(key)}.json"
        plan.write_text(json.dumps(rows))
        # a combination that hangs fails in seconds, with the lagging ranks' stacks
        launcher_args = [*LAUNCH[backend], "--stall-timeout", "60"]
        # SyncBatchNorm on two CPU contexts of one process needs it (dist_gluon/syncbn.py)
        env = {"MXNET_CPU_TEMP_COPY": "1024"}
        if observe != "off":
            launcher_args += ["--timeline", str(out / f"timeline_{_group_name(key)}.json")]
            env["DG_CHECK_SYNC"] = "1"
        argv = [sys.executable, "-m", "dist_gluon.launch", "-n", "2", *launcher_args, "--",
                sys.executable, str(WORKER), str(out), str(plan), "train"]
        try:
            procs[key] = subprocess.run(argv, cwd=out, env=process_env(**env),
                                        capture_output=True, text=True, timeout=240)
        except subprocess.TimeoutExpired as hung:
            procs[key] = subprocess.CompletedProcess(
                argv, "timeout", _text(hung.stdout), _text(hung.stderr))
    replayed = [[name, row] for name, (key, row) in CASES.items()
                if procs[key].returncode == 0 or row["fault"] == "none"]
    # (the replay of a failed job's restart row has no checkpoint to restore: left out)
    plan = out / "plan_replay.json"
    plan.write_text(json.dumps(replayed))
    replay = subprocess.run([sys.executable, str(WORKER), str(out), str(plan), "replay"],
                            cwd=out, env=process_env(MXNET_CPU_TEMP_COPY="1024"),
                            capture_output=True, text=True, timeout=300)
    assert replay.returncode == 0, replay.stdout[-3000:] + replay.stderr[-3000:]
    return out, procs


def _text(output) -> str:
    return output.decode(errors="replace") if isinstance(output, bytes) else output or ""


def _job_ok(proc, name):
    if proc.returncode != 0:
        started = [line for line in proc.stdout.splitlines() if "case " in line]
        pytest.fail(f"the job of {name} failed ({proc.returncode}); cases started: "
                    f"{started[-4:]}\n--- stderr\n{proc.stderr[-3000:]}")


def _load(path: Path) -> dict:
    with np.load(path) as f:
        return dict(f)


def _close(got: dict, want: dict, codec: str, start: dict | None, what: str):
    """``got`` within float tolerance (or the codec's bound) of ``want``, key by key."""
    keys = [k for k in want if "@" not in k and not k.startswith("scale")]
    assert keys and all(k in got for k in keys), (what, sorted(got), sorted(want))
    if codec in CODEC_BOUND:
        off = np.sqrt(sum(float(((got[k] - want[k]) ** 2).sum()) for k in keys))
        travel = np.sqrt(sum(float(((start[k] - want[k]) ** 2).sum()) for k in keys))
        assert off <= CODEC_BOUND[codec] * travel + 1e-5, (
            f"{what}: {off:.3g} from the replay, which moved {travel:.3g} from the start "
            f"(bound for {codec}: {CODEC_BOUND[codec]} of it)")
    else:
        for k in keys:
            np.testing.assert_allclose(got[k], want[k], err_msg=f"{what}: parameter {k}",
                                       **EXACT)


@pytest.mark.spawns
@pytest.mark.parametrize("name", list(CASES))
def test_combination_trains_like_one_process(matrix, name):
    out, procs = matrix
    key, row = CASES[name]
    _job_ok(procs[key], name)
    ranks = [_load(out / f"{name}_rank{r}.npz") for r in range(2)]
    replay = _load(out / f"{name}_replay.npz")
    # every rank, and every device of a rank, holds exactly the same weights
    for k, value in ((k, v) for k, v in ranks[0].items() if k != "scale"):
        np.testing.assert_array_equal(ranks[1][k], value, err_msg=f"rank 1 vs 0, {k}")
        base = k.split("@")[0]
        np.testing.assert_array_equal(value, ranks[0][base], err_msg=f"device copy {k}")
    # the loss scale halved at the same step as one process's (once: one overflow); a
    # Local SGD worker steps (and scales its loss) alone: only rank 1 overflowed
    if row["amp"] != "off" and row["local_sgd"] == "off":
        assert float(ranks[0]["scale"]) == float(ranks[1]["scale"]) == 2.0 ** 15
        assert float(replay["scale"]) == 2.0 ** 15
    elif row["amp"] != "off":
        assert [float(ranks[r]["scale"]) for r in range(2)] == \
            [float(replay[f"scale{r}"]) for r in range(2)] == [2.0 ** 16, 2.0 ** 15]
    start = _load(out / f"{name}_start.npz")
    _close(ranks[0], replay, row["codec"], start, f"{name} rank 0")
    if row["fault"] == "restart":
        restored = _load(out / f"{name}_restored.npz")
        _close(restored, replay, row["codec"], start, f"{name} restored onto one process")


@pytest.mark.spawns
@pytest.mark.parametrize("key", [k for k in JOBS if k[1] != "off"],
                         ids=_group_name)
def test_the_checked_jobs_write_a_timeline(matrix, key):
    out, procs = matrix
    _job_ok(procs[key], _group_name(key))
    events = json.loads((out / f"timeline_{_group_name(key)}.json").read_text())
    events = events["traceEvents"] if isinstance(events, dict) else events
    assert any(e.get("ph") == "X" for e in events), events[:5]


def test_the_plan_covers_every_allowed_pair():
    rows = matrix_plan.covering_rows(2)
    assert all(matrix_plan.allowed(row) for row in rows)
    assert matrix_plan.missing_tuples(rows, 2) == []
    # the constraints leave every value of every axis in the plan
    for axis, values in matrix_plan.AXES.items():
        assert {row[axis] for row in rows} == set(values), axis


def test_a_pair_left_out_of_the_plan_is_found_missing():
    rows = [row for row in matrix_plan.covering_rows(2)
            if not (row["codec"] == "fp16" and row["devices"] == 2)]
    assert {"codec": "fp16", "devices": 2} in matrix_plan.missing_tuples(rows, 2)


def test_a_lossy_run_that_did_not_move_the_weights_is_out_of_bound():
    start, replay = {"0": np.zeros(4)}, {"0": np.ones(4)}
    _close({"0": np.full(4, 0.5)}, replay, "2bit", start, "half way")
    with pytest.raises(AssertionError, match="bound for 2bit"):
        _close(start, replay, "2bit", start, "never moved")
    with pytest.raises(AssertionError, match="parameter 0"):
        _close({"0": np.full(4, 1.001)}, replay, "none", start, "exact")
