"""Smoke run of the benchmark harness (bench/run.py --quick): tiny sizes, every scenario and every
baseline that is installed; asserts the results are written and well formed.  No timing
assertions: benchmarks measure, tests check behaviour."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _leftovers(pid):
    """The run's own segments still in /dev/shm: the bench names each one after its pid
    (`bench.common.tag`), so another process's segments, coming or going, are not counted."""
    own = tuple(f"{prefix}{pid}-" for prefix in
                ("ucmbench-old-", "ucmcache-bench-", "ucmcache-"))
    return sorted(n for n in os.listdir("/dev/shm") if n.startswith(own))


def test_bench_quick_run_writes_results(tmp_path):
    proc = subprocess.Popen([sys.executable, "-m", "bench.run", "--quick", "--out", str(tmp_path)],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    r = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    # It says at startup which baselines are available (or skipped, and why).
    assert "available" in r.stdout or "SKIPPED" in r.stdout
    out = json.loads((tmp_path / "latest.json").read_text())
    for section in ("meta", "baselines", "layout", "s1_hit", "s2_batch", "s3_mix", "s4_flight",
                    "s5_churn", "ratios", "targets"):
        assert section in out, section
    assert out["meta"]["quick"] is True
    for name, b in out["baselines"].items():
        assert b["available"] or b.get("skipped_why"), name
    # ucmcache itself ran every scenario without an error.
    for size, row in out["s1_hit"]["by_size"].items():
        assert row["ucmcache"]["p50_ns"] is not None, size
    s2 = out["s2_batch"]["systems"]["ucmcache"]
    assert s2["exist_found"] == s2["exist_asked"] and s2["get_many_found"] == s2["get_many_asked"]
    for size, blk in out["s3_mix"]["by_size"].items():
        assert blk["systems"]["ucmcache"]["2p"]["ops"] > 0, size
    # Single flight: exactly one loader run per cold key, for every system that ran.
    keys = out["s4_flight"]["keys"]
    for name, r4 in out["s4_flight"]["systems"].items():
        if "error" not in r4:
            assert r4["loader_runs"] == keys, name
    assert "error" not in out["s4_flight"]["systems"]["ucmcache"]
    # ucmcache's Python floor of a wake-up ran too, and every wait is in one wake-up order.
    assert out["s4_flight"]["core_wait"]["loader_runs"] == keys
    floors = out["c_floor"].get("flight", {})  # none with no C compiler
    if floors:  # the C floor also ran in processes as large as this Python process
        assert floors["new_resident"]["resident_mb"] >= 1
        assert floors["new_resident"]["loader_runs"] == keys
    for r4 in (out["s4_flight"]["systems"]["ucmcache"], out["s4_flight"]["core_wait"],
               floors.get("new"), floors.get("new_resident")):
        if r4 is None:
            continue
        assert sum(o["waits"] for o in r4["by_order"].values()) == r4["waits"]
    for size, blk in out["s5_churn"]["by_size"].items():
        assert blk["systems"]["ucmcache"]["ops"] > 0, size
    assert {t["target"] for t in out["targets"]}
    md = (tmp_path / "latest.md").read_text()
    assert "## Targets of scenarios 1-6" in md and "python -m bench.run" in md
    if out.get("chart"):
        assert (tmp_path / "latest.png").stat().st_size > 0
    else:
        assert out.get("chart_skipped")
    assert _leftovers(proc.pid) == []


def test_wake_orders_sorts_each_keys_waiters_by_their_return():
    sys.path.insert(0, ROOT)
    from bench.common import wake_orders

    # key 7: three waiters (30, 10, 20 us), key 3: one (50 us), key 5: two (40, 60 us)
    got = wake_orders([7, 3, 7, 5, 7, 5], [30_000, 50_000, 10_000, 40_000, 20_000, 60_000])
    assert got == {"by_order": {"1": {"waits": 3, "p50_us": 40.0},   # 10, 40, 50
                                "2": {"waits": 2, "p50_us": 40.0},   # 20, 60
                                "3": {"waits": 1, "p50_us": 30.0}}}
    assert wake_orders([], []) == {"by_order": {}}


def test_flight_procs_out_of_range_is_refused_before_anything_runs(tmp_path):
    r = subprocess.run([sys.executable, "-m", "bench.run", "--flight-procs", "1", "--out",
                        str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--flight-procs must be 2..63" in r.stderr
    assert not (tmp_path / "latest.json").exists()
