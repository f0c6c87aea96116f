"""clear() with generations and exact accounting (seed 000, across processes)."""
import pytest

import ucmcache

import workers

K = b"K" * 16


@pytest.mark.parametrize("a_fails", [False, True], ids=["A-succeeds", "A-fails"])
def test_seed_000_scenario_across_processes(make_cache, procs, gate, a_fails):
    c = make_cache(slots_per_rank=8, slot_size=64, max_ranks=6)
    g = gate()
    # A starts loading K and is held inside its loader.
    pa, qa = procs.start(workers.get_or_load_value, c.uuid, K, b"A" * 10, g.path, a_fails)
    g.wait_arrived()
    # B: clear twice; returns at once even though A's load is in flight; size 0.
    c.clear()
    c.clear()
    assert (c.size_bytes(), c.entry_count()) == (0, 0)
    # C loads K in the new generation.
    pc, qc = procs.start(workers.get_or_load_value, c.uuid, K, b"C" * 20, None, False)
    assert procs.result(qc) == ("value", b"C" * 20, 1)
    assert (c.size_bytes(), c.entry_count()) == (20, 1)
    # clear again; D loads K.
    c.clear()
    assert (c.size_bytes(), c.entry_count()) == (0, 0)
    pd, qd = procs.start(workers.get_or_load_value, c.uuid, K, b"D" * 30, None, False)
    assert procs.result(qd) == ("value", b"D" * 30, 1)
    assert (c.size_bytes(), c.entry_count()) == (30, 1)
    # A is released: its caller gets its own value (or exception); nothing else changes.
    g.release()
    if a_fails:
        assert procs.result(qa) == ("error", f"loader of {b'A' * 10!r} failed", 1)
    else:
        assert procs.result(qa) == ("value", b"A" * 10, 1)
    assert (c.size_bytes(), c.entry_count()) == (30, 1)
    assert c.get_or_load(K, lambda: b"never") == b"D" * 30
    s = c.stats()
    assert s["loads_started"] == 3 and s["clears"] == 3
    rep = ucmcache.verify(c.uuid)
    assert rep.ok, rep


def test_clear_does_not_wake_new_waiters_with_old_data(make_cache, procs, gate):
    c = make_cache(slots_per_rank=8, slot_size=64, max_ranks=6)
    g = gate()
    pa, qa = procs.start(workers.get_or_load_value, c.uuid, K, b"old", g.path, False)
    g.wait_arrived()
    c.clear()
    with c.get(K) as h:                # a new-generation get of K: a new owner, not a waiter
        assert h.owner
        g.release()
        assert procs.result(qa) == ("value", b"old", 1)
        h.data[:3] = b"new"
        h.ready(3)
    assert c.get_or_load(K, lambda: b"never") == b"new"


def test_thousand_clears_keep_chains_short_and_capacity_whole(make_cache):
    c = make_cache(slots_per_rank=16, slot_size=32, max_ranks=1, n_buckets=4, n_stripes=1)
    for i in range(1000):
        c.get_or_load(bytes([i % 7]) * 16, lambda: b"v" * 5)
        if i % 3 == 0:
            c.get_or_load(bytes([100 + i % 5]) * 16, lambda: b"w" * 7)
        c.clear()
    rep = ucmcache.verify(c.uuid)
    assert rep.ok, rep
    assert rep.facts["chains"]["max"] <= 16       # at most every slot, never more
    assert (c.entry_count(), c.size_bytes()) == (0, 0)
    for i in range(16):                            # every slot is allocatable again
        with c.get((b"c" * 16, i)) as h:
            assert h.owner
            h.ready(1)
    assert c.entry_count() == 16
    assert c.stats()["clears"] == 1000


def test_a_load_that_outlives_half_a_million_clears_is_never_counted(make_cache):
    from ucmcache.lowlevel import lib
    c = make_cache(slots_per_rank=8, slot_size=32, max_ranks=1)
    stale = c.get(K)                                 # installed in generation g
    for _ in range((1 << 19) + 10):                  # the 20-bit tag of g comes round as "older"
        lib.ucm_clear(c._ctx)
    for i in range(3):
        c.get_or_load(bytes([i]) * 16, lambda: b"x" * 10)
    assert (c.entry_count(), c.size_bytes()) == (3, 30)
    stale.data[:5] = b"stale"
    stale.ready(5)
    stale.close()
    assert (c.entry_count(), c.size_bytes()) == (3, 30)
    assert ucmcache.verify(c.uuid).ok


def test_owner_published_from_another_thread_is_not_left_owned(make_cache):
    import threading
    c = make_cache(slots_per_rank=1, slot_size=32, max_ranks=1)
    h = c.get(K)                                      # owner in this thread's context
    t = threading.Thread(target=lambda: (h.data.__setitem__(slice(0, 1), b"v"), h.ready(1)))
    t.start()
    t.join(30)
    h.close()
    # Another thread reuses our only slot for Z and holds its load; we join and wait.  The slot
    # must not still count as ours, or the wait would be refused as a recursive load.
    owning, release = threading.Event(), threading.Event()

    def other_owner():
        with c.get(b"Z" * 16) as o:
            assert o.owner and o.slot == h.slot
            owning.set()
            assert release.wait(30)
            o.data[:1] = b"z"
            o.ready(1)
    t2 = threading.Thread(target=other_owner)
    t2.start()
    try:
        assert owning.wait(30)
        with c.get(b"Z" * 16) as joiner:
            assert not joiner.owner and joiner.state == "loading"
            with pytest.raises(TimeoutError):       # a wait, not "your own load"
                joiner.wait(0.01)
            release.set()
            assert bytes(joiner.wait(30).data) == b"z"
    finally:
        release.set()
        t2.join(30)
