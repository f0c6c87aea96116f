"""Slot operations: the rules about a pinned slot (its views, length, publish Ready or
Failed, waiting for another caller's load) that Handle, HandleBatch, the tier and the ring
all use.  Below the cache API: this module never imports SlotCache (no import circle)."""
from __future__ import annotations

import contextvars
import os
import sys
import threading
import time
import weakref
from typing import Any, Dict, Optional, Tuple

import numpy as np

from . import hooks as _hooks
from .._core import ffi, lib
from .errors import LoadFailed, UcmError
from .._hit import plain_format
from .results import code_name
from .timeouts import check_timeout  # noqa: F401  (the waits' one rule, imported from here)

# The SlotCache these operations serve.  Not imported, not even for type checkers: slot
# operations sit below the cache API and never reach back into it (no import circle).
SlotCache = Any

STATE_NAMES = {lib.UCM_LOADING: "loading", lib.UCM_READY: "ready", lib.UCM_FAILED: "failed",
               lib.UCM_EMPTY: "failed"}

# The lock-free pin steps (get, get_many, get_or_load's hit), shared here so that the single-key
# and the batch paths, in two modules, read one value and decode the answer one way.
FAST_SPIN = 64          # yields on a claimed slot before the fast path gives up (the seed's 64)
_PIN_SLOT_MASK = lib.UCM_PIN_SLOT_MASK  # a pin's answer, decoded with plain ints (see C)
_PIN_LEN_SHIFT = lib.UCM_PIN_LEN_SHIFT
_PIN_OWNER = lib.UCM_PIN_OWNER
_PIN_READY = lib.UCM_PIN_READY
_PIN_OWNER_OR_READY = _PIN_OWNER | _PIN_READY


def decode_pin(answer: int) -> Tuple[int, int, bool]:
    """A pinning step's answer (>= 0; UCM_PIN_* in ucm_core.h) as (slot, length, owner):
    length is a Ready slot's payload length and -1 for a Loading one; owner is True when the
    step made this caller the owner of a Loading slot (it must load and publish it)."""
    slot = answer & _PIN_SLOT_MASK
    if answer & _PIN_READY:
        return slot, (answer >> _PIN_LEN_SHIFT) & _PIN_SLOT_MASK, False
    return slot, -1, bool(answer & _PIN_OWNER)

# The owned-slot record: the slots whose loads this caller owns (per cache), so that a wait on
# one of them, which would wait forever, is refused, through any cache of the same segment in
# this process (owns_load).  A context variable, so a loader that hands
# its work to code running in a copy of its context (asyncio.to_thread,
# contextvars.copy_context().run in a pool) is caught too: the copy holds the same record.
#
# asyncio tasks start with a copy of their creator's context too, so sibling tasks would share
# their creator's record and refuse to wait for each other's loads.  A task's aget_or_load
# gives it a record of its own (isolate_owned), once, which inherits the loads its creator's
# record holds at that moment: the creator may be awaiting the task, so a wait for one of those
# would never end; loads the creator starts later are not the task's (it may wait for them).
# Inherited by reference, not copied: a handle records its slot in the set it found
# (Handle._owned) and discards it from that set when its load ends, whichever record the
# context holds by then, so the inherited entry ends with it (a copy kept the slot for good and
# refused a later join of it, reused for another key, as a wait for itself).  And each inherited
# load is known by its slot and its install's serial (ucm_load_serial: this process's latest
# install there), so a later load of the creator that takes the same slot is not inherited.
_owning: "contextvars.ContextVar[OwnedRecord]" = contextvars.ContextVar("ucmcache_owning")

# The caches of this process by key (a record's keys: cache._owned_key, a count of the caches
# this process made, so never reused, unlike id(): a set or inherited load a collected cache
# left in a record can name no later cache): an inherited load's serial is read through its
# cache's context, and a load owned through one cache is found for another of the same
# segment (owns_load).  Weak: a record does not keep a cache alive.
_caches: "weakref.WeakValueDictionary[int, Any]" = weakref.WeakValueDictionary()


class SegmentId:
    """One segment as this process knows it: every cache of this process attached to it holds
    this object (``cache._segment_id``), so "the same segment" is one identity test.  A
    segment is its file, (device, inode), not its uuid: a uuid unlinked and created again names
    another file, another segment, and a cache still attached to the old one is not the new
    one's.  (An inode is not reused while a cache maps it; a closed cache owns no load.)

    ``caches``: key (``_owned_key``) -> a weak reference, for each cache of this process open on
    the segment (owns_load looks up these keys in a record, not every set the record holds).  A
    key leaves at the cache's close (forget_cache) or its collection (the reference's callback:
    the references live here, so the callback runs even when the cache dies in a cycle).  Each
    change is one dict operation (atomic under the GIL, no
    lock: a callback may run inside any allocation); a reader copies the ids in one call."""

    __slots__ = ("uuid", "caches", "__weakref__")

    def __init__(self, uuid: str):
        self.uuid = uuid
        self.caches: "Dict[int, weakref.ref]" = {}

    def add(self, cache: "SlotCache") -> None:
        key = cache._owned_key
        caches = self.caches

        def gone(ref: "weakref.ref") -> None:
            caches.pop(key, None)
        caches[key] = weakref.ref(cache, gone)


# (device, inode) -> the SegmentId of this process's caches of that file; weak: it goes with
# the last of them.  A forked child starts with none (its parent's caches are unusable in it),
# and with a lock of its own: the parent's may have been held by another thread inside
# note_cache as the process forked, and that thread does not run in the child.
_segment_ids: "weakref.WeakValueDictionary[Tuple[int, int], SegmentId]" = \
    weakref.WeakValueDictionary()
_segment_ids_lock = threading.Lock()


def _segment_ids_after_fork() -> None:
    global _segment_ids, _segment_ids_lock
    _segment_ids_lock = threading.Lock()
    _segment_ids = weakref.WeakValueDictionary()


os.register_at_fork(after_in_child=_segment_ids_after_fork)


def note_cache(cache: "SlotCache", uuid: str, file: Tuple[int, int]) -> None:
    """A cache made in this process (SlotCache's construction), attached to segment ``uuid``
    whose file is ``file`` (device, inode): its loads may be inherited, and a wait through
    another cache of the same segment on a load it owns is refused (owns_load)."""
    with _segment_ids_lock:  # two threads attaching at once get one SegmentId
        seg = _segment_ids.get(file)
        if seg is None:
            seg = _segment_ids[file] = SegmentId(uuid)
    cache._segment_id = seg
    # The records holding a set of its, by id, weakly (a record is a dict: not hashable)
    cache._owned_records = weakref.WeakValueDictionary()
    seg.add(cache)
    _caches[cache._owned_key] = cache


def forget_cache(cache: "SlotCache") -> None:
    """A cache closed for good (its close committed, or its finalizer's): it owns no load any
    more, so owns_load no longer looks it up, and its empty set leaves every record that holds
    one (``_owned_records``, weak: noted as each set was made), so a context's record holds
    the sets of the caches open that it loaded through, not of every cache it ever did.  No
    load begins through it again, so nothing adds to the set taken out (a set a load is still
    in stays; its key is never another cache's, so no later cache reads it)."""
    key = cache._owned_key
    seg = getattr(cache, "_segment_id", None)
    if seg is not None:
        seg.caches.pop(key, None)
    records = getattr(cache, "_owned_records", None)
    for record in [] if records is None else list(records.values()):
        theirs = record.get(key)
        if theirs is not None and not theirs:
            record.pop(key, None)


def _same_segment(cache: "SlotCache", key: int) -> bool:
    """Whether the cache of this process whose ``_owned_key`` is ``key`` is open on cache's
    segment."""
    seg = getattr(cache, "_segment_id", None)  # (None before note_cache: no load to own)
    return seg is not None and key in seg.caches


def _install_serial(key: int, slot: int) -> int:
    """The serial of this process's latest install of the slot in the cache whose key is key,
    or -1 when it cannot be read: the cache gone or closed, or its context away for a moment
    inside another thread's close() (see _inherited)."""
    cache = _caches.get(key)
    return -1 if cache is None else cache._load_serial(slot)  # (the context read in C)


class OwnedRecord(dict):
    """cache._owned_key -> the set of slots whose loads the contexts holding this record own
    (a dict, so csrc/ucm_hit.c's owned_set finds the set with one lookup).  ``inherited``: the
    loads of the records it was made from that were in flight when it was made, as
    (cache._owned_key, their record's set, {slot: its install's serial} then) per set; a load
    stays inherited while its slot is in that set and its install's serial is the same (the
    load has not ended, and no later load of that set took its slot).  ``task``: a weak
    reference to the asyncio task it was made for, or None (made outside a task)."""

    __slots__ = ("inherited", "task", "__weakref__")

    def __init__(self, inherited: "Tuple[Tuple[int, set, Dict[int, int]], ...]" = (),
                 task: "Optional[weakref.ref]" = None):
        super().__init__()
        self.inherited = inherited
        self.task = task

    def made_for(self, task: Any) -> bool:
        return self.task is not None and self.task() is task

    def inherit(self) -> "Tuple[Tuple[int, set, Dict[int, int]], ...]":
        """What a record made from this one inherits: every load in flight now, its own and
        those it inherited (each set referred to, with its loads' slots and install serials);
        a set with none is left out, so what a line of records inherits is bounded by the loads
        in flight, not by how many records were made.  (The keys are listed first, which
        allocates nothing per item: a collection run meanwhile may let a thread sharing the
        record add a cache's set; a set is copied in one call, whole under the GIL.)"""
        own = ((key, self.get(key)) for key in list(self))
        mine = tuple((key, theirs, {s: _install_serial(key, s) for s in set(theirs)})
                     for key, theirs in own if theirs)
        return mine + tuple((key, theirs, live) for key, theirs, loads in self.inherited
                            if (live := {s: n for s, n in loads.items()
                                         if _inherited(key, theirs, s, n)}))


def _inherited(key: int, theirs: set, slot: int, serial: int) -> bool:
    """Whether an inherited load is still in flight: its slot in its set, its install the
    same (a later load of that set on the same slot has another serial).  A serial that could
    not be read (-1: the cache's context away, as inside another thread's close() until it
    refuses) is no answer: the load is then known by its slot alone, so a wait that may be for
    the creator is refused rather than left to hang."""
    if slot not in theirs:
        return False
    now = -1 if serial == -1 else _install_serial(key, slot)
    return now == -1 or now == serial


def _current_task() -> Any:
    """The asyncio task running in this thread, or None (no event loop runs here)."""
    asyncio = sys.modules.get("asyncio")  # not imported: no task can be running
    if asyncio is None:
        return None
    try:
        return asyncio.current_task()
    except RuntimeError:  # no running event loop in this thread
        return None


def owns_load(cache: "SlotCache", slot: int) -> bool:
    """Whether this context owns the load of the segment's slot (a wait on it would wait for
    itself): its record holds it, as its own or inherited from the record it was made from,
    through this cache or any other cache of this process attached to the same segment (a
    library and an application may each attach one: slots are the segment's, and a loader of
    one asking for its key through the other would wait for itself as surely)."""
    record = _owning.get(None)
    if record is None:
        return False
    key = cache._owned_key
    own = record.get(key)
    if own is not None and slot in own:
        return True
    # Another cache's set: only a record that holds more than this cache's (one len() on the
    # usual path, a wait's cost unchanged), and only the sets of the caches open on this
    # segment (their ids copied in one call, whole under the GIL: another thread may attach
    # or close one meanwhile), however many caches the record has seen.
    if len(record) > (own is not None):
        seg = getattr(cache, "_segment_id", None)
        if seg is not None:
            for k in tuple(seg.caches):
                if k != key:
                    theirs = record.get(k)
                    if theirs is not None and slot in theirs:
                        return True
    for k, theirs, loads in record.inherited:
        serial = loads.get(slot)
        if serial is not None and (k == key or _same_segment(cache, k)) \
                and _inherited(k, theirs, slot, serial):
            return True
    return False


def owns_loads_besides(cache: "SlotCache", slots: "set[int]") -> bool:
    """Whether this context owns a load of the segment other than those of ``slots``, through
    this cache or another of the same segment (a caller owning other loads must not wait for
    another node's: it may be waiting for one of ours)."""
    record = _owning.get(None)
    if record is None:
        return False
    key = cache._owned_key
    for k, own in list(record.items()):
        if own and not own <= slots and (k == key or _same_segment(cache, k)):
            return True
    for k, theirs, loads in record.inherited:
        if (k == key or _same_segment(cache, k)) and any(
                s not in slots and _inherited(k, theirs, s, n) for s, n in loads.items()):
            return True
    return False


def isolate_owned() -> None:
    """Give the current asyncio task an owned-slot record of its own (see _owning): its own
    loads go there, unseen by its sibling tasks, and it inherits the loads in flight of the
    record it had.  Once per task: a task calling aget_or_load a million times keeps one
    record.  Outside a task nothing shares the context's record: no change."""
    task = _current_task()
    if task is None:
        return
    record = _owning.get(None)
    if record is not None and record.made_for(task):
        return
    _owning.set(OwnedRecord(() if record is None else record.inherit(), weakref.ref(task)))


def _owned_slots(cache: "SlotCache") -> set:
    """The set the current context's owned loads of the cache go to (its record's own set),
    made with the record if there is none yet (csrc/ucm_hit.c's owned_set calls this then)."""
    record = _owning.get(None)
    if record is None:
        task = _current_task()
        record = OwnedRecord((), None if task is None else weakref.ref(task))
        _owning.set(record)
    own = record.get(cache._owned_key)
    if own is None:
        own = record.setdefault(cache._owned_key, set())
        records = getattr(cache, "_owned_records", None)  # its close takes the set out
        if records is not None:                             # (forget_cache)
            records[id(record)] = record
    return own




def _fresh_record_after_fork() -> None:
    """A forked child owns none of its parent's loads (the parent's caches are unusable in it):
    it starts with an empty record rather than copies naming the parent's caches."""
    _owning.set(OwnedRecord())


os.register_at_fork(after_in_child=_fresh_record_after_fork)


# ---------------------------------------------------------------- slot operations
# Shared by Handle and HandleBatch: one copy of each rule about a pinned slot.

def slot_view(cache: "SlotCache", slot: int, n: int, writable: bool, views: list) -> memoryview:
    """A view of a slot this caller pins, holding a pin of its own (see SlotBuffer in
    csrc/ucm_hit.c), kept in ``views`` for release when the owner's load ends."""
    mv = cache._slot_view(slot, n, writable)
    views.append(mv)
    return mv


def slot_length(cache: "SlotCache", slot: int) -> int:
    n = lib.ucm_load32(cache._seg.base, cache._layout.meta(slot) + lib.UCM_M_LENGTH)
    return min(n, cache._layout.slot_size)  # a corrupt length never reaches the next slot


def ready_length(cache: "SlotCache", slot: int) -> int:
    """The payload length of a pinned slot that is Ready now; the reasons it is not, raised."""
    st = lib.ucm_slot_state(cache._ctx, slot)
    if st == lib.UCM_READY:
        return slot_length(cache, slot)
    if st == lib.UCM_LOADING:
        raise UcmError("this slot is still loading in another process or thread; call wait() "
                       "first")
    raise LoadFailed(failure_message(cache, slot))


def as_array(mv: memoryview, dtype, shape=None) -> np.ndarray:
    dt = np.dtype(dtype)
    if shape is None:
        return np.frombuffer(mv, dtype=dt, count=len(mv) // dt.itemsize)
    count = int(np.prod(shape))
    if count * dt.itemsize > len(mv):
        raise ValueError(f"shape {shape} of {dt} needs {count * dt.itemsize} bytes, the view "
                         f"has {len(mv)}")
    return np.frombuffer(mv, dtype=dt, count=count).reshape(shape)


def failure_message(cache: "SlotCache", slot: int) -> str:
    if lib.ucm_slot_state(cache._ctx, slot) == lib.UCM_EMPTY:
        return "the loader died and its slot was reclaimed"
    L = cache._layout
    n = min(slot_length(cache, slot), L.slot_size)
    off = L.data(slot)
    text = bytes(cache._seg.view[off:off + n]).decode("utf-8", "replace")
    return text or "the loader failed without a message"


def as_value_view(value: Any, slot_size: int) -> memoryview:
    """A loader's (or put's) value as bytes to copy into a slot, or the error naming what is
    wrong, raised before anything is stored.  Its items must be plain numbers or bytes, the
    rule ``out`` buffers are held to (_hit.plain_format): an object array's items are PyObject*
    addresses, meaningless (and a leak of heap addresses) in every other process.  An empty
    value of any shape is an empty payload, as b"" is."""
    try:
        mv = memoryview(value)
    except TypeError:
        raise TypeError(f"a loader must return a bytes-like object, got "
                        f"{type(value).__name__}") from None
    if not plain_format(mv.format):
        raise TypeError(f"a value's items have format {mv.format!r} ({type(value).__name__}): "
                        "only plain numbers or bytes can be stored (not Python objects or "
                        "pointers, which mean nothing in another process)")
    if not mv.c_contiguous:
        raise ValueError("a loader's value must be C-contiguous")
    if mv.nbytes == 0:
        return _EMPTY  # (memoryview.cast refuses a shape with a zero in it)
    if mv.nbytes > slot_size:
        raise ValueError(f"the loader returned {mv.nbytes} bytes, more than slot_size={slot_size}")
    return mv.cast("B")


_EMPTY = memoryview(b"")


def observe_load(cache: "SlotCache", t0: int) -> None:
    """An owner's load ended (published Ready or Failed): its time into the histogram."""
    lib.ucm_observe(cache._ctx, lib.UCM_HIST_LOAD, time.monotonic_ns() - t0)


def _check_owner(owner: bool, what: str) -> None:
    if not owner:
        raise UcmError(f"{what}() is for the owner of a loading slot; this handle is not")


def publish_ready(cache: "SlotCache", slot: int, serial: int, owner: bool,
                  nbytes: Optional[int]) -> int:
    """The owner's Ready publish of its load, named by the serial its get was handed (I4: a
    stale ready() whose handle's close freed the slot, since installed for another key, is
    refused by the core, never finishes that key's load)."""
    _check_owner(owner, "ready")
    nbytes = check_nbytes(cache, nbytes)
    if _hooks._armed:
        _hooks.fire("before_ready")
    _publish(cache, slot, serial, lib.UCM_READY, int(nbytes), "ready")
    if _hooks._armed:
        _hooks.fire("after_ready")
    return int(nbytes)


def check_nbytes(cache: "SlotCache", nbytes: Any) -> int:
    """A Ready publish's length: None (the slot whole) or an int in [0, slot_size]."""
    size = cache._layout.slot_size
    if nbytes is None:
        return size
    if isinstance(nbytes, bool) or not isinstance(nbytes, (int, np.integer)):
        raise TypeError(f"nbytes must be an int, got {type(nbytes).__name__}")
    if not 0 <= nbytes <= size:
        raise ValueError(f"nbytes must be in [0, slot_size={size}], got {nbytes}")
    return int(nbytes)


def ready_lengths(cache: "SlotCache", nbytes: Any, n: int) -> np.ndarray:
    """ready_many's lengths: None (each slot whole), one int for all, or one per load, each
    checked as publish_ready checks its one (check_nbytes), before anything is published."""
    if nbytes is None or (isinstance(nbytes, (int, np.integer)) and
                          not isinstance(nbytes, bool)):
        return np.full(n, check_nbytes(cache, nbytes), dtype=np.uint32)
    try:
        values = list(nbytes)
    except TypeError:
        raise TypeError(f"nbytes must be None, an int or a sequence of ints, got "
                        f"{type(nbytes).__name__}") from None
    if len(values) != n:
        raise ValueError(f"nbytes has {len(values)} lengths for {n} positions")
    return np.array([check_nbytes(cache, v) for v in values], dtype=np.uint32)


def publish_ready_many(cache: "SlotCache", slots: np.ndarray, serials: np.ndarray,
                       lengths: np.ndarray) -> np.ndarray:
    """publish_ready for many owned loads at once (ownership and lengths checked by the
    caller), each named by its serial (I4: a stale one is refused, never finishes another
    key's load): one core call (ucm_publish_many), each load a step of its own.  The core's
    answers, UCM_OK where published.  With test hooks armed, one load at a time, so that
    before_ready and after_ready fire around each as they do for ready()."""
    n = len(slots)
    answers = np.zeros(n, dtype=np.int32)
    slots = np.ascontiguousarray(slots, dtype=np.uint32)
    serials = np.ascontiguousarray(serials, dtype=np.uint32)
    lengths = np.ascontiguousarray(lengths, dtype=np.uint32)
    if _hooks._armed:
        for j in range(n):
            _hooks.fire("before_ready")
            answers[j] = lib.ucm_publish(cache._ctx, int(slots[j]), int(serials[j]),
                                         lib.UCM_READY, int(lengths[j]))
            if answers[j] == lib.UCM_OK:
                _hooks.fire("after_ready")
        return answers
    if n:
        lib.ucm_publish_many(cache._ctx, ffi.from_buffer("uint32_t[]", slots),
                             ffi.from_buffer("uint32_t[]", serials), n,
                             ffi.from_buffer("uint32_t[]", lengths),
                             ffi.from_buffer("int32_t[]", answers))
    return answers


def fill(cache: "SlotCache", slot: int, serial: int, payload: memoryview) -> None:
    """An owner's slot gets a tier's payload and is published Ready (the owner stays pinned)."""
    n = payload.nbytes
    off = cache._layout.data(slot)
    cache._seg.view[off:off + n] = payload
    publish_ready(cache, slot, serial, True, n)


def write_through(cache: "SlotCache", slot: int, n: int) -> None:
    """An owner published slot Ready with n bytes: the cache's tier keeps a copy (it copies
    during the call; the view is released after it)."""
    off = cache._data_off + slot * cache._stride
    v = cache._ro[off:off + n]
    try:
        cache._tier.write_through(slot, v)
    finally:
        v.release()


def publish_failed(cache: "SlotCache", slot: int, serial: int, owner: bool, message: str) -> None:
    _check_owner(owner, "fail")
    if lib.ucm_slot_state(cache._ctx, slot) != lib.UCM_LOADING:  # before the message lands
        raise UcmError("fail(): the slot was already published")
    raw = str(message).encode("utf-8", "replace")[: cache._layout.slot_size]
    # One core step takes the right to finish the load before the message lands (a ready()
    # of another thread that took it first is never written over: I4), then publishes Failed;
    # only the load of `serial` (a stale fail() never fails a later install's load: I4, I5).
    _check_answer(lib.ucm_fail_load(cache._ctx, slot, serial, raw, len(raw)), "fail")


def _publish(cache: "SlotCache", slot: int, serial: int, state: int, nbytes: int,
             what: str) -> None:
    _check_answer(lib.ucm_publish(cache._ctx, slot, serial, state, nbytes), what)


def answer_message(r: int) -> str:
    """What a refused publish's answer (not UCM_OK) means, for the caller's error."""
    if r == lib.UCM_PUBLISHED:
        return "the slot was already published"
    return f"no longer the owner of a loading slot ({code_name(r)})"


def _check_answer(r: int, what: str) -> None:
    if r != lib.UCM_OK:
        raise UcmError(f"{what}(): {answer_message(r)}")


def release_views(views: list) -> None:
    """An owner's writable views, made unreadable now that its load ended."""
    for mv in views:
        try:
            mv.release()
        except BufferError:
            # A numpy array (or another export) still holds this view: it stays usable, and
            # its own pin (SlotBuffer) keeps the slot, and so the key's bytes, while it lives.
            pass


UNPUBLISHED = b"the owner closed its handle without calling ready()"
# A pin (and, for an owner, a Loading slot) taken by a get whose handle was never made: an
# exception (a signal handler, KeyboardInterrupt) arrived between the C call and the handle.
ABANDONED = b"the loading caller was interrupted before it took its handle"
ABANDONED_LEN = len(ABANDONED)  # the except paths make no call before their drop
UNPUBLISHED_LEN = len(UNPUBLISHED)


def exit_message(exc_type, exc) -> bytes:
    """The Failed message for an owner's with-block that raised: the exception, named."""
    try:
        return f"{exc_type.__name__}: {exc}".encode("utf-8", "replace")
    except Exception:
        return exc_type.__name__.encode("utf-8", "replace")


class _SharedWait:
    """One wait for a slot, shared by every task of one event loop that awaits it: one thread
    blocks on the slot's state word (cache._wait_loaded, uncounted, no deadline) and resolves
    one future on the loop; each task awaits that future shielded, with its own deadline, and
    counts its own wait (the counters and the wait histogram keep their per-waiter meaning).
    The last task to stop awaiting tells the thread to stop and joins it before its pin can go:
    while any task awaits, some task's pin keeps the slot and the cache's context in use."""

    __slots__ = ("fut", "cancel", "thread", "awaiting", "cache_id", "__weakref__")

    def __init__(self, loop: Any, cache: "SlotCache", slot: int, key: tuple, table: dict):
        self.fut = loop.create_future()
        self.cancel = threading.Event()
        self.awaiting = 0
        self.cache_id = cache._owned_key  # never reused, unlike id(): see _owned_key
        fut, cancel = self.fut, self.cancel

        def settle(result: Any, error: Optional[BaseException]) -> None:
            if table.get(key) is self:
                del table[key]  # from here a new awaiter starts a wait of its own
            if not fut.done():
                if error is None:
                    fut.set_result(result)
                else:
                    fut.set_exception(error)

        def run() -> None:
            try:
                st = cache._wait_loaded(slot, None, cancel, counted=False)
                loop.call_soon_threadsafe(settle, st, None)
            except BaseException as e:  # recovery's errors reach every awaiter
                try:
                    loop.call_soon_threadsafe(settle, None, e)
                except RuntimeError:
                    pass  # the loop is closed: nobody waits any more
            finally:
                _running.discard(self)

        # Started by the first awaiter, once it is counted (wait_loaded_async): a thread
        # nobody counts would be stopped by nobody.
        self.thread = threading.Thread(target=run, name="ucmcache-wait", daemon=True)


# Every shared wait whose thread was started and has not ended (stop_shared_waits).  A forked
# child has none of those threads: it starts with none.
_running: "set[_SharedWait]" = set()
os.register_at_fork(after_in_child=_running.clear)

# Per event loop, the shared waits in progress: (cache._owned_key, slot) -> _SharedWait (a key
# no later cache can reuse, as id() could once the cache is gone).  Read and
# changed only by the loop's own thread (a loop runs in one thread); the lock guards the map of
# loops, which the loops of several threads share.
_loop_waits: "weakref.WeakKeyDictionary[Any, dict]" = weakref.WeakKeyDictionary()
_loop_waits_lock = threading.Lock()


async def wait_loaded_async(cache: "SlotCache", slot: int, timeout: Optional[float]) -> int:
    """cache._wait_loaded for asyncio: the tasks of a loop awaiting one slot share one wait
    (one thread, one future: _SharedWait), so a thousand tasks on one cold key cost one thread
    and one wake-up, and the loop keeps running.  ``timeout`` is this task's own: past it, a
    TimeoutError for this task only (the load goes on, and so does the others' wait).
    Cancelling the task abandons its wait, never the load."""
    import asyncio  # here, not at the top: most users never touch asyncio, and it is ~30 modules
    loop = asyncio.get_running_loop()
    with _loop_waits_lock:
        table = _loop_waits.get(loop)
        if table is None:
            table = _loop_waits[loop] = {}
    # Counted as the blocking wait counts (cache._wait_ready): `waits` as the try's first call,
    # its time and a timeout once at the end, by the one C step that holds that rule
    # (ucm_wait_end).  The clock is read first, and from the entry's making to the try nothing
    # calls out but the entry's plain constructor (no thread yet): no signal handler's
    # exception (CPython runs handlers at calls) can leave an awaiter counted and not
    # uncounted, or a thread running that no awaiter will stop.  The thread starts inside the
    # try, so the last awaiter's finally always sees it.
    ctx = cache._ctx
    timed_out = False
    t0 = lib.ucm_now_ns()
    key = (cache._owned_key, slot)
    shared = table.get(key)
    if shared is None or shared.fut.done():
        shared = table[key] = _SharedWait(loop, cache, slot, key, table)
    shared.awaiting += 1
    try:
        lib.ucm_stat_add(ctx, lib.UCM_ST_WAITS, 1)
        if shared.thread.ident is None:
            _running.add(shared)  # before the start: the thread's end discards it
            shared.thread.start()
        if timeout is None:
            return await asyncio.shield(shared.fut)
        try:
            return await asyncio.wait_for(asyncio.shield(shared.fut), timeout)
        except asyncio.TimeoutError:
            if shared.fut.done() and not shared.fut.cancelled():
                return shared.fut.result()  # settled as the deadline passed: the answer wins
            timed_out = True
            raise still_loading(timeout) from None
    finally:
        shared.awaiting -= 1  # first: no call before it (an exception in this cleanup may cut
        # it short after any call; a thread then left running is stopped by the slot's end or
        # by close: stop_shared_waits)
        if cache._ctx is not None:
            lib.ucm_wait_end(ctx, t0, timed_out)
        if shared.awaiting == 0 and not shared.fut.done():
            # The last awaiter: the thread stops (it looks every CANCEL_SLICE) and is joined
            # before this task's pin, the last one keeping the slot, can go.
            if table.get(key) is shared:
                del table[key]
            shared.cancel.set()
            if shared.thread.ident is not None:  # started (an interrupted start: not yet)
                shared.thread.join(WAIT_CANCEL_JOIN)


WAIT_CANCEL_JOIN = 1.0  # seconds; the thread returns within one CANCEL_SLICE


def stop_shared_waits(cache: "SlotCache") -> None:
    """A step of close(), before the context goes: the shared waits on this cache's slots stop
    and are joined.  Every awaiter has gone by then (close refuses while handles are open), so
    only a wait left running is found here: one whose last awaiter was interrupted inside its
    cleanup (a signal handler's exception in a finally), which would otherwise wait on through
    a freed context."""
    cid = cache._owned_key
    for shared in list(_running):  # (a copy: the threads discard themselves as they end)
        if shared.cache_id == cid:
            shared.cancel.set()
            if shared.thread.ident is not None:
                shared.thread.join(WAIT_CANCEL_JOIN)


def still_loading(timeout: Optional[float]) -> TimeoutError:
    """A wait's deadline passed with the slot still Loading (the same words as HandleBase.wait's
    in C)."""
    return TimeoutError(f"key still loading after {timeout} s (the load goes on; get() again "
                        "to wait more)")


def _now() -> float:
    return time.monotonic()
