"""Named points in the protocol where a test can hold a process (a gate) or kill it.

C points (inside one protocol step) are armed on the cache's C context; Python points (between
steps) are armed here.  Unarmed, a C point costs one predictable branch and a Python point one
truthiness test of a module dict.

A Gate is one 32-bit futex word in a small file mapped by every process of a test.  The process
that reaches an armed point bumps it (arrived) and blocks, bounded, until the test bumps it
again (release).  Gates are one-shot.
"""
from __future__ import annotations

import mmap
import os
import signal
import tempfile
from typing import Dict, Optional, Tuple

from .._core import ffi, lib

C_POINTS = {
    "after_match": lib.UCM_PT_AFTER_MATCH,
    "after_pin": lib.UCM_PT_AFTER_PIN,
    "claim_unchecked": lib.UCM_PT_CLAIM_UNCHECKED,
    "after_claim": lib.UCM_PT_AFTER_CLAIM,
    "after_unlink": lib.UCM_PT_AFTER_UNLINK,
    "mid_publish": lib.UCM_PT_MID_PUBLISH,
    "before_handover": lib.UCM_PT_BEFORE_HANDOVER,
    "before_pin_cas": lib.UCM_PT_BEFORE_PIN_CAS,
    "holding_stripe": lib.UCM_PT_HOLDING_STRIPE,
    "counted_not_ready": lib.UCM_PT_COUNTED_NOT_READY,
    "before_copy": lib.UCM_PT_BEFORE_COPY,
    "mid_delete": lib.UCM_PT_MID_DELETE,
    "delete_marked": lib.UCM_PT_DELETE_MARKED,
    "delete_uncounted": lib.UCM_PT_DELETE_UNCOUNTED,
    "delete_usable": lib.UCM_PT_DELETE_USABLE,
    "delete_checked": lib.UCM_PT_DELETE_CHECKED,
    "load_copied": lib.UCM_PT_LOAD_COPIED,
    "load_published": lib.UCM_PT_LOAD_PUBLISHED,
    "before_stripe": lib.UCM_PT_BEFORE_STRIPE,
    "free_look": lib.UCM_PT_FREE_LOOK,
}
PY_POINTS = ("inside_loader", "before_ready", "after_ready", "before_magic", "after_shm_open",
             # an attach or probe read the magic unset, and has not yet probed the creator lock
             "magic_unset",
             # tier 2 (ucmcache.tier2): a get starts waiting for another node's lease (holding
             # none of its own); the background writer is about to send a batch
             "lease_wait", "before_write",
             # the disk tier (ucmcache.disktier): an owner is about to read the disk; a read
             # pool thread is about to open (for a put: remove) a block file; the writer wrote
             # a block's header and half its payload into its temporary file
             "disk_lookup", "disk_read_io", "disk_mid_write")
POINTS = tuple(C_POINTS) + PY_POINTS

_armed: Dict[str, Tuple[str, Optional["Gate"]]] = {}


class Gate:
    """A cross-process gate.  Create it in the test, pass .path to workers, open it there."""

    def __init__(self, path: Optional[str] = None, timeout: float = 30.0):
        self._own = path is None
        if path is None:
            fd, path = tempfile.mkstemp(prefix="ucmcache-gate-")
            os.ftruncate(fd, mmap.PAGESIZE)
        else:
            fd = os.open(path, os.O_RDWR)
        self.path = path
        self.timeout = timeout
        self._mm: Optional[mmap.mmap] = mmap.mmap(fd, mmap.PAGESIZE)
        os.close(fd)
        self._buf = ffi.from_buffer(self._mm)
        self.word = ffi.cast("uint32_t *", self._buf)

    @property
    def value(self) -> int:
        return lib.ucm_load32(ffi.cast("char *", self.word), 0)

    def wait_arrived(self, timeout: Optional[float] = None) -> None:
        """Block until a process has reached the gate (bounded)."""
        t = self.timeout if timeout is None else timeout
        if lib.ucm_gate_wait(self.word, 0, int(t * 1e9)) != lib.UCM_OK:
            raise TimeoutError(f"nobody reached the gate within {t} s")

    def release(self) -> None:
        lib.ucm_gate_wake(self.word)

    def wait_value(self, at_least: int, timeout: Optional[float] = None) -> None:
        t = self.timeout if timeout is None else timeout
        while True:
            v = self.value
            if v >= at_least:
                return
            if lib.ucm_gate_wait(self.word, v, int(t * 1e9)) != lib.UCM_OK:
                raise TimeoutError(f"gate value stayed {v} < {at_least} for {t} s")

    def close(self) -> None:
        if self._mm is None:
            return
        ffi.release(self._buf)
        self._mm.close()
        self._mm = None
        if self._own:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass

    def __enter__(self) -> "Gate":
        return self

    def __exit__(self, *exc) -> None:
        # A test that fails early must not leave a process blocked here.
        if self._mm is not None:
            self.release()
            self.release()
        self.close()


def arm_python(point: str, action: str, gate: Optional[Gate] = None) -> None:
    if point not in PY_POINTS:
        raise ValueError(f"unknown Python point {point!r}; known: {', '.join(PY_POINTS)}")
    if action not in ("gate", "kill", "none"):
        raise ValueError(f"action must be 'gate', 'kill' or 'none', got {action!r}")
    if action == "none":
        _armed.pop(point, None)
    else:
        _armed[point] = (action, gate)


def fire(point: str) -> None:
    """Called at a Python point when _armed is non-empty."""
    entry = _armed.pop(point, None)  # one-shot, like the C points
    if entry is None:
        return
    action, gate = entry
    if action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if gate is not None:
        base = ffi.cast("char *", gate.word)
        arrived = lib.ucm_fetch_add32(base, 0, 1) + 1
        lib.ucm_futex_wake(base, 0, 2 ** 31 - 1)
        lib.ucm_gate_wait(gate.word, arrived, int(gate.timeout * 1e9))
