"""Ring: each rank's prefetch ring of keys, the posting of keys to it (SlotCache.prefetch),
and the prefetcher that drains it.

A scheduler (any process) posts the keys a request will need to the ring of the rank that will
serve it; that rank's prefetcher thread loads them through the normal single-flight path, so a
prefetch racing a get of the same key runs the loader once.  Posting never blocks: keys already
Ready or Loading are skipped, and a full ring or a busy producer lock drops the batch (counted).
The prefetcher sleeps on the ring's tail word (a futex) while the ring is empty.
"""
from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterable, Optional

import numpy as np

from .._core import ffi, lib
from .errors import CacheFull, CorruptSegment, UcmError
from .keys import Key, pack_keys
from .recovery import rank_alive
from .slots import as_value_view, check_timeout

# The cache these operations serve, as a Protocol: this module sits below _cache (which mixes
# Prefetching in) and never imports it (no import circle).
if TYPE_CHECKING:
    from .cache_core import CacheCore
else:
    CacheCore = object  # the seam is for the type checker only

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

    def __init__(self, cache: CacheCore, loader: Callable[[Any], Any], batch: int = 64):
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
        """Stop and join the thread; returns promptly even while it sleeps on an empty ring.
        ``timeout``: None or inf waits for a loader still running without bound."""
        timeout = check_timeout(timeout)
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



class Prefetching(CacheCore):
    """SlotCache's prefetch calls (DESIGN 4.9).  A mixin: it uses the cache's _recover and
    attributes (_ctx, _rank, _seg, _layout, _prefetcher), and adds no state of its own."""

    _prefetcher: Optional[Prefetcher]       # this rank's ring consumer (set by SlotCache)

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
                    ffi.from_buffer("uint64_t[]", offsets[start:start + n]), n, posted)
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
