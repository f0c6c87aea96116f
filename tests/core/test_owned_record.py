"""The owned-slot record (ucmcache/core/slots.py, DESIGN 4.6): the loads a context owns, so that a
wait for one of them (a loader asking for its own key) is refused rather than never ending.

A task's aget_or_load gives the task a record of its own, once, which inherits the loads in
flight of the record it had, by reference to the sets they are in: a handle the task opened
before keeps discarding its slot from the set it recorded it in, and that discard is seen.  (With
a copy, the slot stayed in the copy: once reused for another key loaded by someone else, the
task's join of it was refused as a wait for itself.)  Loads its creator starts later are not
the task's.
"""
import asyncio
import contextvars
import multiprocessing
import sys

import pytest

import ucmcache
from ucmcache import UcmError
from ucmcache.core import slots as _slots
from ucmcache._core import lib

from owned_helpers import (K1, K2, K3, REFUSED, SHORT, one_slot_cache, own_elsewhere,
                           run_task, wait_for)


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


async def join_and_read(c, key, asked):
    """Join key's load (another caller's), say so, wait for it and read its value."""
    with c.get(key) as j:
        assert not j.owner
        asked.set()
        await j.wait_async(30)
        return bytes(j.data)


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
    """A task's record inherits its creator's loads in flight: a load the creator owns is the
    child's own too (the creator may be awaiting the child), and once the creator's load ends
    its slot is no longer the child's, though the child's record was made while it was owned."""
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
    miss made: nothing is made or copied again."""
    c = make_cache(slots_per_rank=4, max_ranks=1, slot_size=64)

    async def main():
        assert await c.aget_or_load(b"k" * 16, lambda: b"v") == b"v"
        first = _slots._owning.get()
        for i in range(1000):
            key = i.to_bytes(16, "little")
            assert await c.aget_or_load(key, lambda: b"v") == b"v"   # each a miss
        return first, _slots._owning.get()

    first, last = run_task(c, main, "in_task")
    assert last is first and last.inherited == ()
    assert [len(s) for s in last.values()] == [0]     # one cache's set, its loads ended


def test_generations_of_tasks_inherit_only_the_loads_in_flight(make_cache):
    """Each task owns a load while it makes the next and waits until the next has isolated,
    then ends its load: the next inherits that one load (refused to it while it runs), never
    the ended ones of the generations before: after 300 generations a record inherits one set
    (unless ended loads' sets were carried on: then one more per generation)."""
    c = make_cache(slots_per_rank=8, max_ranks=1, slot_size=64)
    inherited = []

    async def generation(n, isolated):
        assert await c.aget_or_load(n.to_bytes(16, "little"), lambda: b"v") == b"v"  # a miss
        inherited.append(len(_slots._owning.get().inherited))
        isolated.set()                          # the creator may end its load now
        if not n:
            return None
        with c.get((n + 1000).to_bytes(16, "little")) as h:
            assert h.owner
            next_isolated = asyncio.Event()
            nxt = asyncio.create_task(generation(n - 1, next_isolated))
            await next_isolated.wait()          # the next isolates while this load runs
            h.ready(0)
        return nxt

    async def main():
        task = asyncio.create_task(generation(300, asyncio.Event()))
        while task is not None:                 # each generation's result: the next one
            task = await task

    run_task(c, main, "in_task")
    assert len(inherited) == 301
    assert inherited[0] == 0 and set(inherited[1:]) == {1}, inherited


def test_a_load_the_creator_starts_later_is_not_the_tasks_own(make_cache):
    """A long-lived worker task isolated early; its creator then loads K with a loader that
    does not await the worker, and the worker asks for K meanwhile: it waits for the creator's
    load and reads its value (a record linked to the creator's refused it as its own)."""
    c = make_cache(slots_per_rank=4, max_ranks=1, slot_size=64)

    async def main():
        assert await c.aget_or_load(K3, lambda: b"m") == b"m"      # the creator isolated
        isolated, go, asked = asyncio.Event(), asyncio.Event(), asyncio.Event()

        async def worker():
            assert await c.aget_or_load(K2, lambda: b"w") == b"w"  # the worker isolated
            isolated.set()
            await go.wait()
            return await join_and_read(c, K1, asked)               # the creator's load

        w = asyncio.create_task(worker())
        await isolated.wait()

        async def loader():
            go.set()
            await asyncio.wait_for(asked.wait(), 30)               # the worker has joined
            return b"creator"

        assert await c.aget_or_load(K1, loader) == b"creator"
        return await w

    assert run_task(c, main, "in_task") == b"creator"
    assert c._open_handles == 0 and ucmcache.verify(c.uuid).ok


@pytest.mark.skipif(sys.version_info < (3, 11), reason="create_task(context=) is 3.11+")
def test_tasks_sharing_one_context_keep_a_bounded_record(make_cache):
    """Two tasks made with one context take turns missing: each miss finds the record made for
    the other and makes one for itself, inheriting only loads in flight (none here), so the
    record does not grow with the turns."""
    c = make_cache(slots_per_rank=8, max_ranks=1, slot_size=64)
    sizes = []

    async def turn(me, mine, theirs):
        for i in range(200):
            await mine.wait()
            mine.clear()
            key = (me * 100_000 + i).to_bytes(16, "little")
            assert await c.aget_or_load(key, lambda: b"v") == b"v"
            sizes.append(len(_slots._owning.get().inherited))
            theirs.set()

    async def main():
        ctx = contextvars.copy_context()
        one, two = asyncio.Event(), asyncio.Event()
        one.set()
        await asyncio.gather(asyncio.create_task(turn(1, one, two), context=ctx),
                             asyncio.create_task(turn(2, two, one), context=ctx))

    run_task(c, main, "in_task")
    assert len(sizes) == 400 and max(sizes) == 0, sizes


def _record_in_child(q):
    r = _slots._owning.get()
    q.put([sorted(len(s) for s in r.values()), list(r.inherited)])


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
    assert got == [[], []]
    assert p.exitcode == 0


@pytest.mark.parametrize("end", ["fail", "ready_then_clear"])
def test_a_later_load_of_the_creator_on_the_same_slot_is_not_inherited(make_cache, end):
    """The creator owns a load when its child isolates (the child inherits it); that load ends,
    and the creator's next load, of another key, takes the same slot before the child looks
    again: the child waits for it and reads its value (an inherited load known by its slot
    alone was refused as the child's own)."""
    c = one_slot_cache(make_cache)

    async def main():
        h1 = c.get(K1)
        assert h1.owner
        isolated, go, asked = asyncio.Event(), asyncio.Event(), asyncio.Event()

        async def child():
            assert await c.aget_or_load(K2, lambda: b"two") == b"two"  # isolates (a bypass)
            isolated.set()
            await go.wait()
            return await join_and_read(c, K3, asked)  # the creator's later load, on h1's slot

        task = asyncio.create_task(child())
        await isolated.wait()
        if end == "fail":
            h1.fail("ended")
        else:
            h1.ready(0)
        h1.close()
        if end == "ready_then_clear":
            c.clear()                             # K1 invisible: its slot is taken next
        h3 = c.get(K3)
        assert h3.owner and h3.slot == h1.slot
        go.set()
        await asyncio.wait_for(asked.wait(), 30)
        h3.data[:5] = b"three"
        h3.ready(5)
        h3.close()
        return await task

    assert run_task(c, main, "in_task") == b"three"
    assert c._open_handles == 0 and ucmcache.verify(c.uuid).ok


def test_a_load_inherited_while_its_caches_context_is_away_is_known_by_its_slot(make_cache):
    """Another thread's close() takes the cache's context away while it looks for handles made
    meanwhile, and gives it back when it refuses: a record made then cannot read its inherited
    load's install serial, and knows that load by its slot alone, so the child's wait for it is
    still refused (taken for no load, it would wait for a creator awaiting it: forever)."""
    c = make_cache(slots_per_rank=4, max_ranks=1, slot_size=64)
    creator, child = contextvars.Context(), contextvars.Context()
    h = creator.run(c.get, K1)
    assert h.owner
    try:
        ctx, c._ctx = c._ctx, None                 # as inside close(), before it refuses
        try:
            inherited = creator.run(lambda: _slots._owning.get().inherit())
        finally:
            c._ctx = ctx
        child.run(_slots._owning.set, _slots.OwnedRecord(inherited))
        assert child.run(_slots.owns_load, c, h.slot)
        with pytest.raises(UcmError, match=REFUSED):
            child.run(wait_for, c, K1, 30)
    finally:
        h.fail("done")
        h.close()


def _close_parents_owner_in_child(h, q):
    owned = h._owned                      # the set the parent recorded the load in (a copy)
    was = h.slot in owned
    h.close()                             # the cache is not usable here: no pin to drop
    q.put((was, h.slot in owned))


def test_an_owners_load_leaves_its_owned_set_when_its_cache_is_not_usable(make_cache):
    """An owner's handle dropped when its cache is no longer usable (closed, collected first
    in a cycle with the handle, or a forked child's copy) has no pin to drop, but its load ends
    with it: its slot leaves the owned set it was recorded in (left there, a cache made later
    with the same id() would read it and refuse that slot's joins as this context's own load).
    Driven in a forked child, where the parent's cache is not usable."""
    c = make_cache(slot_size=64)
    h = c.get(K1)
    assert h.owner
    try:
        ctx = multiprocessing.get_context("fork")
        q = ctx.Queue()
        p = ctx.Process(target=_close_parents_owner_in_child, args=(h, q))
        p.start()
        try:
            got = q.get(timeout=30)
        finally:
            p.join(30)
        assert p.exitcode == 0
        assert got == (True, False)
    finally:
        h.fail("done")
        h.close()


@pytest.mark.parametrize("order", ["cache_first", "handle_first"])
def test_an_owner_collected_with_its_cache_leaves_no_slot_owned(uuid, order):
    """An owner's handle and its cache collected together in a cycle (the cache closed by its
    finalizer, which may run before the handle's): the handle's load ends with it, and its
    slot leaves the owned set, which a cache made later with the same id() would read."""
    import gc
    import warnings
    c = ucmcache.SlotCache.create(uuid, slots_per_rank=4, slot_size=64, max_ranks=1)
    try:
        h = c.get(K1)
        assert h.owner
        owned = h._owned
        assert owned == {h.slot}
        c.cycle = h if order == "cache_first" else [h]     # cache -> handle -> cache
        del c, h
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ResourceWarning)  # collected without close()
            gc.collect()
        assert owned == set()
    finally:
        ucmcache.SlotCache.unlink(uuid)


def test_an_owner_closed_while_a_close_has_the_context_away_keeps_its_slot_owned(make_cache):
    """Another thread's close() takes the context away while it looks for handles made
    meanwhile, and gives it back when it refuses.  An owner's handle closed in that moment
    drops no pin (its load goes on until the handle is collected: design 8) and keeps its slot
    in the owned set: its context's wait for that key is refused, not left waiting for itself.
    (The other thread's steps are played by the close's own hooks, as in test_promises.)"""
    c = make_cache(slots_per_rank=4, max_ranks=1, slot_size=64)
    made = {}
    detach, live = c._detach_ctx, c._live_handles

    def detach_after_gets():          # "another thread" gets K1 (owner) and K2 meanwhile
        made["owner"], made["other"] = c.get(K1), c.get(K2)
        return detach()

    def live_closing_the_owner():     # ... and closes its owner while the context is away
        if c._ctx is None and "closed" not in made:
            made["closed"] = True
            made["owner"].close()
        return live()

    c._detach_ctx, c._live_handles = detach_after_gets, live_closing_the_owner
    try:
        with pytest.raises(UcmError, match="cannot close"):
            c.close()
    finally:
        del c._detach_ctx, c._live_handles
    owner, other = made.pop("owner"), made.pop("other")
    try:
        assert owner.slot in owner._owned
        with pytest.raises(UcmError, match=REFUSED):
            wait_for(c, K1, 30)
    finally:
        slot = owner.slot
        del owner
        other.fail("done")
        other.close()
    assert lib.ucm_slot_state(c._ctx, slot) == lib.UCM_FAILED   # the collected owner failed it


def _own_slot_elsewhere(c, slot, held):
    """Another caller's owner (taken in an empty context) of a new key's load on ``slot``: keys
    whose loads land elsewhere are owned too (kept in ``held``) until one lands there."""
    for n in range(100, 100 + c.slots_per_rank * c.max_ranks + 1):
        h = contextvars.Context().run(c.get, bytes([n]) * 16)
        held.append(h)
        assert h.owner
        if h.slot == slot:
            return h, bytes([n]) * 16
    raise AssertionError(f"no new key's load took slot {slot}")


@pytest.mark.parametrize("kind", ["handle", "batch"])
def test_an_owner_closed_while_a_close_had_the_context_away_owns_nothing_once_collected(
        make_cache, kind):
    """The owner above (a handle, or a batch owning its position) keeps its slot owned while
    its load goes on, until it is collected: then its pin drops, its load fails, and its slot
    leaves the owned set too.  Another caller's next load of that slot is waited for by this
    context (until the timeout), not refused as this context's own.  (Before: the slot stayed
    in the set for good, refusing every later wait on it, and after the cache's close the set
    stayed in the record under id(cache), where a cache made later with the same id() found
    it: tests/core/test_owned_across_caches.py's wait for another caller's load failed so.)"""
    import gc
    c = make_cache(slots_per_rank=2, max_ranks=1, slot_size=64)
    made = {}
    detach, live = c._detach_ctx, c._live_handles

    def detach_after_gets():          # "another thread" owns K1 and pins K2 meanwhile
        made["owner"] = c.get(K1) if kind == "handle" else c.get_many([K1])
        made["other"] = c.get(K2)
        return detach()

    def live_closing_the_owner():     # ... and closes its owner while the context is away
        if c._ctx is None and "closed" not in made:
            made["closed"] = True
            made["owner"].close()
        return live()

    c._detach_ctx, c._live_handles = detach_after_gets, live_closing_the_owner
    try:
        with pytest.raises(UcmError, match="cannot close"):
            c.close()
    finally:
        del c._detach_ctx, c._live_handles
    owner, other = made.pop("owner"), made.pop("other")
    held = [other]
    try:
        slot = owner.slot if kind == "handle" else int(owner.slots[0])
        with pytest.raises(UcmError, match=REFUSED):   # its load goes on: still refused
            wait_for(c, K1, 30)
        del owner
        gc.collect()
        assert lib.ucm_slot_state(c._ctx, slot) == lib.UCM_FAILED   # its load ended
        held.remove(other)
        other.fail("done")
        other.close()
        _, key = _own_slot_elsewhere(c, slot, held)
        with pytest.raises(TimeoutError):
            wait_for(c, key, SHORT)
    finally:
        for h in held:
            h.fail("done")
            h.close()
