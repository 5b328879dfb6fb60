"""Collectives from any thread: SyncBatchNorm's backward submits its sums from MXNet's
autograd threads while the script's thread submits the gradients, and a script may run
collectives in threads of its own. Every backend takes them from several threads at
once, step after step, and every rank ends with the same weights. On ps-lite the
SyncBatchNorm sums go through the backend (DG_SYNCBN_SIDE=0), on horovod over its side
channel (dist_gluon/sidechannel.py), beside horovod's own collectives."""
from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import assert_ok, launch

STEPS = 300

STRESS = """
import json
import sys
import threading

import mxnet as mx
import numpy as np
from mxnet import autograd, gluon

import dist_gluon as dg

steps = int(sys.argv[1])
kv = dg.create()
rank = kv.rank
mx.random.seed(rank)
net = gluon.nn.Sequential()
net.add(gluon.nn.Conv2D(4, 3, padding=1), dg.SyncBatchNorm(), gluon.nn.Activation("relu"),
        gluon.nn.Dense(8), dg.SyncBatchNorm(), gluon.nn.Activation("relu"), gluon.nn.Dense(3))
net.initialize(mx.init.Xavier())
trainer = dg.DistributedTrainer(net.collect_params(), "sgd",
                                {"learning_rate": 0.05, "momentum": 0.9}, kv=kv)
loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
rng = np.random.RandomState(rank)

# a thread of the script's own sums a counter every step, beside the training
sums = []
go = threading.Semaphore(0)
def counter():
    for step in range(steps):
        go.acquire()
        value = mx.nd.array([step + rank])
        kv.pushpull("counter", value)
        sums.append(float(value.asscalar()))
thread = threading.Thread(target=counter, name="counter")
thread.start()

for step in range(steps):
    x = mx.nd.array(rng.randn(3 + rank, 2, 5, 5))
    y = mx.nd.array(rng.randint(0, 3, 3 + rank))
    go.release()
    with autograd.record():
        loss = loss_fn(net(x), y)
    loss.backward()
    trainer.step(x.shape[0])
thread.join()
weights = [p.data().asnumpy().tolist() for p in net.collect_params().values()]
with open(f"rank{rank}.json", "w") as f:
    json.dump({"weights": weights, "sums": sums}, f)
"""


@pytest.mark.parametrize("backend_name, side", [("horovod", "1"), ("dist_sync", "0"),
                                                ("p3", "0")])
@pytest.mark.spawns
def test_syncbn_trainer_and_a_scripts_thread_submit_together_for_many_steps(
        tmp_path, backend_name, side):
    proc = launch(STRESS, tmp_path, backend_name, n=2, args=[str(STEPS)], timeout=600,
                  env={"DG_SYNCBN_SIDE": side})
    assert_ok(proc)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    expected = [float(2 * step + 1) for step in range(STEPS)]
    for found in ranks:
        assert found["sums"] == expected
    for a, b in zip(ranks[0]["weights"], ranks[1]["weights"]):
        assert np.array_equal(np.array(a), np.array(b))
    assert all(np.isfinite(np.array(w)).all() for w in ranks[0]["weights"])
