"""Worker functions for the tier-2 tests: spawned processes, one "node" being one segment.

Each attaches to its node's segment with a RedisTier built from a plain config dict, reports
through a queue (see workers.run), and counts how often its own loader ran.  Events and gates
order the steps across processes; nothing sleeps.
"""
import random

from ucmcache import RedisTier, SlotCache
from ucmcache.lowlevel import hooks as _hooks

from workers import check_payload, payload_for, run

SIZE = 200  # payload bytes (slot_size is 256 in these tests)


def _t2(cache, before=None):
    row = cache.stats()["per_rank"][cache.rank]
    now = {k: v for k, v in row.items() if k.startswith("t2_")}
    if before is None:
        return now
    return {k: now[k] - before[k] for k in now}


def _load_keys(uuid, cfg, keys, seed, start_path, mode):
    """get_or_load (mode 'one') or get_many (mode 'many') every key, in an order of our own."""
    from ucmcache.lowlevel import Gate
    c = SlotCache.attach(uuid, tier2=RedisTier(**cfg))
    runs = []
    ok = True
    try:
        before = _t2(c)
        if start_path:
            g = Gate(start_path)
            try:
                g.wait_value(1)
            finally:
                g.close()
        order = list(keys)
        random.Random(seed).shuffle(order)
        if mode == "one":
            for k in order:
                v = c.get_or_load(k, lambda k=k: (runs.append(k), payload_for(k, SIZE))[1],
                                  timeout=30)
                ok = ok and check_payload(k, v)
        else:
            with c.get_many(order, timeout=30) as b:
                for i, k in enumerate(order):
                    if b.owner[i]:
                        runs.append(k)
                        b.data(i)[:SIZE] = payload_for(k, SIZE)
                        b.ready(i, SIZE)
                b.wait(30)
                ok = all(check_payload(k, bytes(b.data(i))) for i, k in enumerate(order))
        return {"runs": len(runs), "ok": ok, "t2": _t2(c, before)}
    finally:
        c.close()


def load_keys(q, *args):
    run(_load_keys, q, *args)


def _hold_lease(uuid, cfg, key, loading_ev, go_ev):
    """Load key; the loader says it started (so our lease is taken) and waits for go_ev."""
    c = SlotCache.attach(uuid, tier2=RedisTier(**cfg))
    runs = []

    def loader():
        runs.append(key)
        loading_ev.set()
        if not go_ev.wait(30):
            raise TimeoutError("go_ev never came")
        return payload_for(key, SIZE)
    try:
        before = _t2(c)
        v = c.get_or_load(key, loader, timeout=30)
        return {"runs": len(runs), "ok": check_payload(key, v), "t2": _t2(c, before)}
    finally:
        c.close()


def hold_lease(q, *args):
    run(_hold_lease, q, *args)


def _wait_lease(uuid, cfg, key, loading_ev, gate_path):
    """Once another node is loading key, load it too: we must wait for its lease (held at the
    gate when we start to), then get its value, or take over if its holder died."""
    from ucmcache.lowlevel import Gate
    c = SlotCache.attach(uuid, tier2=RedisTier(**cfg))
    runs = []
    gate = Gate(gate_path)
    _hooks.arm_python("lease_wait", "gate", gate)
    try:
        before = _t2(c)
        if not loading_ev.wait(30):
            raise TimeoutError("the other node never started loading")
        v = c.get_or_load(key, lambda: (runs.append(key), payload_for(key, SIZE))[1],
                          timeout=30)
        return {"runs": len(runs), "ok": check_payload(key, v), "t2": _t2(c, before)}
    finally:
        _hooks.arm_python("lease_wait", "none")
        gate.close()
        c.close()


def wait_lease(q, *args):
    run(_wait_lease, q, *args)
