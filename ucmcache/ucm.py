"""UcmCacheStore: UCM's V1 KV store interface over a shared ucmcache segment.

UCM (unified-cache-management) is how vLLM and SGLang reach an external KV cache: their UCM
connectors build a store object from ``ucm_connectors: [{ucm_connector_name,
ucm_connector_module_path, ucm_connector_config}]`` and call it through ``UcmKVStoreBaseV1``
(``ucm/store/ucmstore_v1.py``): ``lookup``/``lookup_on_prefix`` on the scheduler side,
``load``/``dump`` (tensors) or ``load_data``/``dump_data`` (raw addresses) on the workers, each
returning a ``Task`` that ``wait`` blocks on and ``check`` polls.  This class is such a store,
backed by one ucmcache segment, so every worker and every engine instance on a node that names
the same segment shares its blocks, with crash recovery and a generation fence.

    ucm_connector_name: UcmCacheStore
    ucm_connector_module_path: ucmcache.ucm

When ``ucm`` is importable the class subclasses ``UcmKVStoreBaseV1`` (UCM's factory asserts
that); otherwise it is duck-typed and this package never needs UCM installed.

Layout: a block's shard is its tensors laid end to end in one slot.  A block of one shard
(UCM's direct connector) is keyed (block id, 0); ``lookup`` and ``lookup_on_prefix`` ask for
exactly that key of each block, one C call for the list, no pin.

Blocks of several shards.  UCM's layerwise connector (its default, ``use_layerwise: true``)
passes block_size = n_layers x shard_size and dumps layer l of a block as shard l, one dump call
per layer, from separate tasks and, under pipeline parallelism, from separate processes.  A
block is a hit only when all n shards are in: an engine killed between two layers' dumps must
not leave blocks whose later layers every later request then fails to load.  Two ways were open:

- lookups ask for all n shards of each block: n keys per block per lookup (a 4096-token
  prompt of 32-layer blocks: 8,192 keys instead of 256, each a (id, offset) key that the key
  packer splits in Python, ~0.7 us each, so ~6 ms per lookup on the scheduler's thread); and
  UCM gives the scheduler's store no shard_size (block_size only on data-parallel rank 0), so
  it could not even know n;
- a *complete mark*: shard s is stored under (id, 1 + s) and, once all n are Ready, a small
  mark under (id, 0), the key lookups already ask for.  Lookups stay one plain key per block,
  need no sizes, and are as fast as before; the cost is one slot per block of n (1/n of the
  capacity: 3% for 32 layers).

This store publishes the mark.  Each dump, after its own shards are stored (or found stored),
looks at the other shards of its blocks not yet marked (one shard per round, starting after its
own, so in-order layer dumps stop after one look per block) and marks those found whole: which
ever dump stores a block's last shard, in whatever process, sees all of them.  Two dumps that
store a block's last two shards at the same moment could each miss the other's (a store then a
load of another word, unordered without a full fence); then neither marks it and the block is a
miss, recomputed and dumped again by the next request (its stored shards skipped), which marks
it: a lost mark costs a recompute, never a wrong token.  A mark and its shards are evicted
independently: the mark first (it is touched only by loads) makes a miss; a shard first makes
a load fail with the not-found error (below), which UCM's RankConsistencyManager turns into
"stop looking this block up" until it is dumped again.  Loads touch the marks of the blocks they
read, so a block in use keeps its mark.

Missing blocks.  ``wait`` of a load raises ``UcmBlockNotFound`` when a block is missing (or
stored with another size); when UCM is importable it subclasses UCM's
``ucm.store.pipeline.errors.StoreNotFoundError`` (a RuntimeError), the only error UCM's
RankConsistencyManager marks blocks missing for.  Other failures raise ``UcmTaskFailed``.  Both
are UcmErrors and RuntimeErrors (what ``wait`` raised before).

Lifetime.  UCM's connectors never close their store: a finalizer (run when the store is
collected, or at process exit: multiprocessing's exit hook in a process it started, fork or
spawn, atexit elsewhere) stops the pool and detaches, so the rank is freed, not left "ready,
pid dead" until someone attaches.  A SIGKILL still leaves it for recovery.

Copies: a dump first waits for its prerequisite device event (dump_data), then copies each
tensor straight into the shard's owned slot and publishes it Ready only after its last copy
completed (a shard another worker is dumping is waited for, never written twice; one already
present is skipped; a failed copy publishes Failed).  Loads copy only entries that are Ready
and of the destination's size, and never write a byte of a block they refuse: read_many would
(it copies a payload shorter than its row, then reports the length), so it never reads into the
caller's memory.  Into one contiguous destination the stored blocks are pinned (get_many), their
lengths checked under the pins, then copied with one gather C call per 32 blocks; into
scattered tensors through a per-thread staging buffer (one read_many per 4 MiB), then one copy
per tensor of the good blocks.
Every copy releases the GIL (the C core's calls, and libc's memcpy called through cffi).
Tasks run on a small pool of threads owned by the store.

This module is the store and its task objects; beside it, one concept each: ``_ucm_config``
(the config keys, the segment name), ``_ucm_memory`` (block ids, tensors and addresses, the
copies) and ``_ucm_tasks`` (a task's plan and the work it does on a pool thread).
"""
from __future__ import annotations

import concurrent.futures
import itertools
import logging
import os
import multiprocessing.util as _mp_util
import threading
from typing import Any, Callable, Dict, List, NamedTuple, Optional

import numpy as np

from .core.cache import SlotCache
from ._core import ffi
from .core.errors import (CorruptSegment, IncompatibleSegment, NotAttached, SegmentNotFound,
                      UcmError)
# The names this module defined before its parts moved out stay importable from here (UCM's
# configs name ucmcache.ucm; bench/ucm_store.py takes _memcpy from it).
from ._ucm_config import (DEFAULT_BUFFER_SIZE, DEFAULT_MAX_RANKS, DEFAULT_THREADS,  # noqa: F401
                          DEFAULT_TIMEOUT_S, _Config, _WorkerSizes, segment_name)
from ._ucm_memory import UVA, _block_id, _memcpy, _Piece, _piece, _shards  # noqa: F401
from ._ucm_tasks import DUMP_CHUNK, JOIN_ROUNDS, STAGING_BYTES, TaskBodies, _Plan  # noqa: F401

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


class _Parts:
    """What a store holds that must be let go of when the store goes: its pool and its cache.
    Held by the store and by its finalizer, never referring back to the store (a finalizer
    that did would keep it alive)."""

    __slots__ = ("pool", "cache", "pid")

    def __init__(self) -> None:
        self.pool: Optional[concurrent.futures.ThreadPoolExecutor] = None
        self.cache: Optional[SlotCache] = None
        self.pid = os.getpid()

    def release(self) -> None:
        """Finish running tasks, stop the pool, detach (the rank is freed).  Nothing in a
        forked child: the parent's rank is the parent's to free (the child's cache object is
        unusable there anyway, DESIGN 5.6)."""
        if os.getpid() != self.pid:
            return
        pool, cache = self.pool, self.cache
        if pool is not None:
            pool.shutdown(wait=True)
        if cache is not None:
            try:
                cache.close()
            except (NotAttached, CorruptSegment):
                pass  # nothing left to free


class UcmCacheStore(TaskBodies, _StoreBase):
    """UCM's V1 KV store (``UcmKVStoreBaseV1``) over a ucmcache segment shared by every store
    that names the same segment.

    Config keys, as UCM's connectors pass them (unknown keys are ignored):

    - ``ucmcache_segment``: the segment's name.  Without it: a config from UCM's vLLM
      connector (it has ``tensor_layout``) or from SGLang's (no ``unique_id``) names
      ``ucm-<tensor_layout>-u<uid>``, shared by every engine of the host and stable across
      restarts (UCM's unique_id is a fresh uuid4 at every start: _ucm_config.default_segment
      says why); any other config names the segment after its ``unique_id`` (or
      ``engine_id``).
    - ``shard_size`` and ``block_size``: bytes per slot (one shard) and per block; a block has
      block_size / shard_size shards (UCM's layerwise connector: one per layer).  Needed by a
      worker store; a scheduler-side store takes the slot size from the segment.
    - ``tensor_size`` / ``tensor_size_list``: bytes behind each raw address of
      ``load_data``/``dump_data`` (tensors carry their own sizes).
    - ``buffer_size`` (bytes) or UCM's ``cache_buffer_capacity_gb`` (GiB; buffer_size wins):
      the segment's slot bytes (default 1 GiB), split evenly among ``ucmcache_max_ranks`` ranks
      (default 8).  More than /dev/shm holds is clamped to half of what is free, with a log
      line (``ucmcache.ucm``); too little for one slot per rank is SharedMemoryFull naming the
      key and what is free.  A segment that exists already is attached whatever its size.
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
        # connectors never call close()).  multiprocessing's Finalize, not weakref.finalize:
        # a worker process that multiprocessing forked (vLLM's default start method) ends with
        # os._exit after running multiprocessing's finalizers, so atexit never runs there;
        # these run there, at atexit in any other process, and on collection.
        self._finalizer = _mp_util.Finalize(self, parts.release, exitpriority=10)
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
        cache = None
        try:
            cache = SlotCache.attach(cfg.segment, timeout=0.0)
        except (SegmentNotFound, CorruptSegment, TimeoutError):
            pass  # none yet, or half-made (create() replaces it), or being made (create waits)
        if cache is None:
            try:
                cache = SlotCache.create(cfg.segment, slots_per_rank=sizes.fitted_slots_per_rank(log),
                                         slot_size=sizes.slot_size, max_ranks=cfg.max_ranks,
                                         exist_ok=True, timeout=cfg.timeout)
            except IncompatibleSegment:
                # Made meanwhile by another store with another capacity: attach to it.
                cache = SlotCache.attach(cfg.segment, timeout=cfg.timeout)
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
        copies through a slot are DMA (cudaHostRegister).  This machine has no GPU: the path is
        written and documented but has never run."""
        try:
            import sys
            torch = sys.modules.get("torch")
            if torch is None or not torch.cuda.is_available():
                return
        except Exception:
            return
        self._cuda = True
        seg = cache._seg
        try:
            addr = int(ffi.cast("uintptr_t", seg.base))
            torch.cuda.cudart().cudaHostRegister(addr, seg.layout.total_size, 0)
        except Exception:
            pass  # pageable copies still work, more slowly

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
