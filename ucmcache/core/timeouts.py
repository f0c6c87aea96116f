"""Timeouts: the one rule every call taking a ``timeout`` checks it by, before anything changes.

None and ``float("inf")`` both mean no deadline (the call waits without bound), and come back
as None: the waits turn a number of seconds into a deadline on the nanosecond clock
(``ucm_now_ns() + int(timeout * 1e9)``, an int64), where infinity has no value and anything past
about 9.2e9 s overflows.  So a finite timeout is held to [0, MAX_TIMEOUT] and a larger one is
refused with the way to say "no deadline", rather than clamped: 1e10 s and None differ where
a call bounds a lock wait by its timeout (None bounds it by the call's own default instead).
NaN, a negative number, a bool and anything that is not an int or a float are refused too.

A bound (check_bound) is the same rule for a number that must stay finite: a tier's timeout on
each disk or network step, its write timeout and its leases.  None and inf are refused there
(each step must end, and a lease's milliseconds are an int), and so is 0.
"""
from __future__ import annotations

import math
from typing import Optional

# The longest finite timeout, in seconds (about 31.7 years): as nanoseconds (1e18) added to the
# monotonic clock it stays far inside an int64 (9.2e18), and the hit path in C hands anything
# above it to the full path (csrc/ucm_hit.c, handle_wait), which checks it here.
MAX_TEXT = "1e9"
MAX_TIMEOUT = float(MAX_TEXT)


def check_timeout(timeout: object) -> Optional[float]:
    """``timeout`` as the waits use it: None for no deadline (None or inf), else a float of
    seconds in [0, MAX_TIMEOUT]; anything else raises ValueError naming it."""
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) \
            or timeout != timeout or timeout < 0:
        raise ValueError(f"timeout must be None or a number of seconds >= 0 (None or "
                         f"float('inf'): no deadline), got {timeout!r}")
    if timeout > MAX_TIMEOUT:
        if math.isinf(timeout):
            return None
        raise ValueError(f"timeout {timeout!r} s is longer than the longest finite wait, "
                         f"{MAX_TEXT} s (about 31 years): pass None or float('inf') to wait "
                         "without a deadline")
    return float(timeout)


def check_bound(value: object, name: str) -> float:
    """``value`` (the parameter ``name``) as a float of seconds in (0, MAX_TIMEOUT]; anything
    else (None, inf, NaN, 0, negative, a bool, not a number) raises ValueError naming it."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not 0 < value <= MAX_TIMEOUT:
        raise ValueError(f"{name} must be a positive number of seconds, at most {MAX_TEXT} "
                         f"(a bound: every step must end, so no None or inf), got {value!r}")
    return float(value)
