"""A SlotCache in a reference cycle through its C fields (its tier, an attribute) is collected,
and frees its rank (csrc/ucm_hit.c: CacheBase's traverse and clear)."""
import gc
import weakref

import pytest

from ucmcache import SlotCache
from ucmcache.core.tier import BoundTier, Tier


K = [i.to_bytes(8, "little") * 2 for i in range(200)]


class _CountingTier(Tier):
    """A tier that keeps the `count` it is bound with, as RedisTier does: the cache's bound
    method, so cache -> _tier (a C field of CacheBase) -> the bound tier -> count -> cache."""

    def bind(self, count, slot_size):
        return _BoundCounting(count)


class _BoundCounting(BoundTier):
    def __init__(self, count):
        self.count = count

    def lookup(self, owned, may_wait, timeout):
        return [None] * len(owned)

    def exist_prefix(self, keys):
        return 0

    def write_through(self, slot, payload):
        pass

    def abandon(self, slot):
        pass

    def close(self):
        pass


def test_a_cache_in_a_reference_cycle_through_its_tier_is_collected(uuid):
    c = SlotCache.create(uuid, slots_per_rank=4, slot_size=64, max_ranks=1,
                         tier2=_CountingTier())
    assert c.get_or_load(K[0], lambda: b"v") == b"v"
    gone = weakref.ref(c)
    del c
    with pytest.warns(ResourceWarning, match="collected without close"):
        gc.collect()
    assert gone() is None
    d = SlotCache.attach(uuid)  # its rank was freed by the finalizer's close
    try:
        assert d.get_or_load(K[0], lambda: b"never") == b"v"
    finally:
        d.close()


def test_a_cache_in_a_reference_cycle_through_an_attribute_is_collected(uuid):
    c = SlotCache.create(uuid, slots_per_rank=4, slot_size=64, max_ranks=1)
    c.itself = c
    gone = weakref.ref(c)
    del c
    with pytest.warns(ResourceWarning, match="collected without close"):
        gc.collect()
    assert gone() is None
