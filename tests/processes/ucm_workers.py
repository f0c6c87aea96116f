"""Spawned processes for tests/engines/test_ucm_store_*.py: UCM-style worker stores that dump and load.

Each worker rebuilds its blocks from a seed (make_blocks), so a loader compares against the same
bytes the dumper wrote without any data crossing the queue.  Events order the steps, never
sleep; every wait is bounded.
"""
import hashlib
import os
import signal
import traceback

import numpy as np

WAIT = 60.0  # the longest a worker waits for the test to release it


def block_ids(seed, n):
    """UCM-style block ids (md5 digests, as UCM's RequestHasher makes them)."""
    return [hashlib.md5(f"ucm-test-{seed}-{i}".encode()).digest() for i in range(n)]


def make_blocks(kind, seed, n_blocks, n_tensors, tensor_bytes):
    """n_blocks rows of n_tensors tensors of tensor_bytes each, the same for the same seed:
    bf16 torch tensors (kind "torch") or uint8 numpy arrays (kind "numpy")."""
    if kind == "torch":
        import torch
        g = torch.Generator().manual_seed(seed)
        return [[torch.rand(tensor_bytes // 2, generator=g).to(torch.bfloat16)
                 for _ in range(n_tensors)] for _ in range(n_blocks)]
    rng = np.random.default_rng(seed)
    return [[rng.integers(0, 256, tensor_bytes, dtype=np.uint8) for _ in range(n_tensors)]
            for _ in range(n_blocks)]


def empty_like(kind, blocks):
    if kind == "torch":
        import torch
        return [[torch.zeros_like(t) for t in row] for row in blocks]
    return [[np.zeros_like(t) for t in row] for row in blocks]


def same(kind, a, b):
    if kind == "torch":
        import torch
        return all(torch.equal(x, y) for ra, rb in zip(a, b) for x, y in zip(ra, rb))
    return all(np.array_equal(x, y) for ra, rb in zip(a, b) for x, y in zip(ra, rb))


def store_config(uuid, n_tensors, tensor_bytes, shards=1, **extra):
    """A worker store's config as UCM's connectors pass it (tensor sizes, shard and block size,
    buffer size, sharing, device id), plus keys for other stores that must be ignored.
    ``shards`` > 1: UCM's layerwise layout, one shard per layer (block_size = shards x
    shard_size)."""
    shard = n_tensors * tensor_bytes
    cfg = {"unique_id": uuid, "device_id": 0, "tensor_size": tensor_bytes,
           "tensor_size_list": [tensor_bytes] * n_tensors, "shard_size": shard,
           "block_size": shard * shards, "buffer_size": shard * 64 * 4,
           "share_buffer_enable": True,
           "local_rank_size": 1, "ucmcache_max_ranks": 4, "transfer_timeout_ms": 20000,
           "store_pipeline": "Cache|Posix", "storage_backends": ["/nonexistent"],
           "waiting_queue_depth": 16}
    cfg.update(extra)
    return cfg


def _report(q, fn, *args):
    try:
        q.put(("ok", fn(*args)))
    except BaseException as e:  # report, never leave the parent waiting
        q.put(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


def _dump(kind, uuid, seed, n_blocks, n_tensors, tensor_bytes):
    from ucmcache.ucm import UcmCacheStore
    with UcmCacheStore(store_config(uuid, n_tensors, tensor_bytes)) as store:
        blocks = make_blocks(kind, seed, n_blocks, n_tensors, tensor_bytes)
        ids = block_ids(seed, n_blocks)
        store.wait(store.dump(ids, [0] * n_blocks, blocks))
        return {"pid": os.getpid(), "rank": store.cache.rank,
                "found": store.lookup(ids), "loads": store.cache.stats()["loads_started"]}


def dump(q, *args):
    """Dump a seed's blocks and report."""
    _report(q, _dump, *args)


def _load(kind, uuid, seed, n_blocks, n_tensors, tensor_bytes):
    from ucmcache.ucm import UcmCacheStore
    with UcmCacheStore(store_config(uuid, n_tensors, tensor_bytes)) as store:
        want = make_blocks(kind, seed, n_blocks, n_tensors, tensor_bytes)
        got = empty_like(kind, want)
        ids = block_ids(seed, n_blocks)
        found = store.lookup(ids)
        store.wait(store.load(ids, [0] * n_blocks, got))
        return {"pid": os.getpid(), "found": found, "equal": same(kind, want, got)}


def load(q, *args):
    """Load a seed's blocks, compare them with what the seed makes, and report."""
    _report(q, _load, *args)


def dump_then_stop(q, kind, uuid, seed, n_blocks, n_tensors, tensor_bytes, point, at_block,
                   action, arrived, release):
    """Dump a seed's blocks with the store's test point `point` armed on block `at_block`:
    action "gate" sets `arrived` and waits for `release` (the test SIGKILLs us meanwhile);
    "kill" SIGKILLs this process there.  Reports only if it ever gets past."""
    from ucmcache.ucm import UcmCacheStore
    try:
        store = UcmCacheStore(store_config(uuid, n_tensors, tensor_bytes))

        def hit(i):
            if i != at_block:
                return
            if action == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            arrived.set()
            if not release.wait(WAIT):
                raise TimeoutError("the test never released the gate")

        store._test_points[point] = hit
        blocks = make_blocks(kind, seed, n_blocks, n_tensors, tensor_bytes)
        task = store.dump(block_ids(seed, n_blocks), [0] * n_blocks, blocks)
        store.wait(task)
        store.close()
        q.put(("ok", "finished"))
    except BaseException as e:
        q.put(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


def dump_layers_then(q, uuid, seed, n_blocks, n_tensors, tensor_bytes, shards, layers, action):
    """Dump layers ``layers`` of a seed's blocks (layer l = shard l, one dump call each, as
    UCM's layerwise connector does), report, then end as ``action`` says: "kill" SIGKILLs this
    process (an engine killed between two layers' dumps); "exit" returns with the store still
    open, never closed (UCM's connector never closes its store), so the process exits
    normally with it attached."""
    from ucmcache.ucm import UcmCacheStore
    try:
        store = UcmCacheStore(store_config(uuid, n_tensors, tensor_bytes, shards))
        _KEPT.append(store)  # alive until the interpreter exits: never collected before
        ids = block_ids(seed, n_blocks)
        for layer in layers:
            blocks = make_blocks("numpy", seed * 1000 + layer, n_blocks, n_tensors,
                                 tensor_bytes)
            store.wait(store.dump(ids, [layer] * n_blocks, blocks))
        q.put(("ok", {"pid": os.getpid(), "rank": store.cache.rank,
                      "found": store.lookup(ids)}))
    except BaseException as e:
        q.put(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
        return
    if action == "kill":
        q.close()
        q.join_thread()  # the report is written to the pipe before the kill, not lost with it
        os.kill(os.getpid(), signal.SIGKILL)


_KEPT: list = []
