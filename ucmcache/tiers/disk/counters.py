"""The disk tier's counters (``t2_*``), kept in its directory so every process of the node and
every tool (``ucmcache tier``, ``inspect --tier``, metrics) sees the same numbers, across
restarts of the processes and re-creations of the segment.

Each process writes its own small file (``stats/<pid>-<random>.counts``), and only that process
writes it (under a thread lock), as each rank writes only its own counter lines in the segment:
no shared read-modify-write, so a process killed mid-update loses at most its own increment.
A file is 16 bytes of header (magic, count) and int64 counters in ``NAMES`` order; a file whose
header does not match is skipped.

Ended files are folded, so that the directory keeps a file per live process, not one per
process ever:
* A writer holds an exclusive ``flock`` on its file for as long as it may write (its tier open,
  its process alive: the kernel drops a killed process's lock).  The file is made, locked and
  filled under a temporary name (``.new``) and renamed to ``.counts`` only then, so a fold never
  sees an unlocked ``.counts`` of a live writer; a fold may remove an unlocked ``.new`` (its
  maker died, or has not locked it yet: that maker's rename fails and it makes another).
* ``fold_ended`` (a DiskTier's construction by the directory's owner, off every get's path; at
  most ``FOLD_LIMIT`` files a call) adds every unlocked ``.counts`` file into ``stats/ended.sum``,
  under the record lock ``stats/fold.lock`` (not a flock: a process forked meanwhile does not
  inherit it; a fold never waits for it): the sum and the names it took in are renamed into place in one step,
  and only then are those files unlinked.  A file named in ``ended.sum`` is never summed again,
  so a fold killed between its rename and its unlinks counts nothing twice; the next fold
  unlinks what it left.  A fold that cannot read an existing ``ended.sum`` does nothing.
* Readers read the counter files, then ``ended.sum``, and sum it with every file it does not
  name, under the fold lock shared (read only: a reader never makes the lock file).
* ``.cnt`` files (written by earlier versions, which take no lock) are summed and never folded.
"""
from __future__ import annotations

import errno
import fcntl
import logging
import mmap
import os
import secrets
import stat
import struct
import threading
import time
from contextlib import contextmanager
from typing import Dict, Iterator, List, Optional, Set, Tuple

import numpy as np

log = logging.getLogger("ucmcache.disktier")

NAMES = (
    "t2_hits",            # an owner's cold key served from the disk
    "t2_misses",          # not on the disk (or a bad file): the owner loads
    "t2_bypasses",        # the disk skipped: breaker open, read error or past the timeout
    "t2_bad_values",      # block files that failed a check (counted among misses), removed
    "t2_writes",          # block files written (renamed into place)
    "t2_write_dedups",    # write-throughs of a key whose file was there already
    "t2_write_drops",     # write-throughs dropped: breaker open, queue full, larger than capacity
    "t2_write_failures",  # writes that failed (ENOSPC, EFBIG, EIO...): counted by the breaker
    "t2_evictions",       # block files removed to stay under capacity_bytes
    "t2_evicted_bytes",
    "t2_read_bytes",      # payload bytes served
    "t2_written_bytes",   # file bytes written
)
_MAGIC = b"UCMDSTAT"
_HEAD = struct.Struct("<8sQ")
_SIZE = 4096
assert _HEAD.size + 8 * len(NAMES) <= _SIZE
_LIVE = ".counts"       # a process's file, under its flock while it may write
_MAKING = ".new"        # one being made (locked, then renamed to .counts)
_LEGACY = ".cnt"        # earlier versions' files (no lock): summed, never folded
# ended.sum: the same header and counters, then the names of the files it took in (one a line).
_ENDED = "ended.sum"
_ENDED_MAGIC = b"UCMDSEND"
_FOLD_LOCK = "fold.lock"
FOLD_LIMIT = 256        # files one fold takes in at most (the rest: the next fold)
MAKE_TRIES = 3          # a fold may remove a file being made: its maker tries again


class ProcessCounters:
    """This process's counter file in ``stats_dir`` (made on the first add).

    Best effort: counting must never fail or kill a get or a publish.  Any OSError making or
    writing the file (ENOSPC, EACCES, EMFILE, EFBIG...) switches the file off for this process;
    its counts go on in memory (``local``), which ``DiskTier.stats`` adds in this process."""

    def __init__(self, stats_dir: str, mode: int):
        self._dir = stats_dir
        self._mode = mode
        self._lock = threading.Lock()
        self._arr: Optional[np.ndarray] = None
        self._mm: Optional[mmap.mmap] = None
        self._fd = -1               # the file's fd, holding its flock while this process writes
        self.off = False            # the file could not be made: counting in memory only
        self.local = np.zeros(len(NAMES), dtype=np.int64)

    def add(self, name: str, n: int = 1) -> None:
        if not n:
            return
        i = NAMES.index(name)
        with self._lock:
            arr = self._arr
            if arr is None and not self.off:
                try:
                    arr = self._open()
                except OSError as e:
                    self.off = True
                    log.warning("ucmcache disk tier: cannot keep counters in %s (%s: %s); "
                                "counting in this process's memory", self._dir,
                                type(e).__name__, e)
            if arr is None:
                self.local[i] += n
            else:
                arr[i] += n

    def memory_counts(self) -> Dict[str, int]:
        """What this process counted in memory (its file is off), by name."""
        return {n: int(v) for n, v in zip(NAMES, self.local)}

    def _open(self) -> np.ndarray:
        os.makedirs(self._dir, exist_ok=True)
        for _ in range(MAKE_TRIES):
            arr = self._make()
            if arr is not None:
                return arr
        raise OSError(errno.EAGAIN, f"counter file: removed while being made {MAKE_TRIES} times")

    def _make(self) -> Optional[np.ndarray]:
        """Make, lock and fill a file under its .new name, then rename it to .counts; None if a
        fold removed it meanwhile (the caller makes another)."""
        name = f"{os.getpid()}-{secrets.token_hex(4)}"
        base = os.path.join(self._dir, name)
        making = base + _MAKING
        _made_here.update((name + _MAKING, name + _LIVE))
        fd = os.open(making, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, self._mode)
        mm: Optional[mmap.mmap] = None
        made = False
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:  # a fold holds it, and removes it
                return None
            # The pages are allocated for real before the map: a sparse file (ftruncate) on a
            # full disk would be SIGBUS at the first store through the map, killing the process.
            head = _HEAD.pack(_MAGIC, len(NAMES))
            data = head + bytes(_SIZE - len(head))
            done = 0
            while done < _SIZE:
                n = os.pwrite(fd, data[done:], done)
                if n <= 0:
                    raise OSError(errno.ENOSPC, "counter file: short write")
                done += n
            try:
                os.posix_fallocate(fd, 0, _SIZE)  # where supported: the blocks are reserved
            except (AttributeError, OSError) as e:
                if isinstance(e, OSError) and e.errno not in (errno.EOPNOTSUPP, errno.EINVAL,
                                                              errno.ENOSYS):
                    raise
            mm = mmap.mmap(fd, _SIZE)
            try:
                os.rename(making, base + _LIVE)  # locked and whole before any fold sees it
            except FileNotFoundError:  # a fold removed it before our lock
                return None
            made = True
        finally:
            if not made:
                if mm is not None:
                    mm.close()
                os.close(fd)
                try:
                    os.unlink(making)
                except OSError:
                    pass
        self._fd = fd
        self._mm = mm
        self._arr = np.frombuffer(mm, dtype=np.int64, count=len(NAMES), offset=_HEAD.size)
        return self._arr

    def close(self) -> None:
        """Unmap the file: a closed tier holds no mapping (a later add makes a new file;
        readers sum every file, so nothing counted is lost)."""
        with self._lock:
            mm, self._mm, self._arr = self._mm, None, None
            fd, self._fd = self._fd, -1
            if mm is not None:
                try:
                    mm.close()
                except BufferError:
                    pass  # a view of it is still exported somewhere: the finalizer gets it
            if fd >= 0:
                os.close(fd)  # the lock goes: the file has ended, a later fold takes it in


def _counts(raw: bytes, magic: bytes) -> Optional[np.ndarray]:
    """The counters of a file's bytes (NAMES order, zeros past its count), None if its header
    does not match."""
    if len(raw) < _HEAD.size:
        return None
    got, count = _HEAD.unpack_from(raw, 0)
    if got != magic or count > len(NAMES) or len(raw) < _HEAD.size + 8 * count:
        return None
    out = np.zeros(len(NAMES), dtype=np.int64)
    out[:count] = np.frombuffer(raw, dtype=np.int64, count=count, offset=_HEAD.size)
    return out


def _open_regular(path: str, flags: int, mode: int = 0o600) -> int:
    """An fd of a regular file (made with ``mode`` if flags say O_CREAT); OSError if it is not
    one: a FIFO named like our files must block nobody (O_NONBLOCK until it is known)."""
    fd = os.open(path, flags | os.O_NONBLOCK | os.O_CLOEXEC, mode)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, f"{path}: not a regular file")
    except BaseException:
        os.close(fd)
        raise
    return fd


def _read_regular(path: str, limit: int) -> Optional[bytes]:
    """A regular file's first ``limit`` bytes (-1: all of it); None if it is gone, unreadable
    or not a regular file."""
    try:
        fd = _open_regular(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        if limit < 0:
            limit = os.fstat(fd).st_size
        return os.pread(fd, limit, 0)
    except OSError:
        return None
    finally:
        os.close(fd)




def _read_ended(stats_dir: str) -> Optional[Tuple[np.ndarray, Set[str]]]:
    """ended.sum's counters and the names of the files it took in: zeros and none if there is
    no such file; None if there is one that cannot be read as one (a fold then does nothing,
    rather than write a sum from zero over it)."""
    path = os.path.join(stats_dir, _ENDED)
    try:
        os.lstat(path)
    except FileNotFoundError:
        return np.zeros(len(NAMES), dtype=np.int64), set()
    except OSError:
        return None
    raw = _read_regular(path, -1)
    counts = _counts(raw, _ENDED_MAGIC) if raw is not None else None
    if raw is None or counts is None:
        return None
    _, count = _HEAD.unpack_from(raw, 0)
    names = raw[_HEAD.size + 8 * count:].split(b"\n")
    return counts, {os.fsdecode(n) for n in names if n}


# A reader waits this long for a fold in progress (one takes milliseconds); past it (a folder
# stopped by a debugger), it reads without the lock (see read_all).
READ_WAIT = 2.0


# The fold lock is a POSIX record lock (lockf), not a flock: a process forked while it folds
# or reads does not inherit it (a flock's open file would keep it held for the child's life).
# Record locks are per process, so this process's threads take turns through _local first; a
# forked child gets a new one (a parent thread may have held it at the fork).
_local = threading.Lock()
# The names of the counter files this process made: a fold never takes them (on NFS, where
# flock is a record lock, this process's own lock would not keep its live file from it).  Not
# by pid: in containers sharing a directory every worker may be pid 1.  A forked child starts
# with none (the parent's files are the parent's, locked by its descriptors).
_made_here: Set[str] = set()


def _new_local_after_fork() -> None:
    global _local
    _local = threading.Lock()
    _made_here.clear()


os.register_at_fork(after_in_child=_new_local_after_fork)


@contextmanager
def _fold_lock(stats_dir: str, fold: Optional[int], wait: float) -> Iterator[bool]:
    """The fold lock: exclusive for a fold (``fold``: the mode its file is made with, if it
    must be), shared for a reader (None: opened read only, never made), polled for at most
    ``wait`` seconds; yields whether it is held (not when its file cannot be opened)."""
    lock = _local
    if not lock.acquire(blocking=wait > 0, timeout=wait if wait > 0 else -1):
        yield False
        return
    try:
        path = os.path.join(stats_dir, _FOLD_LOCK)
        try:
            if fold is None:
                fd = _open_regular(path, os.O_RDONLY)
            else:
                fd = _open_regular(path, os.O_RDWR | os.O_CREAT, fold)
        except OSError:
            yield False
            return
        try:
            how = fcntl.LOCK_SH if fold is None else fcntl.LOCK_EX
            deadline = time.monotonic() + wait
            while True:
                try:
                    fcntl.lockf(fd, how | fcntl.LOCK_NB)
                    held = True
                    break
                except OSError as e:  # EACCES or EAGAIN: another process has it
                    if e.errno not in (errno.EACCES, errno.EAGAIN) or time.monotonic() >= deadline:
                        held = False
                        break
                    time.sleep(0.001)
            yield held
        finally:
            os.close(fd)  # the record lock with it
    finally:
        lock.release()


def _is_counter_file(name: str) -> bool:
    return name.endswith((_LIVE, _LEGACY))


def read_all(stats_dir: str) -> Dict[str, int]:
    """Every process's counters summed, by name: ended.sum and every file it does not name.

    The files are read before ended.sum: a fold that lands between the two names in ended.sum
    the files it took in, so they are counted once, through it.  Under the fold lock (shared)
    that is exact; without it (READ_WAIT passed, or no lock file yet) only a second fold landing
    during the read can make a file count twice."""
    total = np.zeros(len(NAMES), dtype=np.int64)
    try:
        names = os.listdir(stats_dir)
    except OSError:  # missing, or not a directory: no counter files
        return {n: 0 for n in NAMES}
    with _fold_lock(stats_dir, None, READ_WAIT):
        files: Dict[str, np.ndarray] = {}
        for name in names:
            if not _is_counter_file(name):
                continue
            raw = _read_regular(os.path.join(stats_dir, name), _SIZE)
            counts = _counts(raw, _MAGIC) if raw is not None else None
            if counts is not None:
                files[name] = counts
        ended = _read_ended(stats_dir)
    if ended is not None:
        total += ended[0]
    taken = ended[1] if ended is not None else set()
    for name, counts in files.items():
        if name not in taken:
            total += counts
    return {n: int(v) for n, v in zip(NAMES, total)}


def fold_ended(stats_dir: str, mode: int, limit: int = FOLD_LIMIT) -> List[str]:
    """Fold the ended counter files (no writer holds their lock; at most ``limit``) into
    ended.sum, then unlink them; returns the names folded.  Under the fold lock: one fold at a
    time, no reader meanwhile; none at all when the lock is busy (it is not waited for),
    ended.sum cannot be read, or the directory is another user's (a tool run as root must not
    leave a sum its owner cannot read).  Files this process made are left alone (_made_here)."""
    folded: List[str] = []
    try:
        if os.stat(stats_dir).st_uid != os.geteuid():
            return folded  # another user's directory (a tool run as root): its owner folds
    except OSError:
        return folded
    if not any(n.endswith((_LIVE, _MAKING)) and n not in _made_here or n.startswith(_ENDED + ".")
               for n in os.listdir(stats_dir)):
        return folded  # nothing to fold, nor left by a fold: no lock file made
    with _fold_lock(stats_dir, mode, 0.0) as locked:
        if not locked:
            return folded
        ended = _read_ended(stats_dir)
        if ended is None:
            log.warning("ucmcache disk tier: %s cannot be read as a sum of counters; ended "
                        "counter files are not folded", os.path.join(stats_dir, _ENDED))
            return folded
        total, taken = ended
        leftovers: List[str] = []
        for name in sorted(os.listdir(stats_dir)):
            path = os.path.join(stats_dir, name)
            if name in taken or (name.startswith(_ENDED + ".") and name.endswith(".tmp")):
                # in ended.sum already (a fold died before unlinking it), or a dead fold's temp
                _unlink_quietly(path)
                if name in taken:
                    leftovers.append(name)
                continue
            if (not name.endswith((_LIVE, _MAKING)) or name in _made_here or "\n" in name
                    or len(folded) >= limit):
                continue
            try:
                fd = os.open(path, os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
            except OSError:
                continue
            try:
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    continue
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    continue  # its writer is alive (or still making it)
                if name.endswith(_MAKING):
                    # Its maker died before the rename, or has not locked it yet: that maker's
                    # rename fails and it makes another.  Nothing was counted in it.
                    _unlink_quietly(path)
                    continue
                raw = os.pread(fd, _SIZE, 0)
            finally:
                os.close(fd)
            counts = _counts(raw, _MAGIC)
            if counts is not None:
                total += counts
            folded.append(name)  # a file that does not read as counters goes too
        if not folded:
            return folded
        # The leftovers unlinked above stay named: a reader that read one before this fold
        # (without the lock) must not count it beside the sum that holds it.
        body = (_HEAD.pack(_ENDED_MAGIC, len(NAMES)) + total.astype("<i8").tobytes()
                + b"".join(os.fsencode(n) + b"\n" for n in folded + leftovers))
        tmp = os.path.join(stats_dir, f"{_ENDED}.{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, mode)
        try:
            done = 0
            while done < len(body):
                done += os.write(fd, body[done:])
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            _unlink_quietly(tmp)
            raise
        os.close(fd)
        os.rename(tmp, os.path.join(stats_dir, _ENDED))  # the sum and its names in one step
        for name in folded:
            _unlink_quietly(os.path.join(stats_dir, name))
    return folded


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def drop_inherited(c: ProcessCounters) -> None:
    """In a forked child: unmap the parent's counter file without its lock (a parent thread
    may have held it at the fork; it never comes back in the child)."""
    mm, c._mm, c._arr = c._mm, None, None
    fd, c._fd = c._fd, -1
    if mm is not None:
        try:
            mm.close()
        except BufferError:
            pass
    if fd >= 0:
        os.close(fd)  # the parent's lock stays: the parent's descriptor holds it
