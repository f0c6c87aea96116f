"""Workers for tests/core/test_busy_reads.py: a process that only reads."""
import numpy as np

from ucmcache import SlotCache
from ucmcache.lowlevel import Gate

from workers import check_payload, run


def _read_when_told(uuid, rank, keys, first, attached_path, go_path):
    """Attach as `rank` (before the test's other steps: attaching recovers dead ranks), say so
    on the attached gate, wait for the go gate, then read every key: `first` ("getitem" or
    "read_many") first, then the other.  Returns (cache[key] answered each key's bytes,
    read_many answered them, this rank's misses and loads started)."""
    c = SlotCache.attach(uuid, rank=rank)
    attached, go = Gate(attached_path), Gate(go_path)
    try:
        attached.release()
        go.wait_value(1)

        def by_getitem():
            out = []
            for k in keys:
                try:
                    out.append(check_payload(k, c[k]))
                except KeyError:
                    out.append(False)
            return out

        def by_read_many():
            rows = np.zeros((len(keys), c.slot_size), dtype=np.uint8)
            lens = c.read_many(list(keys), rows)
            return [bool(n >= 0 and check_payload(k, rows[i, :n].tobytes()))
                    for i, (k, n) in enumerate(zip(keys, lens.tolist()))]

        if first == "getitem":
            getitem = by_getitem()
            read_many = by_read_many()
        else:
            read_many = by_read_many()
            getitem = by_getitem()
        mine = c.stats()["per_rank"]
        row = next(r for r in mine if r["rank"] == c.rank)
        return getitem, read_many, row["misses"], row["loads_started"]
    finally:
        attached.close()
        go.close()
        c.close()


def read_when_told(q, *args):
    run(_read_when_told, q, *args)
