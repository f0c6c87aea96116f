# ucmcache._core is made by cffi from csrc/ucm_core.h (csrc/_build.py): its `lib` holds the C
# core's functions and every UCM_* constant, `ffi` the cffi FFI.  cffi gives them no types.
from typing import Any

ffi: Any
lib: Any
