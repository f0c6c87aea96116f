"""What a SIGKILLed engine leaves in /dev/shm besides our segment: PyTorch's shared tensors
(psm_*) and multiprocessing's semaphores (sem.mp-*), which only their (dead) creators would
have unlinked.  The e2e runners remove those that appeared while the engine lived and that no
living process has mapped or open, so that a run leaves /dev/shm as it found it.  Our own
segment is never touched here (the runners remove it; its dead ranks are recovered by design)."""
from __future__ import annotations

import os

SHM = "/dev/shm"
PREFIXES = ("psm_", "sem.mp-")


def snapshot() -> set[str]:
    return {n for n in os.listdir(SHM) if n.startswith(PREFIXES)}


def _in_use() -> set[str]:
    """Names under /dev/shm that some process maps or holds open."""
    used: set[str] = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/maps", errors="replace") as f:
                for line in f:
                    at = line.find(SHM + "/")
                    if at >= 0:
                        used.add(line[at + len(SHM) + 1:].split()[0])
            for fd in os.listdir(f"/proc/{pid}/fd"):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith(SHM + "/"):
                    used.add(target[len(SHM) + 1:].split()[0])
        except OSError:
            continue  # gone, or not ours to read
    return used


def remove_orphans(before: set[str]) -> list[str]:
    """Unlink the entries made since `before` that nothing uses any more; returns their names."""
    new = snapshot() - before
    if not new:
        return []
    used = _in_use()
    gone = []
    for name in sorted(new - used):
        try:
            os.unlink(os.path.join(SHM, name))
            gone.append(name)
        except FileNotFoundError:
            pass
    return gone
