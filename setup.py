import os
import sys

from setuptools import setup

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc"))
from _build import hit_extension  # noqa: E402

# Two extensions: the C core through cffi (ucmcache._core), and the hit path as CPython types
# (ucmcache._hit), which calls the core's steps through pointers taken from ucmcache._core.
# A third, ucmcache._crc (csrc/ucm_crc.c, csrc/ucm_copy.c): CRC-32C and the segment copies of
# ucmcache.vllm's block moves.
setup(cffi_modules=["csrc/_build.py:ffibuilder", "csrc/_build.py:crcbuilder"],
      ext_modules=[hit_extension()])
