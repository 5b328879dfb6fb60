"""Put on PYTHONPATH by tests/test_multinode.py for the processes of one emulated host:
Python's wall clock (time.time) runs DG_TEST_CLOCK_OFFSET seconds off there, as on a
host whose clock is wrong (network namespaces share the machine's clock)."""
import os
import time

_offset = float(os.environ.get("DG_TEST_CLOCK_OFFSET", "0"))
if _offset:
    _real_time = time.time

    def _shifted_time() -> float:
        return _real_time() + _offset

    time.time = _shifted_time
