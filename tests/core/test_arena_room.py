"""The CLOCK's order with the arenas (DESIGN 4.12): no live entry is evicted while a slot the
rank could obtain is free, whichever ranks attached in whatever order and whichever arenas
moved between them; once every slot holds an entry, the CLOCK evicts as before."""
import random
import threading

import ucmcache
from ucmcache import SlotCache
from ucmcache.core.arenas import Arenas, room_order
from ucmcache.lowlevel import lib

import arena_workers
import workers
SPAWN = __import__("multiprocessing").get_context("spawn")


def key(i: int) -> bytes:
    return b"r" + i.to_bytes(15, "little")


def run_to_end(procs, fn, *args):
    p, q = procs.start(fn, *args)
    value = procs.result(q, timeout=120)
    p.join(30)
    return value


def readable(c, keys, size=64):
    """Which of keys are entries now, each read and checked against its payload."""
    out = []
    for k in keys:
        if c.exist([k])[0]:
            assert workers.check_payload(k, c[k]), k
            out.append(k)
    return out


def test_a_rank_taking_arenas_that_hold_anothers_entries_evicts_none_while_slots_are_free(
        make_cache, procs):
    """Rank 1 allocates first: it takes every arena and, its hand at 0, fills the start of
    rank 0's home range.  Rank 0 then takes its home arenas from it, and its hand passes over
    those entries; rank 0 closes, its arenas go back to free, and rank 2 (its hand at 0 too)
    takes them.  Before the claim looked for a free slot first, rank 0's hand cleared the
    entries' accessed bits and rank 2's hand evicted them at once, with 245 of 256 slots free."""
    c = make_cache(slots_per_rank=64, slot_size=64, max_ranks=4)   # rank 0: allocates nothing
    first = [key(i) for i in range(10)]
    assert run_to_end(procs, workers.load_as_rank, c.uuid, 1, first) == 1
    assert c.arenas() == []                       # rank 1 took them all
    c.get_or_load(key(100), lambda: workers.payload_for(key(100), 64))
    assert 0 in c.arenas()                        # rank 0's home range, with rank 1's entries
    c.close()                                     # its arenas go back to free
    assert run_to_end(procs, workers.load_as_rank, c.uuid, 2, [key(200)]) == 2
    with SlotCache.attach(c.uuid, rank=3) as d:
        assert d.stats()["evictions"] == 0
        assert readable(d, first + [key(100), key(200)]) == first + [key(100), key(200)]
        assert d.entry_count() == 12
    assert ucmcache.verify(c.uuid).ok


def test_four_processes_load_200_cold_keys_once_each_with_nothing_evicted(make_cache, procs,
                                                                          gate):
    """The issue's single-flight check: 4 processes, 200 cold keys (each process first on its
    own 50) in 8 x 512 slots of 4 KiB: each key loaded exactly once, nothing evicted."""
    c = make_cache(slots_per_rank=512, slot_size=4096, max_ranks=8)
    keys = [i.to_bytes(4, "little") * 4 for i in range(200)]
    start = gate()
    ps = [procs.start(arena_workers.single_flight_rotated, c.uuid, keys, 50 * i, start.path)
          for i in range(4)]
    start.release()
    results = [procs.result(q, timeout=300) for _, q in ps]
    assert all(ok for _, ok, _ in results)       # every value its key's
    s = c.stats()
    assert (sum(runs for runs, _, _ in results), s["loads_started"], s["evictions"]) == (200, 200, 0)
    assert c.entry_count() == 200
    assert ucmcache.verify(c.uuid).ok


class Ranks:
    """Two command servers (arena_workers.serve), driven one step at a time."""

    def __init__(self, procs, uuid, n):
        self.cmds, self.replies = [], []
        for _ in range(n):
            cmd, rep = SPAWN.Queue(), SPAWN.Queue()
            procs.start(arena_workers.serve, uuid, cmd, rep)
            self.cmds.append(cmd)
            self.replies.append(rep)

    def do(self, i, op, arg=None):
        self.cmds[i].put((op, arg))
        status, value = self.replies[i].get(timeout=120)
        assert status == "ok", value
        return value

    def stop(self):
        for i in range(len(self.cmds)):
            self.cmds[i].put(("stop", None))
        for i in range(len(self.cmds)):
            self.replies[i].get(timeout=120)


def test_no_eviction_while_any_slot_is_free_over_random_multi_process_runs(make_cache, procs):
    """The counted property: over seeded random runs of two processes loading, holding and
    releasing keys and restarting (their arenas freed, taken again), a step evicts only when the
    cache held an entry in every slot before it (`entries == n_slots` with nothing loading; a
    pinned slot holds an entry), so `evictions == 0` while `entries < n_slots - (pinned +
    loading)`.  And the runs do reach a full cache, so evictions happen once it is full."""
    c = make_cache(slots_per_rank=16, slot_size=64, max_ranks=3)   # 48 slots, 24 arenas of 2
    n_slots = c.layout.n_slots
    pool = [key(1000 + i) for i in range(80)]
    ranks = Ranks(procs, c.uuid, 2)
    checked = evicting_steps = 0
    try:
        for seed in range(3):
            rng = random.Random(3700 + seed)
            held = [set(), set()]
            for step in range(150):
                i = rng.randrange(2)
                u = rng.random()
                if u < 0.70:
                    op, arg = "load", rng.choice(pool)
                elif u < 0.82 and len(held[0] | held[1]) < 6:
                    op, arg = "hold", rng.choice(pool)
                elif u < 0.95 and held[i]:
                    op, arg = "release", rng.choice(sorted(held[i]))
                elif u >= 0.95:
                    op, arg = "restart", None
                else:
                    op, arg = "load", rng.choice(pool)
                if op == "hold" and arg in held[i]:
                    op = "load"
                entries, evictions = c.entry_count(), c.stats()["evictions"]
                pinned = len(held[0] | held[1])
                rank, ok = ranks.do(i, op, arg)
                assert ok, (seed, step, op)
                if op == "hold":
                    held[i].add(arg)
                elif op == "release":
                    held[i].discard(arg)
                elif op == "restart":
                    held[i].clear()
                evicted = c.stats()["evictions"] - evictions
                if entries < n_slots - pinned:   # a free slot beyond the pinned ones
                    checked += 1
                    assert evicted == 0, (f"seed {seed} step {step}: {op} by rank {rank} "
                                          f"evicted {evicted} with {entries} entries, {pinned} "
                                          f"pinned, of {n_slots} slots")
                if entries < n_slots:              # any free slot at all: the stronger form
                    assert evicted == 0, (seed, step, op, entries)
                evicting_steps += evicted > 0
            for i in range(2):
                for k in sorted(held[i]):
                    ranks.do(i, "release", k)
            c.clear()                               # the next seed starts empty
    finally:
        ranks.stop()
    assert checked > 100 and evicting_steps > 20, (checked, evicting_steps)
    assert ucmcache.verify(c.uuid).ok


def test_room_order_takes_free_then_dead_then_the_largest_surplus_never_ours_busy_or_full():
    # rank 0 (word 1) of live ranks 0-2; 6 arenas: shares 2, 2, 2
    owners = [0, 2, 3, 1, 5, 3]            # free, rank 1, rank 2, ours, rank 4 (not READY), rank 2
    room = [1, 2, 2, 2, 1, 1]
    assert room_order(owners, 0, [0, 1, 2], room, [0] * 6) == [(0, 0), (4, 5), (2, 3), (5, 3),
                                                               (1, 2)]
    # a busy arena and one with no room are never taken
    assert room_order(owners, 0, [0, 1, 2], [1, 0, 2, 2, 1, 1], [1, 0, 0, 0, 0, 1]) == [
        (4, 5), (2, 3)]


def load(c, i: int) -> None:
    c.get_or_load(key(i), lambda: workers.payload_for(key(i), 64))


def owned(c, d):
    return len(c.arenas()), len(d.arenas())


def evictions(c):
    return {r["rank"]: r["evictions"] for r in c.stats()["per_rank"]}


def test_a_rank_a_room_take_left_below_its_share_takes_it_back_before_it_evicts(make_cache):
    """Two ranks, 8 arenas of one slot each, full.  Rank 1 looks for room, finds none and
    marks "nothing to take"; then deletes an entry (room in its own arena, no epoch move);
    rank 0, full, had not looked: its look takes that arena (the last tier, "of any rank"),
    leaving rank 1 at 7 of its 8.  Before, no epoch moved, so rank 1 never looked again and
    evicted among 7 arenas for good (owners 9/7 after 50 more loads); now rank 1 owns fewer
    arenas than its mark says, and takes its share back before its next eviction."""
    c = make_cache(slots_per_rank=8, slot_size=64, max_ranks=2)
    with SlotCache.attach(c.uuid, rank=1) as d:
        for i in range(8):
            load(c, i)
            load(d, 100 + i)
        assert owned(c, d) == (8, 8) and c.stats()["evictions"] == 0
        load(d, 200)                               # full: nothing to take, marked; evicts one
        assert evictions(c) == {0: 0, 1: 1}
        gone = next(k for k in (key(100 + i) for i in range(8)) if d.exist([k])[0])
        assert d.delete(gone)                      # room in rank 1's own arena
        load(c, 300)                               # rank 0 takes it (had not looked)
        assert owned(c, d) == (9, 7)
        load(d, 400)
        assert owned(c, d) == (8, 8)               # its share back, before it evicted again
        for j in range(20):
            load(d, 500 + j)
            load(c, 600 + j)
        assert owned(c, d) == (8, 8)
    assert ucmcache.verify(c.uuid).ok


def test_an_arena_whose_words_count_more_entries_than_slots_is_not_taken_for_room(make_cache):
    """A corrupt entry count above an arena's size (2^32 in a 1-slot arena) reads as full to
    the policy, as to the claim; cut to 32 bits it read as empty, and rank 0's room looks took
    rank 1's arenas, full of its entries, one per look."""
    c = make_cache(slots_per_rank=8, slot_size=64, max_ranks=2)
    L = c.layout
    with SlotCache.attach(c.uuid, rank=1) as d:
        for i in range(8):
            load(c, i)
            load(d, 100 + i)
        words = [L.arena_off + a * lib.UCM_ARENA_SIZE + lib.UCM_A_ACC_ENTRIES
                 for a in d.arenas()]
        saved = [lib.ucm_load64(c._seg.base, w) for w in words]
        try:
            for w, v in zip(words, saved):     # the same generation tag, a count of 2^32
                tag = v >> lib.UCM_ACC_VALUE_BITS << lib.UCM_ACC_VALUE_BITS
                lib.ucm_store64(c._seg.base, w, tag | 1 << 32)
            load(c, 200)                       # rank 0, full: nothing to take; evicts its own
            assert owned(c, d) == (8, 8)
            assert all(d.exist([key(100 + i) for i in range(8)]))
            assert c._arenas.entries()[d.arenas()].tolist() == [1] * 8   # full, not 0
        finally:
            for w, v in zip(words, saved):
                lib.ucm_store64(c._seg.base, w, v)
    assert ucmcache.verify(c.uuid).ok


def test_nothing_to_take_is_not_marked_for_a_generation_the_policy_did_not_look_under(
        make_cache):
    """Rank 0, full, looks for room; while it looks, rank 1 clears the cache (the generation
    moves: every slot free).  Its look saw the old words and found nothing: "nothing to take"
    belongs to the generation it looked under.  Marked for the new one (the pair read at the
    mark, not before the look), rank 0 filled its own arenas and then evicted its own entries
    while rank 1's 8 arenas stood empty."""
    c = make_cache(slots_per_rank=8, slot_size=64, max_ranks=2)
    with SlotCache.attach(c.uuid, rank=1) as d:
        for i in range(8):
            load(c, i)
            load(d, 100 + i)
        look = c._arenas.entries

        def entries_while_rank_1_clears():
            out = look()
            c._arenas.entries = look               # once
            d.clear()
            return out

        c._arenas.entries = entries_while_rank_1_clears
        for i in range(9):                         # 8 fill its arenas again, 1 more
            load(c, 200 + i)
        assert c._arenas.entries is look           # the look was made, the clear in it
        assert c.entry_count() == 9 and c.stats()["evictions"] == 0
        assert owned(c, d) == (9, 7)
    assert ucmcache.verify(c.uuid).ok


def test_a_rank_a_room_take_left_below_its_share_looks_again_only_when_it_would_evict(
        make_cache, monkeypatch):
    """While the cache fills, rank 0 (three loads to each of rank 1's) grows into rank 1's
    room, taking one arena at a time; rank 1 takes its share back only once its own arenas
    are full (before its first eviction), not at each allocation: a take announced to every
    rank (the arena epoch) made both ranks run the policy at every few misses (88 room looks
    and 175 share looks for 2,800 loads, against 7 and 3)."""
    looks = {"make_room": 0, "rebalance": 0}
    for name in looks:
        inner = getattr(Arenas, name)

        def counted(self, *a, _inner=inner, _name=name, **k):
            looks[_name] += 1
            return _inner(self, *a, **k)

        monkeypatch.setattr(Arenas, name, counted)
    c = make_cache(slots_per_rank=512, slot_size=64, max_ranks=2)   # 16 arenas of 64 slots
    with SlotCache.attach(c.uuid, rank=1) as d:
        i = 0
        for _ in range(700):
            for _ in range(3):
                load(c, i)
                i += 1
            load(d, i)
            i += 1
        assert c.entry_count() == c.layout.n_slots
        assert c.stats()["evictions"] == 2800 - c.layout.n_slots   # none before it was full
        assert owned(c, d) == (8, 8)
        assert looks["make_room"] <= c.layout.n_arenas and looks["rebalance"] <= 4, looks
    assert ucmcache.verify(c.uuid).ok


def _full(c, n, start=0):
    """Load keys start..start+n-1; returns them."""
    keys = [key(i) for i in range(start, start + n)]
    for k in keys:
        c.get_or_load(k, lambda k=k: workers.payload_for(k, 64))
    return keys


class _Boom(Exception):
    pass


def _boom():
    raise _Boom("the loader fails")


def test_once_full_a_freed_slot_is_taken_before_any_eviction(make_cache):
    """Once every arena of ours is full, claims skip the free-first walk until a step of ours
    could have made room (csrc full_mark): a delete, a failed load and a clear() each make the
    next claim look again, so the slot they freed is taken and nothing is evicted for it."""
    c = make_cache(slots_per_rank=32, slot_size=64, max_ranks=2)
    keys = _full(c, 64)                                    # both ranks' share: every slot
    _full(c, 3, start=1000)                                # evicting claims: the walk found full
    ev = c.stats()["evictions"]
    assert ev == 3
    live = [k for k in keys if c.exist([k])[0]]
    # A delete frees a slot: the next miss takes it, evicting nothing.
    assert c.delete(live[0])
    _full(c, 1, start=2000)
    assert c.stats()["evictions"] == ev
    # A failed load: its claim evicts one entry (the cache is full), then leaves the slot
    # Failed, a free slot once released: the next miss takes it, evicting nothing more.
    try:
        c.get_or_load(key(3000), _boom)
    except _Boom:
        pass
    ev = c.stats()["evictions"]
    _full(c, 1, start=4000)
    assert c.stats()["evictions"] == ev
    # clear() frees every slot: a cache's worth of new keys, nothing evicted.
    c.clear()
    ev = c.stats()["evictions"]
    _full(c, 64, start=5000)
    assert c.stats()["evictions"] == ev
    assert ucmcache.verify(c.uuid).ok


def mkey(i: int) -> bytes:
    return b"m" + i.to_bytes(15, "little")


def mload(c, k):
    c.get_or_load(k, lambda: workers.payload_for(k, 64))


def bkey(i: int) -> bytes:
    return b"b" + i.to_bytes(15, "little")


def test_a_foreign_delete_straddling_a_look_leaves_no_mark_over_a_free_slot(make_cache, gate):
    """A claim's walk read a full arena's words before another rank's delete uncounted them, and
    its verified bit after our verification: read in that order (words, then bit) the walk
    recorded full_mark over the freed slot and 7 of the next 8 misses evicted (reviewer's
    repro).  The bit is read first (acquire), so the words it reads count the uncount."""
    c = make_cache(slots_per_rank=16, slot_size=64, max_ranks=2)   # 32 slots, 16 arenas of 2
    keys = [mkey(i) for i in range(32)]
    for k in keys:
        mload(c, k)                                 # rank 0 alone: every arena, every slot
    assert c.stats()["evictions"] == 0 and c.entry_count() == 32
    d = SlotCache.attach(c.uuid, rank=1)            # the deleter: another rank
    try:
        victim = keys[5]
        h = c.get(victim)                           # a reader of ours keeps the slot held
        checked = gate()
        d._arm("delete_checked", "gate", checked)
        out = {}
        z = threading.Thread(target=lambda: out.setdefault("del", d.delete(victim)))
        z.start()
        checked.wait_arrived()                      # d took arena A, marked and checked
        owners = c._arenas.owners().tolist()
        a = owners.index(2)
        assert c._arenas.take_for_delete(a)         # we take A back (frees bumped; unverified)
        look = gate()
        c._arm("free_look", "gate", look)
        t2 = threading.Thread(target=mload, args=(c, mkey(100)))
        t2.start()
        look.wait_arrived()                         # T2 read A's words: full (not yet uncounted)
        checked.release()
        z.join(30)
        assert out["del"] is True                   # d uncounted; its give_back found A ours
        assert lib.ucm_arena_usable(c._ctx, a) == 1  # T1: A verifies now (the mark is gone)
        look.release()
        t2.join(30)                                 # T2 read A verified: full_mark recorded
        h.close()                                   # the deleted slot is free now
        ev = c.stats()["evictions"]
        fresh = [mkey(200 + i) for i in range(8)]
        for i, k in enumerate(fresh):
            mload(c, k)
            if i == 0:
                first = c.stats()["evictions"] - ev
        total = c.stats()["evictions"] - ev
        assert first == 0, f"evicted {first} live entry while a slot of ours was free"
    finally:
        d.close()
    assert ucmcache.verify(c.uuid).ok


def test_the_free_first_walk_finds_the_one_free_slot_wherever_the_hand_is(make_cache):
    """claim_free's two passes over the owned-arena bitmap, across a 64-bit word boundary, with
    80 arenas and the hand anywhere: a lone free slot is always taken, nothing evicted."""
    c = make_cache(slots_per_rank=16, slot_size=64, max_ranks=10)   # 160 slots, 80 arenas of 2
    L = c._layout
    assert (L.n_arenas, L.arena_slots) == (80, 2)
    n = L.n_slots
    slot_of = {}
    nxt = [0]

    def load():
        k = bkey(nxt[0]); nxt[0] += 1
        c.get_or_load(k, lambda: workers.payload_for(k, 64))
        h = c.get(k)
        slot_of[int(h._slot)] = k
        h.close()

    for _ in range(n):
        load()
    assert len(slot_of) == n and c.stats()["evictions"] == 0
    hand_off = L.rank(0) + lib.UCM_R_CLOCK_HAND
    cases = 0
    for hand in (0, 1, 126, 127, 128, 129, 130, 158, 159):
        for free in (0, 1, 2, 125, 126, 127, 128, 129, 130, 131, 157, 158, 159, hand, hand ^ 1):
            free %= n
            assert c.delete(slot_of[free])
            del slot_of[free]
            lib.ucm_store64(c._seg.base, hand_off, hand)
            ev = c.stats()["evictions"]
            load()
            assert c.stats()["evictions"] == ev, (hand, free)
            assert free in slot_of, (hand, free)
            cases += 1
    assert cases == 135
    assert ucmcache.verify(c.uuid).ok
