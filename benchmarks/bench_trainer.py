"""Worker: time one training step (forward, backward, gradient sum, update) per trainer.

Run by ``run.py`` through ``python -m dist_gluon.launch -n 2 --backend B``. One model,
one or more trainers on its parameters (``--impls``), measured round by round (each
trainer runs ``--steps`` timed steps per round, in an order rotated every round) so that
load from other processes hits all alike:

- ``dist_gluon``: ``dg.DistributedTrainer`` on the job's backend;
- ``horovod.mxnet``: ``hvd.DistributedTrainer`` (horovod jobs only);
- ``raw``: ``gluon.Trainer(kvstore=None)`` after a hand-written loop of raw collectives,
  one per gradient with priority -i (``hvd.allreduce_`` or MXNet's ``kv.pushpull``):
  the floor the distributed trainers should reach;
- ``compute``: the same step without any communication (each worker alone);
- ``gluon``: ``gluon.Trainer(kvstore='dist_sync')`` with MXNet's defaults (ps-lite jobs,
  with only ``compute`` beside it: MXNet cannot start a second ps-lite store in a
  process).
  With the plain van it updates on the servers; with the P3 van (which the launcher
  starts with MXNET_UPDATE_ON_KVSTORE=0) it updates on the workers, i.e. MXNet's own P3.
"""
from __future__ import annotations

import argparse

import mxnet as mx
import numpy as np
from _common import Clock, launcher_backend, report, summarise
from mxnet import autograd, gluon
from mxnet.gluon import nn

OPTIMIZER = "sgd"
OPTIMIZER_PARAMS = {"learning_rate": 0.001, "momentum": 0.9, "wd": 1e-5}
IMPLS = ("dist_gluon", "horovod.mxnet", "raw", "compute", "gluon")


def build_model(args):
    """The network, one input batch, labels and the loss."""
    mx.random.seed(0)
    rng = np.random.RandomState(0)
    if args.model == "resnet18":
        from gluoncv.model_zoo import get_model
        net = get_model("resnet18_v1b", pretrained=False, classes=1000)
        data = rng.rand(args.batch, 3, args.image, args.image)
        label = rng.randint(0, 1000, size=args.batch)
        loss = gluon.loss.SoftmaxCrossEntropyLoss()
    else:
        net = nn.HybridSequential()
        for layer in range(args.mlp_layers):
            last = layer == args.mlp_layers - 1
            net.add(nn.Dense(args.mlp_width, in_units=args.mlp_width,
                             activation=None if last else "relu"))
        data = rng.rand(args.batch, args.mlp_width)
        label = rng.rand(args.batch, args.mlp_width)
        loss = gluon.loss.L2Loss()
    net.initialize(mx.init.Xavier())
    net.hybridize()
    data, label = mx.nd.array(data), mx.nd.array(label)
    # A first forward gives deferred parameters their shapes. Recorded (training mode):
    # an inference forward leaves conv weights in MKLDNN layout, which Horovod's
    # collectives reject ("can't generate TBlob for MKLDNN data"), raw horovod.mxnet too.
    with autograd.record():
        net(data).wait_to_read()
    return net, data, label, loss


class RawCollectives:
    """One raw sum per gradient, in parameter order with priority -i."""

    def __init__(self, backend_name, grads, dg_backend):
        self.grads = grads
        if backend_name == "horovod":
            import horovod.mxnet as hvd
            self.hvd = hvd
            self.reduce = self._horovod
        else:
            self.kv = dg_backend._kv      # MXNet's own mx.kv.create('dist_sync') store
            self.keys = [f"raw.{i}" for i in range(len(grads))]
            self.kv.init(self.keys, [mx.nd.zeros(g.shape, dtype=g.dtype) for g in grads])
            self.reduce = self._kvstore

    def _horovod(self):
        for i, grad in enumerate(self.grads):
            self.hvd.allreduce_(grad, name=f"raw.{i}", priority=-i, op=self.hvd.Sum)

    def _kvstore(self):
        for i, (key, grad) in enumerate(zip(self.keys, self.grads)):
            self.kv.pushpull(key, grad, out=grad, priority=-i)


def make_steps(impls, net, batch, backend_name):
    """{impl: function running one step on already computed gradients}, and a barrier.
    ``compute`` creates no store, so it can share a job with ``gluon``."""
    params = net.collect_params()
    trainable = [p for p in params.values() if p.grad_req != "null"]
    steps, kv = {}, None
    if "dist_gluon" in impls or "raw" in impls:
        import dist_gluon as dg
        kv = dg.create()
    if "dist_gluon" in impls:
        import dist_gluon as dg
        trainer = dg.DistributedTrainer(params, OPTIMIZER, dict(OPTIMIZER_PARAMS), kv=kv)
        steps["dist_gluon"] = lambda: trainer.step(batch)
    if "horovod.mxnet" in impls:
        import horovod.mxnet as hvd
        hvd_trainer = hvd.DistributedTrainer(params, OPTIMIZER, dict(OPTIMIZER_PARAMS))
        hvd.broadcast_parameters(params)
        steps["horovod.mxnet"] = lambda: hvd_trainer.step(batch)
    if "raw" in impls or "compute" in impls:
        local = gluon.Trainer(params, OPTIMIZER, dict(OPTIMIZER_PARAMS), kvstore=None)
        if "raw" in impls:
            raw = RawCollectives(backend_name, [p.grad() for p in trainable], kv)
            workers = kv.num_workers

            def raw_step():
                raw.reduce()
                local.update(batch * workers)
            steps["raw"] = raw_step
        if "compute" in impls:
            steps["compute"] = lambda: local.update(batch)
    barrier = kv.barrier if kv is not None else (lambda: None)
    if "gluon" in impls:
        gluon_trainer = gluon.Trainer(params, OPTIMIZER, dict(OPTIMIZER_PARAMS),
                                      kvstore="dist_sync")
        steps["gluon"] = lambda: gluon_trainer.step(batch)

        def barrier():
            # the trainer creates its kvstore at its first step
            if gluon_trainer._kvstore is not None:
                gluon_trainer._kvstore._barrier()
    return steps, barrier


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("resnet18", "mlp"), required=True)
    parser.add_argument("--impls", required=True,
                        help="comma-separated, from: " + ", ".join(IMPLS))
    parser.add_argument("--batch", type=int, default=8, help="batch size per worker")
    parser.add_argument("--image", type=int, default=64, help="ResNet input height/width")
    parser.add_argument("--mlp-width", type=int, default=4096)
    parser.add_argument("--mlp-layers", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per trainer")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per round")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    args.impls = args.impls.split(",")
    unknown = set(args.impls) - set(IMPLS)
    if unknown:
        parser.error(f"unknown --impls {sorted(unknown)}; choose from {IMPLS}")
    return args


def main():
    args = parse_args()
    backend_name = launcher_backend()
    net, data, label, loss_fn = build_model(args)
    steps, barrier = make_steps(args.impls, net, args.batch, backend_name)

    def forward_backward():
        with autograd.record():
            loss = loss_fn(net(data), label)
        loss.backward()

    def one_step(impl):
        with Clock(mx) as clock:
            forward_backward()
            steps[impl]()
        return clock.seconds

    for impl in args.impls:
        barrier()
        for _ in range(args.warmup):
            one_step(impl)
    times = {impl: [] for impl in args.impls}
    for r in range(args.rounds):
        # rotate the order every round, so that no trainer always follows the same one
        shift = r % len(args.impls)
        for impl in args.impls[shift:] + args.impls[:shift]:
            barrier()
            times[impl].extend(one_step(impl) for _ in range(args.steps))

    params = [p for p in net.collect_params().values() if p.grad_req != "null"]
    report({"kind": "trainer", "backend": backend_name, "model": args.model,
            "batch": args.batch, "tensors": len(params),
            "parameters": int(sum(p.data().size for p in params)),
            "times": {impl: summarise(t) for impl, t in times.items()}})


if __name__ == "__main__":
    main()
