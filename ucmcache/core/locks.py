"""Locks: the striped robust bucket locks, as the Python layer sees them.

Bucket b is guarded by stripe ``b & (n_stripes - 1)`` (``ucm_stripe_of``).  The slot protocol
and recovery take stripes inside their C steps only (``ucm_get_slow``, ``ucm_recover_rank``:
one stripe with a deadline, any other by trylock, so no lock-order cycles and no stripe held
across Python code, where an exception or a signal could leave it held by a live thread).  A
stripe whose holder died comes back as EOWNERDEAD and is repaired inside the same C call that
took it (``lock_stripe_repairing``): its chains are rebuilt before the mutex is marked
consistent, so it never becomes ENOTRECOVERABLE.

What stays here: naming who holds a stripe, for the error a deadline raises and for verify, and
a lock/unlock pair for tests and tools that need to hold one on purpose.
"""
from __future__ import annotations

from typing import Dict, Optional

from .._core import ffi, lib
from .errors import CorruptSegment
from .results import code_name


def stripe_holder(seg, stripe: int) -> Dict[str, object]:
    """Who holds a stripe now, read from its robust mutex's lock word (the owner's thread id):
    {tid, pid, rank, state}; state is 'free', 'running', 'stopped' (SIGSTOP, a debugger),
    'gone' (no such thread: a forged or stale word) or the /proc state letter."""
    tid = lib.ucm_mutex_holder(seg.base, seg.layout.stripe(stripe))
    out: Dict[str, object] = {"tid": tid, "pid": None, "rank": None, "state": "free"}
    if tid == 0:
        return out
    try:
        with open(f"/proc/{tid}/status") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
    except OSError:
        out["state"] = "gone"
        return out
    pid = int(fields.get("Tgid", "0").strip() or 0)
    letter = fields.get("State", "?").strip()[:1]
    out["pid"] = pid
    out["state"] = {"T": "stopped", "t": "stopped", "R": "running", "S": "running",
                    "D": "running", "Z": "gone", "X": "gone"}.get(letter, letter)
    L = seg.layout
    for r in range(L.max_ranks):
        if lib.ucm_load32(seg.base, L.rank(r) + lib.UCM_R_STATE) != lib.UCM_RANK_FREE and \
                lib.ucm_load32(seg.base, L.rank(r) + lib.UCM_R_PID) == pid:
            out["rank"] = r
            break
    return out


def describe_stripe_holder(seg, stripe: int) -> str:
    h = stripe_holder(seg, stripe)
    if h["state"] == "free":
        return "nobody now (it was released just after the deadline)"
    if h["state"] == "gone":
        return (f"thread {h['tid']}, which does not exist (a forged or stale lock word; "
                f"`ucmcache verify {seg.uuid}` reports it)")
    who = f"rank {h['rank']} " if h["rank"] is not None else ""
    return f"{who}pid {h['pid']} (thread {h['tid']}, {h['state']})"


class Stripes:
    """Hold a stripe on purpose (tests, tools).  The protocol never holds one across Python."""

    def __init__(self, ctx, base, layout):
        self._ctx = ctx
        self._base = base
        self._layout = layout

    def lock(self, stripe: int, timeout: Optional[float] = None) -> None:
        ns = -1 if timeout is None else int(timeout * 1e9)
        r = lib.ucm_stripe_lock(self._ctx, stripe, ns)
        if r == lib.UCM_OK:
            return
        if r == lib.UCM_TIMEOUT:
            raise TimeoutError(f"stripe {stripe} stayed locked for {timeout} s")
        raise CorruptSegment(f"stripe {stripe}'s mutex is unusable ({code_name(r)})")

    def unlock(self, stripe: int) -> None:
        lib.ucm_stripe_unlock(self._ctx, stripe)

    def rebuild(self, stripe: int) -> int:
        """Rebuild the chains of the buckets this stripe guards (held by us); returns how many
        links were dropped."""
        dropped = ffi.new("uint32_t *")
        if lib.ucm_stripe_repair(self._ctx, stripe, dropped) != lib.UCM_OK:
            raise CorruptSegment(f"stripe {stripe} is out of range")
        return dropped[0]
