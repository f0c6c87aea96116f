"""UcmCacheConnector: a vLLM KV connector (``KVConnectorBase_V1``) over a shared ucmcache segment.

Every vLLM instance and data-parallel replica of a host that names the same segment shares one
crash-safe prefix cache of KV blocks (``"kv_connector": "UcmCacheConnector",
"kv_connector_module_path": "ucmcache.vllm"``).  Written against vLLM 0.32;
``import ucmcache.vllm`` works without vLLM, ``UcmCacheConnector`` itself needs it.

Its design (what runs where: the scheduler's lookup, the worker's layer-by-layer load, the saves
off the step, load errors), its ``kv_connector_extra_config`` keys and its limits (CUDA: the
segment registered as pinned host memory, copies on a stream of the connector's own; written,
never run here) are in docs/engines/vllm.md; which module runs each side: scheduler.py (the scheduler's
side), worker.py (a worker's side), blocks.py (the slot format and copies), flight.py (the
intents); single flight across engines in
docs/design/engines.md (DESIGN 4.15).
"""
from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Set, Tuple

from ...core.cache import SlotCache
from .. import kit
from ..kit import DEFAULT_MAX_RANKS, segment_name
from .blocks import EngineIdentity, IOStats, VllmConnectorError
from .config import DEFAULT_SIZE_MB, ConnectorConfig  # noqa: F401 (ucmcache.vllm's names)
from .flight import DEFAULT_PEER_WAIT_S, INTENTS_SUFFIX
from .scheduler import ConnectorScheduler, _Job
from .worker import ConnectorWorker, _Parts

log = logging.getLogger("ucmcache.vllm")

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

def default_segment(identity: EngineIdentity) -> str:
    """The segment of an engine whose config names none: one per engine identity (TP rank
    aside) and user, the same in every process and across restarts."""
    return kit.default_segment("vllm", identity=identity.namespace)


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



# ---------------------------------------------------------------- the connector (needs vLLM)

if HAVE_VLLM:

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

    class UcmCacheConnector(KVConnectorBase_V1):
        """vLLM's KVConnectorBase_V1 over a shared ucmcache segment (see the module docstring).
        As vLLM's own connectors do, it delegates: the scheduler's hooks to a
        ConnectorScheduler (scheduler.py), the workers' to a ConnectorWorker (worker.py); what
        both share (the config, the engine identity, the segment's name, the finalizer) is
        made here."""

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
            self._finalizer = parts.finalizer(self)
            self._scheduler: Optional[ConnectorScheduler] = None
            self._worker: Optional[ConnectorWorker] = None
            if role == KVConnectorRole.SCHEDULER:
                self._scheduler = ConnectorScheduler(
                    cfg=cfg, identity=self._identity, segment=self._segment, parts=parts,
                    new_meta=UcmCacheConnectorMetadata,
                    pace=int(getattr(vllm_config.parallel_config, "data_parallel_size", 1)
                             or 1) <= 1)
            else:
                self._worker = ConnectorWorker(
                    cfg=cfg, identity=self._identity, segment=self._segment,
                    layer_names=self._layer_names, vllm_config=vllm_config,
                    kv_cache_config=kv_cache_config, parts=parts)
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
            if self._scheduler is not None:
                self._scheduler.shutdown()    # the scheduler's intents end first
            if self._worker is not None:
                self._worker.shutdown()
            self._finalizer()

        @property
        def _sched(self) -> ConnectorScheduler:
            """The scheduler side: vLLM calls the scheduler's hooks in its scheduler only."""
            assert self._scheduler is not None, "a scheduler hook called on a worker's connector"
            return self._scheduler

        def _meta(self) -> Optional["UcmCacheConnectorMetadata"]:
            if not self.has_connector_metadata():
                return None
            meta = self._get_connector_metadata()
            return meta if isinstance(meta, UcmCacheConnectorMetadata) else None

        # ------------------------------------------------------------ worker side (worker.py)
        # vLLM's scheduler asks its own connector for stats too: the worker's hooks answer
        # "nothing" where there is no worker side, as before the split.

        def register_kv_caches(self, kv_caches: Dict[str, Any]) -> None:
            """Look at the KV tensors (per layer, first dimension = blocks) and attach to the
            segment, creating it sized for one block of every layer per slot."""
            assert self._worker is not None, "register_kv_caches called on the scheduler's"
            self._worker.register_kv_caches(kv_caches)

        def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
            """Start copying this step's matched blocks into the paged KV cache (before the
            forward; ConnectorWorker.start_load_kv)."""
            if self._worker is not None:
                self._worker.start_load_kv(self._meta())

        def wait_for_layer_load(self, layer_name: str) -> None:
            """Wait until this step's matched blocks have layer ``layer_name`` in."""
            if self._worker is not None:
                self._worker.wait_for_layer_load(layer_name)

        def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any,
                          **kwargs: Any) -> None:
            """Nothing per layer: wait_for_save hands whole blocks to the save thread once
            every layer is computed (a block is published only with every layer in)."""

        def wait_for_save(self) -> None:
            """Hand this step's newly computed full prompt blocks to the save thread and return
            (ConnectorWorker.wait_for_save)."""
            if self._worker is not None:
                self._worker.wait_for_save(self._meta())

        def handle_preemptions(self, kv_connector_metadata: Any) -> None:
            """The saves of the requests vLLM preempted end before the step writes any block
            (ConnectorWorker.handle_preemptions)."""
            meta = kv_connector_metadata
            if self._worker is not None:
                self._worker.handle_preemptions(
                    meta if isinstance(meta, UcmCacheConnectorMetadata) else None)

        def get_finished(self, finished_req_ids: Set[str]
                         ) -> Tuple[Optional[Set[str]], Optional[Set[str]]]:
            """The finished requests whose blocks vLLM kept for their saves, once those are
            over (ConnectorWorker.get_finished)."""
            if self._worker is None:
                return None, None
            return self._worker.get_finished(finished_req_ids, self._meta())

        def get_block_ids_with_load_errors(self) -> Set[int]:
            if self._worker is None:
                return set()
            return self._worker.get_block_ids_with_load_errors()

        def get_kv_connector_stats(self) -> Optional["KVConnectorStats"]:
            data = None if self._worker is None else self._worker.get_kv_connector_stats()
            return None if data is None else UcmCacheConnectorStats(data=data)

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

        # ------------------------------------------------------------ scheduler side (scheduler.py)

        def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
            super().bind_kv_cache_manager(kv_cache_manager)
            if self._scheduler is not None:
                self._scheduler._kv_cache_manager = kv_cache_manager

        def get_num_new_matched_tokens(self, request: Any,
                                       num_computed_tokens: int) -> Tuple[Optional[int], bool]:
            """Tokens beyond num_computed_tokens whose blocks are stored whole for every rank:
            leading full prompt blocks only, never the one holding the last token."""
            return self._sched.get_num_new_matched_tokens(request, num_computed_tokens)

        def update_state_after_alloc(self, request: Any, blocks: Any,
                                     num_external_tokens: int) -> None:
            self._sched.update_state_after_alloc(request, blocks, num_external_tokens)

        def build_connector_meta(self, scheduler_output: Any) -> "UcmCacheConnectorMetadata":
            return self._sched.build_connector_meta(scheduler_output)

        def request_finished(self, request: Any,
                             block_ids: List[int]) -> Tuple[bool, Optional[Dict[str, Any]]]:
            """A request that had saves keeps its blocks until the workers' get_finished names
            it (next step: its saves over, or dropped); any other frees them now."""
            return self._sched.request_finished(request, block_ids)

        def update_connector_output(self, connector_output: Any) -> None:
            """A step's output from the workers: the marks of the requests whose saves are over
            end (ConnectorScheduler.update_connector_output)."""
            self._sched.update_connector_output(connector_output)

        def has_pending_push_work(self) -> bool:
            """Keeps the engine stepping while marks of blocks handed for saving are unsettled
            (ConnectorScheduler.has_pending_push_work)."""
            return self._sched.has_pending_push_work()

        def reset_cache(self) -> Optional[bool]:
            """Clear the segment (every entry, for every engine attached to it)."""
            return self._sched.reset_cache()

else:
    def __getattr__(name: str) -> Any:
        if name in ("UcmCacheConnector", "UcmCacheConnectorMetadata", "UcmCacheConnectorStats",
                    "UcmCachePromMetrics"):
            raise ImportError(f"ucmcache.vllm.{name} needs vLLM (its V1 KV connector API, "
                              f"tested with 0.32): {type(_VLLM_ERROR).__name__}: {_VLLM_ERROR}")
        raise AttributeError(f"module 'ucmcache.vllm' has no attribute {name!r}")
