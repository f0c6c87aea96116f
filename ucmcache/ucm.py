"""UcmCacheStore: UCM's V1 KV store interface over a shared ucmcache segment.

The path UCM's configs name (``ucm_connector_module_path: ucmcache.ucm``); the store lives in
``ucmcache.engines.ucm`` (its design: ``ucmcache/engines/ucm/store.py``).  This module
re-exports its public names only.
"""
from .engines.ucm.config import (DEFAULT_BUFFER_SIZE, DEFAULT_MAX_RANKS,  # noqa: F401
                                 DEFAULT_THREADS, DEFAULT_TIMEOUT_S, segment_name)
from .engines.ucm.memory import UVA  # noqa: F401
from .engines.ucm.store import (HAVE_UCM, UcmBlockNotFound, UcmCacheStore, UcmCacheTask,
                                UcmTaskFailed)
from .engines.ucm.tasks import DUMP_CHUNK, JOIN_ROUNDS, STAGING_BYTES, TaskBodies  # noqa: F401

__all__ = ["UcmCacheStore", "UcmCacheTask", "UcmTaskFailed", "UcmBlockNotFound", "HAVE_UCM"]
