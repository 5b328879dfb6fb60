"""``import dist_gluon`` finds a missing or unsupported MXNet (or numpy) from the installed
files, and the horovod backend finds a horovod that cannot run the job, each with the
command that fixes it. Fake installations sit first on PYTHONPATH in a fresh process."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conftest import REPO


def _python(code: str, site: Path, env=None) -> subprocess.CompletedProcess:
    # none of the caller's MPI or horovod variables: each test states its own
    full_env = {k: v for k, v in os.environ.items()
                if not k.startswith(("OMPI_", "PMI", "HOROVOD_"))}
    full_env.update(PYTHONPATH=f"{site}{os.pathsep}{REPO}", **(env or {}))
    return subprocess.run([sys.executable, "-c", code], cwd=site, env=full_env,
                          capture_output=True, text=True, timeout=60)


def _fake_mxnet(site: Path, dist_infos=(), libinfo_version="1.9.1") -> None:
    """An `mxnet` package in ``site`` with the given ``name-version.dist-info`` beside it."""
    (site / "mxnet").mkdir(parents=True)
    (site / "mxnet" / "__init__.py").write_text("raise RuntimeError('imported')\n")
    (site / "mxnet" / "libinfo.py").write_text(f'__version__ = "{libinfo_version}"\n')
    for dist_info in dist_infos:
        (site / f"{dist_info}.dist-info").mkdir()
        (site / f"{dist_info}.dist-info" / "top_level.txt").write_text("mxnet\n")


@pytest.mark.parametrize("dist_info", ["mxnet-1.9.1", "mxnet_cu112-1.9.1", "mxnet_mkl-1.9.0",
                                       "mxnet-1.9.1.post0"])
def test_any_mxnet_1_9_build_is_accepted_without_importing_it(tmp_path, dist_info):
    _fake_mxnet(tmp_path, [dist_info])
    proc = _python("import sys, dist_gluon; print('mxnet' in sys.modules)", tmp_path)
    assert (proc.returncode, proc.stdout.strip()) == (0, "False"), proc.stderr


@pytest.mark.parametrize("dist_info,found", [
    ("mxnet-1.8.0", "mxnet 1.8.0"),
    ("mxnet_cu112-2.0.0b1", "mxnet-cu112 2.0.0b1"),
    ("mxnet_cu102-1.6.0.post0", "mxnet-cu102 1.6.0.post0"),
])
def test_an_unsupported_mxnet_is_an_import_error_naming_it_and_the_versions_that_work(
        tmp_path, dist_info, found):
    _fake_mxnet(tmp_path, [dist_info])
    proc = _python("import dist_gluon", tmp_path)
    assert proc.returncode == 1
    message = proc.stderr.strip().splitlines()
    assert f"ImportError: dist_gluon needs MXNet 1.9 (1.9.0 or 1.9.1; 1.9.1 is tested), " \
           f"but this Python ({sys.executable}) has {found} at {tmp_path / 'mxnet'}" \
           in message[-3]
    assert f"pip uninstall -y {found.split()[0]}" in message[-3]
    assert message[-2:] == ["  CPU:   pip install mxnet==1.9.1 'numpy<1.24'",
                            "  CUDA:  pip install mxnet-cu112==1.9.1 'numpy<1.24'"]


def test_a_source_build_is_judged_by_its_libinfo_version(tmp_path):
    _fake_mxnet(tmp_path / "good", libinfo_version="1.9.1")
    _fake_mxnet(tmp_path / "old", libinfo_version="1.7.0")
    assert _python("import dist_gluon", tmp_path / "good").returncode == 0
    proc = _python("import dist_gluon", tmp_path / "old")
    assert proc.returncode == 1 and "has mxnet 1.7.0 at" in proc.stderr


def test_two_mxnet_builds_over_each_other_are_a_warning_that_says_keep_one(tmp_path):
    _fake_mxnet(tmp_path, ["mxnet-1.9.1", "mxnet_cu112-1.9.1"])
    proc = _python("import dist_gluon", tmp_path, env={"PYTHONWARNINGS": "error"})
    assert proc.returncode == 1
    assert "RuntimeWarning: mxnet 1.9.1 and mxnet-cu112 1.9.1 are all installed" in proc.stderr
    assert "pip uninstall -y mxnet mxnet-cu112, then reinstall" in proc.stderr


def test_numpy_1_24_or_later_is_an_import_error_with_the_pin(tmp_path):
    _fake_mxnet(tmp_path, ["mxnet-1.9.1"])
    (tmp_path / "numpy").mkdir()
    (tmp_path / "numpy" / "__init__.py").write_text("")
    (tmp_path / "numpy-1.26.4.dist-info").mkdir()
    proc = _python("import dist_gluon", tmp_path)
    assert proc.returncode == 1
    assert ("ImportError: MXNet 1.9 needs numpy < 1.24 (numpy 1.24 removed np.bool, which "
            f"mxnet uses), but this Python ({sys.executable}) has numpy 1.26.4: "
            "pip install 'numpy<1.24' (1.23.5 is tested)") in proc.stderr


# ----------------------------------------------------------------------------- horovod
def _fake_horovod(site: Path, mxnet_module: str) -> None:
    (site / "horovod" / "mxnet").mkdir(parents=True)
    (site / "horovod" / "__init__.py").write_text("__version__ = '0.28.1'\n")
    (site / "horovod" / "mxnet" / "__init__.py").write_text(textwrap.dedent(mxnet_module))


IMPORT_HOROVOD = "from dist_gluon._requirements import import_horovod; import_horovod()"
GLOO_ONLY = "def mpi_built():\n    return False\n"
WITH_MPI = "def mpi_built():\n    return True\n"


def test_a_horovod_built_without_mxnet_is_found_with_the_command_that_rebuilds_it(tmp_path):
    # what horovod 0.28.1 raises when its MXNet extension was not built
    _fake_horovod(tmp_path, """\
        raise ImportError("Extension horovod.mxnet has not been built: mpi_lib.so not found")
        """)
    proc = _python(IMPORT_HOROVOD, tmp_path)
    assert proc.returncode == 1
    assert ("the 'horovod' backend needs horovod 0.28.1 built with MXNet support, but "
            "horovod 0.28.1 is installed without working MXNet support (ImportError: "
            "Extension horovod.mxnet has not been built") in proc.stderr
    assert ("  pip uninstall -y horovod && HOROVOD_WITH_MXNET=1 HOROVOD_WITH_GLOO=1 pip "
            "install --no-build-isolation --no-cache-dir horovod==0.28.1\n") in proc.stderr


@pytest.mark.parametrize("env", [{"OMPI_COMM_WORLD_SIZE": "2"}, {"PMI_SIZE": "2"},
                                 {"HOROVOD_CONTROLLER": "mpi"}])
def test_an_mpi_job_on_a_horovod_without_mpi_is_found_with_the_command_that_adds_it(
        tmp_path, env):
    _fake_horovod(tmp_path, GLOO_ONLY)
    proc = _python(IMPORT_HOROVOD, tmp_path, env=env)
    assert proc.returncode == 1
    assert "this worker was started by MPI (" in proc.stderr
    assert "horovod 0.28.1 was built without MPI, so each worker would train alone" \
        in proc.stderr
    assert ("  pip uninstall -y horovod && HOROVOD_WITH_MPI=1 HOROVOD_WITH_MXNET=1 "
            "HOROVOD_WITH_GLOO=1 pip install --no-build-isolation --no-cache-dir "
            "horovod==0.28.1\n") in proc.stderr


@pytest.mark.parametrize("module,env", [
    (GLOO_ONLY, {}),
    # a Gloo worker of our launcher under srun inherits PMI_* but is told its controller
    (GLOO_ONLY, {"PMI_SIZE": "2", "HOROVOD_CONTROLLER": "gloo"}),
    (WITH_MPI, {"OMPI_COMM_WORLD_SIZE": "2"}),
])
def test_a_horovod_that_can_run_the_job_passes(tmp_path, module, env):
    _fake_horovod(tmp_path, module)
    proc = _python(IMPORT_HOROVOD, tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr
