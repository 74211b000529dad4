"""Loaded by a gateway process started with this folder on PYTHONPATH: shifts the
process's wall clock by GATEWAY_TEST_CLOCK_SKEW seconds, to show that counting does not
depend on the gateways' own clocks (it uses the counter store's)."""

import os
import time

_skew = float(os.environ.get("GATEWAY_TEST_CLOCK_SKEW", "0"))
if _skew:
    _time, _time_ns = time.time, time.time_ns
    time.time = lambda: _time() + _skew
    time.time_ns = lambda: _time_ns() + int(_skew * 1e9)
