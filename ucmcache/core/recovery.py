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

import itertools
import os
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator, List, Optional, Tuple

from .arenas import announce_ranks_changed
from .._core import ffi, lib
from .errors import CorruptSegment, RankUnavailable, UcmError
from .locks import describe_stripe_holder
from .results import code_name
from .segment import Segment, life_lock_byte


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
    failed: List[str] = field(default_factory=list)  # ranks left for the next recovery, why

    @property
    def count(self) -> int:
        return len(self.ranks)


def rank_state(seg: Segment, rank: int) -> int:
    return lib.ucm_load32(seg.base, seg.layout.rank(rank) + lib.UCM_R_STATE)


def rank_pid(seg: Segment, rank: int) -> int:
    return lib.ucm_load32(seg.base, seg.layout.rank(rank) + lib.UCM_R_PID)


def rank_alive(seg: Segment, rank: int) -> bool:
    """True if some open file description other than ours holds the rank's life lock."""
    r = lib.ucm_ofd_held_by_other(seg.lock_fd, life_lock_byte(rank))
    if r < 0:
        raise OSError(-r, os.strerror(-r), "OFD lock probe")
    return bool(r)


# The longest recovery waits for one stripe (to free a dead claimant's slot) before it gives up
# for now; the rank stays as it is and the next recovery finishes it.
RECOVERY_STRIPE_WAIT = 10.0
# The longest a thread waits for another thread of this process to finish recovering.
RANK_LOCK_WAIT = 60.0


@contextmanager
def _rank_lock(seg: Segment, wait: float = RANK_LOCK_WAIT) -> Iterator[bool]:
    """Held around every trylock -> recover -> unlock of this process (see Segment.rank_lock).
    Yields False if another thread held it past `wait` seconds (bounded, never a hang)."""
    ticket = next(_tickets)
    try:  # acquire inside the try: an exception right after it still reaches the release
        got = lib.ucm_plock_acquire(seg.rank_lock, int(max(0.0, wait) * 1e9), ticket) == lib.UCM_OK
        yield got
    finally:
        lib.ucm_plock_release(seg.rank_lock, ticket)  # a no-op unless this call holds it


_tickets = itertools.count(1)


def take_rank(seg: Segment, ctx, rank: Optional[int]) -> Tuple[int, Optional[Recovered]]:
    """Take a free rank (or `rank`); a rank whose holder died is recovered first and returned
    with what was reclaimed."""
    L = seg.layout
    if rank is not None:
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < L.max_ranks:
            raise ValueError(f"rank must be None or an int in [0, {L.max_ranks}), got {rank!r}")
        candidates = [rank]
    else:
        candidates = list(range(L.max_ranks))
    with _rank_lock(seg) as got:
        if not got:
            raise RankUnavailable(f"segment {seg.uuid!r}: another thread of this process held "
                                  f"its rank lock for {RANK_LOCK_WAIT} s")
        for r in candidates:
            if lib.ucm_ofd_trylock(seg.lock_fd, life_lock_byte(r)) != lib.UCM_OK:
                continue
            try:
                return r, _take_locked(seg, ctx, r)
            except BaseException:
                lib.ucm_ofd_unlock(seg.lock_fd, life_lock_byte(r))
                raise
    if rank is not None:
        raise RankUnavailable(f"rank {rank} of segment {seg.uuid!r} is held by a live process "
                              f"(pid {rank_pid(seg, rank)})")
    raise RankUnavailable(f"all {L.max_ranks} ranks of segment {seg.uuid!r} are held by live "
                          "processes")


def _take_locked(seg: Segment, ctx, r: int) -> Optional[Recovered]:
    off = seg.layout.rank(r)
    recovered = None
    if rank_state(seg, r) != lib.UCM_RANK_FREE:
        recovered = _recover_held(seg, ctx, r, count_in=r)  # its holder died; its lock is ours
    # The life lock makes us the only writer of this descriptor; the CAS states the rule.
    if not lib.ucm_cas32(seg.base, off + lib.UCM_R_STATE, lib.UCM_RANK_FREE,
                         lib.UCM_RANK_INITIALIZING):
        raise CorruptSegment(f"rank {r}'s state word changed under its life lock")
    lib.ucm_store32(seg.base, off + lib.UCM_R_PID, os.getpid())
    lib.ucm_fetch_add64(seg.base, off + lib.UCM_R_ATTACHES, 1)
    lib.ucm_store32(seg.base, off + lib.UCM_R_STATE, lib.UCM_RANK_READY)
    announce_ranks_changed(seg)  # the others leave us our share at their next allocation
    return recovered


def free_rank(seg: Segment, ctx, rank: int) -> None:
    """close(): the rank goes back to FREE; its Ready slots stay (entries outlive loaders).
    With no handle open, any hold still naming the rank is a leak (a pin taken just before an
    exception, say): it is removed as a dead rank's would be.  Our own rank: no other thread
    of ours recovers it (recover_dead_ranks skips it), so no rank_lock is needed."""
    _recover_holds(seg, ctx, rank, count_in=-1)  # frees our arenas, marks the rank FREE
    lib.ucm_ofd_unlock(seg.lock_fd, life_lock_byte(rank))


def _recover_held(seg: Segment, ctx, dead: int, stripe_wait: float = RECOVERY_STRIPE_WAIT, *,
                  count_in: int) -> Recovered:
    """Remove every hold of a rank whose life lock we hold; the C step marks it FREE and
    counts the recovery in rank `count_in`'s stats line."""
    return _recover_holds(seg, ctx, dead, stripe_wait, count_in=count_in)


def _recover_holds(seg: Segment, ctx, dead: int, stripe_wait: float = RECOVERY_STRIPE_WAIT, *,
                   count_in: int) -> Recovered:
    """One C step (ucm_recover_rank): finish its deletes in flight (DESIGN 4.13), recount the
    arenas it was writing, fail its loads, clear
    its pins, free its claims under their stripes, free its arenas, mark it FREE.  Raises if a
    stripe stayed held past stripe_wait, leaving the rank as it is for the next recovery."""
    rec = Recovered(rank=dead, pid=rank_pid(seg, dead))
    counts = ffi.new("uint32_t[4]")
    # count_in: a recovery is counted by the C step itself (recovered_ranks, in that rank's
    # stats line), so an exception right after it cannot lose the count; -1 for our own close.
    r = lib.ucm_recover_rank(ctx, dead, max(1, int(stripe_wait * 1e9)), count_in, counts)
    rec.pins, rec.failed_loads, rec.claims = counts[0], counts[1], counts[2]
    if r == lib.UCM_TIMEOUT:
        raise UcmError(f"segment {seg.uuid!r}: recovering rank {dead} waits for stripe "
                       f"{counts[3]}, held for {stripe_wait:g} s by "
                       f"{describe_stripe_holder(seg, counts[3])}; recovery will be "
                       "retried")
    if r != lib.UCM_OK:
        raise CorruptSegment(f"segment {seg.uuid!r}: recovering rank {dead} found "
                             f"{code_name(r)}")
    return rec


def recover_dead_ranks(seg: Segment, ctx, my_rank: Optional[int],
                       wait: Optional[float] = None) -> RecoveryReport:
    """Recover every dead rank.  ``wait`` bounds how long this may block (for this process's
    rank lock, and for each stripe a dead claimant's slot needs); None: the defaults.  A rank
    that cannot be finished now is reported in ``failed`` and left for the next recovery;
    the others are recovered all the same."""
    report = RecoveryReport()
    lock_wait = RANK_LOCK_WAIT if wait is None else wait
    stripe_wait = RECOVERY_STRIPE_WAIT if wait is None else min(wait, RECOVERY_STRIPE_WAIT)
    with _rank_lock(seg, lock_wait) as got:
        if not got:
            return report  # another thread of ours is recovering: it finds what we would
        for r in range(seg.layout.max_ranks):
            if r == my_rank or rank_state(seg, r) == lib.UCM_RANK_FREE:
                continue
            if lib.ucm_ofd_trylock(seg.lock_fd, life_lock_byte(r)) != lib.UCM_OK:
                continue  # alive (or another process's recoverer is at it)
            try:
                if rank_state(seg, r) != lib.UCM_RANK_FREE:
                    report.ranks.append(_recover_held(seg, ctx, r, stripe_wait,
                                                      count_in=-1 if my_rank is None else my_rank))
            except UcmError as e:  # a stripe held past the wait, or corruption: next time
                report.failed.append(f"rank {r}: {e}")
            finally:
                lib.ucm_ofd_unlock(seg.lock_fd, life_lock_byte(r))
    return report
