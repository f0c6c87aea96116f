"""The engine integrations over one shared kit: ``kit`` (open, name and size a segment for an
engine, the finalizer, host-memory registration, config checking), ``vllm/`` (vLLM's KV
connector) and ``ucm/`` (UCM's KV store).  They use the core, never the tiers or each other;
engine configs name them by their public paths, ``ucmcache.vllm`` and ``ucmcache.ucm``."""
