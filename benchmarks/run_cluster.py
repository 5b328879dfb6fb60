"""`make bench-cluster`: dist_gluon and its peers on emulated hosts with real link limits.

    .venv/bin/python benchmarks/run_cluster.py          # full run, RESULTS-cluster-<part>.md
    .venv/bin/python benchmarks/run_cluster.py --quick  # 2 hosts, small sizes (3 minutes)

Each setting is an emulated cluster (tools/emulated_cluster.py: one network namespace per
host on a bridge, own address and host name, ``tc tbf`` rate limit each way per host):
2 and 4 hosts at 1 Gbit/s, and 2 hosts at 10 Gbit/s. One worker per host, started by
``python -m dist_gluon.launch --nnodes N --node-rank I --master-addr <host 0>`` on
every host; ps-lite jobs get one server per host (the launcher's default) and the
scheduler on host 0. In every cluster:

0. Link: what plain TCP streams get through the links (cluster/link.py).
1. Collectives: sums of 1 to 100 MiB and of ResNet-50's shapes through each backend
   next to the raw library calls (../bench_comm.py), against the link bound.
2. Training: ResNet-50 and VGG-16 on synthetic data, DistributedTrainer on each backend
   next to horovod.mxnet.DistributedTrainer, gluon.Trainer(kvstore='dist_sync') and
   MXNet's own P3, each with the compute-only step of the same job (cluster/train.py).
3. Compression: the same models on 2 hosts at 1 Gbit/s with DistributedTrainer's
   compression (none, fp16, 2-bit, PowerSGD rank 4) on horovod and dist_sync, next to
   MXNet's own 2-bit compression, with the bytes each puts on the wire; the shipped
   defaults (horovod's cycle time tuned on each job, its tuning in the untimed steps).
   Other settings of horovod's transport run only when named (--variant); --merge
   adds their rows to the report already there, each marked with its run.
4. Language model: an LSTM language model whose embedding has row_sparse gradients
   (cluster/lm.py) on 2 hosts at 1 Gbit/s: DistributedTrainer with sparse against dense
   embedding gradients on horovod, dist_sync and p3, and gluon.Trainer(kvstore=
   'dist_sync') with MXNet's own row_sparse path.
5. Server hosts: 4 hosts at 1 Gbit/s; 2 worker hosts with 2 server-only hosts (BytePS's
   topology, dist_sync) against the same 2 hosts with a server each and against
   horovod's ring: 100 MiB sums and ResNet-50 steps, each against its layout's bound.
6. Asynchronous: 2 hosts at 1 Gbit/s, ResNet-50 with rank 1 slowed to half speed (it
   sleeps as long as each step took): dist_async's throughput against dist_sync's.
7. Elastic recovery: 3 hosts at 1 Gbit/s, an elastic ResNet-50 job (--nnodes 2:3, one
   worker per host, checkpoints every 2 steps; cluster/elastic.py) on horovod,
   dist_sync and p3 loses host 2 (every process SIGKILLed, or its link down) one step
   after a checkpoint, with the checkpoints in a directory every host shares; then
   host 0, the job's first host, the same ways, with node-local checkpoints (each host's
   own copy): nodes 1 and 2 elect node 1 as the new host, which takes over. The time
   from the fault to the re-formed job's first step, split into detection, the
   takeover (host 0 only: the survivors end their workers, then elect), re-formation,
   worker start, model build, checkpoint load and first step, from the launchers' lines
   (stamped as they are read) and the workers' clocks. The same faults again with the
   job's state in memory (dg.elastic.State, no checkpoint): on horovod the survivors
   keep their processes; on dist_sync and p3 the workers restart and take the state
   from their node's shared memory (their start split into imports, ps-lite's start,
   model build and state sync). --merge adds the rows run to the report already there.
8. Slow links (``--only slow``; its own report, RESULTS-cluster-slow-links.md, and raw
   numbers, results-cluster-slow-links.json, which runs of the other parts never
   touch): ResNet-50 and VGG-16 on 2 hosts at 1 Gbit/s and at 100 Mbit/s, per-step
   averaging against DiLoCo rounds (cluster/slow_links.py, horovod over Gloo); and the
   MNIST example's final accuracy and the language model example's perplexity with
   Local SGD and DiLoCo against per-step averaging on 2 and 4 workers (on one host:
   neither depends on the link).
9. Scale: the launchers' control plane against the number of nodes, 4 to 256 hosts with
   a light worker each, static and elastic: formation, re-formation after a lost
   worker or node, node 0's CPU and bytes per second and every launcher's CPU per node
   (cluster/scale.py). Its report is its own, benchmarks/RESULTS-cluster-scale.md (and
   results-cluster-scale.json), whatever --out says: reruns of the other parts never
   overwrite it, nor it theirs.

Each part's report (cluster/report.py) has a file of its own, benchmarks/PART_FILES[part]
(RESULTS-cluster-comm.md, -train, -compression, -lm, -servers, -async, -elastic), with
its raw numbers beside it (results-cluster-<...>.json), so that a rerun of one part
(`--only lm`) never loses another part's figures; --quick writes everything it ran into
RESULTS-cluster-quick.md instead, and --out FILE into FILE. Every
job has a timeout, and every cluster is torn down (with whatever still runs on it)
when its setting ends, also on an error or Ctrl-C.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO / "tools"))

import emulated_cluster  # noqa: E402
import run as local_bench  # noqa: E402  (benchmarks/run.py: machine facts, cases)
from cluster import report, scale, slow_report  # noqa: E402

from dist_gluon.backends import horovod_tuning  # noqa: E402
from dist_gluon.launch import statedir  # noqa: E402

PY = sys.executable
RESULT_TAG = "BENCH "
LINK_TAG = "LINK "

# VGG-16 runs on 2 hosts only: at 4 hosts and 1 Gbit/s one of its steps needs 6.6 s of
# link time alone, and its seven jobs would take the run past 30 minutes.
FULL = {
    "settings": [
        {"hosts": 2, "rate": "1gbit", "models": ("resnet50", "vgg16")},
        {"hosts": 4, "rate": "1gbit", "models": ("resnet50",)},
        {"hosts": 2, "rate": "10gbit", "models": ("resnet50",)},
    ],
    "link_mib": 64,
    "sizes_mib": (1, 10, 100), "comm_reps": 3, "comm_warmup": 1,
    "models": {
        # batch 16 of 112x112 computes for about 1.2 s per step on an idle core, 1.5 times
        # the link bound of one gradient sum on 2 hosts at 1 Gbit/s (0.82 s): a setting in
        # which overlapping communication with the backward pass can hide most of it
        "resnet50": {"batch": 16, "image": 112, "warmup": 1, "steps": 2, "rounds": 2},
        # 224x224 keeps the first Dense layer's 25088 inputs, hence 138M parameters
        "vgg16": {"batch": 1, "image": 224, "warmup": 1, "steps": 2, "rounds": 1},
    },
    "elastic_reps": 3,
    # ResNet-50's steps are short enough for more rounds: its codecs' differences from
    # the uncompressed step are a few percent
    "compress_rounds": {"resnet50": 6, "vgg16": 3},
}
# Part 3: the wire-bound setting, where compression can pay. Its steps are long and
# their spread on 2 shared cores wide, so each model runs cfg["compress_rounds"][model]
# rounds there, whatever its rounds elsewhere. Its report of record shows the shipped
# defaults (horovod's cycle tuned on the job over Gloo, FINDINGS.md 9i; OpenMPI's
# waiting rank yielding, 9h); the variants below run only when named (--variant), their
# rows merged into that report (--merge). A fixed cycle, which the tuner leaves alone:
COMPRESS = {"hosts": 2, "rate": "1gbit", "models": ("resnet50", "vgg16")}
GLOO_SLOW_CYCLE = "horovod (Gloo, HOROVOD_CYCLE_TIME=20)"
# OpenMPI's waiting rank polling without yielding its core (before FINDINGS.md 9h), and
# yielding (what the launcher gives CPU workers: the variable is set either way, so the
# row does not depend on that default)
MPI_NO_YIELD = "horovod (MPI, mpi_yield_when_idle=0)"
MPI_YIELD = "horovod (MPI, mpi_yield_when_idle=1)"
COMPRESS_EXTRA_VARIANTS = ((GLOO_SLOW_CYCLE, "horovod", "gloo"),
                           (MPI_NO_YIELD, "horovod", "mpi"), (MPI_YIELD, "horovod", "mpi"))
VARIANT_ENV = {GLOO_SLOW_CYCLE: {"HOROVOD_CYCLE_TIME": "20"},
               MPI_NO_YIELD: {"OMPI_MCA_mpi_yield_when_idle": "0"},
               MPI_YIELD: {"OMPI_MCA_mpi_yield_when_idle": "1"}}
# On ps-lite every trainer gets its own job: four VGG-16 trainers' keys on the servers of
# one emulated cluster (2 workers and 2 servers sharing this machine) ran out of memory.
COMPRESS_JOBS = {"horovod": ("dist_gluon,dg_fp16,dg_2bit,dg_powersgd,compute",),
                 "dist_sync": ("dist_gluon,compute", "dg_fp16,compute", "dg_2bit,compute",
                               "dg_powersgd,compute", "gluon_2bit,compute")}
# Untimed steps of a horovod job's first trainer in part 3 (over Gloo: over MPI nothing
# is tuned), so that the tuning of the cycle time ends in them, on that trainer's steps
# alone, and every timed step runs with the cycle chosen: its warm-up, then per
# candidate cycle one step left out and up to MAX_STEPS timed, and one more step after
# its last restart. Up to MAX_STEPS, not MIN_STEPS, however long a step is: the tuner
# plans from the gap between two step ends in Python, which in train.py's loop (no wait
# inside a block) is the time to queue a step, not to run it (a first run with
# MIN_STEPS's 9 steps: ResNet-50's tuning went on to step 12, into the other trainers')
TUNE_WARMUP = (horovod_tuning.WARMUP_STEPS
               + len(horovod_tuning.CYCLES_MS) * (1 + horovod_tuning.MAX_STEPS) + 1)
# the line rank 0 prints once the cycle is chosen, or why nothing was tuned
TUNER_LINE = re.compile(r"dist_gluon: horovod(?: tuned on steps|'s cycle time not tuned).*")

# Part 4: the language model, in the same setting.
LM = {"vocab": 50000, "dim": 256, "batch": 8, "bptt": 20, "warmup": 1, "steps": 3}
LM_JOBS = {"horovod": ("sparse,dense,compute",),
           "dist_sync": ("sparse,dense,compute", "gluon,compute"),
           "p3": ("sparse,dense,compute",)}

QUICK = {
    "settings": [{"hosts": 2, "rate": "1gbit", "models": ("resnet50",)}],
    "link_mib": 64,
    "sizes_mib": (1, 10), "comm_reps": 2, "comm_warmup": 1,
    "models": {
        "resnet50": {"batch": 4, "image": 64, "warmup": 1, "steps": 2, "rounds": 1},
        "vgg16": {"batch": 1, "image": 224, "warmup": 1, "steps": 1, "rounds": 1},
    },
    "elastic_reps": 1,
    "compress_rounds": {"resnet50": 1, "vgg16": 1},
}

# (label, launcher backend, transport): the horovod MPI row runs only where horovod can
# run over MPI across the hosts (see mpi_support()).
VARIANTS = (("horovod (Gloo)", "horovod", "gloo"), ("horovod (MPI)", "horovod", "mpi"),
            ("dist_sync", "dist_sync", None), ("p3", "p3", None))
# Trainers per job. On horovod they take turns in one job; on ps-lite each gets its own
# job (MXNet allows one ps-lite store per process), with the compute-only step beside it.
TRAIN_JOBS = {"horovod": ("dist_gluon,horovod.mxnet,compute",),
              "dist_sync": ("dist_gluon,compute", "gluon,compute"),
              "p3": ("dist_gluon,compute", "gluon,compute")}

# Part 5: (label, backend, [(workers, servers) of host 0, 1, ...]); hosts beyond the
# list stay idle. With N worker hosts and S server-only hosts a sum of B bytes is bound
# by max(1, N/S) x B/R; a server on each worker host, or a ring, by 2(N-1)/N x B/R.
SERVER_HOSTS = {"hosts": 4, "rate": "1gbit"}
SERVER_LAYOUTS = (
    ("2 workers + 2 server-only hosts (dist_sync)", "dist_sync",
     [(1, 0), (1, 0), (0, 1), (0, 1)]),
    ("2 hosts, a server each (dist_sync)", "dist_sync", [(1, 1), (1, 1)]),
    ("horovod ring (Gloo)", "horovod", [(1, 1), (1, 1)]),
)
# Part 6: a worker slowed to half speed, on 2 hosts.
ASYNC = {"hosts": 2, "rate": "1gbit"}
# Part 7: an elastic ResNet-50 job (--nnodes 2:3, a worker per host) loses host 2, then
# (in another job) host 0, to a fault; the launchers keep their defaults (--silence-limit
# 8, --heartbeat 0.5). Where host 0 is lost the checkpoints are node-local: its disk goes
# with it, and a shared directory would hide what the survivors must hold themselves.
# Two modes on every backend: "restart" (every worker restarts from the last
# checkpoint) and "memory" (dg.elastic.State: on horovod the survivors keep their
# processes and their state in memory; on ps-lite the workers restart and take the
# state from the node's shared memory).
ELASTIC = {"hosts": 3, "rate": "1gbit", "nnodes": "2:3", "max_restarts": 3,
           "backends": ("horovod", "dist_sync", "p3"), "modes": ("restart", "memory"),
           "faults": ("kill", "link"),
           "lost_hosts": (2, 0), "node_local": (0,),
           "batch": 4, "image": 64, "save_every": 2, "steps_after": 2,
           # seconds the first round trains before the fault, as a job does for long
           # before it meets one: its launchers' warm standbys (launch/standby.py) have
           # started and imported by then
           "train_before": 15.0}
ELASTIC_TAG = "ELASTIC "
# the phases of a recovery, each named for the boundary that ends it; it begins at the
# boundary before it that the recovery has ("electing" and "took" only where the host
# was lost: its takeover is the survivors ending their workers, then the election)
# In memory mode on horovod the survivors' processes stay: "reset" (horovod initialised
# again in the new round, the last commit put back) and "entered" (rank 0's state
# synced). On ps-lite they restart, and the start is split finer: "imported" (mxnet and
# dist_gluon imported), "backend" (dg.create() returned: ps-lite's scheduler, servers
# and workers met), "entered" (the node's copy taken from /dev/shm and the freshest
# commit synced, a commit made).
BOUNDS = ("fault", "lost", "electing", "took", "spawned", "reset", "imported", "created",
          "backend", "built", "restored", "entered", "first_step")
PHASES = (("detection", "lost"), ("workers ended", "electing"), ("election", "took"),
          ("re-formation", "spawned"), ("re-formation", "reset"), ("imports", "imported"),
          ("worker start", "created"), ("backend start", "backend"),
          ("model build", "built"), ("checkpoint load", "restored"),
          ("state sync", "entered"), ("first step", "first_step"))
TOOK_OVER = "takes over as the job's host"
# the host dropping a node that went silent while the round's processes ended
LEFT_UNCONFIRMED = "did not confirm that its processes ended: it leaves the job"

# Part 8: Local SGD and DiLoCo. Throughput on 2 hosts at each rate; the MNIST example's
# final validation accuracy (mean over the seeds) for each H, on loopback.
SLOW = {"hosts": 2, "rates": ("1gbit", "100mbit"),
        "models": {"resnet50": {"batch": 16, "image": 112, "steps": 2},
                   "vgg16": {"batch": 1, "image": 224, "steps": 2}},
        "impls": ("per_step", "diloco:32", "diloco_fp16:32", "diloco_fp16_overlap:32",
                  "diloco_2bit:32", "diloco_powersgd:32", "diloco_powersgd:128"),
        "mnist": {"workers": (2, 4), "seeds": (42, 7, 1), "epochs": 12,
                  # the example's flags of each run; () is per-step averaging (its rate
                  # scaled with the workers; the rounds' unscaled, the example's default)
                  "runs": ((), ("--sync-every", "8"), ("--sync-every", "32"),
                           ("--sync-every", "128"), ("--sync-every", "32", "--scale-lr"),
                           ("--sync-every", "32", "--outer-lr", "0.7"),
                           ("--sync-every", "32", "--outer-lr", "0.7",
                            "--outer-momentum", "0.5"),
                           ("--sync-every", "32", "--local-sgd-warmup", "24"),
                           ("--sync-every", "32", "--compression", "fp16"),
                           ("--sync-every", "32", "--compression", "2bit",
                            "--threshold", "0.01"),
                           ("--sync-every", "32", "--compression", "powersgd"),
                           ("--sync-every", "32", "--sync-delay", "32"))},
        # the language model example on a fifth of its corpus (about 108,000 training
        # words: 154 windows of 10 x 35 words per epoch on 2 workers, 77 on 4), 2 epochs
        "lm": {"workers": (2, 4), "seeds": (42,), "epochs": 2,
               "args": ("--train-fraction", "0.2"),
               "runs": ((), ("--sync-every", "8"), ("--sync-every", "32"),
                        ("--sync-every", "128"))}}
SLOW_QUICK = {"hosts": 2, "rates": ("100mbit",),
              "models": {"resnet50": {"batch": 4, "image": 64, "steps": 1}},
              "impls": ("per_step", "diloco:8", "diloco_fp16_overlap:8"),
              "mnist": {"workers": (2,), "seeds": (42,), "epochs": 3,
                        "runs": ((), ("--sync-every", "8"),
                                 ("--sync-every", "8", "--outer-lr", "0.7"))},
              "lm": {"workers": (2,), "seeds": (42,), "epochs": 1,
                     "args": ("--train-fraction", "0.05"),
                     "runs": ((), ("--sync-every", "8"))}}
SLOW_RESULTS = "RESULTS-cluster-slow-links.md"
# At 100 Mbit/s VGG-16's first Dense weight (392 MiB) takes 33 s to send, longer than
# Gloo's default of 30 s for one operation ("Timed out waiting 30000ms for send
# operation to complete"), with or without rounds.
SLOW_ENV = {"HOROVOD_GLOO_TIMEOUT_SECONDS": "600"}

_ports = itertools.count(29700)


def log(message: str) -> None:
    print(f"[bench-cluster {time.strftime('%H:%M:%S')}] {message}", flush=True)


# --------------------------------------------------------------------------- jobs
def worker_env() -> dict[str, str]:
    """The environment of every process on the hosts: nothing of the caller's but the
    path, so that a job depends on what it is given only."""
    return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": "/root",
            "PYTHONPATH": os.pathsep.join([str(REPO), str(HERE)]),
            "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "LANG": "C.UTF-8"}


def run_job(cluster, backend: str, transport: str | None, argv: list[str],
            timeout: float, workdir: Path, layout=None, env=None) -> dict:
    """Run ``argv`` (after the python executable) as one dist_gluon job with one worker
    on each host (``layout``: the (workers, servers) of hosts 0, 1, ... instead; the
    other hosts stay idle; ``env``: variables added to every process's); return rank 0's
    ``BENCH`` payload, or {'error': ...}, with the job's wall time."""
    port = str(next(_ports))
    logs = []
    procs = []
    extra = ["--transport", "gloo"] if transport == "gloo" else []
    if transport == "mpi":
        # node 0's mpirun starts every node's ranks over ssh (the hosts' sshd)
        extra = ["--transport", "mpi", "--ssh-port", str(cluster.ssh_port),
                 "--ssh-identity-file", cluster.identity_file]
    layout = layout or [(1, 1)] * cluster.num_hosts
    for host, (workers, servers) in zip(cluster.hosts, layout):
        command = [PY, "-m", "dist_gluon.launch", "--nnodes", str(len(layout)),
                   "--node-rank", str(host.index), "--master-addr", cluster.hosts[0].address,
                   "--master-port", port, "-n", str(workers), "--servers", str(servers),
                   "--backend", backend,
                   "--timeout", str(timeout), "--join-timeout", "60", *extra,
                   "--", PY, *argv]
        out = open(workdir / f"job{port}-node{host.index}.out", "w+")
        err = open(workdir / f"job{port}-node{host.index}.err", "w+")
        logs.append((out, err))
        # the job secret that lets only this job's launchers join it
        host_env = dict(worker_env(), DG_JOB_SECRET=f"bench-{port}", **(env or {}))
        procs.append(cluster.popen(host.index, command, cwd=REPO, env=host_env,
                                   stdin=subprocess.DEVNULL, stdout=out, stderr=err))
    started = time.monotonic()
    deadline = started + timeout + 30
    codes = [wait_or_kill(p, deadline) for p in procs]
    seconds = time.monotonic() - started
    kill_leftovers(cluster)
    texts = []
    for out, err in logs:
        out.seek(0)
        err.seek(0)
        texts.append((out.read(), err.read()))
        out.close()
        err.close()
    rank0 = [line[4:] for line in texts[0][0].splitlines() if line.startswith("[0] ")]
    payloads = [json.loads(line[len(RESULT_TAG):]) for line in rank0
                if line.startswith(RESULT_TAG)]
    if all(code == 0 for code in codes) and payloads:
        tuner = [m.group(0) for m in map(TUNER_LINE.search, texts[0][1].splitlines()) if m]
        return dict(payloads[-1], job_seconds=seconds, **({"tuner": tuner[0]} if tuner else {}))
    tails = []
    for node, (code, (_, err)) in enumerate(zip(codes, texts)):
        lines = [line for line in err.strip().splitlines() if line.strip()][-6:]
        tails.append(f"node {node} exit {code}: " + " | ".join(lines))
    return {"error": " || ".join(tails), "job_seconds": seconds}


def wait_or_kill(proc: subprocess.Popen, deadline: float) -> int | None:
    """The exit code of a host's launcher, terminated (then killed) at ``deadline``."""
    try:
        return proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)
        try:
            return proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            return proc.wait()


def kill_leftovers(cluster) -> None:
    """Kill whatever still runs on the cluster's hosts but their sshd (nothing, when a
    job ended well), so that no straggler of a failed job loads the next one."""
    for host in cluster.hosts:
        pids = subprocess.run(["ip", "netns", "pids", host.namespace], capture_output=True,
                              text=True).stdout.split()
        for pid in pids:
            try:
                if Path(f"/proc/{pid}/comm").read_text().strip() == "sshd":
                    continue
                os.kill(int(pid), signal.SIGKILL)
            except (OSError, ValueError):
                pass


def describe(payload: dict) -> str:
    if "error" in payload:
        return "FAILED " + payload["error"][:600]
    return f"done in {payload['job_seconds']:.0f} s"


def launcher_has_transport() -> bool:
    """Whether the launcher has --transport gloo|mpi (older ones: Gloo only)."""
    text = subprocess.run([PY, "-m", "dist_gluon.launch", "--help"], cwd=REPO,
                          capture_output=True, text=True).stdout
    return "--transport" in text


def mpi_support() -> str | None:
    """None when horovod can run over MPI across the emulated hosts, else why not."""
    if not launcher_has_transport():
        return "the launcher has no --transport option yet (`python -m dist_gluon.launch " \
               "--help`)"
    if shutil.which("mpirun") is None:
        return "mpirun not found (make setup installs OpenMPI as root)"
    built = subprocess.run([PY, "-c", "import horovod.mxnet as h; print(h.mpi_built())"],
                           capture_output=True, text=True).stdout.strip()
    if built != "True":
        return "horovod was built without MPI (make setup rebuilds it once OpenMPI is there)"
    return emulated_cluster.skip_reason(sshd=True)


# --------------------------------------------------------------------------- parts
def run_link(cluster, mib: int) -> dict:
    """Ring of plain TCP streams, all hosts at once; bytes per second of each stream."""
    addresses = ",".join(h.address for h in cluster.hosts)
    start = time.time() + 2.0
    port = str(next(_ports))
    procs = [cluster.popen(h.index, [PY, str(HERE / "cluster" / "link.py"), "--index",
                                     str(h.index), "--addresses", addresses, "--port", port,
                                     "--mib", str(mib), "--start", f"{start:.3f}"],
                           env=worker_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True)
             for h in cluster.hosts]
    rates, errors = [], []
    for p in procs:
        try:
            out, err = p.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            p.kill()
            out, err = p.communicate()
        found = [json.loads(line[len(LINK_TAG):]) for line in out.splitlines()
                 if line.startswith(LINK_TAG)]
        if found:
            rates.append(found[0]["bytes"] / found[0]["seconds"])
        else:
            errors.append(err.strip()[-300:] or f"exit {p.returncode}")
    kill_leftovers(cluster)
    return {"mib": mib, "bytes_per_s": rates, "errors": errors}


def run_comm(cluster, cfg, cases_path: Path, variants, timeout: float, workdir) -> dict:
    jobs = {}
    for label, backend, transport in variants:
        argv = [str(HERE / "cluster" / "comm.py"), "--cases", str(cases_path),
                "--reps", str(cfg["comm_reps"]), "--warmup", str(cfg["comm_warmup"])]
        jobs[label] = run_job(cluster, backend, transport, argv, timeout, workdir)
        log(f"  collectives, {label}: {describe(jobs[label])}")
    return jobs


def run_train(cluster, cfg, models, variants, timeout: float, workdir,
              jobs=None, rounds=None, tune_warmup=0) -> dict:
    """Each model's training jobs on every variant; ``tune_warmup``: untimed steps of a
    horovod job's first trainer (its other trainers get the model's ``warmup``)."""
    jobs = jobs or TRAIN_JOBS
    out = {}
    for model in models:
        opts = dict(cfg["models"][model], **({"rounds": rounds[model]} if rounds else {}))
        args = ["--model", model, *itertools.chain.from_iterable(
            (f"--{k}", str(v)) for k, v in opts.items())]
        per_variant = {}
        for label, backend, transport in variants:
            if backend not in jobs:
                continue
            slot = {"times": {}, "errors": {}, "wire_bytes": {}, "codec_seconds": {},
                    "cpu_seconds": {}, "machine_busy": {}, "tuner": {}}
            first_warmup = tune_warmup if backend == "horovod" and transport != "mpi" else 0
            if first_warmup:
                slot["first_warmup"] = first_warmup
            for impls in jobs[backend]:
                payload = run_job(cluster, backend, transport,
                                  [str(HERE / "cluster" / "train.py"), *args,
                                   "--impls", impls, "--first-warmup", str(first_warmup)],
                                  timeout, workdir, env=VARIANT_ENV.get(label))
                log(f"  training, {model}, {label} [{impls}]: {describe(payload)}")
                if "error" in payload:
                    slot["errors"][impls] = payload["error"]
                    continue
                main = impls.split(",")[0]
                for what in ("times", "cpu_seconds", "machine_busy"):
                    found = dict(payload.get(what, {}))
                    if main.startswith("gluon") and "compute" in found:
                        # the compute-only step of gluon.Trainer's own job
                        found[f"compute_{main}_job"] = found.pop("compute")
                    slot[what].update(found)
                slot["wire_bytes"].update(payload.get("wire_bytes", {}))
                if "tuner" in payload:
                    slot["tuner"][impls] = payload["tuner"]
                    log(f"    {payload['tuner']}")
                slot["codec_seconds"].update(payload.get("codec_seconds", {}))
                slot.update({k: payload[k] for k in ("parameters", "tensors", "batch",
                                                     "image", "gradient_bytes")})
            per_variant[label] = slot
        out[model] = per_variant
    return out


def run_lm(cluster, variants, timeout: float, workdir) -> dict:
    args = list(itertools.chain.from_iterable((f"--{k}", str(v)) for k, v in LM.items()))
    out = {}
    for label, backend, transport in variants:
        if backend not in LM_JOBS or transport == "mpi":
            continue
        slot = {"times": {}, "errors": {}, "wire_elements": {}}
        for impls in LM_JOBS[backend]:
            payload = run_job(cluster, backend, transport,
                              [str(HERE / "cluster" / "lm.py"), *args, "--impls", impls],
                              timeout, workdir)
            log(f"  language model, {label} [{impls}]: {describe(payload)}")
            if "error" in payload:
                slot["errors"][impls] = payload["error"]
                continue
            times = dict(payload["times"])
            if impls.startswith("gluon"):
                times["compute_gluon_job"] = times.pop("compute")
            slot["times"].update(times)
            slot["wire_elements"].update(payload.get("wire_elements", {}))
            slot.update({k: payload[k] for k in ("vocab", "dim", "batch", "bptt",
                                                 "parameters", "embedding")})
        out[label] = slot
    return out


def run_server_hosts(cfg, cases_path: Path, timeout: float) -> dict:
    """Part 5: the layouts of SERVER_LAYOUTS on one 4-host cluster."""
    setting = dict(SERVER_HOSTS, load_start=os.getloadavg(), layouts={})
    log(f"server hosts: {SERVER_HOSTS['hosts']} hosts at {SERVER_HOSTS['rate']}")
    opts = cfg["models"]["resnet50"]
    model_args = ["--model", "resnet50", *itertools.chain.from_iterable(
        (f"--{k}", str(v)) for k, v in opts.items())]
    with tempfile.TemporaryDirectory(prefix="dg-bench-cluster-") as tmp, \
            emulated_cluster.EmulatedCluster(num_hosts=SERVER_HOSTS["hosts"],
                                             rate=SERVER_HOSTS["rate"]) as cluster:
        workdir = Path(tmp)
        setting["link"] = run_link(cluster, cfg["link_mib"])
        for label, backend, layout in SERVER_LAYOUTS:
            transport = "gloo" if backend == "horovod" and launcher_has_transport() else None
            comm = run_job(cluster, backend, transport,
                           [str(HERE / "cluster" / "comm.py"), "--cases", str(cases_path),
                            "--reps", str(cfg["comm_reps"]), "--warmup",
                            str(cfg["comm_warmup"])], timeout, workdir, layout=layout)
            log(f"  sums, {label}: {describe(comm)}")
            train = run_job(cluster, backend, transport,
                            [str(HERE / "cluster" / "train.py"), *model_args, "--impls",
                             "dist_gluon,compute"], timeout, workdir, layout=layout)
            log(f"  ResNet-50, {label}: {describe(train)}")
            setting["layouts"][label] = {"layout": layout, "comm": comm, "train": train}
    setting["load_end"] = os.getloadavg()
    return setting


def run_async(cfg, timeout: float) -> dict:
    """Part 6: dist_sync and dist_async with rank 1 at half speed, on 2 hosts."""
    setting = dict(ASYNC, load_start=os.getloadavg(), jobs={})
    log(f"asynchronous: {ASYNC['hosts']} hosts at {ASYNC['rate']}, rank 1 at half speed")
    opts = dict(cfg["models"]["resnet50"], rounds=1)
    opts["steps"] = max(opts["steps"], 4)
    model_args = ["--model", "resnet50", *itertools.chain.from_iterable(
        (f"--{k}", str(v)) for k, v in opts.items())]
    with tempfile.TemporaryDirectory(prefix="dg-bench-cluster-") as tmp, \
            emulated_cluster.EmulatedCluster(num_hosts=ASYNC["hosts"],
                                             rate=ASYNC["rate"]) as cluster:
        for backend in ("dist_sync", "dist_async"):
            payload = run_job(cluster, backend, None,
                              [str(HERE / "cluster" / "train.py"), *model_args, "--impls",
                               "dist_gluon", "--slow-rank", "1"], timeout, Path(tmp))
            log(f"  ResNet-50, {backend}: {describe(payload)}")
            setting["jobs"][backend] = payload
    setting["load_end"] = os.getloadavg()
    return setting


def run_example(script: str, flags, workers: int, seed: int, epochs: int, timeout: float,
                workdir: Path, metric: str, log_interval: int = 1000) -> dict:
    """The example ``script`` (under examples/) with ``flags`` on ``workers`` local
    workers (horovod): its summary's ``metric`` and val_loss, or the error."""
    argv = [PY, "-m", "dist_gluon.launch", "-n", str(workers), "--backend", "horovod",
            "--timeout", str(timeout), "--", PY, str(REPO / "examples" / script),
            "--epochs", str(epochs), "--seed", str(seed), "--log-interval",
            str(log_interval), *flags]
    env = dict(worker_env(), PYTHONPATH=str(REPO))
    started = time.monotonic()
    proc = subprocess.run(argv, cwd=workdir, env=env, capture_output=True, text=True,
                          timeout=timeout + 60)
    lines = [line[4:] for line in proc.stdout.splitlines() if line.startswith("[0] summary:")]
    if proc.returncode != 0 or not lines:
        return {"error": (proc.stderr.strip().splitlines() or ["no output"])[-1][:400]}
    fields = dict(item.split("=", 1) for item in lines[-1].split()[1:])
    return {metric: float(fields[metric]), "val_loss": float(fields["val_loss"]),
            "seconds": time.monotonic() - started}


def run_mnist(flags, workers: int, seed: int, epochs: int, timeout: float,
              workdir: Path) -> dict:
    """The MNIST example with ``flags`` on ``workers`` local workers (horovod); its
    summary's validation accuracy."""
    return run_example("mnist/train_gluon.py", flags, workers, seed, epochs, timeout,
                       workdir, "val_acc")


def run_lm_example(flags, workers: int, seed: int, epochs: int, args, timeout: float,
                   workdir: Path) -> dict:
    """The language model example with ``flags`` on ``workers`` local workers (horovod);
    its summary's validation perplexity."""
    return run_example("language_model/train_lm.py", [*args, *flags], workers, seed,
                       epochs, timeout, workdir, "val_ppl", log_interval=100000)


def run_slow_links(cfg: dict, timeout: float) -> dict:
    """Part 8: DiLoCo rounds against per-step averaging on emulated links, and the MNIST
    example's accuracy for each H."""
    setting = {"load_start": os.getloadavg(), "throughput": [], "mnist": [], "lm": []}
    for rate in cfg["rates"]:
        log(f"slow links: {cfg['hosts']} hosts at {rate}")
        with tempfile.TemporaryDirectory(prefix="dg-bench-cluster-") as tmp, \
                emulated_cluster.EmulatedCluster(num_hosts=cfg["hosts"], rate=rate) as cluster:
            link = run_link(cluster, 16 if rate.endswith("mbit") else 64)
            for model, opts in cfg["models"].items():
                for impl in cfg["impls"]:
                    args = [str(HERE / "cluster" / "slow_links.py"), "--model", model,
                            "--impls", impl, *itertools.chain.from_iterable(
                                (f"--{k}", str(v)) for k, v in opts.items())]
                    payload = run_job(cluster, "horovod", "gloo" if launcher_has_transport()
                                      else None, args, timeout, Path(tmp), env=SLOW_ENV)
                    log(f"  {model} {impl} at {rate}: {describe(payload)}")
                    setting["throughput"].append({"rate": rate, "model": model,
                                                  "impl": impl, "link": link,
                                                  "load": os.getloadavg(), **payload})
    mnist = cfg["mnist"]
    with tempfile.TemporaryDirectory(prefix="dg-bench-mnist-") as tmp:
        for workers in mnist["workers"]:
            for flags in mnist["runs"]:
                for seed in mnist["seeds"]:
                    found = run_mnist(flags, workers, seed, mnist["epochs"], timeout,
                                      Path(tmp))
                    log(f"  MNIST, {workers} workers, {' '.join(flags) or 'per step'}, "
                        f"seed {seed}: {found}")
                    setting["mnist"].append({"workers": workers, "flags": list(flags),
                                             "seed": seed, "epochs": mnist["epochs"],
                                             **found})
        lm = cfg["lm"]
        for workers in lm["workers"]:
            for flags in lm["runs"]:
                for seed in lm["seeds"]:
                    found = run_lm_example(flags, workers, seed, lm["epochs"], lm["args"],
                                           timeout, Path(tmp))
                    log(f"  language model, {workers} workers, "
                        f"{' '.join(flags) or 'per step'}, seed {seed}: {found}")
                    setting["lm"].append({"workers": workers, "flags": list(flags),
                                          "seed": seed, "epochs": lm["epochs"], **found})
    setting["load_end"] = os.getloadavg()
    return setting


def run_slow_part(args, results: dict, out: Path) -> None:
    """Part 8 into its own files. ``--slow-only``, ``--slow-rate`` and ``--slow-model``
    measure a piece of it again: that piece's entries in the raw file are replaced,
    the others kept, and the report says which run measured what."""
    cfg = json.loads(json.dumps(SLOW_QUICK if args.quick else SLOW))
    pieces = set(args.slow_only or ("throughput", "mnist", "lm"))
    if args.slow_rate:
        cfg["rates"] = [r for r in cfg["rates"] if r in args.slow_rate]
    if args.slow_model:
        cfg["models"] = {m: o for m, o in cfg["models"].items() if m in args.slow_model}
    if "throughput" not in pieces:
        cfg["rates"] = []
    if "mnist" not in pieces:
        cfg["mnist"]["workers"] = []
    if "lm" not in pieces:
        cfg["lm"]["workers"] = []
    raw = out.with_name(out.stem.lower() + ".json")
    partial = bool(args.slow_only or args.slow_rate or args.slow_model)
    slow = json.loads(raw.read_text()) if partial and raw.exists() else \
        {"machine": results["machine"], "config": cfg, "throughput": [], "mnist": [],
         "lm": [], "runs": []}
    slow.setdefault("lm", [])
    run = {"command": results["command"], "uptime_start": uptime(), "measured": {
        "rates": cfg["rates"], "models": list(cfg["models"]),
        "mnist_workers": cfg["mnist"]["workers"], "lm_workers": cfg["lm"]["workers"]}}
    found = run_slow_links(cfg, args.job_timeout)
    run["uptime_end"] = uptime()
    measured = {(t["rate"], t["model"]) for t in found["throughput"]}
    slow["throughput"] = [t for t in slow["throughput"]
                          if (t["rate"], t["model"]) not in measured] + found["throughput"]
    # the report describes each piece with the settings of the run that measured it
    config = slow["config"]
    for piece in ("mnist", "lm"):
        if found[piece]:
            slow[piece] = found[piece]
            config[piece] = cfg[piece]
    if found["throughput"]:
        config["impls"] = cfg["impls"]
    slow["runs"].append(run)
    slow_report.write(slow, out)
    raw.write_text(json.dumps(slow, indent=1, default=str))
    log(f"wrote {out} and {raw}")


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


class _Lines:
    """Every line the launchers print, stamped with the wall-clock time it was read."""

    def __init__(self):
        self.lines: list[tuple[float, int, str, str]] = []   # (time, node, stream, text)
        self.changed = threading.Condition()

    def follow(self, node: int, stream: str, pipe) -> threading.Thread:
        def read():
            for line in pipe:
                with self.changed:
                    self.lines.append((time.time(), node, stream, line.rstrip("\n")))
                    self.changed.notify_all()
            pipe.close()

        thread = threading.Thread(target=read, daemon=True)
        thread.start()
        return thread

    def events(self) -> list[dict]:
        """The workers' ELASTIC payloads, in the order they were read."""
        with self.changed:
            found = [text.split(ELASTIC_TAG, 1)[1] for _, _, stream, text in self.lines
                     if stream == "stdout" and ELASTIC_TAG in text]
        events = []
        for payload in found:
            try:
                events.append(json.loads(payload))
            except ValueError:      # a line another process's output broke into
                pass
        return events

    def said(self, node: int) -> list[str]:
        """What node ``node``'s launcher said (its stderr)."""
        with self.changed:
            return [line for _, n, stream, line in self.lines
                    if n == node and stream == "stderr"]

    def first(self, node: int | None, text: str,
              after: float) -> tuple[float, str] | None:
        """The first line holding ``text`` that node ``node``'s launcher (any node's,
        for None) said at or after ``after``: (its stamp, the line)."""
        with self.changed:
            return next(((t, line) for t, n, stream, line in self.lines
                         if node in (None, n) and stream == "stderr" and t >= after
                         and text in line), None)


def _fault_moment(events: list[dict], save_every: int, memory: bool = False,
                  train_before: float = 0.0) -> bool:
    """The first round has saved a checkpoint and trained a step past it (in memory
    mode: has trained as many steps, committing each), and has trained for
    ``train_before`` seconds since its first step."""
    steps = [e for e in events if e["event"] == "step" and e["reformation"] == 0]
    if not steps or steps[-1]["time"] - steps[0]["time"] < train_before:
        return False
    if memory:
        return any(e["step"] > save_every for e in steps)
    saved = [e["step"] for e in events if e["event"] == "saved" and e["reformation"] == 0]
    return bool(saved) and any(e["step"] > saved[0] for e in steps)


def inject_fault(cluster, host: int, fault: str) -> float:
    """Break ``host``; the wall-clock time of the fault."""
    namespace = cluster.hosts[host].namespace
    if fault == "link":
        at = time.time()
        subprocess.run(["ip", "-n", namespace, "link", "set", "eth0", "down"], check=True)
        return at
    pids = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True,
                          text=True).stdout.split()
    at = time.time()
    for pid in pids:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (OSError, ValueError):
            pass
    return at


def watch_ends(pids: list[int], limit: float = 60.0) -> dict[int, float | None]:
    """From now on, in a thread: when each process of ``pids`` ended (it is gone or a
    zombie), polled every 10 ms; None if it did not within ``limit`` s."""
    ends: dict[int, float | None] = dict.fromkeys(pids)

    def alive(pid: int) -> bool:
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] != "Z"
        except OSError:
            return False

    def watch():
        stop = time.monotonic() + limit
        while time.monotonic() < stop and any(ends[p] is None for p in pids):
            for pid in pids:
                if ends[pid] is None and not alive(pid):
                    ends[pid] = time.time()
            time.sleep(0.01)

    threading.Thread(target=watch, daemon=True).start()
    return ends


def _first_match(lines: _Lines, node: int, pattern: re.Pattern,
                 after: float) -> tuple[float, str] | None:
    """The first line of node ``node``'s launcher at or after ``after`` that
    ``pattern`` finds: (its stamp, the line)."""
    with lines.changed:
        return next(((t, line) for t, n, stream, line in lines.lines
                     if n == node and stream == "stderr" and t >= after
                     and pattern.search(line)), None)


def _detection(lines: _Lines, fault_at: float, lost: int,
               nodes: int) -> tuple[dict, int | None, tuple[float, str] | None]:
    """Who saw the loss of node ``lost`` when, who hosts the job after it, and that
    host's line naming the loss: ({node: stamp of its detection line}, the host, line).

    Node 2's loss: node 0, the host, says `node 2 (...) lost: ...` when it decides so
    during a round. When the round ended first (the workers failed: a horovod job's
    Gloo timeout, 5 s in elastic jobs, is shorter than --silence-limit), node 0 decides
    while it waits for the nodes to confirm that their processes ended, and says `node 2
    (...) did not confirm that its processes ended: it leaves the job` instead
    (dist_gluon/launch/master.py): either line is the detection. Node 0's loss: every
    other node says `lost the master launcher at ...` as it decides, then they elect
    the next host, which says `node N (...) takes over as the job's host` (every node
    repeats it) next to `node 0 (...) lost: ...`."""
    if lost != 0:
        line = _first_match(lines, 0, re.compile(
            rf"\]: node {lost} \(.*\) (lost: |{re.escape(LEFT_UNCONFIRMED)})"), fault_at)
        return ({0: line[0]} if line else {}), 0, line
    seen = {}
    for n in range(1, nodes):
        line = lines.first(n, "lost the master launcher at", fault_at)
        if line:
            seen[n] = line[0]
    took = lines.first(None, TOOK_OVER, fault_at)
    match = took and re.search(r"\]: node (\d+) \(", took[1])
    if not match:
        return seen, None, None
    host = int(match.group(1))
    return seen, host, lines.first(host, " lost: ", fault_at)


def recovery(lines: _Lines, fault_at: float, lost: int, nodes: int) -> dict:
    """The boundaries of the recovery from the loss of node ``lost`` (wall-clock
    times) and the phases between them; {'error': ...} when the job did not get that
    far."""
    events = lines.events()
    seen, host, lost_line = _detection(lines, fault_at, lost, nodes)
    took = lines.first(host, TOOK_OVER, fault_at) if lost == 0 and host is not None \
        else None
    reform = lines.first(host, "re-forming with", fault_at) if host is not None else None
    old = [e for e in events if e["event"] == "timeline" and e["reformation"] == 0]
    new = [e for e in events if e["event"] == "timeline" and e["reformation"] > 0]
    electing = {n: lines.first(n, "electing the next host", fault_at)
                for n in seen} if lost == 0 else {}
    out = {"fault": fault_at, "lost": lost, "new_host": host,
           "detected": {str(n): t - fault_at for n, t in seen.items()},
           # after its detection line each survivor ends its workers, then elects
           "electing": {str(n): e[0] - fault_at for n, e in electing.items() if e},
           "lost_line": lost_line and lost_line[1], "took_line": took and took[1],
           "reform_line": reform and reform[1], "timelines": old + new}
    if old:
        out["cold_start"] = (max(e["times"]["first_step"] for e in old)
                             - min(e["times"]["process"] for e in old))
        out["workers_before"] = old[0]["workers"]
    error = None
    if not seen:
        error = (f"node 0 never said node {lost} was lost or left the job" if lost != 0 else
                 "no surviving node said it lost the master launcher")
    elif lost == 0 and took is None:
        error = "no surviving node took over as the job's host"
    elif not new:
        error = "the re-formed job's workers never finished a step"
    if error:
        return dict(out, error=error)
    # the job re-forms once every surviving node knows: the last detection counts
    bounds = {"fault": fault_at, "lost": max(seen.values()),
              **({"electing": max(e[0] for e in electing.values() if e)}
                 if any(electing.values()) else {}),
              **({"took": took[0]} if took else {})}
    if all("reset" in e["times"] for e in new):     # the processes stayed (memory mode)
        bounds.update({name: max(e["times"][name] for e in new)
                       for name in ("reset", "entered", "first_step")})
    elif all("entered" in e["times"] for e in new):
        # memory mode on ps-lite: new processes, their state from the node's memory
        last = {name: max(e["times"][name] for e in new)
                for name in ("imported", "created", "built", "entered", "first_step")}
        bounds.update(spawned=min(e["times"]["process"] for e in new),
                      backend=last.pop("created"), **last)
    else:
        bounds.update(spawned=min(e["times"]["process"] for e in new),
                      **{name: max(e["times"][name] for e in new)
                         for name in ("created", "built", "restored", "first_step")})
    order = [b for b in BOUNDS if b in bounds]
    out.update(bounds=bounds, workers_after=new[0]["workers"],
               reform_after_lost=reform[0] - bounds["lost"] if reform else None,
               resumed_from=new[0]["resumed_from"],
               # steps rank 0 had finished before the fault that the new round trains again
               steps_lost=max([e["step"] for e in events if e["event"] == "step"
                               and e["reformation"] == 0 and e["time"] < fault_at],
                              default=0) - new[0]["resumed_from"],
               phases={name: bounds[end] - bounds[order[order.index(end) - 1]]
                       for name, end in PHASES if end in bounds},
               total=bounds["first_step"] - fault_at)
    return out


def run_elastic_job(cluster, backend: str, fault: str, lost: int, timeout: float,
                    workdir: Path, mode: str = "restart") -> dict:
    """One elastic job on the cluster's 3 hosts: train, break host ``lost`` once the
    first round has saved a checkpoint and trained a step past it, and time the
    recovery (node-local checkpoints where ELASTIC['node_local'] lists the host). In
    ``mode`` "memory" the job commits its state in memory instead, and the survivors
    keep their processes."""
    memory = mode == "memory"
    port = str(next(_ports))
    cfg = ELASTIC
    argv = [str(HERE / "cluster" / "elastic.py"), "--dir", str(workdir / f"ckpt-{port}"),
            "--batch", str(cfg["batch"]), "--image", str(cfg["image"]),
            "--save-every", str(cfg["save_every"]), "--steps-after", str(cfg["steps_after"]),
            "--max-steps", "100000",       # the first round ends at the fault
            *(["--memory"] if memory else
              ["--node-local"] if lost in cfg["node_local"] else [])]
    stay = [h.index for h in cluster.hosts if h.index != lost]
    lines, procs = _Lines(), []
    for host in cluster.hosts:
        command = [PY, "-m", "dist_gluon.launch", "--nnodes", cfg["nnodes"],
                   "--node-rank", str(host.index), "--master-addr", cluster.hosts[0].address,
                   "--master-port", port, "-n", "1", "--backend", backend,
                   "--max-restarts", str(cfg["max_restarts"]), "--timeout", str(timeout),
                   "--join-timeout", "60", "--", PY, *argv]
        env = dict(worker_env(), DG_JOB_SECRET=f"bench-{port}")
        proc = cluster.popen(host.index, command, cwd=REPO, env=env, text=True,
                             stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE)
        lines.follow(host.index, "stdout", proc.stdout)
        lines.follow(host.index, "stderr", proc.stderr)
        procs.append(proc)
    deadline = time.monotonic() + timeout + 30
    fault_at = None
    try:
        with lines.changed:
            while not _fault_moment(lines.events(), cfg["save_every"], memory,
                                    cfg.get("train_before", 0.0)):
                if time.monotonic() > deadline or procs[0].poll() is not None:
                    break
                lines.changed.wait(timeout=1.0)
        if _fault_moment(lines.events(), cfg["save_every"], memory,
                         cfg.get("train_before", 0.0)):
            # the first round's workers on the hosts that stay (all ranks printed their
            # timeline at their first step, long before the fault)
            names = {cluster.hosts[n].name: n for n in stay}
            old = {e["pid"]: names[e["host"]] for e in lines.events()
                   if e["event"] == "timeline" and e["reformation"] == 0
                   and e["host"] in names}
            fault_at = inject_fault(cluster, lost, fault)
            ended = watch_ends(sorted(old))
        codes = dict.fromkeys(range(len(procs)))
        for n in stay:
            codes[n] = wait_or_kill(procs[n], deadline)
        # a cut-off node's launcher ends by itself once the others have been silent
        # for long (a minority of the last formation: it cannot go on)
        codes[lost] = wait_or_kill(procs[lost], time.monotonic() + 30)
        codes = [codes[n] for n in range(len(procs))]
    finally:
        kill_leftovers(cluster)
        # the node copies in /dev/shm (2 x 196 MiB per node in memory mode on ps-lite)
        # of launchers the fault killed: the next launcher of that host would remove
        # them, but none comes after the last job
        statedir._remove_orphans(statedir.ROOT)
        if fault == "link":
            subprocess.run(["ip", "-n", cluster.hosts[lost].namespace, "link", "set", "eth0",
                            "up"], check=False)
        shutil.rmtree(workdir / f"ckpt-{port}", ignore_errors=True)
    time.sleep(0.5)     # the readers take in the last lines
    if fault_at is None:
        said = lines.said(0)
        return {"error": "the first round never saved a checkpoint and trained past it: "
                + " | ".join(said[-6:]), "codes": codes, "launcher": said}
    result = recovery(lines, fault_at, lost, len(procs))
    # what the job's host after the fault said (node 0, or the node that took over)
    host = result["new_host"] if result["new_host"] is not None else stay[0]
    said = lines.said(host)
    result.update(codes=codes, launcher=said, launcher_node=host, mode=mode,
                  node_local=lost in cfg["node_local"] and not memory)
    # the survivors keep their processes where the backend can re-form in a process
    # (horovod); on ps-lite they restart, and take their state from the node's memory
    kept = memory and backend == "horovod"
    # when the broken round's workers on the hosts that stay were gone: a worker blocked
    # in a collective ends only at its launcher's SIGKILL, 0.5 s after its SIGTERM
    result["old_ended"] = {} if kept else {
        str(node): None if ended[pid] is None else ended[pid] - fault_at
        for pid, node in old.items()}
    if memory and "error" not in result:
        pids = {e["pid"] for e in result["timelines"] if e["reformation"] > 0}
        if kept and not pids <= set(old):
            result["error"] = (f"the re-formed job's workers {sorted(pids)} are not the "
                               f"survivors' processes {sorted(old)}")
        elif not kept and pids & set(old):
            result["error"] = (f"the re-formed job's workers {sorted(pids & set(old))} "
                               "are the old round's: ps-lite's workers restart")
        elif not kept and result["resumed_from"] == 0:
            result["error"] = "the restarted workers began at step 0: no state in memory"
    if "error" not in result and any(codes[n] != 0 for n in stay):
        result["error"] = (f"nodes {stay[0]} and {stay[1]} ended with "
                           f"{[codes[n] for n in stay]}: " + " | ".join(said[-6:]))
    return result


def elastic_jobs(backends=None, modes=None) -> list[tuple[str, str]]:
    """Part 7's (backend, mode) pairs: each backend of ``backends`` (default
    ELASTIC['backends']) in each mode of ``modes`` (default ELASTIC['modes'])."""
    return [(b, m) for m in (modes or ELASTIC["modes"])
            for b in (backends or ELASTIC["backends"])]


def run_elastic(cfg, timeout: float, lost_hosts=None, backends=None, modes=None,
                faults=None) -> dict:
    """Part 7: recovery of an elastic ResNet-50 job from a lost host, on every backend
    and mode (elastic_jobs); ``lost_hosts``: the hosts to break (default
    ELASTIC['lost_hosts']), one at a time; ``faults``: how (default ELASTIC['faults'])."""
    lost_hosts = tuple(lost_hosts or ELASTIC["lost_hosts"])
    faults = tuple(faults or ELASTIC["faults"])
    pairs = elastic_jobs(backends, modes)
    setting = dict(ELASTIC, lost_hosts=lost_hosts, faults=faults, load_start=os.getloadavg(),
                   uptime_start=uptime(), jobs={})
    log(f"elastic: {ELASTIC['hosts']} hosts at {ELASTIC['rate']}, --nnodes "
        f"{ELASTIC['nnodes']}, host(s) {', '.join(map(str, lost_hosts))} lost, "
        f"{cfg['elastic_reps']} repetition(s) of each fault")
    with tempfile.TemporaryDirectory(prefix="dg-bench-cluster-") as tmp, \
            emulated_cluster.EmulatedCluster(num_hosts=ELASTIC["hosts"],
                                             rate=ELASTIC["rate"]) as cluster:
        for backend, mode in pairs:
            for lost, fault in itertools.product(lost_hosts, faults):
                runs = []
                for rep in range(cfg["elastic_reps"]):
                    run = run_elastic_job(cluster, backend, fault, lost, timeout, Path(tmp),
                                          mode)
                    runs.append(run)
                    log(f"  {backend} ({mode}), host {lost} {fault}, repetition {rep + 1}: "
                        + (f"FAILED {run['error'][:400]}" if "error" in run else
                           f"first step {run['total']:.1f} s after the fault ("
                           + ", ".join(f"{k} {v:.1f}" for k, v in run["phases"].items())
                           + "; old workers gone after "
                           + ", ".join("?" if t is None else f"{t:.1f}"
                                       for t in run["old_ended"].values()) + " s)"))
                name = f"{backend} host {lost} {fault}" + (" memory" if mode == "memory"
                                                            else "")
                setting["jobs"][name] = {
                    "backend": backend, "fault": fault, "lost": lost, "mode": mode,
                    "node_local": lost in ELASTIC["node_local"] and mode == "restart",
                    "runs": runs}
    setting["load_end"] = os.getloadavg()
    setting["uptime_end"] = uptime()
    return setting


def run_setting(setting: dict, cfg: dict, cases_path: Path, variants, parts,
                timeout: float, extra_variants=()) -> dict:
    ssh = any(transport == "mpi" for _, _, transport in (*variants, *extra_variants))
    result = {"hosts": setting["hosts"], "rate": setting["rate"],
              "rate_bits": report.rate_bits(setting["rate"]),
              "load_start": os.getloadavg(), "uptime_start": uptime()}
    log(f"setting: {setting['hosts']} hosts at {setting['rate']}")
    with tempfile.TemporaryDirectory(prefix="dg-bench-cluster-") as tmp, \
            emulated_cluster.EmulatedCluster(num_hosts=setting["hosts"], rate=setting["rate"],
                                             sshd=ssh) as cluster:
        workdir = Path(tmp)
        result["link"] = run_link(cluster, cfg["link_mib"])
        rates = result["link"]["bytes_per_s"]
        log("  link: plain TCP " + ", ".join(f"{r / 1e6:.0f}" for r in rates) + " MB/s"
            + (f"; errors: {result['link']['errors']}" if result["link"]["errors"] else ""))
        if "comm" in parts:
            result["comm"] = run_comm(cluster, cfg, cases_path, variants, timeout, workdir)
        if "train" in parts:
            result["train"] = run_train(cluster, cfg, setting["models"], variants, timeout,
                                        workdir)
        if "compress" in parts and (setting["hosts"], setting["rate"]) == (
                COMPRESS["hosts"], COMPRESS["rate"]):
            result["compress"] = run_train(
                cluster, cfg, COMPRESS["models"], (*variants, *extra_variants), timeout,
                workdir,
                jobs=COMPRESS_JOBS, rounds=cfg["compress_rounds"], tune_warmup=TUNE_WARMUP)
        if "lm" in parts and (setting["hosts"], setting["rate"]) == (
                COMPRESS["hosts"], COMPRESS["rate"]):
            result["lm"] = run_lm(cluster, variants, timeout, workdir)
    result["load_end"], result["uptime_end"] = os.getloadavg(), uptime()
    return result


# --------------------------------------------------------------------------- reports
# One report per part: a rerun of one part rewrites its own file only.
PART_FILES = {"comm": "RESULTS-cluster-comm.md", "train": "RESULTS-cluster-train.md",
              "compress": "RESULTS-cluster-compression.md", "lm": "RESULTS-cluster-lm.md",
              "servers": "RESULTS-cluster-servers.md", "async": "RESULTS-cluster-async.md",
              "elastic": "RESULTS-cluster-elastic.md"}
# where each part keeps its numbers: a key of each setting's results, or of the run's
_SETTING_PARTS = ("comm", "train", "compress", "lm")
_RUN_KEYS = {"servers": "server_hosts", "async": "async", "elastic": "elastic"}


def part_results(results: dict, part: str) -> dict | None:
    """The run's results with only ``part``'s numbers (None if it has none): the header's
    facts (machine, load, command) stay, the other parts' numbers go."""
    own = {k: v for k, v in results.items() if k not in _RUN_KEYS.values()}
    if part in _SETTING_PARTS:
        own["settings"] = [{k: v for k, v in s.items()
                            if k not in _SETTING_PARTS or k == part}
                           for s in results["settings"] if part in s]
        return own if own["settings"] else None
    if _RUN_KEYS[part] not in results:
        return None
    own["settings"] = []
    own[_RUN_KEYS[part]] = results[_RUN_KEYS[part]]
    return own


def raw_path(report_path: Path) -> Path:
    return report_path.with_name(report_path.stem.lower() + ".json")


def _run_facts(results: dict, part: str) -> dict:
    """What a report that merges several runs of ``part`` (report.MERGED_PARTS) says of
    one of them: its command, machine, load and the rows it measured."""
    own = report.part_of(results, part)
    return {"command": results["command"], "date": results["machine"]["date"],
            "minutes": results.get("minutes"), "cpu": results["machine"].get("cpu"),
            "dist_gluon": results["machine"]["versions"].get("dist_gluon"),
            "others_cpu_share": results.get("others_cpu_share"),
            "load_start": own.get("load_start"), "load_end": own.get("load_end"),
            "uptime_start": own.get("uptime_start"), "uptime_end": own.get("uptime_end"),
            "jobs": [report.row_name(table, name)
                     for table, rows in report.row_tables(results, part).items()
                     for name in rows]}


def merge_runs(results: dict, part: str, path: Path) -> dict:
    """``part``'s rows of ``results`` (part 3 or 7) added to the report at ``path`` (its
    raw numbers beside it): a row run again replaces the old one, the others stay; the
    first run's header and settings stay, and ``<part>_runs`` lists every run with its
    load and which rows it measured (each row's ``run`` is its index there)."""
    raw = raw_path(path)
    if not raw.exists():
        return results
    merged = json.loads(raw.read_text())
    runs = merged.setdefault(f"{part}_runs", [_run_facts(merged, part)])
    runs.append(_run_facts(results, part))
    tables = report.row_tables(merged, part)
    for table, rows in report.row_tables(results, part).items():
        for name, row in rows.items():
            tables.setdefault(table, {})[name] = dict(row, run=len(runs) - 1)
    return merged


def write_reports(results: dict, parts, out: Path | None) -> list[Path]:
    """Write the report (and the raw numbers beside it) of every part with results: to
    ``out`` all together if given, else each to its own file. Returns the reports."""
    if out is not None:
        jobs = [(results, out)]
    else:
        # (parts 8 and 9 write their own reports)
        jobs = [(own, HERE / PART_FILES[part]) for part in parts if part in PART_FILES
                and (own := part_results(results, part)) is not None]
    for own, path in jobs:
        report.write(own, path)
        raw_path(path).write_text(json.dumps(own, indent=1, default=str))
    return [path for _, path in jobs]


def run_scale(args, argv) -> None:
    """Part 9, into its own report (cluster/scale.py)."""
    sizes = args.scale_nodes or (scale.QUICK_SIZES if args.quick else scale.SIZES)
    results = {"command": " ".join([".venv/bin/python benchmarks/run_cluster.py",
                                    *(argv if argv is not None else sys.argv[1:])]),
               "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
               "machine": local_bench.machine(), "load_start": os.getloadavg(),
               "uptime_start": uptime()}
    log(f"scale: {', '.join(map(str, sizes))} nodes; load average "
        f"{results['load_start'][0]:.2f}")
    results.update(scale.run(sizes, args.job_timeout, log))
    results["load_end"] = os.getloadavg()
    results["uptime_end"] = uptime()
    path = HERE / ("RESULTS-cluster-scale-quick.md" if args.quick
                   else "RESULTS-cluster-scale.md")
    scale.write(results, path)
    log(f"wrote {path}")


# --------------------------------------------------------------------------- main
def parse_args(argv=None):
    parser = argparse.ArgumentParser(description="Benchmark dist_gluon and its peers on "
                                     "emulated hosts with rate-limited links; writes "
                                     "benchmarks/RESULTS-cluster-<part>.md, one file per "
                                     "part run.")
    parser.add_argument("--quick", action="store_true",
                        help="2 hosts at 1 Gbit/s, small sizes, ResNet-50 only (a few "
                             "minutes); writes RESULTS-cluster-quick.md unless --out is "
                             "given")
    parser.add_argument("--only", action="append",
                        choices=("comm", "train", "compress", "lm", "servers", "async",
                                 "elastic", "slow", "scale"),
                        help="run only this part (repeatable); default: all of them "
                             "(compress and lm run in the 2 hosts at 1 Gbit/s setting, "
                             "servers on 4 hosts, async on 2, elastic on 3, scale on 4 "
                             "to 256)")
    parser.add_argument("--scale-nodes", type=lambda text: [int(n) for n in text.split(",")],
                        default=None, metavar="N,N,...",
                        help="part 9 (scale): these numbers of nodes (default: "
                             f"{','.join(map(str, scale.SIZES))}; --quick: "
                             f"{','.join(map(str, scale.QUICK_SIZES))})")
    parser.add_argument("--setting", action="append", metavar="HOSTSxRATE",
                        help="run only this setting of the chosen configuration, e.g. "
                             "2x1gbit (repeatable); default: all of them")
    parser.add_argument("--out", type=Path, default=None,
                        help="write the report of every part run into this one file "
                             "(default: each part into its own benchmarks/"
                             "RESULTS-cluster-<part>.md)")
    parser.add_argument("--variant", action="append", metavar="LABEL",
                        help="run only this backend variant of parts 1-4, by its row label "
                             "(repeatable), e.g. 'horovod (MPI)' or part 3's 'horovod (MPI, "
                             "mpi_yield_when_idle=1)'; needs --out, since the part's report "
                             "would otherwise lose its other rows")
    parser.add_argument("--job-timeout", type=float, default=420,
                        help="seconds one benchmark job may run (default: 420)")
    parser.add_argument("--slow-only", action="append", choices=("throughput", "mnist", "lm"),
                        help="part 8: measure only this piece (repeatable), replacing its "
                             "entries in results-cluster-slow-links.json")
    parser.add_argument("--slow-rate", action="append", metavar="RATE",
                        help="part 8: only this link rate (e.g. 100mbit; repeatable)")
    parser.add_argument("--slow-model", action="append", choices=("resnet50", "vgg16"),
                        help="part 8: only this model (repeatable)")
    parser.add_argument("--lost-host", action="append", type=int,
                        choices=ELASTIC["lost_hosts"], metavar="HOST",
                        help="part 7 (elastic): break only this host (repeatable); "
                             "default: host 2 (checkpoints in a shared directory), then "
                             "host 0, the job's first host (node-local checkpoints)")
    parser.add_argument("--elastic-backend", action="append",
                        choices=ELASTIC["backends"], metavar="BACKEND",
                        help="part 7 (elastic): only this backend (repeatable), in every "
                             "mode of --elastic-mode; default: "
                             f"{', '.join(ELASTIC['backends'])}")
    parser.add_argument("--elastic-mode", action="append", choices=ELASTIC["modes"],
                        help="part 7 (elastic): only this mode (repeatable): restart "
                             "(from checkpoints) or memory (dg.elastic.State, the "
                             "survivors keep their processes); default: both")
    parser.add_argument("--elastic-fault", action="append", choices=ELASTIC["faults"],
                        help="part 7 (elastic): only this fault (repeatable): kill (every "
                             "process of the host SIGKILLed) or link (its link down); "
                             "default: both")
    parser.add_argument("--merge", action="store_true",
                        help="part 3 (compress) or 7 (elastic): add the rows run (e.g. of "
                             "a --variant) to the part's report already there (--out, or "
                             "its RESULTS-cluster-<part>.md) and its raw numbers, replacing "
                             "the rows run again and keeping the others; its header then "
                             "names every run merged in, with its load")
    args = parser.parse_args(argv)
    if args.merge:
        if args.only not in (["compress"], ["elastic"]) or args.quick:
            parser.error("--merge adds rows of part 3 or 7 to its report: give --only "
                         "compress or --only elastic alone, without --quick")
        args.out = args.out or HERE / PART_FILES[args.only[0]]
    if args.out is None and args.quick:
        args.out = HERE / "RESULTS-cluster-quick.md"
    if args.variant and args.out is None:
        parser.error("--variant runs some rows of a part only: give --out FILE, or --merge "
                     "(part 3), so that the part's own report keeps its other rows")
    labels = {label for label, _, _ in VARIANTS} | {v[0] for v in COMPRESS_EXTRA_VARIANTS}
    unknown = sorted(set(args.variant or ()) - labels)
    if unknown:
        parser.error(f"unknown --variant {', '.join(map(repr, unknown))}; the variants are "
                     + ", ".join(map(repr, sorted(labels))))
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    reason = emulated_cluster.skip_reason()
    if reason:
        print(f"bench-cluster: cannot emulate hosts here: {reason}", file=sys.stderr)
        return 1
    cfg = dict(QUICK if args.quick else FULL)
    if args.setting:
        known = {f"{s['hosts']}x{s['rate']}": s for s in cfg["settings"]}
        unknown = [name for name in args.setting if name not in known]
        if unknown:
            print(f"bench-cluster: unknown --setting {', '.join(unknown)}; the settings are "
                  + ", ".join(known), file=sys.stderr)
            return 2
        cfg["settings"] = [known[name] for name in args.setting]
    parts = args.only or ["comm", "train", "compress", "lm", "servers", "async", "elastic",
                          "slow", "scale"]
    if "scale" in parts:
        run_scale(args, argv)
        if not set(parts) - {"scale"}:
            return 0
    if not set(parts) & {"comm", "train", "compress", "lm"}:
        cfg["settings"] = []
    elif not set(parts) & {"comm", "train"}:
        cfg["settings"] = [s for s in cfg["settings"]
                           if (s["hosts"], s["rate"]) == (COMPRESS["hosts"], COMPRESS["rate"])]
    if "compress" in parts and not any(
            (s["hosts"], s["rate"]) == (COMPRESS["hosts"], COMPRESS["rate"])
            for s in cfg["settings"]):
        cfg["settings"] = cfg["settings"] + [dict(COMPRESS)]
    no_mpi = mpi_support()
    transports = launcher_has_transport()
    variants = [(label, backend, transport if transports else None)
                for label, backend, transport in VARIANTS
                if (transport != "mpi" or no_mpi is None)
                and (not args.variant or label in args.variant)]
    # part 3's extra rows, when named: horovod with other settings of its transport
    extra_variants = [v for v in COMPRESS_EXTRA_VARIANTS
                      if transports and (v[2] != "mpi" or no_mpi is None)
                      and v[0] in (args.variant or ())]
    started = time.monotonic()
    results = {"command": " ".join([".venv/bin/python benchmarks/run_cluster.py",
                                    *(argv if argv is not None else sys.argv[1:])]),
               "config": cfg, "machine": local_bench.machine(),
               "load_start": os.getloadavg(), "mpi": no_mpi, "settings": []}
    cpu_start = local_bench.cpu_seconds()
    log(f"{'quick' if args.quick else 'full'} run of {', '.join(parts)}; load average "
        f"{results['load_start'][0]:.2f}; horovod over MPI: "
        + ("included" if no_mpi is None else f"not measured ({no_mpi})"))
    with tempfile.TemporaryDirectory(prefix="dg-bench-cluster-") as tmp:
        cases = local_bench.comm_cases(cfg["sizes_mib"])
        cases_path = Path(tmp) / "cases.json"
        cases_path.write_text(json.dumps(cases))
        results["cases"] = [{"name": c["name"], "tensors": len(c["shapes"]),
                             "bytes": sum(report.numel(s) for s in c["shapes"]) * 4}
                            for c in cases]
        results["minutes"], results["load_end"] = 0.0, os.getloadavg()
        if "servers" in parts:
            # the 100 MiB sum and ResNet-50's shapes
            server_cases = Path(tmp) / "server-cases.json"
            server_cases.write_text(json.dumps(local_bench.comm_cases((100,))))
            results["server_hosts"] = run_server_hosts(cfg, server_cases, args.job_timeout)
        if "async" in parts:
            results["async"] = run_async(cfg, args.job_timeout)
        if "elastic" in parts:
            results["elastic"] = run_elastic(cfg, args.job_timeout, args.lost_host,
                                             args.elastic_backend, args.elastic_mode,
                                             args.elastic_fault)
            results["minutes"] = (time.monotonic() - started) / 60
            results["others_cpu_share"] = local_bench.others_share(
                cpu_start, local_bench.cpu_seconds(), results["machine"]["cores"] or 1)
            if args.merge:
                return _merge(results, "elastic", args.out)
        if "slow" in parts:
            # its own files, whatever else runs: reruns of other parts never overwrite it
            slow_out = HERE / (SLOW_RESULTS if not args.quick else
                               SLOW_RESULTS.replace(".md", "-quick.md"))
            run_slow_part(args, results, slow_out)
            if not set(parts) - {"slow", "scale"}:
                return 0
        if set(parts) & {"servers", "async", "elastic"}:
            results["minutes"] = (time.monotonic() - started) / 60
            results["load_end"] = os.getloadavg()
            results["others_cpu_share"] = local_bench.others_share(
                cpu_start, local_bench.cpu_seconds(), results["machine"]["cores"] or 1)
            write_reports(results, parts, args.out)
        for setting in cfg["settings"]:
            results["settings"].append(run_setting(setting, cfg, cases_path, variants,
                                                   parts, args.job_timeout,
                                                   extra_variants))
            # a partial report after every setting, in case a later one is interrupted
            # (not with --merge: it would overwrite the report its rows are to join)
            results["minutes"] = (time.monotonic() - started) / 60
            results["load_end"] = os.getloadavg()
            results["others_cpu_share"] = local_bench.others_share(
                cpu_start, local_bench.cpu_seconds(), results["machine"]["cores"] or 1)
            if not args.merge:
                write_reports(results, parts, args.out)
    if args.merge:
        return _merge(results, "compress", args.out)
    written = write_reports(results, parts, args.out)
    log(f"wrote {', '.join(str(p) for p in written)} (and the raw numbers beside each) in "
        f"{results['minutes']:.1f} minutes")
    return _failed(results)


def _merge(results: dict, part: str, out: Path) -> int:
    """--merge: ``part``'s rows into its report at ``out``, whose other rows stay, each
    run with its own header facts."""
    merged = merge_runs(dict(results, load_end=os.getloadavg()), part, out)
    write_reports(merged, [part], out)
    log(f"merged part {report.MERGED_PARTS[part]}'s rows into {out} (and the raw numbers "
        "beside it)")
    return _failed(results)


def _failed(results: dict) -> int:
    """1 (and their names logged) if any job of the run failed, else 0."""
    failed = [f"{s['hosts']}x{s['rate']} collectives {label}" for s in results["settings"]
              for label, job in s.get("comm", {}).items() if "error" in job]
    failed += [f"{s['hosts']}x{s['rate']} {part} {model} {label}"
               for s in results["settings"] for part in ("train", "compress")
               for model, per in s.get(part, {}).items()
               for label, slot in per.items() if slot["errors"]]
    failed += [f"elastic {name} repetition {i + 1}"
               for name, job in results.get("elastic", {}).get("jobs", {}).items()
               for i, run in enumerate(job["runs"]) if "error" in run]
    if failed:
        log("failed jobs: " + ", ".join(failed))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
