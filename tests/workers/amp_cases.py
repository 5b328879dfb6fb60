"""Worker script of tests/test_amp.py: MXNet's AMP dynamic loss scaling with every codec.

    python amp_cases.py OUT_DIR

Every rank trains the same two-layer network on its half of every global batch; at step
OVERFLOW_STEP one of rank 1's samples is inf, so that step's gradients overflow (on
rank 1 only, and in the one process that sees the whole batch). For each codec it runs
a DistributedTrainer with ``amp.init_trainer`` and, beside it, the same trainer without
AMP on the same batches minus the overflowed step; and, without any collective, one
process with AMP on the whole batches (gluon.Trainer). Then a Checkpointer save and
restore of an AMP trainer after the overflow, continued beside the uninterrupted one.
Each rank writes ``rank<r>.json``.
"""
import json
import os
import sys

import mxnet as mx
import numpy as np
from mxnet import autograd, gluon
from mxnet.contrib import amp

import dist_gluon as dg
import dist_gluon.compat.horovod as hvd

# a float32 model: nothing is cast, so the runs with and without AMP compare to float
# tolerance; the loss scale (2**16) and its changes are AMP's own
amp.init(target_precision_ops=[], conditional_fp32_ops=[], fp32_ops=[])

out_dir = sys.argv[1]
B, STEPS, FEATURES, CLASSES, LR, OVERFLOW_STEP = 4, 6, 10, 4, 0.1, 2
EF = {"ef": "vanilla", "min_compress_bytes": 0, "seed": 1}     # residuals, every tensor
CODECS = {"none": None, "fp16": "fp16", "2bit": {"type": "2bit", "threshold": 0.05},
          "powersgd": {"type": "powersgd", "rank": 2},
          "onebit": {"type": "onebit", **EF}, "topk": {"type": "topk", "k": 0.5, **EF},
          "randomk": {"type": "randomk", "k": 0.5, **EF},
          "dithering": {"type": "dithering", "k": 4, **EF}}
rng = np.random.RandomState(0)
X = rng.randn(STEPS + 2, 2 * B, FEATURES).astype("float32")
X[OVERFLOW_STEP, 2 * B - 1, 0] = np.inf          # in rank 1's half
Y = rng.randint(0, CLASSES, (STEPS + 2, 2 * B)).astype("float32")
INIT = [rng.randn(8, FEATURES) * 0.3, rng.randn(8) * 0.1, rng.randn(CLASSES, 8) * 0.3,
        rng.randn(CLASSES) * 0.1]
loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
kv = dg.create()
rank, workers = kv.rank, kv.num_workers


def make_net():
    net = gluon.nn.HybridSequential()
    net.add(gluon.nn.Dense(8, activation="relu", in_units=FEATURES),
            gluon.nn.Dense(CLASSES, in_units=8))
    net.initialize()
    for p, value in zip(net.collect_params().values(), INIT):
        p.set_data(mx.nd.array(value))
    return net


def train(net, trainer, steps, whole=False, with_amp=True, split=False):
    """Train on ``steps``; returns (loss scale, next loss scale, updates) after each.
    ``split``: ``allreduce_grads()`` then ``update()`` instead of ``step()``."""
    record = []
    lo, hi = (0, 2 * B) if whole else (rank * B, (rank + 1) * B)
    for step in steps:
        x, y = mx.nd.array(X[step, lo:hi]), mx.nd.array(Y[step, lo:hi])
        with autograd.record():
            loss = loss_fn(net(x), y)
            if with_amp:
                with amp.scale_loss(loss, trainer) as scaled:
                    loss = scaled
        loss.backward()
        if split:
            trainer.allreduce_grads()
            trainer.update(x.shape[0])
        else:
            trainer.step(x.shape[0])
        if with_amp:
            scaler = trainer._amp_loss_scaler
            record.append([scaler.loss_scale, scaler._next_loss_scale,
                           trainer.optimizer.num_update])
    return record


def weights(net):
    return [p.data().asnumpy().tolist() for p in net.collect_params().values()]


def amp_trainer(net, **kwargs):
    trainer = dg.DistributedTrainer(net.collect_params(), "sgd",
                                    {"learning_rate": LR, "momentum": 0.9}, **kwargs)
    amp.init_trainer(trainer)
    return trainer


result = {"cases": {}}
# one process on the whole batches, AMP as MXNet has it (no collective)
net = make_net()
single = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": LR, "momentum": 0.9},
                       kvstore=None)
amp.init_trainer(single)
result["single"] = {"scales": train(net, single, range(STEPS), whole=True),
                    "weights": weights(net)}

cases = dict(CODECS)
cases["sharded"] = None
cases["2bit-split"] = CODECS["2bit"]        # allreduce_grads() + update()
# Local SGD after 3 averaged steps: the overflowed one does not count among them
cases["localsgd-2bit"] = CODECS["2bit"]
for name, codec in cases.items():
    options = {"compression": codec, "shard_optimizer_states": name == "sharded"}
    if name.startswith("localsgd"):
        options.update(sync_every=2, local_sgd_warmup=3)
    split = name.endswith("-split")
    net = make_net()
    scales = train(net, amp_trainer(net, **options), range(STEPS), split=split)
    plain = make_net()
    train(plain, dg.DistributedTrainer(plain.collect_params(), "sgd",
                                       {"learning_rate": LR, "momentum": 0.9}, **options),
          [s for s in range(STEPS) if s != OVERFLOW_STEP], with_amp=False, split=split)
    result["cases"][name] = {"scales": scales, "weights": weights(net),
                             "plain": weights(plain)}



def peer_trainer(net):
    """horovod.mxnet's trainer (the peers' API) with its fp16 compression: the same
    rules as DistributedTrainer's."""
    return hvd.DistributedTrainer(net.collect_params(), "sgd",
                                  {"learning_rate": LR, "momentum": 0.9},
                                  compression=hvd.Compression.fp16)
hvd.init()
net = make_net()
trainer = peer_trainer(net)
amp.init_trainer(trainer)
scales = train(net, trainer, range(STEPS))
plain = make_net()
train(plain, peer_trainer(plain), [s for s in range(STEPS) if s != OVERFLOW_STEP],
      with_amp=False)
result["cases"]["compat-fp16"] = {"scales": scales, "weights": weights(net),
                                  "plain": weights(plain)}


def sparse_train(with_amp, steps):
    """An Embedding with row_sparse gradients (fp16 rows on the wire) and a Dense layer;
    rank 1's loss is inf at OVERFLOW_STEP (the one process's batch overflows there)."""
    tokens = np.random.RandomState(1).randint(0, 20, (STEPS, 2 * B, 3)).astype("float32")
    net = gluon.nn.HybridSequential()
    net.add(gluon.nn.Embedding(20, 4, sparse_grad=True), gluon.nn.Flatten(),
            gluon.nn.Dense(CLASSES, in_units=12))
    net.initialize(mx.init.Xavier(rnd_type="gaussian"))
    for p in net.collect_params().values():       # the same weights on every run
        p.set_data(mx.nd.array(np.random.RandomState(2).randn(*p.shape) * 0.3))
    trainer = dg.DistributedTrainer(net.collect_params(), "sgd", {"learning_rate": LR},
                                    compression="fp16")
    if with_amp:
        amp.init_trainer(trainer)
    record = []
    for step in steps:
        x = mx.nd.array(tokens[step, rank * B:(rank + 1) * B])
        y = mx.nd.array(Y[step, rank * B:(rank + 1) * B])
        with autograd.record():
            loss = loss_fn(net(x), y)
            if step == OVERFLOW_STEP and rank == 1:
                loss = loss * np.inf
            if with_amp:
                with amp.scale_loss(loss, trainer) as scaled:
                    loss = scaled
        loss.backward()
        trainer.step(x.shape[0])
        if with_amp:
            scaler = trainer._amp_loss_scaler
            record.append([scaler.loss_scale, scaler._next_loss_scale,
                           trainer.optimizer.num_update])
    return record, weights(net)


scales, amp_weights = sparse_train(True, range(STEPS))
result["cases"]["sparse-fp16"] = {
    "scales": scales, "weights": amp_weights,
    "plain": sparse_train(False, [s for s in range(STEPS) if s != OVERFLOW_STEP])[1]}


def module_train(codec, steps, dynamic=True):
    """The Module API: DistributedOptimizer(loss_scale='dynamic'), the loss's gradient
    multiplied by ``opt.loss_scale`` through ``backward(out_grads)``."""
    data, label = mx.sym.Variable("data"), mx.sym.Variable("softmax_label")
    hidden = mx.sym.Activation(mx.sym.FullyConnected(data, num_hidden=8, name="fc1"),
                               act_type="relu")
    logits = mx.sym.FullyConnected(hidden, num_hidden=CLASSES, name="fc2")
    # gluon's SoftmaxCrossEntropyLoss, per sample
    loss = -mx.sym.pick(mx.sym.log_softmax(logits), label, axis=1)
    mod = mx.mod.Module(loss, data_names=["data"], label_names=["softmax_label"])
    mod.bind(data_shapes=[("data", (B, FEATURES))], label_shapes=[("softmax_label", (B,))])
    names = ["fc1_weight", "fc1_bias", "fc2_weight", "fc2_bias"]
    mod.init_params(arg_params={n: mx.nd.array(v) for n, v in zip(names, INIT)})
    opt = dg.DistributedOptimizer(
        mx.optimizer.SGD(learning_rate=LR, momentum=0.9, rescale_grad=1.0 / B),
        compression=codec, loss_scale="dynamic" if dynamic else 1.0)
    mod.init_optimizer(kvstore=None, optimizer=opt)
    record = []
    for step in steps:
        batch = mx.io.DataBatch([mx.nd.array(X[step, rank * B:(rank + 1) * B])],
                                [mx.nd.array(Y[step, rank * B:(rank + 1) * B])])
        mod.forward(batch, is_train=True)
        mod.backward(out_grads=[mx.nd.full((B,), opt.loss_scale)])
        mod.update()
        if dynamic:
            scaler = opt._dg_dynamic.scaler
            record.append([scaler.loss_scale, scaler._next_loss_scale, opt.num_update])
    arg_params = mod.get_params()[0]
    return record, [arg_params[n].asnumpy().tolist() for n in names]


for name in ("none", "2bit"):
    scales, amp_weights = module_train(CODECS[name], range(STEPS))
    _, plain_weights = module_train(CODECS[name], [s for s in range(STEPS)
                                                   if s != OVERFLOW_STEP], dynamic=False)
    result["cases"][f"module-{name}"] = {"scales": scales, "weights": amp_weights,
                                         "plain": plain_weights}

# a checkpoint after the overflow: the restored trainer continues with the same scale
net = make_net()
trainer = amp_trainer(net, compression=CODECS["2bit"])
train(net, trainer, range(STEPS))
ckpt = dg.Checkpointer(os.path.join(out_dir, "ckpt"))
ckpt.save(net, trainer, epoch=1)
# dg.elastic.State keeps the trainer's extra_state() counters: the scaler travels in them
kept = amp_trainer(make_net(), compression=CODECS["2bit"])
kept.set_extra_counters(trainer.extra_state()[1])
result["extra_state"] = [kept._amp_loss_scaler.loss_scale,
                         kept._amp_loss_scaler._next_loss_scale]
# dg.elastic.State's commit in memory and its restore bring the scale back
state = dg.elastic.State(net=net, trainer=trainer)
state.commit()
committed = [trainer._amp_loss_scaler.loss_scale, trainer._amp_loss_scaler._next_loss_scale]
trainer._amp_loss_scaler._loss_scale = trainer._amp_loss_scaler._next_loss_scale = 1.0
state.restore()
result["elastic_state"] = {"committed": committed,
                           "restored": [trainer._amp_loss_scaler.loss_scale,
                                        trainer._amp_loss_scaler._next_loss_scale]}
restored_net = make_net()
restored = amp_trainer(restored_net, compression=CODECS["2bit"])
ckpt.restore(restored_net, restored)
result["checkpoint"] = {
    "saved": [trainer._amp_loss_scaler.loss_scale, trainer._amp_loss_scaler._next_loss_scale],
    "restored": [restored._amp_loss_scaler.loss_scale,
                 restored._amp_loss_scaler._next_loss_scale],
    "continued": train(net, trainer, [STEPS, STEPS + 1]),
    "continued_restored": train(restored_net, restored, [STEPS, STEPS + 1]),
    "weights": weights(net), "weights_restored": weights(restored_net)}

with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
    json.dump(result, f)
print(f"rank {rank} done", flush=True)
