"""Worker: an elastic ResNet-50 job that says when each stage of its start happened.

Run by ``benchmarks/run_cluster.py`` (part 7) on every host of an emulated cluster
through ``python -m dist_gluon.launch --nnodes 2:3 ...``. It trains gluoncv's
``resnet50_v1b`` (random init, one fixed random batch per worker, SGD with momentum)
with ``dg.DistributedTrainer``, saves a checkpoint every ``--save-every`` steps, and
resumes from the newest one whenever the launcher starts it (again): the job the
benchmark breaks and times. With ``--node-local`` every host keeps its own copy of each
checkpoint (``dg.Checkpointer(node_local=True)``) under ``DIR/disk-<host name>``, as
machines without a shared file system do: the emulated hosts share this machine's disk,
so each writes into a directory of its own, and a lost host's copy is never read again.

Every rank prints one ``ELASTIC {json}`` line per round with wall-clock times
(``time.time()``; every emulated host shares this machine's clock) of:

- ``process``: this process's start, from ``/proc/self/stat`` (before the interpreter
  loaded anything; 10 ms resolution);
- ``script``: this script began (the interpreter is up); ``imported``: mxnet, numpy
  and dist_gluon imported;
- ``created``: ``dg.create()`` returned (imports and the backend's rendezvous done);
- ``built``: the model built, its shapes known and the trainer made;
- ``restored``: ``Checkpointer.restore`` returned;
- ``first_step``: the round's first ``trainer.step`` finished (the engine waited for).

Rank 0 also prints ``ELASTIC {"event": "step" | "saved", ...}`` after each step and
save, which the benchmark watches to choose the moment of its fault. A round started by
a re-formation (``kv.reformation > 0``) trains ``--steps-after`` steps and ends the job;
the first round trains at most ``--max-steps`` (the fault comes long before).

With ``--memory`` the job keeps its state in memory instead (``dg.elastic.State``
committed after every step, the loop under ``@dg.elastic.run``, no checkpoint): the
survivors keep their processes, and each entry of the training function after a
re-formation prints a timeline with ``reset`` (the reset callback ran: horovod
initialised again in the new round, the last commit put back), ``entered`` (rank 0's
state synced, the function entered) and ``first_step``. On ps-lite the workers restart
instead (the state comes from the node's shared memory): a restarted worker's timeline
has the start's marks above, then ``entered`` (the node's copy taken and the freshest
commit of the job synced, inside ``dg.elastic.run``) and ``first_step``.
"""
from __future__ import annotations

import time

STARTED = time.time()

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import socket  # noqa: E402

import mxnet as mx  # noqa: E402
import numpy as np  # noqa: E402
from mxnet import autograd, gluon  # noqa: E402

import dist_gluon as dg  # noqa: E402

IMPORTED = time.time()
TAG = "ELASTIC "
OPTIMIZER_PARAMS = {"learning_rate": 0.001, "momentum": 0.9, "wd": 1e-5}


def process_start() -> float:
    """This process's start as wall-clock time: field 22 of /proc/self/stat (clock ticks
    since boot, 10 ms resolution), moved onto the wall clock by the time since boot now
    (/proc/stat's boot time is in whole seconds, too coarse)."""
    with open("/proc/self/stat") as f:
        # the command name (field 2) may hold spaces; the fields after it do not
        ticks = int(f.read().rsplit(")", 1)[1].split()[19])
    since_boot = time.clock_gettime(time.CLOCK_BOOTTIME)
    return time.time() - since_boot + ticks / os.sysconf("SC_CLK_TCK")


def say(payload: dict) -> None:
    print(TAG + json.dumps(payload), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", required=True,
                        help="the checkpoint directory (shared by every host, unless "
                             "--node-local)")
    parser.add_argument("--node-local", action="store_true",
                        help="each host keeps its own copy of every checkpoint, in "
                             "DIR/disk-<host name> (dg.Checkpointer(node_local=True))")
    parser.add_argument("--batch", type=int, default=4, help="samples per worker and step")
    parser.add_argument("--image", type=int, default=64, help="image side in pixels")
    parser.add_argument("--save-every", type=int, default=2,
                        help="steps between checkpoints")
    parser.add_argument("--max-steps", type=int, default=40,
                        help="steps after which the first round ends anyway")
    parser.add_argument("--steps-after", type=int, default=2,
                        help="steps a re-formed round trains before the job ends")
    parser.add_argument("--memory", action="store_true",
                        help="keep the state in memory (dg.elastic.State, a commit every "
                             "step) instead of checkpoints: the workers keep their processes")
    args = parser.parse_args()
    # a worker run by a launcher's warm standby starts when it is handed its command
    # (DG_WARM_START), its imports long done
    handed = os.environ.get("DG_WARM_START")
    times = {"process": float(handed) if handed else process_start(), "script": STARTED,
             "imported": IMPORTED, "warm": bool(handed)}

    kv = dg.create()
    times["created"] = time.time()
    from gluoncv.model_zoo import get_model

    mx.random.seed(kv.rank)
    rng = np.random.RandomState(kv.rank)
    net = get_model("resnet50_v1b", pretrained=False, classes=1000)
    net.initialize(mx.init.Xavier())
    net.hybridize()
    data = mx.nd.array(rng.rand(args.batch, 3, args.image, args.image))
    label = mx.nd.array(rng.randint(0, 1000, size=args.batch))
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    with autograd.record():          # the shapes of deferred parameters
        net(data).wait_to_read()
    trainer = dg.DistributedTrainer(net.collect_params(), "sgd", dict(OPTIMIZER_PARAMS),
                                    kv=kv)
    if args.memory:
        mx.nd.waitall()
        times["built"] = time.time()
        in_memory(args, kv, net, trainer, data, label, loss_fn, times)
        return
    if args.node_local:
        ckpt = dg.Checkpointer(os.path.join(args.dir, f"disk-{socket.gethostname()}"), kv,
                               keep=2, node_local=True)
    else:
        ckpt = dg.Checkpointer(args.dir, kv, keep=2)
    mx.nd.waitall()
    times["built"] = time.time()
    state = ckpt.restore(net, trainer)
    mx.nd.waitall()
    times["restored"] = time.time()
    step = state["step"] if state else 0
    resumed_from = step

    steps = 0
    while True:
        with autograd.record():
            loss = loss_fn(net(data), label)
        loss.backward()
        trainer.step(args.batch)
        mx.nd.waitall()
        step, steps = step + 1, steps + 1
        if steps == 1:
            times["first_step"] = time.time()
            say({"event": "timeline", "rank": kv.rank, "pid": os.getpid(),
                 "host": socket.gethostname(),
                 "workers": kv.num_workers,
                 "reformation": kv.reformation, "restart": kv.restart,
                 "resumed_from": resumed_from, "times": times})
        if kv.rank == 0:
            say({"event": "step", "step": step, "reformation": kv.reformation,
                 "time": time.time()})
        stop = dg.stop_requested(kv)   # a planned change (none is made here)
        if stop or step % args.save_every == 0:
            ckpt.save(net, trainer, 0, step=step)
            if kv.rank == 0:
                say({"event": "saved", "step": step, "reformation": kv.reformation,
                     "time": time.time()})
        if stop or step >= args.max_steps or (kv.reformation > 0
                                               and steps >= args.steps_after):
            break


def in_memory(args, kv, net, trainer, data, label, loss_fn, times: dict) -> None:
    """The job of ``--memory``: the same steps, its state committed in memory."""
    state = dg.elastic.State(net=net, trainer=trainer, step=0)
    reset_at = []
    state.register_reset_callbacks([lambda: reset_at.append(time.time())])

    @dg.elastic.run
    def train(state):
        marks = dict(times) if not reset_at else {"reset": reset_at[-1]}
        marks["entered"] = time.time()
        resumed_from, steps = state.step, 0
        while True:
            with autograd.record():
                loss = loss_fn(net(data), label)
            loss.backward()
            trainer.step(args.batch)
            state.step += 1
            state.commit()          # waits for the step's copies, so for the step
            steps += 1
            if steps == 1:
                marks["first_step"] = time.time()
                say({"event": "timeline", "rank": kv.rank, "pid": os.getpid(),
                     "host": socket.gethostname(), "workers": kv.num_workers,
                     "reformation": kv.reformation, "restart": kv.restart,
                     "resumed_from": resumed_from, "times": marks})
            if kv.rank == 0:
                say({"event": "step", "step": state.step, "reformation": kv.reformation,
                     "time": time.time()})
            if state.step >= args.max_steps or (kv.reformation > 0
                                                 and steps >= args.steps_after):
                return

    train(state)


if __name__ == "__main__":
    main()
