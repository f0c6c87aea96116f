"""The engine kit: what every engine integration does with a segment, written once.

An engine integration (``ucmcache.vllm``'s connector, ``ucmcache.ucm``'s store, and the next
one: an SGLang HiCache storage backend would take the same pieces) needs, around its own
protocol with the engine:

- a **name** for the segment when its config gives none (``default_segment``: one segment per
  engine kind, model identity and user, stable across restarts) and a valid uuid for a name it
  is given (``segment_name``);
- a **size** for a segment it creates: what the config asks for, clamped to ``SHM_CLAMP_SHARE``
  of what /dev/shm has free and of MemAvailable (``new_segment_slots_per_rank``), with a log
  line; an existing segment is attached whatever its size;
- **opening** it: attach, else create, else attach what another process made meanwhile
  (``open_segment``);
- a **finalizer** that lets go of the engine object's threads, host registration and cache
  when the object is collected or the process exits (``EngineParts``: engines never call
  close(); multiprocessing's Finalize, which also runs in a process multiprocessing forked and
  that ends with os._exit);
- **host-memory registration** of the mapping for device copies (``HostRegistration``:
  cudaHostRegister, a refusal logged, unregistered before the cache closes);
- **stats files** written whole (``write_json``);
- **config checking** with messages that name the key, what was given and what is expected
  (``check_int``, ``check_number``, ``check_bool``, ``check_choice``, ``check_known``).

Nothing here touches a shared word: it calls SlotCache's public methods only.
"""
from __future__ import annotations

import hashlib
import json
import logging
import multiprocessing.util as _mp_util
import os
import re
from typing import Any, Callable, Dict, Iterable, Optional, Sequence, Type, overload

import numpy as np

from ..core.cache import SlotCache
from .._core import ffi
from ..core.errors import (CorruptSegment, IncompatibleSegment, NotAttached, SegmentNotFound,
                       SharedMemoryFull, UcmError)

__all__ = ["DEFAULT_MAX_RANKS", "SHM_CLAMP_SHARE", "SHM_DIR", "default_segment", "segment_name",
           "shm_free_bytes", "mem_available_bytes", "new_segment_slots_per_rank",
           "open_segment", "EngineParts", "HostRegistration", "check_int", "check_number",
           "check_bool", "check_choice", "check_known", "write_json"]

log = logging.getLogger("ucmcache.engines")

# Ranks of a segment an engine creates.  One value for every engine: each process attached at
# once takes one (a vLLM engine: one per worker and one for its scheduler; UCM: one per worker
# store and one per scheduler-side store), and a TP-8 engine with its scheduler already needs
# 9.  A rank costs its descriptor and prefetch ring (about 100 KB of control region), not
# capacity: a segment's slots are split among its ranks' arenas, whatever their number.  An
# existing segment is attached with the ranks its maker chose, 8 or 16 alike.
DEFAULT_MAX_RANKS = 16
# A size /dev/shm (or the RAM there is) cannot hold is clamped to this share of what is free,
# not all of it: the engine's own IPC buffers, other engines' segments and whatever else uses
# the tmpfs need room too, and a full tmpfs fails their next allocation with SIGBUS rather
# than an error.
SHM_CLAMP_SHARE = 0.5
SHM_DIR = "/dev/shm"
LINE = 64   # a slot's stride is its size rounded up to this; its SlotMeta line is as long

_SEGMENT_RE = re.compile(r"[A-Za-z0-9_-]{1,64}")


# ---------------------------------------------------------------- naming

def segment_name(name: str) -> str:
    """The segment uuid for a name: itself when it is a valid uuid ([A-Za-z0-9_-], at most
    64), else a readable prefix plus a hash of the whole name (deterministic, so every process
    that passes the same name names the same segment)."""
    s = str(name)
    if _SEGMENT_RE.fullmatch(s):
        return s
    digest = hashlib.blake2b(s.encode("utf-8"), digest_size=8).hexdigest()
    return re.sub(r"[^A-Za-z0-9_-]", "_", s)[:40] + "-" + digest


def default_segment(engine: str, *, identity: Optional[str] = None,
                    label: Optional[str] = None) -> str:
    """The segment of an engine whose config names none: one per engine kind, identity and
    user, the same in every process and across restarts (an engine's own ids often are not:
    UCM's unique_id is a new uuid4 at every start).  ``identity``: a string naming what the
    stored bytes mean (model, layout...), digested: ``<engine>-<digest>-u<uid>``; ``label``: a
    short readable one instead: ``<engine>-<label>-u<uid>`` (made a valid uuid)."""
    if (identity is None) == (label is None):
        raise TypeError("default_segment takes exactly one of identity and label")
    if identity is not None:
        digest = hashlib.blake2b(identity.encode("utf-8"), digest_size=6).hexdigest()
        return f"{engine}-{digest}-u{os.getuid()}"
    return segment_name(f"{engine}-{label}-u{os.getuid()}")


# ---------------------------------------------------------------- sizing

def shm_free_bytes() -> int:
    """Bytes free in /dev/shm now (a module function so that tests can give a smaller one)."""
    st = os.statvfs(SHM_DIR)
    return st.f_bavail * st.f_frsize


def mem_available_bytes() -> Optional[int]:
    """The kernel's MemAvailable (/proc/meminfo): memory that can be had without swapping;
    None where it cannot be read (not Linux)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def new_segment_slots_per_rank(want: int, slot_size: int, max_ranks: int, *,
                               asked_by: str, who: str, hint: str,
                               logger: Optional[logging.Logger] = None,
                               error: Type[Exception] = ValueError) -> int:
    """Slots per rank for a segment made now from ``want`` bytes of slots of ``slot_size``.

    ``want`` is clamped, with a log line (``who``: the engine's name; ``asked_by``: the key
    that asked; ``hint``: how to choose), to ``SHM_CLAMP_SHARE`` of /dev/shm's free space and
    of MemAvailable (/dev/shm's size can exceed the RAM there is, and a segment's pages are RAM
    once written) when it does not fit in either, so that an engine configured for a larger
    machine still starts.  The control region (a 64-byte SlotMeta line per slot, buckets,
    ranks) comes on top of the slots: counted as one more line per slot, which it never
    exceeds for slots of >= 64 bytes; the other share of what is free holds it with room to
    spare.  Too little for one slot per rank: ``error`` naming ``asked_by`` when the config
    asked for too little, SharedMemoryFull naming what is free when the clamp left too little.
    """
    logger = logger or log
    stride = -(-slot_size // LINE) * LINE
    need_each = stride * max_ranks
    clamped: Optional[tuple] = None
    for where, free in ((SHM_DIR, shm_free_bytes()), ("MemAvailable", mem_available_bytes())):
        if free is not None and want // stride * (stride + LINE) > free:
            fit = int(free * SHM_CLAMP_SHARE) // stride * stride
            if fit < need_each:
                raise SharedMemoryFull(
                    f"{asked_by}: {where} has {free} bytes free, too little for one slot of "
                    f"{slot_size} bytes for each of {max_ranks} ranks; free some, raise its "
                    f"size (Docker: --shm-size), or lower the ranks")
            if clamped is None or fit < clamped[2]:
                clamped = (where, free, fit)
    if clamped is not None:
        where, free, fit = clamped
        logger.warning("%s: %s asks for %d bytes of slots but %s has %d bytes free: using %d "
                       "(%d%% of what is free); %s", who, asked_by, want, where, free, fit,
                       int(SHM_CLAMP_SHARE * 100), hint)
        want = fit
    per = want // need_each
    if per < 1:
        raise error(f"{asked_by} ({want} bytes) holds no slot of {slot_size} bytes for each of "
                    f"{max_ranks} ranks; it needs at least {need_each}")
    return per


def open_segment(uuid: str, *, slot_size: int, max_ranks: int,
                 slots_per_rank: Callable[[], int], timeout: float) -> SlotCache:
    """Attach to ``uuid`` if it exists (whatever capacity, slot size and ranks its maker chose:
    engines configured differently still share it; the caller checks the slot size), else
    create it with ``slots_per_rank()`` (asked only then: sizing logs) and the given slot size
    and ranks.  One made meanwhile by another process with other parameters is attached."""
    try:
        return SlotCache.attach(uuid, timeout=0.0)
    except (SegmentNotFound, CorruptSegment, TimeoutError):
        pass  # none yet, a half-made one (create replaces it), or one being made (create waits)
    try:
        return SlotCache.create(uuid, slots_per_rank=slots_per_rank(), slot_size=slot_size,
                                max_ranks=max_ranks, exist_ok=True, timeout=timeout)
    except IncompatibleSegment:
        return SlotCache.attach(uuid, timeout=timeout)  # made meanwhile with other params


# ---------------------------------------------------------------- host memory

class HostRegistration:
    """A segment's whole mapping registered as pinned host memory (``cudaHostRegister``), so
    that copies between its slots and a device are DMA, not staged by the driver; undone by
    ``close`` (before the cache closes: the mapping must outlive its registration).  A refusal
    (a driver that will not register shared memory, an error raised) leaves pageable copies:
    slower, the same bytes, with a log line.  ``torch`` is the module whose ``cuda.cudart()``
    is called.  Written for CUDA and driven here by stand-ins: this project's machines have no
    GPU."""

    __slots__ = ("_cudart", "_log", "_who", "addr", "size")

    def __init__(self, torch: Any, cache: SlotCache, *, who: str,
                 logger: Optional[logging.Logger] = None) -> None:
        self._log = logger or log
        self._who = who
        self.addr = 0        # the mapping's address while registered, else 0
        seg = cache._seg     # the whole mapping: page-aligned, as older drivers require
        self.size = int(seg.layout.total_size)
        addr = int(ffi.cast("uintptr_t", seg.base))
        try:
            self._cudart = torch.cuda.cudart()
            err = self._cudart.cudaHostRegister(addr, self.size, 0)
        except Exception as e:
            err = f"{type(e).__name__}: {e}"
        if _cuda_ok(err):
            self.addr = addr
        else:
            self._log.warning("%s: cudaHostRegister of %d bytes refused (%s); copies to and "
                              "from the segment stay pageable", who, self.size, err)

    @property
    def registered(self) -> bool:
        return self.addr != 0

    def close(self) -> None:
        """Unregister (once); a refusal is logged, never raised: the exit goes on."""
        addr, self.addr = self.addr, 0
        if not addr:
            return
        try:
            err = self._cudart.cudaHostUnregister(addr)
        except Exception as e:
            err = f"{type(e).__name__}: {e}"
        if not _cuda_ok(err):
            self._log.warning("%s: cudaHostUnregister of %d bytes refused (%s)", self._who,
                              self.size, err)


def _cuda_ok(err: Any) -> bool:
    """Whether a cudart return value is cudaSuccess (torch returns an enum, ctypes an int)."""
    try:
        return int(err) == 0
    except (TypeError, ValueError):
        return False


# ---------------------------------------------------------------- the finalizer

class EngineParts:
    """What an engine object must let go of when it goes: its threads (``stop``, a subclass's),
    its host registration and its cache, in that order (a copy in flight uses both).  Held by
    the object and by its finalizer (``finalizer``), never referring back to the object (a
    finalizer that did would keep it alive).  Nothing is released in a forked child: the
    parent's rank is the parent's to free (the child's cache object is unusable there anyway,
    DESIGN 5.6)."""

    __slots__ = ("cache", "host", "pid", "_log")

    def __init__(self, logger: Optional[logging.Logger] = None) -> None:
        self.cache: Optional[SlotCache] = None
        self.host: Optional[HostRegistration] = None
        self.pid = os.getpid()
        self._log = logger or log

    def finalizer(self, owner: object, exitpriority: int = 10) -> "_mp_util.Finalize":
        """Runs ``release`` once: when called, when ``owner`` is collected, or at process exit.
        multiprocessing's Finalize, not weakref.finalize: a process that multiprocessing forked
        (vLLM's default start method) ends with os._exit after running multiprocessing's
        finalizers, so atexit never runs there; these run there, at atexit in any other
        process, and on collection."""
        return _mp_util.Finalize(owner, self.release, exitpriority=exitpriority)

    def stop(self) -> None:
        """A subclass's threads and pools, stopped and joined; nothing here."""

    def release(self) -> None:
        if os.getpid() != self.pid:
            return
        self.stop()
        host, self.host = self.host, None
        if host is not None:
            host.close()
        cache, self.cache = self.cache, None
        if cache is not None:
            try:
                cache.close()
            except (NotAttached, CorruptSegment):
                pass  # nothing left to free
            except UcmError as e:
                self._log.warning("closing segment %r: %s", cache.uuid, e)


# ---------------------------------------------------------------- stats files

def write_json(path: str, data: Dict[str, Any]) -> None:
    """``data`` as JSON at ``path``, whole or not at all (written beside it, then renamed): an
    engine's stats file, read by whoever watches it while the engine runs."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(data, f)
    os.replace(tmp, path)


# ---------------------------------------------------------------- config checking

def _given(config: Dict[str, Any], name: str, default: Any) -> Any:
    v = config.get(name)
    return default if v is None else v   # absent, or given as None (a YAML key left empty)


def check_known(config: Dict[str, Any], known: Iterable[str], *, where: str, who: str,
                error: Type[Exception] = ValueError) -> None:
    """``error`` naming every key of ``config`` not in ``known``: a misspelt key is not
    silently ignored."""
    unknown = sorted(set(map(str, config)) - set(known))
    if unknown:
        raise error(f"{where}: unknown key(s) {unknown}; {who} reads {sorted(known)}")


@overload
def check_int(config: Dict[str, Any], name: str, default: int, *,
              minimum: Optional[int] = None, maximum: Optional[int] = None,
              where: str = "config", error: Type[Exception] = ValueError) -> int: ...
@overload
def check_int(config: Dict[str, Any], name: str, default: None = None, *,
              minimum: Optional[int] = None, maximum: Optional[int] = None,
              where: str = "config", error: Type[Exception] = ValueError) -> Optional[int]: ...
def check_int(config: Dict[str, Any], name: str, default: Optional[int] = None, *,
              minimum: Optional[int] = None, maximum: Optional[int] = None,
              where: str = "config", error: Type[Exception] = ValueError) -> Optional[int]:
    """The int under ``name`` (``default`` when absent or None), in [minimum, maximum]; a bool
    is not an int here."""
    v = _given(config, name, default)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
        raise error(f"{where} {name!r} must be an int{_range(minimum, maximum)}, got "
                    f"{type(v).__name__} {v!r}")
    v = int(v)
    if (minimum is not None and v < minimum) or (maximum is not None and v > maximum):
        raise error(f"{where} {name!r} must be an int{_range(minimum, maximum)}, got {v}")
    return v


@overload
def check_number(config: Dict[str, Any], name: str, default: float, *, unit: str,
                 above: Optional[float] = None, minimum: Optional[float] = None,
                 maximum: Optional[float] = None, where: str = "config",
                 error: Type[Exception] = ValueError) -> float: ...
@overload
def check_number(config: Dict[str, Any], name: str, default: None = None, *, unit: str,
                 above: Optional[float] = None, minimum: Optional[float] = None,
                 maximum: Optional[float] = None, where: str = "config",
                 error: Type[Exception] = ValueError) -> Optional[float]: ...
def check_number(config: Dict[str, Any], name: str, default: Optional[float] = None, *,
                 unit: str, above: Optional[float] = None, minimum: Optional[float] = None,
                 maximum: Optional[float] = None, where: str = "config",
                 error: Type[Exception] = ValueError) -> Optional[float]:
    """The number (int or float, not bool) under ``name``, > above, in [minimum, maximum]."""
    v = _given(config, name, default)
    if v is None:
        return None
    ok = not isinstance(v, bool) and isinstance(v, (int, float, np.integer, np.floating))
    if ok:
        f = float(v)
        ok = ((above is None or f > above) and (minimum is None or f >= minimum)
              and (maximum is None or f <= maximum))
    if not ok:
        bound = f" > {above:g}" if above is not None else _range(minimum, maximum)
        raise error(f"{where} {name!r} must be a number of {unit}{bound}, got {v!r}")
    return float(v)


def check_bool(config: Dict[str, Any], name: str, default: bool, *, strict: bool = True,
               where: str = "config", error: Type[Exception] = ValueError) -> bool:
    """The bool under ``name``.  ``strict``: true or false only; else also an int and the
    strings 1/0, true/false, yes/no, on/off (UCM's configs come from YAML and command lines)."""
    v = _given(config, name, default)
    if isinstance(v, bool):
        return v
    if not strict:
        if isinstance(v, str):
            low = v.strip().lower()
            if low in ("1", "true", "yes", "on"):
                return True
            if low in ("0", "false", "no", "off", ""):
                return False
        elif isinstance(v, (int, np.integer)):
            return bool(v)
    raise error(f"{where} {name!r} must be true or false, got {type(v).__name__} {v!r}")


def check_choice(config: Dict[str, Any], name: str, default: str, choices: Sequence[str], *,
                 where: str = "config", error: Type[Exception] = ValueError) -> str:
    """One of ``choices`` under ``name``."""
    v = _given(config, name, default)
    if v not in choices:
        raise error(f"{where} {name!r} must be " + " or ".join(map(repr, choices))
                    + f", got {v!r}")
    return v


def _range(minimum: Any, maximum: Any) -> str:
    if minimum is not None and maximum is not None:
        return f" in [{minimum}, {maximum}]"
    if minimum is not None:
        return f" >= {minimum}"
    if maximum is not None:
        return f" <= {maximum}"
    return ""
