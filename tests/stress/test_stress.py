"""Multi-process stress over a cache much smaller than the key space: constant eviction, every
payload carrying its key and a checksum, so a false hit or a torn read is caught."""
import ucmcache
from ucmcache.core.verify import slot_fields, snapshot

import workers


def test_four_processes_random_mix_no_false_hits(make_cache, procs):
    c = make_cache(slots_per_rank=6, slot_size=96, max_ranks=5, n_buckets=8, n_stripes=2)
    ps = [procs.start(workers.stress, c.uuid, seed, 6000, 60) for seed in range(4)]
    results = [procs.result(q, timeout=240) for _, q in ps]
    assert [bad for bad, _ in results] == [0, 0, 0, 0]
    ops = [o for _, o in results]
    print(ops, c.stats()["evictions"])
    assert sum(o["get"] for o in ops) > 12000
    s = c.stats()
    assert s["evictions"] > 100                  # the cache really churned
    assert s["loads_started"] >= sum(o["loads"] for o in ops)  # plus batch loads
    rep = ucmcache.verify(c.uuid)
    assert rep.ok, rep
    f = slot_fields(snapshot(c._seg)["metas"])
    assert int((f["reference"] != 0).sum()) == 0  # every slot unpinned, nothing claimed
    assert rep.facts["entries"] == c.entry_count() == rep.facts["current_entries_scanned"]


def test_stress_with_clears_keeps_accounting_exact(make_cache, procs):
    c = make_cache(slots_per_rank=6, slot_size=96, max_ranks=5, n_buckets=8, n_stripes=2)
    ps = [procs.start(workers.stress, c.uuid, 100 + seed, 800, 40) for seed in range(3)]
    for i in range(50):
        c.clear()
        c.get_or_load(i.to_bytes(2, "little") * 8, lambda: b"x" * 20)
    results = [procs.result(q, timeout=240) for _, q in ps]
    assert [bad for bad, _ in results] == [0, 0, 0]
    rep = ucmcache.verify(c.uuid)
    assert rep.ok, rep
    assert rep.facts["chains"]["max"] <= c.capacity
