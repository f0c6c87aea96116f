"""UCM's V1 KV store over a shared segment (``ucmcache.ucm``, the path UCM's configs name):
``store`` (UcmCacheStore and its tasks), ``config`` (the keys UCM's connectors pass, checked;
the segment a config names and its size), ``memory`` (block ids and shard keys, a block's
tensors or addresses, the copies), ``tasks`` (a task's plan and the work it does on a pool
thread).  The segment's opening, naming, sizing, finalizer and host registration are the
engine kit's (``ucmcache.engines.kit``)."""
