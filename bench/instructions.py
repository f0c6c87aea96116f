"""Instruction counts of a reader's path, for valgrind's callgrind (repeatable where timings are
not).  One process, one rank, 64 keys of 4 KiB loaded first; then N reads of the chosen form:

    get    with c.get(k) as h: h.data[0]          (a hit's handle and its view, the byte read)
    batch  with c.get_many(keys) as hb: hb.data(i)[0] for all 64   (per key: N // 64 batches)
    hit    c.get_or_load(k, loader)               (a hit: pin, copy 4 KiB, release)
    cold   c.get_or_load(new key, loader)         (a miss that evicts: claim, install, the loader
                                                   returning 4 KiB it already has, copy, publish)
    full   c.get_or_load(new key, loader, timeout=60)   (cold's miss through the Python full
                                                   path: a timeout is not the C path's)
    acold  await c.aget_or_load(new key, loader)  (cold's miss as a coroutine, in one event loop)
    owner  with c.get(new key) as h: h.data[:n] = v; h.ready(n)   (get's owner path, evicting)
    put    c.put(new key, v)                      (evicting)

Per-read instructions are the slope between two runs, so the start-up and set-up cancel out:

    for n in 6400 32000; do PYTHONHASHSEED=0 valgrind --tool=callgrind \\
        --callgrind-out-file=/dev/null .venv/bin/python -m bench.instructions get $n 2>&1 \\
        | grep Collected; done        # (b - a) / 25600 = instructions per read

The miss path, base against this tree in the same session (a base worktree built in
place, `setup.py build_ext --inplace`, on PYTHONPATH with `python -P`):

    for n in 2000 10000; do PYTHONHASHSEED=0 valgrind --tool=callgrind \
        --callgrind-out-file=/dev/null .venv/bin/python -m bench.instructions cold $n 2>&1 \
        | grep Collected; done        # (b - a) / 8000 = instructions per cold get_or_load

The slope still moves by up to ~25% from run to run here (under `setarch -R` too): take the
median of at least 3 runs, each side of a comparison in the same session.
"""
import os
import sys

from ucmcache import SlotCache


def main(argv) -> None:
    what, n = argv[0], int(argv[1])
    if what not in ("get", "batch", "hit", "cold", "full", "acold", "owner", "put"):
        raise SystemExit("usage: python -m bench.instructions "
                         "get|batch|hit|cold|full|acold|owner|put N")
    uuid = f"bench-instr-{os.getpid()}"
    c = SlotCache.create(uuid, max_ranks=1, slots_per_rank=256, slot_size=4096)
    keys = [bytes([i % 251, i // 251]) * 8 for i in range(64)]
    try:
        for k in keys:
            c.get_or_load(k, lambda: b"x" * 4096)
        value = b"x" * 4096
        loader = lambda: value  # noqa: E731 (the value it already has: no allocation)
        # The cold keys: distinct, none of them loaded before; 256 slots, so every one evicts
        # once the cache is full (the first 192 fill free slots).
        cold = [i.to_bytes(8, "little") * 2 for i in range(1000, 1000 + n)]
        if what == "hit":
            for i in range(n):
                c.get_or_load(keys[i & 63], loader)
        elif what == "cold":
            for k in cold:
                c.get_or_load(k, loader)
        elif what == "full":
            for k in cold:
                c.get_or_load(k, loader, timeout=60.0)
        elif what == "acold":
            import asyncio

            async def load_all():
                for k in cold:
                    await c.aget_or_load(k, loader)
            asyncio.run(load_all())
        elif what == "owner":
            for k in cold:
                with c.get(k) as h:
                    h.data[:4096] = value
                    h.ready(4096)
        elif what == "put":
            for k in cold:
                c.put(k, value)
        elif what == "get":
            for i in range(n):
                with c.get(keys[i & 63]) as h:
                    h.data[0]
        else:
            for _ in range(n // 64):
                with c.get_many(keys) as hb:
                    for j in range(64):
                        hb.data(j)[0]
    finally:
        c.close()
        SlotCache.unlink(uuid)


if __name__ == "__main__":
    main(sys.argv[1:])
