"""UcmCacheStore's config (``ucmcache.ucm``): the keys UCM's connectors pass, checked; the
segment a config names; how many bytes of slots it asks for, and how many fit.  Nothing here
touches a segment.

What UCM's connectors pass (uc-manager 0.8.1, ``ucm/integration/vllm/ucm_connector.py``
``_create_store``; ``ucm/integration/sglang/ucm_connector.py``):

- vLLM, worker: the user's ``ucm_connector_config`` plus ``unique_id`` (a fresh uuid4 at each
  engine start when share_buffer_enable, else the engine id), ``tensor_layout`` ("mla" or
  "gqa"), ``device_id``, ``tensor_size_list``, ``shard_size`` and ``block_size`` (both padded
  to 4 KiB; block_size / shard_size shards per block: one per layer with use_layerwise, else
  one), ``local_rank_size``, ``gpu_kv_buffer_*``, ``posix_gc_enable``, and with
  share_buffer_enable ``cache_buffer_capacity_gb`` (128 when the user gave none; the connector
  itself refuses to start when /dev/shm's size is below it).
- vLLM, scheduler: the user's config, ``unique_id``, ``tensor_layout``, ``posix_gc_enable``
  and, on the data-parallel rank 0 scheduler only, ``block_size``.  No shard_size.
- SGLang: the user's config, ``device_id``, ``tensor_size``, ``shard_size`` = ``block_size``,
  ``stream_number``.  No unique_id.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple, overload

import numpy as np

from ...core.timeouts import MAX_TIMEOUT
from .. import kit
from ..kit import DEFAULT_MAX_RANKS, segment_name

DEFAULT_BUFFER_SIZE = 1 << 30   # segment data bytes when the config gives no size at all
DEFAULT_TIMEOUT_S = 30.0        # UCM's transfer_timeout_ms default (30000)
DEFAULT_THREADS = 2


@overload
def _int(config: Dict[str, object], name: str, default: int, minimum: int = 0,
         maximum: Optional[int] = None) -> int: ...
@overload
def _int(config: Dict[str, object], name: str, default: None = None, minimum: int = 0,
         maximum: Optional[int] = None) -> Optional[int]: ...
def _int(config: Dict[str, object], name: str, default: Optional[int] = None,
         minimum: int = 0, maximum: Optional[int] = None) -> Optional[int]:
    """The int under name (default when absent or None), checked (kit.check_int)."""
    return kit.check_int(config, name, default, minimum=minimum, maximum=maximum)


def default_segment(config: Dict[str, object]) -> Tuple[str, str]:
    """(segment, why) for a config without ``ucmcache_segment``.

    A config from UCM's vLLM connector (it always has ``tensor_layout``) or SGLang's (no
    unique_id at all) has no name that survives an engine restart: vLLM's unique_id is a new
    uuid4 at every start.  Named after it, each start would make a new segment, find nothing
    and leave the old one in /dev/shm.  So the default is one segment per tensor layout and
    user: ``ucm-<tensor_layout>-u<uid>``, the same for the scheduler (which is given no sizes)
    and the workers of every engine on the host.  Sharing it across models is safe for keys,
    as far as UCM's block ids go: UCM's RequestHasher puts the model's name, TP size, dtype
    and rank in every id (ucm/integration/vllm/request_hasher.py).  Engines whose shards differ
    in size cannot share a segment (its slots have one size): the second is told at start to
    set ``ucmcache_segment``.  Any other config names the segment after its unique_id (or
    engine_id), as a caller that picks its own stable id wants."""
    layout = config.get("tensor_layout")
    uid = config.get("unique_id") or config.get("engine_id")
    if layout is not None or uid is None or uid == "":
        kind = str(layout) if layout is not None else "kv"
        return (kit.default_segment("ucm", label=kind),
                "the default for UCM's connector (its unique_id changes at every start)")
    return segment_name(str(uid)), "unique_id" if config.get("unique_id") else "engine_id"


class _WorkerSizes:
    """A worker store's sizes (device_id >= 0): its slots, the shards of a block, the bytes
    behind each raw address, and the bytes of slots it asks for.  A scheduler-side store has
    none: it only looks up, in a segment the workers made, whatever its slot size."""

    def __init__(self, slot_size: int, shards: int, tensor_sizes: Optional[List[int]],
                 tensor_size: Optional[int], buffer_size: int, buffer_key: str, max_ranks: int):
        self.slot_size = slot_size
        self.shards = shards
        self.tensor_sizes = tensor_sizes
        self.tensor_size = tensor_size
        self.buffer_size, self.buffer_key = buffer_size, buffer_key
        self.max_ranks = max_ranks   # the config's, which a new segment's slots are split among
        self.slots_per_rank_for(buffer_size)  # a size too small for a slot: say now

    @property
    def stride(self) -> int:
        return -(-self.slot_size // 64) * 64

    def slots_per_rank_for(self, nbytes: int) -> int:
        """Slots each of max_ranks ranks gets from nbytes of slots (ValueError if none)."""
        per = nbytes // (self.stride * self.max_ranks)
        if per < 1:
            raise ValueError(
                f"config {self.buffer_key} ({nbytes} bytes) holds no slot of {self.slot_size} "
                f"bytes for each of {self.max_ranks} ranks (ucmcache_max_ranks); it needs at "
                f"least {self.stride * self.max_ranks}")
        return per

    def fitted_slots_per_rank(self, log) -> int:
        """slots_per_rank for a segment made now: what the config asks for, or, when /dev/shm
        or the memory available cannot hold that, kit.SHM_CLAMP_SHARE of what is free (with a
        log line), so that an engine configured for a larger machine still starts.
        SharedMemoryFull when not even one slot per rank fits."""
        return kit.new_segment_slots_per_rank(
            self.buffer_size, self.slot_size, self.max_ranks,
            asked_by=f"config {self.buffer_key}", who="UcmCacheStore", logger=log,
            hint="set cache_buffer_capacity_gb or buffer_size to choose")

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


class _Config:
    """The config keys this store reads, checked.  Unknown keys are ignored (UCM's connectors
    pass keys meant for other stores: storage_backends, store_pipeline, posix_gc_enable...).
    The size keys are checked on either side, and held (``worker_sizes``) by a worker's only."""

    def __init__(self, config: Dict[str, object]):
        if not isinstance(config, dict):
            raise TypeError(f"config must be a dict, got {type(config).__name__}")
        self.device_id = _int(config, "device_id", -1, minimum=-(1 << 31))
        named = config.get("ucmcache_segment")
        if named is not None and named != "":
            self.segment, self.segment_from = segment_name(str(named)), "ucmcache_segment"
        else:
            self.segment, self.segment_from = default_segment(config)
        # Sizes: a worker needs them; a scheduler-side store attaches to what the workers made
        # and takes the slot size from the segment (UCM gives its scheduler no shard_size, and
        # block_size only on data-parallel rank 0).
        shard = _int(config, "shard_size", minimum=1)
        block = _int(config, "block_size", minimum=1)
        slot_size = shard if shard is not None else block
        # Shards per block: UCM's layerwise connector stores layer l of a block as shard l and
        # passes block_size = n_layers x shard_size; the direct one, one shard per block.
        shards = 1
        if shard is not None and block is not None and self.device_id >= 0:
            if block % shard:
                raise ValueError(f"config block_size {block} is not a multiple of shard_size "
                                 f"{shard}: a block is a whole number of shards")
            shards = block // shard
        given: Any = config.get("tensor_size_list")   # whatever the caller passed
        tensor_sizes: Optional[List[int]] = None
        if given is not None:
            try:
                tensor_sizes = [int(s) for s in given]
            except (TypeError, ValueError):
                raise ValueError(f"config 'tensor_size_list' must be a list of ints, got "
                                 f"{given!r}") from None
            if not tensor_sizes or min(tensor_sizes) <= 0:
                raise ValueError(f"config 'tensor_size_list' must be non-empty sizes > 0, got "
                                 f"{tensor_sizes}")
        tensor_size = _int(config, "tensor_size", minimum=1)
        buffer_size, buffer_key = self._buffer(config)
        self.share = kit.check_bool(config, "share_buffer_enable", True, strict=False)
        self.local_rank_size = _int(config, "local_rank_size", 1, minimum=1)
        self.max_ranks = _int(config, "ucmcache_max_ranks", DEFAULT_MAX_RANKS, minimum=1,
                              maximum=63)
        tkey = "transfer_timeout_ms" if "transfer_timeout_ms" in config else "timeout_ms"
        ms = _int(config, tkey, minimum=1)
        if ms is not None and ms / 1000.0 > MAX_TIMEOUT:  # every wait's rule (check_timeout)
            raise ValueError(f"config {tkey!r} must be at most {int(MAX_TIMEOUT * 1000)} ms "
                             f"(about 31 years: the longest finite wait), got {ms}")
        self.timeout = DEFAULT_TIMEOUT_S if ms is None else ms / 1000.0
        nkey = "transfer_stream_number" if "transfer_stream_number" in config else "stream_number"
        threads = _int(config, nkey, minimum=1)
        self.threads = DEFAULT_THREADS if threads is None else min(16, threads)
        # A worker's sizes; None on the scheduler side (device_id -1).
        self.worker_sizes: Optional[_WorkerSizes] = None
        if self.device_id >= 0:
            if slot_size is None:
                raise ValueError(f"UcmCacheStore config is missing shard_size (or block_size); "
                                 f"got keys {sorted(map(str, config))}")
            self.worker_sizes = _WorkerSizes(slot_size, shards, tensor_sizes, tensor_size,
                                             buffer_size, buffer_key, self.max_ranks)

    @staticmethod
    def _buffer(config: Dict[str, object]) -> Tuple[int, str]:
        """(bytes of slots asked for, the key that asked).  buffer_size (bytes, this store's
        own key) wins over UCM's cache_buffer_capacity_gb (GiB, as UCM counts it: x 2**30)."""
        nbytes = _int(config, "buffer_size", minimum=1)
        if nbytes is not None:
            return nbytes, "buffer_size"
        gb = config.get("cache_buffer_capacity_gb")
        if gb is not None:
            if isinstance(gb, bool) or not isinstance(gb, (int, float, np.integer, np.floating)) \
                    or not gb > 0:
                raise ValueError(f"config 'cache_buffer_capacity_gb' must be a number of GiB > 0, "
                                 f"got {gb!r}")
            return int(float(gb) * (1 << 30)), f"cache_buffer_capacity_gb={gb}"
        return DEFAULT_BUFFER_SIZE, "the default size"
