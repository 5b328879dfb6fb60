"""The peers' MXNet APIs on dist_gluon's backends (MXNet RFC #16795).

Training scripts written for ``horovod.mxnet`` or ``byteps.mxnet`` run on every dist_gluon
backend (one process, horovod, dist_sync, p3) with their import line changed::

    import dist_gluon.compat.horovod as hvd      # was: import horovod.mxnet as hvd
    import dist_gluon.compat.byteps as bps       # was: import byteps.mxnet as bps

and a byteps script runs with no change at all when the launcher is given
``--compat byteps`` (its workers then find ``byteps.mxnet`` here; horovod is installed
beside dist_gluon, so ``horovod`` stays horovod's own).

The semantics are the peers', not dist_gluon's: their DistributedTrainer divides the
summed gradients by the number of workers and each rank's own batch size (dist_gluon's
divides by the summed batch sizes), horovod's trainer leaves the first broadcast to
``broadcast_parameters`` and BytePS's broadcasts at the first step, ``allreduce``
averages unless told otherwise, and so on. What cannot be mapped (process sets, Adasum,
BytePS's compressors and asynchronous mode...) raises an error that names it and says
what to use instead.
"""
