"""Verify: walk a whole segment and report every broken invariant.

The walk reads a private copy of the control region and checks every index it follows, so a
corrupt segment produces a report, never a crash.  It is exact on a quiescent segment (no
process inside a protocol step); on a live one, a step in flight can show up as a problem.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Set, Tuple

import numpy as np

from .._core import lib
from .locks import describe_stripe_holder, stripe_holder
from .segment import Segment
from .table import (RANK_STATES, acc_value, arena_table, bucket_heads, claimant, claimed, current,
                     header_row, pin_bits, pinning_ranks, rank_rows, rank_table, slot_fields,
                     slot_table, state_counts)

SHOWN = 50          # slots named per kind of problem (the counts in facts stay complete)
SHOWN_UNCOUNTED = 20


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
        return (f"segment {self.uuid!r}: {len(self.problems)} problem(s):\n  " +
                "\n  ".join(self.problems))


def verify(uuid: str, *, timeout: float = 1.0) -> VerifyReport:
    """Check segment ``uuid`` (attaching read-only, taking no rank)."""
    seg = Segment.attach(uuid, timeout=timeout, writable=False)
    try:
        return verify_segment(seg)
    finally:
        seg.detach()


def snapshot(seg: Segment) -> Dict[str, Any]:
    """Copies of the control regions: ``metas`` (SLOT_META rows, for slot_fields), ``heads``,
    ``header`` (a HEADER row) and ``ranks``: the descriptors as u32 words, one row per rank,
    indexed by ``UCM_R_* // 4`` (the form the crash harness in tests/ reads)."""
    ranks = rank_table(seg)
    return {"metas": slot_table(seg), "heads": bucket_heads(seg), "header": header_row(seg),
            "ranks": ranks.view(np.uint32).reshape(len(ranks), -1)}


# ------------------------------------------------------------------------- the checks

def _check_ranks(seg: Segment, table: np.ndarray, p: List[str]) -> Tuple[list, Set[int]]:
    """Ranks: which are live (their life lock held by someone); a rank not free must be."""
    rows = rank_rows(seg, table=table)
    for row, state in zip(rows, table["state"]):
        if int(state) not in RANK_STATES:
            p.append(f"rank {row['rank']}: state word {int(state)} is not a rank state")
        elif row["dead"]:
            p.append(f"rank {row['rank']}: {row['state']} (pid {row['pid']}) but its process is "
                     "dead (not recovered yet)")
    return rows, {row["rank"] for row in rows if row["alive"]}


def _check_chains(seg: Segment, heads: np.ndarray, f: Dict[str, np.ndarray],
                  claims: np.ndarray, p: List[str]) -> np.ndarray:
    """Chains: every link in range, every linked slot names its bucket, prev mirrors next, no
    slot in two places, and every slot with a bucket word is reachable from that bucket (but
    one claimed or marked deleting: a step in flight).
    Returns each bucket's chain length."""
    n, NIL = seg.layout.n_slots, lib.UCM_NIL
    seen = np.zeros(n, dtype=bool)
    lengths = np.zeros(seg.layout.n_buckets, dtype=np.int64)
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
    # a claimed slot, or one marked deleting (its unlink between the link and the bucket word,
    # mid_delete; a dead deleter's mark is reported by _check_holds), is a step in flight
    deleting = (f["flags"] & lib.UCM_F_DELETING) != 0
    stray = np.flatnonzero((f["bucket"] != lib.UCM_INVALID_BUCKET) & ~seen & ~claims & ~deleting)
    for s in stray[:SHOWN]:
        p.append(f"slot {s}: bucket word {int(f['bucket'][s])} but not reachable from it")
    return lengths


def _check_holds(f: Dict[str, np.ndarray], claims: np.ndarray, pins: np.ndarray,
                 live: Set[int], p: List[str]) -> None:
    """Holds: pins and claims only by live ranks; Loading only with a live loader."""
    live_mask = np.uint64(sum(1 << r for r in live))
    for s in np.flatnonzero((pins & ~live_mask) != 0)[:SHOWN]:
        ranks = pinning_ranks(int(pins[s]) & ~int(live_mask))
        p.append(f"slot {s}: pinned by rank(s) {ranks} that are not alive")
    who = claimant(f["reference"])
    for s in np.flatnonzero(claims)[:SHOWN]:
        if int(who[s]) not in live:
            p.append(f"slot {s}: claimed by rank {int(who[s])}, which is not alive")
    for s in np.flatnonzero((f["state"] == lib.UCM_LOADING) & ~claims):
        if int(f["loader"][s]) not in live:
            p.append(f"slot {s}: Loading, but its loader rank {int(f['loader'][s])} is not alive")
    for s in np.flatnonzero(((f["flags"] & lib.UCM_F_INSTALLING) != 0) & ~claims)[:SHOWN]:
        p.append(f"slot {s}: marked installing but not claimed")
    # A delete in flight (UCM_F_DELETING): its deleter is the rank in the loader word, which
    # must be alive and pin the slot; a pinner's death is no concern of the mark (I5, I6).
    deleting = (f["flags"] & lib.UCM_F_DELETING) != 0
    for s in np.flatnonzero(deleting)[:SHOWN]:
        deleter = int(f["loader"][s])
        if deleter not in live:
            p.append(f"slot {s}: marked deleting by rank {deleter}, which is not alive (its delete "
                     "is finished by that rank's recovery)")
        elif not int(pins[s]) >> deleter & 1 or claims[s]:
            p.append(f"slot {s}: marked deleting by rank {deleter}, which does not pin it")
        elif int(f["state"][s]) != lib.UCM_READY:
            p.append(f"slot {s}: marked deleting but {int(f['state'][s])} is not Ready")
    checked = (f["flags"] & lib.UCM_F_DELETE_CHECKED) != 0
    for s in np.flatnonzero(checked & ~deleting)[:SHOWN]:
        p.append(f"slot {s}: marked delete-checked but not deleting")
    for s in np.flatnonzero(f["state"] > lib.UCM_FAILED)[:SHOWN]:
        p.append(f"slot {s}: state {int(f['state'][s])} is not a slot state")


def _check_accounting(seg: Segment, arenas: np.ndarray, f: Dict[str, np.ndarray],
                      generation: int, p: List[str]) -> Dict[str, int]:
    """Accounting (I4, I6): each arena's words against the counted Ready slots of that arena in
    the current generation."""
    ready_now = (f["state"] == lib.UCM_READY) & current(f, generation)
    counted = ((f["flags"] & lib.UCM_F_COUNTED) != 0) & ready_now
    entries = size = 0
    L = seg.layout
    for a in range(L.n_arenas):
        e = acc_value(int(arenas[a]["acc_entries"]), generation)
        b = acc_value(int(arenas[a]["acc_bytes"]), generation)
        span = L.arena_range(a)
        mine = counted[span.start:span.stop]
        se = int(mine.sum())
        sb = int(f["length"][span.start:span.stop][mine].astype(np.int64).sum())
        if (e, b) != (se, sb):
            p.append(f"accounting: arena {a}'s words say {e} entries / {b} bytes, its slots "
                     f"of generation {generation} add up to {se} / {sb}")
        entries += e
        size += b
    scanned = ready_now & (f["bucket"] != lib.UCM_INVALID_BUCKET)
    for s in np.flatnonzero(scanned & ~counted)[:SHOWN_UNCOUNTED]:
        p.append(f"slot {s}: Ready in the current generation but not counted")
    return {"entries": entries, "size_bytes": size, "current_entries_scanned": int(scanned.sum())}


def _check_arenas(arenas: np.ndarray, live: Set[int], max_ranks: int,
                  p: List[str]) -> Dict[int, int]:
    """Ownership: every owner word is free or names a live rank (a dead or closed rank's
    arenas are freed by its recovery or its close).  One problem per owner, not per arena."""
    owned: Dict[int, List[int]] = {}
    for a, word in enumerate(arenas["owner"].tolist()):
        if word:
            owned.setdefault(word - 1, []).append(a)
    for r, which in sorted(owned.items()):
        shown = ", ".join(map(str, which[:SHOWN])) + (", ..." if len(which) > SHOWN else "")
        if r >= max_ranks:
            p.append(f"arena(s) {shown}: owner word {r + 1} names no rank (max_ranks "
                     f"{max_ranks})")
        elif r not in live:
            p.append(f"{len(which)} arena(s) owned by rank {r}, which is not alive: {shown}")
    return {r: len(which) for r, which in owned.items()}


def _check_stripes(seg: Segment, p: List[str]) -> None:
    """Stripes: one held by a process that is stopped (SIGSTOP, a debugger) or by a thread that
    does not exist (a forged or stale lock word) wedges every cold get of its buckets."""
    for st in range(seg.layout.n_stripes):
        if stripe_holder(seg, st)["state"] in ("stopped", "gone"):
            p.append(f"stripe {st}: held by {describe_stripe_holder(seg, st)}")


def _chain_facts(n_buckets: int, lengths: np.ndarray) -> Dict[str, Any]:
    used = lengths[lengths > 0]
    return {
        "buckets": n_buckets,
        "nonempty": int(len(used)),
        "mean": float(used.mean()) if len(used) else 0.0,
        "p99": float(np.percentile(used, 99)) if len(used) else 0.0,
        "max": int(used.max()) if len(used) else 0,
        "histogram": {int(k): int(v) for k, v in zip(*np.unique(lengths, return_counts=True))},
    }


def verify_segment(seg: Segment) -> VerifyReport:
    rep = VerifyReport(seg.uuid)
    p = rep.problems
    ranks = rank_table(seg)
    arenas = arena_table(seg)
    f = slot_fields(slot_table(seg))
    heads = bucket_heads(seg)
    generation = int(header_row(seg)["generation"])
    claims = claimed(f["reference"])
    pins = pin_bits(f["reference"])

    rows, live = _check_ranks(seg, ranks, p)
    lengths = _check_chains(seg, heads, f, claims, p)
    _check_holds(f, claims, pins, live, p)
    accounting = _check_accounting(seg, arenas, f, generation, p)
    owned = _check_arenas(arenas, live, seg.layout.max_ranks, p)
    _check_stripes(seg, p)

    rep.facts = {
        "generation": generation,
        "entries": accounting["entries"],
        "size_bytes": accounting["size_bytes"],
        "slots": seg.layout.n_slots,
        "slot_states": state_counts(f["state"]),
        "pinned_slots": int((pins != 0).sum()),
        "claimed_slots": int(claims.sum()),
        "deleting_slots": int(((f["flags"] & lib.UCM_F_DELETING) != 0).sum()),
        "current_entries_scanned": accounting["current_entries_scanned"],
        "chains": _chain_facts(seg.layout.n_buckets, lengths),
        "ranks": rows,
        "arenas": {"count": seg.layout.n_arenas, "slots_each": seg.layout.arena_slots,
                   "free": int((arenas["owner"] == 0).sum()),
                   "owned_by_rank": {int(r): n for r, n in sorted(owned.items())}},
    }
    return rep
