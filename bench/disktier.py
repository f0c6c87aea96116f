"""The disk tier: its read and write GB/s against a plain syscall floor of the same
files in the same run, the index scan's rate (the rebuild at start), and a trace 10x the
segment's size with and without the tier.

    ./scripts/bench --disktier [--runs 3] [--sizes 65536,1048576] [--total-mb 128]
                               [--scan-files 50000] [--dir DIR] [--trace-requests 40000]

Write: N blocks of one size through ``DiskTier`` (the write-through path: copy, queue, writer
thread, header + CRC-32C, temporary file, rename, the shared usage record under flock) against
the floor: the same number of files of the same size made by a plain ``open`` + ``os.pwrite``
+ ``close`` loop.  Read: the same blocks through the tier's read path as a get's owner uses it
(``_read_many`` of one key: the read pool, open + fstat + preadv, header and CRC check) against
``open`` + ``os.preadv`` + ``close`` of the floor's files.  No fsync on either side, and no
cache dropping on a shared machine: both sides run against the page cache of the same
filesystem, so the ratio is the tier's software cost over the syscalls it cannot avoid.  Each
figure is the median [min-max] of --runs passes; each ratio is taken within a pass, reported
as the median [min-max] of the passes' ratios.

Scan: --scan-files block files of 4 KiB, then ``DiskTier.files()`` (what an eviction pass or a
missing usage record does) timed, median of --runs; files/s and the time this rate gives for 1M.

Trace: Zipf(0.9) over keys whose bytes are 10x the segment's (a segment of 4 ranks x 64 slots
of 16 KiB; 2,560 keys; --trace-requests requests; fixed seed), one process, get_or_load with a
loader that makes the payload: hit rate at the segment, hits from the disk, and loader runs,
without and with a DiskTier large enough for every key.  Counts, not times: they depend only on
the seeds (every value returned is checked against its key).  The loader here costs nothing,
so the tier's writer is flushed after each load: otherwise a key evicted from the segment and
asked again before its write-through landed (about a millisecond of file creation on a busy
disk) is loaded again, and the counts would measure the writer's lag, not the tier.  With a
real loader (a prefill: milliseconds or more) the writer keeps up.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
import uuid as uuidlib
from typing import Dict, List

import numpy as np

from ucmcache import DiskTier, SlotCache

from .common import loadavg


def _cell(xs: List[float], fmt: str = "{:.2f}") -> str:
    return f"{fmt.format(statistics.median(xs))} [{fmt.format(min(xs))}-{fmt.format(max(xs))}]"


def _keys(n: int, seed: int) -> List[bytes]:
    rng = np.random.default_rng(seed)
    return [rng.bytes(16) for _ in range(n)]


def _write_floor(d: str, payloads: List[bytes]) -> float:
    t0 = time.perf_counter()
    for i, p in enumerate(payloads):
        fd = os.open(os.path.join(d, f"{i}.blk"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.pwrite(fd, p, 0)
        finally:
            os.close(fd)
    return time.perf_counter() - t0


def _read_floor(d: str, n: int, size: int) -> float:
    buf = bytearray(size)
    t0 = time.perf_counter()
    for i in range(n):
        fd = os.open(os.path.join(d, f"{i}.blk"), os.O_RDONLY)
        try:
            os.preadv(fd, [buf], 0)
        finally:
            os.close(fd)
    return time.perf_counter() - t0


def _io_pass(base: str, size: int, total: int, seed: int) -> Dict[str, float]:
    n = max(1, total // size)
    keys = _keys(n, seed)
    payloads = [np.random.default_rng(seed + i).bytes(size) for i in range(min(n, 8))]
    payloads = [payloads[i % len(payloads)] for i in range(n)]
    floor_dir = os.path.join(base, f"floor-{seed}")
    os.makedirs(floor_dir)
    tier = DiskTier(os.path.join(base, f"tier-{seed}"), 1 << 62, timeout=60.0,
                    max_pending_bytes=1 << 40)
    for i in range(256):  # the steady state: the fan-out directories exist (the floor's does)
        os.makedirs(os.path.join(tier._blocks, f"{i:02x}"), exist_ok=True)
    try:
        fw = _write_floor(floor_dir, payloads)
        t0 = time.perf_counter()
        for k, p in zip(keys, payloads):
            tier._put(k, 0, memoryview(p))
        if not tier.flush(600):
            raise RuntimeError("the tier's writer did not finish")
        tw = time.perf_counter() - t0
        fr = _read_floor(floor_dir, n, size)
        t0 = time.perf_counter()
        for k in keys:
            (p,) = tier._read_many([(k, 0)], size, None)
            if p is None:
                raise RuntimeError("a block written was not read back")
        tr = time.perf_counter() - t0
    finally:
        tier.close()
        shutil.rmtree(floor_dir, ignore_errors=True)
        shutil.rmtree(os.path.join(base, f"tier-{seed}"), ignore_errors=True)
    gb = n * size / 1e9
    return {"tier_write": gb / tw, "floor_write": gb / fw, "tier_read": gb / tr,
            "floor_read": gb / fr}


def _scan(base: str, n: int, runs: int) -> List[float]:
    tier = DiskTier(os.path.join(base, "scan"), 1 << 62)
    blocks = tier._blocks
    body = b"\0" * 4096
    for i in range(n):
        k = i.to_bytes(2, "little") + os.urandom(14)
        path = tier._path_of(k, 0)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
        except FileNotFoundError:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
        os.write(fd, body)
        os.close(fd)
    rates = []
    for _ in range(runs):
        t0 = time.perf_counter()
        found = len(tier.files())
        rates.append(found / (time.perf_counter() - t0))
    assert found == n, (found, n)
    shutil.rmtree(os.path.dirname(blocks), ignore_errors=True)
    return rates


def _trace(base: str, requests: int, with_tier: bool) -> Dict[str, int]:
    slot, ranks, per_rank = 16384, 4, 64
    n_keys = ranks * per_rank * 10  # 10x the segment
    keys = _keys(n_keys, 7)
    rng = np.random.default_rng(11)
    w = 1.0 / np.arange(1, n_keys + 1) ** 0.9
    order = rng.choice(n_keys, size=requests, p=w / w.sum())
    u = f"bench-disk-{os.getpid()}-{uuidlib.uuid4().hex[:8]}"
    tier = DiskTier(os.path.join(base, "trace"), 1 << 40) if with_tier else None
    c = SlotCache.create(u, slots_per_rank=per_rank, slot_size=slot, max_ranks=ranks,
                         tier2=tier)
    runs = 0
    try:
        def loader(k):
            nonlocal runs
            runs += 1
            return k * (slot // 16)
        for i in order.tolist():
            k = keys[i]
            before = runs
            v = c.get_or_load(k, lambda k=k: loader(k))
            if bytes(v[:16]) != k:
                raise RuntimeError("a value that is not its key's")
            del v
            if tier is not None and runs != before:
                tier.flush(60)  # see the module docs: the loader here costs nothing
        s = c.stats()
        disk = tier.stats()["t2_hits"] if tier is not None else 0
    finally:
        c.close()
        SlotCache.unlink(u)
        if tier is not None:
            tier.close()
            shutil.rmtree(os.path.join(base, "trace"), ignore_errors=True)
    return {"requests": requests, "keys": n_keys, "distinct": len(set(order.tolist())),
            "segment_hits": s["hits"], "disk_hits": disk, "loader_runs": runs}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--sizes", default="65536,1048576")
    ap.add_argument("--total-mb", type=int, default=128)
    ap.add_argument("--scan-files", type=int, default=50000)
    ap.add_argument("--trace-requests", type=int, default=40000)
    ap.add_argument("--dir", default=None, help="where the files go (default: a temporary "
                    "directory under $TMPDIR)")
    a = ap.parse_args(argv)
    base = tempfile.mkdtemp(prefix="ucm-bench-disk-", dir=a.dir)
    try:
        print(f"bench.disktier: {a.runs} runs, {a.total_mb} MiB per size per run, in {base}; "
              f"loadavg {loadavg()}")
        print("| block | tier write GB/s | floor write GB/s | write tier/floor | "
              "tier read GB/s | floor read GB/s | read tier/floor |")
        print("|---|---|---|---|---|---|---|")
        for size in (int(s) for s in a.sizes.split(",")):
            passes = [_io_pass(base, size, a.total_mb << 20, 100 + r) for r in range(a.runs)]
            col = {k: [p[k] for p in passes] for k in passes[0]}
            wr = [p["tier_write"] / p["floor_write"] for p in passes]
            rr = [p["tier_read"] / p["floor_read"] for p in passes]
            print(f"| {size} | {_cell(col['tier_write'])} | {_cell(col['floor_write'])} | "
                  f"{_cell(wr)} | {_cell(col['tier_read'])} | {_cell(col['floor_read'])} | "
                  f"{_cell(rr)} |", flush=True)
        if a.scan_files:
            rates = _scan(base, a.scan_files, a.runs)
            med = statistics.median(rates)
            print(f"\nscan (index rebuild): {a.scan_files} files, {_cell(rates, '{:.0f}')} "
                  f"files/s; 1M files: {1e6 / med:.1f} s at the median rate")
        print("\n| trace (Zipf 0.9, keys = 10x the segment) | requests | segment hits | "
              "disk hits | loader runs | distinct keys asked |")
        print("|---|---|---|---|---|---|")
        for with_tier in (False, True):
            t = _trace(base, a.trace_requests, with_tier)
            print(f"| {'with DiskTier' if with_tier else 'segment only'} ({t['keys']} keys) | "
                  f"{t['requests']} | {t['segment_hits']} ({t['segment_hits'] / t['requests']:.1%})"
                  f" | {t['disk_hits']} | {t['loader_runs']} | {t['distinct']} |", flush=True)
        print(f"\nloadavg after: {loadavg()}")
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
