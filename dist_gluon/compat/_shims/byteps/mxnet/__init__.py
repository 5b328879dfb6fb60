"""``byteps.mxnet`` as :mod:`dist_gluon.compat.byteps` (the launcher's ``--compat
byteps``)."""
import dist_gluon.compat.byteps as _byteps
from dist_gluon.compat.byteps import *  # noqa: F403
from dist_gluon.compat.byteps import __all__  # noqa: F401

from . import compression  # noqa: F401  (byteps.mxnet imports it too)

# broadcast_parameters counts in dist_gluon.compat.byteps; read it there (PEP 562)
del parameter_index  # noqa: F821


def __getattr__(name):
    if name == "parameter_index":
        return _byteps.parameter_index
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
