"""Timeouts, one rule at every call that takes one (ucmcache/core/timeouts.py): None and
float("inf") wait without a deadline; a finite timeout past MAX_TIMEOUT (1e9 s), which the
nanosecond clock could not hold as a deadline, is refused up front with the way to say "no
deadline"; NaN, negative numbers, bools and non-numbers are refused, on a hit too.  Each refusal
comes before any shared word changes.

(Before: inf, or anything past about 9.2e9 s, passed the check and then raised OverflowError
from the cold paths, where a deadline was computed; a hit with the same timeout worked.)
"""
import asyncio
import contextlib
import contextvars
import math
import threading
import time

import pytest

import ucmcache
from ucmcache import SlotCache
from ucmcache.core.verify import snapshot

K, J = b"K" * 16, b"J" * 16
INF = float("inf")
BAD = [float("nan"), -1, -INF, True, "1", 1e10, 2.0 ** 70, 10 ** 30]
REFUSED = r"^timeout (must be None or a number of seconds|.* is longer than the longest)"


# ---------------------------------------------------------------- the calls, each with a timeout

def call_get(c, t):
    with c.get(K, timeout=t) as h:
        assert h.owner
        h.data[:2] = b"ok"
        h.ready(2)
    return c[K]


def call_get_many(c, t):
    with c.get_many([K, J], timeout=t) as b:
        assert list(b.owner) == [True, True]
        for i in range(2):
            b.data(i)[:2] = b"ok"
            b.ready(i, 2)
    return c[K]


def call_get_or_load(c, t):
    return c.get_or_load(K, lambda: b"ok", timeout=t)


def call_aget_or_load(c, t):
    return asyncio.run(c.aget_or_load(K, lambda: b"ok", timeout=t))


def call_put(c, t):
    assert c.put(K, b"ok", timeout=t)
    return c[K]


def call_memoize(c, t):
    return c.memoize("tests.timeouts.v1", timeout=t)(lambda x: x)(b"ok")


def call_delete(c, t):
    c.put(K, b"ok")
    assert c.delete(K, timeout=t)
    assert K not in c
    return b"ok"


def call_delete_many(c, t):
    c.put(K, b"ok")
    assert c.delete_many([K], timeout=t) == [True]
    assert K not in c
    return b"ok"


COLD_CALLS = [call_get, call_get_many, call_get_or_load, call_aget_or_load, call_put,
              call_memoize, call_delete, call_delete_many]


@pytest.mark.parametrize("call", COLD_CALLS, ids=lambda f: f.__name__[5:])
def test_an_infinite_timeout_is_no_deadline_on_the_cold_paths(make_cache, call):
    c = make_cache(slot_size=64)
    assert call(c, INF) == b"ok"
    assert c._open_handles == 0 and ucmcache.verify(c.uuid).ok


# ---------------------------------------------------------------- waits for another's load

def publish_once_waited_on(c, h, failures):
    """The owner's side, in a thread: publish h's load once a waiter sleeps on its slot (the
    WAITERS bit of its state word is set by a waiter before its futex wait), so the wait is
    known to have begun, with its deadline computed, while the slot was Loading.  Bounded: if
    nobody ever waits, the load is failed, so a wait that came too late ends too."""
    def run():
        try:
            deadline = time.monotonic() + 30
            while not int(snapshot(c._seg)["metas"]["state"][h.slot]) & ucmcache._core.lib.UCM_WAITERS:
                if time.monotonic() > deadline:
                    h.fail("nobody waited")
                    raise AssertionError("the waiter never slept on the slot")
                time.sleep(0.001)
            h.data[:2] = b"ok"
            h.ready(2)
        except BaseException as e:
            failures.append(e)
        finally:
            h.close()
    t = threading.Thread(target=run)
    t.start()
    return t


def wait_handle(c, t):
    with c.get(K) as j:
        assert not j.owner
        return bytes(j.wait(t).data)


def wait_handle_default(c, t):
    with c.get(K, timeout=t) as j:                 # the handle's default for wait()
        assert not j.owner
        return bytes(j.wait().data)


def wait_handle_async(c, t):
    async def main():
        with c.get(K) as j:
            return bytes((await j.wait_async(t)).data)
    return asyncio.run(main())


def wait_batch(c, t):
    with c.get_many([K], timeout=t) as b:
        assert not b.owner[0]
        return bytes(b.wait(t).data(0))


def wait_get_or_load(c, t):
    return c.get_or_load(K, lambda: b"never", timeout=t)


def wait_aget_or_load(c, t):
    return asyncio.run(c.aget_or_load(K, lambda: b"never", timeout=t))


WAITS = [wait_handle, wait_handle_default, wait_handle_async, wait_batch, wait_get_or_load,
         wait_aget_or_load]


@pytest.mark.parametrize("timeout", [INF, None])
@pytest.mark.parametrize("wait", WAITS, ids=lambda f: f.__name__[5:])
def test_an_infinite_timeout_waits_for_another_callers_load_without_bound(make_cache, wait,
                                                                          timeout):
    c = make_cache(slot_size=64)
    h = contextvars.Context().run(c.get, K)        # another caller's load (not this context's)
    assert h.owner
    failures = []
    t = publish_once_waited_on(c, h, failures)
    try:
        assert wait(c, timeout) == b"ok"
    finally:
        t.join(60)
    assert not failures, failures
    assert c._open_handles == 0 and ucmcache.verify(c.uuid).ok


# ---------------------------------------------------------------- refusals

def refusals(c):
    """Every call taking a timeout, as (name, call(t)); each must refuse a bad t."""
    with c.get(J) as h:                             # a Loading slot of ours for the waits
        assert h.owner
        yield "get", lambda t: c.get(K, timeout=t)
        yield "get_many", lambda t: c.get_many([K], timeout=t)
        yield "get_or_load", lambda t: c.get_or_load(K, lambda: b"x", timeout=t)
        yield "aget_or_load", lambda t: asyncio.run(c.aget_or_load(K, lambda: b"x", timeout=t))
        yield "put", lambda t: c.put(K, b"x", timeout=t)
        yield "delete", lambda t: c.delete(K, timeout=t)
        yield "delete_many", lambda t: c.delete_many([K], timeout=t)
        yield "memoize", lambda t: c.memoize("tests.timeouts.v1", timeout=t)
        yield "Handle.wait", lambda t: h.wait(t)
        yield "Handle.wait_async", lambda t: asyncio.run(h.wait_async(t))
        h.fail("refusals done")
    with c.get_many([J]) as b:
        assert b.owner[0]
        yield "HandleBatch.wait", lambda t: b.wait(t)
        b.fail(0, "refusals done")
    yield "attach", lambda t: SlotCache.attach(c.uuid, timeout=t)
    yield "create", lambda t: SlotCache.create(c.uuid, slots_per_rank=4, slot_size=64,
                                               exist_ok=True, timeout=t)
    yield "verify", lambda t: ucmcache.verify(c.uuid, timeout=t)
    p = c.prefetcher(lambda key: b"x")
    try:
        yield "Prefetcher.stop", lambda t: p.stop(t)
    finally:
        p.stop()


def counters(c):
    s = c.stats()
    return [s[k] for k in ("gets", "hits", "misses", "joins", "waits", "loads_started",
                           "deletes", "entries")]


@pytest.mark.parametrize("bad", BAD, ids=repr)
def test_a_bad_timeout_is_refused_by_every_call_before_anything_changes(make_cache, bad):
    c = make_cache(slot_size=64)
    names = []
    with contextlib.closing(refusals(c)) as calls:
        for name, call in calls:
            names.append(name)
            before = counters(c)
            with pytest.raises(ValueError, match=REFUSED):
                call(bad)
            assert counters(c) == before, name
    assert len(names) == 15
    assert K not in c and len(c) == 0 and c._open_handles == 0
    with c.get(K) as h:                             # nothing was installed: still cold
        assert h.owner
        h.fail("done")
    assert ucmcache.verify(c.uuid).ok


@pytest.mark.parametrize("bad", [float("nan"), -0.5, 1e10], ids=repr)
def test_a_bad_timeout_is_refused_on_a_hit_too(make_cache, bad):
    """A hit waits for nothing, but the argument is still checked: the same call must not
    answer one way when the key is Ready and another when it is cold."""
    c = make_cache(slot_size=64)
    c.put(K, b"ok")
    with pytest.raises(ValueError, match=REFUSED):
        c.get_or_load(K, lambda: b"x", timeout=bad)
    with pytest.raises(ValueError, match=REFUSED):
        asyncio.run(c.aget_or_load(K, lambda: b"x", timeout=bad))
    with pytest.raises(ValueError, match=REFUSED):
        c.get(K, timeout=bad)
    with pytest.raises(ValueError, match=REFUSED):
        c.get_many([K], timeout=bad)
    with c.get(K) as h:
        with pytest.raises(ValueError, match=REFUSED):
            h.wait(bad)
    assert c._open_handles == 0


def test_the_longest_finite_timeout_is_kept_and_the_next_is_refused(make_cache):
    from ucmcache.core.timeouts import MAX_TIMEOUT, check_timeout
    assert check_timeout(MAX_TIMEOUT) == MAX_TIMEOUT
    assert check_timeout(INF) is None and check_timeout(None) is None
    assert check_timeout(0) == 0.0
    with pytest.raises(ValueError, match=r"longer than the longest finite wait, 1e9 s.*"
                                         r"None or float\('inf'\)"):
        check_timeout(math.nextafter(MAX_TIMEOUT, INF))
    c = make_cache(slot_size=64)
    assert c.get_or_load(K, lambda: b"ok", timeout=MAX_TIMEOUT) == b"ok"   # a cold path


# ---------------------------------------------------------------- tiers and the UCM config

BOUND_BAD = [None, INF, float("nan"), 0, -1, True, "1", 1e10]


@pytest.mark.parametrize("bad", BOUND_BAD, ids=repr)
def test_a_tiers_bounds_are_finite_and_positive(tmp_path, bad):
    """A tier's timeout bounds each disk or network step, and a lease's milliseconds are an
    int: None, inf (before: accepted, then OverflowError on every miss of a DiskTier, and from
    RedisTier's lease arithmetic), past MAX_TIMEOUT, NaN, 0 and the rest are refused up front,
    naming the parameter."""
    from ucmcache import DiskTier, RedisTier
    with pytest.raises(ValueError, match=r"^timeout must be a positive number of seconds, at "
                                         r"most 1e9"):
        DiskTier(tmp_path / "d", 1 << 20, timeout=bad)
    assert not (tmp_path / "d").exists()
    for name in ("timeout", "write_timeout", "lease_ttl", "value_ttl"):
        if name == "value_ttl" and bad is None:
            continue                                           # None: no expiry
        with pytest.raises(ValueError, match=rf"^{name} must be a positive number of seconds"):
            RedisTier("redis://127.0.0.1:1", namespace="ns", **{name: bad})


def test_the_longest_finite_tier_timeout_serves_a_miss(make_cache, tmp_path):
    """DiskTier(timeout=1e9), the longest bound: a miss asks the disk and loads (1e10 passed
    the old check and raised OverflowError from the disk wait on every miss)."""
    from ucmcache import DiskTier
    tier = DiskTier(tmp_path / "d", 1 << 20, timeout=1e9)
    c = make_cache(slot_size=64, tier2=tier)
    assert c.get_or_load(K, lambda: b"ok") == b"ok"
    assert tier.flush(None) and tier.flush(INF)             # no deadline: the write is done
    assert c.get_or_load(K, lambda: b"never") == b"ok"


@pytest.mark.parametrize("bad", BAD, ids=repr)
def test_a_tiers_flush_and_close_hold_to_the_timeout_rule(tmp_path, bad):
    """flush(timeout) and close(timeout) of both tiers: check_timeout's rule (before: None
    raised TypeError from a deadline's arithmetic, NaN, inf and -1 passed as if no wait)."""
    from ucmcache import DiskTier, RedisTier
    disk = DiskTier(tmp_path / "d", 1 << 20)
    redis_tier = RedisTier("redis://127.0.0.1:1", namespace="ns")
    for call in (disk.flush, disk.close, redis_tier.flush, redis_tier.close):
        with pytest.raises(ValueError, match=REFUSED):
            call(bad)
    assert disk.flush(None) and disk.flush(INF) and redis_tier.flush(None)
    disk.close(None)
    redis_tier.close(INF)


def test_the_ucm_configs_transfer_timeout_is_held_to_the_longest_wait():
    """transfer_timeout_ms past MAX_TIMEOUT (1e9 s) is refused when the config is read, naming
    the key (before: accepted, then every transfer's get_many refused it)."""
    from ucmcache.engines.ucm.config import _Config
    for key in ("transfer_timeout_ms", "timeout_ms"):
        with pytest.raises(ValueError, match=rf"^config '{key}' must be at most "
                                             r"1000000000000 ms"):
            _Config({key: 10 ** 13})
        assert _Config({key: 10 ** 12}).timeout == 1e9
