"""Random-kill harness: workers of several kinds on a busy shared workload, one SIGKILLed at a
random moment per round; the others stop cleanly, a recoverer recovers, and the segment must be
whole: no leaked slot (pinned, claimed or Loading with nobody alive), no stuck waiter, no false
hit, the verifier clean, every dead rank recovered exactly once, and every stopped worker able
to close with nothing of its own left behind.

Kinds of worker (tests/crash_workers.py), chosen per worker per round from --kinds:
  plain    one thread (the original worker)
  fork     forks helpers that never touch the cache and outlive its SIGKILL (os.fork, and
           sometimes a multiprocessing 'fork' Pool): its rank must be recovered while they
           live; the harness kills and reaps them at the end of the round
  threads  3-4 threads on one SlotCache, killed as a whole
  signals  a SIGALRM timer every 0.3-2 ms whose handler raises; the workload carries on

Each round: start the workers (from a forkserver; each leads its own process group) -> all
attached (a gate) -> N operations done (a gate, N random) -> SIGKILL the victim -> M more
operations by the others (a gate, M random, maybe 0: they meet the victim's leftovers) -> open
the stop gate -> join the others (bounded) -> recover and check, helpers of fork workers still
alive -> kill and reap every worker's process group (this process is their subreaper) ->
recover again (a late recovery means a rank was held by a helper) -> if the segment is still
not whole, replace it, so one failing round does not spill into the next.  Ordering is by
gates, every wait bounded.

Run it as `scripts/crashloop [ROUNDS] [--seed S] [--kinds plain,fork,threads,signals]`
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

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)  # crash_workers, workers

import ucmcache  # noqa: E402
from ucmcache import SlotCache  # noqa: E402
from ucmcache._core import lib  # noqa: E402
from ucmcache._hooks import Gate  # noqa: E402
from ucmcache._recovery import rank_alive, rank_state  # noqa: E402
from ucmcache._stats import rank_counters  # noqa: E402
from ucmcache._verify import slot_fields, snapshot  # noqa: E402

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
TOTALS = ("rounds", "kills", "leaked_slots", "stuck_waiters", "false_hits", "recovered_ranks",
          "verify_problems", "worker_errors", "close_refused", "own_leaks", "bad_recoveries",
          "stale_ranks", "late_recoveries", "helpers_reaped", "helpers_left", "segment_resets",
          "failed_rounds")
FAILURES = ("leaked_slots", "stuck_waiters", "false_hits", "verify_problems", "worker_errors",
            "close_refused", "own_leaks", "bad_recoveries", "stale_ranks", "late_recoveries",
            "helpers_left")
KIND_ROW = ("workers", "rounds", "kills", "stops", "failed_rounds", "failed_as_victim", "stuck",
            "errors", "close_refused", "own_leaks", "interrupts", "helpers",
            "kills_with_live_helpers")

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
        self.cache = SlotCache.create(self.uuid, slots_per_rank=6, slot_size=96,
                                      max_ranks=self.workers + 2, n_buckets=8, n_stripes=2)

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
    names = ("progress", "stop", "ready", "helpers", "helpers_stop")
    gates = {name: Gate() for name in names}
    paths = {name: g.path for name, g in gates.items()}
    paths["bad"] = bad.path
    reports = [os.path.join(tmp, f"r{i}-w{j}.json") for j in range(n)]
    bad0 = bad.value
    rec0 = _recoveries(cache)
    # Not daemonic: a fork worker's Pool needs children.  The finally below kills them all.
    ps = [WORKERS.Process(target=crash_workers.worker,
                          args=(kinds[j], seg.uuid, paths, plan["seeds"][j], reports[j]))
          for j in range(n)]
    started = []
    try:
        for p in ps:
            p.start()
            started.append(p)
        why = _wait_gate(gates["ready"], n, ps, START_TIMEOUT)
        if why:
            problems.append(f"workers did not all attach: {why}")
            stats["worker_errors"] += 1
            return problems
        pid_rank = {int(pid): r for r, pid in
                    enumerate(snapshot(cache._seg)["ranks"][:, lib.UCM_R_PID // 4]) if pid}
        ranks = [pid_rank.get(p.pid) for p in ps]
        why = _wait_gate(gates["progress"], plan["kill_at"], ps, PROGRESS_TIMEOUT)
        if why:
            problems.append(f"no progress to {plan['kill_at']} operations: {why}")
        # The kill.
        v = ps[victim]
        os.kill(v.pid, signal.SIGKILL)
        _join(v, 30)
        killed = v.exitcode == -signal.SIGKILL
        stats["kills"] += killed
        per_kind[kinds[victim]]["kills"] += killed
        # The others go on for a while among the victim's leftovers (its pins, its Loading
        # slots: they wait on them, recover it, allocate around it), then stop.
        if plan["after_kill"]:
            others = [p for j, p in enumerate(ps) if j != victim]
            why = _wait_gate(gates["progress"], gates["progress"].value + plan["after_kill"],
                             others, PROGRESS_TIMEOUT)
            if why:
                problems.append(f"no progress to {plan['after_kill']} more operations after "
                                f"the kill: {why}")
        gates["stop"].release()
        # The others stop, bounded.
        deadline = time.monotonic() + JOIN_TIMEOUT
        expect_recovered = 1 if ranks[victim] is not None else 0
        for j, p in enumerate(ps):
            if j == victim:
                continue
            row = per_kind[kinds[j]]
            if not _join(p, deadline - time.monotonic()):  # a survivor that cannot finish
                stats["stuck_waiters"] += 1
                row["stuck"] += 1
                problems.append(f"worker {j} ({kinds[j]}, rank {ranks[j]}) did not stop within "
                                f"{JOIN_TIMEOUT} s: killed")
                p.kill()
                _join(p, 10)
                expect_recovered += 1
                continue
            row["stops"] += 1
            rep = _read_report(reports[j])
            if rep is None:
                problems.append(f"worker {j} ({kinds[j]}) exited with {p.exitcode} and no report")
                stats["worker_errors"] += 1
                row["errors"] += 1
                expect_recovered += 1
                continue
            expect_recovered += not rep["closed"]
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
        if recovered != expect_recovered:
            stats["bad_recoveries"] += 1
            problems.append(f"ranks recovered {recovered} time(s) in the round, expected "
                            f"{expect_recovered} (the victim, and each stopped worker that did "
                            "not close)")
        problems += _check_segment(seg, ranks, kinds, victim, stats)
        hits = bad.value - bad0
        if hits:
            problems.append(f"{hits} false hit(s)")
        return problems
    finally:
        gates["stop"].release()
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
    who = f"worker {j} ({kind}, rank {rank})"
    if cnt["timeouts"] or rep["stuck_threads"]:
        stats["stuck_waiters"] += cnt["timeouts"] + rep["stuck_threads"]
        row["stuck"] += cnt["timeouts"] + rep["stuck_threads"]
        out.append(f"{who}: {cnt['timeouts']} wait(s) timed out, {rep['stuck_threads']} stuck "
                   "thread(s)")
    if cnt["errors"] or rep["fatal"]:
        stats["worker_errors"] += cnt["errors"] + bool(rep["fatal"])
        row["errors"] += cnt["errors"] + bool(rep["fatal"])
        out.append(f"{who}: {cnt['errors']} error(s), fatal: {rep['fatal']}")
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
    for when in ("own_before_close", "own_after_close"):
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


def _check_segment(seg, ranks, kinds, victim, stats):
    """After recovery, with every worker gone: nothing held, no rank left, verify clean."""
    out = []
    cache = seg.cache
    leaked = _leaked(cache)
    stats["leaked_slots"] += leaked
    if leaked:
        out.append(f"{leaked} slot(s) pinned, claimed or Loading after recovery")
    whose = {r: (j, kinds[j]) for j, r in enumerate(ranks) if r is not None}
    for r in range(cache.max_ranks):
        if r == cache.rank:
            continue
        state, alive = rank_state(cache._seg, r), rank_alive(cache._seg, r)
        if state != lib.UCM_RANK_FREE or alive:
            stats["stale_ranks"] += 1
            j, kind = whose.get(r, (None, "?"))
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
    bad = any(stats[k] for k in FAILURES) or stats["kills"] != stats["rounds"]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
