"""Arenas: which rank allocates where (DESIGN 4.12).

The slot space is cut into arenas; a rank allocates only in arenas it owns.  The protocol
(ownership by CAS on an owner word, verification before a new owner writes, one writer of an
arena's accounting words at a time, recovery) is in the C core; this module is the policy: how
many arenas each attached rank should own and which ones it takes.

* Shares: the arenas split evenly over the ranks whose descriptor is READY (the lower ranks get
  the remainder).  A rank looks at its share again when the set of ranks changes (the header's
  arena epoch moved: an attach, a close, a recovery, an arena freed) at its next allocation,
  never on a hit.
* Taking: every free arena, its home arenas (its own slot range) first, so with every rank
  attached each rank owns its own range; then, up to its share, arenas of ranks that are not
  READY, then of ranks holding more than their share (the largest surplus first, their own range
  last).  Nobody gives arenas away while attached: a newcomer takes its share from the others at
  its own first allocation, so an attach never waits for anybody, and a rank that attaches but
  never allocates (a reader, a monitor) takes nothing: its share keeps serving the others.
* Busy arenas: an arena where another rank's install or load is in flight cannot be used by a
  new owner until it ends (I6), so it is never chosen while another will do, and it does not
  count as usable.  When a rank's arenas hold nothing claimable, it takes one more (free, or from
  a rank above its share); and it gives every busy arena it holds back to free, for the rank
  whose load is in it (that rank may use it at once) or for whoever allocates after the load,
  taking as many idle arenas in exchange, from ranks at their share too.  So `CacheFull` means
  every slot the rank can obtain is pinned or loading.
* Before evicting: a claim takes a free slot of our arenas before it evicts anything; with
  none there, the policy looks once per arena epoch and generation (UCM_ROOM, ``make_room``):
  it takes what we lack of our share from ranks above theirs (their entries come under our
  CLOCK, none evicted), else one arena not ours with room by its words: a free one first, then
  one of a rank not READY, then of the rank furthest above its share, then of any rank, the most
  room first, never a busy one.  Only with nothing to take do our claims evict (the CLOCK
  among live entries), until the epoch or the generation moves (the pair read before the look:
  one that moved during it is not marked), or we own fewer arenas than the look saw (another
  rank's room look took one of ours: no epoch moves, and we look again only when we would
  evict).  So no live entry is evicted while a slot we could obtain is free, and once the
  cache is full each rank takes its share back before its first eviction.
* Deletes: only an arena's writer changes its words (I6), so a delete whose entry lies in an arena
  we do not own takes it for the delete (``take_for_delete``) and gives it back to free after it
  (``give_back``, announced), for its usual owner to take back at its next allocation.
"""
from __future__ import annotations

import itertools
from collections import Counter
from typing import Dict, List, Sequence, Tuple

import numpy as np

from .._core import ffi, lib
from .segment import Segment

LOCK_WAIT = 0.5  # the longest a thread waits for another thread of its rank to take arenas


def shares(live: Sequence[int], n_arenas: int) -> Dict[int, int]:
    """How many arenas each READY rank should own: an even split, the remainder to the lowest
    ranks (every rank computes the same split from the same descriptors)."""
    ranks = sorted(live)
    if not ranks:
        return {}
    base, extra = divmod(n_arenas, len(ranks))
    return {r: base + (i < extra) for i, r in enumerate(ranks)}


def room_order(owners: Sequence[int], me: int, live: Sequence[int], room: Sequence[int],
               busy: Sequence[int]) -> List[Tuple[int, int]]:
    """The arenas rank `me` may take for room before it evicts, best first, as (arena, owner
    word it must still hold): not ours, not busy, with room (`room[a]`: slots its words do not
    count as entries); free ones first, then those of ranks not READY, then of the rank furthest
    above its share, then of any rank; the most room first within each."""
    target = shares(live, len(owners))
    counts = Counter(o - 1 for o in owners if o)
    surplus = {r: n - target.get(r, 0) for r, n in counts.items()}

    def rank_of(a: int) -> Tuple[int, int, int]:
        o = owners[a]
        if o == 0:
            return (0, 0, -room[a])
        if o - 1 not in target:
            return (1, 0, -room[a])
        return (2, -surplus[o - 1], -room[a])

    cands = [a for a, o in enumerate(owners) if o != me + 1 and room[a] > 0 and not busy[a]]
    return [(a, owners[a]) for a in sorted(cands, key=rank_of)]


def plan(owners: Sequence[int], me: int, live: Sequence[int], home: Sequence[int],
         busy: Sequence[int], want_one: bool = False, swaps: int = 0) -> List[Tuple[int, int]]:
    """The arenas rank `me` should take, as (arena, owner word it must still hold).

    `owners`: each arena's owner word (0 free, else rank + 1); `home[a]`: the rank whose range
    arena a is in; `busy[a]`: how many of its slots hold another rank's install or load (a busy
    arena is not usable by a new owner yet, so it is neither counted as usable nor taken).
    `want_one`: nothing claimable in our arenas: take at least one more if one can be had
    without taking a rank below its share.  `swaps`: how many busy arenas we are giving back,
    so as many may be taken from ranks at their share (their totals stay the same)."""
    target = shares(live, len(owners))
    counts = Counter(o - 1 for o in owners if o)
    usable = sum(1 for a, o in enumerate(owners) if o == me + 1 and not busy[a])
    need = target.get(me, 0) - usable
    if want_one:
        need = max(need, 1)
    free = [a for a, o in enumerate(owners) if o == 0 and not busy[a]]
    free.sort(key=lambda a: home[a] != me)  # our own range first
    picks = [(a, 0) for a in free]          # all of them: capacity nobody uses
    need -= len(picks)
    # Ranks not READY (closing, or their arenas not yet freed by a recovery): all surplus.
    surplus = {r: n - target.get(r, 0) for r, n in counts.items() if r != me}
    idle: Dict[int, List[int]] = {}
    for a, o in enumerate(owners):
        if o and o - 1 != me and not busy[a]:
            idle.setdefault(o - 1, []).append(a)
    for arenas in idle.values():
        # take ours back first; leave a rank its own range last
        arenas.sort(key=lambda a: (home[a] != me, home[a] == owners[a] - 1))
    while need > 0:
        # above its share; or, for an arena we gave back, at its share (never below it)
        can = [r for r, n in surplus.items() if idle.get(r) and (n > 0 or (swaps > 0 and n == 0))]
        if not can:
            break
        victim = max(can, key=lambda r: (r not in target, surplus[r]))
        if surplus[victim] <= 0:
            swaps -= 1
        picks.append((idle[victim].pop(0), victim + 1))
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
        self._home = [L.home_rank(a) for a in range(L.n_arenas)]
        self._sizes = np.array([len(L.arena_range(a)) for a in range(L.n_arenas)], dtype=np.int64)
        # Threads of this process take arenas one at a time (another one, meanwhile, just
        # allocates); a C lock that an exception cannot leave held (see Segment.rank_lock).
        self._lock = ffi.gc(lib.ucm_plock_new(), lib.ucm_plock_free)
        if self._lock == ffi.NULL:
            raise MemoryError("could not allocate the arena lock")

    def owners(self) -> np.ndarray:
        """A snapshot of every arena's owner word (0 free, else rank + 1)."""
        out = np.zeros(self._seg.layout.n_arenas, dtype=np.uint32)
        lib.ucm_arena_owners(self._ctx, ffi.from_buffer("uint32_t[]", out))
        return out

    def busy(self) -> np.ndarray:
        """Per arena, how many slots hold another rank's install or load now (a hint)."""
        out = np.zeros(self._seg.layout.n_arenas, dtype=np.uint32)
        lib.ucm_arena_foreign(self._ctx, ffi.from_buffer("uint32_t[]", out))
        return out

    def live_ranks(self) -> List[int]:
        base, L = self._seg.base, self._seg.layout
        return [r for r in range(L.max_ranks)
                if lib.ucm_load32(base, L.rank(r) + lib.UCM_R_STATE) == lib.UCM_RANK_READY]

    def rebalance(self, wait: float = LOCK_WAIT) -> int:
        """The slow path said the set of ranks changed since we last looked (UCM_MOVED): take
        our share and whatever is free.  Returns how many arenas were taken."""
        return self._locked(False, wait)

    def grow(self, wait: float = LOCK_WAIT) -> int:
        """Nothing claimable in our arenas: give back the busy ones, take one more (and one per
        busy arena given back) if they can be had."""
        return self._locked(True, wait)

    def make_room(self, wait: float = LOCK_WAIT) -> int:
        """The claim found nothing free in our arenas, and we have not looked since the epoch
        or the generation moved (UCM_ROOM): before it evicts, take what we lack of our share
        (plan: from ranks above theirs, whose entries come under our CLOCK, none evicted),
        else one arena not ours with room (room_order), so the next claim fills it.  With
        nothing to take, say so to the core under the epoch and generation read before the
        look and the arenas it saw ours (ucm_arena_room_gone_at): our claims evict (CLOCK)
        until either moves or an arena of ours is taken.  Returns how many arenas were
        taken."""
        ticket = next(_tickets)
        try:  # acquire inside the try, as in _locked
            if lib.ucm_plock_acquire(self._lock, max(0, int(wait * 1e9)), ticket) != lib.UCM_OK:
                return 0  # another thread of ours is taking arenas: the claim looks again
            # The epoch and generation we look under, read before the look: if either moves
            # while we look (an attach, a clear()), "nothing to take" is not marked for the
            # new pair, which nobody looked under; the next claim asks again.
            mark = lib.ucm_arena_room_mark(self._ctx)
            for _ in range(3):  # another rank may take the same arena first: look again
                owners, busy = self.owners(), self.busy()
                live = self.live_ranks()
                picks = plan(owners.tolist(), self._rank, live, self._home, busy.tolist())
                if not picks:
                    room = self._sizes - self.entries()
                    picks = room_order(owners.tolist(), self._rank, live, room.tolist(),
                                       busy.tolist())[:1]
                if not picks:
                    break
                taken = 0
                for a, expected in picks:
                    # A take from a rank at or below its share moves no epoch: that rank sees
                    # it owns fewer arenas than when it marked "nothing to take", and looks
                    # again (its share back from our surplus) before its next eviction.
                    r = lib.ucm_arena_take(self._ctx, a, expected)
                    if r == lib.UCM_OK:
                        taken += 1
                    elif r != lib.UCM_BUSY:
                        return taken  # closed or not attached: nothing to take for
                if taken:
                    return taken
            lib.ucm_arena_room_gone_at(self._ctx, mark, int((owners == self._rank + 1).sum()))
            return 0
        finally:
            lib.ucm_plock_release(self._lock, ticket)

    def entries(self) -> np.ndarray:
        """Per arena, the entries its words count in the current generation (a hint)."""
        out = np.zeros(self._seg.layout.n_arenas, dtype=np.uint32)
        lib.ucm_arena_entries(self._ctx, ffi.from_buffer("uint32_t[]", out))
        return out.astype(np.int64)

    def take_for_delete(self, arena: int) -> bool:
        """A delete found its entry in an arena we do not own (ucm_delete: UCM_NOT_HELD): take
        it, from whoever owns it (free, live or dead), so that our rank may write its words
        (I6); the delete's step verifies it before writing.  True if this call took it (the
        caller gives it back after the delete: give_back); False if it is ours already or
        its owner word changed meanwhile (the caller looks again, with backoff).  No arena
        lock: a take is one CAS, and a delete must not wait on another thread's planning."""
        n = self._seg.layout.n_arenas
        if isinstance(arena, bool) or not isinstance(arena, int) or not 0 <= arena < n:
            raise ValueError(f"arena must be an int in [0, {n}), got {arena!r}")
        word = int(self.owners()[arena])
        if word == self._rank + 1:
            return False
        return lib.ucm_arena_take(self._ctx, arena, word) == lib.UCM_OK

    def give_back(self, arena: int) -> None:
        """An arena taken for a delete goes back to free (never kept: the shares stay as the
        policy set them), and every rank looks again, so its usual owner takes it back at its
        next allocation.  Safe with our installs or loads in flight there (ucm_arena_release)."""
        if lib.ucm_arena_release(self._ctx, arena) == lib.UCM_OK:
            announce_ranks_changed(self._seg)

    def _locked(self, want_one: bool, wait: float) -> int:
        """One thread of ours at a time (a take lasts a millisecond or so: the others wait,
        bounded, rather than report CacheFull while it frees or takes what they need); a
        nested call on the same thread (a signal handler) gets nothing at once."""
        ticket = next(_tickets)
        try:  # acquire inside the try: an exception right after it still reaches the release
            if lib.ucm_plock_acquire(self._lock, max(0, int(wait * 1e9)), ticket) != lib.UCM_OK:
                return 0  # the epoch stays unseen: the next slow path looks again
            return self._take(want_one)
        finally:
            lib.ucm_plock_release(self._lock, ticket)

    def _take(self, want_one: bool) -> int:
        taken = 0
        me = self._rank + 1
        for _ in range(3):  # another rank may take the same arena first: look again
            # Only the thread that looks marks the epoch it looked in, read before its look: a
            # change while it looks is seen by the next slow path (UCM_MOVED).
            epoch = lib.ucm_load64(self._seg.base, lib.UCM_H_ARENA_EPOCH)
            owners, busy = self.owners(), self.busy()
            swaps = 0
            if want_one:
                try:
                    for a in np.flatnonzero((owners == me) & (busy > 0)).tolist():
                        if lib.ucm_arena_release(self._ctx, a) == lib.UCM_OK:
                            owners[a] = 0
                            swaps += 1
                finally:
                    if swaps:
                        announce_ranks_changed(self._seg)  # its loader's rank takes it back
            live = self.live_ranks()
            picks = plan(owners.tolist(), self._rank, live, self._home, busy.tolist(),
                         want_one, swaps)
            lib.ucm_arena_epoch_seen(self._ctx, epoch)
            if not picks:
                break
            lost = freed_taken = 0
            for a, expected in picks:
                r = lib.ucm_arena_take(self._ctx, a, expected)
                if r == lib.UCM_OK:
                    taken += 1
                    owners[a] = me
                    freed_taken += expected == 0
                elif r == lib.UCM_BUSY:
                    lost += 1
                else:
                    return taken  # closed or not attached: nothing to take for
            if freed_taken and int((owners == me).sum()) > shares(live, len(owners)).get(
                    self._rank, 0):
                # Free arenas took us above our share: a rank below its share (one that gave
                # them back, say) looks again and takes its share from our surplus.
                announce_ranks_changed(self._seg)
            if not lost or (want_one and taken):
                break
        return taken


_tickets = itertools.count(1)


def announce_ranks_changed(seg: Segment) -> None:
    """An attach, a close, a recovery, an arena given back: every rank looks at its share at
    its next allocation."""
    lib.ucm_fetch_add64(seg.base, lib.UCM_H_ARENA_EPOCH, 1)
