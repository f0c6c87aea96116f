"""A fork while a cache is in use: the child gets no new view and its inherited views keep their
bytes, each forking thread drops only its own holds, a close waits for a fork's parent side, a
failed before-fork hook leaves the cache closable, and a child's first attach does not wait for
the parent's threads."""
import os
import threading

import pytest

from ucmcache import NotAttached, SlotCache, UcmError

from view_helpers import K, _churn, _fds, _refs, payload, put


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
