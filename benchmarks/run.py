"""`make bench`: dist_gluon against the raw libraries, side by side, in one run.

    .venv/bin/python benchmarks/run.py            # full run: 8 minutes on 2 idle cores
    .venv/bin/python benchmarks/run.py --only codecs   # one part: RESULTS-codecs.md
    .venv/bin/python benchmarks/run.py --quick    # smaller sizes, fewer repetitions (3)

1. Communication: sums of 1 to 100 MiB and of ResNet-50's parameter shapes over 2
   workers through dist_gluon's horovod, dist_sync and p3 backends against raw
   ``hvd.allreduce_`` and MXNet's raw ``kv.pushpull``, as GB/s and as a share of a local
   memcpy of the same bytes (bench_comm.py); horovod over Gloo and, where horovod is
   built with MPI and mpirun is installed, over MPI (``--transport mpi``).
2. Trainer step of ResNet-18 and of a 100M-parameter MLP with 2 workers: DistributedTrainer
   on each backend (and horovod over MPI) against horovod.mxnet.DistributedTrainer,
   gluon.Trainer(kvstore='dist_sync') and a hand-written loop of raw collectives
   (bench_trainer.py).
3. Scaling: samples/s of examples/mnist/train_gluon.py with 1 and 2 workers.
4. SyncBatchNorm: the training step of ResNet-18 with dg.SyncBatchNorm against
   nn.BatchNorm, 2 workers (bench_syncbn.py).
5. Codecs: GB/s of gradient that each compression codec processes on one core (2-bit,
   PowerSGD and BytePS's onebit fused and on stock operators, fp16) on a 4096 x 25088
   matrix and on
   ResNet-50's gradients, beside MXNet's own C++ 2-bit and a memory copy
   (bench_codecs.py, one process).
6. Memory: peak resident memory, optimizer-state bytes and step time of each worker
   with ``shard_optimizer_states`` and without, Adam on a BERT-base-sized model and on
   ResNet-50, 2 and 4 workers, horovod and dist_sync (bench_memory.py).

Every job runs through ``python -m dist_gluon.launch`` with OMP_NUM_THREADS=1 per
process. Each part's report has a file of its own, benchmarks/RESULTS-<part>.md (comm,
trainer, scaling, syncbn, codecs), with its raw numbers beside it (results-<part>.json),
so that a rerun of one part (`--only codecs`) never loses another part's figures; a
--quick run writes everything it ran into RESULTS-quick.md, and --out FILE into FILE.
"""
from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import platform
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# Set before numpy/mxnet are imported: this process measures the local memcpy reference
# with one thread, like each worker, and its children inherit the setting.
os.environ["OMP_NUM_THREADS"] = "1"

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
PY = sys.executable
RESULT_TAG = "BENCH "
BACKENDS = ("horovod", "dist_sync", "p3")
# horovod over MPI: a job of its own beside horovod over Gloo (the "horovod" job)
MPI = "horovod-mpi"
MIB = 1 << 20

FULL = {
    "sizes_mib": (1, 10, 100), "comm_reps": 7, "comm_warmup": 2,
    "resnet": {"warmup": 3, "steps": 1, "rounds": 24},
    "mlp": {"warmup": 1, "steps": 1, "rounds": 8, "width": 4096, "layers": 6},
    "mnist_epochs": 4, "mnist_reps": 2, "scaling_backends": BACKENDS,
    "mnist_large_batches": (128,),
    "syncbn": {"warmup": 4, "rounds": 10, "backends": BACKENDS},
    "codecs": {"quick": False},
    "memory": {"models": ("bert", "resnet50"), "workers": (2, 4),
               "backends": ("horovod", "dist_sync"), "warmup": 2, "steps": 4},
}
QUICK = {
    "sizes_mib": (1, 10), "comm_reps": 3, "comm_warmup": 1,
    "resnet": {"warmup": 1, "steps": 1, "rounds": 6},
    "mlp": {"warmup": 1, "steps": 1, "rounds": 2, "width": 2048, "layers": 6},
    "mnist_epochs": 1, "mnist_reps": 1, "scaling_backends": ("horovod",),
    "mnist_large_batches": (),
    "syncbn": {"warmup": 1, "rounds": 3, "backends": ("horovod",)},
    "codecs": {"quick": True},
    "memory": {"models": ("resnet50",), "workers": (2,), "backends": ("horovod",),
               "warmup": 1, "steps": 2},
}


def log(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", flush=True)


# --------------------------------------------------------------------------- jobs
def mpi_available() -> bool:
    """mpirun is installed and horovod is built with MPI."""
    if shutil.which("mpirun") is None:
        return False
    probe = subprocess.run([PY, "-c", "import horovod.mxnet as h; print(h.mpi_built())"],
                           capture_output=True, text=True)
    return probe.stdout.strip() == "True"


def jobs() -> tuple[str, ...]:
    """The backends measured, and horovod over MPI where it can run."""
    return BACKENDS + ((MPI,) if mpi_available() else ())


def launcher_flags(job: str) -> list[str]:
    # the transport is explicit: the launcher's default for horovod depends on the machine
    if job == MPI:
        return ["--backend", "horovod", "--transport", "mpi"]
    if job == "horovod":
        return ["--backend", "horovod", "--transport", "gloo"]
    return ["--backend", job]


def launch(backend: str, workers: int, argv: list[str], timeout: float) -> dict:
    """Run ``argv`` (after the python executable) as a dist_gluon job (``backend`` is a
    backend name or MPI); return the ``BENCH`` payload of rank 0, or {'error': ...},
    plus the job's wall time."""
    cmd = [PY, "-m", "dist_gluon.launch", "-n", str(workers), *launcher_flags(backend),
           "--timeout", str(timeout), "--", PY, *argv]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    started = time.monotonic()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    seconds = time.monotonic() - started
    rank0 = [line[4:] for line in proc.stdout.splitlines() if line.startswith("[0] ")]
    payloads = [json.loads(line[len(RESULT_TAG):]) for line in rank0
                if line.startswith(RESULT_TAG)]
    if proc.returncode == 0 and payloads:
        # rank 0's line on horovod's tuned cycle (on stderr), where it printed one
        tuner = re.findall(r"dist_gluon: horovod(?: tuned on steps|'s cycle time not "
                           r"tuned).*", proc.stderr)
        return dict(payloads[-1], job_seconds=seconds, stdout=rank0,
                    **({"tuner": tuner[-1]} if tuner else {}))
    tail = (proc.stderr.strip().splitlines() or ["(no stderr)"])[-8:]
    return {"error": f"exit code {proc.returncode}: " + " | ".join(tail),
            "job_seconds": seconds, "stdout": rank0}


def describe(payload: dict) -> str:
    if "error" in payload:
        return "FAILED " + payload["error"][:400]
    return f"done in {payload['job_seconds']:.0f} s"


# --------------------------------------------------------------------------- machine
def machine() -> dict:
    info = {"date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
            "cores": os.cpu_count(), "python": platform.python_version(),
            "platform": platform.platform()}
    try:
        with open("/proc/cpuinfo") as f:
            models = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        info["cpu"] = models[0] if models else platform.processor()
        with open("/proc/meminfo") as f:
            kib = int(next(line for line in f if line.startswith("MemTotal")).split()[1])
        info["memory_gib"] = round(kib / MIB, 1)
    except (OSError, StopIteration, ValueError):
        info.setdefault("cpu", platform.processor())
    versions = {}
    mpirun = shutil.which("mpirun")
    if mpirun:
        out = subprocess.run([mpirun, "--version"], capture_output=True, text=True).stdout
        versions["mpi"] = (out.splitlines() or ["mpirun"])[0]
    versions["horovod_mpi"] = mpi_available()
    for dist in ("mxnet", "numpy", "horovod", "gluoncv"):
        try:
            versions[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            versions[dist] = "not installed"
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO,
                            capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--", "dist_gluon"], cwd=REPO,
                           capture_output=True, text=True).stdout.strip()
    versions["dist_gluon"] = f"{commit}{' + uncommitted changes in dist_gluon/' if dirty else ''}"
    info["versions"] = versions
    return info


def load() -> tuple[float, float, float]:
    return os.getloadavg()


def cpu_seconds() -> dict:
    """CPU seconds used so far by the whole machine (/proc/stat) and by this process
    with its finished children (the benchmark jobs), to tell how busy others kept the
    machine during the run."""
    ours = sum(getattr(resource.getrusage(who), field)
               for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
               for field in ("ru_utime", "ru_stime"))
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
        # user nice system idle iowait irq softirq steal: all but idle and iowait
        busy = sum(fields[:8]) - fields[3] - fields[4]
        machine_total = busy / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        machine_total = None
    return {"machine": machine_total, "ours": ours, "wall": time.monotonic()}


def others_share(start: dict, end: dict, cores: int) -> float | None:
    """Share of the machine's CPU capacity that other processes used between two
    cpu_seconds() readings."""
    if start["machine"] is None or end["machine"] is None:
        return None
    others = (end["machine"] - start["machine"]) - (end["ours"] - start["ours"])
    return max(0.0, others) / ((end["wall"] - start["wall"]) * cores)


# --------------------------------------------------------------------------- part 1
def resnet50_shapes() -> list[list[int]]:
    """Shapes of ResNet-50's trainable parameters (gluoncv resnet50_v1b), model order."""
    import mxnet as mx
    from gluoncv.model_zoo import get_model

    net = get_model("resnet50_v1b", pretrained=False)
    net.initialize()
    with mx.autograd.record():
        net(mx.nd.zeros((1, 3, 64, 64)))
    return [list(p.shape) for p in net.collect_params().values() if p.grad_req != "null"]


def comm_cases(sizes_mib) -> list[dict]:
    cases = [{"name": f"{s} MiB", "shapes": [[s * MIB // 4]]} for s in sizes_mib]
    shapes = resnet50_shapes()
    total = sum(_numel(s) for s in shapes) * 4
    cases.append({"name": f"ResNet-50 ({len(shapes)} tensors, {total / MIB:.1f} MiB)",
                  "shapes": shapes})
    return cases


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def local_copy(cases, reps: int) -> dict:
    """Median seconds of a one-thread local copy of each case's tensors, with numpy
    (np.copyto) and with MXNet (NDArray.copyto): this machine's memory limit."""
    import mxnet as mx
    import numpy as np

    out = {}
    for case in cases:
        shapes = [tuple(s) for s in case["shapes"]]
        src = [np.ones(s, dtype=np.float32) for s in shapes]
        dst = [np.empty_like(a) for a in src]
        nd_src = [mx.nd.ones(s) for s in shapes]
        nd_dst = [mx.nd.empty(s) for s in shapes]
        timings = {"numpy": [], "mxnet": []}
        for rep in range(reps + 2):
            t0 = time.perf_counter()
            for a, b in zip(src, dst):
                np.copyto(b, a)
            t1 = time.perf_counter()
            mx.nd.waitall()
            t2 = time.perf_counter()
            for a, b in zip(nd_src, nd_dst):
                a.copyto(b)
            mx.nd.waitall()
            t3 = time.perf_counter()
            if rep >= 2:
                timings["numpy"].append(t1 - t0)
                timings["mxnet"].append(t3 - t2)
        out[case["name"]] = {k: statistics.median(v) for k, v in timings.items()}
    return out


def run_comm(cfg, workdir: Path, timeout: float) -> dict:
    cases = comm_cases(cfg["sizes_mib"])
    path = workdir / "cases.json"
    path.write_text(json.dumps(cases))
    copies = local_copy(cases, reps=cfg["comm_reps"])
    log("local memcpy measured")
    results = {}
    for backend in jobs():
        results[backend] = launch(backend, 2, [str(HERE / "bench_comm.py"), "--cases",
                                               str(path), "--reps", str(cfg["comm_reps"]),
                                               "--warmup", str(cfg["comm_warmup"])], timeout)
        log(f"communication, {backend}: {describe(results[backend])}")
    return {"cases": [{"name": c["name"], "tensors": len(c["shapes"]),
                       "bytes": sum(_numel(s) for s in c["shapes"]) * 4} for c in cases],
            "copy": copies, "jobs": results}


# --------------------------------------------------------------------------- part 2
# On horovod the trainers share one job and take turns. On ps-lite each gets its own job
# (with the compute-only step beside it as a gauge of the machine's load): MXNet allows
# one ps-lite store per process, and a job whose server holds the keys of two trainers
# taking turns ran both about 15% slower than either alone (ResNet-18 on p3).
TRAINER_JOBS = (
    ("horovod", "dist_gluon,horovod.mxnet,raw,compute"),
    (MPI, "dist_gluon,horovod.mxnet,raw,compute"),
    ("dist_sync", "dist_gluon,compute"),
    ("dist_sync", "raw,compute"),
    ("dist_sync", "gluon,compute"),
    ("p3", "dist_gluon,compute"),
    ("p3", "raw,compute"),
    ("p3", "gluon,compute"),
)


def run_trainer(cfg, timeout: float) -> dict:
    models = {}
    for model in ("resnet18", "mlp"):
        opts = cfg["resnet" if model == "resnet18" else "mlp"]
        extra = ["--warmup", str(opts["warmup"]), "--steps", str(opts["steps"]),
                 "--rounds", str(opts["rounds"])]
        if model == "mlp":
            extra += ["--mlp-width", str(opts["width"]), "--mlp-layers", str(opts["layers"])]
        measured = jobs()
        merged: dict[str, dict] = {b: {"times": {}} for b in measured}
        for backend, impls in TRAINER_JOBS:
            if backend not in measured:
                continue
            payload = launch(backend, 2, [str(HERE / "bench_trainer.py"), "--model", model,
                                          "--impls", impls, *extra], timeout)
            log(f"trainer step, {model}, {backend} [{impls}]: {describe(payload)}")
            slot = merged[backend]
            if "error" in payload:
                slot.setdefault("errors", {})[impls] = payload["error"]
                continue
            times = dict(payload["times"])
            main = impls.split(",")[0]
            if main != "dist_gluon" and "compute" in times:
                # compute-only of another job than DistributedTrainer's
                times[f"compute_{main}_job"] = times.pop("compute")
            slot["times"].update(times)
            slot.update({k: payload[k] for k in ("parameters", "tensors", "batch")})
        models[model] = merged
    return models


# --------------------------------------------------------------------------- part 3
MNIST_EXAMPLE = REPO / "examples" / "mnist" / "train_gluon.py"
SUMMARY = re.compile(r"summary:.*samples/s=([0-9.]+)")


def run_scaling(cfg, timeout: float) -> dict:
    """samples/s of the MNIST example (its own final summary line), median of reps."""
    if not MNIST_EXAMPLE.exists():
        return {"error": f"{MNIST_EXAMPLE.relative_to(REPO)} not found"}
    runs = [("horovod", 1, 32)] + [(b, 2, 32) for b in cfg["scaling_backends"]]
    runs += [(b, n, batch) for batch in cfg["mnist_large_batches"] for b, n in
             (("horovod", 1), ("horovod", 2))]
    out = {}
    for backend, workers, batch in runs:
        speeds, errors = [], []
        for _ in range(cfg["mnist_reps"]):
            payload = launch(backend, workers, [str(MNIST_EXAMPLE), "--epochs",
                                                str(cfg["mnist_epochs"]), "--batch-size",
                                                str(batch), "--log-interval", "1000"], timeout)
            found = [SUMMARY.search(line) for line in payload["stdout"]]
            found = [float(m.group(1)) for m in found if m]
            if found:
                speeds.append(found[-1])
            else:
                errors.append(payload.get("error", "no 'summary: ... samples/s=' line"))
        label = f"{backend} x{workers}, batch {batch}"
        out[label] = {"backend": backend, "workers": workers, "batch": batch, "samples_per_s":
                      statistics.median(speeds) if speeds else None,
                      "runs": speeds, "errors": errors}
        log(f"scaling, MNIST example, {label}: "
            + (f"{out[label]['samples_per_s']:.0f} samples/s" if speeds
               else f"FAILED {errors[:1]}"))
    return out


# --------------------------------------------------------------------------- part 4
def run_syncbn(cfg, timeout: float) -> dict:
    """Step times of ResNet-18 with SyncBatchNorm and with BatchNorm, per backend."""
    opts = cfg["syncbn"]
    out = {}
    for backend in opts["backends"]:
        payload = launch(backend, 2, [str(HERE / "bench_syncbn.py"), "--warmup",
                                      str(opts["warmup"]), "--rounds", str(opts["rounds"])],
                         timeout)
        log(f"SyncBatchNorm step, resnet18_v1b, {backend}: {describe(payload)}")
        payload.pop("stdout", None)
        # horovod's cycle, tuned on the SyncBatchNorm model's steps (bench_syncbn.py)
        tuned = re.search(r"HOROVOD_CYCLE_TIME=([0-9.]+) \(ms\)", payload.get("tuner", ""))
        if tuned:
            payload["cycle_ms"] = float(tuned.group(1))
        out[backend] = payload
    return out


# --------------------------------------------------------------------------- part 6
def run_memory(cfg, timeout: float) -> dict:
    """Every rank's peak RSS, optimizer-state bytes and step time, sharded and not."""
    opts = cfg["memory"]
    rows = []
    start = load()
    for model in opts["models"]:
        for backend in opts["backends"]:
            for workers in opts["workers"]:
                for shard in (0, 1):
                    payload = launch(backend, workers, [
                        str(HERE / "bench_memory.py"), "--model", model, "--shard",
                        str(shard), "--warmup", str(opts["warmup"]), "--steps",
                        str(opts["steps"])], timeout)
                    log(f"memory, {model}, {backend}, {workers} workers, "
                        f"{'sharded' if shard else 'unsharded'}: {describe(payload)}")
                    payload.pop("stdout", None)
                    rows.append(dict(payload, model=model, backend=backend, workers=workers,
                                     shard=bool(shard)))
    return {"rows": rows, "load_start": start, "load_end": load()}


def memory_table(memory: dict) -> list[str]:
    def gib(value):
        return f"{value / (1 << 30):.2f}"

    lines = ["| model | backend | workers | optimizer state / worker (GiB) | "
             "peak RSS / worker (GiB) | step (s) | state vs unsharded | RSS saved / state "
             "saved |",
             "|---|---|---|---|---|---|---|---|"]
    rows = memory["rows"]
    for row in rows:
        if "error" in row:
            lines.append(f"| {row['model']} | {row['backend']} | {row['workers']} | "
                         f"{'sharded' if row['shard'] else 'unsharded'}: failed "
                         f"({row['error'][:120]}) | | | | |")
            continue
        ranks = row["ranks"]
        state = max(r["state_bytes"] for r in ranks)
        rss = max(r["peak_rss"] for r in ranks)
        step = max(r["step"] for r in ranks)
        label = "sharded" if row["shard"] else "unsharded"
        compare = ["", ""]
        base = next((b for b in rows if not b["shard"] and "error" not in b
                     and (b["model"], b["backend"], b["workers"])
                     == (row["model"], row["backend"], row["workers"])), None)
        if row["shard"] and base is not None:
            base_state = max(r["state_bytes"] for r in base["ranks"])
            base_rss = max(r["peak_rss"] for r in base["ranks"])
            base_step = max(r["step"] for r in base["ranks"])
            compare = [f"{state / base_state:.3f} (1/N = {1 / row['workers']:.3f}); step "
                       f"{step / base_step:.2f}x",
                       f"{(base_rss - rss) / max(base_state - state, 1):.0%}"]
        lines.append(f"| {row['model']} ({row['parameters'] / 1e6:.0f} M) | {row['backend']}"
                     f" | {row['workers']} {label} | {gib(state)} | {gib(rss)} | {step:.2f} | "
                     f"{compare[0]} | {compare[1]} |")
    return lines


# --------------------------------------------------------------------------- part 5
CODEC_ROWS = ("2bit", "2bit operators", "powersgd", "powersgd operators", "fp16", "onebit",
              "onebit operators", "mxnet 2bit", "memory copy")


def run_codecs(cfg, workdir: Path, timeout: float) -> dict:
    """Codec throughput on one core, in one process (no launcher: nothing is sent)."""
    shapes = workdir / "resnet50_shapes.json"
    shapes.write_text(json.dumps(resnet50_shapes()))
    cmd = [PY, str(HERE / "bench_codecs.py"), "--shapes", str(shapes)]
    if cfg["codecs"]["quick"]:
        cmd.append("--quick")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    try:
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    payloads = [json.loads(line[len(RESULT_TAG):]) for line in proc.stdout.splitlines()
                if line.startswith(RESULT_TAG)]
    if proc.returncode == 0 and payloads:
        log("codec throughput measured")
        return payloads[-1]
    tail = (proc.stderr.strip().splitlines() or ["(no stderr)"])[-8:]
    log(f"codec throughput FAILED: {' | '.join(tail)[:400]}")
    return {"error": f"exit code {proc.returncode}: " + " | ".join(tail)}


def codecs_table(codecs: dict) -> list[str]:
    if "error" in codecs:
        return [f"Not measured: {codecs['error']}."]
    cases = codecs["cases"]
    names = {"matrix": "matrix", "resnet50": "ResNet-50"}
    header = " | ".join(f"{names.get(c, c)} ({cases[c]['tensors']} tensor"
                        f"{'s' if cases[c]['tensors'] > 1 else ''}, "
                        f"{cases[c]['bytes'] / MIB:.0f} MiB): GB/s, ms" for c in cases)
    lines = [f"| codec | {header} |", "|---|" + "---:|" * len(cases)]
    for row in CODEC_ROWS:
        cells = []
        for case in cases.values():
            seconds = case["seconds"].get(row)
            cells.append("–" if seconds is None else
                         f"{case['bytes'] / seconds / 1e9:.2f}, {seconds * 1e3:.0f}")
        lines.append(f"| {row} | " + " | ".join(cells) + " |")
    return lines


def codec_targets(codecs: dict) -> list[str]:
    rows = []
    for case, entry in codecs.get("cases", {}).items():
        ours, theirs = entry["seconds"].get("2bit"), entry["seconds"].get("mxnet 2bit")
        ok = None if ours is None or theirs is None else ours <= theirs
        rows.append(f"| codecs, {case}: our 2-bit at least as fast as MXNet's 2-bit "
                    f"(MXNet's time / ours >= 1) | {ratio(theirs, ours)} | {verdict(ok)} |")
    return rows


# --------------------------------------------------------------------------- report
def ms(seconds) -> str:
    return "–" if seconds is None else f"{seconds * 1e3:.1f}"


def ratio(a, b, digits=2) -> str:
    return "–" if a is None or b is None else f"{a / b:.{digits}f}"


def job_label(job: str) -> str:
    return {"horovod": "horovod (Gloo)", MPI: "horovod (MPI)"}.get(job, job)


def comm_table(comm: dict) -> list[str]:
    lines = ["| case | backend | local memcpy GB/s | dist_gluon GB/s | raw GB/s | "
             "dist_gluon time / raw time | dist_gluon / memcpy | raw / memcpy |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for case in comm["cases"]:
        name, nbytes = case["name"], case["bytes"]
        copy_bw = nbytes / comm["copy"][name]["numpy"] / 1e9
        for backend, job in comm["jobs"].items():
            if "error" in job:
                lines.append(f"| {name} | {job_label(backend)} | {copy_bw:.2f} | failed | "
                             "failed | | | |")
                continue
            result = next(r for r in job["results"] if r["case"] == name)
            t_dg = result["times"]["dist_gluon"]["median"]
            t_raw = result["times"]["raw"]["median"]
            bw_dg, bw_raw = nbytes / t_dg / 1e9, nbytes / t_raw / 1e9
            lines.append(f"| {name} | {job_label(backend)} | {copy_bw:.2f} | {bw_dg:.3f} | "
                         f"{bw_raw:.3f} | {t_dg / t_raw:.2f} | {bw_dg / copy_bw:.3f} | "
                         f"{bw_raw / copy_bw:.3f} |")
    return lines


def _comm_time(comm: dict, job: str, case: str, impl: str):
    result = comm["jobs"].get(job, {})
    found = [r for r in result.get("results", []) if r["case"] == case]
    return found[0]["times"][impl]["median"] if found else None


def mpi_table(results: dict) -> list[str]:
    """Horovod over MPI beside horovod over Gloo: the same calls, in jobs of their own."""
    lines = ["| measured | over Gloo | over MPI | MPI time / Gloo time |",
             "|---|---:|---:|---:|"]
    comm = results.get("comm")
    if comm:
        for case in comm["cases"]:
            name, nbytes = case["name"], case["bytes"]
            for impl, what in (("dist_gluon", "dist_gluon pushpull"),
                               ("raw", "raw hvd.allreduce_")):
                gloo = _comm_time(comm, "horovod", name, impl)
                mpi = _comm_time(comm, MPI, name, impl)
                cells = [f"{ms(t)} ms ({nbytes / t / 1e9:.2f} GB/s)" if t else "–"
                         for t in (gloo, mpi)]
                lines.append(f"| {name}, {what} | {cells[0]} | {cells[1]} | "
                             f"{ratio(mpi, gloo)} |")
    for model, per_backend in results.get("trainer", {}).items():
        gloo, mpi = per_backend.get("horovod", {}), per_backend.get(MPI, {})
        for impl, what in (("dist_gluon", "DistributedTrainer"),
                           ("horovod.mxnet", "horovod.mxnet.DistributedTrainer"),
                           ("raw", "raw collectives"), ("compute", "compute only")):
            a = _t(gloo, impl) if gloo else None
            b = _t(mpi, impl) if mpi else None
            lines.append(f"| {model} step, {what} | {ms(a)} ms | {ms(b)} ms | "
                         f"{ratio(b, a)} |")
    return lines


def _t(slot, impl):
    entry = slot["times"].get(impl)
    return entry["median"] if entry else None


def trainer_table(trainer: dict) -> list[str]:
    lines = ["| model | backend | compute only | raw collectives | **DistributedTrainer** | "
             "horovod.mxnet | gluon.Trainer dist_sync | DT / horovod.mxnet | "
             "DT / gluon dist_sync | DT overhead over raw |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for model, per_backend in trainer.items():
        for backend, slot in per_backend.items():
            if "parameters" in slot:
                label = f"{model} ({slot['parameters'] / 1e6:.1f}M params, {slot['tensors']} " \
                        f"tensors, batch {slot['batch']})"
            else:
                label = model
            dg, raw = _t(slot, "dist_gluon"), _t(slot, "raw")
            hvd, gl = _t(slot, "horovod.mxnet"), _t(slot, "gluon")
            raw_cell, gl_cell = ms(raw), ms(gl)
            if raw is not None and _t(slot, "compute_raw_job") is not None:
                raw_cell += f" ({ms(_t(slot, 'compute_raw_job'))})"
            if gl is not None and _t(slot, "compute_gluon_job") is not None:
                gl_cell += f" ({ms(_t(slot, 'compute_gluon_job'))})"
            overhead = "–" if dg is None or raw is None else f"{(dg / raw - 1) * 100:+.1f}%"
            lines.append(f"| {label} | {job_label(backend)} | {ms(_t(slot, 'compute'))} | "
                         f"{raw_cell} | "
                         f"**{ms(dg)}** | {ms(hvd)} | {gl_cell} | {ratio(dg, hvd)} | "
                         f"{ratio(dg, gl)} | {overhead} |")
            for impls, error in slot.get("errors", {}).items():
                lines.append(f"| {model} | {backend} | job [{impls}] failed: "
                             f"{error[:200]} | | | | | | | |")
    return lines


def verdict(ok) -> str:
    return "–" if ok is None else ("met" if ok else "**not met**")


def _per_compute(slot: dict, impl: str):
    """A trainer's step time over the compute-only step of its own job: on ps-lite each
    trainer has a job of its own, whose compute-only steps differ (by up to 1.7x under
    load), so raw step times are only comparable within one job."""
    step = _t(slot, impl)
    compute = _t(slot, f"compute_{impl}_job") or _t(slot, "compute")
    return None if step is None or compute is None else step / compute


def targets(results: dict) -> list[str]:
    rows = ["| target | measured | |", "|---|---|---|"]
    trainer = results.get("trainer", {})
    for model in trainer:
        hv = trainer[model]["horovod"]
        dg, hvd = _t(hv, "dist_gluon"), _t(hv, "horovod.mxnet")
        ok = None if dg is None or hvd is None else dg / hvd <= 1.0
        rows.append(f"| {model}: DistributedTrainer on horovod / horovod.mxnet.Distributed"
                    f"Trainer <= 1.0 (one job) | {ratio(dg, hvd)} | {verdict(ok)} |")
        for backend in ("dist_sync", "p3"):
            if backend not in trainer[model]:
                continue
            slot = trainer[model][backend]
            dg, gl = _per_compute(slot, "dist_gluon"), _per_compute(slot, "gluon")
            ok = None if dg is None or gl is None else dg / gl <= 1.0
            rows.append(f"| {model}: DistributedTrainer on {job_label(backend)} / gluon."
                        f"Trainer(kvstore='dist_sync') <= 1.0 (each step over its job's "
                        f"compute-only step) | {ratio(dg, gl)} | {verdict(ok)} |")
        for backend, slot in trainer[model].items():
            dg, raw = _per_compute(slot, "dist_gluon"), _per_compute(slot, "raw")
            ok = None if dg is None or raw is None else dg / raw - 1 < 0.05
            over = "–" if ok is None else f"{(dg / raw - 1) * 100:+.1f}%"
            rows.append(f"| {model}: DistributedTrainer overhead over raw collectives on "
                        f"{job_label(backend)} < 5% | {over} | {verdict(ok)} |")
    if "mlp" in trainer:
        p3, ds = _t(trainer["mlp"]["p3"], "dist_gluon"), _t(trainer["mlp"]["dist_sync"],
                                                             "dist_gluon")
        ok = None if p3 is None or ds is None else p3 < ds
        rows.append(f"| mlp: DistributedTrainer on p3 faster than on dist_sync (p3 / "
                    f"dist_sync < 1.0) | {ratio(p3, ds)} | {verdict(ok)} |")
    for backend, payload in results.get("syncbn", {}).items():
        times = payload.get("times", {})
        sync, plain = (times.get(k, {}).get("median") for k in ("syncbn", "batchnorm"))
        ok = None if sync is None or plain is None else sync / plain <= 1.3
        rows.append(f"| resnet18: SyncBatchNorm step / BatchNorm step on {backend} <= 1.3 | "
                    f"{ratio(sync, plain)} | {verdict(ok)} |")
    comm = results.get("comm")
    if comm and MPI in comm["jobs"]:
        for case, bound, kind in (("1 MiB", 1.5e-3, "time"), ("10 MiB", 3.0, "GB/s"),
                                  ("100 MiB", 2.0, "GB/s")):
            t = _comm_time(comm, MPI, case, "dist_gluon")
            nbytes = next((c["bytes"] for c in comm["cases"] if c["name"] == case), None)
            if t is None or nbytes is None:
                rows.append(f"| horovod over MPI, {case} sum | not measured | – |")
            elif kind == "time":
                rows.append(f"| horovod over MPI, {case} sum <= {bound * 1e3:g} ms | "
                            f"{ms(t)} ms | {verdict(t <= bound)} |")
            else:
                rate = nbytes / t / 1e9
                rows.append(f"| horovod over MPI, {case} sum >= {bound:g} GB/s | "
                            f"{rate:.2f} GB/s | {verdict(rate >= bound)} |")
    return rows + codec_targets(results.get("codecs", {})) + memory_targets(
        results.get("memory", {}))


def memory_targets(memory: dict) -> list[str]:
    """Issue 52's targets for Adam on 4 workers: state bytes <= 1/N + 5% of the
    unsharded, peak RSS lower by >= 40% of the state, step <= 1.05x."""
    rows = []
    done = [r for r in memory.get("rows", []) if "error" not in r and r["workers"] == 4]
    for row in (r for r in done if r["shard"]):
        base = next((b for b in done if not b["shard"] and (b["model"], b["backend"])
                     == (row["model"], row["backend"])), None)
        if base is None:
            continue
        worst = {k: max(r[k] for r in row["ranks"]) for k in ("state_bytes", "peak_rss", "step")}
        was = {k: max(r[k] for r in base["ranks"]) for k in ("state_bytes", "peak_rss", "step")}
        what = f"{row['model']} on {row['backend']}, 4 workers"
        share = worst["state_bytes"] / was["state_bytes"]
        rows.append(f"| {what}: optimizer state per worker <= 1/4 + 5% of unsharded | "
                    f"{share:.3f} | {verdict(share <= 0.25 + 0.05)} |")
        saved = (was["peak_rss"] - worst["peak_rss"]) / was["state_bytes"]
        rows.append(f"| {what}: peak RSS lower by >= 40% of the unsharded state | "
                    f"{saved:.0%} | {verdict(saved >= 0.40)} |")
        slower = worst["step"] / was["step"]
        rows.append(f"| {what}: step <= 1.05x unsharded | {slower:.2f}x | "
                    f"{verdict(slower <= 1.05)} |")
    return rows


def scaling_table(scaling: dict) -> list[str]:
    if "error" in scaling:
        return [f"Not measured: {scaling['error']}."]
    lines = ["| run (workers, batch per worker) | samples/s (median) | runs | "
             "scaling efficiency |", "|---|---:|---|---:|"]
    for label, entry in scaling.items():
        one = scaling.get(f"horovod x1, batch {entry['batch']}", {}).get("samples_per_s")
        speed = entry["samples_per_s"]
        eff = "–"
        if speed and one:
            eff = f"{speed / (entry['workers'] * one) * 100:.0f}%"
        runs = ", ".join(f"{s:.0f}" for s in entry["runs"]) or "failed: " + "; ".join(
            e[:150] for e in entry["errors"])
        lines.append(f"| {label} | {'–' if speed is None else f'{speed:.0f}'} | {runs} | "
                     f"{eff} |")
    return lines


def syncbn_table(syncbn: dict) -> list[str]:
    lines = ["| backend | BatchNorm, hybridized | BatchNorm | **SyncBatchNorm** | "
             "SyncBatchNorm / BatchNorm | SyncBatchNorm / BatchNorm hybridized | "
             "extra per BatchNorm layer |", "|---|---:|---:|---:|---:|---:|---:|"]
    for backend, payload in syncbn.items():
        if "error" in payload:
            lines.append(f"| {backend} | failed: {payload['error'][:200]} | | | | | |")
            continue
        t = {impl: entry["median"] for impl, entry in payload["times"].items()}
        sync, plain, hybrid = t["syncbn"], t["batchnorm"], t["batchnorm_hybrid"]
        cycle = (f" (cycle {payload['cycle_ms']:g} ms)" if "cycle_ms" in payload else "")
        lines.append(f"| {backend}{cycle} | {ms(hybrid)} | {ms(plain)} | **{ms(sync)}** | "
                     f"{ratio(sync, plain)} | {ratio(sync, hybrid)} | "
                     f"{ms((sync - plain) / payload['layers'])} |")
    return lines


def write_report(results: dict, path: Path, quick: bool) -> None:
    m = results["machine"]
    v = m["versions"]
    start, end = results["load_start"], results["load_end"]
    others = results.get("others_cpu_share")
    busy = others is None or others > 0.10
    text = [
        "# dist_gluon benchmarks" + (" (--quick run)" if quick else ""),
        "",
        f"Generated by `{results['command']}` on {m['date']} in {results['minutes']:.1f} "
        "minutes. Do not edit: rerun the command. Analysis and the fixes that followed "
        "from these numbers: [FINDINGS.md](FINDINGS.md).",
        "",
        f"- Machine: {m['cores']} cores, {m.get('cpu', '?')}, "
        f"{m.get('memory_gib', '?')} GiB memory, no GPU; {m['platform']}",
        f"- Versions: Python {m['python']}, mxnet {v['mxnet']}, numpy {v['numpy']}, "
        f"horovod {v['horovod']} ({'Gloo and MPI' if v.get('horovod_mpi') else 'Gloo'}), "
        f"gluoncv {v['gluoncv']}, dist_gluon {v['dist_gluon']}"
        + (f"; {v['mpi']}" if v.get("mpi") else ""),
        "- Other work on the machine: "
        + ("unknown" if others is None else
           f"processes outside this benchmark used {others * 100:.0f}% of the machine's CPU "
           "capacity during the run")
        + f" (load average 1/5/15 min at start {start[0]:.2f}/{start[1]:.2f}/{start[2]:.2f}"
        f", at end {end[0]:.2f}/{end[1]:.2f}/{end[2]:.2f}, including this benchmark's own "
        "jobs): "
        + ("**the machine was busy, so absolute numbers are noisy**; ratios between "
           "trainers or calls measured in the same job (interleaved) suffer less than "
           "ratios across jobs." if busy else "the machine was otherwise essentially idle."),
        "- Every job: 2 workers (unless stated) through `python -m dist_gluon.launch`, "
        "OMP_NUM_THREADS=1 per process, on loopback; ps-lite jobs have 1 server and "
        "1 scheduler, which share the same 2 cores.",
        "",
    ]
    if "comm" in results:
        comm = results["comm"]
        text += [
            "## 1. Communication: sum over 2 workers",
            "",
            "GB/s is algorithm bandwidth: bytes of one worker's tensors / wall time of the "
            "sum (10^9 bytes). Local memcpy is a one-thread `np.copyto` of the same bytes "
            "in one process: this machine's memory limit. dist_gluon is "
            "`dg.create().pushpull(key, x, priority=-i)`, one call per tensor; raw is "
            "`hvd.allreduce_(x, op=hvd.Sum, priority=-i)` on horovod and MXNet's "
            "`kv.pushpull(key, x, out=x, priority=-i)` on its `dist_sync` kvstore on "
            "dist_sync and p3 (the very store the backend wraps: ps-lite starts once per "
            "process). dist_gluon and raw alternate repetition by repetition in the same "
            "job, and which goes first alternates too; each figure is the median of "
            f"{results['config']['comm_reps']} timed repetitions after "
            f"{results['config']['comm_warmup']} warm-up ones, each "
            "started from a barrier.",
            "",
            *comm_table(comm),
            "",
            "Local copy with MXNet (`NDArray.copyto`, one thread) for comparison: "
            + "; ".join(f"{name}: {c['bytes'] / comm['copy'][name]['mxnet'] / 1e9:.2f} GB/s"
                        for c in comm["cases"] for name in [c["name"]]) + ".",
            "",
        ]
    if "trainer" in results:
        cfg = results["config"]
        mlp = cfg["mlp"]
        text += [
            "## 2. Trainer step with 2 workers",
            "",
            "Milliseconds per step (forward, backward, gradient sum, SGD-momentum update), "
            "median over all timed steps; every step ends with `mx.nd.waitall()`. "
            "ResNet-18 is gluoncv `resnet18_v1b`, input 3x64x64, batch 8 per worker; the "
            f"MLP is {mlp['layers']} Dense layers {mlp['width']} wide, batch 8 per worker. "
            "Trainers in one job share the model and take turns, in an order rotated "
            f"every round, {cfg['resnet']['steps']} / {mlp['steps']} step(s) each per "
            f"round (ResNet-18 / MLP), {cfg['resnet']['rounds']} / {mlp['rounds']} "
            f"rounds, after {cfg['resnet']['warmup']} / {mlp['warmup']} warm-up steps.",
            "",
            "On horovod all four take turns in one job. "
            "On dist_sync and p3 each of DistributedTrainer, raw collectives and "
            "gluon.Trainer runs in its own job (MXNet allows one ps-lite store per "
            "process, and a server holding the keys of two trainers that take turns "
            "slowed both by about 15%), each taking turns with a compute-only step; "
            "that job's compute-only time is in brackets after raw and gluon.Trainer "
            "figures, as a gauge of how loaded the machine was during that job.",
            "",
            "- *compute only*: the same step with no communication (gluon.Trainer, "
            "kvstore=None), both workers computing at the same time (from "
            "DistributedTrainer's job).",
            "- *raw collectives*: the same, plus one raw sum per gradient (hvd.allreduce_ "
            "or MXNet kv.pushpull, priority -i) before the update: what the trainer "
            "should cost.",
            "- *DistributedTrainer*: `dg.DistributedTrainer` on the job's backend.",
            "- *horovod.mxnet*: `hvd.DistributedTrainer`.",
            "- *gluon.Trainer dist_sync*: `gluon.Trainer(kvstore='dist_sync')` with MXNet's "
            "defaults, in its own ps-lite job: on dist_sync it updates on the server; in "
            "the p3 row it runs on the P3 van with MXNET_UPDATE_ON_KVSTORE=0 (MXNet's own "
            "P3).",
            "",
            *trainer_table(results["trainer"]),
            "",
        ]
    if MPI in results.get("comm", {}).get("jobs", {}) or any(
            MPI in per for per in results.get("trainer", {}).values()):
        text += [
            "## 2b. Horovod over MPI against horovod over Gloo",
            "",
            "The rows *horovod (MPI)* above, side by side with *horovod (Gloo)*: the same "
            "worker scripts through `python -m dist_gluon.launch --backend horovod "
            "--transport mpi` (OpenMPI's mpirun starts the ranks; dist_gluon picks "
            "OpenMPI's segmented-ring allreduce, see FINDINGS.md) and through the default "
            "Gloo transport, each in a job of its own. Median times; a ratio below 1 means "
            "MPI is faster.",
            "",
            *mpi_table(results),
            "",
        ]
    if "scaling" in results:
        cfg = results["config"]
        text += [
            "## 3. Scaling: MNIST example",
            "",
            "`examples/mnist/train_gluon.py --epochs "
            f"{cfg['mnist_epochs']} --batch-size B` (LeNet, 431k parameters; scikit-learn's "
            "digits scaled to 28x28, no download) through the launcher; samples/s is the "
            "example's own summary figure (training samples over training time, all "
            "workers together), median of "
            f"{cfg['mnist_reps']} runs. Scaling efficiency = samples/s with N workers / "
            "(N x samples/s with 1 worker at the same batch per worker). The two workers "
            "share 2 cores with the ps-lite server and scheduler where there are any; "
            "one worker alone already keeps about 1.1 cores busy (MXNet's engine thread "
            "computes while Python prepares the next batch).",
            "",
            *scaling_table(results["scaling"]),
            "",
        ]
    if "syncbn" in results:
        first = next((p for p in results["syncbn"].values() if "error" not in p), {})
        text += [
            "## 4. SyncBatchNorm",
            "",
            "Milliseconds per training step (forward, backward, DistributedTrainer step, "
            "`mx.nd.waitall()`), median, of gluoncv `resnet18_v1b` (3x64x64 input, batch "
            f"8 per worker, {first.get('layers', 20)} BatchNorm layers) on 2 workers, "
            "three copies of it taking turns in one job: with `nn.BatchNorm` hybridized "
            "(a usual training script), with `nn.BatchNorm` not hybridized, and with "
            "`norm_layer=dg.SyncBatchNorm` (never hybridized on several workers; two "
            "collectives per BatchNorm layer and step). The last column is the extra "
            "time per BatchNorm layer and step against `nn.BatchNorm` not hybridized. "
            "horovod's cycle (beside its name) is tuned on the SyncBatchNorm model's first "
            "steps, as in a job that trains it, before the three take turns.",
            "",
            *syncbn_table(results["syncbn"]),
            "",
        ]
    if "codecs" in results:
        codecs = results["codecs"]
        load_note = "" if "error" in codecs else (
            f" Load average during this part: {codecs['load_start'][0]:.2f} at its start, "
            f"{codecs['load_end'][0]:.2f} at its end.")
        text += [
            "## 5. Codec throughput on one core",
            "",
            "GB/s of float32 gradient (10^9 bytes) that a codec's `reduce` processes, "
            "and the milliseconds it takes, on a kvstore whose sum does nothing (one "
            "process, OMP_NUM_THREADS=1): the codec's own CPU time per step on each "
            "worker. *2bit* runs on the fused kernels (dist_gluon/"
            "_kernels.cc, loaded with `mx.library.load`)"
            + ("" if codecs.get("fused_kernels", True) else
               " -- **which did not load on this machine, so it ran on stock operators**")
            + "; *2bit operators* is its fallback on MXNet's stock operators; *powersgd* "
            "is rank 4, its two passes over the matrix that touch the error on the fused "
            "kernels, and *powersgd operators* its fallback; *onebit* is BytePS's with "
            "its example's flags (scaling, error feedback, Nesterov momentum), its "
            "packing and decompress-and-sum on the fused kernels, and *onebit operators* "
            "its fallback; "
            "*mxnet 2bit* is MXNet's own C++ 2-bit: a `device` kvstore with "
            "`set_gradient_compression`, push (quantise) and pull (dequantise) per "
            "tensor; *memory copy* is a one-thread `NDArray.copyto` of the same tensors "
            "(each byte read and written once). Median of 3 timed repetitions (2 with "
            "--quick) after a warm-up." + load_note,
            "",
            *codecs_table(codecs),
            "",
        ]
    if "memory" in results:
        memory = results["memory"]
        text += [
            "## 6. Memory: shard_optimizer_states",
            "",
            "Adam (two float32 states per parameter) through DistributedTrainer with "
            "`shard_optimizer_states=True` (*sharded*) and without, "
            f"{results['config']['memory']['steps']} timed steps after "
            f"{results['config']['memory']['warmup']} warm-up ones, batch 1 x 8 tokens "
            "(BERT-base-sized: BERT-base's parameter shapes on a feed-forward path, "
            "benchmarks/bench_memory.py) or 2 images of 64 x 64 (ResNet-50 v1). Per "
            "worker, the largest over the ranks: the bytes of the optimizer states it "
            "holds, its peak resident memory (`ru_maxrss`: weights, gradients, states, "
            "activations, MXNet and the transport's buffers, since the process started), "
            "and the median step time. *RSS saved / state saved*: how much of the "
            "optimizer-state bytes sharding saves shows up as lower peak RSS. Load "
            f"average during this part: {memory['load_start'][0]:.2f} at its start, "
            f"{memory['load_end'][0]:.2f} at its end; every worker of a job shares the "
            "machine's cores, so step times of 4 workers are 2 workers' work per core.",
            "",
            *memory_table(memory),
            "",
        ]
    text += ["## Targets (reported, not asserted)", "", *targets(results), ""]
    path.write_text("\n".join(text))


# --------------------------------------------------------------------------- reports
PARTS = ("comm", "trainer", "scaling", "syncbn", "codecs", "memory")


def write_reports(results: dict, parts, out: Path | None, quick: bool) -> list[Path]:
    """Write the report (and the raw numbers beside it) of every part with results: to
    ``out`` all together if given, else each to benchmarks/RESULTS-<part>.md, so that a
    rerun of one part rewrites its own file only. Returns the reports written."""
    common = {k: v for k, v in results.items() if k not in PARTS}
    if out is not None:
        jobs = [(results, out)]
    else:
        jobs = [({**common, part: results[part]}, HERE / f"RESULTS-{part}.md")
                for part in parts if part in results]
    for own, path in jobs:
        write_report(own, path, quick)
        for job in own.get("comm", {}).get("jobs", {}).values():
            job.pop("stdout", None)
        raw = path.with_name(path.stem.lower() + ".json")
        raw.write_text(json.dumps(own, indent=1, default=str))
    return [path for _, path in jobs]


# --------------------------------------------------------------------------- main
def parse_args(argv=None):
    parser = argparse.ArgumentParser(description="Benchmark dist_gluon against Horovod "
                                     "and MXNet's kvstore; writes benchmarks/RESULTS-<part>.md, "
                                     "one file per part run.")
    parser.add_argument("--quick", action="store_true",
                        help="smaller sizes and fewer repetitions (a few minutes); writes "
                             "RESULTS-quick.md unless --out is given")
    parser.add_argument("--only", action="append", choices=PARTS,
                        help="run only this part (repeatable); default: all six")
    parser.add_argument("--out", type=Path, default=None,
                        help="write the report of every part run into this one file "
                             "(default: each part into its own benchmarks/RESULTS-<part>.md)")
    parser.add_argument("--job-timeout", type=float, default=900,
                        help="seconds one benchmark job may run (default: 900)")
    args = parser.parse_args(argv)
    if args.out is None and args.quick:
        args.out = HERE / "RESULTS-quick.md"
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    cfg = QUICK if args.quick else FULL
    parts = args.only or list(PARTS)
    started = time.monotonic()
    results = {"command": ".venv/bin/python benchmarks/run.py" + (" --quick" if args.quick
                                                                 else ""),
               "config": cfg, "machine": machine(), "load_start": load()}
    cpu_start = cpu_seconds()
    log(f"{'quick' if args.quick else 'full'} run of {', '.join(parts)}; load average "
        f"{results['load_start'][0]:.2f}")
    with tempfile.TemporaryDirectory(prefix="dg-bench-") as tmp:
        if "comm" in parts:
            results["comm"] = run_comm(cfg, Path(tmp), args.job_timeout)
        if "trainer" in parts:
            results["trainer"] = run_trainer(cfg, args.job_timeout)
        if "scaling" in parts:
            results["scaling"] = run_scaling(cfg, args.job_timeout)
        if "syncbn" in parts:
            results["syncbn"] = run_syncbn(cfg, args.job_timeout)
        if "codecs" in parts:
            results["codecs"] = run_codecs(cfg, Path(tmp), args.job_timeout)
        if "memory" in parts:
            results["memory"] = run_memory(cfg, args.job_timeout)
    results["load_end"] = load()
    results["others_cpu_share"] = others_share(cpu_start, cpu_seconds(),
                                               results["machine"]["cores"] or 1)
    results["minutes"] = (time.monotonic() - started) / 60
    written = write_reports(results, parts, args.out, args.quick)
    log(f"wrote {', '.join(str(p) for p in written)} (and the raw numbers beside each) in "
        f"{results['minutes']:.1f} minutes")
    failed = [k for k, j in results.get("comm", {}).get("jobs", {}).items() if "error" in j]
    failed += [f"{model} {backend}" for model, per in results.get("trainer", {}).items()
               for backend, slot in per.items() if slot.get("errors")]
    failed += [label for label, entry in results.get("scaling", {}).items()
               if isinstance(entry, dict) and entry.get("errors")]
    failed += [f"syncbn {backend}" for backend, payload in results.get("syncbn", {}).items()
               if "error" in payload]
    failed += ["codecs"] if "error" in results.get("codecs", {}) else []
    failed += [f"memory {r['model']} {r['backend']} {r['workers']}"
               for r in results.get("memory", {}).get("rows", []) if "error" in r]
    if failed:
        log(f"failed jobs: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
