"""The disk tier's faults (DESIGN 4.14): capacity and eviction, a full or slow disk (the write
breaker opens, gets go on), a read that never returns, usage-lock holders that died or
stopped, a signal during the probe, deadlines the tier inherits from the get, a dead writer's
leftovers.  Tier directories live under pytest's tmp_path; segments use the run's uuids
(conftest) and are removed; steps are ordered by gates and named points, nothing sleeps."""
import os
import signal

import pytest

from ucmcache import DiskTier, SlotCache
from ucmcache.core import hooks as _hooks
from ucmcache.tiers.disk.fileformat import HEADER_SIZE

import disk_workers as dw
from disk_helpers import (CAP, SIZE, _block, _keys, _leave_gate, _load, segs,  # noqa: F401
                          small_tmpfs)
from workers import payload_for


def test_eviction_keeps_the_directory_under_capacity_least_recently_used_first(segs, tmp_path):
    file_size = HEADER_SIZE + SIZE
    cap = 6 * file_size
    tier = DiskTier(tmp_path / "disk", cap)
    c = segs(slots_per_rank=4)
    cc = SlotCache.attach(c.uuid, tier2=tier)
    try:
        keys = _keys(6)
        runs = []
        for k in keys:
            _load(cc, k, runs)
        assert tier.flush(30) and tier.used_bytes() == cap
        # Ages set by hand (the LRU clock is the file's mtime): keys[0] oldest ... keys[5].
        for age, k in enumerate(reversed(keys)):
            t = 1_000_000_000_000_000_000 - age * 10 ** 10
            os.utime(tier.key_path(k), ns=(t, t))
        # A hit refreshes keys[0]: it is now the youngest.
        cc.clear()
        runs.clear()
        _load(cc, keys[0], runs)
        assert runs == [] and tier.stats()["t2_hits"] == 1
        # One more block: the pass frees down to 90% of capacity, oldest first (1 and 2).
        extra = os.urandom(16)
        _load(cc, extra, runs)
        assert tier.flush(30)
        on_disk = {f.block_id for f in tier.files()}
        assert on_disk == {keys[0], keys[3], keys[4], keys[5], extra}
        assert tier.used_bytes() == 5 * file_size <= cap
        s = tier.stats()
        assert (s["t2_evictions"], s["t2_evicted_bytes"]) == (2, 2 * file_size)
        # trim: down to any target, oldest first; the usage record follows the files.
        assert tier.trim(2 * file_size) == (3, 2 * file_size)
        assert {f.block_id for f in tier.files()} == {keys[0], extra}
    finally:
        cc.close()


def test_a_full_disk_opens_the_write_breaker_and_gets_go_on(segs, tmp_path, procs):
    """A worker lowers RLIMIT_FSIZE below one block file after its first block is written:
    each later write gets EFBIG from the kernel, the same error path as ENOSPC (a full disk;
    this container cannot mount a small tmpfs).  Two failures open the writes' breaker; gets
    go on (loaded, right bytes); the failed temporary files are removed; reads go on."""
    path = str(tmp_path / "disk")
    c = segs()
    keys = _keys(5)
    p, q = procs.start(dw.full_disk, c.uuid, path, CAP, keys, HEADER_SIZE + 100)
    r = procs.result(q)
    assert r["ok"] and r["runs"] == 5 and r["tmp_left"] == []
    assert r["states"] == ["closed", "open", "open", "open"]
    tier = DiskTier(path, CAP)
    s = tier.stats()
    assert (s["t2_writes"], s["t2_write_failures"], s["t2_write_drops"]) == (1, 2, 2)
    assert [f.block_id for f in tier.files()] == [keys[0]]
    assert tier.used_bytes() == HEADER_SIZE + SIZE  # the failed writes' reservations returned


def test_a_slow_disk_never_holds_a_get_past_the_timeout(segs, tmp_path, gate):
    """The read pool's thread is held (a gate at "disk_read_io" stands for a disk that does
    not answer); the get bypasses the disk after the tier's timeout and loads; after
    breaker_failures such gets the disk is bypassed at once."""
    tier = DiskTier(tmp_path / "disk", CAP, timeout=0.2, breaker_failures=1,
                    breaker_reset=3600.0, readers=1)
    c = segs()
    cc = SlotCache.attach(c.uuid, tier2=tier)
    g = gate()
    try:
        _hooks.arm_python("disk_read_io", "gate", g)
        runs = []
        k1, k2 = _keys(2)
        _load(cc, k1, runs)
        g.wait_arrived()                  # the read is still held: the get went on without it
        assert runs == [k1] and tier.state == "open"
        _load(cc, k2, runs)               # bypassed at once: the breaker is open
        assert runs == [k1, k2]
        s = tier.stats()
        assert s["t2_bypasses"] == 2 and s["t2_hits"] == 0
    finally:
        _hooks.arm_python("disk_read_io", "none")
        _leave_gate(tier, g)
        cc.close()


def test_a_full_tmpfs_opens_the_write_breaker_and_gets_go_on(segs, small_tmpfs):
    """A real ENOSPC: a 64 KiB tmpfs fills up (capacity_bytes is larger than the filesystem).
    Two failures open the writes' breaker; every get is served (loaded, right bytes); what
    was written is still served from the disk."""
    tier = DiskTier(os.path.join(small_tmpfs, "disk"), CAP, breaker_failures=2,
                    breaker_reset=3600.0)
    c = segs(slots_per_rank=64)
    cc = SlotCache.attach(c.uuid, tier2=tier)
    try:
        keys = _keys(60)
        runs = []
        for k in keys:
            _load(cc, k, runs)
            assert tier.flush(30)
        assert runs == keys and tier.write_state == "open"
        s = tier.stats()
        assert s["t2_writes"] >= 1 and s["t2_write_failures"] == 2
        assert s["t2_writes"] + s["t2_write_failures"] + s["t2_write_drops"] == 60
        assert os.listdir(tier._tmp) == []
        written = {f.block_id for f in tier.files()}
        assert len(written) == s["t2_writes"]
        cc.clear()
        runs.clear()
        for k in keys:
            _load(cc, k, runs)
        assert set(runs) == set(keys) - written  # the written ones came back from the disk
    finally:
        cc.close()


# ---------------------------------------------------------------- tools: CLI, inspect, metrics


def _cli(capsys, *args):
    from ucmcache import cli
    rc = cli.main([str(a) for a in args])
    out, err = capsys.readouterr()
    return rc, out, err


def test_cli_lists_verifies_and_trims_a_tier_directory(segs, tmp_path, capsys):
    import json
    path = tmp_path / "disk"
    tier = DiskTier(path, CAP)
    c = segs()
    cc = SlotCache.attach(c.uuid, tier2=tier)
    try:
        keys = _keys(4)
        runs = []
        for k in keys:
            _load(cc, k, runs)
        assert tier.flush(30)
        rc, out, _ = _cli(capsys, "tier", "ls", path, "--json", "--files")
        d = json.loads(out)
        assert rc == 0 and d["files"] == 4 and d["bytes"] == 4 * (HEADER_SIZE + SIZE)
        assert d["counters"]["t2_writes"] == 4 and d["counters"]["t2_misses"] == 4
        assert {b["block_id"] for b in d["blocks"]} == {k.hex() for k in keys}
        rc, out, _ = _cli(capsys, "tier", "ls", path)
        assert rc == 0 and "4 block file(s)" in out and "writes 4" in out
        # inspect --tier and metrics --tier show the tier by its label.
        rc, out, _ = _cli(capsys, "inspect", c.uuid, "--json", "--tier", path)
        assert json.loads(out)["tiers"][tier.label]["counters"]["t2_writes"] == 4
        rc, out, _ = _cli(capsys, "inspect", c.uuid, "--tier", path)
        assert rc == 0 and f"tier {tier.label}" in out
        pytest.importorskip("prometheus_client")
        rc, out, _ = _cli(capsys, "metrics", c.uuid, "--once", "--tier", path)
        assert rc == 0
        assert f'ucmcache_tier_writes_total{{tier="{tier.label}"}} 4.0' in out
        assert f'ucmcache_tier_bytes{{tier="{tier.label}"}} {4 * (HEADER_SIZE + SIZE)}.0' in out
        # verify: a flipped bit is found (exit 1), then removed with --remove-bad.
        victim = tier.key_path(keys[1])
        raw = bytearray(open(victim, "rb").read())
        raw[-1] ^= 1
        open(victim, "wb").write(raw)
        rc, out, _ = _cli(capsys, "tier", "verify", path)
        assert rc == 1 and "3 block file(s) ok, 1 bad" in out and "payload checksum" in out
        rc, out, _ = _cli(capsys, "tier", "verify", path, "--remove-bad")
        assert rc == 0 and "1 removed" in out and not os.path.exists(victim)
        # trim: least recently used first, down to the size asked.
        rc, out, _ = _cli(capsys, "tier", "trim", path, "--to", HEADER_SIZE + SIZE)
        assert rc == 0 and "removed 2 block file(s)" in out
        assert len(tier.files()) == 1 and tier.used_bytes() == HEADER_SIZE + SIZE
        rc, _, err = _cli(capsys, "tier", "ls", tmp_path / "nothing")
        assert rc == 2 and "is not a disk tier directory" in err
    finally:
        cc.close()


def test_bench_disktier_runs_and_the_tier_saves_loader_runs(capsys):
    """The bench (bench/disktier.py) at tiny sizes: its tables come out, and on the trace 10x
    the segment the tier turns loader runs into disk hits (counts, fixed seeds: no timing)."""
    import re
    import sys
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    from bench import disktier
    disktier.main(["--runs", "1", "--total-mb", "1", "--sizes", "65536", "--scan-files", "50",
                   "--trace-requests", "3000"])
    out = capsys.readouterr().out
    assert re.search(r"^\| 65536 \| [\d.]+ \[", out, re.M)
    rows = dict(re.findall(r"^\| (segment only|with DiskTier) \(2560 keys\) \| 3000 \| "
                           r"\d+ \([\d.]+%\) \| (\d+ \| \d+ \| \d+) \|$", out, re.M))
    without_disk, without_runs, distinct = map(int, rows["segment only"].split(" | "))
    disk_hits, with_runs, distinct2 = map(int, rows["with DiskTier"].split(" | "))
    assert without_disk == 0 and disk_hits > 0 and distinct == distinct2
    assert with_runs == without_runs - disk_hits  # every disk hit is a loader run saved
    assert with_runs == distinct                  # each key loaded once, then from disk


def test_a_get_timeout_shorter_than_the_disks_is_not_a_disk_fault(segs, tmp_path, gate):
    """A get's own timeout cuts its wait for the disk short: it loads, and the breaker counts
    nothing against the disk (a caller in a hurry is not a failing disk)."""
    tier = DiskTier(tmp_path / "disk", CAP, timeout=30.0, breaker_failures=1, readers=1)
    c = segs()
    cc = SlotCache.attach(c.uuid, tier2=tier)
    g = gate()
    try:
        _hooks.arm_python("disk_read_io", "gate", g)
        k = os.urandom(16)
        with cc.get(k, timeout=0.05) as h:
            assert h.owner                      # the disk did not answer in time: we load
            h.data[:SIZE] = payload_for(k, SIZE)
            h.ready(SIZE)
        g.wait_arrived()
        assert tier.state == "closed" and tier.stats()["t2_bypasses"] == 1
    finally:
        _hooks.arm_python("disk_read_io", "none")
        _leave_gate(tier, g)
        cc.close()


def test_a_read_that_never_returns_does_not_hold_process_exit(segs, tmp_path):
    """A FIFO under a key's name: the read thread blocks in open() forever (a hung NFS/FUSE
    mount).  The get bypasses the disk after the timeout, and the process still exits (its
    read threads are daemons: nothing joins them at exit)."""
    import subprocess
    import sys
    path = str(tmp_path / "disk")
    c = segs()
    script = f"""
import os, sys
from ucmcache import SlotCache, DiskTier
t = DiskTier({path!r}, {CAP}, timeout=0.2)
c = SlotCache.attach({c.uuid!r}, tier2=t)
key = os.urandom(16)
os.makedirs(os.path.dirname(t.key_path(key)), exist_ok=True)
os.mkfifo(t.key_path(key))
h = c.get(key, timeout=30)
assert h.state == "loading"
h.fail("x"); h.close(); c.close(); t.close()
print("closed", flush=True)
"""
    p = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "closed"
        assert p.wait(60) == 0
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


def _fds():
    return len(os.listdir("/proc/self/fd"))


def _maps_of(d):
    with open("/proc/self/maps") as f:
        return [line for line in f if d in line]


def test_tools_and_closed_tiers_keep_no_fd_or_map(segs, tmp_path):
    """metrics' scrapes and the tools read a tier directory without building a writing tier
    (nothing kept open); a closed DiskTier, or one dropped, holds no fd and no map."""
    import gc
    from ucmcache.tiers.disk.facts import tier_facts
    from ucmcache.metrics import tier_families
    path = str(tmp_path / "disk")
    t = DiskTier(path, CAP)
    t._put(os.urandom(16), 0, memoryview(b"x" * 100))
    assert t.flush(30) and t.used_bytes() == HEADER_SIZE + 100
    t.close()
    gc.collect()
    before = _fds()
    for _ in range(20):
        assert tier_facts(path)["usage_bytes"] == HEADER_SIZE + 100
        tier_families([path])
    assert _fds() == before
    for _ in range(5):
        t = DiskTier(path, CAP)
        t._put(os.urandom(16), 0, memoryview(b"x" * 100))
        assert t.flush(30) and t.used_bytes() > 0
        t.close()
        assert _fds() == before and _maps_of(t._stats_dir) == []
    t = DiskTier(path, CAP)
    assert t.used_bytes() > 0 and t.stats()["t2_writes"] == 6
    t.counters.add("t2_hits", 0)
    del t
    gc.collect()
    assert _fds() == before


def test_a_forked_child_does_not_keep_a_dead_parents_usage_lock(tmp_path):
    """P's thread holds the usage lock when P forks C; P is killed.  The lock goes with P:
    C closed the inherited fd (same open file description) right after the fork."""
    import fcntl
    import threading
    path = str(tmp_path / "disk")
    r, w = os.pipe()
    hold_r, hold_w = os.pipe()   # C waits on it; the test closes its end to let C go
    p = os.fork()
    if p == 0:  # P
        try:
            os.close(r)
            os.close(hold_w)
            t = DiskTier(path, CAP)
            held = threading.Event()

            def writer():
                with t._usage():
                    held.set()
                    threading.Event().wait()

            threading.Thread(target=writer, daemon=True).start()
            held.wait()
            c = os.fork()
            if c == 0:  # C: lives on, never touches the tier
                # Said from C: its after-fork handlers have run (os.fork returned here).
                os.write(w, str(os.getpid()).encode())
                os.close(w)
                os.read(hold_r, 1)
                os._exit(0)
            os.read(hold_r, 1)  # never returns: the test kills P
        finally:
            os._exit(1)
    os.close(w)
    os.close(hold_r)
    cpid = int(os.read(r, 32))
    os.close(r)
    try:
        os.kill(p, signal.SIGKILL)
        os.waitpid(p, 0)
        fd = os.open(os.path.join(path, "ucm-disk-v1", "usage"), os.O_RDWR)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # BlockingIOError: C holds it
        finally:
            os.close(fd)
    finally:
        os.close(hold_w)
        try:
            os.kill(cpid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_a_stopped_usage_lock_holder_never_holds_a_writer_or_a_tool(tmp_path):
    """Another holder keeps the usage lock (a SIGSTOPped process: its own open file, so the
    same as another process for flock).  A write-through waits lock_wait, is dropped and
    counted; used_bytes() reads the record without the lock; close() returns."""
    import fcntl
    import threading
    t = DiskTier(tmp_path / "disk", CAP)
    t.lock_wait = 0.2
    assert t.used_bytes() == 0
    fd = os.open(os.path.join(t.root, "usage"), os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        t._put(os.urandom(16), 0, memoryview(b"x" * 100))
        assert t.flush(30)
        s = t.stats()
        assert (s["t2_writes"], s["t2_write_drops"], s["t2_write_failures"]) == (0, 1, 0)
        assert t.write_state == "closed"        # not the disk's fault
        got = []
        th = threading.Thread(target=lambda: got.append(t.used_bytes()), daemon=True)
        th.start()
        th.join(30)
        assert got == [0]
        assert os.listdir(t._tmp) == []
        t.close()
    finally:
        os.close(fd)   # releases the lock (and a taker blocked on it before the fix)


def test_a_signal_handlers_exception_during_the_probe_leaves_the_disk_usable(segs, tmp_path,
                                                                             gate):
    """The read breaker is open; the next lookup is its half-open probe and, while its read
    is held, a signal handler raises (a timeout alarm, KeyboardInterrupt).  The exception
    reaches the caller (not swallowed as a disk fault) and the probe is resolved: a later
    lookup probes again and serves a block the disk has."""
    import threading
    now = [0.0]
    tier = DiskTier(tmp_path / "disk", CAP, timeout=30.0, breaker_failures=1,
                    breaker_reset=10.0, readers=1, clock=lambda: now[0])
    c = segs()
    cc = SlotCache.attach(c.uuid, tier2=tier)
    k_bad, k_held, k_good = (bytes([i]) + k[1:] for i, k in enumerate(_keys(3)))
    bad_dir = os.path.dirname(tier.key_path(k_bad))
    os.symlink(bad_dir, bad_dir)          # ELOOP above the name: a read error (a link at
    good = tier.key_path(k_good)          # the name itself is a bad block, not an error)
    os.makedirs(os.path.dirname(good), exist_ok=True)
    with open(good, "wb") as f:
        f.write(_block(k_good))

    class Interrupted(Exception):
        pass

    def on_signal(*a):
        raise Interrupted()

    old = signal.signal(signal.SIGUSR1, on_signal)
    g = gate()
    main = threading.get_ident()
    try:
        runs = []
        _load(cc, k_bad, runs)
        assert tier.state == "open"
        now[0] += 11
        _hooks.arm_python("disk_read_io", "gate", g)
        kicker = threading.Thread(target=lambda: (g.wait_arrived(),
                                                  signal.pthread_kill(main, signal.SIGUSR1)))
        kicker.start()
        with pytest.raises(Interrupted):
            cc.get_or_load(k_held, lambda: payload_for(k_held, SIZE), timeout=30)
        kicker.join(30)
        _leave_gate(tier, g)
        now[0] += 11
        _load(cc, k_good, runs)
        assert runs == [k_bad] and tier.state == "closed"
        assert tier.stats()["t2_hits"] == 1
    finally:
        signal.signal(signal.SIGUSR1, old)
        _hooks.arm_python("disk_read_io", "none")
        g.release()
        g.release()
        cc.close()


def test_the_tier_gets_what_the_gets_deadline_leaves(segs, tmp_path, monkeypatch):
    """A get(timeout=1) whose pin took 0.8 s (a clock moved on by the slow path here) gives
    the tier at most the 0.2 s left, not the whole timeout; get_many likewise."""
    import types
    import time as real_time
    import ucmcache.core.batches as batches_mod
    import ucmcache.core.cache as cache_mod
    shift = [0.0]
    fake = types.SimpleNamespace(monotonic=lambda: real_time.monotonic() + shift[0])
    monkeypatch.setattr(cache_mod, "time", fake)
    monkeypatch.setattr(batches_mod, "time", fake, raising=False)
    tier = DiskTier(tmp_path / "disk", CAP, timeout=30.0)
    asked = []
    read_many = tier._read_many
    tier._read_many = lambda keys, limit, timeout: (asked.append(timeout),
                                                    read_many(keys, limit, timeout))[1]
    c = segs()
    cc = SlotCache.attach(c.uuid, tier2=tier)
    pin_slow = cc._pin_slow

    def slow_pin(*a, **kw):
        r = pin_slow(*a, **kw)
        shift[0] += 0.8
        return r

    cc._pin_slow = slow_pin
    pin_slow_many = cc._pin_slow_many   # get_many's misses: one C call for the batch

    def slow_pin_many(*a, **kw):
        pin_slow_many(*a, **kw)
        shift[0] += 0.8

    cc._pin_slow_many = slow_pin_many
    try:
        with cc.get(os.urandom(16), timeout=1.0) as h:
            h.fail("x")
        with cc.get_many([os.urandom(16)], timeout=1.0) as b:
            b.fail(0, "x")
        assert len(asked) == 2 and all(0.0 <= t <= 0.2 + 1e-6 for t in asked), asked
    finally:
        cc.close()


def test_a_disk_probe_out_too_long_expires(tmp_path):
    """A probe whose verdict never comes (its caller died mid-way, by whatever path) expires
    after the tier's probe_expiry: the next lookup probes again instead of the disk staying
    bypassed for the life of the process."""
    now = [0.0]
    tier = DiskTier(tmp_path / "disk", CAP, timeout=1.0, breaker_failures=1,
                    breaker_reset=10.0, clock=lambda: now[0])
    b = tier._breaker
    b.failure(OSError("a read error"))
    now[0] += 10
    assert b.allow() and tier.state == "half-open"   # the probe, never resolved
    assert not b.allow()                             # one probe at a time
    now[0] += 10
    assert b.allow()                                 # expired: probing again
    b.success()
    assert tier.state == "closed"


def test_a_dead_writers_temp_file_and_reservation_go_without_an_eviction(segs, tmp_path,
                                                                          procs):
    """A writer SIGKILLed mid-write on a tier far below capacity: the next DiskTier on the
    directory removes its temporary file at once, and its first write corrects the usage
    record (the dead writer's reservation) from a scan; no eviction pass is needed."""
    path = str(tmp_path / "disk")
    c = segs()
    p, q = procs.start(dw.die_mid_write, c.uuid, path, CAP, os.urandom(16))
    p.join(60)
    assert p.exitcode == -signal.SIGKILL
    tier = DiskTier(path, CAP)
    assert os.listdir(tier._tmp) == []
    k = os.urandom(16)
    tier._put(k, 0, memoryview(payload_for(k, SIZE)))
    assert tier.flush(30)
    assert tier.used_bytes() == sum(f.size for f in tier.files()) == HEADER_SIZE + SIZE
    assert tier.stats()["t2_evictions"] == 0
    tier.close()
