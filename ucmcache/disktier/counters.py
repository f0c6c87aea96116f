"""The disk tier's counters (``t2_*``), kept in its directory so every process of the node and
every tool (``ucmcache tier``, ``inspect --tier``, metrics) sees the same numbers, across
restarts of the processes and re-creations of the segment.

Each process writes its own small file (``stats/<pid>-<random>.cnt``), and only that process
writes it (under a thread lock), as each rank writes only its own counter lines in the segment:
no shared read-modify-write, so a process killed mid-update loses at most its own increment.
Readers sum every file.  A file is 16 bytes of header (magic, count) and int64 counters in
``NAMES`` order; a file whose header does not match is skipped.
"""
from __future__ import annotations

import errno
import logging
import mmap
import os
import secrets
import struct
import threading
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
_MAGIC = b"UCMDSTAT"
_HEAD = struct.Struct("<8sQ")
_SIZE = 4096
assert _HEAD.size + 8 * len(NAMES) <= _SIZE


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
        os.close(fd)
        self._mm = mm
        self._arr = np.frombuffer(mm, dtype=np.int64, count=len(NAMES), offset=_HEAD.size)
        return self._arr

    def close(self) -> None:
        """Unmap the file: a closed tier holds no mapping (a later add makes a new file;
        readers sum every file, so nothing counted is lost)."""
        with self._lock:
            mm, self._mm, self._arr = self._mm, None, None
            if mm is not None:
                try:
                    mm.close()
                except BufferError:
                    pass  # a view of it is still exported somewhere: the finalizer gets it


def read_all(stats_dir: str) -> Dict[str, int]:
    """Every process's counters summed, by name."""
    total = np.zeros(len(NAMES), dtype=np.int64)
    try:
        names = os.listdir(stats_dir)
    except OSError:  # missing, or not a directory: no counter files
        names = []
    for name in names:
        if not name.endswith(".cnt"):
            continue
        try:
            with open(os.path.join(stats_dir, name), "rb") as f:
                raw = f.read(_SIZE)
        except OSError:
            continue
        if len(raw) < _HEAD.size:
            continue
        magic, count = _HEAD.unpack_from(raw, 0)
        if magic != _MAGIC or count > len(NAMES) or len(raw) < _HEAD.size + 8 * count:
            continue
        total[:count] += np.frombuffer(raw, dtype=np.int64, count=count, offset=_HEAD.size)
    return {n: int(v) for n, v in zip(NAMES, total)}


def drop_inherited(c: ProcessCounters) -> None:
    """In a forked child: unmap the parent's counter file without its lock (a parent thread
    may have held it at the fork; it never comes back in the child)."""
    mm, c._mm, c._arr = c._mm, None, None
    if mm is not None:
        try:
            mm.close()
        except BufferError:
            pass
