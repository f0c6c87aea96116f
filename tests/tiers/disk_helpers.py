"""What the disk tier's tests share (test_disk_*.py): the payload size and a tier's capacity,
fresh keys, a well-formed block, the segment fixture that closes and unlinks what a test made,
a counted load, a held read's gate left, and a small tmpfs for a real full disk."""
import os

import pytest

from ucmcache import SlotCache
from ucmcache.tiers.disk.fileformat import encode_header

import disk_workers as dw
from conftest import close_and_unlink, run_uuid
from workers import check_payload, payload_for

SIZE = dw.SIZE
CAP = 1 << 20


def _keys(n):
    return [os.urandom(16) for _ in range(n)]


def _block(key, size=SIZE, offset=0):
    data = payload_for(key, size)
    return encode_header(key, offset, data) + data


@pytest.fixture
def segs():
    """segs(**params) -> a created SlotCache on a fresh uuid of the run; every one is closed
    and unlinked after the test.  segs.recreate(cache, **params): unlink and create again."""
    made = []

    def make(uuid=None, **params):
        params.setdefault("slots_per_rank", 16)
        params.setdefault("slot_size", 256)
        params.setdefault("max_ranks", 4)
        u = uuid or run_uuid("d")
        made.append([u, None])
        made[-1][1] = c = SlotCache.create(u, **params)
        return c

    yield make
    close_and_unlink(made)


def _load(c, key, runs, size=SIZE):
    v = c.get_or_load(key, lambda: (runs.append(key), payload_for(key, size))[1], timeout=30)
    assert check_payload(key, bytes(v))


def _leave_gate(tier, g):
    """The held read is a thread of this process: release the gate (twice: also a read that
    reached it late) and wait until that thread has left it, before the fixture unmaps the
    gate's word under it.  With readers=1, a job submitted now runs after the held read."""
    g.release()
    g.release()
    tier._read_pool().submit(int).result(60)


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 64 KiB tmpfs mounted under tmp_path (unmounted after), or a skip where this machine
    does not let the test mount one (not root, no CAP_SYS_ADMIN)."""
    import subprocess
    where = tmp_path / "small"
    where.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(where)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip() or r.returncode}")
    try:
        yield str(where)
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)
