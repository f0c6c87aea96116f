"""ucmcache.vllm's pieces that run without vLLM (issue 24): block keys that engines which differ
never share, the slot format's header checks, and KVBlockIO's copies between a paged KV cache
(CPU tensors) and a segment: a round trip, a block stored elsewhere not written twice, and a
block that cannot be loaded (evicted, cleared, foreign) reported and left untouched, never a
wrong KV.  The real engines run in scripts/e2e-vllm."""
import dataclasses

import pytest

torch = pytest.importorskip("torch")

from ucmcache import vllm as uv  # noqa: E402
from ucmcache._vllm_blocks import HEADER_SIZE, EngineIdentity, KVBlockIO  # noqa: E402

BS = 32
ID = EngineIdentity(model="tiny", dtype="float32", kv_dtype="float32", block_size=BS,
                    num_layers=2, num_kv_heads=2, head_size=32, layout="NHD")
PROMPT = list(range(100, 100 + 4 * BS + 5))


def test_block_keys_are_chained_full_blocks_and_differ_with_every_identity_field():
    keys = uv.block_keys(PROMPT, ID)
    assert len(keys) == 4 and all(len(k) == 16 for k in keys)
    assert uv.block_keys(PROMPT[:2 * BS], ID) == keys[:2]  # a prefix's keys are its prefix
    changed = PROMPT[:BS] + [7] + PROMPT[BS + 1:]
    assert uv.block_keys(changed, ID)[0] == keys[0] and uv.block_keys(changed, ID)[1] != keys[1]
    for field, value in (("model", "other"), ("dtype", "bfloat16"), ("kv_dtype", "fp8"),
                         ("block_size", 16), ("num_layers", 3), ("layout", "HND"),
                         ("tp_size", 2), ("user_namespace", "weights-v2"),
                         ("config_digest", "x")):
        other = dataclasses.replace(ID, **{field: value})
        assert not set(uv.block_keys(PROMPT, other)) & set(keys), field
    assert not set(uv.block_keys(PROMPT, ID, salt="tenant")) & set(keys)
    with pytest.raises(ValueError, match="block_size must be an int >= 1"):
        dataclasses.replace(ID, block_size=0)


def test_a_header_names_its_block_and_refuses_anything_else():
    io_fp, bid = b"\x01" * 16, b"b" * 16
    raw = uv.pack_header(2, io_fp, bid, 0, 1024, 99)
    assert len(raw) == HEADER_SIZE
    ok = dict(n_layers=2, fingerprint=io_fp, block_id=bid, offset=0, payload=1024)
    assert uv.check_header(raw, **ok) == (None, 99)
    for change, why in ((dict(block_id=b"c" * 16), "another key"), (dict(offset=1), "another key"),
                        (dict(n_layers=3), "layer"), (dict(payload=2048), "payload"),
                        (dict(fingerprint=bytes(len(io_fp))), "another namespace")):
        err, _ = uv.check_header(raw, **{**ok, **change})
        assert err and why in err, (change, err)
    assert "bad magic" in uv.check_header(b"\0" * HEADER_SIZE, **ok)[0]
    assert "less than a header" in uv.check_header(b"x", **ok)[0]


def _kv(blocks=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.rand((blocks, 2, BS, 2, 32), generator=g) for _ in range(2)]


def _io(cache, layers):
    return KVBlockIO(cache, layers, namespace=ID.namespace, offset=0, pages=1, checksum=True)


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device: the CUDA path is untested here"))]


@pytest.mark.parametrize("device", DEVICES)
def test_blocks_round_trip_between_two_kv_caches_and_are_written_once(make_cache, device):
    src = [t.to(device) for t in _kv(seed=1)]
    dst = [t.to(device) for t in _kv(seed=2)]
    need = HEADER_SIZE + sum(t[0:1].numel() * t.element_size() for t in src)
    c = make_cache(slots_per_rank=16, slot_size=need, max_ranks=2)
    keys = uv.block_keys(PROMPT, ID)
    saved = _io(c, src).save(keys[:3], [5, 1, 6])
    assert saved.blocks_saved == 3
    again = _io(c, src).save(keys[:3], [5, 1, 6])  # stored already: not written twice
    assert again.blocks_saved == 0 and again.blocks_present == 3
    res = _io(c, dst).load(keys[:3], [0, 2, 3])
    assert res.loaded == 3 and not res.failed
    for layer_src, layer_dst in zip(src, dst):
        for a, b in ((5, 0), (1, 2), (6, 3)):
            assert torch.equal(layer_src[a], layer_dst[b])


def test_a_block_that_cannot_be_loaded_is_reported_and_its_rows_left_untouched(make_cache):
    src, dst = _kv(seed=1), _kv(seed=2)
    need = HEADER_SIZE + sum(t[0:1].numel() * t.element_size() for t in src)
    c = make_cache(slots_per_rank=16, slot_size=need, max_ranks=2)
    keys = uv.block_keys(PROMPT, ID)
    _io(c, src).save(keys[:2], [0, 1])
    c.clear()  # evicted (cleared) since the scheduler looked
    before = [t.clone() for t in dst]
    res = _io(c, dst).load(keys[:2], [4, 5])
    assert res.loaded == 0 and set(res.failed) == {4, 5}
    assert all(torch.equal(a, b) for a, b in zip(before, dst))
    # a block stored by an engine of another namespace under the same key: refused, untouched
    c.put(keys[2], b"\0" * HEADER_SIZE + bytes(need - HEADER_SIZE))
    res = _io(c, dst).load(keys[2:3], [6])
    assert res.loaded == 0 and 6 in res.failed
    assert all(torch.equal(a, b) for a, b in zip(before, dst))
