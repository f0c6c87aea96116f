"""UcmCacheStore (ucmcache.ucm): UCM's V1 KV store interface over a shared segment.

The end-to-end shape is the one UCM tests its own stores with (ucm/store/test/e2e): a
scheduler-side store (device_id -1) and a worker store on one segment, lookup -> dump -> wait ->
lookup -> load -> wait -> compare, bf16 tensors, many layers per block.  Torch tests use real
CPU tensors (torch==2.13.0 is a test dependency) and skip, saying so, where torch is missing;
every behaviour is also tested with numpy arrays.  Threads and processes are ordered with
events, never sleeps; every wait is bounded; segments are the fixture's uuid (always removed).
"""
import multiprocessing as mp
import os
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest

import ucmcache
from ucmcache import SlotCache
from ucmcache.ucm import UcmCacheStore, UcmCacheTask, segment_name

import ucm_workers as W

try:
    import torch
except ImportError:  # pragma: no cover - torch is in the test extra
    torch = None

NEED_TORCH = pytest.mark.skipif(torch is None, reason="torch is not installed: ./scripts/test "
                                "installs torch==2.13.0 (CPU) first; the numpy tests cover the "
                                "same behaviour")
KINDS = [pytest.param("torch", marks=NEED_TORCH), "numpy"]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BOUND = 30.0  # every event wait in these tests
SPAWN = mp.get_context("spawn")


@pytest.fixture
def stores():
    """stores(config) -> an open UcmCacheStore, closed at teardown (pass or fail)."""
    made = []

    def make(config):
        s = UcmCacheStore(config)
        made.append(s)
        return s

    yield make
    for s in reversed(made):
        s.close()


def _bytes(t):
    """A tensor's bytes as a uint8 numpy array (numpy arrays and torch tensors alike)."""
    if isinstance(t, np.ndarray):
        return t.view(np.uint8).reshape(-1)
    return t.view(torch.uint8).numpy().reshape(-1)


def _cfg(uuid, n_tensors=4, tensor_bytes=1024, **extra):
    return W.store_config(uuid, n_tensors, tensor_bytes, **extra)


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


def _gate(store, point, at, then=None):
    """Arm store's point on block `at`: set arrived, wait (bounded) for release, then run
    `then` (e.g. raise).  Returns (arrived, release)."""
    arrived, release = threading.Event(), threading.Event()

    def hit(i):
        if i == at:
            arrived.set()
            assert release.wait(BOUND), "never released"
            if then is not None:
                then()

    store._test_points[point] = hit
    return arrived, release


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


# ---------------------------------------------------------------- processes

@pytest.mark.parametrize("kind", KINDS)
def test_two_worker_processes_one_dumps_what_the_other_loads(uuid, stores, procs, kind):
    n, m, size = 12, 16, 2048
    scheduler = stores(dict(_cfg(uuid, m, size), device_id=-1))
    ids = W.block_ids(20, n)
    _, q = procs.start(W.dump, kind, uuid, 20, n, m, size)
    dumped = procs.result(q)
    assert dumped["found"] == [True] * n and dumped["pid"] != os.getpid()
    assert scheduler.lookup(ids) == [True] * n          # attached lazily, now that it exists
    _, q = procs.start(W.load, kind, uuid, 20, n, m, size)
    loaded = procs.result(q)
    assert loaded == {"pid": loaded["pid"], "found": [True] * n, "equal": True}
    assert loaded["pid"] != dumped["pid"]


@pytest.mark.parametrize("kind", KINDS)
def test_sigkill_between_two_blocks_copies(uuid, stores, procs, kind):
    """A worker published block 0 and is SIGKILLed before copying block 1 (blocks 1-3 are
    owned by it, Loading): no half-written block is ever found, others' loads go on, and the
    blocks are dumped again by a survivor once the dead worker is recovered."""
    n, m, size = 4, 4, 2048
    w = stores(_cfg(uuid, m, size))                     # creates the segment
    other_id = W.block_ids(31, 1)
    other = W.make_blocks(kind, 31, 1, m, size)
    w.wait(w.dump(other_id, [0], other))
    arrived, release = SPAWN.Event(), SPAWN.Event()
    p, q = procs.start(W.dump_then_stop, kind, uuid, 30, n, m, size, "after_publish", 0,
                       "gate", arrived, release)
    assert arrived.wait(BOUND)
    ids = W.block_ids(30, n)
    src = W.make_blocks(kind, 30, n, m, size)
    assert w.lookup(ids) == [True, False, False, False]
    dst = W.empty_like(kind, src)
    w.wait(w.load(ids[:1] + other_id, [0, 0], [dst[0], W.empty_like(kind, other)[0]]))
    assert W.same(kind, src[:1], dst[:1])
    with pytest.raises(RuntimeError, match="3 of 3 block"):
        w.wait(w.load(ids[1:], [0] * 3, dst[1:]))
    p.kill()
    p.join(BOUND)
    assert p.exitcode == -9
    assert w.lookup(ids) == [True, False, False, False]
    with pytest.raises(RuntimeError, match="3 of 3 block"):
        w.wait(w.load(ids[1:], [0] * 3, dst[1:]))
    got = W.empty_like(kind, other)
    w.wait(w.load(other_id, [0], got))                  # others' loads go on
    assert W.same(kind, other, got)
    # The survivor dumps the same blocks: the dead owner's Loading slots are recovered (its
    # waiters learn of the death within a liveness slice) and taken over.
    w.wait(w.dump(ids, [0] * n, src))
    w.wait(w.load(ids, [0] * n, dst))
    assert W.same(kind, src, dst)
    assert ucmcache.verify(uuid).ok


def test_sigkill_after_a_copy_before_its_publish(uuid, stores, procs):
    """Killed with block 1 copied whole but not published: block 1 is never found."""
    n, m, size = 4, 2, 4096
    w = stores(_cfg(uuid, m, size))
    ids = W.block_ids(40, n)
    unused = SPAWN.Event(), SPAWN.Event()  # kept alive until the child has unpickled them
    p, q = procs.start(W.dump_then_stop, "numpy", uuid, 40, n, m, size, "after_copy", 1,
                       "kill", *unused)
    p.join(BOUND)
    assert p.exitcode == -9
    assert w.lookup(ids) == [True, False, False, False]
    w.cache.recover()                                   # the dead rank's loads fail now
    assert w.lookup(ids) == [True, False, False, False]
    src = W.make_blocks("numpy", 40, n, m, size)
    dst = W.empty_like("numpy", src)
    with pytest.raises(RuntimeError, match=r"3 of 4 block.*block 1 .*missing"):
        w.wait(w.load(ids, [0] * n, dst))
    assert W.same("numpy", src[:1], dst[:1]) and not dst[1][0].any()
    assert ucmcache.verify(uuid).ok


# ---------------------------------------------------------------- roles, sharing, lifecycle

def test_scheduler_store_only_looks_up(uuid, stores):
    worker = stores(_cfg(uuid))
    scheduler = stores(dict(_cfg(uuid), device_id=-1))
    assert scheduler.cache is not None and scheduler.cache.rank != worker.cache.rank
    with pytest.raises(ucmcache.UcmError, match="scheduler-side store .* only looks up"):
        scheduler.load(W.block_ids(50, 1), [0], [[np.zeros(1024, np.uint8)]])
    with pytest.raises(ucmcache.UcmError, match="only looks up"):
        scheduler.dump_data(W.block_ids(50, 1), [0], [[0]])
    scheduler.close()
    scheduler.close()                                   # idempotent
    with pytest.raises(ucmcache.UcmError, match="closed"):
        scheduler.lookup(W.block_ids(50, 1))


def test_share_buffer_disabled_gives_a_private_segment(uuid, stores):
    # only names this test could have made count (other processes share this machine's /dev/shm)
    ours = lambda: {n for n in os.listdir("/dev/shm") if uuid[:40] in n}  # noqa: E731
    before = ours()
    a = stores(_cfg(uuid, share_buffer_enable=False))
    assert a.cache.max_ranks == 1 and a.cache.capacity == 4 * 64  # the whole buffer_size
    b = stores(_cfg(uuid, share_buffer_enable="false"))
    assert ours() == before                              # private: no name left behind
    ids = W.block_ids(60, 2)
    a.wait(a.dump(ids, [0, 0], W.make_blocks("numpy", 60, 2, 4, 1024)))
    assert a.lookup(ids) == [True, True] and b.lookup(ids) == [False, False]
    with pytest.raises(ucmcache.SegmentNotFound):
        SlotCache.attach(uuid, timeout=0)


def test_prefetch_is_a_hint_that_never_blocks(uuid, stores):
    store = stores(_cfg(uuid))
    ids = W.block_ids(70, 3)
    store.wait(store.dump(ids[:1], [0], W.make_blocks("numpy", 70, 1, 4, 1024)))
    assert store.prefetch(ids) is None
    ring = store.cache.stats()["rings"][store.cache.rank]
    assert ring["posted"] == 2                          # the stored one is skipped
    scheduler = stores(dict(_cfg(uuid + "-none"), device_id=-1))
    assert scheduler.prefetch(ids) is None              # no segment: nothing to do


def test_tasks_run_on_the_store_pool_and_check_never_blocks(uuid, stores):
    store = stores(_cfg(uuid))
    ids = W.block_ids(80, 2)
    arrived, release = _gate(store, "after_publish", 0)
    task = store.dump(ids, [0, 0], W.make_blocks("numpy", 80, 2, 4, 1024))
    assert arrived.wait(BOUND)
    assert store.check(task) is False                   # held at the gate: not done, no block
    release.set()
    store.wait(task)
    assert store.check(task) is True
    store.wait(task)                                    # waiting again is fine


def test_subclasses_ucm_base_when_ucm_is_importable(tmp_path):
    """With UCM importable, UcmCacheStore is a UcmKVStoreBaseV1 (UCM's factory asserts it) and
    implements every abstract method of the interface's versions; the factory's import by
    module path and class name finds it."""
    pkg = tmp_path / "ucm" / "store"
    pkg.mkdir(parents=True)
    (tmp_path / "ucm" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "ucmstore_v1.py").write_text(textwrap.dedent('''
        from abc import ABC, abstractmethod
        class Task(ABC):
            pass
        class UcmKVStoreBaseV1(ABC):
            def __init__(self, config):
                self.config = config
            @abstractmethod
            def cc_store(self): ...
            @abstractmethod
            def lookup(self, block_ids): ...
            @abstractmethod
            def lookup_on_prefix(self, block_ids): ...
            @abstractmethod
            def lookup_on_reverse(self, block_ids): ...
            @abstractmethod
            def prefetch(self, block_ids): ...
            @abstractmethod
            def load(self, block_ids, shard_index, dst_tensor): ...
            @abstractmethod
            def dump(self, block_ids, shard_index, src_tensor): ...
            @abstractmethod
            def fetch_data(self, block_ids, shard_index, dst_addr): ...
            @abstractmethod
            def load_data(self, block_ids, shard_index, dst_addr): ...
            @abstractmethod
            def dump_data(self, block_ids, shard_index, src_addr, prerequisite_handle=0): ...
            @abstractmethod
            def wait(self, task): ...
            @abstractmethod
            def check(self, task): ...
            @abstractmethod
            def need_register_kv_caches(self): ...
            @abstractmethod
            def register_kv_caches(self, registrations): ...
        '''))
    code = textwrap.dedent('''
        import importlib, sys
        from ucm.store.ucmstore_v1 import Task, UcmKVStoreBaseV1
        module = importlib.import_module("ucmcache.ucm")     # as UCM's factory does
        cls = getattr(module, "UcmCacheStore")
        assert module.HAVE_UCM and issubclass(cls, UcmKVStoreBaseV1)
        assert issubclass(module.UcmCacheTask, Task)
        cfg = {"unique_id": sys.argv[1], "device_id": -1, "block_size": 4096}
        store = cls(cfg)
        assert store.config is cfg and store.lookup([b"x" * 16]) == [False]
        store.close()
        print("subclass ok")
        ''')
    env = dict(os.environ, PYTHONPATH=f"{tmp_path}{os.pathsep}{ROOT}")
    r = subprocess.run([sys.executable, "-c", code, "t-none-" + os.urandom(4).hex()], env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "subclass ok" in r.stdout, r.stdout + r.stderr


def test_bench_ucm_store_quick(tmp_path):
    r = subprocess.run([sys.executable, "-m", "bench.ucm_store", "--quick", "--out",
                        str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    import json
    out = json.loads((tmp_path / "ucm_store.json").read_text())
    for row in ("dump", "load_contiguous", "load_scattered", "memcpy_floor"):
        assert out["rows"][row]["gb_s"] > 0, row
    assert "GB/s" in (tmp_path / "ucm_store.md").read_text()


# ---------------------------------------------------------------- under UCM's connector

import logging  # noqa: E402
import re  # noqa: E402
import uuid as uuidlib  # noqa: E402

import ucmcache.ucm as U  # noqa: E402
import ucmcache.engines.ucm.config as UC  # noqa: E402
from ucmcache.engines import kit  # noqa: E402
import ucmcache.engines.ucm.memory as UM  # noqa: E402
import json  # noqa: E402


def _layers(seed, layers, n, m, size):
    """Layer l of blocks 0..n-1 as UCM's layerwise connector dumps it: shard l."""
    return [W.make_blocks("numpy", seed * 1000 + layer, n, m, size) for layer in range(layers)]


def test_layerwise_block_is_found_only_when_every_shard_is_stored(uuid, stores):
    """UCM's layerwise connector dumps layer l of a block as shard l, one dump call per layer:
    lookup and lookup_on_prefix report a block only once all block_size / shard_size shards
    are in.  Shards may come in any order, from any task."""
    layers, n, m, size = 4, 3, 2, 1024
    worker = stores(_cfg(uuid, m, size, shards=layers))
    scheduler = stores({"unique_id": uuid, "device_id": -1})  # UCM's scheduler: no sizes
    ids = W.block_ids(90, n)
    src = _layers(90, layers, n, m, size)
    for layer in (2, 0, 1):
        worker.wait(worker.dump(ids, [layer] * n, src[layer]))
        assert scheduler.lookup(ids) == [False] * n, layer
        assert scheduler.lookup_on_prefix(ids) == -1 and worker.lookup_on_reverse(ids) == -1
    worker.wait(worker.dump(ids[:2], [3, 3], src[3][:2]))   # block 2's last layer not yet
    assert scheduler.lookup(ids) == [True, True, False]
    assert scheduler.lookup_on_prefix(ids) == 1 and scheduler.lookup_on_prefix(ids[2:]) == -1
    worker.wait(worker.dump(ids[2:], [3], src[3][2:]))
    assert scheduler.lookup(ids) == [True] * n and scheduler.lookup_on_prefix(ids) == n - 1
    for layer in range(layers):
        dst = W.empty_like("numpy", src[layer])
        worker.wait(worker.load(ids, [layer] * n, dst))
        assert W.same("numpy", src[layer], dst), layer
    with pytest.raises(ValueError, match=r"shard index 4 is out of range: blocks here have 4 "
                                         r"shards \(block_size 8192 / shard_size 2048\)"):
        worker.dump(ids[:1], [4], src[0][:1])
    assert ucmcache.verify(uuid).ok


def test_engine_killed_between_two_layers_dumps_leaves_no_hit(uuid, stores, procs):
    """An engine SIGKILLed between two layers' dumps: its blocks are not found,
    in any process, so no request loads them; the next engine that computes the prefix dumps
    the missing layers (the stored ones are skipped) and then the blocks are found.  Layers of
    one block dumped by different processes (pipeline stages) complete it too."""
    layers, n, m, size = 4, 3, 2, 1024
    scheduler = stores({"unique_id": uuid, "device_id": -1})
    ids = W.block_ids(91, n)
    p, q = procs.start(W.dump_layers_then, uuid, 91, n, m, size, layers, [0, 1], "kill")
    done = procs.result(q)
    assert done["found"] == [False] * n                     # in the dumper itself, too
    p.join(BOUND)
    assert p.exitcode == -9
    assert scheduler.lookup(ids) == [False] * n and scheduler.lookup_on_prefix(ids) == -1
    # Another process dumps layer 2, this one layer 3: the block is complete only then.
    _, q = procs.start(W.dump_layers_then, uuid, 91, n, m, size, layers, [2], "exit")
    assert procs.result(q)["found"] == [False] * n
    worker = stores(_cfg(uuid, m, size, shards=layers))
    src = _layers(91, layers, n, m, size)
    worker.wait(worker.dump(ids, [3] * n, src[3]))
    # Whole blocks are found, and only those.  (Not necessarily all three: the core's CLOCK
    # may evict the dead worker's unused shards when this rank takes over its arenas.)
    whole = [all(worker.cache.exist([_shard_key(b, s, layers) for s in range(layers)]))
             for b in ids]
    assert scheduler.lookup(ids) == whole
    # The next engine that computes the prefix dumps every layer: the blocks are whole.
    for layer in range(layers):
        worker.wait(worker.dump(ids, [layer] * n, src[layer]))
    assert scheduler.lookup(ids) == [True] * n
    for layer in range(layers):
        dst = W.empty_like("numpy", src[layer])
        worker.wait(worker.load(ids, [layer] * n, dst))
        assert W.same("numpy", src[layer], dst), layer


def _shard_key(block_id, shard, shards):
    from ucmcache.engines.ucm.memory import _key
    return _key(block_id, shard, shards)


def test_a_missing_block_raises_a_ucm_error_that_is_a_runtime_error(uuid, stores):
    """Without UCM installed: a UcmError subclass, still a RuntimeError."""
    store = stores(_cfg(uuid, 2, 1024))
    ids = W.block_ids(92, 2)
    store.wait(store.dump(ids[:1], [0], W.make_blocks("numpy", 92, 1, 2, 1024)))
    with pytest.raises(U.UcmBlockNotFound) as e:
        store.wait(store.load(ids, [0, 0], W.make_blocks("numpy", 93, 2, 2, 1024)))
    assert isinstance(e.value, ucmcache.UcmError) and isinstance(e.value, RuntimeError)
    assert re.search(rf"load task \d+: 1 of 2 block\(s\) failed: block 1 \(id {ids[1].hex()}, "
                     r"shard 0\): missing", str(e.value))
    # A failure that is not a missing block is the general task error, not "not found".
    store._test_points["after_copy"] = lambda i: (_ for _ in ()).throw(OSError("lost"))
    with pytest.raises(U.UcmTaskFailed) as e:
        store.wait(store.dump(W.block_ids(94, 1), [0], W.make_blocks("numpy", 94, 1, 2, 1024)))
    assert not isinstance(e.value, U.UcmBlockNotFound) and isinstance(e.value, RuntimeError)


_FAKE_UCM = {
    # ucm/store/pipeline/errors.py of uc-manager 0.8.1, as it is (its RankConsistencyManager
    # imports StoreNotFoundError from there), and the V1 base classes the store subclasses.
    "ucm/__init__.py": "",
    "ucm/store/__init__.py": "",
    "ucm/store/pipeline/__init__.py": "",
    "ucm/store/pipeline/errors.py": "class StoreNotFoundError(RuntimeError):\n    pass\n\n\n"
                                    "class StoreUnhealthyError(RuntimeError):\n    pass\n",
    "ucm/store/ucmstore_v1.py": "class Task:\n    pass\n\n\nclass UcmKVStoreBaseV1:\n"
                                "    def __init__(self, config):\n        self.config = config\n",
}


def test_a_missing_block_raises_ucms_store_not_found_error_when_ucm_is_there(tmp_path):
    """With UCM importable, wait() on a load with a missing block raises (a subclass of)
    ucm.store.pipeline.errors.StoreNotFoundError: the only error RankConsistencyManager marks
    blocks missing for."""
    for path, text in _FAKE_UCM.items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(text)
    code = textwrap.dedent('''
        import sys
        import numpy as np
        from ucm.store.pipeline.errors import StoreNotFoundError
        import ucmcache
        from ucmcache import SlotCache
        from ucmcache.ucm import UcmCacheStore, UcmBlockNotFound
        assert issubclass(UcmBlockNotFound, StoreNotFoundError)
        store = UcmCacheStore({"unique_id": sys.argv[1], "device_id": 0, "shard_size": 1024,
                               "buffer_size": 1024 * 64})
        try:
            try:
                store.wait(store.load([b"m" * 16], [0], [[np.zeros(1024, np.uint8)]]))
            except StoreNotFoundError as e:
                assert isinstance(e, RuntimeError) and isinstance(e, ucmcache.UcmError)
                assert "missing" in str(e), e
                print("store not found ok")
        finally:
            store.close()
            SlotCache.unlink(sys.argv[1])
        ''')
    env = dict(os.environ, PYTHONPATH=f"{tmp_path}{os.pathsep}{ROOT}")
    seg = f"t-{os.getpid()}-{os.urandom(5).hex()}"
    r = subprocess.run([sys.executable, "-c", code, seg], env=env, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0 and "store not found ok" in r.stdout, r.stdout + r.stderr


class _FakeCudart:
    """libcudart's cudaEventSynchronize and cudaMemcpy as the store calls them through ctypes,
    on host memory: the event "completes" when the test releases it, cudaMemcpy is a memmove.
    Records the order of calls."""

    def __init__(self, code=0):
        import ctypes
        self.ctypes = ctypes
        self.calls = []
        self.code = code
        self.entered, self.release = threading.Event(), threading.Event()

    def cudaEventSynchronize(self, event):
        self.calls.append(("sync", event.value))
        self.entered.set()
        assert self.release.wait(BOUND), "the test never completed the event"
        return self.code

    def cudaMemcpy(self, dst, src, n, kind):
        self.calls.append(("copy", n.value))
        self.ctypes.memmove(dst.value, src.value, n.value)
        return 0


def test_dump_data_waits_for_its_prerequisite_event_before_copying(uuid, stores, monkeypatch):
    """UCM's connector passes its device event as prerequisite_handle.  The
    store's pool thread synchronizes it (cudaEventSynchronize, the CUDA path, here with
    libcudart replaced by a host fake) before the first byte is copied; a failed sync fails
    every block of the task, none stored.  The caller never blocks on it."""
    n, m, size = 3, 2, 1024
    store = stores(_cfg(uuid, m, size))
    fake = _FakeCudart()
    monkeypatch.setattr(UM, "_cudart", fake)
    store._cuda = True  # as on a CUDA machine: raw addresses go through cudaMemcpy
    src = np.random.default_rng(95).integers(0, 256, (n, m, size), dtype=np.uint8)
    ids = W.block_ids(95, n)
    addrs = [[src[i, j].ctypes.data for j in range(m)] for i in range(n)]
    task = store.dump_data(ids, [0] * n, addrs, prerequisite_handle=0x7f00dead0000)
    assert fake.entered.wait(BOUND)
    assert not store.check(task) and store.lookup(ids) == [False] * n
    assert fake.calls == [("sync", 0x7f00dead0000)]          # nothing copied before the event
    fake.release.set()
    store.wait(task)
    assert fake.calls[0] == ("sync", 0x7f00dead0000) and len(fake.calls) == 1 + n * m
    assert store.lookup(ids) == [True] * n
    # A sync that fails: the task fails naming the event and the CUDA error, nothing stored.
    bad = _FakeCudart(code=700)
    bad.release.set()
    monkeypatch.setattr(UM, "_cudart", bad)
    other = W.block_ids(96, n)
    with pytest.raises(U.UcmTaskFailed, match=r"3 of 3 block.*cudaEventSynchronize of "
                                              r"prerequisite_handle 0x7f00beef0000 failed "
                                              r"with CUDA error 700"):
        store.wait(store.dump_data(other, [0] * n, addrs, prerequisite_handle=0x7f00beef0000))
    assert bad.calls == [("sync", 0x7f00beef0000)] and store.lookup(other) == [False] * n
    store._cuda = False
    monkeypatch.setattr(UM, "_cudart", None)


def test_dump_data_with_a_handle_on_a_cpu_store_stores_the_blocks(uuid, stores):
    """On a store without CUDA, a non-zero prerequisite_handle (a CPU device that returns
    one) has no device work to wait for: the blocks are stored (refused before,
    so with the README's config no block was ever stored)."""
    n, m, size = 2, 2, 1024
    store = stores(_cfg(uuid, m, size))
    src = np.random.default_rng(97).integers(0, 256, (n, m, size), dtype=np.uint8)
    ids = W.block_ids(97, n)
    store.wait(store.dump_data(ids, [0] * n, [[src[i, j].ctypes.data for j in range(m)]
                                               for i in range(n)], prerequisite_handle=12345))
    dst = np.zeros_like(src)
    store.wait(store.load_data(ids, [0] * n, [[dst[i, j].ctypes.data for j in range(m)]
                                               for i in range(n)]))
    assert np.array_equal(src, dst)


def test_capacity_from_cache_buffer_capacity_gb_clamped_to_free_shm(uuid, stores,
                                                                    monkeypatch, caplog):
    """UCM sizes the buffer with cache_buffer_capacity_gb (GiB; 128 by default with
    share_buffer_enable); buffer_size (bytes) is read too and wins.  A size that /dev/shm
    cannot hold is clamped to half of what is free, with a log line naming the key; a
    /dev/shm too small for one slot per rank is an error naming the key and what is free."""
    slot, ranks = 4096, 4
    stride = slot  # a multiple of 64
    base = {"device_id": 0, "shard_size": slot, "block_size": slot, "ucmcache_max_ranks": ranks}
    small = stores(dict(base, unique_id=uuid + "-a", cache_buffer_capacity_gb=1 / 128))
    assert small.cache.capacity == (8 << 20) // stride      # 8 MiB of slots, not 1 GiB
    both = stores(dict(base, unique_id=uuid + "-b", cache_buffer_capacity_gb=1,
                       buffer_size=4 << 20))
    assert both.cache.capacity == (4 << 20) // stride
    monkeypatch.setattr(kit, "shm_free_bytes", lambda: 64 << 20)
    with caplog.at_level(logging.WARNING, logger="ucmcache.ucm"):
        big = stores(dict(base, unique_id=uuid + "-c", cache_buffer_capacity_gb=128))
    assert big.cache.capacity == (32 << 20) // stride       # half of the 64 MiB free
    msg = " ".join(r.getMessage() for r in caplog.records)
    assert re.search(r"cache_buffer_capacity_gb=128 asks for 137438953472 bytes of slots but "
                     r"/dev/shm has 67108864 bytes free: using 33554432", msg), msg
    monkeypatch.setattr(kit, "shm_free_bytes", lambda: 10000)
    with pytest.raises(ucmcache.SharedMemoryFull, match=r"cache_buffer_capacity_gb=128: /dev/shm "
                                                        r"has 10000 bytes free, too little"):
        UcmCacheStore(dict(base, unique_id=uuid + "-d", cache_buffer_capacity_gb=128))
    for s in (small, both, big):
        s.close()
    for suffix in "abcd":
        try:
            SlotCache.unlink(uuid + "-" + suffix)
        except ucmcache.SegmentNotFound:
            pass


def _ucm_worker_config(user, layout, n_tensors, tensor_bytes, shards):
    """The config UCM's vLLM connector gives a worker's store (_create_store): the user's
    ucm_connector_config plus a fresh unique_id (uuid4 hex, new at each engine start),
    tensor_layout, device_id, sizes, and per-process keys."""
    cfg = dict(user)
    cfg.setdefault("share_buffer_enable", False)
    if cfg["share_buffer_enable"] and cfg.get("cache_buffer_capacity_gb") is None:
        cfg["cache_buffer_capacity_gb"] = 128
    shard = n_tensors * tensor_bytes
    cfg.update({"unique_id": uuidlib.uuid4().hex, "tensor_layout": layout, "device_id": 0,
                "tensor_size_list": [tensor_bytes] * n_tensors, "shard_size": shard,
                "block_size": shard * shards, "local_rank_size": 1,
                "gpu_kv_buffer_addrs": [0x7f0000000000], "gpu_kv_buffer_sizes": [1 << 20],
                "posix_gc_enable": False})
    return cfg


def _ucm_scheduler_config(user, unique_id, layout):
    cfg = dict(user)
    cfg.setdefault("share_buffer_enable", False)
    if cfg["share_buffer_enable"] and cfg.get("cache_buffer_capacity_gb") is None:
        cfg["cache_buffer_capacity_gb"] = 128
    cfg.update({"unique_id": unique_id, "tensor_layout": layout, "posix_gc_enable": True})
    return cfg


@pytest.fixture
def default_segments():
    """Names of default segments a test makes: removed afterwards (they carry no run tag)."""
    names = []
    yield names
    for name in names:
        try:
            SlotCache.unlink(name)
        except ucmcache.SegmentNotFound:
            pass


def test_default_segment_is_stable_across_engine_starts(stores, default_segments):
    """UCM's unique_id is a fresh uuid4 at each engine start: without ucmcache_segment the
    segment is named from what is stable (the tensor layout UCM passes, the user), so a
    second engine start finds the first one's blocks and no segment is left per start.  The
    scheduler-side store (no sizes) names the same segment."""
    layout = f"gqa-{os.getpid()}-{os.urandom(3).hex()}"   # a layout name of this test alone
    user = {"share_buffer_enable": True, "cache_buffer_capacity_gb": 1 / 256}
    first = stores(_ucm_worker_config(user, layout, 2, 1024, 1))
    default_segments.append(first.segment)
    assert first.segment == UC.segment_name(f"ucm-{layout}-u{os.getuid()}")
    scheduler = stores(_ucm_scheduler_config(user, first.config["unique_id"], layout))
    ids = W.block_ids(98, 2)
    first.wait(first.dump(ids, [0, 0], W.make_blocks("numpy", 98, 2, 2, 1024)))
    first.close()                                            # the engine stops
    second = stores(_ucm_worker_config(user, layout, 2, 1024, 1))   # and starts again
    assert second.segment == first.segment and second.config["unique_id"] != \
        first.config["unique_id"]
    assert second.lookup(ids) == [True, True] and scheduler.lookup(ids) == [True, True]
    # An engine whose shards differ in size cannot share it: told so at start.
    with pytest.raises(ucmcache.IncompatibleSegment, match=r"holds slots of 2048 bytes, this "
                                                          r"store's shard_size is 4096.*"
                                                          r"ucmcache_segment"):
        UcmCacheStore(_ucm_worker_config(user, layout, 2, 2048, 1))
    # ucmcache_segment still names it whatever the layout.
    named = stores(dict(_ucm_worker_config(user, layout, 2, 2048, 1),
                        ucmcache_segment=second.segment + "-own"))
    default_segments.append(named.segment)
    assert named.segment == second.segment + "-own"


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_rank_is_freed_when_the_process_exits_without_closing_the_store(uuid, stores, method):
    """UCM's connector never closes its store: a process that exits with it open frees its
    rank, so the segment shows no dead rank and verify is clean without anyone attaching to
    recover it.  Both start methods: a forked multiprocessing child (vLLM's
    default for its workers) ends with os._exit, where atexit never runs."""
    n, m, size = 2, 2, 1024
    ctx = mp.get_context(method)
    q = ctx.Queue()
    p = ctx.Process(target=W.dump_layers_then, args=(q, uuid, 99, n, m, size, 1, [0], "exit"),
                    daemon=True)
    p.start()
    try:
        status, value = q.get(timeout=60)
        assert status == "ok", value
        assert value["found"] == [True] * n
        p.join(BOUND)
        assert p.exitcode == 0
    finally:
        if p.is_alive():
            p.kill()
            p.join(BOUND)
    report = ucmcache.verify(uuid)                            # attaches read-only, no rank
    assert report.ok, report.problems
    scheduler = stores({"unique_id": uuid, "device_id": -1})
    assert scheduler.lookup(W.block_ids(99, n)) == [True] * n  # its blocks outlive it


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


def _readme_ucm_config():
    """The ucm_connectors entry of the README's UCM section, read from the README itself.
    A YAML subset: `key: value  # comment` lines whose values are JSON scalars; anything else
    fails this test (keep the README's block that simple, or parse it another way)."""
    text = open(os.path.join(ROOT, "README.md")).read()
    section = text.split("## Under UCM's vLLM and SGLang connectors", 1)[1]
    block = re.search(r"```yaml\n(.*?)```", section, re.S).group(1)
    entry: dict = {}
    config: dict = {}
    target = entry
    for line in block.splitlines():
        body = line.split(" #", 1)[0].rstrip() if not line.lstrip().startswith("#") else ""
        if not body.strip() or body.strip() == "ucm_connectors:":
            continue
        key, sep, value = body.strip().lstrip("- ").partition(":")
        assert sep, f"README UCM config line not understood: {line!r}"
        if key == "ucm_connector_config" and not value.strip():
            target = config
            continue
        target[key] = json.loads(value.strip())
    entry["ucm_connector_config"] = config
    return entry


def test_readme_ucm_config_starts_as_written(stores, default_segments, monkeypatch):
    """The README's UCM config, as UCM's vLLM connector turns it into store configs (worker
    and scheduler), builds working stores, also on a machine whose /dev/shm is smaller than
    the capacity asked for (here 64 MiB free)."""
    entry = _readme_ucm_config()
    module = __import__(entry["ucm_connector_module_path"], fromlist=["x"])
    cls = getattr(module, entry["ucm_connector_name"])     # as UCM's factory finds it
    assert cls is UcmCacheStore
    user = entry["ucm_connector_config"]
    assert user["share_buffer_enable"] is True and "cache_buffer_capacity_gb" in user
    monkeypatch.setattr(kit, "shm_free_bytes", lambda: 64 << 20)
    layout = f"gqa-{os.getpid()}-{os.urandom(3).hex()}"
    layers, m, size = 4, 2, 2048
    worker = stores(_ucm_worker_config(user, layout, m, size, layers))
    default_segments.append(worker.segment)
    scheduler = stores(_ucm_scheduler_config(user, worker.config["unique_id"], layout))
    ids = W.block_ids(102, 2)
    src = _layers(102, layers, 2, m, size)
    for layer in range(layers):
        worker.wait(worker.dump_data(ids, [layer] * 2, [[src[layer][i][j].ctypes.data
                                                         for j in range(m)] for i in range(2)],
                                     prerequisite_handle=1))
    assert scheduler.lookup(ids) == [True, True] and scheduler.lookup_on_prefix(ids) == 1
