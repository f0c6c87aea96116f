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
stamp="$VENV/.ucmcache-installed-$EXTRAS"
sources=$(cd "$ROOT" && cat pyproject.toml setup.py csrc/* 2>/dev/null | cksum | cut -d' ' -f1)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$sources" ] || ! "$VENV/bin/python" -c "import ucmcache._core" 2>/dev/null; then
    (cd "$ROOT" && "$VENV/bin/python" -m pip install -q --no-build-isolation -e ".[$EXTRAS]")
    echo "$sources" > "$stamp"
fi
export PATH="$VENV/bin:$PATH"
