"""UcmCacheStore's config (``ucmcache.ucm``): the keys UCM's connectors pass, checked, and the
segment name a UCM unique_id maps to.  Nothing here touches a segment.
"""
from __future__ import annotations

import hashlib
import re
from typing import Dict, List, Optional

import numpy as np

DEFAULT_BUFFER_SIZE = 1 << 30   # segment data bytes when the config gives no buffer_size
DEFAULT_MAX_RANKS = 8           # stores attached at once (workers and scheduler-side stores)
DEFAULT_TIMEOUT_S = 30.0        # UCM's transfer_timeout_ms default (30000)
DEFAULT_THREADS = 2

_SEGMENT_RE = re.compile(r"[A-Za-z0-9_-]{1,64}")


def _int(config: Dict[str, object], name: str, default: Optional[int] = None,
         minimum: int = 0) -> Optional[int]:
    v = config.get(name, default)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
        raise ValueError(f"config {name!r} must be an int, got {type(v).__name__} {v!r}")
    v = int(v)
    if v < minimum:
        raise ValueError(f"config {name!r} must be >= {minimum}, got {v}")
    return v


def _bool(config: Dict[str, object], name: str, default: bool) -> bool:
    v = config.get(name, default)
    if isinstance(v, str):
        low = v.strip().lower()
        if low in ("1", "true", "yes", "on"):
            return True
        if low in ("0", "false", "no", "off", ""):
            return False
        raise ValueError(f"config {name!r} must be a bool, got {v!r}")
    if not isinstance(v, (bool, int, np.integer)):
        raise ValueError(f"config {name!r} must be a bool, got {type(v).__name__} {v!r}")
    return bool(v)


def segment_name(unique_id: str) -> str:
    """The segment uuid for a UCM unique_id: itself when it is a valid uuid ([A-Za-z0-9_-],
    at most 64), else a readable prefix plus a hash of the whole id (deterministic, so every
    process that passes the same id names the same segment)."""
    s = str(unique_id)
    if _SEGMENT_RE.fullmatch(s):
        return s
    digest = hashlib.blake2b(s.encode("utf-8"), digest_size=8).hexdigest()
    return re.sub(r"[^A-Za-z0-9_-]", "_", s)[:40] + "-" + digest


class _Config:
    """The config keys this store reads, checked.  Unknown keys are ignored (UCM's connectors
    pass keys meant for other stores: storage_backends, store_pipeline, posix_gc_enable...)."""

    def __init__(self, config: Dict[str, object]):
        if not isinstance(config, dict):
            raise TypeError(f"config must be a dict, got {type(config).__name__}")
        missing = []
        uid = config.get("ucmcache_segment") or config.get("unique_id") or config.get("engine_id")
        if uid is None or uid == "":
            missing.append("unique_id (or engine_id)")
        slot = config.get("shard_size", config.get("block_size"))
        if slot is None:
            missing.append("shard_size (or block_size)")
        if missing:
            raise ValueError(f"UcmCacheStore config is missing {' and '.join(missing)}; got keys "
                             f"{sorted(map(str, config))}")
        self.unique_id = str(uid)
        self.segment = segment_name(self.unique_id)
        key = "shard_size" if "shard_size" in config else "block_size"
        self.slot_size = _int(config, key, minimum=1)
        sizes = config.get("tensor_size_list")
        if sizes is not None:
            try:
                sizes = [int(s) for s in sizes]
            except (TypeError, ValueError):
                raise ValueError(f"config 'tensor_size_list' must be a list of ints, got "
                                 f"{sizes!r}") from None
            if not sizes or min(sizes) <= 0:
                raise ValueError(f"config 'tensor_size_list' must be non-empty sizes > 0, got "
                                 f"{sizes}")
        self.tensor_sizes: Optional[List[int]] = sizes
        self.tensor_size = _int(config, "tensor_size", minimum=1)
        self.buffer_size = _int(config, "buffer_size", DEFAULT_BUFFER_SIZE, minimum=1)
        self.share = _bool(config, "share_buffer_enable", True)
        self.local_rank_size = _int(config, "local_rank_size", 1, minimum=1)
        self.device_id = _int(config, "device_id", -1, minimum=-(1 << 31))
        self.max_ranks = _int(config, "ucmcache_max_ranks", DEFAULT_MAX_RANKS, minimum=1)
        if self.max_ranks > 63:
            raise ValueError(f"config 'ucmcache_max_ranks' must be at most 63, got "
                             f"{self.max_ranks}")
        tkey = "transfer_timeout_ms" if "transfer_timeout_ms" in config else "timeout_ms"
        ms = _int(config, tkey, minimum=1)
        self.timeout = DEFAULT_TIMEOUT_S if ms is None else ms / 1000.0
        nkey = "transfer_stream_number" if "transfer_stream_number" in config else "stream_number"
        threads = _int(config, nkey, minimum=1)
        self.threads = DEFAULT_THREADS if threads is None else min(16, threads)
        stride = -(-self.slot_size // 64) * 64
        self.slots_per_rank = self.buffer_size // (stride * self.max_ranks)
        if self.device_id >= 0 and self.slots_per_rank < 1:
            raise ValueError(
                f"config buffer_size={self.buffer_size} holds no slot of {self.slot_size} bytes "
                f"for each of {self.max_ranks} ranks (ucmcache_max_ranks); it needs at least "
                f"{stride * self.max_ranks}")

    def column_sizes(self, m: int) -> List[int]:
        """Bytes behind each of a block's m raw addresses (load_data/dump_data)."""
        if self.tensor_sizes is not None:
            if len(self.tensor_sizes) != m:
                raise ValueError(f"each block has {m} address(es) but config tensor_size_list "
                                 f"has {len(self.tensor_sizes)} sizes")
            return list(self.tensor_sizes)
        if self.tensor_size is not None:
            return [self.tensor_size] * m
        if self.slot_size % m:
            raise ValueError(f"each block has {m} address(es): give tensor_size or "
                             f"tensor_size_list in the config (shard_size {self.slot_size} is "
                             f"not a multiple of {m})")
        return [self.slot_size // m] * m
