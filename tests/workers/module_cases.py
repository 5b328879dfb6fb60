"""Worker script of tests/test_optimizer.py: trains a small Module through
DistributedOptimizer in several configurations and saves every rank's parameters.

    python module_cases.py OUT_DIR WORLD

Run as one plain process it is the single-process reference: it trains on the
concatenation of the WORLD workers' batches.
"""
import json
import logging
import os
import sys

import mxnet as mx
import numpy as np

import dist_gluon as dg
from dist_gluon.optimizer import DistributedOptimizer

logging.getLogger().setLevel(logging.WARNING)     # no per-epoch lines from mod.fit
out_dir, world = sys.argv[1], int(sys.argv[2])
os.makedirs(out_dir, exist_ok=True)
kv = dg.create()
N, rank = kv.num_workers, kv.rank
B, STEPS, FEATURES, CLASSES = 8, 4, 10, 4
SHARE = world * B // N                         # this worker's batch size
rng = np.random.RandomState(0)
X = rng.randn(STEPS * world * B, FEATURES).astype("float32")
Y = rng.randint(0, CLASSES, STEPS * world * B).astype("float32")


def symbol():
    data = mx.sym.Variable("data")
    net = mx.sym.FullyConnected(data, num_hidden=16, name="fc1")
    # frozen statistics: aux params take part in the forward pass, so they must be
    # rank 0's on every rank, and are not updated
    net = mx.sym.BatchNorm(net, use_global_stats=True, fix_gamma=False, name="bn")
    net = mx.sym.Activation(net, act_type="relu")
    net = mx.sym.FullyConnected(net, num_hidden=CLASSES, name="fc2")
    return mx.sym.SoftmaxOutput(net, name="softmax")


def train_iter():
    """This worker's share of every global batch, in order (all of it on one process)."""
    rows = [np.arange(s * world * B + rank * SHARE, s * world * B + (rank + 1) * SHARE)
            for s in range(STEPS)]
    rows = np.concatenate(rows)
    return mx.io.NDArrayIter(X[rows], Y[rows], SHARE, shuffle=False)


def module(it):
    """A bound Module whose parameters start as rank 0's, whatever each rank's seed."""
    mod = mx.mod.Module(symbol(), context=mx.cpu())
    mod.bind(data_shapes=it.provide_data, label_shapes=it.provide_label)
    mx.random.seed(100 + rank)
    mod.init_params(mx.init.Xavier())
    arg_params, aux_params = mod.get_params()
    for value in aux_params.values():      # per-rank moving statistics as well
        value[:] = mx.nd.random.uniform(0.5, 1.5, value.shape)
    dg.broadcast_parameters(arg_params)
    dg.broadcast_parameters(aux_params)
    mod.set_params(arg_params, aux_params)
    return mod


def save(case, mod):
    arg_params, aux_params = mod.get_params()
    arrays = {k: v.asnumpy() for k, v in {**arg_params, **aux_params}.items()}
    np.savez(os.path.join(out_dir, f"{case}_rank{rank}.npz"), **arrays)


def sgd(aggregation, **kw):
    # SGD reads MXNET_OPTIMIZER_AGGREGATION_SIZE when it is created
    os.environ["MXNET_OPTIMIZER_AGGREGATION_SIZE"] = str(aggregation)
    return mx.optimizer.SGD(learning_rate=0.1, momentum=0.9, wd=1e-3,
                            rescale_grad=1.0 / SHARE, **kw)


def fit(case, opt, epochs=3):
    it = train_iter()
    mod = module(it)
    save(case + "_init", mod)
    mod.fit(it, kvstore=None, optimizer=opt, num_epoch=epochs)
    save(case, mod)
    return mod


def record(case, mod, opt):
    with open(os.path.join(out_dir, f"{case}_rank{rank}.json"), "w") as f:
        json.dump({"aggregated": mod._updater.aggregate_updates,
                   "rescale_grad": opt.rescale_grad, "num_update": opt.num_update,
                   "learning_rate": opt.learning_rate}, f)


# 1. SGD with momentum and weight decay, one update call per parameter
opt = DistributedOptimizer(sgd(aggregation=0))
record("sgd", fit("sgd", opt), opt)

# 2. aggregated updates (lists of 4 indices); created from a name, so rescale_grad comes
#    from Module; a learning rate scheduler and a per-parameter lr multiplier
os.environ["MXNET_OPTIMIZER_AGGREGATION_SIZE"] = "4"
opt = DistributedOptimizer("sgd", learning_rate=0.1, momentum=0.9, wd=1e-3,
                           lr_scheduler=mx.lr_scheduler.FactorScheduler(step=3, factor=0.5,
                                                                       base_lr=0.1))
opt.set_lr_mult({"fc1_weight": 0.5})
record("aggregated", fit("aggregated", opt), opt)

# 3. Adam (never aggregated) with a gradient predivide factor
fit("adam", DistributedOptimizer(mx.optimizer.Adam(learning_rate=0.01,
                                                   rescale_grad=1.0 / SHARE),
                                 gradient_predivide_factor=4.0))

# 3b. gradients travel as float16, as with DistributedTrainer(compression='fp16')
fit("fp16", DistributedOptimizer(sgd(aggregation=4), compression="fp16"))

# 4. checkpoint and resume: 2 epochs, rank 0 saves parameters and optimizer states,
#    every rank loads them into a new Module and continues to epoch 4; it must end
#    where an uninterrupted 4-epoch run ends
scheduler = {"step": 5, "factor": 0.5, "base_lr": 0.1}
fit("full", DistributedOptimizer(sgd(
    4, lr_scheduler=mx.lr_scheduler.FactorScheduler(**scheduler))), epochs=4)
mod = fit("part", DistributedOptimizer(sgd(
    4, lr_scheduler=mx.lr_scheduler.FactorScheduler(**scheduler))), epochs=2)
prefix = os.path.join(out_dir, "ckpt")
if rank == 0:
    mod.save_checkpoint(prefix, 2, save_optimizer_states=True)
kv.barrier()
resumed = mx.mod.Module.load(prefix, 2, load_optimizer_states=True, context=mx.cpu())
it = train_iter()
opt = DistributedOptimizer(sgd(4, begin_num_update=2 * STEPS,
                               lr_scheduler=mx.lr_scheduler.FactorScheduler(**scheduler)))
resumed.fit(it, kvstore=None, optimizer=opt, begin_epoch=2, num_epoch=4)
save("resumed", resumed)

# 5. uneven batch sizes: Modules bound with different batch sizes, rank 0 takes the first
#    5 samples of each step's 8 and rank 1 the other 3 (one process: all 8); an SGD
#    instance with rescale_grad = 1 / its batch size, and one created from a name with
#    aggregated updates (Module sets rescale_grad)
if N == 1:
    lo, hi = 0, 8
else:
    assert N == 2, "the uneven cases are written for 2 workers"
    lo, hi = (0, 5) if rank == 0 else (5, 8)
rows = np.concatenate([np.arange(s * 8 + lo, s * 8 + hi) for s in range(STEPS)])
for case, aggregation in (("uneven", 0), ("uneven_aggregated", 4)):
    os.environ["MXNET_OPTIMIZER_AGGREGATION_SIZE"] = str(aggregation)
    it = mx.io.NDArrayIter(X[rows], Y[rows], hi - lo, shuffle=False)
    if aggregation:
        opt = DistributedOptimizer("sgd", learning_rate=0.1, momentum=0.9, wd=1e-3)
    else:
        opt = DistributedOptimizer(mx.optimizer.SGD(learning_rate=0.1, momentum=0.9, wd=1e-3,
                                                    rescale_grad=1.0 / (hi - lo)))
    mod = module(it)
    mod.fit(it, kvstore=None, optimizer=opt, num_epoch=3)
    save(case, mod)

# 6. misuse: a kvstore as well as the DistributedOptimizer
it = train_iter()
mod = mx.mod.Module(symbol(), context=mx.cpu())
try:
    mod.fit(it, kvstore=kv, optimizer=DistributedOptimizer("sgd"), num_epoch=1)
except ValueError as err:
    print("caught:", err, flush=True)
print("cases done", flush=True)
