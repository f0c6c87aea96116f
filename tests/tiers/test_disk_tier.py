"""The disk tier (ucmcache.tiers.disk, DESIGN 4.14): block files beneath the segment, shared by
the node's processes, outliving the segment and the processes; a chain of tiers; batches,
forks and the disk above Redis.  Tier directories live under pytest's tmp_path; segments use
the run's uuids (conftest) and are removed.  Steps across processes are ordered by gates and
named points (ucmcache.core.hooks: "disk_lookup", "disk_mid_write", the core's "after_pin");
nothing sleeps."""
import os
import pickle
import shutil
import signal
import uuid as uuidlib

import pytest

from ucmcache import DiskTier, SlotCache, SegmentNotFound
from ucmcache.core import hooks as _hooks
from ucmcache.tiers.disk.fileformat import HEADER_SIZE, BadBlock, decode, file_name, parse_name

import disk_workers as dw
from conftest import run_uuid
from disk_helpers import CAP, SIZE, _block, _keys, _leave_gate, _load, segs  # noqa: F401
from workers import check_payload, payload_for


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
    counter fd (the parent's threads did not follow the fork, and the parent's fd shares the
    parent's lock); both count into the directory's one counter file."""
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
        assert os.listdir(tier._stats_dir) == ["counters"]   # one file, whoever counted
    finally:
        cc.close()


from redis_fixtures import redis_unix, redis_workdir  # noqa: E402,F401 (fixtures)


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
