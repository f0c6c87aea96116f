"""What tier 2's tests on real Redis servers share (test_redis_*.py): the payload and slot
sizes, a fresh namespace, fresh keys, a cache's tier-2 counters, and the nodes fixture that
closes and unlinks the segments a test made."""
import os
import uuid as uuidlib

import pytest

from ucmcache import SlotCache

from conftest import close_and_unlink
import tier2_workers as tw

SIZE = tw.SIZE
SLOT = 256


def _ns():
    return f"test-{uuidlib.uuid4().hex[:12]}"


def _keys(n):
    return [os.urandom(16) for _ in range(n)]


def _t2(cache):
    return {k: v for k, v in cache.stats().items() if k.startswith("t2_")}


@pytest.fixture
def nodes():
    """nodes(n, tier2=None) -> n created SlotCaches on fresh uuids (closed and unlinked after,
    pass or fail)."""
    made = []

    def make(n, **kw):
        out = []
        for _ in range(n):
            u = f"t2-{os.getpid()}-{uuidlib.uuid4().hex[:10]}"
            made.append([u, None])
            c = SlotCache.create(u, slots_per_rank=64, slot_size=SLOT, max_ranks=6, **kw)
            made[-1][1] = c
            out.append(c)
        return out

    yield make
    close_and_unlink(made)
