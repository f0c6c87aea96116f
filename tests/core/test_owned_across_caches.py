"""The owned-slot record (ucmcache/core/slots.py, DESIGN 4.6) across the caches of one process:
two caches of one segment share it (a loader asking for its key through the other cache is
refused, a task inherits through either, another caller's load is waited for through
either); a cache of another segment, or of a uuid unlinked and made again, does not; the
record holds the sets of open caches only; threads sharing a context refuse each other's
loads naming it."""
import asyncio
import contextlib
import contextvars
import re
import signal

import pytest

import ucmcache
from ucmcache import UcmError
from ucmcache.core import slots as _slots

from owned_helpers import (K1, K2, K3, REFUSED, SHORT, one_slot_cache, own_elsewhere,
                           run_task, wait_for)


class Hung(Exception):
    pass


@contextlib.contextmanager
def bounded(seconds=30):
    """A wait that would never end (the bug) raises Hung after ``seconds`` instead: SIGALRM's
    handler runs between the wait's slices (the C wait and the full path both let it in)."""
    def on_alarm(signum, frame):
        raise Hung(f"still waiting after {seconds} s: a wait for this context's own load")
    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


@pytest.fixture
def two_caches(make_cache):
    """Two caches of one segment in this process (a library and an application each attach)."""
    c1 = make_cache(slots_per_rank=4, max_ranks=2, slot_size=64)
    c2 = ucmcache.SlotCache.attach(c1.uuid)
    try:
        yield c1, c2
    finally:
        c2.close()


def ask_again(c2, how, key):
    """Ask for key through c2, each way a caller may wait for a load (no timeout: the wait
    would be for ever; the C paths where there are)."""
    if how == "get_or_load":                       # the cold path in C, joined
        return c2.get_or_load(key, lambda: b"never")
    if how == "get_or_load_timeout":               # the full path
        return c2.get_or_load(key, lambda: b"never", timeout=600)
    if how == "get_then_wait":
        with c2.get(key) as j:
            assert not j.owner
            return j.wait()
    if how == "get_many_then_wait":
        with c2.get_many([key]) as b:
            assert not b.owner[0]
            return b.wait()
    if how == "aget_or_load":
        return asyncio.run(c2.aget_or_load(key, lambda: b"never"))
    if how == "wait_async":
        async def main():
            with c2.get(key) as j:
                return await j.wait_async()
        return asyncio.run(main())
    raise AssertionError(how)


ASK = ["get_or_load", "get_or_load_timeout", "get_then_wait", "get_many_then_wait",
       "aget_or_load", "wait_async"]


@pytest.mark.parametrize("how", ASK)
def test_a_loader_asking_for_its_key_through_another_cache_of_the_segment_is_refused(
        two_caches, how):
    """The issue's repro, c1.get_or_load(k, lambda: c2.get_or_load(k, ...)), and each other
    way to wait: the load this thread owns through c1 is refused to its wait through c2, with
    the documented error (it waited for ever: the record was keyed by the cache object)."""
    c1, c2 = two_caches

    def loader():
        with pytest.raises(UcmError, match=REFUSED):
            ask_again(c2, how, K1)
        return b"one"
    with bounded():
        assert c1.get_or_load(K1, loader) == b"one"
    with bounded():                                # and the loader's own error, unhandled
        with pytest.raises(UcmError, match=REFUSED):
            c1.get_or_load(K2, lambda: c2.get_or_load(K2, lambda: b"never"))
    assert c2.get_or_load(K2, lambda: b"two") == b"two"   # K2's load failed: loaded again
    assert c1._open_handles == c2._open_handles == 0 and ucmcache.verify(c1.uuid).ok


def test_a_task_inherits_its_creators_load_through_another_cache_of_the_segment(two_caches):
    """A child task inherits its creator's loads in flight through c1; its wait for one of
    them through c2 is refused too (the creator may be awaiting it)."""
    c1, c2 = two_caches

    async def main():
        with c1.get(K1) as h:
            assert h.owner

            async def child():
                assert await c2.aget_or_load(K2, lambda: b"two") == b"two"  # isolates
                with pytest.raises(UcmError, match=REFUSED):
                    await c2.aget_or_load(K1, lambda: b"never")
                with pytest.raises(UcmError, match=REFUSED):
                    wait_for(c2, K1, 600)
            await asyncio.create_task(child())
            h.data[:3] = b"one"
            h.ready(3)
        return await c2.aget_or_load(K1, lambda: b"never")

    with bounded():
        assert run_task(c1, main, "in_task") == b"one"
    assert c1._open_handles == c2._open_handles == 0 and ucmcache.verify(c1.uuid).ok


@pytest.mark.parametrize("how", ["get_then_wait", "get_many_then_wait", "aget_or_load"])
def test_another_callers_load_is_waited_for_through_either_cache(two_caches, how):
    """Not over-refused: while this thread owns K1's load through c1, a load of K3 that another
    caller owns is waited for through c2 (until the timeout, as nobody publishes it)."""
    c1, c2 = two_caches
    other = own_elsewhere(c1, K3)
    try:
        with c1.get(K1) as h:
            assert h.owner and h.slot != other.slot
            with pytest.raises(TimeoutError):
                if how == "aget_or_load":
                    asyncio.run(c2.aget_or_load(K3, lambda: b"never", timeout=SHORT))
                elif how == "get_then_wait":
                    wait_for(c2, K3, SHORT)
                else:
                    with c2.get_many([K3]) as b:
                        b.wait(SHORT)
            h.fail("done")
    finally:
        other.fail("done")
        other.close()


def test_a_cache_of_another_segment_does_not_share_the_record(make_cache, uuid):
    """The same slot number of another segment is another load: this thread owns slot 0's
    load on one segment; its wait for another caller's load on slot 0 of a second segment goes
    on (until its timeout), through a cache made after the first one's."""
    c1 = one_slot_cache(make_cache)
    u2 = uuid + "-b"
    c3 = ucmcache.SlotCache.create(u2, slots_per_rank=1, max_ranks=1, slot_size=64)
    try:
        with c1.get(K1) as h:
            assert h.owner
            other = own_elsewhere(c3, K1)         # the same key, the same slot, elsewhere
            try:
                assert other.slot == h.slot
                with pytest.raises(TimeoutError):
                    wait_for(c3, K1, SHORT)
            finally:
                other.fail("done")
                other.close()
            h.fail("done")
    finally:
        c3.close()
        ucmcache.SlotCache.unlink(u2)


def test_a_uuid_unlinked_and_created_again_is_another_segment(uuid):
    """A segment is its file: c_old stays attached to a segment whose uuid was unlinked and
    created again; a load this thread owns through c_old is not one on the new segment, whose
    slot 0 another caller loads: the wait for that goes on (until its timeout)."""
    params = dict(slots_per_rank=1, max_ranks=2, slot_size=64)
    c_old = ucmcache.SlotCache.create(uuid, **params)
    ucmcache.SlotCache.unlink(uuid)
    c_new = ucmcache.SlotCache.create(uuid, **params)
    try:
        with c_old.get(K1) as h:
            assert h.owner
            other = own_elsewhere(c_new, K1)
            try:
                assert other.slot == h.slot
                with pytest.raises(TimeoutError):
                    wait_for(c_new, K1, SHORT)
            finally:
                other.fail("done")
                other.close()
            h.fail("done")
    finally:
        c_new.close()
        c_old.close()


def test_a_record_holds_the_sets_of_open_caches_only(make_cache):
    """A context that loads through many caches of a segment, each closed after (and kept
    alive, so no id is reused), keeps the sets of the open ones only, and owns_load looks at the
    caches open on the segment, not at every set the record ever held (before: a set per cache
    for ever, each looked at by every Loading wait: 1,001 sets, 51 us a wait).  The loads still
    counted are found through the open cache; a closed cache's are not."""
    c1 = make_cache(slots_per_rank=4, max_ranks=3, slot_size=64)
    c2 = ucmcache.SlotCache.attach(c1.uuid)

    def run():
        assert c1.get_or_load(K1, lambda: b"one") == b"one"
        closed = []
        for i in range(20):
            c = ucmcache.SlotCache.attach(c1.uuid)
            assert c.get_or_load(bytes([i]) * 16, lambda: b"x") == b"x"
            c.close()
            closed.append(c)
        record = _slots._owning.get()
        assert sorted(record) == sorted([c1._owned_key])
        with c2.get(K2) as h:                      # a load owned through c2, in flight
            assert h.owner and _slots.owns_load(c1, h.slot)
            assert sorted(record) == sorted([c1._owned_key, c2._owned_key])
            assert set(c1._segment_id.caches) == {c1._owned_key, c2._owned_key}
            h.fail("done")
        return closed
    try:
        assert len(contextvars.Context().run(run)) == 20
    finally:
        c2.close()


@pytest.mark.parametrize("through", ["the same cache", "another cache of the segment"])
def test_threads_sharing_a_context_refuse_each_others_loads_naming_it(make_cache, through):
    """The documented limit (design 8): two requests' threads made from one context
    (asyncio.to_thread after a startup get_or_load made that context's record) share the
    record, so the second's wait for the first's load is refused as a loader's wait for itself:
    the record cannot tell a sibling from the loader's own hop to a thread.  The refusal
    names the context, not 'this thread' (before: "this thread is loading this key itself",
    untrue of the second thread).  Through the same cache this predates the record's reach to
    other caches of the segment, which widened it to them."""
    import threading
    c1 = make_cache(slots_per_rank=4, max_ranks=2, slot_size=64)
    c2 = ucmcache.SlotCache.attach(c1.uuid)
    via = c1 if through == "the same cache" else c2
    started, release = threading.Event(), threading.Event()
    shared = contextvars.Context()
    shared.run(c2.get_or_load, K3, lambda: b"warm")            # startup: the record made
    got = {}

    def loader():
        started.set()
        assert release.wait(30)
        return b"one"

    def request(name, fn):
        try:
            got[name] = fn()
        except BaseException as e:
            got[name] = e
        finally:
            started.set()
            release.set()

    first = threading.Thread(target=shared.copy().run,
                             args=(request, "first", lambda: c1.get_or_load(K1, loader)))
    second = threading.Thread(target=shared.copy().run, args=(
        request, "second", lambda: via.get_or_load(K1, lambda: b"never", timeout=5)))
    try:
        first.start()
        assert started.wait(30)
        second.start()
        second.join(30)
        release.set()
        first.join(30)
        assert not first.is_alive() and not second.is_alive()
        assert got["first"] == b"one"
        assert isinstance(got["second"], UcmError)
        assert re.match(r"^this thread or a thread or task sharing its context \("
                        r"asyncio.to_thread, copy_context\(\).run\) is loading this key",
                        str(got["second"]))
        assert via.get_or_load(K1, lambda: b"never") == b"one"
    finally:
        release.set()
        c2.close()
