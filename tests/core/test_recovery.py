"""Crash safety (DESIGN 5): a process SIGKILLed at any named point leaves nothing behind once a
survivor recovers: no pin, claim or Loading slot of the dead rank, chains whole, capacity whole,
and the rank reusable."""
import signal

import pytest

import ucmcache
from ucmcache import SlotCache
from ucmcache.lowlevel import lib
from ucmcache.core.verify import slot_fields, snapshot

import workers

X = b"X" * 16
Y = b"Y" * 16


def assert_whole(c):
    rep = ucmcache.verify(c.uuid)
    assert rep.ok, rep
    f = slot_fields(snapshot(c._seg)["metas"])
    assert int((f["reference"] != 0).sum()) == 0, "a pin or claim survived recovery"
    return rep


def capacity_of_rank(uuid, rank, n):
    """Every slot of `rank` can be allocated again: load n distinct keys as that rank."""
    c = SlotCache.attach(uuid, rank=rank)
    try:
        for i in range(n):
            k = b"cap" + i.to_bytes(13, "little")
            with c.get(k) as h:
                assert h.owner
                h.ready(1)
        return True
    finally:
        c.close()


POINTS = ["after_claim", "after_unlink", "mid_publish", "before_handover", "inside_loader",
          "holding_stripe", "before_ready", "after_ready"]


@pytest.mark.parametrize("point", POINTS)
def test_writer_killed_at_point_is_recovered(make_cache, procs, point):
    c = make_cache(slots_per_rank=2, slot_size=64, max_ranks=3, n_buckets=1024, n_stripes=4)
    # every slot holds a key (X among them), so rank 1's allocation, in the arenas it takes
    # from rank 0, must unlink one (relink)
    for k in [X, b"Z" * 16] + [bytes([i]) * 16 for i in range(4)]:
        c.get_or_load(k, lambda: b"v")
    assert c.entry_count() == c.capacity
    p, q = procs.start(workers.die_at_point, c.uuid, 1, Y, point)
    p.join(30)
    assert p.exitcode == -signal.SIGKILL, f"the worker was not killed at {point}"
    report = c.recover()
    assert [r.rank for r in report.ranks] == [1]
    assert c.recover().count == 0              # idempotent
    assert_whole(c)
    assert capacity_of_rank(c.uuid, 1, 2)      # the rank is reusable, its capacity whole
    assert c.get_or_load(Y, lambda: b"y") in (b"y", workers.payload_for(Y, 64))
    assert_whole(c)


@pytest.mark.parametrize("point", ["after_match", "before_pin_cas", "after_pin"])
def test_reader_killed_at_point_is_recovered(make_cache, procs, point):
    c = make_cache(slots_per_rank=2, slot_size=64, max_ranks=3, n_buckets=1024, n_stripes=4)
    c.get_or_load(X, lambda: workers.payload_for(X, 64))
    p, q = procs.start(workers.die_at_point, c.uuid, 1, X, point)
    p.join(30)
    assert p.exitcode == -signal.SIGKILL
    report = c.recover()
    assert [r.rank for r in report.ranks] == [1]
    assert_whole(c)
    assert c.exist([X]) == [True]


def test_dead_pin_holder_is_recovered_on_attach(make_cache, procs, gate):
    c = make_cache(slots_per_rank=2, slot_size=64, max_ranks=3)
    c.get_or_load(X, lambda: b"x")
    g = gate()
    p, q = procs.start(workers.hold_pin_then_die, c.uuid, X, g.path)
    g.wait_value(1)
    f = slot_fields(snapshot(c._seg)["metas"])
    assert int((f["reference"] != 0).sum()) == 1     # the child's pin is there
    p.kill()
    p.join(10)
    assert not ucmcache.verify(c.uuid).ok            # a dead rank's pin: reported
    d = SlotCache.attach(c.uuid)                     # attach recovers dead ranks
    try:
        assert d.stats()["recovered_ranks"] == 1
    finally:
        d.close()
    assert_whole(c)


def test_stripe_lock_held_by_killed_process_is_repaired(make_cache, procs, gate):
    c = make_cache(slots_per_rank=4, slot_size=64, max_ranks=3, n_stripes=1)
    c.get_or_load(X, lambda: b"x")
    g = gate()
    p, q = procs.start(workers.lock_stripe_and_die, c.uuid, 0, g.path)
    g.wait_value(1)
    p.kill()
    p.join(10)
    # The next locker gets EOWNERDEAD, rebuilds the stripe's chains, marks it consistent.
    assert c.get_or_load(Y, lambda: b"y") == b"y"
    assert c.stats()["stripe_repairs"] == 1
    assert c.get_or_load(b"W" * 16, lambda: b"w") == b"w"
    assert c.stats()["stripe_repairs"] == 1          # consistent again: no second repair
    c.recover()
    assert_whole(c)


def test_stripe_repair_rebuilds_broken_prev_links(make_cache):
    c = make_cache(slots_per_rank=8, slot_size=64, max_ranks=1, n_buckets=1, n_stripes=1)
    for i in range(5):
        c.get_or_load(bytes([i]) * 16, lambda: b"v")
    L = c.layout
    # break a prev link the way a holder killed mid-unlink leaves it
    head = lib.ucm_load32(c._seg.base, L.bucket_off)
    nxt = lib.ucm_load32(c._seg.base, L.meta(head) + lib.UCM_M_NEXT)
    lib.ucm_store32(c._seg.base, L.meta(nxt) + lib.UCM_M_PREV, 7)
    assert not ucmcache.verify(c.uuid).ok
    c._stripes.lock(0)
    try:
        assert c._stripes.rebuild(0) == 0
    finally:
        c._stripes.unlock(0)
    assert ucmcache.verify(c.uuid).ok
    assert c.exist([bytes([i]) * 16 for i in range(5)]) == [True] * 5


def test_get_of_a_key_claimed_by_a_dead_rank_recovers_instead_of_cache_full(make_cache, procs):
    c = make_cache(slots_per_rank=2, slot_size=64, max_ranks=3, n_buckets=1024, n_stripes=4)
    p, q = procs.start(workers.die_at_point, c.uuid, 1, Y, "before_handover")
    p.join(30)
    assert p.exitcode == -signal.SIGKILL       # Y's slot: linked, Loading, claimed by rank 1
    assert c.get_or_load(Y, lambda: b"mine") == b"mine"
    s = c.stats()
    assert s["bypasses"] == 0 and s["recovered_ranks"] == 1
    assert_whole(c)


def test_inconsistent_links_are_reported_and_the_claim_given_back(make_cache):
    c = make_cache(slots_per_rank=2, slot_size=64, max_ranks=1, n_buckets=1024, n_stripes=4)
    c.get_or_load(X, lambda: b"x")
    c.get_or_load(Y, lambda: b"y")
    L = c.layout
    for s in range(2):                          # both slots: a prev that names a stranger
        lib.ucm_store32(c._seg.base, L.meta(s) + lib.UCM_M_PREV, 1 - s)
    with pytest.raises(ucmcache.CorruptSegment, match="inconsistent chain links"):
        c.get(b"Q" * 16)
    rep = ucmcache.verify(c.uuid)
    assert rep.facts["claimed_slots"] == 0     # nothing left claimed by a live rank
    assert c.exist([X, Y]) == [True, True]     # and nothing reachable was rewritten


def test_close_removes_a_leaked_pin_of_its_own_rank(uuid):
    c = SlotCache.create(uuid, slots_per_rank=2, slot_size=64, max_ranks=2)
    c.get_or_load(X, lambda: b"x")
    # a pin no Handle owns (an exception hit)
    r = lib.ucm_lookup_pin(c._ctx, X, 0, 64, lib.UCM_OUTER_REQUEST, 0)
    assert r >= 0
    c.close()
    d = SlotCache.attach(uuid)
    try:
        assert_whole(d)
    finally:
        d.close()


def test_two_processes_recovering_at_once_recover_each_dead_rank_once(make_cache, procs, gate):
    c = make_cache(slots_per_rank=4, slot_size=64, max_ranks=5)
    c.get_or_load(X, lambda: b"x")
    held = gate()
    p, q = procs.start(workers.hold_pin_then_die, c.uuid, X, held.path)
    held.wait_value(1)
    p.kill()
    p.join(10)
    start = gate()
    rs = [procs.start(workers.attach_and_recover, c.uuid, start.path) for _ in range(2)]
    start.release()
    for _, q in rs:
        procs.result(q)
    assert c.stats()["recovered_ranks"] == 1      # one of them did it; the other found nothing
    assert_whole(c)
