"""The disk tier's counters (ucmcache.tiers.disk.counters, DESIGN 4.14): one file in the tier's
directory that every process of the node adds into, best effort (a counter that cannot be kept
never fails a get, a publish or the process; an add never waits for another process), summed
by readers that make and write nothing; no count lost but a killed process's own unadded ones."""
import os
import signal

import pytest

from ucmcache import DiskTier, SlotCache

from disk_helpers import CAP, SIZE, _load, segs, small_tmpfs  # noqa: F401
from workers import check_payload, payload_for


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


def _holding_child(stats):
    """Fork a process that takes the counter file's lock (as an add or a reader does) and
    holds it until the parent closes the returned pipe end or kills it; returns (pid, that
    pipe end) once the lock is held."""
    import fcntl
    r, w = os.pipe()
    held_r, held_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.close(w)
            os.close(held_r)
            fd = os.open(os.path.join(stats, "counters"), os.O_RDWR)
            fcntl.flock(fd, fcntl.LOCK_EX)
            os.write(held_w, b"x")
            os.read(r, 1)                           # EOF (or a kill) ends the hold
            code = 0
        finally:
            os._exit(code)
    os.close(r)
    os.close(held_w)
    try:
        assert os.read(held_r, 1) == b"x", "the holding child died before it held the lock"
    finally:
        os.close(held_r)
    return pid, w


def _stats_files(stats):
    return sorted(os.listdir(stats))


def test_every_processs_counts_are_kept_in_one_file(tmp_path):
    """Processes that exited (without closing their counters), one killed and one alive each
    counted: the sum is every count, in one file for the directory however many processes
    counted; a tier of this process adds to it."""
    from ucmcache.tiers.disk.counters import read_all
    path = str(tmp_path / "disk")
    stats = os.path.join(path, "ucm-disk-v1", "stats")
    DiskTier(path, CAP).close()
    w_killed = w_live = None
    try:
        for n in (1, 2):
            _counting_child(stats, n, hold=False)
        killed, w_killed = _counting_child(stats, 4, hold=True)
        live, w_live = _counting_child(stats, 8, hold=True)
        _reap(killed, kill=True)
        assert read_all(stats)["t2_hits"] == 15 and _stats_files(stats) == ["counters"]
        tier = DiskTier(path, CAP)
        tier.counters.add("t2_hits", 16)
        assert tier.stats()["t2_hits"] == 31 and read_all(stats)["t2_hits"] == 31
        tier.close()
        assert read_all(stats)["t2_hits"] == 31 and _stats_files(stats) == ["counters"]
    finally:
        if w_killed is not None:
            os.close(w_killed)
        if w_live is not None:
            os.close(w_live)
            _reap(live, kill=True)


def test_an_add_never_waits_for_the_lock_and_its_counts_go_in_later(tmp_path, monkeypatch):
    """Another process holds the counter file's lock (a holder stopped by a debugger, here a
    process blocked on a pipe): an add returns at once and its counts wait in this process; a
    reader reads without the lock once READ_WAIT has passed; the counts go in with the next add
    after the holder let go, and every count is there."""
    from ucmcache.tiers.disk import counters
    from ucmcache.tiers.disk.counters import ProcessCounters, read_all
    stats = str(tmp_path / "stats")
    _counting_child(stats, 1, hold=False)
    monkeypatch.setattr(counters, "READ_WAIT", 0.01)
    me = ProcessCounters(stats, 0o644)
    pid, w = _holding_child(stats)
    try:
        me.add("t2_hits", 2)                        # the lock is busy: it waits in memory
        assert me.pending[counters.NAMES.index("t2_hits")] == 2 and not me.off
        assert read_all(stats)["t2_hits"] == 1
    finally:
        os.close(w)
        assert os.waitstatus_to_exitcode(_reap(pid)) == 0
    me.add("t2_misses", 4)
    got = read_all(stats)
    assert (got["t2_hits"], got["t2_misses"]) == (3, 4) and not me.pending.any()
    me.close()


def test_a_holder_killed_with_the_lock_costs_no_other_processs_count(tmp_path):
    """A real SIGKILL of a process holding the counter file's lock: the kernel drops the lock;
    what this process counted meanwhile goes in at its close, and nothing counted is lost."""
    from ucmcache.tiers.disk.counters import ProcessCounters, read_all
    stats = str(tmp_path / "stats")
    _counting_child(stats, 1, hold=False)
    me = ProcessCounters(stats, 0o644)
    pid, w = _holding_child(stats)
    try:
        me.add("t2_hits", 2)
    finally:
        _reap(pid, kill=True)
        os.close(w)
    me.close()                                      # adds what waited
    assert read_all(stats)["t2_hits"] == 3


def test_a_counter_file_that_is_not_one_is_never_written_over(tmp_path):
    """A file under the counter file's name that does not read as one (another format, a
    torn copy): an add does not write over it (what it holds is not ours to lose) and counts
    in this process's memory; readers read zeros."""
    from ucmcache.tiers.disk.counters import ProcessCounters, read_all
    stats = str(tmp_path / "stats")
    os.makedirs(stats)
    with open(os.path.join(stats, "counters"), "wb") as f:
        f.write(b"UCMDCNTX" + bytes(200))
    me = ProcessCounters(stats, 0o644)
    me.add("t2_hits", 3)
    assert me.off and me.memory_counts()["t2_hits"] == 3
    with open(os.path.join(stats, "counters"), "rb") as f:
        assert f.read() == b"UCMDCNTX" + bytes(200)
    assert read_all(stats)["t2_hits"] == 0
    me.close()


@pytest.mark.parametrize("odd", ["fifo", "directory", "link"])
def test_an_odd_entry_under_the_counter_files_name_never_blocks_or_fails(tmp_path, odd):
    """A FIFO (opening it to read or write would block), a directory or a link under the
    counter file's name: a read gives zeros and an add counts in memory, neither raises nor
    waits."""
    from ucmcache.tiers.disk.counters import ProcessCounters, read_all
    stats = str(tmp_path / "stats")
    os.makedirs(stats)
    target = os.path.join(stats, "counters")
    if odd == "fifo":
        os.mkfifo(target)
    elif odd == "directory":
        os.mkdir(target)
    else:
        _counting_child(str(tmp_path / "elsewhere"), 5, hold=False)
        os.symlink(str(tmp_path / "elsewhere" / "counters"), target)
    assert read_all(stats)["t2_hits"] == 0
    me = ProcessCounters(stats, 0o644)
    me.add("t2_hits", 3)
    assert me.off and me.memory_counts()["t2_hits"] == 3
    me.close()
    assert read_all(str(tmp_path / "elsewhere"))["t2_hits"] == (5 if odd == "link" else 0)


def test_a_reader_makes_nothing(tmp_path):
    """A tool's read (perhaps as another user, or on a directory no process counted in yet)
    makes no file and no lock, and writes nothing: the directory is left as it was."""
    from ucmcache.tiers.disk.counters import NAMES, read_all
    stats = str(tmp_path / "stats")
    os.makedirs(stats)
    assert read_all(stats) == dict.fromkeys(NAMES, 0) and os.listdir(stats) == []
    _counting_child(stats, 3, hold=False)
    before = os.stat(os.path.join(stats, "counters"))
    assert read_all(stats)["t2_hits"] == 3 and _stats_files(stats) == ["counters"]
    after = os.stat(os.path.join(stats, "counters"))
    assert (after.st_mtime_ns, after.st_ino) == (before.st_mtime_ns, before.st_ino)
