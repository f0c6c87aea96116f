"""The read path: the pin's answer carries what a reader needs, one read-only view
per handle, copies into caller buffers (gather, read_many) and the handle-free get_or_load hit.
"""
import array

import numpy as np
import pytest

import ucmcache
from ucmcache import HandleClosed, LoadFailed, UcmError

import safety_workers
from test_protocol import A, other_key, tiny

K = [bytes([i]) * 16 for i in range(8)]


def fill(c, keys, size=None):
    for i, k in enumerate(keys):
        n = (size or c.slot_size) - i
        c.get_or_load(k, lambda i=i, n=n: bytes([i + 1]) * n)


def test_a_hit_reads_its_bytes_from_one_view_that_keeps_its_own_pin(make_cache):
    c = make_cache(slot_size=64)
    fill(c, K[:1])
    with c.get(K[0]) as h:
        assert h.nbytes == 64
        v = h.data
        assert v is h.data and v.readonly and bytes(v) == b"\x01" * 64
        assert h.array(np.uint8).sum() == 64
    with pytest.raises(HandleClosed):
        h.data
    assert c._open_handles == 0 and c._exports == 1 and set(_refs(c)) != {0}
    assert bytes(v) == b"\x01" * 64  # the handle is closed; the view still pins its slot
    del v
    assert c._exports == 0 and set(_refs(c)) == {0}


def test_a_joined_load_reads_its_length_after_wait(make_cache):
    c = make_cache(slot_size=64)
    owner = c.get(K[0])
    assert owner.owner
    with c.get(K[0]) as j:  # a second handle of this process joins the Loading slot
        assert not j.owner
        with pytest.raises(UcmError, match="call wait"):
            j.data
        owner.data[:3] = b"abc"
        owner.ready(3)
        owner.close()
        assert bytes(j.wait().data) == b"abc"


@pytest.mark.parametrize("kind", ["2d", "flat", "bytearray", "memoryview"])
def test_gather_fills_rows_and_reports_lengths(make_cache, kind):
    c = make_cache(slot_size=64)
    fill(c, K[:3])
    n, row = 4, 64
    out = {"2d": np.full((n, row), 0xEE, np.uint8), "flat": np.full(n * row, 0xEE, np.uint8),
           "bytearray": bytearray(b"\xee" * (n * row)),
           "memoryview": memoryview(bytearray(b"\xee" * (n * row)))}[kind]
    with c.get_many([K[0], K[1], K[2], K[3]]) as b:
        assert b.owner.tolist() == [False, False, False, True]
        lens = b.gather(out)
        assert lens.dtype == np.int64 and lens.tolist() == [64, 63, 62, -1]
        b.fail(3, "not now")
    flat = bytes(memoryview(out).cast("B"))
    assert flat[0:64] == b"\x01" * 64 and flat[64:127] == b"\x02" * 63
    assert flat[128:190] == b"\x03" * 62
    assert flat[192:256] == b"\xee" * 64  # the Loading position's row is untouched


def test_gather_and_read_many_refuse_what_they_cannot_fill(make_cache):
    c = make_cache(slot_size=64)
    fill(c, K[:2])
    with c.get_many(K[:2]) as b:
        with pytest.raises(ValueError, match="not a whole number of rows"):
            b.gather(bytearray(127))
        with pytest.raises(ValueError, match=r"payload is 64 bytes, more than a row of out \(32"):
            b.gather(np.zeros((2, 32), np.uint8))
        with pytest.raises(ValueError, match="not writable"):
            b.gather(b"\0" * 128)
        with pytest.raises(ValueError, match="C-contiguous"):
            b.gather(np.zeros((2, 128), np.uint8)[:, ::2])
    with pytest.raises(TypeError, match="writable C-contiguous buffer"):
        c.read_many(K[:2], 5)
    assert c._open_handles == 0 and ucmcache.verify(c.uuid).ok


def test_read_many_copies_what_is_ready_and_creates_nothing(make_cache):
    c = make_cache(slot_size=64)
    fill(c, K[:2])
    loading = c.get(K[2])  # Loading, ours
    assert loading.owner
    out = np.zeros((4, 64), np.uint8)
    lens = c.read_many([K[0], K[3], K[2], (K[1], 0)], out)
    assert lens.tolist() == [64, -1, -1, 63]
    assert bytes(out[0]) == b"\x01" * 64 and bytes(out[3][:63]) == b"\x02" * 63
    assert not out[1].any() and not out[2].any()
    assert c.exist([K[3]]) == [False]  # a miss elected nobody and installed nothing
    with c.get(K[3]) as h:
        assert h.owner
        h.fail("x")
    loading.fail("y")
    loading.close()
    assert ucmcache.verify(c.uuid).ok
    assert c.read_many([], out).tolist() == []


def test_read_many_is_a_trusted_hit_I3(make_cache, procs, gate):
    """A reader held between MatchKey and the pin while the slot is reclaimed for another key
    reports a miss for its key, never the other key's bytes."""
    c = tiny(make_cache, 1)
    B = other_key(c, True)
    c.get_or_load(A, lambda: b"value-A")
    g = gate()
    # the reader first loads a key of its own, taking its share: arena 1, slot 1
    p, q = procs.start(safety_workers.read_many_with_point, c.uuid, [A], "after_match", g.path,
                       64, b"R" * 16)
    g.wait_arrived()
    with c.get(B) as h:  # reclaims the slot A was in
        assert h.owner and h.slot == 0
        h.data[:7] = b"value-B"
        h.ready(7)
    g.release()
    lens, rows = procs.result(q)
    assert lens == [-1] and rows[0] == b"\0" * 64


def test_get_or_load_hit_returns_bytes_without_a_handle(make_cache):
    c = make_cache(slot_size=64)
    calls = []
    assert c.get_or_load(K[0], lambda: calls.append(1) or b"v" * 10) == b"v" * 10
    before = c.stats()
    v = c.get_or_load(K[0], lambda: calls.append(1) or b"never")
    assert v == b"v" * 10 and type(v) is bytes and calls == [1]
    assert c.stats()["hits"] == before["hits"] + 1
    assert c._open_handles == 0


def test_short_exist_and_prefix_match_the_batch_form(make_cache):
    c = make_cache()
    fill(c, K[:3], size=16)
    for keys in ([K[0]], [K[0], K[5]], [K[5], K[1], K[2]], K[:4], K[:6]):
        assert c.exist(keys) == [k in K[:3] for k in keys]
    assert c.exist_prefix(K[:2]) == 2 and c.exist_prefix([K[0], K[4], K[1]]) == 1
    assert c.exist_prefix(K[:6]) == 3
    with pytest.raises(TypeError):
        c.exist([array.array("I", range(4))])


# ---- the hit path in C (ucmcache._hit): the same answers and counts as the full path

def _refs(c):
    from ucmcache.lowlevel import lib
    return [lib.ucm_load64(c._seg.base, c.layout.meta(s)) for s in range(c.capacity)]


def _counts(c):
    s = c.stats()
    return {k: s[k] for k in ("gets", "hits", "misses", "joins", "fast_hits", "loads_started")}


def test_c_hits_and_the_full_path_answer_and_count_alike(make_cache):
    """Each read form on plain ids (the C path) and on (id, 0) tuples (the Python path, the
    same keys): the same bytes, lengths and counter deltas.  Fails if the C path counted a
    hit twice, not at all, or as a get."""
    c = make_cache(slot_size=64)
    fill(c, K[:4])
    plain, tuples = K[:4], [(k, 0) for k in K[:4]]
    out = {}
    for name, keys in (("c", plain), ("py", tuples)):
        before = _counts(c)
        got = []
        with c.get(keys[0]) as h:
            assert h._token is None and not h.owner
            got.append(bytes(h.data))
        got.append(c.get_or_load(keys[1], lambda: b"never"))
        with c.get_many(keys) as hb:
            got += [bytes(hb.data(i)) for i in range(4)]
            rows = np.zeros((4, 64), np.uint8)
            got.append(hb.gather(rows).tolist())
            got.append(rows.tobytes())
        rows = np.zeros((4, 64), np.uint8)
        got.append(c.read_many(keys, rows).tolist())
        got.append(rows.tobytes())
        after = _counts(c)
        out[name] = (got, {k: after[k] - before[k] for k in after})
    assert out["c"] == out["py"]
    counts = out["c"][1]
    assert counts["fast_hits"] == counts["hits"] == counts["gets"] == 1 + 1 + 4 + 4
    assert counts["misses"] == counts["joins"] == counts["loads_started"] == 0
    assert set(_refs(c)) == {0} and c._open_handles == 0


def test_a_batch_with_one_cold_key_pins_nothing_twice_and_counts_once(make_cache):
    """The C step pins all Ready or nothing: a batch with a cold key in the middle goes to the
    full path, which elects its owner once; the Ready keys' pins are the full path's only."""
    c = make_cache(slot_size=64)
    fill(c, [K[0], K[2]])
    before = _counts(c)
    with c.get_many([K[0], K[1], K[2]]) as hb:
        assert hb.owner.tolist() == [False, True, False]
        assert hb._token is not None  # the full path's batch
        hb.data(1)[:2] = b"ok"
        hb.ready(1, 2)
        assert bytes(hb.data(1)) == b"ok" and bytes(hb.data(2)) == b"\x02" * 63
    after = _counts(c)
    assert after["misses"] - before["misses"] == 1
    assert after["fast_hits"] - before["fast_hits"] == 2
    assert after["loads_started"] - before["loads_started"] == 1
    assert set(_refs(c)) == {0} and c._open_handles == 0
    assert ucmcache.verify(c.uuid).ok


def test_dropped_c_handles_and_batches_unpin_when_collected(make_cache):
    import gc
    c = make_cache(slot_size=64)
    fill(c, K[:3])
    h = c.get(K[0])
    hb = c.get_many(K[:3])
    v, w = h.data, hb.data(1)
    assert h._token is None and hb._token is None  # both from the C path
    assert any(_refs(c)) and c._open_handles == 2
    cycle = [hb]
    cycle.append(cycle)  # a batch in a reference cycle: its finalizer runs in the collector
    del h, hb, cycle
    gc.collect()
    assert c._open_handles == 0
    # The views kept outlive their holders and keep their slots pinned (and so their bytes)
    assert bytes(v) == b"\x01" * 64 and bytes(w) == b"\x02" * 63 and c._exports == 2
    assert set(_refs(c)) != {0}
    del v, w
    assert set(_refs(c)) == {0} and c._exports == 0


def test_a_raise_inside_a_c_hit_with_block_unpins_and_propagates(make_cache):
    c = make_cache(slot_size=64)
    fill(c, K[:2])
    with pytest.raises(KeyError):
        with c.get(K[0]):
            raise KeyError("x")
    with pytest.raises(KeyError):
        with c.get_many(K[:2]):
            raise KeyError("y")
    assert set(_refs(c)) == {0} and c._open_handles == 0


def test_batch_positions_of_every_form_and_closed_batches(make_cache):
    c = make_cache(slot_size=64)
    fill(c, K[:3])
    with c.get_many(K[:3]) as hb:
        assert bytes(hb.data(-1)) == bytes(hb.data(np.int64(2))) == b"\x03" * 62
        for bad in (3, -4, True, 1.0, "0"):
            with pytest.raises(IndexError, match=r"\[0, 3\)"):
                hb.data(bad)
    hb.close()  # idempotent, in C
    with pytest.raises(HandleClosed):
        hb.data(0)
    with pytest.raises(HandleClosed):
        hb.gather(np.zeros((3, 64), np.uint8))


def test_c_paths_on_a_closed_cache_raise_not_attached(make_cache):
    c = make_cache(slot_size=64)
    fill(c, K[:1])
    c.close()
    for call in (lambda: c.get(K[0]), lambda: c.get_many([K[0]]),
                 lambda: c.get_or_load(K[0], lambda: b"x"),
                 lambda: c.read_many([K[0]], bytearray(64))):
        with pytest.raises(ucmcache.NotAttached):
            call()


def test_the_fields_the_c_paths_read_are_checked_not_trusted(make_cache):
    """The C paths read a handle's or batch's _cache only if it is a SlotCache, and a batch's
    _slots/_lens only as arrays of their item size; anything else goes to the Python path,
    which raises, never a crash."""
    c = make_cache(slot_size=64)
    fill(c, K[:1])
    with c.get(K[0]) as h, c.get_many([K[0]]) as hb:
        for o, read in ((h, lambda: h.data), (hb, lambda: hb.data(0))):
            o._cache = object()
            with pytest.raises(AttributeError):
                read()
            o._cache = c
        with pytest.raises(TypeError):
            hb._slots = np.zeros(1, np.int64)  # 8-byte items where slots are 4
    assert set(_refs(c)) == {0} and c._open_handles == 0


@pytest.mark.parametrize("call", ["get", "get_many", "read_many", "get_or_load", "data"])
def test_a_finalizer_that_closes_the_cache_inside_a_c_hit_is_survived(make_cache, call):
    """The C paths read the cache's context after their allocations, or check it did not change
    across them (and data re-checks the handle after making its view): a collection run by an
    allocation may close the cache.
    With the collector's threshold at 1 the next tracked allocation collects a cycle whose
    finalizer closes the cache.  Fails (segfault) if a C path read the context first."""
    import gc
    c = make_cache(slot_size=64)
    fill(c, K[:2])
    h = c.get(K[0]) if call == "data" else None

    ran = []

    class Closer:
        def __init__(self):
            self.me = self  # a cycle: only the collector frees it

        def __del__(self):
            ran.append(1)
            if h is not None:
                h.close()
            c._open_handles = 0
            c.close()

    calls = {"get": lambda: c.get(K[1]), "get_many": lambda: c.get_many(K[:2]),
             "read_many": lambda: c.read_many(K[:2], np.zeros((2, 64), np.uint8)),
             "get_or_load": lambda: c.get_or_load(K[1], lambda: b"x"),
             "data": lambda: h.data}
    gc.collect()
    old = gc.get_threshold()
    Closer()
    gc.set_threshold(1)
    try:
        with pytest.raises((ucmcache.NotAttached, HandleClosed)):
            calls[call]()
    finally:
        gc.set_threshold(*old)
    assert ran


def test_close_waits_for_another_threads_copy_out_of_the_segment(make_cache, gate, monkeypatch):
    """read_many copies with the GIL released; a close() in another thread meanwhile must not
    free the context or unmap the segment under it.  The reader is held inside the core call
    (gate at after_pin); close() gives up after its (shortened) wait with UcmError, and works
    once the copy returned.  Fails if close() went ahead (a use after free)."""
    import threading
    import ucmcache.core.cache as cache_mod
    c = make_cache(slot_size=64)
    fill(c, K[:1])
    g = gate()
    c._arm("after_pin", "gate", g)
    out = np.zeros((1, 64), np.uint8)
    got = []
    t = threading.Thread(target=lambda: got.append(c.read_many([K[0]], out)))
    t.start()
    try:
        g.wait_arrived()
        monkeypatch.setattr(cache_mod, "DETACH_WAIT", 0.05)
        with pytest.raises(UcmError, match="still copying"):
            c.close()
        assert c._ctx is not None
    finally:
        g.release()
        t.join(10)
    assert not t.is_alive() and got[0].tolist() == [64] and bytes(out[0]) == b"\x01" * 64
    c.close()
    assert c._ctx is None


def test_an_all_hit_batch_gathers_into_a_tensor_and_guards_its_positions(make_cache):
    """A batch made in C has no cffi arrays of its own: gather into a CPU tensor (not a
    buffer: the full path) and close after a raise still work, and its position count cannot
    be set past its arrays."""
    torch = pytest.importorskip("torch")
    c = make_cache(slot_size=64)
    fill(c, K[:3])
    with c.get_many(K[:3]) as hb:
        assert hb._token is None
        t = torch.zeros((3, 64), dtype=torch.uint8)
        assert hb.gather(t).tolist() == [64, 63, 62]
        assert bytes(t[1, :63].numpy()) == b"\x02" * 63
        for bad in (-1, 4):
            with pytest.raises(ValueError, match=r"_n must be in \[0, 3\]"):
                hb._n = bad
    assert set(_refs(c)) == {0} and c._open_handles == 0


def test_a_close_that_raised_in_free_rank_goes_on_when_called_again(make_cache, monkeypatch):
    import ucmcache.core.cache as cache_mod
    c = make_cache(slot_size=64)
    fill(c, K[:1])
    real, calls = cache_mod.free_rank, []

    def flaky(*a):
        calls.append(1)
        if len(calls) == 1:
            raise UcmError("stripe held (test)")
        return real(*a)

    monkeypatch.setattr(cache_mod, "free_rank", flaky)
    with pytest.raises(UcmError, match="test"):
        c.close()
    with pytest.raises(ucmcache.NotAttached):
        c.get(K[0])
    c.close()
    assert len(calls) == 2
    other = ucmcache.SlotCache.attach(c.uuid)
    try:
        assert other.rank == c.rank  # the rank was freed by the second close
    finally:
        other.close()


def test_a_cold_plain_key_is_counted_once_and_loaded_once_as_a_tuple_key_is(make_cache):
    """A plain id's miss goes from the C look straight to the slow path (the C step counted
    the request): the counters move as for the same miss through the Python path."""
    c = make_cache(slot_size=64)
    deltas = []
    for key in (K[5], (K[6], 0)):
        before = _counts(c)
        with c.get(key) as h:
            assert h.owner and h._token is not None
            h.data[:1] = b"z"
            h.ready(1)
        with c.get(key) as h:
            assert bytes(h.data) == b"z"
        after = _counts(c)
        deltas.append({k: after[k] - before[k] for k in after})
    assert deltas[0] == deltas[1]
    assert deltas[0]["gets"] == 2 and deltas[0]["misses"] == 1 and deltas[0]["loads_started"] == 1
    assert set(_refs(c)) == {0} and c._open_handles == 0


def test_a_finalizer_whose_full_close_is_cut_short_still_uncounts_its_holder(make_cache,
                                                                             monkeypatch):
    """A signal handler can raise at the entry of the Python _close a finalizer calls: the
    holder goes anyway, its token drops the pin and fails the load, and the open count must not
    keep it (close() would then search for it).  _close raising stands in for the handler.
    Fails if the finalizer left the count at 1."""
    import gc
    import ucmcache.core.handle as handle_mod
    c = make_cache(slot_size=64)
    h = c.get(K[7])
    assert h.owner and h._token is not None and c._open_handles == 1

    def cut_short(self, message):
        raise KeyError("interrupted at entry")

    monkeypatch.setattr(handle_mod.Handle, "_close", cut_short)
    del h
    gc.collect()
    monkeypatch.undo()
    assert c._open_handles == 0
    assert set(_refs(c)) == {0}  # the token dropped the owner's pin
    with c.get(K[7]) as again:   # and failed its load: the next get owns the key
        assert again.owner
        again.ready(1)
