"""The segment copy of ucmcache.vllm's block moves (ucmcache.core.copy, csrc/ucm_copy.c): every
byte of every segment lands where asked and nothing beside it, and the CRC-32C folded into the
copy equals the CRC-32C summed over the same bytes in a pass of its own (the instruction path
and the table path), continued across calls as a layer-by-layer load continues it; the same
with the streaming stores a save uses."""
import numpy as np
import pytest

from ucmcache.core.checksum import crc32c, crc32c_soft
from ucmcache.core.copy import copy_segments

# Lengths around the copy's 3 x 4 KiB chunks (csrc/ucm_crc.c, ucm_crc32c_copy: three streams,
# then a tail of 64-byte lines and bytes), the CRC's own 3 x 8 KiB stretches and its 8-byte
# words; odd offsets too.
LENGTHS = [0, 1, 7, 8, 63, 64, 4096, 3 * 4096 - 1, 3 * 4096, 3 * 4096 + 1, 3 * 4096 + 65,
           3 * 8192 - 1, 3 * 8192, 3 * 8192 + 1, 65536, 100_003]


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


@pytest.mark.parametrize("crc", [False, True])
@pytest.mark.parametrize("streaming", [False, True])
def test_every_alignment_and_short_length_lands_exactly(streaming, crc):
    """A fixed sweep: destination and source misaligned by 0-15 bytes, lengths 0-200 and
    multiples of 64 around it: the streaming stores' head (to 16-byte alignment, longer than
    the segment when it is short), 64-byte runs and tail, and nothing written beside; with a
    CRC, the one-pass copy's sum too (csrc/ucm_crc.c), against the table path."""
    rng = np.random.default_rng(4)
    src = rng.integers(0, 256, 4096, dtype=np.uint8)
    for dmis in range(16):
        for smis in range(16):
            for n in list(range(0, 201, 7)) + [64, 128, 192, 256, 1024]:
                _copy_one_and_check(src, dmis, smis, n, streaming, crc)


@pytest.mark.parametrize("streaming", [False, True])
def test_the_one_pass_crc_copy_is_exact_across_its_chunks_at_any_alignment(streaming):
    """Lengths where the three-stream chunks (3 x 4 KiB) begin and end, misaligned both
    sides: every byte lands, nothing beside, the CRC equals the table path's."""
    rng = np.random.default_rng(5)
    src = rng.integers(0, 256, 3 * 12288 + 256, dtype=np.uint8)
    for dmis in (0, 1, 8, 15):
        for smis in (0, 3, 16):
            for n in (12287, 12288, 12289, 12288 + 64, 12288 + 63, 2 * 12288 + 4095,
                      3 * 12288 + 100):
                _copy_one_and_check(src, dmis, smis, n, streaming, True)


def _copy_one_and_check(src, dmis, smis, n, streaming, crc):
    dst = np.full(len(src) + 64, 0xCD, dtype=np.uint8)
    d0 = (-dst.ctypes.data % 64) + dmis + 32   # 32 bytes guarded before it
    s0 = (-src.ctypes.data % 64) + smis
    crcs = np.array([0x1234], dtype=np.uint32) if crc else None   # continues a sum
    copy_segments(np.array([dst.ctypes.data + d0], dtype=np.uint64),
                  np.array([src.ctypes.data + s0], dtype=np.uint64),
                  np.array([n], dtype=np.uint64), crcs, streaming=streaming)
    expect = np.full_like(dst, 0xCD)
    expect[d0:d0 + n] = src[s0:s0 + n]
    assert np.array_equal(dst, expect), (dmis, smis, n)
    if crc:
        assert int(crcs[0]) == crc32c_soft(src[s0:s0 + n].tobytes(), 0x1234), (dmis, smis, n)


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
