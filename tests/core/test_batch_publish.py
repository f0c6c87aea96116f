"""A batch's misses claimed in one C call (SlotCache._pin_slow_many, ucm_get_slow_many) and its
owned loads published in one (HandleBatch.ready_many, ucm_publish_many): the same pins, owners,
load serials (I4) and answers as one key at a time, the policy's answers still decided in
Python, every input checked before a shared word changes."""
import os
import threading

import pytest

import ucmcache
from ucmcache import CacheFull, SlotCache, UcmError
from ucmcache.core import hooks
from ucmcache.core.hooks import Gate
from ucmcache._core import lib


def _keys(n):
    return [os.urandom(16) for _ in range(n)]


def test_a_batch_of_misses_is_claimed_in_one_call_and_a_policy_answer_goes_to_python(
        make_cache):
    """A fresh rank's first step answers MOVED (its share of the arenas is not looked at yet):
    that position goes through _pin_slow with the C step counted as its first, then the C
    call goes on with the next; every position owned, with its own load serial."""
    c = make_cache(slots_per_rank=4, slot_size=64, max_ranks=2)
    answers = []
    real = c._pin_slow

    def spy(*a, **kw):
        answers.append(kw.get("answer"))
        return real(*a, **kw)

    c._pin_slow = spy
    keys = _keys(8)
    with c.get_many(keys) as b:
        assert answers == [lib.UCM_MOVED]   # one Python frame for 8 misses
        assert b.owner.all() and (b._serials > 0).all()
        assert (b._lens == -1).all() and len(set(b.slots.tolist())) == 8
        for i in range(8):
            b.data(i)[:4] = bytes([i]) * 4
        b.ready_many(range(8), 4)
    for i, k in enumerate(keys):
        assert c.get_or_load(k, lambda: b"none") == bytes([i]) * 4
    assert ucmcache.verify(c.uuid).ok


def test_each_owned_position_gets_its_own_slots_load_serial(make_cache):
    """Slots installed different numbers of times (loads failed 1-5 times first): each owned
    position's serial is its own slot's (I4), asked inside the same C call."""
    c = make_cache(slots_per_rank=4, slot_size=64, max_ranks=2)
    for rounds in range(5):
        with c.get_many(_keys(rounds + 1)) as b:
            for i in range(len(b)):
                b.fail(i, "cycled")
    with c.get_many(_keys(8)) as b:
        serials = [lib.ucm_load_serial(c._ctx, int(s)) for s in b.slots]
        assert len(set(serials)) > 1, serials
        assert b._serials.tolist() == serials
        b.ready_many(range(8), 1)
    assert ucmcache.verify(c.uuid).ok


def test_a_batch_mixing_hits_misses_and_a_repeated_key_pins_each_as_get_many_did(make_cache):
    c = make_cache(slots_per_rank=8, slot_size=64, max_ranks=2)
    hit = os.urandom(16)
    c.get_or_load(hit, lambda: b"hit!")
    new = os.urandom(16)
    with c.get_many([new, hit, new, os.urandom(16)]) as b:
        assert b.owner.tolist() == [True, False, False, True]
        assert bytes(b.data(1)) == b"hit!"
        assert b.slots[0] == b.slots[2]            # the repeat joins the first's load
        b.ready_many([0, 3], [1, 2])
        assert b.state.tolist() == ["ready"] * 4
        assert bytes(b.data(2)) == bytes(b.data(0))[:1]
    assert ucmcache.verify(c.uuid).ok


def test_a_full_cache_mid_batch_raises_and_leaves_no_load_behind(make_cache):
    """The ninth miss of an 8-slot cache whose 8 slots this batch owns: the C call stops
    there, _pin_slow decides CacheFull, and the batch's token fails every load it owned."""
    c = make_cache(slots_per_rank=4, slot_size=64, max_ranks=2)
    keys = _keys(9)
    with pytest.raises(CacheFull):
        c.get_many(keys)
    assert c._open_handles == 0
    with c.get_many(keys[:8]) as b:   # every slot claimable again
        assert b.owner.all()
        b.ready_many(range(8))
    assert ucmcache.verify(c.uuid).ok


def test_ready_many_checks_every_position_and_length_before_publishing_any(make_cache):
    c = make_cache(slots_per_rank=8, slot_size=64, max_ranks=2)
    hit = os.urandom(16)
    c.get_or_load(hit, lambda: b"h")
    with c.get_many(_keys(3) + [hit]) as b:
        bad = [
            (([0, 7],), IndexError, "batch position must be an int in \\[0, 4\\)"),
            (([0, 1, 0],), ValueError, "positions \\[0\\] given more than once"),
            (([0, 1], 65), ValueError, "nbytes must be in \\[0, slot_size=64\\], got 65"),
            (([0, 1], [1, 2, 3]), ValueError, "nbytes has 3 lengths for 2 positions"),
            (([0, 1], [1, "2"]), TypeError, "nbytes must be an int, got str"),
            (([0, 1], 1.5), TypeError, "nbytes must be None, an int or a sequence of ints"),
            (([0, 3],), UcmError, "position 3 is not one"),
        ]
        for args, exc, match in bad:
            with pytest.raises(exc, match=match):
                b.ready_many(*args)
            assert b.state.tolist() == ["loading"] * 3 + ["ready"], args
        b.ready_many([2, 0, 1], None)   # any order; None: each slot whole
        assert b.state.tolist() == ["ready"] * 4
        assert len(b.data(0)) == 64
    assert ucmcache.verify(c.uuid).ok


def test_ready_many_refuses_a_published_load_first_and_names_one_published_meanwhile(
        make_cache):
    """A position already published is refused before anything is published; one that
    another thread publishes while ready_many runs (held at its first load's before_ready) is
    refused by the core and named, the others published."""
    c = make_cache(slots_per_rank=8, slot_size=64, max_ranks=2)
    with c.get_many(_keys(3)) as b:
        b.ready(1, 3)
        with pytest.raises(UcmError, match="position 1's load was already published"):
            b.ready_many([0, 1, 2], 5)
        assert b.state.tolist() == ["loading", "ready", "loading"]
        errors = []

        def publish():
            try:
                b.ready_many([0, 2], 5)
            except BaseException as e:   # seen by the test, never lost in the thread
                errors.append(e)

        with Gate() as g:
            hooks.arm_python("before_ready", "gate", g)
            t = threading.Thread(target=publish)
            t.start()
            try:
                g.wait_arrived()
                b.ready(2, 4)   # meanwhile, by this thread
            finally:
                g.release()
                t.join(10)
                hooks.arm_python("before_ready", "none")
        assert not t.is_alive() and len(errors) == 1
        assert isinstance(errors[0], UcmError)
        assert "position 2: the slot was already published" in str(errors[0])
        assert b.state.tolist() == ["ready"] * 3
        assert [len(b.data(i)) for i in range(3)] == [5, 3, 4]
    assert ucmcache.verify(c.uuid).ok


@pytest.mark.parametrize("point,seen", [("before_ready", ["loading"] * 3),
                                        ("after_ready", ["ready", "loading", "loading"])])
def test_ready_many_with_test_hooks_armed_publishes_one_load_at_a_time(make_cache, point,
                                                                        seen):
    """With a Python point armed, ready_many publishes one load at a time through the points
    ready() fires: held at the first load's before_ready nothing is Ready yet, at its
    after_ready only that load is; released, all are."""
    c = make_cache(slots_per_rank=8, slot_size=64, max_ranks=2)
    with Gate() as g, c.get_many(_keys(3)) as b:
        hooks.arm_python(point, "gate", g)
        errors = []

        def publish():
            try:
                b.ready_many(range(3), 1)
            except BaseException as e:   # seen by the test, never lost in the thread
                errors.append(e)

        t = threading.Thread(target=publish)
        t.start()
        try:
            g.wait_arrived()
            assert b.state.tolist() == seen
        finally:
            g.release()
            t.join(10)
            hooks.arm_python(point, "none")
        assert not t.is_alive() and not errors
        assert b.state.tolist() == ["ready"] * 3
    assert ucmcache.verify(c.uuid).ok


def test_a_closed_batch_publishes_nothing_into_a_later_install_of_its_slot(make_cache):
    """A batch closed with its load unpublished freed the slot (Failed); ready_many on it
    raises HandleClosed, as ready() does, and the slot's next install is a fresh owner's."""
    c = make_cache(slots_per_rank=1, slot_size=64, max_ranks=2)
    b = c.get_many(_keys(1))
    b.close()
    with pytest.raises(ucmcache.HandleClosed):
        b.ready_many([0])
    with c.get(os.urandom(16)) as h:
        assert h.owner
        h.ready(1)
    assert ucmcache.verify(c.uuid).ok
