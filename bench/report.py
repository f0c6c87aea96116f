"""Turns one run's measurements into ratios, targets, latest.json, latest.md and latest.png."""
from __future__ import annotations

import json
import os
import statistics
from typing import Any, Dict, List, Optional, Tuple

ORDER = ["ucmcache", "old", "lmdb", "redis", "manager", "diskcache"]
LABELS = {"ucmcache": "ucmcache", "old": "old design (Python API)", "lmdb": "py-lmdb",
          "redis": "Redis (unix socket)", "manager": "Manager dict", "diskcache": "diskcache",
          "c_floor_new": "C floor: ucmcache steps (futex wait)",
          "c_floor_old": "C floor: old design (polls: yield, then 50 µs sleeps)",
          "c_floor_new_resident": "C floor: ucmcache steps (futex wait), processes as large as "
                                  "Python's",
          "core_wait": "Python floor: ucmcache, the core's wait step called directly (cffi)"}
WRAPPER = "ucmcache bench"


def _get(d: Any, *path, default=None):
    for p in path:
        if not isinstance(d, dict) or p not in d:
            return default
        d = d[p]
    return d


def _ratio(num: Optional[float], den: Optional[float]) -> Optional[float]:
    if num is None or den is None or den <= 0:
        return None
    return round(num / den, 2)


def fmt_x(r: Optional[float]) -> str:
    return "—" if r is None else (f"{r:.2f}x" if r < 10 else f"{r:.0f}x" if r >= 100 else f"{r:.1f}x")


def _num(r: float) -> str:
    return f"{r:.2f}" if r < 10 else f"{r:.0f}" if r >= 100 else f"{r:.1f}"


def fmt_range(rng) -> str:
    """' [min-max]' of a ratio over the passes (empty when there is one pass)."""
    if not rng or rng[0] is None or rng[1] is None:
        return ""
    return f" [{_num(rng[0])}-{_num(rng[1])}]"


def fmt_xr(out: Dict[str, Any], *path) -> str:
    """A ratio of out["ratios"] (the median over the passes) with its [min-max]."""
    med = _get(out.get("ratios", {}), *path)
    if med is None:
        return "—"
    return fmt_x(med) + fmt_range(_get(out.get("ratio_ranges") or {}, *path))


def fmt_ns(v: Optional[float]) -> str:
    if v is None:
        return "—"
    if v >= 1e6:
        return f"{v / 1e6:.2f} ms"
    if v >= 1e4:
        return f"{v / 1e3:.1f} µs"
    return f"{v:.0f} ns"


def fmt_ns_range(med: Optional[float], lo: Optional[float], hi: Optional[float]) -> str:
    """'1.88 µs [1.83-2.82]': a median and its min-max, all in the median's unit."""
    if med is None:
        return "—"
    div, unit, nd = (1e6, "ms", 2) if med >= 1e6 else (1e3, "µs", 1 if med >= 1e4 else 2) \
        if med >= 1e3 else (1, "ns", 0)
    f = (lambda v: f"{v / div:.{nd}f}")
    return f"{f(med)} {unit} [{f(lo)}-{f(hi)}]"


def fmt_ops(v: Optional[float]) -> str:
    if v is None:
        return "—"
    if v >= 1e6:
        return f"{v / 1e6:.2f} M"
    if v >= 1e3:
        return f"{v / 1e3:.1f} k"
    return f"{v:.0f}"


def fmt_us(v: Optional[float]) -> str:
    return "—" if v is None else (f"{v:.1f} µs" if v < 1000 else f"{v / 1000:.2f} ms")


# ====================================================================== ratios


def compute_ratios(out: Dict[str, Any]) -> Dict[str, Any]:
    R: Dict[str, Any] = {}
    s1 = _get(out, "s1_hit", "by_size", default={})
    for size, row in s1.items():
        u = _get(row, "ucmcache", "p50_ns")
        R.setdefault("s1_hit_p50", {})[size] = {
            b: _ratio(_get(row, b, "p50_ns"), u) for b in row if b != "ucmcache"}
    s2 = _get(out, "s2_batch", "systems", default={})
    ue = _get(s2, "ucmcache", "exist_per_key", "mean_ns")
    ug = _get(s2, "ucmcache", "get_many_per_key", "mean_ns")
    R["s2_exist"] = {b: _ratio(_get(v, "exist_per_key", "mean_ns"), ue) for b, v in s2.items() if b != "ucmcache"}
    R["s2_get_many"] = {b: _ratio(_get(v, "get_many_per_key", "mean_ns"), ug) for b, v in s2.items() if b != "ucmcache"}
    s3 = _get(out, "s3_mix", "by_size", default={})
    for size, blk in s3.items():
        sy = blk["systems"]
        u2 = _get(sy, "ucmcache", "2p", "ops_per_s")
        R.setdefault("s3_mix_2p", {})[size] = {b: _ratio(u2, _get(v, "2p", "ops_per_s"))
                                               for b, v in sy.items() if b != "ucmcache"}
        R.setdefault("s3_scaling", {})[size] = {
            b: _ratio(_get(v, "2p", "ops_per_s"), _get(v, "1p", "ops_per_s"))
            for b, v in sy.items() if "1p" in v}
    s4 = _get(out, "s4_flight", "systems", default={})
    uw = _get(s4, "ucmcache", "wake_p50_us")
    R["s4_wake_p50"] = {b: _ratio(_get(v, "wake_p50_us"), uw) for b, v in s4.items() if b != "ucmcache"}
    if uw is not None:
        R["s4_flight"] = _flight_ratios(s4, _get(out, "c_floor", "flight", default={}),
                                        _get(out, "s4_flight", "core_wait", default={}))
    s9 = _get(out, "s9_cold", "systems", default={})
    for fig in ("p50_ns", "p99_ns"):
        u = _get(s9, "ucmcache", "cold", fig)
        R.setdefault("s9_cold", {})[fig] = {b: _ratio(_get(v, "cold", fig), u)
                                            for b, v in s9.items() if b != "ucmcache"}
    if s9:
        R["s9_cold"]["cold_over_hit_p50"] = {b: _ratio(_get(v, "cold", "p50_ns"),
                                                       _get(v, "hit", "p50_ns"))
                                             for b, v in s9.items()}
    s5 = _get(out, "s5_churn", "by_size", default={})
    for size, blk in s5.items():
        sy = blk["systems"]
        u = _get(sy, "ucmcache", "ops_per_s")
        R.setdefault("s5_churn", {})[size] = {b: _ratio(u, _get(v, "ops_per_s"))
                                              for b, v in sy.items() if b != "ucmcache"}
    cf = _get(out, "c_floor", default={})
    if "hit" in cf:
        R["c_floor"] = {
            "hit_p50_new_vs_old": {s: _ratio(_get(v, "old", "p50_ns"), _get(v, "new", "p50_ns"))
                                   for s, v in cf["hit"].items()},
            "exist_new_vs_old": _ratio(_get(cf, "batch", "old", "exist_ns_per_key"),
                                       _get(cf, "batch", "new", "exist_ns_per_key")),
            "get_many_new_vs_old": _ratio(_get(cf, "batch", "old", "get_many_ns_per_key"),
                                          _get(cf, "batch", "new", "get_many_ns_per_key")),
            "mix_2p_new_vs_old": {s: _ratio(_get(v, "new", "2", "ops_per_s"), _get(v, "old", "2", "ops_per_s"))
                                  for s, v in cf["mix"].items()},
            "mix_1p_new_vs_old": {s: _ratio(_get(v, "new", "1", "ops_per_s"), _get(v, "old", "1", "ops_per_s"))
                                  for s, v in cf["mix"].items()},
            "mix_scaling_new": {s: _ratio(_get(v, "new", "2", "ops_per_s"), _get(v, "new", "1", "ops_per_s"))
                                for s, v in cf["mix"].items()},
            "mix_scaling_old": {s: _ratio(_get(v, "old", "2", "ops_per_s"), _get(v, "old", "1", "ops_per_s"))
                                for s, v in cf["mix"].items()},
            "churn_new_vs_old": _ratio(_get(cf, "churn", "new", "ops_per_s"), _get(cf, "churn", "old", "ops_per_s")),
        }
    return R


FLIGHT_CPU_NOTE = (
    "Waiter CPU per wake-up: the CPU time (user + system) of the waiting thread from just "
    "before its wait to just after the wake-up's stamp, less the clock reads' own cost, summed "
    "over every wait and divided by the waits (a futex sleep costs nothing; every round of a "
    "poll counts). Publish CPU: the same, of the owner's publish (where a futex wake's syscall "
    "is paid). Combined: wake-ups per waiter-CPU-second = 10^6 / the waiter CPU per wake-up in "
    "µs (higher is better); p99 x CPU = the p99 wake latency in µs times the waiter CPU per "
    "wake-up in µs, in µs² (lower is better: latency bought with less CPU). For Redis and the "
    "Manager dict only the waiter's process is counted, not their server's.")

# Scenario 4's figures compared per system: (ratio name, figure) -> other's / ucmcache's
_FLIGHT_FIGURES = (("p99", "wake_p99_us"), ("waiter_cpu", "waiter_cpu_us"),
                   ("p99_x_cpu", "p99_x_cpu_us2"))


def _flight_ratios(s4: Dict[str, Any], floors: Dict[str, Any],
                   core_wait: Dict[str, Any]) -> Dict[str, Any]:
    """Scenario 4 against each other system and the floors (c_floor_new: the futex floor,
    c_floor_old: the old design's polling floor, core_wait: ucmcache's Python floor): the
    other's figure / ucmcache's (above 1: ucmcache lower, better), and ucmcache's own p50 over
    the futex floor's and p99 over the old design's (the targets: <= 1.2x, <= 2x), the p50
    also wake-up order by wake-up order (common.wake_orders: like for like) and over the
    Python floor's."""
    u = s4["ucmcache"]
    others = {b: v for b, v in s4.items() if b != "ucmcache"}
    others.update({f"c_floor_{d}": v for d, v in floors.items()})
    if core_wait:
        others["core_wait"] = core_wait
    R: Dict[str, Any] = {name: {b: _ratio(_get(v, fig), u.get(fig)) for b, v in others.items()}
                         for name, fig in _FLIGHT_FIGURES}
    R["p50_over_c_floor"] = _ratio(u.get("wake_p50_us"), _get(floors, "new", "wake_p50_us"))
    R["p99_over_old"] = _ratio(u.get("wake_p99_us"), _get(s4, "old", "wake_p99_us"))
    for name, floor in (("c_floor", _get(floors, "new", default={})),
                        ("c_floor_resident", _get(floors, "new_resident", default={})),
                        ("core_wait", core_wait)):
        R[f"by_order_over_{name}"] = {
            o: _ratio(_get(u, "by_order", o, "p50_us"), _get(floor, "by_order", o, "p50_us"))
            for o in _get(u, "by_order", default={}) if _get(floor, "by_order", o)}
    R["p50_over_core_wait"] = _ratio(u.get("wake_p50_us"), core_wait.get("wake_p50_us"))
    return R


def compute_targets(out: Dict[str, Any], R: Dict[str, Any]) -> List[Dict[str, Any]]:
    """The targets of scenarios 1-6, judged on the median over the passes (R); the details give each
    ratio's [min-max] over the passes."""
    T: List[Dict[str, Any]] = []

    def add(name, goal, value, met, detail=""):
        T.append({"target": name, "goal": goal, "measured": value, "met": met, "detail": detail})

    def ge(v, g):
        return None if v is None else v >= g

    def X(*path):
        return fmt_xr(out, *path)

    for b, g, label in (("lmdb", 1.5, "py-lmdb"), ("redis", 20, "Redis"), ("manager", 40, "Manager dict")):
        v = _get(R, "s1_hit_p50", "4096", b)
        add(f"per-key hit (pin only) vs {label} (scenario 1, p50)", f">= {g}x", v, ge(v, g),
            f"4 KiB {X('s1_hit_p50', '4096', b)}, 64 KiB {X('s1_hit_p50', '65536', b)}")
    v = _get(R, "s2_get_many", "lmdb")
    add("batch get_many + release (pin only) vs py-lmdb, per key (scenario 2)", ">= 4x", v,
        ge(v, 4), X("s2_get_many", "lmdb"))
    v = _get(R, "s2_exist", "lmdb")
    add("batch exist vs py-lmdb, per key (scenario 2)", ">= 5x", v, ge(v, 5), X("s2_exist", "lmdb"))
    v = _get(R, "c_floor", "mix_2p_new_vs_old", "4096")
    add("2 processes, hit-heavy mix vs old design, C-only floor", ">= 3x", v, ge(v, 3),
        f"4 KiB {X('c_floor', 'mix_2p_new_vs_old', '4096')}, "
        f"64 KiB {X('c_floor', 'mix_2p_new_vs_old', '65536')}")
    v = _get(R, "s3_mix_2p", "4096", "old")
    add("2 processes, hit-heavy mix vs old design, Python API (scenario 3)", ">= 1.3x", v, ge(v, 1.3),
        f"4 KiB {X('s3_mix_2p', '4096', 'old')}, 64 KiB {X('s3_mix_2p', '65536', 'old')}")
    w = _get(out, "s4_flight", "systems", "ucmcache", "wake_p50_us")
    add("waiter wake latency p50 (scenario 4)", "< 20 µs", w, None if w is None else w < 20,
        f"{fmt_us(w)} (p99 {fmt_us(_get(out, 's4_flight', 'systems', 'ucmcache', 'wake_p99_us'))}); "
        f"loader runs {_get(out, 's4_flight', 'systems', 'ucmcache', 'loader_runs')} of "
        f"{_get(out, 's4_flight', 'keys')}; C floor (futex, no Python) "
        f"{fmt_us(_get(out, 'c_floor', 'flight', 'new', 'wake_p50_us'))}")
    v = _get(R, "s3_scaling", "4096", "ucmcache")
    add("hit-heavy throughput, 2 processes vs 1 (scenario 3)", ">= 1.8x", v, ge(v, 1.8),
        f"Python API 4 KiB {X('s3_scaling', '4096', 'ucmcache')}, "
        f"64 KiB {X('s3_scaling', '65536', 'ucmcache')}; "
        f"C floor 4 KiB {X('c_floor', 'mix_scaling_new', '4096')}")
    lay = out.get("layout", {})
    typ = next((v for k, v in lay.items() if k.startswith("typical")), None)
    if typ:
        others = "; ".join(f"{k.split(':')[0]} {v['pct']}%" for k, v in lay.items() if not k.startswith("typical"))
        add("control region / data region at 4 KiB slots", "<= 3%", typ["pct"], typ["pct"] <= 3,
            f"typical (8 ranks x 16384 slots): {typ['control_bytes'] / 2**20:.1f} MiB control / "
            f"{typ['data_bytes'] / 2**20:.0f} MiB data = {typ['pct']}%; {others}")
    return T


# The reads' targets (scenario 7, judged at 4 KiB on the median over the repetitions):
# (ratio, goal, ">=" or "<=", what)
READ_TARGETS = [
    ("read_vs_lmdb", 1.0, ">=", "per-key read `with get(k) as h: h.data[0]` vs py-lmdb "
                                "`begin(buffers=True)` + `get(k)[0]`"),
    ("gol_vs_lmdb", 1.5, ">=", "`get_or_load` hit vs py-lmdb `begin()` + `get(k)` (bytes)"),
    ("gmdata_vs_lmdb", 1.5, ">=", "`get_many(64)` + every `data(i)[0]` vs py-lmdb one txn, 64 gets"),
    ("gather_vs_lmdb", 4.0, ">=", "`gather` of 64 into a (64, value) array vs py-lmdb one txn, "
                                  "64 gets copied into it"),
    ("read_many_vs_lmdb", 4.0, ">=", "`read_many` of 64 vs the same py-lmdb copy"),
    ("gather_over_floor", 2.5, "<=", "`gather` of 64 within 2.5x of the memcpy floor (numpy "
                                     "copying the same slots)"),
    ("read_many_over_floor", 2.5, "<=", "`read_many` of 64 within 2.5x of the memcpy floor (numpy)"),
    ("gather_over_cfloor", 2.5, "<=", "(stricter than asked) `gather` within 2.5x of a C "
                                      "memcpy floor (one cffi call, 64 memcpy)"),
    ("read_many_over_cfloor", 2.5, "<=", "(stricter than asked) `read_many` within 2.5x of "
                                         "the C memcpy floor"),
    ("agol_over_gol", 1.5, "<=", "`await aget_or_load` hit within 1.5x of "
                                 "`get_or_load`'s"),
    ("read_vs_old", 1.0, ">=", "per-key read ahead of the old design's Python wrapper"),
    ("pin_vs_old", 1.0, ">=", "per-key hit (pin only) ahead of the old design's Python wrapper"),
]


def _rx(r: Optional[Dict[str, Any]]) -> str:
    if not r:
        return "—"
    return f"{fmt_x(r['median'])} [{_num(r['min'])}-{_num(r['max'])}]"


def compute_read_targets(out: Dict[str, Any]) -> List[Dict[str, Any]]:
    T: List[Dict[str, Any]] = []
    s7 = _get(out, "s7_reads", "by_size", default={})
    if not s7:
        return T
    for name, goal, op, what in READ_TARGETS:
        r4 = _get(s7, "4096", "ratios", name)
        r64 = _get(s7, "65536", "ratios", name)
        met = None
        every = None
        if r4:
            v = r4["median"]
            met = v >= goal if op == ">=" else v <= goal
            every = (r4["min"] >= goal) if op == ">=" else (r4["max"] <= goal)
        detail = f"4 KiB {_rx(r4)}, 64 KiB {_rx(r64)}"
        if met and not every:
            detail += " (the median meets it, not every repetition)"
        if met is False and (r4["max"] >= goal if op == ">=" else r4["min"] <= goal):
            detail += " (some repetitions meet it, the median does not)"
        T.append({"target": what, "goal": f"{op} {goal:g}x", "ratio": name,
                  "measured": None if not r4 else r4["median"], "met": met, "detail": detail})
    return T


def compute_arena_targets(out: Dict[str, Any]) -> List[Dict[str, Any]]:
    """The hit rate's target, one per row of scenario 8: ucmcache hits / global LRU hits."""
    s8 = out.get("s8_arenas")
    if not s8:
        return []
    T: List[Dict[str, Any]] = []
    for r in s8.get("rows", []):
        detail = ("error: " + r["error"]) if "error" in r else \
            f"{r['ratio']:.3f} (hit ratio {r['hit_ratio']:.4f} vs LRU {s8['lru_hit_ratio']:.4f})"
        T.append({"target": f"hit rate at equal memory, {r['label']}: ucmcache / global LRU",
                  "goal": f">= {s8['target']:g}", "measured": r.get("ratio"),
                  "met": r.get("met") if "error" not in r else False, "detail": detail})
    return T


def ratio_lines(out: Dict[str, Any]) -> List[str]:
    R = out.get("ratios", {})
    lines = ["Ratios, ucmcache's speed-up over each baseline (>1: ucmcache faster)"
             + (f", median [min-max] over {out['meta'].get('repeat')} passes:"
                if out.get("ratio_ranges") else ":")]

    def row(title, *path):
        d = _get(R, *path)
        if d:
            lines.append(f"  {title}: " + ", ".join(f"{LABELS.get(b, b)} {fmt_xr(out, *path, b)}"
                                                    for b in d))

    for size in R.get("s1_hit_p50", {}):
        row(f"1 hit (pin only) p50, {int(size) // 1024} KiB", "s1_hit_p50", size)
    row("2 batch exist, ns/key", "s2_exist")
    row("2 batch get_many + release (pin only), ns/key", "s2_get_many")
    for size in R.get("s3_mix_2p", {}):
        row(f"3 mix 2 procs, {int(size) // 1024} KiB", "s3_mix_2p", size)
    row("4 flight wake p50", "s4_wake_p50")
    row("4 flight wake p99", "s4_flight", "p99")
    row("4 flight waiter CPU per wake-up", "s4_flight", "waiter_cpu")
    row("4 flight p99 x waiter CPU", "s4_flight", "p99_x_cpu")
    row("9 cold get_or_load p50", "s9_cold", "p50_ns")
    row("9 cold get_or_load p99", "s9_cold", "p99_ns")
    for size in R.get("s5_churn", {}):
        row(f"5 churn, {int(size) // 1024} KiB", "s5_churn", size)
    cf = R.get("c_floor")
    if cf:
        lines.append("  C floor, new vs old: hit p50 " +
                     ", ".join(f"{int(k) // 1024} KiB {fmt_xr(out, 'c_floor', 'hit_p50_new_vs_old', k)}"
                               for k in cf["hit_p50_new_vs_old"]) +
                     f"; exist {fmt_xr(out, 'c_floor', 'exist_new_vs_old')}; get_many "
                     f"{fmt_xr(out, 'c_floor', 'get_many_new_vs_old')}; mix 2 procs " +
                     ", ".join(f"{int(k) // 1024} KiB {fmt_xr(out, 'c_floor', 'mix_2p_new_vs_old', k)}"
                               for k in cf["mix_2p_new_vs_old"]) +
                     f"; churn {fmt_xr(out, 'c_floor', 'churn_new_vs_old')}")
    s7 = _get(out, "s7_reads", "by_size", default={})
    for size, blk in s7.items():
        rs = blk.get("ratios")
        if rs:
            lines.append(f"  7 reads, {int(size) // 1024} KiB, median [min-max] over "
                         f"{_get(out, 's7_reads', 'reps')} interleaved repetitions: " +
                         ", ".join(f"{k} {_rx(v)}" for k, v in rs.items()))
    return lines


def target_lines(out: Dict[str, Any]) -> List[str]:
    lines = ["Targets of scenarios 1-6 and where this run stands:"]
    for t in out.get("targets", []):
        mark = {True: "MET    ", False: "NOT MET", None: "n/a    "}[t["met"]]
        lines.append(f"  [{mark}] {t['target']}: goal {t['goal']}; measured {t['detail']}")
    if out.get("targets_reads"):
        lines.append("Targets of the reads (scenario 7, judged at 4 KiB on the median):")
        for t in out["targets_reads"]:
            mark = {True: "MET    ", False: "NOT MET", None: "n/a    "}[t["met"]]
            lines.append(f"  [{mark}] {t['target']}: goal {t['goal']}; measured {t['detail']}")
    if out.get("targets_arenas"):
        lines.append("Targets of the hit rate at equal memory (scenario 8):")
        for t in out["targets_arenas"]:
            mark = {True: "MET    ", False: "NOT MET", None: "n/a    "}[t["met"]]
            lines.append(f"  [{mark}] {t['target']}: goal {t['goal']}; measured {t['detail']}")
    return lines


# ====================================================================== markdown


def _systems_in(*dicts) -> List[str]:
    seen = set()
    for d in dicts:
        if isinstance(d, dict):
            seen.update(d.keys())
    return [s for s in ORDER if s in seen]


# how a target's "met" (True, False, or None: not measured) reads in a markdown table
_MET_CELL = {True: "yes", False: "**no**", None: "n/a"}

_READ_GROUPS = [
    ("per key: read one byte of the value", ["read.ucm", "read.lmdb", "read.old", "read.floor",
                                             "read.floor_view"]),
    ("per key: pin only (nothing read)", ["pin.ucm", "pin.old"]),
    ("per key: get_or_load hit, the value as bytes", ["gol.ucm", "gol.lmdb", "gol.floor"]),
    ("per 64-key batch: every value's first byte", ["gmdata.ucm", "gmdata.lmdb", "gmdata.floor"]),
    ("per 64-key batch: copy every value into a (64, value) uint8 array",
     ["gather.ucm", "read_many.ucm", "copy.lmdb", "copy.lmdb_np", "copy.floor", "copy.cfloor"]),
    ("the same, into a page-aligned array (diagnostic: memcpy speed vs the rows' page offset)",
     ["gather.ucm@al", "read_many.ucm@al", "copy.lmdb@al", "copy.floor@al", "copy.cfloor@al"]),
]


def _md_reads(out: Dict[str, Any]) -> List[str]:
    s7 = out.get("s7_reads")
    if not s7:
        return []
    L: List[str] = []
    by = s7.get("by_size", {})
    sizes = list(by)
    L.append("## 7. Reads: what a user does with a hit")
    L.append("")
    keys = "; ".join(f"{int(sz) // 1024} KiB values: {b.get('keys')} keys" for sz, b in by.items())
    L.append(f"{keys} resident, random order; batches of {s7['batch']} distinct keys. Every row "
             f"runs in one process, interleaved: {s7['reps']} repetitions x {s7['rounds']} rounds, "
             f"each row a slice of about {s7['slice_s'] * 1000:.0f} ms per round, in a fresh "
             "random order every round, so the machine's load lands on every row alike. Figures: time "
             "per op (per key, or per 64-key batch), median [min-max] over the repetitions; "
             "ratios computed per repetition, median [min-max]. Load average (1 min) "
             f"{s7.get('load_before')} before, {s7.get('load_after')} after. Before timing, every "
             "row was checked to return or copy the payload.")
    for sz, b in by.items():
        if "error" in b:
            L.append("")
            L.append(f"**{int(sz) // 1024} KiB: error** {b['error']}")
    L.append("")
    L.append("| row |" + "".join(f" {int(sz) // 1024} KiB |" for sz in sizes))
    L.append("|---|" + "---|" * len(sizes))
    for title, ids in _READ_GROUPS:
        present = [r for r in ids if any(r in _get(by, sz, "rows", default={}) for sz in sizes)]
        if not present:
            continue
        L.append(f"| *{title}* |" + " |" * len(sizes))
        for rid in present:
            cells = []
            label = rid
            for sz in sizes:
                r = _get(by, sz, "rows", rid)
                if not r:
                    cells.append(" — |")
                    continue
                label = r["label"]
                cells.append(f" {fmt_ns_range(r['median'], r['min'], r['max'])} |")
            L.append(f"| {label} |" + "".join(cells))
    L.append("")
    L.append("| ratio (per repetition) | what |" + "".join(f" {int(sz) // 1024} KiB |" for sz in sizes))
    L.append("|---|---|" + "---|" * len(sizes))
    names: List[str] = []
    for sz in sizes:
        names += [n for n in _get(by, sz, "ratios", default={}) if n not in names]
    for n in names:
        what = next((_get(by, sz, "ratios", n, "what") for sz in sizes
                     if _get(by, sz, "ratios", n)), n)
        L.append(f"| {n} | {what} |" + "".join(f" {_rx(_get(by, sz, 'ratios', n))} |" for sz in sizes))
    L.append("")
    L.append("Ratios are time / time: `..._vs_lmdb` = py-lmdb's time / ucmcache's (above 1 "
             "ucmcache is faster); `..._over_floor` = ucmcache's (or py-lmdb's) time / the memcpy "
             "floor's (1 = as fast as numpy copying the same bytes); `floor_share_read` = the "
             "Python floor's share of ucmcache's read; `floor_vs_lmdb_read` = py-lmdb's read / the "
             "Python floor (below 1: py-lmdb reads faster than an empty context manager with two "
             "no-op cffi calls costs).")
    fl = "; ".join(f"{int(sz) // 1024} KiB {b.get('memcpy_floor_gb_s')} GB/s" for sz, b in by.items()
                   if b.get("memcpy_floor_gb_s"))
    if fl:
        L.append(f"The memcpy floor (median) copies at {fl}.")
    L.append("")
    T = out.get("targets_reads") or []
    if T:
        L.append("## Targets of the reads (scenario 7, judged at 4 KiB on the median)")
        L.append("")
        L.append("| target | goal | measured median [min-max] | met |")
        L.append("|---|---|---|---|")
        for t in T:
            L.append(f"| {t['target']} | {t['goal']} | {t['detail']} | {_MET_CELL[t['met']]} |")
        L.append("")
    return L


def arenas_table(s8: Dict[str, Any]) -> List[str]:
    """Scenario 8's table (also printed by `python -m bench.arenas`)."""
    n = s8["requests"]
    L = ["| ranks attached | requests on the busiest rank | ucmcache hit ratio | global LRU hit "
         "ratio | ucmcache / LRU | target >= " + f"{s8['target']:g} met? |",
         "|---|---|---|---|---|---|"]
    for r in s8["rows"]:
        busy = f"{r['busiest_rank_requests']:,} ({100 * r['busiest_rank_share']:.1f}%)"
        if "error" in r:
            L.append(f"| {r['label']} | {busy} | **error**: {r['error'][:200]} | "
                     f"{s8['lru_hit_ratio']:.4f} | — | **no** |")
            continue
        L.append(f"| {r['label']} | {busy} | {r['hit_ratio']:.4f} | {s8['lru_hit_ratio']:.4f} | "
                 f"{r['ratio']:.3f} | {'yes' if r['met'] else '**no**'} |")
    L.append("")
    L.append("| ranks attached | loader calls (ucmcache) | LRU misses | evictions | bypasses "
             "(cache full) | requests/s | time |")
    L.append("|---|---|---|---|---|---|---|")
    for r in s8["rows"]:
        if "error" in r:
            continue
        st = r.get("stats", {})
        L.append(f"| {r['label']} | {r['loader_calls']:,} | {n - s8['lru_hits']:,} | "
                 f"{st.get('evictions', 0):,} | {st.get('bypasses', 0):,} | "
                 f"{fmt_ops(r['requests_per_s'])} | {r['elapsed_s']:.2f} s |")
    return L


def _md_arenas(out: Dict[str, Any]) -> List[str]:
    s8 = out.get("s8_arenas")
    if not s8:
        return []
    L = ["## 8. Hit rate at equal memory", ""]
    L.append(f"One Zipf({s8['zipf_s']}) trace of {s8['requests']:,} requests over "
             f"{s8['keys']:,} keys ({s8['distinct_keys_requested']:,} of them requested; fixed "
             f"seed {s8['seeds']['trace']}), walked in order. ucmcache: one segment of "
             f"max_ranks={s8['max_ranks']} x {s8['slots_per_rank']} slots of {s8['slot_size']} B "
             "with the row's ranks attached (SlotCache instances in one process), each request "
             "sent to one attached rank's `get_or_load` (uniformly at random, fixed seed, or 70% "
             "to the first rank and the rest uniform over the other three); a hit is a request "
             "whose loader did not run, and every returned value was checked to be the key's "
             f"payload. Global LRU: an OrderedDict of {s8['lru_capacity']:,} entries (the same "
             "number of slots) on the same key sequence. The ratio is ucmcache's hits / the "
             "LRU's; it depends only on the build and the seeds, so one run is enough. "
             "Requests/s (for information) include the loader and the check. "
             "Rerun: `./scripts/bench --scenarios 8` (or `.venv/bin/python -m bench.arenas` "
             "to print the table without writing results).")
    if s8.get("error"):
        L.append("")
        L.append(f"**Scenario 8 failed**: {s8['error']}")
    L.append("")
    L.extend(arenas_table(s8))
    L.append("")
    return L


def markdown(out: Dict[str, Any]) -> str:
    """latest.md: the run's header, then one section per scenario present in out, then how it
    is measured.  Each section is its own function below."""
    L: List[str] = []
    for section in (_md_header, _md_baselines, _md_targets, _md_reads, _md_arenas, _md_hit,
                    _md_batch, _md_mix, _md_flight, _md_churn, _md_tier2, _md_cold, _md_layout,
                    _md_readme_tables):
        L.extend(section(out))
    L.extend(_md_method())
    return "\n".join(L)


def _md_header(out: Dict[str, Any]) -> List[str]:
    """Title, how to rerun, what x means, and a warning when the machine was busy."""
    m = out["meta"]
    L = ["# ucmcache benchmark results", ""]
    L.append(f"Rerun: `{WRAPPER}` (= `.venv/bin/python -m bench.run` from the repository root; add `--quick` for a "
             "harness check with tiny sizes). This file was written by "
             f"`{m['command']}` on {m['started']}: {m['cores']} cores, load average "
             f"{m.get('load_before')} before, {m.get('load_after')} after; wall time "
             f"{m.get('wall_s')} s{' (QUICK run: tiny sizes, numbers mean little)' if m.get('quick') else ''}.")
    rep = m.get("repeat", 1)
    L.append("Every number below was measured in that one run. **x** = ucmcache's speed-up over that "
             "system (its time / ucmcache's time, or ucmcache's ops/s / its ops/s): above 1 ucmcache "
             "is faster, below 1 slower." +
             (f" Scenarios 1-6, 9 and the floors ran {rep} whole passes: each figure is the median "
              "over the passes, each x the median of the per-pass ratios with its [min-max]."
              if rep and rep > 1 else "") +
             (" Scenario 7 (reads) repeats inside itself, interleaved: its figures and ratios are "
              "median [min-max] over its repetitions." if out.get("s7_reads") else "") +
             (" Scenario 8 (hit rate) runs once: one process, fixed seeds, deterministic hit "
              "counts." if out.get("s8_arenas") else ""))
    lb = m.get("load_before") or []
    # A 1-minute load above half the cores means other work competed with the multi-process
    # scenarios: say so where a reader of the figures cannot miss it.
    if lb and m.get("cores") and lb[0] > 0.5 * m["cores"]:
        L.append("")
        L.append(f"**The machine was busy during this run** (load average {lb[0]} on {m['cores']} "
                 "cores, from other work): single-process figures are roughly right, but the "
                 "multi-process ones (2-process throughput and scaling, single-flight wake latency, "
                 "where a woken process waits for a free CPU) are depressed. Rerun on a quiet "
                 "machine before quoting them.")
    L.append("")
    return L


def _md_baselines(out: Dict[str, Any]) -> List[str]:
    """Which baselines ran, and why any was skipped."""
    L = ["## Baselines", "", "| system | status |", "|---|---|"]
    for name, b in out.get("baselines", {}).items():
        st = "available" + (f" ({b['note']})" if b.get("note") else "") if b["available"] else \
            f"**skipped**: {b.get('skipped_why')}"
        L.append(f"| {b['label']} | {st} |")
    L.append("")
    return L


def _md_targets(out: Dict[str, Any]) -> List[str]:
    """The targets of scenarios 1-6 (the reads' and the arenas' have their own tables)."""
    L = ["## Targets of scenarios 1-6", "", "| target | goal | measured | met |", "|---|---|---|---|"]
    for t in out.get("targets", []):
        L.append(f"| {t['target']} | {t['goal']} | {t['detail']} | {_MET_CELL[t['met']]} |")
    L.append("")
    return L


def _md_hit(out: Dict[str, Any]) -> List[str]:
    """Scenario 1: single-process hit latency, one column group per value size."""
    s1 = _get(out, "s1_hit", "by_size", default={})
    if not s1:
        return []
    sizes = list(s1)
    L = ["## 1. Single-process hit, pin only: get + release, ns/op", ""]
    L.append(f"{_get(out, 's1_hit', 'resident_keys')} resident keys, random order; each op "
             f"timed alone, timer overhead ({_get(out, 's1_hit', 'timer_overhead_ns'):.0f} ns) "
             "subtracted; x from p50. ucmcache: `with cache.get(k): pass`. **Pin only**: no "
             "byte of the value is read (py-lmdb's `get` does locate it); scenario 7 measures "
             "reads.")
    L.append("")
    hdr = "| system |" + "".join(f" {int(s) // 1024} KiB p50 | p99 | mean | x |" for s in sizes)
    L.append(hdr)
    L.append("|---|" + "---|---|---|---|" * len(sizes))
    for sysn in _systems_in(*s1.values()):
        cells = []
        for s in sizes:
            r = s1[s].get(sysn, {})
            if "error" in r:
                cells.append(f" error: {r['error'][:60]} | | | |")
                continue
            x = "—" if sysn == "ucmcache" else fmt_xr(out, "s1_hit_p50", s, sysn)
            cells.append(f" {fmt_ns(r.get('p50_ns'))} | {fmt_ns(r.get('p99_ns'))} | "
                         f"{fmt_ns(r.get('bulk_mean_ns'))} | {x} |")
        L.append(f"| {LABELS[sysn]} |" + "".join(cells))
    L.extend(_md_hit_variants_and_floors(out, s1, sizes))
    L.append("")
    return L


def _md_hit_variants_and_floors(out: Dict[str, Any], s1: Dict[str, Any],
                                sizes: List[str]) -> List[str]:
    """Scenario 1's extra rows: ucmcache's other spellings of a hit, then the Python and C
    floors (what the same steps cost without ucmcache's Python layer)."""
    L: List[str] = []
    for extra, label in (("get_close", "ucmcache `h = get(k); h.close()`"),
                         ("get_data_close", "ucmcache `with get(k) as h: h.data`")):
        cells = []
        for s in sizes:
            r = _get(s1, s, "ucmcache", extra, default={})
            cells.append(f" {fmt_ns(r.get('p50_ns'))} | {fmt_ns(r.get('p99_ns'))} | "
                         f"{fmt_ns(r.get('mean_ns'))} | |")
        L.append(f"| {label} |" + "".join(cells))
    pf = _get(out, "py_floor", "hit")
    if pf:  # measured at one size: the same figure in every size's columns
        L.append("| Python floor (empty context manager + 2 no-op C calls) |" +
                 "".join(f" {fmt_ns(pf['p50_ns'])} | {fmt_ns(pf['p99_ns'])} | {fmt_ns(pf['mean_ns'])} | |"
                         for _ in sizes))
    cf = _get(out, "c_floor", "hit")
    if cf:
        for d, label in (("new", "C floor: ucm_lookup_pin + ucm_release"),
                         ("old", "C floor: old design get + release")):
            cells = []
            for s in sizes:
                r = _get(cf, s, d, default={})
                x = fmt_xr(out, "c_floor", "hit_p50_new_vs_old", s) if d == "old" else ""
                cells.append(f" {r.get('p50_ns', '—')} ns | {r.get('p99_ns', '—')} ns | "
                             f"{r.get('mean_ns', '—')} ns | {x} |")
            L.append(f"| {label} |" + "".join(cells))
        L.append("")
        L.append("C floor p50/p99 are of 32-op chunk averages; its x column is new vs old.")
    return L


def _md_batch(out: Dict[str, Any]) -> List[str]:
    """Scenario 2: 64-key exist and get_many, per key, with the Python and C floors."""
    s2 = _get(out, "s2_batch", "systems", default={})
    if not s2:
        return []
    L = [f"## 2. Batches of {_get(out, 's2_batch', 'batch')} keys over "
         f"{_get(out, 's2_batch', 'resident_keys'):,} resident keys (4 KiB), ns/key", ""]
    L.append("Per request, divided by its key count; x from the mean. ucmcache: one `exist(keys)`; "
             "`with get_many(keys): pass` (**pin only**: no payload is read; scenario 7 reads "
             "them). LMDB: one read transaction per request.")
    L.append("")
    L.append("| system | exist mean | p50 | p99 | x | get_many+release (pin only) mean | p50 | p99 | x |")
    L.append("|---|---|---|---|---|---|---|---|---|")
    for sysn in _systems_in(s2):
        r = s2[sysn]
        if "error" in r:
            L.append(f"| {LABELS[sysn]} | error: {r['error'][:80]} | | | | | | | |")
            continue
        e, g = r["exist_per_key"], r["get_many_per_key"]
        xe = "—" if sysn == "ucmcache" else fmt_xr(out, "s2_exist", sysn)
        xg = "—" if sysn == "ucmcache" else fmt_xr(out, "s2_get_many", sysn)
        L.append(f"| {LABELS[sysn]} | {fmt_ns(e['mean_ns'])} | {fmt_ns(e['p50_ns'])} | "
                 f"{fmt_ns(e['p99_ns'])} | {xe} | {fmt_ns(g['mean_ns'])} | {fmt_ns(g['p50_ns'])} | "
                 f"{fmt_ns(g['p99_ns'])} | {xg} |")
    pf = out.get("py_floor", {})
    if "exist_per_key" in pf:
        e, g = pf["exist_per_key"], pf["get_many_per_key"]
        L.append(f"| Python floor (join ids + no-op C calls) | {fmt_ns(e['mean_ns'])} | "
                 f"{fmt_ns(e['p50_ns'])} | {fmt_ns(e['p99_ns'])} | | {fmt_ns(g['mean_ns'])} | "
                 f"{fmt_ns(g['p50_ns'])} | {fmt_ns(g['p99_ns'])} | |")
    cb = _get(out, "c_floor", "batch")
    if cb:
        for d, label in (("new", "C floor: ucm_exist_many / ucm_lookup_pin_many + ucm_release_many"),
                         ("old", "C floor: old design")):
            r = cb[d]
            xe = fmt_xr(out, "c_floor", "exist_new_vs_old") if d == "old" else ""
            xg = fmt_xr(out, "c_floor", "get_many_new_vs_old") if d == "old" else ""
            L.append(f"| {label} | {r['exist_ns_per_key']} ns | {r['exist_p50_ns_per_key']} ns | "
                     f"{r['exist_p99_ns_per_key']} ns | {xe} | {r['get_many_ns_per_key']} ns | "
                     f"{r['get_many_p50_ns_per_key']} ns | {r['get_many_p99_ns_per_key']} ns | {xg} |")
    L.append("")
    return L


def _md_mix(out: Dict[str, Any]) -> List[str]:
    """Scenario 3: hit-heavy mix, 1 and 2 processes, one column group per value size."""
    s3 = _get(out, "s3_mix", "by_size", default={})
    if not s3:
        return []
    sizes = list(s3)
    L = [f"## 3. Hit-heavy mix: {100 - _get(out, 's3_mix', 'miss_pct')}% hits / "
         f"{_get(out, 's3_mix', 'miss_pct')}% misses (load + evict), total ops/s", ""]
    L.append("Hot set = half of one rank's slots, preloaded; misses are fresh keys (loaded, "
             "evicting by CLOCK where the system evicts). " +
             "; ".join(f"{int(s) // 1024} KiB: {b['slots_per_rank']} slots/rank, {b['hot_keys']} hot keys"
                       for s, b in s3.items()) + ". x compares 2-process throughput.")
    L.append("")
    L.append("| system |" + "".join(f" {int(s) // 1024} KiB 1 proc | 2 procs | 2p/1p | hit rate | x |"
                                    for s in sizes))
    L.append("|---|" + "---|---|---|---|---|" * len(sizes))
    for sysn in _systems_in(*[b["systems"] for b in s3.values()]):
        cells = []
        for s in sizes:
            v = s3[s]["systems"].get(sysn, {})
            one, two = v.get("1p", {}), v.get("2p", {})
            if "error" in two:
                cells.append(f" | error: {two['error'][:60]} | | | |")
                continue
            sc = fmt_xr(out, "s3_scaling", s, sysn) if one else "—"
            x = "—" if sysn == "ucmcache" else fmt_xr(out, "s3_mix_2p", s, sysn)
            cells.append(f" {fmt_ops(one.get('ops_per_s')) if one else '—'} | "
                         f"{fmt_ops(two.get('ops_per_s'))} | {sc} | {two.get('hit_rate', '—')} | {x} |")
        L.append(f"| {LABELS[sysn]} |" + "".join(cells))
    L.extend(_md_mix_c_floor(out, sizes))
    L.append("")
    return L


def _md_mix_c_floor(out: Dict[str, Any], sizes: List[str]) -> List[str]:
    """Scenario 3's C floor rows (the 3x target is new vs old at 2 processes)."""
    cm = _get(out, "c_floor", "mix")
    if not cm:
        return []
    L: List[str] = []
    for d, label in (("new", "C floor: ucmcache protocol steps"), ("old", "C floor: old design")):
        cells = []
        for s in sizes:
            v = _get(cm, s, d, default={})
            one, two = v.get("1", {}), v.get("2", {})
            sc = fmt_xr(out, "c_floor", f"mix_scaling_{d}", s)
            x = fmt_xr(out, "c_floor", "mix_2p_new_vs_old", s) if d == "old" else ""
            hr = round(two.get("hits", 0) / max(two.get("ops", 1), 1), 4)
            cells.append(f" {fmt_ops(one.get('ops_per_s'))} | {fmt_ops(two.get('ops_per_s'))} | "
                         f"{sc} | {hr} | {x} |")
        L.append(f"| {label} |" + "".join(cells))
    L.append("")
    L.append("C floor rows: x is new vs old at 2 processes (the 3x target).")
    return L


def _pass_range(out: Dict[str, Any], *path) -> Optional[Tuple[float, float]]:
    """A figure's (min, max) over the passes (None with one pass or no numbers)."""
    vals = [v for v in (_get(p, *path) for p in out.get("passes") or []) if _is_num(v)]
    return (min(vals), max(vals)) if len(vals) > 1 else None


def _fig(out: Dict[str, Any], unit: str, *path) -> str:
    """A figure of out (the median over the passes) with its [min-max] over them, in one unit:
    unit "ns" or "us" (a time, shown in ns, µs or ms as its size asks) or "" (a number)."""
    v = _get(out, *path)
    if v is None:
        return "—"
    lo, hi = _pass_range(out, *path) or (None, None)
    if unit:
        scale = 1000 if unit == "us" else 1
        if lo is None:
            return fmt_ns(v * scale)
        return fmt_ns_range(v * scale, lo * scale, hi * scale)
    num = (lambda x: f"{x:,}" if isinstance(x, int) else f"{x:,.0f}" if x >= 100
           else f"{x:.1f}" if x >= 10 else f"{x:.2f}")
    return num(v) + ("" if lo is None else f" [{num(lo)}-{num(hi)}]")


def _md_flight(out: Dict[str, Any]) -> List[str]:
    """Scenario 4: cold single flight across processes: loader runs, wake latency, the CPU a
    waiter burns per wake-up, and the combined figures (FLIGHT_CPU_NOTE)."""
    s4 = _get(out, "s4_flight", "systems", default={})
    if not s4:
        return []
    L = [f"## 4. Cold single flight: {_get(out, 's4_flight', 'procs')} processes ask the same "
         f"{_get(out, 's4_flight', 'keys')} cold keys (loader ≈ {_get(out, 's4_flight', 'load_us')} µs)",
         ""]
    L.append("Wake latency: from the owner's timestamp taken just before it publishes (ucmcache: "
             "before `h.ready()`) to the waiter's return from its wait, across processes. "
             "Baselines without a wake-up poll every 50 µs; the old design polls its ready flag. "
             f"{_get(out, 's4_flight', 'procs')} processes on {os.cpu_count()} cores: with more "
             "processes than cores a woken waiter often waits for a CPU while the "
             "owner runs on into the next load: the C floor row (no Python) shows how much of "
             "the latency is scheduling. Few waits and many 'already ready' mean the processes "
             "seldom ran at the same time. " + FLIGHT_CPU_NOTE + " Figures: median [min-max] "
             "over the passes; x: the other's figure / ucmcache's (above 1 ucmcache is lower), "
             "the median of the per-pass ratios [min-max].")
    L.append("")
    L.append("| system | loader runs | waits | already ready | wake p50 | wake p99 | waiter CPU "
             "per wake-up | publish CPU per load | wake-ups per waiter-CPU-s | p99 x CPU (µs²) | "
             "x (p50) | x (p99) | x (p99 x CPU) |")
    L.append("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    rows = [(sysn, ("s4_flight", "systems", sysn)) for sysn in _systems_in(s4)]
    if _get(out, "s4_flight", "core_wait"):
        rows.insert(1, ("core_wait", ("s4_flight", "core_wait")))
    rows += [(f"c_floor_{d}", ("c_floor", "flight", d))
             for d in _get(out, "c_floor", "flight", default={})]
    for name, path in rows:
        r = _get(out, *path)
        if "error" in r:
            L.append(f"| {LABELS[name]} | error: {r['error'][:80]} | | | | | | | | | | | |")
            continue
        # more loader runs than keys means single flight failed: flag it in the table itself
        ok = "" if r["loader_runs"] == _get(out, "s4_flight", "keys") else " **(!)**"
        us = (lambda *k: _fig(out, "us", *path, *k))
        plain = (lambda *k: _fig(out, "", *path, *k))
        xs = ["—"] * 3 if name == "ucmcache" else \
            [fmt_xr(out, "s4_wake_p50", name), fmt_xr(out, "s4_flight", "p99", name),
             fmt_xr(out, "s4_flight", "p99_x_cpu", name)]
        L.append(f"| {LABELS[name]} | {r['loader_runs']}{ok} | {r['waits']} | {r['hits']} | "
                 f"{us('wake_p50_us')} | {us('wake_p99_us')} | {us('waiter_cpu_us')} | "
                 f"{us('publish_cpu_us')} | {plain('wakes_per_cpu_s')} | "
                 f"{plain('p99_x_cpu_us2')} | "
                 + " | ".join(xs) + " |")
    L.append("")
    if _get(out, "ratios", "s4_flight", "p50_over_c_floor") is not None or \
            _get(out, "ratios", "s4_flight", "p99_over_old") is not None:
        L.append("Against the miss path's targets (ratios of ucmcache's figure, median "
                 "[min-max] of the per-pass ratios): wake p50 / the C futex floor's "
                 f"{fmt_xr(out, 's4_flight', 'p50_over_c_floor')} (target <= 1.2x); wake p99 / "
                 f"the old design's {fmt_xr(out, 's4_flight', 'p99_over_old')} (target <= 2x); "
                 "when the old design's waiters spin, latency per CPU: its p99 x CPU / ours "
                 f"{fmt_xr(out, 's4_flight', 'p99_x_cpu', 'old')} (above 1: ours better).")
        L.append("")
    L += _md_wake_orders(out, rows)
    fl = _get(out, "c_floor", "flight", "new", default={})
    if "lead_within_5us" in fl:
        pct = (lambda k: _fig(out, "", "c_floor", "flight", "new", k))
        L.append("When the futex floor's waits began (the lead: the publish's time minus the "
                 f"wait's start): median {_fig(out, 'us', 'c_floor', 'flight', 'new', 'lead_p50_us')}"
                 f", 1st percentile {_fig(out, 'us', 'c_floor', 'flight', 'new', 'lead_p01_us')}; "
                 f"share of waits begun within 5 µs before the publish {pct('lead_within_5us')}, "
                 f"begun after it (the waiter off the CPU between its get and its wait) "
                 f"{pct('lead_negative')}. A spin of a few µs before the futex sleep could catch "
                 "only the first share.")
        L.append("")
    return L


def _md_wake_orders(out: Dict[str, Any], rows) -> List[str]:
    """Scenario 4's wake p50 by wake-up order (common.wake_orders), each row beside the C futex
    floor's and ucmcache's Python floor's in the same order."""
    orders = sorted({o for _, path in rows for o in _get(out, *path, "by_order", default={})},
                    key=int)
    if not orders:
        return []
    L = ["Wake p50 by wake-up order: the waiters of each key sorted by when they returned "
         "(they measure from one stamp). The first woken measures the wake-up itself; the "
         "second and third also wait for a CPU behind those woken before them (2 cores, the "
         "owner running on into its next load on one), so the p50 over every wait above "
         "depends on how often two or three waiters met, which differs between systems and "
         "between runs: these rows compare like with like. The Python floor is ucmcache's "
         "own loop with its waiters calling the core's wait step (`ucm_wait_loaded`) "
         "directly: what any Python process pays to be woken, with none of `Handle.wait`. "
         "Figures: median [min-max] over the passes (waits: how many of that order).", "",
         "| system | " + " | ".join(f"{_ORDINAL.get(o, o + 'th')} woken: waits | p50"
                                   for o in orders) + " |",
         "|---|" + "---|---|" * len(orders)]
    for name, path in rows:
        r = _get(out, *path, default={})
        if "by_order" not in r:
            continue
        cells = [f"{_fig(out, '', *path, 'by_order', o, 'waits')} | "
                 f"{_fig(out, 'us', *path, 'by_order', o, 'p50_us')}" for o in orders]
        L.append(f"| {LABELS[name]} | " + " | ".join(cells) + " |")
    L.append("")
    by = (lambda floor: ", ".join(
        f"{_ORDINAL.get(o, o + 'th')} {fmt_xr(out, 's4_flight', f'by_order_over_{floor}', o)}"
        for o in orders))
    L.append("ucmcache's wake p50 over the C futex floor's, order by order (target <= 1.2x): "
             f"{by('c_floor')}; over every wait {fmt_xr(out, 's4_flight', 'p50_over_c_floor')}. "
             "Over the same C floor in processes as large as a Python process "
             f"({_get(out, 'c_floor', 'flight', 'new_resident', 'resident_mb', default='—')} MB "
             f"resident each): {by('c_floor_resident')}. Over its Python floor's: "
             f"{by('core_wait')}; over every wait "
             f"{fmt_xr(out, 's4_flight', 'p50_over_core_wait')}.")
    L.append("")
    return L


_ORDINAL = {"1": "1st", "2": "2nd", "3": "3rd"}


def _md_cold(out: Dict[str, Any]) -> List[str]:
    """Scenario 9: a cold get_or_load that evicts, per operation, beside a hit."""
    s9 = _get(out, "s9_cold", "systems", default={})
    if not s9:
        return []
    L = ["## 9. Cold get_or_load: a key not in a full cache (it evicts), the loader returning "
         "4 KiB it has", ""]
    L.append(f"One process; a cache of {_get(out, 's9_cold', 'capacity')} slots of 4 KiB filled "
             f"with resident keys; then {_get(out, 's9_cold', 'keys')} get_or_loads of resident "
             "keys in random order (hits, for scale), then as many of keys never seen, each "
             "timed alone, less the timer's overhead. ucmcache: `c.get_or_load(k, loader)`; the "
             "old design (which had no get_or_load): `get`, the loader, the copy into the slot, "
             "`ready`, `close` (`OldCache.get_or_load`); py-lmdb: a read transaction's `get` that "
             "misses, the loader, then a write transaction's `put` of the value (`sync=False`; "
             "LMDB does not evict: its file grows instead). Figures: median [min-max] over the "
             "passes; x: the other's time / ucmcache's, the median of the per-pass ratios "
             "[min-max].")
    L.append("")
    L.append("| system | cold p50 | cold p99 | cold mean | hit p50 | cold / hit (p50) | x (p50) "
             "| x (p99) |")
    L.append("|---|---|---|---|---|---|---|---|")
    for sysn in _systems_in(s9):
        r = s9[sysn]
        if "error" in r:
            L.append(f"| {LABELS[sysn]} | error: {r['error'][:80]} | | | | | | |")
            continue
        ns = (lambda *k: _fig(out, "ns", "s9_cold", "systems", sysn, *k))
        xs = ["—", "—"] if sysn == "ucmcache" else \
            [fmt_xr(out, "s9_cold", "p50_ns", sysn), fmt_xr(out, "s9_cold", "p99_ns", sysn)]
        L.append(f"| {LABELS[sysn]} | {ns('cold', 'p50_ns')} | {ns('cold', 'p99_ns')} | "
                 f"{ns('cold', 'mean_ns')} | {ns('hit', 'p50_ns')} | "
                 f"{fmt_xr(out, 's9_cold', 'cold_over_hit_p50', sysn)} | " + " | ".join(xs) + " |")
    L.append("")
    return L


def _md_churn(out: Dict[str, Any]) -> List[str]:
    """Scenario 5: eviction churn, throughput and hit rate per value size."""
    s5 = _get(out, "s5_churn", "by_size", default={})
    if not s5:
        return []
    sizes = list(s5)
    L = ["## 5. Eviction churn: working set 4x capacity, 2 processes, ops/s", ""]
    L.append("; ".join(f"{int(s) // 1024} KiB: capacity {b['capacity']} slots, working set "
                       f"{b['working_set']} keys" for s, b in s5.items()) +
             ". Uniform keys, every miss loads. Redis runs with maxmemory = capacity x slot "
             "(allkeys-lru), diskcache with size_limit = the same bytes; LMDB and the Manager "
             "dict do not evict, so they keep the whole working set (see their hit rates).")
    L.append("")
    L.append("| system |" + "".join(f" {int(s) // 1024} KiB ops/s | hit rate | x |" for s in sizes))
    L.append("|---|" + "---|---|---|" * len(sizes))
    for sysn in _systems_in(*[b["systems"] for b in s5.values()]):
        cells = []
        for s in sizes:
            r = s5[s]["systems"].get(sysn, {})
            if "error" in r:
                cells.append(f" error: {r['error'][:60]} | | |")
                continue
            x = "—" if sysn == "ucmcache" else fmt_xr(out, "s5_churn", s, sysn)
            cells.append(f" {fmt_ops(r.get('ops_per_s'))} | {r.get('hit_rate')} | {x} |")
        L.append(f"| {LABELS[sysn]} |" + "".join(cells))
    ch = _get(out, "c_floor", "churn")
    if ch:  # the C floor runs at 4 KiB only: its other size columns stay empty
        for d, label in (("new", "C floor: ucmcache protocol steps (4 KiB)"), ("old", "C floor: old design (4 KiB)")):
            r = ch[d]
            x = fmt_xr(out, "c_floor", "churn_new_vs_old") if d == "old" else ""
            hr = round(r["hits"] / max(r["ops"], 1), 4)
            L.append(f"| {label} | {fmt_ops(r['ops_per_s'])} | {hr} | {x} |" +
                     " | | |" * (len(sizes) - 1))
    L.append("")
    return L


def _md_tier2(out: Dict[str, Any]) -> List[str]:
    """Scenario 6: a local hit vs a hit served by Redis vs a cold miss."""
    t2 = out.get("s6_tier2")
    if not t2:
        return []
    L = ["## 6. Tier 2 (Redis over a unix socket): local hit vs tier-2 hit vs cold miss", ""]
    if t2.get("skipped_why"):
        L.append(f"Skipped: {t2['skipped_why']}.")
    else:
        L.append(f"`get_or_load` of {t2['keys']} keys, {t2['slot_size']} B values, mean per "
                 "key. Node A loads every key (cold miss, written through); node B, a second "
                 "segment with the same namespace, then gets every key from Redis; then "
                 "again, from its own segment.")
        L.append("")
        L.append("| path | per key | vs local hit |")
        L.append("|---|---|---|")
        base = t2["local_hit_ns"]
        for label, key in (("local hit (node B, second pass)", "local_hit_ns"),
                           ("tier-2 hit (node B, first pass)", "tier2_hit_ns"),
                           ("cold miss: lease + loader + write-through (node A)",
                            "miss_with_loader_ns"),
                           ("the loader alone", "loader_alone_ns")):
            rel = "" if key == "loader_alone_ns" else f"{t2[key] / base:.1f}x"
            L.append(f"| {label} | {fmt_ns(t2[key])} | {rel} |")
        L.append("")
        L.append(f"Loader runs: node A {t2['node_a_loader_runs']}, node B "
                 f"{t2['node_b_loader_runs']} (it counted {t2['node_b_t2_hits']} tier-2 "
                 f"hits). {t2['note']}.")
    L.append("")
    return L


def _md_layout(out: Dict[str, Any]) -> List[str]:
    """The segment's control region against its data region, for a few configurations."""
    lay = out.get("layout")
    if not lay:
        return []
    L = ["## Control region vs data region (4 KiB slots)", ""]
    L.append("| config | control region | of which SlotMeta | prefetch rings | bucket heads | data region | control / data |")
    L.append("|---|---|---|---|---|---|---|")
    for k, v in lay.items():
        L.append(f"| {k} | {v['control_bytes'] / 2**20:.2f} MiB | {v['meta_bytes'] / 2**20:.2f} MiB | "
                 f"{v['ring_bytes'] / 2**20:.2f} MiB | {v['bucket_bytes'] / 2**20:.2f} MiB | "
                 f"{v['data_bytes'] / 2**20:.0f} MiB | {v['pct']}% |")
    L.append("")
    return L


def _md_readme_tables(out: Dict[str, Any]) -> List[str]:
    """The README's tables, generated here so they can be copied from a real run."""
    rt = readme_tables(out)
    if not rt:
        return []
    return ["## The README's tables (generated from this run)", ""] + rt


def _md_method() -> List[str]:
    """How it is measured: fixed text, the same for every run."""
    L = ["## How it is measured", ""]
    L.append("- Same payload bytes, key sets (16-byte ids, `bench/common.py`) and process counts for "
             "every system; processes are forked and start together at a barrier; multi-process "
             "throughput is the sum over processes of ops / own elapsed time.")
    L.append("- The old design (`bench/baselines/oldlock.c`) is TransBuffer's locking rebuilt on "
             "ucmcache's segment layout: a robust process-shared adaptive mutex per bucket taken on "
             "every lookup, a process-shared spin lock per slot taken for each chain node inspected "
             "and around every reference change and ready read, one global allocation lock with a "
             "global CLOCK hand, lock arrays packed as in TransBuffer. Through Python (cffi API "
             "mode, as ucmcache's core) a hit makes two cffi calls (get, close; a batch: one or "
             "two) from a lean Python handle; ucmcache's hit makes none (its hit path is CPython "
             "types in C, `ucmcache._hit`, calling the same core); a miss allocates inside the old "
             "design's one get call, whereas ucmcache's slow path is several C steps driven from "
             "Python (DESIGN 3).")
    L.append("- LMDB: `sync=False, metasync=False` in a temporary directory; diskcache likewise in a "
             "temporary directory; Redis: a private `redis-server` on a unix socket with "
             "persistence off, client redis-py with hiredis.")
    L.append("- Floors: the C floor (`bench/floor.c`, gcc -O2, includes `csrc/ucm_core.c`) runs the "
             "same protocol steps with no Python; the Python floor is an empty context manager "
             "object plus the same number of no-op cffi calls. Their gap to the ucmcache rows is the "
             "Python layer's cost.")
    L.append("- The machine is shared (2 cores; other work may run): load averages are recorded above.")
    L.append("")
    return L


# ====================================================================== the README's tables


_README_READS = [
    # (what a user writes, ucmcache row, the other row, ratio, target ratio name or None)
    ("per key: `with c.get(k) as h: h.data[0]` vs `with env.begin(buffers=True) as t: "
     "t.get(k)[0]`", "read.ucm", "read.lmdb", "read_vs_lmdb"),
    ("per key: `c.get_or_load(k, loader)` on a hit vs `with env.begin() as t: t.get(k)` "
     "(bytes)", "gol.ucm", "gol.lmdb", "gol_vs_lmdb"),
    ("64 keys: `with c.get_many(b) as hb:` + `hb.data(i)[0]` for each vs one txn, 64 "
     "`get(k)[0]`", "gmdata.ucm", "gmdata.lmdb", "gmdata_vs_lmdb"),
    ("64 keys into a (64, value) uint8 array: `get_many` + `hb.gather(out)` vs one txn, 64 gets "
     "copied into it", "gather.ucm", "copy.lmdb", "gather_vs_lmdb"),
    ("the same with `c.read_many(b, out)`", "read_many.ucm", "copy.lmdb", "read_many_vs_lmdb"),
    ("`gather` vs the memcpy floor, numpy copying the same slots (here x = gather's time / "
     "the floor's: lower is better)", "gather.ucm", "copy.floor", "gather_over_floor"),
    ("`read_many` vs the memcpy floor (x = read_many's time / the floor's)", "read_many.ucm",
     "copy.floor", "read_many_over_floor"),
    ("stricter than asked: `gather` vs a C memcpy floor (one cffi call, 64 `memcpy`)",
     "gather.ucm", "copy.cfloor", "gather_over_cfloor"),
    ("stricter: `read_many` vs the C memcpy floor", "read_many.ucm", "copy.cfloor",
     "read_many_over_cfloor"),
    ("per key: `await c.aget_or_load(k, loader)` on a hit vs `get_or_load` (x = async time / "
     "sync time)", "agol.ucm", "gol.ucm", "agol_over_gol"),
    ("per key: the read above vs the old design's wrapper, same code", "read.ucm", "read.old",
     "read_vs_old"),
    ("per key, **pin only**: `with c.get(k): pass` vs the old design's", "pin.ucm", "pin.old",
     "pin_vs_old"),
    ("Python floor: an empty context manager + 2 no-op cffi calls, vs py-lmdb's read",
     "read.floor", "read.lmdb", "floor_vs_lmdb_read"),
    ("Python floor + a slice of a memoryview and `[0]` (the read itself), vs py-lmdb's read",
     "read.floor_view", "read.lmdb", "floorview_vs_lmdb_read"),
]


def readme_tables(out: Dict[str, Any]) -> List[str]:
    """The README's benchmark tables, every ratio a median [min-max] (scenario 7 over its
    repetitions, the others over the passes)."""
    L: List[str] = []
    s7 = _get(out, "s7_reads", "by_size", default={})
    goals = {n: (g, op) for n, g, op, _ in READ_TARGETS}
    if s7:
        L.append("| what a user writes (4 KiB values unless said) | ucmcache | the other | "
                 "x, 4 KiB | x, 64 KiB | target (4 KiB) | met |")
        L.append("|---|---|---|---|---|---|---|")
        for what, u, o, ratio in _README_READS:
            ru, ro_ = _get(s7, "4096", "rows", u), _get(s7, "4096", "rows", o)
            r4, r64 = _get(s7, "4096", "ratios", ratio), _get(s7, "65536", "ratios", ratio)
            goal = goals.get(ratio)
            tgt = f"{goal[1]} {goal[0]:g}x" if goal else ""
            met = ""
            if goal and r4:
                ok = r4["median"] >= goal[0] if goal[1] == ">=" else r4["median"] <= goal[0]
                met = "yes" if ok else "**no**"
            cell = (lambda r: fmt_ns_range(r["median"], r["min"], r["max"]) if r else "—")
            L.append(f"| {what} | {cell(ru)} | {cell(ro_)} | {_rx(r4)} | {_rx(r64)} | {tgt} | "
                     f"{met} |")
        L.append("")
    R = out.get("ratios", {})
    if not R.get("s1_hit_p50") and not R.get("s2_exist"):
        return L

    def X(*path):
        return fmt_xr(out, *path)
    order = ["ucmcache", "old", "lmdb", "redis", "manager", "diskcache"]
    npass = _get(out, "meta", "repeat", default=1)
    L.append(f"| scenario (median of {npass} pass{'es' if npass != 1 else ''}) | " +
             " | ".join(LABELS[s] for s in order) + " |")
    L.append("|---|" + "---|" * len(order))
    s1 = _get(out, "s1_hit", "by_size", "4096", default={})
    L.append("| 1. hit, **pin only** (`with get(k): pass`), 4 KiB, p50 | " + " | ".join(
        ("—" if not _get(s1, s, "p50_ns") else fmt_ns(_get(s1, s, "p50_ns")) +
         ("" if s == "ucmcache" else f" ({X('s1_hit_p50', '4096', s)})")) for s in order) + " |")
    s2 = _get(out, "s2_batch", "systems", default={})
    for key, rk, title in (("exist_per_key", "s2_exist", "2. batch `exist`, 64 keys, per key"),
                           ("get_many_per_key", "s2_get_many",
                            "2. batch `get_many` + release, **pin only**, per key")):
        L.append(f"| {title} | " + " | ".join(
            ("—" if not _get(s2, s, key, "mean_ns") else fmt_ns(_get(s2, s, key, "mean_ns")) +
             ("" if s == "ucmcache" else f" ({X(rk, s)})")) for s in order) + " |")
    s3 = _get(out, "s3_mix", "by_size", "4096", "systems", default={})
    L.append("| 3. 95% hits, 2 processes, 4 KiB, ops/s | " + " | ".join(
        ("—" if not _get(s3, s, "2p", "ops_per_s") else fmt_ops(_get(s3, s, "2p", "ops_per_s")) +
         ("" if s == "ucmcache" else f" ({X('s3_mix_2p', '4096', s)})")) for s in order) + " |")
    s4 = _get(out, "s4_flight", "systems", default={})
    L.append("| 4. cold single flight, 4 procs: loader runs | " + " | ".join(
        str(_get(s4, s, "loader_runs", default="—")) for s in order) + " |")
    L.append("| 4. waiter wake p50 | " + " | ".join(
        ("—" if _get(s4, s, "wake_p50_us") is None else fmt_us(_get(s4, s, "wake_p50_us")) +
         ("" if s == "ucmcache" else f" ({X('s4_wake_p50', s)}{', polls' if s == 'old' else ''})"))
        for s in order) + " |")
    for title, key, ratio, fmt in (
            ("4. waiter wake p99", "wake_p99_us", "p99", fmt_us),
            ("4. waiter CPU per wake-up", "waiter_cpu_us", "waiter_cpu", fmt_us),
            ("4. p99 x waiter CPU per wake-up (µs², lower is better)", "p99_x_cpu_us2",
             "p99_x_cpu", lambda v: f"{v:,.0f}")):
        L.append(f"| {title} | " + " | ".join(
            ("—" if _get(s4, s, key) is None else fmt(_get(s4, s, key)) +
             ("" if s == "ucmcache" else f" ({X('s4_flight', ratio, s)})")) for s in order) + " |")
    s5 = _get(out, "s5_churn", "by_size", "4096", "systems", default={})
    L.append("| 5. churn, working set 4x capacity, 4 KiB, ops/s | " + " | ".join(
        ("—" if not _get(s5, s, "ops_per_s") else "does not evict" if s in ("lmdb", "manager")
         else fmt_ops(_get(s5, s, "ops_per_s")) +
         ("" if s == "ucmcache" else f" ({X('s5_churn', '4096', s)})")) for s in order) + " |")
    s9 = _get(out, "s9_cold", "systems", default={})
    if s9:
        L.append("| 9. cold `get_or_load` of 4 KiB, full cache (evicts; py-lmdb: get, then put), "
                 "p50 | " + " | ".join(
                     ("—" if _get(s9, s, "cold", "p50_ns") is None else
                      fmt_ns(_get(s9, s, "cold", "p50_ns")) +
                      ("" if s == "ucmcache" else f" ({X('s9_cold', 'p50_ns', s)})"))
                     for s in order) + " |")
    L.append("")
    return L


# ====================================================================== chart


def draw_chart(out: Dict[str, Any], path: str) -> Tuple[bool, str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as e:
        return False, f"matplotlib unavailable ({type(e).__name__}: {e}); chart skipped"
    panels = []
    s1 = _get(out, "s1_hit", "by_size", "4096", default={})
    if s1:
        panels.append(("1. hit p50, 4 KiB (ns, lower is better)",
                       {s: _get(s1, s, "p50_ns") for s in ORDER if s in s1}, True))
    s2 = _get(out, "s2_batch", "systems", default={})
    if s2:
        panels.append(("2. batch exist, ns/key (lower is better)",
                       {s: _get(s2, s, "exist_per_key", "mean_ns") for s in ORDER if s in s2}, True))
        panels.append(("2. batch get_many, ns/key (lower is better)",
                       {s: _get(s2, s, "get_many_per_key", "mean_ns") for s in ORDER if s in s2}, True))
    s3 = _get(out, "s3_mix", "by_size", "4096", "systems", default={})
    if s3:
        panels.append(("3. 95/5 mix, 2 procs, 4 KiB (ops/s, higher is better)",
                       {s: _get(s3, s, "2p", "ops_per_s") for s in ORDER if s in s3}, True))
    s4 = _get(out, "s4_flight", "systems", default={})
    if s4:
        panels.append(("4. single-flight wake p50 (µs, lower is better)",
                       {s: _get(s4, s, "wake_p50_us") for s in ORDER if s in s4}, True))
    s5 = _get(out, "s5_churn", "by_size", "4096", "systems", default={})
    if s5:
        panels.append(("5. churn, 2 procs, 4 KiB (ops/s, higher is better)",
                       {s: _get(s5, s, "ops_per_s") for s in ORDER if s in s5}, True))
    if not panels:
        return False, "nothing to chart"
    cols = 3
    rows = (len(panels) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(15, 4.2 * rows))
    axes = axes.flatten() if hasattr(axes, "flatten") else [axes]
    colors = {"ucmcache": "#1f77b4", "old": "#ff7f0e", "lmdb": "#2ca02c", "redis": "#d62728",
              "manager": "#9467bd", "diskcache": "#8c564b"}
    for ax, (title, data, logy) in zip(axes, panels):
        names = [n for n, v in data.items() if v]
        vals = [data[n] for n in names]
        bars = ax.bar(range(len(names)), vals, color=[colors.get(n, "gray") for n in names])
        ax.set_xticks(range(len(names)))
        ax.set_xticklabels([LABELS[n].replace(" (Python API)", "").replace(" (unix socket)", "")
                            for n in names], rotation=25, ha="right", fontsize=8)
        ax.set_title(title, fontsize=10)
        if logy:
            ax.set_yscale("log")
        for b, v in zip(bars, vals):
            ax.annotate(f"{v:,.3g}", (b.get_x() + b.get_width() / 2, v), ha="center",
                        va="bottom", fontsize=7)
    for ax in axes[len(panels):]:
        ax.axis("off")
    m = out["meta"]
    fig.suptitle(f"ucmcache vs baselines — one run, {m['started']} ({m['cores']} cores)"
                 f"{' — QUICK' if m.get('quick') else ''}", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return True, ""


# ====================================================================== finish


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def merge_passes(vals: List[Any], how: str = "median") -> Any:
    """One structure from several passes' structures of the same shape: a numeric leaf becomes
    the median over the passes (how="median") or [min, max] (how="range"); anything else is
    the first pass's.  Keys missing from some passes merge over the passes that have them (an
    error in any pass stays visible)."""
    first = vals[0]
    if isinstance(first, dict):
        keys = list(first)
        for v in vals[1:]:
            if isinstance(v, dict):
                keys += [k for k in v if k not in keys]
        return {k: merge_passes([v[k] for v in vals if isinstance(v, dict) and k in v], how)
                for k in keys}
    nums = [v for v in vals if _is_num(v)]
    if not nums or not _is_num(first):
        return first if how == "median" else None
    if how == "range":
        return [min(nums), max(nums)]
    if all(isinstance(v, int) for v in nums):
        return statistics.median_low(nums)
    return round(statistics.median(nums), 4)


def finish(out: Dict[str, Any], outdir: str, chart: bool = True,
           passes: Optional[List[Dict[str, Any]]] = None) -> None:
    """passes: the scenario 1-6 results of each pass (run.py --repeat): their figures are
    merged into out as medians, each ratio computed per pass and reported as median [min-max]."""
    os.makedirs(outdir, exist_ok=True)
    if passes:
        out.update(merge_passes(passes))
        per_pass = [compute_ratios(p) for p in passes]
        out["ratios"] = merge_passes(per_pass)
        if len(passes) > 1:
            out["ratio_ranges"] = merge_passes(per_pass, "range")
            out["passes"] = passes
    else:
        out["ratios"] = compute_ratios(out)
    out["targets"] = compute_targets(out, out["ratios"])
    out["targets_reads"] = compute_read_targets(out)
    out["targets_arenas"] = compute_arena_targets(out)
    png = os.path.join(outdir, "latest.png")
    if chart:
        ok, why = draw_chart(out, png + ".tmp.png")
        if ok:
            os.replace(png + ".tmp.png", png)
            out["chart"] = "latest.png"
        else:
            out["chart"] = None
            out["chart_skipped"] = why
    md = markdown(out)
    if out.get("chart"):
        md += "\n![ucmcache vs baselines](latest.png)\n"
    elif out.get("chart_skipped"):
        md += f"\nChart: {out['chart_skipped']}\n"
    for name, text in (("latest.json", json.dumps(out, indent=1, sort_keys=False, default=str)),
                       ("latest.md", md)):
        tmp = os.path.join(outdir, name + ".tmp")
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, os.path.join(outdir, name))
