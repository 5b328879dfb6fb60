"""Worker script of tests/test_matrix.py: trains each row of the combination matrix
(tests/matrix_plan.py) in turn, each with a fresh model and trainer under its own prefix.

    matrix_cases.py OUT PLAN train    as the launcher's workers: every row of PLAN (a JSON
                                      list of [name, row]); rank r's weights in
                                      OUT/<name>_rank<r>.npz; a row with fault=restart
                                      also saves a checkpoint after step HALF in
                                      OUT/ckpt_<name>
    matrix_cases.py OUT PLAN replay   one process: every row replayed on the global batch
                                      with a plain gluon.Trainer (Local SGD: its workers
                                      simulated apart, averaged in NumPy) in
                                      OUT/<name>_replay.npz; a fault=restart row's
                                      checkpoint restored onto this one process and
                                      trained to the end in OUT/<name>_restored.npz

Each worker trains on its share of every step's global batch of WORLD * B samples
(on two devices: half of its share on each); the replay on all of it. Every run starts
from the same weights, drawn with NumPy from a fixed seed. With ``amp=overflow`` the loss
of the global batch's second half (rank 1's share) is infinite at step OVERFLOW: every
rank must skip that step and halve the loss scale, as one process does.
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

OUT, PLAN, MODE = sys.argv[1], sys.argv[2], sys.argv[3]
WORLD, B, STEPS, HALF, OVERFLOW, H = 2, 4, 4, 2, 1, 2
FEATURES, HIDDEN, CLASSES, VOCAB = 6, 8, 3, 10
G = WORLD * B                  # the global batch of one micro-batch
SGD = {"learning_rate": 0.1, "momentum": 0.9, "wd": 1e-3}
CODECS = {
    "none": None,
    "fp16": "fp16",
    "2bit": {"type": "2bit", "threshold": 0.5},     # MXNet's default
    # rank 1: every matrix here is compressed (rank 4 would send these small matrices
    # whole, min_compression_rate=2)
    "powersgd": {"type": "powersgd", "rank": 1},
    # min_compress_bytes=0: BytePS sends tensors under 64 KiB uncompressed
    "topk": {"type": "topk", "k": 0.5, "ef": "vanilla", "min_compress_bytes": 0},
}
rng = np.random.RandomState(0)
X = rng.randn(STEPS, 2, G, FEATURES).astype("float32")
T = rng.randint(0, VOCAB, (STEPS, 2, G)).astype("float32")
Y = rng.randint(0, CLASSES, (STEPS, 2, G)).astype("float32")
loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()


class Net(gluon.Block):
    """Dense -> (+ a row_sparse Embedding) -> (SyncBatchNorm) -> relu -> Dense."""

    def __init__(self, row, kv):
        super().__init__()
        with self.name_scope():
            self.dense1 = gluon.nn.Dense(HIDDEN, in_units=FEATURES)
            self.emb = (gluon.nn.Embedding(VOCAB, HIDDEN, sparse_grad=True)
                        if row["sparse"] != "off" else None)
            self.bn = (dg.SyncBatchNorm(in_channels=HIDDEN, kv=kv)
                       if row["syncbn"] != "off" else None)
            self.dense2 = gluon.nn.Dense(CLASSES, in_units=HIDDEN)

    def forward(self, x, t):
        h = self.dense1(x)
        if self.emb is not None:
            h = h + self.emb(t)
        if self.bn is not None:
            h = self.bn(h)
        return self.dense2(mx.nd.relu(h))


def initial(shape, index):
    return np.random.RandomState(1000 + index).randn(*shape).astype("float32") * 0.3


def make_net(row, kv, ctxs):
    net = Net(row, kv)
    net.initialize(ctx=ctxs)
    for index, p in enumerate(net.collect_params().values()):
        if p.grad_req != "null":
            value = initial(p.shape, index) + (1.0 if p.name.endswith("gamma") else 0.0)
            p.set_data(mx.nd.array(value))
    if row["accumulate"] != "off":
        net.collect_params().setattr("grad_req", "add")
    return net


def make_trainer(name, row, net, kv):
    params = net.collect_params()
    if row["path"] == "compat_hvd":
        compression = hvd.Compression.fp16 if row["codec"] == "fp16" else hvd.Compression.none
        return hvd.DistributedTrainer(params, "sgd", dict(SGD), compression=compression,
                                      prefix=name)
    return dg.DistributedTrainer(
        params, "sgd", dict(SGD), kv=kv, compression=CODECS[row["codec"]], prefix=name,
        sync_every=H if row["local_sgd"] != "off" else 1,
        shard_optimizer_states=row["shard"] != "off")


def shares(step, micro, lo, count, ctxs):
    """Samples [lo, lo + count) of a micro-batch, split evenly over ``ctxs``: (x, t, y,
    loss factor) per device."""
    per = count // len(ctxs)
    parts = []
    for d, ctx in enumerate(ctxs):
        rows = slice(lo + d * per, lo + (d + 1) * per)
        factor = np.ones(per, dtype="float32")
        parts.append(tuple(mx.nd.array(a, ctx=ctx) for a in (
            X[step, micro, rows], T[step, micro, rows], Y[step, micro, rows], factor)))
    return parts


def overflow_factors(parts, step, lo, row):
    """With amp=overflow, the loss of the global batch's second half is infinite at step
    OVERFLOW."""
    if row["amp"] == "off" or step != OVERFLOW:
        return
    per = parts[0][3].shape[0]
    for d, part in enumerate(parts):
        first = lo + d * per
        values = [np.inf if first + i >= G // 2 else 1.0 for i in range(per)]
        part[3][:] = mx.nd.array(values, ctx=part[3].context)


def train_steps(net, trainer, row, steps, lo, count, ctxs, after_step=None, last=None):
    """Steps ``steps`` of the row's loop on samples [lo, lo + count) of every micro-batch
    (``last``: another (lo, count) for the final step, the replay of uneven=join)."""
    micros = 2 if row["accumulate"] != "off" else 1
    whole = (lo, count)
    for step in steps:
        lo, count = last if last is not None and step == STEPS - 1 else whole
        for micro in range(micros):
            parts = shares(step, micro, lo, count, ctxs)
            overflow_factors(parts, step, lo, row)
            with autograd.record():
                losses = [loss_fn(net(x, t), y) * f for x, t, y, f in parts]
                if row["amp"] != "off":
                    with amp.scale_loss(losses, trainer) as scaled:
                        losses = scaled
            autograd.backward(losses)
        if row["path"] == "allreduce_update":
            trainer.allreduce_grads()
            trainer.update(count * micros)
        else:
            trainer.step(count * micros)
        if micros > 1:
            net.collect_params().zero_grad()
        if after_step is not None:
            after_step(step)


def weights(net, trainer=None):
    """Every parameter on every device (``i`` on the first, ``i@d`` on device d), and the
    loss scale under ``scale``."""
    arrays = {}
    for i, p in enumerate(net.collect_params().values()):
        for d, value in enumerate(p.list_data()):
            arrays[str(i) if d == 0 else f"{i}@{d}"] = value.asnumpy()
    scaler = getattr(trainer, "_amp_loss_scaler", None)
    if scaler is not None:
        arrays["scale"] = np.float64(scaler.loss_scale)
    return arrays


# ---- the Module path: the same two Dense layers as a symbol, DistributedOptimizer ----

def module_run(name, row, kv, lo, count, optimizer):
    data = mx.sym.Variable("data")
    sym = mx.sym.FullyConnected(data, num_hidden=HIDDEN, name="fc1")
    sym = mx.sym.Activation(sym, act_type="relu")
    sym = mx.sym.FullyConnected(sym, num_hidden=CLASSES, name="fc2")
    sym = mx.sym.SoftmaxOutput(sym, name="softmax")
    mod = mx.mod.Module(sym, context=mx.cpu())
    mod.bind(data_shapes=[("data", (count, FEATURES))],
             label_shapes=[("softmax_label", (count,))])
    # the Gluon net's parameter order (dense1 weight, bias, dense2 weight, bias)
    names = ["fc1_weight", "fc1_bias", "fc2_weight", "fc2_bias"]
    shapes = [(HIDDEN, FEATURES), (HIDDEN,), (CLASSES, HIDDEN), (CLASSES,)]
    gluon_index = [0, 1, 2, 3]
    mod.init_params(arg_params={n: mx.nd.array(initial(s, i))
                                for n, s, i in zip(names, shapes, gluon_index)},
                    allow_missing=False)
    mod.init_optimizer(kvstore=None, optimizer=optimizer)
    if kv is None:      # the replay: the weights it starts from
        np.savez(os.path.join(OUT, f"{name}_start.npz"),
                 **{str(i): mx.nd.array(initial(s, i)).asnumpy() for i, s in enumerate(shapes)})
    for step in range(STEPS):
        batch = mx.io.DataBatch([mx.nd.array(X[step, 0, lo:lo + count])],
                                [mx.nd.array(Y[step, 0, lo:lo + count])])
        mod.forward_backward(batch)
        mod.update()
    arg_params, _ = mod.get_params()
    return {str(i): arg_params[n].asnumpy() for i, n in enumerate(names)}


def module_optimizer(name, row, kv, count):
    return dg.DistributedOptimizer(
        mx.optimizer.SGD(rescale_grad=1.0 / count, **SGD), kv=kv,
        compression=CODECS[row["codec"]], prefix=name)


# ---- the modes ----

def ctx_list(row):
    return [mx.cpu(d) for d in range(row["devices"])]


def train(name, row, kv):
    share, lo = G // kv.num_workers, kv.rank * (G // kv.num_workers)
    if row["path"] == "module":
        return module_run(name, row, kv, lo, share, module_optimizer(name, row, kv, share)), None
    ctxs = ctx_list(row)
    net = make_net(row, kv, ctxs)
    trainer = make_trainer(name, row, net, kv)
    if row["amp"] != "off":
        amp.init_trainer(trainer)
    after = None
    if row["fault"] == "restart":
        ckpt = dg.Checkpointer(os.path.join(OUT, f"ckpt_{name}"), kv=kv)

        def after(step):
            if step == HALF - 1:
                ckpt.save(net, trainer, epoch=0, step=HALF)
    if row["uneven"] == "off":
        train_steps(net, trainer, row, range(STEPS), lo, share, ctxs, after)
    else:
        # rank 1 runs out of batches one step early; dg.Join shadows rank 0's last step
        with dg.Join(trainer):
            train_steps(net, trainer, row, range(STEPS - (kv.rank == 1)), lo, share, ctxs,
                        after)
    return weights(net, trainer), trainer


def present(row):
    """The replay's final step: only rank 0's samples with uneven=join, else None."""
    return (0, B) if row["uneven"] != "off" else None


def replay(name, row):
    """The row on one process: plain gluon.Trainers, no communication."""
    if row["path"] == "module":
        opt = mx.optimizer.SGD(rescale_grad=1.0 / G, **SGD)
        return module_run(name, row, None, 0, G, opt)
    ctx = [mx.cpu(0)]
    np.savez(os.path.join(OUT, f"{name}_start.npz"), **weights(make_net(row, None, ctx)))
    if row["local_sgd"] == "off":
        net = make_net(row, None, ctx)
        trainer = gluon.Trainer(net.collect_params(), "sgd", dict(SGD), kvstore=None)
        if row["amp"] != "off":
            amp.init_trainer(trainer)
        train_steps(net, trainer, row, range(STEPS), 0, G, ctx, last=present(row))
        return weights(net, trainer)
    # Local SGD: each simulated worker steps alone on its share; the weights are
    # averaged after every H steps
    nets = [make_net(row, None, ctx) for _ in range(WORLD)]
    trainers = [gluon.Trainer(n.collect_params(), "sgd", dict(SGD), kvstore=None)
                for n in nets]
    for trainer in trainers if row["amp"] != "off" else ():
        amp.init_trainer(trainer)
    for step in range(STEPS):
        for r, (net, trainer) in enumerate(zip(nets, trainers)):
            train_steps(net, trainer, row, [step], r * B, B, ctx)
        if (step + 1) % H == 0:
            params = [list(n.collect_params().values()) for n in nets]
            for group in zip(*params):
                mean = np.mean([p.data().asnumpy() for p in group], axis=0)
                for p in group:
                    p.set_data(mx.nd.array(mean))
    arrays = weights(nets[0])
    if row["amp"] != "off":     # each worker scales its own loss (rank 1's overflowed)
        arrays.update({f"scale{r}": np.float64(t._amp_loss_scaler.loss_scale)
                       for r, t in enumerate(trainers)})
    return arrays


def restored(name, row, kv):
    """A restart row's mid-run checkpoint restored onto this one process, trained on the
    whole global batch to the end."""
    ctx = [mx.cpu(0)]
    net = make_net(row, kv, ctx)
    trainer = make_trainer(name, row, net, kv)
    if row["amp"] != "off":
        amp.init_trainer(trainer)
    meta = dg.Checkpointer(os.path.join(OUT, f"ckpt_{name}"), kv=kv).restore(net, trainer)
    assert meta is not None and meta["step"] == HALF, meta
    train_steps(net, trainer, row, range(HALF, STEPS), 0, G, ctx, last=present(row))
    return weights(net, trainer)


def main():
    with open(PLAN) as f:
        plan = json.load(f)
    if any(row["amp"] != "off" for _, row in plan):
        # AMP's dynamic loss scaling without AMP's casts: no operator runs in float16,
        # so the scaled runs stay comparable to float32 ones (a power-of-two scale and
        # its division are exact). It patches MXNet's operators for the whole process:
        # the launched jobs are grouped by this axis (tests/matrix_plan.py).
        amp.init(target_dtype="float16", target_precision_ops=[], conditional_fp32_ops=[],
                 fp32_ops=[])
    kv = dg.create()
    hvd.init()
    for name, row in plan:
        print(f"case {name} {MODE}", flush=True)
        if MODE == "train":
            arrays, _ = train(name, row, kv)
            np.savez(os.path.join(OUT, f"{name}_rank{kv.rank}.npz"), **arrays)
        else:
            np.savez(os.path.join(OUT, f"{name}_replay.npz"), **replay(name, row))
            if row["fault"] == "restart":
                np.savez(os.path.join(OUT, f"{name}_restored.npz"), **restored(name, row, kv))
    print("matrix done", flush=True)


main()
