"""The lease protocol: tier 2 as one SlotCache uses it (DESIGN 4.10; the ``BoundTier`` of
ucmcache.core.tier).

``lookup`` answers a cache's owned cold keys: round trip 1 reads the values; for the rest,
round trip 2 takes a lease for each (``SET lease token NX PX ttl``, in the same round trip as a
second read of the value, so a value written between the two reads is never recomputed).  A
taken lease is kept here (slot -> ``Lease``) until the owner publishes (``write_through``:
queued on the client's writer, which also drops the lease and announces the key) or closes
unpublished (``abandon``: compare-and-delete, queued).  A lease held elsewhere is waited for
(woken by the announcement, polling with backoff, bounded by the lease, the get's timeout and
``2 * lease_ttl``), unless the caller owns other unpublished slots (it loads: waiting could close
a cycle).  Leases are taken in one global order (the Redis key) and, past the first one held
elsewhere, dropped before any wait, so no two batches wait on each other.

Each owner that consulted tier 2 ends in exactly one of ``t2_hits``, ``t2_misses`` (it loads)
or ``t2_bypasses`` (a fault or an open breaker); ``t2_bad_values`` and ``t2_lease_waits`` count
events on the way, ``t2_writes`` the write-throughs queued.
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

from ...core import hooks as _hooks
from ..._core import lib
from ...core.tier import BoundTier, Owned
from ..breaker import Bypass
from .codec import HEADER_SIZE, decode, lease_token

log = logging.getLogger("ucmcache.tier2")

POLL_MIN = 0.002        # first re-check of a value another node is computing (seconds)
POLL_MAX = 0.1          # longest gap between re-checks (the pub/sub wake-up usually comes first)


class Lease(NamedTuple):
    vkey: bytes
    lkey: bytes
    token: Optional[bytes]  # None: we load without a lease (bypass, or we may not wait)


class Leases(BoundTier):
    """A RedisTier (ucmcache.tier2.client) as one SlotCache uses it: the leases its owners hold
    (``pending``: slot -> Lease) until they publish or close.  The round trips are the tier's."""

    def __init__(self, tier: Any, count: Callable[[int, int], None], slot_size: int):
        self.tier = tier
        self._count = count
        self._limit = slot_size
        self.pending: Dict[int, Lease] = {}

    # ---------------------------------------------------------------- what SlotCache calls

    def lookup(self, owned: Sequence[Owned], may_wait: bool,
               timeout: Optional[float]) -> List[Optional[memoryview]]:
        """For each owned (slot, block_id, offset): the payload tier 2 has (to publish), or
        None (the caller loads; a lease, if we took one, is in self.pending)."""
        try:
            out = self._resolve(owned, may_wait, timeout)
        except Exception:
            # A bug of ours must not fail a get: log it, load as if tier 2 were absent.
            log.exception("ucmcache tier 2 %s: unexpected error; bypassing", self.tier.label)
            for slot, _, _ in owned:
                self.pending.pop(slot, None)
            self._count(lib.UCM_ST_T2_BYPASSES, len(owned))
            return [None] * len(owned)
        self._count(lib.UCM_ST_T2_HITS, sum(p is not None for p in out))
        return out

    def exist_prefix(self, keys: Sequence[Tuple[bytes, int]]) -> int:
        """How many leading keys tier 2 holds, one pipelined round trip (0 when bypassed)."""
        vkeys = [self.tier._keys(b, o)[0] for b, o in keys]
        try:
            found = self.tier._exists(vkeys)
        except Bypass:
            self._count(lib.UCM_ST_T2_BYPASSES, 1)
            return 0
        n = 0
        for f in found:
            if not f:
                break
            n += 1
        return n

    def write_through(self, slot: int, payload: memoryview) -> None:
        """The owner published slot Ready: write it through (the copy is taken here, while the
        slot is pinned; the rest happens on the writer thread)."""
        lease = self.pending.pop(slot, None)
        if lease is None:
            return
        buf = bytearray(HEADER_SIZE + payload.nbytes)
        buf[HEADER_SIZE:] = payload
        if self.tier._put(lease, buf):
            self._count(lib.UCM_ST_T2_WRITES, 1)

    def abandon(self, slot: int) -> None:
        """The owner's handle closes without having published Ready: drop our lease now, so
        another node takes over without waiting for it to expire."""
        lease = self.pending.pop(slot, None)
        if lease is not None:
            self.tier._release(lease.lkey, lease.token)

    def close(self) -> None:
        for slot in list(self.pending):
            self.abandon(slot)
        self.tier.flush(2.0)

    # ---------------------------------------------------------------- the protocol

    def _resolve(self, owned: Sequence[Owned], may_wait: bool,
                 timeout: Optional[float]) -> List[Optional[memoryview]]:
        tier = self.tier
        keys = [tier._keys(b, o) for _, b, o in owned]
        for slot, _, _ in owned:
            self.pending.pop(slot, None)
        run = _Lookup(self, owned, keys)
        # Round trip 1: the values.
        try:
            blobs = tier._get_all([k[0] for k in keys])
        except Bypass:
            return run.bypass(range(len(owned)))
        rest = [i for i, blob in enumerate(blobs) if not run.found(i, blob)]
        if rest:
            self._take_leases(run, rest, may_wait, timeout)
        return run.out

    def _take_leases(self, run: "_Lookup", rest: List[int], may_wait: bool,
                     timeout: Optional[float]) -> None:
        """Round trip 2 (and more only after waits): leases, in one global order."""
        tier = self.tier
        keys = run.keys
        rest.sort(key=lambda i: keys[i][0])
        start = tier._clock()
        deadline = start + 2 * tier.lease_ttl
        if timeout is not None:
            deadline = min(deadline, start + timeout)
        while rest:
            tokens = {i: lease_token() for i in rest}
            try:
                got = tier._acquire([(keys[i][0], keys[i][1], tokens[i]) for i in rest])
            except Bypass:
                run.bypass(rest)
                return
            held: Optional[int] = None
            retry: List[int] = []
            drops: List[bytes] = []
            for i, (ok, blob) in zip(rest, got):
                if run.found(i, blob):
                    if ok:  # the value arrived between our two reads: the lease is not needed
                        tier._release(keys[i][1], tokens[i])
                elif ok and (held is None or not may_wait):
                    run.load(i, tokens[i], lib.UCM_ST_T2_MISSES)  # we compute it for all nodes
                elif ok:
                    # Past the first lease held elsewhere: hold none while we wait (drop what
                    # we just took, in the wait's first round trip), take them again after.
                    drops.append(keys[i][1])
                    retry.append(i)
                else:
                    if held is None:
                        held = i
                    retry.append(i)
            if held is None:
                return
            if not may_wait:
                # This caller owns other unpublished slots: waiting could close a cycle, so it
                # loads what another node is loading too.
                for i in retry:
                    run.load(i, None, lib.UCM_ST_T2_MISSES)
                return
            self._count(lib.UCM_ST_T2_LEASE_WAITS, 1)
            r = self._wait(keys[held], drops, deadline, lambda: run.count_bad(held))
            if r == "bypass":
                run.bypass(retry)
                return
            if r == "timeout":
                for i in retry:
                    run.load(i, None, lib.UCM_ST_T2_MISSES)
                return
            if isinstance(r, memoryview):
                run.out[held] = r
                retry.remove(held)
            rest = retry  # "free": the lease is gone (failed or expired holder): try again

    def _wait(self, key: Tuple[bytes, bytes], drops: List[bytes], deadline: float,
              count_bad: Callable[[], None]) -> Any:
        """Wait for another node's value: the payload, 'free' (no lease any more),
        'timeout' or 'bypass'."""
        tier = self.tier
        vkey, lkey = key
        ev = tier._watch(vkey)
        first = True
        try:
            delay = POLL_MIN
            while True:
                try:
                    blob, pttl = tier._poll(vkey, lkey, drops)
                except Bypass:
                    return "bypass"
                drops = []
                if first:
                    first = False
                    if _hooks._armed:  # watching, and holding no lease of ours
                        _hooks.fire("lease_wait")
                if blob is not None:
                    p = decode(vkey, blob, self._limit)
                    if p is not None:
                        return p
                    count_bad()
                if pttl == -2:
                    return "free"
                now = tier._clock()
                if now >= deadline or pttl == -1:  # -1: a lease without expiry is not ours
                    return "timeout"
                ev.wait(max(0.0, min(delay, pttl / 1000.0 + 0.001, deadline - now)))
                ev.clear()
                delay = min(delay * 2, POLL_MAX)
        finally:
            tier._unwatch(vkey, ev)


class _Lookup:
    """One lookup's answers (``out``, by position) and the bookkeeping of its positions."""

    def __init__(self, leases: Leases, owned: Sequence[Owned], keys: List[Tuple[bytes, bytes]]):
        self.leases = leases
        self.owned = owned
        self.keys = keys
        self.out: List[Optional[memoryview]] = [None] * len(owned)
        self.bad: set = set()  # positions whose bad value is counted already (once per get)

    def found(self, i: int, blob: Any) -> bool:
        """Position i read blob: True (and out[i] set) when it is a valid value."""
        if blob is None:
            return False
        p = decode(self.keys[i][0], blob, self.leases._limit)
        if p is None:
            self.count_bad(i)
            return False
        self.out[i] = p
        return True

    def count_bad(self, i: int) -> None:
        if i not in self.bad:
            self.bad.add(i)
            self.leases._count(lib.UCM_ST_T2_BAD_VALUES, 1)

    def load(self, i: int, token: Optional[bytes], counter: int) -> None:
        """The caller loads position i (holding the lease token, or none)."""
        v, l = self.keys[i]
        self.leases.pending[self.owned[i][0]] = Lease(v, l, token)
        self.leases._count(counter, 1)

    def bypass(self, positions: Any) -> List[Optional[memoryview]]:
        for i in positions:
            self.load(i, None, lib.UCM_ST_T2_BYPASSES)
        return self.out
