"""What the UcmCacheStore tests share (test_ucm_store_*.py): torch where installed, the
store fixture that closes what a test opened, the default-segment fixture that removes what a
test made, a block's bytes and a worker store's config."""
import multiprocessing as mp
import os
import threading

import numpy as np
import pytest

import ucmcache
from ucmcache import SlotCache
from ucmcache.ucm import UcmCacheStore

import ucm_workers as W

try:
    import torch
except ImportError:  # pragma: no cover - torch is in the test extra
    torch = None

NEED_TORCH = pytest.mark.skipif(torch is None, reason="torch is not installed: ./scripts/test "
                                "installs torch==2.13.0 (CPU) first; the numpy tests cover the "
                                "same behaviour")
KINDS = [pytest.param("torch", marks=NEED_TORCH), "numpy"]
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BOUND = 30.0  # every event wait in these tests
SPAWN = mp.get_context("spawn")


@pytest.fixture
def stores():
    """stores(config) -> an open UcmCacheStore, closed at teardown (pass or fail)."""
    made = []

    def make(config):
        s = UcmCacheStore(config)
        made.append(s)
        return s

    yield make
    for s in reversed(made):
        s.close()


def _bytes(t):
    """A tensor's bytes as a uint8 numpy array (numpy arrays and torch tensors alike)."""
    if isinstance(t, np.ndarray):
        return t.view(np.uint8).reshape(-1)
    return t.view(torch.uint8).numpy().reshape(-1)


def _cfg(uuid, n_tensors=4, tensor_bytes=1024, **extra):
    return W.store_config(uuid, n_tensors, tensor_bytes, **extra)



@pytest.fixture
def default_segments():
    """Names of default segments a test makes: removed afterwards (they carry no run tag)."""
    names = []
    yield names
    for name in names:
        try:
            SlotCache.unlink(name)
        except ucmcache.SegmentNotFound:
            pass


def _gate(store, point, at, then=None):
    """Arm store's point on block `at`: set arrived, wait (bounded) for release, then run
    `then` (e.g. raise).  Returns (arrived, release)."""
    arrived, release = threading.Event(), threading.Event()

    def hit(i):
        if i == at:
            arrived.set()
            assert release.wait(BOUND), "never released"
            if then is not None:
                then()

    store._test_points[point] = hit
    return arrived, release
