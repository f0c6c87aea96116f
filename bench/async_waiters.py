"""The event loop while many tasks await one cold key: the longest gap of a 10 ms
ticker while N tasks `aget_or_load` a key whose load another thread holds for LOAD_S, beside the
same N tasks awaiting one plain asyncio future per key that the other thread resolves (the floor:
what asyncio itself costs).  Three keys' worth of tasks is not needed: one key, N tasks.

    ./scripts/bench --async-waiters [--runs 3] [--sizes 50,200,1000]

Prints, per N, the longest ticker gap in ms for each (median [min-max] of the runs) and the
ratio of medians, and the total CPU time the process used meanwhile.
"""
import argparse
import asyncio
import os
import statistics
import threading
import time

from ucmcache import SlotCache

LOAD_S = 0.3
TICK_S = 0.01


async def _ticker(stop, gaps):
    last = time.perf_counter()
    while not stop.is_set():
        await asyncio.sleep(TICK_S)
        now = time.perf_counter()
        gaps.append(now - last)
        last = now


def _run_ucmcache(c, key, n):
    owning, release = threading.Event(), threading.Event()

    def owner():
        with c.get(key) as h:
            owning.set()
            release.wait(30)
            h.data[:5] = b"value"
            h.ready(5)

    t = threading.Thread(target=owner)
    t.start()
    owning.wait(10)

    async def main():
        stop, gaps = asyncio.Event(), []
        tick = asyncio.create_task(_ticker(stop, gaps))
        threading.Timer(LOAD_S, release.set).start()
        values = await asyncio.gather(*(c.aget_or_load(key, lambda: b"never", timeout=30)
                                        for _ in range(n)))
        stop.set()
        await tick
        assert values == [b"value"] * n
        return max(gaps)

    try:
        return asyncio.run(main())
    finally:
        release.set()
        t.join(30)


def _run_futures(n):
    async def main():
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        stop, gaps = asyncio.Event(), []
        tick = asyncio.create_task(_ticker(stop, gaps))
        threading.Timer(LOAD_S, lambda: loop.call_soon_threadsafe(fut.set_result, b"value")).start()

        async def one():
            return await asyncio.wait_for(asyncio.shield(fut), 30)

        values = await asyncio.gather(*(one() for _ in range(n)))
        stop.set()
        await tick
        assert values == [b"value"] * n
        return max(gaps)

    return asyncio.run(main())


def _fmt(xs):
    return f"{statistics.median(xs) * 1e3:.1f} [{min(xs) * 1e3:.1f}-{max(xs) * 1e3:.1f}]"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="bench.async_waiters", description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--sizes", default="50,200,1000")
    a = p.parse_args(argv)
    uuid = f"bench-async-{os.getpid()}"
    c = SlotCache.create(uuid, max_ranks=1, slots_per_rank=64, slot_size=64)
    try:
        print(f"longest gap of a {TICK_S * 1e3:.0f} ms ticker while N tasks await one key "
              f"loaded for {LOAD_S} s by another thread; ms, median [min-max] of {a.runs} runs")
        print(f"{'N':>6}  {'ucmcache aget_or_load':>24}  {'asyncio future (floor)':>24}  ratio")
        for n in [int(x) for x in a.sizes.split(",")]:
            ours, floor = [], []
            for r in range(a.runs):
                key = f"{n:08d}{r:08d}".encode()
                ours.append(_run_ucmcache(c, key, n))
                floor.append(_run_futures(n))
            ratio = statistics.median(ours) / statistics.median(floor)
            print(f"{n:>6}  {_fmt(ours):>24}  {_fmt(floor):>24}  {ratio:.2f}x")
    finally:
        c.close()
        SlotCache.unlink(uuid)


if __name__ == "__main__":
    main()
