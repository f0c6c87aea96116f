"""Reads that meet a dead rank's claim (crash window `claim_unchecked`, DESIGN 5.8): a slot
claimed by a rank killed between its claim and its ownership check still holds its Ready
entry, so `key in cache` and len() count it; the read paths that answer BUSY for it recover
dead ranks when that needs no wait and answer the entry, without anybody's miss first."""
import signal

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
