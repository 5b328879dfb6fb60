"""Worker script of tests/test_sparse.py: a small language-model-shaped network whose
embedding has row_sparse gradients (sparse_grad=True), trained through
DistributedTrainer with SGD + momentum and lazy Adam, and through DistributedOptimizer;
saves every rank's weights.

    python sparse_cases.py OUT_DIR WORLD

Run as one plain process it is the single-process reference on the concatenation of the
WORLD workers' batches.
"""
import json
import os
import sys

import mxnet as mx
import numpy as np
from mxnet import autograd, gluon

import dist_gluon as dg

out_dir, world = sys.argv[1], int(sys.argv[2])
os.makedirs(out_dir, exist_ok=True)
kv = dg.create()
N, rank = kv.num_workers, kv.rank
B, STEPS, SEQ, DIM, CLASSES = 4, 4, 5, 6, 3
VOCAB = 400
rng = np.random.RandomState(0)
# words from a small part of the vocabulary, so most rows are never touched
TOKENS = rng.randint(0, 60, (STEPS, world * B, SEQ)).astype("float32")
LABELS = rng.randint(0, CLASSES, (STEPS, world * B)).astype("float32")
loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()


def shard(step):
    share = world * B // N
    lo = rank * share
    return mx.nd.array(TOKENS[step, lo:lo + share]), mx.nd.array(LABELS[step, lo:lo + share])


def make_net(vocab=VOCAB):
    net = gluon.nn.HybridSequential()
    net.add(gluon.nn.Embedding(vocab, DIM, sparse_grad=True), gluon.nn.Flatten(),
            gluon.nn.Dense(CLASSES, in_units=SEQ * DIM))
    mx.random.seed(7 + rank)          # rank 0's weights must win
    net.initialize(mx.init.Uniform(0.5))
    return net


def save(case, net):
    arrays = {str(i): p.data().asnumpy() for i, p in enumerate(net.collect_params().values())}
    np.savez(os.path.join(out_dir, f"{case}_rank{rank}.npz"), **arrays)


def train(net, trainer, steps):
    for step in steps:
        x, y = shard(step)
        with autograd.record():
            loss = loss_fn(net(x), y)
        loss.backward()
        assert net[0].weight.grad().stype == "row_sparse"
        trainer.step(x.shape[0])


OPTIMIZERS = {"sgd": ("sgd", {"learning_rate": 0.5, "momentum": 0.9, "wd": 1e-3}),
              "lazy_adam": ("adam", {"learning_rate": 0.05, "lazy_update": True})}
for case, (name, params) in OPTIMIZERS.items():
    net = make_net()
    trainer = dg.DistributedTrainer(net.collect_params(), name, dict(params), prefix=case)
    train(net, trainer, range(STEPS))
    save(case, net)

# mixed with compression: the dense layer is compressed, the embedding is not
net = make_net()
trainer = dg.DistributedTrainer(net.collect_params(), "sgd", dict(OPTIMIZERS["sgd"][1]),
                                compression="fp16", prefix="fp16")
train(net, trainer, range(STEPS))
save("sgd_fp16", net)

# resume: 2 steps, checkpoint, 2 steps == restore into a new trainer, 2 steps
net = make_net()
trainer = dg.DistributedTrainer(net.collect_params(), "adam", dict(OPTIMIZERS["lazy_adam"][1]),
                                prefix="whole")
ckpt = dg.Checkpointer(os.path.join(out_dir, "ckpt"))
train(net, trainer, range(2))
ckpt.save(net, trainer, epoch=0, step=2)
train(net, trainer, range(2, STEPS))
save("whole", net)
net = make_net()
trainer = dg.DistributedTrainer(net.collect_params(), "adam", dict(OPTIMIZERS["lazy_adam"][1]),
                                prefix="resumed")
ckpt.restore(net, trainer)
train(net, trainer, range(2, STEPS))
save("resumed", net)

# what travels: the same words in a vocabulary of 400 and of 400,000 rows
sent = {}
for vocab in (VOCAB, 400000):
    count = [0]
    pushpull = kv.pushpull

    def counting(key, value, out=None, priority=0, count=count, pushpull=pushpull):
        if ".sparse" in str(key):
            count[0] += sum(v.size for v in (value if isinstance(value, list) else [value]))
        return pushpull(key, value, out=out, priority=priority)

    kv.pushpull = counting
    net = make_net(vocab)
    trainer = dg.DistributedTrainer(net.collect_params(), "sgd", {"learning_rate": 0.1},
                                    prefix=f"vocab{vocab}")
    train(net, trainer, range(1))
    kv.pushpull = pushpull
    sent[vocab] = count[0]
if rank == 0:
    with open(os.path.join(out_dir, "sent.json"), "w") as f:
        share = world * B // N
        largest = max(len(np.unique(TOKENS[0, r * share:(r + 1) * share])) for r in range(N))
        json.dump({"sent": sent, "rows": int(len(np.unique(TOKENS[0]))),
                   "largest": int(largest), "workers": N}, f)

# the Module API: a symbol with a sparse-gradient embedding, DistributedOptimizer
data = mx.sym.Variable("data")
sym = mx.sym.Embedding(data, input_dim=VOCAB, output_dim=DIM, sparse_grad=True, name="emb")
sym = mx.sym.FullyConnected(mx.sym.flatten(sym), num_hidden=CLASSES, name="fc")
sym = mx.sym.SoftmaxOutput(sym, name="softmax")
share = world * B // N
mod = mx.mod.Module(sym, context=mx.cpu())
mod.bind(data_shapes=[("data", (share, SEQ))], label_shapes=[("softmax_label", (share,))])
init = np.random.RandomState(3)
mod.init_params(arg_params={
    "emb_weight": mx.nd.array(init.uniform(-0.5, 0.5, (VOCAB, DIM))),
    "fc_weight": mx.nd.array(init.uniform(-0.5, 0.5, (CLASSES, SEQ * DIM))),
    "fc_bias": mx.nd.zeros((CLASSES,))})
mod.init_optimizer(kvstore=None, optimizer=dg.DistributedOptimizer(
    "sgd", learning_rate=0.5, momentum=0.9, prefix="module"))
for step in range(STEPS):
    x, y = shard(step)
    mod.forward_backward(mx.io.DataBatch([x], [y]))
    mod.update()
arg_params, _ = mod.get_params()
np.savez(os.path.join(out_dir, f"module_rank{rank}.npz"),
         **{str(i): arg_params[n].asnumpy() for i, n in enumerate(
             ["emb_weight", "fc_weight", "fc_bias"])})
print("sparse cases done", flush=True)
