"""The systems under test, behind one small interface, so every scenario runs the same code
shape against each.

A System creates a fresh store (``create`` -> a picklable-enough spec), hands out clients in any
process (``connect(spec, proc)``; with the fork start method the spec is inherited, not pickled)
and destroys the store.  A client's loops are written out per system (no per-op indirection
through a shared helper), so the timing scaffold costs every system the same.

Like for like:
- a hit: ucmcache ``with get(k)`` (pin + release; data not touched); the old design the same;
  LMDB a read transaction + ``get`` with buffers=True (zero copy); Redis ``GET``; Manager dict
  ``d[k]``; diskcache ``cache.get(k)``;
- a 64-key batch: ucmcache one ``exist`` / one ``get_many`` + close; LMDB one read transaction over
  the same keys (exist: cursor ``set_key`` per key; get: ``get`` per key, buffers=True); Redis one
  pipelined round trip (EXISTS x64 / MGET); Manager dict and diskcache have no batch call: a loop;
- a miss (mixes): the value is the prebuilt payload, stored (ucmcache/old: fill the slot and
  publish; LMDB a write transaction; Redis SET; Manager d[k] = v; diskcache set).
- get_or_load (ucmcache, the old design, LMDB): ucmcache's own call; the old design's
  OldCache.get_or_load (get, the loader, the copy in, ready; it had none); LMDB a read
  transaction's get, then on a miss the loader and a write transaction's put.  Each returns
  the value as bytes (on a miss, the loader's own).
- single flight: ucmcache and the old design elect the owner in get(); the others use the usual
  pattern, an atomic add-if-absent of a lock key (Redis SET NX, LMDB a write transaction, Manager
  dict setdefault, diskcache add) and waiters that poll every 50 us.  Every system's waiter
  stamps its wake-up first thing after its wait, and reads its thread's CPU time
  (time.thread_time_ns: user + system) just before the wait and just after that stamp: the CPU
  the wait itself burned (a poll's every round, a futex sleep nothing), less `cpu_overhead`
  (the same reads with no wait between, measured in the waiter's process).  The owner's CPU
  time in its publish is read the same way (a futex wake's syscall is paid there).
"""
from __future__ import annotations

import os
import shutil
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

from .common import cpu_clock_overhead, page_aligned, spin_ns

POLL_S = 50e-6  # baselines without a wake-up mechanism poll this often


class FlightLog:
    """One process's record of scenario 4: loads it ran (each publish's CPU), waits (each one's
    wake latency and waiter CPU) and keys it found ready."""

    def __init__(self):
        self.runs = self.waits = self.hits = 0
        self.lat: List[int] = []
        self.keys: List[int] = []  # each wait's key index: its waiters' wake-up order (run.py)
        self.wait_cpu: List[int] = []
        self.publish_cpu: List[int] = []

    def published(self, cpu_ns: int) -> None:
        self.publish_cpu.append(cpu_ns)
        self.runs += 1

    def woke(self, key_index: int, latency_ns: int, cpu_ns: int) -> None:
        self.keys.append(key_index)
        self.lat.append(latency_ns)
        self.wait_cpu.append(cpu_ns)
        self.waits += 1

    def result(self) -> Dict[str, Any]:
        return {"runs": self.runs, "waits": self.waits, "hits": self.hits, "lat": self.lat,
                "keys": self.keys,
                "wait_cpu": self.wait_cpu, "publish_cpu": self.publish_cpu,
                "cpu_overhead": cpu_clock_overhead()}


def _stamp(value) -> int:
    """The owner's publish stamp: the value's first 8 bytes."""
    return int.from_bytes(value[:8], "little")


def polled_flight(get, claim, set_, keys, payload: bytes, load_ns: int, timeout: float,
                  what: str) -> Dict[str, Any]:
    """Scenario 4 for a store with no wake-up (py-lmdb, Redis, the Manager dict, diskcache):
    the usual single-flight pattern over get(key), claim(lock key) (an atomic add-if-absent:
    True for the one caller that adds it) and set_(key, value); a waiter polls every POLL_S.
    The CPU of the waiter's process only: a server's (Redis, the Manager) is not counted."""
    cpu, mono = time.thread_time_ns, time.monotonic_ns
    body = payload[8:]
    log = FlightLog()
    for i, k in enumerate(keys):
        if get(k) is not None:
            log.hits += 1
            continue
        if claim(b"L" + k):
            spin_ns(load_ns)
            value = mono().to_bytes(8, "little") + body
            c0 = cpu()
            set_(k, value)
            log.published(cpu() - c0)
            continue
        c0 = cpu()
        deadline = time.monotonic() + timeout
        while True:
            v = get(k)
            if v is not None:
                t = mono()
                c1 = cpu()
                log.woke(i, t - _stamp(v), c1 - c0)
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what} flight wait")
            time.sleep(POLL_S)
    return log.result()


# ====================================================================== handle-style systems


class HandleClient:
    """ucmcache's SlotCache and the old design's OldCache have the same API shape."""

    def __init__(self, cache, closer=None):
        self.c = cache
        self._closer = closer

    def close(self) -> None:
        if self._closer is not None:
            self._closer(self.c)
            self._closer = None

    def populate(self, keys: Sequence[bytes], payload: bytes) -> None:
        n = len(payload)
        get = self.c.get
        for k in keys:
            h = get(k)
            if h.owner:
                h.data[:n] = payload
                h.ready(n)
            h.close()

    def hit_timed(self, seq, out) -> None:
        get = self.c.get
        pc = time.perf_counter_ns
        i = 0
        for k in seq:
            t0 = pc()
            with get(k):
                pass
            out[i] = pc() - t0
            i += 1

    def hit_bulk(self, seq) -> int:
        get = self.c.get
        pc = time.perf_counter_ns
        t0 = pc()
        for k in seq:
            with get(k):
                pass
        return pc() - t0

    # ucmcache extras for the hot-path figures: explicit get()+close(), and get + data view
    def hit_close_timed(self, seq, out) -> None:
        get = self.c.get
        pc = time.perf_counter_ns
        i = 0
        for k in seq:
            t0 = pc()
            h = get(k)
            h.close()
            out[i] = pc() - t0
            i += 1

    def hit_data_timed(self, seq, out) -> None:
        get = self.c.get
        pc = time.perf_counter_ns
        i = 0
        for k in seq:
            t0 = pc()
            with get(k) as h:
                h.data
            out[i] = pc() - t0
            i += 1

    def get_or_load_timed(self, seq, loader, out) -> None:
        gol = self.c.get_or_load
        pc = time.perf_counter_ns
        i = 0
        for k in seq:
            t0 = pc()
            gol(k, loader)
            out[i] = pc() - t0
            i += 1

    def exist_timed(self, reqs, out) -> int:
        ex = self.c.exist
        pc = time.perf_counter_ns
        found = 0
        for i, r in enumerate(reqs):
            t0 = pc()
            res = ex(r)
            out[i] = pc() - t0
            found += sum(res)
        return found

    def get_many_timed(self, reqs, out) -> int:
        gm = self.c.get_many
        pc = time.perf_counter_ns
        got = 0
        for i, r in enumerate(reqs):
            t0 = pc()
            with gm(r) as b:
                pass
            out[i] = pc() - t0
            got += len(b)
        return got

    def mix(self, seq, cold_prefix: bytes, payload: bytes, deadline: int) -> Tuple[int, int]:
        get = self.c.get
        pc = time.perf_counter_ns
        n = len(payload)
        payload = page_aligned(payload)  # the copy's source: the same alignment in every run
        ops = hits = cold = i = 0
        L = len(seq)
        while True:
            for _ in range(64):
                k = seq[i]
                i += 1
                if i == L:
                    i = 0
                if k is None:
                    k = cold_prefix + cold.to_bytes(8, "little")
                    cold += 1
                h = get(k)
                if h.owner:
                    h.data[:n] = payload
                    h.ready(n)
                else:
                    hits += 1
                h.close()
            ops += 64
            if pc() >= deadline:
                return ops, hits

    def flight(self, keys, payload: bytes, load_ns: int, timeout: float,
               core_wait: bool = False) -> Dict[str, Any]:
        """core_wait (ucmcache only): a waiter calls the core's wait step (ucm_wait_loaded,
        through cffi, the GIL released) instead of Handle.wait: the same Python process and
        loop with none of the handle's wait path, so the row tells the handle's cost apart from
        what any Python process pays to be woken."""
        get = self.c.get
        cpu, mono = time.thread_time_ns, time.monotonic_ns
        n = len(payload)
        body = payload[8:]
        log = FlightLog()
        if core_wait:
            from ucmcache._core import ffi, lib
            core_step, ctx, state = lib.ucm_wait_loaded, self.c._ctx, ffi.new("uint32_t *")
            timeout_ns = int(timeout * 1e9)
        for i, k in enumerate(keys):
            h = get(k)
            try:
                if h.owner:
                    spin_ns(load_ns)
                    mv = h.data
                    mv[8:n] = body
                    mv[:8] = mono().to_bytes(8, "little")
                    c0 = cpu()
                    h.ready(n)
                    log.published(cpu() - c0)
                elif h.state == "loading":
                    c0 = cpu()
                    if not core_wait:
                        h.wait(timeout)
                    elif core_step(ctx, h.slot, timeout_ns, state) != lib.UCM_OK:
                        raise TimeoutError("ucmcache core wait")
                    t = mono()
                    c1 = cpu()
                    log.woke(i, t - _stamp(h.data), c1 - c0)
                else:
                    log.hits += 1
            finally:
                h.close()
        return log.result()


class UcmSystem:
    name = "ucmcache"
    label = "ucmcache"

    def __init__(self, env):
        self.env = env

    @staticmethod
    def available(env) -> Tuple[bool, str]:
        try:
            import ucmcache  # noqa: F401
            from ucmcache import _core  # noqa: F401
        except Exception as e:
            return False, f"ucmcache does not import: {e}"
        return True, ""

    def create(self, *, slot_size: int, slots_per_rank: int, max_ranks: int, **_):
        from ucmcache import SlotCache

        uuid = f"bench-{self.env.tag}-{self.env.next_id()}"
        self.env.track_segment(uuid)
        cache = SlotCache.create(uuid, slots_per_rank=slots_per_rank, slot_size=slot_size,
                                 max_ranks=max_ranks)
        spec = {"uuid": uuid}
        return spec, HandleClient(cache, lambda c: c.close())

    def connect(self, spec, proc: int) -> HandleClient:
        from ucmcache import SlotCache

        return HandleClient(SlotCache.attach(spec["uuid"], rank=proc), lambda c: c.close())

    def destroy(self, spec) -> None:
        from ucmcache import SlotCache, SegmentNotFound

        try:
            SlotCache.unlink(spec["uuid"])
        except SegmentNotFound:
            pass
        self.env.untrack_segment(spec["uuid"])


class OldSystem:
    name = "old"
    label = "old design (Python API)"

    def __init__(self, env):
        self.env = env

    @staticmethod
    def available(env) -> Tuple[bool, str]:
        if env.old_mod is None:
            return False, env.old_why
        return True, ""

    def create(self, *, slot_size: int, slots_per_rank: int, max_ranks: int, **_):
        from .baselines.oldlock import OldCache

        uuid = f"{self.env.tag}-{self.env.next_id()}"
        self.env.track_old(uuid)
        cache = OldCache.create(self.env.old_mod, uuid, slots_per_rank=slots_per_rank,
                                slot_size=slot_size, max_ranks=max_ranks)
        return {"uuid": uuid}, HandleClient(cache, lambda c: c.close())

    def connect(self, spec, proc: int) -> HandleClient:
        from .baselines.oldlock import OldCache

        return HandleClient(OldCache.attach(self.env.old_mod, spec["uuid"]), lambda c: c.close())

    def destroy(self, spec) -> None:
        from .baselines.oldlock import OldCache

        OldCache.unlink(spec["uuid"])
        self.env.untrack_old(spec["uuid"])


# ====================================================================== LMDB


class LmdbClient:
    def __init__(self, spec):
        import lmdb

        self.env = lmdb.open(spec["path"], map_size=spec["map_size"], subdir=True, sync=False,
                             metasync=False, readahead=False, max_readers=126, lock=True)

    def close(self) -> None:
        if self.env is not None:
            self.env.close()
            self.env = None

    def populate(self, keys, payload) -> None:
        for i in range(0, len(keys), 2000):
            with self.env.begin(write=True) as w:
                for k in keys[i:i + 2000]:
                    w.put(k, payload)

    def hit_timed(self, seq, out) -> None:
        begin = self.env.begin
        pc = time.perf_counter_ns
        i = 0
        for k in seq:
            t0 = pc()
            with begin(buffers=True) as txn:
                txn.get(k)
            out[i] = pc() - t0
            i += 1

    def hit_bulk(self, seq) -> int:
        begin = self.env.begin
        pc = time.perf_counter_ns
        t0 = pc()
        for k in seq:
            with begin(buffers=True) as txn:
                txn.get(k)
        return pc() - t0

    def get_or_load_timed(self, seq, loader, out) -> None:
        """get_or_load's equivalent: a read txn's get; on a miss the loader and a write txn's
        put (no single-flight lock: one process).  LMDB does not evict: a full cache's
        eviction has no counterpart, the file grows instead."""
        begin = self.env.begin
        pc = time.perf_counter_ns
        i = 0
        for k in seq:
            t0 = pc()
            with begin() as txn:
                v = txn.get(k)
            if v is None:
                v = loader()
                with begin(write=True) as w:
                    w.put(k, v)
            out[i] = pc() - t0
            i += 1

    def exist_timed(self, reqs, out) -> int:
        begin = self.env.begin
        pc = time.perf_counter_ns
        found = 0
        for i, r in enumerate(reqs):
            t0 = pc()
            with begin(buffers=True) as txn:
                cur = txn.cursor()
                res = [cur.set_key(k) for k in r]
            out[i] = pc() - t0
            found += sum(res)
        return found

    def get_many_timed(self, reqs, out) -> int:
        begin = self.env.begin
        pc = time.perf_counter_ns
        got = 0
        for i, r in enumerate(reqs):
            t0 = pc()
            with begin(buffers=True) as txn:
                get = txn.get
                res = [get(k) for k in r]
            out[i] = pc() - t0
            got += len(res) - res.count(None)
        return got

    def mix(self, seq, cold_prefix, payload, deadline) -> Tuple[int, int]:
        begin = self.env.begin
        pc = time.perf_counter_ns
        ops = hits = cold = i = 0
        L = len(seq)
        while True:
            for _ in range(64):
                k = seq[i]
                i += 1
                if i == L:
                    i = 0
                if k is None:
                    k = cold_prefix + cold.to_bytes(8, "little")
                    cold += 1
                with begin(buffers=True) as txn:
                    hit = txn.get(k) is not None
                if hit:
                    hits += 1
                else:
                    with begin(write=True) as w:
                        w.put(k, payload)
            ops += 64
            if pc() >= deadline:
                return ops, hits

    def flight(self, keys, payload, load_ns, timeout) -> Dict[str, Any]:
        begin = self.env.begin

        def get(k):
            with begin() as txn:
                return txn.get(k)

        def claim(lock):  # the lock key added in the write txn that finds the key absent
            with begin(write=True) as w:
                return w.get(lock[1:]) is None and w.put(lock, b"1", overwrite=False)

        def set_(k, v):
            with begin(write=True) as w:
                w.put(k, v)

        return polled_flight(get, claim, set_, keys, payload, load_ns, timeout, "lmdb")


class LmdbSystem:
    name = "lmdb"
    label = "py-lmdb"

    def __init__(self, env):
        self.env = env

    @staticmethod
    def available(env) -> Tuple[bool, str]:
        try:
            import lmdb
        except ImportError:
            return False, "py-lmdb is not installed (pip install lmdb, the `bench` extra)"
        return True, f"lmdb {lmdb.__version__}"

    def create(self, *, slot_size: int, n_keys: int, **_):
        path = os.path.join(self.env.tmpdir, f"lmdb-{self.env.next_id()}")
        os.makedirs(path)
        # 4 KiB values use overflow pages: ~2x the payload on disk; generous and sparse.
        map_size = max(1 << 28, int(n_keys * (slot_size + 4096) * 2.5))
        spec = {"path": path, "map_size": map_size}
        return spec, LmdbClient(spec)

    def connect(self, spec, proc: int) -> LmdbClient:
        return LmdbClient(spec)

    def destroy(self, spec) -> None:
        shutil.rmtree(spec["path"], ignore_errors=True)


# ====================================================================== Redis


class _GetSetLoops:
    """The timed loops of a client whose store is a get(key) / set(key, value) object
    (self._kv): Redis and diskcache share them, so their measurements are the same code."""

    def hit_timed(self, seq, out) -> None:
        get = self._kv.get
        pc = time.perf_counter_ns
        i = 0
        for k in seq:
            t0 = pc()
            get(k)
            out[i] = pc() - t0
            i += 1

    def hit_bulk(self, seq) -> int:
        get = self._kv.get
        pc = time.perf_counter_ns
        t0 = pc()
        for k in seq:
            get(k)
        return pc() - t0

    def mix(self, seq, cold_prefix, payload, deadline) -> Tuple[int, int]:
        get, set_ = self._kv.get, self._kv.set
        pc = time.perf_counter_ns
        ops = hits = cold = i = 0
        L = len(seq)
        while True:
            for _ in range(64):
                k = seq[i]
                i += 1
                if i == L:
                    i = 0
                if k is None:
                    k = cold_prefix + cold.to_bytes(8, "little")
                    cold += 1
                if get(k) is not None:
                    hits += 1
                else:
                    set_(k, payload)
            ops += 64
            if pc() >= deadline:
                return ops, hits


class RedisClient(_GetSetLoops):
    def __init__(self, spec):
        import redis

        self.r = redis.Redis(unix_socket_path=spec["sock"])
        self._kv = self.r

    def close(self) -> None:
        if self.r is not None:
            self.r.close()
            self.r = None

    def populate(self, keys, payload) -> None:
        for i in range(0, len(keys), 500):
            p = self.r.pipeline(transaction=False)
            for k in keys[i:i + 500]:
                p.set(k, payload)
            p.execute()

    def exist_timed(self, reqs, out) -> int:
        pipe = self.r.pipeline
        pc = time.perf_counter_ns
        found = 0
        for i, r in enumerate(reqs):
            t0 = pc()
            p = pipe(transaction=False)
            for k in r:
                p.exists(k)
            res = p.execute()
            out[i] = pc() - t0
            found += sum(res)
        return found

    def get_many_timed(self, reqs, out) -> int:
        mget = self.r.mget
        pc = time.perf_counter_ns
        got = 0
        for i, r in enumerate(reqs):
            t0 = pc()
            res = mget(r)
            out[i] = pc() - t0
            got += len(res) - res.count(None)
        return got

    def flight(self, keys, payload, load_ns, timeout) -> Dict[str, Any]:
        set_ = self.r.set
        return polled_flight(self.r.get, lambda lock: set_(lock, b"1", nx=True), set_, keys,
                             payload, load_ns, timeout, "redis")


class RedisSystem:
    name = "redis"
    label = "Redis (unix socket)"

    def __init__(self, env):
        self.env = env

    @staticmethod
    def available(env) -> Tuple[bool, str]:
        if env.redis is None:
            return False, env.redis_why
        return True, f"redis-server {env.redis.version}"

    def create(self, *, slot_size: int, evict_bytes: Optional[int] = None, **_):
        import redis

        sock = self.env.redis.sock
        r = redis.Redis(unix_socket_path=sock)
        r.flushall()
        if evict_bytes:
            # maxmemory counts the server's own baseline too: capacity on top of it, plus
            # Redis's per-key overhead (~100 B) so it holds about as many values as the others.
            base = int(r.info("memory")["used_memory"])
            r.config_set("maxmemory", str(base + int(evict_bytes * 1.05) + 256 * 1024))
            r.config_set("maxmemory-policy", "allkeys-lru")
        else:
            r.config_set("maxmemory", "0")
        r.close()
        spec = {"sock": sock}
        return spec, RedisClient(spec)

    def connect(self, spec, proc: int) -> RedisClient:
        return RedisClient(spec)

    def destroy(self, spec) -> None:
        import redis

        r = redis.Redis(unix_socket_path=spec["sock"])
        r.flushall()
        r.config_set("maxmemory", "0")
        r.close()


# ====================================================================== multiprocessing.Manager


class ManagerClient:
    def __init__(self, spec):
        self.d = spec["dict"]

    def close(self) -> None:
        pass

    def populate(self, keys, payload) -> None:
        for i in range(0, len(keys), 200):
            self.d.update({k: payload for k in keys[i:i + 200]})

    def hit_timed(self, seq, out) -> None:
        d = self.d
        pc = time.perf_counter_ns
        i = 0
        for k in seq:
            t0 = pc()
            d[k]
            out[i] = pc() - t0
            i += 1

    def hit_bulk(self, seq) -> int:
        d = self.d
        pc = time.perf_counter_ns
        t0 = pc()
        for k in seq:
            d[k]
        return pc() - t0

    def exist_timed(self, reqs, out) -> int:
        d = self.d
        pc = time.perf_counter_ns
        found = 0
        for i, r in enumerate(reqs):
            t0 = pc()
            res = [k in d for k in r]
            out[i] = pc() - t0
            found += sum(res)
        return found

    def get_many_timed(self, reqs, out) -> int:
        get = self.d.get
        pc = time.perf_counter_ns
        got = 0
        for i, r in enumerate(reqs):
            t0 = pc()
            res = [get(k) for k in r]
            out[i] = pc() - t0
            got += len(res) - res.count(None)
        return got

    def mix(self, seq, cold_prefix, payload, deadline) -> Tuple[int, int]:
        d = self.d
        get = d.get
        pc = time.perf_counter_ns
        ops = hits = cold = i = 0
        L = len(seq)
        while True:
            for _ in range(64):
                k = seq[i]
                i += 1
                if i == L:
                    i = 0
                if k is None:
                    k = cold_prefix + cold.to_bytes(8, "little")
                    cold += 1
                if get(k) is not None:
                    hits += 1
                else:
                    d[k] = payload
            ops += 64
            if pc() >= deadline:
                return ops, hits

    def flight(self, keys, payload, load_ns, timeout) -> Dict[str, Any]:
        d = self.d
        me = os.getpid()
        return polled_flight(d.get, lambda lock: d.setdefault(lock, me) == me, d.__setitem__,
                             keys, payload, load_ns, timeout, "manager")


class ManagerSystem:
    name = "manager"
    label = "multiprocessing.Manager dict"

    def __init__(self, env):
        self.env = env

    @staticmethod
    def available(env) -> Tuple[bool, str]:
        if env.manager is None:
            return False, env.manager_why
        return True, ""

    def create(self, **_):
        spec = {"dict": self.env.manager.dict()}
        return spec, ManagerClient(spec)

    def connect(self, spec, proc: int) -> ManagerClient:
        return ManagerClient(spec)

    def destroy(self, spec) -> None:
        try:
            spec["dict"].clear()
        except Exception:
            pass
        spec["dict"] = None


# ====================================================================== diskcache


class DiskcacheClient(_GetSetLoops):
    def __init__(self, spec, create: bool = False):
        import diskcache

        kw = {}
        if create:
            kw = {"size_limit": spec["size_limit"], "eviction_policy": "least-recently-used"}
        self.c = diskcache.Cache(spec["dir"], **kw)
        self._kv = self.c

    def close(self) -> None:
        if self.c is not None:
            self.c.close()
            self.c = None

    def populate(self, keys, payload) -> None:
        c = self.c
        for i in range(0, len(keys), 1000):
            with c.transact():
                for k in keys[i:i + 1000]:
                    c.set(k, payload)

    def exist_timed(self, reqs, out) -> int:
        c = self.c
        pc = time.perf_counter_ns
        found = 0
        for i, r in enumerate(reqs):
            t0 = pc()
            res = [k in c for k in r]
            out[i] = pc() - t0
            found += sum(res)
        return found

    def get_many_timed(self, reqs, out) -> int:
        get = self.c.get
        pc = time.perf_counter_ns
        got = 0
        for i, r in enumerate(reqs):
            t0 = pc()
            res = [get(k) for k in r]
            out[i] = pc() - t0
            got += len(res) - res.count(None)
        return got

    def flight(self, keys, payload, load_ns, timeout) -> Dict[str, Any]:
        c = self.c
        me = os.getpid()
        return polled_flight(c.get, lambda lock: c.add(lock, me), c.set, keys, payload, load_ns,
                             timeout, "diskcache")


class DiskcacheSystem:
    name = "diskcache"
    label = "diskcache"

    def __init__(self, env):
        self.env = env

    @staticmethod
    def available(env) -> Tuple[bool, str]:
        try:
            import diskcache
        except ImportError:
            return False, "diskcache is not installed (pip install diskcache, the `bench` extra)"
        return True, f"diskcache {diskcache.__version__}"

    def create(self, *, slot_size: int, n_keys: int, evict_bytes: Optional[int] = None, **_):
        path = os.path.join(self.env.tmpdir, f"diskcache-{self.env.next_id()}")
        # No eviction unless the scenario asks for it (default size_limit is 1 GiB).
        limit = int(evict_bytes) if evict_bytes else max(1 << 30, 4 * n_keys * slot_size)
        spec = {"dir": path, "size_limit": limit}
        return spec, DiskcacheClient(spec, create=True)

    def connect(self, spec, proc: int) -> DiskcacheClient:
        return DiskcacheClient(spec)

    def destroy(self, spec) -> None:
        shutil.rmtree(spec["dir"], ignore_errors=True)


ALL_SYSTEMS = [UcmSystem, OldSystem, LmdbSystem, RedisSystem, ManagerSystem, DiskcacheSystem]
