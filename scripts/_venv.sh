# Sourced by scripts/*: make .venv once, (re)install the package with the given extras when the
# sources changed, then put .venv first on PATH.  Idempotent; needs only python3 and PyPI.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
EXTRAS="${1:-test}"
PY="${PYTHON:-python3}"
if [ ! -x "$VENV/bin/python" ]; then
    "$PY" -m venv "$VENV"
    "$VENV/bin/python" -m pip install -q --upgrade pip setuptools wheel cffi
fi
# The test extra pins torch==2.13.0 (real CPU tensors for the UCM store tests).  It goes in
# first and alone, so that pip takes the CPU build lying on this machine's disk: torch asked for
# later, beside other packages, could resolve to a CUDA build of several GB.  Checked by its
# installed version (no import), so a second run installs nothing.
if [[ ",$EXTRAS," == *",test,"* ]] && ! "$VENV/bin/python" -c \
        "import importlib.metadata as m, sys; sys.exit(m.version('torch').split('+')[0] != '2.13.0')" \
        2>/dev/null; then
    "$VENV/bin/python" -m pip install -q "torch==2.13.0"
fi
stamp="$VENV/.ucmcache-installed-$EXTRAS"
sources=$(cd "$ROOT" && cat pyproject.toml setup.py csrc/* 2>/dev/null | cksum | cut -d' ' -f1)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$sources" ] || ! "$VENV/bin/python" -c "import ucmcache._core" 2>/dev/null; then
    (cd "$ROOT" && "$VENV/bin/python" -m pip install -q --no-build-isolation -e ".[$EXTRAS]")
    echo "$sources" > "$stamp"
fi
export PATH="$VENV/bin:$PATH"
