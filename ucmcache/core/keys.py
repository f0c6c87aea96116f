"""Keys: a 16-byte block id plus an offset, stored in a slot as three 64-bit words."""
from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Iterable, List, Tuple, Union, cast, overload

import numpy as np

Key = Union[bytes, Tuple[bytes, int]]

_MAX_OFFSET = (1 << 64) - 1


def split_key(key: object) -> Tuple[bytes, int]:
    """(id16, offset) for a key, or TypeError/ValueError naming what is wrong.

    A key is a block id (bytes, or a bytearray/memoryview, of exactly 16 bytes) or the tuple
    (block id, offset).  Nothing else: a 16-element array of wider items is 64 bytes, not an id."""
    if type(key) is bytes and len(key) == 16:
        return key, 0
    if isinstance(key, tuple):
        if len(key) != 2:
            raise TypeError(f"a key tuple must be (16-byte id, offset), got a tuple of {len(key)}")
        block_id, offset = key
        block_id = _id_bytes(block_id)
        if isinstance(offset, bool) or not isinstance(offset, (int, np.integer)):
            raise TypeError(f"a key's offset must be an int, got {type(offset).__name__}")
        offset = int(offset)
        if not 0 <= offset <= _MAX_OFFSET:
            raise ValueError(f"a key's offset must be in [0, 2**64), got {offset}")
        return block_id, offset
    return _id_bytes(key), 0


def _id_bytes(block_id: object) -> bytes:
    if type(block_id) is bytes and len(block_id) == 16:
        return block_id
    if isinstance(block_id, (bytes, bytearray, memoryview)):
        # The byte length, not len(): a memoryview of uint32 items has len() = items.
        nbytes = memoryview(block_id).nbytes
        if nbytes == 16:
            return bytes(block_id)
        raise ValueError(f"a block id must be 16 bytes, got {nbytes}")
    raise TypeError(
        "a key must be a 16-byte block id (bytes) or a tuple (block_id, offset), "
        f"got {type(block_id).__name__}")


_ZEROS = np.zeros(0, dtype=np.uint64)


class KeyView(Sequence):
    """A batch of keys as (ids joined, offsets); item i is the key tuple (id16, offset)."""

    __slots__ = ("ids", "offsets")

    def __init__(self, ids: bytes, offsets: np.ndarray):
        self.ids = ids
        self.offsets = offsets

    def __len__(self) -> int:
        return len(self.offsets)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        i = int(i)
        return self.ids[16 * i:16 * i + 16], int(self.offsets[i])


def pack_keys(keys: Iterable[object]) -> Tuple[bytes, np.ndarray, KeyView]:
    """Batch form: all ids joined (16 bytes each), offsets as uint64, and a view of the keys.

    Every key is held to split_key's rules, and a bad one raises TypeError/ValueError naming
    its position before the caller touches shared memory.  A list of plain 16-byte ``bytes``
    (the common case) is checked and joined at C speed and shares a read-only array of zero
    offsets; anything else is split key by key."""
    global _ZEROS
    # Copied once, then checked, then used: another thread may change the caller's list
    # between any two of these steps, and a key replaced after the check would shift every
    # later id (a false hit).  The copy is ours alone; the joined length is checked too.
    if type(keys) is list:
        keys = keys.copy()
    # Both counts are needed: b"".join takes any buffer, so "every item has len 16" alone lets
    # a uint32[16] array in as 64 bytes and shifts every later key (a false hit).  list.count
    # over map() is the cheapest C-speed form of "all are exactly bytes, all of length 16".
    n = len(keys) if type(keys) is list else 0
    plain = cast(List[bytes], keys)     # what the test below proves of it when n > 0
    if n and list(map(type, plain)).count(bytes) == n and list(map(len, plain)).count(16) == n:
        ids = b"".join(plain)
        if len(_ZEROS) < n:
            _ZEROS = np.zeros(max(n, 2 * len(_ZEROS)), dtype=np.uint64)
            _ZEROS.flags.writeable = False
        offsets = _ZEROS[:n]
    else:
        split = _split_all(keys)
        ids = b"".join(k[0] for k in split)
        offsets = np.fromiter((k[1] for k in split), dtype=np.uint64, count=len(split))
    if len(ids) != 16 * len(offsets):
        raise ValueError(f"the keys changed while they were read: {len(ids)} bytes of ids for "
                         f"{len(offsets)} keys (another thread is changing the key list)")
    return ids, offsets, KeyView(ids, offsets)


def _split_all(keys: Iterable[object]) -> List[Tuple[bytes, int]]:
    if isinstance(keys, (bytes, bytearray, memoryview, str)):
        raise TypeError(f"keys must be a list of keys, got one {type(keys).__name__} object "
                        "(for a single key, pass [key])")
    try:
        it = iter(keys)
    except TypeError:
        raise TypeError(f"keys must be an iterable of keys, got {type(keys).__name__}") from None
    split: List[Tuple[bytes, int]] = []
    append = split.append
    try:
        for key in it:
            append(split_key(key))
    except TypeError as e:          # the bad key is the one after those split so far
        raise TypeError(f"keys[{len(split)}]: {e}") from None
    except ValueError as e:
        raise ValueError(f"keys[{len(split)}]: {e}") from None
    return split


@overload
def make_key(data: Union[bytes, str], namespace: str) -> bytes: ...
@overload
def make_key(data: Union[bytes, str], namespace: str, offset: int) -> Key: ...


def make_key(data: Union[bytes, str], namespace: str, offset: int = 0) -> Key:
    """A 16-byte id derived from content and a namespace.

    The namespace names everything that changes what a cached value means (model id and
    version, dtype, normalisation): the same content under another namespace is another key.
    Returns the 16-byte id when offset is 0, else the key tuple (id, offset).
    """
    if isinstance(data, str):
        data = data.encode("utf-8")
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise TypeError(f"make_key data must be bytes or str, got {type(data).__name__}")
    if not isinstance(namespace, str) or not namespace:
        raise ValueError("make_key needs a non-empty namespace string (model id, version, dtype...)")
    ns = namespace.encode("utf-8")
    h = hashlib.blake2b(digest_size=16, person=b"ucmcache.key.v1")
    h.update(len(ns).to_bytes(8, "little"))
    h.update(ns)
    h.update(data)
    block_id = h.digest()
    if offset == 0:
        return block_id
    split_key((block_id, offset))  # validates the offset
    return (block_id, int(offset))


def chain_keys(blocks: Sequence[bytes], namespace: str) -> List[bytes]:
    """Chained block hashes (vLLM/UCM style): each id covers its block and every block before it.

    Each block is bytes-like (bytes, bytearray, memoryview): bytes(3) would be three zero
    bytes, so an int is refused rather than hashed as something it is not."""
    ids: List[bytes] = []
    parent = b""
    for i, block in enumerate(blocks):
        if not isinstance(block, (bytes, bytearray, memoryview)):
            raise TypeError(f"chain_keys blocks[{i}] must be bytes-like (bytes, bytearray or "
                            f"memoryview), got {type(block).__name__}")
        block_id = make_key(parent + bytes(block), namespace)
        assert isinstance(block_id, bytes)
        ids.append(block_id)
        parent = block_id
    return ids
