"""Single flight across engines (ucmcache.engines.vllm.flight, DESIGN 4.15) without an engine: a
scheduler's intents seen by another process's scheduler, which waits for them; intents ended
when their blocks are Ready, or their request ends without saving; a marker SIGKILLed at each
step recovered by the next look; the bound on a wait; no wait for one's own marks; TP."""
import os
import signal

import pytest

import ucmcache
from ucmcache import SegmentNotFound, SlotCache
from ucmcache.engines.vllm.flight import (CREDIT_WAITS, MARK_GRACE_S, PROBE_INTERVAL_S, Intents,
                                          exist_all_ranks, intents_uuid, open_intents)
from conftest import SPAWN
import flight_workers

N = 8
KEYS = [bytes([i + 1]) * 16 for i in range(N)]


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


@pytest.fixture
def main(uuid):
    """The main segment (slots of 64 bytes stand for KV blocks) and its intents segment,
    both removed after the test."""
    c = SlotCache.create(uuid, slots_per_rank=64, slot_size=64, max_ranks=4)
    yield c
    c.close()
    try:
        SlotCache.unlink(intents_uuid(uuid))
    except SegmentNotFound:
        pass


@pytest.fixture
def schedulers(main):
    """schedulers(peer_wait_s=...) -> an Intents of a scheduler of its own (its own rank in
    the intents segment) and its clock; all closed after the test."""
    made = []

    def make(peer_wait_s=10.0):
        clock = Clock()
        f = Intents(open_intents(main.uuid, 4), peer_wait_s=peer_wait_s, clock=clock)
        made.append(f)
        return f, clock

    yield make
    for f in made:
        f.close()


def ready_in(main, ranks=1):
    calls = []

    def ready(ks):
        calls.append(len(ks))
        return len(ks) if not ks else min(
            main.exist_prefix([k if r == 0 else (k, r) for k in ks]) for r in range(ranks))
    ready.calls = calls
    return ready


def save(main, keys, ranks=(0,)):
    """What a worker's save does in the end: each block's shard Ready in the main segment."""
    for k in keys:
        for r in ranks:
            with main.get(k if r == 0 else (k, r)) as h:
                if h.owner:
                    h.data[:4] = b"blk!"
                    h.ready(4)


def intent_state(main, key):
    """The intent entry of ``key`` as a third party sees it: 'loading', or None when there is
    none a get would join (one made here is failed at once)."""
    with SlotCache.attach(intents_uuid(main.uuid)) as c:
        with c.get(key) as h:
            if h.owner:
                h.fail("probe")
                return None
            return h.state


# ---------------------------------------------------------------- in one process, two ranks


def test_a_block_another_scheduler_marks_is_waited_for_then_loaded(main, schedulers):
    a, _ = schedulers()
    b, bclock = schedulers()
    ready = ready_in(main)
    assert a.lookup("ra", KEYS, ready, limit=N - 1, upto=N) == 0    # computes all of it
    assert a.marked("ra") == KEYS
    assert b.lookup("rb", KEYS, ready, limit=N - 1, upto=N) is None   # marked by a: waits
    assert b.marked("rb") == [] and b.waiting("rb")
    # a's first step computes and saves 4 blocks; its next step ends their intents
    a.handed("ra", KEYS[:4])
    save(main, KEYS[:4])
    a.settle(lambda ks: exist_all_ranks(main, ks, 1))
    assert a.marked("ra") == KEYS[4:] and a.stats.ended_ready == 4
    bclock.t += PROBE_INTERVAL_S
    assert b.lookup("rb", KEYS, ready, limit=N - 1, upto=N) is None   # the frontier moved to 4
    a.handed("ra", KEYS[4:])
    save(main, KEYS[4:])
    a.settle(lambda ks: exist_all_ranks(main, ks, 1))
    assert a.marked("ra") == []
    bclock.t += PROBE_INTERVAL_S
    assert b.lookup("rb", KEYS, ready, limit=N - 1, upto=N) == N - 1  # all loaded, none computed
    assert b.marked("rb") == KEYS[N - 1:]   # the one vLLM computes anyway (the last token's)
    assert b.stats.waits == 2 and b.stats.waited_requests == 1 and b.stats.gave_up == 0


def test_a_waiting_request_is_looked_at_once_per_probe_interval(main, schedulers):
    a, _ = schedulers()
    b, bclock = schedulers()
    a.lookup("ra", KEYS, ready_in(main), limit=N, upto=N)
    ready = ready_in(main)
    assert b.lookup("rb", KEYS, ready, limit=N, upto=N) is None
    looked = len(ready.calls)
    for _ in range(100):   # a hot scheduler loop: no look, no segment access
        assert b.lookup("rb", KEYS, ready, limit=N, upto=N) is None
    assert len(ready.calls) == looked
    bclock.t += PROBE_INTERVAL_S
    assert b.lookup("rb", KEYS, ready, limit=N, upto=N) is None
    assert len(ready.calls) > looked


def test_the_wait_is_bounded_by_peer_wait_s_without_progress(main, schedulers):
    a, _ = schedulers()
    b, bclock = schedulers(peer_wait_s=2.0)
    a.lookup("ra", KEYS, ready_in(main), limit=N, upto=N)
    assert b.lookup("rb", KEYS, ready_in(main), limit=N, upto=N) is None
    bclock.t += 1.5
    assert b.lookup("rb", KEYS, ready_in(main), limit=N, upto=N) is None
    a.handed("ra", KEYS[:2])             # progress: the clock starts again at block 2
    save(main, KEYS[:2])
    a.settle(lambda ks: exist_all_ranks(main, ks, 1))
    bclock.t += 1.0
    assert b.lookup("rb", KEYS, ready_in(main), limit=N, upto=N) is None
    bclock.t += 1.9
    assert b.lookup("rb", KEYS, ready_in(main), limit=N, upto=N) is None
    bclock.t += 0.1                      # 2.0 s at block 2: computes blocks 2.. itself
    assert b.lookup("rb", KEYS, ready_in(main), limit=N, upto=N) == 2
    assert b.stats.gave_up == 1 and b.marked("rb") == []   # every one is a's: none to take
    bclock.t += 100.0
    assert b.lookup("rb", KEYS, ready_in(main), limit=N, upto=N) == 2  # never waits again


def test_a_block_any_waiting_request_sees_ready_restarts_every_waits_clock(main, schedulers):
    """A peer computes its prompts in turn: while it computes the first, the request waiting
    for the second sees none of its own blocks Ready, and must not give up for that."""
    a, _ = schedulers()
    b, bclock = schedulers(peer_wait_s=2.0)
    first, second = KEYS[:4], KEYS[4:]
    a.lookup("ra1", first, ready_in(main), limit=4, upto=4)
    a.lookup("ra2", second, ready_in(main), limit=4, upto=4)
    assert b.lookup("rb1", first, ready_in(main), limit=4, upto=4) is None
    assert b.lookup("rb2", second, ready_in(main), limit=4, upto=4) is None
    bclock.t += 1.5
    a.handed("ra1", first[:2])             # a's step: the first prompt's first blocks
    save(main, first[:2])
    a.settle(lambda ks: exist_all_ranks(main, ks, 1))
    assert b.lookup("rb1", first, ready_in(main), limit=4, upto=4) is None   # at block 2 now
    bclock.t += 1.0                        # rb2 waited 2.5 s, 1.0 s since a's progress
    assert b.lookup("rb2", second, ready_in(main), limit=4, upto=4) is None
    assert b.stats.gave_up == 0
    bclock.t += 1.0                        # 2.0 s without progress: both compute
    assert b.lookup("rb2", second, ready_in(main), limit=4, upto=4) == 0
    assert b.lookup("rb1", first, ready_in(main), limit=4, upto=4) == 2
    assert b.stats.gave_up == 2


def test_progress_counts_only_for_the_rank_it_waits_for_and_borrowed_progress_is_bounded(
        main, schedulers):
    """Blocks another engine (c) saves do not keep a request waiting for a stalled one (a);
    a's own progress on another prompt keeps it waiting at most CREDIT_WAITS x peer_wait_s."""
    a, _ = schedulers()
    c, _ = schedulers()
    b, bclock = schedulers(peer_wait_s=2.0)
    first, second, third = KEYS[:4], KEYS[4:8], [bytes([0x40 + i]) * 16 for i in range(40)]
    c.lookup("rc", first, ready_in(main), limit=4, upto=4)
    a.lookup("ra", second, ready_in(main), limit=4, upto=4)
    assert b.lookup("rb1", first, ready_in(main), limit=4, upto=4) is None
    assert b.lookup("rb2", second, ready_in(main), limit=4, upto=4) is None
    bclock.t += 1.5
    c.handed("rc", first[:2])              # c progresses; a, which rb2 waits for, does not
    save(main, first[:2])
    assert b.lookup("rb1", first, ready_in(main), limit=4, upto=4) is None
    bclock.t += 0.5
    assert b.lookup("rb2", second, ready_in(main), limit=4, upto=4) == 0   # 2.0 s: computes
    # a progresses on a long prompt (one block a second) while its mark at rb3's block stays
    a.lookup("ra3", third, ready_in(main), limit=40, upto=40)
    assert b.lookup("rb3", [second[1]], ready_in(main), limit=1, upto=1) is None
    assert b.lookup("rb4", third, ready_in(main), limit=40, upto=40) is None
    t0 = bclock.t
    for i in range(40):
        bclock.t += 1.0
        save(main, third[i:i + 1])
        assert b.lookup("rb4", third, ready_in(main), limit=40, upto=40) is None
        if b.lookup("rb3", [second[1]], ready_in(main), limit=1, upto=1) is not None:
            break
    assert bclock.t - t0 == pytest.approx(CREDIT_WAITS * 2.0)
    assert b.stats.gave_up == 2


def test_an_idle_step_sleeps_until_the_next_look_and_a_busy_one_never(main, schedulers):
    """pace_idle_step: a step that scheduled nothing while a request waits sleeps until its
    next look (at most PROBE_INTERVAL_S), not a spin; nothing waiting, no sleep."""
    a, _ = schedulers()
    b, bclock = schedulers()
    slept = []
    b.sleep = slept.append
    assert b.pace_idle_step() == 0 and slept == []          # nothing waits
    a.lookup("ra", KEYS, ready_in(main), limit=N, upto=N)
    assert b.lookup("rb", KEYS, ready_in(main), limit=N, upto=N) is None
    assert b.pace_idle_step() == pytest.approx(PROBE_INTERVAL_S)
    bclock.t += PROBE_INTERVAL_S * 0.6
    assert b.pace_idle_step() == pytest.approx(PROBE_INTERVAL_S * 0.4)
    bclock.t += PROBE_INTERVAL_S
    assert b.pace_idle_step() == 0                           # a look is due: no sleep
    assert slept == pytest.approx([PROBE_INTERVAL_S, PROBE_INTERVAL_S * 0.4])
    b.end("rb")
    assert b.pace_idle_step() == 0 and len(slept) == 2
    # a request that is over with a mark handed for saving: paced until it settles
    b.lookup("rb2", [bytes([0x70]) * 16], ready_in(main), limit=1, upto=1)
    b.handed("rb2", [bytes([0x70]) * 16])
    b.end("rb2", keep_handed=True)
    assert b.unsettled() and b.pace_idle_step() == PROBE_INTERVAL_S


def test_the_scheduler_paces_only_steps_that_schedule_nothing(main, schedulers, uuid):
    """ConnectorScheduler.build_connector_meta: with a request waiting for a peer, a step
    that runs no token sleeps (pace_idle_step); a step that runs tokens does not."""
    from types import SimpleNamespace as NS
    from ucmcache.engines.kit import EngineParts
    from ucmcache.engines.vllm.blocks import EngineIdentity, block_keys
    from ucmcache.engines.vllm.config import ConnectorConfig
    from ucmcache.engines.vllm.scheduler import ConnectorScheduler
    ident = EngineIdentity(model="tiny", dtype="float32", kv_dtype="float32", block_size=4,
                           num_layers=1, num_kv_heads=1, head_size=8, layout="NHD")
    parts = EngineParts()
    parts.cache = SlotCache.attach(main.uuid)
    sched = ConnectorScheduler(cfg=ConnectorConfig(segment=main.uuid, max_ranks=4), identity=ident,
                               segment=main.uuid, parts=parts,
                               new_meta=lambda **kw: NS(saves=[], **kw))
    try:
        prompt = list(range(100, 100 + 4 * 4 + 1))
        a, _ = schedulers()
        a.lookup("ra", block_keys(prompt, ident), ready_in(main), limit=4, upto=4)
        req = NS(request_id="rb", prompt_token_ids=prompt, num_tokens=len(prompt))
        clock = Clock()
        sched._intents().clock = clock
        assert sched.get_num_new_matched_tokens(req, 0) == (None, False)   # waits for a
        slept = []
        sched._flight.sleep = slept.append

        def step(tokens):
            return NS(scheduled_new_reqs=[], preempted_req_ids=set(),
                      scheduled_cached_reqs=NS(req_ids=[], num_computed_tokens=[]),
                      num_scheduled_tokens={"other": tokens} if tokens else {},
                      total_num_scheduled_tokens=tokens)

        sched.build_connector_meta(step(8))
        assert slept == []
        sched.build_connector_meta(step(0))
        assert slept == pytest.approx([PROBE_INTERVAL_S])
        # another request of this engine that does not wait (running, or waiting for KV
        # blocks): an empty step is not idle, no sleep
        other = NS(request_id="ro", prompt_token_ids=[1, 2, 3], num_tokens=3)
        assert sched.get_num_new_matched_tokens(other, 0) == (0, False)
        sched.build_connector_meta(step(0))
        assert slept == pytest.approx([PROBE_INTERVAL_S])
    finally:
        sched.shutdown()
        parts.cache.close()


def test_peer_wait_s_0_never_waits_but_marks(main, schedulers):
    a, _ = schedulers()
    b, _ = schedulers(peer_wait_s=0)
    a.lookup("ra", KEYS[:4], ready_in(main), limit=4, upto=4)
    assert b.lookup("rb", KEYS, ready_in(main), limit=N, upto=N) == 0
    assert b.marked("rb") == KEYS[4:] and b.stats.waits == 0


def test_a_scheduler_never_waits_for_its_own_marks(main, schedulers):
    a, _ = schedulers()
    assert a.lookup("r1", KEYS, ready_in(main), limit=N, upto=N) == 0
    assert a.lookup("r2", KEYS, ready_in(main), limit=N, upto=N) == 0   # r1's: no wait
    assert a.marked("r2") == [] and a.stats.waits == 0
    # r1 ends; r2 asked again marks what r1 no longer does
    a.end("r1", "aborted")
    assert a.lookup("r2", KEYS, ready_in(main), limit=N, upto=N) == 0
    assert a.marked("r2") == KEYS


@pytest.mark.parametrize("how", ["aborted", "preempted", "finished without saving",
                                 "save failed"])
def test_intents_end_when_their_request_ends_without_saving(main, schedulers, how):
    a, aclock = schedulers()
    b, bclock = schedulers()
    a.lookup("ra", KEYS, ready_in(main), limit=N, upto=N)
    assert b.lookup("rb", KEYS, ready_in(main), limit=N, upto=N) is None
    if how == "aborted":
        a.end("ra", "request aborted")
    elif how == "preempted":     # the connector's build_connector_meta: keep_handed
        a.handed("ra", KEYS[:2])
        save(main, KEYS[:2])     # what it computed before the preemption is saved
        a.end("ra", "request preempted", keep_handed=True)
        assert a.marked("ra") == KEYS[:2]
        a.settle(lambda ks: exist_all_ranks(main, ks, 1))
    elif how == "finished without saving":
        a.end("ra", "request finished", keep_handed=True)
    else:                        # handed for saving, never Ready: the grace ends them
        a.handed("ra", KEYS)
        a.settle(lambda ks: exist_all_ranks(main, ks, 1))
        assert a.marked("ra") == KEYS
        aclock.t += MARK_GRACE_S
        a.settle(lambda ks: exist_all_ranks(main, ks, 1))
    assert a.marked("ra") == [] and not a._mine
    assert intent_state(main, KEYS[2]) is None
    bclock.t += PROBE_INTERVAL_S
    n = 2 if how == "preempted" else 0
    assert b.lookup("rb", KEYS, ready_in(main), limit=N, upto=N) == n   # computes the rest
    assert b.marked("rb") == KEYS[n:]


@pytest.mark.parametrize("saved", [True, False])
def test_marks_of_a_finished_requests_saves_end_when_the_saves_are_over_without_a_step(
        main, schedulers, saved):
    """A request that finishes within a step of its prefill: its deferred saves end after the
    last settle of an engine that then idles.  The workers' finished_sending (saves_over) ends
    its marks, Ready or not, so a peer meeting one of its blocks evicted later computes at
    once instead of waiting peer_wait_s for an idle engine."""
    a, aclock = schedulers()
    b, bclock = schedulers(peer_wait_s=5.0)
    settle_ready = lambda ks: exist_all_ranks(main, ks, 1)   # noqa: E731
    assert a.lookup("ra", KEYS[:4], ready_in(main), limit=3, upto=4) == 0
    a.handed("ra", KEYS[:4])
    a.end("ra", "request finished", keep_handed=True)        # request_finished
    a.settle(settle_ready)                                   # the saves are still running
    assert a.marked("ra") == KEYS[:4] and a.unsettled()
    if saved:
        save(main, KEYS[:4])                                 # published after the last settle
    a.saves_over(["ra"], settle_ready)                       # the workers' finished_sending
    assert a.marked("ra") == [] and not a._mine and not a.unsettled()
    assert (a.stats.ended_ready, a.stats.ended_other) == ((4, 0) if saved else (0, 4))
    assert intent_state(main, KEYS[1]) is None
    main.delete(KEYS[1])                                     # evicted later
    n = 1 if saved else 0
    assert b.lookup("rb", KEYS[:4], ready_in(main), limit=3, upto=4) == n   # no wait
    assert b.stats.waits == 0 and b.marked("rb") == KEYS[n:4]


def test_a_block_ready_for_only_some_tp_ranks_keeps_its_intent(main, schedulers):
    a, _ = schedulers()
    a.lookup("ra", KEYS[:2], ready_in(main, 2), limit=2, upto=2)
    a.handed("ra", KEYS[:2])
    save(main, KEYS[:2], ranks=(0,))           # rank 1's shards not yet
    a.settle(lambda ks: exist_all_ranks(main, ks, 2))
    assert a.marked("ra") == KEYS[:2]
    save(main, KEYS[:1], ranks=(1,))
    a.settle(lambda ks: exist_all_ranks(main, ks, 2))
    assert a.marked("ra") == KEYS[1:2]


def test_a_frontier_that_became_ready_under_the_look_is_loaded_not_computed(main, schedulers):
    a, _ = schedulers()
    looks = []

    def ready(ks):   # block 0 is published (and its intent ended) between the two looks
        looks.append(1)
        if len(looks) == 2:
            save(main, KEYS[:1])
        return main.exist_prefix(list(ks))

    assert a.lookup("ra", KEYS, ready, limit=N, upto=N) == 1
    assert a.marked("ra") == KEYS[1:]


def test_config_and_names():
    from ucmcache.vllm import ConnectorConfig, VllmConnectorError
    assert ConnectorConfig.from_extra({}).peer_wait_s > 0
    assert ConnectorConfig.from_extra({"peer_wait_s": 0}).peer_wait_s == 0
    for bad in (-1, True, "5", 1e9):
        with pytest.raises(VllmConnectorError, match="'peer_wait_s' must be a number of "
                                                     r"seconds in \[0, 3600\]"):
            ConnectorConfig.from_extra({"peer_wait_s": bad})
    with pytest.raises(ValueError, match="peer_wait_s must be a number of seconds >= 0"):
        Intents(None, peer_wait_s=-1)
    assert intents_uuid("vllm-abc") == "vllm-abc-intents"
    long = "x" * 64
    assert len(intents_uuid(long)) <= 64 and intents_uuid(long) != intents_uuid("x" * 63 + "y")


def test_a_segment_of_another_use_named_as_the_intents_segment_is_refused(main):
    """An engine's KV segment that bears another segment's intents name is never taken as
    intents (a mark would evict one of its blocks), and the connector refuses such a name."""
    from ucmcache.vllm import ConnectorConfig, VllmConnectorError
    kv = SlotCache.create(intents_uuid(main.uuid), slots_per_rank=8, slot_size=1 << 12,
                          max_ranks=2)
    try:
        blocks = [bytes([0xB0, i]) * 8 for i in range(16)]
        for k in blocks:
            with kv.get(k) as h:
                if h.owner:
                    h.data[:4] = b"KV!!"
                    h.ready(4)
        before = kv.exist(blocks)
        with pytest.raises(VllmConnectorError, match="holds slots of 4096 bytes, not the "
                                                     "intents segment"):
            open_intents(main.uuid, 4)
        assert kv.exist(blocks) == before and sum(before) == 16 and kv.entry_count() == 16
    finally:
        kv.close()
    for name in ("llama-kv-intents", intents_uuid("x" * 64)):
        with pytest.raises(VllmConnectorError, match="ends in '-intents'"):
            ConnectorConfig.from_extra({"segment": name})
    assert ConnectorConfig.from_extra({"segment": "llama-intents-kv"}).segment


# ---------------------------------------------------------------- another process, killed


def _start_marker(procs, main, ranks=1):
    cmds = SPAWN.Queue()
    p, q = procs.start(flight_workers.marker, cmds, main.uuid, 4, KEYS, ranks)
    procs.queues.append(cmds)
    rank = procs.result(q)
    return p, q, cmds, rank


def ask(procs, q, cmds, *cmd):
    cmds.put(cmd)
    return procs.result(q)


def test_marks_made_in_another_process_are_seen_and_ended(main, schedulers, procs):
    p, q, cmds, rank = _start_marker(procs, main)
    b, bclock = schedulers()
    assert ask(procs, q, cmds, "lookup", "ra", N, N, False) == 0
    assert ask(procs, q, cmds, "marked", "ra") == list(range(N))
    assert intent_state(main, KEYS[0]) == "loading"
    assert b.lookup("rb", KEYS, ready_in(main), limit=N, upto=N) is None
    ask(procs, q, cmds, "handed", "ra", N)
    ask(procs, q, cmds, "save", N)
    ask(procs, q, cmds, "settle")
    assert ask(procs, q, cmds, "marked", "ra") == []
    bclock.t += PROBE_INTERVAL_S
    assert b.lookup("rb", KEYS, ready_in(main), limit=N, upto=N) == N
    ask(procs, q, cmds, "quit")
    p.join(30)
    assert ucmcache.verify(intents_uuid(main.uuid)).ok


# Each step after which the marking scheduler is killed: what it did, in order.
STEPS = {
    "frontier taken": [("lookup", "ra", N, N, True)],
    "all marked": [("lookup", "ra", N, N, False)],
    "handed": [("lookup", "ra", N, N, False), ("handed", "ra", 4)],
    "some saved, their intents ended": [("lookup", "ra", N, N, False), ("handed", "ra", 4),
                                        ("save", 4), ("settle",)],
    "request ended, handed ones kept": [("lookup", "ra", N, N, False), ("handed", "ra", 4),
                                        ("end", "ra", "request finished", True)],
}


@pytest.mark.parametrize("step", list(STEPS))
def test_a_marker_killed_at_each_step_is_recovered_by_the_next_look(main, schedulers, procs,
                                                                     step):
    p, q, cmds, rank = _start_marker(procs, main)
    b, bclock = schedulers()
    for cmd in STEPS[step]:
        out = ask(procs, q, cmds, *cmd)
    if step == "frontier taken":
        assert out == "at-recheck"
    n = 4 if step == "some saved, their intents ended" else 0
    assert intent_state(main, KEYS[n]) == "loading"
    assert b.lookup("rb", KEYS, ready_in(main), limit=N, upto=N) is None   # alive: waits
    os.kill(p.pid, signal.SIGKILL)
    p.join(30)
    bclock.t += PROBE_INTERVAL_S
    # the next look finds the marker dead: recovery fails its intents, b computes the rest
    assert b.lookup("rb", KEYS, ready_in(main), limit=N, upto=N) == n
    assert b.stats.recovered == 1 and b.marked("rb") == KEYS[n:]
    b.end("rb", "done")
    assert ucmcache.verify(intents_uuid(main.uuid)).ok
