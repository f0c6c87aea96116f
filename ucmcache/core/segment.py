"""Segment: one /dev/shm object per uuid; exclusive create, bounded attach, validation.

Bootstrap protocol
------------------
create:  shm_open(O_CREAT|O_EXCL, 0600) -> take the creator lock (an OFD lock on a byte far past
         the end of the file) -> check that the name still names our file (a creator stalled
         before its lock for HALF_MADE_GRACE_S can have it replaced as half-made; it then
         closes its fd and starts again, never making an unlinked file) -> size and reserve the
         memory (posix_fallocate, so a full /dev/shm fails here and not with SIGBUS later) ->
         write the creator pid (from here on, "pid set and creator lock free" means the
         creator died) -> initialise every region -> write the magic last with release order
         and wake attachers -> drop the creator lock.
attach:  open -> check the owner uid -> wait, bounded, for the magic (futex on its low word) ->
         check layout version, then every header field, then the file size -> map it all.
         Until all of that holds nothing in the segment is trusted.
A segment whose creator died before the magic is "half-made": attach says so at once, and
create() replaces it.  Nobody unlinks implicitly: close() detaches, unlink() removes.
"""
from __future__ import annotations

import math
import mmap
import os
import re
import stat
import time
from contextlib import contextmanager
from typing import Any, Dict, Iterator, Optional

import numpy as np
import posix_ipc

from . import hooks as _hooks
from .._core import ffi, lib
from .errors import (CorruptSegment, ForeignSegment, HalfMadeSegment, IncompatibleSegment,
                      SegmentExists, SegmentNotFound, SharedMemoryFull, UcmError)
from .layout import HEADER, Layout, LayoutError
from .timeouts import check_timeout

SHM_DIR = "/dev/shm"
PREFIX = "ucmcache-"
# OFD lock bytes: far past the end of any segment, so they never overlap data (locks on bytes
# beyond EOF are allowed).  One for the creator, one per rank (the rank's life lock).
CREATOR_LOCK_BYTE = 1 << 40
LIFE_LOCK_BYTE0 = CREATOR_LOCK_BYTE + 1
# A segment with neither a creator pid nor a creator lock is only "being made" for the few
# microseconds between shm_open and the lock; older than this, its creator died in that window.
HALF_MADE_GRACE_S = 2.0
# A segment file's mode is permission bits only: no setuid, setgid or sticky bit, no file type.
MAX_MODE = 0o777

_UUID_RE = re.compile(r"[A-Za-z0-9_-]{1,64}")


def check_uuid(uuid: object) -> str:
    if not isinstance(uuid, str) or not _UUID_RE.fullmatch(uuid):
        raise ValueError(f"uuid must match [A-Za-z0-9_-]{{1,64}}, got {uuid!r}")
    return uuid


def shm_name(uuid: str) -> str:
    return "/" + PREFIX + check_uuid(uuid)


def shm_path(uuid: str) -> str:
    return os.path.join(SHM_DIR, PREFIX + check_uuid(uuid))


def life_lock_byte(rank: int) -> int:
    return LIFE_LOCK_BYTE0 + rank


def check_mode(mode: object) -> int:
    """A segment file's mode: an int of permission bits only (0 to 0o777), else ValueError."""
    if isinstance(mode, bool) or not isinstance(mode, int):
        raise ValueError(f"mode must be an int of permission bits from 0 to {MAX_MODE:#o}, "
                         f"got {mode!r}")
    if not 0 <= mode <= MAX_MODE:
        raise ValueError(f"mode must be permission bits from 0 to {MAX_MODE:#o}, got {mode:#o} "
                         "(setuid, setgid, sticky and file-type bits are refused)")
    return mode


_FILE_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISLNK, "a symbolic link"),
               (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
               (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))


def file_kind(st_mode: int) -> str:
    """'a directory', 'a symbolic link', ... for a /dev/shm entry that is not a regular file."""
    return next((name for test, name in _FILE_KINDS if test(st_mode)), f"type {st_mode:#o}")


def _not_a_file(uuid: str, st_mode: int) -> ForeignSegment:
    return ForeignSegment(f"segment {uuid!r}: {shm_path(uuid)} is {file_kind(st_mode)}, not a "
                          "shared-memory file, so not a ucmcache segment; refusing to use it")


def _open_existing(uuid: str) -> posix_ipc.SharedMemory:
    """Open the segment's file; anything but a regular file there (a directory any local user
    can make, a symlink, a FIFO) is ForeignSegment naming it, and is never opened if lstat sees
    it first (opening a FIFO or a device can have effects of its own)."""
    try:
        st = os.lstat(shm_path(uuid))
    except FileNotFoundError:
        st = None               # shm_open below says so, in its words
    if st is not None and not stat.S_ISREG(st.st_mode):
        raise _not_a_file(uuid, st.st_mode)
    try:
        shm = posix_ipc.SharedMemory(shm_name(uuid), flags=0)
    except posix_ipc.ExistentialError:
        raise SegmentNotFound(f"no ucmcache segment {uuid!r} ({shm_path(uuid)} does not exist)") from None
    except posix_ipc.PermissionsError as e:
        raise ForeignSegment(f"segment {uuid!r} cannot be opened: {e}") from None
    except (ValueError, OSError) as e:  # replaced by a non-file since the lstat (EISDIR, ELOOP)
        raise ForeignSegment(f"segment {uuid!r}: {shm_path(uuid)} cannot be opened as a "
                             f"shared-memory file: {e}") from None
    try:
        mode = os.fstat(shm.fd).st_mode
    except BaseException:
        shm.close_fd()
        raise
    if not stat.S_ISREG(mode):          # the same race, caught on what was really opened
        shm.close_fd()
        raise _not_a_file(uuid, mode)
    return shm


def _creator_lock_free(fd: int) -> bool:
    r = lib.ucm_ofd_held_by_other(fd, CREATOR_LOCK_BYTE)
    if r < 0:
        raise OSError(-r, os.strerror(-r), "OFD lock probe")
    return r == 0


def _read_header(fd: int, size: int) -> Dict[str, int]:
    """The header's words, read through a private mapping of the first page."""
    if size < lib.UCM_HEADER_SIZE:
        return {}
    mm = mmap.mmap(fd, lib.UCM_HEADER_SIZE, mmap.MAP_SHARED, mmap.PROT_READ)
    try:
        buf = ffi.from_buffer(mm)
        try:
            base = ffi.cast("char *", buf)
            # The magic first, acquire (it pairs with ucm_segment_publish's release), then the
            # rest: once the magic reads set, every other word reads as its creator wrote it.
            magic = lib.ucm_load64(base, lib.UCM_H_MAGIC)
            row = np.frombuffer(mm[:HEADER.itemsize], dtype=HEADER, count=1)[0]
            header = {name: int(row[name]) for name in HEADER.fields or {}}
            header["magic"] = magic
            header["computed_crc"] = lib.ucm_params_crc(base)
            return header
        finally:
            ffi.release(buf)
    finally:
        mm.close()


def probe(uuid: str) -> Dict[str, Any]:
    """What a segment is, without attaching: status is one of made, making, half-made,
    incompatible, corrupt.  Never raises for a bad segment (only for a missing one)."""
    shm = _open_existing(uuid)
    try:
        st = os.fstat(shm.fd)
        header = _read_header(shm.fd, st.st_size)
        info: Dict[str, Any] = {"uuid": uuid, "size": st.st_size, "uid": st.st_uid,
                                   "header": header}
        magic = header.get("magic", 0)
        creator_gone = False
        if magic == 0:
            if _hooks._armed:
                _hooks.fire("magic_unset")
            if _creator_lock_free(shm.fd):
                # Read again, as _wait_for_magic does: a creator that finished since our read
                # published the magic before dropping its lock.
                st = os.fstat(shm.fd)
                header = _read_header(shm.fd, st.st_size)
                info.update(size=st.st_size, header=header)
                magic = header.get("magic", 0)
                creator_gone = True
        if magic == lib.UCM_MAGIC:
            if header["version"] != lib.UCM_LAYOUT_VERSION:
                info["status"] = "incompatible"
            else:
                try:
                    _validate(uuid, header, st.st_size)
                    info["status"] = "made"
                except UcmError as e:
                    info["status"], info["error"] = "corrupt", str(e)
        elif magic != 0:
            info["status"] = "corrupt"
            info["error"] = str(not_ucmcache_error(uuid, magic))
        elif creator_gone and (
                header.get("creator_pid", 0) != 0 or time.time() - st.st_ctime > HALF_MADE_GRACE_S):
            info["status"] = "half-made"
        else:
            info["status"] = "making"
        return info
    finally:
        shm.close_fd()


# What attach finds wrong before it trusts a segment, in one wording for every caller (attach,
# probe, and the ucmcache command, which reports what probe found without attaching).

def half_made_error(uuid: str, pid: int) -> HalfMadeSegment:
    who = f"(pid {pid}) " if pid else ""
    return HalfMadeSegment(
        f"segment {uuid!r} is half-made: its creator {who}died before finishing it; "
        f"SlotCache.create() with the same uuid replaces it, `ucmcache rm {uuid}` or "
        "`ucmcache gc` removes it")


def not_ours_error(uuid: str, uid: int, refusal: str) -> ForeignSegment:
    return ForeignSegment(f"segment {uuid!r} belongs to uid {uid}, not to us (uid {os.getuid()}); "
                          f"{refusal}")


def version_error(uuid: str, version: int) -> IncompatibleSegment:
    return IncompatibleSegment(f"segment {uuid!r} has layout version {version}, this ucmcache "
                               f"reads version {lib.UCM_LAYOUT_VERSION}")


def not_ucmcache_error(uuid: str, magic: int) -> CorruptSegment:
    return CorruptSegment(f"segment {uuid!r} is not a ucmcache segment (magic {magic:#x}, "
                          f"expected {lib.UCM_MAGIC:#x})")


def probed_error(uuid: str, info: Dict[str, Any]) -> Optional[UcmError]:
    """The error attach would raise for a segment probe() found half-made, incompatible or
    corrupt; None for one that is made or still being made."""
    status, header = info["status"], info["header"]
    if status == "half-made":
        return half_made_error(uuid, header.get("creator_pid", 0))
    if status == "incompatible":
        return version_error(uuid, header["version"])
    if status == "corrupt":
        return CorruptSegment(info["error"])
    return None


def _validate(uuid: str, h: Dict[str, int], file_size: int) -> Layout:
    if h["version"] != lib.UCM_LAYOUT_VERSION:
        raise version_error(uuid, h["version"])
    if h["layout_fp"] != lib.ucm_layout_fingerprint():
        raise IncompatibleSegment(
            f"segment {uuid!r} was laid out by another build of ucmcache (layout fingerprint "
            f"{h['layout_fp']:#010x}, this build's is {lib.ucm_layout_fingerprint():#010x})")
    if h["features"] != 0:
        raise IncompatibleSegment(f"segment {uuid!r} uses feature bits {h['features']:#x} this "
                                  "ucmcache does not know")
    try:
        layout = Layout.compute(max_ranks=h["max_ranks"], slots_per_rank=h["slots_per_rank"],
                                slot_size=h["slot_size"], n_buckets=h["n_buckets"] or None,
                                n_stripes=h["n_stripes"])
    except (LayoutError, TypeError) as e:
        raise CorruptSegment(f"segment {uuid!r} header field out of range: {e}") from None
    if h["params_crc"] != h["computed_crc"]:
        raise CorruptSegment(f"segment {uuid!r} header checksum mismatch: a param word changed "
                             "after the segment was made")
    if h["n_buckets"] != layout.n_buckets:
        raise CorruptSegment(f"segment {uuid!r} header n_buckets={h['n_buckets']} is not valid")
    if h["total_size"] != layout.total_size:
        raise CorruptSegment(f"segment {uuid!r} header says total_size={h['total_size']}, its "
                             f"params need {layout.total_size}")
    if file_size != layout.total_size:
        raise CorruptSegment(f"segment {uuid!r} is truncated or padded: the file has {file_size} "
                             f"bytes, its header needs {layout.total_size}")
    return layout


def _open_lock_fd(fd: int, writable: bool) -> int:
    """A second open file description of the segment's file, used for nothing but OFD locks.

    OFD locks belong to an open file description, and every fd that shares one shares its
    locks.  CPython's mmap keeps its own dup of the fd it maps, so a forked child (a fork pool,
    a DataLoader worker) would keep a life lock taken on the shm fd alive after its parent died.
    This description is shared with nothing: its fd is close-on-exec and closed in a forked
    child (SlotCache's after-fork hook), so the kernel drops the locks when this process dies.
    Reopened through /proc/self/fd, so it is the same file even if the name was replaced."""
    flags = (os.O_RDWR if writable else os.O_RDONLY) | os.O_CLOEXEC
    return os.open(f"/proc/self/fd/{fd}", flags)


class Segment:
    """A mapped, validated segment: its fd and mapping, the base pointer the C core works on,
    and a separate lock fd for the OFD life locks (see _open_lock_fd)."""

    def __init__(self, uuid: str, shm: posix_ipc.SharedMemory, mm: mmap.mmap, layout: Layout,
                 writable: bool = True):
        self.uuid = uuid
        self.shm = shm
        self.fd = shm.fd
        self.lock_fd = _open_lock_fd(shm.fd, writable)
        # Recovery and rank taking are exclusive between processes by the life lock itself, but
        # the threads of this process share lock_fd's description, so each one's trylock would
        # succeed: this lock makes "trylock -> recover -> unlock" exclusive among them too.
        # see ucm_plock in ucm_core.c
        self.rank_lock = ffi.gc(lib.ucm_plock_new(), lib.ucm_plock_free)
        if self.rank_lock == ffi.NULL:
            os.close(self.lock_fd)
            raise MemoryError("could not allocate the process-local rank lock")
        self.mm: Optional[mmap.mmap] = mm
        self.layout = layout
        self._buf = ffi.from_buffer(mm)
        self.base = ffi.cast("char *", self._buf)
        self.view = memoryview(mm)
        # Readers' views are slices of this one (one object per slice, no toreadonly() each).
        self.ro_view = self.view.toreadonly()

    # ---------------------------------------------------------------- create

    @classmethod
    def create(cls, uuid: str, layout: Layout, *, mode: int = 0o600) -> "Segment":
        check_uuid(uuid)
        check_mode(mode)
        _check_room(uuid, layout.total_size)
        for _ in range(3):
            try:
                shm = posix_ipc.SharedMemory(shm_name(uuid), flags=posix_ipc.O_CREX, mode=mode)
            except posix_ipc.ExistentialError:
                if _replace_half_made(uuid):
                    continue
                raise SegmentExists(f"segment {uuid!r} already exists ({shm_path(uuid)})") from None
            try:
                seg = cls._make(uuid, shm, layout)
            except BaseException:
                unlink_if_same(uuid, shm.fd)
                shm.close_fd()
                raise
            if seg is not None:
                return seg
            shm.close_fd()      # our file was replaced before we locked it: start again
        raise SegmentExists(f"segment {uuid!r} keeps being re-created by another process")

    @classmethod
    def _make(cls, uuid: str, shm: posix_ipc.SharedMemory, layout: Layout) -> Optional["Segment"]:
        """Make the segment in the file just created; None if the name no longer names it."""
        fd = shm.fd
        if _hooks._armed:
            _hooks.fire("after_shm_open")
        if lib.ucm_ofd_trylock(fd, CREATOR_LOCK_BYTE) != lib.UCM_OK:
            raise SegmentExists(f"segment {uuid!r} is being created by another process")
        # Re-check under the lock.  Until we held it, our empty file looked half-made to any
        # create() once HALF_MADE_GRACE_S had passed, and that one may have unlinked it and made
        # its own under the name.  Now nobody can: replacing takes the creator lock first.
        if not names_file(uuid, fd):
            return None
        os.ftruncate(fd, layout.total_size)
        try:
            os.posix_fallocate(fd, 0, layout.total_size)
        except OSError as e:
            raise SharedMemoryFull(_room_message(uuid, layout.total_size, str(e))) from None
        mm = mmap.mmap(fd, layout.total_size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        seg = cls(uuid, shm, mm, layout)
        try:
            seg._initialise()
        except BaseException:
            seg.detach()
            raise
        lib.ucm_ofd_unlock(fd, CREATOR_LOCK_BYTE)
        return seg

    def _initialise(self) -> None:
        # Every word but the magic, in one C step (the pid first: from here on a free creator
        # lock with the magic unset means we died), then the magic last with release order.
        r = lib.ucm_segment_init(self.base, self.layout.to_c(), os.getpid(), os.getuid())
        if r != 0:
            raise OSError(r, os.strerror(r), "pthread_mutex_init (robust, process-shared)")
        if _hooks._armed:
            _hooks.fire("before_magic")
        lib.ucm_segment_publish(self.base)

    # ---------------------------------------------------------------- attach

    @classmethod
    def attach(cls, uuid: str, *, timeout: float = 10.0, allow_other_user: bool = False,
               writable: bool = True) -> "Segment":
        check_uuid(uuid)
        wait = check_timeout(timeout)  # None or inf: no deadline
        shm = _open_existing(uuid)
        try:
            st = os.fstat(shm.fd)
            if st.st_uid != os.getuid() and not allow_other_user:
                raise not_ours_error(uuid, st.st_uid, "pass allow_other_user=True to use it anyway")
            header = _wait_for_magic(uuid, shm.fd, math.inf if wait is None else wait)
            size = os.fstat(shm.fd).st_size
            layout = _validate(uuid, header, size)
            prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
            mm = mmap.mmap(shm.fd, layout.total_size, mmap.MAP_SHARED, prot)
            try:
                return cls(uuid, shm, mm, layout, writable)
            except BaseException:
                mm.close()
                raise
        except BaseException:
            shm.close_fd()
            raise

    def header(self) -> Dict[str, int]:
        return _read_header(self.fd, self.layout.total_size)

    # ---------------------------------------------------------------- teardown

    def detach(self) -> None:
        """Unmap and close the fd (which drops any OFD lock this attachment holds)."""
        if self.mm is None:
            return
        self.ro_view.release()
        self.view.release()
        ffi.release(self._buf)
        try:
            self.mm.close()
        except BufferError:
            raise UcmError(
                f"segment {self.uuid!r} cannot be unmapped: data views (memoryviews or numpy "
                "arrays from handles) are still alive; drop them first") from None
        self.mm = None
        self.close_fds()

    def close_fds(self) -> None:
        """Close the lock fd (which drops every OFD lock this attachment holds) and the shm fd,
        leaving the mapping (if any) to go when this object does."""
        if self.lock_fd >= 0:
            os.close(self.lock_fd)
            self.lock_fd = -1
        self.shm.close_fd()

    def forget_after_fork(self) -> None:
        """In a forked child: close the inherited lock fd so the parent's life lock dies with
        the parent (the shm fd and mmap's dup hold no lock), and never use the parent's
        attachment."""
        try:
            os.close(self.lock_fd)
        except OSError:
            pass
        self.lock_fd = -1  # closed: a second call must not close a reused fd number

    @staticmethod
    def unlink(uuid: str) -> None:
        try:
            st = os.lstat(shm_path(uuid))
        except FileNotFoundError:
            st = None
        if st is not None and not stat.S_ISREG(st.st_mode):
            raise _not_a_file(uuid, st.st_mode)
        try:
            posix_ipc.unlink_shared_memory(shm_name(uuid))
        except posix_ipc.ExistentialError:
            raise SegmentNotFound(f"no ucmcache segment {uuid!r} to unlink") from None


def _free_shm_bytes() -> int:
    st = os.statvfs(SHM_DIR)
    return st.f_bavail * st.f_frsize


def _room_message(uuid: str, needed: int, detail: str = "") -> str:
    free = _free_shm_bytes()
    msg = (f"segment {uuid!r} needs {needed} bytes of shared memory but {SHM_DIR} has {free} free"
           " (in Docker, raise --shm-size)")
    return f"{msg}: {detail}" if detail else msg


def _check_room(uuid: str, needed: int) -> None:
    if needed > _free_shm_bytes():
        raise SharedMemoryFull(_room_message(uuid, needed))


def names_file(uuid: str, fd: int) -> bool:
    """Whether the segment's name still names the file behind fd (not unlinked, not replaced)."""
    try:
        st = os.stat(shm_path(uuid))
    except FileNotFoundError:
        return False
    own = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (own.st_dev, own.st_ino)


def unlink_if_same(uuid: str, fd: int) -> bool:
    """Unlink the name only if it still names the file behind fd; True if it did."""
    try:
        if not names_file(uuid, fd):
            return False
        posix_ipc.unlink_shared_memory(shm_name(uuid))
        return True
    except (OSError, posix_ipc.ExistentialError):
        return False


@contextmanager
def held_for_removal(uuid: str) -> Iterator[Dict[str, Any]]:
    """Open the segment and try to take its creator lock and every possible rank's life lock.

    While they are held nobody can attach (taking a rank needs its life lock) or be creating
    it, so "no live rank" stays true until the caller unlinks (with unlink_if_same).  Yields
    {fd, busy_ranks, creator_busy, header}; closing the fd drops every lock.  The price: an
    attach racing a removal in that instant finds every rank taken (RankUnavailable)."""
    shm = _open_existing(uuid)
    try:
        st = os.fstat(shm.fd)
        if st.st_uid != os.getuid():
            raise not_ours_error(uuid, st.st_uid, "refusing to remove it")
        creator_busy = lib.ucm_ofd_trylock(shm.fd, CREATOR_LOCK_BYTE) != lib.UCM_OK
        busy = [r for r in range(lib.UCM_MAX_RANKS)
                if lib.ucm_ofd_trylock(shm.fd, life_lock_byte(r)) != lib.UCM_OK]
        yield {"fd": shm.fd, "busy_ranks": busy, "creator_busy": creator_busy,
               "header": _read_header(shm.fd, st.st_size)}
    finally:
        shm.close_fd()


def _replace_half_made(uuid: str) -> bool:
    """True if the name is free to create again (it was half-made, or vanished).  Anything but
    a regular file under the name is ForeignSegment: never removed, never created over."""
    try:
        shm = _open_existing(uuid)
    except SegmentNotFound:
        return True
    try:
        st = os.fstat(shm.fd)
        if lib.ucm_ofd_trylock(shm.fd, CREATOR_LOCK_BYTE) != lib.UCM_OK:
            return False  # its creator is alive and at work
        header = _read_header(shm.fd, st.st_size)
        if header.get("magic", 0) != 0:
            return False  # made (or not ours to judge): a real SegmentExists
        if header.get("creator_pid", 0) == 0 and time.time() - st.st_ctime <= HALF_MADE_GRACE_S:
            return False
        # Holding its creator lock, nobody else can be replacing it: the name goes.
        unlink_if_same(uuid, shm.fd)
        return True
    finally:
        shm.close_fd()


def _wait_for_magic(uuid: str, fd: int, timeout: float) -> Dict[str, int]:
    deadline = time.monotonic() + timeout
    delay = 0.0005
    while True:
        size = os.fstat(fd).st_size
        header = _read_header(fd, size)
        magic = header.get("magic", 0)
        if magic == lib.UCM_MAGIC:
            return header
        if magic != 0:
            raise not_ucmcache_error(uuid, magic)
        if _hooks._armed:
            _hooks.fire("magic_unset")
        if _creator_lock_free(fd):
            # Read again: a creator that finished between our read and the probe published the
            # magic before it dropped its lock, so a free lock with the magic still unset now
            # means it died; read once, a live creator finishing in between was taken for dead.
            header = _read_header(fd, os.fstat(fd).st_size)
            magic = header.get("magic", 0)
            if magic == lib.UCM_MAGIC:
                return header
            if magic != 0:
                raise not_ucmcache_error(uuid, magic)
            pid = header.get("creator_pid", 0)
            age = time.time() - os.fstat(fd).st_ctime
            if pid or age > HALF_MADE_GRACE_S:
                raise half_made_error(uuid, pid)
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"segment {uuid!r} was not ready within {timeout} s: its creator "
                               "is still initialising it")
        # Bounded back-off while the creator works (microseconds to milliseconds in practice);
        # the creator wakes futex waiters on the magic word, but the file may not be mapped yet.
        if size >= lib.UCM_HEADER_SIZE:
            mm = mmap.mmap(fd, lib.UCM_HEADER_SIZE, mmap.MAP_SHARED, mmap.PROT_READ)
            buf = ffi.from_buffer(mm)
            try:
                lib.ucm_futex_wait(ffi.cast("char *", buf), lib.UCM_H_MAGIC, 0,
                                   int(min(left, 0.05) * 1e9))
            finally:
                ffi.release(buf)
                mm.close()
        else:
            time.sleep(min(delay, left))
            delay = min(delay * 2, 0.05)
