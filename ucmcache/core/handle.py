"""Handle: one pinned slot, held by a context manager; HandleBatch: a request's pins.

A handle is the lifetime of one pin (DESIGN 4): the slot cannot be reclaimed while it is open,
so handles are not copyable.  The views it hands out hold pins of their own (a SlotBuffer,
csrc/ucm_hit.c): a view, and every slice, cast, numpy array or tensor made from it, shows its
key's bytes for as long as it lives, after the handle closed too.  The owner of a Loading slot
fills it and publishes it with ready() or fail(); closing an owner's handle (or dropping it)
without either publishes Failed so that no waiter waits forever.  The rules about a slot
itself live in ucmcache/_slots.py.
"""
from __future__ import annotations

import collections.abc
import functools
import time
from typing import TYPE_CHECKING, Any, Iterable, Optional, Sequence, Union

import numpy as np

from .buffers import check_rows, rows_of
from .._core import ffi, lib
from .drivers import WAIT_LOADED, Steps, run_async, run_blocking
from .._hit import BatchBase, HandleBase, Ready, bind
from .errors import HandleClosed, LoadFailed, UcmError
from .slots import (STATE_NAMES, UNPUBLISHED, _now, _owned_slots, as_array, check_timeout,
                     exit_message, failure_message, fill, observe_load, owns_load,
                     answer_message, publish_failed, publish_ready, publish_ready_many,
                     ready_length,
                     ready_lengths, release_views, slot_length,
                     slot_view, write_through)

SlotCache = Any  # see ucmcache/_slots.py: not imported


class _Pins:
    """What every holder of pins shares: it closes when collected (the finalizers of HandleBase
    and BatchBase, in C), and is never copied (a copy would release the same pins twice) or
    pickled (pins belong to this process)."""

    __slots__ = ()
    _what = "pins"

    if TYPE_CHECKING:   # what HandleBase or BatchBase (C) and the subclass provide
        _closed: Any
        _cache: Any
        def _drop_pins(self, message: bytes, /) -> bool: ...
        def _owned_loads(self) -> Iterable[int]: ...
        def _after_drop(self) -> None: ...

    def __copy__(self):
        raise TypeError(f"a {type(self).__name__} holds {self._what} and cannot be copied")

    def __deepcopy__(self, memo):
        self.__copy__()

    def __reduce__(self):
        raise TypeError(f"a {type(self).__name__} holds {self._what} in this process and cannot "
                        "be pickled")

    def _close(self, message: bytes) -> None:
        # The pins are dropped by one C step (_drop_pins, HandleBase's or BatchBase's: closed
        # and uncounted first, then the token's drop, which fails an owner's unpublished loads,
        # or ucm_release) with no Python code before it; only bookkeeping that cannot leak a
        # hold follows (_after_drop).  Under a tier, owned loads' leases go first (see
        # tier_owner in C): once a pin drops, another get may own the slot's next load and its
        # lease.
        if self._closed:
            return
        cache = self._cache
        leased = self._owned_loads() if cache._ctx is not None and cache._tier is not None else ()
        if leased:
            try:
                for slot in leased:
                    cache._tier.abandon(slot)
            finally:
                if self._drop_pins(message):
                    self._after_drop()
            return
        if self._drop_pins(message):
            self._after_drop()


class Handle(HandleBase, _Pins):
    """A pinned slot.  Use as a context manager; see SlotCache.get."""

    __slots__ = ()
    _what = "one pin"

    # The fields live in HandleBase (csrc/ucm_hit.c), which also runs a hit's handle: made by
    # SlotCache.get in C, entered, read (data) and exited with no Python frame.  The full path
    # (SlotCache._get_full) builds handles itself: an inert one (_closed True) before the
    # pinning C call, its fields stored after it with no call in between.  Fields:
    #   _published  an owner's ready()/fail() went through
    #   _owned      the owned set of the context that became owner (see own()): whichever
    #               thread publishes or closes, the slot leaves this set
    #   _nbytes     the payload length of a slot Ready when pinned (from the pin's answer;
    #               fixed while pinned), -1 until known
    #   _view       the read-only view of the payload, made once (it and whatever is made
    #               from it keep the slot pinned while they live); _views: an owner's
    #               writable views, released when its load ends (ready, fail, close).

    def own(self) -> None:
        """Record an owner's slot in its context's owned set (a waiter in this context on the
        same slot would wait for itself), and when its load began (the load-time histogram)."""
        self._t0 = time.monotonic_ns()
        self._owned = _owned_slots(self._cache)
        self._owned.add(self._slot)

    # ---------------------------------------------------------------- state

    @property
    def slot(self) -> int:
        return self._slot

    @property
    def state(self) -> str:
        """'loading', 'ready' or 'failed', read from the shared state word now."""
        self._check_open()
        return STATE_NAMES[lib.ucm_slot_state(self._cache._ctx, self._slot)]

    @property
    def nbytes(self) -> int:
        """The published payload length (0 while loading)."""
        self._check_open()
        if self._nbytes >= 0:
            return self._nbytes
        return slot_length(self._cache, self._slot)

    def _check_open(self) -> None:
        if self._closed:
            raise HandleClosed("this handle is closed: its slot is no longer pinned")
        if self._cache._ctx is None:
            self._cache._check_usable()

    # ---------------------------------------------------------------- data

    def _data_slow(self) -> memoryview:
        """data (HandleBase) for everything but an open hit's: closed (or a forked child's
        copy), an owner's writable slot, a slot that was not Ready when pinned."""
        cache = self._cache
        if self._closed or cache._ctx is None:
            self._check_open()  # first: a forked child's copy gets no view, not even a made one
        v = self._view
        if v is not None:
            return v  # made once
        n = self._nbytes
        if n >= 0:  # Ready when pinned (the hit path): its length came with the pin
            v = self._view = cache._slot_view(self._slot, n, False)
            return v
        if self._owner and not self._published:  # ours and Loading until we publish it
            if self._views is None:
                self._views = []
            return slot_view(cache, self._slot, cache._layout.slot_size, True, self._views)
        # Not Ready when pinned (a join, or our own published load): look now.
        n = self._nbytes = ready_length(cache, self._slot)
        v = self._view = cache._slot_view(self._slot, n, False)
        return v

    def array(self, dtype, shape=None) -> np.ndarray:
        """A numpy view of data (see data); shape defaults to as many items as fit."""
        return as_array(self.data, dtype, shape)

    def _failure_message(self) -> str:
        return failure_message(self._cache, self._slot)

    # ---------------------------------------------------------------- owner

    # ready(nbytes=None) is HandleBase's (csrc/ucm_hit.c): one core step for an owner whose get
    # took its cold key in C, anything else here.

    def _ready_full(self, nbytes: Optional[int] = None) -> None:
        """ready() (HandleBase) for everything but a C-made owner's plain publish."""
        self._check_open()
        n = publish_ready(self._cache, self._slot, self._serial, self._owner, nbytes)
        self._published = True
        observe_load(self._cache, self._t0)
        if self._owned is not None:
            self._owned.discard(self._slot)
        self._release_views()  # the owner's writable view ends with the load
        if self._cache._tier is not None:
            write_through(self._cache, self._slot, n)

    def _served(self, payload: memoryview) -> None:
        """The cache's tier had this owner's value: publish it Ready through the normal path,
        and this handle becomes a reader of it (no longer the owner, nothing to write through)."""
        fill(self._cache, self._slot, self._serial, payload)
        self._owner = False
        self._published = True
        self._owned.discard(self._slot)

    def fail(self, message: str = "load failed") -> None:
        """Publish the slot as Failed; current waiters get LoadFailed(message)."""
        self._check_open()
        publish_failed(self._cache, self._slot, self._serial, self._owner, message)
        self._published = True
        observe_load(self._cache, self._t0)
        if self._owned is not None:
            self._owned.discard(self._slot)
        self._release_views()

    # ---------------------------------------------------------------- waiting

    # wait(timeout=None) is HandleBase's (csrc/ucm_hit.c): a reader's wait on a Loading slot is
    # one C step there (ucm_wait_ready, the GIL released), and the wake-up returns self with no
    # Python frame; anything else here.

    def _wait_full(self, timeout: Optional[float] = None) -> "Handle":
        """wait() (HandleBase) for everything but a reader's plain wait: a closed handle, an
        owner, a timeout to name, a slot this context loads, a Failed load."""
        return run_blocking(self._waited(timeout, "thread"))

    async def wait_async(self, timeout: Optional[float] = None) -> "Handle":
        """wait() for asyncio: the futex wait runs in a thread, so the event loop goes on.
        Cancelling the awaiting task abandons the wait (the load goes on)."""
        return await run_async(self._waited(timeout, "task"))

    def _waited(self, timeout: Optional[float], waiter: str) -> Steps["Handle"]:
        """wait()'s decisions, for either driver (_drivers); ``waiter`` names who would wait
        for itself ("thread", "task")."""
        self._check_open()
        timeout = self._timeout if timeout is None else check_timeout(timeout)
        st = lib.ucm_slot_state(self._cache._ctx, self._slot)
        if st == lib.UCM_LOADING:
            if self._owner:
                raise UcmError("the owner of a loading slot cannot wait for it: call ready() or "
                               "fail()")
            if owns_load(self._cache, self._slot):
                raise UcmError(f"this {waiter} or a thread or task sharing its context "
                               "(asyncio.to_thread, copy_context().run) is loading this key: "
                               "a loader asking for its own key would wait for ever")
            st = yield (WAIT_LOADED, self, timeout)
        if st == lib.UCM_READY:
            return self
        raise LoadFailed(self._failure_message())

    # ---------------------------------------------------------------- close

    def _release_views(self) -> None:
        """The owner's writable views end with its load (released: unreadable, unless a
        numpy array or a slice of one still holds it, whose pin then keeps the slot).  The
        read-only view is only let go: it keeps its own pin while anything holds it."""
        views = self._views
        if views:
            self._views = None
            release_views(views)
        self._view = None

    def _owned_loads(self) -> tuple:
        """The slot whose load this handle owns (its tier lease goes before the pin)."""
        return (self._slot,) if self._owner else ()

    def _after_drop(self) -> None:
        """What a close does after its pin is dropped (see _Pins._close)."""
        if self._owned is not None:
            self._owned.discard(self._slot)
        self._release_views()

    def _exit_slow(self, exc_type, exc, tb) -> None:
        """__exit__ (HandleBase) for everything but a hit's plain exit: an owner's or a
        slow-path pin's handle, or a with-block that raised."""
        self._close(UNPUBLISHED if exc is None else exit_message(exc_type, exc))

    def __repr__(self) -> str:
        if self._closed:
            return "<Handle closed>"
        return (f"<Handle slot={self._slot} owner={self._owner} "
                f"state={STATE_NAMES[lib.ucm_slot_state(self._cache._ctx, self._slot)]}>")


class _NoOwned(frozenset):
    """An all-hit batch's owned set (HandleBatch.own replaces it): nothing to discard."""

    def discard(self, _slot) -> None:
        pass


_NO_OWNED = _NoOwned()


class HandleBatch(BatchBase, _Pins):
    """The pins of one request's keys: one C call pins them all, one releases them all.

    ``owner`` and ``state`` are numpy arrays over the positions (copies); a key that appears
    twice is pinned twice and owned (if it was cold) by its first position only.
    """

    # The fields the C paths read live in BatchBase (csrc/ucm_hit.c), which also runs an
    # all-hit batch: made by SlotCache.get_many in C (one core step pins every key Ready, or
    # none), read (data, gather) and closed with no Python frame.  The full path
    # (SlotCache._get_many_full) builds batches as get builds handles: inert first, the C calls
    # pin straight into _slots/_owner (through _slots_p/_owner_p), the fields are stored after.
    # _views: None, or one read-only view per position (made once); _owner_views: position ->
    # the owner's writable views; _any_owner False: an all-hit batch skips the owner
    # bookkeeping.  `owner` is a copy of _owner: close() trusts the batch's own array.

    def own(self) -> None:
        """Record the owned positions in the owning context's set (see Handle.own)."""
        self._t0 = time.monotonic_ns()
        self._owned = _owned_slots(self._cache)
        for s in self._slots[self._owner]:
            self._owned.add(int(s))

    def __len__(self) -> int:
        return len(self._slots)

    def _check_open(self) -> None:
        if self._closed:
            raise HandleClosed("this batch is closed: its slots are no longer pinned")
        if self._cache._ctx is None:
            self._cache._check_usable()

    def _index(self, i: int) -> int:
        n = len(self._slots)
        if isinstance(i, bool) or not isinstance(i, (int, np.integer)) or not -n <= i < n:
            raise IndexError(f"batch position must be an int in [0, {n}), got {i!r}")
        return int(i) % n

    @property
    def slots(self) -> np.ndarray:
        return self._slots.copy()

    @property
    def state(self) -> np.ndarray:
        """Each position's state now: 'loading', 'ready' or 'failed'."""
        self._check_open()
        ctx = self._cache._ctx
        return np.array([STATE_NAMES[lib.ucm_slot_state(ctx, int(s))] for s in self._slots])

    def _data_slow(self, i: int) -> memoryview:
        """data(i) (BatchBase) for everything but a position Ready when pinned, read from an
        open batch: closed, an index that is not a plain int in range, an owned position, a
        position joined while Loading."""
        if self._closed:
            self._check_open()
        i = self._index(i)
        cache = self._cache
        if cache._ctx is None:
            cache._check_usable()
        slot = int(self._slots[i])
        n = int(self._lens[i])
        if n < 0:
            if self._owner[i] and lib.ucm_slot_state(cache._ctx, slot) == lib.UCM_LOADING:
                return slot_view(cache, slot, cache._layout.slot_size, True,
                                 self._owner_views.setdefault(i, []))
            n = self._lens[i] = ready_length(cache, slot)
        views = self._views
        if views is None or len(views) != self._n:
            views = self._views = [None] * self._n
        v = views[i]
        if v is None:
            v = views[i] = cache._slot_view(slot, n, False)
        return v

    def _gather_full(self, out) -> np.ndarray:
        """gather(out) (BatchBase) for a closed batch, an empty one, or an out that is not a
        writable C-contiguous buffer (a CPU tensor, or an error to name)."""
        self._check_open()
        n = self._n
        lens = np.empty(n, dtype=np.int64)
        if n:
            ptr, row, keep = rows_of(out, n)
            slots = self._slots.copy()  # the copy's own slots and holds (see gather in C)
            slots_p = ffi.from_buffer("uint32_t[]", slots)
            lens_p = ffi.from_buffer("int64_t[]", lens)
            self._check_open()  # again: the allocations above may have closed it (finalizers)
            ctx = self._cache._ctx
            if lib.ucm_pin_again_many(ctx, slots_p, n) != lib.UCM_OK:
                raise HandleClosed("this batch is closed: its slots are no longer pinned")
            try:
                lib.ucm_gather(ctx, slots_p, n, ptr, row, lens_p)
            finally:
                lib.ucm_release_many(ctx, slots_p, n)
            del keep
            check_rows(lens, row)
        return lens

    def array(self, i: int, dtype, shape=None) -> np.ndarray:
        return as_array(self.data(i), dtype, shape)

    def _serial_of(self, i: int) -> int:
        """Position i's load serial (an owner's: what its ready(i)/fail(i) name, I4), 0 if none."""
        return 0 if self._serials is None else int(self._serials[i])

    def ready(self, i: int, nbytes: Optional[int] = None) -> None:
        self._check_open()
        i = self._index(i)
        slot = int(self._slots[i])
        n = publish_ready(self._cache, slot, self._serial_of(i), bool(self._owner[i]), nbytes)
        observe_load(self._cache, self._t0)
        self._lens[i] = -1  # looked up again by data(i), now Ready
        self._owned.discard(slot)
        release_views(self._owner_views.pop(i, []))  # the owner's writable view ends with the load
        if self._cache._tier is not None:
            write_through(self._cache, slot, n)

    def ready_many(self, positions: Sequence[int],
                   nbytes: Union[None, int, Sequence[int]] = None) -> None:
        """ready(i, nbytes) for every position in ``positions``, in one call into the core:
        each an owned load, each given once; ``nbytes`` None (each slot whole), one length for
        all, or one per position.  Every position and length is checked before anything is
        published (IndexError, TypeError, ValueError, or UcmError for a position this batch
        does not own or whose load is published already).  A load the core still refuses (a
        ready() of another thread on the same batch meanwhile, or a load no longer this
        batch's: I4) is named by the UcmError raised after the others are published."""
        self._check_open()
        idx = [self._index(i) for i in positions]
        if len(set(idx)) != len(idx):
            twice = sorted({i for i in idx if idx.count(i) > 1})
            raise ValueError(f"ready_many: positions {twice} given more than once")
        lengths = ready_lengths(self._cache, nbytes, len(idx))
        ctx = self._cache._ctx
        for i in idx:
            if not self._owner[i]:
                raise UcmError(f"ready_many() is for positions this batch owns the load of; "
                               f"position {i} is not one")
            if lib.ucm_slot_state(ctx, int(self._slots[i])) != lib.UCM_LOADING:
                raise UcmError(f"ready_many(): position {i}'s load was already published")
        at = np.array(idx, dtype=np.intp)
        slots = self._slots[at]
        serials = (self._serials[at] if self._serials is not None
                   else np.zeros(len(idx), dtype=np.uint32))
        answers = publish_ready_many(self._cache, slots, serials, lengths)
        refused = []
        cache = self._cache
        done = []
        for j, i in enumerate(idx):   # ready()'s bookkeeping, for each load published
            if answers[j] != lib.UCM_OK:
                refused.append((i, int(answers[j])))
                continue
            self._lens[i] = -1   # looked up again by data(i), now Ready
            slot = int(slots[j])
            self._owned.discard(slot)
            if self._owner_views:
                release_views(self._owner_views.pop(i, []))
            done.append(j)
        for j in done:   # after every load's own bookkeeping: a tier that raises leaves none
            observe_load(cache, self._t0)
            if cache._tier is not None:
                write_through(cache, int(slots[j]), int(lengths[j]))
        if refused:
            raise UcmError("ready_many(): " + "; ".join(
                f"position {i}: {answer_message(r)}" for i, r in refused))

    def _served(self, i: int, payload: memoryview) -> None:
        """As Handle._served, for owned position i (get_many, before the batch is returned)."""
        slot = int(self._slots[i])
        fill(self._cache, slot, self._serial_of(i), payload)
        self._owner[i] = False
        self._owned.discard(slot)

    def fail(self, i: int, message: str = "load failed") -> None:
        self._check_open()
        i = self._index(i)
        publish_failed(self._cache, int(self._slots[i]), self._serial_of(i),
                       bool(self._owner[i]), message)
        observe_load(self._cache, self._t0)
        self._owned.discard(int(self._slots[i]))
        release_views(self._owner_views.pop(i, []))

    def wait(self, timeout: Optional[float] = None) -> "HandleBatch":
        """Wait for every position that another caller is loading.  Raises LoadFailed for the
        first that failed, TimeoutError if the time runs out (the loads go on)."""
        self._check_open()
        timeout = self._timeout if timeout is None else check_timeout(timeout)
        cache = self._cache
        mine = set(int(s) for s in self._slots[self._owner])
        deadline = None if timeout is None else _now() + timeout
        for s in self._slots:
            s = int(s)
            if s in mine:
                continue  # ours to fill: waiting would never end
            st = lib.ucm_slot_state(cache._ctx, s)
            if st == lib.UCM_LOADING:
                if owns_load(cache, s):
                    raise UcmError("this thread or a thread or task sharing its context is "
                                   "loading one of these keys: a loader asking for its own "
                                   "key would wait for ever")
                left = None if deadline is None else max(0.0, deadline - _now())
                st = cache._wait_loaded(s, left)
            if st != lib.UCM_READY:
                raise LoadFailed(failure_message(cache, s))
        return self

    def _owned_loads(self) -> list:
        """The slots of the owned positions (their tier leases go before the pins; ready()
        took the published ones')."""
        return [int(s) for s in self._slots[self._owner]] if self._any_owner else []

    def _after_drop(self) -> None:
        """What a close does after its pins are dropped (see _Pins._close)."""
        if self._any_owner:
            for s in self._slots[self._owner]:
                self._owned.discard(int(s))
        if self._owner_views:
            for views in self._owner_views.values():
                release_views(views)
            self._owner_views = {}

    def _exit_slow(self, exc_type, exc, tb) -> None:
        """__exit__ (BatchBase) for a batch with a token, or a with-block that raised."""
        self._close(UNPUBLISHED if exc is None else exit_message(exc_type, exc))


# The hit path in C (csrc/ucm_hit.c) calls the core's steps at their addresses in ucmcache._core
# (one copy of the core), and makes Handles and HandleBatches of these classes.
bind(steps={name: int(ffi.cast("uintptr_t", ffi.addressof(lib, name)))
            for name in ("ucm_lookup_pin", "ucm_release", "ucm_slot_data", "ucm_copy_payload",
                         "ucm_ctx_points_set", "ucm_read_many", "ucm_read_count",
                         "ucm_claimant_dead", "ucm_gather", "ucm_pin_all_ready",
                         "ucm_release_many", "ucm_pin_again", "ucm_pin_again_many",
                         "ucm_hold_pins")},
     addr_of=lambda p: int(ffi.cast("uintptr_t", p)), handle_type=Handle,
     batch_type=HandleBatch, new_lengths=functools.partial(np.empty, dtype=np.int64),
     new_slots=functools.partial(np.empty, dtype=np.uint32),
     new_owner=functools.partial(np.zeros, dtype=bool), no_owned=_NO_OWNED,
     unpublished=UNPUBLISHED, token_drop=lib.ucm_token_drop,
     batch_token_drop=lib.ucm_batch_token_drop)
collections.abc.Coroutine.register(Ready)  # aget_or_load's hit: asyncio takes it as a coroutine
