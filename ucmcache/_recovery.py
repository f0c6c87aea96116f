"""Recovery: ranks, their life locks, and exact reclamation of a dead rank's holds (I5).

A rank's life lock is an OFD lock on byte ``LIFE_LOCK_BYTE0 + rank`` of the segment's fd, held
for as long as the attaching process lives (the kernel drops it when the process dies, whatever
thread took it).  Holding a rank's life lock is also what entitles a process to change that
rank's descriptor, so:

* attach: trylock the life lock of a candidate rank; if it is ours and the rank's state is not
  FREE, its previous holder died: recover it first, then take it.
* recovery of others: trylock the life lock of every non-FREE rank; a success means its holder is
  dead (a live holder keeps the lock); recover it, mark it FREE, drop the lock.  Two recoverers
  cannot both hold it, so recovery is safe to run from several processes at once, and it is
  idempotent (a FREE rank is skipped).

Because every hold names its rank in shared words (pin bits, CLAIMED|rank, the loader rank of a
Loading slot), recovery finds exactly the dead rank's holds: its Loading slots become Failed
(waking waiters), its pin bits are cleared, and the slots it had claimed are unlinked if they
are reachable and freed, under their bucket's stripe.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import List, Optional, Tuple

from ._core import ffi, lib
from ._errors import CorruptSegment, RankUnavailable
from ._segment import Segment, life_lock_byte


@dataclass
class Recovered:
    rank: int
    pid: int
    pins: int = 0
    failed_loads: int = 0
    claims: int = 0


@dataclass
class RecoveryReport:
    ranks: List[Recovered] = field(default_factory=list)

    @property
    def count(self) -> int:
        return len(self.ranks)


def rank_state(seg: Segment, rank: int) -> int:
    return lib.ucm_load32(seg.base, seg.layout.rank(rank) + lib.UCM_R_STATE)


def rank_pid(seg: Segment, rank: int) -> int:
    return lib.ucm_load32(seg.base, seg.layout.rank(rank) + lib.UCM_R_PID)


def rank_alive(seg: Segment, rank: int) -> bool:
    """True if some open file description other than ours holds the rank's life lock."""
    r = lib.ucm_ofd_held_by_other(seg.fd, life_lock_byte(rank))
    if r < 0:
        raise OSError(-r, os.strerror(-r), "OFD lock probe")
    return bool(r)


def take_rank(seg: Segment, ctx, stripes, rank: Optional[int]) -> Tuple[int, Optional[Recovered]]:
    """Take a free rank (or `rank`); a rank whose holder died is recovered first and returned
    with what was reclaimed."""
    L = seg.layout
    if rank is not None:
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < L.max_ranks:
            raise ValueError(f"rank must be None or an int in [0, {L.max_ranks}), got {rank!r}")
        candidates = [rank]
    else:
        candidates = list(range(L.max_ranks))
    for r in candidates:
        if lib.ucm_ofd_trylock(seg.fd, life_lock_byte(r)) != lib.UCM_OK:
            continue
        off = L.rank(r)
        recovered = None
        if rank_state(seg, r) != lib.UCM_RANK_FREE:
            recovered = _recover_held(seg, ctx, stripes, r)  # its holder died; its lock is ours
        # The life lock makes us the only writer of this descriptor; the CAS states the rule.
        if not lib.ucm_cas32(seg.base, off + lib.UCM_R_STATE, lib.UCM_RANK_FREE,
                             lib.UCM_RANK_INITIALIZING):
            lib.ucm_ofd_unlock(seg.fd, life_lock_byte(r))
            raise CorruptSegment(f"rank {r}'s state word changed under its life lock")
        lib.ucm_store32(seg.base, off + lib.UCM_R_PID, os.getpid())
        lib.ucm_fetch_add64(seg.base, off + lib.UCM_R_ATTACHES, 1)
        lib.ucm_store32(seg.base, off + lib.UCM_R_STATE, lib.UCM_RANK_READY)
        return r, recovered
    if rank is not None:
        raise RankUnavailable(f"rank {rank} of segment {seg.uuid!r} is held by a live process "
                              f"(pid {rank_pid(seg, rank)})")
    raise RankUnavailable(f"all {L.max_ranks} ranks of segment {seg.uuid!r} are held by live "
                          "processes")


def free_rank(seg: Segment, ctx, stripes, rank: int) -> None:
    """close(): the rank goes back to FREE; its Ready slots stay (entries outlive loaders).
    With no handle open, any hold still naming the rank is a leak (a pin taken just before an
    exception, say): it is removed as a dead rank's would be."""
    _recover_holds(seg, ctx, stripes, rank)
    off = seg.layout.rank(rank)
    lib.ucm_store32(seg.base, off + lib.UCM_R_STATE, lib.UCM_RANK_STOPPED)
    lib.ucm_store32(seg.base, off + lib.UCM_R_PID, 0)
    lib.ucm_store32(seg.base, off + lib.UCM_R_STATE, lib.UCM_RANK_FREE)
    lib.ucm_ofd_unlock(seg.fd, life_lock_byte(rank))


def _recover_held(seg: Segment, ctx, stripes, dead: int) -> Recovered:
    """Remove every hold of a rank whose life lock we hold, then mark it FREE."""
    rec = _recover_holds(seg, ctx, stripes, dead)
    off = seg.layout.rank(dead)
    lib.ucm_store32(seg.base, off + lib.UCM_R_PID, 0)
    lib.ucm_store32(seg.base, off + lib.UCM_R_STATE, lib.UCM_RANK_FREE)
    return rec


def _recover_holds(seg: Segment, ctx, stripes, dead: int) -> Recovered:
    rec = Recovered(rank=dead, pid=rank_pid(seg, dead))
    cap = 256
    while True:
        claimed = ffi.new("uint32_t[]", cap)
        n, pins, loading = ffi.new("uint32_t *"), ffi.new("uint32_t *"), ffi.new("uint32_t *")
        if lib.ucm_recover_pins(ctx, dead, claimed, cap, n, pins, loading) != lib.UCM_OK:
            raise CorruptSegment(f"rank {dead} is out of range")
        rec.pins += pins[0]
        rec.failed_loads += loading[0]
        if n[0] <= cap:
            break
        cap = n[0]  # more claims than we had room for: look again (pins are already cleared)
    L = seg.layout
    for s in list(claimed)[: n[0]]:
        bucket = lib.ucm_load32(seg.base, L.meta(s) + lib.UCM_M_BUCKET)
        stripe = lib.ucm_stripe_of(ctx, bucket) if bucket < L.n_buckets else 0
        stripes.lock(stripe)
        try:
            r = lib.ucm_reclaim_claimed(ctx, s, dead, stripe)
        finally:
            stripes.unlock(stripe)
        if r == lib.UCM_OK:
            rec.claims += 1
    # Its range's accounting words from its slots: exact whatever step it died in (I4, I5).
    entries, size = ffi.new("uint64_t *"), ffi.new("uint64_t *")
    lib.ucm_recount_rank(ctx, dead, entries, size)
    return rec


def recover_dead_ranks(seg: Segment, ctx, stripes, my_rank: Optional[int]) -> RecoveryReport:
    report = RecoveryReport()
    for r in range(seg.layout.max_ranks):
        if r == my_rank or rank_state(seg, r) == lib.UCM_RANK_FREE:
            continue
        if lib.ucm_ofd_trylock(seg.fd, life_lock_byte(r)) != lib.UCM_OK:
            continue  # alive (or another recoverer is at it)
        try:
            if rank_state(seg, r) != lib.UCM_RANK_FREE:
                report.ranks.append(_recover_held(seg, ctx, stripes, r))
                lib.ucm_stat_add(ctx, lib.UCM_ST_RECOVERED_RANKS, 1)
        finally:
            lib.ucm_ofd_unlock(seg.fd, life_lock_byte(r))
    return report
