"""Communication backends behind one interface (:class:`Backend`).

``create(name)`` builds one; with no name it reads the environment the launcher (or
horovodrun, or MXNet's own ps-lite tools) left behind.
"""
from __future__ import annotations

import mxnet as mx
from mxnet.kvstore.base import KVStoreBase

from . import pslite
from .base import Backend
from .horovod import Horovod, started_by_horovod
from .local import Local
from .pslite import P3, DistAsync, DistSync, asynchronous, started_by_pslite, uses_p3_van

_BACKENDS = {"local": Local, "horovod": Horovod, "dist_sync": DistSync, "p3": P3,
             "dist_async": DistAsync}
BACKEND_NAMES = tuple(_BACKENDS)
# ps-lite can be started once per process, so each backend is created once and shared
# by everything that asks for it (trainer, sampler, checkpointer, ...).
_INSTANCES: dict[str, Backend] = {}


def detect() -> str:
    """The backend name the current process was started for."""
    if started_by_horovod():
        return "horovod"
    if started_by_pslite():
        if uses_p3_van():
            return "p3"
        return "dist_async" if asynchronous() else "dist_sync"
    return "local"


def create(name: str | None = None) -> Backend:
    """Create a backend.

    Parameters
    ----------
    name : {'local', 'horovod', 'dist_sync', 'p3', 'dist_async'} or None
        None chooses from the environment: started by horovodrun (or
        ``dist_gluon.launch --backend horovod``) -> 'horovod'; a ps-lite worker
        (``DMLC_ROLE=worker``) -> 'dist_sync', 'p3' with the P3 van, or 'dist_async'
        when the launcher started it so (``DG_BACKEND=dist_async``); otherwise 'local'.

    Returns
    -------
    Backend
        An ``mx.kv.KVStoreBase`` with rank, num_workers, broadcast, pushpull, ...
        Each name is created once per process and then shared.
    """
    if name is None:
        name = detect()
    if isinstance(name, Backend):
        return name
    key = name.lower() if isinstance(name, str) else name
    if key not in _BACKENDS:
        raise ValueError(f"unknown backend {name!r}; valid names are "
                         + ", ".join(repr(n) for n in BACKEND_NAMES))
    if key not in _INSTANCES:
        _INSTANCES[key] = _BACKENDS[key]()
    return _INSTANCES[key]


def resolve(kv) -> Backend:
    """``kv`` as a backend: None -> create(), a name -> create(name), a Backend as is."""
    if kv is None or isinstance(kv, str):
        return create(kv)
    if isinstance(kv, Backend):
        return kv
    raise TypeError(f"kv must be None, a backend name or a dist_gluon backend, got "
                    f"{type(kv).__name__}; MXNet's own KVStore objects are not supported, "
                    f"pass the name instead (e.g. kv='dist_sync')")


def _shared_horovod() -> Backend:
    """What ``mx.kv.create('horovod')`` calls: the process's one horovod backend, the
    same object as ``dist_gluon.create('horovod')``."""
    return create("horovod")


def register() -> None:
    """Make ``mx.kv.create('horovod')`` return our backend (MXNet calls the registry
    entry with no arguments, so it may be a function as well as a class). Assigned
    directly: MXNet's register() takes classes only, and MXNet's own names ('local',
    'dist_sync', ...) must stay MXNet's. ``mx.kv.create`` still returns MXNet's own
    stores for those, but a second ps-lite store in one process raises instead of
    blocking forever."""
    KVStoreBase.kv_registry["horovod"] = _shared_horovod
    if getattr(mx.kvstore.create, "_dg_guard", False):
        return
    mxnet_create = pslite._MXNET_CREATE

    def create(name="local"):
        if isinstance(name, str) and name.lower().startswith("dist") \
                and name.lower() not in KVStoreBase.kv_registry:
            pslite.claim_native_store(f"MXNet's {name!r} kvstore")
        return mxnet_create(name)

    create.__doc__ = mxnet_create.__doc__
    create._dg_guard = True
    mx.kvstore.create = create


__all__ = ["Backend", "Local", "Horovod", "DistSync", "P3", "DistAsync", "BACKEND_NAMES",
           "create", "detect", "resolve", "register"]
