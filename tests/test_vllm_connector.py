"""ucmcache.vllm's pieces that run without vLLM: block keys that engines which differ
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


def _stored(make_cache, n=3):
    src, dst = _kv(seed=1), _kv(seed=2)
    need = HEADER_SIZE + sum(t[0:1].numel() * t.element_size() for t in src)
    c = make_cache(slots_per_rank=16, slot_size=need, max_ranks=2)
    keys = uv.block_keys(PROMPT, ID)
    assert _io(c, src).save(keys[:n], list(range(n))).blocks_saved == n
    return c, src, dst, keys


def test_a_layer_by_layer_load_has_each_layer_in_when_it_says_so_and_checks_the_checksum_last(
        make_cache):
    c, src, dst, keys = _stored(make_cache)
    io = _io(c, dst)
    # block 3: a right header over a payload whose checksum is not the header's
    payload = bytes(io.payload)
    c.put(keys[3], uv.pack_header(2, io.fingerprint, keys[3], 0, io.payload, 12345) + payload)
    before = [t.clone() for t in dst]
    # whole blocks: every check before any copy, so the bad block's rows are untouched
    res = io.load(keys[:4], [4, 5, 6, 7])
    assert res.loaded == 3 and res.failed == {7: "checksum mismatch"}
    assert torch.equal(dst[0][7], before[0][7]) and torch.equal(dst[1][7], before[1][7])
    dst = [t.clone() for t in before]
    io = _io(c, dst)
    seen = []

    def on_layer(layer):  # layer L of every passing block is in; layer L + 1 not yet
        for a, b in ((0, 4), (1, 5), (2, 6)):
            assert torch.equal(dst[layer][b], src[layer][a])
            if layer + 1 < len(dst):
                assert torch.equal(dst[layer + 1][b], before[layer + 1][b])
        seen.append(layer)

    res = io.load(keys[:4], [4, 5, 6, 7], on_layer=on_layer)
    assert seen == [0, 1]
    assert res.loaded == 3 and res.failed == {7: "checksum mismatch"}  # found after the copies


class _GatedExecutor:
    """An executor whose one job starts only when the test says so."""

    def __init__(self):
        self.thread = None

    def submit(self, fn, *args):
        import concurrent.futures
        import threading
        fut = concurrent.futures.Future()
        self.thread = threading.Thread(target=lambda: fut.set_result(fn(*args)))
        return fut


def test_a_forward_waits_for_each_layer_and_a_layer_it_never_waited_for_fails_the_step(
        make_cache):
    c, src, dst, keys = _stored(make_cache)
    ex = _GatedExecutor()
    ll = _io(c, dst).start_load(keys[:3], [4, 5, 6], ex)
    with pytest.raises(uv.VllmConnectorError, match="layer 0 of 3 loading block"):
        ll.wait(0, timeout=0.05)  # the IO thread has not started: the wait is bounded
    ex.thread.start()
    try:
        for layer in range(2):
            ll.wait(layer)
            assert torch.equal(dst[layer][4], src[layer][0])
        res = ll.finish()
    finally:
        ex.thread.join(30)
    assert res.loaded == 3 and not res.failed
    assert ll.waited == {0, 1} and ll.run_ns > 0
    # a forward that read layer 1 without waiting for it may have read it mid-copy:
    # every block of the step is reported, so vLLM recomputes them
    ex = _GatedExecutor()
    ll = _io(c, dst).start_load(keys[:3], [4, 5, 6], ex)
    ex.thread.start()
    try:
        ll.wait(0)
        res = ll.finish()
    finally:
        ex.thread.join(30)
    assert res.loaded == 0 and set(res.failed) == {4, 5, 6}
    assert "did not wait for layer(s) [1]" in res.failed[4]


def test_a_layer_by_layer_load_that_fails_on_its_thread_lets_the_forward_on_and_fails_the_step(
        make_cache):
    c, src, dst, keys = _stored(make_cache)
    io = _io(c, dst)
    c.close()  # the IO thread's read_many raises; the forward must not hang on a layer
    ex = _GatedExecutor()
    ll = io.start_load(keys[:3], [4, 5, 6], ex)
    ex.thread.start()
    try:
        ll.wait(0)
        ll.wait(1)
        res = ll.finish()
    finally:
        ex.thread.join(30)
    assert res.loaded == 0 and set(res.failed) == {4, 5, 6}
