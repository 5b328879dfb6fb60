"""Stopping together when the launcher asks (the checkpoint path of elastic jobs).

A launcher started with ``--nnodes MIN:MAX`` (an elastic job, ``DG_ELASTIC=1`` in every
worker's environment) re-forms the job when a node is lost, preempted (SIGTERM) or
joins. Before it does, it asks the workers to stop at a step boundary by writing a stop
request into the job-control record of one or more ranks
(:mod:`dist_gluon.jobcontrol`). :func:`stop_requested` turns those per-rank requests
into one answer that every rank gets at the same step, so that all of them save the
same checkpoint and exit; the launcher then restarts the workers with the new world
size and they resume from that checkpoint.
"""
from __future__ import annotations

import mxnet as mx

from .. import jobcontrol, worker
from ..backends import Backend, resolve

# the key of the one-element sum; dist_gluon's reserved keys start with __dg
_STOP_KEY = "__dg_stop"


def _elastic() -> bool:
    """Started by a launcher that may ask for a stop (``--nnodes MIN:MAX``)."""
    return worker.context().elastic


def stop_requested(kv: Backend | str | None = None) -> bool:
    """Whether the launcher asked the job to stop here; the same answer on every rank.

    A collective: every rank calls it at the same point of its loop, typically once per
    step, after ``trainer.step``. It returns True on every rank, at the same call, once
    the launcher has asked any rank to stop (an elastic launcher does so before it
    re-forms the job: a node was lost, is being preempted, or a new node waits to join).
    The script then saves a checkpoint at that step (:meth:`Checkpointer.save`) and
    exits normally; the launcher re-forms the job, restarts the workers with the new
    world size, and they resume from that checkpoint (``Checkpointer.restore``, then
    ``ShardSampler.set_epoch(epoch, skip=...)`` to continue inside the epoch).

    What it costs: in an elastic job (``DG_ELASTIC=1``, set by ``dist_gluon.launch
    --nnodes MIN:MAX``) with more than one worker, a sum of one number over the workers,
    which the call waits for (on ``dist_async`` it also makes the workers wait for each
    other once per call). Otherwise it only reads this worker's record: nothing is sent,
    and without a launcher it is always False.

    Parameters
    ----------
    kv : Backend, str or None, default None
        The backend, a backend name, or None to create it from the environment.

    Returns
    -------
    bool
        True when the job should save a checkpoint and exit now. The launcher sees that
        every rank agreed (the record's acknowledgement).

    Examples
    --------
    >>> ckpt = dg.Checkpointer('checkpoints')
    >>> state = ckpt.restore(net, trainer)            # None in the first run
    >>> start, done = (state['epoch'], state['extra']['done']) if state else (0, 0)
    >>> for epoch in range(start, epochs):
    ...     skip = done if epoch == start else 0      # positions of this epoch done
    ...     sampler.set_epoch(epoch, skip=skip)       # a dg.ShardSampler
    ...     for i, (data, label) in enumerate(loader):
    ...         ...                                   # forward, backward
    ...         trainer.step(data.shape[0])
    ...         if dg.stop_requested():
    ...             done = skip + (i + 1) * batch_size * kv.num_workers
    ...             ckpt.save(net, trainer, epoch, step=i + 1, extra={'done': done})
    ...             sys.exit(0)                       # the launcher restarts the job
    ...     ckpt.save(net, trainer, epoch + 1, extra={'done': 0})
    """
    return _agreed_stop(resolve(kv))


def _agreed_stop(backend: Backend) -> bool:
    """stop_requested's answer for ``backend``; acknowledged in the record when True."""
    reporter = jobcontrol.reporter()
    asked = 1.0 if reporter is not None and reporter.stop_request() else 0.0
    if _elastic() and backend.num_workers > 1:
        # ranks read their records at different moments, so one may see a request that
        # another does not see yet: the sum of what they saw is one answer for all
        flag = mx.nd.full((1,), asked, dtype="float32")
        backend.pushpull(_STOP_KEY, flag)
        asked = float(flag.asscalar())
    if not asked:
        return False
    if reporter is not None:
        reporter.stop_acknowledged()
    return True


