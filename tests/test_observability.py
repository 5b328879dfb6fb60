"""Observability through the real launcher: the ranks' weights compared every N steps
(DG_CHECK_SYNC), the job's timeline (--timeline) and the per-rank report with the
straggler named (--report)."""
import pytest

from conftest import launch

# A small model trained a few steps with momentum (so that optimizer states are
# compared too); with "perturb", rank 1 changes one weight after its third step, as a
# rank-dependent bug would.
DIVERGING = """
import sys
import mxnet as mx
from mxnet import autograd, gluon
import dist_gluon as dg

kv = dg.create()
net = gluon.nn.HybridSequential()
net.add(gluon.nn.Dense(8, activation="relu", in_units=4), gluon.nn.Dense(2, in_units=8))
net.initialize(mx.init.Xavier())
trainer = dg.DistributedTrainer(net.collect_params(), sys.argv[1],
                                {"learning_rate": 0.1, **({"momentum": 0.9}
                                                          if sys.argv[1] == "sgd" else {})})
loss_fn = gluon.loss.L2Loss()
for step in range(1, 7):
    x = mx.nd.random.uniform(shape=(4, 4)) + kv.rank
    with autograd.record():
        loss = loss_fn(net(x), mx.nd.zeros((4, 2)))
    loss.backward()
    trainer.step(4)
    if "perturb" in sys.argv and kv.rank == 1 and step == 3:
        net[1].bias.data()[:] += 1e-3
print("trained", step, "steps", flush=True)
"""


@pytest.mark.spawns
def test_check_sync_ends_a_job_whose_ranks_differ_naming_parameter_ranks_and_step(tmp_path):
    proc = launch(DIVERGING, tmp_path, args=["sgd", "perturb"],
                  env={"DG_CHECK_SYNC": "2"})
    assert proc.returncode != 0
    out = proc.stdout + proc.stderr
    assert "DivergenceError" in out and "trained" not in out
    # rank 1 changed the second Dense layer's bias after step 3: the check at step 4
    assert "at step 4" in out
    assert "bias" in out and "parameter #3" in out
    assert "ranks [1] hold another value than ranks [0]" in out


@pytest.mark.spawns
@pytest.mark.parametrize("backend,optimizer", [("horovod", "adam"), ("dist_sync", "sgd")])
def test_check_sync_passes_replicas_that_agree_every_step(tmp_path, backend, optimizer):
    proc = launch(DIVERGING, tmp_path, backend=backend, args=[optimizer],
                  env={"DG_CHECK_SYNC": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "trained 6 steps" in proc.stdout
