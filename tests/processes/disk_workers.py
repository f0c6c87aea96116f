"""Worker functions for the disk-tier tests: spawned processes attached to one segment, each
with its own DiskTier on the test's directory.  They report through a queue (workers.run) and
count how often their own loader ran; gates and named points order the steps, nothing sleeps.
"""
import os
import resource
import signal

from ucmcache import DiskTier, SlotCache
from ucmcache.core import hooks as _hooks
from ucmcache.core.hooks import Gate

from workers import check_payload, payload_for, run

SIZE = 200  # payload bytes (slot_size is 256 in these tests)


# A generous read timeout: on a loaded machine a 1 s disk read can run out and turn a disk hit
# into a load, which these workers' callers count (runs 1 instead of 0: seen once in 20 runs).
READ_TIMEOUT = 30.0

def _load_all(uuid, path, capacity, keys, size=SIZE):
    """get_or_load every key, then flush the disk writes; (loader runs, all bytes right)."""
    tier = DiskTier(path, capacity, timeout=READ_TIMEOUT)
    c = SlotCache.attach(uuid, tier2=tier)
    runs = []
    try:
        ok = True
        for k in keys:
            v = c.get_or_load(k, lambda k=k: (runs.append(k), payload_for(k, size))[1],
                              timeout=30)
            ok = ok and check_payload(k, bytes(v))
        flushed = tier.flush(30)
        return {"runs": len(runs), "ok": ok, "flushed": flushed}
    finally:
        c.close()


def load_all(q, *args):
    run(_load_all, q, *args)


def load_then_park(q, uuid, path, capacity, keys, park_path):
    """Load keys and flush, report, then stay attached at a gate until killed."""
    tier = DiskTier(path, capacity, timeout=READ_TIMEOUT)
    c = SlotCache.attach(uuid, tier2=tier)
    runs = []
    ok = True
    for k in keys:
        v = c.get_or_load(k, lambda k=k: (runs.append(k), payload_for(k, SIZE))[1], timeout=30)
        ok = ok and check_payload(k, bytes(v))
    q.put(("ok", {"runs": len(runs), "ok": ok, "flushed": tier.flush(30)}))
    g = Gate(park_path, timeout=60)
    g.wait_value(1)  # the test kills us long before this gate opens


def die_mid_write(q, uuid, path, capacity, key):
    """Load key; the disk writer is killed (SIGKILL) with half the block in its temp file."""
    tier = DiskTier(path, capacity, timeout=READ_TIMEOUT)
    c = SlotCache.attach(uuid, tier2=tier)
    _hooks.arm_python("disk_mid_write", "kill")
    c.get_or_load(key, lambda: payload_for(key, SIZE), timeout=30)
    tier.flush(30)  # the writer thread kills the process meanwhile: the test sees -SIGKILL


def _get_at_point(uuid, path, capacity, key, point, gate_path):
    """get(key) once, held at a named point by a gate; load it if we own it."""
    tier = DiskTier(path, capacity, timeout=READ_TIMEOUT)
    c = SlotCache.attach(uuid, tier2=tier)
    gate = Gate(gate_path)
    runs = 0
    try:
        if point in _hooks.PY_POINTS:
            _hooks.arm_python(point, "gate", gate)
        else:
            c._arm(point, "gate", gate)
        with c.get(key, timeout=30) as h:
            if h.owner:
                runs += 1
                h.data[:SIZE] = payload_for(key, SIZE)
                h.ready(SIZE)
            else:
                h.wait(30)
            data = bytes(h.data)
        return {"runs": runs, "ok": check_payload(key, data)}
    finally:
        if point in _hooks.PY_POINTS:
            _hooks.arm_python(point, "none")
        gate.close()
        c.close()


def get_at_point(q, *args):
    run(_get_at_point, q, *args)


def _full_disk(uuid, path, capacity, keys, fsize_limit):
    """Load keys[0] (written), then lower RLIMIT_FSIZE below one block file: every later
    write fails with EFBIG from the kernel, as on a full disk.  Gets go on."""
    tier = DiskTier(path, capacity, breaker_failures=2, breaker_reset=3600.0)
    c = SlotCache.attach(uuid, tier2=tier)
    runs = []
    try:
        def load(k):
            v = c.get_or_load(k, lambda: (runs.append(k), payload_for(k, SIZE))[1], timeout=30)
            return check_payload(k, bytes(v))
        ok = load(keys[0])
        tier.flush(30)
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of a fatal signal
        resource.setrlimit(resource.RLIMIT_FSIZE, (fsize_limit, resource.RLIM_INFINITY))
        states = []
        for k in keys[1:]:
            ok = load(k) and ok
            tier.flush(30)
            states.append(tier.write_state)
        left = os.listdir(tier._tmp)
        return {"runs": len(runs), "ok": ok, "states": states, "tmp_left": left}
    finally:
        c.close()


def full_disk(q, *args):
    run(_full_disk, q, *args)
