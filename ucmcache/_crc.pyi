# ucmcache._crc is made by cffi from csrc/ucm_crc.h (csrc/_build.py); cffi gives it no types.
from typing import Any

ffi: Any
lib: Any
