"""What the demos' parents do alike: run workers, watch them, check the cache, clean up.

Both demos (``kv_demo.py``, ``embed_demo.py``) have the same shape.  The parent creates one
segment and detaches, starts worker processes (multiprocessing spawn) that attach to it by uuid,
waits for their reports with a progress line, reaps them, attaches again to read the stats and
run ``ucmcache.verify``, prints a summary and the failed checks, and removes the segment.  This
module is that shape: a ``Session`` (the spawn context, the stop flag and result queue the
workers share, the workers and their reports), the progress line, the cleanup that runs
whatever happened, the end-of-run cache checks, and the verdict.

Ctrl-C and SIGTERM: the workers ignore SIGINT (they inherit "ignored" from the parent while it
starts them) and stop when the parent sets the stop flag; the parent turns SIGTERM into
``Terminated`` so the same cleanup runs as for Ctrl-C, and ignores a second Ctrl-C until the
cleanup is done.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import queue
import signal
import sys
import time
import traceback
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130


class Terminated(BaseException):
    """SIGTERM, raised in the main thread so the same cleanup runs as for Ctrl-C."""


def on_sigterm(signum, frame):
    raise Terminated()


def run_parsed(parse: Callable[[Optional[Sequence[str]]], Any], argv: Optional[Sequence[str]],
               then: Callable[[Any], int]) -> int:
    """then(parse(argv)); when argparse exits instead (--help, bad arguments), its status: 0 or
    2 (EXIT_USAGE)."""
    try:
        args = parse(argv)
    except SystemExit as e:
        return EXIT_USAGE if e.code not in (0, None) else EXIT_OK
    return then(args)


def guarded(run: Callable[[], int]) -> int:
    """run() with SIGTERM raised as Terminated; Ctrl-C, SIGTERM and an unexpected error each end
    with one line and their exit status (run's own cleanup has removed the segment by then)."""
    old_term = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        return run()
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


def add_end_options(ap: argparse.ArgumentParser, timeout: float, progress: str,
                    inject: str) -> None:
    """The options both demos end with: --timeout, --no-progress, and the hidden flag (inject)
    with which a demo's own tests make worker 0 produce a wrong value its checks must catch."""
    ap.add_argument("--timeout", type=float, default=timeout,
                    help=f"give up (and fail) after this many seconds (default {timeout:g})")
    ap.add_argument("--no-progress", action="store_true", help=progress)
    ap.add_argument(inject, action="store_true", help=argparse.SUPPRESS)


def quick_or_full(a: argparse.Namespace, **defaults: Tuple[Any, Any]) -> None:
    """Each option left unset (None) takes its default for the run: (with --quick, without)."""
    for name, (quick, full) in defaults.items():
        if getattr(a, name) is None:
            setattr(a, name, quick if a.quick else full)


class WorkerFrame:
    """A worker process's frame (``with WorkerFrame(w, results) as frame:``): the worker ignores
    Ctrl-C (the parent owns it and sets the stop flag), any exception becomes the worker's report
    (its "error") instead of a crash, and the cache it attached is closed on the way out."""

    def __init__(self, w: int, results):
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        self.w, self.results, self.cache = w, results, None

    def attach(self, uuid: str) -> Any:
        from ucmcache import SlotCache
        self.cache = SlotCache.attach(uuid, timeout=30.0)
        return self.cache

    def __enter__(self) -> "WorkerFrame":
        return self

    def __exit__(self, kind, e, tb) -> bool:
        if e is not None:
            trace = "".join(traceback.format_exception(kind, e, tb))
            self.results.put({"worker": self.w, "error": f"{type(e).__name__}: {e}\n{trace}"})
        if self.cache is not None:
            try:
                self.cache.close()
            except Exception:
                pass
        return True  # reported: the worker exits 0 and the parent reads the error


class Progress:
    """One updating line on stderr when it is a terminal; a line every few seconds otherwise."""

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


class Session:
    """One run's parent side: the spawn context, the stop flag and the result queue the workers
    share, the workers, their reports (worker number -> report dict; a report with "error" is a
    worker that failed), the failed checks, and the cache attached after the workers are gone.

    Made before the segment is; ``create`` marks the segment as ours to remove, and
    ``shut_down`` (in the caller's ``finally``) removes it and reaps the workers."""

    def __init__(self, n_workers: int, uuid: str):
        self.ctx = mp.get_context("spawn")
        self.n_workers = n_workers
        self.uuid = uuid
        self.stop = self.ctx.RawValue("i", 0)
        self.results = self.ctx.Queue()
        self.procs: List[Any] = []
        self.reports: Dict[int, dict] = {}
        self.problems: List[str] = []
        self.cache = None
        self.created = False

    def create(self, **layout) -> None:
        """Create the segment and detach (this process's rank is freed for a worker)."""
        from ucmcache import SlotCache
        self.created = True
        SlotCache.create(self.uuid, **layout).close()

    def start(self, target: Callable, name: str, args_of: Callable[[int], tuple]) -> None:
        """Start the workers (process w runs target(*args_of(w))) and say their pids."""
        # Children inherit "SIGINT ignored" from here; the parent alone handles Ctrl-C.
        old_int = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            for w in range(self.n_workers):
                p = self.ctx.Process(target=target, name=f"{name}{w}", args=args_of(w),
                                     daemon=True)
                p.start()
                self.procs.append(p)
        finally:
            signal.signal(signal.SIGINT, old_int)
        print(f"workers: pids {' '.join(str(p.pid) for p in self.procs)}", file=sys.stderr,
              flush=True)

    def drain(self, wait: float) -> None:
        """Take one report off the queue, waiting up to ``wait`` seconds for it."""
        try:
            r = self.results.get(timeout=wait)
        except queue.Empty:
            return
        self.reports[r["worker"]] = r

    def check_dead(self) -> None:
        """A worker that exited without reporting gets an error report in its place."""
        for w, p in enumerate(self.procs):
            if w not in self.reports and p.exitcode is not None:
                self.drain(0.5)  # a report may still be in the pipe
                if w not in self.reports:
                    self.reports[w] = {"worker": w, "error": f"exited with code {p.exitcode} "
                                                             "without a report"}

    def failed(self) -> bool:
        return any("error" in r for r in self.reports.values())

    def attach(self) -> Any:
        """Attach again, after the workers are gone, to read the stats."""
        from ucmcache import SlotCache
        self.cache = SlotCache.attach(self.uuid, timeout=5.0)
        return self.cache

    def good_reports(self) -> List[dict]:
        """The reports of workers that finished, in worker order; each failed worker's error is
        added to the failed checks."""
        for w in sorted(self.reports):
            if "error" in self.reports[w]:
                self.problems.append(f"worker {w}: {self.reports[w]['error'].strip()}")
        return [self.reports[w] for w in sorted(self.reports) if "error" not in self.reports[w]]

    def shut_down(self, events: Sequence) -> None:
        """The cleanup, whatever happened (events: the start signals to release)."""
        shut_down(self.stop, events, self.procs, self.cache,
                  self.uuid if self.created else None, self.results)


def shut_down(stop, events, procs, cache, uuid: Optional[str], results) -> None:
    """The parent's cleanup, whatever happened: stop and reap the workers, detach, remove the
    segment (uuid None: not ours to remove).  A second Ctrl-C is ignored until it is done."""
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


def table(out, fmt: str) -> Callable[..., None]:
    """A printer of summary rows: row(label, figure, note="") prints fmt.format(...) on out."""
    def row(label: str, figure: Any, note: str = "") -> None:
        print(fmt.format(label, figure, note), file=out)
    return row


def worker_table(out, fmt: str, heads: Sequence[str], good: List[dict], per_rank,
                 cells: Callable[[dict, dict], Sequence]) -> None:
    """A blank line, the heads, then a row a worker that reported: cells(its report, its rank's
    stats), each through fmt."""
    print("", file=out)
    print(fmt.format(*heads), file=out)
    for r in good:
        print(fmt.format(*cells(r, per_rank[r["rank"]])), file=out)


def worker_failures(good: List[dict], count: str, what: str) -> List[str]:
    """Each worker's first failed checks as it listed them, and how many more it counted
    (report[count] is the total, report["failures"] the first few)."""
    problems: List[str] = []
    for r in good:
        for f in r["failures"]:
            problems.append(f"worker {r['worker']}: {f}")
        if r[count] > len(r["failures"]):
            problems.append(f"worker {r['worker']}: {r[count] - len(r['failures'])} more "
                            f"{what}")
    return problems


def cache_checks(st, n_distinct: int, report, procs) -> List[str]:
    """The end-of-run checks both demos make: a cache that held everything (no eviction, no
    bypass, no failure, one entry per distinct key), a clean verify, workers that exited 0."""
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
