"""UcmCacheConnector: a vLLM KV connector (``KVConnectorBase_V1``) over a shared ucmcache segment.

The path vLLM's configs name (``"kv_connector_module_path": "ucmcache.vllm"``); the connector
lives in ``ucmcache.engines.vllm`` (its design: ``ucmcache/engines/vllm/connector.py``).  This
module re-exports its public names only.  ``import ucmcache.vllm`` works without vLLM;
``UcmCacheConnector`` then raises ImportError naming it.
"""
from .engines.kit import (DEFAULT_MAX_RANKS, SHM_CLAMP_SHARE, mem_available_bytes,  # noqa: F401
                          segment_name, shm_free_bytes)
from .engines.vllm.blocks import (HEADER_SIZE, DeferredSaves, EngineIdentity, IOStats,
                                  KVBlockIO, LoadResult, VllmConnectorError, block_keys,
                                  check_header, exist_prefix_all_ranks, pack_header, rank_key)
from .engines.vllm.connector import (DEFAULT_SIZE_MB, HAVE_VLLM, ConnectorConfig,  # noqa: F401
                                     default_segment, identity_from_vllm)
from .engines.vllm.scheduler import ATTACH_RETRY_S  # noqa: F401
from .engines.vllm.worker import open_segment, spare_cpus

__all__ = ["UcmCacheConnector", "UcmCacheConnectorMetadata", "EngineIdentity", "KVBlockIO",
           "IOStats", "LoadResult", "VllmConnectorError", "ConnectorConfig", "block_keys",
           "rank_key", "exist_prefix_all_ranks", "pack_header", "check_header", "HEADER_SIZE",
           "HAVE_VLLM", "default_segment", "open_segment", "mem_available_bytes",
           "DeferredSaves", "spare_cpus"]

if HAVE_VLLM:
    from .engines.vllm.connector import (UcmCacheConnector, UcmCacheConnectorMetadata,  # noqa: F401
                                         UcmCacheConnectorStats, UcmCachePromMetrics)
else:
    def __getattr__(name: str):
        from .engines.vllm import connector
        return getattr(connector, name)   # ImportError naming vLLM for the connector's classes
