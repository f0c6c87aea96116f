"""put, the mapping methods and memoize, across real processes: put never waits and
never wins over a load in progress, cache[key] never loads, memoize runs a function once across
processes, and what does not fit a slot is said, not stored."""
import os
import threading

import pytest

import mapping_workers
import safety_workers
from ucmcache import LoadFailed

K = b"K" * 16


def until(condition, bound=30.0):
    """Poll a state (bounded), never a sleep standing in for an ordering."""
    import time
    deadline = time.monotonic() + bound
    while not condition():
        assert time.monotonic() < deadline, "condition never held"
        time.sleep(0.001)


def test_put_stores_a_cold_key_for_every_process_and_skips_a_ready_one(make_cache, procs):
    c = make_cache(slot_size=64)
    assert K not in c and len(c) == 0 and bool(c)
    assert c.put(K, b"first") is True
    assert c.put(K, b"second") is False  # Ready: skipped, unchanged
    assert c[K] == b"first" and K in c and len(c) == 1
    _, q = procs.start(mapping_workers.look, c.uuid, K)
    assert procs.result(q) == (True, 1, b"first")
    _, q = procs.start(mapping_workers.look, c.uuid, b"Z" * 16)
    assert procs.result(q) == (False, 1, None)


def test_put_racing_another_processs_load_returns_false_at_once_and_the_load_wins(
        make_cache, procs, gate):
    c = make_cache(slot_size=64)
    held, go = gate(), gate()
    _, q = procs.start(safety_workers.load_when_released, c.uuid, K, held.path, go.path)
    held.wait_arrived()  # the other process owns K's load
    assert c.put(K, b"mine") is False  # no wait: the load in progress wins
    with pytest.raises(KeyError):
        c[K]  # Loading: never waited for, never loaded
    assert K not in c
    go.release()
    assert procs.result(q) == "published"
    assert c[K] == b"from-the-other-process"
    assert c.stats()["waits"] == 0


def test_bad_put_input_is_refused_before_any_shared_word_changes(make_cache):
    c = make_cache(slot_size=64)
    with pytest.raises(ValueError, match="more than slot_size=64"):
        c.put(K, b"x" * 65)
    with pytest.raises(TypeError, match="bytes-like"):
        c.put(K, "a str")
    with c.get(K) as h:  # still cold: nothing was installed, failed or counted
        assert h.owner
        h.fail("test")
    assert len(c) == 0 and c.stats()["misses"] == 1


def test_iterating_a_cache_is_refused(make_cache):
    c = make_cache(slot_size=64)
    with pytest.raises(TypeError, match="not iterable"):
        iter(c)


def test_memoize_runs_the_function_once_across_processes(make_cache, procs, gate, tmp_path):
    c = make_cache(slot_size=256)
    runs = tmp_path / "runs"
    started, go = gate(), gate()
    _, q = procs.start(mapping_workers.call_memoized, c.uuid, str(runs), started.path,
                       go.path, 7)
    started.wait_arrived()  # the other process runs the function for 7 and holds it
    f = mapping_workers.memoized(c)
    got = []
    t = threading.Thread(target=lambda: got.append(f(str(runs), started.path, go.path, 7)))
    t.start()
    try:
        until(lambda: c.stats()["waits"] >= 1)  # this process waits for that run
        go.release()
        t.join(30)
    finally:
        go.release()
    theirs = procs.result(q)
    assert got == [theirs] and theirs["square"] == 49 and theirs["by"] != os.getpid()
    assert runs.read_text().count("\n") == 1, "the function ran more than once"
    # and later calls, here, read the stored result without running it
    assert f(str(runs), started.path, go.path, 7) == theirs
    assert runs.read_text().count("\n") == 1


def test_memoize_passes_exceptions_and_returns_values_too_large_for_a_slot_uncached(make_cache):
    c = make_cache(slot_size=64)
    calls = []

    @c.memoize("tests.mapping.v1")
    def f(n):
        calls.append(n)
        if n < 0:
            raise ArithmeticError(f"negative {n}")
        return b"a" * n

    with pytest.raises(ArithmeticError, match="negative -1"):
        f(-1)
    with pytest.raises(ArithmeticError):  # no negative caching: it runs again
        f(-1)
    assert f(1000) == b"a" * 1000 and f(1000) == b"a" * 1000  # too large: computed each time
    assert f(3) == b"aaa" and f(3) == b"aaa"
    assert calls == [-1, -1, 1000, 1000, 3]
    assert len(c) == 1
    with pytest.raises(ValueError, match="namespace"):
        c.memoize("")
    with pytest.raises(TypeError, match="cannot be pickled"):
        f(lambda: 1)


# What the memoized function of the next test waits on: a module global, since memoize keys a
# function by its closure cells as pickled values and refuses an Event there.
EVENTS = {}


def test_a_waiter_of_a_failed_memoized_call_gets_load_failed(make_cache, gate):
    c = make_cache(slot_size=64)
    inside, release = EVENTS["inside"], EVENTS["release"] = threading.Event(), threading.Event()

    @c.memoize("tests.mapping.v1")
    def g(x):
        EVENTS["inside"].set()
        assert EVENTS["release"].wait(30)
        raise RuntimeError("boom")

    errors = []

    def owner():
        try:
            g(1)
        except RuntimeError as e:
            errors.append(e)

    t = threading.Thread(target=owner)
    t.start()
    try:
        assert inside.wait(30)
        waiter = []

        def wait():
            try:
                g(1)
            except LoadFailed as e:
                waiter.append(e)

        w = threading.Thread(target=wait)
        w.start()
        until(lambda: c.stats()["waits"] >= 1)
    finally:
        release.set()
    t.join(30)
    w.join(30)
    assert len(errors) == 1 and len(waiter) == 1 and "boom" in str(waiter[0])
