"""What the tests of views, forks and close share (test_views.py, test_forks.py,
test_close.py): keys, a key's recognisable bytes, a put, each slot's reference word, slot
churn, and this process's open file descriptors."""
import os

K = [bytes([i]) * 16 for i in range(1, 40)]


def payload(k, n):
    """A key's bytes: its first byte and the position, so another key's bytes never match."""
    return bytes((k[0] * 7 + i) & 0xFF for i in range(n))


def put(c, k, n=None):
    n = c.slot_size if n is None else n
    return c.get_or_load(k, lambda: payload(k, n))


def _refs(c):
    from ucmcache.lowlevel import lib
    return [lib.ucm_load64(c._seg.base, c.layout.meta(s)) for s in range(c.capacity)]


def _churn(c, keys):
    """Load keys until every unpinned slot of a tiny segment has been reused."""
    for k in keys:
        put(c, k)



def _fds():
    return len(os.listdir("/proc/self/fd"))
