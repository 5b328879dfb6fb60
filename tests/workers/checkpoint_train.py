"""Worker script of tests/test_checkpoint.py: trains a small deferred-initialised MLP for
3 epochs with DistributedTrainer, ShardSampler and a DataLoader, checkpointing every
EVERY batches (mid-epoch too) and at the end of every epoch, and resumes from the newest
checkpoint when started again, skipping the batches of the restored epoch already done.

    python checkpoint_train.py OUT_DIR CHECKPOINT_DIR [--kill-rank R --kill-at EPOCH:STEP]

With --kill-rank, rank R SIGKILLs itself after batch STEP of EPOCH, in the first run of
the job only (DG_RESTART=0). Every rank writes its final parameters to
OUT_DIR/final_rank{rank}.npz.
"""
import argparse
import os
import signal

import mxnet as mx
import numpy as np
from mxnet import autograd, gluon

import dist_gluon as dg
from dist_gluon.checkpoint import Checkpointer

EPOCHS, BATCH, SAMPLES, FEATURES, CLASSES, EVERY = 3, 4, 40, 6, 3, 2

parser = argparse.ArgumentParser()
parser.add_argument("out_dir")
parser.add_argument("checkpoint_dir")
parser.add_argument("--kill-rank", type=int, default=None)
parser.add_argument("--kill-at", default="1:3", help="EPOCH:STEP")
args = parser.parse_args()
kill_epoch, kill_step = map(int, args.kill_at.split(":"))

kv = dg.create()
rank = kv.rank
data_rng = np.random.RandomState(0)
dataset = gluon.data.ArrayDataset(
    data_rng.randn(SAMPLES, FEATURES).astype("float32"),
    data_rng.randint(0, CLASSES, SAMPLES).astype("float32"))
sampler = dg.ShardSampler(len(dataset), shuffle=True, seed=7)
loader = gluon.data.DataLoader(dataset, batch_size=BATCH, sampler=sampler)

# a different random initialisation on every rank and in every run: the values that
# count come from rank 0 (fresh start) or from the checkpoint (resume)
mx.random.seed(1000 * int(os.environ.get("DG_RESTART", "0")) + rank)
net = gluon.nn.HybridSequential()
net.add(gluon.nn.Dense(16, activation="relu"), gluon.nn.Dense(CLASSES))
net.initialize(mx.init.Xavier())
trainer = dg.DistributedTrainer(net.collect_params(), "adam", {"learning_rate": 0.02})
loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()

checkpoints = Checkpointer(args.checkpoint_dir, keep=2)
state = checkpoints.restore(net, trainer)
start_epoch, skip = (state["epoch"], state["step"]) if state else (0, 0)
if rank == 0:
    print(f"starting at epoch {start_epoch} step {skip} (run {os.environ['DG_RESTART']})",
          flush=True)

for epoch in range(start_epoch, EPOCHS):
    sampler.set_epoch(epoch)
    for i, (x, y) in enumerate(loader):
        if epoch == start_epoch and i < skip:
            continue
        with autograd.record():
            loss = loss_fn(net(x), y)
        loss.backward()
        trainer.step(x.shape[0])
        done = i + 1
        if (rank == args.kill_rank and os.environ["DG_RESTART"] == "0"
                and (epoch, done) == (kill_epoch, kill_step)):
            os.kill(os.getpid(), signal.SIGKILL)
        if done % EVERY == 0 and done < len(loader):
            checkpoints.save(net, trainer, epoch, step=done)
    checkpoints.save(net, trainer, epoch + 1)

np.savez(os.path.join(args.out_dir, f"final_rank{rank}.npz"),
         **{str(i): p.data().asnumpy() for i, p in enumerate(net.collect_params().values())})
print("done", flush=True)
