"""What the tools report of a disk tier directory (``ucmcache tier``, ``inspect --tier``,
metrics' ``tiers=``), read without attaching to any segment and without writing anything but
what ``verify --remove-bad`` and ``trim`` are asked to change."""
from __future__ import annotations

import os
from typing import Any, Dict, List, Optional, Tuple

from .._errors import UcmError
from .counters import read_all
from .fileformat import FORMAT_VERSION
from .tier import DIR_NAME, DiskTier, read_usage_record, scan_blocks


class NotATierDirectory(UcmError, ValueError):
    """The path holds no disk tier (no ``ucm-disk-v1`` directory in it)."""


def open_dir(path: str, capacity_bytes: Optional[int] = None) -> DiskTier:
    """A DiskTier on an existing tier directory (capacity: given, or the bytes it holds)."""
    _root_of(path)
    return DiskTier(path, capacity_bytes if capacity_bytes is not None else 1 << 62)


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
    """{"tier": "disk:<path>", "path", "format_version", "files", "bytes" (scanned),
    "usage_bytes" (the shared record), "counters": {t2_*: int}, "blocks": [...] (with files)}.
    Read only (no DiskTier is built, nothing is written or kept open)."""
    root = _root_of(path)
    found = scan_blocks(os.path.join(root, "blocks"))
    used = read_usage_record(root)
    out: Dict[str, Any] = {
        "tier": f"disk:{os.path.abspath(path)}", "path": os.path.abspath(path),
        "format_version": FORMAT_VERSION, "files": len(found),
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
