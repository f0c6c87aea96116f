"""Random-kill harness: workers on a busy shared workload, one SIGKILLed at a random moment per
round; after each round the survivor stops, a recoverer recovers, and the verifier must find the
segment whole: no leaked slot (pinned, claimed or Loading with nobody alive), no stuck waiter,
no false hit over the whole run.

Run it as `scripts/crashloop [ROUNDS]` (default 1000) or call run_rounds() from a test.
"""
import argparse
import json
import multiprocessing as mp
import os
import random
import signal
import sys
import time
import uuid as uuidlib

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import ucmcache  # noqa: E402
from ucmcache import SlotCache  # noqa: E402
from ucmcache._hooks import Gate  # noqa: E402
from ucmcache._verify import slot_fields, snapshot  # noqa: E402

from workers import check_payload, payload_for  # noqa: E402

SPAWN = mp.get_context("spawn")
N_KEYS = 48


def chaos_worker(uuid, progress_path, stop_path, bad_path, seed):
    """Busy mixed workload until the stop gate opens (or until killed)."""
    rnd = random.Random(seed)
    progress, stop, bad = Gate(progress_path), Gate(stop_path), Gate(bad_path)
    c = SlotCache.attach(uuid, timeout=30)
    keys = [i.to_bytes(8, "little") * 2 for i in range(N_KEYS)]
    size = c.slot_size
    try:
        while stop.value == 0:
            r = rnd.random()
            try:
                if r < 0.75:
                    k = keys[rnd.randrange(N_KEYS)]
                    v = c.get_or_load(k, lambda k=k: payload_for(k, size), timeout=20)
                    if not check_payload(k, v):
                        bad.release()
                elif r < 0.9:
                    batch = [keys[rnd.randrange(N_KEYS)] for _ in range(3)]
                    with c.get_many(batch, timeout=20) as b:
                        for i, k in enumerate(batch):
                            if b.owner[i]:
                                p = payload_for(k, size)
                                b.data(i)[: len(p)] = p
                                b.ready(i, len(p))
                        b.wait()
                        for i, k in enumerate(batch):
                            if not check_payload(k, bytes(b.data(i))):
                                bad.release()
                else:
                    c.exist([keys[rnd.randrange(N_KEYS)] for _ in range(4)])
            except (ucmcache.LoadFailed, ucmcache.CacheFull):
                pass  # a killed loader's waiters, or a full cache: allowed outcomes
            progress.release()
    finally:
        c.close()
        for g in (progress, stop, bad):
            g.close()


def run_rounds(rounds, *, seed=0, workers=2, log=None):
    rnd = random.Random(seed)
    uuid = f"crash-{os.getpid()}-{uuidlib.uuid4().hex[:8]}"
    cache = SlotCache.create(uuid, slots_per_rank=6, slot_size=96, max_ranks=workers + 2,
                             n_buckets=8, n_stripes=2)
    bad = Gate()
    stats = {"rounds": 0, "kills": 0, "leaked_slots": 0, "stuck_waiters": 0, "false_hits": 0,
             "recovered_ranks": 0, "verify_problems": 0, "seconds": 0.0}
    t0 = time.monotonic()
    try:
        for rnd_i in range(rounds):
            progress, stop = Gate(), Gate()
            ps = [SPAWN.Process(target=chaos_worker, daemon=True,
                                args=(uuid, progress.path, stop.path, bad.path, rnd.random()))
                  for _ in range(workers)]
            try:
                for p in ps:
                    p.start()
                progress.wait_value(rnd.randint(1, 400), timeout=60)
                victim = rnd.choice(ps)
                os.kill(victim.pid, signal.SIGKILL)
                victim.join(30)
                stats["kills"] += victim.exitcode == -signal.SIGKILL
                stop.release()
                for p in ps:
                    p.join(60)
                    if p.is_alive():          # a survivor that cannot finish: a stuck waiter
                        stats["stuck_waiters"] += 1
                        p.kill()
                        p.join(10)
            finally:
                stop.release()
                progress.close()
                stop.close()
            stats["recovered_ranks"] += cache.recover().count
            rep = ucmcache.verify(uuid)
            f = slot_fields(snapshot(cache._seg)["metas"])
            leaked = int((f["reference"] != 0).sum()) + int((f["state"] == 1).sum())
            stats["leaked_slots"] += leaked
            stats["verify_problems"] += len(rep.problems)
            stats["rounds"] += 1
            if log and (not rep.ok or leaked):
                log(f"round {rnd_i}: leaked {leaked}, {rep}")
        stats["false_hits"] = bad.value
    finally:
        stats["seconds"] = round(time.monotonic() - t0, 1)
        bad.close()
        cache.close()
        SlotCache.unlink(uuid)
    return stats


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("rounds", nargs="?", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workers", type=int, default=2)
    args = ap.parse_args(argv)
    stats = run_rounds(args.rounds, seed=args.seed, workers=args.workers,
                       log=lambda m: print(m, file=sys.stderr))
    print(json.dumps(stats, indent=2))
    bad = stats["leaked_slots"] or stats["stuck_waiters"] or stats["false_hits"] \
        or stats["verify_problems"] or stats["kills"] != stats["rounds"]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
