"""``byteps.mxnet.compression`` as :mod:`dist_gluon.compat.byteps`'s compression objects
(the launcher's ``--compat byteps``)."""
from dist_gluon.compat._training import _Compressor as Compressor  # noqa: F401
from dist_gluon.compat._training import _FP16Compressor as FP16Compressor  # noqa: F401
from dist_gluon.compat._training import _NoneCompressor as NoneCompressor  # noqa: F401
from dist_gluon.compat.byteps import Compression  # noqa: F401
from dist_gluon.compat.byteps import _NagAdapter as NagAdapter  # noqa: F401
from dist_gluon.compat.byteps import (  # noqa: F401
    _WeightDecayMomentumAdapter as WeightDecayMomentumAdapter,
)
