"""UcmCacheStore (ucmcache.ucm): UCM's V1 KV store interface over a shared segment (issue 16).

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
    with pytest.raises(ValueError, match=r"unique_id \(or engine_id\)"):
        UcmCacheStore({"shard_size": 4096, "device_id": 0})
    with pytest.raises(ValueError, match=r"unique_id \(or engine_id\) and shard_size \(or "
                                         r"block_size\)"):
        UcmCacheStore({"device_id": 0})
    with pytest.raises(ValueError, match=r"shard_size \(or block_size\)"):
        UcmCacheStore({"unique_id": uuid})
    with pytest.raises(ValueError, match="'shard_size' must be an int"):
        UcmCacheStore({"unique_id": uuid, "shard_size": "big"})
    with pytest.raises(ValueError, match="buffer_size=1000 holds no slot"):
        UcmCacheStore({"unique_id": uuid, "shard_size": 4096, "buffer_size": 1000,
                       "device_id": 0})
    # engine_id names the segment when unique_id is absent; block_size sizes the slots;
    # keys for other stores (store_pipeline, storage_backends...) are ignored.
    with UcmCacheStore({"engine_id": uuid, "block_size": 2048, "device_id": 0,
                        "buffer_size": 2048 * 8 * 16, "store_pipeline": "Cache|Posix",
                        "storage_backends": ["/x"], "posix_gc_enable": True}) as s:
        assert s.segment == uuid
        assert s.cache.slot_size == 2048 and s.cache.max_ranks == 8
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
    with pytest.raises(ValueError, match="prerequisite_handle"):
        store.dump_data(ids, [0] * n, addrs, prerequisite_handle=7)
    with pytest.raises(ValueError, match="3 address"):
        store.load_data(ids, [0] * n, [row[:3] for row in addrs])


# ---------------------------------------------------------------- shards, missing blocks

@pytest.mark.parametrize("kind", KINDS)
def test_shards_per_layer(uuid, stores, kind):
    """Layer-wise dumps: block i's layer l is shard l, one slot each, keyed (id, l)."""
    layers, n, size = 6, 4, 2048
    store = stores(_cfg(uuid, 2, size))             # a shard: K and V of one layer
    ids = W.block_ids(4, n)
    per_layer = [W.make_blocks(kind, 100 + layer, n, 2, size) for layer in range(layers)]
    for layer in range(layers):
        store.wait(store.dump(ids, [layer] * n, per_layer[layer]))
    assert store.lookup(ids) == [True] * n          # lookup looks at shard 0
    assert store.cache.entry_count() == layers * n  # one slot per (block, shard)
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
    before = set(os.listdir("/dev/shm"))
    a = stores(_cfg(uuid, share_buffer_enable=False))
    assert a.cache.max_ranks == 1 and a.cache.capacity == 4 * 64  # the whole buffer_size
    b = stores(_cfg(uuid, share_buffer_enable="false"))
    assert set(os.listdir("/dev/shm")) == before        # private: no name left behind
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
