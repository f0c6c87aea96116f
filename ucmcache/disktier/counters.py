"""The disk tier's counters (``t2_*``), kept in its directory so every process of the node and
every tool (``ucmcache tier``, ``inspect --tier``, metrics) sees the same numbers, across
restarts of the processes and re-creations of the segment.

Each process writes its own small file (``stats/<pid>-<random>.cnt``), and only that process
writes it (under a thread lock), as each rank writes only its own counter lines in the segment:
no shared read-modify-write, so a process killed mid-update loses at most its own increment.
A file is 16 bytes of header (magic, count) and int64 counters in ``NAMES`` order; a file whose
header does not match is skipped.

A file's writer holds an exclusive ``flock`` on it for as long as it may write (its tier open,
its process alive: the kernel drops the lock of a killed process).  So that the directory does
not grow by a file per process for ever, a process making its file first folds every unlocked
(ended) file into ``stats/ended.sum`` under ``stats/fold.lock`` (a record lock, which a forked
child does not inherit; a fold never waits for it): the sum and the names it took in are
renamed into place in one step, and only then are those files unlinked.  A file named in
``ended.sum`` is never summed again, so a fold killed between its rename and its unlinks counts
nothing twice; the next fold unlinks what it left.  Readers sum ``ended.sum`` and every file it
does not name, under the fold lock shared, so no fold moves counts while they read.
"""
from __future__ import annotations

import errno
import fcntl
import logging
import mmap
import os
import secrets
import struct
import threading
import time
from typing import Dict, Iterator, List, Optional, Set, Tuple
from contextlib import contextmanager

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
# ended.sum: the same header and counters, then the names of the files it took in (one a line).
_ENDED = "ended.sum"
_ENDED_MAGIC = b"UCMDSEND"
_FOLD_LOCK = "fold.lock"


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
        path = os.path.join(self._dir, f"{os.getpid()}-{secrets.token_hex(4)}.cnt")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, self._mode)
        try:
            # Locked before anything is written: a fold never takes a file being made.
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
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
        except BaseException:
            os.close(fd)
            try:
                os.unlink(path)
            except OSError:
                pass
            raise
        self._fd = fd
        self._mm = mm
        self._arr = np.frombuffer(mm, dtype=np.int64, count=len(NAMES), offset=_HEAD.size)
        try:
            fold_ended(self._dir, self._mode)
        except OSError as e:  # best effort: the files stay, and are summed as they are
            log.warning("ucmcache disk tier: cannot fold ended counter files in %s (%s: %s)",
                        self._dir, type(e).__name__, e)
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


def _read(path: str, limit: int = -1) -> Optional[bytes]:
    try:
        with open(path, "rb") as f:
            return f.read(limit)
    except OSError:
        return None


def _read_ended(stats_dir: str) -> Tuple[np.ndarray, Set[str]]:
    """ended.sum's counters and the names of the files it took in (zeros and none if there is
    no such file, or it does not read as one)."""
    raw = _read(os.path.join(stats_dir, _ENDED))
    counts = _counts(raw, _ENDED_MAGIC) if raw is not None else None
    if raw is None or counts is None:
        return np.zeros(len(NAMES), dtype=np.int64), set()
    _, count = _HEAD.unpack_from(raw, 0)
    names = raw[_HEAD.size + 8 * count:].decode("ascii", "replace").split("\n")
    return counts, {n for n in names if n}


# A reader waits this long for a fold in progress (one takes milliseconds); past it (a folder
# stopped by a debugger), it reads without the lock and may count a file being folded twice.
READ_WAIT = 2.0


# The fold lock is a POSIX record lock (lockf), not a flock: a process forked while it folds
# or reads does not inherit it (a flock's open file would keep it held for the child's life).
# Record locks are per process, so this process's threads take turns through _local first.
_local = threading.Lock()


@contextmanager
def _fold_lock(stats_dir: str, how: int, wait: float) -> Iterator[bool]:
    """The fold lock taken as ``how`` (LOCK_SH to read, LOCK_EX to fold), polled for at most
    ``wait`` seconds; yields whether it is held (not when its file cannot be opened or made, as
    in a read-only directory, where nothing folds)."""
    if not _local.acquire(blocking=wait > 0, timeout=wait if wait > 0 else -1):
        yield False
        return
    try:
        path = os.path.join(stats_dir, _FOLD_LOCK)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
        except OSError:
            try:
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            except OSError:
                yield False
                return
        try:
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
        _local.release()


def read_all(stats_dir: str) -> Dict[str, int]:
    """Every process's counters summed, by name: ended.sum and every file it does not name."""
    total = np.zeros(len(NAMES), dtype=np.int64)
    try:
        names = os.listdir(stats_dir)
    except OSError:  # missing, or not a directory: no counter files
        return {n: 0 for n in NAMES}
    with _fold_lock(stats_dir, fcntl.LOCK_SH, READ_WAIT):
        ended, taken = _read_ended(stats_dir)
        total += ended
        for name in names:
            if not name.endswith(".cnt") or name in taken:
                continue
            raw = _read(os.path.join(stats_dir, name), _SIZE)
            counts = _counts(raw, _MAGIC) if raw is not None else None
            if counts is not None:
                total += counts
    return {n: int(v) for n, v in zip(NAMES, total)}


def fold_ended(stats_dir: str, mode: int) -> List[str]:
    """Fold every ended counter file (no writer holds its lock) into ended.sum, then unlink
    it; returns the names folded.  Under the fold lock: one fold at a time, no reader
    meanwhile; none at all when the lock is busy."""
    folded: List[str] = []
    # Not waited for: this runs on a process's first count (a get's path); when another
    # process folds or reads, the next first count folds.
    with _fold_lock(stats_dir, fcntl.LOCK_EX, 0.0) as locked:
        if not locked:
            return folded
        total, taken = _read_ended(stats_dir)
        for name in os.listdir(stats_dir):
            # in ended.sum already (a fold died before unlinking it), or a dead fold's temp
            if name in taken or (name.startswith(_ENDED + ".") and name.endswith(".tmp")):
                try:
                    os.unlink(os.path.join(stats_dir, name))
                except FileNotFoundError:
                    pass
        for name in sorted(os.listdir(stats_dir)):
            if not name.endswith(".cnt") or name in taken:
                continue
            path = os.path.join(stats_dir, name)
            try:
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            except OSError:
                continue
            try:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    continue  # its writer is alive
                raw = os.pread(fd, _SIZE, 0)
            finally:
                os.close(fd)
            counts = _counts(raw, _MAGIC)
            if counts is not None:
                total += counts
            folded.append(name)  # a file that does not read as counters goes too
        if not folded:
            return folded
        body = (_HEAD.pack(_ENDED_MAGIC, len(NAMES)) + total.astype("<i8").tobytes()
                + "".join(n + "\n" for n in folded).encode("ascii"))
        tmp = os.path.join(stats_dir, f"{_ENDED}.{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, mode)
        try:
            done = 0
            while done < len(body):
                done += os.write(fd, body[done:])
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            os.unlink(tmp)
            raise
        os.close(fd)
        os.rename(tmp, os.path.join(stats_dir, _ENDED))  # the sum and its names in one step
        for name in folded:
            try:
                os.unlink(os.path.join(stats_dir, name))
            except FileNotFoundError:
                pass
    return folded


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
