"""The disk tier's public names at their first import path; the tier is ucmcache.tiers.disk."""
from ..tiers.disk import (BlockFile, DiskTier, ForeignTierDirectory, TierCapacityMismatch,
                          VerifyResult)

__all__ = ["DiskTier", "BlockFile", "VerifyResult", "ForeignTierDirectory",
           "TierCapacityMismatch"]
