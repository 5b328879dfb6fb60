"""``byteps.mxnet.ops`` as :mod:`dist_gluon.compat.byteps` (the launcher's ``--compat
byteps``)."""
from dist_gluon.compat.byteps import (  # noqa: F401
    byteps_declare_tensor,
    byteps_push_pull,
    init,
    local_rank,
    local_size,
    rank,
    resume,
    shutdown,
    size,
    suspend,
)
