"""The ucmcache demo: several inference workers sharing one segment of KV blocks.

``python -m ucmcache.demo`` (or ``./scripts/demo``) creates a segment, starts worker processes
(multiprocessing spawn) that attach to it by uuid, and has them serve a seeded stream of chat
requests whose prompts share prefixes: a few system prompts, a set of documents with skewed
popularity, and multi-turn conversations whose history grows turn by turn.  Each prompt is split
into blocks of 16 tokens, each full block is keyed by a chained 16-byte hash
(``ucmcache.chain_keys``), and each block's "KV" is produced through ``get_or_load`` by a
deterministic numpy function calibrated to cost about 1 ms.

Every payload carries its block id and a checksum, and every payload a worker gets back is
checked; a sample is also recomputed from scratch and compared byte for byte.  Each worker counts
its own loader runs; the sum must equal the cache's ``loads_started`` and the number of distinct
blocks (the cache is sized so that it holds every block).  The run ends with a summary and
``ucmcache.verify`` on the segment; the segment is always removed and the workers always reaped.

Exit status: 0 all checks passed, 1 a check failed, 2 bad arguments, 130 interrupted.
"""
from __future__ import annotations

import argparse
import hashlib
import multiprocessing as mp
import os
import queue
import secrets
import signal
import sys
import time
import traceback
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence

import numpy as np

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
EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130


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


def _worker(w: int, uuid: str, wl: WorkloadParams, iters: int, spot_rate: float,
            next_request, n_requests: int, stop, go, progress, results,
            inject_bad: bool = False) -> None:
    """One inference worker: attach by uuid, serve requests until the stream runs dry."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent owns Ctrl-C and tells us to stop
    cache = None
    row = w * P_FIELDS
    try:
        from ucmcache import SlotCache
        prompts = build_prompts(wl)
        _weights()
        cache = SlotCache.attach(uuid, timeout=30.0)
        progress[row + P_READY] = 1
        if not go.wait(timeout=120.0) or stop.value:
            results.put({"worker": w, "error": "stopped before the start signal"})
            return
        spot = np.random.default_rng([wl.seed, w, 0x5B07])
        loaded_keys: List[bytes] = []
        failures: List[str] = []
        n_failures = requests = blocks = prefix_blocks = spot_checks = 0
        t0 = time.perf_counter()
        while not stop.value:
            with next_request.get_lock():
                i = next_request.value
                if i >= n_requests:
                    break
                next_request.value = i + 1
            keys = request_keys(prompts[i])
            prefix_blocks += cache.exist_prefix(keys)  # what a scheduler asks first
            for key in keys:
                if stop.value:
                    break
                ran = []

                def loader(key=key, ran=ran):
                    ran.append(1)
                    if inject_bad and w == 0 and not loaded_keys:
                        return compute_kv(bytes(16), iters)  # a well-formed payload of another block
                    return compute_kv(key, iters)

                try:
                    payload = cache.get_or_load(key, loader, timeout=WAIT_TIMEOUT)
                    problem = check_payload(payload, key)
                    if problem is None and not ran and spot.random() < spot_rate:
                        spot_checks += 1
                        if payload != compute_kv(key, iters):
                            problem = "differs from a fresh recomputation"
                except Exception as e:  # a failed load or wait is a failed check, not a crash
                    problem = f"{type(e).__name__}: {e}"
                if ran:
                    loaded_keys.append(key)
                    progress[row + P_LOADS] += 1
                if problem is not None:
                    n_failures += 1
                    progress[row + P_FAILURES] += 1
                    if len(failures) < 10:
                        failures.append(f"request {i} block {key.hex()}: {problem}")
                blocks += 1
                progress[row + P_BLOCKS] += 1
            requests += 1
            progress[row + P_REQUESTS] += 1
        wall = time.perf_counter() - t0
        results.put({"worker": w, "rank": cache.rank, "pid": os.getpid(), "requests": requests,
                     "blocks": blocks, "loads": len(loaded_keys), "loaded_keys": b"".join(loaded_keys),
                     "prefix_blocks": prefix_blocks, "spot_checks": spot_checks,
                     "n_failures": n_failures, "failures": failures, "wall": wall})
    except BaseException as e:
        results.put({"worker": w, "error": f"{type(e).__name__}: {e}\n{traceback.format_exc()}"})
    finally:
        if cache is not None:
            try:
                cache.close()
            except Exception:
                pass


# ---------------------------------------------------------------------------------- the parent

class Terminated(BaseException):
    """SIGTERM, raised in the main thread so the same cleanup runs as for Ctrl-C."""


def on_sigterm(signum, frame):
    raise Terminated()


class Progress:
    """One updating line on stderr when it is a terminal; a line every few seconds otherwise.
    (Shared with scripts/embed_demo.py.)"""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.tty = enabled and sys.stderr.isatty()
        self.last = 0.0
        self.shown = False

    @staticmethod
    def bar(done: int, total: int, width: int = 24) -> str:
        frac = done / total if total else 1.0
        n = int(frac * width)
        return "[" + "#" * n + "." * (width - n) + f"] {100 * frac:5.1f}%"

    def update(self, text: str, force: bool = False) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if self.tty:
            if force or now - self.last >= 0.1:
                sys.stderr.write("\r" + text + "\x1b[K")
                sys.stderr.flush()
                self.last, self.shown = now, True
        elif force or now - self.last >= 2.0:
            sys.stderr.write(text + "\n")
            sys.stderr.flush()
            self.last = now

    def done(self) -> None:
        if self.tty and self.shown:
            sys.stderr.write("\n")
            sys.stderr.flush()
            self.shown = False


def reap(procs: Sequence, grace: float = 10.0) -> None:
    """Join every worker; terminate, then kill, whichever does not leave in time."""
    deadline = time.monotonic() + grace
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(3.0)
        if p.is_alive():
            p.kill()
            p.join(3.0)


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
    ap.add_argument("--timeout", type=float, default=300.0,
                    help="give up (and fail) after this many seconds (default 300)")
    ap.add_argument("--no-progress", action="store_true", help="no progress line on stderr")
    # For tests of the demo itself: worker 0's first loader returns another block's payload,
    # which every reader of that block must catch.
    ap.add_argument("--inject-bad-payload", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.requests is None:
        a.requests = 60 if a.quick else 2500
    if a.spot_rate is None:
        a.spot_rate = 0.25 if a.quick else 0.02
    from ._core import lib
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
    try:
        args = _parse(argv)
    except SystemExit as e:
        return EXIT_USAGE if e.code not in (0, None) else EXIT_OK
    # One BLAS thread per worker: 4 workers on a small machine, and bit-identical results.
    for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(var, "1")
    old_term = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        return _run(args)
    except KeyboardInterrupt:
        print("\ninterrupted: workers stopped, segment removed", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Terminated:
        print("terminated: workers stopped, segment removed", file=sys.stderr)
        return 128 + signal.SIGTERM
    except Exception as e:  # the segment is already removed and the workers reaped
        traceback.print_exc()
        print(f"RESULT: FAILED ({type(e).__name__}: {e})", file=sys.stdout)
        return EXIT_FAILED
    finally:
        signal.signal(signal.SIGTERM, old_term)


def _run(args: argparse.Namespace) -> int:
    from ucmcache import SlotCache

    out = sys.stdout
    t_start = time.perf_counter()
    wl = WorkloadParams.for_run(args.seed, args.requests, args.quick)
    prompts = build_prompts(wl)
    all_keys = [request_keys(p) for p in prompts]
    blocks_asked = sum(len(k) for k in all_keys)
    distinct = set(k for keys in all_keys for k in keys)
    n_distinct = len(distinct)
    iters, load_ms = calibrate(args.load_ms)

    # Every rank allocates only from its own range, and any worker may end up loading any
    # block, so each range gets room for every distinct block: nothing is ever evicted.  This
    # process only creates the segment and detaches (freeing its rank for a worker); it attaches
    # again after the workers are gone, to read the stats.
    max_ranks = args.workers
    slots_per_rank = max(1, n_distinct)
    uuid = f"demo-{os.getpid()}-{secrets.token_hex(4)}"
    seg_mib = max_ranks * slots_per_rank * PAYLOAD_SIZE / 2 ** 20

    ctx = mp.get_context("spawn")
    procs: List[Any] = []
    cache = None
    created = False
    stop = ctx.RawValue("i", 0)
    go = ctx.Event()
    next_request = ctx.Value("q", 0)
    progress = ctx.RawArray("q", args.workers * P_FIELDS)
    results = ctx.Queue()
    reports: Dict[int, dict] = {}
    problems: List[str] = []
    ok = False
    try:
        created = True
        SlotCache.create(uuid, slots_per_rank=slots_per_rank, slot_size=PAYLOAD_SIZE,
                         max_ranks=max_ranks).close()
        print(f"ucmcache demo: {args.workers} workers, {args.requests} requests, seed {args.seed}"
              f"{' (quick)' if args.quick else ''}", file=out)
        print(f"segment ucmcache-{uuid}: {max_ranks} ranks x {slots_per_rank} slots x "
              f"{PAYLOAD_SIZE} B = {seg_mib:.1f} MiB; each rank's range holds all {n_distinct} "
              "distinct blocks, so the cache holds everything (no eviction)", file=out)
        print(f"KV block: {BLOCK_TOKENS} tokens -> K,V {KV_ROWS}x{KV_DIM} fp16 + id + checksum; "
              f"loader = {iters} numpy tanh(x@W) steps, {load_ms:.2f} ms each here "
              f"(target {args.load_ms} ms)", file=out)
        out.flush()

        # Children inherit "SIGINT ignored" from here; the parent alone handles Ctrl-C.
        old_int = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            for w in range(args.workers):
                p = ctx.Process(target=_worker, name=f"ucmcache-demo-w{w}",
                                args=(w, uuid, wl, iters, args.spot_rate, next_request,
                                      args.requests, stop, go, progress, results,
                                      args.inject_bad_payload), daemon=True)
                p.start()
                procs.append(p)
        finally:
            signal.signal(signal.SIGINT, old_int)
        print(f"workers: pids {' '.join(str(p.pid) for p in procs)}", file=sys.stderr, flush=True)

        bar = Progress(not args.no_progress)
        deadline = time.monotonic() + args.timeout

        def drain(wait: float) -> None:
            try:
                r = results.get(timeout=wait)
            except queue.Empty:
                return
            reports[r["worker"]] = r

        def check_dead() -> None:
            for w, p in enumerate(procs):
                if w not in reports and p.exitcode is not None:
                    drain(0.5)  # a report may still be in the pipe
                    if w not in reports:
                        reports[w] = {"worker": w, "error": f"exited with code {p.exitcode} "
                                                            "without a report"}

        # Start everyone together, once all are attached (or one failed).
        while not all(progress[w * P_FIELDS + P_READY] for w in range(args.workers)):
            drain(0.05)
            check_dead()
            if reports:
                break
            if time.monotonic() > deadline:
                raise TimeoutError("workers did not attach in time")
        t_go = time.perf_counter()
        go.set()

        def line() -> str:
            req = sum(progress[w * P_FIELDS + P_REQUESTS] for w in range(args.workers))
            blk = sum(progress[w * P_FIELDS + P_BLOCKS] for w in range(args.workers))
            lds = sum(progress[w * P_FIELDS + P_LOADS] for w in range(args.workers))
            bad = sum(progress[w * P_FIELDS + P_FAILURES] for w in range(args.workers))
            rate = 100.0 * (blk - lds) / blk if blk else 0.0
            el = time.perf_counter() - t_go
            return (f"  requests {req}/{args.requests}  blocks {blk}  loader runs {lds}  "
                    f"served from cache {rate:.1f}%  failed checks {bad}  {el:.1f} s")

        while len(reports) < args.workers:
            drain(0.1)
            check_dead()
            bar.update(line())
            if any("error" in r for r in reports.values()):
                stop.value = 1  # no point going on; let the others report what they have
            if time.monotonic() > deadline:
                stop.value = 1
                problems.append(f"timed out after {args.timeout} s")
                break
        bar.update(line(), force=True)
        bar.done()
        serve_time = time.perf_counter() - t_go
        reap(procs)
        cache = SlotCache.attach(uuid, timeout=5.0)
        problems += _summarize(args, out, cache, uuid, wl, all_keys, distinct, blocks_asked,
                               reports, procs, serve_time, t_start)
        ok = not problems
    finally:
        shut_down(stop, [go], procs, cache, uuid if created else None, results)
    return verdict(out, uuid, ok, problems)


def shut_down(stop, events, procs, cache, uuid: Optional[str], results) -> None:
    """The parent's cleanup, whatever happened: stop and reap the workers, detach, remove the
    segment (uuid None: not ours to remove).  A second Ctrl-C is ignored until it is done.
    (Shared with scripts/embed_demo.py.)"""
    from ucmcache import SegmentNotFound, SlotCache
    old_int = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        stop.value = 1
        for e in events:
            e.set()
        reap(procs)
        if cache is not None:
            try:
                cache.close()
            except Exception as e:
                print(f"closing the cache: {e}", file=sys.stderr)
        if uuid is not None:
            try:
                SlotCache.unlink(uuid)
            except SegmentNotFound:
                pass
        results.close()
        results.join_thread()
    finally:
        signal.signal(signal.SIGINT, old_int)


def verdict(out, uuid: str, ok: bool, problems: List[str]) -> int:
    if ok:
        print(f"segment ucmcache-{uuid} removed.  RESULT: OK", file=out)
        return EXIT_OK
    print(f"segment ucmcache-{uuid} removed.  RESULT: FAILED", file=out)
    for p in problems:
        print(f"  - {p}", file=out)
    return EXIT_FAILED


def _summarize(args, out, cache, uuid, wl, all_keys, distinct, blocks_asked, reports, procs,
               serve_time, t_start) -> List[str]:
    """Print the summary table; return the list of failed checks."""
    import ucmcache
    problems: List[str] = []
    for w in sorted(reports):
        if "error" in reports[w]:
            problems.append(f"worker {w}: {reports[w]['error'].strip()}")
    good = [reports[w] for w in sorted(reports) if "error" not in reports[w]]

    st = cache.stats()
    requests_done = sum(r["requests"] for r in good)
    blocks_done = sum(r["blocks"] for r in good)
    loads = sum(r["loads"] for r in good)
    n_fail = sum(r["n_failures"] for r in good)
    spot = sum(r["spot_checks"] for r in good)
    prefix = sum(r["prefix_blocks"] for r in good)
    loaded = [r["loaded_keys"][i:i + 16] for r in good for i in range(0, len(r["loaded_keys"]), 16)]
    loaded_set = set(loaded)
    n_distinct = len(distinct)

    # Every request's prefix is now fully cached: one exist_prefix call per request.
    not_cached = sum(1 for keys in all_keys if cache.exist_prefix(keys) != len(keys))
    report = ucmcache.verify(uuid)

    equal = loads == st["loads_started"] == n_distinct == len(loaded_set)
    gets = st["gets"]
    row = "  {:<34}{:>12}  {}"
    print("", file=out)
    print("summary", file=out)
    print(row.format("requests", f"{requests_done}/{args.requests}", ""), file=out)
    print(row.format("blocks asked (16 tokens each)", blocks_asked,
                     f"served {blocks_done}"), file=out)
    print(row.format("distinct blocks", n_distinct, ""), file=out)
    print(row.format("loader runs", loads,
                     f"workers' count; cache loads_started {st['loads_started']}; "
                     f"== distinct blocks: {'yes' if equal else 'NO'}"), file=out)
    print(row.format("hits (Ready on lookup)", st["hits"],
                     f"hit rate {100.0 * st['hits'] / gets if gets else 0:.1f}% of {gets} gets"),
          file=out)
    print(row.format("joins (waited on a load)", st["joins"],
                     f"futex waits {st['waits']}, {st['wait_seconds']:.3f} s waited in all"),
          file=out)
    print(row.format("served without running a loader", blocks_done - loads,
                     f"{100.0 * (blocks_done - loads) / blocks_done if blocks_done else 0:.1f}%"),
          file=out)
    print(row.format("prefix cached at schedule time", prefix,
                     f"{100.0 * prefix / blocks_done if blocks_done else 0:.1f}% of blocks "
                     "(exist_prefix before each request)"), file=out)
    print(row.format("evictions / bypasses / failed loads",
                     f"{st['evictions']} / {st['bypasses']} / {st['loads_failed']}", ""), file=out)
    print(row.format("entries in cache", st["entries"],
                     f"{st['size_bytes'] / 2 ** 20:.1f} MiB of payload"), file=out)
    print(row.format("payload checks", f"{blocks_done - n_fail} ok",
                     f"{n_fail} failed; {spot} also recomputed and compared byte for byte"),
          file=out)
    print(row.format("total time", f"{time.perf_counter() - t_start:.1f} s",
                     f"serving {serve_time:.1f} s, "
                     f"{requests_done / serve_time if serve_time else 0:.0f} requests/s"), file=out)
    print("", file=out)
    hdr = "  {:<7}{:>5}{:>9}{:>10}{:>9}{:>8}{:>7}{:>7}{:>9}{:>8}"
    print(hdr.format("worker", "rank", "pid", "requests", "blocks", "hits", "joins", "loads",
                     "wall s", "req/s"), file=out)
    per_rank = st["per_rank"]
    for r in good:
        pr = per_rank[r["rank"]]
        print(hdr.format(f"w{r['worker']}", r["rank"], r["pid"], r["requests"], r["blocks"],
                         pr["hits"], pr["joins"], r["loads"], f"{r['wall']:.2f}",
                         f"{r['requests'] / r['wall'] if r['wall'] else 0:.0f}"), file=out)
    print("", file=out)
    print(f"verify: {report}", file=out)

    for r in good:
        for f in r["failures"]:
            problems.append(f"worker {r['worker']}: {f}")
        if r["n_failures"] > len(r["failures"]):
            problems.append(f"worker {r['worker']}: {r['n_failures'] - len(r['failures'])} more "
                            "failed checks")
    if requests_done != args.requests:
        problems.append(f"served {requests_done} of {args.requests} requests")
    if blocks_done != blocks_asked and requests_done == args.requests:
        problems.append(f"served {blocks_done} blocks, the stream asks {blocks_asked}")
    if not equal:
        problems.append(f"loader runs {loads} (distinct keys loaded {len(loaded_set)}), "
                        f"cache loads_started {st['loads_started']}, distinct blocks {n_distinct}: "
                        "not all equal")
    if len(loaded) != len(loaded_set):
        problems.append(f"{len(loaded) - len(loaded_set)} block(s) loaded more than once")
    if loaded_set - distinct:
        problems.append(f"{len(loaded_set - distinct)} loaded block(s) not in the stream")
    problems += cache_checks(st, n_distinct, report, procs)
    if not_cached:
        problems.append(f"{not_cached} request(s) not fully cached after the run")
    return problems


def cache_checks(st, n_distinct: int, report, procs) -> List[str]:
    """The end-of-run checks both demos make: a cache that held everything (no eviction, no
    bypass, no failure, one entry per distinct key), a clean verify, workers that exited 0.
    (Shared with scripts/embed_demo.py.)"""
    problems: List[str] = []
    if st["evictions"] or st["bypasses"] or st["loads_failed"]:
        problems.append(f"evictions {st['evictions']}, bypasses {st['bypasses']}, failed loads "
                        f"{st['loads_failed']}: expected none")
    if st["entries"] != n_distinct:
        problems.append(f"{st['entries']} entries in the cache, expected {n_distinct}")
    if not report.ok:
        problems.append(str(report))
    for w, p in enumerate(procs):
        if p.exitcode != 0:
            problems.append(f"worker {w} exited with code {p.exitcode}")
    return problems


if __name__ == "__main__":
    from ucmcache.demo import main as _main
    sys.exit(_main())
