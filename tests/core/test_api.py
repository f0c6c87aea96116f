"""The single-process public API: names, semantics, errors."""
import copy
import pickle
import re

import numpy as np
import pytest

import ucmcache
from ucmcache import (CacheFull, Handle, HandleClosed, LoadFailed, SlotCache, UcmError,
                      make_key)

K1 = bytes(range(16))
K2 = bytes(range(1, 17))


def fill(h, payload):
    h.data[: len(payload)] = payload
    h.ready(len(payload))


def test_public_names():
    from ucmcache import SlotCache, Handle, UcmError, CacheFull, LoadFailed  # noqa: F401
    assert issubclass(CacheFull, UcmError) and issubclass(LoadFailed, UcmError)
    for name in ("SegmentExists", "SegmentNotFound", "IncompatibleSegment", "CorruptSegment"):
        assert issubclass(getattr(ucmcache, name), UcmError)


def test_cold_get_makes_owner_then_hit(make_cache):
    c = make_cache()
    with c.get(K1) as h:
        assert isinstance(h, Handle)
        assert h.owner and h.state == "loading"
        assert len(h.data) == c.slot_size and not h.data.readonly
        fill(h, b"hello")
        assert h.state == "ready"
    with c.get(K1) as h:
        assert not h.owner and h.state == "ready"
        assert bytes(h.data) == b"hello" and h.data.readonly
        assert h.wait() is h
    assert c.exist([K1, K2]) == [True, False]


def test_key_forms_and_offsets(make_cache):
    c = make_cache()
    with c.get((K1, 7)) as h:
        fill(h, b"seven")
    assert c.exist([(K1, 7), K1, (K1, 0), (bytearray(K1), 7)]) == [True, False, False, True]
    with c.get(K1) as h:
        assert h.owner  # offset 0 is another key
        fill(h, b"zero")
    assert c.get_or_load((K1, 7), lambda: b"never") == b"seven"


@pytest.mark.parametrize("key, exc, msg", [
    (b"short", ValueError, r"16 bytes, got 5"),
    ("a string key....", TypeError, r"16-byte block id"),
    (12345, TypeError, r"got int"),
    ((K1,), TypeError, r"tuple of 1"),
    ((K1, -1), ValueError, r"offset must be in \[0, 2\*\*64\)"),
    ((K1, 2 ** 64), ValueError, r"offset must be in"),
    ((K1, "3"), TypeError, r"offset must be an int"),
])
def test_bad_keys_are_rejected_and_change_nothing(make_cache, key, exc, msg):
    c = make_cache()
    before = c.stats()
    with pytest.raises(exc, match=msg):
        c.get(key)
    with pytest.raises(exc, match=msg):
        c.exist([K1, key])
    assert c.stats()["gets"] == before["gets"]
    assert ucmcache.verify(c.uuid).ok


def test_ready_bounds(make_cache):
    c = make_cache(slot_size=64)
    with c.get(K1) as h:
        with pytest.raises(ValueError, match=r"nbytes must be in \[0, slot_size=64\], got 65"):
            h.ready(65)
        with pytest.raises(TypeError, match="nbytes must be an int"):
            h.ready("3")
        assert h.state == "loading"  # rejected: nothing published
        h.ready()  # whole slot
    with c.get(K1) as h:
        assert len(h.data) == 64


def test_too_large_loader_value_fails_cleanly(make_cache):
    c = make_cache(slot_size=32)
    with pytest.raises(ValueError, match="returned 33 bytes, more than slot_size=32"):
        c.get_or_load(K1, lambda: b"x" * 33)
    # the failed slot is not an entry; the next get elects a new owner
    assert c.exist([K1]) == [False]
    assert c.get_or_load(K1, lambda: b"ok") == b"ok"
    assert c.entry_count() == 1 and c.size_bytes() == 2


def test_fail_reaches_holders_then_next_get_reelects(make_cache):
    c = make_cache()
    owner = c.get(K1)
    waiter = c.get(K1)  # same process, another handle: shares the pin
    assert owner.owner and not waiter.owner
    owner.fail("model exploded")
    with pytest.raises(LoadFailed, match="^model exploded$"):
        waiter.wait(1)
    with pytest.raises(LoadFailed, match="model exploded"):
        waiter.data
    owner.close()
    waiter.close()
    with c.get(K1) as h:
        assert h.owner  # no negative caching
        fill(h, b"second try")


def test_owner_closing_without_ready_marks_failed(make_cache):
    c = make_cache()
    owner = c.get(K1)
    waiter = c.get(K1)
    owner.close()
    with pytest.raises(LoadFailed, match="closed its handle without calling ready"):
        waiter.wait(1)
    waiter.close()


def test_exception_in_with_block_fails_the_load(make_cache):
    c = make_cache()
    waiter = None
    with pytest.raises(KeyError):
        with c.get(K1):
            waiter = c.get(K1)
            raise KeyError("nope")
    with pytest.raises(LoadFailed, match="KeyError"):
        waiter.wait(1)
    waiter.close()


def test_loader_exception_reaches_owner_as_itself(make_cache):
    c = make_cache()

    def boom():
        raise ZeroDivisionError("bad block")
    with pytest.raises(ZeroDivisionError, match="bad block"):
        c.get_or_load(K1, boom)
    assert c.get_or_load(K1, lambda: b"fine") == b"fine"
    s = c.stats()
    assert (s["loads_started"], s["loads_failed"], s["loads_ready"]) == (2, 1, 1)


def test_loader_asking_for_its_own_key_gets_an_error(make_cache):
    c = make_cache()

    def recursive():
        return c.get_or_load(K1, lambda: b"inner")
    with pytest.raises(UcmError, match="a loader asking for its own key would wait for ever"):
        c.get_or_load(K1, recursive)
    assert c.get_or_load(K1, lambda: b"after") == b"after"


def test_handles_are_not_copyable_and_closed_handles_raise(make_cache):
    c = make_cache()
    h = c.get(K1)
    fill(h, b"abc")
    with pytest.raises(TypeError, match="cannot be copied"):
        copy.copy(h)
    with pytest.raises(TypeError, match="cannot be copied"):
        copy.deepcopy(h)
    with pytest.raises(TypeError, match="pickled"):
        pickle.dumps(h)
    h2 = c.get(K1)
    view = h2.data
    h2.close()
    h2.close()  # idempotent
    assert bytes(view) == b"abc"  # a view keeps its own pin, after its handle closed
    del view
    with pytest.raises(HandleClosed):
        h2.data
    with pytest.raises(HandleClosed):
        h2.state
    h.close()


def test_numpy_array_views(make_cache):
    c = make_cache(slot_size=64)
    with c.get(K1) as h:
        a = h.array(np.float32, (4, 4))
        a[:] = np.arange(16, dtype=np.float32).reshape(4, 4)
        del a
        h.ready(64)
    with c.get(K1) as h:
        a = h.array(np.float32, (4, 4))
        assert a[3, 3] == 15 and not a.flags.writeable
        with pytest.raises(ValueError, match="needs 128 bytes"):
            h.array(np.float64, (4, 4))
        del a


def test_close_with_open_handles_is_a_clear_error(make_cache):
    c = make_cache()
    h = c.get(K1)
    with pytest.raises(UcmError, match=r"1 handle\(s\) or batch\(es\) are still open"):
        c.close()
    h.close()
    c.close()


def test_cache_full_when_every_slot_is_pinned(make_cache):
    c = make_cache(slots_per_rank=3, max_ranks=1, n_buckets=2, n_stripes=1)
    held = []
    for i in range(3):
        h = c.get(bytes([i]) * 16)
        fill(h, b"x")
        held.append(h)
    with pytest.raises(CacheFull, match="no claimable slot in the 3 slots"):
        c.get(b"\x09" * 16)
    # get_or_load runs the loader uncached and counts a bypass
    assert c.get_or_load(b"\x09" * 16, lambda: b"uncached") == b"uncached"
    assert c.stats()["bypasses"] == 1  # the loader ran uncached once; the plain get ran none
    with pytest.raises(ValueError, match="more than slot_size"):
        c.get_or_load(b"\x09" * 16, lambda: b"x" * 1000)  # same size rule when bypassing
    for h in held:
        h.close()
    assert c.get_or_load(b"\x09" * 16, lambda: b"cached") == b"cached"
    assert ucmcache.verify(c.uuid).ok


def test_clock_evicts_and_touch_protects(make_cache):
    c = make_cache(slots_per_rank=4, max_ranks=1, n_buckets=2, n_stripes=1)
    keys = [bytes([i]) * 16 for i in range(8)]
    for k in keys[:4]:
        c.get_or_load(k, lambda k=k: k)
    assert all(c.exist(keys[:4]))
    # A sweep clears every accessed bit and takes the first slot; touch keys[1] afterwards so
    # the next allocation passes over it.
    c.get_or_load(keys[4], lambda: keys[4])
    assert c.exist(keys[:5]).count(True) == 4
    resident = [k for k in keys[:4] if c.exist([k])[0]]
    c.touch([resident[0]])
    c.get_or_load(keys[5], lambda: keys[5])
    assert c.exist([resident[0]]) == [True]
    assert c.stats()["evictions"] == 2
    assert c.entry_count() == 4 and c.size_bytes() == 64
    assert ucmcache.verify(c.uuid).ok


def test_get_many_batch(make_cache):
    c = make_cache()
    c.get_or_load(K1, lambda: b"one")
    keys = [K1, K2, K2, (K1, 5)]
    with c.get_many(keys) as b:
        assert list(b.owner) == [False, True, False, True]
        assert list(b.state) == ["ready", "loading", "loading", "loading"]
        assert bytes(b.data(0)) == b"one"
        b.data(1)[:3] = b"two"
        b.ready(1, 3)
        b.array(3, np.uint8)[:2] = [7, 8]
        b.ready(3, 2)
        b.wait(1)
        assert bytes(b.data(2)) == b"two"
        with pytest.raises(IndexError):
            b.data(4)
    assert c.exist(keys) == [True, True, True, True]
    with c.get_many([]) as b:
        assert len(b) == 0


def test_get_many_owner_positions_failed_on_close(make_cache):
    c = make_cache()
    b = c.get_many([K1, K2])
    b.close()
    assert c.exist([K1, K2]) == [False, False]
    assert c.stats()["loads_failed"] == 2


def test_exist_prefix(make_cache):
    c = make_cache()
    ids = ucmcache.chain_keys([b"block-%d" % i for i in range(6)], "model-x/v1/fp16")
    for k in ids[:3]:
        c.get_or_load(k, lambda: b"kv")
    assert c.exist_prefix(ids) == 3
    assert c.exist_prefix(ids[1:]) == 2
    assert c.exist_prefix([]) == 0
    c.get_or_load(ids[4], lambda: b"kv")
    assert c.exist_prefix(ids) == 3  # a hole stops the prefix


def test_make_key():
    a = make_key(b"hello", "llama-3-8b/v2/bf16")
    assert isinstance(a, bytes) and len(a) == 16
    assert make_key("hello", "llama-3-8b/v2/bf16") == a
    assert make_key(b"hello", "llama-3-8b/v3/bf16") != a
    assert make_key(b"hello", "llama-3-8b/v2/bf16", offset=3) == (a, 3)
    with pytest.raises(ValueError, match="non-empty namespace"):
        make_key(b"x", "")
    with pytest.raises(TypeError, match="bytes or str"):
        make_key(3, "ns")


def test_clear_and_exact_accounting(make_cache):
    c = make_cache()
    for i in range(5):
        c.get_or_load(bytes([i]) * 16, lambda i=i: b"x" * (i + 1))
    assert (c.entry_count(), c.size_bytes()) == (5, 15)
    h = c.get(K1)  # a load in flight across clear
    g = c.clear()
    assert g == c.generation
    assert (c.entry_count(), c.size_bytes()) == (0, 0)
    assert c.exist([bytes([i]) * 16 for i in range(5)]) == [False] * 5
    fill(h, b"old-gen")
    h.close()
    assert (c.entry_count(), c.size_bytes()) == (0, 0)  # never counted in the new generation
    assert c.exist([K1]) == [False]
    assert c.get_or_load(K1, lambda: b"new") == b"new"
    assert (c.entry_count(), c.size_bytes()) == (1, 3)
    assert ucmcache.verify(c.uuid).ok


def test_params_are_validated(uuid):
    with pytest.raises(ValueError, match=r"max_ranks must be an int in \[1, 63\], got 64"):
        SlotCache.create(uuid, slots_per_rank=4, slot_size=64, max_ranks=64)
    with pytest.raises(ValueError, match=r"slot_size must be an int in \[1, 2147483647\], got 0"):
        SlotCache.create(uuid, slots_per_rank=4, slot_size=0)
    with pytest.raises(ValueError, match="n_buckets must be a power of two"):
        SlotCache.create(uuid, slots_per_rank=4, slot_size=64, n_buckets=3)
    with pytest.raises(TypeError, match="slots_per_rank must be an int, got str"):
        SlotCache.create(uuid, slots_per_rank="4", slot_size=64)
    with pytest.raises(ValueError, match=re.escape("uuid must match [A-Za-z0-9_-]{1,64}")):
        SlotCache.create("../etc", slots_per_rank=4, slot_size=64)


def test_loader_asking_for_its_own_key_through_a_copied_context(make_cache):
    import asyncio
    c = make_cache()

    def loader():
        async def ask_in_another_thread():
            return await asyncio.to_thread(c.get_or_load, K1, lambda: b"inner")
        return asyncio.run(ask_in_another_thread())
    with pytest.raises(UcmError, match="a loader asking for its own key would wait for ever"):
        c.get_or_load(K1, loader)


def test_two_threads_of_one_process_share_a_load(make_cache):
    import threading
    c = make_cache()
    started, release = threading.Event(), threading.Event()
    out = {}

    def slow_loader():
        started.set()
        assert release.wait(30)
        return b"shared"

    t = threading.Thread(target=lambda: out.setdefault("a", c.get_or_load(K1, slow_loader)))
    t.start()
    try:
        assert started.wait(30)
        with c.get(K1) as h:                    # another thread: joins the load, not an error
            assert not h.owner
            release.set()
            assert bytes(h.wait(30).data) == b"shared"
    finally:
        release.set()
        t.join(30)
    assert out == {"a": b"shared"} and c.stats()["loads_started"] == 1


def test_batch_owner_view_is_released_on_ready(make_cache):
    c = make_cache()
    with c.get_many([K1, K2]) as b:
        v = b.data(0)
        v[:2] = b"ab"
        b.ready(0, 2)
        with pytest.raises(ValueError, match="released"):
            v[:1] = b"x"                       # the writable view ended with the load
        b.fail(1, "no")
    assert c.exist([K1, K2]) == [True, False]


def test_publishing_twice_is_a_clear_error_and_changes_nothing(make_cache):
    c = make_cache()
    with c.get(K1) as h:
        h.data[:2] = b"ok"
        h.ready(2)
        with pytest.raises(UcmError, match=r"^ready\(\): the slot was already published$"):
            h.ready(1)
        with pytest.raises(UcmError, match=r"^fail\(\): the slot was already published$"):
            h.fail("late")
    with c.get(K1) as h:
        assert bytes(h.data) == b"ok"
        with pytest.raises(UcmError, match="for the owner of a loading slot"):
            h.ready()


def test_owner_handle_dropped_without_close_marks_failed(make_cache):
    import gc
    c = make_cache()
    owner = c.get(K1)
    waiter = c.get(K1)
    del owner
    gc.collect()
    with pytest.raises(LoadFailed, match="closed its handle without calling ready"):
        waiter.wait(1)
    waiter.close()
    assert c.get_or_load(K1, lambda: b"again") == b"again"
