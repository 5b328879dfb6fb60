"""Ask the CUDA driver whether this machine's GPU 0 can load given fat binaries.

    python tools/cuda_load_probe.py a.fatbin b.fatbin ... [--from-library libmxnet.so]

Each file is handed to ``cuModuleLoadFatBinary`` (through ctypes, no CUDA toolkit
needed) and the driver's answer is printed: CUDA_SUCCESS, or for instance 209
CUDA_ERROR_NO_BINARY_FOR_GPU when it holds no machine code for the GPU's architecture and
no PTX the driver could compile. ``--from-library`` cuts the fat binaries out of a shared
library (with gpu_check's header walk) and tries the first of 1-4 MB. This is how
benchmarks/FINDINGS.md section 13 showed that MXNet 1.9.1's CUDA kernels cannot load on
an H100.
"""
from __future__ import annotations

import argparse
import ctypes
import mmap
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_check import fat_binaries  # noqa: E402


def first_fat_binary(library: Path, low: int = 2**20, high: int = 4 * 2**20) -> bytes:
    """The first fat binary embedded in ``library`` whose size is in [low, high]."""
    with open(library, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        for start, end in fat_binaries(data):
            if low <= end - start <= high:
                return data[start:end]
    raise SystemExit(f"{library} holds no fat binary of {low}-{high} bytes")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("fatbins", nargs="*", type=Path)
    parser.add_argument("--from-library", type=Path)
    args = parser.parse_args()
    images = [(str(path), path.read_bytes()) for path in args.fatbins]
    if args.from_library:
        images.append((f"a fat binary of {args.from_library.name}",
                       first_fat_binary(args.from_library)))
    cuda = ctypes.CDLL("libcuda.so.1")

    def name(code: int) -> str:
        text = ctypes.c_char_p()
        cuda.cuGetErrorName(code, ctypes.byref(text))
        return text.value.decode() if text.value else "?"

    if (code := cuda.cuInit(0)) != 0:
        print(f"cuInit failed: {code} {name(code)}")
        return 1
    device, major, minor = ctypes.c_int(), ctypes.c_int(), ctypes.c_int()
    cuda.cuDeviceGet(ctypes.byref(device), 0)
    cuda.cuDeviceGetAttribute(ctypes.byref(major), 75, device)  # compute capability major
    cuda.cuDeviceGetAttribute(ctypes.byref(minor), 76, device)  # and minor
    print(f"GPU 0: compute capability {major.value}.{minor.value}")
    context = ctypes.c_void_p()
    cuda.cuCtxCreate_v2(ctypes.byref(context), 0, device)
    for label, image in images:
        buffer = ctypes.create_string_buffer(image, len(image))
        module = ctypes.c_void_p()
        code = cuda.cuModuleLoadFatBinary(ctypes.byref(module), buffer)
        print(f"{label} ({len(image)} bytes): {code} {name(code)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
