"""Workers for tests/core/test_arena_room.py: ranks that load and hold keys on command.

A command server reads (op, arg) from its command queue and answers each on its reply queue,
so the test orders every step of every process (one at a time: nothing is in flight in any
process while the test reads the segment's counters between two steps).
"""
import os

from ucmcache import SlotCache

from workers import check_payload, payload_for, run


def _serve(uuid, commands, replies):
    """Attach, then run commands until ("stop", None): ("load", key) get_or_load; ("hold", key)
    get it and keep the handle open (filled first if ours to load); ("release", key) close
    that handle; ("restart", None) release every handle, close, attach again (any free rank).
    Each answer: ("ok", (rank, value checked)) or ("error", message)."""
    c = SlotCache.attach(uuid)
    held = {}
    try:
        while True:
            op, arg = commands.get(timeout=120)
            try:
                ok = True
                if op == "stop":
                    replies.put(("ok", (c.rank, True)))
                    return
                if op == "load":
                    ok = check_payload(arg, c.get_or_load(arg, lambda: payload_for(arg, 64)))
                elif op == "hold":
                    h = c.get(arg, timeout=30)
                    if h.owner:
                        p = payload_for(arg, 64)
                        h.data[:len(p)] = p
                        h.ready(len(p))
                    ok = check_payload(arg, bytes(h.data))
                    held[arg] = h
                elif op == "release":
                    held.pop(arg).close()
                elif op == "restart":
                    for h in held.values():
                        h.close()
                    held.clear()
                    c.close()
                    c = SlotCache.attach(uuid)
                else:
                    raise ValueError(f"unknown command {op!r}")
                replies.put(("ok", (c.rank, ok)))
            except Exception as e:  # reported, and the server goes on for the test to stop
                replies.put(("error", f"{type(e).__name__}: {e}"))
    finally:
        for h in held.values():
            h.close()
        c.close()


def serve(q, *args):
    run(_serve, q, *args)


def _single_flight_rotated(uuid, keys, first, start_path):
    """get_or_load every key, starting at keys[first] (each process first on its own share of
    the keys); the loader's runs counted.  Returns (runs, every value its key's)."""
    from ucmcache.lowlevel import Gate
    c = SlotCache.attach(uuid)
    start = Gate(start_path)
    runs = []
    ok = True
    try:
        start.wait_value(1)
        for k in keys[first:] + keys[:first]:
            def loader(k=k):
                runs.append(k)
                return payload_for(k, 4096)
            ok = check_payload(k, c.get_or_load(k, loader, timeout=60)) and ok
        return len(runs), ok, os.getpid()
    finally:
        start.close()
        c.close()


def single_flight_rotated(q, *args):
    run(_single_flight_rotated, q, *args)

