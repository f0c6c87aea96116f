"""What the tests of get()'s paths in C share (test_cold_load.py, test_c_owner_and_wait.py):
keys, the counters both paths must agree on, a rank warmed past its first miss, the same
operations run through either path, and two caches made alike (one per path)."""
import contextlib

import numpy as np
import pytest

from ucmcache import SlotCache

from conftest import run_uuid

K = [i.to_bytes(8, "little") * 2 for i in range(200)]
TIMING = ("wait_ns", "load_sum_ns", "wait_sum_ns", "wait_seconds")


def counters(c):
    s = c.stats()
    return {k: v for k, v in s.items() if isinstance(v, int) and k not in TIMING}


def warm(c):
    """The first miss of a rank takes its share of the arenas (UCM_MOVED: the full path's
    decision); after it, cold keys take the C path."""
    c.get_or_load(K[199], lambda: b"first")
    return c


def run_ops(c, kw):
    """The same operations through either path: kw {} is the C path (a plain id, no timeout);
    {"timeout": 30.0} sends every call to the full path (_get_or_load_full)."""
    out = []
    for k in K[:40]:                                   # cold: fill, then evict (16 slots)
        out.append(c.get_or_load(k, lambda k=k: k * 4, **kw))
    for k in K[30:40]:                                 # hits
        out.append(c.get_or_load(k, lambda: b"never", **kw))
    for bad, err in [(lambda: 1 / 0, ZeroDivisionError), (lambda: "text", TypeError),
                     (lambda: b"x" * 65, ValueError),
                     (lambda: np.zeros((4, 4))[:, 0], ValueError)]:
        with pytest.raises(err):
            c.get_or_load(K[100 + len(out)], bad, **kw)
        out.append(err.__name__)
    out.append(c.get_or_load(K[150], lambda: bytearray(b"ba"), **kw))
    out.append(c.get_or_load(K[151], lambda: np.arange(4, dtype=np.uint8), **kw))
    out.append(c.get_or_load(K[152], lambda: memoryview(b"mv"), **kw))
    out.append(c.get_or_load(K[153], lambda: b"", **kw))
    out.append(c.get_or_load(K[153], lambda: b"never", **kw))
    return out


@contextlib.contextmanager
def c_and_full(uuid, **params):
    """Two caches made alike: (one for the C path, on the test's uuid; one for the full path, on
    a second uuid of the run, unlinked after)."""
    full_uuid = run_uuid()
    a = SlotCache.create(uuid, **params)
    try:
        b = SlotCache.create(full_uuid, **params)
        try:
            yield a, b
        finally:
            b.close()
            SlotCache.unlink(full_uuid)
    finally:
        a.close()
