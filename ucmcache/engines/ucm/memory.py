"""UcmCacheStore's blocks and their memory (``ucmcache.ucm``): block ids and shard keys, the
tensors or raw addresses of a block (its pieces), the copies between a piece and host memory
at a slot or a staging buffer, each releasing the GIL, and the wait for a device event.

Keys.  A block of one shard (UCM's direct connector: shard_size = block_size) is stored under
(block id, 0), which is also what lookups ask for.  A block of n > 1 shards (the layerwise
connector: shard l is layer l) stores shard s under (block id, 1 + s) and, once all n are
stored, a small *complete mark* under (block id, 0): lookups keep asking one key per block,
and only a whole block answers (see store.py, "Blocks of several shards").
"""
from __future__ import annotations

import hashlib
import os
import struct
from typing import Any, List

import cffi
import numpy as np

from ..._core import ffi

# libc's memcpy through cffi's ABI mode: cffi releases the GIL around the call (ffi.memmove
# does not), so a task's copies run beside the engine's Python threads.
_abi = cffi.FFI()
_abi.cdef("void *memcpy(void *dest, const void *src, size_t n);")
_libc = _abi.dlopen(None)
_VOIDP = "void *"


def _memcpy(dst: int, src: int, n: int) -> None:
    if n:
        _libc.memcpy(_abi.cast(_VOIDP, dst), _abi.cast(_VOIDP, src), n)


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


def _key(block_id: bytes, shard: int, shards: int):
    """Where shard `shard` of a block of `shards` shards is stored (see the module's note)."""
    return block_id if shards == 1 else (block_id, 1 + shard)


def _complete_mark(shards: int) -> bytes:
    """A complete mark's payload: a tag and the block's shard count (for ucmcache inspect and
    a reader's sanity; lookups only ask whether the mark is Ready)."""
    return struct.pack("<8sQ", b"ucmblock", shards)


def _shards(shard_index, n: int, shards: int, why: str) -> List[int]:
    """The shard index of each of n blocks, each checked against the block's shard count
    (`why` says where that count comes from)."""
    if shard_index is None:
        return [0] * n
    out = [int(s) for s in shard_index]
    if len(out) != n:
        raise ValueError(f"shard_index has {len(out)} entries for {n} block ids")
    for s in out:
        if not 0 <= s < shards:
            raise ValueError(f"shard index {s} is out of range: blocks here have {shards} "
                             f"shard{'s' if shards != 1 else ''} ({why})")
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


def wait_event(handle: int) -> None:
    """Block this thread until the device event behind ``handle`` (a ``cudaEvent_t``, as UCM's
    CudaDevice.get_event_handle returns ``int(torch.cuda.Event().cuda_event)``) has completed:
    cudaEventSynchronize.  UCM's cache store makes its copy stream wait for the event
    (cudaStreamWaitEvent, ucm/store/cache/cc/dump_queue.cc) before its device-to-host copies;
    this store's copies are synchronous calls on a pool thread, so the thread waits instead
    (ctypes releases the GIL).  Untested here (no GPU) but through a stand-in libcudart."""
    global _cudart
    import ctypes
    if _cudart is None:
        _cudart = _load_cudart(ctypes)
    r = _cudart.cudaEventSynchronize(ctypes.c_void_p(handle))
    if r != 0:
        raise RuntimeError(f"cudaEventSynchronize of prerequisite_handle {handle:#x} failed with "
                           f"CUDA error {r}")


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
            lib.cudaEventSynchronize.restype = ctypes.c_int
            return lib
        except OSError:
            continue
    raise RuntimeError("raw addresses and device events on a CUDA machine need libcudart "
                       "(cudaMemcpy, cudaEventSynchronize), and none "
                       f"could be loaded (tried {names})")
