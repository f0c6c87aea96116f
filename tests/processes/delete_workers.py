"""Workers for tests/core/test_delete.py (spawned processes: plain arguments, a result queue)."""
import os

from ucmcache import SlotCache
from ucmcache.lowlevel import Gate

from workers import check_payload, run


def _hold_and_check(uuid, key, held_path, check_path):
    """Pin key, keep a view and a derived view; say so on `held`, wait for `check`, then say
    whether every view still shows key's bytes.  Returns (slot, ok, rank)."""
    c = SlotCache.attach(uuid)
    held, check = Gate(held_path), Gate(check_path)
    try:
        with c.get(key) as h:
            assert h.state == "ready"
            view = h.data
            first = bytes(view)
            tail = view[16:]
            slot = h.slot
            held.release()
            check.wait_value(1, timeout=60)
            ok = bytes(view) == first and bytes(tail) == first[16:] and check_payload(key, first)
        del view, tail
        return slot, ok, c.rank
    finally:
        held.close()
        check.close()
        c.close()


def hold_and_check(q, *args):
    run(_hold_and_check, q, *args)


def _delete_at(uuid, key, point, action, gate_path):
    """Arm `point` (gate or kill) and delete key; returns (result, rank) if it survives."""
    c = SlotCache.attach(uuid)
    gate = Gate(gate_path) if gate_path else None
    try:
        c._arm(point, action, gate)
        return c.delete(key), c.rank
    finally:
        if gate:
            gate.close()
        c.close()


def delete_at(q, *args):
    run(_delete_at, q, *args)


def _pin_then_wait(uuid, key, gate_path):
    """Pin key, say so, then block until SIGKILLed (bounded)."""
    c = SlotCache.attach(uuid)
    gate = Gate(gate_path)
    h = c.get(key)
    gate.release()
    gate.wait_value(10 ** 9, timeout=120)
    h.close()
    c.close()


def pin_then_wait(q, *args):
    run(_pin_then_wait, q, *args)


def _load_keys(uuid, keys, value_of, gate_path):
    """Load keys as this process's rank (so it owns their arenas), say so, wait to be told to
    go, then load one more key (the arenas a deleter gave back come back)."""
    c = SlotCache.attach(uuid)
    gate = Gate(gate_path)
    try:
        for k in keys:
            c.get_or_load(k, lambda k=k: value_of + k)
        gate.release()
        gate.wait_value(2, timeout=60)
        extra = b"E" * 16
        c.get_or_load(extra, lambda: b"extra")
        return c.rank, c.arenas()
    finally:
        gate.close()
        c.close()


def load_keys(q, *args):
    run(_load_keys, q, *args)


def _delete_all(uuid, keys, start_path):
    """Wait for the start, delete every key (others delete the same ones meanwhile)."""
    c = SlotCache.attach(uuid)
    start = Gate(start_path)
    try:
        start.wait_value(1, timeout=60)
        return [c.delete(k, timeout=30) for k in keys], os.getpid()
    finally:
        start.close()
        c.close()


def delete_all(q, *args):
    run(_delete_all, q, *args)


def _load_then_hold_a_load(uuid, ready_key, loading_key, gate_path):
    """Load ready_key, then own loading_key's load and hold it (Loading) until the gate's second
    release; returns the two slots."""
    c = SlotCache.attach(uuid)
    gate = Gate(gate_path)
    try:
        c.get_or_load(ready_key, lambda: b"ready")
        with c.get(ready_key) as h:
            ready_slot = h.slot
        with c.get(loading_key) as h:
            assert h.owner
            loading_slot = h.slot
            gate.release()
            gate.wait_value(2, timeout=60)
            h.data[:4] = b"late"
            h.ready(4)
        return ready_slot, loading_slot
    finally:
        gate.close()
        c.close()


def load_then_hold_a_load(q, *args):
    run(_load_then_hold_a_load, q, *args)


def _load_then_delete_at(uuid, keys, victim, point):
    """Load keys (this rank owns their arena), then delete victim with `point` armed to kill."""
    c = SlotCache.attach(uuid)
    for k in keys:
        c.get_or_load(k, lambda k=k: b"v" + k)
    c._arm(point, "kill", None)
    c.delete(victim)


def load_then_delete_at(q, *args):
    run(_load_then_delete_at, q, *args)


def _load_then_delete_held_then_killed(uuid, keys, victim, gate_path):
    """Load keys (this rank owns their arena), then delete victim: held at delete_usable (its
    arena checked ours, nothing marked) until the gate's release, then killed at its mark."""
    c = SlotCache.attach(uuid)
    for k in keys:
        c.get_or_load(k, lambda k=k: b"v" * 40)
    c._arm("delete_usable", "gate", Gate(gate_path))
    c._arm("delete_marked", "kill", None)
    c.delete(victim)


def load_then_delete_held_then_killed(q, *args):
    run(_load_then_delete_held_then_killed, q, *args)
