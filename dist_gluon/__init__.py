"""dist_gluon: data-parallel distributed training for MXNet Gluon and Module.

One training script runs unchanged on one process, on Horovod, and on MXNet's
parameter server (ps-lite ``dist_sync`` or P3); the backend is chosen by the launcher.

>>> import mxnet as mx
>>> import dist_gluon as dg
>>> kv = dg.create()                      # from the environment the launcher set
>>> trainer = dg.DistributedTrainer(net.collect_params(), 'sgd', {'learning_rate': 0.1})

The public names are loaded on first use, so the launcher (``python -m
dist_gluon.launch``), which needs neither MXNet nor Horovod, starts in a fraction of a
second. Importing dist_gluon after mxnet, or using any of its names, registers the
'horovod' backend with ``mx.kv.create``.

Which side a file runs on is told by its path: ``launch/`` is the launcher (one per
node; it imports neither MXNet nor Horovod), every other module runs in the processes
it starts (the workers, and ps-lite's servers for dist_async), and ``jobcontrol.py`` is
the shared-memory record between the two (standard library only, imported by both).
"""
import importlib
import sys

from . import _requirements
from ._version import __version__

# A missing or unsupported MXNet (or numpy) is an ImportError here, naming the versions
# that work; the check reads installed files and imports neither (see _requirements.py).
_requirements.check_mxnet()

_PUBLIC = {
    "BACKEND_NAMES": ".backends", "Backend": ".backends", "create": ".backends",
    "ModelMismatchError": ".broadcast", "broadcast_parameters": ".broadcast",
    "CheckpointError": ".checkpoint", "Checkpointer": ".checkpoint",
    "parse_devices": ".devices", "StaleGradientError": ".freshness",
    "ShardSampler": ".data", "reduce_metric": ".data", "shard_kwargs": ".data",
    "stop_requested": ".elastic",
    "DistributedOptimizer": ".optimizer", "DistributedTrainer": ".trainer",
    "SyncBatchNorm": ".syncbn", "convert_sync_batchnorm": ".syncbn",
    "DivergenceError": ".syncheck", "Join": ".join", "JoinError": ".join",
}
__all__ = sorted(_PUBLIC) + ["__version__"]


def _load():
    """Import the MXNet-backed API and register 'horovod' with ``mx.kv.create``."""
    namespace = globals()
    for name, module in _PUBLIC.items():
        namespace[name] = getattr(importlib.import_module(module, __name__), name)
    importlib.import_module(".backends", __name__).register()


def __getattr__(name):
    if name == "elastic":       # the subpackage (State, run), as dg.elastic.State
        _load()
        return importlib.import_module(".elastic", __name__)
    if name in _PUBLIC:
        _load()
        return globals()[name]
    raise AttributeError(f"module 'dist_gluon' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_PUBLIC))


# A ps-lite server runs its loop inside `import mxnet` and may unpickle a dist_gluon class
# there (the optimizer of dist_async, dist_gluon/async_updates.py): MXNet is half
# imported then (no mxnet.kv yet), so the API waits for its first use.
if "mxnet" in sys.modules and hasattr(sys.modules["mxnet"], "kv"):
    _load()
