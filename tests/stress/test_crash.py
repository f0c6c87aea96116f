"""Random kills (100 rounds, workers that fork, thread, take signals, detach and attach again,
and not) and corrupted segments: recovery is exact, nothing crashes."""
import asyncio
import multiprocessing as mp
import os
import random
import signal
import sys

import numpy as np
import pytest

import ucmcache
from ucmcache import SlotCache
from ucmcache.lowlevel import shm_path

import crash_workers
import crashloop

SPAWN = mp.get_context("spawn")


# The kinds of worker the in-suite run draws from: every kind, as scripts/crashloop does.
IN_SUITE_KINDS = ("plain", "fork", "threads", "signals", "churn")


def test_random_kills_100_rounds():
    problems = []
    stats = crashloop.run_rounds(100, seed=1234, kinds=IN_SUITE_KINDS, log=problems.append)
    assert problems == []
    assert stats["rounds"] == 100 and stats["kills"] == 100
    for what in crashloop.FAILURES:  # leaked slots, stuck waiters, false hits, verify, ...
        assert stats[what] == 0, (what, stats)
    per_kind = stats["per_kind"]
    assert all(per_kind[k]["kills"] and per_kind[k]["stops"] for k in IN_SUITE_KINDS), per_kind
    # Each rank a victim held (not FREE) when it was killed, exactly once, and nothing else: one
    # for a victim of every kind but churn, 0, 1 or 2 for a churn victim (cut anywhere, inside
    # attach or close too).
    churn = per_kind["churn"]
    assert stats["recovered_ranks"] == stats["expected_recoveries"] == \
        100 - churn["kills"] + churn["ranks_at_kill"], stats
    # The churn workers did detach and attach during their rounds, and checked each rank they
    # gave up.
    assert churn["attaches"] and churn["closes"] and churn["close_checks"], churn
    # Every killed fork worker was recovered while a helper of its still lived.
    assert per_kind["fork"]["kills_with_live_helpers"] == per_kind["fork"]["kills"]


def test_signals_handler_run_inside_itself_raises_nothing():
    """The signals worker's SIGALRM handler, run again inside a run of itself (the timer fired
    before the first run returned: a loaded machine descheduled it) while the first run found a
    frame it leaves alone (Workload.loop outside its try), raises nothing: its exception would
    leave the first run into that frame (it did: a round's worker left its loop, "fatal").  A
    trace function stands in for the second signal: it runs the handler on the first run's
    frame as that run starts, where CPython's check for signals runs it."""
    report = {"interrupts": 0}
    nested = []

    def left_alone():  # stands in for Workload.loop
        on_alarm(signal.SIGALRM, sys._getframe())

    on_alarm = crash_workers.alarm_handler(crash_workers.SoftInterrupt, {left_alone.__code__},
                                           [True], report)

    def second_signal(frame, event, arg):
        if event == "call" and frame.f_code is on_alarm.__code__ and not nested:
            nested.append(frame.f_back.f_code.co_name)
            on_alarm(signal.SIGALRM, frame)
        return None

    sys.settrace(second_signal)
    try:
        left_alone()
    finally:
        sys.settrace(None)
    assert nested == ["left_alone"] and report["interrupts"] == 0
    # On a frame it does not leave alone, it interrupts.
    with pytest.raises(crash_workers.SoftInterrupt):
        on_alarm(signal.SIGALRM, sys._getframe())
    assert report["interrupts"] == 1


def _poke_corrupted(uuid, q):
    """In a child: verify and use a corrupted segment.  Only clean errors may come out."""
    outcomes = []
    try:
        rep = ucmcache.verify(uuid, timeout=0.2)
        outcomes.append("verify-ok" if rep.ok else "verify-report")
    except ucmcache.UcmError as e:
        outcomes.append(type(e).__name__)
    try:
        c = SlotCache.attach(uuid, timeout=0.2)
    except (ucmcache.UcmError, TimeoutError) as e:
        outcomes.append(type(e).__name__)
    else:
        keys = [bytes([i]) * 16 for i in range(20)]
        rows = np.zeros((len(keys), 64), np.uint8)

        def through_handle(k):
            c.exist([k])
            with c.get(k, timeout=0.2) as h:
                if h.owner:
                    h.ready(1)
                else:
                    h.wait(0.2)

        def batch(k):
            with c.get_many(keys[:6]) as hb:
                for i in np.flatnonzero(hb.owner):
                    hb.ready(int(i), 1)
                hb.wait(0.2)
                hb.gather(rows)

        # Each call path of the API once per key in turn, the C miss paths included (a cold
        # get_or_load, put, aget_or_load), so every one meets the flipped words.
        ops = (through_handle, lambda k: c.get_or_load(k, lambda: b"loaded"),
               lambda k: c.put(k, b"put"), batch, lambda k: c.read_many(keys, rows),
               lambda k: c.delete(k, timeout=0.2),
               lambda k: asyncio.run(c.aget_or_load(k, lambda: b"async")),
               lambda k: (c.exist_prefix(keys), len(c), c.size_bytes(), c.stats()))
        try:
            for i, k in enumerate(keys):
                try:
                    ops[i % len(ops)](k)
                    outcomes.append("op-ok")
                except (ucmcache.UcmError, TimeoutError) as e:
                    outcomes.append(type(e).__name__)
        finally:
            try:
                c.close()
            except ucmcache.UcmError:
                pass
    q.put(outcomes)


def test_random_byte_flips_never_crash(make_cache):
    c = make_cache(slots_per_rank=8, slot_size=64, max_ranks=2, n_buckets=8, n_stripes=2)
    for i in range(12):
        c.get_or_load(bytes([i]) * 16, lambda: b"payload")
    with open(shm_path(c.uuid), "rb") as f:
        good = f.read()
    L = c.layout
    # Flip bytes in the header, rank table, bucket heads and slot metadata.  The stripe
    # mutexes are glibc's words (a flipped owner can make a lock look held: a hang, not a
    # crash, and no different from any robust mutex); they are left alone.
    regions = [(0, L.bucket_off), (L.bucket_off, L.stripe_off),
               (L.meta_off, L.ring_off)]
    rnd = random.Random(7)
    seen = set()
    for trial in range(24):
        data = bytearray(good)
        for _ in range(rnd.choice([1, 4, 32])):
            lo, hi = rnd.choice(regions)
            data[rnd.randrange(lo, hi)] ^= 1 << rnd.randrange(8)
        u = f"{c.uuid}-f{trial}"
        fd = os.open(shm_path(u), os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.write(fd, bytes(data))
            os.close(fd)
            q = SPAWN.Queue()
            p = SPAWN.Process(target=_poke_corrupted, args=(u, q))
            p.start()
            p.join(60)
            if p.is_alive():
                p.kill()
                p.join(10)
                pytest.fail(f"trial {trial}: the child hung on a corrupted segment")
            assert p.exitcode == 0, f"trial {trial}: the child died with {p.exitcode}"
            seen.update(q.get(timeout=10))
        finally:
            try:
                SlotCache.unlink(u)
            except ucmcache.SegmentNotFound:
                pass
    assert {"op-ok", "verify-report"} <= seen, seen  # flips were found, and ops still ran
