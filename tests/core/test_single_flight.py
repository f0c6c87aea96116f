"""Single flight across processes (seed 004): one loader run per cold key, failures reach every
current waiter, a waiter's timeout abandons the wait and never the load."""
import pytest

import ucmcache

import workers

K = b"K" * 16


def test_four_processes_same_cold_keys_run_each_loader_once(make_cache, procs, gate):
    c = make_cache(slots_per_rank=64, slot_size=64, max_ranks=5)
    keys = [i.to_bytes(4, "little") * 4 for i in range(40)]
    start = gate()
    ps = [procs.start(workers.single_flight, c.uuid, keys, start.path, None, False)
          for _ in range(4)]
    start.release()
    results = [procs.result(q, timeout=120) for _, q in ps]
    runs = sum(r[0] for r in results)
    assert runs == len(keys)                       # exactly one loader run per key, in all
    assert all(ok is True for r in results for ok in r[1])  # every value carries its key
    s = c.stats()
    assert s["loads_started"] == len(keys) and s["loads_ready"] == len(keys)
    assert s["gets"] == 4 * len(keys)
    assert s["hits"] + s["joins"] + s["misses"] == s["gets"]
    assert ucmcache.verify(c.uuid).ok


def test_failure_reaches_every_current_waiter(make_cache, procs, gate):
    c = make_cache(slots_per_rank=8, slot_size=128, max_ranks=5)
    held = gate()
    owner_p, owner_q = procs.start(workers.load_held, c.uuid, K, None, held.path, b"",
                                   "the model ran out of memory")
    held.wait_value(1)                             # the owner holds the Loading slot
    ready = gate()
    waiters = [procs.start(workers.wait_for_load, c.uuid, K, ready.path, 60) for _ in range(3)]
    ready.wait_value(3)                            # all three hold a handle on it
    held.release()                                 # the owner fails the load
    assert procs.result(owner_q) == "failed"
    for _, q in waiters:
        assert procs.result(q) == ("failed", "the model ran out of memory")
    # no negative caching: the next get elects a new owner
    assert c.get_or_load(K, lambda: b"recovered") == b"recovered"
    s = c.stats()
    assert s["loads_failed"] == 1 and s["loads_started"] == 2


def test_waiter_timeout_leaves_the_load_running(make_cache, procs, gate):
    c = make_cache(slots_per_rank=8, slot_size=128, max_ranks=4)
    held = gate()
    owner_p, owner_q = procs.start(workers.load_held, c.uuid, K, None, held.path, b"slow value",
                                   None)
    held.wait_value(1)
    with c.get(K) as h:
        assert not h.owner and h.state == "loading"
        with pytest.raises(TimeoutError, match="still loading after 0.05 s"):
            h.wait(0.05)
        assert h.state == "loading"                # the load goes on
        held.release()
        assert bytes(h.wait(30).data) == b"slow value"
    assert procs.result(owner_q) == "ready"
    s = c.stats()
    assert s["loads_started"] == 1 and s["wait_timeouts"] == 1


def test_get_timeout_is_the_default_wait(make_cache, procs, gate):
    c = make_cache(slots_per_rank=8, slot_size=128, max_ranks=4)
    held = gate()
    procs.start(workers.load_held, c.uuid, K, None, held.path, b"v", None)
    held.wait_value(1)
    with pytest.raises(TimeoutError):
        c.get_or_load(K, lambda: b"never", timeout=0.05)
    held.release()


def test_waiter_sees_loader_death_as_load_failed(make_cache, procs, gate):
    c = make_cache(slots_per_rank=8, slot_size=128, max_ranks=4)
    held = gate()
    p, q = procs.start(workers.load_held, c.uuid, K, None, held.path, b"v", None)
    held.wait_value(1)
    with c.get(K) as h:
        assert not h.owner
        p.kill()
        p.join(10)
        with pytest.raises(ucmcache.LoadFailed, match=r"the loader \(rank 1\) died"):
            h.wait(30)
    assert ucmcache.verify(c.uuid).ok
    assert c.get_or_load(K, lambda: b"again") == b"again"


# ---------------------------------------------------------------- the drivers' edges


def _interrupt_at_first_call_after(armed, where):
    """A trace function that raises KeyboardInterrupt at the first call into ucmcache's Python
    code once armed[0] is set: where a signal handler's exception lands (CPython runs handlers
    at calls)."""
    import sys

    def tracer(frame, event, arg):
        if event == "call" and armed[0] and "ucmcache" in frame.f_code.co_filename:
            armed[0] = False
            sys.settrace(None)
            where.append(frame.f_code.co_name)
            raise KeyboardInterrupt("a signal handler's")
        return None
    return tracer


@pytest.mark.parametrize("when", ["after_loader", "after_pin"])
def test_a_signal_handlers_exception_in_the_driver_fails_the_load_at_once(uuid, when):
    """The full path's load runs in a driver (ucmcache.core.drivers): a KeyboardInterrupt raised
    at the driver's own calls (right after the loader returned, or right after the pin was
    taken) is thrown into the core, which publishes Failed at once.  The exception is kept (as
    a REPL keeps sys.last_value): nothing may wait for it to be collected; another caller
    loads the key at once and this context's owned-slot record is empty."""
    import sys
    from ucmcache.core.slots import _owned_slots
    c = ucmcache.SlotCache.create(uuid, slots_per_rank=8, slot_size=64, max_ranks=2)
    other = ucmcache.SlotCache.attach(uuid)
    try:
        key = b"k" * 16
        armed, where = [when == "after_pin"], []

        def loader():
            armed[0] = True
            return b"value"

        sys.settrace(_interrupt_at_first_call_after(armed, where))
        kept = None
        try:
            c.get_or_load(key, loader, timeout=5.0)   # timeout=: the Python full path
        except KeyboardInterrupt as e:
            kept = e
        finally:
            sys.settrace(None)
        assert kept is not None and where, "the interrupt was not raised"
        assert _owned_slots(c) == set()
        assert other.get_or_load(key, lambda: b"other", timeout=1.0) in (b"other", b"value")
        del kept
    finally:
        other.close()
        c.close()


def test_a_full_path_hit_in_a_task_that_owns_a_load_keeps_its_owned_record_true(uuid):
    """A task owns a slot (an open owner handle), then aget_or_load hits through the full
    path (timeout=): its owned-slot record must not be swapped for a copy that the handle's
    close does not clear (the slot, reused for another key, would refuse a join as this
    task's own load)."""
    import asyncio
    from ucmcache.core.slots import _owned_slots
    c = ucmcache.SlotCache.create(uuid, slots_per_rank=4, slot_size=64, max_ranks=1)
    try:
        k1, k2 = b"1" * 16, b"2" * 16
        c.get_or_load(k2, lambda: b"two")

        async def main():
            with c.get(k1) as h1:
                assert h1.owner
                assert await c.aget_or_load(k2, lambda: b"x", timeout=1.0) == b"two"
                h1.data[:3] = b"one"
                h1.ready(3)
            return set(_owned_slots(c))

        assert asyncio.run(main()) == set()
    finally:
        c.close()
