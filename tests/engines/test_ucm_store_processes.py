"""UcmCacheStore (ucmcache.ucm): worker processes, roles, sharing and a store's lifecycle.

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

import numpy as np
import pytest

import ucmcache
from ucmcache import SlotCache
from ucmcache.ucm import UcmCacheStore

import ucm_workers as W
from ucm_store_fixtures import BOUND, KINDS, ROOT, SPAWN, _cfg, _gate, stores  # noqa: F401


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

