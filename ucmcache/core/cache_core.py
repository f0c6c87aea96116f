"""CacheCore: what the cache's mixins (Batches, Mapping, Prefetching, SingleFlight) and the
prefetcher need from the cache they are part of, so a type checker sees the seam.

SlotCache (_cache) is the one class that provides it, with CacheBase (csrc/ucm_hit.c, typed in
_hit.pyi) for the C-made methods.  The mixins take it as their base only while type checking
(``class Batches(CacheCore)`` there, ``object`` at run time), so nothing here runs.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Coroutine, Iterable, List, Optional, Protocol

if TYPE_CHECKING:
    from .handle import Handle
    from .keys import Key
    from .layout import Layout
    from .recovery import RecoveryReport
    from .segment import Segment
    from .tier import BoundTier


class CacheCore(Protocol):
    _ctx: Any                       # the process-local C context (a cffi pointer); None once closed
    _seg: Segment
    _layout: Layout
    _rank: int
    _tier: Optional[BoundTier]
    _keep: Any                      # ffi.new_handle(seg): keeps the mapping while C holds pins
    _open_handles: int

    @property
    def uuid(self) -> str: ...
    @property
    def rank(self) -> int: ...
    @property
    def slot_size(self) -> int: ...
    @property
    def max_ranks(self) -> int: ...

    def _check_usable(self) -> None: ...
    def _recover(self, wait: float) -> RecoveryReport: ...
    def _claimant_dead(self, ids: bytes, offsets: Any, n: int) -> bool: ...
    def _pin_slow(self, block_id: bytes, offset: int, code: int, timeout: Optional[float],
                  token: Any, slot_out: Any, owner_out: Any, answer: int = 0,
                  since_ns: int = -1) -> int: ...
    def _pin_slow_many(self, ids: bytes, offsets: Any, codes: Any, split: Any,
                       timeout: Optional[float], slots: Any, owner: Any, lens: Any,
                       serials: Any, slots_p: Any, owner_p: Any) -> None: ...
    def _get_full(self, key: Key, *, timeout: Optional[float] = None,
                  put: bool = False) -> Handle: ...
    def _get_missed(self, key: bytes, answer: int = 0, since_ns: int = -1) -> Handle: ...
    def _hit_bytes(self, key: Key, /) -> Optional[bytes]: ...

    def get(self, key: Key, *, timeout: Optional[float] = None) -> Handle: ...
    def get_or_load(self, key: Key, loader: Callable[[], Any], *,
                    timeout: Optional[float] = None) -> bytes: ...
    def aget_or_load(self, key: Key, loader: Callable[[], Any], *,
                     timeout: Optional[float] = None) -> Coroutine[Any, Any, bytes]: ...
    def exist(self, keys: Iterable[Key]) -> List[bool]: ...
    def entry_count(self) -> int: ...
    def delete(self, key: Key, *, timeout: Optional[float] = None) -> bool: ...
