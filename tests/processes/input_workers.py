"""Workers for tests/core/test_input_checks.py (importable by module name in spawned children)."""
import os

from ucmcache import SlotCache
from ucmcache.core import hooks as _hooks
from ucmcache.lowlevel import Gate
from ucmcache.lowlevel import shm_path

from workers import run


def _create_stalled_after_shm_open(uuid, gate_path, key, params):
    """create(exist_ok=True), held at the gate between shm_open and the creator lock.

    Returns (same_file, hit, value): whether the name names the file we attached, whether key
    was already there, and key's value through get_or_load (ours only if it was not)."""
    gate = Gate(gate_path)
    try:
        _hooks.arm_python("after_shm_open", "gate", gate)
        c = SlotCache.create(uuid, exist_ok=True, **params)
        try:
            same_file = os.stat(shm_path(uuid)).st_ino == os.fstat(c._seg.fd).st_ino
            hit = c.exist([key])[0]
            value = c.get_or_load(key, lambda: b"from the stalled creator", timeout=10)
            return same_file, hit, value
        finally:
            c.close()
    finally:
        _hooks.arm_python("after_shm_open", "none")
        gate.close()


def create_stalled_after_shm_open(q, *args):
    run(_create_stalled_after_shm_open, q, *args)
