"""dist_gluon's stand-in for BytePS (the launcher's ``--compat byteps``):
``byteps.mxnet`` is :mod:`dist_gluon.compat.byteps`, on dist_gluon's backends."""
