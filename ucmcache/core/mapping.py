"""What users of py-lmdb, diskcache or Redis reach for first, on top of the cache's own calls:
``put`` (a value without a loader), the mapping methods (``key in cache``, ``len(cache)``,
``cache[key]``, ``del cache[key]``) and ``memoize``.  A mixin of SlotCache: it uses only the cache's public calls
(get, exist, entry_count, get_or_load, delete) and ``_hit_bytes``, and holds no protocol rule: single
flight, pins and publication are get's, unchanged.
"""
from __future__ import annotations

import functools
import pickle
from typing import TYPE_CHECKING, Any, Callable, Optional, TypeVar

from .errors import LoadFailed
from .function_key import FunctionKey
from .keys import Key, make_key
from .slots import as_value_view, check_timeout

F = TypeVar("F", bound=Callable[..., Any])

# A memoized value too large for a slot: the owner's load is failed with this message, its
# caller gets the value it computed, and a waiter that reads this message computes its own.
_TOO_LARGE = "memoize: the pickled value is larger than a slot; not cached"


class _TooLarge(Exception):
    def __init__(self, value: Any):
        super().__init__(_TOO_LARGE)
        self.value = value


if TYPE_CHECKING:
    from .cache_core import CacheCore
else:
    CacheCore = object  # the seam is for the type checker only


class Mapping(CacheCore):
    """SlotCache's conveniences (see the module docs).  A mixin; no state of its own."""

    def put(self, key: Key, data: Any, *, timeout: Optional[float] = None) -> bool:
        """Publish ``data`` (bytes-like, at most slot_size bytes) under ``key`` without a
        loader.  True if this call stored it; False, without waiting, if the key is Ready
        already or another caller (any process) is loading it: single flight holds, the
        other load wins.  ``data`` is checked before any shared word changes.  Raises
        CacheFull when no slot can be had, as get does.

        Under a DiskTier the value is the caller's: the disk is not read for it, the key's
        older block there is removed before the value is published (OSError, TimeoutError past
        the tier's timeout, when it cannot be: nothing is stored) and the value is written
        through over it, so no older block of the key is served after a put that returned
        True.  Under a RedisTier a value Redis holds wins, as over a load (False)."""
        value = as_value_view(data, self.slot_size)  # TypeError/ValueError before anything
        with (self.get(key, timeout=timeout) if self._tier is None else
              self._get_full(key, timeout=timeout, put=True)) as h:
            if not h.owner:
                return False
            n = value.nbytes
            h.data[:n] = value
            h.ready(n)
            return True

    def __contains__(self, key: Key) -> bool:
        """``key in cache``: Ready now (exist: no pin, no count, no CLOCK touch)."""
        return self.exist([key])[0]

    def __len__(self) -> int:
        """``len(cache)``: the Ready entries of the current generation, every process's."""
        return self.entry_count()

    def __bool__(self) -> bool:
        return True  # an empty cache is still a cache (len() must not make it falsy)

    __iter__ = None  # keys are hashes: there is nothing to iterate (and no sequence protocol)

    def __getitem__(self, key: Key) -> bytes:
        """``cache[key]``: a Ready entry's bytes (a copy), or KeyError.  Never waits for a
        load in progress and never loads."""
        value = self._hit_bytes(key)
        if value is None:
            raise KeyError(key)
        return value

    def __delitem__(self, key: Key) -> None:
        """``del cache[key]``: delete()'s, or KeyError when it deleted nothing (no entry, or
        the key is being loaded: a load in flight is not cut short)."""
        if not self.delete(key):
            raise KeyError(key)

    def memoize(self, namespace: str, *, timeout: Optional[float] = None) -> Callable[[F], F]:
        """A decorator caching a function's results in this segment, shared by every process
        attached to it, with single flight across them: while one call computes a result for
        some arguments, the others wait for it (``timeout``, as get_or_load's).

        The key is ``make_key`` over the pickled ``(module.qualname, the function's digest,
        args, kwargs)`` under ``namespace``.  The digest (ucmcache/_function_key.py) covers
        the function's code, its defaults and its closure cells as pickled values, so closures
        of one factory, the lambdas of one module and a function redefined under its old name
        never share entries; a function whose defaults or cells cannot be pickled is refused
        (TypeError), as is a callable that is not a plain or builtin function.  What the
        function reads from module globals is not in the key: name in ``namespace`` what
        changes its meaning (its version, a model id, the helpers it calls).  The arguments
        must pickle the same way in every process (no sets of str, whose order follows the
        hash seed); the result is pickled.  An exception of the function reaches its caller,
        and callers waiting for that call get LoadFailed with its message (the next call
        computes again: no negative caching).  A result whose pickle is larger than slot_size
        is returned uncached: the callers waiting for it each compute their own (their single
        flight is lost, never their answer)."""
        if not isinstance(namespace, str) or not namespace:
            raise ValueError("memoize needs a non-empty namespace string (what changes the "
                             "function's meaning: its version, a model id)")
        timeout = check_timeout(timeout)  # refused when decorating, not at the first call

        def decorate(fn: F) -> F:
            function_key = FunctionKey(fn)  # TypeError now for what it cannot tell apart
            name = function_key.name

            @functools.wraps(fn)
            def memoized(*args: Any, **kwargs: Any) -> Any:
                digest = function_key.digest()  # taken again if a cell was rebound
                try:
                    blob = pickle.dumps((name, digest, args, sorted(kwargs.items())),
                                        protocol=4)
                except Exception as e:
                    raise TypeError(f"memoize: the arguments of {name} cannot be pickled "
                                    f"({e}); only picklable arguments make a key") from None
                key = make_key(blob, namespace)

                def load() -> bytes:
                    value = fn(*args, **kwargs)
                    out = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
                    if len(out) > self.slot_size:
                        raise _TooLarge(value)
                    return out

                try:
                    return pickle.loads(self.get_or_load(key, load, timeout=timeout))
                except _TooLarge as big:
                    return big.value
                except LoadFailed as e:
                    if _TOO_LARGE not in str(e):
                        raise
                    return fn(*args, **kwargs)

            memoized.cache = self  # type: ignore[attr-defined]
            # Another memoized function's key reads this one as its namespace and function (a
            # closure capturing it is keyed by what it computes, not by this cache object).
            memoized._ucm_memoized = (namespace, fn)  # type: ignore[attr-defined]
            return memoized  # type: ignore[return-value]

        return decorate
