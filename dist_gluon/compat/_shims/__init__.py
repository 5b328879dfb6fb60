"""Stand-ins for the peers' packages, for scripts that are not changed at all.

The launcher's ``--compat byteps`` puts this directory first on the workers'
PYTHONPATH, so that their ``import byteps.mxnet`` finds :mod:`dist_gluon.compat.byteps`.
Nothing here is imported as ``dist_gluon.compat._shims`` (the ``__init__`` files make the
directory part of the installed package).
"""
