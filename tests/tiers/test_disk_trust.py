"""The disk tier's trust model and the names it must not trip on (DESIGN 4.14: trust; issue 37
items 1, 5, 9, 10): another user's tree or block is refused unless the caller opts in; a FIFO,
a link or a directory at a block's name never blocks and is never served; the capacity is the
directory's; put() replaces the block of its key.  Trees live under pytest's tmp_path;
segments use the run's uuids (conftest) and are removed.  A file of another user can be made
only as root (os.chown to uid 65534): those tests skip otherwise.
"""
import json
import os
import pickle
import stat
import subprocess
import sys

import pytest

from ucmcache import DiskTier, ForeignTierDirectory, SlotCache, TierCapacityMismatch, UcmError
from ucmcache.core import hooks as _hooks
from ucmcache.tiers.disk.fileformat import HEADER_SIZE, decode, encode_header

from disk_helpers import CAP, SIZE, _load, segs  # noqa: F401
from workers import check_payload, payload_for

NOBODY = 65534
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="a file of another user can be made "
                                "only as root (os.chown to uid 65534)")


def _plant(path, key, payload, uid=None, offset=0):
    """A well-formed block file for key at path (its checksums right: only who wrote it, or
    what it is, can tell it apart)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(encode_header(key, offset, payload) + payload)
    if uid is not None:
        os.chown(path, uid, uid)


def _tree(tier):
    return [tier.path, tier.root] + [os.path.join(tier.root, d)
                                     for d in ("blocks", "tmp", "stats")]


# ---------------------------------------------------------------- 1. who may write the tree


def test_a_new_tree_is_made_0700_whatever_the_umask(segs, tmp_path):
    c = segs()
    old = os.umask(0)
    try:
        tier = DiskTier(tmp_path / "a" / "b", CAP)
        cc = SlotCache.attach(c.uuid, tier2=tier)
        _load(cc, os.urandom(16), [])
        assert tier.flush(30)
        cc.close()
    finally:
        os.umask(old)
    (f,) = tier.files()
    for d in [str(tmp_path / "a")] + _tree(tier) + [os.path.dirname(f.path)]:
        assert stat.S_IMODE(os.stat(d).st_mode) == 0o700, d


def test_a_tree_group_or_others_can_write_is_refused_unless_allowed(tmp_path):
    tier = DiskTier(tmp_path / "disk", CAP)
    tier.close()
    for d in _tree(tier):
        os.chmod(d, 0o777)
        with pytest.raises(ForeignTierDirectory,
                           match=rf"{d!r} can be written by group or others \(mode 0o777.*"
                                 "allow_other_user=True"):
            DiskTier(tier.path, CAP)
        DiskTier(tier.path, CAP, allow_other_user=True).close()
        os.chmod(d, 0o700)
    # A fan-out directory the writer would fill, and a link in the tree's place.
    fan = os.path.join(tier.root, "blocks", "ab")
    os.mkdir(fan, 0o700)
    os.chmod(fan, 0o770)
    with pytest.raises(ForeignTierDirectory, match=rf"{fan!r} can be written by group"):
        DiskTier(tier.path, CAP)
    os.rmdir(fan)
    stats = os.path.join(tier.root, "stats")
    os.rename(stats, str(tmp_path / "elsewhere"))
    os.symlink(str(tmp_path / "elsewhere"), stats)
    with pytest.raises(ForeignTierDirectory, match=r"is a symbolic link, not a directory"):
        DiskTier(tier.path, CAP)
    # A sticky directory others can write (as /tmp) may hold the tree.
    os.unlink(stats)
    os.rename(str(tmp_path / "elsewhere"), stats)
    os.chmod(tier.path, 0o1777)
    DiskTier(tier.path, CAP).close()
    # Files it makes with group or others' write bits: only when the caller shares on purpose.
    with pytest.raises(ValueError, match=r"mode 0o660 lets group or others write"):
        DiskTier(tmp_path / "shared", CAP, mode=0o660)
    assert not (tmp_path / "shared").exists()


@needs_root
def test_a_tree_another_user_owns_is_refused_unless_allowed(tmp_path):
    tier = DiskTier(tmp_path / "disk", CAP)
    tier.close()
    for d in _tree(tier):
        os.chown(d, NOBODY, NOBODY)
        with pytest.raises(ForeignTierDirectory, match=rf"{d!r} belongs to uid {NOBODY}, not "
                                                       r"to us \(uid 0\).*allow_other_user=True"):
            DiskTier(tier.path, CAP)
        DiskTier(tier.path, CAP, allow_other_user=True).close()
        os.chown(d, 0, 0)
    assert issubclass(ForeignTierDirectory, UcmError)
    # The tools say how to opt in (root's CLI on a service's directory).
    from ucmcache import cli
    os.chown(tier.root, NOBODY, NOBODY)
    assert cli.main(["tier", "verify", tier.path]) == 2
    assert cli.main(["tier", "verify", tier.path, "--allow-other-user"]) == 0


@needs_root
def test_a_block_another_user_wrote_is_never_served_nor_unpickled(segs, tmp_path):
    """A block file planted by uid 65534 under a key's name, its checksums right: get_or_load
    loads instead, memoize computes instead of unpickling it; counted bad and removed.
    allow_other_user=True trusts it (that is what opting in means)."""
    path = tmp_path / "disk"
    tier = DiskTier(path, CAP)
    c = segs()
    cc = SlotCache.attach(c.uuid, tier2=tier)
    try:
        k = os.urandom(16)
        _plant(tier.key_path(k), k, b"planted by another user", uid=NOBODY)
        runs = []
        _load(cc, k, runs)
        assert runs == [k] and tier.stats()["t2_bad_values"] == 1
        assert tier.flush(30)
        with open(tier.key_path(k), "rb") as f:  # removed, then ours written through
            assert check_payload(k, bytes(decode(f.read(), k, 0)[2]))
        assert os.stat(tier.key_path(k)).st_uid == os.geteuid()

        # memoize through the tier: the block under the key it derives is found by what it
        # wrote (not by knowing its key), then replaced with another user's pickle.
        calls = []

        @cc.memoize("trust")
        def compute(x):
            calls.append(x)
            return x * 2

        before = {f.path for f in tier.files()}
        assert compute(21) == 42 and tier.flush(30)
        (f,) = [f for f in tier.files() if f.path not in before]
        _plant(f.path, f.block_id, pickle.dumps("PLANTED"), uid=NOBODY, offset=f.offset)
        cc.clear()
        assert compute(21) == 42 and calls == [21, 21]
        assert tier.stats()["t2_bad_values"] == 2

        # Opting in: the other user's block is served.
        trusting = DiskTier(path, CAP, allow_other_user=True)
        k2 = os.urandom(16)
        _plant(trusting.key_path(k2), k2, payload_for(k2, SIZE), uid=NOBODY)
        cc.close()
        cc = SlotCache.attach(c.uuid, tier2=trusting)
        runs = []
        _load(cc, k2, runs)
        assert runs == []
    finally:
        cc.close()


def test_a_link_at_a_blocks_name_is_never_followed(segs, tmp_path):
    """A symbolic link to a well-formed block of the key elsewhere: never followed (a link
    lets whoever controls its target choose the bytes); counted bad, the link removed, its
    target untouched."""
    tier = DiskTier(tmp_path / "disk", CAP)
    k = os.urandom(16)
    target = str(tmp_path / "target.ucb")
    _plant(target, k, payload_for(k, SIZE)[::-1])
    os.makedirs(os.path.dirname(tier.key_path(k)))
    os.symlink(target, tier.key_path(k))
    c = segs()
    cc = SlotCache.attach(c.uuid, tier2=tier)
    try:
        runs = []
        _load(cc, k, runs)
        assert runs == [k] and tier.stats()["t2_bad_values"] == 1
        assert os.path.exists(target) and tier.flush(30)
        assert not os.path.islink(tier.key_path(k))
    finally:
        cc.close()


# ---------------------------------------------------------------- 5. what is at a block's name


def test_fifos_at_block_names_never_hold_a_read_thread(segs, tmp_path):
    """Five keys whose names are FIFOs (more than the 4 read threads): each is a bad block,
    removed, and a block on disk is still served afterwards."""
    tier = DiskTier(tmp_path / "disk", CAP, timeout=0.5)
    keys = [os.urandom(16) for _ in range(5)]
    good = os.urandom(16)
    _plant(tier.key_path(good), good, payload_for(good, SIZE))
    fifos = [tier.key_path(k) for k in keys]
    for p in fifos:
        os.makedirs(os.path.dirname(p), exist_ok=True)
        os.mkfifo(p, 0o600)
    c = segs()
    cc = SlotCache.attach(c.uuid, tier2=tier)
    try:
        runs = []
        for k in keys:
            _load(cc, k, runs)
        _load(cc, good, runs)
        assert runs == keys
        s = tier.stats()
        assert (s["t2_bad_values"], s["t2_hits"], s["t2_bypasses"]) == (5, 1, 0)
        assert tier.flush(30)
        for p in fifos:
            assert stat.S_ISREG(os.lstat(p).st_mode)  # removed, then written through
    finally:
        for p in fifos:  # a read held in open() (the code before this fix) is let go
            try:
                os.close(os.open(p, os.O_WRONLY | os.O_NONBLOCK))
            except OSError:
                pass
        cc.close()


def test_a_directory_at_a_blocks_name_is_bad_not_a_dedup(segs, tmp_path):
    """An empty directory at a key's name: a bad block, removed, and the key is written through
    again.  One with something in it stays (removing what is inside is not the tier's call):
    never served, never counted as a dedup, its write-through dropped and counted, the writes'
    breaker untouched."""
    tier = DiskTier(tmp_path / "disk", CAP, breaker_failures=1, breaker_reset=3600.0)
    empty, full = os.urandom(16), os.urandom(16)
    os.makedirs(tier.key_path(empty))
    os.makedirs(tier.key_path(full))
    open(os.path.join(tier.key_path(full), "inside"), "wb").close()
    c = segs()
    cc = SlotCache.attach(c.uuid, tier2=tier)
    try:
        runs = []
        _load(cc, empty, runs)
        _load(cc, full, runs)
        assert tier.flush(30)
        assert stat.S_ISREG(os.lstat(tier.key_path(empty)).st_mode)
        assert os.path.isdir(tier.key_path(full)) and tier.write_state == "closed"
        s = tier.stats()
        assert (s["t2_bad_values"], s["t2_write_dedups"], s["t2_writes"],
                s["t2_write_drops"]) == (2, 0, 1, 1)
        cc.clear()
        runs.clear()
        _load(cc, empty, runs)
        _load(cc, full, runs)
        assert runs == [full]  # the first from disk, the second loaded again
    finally:
        cc.close()


def test_tier_verify_never_blocks_and_reports_what_is_at_each_name(tmp_path):
    tier = DiskTier(tmp_path / "disk", CAP)
    ks = [os.urandom(16) for _ in range(5)]
    _plant(tier.key_path(ks[0]), ks[0], payload_for(ks[0], SIZE))   # good
    os.makedirs(os.path.dirname(tier.key_path(ks[1])), exist_ok=True)
    os.mkfifo(tier.key_path(ks[1]))
    os.makedirs(tier.key_path(ks[2]))
    os.makedirs(os.path.dirname(tier.key_path(ks[3])), exist_ok=True)
    os.symlink(tier.key_path(ks[0]), tier.key_path(ks[3]))
    whats = {tier.key_path(ks[1]): "a FIFO, not a regular file",
             tier.key_path(ks[2]): "a directory, not a regular file",
             tier.key_path(ks[3]): "a symbolic link, not a regular file"}
    if os.geteuid() == 0:
        _plant(tier.key_path(ks[4]), ks[4], payload_for(ks[4], SIZE), uid=NOBODY)
        whats[tier.key_path(ks[4])] = f"owned by uid {NOBODY}, not by us"

    def verify(*more):
        # A child process, bounded: a verify that blocks is killed and fails the test.
        r = subprocess.run([sys.executable, "-m", "ucmcache", "tier", "verify", tier.path,
                            "--json", *more], capture_output=True, text=True, timeout=120)
        return r.returncode, json.loads(r.stdout)

    try:
        rc, d = verify()
        assert rc == 1 and d["ok"] == 1 and d["removed"] == 0
        assert {b["path"]: b["why"] for b in d["bad"]}.keys() == whats.keys()
        for b in d["bad"]:
            assert b["why"].startswith(whats[b["path"]]), b
        rc, d = verify("--remove-bad")
        assert rc == 0 and d["removed"] == len(whats)
        assert [f.block_id for f in tier.files()] == [ks[0]]
        assert not any(os.path.lexists(p) for p in whats)
    finally:
        try:
            os.close(os.open(tier.key_path(ks[1]), os.O_WRONLY | os.O_NONBLOCK))
        except OSError:
            pass


# ---------------------------------------------------------------- 9. one capacity a directory


def test_the_capacity_is_the_directorys_and_another_is_refused(tmp_path, capsys):
    from ucmcache import cli
    path = tmp_path / "disk"
    with pytest.raises(ValueError, match=r"records no capacity_bytes .*: give one"):
        DiskTier(path)
    assert not path.exists()  # refused before anything is made
    DiskTier(path, CAP).close()
    with pytest.raises(TierCapacityMismatch,
                       match=rf"made with capacity_bytes={CAP} \(recorded in .*capacity\), not "
                             rf"{4 * CAP}: .*give {CAP} or None"):
        DiskTier(path, 4 * CAP)
    t = DiskTier(path)
    assert t.capacity_bytes == CAP and pickle.loads(pickle.dumps(t)).capacity_bytes == CAP
    t.close()
    assert cli.main(["tier", "ls", str(path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["capacity_bytes"] == CAP
    assert cli.main(["tier", "ls", str(path)]) == 0
    assert f"capacity 1.0 MiB ({CAP} B)" in capsys.readouterr().out
    # A directory made before the record: the first DiskTier records its capacity; the tools
    # record none.
    os.unlink(os.path.join(t.root, "capacity"))
    assert cli.main(["tier", "trim", str(path), "--to", "0"]) == 0
    assert not os.path.exists(os.path.join(t.root, "capacity"))
    DiskTier(path, 3 * CAP).close()
    assert DiskTier(path).capacity_bytes == 3 * CAP


def test_a_smaller_capacity_never_evicts_a_larger_ones_blocks(segs, tmp_path):
    """The issue's run: 100 blocks under a big tier, then a tier with a small capacity on the
    same path: refused, so the blocks stay."""
    big = DiskTier(tmp_path / "disk", CAP)
    c = segs(slots_per_rank=128)
    cc = SlotCache.attach(c.uuid, tier2=big)
    try:
        runs = []
        for _ in range(100):
            _load(cc, os.urandom(16), runs)
        assert big.flush(30) and len(big.files()) == 100
        with pytest.raises(TierCapacityMismatch):
            DiskTier(tmp_path / "disk", 4 * (HEADER_SIZE + SIZE))
        assert len(big.files()) == 100
    finally:
        cc.close()


# ---------------------------------------------------------------- 10. put under a disk tier


def test_put_replaces_the_older_block_of_its_key(segs, tmp_path):
    """An older value on disk (from before a clear): put stores the new one (True), serves it,
    and writes it over the older block, which is never served again."""
    tier = DiskTier(tmp_path / "disk", CAP)
    c = segs()
    cc = SlotCache.attach(c.uuid, tier2=tier)
    try:
        k = os.urandom(16)
        old, new = b"old value" * 10, b"new value" * 10
        assert cc.get_or_load(k, lambda: old, timeout=30) == old and tier.flush(30)
        cc.clear()
        assert cc.put(k, new) is True
        assert cc[k] == new
        assert cc.put(k, b"third") is False  # Ready in RAM: put replaces nothing there
        assert tier.flush(30)
        cc.clear()
        runs = []
        assert cc.get_or_load(k, lambda: runs.append(k) or b"loaded", timeout=30) == new
        assert runs == [] and tier.stats()["t2_hits"] == 1
    finally:
        cc.close()


def test_an_older_block_is_never_served_while_the_puts_write_is_on_its_way(segs, tmp_path,
                                                                           gate):
    """The writer is held in the middle of the put's write; the value leaves RAM (clear):
    the next get finds no block on disk (the older one went before put returned) and loads;
    the put's value lands afterwards, over anything but itself."""
    tier = DiskTier(tmp_path / "disk", CAP)
    c = segs()
    cc = SlotCache.attach(c.uuid, tier2=tier)
    g = gate()
    try:
        k = os.urandom(16)
        old, new = b"old value" * 10, b"new value" * 10
        assert cc.get_or_load(k, lambda: old, timeout=30) == old and tier.flush(30)
        cc.clear()
        _hooks.arm_python("disk_mid_write", "gate", g)
        assert cc.put(k, new) is True
        g.wait_arrived()
        cc.clear()
        runs = []
        assert cc.get_or_load(k, lambda: runs.append(k) or b"loaded", timeout=30) == b"loaded"
        assert runs == [k]
        g.release()
        assert tier.flush(30)
        with open(tier.key_path(k), "rb") as f:
            assert bytes(decode(f.read(), k, 0)[2]) == new
    finally:
        _hooks.arm_python("disk_mid_write", "none")
        g.release()
        cc.close()


def test_a_put_whose_older_block_cannot_be_removed_stores_nothing(segs, tmp_path, gate):
    """The disk does not answer the removal (its one read thread held at a gate) within the
    tier's timeout: put raises TimeoutError and the key is not stored, so the older block can
    never be served over it."""
    tier = DiskTier(tmp_path / "disk", CAP, timeout=0.2, readers=1)
    c = segs()
    cc = SlotCache.attach(c.uuid, tier2=tier)
    g = gate()
    try:
        k = os.urandom(16)
        _hooks.arm_python("disk_read_io", "gate", g)
        with pytest.raises(TimeoutError, match=r"did not remove the key's older block within "
                                               r"0\.200 s \(nothing stored\)"):
            cc.put(k, b"value")
        assert k not in cc and not tier._replacing
        g.release()
        g.release()
        tier._read_pool().submit(int).result(60)  # the held thread has left the gate
        assert cc.put(k, b"value") is True and cc[k] == b"value"
    finally:
        _hooks.arm_python("disk_read_io", "none")
        g.release()
        cc.close()
