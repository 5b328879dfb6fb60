"""The fused kernels (_kernels.cc) of the per-step path: the 2-bit, onebit and PowerSGD
codecs (compression/) and ps-lite's exact float64 sum (backends/pslite.py). Compiled
once per machine with the system C++ compiler and loaded with ``mx.library.load``;
where they cannot be (no compiler, no ``lib_api.h`` in the MXNet wheel,
``DG_COMPRESSION_KERNELS=0``), those run on MXNet's stock operators, with the same
results (PowerSGD's within float32 rounding: its sums run in another order).

The library is built under ``$DG_KERNEL_CACHE`` (default ``~/.cache/dist_gluon``), in a
folder named after a hash of the source and of MXNet's version, under a file lock, so
the workers of a job build it once between them; ``python -m dist_gluon._kernels``
builds it ahead (as ``make setup`` does).
"""
from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import mxnet as mx
import numpy as np

_SOURCE = Path(__file__).with_name("_kernels.cc")
_OPS = ("dg_twobit_quantize", "dg_twobit_dequantize", "dg_onebit_worker",
        "dg_onebit_server", "dg_float64_split", "dg_float64_combine",
        "dg_powersgd_project", "dg_powersgd_approximate", "dg_fp16_pack", "dg_fp16_unpack")
# No -ffast-math: the arithmetic must be the operator path's, bit for bit
# (-fno-trapping-math only lets the compiler compute both sides of a select).
# -Bsymbolic: horovod's MXNet library exports lib_api.h's classes too, and ours must
# register its operators in its own registry, not in horovod's.
_FLAGS = ["-shared", "-fPIC", "-std=c++11", "-O3", "-ffp-contract=off",
          "-fno-trapping-math", "-Wl,-Bsymbolic"]
_loaded: bool | None = None


def available() -> bool:
    """True when the fused kernels are loaded (building them on first use)."""
    global _loaded
    if _loaded is None:
        _loaded = False
        if os.environ.get("DG_COMPRESSION_KERNELS", "1") != "0":
            _loaded = _load()
    return _loaded


def serves(dtype, ctx) -> bool:
    """Whether an array of ``dtype`` on ``ctx`` goes through the kernels: float32 or
    float64 on the CPU, where they could be built (loading them on first use)."""
    return (ctx.device_type == "cpu" and np.dtype(dtype) in (np.float32, np.float64)
            and available())


def _load() -> bool:
    if all(hasattr(mx.nd, op) for op in _OPS):
        return True
    try:
        library = build()
    except (OSError, subprocess.SubprocessError, RuntimeError) as err:
        warnings.warn(f"dist_gluon: the fused codec kernels could not be built ({err}); "
                      "compression runs on MXNet's stock operators (same results, slower)",
                      stacklevel=3)
        return False
    mx.library.load(str(library), verbose=False)
    return all(hasattr(mx.nd, op) for op in _OPS)


def build() -> Path:
    """The compiled library, built now if this machine has none for this source."""
    package = Path(mx.__file__).parent
    include, lib_api = package / "include", package / "src" / "lib_api.cc"
    if not (include / "mxnet" / "lib_api.h").exists() or not lib_api.exists():
        raise RuntimeError(f"the MXNet wheel at {package} has no lib_api.h or lib_api.cc")
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        raise RuntimeError("no C++ compiler (g++) on PATH")
    digest = hashlib.sha256(_SOURCE.read_bytes() + lib_api.read_bytes()
                            + " ".join([compiler, *_FLAGS, mx.__version__]).encode()
                            ).hexdigest()[:16]
    cache = Path(os.environ.get("DG_KERNEL_CACHE")
                 or Path.home() / ".cache" / "dist_gluon") / f"kernels-{digest}"
    library = cache / "libdg_kernels.so"
    if library.exists():
        return library
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if library.exists():
            return library
        with tempfile.TemporaryDirectory(dir=cache) as tmp:
            target = Path(tmp) / library.name
            done = subprocess.run([compiler, *_FLAGS, f"-I{include}", str(_SOURCE),
                                   str(lib_api), "-o", str(target)],
                                  capture_output=True, text=True, timeout=600)
            if done.returncode != 0:
                raise RuntimeError(f"{compiler} failed on {_SOURCE.name}: "
                                   f"{done.stderr.strip()[-2000:]}")
            os.replace(target, library)
    return library


if __name__ == "__main__":
    print(build())
    sys.exit(0 if available() else 1)
