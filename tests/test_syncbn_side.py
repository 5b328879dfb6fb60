"""SyncBatchNorm's side channel (dist_gluon/sidechannel.py): a peer lost or silent in
the middle of a step fails the step with an error that names it and the key, in bounded
time, instead of a hang. Equality with one process over the channel is checked by
tests/test_syncbn.py (its shared job and the micro-batch test); across emulated hosts by
tests/test_multinode.py."""
from __future__ import annotations

import re
import time

import pytest

from conftest import launch
from dist_gluon import sidechannel, worker
from dist_gluon.backends import Backend


class Pair(Backend):
    """Rank 0 of 2 workers of a given backend type (no transport: only asked)."""

    rank, num_workers, local_rank = 0, 2, 0

    def __init__(self, type_: str, workers: int = 2):
        self._type, self.num_workers = type_, workers
        super().__init__()


@pytest.mark.parametrize("type_, workers, elastic, setting, expected", [
    ("horovod", 2, False, None, True), ("dist_sync", 4, False, "1", True),
    ("p3", 2, False, None, True),
    ("horovod", 2, True, None, False),         # re-forms: the workers change
    ("dist_async", 2, False, None, False),     # refused by SyncBatchNorm anyway
    ("horovod", 1, False, None, False),        # one process sums nothing
    ("dist_sync", 2, False, "0", False),       # DG_SYNCBN_SIDE=0
])
def test_the_side_channel_serves_fixed_jobs_of_several_workers_on_three_backends(
        monkeypatch, type_, workers, elastic, setting, expected):
    monkeypatch.setattr(worker.context(), "elastic", elastic)
    if setting is None:
        monkeypatch.delenv("DG_SYNCBN_SIDE", raising=False)
    else:
        monkeypatch.setenv("DG_SYNCBN_SIDE", setting)
    assert sidechannel.enabled(Pair(type_, workers)) is expected

# Rank 1 leaves (killed) or falls silent (asleep) after its forward pass of step 2, so
# rank 0's backward sums wait for its part; rank 0 reads a gradient after its backward
# pass (as gradient clipping does), where the failed sum surfaces.
LEAVING_WORKER = """
import os
import sys
import time

import mxnet as mx
import numpy as np
from mxnet import autograd, gluon

import dist_gluon as dg

how = sys.argv[1]
kv = dg.create()
net = gluon.nn.HybridSequential()
net.add(gluon.nn.Conv2D(4, 3), dg.SyncBatchNorm(), gluon.nn.Activation("relu"),
        gluon.nn.Dense(3))
net.initialize()
trainer = dg.DistributedTrainer(net.collect_params(), "sgd", {"learning_rate": 0.1})
x = mx.nd.array(np.random.RandomState(kv.rank).randn(4, 3, 6, 6))
for step in range(3):
    with autograd.record():
        loss = net(x).sum()
    if step == 2 and kv.rank == 1:
        print(f"LEAVING {time.time()!r}", flush=True)
        if how == "killed":
            os.kill(os.getpid(), 9)
        time.sleep(120)
    loss.backward()
    net[0].weight.grad().wait_to_read()
    trainer.step(4)
print("done", flush=True)
"""


@pytest.mark.parametrize("backend, how, error", [
    ("dist_sync", "killed",
     r"SyncBatchNorm side channel: rank 1 \(127\.0\.0\.1:\d+\) closed its side channel "
     r"\(it exited or failed\).* part of syncbn\.\d+\.(forward|backward)"),
    ("horovod", "silent",
     r"SyncBatchNorm side channel: rank 0 waited 3 s for the part of "
     r"syncbn\.\d+\.(forward|backward) from rank 1 \(127\.0\.0\.1:\d+\)"),
])
@pytest.mark.spawns
def test_a_peer_lost_or_silent_in_a_step_fails_it_naming_the_peer_and_key(
        tmp_path, backend, how, error):
    proc = launch(LEAVING_WORKER, tmp_path, backend, n=2, args=[how], timeout=120,
                  env={"DG_SYNCBN_SIDE_TIMEOUT": "3"})
    ended = time.time()
    assert proc.returncode != 0
    assert "[0] done" not in proc.stdout
    assert re.search(error, proc.stdout + proc.stderr), proc.stderr[-4000:]
    left = float(re.search(r"\[1\] LEAVING (\S+)", proc.stdout).group(1))
    assert ended - left < 60, f"{ended - left:.0f} s from the peer's fault to the job's end"
