"""UcmCacheStore throughput: load and dump of 64 blocks of 1 MiB through the store, in
GB/s, against the memcpy floor, in one process.

    .venv/bin/python -m bench.ucm_store            # about 10 s
    .venv/bin/python -m bench.ucm_store --quick    # tiny sizes: checks the harness
    ./scripts/bench --ucm-store                    # the same, through the bench script

Rows (each a task of `blocks` blocks of `block` bytes, submit + wait; median and [min-max] over
--reps repetitions, the rows interleaved in each repetition):
  dump              one 1 MiB tensor per block: copied into owned slots, each block published
  dump_layers       8 tensors of 128 KiB per block (UCM's layers), end to end in the slot
  dump_present      the same blocks again: every block found stored and skipped (time only)
  load_contiguous   into one array of 64 rows: one read_many C call for the task
  load_scattered    into 64 separate 1 MiB arrays: read_many into staging, then a copy each
  load_layers       into 8 x 64 separate 128 KiB arrays: staging, then 512 copies
  memcpy_floor      one memcpy of the same 64 MiB (numpy copyto, GIL released)
  memcpy_floor_64   64 memcpys of 1 MiB (libc memcpy through cffi, as the store's copies)
Writes ucm_store.json and ucm_store.md to --out (default bench/results).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import statistics
import sys
import time
from typing import Callable, Dict, List

import numpy as np

_RUN_AS_MODULE = __package__ not in (None, "")
if not _RUN_AS_MODULE:  # run as a file: make ucmcache importable from the checkout
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ucmcache import SegmentNotFound, SlotCache  # noqa: E402
from ucmcache.ucm import UcmCacheStore  # noqa: E402
from ucmcache.engines.ucm.memory import _memcpy  # noqa: E402

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
LAYERS = 8


def _ids(tag: str, n: int) -> List[bytes]:
    return [hashlib.md5(f"{tag}-{i}".encode()).digest() for i in range(n)]


def run(blocks: int, block: int, reps: int) -> Dict[str, object]:
    uuid = f"bench-ucm-{os.getpid()}"
    cfg = {"unique_id": uuid, "device_id": 0, "shard_size": block, "block_size": block,
           "buffer_size": 2 * (2 * blocks + 8) * block, "ucmcache_max_ranks": 2,
           "share_buffer_enable": True}
    total = blocks * block
    rng = np.random.default_rng(0)
    src = rng.integers(0, 256, (blocks, block), dtype=np.uint8)
    src_layers = [[np.ascontiguousarray(src[i, j * (block // LAYERS):(j + 1) * (block // LAYERS)])
                   for j in range(LAYERS)] for i in range(blocks)]
    dst = np.zeros_like(src)
    dst_rows = [np.zeros(block, np.uint8) for _ in range(blocks)]
    dst_layers = [[np.zeros(block // LAYERS, np.uint8) for _ in range(LAYERS)]
                  for _ in range(blocks)]
    floor_dst = np.zeros_like(src)
    store = UcmCacheStore(cfg)
    ids = _ids("stored", blocks)
    try:
        store.wait(store.dump(ids, [0] * blocks, [[src[i]] for i in range(blocks)]))
        counter = [0]

        def fresh_dump(tensors) -> Callable[[], None]:
            def go():
                counter[0] += 1
                new = _ids(f"dump-{counter[0]}", blocks)
                store.wait(store.dump(new, [0] * blocks, tensors))
            return go

        def floor64():
            for i in range(blocks):
                _memcpy(floor_dst[i].ctypes.data, src[i].ctypes.data, block)

        rows: Dict[str, Callable[[], None]] = {
            "dump": fresh_dump([[src[i]] for i in range(blocks)]),
            "dump_layers": fresh_dump(src_layers),
            "dump_present": lambda: store.wait(store.dump(ids, [0] * blocks,
                                                          [[src[i]] for i in range(blocks)])),
            "load_contiguous": lambda: store.wait(store.load(ids, [0] * blocks,
                                                             [[dst[i]] for i in range(blocks)])),
            "load_scattered": lambda: store.wait(store.load(ids, [0] * blocks,
                                                            [[r] for r in dst_rows])),
            "load_layers": lambda: store.wait(store.load(ids, [0] * blocks, dst_layers)),
            "memcpy_floor": lambda: np.copyto(floor_dst, src),
            "memcpy_floor_64": floor64,
        }
        times: Dict[str, List[float]] = {name: [] for name in rows}
        for rep in range(reps + 1):           # repetition 0 warms pages and caches, untimed
            for name, fn in rows.items():
                if name in ("dump", "dump_layers"):  # untimed: room for new blocks, and
                    store.cache.clear()                # the blocks the loads read stored again
                    store.wait(store.dump(ids, [0] * blocks, [[src[i]] for i in range(blocks)]))
                t0 = time.perf_counter()
                fn()
                dt = time.perf_counter() - t0
                if rep:
                    times[name].append(dt)
        # correctness of what was measured
        assert np.array_equal(dst, src) and all(np.array_equal(r, src[i])
                                                for i, r in enumerate(dst_rows))
        assert all(np.array_equal(np.concatenate(dst_layers[i]), src[i]) for i in range(blocks))
    finally:
        store.close()
        try:
            SlotCache.unlink(uuid)
        except SegmentNotFound:
            pass
    out = {}
    for name, ts in times.items():
        med = statistics.median(ts)
        out[name] = {"seconds_median": med, "gb_s": total / med / 1e9,
                     "gb_s_min": total / max(ts) / 1e9, "gb_s_max": total / min(ts) / 1e9}
    floor = out["memcpy_floor"]["gb_s"]
    for name in out:
        out[name]["of_floor"] = out[name]["gb_s"] / floor
    return out


def report(result: Dict[str, object]) -> str:
    m = result["meta"]
    lines = ["# UcmCacheStore throughput", "",
             f"{m['blocks']} blocks of {m['block'] >> 10} KiB per task ({m['total_mib']} MiB), "
             f"median [min-max] over {m['reps']} repetitions; {m['machine']}.",
             f"Command: `{m['command']}`.", "",
             "| row | GB/s | [min-max] | of the memcpy floor | µs per task |",
             "|---|---|---|---|---|"]
    for name, r in result["rows"].items():
        us = f"{r['seconds_median'] * 1e6:,.0f}"
        if name == "dump_present":  # nothing is copied: the time is what matters
            lines.append(f"| {name} (every block skipped) | - | - | - | {us} |")
            continue
        lines.append(f"| {name} | {r['gb_s']:.2f} | [{r['gb_s_min']:.2f}-{r['gb_s_max']:.2f}] | "
                     f"{100 * r['of_floor']:.0f}% | {us} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="16 blocks of 64 KiB, 2 repetitions")
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--out", default=os.path.join(BENCH_DIR, "results"))
    args = ap.parse_args(argv)
    blocks, block = (16, 64 << 10) if args.quick else (64, 1 << 20)
    reps = args.reps or (2 if args.quick else 15)
    rows = run(blocks, block, reps)
    result = {"meta": {"blocks": blocks, "block": block, "total_mib": blocks * block >> 20,
                       "reps": reps, "quick": args.quick,
                       "machine": f"{os.cpu_count()} cores, {platform.machine()}, Python "
                                  f"{platform.python_version()}, numpy {np.__version__}",
                       "command": "python -m bench.ucm_store" + (" --quick" if args.quick
                                                                 else "")},
              "rows": rows}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "ucm_store.json"), "w") as f:
        json.dump(result, f, indent=1)
    md = report(result)
    with open(os.path.join(args.out, "ucm_store.md"), "w") as f:
        f.write(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
