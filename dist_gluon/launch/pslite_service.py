"""ps-lite's scheduler and servers of a dist_sync, p3 or dist_async job, as the launcher
starts them: ``python -m dist_gluon.launch.pslite_service`` with ``DMLC_ROLE`` set to
``scheduler`` or ``server``.

MXNet runs a scheduler or a server inside ``import mxnet`` when ``DMLC_ROLE`` names one
(how its own tools/launch.py starts them, and how this launcher did). That import
generates the Python functions of MXNet's operators: about 3 s of CPU per process on
the project's machines, of which a scheduler uses nothing and a server only the
optimizer that ``KVStore.set_optimizer`` sends it (dist_async, or a gluon.Trainer that
updates on the kvstore). This module loads MXNet's library alone (about 0.2 s), creates
the same ``dist`` kvstore and runs the same loop through MXNet's C API. The Python
package is imported when a server first receives an optimizer, which it then installs
as MXNet's ``KVStoreServer`` does; every other command the workers send (the sync
mode, gradient compression, stopping) is handled inside the library, as before.
"""
from __future__ import annotations

import ctypes
import importlib.util
import logging
import os
import pickle
import sys

# MXNet's KVStoreServer: command 0 carries a pickled optimizer, the only command the
# library leaves to Python
SET_OPTIMIZER = 0
_CONTROLLER = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)


def load_library() -> ctypes.CDLL:
    """MXNet's library, found as ``import mxnet`` finds it (``MXNET_LIBRARY_PATH``,
    then next to the package), without importing the package."""
    spec = importlib.util.find_spec("mxnet")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("dist_gluon.launch.pslite_service: mxnet is not installed in this "
                         f"Python ({sys.executable})")
    path = os.path.join(list(spec.submodule_search_locations)[0], "libinfo.py")
    info_spec = importlib.util.spec_from_file_location("_dg_mxnet_libinfo", path)
    libinfo = importlib.util.module_from_spec(info_spec)
    info_spec.loader.exec_module(libinfo)
    lib = ctypes.CDLL(libinfo.find_lib_path()[0], ctypes.RTLD_LOCAL)
    lib.MXGetLastError.restype = ctypes.c_char_p
    return lib


class Service:
    """One scheduler or server: the ``dist`` kvstore MXNet would create for it."""

    def __init__(self, lib: ctypes.CDLL):
        self.lib = lib
        self.handle = ctypes.c_void_p()
        self._check(lib.MXKVStoreCreate(b"dist", ctypes.byref(self.handle)))
        self.kvstore = None      # MXNet's KVStore on the same handle, once one is needed

    def _check(self, status: int) -> None:
        if status != 0:
            raise RuntimeError(self.lib.MXGetLastError().decode(errors="replace"))

    def run(self) -> None:
        """Serve until the workers stop the job (returns on the scheduler too)."""
        controller = _CONTROLLER(self._control)     # referenced while the loop runs
        self._check(self.lib.MXKVStoreRunServer(self.handle, controller, None))

    def _control(self, command: int, body: bytes, _handle) -> None:
        if command != SET_OPTIMIZER:
            print(f"ps-lite server: unknown command ({command}, {body!r})", file=sys.stderr)
            return
        kvstore = self._mxnet_kvstore()
        kvstore.set_optimizer(pickle.loads(body))

    def _mxnet_kvstore(self):
        """MXNet's KVStore on this process's kvstore, importing MXNet's package first:
        during the import DMLC_ROLE says worker, or the import would start a second
        server in this process."""
        if self.kvstore is None:
            role = os.environ.get("DMLC_ROLE", "")
            os.environ["DMLC_ROLE"] = "worker"
            try:
                import mxnet as mx
            finally:
                os.environ["DMLC_ROLE"] = role
            self.kvstore = mx.kvstore.KVStore(self.handle)
            # what MXNet's KVStoreServer sets up before its first command
            logging.basicConfig(level=logging.DEBUG, format=(
                f"%(asctime)-15s Server[{self.kvstore.rank}] %(message)s"))
        return self.kvstore


def main() -> int:
    if os.environ.get("DMLC_ROLE") not in ("scheduler", "server"):
        print("dist_gluon.launch.pslite_service runs ps-lite's scheduler or a server: the "
              "launcher starts it with DMLC_ROLE=scheduler or server (and the other DMLC_* "
              "variables); a worker runs the training script instead", file=sys.stderr)
        return 2
    Service(load_library()).run()
    # MXKVStoreRunServer returns after ps-lite's Finalize (its last barrier with every
    # node of the job): nothing of the job is left here, and the process ends without
    # MXNet's exit handlers
    sys.stdout.flush()
    sys.stderr.flush()
    _save_coverage()
    os._exit(0)


def _save_coverage() -> None:
    """``make coverage`` measures every process the tests start, and os._exit skips the
    exit handler that would save this one's data."""
    coverage = sys.modules.get("coverage")
    current = coverage.Coverage.current() if coverage is not None else None
    if current is not None:
        current.stop()
        current.save()


if __name__ == "__main__":
    sys.exit(main())
