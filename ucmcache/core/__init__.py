"""The protocol: the segment, its slots and arenas, handles, recovery, single flight, batches
and the cache built on them (DESIGN 2-4).  It imports nothing of ucmcache's tiers, engines or
CLI, only the C extensions beside the package (``ucmcache._core``, ``ucmcache._hit``) and the
tier interface it calls, which is its own (``ucmcache.core.tier``: the tiers implement it); tests/core/test_layers.py keeps it so.
The public names are ``ucmcache``'s: import them from there."""
