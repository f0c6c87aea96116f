"""The disk tier (ucmcache.disktier, DESIGN 4.12): block files beneath the segment, shared by
the node's processes, outliving the segment and the processes.  Tier directories live under
pytest's tmp_path; segments use the run's uuids (conftest) and are removed.  Steps across
processes are ordered by gates and named points (ucmcache.core.hooks: "disk_lookup",
"disk_mid_write", the core's "after_pin"); nothing sleeps.
"""
import os
import pickle
import shutil
import signal
import uuid as uuidlib

import pytest

from ucmcache import DiskTier, SlotCache, SegmentNotFound, UcmError
from ucmcache.core import hooks as _hooks
from ucmcache.tiers.disk.fileformat import (HEADER_SIZE, BadBlock, decode, encode_header,
                                          file_name, parse_name)

import disk_workers as dw
from conftest import close_and_unlink, run_uuid
from workers import check_payload, payload_for

SIZE = dw.SIZE
CAP = 1 << 20


def _keys(n):
    return [os.urandom(16) for _ in range(n)]


def _block(key, size=SIZE, offset=0):
    data = payload_for(key, size)
    return encode_header(key, offset, data) + data


@pytest.fixture
def segs():
    """segs(**params) -> a created SlotCache on a fresh uuid of the run; every one is closed
    and unlinked after the test.  segs.recreate(cache, **params): unlink and create again."""
    made = []

    def make(uuid=None, **params):
        params.setdefault("slots_per_rank", 16)
        params.setdefault("slot_size", 256)
        params.setdefault("max_ranks", 4)
        u = uuid or run_uuid("d")
        made.append([u, None])
        made[-1][1] = c = SlotCache.create(u, **params)
        return c

    yield make
    close_and_unlink(made)


def _a_get_right_with_counters_off(uuid, path):
    """In a child whose counter file cannot be kept: one get through the disk tier loads,
    publishes and returns the right bytes, and the tier counts in memory instead."""
    tier = DiskTier(path, CAP)
    cc = SlotCache.attach(uuid, tier2=tier)
    k = os.urandom(16)
    v = cc.get_or_load(k, lambda: payload_for(k, SIZE), timeout=30)
    ok = check_payload(k, bytes(v)) and tier.counters.off
    cc.close()
    return ok


def _load(c, key, runs, size=SIZE):
    v = c.get_or_load(key, lambda: (runs.append(key), payload_for(key, size))[1], timeout=30)
    assert check_payload(key, bytes(v))


# ---------------------------------------------------------------- the block file


def test_block_file_rejects_torn_foreign_corrupt_and_newer_files():
    k, other = _keys(2)
    good = _block(k, offset=7)
    assert bytes(decode(good, k, 7)[2]) == payload_for(k, SIZE)
    cases = {
        "shorter than": good[:HEADER_SIZE - 1],
        r"header says 64 \+ 200": good[:-1],                      # a torn write
        "holds key": good,                                        # read as another key
        "payload checksum": good[:-1] + bytes([good[-1] ^ 1]),    # a flipped bit
        "header checksum": good[:40] + bytes([good[40] ^ 1]) + good[41:],
        "magic": b"X" + good[1:],
        "exceeds the slot size": good,
    }
    for what, buf in cases.items():
        key, limit = (other, None) if what == "holds key" else (k, None)
        if what == "exceeds the slot size":
            limit = SIZE - 1
        with pytest.raises(BadBlock, match=what):
            decode(buf, key, 7, limit)
    # A newer format (its header checksum right) is refused by version, not misread.
    newer = bytearray(good)
    newer[8] = 2
    import struct
    from ucmcache.core.checksum import crc32c
    newer[60:64] = struct.pack("<I", crc32c(bytes(newer[:60])))
    with pytest.raises(BadBlock, match="format version 2"):
        decode(newer, k, 7)
    d, name = file_name(k, 7)
    assert d == k[:1].hex() and parse_name(name) == (k, 7)
    assert parse_name("x.tmp") is None and parse_name("zz-1.ucb") is None


def test_arguments_are_checked_before_anything_is_made(tmp_path):
    with pytest.raises(ValueError, match=r"capacity_bytes must be an int > 64.*got 10"):
        DiskTier(tmp_path / "a", 10)
    with pytest.raises(ValueError, match="timeout must be a positive number"):
        DiskTier(tmp_path / "a", CAP, timeout=0)
    with pytest.raises(TypeError, match="path must be a str or os.PathLike, got int"):
        DiskTier(3, CAP)
    (tmp_path / "f").write_bytes(b"")
    with pytest.raises(ValueError, match="exists and is not a directory"):
        DiskTier(tmp_path / "f", CAP)
    assert not (tmp_path / "a").exists()
    t = DiskTier(tmp_path / "a", CAP, timeout=0.5)
    t2 = pickle.loads(pickle.dumps(t))
    assert (t2.path, t2.capacity_bytes, t2.timeout) == (t.path, CAP, 0.5)
    u = run_uuid("d")
    with pytest.raises(TypeError, match=r"tier2\[1\] must be a ucmcache tier"):
        SlotCache.create(u, slots_per_rank=4, slot_size=64, tier2=[t, "redis://x"])
    with pytest.raises(ValueError, match="tier2 is an empty sequence"):
        SlotCache.create(u, slots_per_rank=4, slot_size=64, tier2=[])
    with pytest.raises(SegmentNotFound):
        SlotCache.unlink(u)


# ---------------------------------------------------------------- across processes


def test_spill_restore_round_trip_across_processes(segs, tmp_path, procs):
    """A process loads; its blocks are written through; the segment is re-created empty and
    another process gets every key from the disk, its loader never running."""
    path = str(tmp_path / "disk")
    c = segs()
    keys = _keys(12)
    p, q = procs.start(dw.load_all, c.uuid, path, CAP, keys)
    r = procs.result(q)
    assert r == {"runs": 12, "ok": True, "flushed": True}
    tier = DiskTier(path, CAP)
    assert len(tier.files()) == 12 and tier.verify().bad == []
    # A block file is the key and its bytes in the tier's own format, nothing of the segment
    # (no layout version, no params): any build reading format 1 reads it.
    for k in keys:
        with open(tier.key_path(k), "rb") as f:
            assert f.read() == _block(k)
    c.close()
    SlotCache.unlink(c.uuid)
    c2 = segs(uuid=c.uuid, slots_per_rank=4)
    before = tier.stats()
    p, q = procs.start(dw.load_all, c2.uuid, path, CAP, keys)
    assert procs.result(q) == {"runs": 0, "ok": True, "flushed": True}
    after = tier.stats()
    assert after["t2_hits"] - before["t2_hits"] == 12
    assert after["t2_read_bytes"] - before["t2_read_bytes"] == 12 * SIZE
    assert after["t2_writes"] == before["t2_writes"]  # nothing written again


def test_a_writer_killed_mid_write_leaves_a_miss_never_wrong_bytes(segs, tmp_path, procs):
    path = str(tmp_path / "disk")
    c = segs()
    k = os.urandom(16)
    p, q = procs.start(dw.die_mid_write, c.uuid, path, CAP, k)
    p.join(60)
    assert p.exitcode == -signal.SIGKILL
    tmp_dir = os.path.join(path, "ucm-disk-v1", "tmp")
    (tmp,) = os.listdir(tmp_dir)                         # the half-written file, unnamed
    assert os.path.getsize(os.path.join(tmp_dir, tmp)) == HEADER_SIZE + SIZE // 2
    half = os.path.join(str(tmp_path), "half")
    shutil.copy(os.path.join(tmp_dir, tmp), half)
    # The next DiskTier on the directory removes the dead writer's temporary file at once
    # (its flock died with it), not only at an eviction pass.
    tier = DiskTier(path, CAP)
    assert os.listdir(tier._tmp) == []
    assert not os.path.exists(tier.key_path(k))
    # Worse than a kill: the half-written bytes under the block's name (a rename that reached
    # the disk before the data did).  The checks on read refuse it: a miss, the file removed.
    os.makedirs(os.path.dirname(tier.key_path(k)), exist_ok=True)
    shutil.copy(half, tier.key_path(k))
    c.close()
    SlotCache.unlink(c.uuid)
    segs(uuid=c.uuid)
    c2_t = SlotCache.attach(c.uuid, tier2=tier)
    try:
        runs = []
        _load(c2_t, k, runs)
        assert runs == [k]                                # a miss: loaded, right bytes
        assert tier.stats()["t2_bad_values"] == 1
        assert tier.flush(30)
        assert tier.verify().bad == [] and len(tier.files()) == 1  # written again, whole
    finally:
        c2_t.close()


def test_a_file_of_another_key_under_a_keys_name_is_a_miss(segs, tmp_path):
    tier = DiskTier(tmp_path / "disk", CAP)
    a, b = _keys(2)
    os.makedirs(os.path.dirname(tier.key_path(b)), exist_ok=True)
    with open(tier.key_path(b), "wb") as f:
        f.write(_block(a))
    c = segs()
    cc = SlotCache.attach(c.uuid, tier2=tier)
    try:
        runs = []
        _load(cc, b, runs)
        assert runs == [b] and tier.stats()["t2_bad_values"] == 1
    finally:
        cc.close()


def test_restart_every_process_killed_segment_removed_then_hits_from_disk(segs, tmp_path,
                                                                         procs, gate):
    """A node restart: two processes load, are SIGKILLed, the segment is removed.  A new
    segment of another layout (larger slots, other sizes: what a new build would make) gets
    every key from the disk."""
    path = str(tmp_path / "disk")
    c = segs()
    keys = _keys(16)
    park = gate(timeout=60)
    started = [procs.start(dw.load_then_park, c.uuid, path, CAP, half, park.path)
               for half in (keys[:8], keys[8:])]
    for p, q in started:
        assert procs.result(q) == {"runs": 8, "ok": True, "flushed": True}
    c.close()
    for p, _ in started:
        p.kill()
        p.join(30)
        assert p.exitcode == -signal.SIGKILL
    SlotCache.unlink(c.uuid)
    assert not os.path.exists(f"/dev/shm/ucmcache-{c.uuid}")
    c2 = segs(slots_per_rank=32, slot_size=512, max_ranks=2)
    p, q = procs.start(dw.load_all, c2.uuid, path, CAP, keys)
    assert procs.result(q) == {"runs": 0, "ok": True, "flushed": True}
    assert DiskTier(path, CAP).stats()["t2_hits"] == 16


def test_two_processes_racing_one_cold_block_read_it_from_disk_once(segs, tmp_path, procs,
                                                                    gate):
    """A holds its lookup at "disk_lookup" (it owns the cold key); B pins the same loading
    slot as a waiter (held at "after_pin"); then A reads the disk once and publishes, and B
    is served A's read: one disk read, no loader anywhere."""
    path = str(tmp_path / "disk")
    tier = DiskTier(path, CAP)
    k = os.urandom(16)
    os.makedirs(os.path.dirname(tier.key_path(k)), exist_ok=True)
    with open(tier.key_path(k), "wb") as f:
        f.write(_block(k))
    c = segs()
    ga, gb = gate(), gate()
    pa, qa = procs.start(dw.get_at_point, c.uuid, path, CAP, k, "disk_lookup", ga.path)
    ga.wait_arrived()                     # A owns the key's slot, about to read the disk
    pb, qb = procs.start(dw.get_at_point, c.uuid, path, CAP, k, "after_pin", gb.path)
    gb.wait_arrived()                     # B holds a pin on A's loading slot: a waiter
    ga.release()
    gb.release()
    assert procs.result(qa) == {"runs": 0, "ok": True}
    assert procs.result(qb) == {"runs": 0, "ok": True}
    s = tier.stats()
    assert (s["t2_hits"], s["t2_misses"]) == (1, 0)
    assert c.stats()["loads_started"] == 1  # one owner in all (A's claim, served from disk)


# ---------------------------------------------------------------- capacity and faults


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


def _leave_gate(tier, g):
    """The held read is a thread of this process: release the gate (twice: also a read that
    reached it late) and wait until that thread has left it, before the fixture unmaps the
    gate's word under it.  With readers=1, a job submitted now runs after the held read."""
    g.release()
    g.release()
    tier._read_pool().submit(int).result(60)


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


# ---------------------------------------------------------------- the chain


def test_a_chain_asks_tiers_in_order_and_copies_upward(segs, tmp_path):
    """[disk A, disk B]: a key only B has is served from B and written to A; a key neither
    has is loaded and written to both."""
    a = DiskTier(tmp_path / "a", CAP)
    b = DiskTier(tmp_path / "b", CAP)
    k_b, k_new = _keys(2)
    os.makedirs(os.path.dirname(b.key_path(k_b)), exist_ok=True)
    with open(b.key_path(k_b), "wb") as f:
        f.write(_block(k_b))
    c = segs()
    cc = SlotCache.attach(c.uuid, tier2=[a, b])
    try:
        runs = []
        _load(cc, k_b, runs)
        _load(cc, k_new, runs)
        assert runs == [k_new]
        assert a.flush(30) and b.flush(30)
        assert {f.block_id for f in a.files()} == {k_b, k_new}
        assert {f.block_id for f in b.files()} == {k_b, k_new}
        sa, sb = a.stats(), b.stats()
        assert (sa["t2_hits"], sa["t2_misses"], sb["t2_hits"], sb["t2_misses"]) == (0, 2, 1, 1)
        # get_many's exist_prefix asks the chain for what the segment lacks.
        cc.clear()
        assert cc.exist_prefix([k_b, k_new, os.urandom(16)]) == 2
    finally:
        cc.close()


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 64 KiB tmpfs mounted under tmp_path (unmounted after), or a skip where this machine
    does not let the test mount one (not root, no CAP_SYS_ADMIN)."""
    import subprocess
    where = tmp_path / "small"
    where.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(where)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip() or r.returncode}")
    try:
        yield str(where)
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


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
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
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


# ---------------------------------------------------------------- batches, forks, under Redis


def test_get_many_is_served_from_disk_where_it_can(segs, tmp_path):
    tier = DiskTier(tmp_path / "disk", CAP)
    keys = _keys(6)
    for k in keys[::2]:
        os.makedirs(os.path.dirname(tier.key_path(k)), exist_ok=True)
        with open(tier.key_path(k), "wb") as f:
            f.write(_block(k))
    c = segs()
    cc = SlotCache.attach(c.uuid, tier2=tier)
    try:
        with cc.get_many(keys, timeout=30) as b:
            assert list(b.owner) == [False, True] * 3
            for i, k in enumerate(keys):
                if b.owner[i]:
                    b.data(i)[:SIZE] = payload_for(k, SIZE)
                    b.ready(i, SIZE)
            b.wait(30)
            assert all(check_payload(k, bytes(b.data(i))) for i, k in enumerate(keys))
        assert tier.flush(30) and len(tier.files()) == 6
        s = tier.stats()
        assert (s["t2_hits"], s["t2_misses"], s["t2_writes"]) == (3, 3, 3)
    finally:
        cc.close()


def test_a_forked_child_writes_and_counts_on_its_own(segs, tmp_path):
    """The child inherits the tier object: it starts its own writer, read pool, usage fd and
    counter file (the parent's threads did not follow the fork, and sharing the parent's
    counter file would lose increments)."""
    tier = DiskTier(tmp_path / "disk", CAP)
    c = segs()
    cc = SlotCache.attach(c.uuid, tier2=tier)
    try:
        runs = []
        _load(cc, os.urandom(16), runs)      # the parent's writer and counter file exist now
        assert tier.flush(30)
        kids = _keys(3)
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                child = SlotCache.attach(c.uuid, tier2=tier)
                for k in kids:
                    child.get_or_load(k, lambda k=k: payload_for(k, SIZE), timeout=30)
                code = 0 if tier.flush(30) else 2
                child.close()
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert {f.block_id for f in tier.files()} >= set(kids)
        assert tier.stats()["t2_writes"] == 4
        # one counter file per process: both were open while the child counted
        assert len(_cnt_files(tier._stats_dir)) == 2
    finally:
        cc.close()


from redis_fixtures import need_redis, redis_unix, redis_workdir  # noqa: E402,F401


def test_disk_above_redis_serves_what_redis_has_and_keeps_a_copy(segs, tmp_path, redis_unix):
    """Two nodes (segments) with their own disks share Redis: a block node A loaded is served
    to node B from Redis and written to B's disk; once B's segment forgets it, B's disk serves
    it and Redis is not asked (the segment's t2_* count the Redis tier)."""
    from ucmcache import RedisTier
    ns = f"disk-{uuidlib.uuid4().hex[:8]}"
    disk_a, disk_b = DiskTier(tmp_path / "a", CAP), DiskTier(tmp_path / "b", CAP)
    ca, cb = segs(), segs()
    a = SlotCache.attach(ca.uuid, tier2=[disk_a, RedisTier(unix_socket=redis_unix.sock,
                                                           namespace=ns, timeout=2.0)])
    red_b = RedisTier(unix_socket=redis_unix.sock, namespace=ns, timeout=2.0)
    b = SlotCache.attach(cb.uuid, tier2=(disk_b, red_b))
    try:
        k = os.urandom(16)
        runs = []
        _load(a, k, runs)
        assert runs == [k]
        a.close()  # flushes both tiers' write-throughs
        _load(b, k, runs)
        assert runs == [k]                                   # from Redis
        assert b.stats()["t2_hits"] == 1
        assert disk_b.flush(30) and [f.block_id for f in disk_b.files()] == [k]
        b.clear()
        _load(b, k, runs)
        assert runs == [k]                                   # from B's disk
        assert b.stats()["t2_hits"] == 1                     # Redis not asked again
        assert disk_b.stats()["t2_hits"] == 1
    finally:
        b.close()


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


# ---------------------------------------------------------------- counters, stuck reads, forks, stopped lock holders


def _fork(child):
    """Run child() in a forked process; its exit code (0: child returned True)."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            code = 0 if child() else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def test_counters_that_cannot_be_kept_never_fail_a_get_or_a_publish(segs, tmp_path):
    """The counter file cannot be made (its directory is a file here: the same path as
    EACCES, EMFILE): the get, its load and the write-through go on; the counts are kept in
    this process's memory and stats() reports them."""
    path = tmp_path / "disk"
    tier = DiskTier(path, CAP)
    os.rmdir(tier._stats_dir)
    open(tier._stats_dir, "w").close()
    c = segs()
    cc = SlotCache.attach(c.uuid, tier2=tier)
    try:
        runs = []
        k = os.urandom(16)
        _load(cc, k, runs)
        assert runs == [k] and tier.flush(30)
        assert [f.block_id for f in tier.files()] == [k]
        s = tier.stats()
        assert (s["t2_misses"], s["t2_writes"]) == (1, 1) and tier.counters.off
    finally:
        cc.close()


def test_a_counter_file_that_cannot_grow_never_kills_or_fails_a_get(segs, tmp_path):
    """A real process whose files cannot grow past 1 KiB (RLIMIT_FSIZE: the kernel's EFBIG,
    as a full disk gives ENOSPC; a sparse counter file written through its map would be
    SIGBUS there): its gets load, publish and return the right bytes."""
    import resource
    path = str(tmp_path / "disk")
    DiskTier(path, CAP).close()
    c = segs()

    def child():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1024, 1024))
        return _a_get_right_with_counters_off(c.uuid, path)

    assert _fork(child) == 0
    assert os.listdir(os.path.join(path, "ucm-disk-v1", "stats")) == []  # no torn file left


def test_a_counter_file_on_a_full_tmpfs_never_kills_the_process(segs, small_tmpfs):
    """A real full filesystem: the counter file's pages cannot be allocated.  A sparse file
    written through a map is SIGBUS; allocated for real first, it is an error, and counting
    goes on in memory."""
    path = os.path.join(small_tmpfs, "disk")
    DiskTier(path, CAP).close()
    fill = os.open(os.path.join(small_tmpfs, "fill"), os.O_WRONLY | os.O_CREAT)
    try:
        while os.write(fill, b"\0" * 4096) > 0:
            pass
    except OSError:
        pass                              # ENOSPC: the filesystem is full
    finally:
        os.close(fill)
    c = segs()

    assert _fork(lambda: _a_get_right_with_counters_off(c.uuid, path)) == 0


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


def test_exist_prefix_is_bounded_and_counts_only_servable_files(segs, tmp_path, gate):
    """exist_prefix (vLLM's scheduler asks it) stats on the read threads under the tier's
    timeout: a disk that does not answer gives 0 in time.  A file a lookup would refuse
    (larger than this cache's slots) is not counted."""
    # A generous timeout while counting (a loaded machine may take long to run the thread),
    # a short one while the stat is held (it always runs out).
    tier = DiskTier(tmp_path / "disk", CAP, timeout=30.0, breaker_failures=100, readers=1)
    c = segs()
    cc = SlotCache.attach(c.uuid, tier2=tier)
    k_ok, k_big, k_after = _keys(3)
    for k, size in ((k_ok, SIZE), (k_big, 1000), (k_after, SIZE)):
        os.makedirs(os.path.dirname(tier.key_path(k)), exist_ok=True)
        with open(tier.key_path(k), "wb") as f:
            f.write(_block(k, size=size))
    g = gate(timeout=10.0)
    try:
        assert cc.exist_prefix([k_ok, k_big, k_after]) == 1
        assert cc.exist_prefix([k_ok, k_after]) == 2
        tier.timeout = 0.2
        _hooks.arm_python("disk_read_io", "gate", g)
        assert cc.exist_prefix([k_ok, k_after]) == 0   # held: past the timeout
        g.wait_arrived()
    finally:
        _hooks.arm_python("disk_read_io", "none")
        _leave_gate(tier, g)
        cc.close()


def test_two_tiers_on_one_path_in_one_process_never_collide(tmp_path, gate):
    """Two DiskTiers on one directory in one process (two caches, one disk): while one
    writer holds its temporary file, the other writes its own (no shared name) and a clean
    leaves the held one alone (its writer's flock says it is alive)."""
    a = DiskTier(tmp_path / "disk", CAP)
    b = DiskTier(tmp_path / "disk", CAP)
    g = gate()
    ka, kb = _keys(2)
    try:
        _hooks.arm_python("disk_mid_write", "gate", g)
        a._put(ka, 0, memoryview(payload_for(ka, SIZE)))
        g.wait_arrived()                      # a's temp file is half written
        (held,) = os.listdir(a._tmp)
        b._put(kb, 0, memoryview(payload_for(kb, SIZE)))
        assert b.flush(30) and b.stats()["t2_write_failures"] == 0
        assert b._clean_tmp() == 0 and os.listdir(a._tmp) == [held]
        g.release()
        assert a.flush(30)
        s = a.stats()
        assert (s["t2_writes"], s["t2_write_failures"]) == (2, 0)
        assert {f.block_id for f in a.files()} == {ka, kb} and os.listdir(a._tmp) == []
        assert a.verify().bad == []
    finally:
        _hooks.arm_python("disk_mid_write", "none")
        g.release()
        a.close()
        b.close()


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


# ---------------------------------------------------------------- ended counter files


def _counting_child(stats, n, hold):
    """Fork a process that counts n t2_hits in the counter directory stats, says so on a pipe,
    then (hold) blocks until the parent closes its other pipe or kills it, or (not hold) exits
    without closing its counters.  Returns (pid, the hold pipe's write end or None) once the
    child has counted."""
    from ucmcache.tiers.disk.counters import ProcessCounters
    r, w = os.pipe()
    done_r, done_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.close(w)
            os.close(done_r)
            ProcessCounters(stats, 0o644).add("t2_hits", n)
            os.write(done_w, b"x")
            if hold:
                os.read(r, 1)                       # EOF (or a kill) ends the hold
            code = 0
        finally:
            os._exit(code)
    os.close(r)
    os.close(done_w)
    try:
        assert os.read(done_r, 1) == b"x", "the counting child died before counting"
    finally:
        os.close(done_r)
    if hold:
        return pid, w
    os.close(w)
    assert os.waitstatus_to_exitcode(_reap(pid)) == 0
    return pid, None


def _reap(pid, kill=False):
    if kill:
        os.kill(pid, signal.SIGKILL)
    _, status = os.waitpid(pid, 0)
    return status


def _cnt_files(stats):
    return sorted(n for n in os.listdir(stats) if n.endswith(".counts"))


class _FoldLockHeld:
    """The fold lock held by this process (a record lock: the children forked meanwhile do
    not inherit it): a fold elsewhere skips (it never waits), so ended files stay until it is
    let go."""

    def __init__(self, stats):
        import fcntl
        os.makedirs(stats, exist_ok=True)
        self.fd = os.open(os.path.join(stats, "fold.lock"), os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.lockf(self.fd, fcntl.LOCK_EX)

    def release(self):
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _fold_elsewhere(stats):
    """fold_ended run by another real process (this one's own files are never folded by
    itself); the names it folded."""
    from ucmcache.tiers.disk.counters import fold_ended
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.close(r)
            os.write(w, pickle.dumps(fold_ended(stats, 0o644)))
            code = 0
        finally:
            os._exit(code)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        out = pickle.loads(f.read())
    assert os.waitstatus_to_exitcode(_reap(pid)) == 0
    return out


def test_ended_counter_files_fold_into_one_sum_and_keep_every_count(tmp_path):
    """Processes that exited, and one killed, leave a counter file each; a DiskTier's
    construction folds them into ended.sum and unlinks them; the totals are what they were,
    and a live process's file (its lock held) is left alone until it ends."""
    from ucmcache.tiers.disk.counters import ProcessCounters, read_all
    path = str(tmp_path / "disk")
    stats = os.path.join(path, "ucm-disk-v1", "stats")
    DiskTier(path, CAP).close()
    w_killed = w_live = None
    try:
        for n in (1, 2):
            _counting_child(stats, n, hold=False)
        killed, w_killed = _counting_child(stats, 4, hold=True)
        live, w_live = _counting_child(stats, 8, hold=True)
        assert read_all(stats)["t2_hits"] == 15 and len(_cnt_files(stats)) == 4
        _reap(killed, kill=True)
        tier = DiskTier(path, CAP)                  # its construction folds
        assert read_all(stats)["t2_hits"] == 15
        left = _cnt_files(stats)
        assert len(left) == 1 and left[0].startswith(f"{live}-")
        assert "ended.sum" in os.listdir(stats)
        tier.counters.add("t2_hits", 16)
        assert tier.stats()["t2_hits"] == 31
        os.close(w_live)                            # the live one ends (never closed)
        w_live = None
        assert os.waitstatus_to_exitcode(_reap(live)) == 0
        tier.close()                                # and this one's file ends with its close
        assert len(_fold_elsewhere(stats)) == 2
        me = ProcessCounters(stats, 0o644)
        me.add("t2_hits", 32)
        assert read_all(stats)["t2_hits"] == 63
        assert len(_cnt_files(stats)) == 1          # only the newest counters' file
        me.close()
    finally:
        if w_killed is not None:
            os.close(w_killed)
        if w_live is not None:
            os.close(w_live)
            _reap(live, kill=True)


def _fold_killed_at_its_first_unlink(stats):
    """A fold in another process, killed (a real SIGKILL) at its first unlink: after its sum's
    rename when it had anything to fold."""
    from ucmcache.tiers.disk.counters import fold_ended
    pid = os.fork()
    if pid == 0:
        try:
            os.unlink = lambda p: os.kill(os.getpid(), signal.SIGKILL)   # dies at the window
            fold_ended(stats, 0o644)
        finally:
            os._exit(3)
    status = _reap(pid)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL


def test_a_fold_killed_between_its_sum_and_its_unlinks_counts_nothing_twice(tmp_path):
    """A real SIGKILL at the fold's first unlink, after ended.sum is renamed into place: the
    folded files are still there, named in the sum, and counted once; the next fold unlinks
    them and the totals stay."""
    from ucmcache.tiers.disk.counters import fold_ended, read_all
    stats = str(tmp_path / "stats")
    for n in (1, 2, 4):
        _counting_child(stats, n, hold=False)
    before = _cnt_files(stats)
    assert len(before) == 3 and read_all(stats)["t2_hits"] == 7
    _fold_killed_at_its_first_unlink(stats)
    assert _cnt_files(stats) == before and "ended.sum" in os.listdir(stats)
    assert read_all(stats)["t2_hits"] == 7
    assert fold_ended(stats, 0o644) == []           # nothing new ended: the leftovers go
    assert _cnt_files(stats) == [] and read_all(stats)["t2_hits"] == 7


def test_a_fold_between_a_counter_files_making_and_its_lock_loses_no_count(tmp_path,
                                                                           monkeypatch):
    """The window the review found: a file made but not yet locked.  Here another process
    folds exactly there (the fold runs inside this process's first flock call): it removes the
    unlocked file being made, this process makes another, and every count it makes after is
    summed."""
    import fcntl
    from ucmcache.tiers.disk import counters
    from ucmcache.tiers.disk.counters import ProcessCounters, read_all
    stats = str(tmp_path / "stats")
    os.makedirs(stats)
    real_flock = fcntl.flock
    seen = []

    def flock_after_a_fold(fd, how):
        if not seen:
            seen.append(os.listdir(stats))
            seen.append(_fold_elsewhere(stats))
        return real_flock(fd, how)

    monkeypatch.setattr(counters.fcntl, "flock", flock_after_a_fold)
    me = ProcessCounters(stats, 0o644)
    me.add("t2_hits", 5)
    monkeypatch.setattr(counters.fcntl, "flock", real_flock)
    made_first = [n for n in seen[0] if n.endswith(".new")]
    assert len(made_first) == 1 and seen[1] == []   # removed, not folded: nothing counted in it
    assert made_first[0] not in os.listdir(stats)
    me.add("t2_hits", 6)
    assert read_all(stats)["t2_hits"] == 11 and len(_cnt_files(stats)) == 1
    assert _fold_elsewhere(stats) == [] and read_all(stats)["t2_hits"] == 11   # locked: kept
    me.close()


def test_a_sum_that_cannot_be_read_is_never_folded_over(tmp_path):
    """An ended.sum that does not read as one (another format, a torn copy): a fold does
    nothing (writing a sum from zero over it would lose what it holds), and the files stay."""
    from ucmcache.tiers.disk.counters import fold_ended
    stats = str(tmp_path / "stats")
    _counting_child(stats, 3, hold=False)
    with open(os.path.join(stats, "ended.sum"), "wb") as f:
        f.write(b"UCMDSENX" + bytes(200))
    files = _cnt_files(stats)
    assert fold_ended(stats, 0o644) == [] and _cnt_files(stats) == files
    with open(os.path.join(stats, "ended.sum"), "rb") as f:
        assert f.read(8) == b"UCMDSENX"


def test_odd_entries_in_the_counter_directory_never_block_or_fail_a_fold_or_a_read(tmp_path):
    """A FIFO named like a counter file (opening it to read would block), a name that is not
    ASCII and a directory: skipped or folded without raising; the totals are right."""
    from ucmcache.tiers.disk.counters import fold_ended, read_all
    stats = str(tmp_path / "stats")
    _counting_child(stats, 3, hold=False)
    odd = os.path.join(stats, "3-\u00e9t\u00e9.counts")
    shutil.copy(os.path.join(stats, _cnt_files(stats)[0]), odd)
    os.mkfifo(os.path.join(stats, "1-fifo.counts"))
    os.mkdir(os.path.join(stats, "2-dir.counts"))
    assert read_all(stats)["t2_hits"] == 6
    folded = fold_ended(stats, 0o644)
    assert "3-\u00e9t\u00e9.counts" in folded and len(folded) == 2
    assert read_all(stats)["t2_hits"] == 6


def test_a_child_forked_while_a_parent_thread_reads_the_counters_can_read_and_fold(tmp_path):
    """The process-local lock beside the fold lock, held by a parent thread at the fork: the
    child gets a free one (it would otherwise wait out READ_WAIT on every read, and never
    fold)."""
    from ucmcache.tiers.disk import counters
    stats = str(tmp_path / "stats")
    _counting_child(stats, 3, hold=False)
    with counters._local:                              # a parent thread inside read_all
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                ok = (not counters._local.locked() and len(counters.fold_ended(stats, 0o644)) == 1
                      and counters.read_all(stats)["t2_hits"] == 3)
                code = 0 if ok else 2
            finally:
                os._exit(code)
    assert os.waitstatus_to_exitcode(_reap(pid)) == 0
    assert _cnt_files(stats) == []


def test_a_fold_lock_that_is_a_fifo_blocks_no_reader_or_fold(tmp_path):
    """fold.lock made a FIFO (by mistake or malice): a reader reads without it at once and a
    fold does nothing; neither blocks."""
    from ucmcache.tiers.disk.counters import fold_ended, read_all
    stats = str(tmp_path / "stats")
    _counting_child(stats, 3, hold=False)
    os.mkfifo(os.path.join(stats, "fold.lock"))
    assert read_all(stats)["t2_hits"] == 3
    assert fold_ended(stats, 0o644) == [] and len(_cnt_files(stats)) == 1


def test_a_fold_names_the_leftovers_it_unlinks(tmp_path):
    """A fold killed after its sum's rename left its files; the next fold unlinks them and its
    own sum still names them, so a reader that read one of them before (without the lock)
    does not count it beside the sum that holds it."""
    from ucmcache.tiers.disk.counters import _read_ended, fold_ended, read_all
    stats = str(tmp_path / "stats")
    for n in (1, 2):
        _counting_child(stats, n, hold=False)
    first = _cnt_files(stats)
    _fold_killed_at_its_first_unlink(stats)
    _counting_child(stats, 4, hold=False)
    assert sorted(fold_ended(stats, 0o644)) != first
    _, named = _read_ended(stats)
    assert set(first) <= named and read_all(stats)["t2_hits"] == 7


def test_a_fold_takes_what_other_processes_made_even_under_its_own_pid(tmp_path):
    """Containers sharing a directory may all run as pid 1: a fold leaves alone the files this
    process made, not the files that carry its pid."""
    from ucmcache.tiers.disk.counters import fold_ended, read_all
    stats = str(tmp_path / "stats")
    _counting_child(stats, 3, hold=False)
    (theirs,) = _cnt_files(stats)
    same_pid = f"{os.getpid()}-{theirs.split('-', 1)[1]}"
    os.rename(os.path.join(stats, theirs), os.path.join(stats, same_pid))
    assert fold_ended(stats, 0o644) == [same_pid] and read_all(stats)["t2_hits"] == 3


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give the directory to another user")
def test_a_tool_run_as_another_user_never_folds(tmp_path):
    """A directory another user owns (a service's tier read by root's CLI): a fold there does
    nothing, so it never leaves a sum its owner cannot read."""
    from ucmcache.tiers.disk.counters import fold_ended, read_all
    stats = str(tmp_path / "stats")
    _counting_child(stats, 3, hold=False)
    os.chown(stats, 65534, 65534)
    assert fold_ended(stats, 0o600) == [] and len(_cnt_files(stats)) == 1
    assert "ended.sum" not in os.listdir(stats) and read_all(stats)["t2_hits"] == 3
