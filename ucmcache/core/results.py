"""Names of the C core's step results (``UCM_OK``, ``UCM_BUSY``, ...), for messages: the core
names them (ucm_result_name, from the one table of results in ucm_core.h)."""
from __future__ import annotations

from .._core import ffi, lib


def code_name(code: int) -> str:
    """'UCM_BUSY' for lib.UCM_BUSY."""
    name = lib.ucm_result_name(code) if -(1 << 31) <= code < 1 << 31 else ffi.NULL
    if name == ffi.NULL:
        return f"unknown result {code}"
    return ffi.string(name).decode()
