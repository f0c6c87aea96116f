"""delete (DESIGN 4.13): an entry invisible at once, its slot reused after its last pin drops,
the accounting exact, a deleter killed inside the step recovered, across real processes.
Ordering by gates, never by sleeping; every wait bounded."""
import signal
import threading

import numpy as np
import pytest

import ucmcache
from ucmcache import SlotCache
from ucmcache.lowlevel import lib
from ucmcache.core.verify import slot_fields, snapshot

import delete_workers
from workers import check_payload, payload_for


def key(i, tag=b"K"):
    return tag + i.to_bytes(15, "little")


def assert_clean(c):
    rep = ucmcache.verify(c.uuid)
    assert rep.ok, rep
    return rep


def flags_and_loader(c, slot):
    f = slot_fields(snapshot(c._seg)["metas"])
    return int(f["flags"][slot]), int(f["loader"][slot]), int(f["reference"][slot])


def same_bucket_keys(c, n):
    """n distinct keys that hash to one bucket (one chain, so a delete has neighbours)."""
    want, found, i = None, [], 0
    while len(found) < n:
        k = key(i, b"B")
        b = lib.ucm_bucket_of(c._ctx, k, 0)
        if want is None:
            want = b
        if b == want:
            found.append(k)
        i += 1
    return found


def test_delete_ready_and_absent_keys_exact_accounting(make_cache):
    c = make_cache()
    keys = [key(i) for i in range(10)]
    for k in keys:
        c.put(k, payload_for(k, 40 + k[1]))
    total = sum(40 + k[1] for k in keys)
    assert (len(c), c.size_bytes()) == (10, total)
    before = c.stats()["deletes"]
    assert c.delete(keys[3]) is True
    assert keys[3] not in c and c[keys[2]] == payload_for(keys[2], 42)
    assert (len(c), c.size_bytes()) == (9, total - 43)
    assert c.delete(keys[3]) is False                 # absent now
    assert c.delete(key(99)) is False                 # never there
    assert c.delete_many([keys[0], keys[0], (keys[1], 0), key(98)]) == [True, False, True, False]
    del c[keys[4]]
    with pytest.raises(KeyError):
        del c[keys[4]]
    with pytest.raises(KeyError):
        c[keys[4]]
    assert (len(c), c.size_bytes()) == (6, total - 43 - 40 - 41 - 44)
    assert c.stats()["deletes"] - before == 4
    assert_clean(c)
    # the key loads again, as any cold key
    assert c.get_or_load(keys[3], lambda: b"again") == b"again"
    assert len(c) == 7
    assert_clean(c)


def test_a_handle_of_the_deleting_process_keeps_its_bytes(make_cache):
    c = make_cache()
    k = key(5)
    c.put(k, payload_for(k, 60))
    with c.get(k) as h:
        view = h.data
        assert c.delete(k) is True and k not in c
        assert c.get_or_load(k, lambda: b"second") == b"second"
        with c.get(k) as h2:
            assert h2.slot != h.slot                  # the new entry's slot is another one
        assert check_payload(k, bytes(view))
    assert check_payload(k, bytes(view))              # the view keeps its own pin
    del view
    assert c[k] == b"second" and len(c) == 1
    assert_clean(c)


def test_delete_of_a_loading_key_deletes_nothing_and_the_load_publishes(make_cache):
    c = make_cache()
    k = key(1)
    with c.get(k) as h:
        assert h.owner
        assert c.delete(k) is False                   # a load in flight is not cut short
        with pytest.raises(KeyError):
            del c[k]
        h.data[:2] = b"ok"
        h.ready(2)
    assert c[k] == b"ok" and len(c) == 1
    assert c.delete(k) is True and len(c) == 0
    assert_clean(c)


def test_bad_input_is_refused_before_anything_is_deleted(make_cache):
    c = make_cache()
    k = key(1)
    c.put(k, b"v")
    with pytest.raises(ValueError):
        c.delete(b"short")
    with pytest.raises(TypeError):
        c.delete(12)
    with pytest.raises(ValueError):
        c.delete(k, timeout=-1)
    with pytest.raises(ValueError):
        c.delete_many([k, b"short"])                  # checked whole first: k stays
    with pytest.raises(ValueError):
        c.delete_many([k], timeout=float("nan"))
    assert k in c and len(c) == 1
    with pytest.raises(ValueError):
        c._arenas.take_for_delete(-1)
    with pytest.raises(ValueError):
        c._arenas.take_for_delete(c.layout.n_arenas)
    c.close()
    with pytest.raises(ucmcache.NotAttached):
        c.delete(k)


def test_delete_with_a_tier_is_refused_clearly(uuid):
    tier = ucmcache.RedisTier(url="redis://127.0.0.1:1/0", namespace="del")
    c = SlotCache.create(uuid, slots_per_rank=8, slot_size=64, max_ranks=2, tier2=tier)
    try:
        with pytest.raises(ucmcache.Unsupported, match="tier 2"):
            c.delete(key(1))
        with pytest.raises(ucmcache.Unsupported):
            c.delete_many([key(1)])
        with pytest.raises(ucmcache.Unsupported):
            del c[key(1)]
    finally:
        c.close()


def test_a_pinned_reader_in_another_process_keeps_its_bytes_then_the_slot_is_reused(
        make_cache, procs, gate):
    c = make_cache(slots_per_rank=8, slot_size=128, max_ranks=2)
    k = key(7)
    c.put(k, payload_for(k, 100))
    held, check = gate(), gate()
    p, q = procs.start(delete_workers.hold_and_check, c.uuid, k, held.path, check.path)
    held.wait_value(1)
    n = len(c)
    assert c.delete(k) is True                        # the reader's pin does not stop it
    assert k not in c and c.exist([k]) == [False] and len(c) == n - 1
    # a new load of the key gets a fresh slot while the old one is pinned
    with c.get(k) as h:
        assert h.owner
        fresh = h.slot
        h.data[:5] = b"fresh"
        h.ready(5)
    assert c[k] == b"fresh"
    # churn through every other slot: the pinned one is never taken
    used = set()
    for i in range(3 * c.capacity):
        with c.get(key(1000 + i)) as h:
            if h.owner:
                used.add(h.slot)
                h.ready(1)
    check.release()
    slot, ok, _ = procs.result(q)
    p.join(30)
    assert ok, "the reader's views changed under its pin"
    assert slot != fresh and slot not in used
    # its last pin dropped: the slot is reused
    for i in range(3 * c.capacity):
        with c.get(key(5000 + i)) as h:
            if h.owner:
                used.add(h.slot)
                h.ready(1)
    assert slot in used
    assert_clean(c)


@pytest.mark.parametrize("point", ["after_pin", "delete_usable", "delete_marked",
                                   "delete_checked", "mid_delete", "delete_uncounted"])
def test_a_deleter_killed_in_the_step_is_recovered_by_the_next_attach(make_cache, procs, point):
    """Killed before its mark: a dead pin.  Marked, not yet past its owner check: the mark
    changed nothing, recovery drops it and the entry stays.  Past the check: recovery finishes
    the delete.  Every way: exact accounting, no pin or mark left, the neighbours kept."""
    c = make_cache(slots_per_rank=8, slot_size=64, max_ranks=3, n_buckets=1024, n_stripes=4)
    a, b, d = same_bucket_keys(c, 3)                  # one chain: d -> b -> a
    for k in (a, b, d):
        c.put(k, payload_for(k, 40))
    n = len(c)
    c.close()                                         # the next attach recovers
    p, q = procs.start(delete_workers.delete_at, c.uuid, b, point, "kill", None)
    p.join(60)
    assert p.exitcode == -signal.SIGKILL, f"the deleter was not killed at {point}"
    before = ucmcache.verify(c.uuid)                 # read-only: recovers nothing
    assert not before.ok
    marked = [m for m in before.problems if "marked deleting by rank" in m]
    assert len(marked) == (point not in ("after_pin", "delete_usable")), before
    c2 = SlotCache.attach(c.uuid)
    try:
        assert_clean(c2)
        f = slot_fields(snapshot(c2._seg)["metas"])
        assert int((f["reference"] != 0).sum()) == 0, "a pin of the dead deleter survived"
        assert int((f["flags"] & lib.UCM_F_DELETING).sum()) == 0
        # checked: recovery finished the delete; not yet: nothing was deleted
        gone = point in ("delete_checked", "mid_delete", "delete_uncounted")
        assert (b in c2) is (not gone) and len(c2) == n - gone
        for k in (a, d):                              # its neighbours are not lost
            assert c2.get_or_load(k, lambda: b"LOST") == payload_for(k, 40)
        # the stripe the dead deleter held works, and every slot is usable again
        for i in range(2 * c2.capacity):
            c2.get_or_load(key(300 + i), lambda: b"x")
        assert_clean(c2)
    finally:
        c2.close()


def test_a_dead_reader_of_a_slot_being_deleted_leaves_the_live_deleters_mark(
        make_cache, procs, gate):
    c = make_cache(slots_per_rank=8, slot_size=64, max_ranks=4)
    k = key(3)
    c.put(k, payload_for(k, 40))
    others = [key(10 + i) for i in range(5)]
    for o in others:
        c.put(o, b"o")
    with c.get(k) as h:
        slot = h.slot
    pinned = gate()
    pr, _ = procs.start(delete_workers.pin_then_wait, c.uuid, k, pinned.path)
    pinned.wait_value(1)
    held = gate()
    pd, qd = procs.start(delete_workers.delete_at, c.uuid, k, "mid_delete", "gate", held.path)
    held.wait_arrived()
    assert_clean(c)                                   # a live deleter's mark is no problem
    flags, loader, ref = flags_and_loader(c, slot)
    assert flags & lib.UCM_F_DELETING
    deleter = loader
    pr.kill()
    pr.join(30)
    report = c.recover()                              # the reader's rank only
    assert len(report.ranks) == 1 and report.ranks[0].rank != deleter
    flags, loader, ref = flags_and_loader(c, slot)
    assert flags & lib.UCM_F_DELETING and loader == deleter, \
        "recovery of a reader touched a live deleter's mark"
    assert ref == 1 << deleter                        # only the deleter's pin is left
    held.release()
    assert procs.result(qd) == (True, deleter)
    pd.join(30)
    assert k not in c and len(c) == len(others)
    assert c.size_bytes() == len(others)
    assert_clean(c)
    flags, _, ref = flags_and_loader(c, slot)
    assert not flags & (lib.UCM_F_DELETING | lib.UCM_F_COUNTED) and ref == 0


def test_delete_in_another_live_ranks_arena(make_cache, procs, gate):
    c = make_cache(slots_per_rank=8, slot_size=64, max_ranks=2)
    keys = [key(i) for i in range(6)]
    loaded = gate()
    p, q = procs.start(delete_workers.load_keys, c.uuid, keys, b"v", loaded.path)
    loaded.wait_value(1)
    assert c.arenas() == []                           # this rank never allocated: owns none
    assert c.delete(keys[2]) is True                  # taken for the delete, then given back
    assert c.arenas() == []
    assert keys[2] not in c and len(c) == 5 and c.size_bytes() == 5 * 17
    assert_clean(c)
    loaded.release()
    rank, arenas = procs.result(q)
    p.join(30)
    assert arenas, "the loader's rank did not take its arenas back"
    assert_clean(c)


def test_two_deleters_taking_the_same_arena_in_turn_both_finish(make_cache, procs, gate):
    # four ranks: this process, the loader and both deleters are attached at once (with three,
    # the second deleter's attach raced the first one's close: RankUnavailable now and then)
    c = make_cache(slots_per_rank=32, slot_size=64, max_ranks=4)
    keys = [key(i) for i in range(40)]
    loaded = gate()
    p, q = procs.start(delete_workers.load_keys, c.uuid, keys, b"v", loaded.path)
    loaded.wait_value(1)
    start = gate()
    ds = [procs.start(delete_workers.delete_all, c.uuid, keys, start.path) for _ in range(2)]
    start.release()
    results = [procs.result(dq, timeout=120)[0] for _, dq in ds]
    for dp, _ in ds:
        dp.join(30)
    per_key = np.array(results, dtype=int).sum(axis=0)
    assert per_key.tolist() == [1] * len(keys), "a key deleted twice or not at all"
    assert len(c) == 0 and c.size_bytes() == 0
    assert_clean(c)
    loaded.release()
    procs.result(q)
    p.join(30)
    assert len(c) == 1
    assert_clean(c)


def test_a_delete_waits_bounded_for_another_ranks_load_in_its_arena(make_cache, procs, gate):
    c = make_cache(slots_per_rank=64, slot_size=64, max_ranks=2)
    k, z = key(1), key(2)
    held = gate()
    p, q = procs.start(delete_workers.load_then_hold_a_load, c.uuid, k, z, held.path)
    held.wait_value(1)
    # the worker's two installs went to consecutive slots of its CLOCK hand: one arena, whose
    # words the loader of z writes until it publishes (I6), so the delete may not write them
    with pytest.raises(ucmcache.LockTimeout, match="arena .* stayed busy"):
        c.delete(k, timeout=0.2)
    assert k in c and len(c) == 1                     # nothing changed
    held.release()
    ready_slot, loading_slot = procs.result(q)
    p.join(30)
    L = c.layout
    assert ready_slot // L.arena_slots == loading_slot // L.arena_slots
    assert c.delete(k) is True and k not in c and c[z] == b"late" and len(c) == 1
    assert_clean(c)


def test_a_delete_in_a_dead_ranks_busy_arena_recovers_it_and_deletes(make_cache, procs, gate):
    c = make_cache(slots_per_rank=64, slot_size=64, max_ranks=2)
    k, z = key(1), key(2)
    held = gate()
    p, q = procs.start(delete_workers.load_then_hold_a_load, c.uuid, k, z, held.path)
    held.wait_value(1)
    p.kill()                                          # dies owning z's load in k's arena
    p.join(30)
    before = c.stats()["recovered_ranks"]
    assert c.delete(k, timeout=5) is True             # recovers the dead loader on its way
    assert c.stats()["recovered_ranks"] == before + 1
    assert k not in c and z not in c and len(c) == 0
    assert_clean(c)


def test_a_delete_recovers_a_dead_deleter_again_when_a_stripe_held_its_first_recovery(
        make_cache, procs):
    """A deleter killed past its owner check (entry still linked) blocks its arena until
    recovery finishes its delete under the entry's stripe.  A live delete in that arena whose
    first recovery found the stripe held by another thread recovers again once it is free,
    rather than waiting out its timeout on a hold recovery can end."""
    c = make_cache(slots_per_rank=64, slot_size=64, max_ranks=2, n_stripes=4)
    k = key(1)
    stripe_of = lambda x: lib.ucm_stripe_of(c._ctx, lib.ucm_bucket_of(c._ctx, x, 0))
    b = next(key(i) for i in range(2, 1000) if stripe_of(key(i)) != stripe_of(k))
    p, q = procs.start(delete_workers.load_then_delete_at, c.uuid, [k, b], b, "delete_checked")
    p.join(60)
    assert p.exitcode == -signal.SIGKILL
    assert any("marked deleting by rank" in m for m in ucmcache.verify(c.uuid).problems)
    held, free = threading.Event(), threading.Event()

    def hold_stripe():  # the dead deleter held it: taken with repair
        assert lib.ucm_stripe_lock(c._ctx, stripe_of(b), int(30e9)) == lib.UCM_OK
        held.set()
        try:
            assert free.wait(30)
        finally:
            lib.ucm_stripe_unlock(c._ctx, stripe_of(b))

    t = threading.Thread(target=hold_stripe)
    t.start()
    reports = []
    real_recover = c._recover

    def recover_then_free_the_stripe(wait):
        report = real_recover(wait)
        reports.append(report)
        if len(reports) == 1:  # the first one met the held stripe: free it now
            free.set()
            t.join(30)
        return report

    try:
        assert held.wait(30)
        c._recover = recover_then_free_the_stripe
        assert c.delete(k, timeout=5.0) is True
    finally:
        free.set()
        t.join(30)
        del c._recover
    assert reports[0].failed and not reports[0].count, reports[0]
    assert any(r.count for r in reports[1:]), reports
    assert b not in c and k not in c and (len(c), c.size_bytes()) == (0, 0)
    assert_clean(c)
    f = slot_fields(snapshot(c._seg)["metas"])
    assert int((f["reference"] != 0).sum()) == 0
    assert int((f["flags"] & lib.UCM_F_DELETING).sum()) == 0


def test_a_deleter_killed_after_its_mark_leaves_a_taker_that_verified_before_it_exact(
        make_cache, procs, gate):
    """The window between a deleter's arena check and its mark: a taker that took and verified
    the arena there is its writer (the mark came after its verification).  The deleter, killed
    at its mark before its owner check, wrote nothing else; its recovery must not recount the
    arena under the taker's load in flight (counted, not yet Ready), or the words come out one
    entry short for good (I4, I6)."""
    c = make_cache(slots_per_rank=16, slot_size=64, max_ranks=3, n_stripes=4)
    keys = [key(i, b"T") for i in range(6)]
    victim = keys[2]
    held = gate()
    p, q = procs.start(delete_workers.load_then_delete_held_then_killed, c.uuid, keys, victim,
                       held.path)
    held.wait_arrived(60)                     # the deleter: pinned, its arena usable, no mark
    f = slot_fields(snapshot(c._seg)["metas"])
    pinned = np.flatnonzero(f["reference"] != 0)
    assert len(pinned) == 1, pinned
    a = int(pinned[0]) // c.layout.arena_slots
    deleters_word = int(c._arenas.owners()[a])
    assert deleters_word != c.rank + 1
    assert lib.ucm_arena_take(c._ctx, a, deleters_word) == lib.UCM_OK
    assert lib.ucm_arena_usable(c._ctx, a) == 1       # verified: no mark yet, no load there
    held.release()                                    # the deleter marks and dies unchecked
    p.join(60)
    assert p.exitcode == -signal.SIGKILL
    # We own a only: our next install goes there, held after its count (counted_not_ready)
    lib.ucm_arena_epoch_seen(c._ctx, lib.ucm_load64(c._seg.base, lib.UCM_H_ARENA_EPOCH))
    lib.ucm_arena_room_gone(c._ctx)                   # and no look for more before evicting
    counted = gate()
    c._arm("counted_not_ready", "gate", counted)
    new = key(100, b"T")
    loader = threading.Thread(target=lambda: c.get_or_load(new, lambda: b"n" * 30))
    loader.start()
    try:
        counted.wait_arrived(30)
        f = slot_fields(snapshot(c._seg)["metas"])
        mine = np.flatnonzero(f["reference"] == (1 << c.rank))
        assert [int(s) // c.layout.arena_slots for s in mine] == [a], mine
        report = c._recover(5.0)                      # the dead deleter: its mark dropped
        assert report.count == 1, report
    finally:
        counted.release()
        loader.join(30)
    assert_clean(c)
    # the words count exactly what is there (our install may have evicted one of the keys
    # from the arena's two slots; the unchecked delete itself deleted nothing)
    assert new in c and len(c) == sum(k in c for k in keys) + 1
    f = slot_fields(snapshot(c._seg)["metas"])
    assert int((f["flags"] & (lib.UCM_F_DELETING | lib.UCM_F_DELETE_CHECKED)).sum()) == 0


def test_a_delete_recovers_a_loader_that_dies_after_its_first_recovery(make_cache, procs, gate):
    """A delete waiting for another rank's load in its arena recovers dead ranks on every
    round: a loader that dies after the delete's first look is recovered, and the delete ends
    well before its timeout."""
    c = make_cache(slots_per_rank=64, slot_size=64, max_ranks=2)
    k, z = key(1), key(2)
    held = gate()
    p, q = procs.start(delete_workers.load_then_hold_a_load, c.uuid, k, z, held.path)
    held.wait_value(1)
    real_recover = c._recover
    reports = []

    def recover_then_kill_the_loader(wait):
        report = real_recover(wait)
        reports.append(report)
        if len(reports) == 1:                         # alive at the first recovery: dies now
            assert report.count == 0, report
            p.kill()
            p.join(30)
        return report

    c._recover = recover_then_kill_the_loader
    try:
        assert c.delete(k, timeout=30.0) is True
    finally:
        del c._recover
        if p.is_alive():
            p.kill()
            p.join(30)
    assert any(r.count == 1 for r in reports[1:]), reports
    assert k not in c and z not in c and len(c) == 0
    assert_clean(c)


def test_a_delete_over_a_dead_deleters_unchecked_mark_recovers_it_first(make_cache, procs):
    """A deleter killed at its mark leaves the mark and its pin; the next delete of the key
    (before any recovery) never marks over it (the dead rank's recovery clears marks without
    the stripe and could erase ours while we write): BUSY, it recovers the dead deleter, then
    deletes with exact accounting."""
    c = make_cache(slots_per_rank=8, slot_size=64, max_ranks=3, n_buckets=1024, n_stripes=4)
    a, b, d = same_bucket_keys(c, 3)
    for k in (a, b, d):
        c.put(k, payload_for(k, 40))
    p, q = procs.start(delete_workers.delete_at, c.uuid, b, "delete_marked", "kill", None)
    p.join(60)
    assert p.exitcode == -signal.SIGKILL
    assert any("marked deleting by rank" in m for m in ucmcache.verify(c.uuid).problems)
    recovered = c.stats()["recovered_ranks"]
    assert c.delete(b, timeout=10.0) is True
    assert c.stats()["recovered_ranks"] == recovered + 1
    assert b not in c and len(c) == 2 and c[a] == payload_for(a, 40)
    assert_clean(c)
    f = slot_fields(snapshot(c._seg)["metas"])
    assert int((f["flags"] & (lib.UCM_F_DELETING | lib.UCM_F_DELETE_CHECKED)).sum()) == 0
    assert int((f["reference"] != 0).sum()) == 0
