"""Joining another caller's load in the hit path's C types (csrc/ucm_hit.c; DESIGN 4.1, 4.6): a
get_or_load or get of a key another caller loads looks it up once before the stripe and waits
with that look's pin, or with the slow step's pin moved out of its token; the counting contract
(ucm_outer) is one look's; a join drops its pin when the full path raises at once, and a wait
whose allocation closes the cache never touches it."""
import os
import threading
import time

import pytest

import ucmcache
from ucmcache import SlotCache

from conftest import run_uuid

K = [i.to_bytes(8, "little") * 2 for i in range(200)]
TIMING = ("wait_ns", "load_sum_ns", "wait_sum_ns", "wait_seconds")
FULL = {"timeout": 30.0}  # a timeout sends get and get_or_load to the full path (Python)
WAIT = 10.0


def counters(c):
    return {k: v for k, v in c.stats().items() if isinstance(v, int) and k not in TIMING}


def warm(c):
    """The first miss of a rank takes its share of the arenas (MOVED: the full path's decision);
    after it, cold keys take the C path."""
    c.get_or_load(K[199], lambda: b"first")
    return c


def until(what, done, thread):
    """Wait (bounded) for a step of `thread` that has no gate of its own to reach a shared
    counter: the counter is the signal, never the passing of time.  A thread that ended first
    raises its error here."""
    deadline = time.monotonic() + WAIT
    while not done():
        if not thread.is_alive():
            thread.result()
            raise AssertionError(f"the thread ended before {what}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} did not happen within {WAIT} s")
        os.sched_yield()


def no_full_path(monkeypatch):
    """Every full-path entry a get or get_or_load of a plain id could take, made to fail; the
    wait of a join (_get_or_load_joined, _load_or_wait) stays allowed."""
    for name in ("_get_or_load_missed", "_get_or_load_cold", "_get_or_load_full", "_get_full",
                 "_get_missed", "_pin_handle"):
        monkeypatch.setattr(SlotCache, name,
                            lambda *a, name=name, **k: pytest.fail(f"{name} ran"))


def in_thread(fn):
    """fn() in a thread; .result() joins it (bounded), then returns fn's value or raises."""
    box = {}

    def run():
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: B902 (handed to the test's thread)
            box["error"] = e
    t = threading.Thread(target=run, daemon=True)
    t.start()

    def result():
        t.join(WAIT)
        assert not t.is_alive(), "the thread did not finish"
        if "error" in box:
            raise box["error"]
        return box["value"]
    t.result = result
    return t


@pytest.fixture
def two(uuid):
    """Two caches alike, warmed: (a, b), a for the C path and b for the full path; both closed
    and unlinked after the test, pass or fail."""
    full_uuid = run_uuid()
    made = []
    try:
        for u in (uuid, full_uuid):
            made.append(SlotCache.create(u, slots_per_rank=16, slot_size=64, max_ranks=1))
            warm(made[-1])
        yield made
    finally:
        for c in made:
            try:
                c.close()
            except ucmcache.UcmError:
                pass  # the test's own failure says why (the segments go below anyway)
        SlotCache.unlink(full_uuid)


def join_at_the_look(c, kw):
    """A get_or_load of a key this process's owner handle holds Loading (another thread's
    context): its look finds it Loading and joins; the owner publishes once its wait began."""
    with c.get(K[3]) as owner:
        assert owner.owner
        waiter = in_thread(lambda: c.get_or_load(K[3], lambda: b"never", **kw))
        until("the waiter's wait", lambda: counters(c)["waits"] == 1, waiter)  # (joined first)
        owner.data[:5] = b"value"
        owner.ready(5)
    return waiter.result()


def test_a_join_found_by_the_look_waits_with_its_pin_and_counts_as_the_full_path(two,
                                                                                   monkeypatch):
    a, b = two
    assert join_at_the_look(b, FULL) == b"value"
    no_full_path(monkeypatch)                          # the C path: one look, no Python look
    assert join_at_the_look(a, {}) == b"value"
    ca, cb = counters(a), counters(b)
    assert ca == cb and ca["joins"] == 1 and ca["waits"] == 1
    assert ucmcache.verify(a.uuid).ok


def join_under_the_stripe(c, kw, gate):
    """The owner held at before_handover (its slot linked, still claimed, its stripe held): the
    waiter's look finds the slot claimed (BUSY, counted as the request), its slow step waits for
    the stripe and finds the owner's load under it: a join whose pin the step's token holds."""
    held = gate()
    c._arm("before_handover", "gate", held)
    owner = in_thread(lambda: c.get(K[4]))
    held.wait_arrived()
    waiter = in_thread(lambda: c.get_or_load(K[4], lambda: b"never", **kw))
    try:
        until("the waiter's look", lambda: counters(c)["spins_exhausted"] == 1, waiter)
    finally:
        held.release()  # (on a failure too: the owner's step holds the stripe until then)
    with owner.result() as h:
        assert h.owner
        until("the waiter's wait", lambda: counters(c)["waits"] == 1, waiter)  # (joined first)
        h.data[:5] = b"strip"
        h.ready(5)
    return waiter.result()


def test_a_join_found_under_the_stripe_waits_with_the_slow_steps_pin(two, gate, monkeypatch):
    a, b = two
    assert join_under_the_stripe(b, FULL, gate) == b"strip"
    no_full_path(monkeypatch)                          # the C path: the slow step at once
    assert join_under_the_stripe(a, {}, gate) == b"strip"
    ca, cb = counters(a), counters(b)
    assert ca == cb and ca["joins"] == 1 and ca["spins_exhausted"] == 1 and ca["waits"] == 1
    assert ucmcache.verify(a.uuid).ok
    a.close()  # refuses while a handle of ours is open; its pins went with the handle


def test_a_get_of_a_key_being_loaded_joins_from_its_one_look(two, monkeypatch):
    a, b = two
    for c, kw in ((b, FULL), (a, {})):
        if c is a:
            no_full_path(monkeypatch)
        with c.get(K[5]) as owner, c.get(K[5], **kw) as joined:
            assert owner.owner and not joined.owner
            owner.data[:2] = b"ok"
            owner.ready(2)
            assert bytes(joined.wait().data) == b"ok"
    assert counters(a) == counters(b) and counters(a)["joins"] == 1


def test_a_join_found_by_the_look_drops_its_pin_when_the_full_path_raises_at_once(uuid):
    """The C look found the key Loading and handed its join to the full path, which raised at
    its first line (as a signal handler's exception does there) before its `with` took the
    handle: the pin is dropped in C at once, not when the kept traceback goes, so close()
    succeeds while the exception is still held."""
    import sys
    c = warm(SlotCache.create(uuid, slots_per_rank=16, slot_size=64, max_ranks=2))
    try:
        owner = c.get(K[0])
        assert owner.owner

        def tracer(frame, event, arg):
            if event == "call" and frame.f_code.co_name == "_get_or_load_joined":
                sys.settrace(None)
                raise KeyboardInterrupt("a signal handler's, at the full path's first line")
            return None

        kept = None
        sys.settrace(tracer)
        try:
            c.get_or_load(K[0], lambda: b"never")
        except KeyboardInterrupt as e:
            kept = e
        finally:
            sys.settrace(None)
        assert kept is not None, "the join did not reach the full path"
        owner.data[:5] = b"value"
        owner.ready(5)
        owner.close()
        c.close()                                   # refused while a handle stayed open
        del kept
    finally:
        c.close()


WAIT_UAF = r'''
import sys
from ucmcache import SlotCache, HandleClosed
from ucmcache.core import slots as _slots
c = SlotCache.create(sys.argv[1], slots_per_rank=16, slot_size=64, max_ranks=1)
try:
    c.get_or_load(b"w" * 16, lambda: b"warm")
    owner = c.get(b"k" * 16); j = c.get(b"k" * 16)
    assert owner.owner and not j.owner
    ran = []
    class Closing(_slots.OwnedRecord):
        def get(self, key, default=None):  # the record's look: Python code inside the wait
            ran.append(1); owner.close(); j.close(); c.close()
            return default
    _slots._owning.set(Closing())
    try:
        j.wait()
        print("returned")
    except HandleClosed:
        print("HandleClosed", ran)
finally:
    c.close()
    SlotCache.unlink(sys.argv[1])
'''


def test_a_wait_whose_allocation_runs_a_finalizer_that_closes_the_cache_never_touches_it(uuid):
    """Handle.wait (C) checks the owned-slot record (_slots.owns_load: Python code, where a
    finalizer or another thread may run), and code run there closes both handles and the cache
    (its context freed, its segment unmapped): the wait re-checks before it counts, and raises
    HandleClosed instead of writing through freed memory (a segfault before).  The record's
    look is made to close them, so the step is deterministic.  In a child process: a crash
    fails the test."""
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-c", WAIT_UAF, uuid], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, f"rc {r.returncode}: {r.stderr[-2000:]}"
    assert r.stdout.strip() == "HandleClosed [1]", r.stdout
