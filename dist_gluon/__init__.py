"""dist_gluon: data-parallel distributed training for MXNet Gluon and Module.

One training script runs unchanged on one process, on Horovod, and on MXNet's
parameter server (ps-lite ``dist_sync`` or P3); the backend is chosen by the launcher.

>>> import dist_gluon as dg
>>> kv = dg.create()                      # from the environment the launcher set
>>> trainer = dg.DistributedTrainer(net.collect_params(), 'sgd', {'learning_rate': 0.1})
"""
from .backends import BACKEND_NAMES, Backend, create
from .backends import register as _register
from .broadcast import ModelMismatchError, broadcast_parameters
from .checkpoint import Checkpointer, CheckpointError
from .data import ShardSampler, reduce_metric, shard_kwargs
from .optimizer import DistributedOptimizer
from .trainer import DistributedTrainer

_register()

__all__ = ["BACKEND_NAMES", "Backend", "CheckpointError", "Checkpointer",
           "DistributedOptimizer", "DistributedTrainer", "ModelMismatchError",
           "ShardSampler", "broadcast_parameters", "create", "reduce_metric", "shard_kwargs"]
