"""On PYTHONPATH for a clock-skew test: this machine's wall clock reads
ROVE_TEST_CLOCK_SKEW_S seconds off (negative: behind), as a host without NTP would.
Every process started with it (rove run, its warm servers, its workers) reads the same
skewed clock; the monotonic clock is untouched, as a skewed host's is."""

import os
import time

_SKEW = float(os.environ.get("ROVE_TEST_CLOCK_SKEW_S", "0") or 0)

if _SKEW:
    _time, _time_ns = time.time, time.time_ns
    time.time = lambda: _time() + _SKEW
    time.time_ns = lambda: _time_ns() + int(_SKEW * 1e9)
