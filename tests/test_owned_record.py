"""The owned-slot record (ucmcache/_slots.py, DESIGN 4.6): the loads a context owns, so that a
wait for one of them (a loader asking for its own key) is refused rather than never ending.

A task's aget_or_load gives the task a record of its own, once, linked to the record it came
from: a handle the task opened before keeps discarding its slot from the set it recorded it in,
and that discard is seen.  (With a copy, the slot stayed in the copy: once reused for another
key loaded by someone else, the task's join of it was refused as a wait for itself.)
"""
import asyncio
import contextvars
import multiprocessing

import pytest

import ucmcache
from ucmcache import UcmError, _slots

K1, K2, K3 = b"1" * 16, b"2" * 16, b"3" * 16
SHORT = 0.05  # a wait that must end by its timeout: nobody publishes meanwhile
REFUSED = r"^this (task|thread) is loading (this key|one of these keys) itself"


def one_slot_cache(make_cache):
    """One slot in all: every key takes the slot the last one left."""
    return make_cache(slots_per_rank=1, max_ranks=1, slot_size=64)


def wait_for(c, key, timeout):
    """Join key's load and wait for it (the C wait)."""
    with c.get(key) as j:
        assert not j.owner
        return j.wait(timeout)


def own_elsewhere(c, key):
    """The owner's handle of key's load, taken in an empty context: another caller's load (as
    another thread's or process's would be), none of the test task's records."""
    h = contextvars.Context().run(c.get, key)
    assert h.owner
    return h


async def own_then_isolate(c):
    """This task owns K1's load (the one slot), then an aget_or_load miss gives it a record of
    its own (the slot is pinned: a bypass), then its load ends: the slot is free for reuse."""
    with c.get(K1) as h:
        assert h.owner
        assert await c.aget_or_load(K2, lambda: b"two") == b"two"
        h.data[:3] = b"one"
        h.ready(3)
    return h.slot


async def join_and_wait(c, how):
    """Join K3 (loaded by another caller) from this task and wait for it: a TimeoutError, as
    nobody publishes; never refused as this task's own load."""
    if how == "aget_or_load":
        await c.aget_or_load(K3, lambda: b"never", timeout=SHORT)
    elif how == "wait":
        wait_for(c, K3, SHORT)
    elif how == "wait_async":
        with c.get(K3) as j:
            await j.wait_async(SHORT)
    else:
        with c.get_many([K3]) as b:
            assert not b.owner[0]
            b.wait(SHORT)


def run_task(c, main, record):
    """asyncio.run(main()) in a new context, whose owned-slot record is made either outside the
    task ("outside": an owner's get there, so the task's first aget_or_load miss links a record
    of its own to it) or inside it ("in_task": by the task's first owner, for the task)."""
    def run():
        if record == "outside":
            with c.get(K1) as h:
                assert h.owner
                h.fail("a load of this context, outside any task")
        return asyncio.run(main())
    return contextvars.Context().run(run)


@pytest.mark.parametrize("record", ["outside", "in_task"])
@pytest.mark.parametrize("how", ["aget_or_load", "wait", "wait_async", "batch"])
def test_a_slot_this_task_loaded_once_is_not_its_own_when_another_loads_it(make_cache, how,
                                                                           record):
    """The review's repro: a task owns a load, isolates (an aget_or_load miss), ends its load;
    the slot is reused for K3, whose load another caller owns: the task's join waits."""
    c = one_slot_cache(make_cache)

    async def main():
        slot = await own_then_isolate(c)
        other = own_elsewhere(c, K3)                # evicts K1: the same slot, Loading
        try:
            assert other.slot == slot
            with pytest.raises(TimeoutError):
                await join_and_wait(c, how)
            other.data[:5] = b"three"
            other.ready(5)
        finally:
            other.close()
        return await c.aget_or_load(K3, lambda: b"never")

    assert run_task(c, main, record) == b"three"
    assert c._open_handles == 0 and ucmcache.verify(c.uuid).ok


def test_a_tasks_own_load_is_refused_after_it_isolated(make_cache):
    """The record still catches what it is for: a task that owns a load (after its record is
    its own) and asks for the key again, itself or through a thread its loader hands work to
    (asyncio.to_thread shares the task's record), is refused at once."""
    c = make_cache(slot_size=64)

    async def main():
        assert await c.aget_or_load(K2, lambda: b"two") == b"two"      # a miss: isolated
        with c.get(K1) as h:
            assert h.owner
            with pytest.raises(UcmError, match=REFUSED):
                await c.aget_or_load(K1, lambda: b"never")
            with pytest.raises(UcmError, match=REFUSED):
                await asyncio.to_thread(wait_for, c, K1, 30)
            h.fail("done")

        async def loader():                       # hands its work to a thread
            return await asyncio.to_thread(c.get_or_load, K3, lambda: b"never")
        with pytest.raises(UcmError, match=REFUSED):
            await c.aget_or_load(K3, loader)

    run_task(c, main, "outside")
    assert c._open_handles == 0 and ucmcache.verify(c.uuid).ok


def test_a_child_task_sees_its_creators_loads_until_they_end(make_cache):
    """A task's record links to its creator's: a load the creator owns is the child's own too
    (the creator may be awaiting the child), and once the creator's load ends its slot is no
    longer the child's, though the child's record was made while it was owned."""
    c = one_slot_cache(make_cache)

    async def main():
        h = c.get(K1)
        assert h.owner
        isolated, ended = asyncio.Event(), asyncio.Event()

        async def child():
            assert await c.aget_or_load(K2, lambda: b"two") == b"two"  # isolates (a bypass)
            with pytest.raises(UcmError, match=REFUSED):
                wait_for(c, K1, 30)               # the creator's load: refused, not waited
            isolated.set()
            await ended.wait()
            other = own_elsewhere(c, K3)          # the creator's slot, Loading for another
            try:
                with pytest.raises(TimeoutError):
                    await join_and_wait(c, "wait")
            finally:
                other.close()

        task = asyncio.create_task(child())
        await isolated.wait()
        h.data[:3] = b"one"
        h.ready(3)
        h.close()
        ended.set()
        await task

    run_task(c, main, "in_task")
    assert c._open_handles == 0 and ucmcache.verify(c.uuid).ok


def test_a_task_isolates_once_however_often_it_misses(make_cache):
    """A long-lived task's thousand aget_or_load misses keep one record, the one its first
    miss made: its chain does not grow and no set is copied."""
    c = make_cache(slots_per_rank=4, max_ranks=1, slot_size=64)

    async def main():
        assert await c.aget_or_load(b"k" * 16, lambda: b"v") == b"v"
        first = list(_slots.owned_records())
        for i in range(1000):
            key = i.to_bytes(16, "little")
            assert await c.aget_or_load(key, lambda: b"v") == b"v"   # each a miss
        return first, list(_slots.owned_records())

    first, last = run_task(c, main, "in_task")
    assert len(first) == 1 and len(last) == 1 and last[0] is first[0]
    assert [len(s) for s in last[0].values()] == [0]     # one cache's set, its loads ended


def test_generations_of_tasks_keep_a_short_chain(make_cache):
    """Each task makes the next, waits until it has isolated, then ends: unless the records of
    ended tasks holding no load are skipped, the chain grows a link per generation.  After 300
    generations no task's chain is longer than its live ancestry (itself and its creator)."""
    c = make_cache(slots_per_rank=4, max_ranks=1, slot_size=64)
    lengths = []

    async def generation(n, isolated):
        assert await c.aget_or_load(n.to_bytes(16, "little"), lambda: b"v") == b"v"  # a miss
        lengths.append(len(list(_slots.owned_records())))
        isolated.set()                          # the creator may end now
        if not n:
            return None
        next_isolated = asyncio.Event()
        nxt = asyncio.create_task(generation(n - 1, next_isolated))
        await next_isolated.wait()              # the next isolates while this one runs
        return nxt

    async def main():
        task = asyncio.create_task(generation(300, asyncio.Event()))
        while task is not None:                 # each generation's result: the next one
            task = await task

    run_task(c, main, "in_task")
    assert len(lengths) == 301
    assert max(lengths) == 2, lengths


def _record_in_child(q):
    q.put([sorted(len(s) for s in r.values()) for r in _slots.owned_records()])


def test_a_forked_child_starts_with_an_empty_record(make_cache):
    """A forked child owns none of its parent's loads: its record names none of them."""
    c = make_cache(slot_size=64)
    with c.get(K1) as h:
        assert h.owner and _slots.owns_load(c, h.slot)
        ctx = multiprocessing.get_context("fork")
        q = ctx.Queue()
        p = ctx.Process(target=_record_in_child, args=(q,))
        p.start()
        try:
            got = q.get(timeout=30)
        finally:
            p.join(30)
        h.fail("done")
    assert got == [[]]
    assert p.exitcode == 0
