"""The slot protocol's invariants driven at their windows (DESIGN 4, I1-I3), across processes.

Tiny caches (one slot per rank, one stripe, one or two buckets) force every collision.  Gates
stop a process at a named point; the test acts; the gate opens.  No sleeps.
"""
import threading

import pytest

import ucmcache
from ucmcache import CacheFull
from ucmcache.lowlevel import lib

import workers

A = b"A" * 16


def other_key(cache, same_bucket: bool) -> bytes:
    """A key whose bucket is (or is not) A's bucket."""
    ba = lib.ucm_bucket_of(cache._ctx, A, 0)
    for i in range(1000):
        k = i.to_bytes(2, "little") * 8
        if k != A and (lib.ucm_bucket_of(cache._ctx, k, 0) == ba) == same_bucket:
            return k
    raise AssertionError("no such key")


def tiny(make_cache, n_buckets):
    return make_cache(slots_per_rank=1, slot_size=64, max_ranks=2, n_buckets=n_buckets,
                      n_stripes=1)


@pytest.mark.parametrize("same_bucket", [True, False], ids=["same-bucket-reuse", "relink"])
def test_I3_reader_between_match_and_pin_sees_miss_not_false_hit(make_cache, procs, gate,
                                                                  same_bucket):
    c = tiny(make_cache, 1 if same_bucket else 1024)
    B = other_key(c, same_bucket)
    c.get_or_load(A, lambda: b"value-A")       # our only slot, slot 0, holds A
    g = gate()
    # The reader first loads a key of its own, taking its share: arena 1, slot 1.
    p, q = procs.start(workers.get_with_point, c.uuid, A, "after_match", g.path, 1, b"R" * 16)
    g.wait_arrived()                            # the reader matched slot 0 for A, not pinned
    with c.get(B) as h:                         # we reclaim slot 0 for B meanwhile
        assert h.owner and h.slot == 0
        h.data[:7] = b"value-B"
        h.ready(7)
    g.release()
    owner, state, data, slot, rank = procs.result(q)
    # Revalidation under the pin saw B: a miss, so the reader loads A into its own slot.
    assert (owner, state, slot) == (True, "loading", 1)
    assert c.get_or_load(B, lambda: b"never") == b"value-B"
    assert ucmcache.verify(c.uuid).ok


def test_I1_pinned_slot_cannot_be_claimed(make_cache, procs, gate):
    c = tiny(make_cache, 1)
    c.get_or_load(A, lambda: b"value-A")
    g = gate()
    # The reader first loads a key of its own, taking its share: arena 1, slot 1.
    p, q = procs.start(workers.get_with_point, c.uuid, A, "after_pin", g.path, 1, b"R" * 16)
    g.wait_arrived()                            # the reader holds its pin on slot 0
    with pytest.raises(CacheFull):              # our one slot is pinned: no claim possible
        c.get(other_key(c, True))
    g.release()
    owner, state, data, slot, rank = procs.result(q)
    assert (owner, state, data, slot) == (False, "ready", b"value-A", 0)
    assert ucmcache.verify(c.uuid).ok


def test_I1_claim_and_pin_race_from_the_same_reference(make_cache, procs, gate):
    """The reader read reference 0 and is about to CAS; the writer claims from that same 0.
    Exactly one wins (the writer): the reader's CAS fails and it ends up loading A itself."""
    c = tiny(make_cache, 1)
    B = other_key(c, True)
    c.get_or_load(A, lambda: b"value-A")
    g_reader, g_writer = gate(), gate()
    p, q = procs.start(workers.get_with_point, c.uuid, A, "before_pin_cas", g_reader.path, 1,
                       b"R" * 16)               # the reader owns arena 1 (slot 1) first
    g_reader.wait_arrived()
    c._arm("after_claim", "gate", g_writer)
    result = {}

    def writer():
        with c.get(B) as h:
            result["slot"], result["owner"] = h.slot, h.owner
            h.data[:7] = b"value-B"
            h.ready(7)
    t = threading.Thread(target=writer)
    t.start()
    try:
        g_writer.wait_arrived()                 # the writer claimed slot 0 (CAS 0 -> CLAIMED)
        g_reader.release()                      # the reader's CAS from 0 now fails
        g_writer.release()
    finally:
        g_writer.release()
        t.join(30)
    assert result == {"slot": 0, "owner": True}
    owner, state, data, slot, rank = procs.result(q)
    assert (owner, slot) == (True, 1)
    assert c.get_or_load(B, lambda: b"never") == b"value-B"
    assert ucmcache.verify(c.uuid).ok


def test_reader_on_a_slot_being_rewritten_waits_for_the_stripe(make_cache, procs, gate):
    """Same-bucket rewrite in progress (key already B, still claimed): a reader of B fails the
    pin, goes slow, and joins the writer's load instead of starting another."""
    c = tiny(make_cache, 1)
    B = other_key(c, True)
    c.get_or_load(A, lambda: b"value-A")
    g_writer = gate()
    c._arm("before_handover", "gate", g_writer)
    result = {}

    def writer():
        with c.get(B) as h:
            result["owner"] = h.owner
            h.data[:7] = b"value-B"
            h.ready(7)
    t = threading.Thread(target=writer)
    t.start()
    try:
        g_writer.wait_arrived()                 # slot 0 now says B, linked, still claimed
        waiter_ready = gate()
        p, q = procs.start(workers.wait_for_load, c.uuid, B, waiter_ready.path, 30)
        g_writer.release()
        status, value = procs.result(q)
    finally:
        g_writer.release()
        t.join(30)
    assert result == {"owner": True}
    assert (status, value) == ("ready", b"value-B")
    assert c.stats()["loads_started"] == 2      # A and B, once each
