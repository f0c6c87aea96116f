"""UcmCacheStore's task bodies (``ucmcache.ucm``): a load or dump task's plan (its keys and
pieces) and the work it does on one of the store's pool threads.  A load copies only entries
that are Ready; a dump fills each owned slot and publishes it after its last copy, waits for a
block another worker is dumping, and takes over one whose dump failed.
"""
from __future__ import annotations

from typing import Callable, Dict, Optional

import numpy as np

from ._core import ffi
from ._errors import CacheFull, LoadFailed, UcmError
from ._ucm_memory import _copy_in, _copy_out, _key, _torch

DUMP_CHUNK = 32                 # blocks pinned (and owned) at once by one dump step
STAGING_BYTES = 4 << 20         # a scattered load's staging buffer per pool thread, at most
                                # (one slot at least): kept, and small enough to stay in cache
JOIN_ROUNDS = 3                 # a block another dump failed is taken over at most this often


class _Plan:
    """A task's blocks: keys and, for each block, its pieces (tensors) in order."""

    __slots__ = ("ids", "shards", "keys", "pieces", "totals", "keep", "any_device")

    def __init__(self, ids, shards, pieces, keep):
        self.ids = ids
        self.shards = shards
        self.keys = [_key(b, s) for b, s in zip(ids, shards)]
        self.pieces = pieces
        self.totals = [sum(p.nbytes for p in row) for row in pieces]
        self.keep = keep
        self.any_device = any(p.device is not None for row in pieces for p in row)

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


class TaskBodies:
    """UcmCacheStore's task bodies.  A mixin: it uses the store's _cache, _cfg, _local (each
    pool thread's staging buffer), _cuda and _test_points, and adds no state of its own."""

    def _guard(self, run, plan: _Plan) -> Dict[int, str]:
        # failures[i]: None once block i is done, else why it failed; a block never reached
        # when something unexpected is raised fails with that exception.
        failures: Dict[int, Optional[str]] = {}
        try:
            run(plan, failures)
        except BaseException as e:  # anything unexpected fails the blocks not finished
            for i in range(len(plan.keys)):
                failures.setdefault(i, f"{type(e).__name__}: {e}")
        finally:
            plan.keep = None
        return {i: failures[i] for i in failures if failures[i] is not None}

    def _point(self, name: str, i: int) -> None:
        fn = self._test_points.get(name)
        if fn is not None:
            fn(i)

    def _run_load(self, plan: _Plan, failures: Dict[int, str]) -> None:
        cache = self._cache
        n = len(plan.keys)
        base = plan.contiguous_base()
        if base is not None:
            row = plan.totals[0]
            out = ffi.buffer(ffi.cast("char *", base), n * row)
            try:
                lens = cache.read_many(plan.keys, out)  # one C call for the whole task
            except ValueError:
                lens = None  # a stored shard is larger than a row: sort it out via staging
            if lens is not None:
                for i in range(n):
                    self._check_len(i, int(lens[i]), row, failures)
                return
        self._load_staged(plan, failures)

    @staticmethod
    def _check_len(i: int, got: int, want: int, failures: Dict[int, str]) -> bool:
        if got == want:
            failures[i] = None  # done
            return True
        if got < 0:
            failures[i] = "missing (not stored, evicted, or still being dumped)"
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

    def _load_staged(self, plan: _Plan, failures: Dict[int, str]) -> None:
        cache = self._cache
        row = cache.slot_size
        per = max(1, STAGING_BYTES // row)
        n = len(plan.keys)
        k_max = min(per, n)
        stage_addr, keep = self._staging(k_max * row, plan.any_device and self._cuda)
        for start in range(0, n, per):
            stop = min(n, start + per)
            k = stop - start
            out = ffi.buffer(ffi.cast("char *", stage_addr), k * row)
            lens = cache.read_many(plan.keys[start:stop], out)  # one C call per chunk
            for r in range(k):
                i = start + r
                if not self._check_len(i, int(lens[r]), plan.totals[i], failures):
                    continue
                at = stage_addr + r * row
                for p in plan.pieces[i]:
                    _copy_out(p, at)
                    at += p.nbytes
            del out
        del keep

    def _run_dump(self, plan: _Plan, failures: Dict[int, str]) -> None:
        cache = self._cache
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
                            self._fill(i, plan, lambda pos=pos: batch.data(pos),
                                       lambda nb, pos=pos: batch.ready(pos, nb),
                                       lambda msg, pos=pos: batch.fail(pos, msg), failures)
                        elif states[pos] == "ready":
                            failures[i] = None  # stored already: skipped
                        else:
                            joined.append(i)  # another dump has it (or our own duplicate)
            for i in joined:
                self._dump_one(i, plan, failures)

    def _dump_one(self, i: int, plan: _Plan, failures: Dict[int, str]) -> None:
        """A block another caller was dumping: wait for it; if that dump failed (or its worker
        died), take it over.  Bounded by the timeout and JOIN_ROUNDS."""
        cache = self._cache
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
              failures: Dict[int, str]) -> None:
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
            failures[i] = f"dump failed: {type(e).__name__}: {e}"
            try:
                fail(failures[i])
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
