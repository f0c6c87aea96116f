"""A view, a copy and a destination as the hit path promises them: a view never shows another
key's bytes (after its pin, its handle or its cache is gone), a batch's copies hold what they
copy while another thread closes it, key lists are read once, destinations are checked by format
and shape, and a view region is exported once.  Each test failed (or crashed) on the code before
the promise was kept."""
import gc
import sys
import threading

import numpy as np
import pytest

from ucmcache import SlotCache

from view_helpers import K, _churn, _refs, payload, put


# ---------------------------------------------------------------- 1. views outlive their pin

def _derived(v):
    torch = pytest.importorskip("torch")
    return {"slice": v[2:10], "memoryview": memoryview(v), "cast": v.cast("B"),
            "toreadonly": v.toreadonly(), "numpy": np.frombuffer(v, np.uint8),
            "torch": torch.frombuffer(v, dtype=torch.uint8)}


@pytest.mark.parametrize("holder", ["handle", "batch"])
def test_every_view_made_from_data_keeps_its_keys_bytes_after_close_and_churn(make_cache, holder):
    c = make_cache(max_ranks=1, slots_per_rank=3, slot_size=64)
    put(c, K[0])
    if holder == "handle":
        with c.get(K[0]) as h:
            kept = _derived(h.data)
    else:
        with c.get_many([K[0]]) as hb:
            kept = _derived(hb.data(0))
    _churn(c, K[1:12])  # a tiny segment: every slot not pinned is reused many times
    want = payload(K[0], 64)
    for name, view in kept.items():
        got = bytes(view.numpy()) if name == "torch" else bytes(view)
        assert got == (want[2:10] if name == "slice" else want), name
    assert c._exports >= 1
    del kept, view
    gc.collect()
    assert c._exports == 0 and set(_refs(c)) == {0}


def test_a_view_cannot_be_reexported_once_its_pin_is_gone(make_cache):
    c = make_cache(slot_size=64)
    put(c, K[0])
    with c.get(K[0]) as h:
        exporter = h.data.obj  # the SlotBuffer behind the view
    gc.collect()
    assert c._exports == 0
    with pytest.raises(BufferError, match="no longer pinned"):
        memoryview(exporter)


# ---------------------------------------------------------------- 2. gather vs close

def test_gather_holds_what_it_copies_while_another_thread_closes_the_batch(make_cache, gate):
    c = make_cache(max_ranks=1, slots_per_rank=3, slot_size=4096)
    put(c, K[0])
    hb = c.get_many([K[0]])
    out = np.zeros((1, 4096), np.uint8)
    g = gate()
    c._arm("before_copy", "gate", g)
    got = []
    t = threading.Thread(target=lambda: got.append(hb.gather(out)))
    t.start()
    try:
        g.wait_arrived()        # the copy's lengths are read, nothing copied yet
        hb.close()              # another thread closes the batch meanwhile ...
        c._arm("before_copy", "none")
        _churn(c, K[1:10])      # ... and loads enough to reuse every unpinned slot
    finally:
        g.release()
        t.join(30)
    assert not t.is_alive() and got[0].tolist() == [4096]
    assert bytes(out[0]) == payload(K[0], 4096)
    assert set(_refs(c)) == {0}


# ---------------------------------------------------------------- 3. key lists read once

def test_a_key_list_changed_between_its_check_and_its_use_gives_the_old_keys_answers(make_cache):
    """A profile hook stands in for another thread: it replaces keys[0] with a longer bytes
    object right before the ids are joined (the window between the check and the join)."""
    c = make_cache(slot_size=64)
    put(c, K[0]), put(c, K[1])
    keys = [K[0], K[1], K[30]]  # the last one is cold
    swapped = []

    def hook(frame, event, arg):
        if event == "c_call" and getattr(arg, "__name__", "") == "join" and not swapped:
            swapped.append(keys[0])
            keys[0] = K[1] + K[1]

    for call in (lambda: c.exist(keys[:]), lambda: c.exist_prefix(keys)):
        keys[0] = K[0]
        swapped.clear()
        sys.setprofile(hook)
        try:
            r = call()
        finally:
            sys.setprofile(None)
        assert r in ([True, True, False], 2)
    keys[0] = K[0]
    swapped.clear()
    sys.setprofile(hook)
    try:
        hb = c.get_many(keys, timeout=5)  # a timeout: the full path, whose ids are joined
    finally:
        sys.setprofile(None)
    with hb:
        assert swapped  # the hook ran inside the call
        assert bytes(hb.data(0)) == payload(K[0], 64) and bytes(hb.data(1)) == payload(K[1], 64)
        assert hb.owner.tolist() == [False, False, True]


@pytest.mark.parametrize("how", ["read_many", "read_many_full", "gather", "gather_full"])
def test_a_2d_out_is_rows_by_its_first_dimension(make_cache, how):
    c = make_cache(slot_size=4096)
    keys = K[:8]
    for k in keys:
        put(c, k)
    out = np.full((64, 4096), 0xEE, np.uint8)  # a staging buffer sized for the largest batch
    if how.startswith("read_many"):
        lens = c.read_many(keys if how == "read_many" else [(k, 0) for k in keys], out)
    else:
        with c.get_many(keys) as hb:
            lens = hb.gather(out) if how == "gather" else hb._gather_full(out)
    assert lens.tolist() == [4096] * 8
    for i, k in enumerate(keys):
        assert bytes(out[i]) == payload(k, 4096)
    assert (out[8:] == 0xEE).all()
    # a 1-D buffer keeps n equal rows
    flat = np.zeros(8 * 4096, np.uint8)
    assert c.read_many(keys, flat).tolist() == [4096] * 8
    assert bytes(flat[4096:8192]) == payload(keys[1], 4096)
    # fewer rows than keys, and rows too small for a payload: errors, nothing copied
    with pytest.raises(ValueError, match="7 rows"):
        c.read_many(keys, np.zeros((7, 4096), np.uint8))
    small = np.full((8, 100), 0xEE, np.uint8)
    with pytest.raises(ValueError, match="more than a row"):
        c.read_many(keys, small)
    assert (small == 0xEE).all()
    with c.get_many(keys) as hb, pytest.raises(ValueError, match="more than a row"):
        hb.gather(small)
    assert (small == 0xEE).all()


def test_rows_of_other_item_types_take_the_bytes_and_torch_rows_follow_the_same_rule(make_cache):
    torch = pytest.importorskip("torch")
    c = make_cache(slot_size=64)
    put(c, K[0]), put(c, K[1])
    out = np.zeros((4, 16), np.float32)  # 64-byte rows of floats
    assert c.read_many([K[0], K[1]], out).tolist() == [64, 64]
    assert out[1].tobytes() == payload(K[1], 64)
    t = torch.zeros((5, 64), dtype=torch.uint8)
    with c.get_many([K[0], K[1]]) as hb:
        assert hb.gather(t).tolist() == [64, 64]
    assert bytes(t[1].numpy()) == payload(K[1], 64)


@pytest.mark.parametrize("how", ["read_many", "read_many_full", "gather"])
def test_an_object_array_is_refused_not_written_over(make_cache, how):
    c = make_cache(slot_size=64)
    put(c, K[0])
    out = np.empty((1, 8), object)
    with pytest.raises(TypeError, match="format 'O'"):
        if how == "read_many":
            c.read_many([K[0]], out)
        elif how == "read_many_full":
            c.read_many([(K[0], 0)], out)
        else:
            with c.get_many([K[0]]) as hb:
                hb.gather(out)
    assert out[0, 0] is None  # untouched, and the process alive


def test_batch_data_makes_one_view_per_position(make_cache):
    c = make_cache(slot_size=64)
    put(c, K[0])
    with c.get_many([K[0], K[0]]) as hb:
        views = {id(hb.data(i % 2)) for i in range(1000)}
        assert len(views) == 2 and c._exports == 1  # one exporter holds the batch's slots
    assert c._exports == 0


def test_a_batchs_data_region_is_not_exported_again(make_cache):
    c = make_cache(slot_size=64)
    put(c, K[0])
    with c.get_many([K[0]]) as hb:
        v = hb.data(0)
        with pytest.raises(BufferError, match="not exported again"):
            memoryview(v.obj)
        assert bytes(v) == payload(K[0], 64)


def test_a_view_another_finalizer_brings_back_keeps_its_keys_bytes(uuid):
    import weakref  # noqa: F401
    c = SlotCache.create(uuid, max_ranks=2, slots_per_rank=2, slot_size=64)
    other = None
    try:
        with c.get(K[0]) as h:
            h.data[:8] = b"AAAAAAAA"
            h.ready(8)
        with c.get(K[0]) as h:
            v = h.data
        slot = h.slot
        stash = []

        class Resurrect:
            def __del__(self):
                stash.append(self.v)

        r = Resurrect()
        r.v = v
        c.kept = [r, v]
        del v, r, h
        other = SlotCache.attach(uuid)
        with pytest.warns(ResourceWarning):
            del c
            gc.collect()
        (v,) = stash
        reused = False
        for i in range(64):
            with other.get(bytes([i + 50]) * 16) as h2:
                if h2.owner:
                    h2.data[:8] = b"BBBBBBBB"
                    h2.ready(8)
                    reused |= h2.slot == slot
            if reused:
                break
        assert reused, "the test never reused the view's slot"
        assert bytes(v) == b"AAAAAAAA", "a view brought back saw another key's bytes"
        del v, stash[:]
        gc.collect()
    finally:
        if other is not None:
            other.close()
        SlotCache.unlink(uuid)
