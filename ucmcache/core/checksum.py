"""CRC-32C (Castagnoli) over any contiguous buffer, in C (``ucmcache._crc``): the checksum of
ucmcache.vllm's block format.  On x86-64 with SSE4.2 it runs on the crc32 instruction, three
streams at a time; elsewhere on slicing-by-8 tables.  ``value`` continues a checksum, so one
can be summed piece by piece: ``crc32c(b, crc32c(a)) == crc32c(a + b)``.  The GIL is released
while it runs (cffi)."""
from __future__ import annotations

from typing import Any

from .._crc import ffi, lib


def crc32c(data: Any, value: int = 0) -> int:
    """The CRC-32C of ``data`` (bytes, bytearray, memoryview, a contiguous numpy array...),
    continuing ``value``."""
    buf = ffi.from_buffer(data)
    return int(lib.ucm_crc32c(value & 0xFFFFFFFF, buf, len(buf)))


def crc32c_soft(data: Any, value: int = 0) -> int:
    """The same from the tables alone: the reference the instruction path is tested against."""
    buf = ffi.from_buffer(data)
    return int(lib.ucm_crc32c_soft(value & 0xFFFFFFFF, buf, len(buf)))


def hardware() -> bool:
    """Whether crc32c runs on the CPU's crc32 instruction here."""
    return bool(lib.ucm_crc32c_hardware())
