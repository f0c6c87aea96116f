"""Reads that meet a dead rank's claim (crash window `claim_unchecked`, DESIGN 5.8): a slot
claimed by a rank killed between its claim and its ownership check still holds its Ready
entry, so `key in cache` and len() count it; the read paths that answer BUSY for it recover
dead ranks when that needs no wait and answer the entry, without anybody's miss first.  A
live claimant's claim ends by itself: no recovery scan for it, and the answer stands.  Each
read counts each key once, whatever it looked at twice."""
import signal

import numpy as np
import pytest

import ucmcache
from ucmcache.lowlevel import lib

import read_workers
import workers


def key(i: int) -> bytes:
    return b"b" + i.to_bytes(15, "little")


@pytest.mark.parametrize("first", ["getitem", "read_many"])
def test_a_reader_reads_an_entry_claimed_by_a_killed_rank(make_cache, procs, gate, first):
    c = make_cache(slots_per_rank=4, slot_size=64, max_ranks=3)
    keys = [key(i) for i in range(c.capacity)]
    for k in keys:                                    # every slot holds an entry
        c.get_or_load(k, lambda k=k: workers.payload_for(k, 64))
    attached, go = gate(), gate()
    reader, rq = procs.start(read_workers.read_when_told, c.uuid, 2, keys, first,
                             attached.path, go.path)
    attached.wait_value(1)                            # the reader attached (attach recovers)
    # rank 1 takes its share and, the cache full, claims a victim: killed before its check
    p, _ = procs.start(workers.die_at_point, c.uuid, 1, key(1000), "claim_unchecked")
    p.join(60)
    assert p.exitcode == -signal.SIGKILL
    L = c.layout
    claimed = [s for s in range(L.n_slots)
               if lib.ucm_load64(c._seg.base, L.meta(s) + lib.UCM_M_REFERENCE)
               == lib.UCM_CLAIMED | 1]
    assert len(claimed) == 1 and lib.ucm_slot_state(c._ctx, claimed[0]) == lib.UCM_READY
    assert all(c.exist(keys)) and len(c) == len(keys)  # it is there, and counted
    go.release()
    getitem, read_many, misses, loads = procs.result(rq)
    assert getitem == [True] * len(keys)              # cache[key]: every entry's bytes
    assert read_many == [True] * len(keys)            # read_many: every row
    assert (misses, loads) == (0, 0)                  # the reader only read
    assert c.stats()["loads_started"] == len(keys)   # nobody loaded anything since the fill
    assert c.recover().count == 0                     # the reader recovered rank 1
    assert ucmcache.verify(c.uuid).ok


def claimed_by(c, rank):
    L = c.layout
    return [s for s in range(L.n_slots)
            if lib.ucm_load64(c._seg.base, L.meta(s) + lib.UCM_M_REFERENCE)
            == lib.UCM_CLAIMED | rank]


def my_counts(c):
    row = next(r for r in c.stats()["per_rank"] if r["rank"] == c.rank)
    return row["hits"], row["gets"]


def counting_recoveries(c):
    """c._recover, wrapped to count its calls (each a scan of every rank's life lock)."""
    calls = []
    inner = c._recover
    c._recover = lambda wait: (calls.append(wait), inner(wait))[1]
    return calls


def read_by(c, keys, path):
    """Every key read once by `path`: read_many of a list of plain ids (the C path), of a
    tuple of (id, 0) keys (the full path), or cache[key] key by key.  Which keys it found."""
    if path == "getitem":
        found = []
        for k in keys:
            try:
                found.append(workers.check_payload(k, c[k]))
            except KeyError:
                found.append(False)
        return found
    rows = np.zeros((len(keys), c.slot_size), dtype=np.uint8)
    ks = list(keys) if path == "read_many" else tuple((k, 0) for k in keys)
    lens = c.read_many(ks, rows)
    return [bool(n >= 0 and workers.check_payload(k, rows[i, :n].tobytes()))
            for i, (k, n) in enumerate(zip(keys, lens.tolist()))]


@pytest.mark.parametrize("path", ["read_many", "read_many_full", "getitem"])
def test_a_live_claimants_busy_slot_is_answered_as_before_without_a_recovery_counted_once(
        make_cache, procs, gate, path):
    """A live rank holds a claim on a Ready entry's slot (stopped at `claim_unchecked`): the
    reads answer every other key and not that one, as before; they run no recovery scan (its
    claimant's life lock is held: a recovery finds nothing), and count each key once (a
    read_many's first pass answered BUSY; counted, then read again, it counted two or three
    times: 34 hits for 12 keys)."""
    c = make_cache(slots_per_rank=4, slot_size=64, max_ranks=3)
    keys = [key(i) for i in range(c.capacity)]
    for k in keys:                                    # every slot holds an entry
        c.get_or_load(k, lambda k=k: workers.payload_for(k, 64))
    g = gate(timeout=60)
    p, q = procs.start(workers.get_with_point, c.uuid, key(1000), "claim_unchecked", g.path, 1)
    try:
        g.wait_arrived()
        assert len(claimed_by(c, 1)) == 1
        calls = counting_recoveries(c)
        for _ in range(3):
            hits, gets = my_counts(c)
            found = read_by(c, keys, path)
            assert found.count(True) == len(keys) - 1   # all but the claimed slot's key
            # a request per key (cache[key] counts only its hits: HIT_ONLY), a hit per copy
            assert my_counts(c) == (hits + len(keys) - 1,
                                    gets + len(keys) - (path == "getitem"))
        assert calls == []                          # no recovery scan for a live claimant
    finally:
        g.release()
    procs.result(q, timeout=60)
    assert ucmcache.verify(c.uuid).ok


@pytest.mark.parametrize("path", ["read_many", "read_many_full", "getitem"])
def test_a_dead_claimants_entry_is_read_after_a_recovery_and_counted_once(make_cache, procs,
                                                                          path):
    """Rank 1 killed between its claim on a Ready entry's slot and its check: the reads recover
    it (no wait needed) and answer every key, each hit counted once."""
    c = make_cache(slots_per_rank=4, slot_size=64, max_ranks=3)
    keys = [key(i) for i in range(c.capacity)]
    for k in keys:
        c.get_or_load(k, lambda k=k: workers.payload_for(k, 64))
    p, _ = procs.start(workers.die_at_point, c.uuid, 1, key(1000), "claim_unchecked")
    p.join(60)
    assert p.exitcode == -signal.SIGKILL
    assert len(claimed_by(c, 1)) == 1
    calls = counting_recoveries(c)
    hits, gets = my_counts(c)
    assert read_by(c, keys, path) == [True] * len(keys)
    assert my_counts(c) == (hits + len(keys), gets + len(keys))
    assert len(calls) == 1 and claimed_by(c, 1) == []    # recovered once, by the read
    assert ucmcache.verify(c.uuid).ok
