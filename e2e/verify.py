"""`ucmcache verify` of an e2e segment once every engine is gone.

vLLM's shutdown SIGKILLs an EngineCore that is slow to exit ("force killing remaining process
EngineCore", seen on a busy 2-core machine), so its store or scheduler never freed its rank.
By design the next process to attach recovers such a rank.  So: verify; if the only problems
are ranks of dead processes not recovered yet (and what they hold), attach once (as any next engine would) and
verify again, which must then be clean.  Any other problem is reported as is."""
from __future__ import annotations

import re
import subprocess
import sys

DEAD_RANK = re.compile(r"rank \d+: ready \(pid \d+\) but its process is dead \(not recovered yet\)"
                       # what such a rank still holds: arenas (a list that may wrap), pins,
                       # claims, loads (a killed engine's, or a stopped one's killed at the end)
                       r"|\d+ arena\(s\) owned by rank \d+, which is not alive: [\d, .]+"
                       r"|[\d, .]+"
                       r"|slot \d+: pinned by rank\(s\) \[[\d, ]+\] that are not alive"
                       r"|slot \d+: claimed by rank \d+, which is not alive"
                       r"|slot \d+: Loading, but its loader rank \d+ is not alive")


def _verify(segment: str, env: dict, cwd: str) -> tuple[int, str]:
    p = subprocess.run([sys.executable, "-m", "ucmcache.cli", "verify", segment], cwd=cwd,
                       env=env, capture_output=True, text=True, timeout=120)
    return p.returncode, (p.stdout + p.stderr).strip()


def only_dead_ranks(report: str) -> bool:
    lines = [ln.strip() for ln in report.splitlines()[1:] if ln.strip()]
    return bool(lines) and all(DEAD_RANK.fullmatch(ln) for ln in lines)


def verify(segment: str, env: dict, cwd: str) -> tuple[int, str, str | None]:
    """(exit code, report, the first report when dead ranks had to be recovered first)."""
    rc, text = _verify(segment, env, cwd)
    if rc == 0 or not only_dead_ranks(text):
        return rc, text, None
    p = subprocess.run([sys.executable, "-c", "import sys; from ucmcache import SlotCache; "
                        "SlotCache.attach(sys.argv[1]).close()", segment],
                       cwd=cwd, env=env, capture_output=True, text=True, timeout=120)
    if p.returncode != 0:
        return p.returncode, f"attach to recover dead ranks failed: {p.stderr.strip()}", text
    rc2, text2 = _verify(segment, env, cwd)
    return rc2, text2, text
