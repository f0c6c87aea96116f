"""The cold get_or_load in C (DESIGN 4.4 "finish", 5.8): one core step each side of the loader
(ucm_get_slow into a token of the C frame, ucm_load_finish), no Handle.  Its counters are the
full path's (for each answer of its slow step too), its loader errors and value checks are the
full path's, and a process killed at each point of the finish leaves what 5.8 says, repaired by
a survivor."""
import re
import signal
import threading

import numpy as np
import pytest

import ucmcache
from ucmcache import SlotCache, UcmError
from ucmcache.core.verify import slot_fields, snapshot

import workers
from cold_load_helpers import K, c_and_full, counters, run_ops, warm


def test_the_c_path_counts_what_the_full_path_counts(uuid):
    with c_and_full(uuid, slots_per_rank=16, slot_size=64, max_ranks=1) as (a, b):
        assert run_ops(a, {}) == run_ops(b, {"timeout": 30.0})
        ca, cb = counters(a), counters(b)
        assert ca == cb
        assert ca["loads_started"] == 48 and ca["evictions"] > 0 and ca["loads_failed"] == 4
        assert ca["load_count"] == 48  # every owner's load observed once, Ready or Failed
        assert a.entry_count() == b.entry_count() and a.size_bytes() == b.size_bytes()
        assert ucmcache.verify(a.uuid).ok


# ---------------------------------------------------------------- the slow step's other answers
# Any answer of the C slow step but a pin goes to the full path's _pin_slow as its first step
# (DESIGN 4.6): the same retries and counters as a full path that ran the step itself.  Each
# answer is made deterministically on two caches alike, one call through each path.

def cold_step_answers(monkeypatch):
    """The answers the C slow step handed to the full path (_get_or_load_cold), as they come."""
    answers = []
    handed = SlotCache._get_or_load_cold

    def recording(self, key, loader, answer=0, since_ns=-1, **kw):
        answers.append(answer)
        return handed(self, key, loader, answer, since_ns, **kw)
    monkeypatch.setattr(SlotCache, "_get_or_load_cold", recording)
    return answers


def load_past_a_dead_claim(c, kw, procs, gate):
    """get_or_load(X) held at before_stripe, its lock-free looks missed, while another process
    installs X and is killed at before_handover (X's slot linked and claimed, the stripe held
    by a dead thread); the process reaped (its life lock gone with it), the get goes on: the
    stripe repaired, X's slot claimed under it (BUSY), the dead rank recovered, X loaded.
    (A get blocked on the stripe instead is woken by the kernel's robust-futex cleanup before
    the dying process's files close: its recovery could find the rank still alive and step
    once more, counting one more BUSY.)"""
    from ucmcache.lowlevel import lib
    key, g = K[30], gate()
    c._arm("before_stripe", "gate", g)
    out = []
    t = threading.Thread(target=lambda: out.append(c.get_or_load(key, lambda: b"mine", **kw)))
    t.start()
    try:
        g.wait_arrived()
        p, q = procs.start(workers.die_at_point, c.uuid, None, key, "before_handover")
        p.join(30)
        assert p.exitcode == -signal.SIGKILL, "the installer was not killed at before_handover"
        reference = slot_fields(snapshot(c._seg)["metas"])["reference"]
        claimed = [s for s in range(c.layout.n_slots) if int(reference[s]) >> 63]
        assert len(claimed) == 1 and lib.ucm_slot_state(c._ctx, claimed[0]) == lib.UCM_LOADING
    finally:
        c._arm("before_stripe", "none")
        g.release()
        t.join(30)
    assert out == [b"mine"]


def test_a_busy_answer_of_the_c_step_counts_what_the_full_path_counts(uuid, procs, gate,
                                                                      monkeypatch):
    from ucmcache.lowlevel import lib
    answers = cold_step_answers(monkeypatch)
    with c_and_full(uuid, slots_per_rank=4, slot_size=64, max_ranks=2) as (a, b):
        warm(a)
        warm(b)
        del answers[:]
        load_past_a_dead_claim(a, {}, procs, gate)
        assert answers == [lib.UCM_BUSY]                   # the C step's answer, handed on
        load_past_a_dead_claim(b, {"timeout": 30.0}, procs, gate)
        assert answers == [lib.UCM_BUSY]                   # (the full path ran its own step)
        ca, cb = counters(a), counters(b)
        assert ca == cb
        assert (ca["spins_exhausted"], ca["stripe_repairs"], ca["recovered_ranks"]) == (1, 1, 1)
        for c in (a, b):
            assert c.get_or_load(K[30], lambda: b"never") == b"mine"
            assert ucmcache.verify(c.uuid).ok


def load_past_busy_stripes(c, kw):
    """get_or_load(X) while every slot holds an entry of a bucket whose stripe is not X's, and
    this thread holds every stripe but X's: each claim's isolate finds its victim's old stripe
    busy (ROLLBACK), in every step, until CacheFull: the loader's value, uncached (a bypass)."""
    from ucmcache.lowlevel import lib

    def stripe(k):
        return lib.ucm_stripe_of(c._ctx, lib.ucm_bucket_of(c._ctx, k, 0))
    key = K[0]
    for k in [k for k in K[1:] if stripe(k) != stripe(key)][:c.capacity]:
        c.get_or_load(k, lambda k=k: k, **kw)
    assert c.entry_count() == c.capacity                   # no slot left but a victim's
    held = [s for s in range(c.layout.n_stripes) if s != stripe(key)]
    out = []
    try:
        for s in held:
            assert lib.ucm_stripe_lock(c._ctx, s, 10**9) == lib.UCM_OK
        t = threading.Thread(target=lambda: out.append(c.get_or_load(key, lambda: b"v", **kw)))
        t.start()
        t.join(60)
    finally:
        for s in held:
            lib.ucm_stripe_unlock(c._ctx, s)
    assert out == [b"v"] and c.exist([key]) == [False]


def test_a_rollback_answer_of_the_c_step_counts_what_the_full_path_counts(uuid, monkeypatch):
    from ucmcache.lowlevel import lib
    answers = cold_step_answers(monkeypatch)
    with c_and_full(uuid, slots_per_rank=8, slot_size=64, max_ranks=1, n_stripes=4) as (a, b):
        load_past_busy_stripes(a, {})
        assert answers[-1] == lib.UCM_ROLLBACK             # the C step's answer, handed on
        handed = len(answers)
        load_past_busy_stripes(b, {"timeout": 30.0})
        assert len(answers) == handed                      # (the full path ran its own step)
        ca, cb = counters(a), counters(b)
        assert ca == cb
        assert ca["bypasses"] == 1 and ca["claim_rollbacks"] > 0
        for c in (a, b):
            assert c.get_or_load(K[0], lambda: b"cached") == b"cached"
            assert ucmcache.verify(c.uuid).ok


def test_a_getter_killed_before_its_stripe_leaves_nothing_but_its_rank(make_cache, procs):
    """DESIGN 5.8, before_stripe: the slow step holds nothing yet (the C path's token unarmed)."""
    c = make_cache(slots_per_rank=4, slot_size=64, max_ranks=3)
    warm(c)
    p, q = procs.start(workers.die_at_point, c.uuid, None, K[9], "before_stripe")
    p.join(30)
    assert p.exitcode == -signal.SIGKILL, "the getter was not killed at before_stripe"
    assert [r.rank for r in c.recover().ranks] == [1]
    rep = ucmcache.verify(c.uuid)
    assert rep.ok, rep
    assert int((slot_fields(snapshot(c._seg)["metas"])["reference"] != 0).sum()) == 0
    assert c.get_or_load(K[9], lambda: b"mine") == b"mine"


def test_a_cold_get_or_load_makes_no_handle_and_runs_no_full_path(make_cache, monkeypatch):
    c = make_cache(slots_per_rank=8, slot_size=64, max_ranks=1)
    warm(c)
    made = []
    orig = ucmcache.Handle.__new__
    monkeypatch.setattr(ucmcache.Handle, "__new__",
                        staticmethod(lambda cls, *a: made.append(1) or orig(cls)))
    for name in ("_get_or_load_missed", "_get_or_load_cold", "_get_or_load_full", "_pin_handle"):
        monkeypatch.setattr(SlotCache, name, lambda *a, **k: pytest.fail("the full path ran"))
    for k in K[:20]:                                   # 8 slots: evicts
        assert c.get_or_load(k, lambda k=k: k) == k
    assert made == []
    assert c.get_or_load(K[19], lambda: b"never") == K[19]


def test_a_failed_cold_load_reaches_a_waiter_in_another_process(make_cache, procs, gate):
    c = make_cache(slots_per_rank=8, slot_size=64, max_ranks=2)
    warm(c)
    joined = gate()
    key = K[7]

    def loader():
        p, q = procs.start(workers.wait_for_load, c.uuid, key, joined.path, 30)
        joined.wait_value(1)                           # it holds a handle on our Loading slot
        loader.q = q
        raise RuntimeError("boom")
    with pytest.raises(RuntimeError, match="^boom$"):
        c.get_or_load(key, loader)
    assert procs.result(loader.q) == ("failed", "RuntimeError: boom")
    assert c.get_or_load(key, lambda: b"again") == b"again"  # no negative caching
    # the waiter waited once, or found it Failed already (it says "joined" before its wait)
    assert c.stats()["loads_failed"] == 1 and c.stats()["waits"] in (0, 1)


def test_a_loader_asking_for_its_own_key_is_refused(make_cache):
    c = make_cache(slots_per_rank=8, slot_size=64, max_ranks=1)
    warm(c)
    seen = []

    def loader():
        with pytest.raises(UcmError, match="sharing its context .*is loading this key"):
            c.get_or_load(K[1], lambda: b"inner")
        seen.append(1)
        return b"outer"
    assert c.get_or_load(K[1], loader) == b"outer" and seen == [1]
    assert c.get_or_load(K[1], lambda: b"never") == b"outer"


def test_close_refuses_while_a_cold_loader_runs(make_cache):
    c = make_cache(slots_per_rank=8, slot_size=64, max_ranks=1)
    warm(c)

    def loader():
        assert c._loads_out == 1
        with pytest.raises(UcmError, match=re.escape("1 handle(s) or batch(es) are still open")):
            c.close()
        return b"v"
    assert c.get_or_load(K[2], loader) == b"v"
    assert c._loads_out == 0 and c._open_handles == 0
    c.close()


def test_a_forked_loader_child_touches_nothing_of_the_parent(make_cache):
    import os
    c = make_cache(slots_per_rank=8, slot_size=64, max_ranks=1)
    warm(c)
    r, w = os.pipe()

    def loader():
        pid = os.fork()
        if pid == 0:  # the child returns into the C frame, whose context is not its own
            code = 0
            try:
                c.get_or_load(K[4], lambda: b"child")  # (a new call: NotAttached too)
                code = 3
            except ucmcache.NotAttached:
                code = 1
            os.write(w, bytes([code]))
            os._exit(0)
        os.waitpid(pid, 0)
        return b"parent"
    assert c.get_or_load(K[3], loader) == b"parent"
    assert os.read(r, 1) == b"\x01"
    os.close(r)
    os.close(w)
    assert c.get_or_load(K[3], lambda: b"never") == b"parent"
    f = slot_fields(snapshot(c._seg)["metas"])
    assert int((f["reference"] != 0).sum()) == 0


def test_a_child_forked_inside_the_loader_raises_not_attached_there(make_cache):
    import os
    c = make_cache(slots_per_rank=8, slot_size=64, max_ranks=1)
    warm(c)
    r, w = os.pipe()
    pid = -1

    def loader():
        nonlocal pid
        pid = os.fork()
        return b"v"
    try:
        v = c.get_or_load(K[5], loader)
    except ucmcache.NotAttached:
        os.write(w, b"N")  # the child: its copy of the load went nowhere
        os._exit(0)
    except BaseException:
        if pid == 0:
            os.write(w, b"E")
            os._exit(0)
        raise
    if pid == 0:
        os.write(w, b"V")
        os._exit(0)
    os.waitpid(pid, 0)
    assert v == b"v" and os.read(r, 1) == b"N"
    os.close(r)
    os.close(w)
    assert c.get_or_load(K[5], lambda: b"never") == b"v"


# The finish's crash windows (DESIGN 5.8): a waiter in a third process holds a handle on the
# Loading slot while the owner dies at the point; a survivor's recovery leaves the words whole.
@pytest.mark.parametrize("point,waiter_gets", [
    ("load_copied", "failed"), ("counted_not_ready", "failed"), ("before_ready", "failed"),
    ("load_published", "ready"), ("after_ready", "ready")])
def test_an_owner_killed_inside_the_finish_is_recovered(make_cache, procs, gate, point,
                                                        waiter_gets):
    c = make_cache(slots_per_rank=4, slot_size=64, max_ranks=3)
    key = K[9]
    g, joined = gate(), gate()
    p, q = procs.start(workers.cold_load_at, c.uuid, key, g.path, point, "kill")
    g.wait_arrived()                                   # the owner is inside its loader
    w, wq = procs.start(workers.wait_for_load, c.uuid, key, joined.path, 30)
    joined.wait_value(1)                               # the waiter holds a handle on it
    g.release()
    p.join(30)
    assert p.exitcode == -signal.SIGKILL, f"the owner was not killed at {point}"
    state, value = procs.result(wq)
    assert state == waiter_gets, (state, value)
    if state == "ready":
        assert workers.check_payload(key, value)
    c.recover()
    rep = ucmcache.verify(c.uuid)
    assert rep.ok, rep
    f = slot_fields(snapshot(c._seg)["metas"])
    assert int((f["reference"] != 0).sum()) == 0, "a pin or claim survived recovery"
    present = c.exist([key])[0]
    assert present == (waiter_gets == "ready")
    assert c.entry_count() == 1 + present             # the owner's own_first entry, and key's


@pytest.mark.parametrize("point", ["load_copied", "load_published"])
def test_an_owner_held_inside_the_finish_is_waited_for_then_seen(make_cache, procs, gate, point):
    c = make_cache(slots_per_rank=4, slot_size=64, max_ranks=3)
    key = K[11]
    g = gate()
    p, q = procs.start(workers.cold_load_at, c.uuid, key, g.path, point, "gate")
    g.wait_value(1)                                    # inside the loader
    g.release()                                        # (value 2) on to the point
    g.wait_value(3)                                    # held at the point
    published = point == "load_published"
    assert c.exist([key]) == [published]               # copied, not yet published: invisible
    assert c.entry_count() == 1 + published            # counted only once published
    g.release()
    assert workers.check_payload(key, procs.result(q))
    assert c.get_or_load(key, lambda: b"never") == workers.payload_for(key, 64)
    assert c.stats()["loads_ready"] == 2


@pytest.mark.parametrize("kind", ["bytearray", "numpy"])
@pytest.mark.parametrize("path", ["c", "full"])
def test_a_writable_value_rewritten_during_the_finish_leaves_what_the_owner_returned(
        make_cache, gate, kind, path):
    """A loader's bytearray or numpy array rewritten by another thread while the finish runs
    (held at load_copied in C, the GIL released; at before_ready on the full path): the value
    the owner returns and the slot's bytes are one and the same (the immutable copy is made
    first, under the GIL, and published from)."""
    import threading
    from ucmcache.core.hooks import arm_python
    n = 4096
    c = make_cache(slots_per_rank=8, slot_size=n, max_ranks=1)
    warm(c)
    g = gate()
    buf = bytearray(b"A" * n) if kind == "bytearray" else np.full(n, ord("A"), dtype=np.uint8)
    if path == "c":
        c._arm("load_copied", "gate", g)
    else:
        arm_python("before_ready", "gate", g)
    out = []
    kw = {} if path == "c" else {"timeout": 30.0}
    t = threading.Thread(target=lambda: out.append(c.get_or_load(K[4], lambda: buf, **kw)))
    t.start()
    try:
        g.wait_arrived()
        buf[:] = b"B" * n if kind == "bytearray" else ord("B")   # the other thread's rewrite
    finally:
        c._arm("load_copied", "none")
        arm_python("before_ready", "none")
        g.release()
        t.join(30)
    assert out == [b"A" * n]
    with c.get(K[4]) as h:
        assert bytes(h.data) == b"A" * n
    assert ucmcache.verify(c.uuid).ok


def test_a_cold_loads_slot_leaves_the_owned_set_before_the_finish(make_cache, gate):
    """The owned-set record goes before ucm_load_finish, which may unpin with the GIL released
    (at load_published the finish has published and not yet unpinned): a thread sharing the
    set that owns the freed slot's next load keeps its record."""
    import contextvars
    import threading
    from ucmcache.core import slots as _slots
    c = make_cache(slots_per_rank=8, slot_size=64, max_ranks=1)
    warm(c)
    g = gate()
    seen = []

    def loader():
        seen.append(set(_slots._owning.get()[c._owned_key]))   # recorded while the loader runs
        return b"v"
    c._arm("load_published", "gate", g)
    _slots._owned_slots(c)                              # the record exists before the copy
    records = _slots._owning.get()
    ctx = contextvars.copy_context()                    # shares the owned set (its dict)
    t = threading.Thread(target=lambda: ctx.run(c.get_or_load, K[6], loader))
    t.start()
    try:
        g.wait_arrived()
        owned = set(records.get(c._owned_key, ()))
    finally:
        c._arm("load_published", "none")
        g.release()
        t.join(30)
    assert len(seen) == 1 and len(seen[0]) == 1         # the loader's slot was recorded
    assert owned == set()                               # and left before the finish
    assert c.get_or_load(K[6], lambda: b"never") == b"v"


class BadStr(Exception):
    def __str__(self):
        raise LookupError("str of the loader's error failed")


@pytest.mark.parametrize("kw", [{}, {"timeout": 30.0}])
def test_an_error_naming_the_loaders_error_is_raised_after_the_finish(make_cache, kw):
    """str(e) of the loader's error raises: the C path raises that error (the loader's its
    context) once the load is failed, as the full path's except does."""
    c = make_cache(slots_per_rank=8, slot_size=64, max_ranks=1)
    warm(c)

    def loader():
        raise BadStr()
    with pytest.raises(LookupError, match="^str of the loader's error failed$") as ei:
        c.get_or_load(K[8], loader, **kw)
    assert isinstance(ei.value.__context__, BadStr)
    assert c._open_handles == 0 and c.stats()["loads_failed"] == 1
    assert c.get_or_load(K[8], lambda: b"again", **kw) == b"again"
    assert ucmcache.verify(c.uuid).ok


class CountingLib:
    """ucmcache.core.cache's lib with its ucm_get_slow calls counted (the full path's steps)."""

    def __init__(self, lib):
        self._lib, self.slow_steps = lib, 0

    def __getattr__(self, name):
        return getattr(self._lib, name)

    def ucm_get_slow(self, *args):
        self.slow_steps += 1
        return self._lib.ucm_get_slow(*args)


@pytest.mark.parametrize("call", ["get_or_load", "get"])
def test_a_held_stripe_times_out_once_after_the_c_step(make_cache, monkeypatch, call):
    """The C slow step (cold_load, cold_handle) answering TIMEOUT hands its answer and start to
    _pin_slow, which raises at once: one STRIPE_WAIT, not the C step's and then its own."""
    import threading
    import time
    from ucmcache.core import cache as _cache
    from ucmcache import LockTimeout
    from ucmcache._core import lib
    c = make_cache(slots_per_rank=8, slot_size=64, max_ranks=1)
    warm(c)
    monkeypatch.setattr(_cache, "STRIPE_WAIT", 0.3)
    _cache._bind_loads()                               # the C step's budget too
    counting = CountingLib(lib)
    monkeypatch.setattr(_cache, "lib", counting)
    stripe = lib.ucm_stripe_of(c._ctx, lib.ucm_bucket_of(c._ctx, K[9], 0))
    out = []

    def getter():
        t0 = time.monotonic()
        try:
            c.get_or_load(K[9], lambda: b"v") if call == "get_or_load" else c.get(K[9])
        except LockTimeout as e:
            out.append((time.monotonic() - t0, str(e)))
    try:
        assert lib.ucm_stripe_lock(c._ctx, stripe, 10**9) == lib.UCM_OK  # held by this thread
        t = threading.Thread(target=getter)
        t.start()
        t.join(30)
    finally:
        lib.ucm_stripe_unlock(c._ctx, stripe)
        monkeypatch.undo()
        _cache._bind_loads()
    assert len(out) == 1 and re.search(r"stayed held for 0\.[34] s", out[0][1]), out
    assert counting.slow_steps == 0                    # the C step was the only one
    assert out[0][0] < 0.3 * 1.9                       # one wait, not two
    assert c.get_or_load(K[9], lambda: b"v") == b"v"
