# Sourced by scripts/test: make sure Debian's redis-server (and redis-cli) are installed for the
# tier-2 tests, which start their own servers (unix sockets and loopback ports in a temporary
# folder) and stop them.  Idempotent: installs only when missing, with apt-get, as root or with
# passwordless sudo; never starts the system service.  Without it the tier-2 tests skip.
# Before installing it says so on stderr: which packages, with what, as whom.
if ! command -v redis-server >/dev/null 2>&1 || ! command -v redis-cli >/dev/null 2>&1; then
    _ucm_sudo=""
    _ucm_can=""
    if [ "$(id -u)" = 0 ]; then
        _ucm_can=1
    elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
        _ucm_sudo="sudo -n"
        _ucm_can=1
    fi
    if [ -n "$_ucm_can" ] && command -v apt-get >/dev/null 2>&1; then
        _ucm_as="as root"
        [ -n "$_ucm_sudo" ] && _ucm_as="with sudo -n"
        echo "scripts/test: redis-server is missing: installing the Debian packages" \
             "redis-server and redis-tools for the tier-2 tests (apt-get update, then" \
             "apt-get install --no-install-recommends, $_ucm_as; the system service is kept" \
             "from starting)" >&2
        _ucm_policy=/usr/sbin/policy-rc.d
        _ucm_made_policy=""
        if [ ! -e "$_ucm_policy" ]; then  # keep the package from starting a system service
            if printf '#!/bin/sh\nexit 101\n' | $_ucm_sudo tee "$_ucm_policy" >/dev/null \
                    && $_ucm_sudo chmod 755 "$_ucm_policy"; then
                _ucm_made_policy=1
            fi
        fi
        if ! { $_ucm_sudo env DEBIAN_FRONTEND=noninteractive apt-get update -qq \
                && $_ucm_sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
                    --no-install-recommends redis-server redis-tools >/dev/null; }; then
            echo "scripts/test: could not install redis-server; the tier-2 tests will skip" >&2
        fi
        if [ -n "$_ucm_made_policy" ]; then
            $_ucm_sudo rm -f "$_ucm_policy"
        fi
    else
        echo "scripts/test: redis-server is missing and apt-get cannot run here; the tier-2" \
             "tests will skip (install redis-server to run them)" >&2
    fi
    unset _ucm_sudo _ucm_can _ucm_as _ucm_policy _ucm_made_policy
fi
true
