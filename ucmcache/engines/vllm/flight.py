"""Single flight across engines (DESIGN 4.15): a prefix one engine computes is waited for by the
others, not computed again.

The cache's single flight (DESIGN 4.6) elects one owner per cold key across processes, but a
vLLM engine does not ask the cache for a block before computing it: its scheduler asks which
leading blocks are Ready, and computes the rest.  So the scheduler announces what it computes.

**Intents.**  Beside an engine's segment ``<uuid>`` lives a companion segment
``intents_uuid(<uuid>)`` of 64-byte slots.  Each engine's scheduler (a process of its own, with
a rank of its own in it) takes, for each prompt block it is about to compute and save, the
block's intent entry (the block's 16-byte id, offset 0) as its owner: a ``get`` that installs
it Loading, with this rank in the loader word, and whose owner handle the scheduler keeps
across scheduler steps.  The entry is never published Ready; it ends Failed (``fail`` then the
handle's close), which matches nothing (DESIGN 4.1), when:

- its block is Ready in the main segment for every TP x PP rank (``settle``, each step: a
  waiter that then finds no intent finds the block Ready, see below);
- its block was handed to the workers for saving ``MARK_GRACE_S`` ago and is still not Ready
  (the save failed, was skipped, or another engine owns the entry in the main segment);
- its request finished and the workers say its saves are over (``saves_over``, from vLLM's
  ``finished_sending``), Ready or not: this needs no later step of the engine;
- its request ends without saving it: finished, aborted, preempted (``end``).

**Waiting.**  ``lookup`` is the scheduler's lookup.  The first block after the request's Ready
prefix (and after vLLM's own local hit) is its frontier.  Its intent is looked at with one
``get``: absent, it is installed and this engine owns it (one election per block across
engines, the cache's own); Loading by a live other rank, the request waits (``None``: vLLM's
"ask again later" keeps it waiting and schedules others); Loading by a dead rank, the cache's
exact recovery fails the dead rank's entries (DESIGN 5.3) and the look repeats, so a SIGKILLed
engine's marks are gone at the next look.  After taking the frontier the Ready prefix is
counted again: an intent ends only after its block is Ready, so an intent seen absent and a
block then not Ready means that block is computed by nobody.  A request never waits for its
own engine (this scheduler's marks are known here: ``_mine``), waits at most ``peer_wait_s``
without progress (the frontier moving on restarts the clock), then counts what is Ready and
computes the rest for good; it is looked at no more often than every ``PROBE_INTERVAL_S``.
Progress is the marking engine's, not only the request's: a peer computes its prompts one
after another, and a request whose prompt it takes later sees no block of its own Ready until
then.  So a block that any waiting request of this scheduler waited at becoming Ready is
progress of the rank whose mark it waited for (``_progress_at``), and restarts the clock of
every request waiting for that rank; but such borrowed progress keeps a request at one block
``CREDIT_WAITS`` x ``peer_wait_s`` at most in all (a Ready block does not say who saved it:
this engine's own save of a block a stalled peer marks looks the same).  Whatever it computes
it marks (the blocks nobody else marks).

**Pacing.**  While requests wait, vLLM's engine loop steps every millisecond (it has work:
the waiting requests), and on a small host those steps take CPU the engine waited for needs.
A step that scheduled nothing while every request this scheduler tracks waits for a peer (or
while none is left but handed marks to settle) therefore sleeps until the next look is due
(``pace_idle_step``: at most ``PROBE_INTERVAL_S``), so a waiting engine costs a look every few
milliseconds; a request that arrives meanwhile is seen at most that much later.  Not under
data parallelism, whose idle ranks step in lockstep with the others.

Why no intent outlives its engine: an intent is an owner's Loading entry under the scheduler's
rank.  The scheduler ends each one (above) or, closing, all of them; if it dies, its life lock
goes with it and the next look of any waiter (or any attach) recovers the rank, which fails
every Loading entry it loaded.  A live engine that stalls keeps its marks, and is waited for
``peer_wait_s`` at most.
"""
from __future__ import annotations

import hashlib
import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterable, List, Optional, Sequence

from ...core.cache import SlotCache
from ..._core import lib
from ...core.errors import CacheFull, IncompatibleSegment, UcmError
from ...core.handle import Handle
from ...core.keys import Key
from .blocks import VllmConnectorError

log = logging.getLogger("ucmcache.vllm")

INTENT_SLOT_SIZE = 64          # an intent carries no data; a Failed one its reason, cut to this
INTENT_SLOTS_PER_RANK = 4096   # x max_ranks entries: marks of every engine's unsaved blocks
DEFAULT_PEER_WAIT_S = 5.0      # a request waits this long for a live engine without progress
CREDIT_WAITS = 4               # at one block, at most this many peer_wait_s in all (below)
PROBE_INTERVAL_S = 0.005       # a waiting request is looked at no more often than this
MARK_GRACE_S = 5.0             # a block handed for saving and not Ready this long: mark ends
CLAIM_TIMEOUT_S = 1.0          # a get of an intent: the bound on its stripe wait
RECOVER_WAIT_S = 1.0           # the recovery of a dead marker, bounded


INTENTS_SUFFIX = "-intents"     # every intents segment's name ends so; no engine's segment may


def intents_uuid(segment: str) -> str:
    """The companion segment of ``segment``: ``<segment>-intents``, or, when that is longer
    than a uuid may be (64), a shortened name with a digest of the whole."""
    name = f"{segment}{INTENTS_SUFFIX}"
    if len(name) <= 64:
        return name
    digest = hashlib.blake2b(segment.encode("utf-8"), digest_size=6).hexdigest()
    return f"{segment[:64 - len(digest) - 10]}-{digest}{INTENTS_SUFFIX}"


def open_intents(segment: str, max_ranks: int) -> SlotCache:
    """Attach to (or create) the intents segment of ``segment``.  A segment of that name
    whose slots are not intents' (``INTENT_SLOT_SIZE``: another engine's KV segment, say) is
    refused (VllmConnectorError): a mark would take one of its slots, evicting a block."""
    uuid = intents_uuid(segment)
    try:
        c = SlotCache.create(uuid, slots_per_rank=INTENT_SLOTS_PER_RANK,
                             slot_size=INTENT_SLOT_SIZE, max_ranks=max_ranks, exist_ok=True)
    except IncompatibleSegment:  # made with other parameters: another max_ranks is fine
        c = SlotCache.attach(uuid, timeout=10.0)
    if c.slot_size != INTENT_SLOT_SIZE:
        c.close()
        raise VllmConnectorError(
            f"segment {uuid!r} holds slots of {c.slot_size} bytes, not the intents segment of "
            f"{segment!r} ({INTENT_SLOT_SIZE}-byte slots): a segment of another use has its "
            f"name; rename one of them")
    return c


def exist_all_ranks(cache: SlotCache, ids: Sequence[bytes], ranks: int) -> List[bool]:
    """For each block, whether every rank's shard is Ready in the main segment (one exist call
    a rank)."""
    found = [True] * len(ids)
    for r in range(ranks):
        if not ids:
            break
        keys: List[Key] = list(ids) if r == 0 else [(b, r) for b in ids]
        found = [a and b for a, b in zip(found, cache.exist(keys))]
    return found


@dataclass
class _Req:
    """One request's marks and wait, in the scheduler that looks it up."""

    marks: Dict[bytes, Handle] = field(default_factory=dict)   # key -> our owner handle
    handed: Dict[bytes, float] = field(default_factory=dict)   # key -> when handed for saving
    frontier: int = -1           # the block it waits at, -1 while it does not wait
    waiting_on: int = -1         # the rank whose mark it waits for there
    wait_since: float = 0.0      # when it began to wait at that block (or its frontier moved)
    next_look: float = 0.0       # no look before this while it waits
    gave_up: bool = False        # waited peer_wait_s once: computes from then on
    over: bool = False           # the request ended; only marks of blocks handed are left


@dataclass
class FlightStats:
    """What the intents did in this scheduler since it started."""

    marks: int = 0            # intents taken
    ended_ready: int = 0      # intents ended because their block is Ready
    ended_other: int = 0      # intents ended otherwise (request over, grace past)
    waits: int = 0            # lookups answered "ask again later"
    waited_requests: int = 0  # requests that waited at least once
    gave_up: int = 0          # requests that waited peer_wait_s and computed
    recovered: int = 0        # dead markers' intents found and recovered


NONE = "none"   # _claim: not ours, and nobody's to wait for


class Intents:
    """One scheduler's intents in the companion segment ``cache`` (see the module docstring).
    Single-threaded, as vLLM's scheduler is.  ``clock`` is injectable for tests."""

    def __init__(self, cache: SlotCache, *, peer_wait_s: float = DEFAULT_PEER_WAIT_S,
                 clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep):
        if isinstance(peer_wait_s, bool) or not isinstance(peer_wait_s, (int, float)) or \
                not peer_wait_s >= 0:
            raise ValueError(f"peer_wait_s must be a number of seconds >= 0, got {peer_wait_s!r}")
        self.cache = cache
        self.peer_wait_s = float(peer_wait_s)
        self.clock = clock
        self.sleep = sleep
        self.stats = FlightStats()
        self._progress_at: Dict[int, float] = {}   # rank -> a block it marked found Ready
        self._reqs: Dict[str, _Req] = {}
        self._mine: Dict[bytes, str] = {}     # every key this scheduler marks -> its request
        self._full_logged = False

    # ------------------------------------------------------------ the lookup

    def lookup(self, req_id: str, keys: Sequence[bytes],
               ready_prefix: Callable[[Sequence[bytes]], int], *, limit: int, upto: int,
               local: int = 0) -> Optional[int]:
        """The blocks of ``keys[:limit]`` to load (the leading ones Ready for every rank, as
        ``ready_prefix`` counts them), or None: wait, another live engine computes the next
        one.  Before answering a count, marks ``keys[start:upto]`` (the blocks this engine
        will compute and save; ``start`` is past the Ready prefix and vLLM's ``local`` hit)."""
        r = self._reqs.get(req_id)
        if r is None or r.over:   # new, or back after a preemption ended it
            r = self._reqs[req_id] = _Req(marks=r.marks, handed=r.handed) if r else _Req()
        now = self.clock()
        if r.frontier >= 0 and now < r.next_look:
            self.stats.waits += 1
            return None     # looked at less than PROBE_INTERVAL_S ago: still waiting
        n = ready_prefix(keys[:limit])
        if 0 <= r.frontier < n:   # the block it waited at is Ready: its marker progresses
            self._progress_at[r.waiting_on] = now
        for _ in range(4):  # each round a block became Ready under us; bounded all the same
            start = max(n, local)
            if start >= limit or self.peer_wait_s <= 0 or r.gave_up:
                break
            key = keys[start]
            if key in self._mine:
                break       # ours, for this request or another of this engine: never waited for
            got = self._claim(key)
            if isinstance(got, int):   # the live rank that marks it
                return self._wait(req_id, r, start, got, now, n)
            if isinstance(got, Handle):
                self._keep(req_id, r, key, got)
            again = ready_prefix(keys[:limit])
            if again <= n:
                break
            n = again       # it became Ready meanwhile (its marker ended after the publish)
            if isinstance(got, Handle) and again > start:
                self._end_one(r, key, b"ready meanwhile", ready=True)
        if r.frontier >= 0:
            r.frontier = -1
        self._mark(req_id, r, keys[max(n, local):upto])
        return n

    def _wait(self, req_id: str, r: _Req, at: int, marker: int, now: float,
              n: int) -> Optional[int]:
        """Rank ``marker`` (another live engine) marks block ``at``: wait, unless it made no
        progress for peer_wait_s (its blocks this request or another waited at becoming
        Ready; the borrowed kind for CREDIT_WAITS x peer_wait_s at one block at most)."""
        if r.frontier != at or r.waiting_on != marker:
            if r.frontier < 0:
                self.stats.waited_requests += 1
            r.frontier, r.waiting_on, r.wait_since = at, marker, now
        credit = min(self._progress_at.get(marker, float("-inf")),
                     r.wait_since + (CREDIT_WAITS - 1) * self.peer_wait_s)
        quiet = now - max(r.wait_since, credit)
        if quiet < self.peer_wait_s:
            r.next_look = now + PROBE_INTERVAL_S
            self.stats.waits += 1
            return None
        r.gave_up, r.frontier = True, -1
        self.stats.gave_up += 1
        log.warning("UcmCacheConnector: request %s waited %.1f s at block %d (%.1f s with no "
                    "progress of rank %d, which marks it): computing it", req_id,
                    now - r.wait_since, at, quiet, marker)
        return n

    def pace_idle_step(self) -> float:
        """Called for a scheduler step that scheduled nothing while no request of the engine
        runs: sleeps until the earliest look of a waiting request is due (at most
        PROBE_INTERVAL_S; PROBE_INTERVAL_S while only handed marks are left to settle), so
        that the engine's loop does not take CPU its peer needs.  Returns the seconds slept
        (0: nothing waits, or a look is due now)."""
        now = self.clock()
        due = [r.next_look for r in self._reqs.values() if r.frontier >= 0]
        if due:
            pause = min(max(0.0, min(due) - now), PROBE_INTERVAL_S)
        elif self.unsettled():
            pause = PROBE_INTERVAL_S
        else:
            return 0.0
        if pause > 0:
            self.sleep(pause)
        return pause

    def _claim(self, key: bytes):
        """Take ``key``'s intent: our owner Handle, the rank (an int) of the live other engine
        that marks it, or NONE (not ours and nobody's to wait for: a full intents segment, a
        dead marker not yet recovered, an error; the caller computes)."""
        for _ in range(3):
            try:
                h = self.cache.get(key, timeout=CLAIM_TIMEOUT_S)
            except CacheFull:
                self._log_full()
                return NONE
            except UcmError as e:
                log.warning("UcmCacheConnector: intents: %s", e)
                return NONE
            if h.owner:
                return h
            try:
                state = h.state
                if state == "loading":
                    loader = lib.ucm_slot_loader(self.cache._ctx, h.slot)  # under our pin (I3)
                    if loader == self.cache.rank:
                        return NONE   # a mark of ours we do not know: never waited for
                    # A dead loader's rank is recovered here: its Loading entries (this one
                    # among them) become Failed, exactly (DESIGN 5.3).
                    self.cache._recover_loader(h.slot,
                                               lib.ucm_now_ns() + int(RECOVER_WAIT_S * 1e9))
                    state = h.state
                    if state == "loading":
                        return int(loader)
                    self.stats.recovered += 1
            finally:
                h.close()
            # Failed (recovered) or Ready (nobody publishes intents Ready): look again
        return NONE

    def _keep(self, req_id: str, r: _Req, key: bytes, h: Handle) -> None:
        r.marks[key] = h
        self._mine[key] = req_id
        self.stats.marks += 1

    def _mark(self, req_id: str, r: _Req, keys: Sequence[bytes]) -> None:
        """Take the intents of ``keys`` that nobody holds (those another engine holds are left
        to it: its save and ours meet in the main segment's single flight)."""
        for key in keys:
            if key in self._mine:
                continue
            try:
                h = self.cache.get(key, timeout=CLAIM_TIMEOUT_S)
            except CacheFull:
                self._log_full()
                return
            except UcmError as e:
                log.warning("UcmCacheConnector: intents: %s", e)
                return
            if h.owner:
                self._keep(req_id, r, key, h)
            else:
                h.close()

    def _log_full(self) -> None:
        if not self._full_logged:
            self._full_logged = True
            log.warning("UcmCacheConnector: the intents segment %r is full: blocks computed "
                        "now go unmarked (other engines may compute them too)", self.cache.uuid)

    # ------------------------------------------------------------ the end of intents

    def handed(self, req_id: str, keys: Sequence[bytes]) -> None:
        """``keys`` of ``req_id`` were handed to the workers for saving now."""
        r = self._reqs.get(req_id)
        if r is None:
            return
        now = self.clock()
        for key in keys:
            if key in r.marks:
                r.handed.setdefault(key, now)

    def settle(self, ready: Callable[[List[bytes]], List[bool]]) -> None:
        """End the intents whose blocks are Ready now for every rank (``ready``), and those
        handed for saving more than MARK_GRACE_S ago (a save that failed, or went to another
        engine's entry).  One ``ready`` call for every block handed and still marked."""
        keys = [k for r in self._reqs.values() for k in r.handed]
        if not keys:
            return
        found = dict(zip(keys, ready(keys)))
        now = self.clock()
        for req_id, r in list(self._reqs.items()):
            for key, t in list(r.handed.items()):
                if found.get(key):
                    self._end_one(r, key, b"saved", ready=True)
                elif now - t >= MARK_GRACE_S:
                    self._end_one(r, key, b"not saved within the grace")
            if r.over and not r.marks:
                del self._reqs[req_id]

    def saves_over(self, req_ids: Iterable[str],
                   ready: Optional[Callable[[List[bytes]], List[bool]]]) -> None:
        """Every save of the finished requests ``req_ids`` is over, on every worker (vLLM's
        ``finished_sending``): ``settle`` (with ``ready``, when given), then their remaining
        marks end: their blocks are not Ready and nobody saves them now (a save that failed,
        was dropped, or met another engine's entry).  Without this an engine that steps no
        more after its last request kept their marks Loading."""
        if ready is not None:
            self.settle(ready)
        for req_id in req_ids:
            r = self._reqs.pop(req_id, None)
            if r is None:
                continue
            for key in list(r.marks):
                self._end_one(r, key, b"its saves are over, the block not saved")

    def unsettled(self) -> bool:
        """Whether requests that are over still hold marks of blocks handed for saving (ended
        by ``settle`` once Ready, or MARK_GRACE_S after being handed, or by ``saves_over``)."""
        return any(r.over and r.handed for r in self._reqs.values())

    def end(self, req_id: str, why: str = "request ended", *, keep_handed: bool = False) -> None:
        """The request is over (finished, aborted, preempted): its intents end, but with
        ``keep_handed`` those of blocks handed for saving, which ``settle`` ends once they
        are Ready (or the grace is past).  Its wait is forgotten."""
        r = self._reqs.get(req_id)
        if r is None:
            return
        msg = why.encode("utf-8")
        for key in list(r.marks):
            if keep_handed and key in r.handed:
                continue
            self._end_one(r, key, msg)
        if r.marks:
            r.frontier, r.over = -1, True     # only its handed blocks' marks are left
        else:
            del self._reqs[req_id]

    def _end_one(self, r: _Req, key: bytes, msg: bytes, ready: bool = False) -> None:
        h = r.marks.pop(key, None)
        r.handed.pop(key, None)
        self._mine.pop(key, None)
        if h is None:
            return
        try:
            h.fail(msg.decode("utf-8", "replace"))
        except UcmError as e:  # the handle's pin is gone (a closed cache): nothing to end
            log.debug("UcmCacheConnector: intents: ending a mark: %s", e)
        finally:
            h.close()
        if ready:
            self.stats.ended_ready += 1
        else:
            self.stats.ended_other += 1

    def marked(self, req_id: str) -> List[bytes]:
        """The keys ``req_id`` marks now (in the order taken)."""
        r = self._reqs.get(req_id)
        return list(r.marks) if r is not None else []

    def waiting(self, req_id: str) -> bool:
        r = self._reqs.get(req_id)
        return r is not None and r.frontier >= 0

    def close(self) -> None:
        """End every intent and detach.  Idempotent."""
        for req_id in list(self._reqs):
            self.end(req_id, "the engine's scheduler closed")
        try:
            self.cache.close()
        except UcmError as e:
            log.warning("UcmCacheConnector: closing the intents segment: %s", e)
