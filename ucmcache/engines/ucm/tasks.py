"""UcmCacheStore's task bodies (``ucmcache.ucm``): a load or dump task's plan (its keys and
pieces) and the work it does on one of the store's pool threads.  A load copies only entries
that are Ready and of the destination's size, and never writes a byte of a block it refuses; a
dump waits for its prerequisite device event, fills each owned slot and publishes it after its
last copy, waits for a block another worker is dumping, takes over one whose dump failed, and
marks the blocks whose every shard is now stored complete.
"""
from __future__ import annotations

import functools
import threading
from typing import TYPE_CHECKING, Callable, Dict, List, Optional, Set, Tuple

import numpy as np

from ..._core import ffi
from ...core.errors import CacheFull, LoadFailed, UcmError
from . import memory as _ucm_memory
from .memory import _complete_mark, _copy_in, _copy_out, _key, _memcpy, _torch

DUMP_CHUNK = 32                 # blocks pinned (and owned) at once by one dump step
STAGING_BYTES = 4 << 20         # a load's staging buffer per pool thread, at most (one row at
                                # least): kept, and small enough to stay in cache
JOIN_ROUNDS = 3                 # a block another dump failed is taken over at most this often

# A failure message of a block that is not there for this load (missing, or stored with
# another size): wait() raises the "not found" error for these (UCM's StoreNotFoundError).
MISSING = "missing (not stored, evicted, or still being dumped)"


class _Plan:
    """A task's blocks: keys and, for each block, its pieces (tensors) in order; and the
    worker's cache they are loaded from or dumped to."""

    __slots__ = ("cache", "ids", "shards", "n_shards", "keys", "pieces", "totals", "keep", "any_device",
                 "event", "not_found")

    def __init__(self, cache: SlotCache, ids, shards, pieces, keep, n_shards: int = 1,
                 event: int = 0):
        self.cache = cache
        self.ids = ids
        self.shards = shards
        self.n_shards = n_shards
        self.keys = [_key(b, s, n_shards) for b, s in zip(ids, shards)]
        self.pieces = pieces
        self.totals = [sum(p.nbytes for p in row) for row in pieces]
        self.keep = keep
        self.any_device = any(p.device is not None for row in pieces for p in row)
        self.event = event              # a device event to wait for before copying (dumps)
        self.not_found: Set[int] = set()  # blocks that failed as not there (loads)

    def contiguous_base(self) -> Optional[int]:
        """The start of the destination when every piece of every block lies in one run of
        equal rows (block i at base + i * row), else None."""
        if self.any_device or not self.pieces:
            return None
        row = self.totals[0]
        sizes0 = [p.nbytes for p in self.pieces[0]]
        base = self.pieces[0][0].addr
        for i, pieces in enumerate(self.pieces):
            at = base + i * row
            if len(pieces) != len(sizes0):
                return None
            for p, n in zip(pieces, sizes0):
                if p.addr != at or p.nbytes != n:
                    return None
                at += n
        return base


if TYPE_CHECKING:
    from ...core.cache import SlotCache
    from .config import _Config

# A task's outcome by block: None once block i is done, else why it failed.
Failures = Dict[int, Optional[str]]


class TaskBodies:
    """UcmCacheStore's task bodies.  A mixin: it uses the store's _cfg, _local (each pool
    thread's staging buffer), _cuda and _test_points, and adds no state of its own; the cache
    is the plan's (a worker's, set before its pool takes any task)."""

    if TYPE_CHECKING:   # the store's (UcmCacheStore.__init__)
        _cfg: _Config
        _local: threading.local
        _cuda: bool
        _test_points: Dict[str, Callable[[int], None]]

    def _guard(self, run, plan: _Plan) -> Tuple[Dict[int, str], Set[int]]:
        # failures[i]: None once block i is done, else why it failed; a block never reached
        # when something unexpected is raised fails with that exception.
        failures: Failures = {}
        try:
            run(plan, failures)
        except BaseException as e:  # anything unexpected fails the blocks not finished
            for i in range(len(plan.keys)):
                failures.setdefault(i, f"{type(e).__name__}: {e}")
        finally:
            plan.keep = None
        failed = {i: why for i, why in failures.items() if why is not None}
        return failed, plan.not_found & set(failed)

    def _point(self, name: str, i: int) -> None:
        fn = self._test_points.get(name)
        if fn is not None:
            fn(i)

    # ---------------------------------------------------------------- loads

    def _run_load(self, plan: _Plan, failures: Failures) -> None:
        """Copy each Ready shard of the destination's size into its tensors; never write a
        byte of a block it refuses.  read_many cannot be asked for that: it copies a payload
        shorter than its row into the row and reports the length after, so read straight
        into the caller's tensors it would already have written a shard stored with fewer
        bytes.  So: into one contiguous destination, under pins (_load_pinned: lengths read
        first, one copy); into scattered tensors (or when pins cannot be had), through a
        staging buffer (_load_staged: a copy more)."""
        n = len(plan.keys)
        if not n:
            return
        base = plan.contiguous_base()
        rest = list(range(n))
        if base is not None:
            rest = self._load_pinned(plan, base, failures)
        if rest:
            self._load_staged(plan, rest, failures)
        if plan.n_shards > 1:
            # The blocks' complete marks are used with their shards: keep CLOCK from taking
            # the marks of blocks in use first (nothing else touches them: lookups take no
            # pin and set no bit).
            done = [plan.ids[i] for i in range(n) if failures.get(i, "") is None]
            if done:
                plan.cache.touch(list(dict.fromkeys(done)))

    def _load_pinned(self, plan: _Plan, base: int, failures: Failures) -> List[int]:
        """A contiguous destination (block i at base + i * row): the stored blocks (one exist
        call) pinned a chunk at a time with get_many, their lengths checked under the pins,
        then copied with one gather call when the whole chunk is good and consecutive, else a
        memcpy per good block.  A block that went between the exist and the get_many (evicted:
        get_many made us its loader) is failed at once, as missing: the one case where a load
        installs an entry, for an instant.  Returns the blocks left for the staged path (a
        chunk that met CacheFull)."""
        cache = plan.cache
        row = plan.totals[0]
        left: List[int] = []
        stored = cache.exist(plan.keys)
        idx = []
        for i, there in enumerate(stored):
            if there:
                idx.append(i)
            else:
                self._check_len(i, -1, plan, failures)
        self._point("after_exist", len(idx))
        for start in range(0, len(idx), DUMP_CHUNK):
            chunk = idx[start:start + DUMP_CHUNK]
            try:
                batch = cache.get_many([plan.keys[i] for i in chunk], timeout=self._cfg.timeout)
            except CacheFull:
                left.extend(chunk)  # no room even for the instant's entry: staged, no pins
                continue
            with batch:
                owner = batch.owner
                states = batch.state
                good: List[Tuple[int, int]] = []  # (position, block)
                for pos, i in enumerate(chunk):
                    if owner[pos]:
                        batch.fail(pos, "not stored (a load does not make entries)")
                        self._check_len(i, -1, plan, failures)
                    elif states[pos] != "ready":
                        self._check_len(i, -1, plan, failures)  # being dumped: not yet
                    elif self._check_len(i, len(batch.data(pos)), plan, failures):
                        good.append((pos, i))
                if len(good) == len(chunk) and chunk[-1] - chunk[0] == len(chunk) - 1:
                    out = ffi.buffer(ffi.cast("char *", base + chunk[0] * row), len(chunk) * row)
                    batch.gather(out)  # one C call, the GIL released, lengths already checked
                    del out
                else:
                    for pos, i in good:
                        mv = batch.data(pos)
                        src = ffi.from_buffer(mv)
                        _memcpy(base + i * row, int(ffi.cast("uintptr_t", src)), row)
                        ffi.release(src)
                        del mv
        return left

    def _load_staged(self, plan: _Plan, which: List[int], failures: Failures) -> None:
        """Blocks `which` through this thread's staging buffer: one read_many C call per chunk,
        each block's length checked in staging, then one copy per tensor of the good ones (a
        refused block's tensors are never written)."""
        slot = plan.cache.slot_size
        totals = [plan.totals[i] for i in which]
        # Staging rows as long as the blocks when they are all alike, else slot-long rows.
        row = totals[0] if min(totals) == max(totals) and totals[0] > 0 else slot
        per = max(1, STAGING_BYTES // max(row, slot))
        stage_addr, keep = self._staging(min(per, len(which)) * max(row, slot),
                                         plan.any_device and self._cuda)
        for start in range(0, len(which), per):
            chunk = which[start:start + per]
            lens, at_row = self._read_chunk(plan.cache, [plan.keys[i] for i in chunk], stage_addr,
                                            row, slot)
            for r, i in enumerate(chunk):
                if self._check_len(i, int(lens[r]), plan, failures):
                    at = stage_addr + r * at_row
                    for p in plan.pieces[i]:
                        _copy_out(p, at)
                        at += p.nbytes
        del keep

    def _read_chunk(self, cache: SlotCache, keys, stage_addr: int, row: int,
                    slot: int) -> Tuple[np.ndarray, int]:
        """read_many of keys into staging rows of `row` bytes: (lengths, row).  A payload
        longer than a short row is a ValueError with nothing copied: read the chunk again into
        slot-long rows, where every payload fits, to learn each one's length."""
        k = len(keys)
        out = ffi.buffer(ffi.cast("char *", stage_addr), k * row)
        try:
            return cache.read_many(keys, out), row  # one C call, GIL released
        except ValueError:
            if row >= slot:
                raise
        out = ffi.buffer(ffi.cast("char *", stage_addr), k * slot)
        return cache.read_many(keys, out), slot

    @staticmethod
    def _check_len(i: int, got: int, plan: _Plan, failures: Failures) -> bool:
        want = plan.totals[i]
        if got == want:
            failures[i] = None  # done
            return True
        plan.not_found.add(i)
        if got < 0:
            failures[i] = MISSING
        else:
            failures[i] = (f"stored with {got} bytes, the destination tensors hold {want} "
                           "(another layout?)")
        return False

    def _staging(self, nbytes: int, pinned: bool):
        """This pool thread's staging buffer (kept: a fresh one would page-fault every task):
        (address, owner object)."""
        local = self._local
        have = getattr(local, "stage", None)
        if have is None or have[2] < nbytes or have[3] != pinned:
            if pinned:  # for device copies (untested here)
                t = _torch().empty(nbytes, dtype=_torch().uint8, pin_memory=True)
                have = (int(t.data_ptr()), t, nbytes, True)
            else:
                a = np.empty(nbytes, dtype=np.uint8)
                have = (int(a.ctypes.data), a, nbytes, False)
            local.stage = have
        return have[0], have[1]

    # ---------------------------------------------------------------- dumps

    def _run_dump(self, plan: _Plan, failures: Failures) -> None:
        if plan.event:
            self._wait_prerequisite(plan.event)  # raises: every block fails, none copied
        cache = plan.cache
        n = len(plan.keys)
        for start in range(0, n, DUMP_CHUNK):
            chunk = list(range(start, min(n, start + DUMP_CHUNK)))
            try:
                batch = cache.get_many([plan.keys[i] for i in chunk], timeout=self._cfg.timeout)
            except CacheFull:
                joined = chunk  # not all at once: one by one, each may still find room
            else:
                joined = []
                with batch:
                    owner = batch.owner
                    states = batch.state
                    for pos, i in enumerate(chunk):
                        if owner[pos]:
                            self._fill(i, plan, functools.partial(batch.data, pos),
                                       functools.partial(batch.ready, pos),
                                       functools.partial(batch.fail, pos), failures)
                        elif states[pos] == "ready":
                            failures[i] = None  # stored already: skipped
                        else:
                            joined.append(i)  # another dump has it (or our own duplicate)
            for i in joined:
                self._dump_one(i, plan, failures)
        if plan.n_shards > 1:
            self._mark_complete(plan, failures)

    def _wait_prerequisite(self, handle: int) -> None:
        """Wait for the device event UCM's connector passes with a dump (prerequisite_handle:
        its compute stream's event after the layer's KV was written), before any copy.  On a
        store with CUDA: cudaEventSynchronize, on this pool thread (the caller never blocks).
        Without CUDA there is no device work to wait for: every source is host memory the
        engine wrote before calling (UCM's simulated stream ignores the event likewise)."""
        if self._cuda:
            _ucm_memory.wait_event(handle)

    def _mark_complete(self, plan: _Plan, failures: Failures) -> None:
        """Publish the complete mark of each block of this task whose every shard is stored
        now (ucm.py, "Blocks of several shards").  Whichever dump stores a block's last shard,
        in any process, finds all of them Ready here; a block still missing shards is left to
        the dump that brings them.  Looks at one shard of each candidate per round, starting
        after the task's own shard, so the usual in-order layer dumps stop after one look."""
        cache = plan.cache
        n = plan.n_shards
        todo: Dict[bytes, int] = {}
        for i, b in enumerate(plan.ids):
            if failures.get(i, "") is None:
                todo.setdefault(b, plan.shards[i])
        if not todo:
            return
        ids = list(todo)
        ids = [b for b, marked in zip(ids, cache.exist(ids)) if not marked]
        for step in range(1, n):
            if not ids:
                return
            found = cache.exist([_key(b, (todo[b] + step) % n, n) for b in ids])
            ids = [b for b, ok in zip(ids, found) if ok]
        if not ids:
            return
        payload = _complete_mark(n)
        try:
            batch = cache.get_many(ids, timeout=self._cfg.timeout)
        except UcmError:
            return  # CacheFull, LockTimeout: unmarked, the blocks stay misses (never wrong)
        with batch:
            for pos in np.flatnonzero(batch.owner).tolist():
                try:
                    view = batch.data(pos)
                    view[:len(payload)] = payload
                    del view
                    batch.ready(pos, len(payload))
                except UcmError:
                    pass  # taken by a recovery meanwhile: unmarked, a miss
            # Not owned: Ready (marked already) or Loading (another dump is marking it).

    def _dump_one(self, i: int, plan: _Plan, failures: Failures) -> None:
        """A block another caller was dumping: wait for it; if that dump failed (or its worker
        died), take it over.  Bounded by the timeout and JOIN_ROUNDS."""
        cache = plan.cache
        timeout = self._cfg.timeout
        self._point("joined", i)
        for _ in range(JOIN_ROUNDS):
            try:
                h = cache.get(plan.keys[i], timeout=timeout)
            except UcmError as e:  # CacheFull, LockTimeout: this block only
                failures[i] = f"{type(e).__name__}: {e}"
                return
            with h:
                if h.owner:
                    self._fill(i, plan, lambda: h.data, h.ready, h.fail, failures)
                    return
                try:
                    h.wait(timeout)
                    failures[i] = None  # stored by the other dump
                    return
                except LoadFailed:
                    continue  # that dump failed: the next get makes us the owner
                except TimeoutError:
                    failures[i] = (f"another worker's dump of this block did not finish within "
                                   f"{timeout} s")
                    return
        failures[i] = f"every dump of this block failed ({JOIN_ROUNDS} tries)"

    def _fill(self, i: int, plan: _Plan, view: Callable[[], memoryview],
              ready: Callable[[int], None], fail: Callable[[str], None],
              failures: Failures) -> None:
        """Copy block i's pieces into its owned slot, then publish it Ready; Failed if
        anything goes wrong before that, so nobody waits on it."""
        try:
            mv = view()
            p = ffi.from_buffer(mv)
            slot = int(ffi.cast("uintptr_t", p))
            ffi.release(p)  # the address stays valid: the slot is pinned (ours) until we publish
            del mv
            at = slot
            for piece in plan.pieces[i]:
                _copy_in(at, piece)
                at += piece.nbytes
            self._point("after_copy", i)
        except BaseException as e:
            why = f"dump failed: {type(e).__name__}: {e}"
            failures[i] = why
            try:
                fail(why)
            except UcmError:
                pass
            if not isinstance(e, Exception):
                raise
            return
        try:
            ready(plan.totals[i])
        except UcmError as e:  # no longer ours (a recovery took it): never published by us
            failures[i] = f"dump not published: {e}"
            return
        failures[i] = None
        self._point("after_publish", i)

