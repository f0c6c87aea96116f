"""Layout: every offset and size of a segment, derived from its params by the C core.

The formula lives once, in ``ucm_layout_compute`` (csrc/ucm_core.c); this module turns its answer
into a Python object and its error codes into messages.  The words of each fixed-size table
(header, RankDesc, ArenaDesc, SlotMeta, PrefetchRing) are declared once too, in ucm_core.h's layout tables;
``ucm_layout_fields()`` hands their rows to this module, which makes of them the numpy dtypes
every whole-table reader uses (HEADER, RANK_DESC, ARENA_DESC, SLOT_META, RING).  The fields of
``Layout`` are those of the C struct ``ucm_layout``, read from cffi.
"""
from __future__ import annotations

from dataclasses import make_dataclass
from typing import TYPE_CHECKING, Dict, List, Optional, Tuple, Type, TypeVar

import numpy as np

from .._core import ffi, lib

DEFAULT_STRIPES = 64

_PARAM_ERRORS = {
    lib.UCM_EP_MAX_RANKS: ("max_ranks", f"an int in [1, {lib.UCM_MAX_RANKS}]"),
    lib.UCM_EP_SLOTS_PER_RANK: ("slots_per_rank",
                                f"an int >= 1 with max_ranks * slots_per_rank < {lib.UCM_MAX_SLOTS}"),
    lib.UCM_EP_SLOT_SIZE: ("slot_size", f"an int in [1, {lib.UCM_MAX_SLOT_SIZE}]"),
    lib.UCM_EP_N_BUCKETS: ("n_buckets", f"a power of two <= {lib.UCM_MAX_BUCKETS} (or None)"),
    lib.UCM_EP_N_STRIPES: ("n_stripes", f"a power of two <= {lib.UCM_MAX_STRIPES}"),
    lib.UCM_EP_TOO_LARGE: ("slots_per_rank * slot_size", "a segment size that fits in 64 bits"),
}


class LayoutError(ValueError):
    """A parameter is out of range; .field names it."""

    def __init__(self, field: str, value: object, expected: str):
        super().__init__(f"{field} must be {expected}, got {value!r}")
        self.field = field


def _table_dtypes() -> Dict[str, np.dtype]:
    """One dtype per layout table of ucm_core.h, by its name ("header", "rank", "arena",
    "slot_meta", "ring"); a field's name is its row's NAME in lower case."""
    n = ffi.new("uint32_t *")
    rows = lib.ucm_layout_fields(n)
    fields: Dict[str, List[Tuple[str, object, int]]] = {}
    sizes: Dict[str, int] = {}
    for i in range(n[0]):
        row = rows[i]
        table = ffi.string(row.table).decode()
        sizes[table] = row.table_size
        item = f"<u{row.item_size}"
        fields.setdefault(table, []).append(
            (ffi.string(row.name).decode().lower(),
             item if row.count == 1 else (item, (row.count,)), row.offset))
    out = {}
    for table, rows_of in fields.items():
        names, formats, offsets = zip(*rows_of)
        out[table] = np.dtype({"names": list(names), "formats": list(formats),
                               "offsets": list(offsets), "itemsize": sizes[table]})
    return out


_DTYPES = _table_dtypes()
HEADER: np.dtype = _DTYPES["header"]          # the header's words (UCM_HEADER_TABLE)
RANK_DESC: np.dtype = _DTYPES["rank"]         # one RankDesc (UCM_RANK_TABLE)
ARENA_DESC: np.dtype = _DTYPES["arena"]       # one ArenaDesc (UCM_ARENA_TABLE)
SLOT_META: np.dtype = _DTYPES["slot_meta"]    # one SlotMeta line (UCM_SLOT_META_TABLE)
RING: np.dtype = _DTYPES["ring"]              # one PrefetchRing (UCM_RING_TABLE)

_L = TypeVar("_L", bound="_LayoutOps")


class _LayoutOps:
    """What a Layout does; its fields (ints, those of the C struct ucm_layout) are added by
    make_dataclass below, so they are named once, in ucm_core.h."""

    if TYPE_CHECKING:
        def __getattr__(self, name: str) -> int: ...

    @classmethod
    def compute(cls: Type[_L], *, max_ranks: int, slots_per_rank: int, slot_size: int,
                n_buckets: Optional[int] = None, n_stripes: int = DEFAULT_STRIPES) -> _L:
        values = dict(max_ranks=max_ranks, slots_per_rank=slots_per_rank, slot_size=slot_size,
                      n_buckets=0 if n_buckets is None else n_buckets, n_stripes=n_stripes)
        for name, v in values.items():
            if isinstance(v, bool) or not isinstance(v, int):
                raise TypeError(f"{name} must be an int, got {type(v).__name__}")
            if v < 0 or v >= 1 << 63:
                code = {"max_ranks": lib.UCM_EP_MAX_RANKS, "slots_per_rank": lib.UCM_EP_SLOTS_PER_RANK,
                        "slot_size": lib.UCM_EP_SLOT_SIZE, "n_buckets": lib.UCM_EP_N_BUCKETS,
                        "n_stripes": lib.UCM_EP_N_STRIPES}[name]
                raise LayoutError(name, v, _PARAM_ERRORS[code][1])
        if n_buckets is not None and n_buckets == 0:
            raise LayoutError("n_buckets", 0, _PARAM_ERRORS[lib.UCM_EP_N_BUCKETS][1])
        if max_ranks > 0xFFFFFFFF or n_stripes > 0xFFFFFFFF:
            code = lib.UCM_EP_MAX_RANKS if max_ranks > 0xFFFFFFFF else lib.UCM_EP_N_STRIPES
            field, expected = _PARAM_ERRORS[code]
            raise LayoutError(field, values[field], expected)
        c = ffi.new("ucm_layout *")
        for name, v in values.items():
            setattr(c, name, v)
        r = lib.ucm_layout_compute(c)
        if r != lib.UCM_OK:
            field, expected = _PARAM_ERRORS[r]
            raise LayoutError(field, values.get(field, (slots_per_rank, slot_size)), expected)
        return cls(**{f: getattr(c, f) for f in _FIELDS})

    def to_c(self):
        c = ffi.new("ucm_layout *")
        for f in _FIELDS:
            setattr(c, f, getattr(self, f))
        return c

    @property
    def control_bytes(self) -> int:
        return self.data_off

    @property
    def data_bytes(self) -> int:
        return self.total_size - self.data_off

    def meta(self, slot: int) -> int:
        return self.meta_off + slot * lib.UCM_META_SIZE

    def rank(self, rank: int) -> int:
        return self.rank_off + rank * lib.UCM_RANK_SIZE

    def arena_range(self, arena: int) -> range:
        return range(arena * self.arena_slots, min((arena + 1) * self.arena_slots, self.n_slots))

    def home_rank(self, arena: int) -> int:
        """The rank whose slot range (rank * slots_per_rank, ...) the arena starts in: with
        every rank attached, each owns the arenas of its own range."""
        return min(arena * self.arena_slots // self.slots_per_rank, self.max_ranks - 1)

    def data(self, slot: int) -> int:
        return self.data_off + slot * self.slot_stride

    def stripe(self, stripe: int) -> int:
        return self.stripe_off + stripe * lib.UCM_LINE


_FIELDS: Tuple[str, ...] = tuple(name for name, _ in ffi.typeof("ucm_layout").fields)

if TYPE_CHECKING:
    class Layout(_LayoutOps):
        def __init__(self, **fields: int) -> None: ...
else:
    Layout = make_dataclass("Layout", [(name, int) for name in _FIELDS], bases=(_LayoutOps,),
                            frozen=True)
    Layout.__module__ = __name__
    Layout.__doc__ = "A segment's layout: the ints of the C struct ucm_layout by name."
