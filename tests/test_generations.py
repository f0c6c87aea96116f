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
