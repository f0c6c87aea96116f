# Types of ucmcache._hit (csrc/ucm_hit.c): the hit path as CPython types, bases of SlotCache,
# Handle and HandleBatch.  The methods below are the public API of those classes.
from typing import Any, Callable, Coroutine, Dict, Optional, Sequence, Tuple

import numpy as np

from ._handle import Handle, HandleBatch
from ._keys import Key

class CacheBase:
    _open_handles: int
    _data_off: int
    _stride: int
    _ctx: Any
    _ro: Optional[memoryview]
    _tier: Any                # the bound tier beneath the cache, or None (the C miss path skips it)
    _value_max: int           # the longest value a load stores (the slot size)
    _lock_fd: int             # the life locks' fd (a waiter's liveness check in C)
    @property
    def _loads_out(self) -> int: ...  # cold loads in flight through C (close() refuses meanwhile)
    @property
    def _exports(self) -> int: ...
    def _slot_view(self, slot: int, nbytes: int, writable: bool, /) -> memoryview: ...
    def get(self, key: Key, *, timeout: Optional[float] = None) -> Handle: ...
    def get_many(self, keys: Sequence[Key], *,
                 timeout: Optional[float] = None) -> HandleBatch: ...
    def get_or_load(self, key: Key, loader: Callable[[], Any], *,
                    timeout: Optional[float] = None) -> bytes: ...
    def aget_or_load(self, key: Key, loader: Callable[[], Any], *,
                     timeout: Optional[float] = None) -> Coroutine[Any, Any, bytes]: ...
    def read_many(self, keys: Sequence[Key], out: Any) -> np.ndarray: ...
    def _hit_bytes(self, key: Key, /) -> Optional[bytes]: ...
    def _detach(self) -> Any: ...
    def _fork_hold(self, slots: Any, holds: list, /) -> bool: ...
    def _fork_release(self, slots: Any, n: int, /) -> None: ...
    def _forks_out(self) -> int: ...

# The field tables of HandleBase and BatchBase (HANDLE_FIELDS, BATCH_FIELDS in ucm_hit.c), as
# data: type name -> ((Python name, "MEMBER" | "GETSET" | "C"), ...).
FIELDS: Dict[str, Tuple[Tuple[str, str], ...]]

class HandleBase:
    # Its fields (HANDLE_FIELDS in ucm_hit.c: objects the Python layer sets and reads).
    _cache: Any
    _token: Any
    _timeout: Any
    _views: Any
    _owned: Any
    _view: Any
    _t0: Any
    _nbytes: Any
    _slot: Any
    _closed: Any
    _owner: Any
    _published: Any
    _serial: Any
    @property
    def data(self) -> memoryview: ...
    @property
    def owner(self) -> bool: ...
    def wait(self, timeout: Optional[float] = None) -> Handle: ...
    def ready(self, nbytes: Optional[int] = None) -> None: ...
    def close(self) -> None: ...
    def _drop_pins(self, message: bytes, /) -> bool: ...
    def __enter__(self) -> Handle: ...
    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None: ...

class BatchBase:
    # Its fields (BATCH_FIELDS in ucm_hit.c, and the getset _n).
    _cache: Any
    _owner: Any
    _slots_p: Any
    _owner_p: Any
    _token: Any
    _timeout: Any
    _views: Any
    _owner_views: Any
    _owned: Any
    _closed: Any
    _any_owner: Any
    _serials: Any
    _n: int
    _slots: Any
    _lens: Any
    @property
    def owner(self) -> np.ndarray: ...  # a copy
    def data(self, i: int, /) -> memoryview: ...
    def gather(self, out: Any, /) -> np.ndarray: ...
    def close(self) -> None: ...
    def _drop_pins(self, message: bytes, /) -> bool: ...
    def __enter__(self) -> HandleBatch: ...
    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None: ...

class Ready:
    def send(self, arg: Any, /) -> Any: ...
    def throw(self, typ: Any, val: Any = ..., tb: Any = ..., /) -> Any: ...
    def close(self) -> None: ...
    def __await__(self) -> Any: ...

class SlotBuffer:
    """The exporter behind a slot's views: holds the slot pinned while any view of it lives."""

def row_size(nbytes: int, ndim: int, rows: int, n: int, /) -> int: ...
def buffer_row(out: Any, n: int, /) -> int: ...

def bind(*, steps: dict, addr_of: Callable[[Any], int], handle_type: type, batch_type: type,
         new_lengths: Callable[[int], np.ndarray], new_slots: Callable[[int], np.ndarray],
         new_owner: Callable[[int], np.ndarray], no_owned: Any, unpublished: bytes,
         token_drop: Callable[..., None], batch_token_drop: Callable[..., None]) -> None: ...
def bind_loads(steps: dict, owning: Any, owned_slots: Callable[[Any], set],
               owns_load: Callable[[Any, int], bool], as_value_view: Callable[..., Any],
               hooks_armed: dict, hooks_fire: Callable[..., Any], slow_spin: int,
               max_rollbacks: int, stripe_wait: float, liveness_ns: int,
               life_byte0: int) -> None: ...
