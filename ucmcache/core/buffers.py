"""Destination buffers for the copying reads (HandleBatch.gather, SlotCache.read_many): n rows
of equal size in one writable C-contiguous block, whatever object holds it."""
from __future__ import annotations

from typing import Any, Tuple

import numpy as np

from .._core import ffi
from .._hit import buffer_row, row_size


def rows_of(out: Any, n: int) -> Tuple[Any, int, Any]:
    """(char pointer, row bytes, object to keep alive during the copy) for ``out`` cut into n
    rows.  Accepts the buffer protocol (numpy, bytearray, memoryview...) and CPU torch tensors
    (anything with data_ptr(), numel(), element_size(), is_contiguous() and a cpu device).
    The rows follow one rule, written once in C (ucmcache._hit.row_size): a 2-D or higher out
    is rows by its first dimension, a 1-D one n equal rows; items must be plain numbers or
    bytes (checked by ucmcache._hit.buffer_row)."""
    if hasattr(out, "data_ptr") and hasattr(out, "element_size") and not isinstance(out, np.ndarray):
        device = getattr(getattr(out, "device", None), "type", "cpu")
        if device != "cpu":
            raise ValueError(f"out must be in CPU memory, got a tensor on {device!r}")
        if not out.is_contiguous():
            raise ValueError("out must be C-contiguous (call .contiguous() first)")
        nbytes = int(out.numel()) * int(out.element_size())
        ptr = ffi.cast("char *", int(out.data_ptr()))
        ndim = int(out.dim())
        return ptr, row_size(nbytes, ndim, int(out.shape[0]) if ndim else 1, n), out
    else:
        try:
            keep = ffi.from_buffer("char[]", out, require_writable=True)
        except TypeError as e:
            raise TypeError(f"out must be a writable C-contiguous buffer (numpy array, "
                            f"bytearray, memoryview, CPU tensor), got {type(out).__name__}: "
                            f"{e}") from None
        except (ValueError, BufferError) as e:
            raise ValueError(f"out must be a writable C-contiguous buffer: {e}") from None
        return keep, buffer_row(out, n), keep


def check_rows(lens: np.ndarray, row: int) -> None:
    """A payload longer than out's rows was not copied: say which."""
    over = np.flatnonzero(lens > row)
    if len(over):
        i = int(over[0])
        raise ValueError(f"key {i}'s payload is {int(lens[i])} bytes, more than a row of out "
                         f"({row} bytes); {len(over)} position(s) were not copied")
