"""Put first on PYTHONPATH (``conftest.WORKER_PYTHONPATH``) for the processes the tests
start: they import MXNet without SciPy and OpenCV, as in an environment without the
examples' extra. ``make setup`` installs gluoncv for the examples, and gluoncv brings
both; MXNet 1.9 imports them whenever they are installed (quantization, test_utils,
sparse, image), which costs each process about 1 s of CPU of its 3 s start on this
machine. dist_gluon uses neither; MXNet treats both as optional. The tests that run
gluoncv (the examples, SyncBatchNorm's gluoncv cases) keep the full environment."""
import sys

_HIDDEN = ("scipy", "cv2")


class _Hidden:
    """A finder that answers first and says the hidden packages are not installed."""

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in _HIDDEN:
            raise ModuleNotFoundError(f"No module named {name!r} (hidden by tests/lean)",
                                      name=name)
        return None


sys.meta_path.insert(0, _Hidden())
