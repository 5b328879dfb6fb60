"""Worker: training throughput of ResNet-50 or VGG-16 per trainer, on synthetic data.

Run by ``benchmarks/run_cluster.py`` on every host of an emulated cluster through
``python -m dist_gluon.launch --nnodes M ...``. One model (gluoncv ``resnet50_v1b`` or
``vgg16``, full parameter counts), one fixed random batch per worker, and one or more
trainers on its parameters (``--impls``), measured round by round: in each round every
trainer runs ``--steps`` consecutive training steps (forward, backward, gradient sum,
SGD-momentum update) timed as one block, waiting for the engine only at the block's
ends, so communication may overlap the backward pass and the next forward as in a real
training loop. The order of the trainers rotates every round.

- ``dist_gluon``: ``dg.DistributedTrainer`` on the job's backend;
- ``horovod.mxnet``: ``hvd.DistributedTrainer`` (horovod jobs);
- ``gluon``: ``gluon.Trainer(kvstore='dist_sync')`` with MXNet's defaults (ps-lite jobs;
  on the P3 van, where the launcher sets MXNET_UPDATE_ON_KVSTORE=0, MXNet's own P3);
- ``dg_fp16``, ``dg_2bit``, ``dg_powersgd``: DistributedTrainer with compression='fp16',
  '2bit' (threshold 0.5) and 'powersgd' (rank 4), each with the bytes it gives the
  backend's sums per step;
- ``gluon_2bit``: MXNet's own 2-bit compression on its dist_sync kvstore (push and pull
  per tensor, the update on the worker);
- ``compute``: the same step with no communication (``gluon.Trainer(kvstore=None)``),
  while the other workers do the same: the step time of perfect scaling on this machine.

``--slow-rank R``: rank R runs at half speed: after each forward and backward it sleeps
as long as they took (sleeping, not computing twice, so that on a machine whose cores
the workers share the slow rank does not take CPU from the others), and the payload
holds every rank's step times (``rank_times``), for the throughput of a job whose
workers need not wait for each other (dist_async).

After the timed rounds, each codec's own work (``codec_seconds``: what it computes per
step to compress and reconstruct the model's gradients, on the engine, with the sums
replaced by nothing) is timed alone, so that a reader sees which part of a compressed
step is the codec's and which the link's.

Each timed block also records the CPU time of this worker's process per step, all its
threads (``cpu_seconds``), and the share of the machine's cores busy meanwhile
(``machine_busy``, from /proc/stat): on cores shared by the emulated hosts a step can be
bound by CPU rather than by the link, and these show which.

Prints one ``BENCH {json}`` line on rank 0 (see ../_common.py).
"""
from __future__ import annotations

import argparse
import os
import time

import mxnet as mx
import numpy as np
from _common import launcher_backend, report, summarise
from mxnet import autograd, gluon

OPTIMIZER = "sgd"
OPTIMIZER_PARAMS = {"learning_rate": 0.001, "momentum": 0.9, "wd": 1e-5}
IMPLS = ("dist_gluon", "dg_fp16", "dg_2bit", "dg_powersgd", "horovod.mxnet", "gluon",
         "gluon_2bit", "compute")
COMPRESSIONS = {"dg_fp16": "fp16", "dg_2bit": {"type": "2bit", "threshold": 0.5},
                "dg_powersgd": {"type": "powersgd", "rank": 4}}
MODELS = {"resnet50": "resnet50_v1b", "vgg16": "vgg16"}


def build_model(args):
    """The network (initialised, hybridized), one input batch, labels and the loss."""
    from gluoncv.model_zoo import get_model

    mx.random.seed(0)
    rng = np.random.RandomState(0)
    net = get_model(MODELS[args.model], pretrained=False, classes=1000)
    net.initialize(mx.init.Xavier())
    net.hybridize()
    data = mx.nd.array(rng.rand(args.batch, 3, args.image, args.image))
    label = mx.nd.array(rng.randint(0, 1000, size=args.batch))
    # A recorded first forward gives deferred parameters their shapes (VGG's first Dense
    # layer takes 512 x 7 x 7 inputs at 224 x 224) and leaves the weights in plain layout,
    # which horovod.mxnet needs to read them.
    with autograd.record():
        net(data).wait_to_read()
    return net, data, label, gluon.loss.SoftmaxCrossEntropyLoss()


def machine_ticks() -> tuple[int, int]:
    """(busy, all) clock ticks of the machine's cores since boot, from /proc/stat (the
    same in every network namespace): busy is everything but idle and I/O wait, so it
    includes the kernel's network work and time the hypervisor gave to others (steal)."""
    with open("/proc/stat") as f:
        ticks = [int(x) for x in f.readline().split()[1:9]]
    idle = ticks[3] + ticks[4]
    return sum(ticks) - idle, sum(ticks)


def busy_share(before: tuple[int, int], after: tuple[int, int]) -> float:
    """The share of the machine's CPU capacity used between two :func:`machine_ticks`."""
    total = after[1] - before[1]
    return (after[0] - before[0]) / total if total else 0.0


class NoWire:
    """Stands in for the job's backend when a codec's own work is timed: the same
    workers, rank and integer carrier, and sums that send nothing."""

    def __init__(self, kv):
        self.num_workers, self.rank, self.type = kv.num_workers, kv.rank, kv.type
        self._exact_integers = getattr(kv, "_exact_integers", ("float32", 24))

    def pushpull(self, key, value, out=None, priority=0):
        pass


def codec_seconds(trainer, kv, repeats=3) -> float:
    """Seconds per step of ``trainer``'s codec compressing and reconstructing copies of
    the current gradients, with no communication (median of ``repeats``)."""
    entries = trainer._grad_entries()
    indices = [i for i, _ in entries]
    keys = [f"codec-time.{i}" for i in indices]
    grads = [g.copy() for _, g in entries]
    nowire, seconds = NoWire(kv), []
    for _ in range(repeats + 1):
        mx.nd.waitall()
        t0 = time.perf_counter()
        trainer.codec.reduce(nowire, indices, keys, grads, 0)
        mx.nd.waitall()
        seconds.append(time.perf_counter() - t0)
    return float(np.median(seconds[1:]))


def make_trainers(impls, net, batch, wire, codecs=None):
    """{impl: function running one step's update on computed gradients}, and a barrier
    over the workers. ``wire[impl]`` sums the bytes DistributedTrainers give the
    backend's sums; ``codecs[impl]`` is a function timing a compressing trainer's codec
    alone (:func:`codec_seconds`)."""
    params = net.collect_params()
    steps, barrier = {}, None
    codecs = {} if codecs is None else codecs
    dg_impls = [i for i in impls if i == "dist_gluon" or i in COMPRESSIONS]
    if dg_impls:
        import dist_gluon as dg

        kv = dg.create()
        pushpull = kv.pushpull
        counting = {"impl": None}

        def counted(key, value, out=None, priority=0):
            for v in value if isinstance(value, list) else [value]:
                impl = counting["impl"]
                wire[impl] = wire.get(impl, 0) + v.size * np.dtype(v.dtype).itemsize
            return pushpull(key, value, out=out, priority=priority)

        kv.pushpull = counted
        for impl in dg_impls:
            trainer = dg.DistributedTrainer(params, OPTIMIZER, dict(OPTIMIZER_PARAMS), kv=kv,
                                            compression=COMPRESSIONS.get(impl))

            def step(trainer=trainer, impl=impl):
                counting["impl"] = impl
                trainer.step(batch)
                counting["impl"] = None

            steps[impl] = step
            if impl in COMPRESSIONS:
                codecs[impl] = lambda trainer=trainer: codec_seconds(trainer, kv)
        barrier = kv.barrier
    if "horovod.mxnet" in impls:
        import horovod.mxnet as hvd

        hvd.init()
        hvd.broadcast_parameters(params)
        hvd_trainer = hvd.DistributedTrainer(params, OPTIMIZER, dict(OPTIMIZER_PARAMS))
        steps["horovod.mxnet"] = lambda: hvd_trainer.step(batch)
        if barrier is None:
            token = mx.nd.zeros((1,))

            def barrier():
                hvd.allreduce_(token, name="bench.barrier", op=hvd.Sum)
                token.wait_to_read()
    if "gluon" in impls:
        gluon_trainer = gluon.Trainer(params, OPTIMIZER, dict(OPTIMIZER_PARAMS),
                                      kvstore="dist_sync")
        steps["gluon"] = lambda: gluon_trainer.step(batch)

        def barrier():
            # gluon.Trainer creates its kvstore at its first step
            if gluon_trainer._kvstore is not None:
                gluon_trainer._kvstore._barrier()
    if "gluon_2bit" in impls:
        # MXNet 1.9's gluon.Trainer cannot use its own compression on dist_sync (its
        # pushpull refuses it: "Compression not supported with PushPull"), so push and
        # pull by hand, as a Module script does, and update on the worker
        kv2 = mx.kv.create("dist_sync")
        kv2.set_gradient_compression({"type": "2bit", "threshold": 0.5})
        plist = [p for p in params.values() if p.grad_req != "null"]
        for i, p in enumerate(plist):
            kv2.init(i, mx.nd.zeros(p.shape))
        local_2bit = gluon.Trainer(params, OPTIMIZER, dict(OPTIMIZER_PARAMS), kvstore=None)

        def step_2bit():
            for i, p in enumerate(plist):
                kv2.push(i, p.grad(), priority=-i)
                kv2.pull(i, out=p.grad(), priority=-i)
            local_2bit.step(batch * kv2.num_workers)

        steps["gluon_2bit"] = step_2bit

        def barrier():
            kv2._barrier()
    if "compute" in impls:
        local = gluon.Trainer(params, OPTIMIZER, dict(OPTIMIZER_PARAMS), kvstore=None)
        steps["compute"] = lambda: local.step(batch)
    return steps, barrier or (lambda: None)


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=tuple(MODELS), required=True)
    parser.add_argument("--impls", required=True,
                        help="comma-separated, from: " + ", ".join(IMPLS) + "; the first "
                             "one that communicates should come first (its first step "
                             "creates gluon's kvstore)")
    parser.add_argument("--batch", type=int, default=16, help="batch size per worker")
    parser.add_argument("--image", type=int, default=112, help="input height and width")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per trainer")
    parser.add_argument("--first-warmup", type=int, default=0,
                        help="untimed steps of the first trainer, if more than --warmup: "
                             "horovod's cycle time is tuned on the job's first steps "
                             "(dist_gluon/backends/horovod_tuning.py), which should end "
                             "before the timed rounds")
    parser.add_argument("--steps", type=int, default=3, help="steps per timed block")
    parser.add_argument("--rounds", type=int, default=2, help="timed blocks per trainer")
    parser.add_argument("--slow-rank", type=int, default=None,
                        help="this rank runs at half speed (it sleeps as long as each "
                             "forward and backward took); report every rank's step times")
    args = parser.parse_args()
    args.impls = args.impls.split(",")
    unknown = set(args.impls) - set(IMPLS)
    if unknown:
        parser.error(f"unknown --impls {sorted(unknown)}; choose from {IMPLS}")
    return args


def main():
    args = parse_args()
    started = time.perf_counter()
    net, data, label, loss_fn = build_model(args)
    wire, codecs = {}, {}
    steps, barrier = make_trainers(args.impls, net, args.batch, wire, codecs)
    setup_seconds = time.perf_counter() - started

    slow = args.slow_rank is not None and \
        int(os.environ.get("DG_RANK", "0")) == args.slow_rank

    def block(impl, count):
        """Seconds, this process's CPU seconds per step of ``count`` consecutive steps of
        ``impl``, and the machine's busy share meanwhile."""
        mx.nd.waitall()
        t0, cpu0, machine0 = time.perf_counter(), time.process_time(), machine_ticks()
        for _ in range(count):
            computed = time.perf_counter()
            with autograd.record():
                loss = loss_fn(net(data), label)
            loss.backward()
            if slow:
                mx.nd.waitall()
                time.sleep(time.perf_counter() - computed)
            steps[impl]()
        mx.nd.waitall()
        return ((time.perf_counter() - t0) / count, (time.process_time() - cpu0) / count,
                busy_share(machine0, machine_ticks()))

    warmups = {impl: args.warmup for impl in args.impls}
    warmups[args.impls[0]] = max(args.warmup, args.first_warmup)
    for impl in args.impls:
        block(impl, warmups[impl])
        barrier()
    wire_per_step = {impl: wire.get(impl, 0) / max(warmups[impl], 1) for impl in wire if impl}
    # impl -> (seconds, CPU seconds, busy share) of each round's block
    blocks = {impl: [] for impl in args.impls}
    for r in range(args.rounds):
        shift = r % len(args.impls)
        for impl in args.impls[shift:] + args.impls[:shift]:
            barrier()
            blocks[impl].append(block(impl, args.steps))
    # each codec alone, on the last step's gradients (the residuals it changes are not
    # used again)
    codec_times = {impl: time_codec() for impl, time_codec in codecs.items()}
    params = [p for p in net.collect_params().values() if p.grad_req != "null"]
    # the medians and quartiles of each column of the blocks, per impl
    summaries = {what: {impl: summarise([b[column] for b in found])
                        for impl, found in blocks.items()}
                 for column, what in enumerate(("times", "cpu_seconds", "machine_busy"))}
    rank_times = None
    if args.slow_rank is not None:
        import dist_gluon as dg

        rank_times = dg.create().allgather_object(summaries["times"])
    report({"kind": "train", "backend": launcher_backend(), "model": args.model,
            "rank_times": rank_times, "slow_rank": args.slow_rank,
            "batch": args.batch, "image": args.image, "tensors": len(params),
            "parameters": int(sum(p.data().size for p in params)),
            "gradient_bytes": int(sum(p.data().size * 4 for p in params)),
            "setup_seconds": setup_seconds, "wire_bytes": wire_per_step,
            "codec_seconds": codec_times,
            **summaries})


if __name__ == "__main__":
    main()
