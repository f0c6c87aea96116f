"""The disk tier's counters (ucmcache.tiers.disk.counters, DESIGN 4.14): kept in the tier's
directory across the node's processes, best effort (a counter that cannot be kept never fails
a get, a publish or the process), summed by readers, the files of ended processes folded
into one sum with no count lost or counted twice."""
import os
import pickle
import shutil
import signal

import pytest

from ucmcache import DiskTier, SlotCache

import disk_workers as dw
from conftest import close_and_unlink, run_uuid
from workers import check_payload, payload_for

SIZE = dw.SIZE
CAP = 1 << 20


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


def _cnt_files(stats):
    return sorted(n for n in os.listdir(stats) if n.endswith(".counts"))


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
