"""SlotCache: the public object.  This module drives the slot protocol (DESIGN 4).

Read (get): one C call does the optimistic step (walk, MatchKey, pin, revalidate: I3) with no
lock.  Anything but a pinned match goes to the slow path: take the bucket's stripe, look again
(a second pinned lookup, exact now that no writer can change the chain), and on a miss allocate:
CLOCK claim from our own range (I1), install (isolate with trylock only, rewrite while
unreachable, publish bucket-before-head, hand over as pinned: I2), all under the stripe.  The
stripe is released before any loader runs or any wait begins.

Allocation that finds nothing claimable first recovers dead ranks (their pins may be what fills
the cache), then tries once more, then raises CacheFull: never spins holding a stripe.

The rest of SlotCache's API is mixed in, one concept a module, none of which imports this one:
``single_flight`` (get_or_load, aget_or_load, the wait), ``batches`` (get_many, read_many,
exist, exist_prefix, touch), ``ring`` (prefetch, prefetcher) and ``mapping`` (put, ``in``,
``len``, ``[]``, ``del``, memoize).
"""
from __future__ import annotations

import functools
import gc
import itertools
import os
import random
import threading
import time
import warnings
import weakref
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple, Union

import numpy as np

from . import hooks as _hooks
from .arenas import LOCK_WAIT, Arenas
from .._core import ffi, lib
from .batches import Batches
from .errors import (CacheFull, CorruptSegment, IncompatibleSegment, LockTimeout,
                      NotAttached, SegmentExists, UcmError, Unsupported)
from .handle import Handle, _Pins
from .._hit import CacheBase
from .single_flight import SingleFlight
from .mapping import Mapping
from .slots import (ABANDONED, ABANDONED_LEN, FAST_SPIN, _PIN_LEN_SHIFT, _PIN_OWNER,
                     _PIN_OWNER_OR_READY, _PIN_READY, _PIN_SLOT_MASK, check_timeout,
                     decode_pin, owns_loads_besides)
from .keys import Key, split_key
from .layout import DEFAULT_STRIPES, Layout
from .locks import Stripes, describe_stripe_holder
from .recovery import (RecoveryReport, free_rank, rank_alive, recover_dead_ranks, take_rank)
from .results import code_name
from .ring import Prefetcher, Prefetching, ring_counters
from .tier import BoundTier, TierArg, check_tier
from .segment import LIFE_LOCK_BYTE0, Segment
from .. import _hit
from . import single_flight as _single_flight, slots as _slots, stats as _stats

SLOW_SPIN = 64          # under the stripe a live claimant of our chain rolls back at once; a
                        # claim that stays is a dead rank's, recovered without the stripe held
MAX_ROLLBACKS = 64      # isolate trylock failures tolerated in one allocation
MAX_ROLLBACK_ROUNDS = 8 # allocations retried when every one of them rolled back
MAX_GROWS = 8           # arenas one allocation may take when its rank's arenas are full
MAX_MOVED = 4           # looks at the arena shares in one allocation (ranks keep changing)
MAX_ROOMS = 4           # arena policy looks (UCM_ROOM) in one allocation before it evicts; each
                        # takes an arena, so past this others took what it took as fast
CLAIM_WAIT = 10.0       # the longest a get waits for another process to recover a dead claim
STRIPE_WAIT = 10.0      # the longest a get with no timeout waits for a bucket's stripe; held
                        # for microseconds normally, so past this its holder is stopped or stuck
FORK_WAIT = 5.0         # the longest a parent waits for its child's private copies (below)
DETACH_WAIT = 5.0       # the longest close() waits for other threads' copies out of the
                        # segment (a fork's parent side: FORK_HOLD_WAIT, below)
DELETE_WAIT = 10.0      # the longest a delete with no timeout waits for its entry's arena (another
                        # rank's install or load in flight there, or deleters taking it in turn)
RECOVER_SLICE = 0.05    # a delete's recovery of a dead rank waits this long at most per backoff
                        # round for a stripe (a dead deleter's entry is finished under it)
MIN_LOCK_WAIT = 0.05    # a get's timeout below this still waits this long for a lock: a
                        # stripe or a claim held that long is not contention any more

def _stripe_wait(timeout: Optional[float]) -> float:
    """How long a slow step may wait for its key's stripe: STRIPE_WAIT with no timeout, else
    the timeout, never under MIN_LOCK_WAIT (read at call time: a test may change them)."""
    return STRIPE_WAIT if timeout is None else max(timeout, MIN_LOCK_WAIT)


_live_caches: "weakref.WeakSet[SlotCache]" = weakref.WeakSet()

# The cold get_or_load in C (csrc/ucm_hit.c, cold_load): the slow step's budgets are these, the
# owned-slot record, the value checks and the test hooks are the full path's.  A function so a
# test that changes a budget (STRIPE_WAIT) binds it again.
def _bind_loads() -> None:
    _hit.bind_loads(steps={name: int(ffi.cast("uintptr_t", ffi.addressof(lib, name)))
                           for name in ("ucm_get_slow", "ucm_load_finish", "ucm_token_drop",
                                        "ucm_now_ns", "ucm_token_publish", "ucm_token_release",
                                        "ucm_wait_ready", "ucm_slot_state", "ucm_stat_add",
                                        "ucm_observe", "ucm_load_serial")},
                    owning=_slots._owning, owned_slots=_slots._owned_slots,
                    owns_load=_slots.owns_load, as_value_view=_slots.as_value_view,
                    hooks_armed=_hooks._armed, hooks_fire=_hooks.fire, slow_spin=SLOW_SPIN,
                    max_rollbacks=MAX_ROLLBACKS, stripe_wait=STRIPE_WAIT,
                    liveness_ns=_single_flight.LIVENESS_NS, life_byte0=LIFE_LOCK_BYTE0)


_bind_loads()


# A fork (DESIGN 5.6).  Views the child inherits must keep showing their key's bytes, so the
# child gives the slots this process pins private pages (ucm_privatize_pins) before the parent
# may drop any of those pins: the parent holds one more pin on each of them across the fork
# (ucm_hold_pins, in every live cache) and waits, bounded, until the child says its copies are
# made, then drops those holds.  The child must attach for itself.
# What one fork holds lives in the forking thread's own state: two threads of a process may fork
# at once (the hooks run Python, and the GIL can pass between them), and each parent side drops
# exactly the holds its own fork took.  A thread's locals are the child's too (it is the child's
# only thread).  Each hold is taken, counted on its cache and recorded in one C step
# (_fork_hold), so no exception can fall between a hold and its record, and close() in another
# thread waits for the parent side instead of freeing the context its holds are dropped
# through.  Every fork's pipe in flight is in _fork_pipes: a child closes them all (another
# thread's fork's pipe too, else that parent would wait for this child's exit).
_fork_state = threading.local()  # .holds: [(cache, ctx, slots array, count)], .pipe
_fork_pipes: set = set()
FORK_HOLD_WAIT = 60.0   # the longest close() waits for forks' parent sides (each bounded by
                        # FORK_WAIT once its child runs; before that, by its own hooks and fork())


def _before_fork() -> None:
    holds: list = []
    _fork_state.holds, _fork_state.pipe = holds, None
    caches = list(_live_caches)
    if not caches:
        return
    pipe = os.pipe()  # first: a pipe that cannot be made leaves nothing held
    _fork_pipes.add(pipe)
    _fork_state.pipe = pipe
    for cache in caches:
        try:
            mapped = len(cache._ro) if cache._ro is not None else 0
        except ValueError:
            # Released: another thread's close of this cache ended after the list was taken
            # (it detaches after leaving _live_caches).  Its context is gone: nothing to hold
            # (_fork_hold would answer False), and the caches after it still get theirs.
            continue
        n = max(cache.capacity, (mapped - cache._data_off) // cache._stride
                if cache._stride > 0 else 0)
        cache._fork_hold(np.empty(n, dtype=np.uint32), holds)  # holds and records, one step


def _after_fork_in_parent() -> None:
    holds, pipe = getattr(_fork_state, "holds", None), getattr(_fork_state, "pipe", None)
    _fork_state.holds, _fork_state.pipe = None, None
    try:
        if pipe is not None:
            _fork_pipes.discard(pipe)
            os.close(pipe[1])
            if holds:
                import select
                select.select([pipe[0]], [], [], FORK_WAIT)  # a byte, or EOF: copies made
    finally:
        try:
            if pipe is not None:
                os.close(pipe[0])
        finally:
            while holds:
                cache, _ctx, slots, n = holds.pop()
                cache._fork_release(slots, n)


def _after_fork_in_child() -> None:
    _fork_state.holds, _fork_state.pipe = None, None  # the parent's holds: not ours to drop
    pipes = list(_fork_pipes)
    _fork_pipes.clear()
    try:
        for cache in list(_live_caches):
            cache._forget_after_fork()
    finally:
        for r, w in pipes:  # EOF for the parents: the copies are made
            for fd in (r, w):
                try:
                    os.close(fd)
                except OSError:
                    pass


os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent,
                    after_in_child=_after_fork_in_child)


_next_ticket = itertools.count(1).__next__  # a unique ticket per single-key read (see get)


class SlotCache(CacheBase, SingleFlight, Batches, Prefetching, Mapping):
    """A shared-memory slot cache attached to one segment as one rank.

    Create a segment with ``SlotCache.create`` (the creator is attached too), attach to it from
    other processes with ``SlotCache.attach``, and remove it with ``SlotCache.unlink``.
    """

    def __init__(self, seg: Segment, rank: Optional[int], tier2: TierArg = None):
        tier2 = check_tier(tier2)  # a sequence of tiers becomes one TierChain
        # None, or the tier beneath this cache, bound to it (see _tier: the calls it gets)
        self._value_max = seg.layout.slot_size  # the longest value a load stores (C's copy)
        self._lock_fd = seg.lock_fd  # the life locks' fd: a waiter's liveness check in C
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
        self._closing_ctx = None  # a close that raised in free_rank: close() goes on from it
        self._detach_pending = False  # a close whose unmapping raised: close() goes on from it
        self._prefetcher: Optional[Prefetcher] = None
        self._pid = os.getpid()
        self._why_unusable = ""
        self._armed_gates: Dict[str, Optional[_hooks.Gate]] = {}  # test points' gates (_arm)
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
        st = os.fstat(seg.fd)  # the segment is its file: another cache of it shares its loads'
        _slots.note_cache(self, seg.uuid, (st.st_dev, st.st_ino))  # record (owns_load)
        self.recover()

    # ---------------------------------------------------------------- lifecycle

    @classmethod
    def create(cls, uuid: str, *, slots_per_rank: int, slot_size: int, max_ranks: int = 8,
               n_buckets: Optional[int] = None, n_stripes: int = DEFAULT_STRIPES,
               mode: int = 0o600, exist_ok: bool = False, timeout: float = 10.0,
               tier2: TierArg = None) -> "SlotCache":
        """Create the segment ``uuid`` and attach to it.  With exist_ok, a segment that exists
        with the same params is attached instead (other params: IncompatibleSegment), waiting up
        to ``timeout`` for one still being created."""
        check_tier(tier2)
        check_timeout(timeout)  # refused before the segment is made, not only when it exists
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
               allow_other_user: bool = False, tier2: TierArg = None) -> "SlotCache":
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
        """Detach: the rank is freed (its Ready entries stay for others), the mapping dropped.
        Refuses, before it frees anything, while handles or batches are open or views of slot
        bytes are alive (each keeps its slot pinned); call it again once they are gone.  A
        close that raised part-way (a stripe held too long, a corrupt segment) can be called
        again: it goes on from where it stopped."""
        if self._closing_ctx is not None:
            self._finish_close(self._closing_ctx)
            return
        if self._ctx is None:
            if self._detach_pending:
                self._finish_detach()
            return  # closed already, or a forked child's copy (the parent's rank is not ours)
        if self._prefetcher is not None:
            self._prefetcher.stop()  # its thread's load holds a handle on this mapping: first
        self._check_closable()
        if self._tier is not None:
            self._tier.close()  # write-throughs queued by this process go out first (bounded)
        _slots.stop_shared_waits(self)  # a shared async wait left running: joined, bounded
        # Unusable first: from here no call of this cache (the C hit path of another thread
        # included) takes a pin through ctx, and no copy of another thread still runs on it;
        # then closed: no pin drop or token through ctx touches the segment, before the rank
        # is freed for another process (free_rank's recovery removes our holds).
        ctx = self._detach_ctx()
        # Checked again now that no path can take a pin through the cache: another thread may
        # have made a handle or a view between the first check and the detach.
        if self._exports > 0 or (self._open_handles > 0 and self._live_handles() > 0):
            self._ctx = ctx  # given back whole: nothing was freed
            self._check_closable()  # raises, unless what looked alive was garbage
            ctx = self._detach_ctx()
        self._closing_ctx = ctx
        self._why_unusable = "closed"
        _slots.forget_cache(self)  # owns_load looks it up no more
        lib.ucm_ctx_close(ctx)
        self._finish_close(ctx)

    def _check_closable(self) -> None:
        """Refuse to close while something of this process still reads through the cache."""
        if self._open_handles > 0 and self._live_handles() > 0:
            raise UcmError(f"cannot close: {self._open_handles} handle(s) or batch(es) are still "
                           "open; close them first")
        if self._exports > 0:
            gc.collect()  # views that are garbage in a reference cycle only look alive
        if self._exports > 0:
            raise UcmError(f"cannot close: {self._exports} view(s) of slot bytes are still alive "
                           "(memoryviews, numpy arrays or tensors made from data keep their "
                           "slots pinned and the segment mapped); drop them first")

    def _finish_close(self, ctx, keep_mapping: bool = False) -> None:
        free_rank(self._seg, ctx, self._rank)  # may raise: close() again comes back here
        self._closing_ctx = None
        lib.ucm_ctx_free(ctx)
        _live_caches.discard(self)
        if keep_mapping:
            self._seg.close_fds()  # the mapping goes when the segment object does
            return
        self._detach_pending = True
        self._finish_detach()

    def _finish_detach(self) -> None:
        self._seg.detach()  # may raise (a view of the mapping alive): close() again retries it
        self._detach_pending = False

    def __del__(self) -> None:
        # A cache collected without close(): its rank, arenas, mapping and fds are freed now,
        # as files and sockets are, with a ResourceWarning.  Nothing can reach its handles any
        # more (they would hold it), so their pins go with the rank (free_rank's recovery).
        # Nor its views: each holds the cache (SlotBuffer), so views still counted are garbage
        # of the same cycle, released after this; the mapping is left to go with the segment
        # object, so that even a view another finalizer brings back never reads unmapped memory.
        if getattr(self, "_ctx", None) is None or getattr(self, "_pid", None) != os.getpid():
            return  # closed, never attached, or a forked child's copy of the parent's cache
        try:
            warnings.warn(f"SlotCache {self.uuid!r} (rank {self._rank}) was collected without "
                          "close(); closing it now", ResourceWarning, source=self)
            if self._prefetcher is not None:
                self._prefetcher.stop()
            if self._tier is not None:
                self._tier.close()
            ctx = self._closing_ctx = self._detach_ctx()
            self._why_unusable = "closed"
            _slots.forget_cache(self)
            keep = self._exports > 0
            if keep:
                # Their pins go with the rank: the pinned slots get private pages first, so a
                # view another finalizer brings back still shows its key's bytes (DESIGN 5.5).
                lib.ucm_privatize_pins(ctx)
            lib.ucm_ctx_close(ctx)
            self._finish_close(ctx, keep_mapping=keep)
        except Exception:
            pass  # a finalizer's errors have nowhere to go; the process's exit frees the rest

    def _detach_ctx(self):
        """Take the context away (see CacheBase._detach), waiting for another thread's copy
        (read_many, gather: milliseconds at most) for up to DETACH_WAIT."""
        deadline = time.monotonic() + DETACH_WAIT
        while True:
            ctx = self._detach()
            if ctx is not None:
                return ctx
            if self._forks_out() > 0 and time.monotonic() <= deadline - DETACH_WAIT \
                    + FORK_HOLD_WAIT:
                time.sleep(0.0005)  # a fork's parent side still holds pins through it
                continue
            if time.monotonic() > deadline:
                raise UcmError(f"cannot close: another thread's read was still copying from the "
                               f"segment, or a fork was still waiting for its child, after "
                               f"{DETACH_WAIT} s")
            time.sleep(0.0005)

    def __enter__(self) -> "SlotCache":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _live_handles(self) -> int:
        """Handles and batches of this cache that still exist and are open.  The counter can
        stay above it when a signal handler raised inside both a handle's __exit__ and its
        finalizer; such a handle is gone, and free_rank removes the pin it leaked."""
        n = self._loads_out  # cold get_or_loads running their loader (no Handle: see C)
        for o in gc.get_referrers(self):
            if isinstance(o, _Pins):  # (their _cache is a C member: found through them)
                n += not getattr(o, "_closed", True)
        self._open_handles = n
        return n

    def _forget_after_fork(self) -> None:
        self._closing_ctx = None  # a parent's close in progress is not the child's to finish
        if self._ctx is None:
            # Closed, or the parent was closing it as it forked: the parent's life lock must
            # still die with the parent, not live on in this child's copy of the fd.
            if self._seg is not None and self._seg.lock_fd >= 0:
                self._seg.forget_after_fork()
            return
        # Views the child inherited keep their key's bytes: the slots this process pinned get
        # private pages in the child, before the parent can drop a pin (DESIGN 5.6).
        lib.ucm_privatize_pins(self._ctx)
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

    # The read path's public methods are CacheBase's, made in C (csrc/ucm_hit.c; signatures in
    # _hit.pyi, docs in help()): a hit is one C call with no Python frame, anything else comes
    # back here (_get_full, _get_missed, _pin_slow; get_or_load's miss in _single_flight).
    # Named here so a reader of SlotCache finds them: each is the C method itself.
    get = CacheBase.get
    get_many = CacheBase.get_many
    get_or_load = CacheBase.get_or_load
    aget_or_load = CacheBase.aget_or_load
    read_many = CacheBase.read_many

    def _get_full(self, key: Key, *, timeout: Optional[float] = None,
                  put: bool = False) -> Handle:
        """get() for everything but a plain hit (see CacheBase.get).  ``put``: for put() under
        a tier (an owner asks the tier's put, not its lookup: see _ask_tier)."""
        ctx = self._ctx
        if ctx is None:
            self._check_usable()
        timeout = check_timeout(timeout)  # inf: None (no deadline)
        if type(key) is bytes and len(key) == 16:
            block_id, offset = key, 0
        else:
            block_id, offset = split_key(key)
        return self._pin_handle(block_id, offset, timeout, True, put=put)

    def _get_missed(self, key: bytes, answer: int = 0, since_ns: int = -1) -> Handle:
        """get() of a plain id the C hit path looked for, missed and counted as a request:
        the slow path at once (a look less for every cold key).  ``answer``: the C slow step
        (cold_handle) ran already, started at ``since_ns`` (ucm_now_ns), and answered
        -answer: _pin_slow takes it as its own first step (see there)."""
        return self._pin_handle(key, 0, None, False, answer, since_ns)

    def _pin_handle(self, block_id: bytes, offset: int, timeout: Optional[float],
                    look: bool, answer: int = 0, since_ns: int = -1,
                    put: bool = False) -> Handle:
        """A Handle holding key's pin: looked up first (``look``), else the slow path at once."""
        t0 = time.monotonic() if timeout is not None else 0.0  # the tier gets what is left
        # No window without an owner object (a signal handler may raise at any call): the
        # handle exists, inert, before the pin, and so does the call's ticket; the pin becomes
        # the handle's in plain stores, with no call in between (CPython >= 3.10 runs signal
        # handlers only at calls, function entries and backward jumps).  Until then the C step
        # records the pin under the ticket and the except path drops it; a slow-path pin (maybe
        # an owner's) goes to a token instead, dropped there or, failing that, from C when the
        # token is collected.
        h = Handle.__new__(Handle)
        h._closed = True
        ctx = self._ctx  # again: a finalizer run by the allocation may have closed the cache
        if ctx is None:
            self._check_usable()
        token = None
        ticket = _next_ticket()
        try:
            r = lib.ucm_lookup_pin(ctx, block_id, offset, FAST_SPIN, lib.UCM_OUTER_REQUEST,
                                   ticket) if look else -lib.UCM_MISS
            if r < 0:
                token = ffi.gc(ffi.new("ucm_token *"), self._token_release)
                r = self._pin_slow(block_id, offset, -r, timeout, token, ffi.NULL, ffi.NULL,
                                   answer, since_ns)
            # The pin's answer says what a reader needs (UCM_PIN_*): slot, and for a Ready
            # slot its length, so data needs no further C call.
            owner = (r & _PIN_OWNER_OR_READY) == _PIN_OWNER
            h._token = token
            # The load's serial, handed by the step (the token's): what ready()/fail() name, so
            # a stale one never finishes a later install's load on this slot (I4).
            h._serial = token.serial if owner and token is not None else 0
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
                    self._ask_tier(h, block_id, offset, timeout if timeout is None else
                                   max(0.0, timeout - (time.monotonic() - t0)), put)
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
                  token, slot_out, owner_out, answer: int = 0, since_ns: int = -1) -> int:
        """The slow path for one key (one C step: lock, look again, allocate); returns the
        pin's answer (UCM_PIN_*), the pin also handed inside the step to its owner object: the
        token, or slot_out/owner_out (a batch's arrays, covered by the batch's token).  What to
        do when it cannot is decided here: ranks came or went (look at our share of the arenas);
        nothing free in our arenas (look for our share or room elsewhere before evicting);
        a dead rank's pins may be what fills the cache, and a key's slot that stays claimed
        under its stripe has a dead claimant: both are recovered and the step is tried again.  Never
        CacheFull for a claim, never a spin with a stripe held, never a wait past the deadline
        (``timeout``, or STRIPE_WAIT for the stripe and CLAIM_WAIT for a dead claim).
        ``answer`` > 0: the C path (cold_load, cold_handle) ran this step already, from
        ``since_ns`` (ucm_now_ns), and it answered -answer: that is our first step's answer and
        our deadlines count from its start, so the waits, retries and counters are the full
        path's, not one step more."""
        if code == lib.UCM_CORRUPT:
            raise CorruptSegment(f"segment {self.uuid!r}: a chain points outside the slot table")
        ctx = self._ctx
        recovered_once = False
        rollback_rounds = grown = moved = roomed = 0
        tried_recovery = looked_again = False
        start = time.monotonic()
        if answer and since_ns >= 0:  # the C step's start (monotonic clocks both)
            start -= max(0, lib.ucm_now_ns() - since_ns) / 1e9
        stripe_deadline = start + _stripe_wait(timeout)
        claim_deadline = start + (CLAIM_WAIT if timeout is None else max(timeout, MIN_LOCK_WAIT))
        delay = 0.0005
        while True:
            if answer:  # the C path's step was our first
                r, answer = -answer, 0
            else:
                left = max(0.0, stripe_deadline - time.monotonic())
                r = lib.ucm_get_slow(ctx, block_id, offset, SLOW_SPIN, MAX_ROLLBACKS,
                                     max(1, int(left * 1e9)), token, slot_out, owner_out)
            if r >= 0:
                return r
            code = -r
            if code == lib.UCM_MOVED:  # ranks came or went: look at our share of arenas first
                moved += 1
                self._look_at_share(moved, stripe_deadline)
                continue
            if code == lib.UCM_ROOM:  # nothing free in our arenas: the policy looks before we evict
                roomed += 1
                if roomed > MAX_ROOMS:
                    lib.ucm_arena_room_gone(ctx)  # enough looks: the claim evicts (CLOCK)
                else:  # takes an arena, or marks none to take under the pair it looked under
                    self._arenas.make_room(
                        min(LOCK_WAIT, max(0.0, stripe_deadline - time.monotonic())))
                continue
            if code == lib.UCM_TIMEOUT:
                stripe = lib.ucm_stripe_of(ctx, lib.ucm_bucket_of(ctx, block_id, offset))
                raise self._stripe_timeout(stripe, time.monotonic() - start)
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

    def _pin_slow_many(self, ids: bytes, offsets: Any, codes: np.ndarray,
                       split: Sequence[Tuple[bytes, int]], timeout: Optional[float],
                       slots: np.ndarray, owner: np.ndarray, lens: np.ndarray,
                       serials: np.ndarray, slots_p: Any, owner_p: Any) -> None:
        """_pin_slow for every position of a batch whose first look missed (``codes`` != 0),
        the pins handed to the batch's arrays (``slots_p``/``owner_p``, which its token
        covers), ``lens`` and an owned position's load serial (``serials``, I4) filled.  The
        slow steps run in one C call (ucm_get_slow_many: each key's step whole, with the
        stripe wait _pin_slow gives its first step) up to the first that answers what this
        layer decides (MOVED, ROOM, FULL, BUSY, ...); that key goes on through _pin_slow, its
        C step counted as its first, then the C call again from the next key.  So a batch of
        misses pays one call, not a Python frame and two calls a key.  A signal's Python
        handler runs when the call returns (after every key's step, each bounded by its stripe
        wait), not between two keys; whatever it raises, the batch's token drops every pin."""
        n = len(codes)
        wait_ns = max(1, int(_stripe_wait(timeout) * 1e9))
        codes_p = ffi.from_buffer("uint8_t[]", codes)
        lens_p = ffi.from_buffer("int64_t[]", lens)
        serials_p = ffi.from_buffer("uint32_t[]", serials)
        answer = ffi.new("int64_t *")
        since = ffi.new("int64_t *")
        at = 0
        while at < n:
            ctx = self._ctx   # after the allocations above and each _pin_slow (finalizers)
            if ctx is None:
                self._check_usable()
            at = lib.ucm_get_slow_many(ctx, ids, offsets, n, at, codes_p, SLOW_SPIN,
                                       MAX_ROLLBACKS, wait_ns, slots_p, owner_p, lens_p,
                                       serials_p, answer, since)
            if at >= n:
                return
            r = self._pin_slow(split[at][0], split[at][1], int(codes[at]), timeout, ffi.NULL,
                               slots_p + at, owner_p + at, answer=int(answer[0]),
                               since_ns=int(since[0]) if answer[0] else -1)
            lens[at] = decode_pin(r)[1]
            if owner[at]:  # the load's serial, asked while the batch's pin holds the slot
                ctx = self._ctx   # a finalizer may have closed it inside _pin_slow
                if ctx is None:
                    self._check_usable()
                serials[at] = lib.ucm_load_serial(ctx, int(slots[at]))
            at += 1

    def _look_at_share(self, moved: int, deadline: float) -> None:
        """The slow step answered MOVED (ranks came or went): take our share of the arenas.
        Past MAX_MOVED looks in one get, allocate in what we have and look next time."""
        if moved <= MAX_MOVED:
            self._arenas.rebalance(min(LOCK_WAIT, max(0.0, deadline - time.monotonic())))
        elif time.monotonic() < deadline:
            lib.ucm_arena_epoch_seen(self._ctx, lib.ucm_load64(self._seg.base,
                                                               lib.UCM_H_ARENA_EPOCH))
        else:
            raise LockTimeout(f"segment {self.uuid!r}: ranks attached and closed faster than "
                              f"this get could allocate, for {STRIPE_WAIT} s")

    def _stripe_timeout(self, stripe: int, waited: float) -> LockTimeout:
        return LockTimeout(
            f"segment {self.uuid!r}: stripe {stripe} (this key's bucket lock) stayed held for "
            f"{waited:.1f} s by {describe_stripe_holder(self._seg, stripe)}; a stripe is held "
            "for microseconds, so its holder is stopped, stuck, or the lock word is corrupt")

    def _hit_bytes_full(self, key: Key) -> Optional[bytes]:
        """A Ready entry's bytes (pin, copy, release; no Handle), or None for anything else
        (which the caller takes through get()).  Counts only a hit.  A slot that stays claimed
        (BUSY) may be a dead rank's unchecked claim on a Ready entry (crash window
        `claim_unchecked`): dead ranks are recovered if that needs no wait (I5), and the key is
        looked at again, so a process that only reads is not left without the entry until
        another process's slow path recovers it."""
        if self._ctx is None:
            self._check_usable()
        if type(key) is bytes and len(key) == 16:
            block_id, offset = key, 0
        else:
            block_id, offset = split_key(key)
        r = self._hit_answer(block_id, offset)
        if (r == -lib.UCM_BUSY and self._claimant_dead(block_id, _offsets_of(offset), 1)
                and self._recover(0.0).count):
            r = self._hit_answer(block_id, offset)
        return r if isinstance(r, bytes) else None

    def _claimant_dead(self, ids: bytes, offsets: Any, n: int) -> bool:
        """After a read answered BUSY: whether one of its keys' slots is claimed by a dead
        rank (its life lock free), whose claim stays until a recovery (ucm_claimant_dead).  A
        live claimant's claim ends by itself: no recovery scan for it."""
        r = lib.ucm_claimant_dead(self._ctx_now(), ids, offsets, n, self._seg.lock_fd,
                                  LIFE_LOCK_BYTE0)
        if r < 0:
            raise OSError(-r, os.strerror(-r), "OFD lock probe")
        return r == 1

    def _hit_answer(self, block_id: bytes, offset: int) -> Union[bytes, int]:
        """One look of _hit_bytes_full: a Ready entry's bytes, or the look's answer."""
        ctx = self._ctx
        if ctx is None:
            self._check_usable()
        # The pin is named by the C step's in-flight record until released, so an exception
        # anywhere drops it (see get()).
        ticket = _next_ticket()
        try:
            r = lib.ucm_lookup_pin(ctx, block_id, offset, FAST_SPIN, lib.UCM_OUTER_HIT_ONLY,
                                   ticket)
            if r >= 0:
                slot, length, _ = decode_pin(r)
                if length >= 0:                     # Ready
                    assert self._ro is not None     # set while _ctx is
                    o = self._data_off + slot * self._stride
                    value = self._ro[o:o + length].tobytes()
        except BaseException:
            lib.ucm_abandon_inflight(ctx, ticket)
            raise
        if r >= 0:
            lib.ucm_release(ctx, slot)  # no call between the try and this one
            if length >= 0:
                return value
        return r

    # ---------------------------------------------------------------- delete (DESIGN 4.13)

    def delete(self, key: Key, *, timeout: Optional[float] = None) -> bool:
        """Remove key's Ready entry.  True if this call deleted it; False if there was none,
        or the key is being loaded (Loading: a load in flight is never cut short, its owner
        publishes as usual and its waiters get its value; delete again once it is Ready).

        The entry is invisible to every process when this returns (get, exist, ``in`` miss;
        the next get of the key elects an owner and loads into another slot) and out of
        ``len()``/``entry_count()``/``size_bytes()`` exactly.  Holders of the entry (handles,
        views, arrays made from them, in any process) keep its bytes: its slot is reused only
        after the last of them lets go.  Waits only for the key's stripe and, when another
        rank's install or load is in flight in the entry's arena, for that arena (up to
        ``timeout``, or DELETE_WAIT s: LockTimeout).  Crash-safe: a deleter killed inside the
        step leaves a mark that recovery finishes (DESIGN 5.8).  With a tier 2 beneath the
        cache it raises Unsupported (the tier would serve the bytes again)."""
        block_id, offset, timeout = self._delete_args(key, timeout)
        return self._delete_one(block_id, offset, timeout)

    def delete_many(self, keys: Iterable[Key], *, timeout: Optional[float] = None) -> List[bool]:
        """delete() of each key, in order: a list of bools (a key twice: True, then False).
        Every key is checked before any is deleted; ``timeout`` bounds each key's wait."""
        timeout = self._delete_args(None, timeout)[2]
        parsed = [split_key(k) for k in keys]  # TypeError/ValueError before any shared word
        return [self._delete_one(block_id, offset, timeout) for block_id, offset in parsed]

    def _delete_args(self, key: Any, timeout: Optional[float]):
        """Everything a delete can refuse, refused before any shared word changes: the key
        split (None for None) and the timeout checked (inf: None), (block_id, offset, timeout)."""
        if self._ctx is None:
            self._check_usable()
        timeout = check_timeout(timeout)
        if self._tier is not None:
            raise Unsupported(
                f"segment {self.uuid!r}: delete with a tier 2 beneath the cache is not "
                "supported: the tier keeps the value, and the next get would be served it again")
        return (None, None, timeout) if key is None else (*split_key(key), timeout)

    def _delete_one(self, block_id: bytes, offset: int, timeout: Optional[float]) -> bool:
        """One key: the C step (ucm_delete: find, pin, mark, unlink, uncount, under the key's
        stripe; I2 and I4) and what to do when it cannot.  Its entry's arena not ours: take it
        (I6: only the arena's writer changes its words), delete, give it back.  The arena busy
        (another rank's install or load in flight there, or another deleter took it): look
        again with bounded, jittered backoff, so two deleters taking it in turn both finish.
        The key's slot claimed under our stripe: a dead claimant, recovered as get does."""
        ctx = self._ctx
        arena_out = ffi.new("uint32_t *")
        start = time.monotonic()
        deadline = start + (DELETE_WAIT if timeout is None else max(timeout, MIN_LOCK_WAIT))
        stripe_deadline = start + _stripe_wait(timeout)
        taken: List[int] = []
        delay = 0.0005
        # Dead ranks are recovered on every round the arena stays busy or the slot claimed: a
        # rank may die while we wait, or another process may hold its life lock at our first
        # try, or a dead deleter's mark may need a stripe a live thread holds for a moment
        # (I5).  A recovery that finds nobody dead costs a trylock per rank; each stripe it
        # waits for, RECOVER_SLICE at most (a dead deleter's entries may need several).
        unfinished: List[str] = []
        try:
            while True:
                left = max(0.0, stripe_deadline - time.monotonic())
                r = lib.ucm_delete(ctx, block_id, offset, SLOW_SPIN, max(1, int(left * 1e9)),
                                   arena_out)
                if r == lib.UCM_OK:
                    return True
                if r in (lib.UCM_MISS, lib.UCM_IN_FLIGHT):
                    return False
                if r == lib.UCM_TIMEOUT:
                    stripe = lib.ucm_stripe_of(ctx, lib.ucm_bucket_of(ctx, block_id, offset))
                    raise self._stripe_timeout(stripe, time.monotonic() - start)
                if r == lib.UCM_NOT_HELD:
                    a = arena_out[0]
                    if a == lib.UCM_NIL:  # closed under us (another thread)
                        self._check_usable()
                        raise NotAttached("this SlotCache is closed")
                    if self._arenas.take_for_delete(a):
                        taken.append(a)
                        if taken.count(a) == 1:
                            continue  # first take: verified by the step at once, if idle
                    # Busy (or taken in turn by other deleters): maybe a dead rank's load or
                    # mark is what keeps it (I5, I6).
                    report = self._recover(min(RECOVER_SLICE, max(0.0, deadline - time.monotonic())))
                    unfinished = report.failed
                    if report.count and time.monotonic() < deadline:
                        continue
                elif r == lib.UCM_BUSY:
                    # The key's slot claimed under our stripe (a dead claimant, as in get), or
                    # marked by a dead deleter: its recovery finishes or drops that mark.
                    report = self._recover(min(RECOVER_SLICE, max(0.0, deadline - time.monotonic())))
                    unfinished = report.failed
                    if report.count and time.monotonic() < deadline:
                        continue
                else:
                    raise CorruptSegment(
                        f"segment {self.uuid!r}: delete found inconsistent chain links or a "
                        f"broken stripe lock ({code_name(r)}); `ucmcache verify {self.uuid}` "
                        "lists what is broken")
                now = time.monotonic()
                if now >= deadline:
                    what = ("its slot stayed claimed by a rank that neither finished nor died, "
                            "or marked by a dead deleter whose recovery did not finish"
                            if r == lib.UCM_BUSY else
                            f"its arena {arena_out[0]} stayed busy (another rank's install or "
                            "load in flight there, or other deleters taking it)"
                            + (f"; a dead rank's recovery could not finish: "
                               f"{'; '.join(unfinished)}" if unfinished else ""))
                    raise LockTimeout(f"segment {self.uuid!r}: delete gave up after "
                                      f"{now - start:.2f} s: {what}")
                time.sleep(min(delay * (0.5 + random.random()), deadline - now))
                delay = min(delay * 2, 0.05)
        finally:
            for a in dict.fromkeys(taken):
                self._arenas.give_back(a)

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
        """Counters summed over ranks, plus ``per_rank`` rows; see ucmcache.core.stats."""
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
    # get_many's side of this is _ask_tier_many, beside it in _batches.

    def _ask_tier(self, h: Handle, block_id: bytes, offset: int,
                  timeout: Optional[float], put: bool = False) -> None:
        """get(): h owns a cold slot.  When the tier has the value, h publishes it and becomes
        a reader of it; else h stays the owner (the tier may hold a lease for its slot).
        ``put``: h is put()'s, whose value is the caller's: the tier's put, not its lookup."""
        # Waiting for another node is safe only when this caller owns no other load.
        assert self._tier is not None   # asked only under a tier (get's miss checks)
        ask = self._tier.put if put else self._tier.lookup
        (payload,) = ask([(h._slot, block_id, offset)],
                         not owns_loads_besides(self, {h._slot}), timeout)
        if payload is not None:
            h._served(payload)

    def _count(self, counter: int, n: int) -> None:
        """Add n to one of this rank's shared counters (the tier's UCM_ST_T2_*)."""
        ctx = self._ctx
        if ctx is not None and n:
            lib.ucm_stat_add(ctx, counter, n)

    # ---------------------------------------------------------------- test hooks

    def _arm(self, point: str, action: str = "gate", gate: Optional[_hooks.Gate] = None) -> None:
        """Arm a named point (ucmcache.core.hooks.POINTS) in this process: hold at a gate, or kill."""
        self._check_usable()
        actions = {"none": lib.UCM_ACT_NONE, "gate": lib.UCM_ACT_GATE, "kill": lib.UCM_ACT_KILL}
        if action not in actions:
            raise ValueError(f"action must be one of {sorted(actions)}, got {action!r}")
        if action == "gate" and gate is None:
            raise ValueError("a gate action needs a Gate")
        if point in _hooks.C_POINTS:
            # The core keeps the gate word's address: the Gate (its mapping) lives as long as
            # the point is armed, even if the caller dropped it.
            self._armed_gates[point] = gate
            word = gate.word if gate is not None else ffi.NULL
            t = int((gate.timeout if gate is not None else 0) * 1e9)
            lib.ucm_ctx_set_point(self._ctx, _hooks.C_POINTS[point], actions[action], word, t)
        else:
            _hooks.arm_python(point, action, gate)

    def __repr__(self) -> str:
        state = "attached" if self._ctx is not None else self._why_unusable or "closed"
        return (f"<SlotCache {self.uuid!r} rank={getattr(self, '_rank', None)} "
                f"slots={self._layout.n_slots}x{self._layout.slot_size}B {state}>")


def _offsets_of(offset: int) -> Any:
    """One key's offset for a C step taking an offsets array (NULL: offset 0)."""
    return ffi.NULL if offset == 0 else ffi.new("uint64_t[1]", [offset])


def _check_same_params(seg: Segment, want: Layout) -> None:
    have = seg.layout
    for field in ("max_ranks", "slots_per_rank", "slot_size", "n_buckets", "n_stripes"):
        if getattr(have, field) != getattr(want, field):
            seg.detach()
            raise IncompatibleSegment(
                f"segment {seg.uuid!r} exists with {field}={getattr(have, field)}, "
                f"asked for {getattr(want, field)}")
