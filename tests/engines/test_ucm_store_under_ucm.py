"""UcmCacheStore (ucmcache.ucm) under UCM's connectors: layerwise blocks, UCM's errors,
device events, sizes, default segments and the documented config (docs/engines/ucm.md).

The end-to-end shape is the one UCM tests its own stores with (ucm/store/test/e2e): a
scheduler-side store (device_id -1) and a worker store on one segment, lookup -> dump -> wait ->
lookup -> load -> wait -> compare, bf16 tensors, many layers per block.  Torch tests use real
CPU tensors (torch==2.13.0 is a test dependency) and skip, saying so, where torch is missing;
every behaviour is also tested with numpy arrays.  Threads and processes are ordered with
events, never sleeps; every wait is bounded; segments are the fixture's uuid (always removed).
"""
import json
import logging
import os
import re
import subprocess
import sys
import textwrap
import threading
import uuid as uuidlib

import numpy as np
import pytest

import ucmcache
import ucmcache.engines.ucm.config as UC
import ucmcache.engines.ucm.memory as UM
import ucmcache.ucm as U
from ucmcache import SlotCache
from ucmcache.engines import kit
from ucmcache.ucm import UcmCacheStore

import ucm_workers as W
from ucm_store_fixtures import BOUND, ROOT, _cfg, default_segments, stores  # noqa: F401




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
    so with the documented config no block was ever stored)."""
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




def _readme_ucm_config():
    """The ucm_connectors entry of the UCM page (docs/engines/ucm.md: its first yaml block),
    read from the page itself.
    A YAML subset: `key: value  # comment` lines whose values are JSON scalars; anything else
    fails this test (keep the page's block that simple, or parse it another way)."""
    text = open(os.path.join(ROOT, "docs", "engines", "ucm.md")).read()
    block = re.search(r"```yaml\n(.*?)```", text, re.S).group(1)
    entry: dict = {}
    config: dict = {}
    target = entry
    for line in block.splitlines():
        body = line.split(" #", 1)[0].rstrip() if not line.lstrip().startswith("#") else ""
        if not body.strip() or body.strip() == "ucm_connectors:":
            continue
        key, sep, value = body.strip().lstrip("- ").partition(":")
        assert sep, f"docs/engines/ucm.md config line not understood: {line!r}"
        if key == "ucm_connector_config" and not value.strip():
            target = config
            continue
        target[key] = json.loads(value.strip())
    entry["ucm_connector_config"] = config
    return entry


def test_readme_ucm_config_starts_as_written(stores, default_segments, monkeypatch):
    """The UCM page's config (docs/engines/ucm.md), as UCM's vLLM connector turns it into store configs (worker
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
