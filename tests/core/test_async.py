"""asyncio: aget_or_load and Handle.wait_async keep the event loop running, single
flight across tasks, cancellation of owners and waiters."""
import asyncio
import contextvars

import pytest

import ucmcache
from ucmcache import LoadFailed

import safety_workers

K = b"K" * 16


async def until(condition, bound=30.0):
    """Yield to the loop until condition() holds (a wait on a state, bounded), never a sleep
    standing in for an ordering."""
    deadline = asyncio.get_running_loop().time() + bound
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "condition never held"
        await asyncio.sleep(0.001)


def waiting(c, n=1):
    """True once n waits have begun on this rank (the waiter's thread is in _wait_loaded)."""
    return lambda: c.stats()["waits"] >= n


def test_a_hit_returns_without_yielding_to_the_loop(make_cache):
    c = make_cache(slot_size=64)
    c.get_or_load(K, lambda: b"v" * 8)
    coro = c.aget_or_load(K, lambda: b"never")
    with pytest.raises(StopIteration) as done:  # finished in its first step: no await at all
        coro.send(None)
    assert done.value.value == b"v" * 8


def test_forty_tasks_over_four_cold_keys_run_four_loads(make_cache):
    c = make_cache(slots_per_rank=16, slot_size=64)
    keys = [bytes([i]) * 16 for i in range(4)]
    runs = []

    async def loader_for(k):
        runs.append(k)
        for _ in range(5):
            await asyncio.sleep(0)  # let every other task join meanwhile
        return k * 2

    async def main():
        tasks = [c.aget_or_load(keys[i % 4], lambda i=i: loader_for(keys[i % 4]), timeout=30)
                 for i in range(40)]
        return await asyncio.gather(*tasks)

    values = asyncio.run(main())
    assert sorted(runs) == sorted(keys)
    assert values == [keys[i % 4] * 2 for i in range(40)]
    assert c._open_handles == 0 and ucmcache.verify(c.uuid).ok


def test_waiting_for_another_process_keeps_the_loop_ticking(make_cache, procs, gate):
    c = make_cache(slot_size=64)
    held, go = gate(), gate()
    _, q = procs.start(safety_workers.load_when_released, c.uuid, K, held.path, go.path)
    held.wait_arrived()  # the other process owns K's load and holds it until we say
    ticks = []

    async def ticker():
        while len(ticks) < 20:
            await asyncio.sleep(0.01)
            ticks.append(1)
        go.release()  # only a loop that kept running gets here

    async def main():
        t = asyncio.create_task(ticker())
        value = await c.aget_or_load(K, lambda: b"never", timeout=60)
        await t
        return value

    assert asyncio.run(main()) == b"from-the-other-process"
    assert procs.result(q) == "published"
    assert len(ticks) == 20


def test_a_cancelled_owner_fails_its_load_for_every_waiter(make_cache):
    c = make_cache(slot_size=64)

    async def main():
        forever, started = asyncio.Event(), asyncio.Event()

        async def stuck():
            started.set()
            await forever.wait()
            return b"never"

        owner = asyncio.create_task(c.aget_or_load(K, stuck))
        await started.wait()  # the owner took the load and awaits its loader
        waiter = asyncio.create_task(c.aget_or_load(K, lambda: b"never", timeout=30))
        await until(waiting(c))  # the waiter joined and waits in its thread
        owner.cancel()
        with pytest.raises(asyncio.CancelledError):
            await owner
        with pytest.raises(LoadFailed, match="CancelledError"):
            await waiter
        return await c.aget_or_load(K, lambda: b"again")  # the next get elects a new owner

    assert asyncio.run(main()) == b"again"
    assert c._open_handles == 0 and ucmcache.verify(c.uuid).ok


def test_a_cancelled_waiter_abandons_the_wait_not_the_load(make_cache):
    c = make_cache(slot_size=64)

    async def main():
        release, started = asyncio.Event(), asyncio.Event()

        async def slow():
            started.set()
            await release.wait()
            return b"loaded"

        owner = asyncio.create_task(c.aget_or_load(K, slow))
        await started.wait()
        waiter = asyncio.create_task(c.aget_or_load(K, lambda: b"never", timeout=30))
        await until(waiting(c))
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        release.set()
        assert await owner == b"loaded"
        with pytest.raises(TimeoutError):
            # Loading, owned from another context (as another thread's would be): a task waits
            # for it with a timeout
            h = contextvars.Context().run(c.get, b"T" * 16)
            try:
                async def wait_other():
                    return await c.aget_or_load(b"T" * 16, lambda: b"never", timeout=0.2)
                await asyncio.create_task(wait_other())
            finally:
                h.fail("done")
                h.close()
        return await c.aget_or_load(K, lambda: b"never")

    assert asyncio.run(main()) == b"loaded"
    assert c._open_handles == 0 and ucmcache.verify(c.uuid).ok


def test_a_hit_is_a_coroutine_asyncio_takes_as_any(make_cache):
    """The hit's answer (made in C, finished in its first step) goes through create_task,
    gather and wait_for like a native coroutine, and cannot be awaited twice."""
    import collections.abc
    c = make_cache(slot_size=64)
    c.get_or_load(K, lambda: b"v" * 8)
    coro = c.aget_or_load(K, lambda: b"never")
    assert isinstance(coro, collections.abc.Coroutine) and asyncio.iscoroutine(coro)

    async def main():
        t = asyncio.create_task(c.aget_or_load(K, lambda: b"never"))
        both = await asyncio.gather(c.aget_or_load(K, lambda: b"never"), t)
        one = await asyncio.wait_for(c.aget_or_load(K, lambda: b"never"), 5)
        return both, one, await coro

    assert asyncio.run(main()) == ([b"v" * 8] * 2, b"v" * 8, b"v" * 8)
    with pytest.raises(RuntimeError, match="reuse"):
        coro.send(None)
    thrown = c.aget_or_load(K, lambda: b"never")
    with pytest.raises(KeyError):
        thrown.throw(KeyError("k"))
    closed = c.aget_or_load(K, lambda: b"never")
    closed.close()
    with pytest.raises(RuntimeError, match="reuse"):
        closed.send(None)
    assert c._open_handles == 0 and c.stats()["fast_hits"] >= 6


def test_a_thousand_tasks_on_one_cold_key_share_one_wait_and_the_loop_keeps_ticking(make_cache):
    """N tasks awaiting a key another thread loads: one waiting thread for them all (not one
    each), a ticker that goes on ticking while they wait (the owner publishes only after 20
    ticks), one task's short timeout ends only that task's wait, and each task counts its own
    wait."""
    import threading
    n = 1000
    c = make_cache(slot_size=64)
    owning, publish = threading.Event(), threading.Event()

    def owner():
        with c.get(K) as h:
            assert h.owner
            owning.set()
            assert publish.wait(60)
            h.data[:5] = b"value"
            h.ready(5)

    t = threading.Thread(target=owner)
    t.start()
    try:
        assert owning.wait(10)
        ticks, most_threads = [], [0]

        async def ticker():
            await until(waiting(c, n + 1))  # every task (and the impatient one) waits
            while len(ticks) < 20:
                await asyncio.sleep(0.01)
                ticks.append(1)
                most_threads[0] = max(most_threads[0], sum(
                    th.name == "ucmcache-wait" for th in threading.enumerate()))
            publish.set()  # only a loop that kept running gets here

        async def impatient():
            with pytest.raises(TimeoutError, match="still loading"):
                await c.aget_or_load(K, lambda: b"never", timeout=0.01)
            return "timed out"

        async def main():
            tick = asyncio.create_task(ticker())
            early = asyncio.create_task(impatient())
            values = await asyncio.gather(*(c.aget_or_load(K, lambda: b"never", timeout=60)
                                            for _ in range(n)))
            await tick
            return values, await early

        waits0 = c.stats()["waits"]
        values, early = asyncio.run(main())
    finally:
        publish.set()
        t.join(30)
    assert values == [b"value"] * n and early == "timed out"
    assert len(ticks) == 20
    assert most_threads[0] == 1, f"{most_threads[0]} waiting threads for one key"
    stats = c.stats()
    assert stats["waits"] - waits0 == n + 1 and stats["wait_timeouts"] >= 1
    assert c._open_handles == 0 and ucmcache.verify(c.uuid).ok


def test_an_exception_at_any_call_of_the_shared_wait_leaves_nothing_waiting_past_close(uuid):
    """A signal handler's exception lands at the calls of wait_loaded_async (CPython runs
    handlers there): raised here after each of its C calls in turn (a profile function at their
    return), before its wait (no awaiter left counted: the entry is unused) or in its cleanup
    (the thread may be left running): once the cache closes, no 'ucmcache-wait' thread runs,
    so none waits on through its freed context."""
    import sys
    import threading
    from ucmcache.core import slots as _slots
    other = ucmcache.SlotCache.create(uuid, slots_per_rank=4, slot_size=64, max_ranks=2)
    try:
        k = b"k" * 16
        # Another caller's load (taken in an empty context): this context's own, even through
        # the other cache of the segment, would be refused to the wait rather than waited for.
        owner = contextvars.Context().run(other.get, k)
        assert owner.owner
        at = 0
        while True:
            c = ucmcache.SlotCache.attach(uuid)
            assert at < 50, "the wait never reached its timeout"
            seen = [0]

            def prof(frame, event, arg):
                if event == "c_return" and frame.f_code.co_name == "wait_loaded_async":
                    seen[0] += 1
                    if seen[0] == at + 1:
                        raise KeyboardInterrupt(f"at the wait's C call {at + 1}")

            async def main():
                sys.setprofile(prof)
                try:
                    await c.aget_or_load(k, lambda: b"x", timeout=0.05)
                except (KeyboardInterrupt, TimeoutError) as e:
                    return e
                finally:
                    sys.setprofile(None)

            got = asyncio.run(main())
            waits = [w for t in list(_slots._loop_waits.values()) for w in t.values()]
            assert all(w.awaiting == 0 for w in waits), (at, got)
            c.close()
            alive = [t for t in threading.enumerate()
                     if t.name == "ucmcache-wait" and t.is_alive()]
            assert not alive, (at, got)
            if not isinstance(got, KeyboardInterrupt):
                break  # past the wait's last C call: it timed out as asked
            at += 1
        assert at >= 6  # before the wait: the loop, the lock, the clock, the table, the count
        owner.close()
    finally:
        other.close()
