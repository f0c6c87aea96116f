"""A marking engine's scheduler for tests/engines/test_vllm_flight.py: intents taken and ended on
command, in a process of its own, so that the test can SIGKILL it between any two steps.

The worker reads commands from ``cmds`` and answers each on ``q`` (("ok", value) or
("error", text)); it blocks on the next command, so a kill lands exactly after a step.
"""
import traceback

from ucmcache import SlotCache
from ucmcache.engines.vllm.flight import Intents, exist_all_ranks, open_intents


def marker(q, cmds, main_uuid, max_ranks, keys, ranks):
    """Commands: ("lookup", req, limit, upto, stop_at_recheck) -> the answer; ("handed", req,
    n) -> None; ("save", n) -> publish keys[:n] Ready in the main segment for every rank;
    ("settle",); ("end", req, why, keep_handed); ("marked", req) -> keys marked; ("quit",)."""
    main = SlotCache.attach(main_uuid)
    intents = Intents(open_intents(main_uuid, max_ranks), peer_wait_s=30.0)
    q.put(("ok", intents.cache.rank))
    try:
        while True:
            cmd = cmds.get(timeout=60)
            op = cmd[0]
            if op == "quit":
                intents.close()
                main.close()
                q.put(("ok", None))
                return
            try:
                if op == "lookup":
                    _, req, limit, upto, stop = cmd
                    calls = []

                    def ready(ks):
                        calls.append(1)
                        if stop and len(calls) == 2:   # the frontier is ours, the rest not yet
                            q.put(("ok", "at-recheck"))
                            cmds.get(timeout=60)        # killed here
                        return main.exist_prefix(list(ks))

                    out = intents.lookup(req, keys, ready, limit=limit, upto=upto)
                elif op == "handed":
                    intents.handed(cmd[1], keys[:cmd[2]])
                    out = None
                elif op == "save":
                    for k in keys[:cmd[1]]:
                        for r in range(ranks):
                            with main.get(k if r == 0 else (k, r)) as h:
                                if h.owner:
                                    h.data[:4] = b"blk!"
                                    h.ready(4)
                    out = None
                elif op == "settle":
                    intents.settle(lambda ks: exist_all_ranks(main, ks, ranks))
                    out = None
                elif op == "end":
                    intents.end(cmd[1], cmd[2], keep_handed=cmd[3])
                    out = None
                elif op == "marked":
                    out = [keys.index(k) for k in intents.marked(cmd[1])]
                else:
                    raise ValueError(f"unknown command {op!r}")
                q.put(("ok", out))
            except BaseException as e:
                q.put(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    except BaseException as e:
        q.put(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
