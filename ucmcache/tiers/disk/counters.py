"""The disk tier's counters (``t2_*``): one file in the tier's directory, ``stats/counters``,
that every process of the node adds into and every tool (``ucmcache tier``, ``inspect --tier``,
metrics) reads, so the numbers outlive the processes and re-creations of the segment.

What they promise is best effort (DESIGN 4.14): counting never fails, blocks or kills a get or
a publish; the readers see every count that reached the file; a process killed loses at most
the counts it had not yet added into the file.  So:

* The file is 16 bytes of header (magic, count) and int64 counters in ``NAMES`` order, one page.
  It is written whole (its blocks allocated) under a temporary name and linked into place, so
  no process sees it short, and a full disk or a file size limit is an error at its making, not
  a torn file.  A file whose header does not match is never written over, and reads as zeros.
* An add is a read-modify-write of the file under an exclusive ``flock`` on it, taken without
  waiting: while another process holds it (a reader, or a holder stopped by a debugger) the
  counts wait in this process (``pending``) and go in with its next add or at its close.  The
  kernel drops a dead holder's lock, so a process killed mid-add costs only its own add.
* Readers take the lock shared, waiting at most ``READ_WAIT`` (then they read without it: a
  stopped holder must not hold a tool), and never make or write anything.
* Any OSError making or writing the file (ENOSPC, EACCES, EMFILE, EFBIG) switches the file off
  for this process: its counts go on in memory, which ``DiskTier.stats`` adds in this process.
"""
from __future__ import annotations

import errno
import fcntl
import logging
import os
import secrets
import stat
import struct
import threading
import time
from typing import Dict, Optional

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
FILE = "counters"
_MAGIC = b"UCMDCNT2"
_HEAD = struct.Struct("<8sQ")
_SIZE = 4096
_BODY = _HEAD.size + 8 * len(NAMES)
assert _BODY <= _SIZE
# A reader waits this long for an add in progress (one takes microseconds); past it (a holder
# stopped by a debugger), it reads without the lock.  A close waits as long to add what waits.
READ_WAIT = 2.0


class ProcessCounters:
    """This process's adds into the counter file of ``stats_dir`` (opened on the first add).

    Best effort: counting must never fail, block or kill a get or a publish.  Any OSError making,
    opening or writing the file switches it off for this process (``off``); its counts go on in
    memory (``pending``), which ``DiskTier.stats`` adds in this process."""

    def __init__(self, stats_dir: str, mode: int):
        self._dir = stats_dir
        self._mode = mode
        self._lock = threading.Lock()
        self._fd = -1               # the counter file, opened read-write on the first add
        self.off = False            # the file could not be kept: counting in memory only
        self.pending = np.zeros(len(NAMES), dtype=np.int64)   # not yet in the file

    def add(self, name: str, n: int = 1) -> None:
        self.add_many({name: n})

    def add_many(self, counts: Dict[str, int]) -> None:
        """Add each name's count, in one read-modify-write of the file."""
        idx = [(NAMES.index(name), n) for name, n in counts.items() if n]
        if not idx:
            return
        with self._lock:
            for i, n in idx:
                self.pending[i] += n
            self._flush(0.0)

    def memory_counts(self) -> Dict[str, int]:
        """What this process counted in memory (its file is off), by name."""
        return {n: int(v) for n, v in zip(NAMES, self.pending)}

    def close(self) -> None:
        """Add what waits (waiting at most READ_WAIT for the lock), then close the file: a
        closed tier holds no fd (a later add opens it again)."""
        with self._lock:
            self._flush(READ_WAIT)
            fd, self._fd = self._fd, -1
            if fd >= 0:
                os.close(fd)

    def _flush(self, wait: float) -> None:
        """Add ``pending`` into the file under its lock (polled for at most ``wait`` seconds);
        where the lock is busy, pending waits for the next add.  Called under self._lock."""
        if self.off or not self.pending.any():
            return
        try:
            if self._fd < 0:
                self._fd = _open_or_make(self._dir, self._mode)
            if not _lock(self._fd, fcntl.LOCK_EX, wait):
                return
            try:
                counts = _counts(os.pread(self._fd, _BODY, 0))
                if counts is None:
                    raise OSError(errno.EINVAL, f"{os.path.join(self._dir, FILE)}: not a "
                                  "counter file")
                counts += self.pending
                _write_all(self._fd, _HEAD.pack(_MAGIC, len(NAMES)) + counts.astype("<i8")
                           .tobytes())
                self.pending[:] = 0
            finally:
                fcntl.flock(self._fd, fcntl.LOCK_UN)
        except OSError as e:
            self.off = True
            log.warning("ucmcache disk tier: cannot keep counters in %s (%s: %s); counting in "
                        "this process's memory", self._dir, type(e).__name__, e)


def _open_regular(path: str, flags: int) -> int:
    """An fd of a regular file (no link followed); OSError if it is not one: a FIFO named like
    the file must block nobody (O_NONBLOCK until it is known)."""
    fd = os.open(path, flags | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, f"{path}: not a regular file")
    except BaseException:
        os.close(fd)
        raise
    return fd


def _open_or_make(stats_dir: str, mode: int) -> int:
    """The counter file opened read-write; made first where there is none: written whole
    (zeros, the blocks allocated) under a temporary name, then linked into place (a process
    that links second opens the first one's)."""
    path = os.path.join(stats_dir, FILE)
    try:
        return _open_regular(path, os.O_RDWR)
    except FileNotFoundError:
        pass
    os.makedirs(stats_dir, exist_ok=True)
    tmp = os.path.join(stats_dir, f".{FILE}.{os.getpid()}-{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode)
    try:
        head = _HEAD.pack(_MAGIC, len(NAMES))
        _write_all(fd, head + bytes(_SIZE - len(head)))
        try:
            os.posix_fallocate(fd, 0, _SIZE)  # where supported: the blocks are reserved
        except OSError as e:
            if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                raise
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass  # another process made it first: its file is the one
    finally:
        os.close(fd)
        os.unlink(tmp)
    return _open_regular(path, os.O_RDWR)


def _write_all(fd: int, data: bytes) -> None:
    done = 0
    while done < len(data):
        n = os.pwrite(fd, data[done:], done)
        if n <= 0:
            raise OSError(errno.ENOSPC, "counter file: short write")
        done += n


def _lock(fd: int, how: int, wait: float) -> bool:
    """flock(fd, how), polled for at most ``wait`` seconds (0: tried once); whether it is held."""
    deadline = time.monotonic() + wait
    while True:
        try:
            fcntl.flock(fd, how | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.001)


def _counts(raw: bytes) -> Optional[np.ndarray]:
    """The counters of the file's bytes (NAMES order, zeros past its count), None if its header
    does not match."""
    if len(raw) < _HEAD.size:
        return None
    got, count = _HEAD.unpack_from(raw, 0)
    if got != _MAGIC or count > len(NAMES) or len(raw) < _HEAD.size + 8 * count:
        return None
    out = np.zeros(len(NAMES), dtype=np.int64)
    out[:count] = np.frombuffer(raw, dtype=np.int64, count=count, offset=_HEAD.size)
    return out


def read_all(stats_dir: str) -> Dict[str, int]:
    """Every process's counts that reached the file, by name (zeros where there is no file, or
    one that is not a counter file).  Read only: never makes, writes or waits past READ_WAIT."""
    counts = None
    try:
        fd = _open_regular(os.path.join(stats_dir, FILE), os.O_RDONLY)
    except OSError:
        fd = -1
    if fd >= 0:
        try:
            _lock(fd, fcntl.LOCK_SH, READ_WAIT)  # past it, read anyway (best effort)
            counts = _counts(os.pread(fd, _BODY, 0))
        except OSError:
            pass
        finally:
            os.close(fd)  # the lock with it
    if counts is None:
        counts = np.zeros(len(NAMES), dtype=np.int64)
    return {n: int(v) for n, v in zip(NAMES, counts)}


def drop_inherited(c: ProcessCounters) -> None:
    """In a forked child: close the parent's counter fd without its lock (a parent thread may
    have held it at the fork; the parent's own descriptor keeps it) and drop the parent's
    pending counts (they are the parent's to add)."""
    fd, c._fd = c._fd, -1
    c.pending = np.zeros(len(NAMES), dtype=np.int64)
    if fd >= 0:
        os.close(fd)
