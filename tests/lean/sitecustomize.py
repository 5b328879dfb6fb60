"""Put first on PYTHONPATH (``conftest.WORKER_PYTHONPATH``) for the processes the tests
start, to make their start cheap; what they compute is unchanged. Importing MXNet costs
such a process most of its CPU, and the suite starts about 400 of them. Three things
here take about 2 s of CPU off each (measured: a worker that imports MXNet and
dist_gluon and runs a hybridized layer, 3.0 s -> 0.8 s of CPU on this machine):

- **No SciPy, no OpenCV.** ``make setup`` installs gluoncv for the examples, and gluoncv
  brings both; MXNet 1.9 imports them whenever they are installed (quantization,
  test_utils, sparse, image), as in an environment without the examples' extra.
  dist_gluon uses neither; MXNet treats both as optional. The tests that run gluoncv
  (the examples, SyncBatchNorm's gluoncv cases) keep both: ``conftest.process_env(
  gluoncv=True)`` sets ``DG_TESTS_WITH_SCIPY=1``.
- **MXNet's operator functions made on first use.** At import MXNet writes and compiles a
  Python function for each of its ~2,300 operators, under mxnet.ndarray, mxnet.symbol
  and their numpy namespaces, although a worker calls a few dozen. Here each name is
  bound at import to a small function that, when first called, asks MXNet's own
  ``make_op_func`` for the real one and then forwards to it: the same code runs, built
  later. Until then the docstring is a one-line stand-in.
- **distutils from the standard library**, not setuptools' copy (see below).
- **requests loaded on first use** (a stand-in module that runs the real one when one
  of its names is first looked up): mxnet.gluon.utils and mxnet.test_utils import it
  for their downloads, which the tests never make.

``DG_TESTS_EAGER_IMPORT=1`` in the test's environment leaves out the other two (MXNet's
import as users have it, e.g. to rule them out when a test fails). P3's workers always
import MXNet as users do: MXNet 1.9's P3 kvstore has a race that segfaults now and then
while keys are created (benchmarks/FINDINGS.md 12), and the other timing of the first
steps made it more frequent (the compression cases under load, 2026-11-26: 4 crashes in
36 runs with the operators made on first use, none in 36 without).
"""
import importlib.machinery
import importlib.util
import os
import sys
import types

_HIDDEN = ("scipy", "cv2")


class _Hidden:
    """A finder that answers first and says the hidden packages are not installed."""

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in _HIDDEN:
            raise ModuleNotFoundError(f"No module named {name!r} (hidden by tests/lean)",
                                      name=name)
        return None


def _on_first_call(make_op_func):
    """MXNet's ``make_op_func(handle, name, func_name)``, deferred to the first call."""
    def make(handle, name, func_name):
        real = None

        def operator(*args, **kwargs):
            nonlocal real
            if real is None:
                real = make_op_func(handle, name, func_name)
            return real(*args, **kwargs)
        operator.__name__ = func_name
        operator.__doc__ = f"MXNet's operator {name} (made on first use by tests/lean)."
        return operator
    return make


class _Deferred:
    """A finder that loads requests lazily and, once mxnet.base has run, wraps its two
    operator registrations so that they bind deferred functions."""

    _NAMES = ("mxnet.base", "requests")

    def find_spec(self, name, path=None, target=None):
        if name not in self._NAMES:
            return None
        sys.meta_path.remove(self)      # find the real module with the other finders
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        if name == "requests":
            return importlib.machinery.ModuleSpec(name, _StubLoader(spec), origin=spec.origin,
                                                  is_package=True)
        spec.loader = _PatchedBase(spec.loader)
        return spec


class _Stub(types.ModuleType):
    """A module that runs the real one when a name other than a module's own dunders
    is first looked up in it (``importlib.util.LazyLoader`` runs it on any lookup, and
    an ``import requests`` of a module already imported looks up ``__spec__``, so
    MXNet's second import of requests loaded it after all)."""

    def __getattr__(self, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        real_spec = self.__dict__["_dg_real_spec"]
        real = importlib.util.module_from_spec(real_spec)
        sys.modules[real_spec.name] = real
        real_spec.loader.exec_module(real)
        self.__dict__.update(real.__dict__)      # for those who hold the stub
        return getattr(real, name)


class _StubLoader:
    def __init__(self, real_spec):
        self.real_spec = real_spec

    def create_module(self, spec):
        module = _Stub(spec.name)
        module.__dict__["_dg_real_spec"] = self.real_spec
        return module

    def exec_module(self, module):
        pass


class _PatchedBase:
    """Runs mxnet.base, then wraps ``_init_op_module`` and ``_init_np_op_module`` (the
    modules that register operators import them from mxnet.base afterwards)."""

    def __init__(self, loader):
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        self.loader.exec_module(module)
        init_op, init_np_op = module._init_op_module, module._init_np_op_module

        def _init_op_module(root_namespace, module_name, make_op_func):
            init_op(root_namespace, module_name, _on_first_call(make_op_func))

        def _init_np_op_module(root_module_name, np_module_name, mx_module_name,
                               make_op_func):
            init_np_op(root_module_name, np_module_name, mx_module_name,
                       _on_first_call(make_op_func))
        module._init_op_module = _init_op_module
        module._init_np_op_module = _init_np_op_module


# MXNet imports distutils (numpy_dispatch_protocol's LooseVersion); setuptools' shim
# would hand it setuptools' copy, importing setuptools (0.15 s of CPU): the standard
# library's, as without setuptools (setuptools itself puts its own back when imported)
if "_distutils_hack" in sys.modules:
    sys.modules["_distutils_hack"].remove_shim()
if os.environ.get("DG_TESTS_WITH_SCIPY") != "1":
    sys.meta_path.insert(0, _Hidden())
if os.environ.get("DG_TESTS_EAGER_IMPORT") != "1" and os.environ.get("DG_BACKEND") != "p3":
    sys.meta_path.insert(0, _Deferred())
