"""Closing and collecting a cache: an owner's exit publishes (or fails its load) before any Python
runs, close refuses while a view is alive and can be retried, stops the cache's own prefetcher,
checks again once it took the context away, and a cache collected without close (or with a view
kept on it) frees its rank; nothing a cache holds leaks."""
import gc
import sys
import threading

import numpy as np
import pytest

from ucmcache import HandleClosed, NotAttached, SlotCache, UcmError

from view_helpers import K, _fds, _refs, payload, put


def _other_gets_the_value(uuid, key):
    """Another attachment's get_or_load: the value when the owner's load was failed (a new
    owner is elected), TimeoutError when it was left Loading."""
    o = SlotCache.attach(uuid)
    try:
        return o.get_or_load(key, lambda: b"recomputed", timeout=2)
    finally:
        o.close()


@pytest.mark.parametrize("holder", ["handle", "batch"])
def test_an_owners_exit_cut_short_by_a_signal_handler_still_fails_its_load(make_cache, uuid,
                                                                           holder):
    """A raising handler at the first Python code of the exit (a profile hook raises there,
    as a signal handler would at that function's entry)."""
    c = make_cache(slot_size=64)

    class Interrupt(Exception):
        pass

    def hook(frame, event, arg):
        if event == "call" and frame.f_code.co_name in ("_exit_slow", "_close", "_after_drop"):
            sys.setprofile(None)
            raise Interrupt()

    with pytest.raises(Interrupt):
        if holder == "handle":
            with c.get(K[5]) as h:
                assert h.owner
                sys.setprofile(hook)
        else:
            with c.get_many([K[5]]) as hb:
                assert hb.owner.all()
                sys.setprofile(hook)
    sys.setprofile(None)
    assert _other_gets_the_value(uuid, K[5]) == b"recomputed"


def test_a_batchs_owner_array_is_a_copy_close_does_not_trust(make_cache, uuid):
    c = make_cache(slot_size=64)
    hb = c.get_many([K[6]])
    hb.owner[0] = False  # a copy: the batch still owns the load
    assert hb.owner.tolist() == [True]
    hb.close()
    assert _other_gets_the_value(uuid, K[6]) == b"recomputed"


# ---------------------------------------------------------------- 9-12. leaks

def test_a_cache_collected_without_close_frees_its_rank(uuid):
    c = SlotCache.create(uuid, max_ranks=1, slots_per_rank=4, slot_size=64)
    try:
        put(c, K[0])
        with pytest.warns(ResourceWarning, match="without close"):
            del c
            gc.collect()
        again = SlotCache.attach(uuid)  # the only rank is free again
        assert again.get_or_load(K[0], lambda: b"x") == payload(K[0], 64)
        again.close()
    finally:
        SlotCache.unlink(uuid)


def test_close_with_a_view_alive_refuses_before_it_frees_anything_and_can_be_retried(uuid):
    c = SlotCache.create(uuid, max_ranks=1, slots_per_rank=4, slot_size=64)
    put(c, K[0])
    with c.get(K[0]) as h:
        arr = np.frombuffer(h.data, np.uint8)
    with pytest.raises(UcmError, match="1 view"):
        c.close()
    assert c.get_or_load(K[0], lambda: b"x") == payload(K[0], 64)  # still attached, whole
    assert bytes(arr) == payload(K[0], 64)
    del arr
    c.close()
    again = SlotCache.attach(uuid)  # its rank, mapping and fds were freed
    again.close()
    SlotCache.unlink(uuid)


def test_close_stops_the_caches_own_prefetcher_mid_load_before_counting_handles(make_cache,
                                                                                 monkeypatch):
    from ucmcache.core.ring import Prefetcher
    c = make_cache(slot_size=64)
    entered, release = threading.Event(), threading.Event()

    def loader(key):
        entered.set()
        assert release.wait(30)
        return b"v"

    stop = Prefetcher.stop

    def stop_then_let_the_load_finish(self, *a, **kw):
        release.set()  # the load ends only once close() has begun stopping the prefetcher
        return stop(self, *a, **kw)

    monkeypatch.setattr(Prefetcher, "stop", stop_then_let_the_load_finish)
    c.prefetcher(loader)
    c.prefetch([K[9]])
    assert entered.wait(30)
    c.close()  # the prefetcher's load holds a handle: it stops first, then close goes on
    assert c._ctx is None


def test_close_checks_again_after_it_took_the_context_away(make_cache, monkeypatch):
    """A view made by another thread between close()'s first check and its detach (played by
    a hook on _detach_ctx) makes close() give the context back and refuse: nothing freed."""
    c = make_cache(slot_size=64)
    put(c, K[0])
    kept, done = [], []
    detach = type(c)._detach_ctx

    def view_then_detach(self):
        if not done:
            done.append(1)
            with self.get(K[0]) as h:
                kept.append(h.data[0:8])
        return detach(self)

    monkeypatch.setattr(type(c), "_detach_ctx", view_then_detach)
    with pytest.raises(UcmError, match="1 view"):
        c.close()
    assert c._ctx is not None and bytes(kept[0]) == payload(K[0], 8)
    assert c.get_or_load(K[0], lambda: b"x") == payload(K[0], 64)
    kept.clear()
    c.close()
    assert c._ctx is None


@pytest.mark.parametrize("holder", ["handle", "batch"])
def test_a_view_kept_on_its_own_cache_is_collected_with_it_and_frees_its_rank(uuid, holder):
    import weakref
    c = SlotCache.create(uuid, max_ranks=1, slots_per_rank=4, slot_size=64)
    fds = _fds()
    try:
        put(c, K[0])
        if holder == "handle":
            with c.get(K[0]) as h:
                c.kept = h.data[2:10]  # a cycle: cache -> view -> its exporter -> cache
        else:
            with c.get_many([K[0]]) as h:
                c.kept = [h.data(0)]
        del h
        alive = weakref.ref(c)
        with pytest.warns(ResourceWarning, match="without close"):
            del c
            gc.collect()
        assert alive() is None, "the cache and its view were never collected"
        assert _fds() <= fds - 2, "the collected cache's lock and shm fds stayed open"
        again = SlotCache.attach(uuid)  # the only rank is free again, the slot unpinned
        assert set(_refs(again)) == {0}
        assert again.get_or_load(K[0], lambda: b"x") == payload(K[0], 64)
        again.close()
    finally:
        SlotCache.unlink(uuid)


@pytest.mark.parametrize("holder", ["handle", "batch"])
def test_an_owners_close_cut_short_after_its_drop_leaves_no_stale_owned_slot(make_cache, holder,
                                                                             monkeypatch):
    """A signal handler's exception at the first line of _after_drop (the Python after a close's
    C drop) must not leave the slot in this thread's owned set: a later wait here on the slot,
    Loading then for another thread's load, would refuse as 'loading this key itself'."""
    from ucmcache.core import handle as _handle
    c = make_cache(max_ranks=1, slots_per_rank=1, slot_size=64)  # one slot: reused
    h = c.get(K[0]) if holder == "handle" else c.get_many([K[0]])
    slot = h.slot if holder == "handle" else int(h._slots[0])
    assert (h.owner if holder == "handle" else h.owner[0])

    def interrupted(self):
        raise KeyboardInterrupt("a signal handler, at the first line of _after_drop")

    cls = _handle.Handle if holder == "handle" else _handle.HandleBatch
    monkeypatch.setattr(cls, "_after_drop", interrupted)
    with pytest.raises(KeyboardInterrupt):
        h.close()
    monkeypatch.undo()
    got = []
    t = threading.Thread(target=lambda: got.append(c.get(K[0])))  # its own owned set
    t.start()
    t.join(10)
    theirs = got[0]
    try:
        assert theirs.owner and theirs.slot == slot  # the key's next load, in the same slot
        with c.get(K[0], timeout=5) as mine:
            assert not mine.owner
            with pytest.raises(TimeoutError):  # a wait, not a refusal: nobody publishes
                mine.wait(timeout=0.01)
        theirs.data[:4] = b"abcd"
        theirs.ready(4)
    finally:
        theirs.close()
    assert c.get_or_load(K[0], lambda: b"x") == b"abcd"


def test_a_finalizer_that_closes_everything_while_a_view_is_made_leaves_no_freed_context(uuid):
    """Making a view allocates a collected object, and a collection there may run a finalizer
    that closes the handle and the cache: the view's maker must not go on with the freed
    context (a use-after-free under valgrind before)."""
    c = SlotCache.create(uuid, max_ranks=2, slots_per_rank=2, slot_size=64)
    try:
        with c.get(K[0]) as h:
            h.data[:4] = b"AAAA"
            h.ready(4)
        h = c.get(K[0])  # a hit: its view not made yet
        ran = []

        class Closer:
            def __del__(self):
                self.h.close()
                self.c.close()
                ran.append(c._ctx)

        threshold = gc.get_threshold()
        gc.collect()
        gc.disable()
        try:
            g = Closer()
            g.h, g.c, g.me = h, c, g  # a young cycle
            junk = [[] for _ in range(50)]  # noqa: F841  (generation 0 well over threshold)
            del g
            gc.set_threshold(1)
            gc.enable()
            try:
                v = h.data
            except (HandleClosed, NotAttached):
                v = None
        finally:
            gc.set_threshold(*threshold)
            gc.enable()
        assert ran == [None], "the finalizer never ran inside the view's allocation"
        assert v is None or bytes(v) == b"AAAA"
    finally:
        SlotCache.unlink(uuid)
