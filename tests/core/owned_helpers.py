"""What the owned-slot record's tests share (test_owned_*.py): keys, the short wait that must
time out, the refusal's words, a one-slot cache, a join's wait, another caller's load, and a
task run with its record made outside it or inside it."""
import asyncio
import contextvars

K1, K2, K3 = b"1" * 16, b"2" * 16, b"3" * 16
SHORT = 0.05  # a wait that must end by its timeout: nobody publishes meanwhile
REFUSED = (r"^this (task|thread) or a thread or task sharing its context .*is loading "
           r"(this key|one of these keys)")


def one_slot_cache(make_cache):
    """One slot in all: every key takes the slot the last one left."""
    return make_cache(slots_per_rank=1, max_ranks=1, slot_size=64)


def wait_for(c, key, timeout):
    """Join key's load and wait for it (the C wait)."""
    with c.get(key) as j:
        assert not j.owner
        return j.wait(timeout)


def own_elsewhere(c, key):
    """The owner's handle of key's load, taken in an empty context: another caller's load (as
    another thread's or process's would be), none of the test task's records."""
    h = contextvars.Context().run(c.get, key)
    assert h.owner
    return h


def run_task(c, main, record):
    """asyncio.run(main()) in a new context, whose owned-slot record is made either outside the
    task ("outside": an owner's get there, so the task's first aget_or_load miss links a record
    of its own to it) or inside it ("in_task": by the task's first owner, for the task)."""
    def run():
        if record == "outside":
            with c.get(K1) as h:
                assert h.owner
                h.fail("a load of this context, outside any task")
        return asyncio.run(main())
    return contextvars.Context().run(run)
