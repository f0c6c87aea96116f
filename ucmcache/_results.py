"""Names of the C core's step results (``UCM_OK``, ``UCM_BUSY``, ...), for messages."""
from __future__ import annotations

from ._core import lib

_NAMES = {getattr(lib, n): n for n in (
    "UCM_OK", "UCM_MISS", "UCM_BUSY", "UCM_FULL", "UCM_CORRUPT", "UCM_TIMEOUT", "UCM_ROLLBACK",
    "UCM_OWNERDEAD", "UCM_NOT_HELD", "UCM_PUBLISHED", "UCM_MOVED", "UCM_IN_FLIGHT")}


def code_name(code: int) -> str:
    """'UCM_BUSY' for lib.UCM_BUSY."""
    if code in _NAMES:
        return _NAMES[code]
    return f"unknown result {code}"
