"""ucmcache benchmarks, side by side with baselines.

    .venv/bin/python -m bench.run            # the full run (about 4-5 minutes on 2 cores)
    .venv/bin/python -m bench.run --scenarios 7   # the reads alone (under a minute)
    .venv/bin/python -m bench.run --scenarios 8   # hit rate at equal memory alone (about 15 s)
    .venv/bin/python -m bench.run --quick    # tiny sizes: checks the harness, numbers mean little

Writes bench/results/latest.json, latest.md and latest.png (--out DIR to put them elsewhere).
Every number in them is measured in the one run that wrote them.

Scenarios (same payloads, key sets and process counts for every system):
  1 hit:    single-process hit get+release, ns/op p50/p99 (4 KiB and 64 KiB slots)
  2 batch:  64-key exist and get_many+release over 10^5 resident keys, ns/key
  3 mix:    95% hits / 5% misses (loads, evictions), 1 and 2 processes, total ops/s
  4 flight: 4 processes ask the same 1000 cold keys: loader runs, waiter wake latency
  5 churn:  working set 4x capacity, 2 processes, ops/s and hit rate
  6 tier2:  get_or_load local hit vs a hit served from Redis vs a cold miss
  7 reads:  what a user does with a hit: per-key read of h.data, get_or_load hit,
            get_many(64) + every data(i), gather / read_many of 64 into a numpy array, each vs
            py-lmdb doing the same work, the old design, the Python floor and the memcpy floor;
            every row interleaved in one process, median [min-max] over repetitions (reads.py)
  8 arenas: hit rate at equal memory: one Zipf(0.9) trace against a segment of 8 ranks
            x 500 slots with 8, 4, 2, 1 (and 4, skewed) ranks attached vs a global LRU of as many
            slots; ucmcache hits / LRU hits per row; one process, deterministic (arenas.py)
  9 cold:   get_or_load of a key not in a full cache (so it evicts), the loader returning 4 KiB
            it already has, ns/op p50/p99, beside a get_or_load hit; ucmcache, the old design
            and py-lmdb (its get that misses, then the put in a write transaction; no eviction)
Scenarios 1-6, 9 and the floors run --repeat passes (default 3): each figure is the median over the
passes, each ratio the median of the per-pass ratios with its [min-max].  --time-scale X
multiplies scenarios 3 and 5's measurement windows (s3_time, s5_time; the config in latest.json
holds the scaled values).
Baselines: the old locking design (bench/baselines/oldlock.*), py-lmdb, Redis over a unix socket,
multiprocessing.Manager dict, diskcache; floors: a C-only run of the same protocol steps
(bench/floor.c) and a Python floor (an empty context manager + the same number of no-op C calls).
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from typing import Any, Dict, List, Optional

_RUN_AS_MODULE = __package__ not in (None, "")
if not _RUN_AS_MODULE:  # run as a file (`ucmcache bench` does that): make `bench` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    __package__ = "bench"

from bench import arenas, cbuild, common, reads, report  # noqa: E402
from bench.baselines.redis_server import RedisServer  # noqa: E402
from bench.systems import ALL_SYSTEMS  # noqa: E402

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
FORK = mp.get_context("fork")

FULL = {
    "sizes": [4096, 65536],
    "s1_keys": 1000, "s1_time": 0.25, "s1_max": 30000,
    "s2_keys": 100_000, "s2_batch": 64, "s2_time": 0.35, "s2_max": 4000,
    "s3_spr": {4096: 4096, 65536: 512}, "s3_time": 1.5, "s3_seq": 1 << 16, "s3_miss_pct": 5,
    "s4_keys": 1000, "s4_procs": 4, "s4_load_us": 50,
    "s5_spr": {4096: 2048, 65536: 256}, "s5_time": 1.0,
    "floor_hit_iters": 2_000_000, "floor_batch_reqs": 20000, "floor_mix_ms": 1000,
    "pyfloor_ops": 100_000,
    "s6_keys": 2000,
    "s9_capacity": 4096, "s9_keys": 20000,
    # scenario 7 (reads): every row interleaved, s7_reps repetitions of s7_rounds
    # rounds, each row a slice of about s7_slice s per round
    "s7_keys": 4096, "s7_keys_by_size": {}, "s7_batch": 64, "s7_reps": 5, "s7_rounds": 6,
    "s7_slice": 0.02, "s7_pool": 100_000, "s7_distinct_batches": 256,
    "s7_min_keys": 200, "s7_max_keys": 50_000, "s7_min_batches": 3, "s7_max_batches": 2000,
    # scenario 8 (hit rate at equal memory): its sizes live in arenas.py
    **arenas.FULL,
}
QUICK = {
    "sizes": [4096, 65536],
    "s1_keys": 50, "s1_time": 0.01, "s1_max": 300,
    "s2_keys": 500, "s2_batch": 64, "s2_time": 0.01, "s2_max": 5,
    "s3_spr": {4096: 64, 65536: 16}, "s3_time": 0.05, "s3_seq": 1024, "s3_miss_pct": 5,
    "s4_keys": 20, "s4_procs": 4, "s4_load_us": 50,
    "s5_spr": {4096: 32, 65536: 8}, "s5_time": 0.05,
    "floor_hit_iters": 20000, "floor_batch_reqs": 200, "floor_mix_ms": 50,
    "pyfloor_ops": 2000,
    "s6_keys": 50,
    "s9_capacity": 64, "s9_keys": 200,
    "s7_keys": 256, "s7_keys_by_size": {}, "s7_batch": 64, "s7_reps": 3, "s7_rounds": 1,
    "s7_slice": 0.002, "s7_pool": 2000, "s7_distinct_batches": 16,
    "s7_min_keys": 50, "s7_max_keys": 2000, "s7_min_batches": 2, "s7_max_batches": 20,
    **arenas.QUICK,
}
SCENARIOS = ["1", "2", "3", "4", "5", "6", "7", "8", "9"]


# ====================================================================== run-wide environment


class Env:
    """Run-wide resources, each released in cleanup() whatever happened."""

    def __init__(self, tmpdir: str, quick: bool):
        self.tmpdir = tmpdir
        self.quick = quick
        self.tag = common.tag()
        self._id = 0
        self.segments: set = set()
        self.olds: set = set()
        self.old_mod = None
        self.old_why = ""
        self.floor_bin: Optional[str] = None
        self.floor_why = ""
        self.redis: Optional[RedisServer] = None
        self.redis_why = ""
        self.manager = None
        self.manager_why = ""

    def next_id(self) -> int:
        self._id += 1
        return self._id

    def track_segment(self, uuid: str) -> None:
        self.segments.add(uuid)

    def untrack_segment(self, uuid: str) -> None:
        self.segments.discard(uuid)

    def track_old(self, uuid: str) -> None:
        self.olds.add(uuid)

    def untrack_old(self, uuid: str) -> None:
        self.olds.discard(uuid)

    def start(self, want: List[str]) -> None:
        self.floor_bin, self.floor_why = cbuild.build_floor(self.tmpdir)
        self.old_mod, self.old_why = cbuild.build_old_module(self.tmpdir)
        if "redis" in want:
            srv = RedisServer(self.tmpdir)
            try:
                srv.start()
                self.redis = srv
            except Exception as e:
                srv.stop()
                self.redis_why = str(e) or type(e).__name__
                if isinstance(e, ImportError):
                    self.redis_why = "redis-py is not installed (pip install 'redis[hiredis]')"
        if "manager" in want:
            try:
                self.manager = FORK.Manager()
            except Exception as e:
                self.manager_why = f"multiprocessing.Manager() failed: {e}"

    def cleanup(self) -> None:
        for uuid in list(self.segments):
            try:
                from ucmcache import SlotCache

                SlotCache.unlink(uuid)
            except Exception:
                pass
        self.segments.clear()
        from bench.baselines.oldlock import OldCache

        for uuid in list(self.olds):
            OldCache.unlink(uuid)
        self.olds.clear()
        if self.redis is not None:
            self.redis.stop()
            self.redis = None
        if self.manager is not None:
            try:
                self.manager.shutdown()
            except Exception:
                pass
            self.manager = None
        shutil.rmtree(self.tmpdir, ignore_errors=True)


def log(msg: str) -> None:
    print(msg, flush=True)


# ====================================================================== process helpers


def _child(fn, system, spec, proc, barrier, start, queue, kwargs):
    try:
        try:
            client = system.connect(spec, proc)
        except BaseException:
            barrier.abort()  # the others (and the parent) stop waiting for us at once
            raise
        try:
            barrier.wait(60)  # everyone connected
            barrier.wait(60)  # the parent has set the start time
            _sleep_until(start.value)
            res = fn(client, proc, **kwargs)
        finally:
            client.close()
        queue.put((proc, "ok", res))
    except BaseException as e:  # report, never hang the parent
        queue.put((proc, "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


def _sleep_until(t_ns: int) -> None:
    left = t_ns - time.monotonic_ns()
    if left > 2_000_000:
        time.sleep((left - 1_000_000) / 1e9)
    while time.monotonic_ns() < t_ns:  # the last millisecond: spin, for a common start
        pass


def run_procs(system, spec, nprocs: int, fn, kwargs: Dict[str, Any], timeout: float) -> List[Any]:
    """Run fn(client, proc, **kwargs) in nprocs forked processes that start at one instant
    (a shared start time set after all have connected)."""
    barrier = FORK.Barrier(nprocs + 1)
    start = FORK.RawValue("q", 0)
    queue = FORK.Queue()
    procs = [FORK.Process(target=_child, args=(fn, system, spec, p, barrier, start, queue, kwargs),
                          daemon=True) for p in range(nprocs)]
    for p in procs:
        p.start()
    results: List[Any] = [None] * nprocs
    errors = []
    deadline = time.monotonic() + timeout
    try:
        try:
            barrier.wait(60)
            start.value = time.monotonic_ns() + 20_000_000
            barrier.wait(60)
        except Exception:
            pass  # a child failed to connect: its error arrives on the queue
        for _ in range(nprocs):
            left = max(0.1, deadline - time.monotonic())
            proc, status, res = queue.get(timeout=left)
            if status == "ok":
                results[proc] = res
            else:
                errors.append(f"proc {proc}: {res}")
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()  # only our own child, by its handle
                p.join(5)
    if errors:
        raise RuntimeError("; ".join(errors))
    return results


def _mix_child(client, proc, *, seqs, prefix, payload, duration):
    seq = seqs[proc]
    pc = time.perf_counter_ns
    t0 = pc()
    cold_prefix = (prefix + bytes([proc])).ljust(8, b"\0")[:8]  # + an 8-byte counter = 16
    ops, hits = client.mix(seq, cold_prefix, payload, t0 + int(duration * 1e9))
    return {"ops": ops, "hits": hits, "elapsed_ns": pc() - t0}


def _flight_child(client, proc, *, keys, payload, load_ns, core_wait=False):
    if core_wait:  # ucmcache's Python floor of a wake-up (HandleClient.flight)
        return client.flight(keys, payload, load_ns, timeout=60.0, core_wait=True)
    return client.flight(keys, payload, load_ns, timeout=60.0)


# ====================================================================== floors


def run_floor(env: Env, mode: str, design: str, **kw) -> Optional[Dict[str, Any]]:
    if env.floor_bin is None:
        return None
    cmd = [env.floor_bin, mode, design] + [f"{k}={v}" for k, v in kw.items()]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if r.returncode != 0:
        raise RuntimeError(f"floor {mode} {design} failed: {r.stderr.strip()}")
    return json.loads(r.stdout)


def c_floor(env: Env, cfg, out: Dict[str, Any]) -> None:
    if env.floor_bin is None:
        out["c_floor"] = {"skipped": env.floor_why}
        log(f"[floor] C floor skipped: {env.floor_why}")
        return
    res: Dict[str, Any] = {"hit": {}, "batch": {}, "mix": {}, "churn": {}}
    for size in cfg["sizes"]:
        for d in ("new", "old"):
            r = run_floor(env, "hit", d, slot_size=size, n_keys=cfg["s1_keys"],
                          iters=cfg["floor_hit_iters"])
            res["hit"].setdefault(str(size), {})[d] = r
        log(f"[floor] hit {size}: new p50 {res['hit'][str(size)]['new']['p50_ns']} ns, "
            f"old {res['hit'][str(size)]['old']['p50_ns']} ns")
    for d in ("new", "old"):
        res["batch"][d] = run_floor(env, "batch", d, n_keys=cfg["s2_keys"], batch=cfg["s2_batch"],
                                    reqs=cfg["floor_batch_reqs"])
    log(f"[floor] batch: exist new {res['batch']['new']['exist_ns_per_key']} ns/key "
        f"old {res['batch']['old']['exist_ns_per_key']}; get_many new "
        f"{res['batch']['new']['get_many_ns_per_key']} old {res['batch']['old']['get_many_ns_per_key']}")
    for size in cfg["sizes"]:
        spr = cfg["s3_spr"][size]
        for d in ("new", "old"):
            for n in (1, 2):
                r = run_floor(env, "mix", d, slot_size=size, spr=spr, nprocs=n, ranks=2,
                              duration_ms=cfg["floor_mix_ms"], miss_pct=cfg["s3_miss_pct"],
                              hot=spr // 2, preload=1)
                res["mix"].setdefault(str(size), {}).setdefault(d, {})[str(n)] = r
        m = res["mix"][str(size)]
        log(f"[floor] mix {size}: new 1p {m['new']['1']['ops_per_s']:.3g}/s 2p "
            f"{m['new']['2']['ops_per_s']:.3g}/s; old 1p {m['old']['1']['ops_per_s']:.3g}/s 2p "
            f"{m['old']['2']['ops_per_s']:.3g}/s")
    size = 4096
    spr = cfg["s5_spr"][size]
    for d in ("new", "old"):
        res["churn"][d] = run_floor(env, "mix", d, slot_size=size, spr=spr, nprocs=2, ranks=2,
                                    duration_ms=cfg["floor_mix_ms"], miss_pct=0,
                                    hot=4 * 2 * spr, preload=0)
    log(f"[floor] churn 4096: new {res['churn']['new']['ops_per_s']:.3g}/s old "
        f"{res['churn']['old']['ops_per_s']:.3g}/s")
    res["flight"] = {}
    # new_resident: ucmcache's steps in processes holding as much memory resident as this
    # Python process (numpy and ucmcache imported, as each scenario 4 process is): what the
    # size of a woken process alone costs, beside the tiny C processes of "new"
    resident_mb = python_resident_mb()
    for d, design, extra in (("new", "new", {}), ("old", "old", {}),
                             ("new_resident", "new", {"resident_mb": resident_mb})):
        r = run_floor(env, "flight", design, n_keys=cfg["s4_keys"], nprocs=cfg["s4_procs"],
                      load_us=cfg["s4_load_us"], slot_size=4096, **extra)
        wakes = r.pop("wakes")
        r.update(common.wake_orders([k for k, _ in wakes], [lat for _, lat in wakes]))
        r.update(flight_cpu_figures(r["waiter_cpu_us"], r["wake_p99_us"]))
        r.update(extra)
        res["flight"][d] = r
    for d, what in (("new", "futex"), ("old", "polling"),
                    ("new_resident", f"futex, {resident_mb} MB resident")):
        r = res["flight"][d]
        log(f"[floor] flight {d} ({what}): runs {r['loader_runs']} wake p50 {r['wake_p50_us']} us "
            f"(first woken {_get_first_p50(r)} us) "
            f"p99 {r['wake_p99_us']} us, waiter CPU {r['waiter_cpu_us']} us per wake-up; waits "
            f"begun within 5 us before the publish {r['lead_within_5us']}, after it "
            f"{r['lead_negative']}")
    out["c_floor"] = res


class _EmptyCM:
    __slots__ = ("r",)

    def __init__(self, r):
        self.r = r

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        _NOOP_RELEASE(_NULL, 0)


_NOOP_RELEASE = None
_NULL = None


def python_resident_mb() -> int:
    """This process's resident memory in MB (VmRSS), at least 1."""
    with open("/proc/self/status") as f:
        kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return max(1, round(kb / 1024))


def py_floor(env: Env, cfg, out: Dict[str, Any]) -> None:
    """An empty context manager object plus the same number of no-op C calls (cffi API mode,
    the same argument types as ucm_lookup_pin / ucm_release / the batch calls)."""
    global _NOOP_RELEASE, _NULL
    if env.old_mod is None:
        out["py_floor"] = {"skipped": env.old_why}
        return
    ffi, lib = env.old_mod.ffi, env.old_mod.lib
    _NOOP_RELEASE, _NULL = lib.bench_noop_release, ffi.NULL
    noop_lookup = lib.bench_noop_lookup
    ks = common.keys(cfg["s1_keys"])
    n = cfg["pyfloor_ops"]
    seq = [ks[i] for i in common.rng_indices(n, len(ks), 11)]
    ovh = common.timer_overhead()
    pc = time.perf_counter_ns
    t = [0] * n
    i = 0
    NULL = ffi.NULL
    for k in seq:
        t0 = pc()
        with _EmptyCM(noop_lookup(NULL, k, 0, 64, 1)):
            pass
        t[i] = pc() - t0
        i += 1
    hit = common.stats_ns(t, ovh)
    # batches: join the ids (the packing any batch call needs), one no-op call (exist);
    # + an empty context manager whose exit makes the second no-op call (get_many + close)
    import numpy as np

    B = cfg["s2_batch"]
    reqs = [[ks[j] for j in common.rng_indices(B, len(ks), 100 + r)] for r in range(200)]
    offs = ffi.from_buffer("uint64_t[]", np.zeros(B, dtype=np.uint64))
    outb = ffi.from_buffer("uint8_t[]", np.zeros(B, dtype=np.uint8))
    slots = ffi.from_buffer("uint32_t[]", np.zeros(B, dtype=np.uint32))
    many, rel_many = lib.bench_noop_many, lib.bench_noop_release_many
    m = max(200, n // B)
    te, tg = [0] * m, [0] * m
    for r in range(m):
        q = reqs[r % len(reqs)]
        t0 = pc()
        many(NULL, b"".join(q), offs, B, outb)
        t1 = pc()
        with _BatchCM(many(NULL, b"".join(q), offs, B, outb), rel_many, slots, B):
            pass
        t2 = pc()
        te[r], tg[r] = t1 - t0, t2 - t1
    out["py_floor"] = {
        "hit": hit,
        "exist_per_key": common.stats_ns(te, ovh, B),
        "get_many_per_key": common.stats_ns(tg, ovh, B),
        "what": "hit: an empty context manager object + 2 no-op cffi calls (lookup, release "
                "signatures); batch: b''.join of 64 ids + 1 no-op call (exist), + an empty "
                "context manager and a 2nd no-op call (get_many + close)",
    }
    log(f"[floor] python floor: hit p50 {hit['p50_ns']} ns; exist "
        f"{out['py_floor']['exist_per_key']['mean_ns']} ns/key; get_many "
        f"{out['py_floor']['get_many_per_key']['mean_ns']} ns/key")


class _BatchCM:
    __slots__ = ("r", "f", "s", "n")

    def __init__(self, r, f, s, n):
        self.r, self.f, self.s, self.n = r, f, s, n

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.f(_NULL, self.s, self.n)


# ====================================================================== scenarios


def _with_store(system, make_kw, body):
    spec, client = system.create(**make_kw)
    try:
        return body(spec, client)
    finally:
        try:
            client.close()
        finally:
            system.destroy(spec)


def _count_for(budget_s: float, per_op_ns: float, lo: int, hi: int) -> int:
    return int(max(lo, min(hi, budget_s * 1e9 / max(per_op_ns, 1.0))))


def scenario1(env: Env, systems, cfg, out) -> None:
    n = cfg["s1_keys"]
    ks = common.keys(n)
    seq_all = [ks[i] for i in common.rng_indices(cfg["s1_max"], n, 1)]
    ovh = common.timer_overhead()
    res: Dict[str, Any] = {"timer_overhead_ns": ovh, "resident_keys": n, "by_size": {}}
    for size in cfg["sizes"]:
        pay = common.payload(size)
        row: Dict[str, Any] = {}
        for system in systems:
            def body(spec, cl, system=system):
                cl.populate(ks, pay)
                probe = seq_all[:200]
                cl.hit_bulk(probe)  # warm-up
                per = cl.hit_bulk(probe) / len(probe)
                m = _count_for(cfg["s1_time"], per, 200, cfg["s1_max"])
                seq = seq_all[:m]
                t = [0] * m
                cl.hit_timed(seq, t)
                r = common.stats_ns(t, ovh)
                bulk = cl.hit_bulk(seq)
                r["bulk_mean_ns"] = round(bulk / m - common.loop_overhead(seq), 1)
                if system.name == "ucmcache":
                    t2 = [0] * m
                    cl.hit_close_timed(seq, t2)
                    r["get_close"] = common.stats_ns(t2, ovh)
                    cl.hit_data_timed(seq, t2)
                    r["get_data_close"] = common.stats_ns(t2, ovh)
                return r
            try:
                row[system.name] = _with_store(system, dict(slot_size=size, slots_per_rank=n + 64,
                                                            max_ranks=1, n_keys=n), body)
                log(f"[1 hit] {size:>5} B {system.name:<10} p50 {row[system.name]['p50_ns']:>9} ns  "
                    f"p99 {row[system.name]['p99_ns']:>9} ns")
            except Exception as e:
                row[system.name] = {"error": f"{type(e).__name__}: {e}"}
                log(f"[1 hit] {size} {system.name} ERROR {e}")
        res["by_size"][str(size)] = row
    out["s1_hit"] = res


def scenario2(env: Env, systems, cfg, out) -> None:
    n, B = cfg["s2_keys"], cfg["s2_batch"]
    size = 4096
    ks = common.keys(n, seed=common.KEY_SEED + 2)
    pay = common.payload(size)
    import numpy as np

    rng = np.random.default_rng(2)
    distinct = 512
    reqs_all = [[ks[j] for j in rng.choice(n, size=B, replace=False)] for _ in range(distinct)]
    ovh = common.timer_overhead()
    res: Dict[str, Any] = {"resident_keys": n, "batch": B, "slot_size": size, "systems": {}}
    for system in systems:
        def body(spec, cl):
            t0 = time.perf_counter()
            cl.populate(ks, pay)
            pop_s = time.perf_counter() - t0
            probe = reqs_all[:8]
            w = [0] * len(probe)
            cl.exist_timed(probe, w)  # warm-up
            cl.get_many_timed(probe, w)
            t1 = [0] * len(probe)
            cl.exist_timed(probe, t1)
            t2 = [0] * len(probe)
            cl.get_many_timed(probe, t2)
            me = _count_for(cfg["s2_time"], sum(t1) / len(t1), 5, cfg["s2_max"])
            mg = _count_for(cfg["s2_time"], sum(t2) / len(t2), 5, cfg["s2_max"])
            reqs_e = [reqs_all[i % distinct] for i in range(me)]
            reqs_g = [reqs_all[i % distinct] for i in range(mg)]
            te, tg = [0] * me, [0] * mg
            found = cl.exist_timed(reqs_e, te)
            got = cl.get_many_timed(reqs_g, tg)
            return {"exist_per_key": common.stats_ns(te, ovh, B),
                    "get_many_per_key": common.stats_ns(tg, ovh, B),
                    "exist_found": found, "exist_asked": me * B,
                    "get_many_found": got, "get_many_asked": mg * B,
                    "populate_s": round(pop_s, 2)}
        try:
            r = _with_store(system, dict(slot_size=size, slots_per_rank=n + n // 4 + 64,
                                         max_ranks=1, n_keys=n), body)
            res["systems"][system.name] = r
            log(f"[2 batch] {system.name:<10} exist {r['exist_per_key']['mean_ns']:>8} ns/key  "
                f"get_many {r['get_many_per_key']['mean_ns']:>8} ns/key  "
                f"(found {r['exist_found']}/{r['exist_asked']}, populate {r['populate_s']} s)")
        except Exception as e:
            res["systems"][system.name] = {"error": f"{type(e).__name__}: {e}"}
            log(f"[2 batch] {system.name} ERROR {e}")
    out["s2_batch"] = res


def _mix_seqs(hot_keys: List[bytes], nprocs: int, length: int, miss_pct: int, seed: int):
    import numpy as np

    seqs = []
    for p in range(nprocs):
        rng = np.random.default_rng(seed + p)
        idx = rng.integers(0, len(hot_keys), size=length)
        cold = rng.integers(0, 100, size=length) < miss_pct
        seqs.append([None if c else hot_keys[i] for i, c in zip(idx.tolist(), cold.tolist())])
    return seqs


def scenario3(env: Env, systems, cfg, out) -> None:
    res: Dict[str, Any] = {"miss_pct": cfg["s3_miss_pct"], "by_size": {}}
    for size in cfg["sizes"]:
        spr = cfg["s3_spr"][size]
        hot = spr // 2
        hot_keys = common.keys(hot, seed=common.KEY_SEED + 3)
        pay = common.payload(size)
        seqs = _mix_seqs(hot_keys, 2, cfg["s3_seq"], cfg["s3_miss_pct"], 30)
        row: Dict[str, Any] = {}
        for system in systems:
            for nprocs in ((1, 2) if system.name in ("ucmcache", "old") else (2,)):
                key = f"{nprocs}p"
                def body(spec, cl):
                    cl.populate(hot_keys, pay)
                    cl.close()
                    rs = run_procs(system, spec, nprocs, _mix_child,
                                   dict(seqs=seqs, prefix=b"s3" + bytes([nprocs]),
                                        payload=pay, duration=cfg["s3_time"]),
                                   timeout=cfg["s3_time"] * 10 + 60)
                    ops = sum(r["ops"] for r in rs)
                    hits = sum(r["hits"] for r in rs)
                    return {"ops_per_s": round(sum(r["ops"] * 1e9 / r["elapsed_ns"] for r in rs), 1),
                            "ops": ops, "hit_rate": round(hits / max(ops, 1), 4), "procs": nprocs,
                            "per_proc": rs}
                try:
                    r = _with_store(system, dict(slot_size=size, slots_per_rank=spr, max_ranks=2,
                                                 n_keys=hot + 200_000), body)
                    row.setdefault(system.name, {})[key] = r
                    log(f"[3 mix] {size:>5} B {system.name:<10} {key}: {r['ops_per_s']:>12,.0f} ops/s "
                        f"hit rate {r['hit_rate']:.3f}")
                except Exception as e:
                    row.setdefault(system.name, {})[key] = {"error": f"{type(e).__name__}: {e}"}
                    log(f"[3 mix] {size} {system.name} {key} ERROR {e}")
        res["by_size"][str(size)] = {"slots_per_rank": spr, "hot_keys": hot, "systems": row}
    out["s3_mix"] = res


def _waiter_cpu(rs: List[Dict[str, Any]], wake_p99_us: Optional[float]) -> Dict[str, Any]:
    """Scenario 4's CPU figures from its processes' samples, each less its process's clock
    overhead: the waiter's CPU per wake-up (mean: total waiter CPU / waits, and p50), the
    owner's per publish, and the combined figures (see report.FLIGHT_CPU_NOTE)."""
    def less(r, key):
        return [max(0, x - r["cpu_overhead"]) for x in r[key]]
    wait_cpu = [x for r in rs for x in less(r, "wait_cpu")]
    publish_cpu = [x for r in rs for x in less(r, "publish_cpu")]
    if not wait_cpu:
        return {}
    per_wake_us = sum(wait_cpu) / len(wait_cpu) / 1000
    res = {"waiter_cpu_us": round(per_wake_us, 2),
           "waiter_cpu_p50_us": round(common.stats_ns(wait_cpu)["p50_ns"] / 1000, 2),
           "publish_cpu_us": (round(sum(publish_cpu) / len(publish_cpu) / 1000, 2)
                              if publish_cpu else None),
           "cpu_overhead_ns": max(r["cpu_overhead"] for r in rs)}
    res.update(flight_cpu_figures(per_wake_us, wake_p99_us))
    return res


def flight_cpu_figures(per_wake_us: Optional[float], wake_p99_us: Optional[float]):
    """The combined figures of scenario 4 (defined in report.FLIGHT_CPU_NOTE): wake-ups per
    waiter-CPU-second, and p99 wake latency x waiter CPU per wake-up (µs², lower is better)."""
    if not per_wake_us:
        return {}
    return {"wakes_per_cpu_s": round(1e6 / per_wake_us),
            "p99_x_cpu_us2": None if wake_p99_us is None else round(wake_p99_us * per_wake_us, 1)}


def _get_first_p50(r: Dict[str, Any]) -> Optional[float]:
    return r.get("by_order", {}).get("1", {}).get("p50_us")


def scenario4(env: Env, systems, cfg, out) -> None:
    n, P = cfg["s4_keys"], cfg["s4_procs"]
    size = 4096
    ks = common.keys(n, seed=common.KEY_SEED + 4)
    pay = common.payload(size)
    load_ns = cfg["s4_load_us"] * 1000
    res: Dict[str, Any] = {"keys": n, "procs": P, "load_us": cfg["s4_load_us"], "slot_size": size,
                           "systems": {}}
    # ucmcache runs twice: as users call it, and as its Python floor of a wake-up (core_wait:
    # the same loop with the core's wait step called directly), stored apart from the systems
    runs = [(system, False) for system in systems]
    at = next((i for i, s in enumerate(systems) if s.name == "ucmcache"), None)
    if at is not None:
        runs.insert(at + 1, (systems[at], True))
    for system, core_wait in runs:
        def body(spec, cl):
            cl.close()
            rs = run_procs(system, spec, P, _flight_child,
                           dict(keys=ks, payload=pay, load_ns=load_ns, core_wait=core_wait),
                           timeout=120)
            lat = [x for r in rs for x in r["lat"]]
            st = common.stats_ns(lat)
            r4 = {"loader_runs": sum(r["runs"] for r in rs), "waits": sum(r["waits"] for r in rs),
                  "hits": sum(r["hits"] for r in rs),
                  "wake_p50_us": None if st["p50_ns"] is None else round(st["p50_ns"] / 1000, 1),
                  "wake_p99_us": None if st["p99_ns"] is None else round(st["p99_ns"] / 1000, 1),
                  "wake_mean_us": None if st["mean_ns"] is None else round(st["mean_ns"] / 1000, 1)}
            r4.update(_waiter_cpu(rs, r4["wake_p99_us"]))
            r4.update(common.wake_orders([k for r in rs for k in r["keys"]], lat))
            return r4
        into, name = ((res, "core_wait") if core_wait else (res["systems"], system.name))
        try:
            r = _with_store(system, dict(slot_size=size, slots_per_rank=n + 64, max_ranks=P,
                                         n_keys=2 * n), body)
            into[name] = r
            log(f"[4 flight] {name:<10} loader runs {r['loader_runs']} (want {n}), waits "
                f"{r['waits']}, wake p50 {r['wake_p50_us']} us p99 {r['wake_p99_us']} us, "
                f"first woken p50 {_get_first_p50(r)} us, "
                f"waiter CPU {r.get('waiter_cpu_us')} us per wake-up")
        except Exception as e:
            into[name] = {"error": f"{type(e).__name__}: {e}"}
            log(f"[4 flight] {name} ERROR {e}")
    out["s4_flight"] = res


def scenario5(env: Env, systems, cfg, out) -> None:
    res: Dict[str, Any] = {"procs": 2, "by_size": {}}
    for size in cfg["sizes"]:
        spr = cfg["s5_spr"][size]
        capacity = 2 * spr
        ws = 4 * capacity
        wkeys = common.keys(ws, seed=common.KEY_SEED + 5)
        pay = common.payload(size)
        seqs = _mix_seqs(wkeys, 2, cfg["s3_seq"], 0, 50)
        row: Dict[str, Any] = {}
        for system in systems:
            def body(spec, cl):
                cl.close()
                rs = run_procs(system, spec, 2, _mix_child,
                               dict(seqs=seqs, prefix=b"s5", payload=pay, duration=cfg["s5_time"]),
                               timeout=cfg["s5_time"] * 10 + 60)
                ops = sum(r["ops"] for r in rs)
                hits = sum(r["hits"] for r in rs)
                return {"ops_per_s": round(sum(r["ops"] * 1e9 / r["elapsed_ns"] for r in rs), 1),
                        "ops": ops, "hit_rate": round(hits / max(ops, 1), 4)}
            try:
                r = _with_store(system, dict(slot_size=size, slots_per_rank=spr, max_ranks=2,
                                             n_keys=ws, evict_bytes=capacity * size), body)
                row[system.name] = r
                log(f"[5 churn] {size:>5} B {system.name:<10} {r['ops_per_s']:>12,.0f} ops/s "
                    f"hit rate {r['hit_rate']:.3f}")
            except Exception as e:
                row[system.name] = {"error": f"{type(e).__name__}: {e}"}
                log(f"[5 churn] {size} {system.name} ERROR {e}")
        res["by_size"][str(size)] = {"slots_per_rank": spr, "capacity": capacity,
                                     "working_set": ws, "systems": row}
    out["s5_churn"] = res


def scenario6(env: Env, systems, cfg, out) -> None:
    """Tier 2: a local hit vs a hit served from Redis (another node loaded the key)
    vs a cold miss that runs the loader, per get_or_load, all in this run."""
    if env.redis is None:
        out["s6_tier2"] = {"skipped_why": env.redis_why or "no redis-server"}
        log(f"[6 tier2] skipped: {out['s6_tier2']['skipped_why']}")
        return
    from ucmcache import RedisTier, SlotCache

    n = cfg["s6_keys"]
    size = 4096
    pay = common.payload(size)
    ks = [b"t2" + k[2:] for k in common.keys(n)]
    ns = f"bench-{env.tag}-{env.next_id()}"
    uuids = [f"{env.tag}-t2-{env.next_id()}" for _ in range(3)]
    for u in uuids:
        env.track_segment(u)
    caches, tiers = [], []
    try:
        for u in uuids:
            t = RedisTier(unix_socket=env.redis.sock, namespace=ns, timeout=0.5)
            tiers.append(t)
            caches.append(SlotCache.create(u, slots_per_rank=n + 64, slot_size=size, max_ranks=1,
                                           tier2=t))
        node_a, node_b, node_c = caches
        loads = [0]

        def loader():
            loads[0] += 1
            return pay
        t0 = time.perf_counter_ns()
        for k in ks:                       # node A: cold misses, loader runs, written through
            node_a.get_or_load(k, loader)
        miss_ns = (time.perf_counter_ns() - t0) / n
        tiers[0].flush(30)
        loads_a = loads[0]
        t0 = time.perf_counter_ns()
        for k in ks:                       # node B: every key served from Redis
            node_b.get_or_load(k, loader)
        t2_ns = (time.perf_counter_ns() - t0) / n
        t0 = time.perf_counter_ns()
        for k in ks:                       # node B again: local hits
            node_b.get_or_load(k, loader)
        hit_ns = (time.perf_counter_ns() - t0) / n
        loads_b = loads[0] - loads_a
        t0 = time.perf_counter_ns()
        for k in ks:                       # the loader alone, for scale
            loader()
        loader_ns = (time.perf_counter_ns() - t0) / n
        sb = node_b.stats()
        res = {"keys": n, "slot_size": size, "local_hit_ns": round(hit_ns),
               "tier2_hit_ns": round(t2_ns), "miss_with_loader_ns": round(miss_ns),
               "loader_alone_ns": round(loader_ns),
               "node_a_loader_runs": loads_a, "node_b_loader_runs": loads_b,
               "node_b_t2_hits": sb["t2_hits"],
               "note": "get_or_load per key; the loader returns a ready 4 KiB payload, so the "
                       "miss row is the cache's own cost of a cold key (plus one Redis write-"
                       "through off the path and a lease round trip)"}
        out["s6_tier2"] = res
        log(f"[6 tier2] local hit {res['local_hit_ns']} ns, tier-2 hit {res['tier2_hit_ns']} ns, "
            f"cold miss {res['miss_with_loader_ns']} ns; node B loader runs "
            f"{res['node_b_loader_runs']}, t2 hits {res['node_b_t2_hits']}")
    finally:
        for c in caches:
            try:
                c.close()
            except Exception:
                pass
        for u in uuids:
            try:
                SlotCache.unlink(u)
            except Exception:
                pass
            env.untrack_segment(u)


COLD_SYSTEMS = ("ucmcache", "old", "lmdb")  # the systems with a get_or_load (or its equivalent)


def scenario9(env: Env, systems, cfg, out) -> None:
    """Cold get_or_load: one process, a cache of s9_capacity 4 KiB slots filled with resident
    keys, then get_or_load of a resident key each (hits, for scale), then of s9_keys keys never
    seen (each one evicts), the loader returning the 4 KiB value it already has (no allocation:
    the cache's own cost of a miss plus the copy in).  Each operation timed alone, less the
    timer's overhead."""
    cap, n = cfg["s9_capacity"], cfg["s9_keys"]
    size = 4096
    resident = common.keys(cap, seed=common.KEY_SEED + 9)
    hit_seq = [resident[i] for i in common.rng_indices(n, cap, 9)]
    cold = common.keys(n, seed=common.KEY_SEED + 90)
    value = common.payload(size)

    def loader():
        return value
    ovh = common.timer_overhead()
    res: Dict[str, Any] = {"capacity": cap, "keys": n, "slot_size": size,
                           "timer_overhead_ns": ovh, "systems": {}}
    for system in systems:
        if system.name not in COLD_SYSTEMS:
            continue

        def body(spec, cl):
            cl.populate(resident, value)
            t = [0] * n
            cl.get_or_load_timed(hit_seq, loader, t)
            hit = common.stats_ns(t, ovh)
            cl.get_or_load_timed(cold, loader, t)
            return {"cold": common.stats_ns(t, ovh), "hit": hit}
        try:
            r = _with_store(system, dict(slot_size=size, slots_per_rank=cap, max_ranks=1,
                                         n_keys=cap + n), body)
            res["systems"][system.name] = r
            log(f"[9 cold] {system.name:<10} cold get_or_load p50 {r['cold']['p50_ns']} ns p99 "
                f"{r['cold']['p99_ns']} ns; hit p50 {r['hit']['p50_ns']} ns")
        except Exception as e:
            res["systems"][system.name] = {"error": f"{type(e).__name__}: {e}"}
            log(f"[9 cold] {system.name} ERROR {e}")
    out["s9_cold"] = res


def layout_figures(cfg) -> Dict[str, Any]:
    from ucmcache.core.layout import Layout

    rows = {}
    configs = {
        "typical": (8, 16384, 4096),
        "scenario 2": (1, cfg["s2_keys"] + cfg["s2_keys"] // 4 + 64, 4096),
        "scenario 3": (2, cfg["s3_spr"][4096], 4096),
        "small": (8, 1024, 4096),
    }
    for label, (mr, spr, ss) in configs.items():
        name = f"{label}: {mr} rank{'s' if mr > 1 else ''} x {spr} slots x 4 KiB"
        L = Layout.compute(max_ranks=mr, slots_per_rank=spr, slot_size=ss)
        rows[name] = {"control_bytes": L.control_bytes, "data_bytes": L.data_bytes,
                      "pct": round(100.0 * L.control_bytes / L.data_bytes, 2),
                      "meta_bytes": L.n_slots * 64, "ring_bytes": L.max_ranks * L.ring_size,
                      "bucket_bytes": L.n_buckets * 4}
    return rows


# ====================================================================== main


def parse(argv):
    p = argparse.ArgumentParser(prog="ucmcache bench", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny sizes (harness check, not numbers)")
    p.add_argument("--out", default=os.path.join(BENCH_DIR, "results"),
                   help="directory for latest.json / latest.md / latest.png")
    p.add_argument("--systems", default=",".join(s.name for s in ALL_SYSTEMS),
                   help="comma list of systems (default: all)")
    p.add_argument("--scenarios", default=",".join(SCENARIOS), help="comma list of 1..9")
    p.add_argument("--no-floor", action="store_true", help="skip the C and Python floors")
    p.add_argument("--no-chart", action="store_true", help="skip the PNG chart")
    p.add_argument("--repeat", type=int, default=None,
                   help="passes of scenarios 1-6, 9 and the floors, each figure the median over "
                        "them, each ratio with its min-max (default 3; --quick: 1)")
    p.add_argument("--time-scale", type=float, default=1.0,
                   help="multiplies the measurement window of scenarios 3 and 5 (s3_time, "
                        "s5_time; default 1.0): longer windows average out other work on a "
                        "shared machine (bench.ab passes 4)")
    p.add_argument("--flight-procs", type=int, default=None,
                   help="scenario 4's processes (default 4: two per core here, so a woken "
                        "waiter often waits for a CPU; 2: one per core)")
    return p.parse_args(argv)


def config_for(quick: bool, time_scale: float, flight_procs: Optional[int] = None) -> Dict[str, Any]:
    """QUICK or FULL, with scenarios 3 and 5's measurement windows scaled and scenario 4's
    process count replaced when given (a copy: the tables stay as they are)."""
    cfg = dict(QUICK if quick else FULL)
    for k in ("s3_time", "s5_time"):
        cfg[k] = round(cfg[k] * time_scale, 6)
    if flight_procs is not None:
        cfg["s4_procs"] = flight_procs
    return cfg


def main(argv=None) -> int:
    args = parse(argv)
    repeat = args.repeat if args.repeat is not None else (1 if args.quick else 3)
    want = [s.strip() for s in args.systems.split(",") if s.strip()]
    scen = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    bad = _bad_args(args, repeat, want)
    if bad:
        print(bad, file=sys.stderr)
        return 2
    cfg = config_for(args.quick, args.time_scale, args.flight_procs)
    t_start = time.monotonic()
    started = time.strftime("%Y-%m-%d %H:%M:%S %z")
    tmpdir = tempfile.mkdtemp(prefix="ucmbench-")
    env = Env(tmpdir, args.quick)
    out: Dict[str, Any] = {}
    passes: List[Dict[str, Any]] = []
    try:
        env.start(want)
        systems, baselines = _systems_and_baselines(env, want)
        _log_baselines(args.quick, baselines)
        out["meta"] = _meta(args, argv, cfg, started, repeat)
        out["baselines"] = baselines
        out["layout"] = layout_figures(cfg)
        passes = _run_scenarios(env, systems, cfg, out, scen, repeat, args.no_floor)
    finally:
        env.cleanup()
    out["meta"]["load_after"] = common.loadavg()
    out["meta"]["wall_s"] = round(time.monotonic() - t_start, 1)
    report.finish(out, args.out, chart=not args.no_chart, passes=passes)
    return _summarize(out, args)


def _bad_args(args, repeat: int, want: List[str]) -> Optional[str]:
    """Why the command line cannot run (the first reason found), or None."""
    if repeat < 1:
        return "--repeat must be >= 1"
    if not args.time_scale > 0:  # also refuses nan
        return "--time-scale must be > 0"
    if args.flight_procs is not None and not 2 <= args.flight_procs <= 63:
        return "--flight-procs must be 2..63 (one owner and at least one waiter; floor.c: 63)"
    unknown = [w for w in want if w not in {s.name for s in ALL_SYSTEMS}]
    if unknown or "ucmcache" not in want:  # every ratio is against ucmcache: it must run
        return f"--systems must include ucmcache and name only {[s.name for s in ALL_SYSTEMS]}"
    return None


def _systems_and_baselines(env: Env, want: List[str]):
    """The wanted systems that can run here, and for every wanted one (and the C floor) whether
    it is available, with a note or why it was skipped: latest.json's "baselines"."""
    systems, baselines = [], {}
    for cls in ALL_SYSTEMS:
        if cls.name not in want:
            continue
        ok, why = cls.available(env)
        baselines[cls.name] = {"label": cls.label, "available": ok,
                               ("note" if ok else "skipped_why"): why}
        if ok:
            systems.append(cls(env))
    baselines["c_floor"] = {"label": "C-only floor (bench/floor.c)",
                            "available": env.floor_bin is not None,
                            ("note" if env.floor_bin else "skipped_why"): env.floor_why}
    return systems, baselines


def _log_baselines(quick: bool, baselines: Dict[str, Any]) -> None:
    """Say at the start which baselines run and why any is skipped (the smoke test reads it)."""
    log(f"ucmcache bench ({'quick' if quick else 'full'} run), {os.cpu_count()} cores, "
        f"load {common.loadavg()}")
    for name, b in baselines.items():
        state = "available" if b["available"] else f"SKIPPED: {b.get('skipped_why')}"
        extra = f" ({b['note']})" if b.get("note") else ""
        log(f"  {b['label']:<32} {state}{extra}")


def _meta(args, argv, cfg: Dict[str, Any], started: str, repeat: int) -> Dict[str, Any]:
    """latest.json's "meta": the exact command, the machine, and the config it ran with (the
    config's int-keyed dicts get str keys, as JSON would give them anyway)."""
    prog = "python -m bench.run" if _RUN_AS_MODULE else "python bench/run.py"
    args_txt = " ".join(argv if argv is not None else sys.argv[1:])
    cmd = prog + (" " + args_txt if args_txt else "")
    return {"command": cmd, "started": started, "quick": args.quick, "repeat": repeat,
            "time_scale": args.time_scale,
            "cores": os.cpu_count(), "load_before": common.loadavg(),
            "python": platform.python_version(), "platform": platform.platform(),
            "config": {k: (v if not isinstance(v, dict) else {str(a): b for a, b in v.items()})
                       for k, v in cfg.items()}}


def _run_scenarios(env: Env, systems, cfg, out: Dict[str, Any], scen: List[str], repeat: int,
                   no_floor: bool) -> List[Dict[str, Any]]:
    """Run the chosen scenarios: 7 and 8 once, into out; 1-6, 9 and the floors `repeat` times.
    Returns the passes' results (report.finish merges them)."""
    steps = {"1": scenario1, "2": scenario2, "3": scenario3, "4": scenario4, "5": scenario5,
             "6": scenario6, "9": scenario9}
    # Scenario 7 repeats inside itself (interleaved).  Scenarios 1-6, 9 (and the floors, whose
    # figures they are compared with) run `repeat` whole passes: every figure of theirs is
    # reported as the median over the passes, every ratio with its min-max.
    want_passes = [s for s in SCENARIOS if s in scen and s in steps]
    floors = not no_floor and any(s in scen for s in "12345")
    if "7" in scen:  # first: the reads want a quiet start
        reads.scenario7(env, systems, cfg, out, log)
    if "8" in scen:  # one process, deterministic hit counts: needs no passes
        arenas.scenario8(env, cfg, out, log)
    passes: List[Dict[str, Any]] = []
    if want_passes or floors:
        for p in range(repeat):
            if repeat > 1:
                log(f"--- pass {p + 1} of {repeat} (load {common.loadavg()})")
            pout: Dict[str, Any] = {}
            if floors:
                c_floor(env, cfg, pout)
                py_floor(env, cfg, pout)
            for s in want_passes:
                steps[s](env, systems, cfg, pout)
            passes.append(pout)
    return passes


def _summarize(out: Dict[str, Any], args) -> int:
    """Where the results went, the ratios and the targets; the exit status (1 when scenario 8
    found a wrong value or a broken invariant: not a figure, a bug)."""
    log(f"wrote {os.path.join(args.out, 'latest.json')}, latest.md"
        f"{'' if args.no_chart else ', latest.png'} in {out['meta']['wall_s']} s")
    log("")
    for line in report.ratio_lines(out):
        log(line)
    log("")
    for line in report.target_lines(out):
        log(line)
    if _get_error(out, "s8_arenas"):
        log(f"scenario 8 FAILED: {out['s8_arenas']['error']}")
        return 1
    return 0


def _get_error(out: Dict[str, Any], section: str) -> Optional[str]:
    sec = out.get(section)
    return sec.get("error") if isinstance(sec, dict) else None


if __name__ == "__main__":
    sys.exit(main())
