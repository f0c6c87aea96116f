"""Tier 2's public names at their first import path; the Redis tier is ucmcache.tiers.redis."""
from ..tiers.redis import RedisTier

__all__ = ["RedisTier"]
