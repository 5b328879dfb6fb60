"""`make gpu-check`: dist_gluon on this machine's GPUs, with a CUDA build of MXNet 1.9.1.

Run by anyone with a GPU; on a machine without one it says so and exits 0. It makes its
own environment (.venv-gpu) with the CUDA build of MXNet that matches the driver
(``mxnet-cu117``, ``-cu112`` or ``-cu110``; ``MXNET_GPU_PACKAGE`` overrides), installs
dist_gluon there, and runs through the real launcher, on every GPU (one worker per GPU)
and, with two or more, one process driving all of them:

- MNIST with DistributedTrainer on dist_sync and p3;
- a ResNet-50 step (synthetic images) on dist_sync and p3, also with 2-bit compression
  and with SyncBatchNorm (also over one process's several GPUs);
- one process with several GPUs (MXNet's layout) on dist_sync.

Horovod is left out: building it against a CUDA MXNet needs the CUDA toolkit and NCCL,
which a driver-only machine lacks; its CPU tests cover the horovod backend's logic.
Each run's summary line (accuracy, images/s) is printed, then a table; the exit status
is 1 when a run failed. Stdlib only: it runs before any environment exists.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
VENV = REPO / ".venv-gpu"
PY = VENV / "bin" / "python"


def gpus() -> list[str]:
    """The names of this machine's GPUs, as nvidia-smi lists them (none without it)."""
    if shutil.which("nvidia-smi") is None:
        return []
    found = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                           capture_output=True, text=True)
    return [line.strip() for line in found.stdout.splitlines() if line.strip()]


def cuda_package() -> str:
    """The mxnet 1.9.1 CUDA build for the driver's CUDA version."""
    if os.environ.get("MXNET_GPU_PACKAGE"):
        return os.environ["MXNET_GPU_PACKAGE"]
    banner = subprocess.run(["nvidia-smi"], capture_output=True, text=True).stdout
    match = re.search(r"CUDA Version:\s*(\d+)\.(\d+)", banner)
    version = (int(match[1]), int(match[2])) if match else (11, 2)
    for needed, package in (((11, 7), "mxnet-cu117"), ((11, 2), "mxnet-cu112")):
        if version >= needed:
            return package
    return "mxnet-cu110"


def setup(package: str) -> None:
    if not PY.exists():
        subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
    pip = [str(PY), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    # constraints.txt pins the CPU build's name; the CUDA build installs the same module
    pins = [line for line in (REPO / "constraints.txt").read_text().splitlines()
            if line and not line.startswith(("#", "mxnet", "horovod"))]
    subprocess.run([*pip, "numpy==1.23.5", f"{package}==1.9.1"], check=True)
    subprocess.run([*pip, *pins, "-e", f"{REPO}[examples]"], check=True)


def run(name: str, argv: list[str], results: list) -> None:
    print(f"==> {name}: {' '.join(argv)}", flush=True)
    env = dict(os.environ, OMP_NUM_THREADS="4", PYTHONPATH=str(REPO))
    start = time.monotonic()
    proc = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=1800)
    took = time.monotonic() - start
    summary = [line for line in proc.stdout.splitlines() if "summary:" in line]
    ok = proc.returncode == 0 and bool(summary)
    print(summary[-1] if summary else (proc.stdout[-2000:] + proc.stderr[-2000:]), flush=True)
    results.append((name, "ok" if ok else f"FAILED ({proc.returncode})", f"{took:.0f} s",
                    summary[-1].split("summary: ", 1)[1] if summary else ""))


def launch(backend: str, workers: int, script: str, *args: str) -> list[str]:
    return [str(PY), "-m", "dist_gluon.launch", "-n", str(workers), "--backend", backend,
            "--", str(PY), str(REPO / "examples" / script), *args]


def main() -> int:
    names = gpus()
    if not names:
        print("gpu-check: no GPU on this machine (nvidia-smi lists none): nothing to check")
        return 0
    count = len(names)
    package = cuda_package()
    print(f"gpu-check: {count} GPU(s): {', '.join(names)}; MXNet build {package}")
    setup(package)
    seen = subprocess.run([str(PY), "-c", "import mxnet; print(mxnet.context.num_gpus())"],
                          capture_output=True, text=True)
    if seen.returncode != 0 or int(seen.stdout.strip() or 0) == 0:
        print(f"gpu-check: {package} sees no GPU ({seen.stderr.strip()[-500:]}); set "
              "MXNET_GPU_PACKAGE to the build for this driver")
        return 1
    resnet = ["--synthetic", "--model", "resnet50_v1b", "--batch-size", "32", "--epochs", "1",
              "--steps-per-epoch", "30", "--num-classes", "1000"]
    results: list = []
    for backend in ("dist_sync", "p3"):
        run(f"MNIST, {backend}, {count} worker(s) x 1 GPU",
            launch(backend, count, "mnist/train_gluon.py", "--epochs", "3", "--devices", "gpu"),
            results)
        run(f"ResNet-50, {backend}, {count} x 1 GPU",
            launch(backend, count, "imagenet/train_imagenet.py", *resnet, "--devices", "gpu"),
            results)
        run(f"ResNet-50 2-bit, {backend}, {count} x 1 GPU",
            launch(backend, count, "imagenet/train_imagenet.py", *resnet, "--devices", "gpu",
                   "--compression", "2bit"), results)
        run(f"ResNet-50 SyncBatchNorm, {backend}, {count} x 1 GPU",
            launch(backend, count, "imagenet/train_imagenet.py", *resnet, "--devices", "gpu",
                   "--syncbn"), results)
    if count >= 2:
        every = ",".join(str(i) for i in range(count))
        run(f"ResNet-50, dist_sync, 1 worker x {count} GPUs",
            launch("dist_sync", 1, "imagenet/train_imagenet.py", *resnet, "--gpus", every),
            results)
        run(f"ResNet-50 SyncBatchNorm, dist_sync, 1 worker x {count} GPUs",
            launch("dist_sync", 1, "imagenet/train_imagenet.py", *resnet, "--gpus", every,
                   "--syncbn"), results)
        run(f"MNIST, dist_sync, 1 worker x {count} GPUs",
            launch("dist_sync", 1, "mnist/train_gluon.py", "--epochs", "3", "--gpus", every),
            results)
    print(f"\ngpu-check on {', '.join(names)} ({package}):")
    for row in results:
        print(" | ".join(row))
    return 0 if all(row[1] == "ok" for row in results) else 1


if __name__ == "__main__":
    sys.exit(main())
