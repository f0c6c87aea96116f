"""The smoke test scripts/package runs in a clean venv with only the built wheel installed.

Run from outside the checkout (scripts/package runs it from a temporary folder), so
``import ucmcache`` finds the installed package, never the source tree: checked first.  It
exercises what an installed wheel must carry: both C extensions (the core through cffi and the
hit path), put and delete, a second process attaching to the segment, the CLI's entry points (``ucmcache``,
``python -m ucmcache``) and the license.  Exit 0 and one line "smoke ok ..." when all passed;
any failure raises (a traceback, exit 1).  Every segment it makes is unlinked, pass or fail.
"""
import importlib.metadata as md
import os
import subprocess
import sys
import sysconfig
import uuid as uuidlib

import numpy as np

import ucmcache
from ucmcache import SegmentNotFound, SlotCache, make_key

site = sysconfig.get_paths()["purelib"]
assert ucmcache.__file__.startswith(site), f"ucmcache imported from {ucmcache.__file__}, " \
    f"not from the venv's {site}"
import ucmcache._core  # noqa: E402,F401  (the C core, cffi)
import ucmcache._hit  # noqa: E402,F401   (the hit path, CPython types)
from ucmcache.core.checksum import crc32c  # noqa: E402  (CRC-32C, cffi)
assert crc32c(b"123456789") == 0xE3069283

dist = md.distribution("ucmcache")
assert dist.version == ucmcache.__version__, (dist.version, ucmcache.__version__)
license_files = [f for f in dist.files or () if f.name == "LICENSE"]
assert license_files, "no LICENSE in the installed distribution"
assert "MIT License" in license_files[0].read_text()

UUID = f"pkg-smoke-{os.getpid()}-{uuidlib.uuid4().hex[:10]}"
NS = "package-smoke"
CHILD = f"""
import sys
from ucmcache import SlotCache, make_key
c = SlotCache.attach({UUID!r})
try:
    def never():
        raise AssertionError("the child's loader ran: the parent's value was not shared")
    v = c.get_or_load(make_key(b"block-0", namespace={NS!r}), never)
    sys.stdout.write(v.decode())
finally:
    c.close()
"""


def value(i: int) -> bytes:
    return f"value-{i}:".encode() * (i + 1)


def disk_tier() -> None:
    """ucmcache.disktier is in the wheel: blocks written through survive the segment, and
    `ucmcache tier ls` reads the directory."""
    import json
    import shutil
    import tempfile
    from ucmcache import DiskTier
    where = tempfile.mkdtemp(prefix="ucmcache-smoke-disk-")
    u = UUID + "-disk"
    try:
        keys = [make_key(f"disk-{i}".encode(), namespace=NS) for i in range(4)]
        for round_ in range(2):
            tier = DiskTier(where, 1 << 20)
            c = SlotCache.create(u, slots_per_rank=8, slot_size=4096, max_ranks=2, tier2=tier)
            try:
                runs = []
                for i, k in enumerate(keys):
                    assert c.get_or_load(k, lambda i=i: runs.append(i) or value(i)) == value(i)
                assert runs == ([0, 1, 2, 3] if round_ == 0 else []), (round_, runs)
            finally:
                c.close()
                SlotCache.unlink(u)
        r = subprocess.run(["ucmcache", "tier", "ls", where, "--json"], capture_output=True,
                           text=True, timeout=60)
        assert r.returncode == 0 and json.loads(r.stdout)["files"] == 4, (r.returncode, r.stderr)
    finally:
        shutil.rmtree(where, ignore_errors=True)


def main() -> None:
    cache = SlotCache.create(UUID, slots_per_rank=32, slot_size=4096, max_ranks=4)
    try:
        keys = [make_key(f"block-{i}".encode(), namespace=NS) for i in range(8)]
        runs = []
        for i, k in enumerate(keys):
            got = cache.get_or_load(k, lambda i=i: runs.append(i) or value(i))
            assert got == value(i), (i, got)
        again = [cache.get_or_load(k, lambda: runs.append("again") or b"") for k in keys]
        assert again == [value(i) for i in range(8)], again
        assert runs == list(range(8)), f"loaders ran {runs}, expected once per key"

        out = np.zeros((len(keys), 4096), dtype=np.uint8)
        with cache.get_many(keys) as hb:
            assert not hb.owner.any(), hb.owner
            lengths = hb.gather(out)
        for i, n in enumerate(lengths.tolist()):
            assert out[i, :n].tobytes() == value(i), i

        child = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True,
                               timeout=60)
        assert child.returncode == 0, child.stderr
        assert child.stdout == value(0).decode(), child.stdout

        assert cache.entry_count() == 8, cache.entry_count()
        stats = cache.stats()
        assert stats["loads_started"] == 8, stats

        extra = make_key(b"put-0", namespace=NS)
        assert cache.put(extra, b"put value") is True
        assert cache.put(extra, b"other") is False, "a put over a Ready key must be skipped"
        assert extra in cache and cache[extra] == b"put value" and len(cache) == 9
        assert cache.delete(extra) is True and cache.delete(extra) is False
        assert extra not in cache and len(cache) == 8
        assert cache.delete_many(keys[:2]) == [True, True], "delete_many of two stored keys"
        assert len(cache) == 6 and keys[0] not in cache
        assert cache.stats()["deletes"] == 3, cache.stats()

        for argv in (["ucmcache", "inspect", UUID], [sys.executable, "-m", "ucmcache", "ls"]):
            r = subprocess.run(argv, capture_output=True, text=True, timeout=60)
            assert r.returncode == 0 and UUID in r.stdout, (argv, r.returncode, r.stderr)
        r = subprocess.run(["ucmcache", "demo"], capture_output=True, text=True, timeout=60)
        assert r.returncode == 2 and r.stderr.count("\n") == 1 and "checkout" in r.stderr, \
            ("ucmcache demo from a wheel", r.returncode, r.stderr)
    finally:
        cache.close()
        SlotCache.unlink(UUID)
    try:
        SlotCache.attach(UUID, timeout=0.1)
    except SegmentNotFound:
        pass
    else:
        raise AssertionError("the segment is still there after unlink")
    disk_tier()
    print(f"smoke ok: ucmcache {ucmcache.__version__} on Python "
          f"{sys.version.split()[0]} from {os.path.dirname(ucmcache.__file__)}")


main()
