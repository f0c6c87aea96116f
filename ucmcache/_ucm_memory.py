"""UcmCacheStore's blocks and their memory (``ucmcache.ucm``): block ids and shard keys, the
tensors or raw addresses of a block (its pieces), and the copies between a piece and host memory
at a slot or a staging buffer, each releasing the GIL.
"""
from __future__ import annotations

import hashlib
import os
from typing import Any, List

import cffi
import numpy as np

from ._core import ffi

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
