"""What the hit path promises a reader, broken on purpose: a view never shows another
key's bytes, copies hold what they copy, key lists are read once, destinations are checked by
format and shape, an owner's exit publishes before any Python runs, and nothing a cache holds
leaks.  Each test failed (or crashed) on the code before these promises were kept."""
import gc
import os
import sys
import threading
import warnings

import numpy as np
import pytest

import ucmcache
from ucmcache import HandleClosed, LoadFailed, NotAttached, SlotCache, UcmError

K = [bytes([i]) * 16 for i in range(1, 40)]


def payload(k, n):
    """A key's bytes: its first byte and the position, so another key's bytes never match."""
    return bytes((k[0] * 7 + i) & 0xFF for i in range(n))


def put(c, k, n=None):
    n = c.slot_size if n is None else n
    return c.get_or_load(k, lambda: payload(k, n))


def _refs(c):
    from ucmcache.lowlevel import lib
    return [lib.ucm_load64(c._seg.base, c.layout.meta(s)) for s in range(c.capacity)]


def _churn(c, keys):
    """Load keys until every unpinned slot of a tiny segment has been reused."""
    for k in keys:
        put(c, k)


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


# ---------------------------------------------------------------- 4. forks

def test_a_forked_child_gets_no_new_view_and_its_inherited_view_keeps_its_bytes(make_cache):
    c = make_cache(max_ranks=1, slots_per_rank=3, slot_size=64)
    put(c, K[0])
    h = c.get(K[0])
    v = h.data
    r1, w1 = os.pipe()
    r2, w2 = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: waits until the parent dropped its pin and reused the slot
        code = 1
        try:
            os.read(r1, 1)
            try:
                h.data
            except NotAttached:
                code = 0 if bytes(v) == payload(K[0], 64) else 2
        finally:
            os._exit(code)
    h.close()
    del v
    assert set(_refs(c)) == {0}  # the parent holds nothing: the slot may be reused
    _churn(c, K[1:12])
    os.write(w1, b"x")
    _, status = os.waitpid(pid, 0)
    for fd in (r1, w1, r2, w2):
        os.close(fd)
    assert os.waitstatus_to_exitcode(status) == 0, "the child saw another key's bytes"


# ---------------------------------------------------------------- 5, 6. destinations

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


# ---------------------------------------------------------------- 7, 8. an owner's exit

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


def test_batch_data_makes_one_view_per_position(make_cache):
    c = make_cache(slot_size=64)
    put(c, K[0])
    with c.get_many([K[0], K[0]]) as hb:
        views = {id(hb.data(i % 2)) for i in range(1000)}
        assert len(views) == 2 and c._exports == 1  # one exporter holds the batch's slots
    assert c._exports == 0


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


def test_a_batchs_data_region_is_not_exported_again(make_cache):
    c = make_cache(slot_size=64)
    put(c, K[0])
    with c.get_many([K[0]]) as hb:
        v = hb.data(0)
        with pytest.raises(BufferError, match="not exported again"):
            memoryview(v.obj)
        assert bytes(v) == payload(K[0], 64)


# ---------------------------------------------------------------- review holes: cycles, forks

def _fds():
    return len(os.listdir("/proc/self/fd"))


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


def test_two_threads_forking_at_once_each_drop_only_their_own_holds(make_cache):
    """The fork hooks of two threads interleaved (A's before, B's before, B's after, A's
    after), run without a child: each parent side finds no child and goes on at once."""
    from ucmcache.core import cache as _cache
    c = make_cache(max_ranks=1, slots_per_rank=4, slot_size=64)
    put(c, K[0])
    h = c.get(K[0])
    a_held, b_done = threading.Event(), threading.Event()
    errors = []

    def thread_a():
        try:
            _cache._before_fork()
            a_held.set()
            assert b_done.wait(10)
            _cache._after_fork_in_parent()
        except BaseException as e:
            errors.append(e)

    def thread_b():
        try:
            assert a_held.wait(10)
            _cache._before_fork()
            _cache._after_fork_in_parent()
        except BaseException as e:
            errors.append(e)
        finally:
            b_done.set()
            a_held.set()

    fds = _fds()
    threads = [threading.Thread(target=thread_a), threading.Thread(target=thread_b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert not errors and not any(t.is_alive() for t in threads)
    h.close()
    assert set(_refs(c)) == {0}, "a fork's holds were never dropped"
    assert _fds() == fds, "a fork's pipe was left open"


def test_close_waits_for_a_forks_parent_side_before_freeing_the_context(make_cache,
                                                                          monkeypatch):
    """A fork holds the pins of a view across the fork; the view goes and another thread
    closes while the parent still waits for its child: close() must not free the context the
    parent side will drop its holds through."""
    from ucmcache.core import cache as _cache
    c = make_cache(max_ranks=1, slots_per_rank=4, slot_size=64)
    put(c, K[0])
    with c.get(K[0]) as h:
        v = h.data
    _cache._before_fork()  # the forking thread's before hook: holds the view's slot
    try:
        del v
        monkeypatch.setattr(_cache, "DETACH_WAIT", 0.05)
        monkeypatch.setattr(_cache, "FORK_HOLD_WAIT", 0.05)
        with pytest.raises(UcmError, match="fork was still waiting"):
            c.close()
        assert c.get_or_load(K[0], lambda: b"x") == payload(K[0], 64)  # still whole
    finally:
        _cache._after_fork_in_parent()  # no child: it goes on at once, dropping its holds
    assert set(_refs(c)) == {0}
    c.close()


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


def test_a_fork_whose_before_hook_fails_leaves_the_cache_closable(make_cache, monkeypatch):
    """os.pipe() failing in the before-fork hook (EMFILE at the fd limit) must leave no hold and
    no fork count behind: close() then works."""
    from ucmcache.core import cache as _cache
    c = make_cache(max_ranks=1, slots_per_rank=4, slot_size=64)
    put(c, K[0])
    with c.get(K[0]) as h:
        v = h.data

    def no_pipe():
        raise OSError(24, "Too many open files")

    monkeypatch.setattr(_cache.os, "pipe", no_pipe)
    with pytest.raises(OSError):
        _cache._before_fork()
    monkeypatch.undo()
    _cache._after_fork_in_parent()  # what the fork's parent runs after a failed before-hook
    del v
    assert c._forks_out() == 0 and set(_refs(c)) == {0}


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


def test_a_forked_childs_first_attach_does_not_wait_for_the_parents_threads(make_cache):
    """A fork while another thread is inside note_cache (holding the lock of the segment
    ids, as an attach or create does): the child's attach takes a lock of its own (before: it
    waited for ever on the parent's copy, held by a thread the child does not have; here
    bounded by SIGALRM, exit code 3)."""
    import signal
    from ucmcache.core import slots as _slots
    c = make_cache(max_ranks=3, slots_per_rank=4, slot_size=64)
    with _slots._segment_ids_lock:                 # another thread inside note_cache
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                signal.signal(signal.SIGALRM, lambda *a: os._exit(3))
                signal.alarm(10)
                SlotCache.attach(c.uuid).close()
                code = 0
            finally:
                os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "the child's attach hung on the lock"


def test_a_fork_as_another_thread_closes_a_cache_holds_the_other_caches_pins(make_cache):
    """The before-fork hook lists the live caches, and another thread's close of one of them
    ends (detached: its views released) before the hook reaches it: the hook skips that cache
    and holds the others' pins (before: ValueError on the released view, out of the hook,
    so the caches after it in the list were not held across the fork)."""
    from ucmcache.core import cache as _cache
    c = make_cache(max_ranks=2, slots_per_rank=4, slot_size=64)
    put(c, K[0])
    h = c.get(K[0])
    gone = SlotCache.attach(c.uuid)
    gone.close()
    _cache._live_caches.add(gone)        # still in the hook's list as its close ended
    try:
        _cache._before_fork()
        assert [hold[0] for hold in _cache._fork_state.holds] == [c]
    finally:
        _cache._live_caches.discard(gone)
        _cache._after_fork_in_parent()
    h.close()
    assert c._forks_out() == 0 and set(_refs(c)) == {0}
