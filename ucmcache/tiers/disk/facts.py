"""What the tools report of a disk tier directory (``ucmcache tier``, ``inspect --tier``,
metrics' ``tiers=``), read without attaching to any segment and without writing anything but
what ``verify --remove-bad`` and ``trim`` are asked to change."""
from __future__ import annotations

import os
from typing import Any, Dict, List, Optional, Tuple

from ...core.errors import UcmError
from .counters import read_all
from .fileformat import FORMAT_VERSION
from .tier import DIR_NAME, DiskTier, read_capacity_record, read_usage_record, scan_blocks


class NotATierDirectory(UcmError, ValueError):
    """The path holds no disk tier (no ``ucm-disk-v1`` directory in it)."""


class _ToolTier(DiskTier):
    """The tools' DiskTier on a directory that records no capacity (made by an earlier
    version): it records none either (the first DiskTier the application makes does)."""
    _records_capacity = False


def open_dir(path: str, capacity_bytes: Optional[int] = None,
             allow_other_user: bool = False) -> DiskTier:
    """A DiskTier on an existing tier directory (capacity: the recorded one; where none is
    recorded, the one given, or unbounded, recording nothing).  Another user's directory
    raises ForeignTierDirectory unless allow_other_user (as DiskTier)."""
    root = _root_of(path)
    if read_capacity_record(root) is not None:
        return DiskTier(path, capacity_bytes, allow_other_user=allow_other_user)
    return _ToolTier(path, capacity_bytes if capacity_bytes is not None else 1 << 62,
                     allow_other_user=allow_other_user)


def _root_of(path: str) -> str:
    root = os.path.join(os.path.abspath(path), DIR_NAME)
    if not os.path.isdir(root):
        raise NotATierDirectory(f"{path!r} is not a disk tier directory: no {DIR_NAME}/ in it "
                                "(a DiskTier(path, ...) makes one)")
    return root


def tier_usage(path: str) -> Tuple[str, Dict[str, int], int]:
    """(label, counters, usage bytes) of a tier directory, read only: no DiskTier is built, no
    fd or map is kept (metrics reads this on every scrape)."""
    root = _root_of(path)
    used = read_usage_record(root)
    if used is None:
        used = sum(f.size for f in scan_blocks(os.path.join(root, "blocks")))
    return f"disk:{os.path.abspath(path)}", read_all(os.path.join(root, "stats")), used


def tier_facts(path: str, files: bool = False) -> Dict[str, Any]:
    """{"tier": "disk:<path>", "path", "format_version", "capacity_bytes" (the recorded one,
    or None), "files", "bytes" (scanned: regular block files),
    "usage_bytes" (the shared record), "counters": {t2_*: int}, "blocks": [...] (with files)}.
    Read only (no DiskTier is built, nothing is written or kept open)."""
    root = _root_of(path)
    found = scan_blocks(os.path.join(root, "blocks"))
    used = read_usage_record(root)
    try:
        capacity = read_capacity_record(root)
    except (UcmError, ValueError):
        capacity = None  # not a record a DiskTier would use (it says why when made)
    out: Dict[str, Any] = {
        "tier": f"disk:{os.path.abspath(path)}", "path": os.path.abspath(path),
        "format_version": FORMAT_VERSION, "capacity_bytes": capacity, "files": len(found),
        "bytes": sum(f.size for f in found),
        "usage_bytes": used if used is not None else sum(f.size for f in found),
        "counters": read_all(os.path.join(root, "stats"))}
    if files:
        found.sort(key=lambda f: f.mtime_ns, reverse=True)
        out["blocks"] = [{"block_id": f.block_id.hex(), "offset": f.offset, "size": f.size,
                          "mtime_ns": f.mtime_ns} for f in found]
    return out


def many_tier_facts(paths: List[str]) -> Dict[str, Dict[str, Any]]:
    """tier_facts of each path, by tier label."""
    out = {}
    for p in paths:
        d = tier_facts(p)
        out[d["tier"]] = d
    return out
