"""Spawned workers for the crash-safety tests of forked, threaded and interrupted processes
(tests/stress/test_crash_safety.py).  Each reports through a queue (workers.run); gates order steps."""
import gc
import os
import random
import signal

from ucmcache import SlotCache
from ucmcache.lowlevel import lib
from ucmcache.lowlevel import Gate

from workers import check_payload, fill_owned, payload_for, run


def held_by_rank(c):
    """(slots whose reference names our rank, slots Loading with our rank as loader)."""
    L, base = c.layout, c._seg.base
    bit, claim = 1 << c.rank, lib.UCM_CLAIMED | c.rank
    pinned, loading = [], []
    for s in range(L.n_slots):
        ref = lib.ucm_load64(base, L.meta(s))
        if ref & bit and not ref & lib.UCM_CLAIMED or ref == claim:
            pinned.append(s)
        state = lib.ucm_load32(base, L.meta(s) + lib.UCM_M_STATE) & lib.UCM_STATE_MASK
        if state == lib.UCM_LOADING and \
                lib.ucm_load32(base, L.meta(s) + lib.UCM_M_LOADER) & 0xFFFF == c.rank:
            loading.append(s)
    return pinned, loading


def _own_then_fork(uuid, key, gate_path):
    """Become the owner of key (never publish), fork a child that outlives us, report both
    pids and block until SIGKILLed.  The child blocks on the gate (bounded) and touches
    nothing of the cache."""
    c = SlotCache.attach(uuid)
    h = c.get(key)
    assert h.owner
    gate = Gate(gate_path)
    pid = os.fork()
    if pid == 0:  # the child: a helper that never uses the cache (a pool worker, say)
        try:
            gate.wait_value(10 ** 9, timeout=60)
        finally:
            os._exit(0)
    return (c.rank, os.getpid(), pid, h.slot), h


def own_then_fork(q, *args):
    # Report, then stay alive (the test SIGKILLs us) holding the handle (closing it would
    # publish Failed and unpin: the test wants the load left to recovery).
    try:
        out, h = _own_then_fork(*args)
    except BaseException as e:
        q.put(("error", f"{type(e).__name__}: {e}"))
        return
    q.put(("ok", out))
    Gate(args[2]).wait_value(10 ** 9, timeout=60)
    h.close()


class Interrupt(Exception):
    """What the SIGALRM handler raises: an exception from a signal handler, at any call."""


def _interrupted_workload(uuid, seconds, interval, seed):
    """Mixed gets while SIGALRM raises every `interval` s; afterwards nothing of ours may be
    pinned or Loading, close() must work.  Returns counts.  The handler raises only while an
    operation runs (`armed`), so the harness itself is never cut short."""
    import time
    from ucmcache import LoadFailed
    c = SlotCache.attach(uuid)
    rnd = random.Random(seed)
    keys = [i.to_bytes(8, "little") * 2 for i in range(24)]
    size = c.slot_size
    counts = {"ops": 0, "interrupts": 0, "bad": 0, "failed_joins": 0}
    armed = [False]

    def on_alarm(signum, frame):
        if armed[0]:
            raise Interrupt()

    def op(r, k):
        if r < 0.4:
            v = c.get_or_load(k, lambda k=k: payload_for(k, size), timeout=10)
            counts["bad"] += not check_payload(k, v)
        elif r < 0.7:
            with c.get(k, timeout=10) as h:
                if h.owner:
                    p = payload_for(k, size)
                    h.data[: len(p)] = p
                    h.ready(len(p))
                else:
                    h.wait()
                    counts["bad"] += not check_payload(k, bytes(h.data))
        elif r < 0.95:
            batch = [keys[rnd.randrange(len(keys))] for _ in range(3)]
            with c.get_many(batch, timeout=10) as b:
                fill_owned(b, batch, size)
                b.wait()
                for i, bk in enumerate(batch):
                    counts["bad"] += not check_payload(bk, bytes(b.data(i)))
        else:
            c.exist(keys[:4])

    import sys
    counts["unraisable"] = 0

    def count_unraisable(u):  # a handler raising inside a finalizer: counted, not printed
        counts["unraisable"] += 1

    sys.unraisablehook = count_unraisable
    old = signal.signal(signal.SIGALRM, on_alarm)
    end = time.monotonic() + seconds
    signal.setitimer(signal.ITIMER_REAL, interval, interval)
    try:
        while time.monotonic() < end:
            counts["ops"] += 1
            r = rnd.random()
            k = keys[rnd.randrange(len(keys))]
            try:
                armed[0] = True
                op(r, k)
                armed[0] = False
            except Interrupt:
                armed[0] = False
                counts["interrupts"] += 1
            except LoadFailed:  # another process's load was interrupted: it failed, we go on
                armed[0] = False
                counts["failed_joins"] += 1
            except TimeoutError:
                armed[0] = False
                counts["bad"] += 1  # a key stayed Loading: someone's load was left unowned
    finally:
        armed[0] = False
        signal.setitimer(signal.ITIMER_REAL, 0, 0)
        signal.signal(signal.SIGALRM, old)
    gc.collect()  # handles dropped by interrupted frames are closed by their finalizers
    pinned, loading = held_by_rank(c)
    counts["pinned"], counts["loading"] = len(pinned), len(loading)
    counts["open_handles"] = c._open_handles
    c.close()  # must not refuse
    return counts


def interrupted_workload(q, *args):
    run(_interrupted_workload, q, *args)


def _publish_and_die(uuid, rank, first, second):
    """Load `first` (counted), then die inside the publish of `second` after it was counted
    and before it became Ready."""
    c = SlotCache.attach(uuid, rank=rank)
    c.get_or_load(first, lambda: b"1" * 8)
    c._arm("counted_not_ready", "kill")
    c.get_or_load(second, lambda: b"2" * 8)
    return "survived"


def publish_and_die(q, *args):
    run(_publish_and_die, q, *args)


def _hold_stripe_stopped(uuid, stripe, gate_path):
    """Hold a stripe, tell the test, then stop ourselves (as a debugger or SIGSTOP would)."""
    c = SlotCache.attach(uuid)
    c._stripes.lock(stripe)
    Gate(gate_path).release()
    os.kill(os.getpid(), signal.SIGSTOP)
    Gate(gate_path).wait_value(10 ** 9, timeout=60)  # until the test kills us


def hold_stripe_stopped(q, *args):
    run(_hold_stripe_stopped, q, *args)


def _wait_for(uuid, key, timeout):
    """Join key's load and wait for it with a timeout; returns what happened."""
    import time
    c = SlotCache.attach(uuid)
    try:
        with c.get(key) as h:
            assert not h.owner
            t0 = time.monotonic()
            try:
                h.wait(timeout)
                return "ready", time.monotonic() - t0
            except TimeoutError:
                return "timeout", time.monotonic() - t0
    finally:
        c.close()


def wait_for(q, *args):
    run(_wait_for, q, *args)


def _pin_and_block(uuid, keys, gate_path):
    """Pin keys (owning the cold ones), report our rank, block until SIGKILLed."""
    c = SlotCache.attach(uuid)
    handles = [c.get(k) for k in keys]
    q_out = (c.rank, [h.owner for h in handles])
    return q_out, handles, Gate(gate_path)


def pin_and_block(q, uuid, keys, gate_path):
    try:
        out, handles, gate = _pin_and_block(uuid, keys, gate_path)
    except BaseException as e:
        q.put(("error", f"{type(e).__name__}: {e}"))
        return
    q.put(("ok", out))
    gate.wait_value(10 ** 9, timeout=60)


def _read_many_with_point(uuid, keys, point, gate_path, row, own_first=None):
    """read_many(keys) with `point` armed (a gate): returns (lengths, rows as bytes).
    `own_first`: a key to load before, so that this rank takes its share of the arenas."""
    import numpy as np
    c = SlotCache.attach(uuid)
    gate = Gate(gate_path)  # kept alive: the armed point holds a pointer into its mapping
    try:
        if own_first is not None:
            c.get_or_load(own_first, lambda: b"mine")
        c._arm(point, "gate", gate)
        out = np.zeros((len(keys), row), dtype=np.uint8)
        lens = c.read_many(keys, out)
        return lens.tolist(), [bytes(r) for r in out]
    finally:
        c.close()


def read_many_with_point(q, *args):
    run(_read_many_with_point, q, *args)


def _token_outlives_cache(uuid):
    """An owner's handle that holds the last reference to its cache, collected with its
    finalizer cut short (as a signal handler would): its token runs after the cache's
    fields are gone and must find the mapping still there."""
    from ucmcache.core.handle import _Pins
    c = SlotCache.create(uuid, slots_per_rank=8, slot_size=64, max_ranks=2)
    h = c.get(b"Q" * 16)
    assert h.owner and h._token is not None
    del c
    _Pins.__del__ = lambda self: None
    del h
    import gc
    gc.collect()
    return "survived"


def token_outlives_cache(q, *args):
    run(_token_outlives_cache, q, *args)


def _load_when_released(uuid, key, held_path, go_path):
    """Own key's load, say so (held), publish only once `go` is released (bounded: 30 s, then
    fail the load, so a test whose loop froze fails instead of hanging)."""
    c = SlotCache.attach(uuid)
    try:
        h = c.get(key)
        assert h.owner
        Gate(held_path).release()
        try:
            Gate(go_path).wait_value(1, timeout=30)
        except TimeoutError:
            h.fail("the test's event loop never released us")
            h.close()
            return "failed"
        h.data[:22] = b"from-the-other-process"
        h.ready(22)
        h.close()
        return "published"
    finally:
        c.close()


def load_when_released(q, *args):
    run(_load_when_released, q, *args)


def _take_ring_lock_and_block(uuid, ring, gate_path):
    """Hold `ring`'s producer lock as a producer mid-post would (our rank + 1 in the lock
    word), then block until SIGKILLed: a producer that died holding the lock."""
    c = SlotCache.attach(uuid)
    L = c.layout
    off = L.ring_off + ring * L.ring_size + lib.UCM_RING_LOCK
    assert lib.ucm_cas32(c._seg.base, off, 0, c.rank + 1)
    g = Gate(gate_path)
    g.release()
    g.wait_value(10 ** 9, timeout=60)


def take_ring_lock_and_block(q, *args):
    run(_take_ring_lock_and_block, q, *args)
