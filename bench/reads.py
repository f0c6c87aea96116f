"""Scenario 7: what a user does with a hit, measured: reading the bytes.

Every row runs in this one process, interleaved: a repetition is several rounds, and each round
runs every row for a short slice (about cfg["s7_slice"] seconds), in a fresh random order each
round, so a change in the machine's load lands on every row alike.  A row's figure for a
repetition is its time over all its slices / its ops; the ratios are computed per repetition
(py-lmdb's time / ucmcache's time, etc.) and reported as median [min-max] over the repetitions.

Rows, per value size (4 KiB and 64 KiB), over cfg["s7_keys"] resident keys, random order:
  per key   ucmcache `with c.get(k) as h: h.data[0]`; py-lmdb `with env.begin(buffers=True) as t:
            t.get(k)[0]`; the old design's Python wrapper the same as ucmcache; the pin alone
            (`with c.get(k): pass`, pin-only, ucmcache and the old design); ucmcache
            `c.get_or_load(k, loader)` on a hit (bytes) vs py-lmdb `with env.begin() as t:
            t.get(k)` (bytes); Python floors made of no-op cffi calls (below)
  per batch of 64 distinct keys
            ucmcache `with c.get_many(b) as hb:` + `hb.data(i)[0]` for every i vs py-lmdb one
            read txn (buffers=True), `t.get(k)[0]` for each key; ucmcache `hb.gather(out)` (inside
            get_many) and `c.read_many(b, out)` into out = a (64, value) uint8 array vs py-lmdb one
            txn with its 64 buffers copied into the same array (row memoryviews: the fastest
            copy found; `out[i] = np.frombuffer(...)` is shown too) vs the memcpy floor, numpy
            copying the same 64 slots' bytes (np.take over the segment's data region with the
            batch's slot indices: the same source addresses, not one hot block).
Floors (cffi no-op functions with the signatures of ucmcache's calls, bench/cbuild.py):
  read      an empty context manager + 2 no-op calls (pin, release): what any `with get(k)`
            made of a Python object and cffi calls costs, before a byte is read; `+ view[0]`
            adds a slice of the segment's read-only memoryview and [0] (the read itself)
  get_or_load  a function call + 2 no-op calls + bytes of the slot's payload (the copy a
            bytes-returning API makes)
  get_many  b"".join of the ids + a no-op batch call, an empty context manager whose exit
            makes the no-op release call, + 64 slices of the read-only view and [0]
"""
from __future__ import annotations

import asyncio
import time
from typing import Any, Callable, Dict, List

import numpy as np

from . import common

# (ratio name, numerator row, denominator row, what it compares)
RATIOS = [
    ("read_vs_lmdb", "read.lmdb", "read.ucm", "per-key read vs py-lmdb"),
    ("read_vs_old", "read.old", "read.ucm", "per-key read vs the old design"),
    ("pin_vs_old", "pin.old", "pin.ucm", "pin only vs the old design"),
    ("pin_vs_lmdb", "read.lmdb", "pin.ucm", "pin only vs py-lmdb's read"),
    ("gol_vs_lmdb", "gol.lmdb", "gol.ucm", "get_or_load hit vs py-lmdb bytes"),
    ("agol_over_gol", "agol.ucm", "gol.ucm", "await aget_or_load hit / get_or_load hit"),
    ("gmdata_vs_lmdb", "gmdata.lmdb", "gmdata.ucm", "get_many(64) + data(i)[0] vs py-lmdb"),
    ("gather_vs_lmdb", "copy.lmdb", "gather.ucm", "gather(64) vs py-lmdb copy"),
    ("read_many_vs_lmdb", "copy.lmdb", "read_many.ucm", "read_many(64) vs py-lmdb copy"),
    ("gather_over_floor", "gather.ucm", "copy.floor", "gather / memcpy floor"),
    ("read_many_over_floor", "read_many.ucm", "copy.floor", "read_many / memcpy floor"),
    ("lmdb_over_floor", "copy.lmdb", "copy.floor", "py-lmdb copy / memcpy floor"),
    ("gather_vs_lmdb@al", "copy.lmdb@al", "gather.ucm@al", "gather vs py-lmdb, out page-aligned"),
    ("read_many_vs_lmdb@al", "copy.lmdb@al", "read_many.ucm@al",
     "read_many vs py-lmdb, out page-aligned"),
    ("gather_over_floor@al", "gather.ucm@al", "copy.floor@al", "gather / memcpy floor, page-aligned"),
    ("read_many_over_floor@al", "read_many.ucm@al", "copy.floor@al",
     "read_many / memcpy floor, page-aligned"),
    ("gather_over_cfloor", "gather.ucm", "copy.cfloor", "gather / C memcpy floor"),
    ("read_many_over_cfloor", "read_many.ucm", "copy.cfloor", "read_many / C memcpy floor"),
    ("npfloor_over_cfloor", "copy.floor", "copy.cfloor", "numpy floor / C memcpy floor"),
    ("floor_unaligned_over_aligned", "copy.floor", "copy.floor@al",
     "numpy floor: out as numpy allocates it / page-aligned"),
    ("cfloor_unaligned_over_aligned", "copy.cfloor", "copy.cfloor@al",
     "C memcpy floor: out as numpy allocates it / page-aligned"),
    ("floor_share_read", "read.floor", "read.ucm", "Python floor / ucmcache read"),
    ("floor_vs_lmdb_read", "read.lmdb", "read.floor", "py-lmdb read / Python floor"),
    ("floorview_vs_lmdb_read", "read.lmdb", "read.floor_view", "py-lmdb read / floor + view[0]"),
]

LABELS = {
    "read.ucm": "ucmcache `with c.get(k) as h: h.data[0]`",
    "read.lmdb": "py-lmdb `with env.begin(buffers=True) as t: t.get(k)[0]`",
    "read.old": "old design `with c.get(k) as h: h.data[0]`",
    "read.floor": "Python floor: empty context manager + 2 no-op cffi calls",
    "read.floor_view": "Python floor + `view[o:o+n][0]`",
    "pin.ucm": "ucmcache `with c.get(k): pass` (pin only, nothing read)",
    "pin.old": "old design `with c.get(k): pass` (pin only, nothing read)",
    "gol.ucm": "ucmcache `c.get_or_load(k, loader)`, hit (bytes)",
    "agol.ucm": "ucmcache `await c.aget_or_load(k, loader)` in a running loop, hit (bytes)",
    "gol.lmdb": "py-lmdb `with env.begin() as t: t.get(k)` (bytes)",
    "gol.floor": "Python floor: call + 2 no-op cffi calls + payload to bytes",
    "gmdata.ucm": "ucmcache `with c.get_many(b) as hb:` + `hb.data(i)[0]` x64",
    "gmdata.lmdb": "py-lmdb one txn (buffers), `t.get(k)[0]` x64",
    "gmdata.floor": "Python floor: join + 2 no-op batch calls + context manager + 64 x `view[..][0]`",
    "gather.ucm": "ucmcache `with c.get_many(b) as hb: hb.gather(out)`",
    "read_many.ucm": "ucmcache `c.read_many(b, out)`",
    "copy.lmdb": "py-lmdb one txn (buffers), 64 gets copied into out's rows (`row[:] = buf`)",
    "copy.lmdb_np": "py-lmdb the same, `out[i] = np.frombuffer(buf, np.uint8)`",
    "copy.floor": "memcpy floor: `np.take(data_region, slots, axis=0, out=out, mode='clip')`",
    "copy.cfloor": "C memcpy floor: one cffi call, 64 `memcpy` of the same slots",
    "gather.ucm@al": "ucmcache `gather`, out page-aligned",
    "read_many.ucm@al": "ucmcache `read_many`, out page-aligned",
    "copy.lmdb@al": "py-lmdb copy (`row[:] = buf`), out page-aligned",
    "copy.floor@al": "memcpy floor, out page-aligned",
    "copy.cfloor@al": "C memcpy floor, out page-aligned",
}


class _EmptyCM:
    """The Python floor's context manager: enter returns itself, exit makes one no-op C call."""

    __slots__ = ("r",)
    release = None  # set to the no-op release (a cffi function) before use
    null = None

    def __init__(self, r):
        self.r = r

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        _EmptyCM.release(_EmptyCM.null, 0)


class _BatchCM:
    __slots__ = ("r", "f", "s", "n")
    null = None

    def __init__(self, r, f, s, n):
        self.r, self.f, self.s, self.n = r, f, s, n

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.f(_BatchCM.null, self.s, self.n)


def _stats(v: List[float]) -> Dict[str, Any]:
    a = np.asarray(v, dtype=np.float64)
    return {"median": round(float(np.median(a)), 3), "min": round(float(a.min()), 3),
            "max": round(float(a.max()), 3), "values": [round(float(x), 3) for x in a]}


# ====================================================================== the rows
#
# A row is (kind, function(lo, m) -> ns for m ops starting at position lo of the pools).  Every
# timed loop is written out (no per-op indirection), bound methods looked up once before the
# clock starts, as a user who cares would write it, for every system alike.


class _Pools:
    """What the rows walk: the key sequence and the batches, from position lo, wrapping, so
    every round can start at a fresh random place without running off the end."""

    def __init__(self, seq_pool: List[bytes], reqs: List[List[bytes]]):
        self.seq_pool, self.reqs = seq_pool, reqs
        self.NK, self.NR = len(seq_pool), len(reqs)

    def keys_at(self, lo, m):
        lo %= self.NK
        s = self.seq_pool[lo:lo + m]
        if len(s) < m:
            s = s + self.seq_pool[:m - len(s)]
        return s

    def reqs_at(self, lo, m):
        return [self.reqs[(lo + j) % self.NR] for j in range(m)]

    def idx_at(self, lo, m):
        return [(lo + j) % self.NR for j in range(m)]


def _rows(size: int, c, lm_env, old, mod, seq_pool: List[bytes], off_of: Dict[bytes, int],
          reqs: List[List[bytes]], req_slots: List[np.ndarray], req_offs: List[List[int]],
          out: np.ndarray, out_al: np.ndarray) -> Dict[str, Any]:
    """row id -> (kind, timed function), for every row the installed systems can run.  The
    insertion order is kept as it always was: _check walks the rows in it and records them so."""
    P = _Pools(seq_pool, reqs)
    R: Dict[str, Any] = {}
    R.update(_ucm_key_rows(c, P))
    if lm_env is not None:
        R.update(_lmdb_key_rows(lm_env, P))
    if old is not None:
        R.update(_read_and_pin_rows(old, P, "old"))  # written exactly as ucmcache's rows
    ro = c._ro  # the segment's read-only view (what ucmcache's read views are slices of)
    if mod is not None:
        R.update(_floor_rows(mod, size, ro, off_of, req_offs, P))
    R["gmdata.ucm"] = ("batch", _gmdata_ucm(c, P))
    region = _data_region(c, size)
    keep: list = []  # cffi views of the segment and the arrays, alive as long as the rows
    for dst, tag in ((out, ""), (out_al, "@al")):
        R.update(_copy_rows(size, c, lm_env, mod, ro, region, req_slots, req_offs, P, dst, tag,
                            keep))
    if lm_env is not None:
        R.update(_lmdb_batch_rows(lm_env, P, out))
    return R


def _read_and_pin_rows(cache, P: _Pools, tag: str) -> Dict[str, Any]:
    """Per key, through any object with ucmcache's `get` (ucmcache, the old design's wrapper):
    read one byte, and the pin only; one loop for both, so the two systems run the same code."""
    pc = time.perf_counter_ns

    def read(lo, m):
        seq = P.keys_at(lo, m)
        get = cache.get
        t0 = pc()
        for k in seq:
            with get(k) as h:
                h.data[0]
        return pc() - t0

    def pin(lo, m):
        seq = P.keys_at(lo, m)
        get = cache.get
        t0 = pc()
        for k in seq:
            with get(k):
                pass
        return pc() - t0
    return {f"read.{tag}": ("key", read), f"pin.{tag}": ("key", pin)}


def _ucm_key_rows(c, P: _Pools) -> Dict[str, Any]:
    """ucmcache per key: read one byte, pin only, get_or_load and await aget_or_load hits."""
    pc = time.perf_counter_ns

    def gol_ucm(lo, m):
        seq = P.keys_at(lo, m)
        gol = c.get_or_load

        def loader():
            raise AssertionError("get_or_load ran its loader on a resident key")
        t0 = pc()
        for k in seq:
            gol(k, loader)
        return pc() - t0

    loop = asyncio.new_event_loop()  # one loop for every repetition (closed by the GC)

    def agol_ucm(lo, m):
        seq = P.keys_at(lo, m)
        agol = c.aget_or_load

        def loader():
            raise AssertionError("aget_or_load ran its loader on a resident key")

        async def run():
            t0 = pc()
            for k in seq:
                await agol(k, loader)
            return pc() - t0
        return loop.run_until_complete(run())

    return {**_read_and_pin_rows(c, P, "ucm"), "gol.ucm": ("key", gol_ucm),
            "agol.ucm": ("key", agol_ucm)}


def _lmdb_key_rows(lm_env, P: _Pools) -> Dict[str, Any]:
    """py-lmdb per key: one byte through a buffers txn, and the value as bytes."""
    pc = time.perf_counter_ns

    def read_lmdb(lo, m):
        seq = P.keys_at(lo, m)
        begin = lm_env.begin
        t0 = pc()
        for k in seq:
            with begin(buffers=True) as t:
                t.get(k)[0]
        return pc() - t0

    def gol_lmdb(lo, m):
        seq = P.keys_at(lo, m)
        begin = lm_env.begin
        t0 = pc()
        for k in seq:
            with begin() as t:
                t.get(k)
        return pc() - t0
    return {"read.lmdb": ("key", read_lmdb), "gol.lmdb": ("key", gol_lmdb)}


def _floor_rows(mod, size: int, ro, off_of: Dict[bytes, int], req_offs: List[List[int]],
                P: _Pools) -> Dict[str, Any]:
    """The Python floors: ucmcache's steps made of no-op cffi calls, reading the same source
    addresses as ucmcache does (what any Python API of this shape costs)."""
    pc = time.perf_counter_ns
    ffi, lib = mod.ffi, mod.lib
    NULL = ffi.NULL
    _EmptyCM.release, _EmptyCM.null, _BatchCM.null = lib.bench_noop_release, NULL, NULL
    noop_lookup, noop_release = lib.bench_noop_lookup, lib.bench_noop_release
    many, rel_many = lib.bench_noop_many, lib.bench_noop_release_many
    n = size
    B = len(P.reqs[0])
    CM = _EmptyCM

    def read_floor(lo, m):
        seq = P.keys_at(lo, m)
        t0 = pc()
        for k in seq:
            with CM(noop_lookup(NULL, k, 0, 64, 1)):
                pass
        return pc() - t0

    def read_floor_view(lo, m):
        pairs = [(k, off_of[k]) for k in P.keys_at(lo, m)]
        t0 = pc()
        for k, o in pairs:
            with CM(noop_lookup(NULL, k, 0, 64, 1)):
                ro[o:o + n][0]
        return pc() - t0

    def floor_gol(k, o):
        noop_lookup(NULL, k, 0, 64, 2)
        noop_release(NULL, 0)
        return ro[o:o + n].tobytes()

    def gol_floor(lo, m):
        pairs = [(k, off_of[k]) for k in P.keys_at(lo, m)]
        f = floor_gol
        t0 = pc()
        for k, o in pairs:
            f(k, o)
        return pc() - t0

    offs = ffi.from_buffer("uint64_t[]", np.zeros(B, dtype=np.uint64))
    outb = ffi.from_buffer("uint8_t[]", np.zeros(B, dtype=np.uint8))
    slots_c = ffi.from_buffer("uint32_t[]", np.zeros(B, dtype=np.uint32))

    def gmdata_floor(lo, m):
        idx = P.idx_at(lo, m)
        rq = [(P.reqs[i], req_offs[i]) for i in idx]
        BCM = _BatchCM
        t0 = pc()
        for r, os_ in rq:
            with BCM(many(NULL, b"".join(r), offs, B, outb), rel_many, slots_c, B):
                for o in os_:
                    ro[o:o + n][0]
        return pc() - t0
    return {"read.floor": ("key", read_floor), "read.floor_view": ("key", read_floor_view),
            "gol.floor": ("key", gol_floor), "gmdata.floor": ("batch", gmdata_floor)}


def _gmdata_ucm(c, P: _Pools):
    """ucmcache per batch: get_many, then every value's first byte."""
    pc = time.perf_counter_ns
    RB = range(len(P.reqs[0]))

    def gmdata_ucm(lo, m):
        rq = P.reqs_at(lo, m)
        gm = c.get_many
        t0 = pc()
        for r in rq:
            with gm(r) as hb:
                data = hb.data
                for i in RB:
                    data(i)[0]
        return pc() - t0
    return gmdata_ucm


def _data_region(c, size: int) -> np.ndarray:
    """The segment's data region as a (slots, stride) uint8 array: the memcpy floor's source."""
    L = c.layout
    region = np.frombuffer(c._ro, dtype=np.uint8, count=L.n_slots * L.slot_stride,
                           offset=L.data_off).reshape(L.n_slots, L.slot_stride)
    if L.slot_stride != size:  # np.take would first copy a non-contiguous source
        raise RuntimeError(f"slot stride {L.slot_stride} != value size {size}: the memcpy floor "
                           "assumes whole-slot rows")
    return region


def _copy_rows(size: int, c, lm_env, mod, ro, region: np.ndarray, req_slots: List[np.ndarray],
               req_offs: List[List[int]], P: _Pools, dst: np.ndarray, tag: str,
               keep: list) -> Dict[str, Any]:
    """The copying rows into dst (out as numpy allocates it, or page-aligned: tag '@al')."""
    pc = time.perf_counter_ns

    def gather_ucm(lo, m):
        rq = P.reqs_at(lo, m)
        gm = c.get_many
        t0 = pc()
        for r in rq:
            with gm(r) as hb:
                hb.gather(dst)
        return pc() - t0

    def read_many_ucm(lo, m):
        rq = P.reqs_at(lo, m)
        rm = c.read_many
        t0 = pc()
        for r in rq:
            rm(r, dst)
        return pc() - t0

    def copy_floor(lo, m):
        sl = [req_slots[i] for i in P.idx_at(lo, m)]
        take = np.take
        t0 = pc()
        for s in sl:
            take(region, s, axis=0, out=dst, mode="clip")  # "raise" would buffer out
        return pc() - t0
    R = {"gather.ucm" + tag: ("batch", gather_ucm),
         "read_many.ucm" + tag: ("batch", read_many_ucm),
         "copy.floor" + tag: ("batch", copy_floor)}
    if mod is not None:
        R["copy.cfloor" + tag] = ("batch", _copy_cfloor(mod, size, ro, req_offs, P, dst, keep))
    if lm_env is not None:
        R["copy.lmdb" + tag] = ("batch", _copy_lmdb(lm_env, P, dst))
    return R


def _copy_cfloor(mod, size: int, ro, req_offs: List[List[int]], P: _Pools, dst: np.ndarray,
                 keep: list):
    """The C memcpy floor: one cffi call making the batch's 64 memcpy of the same slots."""
    pc = time.perf_counter_ns
    B = len(P.reqs[0])
    ffi_, copy = mod.ffi, mod.lib.bench_copy_rows
    base = ffi_.from_buffer("char[]", ro)
    dst_p = ffi_.from_buffer("char[]", dst, require_writable=True)
    offs_p = [ffi_.from_buffer("uint64_t[]", np.asarray(o, dtype=np.uint64))
              for o in req_offs]
    keep.append((base, dst_p, offs_p))

    def copy_cfloor(lo, m):
        op = [offs_p[i] for i in P.idx_at(lo, m)]
        t0 = pc()
        for o in op:
            copy(base, o, B, dst_p, size)
        return pc() - t0
    return copy_cfloor


def _copy_lmdb(lm_env, P: _Pools, dst: np.ndarray):
    """py-lmdb's copy into dst: one txn, 64 buffers copied into dst's rows."""
    pc = time.perf_counter_ns
    B = len(P.reqs[0])
    dst_rows = [memoryview(dst[i]) for i in range(B)]  # made once, like dst itself

    def copy_lmdb(lo, m):
        rq = P.reqs_at(lo, m)
        begin = lm_env.begin
        rows = dst_rows
        t0 = pc()
        for r in rq:
            with begin(buffers=True) as t:
                get = t.get
                for row, k in zip(rows, r):
                    row[:] = get(k)
        return pc() - t0
    return copy_lmdb


def _lmdb_batch_rows(lm_env, P: _Pools, out: np.ndarray) -> Dict[str, Any]:
    """py-lmdb per batch: every value's first byte, and the copy written the numpy way."""
    pc = time.perf_counter_ns

    def gmdata_lmdb(lo, m):
        rq = P.reqs_at(lo, m)
        begin = lm_env.begin
        t0 = pc()
        for r in rq:
            with begin(buffers=True) as t:
                get = t.get
                for k in r:
                    get(k)[0]
        return pc() - t0

    def copy_lmdb_np(lo, m):
        rq = P.reqs_at(lo, m)
        begin = lm_env.begin
        fb, u8 = np.frombuffer, np.uint8
        t0 = pc()
        for r in rq:
            with begin(buffers=True) as t:
                get = t.get
                for i, k in enumerate(r):
                    out[i] = fb(get(k), u8)
        return pc() - t0
    return {"gmdata.lmdb": ("batch", gmdata_lmdb), "copy.lmdb_np": ("batch", copy_lmdb_np)}


# ====================================================================== checks


def _check(c, reqs, out, out_al, pay, rows) -> Dict[str, Any]:
    """Every copying row fills its array with the payload; every lookup finds its key."""
    want = np.frombuffer(pay, dtype=np.uint8)
    res: Dict[str, Any] = {}
    r = reqs[0]

    def filled(rid):
        dst = out_al if rid.endswith("@al") else out
        dst[:] = 0
        rows[rid][1](0, 1)
        return bool((dst == want).all())
    with c.get_many(r) as hb:
        lens = hb.gather(out)
        res["gather_lengths_ok"] = bool((lens == len(pay)).all())
    lens = c.read_many(r, out)
    res["read_many_lengths_ok"] = bool((lens == len(pay)).all())
    for rid in rows:
        if rid.startswith(("gather.", "read_many.", "copy.")):
            res[rid + " fills out"] = filled(rid)
    with c.get(r[0]) as h:
        res["read_ok"] = bytes(h.data) == pay
    res["get_or_load_ok"] = c.get_or_load(r[0], lambda: b"") == pay
    return res


# ====================================================================== the scenario


def scenario7(env, systems, cfg, out, log: Callable[[str], None]) -> None:
    by_name = {s.name: s for s in systems}
    ucm_sys = by_name["ucmcache"]
    lm_sys = by_name.get("lmdb")
    old_sys = by_name.get("old")
    n = cfg["s7_keys"]
    B = cfg["s7_batch"]
    reps, rounds, slice_s = cfg["s7_reps"], cfg["s7_rounds"], cfg["s7_slice"]
    res: Dict[str, Any] = {
        "batch": B, "reps": reps, "rounds": rounds, "slice_s": slice_s,
        "load_before": common.loadavg(), "by_size": {},
        "skipped": {"py-lmdb": None if lm_sys else "py-lmdb not selected or not installed",
                    "old": None if old_sys else "the old design not selected or not built",
                    "floor": None if env.old_mod is not None else env.old_why},
    }
    for size in cfg["sizes"]:
        nk = cfg["s7_keys_by_size"].get(size, n)
        t_size = time.monotonic()
        try:
            res["by_size"][str(size)] = _one_size(env, ucm_sys, lm_sys, old_sys, size, nk, B,
                                                  reps, rounds, slice_s, cfg, log)
        except Exception as e:
            import traceback

            res["by_size"][str(size)] = {"error": f"{type(e).__name__}: {e}",
                                         "trace": traceback.format_exc()[-2000:]}
            log(f"[7 reads] {size} ERROR {type(e).__name__}: {e}")
        log(f"[7 reads] {size} B done in {time.monotonic() - t_size:.1f} s")
    res["load_after"] = common.loadavg()
    out["s7_reads"] = res


def _one_size(env, ucm_sys, lm_sys, old_sys, size, nk, B, reps, rounds, slice_s, cfg, log):
    ks = common.keys(nk, seed=common.KEY_SEED + 7)
    pay = common.payload(size, tag=7)
    rng = np.random.default_rng(70 + size)
    seq_pool = [ks[i] for i in rng.integers(0, nk, size=cfg["s7_pool"]).tolist()]
    reqs = [[ks[j] for j in rng.choice(nk, size=B, replace=False).tolist()]
            for _ in range(cfg["s7_distinct_batches"])]
    made = []  # (system, spec, client), destroyed in reverse order
    rows: Dict[str, Any] = {}
    outarr, out_al = _out_arrays(B, size)
    try:
        c, lm_env, old = _populate(ucm_sys, lm_sys, old_sys, size, nk, ks, pay, made)
        off_of, req_slots, req_offs = _slot_addresses(c, ks, reqs)
        rows = _rows(size, c, lm_env, old, env.old_mod, seq_pool, off_of, reqs, req_slots,
                     req_offs, outarr, out_al)
        checks = _check(c, reqs, outarr, out_al, pay, rows)
        if not all(checks.values()):
            raise RuntimeError(f"a read row does not return the payload: {checks}")
        ids = [r for r in LABELS if r in rows]
        counts = _calibrate(rows, ids, cfg, slice_s)
        ns, ops, loads = _interleave(rows, ids, counts, reps, rounds, size)
        result_rows = _row_stats(rows, ids, ns, ops, counts, reps, rounds, B)
        ratios = _ratio_stats(ns, ops, reps)
        fl = result_rows["copy.floor"]["median"]
        blk = {"keys": nk, "value_bytes": size, "batch_bytes": B * size, "checks": checks,
               "out_page_offset": int(outarr.ctypes.data % 4096),
               "rows": result_rows, "ratios": ratios, "load_1min_per_rep": loads,
               "memcpy_floor_gb_s": round(B * size / fl, 2) if fl else None,
               "loop_overhead_ns": round(common.loop_overhead(seq_pool[:20000]), 1)}
        _log_size(size, B, ids, result_rows, ratios, blk, log)
        return blk
    finally:
        rows = {}
        outarr = out_al = None
        import gc

        gc.collect()  # the rows' closures hold views of the segment
        for system, spec, cl in reversed(made):
            try:
                cl.close()
            finally:
                system.destroy(spec)


def _out_arrays(B: int, size: int):
    """(out, out_al): out as a user makes it (numpy's allocation: on Linux a
    large array starts 16 bytes into a page, so its rows sit 16 bytes past the segment's
    page-aligned slots), and a page-aligned one: memcpy speed on some CPUs depends on that
    offset (the "@al" rows)."""
    outarr = np.zeros((B, size), dtype=np.uint8)
    raw = np.zeros(B * size + 4096, dtype=np.uint8)
    a0 = (-raw.ctypes.data) % 4096
    out_al = raw[a0:a0 + B * size].reshape(B, size)
    return outarr, out_al


def _populate(ucm_sys, lm_sys, old_sys, size, nk, ks, pay, made):
    """Every selected system filled with the same keys and payload: (ucmcache's cache, py-lmdb's
    env or None, the old design's cache or None).  Each is appended to made as soon as it
    exists, so the caller destroys it even if a later one fails."""
    spec, ucl = ucm_sys.create(slot_size=size, slots_per_rank=nk + 64, max_ranks=1, n_keys=nk)
    made.append((ucm_sys, spec, ucl))
    ucl.populate(ks, pay)
    lm_env = old = None
    if lm_sys is not None:
        spec, lcl = lm_sys.create(slot_size=size, n_keys=nk)
        made.append((lm_sys, spec, lcl))
        lcl.populate(ks, pay)
        lm_env = lcl.env
    if old_sys is not None:
        spec, ocl = old_sys.create(slot_size=size, slots_per_rank=nk + 64, max_ranks=1)
        made.append((old_sys, spec, ocl))
        ocl.populate(ks, pay)
        old = ocl.c
    return ucl.c, lm_env, old


def _slot_addresses(c, ks, reqs):
    """Where each key and each batch's keys live in the segment, so the floors read the same
    source addresses as ucmcache: (key -> byte offset, per batch its slots, per batch its
    byte offsets)."""
    L = c.layout
    off_of: Dict[bytes, int] = {}
    for k in ks:
        with c.get(k) as h:
            off_of[k] = L.data_off + h.slot * L.slot_stride
    req_slots, req_offs = [], []
    for r in reqs:
        with c.get_many(r) as hb:
            s = hb.slots.astype(np.intp)
        req_slots.append(s)
        req_offs.append((s * L.slot_stride + L.data_off).tolist())
    return off_of, req_slots, req_offs


def _calibrate(rows, ids, cfg, slice_s) -> Dict[str, int]:
    """Ops per slice for each row, so each slice lasts about slice_s (within the config's
    bounds): a short probe after a warm-up."""
    counts: Dict[str, int] = {}
    for rid in ids:
        kind, fn = rows[rid]
        probe = 300 if kind == "key" else 6
        fn(0, probe)  # warm-up
        per_op = fn(probe, probe) / probe
        lo, hi = (cfg["s7_min_keys"], cfg["s7_max_keys"]) if kind == "key" else \
            (cfg["s7_min_batches"], cfg["s7_max_batches"])
        counts[rid] = int(max(lo, min(hi, slice_s * 1e9 / max(per_op, 1.0))))
    return counts


def _interleave(rows, ids, counts, reps, rounds, size):
    """The measurement: reps x rounds, every row one slice per round.  Returns per row the ns
    and ops summed per repetition, and the 1-minute load after each repetition."""
    ns = {rid: [0] * reps for rid in ids}
    ops = {rid: [0] * reps for rid in ids}
    prng = np.random.default_rng(700 + size)
    loads = []
    for rep in range(reps):
        for rnd in range(rounds):
            # a fresh random order every round: no row always follows the same one (a
            # 4 MiB copy before a per-key row would always leave it cold caches)
            order = [ids[i] for i in prng.permutation(len(ids))]
            start = int(prng.integers(0, 1 << 30))  # this round's keys / batches
            for rid in order:
                kind, fn = rows[rid]
                m = counts[rid]
                ns[rid][rep] += fn(start, m)
                ops[rid][rep] += m
        loads.append(common.loadavg()[:1])
    return ns, ops, loads


def _row_stats(rows, ids, ns, ops, counts, reps, rounds, B) -> Dict[str, Any]:
    """Each row's time per op (per key or per batch), median [min-max] over the repetitions."""
    result_rows: Dict[str, Any] = {}
    for rid in ids:
        kind = rows[rid][0]
        per = [ns[rid][r] / ops[rid][r] for r in range(reps)]
        st = _stats(per)
        st.update(kind=kind, label=LABELS[rid], ops_per_slice=counts[rid],
                  slices=reps * rounds)
        if kind == "batch":
            st["per_key_median"] = round(st["median"] / B, 1)
        result_rows[rid] = st
    return result_rows


def _ratio_stats(ns, ops, reps) -> Dict[str, Any]:
    """The RATIOS whose two rows both ran, computed within each repetition (so a change of the
    machine's load cancels out) and reported as median [min-max]."""
    ratios: Dict[str, Any] = {}
    for name, num, den, what in RATIOS:
        if num in ns and den in ns:
            v = [(ns[num][r] / ops[num][r]) / (ns[den][r] / ops[den][r]) for r in range(reps)]
            st = _stats(v)
            st.update(num=num, den=den, what=what)
            ratios[name] = st
    return ratios


def _log_size(size, B, ids, result_rows, ratios, blk, log) -> None:
    """One value size's figures, as the run goes."""
    mb = B * size / 2**20
    for rid in ids:
        r = result_rows[rid]
        log(f"[7 reads] {size:>5} B {rid:<16} {r['median']:>10.0f} ns/{r['kind']} "
            f"[{r['min']:.0f}-{r['max']:.0f}]")
    for name, r in ratios.items():
        log(f"[7 reads] {size:>5} B {name:<22} {r['median']:.2f}x [{r['min']:.2f}-{r['max']:.2f}]")
    log(f"[7 reads] {size:>5} B memcpy floor {blk['memcpy_floor_gb_s']} GB/s "
        f"({mb:.2f} MiB per batch)")
