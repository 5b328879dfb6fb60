"""What dist_gluon needs installed beside it, and the errors that say how to install it.

MXNet
-----
dist_gluon declares no requirement on the ``mxnet`` distribution: MXNet 1.9 comes as
``mxnet`` (CPU) and as CUDA builds (``mxnet-cu112``, ...) that all install the one
``mxnet`` module, so requiring it by name would install the CPU build over a GPU build
(horovod and BytePS declare none either). Instead ``import dist_gluon`` calls
:func:`check_mxnet`, which finds the installed build from its files and raises an
ImportError naming the versions that work and how to install one. It imports neither
mxnet nor ``importlib.metadata`` (tens of milliseconds): the launcher imports this
package too and must start in a fraction of a second.

Horovod
-------
horovod 0.28.1 has no wheel, and pip builds it in an isolated environment that has no
MXNet, so a plain ``pip install horovod`` silently leaves out ``horovod.mxnet``; a
horovod built before MXNet changed, or without MPI for a job that mpirun started, fails
later and obscurely. :func:`import_horovod` finds each case at once and gives the
command that fixes it.
"""
from __future__ import annotations

import importlib.util
import os
import re
import sys
import warnings

MXNET_SERIES = (1, 9)   # MXNet 1.9.x; 1.9.1 is the tested release
NUMPY_BELOW = (1, 24)   # numpy 1.24 removed np.bool, which mxnet 1.9 uses at import
HOROVOD_VERSION = "0.28.1"

INSTALL_MXNET = ("install one MXNet 1.9 build (each provides the same `mxnet` module, so "
                 "only one at a time):\n"
                 "  CPU:   pip install mxnet==1.9.1 'numpy<1.24'\n"
                 "  CUDA:  pip install mxnet-cu112==1.9.1 'numpy<1.24'")
_LAUNCHER_NOTE = ("(The launcher, dist-gluon-run, does not import MXNet itself, but "
                  "dist_gluon checks for it wherever it is imported: install MXNet in "
                  "every environment that has dist_gluon.)")
_BUILD_HOROVOD = ("HOROVOD_WITH_MXNET=1 HOROVOD_WITH_GLOO=1 pip install --no-build-isolation "
                  f"--no-cache-dir horovod=={HOROVOD_VERSION}")
_INFO_DIR = re.compile(r"^(?P<name>[^-]+)(?:-(?P<version>[^-]+))?(?:-py[^-]*)?"
                       r"\.(?:dist|egg)-info$")
_MPI_LAUNCH_VARIABLES = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK")


def check_mxnet() -> None:
    """Raise ImportError unless MXNet 1.9 and a numpy it can import are installed.

    Reads the installed files only: ``mxnet`` is located with ``find_spec`` and its
    version is taken from the distribution that installed it (``mxnet``,
    ``mxnet-cu112``, ...), or from ``mxnet/libinfo.py`` for a source build.
    """
    python = sys.executable
    spec = importlib.util.find_spec("mxnet")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(f"dist_gluon needs MXNet 1.9 (1.9.1 is tested), but this Python "
                          f"({python}) has no `mxnet` module; {INSTALL_MXNET}\n"
                          f"{_LAUNCHER_NOTE}")
    package = spec.submodule_search_locations[0]
    dists = _distributions(os.path.dirname(package), "mxnet")
    if len(dists) > 1:
        listed = " and ".join(f"{name} {version}" for name, version in dists)
        names = " ".join(name for name, _ in dists)
        warnings.warn(f"{listed} are all installed and all provide the one `mxnet` module "
                      f"({package}): the one installed last overwrote the others' files, "
                      "and uninstalling any of them breaks the rest. Keep one: "
                      f"pip uninstall -y {names}, then reinstall the build you want.",
                      RuntimeWarning, stacklevel=2)
    name, version = dists[0] if len(dists) == 1 else ("mxnet", None)
    version = version or _libinfo_version(package)
    if version is not None and _release(version)[:2] != MXNET_SERIES:
        raise ImportError(f"dist_gluon needs MXNet 1.9 (1.9.0 or 1.9.1; 1.9.1 is tested), "
                          f"but this Python ({python}) has {name} {version} at {package}; "
                          f"uninstall it (pip uninstall -y {name}) and {INSTALL_MXNET}")
    _check_numpy(python)


def import_horovod(environ=os.environ):
    """``horovod.mxnet``, or an ImportError with the command that installs a horovod that
    can run this worker: built with MXNet support, and with MPI when MPI started it."""
    try:
        import horovod.mxnet as hvd
    except (ImportError, OSError) as err:
        if isinstance(err, ModuleNotFoundError) and err.name == "horovod":
            found, fix = "horovod is not installed", _BUILD_HOROVOD
        else:
            found = (f"{_horovod_name()} is installed without working MXNet support "
                     f"({type(err).__name__}: {err})")
            fix = f"pip uninstall -y horovod && {_BUILD_HOROVOD}"
        raise ImportError(
            f"the 'horovod' backend needs horovod {HOROVOD_VERSION} built with MXNet support, "
            f"but {found}. pip builds horovod in an isolated environment that has no MXNet, "
            "so build it in this one, after MXNet (--no-cache-dir keeps pip from reusing a "
            f"wheel built without it):\n  {fix}\n"
            "Or pick another backend: 'local', 'dist_sync' or 'p3'.") from err
    launcher = _mpi_launcher(environ)
    if launcher and not hvd.mpi_built():
        raise ImportError(
            f"this worker was started by MPI ({launcher}), but {_horovod_name()} was "
            "built without MPI, so each worker would train alone. Install OpenMPI (Debian: "
            "apt-get install openmpi-bin libopenmpi-dev) and rebuild horovod with it:\n"
            f"  pip uninstall -y horovod && HOROVOD_WITH_MPI=1 {_BUILD_HOROVOD}\n"
            "or run the job over Gloo (dist-gluon-run --backend horovod).")
    return hvd


def _horovod_name() -> str:
    version = getattr(sys.modules.get("horovod"), "__version__", None)
    return f"horovod {version}" if version else "horovod"


def _mpi_launcher(environ) -> str | None:
    """What says that MPI started this process, or None (HOROVOD_CONTROLLER decides when
    set: a Gloo worker of a SLURM job inherits srun's PMI variables)."""
    controller = environ.get("HOROVOD_CONTROLLER")
    if controller:
        return "HOROVOD_CONTROLLER=mpi" if controller == "mpi" else None
    return next((f"{name} is set" for name in _MPI_LAUNCH_VARIABLES if name in environ), None)


def _check_numpy(python: str) -> None:
    spec = importlib.util.find_spec("numpy")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(f"MXNet 1.9 needs numpy, and this Python ({python}) has none: "
                          "pip install 'numpy<1.24'")
    dists = _distributions(os.path.dirname(spec.submodule_search_locations[0]), "numpy")
    version = dists[0][1] if len(dists) == 1 else None
    if version is not None and _release(version)[:2] >= NUMPY_BELOW:
        raise ImportError(f"MXNet 1.9 needs numpy < 1.24 (numpy 1.24 removed np.bool, which "
                          f"mxnet uses), but this Python ({python}) has numpy {version}: "
                          "pip install 'numpy<1.24' (1.23.5 is tested)")


def _distributions(site_dir: str, module: str) -> list[tuple[str, str | None]]:
    """(name, version) of each distribution in ``site_dir`` that installed ``module``:
    its ``.dist-info`` (or ``.egg-info``) directory is named ``{name}-{version}``, the name
    is ``module`` or starts with ``module-``, and its top_level.txt, where present, lists
    ``module``."""
    found = []
    try:
        entries = sorted(os.listdir(site_dir))
    except OSError:
        return found
    for entry in entries:
        match = _INFO_DIR.match(entry)
        if not match:
            continue
        name = re.sub(r"[-_.]+", "-", match["name"]).lower()
        if name != module and not name.startswith(module + "-"):
            continue
        try:
            with open(os.path.join(site_dir, entry, "top_level.txt")) as f:
                if module not in f.read().split():
                    continue
        except OSError:
            pass   # (not every installer writes top_level.txt; the name decides)
        found.append((name, match["version"]))
    return found


def _libinfo_version(package: str) -> str | None:
    """``__version__`` from ``mxnet/libinfo.py``, which every MXNet 1.x has."""
    try:
        with open(os.path.join(package, "libinfo.py")) as f:
            match = re.search(r"""^__version__\s*=\s*["']([^"']+)["']""", f.read(), re.M)
    except OSError:
        return None
    return match[1] if match else None


def _release(version: str) -> tuple[int, ...]:
    """The leading release numbers of a version string: '1.9.1.post0' -> (1, 9, 1)."""
    match = re.match(r"\d+(?:\.\d+)*", version)
    return tuple(int(part) for part in match[0].split(".")) if match else ()
