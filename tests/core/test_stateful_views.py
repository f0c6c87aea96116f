"""A stateful hypothesis test over the public API on a tiny segment (reuse is constant).

The machine gets, batches, copies out (read_many, gather) into buffers of every kind and shape,
keeps views and everything derived from them across closes (of handles, batches, the cache),
drops caches without close and re-attaches the same uuid.  The invariant, after every rule:
every byte read through a kept view / array / tensor, and every row of an `out`, is its key's
bytes (a deterministic function of key and length), or the read raises.  Buffers that cannot
be filled are refused with a clear error and nothing copied.  close() completes or refuses
without freeing anything (and is retried).  An object-dtype `out` is checked in a child
process, so a segfault is a failure of that test, not a crashed pytest.
"""
import gc
import os
import subprocess
import sys
import textwrap
import warnings

import numpy as np
import pytest
from hypothesis import HealthCheck, seed, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from ucmcache import CacheFull, LoadFailed, SegmentNotFound, SlotCache, UcmError

from conftest import run_uuid

try:
    import torch
except ImportError:  # pragma: no cover
    torch = None

SLOT = 128
N_KEYS = 8
KEYS = [bytes([(i * 37 + j * 11 + 1) & 0xFF for j in range(16)]) for i in range(N_KEYS)]
LEN = {k: 1 + (i * 53 + 29) % SLOT for i, k in enumerate(KEYS)}  # key-dependent lengths


def payload(key, n=None):
    """The key's bytes: its id repeated, xor a position counter (a reused slot shows)."""
    n = LEN[key] if n is None else n
    return bytes((key[j % 16] ^ ((j // 16) * 29 + 1)) & 0xFF for j in range(n))


PAY = {k: payload(k) for k in KEYS}
# a read of a view whose export was released raises one of these
RELEASED = (ValueError, BufferError, TypeError, RuntimeError)


def readable_bytes(obj):
    if torch is not None and isinstance(obj, torch.Tensor):
        return obj.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
    if isinstance(obj, np.ndarray):
        return obj.tobytes()
    if isinstance(obj, memoryview):
        return obj.tobytes()
    return bytes(obj)


def flat_u8(out):
    if torch is not None and isinstance(out, torch.Tensor):
        return out.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
    return bytes(memoryview(out).cast("B")) if not isinstance(out, np.ndarray) else out.tobytes()


def nrows_of(out):
    shape = tuple(out.shape) if hasattr(out, "shape") else (len(out),)
    if isinstance(out, memoryview):
        shape = out.shape
    return shape


def make_out(kind, n, extra):
    """(buffer, row_bytes): the row rule: 2-D or more: rows by the first dimension; 1-D: nbytes // n."""
    rows = n + extra
    if kind == "u8_2d":
        return np.full((rows, SLOT), 0xEE, np.uint8), SLOT
    if kind == "u8_2d_wide":
        return np.full((rows, SLOT + 16), 0xEE, np.uint8), SLOT + 16
    if kind == "u8_3d":
        return np.full((rows, 2, SLOT // 2), 0xEE, np.uint8), SLOT
    if kind == "u8_1d":
        return np.full(n * SLOT, 0xEE, np.uint8), SLOT
    if kind == "u32_2d":
        return np.full((rows, SLOT // 4), 0xEEEEEEEE, np.uint32), SLOT
    if kind == "f32_1d":
        return np.frombuffer(b"\xee" * (n * SLOT), np.float32).copy(), SLOT
    if kind == "bytearray":
        return bytearray(b"\xee" * (n * SLOT)), SLOT
    if kind == "memoryview":
        return memoryview(bytearray(b"\xee" * (n * SLOT))), SLOT
    if kind == "memoryview_2d":
        return memoryview(bytearray(b"\xee" * (rows * SLOT))).cast("B", (rows, SLOT)), SLOT
    if kind == "torch_u8_2d":
        return torch.full((rows, SLOT), 0xEE, dtype=torch.uint8), SLOT
    if kind == "torch_i32_2d":
        t = torch.empty((rows, SLOT // 4), dtype=torch.int32)
        t.view(torch.uint8).fill_(0xEE)
        return t, SLOT
    raise AssertionError(kind)


OUT_KINDS = ["u8_2d", "u8_2d_wide", "u8_3d", "u8_1d", "u32_2d", "f32_1d", "bytearray",
             "memoryview", "memoryview_2d"] + (["torch_u8_2d", "torch_i32_2d"] if torch else [])


def make_bad_out(kind, n):
    """(buffer, exception types): buffers that must be refused with nothing copied."""
    if kind == "small_rows":   # may also succeed when no Ready payload exceeds a row
        return np.full((n, 1), 0xEE, np.uint8), (ValueError,)
    if kind == "readonly_np":
        a = np.full((n, SLOT), 0xEE, np.uint8)
        a.flags.writeable = False
        return a, (ValueError, TypeError, BufferError)
    if kind == "bytes":
        return b"\xee" * (n * SLOT), (ValueError, TypeError, BufferError)
    if kind == "not_whole_rows":
        return bytearray(b"\xee" * (n * SLOT + 1)), (ValueError,)
    if kind == "few_rows_2d":  # a 2-D out with fewer rows than keys
        return np.full((n - 1, SLOT), 0xEE, np.uint8), (ValueError,)
    if kind == "strided":
        return np.full((n, 2 * SLOT), 0xEE, np.uint8)[:, ::2], (ValueError, TypeError,
                                                                BufferError)
    raise AssertionError(kind)


BAD_KINDS = ["small_rows", "readonly_np", "bytes", "not_whole_rows", "few_rows_2d", "strided"]
DERIVE = ["self", "slice", "memoryview", "cast", "toreadonly", "np_frombuffer", "np_asarray",
          "array", "torch_frombuffer", "bytes", "slice_of_slice", "np_slice"]

keys_st = st.sampled_from(KEYS)
key_lists = st.lists(keys_st, min_size=1, max_size=4, unique=True)


class ViewsMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.uuid = run_uuid("sv")
        self.cache = SlotCache.create(self.uuid, slots_per_rank=3, slot_size=SLOT, max_ranks=1,
                                      n_stripes=1)
        self.kept = []       # (key, expected bytes, reader, how it was made)
        self.handles = []    # open Ready handles: (key, handle)
        self.batches = []    # open batches: (keys, batch)
        self.refused_close = 0

    # ---------------------------------------------------------------- helpers
    def _drop_some(self):
        """A full tiny segment is legitimate when views pin its slots: make room."""
        self.kept.clear()
        for _, h in self.handles:
            h.close()
        self.handles.clear()
        for _, b in self.batches:
            b.close()
        self.batches.clear()
        gc.collect()

    def _keep(self, key, view, how, owner_array=None):
        """Keep `view` (a Ready payload view of `key`) or something derived from it."""
        exp = PAY[key]
        n = len(exp)
        if how == "self":
            r = view
        elif how == "slice":
            a, b = n // 3, n - n // 4
            r, exp = view[a:b], exp[a:b]
        elif how == "slice_of_slice":
            r, exp = view[1:][: max(0, n - 2)], exp[1:][: max(0, n - 2)]
        elif how == "memoryview":
            r = memoryview(view)
        elif how == "cast":
            r = view.cast("B")
        elif how == "toreadonly":
            r = view.toreadonly()
        elif how == "np_frombuffer":
            r = np.frombuffer(view, np.uint8)
        elif how == "np_slice":
            r, exp = np.frombuffer(view, np.uint8)[n // 2:], exp[n // 2:]
        elif how == "np_asarray":
            r = np.asarray(view)
        elif how == "array":
            r = owner_array if owner_array is not None else np.frombuffer(view, np.uint8)
        elif how == "torch_frombuffer":
            if torch is None or n == 0:
                return
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                r = torch.frombuffer(view, dtype=torch.uint8)
        elif how == "bytes":
            r = bytes(view)
        else:
            raise AssertionError(how)
        self.kept.append((key, exp, r, how))

    def _check_out(self, keys, out, row, lens, before):
        flat = flat_u8(out)
        assert len(lens) == len(keys)
        for i, k in enumerate(keys):
            got = flat[i * row:(i + 1) * row]
            if lens[i] == -1:
                assert got == before[i * row:(i + 1) * row], f"row {i} of a key not Ready changed"
            else:
                assert lens[i] == LEN[k], (i, int(lens[i]), LEN[k])
                assert got[:LEN[k]] == PAY[k], f"row {i} is not key {KEYS.index(k)}'s bytes"
        # the rows past n (2-D outs with more rows than keys) are untouched
        assert flat[len(keys) * row:] == before[len(keys) * row:]

    # ---------------------------------------------------------------- rules
    @precondition(lambda self: self.cache is not None)
    @rule(key=keys_st, fail=st.booleans(), keep_open=st.booleans(),
          how=st.sampled_from(DERIVE), keep_owner=st.booleans())
    def get(self, key, fail, keep_open, how, keep_owner):
        try:
            h = self.cache.get(key)
        except CacheFull:
            self._drop_some()
            return
        if h.owner:
            n = LEN[key]
            kept_owner = None
            if keep_owner and not fail:
                # an array made from the owner's view stays usable and pinned after ready()
                arr = h.array(np.uint8)
                arr[:n] = np.frombuffer(PAY[key], np.uint8)
                kept_owner = arr[:n]
                del arr
                raw = h.data[:n]  # the writable view: released when the load ends
            else:
                h.data[:n] = PAY[key]
                raw = None
            if fail:
                h.fail("no")
                h.close()
                return
            h.ready(n)
            if raw is not None:
                self.kept.append((key, PAY[key], raw, "owner_slice"))
                self.kept.append((key, PAY[key], kept_owner, "owner_array"))
        else:
            try:
                h.wait(timeout=2.0)
            except LoadFailed:
                h.close()
                return
        assert h.state == "ready"
        v = h.data
        assert bytes(v) == PAY[key]
        self._keep(key, v, how, owner_array=h.array(np.uint8) if how == "array" else None)
        del v
        if keep_open:
            self.handles.append((key, h))
        else:
            h.close()

    @precondition(lambda self: self.cache is not None)
    @rule(keys=key_lists, fails=st.lists(st.booleans(), min_size=4, max_size=4),
          keep_open=st.booleans(), hows=st.lists(st.sampled_from(DERIVE), min_size=4,
                                                 max_size=4))
    def get_many(self, keys, fails, keep_open, hows):
        try:
            b = self.cache.get_many(keys)
        except CacheFull:
            self._drop_some()
            return
        owner = list(b.owner)
        for i, k in enumerate(keys):
            if owner[i]:
                n = LEN[k]
                b.data(i)[:n] = PAY[k]
                if fails[i]:
                    b.fail(i, "no")
                else:
                    b.ready(i, n)
        try:
            b.wait(timeout=2.0)
        except LoadFailed:
            pass
        state = list(b.state)
        for i, k in enumerate(keys):
            if state[i] == "ready":
                v = b.data(i)
                assert bytes(v) == PAY[k]
                self._keep(k, v, hows[i])
                del v
        if keep_open:
            self.batches.append((keys, b))
        else:
            b.close()

    @precondition(lambda self: self.cache is not None)
    @rule(keys=key_lists, kind=st.sampled_from(OUT_KINDS), extra=st.integers(0, 3))
    def read_many(self, keys, kind, extra):
        out, row = make_out(kind, len(keys), extra)
        before = flat_u8(out)
        lens = self.cache.read_many(keys, out)
        self._check_out(keys, out, row, list(lens), before)

    @precondition(lambda self: self.batches)
    @rule(data=st.data(), kind=st.sampled_from(OUT_KINDS), extra=st.integers(0, 3))
    def gather(self, data, kind, extra):
        keys, b = data.draw(st.sampled_from(self.batches))
        out, row = make_out(kind, len(keys), extra)
        before = flat_u8(out)
        lens = b.gather(out)
        self._check_out(keys, out, row, list(lens), before)

    @precondition(lambda self: self.cache is not None)
    @rule(data=st.data(), keys=key_lists, kind=st.sampled_from(BAD_KINDS),
          use_batch=st.booleans())
    def refused_out(self, data, keys, kind, use_batch):
        if kind in ("few_rows_2d", "not_whole_rows") and len(keys) < 2:
            return  # one key: any 1-D buffer is one whole row
        if use_batch and self.batches:
            keys, b = data.draw(st.sampled_from(self.batches))
            if kind in ("few_rows_2d", "not_whole_rows") and len(keys) < 2:
                return
            call = b.gather
        else:
            def call(o):
                return self.cache.read_many(keys, o)
        out, errors = make_bad_out(kind, len(keys))
        before = flat_u8(out)
        try:
            lens = call(out)
        except errors:
            assert flat_u8(out) == before, f"{kind}: refused but copied"
            return
        # only a too-small row may be accepted, when no Ready payload exceeds it
        assert kind == "small_rows", f"{kind} out was accepted: {list(lens)}"
        self._check_out(keys, out, 1, list(lens), before)

    @precondition(lambda self: self.handles)
    @rule(data=st.data())
    def close_handle(self, data):
        i = data.draw(st.integers(0, len(self.handles) - 1))
        _, h = self.handles.pop(i)
        h.close()

    @precondition(lambda self: self.batches)
    @rule(data=st.data())
    def close_batch(self, data):
        i = data.draw(st.integers(0, len(self.batches) - 1))
        _, b = self.batches.pop(i)
        b.close()

    @precondition(lambda self: self.kept)
    @rule(data=st.data())
    def drop_reader(self, data):
        i = data.draw(st.integers(0, len(self.kept) - 1))
        del self.kept[i]
        gc.collect()

    @precondition(lambda self: self.cache is not None)
    @rule(close_handles=st.booleans())
    def close_cache(self, close_handles):
        if close_handles:
            for _, h in self.handles:
                h.close()
            self.handles.clear()
            for _, b in self.batches:
                b.close()
            self.batches.clear()
        try:
            self.cache.close()
        except UcmError:
            # refused: nothing freed, the cache still works, and it can be retried later
            self.refused_close += 1
            assert self.cache.entry_count() >= 0
            self.cache.exist(KEYS[:1])
            return
        self.cache = None
        self.handles.clear()  # closed with the cache (if close allowed them at all)
        self.batches.clear()

    @precondition(lambda self: self.cache is not None and not self.kept and not self.handles
                  and not self.batches)
    @rule()
    def drop_cache_without_close(self):
        # a cache collected without close() frees its rank, with a ResourceWarning
        with warnings.catch_warnings(record=True):
            warnings.simplefilter("always")
            self.cache = None
            gc.collect()
        self.cache = SlotCache.attach(self.uuid, timeout=1.0)  # max_ranks=1: the same rank

    @precondition(lambda self: self.cache is None)
    @rule()
    def reattach(self):
        gc.collect()
        self.cache = SlotCache.attach(self.uuid, timeout=1.0)

    # ---------------------------------------------------------------- invariant
    @invariant()
    def kept_readers_show_their_keys_bytes(self):
        for key, exp, r, how in self.kept:
            try:
                got = readable_bytes(r)
            except RELEASED:
                continue
            assert got == exp, (f"a kept {how} view of key {KEYS.index(key)} shows "
                                f"{got[:16].hex()}..., not its key's {exp[:16].hex()}...")

    def teardown(self):
        try:
            self.kept.clear()
            for _, h in self.handles:
                try:
                    h.close()
                except Exception:
                    pass
            for _, b in self.batches:
                try:
                    b.close()
                except Exception:
                    pass
            self.handles.clear()
            self.batches.clear()
            gc.collect()
            if self.cache is not None:
                try:
                    self.cache.close()
                except Exception:
                    pass
                self.cache = None
            gc.collect()
        finally:
            try:
                SlotCache.unlink(self.uuid)
            except SegmentNotFound:
                pass


ViewsMachine.TestCase.settings = settings(
    max_examples=int(os.environ.get("UCM_STATEFUL_EXAMPLES", "80")), stateful_step_count=30,
    deadline=None, derandomize=True, database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
TestViews = ViewsMachine.TestCase


_OBJECT_CHILD = textwrap.dedent("""
    import sys, numpy as np
    from ucmcache import SlotCache
    u = sys.argv[1]
    c = SlotCache.create(u, slots_per_rank=2, slot_size=64, max_ranks=1)
    try:
        k = [b"a" * 16, b"b" * 16]
        for x in k:
            c.get_or_load(x, lambda x=x: x * 4)
        for name, call in (("read_many", lambda o: c.read_many(k, o)),
                           ("gather", None)):
            for shape in ((2, 8), (16,)):
                out = np.empty(shape, object)
                if call is None:
                    with c.get_many(k) as b:
                        try:
                            b.gather(out); print(name, shape, "ACCEPTED"); sys.exit(3)
                        except (TypeError, ValueError) as e:
                            print(name, shape, type(e).__name__, e)
                else:
                    try:
                        call(out); print(name, shape, "ACCEPTED"); sys.exit(3)
                    except (TypeError, ValueError) as e:
                        print(name, shape, type(e).__name__, e)
        for o in (np.empty((2, 8), object),):
            assert all(x is None for x in o.ravel())
    finally:
        c.close()
        SlotCache.unlink(u)
""")


def test_an_object_dtype_out_is_refused_in_a_child():
    """An object-dtype out must be a clear error (it once crashed the process)."""
    u = run_uuid("svo")
    try:
        p = subprocess.run([sys.executable, "-c", _OBJECT_CHILD, u], capture_output=True,
                           text=True, timeout=60)
    finally:
        try:
            SlotCache.unlink(u)
        except SegmentNotFound:
            pass
    assert p.returncode == 0, f"child exited {p.returncode}: {p.stdout}{p.stderr}"
    assert p.stdout.count("Error") == 4, p.stdout
