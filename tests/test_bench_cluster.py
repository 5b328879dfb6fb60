"""benchmarks/run_cluster.py part 7 reads the launchers' lines to time a recovery: the
line that says a node is out of the job counts as its detection, whichever of the
launcher's two wordings it takes."""
from __future__ import annotations

import sys

import pytest

from conftest import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
import run_cluster  # noqa: E402  (benchmarks/run_cluster.py)

HOST = "dist_gluon.launch[node 0]: "


def lines_of(*said: tuple[float, int, str]) -> run_cluster._Lines:
    """A launcher's stderr lines, as (wall-clock time, node, text)."""
    lines = run_cluster._Lines()
    lines.lines = [(t, node, "stderr", text) for t, node, text in said]
    return lines


def test_a_node_that_left_unconfirmed_after_its_workers_failed_counts_as_detected():
    """With the link to host 2 down, horovod's 5 s Gloo timeout ends the round before the
    8 s silence limit; node 0 then drops node 2 as it waits for confirmations (the lines
    of part 7's horovod restart row, link down, at fault + 5.1 s and + 8.0 s)."""
    lines = lines_of(
        (105.1, 0, HOST + "rank 0 (h0) failed (MXNetError: Horovod has been shut down)"),
        (108.0, 0, HOST + "node 2 did not confirm that its processes ended"),
        (108.0, 0, HOST + "node 2 (dgc-h2) did not confirm that its processes ended: it "
                          "leaves the job"),
        (108.1, 0, HOST + "re-forming with 2 nodes (2 workers) from checkpoint epoch 0"))
    seen, host, line = run_cluster._detection(lines, 100.0, lost=2, nodes=3)
    assert (seen, host) == ({0: 108.0}, 0)
    assert line[1].endswith("node 2 (dgc-h2) did not confirm that its processes ended: "
                            "it leaves the job")


@pytest.mark.parametrize("how", ["its launcher's connection closed",
                                 "nothing heard from its launcher for 8 s"])
def test_a_node_declared_lost_during_the_round_counts_as_detected(how):
    lines = lines_of((99.0, 0, HOST + "node 2 (dgc-h2) lost: before the fault"),
                     (103.0, 0, HOST + f"node 2 (dgc-h2) lost: {how}"))
    seen, host, line = run_cluster._detection(lines, 100.0, lost=2, nodes=3)
    assert (seen, host, line) == ({0: 103.0}, 0, (103.0, HOST + f"node 2 (dgc-h2) lost: {how}"))


def test_another_nodes_loss_or_a_workers_line_is_not_the_detection():
    lines = lines_of((103.0, 0, HOST + "node 1 (dgc-h1) lost: its launcher's connection "
                                       "closed"),
                     (104.0, 0, HOST + "node 2 did not confirm that its processes ended"),
                     (105.0, 1, "dist_gluon.launch[node 1]: node 2 (dgc-h2) lost: nothing heard "
                                       "from it"))
    assert run_cluster._detection(lines, 100.0, lost=2, nodes=3) == ({}, 0, None)
    assert run_cluster.recovery(lines, 100.0, lost=2, nodes=3)["error"] == \
        "node 0 never said node 2 was lost or left the job"


def timeline(rank: int, pid: int, reformation: int, resumed_from: int, **times) -> tuple:
    """A worker's ELASTIC timeline line, as the launcher's stdout carries it."""
    payload = {"event": "timeline", "rank": rank, "pid": pid, "host": f"dgc-h{rank}",
               "workers": 3 if reformation == 0 else 2, "reformation": reformation,
               "restart": reformation, "resumed_from": resumed_from, "times": times}
    return run_cluster.ELASTIC_TAG + run_cluster.json.dumps(payload)


def test_restarted_pslite_workers_in_memory_mode_are_timed_from_process_start_to_first_step():
    """On ps-lite the in-memory mode restarts the workers: the phases are the new
    processes' start, their imports, ps-lite's start, the model, the state synced from
    the node's copy and the first step, each up to the last worker."""
    step = {"event": "step", "step": 3, "reformation": 0, "time": 99.0}
    lines = run_cluster._Lines()
    lines.lines = [
        (50.0, 0, "stdout", timeline(0, 11, 0, 0, process=40.0, first_step=60.0)),
        (50.0, 1, "stdout", timeline(1, 12, 0, 0, process=40.5, first_step=61.0)),
        (99.0, 0, "stdout", run_cluster.ELASTIC_TAG + run_cluster.json.dumps(step)),
        (100.1, 0, "stderr", HOST + "node 2 (dgc-h2) lost: its launcher's connection closed"),
        (100.2, 0, "stderr", HOST + "re-forming with 2 nodes (2 workers) from the workers' "
                                    "last commit in memory"),
        (112.0, 0, "stdout", timeline(0, 21, 1, 3, process=100.5, imported=104.0,
                                      created=105.0, built=106.0, entered=109.0,
                                      first_step=111.0)),
        (112.0, 1, "stdout", timeline(1, 22, 1, 3, process=100.4, imported=104.5,
                                      created=105.1, built=106.5, entered=109.5,
                                      first_step=111.5)),
    ]
    found = run_cluster.recovery(lines, 100.0, lost=2, nodes=3)
    assert "error" not in found
    assert found["phases"] == pytest.approx({
        "detection": 0.1, "re-formation": 0.3, "imports": 4.1, "backend start": 0.6,
        "model build": 1.4, "state sync": 3.0, "first step": 2.0})
    assert found["total"] == pytest.approx(11.5)
    assert (found["resumed_from"], found["steps_lost"]) == (3, 0)


def test_merged_rows_replace_the_same_rows_and_keep_the_others(tmp_path):
    """--merge: a row run again replaces its old one, the others stay, and every run is
    listed with its own load and rows."""
    def run(command, jobs, load):
        return {"command": command, "minutes": 1.0, "others_cpu_share": 0.5,
                "machine": {"date": "today", "cpu": "AMD EPYC",
                            "versions": {"dist_gluon": "abc"}},
                "elastic": {"jobs": jobs, "load_start": [load] * 3, "load_end": [load] * 3,
                            "uptime_start": "up", "uptime_end": "up"}}

    report = tmp_path / "RESULTS-cluster-elastic.md"
    first = run("first", {"horovod host 2 kill": {"runs": [1]},
                          "p3 host 2 kill memory": {"runs": [2]}}, 5.0)
    run_cluster.raw_path(report).write_text(run_cluster.json.dumps(first))
    merged = run_cluster.merge_runs(
        run("second", {"p3 host 2 kill memory": {"runs": [3]},
                       "p3 host 0 kill memory": {"runs": [4]}}, 9.0), "elastic", report)
    assert merged["command"] == "first"
    assert merged["elastic"]["jobs"] == {
        "horovod host 2 kill": {"runs": [1]},
        "p3 host 2 kill memory": {"runs": [3], "run": 1},
        "p3 host 0 kill memory": {"runs": [4], "run": 1}}
    assert [(r["command"], r["load_start"][0], r["jobs"]) for r in merged["elastic_runs"]] == [
        ("first", 5.0, ["horovod host 2 kill", "p3 host 2 kill memory"]),
        ("second", 9.0, ["p3 host 2 kill memory", "p3 host 0 kill memory"])]


def test_a_variant_run_of_part_3_joins_its_report_marked_by_its_run(tmp_path):
    """--merge --only compress: a --variant run's rows join the report of record, each
    marked with the run that measured it; a variant run again replaces its old rows, the
    other rows stay in place, and the header names every run with its commit and load."""
    def run(command, commit, load, rows):
        compress = {model: {label: {"times": {"dist_gluon": {"median": step}}}
                            for label, step in per.items()} for model, per in rows.items()}
        return {"command": command, "minutes": 2.0, "others_cpu_share": 0.1,
                "machine": {"date": "today", "cpu": "AMD EPYC",
                            "versions": {"dist_gluon": commit}},
                "settings": [{"hosts": 2, "rate": "1gbit", "load_start": [load] * 3,
                              "load_end": [load + 1] * 3, "uptime_start": f"up {load}",
                              "compress": compress}]}

    report = tmp_path / "RESULTS-cluster-compression.md"
    record = run("record", "aaa", 2.0, {"resnet50": {"horovod (Gloo)": 1.0, "dist_sync": 2.0},
                                        "vgg16": {"horovod (Gloo)": 3.0}})
    run_cluster.raw_path(report).write_text(run_cluster.json.dumps(record))
    once = run_cluster.merge_runs(
        run("variant", "bbb", 4.0, {"resnet50": {"fixed": 5.0}, "vgg16": {"fixed": 6.0}}),
        "compress", report)
    run_cluster.raw_path(report).write_text(run_cluster.json.dumps(once))
    merged = run_cluster.merge_runs(
        run("again", "ccc", 6.0, {"resnet50": {"fixed": 7.0}}), "compress", report)

    assert merged["command"] == "record"
    rows = {model: {label: (slot["times"]["dist_gluon"]["median"], slot.get("run", 0))
                    for label, slot in per.items()}
            for model, per in merged["settings"][0]["compress"].items()}
    assert rows == {"resnet50": {"horovod (Gloo)": (1.0, 0), "dist_sync": (2.0, 0),
                                 "fixed": (7.0, 2)},
                    "vgg16": {"horovod (Gloo)": (3.0, 0), "fixed": (6.0, 1)}}
    assert [(r["command"], r["dist_gluon"], r["load_start"][0], r["uptime_start"], r["jobs"])
            for r in merged["compress_runs"]] == [
        ("record", "aaa", 2.0, "up 2.0", ["resnet50, horovod (Gloo)", "resnet50, dist_sync",
                                           "vgg16, horovod (Gloo)"]),
        ("variant", "bbb", 4.0, "up 4.0", ["resnet50, fixed", "vgg16, fixed"]),
        ("again", "ccc", 6.0, "up 6.0", ["resnet50, fixed"])]
    header = "\n".join(run_cluster.report._merged_runs(merged))
    assert "Part 3 merges several runs" in header
    assert "`variant` on today in 2.0 minutes, dist_gluon bbb" in header
    assert "load average (1 min) 4.00 at its start, 5.00 at its end" in header
    assert "2 row(s), 1 of them shown (the others measured again later)" in header
    table = run_cluster.report.compress_table(merged["settings"][0], "resnet50", merged=True)
    assert [line.rsplit("|", 2)[1].strip() for line in table[2:]] == ["1", "1", "3"]
