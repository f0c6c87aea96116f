"""Tier 2 on real Redis servers (standalone on a unix socket, a 3-master Cluster on loopback).

A "node" is one segment (its own uuid) with its own processes and its own RedisTier; nodes
share only Redis.  Loader runs are counted in every process.  Events, gates and test points
(ucmcache.core.hooks: "lease_wait", "before_write") order the steps; the only polling is for an
external server to come up.
"""
import os
import pickle
import threading
import uuid as uuidlib

import pytest

from ucmcache import RedisTier, SlotCache, SegmentNotFound
from ucmcache.lowlevel import hooks as _hooks
from ucmcache.core.tier import BoundTier, Tier
from ucmcache.tiers.redis.codec import HEADER, MAGIC, decode, encode

# Fixtures used by name: redis_cluster, redis_unix, redis_workdir.
from redis_fixtures import (RedisProc, free_port, need_redis, redis_cluster,  # noqa: F401
                            redis_unix, redis_workdir)
from redis_helpers import SIZE, _keys, _ns, _t2, nodes  # noqa: F401 (nodes: a fixture)
from workers import check_payload, payload_for
import tier2_workers as tw


@pytest.fixture(params=["standalone", "cluster"])
def backend(request, redis_workdir):
    """Tier-2 connection settings for a fresh standalone server or the module's cluster."""
    need_redis(cli=request.param == "cluster")
    if request.param == "standalone":
        r = RedisProc(redis_workdir, "b").start()
        try:
            yield {"unix_socket": r.sock}
        finally:
            r.kill()
    else:
        cl = request.getfixturevalue("redis_cluster")
        yield {"cluster_nodes": cl.startup}


def _cfg(backend, **kw):
    # Generous round-trip bounds: these tests check single flight, not fault handling, and
    # run beside other suites on two cores.
    return dict(backend, namespace=_ns(), timeout=2.0, **kw)


# ---------------------------------------------------------------- values and keys


def test_value_format_rejects_corrupt_truncated_and_foreign():
    vk, other = b"ucm:v2:ns:{aa:0}", b"ucm:v2:ns:{bb:0}"
    blob = encode(vk, b"x" * 100)
    assert bytes(decode(vk, blob, 256)) == b"x" * 100
    flipped = bytearray(blob)
    flipped[-1] ^= 1
    bad_layout = bytearray(blob)
    bad_layout[5] ^= 0x7F
    for bad in (b"", b"garbage", blob[:-1], blob + b"!", bytes(flipped), bytes(bad_layout),
                b"XXXX" + blob[4:]):
        assert decode(vk, bad, 256) is None
    assert decode(other, blob, 256) is None      # another key's value
    assert decode(vk, blob, 99) is None          # longer than the slot
    assert HEADER.size == 24 and blob[:4] == MAGIC


def test_keys_carry_namespace_layout_and_hash_tag():
    from ucmcache.lowlevel import lib
    t = RedisTier(url="redis://127.0.0.1:1/0", namespace="llama{3}:8b")
    k = bytes(range(16))
    v = t.key_for((k, 7))
    assert v == b"ucm:v%d:llama%%7B3%%7D:8b:{%s:7}" % (lib.UCM_LAYOUT_VERSION, k.hex().encode())
    assert t.key_for(k) != v and t._keys(k, 7)[1] == v + b":lease"
    other = RedisTier(url="redis://127.0.0.1:1/0", namespace="llama-3-8b")
    assert other.key_for(k) != t.key_for(k)


def test_arguments_and_pickling():
    with pytest.raises(ValueError, match="exactly one"):
        RedisTier(namespace="x")
    with pytest.raises(ValueError, match="exactly one"):
        RedisTier("redis://h", unix_socket="/s", namespace="x")
    with pytest.raises(ValueError, match="namespace"):
        RedisTier(url="redis://h", namespace="")
    with pytest.raises(ValueError, match="timeout"):
        RedisTier(url="redis://h", namespace="x", timeout=0)
    with pytest.raises(ValueError, match="cluster node"):
        RedisTier(cluster_nodes=["nohostport"], namespace="x")
    t = RedisTier(cluster_nodes=["127.0.0.1:7000", ("127.0.0.1", 7001)], namespace="x",
                  lease_ttl=3.0)
    t2 = pickle.loads(pickle.dumps(t))
    assert t2._config == t._config and t2.key_for(b"k" * 16) == t.key_for(b"k" * 16)
    with pytest.raises(TypeError, match="client"):
        pickle.dumps(RedisTier(client=object(), namespace="x"))


def test_bad_tier2_argument_creates_nothing():
    u = f"t2-{os.getpid()}-{uuidlib.uuid4().hex[:10]}"
    with pytest.raises(TypeError, match="RedisTier"):
        SlotCache.create(u, slots_per_rank=4, slot_size=64, tier2="redis://localhost")
    with pytest.raises(SegmentNotFound):
        SlotCache.unlink(u)


class DictTier(Tier):
    """A second backend through the tier interface alone (ucmcache.core.tier): a dict of this
    process, shared by every cache bound to it; it records the calls it gets."""

    def __init__(self):
        self.values, self.calls = {}, []

    def bind(self, count, slot_size):
        tier = self

        class Bound(BoundTier):
            keys = {}

            def lookup(self, owned, may_wait, timeout):
                tier.calls.append(("lookup", len(owned), may_wait))
                out = []
                for slot, block_id, offset in owned:
                    self.keys[slot] = (block_id, offset)
                    v = tier.values.get((block_id, offset))
                    out.append(None if v is None else memoryview(v))
                return out

            def exist_prefix(self, keys):
                n = 0
                while n < len(keys) and tuple(keys[n]) in tier.values:
                    n += 1
                return n

            def write_through(self, slot, payload):
                tier.values[self.keys.pop(slot)] = bytes(payload)

            def abandon(self, slot):
                tier.calls.append(("abandon", self.keys.pop(slot, None)))

            def close(self):
                tier.calls.append(("close",))
        return Bound()


def test_a_second_backend_plugs_in_through_the_tier_interface(nodes):
    tier = DictTier()
    a, b = nodes(2, tier2=tier)
    keys = _keys(4)
    runs = []
    for k in keys[:3]:
        assert check_payload(k, a.get_or_load(k, lambda k=k: (runs.append(k),
                                                               payload_for(k, SIZE))[1]))
    assert len(runs) == 3 and len(tier.values) == 3          # written through on ready()
    assert b.exist_prefix(keys) == 3                          # the rest, from the tier
    with b.get(keys[0]) as h:                                 # served: published, a reader
        assert not h.owner and h.state == "ready" and check_payload(keys[0], h.data)
    with b.get_many(keys[1:]) as batch:                       # two served, one to load
        assert batch.owner.tolist() == [False, False, True]
        assert check_payload(keys[1], bytes(batch.data(0)))
    assert ("abandon", (keys[3], 0)) in tier.calls            # closed unpublished
    assert ("lookup", 3, True) in tier.calls and len(runs) == 3
    with a.get(keys[3]) as mine:
        with a.get(_keys(1)[0]) as other:                     # owns another load: no waiting
            assert other.owner
            other.fail("no")
        mine.fail("no")
    assert tier.calls[-4:-2] == [("lookup", 1, True), ("lookup", 1, False)]


def test_no_server_every_get_is_served_by_the_loader(nodes):
    tier = RedisTier(url=f"redis://127.0.0.1:{free_port()}/0", namespace=_ns(), timeout=0.05,
                     breaker_failures=2)
    (c,) = nodes(1, tier2=tier)
    keys = _keys(5)
    for k in keys:
        assert check_payload(k, c.get_or_load(k, lambda k=k: payload_for(k, SIZE)))
    with c.get_many(_keys(3)) as b:
        assert b.owner.all()  # the caller loads; nothing failed
    s = _t2(c)
    assert s["t2_bypasses"] == 8 and s["t2_hits"] == s["t2_misses"] == 0  # one per owner
    assert tier.state == "open"


# ---------------------------------------------------------------- two nodes


def test_a_block_computed_on_node_a_is_served_on_node_b(nodes, backend, procs):
    cfg = _cfg(backend)
    a, b = nodes(2)
    keys = _keys(12)
    _, qa = procs.start(tw.load_keys, a.uuid, cfg, keys, 1, None, "one")
    ra = procs.result(qa)
    assert ra["runs"] == 12 and ra["ok"]
    assert ra["t2"]["t2_misses"] == 12 and ra["t2"]["t2_writes"] == 12

    # Node B: its prefix check sees tier 2; its processes get everything without a loader.
    tb = RedisTier(**cfg)
    b2 = SlotCache.attach(b.uuid, tier2=tb)
    try:
        assert b.exist_prefix(keys) == 0          # no tier 2 on this handle of the segment
        assert b2.exist_prefix(keys) == 12        # one round trip to tier 2
        assert b2.exist_prefix(keys + _keys(1)) == 12
    finally:
        b2.close()
    _, q1 = procs.start(tw.load_keys, b.uuid, cfg, keys[:6], 2, None, "one")
    _, q2 = procs.start(tw.load_keys, b.uuid, cfg, keys[6:], 3, None, "many")
    r1, r2 = procs.result(q1), procs.result(q2)
    assert (r1["runs"], r2["runs"]) == (0, 0), "node B's loader ran"
    assert r1["ok"] and r2["ok"]
    assert r1["t2"]["t2_hits"] == 6 and r2["t2"]["t2_hits"] == 6
    assert b.exist(keys) == [True] * 12           # published in node B's segment


def test_same_cold_keys_on_both_nodes_run_the_loader_once_in_all(nodes, backend, procs, gate):
    cfg = _cfg(backend)
    a, b = nodes(2)
    keys = _keys(16)
    start = gate()
    qs = [procs.start(tw.load_keys, node.uuid, cfg, keys, seed, start.path, mode)[1]
          for seed, (node, mode) in enumerate([(a, "one"), (a, "many"), (b, "one"),
                                               (b, "many")])]
    start.release()
    rs = [procs.result(q) for q in qs]
    assert all(r["ok"] for r in rs)
    assert sum(r["runs"] for r in rs) == 16, [r["runs"] for r in rs]
    t2 = {k: sum(r["t2"][k] for r in rs) for k in rs[0]["t2"]}
    assert t2["t2_misses"] == 16 and t2["t2_bypasses"] == 0 and t2["t2_bad_values"] == 0


def _events(n):
    import multiprocessing as mp
    ctx = mp.get_context("spawn")
    return [ctx.Event() for _ in range(n)]


def test_a_node_waits_for_the_node_holding_the_lease(nodes, backend, procs, gate):
    cfg = _cfg(backend)
    a, b = nodes(2)
    (key,) = _keys(1)
    loading, go = _events(2)
    lease_wait = gate()
    # A's loader starts (its lease is taken), then waits until B waits on that lease.
    _, qa = procs.start(tw.hold_lease, a.uuid, cfg, key, loading, go)
    _, qb = procs.start(tw.wait_lease, b.uuid, cfg, key, loading, lease_wait.path)
    lease_wait.wait_arrived()                   # B waits on A's lease
    go.set()
    lease_wait.release()
    ra, rb = procs.result(qa), procs.result(qb)
    assert (ra["runs"], rb["runs"]) == (1, 0)
    assert ra["ok"] and rb["ok"]
    assert rb["t2"]["t2_lease_waits"] == 1 and rb["t2"]["t2_hits"] == 1
    assert rb["t2"]["t2_misses"] == 0


def test_a_dead_lease_holder_is_taken_over_when_its_lease_expires(nodes, redis_unix, procs,
                                                                   gate):
    # B is up and waiting before A dies, so it asks well within the lease (1.5 s).
    cfg = dict(unix_socket=redis_unix.sock, namespace=_ns(), timeout=2.0, lease_ttl=1.5)
    a, b = nodes(2)
    (key,) = _keys(1)
    loading, never, killed = _events(3)
    lease_wait = gate()
    pa, qa = procs.start(tw.hold_lease, a.uuid, cfg, key, loading, never)
    _, qb = procs.start(tw.wait_lease, b.uuid, cfg, key, killed, lease_wait.path)
    assert loading.wait(30)
    pa.kill()                                   # dies inside its loader, holding the lease
    pa.join(10)
    killed.set()
    lease_wait.wait_arrived()                   # B waits on the dead holder's lease
    lease_wait.release()
    rb = procs.result(qb)
    assert rb["runs"] == 1 and rb["ok"]         # B waited, then loaded it itself
    assert rb["t2"]["t2_lease_waits"] == 1 and rb["t2"]["t2_misses"] == 1


def test_get_many_takes_leases_in_order_and_never_waits_holding_one(nodes, redis_unix, gate):
    cfg = dict(unix_socket=redis_unix.sock, namespace=_ns(), timeout=2.0)
    ta, tb = RedisTier(**cfg), RedisTier(**cfg)
    a, b = nodes(2)
    a2 = SlotCache.attach(a.uuid, tier2=ta)
    b2 = SlotCache.attach(b.uuid, tier2=tb)
    lo, hi = sorted(_keys(2), key=ta.key_for)
    lease_wait = gate()
    out = {}
    opened = []
    try:
        h_lo = a2.get_many([lo])                    # node A holds lo's lease
        opened.append(h_lo)
        assert h_lo.owner.tolist() == [True]

        def node_b():
            with b2.get_many([lo, hi], timeout=30) as batch:
                out["owner"] = batch.owner.tolist()
                batch.wait(30)
                out["data"] = [bytes(batch.data(i)) for i in range(2)]
        _hooks.arm_python("lease_wait", "gate", lease_wait)
        t = threading.Thread(target=node_b)
        t.start()
        try:
            lease_wait.wait_arrived()
            # B waits for lo (held at the gate) and holds no lease past it: node A can take
            # hi's lease.
            h_hi = a2.get_many([hi])
            opened.append(h_hi)
            assert h_hi.owner.tolist() == [True]
            assert a2._tier.pending[int(h_hi.slots[0])].token is not None
            lease_wait.release()
            for h, k in ((h_hi, hi), (h_lo, lo)):
                h.data(0)[:SIZE] = payload_for(k, SIZE)
                h.ready(0, SIZE)
                h.close()
        finally:
            _hooks.arm_python("lease_wait", "none")
            lease_wait.release()
            t.join(60)
        assert out["owner"] == [False, False]      # both came from node A through tier 2
        assert check_payload(lo, out["data"][0]) and check_payload(hi, out["data"][1])
        s = b2.stats()["per_rank"][b2.rank]
        assert s["t2_hits"] == 2 and s["t2_lease_waits"] >= 1 and s["t2_misses"] == 0
    finally:
        for h in opened:
            h.close()
        a2.close()
        b2.close()


def test_a_caller_owning_other_slots_does_not_wait_for_another_node(nodes, redis_unix):
    cfg = dict(unix_socket=redis_unix.sock, namespace=_ns(), timeout=2.0)
    a, b = nodes(2, tier2=None)
    a2 = SlotCache.attach(a.uuid, tier2=RedisTier(**cfg))
    b2 = SlotCache.attach(b.uuid, tier2=RedisTier(**cfg))
    k1, k2 = _keys(2)
    try:
        with a2.get(k2) as held:                    # node A loads k2 (lease taken)
            assert held.owner
            with b2.get(k1) as mine:                # node B owns k1 ...
                assert mine.owner
                with b2.get(k2) as other:           # ... so it loads k2 rather than wait
                    assert other.owner
                    other.ready(0)
                mine.ready(0)
            held.ready(0)
        s = b2.stats()["per_rank"][b2.rank]
        assert s["t2_lease_waits"] == 0 and s["t2_misses"] == 2
    finally:
        a2.close()
        b2.close()
