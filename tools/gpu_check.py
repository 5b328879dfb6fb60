"""`make gpu-check`: dist_gluon on this machine's GPUs, with a CUDA build of MXNet 1.9.1.

Run by anyone with a GPU; on a machine without one it says so and exits 0. It makes its
own environment (.venv-gpu) with the CUDA build of MXNet that matches the driver
(``mxnet-cu117``, ``-cu112`` or ``-cu110``; ``MXNET_GPU_PACKAGE`` overrides) and the CUDA
11 libraries it links (NVIDIA's wheels: CUDA runtime, cuDNN 8, NCCL), installs dist_gluon
there, and runs through the real launcher, on every GPU (one worker per GPU)
and, with two or more, one process driving all of them:

- MNIST with DistributedTrainer on dist_sync and p3;
- a ResNet-50 step (synthetic images) on dist_sync and p3, also with 2-bit compression
  and with SyncBatchNorm (also over one process's several GPUs);
- one process with several GPUs (MXNet's layout) on dist_sync.

Horovod is left out: building it against a CUDA MXNet needs the CUDA toolkit and NCCL,
which a driver-only machine lacks; its CPU tests cover the horovod backend's logic.

Before running anything it reads which GPU architectures the installed libmxnet.so has
kernels for (the headers of its CUDA fat binaries) and compares them with the GPUs'
compute capability. MXNet 1.9.1's CUDA wheels carry machine code for compute capability
5.0 to 8.6 and no PTX, so on a Hopper GPU (9.0: H100, H200) or newer not one MXNet kernel
can load (the driver answers CUDA_ERROR_NO_BINARY_FOR_GPU); the check then says so and
exits 0, having checked nothing. ``MXNET_GPU_PACKAGE`` may name a wheel file, such as an
MXNet built from source for that architecture.
Each run's summary line (accuracy, images/s) is printed, then a table; the exit status
is 1 when a run failed. Stdlib only: it runs before any environment exists.
"""
from __future__ import annotations

import mmap
import os
import re
import shutil
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
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


def compute_capabilities() -> list[int]:
    """Each GPU's compute capability as nvidia-smi reports it, 9.0 as 90 (none if it can't)."""
    found = subprocess.run(["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader"],
                           capture_output=True, text=True)
    if found.returncode != 0:
        return []
    return [round(float(line) * 10) for line in found.stdout.split()
            if re.fullmatch(r"\d+\.\d+", line)]


FATBIN_MAGIC = struct.pack("<I", 0xBA55ED50)
FATBIN_SASS, FATBIN_PTX = 2, 1


def fat_binaries(data) -> Iterator[tuple[int, int]]:
    """Where the fat binaries embedded in a library's bytes (an mmap) start and end, each
    with its header: 0xBA55ED50, a version, the header's size (16) and the payload's."""
    pos = data.find(FATBIN_MAGIC)
    while pos >= 0:
        _, header, size = struct.unpack_from("<HHQ", data, pos + 4)
        end = pos + header + size
        if header != 16 or end > len(data):  # the magic's bytes by chance, not a header
            pos = data.find(FATBIN_MAGIC, pos + 4)
            continue
        yield pos, end
        pos = data.find(FATBIN_MAGIC, end)


def kernel_archs(library: Path) -> tuple[set[int], set[int]]:
    """The architectures a CUDA library carries machine code (SASS) and PTX for, e.g. 86.

    Reads the headers of the entries of its fat binaries: each gives the entry's kind (1
    PTX, 2 machine code), header and payload sizes, and its architecture at byte 28.
    """
    sass: set[int] = set()
    ptx: set[int] = set()
    with open(library, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        for start, end in fat_binaries(data):
            entry = start + 16
            while entry + 32 <= end:
                kind, _, entry_header, payload = struct.unpack_from("<HHII", data, entry)
                arch = struct.unpack_from("<I", data, entry + 28)[0]
                {FATBIN_SASS: sass, FATBIN_PTX: ptx}.get(kind, set()).add(arch)
                entry += entry_header + payload
    return sass, ptx


def runs_on(capability: int, sass: set[int], ptx: set[int]) -> bool:
    """Whether a GPU of this capability can load kernels built for these architectures.

    Machine code runs on its own major version at the same or a higher minor (sm_80 on an
    8.6 GPU); PTX is compiled by the driver for any GPU at or above its architecture.
    """
    return (any(arch // 10 == capability // 10 and arch <= capability for arch in sass)
            or any(arch <= capability for arch in ptx))


def listed(archs: set[int]) -> str:
    """86 as 8.6, for a message."""
    return ", ".join(f"{arch // 10}.{arch % 10}" for arch in sorted(archs)) or "none"


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


# MXNet's CUDA builds link the CUDA 11 runtime, cuDNN 8 and NCCL 2 without shipping them;
# NVIDIA's wheels supply them to a machine that has only the driver
CUDA_LIBRARIES = ["nvidia-cuda-runtime-cu11==11.8.89", "nvidia-cublas-cu11==11.11.3.6",
                  "nvidia-cufft-cu11==10.9.0.58", "nvidia-cusolver-cu11==11.4.1.48",
                  "nvidia-cusparse-cu11==11.7.5.86", "nvidia-curand-cu11==10.3.0.86",
                  "nvidia-cuda-nvrtc-cu11==11.8.89", "nvidia-nvtx-cu11==11.8.86",
                  "nvidia-cudnn-cu11==8.9.6.50", "nvidia-nccl-cu11==2.21.5"]


def site_packages() -> Path:
    return next(VENV.glob("lib/python3*/site-packages"))


def library_env() -> dict[str, str]:
    """The environment in which .venv-gpu's MXNet finds the CUDA libraries it links."""
    dirs = [str(d) for d in sorted(site_packages().glob("nvidia/*/lib"))]
    if os.environ.get("LD_LIBRARY_PATH"):
        dirs.append(os.environ["LD_LIBRARY_PATH"])
    return dict(os.environ, LD_LIBRARY_PATH=":".join(dirs))


def setup(package: str) -> None:
    if not PY.exists():
        subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
    pip = [str(PY), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    # constraints.txt pins the CPU build's name; the CUDA build installs the same module
    pins = [line for line in (REPO / "constraints.txt").read_text().splitlines()
            if line and not line.startswith(("#", "mxnet", "horovod"))]
    wanted = package if package.endswith(".whl") else f"{package}==1.9.1"
    subprocess.run([*pip, "numpy==1.23.5", wanted, *CUDA_LIBRARIES], check=True)
    subprocess.run([*pip, *pins, "-e", f"{REPO}[examples]"], check=True)


def run(name: str, argv: list[str], results: list) -> None:
    print(f"==> {name}: {' '.join(argv)}", flush=True)
    env = dict(library_env(), OMP_NUM_THREADS="4", PYTHONPATH=str(REPO))
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
    library = site_packages() / "mxnet" / "libmxnet.so"
    if library.exists():
        sass, ptx = kernel_archs(library)
        unfit = {cc for cc in compute_capabilities() if not runs_on(cc, sass, ptx)}
        if unfit:
            print(f"gpu-check: NOT CHECKED. {package} has GPU kernels for compute capability "
                  f"{listed(sass)} (PTX: {listed(ptx)}); this machine's GPUs are "
                  f"{listed(unfit)}, which cannot load them (MXNet 1.9.1's builds "
                  "predate CUDA's support for Hopper). Set MXNET_GPU_PACKAGE to a wheel of "
                  "MXNet built for this architecture (from source, with CUDA_ARCH including "
                  "it) to check here.")
            return 0
    seen = subprocess.run([str(PY), "-c", "import mxnet; print(mxnet.context.num_gpus())"],
                          capture_output=True, text=True, env=library_env())
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
