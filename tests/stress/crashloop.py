"""Random-kill harness: workers of several kinds on a busy shared workload, one SIGKILLed at a
random moment per round; the others stop cleanly, a recoverer recovers, and the segment must be
whole: no leaked slot (pinned, claimed or Loading with nobody alive), no stuck waiter, no false
hit, the verifier clean, every dead rank recovered exactly once, and every stopped worker able
to close with nothing of its own left behind.

Kinds of worker (tests/processes/crash_workers.py), chosen per worker per round from --kinds:
  plain    one thread (the original worker)
  fork     forks helpers that never touch the cache and outlive its SIGKILL (os.fork, and
           sometimes a multiprocessing 'fork' Pool): its rank must be recovered while they
           live; the harness kills and reaps them at the end of the round
  threads  3-4 threads on one SlotCache, killed as a whole
  signals  a SIGALRM timer every 0.3-2 ms whose handler raises; the workload carries on
  churn    closes its SlotCache and attaches again among its operations (maybe another rank),
           and now and then holds a second SlotCache (a second rank) for a while: ranks attach
           and detach during the round, so capacity moves between them

Each round: start the workers (from a forkserver; each leads its own process group) -> all
attached (a gate) -> N operations done (a gate, N random) -> kill the victim -> M more
operations by the others (a gate, M random, maybe 0: they meet the victim's leftovers) -> open
the stop gate -> every survivor out of its loop (a gate, bounded) -> open the close gate (from
here nobody attaches or operates, so a stopped worker's check of the ranks it gives up sees
only its own) -> join the others (bounded) -> recover and check, helpers of fork workers still
alive -> kill and reap every worker's process group (this process is their subreaper) ->
recover again (a late recovery means a rank was held by a helper) -> if the segment is still
not whole, replace it, so one failing round does not spill into the next.  Ordering is by
gates, every wait bounded.

A kill is SIGSTOP, then (every thread stopped, a bounded wait) a look at what the process holds
at that instant: the ranks whose life lock it holds (its lock fd's OFD locks in
/proc/PID/fdinfo) and which of them are not FREE (those, and only those, must be recovered: a
churn worker holds 0, 1 or 2 such ranks, and may be cut inside attach or close), and its phase
word (working, attaching, closing) -> SIGKILL.  The ranks recovered in a round must be exactly
those: the victim's, plus every rank a stopped worker did not close (or a stuck one held when
it was killed).

Run it as `scripts/crashloop [ROUNDS] [--seed S] [--kinds plain,fork,threads,signals,churn]`
(default 1000 rounds, every kind) or call run_rounds() from a test.
"""
import argparse
import ctypes
import json
import multiprocessing as mp
import os
import random
import shutil
import signal
import sys
import tempfile
import time
import uuid as uuidlib

HERE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "processes")
sys.path.insert(0, HERE)  # crash_workers, workers

import ucmcache  # noqa: E402
from ucmcache import SlotCache  # noqa: E402
from ucmcache.lowlevel import ffi, lib  # noqa: E402
from ucmcache.lowlevel import Gate  # noqa: E402
from ucmcache.core.recovery import rank_alive, rank_pid, rank_state  # noqa: E402
from ucmcache.lowlevel import life_lock_byte  # noqa: E402
from ucmcache.core.stats import rank_counters  # noqa: E402
from ucmcache.core.verify import slot_fields, snapshot  # noqa: E402

import crash_workers  # noqa: E402
from crash_workers import KINDS  # noqa: E402

# Workers start from a forkserver that has imported them (a fresh single-threaded process, as a
# spawned one, without 0.2 s of interpreter start and imports each).  Their exit status comes
# through the forkserver's own pipe, which no helper of theirs inherits.
WORKERS = mp.get_context("forkserver")
START_TIMEOUT = 60.0    # every worker attached
PROGRESS_TIMEOUT = 60.0
JOIN_TIMEOUT = 45.0     # the survivors stop (their own waits are bounded by 10 s)
REAP_TIMEOUT = 10.0     # a SIGKILLed process group is gone
STOP_TIMEOUT = 10.0     # a SIGSTOPped process has every thread stopped
SLOTS_PER_RANK = 6      # a few slots per rank: ranks that come and go move capacity
TOTALS = ("rounds", "kills", "leaked_slots", "stuck_waiters", "false_hits", "recovered_ranks",
          "expected_recoveries", "verify_problems", "worker_errors", "close_refused",
          "own_leaks", "bad_recoveries", "stale_ranks", "late_recoveries", "helpers_reaped",
          "helpers_left", "segment_resets", "failed_rounds")
FAILURES = ("leaked_slots", "stuck_waiters", "false_hits", "verify_problems", "worker_errors",
            "close_refused", "own_leaks", "bad_recoveries", "stale_ranks", "late_recoveries",
            "helpers_left")
# Per kind.  ranks_at_kill: the victims' ranks that needed recovery (summed); kills_with_0/2:
# victims holding none or two; kills_in_attach/close: victims cut inside an attach or a close;
# attaches, closes: a stopped churn worker's detaches and attaches during the round;
# close_checks: its checks after them that nothing named the rank it gave up (skipped when
# another process took the rank first: close_checks_skipped).
KIND_ROW = ("workers", "rounds", "kills", "stops", "failed_rounds", "failed_as_victim", "stuck",
            "errors", "close_refused", "own_leaks", "interrupts", "helpers",
            "kills_with_live_helpers", "ranks_at_kill", "kills_with_0_ranks",
            "kills_with_2_ranks", "kills_in_attach", "kills_in_close", "attaches", "closes",
            "close_checks", "close_checks_skipped")

PR_SET_CHILD_SUBREAPER, PR_GET_CHILD_SUBREAPER = 36, 37


def _subreaper(on):
    """Make this process the reaper of its orphaned descendants (a killed fork worker's
    helpers); returns the previous setting."""
    libc = ctypes.CDLL(None, use_errno=True)
    prev = ctypes.c_int(0)
    libc.prctl(PR_GET_CHILD_SUBREAPER, ctypes.byref(prev), 0, 0, 0)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, int(on), 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")
    return bool(prev.value)


def _group_alive(pgid):
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def _kill_and_reap_groups(pgids, timeout=REAP_TIMEOUT):
    """SIGKILL every process of these groups and reap them (our children, or orphans of ours:
    we are their subreaper).  The group leaders (the workers) are the forkserver's children,
    not ours.  Returns (reaped, groups still not empty after `timeout`)."""
    left = set(pgids)
    for pg in left:
        try:
            os.killpg(pg, signal.SIGKILL)
        except ProcessLookupError:
            pass
    reaped = 0
    deadline = time.monotonic() + timeout
    while left:
        for pg in list(left):
            try:
                while os.waitid(os.P_PGID, pg, os.WEXITED | os.WNOHANG) is not None:
                    reaped += 1
            except ChildProcessError:  # no child of ours left in it
                if not _group_alive(pg):
                    left.discard(pg)
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.002)  # polling a SIGKILLed group's exit, not ordering anything
    return reaped, sorted(left)


def _threads_stopped(pid):
    """True once every thread of `pid` is in a stop (or the process is gone)."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return True
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError, IndexError):
            continue  # a thread that exited
        if state not in ("T", "t", "Z", "X"):
            return False
    return True


def _life_locks(pid, seg):
    """The ranks whose life lock `pid` holds on `seg`'s file: its OFD locks, listed under each
    fd in /proc/PID/fdinfo ("lock:  1: OFDLCK ADVISORY WRITE -1 MAJ:MIN:INODE START END")."""
    ino = os.fstat(seg.fd).st_ino
    first, n = life_lock_byte(0), seg.layout.max_ranks
    ranks = set()
    try:
        fds = os.listdir(f"/proc/{pid}/fdinfo")
    except FileNotFoundError:
        return ranks
    for fd in fds:
        try:
            with open(f"/proc/{pid}/fdinfo/{fd}") as f:
                lines = f.read().splitlines()
        except (FileNotFoundError, ProcessLookupError):
            continue
        for line in lines:
            w = line.split()
            if not line.startswith("lock:") or "OFDLCK" not in w or len(w) < 4:
                continue
            if w[-3].rsplit(":", 1)[-1] != str(ino):
                continue
            start, end = int(w[-2]), (int(w[-1]) if w[-1] != "EOF" else 1 << 62)
            ranks.update(r - first for r in range(max(start, first), min(end, first + n - 1) + 1))
    return ranks


def _stop_and_kill(p, seg, phases, j):
    """SIGKILL worker `p` (index j) at the instant it is at now, knowing what it held then:
    SIGSTOP, wait (bounded) until every thread of it is stopped, read the ranks whose life lock
    it holds and their states (only those not FREE need recovery: a lock taken in attach before
    the rank left FREE, or kept in close after it went back to FREE, leaves nothing to
    recover), and its phase; then SIGKILL and join.  Returns a dict: held (ranks locked),
    recover (of those, not FREE), phase, stopped (False: it did not stop in time, so what was
    read may be off)."""
    try:
        os.kill(p.pid, signal.SIGSTOP)
    except ProcessLookupError:
        pass
    deadline = time.monotonic() + STOP_TIMEOUT
    while not _threads_stopped(p.pid) and time.monotonic() < deadline:
        time.sleep(0.0005)  # polling the kernel's view of a stop we sent, not ordering anything
    stopped = _threads_stopped(p.pid)
    held = _life_locks(p.pid, seg)
    recover = sorted(r for r in held if rank_state(seg, r) != lib.UCM_RANK_FREE)
    phase = _phase(phases, j)
    try:
        os.kill(p.pid, signal.SIGKILL)  # a stopped process dies of it all the same
    except ProcessLookupError:
        pass
    _join(p, 30)
    return {"held": sorted(held), "recover": recover, "stopped": stopped, "phase": phase}


def _start_forkserver():
    """Start the forkserver (if nothing has yet) with crash_workers imported.  Python 3.11's
    forkserver ignores the sys.path it is handed, so this directory goes in its environment."""
    from multiprocessing import forkserver
    WORKERS.set_forkserver_preload(["crash_workers"])
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (HERE, old) if p)
    try:
        forkserver.ensure_running()
    finally:
        if old is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = old


def _join(p, timeout):
    """Wait, bounded, for a worker to exit; True if it did."""
    p.join(max(0.0, timeout))
    return not p.is_alive()


def _wait_gate(gate, at_least, procs, timeout):
    """Wait (bounded) for the gate to reach a value; give up early if a worker died."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            gate.wait_value(at_least, timeout=0.25)
            return None
        except TimeoutError:
            pass
        dead = [p for p in procs if not p.is_alive()]
        if dead:
            return f"worker pid {dead[0].pid} exited with {dead[0].exitcode} first"
        if time.monotonic() > deadline:
            return f"gate stayed at {gate.value} < {at_least} for {timeout} s"


def _recoveries(cache):
    """Ranks recovered so far, by anyone (each recoverer counts in its rank's stats line)."""
    return int(rank_counters(cache._seg)[:, lib.UCM_ST_RECOVERED_RANKS].sum())


def _leaked(cache):
    f = slot_fields(snapshot(cache._seg)["metas"])
    return int((f["reference"] != 0).sum()) + int((f["state"] == lib.UCM_LOADING).sum())


class _Segment:
    """The harness's own attachment (the recoverer), replaceable after a round left it broken."""

    def __init__(self, workers):
        self.workers = workers
        self.n = 0
        self._make()

    def _make(self):
        self.n += 1
        self.uuid = f"crash-{os.getpid()}-{uuidlib.uuid4().hex[:8]}"
        # Ranks: ours, and up to two per worker (a churn worker's second cache), and a spare.
        self.cache = SlotCache.create(self.uuid, slots_per_rank=SLOTS_PER_RANK, slot_size=96,
                                      max_ranks=min(63, 2 * self.workers + 2), n_buckets=8,
                                      n_stripes=2)

    def drop(self):
        try:
            self.cache.close()
        finally:
            SlotCache.unlink(self.uuid)

    def replace(self):
        self.drop()
        self._make()


def run_rounds(rounds, *, seed=0, workers=2, kinds=("plain",), log=None):
    kinds = tuple(kinds)
    unknown = set(kinds) - set(KINDS)
    if not kinds or unknown:
        raise ValueError(f"kinds must be some of {', '.join(KINDS)}, got {', '.join(kinds)}")
    _start_forkserver()
    rnd = random.Random(seed)
    stats = {k: 0 for k in TOTALS}
    stats["seconds"] = 0.0
    per_kind = {k: {f: 0 for f in KIND_ROW} for k in kinds}
    stats["per_kind"] = per_kind
    t0 = time.monotonic()
    tmp = tempfile.mkdtemp(prefix="ucmcache-crashloop-")
    bad = Gate()
    prev_reaper = _subreaper(True)
    seg = _Segment(workers)
    try:
        for i in range(rounds):
            plan = {"kinds": [rnd.choice(kinds) for _ in range(workers)],
                    "seeds": [rnd.random() for _ in range(workers)],
                    "kill_at": rnd.randint(1, 400),
                    "after_kill": rnd.randint(0, 300),
                    "victim": rnd.randrange(workers)}
            problems = _round(i, plan, seg, bad, tmp, stats)
            stats["rounds"] += 1
            for j, kind in enumerate(plan["kinds"]):
                per_kind[kind]["workers"] += 1
            for kind in set(plan["kinds"]):
                per_kind[kind]["rounds"] += 1
                if problems:
                    per_kind[kind]["failed_rounds"] += 1
            if problems:
                stats["failed_rounds"] += 1
                vk = plan["kinds"][plan["victim"]]
                per_kind[vk]["failed_as_victim"] += 1
                if log:
                    who = ",".join(k + ("*" if j == plan["victim"] else "")
                                   for j, k in enumerate(plan["kinds"]))
                    log(f"round {i} [{who}]: " + "\n  ".join(problems))
        stats["false_hits"] = bad.value
    finally:
        stats["seconds"] = round(time.monotonic() - t0, 1)
        _subreaper(prev_reaper)
        bad.close()
        seg.drop()
        shutil.rmtree(tmp, ignore_errors=True)
    return stats


def _round(i, plan, seg, bad, tmp, stats):
    """One round; returns its problems (empty: the round was clean).  Updates stats."""
    per_kind = stats["per_kind"]
    kinds, victim = plan["kinds"], plan["victim"]
    n = len(kinds)
    cache = seg.cache
    problems = []
    names = ("progress", "stop", "ready", "helpers", "helpers_stop", "stopped", "close", "phases")
    gates = {name: Gate() for name in names}
    paths = {name: g.path for name, g in gates.items()}
    paths["bad"] = bad.path
    reports = [os.path.join(tmp, f"r{i}-w{j}.json") for j in range(n)]
    bad0 = bad.value
    rec0 = _recoveries(cache)
    # Not daemonic: a fork worker's Pool needs children.  The finally below kills them all.
    ps = [WORKERS.Process(target=crash_workers.worker,
                          args=(kinds[j], seg.uuid, paths, j, plan["seeds"][j], reports[j]))
          for j in range(n)]
    started = []
    whose = {}  # rank -> the worker last known to hold it (for messages)
    try:
        for p in ps:
            p.start()
            started.append(p)
        why = _wait_gate(gates["ready"], n, ps, START_TIMEOUT)
        if why:
            problems.append(f"workers did not all attach: {why}")
            stats["worker_errors"] += 1
            return problems
        why = _wait_gate(gates["progress"], plan["kill_at"], ps, PROGRESS_TIMEOUT)
        if why:
            problems.append(f"no progress to {plan['kill_at']} operations: {why}")
        # The kill, with what the victim held at that instant: the ranks to recover.
        v = ps[victim]
        vat = _stop_and_kill(v, cache._seg, gates["phases"], victim)
        killed = v.exitcode == -signal.SIGKILL
        stats["kills"] += killed
        _count_kill(per_kind[kinds[victim]], killed, vat)
        whose.update((r, victim) for r in vat["held"])
        expect_recovered = len(vat["recover"])
        vwho = f"worker {victim} ({kinds[victim]}, killed)"
        if not vat["stopped"]:
            stats["worker_errors"] += 1
            problems.append(f"{vwho} did not stop within {STOP_TIMEOUT} s of SIGSTOP: the ranks "
                            "it held were read while it ran")
        if vat["phase"] == "stopped":  # before the stop gate: it failed (never reported)
            stats["worker_errors"] += 1
            problems.append(f"{vwho} had left its workload before the kill")
        if kinds[victim] != "churn" and (vat["held"] != vat["recover"]
                                         or len(vat["recover"]) != 1):
            stats["bad_recoveries"] += 1
            problems.append(f"{vwho} held the life locks of ranks {vat['held']}, of which "
                            f"{vat['recover']} not FREE: one attached rank was expected")
        # The others go on for a while among the victim's leftovers (its pins, its Loading
        # slots: they wait on them, recover it, allocate around it), then stop.
        others = [p for j, p in enumerate(ps) if j != victim]
        if plan["after_kill"]:
            why = _wait_gate(gates["progress"], gates["progress"].value + plan["after_kill"],
                             others, PROGRESS_TIMEOUT)
            if why:
                problems.append(f"no progress to {plan['after_kill']} more operations after "
                                f"the kill: {why}")
        gates["stop"].release()
        # Every survivor out of its loop (no attach or operation from here), then they check
        # and close, bounded.
        deadline = time.monotonic() + JOIN_TIMEOUT
        _wait_stopped(gates["stopped"], gates["phases"],
                      [(j, p) for j, p in enumerate(ps) if j != victim], deadline)
        gates["close"].release()
        for j, p in enumerate(ps):
            if j == victim:
                continue
            row = per_kind[kinds[j]]
            if not _join(p, deadline - time.monotonic()):  # a survivor that cannot finish
                stats["stuck_waiters"] += 1
                row["stuck"] += 1
                at = _stop_and_kill(p, cache._seg, gates["phases"], j)
                whose.update((r, j) for r in at["held"])
                problems.append(f"worker {j} ({kinds[j]}, ranks {at['held']}, {at['phase']}) "
                                f"did not stop within {JOIN_TIMEOUT} s: killed")
                expect_recovered = _plus(expect_recovered, len(at["recover"]))
                continue
            row["stops"] += 1
            rep = _read_report(reports[j])
            if rep is None:
                problems.append(f"worker {j} ({kinds[j]}) exited with {p.exitcode} and no report")
                stats["worker_errors"] += 1
                row["errors"] += 1
                # How many ranks it held when it died is known only for a worker of one rank.
                expect_recovered = _plus(expect_recovered, None if kinds[j] == "churn" else 1)
                continue
            whose.update((r, j) for r in rep["ranks"])
            expect_recovered = _plus(expect_recovered, len(rep["unclosed_ranks"]))
            problems += _check_report(j, rep, stats, row)
        # Recovery and checks, with every fork worker's helpers still alive.
        for j, p in enumerate(ps):
            if kinds[j] == "fork" and _group_alive(p.pid):
                per_kind["fork"]["kills_with_live_helpers"] += j == victim
            elif kinds[j] == "fork" and j == victim:
                problems.append(f"worker {j} (fork, killed): its helpers were gone before recovery")
        cache.recover()
        recovered = _recoveries(cache) - rec0
        stats["recovered_ranks"] += recovered
        if expect_recovered is None:
            problems.append(f"ranks recovered {recovered} time(s) in the round: not checked (a "
                            "churn worker died without a report)")
        else:
            stats["expected_recoveries"] += expect_recovered
            if recovered != expect_recovered:
                stats["bad_recoveries"] += 1
                problems.append(f"ranks recovered {recovered} time(s) in the round, expected "
                                f"{expect_recovered} (the victim's ranks not FREE at its kill, "
                                f"{vat['recover']} ({vat['phase']}), and each rank a stopped "
                                "worker did not close)")
        pids = {p.pid: j for j, p in enumerate(ps)}
        problems += _check_segment(seg, whose, pids, kinds, victim, stats)
        hits = bad.value - bad0
        if hits:
            problems.append(f"{hits} false hit(s)")
        return problems
    finally:
        gates["stop"].release()
        gates["close"].release()
        gates["helpers_stop"].release()
        for p in started:
            if p.is_alive():
                p.kill()
            _join(p, 10)
        reaped, left = _kill_and_reap_groups([p.pid for p in started])
        stats["helpers_reaped"] += reaped
        if "fork" in per_kind:
            per_kind["fork"]["helpers"] += reaped
        if left:
            stats["helpers_left"] += len(left)
            problems.append(f"process groups {left} not empty {REAP_TIMEOUT} s after SIGKILL")
        for g in gates.values():
            g.close()
        for r in reports:
            if os.path.exists(r):
                os.unlink(r)
        # With every helper gone: a rank recovered only now was held by a helper.
        late = cache.recover().count
        if late:
            stats["late_recoveries"] += late
            problems.append(f"{late} rank(s) recovered only after the helpers were killed")
        if late or problems:
            if _leaked(cache) or not ucmcache.verify(seg.uuid).ok:
                stats["segment_resets"] += 1
                problems.append("segment still not whole after the helpers died: replaced")
                seg.replace()


def _plus(total, n):
    """Expected recoveries so far plus n; None (unknown) absorbs."""
    return None if total is None or n is None else total + n


def _count_kill(row, killed, at):
    row["kills"] += killed
    row["ranks_at_kill"] += len(at["recover"])
    row["kills_with_0_ranks"] += not at["recover"]
    row["kills_with_2_ranks"] += len(at["recover"]) == 2
    row["kills_in_attach"] += at["phase"] == "attaching"
    row["kills_in_close"] += at["phase"] == "closing"


def _phase(phases, j):
    return crash_workers.PHASE_NAMES.get(
        lib.ucm_load32(ffi.cast("char *", phases.word), 4 * j), "?")


def _wait_stopped(gate, phases, others, deadline):
    """Wait (bounded) until every survivor (j, process) has left its loop: its phase word says
    "stopped" (set once on the way out, whatever happened, before a wake on the gate), or it
    is gone.  Gives up at the deadline."""
    while True:
        seen = gate.value  # before the words: a later stop bumps it, and the wait below sees it
        if all(_phase(phases, j) == "stopped" or not p.is_alive() for j, p in others):
            return
        left = deadline - time.monotonic()
        if left <= 0:
            return
        try:
            gate.wait_value(seen + 1, timeout=min(0.25, left))
        except TimeoutError:
            pass


def _read_report(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _check_report(j, rep, stats, row):
    """A stopped worker's own account: errors, timeouts, close, nothing of its own left."""
    out = []
    kind, rank = rep["kind"], rep["rank"]
    cnt = rep["counts"]
    row["interrupts"] += rep["interrupts"]
    for f in ("attaches", "closes", "close_checks", "close_checks_skipped"):
        row[f] += rep[f]
    who = f"worker {j} ({kind}, rank {rank})"
    if len(rep["ranks"]) > 1 or len(rep["held_at_stop"]) != 1:
        who = f"worker {j} ({kind}, ranks {rep['held_at_stop']} at the stop, {rep['ranks']} held)"
    if cnt["timeouts"] or rep["stuck_threads"]:
        stats["stuck_waiters"] += cnt["timeouts"] + rep["stuck_threads"]
        row["stuck"] += cnt["timeouts"] + rep["stuck_threads"]
        out.append(f"{who}: {cnt['timeouts']} wait(s) timed out, {rep['stuck_threads']} stuck "
                   "thread(s)")
    if cnt["errors"] or rep["fatal"] or rep["close_gate_timeout"]:
        n = cnt["errors"] + bool(rep["fatal"]) + rep["close_gate_timeout"]
        stats["worker_errors"] += n
        row["errors"] += n
        out.append(f"{who}: {cnt['errors']} error(s), fatal: {rep['fatal']}"
                   + (", the close gate never opened" if rep["close_gate_timeout"] else ""))
    for s in cnt["samples"]:
        out.append(f"{who}:   {s.strip()}")
    if (rep["recover_seconds"] or 0) > crash_workers.RECOVER_SLOW:
        stats["stuck_waiters"] += 1
        row["stuck"] += 1
        out.append(f"{who}: recover() after the stop took {rep['recover_seconds']} s")
    if rep["close_error"]:
        stats["close_refused"] += 1
        row["close_refused"] += 1
        out.append(f"{who}: close() refused: {rep['close_error']} (open handles counted: "
                   f"{rep['open_handles']})")
    leaks = 0
    for when in ("own_before_close", "own_after_close", "own_after_churn_close"):
        held = rep[when] or {}
        if any(held.values()):
            leaks += sum(held.values())
            out.append(f"{who}: {when.replace('_', ' ')}: {held}")
    if rep["verify_after_close"]:
        leaks += len(rep["verify_after_close"])
        out.append(f"{who}: verify after close: {rep['verify_after_close'][:5]}")
    if leaks:
        stats["own_leaks"] += leaks
        row["own_leaks"] += leaks
    return out


def _check_segment(seg, whose, pids, kinds, victim, stats):
    """After recovery, with every worker gone: nothing held, no rank left, verify clean.
    whose: rank -> the worker last known to hold it; pids: pid -> worker (a rank's pid word
    names its holder, while it has one)."""
    out = []
    cache = seg.cache
    leaked = _leaked(cache)
    stats["leaked_slots"] += leaked
    if leaked:
        out.append(f"{leaked} slot(s) pinned, claimed or Loading after recovery")
    for r in range(cache.max_ranks):
        if r == cache.rank:
            continue
        state, alive = rank_state(cache._seg, r), rank_alive(cache._seg, r)
        if state != lib.UCM_RANK_FREE or alive:
            stats["stale_ranks"] += 1
            j = pids.get(rank_pid(cache._seg, r), whose.get(r))
            kind = "?" if j is None else kinds[j]
            role = "killed" if j == victim else "stopped"
            out.append(f"rank {r} ({kind} worker {j}, {role}) is "
                       f"{'alive' if alive else 'dead'} with state {state} after recovery")
    rep = ucmcache.verify(seg.uuid)
    stats["verify_problems"] += len(rep.problems)
    if not rep.ok:
        out.append(str(rep))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("rounds", nargs="?", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--kinds", default=",".join(KINDS),
                    help=f"comma-separated kinds of worker to draw from (default: "
                         f"{','.join(KINDS)})")
    args = ap.parse_args(argv)
    kinds = tuple(k for k in args.kinds.split(",") if k)
    if not kinds or set(kinds) - set(KINDS):
        ap.error(f"--kinds takes some of {','.join(KINDS)}, got {args.kinds!r}")
    stats = run_rounds(args.rounds, seed=args.seed, workers=args.workers, kinds=kinds,
                       log=lambda m: print(m, file=sys.stderr, flush=True))
    print(json.dumps(stats, indent=2))
    bad = (any(stats[k] for k in FAILURES) or stats["kills"] != stats["rounds"]
           or stats["recovered_ranks"] != stats["expected_recoveries"])
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
