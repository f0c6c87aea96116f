"""Shared pieces of the benchmark: key sets, payloads, timing statistics, small helpers.

Key i of a key set is splitmix64(seed + 2i) || splitmix64(seed + 2i + 1), 16 bytes little endian,
the same formula as bench/floor.c, so every system (and the C floor) sees the same ids.
"""
from __future__ import annotations

import os
import time
from typing import Any, Dict, Iterable, List, Sequence

import numpy as np

KEY_SEED = 0x5EED
MASK64 = np.uint64(0xFFFFFFFFFFFFFFFF)


def _splitmix64(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        z = x + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def key_block(n: int, seed: int = KEY_SEED, start: int = 0) -> bytes:
    """n keys (16 bytes each) joined: keys start .. start+n-1 of the set `seed`."""
    i = np.arange(start, start + n, dtype=np.uint64)
    with np.errstate(over="ignore"):
        a = _splitmix64(np.uint64(seed) + np.uint64(2) * i)
        b = _splitmix64(np.uint64(seed) + np.uint64(2) * i + np.uint64(1))
    out = np.empty((n, 2), dtype="<u8")
    out[:, 0] = a
    out[:, 1] = b
    return out.tobytes()


def keys(n: int, seed: int = KEY_SEED, start: int = 0) -> List[bytes]:
    blk = key_block(n, seed, start)
    return [blk[16 * j:16 * j + 16] for j in range(n)]


def payload(size: int, tag: int = 1) -> bytes:
    """A deterministic payload of `size` bytes (same bytes for every system)."""
    rng = np.random.default_rng(1000 + tag)
    return rng.integers(0, 256, size=size, dtype=np.uint8).tobytes()


PAGE = 4096


def page_aligned(data: bytes) -> memoryview:
    """A read-only copy of data whose first byte starts a 4 KiB page: the source of the
    handle-style systems' payload copy in the mixes (h.data[:n] = src, ucmcache and the old
    design; the other systems hand the bytes to their own clients).  A bytes object's data sits
    wherever the heap put it, and that moves with the process's history, down to the lengths of
    its argv, environment and import paths: a 64 KiB copy from an address = 16 mod 32 ran ~15%
    slower here (AMD EPYC, glibc memcpy into a page-aligned slot) than one from a page start, and
    an A/A run of bench.ab measured that as new/base 0.84-0.89 at 64 KiB.  From a page start the
    source's alignment is the same in every run and on both sides of an A/B."""
    n = len(data)
    raw = np.empty(n + PAGE, dtype=np.uint8)
    off = (-raw.ctypes.data) % PAGE
    a = raw[off:off + n]
    a[:] = np.frombuffer(data, dtype=np.uint8)
    return memoryview(a).toreadonly()


def rng_indices(n: int, high: int, seed: int) -> List[int]:
    return np.random.default_rng(seed).integers(0, high, size=n).tolist()


def stats_ns(samples: Sequence[float], overhead: float = 0.0, div: float = 1.0) -> Dict[str, float]:
    """p50 / p99 / mean of samples (ns), minus a timer overhead, divided by div (per key)."""
    a = np.asarray(samples, dtype=np.float64)
    if a.size == 0:
        return {"p50_ns": None, "p99_ns": None, "mean_ns": None, "n": 0}
    a = np.maximum(a - overhead, 0.0) / div
    return {"p50_ns": round(float(np.percentile(a, 50)), 1),
            "p99_ns": round(float(np.percentile(a, 99)), 1),
            "mean_ns": round(float(a.mean()), 1), "n": int(a.size)}


def wake_orders(key_indexes: Sequence[int], latencies_ns: Sequence[int]) -> Dict[str, Any]:
    """Scenario 4's wake latencies by wake-up order: the waiters of one key all measure from its
    owner's one stamp, so sorting a key's latencies puts them in the order they returned.  The
    first woken of each key measures the wake-up itself; the second and third also wait for a
    CPU behind the ones woken before them (2 cores, the owner on one), so a p50 over every wait
    depends on how often two or three waiters met, which differs between systems and runs.
    {"by_order": {"1": {"waits", "p50_us"}, "2": ...}}, the comparison made like for like."""
    per_key: Dict[int, List[int]] = {}
    for k, lat in zip(key_indexes, latencies_ns):
        per_key.setdefault(k, []).append(lat)
    by_order: Dict[int, List[int]] = {}
    for lats in per_key.values():
        for order, lat in enumerate(sorted(lats), 1):
            by_order.setdefault(order, []).append(lat)
    return {"by_order": {str(o): {"waits": len(v),
                                  "p50_us": round(stats_ns(v)["p50_ns"] / 1000, 1)}
                         for o, v in sorted(by_order.items())}}


def timer_overhead(n: int = 20000) -> float:
    """Median cost of the timing scaffold used around one op (two perf_counter_ns and a store)."""
    pc = time.perf_counter_ns
    out = [0] * n
    for i in range(n):
        t0 = pc()
        out[i] = pc() - t0
    return float(np.median(out))


def cpu_clock_overhead(n: int = 2001) -> int:
    """Median CPU time of the waiter-CPU scaffold with no wait inside it: thread_time_ns, the
    wake-up's monotonic_ns stamp, thread_time_ns (subtracted from each waiter CPU sample)."""
    cpu, mono = time.thread_time_ns, time.monotonic_ns
    out = [0] * n
    for i in range(n):
        c0 = cpu()
        mono()
        out[i] = cpu() - c0
    return int(np.median(out))


def loop_overhead(seq: Sequence) -> float:
    """Per-iteration cost of an empty `for k in seq` loop (subtracted from bulk means)."""
    pc = time.perf_counter_ns
    t0 = pc()
    for _k in seq:
        pass
    return (pc() - t0) / max(1, len(seq))


def spin_ns(ns: int) -> None:
    """Busy work for about ns nanoseconds (a loader's cost; burns CPU like real work)."""
    end = time.perf_counter_ns() + ns
    pc = time.perf_counter_ns
    while pc() < end:
        pass


def tag() -> str:
    """A unique tag for segment / store names of this run."""
    return f"{os.getpid()}-{os.urandom(4).hex()}"


def loadavg() -> List[float]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


def chunks(seq: Sequence, n: int) -> Iterable[Sequence]:
    for i in range(0, len(seq), n):
        yield seq[i:i + n]
