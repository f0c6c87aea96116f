"""UcmCacheStore (ucmcache.ucm): its config, and blocks dumped and loaded in one process.

The end-to-end shape is the one UCM tests its own stores with (ucm/store/test/e2e): a
scheduler-side store (device_id -1) and a worker store on one segment, lookup -> dump -> wait ->
lookup -> load -> wait -> compare, bf16 tensors, many layers per block.  Torch tests use real
CPU tensors (torch==2.13.0 is a test dependency) and skip, saying so, where torch is missing;
every behaviour is also tested with numpy arrays.  Threads and processes are ordered with
events, never sleeps; every wait is bounded; segments are the fixture's uuid (always removed).
"""
import os

import numpy as np
import pytest

import ucmcache
import ucmcache.ucm as U
from ucmcache.ucm import UcmCacheStore, UcmCacheTask, segment_name

import ucm_workers as W
from ucm_store_fixtures import (BOUND, KINDS, NEED_TORCH, _bytes, _cfg, _gate,  # noqa: F401
                                stores, torch)


# ---------------------------------------------------------------- config

def test_config_missing_keys_are_named_and_unknown_keys_ignored(uuid):
    # A worker store needs its sizes; a scheduler-side one (device_id -1) takes them from the
    # segment (UCM gives its scheduler no shard_size).
    with pytest.raises(ValueError, match=r"missing shard_size \(or block_size\); got keys "
                                         r"\['device_id', 'unique_id'\]"):
        UcmCacheStore({"unique_id": uuid, "device_id": 0})
    with UcmCacheStore({"unique_id": uuid}) as s:
        assert s.cache is None and s.lookup([b"x" * 16]) == [False]
    with pytest.raises(ValueError, match="'shard_size' must be an int"):
        UcmCacheStore({"unique_id": uuid, "shard_size": "big"})
    with pytest.raises(ValueError, match=r"config buffer_size \(1000 bytes\) holds no slot"):
        UcmCacheStore({"unique_id": uuid, "shard_size": 4096, "buffer_size": 1000,
                       "device_id": 0})
    with pytest.raises(ValueError, match="block_size 5000 is not a multiple of shard_size 4096"):
        UcmCacheStore({"unique_id": uuid, "shard_size": 4096, "block_size": 5000,
                       "device_id": 0})
    # No unique_id at all (SGLang passes none), or UCM's vLLM connector (tensor_layout; its
    # unique_id is new at every start): the default name; ucmcache_segment names it anyway.
    from ucmcache.engines.ucm.config import _Config
    assert _Config({"shard_size": 64, "device_id": 0}).segment == f"ucm-kv-u{os.getuid()}"
    assert _Config({"unique_id": "ab" * 16, "tensor_layout": "mla"}).segment == \
        f"ucm-mla-u{os.getuid()}"
    assert _Config({"unique_id": "x", "tensor_layout": "gqa",
                    "ucmcache_segment": "kv/1"}).segment == segment_name("kv/1")
    # engine_id names the segment when unique_id is absent; block_size sizes the slots;
    # keys for other stores (store_pipeline, storage_backends...) are ignored.
    with UcmCacheStore({"engine_id": uuid, "block_size": 2048, "device_id": 0,
                        "buffer_size": 2048 * 8 * 16, "store_pipeline": "Cache|Posix",
                        "storage_backends": ["/x"], "posix_gc_enable": True}) as s:
        assert s.segment == uuid
        assert s.cache.slot_size == 2048 and s.cache.max_ranks == 16  # kit.DEFAULT_MAX_RANKS
        assert s.cc_store() == 0 and "0" in UcmCacheStore.cc_store.__doc__
        assert s.need_register_kv_caches() is False


def test_segment_names_from_any_unique_id():
    assert segment_name("abc-123_X") == "abc-123_X"
    odd = segment_name("vllm engine/0:dp1")
    assert odd.startswith("vllm_engine_0_dp1-") and odd == segment_name("vllm engine/0:dp1")
    assert segment_name("x" * 100) != segment_name("x" * 99) and len(segment_name("x" * 100)) <= 64


# ---------------------------------------------------------------- the e2e shape UCM uses

@NEED_TORCH
def test_e2e_scheduler_and_worker_bf16_many_layers(uuid, stores):
    layers, chunk, blocks, tensor_bytes = 8, 4, 16, 2048     # 32 bf16 tensors per block
    n_tensors = layers * chunk
    cfg = _cfg(uuid, n_tensors, tensor_bytes)
    # The scheduler-side store may come first: no segment yet, lookups say "not found".
    scheduler = stores(dict(cfg, device_id=-1))
    ids = W.block_ids(1, blocks)
    assert scheduler.cache is None and scheduler.lookup(ids) == [False] * blocks
    worker = stores(cfg)
    assert not any(scheduler.lookup(ids)) and scheduler.lookup_on_prefix(ids) == -1
    src = W.make_blocks("torch", 1, blocks, n_tensors, tensor_bytes)
    assert src[0][0].dtype == torch.bfloat16
    task = worker.dump(ids, [0] * blocks, src)
    assert isinstance(task, UcmCacheTask)
    worker.wait(task)
    assert worker.check(task)
    assert scheduler.lookup(ids) == [True] * blocks
    assert scheduler.lookup_on_prefix(ids) == blocks - 1
    assert scheduler.lookup_on_prefix(ids[:3] + [b"\x00" * 16] + ids[3:]) == 2
    assert scheduler.lookup_on_reverse([b"\x01" * 16] + ids[:2] + [b"\x02" * 16]) == 2
    dst = [[torch.empty_like(t) for t in row] for row in src]
    task = worker.load(ids, [0] * blocks, dst)
    worker.wait(task)
    assert W.same("torch", src, dst)
    # The same blocks into one contiguous destination: the one-C-call path.
    whole = torch.zeros(blocks, n_tensors, tensor_bytes // 2, dtype=torch.bfloat16)
    worker.wait(worker.load(ids, [0] * blocks,
                            [[whole[i, j] for j in range(n_tensors)] for i in range(blocks)]))
    assert all(torch.equal(whole[i, j], src[i][j]) for i in range(blocks)
               for j in range(n_tensors))
    assert ucmcache.verify(uuid).ok


@pytest.mark.parametrize("kind", KINDS)
def test_e2e_numpy_and_torch_through_both_load_paths(uuid, stores, kind):
    cfg = _cfg(uuid, 3, 4096)
    worker, scheduler = stores(cfg), stores(dict(cfg, device_id=-1))
    ids = W.block_ids(2, 6)
    src = W.make_blocks(kind, 2, 6, 3, 4096)
    worker.wait(worker.dump(ids, [0] * 6, src))
    assert scheduler.lookup(ids) == [True] * 6
    scattered = W.empty_like(kind, src)
    worker.wait(worker.load(ids, [0] * 6, scattered))
    assert W.same(kind, src, scattered)
    flat = np.zeros((6, 3, 4096), dtype=np.uint8)   # one run of equal rows: read_many
    worker.wait(worker.load(ids, [0] * 6, [list(flat[i]) for i in range(6)]))
    assert all(np.array_equal(flat[i, j], _bytes(src[i][j])) for i in range(6) for j in range(3))


def test_raw_addresses_dump_data_load_data_fetch_data(uuid, stores):
    n, m, size = 5, 4, 1024
    store = stores(_cfg(uuid, m, size))
    src = np.random.default_rng(3).integers(0, 256, (n, m, size), dtype=np.uint8)
    ids = W.block_ids(3, n)
    addrs = [[src[i, j].ctypes.data for j in range(m)] for i in range(n)]
    store.wait(store.dump_data(ids, [0] * n, addrs))
    for name in ("load_data", "fetch_data"):
        dst = np.zeros_like(src)
        dst_addr = np.array([[dst[i, j].ctypes.data for j in range(m)] for i in range(n)],
                            dtype=np.uint64)
        store.wait(getattr(store, name)(ids, [0] * n, dst_addr))
        assert np.array_equal(src, dst), name
    with pytest.raises(ValueError, match="prerequisite_handle must be an event handle >= 0"):
        store.dump_data(ids, [0] * n, addrs, prerequisite_handle=-7)
    with pytest.raises(ValueError, match="3 address"):
        store.load_data(ids, [0] * n, [row[:3] for row in addrs])


# ---------------------------------------------------------------- shards, missing blocks

@pytest.mark.parametrize("kind", KINDS)
def test_shards_per_layer(uuid, stores, kind):
    """Layer-wise dumps: block i's layer l is shard l, one slot each, plus one complete mark
    per block once all its layers are in."""
    layers, n, size = 6, 4, 2048
    store = stores(_cfg(uuid, 2, size, shards=layers))   # a shard: K and V of one layer
    ids = W.block_ids(4, n)
    per_layer = [W.make_blocks(kind, 100 + layer, n, 2, size) for layer in range(layers)]
    for layer in range(layers):
        store.wait(store.dump(ids, [layer] * n, per_layer[layer]))
    assert store.lookup(ids) == [True] * n
    assert store.cache.entry_count() == (layers + 1) * n  # a slot per shard, and the mark
    for layer in reversed(range(layers)):
        dst = W.empty_like(kind, per_layer[layer])
        store.wait(store.load(ids, [layer] * n, dst))
        assert W.same(kind, per_layer[layer], dst), layer
    # Shards of one block in one task: block ids may repeat with their shard indexes.
    dst = W.empty_like(kind, [per_layer[layer][1] for layer in range(layers)])
    store.wait(store.load([ids[1]] * layers, list(range(layers)), dst))
    assert W.same(kind, [per_layer[layer][1] for layer in range(layers)], dst)


@pytest.mark.parametrize("kind", KINDS)
def test_missing_block_is_named_and_its_tensors_untouched(uuid, stores, kind):
    store = stores(_cfg(uuid, 2, 1024))
    ids = W.block_ids(5, 3)
    src = W.make_blocks(kind, 5, 3, 2, 1024)
    store.wait(store.dump([ids[0], ids[2]], [0, 0], [src[0], src[2]]))
    dst = W.empty_like(kind, src)
    task = store.load(ids, [0, 0, 0], dst)
    with pytest.raises(RuntimeError) as e:
        store.wait(task)
    msg = str(e.value)
    assert "1 of 3 block(s) failed" in msg and f"block 1 (id {ids[1].hex()}, shard 0)" in msg
    assert "missing" in msg and store.check(task)
    assert W.same(kind, [src[0], src[2]], [dst[0], dst[2]])
    assert not any(_bytes(t).any() for t in dst[1])
    # A shard stored with another size is refused, not half-copied into a smaller tensor.
    other = W.make_blocks(kind, 6, 1, 1, 1024)
    with pytest.raises(RuntimeError, match="stored with 2048 bytes, the destination tensors "
                                           "hold 1024"):
        store.wait(store.load([ids[0]], [0], other))


def test_oversized_and_malformed_arguments_raise_at_the_call(uuid, stores):
    store = stores(_cfg(uuid, 2, 1024))
    ids = W.block_ids(7, 2)
    big = [[np.zeros(1024, np.uint8)] * 3] * 2
    with pytest.raises(ValueError, match="block 0's tensors hold 3072 bytes, more than a slot"):
        store.dump(ids, [0, 0], big)
    with pytest.raises(ValueError, match="1 rows of tensors for 2 block ids"):
        store.dump(ids, [0, 0], big[:1])
    with pytest.raises(ValueError, match="shard_index has 1 entries for 2 block ids"):
        store.dump(ids, [0], big)
    with pytest.raises(ValueError, match="block 1: .*read-only"):
        ro = np.zeros(1024, np.uint8)
        ro.flags.writeable = False
        store.load(ids, [0, 0], [[np.zeros(1024, np.uint8)], [ro]])
    with pytest.raises(ValueError, match="C-contiguous"):
        store.dump(ids[:1], [0], [[np.zeros((4, 512), np.uint8)[:, ::2]]])


# ---------------------------------------------------------------- dumps: skip, single flight

def test_dump_skips_blocks_already_stored(uuid, stores):
    a, b = stores(_cfg(uuid, 2, 1024)), stores(_cfg(uuid, 2, 1024))
    ids = W.block_ids(8, 4)
    first = W.make_blocks("numpy", 8, 4, 2, 1024)
    a.wait(a.dump(ids, [0] * 4, first))
    loads = a.cache.stats()["loads_started"]
    b.wait(b.dump(ids, [0] * 4, W.make_blocks("numpy", 9, 4, 2, 1024)))   # other bytes
    assert a.cache.stats()["loads_started"] == loads  # no slot was claimed again
    dst = W.empty_like("numpy", first)
    b.wait(b.load(ids, [0] * 4, dst))
    assert W.same("numpy", first, dst)              # still the first dump's bytes


def test_single_flight_a_block_being_dumped_is_not_written_twice(uuid, stores):
    a, b = stores(_cfg(uuid, 2, 1024)), stores(_cfg(uuid, 2, 1024))
    ids = W.block_ids(10, 3)
    mine, theirs = W.make_blocks("numpy", 10, 3, 2, 1024), W.make_blocks("numpy", 11, 3, 2, 1024)
    arrived, release = _gate(a, "after_copy", 0)       # a holds block 0 copied, not published
    joined, go_on = _gate(b, "joined", 0)
    task_a = a.dump(ids, [0] * 3, mine)
    assert arrived.wait(BOUND)
    assert b.lookup(ids) == [False, False, False]      # copied is not published
    task_b = b.dump(ids, [0] * 3, theirs)
    assert joined.wait(BOUND)                          # b found block 0 being dumped by a
    assert not b.check(task_b)
    go_on.set()
    release.set()
    a.wait(task_a)
    b.wait(task_b)
    dst = W.empty_like("numpy", mine)
    b.wait(b.load(ids, [0] * 3, dst))
    assert W.same("numpy", mine, dst)                  # a's bytes: b wrote none of them
    assert b.cache.stats()["per_rank"][b.cache.rank]["loads_started"] == 0
    assert a.cache.stats()["per_rank"][a.cache.rank]["loads_started"] == 3


def test_a_failed_dump_publishes_failed_and_another_takes_over(uuid, stores):
    a, b = stores(_cfg(uuid, 2, 1024)), stores(_cfg(uuid, 2, 1024))
    ids = W.block_ids(12, 2)
    mine, theirs = W.make_blocks("numpy", 12, 2, 2, 1024), W.make_blocks("numpy", 13, 2, 2, 1024)

    def boom():
        raise OSError("device lost mid-copy")

    arrived, release = _gate(a, "after_copy", 0, then=boom)
    joined, go_on = _gate(b, "joined", 0)
    task_a = a.dump(ids, [0, 0], mine)
    assert arrived.wait(BOUND)
    task_b = b.dump(ids, [0, 0], theirs)
    assert joined.wait(BOUND)
    go_on.set()
    release.set()
    with pytest.raises(RuntimeError, match=r"block 0 .*dump failed: OSError: device lost"):
        a.wait(task_a)
    b.wait(task_b)                                     # b waited, saw Failed, took block 0 over
    dst = W.empty_like("numpy", mine)
    a.wait(a.load(ids, [0, 0], dst))
    assert W.same("numpy", [theirs[0], mine[1]], dst)
    assert ucmcache.verify(uuid).ok


def test_clear_fences_a_dump_in_flight(uuid, stores):
    """cache.clear() while a dump is between its copy and its publish: after the clear, neither
    the old blocks nor that dump's are ever found; the next dump stores them again."""
    store = stores(_cfg(uuid, 2, 1024))
    old, new = W.block_ids(14, 2), W.block_ids(15, 2)
    store.wait(store.dump(old, [0, 0], W.make_blocks("numpy", 14, 2, 2, 1024)))
    arrived, release = _gate(store, "after_copy", 0)
    src = W.make_blocks("numpy", 15, 2, 2, 1024)
    task = store.dump(new, [0, 0], src)
    assert arrived.wait(BOUND)
    store.cache.clear()
    release.set()
    store.wait(task)                                   # published into a cleared generation
    assert store.lookup(old + new) == [False] * 4
    assert store.cache.entry_count() == 0
    store._test_points.clear()
    store.wait(store.dump(new, [0, 0], src))
    dst = W.empty_like("numpy", src)
    store.wait(store.load(new, [0, 0], dst))
    assert W.same("numpy", src, dst) and store.cache.entry_count() == 2





@pytest.mark.parametrize("stored", ["smaller", "larger"])
def test_refused_contiguous_load_leaves_the_destination_untouched(uuid, stores, stored):
    """A load into one contiguous destination of a shard stored with another size is refused
    and leaves that block's rows exactly as they were; the other blocks are loaded
    (with a smaller stored shard, its bytes used to be copied in already)."""
    row = 2048
    store = stores(_cfg(uuid, 2, 2048))                      # slots of 4096 bytes
    ids = W.block_ids(100, 3)
    good = W.make_blocks("numpy", 100, 1, 2, row // 2)       # 2 x 1024 = one row
    other = W.make_blocks("numpy", 101, 1, 2, row // 4 if stored == "smaller" else row)
    store.wait(store.dump(ids[:1], [0], good))
    store.wait(store.dump(ids[1:2], [0], other))
    store.wait(store.dump(ids[2:], [0], good))
    flat = np.full((3, 2, row // 2), 0xAB, dtype=np.uint8)
    with pytest.raises(U.UcmBlockNotFound, match=r"1 of 3 block.*block 1 .*stored with "
                                                 rf"{1024 if stored == 'smaller' else 4096} "
                                                 r"bytes, the destination tensors hold 2048"):
        store.wait(store.load(ids, [0] * 3, [list(flat[i]) for i in range(3)]))
    assert (flat[1] == 0xAB).all()                           # untouched
    assert W.same("numpy", good, [list(flat[0])]) and W.same("numpy", good, [list(flat[2])])


def test_a_block_gone_between_a_loads_look_and_its_pins_is_missing(uuid, stores):
    """A contiguous load looks (exist) and then pins (get_many): a block evicted or cleared in
    between makes the load its loader for an instant; it is failed at once, reported missing,
    its rows untouched, and nothing is left in the segment (the one-copy path)."""
    store = stores(_cfg(uuid, 2, 1024))
    ids = W.block_ids(103, 2)
    store.wait(store.dump(ids, [0, 0], W.make_blocks("numpy", 103, 2, 2, 1024)))
    store._test_points["after_exist"] = lambda n_stored: store.cache.clear()
    flat = np.full((2, 2, 1024), 0xCD, dtype=np.uint8)
    with pytest.raises(U.UcmBlockNotFound, match=r"2 of 2 block.*block 0 .*missing"):
        store.wait(store.load(ids, [0, 0], [list(flat[i]) for i in range(2)]))
    assert (flat == 0xCD).all() and store.cache.entry_count() == 0
    assert store.lookup(ids) == [False, False] and ucmcache.verify(uuid).ok

