"""Workers for tests/cli/: spawned processes that hold a segment in a known state.

``hold`` attaches, puts one slot per requested kind into that state, reports what it did through
a queue, sets ``ready`` and then waits (bounded) for ``release`` before closing cleanly.  A test
either sets ``release`` or SIGKILLs the worker while it holds everything.  Events order the
steps; nothing sleeps.
"""
import os
import traceback

from ucmcache import SlotCache

KINDS = ("ready", "pinned", "loading", "failed")


def key_for(kind: str) -> bytes:
    return (kind.encode() * 16)[:16]


def hold(uuid, kinds, info_q, ready, release, timeout):
    cache = None
    held = []
    try:
        cache = SlotCache.attach(uuid)
        slots = {}
        for kind in kinds:
            if kind not in KINDS:
                raise ValueError(f"unknown kind {kind!r}")
            h = cache.get(key_for(kind))
            if not h.owner:
                raise AssertionError(f"{kind}: expected to own a cold key")
            slots[kind] = h.slot
            if kind in ("ready", "pinned"):
                payload = f"value of {kind}".encode()
                h.data[:len(payload)] = payload
                h.ready(len(payload))
            elif kind == "failed":
                h.fail("failed on purpose")
            if kind in ("pinned", "loading"):
                held.append(h)          # stays pinned (and, for loading, owned and unpublished)
            else:
                h.close()
        info_q.put(("ok", {"rank": cache.rank, "pid": os.getpid(), "slots": slots}))
    except BaseException as e:  # report, never leave the parent waiting
        info_q.put(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
        ready.set()
        raise
    ready.set()
    release.wait(timeout)
    for h in held:
        if h.owner and h.state == "loading":
            h.fail("worker released")
        h.close()
    cache.close()
