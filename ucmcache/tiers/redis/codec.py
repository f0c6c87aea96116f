"""Tier 2's values and names: the value header, the Redis key of a cache key, lease tokens.

A value is a header (magic, format, layout version, flags, payload length, crc32, a fingerprint
of its Redis key) and the payload: anything that is not a whole, valid value for the key it was
read from (corrupt, truncated, oversized, another key's or namespace's) decodes to None, a miss.
Keys are ``ucm:v<layout>:<namespace>:{<id hex>:<offset>}`` (the braces a Cluster hash tag, so a
value and its lease ``...:lease`` share a hash slot).
"""
from __future__ import annotations

import hashlib
import os
import struct
import zlib
from typing import Any, Optional

from ..._core import lib

LAYOUT_VERSION = int(lib.UCM_LAYOUT_VERSION)
MAGIC = b"UCT2"
FORMAT = 1
# magic, format, layout version, flags, payload length, crc32, fingerprint of the Redis key
HEADER = struct.Struct("<4sBBHII8s")
HEADER_SIZE = HEADER.size  # 24


def _fingerprint(vkey: bytes) -> bytes:
    return hashlib.blake2b(vkey, digest_size=8).digest()


def encode_into(vkey: bytes, buf: bytearray) -> None:
    """Fill the header of buf (HEADER_SIZE bytes, then the payload) for Redis key vkey."""
    n = len(buf) - HEADER_SIZE
    fp = _fingerprint(vkey)
    HEADER.pack_into(buf, 0, MAGIC, FORMAT, LAYOUT_VERSION & 0xFF, 0, n, 0, fp)
    mv = memoryview(buf)
    crc = zlib.crc32(mv[HEADER_SIZE:], zlib.crc32(fp, zlib.crc32(mv[:12])))
    struct.pack_into("<I", buf, 12, crc)
    mv.release()


def encode(vkey: bytes, payload: bytes) -> bytes:
    buf = bytearray(HEADER_SIZE + len(payload))
    buf[HEADER_SIZE:] = payload
    encode_into(vkey, buf)
    return bytes(buf)


def decode(vkey: bytes, blob: Any, limit: int) -> Optional[memoryview]:
    """The payload of a stored value, or None when it is not a whole, valid value for vkey of
    at most limit bytes."""
    if not isinstance(blob, (bytes, bytearray)) or len(blob) < HEADER_SIZE:
        return None
    magic, fmt, layout, flags, n, crc, fp = HEADER.unpack_from(blob)
    if magic != MAGIC or fmt != FORMAT or layout != (LAYOUT_VERSION & 0xFF) or flags != 0:
        return None
    if n != len(blob) - HEADER_SIZE or n > limit or fp != _fingerprint(vkey):
        return None
    mv = memoryview(blob)
    if zlib.crc32(mv[HEADER_SIZE:], zlib.crc32(fp, zlib.crc32(mv[:12]))) != crc:
        return None
    return mv[HEADER_SIZE:]


def escape_namespace(namespace: str) -> str:
    # '{' and '}' would change the Cluster hash tag; ':' stays readable.
    return namespace.replace("%", "%25").replace("{", "%7B").replace("}", "%7D")


def lease_token() -> bytes:
    return os.urandom(12).hex().encode()
