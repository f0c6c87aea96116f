"""The serving benchmark's own logic (bench/serving.py), without vLLM: the proxy's round-robin,
the /metrics parsing and what is derived from it, the overlap count, the table.  The proxy
itself is run against two stub backends where aiohttp is installed (it is in .venv-e2e, where
the benchmark runs); the whole benchmark is ./scripts/serve-bench (minutes: not a test)."""
import os
import subprocess
import sys

import pytest

from bench.serving import (Arrival, RoundRobin, cache_shares, connector_note, counter_delta,
                           first_request_overlaps, fmt_range, parse_prometheus, problems,
                           render_markdown, table_row)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_round_robin_spreads_completions_and_sends_the_rest_to_the_first():
    rr = RoundRobin(["http://a", "http://b"])
    got = [rr.pick("POST", "/v1/completions")[1] for _ in range(5)]
    assert got == ["http://a", "http://b", "http://a", "http://b", "http://a"]
    # side calls neither move the turn nor go elsewhere than the first backend
    assert rr.pick("GET", "/v1/models") == (0, "http://a")
    assert rr.pick("POST", "/tokenize") == (0, "http://a")
    assert rr.pick("POST", "/v1/chat/completions") == (1, "http://b")
    rr.reset()
    assert rr.pick("post", "/v1/completions") == (0, "http://a")


def test_round_robin_one_backend_and_none():
    rr = RoundRobin(["http://a"])
    assert {rr.pick("POST", "/v1/completions")[1] for _ in range(3)} == {"http://a"}
    with pytest.raises(ValueError, match="at least one backend"):
        RoundRobin([])


METRICS = """\
# HELP vllm:prefix_cache_queries Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries counter
vllm:prefix_cache_queries_total{engine="0",model_name="/m/x"} 4224.0
vllm:prefix_cache_queries_created{engine="0",model_name="/m/x"} 1.79e+09
vllm:prefix_cache_hits_total{engine="0",model_name="/m/x"} 2048.0
vllm:prefix_cache_hits_total{engine="1",model_name="a b}\\"c"} 32.0
vllm:external_prefix_cache_queries_total{engine="0",model_name="/m/x"} 2176.0
vllm:external_prefix_cache_hits_total{engine="0",model_name="/m/x"} 1024
vllm:num_requests_running{engine="0",model_name="/m/x"} 0.0
process_open_fds 17.0
"""


def test_parse_prometheus_sums_label_sets_and_skips_comments():
    m = parse_prometheus(METRICS)
    assert m["vllm:prefix_cache_queries_total"] == 4224.0
    # a label value holding a space, a brace and an escaped quote does not end the labels
    assert m["vllm:prefix_cache_hits_total"] == 2048.0 + 32.0
    assert m["vllm:external_prefix_cache_hits_total"] == 1024.0
    assert m["process_open_fds"] == 17.0
    assert not any(k.startswith("#") for k in m)


@pytest.mark.parametrize("line, what", [('x{a="1" 3', "unclosed label block"),
                                         ("x{a=\"1\"}", "without a value")])
def test_parse_prometheus_refuses_broken_lines(line, what):
    with pytest.raises(ValueError, match=what):
        parse_prometheus(line)


def test_counter_delta_and_cache_shares():
    before = {"vllm:prefix_cache_queries_total": 100.0, "vllm:prefix_cache_hits_total": 10.0,
              "vllm:num_requests_running": 3.0}
    after = {"vllm:prefix_cache_queries_total": 1100.0, "vllm:prefix_cache_hits_total": 410.0,
             "vllm:external_prefix_cache_queries_total": 600.0,
             "vllm:external_prefix_cache_hits_total": 300.0, "vllm:num_requests_running": 1.0}
    d = counter_delta(before, after)
    assert d == {"vllm:prefix_cache_queries_total": 1000.0,
                 "vllm:prefix_cache_hits_total": 400.0,
                 "vllm:external_prefix_cache_queries_total": 600.0,
                 "vllm:external_prefix_cache_hits_total": 300.0}   # gauges left out
    s = cache_shares(d)
    assert s["prompt_tokens"] == 1000 and s["local_hits"] == 400
    assert s["external_hits"] == 300 and s["computed"] == 300
    assert s["external_hit_rate"] == 0.5 and s["local_hit_rate"] == 0.4
    assert cache_shares({})["external_hit_rate"] == 0.0    # nothing asked: no division


def test_first_request_overlaps():
    arrivals = [
        # prefix p: backend 1's first request came before backend 0's first token: overlap
        Arrival(0.0, 0, "p", first_byte=2.0), Arrival(1.0, 1, "p", first_byte=3.0),
        Arrival(5.0, 1, "p", first_byte=5.5),
        # prefix q: backend 1's first came after backend 0's first token: no overlap
        Arrival(2.0, 0, "q", first_byte=4.0), Arrival(4.5, 1, "q", first_byte=5.0),
        # prefix r: one backend only: not counted
        Arrival(6.0, 0, "r", first_byte=7.0), Arrival(8.0, 0, "r", first_byte=9.0),
        # prefix s: the first request never answered: the later one overlapped it
        Arrival(9.0, 1, "s"), Arrival(9.5, 0, "s", first_byte=10.0),
    ]
    assert first_request_overlaps(reversed(arrivals)) == (2, 3)   # order of the list is free
    assert first_request_overlaps([]) == (0, 0)


def _run(ttft50, ttft99, rps, computed, ext_h, ext_q, overlaps=(0, 0)):
    return {"client": {"median_ttft_ms": ttft50, "p99_ttft_ms": ttft99,
                       "mean_ttft_ms": (ttft50 + ttft99) / 2,
                       "request_throughput": rps, "output_throughput": 8 * rps},
            "cache": cache_shares({"vllm:prefix_cache_queries_total": 1000.0,
                                   "vllm:prefix_cache_hits_total": 1000.0 - computed - ext_h,
                                   "vllm:external_prefix_cache_queries_total": ext_q,
                                   "vllm:external_prefix_cache_hits_total": ext_h}),
            "overlaps": overlaps}


def test_fmt_range():
    assert fmt_range([3.0, 1.0, 2.0]) == "2 [1-3]"
    assert fmt_range([1234.4, 1500.0, 1300.0]) == "1300 [1234-1500]"
    assert fmt_range([0.5]) == "0.5"
    assert fmt_range([12.34, 12.0]) == "12.2 [12-12.3]"
    assert fmt_range([0.25, 0.25]) == "0.25"
    assert fmt_range([0.5, 0.25, 0.75], pct=True) == "50% [25-75]"
    with pytest.raises(ValueError):
        fmt_range([])


def test_table_row_and_markdown():
    runs = [_run(200, 900, 1.5, 300, 400, 500, (1, 8)),
            _run(100, 800, 2.0, 200, 500, 500, (0, 8)),
            _run(150, 1000, 1.0, 250, 450, 600, (2, 8))]
    row = table_row("(c) ucm", runs)
    assert row == ["(c) ucm", "150 [100-200]", "900 [800-1000]", "550 [450-575]", "1.5 [1-2]",
                   "12 [8-16]",
                   "250 [200-300] of 1000", "300", "450 [400-500] (80% [75-100])",
                   "1 [0-2] of 8"]
    plain = table_row("(b) one", [_run(10, 20, 3, 900, 0, 0)])
    assert plain[8] == "0 (none asked)" and plain[9] == "-"
    md = render_markdown("T", ["ctx line"], [("(c) ucm", runs), ("(b) one", [_run(10, 20, 3,
                                                                                 900, 0, 0)])],
                         notes=["a note"])
    lines = md.splitlines()
    assert lines[0] == "# T" and "ctx line" in lines
    header = lines.index(next(ln for ln in lines if ln.startswith("| configuration")))
    assert lines[header + 1] == "|" + "---|" * 10
    assert lines[header + 2] == "| " + " | ".join(row) + " |"
    assert lines[header + 3].startswith("| (b) one | 10 | 20 | 15 | 3 |")
    assert lines[-1] == "a note"


def test_connector_note():
    runs = [{"ucmcache": {"vllm:ucmcache_blocks_loaded_total": 224.0,
                          "vllm:ucmcache_blocks_saved_total": 288.0,
                          "vllm:ucmcache_load_errors_total": 0.0}},
            {"ucmcache": {"vllm:ucmcache_blocks_loaded_total": 192.0,
                          "vllm:ucmcache_blocks_saved_total": 288.0,
                          "vllm:ucmcache_load_errors_total": 0.0}}]
    assert connector_note("(c)", runs) == (
        "(c): the connector's counters (vllm:ucmcache_*, summed over its servers): "
        "208 [192-224] blocks loaded, 288 blocks saved, 0 load errors.")
    assert connector_note("(a)", [{"ucmcache": {}}]) is None


def test_problems_fail_a_run_without_sharing_or_with_load_errors():
    good = dict(_run(100, 200, 2, 200, 500, 500), ucmcache={})
    none = dict(_run(100, 200, 2, 700, 0, 500), ucmcache={})
    errs = dict(_run(100, 200, 2, 200, 500, 500),
                ucmcache={"vllm:ucmcache_load_errors_total": 3.0})
    assert problems({"a": [none], "c": [good, good]}) == []     # (a) has no hit by design
    got = problems({"c": [good, none, errs]})
    assert len(got) == 2
    assert got[0].startswith("(c) run 2: no external prefix-cache hit")
    assert got[1] == "(c) run 3: 3 load error(s)"


def test_proxy_round_robin_streams_through_stub_backends():
    """The proxy between a client and two stub backends (tests/processes/serving_proxy.py):
    completions alternate, a side call goes to the first, bodies stream back whole, each
    completion's arrival is recorded with its prompt's key and its first bytes' time.  Runs
    under this interpreter when it has aiohttp, else under .venv-e2e's (where the benchmark
    runs), else is skipped."""
    try:
        import aiohttp  # noqa: F401
        python = sys.executable
    except ImportError:
        python = os.path.join(ROOT, ".venv-e2e", "bin", "python")
        if not os.path.exists(python) or subprocess.run(
                [python, "-c", "import aiohttp"], capture_output=True, timeout=60).returncode:
            pytest.skip("aiohttp is in neither this venv nor .venv-e2e")
    p = subprocess.run([python, "-m", "tests.processes.serving_proxy"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "proxy ok" in p.stdout
