"""What dg.elastic.State.commit() costs per step, beside a ResNet-50 training step.

One process (no launcher: the commit's one-number sum over the workers, the same as
dg.stop_requested()'s, is not part of it). Rounds alternate, so that load from other
processes hits both alike: ``--steps`` training steps without a commit, then as many
with a commit after each (each step waited for with ``mx.nd.waitall()``); then
``--commits`` commits alone, each waited for (the copies of the weights and of the
optimizer's states into the preallocated arrays). Prints one JSON line.

With ``--node-copy`` the state commits as on ps-lite: its copies live in the node's
shared memory (dist_gluon/elastic/nodecopy.py, a fresh 0700 directory in /dev/shm,
removed at the end), and each commit also renames in the copy's ``meta``.

    python benchmarks/bench_elastic_commit.py [--batch-size 32] [--image-size 224]
        [--node-copy]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time

import mxnet as mx
from mxnet import autograd, gluon

import dist_gluon as dg
from dist_gluon.elastic.nodecopy import NodeCopy


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch-size", type=int, default=32, help="samples per step")
    parser.add_argument("--image-size", type=int, default=224, help="input height/width")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per round and kind")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of both kinds")
    parser.add_argument("--commits", type=int, default=20, help="commits timed alone")
    parser.add_argument("--node-copy", action="store_true",
                        help="commit to a node copy in shared memory, as on ps-lite")
    args = parser.parse_args()
    directory = tempfile.mkdtemp(prefix="dg-bench-state-", dir="/dev/shm") \
        if args.node_copy else None
    try:
        run(args, directory)
    finally:
        if directory is not None:
            shutil.rmtree(directory, ignore_errors=True)


def run(args, directory):
    """Time the steps and commits; ``directory``: the node copy's, or None."""
    mx.random.seed(0)
    net = gluon.model_zoo.vision.resnet50_v1(classes=1000)
    net.initialize(mx.init.Xavier())
    net.hybridize(static_alloc=True, static_shape=True)
    trainer = dg.DistributedTrainer(net.collect_params(), "sgd",
                                    {"learning_rate": 0.01, "momentum": 0.9, "wd": 1e-4},
                                    kv="local")
    state = dg.elastic.State(net=net, trainer=trainer, epoch=0, done=0)
    if directory is not None:
        state._use_node_copy(NodeCopy(directory, "bench", writer=True))
        state.sync()
    data = mx.nd.random.uniform(shape=(args.batch_size, 3, args.image_size, args.image_size))
    label = mx.nd.array([i % 1000 for i in range(args.batch_size)])
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()

    def step(commit: bool) -> float:
        start = time.perf_counter()
        with autograd.record():
            loss = loss_fn(net(data), label)
        loss.backward()
        trainer.step(args.batch_size)
        if commit:
            state.done += args.batch_size
            state.commit()
        mx.nd.waitall()
        return time.perf_counter() - start

    for _ in range(2):                      # warm-up: graphs, optimizer states, copies
        step(True)
    plain, committed = [], []
    for _ in range(args.rounds):
        plain += [step(False) for _ in range(args.steps)]
        committed += [step(True) for _ in range(args.steps)]
    alone = []
    for _ in range(args.commits):
        start = time.perf_counter()
        state.commit()
        mx.nd.waitall()
        alone.append(time.perf_counter() - start)
    kept = sum(a.size * 4 for a in net.collect_params().values() for a in [a.data()])
    step_s, commit_s = statistics.median(plain), statistics.median(alone)
    print(json.dumps({
        "batch_size": args.batch_size, "image_size": args.image_size,
        "node_copy": directory is not None,
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "step_s": round(step_s, 4), "step_with_commit_s": round(statistics.median(committed), 4),
        "commit_alone_ms": round(commit_s * 1e3, 2),
        "commit_share_of_step": round(commit_s / step_s, 5),
        "weights_mb": round(kept / 2**20, 1),
        "steps": {"plain": [round(t, 3) for t in plain],
                  "committed": [round(t, 3) for t in committed]}}))


if __name__ == "__main__":
    main()
