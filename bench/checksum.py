"""The vLLM block format's checksum: CRC-32C in C (ucmcache._checksum) against zlib's CRC-32
(what the format used before) and a memcpy floor of the same bytes, in block-sized pieces.

    ./scripts/bench --checksum [--runs 5] [--sizes 32768,1048576] [--total-mb 256]

Per piece size: GB/s over --total-mb of random bytes held in memory, fed piece by piece, as a
load checks one block after another; median [min-max] of --runs, and the ratio of medians
against zlib's.  Also under callgrind (instruction counts are repeatable here):
``valgrind --tool=callgrind python -m bench.checksum --runs 1 --total-mb 16``.
"""
import argparse
import statistics
import time
import zlib

import numpy as np

from ucmcache._checksum import crc32c, hardware


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


if __name__ == "__main__":
    main()
