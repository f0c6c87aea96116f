"""DiskTier: a tier on a local directory, shared by every process of the node that uses the
same path (DESIGN 4.14).

Layout of the directory (``<path>/ucm-disk-v1/``, versioned with the file format):

* ``blocks/<xx>/<block id hex>-<offset hex>.ucb``: one file per key (ucmcache.disktier.fileformat);
  the filesystem is the index: a lookup opens the key's name, nothing is loaded at start;
* ``tmp/<pid>.<n>.tmp``: files being written; renamed into ``blocks/`` when complete, so a
  writer killed mid-write leaves only a temporary file (removed by the next scan);
* ``usage``: the bytes the blocks take (a u64), read and written under ``flock`` on it, the
  lock also serialising eviction passes across processes;
* ``stats/``: the counters (ucmcache.disktier.counters).

Reads run on a small per-process pool of threads so that the get waiting for them waits at most
``timeout``; write-throughs are copied on the owner's thread and written by one background
writer thread per process.  A read error or a read past the timeout counts against the reads'
circuit breaker (ucmcache.tier2.breaker; open: gets load as if the disk were absent); a write
error (ENOSPC, EFBIG, EIO) against the writes' (open: write-throughs are dropped, reads go on).
"""
from __future__ import annotations

import atexit
import errno
import fcntl
import logging
import os
import struct
import threading
import time
import weakref
from collections import deque
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Any, Callable, Dict, Iterator, List, NamedTuple, Optional, Sequence, Tuple

from .. import _hooks
from .._tier import BoundTier, Owned, Tier
from ..tier2.breaker import Breaker
from .counters import ProcessCounters, read_all
from .fileformat import HEADER_SIZE, BadBlock, decode, encode_header, file_name, parse_name

log = logging.getLogger("ucmcache.disktier")

DIR_NAME = "ucm-disk-v1"
LOW_WATER = 0.9       # an eviction pass frees down to this fraction of capacity_bytes
TOUCH_AFTER_NS = 1_000_000_000  # a hit refreshes its file's mtime (the LRU clock) at most 1/s
_STALE_TMP_NS = 3600 * 1_000_000_000  # a temporary file this old is a dead writer's
_U64 = struct.Struct("<Q")

_live_tiers: "weakref.WeakSet[DiskTier]" = weakref.WeakSet()


class BlockFile(NamedTuple):
    """One block file as a scan of the directory finds it."""
    block_id: bytes
    offset: int
    size: int        # file bytes (header included)
    mtime_ns: int    # last write or served hit (the LRU clock)
    path: str


class VerifyResult(NamedTuple):
    ok: int
    bad: List[Tuple[str, str]]  # (path, what failed)
    removed: int


class DiskTier(Tier):
    """A tier on a local directory, below the shared-memory cache and above (or instead of) a
    RedisTier: ``tier2=DiskTier(path, capacity_bytes)`` or ``tier2=[DiskTier(...),
    RedisTier(...)]`` (looked up in order).

    Every process of the node giving the same ``path`` shares its blocks; they outlive the
    segment (unlink, re-create, a layout change) and the processes (a node restart).  A cold
    key's owner asks the disk before its loader, through the segment's single flight; what it
    loads is written through in the background.  ``capacity_bytes`` bounds the files' bytes
    (least recently used files go first).  ``timeout`` bounds a get's wait for the disk
    (seconds); ``breaker_failures`` consecutive errors or timeouts bypass the disk for
    ``breaker_reset`` seconds.  ``fsync`` makes each file durable before it is named (off: a
    power loss may lose recent blocks, never serve a torn one; the checks on read catch it).
    ``max_pending_bytes`` bounds write-throughs queued in this process; ``readers`` is the
    size of this process's read pool; ``mode`` the permission bits of files it makes.
    """

    def __init__(self, path: "os.PathLike[str] | str", capacity_bytes: int, *,
                 timeout: float = 1.0, breaker_failures: int = 3, breaker_reset: float = 5.0,
                 fsync: bool = False, max_pending_bytes: int = 64 << 20, readers: int = 4,
                 mode: int = 0o600, clock: Optional[Callable[[], float]] = None):
        if not isinstance(path, (str, os.PathLike)):
            raise TypeError(f"path must be a str or os.PathLike, got {type(path).__name__}")
        path = os.fspath(path)
        if not isinstance(path, str) or not path:
            raise ValueError(f"path must be a non-empty directory path, got {path!r}")
        if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int) or \
                capacity_bytes <= HEADER_SIZE:
            raise ValueError(f"capacity_bytes must be an int > {HEADER_SIZE} (one block file's "
                             f"header), got {capacity_bytes!r}")
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
        if isinstance(breaker_failures, bool) or not isinstance(breaker_failures, int) or \
                breaker_failures < 1:
            raise ValueError(f"breaker_failures must be an int >= 1, got {breaker_failures!r}")
        if isinstance(breaker_reset, bool) or not isinstance(breaker_reset, (int, float)) or \
                breaker_reset < 0:
            raise ValueError(f"breaker_reset must be >= 0 seconds, got {breaker_reset!r}")
        for name, v in (("max_pending_bytes", max_pending_bytes), ("readers", readers)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        if isinstance(mode, bool) or not isinstance(mode, int) or not 0 <= mode <= 0o777:
            raise ValueError(f"mode must be permission bits in [0, 0o777], got {mode!r}")
        if os.path.exists(path) and not os.path.isdir(path):
            raise ValueError(f"path {path!r} exists and is not a directory")
        self.path = os.path.abspath(path)
        self.root = os.path.join(self.path, DIR_NAME)
        self.capacity_bytes = capacity_bytes
        self.timeout = float(timeout)
        self.fsync = bool(fsync)
        self._config = dict(capacity_bytes=capacity_bytes, timeout=float(timeout),
                            breaker_failures=breaker_failures, breaker_reset=float(breaker_reset),
                            fsync=bool(fsync), max_pending_bytes=max_pending_bytes,
                            readers=readers, mode=mode)
        self._max_pending = max_pending_bytes
        self._readers = readers
        self._mode = mode
        self._clock = clock or time.monotonic
        self.label = f"disk:{self.path}"
        self._blocks = os.path.join(self.root, "blocks")
        self._tmp = os.path.join(self.root, "tmp")
        self._stats_dir = os.path.join(self.root, "stats")
        # Directories: the files' read/write bits, each readable one searchable too.
        self._dir_mode = 0o700 | mode | ((mode & 0o444) >> 2)
        for d in (self._blocks, self._tmp, self._stats_dir):
            os.makedirs(d, mode=self._dir_mode, exist_ok=True)
        # Two breakers: a full disk (writes failing) must not stop serving what is on it, and
        # a read's success must not reset the count of failing writes.
        self._breaker = Breaker(breaker_failures, float(breaker_reset), self._clock,
                                self.label + " (reads)")
        self._write_breaker = Breaker(breaker_failures, float(breaker_reset), self._clock,
                                      self.label + " (writes)")
        self._reset_process_state()
        _live_tiers.add(self)

    def _reset_process_state(self) -> None:
        self._pid = os.getpid()
        self._breaker._lock = threading.Lock()
        self._write_breaker._lock = threading.Lock()
        self.counters = ProcessCounters(self._stats_dir, self._mode)
        self._cond = threading.Condition()
        self._queue: deque = deque()
        self._queued_bytes = 0
        self._enqueued = 0
        self._done = 0
        self._writer: Optional[threading.Thread] = None
        self._stopping = False
        self._pool: Optional[ThreadPoolExecutor] = None
        self._pool_lock = threading.Lock()
        self._usage_lock = threading.Lock()  # flock does not exclude threads sharing the fd
        self._usage_fd: Optional[int] = None
        self._tmp_seq = 0

    def _check_pid(self) -> None:
        if self._pid != os.getpid():
            self._reset_process_state()  # threads and fds of the parent are not ours

    # ---------------------------------------------------------------- facts

    @property
    def state(self) -> str:
        """The reads' circuit breaker in this process: 'closed', 'open' (lookups bypass the
        disk) or 'half-open'."""
        return self._breaker.state

    @property
    def write_state(self) -> str:
        """The writes' circuit breaker in this process: 'closed', 'open' (write-throughs are
        dropped: the disk is full or failing) or 'half-open'."""
        return self._write_breaker.state

    def stats(self) -> Dict[str, int]:
        """The tier's ``t2_*`` counters, summed over every process that used this directory."""
        return read_all(self._stats_dir)

    def used_bytes(self) -> int:
        """The bytes the block files take, as the shared usage record says."""
        with self._usage():
            return self._read_used()

    def key_path(self, key: Any) -> str:
        """The file that holds a key's block (whether or not it exists)."""
        from .._keys import split_key
        block_id, offset = split_key(key)
        return self._path_of(block_id, offset)

    def _path_of(self, block_id: bytes, offset: int) -> str:
        d, name = file_name(block_id, offset)
        return os.path.join(self._blocks, d, name)

    def __repr__(self) -> str:
        return (f"<DiskTier {self.label} capacity={self.capacity_bytes}B reads {self.state} "
                f"writes {self.write_state}>")

    def __reduce__(self):
        return (_rebuild, (self.path, self._config))

    # ---------------------------------------------------------------- reads (a get's path)

    def _read_many(self, keys: Sequence[Tuple[bytes, int]], limit: int,
                   timeout: Optional[float]) -> List[Optional[memoryview]]:
        """Each key's payload from the disk, or None (missing, bad, or the disk bypassed)."""
        self._check_pid()
        n = len(keys)
        b = self._breaker
        if not b.allow():
            self.counters.add("t2_bypasses", n)
            return [None] * n
        bound = self.timeout if timeout is None else max(0.0, min(self.timeout, timeout))
        try:
            pool = self._read_pool()
            futs = [pool.submit(self._read_one, bid, off, limit) for bid, off in keys]
        except BaseException:
            b.abort()
            raise
        done, _ = wait(futs, timeout=bound)
        out: List[Optional[memoryview]] = [None] * n
        err: Optional[BaseException] = None
        hits = misses = bypasses = bad = nbytes = 0
        cut_short = False  # by the caller's deadline, shorter than ours: no fault of the disk
        for i, f in enumerate(futs):
            if f not in done:
                f.cancel()  # not started: never runs; running: its result is dropped
                bypasses += 1
                if bound < self.timeout:
                    cut_short = True
                else:
                    err = err or TimeoutError(f"disk read past {bound:.3f} s")
                continue
            e = f.exception()
            if e is not None:
                bypasses += 1
                err = err or e
                continue
            r = f.result()
            if r is None:
                misses += 1
            elif isinstance(r, str):
                misses += 1
                bad += 1
            else:
                out[i] = r
                hits += 1
                nbytes += r.nbytes
        if err is not None:
            b.failure(err)
            log.debug("ucmcache disk tier %s: %s: %s", self.label, type(err).__name__, err)
        elif cut_short:
            b.abort()  # no verdict: a probe, if this was one, goes to the next lookup
        else:
            b.success()
        c = self.counters
        c.add("t2_hits", hits)
        c.add("t2_misses", misses)
        c.add("t2_bypasses", bypasses)
        c.add("t2_bad_values", bad)
        c.add("t2_read_bytes", nbytes)
        return out

    def _read_pool(self) -> ThreadPoolExecutor:
        p = self._pool
        if p is None:
            with self._pool_lock:
                p = self._pool
                if p is None:
                    p = self._pool = ThreadPoolExecutor(self._readers,
                                                        thread_name_prefix="ucmcache-disk-read")
        return p

    def _read_one(self, block_id: bytes, offset: int, limit: int) -> Any:
        """The payload (a view of a private buffer), None (no file), or a str saying why the
        file was bad (it is removed).  Other OSErrors propagate (the breaker counts them)."""
        path = self._path_of(block_id, offset)
        if _hooks._armed:
            _hooks.fire("disk_read_io")  # a test holds this read: a disk that does not answer
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        try:
            st = os.fstat(fd)
            size = st.st_size
            if size > HEADER_SIZE + limit:
                # Not bad: written under a segment with larger slots; this one cannot hold it.
                return None
            buf = bytearray(size)
            _read_all(fd, buf)
        finally:
            os.close(fd)
        try:
            _, _, payload = decode(buf, block_id, offset, limit)
        except BadBlock as e:
            log.warning("ucmcache disk tier %s: %s is bad (%s); removed", self.label, path, e)
            _unlink_quiet(path)
            return str(e)
        if time.time_ns() - st.st_mtime_ns > TOUCH_AFTER_NS:
            try:
                os.utime(path)  # the LRU clock: a served block is young again
            except OSError:
                pass
        return payload

    def _exist_prefix(self, keys: Sequence[Tuple[bytes, int]]) -> int:
        if not self._breaker.would_allow():
            return 0
        n = 0
        for bid, off in keys:
            if not os.path.exists(self._path_of(bid, off)):
                break
            n += 1
        return n

    # ---------------------------------------------------------------- write-through (background)

    def _put(self, block_id: bytes, offset: int, payload: memoryview) -> bool:
        """Queue a copy of payload for the writer thread; False (counted) when dropped."""
        self._check_pid()
        size = HEADER_SIZE + payload.nbytes
        if size > self.capacity_bytes or not self._write_breaker.would_allow():
            self.counters.add("t2_write_drops", 1)
            return False
        data = bytes(payload)  # the copy: the slot's view is valid only during this call
        with self._cond:
            if self._queue and self._queued_bytes + size > self._max_pending:
                self.counters.add("t2_write_drops", 1)
                return False
            self._queue.append((block_id, offset, data))
            self._queued_bytes += size
            self._enqueued += 1
            if self._writer is None:
                self._stopping = False
                t = threading.Thread(target=self._writer_loop, name="ucmcache-disk-writer",
                                     daemon=True)
                self._writer = t
                t.start()
            self._cond.notify_all()
        return True

    def _writer_loop(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._stopping:
                    self._cond.wait()
                if not self._queue:
                    self._writer = None
                    return
                block_id, offset, data = self._queue.popleft()
                self._queued_bytes -= HEADER_SIZE + len(data)
            try:
                self._write_block(block_id, offset, data)
            except BaseException:  # never let the writer die silently
                log.exception("ucmcache disk tier %s: write-through failed", self.label)
            finally:
                with self._cond:
                    self._done += 1
                    self._cond.notify_all()

    def _write_block(self, block_id: bytes, offset: int, data: bytes) -> None:
        """Write one block file: temporary name, complete, then renamed into place."""
        final = self._path_of(block_id, offset)
        if os.path.exists(final):
            self.counters.add("t2_write_dedups", 1)
            return
        b = self._write_breaker
        if not b.allow():
            self.counters.add("t2_write_drops", 1)
            return
        header = encode_header(block_id, offset, data)
        size = HEADER_SIZE + len(data)
        self._tmp_seq += 1
        tmp = os.path.join(self._tmp, f"{self._pid}.{self._tmp_seq}.tmp")
        reserved = False
        try:
            self._reserve(size)
            reserved = True
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, self._mode)
            try:
                if _hooks._armed and "disk_mid_write" in _hooks._armed:
                    # A test kills the writer here: the header and half the payload written.
                    _write_all(fd, header + data[:len(data) // 2], 0)
                    _hooks.fire("disk_mid_write")
                    _write_all(fd, data[len(data) // 2:], HEADER_SIZE + len(data) // 2)
                else:
                    _write_all(fd, header, 0, data)
                if self.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            try:
                os.rename(tmp, final)
            except FileNotFoundError:
                os.makedirs(os.path.dirname(final), mode=self._dir_mode, exist_ok=True)
                os.rename(tmp, final)
        except Exception as e:
            _unlink_quiet(tmp)
            if reserved:
                self._unreserve(size)
            b.failure(e)
            self.counters.add("t2_write_failures", 1)
            log.debug("ucmcache disk tier %s: write: %s: %s", self.label, type(e).__name__, e)
            return
        except BaseException:
            b.abort()
            raise
        b.success()
        self.counters.add("t2_writes", 1)
        self.counters.add("t2_written_bytes", size)

    def flush(self, timeout: float = 5.0) -> bool:
        """Wait until every write-through queued so far in this process is written (or
        dropped); False on timeout."""
        if self._pid != os.getpid():
            return True
        deadline = time.monotonic() + timeout
        with self._cond:
            target = self._enqueued
            while self._done < target:
                left = deadline - time.monotonic()
                if left <= 0 or self._writer is None:
                    return self._done >= target
                self._cond.wait(left)
        return True

    # ---------------------------------------------------------------- capacity (shared)

    def _usage(self) -> "_UsageLock":
        self._check_pid()
        return _UsageLock(self)

    def _usage_file(self) -> int:
        fd = self._usage_fd
        if fd is None:
            fd = os.open(os.path.join(self.root, "usage"),
                         os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, self._mode)
            self._usage_fd = fd
        return fd

    def _read_used(self) -> int:
        """Under the usage lock: the recorded bytes; a missing record is rebuilt by a scan."""
        raw = os.pread(self._usage_file(), 8, 0)
        if len(raw) < 8:
            used = sum(f.size for f in self._scan())
            self._write_used(used)
            return used
        return _U64.unpack(raw)[0]

    def _write_used(self, used: int) -> None:
        os.pwrite(self._usage_file(), _U64.pack(max(0, used)), 0)

    def _reserve(self, size: int) -> None:
        with self._usage():
            used = self._read_used()
            if used + size > self.capacity_bytes:
                used, _ = self._evict_locked(int(self.capacity_bytes * LOW_WATER) - size)
            self._write_used(used + size)

    def _unreserve(self, size: int) -> None:
        with self._usage():
            self._write_used(self._read_used() - size)

    def _evict_locked(self, target: int) -> Tuple[int, int]:
        """Under the usage lock: remove least recently used files until the blocks take at
        most target bytes; returns (the bytes they take, files removed).  The bytes are
        measured by the scan, so the record is corrected for whatever a killed process left
        uncounted."""
        files = self._scan()
        used = sum(f.size for f in files)
        if used <= target:
            return used, 0
        files.sort(key=lambda f: f.mtime_ns)
        n = freed = 0
        for f in files:
            if used - freed <= target:
                break
            try:
                os.unlink(f.path)
            except FileNotFoundError:
                pass
            freed += f.size
            n += 1
        self.counters.add("t2_evictions", n)
        self.counters.add("t2_evicted_bytes", freed)
        return used - freed, n

    def _scan(self) -> List[BlockFile]:
        """Every block file (the index, rebuilt from the directory); stale temporary files of
        dead writers are removed on the way."""
        out: List[BlockFile] = []
        try:
            subdirs = list(os.scandir(self._blocks))
        except FileNotFoundError:
            subdirs = []
        for d in subdirs:
            if not d.is_dir(follow_symlinks=False):
                continue
            try:
                entries = list(os.scandir(d.path))
            except FileNotFoundError:
                continue
            for e in entries:
                key = parse_name(e.name)
                if key is None:
                    continue
                try:
                    st = e.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                out.append(BlockFile(key[0], key[1], st.st_size, st.st_mtime_ns, e.path))
        self._clean_tmp()
        return out

    def _clean_tmp(self) -> None:
        now = time.time_ns()
        try:
            entries = list(os.scandir(self._tmp))
        except FileNotFoundError:
            return
        for e in entries:
            pid_s = e.name.split(".", 1)[0]
            try:
                pid = int(pid_s)
                st = e.stat(follow_symlinks=False)
            except (ValueError, FileNotFoundError):
                continue
            if pid == os.getpid():
                continue
            if not _pid_alive(pid) or now - st.st_mtime_ns > _STALE_TMP_NS:
                _unlink_quiet(e.path)

    # ---------------------------------------------------------------- tools (CLI)

    def files(self) -> List[BlockFile]:
        """Every block file of the directory (a scan)."""
        return self._scan()

    def verify(self, remove_bad: bool = False) -> VerifyResult:
        """Read and check every block file; with remove_bad, remove those that fail."""
        ok = removed = 0
        bad: List[Tuple[str, str]] = []
        for f in self._scan():
            try:
                with open(f.path, "rb") as fh:
                    buf = fh.read()
                decode(buf, f.block_id, f.offset)
                ok += 1
            except FileNotFoundError:
                continue
            except (BadBlock, OSError) as e:
                bad.append((f.path, str(e)))
                if remove_bad:
                    _unlink_quiet(f.path)
                    removed += 1
        if removed:
            with self._usage():
                self._write_used(sum(f.size for f in self._scan()))
        return VerifyResult(ok, bad, removed)

    def trim(self, target_bytes: Optional[int] = None) -> Tuple[int, int]:
        """Evict least recently used files until the blocks take at most target_bytes
        (default: capacity_bytes); returns (files removed, bytes the blocks take now)."""
        if target_bytes is None:
            target_bytes = self.capacity_bytes
        if isinstance(target_bytes, bool) or not isinstance(target_bytes, int) or \
                target_bytes < 0:
            raise ValueError(f"target_bytes must be an int >= 0, got {target_bytes!r}")
        with self._usage():
            used, removed = self._evict_locked(target_bytes)
            self._write_used(used)
        return removed, used

    # ---------------------------------------------------------------- lifecycle

    def close(self, timeout: float = 5.0) -> None:
        """Flush write-throughs (bounded), stop this process's threads.  The tier can be used
        again afterwards (threads come back on demand)."""
        if self._pid != os.getpid():
            self._reset_process_state()
            return
        self.flush(timeout)
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        with self._pool_lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)

    def bind(self, count: Callable[[int, int], None], slot_size: int) -> "BoundDisk":
        """This tier as one cache uses it (ucmcache._tier).  Its counters are its own (the
        directory's ``t2_*``), not the segment's, which count the Redis tier."""
        return BoundDisk(self, slot_size)


class _UsageLock:
    """flock on the usage file (across processes) plus a thread lock (within this one)."""

    def __init__(self, tier: DiskTier):
        self.tier = tier

    def __enter__(self) -> "_UsageLock":
        t = self.tier
        t._usage_lock.acquire()
        try:
            fcntl.flock(t._usage_file(), fcntl.LOCK_EX)
        except BaseException:
            t._usage_lock.release()
            raise
        return self

    def __exit__(self, *exc) -> None:
        t = self.tier
        try:
            fcntl.flock(t._usage_file(), fcntl.LOCK_UN)
        finally:
            t._usage_lock.release()


class BoundDisk(BoundTier):
    """A DiskTier as one SlotCache uses it: the keys of the owned loads it missed (slot ->
    key) until their owners publish (written through) or close."""

    def __init__(self, tier: DiskTier, slot_size: int):
        self.tier = tier
        self._limit = slot_size
        self.pending: Dict[int, Tuple[bytes, int]] = {}

    def lookup(self, owned: Sequence[Owned], may_wait: bool,
               timeout: Optional[float]) -> List[Optional[memoryview]]:
        for slot, _, _ in owned:
            self.pending.pop(slot, None)
        if _hooks._armed:
            _hooks.fire("disk_lookup")  # an owner is about to read the disk
        try:
            out = self.tier._read_many([(b, o) for _, b, o in owned], self._limit, timeout)
        except Exception:
            # A bug of ours must not fail a get: log it, load as if the disk were absent.
            log.exception("ucmcache disk tier %s: unexpected error; bypassing", self.tier.label)
            self.tier.counters.add("t2_bypasses", len(owned))
            out = [None] * len(owned)
        for (slot, b, o), p in zip(owned, out):
            if p is None:
                self.pending[slot] = (b, o)
        return out

    def exist_prefix(self, keys: Sequence[Tuple[bytes, int]]) -> int:
        return self.tier._exist_prefix(keys)

    def write_through(self, slot: int, payload: memoryview) -> None:
        key = self.pending.pop(slot, None)
        if key is not None:
            self.tier._put(key[0], key[1], payload)

    def abandon(self, slot: int) -> None:
        self.pending.pop(slot, None)

    def close(self) -> None:
        self.pending.clear()
        self.tier.flush(2.0)


def _read_all(fd: int, buf: bytearray) -> None:
    mv = memoryview(buf)
    got = 0
    while got < len(buf):
        n = os.preadv(fd, [mv[got:]], got)
        if n == 0:
            break  # shorter than fstat said (truncated meanwhile): decode refuses it
        got += n
    if got < len(buf):
        del buf[got:]


def _write_all(fd: int, head: bytes, pos: int, body: Optional[bytes] = None) -> None:
    bufs = [memoryview(head)] + ([memoryview(body)] if body is not None else [])
    while bufs:
        n = os.pwritev(fd, bufs, pos)
        if n == 0:
            raise OSError(errno.EIO, "pwritev wrote nothing")
        pos += n
        while bufs and n >= bufs[0].nbytes:
            n -= bufs[0].nbytes
            bufs.pop(0)
        if bufs and n:
            bufs[0] = bufs[0][n:]


def _unlink_quiet(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _rebuild(path: str, config: Dict[str, Any]) -> DiskTier:
    return DiskTier(path, **config)


@atexit.register
def _flush_at_exit() -> None:
    for t in list(_live_tiers):
        try:
            if t._pid == os.getpid():
                t.flush(2.0)
        except Exception:
            pass


def _forget_after_fork() -> None:
    for t in list(_live_tiers):
        t._reset_process_state()


os.register_at_fork(after_in_child=_forget_after_fork)
