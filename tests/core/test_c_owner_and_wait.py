"""get()'s owner path and a reader's wait, each made in C (DESIGN 4.4, 5.8): an owner handle made
in C publishes in C and, dropped, fails its load; a reader's wait is one C step counted as the
full path's, ends at its deadline or at a signal as the full path's does, and counts its time
once; a stale finish never finishes the next load on its slot; a dead owner is recovered."""
import signal

import numpy as np
import pytest

import ucmcache
from ucmcache import SlotCache, UcmError
from ucmcache.core.verify import slot_fields, snapshot

import workers
from cold_load_helpers import K, c_and_full, counters, warm


def run_owner_ops(c, kw):
    """get()'s owner path and put() through either path (kw as run_ops')."""
    out = []
    for k in K[:30]:                                   # cold owners, evicting
        with c.get(k, **kw) as h:
            out.append((h.owner, h.state))
            h.data[:16] = k
            h.ready(16)
            out.append((h.state, bytes(h.data)))
    for k in K[25:30]:                                 # hits
        with c.get(k, **kw) as h:
            out.append((h.owner, bytes(h.data)))
    with c.get(K[60], **kw) as h:                      # closed without ready(): Failed
        out.append(h.owner)
    with pytest.raises(KeyError):
        with c.get(K[61], **kw) as h:                  # the with-block raised: Failed
            raise KeyError("gone")
    with c.get(K[62], **kw) as h:
        h.fail("no")
    with c.get(K[63], **kw) as h:
        h.ready()                                      # the whole slot
        with pytest.raises(UcmError, match="already published"):
            h.ready(1)
    for bad, err in [(-1, ValueError), (65, ValueError), (True, TypeError), (1.0, TypeError)]:
        with c.get(K[64], **kw) as h:
            with pytest.raises(err):
                h.ready(bad)
    with c.get(K[65], **kw) as h:                      # a keyword
        h.data[:1] = b"k"
        h.ready(nbytes=1)
        out.append(bytes(h.data))
    out.append(c.put(K[70], b"put", **kw))
    out.append(c.put(K[70], b"again", **kw))
    out.append(c.get_or_load(K[70], lambda: b"never"))
    return out


def test_gets_owner_path_counts_what_the_full_path_counts(uuid):
    with c_and_full(uuid, slots_per_rank=16, slot_size=64, max_ranks=1) as (a, b):
        warm(a)
        warm(b)
        assert run_owner_ops(a, {}) == run_owner_ops(b, {"timeout": 30.0})
        ca, cb = counters(a), counters(b)
        assert ca == cb
        assert ca["loads_failed"] == 7 and ca["load_count"] == ca["loads_started"] - 6  # (abandons: unobserved)
        assert a.entry_count() == b.entry_count() and a.size_bytes() == b.size_bytes()
        assert a._open_handles == 0 and ucmcache.verify(a.uuid).ok


def test_an_owner_handle_made_in_c_publishes_in_c(make_cache, monkeypatch):
    c = warm(make_cache(slots_per_rank=8, slot_size=64, max_ranks=1))
    for name in ("_get_missed", "_pin_handle", "_get_full"):
        monkeypatch.setattr(SlotCache, name, lambda *a, **k: pytest.fail("the full path ran"))
    monkeypatch.setattr(ucmcache.Handle, "_ready_full", lambda *a: pytest.fail("Python ready"))
    monkeypatch.setattr(ucmcache.Handle, "_after_drop", lambda *a: pytest.fail("Python close"))
    with c.get(K[3]) as h:
        assert h.owner and h._token is None
        arr = np.frombuffer(h.data, dtype=np.uint8)    # an export of the writable view
        arr[:4] = 7
        h.ready(4)
        assert bytes(h.data) == b"\x07" * 4
    assert arr[0] == 7                                 # the array keeps its own pin, and bytes
    del arr
    assert c.get_or_load(K[3], lambda: b"never") == b"\x07" * 4


def test_an_owner_handle_made_in_c_and_dropped_fails_its_load(make_cache, procs, gate):
    import gc
    c = warm(make_cache(slots_per_rank=8, slot_size=64, max_ranks=2))
    joined = gate()
    h = c.get(K[5])
    assert h.owner
    p, q = procs.start(workers.wait_for_load, c.uuid, K[5], joined.path, 30)
    joined.wait_value(1)
    del h
    gc.collect()
    assert procs.result(q) == ("failed", "the owner closed its handle without calling ready()")
    assert c._open_handles == 0


# ---------------------------------------------------------------- the wait in C

def test_a_readers_wait_is_one_c_step_and_counts_as_the_full_paths(make_cache, monkeypatch):
    import threading
    c = warm(make_cache(slots_per_rank=8, slot_size=64, max_ranks=1))
    monkeypatch.setattr(ucmcache.Handle, "_wait_full", lambda *a: pytest.fail("Python wait"))
    owner = c.get(K[20])
    assert owner.owner
    got, joined = [], threading.Event()

    def reader():
        with c.get(K[20]) as h:                       # a join (the full path makes it)
            assert not h.owner
            joined.set()
            got.append(bytes(h.wait(30.0).data))
    t = threading.Thread(target=reader)
    t.start()
    assert joined.wait(30)
    owner.data[:2] = b"ok"
    owner.ready(2)
    owner.close()
    t.join(30)
    assert got == [b"ok"]
    st = c.stats()
    assert st["waits"] in (0, 1) and st["wait_count"] == st["waits"]


def test_a_c_wait_past_its_deadline_raises_as_the_full_path(make_cache):
    c = warm(make_cache(slots_per_rank=8, slot_size=64, max_ranks=1))
    import threading
    owner = c.get(K[21])
    errs = []

    def reader():
        with c.get(K[21]) as h:
            for t in (0.01, 0):                        # a float and an int deadline
                try:
                    h.wait(timeout=t) if t == 0 else h.wait(t)
                except TimeoutError as e:
                    errs.append(str(e))
    t = threading.Thread(target=reader)
    t.start()
    t.join(30)
    owner.close()
    assert errs == [f"key still loading after {t} s (the load goes on; get() again to wait "
                    "more)" for t in (0.01, 0.0)]
    st = c.stats()
    assert st["waits"] == st["wait_timeouts"] == st["wait_count"] == 2
    with c.get(K[21]) as h:                            # the owner closed unpublished: Failed
        assert h.owner                                 # (no negative caching)
    with pytest.raises(ValueError, match="timeout must be None or a number"):
        with c.get(K[22]) as h:
            c.get(K[22]).wait(-1)


class Interrupted(Exception):
    pass


@pytest.mark.parametrize("how", ["get_or_load", "wait", "wait_full"])
@pytest.mark.parametrize("send", ["sigint_to_process", "sigalrm_to_main_thread"])
def test_a_signal_ends_a_wait_with_no_timeout_on_a_live_loader(make_cache, procs, gate, how,
                                                                send):
    """A wait with no deadline on a loader that lives (another process, held at a gate) ends
    within about a slice when the main thread's signal handler raises: ucm_wait_ready answers
    SLICE at each slice's end and on EINTR, and its callers (HandleBase.wait in C, _wait_ready)
    run the handlers.  The waiter's pin goes with its handle; the load goes on."""
    import os
    import threading
    import time
    c = make_cache(slots_per_rank=8, slot_size=64, max_ranks=2)
    warm(c)
    key, g = K[3], gate()
    p, q = procs.start(workers.load_held, c.uuid, key, None, g.path, b"loaded", None)
    g.wait_arrived()                                   # the loader owns key's slot, and lives
    waits0, main = c.stats()["waits"], threading.get_ident()
    done, gave_up = threading.Event(), []

    def sender():
        deadline = time.monotonic() + 10
        while c.stats()["waits"] == waits0 and time.monotonic() < deadline:
            time.sleep(0.005)                          # until the main thread waits (bounded)
        if send == "sigint_to_process":
            os.kill(os.getpid(), signal.SIGINT)        # any thread may take it
        else:
            signal.pthread_kill(main, signal.SIGALRM)
        if not done.wait(10):                          # not interrupted: end the wait, fail
            gave_up.append(1)
            g.release()

    def on_alarm(signum, frame):
        raise Interrupted()
    old = signal.signal(signal.SIGALRM, on_alarm)
    t = threading.Thread(target=sender)
    t.start()
    try:
        with pytest.raises(KeyboardInterrupt if send == "sigint_to_process" else Interrupted):
            if how == "get_or_load":
                c.get_or_load(key, lambda: b"never")
            else:
                with c.get(key) as h:
                    assert not h.owner
                    h.wait() if how == "wait" else h.wait(timeout=None)
    finally:
        done.set()
        t.join(15)
        signal.signal(signal.SIGALRM, old)
    assert gave_up == [] and c._open_handles == 0
    assert c.stats()["waits"] == waits0 + 1
    g.release()                                        # the load goes on and completes
    assert procs.result(q) == "ready"
    assert c.get_or_load(key, lambda: b"never") == b"loaded"
    s = c.stats()
    assert s["wait_count"] == s["waits"]               # the interrupted wait's time counted once
    assert int((slot_fields(snapshot(c._seg)["metas"])["reference"] != 0).sum()) == 0
    assert ucmcache.verify(c.uuid).ok


@pytest.mark.parametrize("made", ["c", "full"])
@pytest.mark.parametrize("second", ["close", "fail"])
def test_a_ready_and_a_close_of_one_handle_at_once_finish_the_load_once(make_cache, gate, made,
                                                                          second):
    """h.ready() in one thread held at counted_not_ready (COUNTED, the Ready exchange still to
    come) and h.close() or h.fail() in another: the right to finish (take_finish) is the
    ready's, so the close only unpins and the fail refuses; the slot ends Ready with the
    owner's bytes, counted once (I4), unpinned."""
    import threading
    c = make_cache(slots_per_rank=8, slot_size=64, max_ranks=1)
    warm(c)
    g = gate()
    h = c.get(K[1]) if made == "c" else c.get(K[1], timeout=30.0)
    assert h.owner and (h._token is None) == (made == "c")   # C-made: its token is in C
    h.data[:16] = b"V" * 16
    c._arm("counted_not_ready", "gate", g)
    errors = []

    def ready():
        try:
            h.ready(16)
        except BaseException as e:
            errors.append(e)
    t = threading.Thread(target=ready)
    t.start()
    try:
        g.wait_arrived()
        if second == "close":
            h.close()
        else:
            with pytest.raises(UcmError, match=r"^fail\(\): the slot was already published$"):
                h.fail("late")
    finally:
        c._arm("counted_not_ready", "none")
        g.release()
        t.join(30)
    assert errors == []
    h.close()
    assert c.get_or_load(K[1], lambda: b"fresh") == b"V" * 16
    s = c.stats()
    assert (s["loads_ready"], s["loads_failed"]) == (2, 0) and c.entry_count() == 2
    assert int((slot_fields(snapshot(c._seg)["metas"])["reference"] != 0).sum()) == 0
    assert ucmcache.verify(c.uuid).ok


def test_a_c_made_owner_killed_at_counted_not_ready_in_its_ready_is_recovered(make_cache, procs,
                                                                              gate):
    """DESIGN 5.8: get()'s owner handle made in C dies inside ready() (ucm_token_publish) at
    counted_not_ready (COUNTED set, still Loading, its token on a dead stack): the waiter in a
    third process learns Failed, a survivor's recovery uncounts it and drops the pin."""
    c = make_cache(slots_per_rank=4, slot_size=64, max_ranks=3)
    key = K[12]
    g, joined = gate(), gate()
    p, q = procs.start(workers.load_then_publish_at, c.uuid, key, g.path, "counted_not_ready",
                       K[13], True)
    g.wait_arrived()                                   # the owner holds its C-made handle
    w, wq = procs.start(workers.wait_for_load, c.uuid, key, joined.path, 30)
    joined.wait_value(1)                               # the waiter holds a handle on it
    g.release()                                        # on to ready(): killed inside it
    p.join(30)
    assert p.exitcode == -signal.SIGKILL, "the owner was not killed at counted_not_ready"
    state, value = procs.result(wq)
    assert state == "failed", (state, value)
    c.recover()
    rep = ucmcache.verify(c.uuid)
    assert rep.ok, rep
    f = slot_fields(snapshot(c._seg)["metas"])
    assert int((f["reference"] != 0).sum()) == 0, "a pin or claim survived recovery"
    assert c.exist([key, K[13]]) == [False, True]
    assert c.entry_count() == 1                        # the owner's own_first entry only
    assert c.get_or_load(key, lambda: b"again") == b"again"


@pytest.mark.parametrize("how", ["wait", "wait_full"])
def test_a_wait_ended_by_its_recovery_raising_counts_its_time_once(make_cache, procs, gate,
                                                                   monkeypatch, how):
    """A wait that counted `waits` and ends on an exception of its own (here the recovery of
    its dead loader raising) counts its time once: wait_ns and a wait histogram entry."""
    c = make_cache(slots_per_rank=8, slot_size=64, max_ranks=2)
    warm(c)
    key, g = K[14], gate()
    p, q = procs.start(workers.load_held, c.uuid, key, None, g.path, b"v", None)
    g.wait_arrived()
    p.kill()                                           # the loader dies owning key's slot
    p.join(30)

    def broken(self, slot, deadline):
        raise RuntimeError("recovery failed")
    monkeypatch.setattr(SlotCache, "_recover_loader", broken)
    before = c.stats()
    with c.get(key) as h:
        assert not h.owner
        with pytest.raises(RuntimeError, match="^recovery failed$"):
            h.wait() if how == "wait" else h.wait(timeout=None)
    s = c.stats()
    assert s["waits"] - before["waits"] == 1
    assert s["wait_count"] - before["wait_count"] == 1
    assert s["wait_ns"] > before["wait_ns"]
    monkeypatch.undo()
    c.recover()
    assert c.get_or_load(key, lambda: b"again") == b"again"


class _StepFirst:
    """ucmcache.core.slots' lib with one step (`name`) made to run `first` once before it: the
    interleaving of another thread of the process landing between a finisher's checks and its
    core step (a GIL switch there), made deterministic."""

    def __init__(self, lib, name, first):
        self._lib, self._name, self._first = lib, name, first

    def __getattr__(self, attr):
        step = getattr(self._lib, attr)
        if attr != self._name or self._first is None:
            return step

        def wrapped(*args):
            first, self._first = self._first, None
            first()
            return step(*args)
        return wrapped


@pytest.mark.parametrize("made", ["c", "full", "batch"])
@pytest.mark.parametrize("finish", ["ready", "fail"])
def test_a_stale_finish_never_finishes_the_next_load_on_its_slot(make_cache, monkeypatch, made,
                                                                 finish):
    """A's ready()/fail() passed its checks; before its core step another thread closes A (the
    load failed, the slot unpinned and free) and another get of the same process installs K2
    on that slot.  The stale step must not take the right to finish K2's load (the done flag
    is the slot's; the load's serial is A's): it raises, K2 stays Loading, and K2's own owner
    publishes its bytes (I4, I5)."""
    from ucmcache.core import hooks as _hooks, slots as _slots
    c = make_cache(slots_per_rank=4, slot_size=64, max_ranks=1)
    warm(c)
    if made == "batch":
        a = c.get_many([K[1]], timeout=30.0)
        assert bool(a.owner[0])
        slot = int(a._slots[0])
        a.data(0)[:16] = b"A" * 16
    else:
        a = c.get(K[1]) if made == "c" else c.get(K[1], timeout=30.0)
        assert a.owner and (a._token is None) == (made == "c")
        slot = a._slot
        a.data[:16] = b"A" * 16
    got = {}

    def other_threads():
        a.close()                                   # T1: A's load failed, its slot unpinned
        for i in range(2, 150):                     # T3: a new key's install on that slot
            h = c.get(K[i])
            if h._slot == slot and h.owner:
                got["h"], got["key"] = h, K[i]
                return
            h.close()
    step = "ucm_publish" if finish == "ready" else "ucm_fail_load"
    monkeypatch.setattr(_slots, "lib", _StepFirst(_slots.lib, step, other_threads))
    monkeypatch.setitem(_hooks._armed, "before_magic", ("none", None))  # off C's ready()
    with pytest.raises(UcmError, match=r"no longer the owner of a loading slot \(UCM_NOT_HELD\)"):
        if made == "batch":
            a.ready(0, 16) if finish == "ready" else a.fail(0, "stale")
        else:
            a.ready(16) if finish == "ready" else a.fail("stale")
    monkeypatch.undo()
    assert "h" in got, "the slot was not installed again"
    h2, key2 = got["h"], got["key"]
    from ucmcache.lowlevel import lib
    assert lib.ucm_slot_state(c._ctx, slot) == lib.UCM_LOADING   # K2's load is its owner's
    h2.data[:8] = b"K2 owner"
    h2.ready(8)                                     # and its owner finishes it
    h2.close()
    assert c.get_or_load(key2, lambda: b"never") == b"K2 owner"
    assert c.get_or_load(K[1], lambda: b"A again") == b"A again"   # A's load failed, not Ready
    assert int((slot_fields(snapshot(c._seg)["metas"])["reference"] != 0).sum()) == 0
    assert ucmcache.verify(c.uuid).ok


@pytest.mark.parametrize("how", ["batch", "handle"])
def test_a_steady_stream_of_signals_still_finds_a_dead_loader(make_cache, procs, gate, how):
    """A loader killed at a gate; the waiter's thread takes a signal every 50 ms, faster than
    a liveness slice (0.5 s).  Each signal ends ucm_wait_ready's call with UCM_SLICE and the
    next call starts a new slice: the life lock must be looked at on those answers too, or the
    dead loader is never seen (TimeoutError at the deadline, or no end with none).  Here the
    wait ends LoadFailed (recovered) well before its 3 s deadline, in the batch's Python wait
    (_wait_ready) and the handle's C wait (handle_wait) alike."""
    import threading
    import time
    c = make_cache(slots_per_rank=8, slot_size=64, max_ranks=2)
    warm(c)
    key, g = K[3], gate()
    p, q = procs.start(workers.load_held, c.uuid, key, None, g.path, b"loaded", None)
    g.wait_arrived()
    p.kill()
    p.join(10)
    assert not p.is_alive()
    main, stop = threading.get_ident(), threading.Event()

    def ticker():
        while not stop.wait(0.05):
            signal.pthread_kill(main, signal.SIGALRM)
    old = signal.signal(signal.SIGALRM, lambda *a: None)
    t = threading.Thread(target=ticker)
    t.start()
    t0 = time.monotonic()
    try:
        with pytest.raises(ucmcache.LoadFailed):
            if how == "batch":
                with c.get_many([key], timeout=30.0) as b:
                    b.wait(3.0)
            else:
                with c.get(key) as h:
                    assert not h.owner
                    h.wait(3.0)
        took = time.monotonic() - t0
    finally:
        stop.set()
        t.join(10)
        signal.signal(signal.SIGALRM, old)
    assert took < 2.0, f"the dead loader was found after {took:.2f} s"
    assert c.get_or_load(key, lambda: b"again") == b"again"
    assert ucmcache.verify(c.uuid).ok


def test_a_python_wait_ended_ready_under_a_pending_signal_counts_its_time_once(make_cache):
    """A batch's wait (_wait_ready, Python) ends Ready while a signal is pending for the main
    thread: its handler raises at the eval-breaker check right after the wait's C step
    returned.  The wait is counted exactly once (waits, and its time: wait_count in the
    histogram), not once in C and again in the Python `finally`."""
    import threading
    import time
    from ucmcache.lowlevel import lib
    c = make_cache(slots_per_rank=8, slot_size=64, max_ranks=1)
    warm(c)
    key = K[5]
    owning, failures = threading.Event(), []

    class Boom(Exception):
        pass

    def on_usr1(signum, frame):
        raise Boom()
    old = signal.signal(signal.SIGUSR1, on_usr1)

    def owner():
        try:
            with c.get(key) as h:
                assert h.owner
                slot = h._slot
                owning.set()
                deadline = time.monotonic() + 10       # gate: the waiter is at the futex
                while not int(snapshot(c._seg)["metas"]["state"][slot]) & lib.UCM_WAITERS:
                    assert time.monotonic() < deadline, "the waiter never slept"
                    time.sleep(0.002)
                # The bit is set: the waiter is inside the C wait (GIL released), before or in
                # the futex syscall; either way it first runs Python again after that call.
                # Trips the interpreter's flag (handlers run on the main thread, after its
                # next call): the main thread's futex is not interrupted, ready() wakes it.
                signal.pthread_kill(threading.get_ident(), signal.SIGUSR1)
                h.data[:4] = b"okok"
                h.ready(4)
        except BaseException as e:
            failures.append(e)
    t = threading.Thread(target=owner)
    t.start()
    try:
        assert owning.wait(10)
        s0 = c.stats()
        b = c.get_many([key], timeout=30.0)
        try:
            with pytest.raises(Boom):
                b.wait(30.0)
        finally:
            b.close()
    finally:
        t.join(10)
        signal.signal(signal.SIGUSR1, old)
    assert failures == [] and not t.is_alive()
    s = c.stats()
    assert s["waits"] - s0["waits"] == 1
    assert s["wait_count"] - s0["wait_count"] == 1
    assert s["wait_timeouts"] == s0["wait_timeouts"]
    assert c.get_or_load(key, lambda: b"never") == b"okok"
