"""The demo (demos/kv_demo.py; ./scripts/demo and ``ucmcache demo`` run it): a quick run passes
its own checks and leaves nothing behind; a bad payload makes it fail; Ctrl-C stops it cleanly;
``ucmcache demo`` finds it in the source tree, and says in one line when there is none."""
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DEMOS = ROOT / "demos"
SCRIPT = DEMOS / "kv_demo.py"
sys.path.insert(0, str(DEMOS))

import kv_demo as demo  # noqa: E402  (the demos are not a package: they run as scripts)
import ucmcache.demo  # noqa: E402

SHM = "/dev/shm"
TIMEOUT = 120


def _run(*args):
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True,
                          timeout=TIMEOUT)


def _segment(out):
    m = re.search(r"segment ucmcache-(demo-[A-Za-z0-9_-]+):", out)
    assert m, f"no segment line in the demo's output:\n{out}"
    return m.group(1)


def _gone(uuid):
    return not os.path.exists(os.path.join(SHM, "ucmcache-" + uuid))


def _no_segment_of(pid):
    return [n for n in os.listdir(SHM) if n.startswith(f"ucmcache-demo-{pid}-")]


def test_quick_run_counts_one_load_per_distinct_block_and_cleans_up():
    r = _run("--quick")
    out = r.stdout
    assert r.returncode == 0, f"exit {r.returncode}\nstdout:\n{out}\nstderr:\n{r.stderr}"
    distinct = int(re.search(r"^\s+distinct blocks\s+(\d+)", out, re.M).group(1))
    m = re.search(r"^\s+loader runs\s+(\d+)\s+workers' count; cache loads_started (\d+); "
                  r"== distinct blocks: (\w+)", out, re.M)
    assert m, out
    assert int(m.group(1)) == int(m.group(2)) == distinct > 0
    assert m.group(3) == "yes"
    assert re.search(r"payload checks\s+\d+ ok\s+0 failed", out), out
    assert "all invariants hold" in out
    assert "RESULT: OK" in out
    assert _gone(_segment(out))


def test_a_wrong_payload_is_caught_and_fails_the_run():
    r = _run("--quick", "--inject-bad-payload", "--no-progress")
    assert r.returncode == 1, f"exit {r.returncode}\n{r.stdout}\n{r.stderr}"
    assert "RESULT: FAILED" in r.stdout
    assert "carries block id 00000000000000000000000000000000" in r.stdout
    assert _gone(_segment(r.stdout))


def test_ctrl_c_stops_workers_and_removes_the_segment():
    # Slow loads (50 ms) keep the run going well past the first progress line, the gate.
    p = subprocess.Popen([sys.executable, str(SCRIPT), "--quick", "--load-ms", "50"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        pids = []
        for line in p.stderr:
            if line.startswith("workers: pids"):
                pids = [int(x) for x in line.split()[2:]]
            if line.lstrip().startswith("requests "):
                break  # serving has started
        assert pids, "the demo never reported its workers"
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=TIMEOUT)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == 130, f"exit {p.returncode}\n{out}\n{err}"
    assert "interrupted" in err
    assert _gone(_segment(out))
    assert not _no_segment_of(p.pid)
    for pid in pids:  # reaped by the demo, not orphaned
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_payloads_are_deterministic_and_self_checking():
    key = bytes(range(16))
    a = demo.compute_kv(key, 3)
    assert len(a) == demo.PAYLOAD_SIZE
    assert a == demo.compute_kv(key, 3)
    assert demo.check_payload(a, key) is None
    assert "block id" in demo.check_payload(a, bytes(16))
    torn = bytearray(a)
    torn[100] ^= 1
    assert "checksum" in demo.check_payload(bytes(torn), key)
    assert "length" in demo.check_payload(a[:-1], key)


def test_requests_share_chained_prefixes():
    wl = demo.WorkloadParams.for_run(seed=3, n_requests=40, quick=True)
    prompts = demo.build_prompts(wl)
    assert len(prompts) == 40
    assert all((x == y).all() for x, y in zip(prompts, demo.build_prompts(wl)))
    keys = [demo.request_keys(p) for p in prompts]
    assert all(len(k) == len(p) // demo.BLOCK_TOKENS for k, p in zip(keys, prompts))
    flat = [k for ks in keys for k in ks]
    assert len(set(flat)) < len(flat)  # prefixes are shared
    # Chained: a block id depends on every block before it.
    a = demo.request_keys(prompts[0])
    changed = prompts[0].copy()
    changed[0] += 1
    assert not set(a) & set(demo.request_keys(changed))


def test_ucmcache_demo_runs_the_source_trees_demo():
    # In the process that runs it (the workers import it by name), through the entry point the
    # CLI's `ucmcache demo` calls.
    r = subprocess.run([sys.executable, "-m", "ucmcache.demo", "--quick", "--no-progress",
                        "--workers", "2"], capture_output=True, text=True, timeout=TIMEOUT)
    assert r.returncode == 0, f"exit {r.returncode}\n{r.stdout}\n{r.stderr}"
    assert "RESULT: OK" in r.stdout
    assert _gone(_segment(r.stdout))
    r = subprocess.run([sys.executable, "-c", "import sys; from ucmcache.cli import main; "
                        "sys.exit(main(['demo', '--help']))"],
                       capture_output=True, text=True, timeout=TIMEOUT)
    assert r.returncode == 0 and r.stdout.startswith("usage: ucmcache-demo"), r.stdout + r.stderr


def test_ucmcache_demo_without_a_source_tree_says_so_in_one_line(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(ucmcache.demo, "DEMOS", tmp_path / "demos")
    assert ucmcache.demo.main(["--quick"]) == 2
    err = capsys.readouterr().err
    assert re.fullmatch(r"ucmcache demo: the demo is not available: \S+/demos/kv_demo\.py does "
                        r"not exist \(it ships with the source tree, not with an installed "
                        r"package: run \./scripts/demo in a checkout of the repository\)\n",
                        err), err


def test_the_demos_functions_read_as_named_steps():
    # No demo function over ~80 lines (a long one is steps waiting for names).
    import ast
    for path in sorted(DEMOS.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                assert n <= 80, f"{path.name}:{node.lineno} {node.name} is {n} lines"
