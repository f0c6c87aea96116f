"""Verify: walk a whole segment and report every broken invariant.

The walk reads a private copy of the control region and checks every index it follows, so a
corrupt segment produces a report, never a crash.  It is exact on a quiescent segment (no
process inside a protocol step); on a live one, a step in flight can show up as a problem.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List

import numpy as np

from ._core import lib
from ._locks import describe_stripe_holder, stripe_holder
from ._recovery import rank_alive
from ._segment import Segment
from ._stats import RANK_STATES

_ACC_GEN_MASK = (1 << lib.UCM_ACC_GEN_BITS) - 1
_ACC_VAL_MASK = (1 << lib.UCM_ACC_VALUE_BITS) - 1
STATE_NAMES = {lib.UCM_EMPTY: "empty", lib.UCM_LOADING: "loading", lib.UCM_READY: "ready",
               lib.UCM_FAILED: "failed"}


@dataclass
class VerifyReport:
    uuid: str
    problems: List[str] = field(default_factory=list)
    facts: Dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.problems

    def __str__(self) -> str:
        if self.ok:
            return f"segment {self.uuid!r}: all invariants hold"
        return f"segment {self.uuid!r}: {len(self.problems)} problem(s):\n  " + "\n  ".join(self.problems)


def verify(uuid: str, *, timeout: float = 1.0) -> VerifyReport:
    """Check segment ``uuid`` (attaching read-only, taking no rank)."""
    seg = Segment.attach(uuid, timeout=timeout, writable=False)
    try:
        return verify_segment(seg)
    finally:
        seg.detach()


def snapshot(seg: Segment) -> Dict[str, Any]:
    """Copies of the control arrays, as numpy arrays."""
    L = seg.layout
    metas = np.frombuffer(seg.mm, dtype=np.uint32, count=L.n_slots * 16, offset=L.meta_off)
    metas = metas.reshape(L.n_slots, 16).copy()
    heads = np.frombuffer(seg.mm, dtype=np.uint32, count=L.n_buckets, offset=L.bucket_off).copy()
    hdr = np.frombuffer(seg.mm, dtype=np.uint64, count=lib.UCM_HEADER_SIZE // 8).copy()
    ranks = np.frombuffer(seg.mm, dtype=np.uint32, count=L.max_ranks * lib.UCM_RANK_SIZE // 4,
                          offset=L.rank_off).reshape(L.max_ranks, -1).copy()
    return {"metas": metas, "heads": heads, "header": hdr, "ranks": ranks}


def slot_fields(metas: np.ndarray) -> Dict[str, np.ndarray]:
    ref = metas[:, 0].astype(np.uint64) | (metas[:, 1].astype(np.uint64) << np.uint64(32))
    return {
        "reference": ref,
        "bucket": metas[:, lib.UCM_M_BUCKET // 4],
        "state": metas[:, lib.UCM_M_STATE // 4] & lib.UCM_STATE_MASK,
        "prev": metas[:, lib.UCM_M_PREV // 4],
        "next": metas[:, lib.UCM_M_NEXT // 4],
        "generation": metas[:, lib.UCM_M_GENERATION // 4],
        "length": metas[:, lib.UCM_M_LENGTH // 4],
        "accessed": metas[:, lib.UCM_M_ACCESSED // 4],
        "loader": metas[:, lib.UCM_M_LOADER // 4] & 0xFFFF,
        "flags": metas[:, lib.UCM_M_LOADER // 4] >> 16,
    }


def verify_segment(seg: Segment) -> VerifyReport:
    L = seg.layout
    rep = VerifyReport(seg.uuid)
    p = rep.problems
    snap = snapshot(seg)
    f = slot_fields(snap["metas"])
    heads = snap["heads"]
    n = L.n_slots
    NIL = lib.UCM_NIL
    generation = int(snap["header"][lib.UCM_H_GENERATION // 8])

    # Ranks: which are live (their life lock held by someone).
    live = set()
    rank_rows = []
    for r in range(L.max_ranks):
        state = int(snap["ranks"][r, lib.UCM_R_STATE // 4])
        pid = int(snap["ranks"][r, lib.UCM_R_PID // 4])
        alive = rank_alive(seg, r)
        if alive:
            live.add(r)
        if state not in RANK_STATES:
            p.append(f"rank {r}: state word {state} is not a rank state")
        elif state != lib.UCM_RANK_FREE and not alive:
            p.append(f"rank {r}: {RANK_STATES[state]} (pid {pid}) but its process is dead "
                     "(not recovered yet)")
        rank_rows.append({"rank": r, "state": RANK_STATES.get(state, str(state)), "pid": pid,
                          "alive": alive})

    # Chains: every link in range, every linked slot names its bucket, prev mirrors next, no
    # slot in two places, and every slot with a bucket word is reachable from that bucket.
    seen = np.zeros(n, dtype=bool)
    lengths = np.zeros(L.n_buckets, dtype=np.int64)
    for b in np.flatnonzero(heads != NIL):
        s, prev, steps = int(heads[b]), NIL, 0
        while s != NIL:
            if s >= n:
                p.append(f"bucket {b}: link to slot {s}, beyond the {n} slots")
                break
            if seen[s]:
                p.append(f"bucket {b}: slot {s} reached twice (a cycle or a slot in two chains)")
                break
            seen[s] = True
            steps += 1
            if int(f["bucket"][s]) != b:
                p.append(f"bucket {b}: slot {s} is linked here but its bucket word is "
                         f"{int(f['bucket'][s]):#x}")
            if int(f["prev"][s]) != prev:
                p.append(f"bucket {b}: slot {s}'s prev is {int(f['prev'][s])}, expected {prev}")
            prev, s = s, int(f["next"][s])
        lengths[b] = steps
    claimed_mask = (f["reference"] & np.uint64(lib.UCM_CLAIMED)) != 0
    stray = np.flatnonzero((f["bucket"] != lib.UCM_INVALID_BUCKET) & ~seen & ~claimed_mask)
    for s in stray[:50]:
        p.append(f"slot {s}: bucket word {int(f['bucket'][s])} but not reachable from it")

    # Holds: pins and claims only by live ranks; Loading only with a live loader.
    live_mask = np.uint64(sum(1 << r for r in live))
    ref = f["reference"]
    pins = np.where(claimed_mask, np.uint64(0), ref)
    dead_pins = np.flatnonzero((pins & ~live_mask) != 0)
    for s in dead_pins[:50]:
        bits = int(pins[s]) & ~int(live_mask)
        ranks = [r for r in range(64) if bits >> r & 1]
        p.append(f"slot {s}: pinned by rank(s) {ranks} that are not alive")
    for s in np.flatnonzero(claimed_mask)[:50]:
        r = int(ref[s]) & 0xFF
        if r not in live:
            p.append(f"slot {s}: claimed by rank {r}, which is not alive")
    loading = np.flatnonzero((f["state"] == lib.UCM_LOADING) & ~claimed_mask)
    for s in loading:
        if int(f["loader"][s]) not in live:
            p.append(f"slot {s}: Loading, but its loader rank {int(f['loader'][s])} is not alive")
    bad_state = np.flatnonzero(f["state"] > lib.UCM_FAILED)
    for s in bad_state[:50]:
        p.append(f"slot {s}: state {int(f['state'][s])} is not a slot state")

    # Accounting (I4): each rank's words against the counted Ready slots of its own range in
    # the current generation.
    g32 = generation & 0xFFFFFFFF
    counted = ((f["flags"] & lib.UCM_F_COUNTED) != 0) & (f["generation"] == g32) & \
        (f["state"] == lib.UCM_READY)
    current_ready = (f["state"] == lib.UCM_READY) & (f["generation"] == g32) & (f["bucket"] != lib.UCM_INVALID_BUCKET)
    ranks64 = snap["ranks"].view(np.uint64)

    def acc(a: int) -> int:
        return a & _ACC_VAL_MASK if (a >> lib.UCM_ACC_VALUE_BITS) == (generation & _ACC_GEN_MASK) else 0

    entries = size = 0
    spr = L.slots_per_rank
    for r in range(L.max_ranks):
        e = acc(int(ranks64[r, lib.UCM_R_ACC_ENTRIES // 8]))
        b = acc(int(ranks64[r, lib.UCM_R_ACC_BYTES // 8]))
        mine = counted[r * spr:(r + 1) * spr]
        se = int(mine.sum())
        sb = int(f["length"][r * spr:(r + 1) * spr][mine].astype(np.int64).sum())
        if (e, b) != (se, sb):
            p.append(f"accounting: rank {r}'s words say {e} entries / {b} bytes, its range's "
                     f"slots of generation {generation} add up to {se} / {sb}")
        entries += e
        size += b
    uncounted = np.flatnonzero(current_ready & ~counted)
    for s in uncounted[:20]:
        p.append(f"slot {s}: Ready in the current generation but not counted")

    # Stripes: one held by a process that is stopped (SIGSTOP, a debugger) or by a thread that
    # does not exist (a forged or stale lock word) wedges every cold get of its buckets.
    for st in range(L.n_stripes):
        h = stripe_holder(seg, st)
        if h["state"] in ("stopped", "gone"):
            p.append(f"stripe {st}: held by {describe_stripe_holder(seg, st)}")

    states = {name: int((f["state"] == v).sum()) for v, name in STATE_NAMES.items()}
    used = lengths[lengths > 0]
    rep.facts = {
        "generation": generation,
        "entries": entries,
        "size_bytes": size,
        "slots": n,
        "slot_states": states,
        "pinned_slots": int(((pins != 0)).sum()),
        "claimed_slots": int(claimed_mask.sum()),
        "current_entries_scanned": int(current_ready.sum()),
        "chains": {
            "buckets": L.n_buckets,
            "nonempty": int(len(used)),
            "mean": float(used.mean()) if len(used) else 0.0,
            "p99": float(np.percentile(used, 99)) if len(used) else 0.0,
            "max": int(used.max()) if len(used) else 0,
            "histogram": {int(k): int(v) for k, v in zip(*np.unique(lengths, return_counts=True))},
        },
        "ranks": rank_rows,
    }
    return rep
