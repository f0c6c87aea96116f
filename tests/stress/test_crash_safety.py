"""Crash safety in the processes users really run: forked helpers, threads, signal
handlers that raise, the publish kill window, a stopped or forged stripe holder.  Each test
failed on the code before the fix."""
import os
import signal
import threading

import pytest

import ucmcache
from ucmcache import SlotCache, UcmError
from ucmcache.lowlevel import lib

import safety_workers

K = b"K" * 16


def _kill(pid):
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def test_a_forked_child_does_not_keep_its_killed_parents_rank_alive(make_cache, procs, gate):
    c = make_cache(max_ranks=4)
    g = gate()
    p, q = procs.start(safety_workers.own_then_fork, c.uuid, K, g.path)
    rank, parent, child, slot = procs.result(q)
    try:
        _kill(parent)
        p.join(10)
        os.kill(child, 0)  # the forked helper outlives its parent
        rep = c.recover()
        assert [r.rank for r in rep.ranks] == [rank]
        assert rep.ranks[0].failed_loads == 1
        with c.get(K) as h:  # the dead owner's load is Failed: the next get is the owner
            assert h.owner
            h.ready(1)
        assert ucmcache.verify(c.uuid).ok
    finally:
        g.release()
        _kill(child)


@pytest.mark.parametrize("round_", range(4))
def test_threads_recover_a_dead_rank_exactly_once(make_cache, procs, gate, round_):
    c = make_cache(slots_per_rank=64, max_ranks=3)
    g = gate()
    keys = [bytes([round_, i]) * 8 for i in range(8)]
    p, q = procs.start(safety_workers.pin_and_block, c.uuid, keys, g.path)
    (rank, owners) = procs.result(q)
    assert all(owners)
    _kill(p.pid)
    p.join(10)
    start = threading.Barrier(4, timeout=30)
    found = []

    def recover():
        start.wait()
        found.extend(r.rank for r in c.recover().ranks)

    threads = [threading.Thread(target=recover) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert found == [rank]
    assert ucmcache.verify(c.uuid).ok


def test_a_wait_on_a_load_nobody_finishes_ends_at_its_timeout(make_cache, procs):
    c = make_cache(max_ranks=4)
    h = c.get(K)
    assert h.owner
    # The slot names a loader rank nobody holds and recovery cannot fail it (no pin of that
    # rank): before the fix, the waiter recovered in a loop past its deadline at 100% CPU.
    meta = c.layout.meta(h.slot)
    lib.ucm_store32(c._seg.base, meta + lib.UCM_M_LOADER, 3)
    try:
        _, q = procs.start(safety_workers.wait_for, c.uuid, K, 0.3)
        what, _elapsed = procs.result(q, timeout=30)
        assert what == "timeout"
    finally:
        lib.ucm_store32(c._seg.base, meta + lib.UCM_M_LOADER, c.rank)
        h.close()


def test_signal_handlers_raising_inside_gets_leave_nothing_held(make_cache, procs):
    c = make_cache(slots_per_rank=16, slot_size=256, max_ranks=4)
    runs = [procs.start(safety_workers.interrupted_workload, c.uuid, 3.0, 0.0003, seed)[1]
            for seed in (1, 2)]
    for q in runs:
        counts = procs.result(q, timeout=120)
        assert counts["interrupts"] > 100, counts  # the handler really ran inside the calls
        assert (counts["pinned"], counts["loading"], counts["open_handles"]) == (0, 0, 0), counts
        assert counts["bad"] == 0, counts
    rep = ucmcache.verify(c.uuid)
    assert rep.ok, rep


def test_an_owner_killed_after_counting_before_ready_leaves_the_words_exact(make_cache, procs):
    c = make_cache(slots_per_rank=2, slot_size=64, max_ranks=2)
    A, B, C, D = (bytes([x]) * 16 for x in b"ABCD")
    p, q = procs.start(safety_workers.publish_and_die, c.uuid, 1, A, B)
    p.join(30)
    assert p.exitcode == -signal.SIGKILL
    assert c.recover().count == 1
    assert ucmcache.verify(c.uuid).ok
    with SlotCache.attach(c.uuid, rank=1) as again:  # allocates over B's Failed slot
        for k in (C, D):
            again.get_or_load(k, lambda: b"x" * 8)
        present = sum(c.exist([A, C, D]))
        assert c.entry_count() == present
        rep = ucmcache.verify(c.uuid)
        assert rep.ok, rep


def test_a_stopped_stripe_holder_is_named_and_never_waited_for_past_the_timeout(
        make_cache, procs, gate):
    c = make_cache(slots_per_rank=8, max_ranks=3, n_buckets=2, n_stripes=1)
    g = gate()
    p, q = procs.start(safety_workers.hold_stripe_stopped, c.uuid, 0, g.path)
    g.wait_arrived()
    _, status = os.waitpid(p.pid, os.WUNTRACED)  # returns once it has stopped itself
    assert os.WIFSTOPPED(status)
    try:
        with pytest.raises(UcmError, match=rf"stripe 0 .*held .* by rank \d pid {p.pid} "
                                           r"\(thread \d+, stopped\)"):
            c.get(K, timeout=0.3)
        rep = ucmcache.verify(c.uuid)
        assert any(f"pid {p.pid}" in x and "stopped" in x for x in rep.problems), rep
    finally:
        _kill(p.pid)
        os.kill(p.pid, signal.SIGCONT)
        p.join(10)
    with c.get(K, timeout=5) as h:  # the dead holder's stripe is repaired by the next locker
        assert h.owner
        h.ready(1)


def test_a_forged_stripe_lock_word_is_an_error_not_a_hang(make_cache):
    c = make_cache(slots_per_rank=8, max_ranks=3, n_buckets=2, n_stripes=1)
    off = c.layout.stripe(0)
    tid = 0x3ffffff0
    assert not os.path.exists(f"/proc/{tid}")
    lib.ucm_store32(c._seg.base, off, tid)
    try:
        with pytest.raises(UcmError, match=r"stripe 0 .*thread \d+, which does not exist"):
            c.get(K, timeout=0.3)
        rep = ucmcache.verify(c.uuid)
        assert any("stripe 0" in x and "does not exist" in x for x in rep.problems), rep
    finally:
        lib.ucm_store32(c._seg.base, off, 0)
    assert ucmcache.verify(c.uuid).ok


def test_rejected_arguments_change_nothing_shared(make_cache):
    c = make_cache()
    with pytest.raises(TypeError, match="loader must be a callable"):
        c.get_or_load(K, None)
    assert c.exist([K]) == [False]
    with c.get(K) as h:  # nothing was installed: the next get is the owner
        assert h.owner
        h.fail("x")
    for bad in (-1, "x", float("nan"), True):
        with pytest.raises(ValueError, match="timeout must be None or a number of seconds"):
            c.get(K, timeout=bad)
        with pytest.raises(ValueError, match="timeout must be None or a number of seconds"):
            c.get_many([K], timeout=bad)
    assert c._open_handles == 0
    assert ucmcache.verify(c.uuid).ok


# ---------------------------------------------------------------- review findings (windows)

class _Interrupt(Exception):
    pass


@pytest.fixture
def interrupt_after(monkeypatch):
    """interrupt_after(name, handler=None): the next call of lib.<name> made by the cache is
    followed at once by SIGUSR1, whose handler (default: raise _Interrupt) runs at the eval-
    breaker check right after the C call returned: the window between a pin and its owner."""
    import ucmcache.core.cache as cache_mod
    real = cache_mod.lib
    old = signal.getsignal(signal.SIGUSR1)

    def arm(name, handler=None):
        def default(signum, frame):
            raise _Interrupt()

        signal.signal(signal.SIGUSR1, handler or default)
        fired = []

        class Shim:
            def __getattr__(self, n):
                return getattr(real, n)

        def wrapped(*a):
            r = getattr(real, name)(*a)
            if not fired:
                fired.append(1)
                signal.pthread_kill(threading.get_ident(), signal.SIGUSR1)
            return r

        shim = Shim()
        setattr(shim, name, wrapped)
        monkeypatch.setattr(cache_mod, "lib", shim)
        return fired

    yield arm
    signal.signal(signal.SIGUSR1, old)


def _ref(c, slot):
    return lib.ucm_load64(c._seg.base, c.layout.meta(slot))


def test_a_nested_get_in_a_signal_handler_does_not_steal_the_outer_pin(make_cache,
                                                                     interrupt_after):
    c = make_cache(slots_per_rank=8, slot_size=64, max_ranks=2)
    k1, k2 = b"A" * 16, b"B" * 16
    for k in (k1, k2):
        c.get_or_load(k, lambda: b"x")
    held = c.get(k2)  # a live handle on k2
    with c.get(k1) as h:
        slot1 = h.slot

    def handler(signum, frame):
        with c.get(k2):  # a nested get between the outer pin and its handle
            pass
        raise _Interrupt()

    interrupt_after("ucm_lookup_pin", handler)
    with pytest.raises(_Interrupt):
        c.get(k1, timeout=5)  # a timeout takes the Python path, whose window this is
    assert _ref(c, held.slot) == 1 << c.rank  # the live handle keeps its pin
    assert _ref(c, slot1) == 0                # the interrupted get's pin was dropped
    assert bytes(held.data) == b"x"
    held.close()


def test_a_signal_during_a_c_hit_raises_after_get_and_the_dropped_handle_unpins(make_cache,
                                                                                 gate):
    """The hit path in C (ucmcache._hit) has no window between the pin and its handle: a
    signal that arrives while the pin is taken (the thread held at after_pin) runs its handler
    once get() has returned the handle, and the raise drops that handle, whose finalizer
    drops the pin.  Fails if the C path kept a pin nobody owns."""
    c = make_cache(slots_per_rank=8, slot_size=64, max_ranks=2)
    c.get_or_load(K, lambda: b"x")
    with c.get(K) as h:
        slot = h.slot
    g = gate()
    c._arm("after_pin", "gate", g)
    main = threading.get_ident()
    old = signal.signal(signal.SIGUSR1, lambda *a: (_ for _ in ()).throw(_Interrupt()))

    def interrupt():
        g.wait_arrived()
        signal.pthread_kill(main, signal.SIGUSR1)
        g.release()

    t = threading.Thread(target=interrupt)
    t.start()
    try:
        with pytest.raises(_Interrupt):
            h = c.get(K)
            h.close()  # not reached: the handler raises first
    finally:
        g.release()
        t.join(10)
        signal.signal(signal.SIGUSR1, old)
    assert not t.is_alive()
    assert _ref(c, slot) == 0 and c._open_handles == 0


def test_an_interrupted_slow_path_fails_its_load_at_once(make_cache, interrupt_after):
    c = make_cache(slots_per_rank=8, slot_size=64, max_ranks=2)
    interrupt_after("ucm_get_slow")
    kept = []
    try:
        c.get(K)
    except _Interrupt as e:
        kept.append(e)  # a kept traceback keeps the frames (and their token) alive
    with c.get(K, timeout=1) as h:  # the orphaned load failed at once: not a join, an owner
        assert h.owner
        h.ready(1)
    assert c._open_handles == 0 and ucmcache.verify(c.uuid).ok
    assert kept


def test_an_interrupted_batch_of_misses_drops_every_pin_and_fails_its_loads(make_cache,
                                                                           interrupt_after):
    """A signal handler that raises when the batch's one C call for its misses returns
    (ucm_get_slow_many: every key pinned and owned by then): the batch's token drops every pin
    and fails every load, so the next get_many owns every key at once."""
    c = make_cache(slots_per_rank=8, slot_size=64, max_ranks=2)
    c.get_or_load(b"W" * 16, lambda: b"w")   # the rank's share looked at: no MOVED answer
    keys = [bytes([i]) * 16 for i in range(1, 5)]
    interrupt_after("ucm_get_slow_many")
    kept = []
    try:
        c.get_many(keys)
    except _Interrupt as e:
        kept.append(e)   # a kept traceback keeps the frames alive
    assert kept
    with c.get_many(keys, timeout=1) as b:
        assert b.owner.all()
        b.ready_many(range(4), 1)
    assert c._open_handles == 0 and ucmcache.verify(c.uuid).ok


def test_a_handle_of_a_forked_childs_copy_drops_nothing_of_the_parent(make_cache):
    import gc
    c = make_cache(slots_per_rank=4, slot_size=64, max_ranks=2)
    c.get_or_load(K, lambda: b"KKKK")
    gc.disable()
    try:
        h = c.get(K)
        slot = h.slot
        cycle = [h]
        cycle.append(cycle)  # garbage the child's collector finds before any after-fork hook
        del h, cycle
        os.register_at_fork(after_in_child=gc.collect)  # (runs before ucmcache's hook: it is
        pid = os.fork()                                  #  registered later in this process)
        if pid == 0:
            os._exit(0)
        os.waitpid(pid, 0)
        assert _ref(c, slot) == 1 << c.rank  # the parent's pin is still there
    finally:
        gc.enable()
        gc.collect()
    assert _ref(c, slot) == 0


def test_a_token_outliving_its_cache_does_not_touch_the_unmapped_segment(uuid, procs):
    # In a child process: a crash here would be a segfault.
    _, q = procs.start(safety_workers.token_outlives_cache, uuid)
    assert procs.result(q) == "survived"


def test_a_producer_that_died_holding_a_ring_lock_costs_one_post_not_all(make_cache, procs,
                                                                         gate):
    c = make_cache(max_ranks=3)
    g = gate()
    p, q = procs.start(safety_workers.take_ring_lock_and_block, c.uuid, c.rank, g.path)
    g.wait_arrived()
    _kill(p.pid)
    p.join(10)
    keys = [bytes([i]) * 16 for i in range(5)]
    assert c.prefetch(keys) == 5  # the dead holder is recovered and the post goes through
    assert c.stats()["rings"][c.rank]["depth"] == 5


# A fresh interpreter: its own fork hook must run after ucmcache's (a before-fork hook
# registered earlier runs later), so it is registered before ucmcache is imported.
_FORK_BATCH_CHILD = r'''
import gc, os, sys, threading
_hook = {}
os.register_at_fork(before=lambda: _hook.pop("before", lambda: None)())
from ucmcache import SlotCache
from ucmcache.lowlevel import Gate
uuid = sys.argv[1]
c = SlotCache.create(uuid, slots_per_rank=256, slot_size=64, max_ranks=1)
try:
    keys = [i.to_bytes(8, "little") * 2 for i in range(400)]
    b = c.get_many([keys[0]], timeout=30.0)    # the full path: a batch owning its one load
    assert bool(b._owner[0])
    s = int(b._slots[0])
    k2 = None                                  # a key whose slot shares s's local lock stripe
    for k in keys[1:]:
        c.get_or_load(k, lambda k=k: k)
        with c.get(k, timeout=30.0) as h:
            if h._slot != s and h._slot % 64 == s % 64:
                k2 = k
                break
    assert k2 is not None
    held, done = Gate(timeout=30.0), Gate(timeout=30.0)
    go = threading.Event()

    def hold_the_stripe():                     # pin(k2) stops at before_pin_cas, lock held
        go.wait(30)
        c.get(k2, timeout=30.0).close()

    t = threading.Thread(target=hold_the_stripe)
    t.start()

    def at_fork():                             # after ucmcache's hook took its holds
        c._arm("before_pin_cas", "gate", held)
        go.set()
        held.wait_arrived(30)

    _hook["before"] = at_fork
    pid = os.fork()
    if pid == 0:                               # the child's copy of that lock is held
        try:
            del b                              # the inherited batch's token is dropped
            gc.collect()
            done.release()
        finally:
            held.release()                     # lets the parent's holder thread go on
            os._exit(0)
    c._arm("before_pin_cas", "none")
    try:
        done.wait_value(1, timeout=30)
        print("the child dropped its inherited batch")
    finally:
        os.kill(pid, 9)                        # a hung child (a zombie takes it harmlessly)
        os.waitpid(pid, 0)
        t.join(60)
        b.close()                              # the parent's batch fails its load and unpins
finally:
    c.close()
    SlotCache.unlink(uuid)
'''


def test_a_forked_child_drops_an_inherited_owner_batch_while_a_parent_thread_held_its_lock(uuid):
    """A child that inherits a batch owning a load, forked while another parent thread held
    that slot's process-local lock, drops the batch without touching its copy of the lock (it
    would spin for ever: the holder does not exist in the child)."""
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-c", _FORK_BATCH_CHILD, uuid], capture_output=True,
                       text=True, timeout=180)
    assert r.returncode == 0 and "dropped its inherited batch" in r.stdout, (r.stdout, r.stderr)
