"""Worker functions for spawned test processes (importable by module name in the children).

Each takes plain arguments (uuid, gate paths, a multiprocessing queue) and reports back through
the queue; gates and events order the steps, never sleep.
"""
import os
import traceback
import zlib

import ucmcache
import ucmcache.lowlevel
from ucmcache import SlotCache
from ucmcache.lowlevel import Gate


def payload_for(key: bytes, size: int) -> bytes:
    """A payload that carries its key and a checksum: a false hit or torn read is caught."""
    body = (key * (size // 16 + 1))[: max(0, size - 20)]
    data = key + body[: size - 20]
    return data + zlib.crc32(data).to_bytes(4, "little")


def fill_owned(batch, keys, size: int) -> None:
    """Fill and publish every position of a HandleBatch that came back owned."""
    for i, key in enumerate(keys):
        if batch.owner[i]:
            p = payload_for(key, size)
            batch.data(i)[: len(p)] = p
            batch.ready(i, len(p))


def check_payload(key: bytes, data: bytes) -> bool:
    return (len(data) >= 20 and data[:16] == key
            and zlib.crc32(data[:-4]).to_bytes(4, "little") == data[-4:])


def run(fn, q, *args):
    try:
        q.put(("ok", fn(*args)))
    except BaseException as e:  # report, do not hang the parent
        q.put(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


def _get_with_point(uuid, key, point, gate_path, rank=None, own_first=None):
    """Attach, arm `point` with a gate, get(key); return (owner, state, data, slot).
    `own_first`: a key to load before, so that this rank takes its share of the arenas."""
    c = SlotCache.attach(uuid, rank=rank)
    gate = Gate(gate_path) if gate_path else None
    try:
        if own_first is not None:
            c.get_or_load(own_first, lambda: b"mine")
        if point:
            c._arm(point, "gate", gate)
        with c.get(key) as h:
            data = bytes(h.data) if h.state == "ready" else None
            out = (h.owner, h.state, data, h.slot, c.rank)
            if h.owner:
                h.data[:3] = b"R!!"
                h.ready(3)
        return out
    finally:
        if gate:
            gate.close()
        c.close()


def get_with_point(q, *args):
    run(_get_with_point, q, *args)


def _single_flight(uuid, keys, start_path, loader_gate_path, fail):
    """get_or_load each key; count how often our loader ran."""
    c = SlotCache.attach(uuid)
    runs = []
    results = []
    start = Gate(start_path)
    try:
        start.wait_value(1)
        for k in keys:
            def loader(k=k):
                runs.append(k)
                if fail:
                    raise RuntimeError(f"boom {k.hex()}")
                return payload_for(k, 64)
            try:
                v = c.get_or_load(k, loader, timeout=30)
                results.append(check_payload(k, v))
            except ucmcache.LoadFailed as e:
                results.append(f"LoadFailed: {e}")
            except RuntimeError as e:
                results.append(f"own: {e}")
        return len(runs), results
    finally:
        start.close()
        c.close()


def single_flight(q, *args):
    run(_single_flight, q, *args)


def _wait_for_load(uuid, key, ready_path, timeout):
    """Get key (someone else is loading it), say so on the gate, then wait."""
    c = SlotCache.attach(uuid)
    ready = Gate(ready_path)
    try:
        with c.get(key) as h:
            assert not h.owner, "the waiter must not become the owner"
            ready.release()  # bump: "I hold a handle on the Loading slot"
            try:
                h.wait(timeout)
                return ("ready", bytes(h.data))
            except ucmcache.LoadFailed as e:
                return ("failed", str(e))
            except TimeoutError as e:
                return ("timeout", str(e))
    finally:
        ready.close()
        c.close()


def wait_for_load(q, *args):
    run(_wait_for_load, q, *args)


def _load_held(uuid, key, point, gate_path, value, fail_msg):
    """Own key's load and stop at a gate inside it (or die there with point action kill)."""
    c = SlotCache.attach(uuid)
    gate = Gate(gate_path) if gate_path else None
    try:
        with c.get(key) as h:
            assert h.owner
            if gate is not None:
                gate.release()          # arrived (value 1)
                gate.wait_value(2)      # released by the test
            if fail_msg:
                h.fail(fail_msg)
                return "failed"
            h.data[: len(value)] = value
            h.ready(len(value))
            return "ready"
    finally:
        if gate:
            gate.close()
        c.close()


def load_held(q, *args):
    run(_load_held, q, *args)


def _stress(uuid, seed, n_ops, n_keys):
    import random
    rnd = random.Random(seed)
    c = SlotCache.attach(uuid)
    size = c.slot_size
    bad = 0
    ops = {"get": 0, "exist": 0, "touch": 0, "full": 0, "loads": 0, "many": 0, "failed": 0}
    keys = [i.to_bytes(8, "little") * 2 for i in range(n_keys)]
    try:
        for _ in range(n_ops):
            r = rnd.random()
            k = keys[rnd.randrange(n_keys)]
            if r < 0.7:
                def loader(k=k):
                    ops["loads"] += 1
                    return payload_for(k, size)
                try:
                    v = c.get_or_load(k, loader, timeout=30)
                except ucmcache.LoadFailed:  # its owner's batch gave up (CacheFull there)
                    ops["failed"] += 1
                    continue
                ops["get"] += 1
                if not check_payload(k, v):
                    bad += 1
            elif r < 0.8:
                batch = [keys[rnd.randrange(n_keys)] for _ in range(4)]
                try:
                    with c.get_many(batch) as b:
                        fill_owned(b, batch, size)
                        b.wait(30)
                        for i, key in enumerate(batch):
                            if not check_payload(key, bytes(b.data(i))):
                                bad += 1
                except ucmcache.CacheFull:
                    ops["full"] += 1
                except ucmcache.LoadFailed:
                    ops["failed"] += 1
                ops["many"] += 1
            elif r < 0.9:
                c.exist([keys[rnd.randrange(n_keys)] for _ in range(8)])
                ops["exist"] += 1
            else:
                c.touch([keys[rnd.randrange(n_keys)] for _ in range(8)])
                ops["touch"] += 1
        return bad, ops
    finally:
        c.close()


def stress(q, *args):
    run(_stress, q, *args)


def _hold_pin_then_die(uuid, key, gate_path):
    """Pin key (loading or not), tell the test, then block until killed."""
    c = SlotCache.attach(uuid)
    gate = Gate(gate_path)
    h = c.get(key)
    gate.release()
    gate.wait_value(10 ** 9, timeout=120)  # until SIGKILLed
    h.close()
    c.close()


def hold_pin_then_die(q, *args):
    run(_hold_pin_then_die, q, *args)


def _die_at(uuid, key, point, rank=None):
    """Arm `point` with kill and get(key) as owner: SIGKILLed at that point."""
    c = SlotCache.attach(uuid, rank=rank)
    c._arm(point, "kill")
    with c.get(key) as h:
        if h.owner:
            ucmcache.lowlevel.hooks._armed and ucmcache.lowlevel.hooks.fire("inside_loader")
            h.data[:4] = b"dead"
            h.ready(4)
    c.close()
    return "survived"


def die_at(q, *args):
    run(_die_at, q, *args)


def _lock_stripe_and_die(uuid, stripe, gate_path):
    c = SlotCache.attach(uuid)
    gate = Gate(gate_path)
    c._stripes.lock(stripe)
    gate.release()
    gate.wait_value(10 ** 9, timeout=120)  # until SIGKILLed


def lock_stripe_and_die(q, *args):
    run(_lock_stripe_and_die, q, *args)


def _attach_and_report(uuid, rank):
    c = SlotCache.attach(uuid, rank=rank)
    try:
        return c.rank, os.getpid()
    finally:
        c.close()


def attach_and_report(q, *args):
    run(_attach_and_report, q, *args)


def _create_or_attach(uuid, start_path, exist_ok):
    start = Gate(start_path)
    try:
        start.wait_value(1)
        try:
            c = SlotCache.create(uuid, slots_per_rank=8, slot_size=64, max_ranks=4,
                                 exist_ok=exist_ok)
        except ucmcache.SegmentExists:
            return "exists"
        try:
            with c.get(b"\x01" * 16) as h:
                if h.owner:
                    h.data[:1] = b"!"
                    h.ready(1)
            return "created-or-attached"
        finally:
            c.close()
    finally:
        start.close()


def create_or_attach(q, *args):
    run(_create_or_attach, q, *args)


def _create_held_before_magic(uuid, gate_path, action):
    from ucmcache.lowlevel import hooks as _hooks
    gate = Gate(gate_path) if gate_path else None
    _hooks.arm_python("before_magic", action, gate)
    c = SlotCache.create(uuid, slots_per_rank=8, slot_size=64, max_ranks=2)
    c.close()
    return "created"


def create_held_before_magic(q, *args):
    run(_create_held_before_magic, q, *args)


def _load_as_rank(uuid, rank, keys):
    c = SlotCache.attach(uuid, rank=rank)
    try:
        for k in keys:
            c.get_or_load(k, lambda k=k: payload_for(k, 64))
        return c.rank
    finally:
        c.close()


def load_as_rank(q, *args):
    run(_load_as_rank, q, *args)


def _die_at_point(uuid, rank, key, point):
    """As `rank`, arm `point` to SIGKILL this process, then get(key) (and fill it if owner)."""
    c = SlotCache.attach(uuid, rank=rank)
    if point in ucmcache.lowlevel.hooks.PY_POINTS:
        ucmcache.lowlevel.hooks.arm_python(point, "kill")
    else:
        c._arm(point, "kill")
    v = c.get_or_load(key, lambda: payload_for(key, 64))
    c.close()
    return "survived: " + v[:4].hex()


def die_at_point(q, *args):
    run(_die_at_point, q, *args)


def _get_or_load_value(uuid, key, value, gate_path, fail):
    """get_or_load(key) with a loader that returns `value` (or raises); with a gate, the loader
    stops at the `inside_loader` point until the test opens it."""
    c = SlotCache.attach(uuid)
    gate = Gate(gate_path) if gate_path else None
    runs = []
    try:
        if gate is not None:
            ucmcache.lowlevel.hooks.arm_python("inside_loader", "gate", gate)

        def loader():
            runs.append(1)
            if fail:
                raise ValueError(f"loader of {value!r} failed")
            return value
        try:
            return ("value", c.get_or_load(key, loader, timeout=30), len(runs))
        except ValueError as e:
            return ("error", str(e), len(runs))
    finally:
        if gate:
            gate.close()
        c.close()


def get_or_load_value(q, *args):
    run(_get_or_load_value, q, *args)


def _post_keys(uuid, rank, keys, chunk):
    c = SlotCache.attach(uuid)
    try:
        posted = 0
        for i in range(0, len(keys), chunk):
            posted += c.prefetch(keys[i:i + chunk], rank=rank)
        return posted
    finally:
        c.close()


def post_keys(q, *args):
    run(_post_keys, q, *args)


def _attach_and_recover(uuid, start_path):
    start = Gate(start_path)
    try:
        start.wait_value(1)
        c = SlotCache.attach(uuid)
        try:
            c.recover()
            return c.rank
        finally:
            c.close()
    finally:
        start.close()


def attach_and_recover(q, *args):
    run(_attach_and_recover, q, *args)


def _load_then_publish_at(uuid, key, gate_path, point, own_first, in_c=None):
    """Take our share (load own_first), then own `key`'s load, arrive at the gate, wait for the
    test's release, then publish with `point` armed to kill (None: publish and return).
    in_c True: the owner's handle must be get()'s C-made one (its token in C, its ready()
    ucm_token_publish)."""
    c = SlotCache.attach(uuid)
    gate = Gate(gate_path)
    try:
        c.get_or_load(own_first, lambda: b"mine")
        with c.get(key) as h:
            assert h.owner
            if in_c:
                assert h._token is None, "not the C-made owner's handle"
            gate.release()          # arrived (value 1)
            gate.wait_value(2)      # released by the test
            if point:
                c._arm(point, "kill")
            h.data[:5] = b"value"
            h.ready(5)
            return h.slot
    finally:
        gate.close()
        c.close()


def load_then_publish_at(q, *args):
    run(_load_then_publish_at, q, *args)


def _cold_load_at(uuid, key, gate_path, point, action):
    """get_or_load(key) through the C path (a plain id, no timeout), its loader held at the
    `inside_loader` gate until the test opens it, then `point` (a C point of the finish, or a
    Python point after the loader) armed with `action` ("kill", or "gate" on the same gate)."""
    c = SlotCache.attach(uuid)
    gate = Gate(gate_path)
    try:
        c.get_or_load(b"own-first-" + key[:6], lambda: b"mine")  # our share of the arenas
        ucmcache.core.hooks.arm_python("inside_loader", "gate", gate)

        def loader():
            if point in ucmcache.core.hooks.PY_POINTS:
                ucmcache.core.hooks.arm_python(point, action, gate if action == "gate" else None)
            else:
                c._arm(point, action, gate if action == "gate" else None)
            return payload_for(key, 64)
        return c.get_or_load(key, loader)
    finally:
        gate.close()
        c.close()


def cold_load_at(q, *args):
    run(_cold_load_at, q, *args)
