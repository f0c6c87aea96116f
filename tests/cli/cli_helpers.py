"""What the `ucmcache` command's tests share (test_cli_*.py): the command run as a subprocess,
its one-line errors, the segment-naming fixture that removes what a test made, and segments
made in the states the command reports (orphaned, half made, incompatible, not ucmcache's)."""
import json
import os
import re
import struct
import subprocess
import sys
import uuid as uuidlib

import pytest

from ucmcache import SlotCache
from ucmcache.cli import _render
from ucmcache.lowlevel import lib
from ucmcache.lowlevel import PREFIX, SHM_DIR

WAIT = 30.0          # bound on every wait for a worker
PARAMS = dict(slots_per_rank=16, slot_size=64, max_ranks=4)
VERSION = lib.UCM_LAYOUT_VERSION
ERROR_LINE = re.compile(r"\Aucmcache: error: [^\n]+\n\Z")
CREATE = ["create", "--slots-per-rank", "4", "--slot-size", "64"]     # the uuid goes second


def path_of(u):
    return os.path.join(SHM_DIR, PREFIX + u)


def run(*args, timeout=60):
    return subprocess.run([sys.executable, "-m", "ucmcache.cli", *map(str, args)],
                          capture_output=True, text=True, timeout=timeout)


def assert_fits(text):
    long = [line for line in text.splitlines() if len(line) > _render.WIDTH]
    assert not long, f"lines wider than {_render.WIDTH} columns: {long}"


def assert_one_error_line(r, code, pattern):
    assert r.returncode == code, (r.returncode, r.stdout, r.stderr)
    assert ERROR_LINE.match(r.stderr), repr(r.stderr)
    assert "Traceback" not in r.stderr + r.stdout
    assert re.search(pattern, r.stderr), r.stderr


def ls_json():
    r = run("ls", "--json")
    assert r.returncode == 0, r.stderr
    return {row["uuid"]: row for row in json.loads(r.stdout)}


@pytest.fixture
def names():
    """names(tag='') -> a fresh uuid under this test's prefix; every one is removed afterwards."""
    prefix = f"t-{os.getpid()}-{uuidlib.uuid4().hex[:8]}-"
    made = []

    def make(tag="s"):
        u = prefix + tag
        made.append(u)
        return u

    make.prefix = prefix
    yield make
    for u in made:
        try:
            os.unlink(path_of(u))
        except FileNotFoundError:
            pass
    assert not [n for n in os.listdir(SHM_DIR) if n.startswith(PREFIX + prefix)]


def make_orphan(u):
    SlotCache.create(u, **PARAMS).close()


def make_half_made(u):
    """A segment whose creator died after writing its pid, before the magic (DESIGN 5)."""
    p = subprocess.Popen(["true"])
    p.wait(WAIT)
    fd = os.open(path_of(u), os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, 4096)
        os.pwrite(fd, struct.pack("<I", p.pid), lib.UCM_H_CREATOR_PID)
    finally:
        os.close(fd)


def make_incompatible(u):
    make_orphan(u)
    fd = os.open(path_of(u), os.O_RDWR)
    try:
        os.pwrite(fd, struct.pack("<I", 99), lib.UCM_H_VERSION)
    finally:
        os.close(fd)


def make_not_ucmcache(u):
    fd = os.open(path_of(u), os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, 4096)
        os.pwrite(fd, struct.pack("<Q", 0x1234_5678_9ABC_DEF0), lib.UCM_H_MAGIC)
    finally:
        os.close(fd)
