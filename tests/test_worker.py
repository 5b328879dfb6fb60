"""The worker context (dist_gluon/worker.py): where a worker is in its job, parsed once
from the launcher's variables and updated in place when an in-process re-formation
hands it its next round; and the timeline, which follows it into the new round."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from conftest import assert_ok, process_env
from dist_gluon import timeline, worker


def test_the_context_parses_the_launchers_variables_once_into_typed_fields():
    place = worker.WorkerContext.from_environ({
        "DG_RANK": "3", "DG_NUM_WORKERS": "4", "DG_LOCAL_RANK": "1", "DG_NODE_RANK": "1",
        "DG_NNODES": "2", "DG_RESTART": "2", "DG_REFORMATION": "1", "DG_ELASTIC": "1",
        "DG_BACKEND": "horovod", "DG_JOB_ID": "job7", "DG_STATE_DIR": "/dev/shm/dg/x",
        "DG_CONTROL_DIR": "/tmp/control", "DG_OBSERVE_DIR": "/tmp/observe",
        "DG_OBSERVE": "timeline", "HOROVOD_RANK": "3"})
    assert place == worker.WorkerContext(
        rank=3, num_workers=4, local_rank=1, node_rank=1, nnodes=2, restart=2,
        reformation=1, elastic=True, heal=False, backend="horovod", job_id="job7",
        state_dir="/dev/shm/dg/x", control_dir="/tmp/control",
        observe_dir="/tmp/observe", observe="timeline", placed=True)
    # without a launcher: rank 0 of 1, first run, not elastic, no directories
    assert worker.WorkerContext.from_environ({}) == worker.WorkerContext()
    assert not worker.WorkerContext().placed


@pytest.mark.parametrize("name, text", [("DG_RESTART", "two"), ("DG_REFORMATION", "-1"),
                                        ("DG_NUM_WORKERS", "0")])
def test_a_bad_count_is_a_value_error_naming_the_variable(name, text):
    with pytest.raises(ValueError, match=f"{name}='{text}' must be an int >= "):
        worker.WorkerContext.from_environ({name: text})


def test_a_round_handed_in_process_updates_the_one_context_in_place():
    place = worker.WorkerContext.from_environ({
        "DG_RANK": "2", "DG_NUM_WORKERS": "3", "DG_RESTART": "1", "DG_ELASTIC": "1",
        "DG_CONTROL_DIR": "/tmp/control"})
    same = place
    # node 0 was lost: this survivor is rank 1 of 2 in round 2 (the launcher hands the
    # round's variables; the control directory stays the process's own)
    place.update({"DG_RANK": "1", "DG_NUM_WORKERS": "2", "DG_RESTART": "2",
                  "DG_REFORMATION": "1", "HOROVOD_RANK": "1"})
    assert same is place
    assert (place.rank, place.num_workers, place.restart, place.reformation) == (1, 2, 2, 1)
    assert place.elastic and place.control_dir == "/tmp/control"


REFORMED = """
    import os, sys
    from dist_gluon import timeline, worker

    os.environ.update(DG_OBSERVE_DIR=sys.argv[1], DG_OBSERVE="steps", DG_RANK="2",
                      DG_RESTART="0")
    for _ in range(3):
        timeline.begin_step()
        timeline.end_step(4)
    # the job re-forms around this process (dist_gluon.elastic.run hands the round to
    # the context): rank 2 of round 0 goes on as rank 1 of round 1
    worker.context().update({"DG_RANK": "1", "DG_RESTART": "1"})
    for _ in range(2):
        timeline.begin_step()
        timeline.end_step(4)
"""


@pytest.mark.spawns
def test_the_timeline_follows_a_survivor_into_its_new_rank_and_round(tmp_path):
    """A survivor's steps after an in-process re-formation go to the new round's files
    under its new rank, numbered from 1 like those of the round's new workers (the
    report lines up the ranks' steps by number)."""
    script = tmp_path / "reformed.py"
    script.write_text(textwrap.dedent(REFORMED))
    assert_ok(subprocess.run([sys.executable, str(script), str(tmp_path)], cwd=tmp_path,
                             env=process_env(), capture_output=True, text=True,
                             timeout=120))
    before, _ = timeline.read_steps(timeline.steps_path(str(tmp_path), 2, 0))
    after, _ = timeline.read_steps(timeline.steps_path(str(tmp_path), 1, 1))
    assert [row[0] for row in before] == [1, 2, 3]
    assert [row[0] for row in after] == [1, 2]
    assert [row[8] for row in after] == [4.0, 4.0]      # the samples of each step
