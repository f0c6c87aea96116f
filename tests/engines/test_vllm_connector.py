"""ucmcache.vllm's pieces that run without vLLM: block keys that engines which differ
never share, the slot format's header checks, and KVBlockIO's copies between a paged KV cache
(CPU tensors) and a segment: a round trip, a block stored elsewhere not written twice, and a
block that cannot be loaded (evicted, cleared, foreign) reported and left untouched, never a
wrong KV.  The real engines run in scripts/e2e-vllm."""
import dataclasses
import os

import pytest

torch = pytest.importorskip("torch")

from ucmcache.engines.vllm import blocks as _vb  # noqa: E402
from ucmcache import vllm as uv  # noqa: E402
from ucmcache.engines import kit  # noqa: E402
from ucmcache.core.checksum import crc32c, crc32c_soft  # noqa: E402
from ucmcache.engines.vllm.blocks import HEADER_SIZE, EngineIdentity, KVBlockIO  # noqa: E402

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
                         ("config_digest", "x"), ("attn_backend", "FLASHINFER"),
                         ("device", "cuda")):
        other = dataclasses.replace(ID, **{field: value})
        assert not set(uv.block_keys(PROMPT, other)) & set(keys), field
    assert not set(uv.block_keys(PROMPT, ID, salt="tenant")) & set(keys)
    with pytest.raises(ValueError, match="block_size must be an int >= 1"):
        dataclasses.replace(ID, block_size=0)


def test_engines_differing_only_in_attention_backend_or_kv_device_share_no_block():
    """Two engines whose KV tensors have the same shape, strides and dtype but whose attention
    backends (or KV devices) differ read the elements differently: their identities, as
    identity_from_vllm makes them, give different block keys and segments."""
    from types import SimpleNamespace as NS

    def config(backend, device):
        return NS(model_config=NS(model="tiny", revision="", hf_config=None, dtype="float32"),
                  cache_config=NS(block_size=BS, cache_dtype="auto", kv_cache_layout="NHD"),
                  parallel_config=NS(tensor_parallel_size=1, pipeline_parallel_size=1),
                  attention_config=NS(backend=backend), device_config=NS(device_type=device))

    kv = NS(kv_cache_groups=[NS(layer_names=["l0", "l1"], kv_cache_spec=NS(
        num_kv_heads=2, head_size=32, dtype="float32"))])
    base, layers = uv.identity_from_vllm(config(None, "cpu"), kv)
    assert layers == ["l0", "l1"] and base.device == "cpu" and base.attn_backend
    keys = uv.block_keys(PROMPT, base)
    for backend, device in ((NS(name="FLASHINFER"), "cpu"), (None, "cuda")):
        other, _ = uv.identity_from_vllm(config(backend, device), kv)
        assert dataclasses.replace(other, attn_backend=base.attn_backend,
                                   device=base.device) == base    # only there they differ
        assert not set(uv.block_keys(PROMPT, other)) & set(keys), (backend, device)
        assert uv.default_segment(other) != uv.default_segment(base)


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
    # the save's CPU time inside it (the bench's "on CPU" rate): some, never past its wall
    assert 0 < saved.save_cpu_us <= saved.save_us + 1
    again = _io(c, src).save(keys[:3], [5, 1, 6])  # stored already: not written twice
    assert again.blocks_saved == 0 and again.blocks_present == 3
    res = _io(c, dst).load(keys[:3], [0, 2, 3])
    assert res.loaded == 3 and not res.failed
    for layer_src, layer_dst in zip(src, dst):
        for a, b in ((5, 0), (1, 2), (6, 3)):
            assert torch.equal(layer_src[a], layer_dst[b])


def test_a_save_into_a_fresh_segment_takes_no_page_fault_per_page(make_cache):
    # Every process faults each page of a shared mapping into its own page tables on first
    # touch, one write fault per 4 KiB page (no fault-around on a shared writable page): that
    # was most of a save's time into a new segment (bench/kv_io.py).  KVBlockIO maps the
    # segment in at start (MADV_POPULATE_WRITE, on a thread of its own: waited for here), so
    # the save's copies fault nothing: 64 blocks of 32 KiB here are 512 pages, one fault
    # each before.
    resource = pytest.importorskip("resource")
    src = _kv(blocks=64, seed=3)
    need = HEADER_SIZE + sum(t[0:1].numel() * t.element_size() for t in src)
    c = make_cache(slots_per_rank=64, slot_size=need, max_ranks=1)
    io = _io(c, src)
    assert io.mapped.wait(30.0)
    keys = [bytes([i]) * 16 for i in range(64)]
    pages = 64 * (need - HEADER_SIZE) // 4096
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    assert io.save(keys, list(range(64))).blocks_saved == 64
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0
    assert faults < pages // 8, f"{faults} page faults for {pages} pages saved"
    dst = [torch.zeros_like(t) for t in src]
    assert _io(c, dst).load(keys, list(range(64))).loaded == 64
    assert all(torch.equal(a, b) for a, b in zip(src, dst))
    io.close()
    assert io._map_thread is None and io.mapped.is_set()


def test_the_map_in_thread_runs_on_the_copy_cpus(make_cache, monkeypatch):
    # the connector passes its copy threads' CPUs (off the forward's core): the map-in thread
    # binds itself there before it touches a page
    import threading
    bound = []
    monkeypatch.setattr(_vb.os, "sched_setaffinity",
                        lambda pid, cpus: bound.append((pid, set(cpus),
                                                        threading.current_thread().name)))
    src = _kv(seed=4)
    need = HEADER_SIZE + sum(t[0:1].numel() * t.element_size() for t in src)
    c = make_cache(slots_per_rank=16, slot_size=need, max_ranks=1)
    io = KVBlockIO(c, src, namespace=ID.namespace, map_cpus={0})
    assert io.mapped.wait(30.0)
    io.close()
    assert bound == [(0, {0}, "ucmcache-map-in")]
    assert io.mapped_in


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
    # block 3: a right header over a payload whose checksum is not the header's; block 4: a
    # header of another length (refused before any byte is copied)
    payload = bytes(io.payload)
    c.put(keys[3], uv.pack_header(2, io.fingerprint, keys[3], 0, io.payload, 12345) + payload)
    short = uv.block_keys([9] * BS, ID)[0]
    c.put(short, uv.pack_header(2, io.fingerprint, short, 0, io.payload - 4, 0) + payload)
    before = [t.clone() for t in dst]
    # whole blocks: the checksum is summed in the copy's pass and checked after it
    res = io.load(keys[:4] + [short], [4, 5, 6, 7, 3])
    assert res.loaded == 3 and res.failed[7] == "checksum mismatch"
    assert "payload" in res.failed[3]
    assert torch.equal(dst[0][3], before[0][3]) and torch.equal(dst[1][3], before[1][3])
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


def _slot_bytes(c, key):
    with c.get(key) as h:
        return bytes(h.data)


# each header field (at its offset in _HEADER "<8sII16s16sQII"), a value this engine never
# writes there, and the reason a load gives
TAMPERED = [(0, b"NOTUCMKV", "bad magic"), (8, (9).to_bytes(4, "little"), "format version 9"),
            (12, (3).to_bytes(4, "little"), "holds 3 layer(s)"),
            (16, b"\xee" * 16, "another namespace or KV layout"),
            (32, b"\x11" * 15 + b"\x00", "names another key"),
            (47, b"\x00", "names another key"),   # the key's last byte only (NULs count)
            (48, (1).to_bytes(8, "little"), "names another key"),
            (56, (5).to_bytes(4, "little"), "5 payload bytes")]


def test_a_load_checks_every_header_field_of_every_block_at_once(make_cache):
    """A load reads the step's headers in one copy and compares them at once: a block whose
    header differs in any one field (or whose stored length is not a block's) fails with the
    reason check_header gives, its rows untouched, while the blocks beside it in the same load
    are loaded."""
    src = _kv(blocks=10, seed=1)
    need = HEADER_SIZE + sum(t[0:1].numel() * t.element_size() for t in src)
    c = make_cache(slots_per_rank=32, slot_size=need, max_ranks=2)
    io = _io(c, src)
    keys = uv.block_keys(list(range(100, 100 + 10 * BS + 1)), ID)[:10]
    keys[5] = keys[5][:15] + b"\x01"   # its last byte tampered to 0 below must differ
    assert io.save(keys, list(range(10))).blocks_saved == 10
    stored = [_slot_bytes(c, k) for k in keys]
    cases = TAMPERED + [(None, None, f"bytes stored, a block is {need}")]
    for i, (at, value, _) in enumerate(cases):   # blocks 0-8 tampered, block 9 left as saved
        raw = bytearray(stored[i])
        if at is None:
            raw = raw[:-8]
        else:
            raw[at:at + len(value)] = value
        assert c.delete(keys[i])
        with c.get(keys[i]) as h:
            assert h.owner
            h.data[:len(raw)] = raw
            h.ready(len(raw))
    dst = _kv(blocks=10, seed=2)
    before = [t.clone() for t in dst]
    looked = []
    check = _vb.check_header
    _vb.check_header = lambda raw, **kw: (looked.append(kw["block_id"]), check(raw, **kw))[1]
    try:
        for on_layer in (None, lambda layer: None):
            looked.clear()
            res = _io(c, dst).load(keys, list(range(10)), on_layer=on_layer)
            assert res.loaded == 1
            for i, (_, _, why) in enumerate(cases):
                assert why in res.failed[i], (i, res.failed[i])
                assert all(torch.equal(d[i], b[i]) for d, b in zip(dst, before))
            assert all(torch.equal(d[9], s_[9]) for d, s_ in zip(dst, src))
            # the good block passed the at-once check; only the others were looked at alone
            assert looked == keys[:9]
    finally:
        _vb.check_header = check


def test_vllm_cpus_layout_moves_by_the_c_copy_and_its_crc_is_the_two_pass_crc(make_cache):
    """[blocks, kv heads, block size, 2 x head size], contiguous: each layer's block is one
    range: a save and a whole-block load copy all of a step's layers and blocks in one C call,
    a layer-by-layer load one call per layer; the header's CRC-32C is the one a separate pass
    over the stored payload sums (the block format is unchanged)."""
    src, dst = _kv(seed=1), _kv(seed=2)
    need = HEADER_SIZE + sum(t[0:1].numel() * t.element_size() for t in src)
    c = make_cache(slots_per_rank=16, slot_size=need, max_ranks=2)
    io = _io(c, src)
    assert io.fast_layers == 2
    keys = uv.block_keys(PROMPT, ID)
    calls = []
    copy = _vb.copy_segments
    try:
        _vb.copy_segments = lambda *a, **k: (calls.append(len(a[0])), copy(*a, **k))
        assert io.save(keys[:3], [5, 1, 6]).blocks_saved == 3
        assert _io(c, dst).load(keys[:3], [0, 2, 3]).loaded == 3
        layers = []
        assert _io(c, dst).load(keys[:3], [0, 2, 3], on_layer=layers.append).loaded == 3
    finally:
        _vb.copy_segments = copy
    assert layers == [0, 1]
    # a save: the step's payload in one call, then its 3 headers in one; a whole-block load:
    # its 3 headers read in one call, then one; layer by layer: the headers, then one a layer
    assert calls == [6, 3, 3, 6, 3, 3, 3]
    for a, b in ((5, 0), (1, 2), (6, 3)):
        assert all(torch.equal(s[a], d[b]) for s, d in zip(src, dst))
    for k, b in zip(keys[:3], (5, 1, 6)):
        raw = _slot_bytes(c, k)
        why, crc = uv.check_header(raw, n_layers=2, fingerprint=io.fingerprint, block_id=k,
                                   offset=0, payload=io.payload)
        assert why is None and crc == crc32c(raw[HEADER_SIZE:]) == crc32c_soft(raw[HEADER_SIZE:])
        assert raw[HEADER_SIZE:] == b"".join(t[b].numpy().tobytes() for t in src)


def test_a_layout_whose_blocks_are_not_one_range_is_copied_by_torch_with_the_same_bytes(
        make_cache, caplog):
    """Blocks whose K and V halves lie apart (a [2, blocks, ...] tensor seen as [blocks, 2,
    ...]): not one range of memory, so torch copies each block, logged at start; the stored
    bytes are the block in its logical order, as any engine of that layout reads them."""
    def kv(seed):
        g = torch.Generator().manual_seed(seed)
        return [torch.rand((2, 8, BS, 2, 32), generator=g).transpose(0, 1) for _ in range(2)]
    src, dst = kv(1), kv(2)
    assert not src[0][0].is_contiguous()
    need = HEADER_SIZE + sum(t[0:1].numel() * t.element_size() for t in src)
    c = make_cache(slots_per_rank=16, slot_size=need, max_ranks=2)
    with caplog.at_level("WARNING", logger="ucmcache.vllm"):
        io = _io(c, src)
    assert io.fast_layers == 0 and "copied with torch per block" in caplog.text
    keys = uv.block_keys(PROMPT, ID)
    assert io.save(keys[:2], [3, 6]).blocks_saved == 2
    res = _io(c, dst).load(keys[:2], [1, 7])
    assert res.loaded == 2 and not res.failed
    assert all(torch.equal(s[3], d[1]) and torch.equal(s[6], d[7]) for s, d in zip(src, dst))
    raw = _slot_bytes(c, keys[0])
    assert raw[HEADER_SIZE:] == b"".join(t[3].contiguous().numpy().tobytes() for t in src)
    assert crc32c(raw[HEADER_SIZE:]) == uv.check_header(
        raw, n_layers=2, fingerprint=io.fingerprint, block_id=keys[0], offset=0,
        payload=io.payload)[1]


def test_a_permuted_dense_layout_moves_raw_and_is_never_read_by_an_ordered_one(make_cache):
    """Blocks that are one range of memory in a permuted order (an HND view of NHD memory):
    the C copy moves them as they lie, and the fingerprint says so, so an engine whose blocks
    are in order never reads them as its own."""
    def kv(seed):
        g = torch.Generator().manual_seed(seed)
        return [torch.rand((8, 2, 2, BS, 32), generator=g).permute(0, 1, 3, 2, 4)
                for _ in range(2)]
    src, dst = kv(1), kv(2)
    need = HEADER_SIZE + sum(t[0:1].numel() * t.element_size() for t in src)
    c = make_cache(slots_per_rank=16, slot_size=need, max_ranks=2)
    io = _io(c, src)
    assert io.fast_layers == 2 and not src[0][0].is_contiguous()
    keys = uv.block_keys(PROMPT, ID)
    assert io.save(keys[:2], [3, 6]).blocks_saved == 2
    res = _io(c, dst).load(keys[:2], [1, 7])
    assert res.loaded == 2
    assert all(torch.equal(s[3], d[1]) and torch.equal(s[6], d[7]) for s, d in zip(src, dst))
    ordered = [t.contiguous() for t in kv(3)]
    assert _io(c, ordered).fingerprint != io.fingerprint
    assert _io(c, ordered).load(keys[:1], [0]).loaded == 0


def test_layers_with_different_block_counts_are_refused_before_any_copy(make_cache):
    """Block ids are bounded by one count for every layer: a layer with fewer rows (here a
    view of the first 4 blocks of a larger buffer) would be written past its end by the C
    copy, so the copier refuses it at start."""
    src = _kv()
    need = HEADER_SIZE + sum(t[0:1].numel() * t.element_size() for t in src)
    c = make_cache(slots_per_rank=16, slot_size=need, max_ranks=2)
    keys = uv.block_keys(PROMPT, ID)
    assert _io(c, src).save(keys[:1], [0]).blocks_saved == 1
    big = torch.zeros((16, 2, BS, 2, 32))
    with pytest.raises(_vb.VllmConnectorError, match="layer 1: KV cache of 4 rows, layer 0 of "
                                                     "8: every layer needs the same number"):
        _io(c, [torch.zeros((8, 2, BS, 2, 32)), big[0:4]])
    with pytest.raises(ValueError, match="block id 8 is outside the KV cache's 8 blocks"):
        _io(c, _kv(seed=3)).load(keys[:1], [8])


def test_a_save_whose_copy_fails_publishes_failed_and_nothing_ready(make_cache):
    src = _kv(seed=1)
    need = HEADER_SIZE + sum(t[0:1].numel() * t.element_size() for t in src)
    c = make_cache(slots_per_rank=16, slot_size=need, max_ranks=2)
    io = _io(c, src)
    copy_layer = io._copy_layer

    def broken(blocks, slots, *args):   # layer 0 copied, then the copy breaks
        copy_layer(0, blocks, slots, *args)
        raise RuntimeError("copy broke")

    io._copy_blocks = broken
    keys = uv.block_keys(PROMPT, ID)
    st = io.save(keys[:2], [0, 1])
    assert st.blocks_saved == 0 and st.blocks_not_saved == 2
    assert c.exist(keys[:2]) == [False, False] and c.entry_count() == 0
    res = _io(c, _kv(seed=2)).load(keys[:2], [0, 1])
    assert res.loaded == 0 and set(res.failed) == {0, 1}


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
    assert 0 < ll.run_cpu_ns <= ll.run_ns + 10_000   # (the clocks are read one after the other)
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


# ---------------------------------------------------------------- saves off the step


def _saves(make_cache):
    src = _kv(seed=1)
    need = HEADER_SIZE + sum(t[0:1].numel() * t.element_size() for t in src)
    c = make_cache(slots_per_rank=16, slot_size=need, max_ranks=2)
    return c, src, _vb.DeferredSaves(_io(c, src), _GatedExecutor())


def test_a_deferred_save_returns_at_once_and_publishes_its_blocks_only_once_copied(make_cache):
    c, src, saves = _saves(make_cache)
    keys = uv.block_keys(PROMPT, ID)
    job = saves.submit(["r1", "r2"], keys[:3], [5, 1, 6])
    assert saves.pending({"r2"}) == [job] and saves.pending({"other"}) == []
    assert c.exist(keys[:3]) == [False] * 3          # handed over, not copied yet
    assert saves.take_stats().empty()                # nothing over to count
    saves.executor.thread.start()                    # the save thread runs it
    saves.wait_for({"r1"})                           # as get_finished does for a finished one
    saves.executor.thread.join(30)
    assert c.exist(keys[:3]) == [True] * 3 and saves.pending() == []
    st = saves.take_stats()
    assert st.blocks_saved == 3 and st.bytes_saved == 3 * saves.io.need and not st.saves_dropped
    dst = _kv(seed=2)
    assert _io(c, dst).load(keys[:3], [0, 1, 2]).loaded == 3
    assert all(torch.equal(s[5], d[0]) and torch.equal(s[6], d[2]) for s, d in zip(src, dst))


def test_a_deferred_save_not_over_in_time_is_dropped_and_publishes_failed_never_ready(
        make_cache):
    """What handle_preemptions and get_finished do when a save outlives SAVE_WAIT: after
    wait_for returns vLLM may write the blocks, so the copy, whenever it ends, publishes
    Failed."""
    c, src, saves = _saves(make_cache)
    keys = uv.block_keys(PROMPT, ID)
    saves.submit(["r"], keys[:2], [0, 1])
    saves.wait_for({"someone else"}, timeout=0.01)   # not this request's: nothing dropped
    assert saves.take_stats().saves_dropped == 0
    saves.wait_for({"r"}, timeout=0.01)              # the thread never started: dropped
    saves.executor.thread.start()
    saves.executor.thread.join(30)
    assert c.exist(keys[:2]) == [False, False] and c.entry_count() == 0
    st = saves.take_stats()
    assert st.saves_dropped == 1 and st.blocks_not_saved == 2 and st.blocks_saved == 0


class _CountingCache:
    """A cache whose get_many calls (a save's claims) are counted."""

    def __init__(self, cache):
        self.cache, self.claims = cache, 0

    def get_many(self, keys):
        self.claims += 1
        return self.cache.get_many(keys)

    def __getattr__(self, name):
        return getattr(self.cache, name)


def test_a_stuck_save_is_dropped_once_with_the_saves_queued_behind_it(make_cache, monkeypatch):
    """A save that does not end (held between two layers) is dropped by the first wait that
    outlives its timeout, together with every save queued behind it on the save thread; later
    waits do not wait for them again, and a save submitted later, queued behind the stuck one,
    is dropped without a wait; a dropped save claims no more chunks, and one dropped before it
    starts claims nothing.  Each drop is counted once."""
    import threading
    from concurrent.futures import ThreadPoolExecutor
    monkeypatch.setattr(_vb, "SAVE_CHUNK", 1)     # a chunk a block: the claim before each
    src = _kv(seed=1)
    need = HEADER_SIZE + sum(t[0:1].numel() * t.element_size() for t in src)
    c = make_cache(slots_per_rank=16, slot_size=need, max_ranks=2)
    io = _io(c, src)
    io.cache = counting = _CountingCache(c)
    entered, gate = threading.Event(), threading.Event()

    def stuck(layer):
        entered.set()
        gate.wait(20)     # bounded: then the stuck save ends, and what is queued behind runs

    io._test_points["save_between_layers"] = stuck
    ex = ThreadPoolExecutor(1)
    saves = _vb.DeferredSaves(io, ex)
    keys = uv.block_keys(list(range(6 * BS + 1)), ID)
    try:
        first = saves.submit(["r0"], keys[:2], [0, 1])        # 2 chunks; stuck in the 1st
        assert entered.wait(30)
        behind = [saves.submit(["r1"], keys[2:3], [2]), saves.submit(["r2"], keys[3:4], [3])]
        assert saves.wait_for({"r0"}, timeout=0.01) == 1      # dropped, and those behind it
        assert first.dropped() and all(j.dropped() for j in behind)
        assert saves.wait_for(timeout=0.01) == 0              # none of them waited for again
        assert saves.wait_for({"r2"}, timeout=0.01) == 0
        assert saves.wait_for(keep=1, timeout=0.01) == 0
        assert saves.take_stats().saves_dropped == 3          # once each
        later = saves.submit(["r3"], keys[4:5], [4])          # the next step's, behind it
        assert saves.wait_for({"r3"}, timeout=60) == 1 and later.dropped()   # no wait
    finally:
        gate.set()
        ex.shutdown(wait=True)
    assert counting.claims == 1                               # the stuck chunk only
    assert c.exist(keys[:5]) == [False] * 5 and c.entry_count() == 0
    st = saves.take_stats()
    assert st.saves_dropped == 1 and st.blocks_saved == 0 and st.blocks_not_saved == 5


def test_a_preempted_requests_save_is_finished_before_the_wait_returns(make_cache):
    """handle_preemptions' wait: the copy in flight ends and is published whole before the
    step goes on to write the freed blocks; saves of two steps ago are waited for at submit
    (keep=1 leaves the last step's running)."""
    c, src, saves = _saves(make_cache)
    keys = uv.block_keys(PROMPT, ID)
    first = saves.submit(["a"], keys[:2], [0, 1])
    t1 = saves.executor.thread
    saves.executor = _GatedExecutor()
    second = saves.submit(["b"], keys[2:4], [2, 3])
    assert saves.pending() == [first, second]
    t1.start()
    saves.wait_for(keep=1)                           # the first is over; the second is left
    assert first.future.done() and not second.future.done()
    saves.executor.thread.start()
    saves.wait_for({"b"}, timeout=30)
    assert c.exist(keys[:4]) == [True] * 4
    t1.join(30)
    saves.executor.thread.join(30)
    assert saves.take_stats().blocks_saved == 4


def test_an_engine_killed_mid_deferred_save_leaves_nothing_ready_and_verify_clean(
        make_cache, procs):
    """A worker process SIGKILLed while its save thread is between two layers' copies: none of
    the blocks is Ready, before or after its rank is recovered; the segment verifies clean and
    the blocks can be saved again and read whole."""
    import signal

    import ucmcache
    import vllm_workers as VW
    from conftest import SPAWN
    layers = VW.kv_layers(7)
    need = HEADER_SIZE + sum(t[0:1].numel() * t.element_size() for t in layers)
    c = make_cache(slots_per_rank=16, slot_size=need, max_ranks=4)
    keys = uv.block_keys(PROMPT, ID)
    arrived, release = SPAWN.Event(), SPAWN.Event()
    p, q = procs.start(VW.save_deferred_then_stop, c.uuid, ID.namespace, keys[:3], [2, 4, 6],
                       arrived, release)
    # (release is never set: the child is killed while it waits on it, and setting an Event
    # a killed process waited on can hang; the kill is what releases it, pass or fail)
    try:
        assert arrived.wait(60), "the save thread never reached its copy"
        assert c.exist(keys[:3]) == [False] * 3      # owned, layer 0 copied, not published
    finally:
        os.kill(p.pid, signal.SIGKILL)
        p.join(30)
    assert p.exitcode == -signal.SIGKILL
    assert c.exist(keys[:3]) == [False] * 3
    c.recover()                                      # the dead rank's loads are failed now
    assert c.exist(keys[:3]) == [False] * 3
    assert ucmcache.verify(c.uuid).ok
    io = KVBlockIO(c, layers, namespace=ID.namespace)
    assert io.save(keys[:3], [2, 4, 6]).blocks_saved == 3
    dst = [torch.zeros_like(t) for t in layers]
    assert KVBlockIO(c, dst, namespace=ID.namespace).load(keys[:3], [2, 4, 6]).loaded == 3
    assert all(torch.equal(a[b], d[b]) for a, d in zip(layers, dst) for b in (2, 4, 6))


def test_a_new_segment_is_clamped_by_memavailable_with_a_log_line(uuid, monkeypatch, caplog):
    monkeypatch.setattr(kit, "mem_available_bytes", lambda: 8 << 20)
    monkeypatch.setattr(kit, "shm_free_bytes", lambda: 1 << 40)
    with caplog.at_level("WARNING", logger="ucmcache.vllm"):
        c = uv.open_segment(uuid, slot_size=64 << 10, size_mb=256, max_ranks=2)
    try:
        assert c.capacity * c.slot_size <= 4 << 20
        assert "but MemAvailable has 8388608 bytes free: using 4194304" in caplog.text
    finally:
        c.close()


# ------------------------------------------------------------------ copy threads' CPUs

@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs sched_setaffinity and two CPUs")
def test_copy_threads_run_on_the_engines_cpus_the_worker_is_not_bound_to():
    """vLLM binds a CPU worker's threads to its cores; a thread it starts later inherits that.
    The connector's copy threads go to the CPUs the engine's process may use besides those."""
    from concurrent.futures import ThreadPoolExecutor
    from ucmcache.engines.vllm.worker import _run_on, spare_cpus
    cpus = sorted(os.sched_getaffinity(0))
    bound, rest = {cpus[0]}, set(cpus[1:])

    def worker_thread():
        os.sched_setaffinity(0, bound)           # as vLLM's OpenMP binding leaves a worker
        spare = spare_cpus(os.getpid())          # this process's main thread: the "engine"
        with ThreadPoolExecutor(1, initializer=_run_on, initargs=(spare,)) as ex:
            copy = ex.submit(os.sched_getaffinity, 0).result(timeout=30)
        with ThreadPoolExecutor(1) as ex:        # what a thread inherits without it
            inherited = ex.submit(os.sched_getaffinity, 0).result(timeout=30)
        return spare, copy, inherited

    with ThreadPoolExecutor(1) as ex:
        spare, copy, inherited = ex.submit(worker_thread).result(timeout=60)
    assert spare == rest and copy == rest and inherited == bound


def test_copy_threads_stay_put_when_nothing_is_spare_or_asked():
    from ucmcache.vllm import ConnectorConfig, spare_cpus
    assert spare_cpus(os.getpid()) is None       # the same CPUs as the engine: none spare
    assert ConnectorConfig.from_extra({}).copy_cpus == "spare"
    assert ConnectorConfig.from_extra({"copy_cpus": "inherit"}).copy_cpus == "inherit"
    with pytest.raises(uv.VllmConnectorError, match="'copy_cpus' must be 'spare' or 'inherit'"):
        ConnectorConfig.from_extra({"copy_cpus": "all"})
