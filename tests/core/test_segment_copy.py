"""The segment copy of ucmcache.vllm's block moves (ucmcache.core.copy, csrc/ucm_copy.c): every
byte of every segment lands where asked and nothing beside it, and the CRC-32C folded into the
copy equals the CRC-32C summed over the same bytes in a pass of its own (the instruction path
and the table path), continued across calls as a layer-by-layer load continues it; the same
with the streaming stores a save uses."""
import numpy as np
import pytest

from ucmcache.core.checksum import crc32c, crc32c_soft
from ucmcache.core.copy import copy_segments

# Lengths around the fold's 24 KiB chunks and the CRC's 8-byte words; odd offsets too.
LENGTHS = [0, 1, 7, 8, 63, 4096, 3 * 8192 - 1, 3 * 8192, 3 * 8192 + 1, 65536, 100_003]


def _segments(rng, lengths, src, dst, gap=3):
    """Scattered segments: src pieces in order with gaps, dst pieces shuffled, odd offsets."""
    s_off, d_off = [], []
    at = 1
    for n in lengths:
        s_off.append(at)
        at += n + gap
    order = rng.permutation(len(lengths))
    at = 5
    d_at = [0] * len(lengths)
    for i in order:
        d_at[i] = at
        at += lengths[i] + gap
    d_off = d_at
    assert max(s + n for s, n in zip(s_off, lengths)) <= len(src)
    assert max(d + n for d, n in zip(d_off, lengths)) <= len(dst)
    base_s, base_d = src.ctypes.data, dst.ctypes.data
    return (np.array([base_d + o for o in d_off], dtype=np.uint64),
            np.array([base_s + o for o in s_off], dtype=np.uint64),
            np.array(lengths, dtype=np.uint64), s_off, d_off)


@pytest.mark.parametrize("streaming", [False, True])
def test_every_segment_lands_where_asked_and_nothing_else_is_written(streaming):
    """Also with streaming stores (the save's): heads before 16-byte alignment, 64-byte
    runs, tails, at odd offsets of source and destination."""
    rng = np.random.default_rng(1)
    src = rng.integers(0, 256, 400_000, dtype=np.uint8)
    dst = np.full(400_000, 0xAB, dtype=np.uint8)
    d, s, n, s_off, d_off = _segments(rng, LENGTHS, src, dst)
    copy_segments(d, s, n, streaming=streaming)
    expect = np.full_like(dst, 0xAB)
    for so, do, ln in zip(s_off, d_off, LENGTHS):
        expect[do:do + ln] = src[so:so + ln]
    assert np.array_equal(dst, expect)


@pytest.mark.parametrize("streaming", [False, True])
@pytest.mark.parametrize("per", [1, 2, 3])
def test_the_folded_crc_equals_the_two_pass_crc_of_each_blocks_pieces(per, streaming):
    rng = np.random.default_rng(2)
    lengths = LENGTHS + [512] * ((-len(LENGTHS)) % per)
    src = rng.integers(0, 256, 500_000, dtype=np.uint8)
    dst = np.zeros(500_000, dtype=np.uint8)
    d, s, n, s_off, _ = _segments(rng, lengths, src, dst)
    crcs = np.zeros(len(lengths) // per, dtype=np.uint32)
    copy_segments(d, s, n, crcs, per, streaming=streaming)
    for b in range(len(crcs)):
        pieces = b"".join(src[s_off[i]:s_off[i] + lengths[i]].tobytes()
                          for i in range(b * per, (b + 1) * per))
        assert int(crcs[b]) == crc32c(pieces) == crc32c_soft(pieces), b


@pytest.mark.parametrize("streaming", [False, True])
def test_every_alignment_and_short_length_lands_exactly(streaming):
    """A fixed sweep: destination and source misaligned by 0-15 bytes, lengths 0-200 and
    multiples of 64 around it: the streaming stores' head (to 16-byte alignment, longer than
    the segment when it is short), 64-byte runs and tail, and nothing written beside."""
    rng = np.random.default_rng(4)
    src = rng.integers(0, 256, 4096, dtype=np.uint8)
    for dmis in range(16):
        for smis in range(16):
            for n in list(range(0, 201, 7)) + [64, 128, 192, 256, 1024]:
                dst = np.full(4096 + 64, 0xCD, dtype=np.uint8)
                d0 = (-dst.ctypes.data % 64) + dmis + 32   # 32 bytes guarded before it
                s0 = (-src.ctypes.data % 64) + smis
                copy_segments(np.array([dst.ctypes.data + d0], dtype=np.uint64),
                              np.array([src.ctypes.data + s0], dtype=np.uint64),
                              np.array([n], dtype=np.uint64), streaming=streaming)
                expect = np.full_like(dst, 0xCD)
                expect[d0:d0 + n] = src[s0:s0 + n]
                assert np.array_equal(dst, expect), (dmis, smis, n)


@pytest.mark.parametrize("streaming", [False, True])
def test_a_crc_continues_across_calls_as_a_layer_by_layer_load_sums_it(streaming):
    rng = np.random.default_rng(3)
    layers = [rng.integers(0, 256, (4, 30_000), dtype=np.uint8) for _ in range(3)]
    out = [np.zeros_like(a) for a in layers]
    crcs = np.zeros(4, dtype=np.uint32)
    for a, o in zip(layers, out):   # one call per layer, all blocks, as KVBlockIO does
        d = np.array([o[b].ctypes.data for b in range(4)], dtype=np.uint64)
        s = np.array([a[b].ctypes.data for b in range(4)], dtype=np.uint64)
        copy_segments(d, s, np.full(4, 30_000, dtype=np.uint64), crcs, streaming=streaming)
    for b in range(4):
        whole = b"".join(a[b].tobytes() for a in layers)
        assert int(crcs[b]) == crc32c(whole)
        assert all(np.array_equal(a[b], o[b]) for a, o in zip(layers, out))


def test_bad_arguments_are_refused_before_any_byte_moves():
    a = np.zeros(4, dtype=np.uint64)
    with pytest.raises(TypeError, match="src must be a 1-d contiguous numpy uint64 array"):
        copy_segments(a, np.zeros(4, dtype=np.int64), a)
    with pytest.raises(ValueError, match="lens has 3 entries, dst has 4"):
        copy_segments(a, a, np.zeros(3, dtype=np.uint64))
    with pytest.raises(ValueError, match="per must be an int >= 1"):
        copy_segments(a, a, a, np.zeros(4, dtype=np.uint32), 0)
    with pytest.raises(ValueError, match="crcs has 4 entries; 4 segments of 2 per block need 2"):
        copy_segments(a, a, a, np.zeros(4, dtype=np.uint32), 2)
    with pytest.raises(TypeError, match="crcs must be a writable"):
        copy_segments(a, a, a, np.zeros(4, dtype=np.int32))
