"""Segment copies in one C call (``ucmcache._crc``, csrc/ucm_copy.c): a list of (dst, src, len)
segments copied with the GIL released, the CRC-32C optionally folded into the same pass.  The
copy step of ucmcache.vllm's block moves between a paged KV cache and the slots of a segment:
the caller pins the slots, checks them and computes every address; this moves the bytes."""
from __future__ import annotations

from typing import Optional

import numpy as np

from .._crc import ffi, lib


def _u64(name: str, a: np.ndarray, n: int):
    if not isinstance(a, np.ndarray) or a.dtype != np.uint64 or a.ndim != 1 or \
            not a.flags.c_contiguous:
        raise TypeError(f"copy_segments: {name} must be a 1-d contiguous numpy uint64 array, "
                        f"got {type(a).__name__} {getattr(a, 'dtype', '')}")
    if len(a) != n:
        raise ValueError(f"copy_segments: {name} has {len(a)} entries, dst has {n}")
    return ffi.from_buffer("uint64_t[]", a)


def copy_segments(dst: np.ndarray, src: np.ndarray, lens: np.ndarray,
                  crcs: Optional[np.ndarray] = None, per: int = 1, *,
                  streaming: bool = False) -> None:
    """Copy ``lens[i]`` bytes from address ``src[i]`` to address ``dst[i]`` for every i (numpy
    uint64 arrays of one length).  With ``crcs`` (a writable uint32 array of ceil(n / per)
    entries), the CRC-32C of segment i continues ``crcs[i // per]``: ``per`` consecutive
    segments are one block's pieces, in order.  The addresses are trusted: the caller owns them
    (a pinned slot, a KV cache tensor it holds).  ``streaming``: the destination is written
    with stores that bypass the cache (x86-64), for a destination this process does not read
    next (a slot a save fills: no read of each line before its write; bench/kv_io.py
    --evict-mb); every byte is visible to other processes when this returns."""
    n = len(dst) if isinstance(dst, np.ndarray) else -1
    d = _u64("dst", dst, n)
    s = _u64("src", src, n)
    ln = _u64("lens", lens, n)
    if isinstance(per, bool) or not isinstance(per, int) or per < 1:
        raise ValueError(f"copy_segments: per must be an int >= 1, got {per!r}")
    if crcs is None:
        c = ffi.NULL
    else:
        if not isinstance(crcs, np.ndarray) or crcs.dtype != np.uint32 or crcs.ndim != 1 or \
                not crcs.flags.c_contiguous or not crcs.flags.writeable:
            raise TypeError("copy_segments: crcs must be a writable 1-d contiguous numpy uint32 "
                            "array")
        if len(crcs) != -(-n // per):
            raise ValueError(f"copy_segments: crcs has {len(crcs)} entries; {n} segments of "
                             f"{per} per block need {-(-n // per)}")
        c = ffi.from_buffer("uint32_t[]", crcs)
    if n:
        (lib.ucm_copy_segments_streaming if streaming else lib.ucm_copy_segments)(
            n, d, s, ln, c, per)
