"""Arenas (DESIGN 4.12): whichever ranks are attached, allocation can use every slot;
ownership moves between ranks without losing an entry, a false hit, a leaked slot or exact
accounting (I6: one writer of an arena's words at a time), and a killed rank's arenas return."""
import signal
from contextlib import contextmanager

import pytest

import ucmcache
from ucmcache import CacheFull, SlotCache
from ucmcache.core.arenas import plan, shares
from ucmcache.lowlevel import lib

import workers

CLAIMED = lib.UCM_CLAIMED


def key(i: int) -> bytes:
    return b"k" + i.to_bytes(15, "little")


def value(i: int) -> bytes:
    return b"v%d" % i


def load(c, i):
    return c.get_or_load(key(i), lambda: value(i))


def hits(c, ids, value=value):
    """Which of ids are still entries (exist, loading nothing), each read and checked."""
    ids = list(ids)
    out = [i for i, there in zip(ids, c.exist([key(i) for i in ids])) if there]
    for i in out:
        with c.get(key(i)) as h:
            assert not h.owner and bytes(h.data) == value(i)
    return out


def assert_whole(c):
    rep = ucmcache.verify(c.uuid)
    assert rep.ok, rep
    return rep


def claimed_by(c, rank):
    L = c.layout
    return [s for s in range(L.n_slots)
            if lib.ucm_load64(c._seg.base, L.meta(s) + lib.UCM_M_REFERENCE) == CLAIMED | rank]


# ------------------------------------------------------------------------------- capacity


def test_one_rank_of_many_uses_every_slot(make_cache):
    c = make_cache(slots_per_rank=8, slot_size=64, max_ranks=4)
    n = c.capacity
    for i in range(n):
        load(c, i)
    assert c.arenas() == list(range(c.layout.n_arenas))
    assert hits(c, range(n)) == list(range(n))       # nothing was evicted: 4x the old range
    assert c.entry_count() == n
    assert_whole(c)


def test_cache_full_only_when_every_slot_it_can_obtain_is_pinned(make_cache):
    c = make_cache(slots_per_rank=2, slot_size=64, max_ranks=2)
    held = [c.get(key(i)) for i in range(4)]          # every slot of the segment
    for h in held:
        h.ready(0)
    with pytest.raises(CacheFull, match="in the 4 slots of the arenas it owns"):
        c.get(key(99))
    held.pop().close()
    with c.get(key(99)) as h:                         # one slot free again: it is used
        assert h.owner
        h.ready(0)
    for h in held:
        h.close()
    assert_whole(c)


# ------------------------------------------------------------------------------- moves


def test_newcomer_takes_its_share_and_entries_stay_readable(make_cache):
    c = make_cache(slots_per_rank=8, slot_size=64, max_ranks=4)
    n, L = c.capacity, c.layout
    for i in range(n):
        load(c, i)
    d = SlotCache.attach(c.uuid)
    try:
        assert d.arenas() == []                       # an attach takes nothing, waits for nobody
        load(d, 1000)                                 # its first allocation: its share
        share = shares([0, 1], L.n_arenas)
        assert len(d.arenas()) == share[1]
        home = [a for a in range(L.n_arenas) if L.home_rank(a) == 1]
        assert set(home) <= set(d.arenas())          # its own range first
        assert set(c.arenas()) == set(range(L.n_arenas)) - set(d.arenas())
        # one entry made way for key 1000; every other is still a hit, from either rank
        left = hits(d, range(n))
        assert len(left) == n - 1 and hits(c, left) == left
        assert_whole(c)
    finally:
        d.close()


def test_a_newcomer_takes_its_share_from_the_ranks_above_theirs(make_cache):
    c = make_cache(slots_per_rank=8, slot_size=64, max_ranks=4)
    L = c.layout
    d = SlotCache.attach(c.uuid)
    e = None
    try:
        load(c, 0)
        load(d, 1)
        assert len(c.arenas()) + len(d.arenas()) == L.n_arenas
        e = SlotCache.attach(c.uuid)                  # three ranks now: c and d hold too much
        load(c, 2)
        load(d, 3)                                    # nobody gives arenas away while attached
        assert len(c.arenas()) + len(d.arenas()) == L.n_arenas
        load(e, 4)                                    # e takes its share from both
        want = shares([0, 1, 2], L.n_arenas)
        assert len(e.arenas()) == want[2]
        assert {len(c.arenas()), len(d.arenas())} <= {want[0], want[1], want[0] + 1}
        assert sorted(c.arenas() + d.arenas() + e.arenas()) == list(range(L.n_arenas))
        assert_whole(c)
    finally:
        d.close()
        if e is not None:
            e.close()


def test_an_attached_rank_that_never_allocates_takes_nothing(make_cache):
    c = make_cache(slots_per_rank=8, slot_size=64, max_ranks=4)
    idle = SlotCache.attach(c.uuid)                   # a reader: it only looks keys up
    try:
        for i in range(c.capacity):
            load(c, i)
        assert c.arenas() == list(range(c.layout.n_arenas)) and idle.arenas() == []
        assert hits(idle, range(c.capacity)) == list(range(c.capacity))
    finally:
        idle.close()


def test_close_gives_arenas_back(make_cache):
    c = make_cache(slots_per_rank=8, slot_size=64, max_ranks=4)
    d = SlotCache.attach(c.uuid)
    load(d, 1)
    load(c, 2)
    assert d.arenas() and len(c.arenas()) < c.layout.n_arenas
    d.close()
    assert ucmcache.verify(c.uuid).facts["arenas"]["owned_by_rank"] == {0: len(c.arenas())}
    load(c, 3)                                        # the next allocation takes them all
    assert c.arenas() == list(range(c.layout.n_arenas))
    assert_whole(c)


def test_a_killed_ranks_arenas_are_freed_by_recovery(make_cache, procs):
    c = make_cache(slots_per_rank=4, slot_size=64, max_ranks=2)
    load(c, 0)
    # the worker takes its share at its first allocation and is killed with a handle open
    p, q = procs.start(workers.die_at_point, c.uuid, 1, key(1), "after_ready")
    p.join(30)
    assert p.exitcode == -signal.SIGKILL
    facts = ucmcache.verify(c.uuid).facts["arenas"]
    assert facts["owned_by_rank"].get(1), facts  # still its own until recovered
    assert [r.rank for r in c.recover().ranks] == [1]
    assert ucmcache.verify(c.uuid).facts["arenas"]["owned_by_rank"] == {0: len(c.arenas())}
    assert hits(c, [1], lambda i: workers.payload_for(key(i), 64)) == [1]  # it outlives it
    for i in range(2, 2 + c.capacity):                # and its slots serve us again
        load(c, i)
    assert c.arenas() == list(range(c.layout.n_arenas))
    assert_whole(c)


# ------------------------------------------------------------------------------- one writer (I6)


def _worker_arena(c, rank):
    return [a for a, o in enumerate(c._arenas.owners().tolist()) if o == rank + 1]


def test_a_taken_arena_waits_for_the_previous_owners_load(make_cache, procs, gate):
    c = make_cache(slots_per_rank=4, slot_size=64, max_ranks=2)
    g = gate()
    p, q = procs.start(workers.load_then_publish_at, c.uuid, key(7), g.path, None, key(8))
    g.wait_arrived()                                  # rank 1 owns key 7's load, in its arena
    slot = next(s for s in range(c.capacity) if lib.ucm_slot_state(c._ctx, s) == lib.UCM_LOADING)
    arena = slot // c.layout.arena_slots
    assert lib.ucm_arena_take(c._ctx, arena, 2) == lib.UCM_OK    # taken from rank 1
    assert lib.ucm_arena_usable(c._ctx, arena) == 0   # its load still writes the arena's words
    g.release()
    assert procs.result(q) == slot
    assert lib.ucm_arena_usable(c._ctx, arena) == 1   # published: now ours to write
    assert c.get_or_load(key(7), lambda: b"never") == b"value"
    assert_whole(c)                                    # its words count key 7 exactly


def test_previous_owner_killed_while_counting_in_a_taken_arena(make_cache, procs, gate):
    """The loader dies inside publish with its entry counted but still Loading, in an arena
    another rank took meanwhile: recovery recounts that arena (its writer was the dead rank),
    before the new owner may write it."""
    c = make_cache(slots_per_rank=4, slot_size=64, max_ranks=2)
    g = gate()
    p, q = procs.start(workers.load_then_publish_at, c.uuid, key(7), g.path,
                       "counted_not_ready", key(8))
    g.wait_arrived()
    slot = next(s for s in range(c.capacity) if lib.ucm_slot_state(c._ctx, s) == lib.UCM_LOADING)
    arena = slot // c.layout.arena_slots
    assert lib.ucm_arena_take(c._ctx, arena, 2) == lib.UCM_OK
    g.release()
    p.join(30)
    assert p.exitcode == -signal.SIGKILL
    assert lib.ucm_arena_usable(c._ctx, arena) == 0   # a dead loader's slot still in it
    assert [r.failed_loads for r in c.recover().ranks] == [1]
    assert lib.ucm_arena_usable(c._ctx, arena) == 1
    rep = assert_whole(c)                              # the arena's words are exact again
    assert rep.facts["entries"] == c.entry_count()
    assert c.get_or_load(key(7), lambda: b"again") == b"again"


def test_a_claim_that_loses_its_arena_is_given_back_untouched(make_cache, procs, gate):
    """Dekker: the claimant CASes a slot, then checks the arena's owner; a taker CASes the
    owner, then verifies.  Held between the two by a gate, the claim blocks the taker's
    verification; released, the claimant sees the new owner and gives the slot back as it
    was (its old entry still a hit) and allocates elsewhere."""
    c = make_cache(slots_per_rank=4, slot_size=64, max_ranks=2)
    for i in range(c.capacity):
        load(c, i)                                    # every slot holds an entry
    g = gate()
    p, q = procs.start(workers.get_with_point, c.uuid, key(100), "claim_unchecked", g.path,
                       None, key(101))
    g.wait_arrived()
    [slot] = claimed_by(c, 1)
    arena = slot // c.layout.arena_slots
    assert lib.ucm_arena_take(c._ctx, arena, 2) == lib.UCM_OK
    assert lib.ucm_arena_usable(c._ctx, arena) == 0   # the claim is seen
    g.release()
    owner, state, data, got, rank = procs.result(q)
    assert owner and got != slot and got // c.layout.arena_slots != arena
    assert lib.ucm_arena_usable(c._ctx, arena) == 1
    assert claimed_by(c, 1) == []
    assert_whole(c)


def test_killed_between_claim_and_ownership_check_loses_no_entry(make_cache, procs):
    c = make_cache(slots_per_rank=4, slot_size=64, max_ranks=2)
    for i in range(c.capacity):
        load(c, i)
    p, q = procs.start(workers.die_at_point, c.uuid, 1, key(100), "claim_unchecked")
    p.join(30)
    assert p.exitcode == -signal.SIGKILL
    [rec] = c.recover().ranks
    assert rec.claims == 1
    # the claimed victim was not touched (and the killed get was the worker's first
    # allocation, so nothing was evicted): every entry is still there, counted once
    assert hits(c, range(c.capacity)) == list(range(c.capacity))
    assert c.entry_count() == c.capacity
    assert_whole(c)


@contextmanager
def rank_1_beside_loads_of_rank_0(make_cache):
    """Rank 0 (c) fills a 2-rank segment (16 arenas of 8), keeping one load in flight in each
    arena of rank 1's range; rank 1 (d) attached.  Yields (c, d, the busy arenas); publishes
    the loads and closes d afterwards, and checks the segment is whole."""
    c = make_cache(slots_per_rank=64, slot_size=64, max_ranks=2)
    L, held = c.layout, []
    for i in range(c.capacity):
        h = c.get(key(i))
        a = h.slot // L.arena_slots
        if h.slot == L.arena_range(a).start and L.home_rank(a) == 1:
            held.append(h)
        else:
            with h:
                h.ready(0)
    d = SlotCache.attach(c.uuid)
    try:
        yield c, d, sorted({h.slot // L.arena_slots for h in held})
    finally:
        for h in held:
            h.ready(0)
            h.close()
        d.close()
    assert_whole(c)


def test_busy_arenas_are_not_taken_while_idle_ones_will_do(make_cache):
    """A newcomer's share comes from arenas nobody is loading into: one with another rank's
    load in flight could not be used until the load ends (I6)."""
    with rank_1_beside_loads_of_rank_0(make_cache) as (c, d, busy):
        with d.get(key(1000), timeout=5) as h:
            assert h.owner
            h.ready(0)
        assert d.arenas() and not set(busy) & set(d.arenas())
        assert all(lib.ucm_arena_usable(d._ctx, a) for a in d.arenas())


def test_a_rank_gives_back_busy_arenas_for_idle_ones(make_cache):
    """A rank whose arenas are all busy with another rank's loads gives them back (free) and
    takes an idle arena, even from a rank at its share, rather than raise CacheFull; the
    loader's rank takes its busy arenas back at once (its own loads are no obstacle to it), and
    the first rank then takes its share from that rank's surplus."""
    with rank_1_beside_loads_of_rank_0(make_cache) as (c, d, busy):
        # this test places d's arenas: its rebalance only notes the epoch
        d._arenas.rebalance = lambda *wait: lib.ucm_arena_epoch_seen(
            d._ctx, lib.ucm_load64(d._seg.base, lib.UCM_H_ARENA_EPOCH))
        for a in busy:
            assert lib.ucm_arena_take(d._ctx, a, 1) == lib.UCM_OK
        assert d.arenas() == busy and not any(lib.ucm_arena_usable(d._ctx, a) for a in busy)
        with d.get(key(1000), timeout=5) as h:             # FULL -> give back, take idle ones
            assert h.owner and h.slot // c.layout.arena_slots not in busy
            h.ready(0)
        assert d.arenas() and not set(busy) & set(d.arenas())   # idle ones instead
        load(c, 2000)                                      # c takes the free busy ones back
        assert set(busy) <= set(c.arenas())
        del d._arenas.rebalance                            # d places itself again:
        load(d, 2001)                                      # its share, from c's surplus
        assert len(d.arenas()) == shares([0, 1], c.layout.n_arenas)[1]
        assert sorted(c.arenas() + d.arenas()) == list(range(c.layout.n_arenas))


# ------------------------------------------------------------------------------- policy


def test_shares_split_evenly_with_the_remainder_to_the_lowest_ranks():
    assert shares([5, 1, 3], 10) == {1: 4, 3: 3, 5: 3}
    assert shares([], 10) == {}


def test_plan_takes_free_home_arenas_first_then_from_the_largest_surplus():
    home = [0, 0, 1, 1, 2, 2]
    # rank 2 alone is new: arenas 0-3 are rank 0's, 4-5 rank 1's, none free
    owners = [1, 1, 1, 1, 2, 2]
    idle = [0] * 6
    assert plan(owners, 2, [0, 1, 2], home, idle) == [(2, 1), (3, 1)]  # not rank 0's own range
    # every free arena, its home ones first
    assert plan([0, 0, 0, 0, 0, 0], 1, [0, 1], home, idle) == [(2, 0), (3, 0), (0, 0), (1, 0),
                                                         (4, 0), (5, 0)]
    # a rank not READY (dead, not yet recovered) gives before a live one with surplus
    assert plan([4, 4, 1, 1, 1, 0], 1, [0, 1], home, idle) == [(5, 0), (0, 4), (1, 4)]
    # above its share, it still takes what is free
    assert plan([2, 2, 2, 2, 1, 0], 1, [0, 1], home, idle) == [(5, 0)]
    # a busy arena (another rank's load in it) is neither counted as usable nor taken
    assert plan([0, 1, 1, 1, 2, 2], 1, [0, 1], home, [1, 0, 0, 0, 0, 0]) == []
    assert plan([1, 1, 1, 1, 2, 2], 1, [0, 1], home, [0, 0, 0, 0, 1, 0]) == [(2, 1)]
    # giving busy arenas back (swaps) lets it take an idle one from a rank at its share, but
    # never from a rank below it
    assert plan([1, 1, 1, 0, 0, 2], 1, [0, 1], home, [0, 0, 0, 1, 1, 0], want_one=True,
                swaps=2) == [(2, 1)]
    assert plan([1, 0, 0, 0, 0, 2], 1, [0, 1, 2], home, [0, 1, 1, 1, 1, 0], want_one=True,
                swaps=3) == []
    # at its share: nothing, unless it found nothing claimable and someone is above share
    assert plan([1, 1, 1, 2, 2, 2], 1, [0, 1], home, idle) == []
    assert plan([1, 1, 1, 2, 2, 2], 1, [0, 1], home, idle, want_one=True) == []
    assert plan([1, 1, 1, 1, 2, 2], 1, [0, 1], home, idle, want_one=True) == [(2, 1)]


def test_a_thread_waits_for_another_thread_of_its_rank_taking_arenas(make_cache, monkeypatch):
    """Threads of one rank take arenas one at a time.  T1 holds that turn (held inside its plan
    by an event) while the main thread, its rank's arenas all pinned, needs an arena: it waits
    for T1's turn (bounded) instead of reporting CacheFull while free arenas exist."""
    import threading
    import ucmcache.core.arenas as arenas_mod
    c = make_cache(slots_per_rank=16, slot_size=64, max_ranks=2)
    d = SlotCache.attach(c.uuid)
    load(c, 0)
    load(d, 1)                                   # shares: 8 arenas each
    for i in range(2, len(d.arenas()) * d.layout.arena_slots + 1):
        load(d, i)                               # d's full: no room there to take (make_room)
    held = [c.get(key(100 + i)) for i in range(len(c.arenas()) * c.layout.arena_slots)]
    for h in held:
        if h.owner:
            h.ready(0)
    d.close()                                    # its 8 arenas are free now
    inside, go, growing = threading.Event(), threading.Event(), threading.Event()
    real_plan, real_grow = arenas_mod.plan, c._arenas.grow

    def plan_held_in_t1(*args, **kw):
        if threading.current_thread().name == "T1":
            inside.set()
            assert go.wait(30)
        return real_plan(*args, **kw)

    def grow_announced(*args, **kw):
        growing.set()                            # the main thread reached its grow
        return real_grow(*args, **kw)
    monkeypatch.setattr(arenas_mod, "plan", plan_held_in_t1)
    monkeypatch.setattr(c._arenas, "grow", grow_announced)
    t1 = threading.Thread(target=lambda: load(c, 999), name="T1")
    t1.start()
    try:
        assert inside.wait(30)                   # T1 holds its rank's turn to take arenas

        def release_when_growing():
            if growing.wait(30):
                go.set()
        releaser = threading.Thread(target=release_when_growing)
        releaser.start()
        with c.get(key(5000), timeout=30) as h:  # every slot of its arenas pinned
            h.ready(0)
        releaser.join(30)
        assert growing.is_set()                  # it did need an arena, and got one
    finally:
        go.set()
        t1.join(30)
        for h in held:
            h.close()
    assert c.arenas() == list(range(c.layout.n_arenas))
    assert_whole(c)
