"""Batches, copying reads, exist, touch (DESIGN 4.7): the calls that take many keys at once,
each in one C call.  Mixed into SlotCache (``_cache``): ``get_many`` pins every key into a
HandleBatch (misses through the cache's slow path: every miss's step in one C call,
_pin_slow_many, a policy answer in Python); ``read_many`` copies Ready
payloads out with no handle; ``exist``/``exist_prefix`` and ``touch`` take no pin at all.
"""
from __future__ import annotations

import functools
import time
from typing import TYPE_CHECKING, Any, Iterable, List, Optional, Sequence, Tuple

import numpy as np

from .._core import ffi, lib
from .errors import CorruptSegment
from .buffers import check_rows, rows_of
from .handle import _NO_OWNED, HandleBatch
from .keys import Key, pack_keys
from .slots import (ABANDONED, ABANDONED_LEN, FAST_SPIN, check_timeout,
                     owns_loads_besides)


def _ptr(ctype: str, arr: np.ndarray):
    return ffi.from_buffer(ctype, arr)


_SHORT = 4  # exist/exist_prefix of at most this many plain ids: one C call per key, no arrays


def _plain_ids(keys: list) -> bool:
    for k in keys:
        if type(k) is not bytes or len(k) != 16:
            return False
    return True




if TYPE_CHECKING:
    from .cache_core import CacheCore
else:
    CacheCore = object  # the seam is for the type checker only


class Batches(CacheCore):
    """SlotCache's calls over many keys.  A mixin: it uses the cache's _pin_slow_many, _tier and
    attributes (_ctx, _keep, _open_handles), and adds no state of its own."""

    # get_many(keys, *, timeout=None) -> HandleBatch is CacheBase's (csrc/ucm_hit.c): a list of
    # plain ids all Ready in C, anything else here.

    def _get_many_full(self, keys: Sequence[Key], *,
                       timeout: Optional[float] = None) -> HandleBatch:
        """get_many() for everything but an all-hit list of plain ids (see CacheBase)."""
        ctx = self._ctx
        if ctx is None:
            self._check_usable()
        timeout = check_timeout(timeout)  # inf: None (no deadline)
        t0 = time.monotonic() if timeout is not None else 0.0  # the tier gets what is left
        ids, offsets, split = pack_keys(keys)
        n = len(split)
        slots = np.full(n, lib.UCM_NIL, dtype=np.uint32)
        owner = np.zeros(n, dtype=bool)
        states = np.empty(n, dtype=np.uint8)
        codes = np.zeros(n, dtype=np.uint8)
        lens = np.empty(n, dtype=np.int64)
        serials = np.zeros(n, dtype=np.uint32)  # an owned position's load serial (I4)
        slots_p = ffi.from_buffer("uint32_t[]", slots)
        owner_p = ffi.from_buffer("uint8_t[]", owner)
        # The batch's token covers its arrays from before the first pin: every C step pins
        # straight into them, so whatever is raised where (a signal handler, CacheFull), the
        # token's drop (explicit below, or from C when collected) releases every pin and fails
        # every owned load.
        token = ffi.gc(ffi.new("ucm_token *"),
                       functools.partial(lib.ucm_batch_token_release, self._keep, slots_p,
                                         owner_p))
        batch = HandleBatch.__new__(HandleBatch)
        batch._closed = True
        arrays = (_ptr("uint64_t[]", offsets), _ptr("uint8_t[]", states),
                  _ptr("uint8_t[]", codes), _ptr("int64_t[]", lens))
        ctx = self._ctx  # again, after every allocation: a finalizer may have closed the cache
        if ctx is None:
            self._check_usable()
        lib.ucm_batch_token_arm(ctx, token, n)
        try:
            if n:
                lib.ucm_lookup_pin_many(ctx, ids, arrays[0], n, FAST_SPIN, slots_p, *arrays[1:])
            missed = n > 0 and bool(codes.any())
            if missed:  # the slow steps, into the arrays the token covers (serials: I4)
                self._pin_slow_many(ids, arrays[0], codes, split, timeout, slots, owner, lens,
                                    serials, slots_p, owner_p)
            any_owner = missed and bool(owner.any())
            batch._cache = self
            batch._slots = slots
            batch._owner = owner
            batch._serials = serials
            batch._slots_p = slots_p
            batch._owner_p = owner_p
            batch._token = token
            batch._lens = lens
            batch._n = n  # (after _slots and _lens: the positions they hold)
            batch._timeout = timeout
            batch._owner_views = {}
            batch._views = None
            batch._any_owner = any_owner
            batch._owned = _NO_OWNED
            self._open_handles += 1
            batch._closed = False
            if any_owner:
                batch.own()
                if self._tier is not None:  # the batch owns the pins: a raise here closes it
                    self._ask_tier_many(batch, split, timeout if timeout is None else
                                        max(0.0, timeout - (time.monotonic() - t0)))
        except BaseException as e:
            if batch._closed:  # the token still holds every pin: drop them, failing owned loads
                message, length = ABANDONED, ABANDONED_LEN
                try:
                    message = (f"the batch loading this key gave up: {type(e).__name__}: "
                               f"{e}").encode("utf-8", "replace")
                    length = len(message)
                finally:
                    lib.ucm_batch_token_drop(slots_p, owner_p, token, message, length)
            else:
                batch._close(ABANDONED)
            raise
        return batch

    def _ask_tier_many(self, batch: HandleBatch, split: Sequence[Tuple[bytes, int]],
                       timeout: Optional[float]) -> None:
        """get_many(): the owned positions ask the tier together; those it serves are
        published and no longer owned."""
        idx = np.flatnonzero(batch._owner).tolist()
        slots = [int(batch._slots[i]) for i in idx]
        may_wait = not owns_loads_besides(self, set(slots))
        assert self._tier is not None   # asked only under a tier (get_many's caller checks)
        payloads = self._tier.lookup([(s, *split[i]) for s, i in zip(slots, idx)], may_wait,
                                     timeout)
        for i, p in zip(idx, payloads):
            if p is not None:
                batch._served(i, p)

    # read_many(keys, out) -> numpy.ndarray is CacheBase's (csrc/ucm_hit.c): a list of plain
    # ids into a buffer in C, anything else here.

    def _read_many_full(self, keys: Sequence[Key], out: Any) -> np.ndarray:
        """read_many() for other key forms and destinations (see CacheBase.read_many)."""
        ctx = self._ctx
        if ctx is None:
            self._check_usable()
        ids, offsets, split = pack_keys(keys)
        n = len(split)
        lens = np.empty(n, dtype=np.int64)
        if n:
            ptr, row, keep = rows_of(out, n)
            offsets_p, lens_p = _ptr("uint64_t[]", offsets), _ptr("int64_t[]", lens)
            ctx = self._ctx  # again, after every allocation (a finalizer may have closed it)
            if ctx is None:
                self._check_usable()
            r = lib.ucm_read_many(ctx, ids, offsets_p, n, ptr, row, lens_p)
            if r == lib.UCM_BUSY:
                # A key's slot stayed claimed (the read counted nothing).  A dead rank's
                # unchecked claim on a Ready entry (crash window `claim_unchecked`) stays until
                # a recovery: run it if that needs no wait (I5), and read again; a live
                # claimant's ends by itself, and this read's answer stands.
                if self._claimant_dead(ids, offsets_p, n) and self._recover(0.0).count:
                    r = lib.ucm_read_many(self._ctx_now(), ids, offsets_p, n, ptr, row, lens_p)
                if r == lib.UCM_BUSY:  # the answer we settle on, counted once
                    lib.ucm_read_count(self._ctx_now(), lens_p, n)
            del keep
            self._read_checked(r, lens, row)
        return lens

    def _read_checked(self, code: int, lens: np.ndarray, row: int) -> None:
        """A copying read's outcome: a corrupt chain, or a payload longer than out's rows."""
        if code == lib.UCM_CORRUPT:
            raise CorruptSegment(f"segment {self.uuid!r}: a chain points outside the slot "
                                 "table")
        check_rows(lens, row)

    def _ctx_now(self):
        """The context, read after the caller's last allocation (a collection it starts may run
        a finalizer that closes this cache): NotAttached if it is gone."""
        ctx = self._ctx
        if ctx is None:
            self._check_usable()
        return ctx

    def exist(self, keys: Iterable[Key]) -> List[bool]:
        """For each key, whether a Ready entry is there now (no pin, one C call)."""
        if self._ctx is None:
            self._check_usable()
        if type(keys) is list and len(keys) <= _SHORT and _plain_ids(keys):
            found = [False] * len(keys)  # no arrays for a handful
            ctx = self._ctx_now()
            for i, k in enumerate(keys):
                found[i] = lib.ucm_exist1(ctx, k, 0) == 1
            return found
        ids, offsets, split = pack_keys(keys)
        out = np.zeros(len(split), dtype=np.uint8)
        if len(split):
            offsets_p, out_p = _ptr("uint64_t[]", offsets), _ptr("uint8_t[]", out)
            lib.ucm_exist_many(self._ctx_now(), ids, offsets_p, len(split), out_p)
        return out.astype(bool).tolist()

    def exist_prefix(self, keys: Sequence[Key]) -> int:
        """How many leading keys (a chained-hash prefix) are Ready, in one C call."""
        if self._ctx is None:
            self._check_usable()
        if type(keys) is list and len(keys) <= _SHORT and _plain_ids(keys) and \
                self._tier is None:
            ctx = self._ctx_now()
            n = 0
            for k in keys:
                if lib.ucm_exist1(ctx, k, 0) != 1:
                    break
                n += 1
            return n
        ids, offsets, split = pack_keys(keys)
        if not split:
            return 0
        offsets_p = _ptr("uint64_t[]", offsets)
        n = lib.ucm_exist_prefix(self._ctx_now(), ids, offsets_p, len(split))
        if self._tier is not None and n < len(split):
            n += self._tier.exist_prefix(split[n:])  # the rest, from tier 2: one round trip
        return n

    def touch(self, keys: Iterable[Key]) -> None:
        """Mark entries recently used (CLOCK's bit) without pinning; best effort."""
        if self._ctx is None:
            self._check_usable()
        ids, offsets, split = pack_keys(keys)
        if split:
            offsets_p = _ptr("uint64_t[]", offsets)
            lib.ucm_touch_many(self._ctx_now(), ids, offsets_p, len(split))
