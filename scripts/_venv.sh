# Sourced by scripts/*: make .venv once, (re)install the package with the given extras when the
# sources changed, then put .venv first on PATH.  Idempotent; needs only python3 and PyPI.
# `source _venv.sh test` (the default), `source _venv.sh bench`, or `source _venv.sh ""` for the
# package and its own dependencies only (numpy, posix_ipc, cffi): what the demo needs.  The
# package alone is satisfied by any install of the current sources, whatever its extras, so
# ./scripts/demo after ./scripts/test installs nothing.  Says what it installs before it does.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
EXTRAS="${1-test}"
PY="${PYTHON:-python3}"
_ucm_say() { echo "$(basename "$0"): $*" >&2; }
if [ ! -x "$VENV/bin/python" ]; then
    _ucm_say "creating $VENV; installing pip, setuptools, wheel, cffi into it (PyPI)"
    "$PY" -m venv "$VENV"
    "$VENV/bin/python" -m pip install -q --upgrade pip setuptools wheel cffi
fi
# pyproject.toml's license fields (PEP 639) need setuptools 77; the install below builds
# without isolation, with the venv's own.
if ! "$VENV/bin/python" -c "import setuptools, sys; sys.exit(int(setuptools.__version__.split('.')[0]) < 77)" \
        2>/dev/null; then
    _ucm_say "installing setuptools>=77 into $VENV (PyPI)"
    "$VENV/bin/python" -m pip install -q --upgrade "setuptools>=77"
fi
# The test extra pins torch==2.13.0 (real CPU tensors for the UCM store tests).  It goes in
# first and alone, so that pip takes the CPU build lying on this machine's disk: torch asked for
# later, beside other packages, could resolve to a CUDA build of several GB.  Checked by its
# installed version (no import), so a second run installs nothing.
if [[ ",$EXTRAS," == *",test,"* ]] && ! "$VENV/bin/python" -c \
        "import importlib.metadata as m, sys; sys.exit(m.version('torch').split('+')[0] != '2.13.0')" \
        2>/dev/null; then
    _ucm_say "installing torch==2.13.0 (CPU) into $VENV for the test extra (PyPI)"
    "$VENV/bin/python" -m pip install -q "torch==2.13.0"
fi
sources=$(cd "$ROOT" && cat pyproject.toml setup.py csrc/* 2>/dev/null | cksum | cut -d' ' -f1)
_ucm_current() {  # a stamp of these sources: for the extras asked, or any when none are
    local f
    for f in "$VENV/.ucmcache-installed-${EXTRAS:-base}" \
             $([ -z "$EXTRAS" ] && ls "$VENV"/.ucmcache-installed-* 2>/dev/null); do
        [ -f "$f" ] && [ "$(cat "$f")" = "$sources" ] && return 0
    done
    return 1
}
if ! _ucm_current || ! "$VENV/bin/python" -c "import ucmcache._core" 2>/dev/null; then
    _ucm_spec="."
    [ -n "$EXTRAS" ] && _ucm_spec=".[$EXTRAS]"
    _ucm_say "installing ucmcache from $ROOT (editable, building its C core)" \
             "${EXTRAS:+with the extras [$EXTRAS] }and its dependencies into $VENV (PyPI)"
    (cd "$ROOT" && "$VENV/bin/python" -m pip install -q --no-build-isolation -e "$_ucm_spec")
    echo "$sources" > "$VENV/.ucmcache-installed-${EXTRAS:-base}"
    unset _ucm_spec
fi
export PATH="$VENV/bin:$PATH"
