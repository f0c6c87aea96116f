"""Single flight and the wait (DESIGN 4.5, 4.6): get_or_load, aget_or_load, and the wait on a
slot another caller is loading.  Mixed into SlotCache (``_cache``), whose ``get`` elects the
owner; this module only decides what a caller does with the handle it got: load and publish,
or wait (bounded, never spinning, recovering a dead loader) and read.
"""
from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, Callable, Optional

from . import hooks as _hooks
from .._core import ffi, lib
from .errors import CacheFull, CorruptSegment
from .results import code_name
from .segment import LIFE_LOCK_BYTE0
from .keys import Key
from .recovery import rank_alive
from .drivers import LOAD, WAIT_HANDLE, Steps, run_async, run_blocking
from .slots import as_value_view, check_timeout, isolate_owned, still_loading

LIVENESS_SLICE = 0.5    # a waiter checks that the loader still lives this often (seconds)
LIVENESS_NS = int(LIVENESS_SLICE * 1e9)
CANCEL_SLICE = 0.02     # an async wait's thread looks at its cancel flag this often (seconds)
CANCEL_NS = int(CANCEL_SLICE * 1e9)


if TYPE_CHECKING:
    from .cache_core import CacheCore
else:
    CacheCore = object  # the seam is for the type checker only


class SingleFlight(CacheCore):
    """SlotCache's loading calls.  A mixin: it uses the cache's get, _hit_bytes, _recover and
    its attributes (_ctx, _rank, _seg, _layout), and adds no state of its own."""

    # get_or_load(key, loader, *, timeout=None) -> bytes and aget_or_load (a coroutine) are
    # CacheBase's (csrc/ucm_hit.c): a hit in C (aget_or_load's a coroutine finished in its
    # first step), anything else here.  Each decision below is written once, as a core that
    # yields what it waits for (_drivers): get_or_load runs it with blocking calls, aget_or_load
    # with awaits (its loader may be a coroutine function).

    def _get_or_load_full(self, key: Key, loader: Callable[[], Any], *,
                          timeout: Optional[float] = None) -> bytes:
        """get_or_load() for everything but a plain hit (see CacheBase.get_or_load)."""
        timeout = check_timeout(timeout)  # on a hit too (inf: None, no deadline)
        value = self._loader_then_hit(key, loader, "a callable")
        return value if value is not None else run_blocking(self._missed(key, loader, timeout))

    async def _aget_or_load_full(self, key: Key, loader: Callable[[], Any], *,
                                 timeout: Optional[float] = None) -> bytes:
        """aget_or_load() for everything but a plain hit (see CacheBase.aget_or_load)."""
        timeout = check_timeout(timeout)  # on a hit too (inf: None, no deadline)
        value = self._loader_then_hit(key, loader, "a callable or a coroutine function")
        if value is not None:
            return value
        isolate_owned()  # as _aget_or_load_missed
        return await run_async(self._missed(key, loader, timeout))

    def _get_or_load_missed(self, key: Key, loader: Callable[[], Any], *,
                            timeout: Optional[float] = None) -> bytes:
        """get_or_load() once a hit was looked for (in C) and not found."""
        return run_blocking(self._missed(key, loader, timeout))

    async def _aget_or_load_missed(self, key: Key, loader: Callable[[], Any], *,
                                   timeout: Optional[float] = None) -> bytes:
        """aget_or_load() once a hit was looked for (in C) and not found."""
        isolate_owned()  # the task's own record, once: sibling tasks do not see its loads
        return await run_async(self._missed(key, loader, timeout))

    def _get_or_load_cold(self, key: bytes, loader: Callable[[], Any], answer: int = 0,
                          since_ns: int = -1, *, timeout: None = None) -> bytes:
        """get_or_load() of a plain id the C path looked for, missed and counted as a request:
        the slow path at once (no second look), where the C step's answer was not a pin (or a
        tier is beneath the cache) and the full path decides.  ``answer``/``since_ns``: the C
        step's (cold_load), its first step's (see _pin_slow)."""
        return run_blocking(self._cold(key, loader, answer, since_ns))

    def _get_or_load_joined(self, h: Any) -> bytes:
        """get_or_load() whose C slow step joined another caller's load: h holds the pin."""
        return run_blocking(self._load_or_wait(h, None, None))

    # ---------------------------------------------------------------- the cores (_drivers)

    def _loader_then_hit(self, key: Key, loader: Any, what: str) -> Optional[bytes]:
        """The full path's first steps: the loader checked, then a hit's bytes (or None)."""
        if not callable(loader):
            raise TypeError(f"loader must be {what} returning bytes, got "
                            f"{type(loader).__name__}")
        return self._hit_bytes(key)

    # _missed and _cold take their pin inside the core, once the driver runs it within its
    # try, and enter its handle at once (_in_handle): a signal handler's exception at the
    # driver's first line finds no pin taken (one taken before would stay, with the unstarted
    # core that holds its handle, for as long as the exception's traceback is kept).

    def _missed(self, key: Key, loader: Callable[[], Any],
                timeout: Optional[float]) -> Steps[bytes]:
        """A hit was looked for and not found: get's full path elects an owner or joins."""
        try:
            h = self._get_full(key, timeout=timeout)  # (get() would look for the hit again)
        except CacheFull:
            h = None  # the bypass runs after the except: a loader's error is not chained to it
        if h is None:
            return (yield from self._bypass(loader))
        with h:
            return (yield from self._in_handle(h, loader, timeout))

    def _cold(self, key: bytes, loader: Callable[[], Any], answer: int,
              since_ns: int) -> Steps[bytes]:
        """_missed after the C slow step's answer (see _get_or_load_cold)."""
        try:
            h = self._get_missed(key, answer, since_ns)
        except CacheFull:
            h = None  # as in _missed
        if h is None:
            return (yield from self._bypass(loader))
        with h:
            return (yield from self._in_handle(h, loader, None))

    def _bypass(self, loader: Callable[[], Any]) -> Steps[bytes]:
        """No slot to be had (CacheFull): the loader runs uncached, counted as a bypass."""
        lib.ucm_stat_add(self._ctx, lib.UCM_ST_BYPASSES, 1)
        value = yield (LOAD, loader, None)
        return as_value_view(value, self._layout.slot_size).tobytes()

    def _load_or_wait(self, h: Any, loader: Optional[Callable[[], Any]],
                      timeout: Optional[float]) -> Steps[bytes]:
        """_in_handle with h entered: closes h."""
        with h:
            return (yield from self._in_handle(h, loader, timeout))

    def _in_handle(self, h: Any, loader: Optional[Callable[[], Any]],
                   timeout: Optional[float]) -> Steps[bytes]:
        """An owner loads and publishes; any other waits (bounded) and reads.  h is entered by
        the caller, its ``with`` the statement right after the step that made h: CPython 3.11+
        runs signal handlers at calls and backward jumps, none of which lies between the two,
        so a handler's exception never finds h made and not entered."""
        if not h.owner:
            yield (WAIT_HANDLE, h, timeout)
            return bytes(h.data)
        # an owner always came with its loader: a join (loader None) never owns its slot
        assert loader is not None
        if _hooks._armed:
            _hooks.fire("inside_loader")
        try:
            value = yield (LOAD, loader, None)
            # The immutable bytes first: a writable value (bytearray, numpy) another thread
            # rewrites cannot make the slot differ from what we return.
            data = as_value_view(value, self._layout.slot_size).tobytes()
        except BaseException as e:  # CancelledError included: the load fails, waiters learn
            # Published Failed by the load's serial (I4): every waiter wakes to LoadFailed.
            h.fail(f"{type(e).__name__}: {e}")
            raise
        h.data[: len(data)] = data
        h.ready(len(data))
        return data

    def _wait_ready(self, slot: int, timeout: Optional[float], counted: bool,
                    cancel: Optional[threading.Event] = None) -> int:
        """_wait_loaded's loop: the wait is one C step per slice (ucm_wait_ready: the futex
        slice, the loader's life lock, the deadline, a final answer's counters), so nothing but
        this frame's return runs between the wake-up and the caller.  The step answers SLICE at
        each slice's end, or when a signal interrupted it, with the loader alive: back here, so
        the interpreter runs the signal handlers (a KeyboardInterrupt ends the wait), then the
        step again with the same start and deadline (a ``cancel`` flag is looked at before
        each step).
        It answers OWNERDEAD when the loader's life lock looks free: recovered here (it fails
        the load, waking everyone), then the step again, which answers the new state at once.
        A wait that counted ``waits`` counts its time exactly once, in the ``finally`` (one C
        step, ucm_wait_end, that reads the clock itself): the steps are given no start (-1),
        so C counts nothing, and no signal handler raising between a step's return and this
        frame (the eval-breaker check after a call) can make a count twice or not at all.
        ``waits`` is the try's first call: no handler runs before it in the try (none runs
        before a call to C), so the time is counted exactly when ``waits`` was."""
        ctx = self._ctx
        state = ffi.new("uint32_t *")
        t0 = lib.ucm_now_ns()
        deadline = -1 if timeout is None else t0 + int(timeout * 1e9)
        slice_ns = LIVENESS_NS if cancel is None else CANCEL_NS
        r = lib.UCM_SLICE
        try:
            if counted:
                lib.ucm_stat_add(ctx, lib.UCM_ST_WAITS, 1)
            while True:
                if cancel is not None and cancel.is_set():
                    return lib.UCM_LOADING  # abandoned (the load goes on)
                r = lib.ucm_wait_ready(ctx, slot, deadline, slice_ns, self._seg.lock_fd,
                                       LIFE_LOCK_BYTE0, -1, state)
                if r == lib.UCM_OK:
                    return state[0]
                if r == lib.UCM_TIMEOUT:
                    raise still_loading(timeout)
                if r == lib.UCM_SLICE:
                    continue  # the signal handlers run here, between two steps
                if r != lib.UCM_OWNERDEAD:
                    raise CorruptSegment(f"segment {self.uuid!r}: a wait found slot {slot} out "
                                         f"of range ({code_name(r)})")
                self._recover_loader(slot, deadline)
        finally:
            if counted:  # however it ended (a final answer, a handler's or a recovery's raise)
                lib.ucm_wait_end(ctx, t0, r == lib.UCM_TIMEOUT)

    def _recover_loader(self, slot: int, deadline: int) -> None:
        """ucm_wait_ready answered OWNERDEAD (the loader's life lock looked free): if the
        loader is another rank and really dead, recover it (which fails its loads, this one
        included, waking every waiter), bounded by the wait's deadline (ucm_now_ns; < 0:
        none).  Called by _wait_ready and by HandleBase.wait in C, which then wait again."""
        loader = lib.ucm_slot_loader(self._ctx, slot)
        if loader != self._rank and loader < self._layout.max_ranks \
                and not rank_alive(self._seg, loader):
            self._recover(LIVENESS_SLICE if deadline < 0
                          else (deadline - lib.ucm_now_ns()) / 1e9)

    def _wait_loaded(self, slot: int, timeout: Optional[float],
                     cancel: Optional[threading.Event] = None, counted: bool = True) -> int:
        """Block on the slot's state word until it leaves Loading, never past ``timeout`` and
        never spinning.  Every LIVENESS_SLICE the loader's life lock is checked, so a dead
        loader is recovered rather than waited for.  ``cancel`` (set): returns UCM_LOADING
        within a CANCEL_SLICE (an abandoned async wait).  ``counted`` False: the shared wait of
        a loop's tasks, each of which counts its own (wait_loaded_async)."""
        return self._wait_ready(slot, timeout, counted, cancel)
