"""DiskTier: a tier on a local directory, shared by every process of the node that uses the
same path (DESIGN 4.14).

Layout of the directory (``<path>/ucm-disk-v1/``, versioned with the file format):

* ``blocks/<xx>/<block id hex>-<offset hex>.ucb``: one file per key (ucmcache.disktier.fileformat);
  the filesystem is the index: a lookup opens the key's name, nothing is loaded at start;
* ``tmp/<pid>.<random>.tmp``: files being written, each under its writer's ``flock``; renamed
  into ``blocks/`` when complete, so a writer killed mid-write leaves only an unlocked
  temporary file (removed at the next start, scan or periodic clean);
* ``usage``: the bytes the blocks take (a u64), read and written under ``flock`` on it, the
  lock also serialising eviction passes across processes;
* ``stats/``: the counters (ucmcache.disktier.counters);
* ``capacity``: the ``capacity_bytes`` the directory was made with (decimal text), which every
  later DiskTier on it uses (a different one is refused: ``TierCapacityMismatch``).

Trust: every directory of the tree (``path`` itself, the root, ``blocks/`` and its fan-out
directories, ``tmp/``, ``stats/``) must belong to this user and be writable by nobody else, and
a block file is served only when it is a regular file this user owns (opened with
``O_NOFOLLOW | O_NONBLOCK``, then ``fstat``): another user's bytes never reach a caller
(``allow_other_user=True`` trusts them, as ``SlotCache.attach`` does another user's segment).

Reads run on a few per-process daemon threads so that the get waiting for them waits at most
``timeout`` (and a read that never returns holds neither the get nor process exit);
write-throughs are copied on the owner's thread and written by one background writer thread
per process.  A read error or a read past the timeout counts against the reads'
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
import secrets
import stat as stat_mod
import weakref
from collections import deque
from typing import Any, Callable, Dict, Iterator, List, NamedTuple, Optional, Sequence, Tuple

from ...core import hooks as _hooks
from ...core.errors import UcmError
from ...core.tier import BoundTier, Owned, Tier
from ...core.timeouts import check_bound, check_timeout
from ..write_through import WriteThroughQueue
from ..breaker import Breaker
from .counters import ProcessCounters, drop_inherited, read_all
from .fileformat import HEADER_SIZE, BadBlock, decode, encode_header, file_name, parse_name

log = logging.getLogger("ucmcache.disktier")

DIR_NAME = "ucm-disk-v1"
LOW_WATER = 0.9       # an eviction pass frees down to this fraction of capacity_bytes
TOUCH_AFTER_NS = 1_000_000_000  # a hit refreshes its file's mtime (the LRU clock) at most 1/s
LOCK_WAIT = 5.0      # seconds a usage-lock taker waits (a stopped holder): then it gives up
CLEAN_TMP_EVERY = 60.0  # seconds between a writer's cleans of dead writers' temporary files
_U64 = struct.Struct("<Q")

CAPACITY_FILE = "capacity"
# A block file is opened without following a symbolic link and without waiting (a FIFO at its
# name must hold no thread), then judged by fstat.
_OPEN_BLOCK = os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK

_live_tiers: "weakref.WeakSet[DiskTier]" = weakref.WeakSet()


class ForeignTierDirectory(UcmError):
    """A disk tier's directory (``path``, or one the tier reads or writes in it) belongs to
    another user, can be written by group or others, or is not a plain directory: another
    user could plant blocks there (refused unless allow_other_user=True)."""


class TierCapacityMismatch(UcmError, ValueError):
    """DiskTier(path, capacity_bytes) names a capacity other than the one the directory was
    made with (recorded in it): two capacities on one directory would evict each other's
    blocks."""


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
    (least recently used files go first); it is recorded in the directory when the directory
    is made, every later DiskTier on it uses that one (``None``: the recorded one; another
    value raises TierCapacityMismatch naming both).  ``timeout`` bounds a get's wait for the disk
    (seconds); ``breaker_failures`` consecutive errors or timeouts bypass the disk for
    ``breaker_reset`` seconds.  ``fsync`` makes each file durable before it is named (off: a
    power loss may lose recent blocks, never serve a torn one; the checks on read catch it).
    ``max_pending_bytes`` bounds write-throughs queued in this process; ``readers`` is the
    size of this process's read pool; ``mode`` the permission bits of files it makes (group or
    others' write bits only with ``allow_other_user``).

    Trust (as a segment's): the directories must be this user's and writable by nobody else,
    and only regular files this user owns are served; anything else raises
    ForeignTierDirectory (a directory) or is a bad block (a file: counted, never served,
    removed).  ``allow_other_user=True`` shares the directory with other users: their
    directories and blocks are trusted (a block is still checked, never trusted to be honest:
    the CRC is not authentication, and ``memoize`` unpickles what it reads).
    """

    # Whether this object records capacity_bytes in a directory that has none (the tools'
    # DiskTier on a directory made before the record existed does not: facts.open_dir).
    _records_capacity = True

    def __init__(self, path: "os.PathLike[str] | str", capacity_bytes: Optional[int] = None, *,
                 timeout: float = 1.0, breaker_failures: int = 3, breaker_reset: float = 5.0,
                 fsync: bool = False, max_pending_bytes: int = 64 << 20, readers: int = 4,
                 mode: int = 0o600, allow_other_user: bool = False,
                 clock: Optional[Callable[[], float]] = None):
        if not isinstance(path, (str, os.PathLike)):
            raise TypeError(f"path must be a str or os.PathLike, got {type(path).__name__}")
        path = os.fspath(path)
        if not isinstance(path, str) or not path:
            raise ValueError(f"path must be a non-empty directory path, got {path!r}")
        if capacity_bytes is not None and (
                isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int) or
                capacity_bytes <= HEADER_SIZE):
            raise ValueError(f"capacity_bytes must be an int > {HEADER_SIZE} (one block file's "
                             f"header), or None for the one the directory records, got "
                             f"{capacity_bytes!r}")
        check_bound(timeout, "timeout")  # each disk step's bound: finite (inf overflowed)
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
        if not isinstance(allow_other_user, bool):
            raise TypeError(f"allow_other_user must be a bool, got "
                            f"{type(allow_other_user).__name__}")
        if mode & 0o022 and not allow_other_user:
            raise ValueError(f"mode {mode:#o} lets group or others write the tier's files: "
                             "their bytes would be served; pass allow_other_user=True to share "
                             "the directory with them, or drop those bits")
        if os.path.exists(path) and not os.path.isdir(path):
            raise ValueError(f"path {path!r} exists and is not a directory")
        self.path = os.path.abspath(path)
        self.root = os.path.join(self.path, DIR_NAME)
        if capacity_bytes is None and not os.path.isdir(self.root):
            raise _no_capacity(self.path)
        self.timeout = float(timeout)
        self.fsync = bool(fsync)
        self.allow_other_user = allow_other_user
        # The owner a block file must have to be served (None: any, the caller opted in).
        self._owner: Optional[int] = None if allow_other_user else os.geteuid()
        self._max_pending = max_pending_bytes
        self._readers = readers
        self._mode = mode
        self._clock = clock or time.monotonic
        self.label = f"disk:{self.path}"
        self._blocks = os.path.join(self.root, "blocks")
        self._tmp = os.path.join(self.root, "tmp")
        self._stats_dir = os.path.join(self.root, "stats")
        # Directories: the files' read/write bits, each readable one searchable too; made with
        # exactly these bits whatever the umask (_make_dir).
        self._dir_mode = 0o700 | mode | ((mode & 0o444) >> 2)
        self._make_tree()
        self.capacity_bytes = self._settle_capacity(capacity_bytes)
        self._config = dict(capacity_bytes=self.capacity_bytes, timeout=float(timeout),
                            breaker_failures=breaker_failures, breaker_reset=float(breaker_reset),
                            fsync=bool(fsync), max_pending_bytes=max_pending_bytes,
                            readers=readers, mode=mode, allow_other_user=allow_other_user)
        # Two breakers: a full disk (writes failing) must not stop serving what is on it, and
        # a read's success must not reset the count of failing writes.
        self._breaker = Breaker(breaker_failures, float(breaker_reset), self._clock,
                                self.label + " (reads)")
        self._write_breaker = Breaker(breaker_failures, float(breaker_reset), self._clock,
                                      self.label + " (writes)")
        self.lock_wait = LOCK_WAIT
        self._res: Optional[_Files] = None
        self._reset_process_state()
        _live_tiers.add(self)
        try:
            # A crash-looping worker's temp files go at its next start; their reservations
            # are taken out of the usage record by this process's writer (a scan, off the
            # caller's thread).
            self._resync = self._clean_tmp() > 0
        except OSError:
            pass

    def _reset_process_state(self) -> None:
        if self._res is not None:
            # A forked child: the parent's usage fd shares the parent's open file description,
            # so keeping it would keep the parent's flock held after the parent dies.
            self._res.drop_inherited()
        self._pid = os.getpid()
        self._breaker._lock = threading.Lock()
        self._write_breaker._lock = threading.Lock()
        # Expire a probe that never got its verdict (the probing get died mid-way).
        self._breaker.probe_expiry = max(2 * self.timeout, self._breaker.reset, 1.0)
        self.counters = ProcessCounters(self._stats_dir, self._mode)
        self._res = _Files(self.counters)
        # The fd and map of a tier dropped without close().  Not at exit: the kernel closes
        # them, and a daemon thread may still be using them then.
        weakref.finalize(self, _Files.release, self._res).atexit = False
        self._writes = WriteThroughQueue(self._write_batch, max_pending_bytes=self._max_pending,
                                         thread_name="ucmcache-disk-writer", log=log,
                                         what=f"ucmcache disk tier {self.label}")
        self._pool: Optional[_Readers] = None
        self._pool_lock = threading.Lock()
        self._usage_lock = threading.Lock()  # flock does not exclude threads sharing the fd
        self._next_clean = time.monotonic() + CLEAN_TMP_EVERY
        self._resync = False
        # Keys a put() of this process is replacing on the disk (see _begin_replace).
        self._replacing: Dict[Tuple[bytes, int], int] = {}
        self._replacing_lock = threading.Lock()

    def _check_pid(self) -> None:
        if self._pid != os.getpid():
            self._reset_process_state()  # threads and fds of the parent are not ours

    # ---------------------------------------------------------------- the tree (trust)

    def _make_tree(self) -> None:
        """Make what is missing of ``path`` and the tree (each directory with ``_dir_mode``
        exactly), then check every directory the tier reads or writes (DESIGN 4.14, trust):
        ForeignTierDirectory, before anything is read from it, for one that another user owns,
        group or others can write (``path`` itself: unless sticky, as /tmp), or that is not a
        plain directory (a symbolic link inside the tree)."""
        _make_dirs(self.path, self._dir_mode)
        st = os.stat(self.path)  # the caller named it: a link to it is the caller's choice
        if not self.allow_other_user:
            if st.st_uid not in (os.geteuid(), 0):
                raise _foreign(self.path, f"belongs to uid {st.st_uid}, not to us (uid "
                               f"{os.geteuid()}) nor root")
            if st.st_mode & 0o022 and not st.st_mode & stat_mod.S_ISVTX:
                raise _foreign(self.path, f"can be written by group or others (mode "
                               f"{stat_mod.S_IMODE(st.st_mode):#o}, not sticky): they could "
                               f"put a tree of their own in its place")
        for d in (self.root, self._blocks, self._tmp, self._stats_dir):
            _make_dir(d, self._dir_mode)
            self._check_dir(d)
        with os.scandir(self._blocks) as it:  # the fan-out directories the writer fills
            for e in it:
                if e.is_dir(follow_symlinks=False) or e.is_symlink():
                    self._check_dir(e.path)

    def _check_dir(self, d: str) -> None:
        st = os.lstat(d)
        if not stat_mod.S_ISDIR(st.st_mode):
            raise _foreign(d, f"is {_kind(st.st_mode)}, not a directory (the tier's "
                           f"directories are real ones: link or mount `path` instead)")
        if self.allow_other_user:
            return
        if st.st_uid != os.geteuid():
            raise _foreign(d, f"belongs to uid {st.st_uid}, not to us (uid {os.geteuid()})")
        if st.st_mode & 0o022:
            raise _foreign(d, f"can be written by group or others (mode "
                           f"{stat_mod.S_IMODE(st.st_mode):#o}): they could plant blocks")

    def _settle_capacity(self, asked: Optional[int]) -> int:
        """The capacity this tier runs with: the one recorded in the directory; a directory
        without a record gets ``asked`` (the first maker's wins a race); ``asked`` other than
        the record raises TierCapacityMismatch."""
        recorded = read_capacity_record(self.root, self._owner)
        if recorded is None:
            if asked is None:
                raise _no_capacity(self.path)
            if not self._records_capacity:
                return asked
            recorded = self._record_capacity(asked)
        if asked is not None and asked != recorded:
            raise TierCapacityMismatch(
                f"disk tier {self.path!r} was made with capacity_bytes={recorded} (recorded in "
                f"{os.path.join(self.root, CAPACITY_FILE)}), not {asked}: two capacities on one "
                f"directory evict each other's blocks; give {recorded} or None (to change it: "
                f"stop every process using it, remove that file, and make the tier again)")
        return recorded

    def _record_capacity(self, capacity: int) -> int:
        """Write the record (a temporary file linked into place: never over another's);
        returns the capacity recorded (ours, or a racing maker's)."""
        tmp, fd = self._make_tmp()
        try:
            _write_all(fd, f"{capacity}\n".encode(), 0)
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            _place_no_replace(tmp, os.path.join(self.root, CAPACITY_FILE))
        finally:
            _unlink_quiet(tmp)
        recorded = read_capacity_record(self.root, self._owner)
        assert recorded is not None
        return recorded

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
        """The tier's ``t2_*`` counters, summed over every process that used this directory
        (plus what this process counted in memory where it could not keep its file)."""
        out = read_all(self._stats_dir)
        if self.counters.off:
            for k, v in self.counters.memory_counts().items():
                out[k] += v
        return out

    def used_bytes(self) -> int:
        """The bytes the block files take, as the shared usage record says (read without the
        lock when a stopped process holds it past ``lock_wait``)."""
        try:
            with self._usage():
                return self._read_used()
        except UsageLockBusy:
            used = read_usage_record(self.root)
            return used if used is not None else sum(f.size for f in scan_blocks(self._blocks))

    def key_path(self, key: Any) -> str:
        """The file that holds a key's block (whether or not it exists)."""
        from ...core.keys import split_key
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
        out: List[Optional[memoryview]] = [None] * n
        hits = misses = bypasses = bad = nbytes = 0
        # From allow() to the verdict, anything raised here (a signal handler's exception
        # landing in the wait: a timeout alarm, KeyboardInterrupt) resolves the probe without
        # a verdict, so the next lookup probes again instead of the disk staying off.
        try:
            pool = self._read_pool()
            batch = _Batch(n)
            jobs = [pool.submit(self._read_one, bid, off, limit, batch=batch)
                    for bid, off in keys]
            finished = batch.wait(jobs, bound)
            err: Optional[BaseException] = None
            cut_short = False  # by the caller's deadline, shorter than ours: no fault of the disk
            for i, (j, ok) in enumerate(zip(jobs, finished)):
                if not ok:
                    bypasses += 1  # not started: never runs; running: its result is dropped
                    if bound < self.timeout:
                        cut_short = True
                    else:
                        err = err or TimeoutError(f"disk read past {bound:.3f} s")
                    continue
                if j.error is not None:
                    bypasses += 1
                    err = err or j.error
                    continue
                r = j.value
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
        except BaseException:
            b.abort()
            raise
        self.counters.add_many({"t2_hits": hits, "t2_misses": misses, "t2_bypasses": bypasses,
                                "t2_bad_values": bad, "t2_read_bytes": nbytes})
        return out

    def _read_pool(self) -> "_Readers":
        p = self._pool
        if p is None:
            with self._pool_lock:
                p = self._pool
                if p is None:
                    p = self._pool = _Readers(self._readers, "ucmcache-disk-read")
        return p

    def _read_one(self, block_id: bytes, offset: int, limit: int) -> Any:
        """The payload (a view of a private buffer), None (no file), or a str saying why the
        file was bad (it is removed where that is safe: remove_entry).  Other OSErrors
        propagate (the breaker counts them)."""
        path = self._path_of(block_id, offset)
        if _hooks._armed:
            _hooks.fire("disk_read_io")  # a test holds this read: a disk that does not answer
        if self._replacing and (block_id, offset) in self._replacing:
            return None  # a put of this key is on its way to the disk (see _put): not served
        try:
            fd, st = open_block(path, self._owner)
        except (FileNotFoundError, NotADirectoryError):
            return None
        except BadBlock as e:
            return self._drop_bad(path, e)
        try:
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
            return self._drop_bad(path, e)
        if time.time_ns() - st.st_mtime_ns > TOUCH_AFTER_NS:
            try:
                os.utime(path, follow_symlinks=False)  # the LRU clock: served, young again
            except OSError:
                pass
        return payload

    def _drop_bad(self, path: str, e: BadBlock) -> str:
        """A bad block at path: removed where safe (remove_entry); the reason, for the count."""
        gone = remove_entry(path)
        log.warning("ucmcache disk tier %s: %s is bad (%s); %s", self.label, path, e,
                    "removed" if gone else "left in place (a directory with something in it)")
        return str(e)

    def _exist_prefix(self, keys: Sequence[Tuple[bytes, int]], limit: int) -> int:
        """How many leading keys have a file a lookup would serve.  The stats run on the read
        threads under ``timeout`` (the caller may be a scheduler: a hung disk must not hold
        it); past it, or on an error, 0 (and the reads' breaker counts it)."""
        self._check_pid()
        b = self._breaker
        if not keys or not b.would_allow():
            return 0
        try:
            batch = _Batch(1)
            job = self._read_pool().submit(self._stat_prefix, list(keys), limit, batch=batch)
            if not batch.wait([job], self.timeout)[0]:
                b.failure(TimeoutError(f"disk stat past {self.timeout:.3f} s"))
                return 0
        except OSError as e:  # no read thread could start
            log.debug("ucmcache disk tier %s: exist_prefix: %s", self.label, e)
            return 0
        if job.error is not None:
            if not isinstance(job.error, OSError):
                raise job.error
            b.failure(job.error)
            return 0
        return int(job.value)

    def _stat_prefix(self, keys: Sequence[Tuple[bytes, int]], limit: int) -> int:
        if _hooks._armed:
            _hooks.fire("disk_read_io")  # a test holds this stat: a disk that does not answer
        n = 0
        for bid, off in keys:
            try:
                st = os.lstat(self._path_of(bid, off))
            except (FileNotFoundError, NotADirectoryError):
                break
            # What _read_one would refuse (larger than this cache's slots, shorter than a
            # header, not a regular file, another user's) is not there for this cache.
            if not stat_mod.S_ISREG(st.st_mode) or not \
                    HEADER_SIZE <= st.st_size <= HEADER_SIZE + limit or \
                    (self._owner is not None and st.st_uid != self._owner) or \
                    (bid, off) in self._replacing:
                break
            n += 1
        return n

    # ---------------------------------------------------------------- write-through (background)

    def _put(self, block_id: bytes, offset: int, payload: memoryview,
             replace: bool = False) -> bool:
        """Queue a copy of payload for the writer thread; False (counted) when dropped.
        ``replace``: a put()'s value (its key is in _replacing until this write is done),
        written over whatever the disk holds for the key; else a loaded value, written only
        where the key has no file."""
        self._check_pid()
        size = HEADER_SIZE + payload.nbytes
        key = (block_id, offset)
        if size > self.capacity_bytes or not self._write_breaker.would_allow():
            self.counters.add("t2_write_drops", 1)
            if replace:
                self._end_replace(key)
            return False
        data = bytes(payload)  # the copy: the slot's view is valid only during this call
        if not self._writes.put((block_id, offset, data, replace), size):
            self.counters.add("t2_write_drops", 1)
            if replace:
                self._end_replace(key)
            return False
        return True

    # put() under this tier (BoundDisk.put): the key's older block goes before the value is
    # published, and until the put's own write is done the key is in _replacing (key -> puts
    # of it in flight in this process): reads here do not serve it and loaded values queued
    # before the put are not written over the name (the put's value wins, never an older one).

    def _begin_replace(self, keys: Sequence[Tuple[bytes, int]],
                       timeout: Optional[float]) -> None:
        """Mark keys as being put, then remove their block files, on the read threads within
        ``min(self.timeout, timeout)``.  OSError (TimeoutError past the bound) if any could not
        be removed: the marks are taken back and the put must not publish (an older block
        would be served again once its value leaves RAM)."""
        self._check_pid()
        with self._replacing_lock:
            for k in keys:
                self._replacing[k] = self._replacing.get(k, 0) + 1
        try:
            bound = self.timeout if timeout is None else max(0.0, min(self.timeout, timeout))
            pool = self._read_pool()
            batch = _Batch(len(keys))
            jobs = [pool.submit(self._remove_block, b, o, batch=batch) for b, o in keys]
            finished = batch.wait(jobs, bound)
            for (b, o), j, ok in zip(keys, jobs, finished):
                if not ok:
                    raise TimeoutError(errno.ETIMEDOUT, f"put: the disk tier {self.label} did "
                                       f"not remove the key's older block within {bound:.3f} s "
                                       "(nothing stored)")
                if j.error is not None:
                    raise j.error
                if not j.value:
                    raise OSError(errno.ENOTEMPTY, f"put: the disk tier {self.label} cannot "
                                  f"remove the directory at the key's name "
                                  f"{self._path_of(b, o)} (nothing stored)")
        except BaseException:
            for k in keys:
                self._end_replace(k)
            raise

    def _remove_block(self, block_id: bytes, offset: int) -> bool:
        if _hooks._armed:
            _hooks.fire("disk_read_io")  # a test holds this removal: a disk that does not answer
        return remove_entry(self._path_of(block_id, offset))

    def _end_replace(self, key: Tuple[bytes, int]) -> None:
        with self._replacing_lock:
            n = self._replacing.get(key, 0) - 1
            if n > 0:
                self._replacing[key] = n
            else:
                self._replacing.pop(key, None)

    def _write_batch(self, batch: List[Tuple[bytes, int, bytes, bool]]) -> None:
        """The writer thread's work: one block at a time (a batch of one, so a failing write
        is logged alone)."""
        for block_id, offset, data, replace in batch:
            try:
                self._write_block(block_id, offset, data, replace)
            finally:
                if replace:
                    self._end_replace((block_id, offset))

    def _write_block(self, block_id: bytes, offset: int, data: bytes, replace: bool) -> None:
        """Write one block file: temporary name, complete, then given the block's name (over
        what is there for a put's value, only where nothing is for a loaded one)."""
        final = self._path_of(block_id, offset)
        if not replace:
            if (block_id, offset) in self._replacing:
                # A put of this key is queued behind: its value wins, this older one goes.
                self.counters.add("t2_write_dedups", 1)
                return
            if not self._clear_name(final):
                return
        b = self._write_breaker
        if not b.allow():
            self.counters.add("t2_write_drops", 1)
            return
        if time.monotonic() >= self._next_clean:
            self._next_clean = time.monotonic() + CLEAN_TMP_EVERY
            try:
                # Dead writers' temp files, on a tier that never evicts.
                self._resync = self._clean_tmp() > 0 or self._resync
            except OSError:
                pass
        if self._resync:
            self._resync = False
            try:
                with self._usage():  # their reservations: the record from a scan
                    self._write_used(sum(f.size for f in scan_blocks(self._blocks)))
            except OSError:
                pass
        header = encode_header(block_id, offset, data)
        size = HEADER_SIZE + len(data)
        tmp = ""
        reserved = False
        try:
            self._reserve(size)
            reserved = True
            tmp, fd = self._make_tmp()
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
            if replace and not self._clear_name(final, replace=True):
                _unlink_quiet(tmp)
                self._unreserve(size)
                return
            try:
                placed = self._place(tmp, final, replace)
            except FileNotFoundError:
                _make_dir(os.path.dirname(final), self._dir_mode)  # a new fan-out directory
                placed = self._place(tmp, final, replace)
            if not placed:  # a loaded value, and another writer named the key's file first
                _unlink_quiet(tmp)
                self._unreserve(size)
                self.counters.add("t2_write_dedups", 1)
                b.success()
                return
        except UsageLockBusy as e:
            # Another process holds the lock past lock_wait (stopped, or a long pass): not a
            # fault of the disk; this write is dropped.
            if tmp:
                _unlink_quiet(tmp)
            b.abort()
            self.counters.add("t2_write_drops", 1)
            log.debug("ucmcache disk tier %s: write dropped: %s", self.label, e)
            return
        except Exception as e:
            if tmp:
                _unlink_quiet(tmp)
            if reserved:
                try:
                    self._unreserve(size)
                except UsageLockBusy:
                    pass  # the record over-counts until the next eviction pass's scan
            b.failure(e)
            self.counters.add("t2_write_failures", 1)
            log.debug("ucmcache disk tier %s: write: %s: %s", self.label, type(e).__name__, e)
            return
        except BaseException:
            b.abort()
            raise
        b.success()
        self.counters.add_many({"t2_writes": 1, "t2_written_bytes": size})

    def _clear_name(self, final: str, replace: bool = False) -> bool:
        """Before a write: True if the block's name may be written.  A loaded value's write
        finds a block file that would be served there: a dedup (counted), False.  Anything else
        at the name (another user's file, a FIFO, a link, a directory) is not a dedup: it is
        removed where safe (remove_entry) and the write goes on; a directory that cannot be
        removed drops the write (counted, logged: not a fault of the disk)."""
        try:
            st = os.lstat(final)
        except OSError:
            return True  # nothing there, or the path fails: the write meets it and counts it
        regular = stat_mod.S_ISREG(st.st_mode)
        if regular and (self._owner is None or st.st_uid == self._owner):
            if replace:
                return True  # the rename replaces it in one step
            self.counters.add("t2_write_dedups", 1)
            return False
        if remove_entry(final):
            log.warning("ucmcache disk tier %s: %s at %s (%s) removed before writing the "
                        "block", self.label, _kind(st.st_mode), final,
                        f"uid {st.st_uid}" if regular else "not a regular file")
            return True
        log.warning("ucmcache disk tier %s: %s at %s cannot be removed: the key's block is "
                    "not written", self.label, _kind(st.st_mode), final)
        self.counters.add("t2_write_drops", 1)
        return False

    def _place(self, tmp: str, final: str, replace: bool) -> bool:
        if replace:
            os.rename(tmp, final)
            return True
        placed = _place_no_replace(tmp, final)
        if placed:
            _unlink_quiet(tmp)  # the link's other name (gone already where it was a rename)
        return placed

    def _make_tmp(self) -> Tuple[str, int]:
        """A new temporary file, flocked by this writer for its life: a cleaner removes a temp
        file only when it can take that lock (its writer is gone), which needs no pid (pids
        repeat across pid namespaces sharing the directory).  Random names: two DiskTiers on
        one path in one process never collide."""
        for _ in range(8):
            tmp = os.path.join(self._tmp, f"{os.getpid()}.{secrets.token_hex(8)}.tmp")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, self._mode)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                # A cleaner may have taken it between our create and our lock and removed it.
                if os.stat(tmp).st_ino == os.fstat(fd).st_ino:
                    return tmp, fd
            except (BlockingIOError, FileNotFoundError):
                pass
            except BaseException:
                os.close(fd)
                _unlink_quiet(tmp)
                raise
            os.close(fd)
        raise OSError(errno.EAGAIN, "could not make a temporary file (removed by cleaners)")

    def flush(self, timeout: Optional[float] = 5.0) -> bool:
        """Wait until every write-through queued so far in this process is written (or
        dropped); False on timeout (None or inf: no deadline)."""
        check_timeout(timeout)
        if self._pid != os.getpid():
            return True
        return self._writes.flush(timeout)

    # ---------------------------------------------------------------- capacity (shared)

    def _usage(self) -> "_UsageLock":
        self._check_pid()
        return _UsageLock(self)

    def _usage_file(self) -> int:
        res = self._res
        assert res is not None
        fd = res.usage_fd
        if fd is None:
            fd = os.open(os.path.join(self.root, "usage"),
                         os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, self._mode)
            res.usage_fd = fd
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
            except OSError as e:  # e.g. made a directory since the scan: not freed
                log.debug("ucmcache disk tier %s: evict %s: %s", self.label, f.path, e)
                continue
            freed += f.size
            n += 1
        self.counters.add_many({"t2_evictions": n, "t2_evicted_bytes": freed})
        return used - freed, n

    def _scan(self) -> List[BlockFile]:
        """Every block file (the index, rebuilt from the directory); temporary files of dead
        writers are removed on the way."""
        out = scan_blocks(self._blocks)
        self._clean_tmp()
        return out

    def _clean_tmp(self) -> int:
        """Remove the temporary files no writer holds (a writer flocks its file until renamed
        or removed; the kernel drops a killed writer's lock); returns how many."""
        removed = 0
        try:
            entries = list(os.scandir(self._tmp))
        except FileNotFoundError:
            return 0
        for e in entries:
            if not e.name.endswith(".tmp"):
                continue
            try:
                fd = os.open(e.path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOFOLLOW)
            except OSError:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                if os.stat(e.path).st_ino == os.fstat(fd).st_ino:
                    _unlink_quiet(e.path)
                    removed += 1
            except OSError:
                pass  # held: its writer is alive (or the file is gone already)
            finally:
                os.close(fd)
        return removed

    # ---------------------------------------------------------------- tools (CLI)

    def files(self) -> List[BlockFile]:
        """Every block file of the directory (a scan)."""
        return self._scan()

    def verify(self, remove_bad: bool = False) -> VerifyResult:
        """Read and check every block file; with remove_bad, remove those that fail (where
        that is safe: remove_entry).  Whatever has a block's name is judged as a read would
        judge it and never waited for: a FIFO, a directory, a link or another user's file is
        bad, with what it is."""
        ok = removed = 0
        bad: List[Tuple[str, str]] = []
        self._clean_tmp()
        for f in scan_blocks(self._blocks, every=True):
            try:
                fd, st = open_block(f.path, self._owner)
                try:
                    buf = bytearray(st.st_size)
                    _read_all(fd, buf)
                finally:
                    os.close(fd)
                decode(buf, f.block_id, f.offset)
                ok += 1
            except FileNotFoundError:
                continue
            except (BadBlock, OSError) as e:
                bad.append((f.path, str(e)))
                if remove_bad and remove_entry(f.path):
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

    def close(self, timeout: Optional[float] = 5.0) -> None:
        """Flush write-throughs (bounded: None or inf, no deadline), stop this process's threads, close the usage file
        and unmap the counter file.  Bounded: a read or a writer stuck in the kernel keeps its
        daemon thread, not the caller.  The tier can be used again afterwards (threads, fd and
        map come back on demand)."""
        bound = check_timeout(timeout)  # refused before anything stops
        if self._pid != os.getpid():
            self._reset_process_state()
            return
        self.flush(timeout)
        self._writes.stop()
        with self._pool_lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.stop()
        res = self._res
        if res is not None:
            # Under the thread lock: a writer still inside the usage lock keeps the fd (the
            # finalizer closes it later).
            if self._usage_lock.acquire(
                    timeout=self.lock_wait if bound is None else min(bound, self.lock_wait)):
                try:
                    res.close_usage()
                finally:
                    self._usage_lock.release()
            self.counters.close()

    def bind(self, count: Callable[[int, int], None], slot_size: int) -> "BoundDisk":
        """This tier as one cache uses it (ucmcache.core.tier).  Its counters are its own (the
        directory's ``t2_*``), not the segment's, which count the Redis tier."""
        return BoundDisk(self, slot_size)


class UsageLockBusy(OSError):
    """The usage lock stayed held past ``lock_wait`` (a stopped or stuck process holds it)."""


class _UsageLock:
    """flock on the usage file (across processes) plus a thread lock (within this one), both
    taken within ``lock_wait``: a holder that is stopped (SIGSTOP, a debugger) or stuck never
    holds a taker for longer; the taker gets UsageLockBusy."""

    def __init__(self, tier: DiskTier):
        self.tier = tier

    def __enter__(self) -> "_UsageLock":
        t = self.tier
        deadline = time.monotonic() + t.lock_wait
        if not t._usage_lock.acquire(timeout=max(0.0, t.lock_wait)):
            raise UsageLockBusy(errno.EWOULDBLOCK, f"usage lock of {t.label}: held by another "
                                f"thread past {t.lock_wait} s")
        try:
            fd = t._usage_file()
            delay = 0.001
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise UsageLockBusy(errno.EWOULDBLOCK, f"usage lock of {t.label}: "
                                            f"held by another process past {t.lock_wait} s")
                    time.sleep(min(delay, left))  # flock has no timed wait: poll, backing off
                    delay = min(delay * 2, 0.05)
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


class _Files:
    """The fd and the map a DiskTier holds in this process (closed by close(), the finalizer,
    or dropped in a forked child)."""

    def __init__(self, counters: ProcessCounters):
        self.usage_fd: Optional[int] = None
        self.counters = counters

    def close_usage(self) -> None:
        fd, self.usage_fd = self.usage_fd, None
        if fd is not None:
            try:
                os.close(fd)
            except OSError:
                pass

    def release(self) -> None:
        self.close_usage()
        self.counters.close()

    def drop_inherited(self) -> None:
        """In a forked child: no lock taken (a parent thread may have held one at the fork)."""
        self.close_usage()
        drop_inherited(self.counters)


_QUEUED, _RUNNING, _DONE, _CANCELLED = range(4)


class _Batch:
    """Jobs one caller waits for together, with one deadline."""

    def __init__(self, n: int):
        self.cond = threading.Condition(threading.Lock())
        self.left = n

    def wait(self, jobs: Sequence["_Job"], timeout: float) -> List[bool]:
        """Wait up to timeout for the jobs; the ones not started are cancelled (never run);
        returns which finished."""
        deadline = time.monotonic() + timeout
        with self.cond:
            while self.left > 0:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self.cond.wait(left)
            for j in jobs:
                if j.state == _QUEUED:
                    j.state = _CANCELLED
            return [j.state == _DONE for j in jobs]


class _Job:
    __slots__ = ("fn", "args", "batch", "state", "value", "error")

    def __init__(self, fn: Callable[..., Any], args: Tuple[Any, ...], batch: _Batch):
        self.fn, self.args, self.batch = fn, args, batch
        self.state = _QUEUED
        self.value: Any = None
        self.error: Optional[BaseException] = None

    def run(self) -> None:
        with self.batch.cond:
            if self.state != _QUEUED:
                return
            self.state = _RUNNING
        try:
            self.value = self.fn(*self.args)
        except BaseException as e:  # the waiter judges it
            self.error = e
        with self.batch.cond:
            self.state = _DONE
            self.batch.left -= 1
            self.batch.cond.notify_all()

    def result(self, timeout: float) -> Any:
        if not self.batch.wait([self], timeout)[0]:
            raise TimeoutError("job not done")
        if self.error is not None:
            raise self.error
        return self.value


class _Readers:
    """This process's read threads for one tier: at most ``count`` daemon threads on a FIFO
    queue.  Not concurrent.futures: it joins its workers at interpreter exit, so one read that
    never returns (hung NFS/FUSE, a dying disk) would hold process exit forever; a daemon
    thread stuck in the kernel does not."""

    def __init__(self, count: int, name: str):
        self._count = count
        self._name = name
        self._cond = threading.Condition(threading.Lock())
        self._queue: deque = deque()
        self._threads = 0
        self._idle = 0
        self._stopping = False

    def submit(self, fn: Callable[..., Any], *args: Any, batch: Optional[_Batch] = None) -> _Job:
        job = _Job(fn, args, batch if batch is not None else _Batch(1))
        with self._cond:
            self._stopping = False
            self._queue.append(job)
            if len(self._queue) > self._idle and self._threads < self._count:
                t = threading.Thread(target=self._run, name=self._name, daemon=True)
                try:
                    t.start()
                except RuntimeError as e:  # cannot start a thread (EAGAIN: too many)
                    if self._threads == 0:
                        self._queue.remove(job)
                        raise OSError(errno.EAGAIN, f"cannot start a read thread: {e}") from e
                else:
                    self._threads += 1
            self._cond.notify()
        return job

    def stop(self) -> None:
        """Idle threads exit; busy ones exit when their read returns.  Never waits."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._stopping:
                    self._idle += 1
                    try:
                        self._cond.wait()
                    finally:
                        self._idle -= 1
                if not self._queue:
                    self._threads -= 1
                    return
                job = self._queue.popleft()
            job.run()


def _foreign(path: str, what: str) -> ForeignTierDirectory:
    return ForeignTierDirectory(f"disk tier directory {path!r} {what}; pass "
                                "allow_other_user=True to use it anyway")


def _no_capacity(path: str) -> ValueError:
    return ValueError(f"disk tier {path!r} records no capacity_bytes (new, or made before "
                      "capacities were recorded): give one")


def _kind(st_mode: int) -> str:
    for test, name in ((stat_mod.S_ISLNK, "a symbolic link"), (stat_mod.S_ISDIR, "a directory"),
                       (stat_mod.S_ISFIFO, "a FIFO"), (stat_mod.S_ISSOCK, "a socket"),
                       (stat_mod.S_ISCHR, "a character device"),
                       (stat_mod.S_ISBLK, "a block device"), (stat_mod.S_ISREG, "a regular file")):
        if test(st_mode):
            return name
    return f"a file of type {stat_mod.S_IFMT(st_mode):#o}"


def _make_dir(d: str, mode: int) -> bool:
    """mkdir with exactly ``mode`` (the umask would clear bits: set again on the new directory
    itself, through an fd that does not follow a link); False if it was there already."""
    try:
        os.mkdir(d, mode)
    except FileExistsError:
        return False
    fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        os.fchmod(fd, mode)
    finally:
        os.close(fd)
    return True


def _make_dirs(path: str, mode: int) -> None:
    """path and the directories missing above it, each made with exactly ``mode``."""
    missing = []
    p = path
    while not os.path.isdir(p):
        missing.append(p)
        parent = os.path.dirname(p)
        if parent == p:
            break
        p = parent
    for d in reversed(missing):
        _make_dir(d, mode)


def read_capacity_record(root: str, owner: Optional[int] = None) -> Optional[int]:
    """The capacity_bytes a tier's ``ucm-disk-v1`` directory was made with; None if it records
    none.  A record that is not a regular file, not ``owner``'s (when given) or not a number
    raises ForeignTierDirectory or ValueError, naming it."""
    path = os.path.join(root, CAPACITY_FILE)
    try:
        fd = os.open(path, _OPEN_BLOCK)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise _foreign(path, f"cannot be read as a capacity record ({e.strerror})") from None
    try:
        st = os.fstat(fd)
        if not stat_mod.S_ISREG(st.st_mode):
            raise _foreign(path, f"is {_kind(st.st_mode)}, not a capacity record")
        if owner is not None and st.st_uid != owner:
            raise _foreign(path, f"belongs to uid {st.st_uid}, not to us (uid {owner})")
        raw = os.pread(fd, 32, 0)
    finally:
        os.close(fd)
    try:
        value = int(raw.decode("ascii").strip())
    except (UnicodeDecodeError, ValueError):
        value = 0
    if value <= HEADER_SIZE:
        raise ValueError(f"{path}: {raw!r} is not a capacity record (a number of bytes > "
                         f"{HEADER_SIZE}); remove it and make the tier again to record one")
    return value


def open_block(path: str, owner: Optional[int]) -> Tuple[int, os.stat_result]:
    """An fd of the block file at path and its fstat: FileNotFoundError when there is none;
    BadBlock (saying why) when what is there must not be read as a block: a symbolic link, a
    FIFO or any file that is not regular (never waited for: O_NONBLOCK), or a file of another
    user than ``owner`` (None: any).  Other OSErrors are the disk's."""
    try:
        fd = os.open(path, _OPEN_BLOCK)
    except OSError as e:
        if e.errno not in (errno.ELOOP, errno.ENXIO, errno.EISDIR, errno.EWOULDBLOCK):
            raise
        # A link at the name (O_NOFOLLOW), a socket, ...: name what is there.  A name that
        # cannot even be looked at (a loop above it) is the disk's error, not a bad block.
        try:
            what = _kind(os.lstat(path).st_mode)
        except OSError:
            raise e from None
        raise BadBlock(f"{what}, not a regular file") from None
    try:
        st = os.fstat(fd)
        if not stat_mod.S_ISREG(st.st_mode):
            raise BadBlock(f"{_kind(st.st_mode)}, not a regular file")
        if owner is not None and st.st_uid != owner:
            raise BadBlock(f"owned by uid {st.st_uid}, not by us (uid {owner}): another "
                           "user's block is never served (allow_other_user=True trusts it)")
    except BaseException:
        os.close(fd)
        raise
    return fd, st


def remove_entry(path: str) -> bool:
    """Remove what is at a block's name where that is safe: any name but a directory (only
    the name goes: a link's target, a FIFO's reader are untouched), an empty directory; a
    directory with something in it stays (what is in it is not ours to judge).  True if gone."""
    try:
        if stat_mod.S_ISDIR(os.lstat(path).st_mode):
            os.rmdir(path)
        else:
            os.unlink(path)
    except FileNotFoundError:
        return True
    except OSError:
        return False
    return True


def _place_no_replace(tmp: str, final: str) -> bool:
    """Give the complete file at tmp the name final unless final exists (a hard link: never
    over another's; tmp keeps its name, the caller removes it); True if placed.  Where links
    are not supported, a rename after a check (a racing writer may then be replaced)."""
    try:
        os.link(tmp, final)
        return True
    except FileExistsError:
        return False
    except OSError as e:
        if e.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.EMLINK, errno.EXDEV):
            raise
    if os.path.lexists(final):
        return False
    os.rename(tmp, final)
    return True


def scan_blocks(blocks_dir: str, every: bool = False) -> List[BlockFile]:
    """Every block file under a tier's ``blocks/`` (reads only: the tools use it): regular
    files named as blocks; with ``every``, whatever else has a block's name too (a FIFO, a
    directory, a link: what verify reports)."""
    out: List[BlockFile] = []
    try:
        subdirs = list(os.scandir(blocks_dir))
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
            if not every and not stat_mod.S_ISREG(st.st_mode):
                continue
            out.append(BlockFile(key[0], key[1], st.st_size, st.st_mtime_ns, e.path))
    return out


def read_usage_record(root: str) -> Optional[int]:
    """The usage record of a tier's ``ucm-disk-v1`` directory, read without its lock (one
    8-byte pread, written by one 8-byte pwrite) and without keeping an fd; None if missing."""
    try:
        fd = os.open(os.path.join(root, "usage"), os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    try:
        raw = os.pread(fd, 8, 0)
    finally:
        os.close(fd)
    return _U64.unpack(raw)[0] if len(raw) == 8 else None


class BoundDisk(BoundTier):
    """A DiskTier as one SlotCache uses it: the keys of the owned loads it missed or a put
    owns (slot -> (block_id, offset, whether a put's)) until their owners publish (written
    through) or close."""

    def __init__(self, tier: DiskTier, slot_size: int):
        self.tier = tier
        self._limit = slot_size
        self.pending: Dict[int, Tuple[bytes, int, bool]] = {}

    def lookup(self, owned: Sequence[Owned], may_wait: bool,
               timeout: Optional[float]) -> List[Optional[memoryview]]:
        for slot, _, _ in owned:
            self._forget(slot)
        if _hooks._armed:
            _hooks.fire("disk_lookup")  # an owner is about to read the disk
        try:
            out = self.tier._read_many([(b, o) for _, b, o in owned], self._limit, timeout)
        except OSError:
            # The disk's fault (reads run on threads; this is what reached this one, e.g. no
            # thread could start): load as if the disk were absent.  Anything else (a signal
            # handler's exception, KeyboardInterrupt) is the caller's and goes up.
            log.exception("ucmcache disk tier %s: unexpected error; bypassing", self.tier.label)
            self.tier.counters.add("t2_bypasses", len(owned))
            out = [None] * len(owned)
        for (slot, b, o), p in zip(owned, out):
            if p is None:
                self.pending[slot] = (b, o, False)
        return out

    def put(self, owned: Sequence[Owned], may_wait: bool,
            timeout: Optional[float]) -> List[Optional[memoryview]]:
        """put(): the disk is not read (the value is the caller's); each key's older block is
        removed now, bounded (_begin_replace: OSError if it cannot be, and the put stores
        nothing), and what the owner publishes is written over whatever the disk holds."""
        for slot, _, _ in owned:
            self._forget(slot)
        keys = [(b, o) for _, b, o in owned]
        self.tier._begin_replace(keys, timeout)
        for slot, b, o in owned:
            self.pending[slot] = (b, o, True)
        return [None] * len(owned)

    def exist_prefix(self, keys: Sequence[Tuple[bytes, int]]) -> int:
        return self.tier._exist_prefix(keys, self._limit)

    def write_through(self, slot: int, payload: memoryview) -> None:
        key = self.pending.pop(slot, None)
        if key is not None:
            self.tier._put(key[0], key[1], payload, key[2])

    def abandon(self, slot: int) -> None:
        self._forget(slot)

    def _forget(self, slot: int) -> None:
        key = self.pending.pop(slot, None)
        if key is not None and key[2]:
            self.tier._end_replace((key[0], key[1]))

    def close(self) -> None:
        for slot in list(self.pending):
            self._forget(slot)
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
        t._reset_process_state()  # closes the parent's usage fd in this child at once


os.register_at_fork(after_in_child=_forget_after_fork)
