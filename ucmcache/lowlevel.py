"""ucmcache.lowlevel: what tools, tests, the CLI and the bench use below the public API.

The public API (``ucmcache``: SlotCache, Handle, the errors) is the contract for callers.
This namespace names, without an underscore, the parts beneath it that tools need (as
``trio.lowlevel`` does): they follow the C core and the segment format, so a new layout
version may change them.

The C core (cffi): ``ffi`` and ``lib`` (every ``UCM_*`` constant of csrc/ucm_core.h and every
protocol step).  The segment file: ``Segment``, ``probe``, ``held_for_removal``, ``shm_path``,
``life_lock_byte``, ``PREFIX``, ``SHM_DIR``; what the CLI checks and says of one: ``check_uuid``,
``check_mode`` (and ``MAX_MODE``), ``file_kind``, ``names_file``, ``unlink_if_same``,
``probed_error``, ``not_ours_error``.  The layout: ``Layout`` and the dtypes of its tables
(``HEADER``, ``RANK_DESC``, ``ARENA_DESC``, ``SLOT_META``, ``RING``).  The named points where a test holds
or kills a process: ``Gate``, ``arm_python``, ``POINTS``, ``C_POINTS``, ``PY_POINTS``, and
``hooks``, the module (its ``_armed`` and ``fire`` are read where the points are).
"""
from .core import hooks
from ._core import ffi, lib
from .core.hooks import C_POINTS, POINTS, PY_POINTS, Gate, arm_python
from .core.layout import ARENA_DESC, HEADER, RANK_DESC, RING, SLOT_META, Layout
from .core.segment import (MAX_MODE, PREFIX, SHM_DIR, Segment, check_mode, check_uuid, file_kind,
                       held_for_removal, life_lock_byte, names_file, not_ours_error, probe,
                       probed_error, shm_path, unlink_if_same)

__all__ = [
    "ffi", "lib", "Segment", "probe", "held_for_removal", "shm_path", "life_lock_byte", "PREFIX",
    "SHM_DIR", "check_uuid", "check_mode", "MAX_MODE", "file_kind", "names_file", "unlink_if_same",
    "probed_error", "not_ours_error", "Layout", "HEADER", "RANK_DESC", "ARENA_DESC", "SLOT_META",
    "RING", "Gate", "arm_python", "POINTS", "C_POINTS", "PY_POINTS", "hooks",
]
