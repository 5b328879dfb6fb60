"""dist_gluon.build_horovod: the patches to horovod 0.28.1's source, without a download.

The build itself runs in `make setup`; the launched test in tests/test_backends.py checks
what it changes (every finite float16 summed exactly over Gloo).
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from dist_gluon import build_horovod


def _sdist(tmp_path, texts: dict[str, str]):
    for name, text in texts.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


def _original(tmp_path):
    files: dict[str, str] = {}
    for name, before, _ in build_horovod.PATCHES:
        files[name] = files.get(name, "// start\n") + before + "// between\n"
    return _sdist(tmp_path, files)


def test_the_patches_make_assignment_unconditional_compare_bits_and_key_f16c_on_the_compiler(
        tmp_path):
    source = _original(tmp_path)
    build_horovod.patch(str(source))
    types = (source / "third_party/gloo/gloo/types.h").read_text()
    assert "if (rhs != *this)" not in types and "    x = rhs.x;\n    return *this;" in types
    assert "return x != rhs.x;" in types and "rhs.x);" not in types
    for name in ("math.h", "math.cc"):      # the declaration and the definition alike
        text = (source / "third_party/gloo/gloo" / name).read_text()
        assert "GLOO_USE_AVX" not in text
        assert text.count("#if defined(__AVX__) && defined(__F16C__)") == (1 if name == "math.h"
                                                                            else 2)
    sources = (source / "third_party/gloo/gloo/CMakeLists.txt").read_text()
    assert sources.index("/math.cc") < sources.index("/reduce.cc")


def test_a_source_without_the_text_to_patch_is_refused_by_name(tmp_path):
    """Another horovod (or an already patched tree) stops the build with the file's name,
    rather than building a wheel labelled as fixed that is not."""
    source = _original(tmp_path)
    build_horovod.patch(str(source))
    with pytest.raises(SystemExit, match=r"third_party/gloo/gloo/types.h of horovod 0.28.1 "
                                         r"does not hold the text to patch exactly once"):
        build_horovod.patch(str(source))


def test_without_an_index_the_build_says_it_needs_pypi(tmp_path):
    """No source to download (here: pip told to use no index) ends with what is needed,
    not a traceback."""
    proc = subprocess.run([sys.executable, "-m", "dist_gluon.build_horovod", str(tmp_path)],
                          capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PIP_NO_INDEX="1", PIP_FIND_LINKS=""))
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "could not download horovod 0.28.1's source" in proc.stderr
    assert "Traceback" not in proc.stderr and not list(tmp_path.iterdir())
