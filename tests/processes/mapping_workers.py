"""Worker processes for tests/core/test_mapping.py (spawned: importable, module-level)."""
import os

from ucmcache import SlotCache
from ucmcache.lowlevel import Gate

from workers import run


def slow_square(runs_path, started_path, go_path, x):
    """The memoized function of the tests: records each run, says it started, and returns only
    once `go` is released (bounded)."""
    with open(runs_path, "a") as f:
        f.write(f"{os.getpid()}\n")
    Gate(started_path).release()
    Gate(go_path).wait_value(1, timeout=30)
    return {"square": x * x, "by": os.getpid()}


def memoized(cache):
    return cache.memoize("tests.mapping.v1")(slow_square)


def _call_memoized(uuid, *args):
    c = SlotCache.attach(uuid)
    try:
        return memoized(c)(*args)
    finally:
        c.close()


def call_memoized(q, *args):
    run(_call_memoized, q, *args)


def _look(uuid, key):
    c = SlotCache.attach(uuid)
    try:
        try:
            value = c[key]
        except KeyError:
            value = None
        return key in c, len(c), value
    finally:
        c.close()


def look(q, *args):
    run(_look, q, *args)
