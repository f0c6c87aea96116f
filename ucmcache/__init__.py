"""ucmcache: a cross-process shared-memory slot cache for inference workers.

Several processes attach to one /dev/shm segment by uuid and share fixed-size slots keyed by a
16-byte block id plus an offset.  Hits take no lock; a cold key is computed once across all
processes; a crashed process never leaks capacity or wedges the others.
"""
from .core.cache import SlotCache
from .core.errors import (CacheFull, CorruptSegment, ForeignSegment, HalfMadeSegment, HandleClosed,
                      IncompatibleSegment, LoadFailed, LockTimeout, NotAttached,
                      RankUnavailable,
                      SegmentExists, SegmentNotFound, SharedMemoryFull, UcmError, Unsupported)
from .core.handle import Handle, HandleBatch
from .core.keys import Key, chain_keys, make_key
from .tiers.redis import RedisTier
from .tiers.disk import DiskTier, ForeignTierDirectory, TierCapacityMismatch
from .core.verify import VerifyReport, verify

__all__ = [
    "SlotCache", "Handle", "HandleBatch", "Key", "make_key", "chain_keys", "verify",
    "VerifyReport", "UcmError", "CacheFull", "LoadFailed", "SegmentExists", "SegmentNotFound",
    "IncompatibleSegment", "CorruptSegment", "HalfMadeSegment", "ForeignSegment",
    "SharedMemoryFull", "RankUnavailable", "HandleClosed", "NotAttached", "LockTimeout",
    "RedisTier", "DiskTier", "Unsupported", "ForeignTierDirectory", "TierCapacityMismatch",
]
__version__ = "0.1.0"


def _show_as_public() -> None:
    """Public objects say they are ucmcache's (ucmcache.SlotCache, not ucmcache.core.cache.SlotCache)
    in reprs, tracebacks and pickles, as trio's do; each is importable from here by that name."""
    for name in __all__:
        obj = globals()[name]
        if getattr(obj, "__module__", "").startswith("ucmcache."):
            obj.__module__ = "ucmcache"


_show_as_public()
