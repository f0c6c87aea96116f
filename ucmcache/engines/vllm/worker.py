"""UcmCacheConnector's worker side (``ucmcache.vllm``; the design: ``connector.py``): the KV
tensors and the segment (``register_kv_caches``), this step's loads into the paged KV cache
(layer by layer on an IO thread, or whole blocks before the forward), the deferred saves after
the forward, the load errors reported to vLLM, and the copy threads' CPUs.  Needs no vLLM: the
connector hands it each step's metadata."""
from __future__ import annotations

import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Set, Tuple

from ...core.cache import SlotCache
from .. import kit
from ..kit import EngineParts
from .blocks import (HEADER_SIZE, SAVE_WAIT, DeferredSaves, EngineIdentity, IOStats, KVBlockIO,
                     LayerLoad, LoadResult, VllmConnectorError)

from .config import ConnectorConfig

log = logging.getLogger("ucmcache.vllm")


def open_segment(uuid: str, *, slot_size: int, size_mb: float, max_ranks: int) -> SlotCache:
    """Attach to ``uuid`` (whatever its size), else create it with ``size_mb`` MiB of slots of
    ``slot_size`` bytes, clamped to half of what /dev/shm has free and half of the memory
    available (MemAvailable: /dev/shm's size can exceed the RAM there is, and a segment's pages
    are RAM once written), with a log line (kit.open_segment, kit.new_segment_slots_per_rank).
    """
    def slots_per_rank() -> int:
        return kit.new_segment_slots_per_rank(
            int(size_mb * (1 << 20)), slot_size, max_ranks, asked_by=f"size_mb {size_mb:g}",
            who=f"ucmcache.vllm: segment {uuid!r}", logger=log, hint="set size_mb to choose",
            error=VllmConnectorError)
    return kit.open_segment(uuid, slot_size=slot_size, max_ranks=max_ranks,
                            slots_per_rank=slots_per_rank, timeout=10.0)


class _Parts(EngineParts):
    """What a connector must let go of when it goes (kit.EngineParts: its cache), held by its
    finalizer; never refers back to the connector.  Its copy threads and its KV copy path
    (whose CUDA registration goes before the cache) stop first."""

    __slots__ = ("executor", "saver", "io")

    def __init__(self) -> None:
        super().__init__(log)
        self.io: Optional[KVBlockIO] = None     # its CUDA registration goes before the cache
        self.executor: Optional[ThreadPoolExecutor] = None   # the IO thread of layer loads
        self.saver: Optional[ThreadPoolExecutor] = None      # the thread of deferred saves

    def stop(self) -> None:
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



class ConnectorWorker:
    """The worker side of a UcmCacheConnector (vLLM runs one in each worker process)."""

    def __init__(self, *, cfg: "ConnectorConfig", identity: EngineIdentity, segment: str,
                 layer_names: List[str], vllm_config: Any, kv_cache_config: Any,
                 parts: _Parts) -> None:
        self._cfg = cfg
        self._identity = identity
        self._segment = segment
        self._layer_names = layer_names
        self._vllm_config = vllm_config
        self._kv_cache_config = kv_cache_config
        self._parts = parts
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

    def start_load_kv(self, meta: Any) -> None:
        """Start copying this step's matched blocks into the paged KV cache (vLLM calls
        this before the forward).  Layer by layer (``layerwise``, CPU KV caches): on the IO
        thread, the forward waiting for each layer in ``wait_for_layer_load``; else every
        layer is copied here before the forward."""
        self._finish_load()  # a step's loads end with it; never two at once (one staging)
        self._step_load_failed = False
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
        c0 = time.thread_time_ns()
        try:
            res = io.load(keys, blocks)
        except Exception as e:  # whatever went wrong: recomputed, never left as is
            res = LoadResult(failed={b: f"{type(e).__name__}: {e}" for b in blocks})
        self._record_load(res, len(blocks), time.perf_counter_ns() - t0,
                          time.thread_time_ns() - c0)

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
        self._record_load(res, len(ll.blocks), ll.run_ns, ll.run_cpu_ns)

    def _record_load(self, res: LoadResult, n_blocks: int, ns: int, cpu_ns: int = 0) -> None:
        self._stats.load_us += ns // 1000
        self._stats.load_cpu_us += cpu_ns // 1000
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

    def wait_for_save(self, meta: Any) -> None:
        """Hand this step's newly computed full prompt blocks to the save thread (after
        the forward, once this step's loads are done) and return: the copies run while
        the next step computes.  The blocks stay alive until copied: a finished request's
        are kept by vLLM until get_finished names it (request_finished delays them), a
        preempted request's saves end in handle_preemptions before the next forward.  At
        most one earlier step's saves are left running (the one before is waited for)."""
        self._finish_load()
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

    def handle_preemptions(self, meta: Any) -> None:
        """vLLM freed the blocks of the requests it preempted in this schedule; this runs
        before the step's loads and forward write any block: their saves end here (over,
        or dropped past SAVE_WAIT: published Failed, never half)."""
        if meta is None or not meta.preempted or \
                self._saves is None:
            return
        self._stats.preempted_saves_waited += self._saves.wait_for(set(meta.preempted),
                                                                  SAVE_WAIT)

    def get_finished(self, finished_req_ids: Set[str], meta: Any
                     ) -> Tuple[Optional[Set[str]], Optional[Set[str]]]:
        """The finished requests whose blocks vLLM kept for their saves (the scheduler's
        request_finished said so; the metadata names them): named once their saves are
        over (waited for here, after a forward they ran beside; dropped past SAVE_WAIT)."""
        if meta is None or not meta.delayed:
            return None, None
        if self._saves is not None:
            self._saves.wait_for(set(meta.delayed), SAVE_WAIT)
        return set(meta.delayed), None

    def get_block_ids_with_load_errors(self) -> Set[int]:
        self._finish_load()  # vLLM asks after the forward: the step's loads are over
        errors, self._load_errors = self._load_errors, set()
        return errors

    def get_kv_connector_stats(self) -> Optional[Dict[str, Any]]:
        """The counters since the last report (the connector wraps them for vLLM); None if none."""
        if self._saves is not None:
            self._stats.add(self._saves.take_stats())
        if self._stats.empty():
            return None
        st, self._stats = self._stats, IOStats()
        self._total.add(st)
        self._write_stats(force=True)
        return st.as_dict()

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
            kit.write_json(f"{path}.rank{self._rank_offset}",
                        {**total.as_dict(), "pid": os.getpid(), "segment": self._segment})
        except OSError as e:
            log.warning("UcmCacheConnector: stats_file %s: %s", path, e)

    def shutdown(self) -> None:
        """The KV copy path is let go of (the connector's finalizer releases it, then the
        cache)."""
        self._io = None
