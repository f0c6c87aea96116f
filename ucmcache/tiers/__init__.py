"""Tiers beneath the shared-memory cache (DESIGN 4.10): ``base`` (the interface the cache calls,
importing nothing of the package), ``write_through`` (the background writer's queue),
``breaker`` (the circuit breaker), ``disk/`` (DiskTier) and ``redis/`` (RedisTier).  A tier
imports the core and these shared modules, never another tier nor an engine.  Imports nothing,
so the core can import ``base`` alone."""
