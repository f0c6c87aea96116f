"""Bench-time C builds, into a temporary directory (nothing is written into the work tree):

- ``floor``: the C-only floor binary (bench/floor.c, which includes csrc/ucm_core.c and
  bench/baselines/oldlock.c), gcc -O2.
- ``_ucmbench_old``: a cffi API-mode module (the same build style and flags as ucmcache._core)
  with the old locking design's steps (bench/baselines/oldlock.c) and the no-op functions of the
  Python floor, so the old design and the floor are called from Python exactly the way ucmcache's
  core is.
"""
from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from typing import Optional, Tuple

BENCH = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(BENCH)
CSRC = os.path.join(ROOT, "csrc")
BASELINES = os.path.join(BENCH, "baselines")
CFLAGS = ["-O2", "-std=gnu11", "-Wall", "-Wextra", "-Wno-unused-parameter", "-Wno-unused-function"]


def gcc() -> Optional[str]:
    return shutil.which(os.environ.get("CC", "gcc")) or shutil.which("cc")


def build_floor(tmpdir: str) -> Tuple[Optional[str], str]:
    """(path to the floor binary, '') or (None, why)."""
    cc = gcc()
    if cc is None:
        return None, "no C compiler (gcc/cc) on PATH"
    out = os.path.join(tmpdir, "floor")
    cmd = [cc, *CFLAGS, "-I", CSRC, os.path.join(BENCH, "floor.c"), "-o", out, "-lpthread"]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=BENCH)
    if r.returncode != 0:
        return None, "gcc failed: " + (r.stderr.strip().splitlines() or ["?"])[-1]
    return out, ""


_NOOPS = r"""
/* The Python floor: functions with the signatures of the hot-path calls, doing nothing. */
int64_t bench_noop_lookup(void *c, const char *id, uint64_t offset, uint32_t spin, int32_t outer)
{ (void)c; (void)id; (void)offset; (void)spin; (void)outer; return 0; }
int bench_noop_release(void *c, uint32_t s) { (void)c; (void)s; return 0; }
int bench_noop_many(void *c, const char *ids, const uint64_t *offsets, uint32_t n, uint8_t *out)
{ (void)c; (void)ids; (void)offsets; (void)n; (void)out; return 0; }
int bench_noop_release_many(void *c, const uint32_t *slots, uint32_t n)
{ (void)c; (void)slots; (void)n; return 0; }
/* The C memcpy floor of scenario 7: n rows copied from base + offs[i], nothing else. */
void bench_copy_rows(const char *base, const uint64_t *offs, uint32_t n, char *out, uint64_t row)
{ for (uint32_t i = 0; i < n; i++) memcpy(out + (uint64_t)i * row, base + offs[i], row); }
"""

_OLD_CDEF = r"""
typedef struct old_ctx old_ctx;
uint64_t old_extra_size(const ucm_layout *l);
int old_init(char *base, const ucm_layout *l);
old_ctx *old_ctx_new(char *base, const ucm_layout *l);
void old_ctx_free(old_ctx *c);
int64_t old_get(old_ctx *c, const char *id, uint64_t offset);
int old_release(old_ctx *c, uint32_t s);
int old_publish(old_ctx *c, uint32_t s, uint32_t state, uint32_t length);
uint32_t old_slot_state(old_ctx *c, uint32_t s);
int old_wait_ready(old_ctx *c, uint32_t s, int64_t timeout_ns, uint32_t *state_out);
int old_exist_many(old_ctx *c, const char *ids, const uint64_t *offsets, uint32_t n, uint8_t *out);
int old_get_many(old_ctx *c, const char *ids, const uint64_t *offsets, uint32_t n,
                 uint32_t *slots_out, uint8_t *states_out, uint8_t *owner_out, uint8_t *codes_out);
int old_release_many(old_ctx *c, const uint32_t *slots, uint32_t n);
int ucm_layout_compute(ucm_layout *l);
int64_t bench_noop_lookup(void *c, const char *id, uint64_t offset, uint32_t spin, int32_t outer);
int bench_noop_release(void *c, uint32_t s);
int bench_noop_many(void *c, const char *ids, const uint64_t *offsets, uint32_t n, uint8_t *out);
int bench_noop_release_many(void *c, const uint32_t *slots, uint32_t n);
void bench_copy_rows(const char *base, const uint64_t *offs, uint32_t n, char *out, uint64_t row);
"""


def _layout_typedef() -> str:
    with open(os.path.join(CSRC, "ucm_core.h")) as f:
        text = f.read()
    m = re.search(r"typedef struct \{[^}]*\} ucm_layout;", text)
    if not m:
        raise RuntimeError("ucm_layout typedef not found in csrc/ucm_core.h")
    return m.group(0)


def build_old_module(tmpdir: str):
    """(module, '') or (None, why): the cffi module with the old design and the no-ops."""
    if gcc() is None:
        return None, "no C compiler (gcc/cc) on PATH"
    try:
        from cffi import FFI
    except ImportError:
        return None, "cffi is not installed"
    name = "_ucmbench_old"
    try:
        ffib = FFI()
        ffib.cdef(_layout_typedef() + _OLD_CDEF)
        ffib.set_source(name, '#include "ucm_core.c"\n#include "oldlock.c"\n' + _NOOPS,
                        include_dirs=[CSRC, BASELINES], extra_compile_args=CFLAGS,
                        libraries=["pthread"])
        build = os.path.join(tmpdir, "cffi")
        os.makedirs(build, exist_ok=True)
        # cffi prints compiler chatter; keep the bench's output readable.
        with open(os.devnull, "w") as devnull:
            old_out, old_err = os.dup(1), os.dup(2)
            os.dup2(devnull.fileno(), 1)
            os.dup2(devnull.fileno(), 2)
            try:
                path = ffib.compile(tmpdir=build, verbose=False)
            finally:
                os.dup2(old_out, 1)
                os.dup2(old_err, 2)
                os.close(old_out)
                os.close(old_err)
        spec = importlib.util.spec_from_file_location(name, path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        sys.modules[name] = mod
        return mod, ""
    except Exception as e:  # a build failure is a skipped baseline, with why
        return None, f"cffi build of the old design failed: {type(e).__name__}: {e}"
