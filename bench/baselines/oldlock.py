"""The old locking design (seed 002's TransBuffer) behind a Python API shaped like ucmcache's.

The locking lives in C (oldlock.c, built by bench/cbuild.py as a cffi API-mode module, like
ucmcache._core), and the Python side makes the same number of C calls per operation as ucmcache
does (get: one, close: one; exist / get_many + close: one or two per batch), so a comparison
through the Python API measures the locking design, not a difference in call counts.  The
handle is deliberately lean (fewer checks than ucmcache's Handle), which favours the baseline.

The segment is a /dev/shm file named ``ucmbench-old-<uuid>`` with ucmcache's layout (params in
the same header words) plus the old design's lock region; create / attach / unlink by uuid.
"""
from __future__ import annotations

import mmap
import os
from typing import List, Optional, Sequence

import numpy as np

from ucmcache.core.keys import pack_keys, split_key
from ucmcache.core.layout import SLOT_META, Layout

SHM_DIR = "/dev/shm"
PREFIX = "ucmbench-old-"
UCM_LOADING, UCM_READY, UCM_FAILED = 1, 2, 3
LENGTH_OFF = SLOT_META.fields["length"][1]  # the same SlotMeta line as ucmcache's
OWNER_FLAG = 1 << 62
NIL = 0xFFFFFFFF


def _path(uuid: str) -> str:
    return os.path.join(SHM_DIR, PREFIX + uuid)


class OldError(RuntimeError):
    pass


class OldCache:
    def __init__(self, mod, fd: int, mm: mmap.mmap, layout: Layout, uuid: str):
        self._mod = mod
        ffi, lib = mod.ffi, mod.lib
        self._ffi, self._lib = ffi, lib
        self.uuid = uuid
        self._fd = fd
        self._mm = mm
        self._buf = ffi.from_buffer(mm)
        self._base = ffi.cast("char *", self._buf)
        self._view = memoryview(mm)
        self.layout = layout
        self._cl = self._c_layout(layout)
        self._ctx = lib.old_ctx_new(self._base, self._cl)
        self._slot_size = layout.slot_size

    def _c_layout(self, layout: Layout):
        c = self._ffi.new("ucm_layout *")
        for f in layout.__dataclass_fields__:
            setattr(c, f, getattr(layout, f))
        return c

    @classmethod
    def create(cls, mod, uuid: str, *, slots_per_rank: int, slot_size: int,
               max_ranks: int) -> "OldCache":
        layout = Layout.compute(max_ranks=max_ranks, slots_per_rank=slots_per_rank,
                                slot_size=slot_size)
        ffi, lib = mod.ffi, mod.lib
        cl = ffi.new("ucm_layout *")
        for f in layout.__dataclass_fields__:
            setattr(cl, f, getattr(layout, f))
        size = layout.total_size + lib.old_extra_size(cl)
        fd = os.open(_path(uuid), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, size)
            os.posix_fallocate(fd, 0, size)
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            hdr = np.frombuffer(mm, dtype=np.uint64, count=8)
            # Same header words as ucmcache's (params), so attach finds the layout.
            hdr[4] = slots_per_rank   # UCM_H_SLOTS_PER_RANK = 32
            hdr[5] = slot_size        # UCM_H_SLOT_SIZE = 40
            hdr[3] = max_ranks        # word 3 (24): max_ranks (u32) | n_stripes (u32) unused here
            del hdr
            self = cls(mod, fd, mm, layout, uuid)
            r = lib.old_init(self._base, self._cl)
            if r != 0:
                raise OldError(f"old_init failed ({r})")
            return self
        except BaseException:
            os.close(fd)
            try:
                os.unlink(_path(uuid))
            except OSError:
                pass
            raise

    @classmethod
    def attach(cls, mod, uuid: str) -> "OldCache":
        fd = os.open(_path(uuid), os.O_RDWR)
        try:
            size = os.fstat(fd).st_size
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            hdr = np.frombuffer(mm, dtype=np.uint64, count=8)
            spr, ss, mr = int(hdr[4]), int(hdr[5]), int(hdr[3] & 0xFFFFFFFF)
            del hdr
            layout = Layout.compute(max_ranks=mr, slots_per_rank=spr, slot_size=ss)
            return cls(mod, fd, mm, layout, uuid)
        except BaseException:
            os.close(fd)
            raise

    @staticmethod
    def unlink(uuid: str) -> None:
        try:
            os.unlink(_path(uuid))
        except FileNotFoundError:
            pass

    def close(self) -> None:
        if self._mm is None:
            return
        self._lib.old_ctx_free(self._ctx)
        self._view.release()
        self._ffi.release(self._buf)
        self._mm.close()
        os.close(self._fd)
        self._mm = None

    # ---------------------------------------------------------------- the API

    def get(self, key) -> "OldHandle":
        if type(key) is bytes and len(key) == 16:
            block_id, offset = key, 0
        else:
            block_id, offset = split_key(key)
        r = self._lib.old_get(self._ctx, block_id, offset)
        if r < 0:
            raise OldError(f"old design: no slot ({-r})")
        return OldHandle(self, r & 0xFFFFFFFF, bool(r & OWNER_FLAG))

    def get_or_load(self, key, loader, timeout: Optional[float] = None) -> bytes:
        """What a user of the old design writes for ucmcache's get_or_load (it had none): get;
        the owner runs the loader, copies its bytes into the slot and publishes them (a loader
        that raises publishes Failed); a joiner waits; a reader copies the value out as
        bytes."""
        with self.get(key) as h:
            if h.owner:
                try:
                    value = loader()
                except BaseException:
                    h.fail()
                    raise
                n = len(value)
                h.data[:n] = value
                h.ready(n)
                return value
            if h.state == "loading":
                h.wait(timeout)
            return bytes(h.data[:h.length])

    def exist(self, keys: Sequence) -> List[bool]:
        ids, offsets, split = pack_keys(keys)
        out = np.zeros(len(split), dtype=np.uint8)
        if len(split):
            ffi = self._ffi
            self._lib.old_exist_many(self._ctx, ids, ffi.from_buffer("uint64_t[]", offsets),
                                     len(split), ffi.from_buffer("uint8_t[]", out))
        return out.astype(bool).tolist()

    def get_many(self, keys: Sequence) -> "OldBatch":
        ids, offsets, split = pack_keys(keys)
        n = len(split)
        slots = np.empty(n, dtype=np.uint32)
        states = np.empty(n, dtype=np.uint8)
        owner = np.empty(n, dtype=np.uint8)
        codes = np.empty(n, dtype=np.uint8)
        if n:
            ffi = self._ffi
            r = self._lib.old_get_many(self._ctx, ids, ffi.from_buffer("uint64_t[]", offsets), n,
                                       ffi.from_buffer("uint32_t[]", slots),
                                       ffi.from_buffer("uint8_t[]", states),
                                       ffi.from_buffer("uint8_t[]", owner),
                                       ffi.from_buffer("uint8_t[]", codes))
            if r != 0:
                self._lib.old_release_many(self._ctx, ffi.from_buffer("uint32_t[]", slots), n)
                raise OldError(f"old design: get_many found no slot ({r})")
        return OldBatch(self, slots, owner.astype(bool))

    def _data_off(self, slot: int) -> int:
        return self.layout.data_off + slot * self.layout.slot_stride


class OldHandle:
    __slots__ = ("_c", "_slot", "owner", "_closed", "_views")

    def __init__(self, cache: OldCache, slot: int, owner: bool):
        self._c = cache
        self._slot = slot
        self.owner = owner
        self._closed = False
        self._views = None

    @property
    def state(self) -> str:
        st = self._c._lib.old_slot_state(self._c._ctx, self._slot)
        return {UCM_LOADING: "loading", UCM_READY: "ready"}.get(st, "failed")

    @property
    def data(self) -> memoryview:
        c = self._c
        off = c._data_off(self._slot)
        mv = c._view[off:off + c._slot_size]
        if self._views is None:
            self._views = []
        self._views.append(mv)
        return mv

    @property
    def length(self) -> int:
        """The published value's length (the SlotMeta word old_publish wrote, read once the
        state said Ready: the node lock's release ordered it before)."""
        c = self._c
        off = c.layout.meta_off + self._slot * SLOT_META.itemsize + LENGTH_OFF
        return int.from_bytes(c._view[off:off + 4], "little")

    def ready(self, nbytes: Optional[int] = None) -> None:
        c = self._c
        c._lib.old_publish(c._ctx, self._slot, UCM_READY, c._slot_size if nbytes is None else nbytes)

    def fail(self, message: str = "") -> None:
        c = self._c
        c._lib.old_publish(c._ctx, self._slot, UCM_FAILED, 0)

    def wait(self, timeout: Optional[float] = None) -> "OldHandle":
        c = self._c
        st = c._ffi.new("uint32_t *")
        ns = -1 if timeout is None else int(timeout * 1e9)
        if c._lib.old_wait_ready(c._ctx, self._slot, ns, st) != 0:
            raise TimeoutError("old design: still loading")
        if st[0] != UCM_READY:
            raise OldError("old design: load failed")
        return self

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._views:
            for mv in self._views:
                mv.release()
        c = self._c
        if self.owner and c._lib.old_slot_state(c._ctx, self._slot) == UCM_LOADING:
            c._lib.old_publish(c._ctx, self._slot, UCM_FAILED, 0)
        c._lib.old_release(c._ctx, self._slot)

    def __enter__(self) -> "OldHandle":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class OldBatch:
    def __init__(self, cache: OldCache, slots: np.ndarray, owner: np.ndarray):
        self._c = cache
        self._slots = slots
        self.owner = owner
        self._closed = False

    def __len__(self) -> int:
        return len(self._slots)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        c = self._c
        if self.owner.any():
            for s in self._slots[self.owner]:
                if c._lib.old_slot_state(c._ctx, int(s)) == UCM_LOADING:
                    c._lib.old_publish(c._ctx, int(s), UCM_FAILED, 0)
        c._lib.old_release_many(c._ctx, c._ffi.from_buffer("uint32_t[]", self._slots),
                                len(self._slots))

    def __enter__(self) -> "OldBatch":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
