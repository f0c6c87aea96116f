"""Prefetch rings: wrap-around, exact drops, cross-process posting, single flight with get,
prompt stop."""
import threading

import pytest

from ucmcache import SlotCache
from ucmcache.lowlevel import lib

import workers

DEPTH = lib.UCM_RING_DEPTH


def key(i):
    return i.to_bytes(8, "little") + b"prefetch"


class Recorder:
    """A loader that records each key and says when it has seen `target` of them."""

    def __init__(self):
        self.keys = []
        self.lock = threading.Lock()
        self.target = None
        self.reached = threading.Event()

    def expect(self, n):
        with self.lock:
            self.target = n
            self.reached.clear()
            if len(self.keys) >= n:
                self.reached.set()

    def __call__(self, k):
        with self.lock:
            self.keys.append(k)
            if self.target is not None and len(self.keys) >= self.target:
                self.reached.set()
        return b"v"


def test_full_ring_drops_and_counts_exactly(make_cache):
    c = make_cache(slots_per_rank=8, slot_size=16, max_ranks=2)
    assert c.prefetch([key(i) for i in range(DEPTH)]) == DEPTH
    assert c.prefetch([key(DEPTH + i) for i in range(10)]) == 0
    ring = c.stats()["rings"][c.rank]
    assert ring == {"depth": DEPTH, "posted": DEPTH, "dropped": 10, "already_present": 0}


def test_wrap_around_many_times_the_depth(make_cache):
    c = make_cache(slots_per_rank=64, slot_size=16, max_ranks=1)
    rec = Recorder()
    total = 0
    with c.prefetcher(rec, batch=128) as p:
        for round_ in range(12):                     # 12 x 3000 keys through a 4096 ring
            keys = [(key(round_ * 3000 + i), 0) for i in range(3000)]
            assert c.prefetch(keys) == 3000
            total += 3000
            rec.expect(total)
            assert rec.reached.wait(60), f"prefetcher stalled at {len(rec.keys)} of {total}"
        assert not p.errors
    assert rec.keys == [(key(i), 0) for i in range(total)]  # in order, none lost or repeated
    s = c.stats()
    assert s["rings"][0]["dropped"] == 0 and s["prefetched"] == total


def test_cross_process_producer_no_lost_or_duplicated_keys(make_cache, procs):
    c = make_cache(slots_per_rank=64, slot_size=16, max_ranks=3)
    rec = Recorder()
    keys = [key(i) for i in range(2000)]
    rec.expect(len(keys))
    with c.prefetcher(rec, batch=64):
        p, q = procs.start(workers.post_keys, c.uuid, c.rank, keys, 100)
        assert procs.result(q) == len(keys)
        assert rec.reached.wait(60)
    assert sorted(k for k, _ in rec.keys) == sorted(keys)
    assert len(rec.keys) == len(set(rec.keys))
    assert c.stats()["rings"][c.rank]["dropped"] == 0


def test_prefetch_racing_get_runs_the_loader_once(make_cache, procs):
    c = make_cache(slots_per_rank=8, slot_size=64, max_ranks=3)
    K = key(1)
    inside, release = threading.Event(), threading.Event()
    runs = []

    def slow_loader(k):
        runs.append(k)
        inside.set()
        assert release.wait(60)
        return workers.payload_for(k[0], 64)

    with c.prefetcher(slow_loader):
        c.prefetch([K])
        assert inside.wait(60)                        # the prefetcher owns K's load
        p, q = procs.start(workers.single_flight, c.uuid, [K], _opened_gate_path(), None, False)
        release.set()
        loader_runs, results = procs.result(q)
    assert loader_runs == 0 and results == [True]      # the other process joined the load
    assert len(runs) == 1 and c.stats()["loads_started"] == 1
    assert c.prefetch([K]) == 0                        # present now: skipped cheaply
    assert c.stats()["rings"][c.rank]["already_present"] == 1


_gates = []


def _opened_gate_path():
    from ucmcache.lowlevel import Gate
    g = Gate()
    g.release()
    _gates.append(g)
    return g.path


@pytest.fixture(autouse=True)
def _close_gates():
    yield
    while _gates:
        _gates.pop().close()


def test_stop_while_waiting_returns(make_cache):
    c = make_cache(slots_per_rank=8, slot_size=16, max_ranks=1)
    p = c.prefetcher(lambda k: b"")
    assert p.running
    p.stop(timeout=10)                                 # woken from its futex sleep
    assert not p.running


def test_bad_prefetch_arguments(make_cache):
    c = make_cache(slots_per_rank=8, slot_size=16, max_ranks=2)
    with pytest.raises(ValueError, match=r"rank must be None or an int in \[0, 2\), got 5"):
        c.prefetch([key(1)], rank=5)
    with pytest.raises(ValueError, match="batch must be an int"):
        c.prefetcher(lambda k: b"", batch=0)
    with pytest.raises(TypeError, match="loader must be callable"):
        c.prefetcher(None)


def test_close_stops_a_running_prefetcher(uuid):
    c = SlotCache.create(uuid, slots_per_rank=8, slot_size=16, max_ranks=1)
    p = c.prefetcher(lambda k: b"")
    with pytest.raises(Exception, match="already has a prefetcher"):
        c.prefetcher(lambda k: b"")
    c.close()                                          # stops and joins it before unmapping
    assert not p.running
