"""The engine kit (ucmcache.engines.kit) through its API, and the differences it made in the two
integrations that use it: one DEFAULT_MAX_RANKS, the MemAvailable clamp for UCM's store too,
and a host registration that is logged when refused and undone when the store goes."""
import logging
import multiprocessing as mp
import os
import re
import sys
import types

import pytest

import ucmcache
from ucmcache import SlotCache
from ucmcache.engines import kit
from ucmcache.ucm import UcmCacheStore

import ucm_workers as W

MiB = 1 << 20


def _free(monkeypatch, shm, mem):
    monkeypatch.setattr(kit, "shm_free_bytes", lambda: shm)
    monkeypatch.setattr(kit, "mem_available_bytes", lambda: mem)


# ---------------------------------------------------------------- sizing and clamps

def test_a_size_that_fits_is_split_among_the_ranks(monkeypatch, caplog):
    _free(monkeypatch, 1 << 40, 1 << 40)
    with caplog.at_level(logging.WARNING):
        per = kit.new_segment_slots_per_rank(64 * MiB, 4000, 16, asked_by="size_mb 64",
                                             who="engine", hint="set size_mb")
    assert per == 64 * MiB // (4032 * 16)       # the stride: 4000 rounded up to 64
    assert caplog.records == []


@pytest.mark.parametrize("shm, mem, where, free", [
    (64 * MiB, 1 << 40, "/dev/shm", 64 * MiB),
    (1 << 40, 48 * MiB, "MemAvailable", 48 * MiB),
    (64 * MiB, 48 * MiB, "MemAvailable", 48 * MiB),     # the smaller of the two clamps
    (48 * MiB, 64 * MiB, "/dev/shm", 48 * MiB),
    (64 * MiB, None, "/dev/shm", 64 * MiB),             # MemAvailable unreadable: not used
])
def test_a_size_that_does_not_fit_is_clamped_to_half_of_what_is_free(monkeypatch, caplog,
                                                                    shm, mem, where, free):
    _free(monkeypatch, shm, mem)
    with caplog.at_level(logging.WARNING, logger="ucmcache.engines"):
        per = kit.new_segment_slots_per_rank(1 << 30, 4096, 4, asked_by="config x",
                                             who="Engine", hint="set x to choose")
    assert per == free // 2 // (4096 * 4)
    assert caplog.messages == [f"Engine: config x asks for {1 << 30} bytes of slots but {where} "
                               f"has {free} bytes free: using {free // 2} (50% of what is free); "
                               f"set x to choose"]


def test_too_little_room_and_too_small_a_size_are_told_apart(monkeypatch):
    _free(monkeypatch, 10000, 1 << 40)
    with pytest.raises(ucmcache.SharedMemoryFull, match=r"^config x: /dev/shm has 10000 bytes "
                                                        r"free, too little for one slot of 4096"):
        kit.new_segment_slots_per_rank(1 << 30, 4096, 4, asked_by="config x", who="E", hint="")
    _free(monkeypatch, 1 << 40, 1 << 40)
    with pytest.raises(KeyError, match=r"config x \(1000 bytes\) holds no slot of 4096 bytes for "
                                       r"each of 4 ranks; it needs at least 16384"):
        kit.new_segment_slots_per_rank(1000, 4096, 4, asked_by="config x", who="E", hint="",
                                       error=KeyError)


def test_open_segment_attaches_a_segment_made_with_the_other_ranks_default(uuid):
    """DEFAULT_MAX_RANKS was 8 for UCM's store and 16 for the vLLM connector: one value now,
    and a segment either made is attached with its own ranks, unsized (no sizing call)."""
    assert kit.DEFAULT_MAX_RANKS == 16
    old = SlotCache.create(uuid, slots_per_rank=4, slot_size=256, max_ranks=8)
    try:
        def never() -> int:
            raise AssertionError("an existing segment is not sized again")
        c = kit.open_segment(uuid, slot_size=256, max_ranks=kit.DEFAULT_MAX_RANKS,
                             slots_per_rank=never, timeout=5.0)
        try:
            assert (c.max_ranks, c.capacity) == (8, 32) and c.rank != old.rank
        finally:
            c.close()
    finally:
        old.close()


def test_open_segment_creates_an_absent_one_sized_once(uuid):
    calls = []

    def size() -> int:
        calls.append(1)
        return 3
    c = kit.open_segment(uuid, slot_size=512, max_ranks=kit.DEFAULT_MAX_RANKS,
                         slots_per_rank=size, timeout=5.0)
    try:
        assert (c.max_ranks, c.slots_per_rank, c.slot_size, calls) == (16, 3, 512, [1])
    finally:
        c.close()


def test_both_engines_default_to_the_same_ranks(uuid, monkeypatch):
    """A UCM store that names no ucmcache_max_ranks makes a segment of the kit's ranks, as the
    vLLM connector does (before the kit: 8 against 16)."""
    import ucmcache.vllm as uv
    cfg = W.store_config(uuid, 2, 1024)
    del cfg["ucmcache_max_ranks"]
    cfg["buffer_size"] = 2048 * 16 * 4
    with UcmCacheStore(cfg) as store:
        assert store.cache.max_ranks == kit.DEFAULT_MAX_RANKS == uv.ConnectorConfig().max_ranks


def test_ucm_store_is_clamped_by_memavailable_too(uuid, monkeypatch, caplog):
    """/dev/shm can be larger than the RAM there is: UCM's store clamps a new segment to half
    of MemAvailable as the vLLM connector does (before the kit it looked at /dev/shm alone)."""
    _free(monkeypatch, 1 << 40, 64 * MiB)
    with caplog.at_level(logging.WARNING, logger="ucmcache.ucm"):
        store = UcmCacheStore(dict(W.store_config(uuid, 1, 4096), buffer_size=1 << 30))
    with store:
        assert store.cache.capacity * 4096 <= 32 * MiB
        assert re.search(r"UcmCacheStore: config buffer_size asks for 1073741824 bytes of slots "
                         r"but MemAvailable has 67108864 bytes free: using 33554432",
                         caplog.text), caplog.text


# ---------------------------------------------------------------- naming

def test_default_segment_names(monkeypatch):
    monkeypatch.setattr(os, "getuid", lambda: 1234)
    a = kit.default_segment("vllm", identity="model=x|tp=2")
    assert a == kit.default_segment("vllm", identity="model=x|tp=2")
    assert re.fullmatch(r"vllm-[0-9a-f]{12}-u1234", a)
    assert a != kit.default_segment("vllm", identity="model=y|tp=2")
    assert kit.default_segment("ucm", label="gqa") == "ucm-gqa-u1234"
    assert re.fullmatch(r"ucm-a_b_c-u1234-[0-9a-f]{16}", kit.default_segment("ucm", label="a/b c"))
    with pytest.raises(TypeError, match="exactly one of identity and label"):
        kit.default_segment("x")
    assert kit.segment_name("ok-name_1") == "ok-name_1"
    long = kit.segment_name("x" * 100)
    assert len(long) <= 64 and long == kit.segment_name("x" * 100)


# ---------------------------------------------------------------- the finalizer

class _Parts(kit.EngineParts):
    __slots__ = ("events",)

    def __init__(self, events):
        super().__init__()
        self.events = events

    def stop(self):
        self.events.append("stop")


class _Host:
    def __init__(self, events):
        self.events = events

    def close(self):
        self.events.append("host")


class _Owner:
    pass


def test_release_stops_threads_then_unregisters_then_detaches_once(make_cache):
    cache = make_cache(slots_per_rank=2, slot_size=64, max_ranks=2)
    events = []
    parts = _Parts(events)
    parts.cache, parts.host = cache, _Host(events)
    owner = _Owner()
    fin = parts.finalizer(owner)
    fin()
    assert events == ["stop", "host"]
    with pytest.raises(ucmcache.NotAttached):
        cache.exist([b"k" * 16])
    fin()                                    # runs once
    parts.release()                          # and a direct second release finds nothing
    assert events == ["stop", "host", "stop"]


def test_release_on_collection(make_cache):
    cache = make_cache(slots_per_rank=2, slot_size=64, max_ranks=2)
    parts = kit.EngineParts()
    parts.cache = cache
    owner = _Owner()
    parts.finalizer(owner)
    del owner                                # collected: the finalizer runs
    assert parts.cache is None
    with pytest.raises(ucmcache.NotAttached):
        cache.exist([b"k" * 16])


def _release_in_child(parts, q):
    parts.release()
    q.put(parts.cache is not None)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_release_in_a_forked_child_leaves_the_parents_rank(make_cache):
    cache = make_cache(slots_per_rank=2, slot_size=64, max_ranks=2)
    parts = kit.EngineParts()
    parts.cache = cache
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=_release_in_child, args=(parts, q))
    p.start()
    try:
        assert q.get(timeout=30) is True     # the child let nothing go
    finally:
        p.join(30)
    assert p.exitcode == 0
    assert cache.exist([b"k" * 16]) == [False]    # the parent's rank is still attached
    parts.release()


# ---------------------------------------------------------------- host registration

class _Cudart:
    def __init__(self, register=0, unregister=0):
        self.calls = []
        self._register, self._unregister = register, unregister

    def _answer(self, v):
        if isinstance(v, BaseException):
            raise v
        return v

    def cudaHostRegister(self, addr, size, flags):
        self.calls.append(("register", addr, size, flags))
        return self._answer(self._register)

    def cudaHostUnregister(self, addr):
        self.calls.append(("unregister", addr))
        return self._answer(self._unregister)


def _fake_torch(cudart):
    cuda = types.SimpleNamespace(is_available=lambda: True, cudart=lambda: cudart)
    return types.SimpleNamespace(cuda=cuda, __name__="torch")


def _mapping(cache):
    seg = cache._seg
    return int(kit.ffi.cast("uintptr_t", seg.base)), seg.layout.total_size


def test_host_registration_registers_the_whole_mapping_and_unregisters_once(make_cache, caplog):
    cache = make_cache(slots_per_rank=2, slot_size=64, max_ranks=2)
    cudart = _Cudart()
    with caplog.at_level(logging.WARNING):
        host = kit.HostRegistration(_fake_torch(cudart), cache, who="E")
        assert host.registered
        host.close()
        host.close()
    addr, size = _mapping(cache)
    assert cudart.calls == [("register", addr, size, 0), ("unregister", addr)]
    assert caplog.records == []


@pytest.mark.parametrize("answer, said", [(1, r"\(1\)"),
                                          (RuntimeError("no"), r"\(RuntimeError: no\)")])
def test_a_refused_registration_is_logged_and_not_undone(make_cache, caplog, answer, said):
    cache = make_cache(slots_per_rank=2, slot_size=64, max_ranks=2)
    cudart = _Cudart(register=answer)
    with caplog.at_level(logging.WARNING, logger="ucmcache.engines"):
        host = kit.HostRegistration(_fake_torch(cudart), cache, who="E")
        host.close()
    assert not host.registered and [c[0] for c in cudart.calls] == ["register"]
    assert re.fullmatch(rf"E: cudaHostRegister of \d+ bytes refused {said}; copies to and from "
                        rf"the segment stay pageable", caplog.messages[0]), caplog.messages


def test_a_refused_unregistration_is_logged_not_raised(make_cache, caplog):
    cache = make_cache(slots_per_rank=2, slot_size=64, max_ranks=2)
    host = kit.HostRegistration(_fake_torch(_Cudart(unregister=RuntimeError("busy"))), cache,
                                who="E")
    with caplog.at_level(logging.WARNING, logger="ucmcache.engines"):
        host.close()
    assert re.fullmatch(r"E: cudaHostUnregister of \d+ bytes refused \(RuntimeError: busy\)",
                        caplog.messages[0]), caplog.messages


@pytest.mark.parametrize("register", [0, 2])
def test_ucm_store_unregisters_its_segment_when_it_closes(uuid, monkeypatch, caplog, register):
    """A worker store on a machine with CUDA registers its segment and, when it goes,
    unregisters it before detaching (before the kit: registered, never unregistered, and a
    refusal said nothing)."""
    cudart = _Cudart(register=register)
    monkeypatch.setitem(sys.modules, "torch", _fake_torch(cudart))
    with caplog.at_level(logging.WARNING, logger="ucmcache.ucm"):
        store = UcmCacheStore(W.store_config(uuid, 1, 4096))
        addr, size = _mapping(store.cache)
        store.close()
    if register == 0:
        assert cudart.calls == [("register", addr, size, 0), ("unregister", addr)]
        assert "cudaHostRegister" not in caplog.text
    else:
        assert cudart.calls == [("register", addr, size, 0)]
        assert f"UcmCacheStore: cudaHostRegister of {size} bytes refused (2)" in caplog.text


# ---------------------------------------------------------------- config checking

def test_config_checks_name_the_key_what_was_given_and_what_is_expected():
    cfg = {"n": 3, "b": True, "s": "no", "f": 0.5, "bad": "x", "none": None}
    assert kit.check_int(cfg, "n", minimum=1) == 3
    assert kit.check_int(cfg, "none", 7) == 7 and kit.check_int(cfg, "absent") is None
    with pytest.raises(ValueError, match=r"^config 'b' must be an int >= 1, got bool True$"):
        kit.check_int(cfg, "b", minimum=1)
    with pytest.raises(KeyError, match=r"where 'n' must be an int in \[4, 63\], got 3"):
        kit.check_int(cfg, "n", minimum=4, maximum=63, where="where", error=KeyError)
    assert kit.check_number(cfg, "f", unit="s", above=0) == 0.5
    with pytest.raises(ValueError, match=r"^config 'bad' must be a number of MiB > 0, got 'x'$"):
        kit.check_number(cfg, "bad", unit="MiB", above=0)
    with pytest.raises(ValueError, match=r"^config 'f' must be a number of s in \[1, 2\], got "):
        kit.check_number(cfg, "f", unit="s", minimum=1, maximum=2)
    assert kit.check_bool(cfg, "b", False) is True
    assert kit.check_bool(cfg, "s", True, strict=False) is False
    with pytest.raises(ValueError, match=r"^config 's' must be true or false, got str 'no'$"):
        kit.check_bool(cfg, "s", True)
    assert kit.check_choice(cfg, "absent", "a", ("a", "b")) == "a"
    with pytest.raises(ValueError, match=r"^config 'bad' must be 'a' or 'b', got 'x'$"):
        kit.check_choice(cfg, "bad", "a", ("a", "b"))
    with pytest.raises(ValueError, match=r"^cfg: unknown key\(s\) \['bad', 'none'\]; E reads "):
        kit.check_known(cfg, ["n", "b", "s", "f"], where="cfg", who="E")


def test_engine_configs_are_checked_by_the_kit():
    import ucmcache.vllm as uv
    with pytest.raises(uv.VllmConnectorError, match=r"'max_ranks' must be an int in \[2, 63\], "
                                                     r"got 64"):
        uv.ConnectorConfig.from_extra({"max_ranks": 64})
    with pytest.raises(uv.VllmConnectorError, match=r"unknown key\(s\) \['sise_mb'\]"):
        uv.ConnectorConfig.from_extra({"sise_mb": 1})
    with pytest.raises(ValueError, match=r"config 'ucmcache_max_ranks' must be an int in "
                                         r"\[1, 63\], got 64"):
        UcmCacheStore(dict(W.store_config("unused", 1, 4096), ucmcache_max_ranks=64))

