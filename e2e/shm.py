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


def _in_use() -> set[int]:
    """Inodes of the files under /dev/shm that some process maps or holds open.  By inode, not
    name: glibc's sem_open maps a file under a temporary name and then links it to the
    semaphore's name, so a live semaphore is mapped only under a name that is gone
    ("/dev/shm/sem.XXXXXX (deleted)"); matched by name, every live multiprocessing semaphore of
    every other process on the machine looked unused here, and was unlinked under it."""
    used: set[int] = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/maps", errors="replace") as f:
                for line in f:
                    if SHM + "/" in line:
                        fields = line.split(None, 5)   # addr perms offset dev inode path
                        if len(fields) >= 5 and fields[4].isdigit():
                            used.add(int(fields[4]))
            for fd in os.listdir(f"/proc/{pid}/fd"):
                try:
                    if os.readlink(f"/proc/{pid}/fd/{fd}").startswith(SHM + "/"):
                        used.add(os.stat(f"/proc/{pid}/fd/{fd}").st_ino)
                except OSError:
                    continue
        except OSError:
            continue  # gone, or not ours to read
    return used


def remove_orphans(before: set[str]) -> list[str]:
    """Unlink the entries made since `before` that nothing maps or holds open any more; returns
    their names."""
    new = snapshot() - before
    if not new:
        return []
    used = _in_use()
    gone = []
    for name in sorted(new):
        path = os.path.join(SHM, name)
        try:
            if os.stat(path).st_ino in used:
                continue
            os.unlink(path)
            gone.append(name)
        except FileNotFoundError:
            pass
    return gone
