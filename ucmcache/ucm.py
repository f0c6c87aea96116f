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

Layout: a block's shard is its tensors laid end to end in one slot, keyed by (block id, shard
index).  ``lookup`` and ``lookup_on_prefix`` look at shard 0 of each block.

Copies: dumps copy each tensor straight into the block's owned slot and publish the block Ready
only after its last copy completed (a block another worker is dumping is waited for, never
written twice; one already present is skipped; a failed copy publishes Failed).  Loads copy
only entries that are Ready (a load never creates or waits for an entry): into a destination
that is one contiguous run of equal rows with one C call for the task (``read_many``), into
scattered tensors through one ``read_many`` into a staging buffer and then one copy per tensor.
Every copy releases the GIL (the C core's calls, and libc's memcpy called through cffi).
Tasks run on a small pool of threads owned by the store.
"""
from __future__ import annotations

import concurrent.futures
import hashlib
import itertools
import os
import re
import threading
from typing import Any, Callable, Dict, List, Optional

import cffi
import numpy as np

from ._cache import SlotCache
from ._core import ffi
from ._errors import CacheFull, LoadFailed, SegmentNotFound, UcmError

try:  # UCM's own base classes, when UCM is installed (it imports torch)
    from ucm.store.ucmstore_v1 import Task as _TaskBase
    from ucm.store.ucmstore_v1 import UcmKVStoreBaseV1 as _StoreBase
    HAVE_UCM = True
except Exception:  # not installed (or broken): duck-typed, same methods and signatures
    _TaskBase = object
    _StoreBase = object
    HAVE_UCM = False

__all__ = ["UcmCacheStore", "UcmCacheTask", "HAVE_UCM"]

DEFAULT_BUFFER_SIZE = 1 << 30   # segment data bytes when the config gives no buffer_size
DEFAULT_MAX_RANKS = 8           # stores attached at once (workers and scheduler-side stores)
DEFAULT_TIMEOUT_S = 30.0        # UCM's transfer_timeout_ms default (30000)
DEFAULT_THREADS = 2
DUMP_CHUNK = 32                 # blocks pinned (and owned) at once by one dump step
STAGING_BYTES = 4 << 20         # a scattered load's staging buffer per pool thread, at most
                                # (one slot at least): kept, and small enough to stay in cache
JOIN_ROUNDS = 3                 # a block another dump failed is taken over at most this often

_SEGMENT_RE = re.compile(r"[A-Za-z0-9_-]{1,64}")
_private_seq = itertools.count(1)
_task_seq = itertools.count(1)

# libc's memcpy through cffi's ABI mode: cffi releases the GIL around the call (ffi.memmove
# does not), so a task's copies run beside the engine's Python threads.
_abi = cffi.FFI()
_abi.cdef("void *memcpy(void *dest, const void *src, size_t n);")
_libc = _abi.dlopen(None)
_VOIDP = "void *"


def _memcpy(dst: int, src: int, n: int) -> None:
    if n:
        _libc.memcpy(_abi.cast(_VOIDP, dst), _abi.cast(_VOIDP, src), n)


# ---------------------------------------------------------------- config

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


# ---------------------------------------------------------------- blocks and their memory

def _block_id(b: object) -> bytes:
    if type(b) is bytes and len(b) == 16:
        return b
    if isinstance(b, str):
        b = b.encode("utf-8")
    if isinstance(b, (bytes, bytearray, memoryview)):
        raw = bytes(b)
        if len(raw) == 16:
            return raw
        return hashlib.blake2b(raw, digest_size=16, person=b"ucmcache.ucm").digest()
    if isinstance(b, (int, np.integer)) and not isinstance(b, bool):  # an int hash (vLLM's)
        return hashlib.blake2b(int(b).to_bytes(32, "little", signed=True), digest_size=16,
                               person=b"ucmcache.ucm").digest()
    raise TypeError(f"a block id must be bytes, got {type(b).__name__}")


def _key(block_id: bytes, shard: int):
    return block_id if shard == 0 else (block_id, shard)


def _shards(shard_index, n: int) -> List[int]:
    if shard_index is None:
        return [0] * n
    out = [int(s) for s in shard_index]
    if len(out) != n:
        raise ValueError(f"shard_index has {len(out)} entries for {n} block ids")
    for s in out:
        if not 0 <= s < 1 << 64:
            raise ValueError(f"a shard index must be in [0, 2**64), got {s}")
    return out


class _Piece:
    """One tensor of a block: host address and bytes, or a device tensor (CUDA path)."""

    __slots__ = ("addr", "nbytes", "device")

    def __init__(self, addr: int, nbytes: int, device: Any = None):
        self.addr = addr
        self.nbytes = nbytes
        self.device = device  # a torch CUDA tensor viewed as uint8, or None for host memory


def _piece(obj: Any, writable: bool, keep: list) -> _Piece:
    """A tensor's memory: torch tensors (CPU, or CUDA on a machine with CUDA), numpy arrays,
    anything with the buffer protocol, or anything with data_ptr() and a byte size."""
    if hasattr(obj, "data_ptr") and not isinstance(obj, np.ndarray):
        if hasattr(obj, "is_contiguous") and not obj.is_contiguous():
            raise ValueError("tensors must be contiguous (call .contiguous() first)")
        if hasattr(obj, "nbytes"):
            nbytes = int(obj.nbytes)
        else:
            nbytes = int(obj.numel()) * int(obj.element_size())
        device = getattr(getattr(obj, "device", None), "type", "cpu")
        keep.append(obj)
        if device == "cpu":
            return _Piece(int(obj.data_ptr()), nbytes)
        if device == "cuda":  # untested here (no GPU): see _device_copy
            return _Piece(int(obj.data_ptr()), nbytes, obj.reshape(-1).view(_torch().uint8))
        raise ValueError(f"tensors on {device!r} are not supported (CPU, or CUDA)")
    if isinstance(obj, np.ndarray):
        if not obj.flags.c_contiguous:
            raise ValueError("arrays must be C-contiguous (np.ascontiguousarray first)")
        if writable and not obj.flags.writeable:
            raise ValueError("a load's destination array is read-only")
        keep.append(obj)
        return _Piece(int(obj.ctypes.data), int(obj.nbytes))
    try:
        buf = ffi.from_buffer("char[]", obj, require_writable=writable)
    except TypeError:
        raise TypeError(f"a tensor must be a torch tensor, a numpy array or a "
                        f"{'writable ' if writable else ''}buffer, got "
                        f"{type(obj).__name__}") from None
    keep.append(buf)
    return _Piece(int(ffi.cast("uintptr_t", buf)), len(buf))


def _torch():
    import torch  # only on the CUDA path: the package itself never needs torch
    return torch


def _host_tensor(addr: int, nbytes: int):
    """A torch uint8 CPU tensor over host memory at addr (the slot or the staging buffer)."""
    return _torch().frombuffer(ffi.buffer(ffi.cast("char *", addr), nbytes),
                               dtype=_torch().uint8)


UVA = "uva"  # a raw address on a CUDA machine: host or device, cudaMemcpyDefault decides


def _copy_in(dst: int, p: _Piece) -> None:
    """A piece's bytes into host memory at dst (a dump into its slot)."""
    if p.device is None:
        _memcpy(dst, p.addr, p.nbytes)
    elif p.device is UVA:
        _cuda_memcpy(dst, p.addr, p.nbytes)
    else:  # device tensor -> pinned segment, synchronous (the block is published after it)
        _host_tensor(dst, p.nbytes).copy_(p.device)


def _copy_out(p: _Piece, src: int) -> None:
    """Host memory at src into a piece (a load)."""
    if p.device is None:
        _memcpy(p.addr, src, p.nbytes)
    elif p.device is UVA:
        _cuda_memcpy(p.addr, src, p.nbytes)
    else:
        p.device.copy_(_host_tensor(src, p.nbytes))


_cudart = None


def _cuda_memcpy(dst: int, src: int, n: int) -> None:
    """cudaMemcpy(dst, src, n, cudaMemcpyDefault): under unified addressing it copies between
    any host and device pointers (ctypes releases the GIL).  Untested here (no GPU)."""
    global _cudart
    import ctypes
    if _cudart is None:
        _cudart = _load_cudart(ctypes)
    r = _cudart.cudaMemcpy(ctypes.c_void_p(dst), ctypes.c_void_p(src), ctypes.c_size_t(n), 4)
    if r != 0:
        raise RuntimeError(f"cudaMemcpy of {n} bytes failed with CUDA error {r}")


def _load_cudart(ctypes):
    import glob
    names = ["libcudart.so", "libcudart.so.12", "libcudart.so.11.0"]
    try:
        torch_dir = os.path.dirname(os.path.dirname(_torch().__file__))
        names += sorted(glob.glob(os.path.join(torch_dir, "nvidia", "cuda_runtime", "lib",
                                               "libcudart.so*")))
        names += sorted(glob.glob(os.path.join(torch_dir, "torch", "lib", "libcudart*.so*")))
    except Exception:
        pass
    for name in names:
        try:
            lib = ctypes.CDLL(name)
            lib.cudaMemcpy.restype = ctypes.c_int
            return lib
        except OSError:
            continue
    raise RuntimeError("raw addresses on a CUDA machine need libcudart (cudaMemcpy), and none "
                       f"could be loaded (tried {names})")


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


class _Plan:
    """A task's blocks: keys and, for each block, its pieces (tensors) in order."""

    __slots__ = ("ids", "shards", "keys", "pieces", "totals", "keep", "any_device")

    def __init__(self, ids, shards, pieces, keep):
        self.ids = ids
        self.shards = shards
        self.keys = [_key(b, s) for b, s in zip(ids, shards)]
        self.pieces = pieces
        self.totals = [sum(p.nbytes for p in row) for row in pieces]
        self.keep = keep
        self.any_device = any(p.device is not None for row in pieces for p in row)

    def contiguous_base(self) -> Optional[int]:
        """The start of the destination when every piece of every block lies in one run of
        equal rows (block i at base + i * row), else None."""
        if self.any_device or not self.pieces:
            return None
        row = self.totals[0]
        sizes0 = [p.nbytes for p in self.pieces[0]]
        base = self.pieces[0][0].addr
        for i, pieces in enumerate(self.pieces):
            at = base + i * row
            if len(pieces) != len(sizes0):
                return None
            for p, n in zip(pieces, sizes0):
                if p.addr != at or p.nbytes != n:
                    return None
                at += n
        return base


# ---------------------------------------------------------------- the store

class UcmCacheStore(_StoreBase):
    """UCM's V1 KV store (``UcmKVStoreBaseV1``) over a ucmcache segment shared by every store
    with the same ``unique_id``.

    Config keys, as UCM's connectors pass them (unknown keys are ignored):

    - ``unique_id`` (``engine_id`` accepted): the segment's name; ``ucmcache_segment``, if
      given, overrides both (a name every engine instance shares whatever its engine id).
    - ``shard_size`` or ``block_size``: bytes per slot (one block's shard).
    - ``tensor_size`` / ``tensor_size_list``: bytes behind each raw address of
      ``load_data``/``dump_data`` (tensors carry their own sizes).
    - ``buffer_size``: the segment's data bytes (default 1 GiB), split evenly among
      ``ucmcache_max_ranks`` ranks (default 8): each store attached takes one rank and writes
      only into its own range; every store reads all of them.
    - ``share_buffer_enable`` (default True): attach to, or create, the one segment named by the
      id; False: a private segment for this store alone (its name is removed at once, so it
      disappears with the store's process).
    - ``local_rank_size``: accepted (the ranks sharing a buffer in UCM); sharing here is by id.
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
        self._cache: Optional[SlotCache] = None
        self._pool: Optional[concurrent.futures.ThreadPoolExecutor] = None
        self._closed = False
        self._test_points: Dict[str, Callable[[int], None]] = {}
        self._cuda = False
        if cfg.device_id < 0:
            self._try_attach()  # the scheduler side: attach if the segment exists, never create
            return
        if cfg.share:
            self._cache = SlotCache.create(cfg.segment, slots_per_rank=cfg.slots_per_rank,
                                           slot_size=cfg.slot_size, max_ranks=cfg.max_ranks,
                                           exist_ok=True, timeout=cfg.timeout)
        else:
            name = f"{cfg.segment[:40]}-p{os.getpid()}-{next(_private_seq)}"
            self._cache = SlotCache.create(name, slots_per_rank=cfg.slots_per_rank *
                                           cfg.max_ranks, slot_size=cfg.slot_size, max_ranks=1)
            SlotCache.unlink(name)  # private: its mapping lives as long as this store
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=cfg.threads, thread_name_prefix=f"ucmcache-ucm-{cfg.segment[:16]}")
        self._register_cuda()

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
                    self._cache = SlotCache.attach(self._cfg.segment, timeout=0.0)
                except (SegmentNotFound, TimeoutError):
                    pass  # not made yet (or still being made): the next lookup tries again
            return self._cache

    def _reader(self) -> Optional[SlotCache]:
        if self._closed:
            raise UcmError("this UcmCacheStore is closed")
        c = self._cache
        return c if c is not None else self._try_attach()

    def lookup(self, block_ids: List[bytes]) -> List[bool]:
        """Whether each block (its shard 0) is stored: one C call, no pin."""
        ids = [_block_id(b) for b in block_ids]
        c = self._reader()
        if c is None or not ids:
            return [False] * len(ids)
        return c.exist(ids)

    def lookup_on_prefix(self, block_ids: List[bytes]) -> int:
        """The index of the last of the leading blocks that are stored, -1 if none (one C
        call)."""
        ids = [_block_id(b) for b in block_ids]
        c = self._reader()
        if c is None or not ids:
            return -1
        return c.exist_prefix(ids) - 1

    def lookup_on_reverse(self, block_ids: List[bytes]) -> int:
        """The index of the last block that is stored, -1 if none (one C call)."""
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
        laid end to end in the slot).  wait() raises naming every block that is missing (not
        stored, evicted, or not published yet: a load never waits for or creates an entry),
        whose tensors are left as they were, or that was stored with another size."""
        return self._submit("load", block_ids, shard_index, self._tensor_pieces(
            block_ids, dst_tensor, writable=True))

    def dump(self, block_ids: List[bytes], shard_index: List[int],
             src_tensor: List[List[Any]]) -> UcmCacheTask:
        """Store each block's tensors end to end in one slot keyed by (block id, shard index).
        A block already stored is skipped; one another worker is dumping is waited for, not
        written twice; each block is published only after its copy completed."""
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
        """dump() with raw addresses (see load_data).  ``prerequisite_handle`` (a device event
        to wait for before copying) must be 0: device work is finished before the call."""
        if prerequisite_handle:
            raise ValueError("prerequisite_handle is not supported: synchronize before dump_data")
        return self._submit("dump", block_ids, shard_index, self._addr_pieces(block_ids,
                                                                              src_addr))

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
        self._worker()
        arr = np.asarray(addrs, dtype=np.uint64)
        if arr.ndim == 1:
            arr = arr.reshape(-1, 1)
        if arr.ndim != 2 or arr.shape[0] != len(block_ids):
            raise ValueError(f"addresses must be n_blocks x n_tensors, got shape {arr.shape} "
                             f"for {len(block_ids)} block ids")
        sizes = self._cfg.column_sizes(arr.shape[1])
        on_device = self._cuda
        pieces = []
        for row in arr.tolist():
            if on_device:  # untested here: host (SGLang) or device (vLLM) addresses alike
                pieces.append([_Piece(a, n, UVA) for a, n in zip(row, sizes)])
            else:
                pieces.append([_Piece(a, n) for a, n in zip(row, sizes)])
        return pieces, [addrs]

    def _worker(self) -> None:
        if self._closed:
            raise UcmError("this UcmCacheStore is closed")
        if self._pool is None:
            raise UcmError("a scheduler-side store (device_id -1) only looks up: load and dump "
                           "need a worker store (device_id >= 0)")

    def _submit(self, kind: str, block_ids, shard_index, pieces_keep) -> UcmCacheTask:
        self._worker()
        pieces, keep = pieces_keep
        ids = [_block_id(b) for b in block_ids]
        plan = _Plan(ids, _shards(shard_index, len(ids)), pieces, keep)
        if kind == "dump":
            for i, total in enumerate(plan.totals):
                if total > self._cfg.slot_size:
                    raise ValueError(f"block {i}'s tensors hold {total} bytes, more than a slot "
                                     f"(shard_size {self._cfg.slot_size})")
        run = self._run_dump if kind == "dump" else self._run_load
        future = self._pool.submit(self._guard, run, plan)
        return UcmCacheTask(next(_task_seq), kind, ids, plan.shards, future)

    def wait(self, task: UcmCacheTask) -> None:
        """Block until the task is done.  Raises RuntimeError naming every block that failed or
        was missing (a task's waits are bounded by transfer_timeout_ms, so this returns)."""
        failures: Dict[int, str] = task._future.result()
        if failures:
            shown = []
            for i in sorted(failures)[:8]:
                shown.append(f"block {i} (id {task.block_ids[i].hex()}, shard {task.shards[i]}):"
                             f" {failures[i]}")
            more = "" if len(failures) <= 8 else f"; and {len(failures) - 8} more"
            raise RuntimeError(f"{task.kind} task {task.task_id}: {len(failures)} of "
                               f"{len(task.block_ids)} block(s) failed: " + "; ".join(shown)
                               + more)

    def check(self, task: UcmCacheTask) -> bool:
        """True once the task is done (successfully or not: wait() says which); never
        blocks."""
        return task._future.done()

    # ---------------------------------------------------------------- task bodies

    def _guard(self, run, plan: _Plan) -> Dict[int, str]:
        # failures[i]: None once block i is done, else why it failed; a block never reached
        # when something unexpected is raised fails with that exception.
        failures: Dict[int, Optional[str]] = {}
        try:
            run(plan, failures)
        except BaseException as e:  # anything unexpected fails the blocks not finished
            for i in range(len(plan.keys)):
                failures.setdefault(i, f"{type(e).__name__}: {e}")
        finally:
            plan.keep = None
        return {i: failures[i] for i in failures if failures[i] is not None}

    def _point(self, name: str, i: int) -> None:
        fn = self._test_points.get(name)
        if fn is not None:
            fn(i)

    def _run_load(self, plan: _Plan, failures: Dict[int, str]) -> None:
        cache = self._cache
        n = len(plan.keys)
        base = plan.contiguous_base()
        if base is not None:
            row = plan.totals[0]
            out = ffi.buffer(ffi.cast("char *", base), n * row)
            try:
                lens = cache.read_many(plan.keys, out)  # one C call for the whole task
            except ValueError:
                lens = None  # a stored shard is larger than a row: sort it out via staging
            if lens is not None:
                for i in range(n):
                    self._check_len(i, int(lens[i]), row, failures)
                return
        self._load_staged(plan, failures)

    @staticmethod
    def _check_len(i: int, got: int, want: int, failures: Dict[int, str]) -> bool:
        if got == want:
            failures[i] = None  # done
            return True
        if got < 0:
            failures[i] = "missing (not stored, evicted, or still being dumped)"
        else:
            failures[i] = (f"stored with {got} bytes, the destination tensors hold {want} "
                           "(another layout?)")
        return False

    def _staging(self, nbytes: int, pinned: bool):
        """This pool thread's staging buffer (kept: a fresh one would page-fault every task):
        (address, owner object)."""
        local = self._local
        have = getattr(local, "stage", None)
        if have is None or have[2] < nbytes or have[3] != pinned:
            if pinned:  # for device copies (untested here)
                t = _torch().empty(nbytes, dtype=_torch().uint8, pin_memory=True)
                have = (int(t.data_ptr()), t, nbytes, True)
            else:
                a = np.empty(nbytes, dtype=np.uint8)
                have = (int(a.ctypes.data), a, nbytes, False)
            local.stage = have
        return have[0], have[1]

    def _load_staged(self, plan: _Plan, failures: Dict[int, str]) -> None:
        cache = self._cache
        row = cache.slot_size
        per = max(1, STAGING_BYTES // row)
        n = len(plan.keys)
        k_max = min(per, n)
        stage_addr, keep = self._staging(k_max * row, plan.any_device and self._cuda)
        for start in range(0, n, per):
            stop = min(n, start + per)
            k = stop - start
            out = ffi.buffer(ffi.cast("char *", stage_addr), k * row)
            lens = cache.read_many(plan.keys[start:stop], out)  # one C call per chunk
            for r in range(k):
                i = start + r
                if not self._check_len(i, int(lens[r]), plan.totals[i], failures):
                    continue
                at = stage_addr + r * row
                for p in plan.pieces[i]:
                    _copy_out(p, at)
                    at += p.nbytes
            del out
        del keep

    def _run_dump(self, plan: _Plan, failures: Dict[int, str]) -> None:
        cache = self._cache
        n = len(plan.keys)
        for start in range(0, n, DUMP_CHUNK):
            chunk = list(range(start, min(n, start + DUMP_CHUNK)))
            try:
                batch = cache.get_many([plan.keys[i] for i in chunk], timeout=self._cfg.timeout)
            except CacheFull:
                joined = chunk  # not all at once: one by one, each may still find room
            else:
                joined = []
                with batch:
                    owner = batch.owner
                    states = batch.state
                    for pos, i in enumerate(chunk):
                        if owner[pos]:
                            self._fill(i, plan, lambda pos=pos: batch.data(pos),
                                       lambda nb, pos=pos: batch.ready(pos, nb),
                                       lambda msg, pos=pos: batch.fail(pos, msg), failures)
                        elif states[pos] == "ready":
                            failures[i] = None  # stored already: skipped
                        else:
                            joined.append(i)  # another dump has it (or our own duplicate)
            for i in joined:
                self._dump_one(i, plan, failures)

    def _dump_one(self, i: int, plan: _Plan, failures: Dict[int, str]) -> None:
        """A block another caller was dumping: wait for it; if that dump failed (or its worker
        died), take it over.  Bounded by the timeout and JOIN_ROUNDS."""
        cache = self._cache
        timeout = self._cfg.timeout
        self._point("joined", i)
        for _ in range(JOIN_ROUNDS):
            try:
                h = cache.get(plan.keys[i], timeout=timeout)
            except UcmError as e:  # CacheFull, LockTimeout: this block only
                failures[i] = f"{type(e).__name__}: {e}"
                return
            with h:
                if h.owner:
                    self._fill(i, plan, lambda: h.data, h.ready, h.fail, failures)
                    return
                try:
                    h.wait(timeout)
                    failures[i] = None  # stored by the other dump
                    return
                except LoadFailed:
                    continue  # that dump failed: the next get makes us the owner
                except TimeoutError:
                    failures[i] = (f"another worker's dump of this block did not finish within "
                                   f"{timeout} s")
                    return
        failures[i] = f"every dump of this block failed ({JOIN_ROUNDS} tries)"

    def _fill(self, i: int, plan: _Plan, view: Callable[[], memoryview],
              ready: Callable[[int], None], fail: Callable[[str], None],
              failures: Dict[int, str]) -> None:
        """Copy block i's pieces into its owned slot, then publish it Ready; Failed if
        anything goes wrong before that, so nobody waits on it."""
        try:
            mv = view()
            p = ffi.from_buffer(mv)
            slot = int(ffi.cast("uintptr_t", p))
            ffi.release(p)  # the address stays valid: the slot is pinned (ours) until we publish
            del mv
            at = slot
            for piece in plan.pieces[i]:
                _copy_in(at, piece)
                at += piece.nbytes
            self._point("after_copy", i)
        except BaseException as e:
            failures[i] = f"dump failed: {type(e).__name__}: {e}"
            try:
                fail(failures[i])
            except UcmError:
                pass
            if not isinstance(e, Exception):
                raise
            return
        try:
            ready(plan.totals[i])
        except UcmError as e:  # no longer ours (a recovery took it): never published by us
            failures[i] = f"dump not published: {e}"
            return
        failures[i] = None
        self._point("after_publish", i)

    # ---------------------------------------------------------------- CUDA (untested here)

    def _register_cuda(self) -> None:
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
        seg = self._cache._seg
        try:
            addr = int(ffi.cast("uintptr_t", seg.base))
            torch.cuda.cudart().cudaHostRegister(addr, seg.layout.total_size, 0)
        except Exception:
            pass  # pageable copies still work, more slowly

    # ---------------------------------------------------------------- lifecycle

    def close(self) -> None:
        """Finish running tasks, stop the pool, detach (a private segment goes away)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        if self._cache is not None:
            self._cache.close()

    def __enter__(self) -> "UcmCacheStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        role = "scheduler" if self._cfg.device_id < 0 else f"worker device {self._cfg.device_id}"
        return (f"<UcmCacheStore segment={self._cfg.segment!r} {role} "
                f"slot={self._cfg.slot_size}B {'closed' if self._closed else 'open'}>")
