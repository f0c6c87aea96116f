"""UcmCacheStore: UCM's V1 KV store interface over a shared ucmcache segment.

UCM's vLLM and SGLang connectors build their store from ``ucm_connector_name: UcmCacheStore``
and ``ucm_connector_module_path: ucmcache.ucm``; every worker and engine instance on a node
that names the same segment shares its blocks, with crash recovery and a generation fence.
When ``ucm`` is importable the class subclasses ``UcmKVStoreBaseV1``; otherwise it is
duck-typed and this package never needs UCM installed.

Its design (a block's shards and the complete mark, missing blocks, lifetime, copies), its
config keys and its limits are in docs/engines/ucm.md.

This module is the store and its task objects; beside it, one concept each: ``config``
(the config keys, the segment name), ``memory`` (block ids, tensors and addresses, the
copies) and ``tasks`` (a task's plan and the work it does on a pool thread).
"""
from __future__ import annotations

import concurrent.futures
import itertools
import logging
import os
import threading
from typing import Any, Callable, Dict, List, NamedTuple, Optional

import numpy as np

from ...core.cache import SlotCache
from ...core.errors import IncompatibleSegment, SegmentNotFound, UcmError
from .. import kit
from ..kit import EngineParts, HostRegistration
from .config import _Config, _WorkerSizes
from .memory import UVA, _block_id, _Piece, _piece, _shards
from .tasks import TaskBodies, _Plan

log = logging.getLogger("ucmcache.ucm")

try:  # UCM's own base classes, when UCM is installed (it imports torch)
    from ucm.store.ucmstore_v1 import Task as _TaskBase
    from ucm.store.ucmstore_v1 import UcmKVStoreBaseV1 as _StoreBase
    HAVE_UCM = True
except Exception:  # not installed (or broken): duck-typed, same methods and signatures
    _TaskBase = object
    _StoreBase = object
    HAVE_UCM = False

try:  # where UCM's RankConsistencyManager looks for "this block is not there" (uc-manager 0.8)
    from ucm.store.pipeline.errors import StoreNotFoundError as _NotFoundBase
except Exception:  # not installed, or a UCM without it: this package's own class alone
    _NotFoundBase = None

__all__ = ["UcmCacheStore", "UcmCacheTask", "UcmTaskFailed", "UcmBlockNotFound", "HAVE_UCM"]


class UcmTaskFailed(UcmError, RuntimeError):
    """wait(): some of a task's blocks failed; the message names each (at most 8) and why.  A
    RuntimeError, as wait() raised before these classes."""


if _NotFoundBase is not None:
    class UcmBlockNotFound(_NotFoundBase, UcmTaskFailed):
        """wait() of a load: a block is missing (not stored, evicted, not published yet) or
        stored with another size.  UCM's StoreNotFoundError, so that UCM's
        RankConsistencyManager stops looking the block up until it is dumped again."""
else:
    class UcmBlockNotFound(UcmTaskFailed):  # type: ignore[no-redef]
        """wait() of a load: a block is missing (not stored, evicted, not published yet) or
        stored with another size.  With UCM installed, also UCM's
        ucm.store.pipeline.errors.StoreNotFoundError."""

_private_seq = itertools.count(1)
_task_seq = itertools.count(1)


# ---------------------------------------------------------------- tasks

class UcmCacheTask(_TaskBase):
    """A load or dump in flight: pass it to ``wait`` or ``check``.  ``task_id`` as UCM's own
    stores have it; the rest is this store's."""

    def __init__(self, task_id: int, kind: str, block_ids: List[bytes], shards: List[int],
                 future: "concurrent.futures.Future"):
        self.task_id = task_id
        self.kind = kind
        self.block_ids = block_ids
        self.shards = shards
        self._future = future

    def __repr__(self) -> str:
        state = "done" if self._future.done() else "running"
        return f"<UcmCacheTask {self.task_id} {self.kind} of {len(self.block_ids)} block(s) {state}>"


# ---------------------------------------------------------------- the store

class _Worker(NamedTuple):
    """What a worker store (device_id >= 0) has from its start and a scheduler-side store never
    has: its sizes, its cache and the pool its tasks run on."""

    sizes: _WorkerSizes
    cache: SlotCache
    pool: concurrent.futures.ThreadPoolExecutor


class _Parts(EngineParts):
    """What a store holds that must be let go of when the store goes (kit.EngineParts: its
    host registration and cache) and its pool, stopped first: running tasks finish."""

    __slots__ = ("pool",)

    def __init__(self) -> None:
        super().__init__(log)
        self.pool: Optional[concurrent.futures.ThreadPoolExecutor] = None

    def stop(self) -> None:
        pool, self.pool = self.pool, None
        if pool is not None:
            pool.shutdown(wait=True)


class UcmCacheStore(TaskBodies, _StoreBase):
    """UCM's V1 KV store (``UcmKVStoreBaseV1``) over a ucmcache segment shared by every store
    that names the same segment.

    Config keys, as UCM's connectors pass them (unknown keys are ignored):

    - ``ucmcache_segment``: the segment's name.  Without it: a config from UCM's vLLM
      connector (it has ``tensor_layout``) or from SGLang's (no ``unique_id``) names
      ``ucm-<tensor_layout>-u<uid>``, shared by every engine of the host and stable across
      restarts (UCM's unique_id is a fresh uuid4 at every start: config.default_segment
      says why); any other config names the segment after its ``unique_id`` (or
      ``engine_id``).
    - ``shard_size`` and ``block_size``: bytes per slot (one shard) and per block; a block has
      block_size / shard_size shards (UCM's layerwise connector: one per layer).  Needed by a
      worker store; a scheduler-side store takes the slot size from the segment.
    - ``tensor_size`` / ``tensor_size_list``: bytes behind each raw address of
      ``load_data``/``dump_data`` (tensors carry their own sizes).
    - ``buffer_size`` (bytes) or UCM's ``cache_buffer_capacity_gb`` (GiB; buffer_size wins):
      the segment's slot bytes (default 1 GiB), for ``ucmcache_max_ranks`` ranks (default 16,
      the engine kit's DEFAULT_MAX_RANKS; their arenas are shared among the ranks that
      allocate).  More than /dev/shm or MemAvailable holds is clamped to half of what is free,
      with a log line (``ucmcache.ucm``); too little for one slot per rank is SharedMemoryFull
      naming the key and what is free.  A segment that exists already is attached whatever its size.
    - ``share_buffer_enable`` (default True): attach to, or create, the named segment; False: a
      private segment for this store alone (its name is removed at once, so it disappears with
      the store's process).
    - ``local_rank_size``: accepted (the ranks sharing a buffer in UCM); sharing here is by name.
    - ``device_id``: -1 (the default, as in UCM): a scheduler-side store that only looks up; it
      attaches to the segment when the segment exists and never creates it.
    - ``transfer_timeout_ms`` (or ``timeout_ms``): the longest a task waits for a lock or for
      another worker's dump of the same block (default 30000).
    - ``transfer_stream_number`` (or ``stream_number``): threads in the task pool (default 2).
    """

    def __init__(self, config: Dict[str, object]) -> None:
        if HAVE_UCM:
            _StoreBase.__init__(self, config)
        else:
            self.config = config
        self._cfg = cfg = _Config(config)
        self._lock = threading.Lock()
        self._local = threading.local()  # each pool thread's staging buffer
        self._parts = parts = _Parts()
        self._cache: Optional[SlotCache] = None   # a scheduler-side store's, once attached
        self._work: Optional[_Worker] = None      # a worker store's (None: scheduler side)
        self._closed = False
        self._test_points: Dict[str, Callable[[int], None]] = {}
        self._cuda = False
        # Runs once: at close(), when the store is collected, or when the process exits (UCM's
        # connectors never call close()): kit.EngineParts.finalizer.
        self._finalizer = parts.finalizer(self)
        sizes = cfg.worker_sizes
        if sizes is None:
            self._try_attach()  # the scheduler side: attach if the segment exists, never create
            return
        if cfg.share:
            cache = self._open_shared(sizes)
        else:
            name = f"{cfg.segment[:40]}-p{os.getpid()}-{next(_private_seq)}"
            cache = SlotCache.create(name, slots_per_rank=sizes.fitted_slots_per_rank(log)
                                     * cfg.max_ranks, slot_size=sizes.slot_size, max_ranks=1)
            SlotCache.unlink(name)  # private: its mapping lives as long as this store
        self._set_cache(cache)
        pool = parts.pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=cfg.threads, thread_name_prefix=f"ucmcache-ucm-{cfg.segment[:16]}")
        self._work = _Worker(sizes, cache, pool)
        self._register_cuda(cache)

    def _set_cache(self, cache: SlotCache) -> None:
        self._cache = self._parts.cache = cache

    def _open_shared(self, sizes: _WorkerSizes) -> SlotCache:
        """Attach to the named segment if it exists (whatever capacity its maker chose: engines
        configured differently still share it), else create it with the capacity that fits
        /dev/shm now.  Its slots must be this store's shard size."""
        cfg = self._cfg
        cache = kit.open_segment(cfg.segment, slot_size=sizes.slot_size,
                                 max_ranks=cfg.max_ranks, timeout=cfg.timeout,
                                 slots_per_rank=lambda: sizes.fitted_slots_per_rank(log))
        if cache.slot_size != sizes.slot_size:
            have = cache.slot_size
            cache.close()
            raise IncompatibleSegment(
                f"segment {cfg.segment!r} ({cfg.segment_from}) holds slots of {have} bytes, this "
                f"store's shard_size is {sizes.slot_size}: engines whose shards differ (another "
                f"model or layout) cannot share a segment; set ucmcache_segment to name one for "
                f"this engine")
        return cache

    # ---------------------------------------------------------------- facts

    @property
    def cache(self) -> Optional[SlotCache]:
        """The SlotCache behind the store (None for a scheduler-side store not attached yet)."""
        return self._cache

    @property
    def segment(self) -> str:
        return self._cfg.segment

    def cc_store(self) -> int:
        """0: there is no native ``Store*`` behind this store (UCM's C++ pipelines cannot stack
        on it); everything goes through these Python methods and the ucmcache C core."""
        return 0

    def need_register_kv_caches(self) -> bool:
        """False: loads and dumps take the tensors or addresses with each call."""
        return False

    def register_kv_caches(self, registrations: Any) -> None:
        """Accepted and ignored (nothing to register; see need_register_kv_caches)."""

    def register_memory(self, base_addr: int, total_size: int) -> None:
        """Accepted and ignored (nothing to register)."""

    # ---------------------------------------------------------------- lookups

    def _try_attach(self) -> Optional[SlotCache]:
        with self._lock:
            if self._cache is None and not self._closed and self._cfg.share:
                try:
                    self._set_cache(SlotCache.attach(self._cfg.segment, timeout=0.0))
                except (SegmentNotFound, TimeoutError):
                    pass  # not made yet (or still being made): the next lookup tries again
            return self._cache

    def _reader(self) -> Optional[SlotCache]:
        if self._closed:
            raise UcmError("this UcmCacheStore is closed")
        c = self._cache
        return c if c is not None else self._try_attach()

    def lookup(self, block_ids: List[bytes]) -> List[bool]:
        """Whether each block is stored whole (all its shards): one C call, no pin."""
        ids = [_block_id(b) for b in block_ids]
        c = self._reader()
        if c is None or not ids:
            return [False] * len(ids)
        return c.exist(ids)

    def lookup_on_prefix(self, block_ids: List[bytes]) -> int:
        """The index of the last of the leading blocks that are stored whole, -1 if none (one
        C call)."""
        ids = [_block_id(b) for b in block_ids]
        c = self._reader()
        if c is None or not ids:
            return -1
        return c.exist_prefix(ids) - 1

    def lookup_on_reverse(self, block_ids: List[bytes]) -> int:
        """The index of the last block that is stored whole, -1 if none (one C call)."""
        found = self.lookup(block_ids)
        for i in range(len(found) - 1, -1, -1):
            if found[i]:
                return i
        return -1

    def prefetch(self, block_ids: List[bytes]) -> None:
        """A hint that never blocks: marks stored blocks recently used (CLOCK keeps them) and
        posts the rest to this rank's prefetch ring (dropped, and counted, when it is full)."""
        ids = [_block_id(b) for b in block_ids]
        c = self._reader()
        if c is None or not ids:
            return
        try:
            c.touch(ids)
            c.prefetch(ids)
        except UcmError:
            pass  # a hint: a busy ring or a closed cache is not the caller's problem

    # ---------------------------------------------------------------- transfers

    def load(self, block_ids: List[bytes], shard_index: List[int],
             dst_tensor: List[List[Any]]) -> UcmCacheTask:
        """Copy each block's shard into its tensors (``dst_tensor[i][j]``: tensor j of block i,
        laid end to end in the slot).  wait() raises UcmBlockNotFound naming every block that is
        missing (not stored, evicted, or not published yet: a load never waits for or creates
        an entry) or was stored with another size; their tensors are left as they were."""
        return self._submit("load", block_ids, shard_index, self._tensor_pieces(
            block_ids, dst_tensor, writable=True))

    def dump(self, block_ids: List[bytes], shard_index: List[int],
             src_tensor: List[List[Any]]) -> UcmCacheTask:
        """Store each block's tensors end to end in one slot, as shard shard_index[i] of block
        i.  A shard already stored is skipped; one another worker is dumping is waited for,
        not written twice; each is published only after its copy completed, and a block is
        found by lookups once all its shards are."""
        return self._submit("dump", block_ids, shard_index, self._tensor_pieces(
            block_ids, src_tensor, writable=False))

    def load_data(self, block_ids: List[bytes], shard_index: List[int],
                  dst_addr) -> UcmCacheTask:
        """load() with raw addresses: ``dst_addr[i][j]`` (ints, or a uint64 array) of
        tensor_size_list[j] (or tensor_size) bytes each.  Host addresses; on a worker store
        (device_id >= 0) of a machine with CUDA, device addresses (untested here)."""
        return self._submit("load", block_ids, shard_index, self._addr_pieces(block_ids,
                                                                              dst_addr))

    fetch_data = load_data  # the name older versions of UcmKVStoreBaseV1 use

    def dump_data(self, block_ids: List[bytes], shard_index: List[int], src_addr,
                  prerequisite_handle: int = 0) -> UcmCacheTask:
        """dump() with raw addresses (see load_data).  ``prerequisite_handle``, when not 0, is
        the device event (a ``cudaEvent_t``) the sources are complete after: the task's pool
        thread synchronizes it before its first copy, and the call itself never waits.  Keep
        the event alive until the task is done (UCM's connector does).  On a store without
        CUDA there is no device work to wait for and the handle is not used."""
        handle = int(prerequisite_handle or 0)
        if handle < 0:
            raise ValueError(f"prerequisite_handle must be an event handle >= 0, got {handle}")
        return self._submit("dump", block_ids, shard_index, self._addr_pieces(block_ids,
                                                                              src_addr),
                            event=handle)

    def _tensor_pieces(self, block_ids, tensors, writable: bool):
        self._worker()
        if len(tensors) != len(block_ids):
            raise ValueError(f"{len(tensors)} rows of tensors for {len(block_ids)} block ids")
        keep: list = []
        pieces = []
        for i, row in enumerate(tensors):
            if isinstance(row, np.ndarray) and row.dtype != object and row.ndim <= 1:
                row = [row]  # a block given as one array rather than a list of tensors
            try:
                got = [_piece(t, writable, keep) for t in row]
            except (TypeError, ValueError) as e:
                raise type(e)(f"block {i}: {e}") from None
            if not got:
                raise ValueError(f"block {i} has no tensors")
            pieces.append(got)
        return pieces, keep

    def _addr_pieces(self, block_ids, addrs):
        work = self._worker()
        arr = np.asarray(addrs, dtype=np.uint64)
        if arr.ndim == 1:
            arr = arr.reshape(-1, 1)
        if arr.ndim != 2 or arr.shape[0] != len(block_ids):
            raise ValueError(f"addresses must be n_blocks x n_tensors, got shape {arr.shape} "
                             f"for {len(block_ids)} block ids")
        sizes = work.sizes.column_sizes(arr.shape[1])
        on_device = self._cuda
        pieces = []
        for row in arr.tolist():
            if on_device:  # untested here: host (SGLang) or device (vLLM) addresses alike
                pieces.append([_Piece(a, n, UVA) for a, n in zip(row, sizes)])
            else:
                pieces.append([_Piece(a, n) for a, n in zip(row, sizes)])
        return pieces, [addrs]

    def _worker(self) -> _Worker:
        """What a load or dump needs: the worker's parts, if this is an open worker store."""
        if self._closed:
            raise UcmError("this UcmCacheStore is closed")
        if self._work is None:
            raise UcmError("a scheduler-side store (device_id -1) only looks up: load and dump "
                           "need a worker store (device_id >= 0)")
        return self._work

    def _submit(self, kind: str, block_ids, shard_index, pieces_keep,
                event: int = 0) -> UcmCacheTask:
        work = self._worker()
        pieces, keep = pieces_keep
        ids = [_block_id(b) for b in block_ids]
        sizes = work.sizes
        why = (f"block_size {sizes.slot_size * sizes.shards} / shard_size {sizes.slot_size}"
               if sizes.shards > 1 else "block_size = shard_size, or only one of them given")
        plan = _Plan(work.cache, ids, _shards(shard_index, len(ids), sizes.shards, why), pieces,
                     keep, sizes.shards, event)
        if kind == "dump":
            for i, total in enumerate(plan.totals):
                if total > sizes.slot_size:
                    raise ValueError(f"block {i}'s tensors hold {total} bytes, more than a slot "
                                     f"(shard_size {sizes.slot_size})")
        run = self._run_dump if kind == "dump" else self._run_load
        future = work.pool.submit(self._guard, run, plan)
        return UcmCacheTask(next(_task_seq), kind, ids, plan.shards, future)

    def wait(self, task: UcmCacheTask) -> None:
        """Block until the task is done.  Raises naming every block that failed (at most 8 of
        them): UcmBlockNotFound (UCM's StoreNotFoundError when UCM is installed) when a load
        found a block missing or stored with another size, else UcmTaskFailed; both are
        RuntimeErrors.  A task's waits are bounded by transfer_timeout_ms, so this returns."""
        failures, not_found = task._future.result()
        if failures:
            shown = []
            for i in sorted(failures)[:8]:
                shown.append(f"block {i} (id {task.block_ids[i].hex()}, shard {task.shards[i]}):"
                             f" {failures[i]}")
            more = "" if len(failures) <= 8 else f"; and {len(failures) - 8} more"
            error = UcmBlockNotFound if not_found else UcmTaskFailed
            raise error(f"{task.kind} task {task.task_id}: {len(failures)} of "
                               f"{len(task.block_ids)} block(s) failed: " + "; ".join(shown)
                               + more)

    def check(self, task: UcmCacheTask) -> bool:
        """True once the task is done (successfully or not: wait() says which); never
        blocks."""
        return task._future.done()

    # ---------------------------------------------------------------- CUDA (untested here)

    def _register_cuda(self, cache: SlotCache) -> None:
        """On a machine with CUDA and a worker store: page-lock the segment so that device
        copies through a slot are DMA (kit.HostRegistration: cudaHostRegister, a refusal
        logged, unregistered when the store goes).  This machine has no GPU: the path runs
        here only against stand-ins."""
        try:
            import sys
            torch = sys.modules.get("torch")
            if torch is None or not torch.cuda.is_available():
                return
        except Exception:
            return
        self._cuda = True
        self._parts.host = HostRegistration(torch, cache, who="UcmCacheStore", logger=log)

    # ---------------------------------------------------------------- lifecycle

    def close(self) -> None:
        """Finish running tasks, stop the pool, detach (the rank is freed; a private segment
        goes away).  Also done when the store is collected or the interpreter exits."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._finalizer()

    def __enter__(self) -> "UcmCacheStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        work = self._work
        role = ("scheduler" if work is None else f"worker device {self._cfg.device_id} "
                f"slot={work.sizes.slot_size}B x {work.sizes.shards} shard(s)")
        return (f"<UcmCacheStore segment={self._cfg.segment!r} {role} "
                f"{'closed' if self._closed else 'open'}>")
