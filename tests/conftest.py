"""Shared fixtures: unique segment uuids that are always removed, and /dev/shm hygiene."""
import os
import sys
import uuid as uuidlib

import pytest

# The modules the tests' other processes run (tests/processes/: workers.py and the *_workers.py
# of each test file) import as top-level modules, here and in spawned children (spawn hands
# them this sys.path).
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "processes"))

from ucmcache import SlotCache, SegmentNotFound  # noqa: E402


# Every segment a test makes carries this run's pid between dashes ("t-<pid>-<hex>", made by
# the fixtures below or the same pattern in a test): the hygiene check counts only those, so a
# segment another process of this machine makes meanwhile is never blamed on the suite.
RUN_TAG = f"-{os.getpid()}-"


def run_uuid(prefix="t"):
    """A fresh segment uuid of this run (see RUN_TAG)."""
    return f"{prefix}{RUN_TAG}{uuidlib.uuid4().hex[:10]}"


def _ours():
    return {n for n in os.listdir("/dev/shm") if n.startswith("ucmcache-") and RUN_TAG in n}


@pytest.fixture(scope="session", autouse=True)
def shm_left_as_found():
    before = _ours()
    yield
    left = _ours() - before
    assert not left, f"tests left segments in /dev/shm: {sorted(left)}"


def close_and_unlink(made):
    """A fixture's teardown: each [uuid, cache or None] closed (quietly) and its segment
    unlinked, pass or fail."""
    for u, c in made:
        try:
            if c is not None:
                c.close()
        except Exception:
            pass
        try:
            SlotCache.unlink(u)
        except SegmentNotFound:
            pass


@pytest.fixture
def uuid():
    """A fresh uuid; the segment (if any) is unlinked after the test, pass or fail."""
    u = run_uuid()
    yield u
    try:
        SlotCache.unlink(u)
    except SegmentNotFound:
        pass


@pytest.fixture
def make_cache(uuid):
    """make_cache(**params) -> a created SlotCache on the test's uuid, closed afterwards."""
    made = []

    def make(**params):
        params.setdefault("slots_per_rank", 16)
        params.setdefault("slot_size", 256)
        params.setdefault("max_ranks", 4)
        c = SlotCache.create(uuid, **params)
        made.append(c)
        return c

    yield make
    for c in made:
        try:
            c.close()
        except Exception:
            pass


import multiprocessing as mp  # noqa: E402

SPAWN = mp.get_context("spawn")


class Procs:
    """Spawned worker processes for one test; every one is killed and joined at teardown."""

    def __init__(self):
        self.procs = []
        self.queues = []

    def start(self, fn, *args):
        q = SPAWN.Queue()
        p = SPAWN.Process(target=fn, args=(q,) + args, daemon=True)
        p.start()
        self.procs.append(p)
        self.queues.append(q)  # a queue collected before the child unpickles it breaks the child
        return p, q

    @staticmethod
    def result(q, timeout=60):
        status, value = q.get(timeout=timeout)
        if status != "ok":
            raise AssertionError(f"worker failed: {value}")
        return value

    def cleanup(self):
        for p in self.procs:
            if p.is_alive():
                p.kill()
            p.join(10)


@pytest.fixture
def procs():
    p = Procs()
    yield p
    p.cleanup()


@pytest.fixture
def gate():
    """gate() -> a fresh Gate; all are released and removed at teardown."""
    from ucmcache.lowlevel import Gate
    made = []

    def make(timeout=30.0):
        g = Gate(timeout=timeout)
        made.append(g)
        return g

    yield make
    for g in made:
        g.__exit__(None, None, None)
