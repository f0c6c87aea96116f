"""Hypothesis stateful test of the single-process API against a plain dict model.

The cache has room for every key the machine uses, so the model is exact: no eviction.
"""
import os
import uuid as uuidlib

from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import ucmcache
from ucmcache import LoadFailed, SlotCache

KEYS = [bytes([i]) * 16 for i in range(6)] + [(bytes([7]) * 16, o) for o in (1, 2**63)]
keys = st.sampled_from(KEYS)
values = st.binary(min_size=0, max_size=48)


class CacheModel(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.uuid = f"h-{os.getpid()}-{uuidlib.uuid4().hex[:10]}"
        self.cache = SlotCache.create(self.uuid, slots_per_rank=16, slot_size=48, max_ranks=1,
                                      n_buckets=2, n_stripes=1)
        self.model = {}
        self.open = []  # [handle, key, generation] of owners not yet published
        self.generation = 0

    def teardown(self):
        for h, _, _ in self.open:
            h.close()
        self.cache.close()
        SlotCache.unlink(self.uuid)

    @rule(key=keys, value=values)
    def get_or_load(self, key, value):
        if any(k == key for _, k, _ in self.open):
            return  # an open owner of this key in this thread would be a recursive load
        got = self.cache.get_or_load(key, lambda: value)
        expected = self.model.setdefault(key, value)
        assert got == expected

    @rule(key=keys)
    def start_load(self, key):
        if any(k == key for _, k, _ in self.open):
            return
        h = self.cache.get(key)
        assert h.owner == (key not in self.model)
        if h.owner:
            self.open.append((h, key, self.generation))
        else:
            assert bytes(h.data) == self.model[key]
            h.close()

    @precondition(lambda self: self.open)
    @rule(value=values, ok=st.booleans())
    def finish_load(self, value, ok):
        h, key, generation = self.open.pop(0)
        if ok:
            h.data[: len(value)] = value
            h.ready(len(value))
            if generation == self.generation:  # a load from before clear() is never published
                self.model[key] = value
        else:
            h.fail("no")
        h.close()

    @rule(key=keys)
    def exist(self, key):
        assert self.cache.exist([key]) == [key in self.model]

    @rule()
    def clear(self):
        self.cache.clear()
        self.model.clear()
        self.generation += 1

    @rule(ks=st.lists(keys, max_size=4))
    def exist_prefix(self, ks):
        n = 0
        while n < len(ks) and ks[n] in self.model:
            n += 1
        assert self.cache.exist_prefix(ks) == n

    @invariant()
    def accounting(self):
        assert self.cache.entry_count() == len(self.model)
        assert self.cache.size_bytes() == sum(len(v) for v in self.model.values())


CacheModel.TestCase.settings = settings(max_examples=150, stateful_step_count=30, deadline=None)
TestCacheModel = CacheModel.TestCase


def test_verify_after_model_runs(make_cache):
    c = make_cache(slots_per_rank=4, slot_size=16, max_ranks=1)
    c.get_or_load(KEYS[0], lambda: b"a")
    assert ucmcache.verify(c.uuid).ok
    try:
        h = c.get(KEYS[1])
        h.fail("x")
        h.close()
        with c.get(KEYS[1]) as h2:
            assert h2.owner
    except LoadFailed:  # pragma: no cover
        raise
