"""e2e.shm.remove_orphans (what the e2e runners and the serving bench remove from /dev/shm after
killing engines) never unlinks what a live process still uses, whoever it is: a multiprocessing
semaphore is mapped only under the temporary name glibc made it with, so it is matched by inode."""
import multiprocessing as mp
import os

from e2e import shm


def test_a_live_semaphore_of_this_process_is_not_an_orphan():
    before = shm.snapshot()
    lock = mp.get_context("spawn").Lock()     # a named semaphore (sem.mp-*) kept for a child
    new = shm.snapshot() - before
    assert new, "the spawn context's Lock made no sem.mp-* entry"
    assert shm.remove_orphans(before) == []
    assert all(os.path.exists(os.path.join(shm.SHM, n)) for n in new)
    del lock


def test_an_entry_nothing_maps_or_holds_open_is_removed():
    before = shm.snapshot()
    name = f"psm_ucmtest{os.getpid()}"
    with open(os.path.join(shm.SHM, name), "wb") as f:
        f.write(b"x")
    assert name in shm.remove_orphans(before)
    assert not os.path.exists(os.path.join(shm.SHM, name))
