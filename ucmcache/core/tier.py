"""The tier interface: what SlotCache calls on a tier beneath the shared-memory cache (DESIGN 4.10).

A tier is chosen at attach (``SlotCache.create/attach(..., tier2=...)``) and bound to that cache
once: ``Tier.bind`` returns the ``BoundTier`` the cache calls, at four points and nowhere else:

1. ``lookup``: get()/get_many() made this caller the owner of cold slots (the handle or batch
   owns their pins already).  The tier answers each with a payload, which the cache publishes
   Ready through the normal publish path (the handle becomes a reader of it), or None: the
   caller loads, and the tier may keep a record of that slot (a lease) until 2 or 3.
2. ``write_through``: the owner published a slot Ready; the tier copies the payload before it
   returns (the view is valid only during the call) and writes it wherever it writes, off the
   caller's path.
3. ``abandon``: the owner's handle closed without publishing Ready (failed, cut short): drop
   whatever the tier holds for that slot (a lease), so another node need not wait it out.
4. ``exist_prefix`` (the keys the cache lacks) and ``close`` (the cache detaches).

``put`` stands for ``lookup`` at 1 when the owner is a ``put()`` (its value is the caller's):
a tier that can be written over (DiskTier) does not serve what it holds and writes the put's
value over it; the default is lookup (RedisTier: a value it holds wins).

Slots name an owner's load from ``lookup`` to ``write_through``/``abandon``; keys are
``(block_id, offset)``.  A tier may report into the caller's shared counters through the ``count``
it is bound with (``UCM_ST_T2_*``: RedisTier does; DiskTier keeps its own in its directory).
A tier never touches handles, slots or the segment: the cache owns every pin and every
publish, so a tier (Redis, a local disk, a third) is added without changing ``_cache``.
``tier2=`` may also be a sequence of tiers, looked up in order: ``TierChain`` below binds each
and is itself a tier.  This module imports nothing of the package; tiers import it.
"""
from __future__ import annotations

import abc
import time
from typing import Any, Callable, List, Optional, Sequence, Tuple, Union

# (slot, block_id, offset): one owned cold key of a get or get_many
Owned = Tuple[int, bytes, int]


class BoundTier(abc.ABC):
    """A tier as one SlotCache uses it.  Calls come from the cache's threads, never under a
    stripe lock; every call is bounded in time (a tier that cannot answer answers None/0)."""

    @abc.abstractmethod
    def lookup(self, owned: Sequence[Owned], may_wait: bool,
               timeout: Optional[float]) -> List[Optional[memoryview]]:
        """For each owned cold key, its payload (at most slot_size bytes) or None (the caller
        loads it).  ``may_wait`` False: the caller owns other unpublished slots, so waiting
        for another node could close a cycle.  ``timeout`` bounds any wait (None: the tier's
        own bound)."""

    def put(self, owned: Sequence[Owned], may_wait: bool,
            timeout: Optional[float]) -> List[Optional[memoryview]]:
        """As lookup, for the owners of cold slots that put() will publish with the caller's
        value.  A tier that can be written over answers None for each, does not serve what it
        holds, and keeps what write_through then hands it in place of anything it held for the
        key (DiskTier: an older block is never served after the put; it raises OSError when it
        cannot make sure of that, and the put stores nothing).  This default is lookup: a value
        the tier holds wins, as over a load (RedisTier)."""
        return self.lookup(owned, may_wait, timeout)

    @abc.abstractmethod
    def exist_prefix(self, keys: Sequence[Tuple[bytes, int]]) -> int:
        """How many leading keys the tier holds (0 when it cannot tell now)."""

    @abc.abstractmethod
    def write_through(self, slot: int, payload: memoryview) -> None:
        """slot, looked up and loaded by its owner, is Ready with payload: keep a copy."""

    @abc.abstractmethod
    def abandon(self, slot: int) -> None:
        """slot's owner closed it unpublished (or Failed): drop what the tier holds for it."""

    @abc.abstractmethod
    def close(self) -> None:
        """The cache detaches: drop what is held for its slots, flush (bounded)."""


class Tier(abc.ABC):
    """What ``tier2=`` accepts (``ucmcache.RedisTier`` is one)."""

    @abc.abstractmethod
    def bind(self, count: Callable[[int, int], None], slot_size: int) -> BoundTier:
        """This tier as one cache uses it.  ``count(counter, n)`` adds to the cache's shared
        counters; payloads are at most ``slot_size`` bytes."""


class TierChain(Tier):
    """Tiers looked up in order (``tier2=[DiskTier(...), RedisTier(...)]``): a key the first
    misses is asked of the second, and so on.  A value found in a later tier is written
    through to the earlier ones that missed it (they hold its slot from their lookup), and a
    value the owner loads is written through to every tier that missed it.  No tier knows of
    the others: each is bound to the cache on its own."""

    def __init__(self, tiers: Sequence[Tier]):
        tiers = list(tiers)
        if not tiers:
            raise ValueError("tier2 is an empty sequence; give a tier, a sequence of tiers or "
                             "None")
        for i, t in enumerate(tiers):
            if not isinstance(t, Tier):
                raise TypeError(f"tier2[{i}] must be a ucmcache tier (DiskTier, RedisTier), got "
                                f"{type(t).__name__}")
        self.tiers = tiers

    def bind(self, count: Callable[[int, int], None], slot_size: int) -> BoundTier:
        return BoundChain([t.bind(count, slot_size) for t in self.tiers])

    def __repr__(self) -> str:
        return f"TierChain({self.tiers!r})"


class BoundChain(BoundTier):
    """A TierChain as one cache uses it."""

    def __init__(self, bound: List[BoundTier]):
        self.bound = bound

    def lookup(self, owned: Sequence[Owned], may_wait: bool,
               timeout: Optional[float]) -> List[Optional[memoryview]]:
        return self._in_order("lookup", owned, may_wait, timeout)

    def put(self, owned: Sequence[Owned], may_wait: bool,
            timeout: Optional[float]) -> List[Optional[memoryview]]:
        """Each tier's put in order; the first that serves a value (one whose rule is that
        its value wins) ends it, and the tiers above keep that value as they would a put's."""
        return self._in_order("put", owned, may_wait, timeout)

    def _in_order(self, step: str, owned: Sequence[Owned], may_wait: bool,
                  timeout: Optional[float]) -> List[Optional[memoryview]]:
        """Each tier's ``step`` (lookup or put) over the keys the tiers before it left; a
        tier that serves a key ends it there, and the tiers before it, which missed it, keep
        a copy now."""
        out: List[Optional[memoryview]] = [None] * len(owned)
        rest = list(range(len(owned)))
        deadline = None if timeout is None else time.monotonic() + timeout
        for k, tier in enumerate(self.bound):
            if not rest:
                break
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            found = getattr(tier, step)([owned[i] for i in rest], may_wait, left)
            missed = []
            for i, p in zip(rest, found):
                if p is None:
                    missed.append(i)
                    continue
                out[i] = p
                for above in self.bound[:k]:  # they missed it: they keep a copy now
                    above.write_through(owned[i][0], p)
            rest = missed
        return out

    def exist_prefix(self, keys: Sequence[Tuple[bytes, int]]) -> int:
        n = 0
        for tier in self.bound:
            if n == len(keys):
                break
            n += tier.exist_prefix(keys[n:])
        return n

    def write_through(self, slot: int, payload: memoryview) -> None:
        for tier in self.bound:
            tier.write_through(slot, payload)

    def abandon(self, slot: int) -> None:
        for tier in self.bound:
            tier.abandon(slot)

    def close(self) -> None:
        for tier in self.bound:
            tier.close()


# What tier2= accepts: a tier, tiers looked up in order, or None.
TierArg = Union[Tier, Sequence[Tier], None]


def check_tier(tier: Any) -> Optional[Tier]:
    """Refuse, before anything is created, a tier2= argument that is not a tier or a sequence
    of tiers; returns the one Tier the cache binds (a TierChain for a sequence)."""
    if tier is None or isinstance(tier, Tier):
        return tier
    if isinstance(tier, (list, tuple)):
        return tier[0] if len(tier) == 1 and isinstance(tier[0], Tier) else TierChain(tier)
    raise TypeError(f"tier2 must be a ucmcache tier (DiskTier, RedisTier), a sequence of them "
                    f"(looked up in order) or None, got {type(tier).__name__}")
