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

import ctypes
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
# SyncBatchNorm's side channel (sidechannel.py): engine tasks in the same library
_SIDE_SOURCE = Path(__file__).with_name("_sidesum.cc")
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
_library: ctypes.CDLL | None = None      # the same library, for push()
_mutated: dict = {}                       # operator -> indices of the inputs it writes
# MXNet's dtype codes (mshadow's type flags, lib_api.h's MXDType)
_DTYPE_CODES = {np.dtype(t): code for code, t in enumerate(
    ["float32", "float64", "float16", "uint8", "int32", "int8", "int64"])}


class _Context(ctypes.Structure):
    """mxnet::Context, as MXEnginePushSyncND reads it."""
    _fields_ = [("dev_type", ctypes.c_int), ("dev_id", ctypes.c_int)]


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


def tasks() -> ctypes.CDLL:
    """The library's engine-task entry points (it is loaded already: the same handle)."""
    global _library
    if _library is None:
        lib = ctypes.CDLL(str(build()))
        lib.dg_task_new.restype = ctypes.c_void_p
        lib.dg_task_error.restype = ctypes.c_char_p
        # the function pointers every push passes, made once
        lib.run, lib.free = (ctypes.cast(f, ctypes.c_void_p)
                             for f in (lib.dg_task_run, lib.dg_task_free))
        lib.get_data, lib.free_handle = (
            ctypes.cast(f, ctypes.c_void_p)
            for f in (mx.base._LIB.MXNDArrayGetData, mx.base._LIB.MXNDArrayFree))
        _library = lib
    return _library


def push(name: str, inputs: list, outputs: list, priority: int = 0, **attrs) -> list:
    """Queue kernel ``name`` on MXNet's engine, reading ``inputs`` and writing
    ``outputs`` (NDArrays, or ``(shape, dtype)`` for new arrays on the first input's
    context) and the inputs the kernel updates; returns the outputs. The same kernels
    as ``mx.nd.<name>``, pushed with exactly these arrays as dependencies: a library
    operator also takes one of MXNet's few parallel-random resources, which chains
    every such operator to the one before it (a decode waiting for its sum held back
    the next tensor's encode). Call only where :func:`serves` is true."""
    lib = tasks()
    ctx = inputs[0].context
    outputs = [o if isinstance(o, mx.nd.NDArray)
               else mx.nd.empty(o[0], ctx=ctx, dtype=o[1]) for o in outputs]
    mutated = _mutated.get(name)
    if mutated is None:
        found = (ctypes.c_int * 8)()
        count = lib.dg_task_mutates(name.encode(), found, 8)
        if count < 0:
            raise ValueError(f"no fused kernel named {name!r}")
        mutated = _mutated[name] = frozenset(found[:count])
    keys = [k.encode() for k in attrs]
    values = [str(int(v) if isinstance(v, bool) else v).encode() for v in attrs.values()]
    dims = [d for a in inputs for d in a.shape]
    own_in, own_out = [own_handle(a) for a in inputs], [own_handle(a) for a in outputs]
    task = lib.dg_task_new(
        name.encode(), len(keys), (ctypes.c_char_p * len(keys))(*keys),
        (ctypes.c_char_p * len(values))(*values), len(inputs),
        (ctypes.c_void_p * len(inputs))(*own_in),
        (ctypes.c_int * len(inputs))(*[_DTYPE_CODES[np.dtype(a.dtype)] for a in inputs]),
        (ctypes.c_int * len(inputs))(*[a.ndim for a in inputs]),
        (ctypes.c_int64 * len(dims))(*dims), len(outputs),
        (ctypes.c_void_p * len(outputs))(*own_out),
        (ctypes.c_int * len(outputs))(*[_DTYPE_CODES[np.dtype(a.dtype)] for a in outputs]),
        (ctypes.c_int64 * len(outputs))(*[a.size for a in outputs]),
        lib.get_data, lib.free_handle)
    if not task:
        for handle in own_in + own_out:
            mx.base._LIB.MXNDArrayFree(ctypes.c_void_p(handle))
        raise ValueError(lib.dg_task_error().decode())
    const = [a.handle for i, a in enumerate(inputs) if i not in mutated]
    mutable = [a.handle for a in outputs] + [inputs[i].handle for i in sorted(mutated)]
    context = _Context(ctx.device_typeid, ctx.device_id)
    mx.base.check_call(mx.base._LIB.MXEnginePushSyncND(
        lib.run, ctypes.c_void_p(task), lib.free,
        ctypes.byref(context), (mx.base.NDArrayHandle * len(const))(*const), len(const),
        (mx.base.NDArrayHandle * len(mutable))(*mutable), len(mutable), None,
        ctypes.c_int(priority), name.encode()))
    return outputs


def own_handle(array: mx.nd.NDArray) -> int:
    """A handle of the task's own on ``array``'s memory (a view keeps its offset and
    shape), which keeps it alive until the task has run; the task frees it."""
    handle = mx.base.NDArrayHandle()
    mx.base.check_call(mx.base._LIB.MXShallowCopyNDArray(array.handle, ctypes.byref(handle)))
    return handle.value


def build() -> Path:
    """The compiled library, built now if this machine has none for this source."""
    package = Path(mx.__file__).parent
    include, lib_api = package / "include", package / "src" / "lib_api.cc"
    if not (include / "mxnet" / "lib_api.h").exists() or not lib_api.exists():
        raise RuntimeError(f"the MXNet wheel at {package} has no lib_api.h or lib_api.cc")
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        raise RuntimeError("no C++ compiler (g++) on PATH")
    digest = hashlib.sha256(_SOURCE.read_bytes() + _SIDE_SOURCE.read_bytes()
                            + lib_api.read_bytes()
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
                                   str(_SIDE_SOURCE), str(lib_api), "-lpthread", "-o",
                                   str(target)],
                                  capture_output=True, text=True, timeout=600)
            if done.returncode != 0:
                raise RuntimeError(f"{compiler} failed on {_SOURCE.name}: "
                                   f"{done.stderr.strip()[-2000:]}")
            os.replace(target, library)
    return library


if __name__ == "__main__":
    print(build())
    sys.exit(0 if available() else 1)
