"""Worker script of tests/test_checkpoint.py: saves checkpoints with 2 workers and
restores them in several situations; every rank records what it got in OUT_DIR.

    python checkpoint_cases.py OUT_DIR            # as 2 workers, through the launcher
    python checkpoint_cases.py OUT_DIR one_worker # afterwards, as one plain process

The first form writes OUT_DIR/shared (the checkpoints), saved.npz and continued.npz
(rank 0's parameters at the last save and after one more step on batch 5) and, per rank,
result_rank{r}.json plus the parameters each case ended with. The second form restores
OUT_DIR/shared on one process and takes the same step on the whole global batch.
"""
import json
import os
import shutil
import sys
import warnings

import mxnet as mx
import numpy as np
from mxnet import autograd, gluon

import dist_gluon as dg
from dist_gluon.checkpoint import Checkpointer, CheckpointError

out_dir = sys.argv[1]
phase = sys.argv[2] if len(sys.argv) > 2 else "cases"
kv = dg.create()
rank, N = kv.rank, kv.num_workers
B, FEATURES, CLASSES = 4, 5, 3
rng = np.random.RandomState(0)
X = rng.randn(6, 2 * B, FEATURES).astype("float32")   # 6 global batches of 2 workers
Y = rng.randint(0, CLASSES, (6, 2 * B)).astype("float32")
loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
shared = os.path.join(out_dir, "shared")
result = {}


def make_net(seed, hidden=8):
    # a different init on every rank, and on rank 1 other parameter names (dense2_...)
    mx.random.seed(seed + rank)
    if rank == 1:
        gluon.nn.Dense(3)
        gluon.nn.Dense(3)
    net = gluon.nn.HybridSequential()
    net.add(gluon.nn.Dense(hidden, activation="relu"), gluon.nn.Dense(CLASSES))
    net.initialize(mx.init.Xavier())   # deferred
    return net


def make_trainer(net):
    return dg.DistributedTrainer(net.collect_params(), "adam", {"learning_rate": 0.05})


def batch(step):
    lo, share = rank * 2 * B // N, 2 * B // N
    return mx.nd.array(X[step, lo:lo + share]), mx.nd.array(Y[step, lo:lo + share])


def train_step(net, trainer, step, record_before=None):
    x, y = batch(step)
    with autograd.record():
        loss = loss_fn(net(x), y)
    loss.backward()
    if record_before:
        dump(record_before, net)
    trainer.step(x.shape[0])


def dump(name, net):
    np.savez(os.path.join(out_dir, f"{name}.npz"),
             **{str(i): p.data().asnumpy() for i, p in enumerate(net.collect_params().values())})


def info(state):
    return {key: state[key] for key in ("epoch", "step", "extra", "num_workers")}


if phase == "one_worker":
    net = make_net(seed=50)
    trainer = make_trainer(net)
    result["restored"] = info(Checkpointer(shared).restore(net, trainer))
    train_step(net, trainer, 5, record_before="one_worker_restored")
    dump("one_worker_continued", net)
    with open(os.path.join(out_dir, "result_one_worker.json"), "w") as f:
        json.dump(result, f)
    sys.exit(0)

# Two checkpoints of a model trained for 3 + 2 steps, then one more step (not saved).
# Only rank 0 writes: rank 1's directory is never created.
net = make_net(seed=10)
trainer = make_trainer(net)
checkpoints = Checkpointer(shared if rank == 0 else os.path.join(out_dir, "rank1_save_dir"))
for step in range(3):
    train_step(net, trainer, step)
checkpoints.save(net, trainer, epoch=0, step=3, extra={"note": "first"})
for step in range(3, 5):
    train_step(net, trainer, step)
result["saved_path"] = checkpoints.save(net, trainer, epoch=1, extra={"note": "second"})
if rank == 0:
    dump("saved", net)
train_step(net, trainer, 5)
if rank == 0:
    dump("continued", net)

# A deferred model restored where rank 1's directory is empty (it cannot see rank 0's).
net = make_net(seed=20)
trainer = make_trainer(net)
own_dir = shared if rank == 0 else os.path.join(out_dir, "empty_rank1")
os.makedirs(own_dir, exist_ok=True)
result["rank0_only"] = info(Checkpointer(own_dir).restore(net, trainer))
train_step(net, trainer, 5, record_before=f"rank0_only_restored_rank{rank}")
dump(f"rank0_only_continued_rank{rank}", net)

# An initialised model (different values on every rank), no trainer.
net = make_net(seed=30)
net(batch(0)[0])
result["initialised"] = info(Checkpointer(shared).restore(net))
dump(f"initialised_restored_rank{rank}", net)

# The newest checkpoint damaged: a warning, and the previous one is used.
damaged = os.path.join(out_dir, "damaged")
if rank == 0:
    shutil.copytree(shared, damaged)
    newest = os.path.join(damaged, os.path.basename(result["saved_path"]), "params.npz")
    with open(newest, "r+b") as f:
        f.seek(os.path.getsize(newest) // 2)
        f.write(b"garbage!")
kv.barrier()
net = make_net(seed=40)
trainer = make_trainer(net)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    result["fallback"] = info(Checkpointer(damaged).restore(net, trainer))
result["fallback_warnings"] = [str(w.message) for w in caught
                              if "checkpoint" in str(w.message)]
train_step(net, trainer, 5)

# The damaged checkpoint asked for by name: an error on every rank.
try:
    Checkpointer(damaged).restore(net, path=os.path.basename(result["saved_path"]))
    result["explicit_error"] = None
except CheckpointError as err:
    result["explicit_error"] = str(err)

# A model that does not match the checkpoint: an error on every rank.
try:
    Checkpointer(shared).restore(make_net(seed=60, hidden=7))
    result["mismatch_error"] = None
except CheckpointError as err:
    result["mismatch_error"] = str(err)

# A save rank 0 cannot do (the model's deferred parameters have no values yet): an
# error on every rank, and nothing written.
try:
    Checkpointer(shared).save(make_net(seed=70), None, epoch=9)
    result["save_error"] = None
except CheckpointError as err:
    result["save_error"] = str(err)

with open(os.path.join(out_dir, f"result_rank{rank}.json"), "w") as f:
    json.dump(result, f)
print("cases done", flush=True)
