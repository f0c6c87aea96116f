"""Arenas: which rank allocates where (DESIGN 4.12).

The slot space is cut into arenas; a rank allocates only in arenas it owns.  The protocol
(ownership by CAS on an owner word, verification before a new owner writes, one writer of an
arena's accounting words at a time, recovery) is in the C core; this module is the policy: how
many arenas each attached rank should own and which ones it takes.

* Shares: the arenas split evenly over the ranks whose descriptor is READY (the lower ranks get
  the remainder).  A rank looks at its share again when the set of ranks changes (the header's
  arena epoch moved: an attach, a close, a recovery) at its next allocation, never on a hit.
* Taking: free arenas first, its home arenas (its own slot range) before others, so with every
  rank attached each rank owns its own range; then arenas of ranks that are not READY, then
  arenas of ranks holding more than their share, the largest surplus first (their own range
  last).  Then any arena still free: capacity nobody uses serves whoever allocates.
* Nobody gives arenas away while attached: a newcomer takes its share from the others at its
  own first allocation.  So an attach never waits for anybody, and a rank that attaches but
  never allocates (a reader, a monitor) takes nothing: its share keeps serving the others.
* When its arenas have no claimable slot (everything pinned or loading), a rank takes one more
  arena, free or from a rank above its share, before the cache reports CacheFull.
"""
from __future__ import annotations

from collections import Counter
from typing import Dict, List, Sequence, Tuple

import numpy as np

from ._core import ffi, lib
from ._segment import Segment


def shares(live: Sequence[int], n_arenas: int) -> Dict[int, int]:
    """How many arenas each READY rank should own: an even split, the remainder to the lowest
    ranks (every rank computes the same split from the same descriptors)."""
    ranks = sorted(live)
    if not ranks:
        return {}
    base, extra = divmod(n_arenas, len(ranks))
    return {r: base + (i < extra) for i, r in enumerate(ranks)}


def plan(owners: Sequence[int], me: int, live: Sequence[int], home: Sequence[int],
         want_one: bool = False) -> List[Tuple[int, int]]:
    """The arenas rank `me` should take, as (arena, owner word it must still hold): every free
    one, then from others up to its share.  `owners`: each arena's owner word (0 free, else
    rank + 1); `home[a]`: the rank whose range arena a is in.  `want_one`: the rank found
    nothing claimable in its arenas, so it takes at least one more if one can be had without
    taking a rank below its share."""
    target = shares(live, len(owners))
    counts = Counter(o - 1 for o in owners if o)
    need = target.get(me, 0) - counts[me]
    if want_one:
        need = max(need, 1)
    free = [a for a, o in enumerate(owners) if o == 0]
    free.sort(key=lambda a: home[a] != me)  # our own range first
    picks = [(a, 0) for a in free]          # all of them: capacity nobody uses
    need -= len(picks)
    if need <= 0:
        return picks
    # Ranks not READY (closing, or their arenas not yet freed by a recovery): all surplus.
    surplus = {r: n - target.get(r, 0) for r, n in counts.items() if r != me}
    mine_by_rank: Dict[int, List[int]] = {}
    for a, o in enumerate(owners):
        if o and o - 1 != me:
            mine_by_rank.setdefault(o - 1, []).append(a)
    while need > 0:
        victim = max((r for r, n in surplus.items() if n > 0), default=None,
                     key=lambda r: (r not in target, surplus[r]))
        if victim is None:
            break
        arenas = mine_by_rank[victim]
        # leave a rank its own range last; take ours back first
        arenas.sort(key=lambda a: (home[a] == victim, home[a] != me))
        a = arenas.pop(0)
        picks.append((a, victim + 1))
        surplus[victim] -= 1
        need -= 1
    return picks


class Arenas:
    """One rank's view of the arenas: when to look at its share again, and the taking."""

    def __init__(self, seg: Segment, ctx, rank: int):
        self._seg = seg
        self._ctx = ctx
        self._rank = rank
        L = seg.layout
        self._owners = np.zeros(L.n_arenas, dtype=np.uint32)
        self._owners_p = ffi.from_buffer("uint32_t[]", self._owners)
        self._home = [L.home_rank(a) for a in range(L.n_arenas)]
        self._epoch_seen = -1  # the first allocation looks

    def owners(self) -> np.ndarray:
        """A snapshot of every arena's owner word (0 free, else rank + 1)."""
        lib.ucm_arena_owners(self._ctx, self._owners_p)
        return self._owners.copy()

    def live_ranks(self) -> List[int]:
        base, L = self._seg.base, self._seg.layout
        return [r for r in range(L.max_ranks)
                if lib.ucm_load32(base, L.rank(r) + lib.UCM_R_STATE) == lib.UCM_RANK_READY]

    def rebalance_if_changed(self) -> int:
        """At an allocation: if the set of ranks changed since we last looked, take our share
        and whatever is free.  Returns how many arenas were taken."""
        epoch = lib.ucm_load64(self._seg.base, lib.UCM_H_ARENA_EPOCH)
        if epoch == self._epoch_seen:
            return 0
        self._epoch_seen = epoch
        return self._take(want_one=False)

    def grow(self) -> int:
        """Nothing claimable in our arenas: take one more if one can be had."""
        return self._take(want_one=True)

    def _take(self, want_one: bool) -> int:
        taken = 0
        for _ in range(3):  # another rank may take the same arena first: look again
            owners = self.owners()
            picks = plan(owners.tolist(), self._rank, self.live_ranks(), self._home, want_one)
            if not picks:
                break
            busy = 0
            for a, expected in picks:
                r = lib.ucm_arena_take(self._ctx, a, expected)
                if r == lib.UCM_OK:
                    taken += 1
                elif r == lib.UCM_BUSY:
                    busy += 1
                else:
                    return taken  # closed or not attached: nothing to take for
            if not busy or (want_one and taken):
                break
        return taken


def announce_ranks_changed(seg: Segment) -> None:
    """An attach or a close: every rank looks at its share at its next allocation."""
    lib.ucm_fetch_add64(seg.base, lib.UCM_H_ARENA_EPOCH, 1)
