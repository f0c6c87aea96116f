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
