"""Locks: the striped robust bucket locks, as recovery and repair use them.

Bucket b is guarded by stripe ``b & (n_stripes - 1)`` (``ucm_stripe_of``).  The slot protocol
takes stripes inside its C steps (``ucm_get_slow``: one stripe blocking, any other only by
trylock, so no lock-order cycles); this module is for the Python-driven steps around them
(rank recovery freeing a dead claimant's slot).  A stripe whose holder died comes back as EOWNERDEAD: before marking it consistent, the chains of every bucket it
guards are rebuilt from their heads (``ucm_stripe_repair``), so the next holder finds them whole
and the mutex never becomes ENOTRECOVERABLE.  The lock is never held across user code or a
blocking wait (loaders run after it is released).
"""
from __future__ import annotations

from typing import Optional

from ._core import ffi, lib
from ._errors import CorruptSegment


class Stripes:
    def __init__(self, ctx, base, layout):
        self._ctx = ctx
        self._base = base
        self._layout = layout

    def lock(self, stripe: int, timeout: Optional[float] = None) -> None:
        ns = -1 if timeout is None else int(timeout * 1e9)
        r = lib.ucm_stripe_lock(self._ctx, stripe, ns)
        if r == lib.UCM_OK:
            return
        if r == lib.UCM_OWNERDEAD:
            self._repair_or_release(stripe)
            return
        if r == lib.UCM_TIMEOUT:
            raise TimeoutError(f"stripe {stripe} stayed locked for {timeout} s")
        raise CorruptSegment(f"stripe {stripe}'s mutex is unusable (code {r})")

    def unlock(self, stripe: int) -> None:
        lib.ucm_stripe_unlock(self._ctx, stripe)

    def _repair_or_release(self, stripe: int) -> None:
        # A lock() that raises must not leave the stripe held by a live thread.
        try:
            self.repair(stripe)
        except BaseException:
            self.unlock(stripe)
            raise

    def repair(self, stripe: int) -> None:
        """We hold a stripe whose previous holder died: rebuild its chains, then mark the mutex
        consistent.  Keeps I2 (a linked slot's bucket word names its bucket) for the chains the
        dead holder may have left half-changed."""
        self.rebuild(stripe)
        r = lib.ucm_mutex_consistent(self._base, self._layout.stripe(stripe))
        if r != lib.UCM_OK:
            raise CorruptSegment(f"stripe {stripe} could not be made consistent (code {r})")

    def rebuild(self, stripe: int) -> int:
        """Rebuild the chains of the buckets this stripe guards (held by us); returns how many
        links were dropped."""
        dropped = ffi.new("uint32_t *")
        if lib.ucm_stripe_repair(self._ctx, stripe, dropped) != lib.UCM_OK:
            raise CorruptSegment(f"stripe {stripe} is out of range")
        return dropped[0]
