"""Build horovod 0.28.1's wheel from its source on PyPI, with Gloo's float16 sum fixed.

horovod 0.28.1 bundles a Gloo whose float16 sum is wrong for some pairs of values and
slow for all (benchmarks/FINDINGS.md 9l, 9m):

* **wrong**: ``gloo::float16::operator=`` skips the assignment when ``rhs != *this``
  is false, and ``operator!=`` compares the left value with the right one's *bits read
  as an integer* (``*this == rhs.x`` picks the ``int`` overload). So ``a + b`` keeps
  ``a`` whenever ``float16(bits of a + b) == a``: 0.000428 (0x0f03, 3843 as an integer)
  + 3844 gives 0.000428, since float16(3843) rounds to 3844, which is the sum.
* **slow**: ``gloo::sum<float16>`` takes the scalar loop, software conversions per
  element (and one more in each assignment's comparison), never its F16C loop: Gloo
  keys that loop on ``GLOO_USE_AVX`` of its generated config.h, which neither
  gloo/math.h nor math.cc includes, and math.cc is not even compiled into the library,
  so horovod's code instantiates the scalar template.

This module downloads the sdist, fixes ``operator=`` and ``operator!=`` (assign always;
compare bits with bits), compiles math.cc and keys its F16C loop on the compiler's own
``__AVX__`` and ``__F16C__`` (horovod compiles with ``-mavx -mf16c`` where the build
machine has them), and builds the wheel with the local version ``0.28.1+dg2`` (``+dg1``
had the fix without the F16C loop): ``pip``'s ``horovod==0.28.1`` still matches it, and
dist_gluon reads the label to know the sums are exact
(:data:`dist_gluon.backends.horovod.EXACT_HALF_BUILDS`). The build's environment
(HOROVOD_WITH_MXNET, HOROVOD_WITH_MPI, ...) is the caller's.

    HOROVOD_WITH_MXNET=1 HOROVOD_WITH_GLOO=1 python -m dist_gluon.build_horovod WHEEL_DIR
    pip install WHEEL_DIR/horovod-0.28.1+dg2-*.whl

(after MXNet; add HOROVOD_WITH_MPI=1 for jobs that mpirun starts). It needs cmake and a
C++ compiler, and PyPI for the source; ``make setup`` runs it.
"""
from __future__ import annotations

import glob
import os
import subprocess
import sys
import tarfile
import tempfile

VERSION = "0.28.1"
LABEL = "dg2"
USAGE = "usage: python -m dist_gluon.build_horovod WHEEL_DIR"

_F16C = "#if defined(__AVX__) && defined(__F16C__)\n"
# (file, text before, text after): each must occur exactly once in the sdist
PATCHES = [
    ("third_party/gloo/gloo/types.h",
     "  float16& operator=(const float16& rhs) {\n"
     "    if (rhs != *this) {\n"
     "      x = rhs.x;\n"
     "    }\n"
     "    return *this;\n"
     "  }\n",
     "  float16& operator=(const float16& rhs) {\n"
     "    x = rhs.x;\n"
     "    return *this;\n"
     "  }\n"),
    ("third_party/gloo/gloo/types.h",
     "  bool operator!=(const float16& rhs) const {\n"
     "    return !(*this == rhs.x);\n"
     "  }\n",
     "  bool operator!=(const float16& rhs) const {\n"
     "    return x != rhs.x;\n"
     "  }\n"),
    # F16C's loop where the compiler targets it: horovod compiles Gloo with -mf16c -mavx
    # where the machine has them, but Gloo keys the loop on GLOO_USE_AVX from its
    # generated config.h, which neither math.h nor math.cc includes; and math.cc, which
    # defines the loop, is not among the library's sources
    ("third_party/gloo/gloo/CMakeLists.txt",
     '  "${CMAKE_CURRENT_SOURCE_DIR}/reduce.cc"\n',
     '  "${CMAKE_CURRENT_SOURCE_DIR}/math.cc"\n  "${CMAKE_CURRENT_SOURCE_DIR}/reduce.cc"\n'),
    ("third_party/gloo/gloo/math.h",
     "#if GLOO_USE_AVX\n",
     _F16C),
    ("third_party/gloo/gloo/math.cc",
     "#if GLOO_USE_AVX\n#include <immintrin.h>\n#endif\n",
     _F16C + "#include <immintrin.h>\n#endif\n"),
    ("third_party/gloo/gloo/math.cc",
     "namespace gloo {\n\n#if GLOO_USE_AVX\n",
     "namespace gloo {\n\n" + _F16C),
]


def patch(source: str) -> None:
    """Apply :data:`PATCHES` to the unpacked sdist at ``source``."""
    for name, before, after in PATCHES:
        path = os.path.join(source, name)
        with open(path) as f:
            text = f.read()
        if text.count(before) != 1:
            raise SystemExit(f"build_horovod: {name} of horovod {VERSION} does not hold the "
                             f"text to patch exactly once; is this horovod {VERSION}?")
        with open(path, "w") as f:
            f.write(text.replace(before, after))


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(USAGE, file=sys.stderr)
        return 2
    wheels = os.path.abspath(argv[0])
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check"]
    with tempfile.TemporaryDirectory(prefix="dg-horovod-") as work:
        if subprocess.run(pip + ["download", "-q", "--no-deps", "--no-binary", ":all:",
                                 "-d", work, f"horovod=={VERSION}"]).returncode:
            raise SystemExit(f"build_horovod: pip could not download horovod {VERSION}'s "
                             "source (above); it needs PyPI or a mirror of it (pip's "
                             "index-url)")
        (sdist,) = glob.glob(os.path.join(work, f"horovod-{VERSION}.tar.gz"))
        with tarfile.open(sdist) as tar:
            tar.extractall(work, filter="data")
        source = os.path.join(work, f"horovod-{VERSION}")
        patch(source)
        env = dict(os.environ, HOROVOD_LOCAL_VERSION=LABEL)
        subprocess.run(pip + ["wheel", "-q", "--no-cache-dir", "--no-deps",
                              "--no-build-isolation", "-w", wheels, source],
                       check=True, env=env)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
