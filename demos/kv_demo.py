"""The ucmcache demo: several inference workers sharing one segment of KV blocks.

``./scripts/demo`` (or ``ucmcache demo`` in a source tree, or ``python demos/kv_demo.py``) creates a
segment, starts worker processes (multiprocessing spawn) that attach to it by uuid, and has them
serve a seeded stream of chat requests whose prompts share prefixes: a few system prompts, a set
of documents with skewed popularity, and multi-turn conversations whose history grows turn by
turn.  Each prompt is split
into blocks of 16 tokens, each full block is keyed by a chained 16-byte hash
(``ucmcache.chain_keys``), and each block's "KV" is produced through ``get_or_load`` by a
deterministic numpy function calibrated to cost about 1 ms.

Every payload carries its block id and a checksum, and every payload a worker gets back is
checked; a sample is also recomputed from scratch and compared byte for byte.  Each worker counts
its own loader runs; the sum must equal the cache's ``loads_started`` and the number of distinct
blocks (the cache is sized so that it holds every block).  The run ends with a summary and
``ucmcache.verify`` on the segment; the segment is always removed and the workers always reaped.
The parent's side of that (workers, progress line, cleanup, the end-of-run cache checks) is
``demo_harness``, shared with ``embed_demo.py``.

Exit status: 0 all checks passed, 1 a check failed, 2 bad arguments, 130 interrupted.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import secrets
import sys
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence

import numpy as np

from demo_harness import (Progress, Session, WorkerFrame, add_end_options, cache_checks, guarded,
                          quick_or_full, reap, run_parsed, table, verdict, worker_failures,
                          worker_table)

BLOCK_TOKENS = 16                # tokens per KV block (vLLM's default block size)
VOCAB = 32000
NAMESPACE = "ucmcache-demo/toy-llm-v1/fp16/block16"
KV_DIM = 128                     # hidden width of the toy "layer"
KV_ROWS = 2 * BLOCK_TOKENS       # K and V rows for the block's 16 tokens
ID_BYTES = 16
SUM_BYTES = 8
KV_BYTES = KV_ROWS * KV_DIM * 2  # float16
PAYLOAD_SIZE = ID_BYTES + KV_BYTES + SUM_BYTES
WAIT_TIMEOUT = 60.0              # bound on any single wait for another worker's load


# ------------------------------------------------------------------------------------ workload

@dataclass(frozen=True)
class WorkloadParams:
    seed: int
    n_requests: int
    n_system: int = 3
    system_tokens: tuple = (48, 200)
    n_docs: int = 32
    doc_tokens: tuple = (96, 560)
    active_conversations: int = 8
    max_turns: int = 4
    user_tokens: tuple = (8, 48)
    reply_tokens: tuple = (16, 80)

    @classmethod
    def for_run(cls, seed: int, n_requests: int, quick: bool) -> "WorkloadParams":
        if quick:
            return cls(seed=seed, n_requests=n_requests, n_system=2, system_tokens=(32, 80),
                       n_docs=6, doc_tokens=(48, 160), active_conversations=4, max_turns=4,
                       user_tokens=(8, 40), reply_tokens=(16, 64))
        return cls(seed=seed, n_requests=n_requests)


def _tokens(rng: np.random.Generator, bounds: tuple) -> np.ndarray:
    return rng.integers(1, VOCAB, size=int(rng.integers(bounds[0], bounds[1] + 1)), dtype=np.int32)


def build_prompts(p: WorkloadParams) -> List[np.ndarray]:
    """The request stream: one token array per request, deterministic in the params.

    A request is system prompt + document + the conversation so far + the new user message.
    Conversations are interleaved (a pool of active ones), so turn k+1 of a conversation may be
    served by another worker while turn k is still in flight, which is what makes waiters.
    """
    rng = np.random.default_rng([p.seed, 0x5EED])
    systems = [_tokens(rng, p.system_tokens) for _ in range(p.n_system)]
    sys_weights = 1.0 / np.arange(1, p.n_system + 1) ** 1.5
    sys_weights /= sys_weights.sum()
    docs = [_tokens(rng, p.doc_tokens) for _ in range(p.n_docs)]
    doc_weights = 1.0 / np.arange(1, p.n_docs + 1)  # Zipf popularity
    doc_weights /= doc_weights.sum()

    def new_conversation() -> dict:
        s = int(rng.choice(p.n_system, p=sys_weights))
        d = int(rng.choice(p.n_docs, p=doc_weights))
        return {"history": [systems[s], docs[d]], "turns_left": int(rng.integers(1, p.max_turns + 1))}

    pool = [new_conversation() for _ in range(p.active_conversations)]
    prompts: List[np.ndarray] = []
    while len(prompts) < p.n_requests:
        i = int(rng.integers(len(pool)))
        conv = pool[i]
        user = _tokens(rng, p.user_tokens)
        prompts.append(np.concatenate(conv["history"] + [user]))
        conv["history"] = conv["history"] + [user, _tokens(rng, p.reply_tokens)]
        conv["turns_left"] -= 1
        if conv["turns_left"] == 0:
            pool[i] = new_conversation()
    return prompts


def request_keys(prompt: np.ndarray) -> List[bytes]:
    """Chained 16-byte hashes of the prompt's full blocks (a partial tail block is not cached)."""
    import ucmcache
    n_full = len(prompt) // BLOCK_TOKENS
    blocks = [prompt[i * BLOCK_TOKENS:(i + 1) * BLOCK_TOKENS].tobytes() for i in range(n_full)]
    return ucmcache.chain_keys(blocks, NAMESPACE)


# ------------------------------------------------------------------------------- the "model"

_W: Optional[np.ndarray] = None


def _weights() -> np.ndarray:
    global _W
    if _W is None:
        rng = np.random.default_rng(0xC0FFEE)
        _W = (rng.standard_normal((KV_DIM, KV_DIM), dtype=np.float32) / np.sqrt(KV_DIM)).astype(np.float32)
    return _W


def compute_kv(block_id: bytes, iters: int) -> bytes:
    """The KV payload of one block: deterministic in (block_id, iters).

    Layout: block id (16 bytes) | K and V as float16 (KV_ROWS x KV_DIM) | blake2b-64 of the rest.
    """
    w = _weights()
    rng = np.random.default_rng(int.from_bytes(block_id, "little"))
    x = rng.standard_normal((KV_ROWS, KV_DIM), dtype=np.float32)
    for _ in range(iters):
        x = np.tanh(x @ w)
    body = block_id + x.astype(np.float16).tobytes()
    return body + hashlib.blake2b(body, digest_size=SUM_BYTES).digest()


def check_payload(payload: bytes, block_id: bytes) -> Optional[str]:
    """None if the payload is the one for block_id (id and checksum); else what is wrong."""
    if len(payload) != PAYLOAD_SIZE:
        return f"length {len(payload)}, expected {PAYLOAD_SIZE}"
    if payload[:ID_BYTES] != block_id:
        return f"carries block id {payload[:ID_BYTES].hex()}, expected {block_id.hex()}"
    if hashlib.blake2b(payload[:-SUM_BYTES], digest_size=SUM_BYTES).digest() != payload[-SUM_BYTES:]:
        return "checksum mismatch (torn or corrupted payload)"
    return None


def calibrate(target_ms: float) -> tuple:
    """Iterations of the toy layer that make compute_kv cost about target_ms; (iters, ms)."""
    probe = bytes(range(16))

    def best(iters: int, reps: int) -> float:
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            compute_kv(probe, iters)
            times.append(time.perf_counter() - t)
        return min(times) * 1e3

    compute_kv(probe, 1)  # warm up
    base = best(0, 5)
    per_iter = max((best(40, 5) - base) / 40, 1e-4)
    iters = max(1, int(round((target_ms - base) / per_iter)))
    measured = sorted(best(iters, 1) for _ in range(5))[2]  # median at the chosen size
    for _ in range(2):  # refine where the linear estimate was off by more than 5%
        if abs(measured - target_ms) < 0.05 * target_ms:
            break
        iters = max(1, int(round(iters * target_ms / measured)))
        measured = sorted(best(iters, 1) for _ in range(5))[2]
    return iters, measured


# ------------------------------------------------------------------------------------ workers

# Live progress, one row per worker, written only by that worker (plain shared words, no lock).
P_READY, P_REQUESTS, P_BLOCKS, P_LOADS, P_FAILURES, P_FIELDS = 0, 1, 2, 3, 4, 5


def _take_request(next_request, n_requests: int) -> Optional[int]:
    """The next request of the stream, or None when it has run dry."""
    with next_request.get_lock():
        i = next_request.value
        if i >= n_requests:
            return None
        next_request.value = i + 1
        return i


class _Server:
    """One worker's serving loop state: what it loaded, what it checked, what failed.  Its live
    counts go to its row of ``progress`` as they change."""

    def __init__(self, w: int, iters: int, spot_rate: float, spot, progress, inject_bad: bool):
        self.w, self.iters, self.spot_rate, self.spot = w, iters, spot_rate, spot
        self.progress, self.row, self.inject_bad = progress, w * P_FIELDS, inject_bad
        self.loaded_keys: List[bytes] = []
        self.failures: List[str] = []
        self.n_failures = self.requests = self.blocks = self.prefix_blocks = self.spot_checks = 0

    def request(self, cache, i: int, keys: List[bytes], stop) -> None:
        """Serve request i: ask what prefix is cached, then get or load each of its blocks."""
        self.prefix_blocks += cache.exist_prefix(keys)  # what a scheduler asks first
        for key in keys:
            if stop.value:
                break
            self.block(cache, i, key)
        self.requests += 1
        self.progress[self.row + P_REQUESTS] += 1

    def block(self, cache, i: int, key: bytes) -> None:
        """Get one block through the cache (loading it if nobody has) and check the payload."""
        ran = []

        def loader():
            ran.append(1)
            if self.inject_bad and self.w == 0 and not self.loaded_keys:
                return compute_kv(bytes(16), self.iters)  # a well-formed payload of another block
            return compute_kv(key, self.iters)

        try:
            payload = cache.get_or_load(key, loader, timeout=WAIT_TIMEOUT)
            problem = check_payload(payload, key)
            if problem is None and not ran and self.spot.random() < self.spot_rate:
                self.spot_checks += 1
                if payload != compute_kv(key, self.iters):
                    problem = "differs from a fresh recomputation"
        except Exception as e:  # a failed load or wait is a failed check, not a crash
            problem = f"{type(e).__name__}: {e}"
        if ran:
            self.loaded_keys.append(key)
            self.progress[self.row + P_LOADS] += 1
        if problem is not None:
            self.n_failures += 1
            self.progress[self.row + P_FAILURES] += 1
            if len(self.failures) < 10:
                self.failures.append(f"request {i} block {key.hex()}: {problem}")
        self.blocks += 1
        self.progress[self.row + P_BLOCKS] += 1

    def report(self, rank: int, wall: float) -> dict:
        return {"worker": self.w, "rank": rank, "pid": os.getpid(), "requests": self.requests,
                "blocks": self.blocks, "loads": len(self.loaded_keys),
                "loaded_keys": b"".join(self.loaded_keys), "prefix_blocks": self.prefix_blocks,
                "spot_checks": self.spot_checks, "n_failures": self.n_failures,
                "failures": self.failures, "wall": wall}


def _worker(w: int, uuid: str, wl: WorkloadParams, iters: int, spot_rate: float,
            next_request, n_requests: int, stop, go, progress, results,
            inject_bad: bool = False) -> None:
    """One inference worker: attach by uuid, serve requests until the stream runs dry."""
    with WorkerFrame(w, results) as frame:
        prompts = build_prompts(wl)
        _weights()
        cache = frame.attach(uuid)
        progress[w * P_FIELDS + P_READY] = 1
        if not go.wait(timeout=120.0) or stop.value:
            results.put({"worker": w, "error": "stopped before the start signal"})
            return
        server = _Server(w, iters, spot_rate, np.random.default_rng([wl.seed, w, 0x5B07]),
                         progress, inject_bad)
        t0 = time.perf_counter()
        while not stop.value:
            i = _take_request(next_request, n_requests)
            if i is None:
                break
            server.request(cache, i, request_keys(prompts[i]), stop)
        results.put(server.report(cache.rank, time.perf_counter() - t0))


# ---------------------------------------------------------------------------------- the parent

def _parse(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="ucmcache-demo",
        description="Inference workers sharing KV blocks through one ucmcache segment.")
    ap.add_argument("--workers", type=int, default=4, help="worker processes (default 4)")
    ap.add_argument("--requests", type=int, default=None,
                    help="requests in the stream (default 2500, or 60 with --quick)")
    ap.add_argument("--seed", type=int, default=0, help="workload seed (default 0)")
    ap.add_argument("--quick", action="store_true", help="a tiny run (for tests)")
    ap.add_argument("--load-ms", type=float, default=1.0,
                    help="cost of producing one KV block, calibrated (default 1.0 ms)")
    ap.add_argument("--spot-rate", type=float, default=None,
                    help="fraction of cache-served payloads also recomputed and compared byte "
                         "for byte (default 0.02, or 0.25 with --quick)")
    # --inject-bad-payload: worker 0's first loader returns another block's payload, which
    # every reader of that block must catch.
    add_end_options(ap, 300.0, "no progress line on stderr", "--inject-bad-payload")
    a = ap.parse_args(argv)
    quick_or_full(a, requests=(60, 2500), spot_rate=(0.25, 0.02))
    from ucmcache.lowlevel import lib
    if not 1 <= a.workers <= lib.UCM_MAX_RANKS - 1:
        ap.error(f"--workers must be in [1, {lib.UCM_MAX_RANKS - 1}]")
    if a.requests < 1:
        ap.error("--requests must be >= 1")
    if not 0 < a.load_ms <= 1000:
        ap.error("--load-ms must be in (0, 1000]")
    if not 0 <= a.spot_rate <= 1:
        ap.error("--spot-rate must be in [0, 1]")
    return a


def main(argv: Optional[Sequence[str]] = None) -> int:
    return run_parsed(_parse, argv, _start)


def _start(args: argparse.Namespace) -> int:
    # One BLAS thread per worker: 4 workers on a small machine, and bit-identical results.
    for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(var, "1")
    return guarded(lambda: _run(args))


@dataclass
class _Plan:
    """What the parent works out before it starts anyone: the stream, its keys, the loader's
    cost, and the segment's size."""
    wl: WorkloadParams
    all_keys: List[List[bytes]]
    blocks_asked: int
    distinct: set
    iters: int
    load_ms: float
    slots_per_rank: int


def _plan(args: argparse.Namespace) -> _Plan:
    wl = WorkloadParams.for_run(args.seed, args.requests, args.quick)
    all_keys = [request_keys(p) for p in build_prompts(wl)]
    distinct = set(k for keys in all_keys for k in keys)
    iters, load_ms = calibrate(args.load_ms)
    # Every rank allocates only from its own range, and any worker may end up loading any
    # block, so each range gets room for every distinct block: nothing is ever evicted.
    return _Plan(wl, all_keys, sum(len(k) for k in all_keys), distinct, iters, load_ms,
                 max(1, len(distinct)))


def _run(args: argparse.Namespace) -> int:
    out = sys.stdout
    t_start = time.perf_counter()
    plan = _plan(args)
    # This process only creates the segment and detaches (freeing its rank for a worker); it
    # attaches again after the workers are gone, to read the stats.
    s = Session(args.workers, f"demo-{os.getpid()}-{secrets.token_hex(4)}")
    go = s.ctx.Event()
    next_request = s.ctx.Value("q", 0)
    progress = s.ctx.RawArray("q", args.workers * P_FIELDS)
    ok = False
    try:
        s.create(slots_per_rank=plan.slots_per_rank, slot_size=PAYLOAD_SIZE,
                 max_ranks=args.workers)
        _print_header(out, args, plan, s.uuid)
        s.start(_worker, "ucmcache-demo-w",
                lambda w: (w, s.uuid, plan.wl, plan.iters, args.spot_rate, next_request,
                           args.requests, s.stop, go, progress, s.results,
                           args.inject_bad_payload))
        serve_time = _serve(args, s, go, progress)
        reap(s.procs)
        s.attach()
        s.problems += _summarize(args, out, s, plan, serve_time, t_start)
        ok = not s.problems
    finally:
        s.shut_down([go])
    return verdict(out, s.uuid, ok, s.problems)


def _print_header(out, args: argparse.Namespace, plan: _Plan, uuid: str) -> None:
    n_distinct = len(plan.distinct)
    seg_mib = args.workers * plan.slots_per_rank * PAYLOAD_SIZE / 2 ** 20
    print(f"ucmcache demo: {args.workers} workers, {args.requests} requests, seed {args.seed}"
          f"{' (quick)' if args.quick else ''}", file=out)
    print(f"segment ucmcache-{uuid}: {args.workers} ranks x {plan.slots_per_rank} slots x "
          f"{PAYLOAD_SIZE} B = {seg_mib:.1f} MiB; each rank's range holds all {n_distinct} "
          "distinct blocks, so the cache holds everything (no eviction)", file=out)
    print(f"KV block: {BLOCK_TOKENS} tokens -> K,V {KV_ROWS}x{KV_DIM} fp16 + id + checksum; "
          f"loader = {plan.iters} numpy tanh(x@W) steps, {plan.load_ms:.2f} ms each here "
          f"(target {args.load_ms} ms)", file=out)
    out.flush()


def _serve(args: argparse.Namespace, s: Session, go, progress) -> float:
    """Start everyone together once all are attached (or one failed), show progress until every
    worker has reported (or the time is up); return the serving time in seconds."""
    bar = Progress(not args.no_progress)
    deadline = time.monotonic() + args.timeout
    while not all(progress[w * P_FIELDS + P_READY] for w in range(args.workers)):
        s.drain(0.05)
        s.check_dead()
        if s.reports:
            break
        if time.monotonic() > deadline:
            raise TimeoutError("workers did not attach in time")
    t_go = time.perf_counter()
    go.set()

    def line() -> str:
        req, blk, lds, bad = (sum(progress[w * P_FIELDS + f] for w in range(args.workers))
                              for f in (P_REQUESTS, P_BLOCKS, P_LOADS, P_FAILURES))
        rate = 100.0 * (blk - lds) / blk if blk else 0.0
        el = time.perf_counter() - t_go
        return (f"  requests {req}/{args.requests}  blocks {blk}  loader runs {lds}  "
                f"served from cache {rate:.1f}%  failed checks {bad}  {el:.1f} s")

    while len(s.reports) < args.workers:
        s.drain(0.1)
        s.check_dead()
        bar.update(line())
        if s.failed():
            s.stop.value = 1  # no point going on; let the others report what they have
        if time.monotonic() > deadline:
            s.stop.value = 1
            s.problems.append(f"timed out after {args.timeout} s")
            break
    bar.update(line(), force=True)
    bar.done()
    return time.perf_counter() - t_go


@dataclass
class _Totals:
    """The workers' reports added up, and what the cache says after the run."""
    st: Dict[str, Any]
    requests: int
    blocks: int
    loads: int
    n_fail: int
    spot: int
    prefix: int
    loaded: List[bytes]    # every key a worker ran the loader for, repeats kept

    @classmethod
    def of(cls, good: List[dict], st: Dict[str, Any]) -> "_Totals":
        def total(field: str) -> int:
            return sum(r[field] for r in good)
        loaded = [r["loaded_keys"][i:i + 16] for r in good
                  for i in range(0, len(r["loaded_keys"]), 16)]
        return cls(st, total("requests"), total("blocks"), total("loads"), total("n_failures"),
                   total("spot_checks"), total("prefix_blocks"), loaded)

    def loads_agree(self, n_distinct: int) -> bool:
        """Loader runs == the cache's loads_started == distinct blocks == distinct keys loaded."""
        return self.loads == self.st["loads_started"] == n_distinct == len(set(self.loaded))


def _summarize(args, out, s: Session, plan: _Plan, serve_time: float,
               t_start: float) -> List[str]:
    """Print the summary table; return the list of failed checks."""
    import ucmcache
    good = s.good_reports()
    t = _Totals.of(good, s.cache.stats())
    # Every request's prefix is now fully cached: one exist_prefix call per request.
    not_cached = sum(1 for keys in plan.all_keys if s.cache.exist_prefix(keys) != len(keys))
    report = ucmcache.verify(s.uuid)
    _print_totals(out, args, plan, t, serve_time, t_start)
    _print_workers(out, good, t.st["per_rank"])
    print("", file=out)
    print(f"verify: {report}", file=out)
    problems = worker_failures(good, "n_failures", "failed checks")
    problems += _count_checks(args, plan, t)
    problems += cache_checks(t.st, len(plan.distinct), report, s.procs)
    if not_cached:
        problems.append(f"{not_cached} request(s) not fully cached after the run")
    return problems


def _print_totals(out, args, plan: _Plan, t: _Totals, serve_time: float,
                  t_start: float) -> None:
    st, gets, n_distinct = t.st, t.st["gets"], len(plan.distinct)
    row = table(out, "  {:<34}{:>12}  {}")
    print("", file=out)
    print("summary", file=out)
    row("requests", f"{t.requests}/{args.requests}")
    row("blocks asked (16 tokens each)", plan.blocks_asked, f"served {t.blocks}")
    row("distinct blocks", n_distinct)
    row("loader runs", t.loads, f"workers' count; cache loads_started {st['loads_started']}; "
        f"== distinct blocks: {'yes' if t.loads_agree(n_distinct) else 'NO'}")
    row("hits (Ready on lookup)", st["hits"],
        f"hit rate {100.0 * st['hits'] / gets if gets else 0:.1f}% of {gets} gets")
    row("joins (waited on a load)", st["joins"],
        f"futex waits {st['waits']}, {st['wait_seconds']:.3f} s waited in all")
    row("served without running a loader", t.blocks - t.loads,
        f"{100.0 * (t.blocks - t.loads) / t.blocks if t.blocks else 0:.1f}%")
    row("prefix cached at schedule time", t.prefix,
        f"{100.0 * t.prefix / t.blocks if t.blocks else 0:.1f}% of blocks "
        "(exist_prefix before each request)")
    row("evictions / bypasses / failed loads",
        f"{st['evictions']} / {st['bypasses']} / {st['loads_failed']}")
    row("entries in cache", st["entries"], f"{st['size_bytes'] / 2 ** 20:.1f} MiB of payload")
    row("payload checks", f"{t.blocks - t.n_fail} ok",
        f"{t.n_fail} failed; {t.spot} also recomputed and compared byte for byte")
    row("total time", f"{time.perf_counter() - t_start:.1f} s",
        f"serving {serve_time:.1f} s, "
        f"{t.requests / serve_time if serve_time else 0:.0f} requests/s")


def _print_workers(out, good: List[dict], per_rank) -> None:
    worker_table(out, "  {:<7}{:>5}{:>9}{:>10}{:>9}{:>8}{:>7}{:>7}{:>9}{:>8}",
                 ("worker", "rank", "pid", "requests", "blocks", "hits", "joins", "loads",
                  "wall s", "req/s"), good, per_rank,
                 lambda r, pr: (f"w{r['worker']}", r["rank"], r["pid"], r["requests"],
                                r["blocks"], pr["hits"], pr["joins"], r["loads"],
                                f"{r['wall']:.2f}",
                                f"{r['requests'] / r['wall'] if r['wall'] else 0:.0f}"))


def _count_checks(args, plan: _Plan, t: _Totals) -> List[str]:
    """The counts must add up: every request served, every distinct block loaded exactly once."""
    problems: List[str] = []
    loaded_set, n_distinct = set(t.loaded), len(plan.distinct)
    if t.requests != args.requests:
        problems.append(f"served {t.requests} of {args.requests} requests")
    if t.blocks != plan.blocks_asked and t.requests == args.requests:
        problems.append(f"served {t.blocks} blocks, the stream asks {plan.blocks_asked}")
    if not t.loads_agree(n_distinct):
        problems.append(f"loader runs {t.loads} (distinct keys loaded {len(loaded_set)}), "
                        f"cache loads_started {t.st['loads_started']}, distinct blocks "
                        f"{n_distinct}: not all equal")
    if len(t.loaded) != len(loaded_set):
        problems.append(f"{len(t.loaded) - len(loaded_set)} block(s) loaded more than once")
    if loaded_set - plan.distinct:
        problems.append(f"{len(loaded_set - plan.distinct)} loaded block(s) not in the stream")
    return problems


if __name__ == "__main__":
    sys.exit(main())
