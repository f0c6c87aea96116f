"""SlotCache: the public object.  This module drives the slot protocol (DESIGN 4).

Read (get): one C call does the optimistic step (walk, MatchKey, pin, revalidate: I3) with no
lock.  Anything but a pinned match goes to the slow path: take the bucket's stripe, look again
(a second pinned lookup, exact now that no writer can change the chain), and on a miss allocate:
CLOCK claim from our own range (I1), install (isolate with trylock only, rewrite while
unreachable, publish bucket-before-head, hand over as pinned: I2), all under the stripe.  The
stripe is released before any loader runs or any wait begins.

Allocation that finds nothing claimable first recovers dead ranks (their pins may be what fills
the cache), then tries once more, then raises CacheFull: never spins holding a stripe.
"""
from __future__ import annotations

import functools
import gc
import inspect
import itertools
import os
import threading
import time
import weakref
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import numpy as np

from . import _hooks
from ._arenas import LOCK_WAIT, Arenas
from ._core import ffi, lib
from ._errors import (CacheFull, CorruptSegment, IncompatibleSegment, LockTimeout,
                      NotAttached, SegmentExists, UcmError)
from ._buffers import check_rows, rows_of
from ._handle import Handle, HandleBatch, _Pins
from ._slots import ABANDONED, ABANDONED_LEN, as_value_view, check_timeout, isolate_owned
from ._keys import Key, pack_keys, split_key
from ._layout import DEFAULT_STRIPES, Layout
from ._locks import Stripes, describe_stripe_holder
from ._recovery import (RecoveryReport, free_rank, rank_alive, recover_dead_ranks, take_rank)
from ._results import code_name
from ._ring import Prefetcher, ring_counters
from ._tier import BoundTier, Tier, check_tier
from ._segment import Segment
from . import _stats

FAST_SPIN = 64          # yields on a claimed slot before the fast path gives up (the seed's 64)
SLOW_SPIN = 64          # under the stripe a live claimant of our chain rolls back at once; a
                        # claim that stays is a dead rank's, recovered without the stripe held
MAX_ROLLBACKS = 64      # isolate trylock failures tolerated in one allocation
MAX_ROLLBACK_ROUNDS = 8 # allocations retried when every one of them rolled back
MAX_GROWS = 8           # arenas one allocation may take when its rank's arenas are full
MAX_MOVED = 4           # looks at the arena shares in one allocation (ranks keep changing)
LIVENESS_SLICE = 0.5    # a waiter checks that the loader still lives this often (seconds)
CLAIM_WAIT = 10.0       # the longest a get waits for another process to recover a dead claim
CANCEL_SLICE = 0.02     # an async wait's thread looks at its cancel flag this often (seconds)
STRIPE_WAIT = 10.0      # the longest a get with no timeout waits for a bucket's stripe; held
                        # for microseconds normally, so past this its holder is stopped or stuck
MIN_LOCK_WAIT = 0.05    # a get's timeout below this still waits this long for a lock: a
                        # stripe or a claim held that long is not contention any more

_live_caches: "weakref.WeakSet[SlotCache]" = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for cache in list(_live_caches):
        cache._forget_after_fork()


os.register_at_fork(after_in_child=_after_fork_in_child)


def _ptr(ctype: str, arr: np.ndarray):
    return ffi.from_buffer(ctype, arr)


_SHORT = 4  # exist/exist_prefix of at most this many plain ids: one C call per key, no arrays


def _plain_ids(keys: list) -> bool:
    for k in keys:
        if type(k) is not bytes or len(k) != 16:
            return False
    return True


_new = object.__new__  # an inert handle: every field is stored by get()/get_many()
_next_ticket = itertools.count(1).__next__  # a unique ticket per single-key read (see get)
_PIN_SLOT_MASK = lib.UCM_PIN_SLOT_MASK  # a pin's answer, decoded with plain ints (see C)
_PIN_LEN_SHIFT = lib.UCM_PIN_LEN_SHIFT
_PIN_OWNER = lib.UCM_PIN_OWNER
_PIN_READY = lib.UCM_PIN_READY
_PIN_OWNER_OR_READY = _PIN_OWNER | _PIN_READY
class _NoOwned(frozenset):
    """An all-hit batch's owned set (HandleBatch.own replaces it): nothing to discard."""

    def discard(self, _slot) -> None:
        pass


_NO_OWNED = _NoOwned()


class SlotCache:
    """A shared-memory slot cache attached to one segment as one rank.

    Create a segment with ``SlotCache.create`` (the creator is attached too), attach to it from
    other processes with ``SlotCache.attach``, and remove it with ``SlotCache.unlink``.
    """

    def __init__(self, seg: Segment, rank: Optional[int], tier2: Optional[Tier] = None):
        check_tier(tier2)
        # None, or the tier beneath this cache, bound to it (see _tier: the calls it gets)
        self._tier: Optional[BoundTier] = \
            None if tier2 is None else tier2.bind(self._count, seg.layout.slot_size)
        self._seg = seg
        self._layout: Layout = seg.layout
        ctx = lib.ucm_ctx_new(seg.base, seg.layout.total_size, seg.layout.to_c())
        if ctx == ffi.NULL:
            raise MemoryError("could not allocate the process-local cache context")
        self._ctx = ctx
        self._stripes = Stripes(ctx, seg.base, seg.layout)  # for tests and tools only
        self._open_handles = 0
        self._prefetcher: Optional[Prefetcher] = None
        self._pid = os.getpid()
        self._why_unusable = ""
        self._data_off = seg.layout.data_off  # the hit path's view arithmetic, as plain ints
        self._stride = seg.layout.slot_stride
        self._ro = seg.ro_view  # readers' views are slices of it
        # Token destructors hold the Segment (so its mapping) until they have run: a handle
        # collected after its cache must not drop pins in an unmapped segment.
        self._keep = ffi.new_handle(seg)
        self._token_release = functools.partial(lib.ucm_token_release, self._keep)
        try:
            self._rank, _ = take_rank(seg, ctx, rank)  # a dead holder recovered: counted in C
        except BaseException:
            lib.ucm_ctx_free(ctx)
            self._ctx = None
            raise
        lib.ucm_ctx_set_rank(ctx, self._rank)
        self._arenas = Arenas(seg, ctx, self._rank)
        _live_caches.add(self)
        self.recover()

    # ---------------------------------------------------------------- lifecycle

    @classmethod
    def create(cls, uuid: str, *, slots_per_rank: int, slot_size: int, max_ranks: int = 8,
               n_buckets: Optional[int] = None, n_stripes: int = DEFAULT_STRIPES,
               mode: int = 0o600, exist_ok: bool = False, timeout: float = 10.0,
               tier2: Optional[Tier] = None) -> "SlotCache":
        """Create the segment ``uuid`` and attach to it.  With exist_ok, a segment that exists
        with the same params is attached instead (other params: IncompatibleSegment)."""
        check_tier(tier2)
        layout = Layout.compute(max_ranks=max_ranks, slots_per_rank=slots_per_rank,
                                slot_size=slot_size, n_buckets=n_buckets, n_stripes=n_stripes)
        try:
            seg = Segment.create(uuid, layout, mode=mode)
        except SegmentExists:
            if not exist_ok:
                raise
            seg = Segment.attach(uuid, timeout=timeout)
            _check_same_params(seg, layout)
        try:
            return cls(seg, None, tier2)
        except BaseException:
            seg.detach()
            raise

    @classmethod
    def attach(cls, uuid: str, *, rank: Optional[int] = None, timeout: float = 10.0,
               allow_other_user: bool = False, tier2: Optional[Tier] = None) -> "SlotCache":
        """Attach to an existing segment as ``rank`` (None: any free rank).  Waits up to
        ``timeout`` seconds for a segment that is still being created."""
        seg = Segment.attach(uuid, timeout=timeout, allow_other_user=allow_other_user)
        try:
            return cls(seg, rank, tier2)
        except BaseException:
            seg.detach()
            raise

    @staticmethod
    def unlink(uuid: str) -> None:
        """Remove the segment's name; processes still attached keep their mapping."""
        Segment.unlink(uuid)

    def close(self) -> None:
        """Detach: the rank is freed (its Ready entries stay for others), the mapping dropped."""
        if self._ctx is None:
            return  # closed already, or a forked child's copy (the parent's rank is not ours)
        if self._open_handles > 0 and self._live_handles() > 0:
            raise UcmError(f"cannot close: {self._open_handles} handle(s) or batch(es) are still "
                           "open; close them first")
        if self._prefetcher is not None:
            self._prefetcher.stop()  # its thread works on this mapping: it goes first
        if self._tier is not None:
            self._tier.close()  # write-throughs queued by this process go out first (bounded)
        ctx = self._ctx
        # Closed first: from here no pin drop or token through ctx touches the segment, before
        # the rank is freed for another process (free_rank's recovery removes our holds).
        lib.ucm_ctx_close(ctx)
        free_rank(self._seg, ctx, self._rank)
        self._ctx = None
        self._why_unusable = "closed"
        lib.ucm_ctx_free(ctx)
        _live_caches.discard(self)
        self._seg.detach()

    def __enter__(self) -> "SlotCache":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _live_handles(self) -> int:
        """Handles and batches of this cache that still exist and are open.  The counter can
        stay above it when a signal handler raised inside both a handle's __exit__ and its
        finalizer; such a handle is gone, and free_rank removes the pin it leaked."""
        n = 0
        for o in gc.get_referrers(self):
            if isinstance(o, _Pins):
                n += not getattr(o, "_closed", True)
            elif type(o) is dict and o.get("_cache") is self:  # a batch's materialized dict
                n += not o.get("_closed", True)
        self._open_handles = n
        return n

    def _forget_after_fork(self) -> None:
        if self._ctx is None:
            return
        lib.ucm_ctx_forget(self._ctx)  # tokens copied into the child must drop nothing
        self._ctx = None
        self._why_unusable = f"forked: attached by pid {self._pid}, this is pid {os.getpid()}"
        self._seg.forget_after_fork()

    def _check_usable(self) -> None:
        if self._ctx is None:
            if self._why_unusable.startswith("forked"):
                raise NotAttached(
                    f"this SlotCache belongs to the process that attached it ({self._why_unusable}); "
                    "call SlotCache.attach() in the child")
            raise NotAttached("this SlotCache is closed")

    # ---------------------------------------------------------------- facts

    @property
    def uuid(self) -> str:
        return self._seg.uuid

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def slot_size(self) -> int:
        return self._layout.slot_size

    @property
    def slots_per_rank(self) -> int:
        return self._layout.slots_per_rank

    @property
    def max_ranks(self) -> int:
        return self._layout.max_ranks

    @property
    def capacity(self) -> int:
        """Slots in the whole segment."""
        return self._layout.n_slots

    @property
    def layout(self) -> Layout:
        return self._layout

    @property
    def generation(self) -> int:
        self._check_usable()
        return lib.ucm_generation(self._ctx)

    # ---------------------------------------------------------------- read path

    def get(self, key: Key, *, timeout: Optional[float] = None) -> Handle:
        """Pin the slot for key.  A hit returns at once; a cold key makes this caller the owner
        (h.owner: fill h.data, then h.ready(n) or h.fail(msg)); a key another caller is loading
        returns a handle to wait() on.  ``timeout`` bounds this call's wait for a bucket lock
        and is the default for that wait."""
        ctx = self._ctx
        if ctx is None:
            self._check_usable()
        if timeout is not None:
            timeout = check_timeout(timeout)
        if type(key) is bytes and len(key) == 16:
            block_id, offset = key, 0
        else:
            block_id, offset = split_key(key)
        # No window without an owner object (a signal handler may raise at any call): the
        # handle exists, inert, before the pin, and so does the call's ticket; the pin becomes
        # the handle's in plain stores, with no call in between (CPython >= 3.10 runs signal
        # handlers only at calls, function entries and backward jumps).  Until then the C step
        # records the pin under the ticket and the except path drops it; a slow-path pin (maybe
        # an owner's) goes to a token instead, dropped there or, failing that, from C when the
        # token is collected.
        h = _new(Handle)
        h._closed = True
        token = None
        ticket = _next_ticket()
        try:
            r = lib.ucm_lookup_pin(ctx, block_id, offset, FAST_SPIN, 1, ticket)
            if r < 0:
                token = ffi.gc(ffi.new("ucm_token *"), self._token_release)
                r = self._pin_slow(block_id, offset, -r, timeout, token, ffi.NULL, ffi.NULL)
            # The pin's answer says what a reader needs (UCM_PIN_*): slot, and for a Ready
            # slot its length, so data needs no further C call.
            owner = (r & _PIN_OWNER_OR_READY) == _PIN_OWNER
            h._token = token
            h._cache = self
            h._slot = r & _PIN_SLOT_MASK
            h._nbytes = (r >> _PIN_LEN_SHIFT) & _PIN_SLOT_MASK if r & _PIN_READY else -1
            h._view = None
            h._owner = owner
            h._timeout = timeout
            h._views = None
            h._published = False
            h._owned = None
            self._open_handles += 1
            h._closed = False
            if owner:  # the handle holds the load now: cut short, closing it fails the load
                h.own()
                if self._tier is not None:  # the handle owns the pin: a raise here closes it
                    self._ask_tier(h, block_id, offset, timeout)
        except BaseException:
            if h._closed:
                if token is None:
                    lib.ucm_abandon_inflight(ctx, ticket)
                else:
                    lib.ucm_token_drop(token, ABANDONED, ABANDONED_LEN)
            else:
                h._close(ABANDONED)
            raise
        return h

    def _pin_slow(self, block_id: bytes, offset: int, code: int, timeout: Optional[float],
                  token, slot_out, owner_out) -> int:
        """The slow path for one key (one C step: lock, look again, allocate); returns the
        pin's answer (UCM_PIN_*), the pin also handed inside the step to its owner object: the
        token, or slot_out/owner_out (a batch's arrays, covered by the batch's token).  What to do when it cannot is decided here: a
        dead rank's pins may be what fills the cache, and a key's slot that stays claimed under
        its stripe has a dead claimant; both are recovered and the step is tried again.  Never
        CacheFull for a claim, never a spin with a stripe held, never a wait past the deadline
        (``timeout``, or STRIPE_WAIT for the stripe and CLAIM_WAIT for a dead claim)."""
        if code == lib.UCM_CORRUPT:
            raise CorruptSegment(f"segment {self.uuid!r}: a chain points outside the slot table")
        ctx = self._ctx
        recovered_once = False
        rollback_rounds = grown = moved = 0
        tried_recovery = looked_again = False
        start = time.monotonic()
        stripe_deadline = start + (STRIPE_WAIT if timeout is None else max(timeout, MIN_LOCK_WAIT))
        claim_deadline = start + (CLAIM_WAIT if timeout is None else max(timeout, MIN_LOCK_WAIT))
        delay = 0.0005
        while True:
            left = max(0.0, stripe_deadline - time.monotonic())
            r = lib.ucm_get_slow(ctx, block_id, offset, SLOW_SPIN, MAX_ROLLBACKS,
                                 max(1, int(left * 1e9)), token, slot_out, owner_out)
            if r >= 0:
                return r
            code = -r
            if code == lib.UCM_MOVED:  # ranks came or went: look at our share of arenas first
                moved += 1
                if moved <= MAX_MOVED:
                    self._arenas.rebalance(min(LOCK_WAIT, max(0.0, stripe_deadline - start)))
                elif time.monotonic() < stripe_deadline:  # they keep changing: allocate in
                    lib.ucm_arena_epoch_seen(ctx, lib.ucm_load64(  # what we have, look later
                        self._seg.base, lib.UCM_H_ARENA_EPOCH))
                else:
                    raise LockTimeout(f"segment {self.uuid!r}: ranks attached and closed faster "
                                      f"than this get could allocate, for {STRIPE_WAIT} s")
                continue
            if code == lib.UCM_TIMEOUT:
                stripe = lib.ucm_stripe_of(ctx, lib.ucm_bucket_of(ctx, block_id, offset))
                raise LockTimeout(
                    f"segment {self.uuid!r}: stripe {stripe} (this key's bucket lock) stayed held "
                    f"for {time.monotonic() - start:.1f} s by "
                    f"{describe_stripe_holder(self._seg, stripe)}; a stripe is held for "
                    "microseconds, so its holder is stopped, stuck, or the lock word is corrupt")
            if code == lib.UCM_BUSY:
                if self._recover(claim_deadline - time.monotonic()).count:
                    continue
                now = time.monotonic()
                if now > claim_deadline:
                    raise LockTimeout(f"segment {self.uuid!r}: the slot of this key stayed "
                                      f"claimed for {now - start:.2f} s by a rank that neither "
                                      "finished nor died")
                time.sleep(min(delay, claim_deadline - now))  # another process recovers it
                delay = min(delay * 2, 0.05)
                continue
            if code == lib.UCM_ROLLBACK and rollback_rounds < MAX_ROLLBACK_ROUNDS:
                rollback_rounds += 1  # contended, not full: the other stripes were busy
                continue
            if code in (lib.UCM_FULL, lib.UCM_ROLLBACK):
                if not tried_recovery:  # a dead rank's pins, claims or arenas, if free at once
                    tried_recovery = True
                    if self._recover(0.0).count:
                        continue
                left = max(0.0, stripe_deadline - time.monotonic())
                if code == lib.UCM_FULL and grown < MAX_GROWS and self._arenas.grow(
                        min(LOCK_WAIT, left)):
                    grown += 1  # one more arena, free or from a rank above its share
                    continue
                if not recovered_once:  # the same, waiting (bounded) for what holds it up
                    recovered_once = True
                    if self._recover(left).count:
                        continue
                if not looked_again:  # ranks may have come or gone meanwhile (UCM_MOVED)
                    looked_again = True
                    continue
                raise CacheFull(
                    f"segment {self.uuid!r}: rank {self._rank} found no claimable slot in the "
                    f"{self._owned_slots()} slots of the arenas it owns, and no arena to take "
                    "(all pinned, loading or contended); release handles or give the cache more "
                    "slots_per_rank")
            raise CorruptSegment(
                f"segment {self.uuid!r}: the slow path found inconsistent chain links or a "
                f"broken stripe lock ({code_name(code)}); `ucmcache verify {self.uuid}` lists "
                "what is broken")

    def get_many(self, keys: Sequence[Key], *, timeout: Optional[float] = None) -> HandleBatch:
        """Pin every key of a request with one C call (misses take the slow path one by one).
        Positions that come back owned must be filled and published by the caller.  All or
        nothing: if any key cannot be pinned, nothing stays pinned or owned."""
        ctx = self._ctx
        if ctx is None:
            self._check_usable()
        if timeout is not None:
            timeout = check_timeout(timeout)
        ids, offsets, split = pack_keys(keys)
        n = len(split)
        slots = np.full(n, lib.UCM_NIL, dtype=np.uint32)
        owner = np.zeros(n, dtype=bool)
        states = np.empty(n, dtype=np.uint8)
        codes = np.zeros(n, dtype=np.uint8)
        lens = np.empty(n, dtype=np.int64)
        slots_p = ffi.from_buffer("uint32_t[]", slots)
        owner_p = ffi.from_buffer("uint8_t[]", owner)
        # The batch's token covers its arrays from before the first pin: every C step pins
        # straight into them, so whatever is raised where (a signal handler, CacheFull), the
        # token's drop (explicit below, or from C when collected) releases every pin and fails
        # every owned load.
        token = ffi.gc(ffi.new("ucm_token *"),
                       functools.partial(lib.ucm_batch_token_release, self._keep, slots_p,
                                         owner_p))
        lib.ucm_batch_token_arm(ctx, token, n)
        batch = _new(HandleBatch)
        batch._closed = True
        try:
            if n:
                lib.ucm_lookup_pin_many(ctx, ids, _ptr("uint64_t[]", offsets), n, FAST_SPIN,
                                        slots_p, _ptr("uint8_t[]", states),
                                        _ptr("uint8_t[]", codes), _ptr("int64_t[]", lens))
            misses = np.flatnonzero(codes)
            for i in misses.tolist():
                r = self._pin_slow(split[i][0], split[i][1], int(codes[i]), timeout, ffi.NULL,
                                   slots_p + i, owner_p + i)
                lens[i] = (r >> _PIN_LEN_SHIFT) & _PIN_SLOT_MASK if r & _PIN_READY else -1
            any_owner = len(misses) > 0 and bool(owner.any())
            batch._cache = self
            batch._slots = slots
            batch.owner = owner
            batch._slots_p = slots_p
            batch._owner_p = owner_p
            batch._token = token
            batch._n = n
            batch._lens = lens
            batch._lens_l = None  # lens and data offsets as lists, made by the first data(i)
            batch._offs_l = None
            batch._timeout = timeout
            batch._owner_views = {}
            batch._views = []
            batch._any_owner = any_owner
            batch._owned = _NO_OWNED
            self._open_handles += 1
            batch._closed = False
            if any_owner:
                batch.own()
                if self._tier is not None:  # the batch owns the pins: a raise here closes it
                    self._ask_tier_many(batch, split, timeout)
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

    def _wait_loaded(self, slot: int, timeout: Optional[float],
                     cancel: Optional[threading.Event] = None) -> int:
        """Block on the slot's state word until it leaves Loading, never past ``timeout`` and
        never spinning.  Every LIVENESS_SLICE the loader's life lock is checked, so a dead
        loader is recovered rather than waited for.  ``cancel`` (set, then the state word
        woken): returns UCM_LOADING at once (an abandoned async wait)."""
        ctx = self._ctx
        state = ffi.new("uint32_t *")
        start = time.monotonic()
        deadline = None if timeout is None else start + timeout
        slice_s = LIVENESS_SLICE if cancel is None else CANCEL_SLICE
        lib.ucm_stat_add(ctx, lib.UCM_ST_WAITS, 1)
        try:
            while True:
                if cancel is not None and cancel.is_set():
                    return lib.UCM_LOADING
                left = slice_s if deadline is None else min(slice_s, deadline - time.monotonic())
                if left > 0 and lib.ucm_wait_loaded(ctx, slot, int(left * 1e9), state) == lib.UCM_OK:
                    return state[0]
                loader = lib.ucm_slot_loader(ctx, slot)
                if loader != self._rank and loader < self._layout.max_ranks \
                        and not rank_alive(self._seg, loader):
                    # Fails its loads, this one included, waking us; bounded by our deadline.
                    self._recover(LIVENESS_SLICE if deadline is None
                                  else deadline - time.monotonic())
                    st = lib.ucm_slot_state(ctx, slot)
                    if st != lib.UCM_LOADING:
                        return st
                if deadline is not None and time.monotonic() >= deadline:
                    lib.ucm_stat_add(ctx, lib.UCM_ST_WAIT_TIMEOUTS, 1)
                    raise TimeoutError(f"key still loading after {timeout} s (the load goes on; "
                                       "get() again to wait more)")
        finally:
            waited = int((time.monotonic() - start) * 1e9)
            lib.ucm_stat_add(ctx, lib.UCM_ST_WAIT_NS, waited)
            lib.ucm_observe(ctx, lib.UCM_HIST_WAIT, waited)

    def get_or_load(self, key: Key, loader: Callable[[], Any], *,
                    timeout: Optional[float] = None) -> bytes:
        """The value for key, computed by ``loader()`` exactly once across all processes.

        loader returns a bytes-like of at most slot_size bytes.  Its exception reaches this
        caller as itself and every concurrent waiter as LoadFailed.  When the cache is full the
        loader runs uncached (counted as a bypass)."""
        if not callable(loader):
            raise TypeError(f"loader must be a callable returning bytes, got "
                            f"{type(loader).__name__}")
        value = self._hit_bytes(key)
        if value is not None:
            return value
        try:
            h = self.get(key, timeout=timeout)
        except CacheFull:
            lib.ucm_stat_add(self._ctx, lib.UCM_ST_BYPASSES, 1)
            return as_value_view(loader(), self._layout.slot_size).tobytes()
        with h:
            if not h.owner:
                h.wait(timeout)
                return bytes(h.data)
            if _hooks._armed:
                _hooks.fire("inside_loader")
            try:
                value = loader()
                mv = as_value_view(value, self._layout.slot_size)
            except BaseException as e:
                h.fail(f"{type(e).__name__}: {e}")
                raise
            h.data[: mv.nbytes] = mv
            h.ready(mv.nbytes)
            return mv.tobytes()

    def _hit_bytes(self, key: Key) -> Optional[bytes]:
        """A Ready entry's bytes (pin, copy, release; no Handle), or None for anything else
        (which the caller takes through get()).  Counts only a hit."""
        ctx = self._ctx
        if ctx is None:
            self._check_usable()
        if type(key) is bytes and len(key) == 16:
            block_id, offset = key, 0
        else:
            block_id, offset = split_key(key)
        # The pin is named by the C step's in-flight record until released, so an exception
        # anywhere drops it (see get()).
        ticket = _next_ticket()
        try:
            r = lib.ucm_lookup_pin(ctx, block_id, offset, FAST_SPIN, 2, ticket)  # a hit counts
            if r >= 0 and r & _PIN_READY:
                o = self._data_off + (r & _PIN_SLOT_MASK) * self._stride
                value = self._ro[o:o + ((r >> _PIN_LEN_SHIFT) & _PIN_SLOT_MASK)].tobytes()
        except BaseException:
            lib.ucm_abandon_inflight(ctx, ticket)
            raise
        if r >= 0:
            lib.ucm_release(ctx, r & _PIN_SLOT_MASK)  # no call between the try and this one
            if r & _PIN_READY:
                return value
        return None

    async def aget_or_load(self, key: Key, loader: Callable[[], Any], *,
                           timeout: Optional[float] = None) -> bytes:
        """get_or_load for asyncio.  ``loader`` may be a plain callable or a coroutine
        function.  A hit returns with no thread hop; a cold key makes this task the owner and
        awaits its loader; waiting for another task's, thread's or process's load never blocks
        the event loop (the futex wait runs in a thread) and honours ``timeout`` and
        cancellation: a cancelled owner publishes Failed, a cancelled waiter abandons the wait,
        never the load.  Single flight across tasks, threads and processes."""
        if not callable(loader):
            raise TypeError(f"loader must be a callable or a coroutine function returning "
                            f"bytes, got {type(loader).__name__}")
        value = self._hit_bytes(key)
        if value is not None:
            return value
        isolate_owned()  # this task's own loads only (sibling tasks share the parent's set)
        try:
            h = self.get(key, timeout=timeout)
        except CacheFull:
            lib.ucm_stat_add(self._ctx, lib.UCM_ST_BYPASSES, 1)
            value = loader()
            if inspect.isawaitable(value):
                value = await value
            return as_value_view(value, self._layout.slot_size).tobytes()
        with h:
            if not h.owner:
                await h.wait_async(timeout)
                return bytes(h.data)
            try:
                value = loader()
                if inspect.isawaitable(value):
                    value = await value
                mv = as_value_view(value, self._layout.slot_size)
            except BaseException as e:  # CancelledError included: the load fails, waiters learn
                h.fail(f"{type(e).__name__}: {e}")
                raise
            h.data[: mv.nbytes] = mv
            h.ready(mv.nbytes)
            return mv.tobytes()

    def read_many(self, keys: Sequence[Key], out: Any) -> np.ndarray:
        """Copy every key that is Ready now into row i of ``out`` and return the lengths
        (int64; -1 for a key that is missing or not Ready, its row untouched), in one C call
        that pins, copies and releases each key in turn (the GIL released).  Elects no owner
        and creates nothing.  ``out`` as for HandleBatch.gather."""
        ctx = self._ctx
        if ctx is None:
            self._check_usable()
        ids, offsets, split = pack_keys(keys)
        n = len(split)
        lens = np.empty(n, dtype=np.int64)
        if n:
            ptr, row, keep = rows_of(out, n)
            r = lib.ucm_read_many(ctx, ids, _ptr("uint64_t[]", offsets), n, ptr, row,
                                  _ptr("int64_t[]", lens))
            del keep
            if r == lib.UCM_CORRUPT:
                raise CorruptSegment(f"segment {self.uuid!r}: a chain points outside the slot "
                                     "table")
            check_rows(lens, row)
        return lens

    # ---------------------------------------------------------------- batch lookups

    def exist(self, keys: Iterable[Key]) -> List[bool]:
        """For each key, whether a Ready entry is there now (no pin, one C call)."""
        ctx = self._ctx
        if ctx is None:
            self._check_usable()
        if type(keys) is list and len(keys) <= _SHORT and _plain_ids(keys):
            return [lib.ucm_exist1(ctx, k, 0) == 1 for k in keys]  # no arrays for a handful
        ids, offsets, split = pack_keys(keys)
        out = np.zeros(len(split), dtype=np.uint8)
        if len(split):
            lib.ucm_exist_many(ctx, ids, _ptr("uint64_t[]", offsets), len(split),
                               _ptr("uint8_t[]", out))
        return out.astype(bool).tolist()

    def exist_prefix(self, keys: Sequence[Key]) -> int:
        """How many leading keys (a chained-hash prefix) are Ready, in one C call."""
        ctx = self._ctx
        if ctx is None:
            self._check_usable()
        if type(keys) is list and len(keys) <= _SHORT and _plain_ids(keys) and \
                self._tier is None:
            n = 0
            for k in keys:
                if lib.ucm_exist1(ctx, k, 0) != 1:
                    break
                n += 1
            return n
        ids, offsets, split = pack_keys(keys)
        if not split:
            return 0
        n = lib.ucm_exist_prefix(ctx, ids, _ptr("uint64_t[]", offsets), len(split))
        if self._tier is not None and n < len(split):
            n += self._tier.exist_prefix(split[n:])  # the rest, from tier 2: one round trip
        return n

    def touch(self, keys: Iterable[Key]) -> None:
        """Mark entries recently used (CLOCK's bit) without pinning; best effort."""
        ctx = self._ctx
        if ctx is None:
            self._check_usable()
        ids, offsets, split = pack_keys(keys)
        if split:
            lib.ucm_touch_many(ctx, ids, _ptr("uint64_t[]", offsets), len(split))

    # ---------------------------------------------------------------- prefetch

    def prefetch(self, keys: Iterable[Key], *, rank: Optional[int] = None) -> int:
        """Post keys to a rank's prefetch ring (default: our own); never blocks.  Keys already
        Ready or Loading are skipped; a full ring or a busy producer drops them (counted in
        stats).  Returns how many were posted."""
        ctx = self._ctx
        if ctx is None:
            self._check_usable()
        if rank is None:
            rank = self._rank
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.max_ranks:
            raise ValueError(f"rank must be None or an int in [0, {self.max_ranks}), got {rank!r}")
        ids, offsets, split = pack_keys(keys)
        posted = ffi.new("uint32_t *")
        total = 0
        for start in range(0, len(split), lib.UCM_RING_DEPTH):  # one lock hold per chunk
            n = min(lib.UCM_RING_DEPTH, len(split) - start)
            args = (ctx, rank, ids[16 * start:16 * (start + n)],
                    _ptr("uint64_t[]", offsets[start:start + n]), n, posted)
            if lib.ucm_ring_post(*args) == lib.UCM_BUSY and self._ring_holder_dead(rank):
                # A producer died holding the lock (it names its rank): recovery releases it,
                # so a dead producer costs one dropped post, not every post until a recovery.
                self._recover(0.0)  # never blocks: a busy recovery elsewhere does it
                lib.ucm_ring_post(*args)
            total += posted[0]
        return total

    def _ring_holder_dead(self, ring: int) -> bool:
        L = self._layout
        holder = lib.ucm_load32(self._seg.base, L.ring_off + ring * L.ring_size + lib.UCM_RING_LOCK)
        return 0 < holder <= L.max_ranks and holder - 1 != self._rank \
            and not rank_alive(self._seg, holder - 1)

    def prefetcher(self, loader: Callable[[Key], Any], *, batch: int = 64) -> Prefetcher:
        """Start a thread that drains this rank's ring, loading each cold key with
        ``loader(key)`` through the single-flight path.  Stop it with .stop() (or a with)."""
        self._check_usable()
        if self._prefetcher is not None and self._prefetcher.running:
            raise UcmError(f"rank {self._rank} already has a prefetcher: a ring has one consumer")
        self._prefetcher = Prefetcher(self, loader, batch)
        return self._prefetcher

    # ---------------------------------------------------------------- generations, stats

    def clear(self) -> int:
        """Make every current entry invisible at once; never waits for in-flight loads.
        Returns the new generation."""
        self._check_usable()
        return lib.ucm_clear(self._ctx)

    def size_bytes(self) -> int:
        """Sum of published payload lengths in the current generation (exact)."""
        self._check_usable()
        return lib.ucm_acc_value(self._ctx, lib.UCM_A_ACC_BYTES)

    def entry_count(self) -> int:
        """Ready entries in the current generation (exact)."""
        self._check_usable()
        return lib.ucm_acc_value(self._ctx, lib.UCM_A_ACC_ENTRIES)

    def _owned_slots(self) -> int:
        mine = self._arenas.owners() == self._rank + 1
        return sum(len(self._layout.arena_range(a)) for a in np.flatnonzero(mine).tolist())

    def arenas(self) -> List[int]:
        """The arenas this rank owns now (it allocates only in those; DESIGN 4.12)."""
        self._check_usable()
        return np.flatnonzero(self._arenas.owners() == self._rank + 1).tolist()

    def stats(self) -> Dict[str, Any]:
        """Counters summed over ranks, plus ``per_rank`` rows; see ucmcache._stats."""
        self._check_usable()
        out = _stats.collect(self._seg, lambda r: r == self._rank or rank_alive(self._seg, r))
        out["rings"] = [ring_counters(self._seg, r) for r in range(self.max_ranks)]
        out["generation"] = self.generation
        out["entries"] = self.entry_count()
        out["size_bytes"] = self.size_bytes()
        return out

    def recover(self) -> RecoveryReport:
        """Recover every dead rank now (also done on attach and when allocation is starved).
        A rank that cannot be finished now (a stripe its dead claim needs is held by a stopped
        process) is listed in the report's ``failed`` and left for the next recovery."""
        self._check_usable()
        return recover_dead_ranks(self._seg, self._ctx, self._rank)

    def _recover(self, wait: float) -> RecoveryReport:
        """recover() within a caller's deadline: never blocks longer than ``wait`` seconds."""
        return recover_dead_ranks(self._seg, self._ctx, self._rank, max(0.0, wait))

    # ---------------------------------------------------------------- the tier (DESIGN 4.10)
    # The cache asks its tier (see _tier) right after get/get_many made this caller an owner,
    # with the pins already the handle's or the batch's; the handle publishes what the tier
    # serves (_served), writes through on ready() and abandons on an unpublished close.

    def _ask_tier(self, h: Handle, block_id: bytes, offset: int,
                  timeout: Optional[float]) -> None:
        """get(): h owns a cold slot.  When the tier has the value, h publishes it and becomes
        a reader of it; else h stays the owner (the tier may hold a lease for its slot)."""
        # Waiting for another node is safe only when this caller owns no other load.
        (payload,) = self._tier.lookup([(h._slot, block_id, offset)], len(h._owned) == 1,
                                       timeout)
        if payload is not None:
            h._served(payload)

    def _ask_tier_many(self, batch: HandleBatch, split: Sequence[Tuple[bytes, int]],
                       timeout: Optional[float]) -> None:
        """get_many(): the owned positions ask the tier together; those it serves are
        published and no longer owned."""
        idx = np.flatnonzero(batch.owner).tolist()
        slots = [int(batch._slots[i]) for i in idx]
        may_wait = not (batch._owned - set(slots))
        payloads = self._tier.lookup([(s, *split[i]) for s, i in zip(slots, idx)], may_wait,
                                     timeout)
        for i, p in zip(idx, payloads):
            if p is not None:
                batch._served(i, p)

    def _count(self, counter: int, n: int) -> None:
        """Add n to one of this rank's shared counters (the tier's UCM_ST_T2_*)."""
        ctx = self._ctx
        if ctx is not None and n:
            lib.ucm_stat_add(ctx, counter, n)

    # ---------------------------------------------------------------- test hooks

    def _arm(self, point: str, action: str = "gate", gate: Optional[_hooks.Gate] = None) -> None:
        """Arm a named point (ucmcache._hooks.POINTS) in this process: hold at a gate, or kill."""
        self._check_usable()
        actions = {"none": lib.UCM_ACT_NONE, "gate": lib.UCM_ACT_GATE, "kill": lib.UCM_ACT_KILL}
        if action not in actions:
            raise ValueError(f"action must be one of {sorted(actions)}, got {action!r}")
        if action == "gate" and gate is None:
            raise ValueError("a gate action needs a Gate")
        if point in _hooks.C_POINTS:
            word = gate.word if gate is not None else ffi.NULL
            t = int((gate.timeout if gate is not None else 0) * 1e9)
            lib.ucm_ctx_set_point(self._ctx, _hooks.C_POINTS[point], actions[action], word, t)
        else:
            _hooks.arm_python(point, action, gate)

    def __repr__(self) -> str:
        state = "attached" if self._ctx is not None else self._why_unusable or "closed"
        return (f"<SlotCache {self.uuid!r} rank={getattr(self, '_rank', None)} "
                f"slots={self._layout.n_slots}x{self._layout.slot_size}B {state}>")


def _check_same_params(seg: Segment, want: Layout) -> None:
    have = seg.layout
    for field in ("max_ranks", "slots_per_rank", "slot_size", "n_buckets", "n_stripes"):
        if getattr(have, field) != getattr(want, field):
            seg.detach()
            raise IncompatibleSegment(
                f"segment {seg.uuid!r} exists with {field}={getattr(have, field)}, "
                f"asked for {getattr(want, field)}")
