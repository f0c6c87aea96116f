"""Table: the one decoder of a segment's shared words for readers that look at all of them at once.

``verify``, ``stats()``, the metrics and the ``ucmcache`` command read whole regions of a
segment (every SlotMeta line, every RankDesc) as numpy arrays.  The dtypes they read them with
(HEADER, RANK_DESC, ARENA_DESC, SLOT_META) are built in _layout from the layout tables that
csrc/ucm_core.h declares and the core exports (``ucm_layout_fields``), so the layout is written
once, in C, and no reader retypes a word's position, width or mask.

A copy made here is not an atomic snapshot of a live segment: each word is read once, with no
lock, and a protocol step in flight can show up half done.  That is what these readers accept
(verify is exact only on a quiescent segment); the protocol steps themselves stay in C.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Dict, Iterator, List, Optional, TypedDict

import numpy as np

from .._core import ffi, lib
from .layout import ARENA_DESC, HEADER, RANK_DESC, SLOT_META
from .recovery import rank_alive


# The names every reader of the table reports slot and rank states by.  (A Handle's state is
# another question, answered in _handle: there an Empty slot means the load failed.)
SLOT_STATES: Dict[int, str] = {lib.UCM_EMPTY: "empty", lib.UCM_LOADING: "loading",
                               lib.UCM_READY: "ready", lib.UCM_FAILED: "failed"}
RANK_STATES: Dict[int, str] = {lib.UCM_RANK_FREE: "free",
                               lib.UCM_RANK_INITIALIZING: "initializing",
                               lib.UCM_RANK_READY: "ready", lib.UCM_RANK_STOPPED: "stopped"}

_CLAIMED = np.uint64(lib.UCM_CLAIMED)
_ACC_GEN_MASK = (1 << lib.UCM_ACC_GEN_BITS) - 1
_ACC_VALUE_MASK = (1 << lib.UCM_ACC_VALUE_BITS) - 1
_GEN32 = (1 << 32) - 1      # a slot's generation word holds the header's low 32 bits


# ------------------------------------------------------------------------- reading the regions

def _region(seg, dtype: np.dtype, count: int, offset: int, copy: bool) -> np.ndarray:
    view = np.frombuffer(seg.mm, dtype=dtype, count=count, offset=offset)
    return view.copy() if copy else view


def header_row(seg) -> np.void:
    """A copy of the header's words, by HEADER's field names."""
    return _region(seg, HEADER, 1, 0, True)[0]


def rank_table(seg, *, copy: bool = True) -> np.ndarray:
    """Every rank's descriptor (max_ranks rows of RANK_DESC), a copy unless copy=False."""
    return _region(seg, RANK_DESC, seg.layout.max_ranks, seg.layout.rank_off, copy)


def arena_table(seg, *, copy: bool = True) -> np.ndarray:
    """Every arena's descriptor (n_arenas rows of ARENA_DESC), a copy unless copy=False."""
    return _region(seg, ARENA_DESC, seg.layout.n_arenas, seg.layout.arena_off, copy)


def arena_owners(seg, table: Optional[np.ndarray] = None) -> Dict[int, List[int]]:
    """{rank: the arenas it owns} (-1: free), from an arena_table() copy if one is at hand."""
    table = arena_table(seg) if table is None else table
    out: Dict[int, List[int]] = {}
    for a, owner in enumerate(table["owner"].tolist()):
        out.setdefault(owner - 1, []).append(a)
    return out


def slot_table(seg, *, copy: bool = True) -> np.ndarray:
    """Every slot's SlotMeta (n_slots rows of SLOT_META), a copy unless copy=False."""
    return _region(seg, SLOT_META, seg.layout.n_slots, seg.layout.meta_off, copy)


def bucket_heads(seg) -> np.ndarray:
    """A copy of every bucket's chain head (a slot, or UCM_NIL)."""
    return _region(seg, np.dtype("<u4"), seg.layout.n_buckets, seg.layout.bucket_off, True)


# ------------------------------------------------------------------------- decoding the words

def slot_fields(slots: np.ndarray) -> Dict[str, np.ndarray]:
    """A slot table's fields by name, the state word reduced to the state (no waiters bit)."""
    out = {name: slots[name] for name in SLOT_META.fields or {} if name != "key"}
    out["state"] = slots["state"] & np.uint32(lib.UCM_STATE_MASK)
    return out


def claimed(reference: np.ndarray) -> np.ndarray:
    """Which references are claims (UCM_CLAIMED | rank) rather than pin bits."""
    return (reference & _CLAIMED) != 0


def claimant(reference: np.ndarray) -> np.ndarray:
    """The claiming rank of each reference (meaningful where claimed())."""
    return reference & ~_CLAIMED


def pin_bits(reference: np.ndarray) -> np.ndarray:
    """Each slot's pin bits (bit r: rank r pins it); 0 for a claimed slot."""
    return np.where(claimed(reference), np.uint64(0), reference)


def pinning_ranks(bits: int) -> List[int]:
    """The ranks whose bits are set in one slot's pin bits."""
    return [r for r in range(lib.UCM_MAX_RANKS) if bits >> r & 1]


def current(fields: Dict[str, np.ndarray], generation: int) -> np.ndarray:
    """Which slots belong to `generation` (the header's; slots keep its low 32 bits)."""
    return fields["generation"] == (generation & _GEN32)


def acc_value(word: int, generation: int) -> int:
    """One accounting word's value, or 0 if it was written in another generation."""
    if word >> lib.UCM_ACC_VALUE_BITS != generation & _ACC_GEN_MASK:
        return 0
    return word & _ACC_VALUE_MASK


def state_counts(state: np.ndarray) -> Dict[str, int]:
    """How many slots are in each state, by SLOT_STATES' names."""
    return {name: int((state == v).sum()) for v, name in SLOT_STATES.items()}


def rank_state_name(state: int) -> str:
    return RANK_STATES.get(state, f"unknown({state})")


# ------------------------------------------------------------------------- rank rows

class RankRow(TypedDict):
    rank: int
    state: str      # a RANK_STATES name
    pid: int
    alive: bool
    dead: bool      # not free and not alive: the rank needs recovery


def rank_rows(seg, alive: Optional[Callable[[int], bool]] = None,
              table: Optional[np.ndarray] = None) -> List[RankRow]:
    """One row per rank: {rank, state (a name), pid, alive, dead}.

    `alive(r)` says whether rank r's process lives (default: its life lock is held by another
    open file description; a cache passes its own rank as alive).  `dead` is "not free and not
    alive": the rank needs recovery.  `table` is a rank_table() copy to read, if one is at hand.
    """
    if alive is None:
        def alive(r: int) -> bool:
            return rank_alive(seg, r)
    table = rank_table(seg) if table is None else table
    rows: List[RankRow] = []
    for r in range(seg.layout.max_ranks):
        state = int(table[r]["state"])
        up = bool(alive(r))
        rows.append({"rank": r, "state": rank_state_name(state), "pid": int(table[r]["pid"]),
                     "alive": up, "dead": state != lib.UCM_RANK_FREE and not up})
    return rows


# ------------------------------------------------------------------------- exact accounting

@contextmanager
def reader_context(seg) -> Iterator[object]:
    """A process-local C context on a segment with no rank (as SlotCache builds one), for the
    C core's readers (ucm_generation, ucm_acc_value) and for recovery by a process without one."""
    ctx = lib.ucm_ctx_new(seg.base, seg.layout.total_size, seg.layout.to_c())
    if ctx == ffi.NULL:
        raise MemoryError("could not allocate a cache context")
    try:
        yield ctx
    finally:
        lib.ucm_ctx_free(ctx)


def accounting(seg) -> Dict[str, int]:
    """The generation and the exact entries and payload bytes of it, as the cache counts them."""
    with reader_context(seg) as ctx:
        return {"generation": int(lib.ucm_generation(ctx)),
                "entries": int(lib.ucm_acc_value(ctx, lib.UCM_A_ACC_ENTRIES)),
                "size_bytes": int(lib.ucm_acc_value(ctx, lib.UCM_A_ACC_BYTES))}
