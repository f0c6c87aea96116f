"""ucmcache.core.checksum: CRC-32C in C, the vLLM block format's checksum.  The instruction path
(three streams joined by a shift) must equal the table path, and both the standard's check
value, at every length and alignment that takes a different branch; a checksum summed piece
by piece equals the whole; any contiguous buffer is accepted and anything else refused."""
import numpy as np
import pytest

from ucmcache.core.checksum import crc32c, crc32c_soft, hardware

STRETCH = 8192   # csrc/ucm_crc.c: three of these a round on the instruction path


def test_the_check_value_of_the_standard_and_of_nothing():
    for f in (crc32c, crc32c_soft):
        assert f(b"123456789") == 0xE3069283   # RFC 3720 / the catalogue's check value
        assert f(b"") == 0
        assert f(bytes(32)) == 0x8A9136AA         # RFC 3720 B.4: 32 bytes of zeros
        assert f(b"\xff" * 32) == 0x62A8AB43      # and of ones


@pytest.mark.parametrize("length", [1, 7, 8, 9, 63, 3 * STRETCH - 1, 3 * STRETCH,
                                    3 * STRETCH + 1, 2 * 3 * STRETCH + 13, 1 << 20])
@pytest.mark.parametrize("start", [0, 1, 5])
def test_the_instruction_path_equals_the_tables_and_pieces_sum_to_the_whole(length, start):
    data = np.random.default_rng(length + start).integers(0, 256, length + 8, dtype=np.uint8)
    x = data[start:start + length]
    whole = crc32c(x)
    assert whole == crc32c_soft(x)
    cut = length // 3
    assert crc32c(x[cut:], crc32c(x[:cut])) == whole
    assert crc32c_soft(x[cut:], crc32c_soft(x[:cut])) == whole


def test_one_flipped_bit_anywhere_changes_it():
    data = bytearray(np.random.default_rng(1).integers(0, 256, 3 * STRETCH + 100,
                                                     dtype=np.uint8).tobytes())
    base = crc32c(data)
    for pos in (0, STRETCH - 1, STRETCH, 2 * STRETCH + 5, len(data) - 1):
        data[pos] ^= 0x10
        assert crc32c(data) != base, pos
        data[pos] ^= 0x10


def test_it_takes_buffers_and_refuses_what_is_not_one():
    assert crc32c(memoryview(b"123456789")) == crc32c(bytearray(b"123456789")) == 0xE3069283
    with pytest.raises(TypeError):
        crc32c("123456789")
    assert isinstance(hardware(), bool)
