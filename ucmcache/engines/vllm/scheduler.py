"""UcmCacheConnector's scheduler side (``ucmcache.vllm``; the design: ``connector.py``): which
leading prompt blocks are stored for every rank (``get_num_new_matched_tokens``), what each
step's workers load and save (``build_connector_meta``), the requests whose blocks wait for
their saves, and single flight across engines (the intents, ``flight.py``).  Needs no vLLM: the
connector makes it with the metadata class vLLM's scheduler passes to the workers."""
from __future__ import annotations

import dataclasses
import logging
import multiprocessing.util as _mp_util
import os
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

from ...core.cache import SlotCache
from ...core.errors import CorruptSegment, SegmentNotFound, UcmError
from .. import kit
from ..kit import EngineParts
from .blocks import EngineIdentity, VllmConnectorError, block_keys, exist_prefix_all_ranks
from .flight import Intents, exist_all_ranks, open_intents

log = logging.getLogger("ucmcache.vllm")

ATTACH_RETRY_S = 1.0


@dataclass
class _Job:
    req_id: str
    keys: List[bytes]
    block_ids: List[int]


@dataclass
class _ReqState:
    prompt: List[int]
    salt: Optional[str]
    eligible: bool
    keys: Optional[List[bytes]] = None
    matched_tokens: int = 0     # the last get_num_new_matched_tokens' answer, in tokens
    saved_blocks: int = 0       # leading prompt blocks stored, matched or supplied by
                                # vLLM's own prefix cache: not offered to save again
    had_save: bool = False      # a save job went to the workers: its blocks wait for it


def _scheduled_tokens(scheduler_output: Any) -> int:
    """The tokens a step runs (vLLM's ``total_num_scheduled_tokens``)."""
    total = getattr(scheduler_output, "total_num_scheduled_tokens", None)
    if total is None:
        total = sum(scheduler_output.num_scheduled_tokens.values())
    return int(total)


class ConnectorScheduler:
    """The scheduler side of a UcmCacheConnector (vLLM runs one, in its scheduler's process).
    ``new_meta`` makes one step's metadata for the workers (UcmCacheConnectorMetadata)."""

    def __init__(self, *, cfg: Any, identity: EngineIdentity, segment: str, parts: EngineParts,
                 new_meta: Callable[..., Any], pace: bool = True) -> None:
        """``pace``: idle steps may sleep while every request waits for a peer
        (Intents.pace_idle_step); False under data parallelism, whose ranks step in
        lockstep."""
        self._cfg = cfg
        self._identity = identity
        self._segment = segment
        self._bs = identity.block_size
        self._parts = parts
        self._new_meta = new_meta
        self._kv_cache_manager: Any = None   # vLLM's, bound after the connector is made
        self._reqs: Dict[str, _ReqState] = {}
        self._pending_loads: List[_Job] = []
        self._delayed: Set[str] = set()     # finished, blocks kept: for the next meta
        self._next_attach = 0.0
        self._lookup_failed_logged = False
        self._flight: Optional[Intents] = None      # this scheduler's intents (_intents)
        self._flight_next = 0.0
        self._flight_finalizer: Optional[_mp_util.Finalize] = None
        self._flight_written: Optional[Dict[str, Any]] = None
        self._pace = pace

    def shutdown(self) -> None:
        """The intents end (before the connector detaches from the segment)."""
        if self._flight_finalizer is not None:
            self._flight_finalizer()

    def _reader(self) -> Optional[SlotCache]:
        c = self._parts.cache
        if c is not None:
            return c
        now = time.monotonic()
        if now < self._next_attach:
            return None
        self._next_attach = now + ATTACH_RETRY_S
        try:
            c = SlotCache.attach(self._segment, timeout=0.0)
        except (SegmentNotFound, CorruptSegment, TimeoutError):
            return None  # the workers make it; asked again in a second
        self._parts.cache = c
        return c

    def _state(self, request: Any) -> _ReqState:
        st = self._reqs.get(request.request_id)
        if st is None:
            eligible = (not getattr(request, "mm_features", None)
                        and getattr(request, "prompt_embeds", None) is None
                        and getattr(request, "lora_request", None) is None
                        and request.prompt_token_ids is not None)
            st = _ReqState(prompt=list(request.prompt_token_ids or []),
                           salt=getattr(request, "cache_salt", None), eligible=eligible)
            self._reqs[request.request_id] = st
        return st

    def _keys(self, st: _ReqState) -> List[bytes]:
        if st.keys is None:
            st.keys = block_keys(st.prompt, self._identity, st.salt)
        return st.keys

    def get_num_new_matched_tokens(self, request: Any,
                                   num_computed_tokens: int) -> Tuple[Optional[int], bool]:
        """Tokens beyond num_computed_tokens whose blocks are stored whole for every rank:
        leading full prompt blocks only, never the one holding the last token."""
        st = self._state(request)
        st.matched_tokens = 0
        if not st.eligible:
            return 0, False
        limit = (min(len(st.prompt), int(request.num_tokens)) - 1) // self._bs
        if limit * self._bs <= num_computed_tokens:
            return 0, False
        cache = self._reader()
        if cache is None:
            return 0, False
        try:
            n = self._matched_blocks(request, st, cache, limit, num_computed_tokens)
        except UcmError as e:
            if not self._lookup_failed_logged:
                log.warning("UcmCacheConnector: lookup failed, serving misses: %s", e)
                self._lookup_failed_logged = True
            return 0, False
        if n is None:
            return None, False  # another engine computes the next blocks: ask again later
        st.matched_tokens = n * self._bs
        return max(0, st.matched_tokens - num_computed_tokens), False

    def update_state_after_alloc(self, request: Any, blocks: Any,
                                 num_external_tokens: int) -> None:
        st = self._state(request)
        if num_external_tokens <= 0 or not st.eligible:
            return
        end = st.matched_tokens // self._bs
        start = (st.matched_tokens - num_external_tokens) // self._bs
        ids = list(blocks.get_block_ids()[0])
        if start < 0 or end > len(ids) or end > len(self._keys(st)):
            log.warning("UcmCacheConnector: request %s: %d external tokens do not fit its "
                        "%d blocks; loading nothing", request.request_id,
                        num_external_tokens, len(ids))
            return
        self._pending_loads.append(_Job(request.request_id, self._keys(st)[start:end],
                                        ids[start:end]))
        st.saved_blocks = max(st.saved_blocks, end)

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        self._flight_step(scheduler_output)
        meta = self._new_meta(
            loads=self._pending_loads, delayed=self._delayed,
            preempted=set(getattr(scheduler_output, "preempted_req_ids", None) or ()))
        self._pending_loads = []
        self._delayed = set()
        computed: Dict[str, int] = {}
        starting: Set[str] = set()  # scheduled for the first time, or again after preemption
        for nr in scheduler_output.scheduled_new_reqs:
            computed[nr.req_id] = int(nr.num_computed_tokens)
            starting.add(nr.req_id)
            if nr.req_id not in self._reqs and nr.prompt_token_ids is not None:
                self._reqs[nr.req_id] = _ReqState(prompt=list(nr.prompt_token_ids),
                                                  salt=None, eligible=False)
        cr = scheduler_output.scheduled_cached_reqs
        starting |= set(getattr(cr, "resumed_req_ids", None) or ())
        for i, rid in enumerate(cr.req_ids):
            computed[rid] = int(cr.num_computed_tokens[i])
        for rid in starting:
            st = self._reqs.get(rid)
            if st is not None and rid in computed:
                # what it starts with was supplied, not computed in this step: vLLM's own
                # prefix cache (blocks this engine computed, or loaded, before) and the
                # connector's matched blocks; none is offered to the save path again
                st.saved_blocks = max(st.saved_blocks, computed[rid] // self._bs)
        for rid, ntok in scheduler_output.num_scheduled_tokens.items():
            st = self._reqs.get(rid)
            if st is None or not st.eligible or rid not in computed:
                continue
            full = min(computed[rid] + int(ntok), len(st.prompt)) // self._bs
            if full <= st.saved_blocks:
                continue
            ids = self._block_ids(rid)
            if ids is None or len(ids) < full:
                continue
            keys = self._keys(st)
            meta.saves.append(_Job(rid, keys[st.saved_blocks:full],
                                   ids[st.saved_blocks:full]))
            st.saved_blocks = full
            st.had_save = True
        self._flight_handed(meta)
        f = self._flight
        if f is not None and self._pace and not _scheduled_tokens(scheduler_output) and \
                all(f.waiting(rid) for rid in self._reqs):
            f.pace_idle_step()   # nothing runs, every request waits for a peer: no busy loop
        return meta

    def _block_ids(self, req_id: str) -> Optional[List[int]]:
        mgr = self._kv_cache_manager
        if mgr is None:
            return None
        try:
            return list(mgr.get_block_ids(req_id)[0])
        except Exception:
            return None

    def request_finished(self, request: Any,
                         block_ids: List[int]) -> Tuple[bool, Optional[Dict[str, Any]]]:
        """A request that had saves keeps its blocks until the workers' get_finished names
        it (next step: its saves over, or dropped); any other frees them now."""
        st = self._reqs.pop(request.request_id, None)
        self._flight_end(request.request_id, "request finished")
        if st is None or not st.had_save:
            return False, None
        self._delayed.add(request.request_id)
        return True, None

    def _intents(self) -> Optional[Intents]:
        """This scheduler's intents (flight.py), attached on first use; None
        while the intents segment cannot be opened (asked again in a second)."""
        f = self._flight
        if f is not None:
            return f
        now = time.monotonic()
        if now < self._flight_next:
            return None
        self._flight_next = now + ATTACH_RETRY_S
        try:
            cache = open_intents(self._segment, self._cfg.max_ranks)
        except VllmConnectorError as e:   # a segment of another use has its name: for good
            self._flight_next = float("inf")
            log.error("UcmCacheConnector: %s: no single flight across engines", e)
            return None
        except (UcmError, OSError, ValueError) as e:
            log.warning("UcmCacheConnector: intents segment of %r: %s: no single flight "
                        "across engines for now", self._segment, e)
            return None
        self._flight = f = Intents(cache, peer_wait_s=self._cfg.peer_wait_s)
        self._flight_finalizer = _mp_util.Finalize(self, f.close, exitpriority=11)
        return f

    def _matched_blocks(self, request: Any, st: _ReqState, cache: SlotCache, limit: int,
                        num_computed_tokens: int) -> Optional[int]:
        """The leading prompt blocks Ready for every rank, up to ``limit``; or None while
        another live engine computes the first block after them (DESIGN 4.15)."""
        keys = self._keys(st)
        ranks = self._identity.ranks

        def ready(ks: Sequence[bytes]) -> int:
            return exist_prefix_all_ranks(cache, ks, ranks)

        flight = self._intents()
        if flight is None:
            return ready(keys[:limit])
        return flight.lookup(request.request_id, keys, ready, limit=limit, upto=len(keys),
                             local=num_computed_tokens // self._bs)

    def _flight_ready(self) -> Optional[Callable[[List[bytes]], List[bool]]]:
        cache = self._parts.cache
        if cache is None:
            return None
        ranks = self._identity.ranks
        return lambda ks: exist_all_ranks(cache, ks, ranks)

    def _flight_step(self, scheduler_output: Any) -> None:
        """Each step: the intents of preempted requests end (but for blocks handed for
        saving), and those of blocks now Ready (or handed long ago) end."""
        f = self._flight
        if f is None:
            return
        for rid in getattr(scheduler_output, "preempted_req_ids", None) or ():
            f.end(rid, "request preempted", keep_handed=True)
        self._flight_settle(f)

    def _flight_settle(self, f: Intents) -> None:
        ready = self._flight_ready()
        if ready is not None:
            try:
                f.settle(ready)
            except UcmError as e:
                log.warning("UcmCacheConnector: intents: %s", e)
        self._write_flight_stats(f)

    def _flight_handed(self, meta: Any) -> None:   # a UcmCacheConnectorMetadata
        f = self._flight
        if f is not None:
            for job in meta.saves:
                f.handed(job.req_id, job.keys)

    def _flight_end(self, req_id: str, why: str) -> None:
        f = self._flight
        if f is not None:
            f.end(req_id, why, keep_handed=True)
            self._flight_settle(f)

    def update_connector_output(self, connector_output: Any) -> None:
        """A step's output from the workers (vLLM calls this after each step's output,
        before it frees the blocks of ``finished_sending``): the requests it names have
        every save over on every worker (get_finished waited for them), so their marks
        end now, Ready or not (DESIGN 4.15), whether or not this engine steps again."""
        f = self._flight
        done = getattr(connector_output, "finished_sending", None)
        if f is None or not done:
            return
        try:
            f.saves_over(done, self._flight_ready())
        except UcmError as e:
            log.warning("UcmCacheConnector: intents: %s", e)
        self._write_flight_stats(f)

    def has_pending_push_work(self) -> bool:
        """Keeps the engine stepping while requests that are over hold marks of blocks
        handed for saving: each step's settle ends them (Ready, or MARK_GRACE_S after),
        so an engine never idles with a mark a peer would wait for."""
        f = self._flight
        return f is not None and f.unsettled()

    def _write_flight_stats(self, f: Intents) -> None:
        path = self._cfg.stats_file
        if path is None:
            return
        data = dataclasses.asdict(f.stats)
        if data == self._flight_written:
            return
        self._flight_written = data
        try:
            kit.write_json(f"{path}.scheduler", {**data, "pid": os.getpid()})
        except OSError as e:
            log.warning("UcmCacheConnector: stats_file %s: %s", path, e)

    def reset_cache(self) -> Optional[bool]:
        """Clear the segment (every entry, for every engine attached to it)."""
        cache = self._reader()
        if cache is None:
            return True  # nothing stored yet
        try:
            cache.clear()
        except UcmError as e:
            log.warning("UcmCacheConnector: reset_cache: %s", e)
            return False
        return True
