import re
from pathlib import Path

from setuptools import find_packages, setup

# The one version number lives in dist_gluon/_version.py; read it without importing the
# package (which needs MXNet).
VERSION = re.search(r'^__version__ = "([^"]+)"$',
                    (Path(__file__).parent / "dist_gluon" / "_version.py").read_text(),
                    re.M)[1]

setup(
    name="dist_gluon",
    version=VERSION,
    description="Data-parallel distributed training for MXNet Gluon on Horovod, "
                "ps-lite (dist_sync) and P3 with one training script.",
    packages=find_packages(include=["dist_gluon", "dist_gluon.*"]),
    # the fused codec kernels' source, compiled on the user's machine at first use (or by
    # `python -m dist_gluon._kernels`)
    package_data={"dist_gluon": ["_kernels.cc"]},
    # 3.10: zip(strict=True). Below 3.12: MXNet 1.9 needs numpy<1.24, which has no
    # wheels for Python 3.12 or later (and does not build there).
    python_requires=">=3.10,<3.12",
    # No requirement on the `mxnet` name: MXNet 1.9 comes as mxnet (CPU), mxnet-cu112,
    # ... which all install the one `mxnet` module, and requiring `mxnet` would put the
    # CPU build over a GPU build (horovod and BytePS declare none either). `import
    # dist_gluon` checks for MXNet 1.9 and says how to install it (_requirements.py).
    # numpy 1.24 removed np.bool, which mxnet 1.9 uses at import.
    install_requires=["numpy<1.24"],
    # No horovod extra: pip would build horovod in an isolated environment without
    # MXNet, and so without horovod.mxnet. README gives the command that builds it
    # against the installed MXNet; the horovod backend checks the build at start.
    extras_require={
        "examples": ["gluoncv==0.10.5.post0", "matplotlib"],
        "test": ["pytest", "pytest-xdist", "hypothesis", "ruff", "coverage", "allpairspy"],
    },
    entry_points={"console_scripts": ["dist-gluon-run=dist_gluon.launch:main"]},
)
