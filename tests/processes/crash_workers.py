"""The worker processes of the random-kill harness (tests/stress/crashloop.py), one kind per worker.

Every kind runs the same mixed workload on one SlotCache (get_or_load, get_many with owner
positions, with-blocks that hold a pin across more calls (and now and then delete the key they
hold), exist, delete, now and then recover) until the
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
churn    detaches and attaches again while it works, so the number of attached ranks (and which
         ranks hold capacity) changes during the round: between operations it closes its
         SlotCache and attaches again (SlotCache.attach on the same uuid: maybe another rank),
         and it attaches a second SlotCache in the same process for a while (between
         operations, or inside one, while the first holds a Loading slot or a pin), runs some
         operations on it and closes it.  After each of those closes it checks, from a
         read-only mapping, that nothing names the rank it gave up (when nobody took the rank
         meanwhile: otherwise the check is skipped).

Every attach and close of a worker goes through Attachments, which keeps the ranks it held (all
of them, in order: the report's "ranks") and marks, in a shared word per worker (the "phases"
gate file, word j), whether it is attaching or closing, so the harness can tell what a kill cut.

A worker that is stopped (not killed) leaves its loop, says so (its phase word, then a wake on
the "stopped" gate) and waits, bounded, for the harness's "close" gate (opened once every
survivor has stopped: no attach or operation of another worker then runs, so a rank this one
gives up is not retaken while it checks it).  Then, with its signals off and no handle open, it checks that it can still recover
promptly and that each rank it holds holds nothing (no pin, claim or Loading slot of its own),
closes its caches (it must work), checks again from a read-only attach (and with verify) that
nothing of those ranks is left, and writes a JSON report for the harness.  Every wait is
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
from ucmcache.lowlevel import ffi, lib
from ucmcache.lowlevel import Gate
from ucmcache.core.recovery import rank_state
from ucmcache.lowlevel import Segment
from ucmcache.core.verify import slot_fields, snapshot

from workers import check_payload, fill_owned, payload_for

KINDS = ("plain", "fork", "threads", "signals", "churn")
N_KEYS = 48
WAIT_TIMEOUT = 10.0      # any one wait of the workload: a loader's waiters learn of its death
                         # within 0.5 s, so 10 s means stuck
THREAD_JOIN = 30.0       # a stopped threads worker waits this long for its threads
HELPER_TIMEOUT = 300.0   # a helper gives up waiting by itself (the harness kills it long before)
WATCHDOG = 40.0          # a worker still running this long after its start is stuck: its threads'
                         # stacks go to stderr before the harness kills it (45 s after stop)
MAX_SAMPLES = 5          # error messages kept per worker
RECOVER_SLOW = 5.0       # a stopped worker's recover() taking longer is reported
CLOSE_WAIT = 60.0        # a stopped worker waits this long for the harness's close gate (the
                         # harness opens it within its own 45 s)
ATTACH_TIMEOUT = 30.0    # SlotCache.attach's wait for the segment

# A worker's phase, in its word of the phases gate file (read by the harness at a kill, and
# to know that every survivor has left its loop: "stopped").
PHASE_WORKING, PHASE_ATTACHING, PHASE_CLOSING, PHASE_STOPPED = 0, 1, 2, 3
PHASE_NAMES = {PHASE_WORKING: "working", PHASE_ATTACHING: "attaching", PHASE_CLOSING: "closing",
               PHASE_STOPPED: "stopped"}


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
                if rnd.random() < 0.2:
                    c.delete(k, timeout=WAIT_TIMEOUT)  # our pin keeps its bytes (checked below)
                c.exist([self.key() for _ in range(4)])
                k2 = self.key()
                self.check(k2, c.get_or_load(k2, lambda k2=k2: payload_for(k2, size),
                                             timeout=WAIT_TIMEOUT))
                self.check(k, h.data)  # still pinned: still ours to read
        elif r < 0.9:
            c.recover()  # as a supervisor thread would: after a kill, several at once
        elif r < 0.94:
            c.delete(self.key(), timeout=WAIT_TIMEOUT)  # others may hold it pinned meanwhile
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


def _inside(frame, codes):
    """True if `frame` or a caller of it runs one of `codes`: the signals worker leaves the
    loop's error bookkeeping alone (it runs inside an except clause, where an interruption would
    escape the loop's try), and its own handler (see alarm_handler)."""
    while frame is not None:
        if frame.f_code in codes:
            return True
        frame = frame.f_back
    return False


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


def quiet_own_holds(seg, rank):
    """own_holds(seg, rank) for a rank just given up, if nobody held it while its slots were
    read (FREE before and after, with the same attach count); None otherwise (another process
    took it: what names it now is theirs)."""
    off = seg.layout.rank(rank) + lib.UCM_R_ATTACHES
    n0, s0 = lib.ucm_load64(seg.base, off), rank_state(seg, rank)
    held = own_holds(seg, rank)
    s1, n1 = rank_state(seg, rank), lib.ucm_load64(seg.base, off)
    free = lib.UCM_RANK_FREE
    return held if s0 == free and s1 == free and n0 == n1 else None


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


# ---------------------------------------------------------------- a worker's attachments

class Attachments:
    """The SlotCaches a worker has attached (the first is the one its workload uses), every rank
    it has held (report["ranks"], in order), and its phase word for the harness."""

    def __init__(self, uuid, report, phases, index):
        self.uuid = uuid
        self.report = report
        self.caches = []
        self._phase_base = ffi.cast("char *", phases.word)
        self._phase_off = 4 * index
        self.resting = PHASE_WORKING  # the phase outside attach and close

    @property
    def primary(self):
        return self.caches[0] if self.caches else None

    @property
    def second(self):
        return self.caches[1] if len(self.caches) > 1 else None

    def ranks(self):
        return [c.rank for c in self.caches]

    def _phase(self, v):
        lib.ucm_store32(self._phase_base, self._phase_off, v)

    def stopped(self, gate):
        """Out of the loop for good: say so in the phase word, then wake the harness."""
        self.resting = PHASE_STOPPED
        self._phase(PHASE_STOPPED)
        gate.release()

    def attach(self):
        self._phase(PHASE_ATTACHING)
        try:
            c = SlotCache.attach(self.uuid, timeout=ATTACH_TIMEOUT)
            self.caches.append(c)
            self.report["ranks"].append(c.rank)
        finally:
            self._phase(self.resting)
        return c

    def close(self, c):
        """Close one of ours.  Whether it worked or not, a cache whose rank was given up (its
        context gone) is no longer ours; one that refused stays."""
        self._phase(PHASE_CLOSING)
        try:
            c.close()
        finally:
            if c._ctx is None and c in self.caches:
                self.caches.remove(c)
            self._phase(self.resting)


class ChurnWorkload(Workload):
    """The churn kind: the workload, with detaches and attaches among its operations.

    Each step is one of: close the first cache and attach again (or promote the second cache
    to first), attach a second cache or close it, an operation on the second cache, an
    operation on the first.  Inside an operation on the first (holding a Loading slot or a
    pin), the second cache is sometimes attached or closed."""

    P_SWAP = 0.05         # close the first cache and attach again
    P_PROMOTE = 0.3       # ... of those, with a second attached: close the first, the second
                          # becomes first (no attach)
    P_MAKE_FIRST = 0.2    # ... of the others: attach the new one before closing the old
    P_SECOND = 0.04       # attach a second cache (none attached) or close it
    P_ON_SECOND = 0.35    # an operation runs on the second cache, while one is attached
    P_INSIDE = 0.12       # at an "owner" or "pinned" point: attach or close the second cache

    def __init__(self, att, obs, rnd, gates, report):
        super().__init__(att.primary, rnd, gates, hook=self._inside)
        self.att = att
        self.obs = obs          # a read-only mapping, for the checks after each close
        self.report = report

    def _close(self, c):
        rank = c.rank
        self.att.close(c)
        self.report["closes"] += 1
        held = quiet_own_holds(self.obs, rank)
        if held is None:
            self.report["close_checks_skipped"] += 1
            return
        self.report["close_checks"] += 1
        if any(held.values()):
            _add_holds(self.report["own_after_churn_close"], held)

    def _attach(self):
        self.att.attach()
        self.report["attaches"] += 1

    def swap(self):
        att, rnd = self.att, self.rnd
        old = att.primary
        if att.second is not None and rnd.random() < self.P_PROMOTE:
            self._close(old)        # the second is first now
        elif att.second is None and rnd.random() < self.P_MAKE_FIRST:
            self._attach()          # briefly two ranks, then the new one is first
            self._close(old)
        else:
            self._close(old)
            self._attach()          # maybe another rank; the first again if a second exists
            if att.second is not None and rnd.random() < 0.5:
                att.caches.reverse()  # the new one first, the older second

    def toggle_second(self):
        if self.att.second is None:
            self._attach()
        else:
            self._close(self.att.second)

    def one_op(self):
        att, rnd = self.att, self.rnd
        if att.primary is None:     # an attach failed (reported): try again
            self._attach()
            return
        r = rnd.random()
        if r < self.P_SWAP:
            self.swap()
            return
        if r < self.P_SWAP + self.P_SECOND:
            self.toggle_second()
            return
        on_second = att.second is not None and rnd.random() < self.P_ON_SECOND
        self.c = att.second if on_second else att.primary
        super().one_op()

    def _inside(self, point):
        """Inside an operation on self.c (which holds a Loading slot or a pin): attach a second
        cache, or close the second if the operation is not running on it."""
        if point == "between" or self.rnd.random() >= self.P_INSIDE:
            return
        second = self.att.second
        if second is None:
            self._attach()
        elif second is not self.c:
            self._close(second)


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


def alarm_handler(cls, never, armed, report):
    """The signals worker's SIGALRM handler: raise `cls` into the frame the signal found
    running, unless that frame runs one of the codes in `never` or the loop's error bookkeeping
    (_sample), or it is inside this handler itself.  CPython runs a handler at the next check
    of the interpreter, which may be inside a handler still running (the timer fired again
    before it returned: a loaded machine descheduled it): such a nested run must not raise,
    since its exception would leave the outer handler into the frame the outer one was
    called on, which may be one left alone (the loop outside its try).  The outer run decides
    for both."""
    def on_alarm(signum, frame):
        if armed[0] and frame is not None and frame.f_code not in never \
                and not _inside(frame, skip):
            report["interrupts"] += 1
            raise cls("SIGALRM")

    skip = (_sample.__code__, on_alarm.__code__)
    return on_alarm


def _run_signals(c, rnd, gates, report):
    cls = rnd.choice((SoftInterrupt, HardInterrupt))
    interval = rnd.uniform(0.0003, 0.002)
    report["interrupt"] = cls.__name__
    report["interval_ms"] = round(interval * 1e3, 3)
    w = Workload(c, rnd, gates)
    armed = [True]
    # Left alone: the loop's frame (so every interruption lands under its try) and this one
    # (so the timer is always disarmed on the way out).
    on_alarm = alarm_handler(cls, {Workload.loop.__code__, _run_signals.__code__}, armed, report)
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


def _run_churn(att, rnd, gates, report):
    obs = Segment.attach(att.uuid, timeout=5, writable=False)
    try:
        w = ChurnWorkload(att, obs, rnd, gates, report)
        gates["ready"].release()
        try:
            w.loop(gates["stop"])
        finally:
            merge_counts(report["counts"], w.counts)
    finally:
        obs.detach()


# Each runner takes (first cache, rnd, gates, report); the churn one takes the Attachments.
RUNNERS = {"plain": _run_plain, "fork": _run_fork, "threads": _run_threads,
           "signals": _run_signals, "churn": _run_churn}


class _Stuck(Exception):
    pass


def worker(kind, uuid, gate_paths, index, seed, report_path):
    """The process body: lead a process group (the harness kills it whole), attach, run the
    kind until stopped, say so, wait for the close gate, then check, close and report.  Never
    returns (os._exit): what the worker leaves behind (helpers, a Pool) is the harness's to
    clean up.  `index`: the worker's word in the phases gate file."""
    os.setpgid(0, 0)
    faulthandler.dump_traceback_later(WATCHDOG, exit=False)
    rnd = random.Random(seed)
    gates = {name: Gate(path) for name, path in gate_paths.items()}
    report = {"kind": kind, "pid": os.getpid(), "rank": None, "ranks": [], "counts": new_counts(),
              "interrupts": 0, "helpers_forked": {}, "pool": False, "stuck_threads": 0,
              "fatal": None, "open_handles": None, "own_before_close": None, "closed": False,
              "close_error": None, "own_after_close": None, "verify_after_close": None,
              "recover_seconds": None, "held_at_stop": [], "unclosed_ranks": [],
              "close_gate_timeout": False, "attaches": 0, "closes": 0, "close_checks": 0,
              "close_checks_skipped": 0, "own_after_churn_close": {}}
    code = 0
    att = Attachments(uuid, report, gates["phases"], index)
    stopped = False
    try:
        c = att.attach()
        report["rank"] = c.rank
        stuck = False
        try:
            RUNNERS[kind](att if kind == "churn" else c, rnd, gates, report)
        except _Stuck as e:
            stuck = True
            report["fatal"] = str(e)
        except BaseException as e:
            report["fatal"] = _format(e)
        # What we hold now; until each is closed, the harness counts on its recovery.
        report["held_at_stop"] = att.ranks()
        report["unclosed_ranks"] = att.ranks()
        if att.ranks():
            report["rank"] = att.ranks()[0]
        att.stopped(gates["stopped"])
        stopped = True
        try:
            gates["close"].wait_value(1, timeout=CLOSE_WAIT)
        except TimeoutError:
            report["close_gate_timeout"] = True
        if not stuck:  # with threads still inside the cache, neither check nor close is sound
            _finish(att, uuid, report)
    except BaseException as e:
        report["fatal"] = _format(e)
        code = 2
    finally:
        try:
            if not stopped:
                att.stopped(gates["stopped"])
            tmp = report_path + ".tmp"
            with open(tmp, "w") as f:
                json.dump(report, f)
            os.replace(tmp, report_path)
        finally:
            os._exit(code)


def _format(e):
    """The whole traceback: its first frames say where an exception left the workload."""
    return "".join(traceback.format_exception(type(e), e, e.__traceback__))


def _add_holds(into, held):
    for k, v in held.items():
        into[k] = into.get(k, 0) + v
    return into


def _finish(att, uuid, report):
    """Stopped cleanly: nothing of ours may be held once no handle is open; close must work.
    Every cache we hold is checked and closed (a second one first); the holds are summed."""
    gc.collect()  # handles only a reference cycle still holds are closed by their finalizer
    # It can still recover (the victim, if nobody has yet): nothing process-local (a lock an
    # interruption left held, say) keeps it from it.  Slower than RECOVER_SLOW s is reported.
    slowest = 0.0
    for c in att.caches:
        t = time.monotonic()
        c.recover()
        slowest = max(slowest, time.monotonic() - t)
    report["recover_seconds"] = round(slowest, 3)
    report["open_handles"] = sum(c._open_handles for c in att.caches)
    report["own_before_close"] = {}
    for c in att.caches:
        _add_holds(report["own_before_close"], own_holds(c._seg, c.rank))
    closed = []
    for c in list(reversed(att.caches)):
        rank = c.rank
        try:
            att.close(c)
        except Exception as e:
            if report["close_error"] is None:
                report["close_error"] = f"{type(e).__name__}: {e}"
        if c not in att.caches:
            closed.append(rank)
    report["unclosed_ranks"] = att.ranks()
    report["closed"] = not att.caches
    if not closed:
        return
    seg = Segment.attach(uuid, timeout=5, writable=False)
    try:
        report["own_after_close"] = {}
        for rank in closed:
            _add_holds(report["own_after_close"], own_holds(seg, rank))
    finally:
        seg.detach()
    report["verify_after_close"] = [p for rank in closed for p in _verify_mentions(uuid, rank)]
