"""tools/gpu_check.py's decisions that need no GPU: which architectures a CUDA library
carries kernels for, whether a GPU can load them, and the exit on a machine without one."""
import struct
import subprocess
import sys

import pytest

from conftest import REPO

sys.path.insert(0, str(REPO / "tools"))
import gpu_check  # noqa: E402


def entry(kind: int, arch: int, payload: bytes) -> bytes:
    """One fat-binary entry: a 64-byte header (kind, version, header size, payload size,
    ..., architecture at byte 28), then the payload."""
    header = bytearray(64)
    struct.pack_into("<HHII", header, 0, kind, 0x101, 64, len(payload))
    struct.pack_into("<I", header, 28, arch)
    return bytes(header) + payload


def fatbin(*entries: bytes) -> bytes:
    body = b"".join(entries)
    return gpu_check.FATBIN_MAGIC + struct.pack("<HHQ", 1, 16, len(body)) + body


def test_kernel_archs_reads_every_fat_binary_and_skips_stray_magic(tmp_path):
    lib = tmp_path / "libfake.so"
    lib.write_bytes(b"\x7fELF" + b"\0" * 100
                    + gpu_check.FATBIN_MAGIC + b"\xff" * 12  # the magic's bytes, no header
                    + fatbin(entry(2, 70, b"s" * 40), entry(2, 86, b"s" * 24))
                    + b"\0" * 33
                    + fatbin(entry(2, 80, b"x" * 8), entry(1, 80, b".version 7.0\0"))
                    + b"\0" * 8)
    assert gpu_check.kernel_archs(lib) == ({70, 80, 86}, {80})


def test_the_cpu_build_of_mxnet_has_no_gpu_kernels():
    import mxnet.libinfo
    assert gpu_check.kernel_archs(mxnet.libinfo.find_lib_path()[0]) == (set(), set())


@pytest.mark.parametrize("capability, sass, ptx, fits", [
    (86, {50, 60, 70, 80, 86}, set(), True),
    (89, {80}, set(), True),           # sm_80 machine code runs on 8.x at or above 8.0
    (90, {50, 60, 70, 80, 86}, set(), False),   # MXNet 1.9.1's wheels on an H100
    (90, {86}, {80}, True),            # PTX is compiled by the driver for newer GPUs
    (75, {80, 86}, set(), False),
    (75, set(), {80}, False),
])
def test_runs_on(capability, sass, ptx, fits):
    assert gpu_check.runs_on(capability, sass, ptx) is fits


def test_without_a_gpu_it_says_so_and_exits_0(tmp_path):
    done = subprocess.run([sys.executable, str(REPO / "tools" / "gpu_check.py")],
                          env={"PATH": str(tmp_path)}, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "no GPU on this machine" in done.stdout
