"""dist_async: MXNet's asynchronous parameter server, through the real launcher.

The servers run the optimizer: each worker's push is one optimizer step, applied as it
arrives, and nobody waits for anybody. When every worker pushes the same gradient, the
order of the pushes does not matter, so N workers making S steps each must end exactly
where one process ends after N*S steps of that gradient (momentum included: its state
lives on the servers).
"""
from __future__ import annotations

import json
import re
import sys

import mxnet as mx
import numpy as np
from mxnet import autograd, gluon

from conftest import REPO, assert_ok, launch, run, worker_lines

STEPS = 4
LR, MOMENTUM, WD, BIAS_LR_MULT = 0.1, 0.9, 0.01, 0.5
X_ROW = [0.5, -1.0, 2.0, 0.25]

TRAINER_JOB = f"""
import json
import mxnet as mx
from mxnet import autograd, gluon
import dist_gluon as dg

kv = dg.create()
results = {{"type": kv.type}}
# the collectives still work, with the same result on every rank
x = mx.nd.array([kv.rank + 1.0, 10.0 * (kv.rank + 1)])
kv.pushpull("sum", x)
results["sum"] = x.asnumpy().tolist()
results["gathered"] = kv.allgather_object(("rank", kv.rank))
results["broadcast"] = kv.broadcast_object({{"from": kv.rank}})

net = gluon.nn.Dense(3, in_units=4)
net.initialize(mx.init.Constant(0.3 if kv.rank == 0 else -5.0))   # rank 0's win
net.bias.lr_mult = {BIAS_LR_MULT}
trainer = dg.DistributedTrainer(net.collect_params(), "sgd",
                                {{"learning_rate": {LR}, "momentum": {MOMENTUM},
                                  "wd": {WD}}})
batch = 3 if kv.rank == 0 else 5       # the same mean gradient from different batches
data = mx.nd.array([{X_ROW}] * batch)
for step in range({STEPS}):
    with autograd.record():
        loss = net(data).sum()
    loss.backward()
    trainer.step(batch)
try:
    trainer.allreduce_grads()
except RuntimeError as err:
    results["allreduce_grads"] = str(err)
try:
    trainer.set_learning_rate(0.5)
except RuntimeError as err:
    results["set_learning_rate"] = str(err)
ckpt = dg.Checkpointer("ckpt", kv=kv)
ckpt.save(net, trainer, epoch=1)       # pulls the servers' weights on every rank first
results["weight"] = net.weight.data().asnumpy().tolist()
results["bias"] = net.bias.data().asnumpy().tolist()
try:
    ckpt.restore(net, trainer)
except dg.CheckpointError as err:
    results["late restore"] = str(err)
print("RESULT " + json.dumps(results), flush=True)
"""


RESUME_JOB = f"""
import json
import mxnet as mx
from mxnet import autograd, gluon
import dist_gluon as dg

kv = dg.create()
net = gluon.nn.Dense(3, in_units=4)
net.initialize(mx.init.Constant(42.0))
net.bias.lr_mult = {BIAS_LR_MULT}
trainer = dg.DistributedTrainer(net.collect_params(), "sgd", {{"learning_rate": 1.0}})
state = dg.Checkpointer("ckpt", kv=kv).restore(net, trainer)
results = {{"epoch": state["epoch"], "restored": net.weight.data().asnumpy().tolist(),
            "lr": trainer.learning_rate}}
data = mx.nd.array([{X_ROW}])
with autograd.record():
    loss = net(data).sum()
loss.backward()
trainer.step(1)
trainer.sync_weights()
results["weight"] = net.weight.data().asnumpy().tolist()
print("RESULT " + json.dumps(results), flush=True)
"""


def _results(proc, rank):
    lines = [line for line in worker_lines(proc.stdout, rank) if line.startswith("RESULT ")]
    assert lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT "):])


def _one_process_reference(steps: int, weight=None, bias=None):
    """One process, plain gluon.Trainer: ``steps`` SGD steps of the mean gradient, from
    the initial values or from ``weight`` and ``bias`` with a fresh optimizer."""
    net = gluon.nn.Dense(3, in_units=4)
    net.initialize(mx.init.Constant(0.3))
    net.bias.lr_mult = BIAS_LR_MULT
    if weight is not None:
        net.weight.set_data(mx.nd.array(weight))
        net.bias.set_data(mx.nd.array(bias))
    trainer = gluon.Trainer(net.collect_params(), "sgd",
                            {"learning_rate": LR, "momentum": MOMENTUM, "wd": WD})
    data = mx.nd.array([X_ROW])
    for _ in range(steps):
        with autograd.record():
            loss = net(data).sum()
        loss.backward()
        trainer.step(1)
    return net.weight.data().asnumpy(), net.bias.data().asnumpy()


def test_two_async_workers_end_where_one_process_ends_after_all_their_pushes(tmp_path):
    proc = launch(TRAINER_JOB, tmp_path, backend="dist_async", timeout=240)
    assert_ok(proc)
    weight, bias = _one_process_reference(2 * STEPS)
    for rank in (0, 1):
        got = _results(proc, rank)
        assert got["type"] == "dist_async"
        assert got["sum"] == [3.0, 30.0]
        assert got["gathered"] == [["rank", 0], ["rank", 1]]
        assert got["broadcast"] == {"from": 0}
        # momentum, weight decay and the bias's lr_mult ran on the servers
        np.testing.assert_allclose(got["weight"], weight, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(got["bias"], bias, rtol=1e-5, atol=1e-6)
        assert "does not exist on dist_async" in got["allreduce_grads"]
        assert "lr_scheduler" in got["set_learning_rate"]
        assert "before its first step" in got["late restore"]
    # a one-process run after half the pushes is elsewhere: the test can fail
    assert not np.allclose(_one_process_reference(STEPS)[0], weight, atol=1e-3)

    # Resume: the weights are the checkpoint's, the optimizer its settings (not the
    # new run's lr=1.0) with a fresh state on the new servers
    resumed = launch(RESUME_JOB, tmp_path, backend="dist_async", timeout=240,
                     name="resume.py")
    assert_ok(resumed)
    expected, _ = _one_process_reference(2, weight, bias)
    for rank in (0, 1):
        got = _results(resumed, rank)
        assert got["epoch"] == 1 and got["lr"] == LR
        np.testing.assert_allclose(got["restored"], weight, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(got["weight"], expected, rtol=1e-5, atol=1e-6)


MODULE_AND_REFUSALS_JOB = f"""
import json
import mxnet as mx
import numpy as np
import dist_gluon as dg
from mxnet import autograd, gluon

kv = dg.create()
results = {{}}

def refused(name, call):
    try:
        call()
    except (ValueError, TypeError, RuntimeError, NotImplementedError) as err:
        results[name] = f"{{type(err).__name__}}: {{err}}"

params = lambda: gluon.nn.Dense(2, in_units=4).collect_params()
refused("compression", lambda: dg.DistributedTrainer(params(), "sgd", compression="fp16"))
refused("predivide", lambda: dg.DistributedTrainer(params(), "sgd",
                                                   gradient_predivide_factor=2.0))
refused("kv compression", lambda: kv.set_gradient_compression({{"type": "2bit"}}))

class ScriptSGD(mx.optimizer.SGD):
    pass

refused("optimizer in the script", lambda: dg.DistributedOptimizer(ScriptSGD()))
bn = dg.SyncBatchNorm(in_channels=2)
bn.initialize()
def syncbn_forward():
    with autograd.record():
        bn(mx.nd.ones((4, 2)))
refused("syncbn", syncbn_forward)

# The Module API: DistributedOptimizer pushes to the servers as well
data = mx.sym.Variable("data")
out = mx.sym.FullyConnected(data, num_hidden=1, name="fc")
sym = mx.sym.MakeLoss(mx.sym.sum(out))
mod = mx.mod.Module(sym, data_names=["data"], label_names=None, context=mx.cpu())
batch = 2
mod.bind(data_shapes=[("data", (batch, 4))])
mod.init_params(mx.init.Constant(0.2 if kv.rank == 0 else 9.0))
arg, aux = mod.get_params()
dg.broadcast_parameters(arg)
mod.set_params(arg, aux)
opt = dg.DistributedOptimizer(mx.optimizer.SGD(learning_rate={LR}, momentum={MOMENTUM},
                                               rescale_grad=1.0 / batch))
mod.init_optimizer(kvstore=None, optimizer=opt)
batch_data = mx.io.DataBatch([mx.nd.array([{X_ROW}] * batch)])
for step in range({STEPS}):
    mod.forward(batch_data, is_train=True)
    mod.backward()
    mod.update()
mx.nd.waitall()
results["fc_weight"] = mod.get_params()[0]["fc_weight"].asnumpy().tolist()
refused("second trainer", lambda: dg.DistributedTrainer(params(), "sgd").step(1))
plain = gluon.nn.Dense(2, in_units=4)
plain.initialize()
refused("plain gluon.Trainer",
        lambda: gluon.Trainer(plain.collect_params(), "sgd", kvstore=kv).step(1))
print("RESULT " + json.dumps(results), flush=True)
"""


def test_module_updates_on_the_servers_and_what_cannot_work_async_is_refused(tmp_path):
    proc = launch(MODULE_AND_REFUSALS_JOB, tmp_path, backend="dist_async", timeout=240)
    assert_ok(proc)
    # each rank holds the weights after its own last push: after its own STEPS pushes
    # and at most all 2 * STEPS of the job, on the path of one process
    sgd = mx.optimizer.SGD(learning_rate=LR, momentum=MOMENTUM)
    weight, state = mx.nd.full((1, 4), 0.2), None
    path = [weight.asnumpy().copy()]
    state = sgd.create_state(0, weight)
    for _ in range(2 * STEPS):
        sgd.update(0, weight, mx.nd.array([X_ROW]), state)
        path.append(weight.asnumpy().copy())
    for rank in (0, 1):
        got = _results(proc, rank)
        held = np.array(got["fc_weight"])
        assert any(np.allclose(held, p, rtol=1e-5, atol=1e-6) for p in path[STEPS:]), held
        assert got["compression"].startswith("ValueError") and "'fp16'" in got["compression"]
        assert "gradient_predivide_factor=2.0" in got["predivide"]
        assert "does not compress" in got["kv compression"]
        assert "defined in the script (__main__)" in got["optimizer in the script"]
        assert "SyncBatchNorm" in got["syncbn"] and "dist_async" in got["syncbn"]
        assert "one optimizer" in got["second trainer"]
        assert "use dist_gluon.DistributedTrainer" in got["plain gluon.Trainer"]


SLOW_RANK_JOB = """
import time
import mxnet as mx
from mxnet import autograd, gluon
import dist_gluon as dg

kv = dg.create()
net = gluon.nn.Dense(2, in_units=4)
net.initialize()
trainer = dg.DistributedTrainer(net.collect_params(), "sgd", {"learning_rate": 0.01})
data = mx.nd.ones((2, 4))
steps = 6 if kv.rank == 1 else 150
for step in range(steps):
    if kv.rank == 1 and step == 3:
        print(f"sleep from {time.monotonic():.4f}", flush=True)
        time.sleep(5)
        print(f"sleep until {time.monotonic():.4f}", flush=True)
    with autograd.record():
        loss = net(data).sum()
    loss.backward()
    trainer.step(2)
    mx.nd.waitall()
    if kv.rank == 0:
        print(f"step {step} at {time.monotonic():.4f}", flush=True)
        time.sleep(0.05)
"""


def test_a_rank_that_sleeps_does_not_stop_the_other(tmp_path):
    proc = launch(SLOW_RANK_JOB, tmp_path, backend="dist_async", timeout=240)
    assert_ok(proc)
    slow = worker_lines(proc.stdout, 1)
    start = float(next(line.split()[-1] for line in slow if line.startswith("sleep from")))
    end = float(next(line.split()[-1] for line in slow if line.startswith("sleep until")))
    steps = [float(m.group(1)) for m in
             (re.match(r"step \d+ at ([\d.]+)", line) for line in worker_lines(proc.stdout, 0))
             if m]
    assert len(steps) == 150
    # rank 0 kept pushing and pulling while rank 1 slept (on dist_sync it would wait in
    # its next step, finishing at most one during the sleep); a loaded machine still
    # gives it several
    during = [t for t in steps if start < t < end]
    assert len(during) >= 3, (start, end, steps)


FAILING_RANK_JOB = """
import mxnet as mx
from mxnet import autograd, gluon
import dist_gluon as dg

kv = dg.create()
net = gluon.nn.Dense(2, in_units=4)
net.initialize()
trainer = dg.DistributedTrainer(net.collect_params(), "sgd", {"learning_rate": 0.01})
for step in range(20):
    if kv.rank == 1 and step == 5:
        raise RuntimeError("rank 1 lost its data")
    with autograd.record():
        loss = net(mx.nd.ones((2, 4))).sum()
    loss.backward()
    trainer.step(2)
kv.barrier()
"""


def test_a_rank_that_fails_is_named_and_ends_the_job(tmp_path):
    proc = launch(FAILING_RANK_JOB, tmp_path, backend="dist_async", timeout=240)
    assert proc.returncode != 0
    assert "rank 1 (" in proc.stderr and "RuntimeError: rank 1 lost its data" in proc.stderr


def test_mnist_example_reaches_97_percent_on_dist_async(tmp_path):
    """examples/mnist/train_gluon.py as it is (12 epochs of the embedded digits): on
    dist_async it keeps the one-worker learning rate and schedules over every push."""
    argv = [sys.executable, "-m", "dist_gluon.launch", "-n", "2", "--backend", "dist_async",
            "--", sys.executable, str(REPO / "examples" / "mnist" / "train_gluon.py")]
    proc = run(argv, cwd=tmp_path, timeout=400)
    assert_ok(proc)
    summary = [line for line in worker_lines(proc.stdout, 0) if line.startswith("summary:")]
    assert summary, proc.stdout[-3000:]
    fields = dict(item.split("=", 1) for item in summary[0].split()[1:])
    assert (fields["backend"], fields["workers"]) == ("dist_async", "2")
    assert float(fields["val_acc"]) >= 0.97


STALLING_RANK_JOB = """
import time
import mxnet as mx
from mxnet import autograd, gluon
import dist_gluon as dg

def load_next_batch():
    time.sleep(300)

kv = dg.create()
net = gluon.nn.Dense(2, in_units=4)
net.initialize()
trainer = dg.DistributedTrainer(net.collect_params(), "sgd", {"learning_rate": 0.01})
for step in range(3):
    with autograd.record():
        loss = net(mx.nd.ones((2, 4))).sum()
    loss.backward()
    trainer.step(2)
if kv.rank == 1:
    load_next_batch()
trainer.sync_weights()          # a barrier: rank 0 waits here for rank 1
"""


def test_a_rank_that_stalls_is_named_with_its_stack(tmp_path):
    proc = launch(STALLING_RANK_JOB, tmp_path, backend="dist_async", timeout=240,
                  launcher_args=["--stall-warning", "2", "--stall-timeout", "6"])
    assert proc.returncode == 124, proc.stderr[-3000:]
    assert re.search(r"stall: rank 0 has waited \d+ s in collective #\d+ \(key 'barrier'\) "
                     r"that rank 1 \(.*\) has not reached", proc.stderr), proc.stderr[-3000:]
    assert "Python stacks of rank 1 (every thread):" in proc.stderr
    assert "in load_next_batch" in proc.stderr
