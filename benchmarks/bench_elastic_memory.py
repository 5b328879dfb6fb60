"""How long a ResNet-50 job whose workers keep their processes takes to go on after a
host is killed: 3 emulated hosts (links of ``--rate``), one launcher and one worker each,
``--nnodes 2:3``, horovod over Gloo; the worker (this file, ``worker`` mode) commits a
``dg.elastic.State`` after every step. Host 2's processes are SIGKILLed after
``--steps`` steps; the survivors' rank 0 writes when ``train`` is entered again (the
re-formation, restore and sync done) and when its first step ends. Then host 2 is
started again and the time its new worker takes to heal and train is written too.
Prints one JSON line. Needs root (network namespaces).

    python benchmarks/bench_elastic_memory.py [--batch-size 8] [--image-size 112]
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def worker(directory: str, batch_size: int, image_size: int) -> None:
    import mxnet as mx
    from mxnet import autograd, gluon

    import dist_gluon as dg

    kv = dg.create()
    mx.random.seed(0)
    net = gluon.model_zoo.vision.resnet50_v1(classes=1000)
    net.initialize(mx.init.Xavier())
    net.hybridize(static_alloc=True, static_shape=True)
    trainer = dg.DistributedTrainer(net.collect_params(), "sgd",
                                    {"learning_rate": 0.01, "momentum": 0.9}, kv=kv)
    state = dg.elastic.State(net=net, trainer=trainer, steps=0)
    data = mx.nd.random.uniform(shape=(batch_size, 3, image_size, image_size))
    label = mx.nd.array([i % 1000 for i in range(batch_size)])
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    log = os.path.join(directory, "events.jsonl")

    def note(**fields):
        if kv.rank == 0:
            with open(log, "a") as f:
                f.write(json.dumps(dict(world=kv.num_workers, reformation=kv.reformation,
                                        at=time.time(), **fields)) + "\n")

    @dg.elastic.run
    def train(state):
        note(event="enter", steps=state.steps)
        finish = os.path.join(directory, "finish")
        while not kv.broadcast_object(os.path.exists(finish)):     # every rank alike
            start = time.time()
            with autograd.record():
                loss = loss_fn(net(data), label)
            loss.backward()
            trainer.step(batch_size)
            state.steps += 1
            state.commit()
            note(event="step", steps=state.steps, seconds=time.time() - start)

    train(state)


def events(directory: Path) -> list[dict]:
    path = directory / "events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] \
        if path.exists() else []


def wait(directory: Path, test, timeout: float = 600) -> dict:
    limit = time.monotonic() + timeout
    while time.monotonic() < limit:
        found = [e for e in events(directory) if test(e)]
        if found:
            return found[0]
        time.sleep(0.05)
    raise SystemExit(f"timed out; events: {events(directory)[-5:]}")


def kill_host(cluster, host: int, marker: str) -> None:
    ns = os.stat(f"/run/netns/{cluster.hosts[host].namespace}").st_ino
    needle = f"DG_TEST_MARKER={marker}".encode()
    for entry in os.scandir("/proc"):
        try:
            if entry.name.isdigit() and os.stat(f"/proc/{entry.name}/ns/net").st_ino == ns \
                    and needle in Path(entry.path, "environ").read_bytes().split(b"\0"):
                os.kill(int(entry.name), signal.SIGKILL)
        except OSError:
            pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch-size", type=int, default=8, help="per worker")
    parser.add_argument("--image-size", type=int, default=112, help="input height/width")
    parser.add_argument("--steps", type=int, default=4, help="steps before the kill")
    parser.add_argument("--rate", default="1gbit", help="each host's link rate (tc)")
    parser.add_argument("--dir", default="/tmp/dg-bench-elastic-memory",
                        help="working directory (emptied first)")
    args = parser.parse_args()
    sys.path.insert(0, str(REPO / "tools"))
    import emulated_cluster

    directory = Path(args.dir)
    subprocess.run(["rm", "-rf", str(directory)], check=True)
    directory.mkdir(parents=True)
    marker = uuid.uuid4().hex
    env = {"PATH": "/usr/bin:/bin:/usr/sbin:/sbin", "PYTHONPATH": str(REPO),
           "OMP_NUM_THREADS": "1", "DG_JOB_SECRET": f"bench-{marker}",
           "DG_TEST_MARKER": marker}
    with emulated_cluster.EmulatedCluster(num_hosts=3, rate=args.rate) as cluster:
        def start(host):
            argv = [sys.executable, "-m", "dist_gluon.launch", "--nnodes", "2:3",
                    "--node-rank", str(host), "--master-addr", cluster.hosts[0].address,
                    "--master-port", "29650", "-n", "1", "--backend", "horovod",
                    "--max-restarts", "3", "--heartbeat", "0.3", "--silence-limit", "3",
                    "--last-call", "2", "--", sys.executable, __file__, "worker",
                    str(directory), str(args.batch_size), str(args.image_size)]
            log = open(directory / f"node{host}-{time.time():.0f}.log", "w")
            return cluster.popen(host, argv, cwd=directory, env=env, stdout=log,
                                 stderr=subprocess.STDOUT, text=True)

        launchers = [start(h) for h in range(3)]
        wait(directory, lambda e: e["event"] == "step" and e["steps"] >= args.steps)
        before = [e["seconds"] for e in events(directory)
                  if e["event"] == "step" and e["reformation"] == 0][1:]
        killed = time.time()
        kill_host(cluster, 2, marker)
        entered = wait(directory, lambda e: e["event"] == "enter" and e["reformation"] == 1)
        first = wait(directory, lambda e: e["event"] == "step" and e["reformation"] == 1)
        restarted = time.time()
        launchers.append(start(2))
        healed = wait(directory, lambda e: e["event"] == "enter" and e["reformation"] == 2)
        grown = wait(directory, lambda e: e["event"] == "step" and e["reformation"] == 2)
        (directory / "finish").touch()
        for p in launchers[:2] + launchers[3:]:
            p.wait(timeout=300)
    print(json.dumps({
        "model": "resnet50_v1", "batch_size": args.batch_size,
        "image_size": args.image_size, "rate": args.rate,
        "step_s_before": round(statistics.median(before), 3) if before else None,
        "kill_to_train_entered_s": round(entered["at"] - killed, 3),
        "kill_to_first_step_done_s": round(first["at"] - killed, 3),
        "first_step_s": round(first["seconds"], 3),
        "joiner_start_to_train_entered_s": round(healed["at"] - restarted, 3),
        "joiner_first_step_done_s": round(grown["at"] - restarted, 3)}))


if __name__ == "__main__":
    if sys.argv[1:2] == ["worker"]:
        worker(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
    else:
        main()
