"""Ring: each rank's prefetch ring of keys, and the prefetcher that drains it.

A scheduler (any process) posts the keys a request will need to the ring of the rank that will
serve it; that rank's prefetcher thread loads them through the normal single-flight path, so a
prefetch racing a get of the same key runs the loader once.  Posting never blocks: keys already
Ready or Loading are skipped, and a full ring or a busy producer lock drops the batch (counted).
The prefetcher sleeps on the ring's tail word (a futex) while the ring is empty.
"""
from __future__ import annotations

import threading
from typing import Any, Callable, Dict, Optional

import numpy as np

from ._core import ffi, lib
from ._errors import CacheFull, CorruptSegment, UcmError
from ._slots import as_value_view

# The SlotCache these operations serve.  Not imported, not even for type checkers: slot
# operations sit below the cache API and never reach back into it (no import circle).
SlotCache = Any

SLEEP_SLICE = 0.2  # the longest a stop() can wait for the consumer (normally it is woken at once)


def ring_counters(seg, ring: int) -> Dict[str, int]:
    off = seg.layout.ring_off + ring * seg.layout.ring_size
    head = lib.ucm_load64(seg.base, off + lib.UCM_RING_HEAD)
    tail = lib.ucm_load32(seg.base, off + lib.UCM_RING_TAIL)
    return {
        "depth": (tail - head) % (1 << 32) if (tail - head) % (1 << 32) <= lib.UCM_RING_DEPTH
        else lib.UCM_RING_DEPTH,
        "posted": lib.ucm_load64(seg.base, off + lib.UCM_RING_POSTED),
        "dropped": lib.ucm_load64(seg.base, off + lib.UCM_RING_DROPPED),
        "already_present": lib.ucm_load64(seg.base, off + lib.UCM_RING_PRESENT),
    }


class Prefetcher:
    """A thread draining this rank's ring: ``loader(key) -> bytes`` fills each cold key."""

    def __init__(self, cache: "SlotCache", loader: Callable[[Any], Any], batch: int = 64):
        if not callable(loader):
            raise TypeError(f"loader must be callable, got {type(loader).__name__}")
        if isinstance(batch, bool) or not isinstance(batch, int) or not 1 <= batch <= lib.UCM_RING_DEPTH:
            raise ValueError(f"batch must be an int in [1, {lib.UCM_RING_DEPTH}], got {batch!r}")
        self._cache = cache
        self._loader = loader
        self._batch = batch
        self._stop = threading.Event()
        self.errors: list = []
        self._thread = threading.Thread(target=self._run, name=f"ucmcache-prefetch-{cache.rank}",
                                        daemon=True)
        self._thread.start()

    def _run(self) -> None:
        cache = self._cache
        ids = bytearray(16 * self._batch)
        offsets = np.zeros(self._batch, dtype=np.uint64)
        ids_p = ffi.from_buffer("char[]", ids)
        offs_p = ffi.from_buffer("uint64_t[]", offsets)
        n_p = ffi.new("uint32_t *")
        while not self._stop.is_set():
            ctx = cache._ctx
            if ctx is None:
                return
            r = lib.ucm_ring_take(ctx, ids_p, offs_p, self._batch, int(SLEEP_SLICE * 1e9), n_p)
            if r == lib.UCM_CORRUPT:
                self.errors.append(CorruptSegment("the prefetch ring's positions are corrupt"))
                return
            for i in range(n_p[0]):
                if self._stop.is_set():
                    return
                try:
                    self._load((bytes(ids[16 * i:16 * i + 16]), int(offsets[i])))
                except UcmError as e:  # kept for the owner to see; the worker goes on
                    self.errors.append(e)

    def _load(self, key) -> None:
        cache = self._cache
        try:
            h = cache.get(key)
        except CacheFull:
            lib.ucm_stat_add(cache._ctx, lib.UCM_ST_PREFETCH_SKIPPED, 1)
            return
        with h:
            if not h.owner:  # someone loads or loaded it already
                lib.ucm_stat_add(cache._ctx, lib.UCM_ST_PREFETCH_SKIPPED, 1)
                return
            try:
                mv = as_value_view(self._loader(key), cache.slot_size)
            except Exception as e:
                h.fail(f"prefetch loader: {type(e).__name__}: {e}")
                self.errors.append(e)
                return
            h.data[: mv.nbytes] = mv
            h.ready(mv.nbytes)
            lib.ucm_stat_add(cache._ctx, lib.UCM_ST_PREFETCHED, 1)

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def stop(self, timeout: Optional[float] = 10.0) -> None:
        """Stop and join the thread; returns promptly even while it sleeps on an empty ring."""
        self._stop.set()
        ctx = self._cache._ctx
        if ctx is not None:
            lib.ucm_ring_wake(ctx, self._cache.rank)
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise UcmError(f"the prefetcher did not stop within {timeout} s (a loader still runs)")

    def __enter__(self) -> "Prefetcher":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
