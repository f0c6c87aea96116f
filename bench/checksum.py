"""The vLLM block format's checksum: CRC-32C in C (ucmcache.core.checksum) against zlib's CRC-32
(what the format used before) and a memcpy floor of the same bytes, in block-sized pieces.

    ./scripts/bench --checksum [--runs 5] [--sizes 32768,1048576] [--total-mb 256]

Per piece size: GB/s over --total-mb of random bytes held in memory, fed piece by piece, as a
load checks one block after another; median [min-max] of --runs, and the ratio of medians
against zlib's.  Then the copy the vLLM connector makes (ucmcache.core.copy.copy_segments: every
piece in one C call) without the CRC, with it folded into the copy's pass, and as two passes
(the copy, then crc32c over the copied bytes): what the checksum costs a block move.  Also under callgrind (instruction counts are repeatable here):
``valgrind --tool=callgrind python -m bench.checksum --runs 1 --total-mb 16``.
"""
import argparse
import statistics
import time
import zlib

import numpy as np

from ucmcache.core.checksum import crc32c, hardware
from ucmcache.core.copy import copy_segments


def _gbps(fn, pieces, nbytes: int) -> float:
    t0 = time.perf_counter()
    for p in pieces:
        fn(p)
    return nbytes / (time.perf_counter() - t0) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--sizes", default="32768,1048576")
    ap.add_argument("--total-mb", type=int, default=256)
    a = ap.parse_args()
    total = a.total_mb << 20
    data = np.random.default_rng(0).integers(0, 256, total, dtype=np.uint8)
    out = np.empty_like(data)
    out[:] = 0   # touched: the floor measures copies, not page faults
    print(f"bench.checksum: crc32c on the {'crc32 instruction' if hardware() else 'tables'}; "
          f"{a.total_mb} MiB per run, {a.runs} runs")
    copies = {}
    print("| piece | crc32c GB/s | zlib crc32 GB/s | memcpy floor GB/s | crc32c / zlib |")
    print("|---|---|---|---|---|")
    for size in (int(s) for s in a.sizes.split(",")):
        n = total // size
        pieces = [data[i * size:(i + 1) * size] for i in range(n)]
        outs = [out[i * size:(i + 1) * size] for i in range(n)]
        res = {"crc32c": [], "zlib": [], "memcpy": []}
        for _ in range(a.runs):
            res["crc32c"].append(_gbps(crc32c, pieces, n * size))
            res["zlib"].append(_gbps(zlib.crc32, pieces, n * size))
            t0 = time.perf_counter()
            for src, dst in zip(pieces, outs):
                np.copyto(dst, src)
            res["memcpy"].append(n * size / (time.perf_counter() - t0) / 1e9)

        def cell(xs):
            return f"{statistics.median(xs):.2f} [{min(xs):.2f}-{max(xs):.2f}]"
        ratio = statistics.median(res["crc32c"]) / statistics.median(res["zlib"])
        print(f"| {size} | {cell(res['crc32c'])} | {cell(res['zlib'])} | "
              f"{cell(res['memcpy'])} | {ratio:.2f}x |", flush=True)
        copies[size] = _copies(data, out, size, n, a.runs, cell)
    print("\n| piece | segment copy GB/s | copy + CRC folded GB/s | copy, then CRC GB/s | "
          "folded / plain |\n|---|---|---|---|---|")
    for size, row in copies.items():
        print(f"| {size} | {row} |", flush=True)


def _copies(data, out, size: int, n: int, runs: int, cell) -> str:
    """copy_segments over n pieces of `size` bytes: plain, CRC folded, CRC in a second pass."""
    src = np.arange(n, dtype=np.uint64) * np.uint64(size) + np.uint64(data.ctypes.data)
    dst = np.arange(n, dtype=np.uint64) * np.uint64(size) + np.uint64(out.ctypes.data)
    lens = np.full(n, size, dtype=np.uint64)
    res = {"plain": [], "folded": [], "two": []}
    for _ in range(runs):
        t0 = time.perf_counter()
        copy_segments(dst, src, lens)
        res["plain"].append(n * size / (time.perf_counter() - t0) / 1e9)
        crcs = np.zeros(n, dtype=np.uint32)
        t0 = time.perf_counter()
        copy_segments(dst, src, lens, crcs)
        res["folded"].append(n * size / (time.perf_counter() - t0) / 1e9)
        t0 = time.perf_counter()
        copy_segments(dst, src, lens)
        for i in range(n):
            crc32c(out[i * size:(i + 1) * size])
        res["two"].append(n * size / (time.perf_counter() - t0) / 1e9)
    ratio = statistics.median(res["folded"]) / statistics.median(res["plain"])
    return (f"{cell(res['plain'])} | {cell(res['folded'])} | {cell(res['two'])} | "
            f"{ratio:.2f}x")


if __name__ == "__main__":
    main()
