"""cffi build of the C core (API mode): ``ucmcache._core``; and the hit path's extension.

The cdef is the CDEF block of ucm_core.h as it stands, plus every ``#define UCM_*`` of that
header, every row of its layout tables (``F(M, BUCKET, ...)``: the offset ``UCM_M_BUCKET``) and
every row of its result table (``RESULT(BUSY, 2)``: ``UCM_BUSY``), declared with ``...`` so the
compiler, not this file, supplies the values.
"""
import os
import re

from cffi import FFI

HERE = os.path.dirname(os.path.abspath(__file__))


def cdef_source(header_text: str) -> str:
    block = header_text.split("/* CDEF-BEGIN */", 1)[1].split("/* CDEF-END */", 1)[0]
    names = re.findall(r"^#define (UCM_[A-Z0-9_]+)[ \t]+\S", header_text, flags=re.M)
    names += [f"UCM_{prefix}_{name}" for prefix, name
              in re.findall(r"^[ \t]+F\(([A-Z]+), ([A-Z0-9_]+),", header_text, flags=re.M)]
    names += [f"UCM_{name}"
              for name in re.findall(r"^[ \t]+RESULT\(([A-Z0-9_]+),", header_text, flags=re.M)]
    return "\n".join(f"#define {name} ..." for name in names) + "\n" + block


def extra_compile_args() -> list:
    # -Werror: a warning is a build failure (a word of the wrong width, a shadowed name), so
    # none piles up unread in pip's output.
    args = ["-O2", "-std=gnu11", "-Wall", "-Wextra", "-Wshadow", "-Werror", "-Wno-unused-parameter"]
    sanitize = os.environ.get("UCMCACHE_SANITIZE")
    if sanitize:
        args += [f"-fsanitize={sanitize}", "-fno-omit-frame-pointer", "-g"]
    return args


def extra_link_args() -> list:
    sanitize = os.environ.get("UCMCACHE_SANITIZE")
    return [f"-fsanitize={sanitize}"] if sanitize else []


def hit_extension():
    """ucmcache._hit (csrc/ucm_hit.c): the hit path as CPython types.  It compiles the core's
    header, not the core: it calls the steps of ucmcache._core through pointers."""
    from setuptools import Extension
    return Extension("ucmcache._hit", sources=[os.path.relpath(os.path.join(HERE, "ucm_hit.c"))],
                     include_dirs=[os.path.relpath(HERE)],
                     extra_compile_args=extra_compile_args() + ["-Wno-missing-field-initializers",
                                                                "-Wno-cast-function-type"],
                     extra_link_args=extra_link_args())


with open(os.path.join(HERE, "ucm_core.h")) as f:
    _header = f.read()

ffibuilder = FFI()
ffibuilder.cdef(cdef_source(_header))
ffibuilder.set_source(
    "ucmcache._core",
    '#include "ucm_core.h"',
    sources=[os.path.relpath(os.path.join(HERE, "ucm_core.c"))],
    include_dirs=[os.path.relpath(HERE)],
    extra_compile_args=extra_compile_args(),
    extra_link_args=extra_link_args(),
    libraries=["pthread"],
)

# CRC-32C (csrc/ucm_crc.c) and the segment copies (csrc/ucm_copy.c) of the vLLM block format:
# utilities, not protocol steps, so a module of their own beside the core.
with open(os.path.join(HERE, "ucm_crc.h")) as f:
    _crc_header = f.read()
with open(os.path.join(HERE, "ucm_copy.h")) as f:
    _copy_header = f.read()

crcbuilder = FFI()
crcbuilder.cdef(cdef_source(_crc_header) + "\n" + cdef_source(_copy_header))
crcbuilder.set_source(
    "ucmcache._crc",
    '#include "ucm_crc.h"\n#include "ucm_copy.h"',
    sources=[os.path.relpath(os.path.join(HERE, "ucm_crc.c")),
             os.path.relpath(os.path.join(HERE, "ucm_copy.c"))],
    include_dirs=[os.path.relpath(HERE)],
    extra_compile_args=extra_compile_args(),
    extra_link_args=extra_link_args(),
    libraries=["pthread"],
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
    crcbuilder.compile(verbose=True)
