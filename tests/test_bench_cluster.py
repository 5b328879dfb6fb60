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
