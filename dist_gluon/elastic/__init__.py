"""Elastic training, the worker's side.

Two ways through a change of the job's nodes (``dist_gluon.launch --nnodes MIN:MAX``):

- **In memory, the processes stay** (:class:`State`, :func:`run`; horovod elastic's
  shape): the training function commits its state at every step; when a node is lost
  the survivors go back to their last commit and go on in the same processes on the
  new world, and a joining node's new workers get the state from a live peer. No
  checkpoint file is read. See :mod:`dist_gluon.elastic.rounds`. On ps-lite
  (``dist_sync``, ``p3``, ``dist_async``), which starts once per process, the same
  script's workers restart instead, and take the freshest commit of the job from their
  nodes' shared memory or a live peer (:mod:`dist_gluon.elastic.nodecopy`).
- **Through checkpoints, the workers restart** (:func:`stop_requested`, with
  :class:`dist_gluon.Checkpointer`): every worker stops at a step boundary, saves and
  exits, and the launcher starts them again on the new world. Restarts of the whole job
  always go this way.
"""
from .rounds import run
from .state import HostsUpdatedInterrupt, State
from .stop import stop_requested

__all__ = ["HostsUpdatedInterrupt", "State", "run", "stop_requested"]
