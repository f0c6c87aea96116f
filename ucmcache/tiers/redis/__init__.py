"""Tier 2: an optional Redis tier (standalone or Redis Cluster) beneath the shared-memory cache.

Without it nothing changes: the shared-memory cache needs no server.  With it
(``SlotCache.create/attach(..., tier2=RedisTier(...))``), the one local owner of a cold key asks
Redis before its loader runs:

* found (and valid): the value is copied into the slot and published Ready; the caller gets a
  non-owner Ready handle (``get_many``: ``owner[i]`` False) and no loader runs on this node;
* not found: a lease elects one computing node across machines.  The lease holder stays owner;
  what it publishes Ready is written through by a background thread, which also drops the lease
  and announces the key.  A node that finds the lease held keeps its local owner slot (its
  local processes wait on it as usual) and waits for the value, bounded by the lease's
  remaining time: when the lease is gone (its holder failed, or died and the lease expired) it
  takes the lease and loads.  So with tier 2 a get() can block while another node loads the
  key, never longer than the get's ``timeout`` (when given) or twice ``lease_ttl``.

``clear()`` is local: it does not touch tier 2 (change the namespace to drop tier-2 values).

The cache calls tier 2 through the interface of ucmcache.core.tier only; the modules here, by
concept:

* ``breaker``: the circuit breaker (closed / open / half-open) and ``Bypass``;
* ``codec``: the value header (corrupt, truncated, oversized or foreign values are misses,
  counted in ``t2_bad_values``), Redis key names, lease tokens;
* ``client``: ``RedisTier``, its connections, round trips and background writer;
* ``announce``: the pub/sub listener that wakes this process's waiters of a written key;
* ``leases``: the lease protocol for one cache (``Leases``, the tier as that cache uses it).

Faults: every round trip is bounded by ``timeout``, and the breaker bypasses tier 2 after
``breaker_failures`` consecutive failures, lets one probe through every ``breaker_reset``
seconds, and logs each opening and closing once on the ``ucmcache.tier2`` logger.  A get that
meets a fault or an open breaker goes on as if tier 2 did not exist (the local owner loads),
counted in ``t2_bypasses``.
"""
from .client import RedisTier

__all__ = ["RedisTier"]
