from setuptools import find_packages, setup

setup(
    name="dist_gluon",
    version="0.1.0",
    description="Data-parallel distributed training for MXNet Gluon on Horovod, "
                "ps-lite (dist_sync) and P3 with one training script.",
    packages=find_packages(include=["dist_gluon", "dist_gluon.*"]),
    python_requires=">=3.8",
    install_requires=["mxnet>=1.9.1,<2", "numpy<1.24"],
    extras_require={
        # horovod must be built after mxnet with HOROVOD_WITH_MXNET=1: `make setup` does it.
        "horovod": ["horovod==0.28.1"],
        "examples": ["gluoncv==0.10.5.post0", "scikit-learn", "matplotlib"],
        "test": ["pytest", "hypothesis", "ruff"],
    },
    entry_points={"console_scripts": ["dist-gluon-run=dist_gluon.launch:main"]},
)
