"""The wheel installs into a user's own environment next to MXNet, and works there.

A wheel is built from a copy of the sources and installed into fresh virtual environments
from ``.venv/wheelhouse`` (the pinned mxnet and numpy wheels that ``make setup``
downloads), with ``--no-index``: nothing is downloaded here. Everything then runs through
the environment's own ``dist-gluon-run`` and ``python``, outside the checkout.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from conftest import REPO, assert_ok, worker_lines
from dist_gluon import __version__

WHEELHOUSE = REPO / ".venv" / "wheelhouse"


def _pip(*args) -> None:
    subprocess.run([sys.executable, "-m", "pip", "--disable-pip-version-check", *map(str, args)],
                   check=True, capture_output=True, text=True, timeout=300)


def _user_env() -> dict[str, str]:
    """This environment without the checkout or the project's venv on any path."""
    return {k: v for k, v in os.environ.items()
            if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}


def _run(argv, cwd, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([str(a) for a in argv], cwd=cwd,
                          env=dict(_user_env(), OMP_NUM_THREADS="1"),
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="session")
def wheel(tmp_path_factory) -> Path:
    if not (WHEELHOUSE / ".complete").exists():
        pytest.fail(f"{WHEELHOUSE} is missing: run `make setup`, which downloads the pinned "
                    "mxnet and numpy wheels these tests install offline")
    # a copy, so that the build's build/ and egg-info stay out of the shared checkout
    source = tmp_path_factory.mktemp("source")
    shutil.copy(REPO / "setup.py", source)
    shutil.copytree(REPO / "dist_gluon", source / "dist_gluon",
                    ignore=shutil.ignore_patterns("__pycache__"))
    out = tmp_path_factory.mktemp("wheel")
    _pip("wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w", out, source)
    (built,) = out.glob("dist_gluon-*.whl")
    return built


def _venv(path: Path) -> Path:
    """A fresh virtual environment at ``path``, without pip of its own (``_install`` runs
    this pip into it); returns its python."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True,
                   timeout=60)
    return path / "bin" / "python"


def _install(python: Path, *requirements) -> None:
    _pip("--python", python, "install", "--no-index", "--find-links", WHEELHOUSE,
         *requirements)


@pytest.fixture(scope="session")
def user_venv(wheel, tmp_path_factory) -> Path:
    """A user's environment that already held the pinned MXNet, then got the wheel."""
    root = tmp_path_factory.mktemp("user") / "venv"
    python = _venv(root)
    _install(python, "mxnet==1.9.1", "numpy==1.23.5")
    _install(python, wheel)
    return root


def test_the_wheel_carries_the_one_version_and_requires_no_mxnet_distribution(wheel):
    with zipfile.ZipFile(wheel) as archive:
        metadata = archive.read(f"dist_gluon-{__version__}.dist-info/METADATA").decode()
    fields = [line.split(": ", 1) for line in metadata.splitlines() if ": " in line]
    assert ["Version", __version__] in fields
    assert ["Requires-Python", ">=3.10,<3.12"] in fields
    requires = [value for key, value in fields if key == "Requires-Dist"]
    assert "numpy<1.24" in requires
    assert not [r for r in requires if r.startswith(("mxnet", "horovod"))], requires
    assert wheel.name == f"dist_gluon-{__version__}-py3-none-any.whl"


def test_the_installed_console_script_prints_the_version(user_venv, tmp_path):
    proc = _run([user_venv / "bin" / "dist-gluon-run", "--version"], tmp_path)
    assert (proc.returncode, proc.stdout.strip()) == (0, f"dist_gluon {__version__}"), \
        proc.stderr


def test_the_installed_console_script_exits_2_on_a_usage_error(user_venv, tmp_path):
    proc = _run([user_venv / "bin" / "dist-gluon-run", "-n", "2"], tmp_path)
    assert proc.returncode == 2
    assert "error: no command given: put the worker command after --" in proc.stderr


PUSHPULL_WORKER = """\
import os

import mxnet as mx

import dist_gluon as dg

kv = dg.create()
out = mx.nd.zeros((3,))
kv.pushpull("x", mx.nd.ones((3,)) * (kv.rank + 1), out=out)
installed = dg.__file__.startswith(os.environ["VENV"])
print(kv.type, kv.rank, kv.num_workers, out.asnumpy().tolist(), installed)
"""


def test_the_installed_package_runs_a_two_worker_dist_sync_job(user_venv, tmp_path):
    script = tmp_path / "pushpull.py"
    script.write_text(PUSHPULL_WORKER)
    proc = subprocess.run(
        [user_venv / "bin" / "dist-gluon-run", "-n", "2", "--backend", "dist_sync", "--",
         user_venv / "bin" / "python", script],
        cwd=tmp_path, env=dict(_user_env(), OMP_NUM_THREADS="1", VENV=str(user_venv)),
        capture_output=True, text=True, timeout=120)
    assert_ok(proc)
    for rank in (0, 1):
        assert worker_lines(proc.stdout, rank) == [f"dist_sync {rank} 2 [3.0, 3.0, 3.0] True"]


def test_import_without_mxnet_says_which_versions_work_and_how_to_install_one(
        wheel, tmp_path_factory):
    venv = tmp_path_factory.mktemp("no_mxnet") / "venv"
    python = _venv(venv)
    _install(python, "--no-deps", wheel)   # the wheel alone: MXNet is checked first
    for argv in ([python, "-c", "import dist_gluon"],
                 [venv / "bin" / "dist-gluon-run", "--version"]):
        proc = _run(argv, venv.parent)
        assert proc.returncode == 1
        lines = proc.stderr.strip().splitlines()
        assert lines[-4] == (f"ImportError: dist_gluon needs MXNet 1.9 (1.9.1 is tested), but "
                             f"this Python ({python}) has no `mxnet` module; install one "
                             "MXNet 1.9 build (each provides the same `mxnet` module, so only "
                             "one at a time):")
        assert lines[-3:-1] == ["  CPU:   pip install mxnet==1.9.1 'numpy<1.24'",
                                "  CUDA:  pip install mxnet-cu112==1.9.1 'numpy<1.24'"]
        assert "launcher, dist-gluon-run, does not import MXNet itself" in lines[-1]
