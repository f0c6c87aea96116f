"""The disk tier's block file: one file per key, its own format and version (DESIGN 4.14).

A block file is a 64-byte header followed by the payload.  The header carries the key itself
(the fingerprint is the whole key: 16-byte block id and offset), the payload's length and
CRC-32C, and a CRC-32C of the header.  A reader serves a file only when every one of these
checks out and the file's size is exactly header + length; anything else is a miss (counted in
``t2_bad_values``), never bytes of another key or a torn write.  Writers write a temporary file
and rename it into place, so a file at a block's name was complete when it was named; the
checks on read cover what rename does not (a power loss before the data reached the disk, a
file copied in by hand, a bit flip).

The format is versioned apart from the segment's layout: a block written by any build whose
``FORMAT_VERSION`` is this one is read by this one, whatever their segment layouts.

Header, little-endian (offsets in bytes)::

     0  magic          8s   b"UCMDBLK\\0"
     8  version        u16  FORMAT_VERSION
    10  header_size    u16  64
    12  flags          u32  0 (no flag defined)
    16  block_id       16s
    32  offset         u64  the key's offset
    40  length         u64  payload bytes
    48  payload_crc    u32  CRC-32C of the payload
    52  reserved       8s   zero
    60  header_crc     u32  CRC-32C of bytes 0..59
"""
from __future__ import annotations

import struct
from typing import Optional, Tuple

from ...core.checksum import crc32c

MAGIC = b"UCMDBLK\0"
FORMAT_VERSION = 1
HEADER_SIZE = 64
SUFFIX = ".ucb"
_HEADER = struct.Struct("<8sHHI16sQQI8s")  # bytes 0..59; header_crc follows
assert _HEADER.size == 60


class BadBlock(Exception):
    """A block file that must not be served; the message says which check failed."""


def encode_header(block_id: bytes, offset: int, payload) -> bytes:
    """The 64-byte header of a block file holding payload for (block_id, offset)."""
    head = _HEADER.pack(MAGIC, FORMAT_VERSION, HEADER_SIZE, 0, block_id, offset,
                        len(payload) if not isinstance(payload, memoryview) else payload.nbytes,
                        crc32c(payload), b"\0" * 8)
    return head + struct.pack("<I", crc32c(head))


def decode(buf, block_id: Optional[bytes], offset: Optional[int],
           limit: Optional[int] = None) -> Tuple[bytes, int, memoryview]:
    """(block_id, offset, payload view) of a whole block file read into buf, or BadBlock.
    With block_id/offset given, the file must hold that key; with limit, at most limit bytes."""
    mv = memoryview(buf)
    if mv.nbytes < HEADER_SIZE:
        raise BadBlock(f"file of {mv.nbytes} bytes is shorter than the {HEADER_SIZE}-byte header")
    magic, version, hsize, _flags, bid, off, length, pcrc, _r = _HEADER.unpack_from(mv, 0)
    if magic != MAGIC:
        raise BadBlock(f"magic {magic!r}, expected {MAGIC!r}")
    (hcrc,) = struct.unpack_from("<I", mv, 60)
    if crc32c(mv[:60]) != hcrc:
        raise BadBlock("header checksum mismatch")
    if version != FORMAT_VERSION or hsize != HEADER_SIZE:
        raise BadBlock(f"format version {version} (header {hsize} B), this build reads "
                       f"version {FORMAT_VERSION} ({HEADER_SIZE} B)")
    if block_id is not None and (bid != block_id or off != offset):
        raise BadBlock(f"file holds key ({bid.hex()}, {off}), expected "
                       f"({block_id.hex()}, {offset})")
    if mv.nbytes != HEADER_SIZE + length:
        raise BadBlock(f"file is {mv.nbytes} bytes, header says {HEADER_SIZE} + {length}")
    if limit is not None and length > limit:
        raise BadBlock(f"payload of {length} bytes exceeds the slot size {limit}")
    payload = mv[HEADER_SIZE:]
    if crc32c(payload) != pcrc:
        raise BadBlock("payload checksum mismatch")
    return bid, off, payload


def file_name(block_id: bytes, offset: int) -> Tuple[str, str]:
    """(fan-out directory, file name) of a key's block file: 256 directories by the id's first
    byte, so no directory holds more than a 256th of the blocks."""
    return block_id[:1].hex(), f"{block_id.hex()}-{offset:x}{SUFFIX}"


def parse_name(name: str) -> Optional[Tuple[bytes, int]]:
    """The key a block file name stands for, or None for a name that is not a block file's."""
    if not name.endswith(SUFFIX):
        return None
    stem = name[:-len(SUFFIX)]
    hexid, sep, hexoff = stem.partition("-")
    if not sep or len(hexid) != 32:
        return None
    try:
        return bytes.fromhex(hexid), int(hexoff, 16)
    except ValueError:
        return None
