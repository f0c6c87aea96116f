"""The disk tier: blocks on a local directory beneath the shared-memory cache (DESIGN 4.14).

``DiskTier(path, capacity_bytes)`` is a tier (ucmcache.core.tier) like ``RedisTier``, usable alone
(``tier2=DiskTier(...)``) or above Redis (``tier2=[DiskTier(...), RedisTier(...)]``).  Modules:

* ``fileformat``: the block file (header with the key, length and checksums; versioned);
* ``counters``: the ``t2_*`` counters kept in the directory, one file every process adds into;
* ``tier``: ``DiskTier`` (reads on a bounded pool, the background writer, capacity and
  eviction under a shared lock, verify and trim) and ``BoundDisk`` (the tier as a cache uses it).
"""
from .tier import BlockFile, DiskTier, ForeignTierDirectory, TierCapacityMismatch, VerifyResult

__all__ = ["DiskTier", "BlockFile", "VerifyResult", "ForeignTierDirectory",
           "TierCapacityMismatch"]
