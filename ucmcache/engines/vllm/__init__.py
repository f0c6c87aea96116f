"""vLLM's KV connector over a shared segment (``ucmcache.vllm``, the path vLLM's
kv_transfer_config names): ``connector`` (UcmCacheConnector, its config and metadata; the
design in its docstring), ``scheduler`` (the scheduler side: lookups, what each step loads and
saves), ``worker`` (the worker side: the KV tensors, loads, deferred saves), ``blocks`` (keys,
the slot format, block copies; no vLLM needed), ``flight`` (single flight across engines: the
intents).  The segment's opening, naming, sizing, finalizer and host registration are the
engine kit's (``ucmcache.engines.kit``)."""
