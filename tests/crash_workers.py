"""The worker processes of the random-kill harness (tests/crashloop.py), one kind per worker.

Every kind runs the same mixed workload on one SlotCache (get_or_load, get_many with owner
positions, with-blocks that hold a pin across more calls, exist, now and then recover) until the
round's stop gate opens or the harness SIGKILLs it.  The kinds differ in what else lives in the
process:

plain    one thread, nothing else: the harness's original worker.
fork     forks helpers that never touch the cache and block on a gate, so they outlive the
         worker's SIGKILL: with os.fork() (right after attach, between operations, while owning
         a Loading slot, while holding a pin) and, in half of them, a multiprocessing 'fork'
         Pool (made right after attach) whose workers block in a task.  The harness recovers
         the worker's rank while they live, then kills and reaps them (every worker leads its
         own process group for that).
threads  3 or 4 threads on the one SlotCache, killed as a whole.
signals  a SIGALRM interval timer (0.3 to 2 ms) whose handler raises an exception of this module
         (an Exception or a BaseException subclass, chosen per worker) wherever the workload or
         the library happens to be; the workload catches it around each operation and goes on.

A worker that is stopped (not killed), with its signals off and no handle open, checks that it
can still recover promptly and that its rank holds nothing (no pin, claim or Loading slot of its
own), closes its cache (it must work), checks again from a read-only attach (and with verify)
that nothing of its rank is left, and writes a JSON report for the harness.  Every wait is
bounded; helpers are killed by the harness.
"""
import faulthandler
import gc
import json
import multiprocessing as mp
import os
import random
import re
import signal
import threading
import time
import traceback

import numpy as np

import ucmcache
from ucmcache import SlotCache
from ucmcache._core import lib
from ucmcache._hooks import Gate
from ucmcache._segment import Segment
from ucmcache._verify import slot_fields, snapshot

from workers import check_payload, fill_owned, payload_for

KINDS = ("plain", "fork", "threads", "signals")
N_KEYS = 48
WAIT_TIMEOUT = 10.0      # any one wait of the workload: a loader's waiters learn of its death
                         # within 0.5 s, so 10 s means stuck
THREAD_JOIN = 30.0       # a stopped threads worker waits this long for its threads
HELPER_TIMEOUT = 300.0   # a helper gives up waiting by itself (the harness kills it long before)
WATCHDOG = 40.0          # a worker still running this long after its start is stuck: its threads'
                         # stacks go to stderr before the harness kills it (45 s after stop)
MAX_SAMPLES = 5          # error messages kept per worker
RECOVER_SLOW = 5.0       # a stopped worker's recover() taking longer is reported


class SoftInterrupt(Exception):
    """Raised by the signals worker's SIGALRM handler (the kind library code may catch)."""


class HardInterrupt(BaseException):
    """Raised by the signals worker's SIGALRM handler (like KeyboardInterrupt)."""


def new_counts():
    return {"ops": 0, "load_failed": 0, "cache_full": 0, "timeouts": 0, "errors": 0,
            "interrupted": 0, "false_hits": 0, "samples": []}


def merge_counts(into, other):
    for k, v in other.items():
        if k == "samples":
            into[k] = (into[k] + v)[:MAX_SAMPLES]
        else:
            into[k] += v


class Workload:
    """The mixed workload of one thread.  `hook(point)` is called at the points where the fork
    kind may fork: "between" operations, "owner" (holding a Loading slot of ours), "pinned"
    (holding a pin on a Ready slot)."""

    def __init__(self, cache, rnd, gates, hook=None):
        self.c = cache
        self.rnd = rnd
        self.size = cache.slot_size
        self.keys = [i.to_bytes(8, "little") * 2 for i in range(N_KEYS)]
        self.bad = gates["bad"]
        self.progress = gates["progress"]
        self.hook = hook or (lambda point: None)
        self.counts = new_counts()

    def key(self):
        return self.keys[self.rnd.randrange(N_KEYS)]

    def check(self, k, v):
        if not check_payload(k, bytes(v)):
            self.counts["false_hits"] += 1
            self.bad.release()

    def one_op(self):
        c, rnd, size = self.c, self.rnd, self.size
        r = rnd.random()
        if r < 0.6:
            k = self.key()
            self.check(k, c.get_or_load(k, lambda k=k: payload_for(k, size), timeout=WAIT_TIMEOUT))
        elif r < 0.75:
            batch = [self.key() for _ in range(3)]
            with c.get_many(batch, timeout=WAIT_TIMEOUT) as b:
                fill_owned(b, batch, size)
                b.wait()
                for i, k in enumerate(batch):
                    self.check(k, b.data(i))
        elif r < 0.88:
            # A with-block that holds its pin across more calls (never while it owns a Loading
            # slot: a wait there could close a cycle with another owner).
            k = self.key()
            with c.get(k, timeout=WAIT_TIMEOUT) as h:
                if h.owner:
                    self.hook("owner")
                    p = payload_for(k, size)
                    h.data[: len(p)] = p
                    h.ready(len(p))
                else:
                    h.wait()
                self.check(k, h.data)
                self.hook("pinned")
                c.exist([self.key() for _ in range(4)])
                k2 = self.key()
                self.check(k2, c.get_or_load(k2, lambda k2=k2: payload_for(k2, size),
                                             timeout=WAIT_TIMEOUT))
                self.check(k, h.data)  # still pinned: still ours to read
        elif r < 0.9:
            c.recover()  # as a supervisor thread would: after a kill, several at once
        else:
            c.exist([self.key() for _ in range(4)])
        self.hook("between")

    def loop(self, stop, interrupts=()):
        """Operations until the stop gate opens.  `interrupts`: exception classes a signal
        handler raises; caught around each operation (this frame is never interrupted: the
        handler leaves it alone, so every interruption lands inside the try below)."""
        cnt = self.counts
        while True:
            try:
                if stop.value:
                    return
                self.one_op()
                cnt["ops"] += 1
                self.progress.release()
            except interrupts:
                cnt["interrupted"] += 1
            except (ucmcache.LoadFailed, ucmcache.CacheFull) as e:
                # A killed (or interrupted) loader's waiters, or a full range: allowed outcomes.
                cnt["load_failed" if isinstance(e, ucmcache.LoadFailed) else "cache_full"] += 1
            except TimeoutError as e:
                cnt["timeouts"] += 1
                _sample(cnt, e)
            except Exception as e:
                cnt["errors"] += 1
                _sample(cnt, e)


def _sample(cnt, e):
    if len(cnt["samples"]) < MAX_SAMPLES:
        tb = traceback.format_exception(type(e), e, e.__traceback__)
        cnt["samples"].append("".join(tb[-3:])[-1500:])


# ---------------------------------------------------------------- holds of one rank

def own_holds(seg, rank):
    """Slots that name `rank`: pinned by it, claimed by it, Loading with it as the loader."""
    f = slot_fields(snapshot(seg)["metas"])
    ref = f["reference"]
    claimed = (ref & np.uint64(lib.UCM_CLAIMED)) != 0
    pinned = ~claimed & (((ref >> np.uint64(rank)) & np.uint64(1)) != 0)
    claimed_mine = claimed & ((ref & np.uint64(0xFF)) == rank)
    loading = (f["state"] == lib.UCM_LOADING) & (f["loader"] == rank)
    return {"pinned": int(pinned.sum()), "claimed": int(claimed_mine.sum()),
            "loading": int(loading.sum())}


def _verify_mentions(uuid, rank):
    """verify's problems that name `rank` (others may still be working: theirs are theirs)."""
    rep = ucmcache.verify(uuid, timeout=5)
    pat = re.compile(rf"rank\(s\) \[[^\]]*\b{rank}\b|rank {rank}\b")
    return [p for p in rep.problems if pat.search(p)]


# ---------------------------------------------------------------- helpers of the fork kind

def _helper_wait(helpers, helpers_stop):
    helpers.release()  # one more helper is up
    helpers_stop.wait_value(1, timeout=HELPER_TIMEOUT)


def helper_task(helpers_path, helpers_stop_path):
    """A task for a 'fork' Pool worker: block until the harness lets go (or kills us), then
    leave at once (the Pool's owner is gone: there is nobody to hand a result to)."""
    try:
        _helper_wait(Gate(helpers_path), Gate(helpers_stop_path))
    finally:
        os._exit(0)


class Forker:
    """The fork kind's hook: forks helpers at random points, once builds a Pool."""

    P_FORK = {"between": 0.03, "owner": 0.15, "pinned": 0.06}
    MAX_FORKS = 4

    def __init__(self, rnd, gates, report):
        self.rnd = rnd
        self.gates = gates
        self.report = report
        self.forks_left = self.MAX_FORKS
        self.pool = None  # kept alive: its workers must outlive us

    def fork_helper(self, point):
        pid = os.fork()
        if pid == 0:  # the helper: never touches the cache, never returns
            try:
                _helper_wait(self.gates["helpers"], self.gates["helpers_stop"])
            except BaseException:
                pass
            finally:
                os._exit(0)
        self.report["helpers_forked"][point] = self.report["helpers_forked"].get(point, 0) + 1

    def start_pool(self):
        """A 'fork' Pool of 2 whose workers block in a task.  Made before the harness may kill
        us: a kill inside its sem_open would leave glibc's temporary file in /dev/shm."""
        self.pool = mp.get_context("fork").Pool(2)
        for _ in range(2):
            self.pool.apply_async(helper_task, (self.gates["helpers"].path,
                                                self.gates["helpers_stop"].path))
        self.report["pool"] = True

    def __call__(self, point):
        if self.forks_left and self.rnd.random() < self.P_FORK[point]:
            self.forks_left -= 1
            self.fork_helper(point)


# ---------------------------------------------------------------- the kinds

def _run_plain(c, rnd, gates, report):
    w = Workload(c, rnd, gates)
    gates["ready"].release()
    try:
        w.loop(gates["stop"])
    finally:
        merge_counts(report["counts"], w.counts)


def _run_fork(c, rnd, gates, report):
    forker = Forker(rnd, gates, report)
    forker.fork_helper("attach")  # one helper lives before the harness may kill us
    if rnd.random() < 0.5:
        forker.start_pool()
    w = Workload(c, rnd, gates, hook=forker)
    gates["ready"].release()
    try:
        w.loop(gates["stop"])
    finally:
        merge_counts(report["counts"], w.counts)


def _run_threads(c, rnd, gates, report):
    n = rnd.choice((3, 4))
    report["threads"] = n
    ws = [Workload(c, random.Random(rnd.random()), gates) for _ in range(n)]
    errors = []

    def body(w):
        try:
            w.loop(gates["stop"])
        except BaseException as e:  # reported, never silent
            errors.append(f"{type(e).__name__}: {e}")

    ts = [threading.Thread(target=body, args=(w,), daemon=True) for w in ws]
    for t in ts:
        t.start()
    gates["ready"].release()
    gates["stop"].wait_value(1, timeout=HELPER_TIMEOUT)
    deadline = time.monotonic() + THREAD_JOIN
    for t in ts:
        t.join(max(0.0, deadline - time.monotonic()))
    for w in ws:
        merge_counts(report["counts"], w.counts)
    report["counts"]["errors"] += len(errors)
    report["counts"]["samples"] = (report["counts"]["samples"] + errors)[:MAX_SAMPLES]
    stuck = sum(t.is_alive() for t in ts)
    if stuck:
        report["stuck_threads"] = stuck
        raise _Stuck(f"{stuck} of {n} threads did not stop within {THREAD_JOIN} s")


def _run_signals(c, rnd, gates, report):
    cls = rnd.choice((SoftInterrupt, HardInterrupt))
    interval = rnd.uniform(0.0003, 0.002)
    report["interrupt"] = cls.__name__
    report["interval_ms"] = round(interval * 1e3, 3)
    w = Workload(c, rnd, gates)
    armed = [True]
    # Left alone: the loop's frame (so every interruption lands under its try) and this one
    # (so the timer is always disarmed on the way out).
    never = {Workload.loop.__code__, _run_signals.__code__}

    def on_alarm(signum, frame):
        if armed[0] and frame is not None and frame.f_code not in never:
            report["interrupts"] += 1
            raise cls("SIGALRM")

    gates["ready"].release()
    signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, interval, interval)
    try:
        w.loop(gates["stop"], interrupts=(cls,))
    finally:
        armed[0] = False
        signal.setitimer(signal.ITIMER_REAL, 0, 0)
        signal.signal(signal.SIGALRM, signal.SIG_IGN)
        merge_counts(report["counts"], w.counts)


RUNNERS = {"plain": _run_plain, "fork": _run_fork, "threads": _run_threads,
           "signals": _run_signals}


class _Stuck(Exception):
    pass


def worker(kind, uuid, gate_paths, seed, report_path):
    """The process body: lead a process group (the harness kills it whole), attach, run the
    kind until stopped, then check, close and report.  Never returns (os._exit): what the
    worker leaves behind (helpers, a Pool) is the harness's to clean up."""
    os.setpgid(0, 0)
    faulthandler.dump_traceback_later(WATCHDOG, exit=False)
    rnd = random.Random(seed)
    gates = {name: Gate(path) for name, path in gate_paths.items()}
    report = {"kind": kind, "pid": os.getpid(), "rank": None, "counts": new_counts(),
              "interrupts": 0, "helpers_forked": {}, "pool": False, "stuck_threads": 0,
              "fatal": None, "open_handles": None, "own_before_close": None, "closed": False,
              "close_error": None, "own_after_close": None, "verify_after_close": None,
              "recover_seconds": None}
    code = 0
    try:
        c = SlotCache.attach(uuid, timeout=30)
        report["rank"] = c.rank
        stuck = False
        try:
            RUNNERS[kind](c, rnd, gates, report)
        except _Stuck as e:
            stuck = True
            report["fatal"] = str(e)
        except BaseException as e:
            report["fatal"] = _format(e)
        if not stuck:  # with threads still inside the cache, neither check nor close is sound
            _finish(c, uuid, report)
    except BaseException as e:
        report["fatal"] = _format(e)
        code = 2
    finally:
        try:
            tmp = report_path + ".tmp"
            with open(tmp, "w") as f:
                json.dump(report, f)
            os.replace(tmp, report_path)
        finally:
            os._exit(code)


def _format(e):
    return "".join(traceback.format_exception(type(e), e, e.__traceback__))[-2000:]


def _finish(c, uuid, report):
    """Stopped cleanly: nothing of ours may be held once no handle is open; close must work."""
    gc.collect()  # handles only a reference cycle still holds are closed by their finalizer
    rank = c.rank
    # It can still recover (the victim, if nobody has yet): nothing process-local (a lock an
    # interruption left held, say) keeps it from it.  Slower than RECOVER_SLOW s is reported.
    t = time.monotonic()
    c.recover()
    report["recover_seconds"] = round(time.monotonic() - t, 3)
    report["open_handles"] = c._open_handles
    report["own_before_close"] = own_holds(c._seg, rank)
    try:
        c.close()
        report["closed"] = True
    except Exception as e:
        report["close_error"] = f"{type(e).__name__}: {e}"
        return
    seg = Segment.attach(uuid, timeout=5, writable=False)
    try:
        report["own_after_close"] = own_holds(seg, rank)
    finally:
        seg.detach()
    report["verify_after_close"] = _verify_mentions(uuid, rank)
