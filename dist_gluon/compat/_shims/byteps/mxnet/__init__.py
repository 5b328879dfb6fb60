"""``byteps.mxnet`` as :mod:`dist_gluon.compat.byteps` (the launcher's ``--compat
byteps``)."""
from dist_gluon.compat.byteps import *  # noqa: F403
from dist_gluon.compat.byteps import __all__  # noqa: F401
