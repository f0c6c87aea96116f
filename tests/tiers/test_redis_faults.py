"""Tier 2's faults on real Redis servers: a server killed and restarted, a slow server (never
holds a get past its timeout), corrupt, truncated and foreign values (misses), exist_prefix
asking only for the rest, a Cluster key slot that moves, a failed load dropping its lease at
once, write-through off the path and bounded.  Events, gates and test points order the steps;
the only polling is for an external server to come up."""
import logging
import os
import threading

from ucmcache import RedisTier, SlotCache
from ucmcache.lowlevel import hooks as _hooks
from ucmcache.tiers.redis.codec import decode, encode

from redis_fixtures import redis_cluster, redis_unix, redis_workdir  # noqa: F401 (fixtures)
from redis_helpers import SIZE, SLOT, _keys, _ns, _t2, nodes  # noqa: F401 (nodes: a fixture)
from workers import check_payload, payload_for


class FakeClock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def _messages(caplog, text):
    return [r for r in caplog.records if r.name == "ucmcache.tier2" and text in r.getMessage()]


def test_server_killed_then_restarted(nodes, redis_unix, caplog):
    caplog.set_level(logging.INFO, logger="ucmcache.tier2")
    clock = FakeClock()
    tier = RedisTier(unix_socket=redis_unix.sock, namespace=_ns(), timeout=0.05,
                     breaker_failures=3, breaker_reset=5.0, clock=clock)
    (c,) = nodes(1, tier2=tier)
    keys = _keys(9)
    runs = []

    def load(k):
        return c.get_or_load(k, lambda: (runs.append(k), payload_for(k, SIZE))[1])

    assert check_payload(keys[0], load(keys[0]))
    assert tier.flush() and redis_unix.client().exists(tier.key_for(keys[0]))

    redis_unix.kill()                               # mid-run
    for k in keys[1:6]:                             # each served by the loader, bypassing
        assert check_payload(k, load(k))
    assert check_payload(keys[0], load(keys[0]))   # a local hit needs no tier 2
    assert tier.state == "open"
    s = _t2(c)
    assert s["t2_bypasses"] == 5 and s["t2_misses"] == 1 and len(runs) == 6
    assert len(_messages(caplog, "circuit open")) == 1

    redis_unix.start()                              # back, empty
    assert check_payload(keys[6], load(keys[6]))   # the breaker waits breaker_reset first
    assert _t2(c)["t2_bypasses"] == 6 and tier.state == "open"
    clock.t += 5.0
    assert check_payload(keys[7], load(keys[7]))   # the probe goes through: closed again
    assert tier.state == "closed"
    assert len(_messages(caplog, "circuit closed")) == 1
    assert len(_messages(caplog, "circuit open")) == 1
    assert check_payload(keys[8], load(keys[8]))
    assert tier.flush()
    r = redis_unix.client()
    assert r.exists(tier.key_for(keys[7])) and r.exists(tier.key_for(keys[8]))
    s = _t2(c)
    assert s["t2_misses"] == 3 and s["t2_writes"] >= 3 and len(runs) == 9


def test_slow_server_never_blocks_a_get_past_the_timeout(nodes, redis_unix):
    tier = RedisTier(unix_socket=redis_unix.sock, namespace=_ns(), timeout=0.05,
                     write_timeout=0.2, breaker_failures=3, breaker_reset=60.0)
    (c,) = nodes(1, tier2=tier)
    keys = _keys(7)
    assert check_payload(keys[0], c.get_or_load(keys[0], lambda: payload_for(keys[0], SIZE)))
    redis_unix.pause()                              # accepts, answers nothing
    try:
        for i, k in enumerate(keys[1:]):
            assert check_payload(k, c.get_or_load(k, lambda k=k: payload_for(k, SIZE)))
            if i == 2:                                  # three timed-out round trips: open
                assert tier.state == "open"
                fails = tier._breaker.fails
        assert tier._breaker.fails == fails             # breaker open: no round trip at all
        assert tier.state == "open" and _t2(c)["t2_bypasses"] == 6
    finally:
        redis_unix.resume()


def test_corrupt_truncated_and_foreign_values_are_misses(nodes, redis_unix):
    tier = RedisTier(unix_socket=redis_unix.sock, namespace=_ns(), timeout=2.0)
    (c,) = nodes(1, tier2=tier)
    keys = _keys(8)
    r = redis_unix.client()
    good = {k: encode(tier.key_for(k), payload_for(k, SIZE)) for k in keys}
    wrong_layout = bytearray(good[keys[4]])
    wrong_layout[5] ^= 0x40
    flipped = bytearray(good[keys[5]])
    flipped[40] ^= 1
    planted = [b"not a ucmcache value", good[keys[1]][:-7], good[keys[0]],  # foreign: key 0's
               b"NOPE" + good[keys[3]][4:], bytes(wrong_layout), bytes(flipped),
               encode(tier.key_for(keys[6]), b"z" * (SLOT + 1))]             # bigger than a slot
    for k, blob in zip(keys[1:], planted):
        r.set(tier.key_for(k), blob)
    runs = []
    for k in keys[1:5]:
        v = c.get_or_load(k, lambda k=k: (runs.append(k), payload_for(k, SIZE))[1])
        assert check_payload(k, v)
    with c.get_many(keys[5:]) as b:                 # the batch path too
        assert b.owner.tolist() == [True, True, True]
        for i, k in enumerate(keys[5:]):
            runs.append(k)
            b.data(i)[:SIZE] = payload_for(k, SIZE)
            b.ready(i, SIZE)
    assert len(runs) == 7
    s = _t2(c)
    assert s["t2_bad_values"] == 7 and s["t2_misses"] == 7 and s["t2_hits"] == 0
    assert tier.flush()
    for k in keys[1:]:                              # written through over the bad ones
        assert check_payload(k, bytes(decode(tier.key_for(k), r.get(tier.key_for(k)), SLOT)))


def test_exist_prefix_consults_tier_2_for_the_rest_only(nodes, redis_unix):
    from ucmcache import chain_keys
    cfg = dict(unix_socket=redis_unix.sock, namespace=_ns(), timeout=0.05,
               breaker_failures=1, breaker_reset=60.0)
    a, b = nodes(2)
    a2 = SlotCache.attach(a.uuid, tier2=RedisTier(**cfg))
    b2 = SlotCache.attach(b.uuid, tier2=RedisTier(**cfg))
    try:
        keys = chain_keys([bytes([i]) * 32 for i in range(8)], namespace="m")
        for k in keys[:6]:
            a2.get_or_load(k, lambda k=k: payload_for(k, SIZE))
        a2._tier.tier.flush()
        b.get_or_load(keys[0], lambda: payload_for(keys[0], SIZE))  # local only, no tier 2
        assert b.exist_prefix(keys) == 1
        assert b2.exist_prefix(keys) == 6
        redis_unix.kill()
        assert b2.exist_prefix(keys) == 1           # tier 2 down: what is local
        assert b2.stats()["per_rank"][b2.rank]["t2_bypasses"] == 1
    finally:
        a2.close()
        b2.close()


# ---------------------------------------------------------------- cluster: a slot moves


def _key_in_slot(tier, slot, block_id):
    from redis.crc import key_slot
    for off in range(1, 1 << 20):
        if key_slot(tier.key_for((block_id, off))) == slot:
            return (block_id, off)
    raise AssertionError("no offset maps to the slot")


def test_cluster_a_key_slot_moving_is_followed(nodes, redis_cluster):
    from redis.crc import key_slot
    cfg = dict(cluster_nodes=redis_cluster.startup, namespace=_ns(), timeout=2.0)
    ta, tb = RedisTier(**cfg), RedisTier(**cfg)
    a, b = nodes(2)
    a2 = SlotCache.attach(a.uuid, tier2=ta)
    b2 = SlotCache.attach(b.uuid, tier2=tb)
    moved = None
    try:
        k1, k2 = _keys(2)
        for k in (k1, k2):
            a2.get_or_load(k, lambda k=k: payload_for(k, SIZE))
        assert ta.flush()
        warm = _keys(1)[0]                          # B's client learns the slot map now
        b2.get_or_load(warm, lambda: payload_for(warm, SIZE))
        slot = key_slot(ta.key_for(k1))
        src = redis_cluster.owner_of(slot)
        dst = next(n for n in redis_cluster.nodes if n is not src)
        k3 = _key_in_slot(ta, slot, os.urandom(16))  # a new key in the moving slot

        redis_cluster.begin_migration(slot, src, dst)
        moved = (slot, dst)
        # Mid-migration: k1 is on dst already (ASK from src), k3 is new (its lease and value
        # go to dst by ASK too).
        runs = []
        assert check_payload(k1, b2.get_or_load(k1, lambda: runs.append(1) or b"x"))
        assert check_payload(k3[0], a2.get_or_load(k3, lambda: payload_for(k3[0], SIZE)))
        assert ta.flush()
        redis_cluster.end_migration(slot, dst)
        moved = None
        # After: B's stale map says src, src answers MOVED.
        assert check_payload(k3[0], b2.get_or_load(k3, lambda: runs.append(3) or b"x"))
        assert check_payload(k2, b2.get_or_load(k2, lambda: runs.append(2) or b"x"))
        assert runs == []
        s = b2.stats()["per_rank"][b2.rank]
        assert s["t2_hits"] == 3 and s["t2_bypasses"] == 0
        c = dst.client()
        assert c.exists(ta.key_for(k1)) and c.exists(ta.key_for(k3))
        c.close()
    finally:
        if moved is not None:
            redis_cluster.end_migration(*moved)
        a2.close()
        b2.close()


def test_a_failed_load_drops_its_lease_at_once(nodes, redis_unix, gate):
    """A node whose load fails drops its lease: a waiting node takes over at once, long
    before the lease would expire."""
    cfg = dict(unix_socket=redis_unix.sock, namespace=_ns(), timeout=2.0, lease_ttl=60.0)
    a, b = nodes(2)
    a2 = SlotCache.attach(a.uuid, tier2=RedisTier(**cfg))
    b2 = SlotCache.attach(b.uuid, tier2=RedisTier(**cfg))
    (key,) = _keys(1)
    lease_wait = gate()
    out = {}
    try:
        h = a2.get(key)
        assert h.owner                             # node A holds the lease

        def node_b():
            out["v"] = b2.get_or_load(key, lambda: payload_for(key, SIZE), timeout=30)
        _hooks.arm_python("lease_wait", "gate", lease_wait)
        t = threading.Thread(target=node_b)
        t.start()
        try:
            lease_wait.wait_arrived()               # node B waits on node A's lease
            lease_wait.release()
            h.fail("no GPU")                        # node A's load fails ...
            h.close()                               # ... and its lease goes with the handle
        finally:
            _hooks.arm_python("lease_wait", "none")
            lease_wait.release()
            t.join(60)
        assert not t.is_alive()                    # released with the handle, not expired
        assert check_payload(key, out["v"])
        s = b2.stats()["per_rank"][b2.rank]
        assert s["t2_lease_waits"] == 1 and s["t2_misses"] == 1
        assert a2._tier.tier.flush() and a2._tier.tier.counters["releases"] == 1
    finally:
        a2.close()
        b2.close()


def test_write_through_is_off_the_path_and_bounded(nodes, redis_unix, gate):
    """Publishing never waits for Redis: while the writer is held, the value is Ready locally
    and not yet in Redis; past max_pending_bytes write-throughs are dropped (and counted), and
    the dropped one's lease is released rather than left to expire."""
    tier = RedisTier(unix_socket=redis_unix.sock, namespace=_ns(), timeout=2.0,
                     max_pending_bytes=300)
    (c,) = nodes(1, tier2=tier)
    r = redis_unix.client()
    k1, k2, k3 = _keys(3)
    writer = gate()
    _hooks.arm_python("before_write", "gate", writer)  # one-shot: k1's batch only
    try:
        assert check_payload(k1, c.get_or_load(k1, lambda: payload_for(k1, SIZE)))
        writer.wait_arrived()                       # the writer holds k1's write-through
        assert c.exist([k1]) == [True] and not r.exists(tier.key_for(k1))
        c.get_or_load(k2, lambda: payload_for(k2, SIZE))   # queued (224 bytes)
        c.get_or_load(k3, lambda: payload_for(k3, SIZE))   # over 300 bytes queued: dropped
        assert tier.counters["writes_dropped"] == 1 and _t2(c)["t2_writes"] == 2
    finally:
        _hooks.arm_python("before_write", "none")
        writer.release()
    assert tier.flush()
    assert r.exists(tier.key_for(k1)) and r.exists(tier.key_for(k2))
    assert not r.exists(tier.key_for(k3)) and not r.exists(tier.key_for(k3) + b":lease")
    assert tier.counters["releases"] == 1
