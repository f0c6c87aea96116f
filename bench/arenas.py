"""Scenario 8: hit rate at equal memory.

One Zipf trace (cfg["s8_requests"] requests over cfg["s8_keys"] keys, exponent cfg["s8_zipf"],
fixed seed) is walked in order against one segment of max_ranks x slots_per_rank slots with k
of its ranks attached, each request sent to one attached rank's `get_or_load`; and against a
global LRU (an OrderedDict) holding the same number of slots, max_ranks x slots_per_rank.  The
figure is ucmcache's hits / the LRU's hits (the same requests, so also the ratio of hit ratios):
the memory is the same in every row, and what changes is how many ranks can allocate from it.

Rows (ranks attached of max_ranks): 8 of 8, 4 of 8, 2 of 8, 1 of 8 with requests spread
uniformly over the attached ranks, and 4 of 8 with 70% of the requests on the first rank and the
rest uniform over the other three.  Target: >= 0.97 in every row.

Everything runs in one process: the k caches are k `SlotCache` instances on one uuid (each takes
its own rank), so the result depends only on the build and the seeds, and one run is enough.  A
hit is a request whose loader did not run; every returned value is checked against the key's
payload, and a wrong one fails the row (a value returned without its loader running is a false
hit).  Requests/s per row is reported for information only.

    .venv/bin/python -m bench.arenas            # this scenario alone, prints the table
    .venv/bin/python -m bench.arenas --quick    # tiny sizes
    ./scripts/bench --scenarios 8               # the same through the bench (writes results/)
"""
from __future__ import annotations

import argparse
import sys
import time
import traceback
from collections import OrderedDict
from typing import Any, Callable, Dict, List, Optional, Sequence

import numpy as np

from . import common

# Sizes, merged into bench.run's FULL and QUICK (here so that running this file alone needs
# nothing from run.py): a Zipf trace over max_ranks x slots_per_rank slots.
FULL = {"s8_requests": 200_000, "s8_keys": 20_000, "s8_zipf": 0.9, "s8_max_ranks": 8,
        "s8_slots_per_rank": 500}
QUICK = {"s8_requests": 5000, "s8_keys": 1000, "s8_zipf": 0.9, "s8_max_ranks": 8,
         "s8_slots_per_rank": 25}
TARGET = 0.97
SLOT_SIZE = 64  # small: this measures hit rate, not bytes
TRACE_SEED = 1515
RANK_SEED = 1500  # + the row's index: each row its own fixed assignment

# (row id, label, ranks attached, share of the requests on the first rank; None: uniform)
ROWS = [
    ("8of8", "8 of 8", 8, None),
    ("4of8", "4 of 8", 4, None),
    ("2of8", "2 of 8", 2, None),
    ("1of8", "1 of 8", 1, None),
    ("4of8_skew70", "4 of 8, 70% of requests on one rank", 4, 0.7),
]


class WrongValue(AssertionError):
    """get_or_load returned bytes that are not the key's payload."""


# ====================================================================== the trace


def zipf_trace(n_requests: int, n_keys: int, s: float, seed: int) -> List[int]:
    """Key indices drawn from a bounded Zipf(s) over n_keys (index 0 the most popular).  numpy's
    own zipf needs s > 1 and is unbounded, so the probabilities are made here."""
    w = 1.0 / np.arange(1, n_keys + 1, dtype=np.float64) ** s
    rng = np.random.default_rng(seed)
    return rng.choice(n_keys, size=n_requests, p=w / w.sum()).tolist()


def assign_ranks(n_requests: int, k: int, first_share: Optional[float], seed: int) -> List[int]:
    """Which attached cache (0..k-1) serves each request: uniform, or first_share of them on
    cache 0 and the rest uniform over the others."""
    rng = np.random.default_rng(seed)
    if first_share is None or k == 1:
        return rng.integers(0, k, size=n_requests).tolist()
    on_first = rng.random(n_requests) < first_share
    others = rng.integers(1, k, size=n_requests)
    return np.where(on_first, 0, others).tolist()


def payload_of(key: bytes) -> bytes:
    """A key's value: derived from the key, so a value of another key is caught."""
    return key * 3  # 48 bytes, fits a 64-byte slot


def lru_hits(trace: Sequence[int], capacity: int) -> int:
    """Hits of a global LRU of `capacity` entries on the trace (ranks do not matter to it)."""
    lru: "OrderedDict[int, None]" = OrderedDict()
    hits = 0
    for k in trace:
        if k in lru:
            lru.move_to_end(k)
            hits += 1
        else:
            lru[k] = None
            if len(lru) > capacity:
                lru.popitem(last=False)
    return hits


# ====================================================================== one row


class _Loader:
    """The loader of every request: returns key i's payload and counts its runs (a request
    whose loader did not run is a hit).  One object, its index set before each request,
    instead of a closure per request."""

    __slots__ = ("payloads", "i", "calls")

    def __init__(self, payloads: Sequence[bytes]):
        self.payloads = payloads
        self.i = 0
        self.calls = 0

    def __call__(self) -> bytes:
        self.calls += 1
        return self.payloads[self.i]


def _walk(caches: list, trace: Sequence[int], ranks: Sequence[int], keys: Sequence[bytes],
          payloads: Sequence[bytes], label: str) -> int:
    """Send every request to its cache's get_or_load, checking each value; the loader's runs."""
    gols = [c.get_or_load for c in caches]
    ld = _Loader(payloads)
    for n, (ki, r) in enumerate(zip(trace, ranks)):
        ld.i = ki
        before = ld.calls
        v = gols[r](keys[ki], ld)
        if v != payloads[ki]:
            what = "FALSE HIT (the loader did not run)" if ld.calls == before else \
                "wrong value after the loader ran"
            raise WrongValue(f"{label}: request {n}, key #{ki} {keys[ki].hex()} on rank "
                             f"{caches[r].rank}: {what}: got {bytes(v).hex()} ({len(v)} B), "
                             f"want {payloads[ki].hex()} ({len(payloads[ki])} B)")
    return ld.calls


def run_row(uuid: str, k: int, trace: Sequence[int], ranks: Sequence[int],
            keys: Sequence[bytes], payloads: Sequence[bytes], max_ranks: int,
            slots_per_rank: int, label: str) -> Dict[str, Any]:
    """One segment, k caches attached on it in this process; the trace walked once."""
    from ucmcache import SegmentNotFound, SlotCache, verify

    caches: list = []
    try:
        caches.append(SlotCache.create(uuid, max_ranks=max_ranks, slots_per_rank=slots_per_rank,
                                       slot_size=SLOT_SIZE))
        for _ in range(k - 1):
            caches.append(SlotCache.attach(uuid))
        t0 = time.perf_counter_ns()
        calls = _walk(caches, trace, ranks, keys, payloads, label)
        elapsed = (time.perf_counter_ns() - t0) / 1e9
        st = caches[0].stats()
        rep = verify(uuid)  # the walk left the segment consistent (cheap at this size)
        if not rep.ok:
            raise RuntimeError(f"{label}: {rep}")
        return {"loader_calls": calls, "elapsed_s": round(elapsed, 3),
                "requests_per_s": round(len(trace) / elapsed) if elapsed > 0 else None,
                "attached_ranks": [c.rank for c in caches],
                "stats": {n: st[n] for n in ("hits", "misses", "bypasses", "evictions",
                                             "entries")},
                "verify_ok": rep.ok}
    finally:
        try:
            for c in reversed(caches):
                c.close()
        finally:  # the segment goes even if a close failed
            try:
                SlotCache.unlink(uuid)
            except SegmentNotFound:
                pass


# ====================================================================== the scenario


def measure(cfg: Dict[str, Any], new_uuid: Callable[[], str],
            log: Callable[[str], None]) -> Dict[str, Any]:
    """Every row of the scenario; a row that fails is recorded with its error (and `error` set
    at the top), the others still run."""
    n_req, n_keys, s = cfg["s8_requests"], cfg["s8_keys"], cfg["s8_zipf"]
    max_ranks, spr = cfg["s8_max_ranks"], cfg["s8_slots_per_rank"]
    t_all = time.monotonic()
    keys = common.keys(n_keys, seed=common.KEY_SEED + 8)
    payloads = [payload_of(k) for k in keys]
    trace = zipf_trace(n_req, n_keys, s, TRACE_SEED)
    capacity = max_ranks * spr
    lru = lru_hits(trace, capacity)  # the same for every row: the key sequence is the same
    res: Dict[str, Any] = {
        "requests": n_req, "keys": n_keys, "zipf_s": s, "max_ranks": max_ranks,
        "slots_per_rank": spr, "slot_size": SLOT_SIZE, "lru_capacity": capacity,
        "lru_hits": lru, "lru_hit_ratio": round(lru / n_req, 4), "target": TARGET,
        "seeds": {"trace": TRACE_SEED, "ranks": RANK_SEED, "keys": common.KEY_SEED + 8},
        "distinct_keys_requested": len(set(trace)), "rows": [],
    }
    log(f"[8 arenas] {n_req:,} requests over {n_keys:,} keys, Zipf({s}); global LRU of "
        f"{capacity} slots: {lru:,} hits ({lru / n_req:.4f})")
    for i, (rid, label, k, share) in enumerate(ROWS):
        ranks = assign_ranks(n_req, k, share, RANK_SEED + i)
        busiest = int(np.bincount(ranks, minlength=k).max())
        row: Dict[str, Any] = {"id": rid, "label": label, "ranks_attached": k,
                               "first_rank_share": share, "busiest_rank_requests": busiest,
                               "busiest_rank_share": round(busiest / n_req, 4)}
        try:
            row.update(run_row(new_uuid(), k, trace, ranks, keys, payloads, max_ranks, spr,
                               label))
            hits = n_req - row["loader_calls"]
            row.update(hits=hits, hit_ratio=round(hits / n_req, 4),
                       ratio=round(hits / lru, 4) if lru else None)
            row["met"] = None if row["ratio"] is None else hits / lru >= TARGET
            log(f"[8 arenas] {label:<36} hit ratio {hits / n_req:.4f}, LRU {lru / n_req:.4f}, "
                f"ucmcache/LRU {row['ratio']:.3f} ({'met' if row['met'] else 'NOT met'}); "
                f"{row['loader_calls']:,} loader calls; {row['requests_per_s'] / 1e3:.0f} k req/s")
        except Exception as e:
            row["error"] = f"{type(e).__name__}: {e}"
            row["trace"] = traceback.format_exc()[-2000:]
            res.setdefault("error", row["error"])  # the first: later rows may only echo it
            log(f"[8 arenas] {label} ERROR {row['error']}")
        res["rows"].append(row)
    res["wall_s"] = round(time.monotonic() - t_all, 1)
    log(f"[8 arenas] done in {res['wall_s']} s")
    return res


def scenario8(env, cfg: Dict[str, Any], out: Dict[str, Any], log: Callable[[str], None]) -> None:
    """bench.run's entry: segments named and tracked like the other scenarios' (env.cleanup()
    removes any left by an interruption)."""
    made: List[str] = []

    def new_uuid() -> str:
        uuid = f"bench-{env.tag}-{env.next_id()}"
        env.track_segment(uuid)
        made.append(uuid)
        return uuid
    out["s8_arenas"] = measure(cfg, new_uuid, log)
    for uuid in made:  # each row unlinked its own segment
        env.untrack_segment(uuid)


# ====================================================================== alone


def main(argv: Optional[List[str]] = None) -> int:
    """This scenario alone: prints the table (the bench's results/ are not touched)."""
    p = argparse.ArgumentParser(prog="python -m bench.arenas",
                                description="Scenario 8: hit rate at equal memory")
    p.add_argument("--quick", action="store_true", help="tiny sizes (the bench's --quick)")
    args = p.parse_args(argv)
    from bench import report

    cfg = QUICK if args.quick else FULL
    tag = common.tag()
    n = [0]

    def new_uuid() -> str:
        n[0] += 1
        return f"bench-arenas-{tag}-{n[0]}"
    res = measure(cfg, new_uuid, lambda m: print(m, flush=True))
    print()
    print("\n".join(report.arenas_table(res)))
    return 1 if res.get("error") else 0


if __name__ == "__main__":
    sys.exit(main())
