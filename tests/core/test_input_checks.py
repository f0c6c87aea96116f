"""Bad input is refused whole, with a message naming it, before anything in shared memory
changes: batch keys, chain_keys blocks, file modes, and non-file entries under a segment's
name.  Also the creator's re-check that the name still names its own file."""
import array
import os
import re
import stat

import numpy as np
import pytest

import ucmcache
from ucmcache import ForeignSegment, SlotCache, chain_keys
from ucmcache.core import segment as _segment
from ucmcache.core.keys import pack_keys, split_key
from ucmcache.core.layout import Layout
from ucmcache.lowlevel import Segment, probe, shm_path

import input_workers

PARAMS = dict(slots_per_rank=16, slot_size=256, max_ranks=4)
A = bytes(range(16))
B = bytes(range(100, 116))
C = bytes(range(200, 216))


def _stored(c, key, value):
    assert c.get_or_load(key, lambda: value) == value


# ------------------------------------------------------------------------- batch keys

# Each of these has len() == 16 (the old fast path's only test) or is 16 of something else.
MISALIGNED = {
    "uint32[16] array": lambda: np.frombuffer(A + B + C + A, dtype=np.uint32),
    "array('I')": lambda: array.array("I", range(16)),
    "list of 16 ints": lambda: list(range(16)),
    "uint8[16] array": lambda: np.frombuffer(A, dtype=np.uint8),
    "str of 16": lambda: "k" * 16,
    "uint32 memoryview of len 16": lambda: memoryview(np.frombuffer(A + B + C + A,
                                                                  dtype=np.uint32)),
    "15 bytes": lambda: A[:15],
    "bytearray of 17": lambda: bytearray(17),
    "tuple with a negative offset": lambda: (A, -1),
}
BAD_KEY = re.compile(r"^keys\[1\]: (a key must be a 16-byte block id \(bytes\) or a tuple "
                     r"\(block_id, offset\), got \w+|a block id must be 16 bytes, got \d+|"
                     r"a key's offset must be in \[0, 2\*\*64\), got -1)$")


@pytest.mark.parametrize("call", ["exist", "exist_prefix", "get_many", "touch", "prefetch"])
@pytest.mark.parametrize("weird", list(MISALIGNED), ids=list(MISALIGNED))
def test_batch_calls_refuse_a_misaligned_key_by_position(make_cache, call, weird):
    c = make_cache(**PARAMS)
    _stored(c, A, b"value of A")
    _stored(c, B, b"value of B")
    before = c.stats()
    with pytest.raises((TypeError, ValueError)) as e:
        getattr(c, call)([A, MISALIGNED[weird](), B])
    assert BAD_KEY.match(str(e.value)), str(e.value)
    # Refused before any shared word changed: no counter moved, no pin or post left behind.
    assert c.stats() == before
    assert ucmcache.verify(c.uuid).ok


def test_get_many_never_reads_another_keys_bytes(make_cache):
    """A uint32[16] whose bytes 16..32 are B's id, then A: joined, position 1 would be B."""
    c = make_cache(**PARAMS)
    _stored(c, A, b"value of A")
    _stored(c, B, b"value of B")
    weird = np.frombuffer(A + B + C + A, dtype=np.uint32)
    assert len(weird) == 16
    with pytest.raises(TypeError, match=r"^keys\[0\]: a key must be .* got ndarray$"):
        c.get_many([weird, A])
    with pytest.raises(TypeError, match=r"^keys\[0\]: "):
        c.exist([weird, A])
    with pytest.raises(TypeError, match=r"^keys\[0\]: "):
        c.exist_prefix([weird, A])
    with c.get_many([A, B]) as batch:         # still usable, and the real answer
        assert [bytes(batch.data(i)) for i in range(2)] == [b"value of A", b"value of B"]


def test_byte_ids_count_bytes_not_items():
    # A memoryview's len() counts items: 4 uint32 are a 16-byte id, 16 of them are not.
    four = memoryview(np.frombuffer(A, dtype=np.uint32))
    assert len(four) == 4
    assert split_key(four) == (A, 0)
    assert split_key((four, 5)) == (A, 5)
    sixteen = memoryview(np.frombuffer(A * 4, dtype=np.uint32))
    with pytest.raises(ValueError, match=r"^a block id must be 16 bytes, got 64$"):
        split_key(sixteen)
    ids, offsets, view = pack_keys([four, bytearray(B), (memoryview(C), 7)])
    assert ids == A + B + C and offsets.tolist() == [0, 0, 7]
    assert list(view) == [(A, 0), (B, 0), (C, 7)]


def test_pack_keys_fast_path_and_its_neighbours():
    ids, offsets, view = pack_keys([A, B, C])
    assert ids == A + B + C and offsets.tolist() == [0, 0, 0] and view[2] == (C, 0)
    for keys in ((A, B), iter([A, B])):              # not a list: key by key, same answer
        assert pack_keys(keys)[0] == A + B
    with pytest.raises(TypeError, match=r"^keys must be a list of keys, got one bytes object "
                                        r"\(for a single key, pass \[key\]\)$"):
        pack_keys(A)
    with pytest.raises(TypeError, match=r"^keys must be an iterable of keys, got int$"):
        pack_keys(16)
    with pytest.raises(TypeError, match=r"^keys\[2\]: .* got NoneType$"):
        pack_keys([A, B, None])


def test_batch_key_of_a_bytes_subclass_is_still_a_key(make_cache):
    class Id(bytes):
        pass
    c = make_cache(**PARAMS)
    _stored(c, A, b"value of A")
    assert c.exist([Id(A), B]) == [True, False]


# ------------------------------------------------------------------------- chain_keys

def test_chain_keys_blocks_must_be_bytes_like():
    with pytest.raises(TypeError, match=r"^chain_keys blocks\[0\] must be bytes-like \(bytes, "
                                        r"bytearray or memoryview\), got int$"):
        chain_keys([3], "ns")
    with pytest.raises(TypeError, match=r"^chain_keys blocks\[1\] must be .* got str$"):
        chain_keys([b"a", "b"], "ns")
    assert chain_keys([bytearray(b"ab"), memoryview(b"cd")], "ns") == chain_keys([b"ab", b"cd"],
                                                                                 "ns")


# ------------------------------------------------------------------------- modes

BAD_MODES = [-1, 0o1000, 0o4755, 0o2700, 0o1777, 0o7777, 0o100600, True, "600", 1.5, None,
             np.int32(0o600)]


@pytest.mark.parametrize("mode", BAD_MODES, ids=repr)
def test_create_accepts_permission_bits_only(uuid, mode):
    with pytest.raises(ValueError, match=r"^mode must be (an int of )?permission bits from 0 to "
                                         r"0o777, got "):
        SlotCache.create(uuid, mode=mode, **PARAMS)
    with pytest.raises(ValueError, match=r"^mode must be "):
        Segment.create(uuid, Layout.compute(**PARAMS), mode=mode)
    assert not os.path.lexists(shm_path(uuid))      # refused before any file was made


def test_create_mode_is_applied(uuid):
    old = os.umask(0)
    try:
        SlotCache.create(uuid, mode=0o640, **PARAMS).close()
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(shm_path(uuid)).st_mode) == 0o640


# ------------------------------------------------------------------------- non-file entries

def _name():
    return f"t-{os.getpid()}-{os.urandom(5).hex()}-stray"


@pytest.fixture(params=["directory", "symbolic link", "FIFO"])
def stray(request, tmp_path):
    """(uuid, kind): a non-file entry under a segment's name in /dev/shm, always removed."""
    u = _name()
    path = shm_path(u)
    if request.param == "directory":
        os.mkdir(path)
    elif request.param == "symbolic link":
        target = tmp_path / "target"
        target.write_bytes(b"\0" * 4096)
        os.symlink(target, path)
    else:
        os.mkfifo(path)
    try:
        yield u, request.param
    finally:
        if os.path.isdir(path) and not os.path.islink(path):
            os.rmdir(path)
        elif os.path.lexists(path):
            os.unlink(path)


def test_non_file_entry_is_refused_naming_its_path(stray):
    u, kind = stray
    refused = re.escape(f"segment {u!r}: {shm_path(u)} is a {kind}, not a shared-memory file, "
                        "so not a ucmcache segment; refusing to use it")
    for op in (lambda: SlotCache.attach(u, timeout=1),
               lambda: Segment.attach(u, timeout=1),
               lambda: probe(u),
               lambda: ucmcache.verify(u),
               lambda: SlotCache.create(u, **PARAMS),
               lambda: SlotCache.create(u, exist_ok=True, **PARAMS),
               lambda: SlotCache.unlink(u)):
        with pytest.raises(ForeignSegment, match=f"^{refused}$"):
            op()
    assert os.path.lexists(shm_path(u))             # still there: only its owner removes it


# ------------------------------------------------------------------------- creator split brain

def test_stalled_creator_whose_file_was_replaced_starts_again(uuid, make_cache, procs, gate,
                                                             monkeypatch):
    """A creator held between shm_open and its creator lock has its empty file replaced as
    half-made by another create(); after taking the lock it must see that the name is no
    longer its file and start again (here: find the segment made and attach, exist_ok)."""
    g = gate()
    p, q = procs.start(input_workers.create_stalled_after_shm_open, uuid, g.path, A, PARAMS)
    g.wait_arrived()
    stalled = os.stat(shm_path(uuid)).st_ino
    # The grace that would make us wait for the stalled creator is over at once.
    monkeypatch.setattr(_segment, "HALF_MADE_GRACE_S", -1.0)
    c = make_cache(**PARAMS)
    assert os.stat(shm_path(uuid)).st_ino != stalled        # it replaced the stalled file
    _stored(c, A, b"from the replacing creator")
    g.release()
    same_file, hit, value = procs.result(q, timeout=30)
    assert (same_file, hit, value) == (True, True, b"from the replacing creator")
    p.join(30)
    assert p.exitcode == 0
    assert ucmcache.verify(uuid).ok


# ------------------------------------------------------------------------- values

# Values whose items are not plain numbers or bytes: the rule out buffers are held to
# (read_many, gather) holds for what is stored too.  An object array's items are PyObject*
# addresses: stored, they leaked heap addresses into shared memory and handed every other
# process garbage.
NOT_PLAIN = {
    "object array": lambda: np.array([1, "a", None], dtype=object),
    "empty object array": lambda: np.zeros(0, dtype=object),
    "structured array": lambda: np.zeros(2, dtype="i4,f4"),
    "numpy bytes (S2)": lambda: np.array([b"ab"], dtype="S2"),
    "numpy str (U2)": lambda: np.array(["ab"], dtype="U2"),
}
NOT_PLAIN_MSG = r"^a value's items have format '[^']+' \(ndarray\): only plain numbers or bytes"
PLAIN = {
    "float16 2-D": lambda: np.arange(6, dtype=np.float16).reshape(2, 3),
    "big-endian int32": lambda: np.arange(3, dtype=">i4"),
    "complex128": lambda: np.array([1 + 2j]),
    "bool": lambda: np.array([True, False]),
    "array('d')": lambda: array.array("d", [1.5, 2.5]),
    "bytearray": lambda: bytearray(b"abc"),
}


@pytest.mark.parametrize("how", ["put", "get_or_load", "get_or_load_full", "aget_or_load"])
@pytest.mark.parametrize("value", list(NOT_PLAIN), ids=list(NOT_PLAIN))
def test_a_value_of_objects_is_refused_and_stores_nothing(make_cache, value, how):
    import asyncio
    c = make_cache(**PARAMS)
    v = NOT_PLAIN[value]()
    with pytest.raises(TypeError, match=NOT_PLAIN_MSG):
        if how == "put":
            c.put(A, v)
        elif how == "get_or_load":                       # the cold path in C
            c.get_or_load(A, lambda: v)
        elif how == "get_or_load_full":                  # the full path (a timeout)
            c.get_or_load(A, lambda: v, timeout=30)
        else:
            asyncio.run(c.aget_or_load(A, lambda: v))
    assert A not in c and len(c) == 0 and c.stats()["loads_ready"] == 0
    # put refuses before its get; a loader's value fails the load it owned (never Ready,
    # never left Loading): either way the next get is the owner of a cold key.
    with c.get(A) as h:
        assert h.owner
        h.fail("done")
    assert c._open_handles == 0 and ucmcache.verify(c.uuid).ok


@pytest.mark.parametrize("value", list(PLAIN), ids=list(PLAIN))
def test_a_value_of_plain_numbers_is_stored_as_its_bytes(make_cache, value):
    c = make_cache(**PARAMS)
    assert c.put(A, PLAIN[value]()) is True
    assert c.get_or_load(B, PLAIN[value]) == bytes(memoryview(PLAIN[value]()).cast("B"))
    assert c[A] == c[B]


@pytest.mark.parametrize("how", ["put", "get_or_load", "get_or_load_full"])
@pytest.mark.parametrize("shape", [(0, 3), (2, 0), (0,), (0, 0, 4)])
def test_an_empty_value_of_any_shape_is_an_empty_payload_as_b_empty_is(make_cache, shape, how):
    """b"" is a value (an empty payload, Ready); so is an empty array of any shape, where
    memoryview's cast used to refuse a shape with a zero in it with its own message."""
    c = make_cache(**PARAMS)
    v = np.zeros(shape, dtype=np.float32)
    if how == "put":
        assert c.put(A, v) is True and c.put(B, b"") is True
    else:
        timeout = None if how == "get_or_load" else 30
        assert c.get_or_load(A, lambda: v, timeout=timeout) == b""
        assert c.get_or_load(B, lambda: b"", timeout=timeout) == b""
    assert c[A] == c[B] == b"" and len(c) == 2
    assert c.stats()["size_bytes"] == 0


def test_a_refused_loader_value_fails_the_load_for_a_waiter_in_another_process(make_cache,
                                                                               procs, gate):
    """The owner's loader returns an object array while another process waits for the key:
    the load is failed (the waiter gets LoadFailed naming the refusal, not a hang or the
    addresses), and the next get_or_load loads it again."""
    import workers
    c = make_cache(**PARAMS)
    joined = gate()

    def loader():
        p, q = procs.start(workers.wait_for_load, c.uuid, A, joined.path, 30)
        joined.wait_value(1)                          # it holds a handle on our Loading slot
        loader.q = q
        return np.array([object(), object()], dtype=object)
    with pytest.raises(TypeError, match=NOT_PLAIN_MSG):
        c.get_or_load(A, loader)
    state, message = procs.result(loader.q)
    assert state == "failed"
    assert re.match(r"^TypeError: a value's items have format 'O'", message), message
    assert c.get_or_load(A, lambda: b"again") == b"again"
    assert c.stats()["loads_failed"] == 1
