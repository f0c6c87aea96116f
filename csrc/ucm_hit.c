/* ucmcache._hit: the hit path as CPython types, so a hit makes no cffi call and runs no
 * Python frame.
 *
 * Why a second extension: a cffi call costs ~150 ns here (argument conversion, the GIL released
 * and taken again) and a Handle made of Python code ~1 us more, while py-lmdb reads a value in
 * ~1.2 us (issue 14).  This module holds no rule of the protocol.  It calls the C core's steps
 * through pointers taken from ucmcache._core when ucmcache is imported (one copy of the core
 * runs, with its test points), and it takes only the plain hit: a key of 16 bytes found Ready.
 * Anything else (a miss, a join, another key form, a timeout, a closed or forked cache, an
 * owner, a raised exception) goes to the Python methods named below, which are the full path.
 *
 * Signals: CPython runs a Python signal handler only between bytecodes, never inside this C
 * code, so a pin taken here is stored into its handle with no window in which an exception
 * can arrive (the Python path needs tickets and tokens for that; see SlotCache._get_full).
 * Finalizers: an allocation may start a collection that runs them.  A batch allocates all
 * it needs before it pins and reads its ids and the context after; a single get pins first
 * (a miss allocates nothing) and checks the context after allocating its handle (see
 * pinned_handle).  An exception a finalizer raises is reported and dropped, never ours.
 *
 * The reentrancy points, where Python code can run inside this module's C code: an allocation
 * of an object the collector tracks (its collection runs finalizers, which may close a handle,
 * a batch or the cache), a call of a Python object (the full path, a loader, a test hook,
 * _after_drop, the numpy constructors, the owned-slot record's functions) and a reference
 * dropped that may be the last one of such an object (a view's).  After each, before a context
 * read earlier is used again, the code re-checks with CLOSED_MEANWHILE.  Every function
 * funnels its exits into one cleanup label that releases what it took, so no exit releases by
 * hand.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <string.h>

#include "ucm_core.h"

/* The core's steps, bound by bind() from ucmcache._core's addresses; their types are the
 * header's declarations, not a second copy of them. */
static struct {
    __typeof__(ucm_lookup_pin) *lookup_pin;
    __typeof__(ucm_release) *release;
    __typeof__(ucm_slot_data) *slot_data;
    __typeof__(ucm_copy_payload) *copy_payload;
    __typeof__(ucm_ctx_points_set) *ctx_points_set;
    __typeof__(ucm_read_many) *read_many;
    __typeof__(ucm_read_count) *read_count;
    __typeof__(ucm_claimant_dead) *claimant_dead;
    __typeof__(ucm_gather) *gather;
    __typeof__(ucm_pin_all_ready) *pin_all_ready;
    __typeof__(ucm_release_many) *release_many;
    __typeof__(ucm_pin_again) *pin_again;
    __typeof__(ucm_pin_again_many) *pin_again_many;
    __typeof__(ucm_hold_pins) *hold_pins;
    /* the cold get_or_load (bind_loads) */
    __typeof__(ucm_get_slow) *get_slow;
    __typeof__(ucm_load_finish) *load_finish;
    __typeof__(ucm_token_drop) *token_drop;
    __typeof__(ucm_now_ns) *now_ns;
    __typeof__(ucm_token_publish) *token_publish;
    __typeof__(ucm_token_release) *token_release;
    __typeof__(ucm_wait_ready) *wait_ready;
    __typeof__(ucm_slot_state) *slot_state;
    __typeof__(ucm_stat_add) *stat_add;
    __typeof__(ucm_observe) *observe;
    __typeof__(ucm_load_serial) *load_serial;
} core;
static int bound;
/* No spinning here: a claimed slot answers BUSY at once and the full path (which spins with
 * the GIL released) takes the key, so a claim held by a stopped or dead process never holds
 * every thread of this one. */
#define C_SPIN 0
static PyObject *addr_of;        /* cffi pointer -> int (ffi.cast("uintptr_t", p)) */
static PyTypeObject *handle_type; /* ucmcache.Handle, a subclass of HandleBase */
static PyObject *new_lengths;    /* n -> numpy int64 array of n */
static PyTypeObject *batch_type;  /* ucmcache.HandleBatch, a subclass of BatchBase */
static PyObject *new_slots;      /* n -> numpy uint32 array of n */
static PyObject *new_owner;      /* n -> numpy bool array of n zeros */
static PyObject *no_owned;       /* an all-hit batch's owned set (ucmcache._batches) */
static PyObject *unpublished;    /* the Failed message of an owner closed without ready() */
static PyObject *token_drop;     /* lib.ucm_token_drop, lib.ucm_batch_token_drop: cffi's C */
static PyObject *batch_token_drop; /* functions (calling them runs no Python code) */

/* The cold get_or_load's pieces (bind_loads, from ucmcache/_cache.py): 0 until bound. */
static int loads_bound;
static PyObject *owning;         /* ucmcache._slots._owning: the owned-slot record (a ContextVar) */
static PyObject *owned_slots;    /* _slots._owned_slots: the record's own set, made if missing */
static PyObject *owns_load;      /* _slots.owns_load: whether this context owns a slot's load */
static PyObject *as_value_view;  /* ucmcache._slots.as_value_view: a value's checks and messages */
static PyObject *hooks_armed;    /* ucmcache._hooks._armed (a dict) and _hooks.fire */
static PyObject *hooks_fire;
static uint32_t slow_spin, max_rollbacks; /* _cache.SLOW_SPIN, MAX_ROLLBACKS, STRIPE_WAIT */
static int64_t stripe_wait_ns;
static int64_t liveness_ns;      /* _single_flight.LIVENESS_NS, _segment.LIFE_LOCK_BYTE0 */
static uint64_t life_byte0;

static PyObject *s_get_full, *s_hit_bytes_full, *s_get_or_load_full, *s_read_many_full,
    *s_data_slow, *s_exit_slow, *s_close, *s_release, *s_timeout,
    *s_get_many_full, *s_gather_full, *s_close_with, *s_get_or_load_missed,
    *s_aget_or_load_full, *s_aget_or_load_missed, *s_get_missed, *s_after_drop, *s_tier,
    *s_copy, *s_get_or_load_cold, *s_get_or_load_joined, *s_check_usable, *s_inside_loader,
    *s_before_ready, *s_after_ready, *s_ready_full, *s_wait_full, *s_why_unusable;

/* ---------------------------------------------------------------- CacheBase */

typedef struct {
    PyObject_HEAD
    PyObject *ctx_obj;        /* _ctx: the cffi context pointer, or None (closed, forked) */
    ucm_ctx *ctx;             /* its address, NULL with None */
    PyObject *open_handles;   /* _open_handles: an int (objects, not C fields, wherever Python
                               * reads or writes a field: CPython 3.11 specializes attribute
                               * access only for object members, 3x faster than the rest) */
    PyObject *ro;             /* _ro: the mapping's read-only memoryview */
    Py_ssize_t data_off;      /* _data_off, _stride: where slot s's bytes start in _ro */
    Py_ssize_t stride;
    Py_ssize_t calls_out;     /* core calls running with the GIL released (see WITHOUT_GIL) */
    Py_ssize_t exports;       /* SlotBuffers holding a pin of this cache: close() refuses while
                               * any lives (their pins must outlast the views made of them) */
    PyObject *tier;           /* _tier: None, or the BoundTier beneath (its misses take the
                               * full path: the tier is asked before an owner loads) */
    Py_ssize_t value_max;     /* _value_max: the slot size (the longest value a load stores) */
    int lock_fd;              /* _lock_fd: the segment's fd of the OFD life locks (a waiter's
                               * liveness check of the loader, ucm_wait_ready) */
    Py_ssize_t loads_out;     /* cold get_or_loads of this cache whose loader runs now, each
                               * owning a Loading slot through a token in its C frame (see
                               * cold_load): close() refuses while any runs, as it does for
                               * an open owner's handle */
    Py_ssize_t forks_out;     /* forks of this process whose parent side holds pins through ctx
                               * until the child has copied them (_fork_hold): the context is
                               * not taken away meanwhile (cache_detach) */
    PyObject *owned_key;      /* _owned_key: this cache's key in the owned-slot records (an
                               * int from a process-wide count, never reused, unlike id():
                               * a set a collected cache left in a record is never another
                               * cache's; see _slots.OwnedRecord) */
} CacheBase;

/* The re-check after a reentrancy point (see the top of this file): `now` is the cache as the
 * caller may use it now (c itself, or still_open / batch_usable of the holder: NULL once the
 * holder closed), `was` the context it read before.  True: the code that ran closed the cache
 * or the holder (or the cache forked), whose close removed this process's holds through that
 * context, so nothing may be done through it any more (the full path says why).  `now` is
 * read twice: pass a plain read. */
#define CLOSED_MEANWHILE(now, was) ((now) == NULL || (now)->ctx != (was))

/* A _closed field: open is exactly False (NULL, a deleted field, counts as closed; Python
 * stores only the literals True and False). */
#define IS_OPEN(o) ((o) == Py_False)

/* c, the cache a holder (a handle, a batch) was found usable with, while the holder is still
 * open (its _closed field `closed`), else NULL: CLOSED_MEANWHILE's `now` for a holder, whose
 * cache and arrays do not change while it is open. */
static inline CacheBase *still_open(PyObject *closed, CacheBase *c)
{
    return IS_OPEN(closed) ? c : NULL;
}

/* _open_handles += d from C (small ints are cached: no allocation in practice). */
static void add_open(CacheBase *c, Py_ssize_t d)
{
    Py_ssize_t n = c->open_handles ? PyLong_AsSsize_t(c->open_handles) : 0;
    if (n == -1 && PyErr_Occurred()) {
        PyErr_Clear();
        n = 0;
    }
    PyObject *v = PyLong_FromSsize_t(n + d);
    if (v) Py_XSETREF(c->open_handles, v);
    else PyErr_Clear();
}

/* A core call with the GIL released, counted in c->calls_out (changed only with the GIL held):
 * close() does not take the context away while one runs (CacheBase._detach), so the call's
 * context stays allocated and its segment mapped until it returns. */
#define WITHOUT_GIL(c, stmt)                      \
    do {                                          \
        (c)->calls_out++;                         \
        Py_BEGIN_ALLOW_THREADS stmt;              \
        Py_END_ALLOW_THREADS (c)->calls_out--;    \
    } while (0)

static PyTypeObject CacheBase_Type;

static PyObject *cache_get_ctx(CacheBase *c, void *closure)
{
    return Py_NewRef(c->ctx_obj ? c->ctx_obj : Py_None);
}

static int cache_set_ctx(CacheBase *c, PyObject *v, void *closure)
{
    ucm_ctx *p = NULL;
    if (v == NULL) v = Py_None;
    if (v != Py_None) {
        if (!addr_of) {
            PyErr_SetString(PyExc_RuntimeError, "ucmcache._hit is not bound to the C core");
            return -1;
        }
        PyObject *a = PyObject_CallOneArg(addr_of, v);
        if (!a) return -1;
        p = (ucm_ctx *)PyLong_AsVoidPtr(a);
        Py_DECREF(a);
        if (!p && PyErr_Occurred()) return -1;
    }
    c->ctx = p; /* first: dropping the old object may run a finalizer that reads it */
    Py_XSETREF(c->ctx_obj, Py_NewRef(v));
    return 0;
}

/* One lookup-and-pin step of the fast path on ctx (the caller read it from c with nothing
 * able to run Python after), counted as `outer` says (ucm_outer in ucm_core.h).  The GIL is
 * kept (a lookup is tens of ns) unless a test point was ever set on this context: a gate then
 * holds this thread, and the other threads of the process must be able to run (close() waits
 * for the call: WITHOUT_GIL). */
static inline int64_t lookup(CacheBase *c, ucm_ctx *ctx, const char *id, ucm_outer outer)
{
    if (__builtin_expect(core.ctx_points_set(ctx), 0)) {
        int64_t r;
        WITHOUT_GIL(c, r = core.lookup_pin(ctx, id, 0, C_SPIN, outer, 0));
        return r;
    }
    return core.lookup_pin(ctx, id, 0, C_SPIN, outer, 0);
}

/* Drop one pin, or one hold on each of n slots; with test points set, the GIL released (a
 * thread held at a gate may hold the process-local lock of a slot's group). */
static inline void release_pin(CacheBase *c, ucm_ctx *ctx, uint32_t slot)
{
    if (__builtin_expect(core.ctx_points_set(ctx), 0)) {
        WITHOUT_GIL(c, core.release(ctx, slot));
        return;
    }
    core.release(ctx, slot);
}

static inline void release_pins(CacheBase *c, ucm_ctx *ctx, const uint32_t *slots, uint32_t n)
{
    if (__builtin_expect(core.ctx_points_set(ctx), 0)) {
        WITHOUT_GIL(c, core.release_many(ctx, slots, n));
        return;
    }
    core.release_many(ctx, slots, n);
}

static inline int plain_id(PyObject *key)
{
    return PyBytes_CheckExact(key) && PyBytes_GET_SIZE(key) == 16;
}

/* The call goes to the full path: self.<name>(*args, **kwargs) as it came. */
static PyObject *forward(PyObject *self, PyObject *name, PyObject *const *args, Py_ssize_t nargs,
                         PyObject *kwnames)
{
    PyObject *m = PyObject_GetAttr(self, name);
    if (!m) return NULL;
    PyObject *r = PyObject_Vectorcall(m, args, nargs, kwnames);
    Py_DECREF(m);
    return r;
}

/* Only `timeout=None` among keywords keeps the fast path (a hit waits for nothing). */
static inline int no_timeout(PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    if (!kwnames) return 1;
    if (PyTuple_GET_SIZE(kwnames) != 1 || args[nargs] != Py_None) return 0;
    PyObject *k = PyTuple_GET_ITEM(kwnames, 0);
    return k == s_timeout || PyUnicode_Compare(k, s_timeout) == 0;
}

/* ---------------------------------------------------------------- SlotBuffer
 *
 * Every view this module hands out over a slot's bytes (a handle's or a batch's data, and so
 * every slice, cast, memoryview, numpy array or torch tensor made from one) is a memoryview
 * whose exporter is a SlotBuffer.  A SlotBuffer takes one more hold on its slot's pin when it
 * is made (ucm_pin_again: the process-local count, no shared word) and drops it when the last
 * buffer made from it is released: a memoryview and every view derived from it share one
 * managed buffer, which holds one export of the SlotBuffer until the last of them goes (numpy
 * and torch keep the memoryview they were made from).  So whatever can read a slot's bytes
 * keeps the slot pinned, and its key's bytes in it (I1), for as long as it lives; closing a
 * handle or batch drops only its own hold.  close() of the cache refuses while a SlotBuffer
 * holds a pin (CacheBase.exports): the pin, the context and the mapping outlive every view.
 * In a forked child the views it inherited read a private copy of the pinned slots' pages
 * (ucm_privatize_pins, run by the after-fork hook), and drop nothing shared. */
typedef struct {
    PyObject_HEAD
    CacheBase *cache;    /* strong: exports counted there */
    ucm_ctx *ctx;        /* the context the holds were taken on */
    char *buf;
    Py_ssize_t len;
    uint32_t slot;       /* one slot's view: its slot (slots points here) */
    uint32_t *slots;     /* the slots held: &slot, or a batch's copy (PyMem, UCM_NIL skipped) */
    uint32_t n;
    int readonly;
    int held;            /* holds its pins (until its last export is released) */
    Py_ssize_t exports;
} SlotBuffer;

static PyTypeObject SlotBuffer_Type;

static void slot_buffer_drop(SlotBuffer *e)
{
    if (!e->held) return;
    e->held = 0;
    CacheBase *c = e->cache;
    c->exports--;
    /* A cache whose context is gone (closed, a forked child's: None) holds nothing through it. */
    if (CLOSED_MEANWHILE(c, e->ctx)) return;
    if (e->slots == &e->slot) release_pin(c, e->ctx, e->slot);
    else release_pins(c, e->ctx, e->slots, e->n);
}

static int slot_buffer_getbuf(SlotBuffer *e, Py_buffer *view, int flags)
{
    if (!e->held) {
        PyErr_SetString(PyExc_BufferError, "this slot's bytes are no longer pinned");
        return -1;
    }
    if (e->slots != &e->slot && e->exports > 0) {
        /* a batch's region: only the view its positions narrow, never the whole region */
        PyErr_SetString(PyExc_BufferError, "a batch's data region is not exported again");
        return -1;
    }
    if (PyBuffer_FillInfo(view, (PyObject *)e, e->buf, e->len, e->readonly, flags) < 0)
        return -1;
    e->exports++;
    return 0;
}

static void slot_buffer_releasebuf(SlotBuffer *e, Py_buffer *view)
{
    if (--e->exports == 0) slot_buffer_drop(e);
}

/* Tracked by the collector: a view kept on its own cache (an attribute, a list the cache holds)
 * makes a cycle cache -> view -> managed buffer -> SlotBuffer -> cache, collectable only if the
 * collector sees this last edge.  No tp_clear: the cycle is broken at the memoryview and its
 * managed buffer, whose clearing releases the export (and so the pin) before the cache goes. */
static int slot_buffer_traverse(SlotBuffer *e, visitproc visit, void *arg)
{
    Py_VISIT(e->cache);
    return 0;
}

static void slot_buffer_dealloc(SlotBuffer *e)
{
    PyObject_GC_UnTrack(e);
    slot_buffer_drop(e);
    if (e->slots != &e->slot) PyMem_Free(e->slots);
    Py_XDECREF(e->cache);
    PyObject_GC_Del(e);
}

static PyBufferProcs slot_buffer_as_buffer = {
    .bf_getbuffer = (getbufferproc)slot_buffer_getbuf,
    .bf_releasebuffer = (releasebufferproc)slot_buffer_releasebuf,
};

static PyTypeObject SlotBuffer_Type = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "ucmcache._hit.SlotBuffer",
    .tp_basicsize = sizeof(SlotBuffer),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "The exporter behind a slot's views: it keeps the slot pinned while any view of\n"
              "it lives (see csrc/ucm_hit.c).",
    .tp_dealloc = (destructor)slot_buffer_dealloc,
    .tp_traverse = (traverseproc)slot_buffer_traverse,
    .tp_as_buffer = &slot_buffer_as_buffer,
};

/* A new SlotBuffer that holds nothing (Py_DECREF frees it), not tracked yet: its maker sets
 * its fields and hands it to slot_buffer_view. */
static SlotBuffer *slot_buffer_new(void)
{
    SlotBuffer *e = PyObject_GC_New(SlotBuffer, &SlotBuffer_Type);
    if (!e) return NULL;
    e->cache = NULL;
    e->ctx = NULL;
    e->buf = NULL;
    e->len = 0;
    e->slot = UCM_NIL;
    e->slots = &e->slot;
    e->n = 0;
    e->readonly = 1;
    e->held = 0;
    e->exports = 0;
    return e;
}

/* The rest of a view's making, once e's fields are set (its cache, context, bytes and slots):
 * tracked, its holds taken (one more on each of its slots: ucm_pin_again, the process-local
 * count, no shared word), then the memoryview that exports it.  Steals e: the view's managed
 * buffer holds it, or, with no view, it drops its holds as it goes.  NULL with no exception:
 * this process no longer pins those slots (the caller's full path says why). */
static PyObject *slot_buffer_view(SlotBuffer *e)
{
    PyObject *view = NULL;
    PyObject_GC_Track(e); /* every field set: the collector may look at it from here */
    int r = e->slots == &e->slot ? core.pin_again(e->ctx, e->slot)
                                 : core.pin_again_many(e->ctx, e->slots, e->n);
    if (r == UCM_OK) {
        e->held = 1;
        e->cache->exports++;
        view = PyMemoryView_FromObject((PyObject *)e);
    }
    Py_DECREF(e);
    return view;
}

/* A memoryview of the first n bytes of slot, which this process pins (the caller holds a pin
 * on ctx), writable or not, holding a hold of its own (SlotBuffer).  NULL with no exception
 * when this process holds no pin on the slot any more (an allocation's finalizer closed the
 * holder, or the cache): the caller's full path says why; NULL with one for anything else.
 * The SlotBuffer holds its pin before the memoryview's allocations can run a finalizer. */
static PyObject *slot_view(CacheBase *c, ucm_ctx *ctx, uint32_t slot, Py_ssize_t n, int writable)
{
    /* The allocation first: it may run a collection, whose finalizers may close the holder or
     * the cache (freeing ctx); ctx is used only once it is known to be the cache's still. */
    SlotBuffer *e = slot_buffer_new();
    char *p = NULL;
    if (!e || CLOSED_MEANWHILE(c, ctx)) goto error;
    if (!(p = core.slot_data(ctx, slot)) || n < 0 || n > c->stride) {
        PyErr_Format(PyExc_ValueError, "slot %u's payload of %zd bytes lies outside the mapping",
                     slot, n);
        goto error;
    }
    e->cache = (CacheBase *)Py_NewRef(c);
    e->ctx = ctx;
    e->buf = p;
    e->len = n;
    e->slot = slot;
    e->n = 1;
    e->readonly = !writable;
    return slot_buffer_view(e);
error:
    Py_XDECREF(e);
    return NULL;
}

/* A batch's read-only views share one SlotBuffer (one allocation and one pin step per batch,
 * not per position): it holds one more hold on every slot of the batch (ucm_pin_again_many on
 * a copy of its slot list) and exports the data region whole; each position's view is that
 * view narrowed to its payload (narrow_view).  Its holds outlast every view made of it, so a
 * position's slot stays pinned at least as long as its view lives.  NULL with no exception:
 * this process no longer pins the batch's slots (the caller's full path says why). */
static PyObject *batch_region_view(CacheBase *c, ucm_ctx *ctx, const uint32_t *slots,
                                   uint32_t n)
{
    SlotBuffer *e = NULL;
    uint32_t *copy = PyMem_Malloc(sizeof(uint32_t) * (n ? n : 1));
    if (!copy) return PyErr_NoMemory();
    memcpy(copy, slots, sizeof(uint32_t) * n); /* before the allocation: slots may be freed */
    /* As slot_view: the allocation may have run finalizers that closed the batch or cache. */
    if (!(e = slot_buffer_new()) || CLOSED_MEANWHILE(c, ctx)) goto error;
    Py_buffer *ro = c->ro ? PyMemoryView_GET_BUFFER(c->ro) : NULL;
    char *p = core.slot_data(ctx, 0);
    if (!ro || !p || ro->len < c->data_off) {
        PyErr_SetString(PyExc_ValueError, "the cache's mapping has no data region");
        goto error;
    }
    e->cache = (CacheBase *)Py_NewRef(c);
    e->ctx = ctx;
    e->buf = p;
    e->len = ro->len - c->data_off;
    e->slots = copy; /* e's now: freed with it */
    e->n = n;
    return slot_buffer_view(e);
error:
    PyMem_Free(copy);
    Py_XDECREF(e);
    return NULL;
}

/* A view of n bytes at offset off of base (a 1-D read-only byte view), registered on base's
 * managed buffer, so it keeps base's exporter as base would: made as memoryview slicing makes
 * its result (mbuf_add_view, then the buffer narrowed), without the slice object. */
static PyObject *narrow_view(PyObject *base, Py_ssize_t off, Py_ssize_t n)
{
    PyObject *v = PyMemoryView_FromObject(base);
    if (!v) return NULL;
    Py_buffer *b = PyMemoryView_GET_BUFFER(v);
    if (off < 0 || n < 0 || off > b->len || n > b->len - off || b->ndim != 1) {
        Py_DECREF(v);
        PyErr_SetString(PyExc_ValueError, "a slot's payload lies outside the mapping");
        return NULL;
    }
    b->buf = (char *)b->buf + off;
    b->len = n;
    b->shape[0] = n; /* 1-D bytes: strides[0] stays 1, the view stays contiguous */
    return v;
}

/* A destination's items must take raw payload bytes: plain numbers or bytes, never objects
 * or pointers (a payload written over an object array's PyObject* would crash the process).
 * The struct-module/PEP 3118 codes of one plain item, with an optional byte-order prefix. */
static int plain_format(const char *f)
{
    if (!f) return 1; /* "B" */
    if (*f == '@' || *f == '=' || *f == '<' || *f == '>' || *f == '!') f++;
    if (f[0] == 'Z') return (f[1] == 'e' || f[1] == 'f' || f[1] == 'd' || f[1] == 'g') && !f[2];
    return f[0] && !f[1] && strchr("cbB?hHiIlLqQnNefdg", f[0]) != NULL;
}

/* The row size of out for n keys (DESIGN 4.7): a 2-D or higher out is rows by its first
 * dimension (at least n of them; keys go to the first n); a 1-D out is cut into n equal rows.
 * -1 with ValueError/TypeError naming what is wrong, before anything is copied. */
static Py_ssize_t row_size(Py_ssize_t nbytes, int ndim, Py_ssize_t rows, Py_ssize_t n)
{
    if (n <= 0) return 0;
    if (ndim >= 2) {
        if (rows < n) {
            PyErr_Format(PyExc_ValueError, "out has %zd rows (its first dimension), fewer than "
                         "the %zd keys", rows, n);
            return -1;
        }
        return nbytes / rows;
    }
    if (nbytes % n) {
        PyErr_Format(PyExc_ValueError, "out has %zd bytes, not a whole number of rows for %zd "
                     "keys (a 1-D out is cut into equal rows; give a 2-D out for rows of its "
                     "own size)", nbytes, n);
        return -1;
    }
    return nbytes / n;
}

/* out's writable C-contiguous buffer and its row size for n keys.  -1 with an exception: the
 * buffer is not one that may take these rows (the message says why); -2 with none: out has no
 * writable C-contiguous buffer (a torch tensor, or an error the full path words). */
static Py_ssize_t out_rows(PyObject *out, Py_ssize_t n, Py_buffer *ob)
{
    if (PyObject_GetBuffer(out, ob, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        PyErr_Clear();
        return -2;
    }
    Py_ssize_t row = -1;
    if (!plain_format(ob->format))
        PyErr_Format(PyExc_TypeError, "out's items have format '%s': only plain numbers or "
                     "bytes can receive payload bytes (not Python objects or pointers)",
                     ob->format);
    else
        row = row_size(ob->len, ob->ndim, ob->ndim >= 1 ? ob->shape[0] : 1, n);
    if (row < 0) PyBuffer_Release(ob); /* refused: the caller gets no buffer to release */
    return row;
}

/* A field the Python code may have stored None in. */
#define HAS(o) ((o) != NULL && (o) != Py_None)
#define SET_FLAG(field, v) Py_XSETREF(field, Py_NewRef((v) ? Py_True : Py_False))

/* A handle's or batch's _cache as the C paths may use it: a SlotCache, else NULL. */
static inline CacheBase *cache_of(PyObject *o)
{
    return o && PyObject_TypeCheck(o, &CacheBase_Type) ? (CacheBase *)o : NULL;
}

/* The fields of HandleBase and BatchBase, declared once each, as a table F(name, init, access,
 * doc) of the objects they hold (HANDLE_FIELDS, BATCH_FIELDS).  From a table come the struct's
 * `PyObject *name`, its value in a new, inert object (init: NONE, TRUE, FALSE, ZERO, MINUS1,
 * or UNSET: NULL), traverse and clear, the member `_name` when access is MEMBER (T_OBJECT_EX:
 * the Python layer reads and writes it; GETSET: a getset reads and writes it, keeping C's view
 * of it; C: no Python name), and the rows of _hit.FIELDS, against which tests/test_layout.py
 * checks ucmcache/_hit.pyi.  The expansions name the object `o`.  The fields that follow a
 * table in its struct are the C paths' own (a weakref list, a token, C views of the arrays):
 * none holds a strong reference to traverse or clear, none is a member. */
#define FIELD_DECL(name, init, access, doc) PyObject *name;
#define FIELD_INIT(name, init, access, doc) FIELD_INIT_##init(o->name);
#define FIELD_INIT_NONE(f) f = Py_NewRef(Py_None)
#define FIELD_INIT_TRUE(f) f = Py_NewRef(Py_True)
#define FIELD_INIT_FALSE(f) f = Py_NewRef(Py_False)
#define FIELD_INIT_ZERO(f) f = PyLong_FromLong(0)
#define FIELD_INIT_MINUS1(f) f = PyLong_FromLong(-1)
#define FIELD_INIT_UNSET(f) (void)0
#define FIELD_VISIT(name, init, access, doc) Py_VISIT(o->name);
#define FIELD_CLEAR(name, init, access, doc) Py_CLEAR(o->name);
#define FIELD_MEMBER(name, init, access, doc) FIELD_MEMBER_##access(name, doc)
#define FIELD_MEMBER_MEMBER(name, doc) {"_" #name, T_OBJECT_EX, offsetof(FIELDS_OF, name), 0, doc},
#define FIELD_MEMBER_GETSET(name, doc)
#define FIELD_MEMBER_C(name, doc)
#define FIELD_ROW(name, init, access, doc) {"_" #name, #access},

typedef struct {
    const char *name, *access;
} field_row;

/* Every field is an object (see CacheBase.open_handles): the full path in Python reads and
 * writes them all. */
#define HANDLE_FIELDS(F) \
    F(cache, NONE, MEMBER, "Its SlotCache (cache_of).") \
    F(token, NONE, MEMBER, "A slow-path pin's token (cffi's ucm_token *): None for a fast-path " \
      "pin, or one that ctok holds.") \
    F(timeout, NONE, MEMBER, "The get's timeout: wait()'s default.") \
    F(views, NONE, MEMBER, "An owner's writable views while it loads (released at its end).") \
    F(owned, NONE, MEMBER, "An owner's owned-slot set, of the context that became owner.") \
    F(view, NONE, MEMBER, "The payload's read-only view, made once.") \
    F(t0, NONE, MEMBER, "An owner's load start (monotonic ns): the load histogram's.") \
    F(nbytes, MINUS1, MEMBER, "A Ready slot's length when pinned, -1 until known.") \
    F(slot, ZERO, MEMBER, "The slot pinned.") \
    F(closed, TRUE, MEMBER, "True: the pin is dropped (or not taken yet: an inert handle).") \
    F(owner, FALSE, MEMBER, "True: this caller must publish the slot (ready() or fail()).") \
    F(published, FALSE, MEMBER, "An owner's ready() or fail() went through.") \
    F(serial, ZERO, MEMBER, "An owner's load serial (ucm_load_serial; 0 otherwise): what its " \
      "full-path ready()/fail() name (ucm_publish, ucm_fail_load).")

typedef struct HandleBase HandleBase;
static PyTypeObject HandleBase_Type;

struct HandleBase {
    PyObject_HEAD
    HANDLE_FIELDS(FIELD_DECL)
    PyObject *weakreflist;
    ucm_token ctok;     /* the pin of a get's cold key taken in C (cold_handle, or a join's
                         * token moved in: pinned_handle): the C twin of token (zeroed by
                         * tp_alloc: unarmed), dropped by handle_drop, by dealloc if still
                         * armed ("collected without ready()") */
    int kept_owned;     /* an owner closed while another thread's close() had the context away:
                         * its pin, so its load, goes on until the handle is collected, and its
                         * slot stays in its owned set until then (kept_owned_discard) */
};

/* A new handle's fields: inert (closed), no cache, no owner.  No allocation (None, bools and
 * small ints are shared). */
static void handle_init(HandleBase *o) { HANDLE_FIELDS(FIELD_INIT) }

/* The handle's cache when it is open and the cache attached, else NULL. */
static inline CacheBase *handle_usable(HandleBase *h)
{
    CacheBase *c = cache_of(h->cache);
    return IS_OPEN(h->closed) && c && c->ctx ? c : NULL;
}

/* A Handle over the pin of answer r, taken through ctx by the caller, not an owner's: Ready
 * (its length, from the answer) or Loading (a join: nbytes -1, the caller waits).  Until here
 * the caller's C frame owns the pin: in `tok`, a token of the frame, which moves into the
 * handle's ctok (so the handle's drop is the token's: ucm_token_drop), or plain (NULL: the
 * handle's drop is ucm_release).  The handle is allocated while the frame holds the pin: no
 * signal handler can raise there (it would run, if at all, inside a finalizer the allocation's
 * collection runs, where its exception is reported and dropped), and a finalizer that closed
 * the cache meanwhile shows as a changed context (that close's recovery removed our holds).
 * The pin becomes the handle's in plain stores, with no Python code between: its bit stays set
 * and the local count unchanged throughout (I1).  If the handle cannot be made, the pin is
 * dropped here.  NULL with no exception: the cache was closed meanwhile. */
static PyObject *pinned_handle(CacheBase *c, ucm_ctx *ctx, int64_t r, ucm_token *tok)
{
    uint32_t slot = UCM_PIN_SLOT(r);
    PyObject *slot_o = NULL, *len_o = NULL;
    HandleBase *h = (HandleBase *)handle_type->tp_alloc(handle_type, 0);
    if (h) handle_init(h); /* inert until the pin is its own */
    /* Ints are not tracked by the collector: making them runs no Python code. */
    if (!h || CLOSED_MEANWHILE(c, ctx) || !(slot_o = PyLong_FromUnsignedLong(slot)) ||
        !(len_o = PyLong_FromLongLong(r & UCM_PIN_READY ? (long long)UCM_PIN_LEN(r) : -1)))
        goto error;
    if (tok) {
        h->ctok = *tok; /* the token moves: its pin and its context reference with it */
        tok->armed = 0;
    }
    Py_SETREF(h->cache, Py_NewRef(c));
    Py_SETREF(h->slot, slot_o);
    Py_SETREF(h->nbytes, len_o);
    SET_FLAG(h->closed, 0);
    add_open(c, 1);
    return (PyObject *)h;
error:
    Py_XDECREF(slot_o);
    Py_XDECREF(h);
    if (tok) core.token_drop(tok, NULL, 0); /* a closed cache's: touches nothing shared */
    else if (!CLOSED_MEANWHILE(c, ctx)) release_pin(c, ctx, slot); /* else its recovery did */
    return NULL;
}

/* get()'s look (UCM_OUTER_REQUEST: the request counted, and a hit or a join): a new open
 * Handle over its pin, Ready or joined; NULL with *missed set: no pin (a miss, a slot claimed,
 * a corrupt chain), the caller takes the slow step at once, with no second look; NULL with an
 * exception; NULL with neither: a finalizer closed the cache (the full path says so). */
static PyObject *hit_handle(CacheBase *c, PyObject *key, int *missed)
{
    ucm_ctx *ctx = c->ctx;
    int64_t r = lookup(c, ctx, PyBytes_AS_STRING(key), UCM_OUTER_REQUEST);
    if (r < 0) {
        *missed = 1;
        return NULL;
    }
    return pinned_handle(c, ctx, r, NULL);
}

static PyObject *cold_handle(CacheBase *c, PyObject *key);

static PyObject *cache_get(CacheBase *self, PyObject *const *args, Py_ssize_t nargs,
                           PyObject *kwnames)
{
    if (bound && self->ctx && nargs == 1 && plain_id(args[0]) && no_timeout(args, 1, kwnames)) {
        int missed = 0;
        PyObject *h = hit_handle(self, args[0], &missed);
        if (h || PyErr_Occurred()) return h;
        if (missed) { /* the request counted: the slow step at once */
            if (loads_bound && !HAS(self->tier)) return cold_handle(self, args[0]);
            return PyObject_CallMethodOneArg((PyObject *)self, s_get_missed, args[0]);
        }
    }
    return forward((PyObject *)self, s_get_full, args, nargs, kwnames);
}

/* The payload of Ready answer r, whose slot the caller pins, copied into a new bytes; NULL
 * with an exception.  A bytes object is not tracked by the collector: making it runs no Python
 * code. */
static PyObject *ready_bytes(ucm_ctx *ctx, int64_t r)
{
    const char *src = core.slot_data(ctx, UCM_PIN_SLOT(r)); /* NULL: a slot past the table */
    PyObject *v = src ? PyBytes_FromStringAndSize(NULL, UCM_PIN_LEN(r)) : NULL;
    if (v) core.copy_payload(PyBytes_AS_STRING(v), src, UCM_PIN_LEN(r));
    else if (!src) PyErr_Format(PyExc_RuntimeError, "a pin's slot %u lies past the slot table",
                                UCM_PIN_SLOT(r));
    return v;
}

/* A Ready entry's bytes, copied under the pin, the pin dropped; counted as `outer` says.  NULL
 * with no exception for anything but a hit, *answer then the look's answer: with
 * UCM_OUTER_HIT_ONLY any pin is dropped here; with UCM_OUTER_REQUEST a join's pin (*answer >=
 * 0) is the caller's to hand on.  The caller read ctx from c with nothing able to run Python
 * after. */
static PyObject *hit_bytes(CacheBase *c, ucm_ctx *ctx, PyObject *key, ucm_outer outer,
                           int64_t *answer)
{
    int64_t r = *answer = lookup(c, ctx, PyBytes_AS_STRING(key), outer);
    if (r < 0) return NULL;
    uint32_t slot = UCM_PIN_SLOT(r);
    PyObject *v = NULL;
    if (r & UCM_PIN_READY) {
        v = ready_bytes(ctx, r);
    } else if (outer == UCM_OUTER_REQUEST) {
        return NULL; /* a join: the caller's pin */
    }
    release_pin(c, ctx, slot);
    return v;
}

static PyObject *cache_hit_bytes(CacheBase *self, PyObject *key)
{
    if (bound && self->ctx && plain_id(key)) {
        int64_t r;
        PyObject *v = hit_bytes(self, self->ctx, key, UCM_OUTER_HIT_ONLY, &r);
        if (v || PyErr_Occurred()) return v;
        /* A slot that stayed claimed (BUSY): its claimant may have died, so the full path
         * recovers dead ranks if that needs no wait and looks again (_hit_bytes_full). */
        if (r != -(int64_t)UCM_BUSY) Py_RETURN_NONE;
    }
    return PyObject_CallMethodOneArg((PyObject *)self, s_hit_bytes_full, key);
}

/* ---------------------------------------------------------------- the cold get_or_load
 *
 * A cold key's get_or_load is one core step on each side of the loader, with no Handle: the
 * slow path (ucm_get_slow: stripe, look again, claim, evict, install; the pin handed to a
 * token on this C frame's stack) and the finish (ucm_load_finish: copy in, publish, count,
 * observe, unpin).  The owner object of the pin between them (DESIGN 5.5) is this C frame:
 * no signal handler runs inside it except through the loader and the test hooks, whose
 * exceptions are caught here and turned into a Failed load, as the full path's except does.
 * The token keeps the context allocated while the loader runs (a forked child's copy, or a
 * close in another thread, makes the finish touch nothing); close() refuses while a load
 * runs (CacheBase.loads_out, counted in _live_handles), as it refuses for an owner's handle.
 * What the full path decides stays there: any answer of the slow step but a pin (MOVED, FULL,
 * ROLLBACK, BUSY, TIMEOUT, CORRUPT) goes to _get_or_load_cold with the step's start, and
 * SlotCache._pin_slow takes it as its own first step (one deadline from that start, no step
 * counted twice) before it runs the step again in its loop; a join goes to
 * _get_or_load_joined with a Handle that the frame's token, and so the pin, moves into. */

static PyObject *exit_message_of(PyObject *typ, PyObject *exc, PyObject **err_t,
                                 PyObject **err_v, PyObject **err_tb);
static void owned_discard(PyObject *owned, PyObject *slot);
static PyObject *handle_close_with(HandleBase *h, PyObject *msg, PyObject *et, PyObject *ev,
                                   PyObject *tb);

/* The set the current context's owned loads of cache go to (its owned-slot record's own set:
 * the record, a dict, maps the cache's _owned_key to it), a new reference, or NULL with an
 * exception.  One lookup when the context has it; otherwise _slots._owned_slots makes it (the
 * record's rules are written there once). */
static PyObject *owned_set(PyObject *cache)
{
    PyObject *d = NULL, *set = NULL;
    CacheBase *c = cache_of(cache);
    if (PyContextVar_Get(owning, NULL, &d) < 0) return NULL;
    if (d && PyDict_Check(d) && c && c->owned_key) {
        set = PyDict_GetItemWithError(d, c->owned_key);
        if (set && PySet_CheckExact(set)) {
            Py_INCREF(set);
            goto done;
        }
        set = NULL;
        if (PyErr_Occurred()) goto done;
    }
    set = PyObject_CallOneArg(owned_slots, cache);
done:
    Py_XDECREF(d);
    return set;
}

/* A test point of ucmcache._hooks, fired when any is armed (one dict size read otherwise). */
static inline int fire_hook(PyObject *name)
{
    if (!PyDict_GET_SIZE(hooks_armed)) return 0;
    PyObject *r = PyObject_CallOneArg(hooks_fire, name);
    Py_XDECREF(r);
    return r ? 0 : -1;
}

/* Python code run under us (a finalizer, a loader) closed the cache, and a pin of ours went
 * with it: raise what the full path raises for a closed cache (_check_usable: NotAttached).
 * 0, nothing raised: the cache was not closed (or said nothing); the caller names the loss. */
static int raise_if_closed(CacheBase *c, ucm_ctx *ctx)
{
    if (!CLOSED_MEANWHILE(c, ctx)) return 0;
    PyObject *r = PyObject_CallMethodNoArgs((PyObject *)c, s_check_usable);
    Py_XDECREF(r);
    return PyErr_Occurred() != NULL;
}

/* get_or_load's wait on another caller's load: a Handle over the join's pin (pinned_handle,
 * the pin in tok or plain), then the full path's wait and read (_get_or_load_joined). */
static PyObject *wait_joined(CacheBase *c, ucm_ctx *ctx, int64_t r, ucm_token *tok)
{
    PyObject *h = pinned_handle(c, ctx, r, tok), *v = NULL;
    if (h) v = PyObject_CallMethodOneArg((PyObject *)c, s_get_or_load_joined, h);
    else if (!PyErr_Occurred() && !raise_if_closed(c, ctx))
        PyErr_SetString(PyExc_RuntimeError, "get_or_load: the joined slot's pin was lost");
    if (!v && h && IS_OPEN(((HandleBase *)h)->closed)) {
        /* The full path raised before its `with` took h (a signal handler's exception at its
         * first line): h is this frame's, so its pin is dropped here, now, and not with a
         * traceback the caller may keep (I1's pin is never held by nobody's code). */
        PyObject *et, *ev, *etb;
        PyErr_Fetch(&et, &ev, &etb);
        PyObject *x = handle_close_with((HandleBase *)h, unpublished, NULL, NULL, NULL);
        if (x) Py_DECREF(x);
        else PyErr_Clear(); /* the first exception is the one the caller must see */
        PyErr_Restore(et, ev, etb);
    }
    Py_XDECREF(h);
    return v;
}

/* The loader's value as the bytes the slot gets and the caller is returned (steals value): an
 * exact bytes of at most the slot size as it is; anything else through _slots.as_value_view
 * (its checks and messages are the full path's) and copied at once, under the GIL: a writable
 * value (a bytearray, a numpy array) another thread rewrites cannot make the slot and the
 * answer differ (two copies, as the full path makes).  NULL with an exception. */
static PyObject *value_bytes(CacheBase *c, PyObject *value)
{
    PyObject *view_o = NULL, *b = NULL;
    Py_buffer view = {0};
    if (PyBytes_CheckExact(value) && (uint64_t)PyBytes_GET_SIZE(value) <= (uint64_t)c->value_max)
        return value;
    if ((view_o = PyObject_CallFunction(as_value_view, "OK", value,
                                        (unsigned long long)(uint64_t)c->value_max)) &&
        PyObject_GetBuffer(view_o, &view, PyBUF_SIMPLE) == 0)
        b = PyBytes_FromStringAndSize(view.buf, view.len);
    PyBuffer_Release(&view); /* (a no-op if none was taken) */
    Py_XDECREF(view_o);
    Py_DECREF(value);
    return b;
}

/* The loader run by the owner of `slot` (pinned through tok), and the finish.  An exception of
 * the loader, of its value's checks (value_bytes) or of a test hook fails the load with
 * "Type: message" and is raised again. */
static PyObject *own_load(CacheBase *c, ucm_ctx *ctx, ucm_token *tok, uint32_t slot,
                          PyObject *loader)
{
    PyObject *value = NULL, *result = NULL, *owned = NULL, *slot_o = NULL, *msg = NULL;
    PyObject *et = NULL, *ev = NULL, *etb = NULL, *ft = NULL, *fv = NULL, *ftb = NULL;
    int r;
    c->loads_out++;
    add_open(c, 1);
    int64_t t0 = core.now_ns();
    /* The owned-slot record first: a loader that asks for its own key must be refused, not
     * wait for itself (Handle.wait). */
    if (!(slot_o = PyLong_FromUnsignedLong(slot)) || !(owned = owned_set((PyObject *)c)) ||
        PySet_Add(owned, slot_o) < 0 || fire_hook(s_inside_loader) < 0 ||
        !(value = PyObject_CallNoArgs(loader)) || !(value = value_bytes(c, value)) ||
        fire_hook(s_before_ready) < 0)
        goto failed;
    /* Out of the owned set before the finish, which may unpin with the GIL released: a thread
     * sharing this set (asyncio.to_thread copies the context) could own the freed slot's next
     * load meanwhile, and must keep its record (handle_drop does the same). */
    owned_discard(owned, slot_o);
    const char *src = PyBytes_AS_STRING(value);
    Py_ssize_t n = PyBytes_GET_SIZE(value);
    if (__builtin_expect(core.ctx_points_set(ctx), 0) || n > 65536)
        WITHOUT_GIL(c, r = core.load_finish(tok, UCM_READY, src, (uint64_t)n, t0));
    else
        r = core.load_finish(tok, UCM_READY, src, (uint64_t)n, t0);
    if (r != UCM_OK) { /* closed under the loader, or a forked child: NotAttached */
        if (!raise_if_closed(c, ctx))
            PyErr_Format(PyExc_RuntimeError, "get_or_load: the load of slot %u was lost before "
                         "its publish (step answer %d)", slot, r);
        goto done;
    }
    if (fire_hook(s_after_ready) == 0) result = Py_NewRef(value); /* bytes, as the slot got */
    goto done;
failed:
    /* The load failed: its message published Failed, the exception raised again. */
    PyErr_Fetch(&et, &ev, &etb);
    PyErr_NormalizeException(&et, &ev, &etb);
    msg = et ? exit_message_of(et, ev ? ev : Py_None, &ft, &fv, &ftb) : Py_NewRef(unpublished);
    owned_discard(owned, slot_o); /* before the finish, as above */
    if (msg)
        WITHOUT_GIL(c, r = core.load_finish(tok, UCM_FAILED, PyBytes_AS_STRING(msg),
                                            (uint64_t)PyBytes_GET_SIZE(msg), t0));
    else
        core.token_drop(tok, NULL, 0);
    if (ft) {
        /* Naming the error raised (str(e) raised, or a signal handler's exception came
         * meanwhile): that one goes up once the load is failed, the loader's error its
         * context, as the full path's except raises it. */
        PyErr_NormalizeException(&ft, &fv, &ftb);
        if (fv && ev) PyException_SetContext(fv, Py_NewRef(ev));
        Py_XDECREF(et);
        Py_XDECREF(ev);
        Py_XDECREF(etb);
        PyErr_Restore(ft, fv, ftb);
    } else {
        PyErr_Restore(et, ev, etb);
    }
done:
    Py_XDECREF(msg);
    Py_XDECREF(value);
    Py_XDECREF(owned);
    Py_XDECREF(slot_o);
    c->loads_out--;
    add_open(c, -1);
    return result;
}

/* get() of a plain id the hit path looked for, missed and counted as a request: the slow step
 * (ucm_get_slow) straight into the C token of a new Handle, made inert before the step, so the
 * pin has its owner object from the moment it is taken (DESIGN 5.5).  An owner's handle
 * records its load's start and its slot in its context's owned set (Handle.own's work); its
 * data is the slot, writable (handle_data), and its ready() one core step (handle_ready).  Any
 * answer but a pin: the full path (_get_missed), which runs the step in its loop. */
static PyObject *cold_handle(CacheBase *c, PyObject *key)
{
    ucm_ctx *ctx = c->ctx;
    PyObject *result = NULL, *slot_o = NULL, *len_o = NULL, *t0_o = NULL, *serial_o = NULL;
    PyObject *owned = NULL;
    int64_t r, since;
    HandleBase *h = (HandleBase *)handle_type->tp_alloc(handle_type, 0);
    if (!h) return NULL;
    handle_init(h);
    if (CLOSED_MEANWHILE(c, ctx)) { /* a finalizer of the allocation closed the cache */
        result = PyObject_CallMethodOneArg((PyObject *)c, s_get_missed, key);
        goto done;
    }
    since = core.now_ns();
    WITHOUT_GIL(c, r = core.get_slow(ctx, PyBytes_AS_STRING(key), 0, slow_spin, max_rollbacks,
                                     stripe_wait_ns, &h->ctok, NULL, NULL));
    if (r < 0) { /* nothing armed: the full path decides, this step its first (_pin_slow) */
        result = PyObject_CallMethod((PyObject *)c, "_get_missed", "OLL", key, (long long)-r,
                                     (long long)since);
        goto done;
    }
    int ready = (r & UCM_PIN_READY) != 0, owner = !ready && (r & UCM_PIN_OWNER);
    /* Ints are not tracked by the collector: making them runs no Python code.  On failure the
     * handle's dealloc drops the armed token: an owner's load fails at once. */
    if (!(slot_o = PyLong_FromUnsignedLong(UCM_PIN_SLOT(r))) ||
        !(len_o = PyLong_FromLongLong(ready ? (long long)UCM_PIN_LEN(r) : -1)))
        goto done;
    /* The load's serial, the token's (armed by the step): ready()/fail() name it (I4). */
    if (owner && (!(t0_o = PyLong_FromLongLong(core.now_ns())) ||
                  !(serial_o = PyLong_FromUnsignedLong(h->ctok.serial))))
        goto done;
    /* The pin is the handle's already (its token); the fields in plain stores. */
    Py_SETREF(h->cache, Py_NewRef(c));
    Py_SETREF(h->slot, Py_NewRef(slot_o));
    Py_SETREF(h->nbytes, Py_NewRef(len_o));
    SET_FLAG(h->owner, owner);
    SET_FLAG(h->closed, 0);
    add_open(c, 1);
    if (owner) {
        Py_SETREF(h->serial, Py_NewRef(serial_o));
        Py_SETREF(h->t0, Py_NewRef(t0_o));
        /* may run a collection (finalizers): the handle is open and owns its pin by now */
        if (!(owned = owned_set((PyObject *)c)) || PySet_Add(owned, h->slot) < 0) {
            /* closed as an owner's with-block that raised: the load fails, the error goes up */
            PyObject *et, *ev, *tb;
            PyErr_Fetch(&et, &ev, &tb);
            PyObject *x = handle_close_with(h, unpublished, et, ev, tb);
            Py_XDECREF(x);
            goto done;
        }
        Py_SETREF(h->owned, Py_NewRef(owned));
    }
    result = Py_NewRef((PyObject *)h);
done:
    Py_XDECREF(slot_o);
    Py_XDECREF(len_o);
    Py_XDECREF(t0_o);
    Py_XDECREF(serial_o);
    Py_XDECREF(owned);
    Py_DECREF(h);
    return result;
}

/* get_or_load of a plain id whose look found no pin to hold (a miss, a slot claimed), counted
 * as the request: the slow step at once, no second look before the stripe. */
static PyObject *cold_load(CacheBase *c, PyObject *const *args, Py_ssize_t nargs,
                           PyObject *kwnames)
{
    ucm_ctx *ctx = c->ctx;
    ucm_token tok = {0};
    int64_t r, since;
    if (!ctx) return forward((PyObject *)c, s_get_or_load_full, args, nargs, kwnames);
    since = core.now_ns();
    WITHOUT_GIL(c, r = core.get_slow(ctx, PyBytes_AS_STRING(args[0]), 0, slow_spin,
                                     max_rollbacks, stripe_wait_ns, &tok, NULL, NULL));
    if (r < 0) /* the full path's decisions, this step its first (_pin_slow: one deadline,
                * the same counters); timeout is None here (cache_get_or_load) */
        return PyObject_CallMethod((PyObject *)c, "_get_or_load_cold", "OOLL", args[0], args[1],
                                   (long long)-r, (long long)since);
    uint32_t slot = UCM_PIN_SLOT(r);
    /* READY first: a Ready answer's length overlaps the OWNER bit (UCM_PIN_* in the header). */
    if (!(r & UCM_PIN_READY) && (r & UCM_PIN_OWNER))
        return own_load(c, ctx, &tok, slot, args[1]);
    if (!(r & UCM_PIN_READY))
        /* A join: the token, and with it the pin, moves into the Handle that waits in the full
         * path: pinned once (I1: the pin bit set throughout, the token's drop the handle's). */
        return wait_joined(c, ctx, r, &tok);
    /* Found Ready under the stripe (another caller's load landed meanwhile): a copy. */
    PyObject *v = ready_bytes(ctx, r);
    core.token_drop(&tok, NULL, 0);
    return v;
}

static PyObject *cache_get_or_load(CacheBase *self, PyObject *const *args, Py_ssize_t nargs,
                                   PyObject *kwnames)
{
    if (bound && self->ctx && nargs == 2 && plain_id(args[0]) && PyCallable_Check(args[1]) &&
        no_timeout(args, 2, kwnames)) {
        ucm_ctx *ctx = self->ctx;
        int64_t r;
        PyObject *v = hit_bytes(self, ctx, args[0], UCM_OUTER_REQUEST, &r);
        if (v || PyErr_Occurred()) return v;
        /* The request counted by the look: a join waits with the look's pin; anything else
         * (a miss, a slot claimed) takes the slow step at once.  So a cold key is looked up
         * once before the stripe, once under it. */
        if (r >= 0) return wait_joined(self, ctx, r, NULL);
        if (loads_bound && !HAS(self->tier)) return cold_load(self, args, nargs, kwnames);
        return forward((PyObject *)self, s_get_or_load_cold, args, nargs, kwnames);
    }
    return forward((PyObject *)self, s_get_or_load_full, args, nargs, kwnames);
}

/* read_many of a list of plain ids into a buffer-protocol `out`: one core call with the GIL
 * released for the copies.  NULL with no exception: the full path takes the call (other key
 * forms, a tensor or a buffer that is not writable and C-contiguous, rows that do not divide;
 * it also owns every error message). */
/* ---------------------------------------------------------------- Ready (aget_or_load) */

/* What `aget_or_load` returns on a hit: a coroutine that is finished in its first step (send
 * raises StopIteration(value)), so `await cache.aget_or_load(k, f)` costs a hit and an await,
 * no frame.  Registered as a collections.abc.Coroutine (ucmcache/_handle.py): asyncio's
 * create_task, gather and wait_for take it as they take a native coroutine. */
typedef struct {
    PyObject_HEAD
    PyObject *value; /* NULL once awaited, thrown into or closed */
} Ready;

static PyTypeObject Ready_Type;

static PyObject *ready_new_value(PyObject *value) /* steals value */
{
    Ready *r = PyObject_New(Ready, &Ready_Type);
    if (!r) {
        Py_DECREF(value);
        return NULL;
    }
    r->value = value;
    return (PyObject *)r;
}

static PyObject *ready_next(Ready *r)
{
    if (!r->value) {
        PyErr_SetString(PyExc_RuntimeError, "cannot reuse already awaited coroutine");
        return NULL;
    }
    PyObject *v = r->value;
    r->value = NULL;
    PyErr_SetObject(PyExc_StopIteration, v); /* v is bytes: never a tuple or an exception */
    Py_DECREF(v);
    return NULL;
}

static PyObject *ready_send(Ready *r, PyObject *arg) { return ready_next(r); }

static PyObject *ready_throw(Ready *r, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs < 1 || nargs > 3) {
        PyErr_SetString(PyExc_TypeError, "throw expected 1 to 3 arguments");
        return NULL;
    }
    Py_CLEAR(r->value); /* a coroutine thrown into before its first step never runs */
    PyObject *typ = args[0], *val = nargs > 1 ? args[1] : NULL;
    if (PyExceptionInstance_Check(typ)) PyErr_SetObject((PyObject *)Py_TYPE(typ), typ);
    else if (PyExceptionClass_Check(typ)) PyErr_SetObject(typ, val == Py_None ? NULL : val);
    else PyErr_SetString(PyExc_TypeError, "exceptions must be classes or instances deriving "
                         "from BaseException");
    return NULL;
}

static PyObject *ready_close(Ready *r, PyObject *unused)
{
    Py_CLEAR(r->value);
    Py_RETURN_NONE;
}

static PyObject *ready_await(PyObject *self) { return Py_NewRef(self); }

static void ready_dealloc(Ready *r)
{
    Py_CLEAR(r->value);
    PyObject_Free(r);
}

static PyMethodDef ready_methods[] = {
    {"send", (PyCFunction)ready_send, METH_O, NULL},
    {"throw", (PyCFunction)(void (*)(void))ready_throw, METH_FASTCALL, NULL},
    {"close", (PyCFunction)ready_close, METH_NOARGS, NULL},
    {NULL},
};

static PyAsyncMethods ready_async = {.am_await = ready_await};

static PyTypeObject Ready_Type = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "ucmcache._hit.Ready",
    .tp_basicsize = sizeof(Ready),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "aget_or_load's answer on a hit: a coroutine finished in its first step.",
    .tp_dealloc = (destructor)ready_dealloc,
    .tp_as_async = &ready_async,
    .tp_iter = PyObject_SelfIter,
    .tp_iternext = (iternextfunc)ready_next,
    .tp_methods = ready_methods,
};

static PyObject *cache_aget_or_load(CacheBase *self, PyObject *const *args, Py_ssize_t nargs,
                                    PyObject *kwnames)
{
    if (bound && self->ctx && nargs == 2 && plain_id(args[0]) && PyCallable_Check(args[1]) &&
        no_timeout(args, 2, kwnames)) {
        int64_t r;
        PyObject *v = hit_bytes(self, self->ctx, args[0], UCM_OUTER_HIT_ONLY, &r);
        if (v) return ready_new_value(v);
        if (PyErr_Occurred()) return NULL;
        return forward((PyObject *)self, s_aget_or_load_missed, args, nargs, kwnames);
    }
    return forward((PyObject *)self, s_aget_or_load_full, args, nargs, kwnames);
}

/* Copy the plain ids of `keys` (n of them) into ids.  Run with nothing able to run Python
 * code after it until the ids are used: a finalizer could change the list.  0: the list is not
 * n plain ids any more. */
static int copy_ids(PyObject *keys, Py_ssize_t n, char *ids)
{
    if (PyList_GET_SIZE(keys) != n) return 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *k = PyList_GET_ITEM(keys, i);
        if (!plain_id(k)) return 0;
        memcpy(ids + 16 * i, PyBytes_AS_STRING(k), 16);
    }
    return 1;
}

static int all_plain(PyObject *keys)
{
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(keys); i++)
        if (!plain_id(PyList_GET_ITEM(keys, i))) return 0;
    return 1;
}

static PyObject *call_n(PyObject *f, Py_ssize_t n);

/* The lengths of a copy of n keys into rows of `row` bytes (read_many, gather: lens, whose
 * items are at lp; rc the step's answer), checked as the full path checks them: a corrupt
 * chain, or a payload longer than its row, is raised by _read_checked, which says which.  A
 * new reference to lens, or NULL with the error. */
static PyObject *checked_lengths(CacheBase *c, int rc, PyObject *lens, const int64_t *lp,
                                 Py_ssize_t n, Py_ssize_t row)
{
    int64_t worst = -1;
    for (Py_ssize_t i = 0; i < n; i++)
        if (lp[i] > worst) worst = lp[i];
    if (rc != UCM_OK || worst > (int64_t)row) {
        PyObject *checked = PyObject_CallMethod((PyObject *)c, "_read_checked", "iOn", rc, lens,
                                                row);
        if (!checked) return NULL;
        Py_DECREF(checked);
    }
    return Py_NewRef(lens);
}

static PyObject *read_many_fast(CacheBase *c, PyObject *keys, PyObject *out)
{
    Py_ssize_t n = PyList_GET_SIZE(keys);
    if (n == 0 || n > (Py_ssize_t)UINT32_MAX || !all_plain(keys)) return NULL;
    Py_buffer ob, lb = {0};
    Py_ssize_t row_n = out_rows(out, n, &ob);
    if (row_n < 0) return NULL; /* -1: said; -2: the full path takes it (a tensor...) */
    ucm_ctx *ctx = c->ctx;
    PyObject *lens = NULL, *result = NULL;
    char small[16 * 64], *ids = small;
    /* Everything that can run Python code first (see copy_ids) */
    if (!(lens = call_n(new_lengths, n)) ||
        PyObject_GetBuffer(lens, &lb, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0)
        goto done;
    if (n > 64 && !(ids = PyMem_Malloc(16 * (size_t)n))) {
        PyErr_NoMemory();
        goto done;
    }
    if (CLOSED_MEANWHILE(c, ctx) || !copy_ids(keys, n, ids)) goto done; /* the full path */
    int rc;
    WITHOUT_GIL(c, rc = core.read_many(ctx, ids, NULL, (uint32_t)n, ob.buf, (uint64_t)row_n,
                                       lb.buf));
    /* A key's slot stayed claimed (BUSY; the read counted nothing).  A live claimant's claim
     * ends by itself: this answer stands, counted once here.  A dead one's stays until a
     * recovery, and a failed probe is the full path's to raise: it reads again, recovering
     * dead ranks if that needs no wait (_read_many_full); NULL with no exception says so. */
    if (rc == UCM_BUSY && loads_bound && !CLOSED_MEANWHILE(c, ctx)
        && core.claimant_dead(ctx, ids, NULL, (uint32_t)n, c->lock_fd, life_byte0) == 0) {
        core.read_count(ctx, lb.buf, (uint32_t)n);
        rc = UCM_OK;
    }
    if (rc != UCM_BUSY) result = checked_lengths(c, rc, lens, lb.buf, n, row_n);
done:
    if (ids != small) PyMem_Free(ids);
    PyBuffer_Release(&lb); /* (a no-op if none was taken) */
    PyBuffer_Release(&ob);
    Py_XDECREF(lens);
    return result;
}

static PyObject *cache_read_many(CacheBase *self, PyObject *const *args, Py_ssize_t nargs,
                                 PyObject *kwnames)
{
    if (bound && self->ctx && nargs == 2 && !kwnames && PyList_CheckExact(args[0])) {
        PyObject *r = read_many_fast(self, args[0], args[1]);
        if (r || PyErr_Occurred()) return r;
    }
    return forward((PyObject *)self, s_read_many_full, args, nargs, kwnames);
}

/* The caches made in this process so far: the next one's _owned_key (read and counted under
 * the GIL; a forked child goes on counting from its parent's, whose caches it cannot use). */
static unsigned long long caches_made;

static PyObject *cache_new(PyTypeObject *type, PyObject *args, PyObject *kw)
{
    CacheBase *c = (CacheBase *)type->tp_alloc(type, 0);
    if (c && (!(c->open_handles = PyLong_FromLong(0)) ||
              !(c->owned_key = PyLong_FromUnsignedLongLong(++caches_made))))
        Py_CLEAR(c);
    return (PyObject *)c;
}

/* Tracked by the collector: a cache's objects can lead back to it (its tier is bound with the
 * cache's own _count, a bound method: cache -> tier -> method -> cache), and such a cycle is
 * collectable only if the collector sees the cache's edges.  (A cycle through the SlotCache's
 * __dict__ is traversed by its Python subclass.) */
static int cache_traverse(CacheBase *c, visitproc visit, void *arg)
{
    Py_VISIT(c->ctx_obj);
    Py_VISIT(c->open_handles);
    Py_VISIT(c->ro);
    Py_VISIT(c->tier);
    return 0;
}

/* Breaks a cycle at the tier, the one field whose object can refer back to the cache.  By
 * then the cache's finalizer (SlotCache.__del__) has closed it; the context, the mapping's
 * view and the count stay until dealloc, since other garbage of the same collection (handles,
 * views: a SlotBuffer's drop reads the context) may still read them as it goes. */
static int cache_clear(CacheBase *c)
{
    Py_CLEAR(c->tier);
    return 0;
}

static void cache_dealloc(CacheBase *c)
{
    PyObject_GC_UnTrack(c);
    Py_CLEAR(c->open_handles);
    Py_CLEAR(c->tier);
    Py_CLEAR(c->ctx_obj);
    Py_CLEAR(c->ro);
    Py_CLEAR(c->owned_key);
    Py_TYPE(c)->tp_free((PyObject *)c);
}

static PyObject *cache_get_many(CacheBase *self, PyObject *const *args, Py_ssize_t nargs,
                                PyObject *kwnames);

static PyObject *cache_detach(CacheBase *c, PyObject *unused)
{
    /* One step under the GIL: no C path can start a core call on the context after it, and
     * none is running one (else None: close() waits and asks again). */
    if (c->calls_out > 0 || c->forks_out > 0 || !c->ctx_obj) Py_RETURN_NONE;
    PyObject *ctx = c->ctx_obj;
    c->ctx = NULL;
    c->ctx_obj = NULL;
    return ctx;
}

/* _load_serial(slot): the serial of this process's latest install of the slot (ucm_load_serial),
 * or -1 with no context (closed, a forked child's copy, or away inside another thread's
 * close()).  The context is read and used under the GIL (or counted in calls_out), in one step:
 * a close in another thread cannot free it in between, as it could between a Python read of
 * _ctx and a cffi call (which releases the GIL). */
static PyObject *cache_load_serial(CacheBase *c, PyObject *arg)
{
    unsigned long slot = PyLong_AsUnsignedLong(arg);
    if (slot == (unsigned long)-1 && PyErr_Occurred()) return NULL;
    if (!loads_bound || !c->ctx || slot > UCM_PIN_SLOT_MASK) return PyLong_FromLong(-1);
    uint32_t serial;
    /* With test points set, the GIL released (a gate may hold the slot's process-local lock,
     * as in handle_drop), counted so close() cannot take the context meanwhile. */
    if (__builtin_expect(core.ctx_points_set(c->ctx), 0))
        WITHOUT_GIL(c, serial = core.load_serial(c->ctx, (uint32_t)slot));
    else
        serial = core.load_serial(c->ctx, (uint32_t)slot);
    return PyLong_FromUnsignedLong(serial);
}

/* A fork's parent side: the context, counted as held by a fork until _fork_release (close()
 * waits for it: the parent drops the pins it holds across the fork through this context after
 * the child's copies are made), or None if the cache has none.  One step under the GIL, as
 * _detach: a close in another thread either took the context first or waits for the fork. */
static PyObject *cache_forks_out(CacheBase *c, PyObject *unused)
{
    return PyLong_FromSsize_t(c->forks_out);
}

/* A fork's parent side, one C step each way, so that no exception (a signal handler's) can
 * fall between a hold and its record: _fork_hold(slots, holds) counts the fork on this cache,
 * holds one more pin on every slot this process pins (ucm_hold_pins into `slots`, a uint32
 * buffer of capacity items) and appends (self, ctx, slots, n) to the list `holds`, all with
 * the GIL held; nothing is held (and False returned) when the cache has no context or pins
 * nothing.  _fork_release(ctx, slots, n) drops those pins and the count.  close() waits while
 * the count is above zero (cache_detach): the pins are dropped through ctx. */
static PyObject *cache_fork_hold(CacheBase *c, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2 || !PyList_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "_fork_hold(slots, holds)");
        return NULL;
    }
    ucm_ctx *ctx = c->ctx;
    Py_buffer *ro = c->ro ? PyMemoryView_GET_BUFFER(c->ro) : NULL;
    if (!ctx || !c->ctx_obj || !ro || c->stride <= 0 || ro->len < c->data_off) Py_RETURN_FALSE;
    /* At least one item per slot of the data region: ucm_hold_pins writes one per pinned slot */
    Py_ssize_t need = (ro->len - c->data_off) / c->stride;
    PyObject *rec = NULL, *n_obj = NULL, *result = NULL;
    Py_buffer b = {0};
    uint32_t n = 0;
    if (!(rec = PyTuple_New(4)) ||
        PyObject_GetBuffer(args[0], &b, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0)
        goto done;
    if (CLOSED_MEANWHILE(c, ctx)) { /* the context gone while we allocated: nothing to hold */
        result = Py_NewRef(Py_False);
        goto done;
    }
    if (b.len < need * (Py_ssize_t)sizeof(uint32_t)) {
        PyErr_Format(PyExc_ValueError, "_fork_hold: slots holds %zd bytes, %zd needed", b.len,
                     need * (Py_ssize_t)sizeof(uint32_t));
        goto done;
    }
    if (!(n = core.hold_pins(ctx, (uint32_t *)b.buf))) {
        result = Py_NewRef(Py_False);
        goto done;
    }
    if (!(n_obj = PyLong_FromUnsignedLong(n))) goto done;
    PyTuple_SET_ITEM(rec, 0, Py_NewRef(c));
    PyTuple_SET_ITEM(rec, 1, Py_NewRef(c->ctx_obj));
    PyTuple_SET_ITEM(rec, 2, Py_NewRef(args[0]));
    PyTuple_SET_ITEM(rec, 3, n_obj);
    if (PyList_Append(args[1], rec) < 0) goto done;
    c->forks_out++;
    result = Py_NewRef(Py_True);
done:
    if (!result && n) core.release_many(ctx, (const uint32_t *)b.buf, n); /* held, unrecorded */
    PyBuffer_Release(&b);
    Py_XDECREF(rec);
    return result;
}

static PyObject *cache_fork_release(CacheBase *c, PyObject *const *args, Py_ssize_t nargs)
{
    Py_buffer b;
    unsigned long n;
    if (nargs != 2 || (n = PyLong_AsUnsignedLong(args[1])) == (unsigned long)-1) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "_fork_release(slots, n)");
        return NULL;
    }
    if (PyObject_GetBuffer(args[0], &b, PyBUF_C_CONTIGUOUS) < 0) return NULL;
    if (c->ctx && n <= (unsigned long)(b.len / sizeof(uint32_t)))
        core.release_many(c->ctx, (const uint32_t *)b.buf, (uint32_t)n);
    PyBuffer_Release(&b);
    if (c->forks_out > 0) c->forks_out--;
    Py_RETURN_NONE;
}

static PyObject *cache_slot_view(CacheBase *c, PyObject *const *args, Py_ssize_t nargs)
{
    unsigned long slot;
    Py_ssize_t n;
    int writable;
    if (nargs != 3 || (slot = PyLong_AsUnsignedLong(args[0])) == (unsigned long)-1 ||
        (n = PyLong_AsSsize_t(args[1])) == -1 || (writable = PyObject_IsTrue(args[2])) < 0) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_TypeError, "_slot_view(slot, nbytes, writable)");
        return NULL;
    }
    if (!c->ctx || slot > UCM_PIN_SLOT_MASK) {
        PyErr_SetString(PyExc_ValueError, "_slot_view: no such slot, or the cache is detached");
        return NULL;
    }
    PyObject *v = slot_view(c, c->ctx, (uint32_t)slot, n, writable);
    if (!v && !PyErr_Occurred())
        PyErr_Format(PyExc_BufferError, "slot %lu is not pinned by this process", slot);
    return v;
}

static PyMethodDef cache_methods[] = {
    {"_slot_view", (PyCFunction)(void (*)(void))cache_slot_view, METH_FASTCALL,
     "_slot_view(slot, nbytes, writable): a view of a slot this process pins, holding a pin\n"
     "of its own while it (or anything made from it) lives."},
    {"_fork_hold", (PyCFunction)(void (*)(void))cache_fork_hold, METH_FASTCALL,
     "_fork_hold(slots, holds): a fork's parent side holds every slot this process pins and\n"
     "appends (cache, ctx, slots, n) to holds, in one step; False if nothing was held."},
    {"_fork_release", (PyCFunction)(void (*)(void))cache_fork_release, METH_FASTCALL,
     "_fork_release(slots, n): drops one _fork_hold's pins and its count."},
    {"_load_serial", (PyCFunction)cache_load_serial, METH_O,
     "_load_serial(slot): the serial of this process's latest install of the slot, or -1 with\n"
     "no context; read under the GIL (the owned-slot record's inherited loads)."},
    {"_forks_out", (PyCFunction)cache_forks_out, METH_NOARGS,
     "Forks whose parent side holds pins through this cache now."},
    {"_detach", (PyCFunction)cache_detach, METH_NOARGS,
     "The context, taken away from every path of this cache (_ctx becomes None), or None\n"
     "while another thread's core call runs on it without the GIL, or a fork's parent side\n"
     "holds it (close() asks again)."},
    {"get_many", (PyCFunction)(void (*)(void))cache_get_many, METH_FASTCALL | METH_KEYWORDS,
     "get_many($self, keys, *, timeout=None)\n--\n\n"
     "Pin every key of a request with one C call (misses take the slow path, every miss's\n"
     "step in one C call).\n"
     "Positions that come back owned must be filled and published by the caller.  All or\n"
     "nothing: if any key cannot be pinned, nothing stays pinned or owned."},
    {"get", (PyCFunction)(void (*)(void))cache_get, METH_FASTCALL | METH_KEYWORDS,
     "get($self, key, *, timeout=None)\n--\n\n"
     "Pin the slot for key.  A hit returns at once; a cold key makes this caller the owner\n"
     "(h.owner: fill h.data, then h.ready(n) or h.fail(msg)); a key another caller is loading\n"
     "returns a handle to wait() on.  ``timeout`` bounds this call's wait for a bucket lock\n"
     "and is the default for that wait."},
    {"get_or_load", (PyCFunction)(void (*)(void))cache_get_or_load,
     METH_FASTCALL | METH_KEYWORDS,
     "get_or_load($self, key, loader, *, timeout=None)\n--\n\n"
     "The value for key, computed by ``loader()`` exactly once across all processes.\n\n"
     "loader returns a bytes-like of at most slot_size bytes.  Its exception reaches this\n"
     "caller as itself and every concurrent waiter as LoadFailed.  When the cache is full the\n"
     "loader runs uncached (counted as a bypass).  A hit is one step: pin, copy, release."},
    {"read_many", (PyCFunction)(void (*)(void))cache_read_many, METH_FASTCALL | METH_KEYWORDS,
     "read_many($self, keys, out)\n--\n\n"
     "Copy every key that is Ready now into row i of ``out`` and return the lengths\n"
     "(int64; -1 for a key that is missing or not Ready, its row untouched), in one C call\n"
     "that pins, copies and releases the keys a chunk at a time (the GIL released).  Elects no owner\n"
     "and creates nothing.  ``out`` as for HandleBatch.gather."},
    {"aget_or_load", (PyCFunction)(void (*)(void))cache_aget_or_load,
     METH_FASTCALL | METH_KEYWORDS,
     "aget_or_load($self, key, loader, *, timeout=None)\n--\n\n"
     "get_or_load for asyncio (a coroutine: await it).  ``loader`` may be a plain callable or\n"
     "a coroutine function.  A hit returns with no thread hop and no frame; a cold key makes\n"
     "this task the owner and awaits its loader; waiting for another task's, thread's or\n"
     "process's load never blocks the event loop (the futex wait runs in a thread) and honours\n"
     "``timeout`` and cancellation: a cancelled owner publishes Failed, a cancelled waiter\n"
     "abandons the wait, never the load.  Single flight across tasks, threads and processes."},
    {"_hit_bytes", (PyCFunction)cache_hit_bytes, METH_O,
     "A Ready entry's bytes (pin, copy, release; no Handle), or None for anything else.\n"
     "Counts only a hit."},
    {NULL},
};

static PyMemberDef cache_members[] = {
    {"_open_handles", T_OBJECT_EX, offsetof(CacheBase, open_handles), 0, NULL},
    {"_data_off", T_PYSSIZET, offsetof(CacheBase, data_off), 0, NULL},
    {"_stride", T_PYSSIZET, offsetof(CacheBase, stride), 0, NULL},
    {"_tier", T_OBJECT, offsetof(CacheBase, tier), 0, NULL},
    {"_value_max", T_PYSSIZET, offsetof(CacheBase, value_max), 0, NULL},
    {"_lock_fd", T_INT, offsetof(CacheBase, lock_fd), 0, NULL},
    {"_loads_out", T_PYSSIZET, offsetof(CacheBase, loads_out), READONLY,
     "Cold get_or_loads whose loader runs now (each owns a load); close() refuses while any is."},
    {"_exports", T_PYSSIZET, offsetof(CacheBase, exports), READONLY,
     "Views of slot bytes alive now (each keeps its slot pinned); close() refuses while any is."},
    {"_owned_key", T_OBJECT, offsetof(CacheBase, owned_key), READONLY,
     "This cache's key in the owned-slot records: never another cache's of this process."},
    {NULL},
};

static PyObject *cache_get_ro(CacheBase *c, void *closure)
{
    return Py_NewRef(c->ro ? c->ro : Py_None);
}

static int cache_set_ro(CacheBase *c, PyObject *v, void *closure)
{
    /* The mapping's read-only view (the Python layer's slices of it): what that assumes. */
    if (v && v != Py_None) {
        Py_buffer *b = PyMemoryView_Check(v) ? PyMemoryView_GET_BUFFER(v) : NULL;
        if (!b || b->ndim != 1 || b->itemsize != 1 || !b->readonly ||
            (b->strides && b->strides[0] != 1) || (b->format && strcmp(b->format, "B"))) {
            PyErr_SetString(PyExc_TypeError, "_ro must be a 1-D read-only contiguous memoryview "
                            "of bytes");
            return -1;
        }
    }
    Py_XSETREF(c->ro, v && v != Py_None ? Py_NewRef(v) : NULL);
    return 0;
}

static PyGetSetDef cache_getset[] = {
    {"_ctx", (getter)cache_get_ctx, (setter)cache_set_ctx, NULL, NULL},
    {"_ro", (getter)cache_get_ro, (setter)cache_set_ro, NULL, NULL},
    {NULL},
};

static PyTypeObject CacheBase_Type = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "ucmcache._hit.CacheBase",
    .tp_basicsize = sizeof(CacheBase),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "SlotCache's hit path (get, get_or_load, read_many) in C.",
    .tp_new = cache_new,
    .tp_dealloc = (destructor)cache_dealloc,
    .tp_traverse = (traverseproc)cache_traverse,
    .tp_clear = (inquiry)cache_clear,
    .tp_methods = cache_methods,
    .tp_members = cache_members,
    .tp_getset = cache_getset,
};

/* ---------------------------------------------------------------- HandleBase */

static PyObject *handle_new(PyTypeObject *type, PyObject *args, PyObject *kw)
{
    HandleBase *h = (HandleBase *)type->tp_alloc(type, 0);
    if (h) handle_init(h); /* inert: SlotCache._get_full stores the fields */
    return (PyObject *)h;
}

/* The Failed message of an owner whose with-block raised, as _slots.exit_message makes it
 * ("Type: message").  Formatting may run Python code (an exception's __str__) and so fail (a
 * signal handler's exception): then the type's name alone, and the error in *err for the
 * caller to raise once the pins are dropped.  Never NULL unless memory ran out. */
static PyObject *exit_message_of(PyObject *typ, PyObject *exc, PyObject **err_t,
                                 PyObject **err_v, PyObject **err_tb)
{
    PyObject *name = PyType_Check(typ) ? PyObject_GetAttrString(typ, "__name__") : NULL;
    PyObject *text = name ? PyUnicode_FromFormat("%U: %S", name, exc) : NULL;
    if (!text) {
        PyErr_Fetch(err_t, err_v, err_tb);
        text = name ? Py_NewRef(name) : NULL;
    }
    Py_XDECREF(name);
    PyObject *msg = text ? PyUnicode_AsEncodedString(text, "utf-8", "replace") : NULL;
    Py_XDECREF(text);
    if (!msg) {
        PyErr_Clear();
        msg = Py_NewRef(unpublished);
    }
    return msg;
}

/* The one drop of a handle's pin: closed and uncounted first, then the pin dropped by one core
 * step (a slow-path pin through its token, which fails an owner's unpublished load; a
 * fast-path pin by ucm_release), with no Python code before it (cffi's functions are C).
 * 1: dropped, the Python bookkeeping (_after_drop) is due; 0: nothing to drop (closed
 * already, or a forked or closed cache's handle, whose pin is not ours); -1: an error, the
 * handle closed anyway. */
/* An owner's slot leaves its context's owned set inside the drop, with no Python code between
 * the two: _after_drop is Python, and an exception a signal handler raises at its first line
 * would leave the slot there for good, so that a later wait of this context on the slot,
 * Loading then for another key or another owner, would refuse as waiting for itself.  Only a
 * set's own entries are touched (the set of a batch with no owner is a frozen stand-in). */
static void owned_discard(PyObject *owned, PyObject *slot)
{
    if (!HAS(owned) || !PySet_Check(owned) || !slot) return;
    if (PySet_Discard(owned, slot) < 0) PyErr_Clear(); /* hashing a small int cannot fail */
}

/* Whether a cache that is not usable is so for good (closed, or a forked child's copy: its
 * _why_unusable says which, set once a close commits), not for a moment: another thread's
 * close() has the context away while it checks for handles made meanwhile, and gives it back
 * when it refuses.  An owner dropped then keeps its slot in the owned set (its load may go on).
 * Reads an attribute; any exception pending is kept, none is added. */
static int unusable_for_good(PyObject *cache)
{
    if (!cache_of(cache)) return 1;
    PyObject *et, *ev, *tb;
    PyErr_Fetch(&et, &ev, &tb); /* (a finalizer's caller may have one pending: kept) */
    PyObject *why = PyObject_GetAttr(cache, s_why_unusable);
    int r = why && PyUnicode_Check(why) && PyUnicode_GET_LENGTH(why) > 0;
    Py_XDECREF(why);
    PyErr_Clear();
    PyErr_Restore(et, ev, tb);
    return r;
}

static int handle_drop(HandleBase *h, PyObject *msg)
{
    CacheBase *c = handle_usable(h);
    if (!IS_OPEN(h->closed)) return 0; /* closed already: its load ended then */
    SET_FLAG(h->closed, 1);
    if (!c) {
        /* A closed or forked cache's: not our pin.  But an owner's load ends with its handle
         * when the cache is gone for good (closed, finalized first in a cycle with it): its
         * slot leaves the owned set, which a later wait of its context on that slot would read. */
        if (h->owner == Py_True) {
            if (unusable_for_good(h->cache)) owned_discard(h->owned, h->slot);
            else h->kept_owned = 1; /* its load goes on: the slot leaves at its collection */
        }
        return 0;
    }
    ucm_ctx *ctx = c->ctx;
    Py_INCREF(c);
    add_open(c, -1);
    /* The handle's own view: one nobody else holds goes now with its hold; one still held
     * keeps the slot pinned by its own (SlotBuffer). */
    Py_SETREF(h->view, Py_NewRef(Py_None));
    /* Before the drop (as in batch_drop): the token's drop runs with the GIL released, and a
     * thread sharing this owned set could own the freed slot's next load meanwhile. */
    if (h->owner == Py_True) owned_discard(h->owned, h->slot);
    int rc = 1;
    if (h->ctok.armed) {
        /* With test points set, the GIL released (a gate may hold a process-local lock). */
        if (__builtin_expect(core.ctx_points_set(h->ctok.c), 0))
            WITHOUT_GIL(c, core.token_drop(&h->ctok, PyBytes_AS_STRING(msg),
                                           (uint32_t)PyBytes_GET_SIZE(msg)));
        else
            core.token_drop(&h->ctok, PyBytes_AS_STRING(msg), (uint32_t)PyBytes_GET_SIZE(msg));
    } else if (HAS(h->token)) {
        PyObject *len = PyLong_FromSsize_t(PyBytes_GET_SIZE(msg));
        /* cffi releases the GIL around the call: counted, so close() cannot take the context
         * away under it (as WITHOUT_GIL). */
        c->calls_out++;
        PyObject *r = len ? PyObject_CallFunctionObjArgs(token_drop, h->token, msg, len, NULL)
                          : NULL;
        c->calls_out--;
        Py_XDECREF(len);
        if (r) Py_DECREF(r);
        else rc = -1;
    } else {
        unsigned long slot = h->slot && PyLong_CheckExact(h->slot)
                                 ? PyLong_AsUnsignedLong(h->slot) : (unsigned long)-1;
        if (slot == (unsigned long)-1 && PyErr_Occurred()) PyErr_Clear();
        /* Dropping the view may have run code that closed the cache: its close's recovery
         * removed our holds then. */
        if (slot <= UCM_PIN_SLOT_MASK && !CLOSED_MEANWHILE(c, ctx))
            release_pin(c, ctx, (uint32_t)slot);
    }
    Py_DECREF(c);
    return rc;
}

/* An owner under a tier, which may hold a lease for its load (until ready() wrote it through;
 * fail() leaves it): the tier's abandon (Python) must come before the pin drops, since once it
 * drops another get may own the slot's next load and its lease (Handle._close keeps that
 * order). */
static int tier_owner(PyObject *owner, PyObject *cache)
{
    if (owner != Py_True || !cache_of(cache)) return 0;
    PyObject *t = PyObject_GetAttr(cache, s_tier);
    if (!t) {
        PyErr_Clear();
        return 0;
    }
    int has = t != Py_None;
    Py_DECREF(t);
    return has;
}

/* The rest of a close of a handle or batch, once its drop answered r (handle_drop,
 * batch_drop): the bookkeeping an owner or a holder of writable views needs (`after`:
 * _after_drop, Python), then an error the message's formatting kept, if any. */
static PyObject *close_rest(PyObject *self, int r, int after, PyObject *et, PyObject *ev,
                            PyObject *tb)
{
    if (r > 0 && after) {
        PyObject *x = PyObject_CallMethodNoArgs(self, s_after_drop);
        if (x) Py_DECREF(x);
        else r = -1;
    }
    if (et) {
        if (r < 0) PyErr_Clear(); /* the first error wins: the one that cut the exit short */
        PyErr_Restore(et, ev, tb);
        return NULL;
    }
    if (r < 0) return NULL;
    Py_RETURN_NONE;
}

/* close() and __exit__ of any handle: the drop in C, then close_rest.  A plain hit runs no
 * Python code at all. */
static PyObject *handle_close_with(HandleBase *h, PyObject *msg, PyObject *et, PyObject *ev,
                                   PyObject *tb)
{
    /* (an owner published by ready() in C has no owned set or views left: nothing after) */
    int after = (h->owner != Py_False && h->published != Py_True) || HAS(h->views) ||
                HAS(h->owned);
    return close_rest((PyObject *)h, handle_drop(h, msg), after, et, ev, tb);
}

static PyObject *handle_enter(PyObject *self, PyObject *unused) { return Py_NewRef(self); }

static PyObject *handle_exit(HandleBase *h, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3 || tier_owner(h->owner, h->cache))
        return forward((PyObject *)h, s_exit_slow, args, nargs, NULL);
    if (!IS_OPEN(h->closed)) Py_RETURN_NONE;
    PyObject *et = NULL, *ev = NULL, *tb = NULL;
    /* A reader's message matters to nobody (only an owner's reaches waiters). */
    PyObject *msg = args[1] == Py_None || h->owner == Py_False
                        ? Py_NewRef(unpublished)
                        : exit_message_of(args[0], args[1], &et, &ev, &tb);
    PyObject *r = handle_close_with(h, msg, et, ev, tb);
    Py_DECREF(msg);
    return r;
}

static PyObject *handle_close(HandleBase *h, PyObject *unused)
{
    if (!IS_OPEN(h->closed)) Py_RETURN_NONE;
    if (tier_owner(h->owner, h->cache))
        return PyObject_CallMethodOneArg((PyObject *)h, s_close_with, unpublished);
    return handle_close_with(h, unpublished, NULL, NULL, NULL);
}

/* ready(nbytes=None): an owner's handle made by cold_handle publishes in one core step
 * (ucm_token_publish: publish, count, observe), then leaves its owned set and releases its
 * writable views (as Handle._ready_full does).  Everything else, and every error to name,
 * goes to _ready_full: another handle, an argument that is not None or an int in range, a
 * tier beneath the cache (its write-through), an armed test hook, an answer but UCM_OK (it
 * changed nothing: the full path's ucm_publish answers the same and raises). */
static PyObject *handle_ready(HandleBase *h, PyObject *const *args, Py_ssize_t nargs,
                              PyObject *kwnames)
{
    if (kwnames) /* ready(nbytes=...): the full path reads its keywords */
        return forward((PyObject *)h, s_ready_full, args, nargs, kwnames);
    CacheBase *c = cache_of(h->cache);
    Py_ssize_t n = -1;
    if (c && c->ctx && nargs <= 1 && IS_OPEN(h->closed) && h->ctok.armed && h->ctok.owner &&
        h->owner == Py_True && h->published == Py_False && !HAS(c->tier) &&
        !PyDict_GET_SIZE(hooks_armed) && h->t0 && PyLong_CheckExact(h->t0)) {
        if (nargs == 0 || args[0] == Py_None) n = c->value_max;
        else if (PyLong_CheckExact(args[0])) {
            n = PyLong_AsSsize_t(args[0]);
            if (n == -1) PyErr_Clear();
        }
    }
    if (n < 0 || n > c->value_max)
        return forward((PyObject *)h, s_ready_full, args, nargs, NULL);
    int64_t t0 = PyLong_AsLongLong(h->t0);
    int r;
    if (__builtin_expect(core.ctx_points_set(c->ctx), 0))
        WITHOUT_GIL(c, r = core.token_publish(&h->ctok, UCM_READY, (uint32_t)n, t0));
    else
        r = core.token_publish(&h->ctok, UCM_READY, (uint32_t)n, t0);
    if (r != UCM_OK) return forward((PyObject *)h, s_ready_full, args, nargs, NULL);
    SET_FLAG(h->published, 1);
    owned_discard(h->owned, h->slot);
    Py_SETREF(h->owned, Py_NewRef(Py_None));
    Py_SETREF(h->view, Py_NewRef(Py_None));
    PyObject *views = h->views, *result = NULL;
    h->views = Py_NewRef(Py_None);
    if (HAS(views) && PyList_Check(views)) {
        /* The owner's writable views end with the load: released, unless an export (a numpy
         * array) still holds one, whose own pin then keeps the slot (_slots.release_views). */
        for (Py_ssize_t i = 0; i < PyList_GET_SIZE(views); i++) {
            PyObject *view = Py_NewRef(PyList_GET_ITEM(views, i)); /* held across the call */
            PyObject *x = PyObject_CallMethodNoArgs(view, s_release);
            Py_DECREF(view);
            if (x) Py_DECREF(x);
            else if (PyErr_ExceptionMatches(PyExc_BufferError)) PyErr_Clear();
            else goto done;
        }
    }
    result = Py_NewRef(Py_None);
done:
    Py_XDECREF(views);
    return result;
}

/* wait(timeout=None): a reader's wait on a slot another caller loads, one core step with the
 * GIL released (ucm_wait_ready: futex slices, the loader's life lock, the deadline, the wait's
 * time and a timeout counted), so a wake-up returns self with no Python frame.  It counts the
 * wait (`waits`) when it begins, as _wait_ready does; a loader that looks dead is recovered by
 * SlotCache._recover_loader (Python) and the step runs again.  Everything else goes to
 * _wait_full: a closed handle or cache, an owner, keywords, a timeout that is not a plain
 * number >= 0 (to be named), a slot not Loading (Failed: its message), a slot this context
 * loads itself (refused there), another answer of the step. */
static PyObject *handle_wait(HandleBase *h, PyObject *const *args, Py_ssize_t nargs,
                             PyObject *kwnames)
{
    if (kwnames) /* wait(timeout=...): the full path reads its keywords */
        return forward((PyObject *)h, s_wait_full, args, nargs, kwnames);
    CacheBase *c = cache_of(h->cache);
    PyObject *t = nargs ? args[0] : Py_None;
    double secs = -1.0;
    unsigned long slot = (unsigned long)-1;
    if (t == Py_None) t = h->timeout;
    if (!loads_bound || !c || !c->ctx || nargs > 1 || !IS_OPEN(h->closed) ||
        h->owner != Py_False || !h->slot || !PyLong_CheckExact(h->slot))
        goto full;
    if (t && t != Py_None) {
        if (PyFloat_CheckExact(t)) secs = PyFloat_AS_DOUBLE(t);
        else if (PyLong_CheckExact(t)) secs = PyLong_AsDouble(t);
        else goto full;
        if (!(secs >= 0.0) || secs > 1e9) { /* NaN, negative, an overflow: named there */
            PyErr_Clear();
            goto full;
        }
    }
    slot = PyLong_AsUnsignedLong(h->slot);
    if (slot > UCM_PIN_SLOT_MASK) {
        PyErr_Clear();
        goto full;
    }
    ucm_ctx *ctx = c->ctx;
    uint32_t st = core.slot_state(ctx, (uint32_t)slot);
    if (st == UCM_READY) return Py_NewRef(h);
    if (st != UCM_LOADING) goto full;
    /* The owned-slot record's check walks the record's chain (_slots.owns_load: the rule is
     * written there once); a wait of ours then goes on with the GIL released, so the call's
     * cost is paid before a sleep, never after a wake-up. */
    PyObject *mine_o = PyObject_CallFunctionObjArgs(owns_load, (PyObject *)c, h->slot, NULL);
    if (!mine_o) return NULL;
    int mine = PyObject_IsTrue(mine_o);
    Py_DECREF(mine_o);
    if (mine != 0) {
        if (mine < 0) return NULL;
        goto full;
    }
    /* That Python code may have allocated, and a collection run finalizers that closed h or
     * the cache (its ctx freed): nothing of ctx's is touched before this re-check */
    if (CLOSED_MEANWHILE(still_open(h->closed, c), ctx)) goto full;
    core.stat_add(ctx, UCM_ST_WAITS, 1);
    int64_t t0 = core.now_ns();
    int64_t deadline = secs < 0 ? -1 : t0 + (int64_t)(secs * 1e9);
    for (;;) {
        int r;
        if (CLOSED_MEANWHILE(c, ctx)) goto full; /* closed by Python code run below: named there */
        WITHOUT_GIL(c, r = core.wait_ready(ctx, (uint32_t)slot, deadline, liveness_ns,
                                           c->lock_fd, life_byte0, t0, &st));
        if (r == UCM_OK) {
            if (st == UCM_READY) return Py_NewRef(h);
            goto full; /* Failed (or reclaimed): its message */
        }
        if (r == UCM_TIMEOUT) {
            PyObject *secs_o = PyFloat_FromDouble(secs);
            if (secs_o) {
                PyErr_Format(PyExc_TimeoutError, "key still loading after %R s (the load goes "
                             "on; get() again to wait more)", secs_o);
                Py_DECREF(secs_o);
            }
            return NULL;
        }
        if (r == UCM_SLICE) { /* a slice's end or a signal: the handlers run here */
            if (PyErr_CheckSignals() < 0) goto raised;
            continue;
        }
        if (r != UCM_OWNERDEAD) goto full;
        PyObject *x = PyObject_CallMethod((PyObject *)c, "_recover_loader", "kL", slot,
                                          (long long)deadline);
        if (!x) goto raised;
        Py_DECREF(x);
    }
raised:
    /* The wait ends on our own exception, with no final answer of the step: its time counted
     * here, once (c->ctx: a handler may have closed the cache, whose counters went with it). */
    if (!CLOSED_MEANWHILE(c, ctx)) {
        uint64_t waited = (uint64_t)(core.now_ns() - t0);
        core.stat_add(ctx, UCM_ST_WAIT_NS, waited);
        core.observe(ctx, UCM_HIST_WAIT, waited);
    }
    return NULL;
full:
    return forward((PyObject *)h, s_wait_full, args, nargs, NULL);
}

static PyObject *handle_drop_pins(HandleBase *h, PyObject *msg)
{
    if (!PyBytes_Check(msg)) {
        PyErr_SetString(PyExc_TypeError, "_drop_pins(message): message must be bytes");
        return NULL;
    }
    int r = handle_drop(h, msg);
    if (r < 0) return NULL;
    return Py_NewRef(r ? Py_True : Py_False);
}

static PyObject *handle_owner(HandleBase *h, void *closure)
{
    return Py_NewRef(h->owner ? h->owner : Py_False);
}

/* data of an open handle whose view C makes, made once: a slot Ready when pinned (the payload,
 * read-only) or an owner's Loading slot from cold_handle (the whole slot, writable, kept in
 * its views until the load ends, as _data_slow makes it).  NULL with no exception: anything
 * else, or Python code run by an allocation closed h (the full path says so). */
static PyObject *handle_view(HandleBase *h, CacheBase *c)
{
    if (HAS(h->view)) return Py_NewRef(h->view);
    ucm_ctx *ctx = c->ctx;
    PyObject *views = NULL, *v = NULL;
    long long n = h->nbytes && PyLong_CheckExact(h->nbytes) ? PyLong_AsLongLong(h->nbytes) : -1;
    unsigned long slot = h->slot && PyLong_CheckExact(h->slot) ? PyLong_AsUnsignedLong(h->slot)
                                                               : (unsigned long)-1;
    if (PyErr_Occurred() || slot > UCM_PIN_SLOT_MASK) {
        PyErr_Clear(); /* not a slot and a length: the full path says so */
        return NULL;
    }
    int writable = n < 0; /* not Ready when pinned: only an owner's C-made handle is ours */
    if (writable) {
        if (!h->ctok.armed || !h->ctok.owner || h->owner != Py_True || h->published != Py_False)
            return NULL;
        if (!HAS(h->views)) {
            PyObject *l = PyList_New(0);
            if (!l) return NULL;
            Py_XSETREF(h->views, l);
        }
        views = Py_NewRef(h->views);
        n = c->value_max;
    }
    if (CLOSED_MEANWHILE(still_open(h->closed, c), ctx)) goto done;
    if (!(v = slot_view(c, ctx, (uint32_t)slot, (Py_ssize_t)n, writable))) goto done;
    if (CLOSED_MEANWHILE(still_open(h->closed, c), ctx)) { /* not ours to give: the full path */
        Py_CLEAR(v);
        goto done;
    }
    if (writable) {
        if (PyList_Append(views, v) < 0) Py_CLEAR(v);
    } else if (HAS(h->view)) {
        Py_SETREF(v, Py_NewRef(h->view)); /* a finalizer read data meanwhile: made once */
    } else {
        Py_XSETREF(h->view, Py_NewRef(v));
    }
done:
    Py_XDECREF(views);
    return v;
}

static PyObject *handle_data(HandleBase *h, void *closure)
{
    CacheBase *c = handle_usable(h);
    PyObject *v = c ? handle_view(h, c) : NULL;
    if (v || PyErr_Occurred()) return v;
    return PyObject_CallMethodNoArgs((PyObject *)h, s_data_slow);
}

/* Both bases' finalizer: close() (a hit's close in C, else the full close), its errors
 * dropped as a __del__'s would be.  If the full close was cut short before it began (a
 * signal handler raising at the entry of the Python _close), the object goes anyway: only a
 * holder with a token takes that path, and its token drops the pins (and fails an owner's
 * load) from C when the fields are cleared; the open count goes with it here. */
static void finalize_by_close(PyObject *self, PyObject **closed, PyObject *cache)
{
    PyObject *et, *ev, *tb;
    PyErr_Fetch(&et, &ev, &tb);
    PyObject *r = PyObject_CallMethodNoArgs(self, s_close);
    if (r) Py_DECREF(r);
    else if (PyErr_ExceptionMatches(PyExc_Exception)) PyErr_Clear();
    else PyErr_WriteUnraisable(self);
    if (IS_OPEN(*closed)) {
        CacheBase *c = cache_of(cache);
        SET_FLAG(*closed, 1);
        if (c && c->ctx) add_open(c, -1);
    }
    PyErr_Restore(et, ev, tb);
}

static void handle_finalize(PyObject *self)
{
    HandleBase *h = (HandleBase *)self;
    if (IS_OPEN(h->closed)) finalize_by_close(self, &h->closed, h->cache);
}

static int handle_traverse(HandleBase *o, visitproc visit, void *arg)
{
    HANDLE_FIELDS(FIELD_VISIT)
    return 0;
}

/* A handle whose load went on past its close (kept_owned) is collected: its pin drops now
 * (the armed ctok in dealloc, the full path's token with the fields), so its load ends, and
 * its slot leaves the owned set first, as in handle_drop (else a later wait of its context on
 * the slot, Loading then for another key or owner, would be refused as a wait for itself).
 * The pin is still held here, so no later load of the slot can be in the set yet. */
static void kept_owned_discard(HandleBase *h)
{
    if (!h->kept_owned) return;
    h->kept_owned = 0;
    owned_discard(h->owned, h->slot);
}

/* Never the armed ctok: its drop is dealloc's (a cycle's handle is finalized, so closed, by
 * then). */
static int handle_clear(HandleBase *o)
{
    kept_owned_discard(o); /* before the fields go: the token among them drops the pin */
    HANDLE_FIELDS(FIELD_CLEAR)
    return 0;
}

static void handle_dealloc(HandleBase *h)
{
    PyObject_GC_UnTrack(h);
    kept_owned_discard(h);
    /* A close cut short (see finalize_by_close): the C token drops its pin as cffi's would. */
    if (h->ctok.armed) core.token_release(NULL, &h->ctok);
    if (h->weakreflist) PyObject_ClearWeakRefs((PyObject *)h);
    handle_clear(h);
    Py_TYPE(h)->tp_free((PyObject *)h);
}

static PyMethodDef handle_methods[] = {
    {"__enter__", handle_enter, METH_NOARGS, NULL},
    {"wait", (PyCFunction)(void (*)(void))handle_wait, METH_FASTCALL | METH_KEYWORDS,
     "Block while another caller loads the slot.  Returns self when Ready; raises\n"
     "LoadFailed when the owner failed (or died), TimeoutError when timeout passes first\n"
     "(the load goes on)."},
    {"ready", (PyCFunction)(void (*)(void))handle_ready, METH_FASTCALL | METH_KEYWORDS,
     "Publish the slot as Ready with nbytes of payload (default: the whole slot)."},
    {"__exit__", (PyCFunction)(void (*)(void))handle_exit, METH_FASTCALL, NULL},
    {"close", (PyCFunction)handle_close, METH_NOARGS,
     "Unpin the slot (idempotent).  An owner that did not publish publishes Failed."},
    {"_drop_pins", (PyCFunction)handle_drop_pins, METH_O,
     "Close and drop the pin in one C step (failing an owner's unpublished load with the\n"
     "message); True if there is bookkeeping to do (_after_drop)."},
    {NULL},
};

#define FIELDS_OF HandleBase
static PyMemberDef handle_members[] = {
    HANDLE_FIELDS(FIELD_MEMBER)
    {NULL},
};
static const field_row handle_fields[] = {HANDLE_FIELDS(FIELD_ROW)};
#undef FIELDS_OF

static PyGetSetDef handle_getset[] = {
    {"owner", (getter)handle_owner, NULL,
     "True if this caller must fill the slot and publish ready() or fail().", NULL},
    {"data", (getter)handle_data, NULL,
     "The slot's bytes.  The owner, while loading: the whole slot, writable.  Ready: the\n"
     "published payload, read-only.  The view, and everything made from it (slices, casts,\n"
     "numpy arrays, tensors), keeps the slot pinned while it lives.", NULL},
    {NULL},
};

static PyTypeObject HandleBase_Type = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "ucmcache._hit.HandleBase",
    .tp_basicsize = sizeof(HandleBase),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "Handle's fields and its hit path (enter, data, exit) in C.",
    .tp_new = handle_new,
    .tp_dealloc = (destructor)handle_dealloc,
    .tp_traverse = (traverseproc)handle_traverse,
    .tp_clear = (inquiry)handle_clear,
    .tp_finalize = handle_finalize,
    .tp_weaklistoffset = offsetof(HandleBase, weakreflist),
    .tp_methods = handle_methods,
    .tp_members = handle_members,
    .tp_getset = handle_getset,
};

/* ---------------------------------------------------------------- BatchBase */

#define BATCH_FIELDS(F) \
    F(cache, NONE, MEMBER, "Its SlotCache (cache_of).") \
    F(slots, UNSET, GETSET, "numpy uint32: each position's slot (UCM_NIL: no pin).") \
    F(lens, UNSET, GETSET, "numpy int64: a position's length if Ready when pinned, else -1.") \
    F(owner, NONE, MEMBER, "numpy bool: the positions this caller owns (`owner`: a copy).") \
    F(serials, NONE, MEMBER, "numpy uint32: an owned position's load serial (or None).") \
    F(slots_p, NONE, MEMBER, "The full path's cffi pointer to _slots (its token's drop takes " \
      "it).") \
    F(owner_p, NONE, MEMBER, "The full path's cffi pointer to _owner, likewise.") \
    F(token, NONE, MEMBER, "The full path's batch token (None: an all-hit batch).") \
    F(timeout, NONE, MEMBER, "The get_many's timeout: its waits' default.") \
    F(views, NONE, MEMBER, "None, or a list of n: position i's read-only view, made once.") \
    F(region, NONE, C, "None, or the view of the data region the positions' views narrow " \
      "(batch_region_view).") \
    F(owner_views, NONE, MEMBER, "Position -> the owner's writable views (released when its " \
      "load ends).") \
    F(owned, NONE, MEMBER, "The owned-slot set of the context that owns positions.") \
    F(closed, TRUE, MEMBER, "True: the pins are dropped (or not taken yet: an inert batch).") \
    F(any_owner, FALSE, MEMBER, "False: an all-hit batch, no owner bookkeeping.")

typedef struct {
    PyObject_HEAD
    BATCH_FIELDS(FIELD_DECL)
    PyObject *weakreflist;
    uint32_t *slot_at;    /* slots' and lens' items (kept by their setters), and how many each */
    int64_t *len_at;      /* holds: the arrays stay referenced, so their memory does not move */
    Py_ssize_t n_slot_at, n_len_at;
    Py_ssize_t n;         /* _n: the positions (a getset: never more than the arrays hold) */
    int kept_owned;       /* as HandleBase's: closed while a close had the context away, its
                           * owned positions' slots stay in the owned set until collected */
} BatchBase;

/* A new batch's fields: inert (closed), no cache, no owner (no allocation). */
static void batch_init(BatchBase *o) { BATCH_FIELDS(FIELD_INIT) }

static PyTypeObject BatchBase_Type;

/* The items of a numpy array (or any C-contiguous buffer) of `itemsize`-byte items; the array
 * stays referenced by the batch, so its memory does not move. */
static int items_of(PyObject *v, Py_ssize_t itemsize, int writable, void **at, Py_ssize_t *n)
{
    Py_buffer b;
    if (PyObject_GetBuffer(v, &b, PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0)) < 0)
        return -1;
    int r = b.itemsize == itemsize ? 0 : -1;
    if (r == 0) {
        *at = b.buf;
        *n = b.len / itemsize;
    } else {
        PyErr_Format(PyExc_TypeError, "expected an array of %zd-byte items", itemsize);
    }
    PyBuffer_Release(&b);
    return r;
}

static int batch_set_slots(BatchBase *b, PyObject *v, void *closure)
{
    void *at = NULL;
    Py_ssize_t n = 0;
    if (v && v != Py_None && items_of(v, 4, 0, &at, &n) < 0) return -1;
    Py_XSETREF(b->slots, v && v != Py_None ? Py_NewRef(v) : NULL);
    b->slot_at = at;
    b->n_slot_at = n;
    return 0;
}

static int batch_set_lens(BatchBase *b, PyObject *v, void *closure)
{
    void *at = NULL;
    Py_ssize_t n = 0;
    if (v && v != Py_None && items_of(v, 8, 1, &at, &n) < 0) return -1;
    Py_XSETREF(b->lens, v && v != Py_None ? Py_NewRef(v) : NULL);
    b->len_at = at;
    b->n_len_at = n;
    return 0;
}

static PyObject *batch_get_slots(BatchBase *b, void *c) { return Py_NewRef(b->slots ? b->slots : Py_None); }
static PyObject *batch_get_lens(BatchBase *b, void *c) { return Py_NewRef(b->lens ? b->lens : Py_None); }

/* The batch's cache when its positions are all readable from C (open, its arrays cover n
 * positions, its cache attached), else NULL. */
static inline CacheBase *batch_usable(BatchBase *b)
{
    CacheBase *c = cache_of(b->cache);
    return IS_OPEN(b->closed) && c && c->ctx && b->slot_at && b->len_at &&
           b->n_slot_at >= b->n && b->n_len_at >= b->n ? c : NULL;
}

static PyObject *call_n(PyObject *f, Py_ssize_t n)
{
    PyObject *pn = PyLong_FromSsize_t(n);
    if (!pn) return NULL;
    PyObject *r = PyObject_CallOneArg(f, pn);
    Py_DECREF(pn);
    return r;
}

/* An all-hit batch: every key a plain id, every one pinned Ready by one core step.  NULL with
 * no exception: the full path takes the call (nothing pinned, nothing counted). */
static PyObject *batch_hit(CacheBase *c, PyObject *keys)
{
    Py_ssize_t n = PyList_GET_SIZE(keys);
    if (n == 0 || n > (Py_ssize_t)UCM_PIN_SLOT_MASK || !all_plain(keys)) return NULL;
    ucm_ctx *ctx = c->ctx;
    BatchBase *b = NULL;
    PyObject *slots = NULL, *lens = NULL, *owner = NULL, *result = NULL;
    char small[16 * 64], *ids = small;
    int rc;
    /* Everything is allocated before the pins (see the top of this file), and before the ids
     * are read (see copy_ids). */
    if (!(b = (BatchBase *)batch_type->tp_alloc(batch_type, 0))) goto done;
    batch_init(b);
    if (!(slots = call_n(new_slots, n)) || !(lens = call_n(new_lengths, n)) ||
        !(owner = call_n(new_owner, n)) ||
        batch_set_slots(b, slots, NULL) < 0 || batch_set_lens(b, lens, NULL) < 0 ||
        b->n_slot_at < n || b->n_len_at < n)
        goto done;
    if (n > 64 && !(ids = PyMem_Malloc(16 * (size_t)n))) {
        PyErr_NoMemory();
        goto done;
    }
    if (CLOSED_MEANWHILE(c, ctx) || !copy_ids(keys, n, ids)) goto done;
    if (__builtin_expect(core.ctx_points_set(ctx), 0)) {
        uint32_t *slot_at = b->slot_at;
        int64_t *lens_at = b->len_at;
        WITHOUT_GIL(c, rc = core.pin_all_ready(ctx, ids, NULL, (uint32_t)n, C_SPIN, slot_at,
                                               lens_at));
    } else {
        rc = core.pin_all_ready(ctx, ids, NULL, (uint32_t)n, C_SPIN, b->slot_at, b->len_at);
    }
    if (rc != UCM_OK) goto done; /* nothing pinned: the full path */
    /* The pins become the batch's in plain stores (the fields replaced are None). */
    Py_SETREF(b->owner, Py_NewRef(owner));
    Py_SETREF(b->owned, Py_NewRef(no_owned));
    Py_SETREF(b->cache, Py_NewRef(c));
    b->n = n;
    SET_FLAG(b->closed, 0);
    add_open(c, 1);
    result = Py_NewRef((PyObject *)b);
done:
    if (ids != small) PyMem_Free(ids);
    Py_XDECREF(slots);
    Py_XDECREF(lens);
    Py_XDECREF(owner);
    Py_XDECREF(b);
    return result;
}

static PyObject *cache_get_many(CacheBase *self, PyObject *const *args, Py_ssize_t nargs,
                                PyObject *kwnames)
{
    if (bound && batch_type && self->ctx && nargs == 1 && PyList_CheckExact(args[0]) &&
        no_timeout(args, 1, kwnames)) {
        PyObject *b = batch_hit(self, args[0]);
        if (b || PyErr_Occurred()) return b;
    }
    return forward((PyObject *)self, s_get_many_full, args, nargs, kwnames);
}

/* The one drop of a batch's pins, as handle_drop: closed and uncounted first, its views let
 * go (each keeps its own hold while held elsewhere), then every pin by one core step: the
 * token's (which fails the owned positions still Loading) or, for an all-hit batch, one
 * release of them all.  1, 0, -1 as handle_drop. */
/* The owned positions' slots leave the owned set with the drop (as owned_discard). */
static void batch_owned_discard(BatchBase *b)
{
    Py_buffer own;
    if (!HAS(b->owned) || !PySet_Check(b->owned) || !b->slot_at || !HAS(b->owner)) return;
    if (PyObject_GetBuffer(b->owner, &own, PyBUF_C_CONTIGUOUS) < 0) {
        PyErr_Clear();
        return;
    }
    const char *is_owner = own.buf;
    /* (a bool array, new_owner's: one byte per position; anything else is no owner array) */
    Py_ssize_t n = own.itemsize == 1 ? own.len : 0;
    for (Py_ssize_t i = 0; i < b->n && i < n && i < b->n_slot_at; i++) {
        if (!is_owner[i]) continue;
        PyObject *slot = PyLong_FromUnsignedLong(b->slot_at[i]);
        if (slot) owned_discard(b->owned, slot);
        else PyErr_Clear();
        Py_XDECREF(slot);
    }
    PyBuffer_Release(&own);
}

static int batch_drop(BatchBase *b, PyObject *msg)
{
    CacheBase *c = cache_of(b->cache);
    if (!IS_OPEN(b->closed)) return 0;
    SET_FLAG(b->closed, 1);
    if (!c || !c->ctx) {
        /* A closed or forked cache's batch: not our pins; its owned loads end with it when the
         * cache is gone for good (as in handle_drop). */
        if (b->any_owner == Py_True) {
            if (unusable_for_good(b->cache)) batch_owned_discard(b);
            else b->kept_owned = 1; /* its loads go on: their slots leave at its collection */
        }
        return 0;
    }
    ucm_ctx *ctx = c->ctx;
    Py_INCREF(c);
    add_open(c, -1);
    Py_SETREF(b->views, Py_NewRef(Py_None));
    Py_SETREF(b->region, Py_NewRef(Py_None));
    /* Before the token's drop, which clears the owner flags of the loads it fails. */
    if (b->any_owner == Py_True) batch_owned_discard(b);
    int rc = 1;
    if (HAS(b->token)) {
        PyObject *len = PyLong_FromSsize_t(PyBytes_GET_SIZE(msg));
        c->calls_out++; /* as in handle_drop */
        PyObject *r = len ? PyObject_CallFunctionObjArgs(batch_token_drop, b->slots_p, b->owner_p,
                                                         b->token, msg, len, NULL) : NULL;
        c->calls_out--;
        Py_XDECREF(len);
        if (r) Py_DECREF(r);
        else rc = -1;
    } else if (!CLOSED_MEANWHILE(c, ctx) && b->slot_at && b->n_slot_at >= b->n) {
        /* (closed meanwhile: dropping the views ran code that closed the cache, whose
         * recovery removed our holds) */
        release_pins(c, ctx, b->slot_at, (uint32_t)b->n);
    }
    Py_DECREF(c);
    return rc;
}

/* close() and __exit__ of any batch, as handle_close_with. */
static PyObject *batch_close_with(BatchBase *b, PyObject *msg, PyObject *et, PyObject *ev,
                                  PyObject *tb)
{
    int after = b->any_owner != Py_False || HAS(b->owner_views);
    return close_rest((PyObject *)b, batch_drop(b, msg), after, et, ev, tb);
}

static PyObject *batch_enter(PyObject *self, PyObject *unused) { return Py_NewRef(self); }

static PyObject *batch_exit(BatchBase *b, PyObject *const *args, Py_ssize_t nargs)
{
    /* With a tier, owned positions' leases go before the pins (see tier_owner). */
    if (nargs != 3 || tier_owner(b->any_owner, b->cache))
        return forward((PyObject *)b, s_exit_slow, args, nargs, NULL);
    if (!IS_OPEN(b->closed)) Py_RETURN_NONE;
    PyObject *et = NULL, *ev = NULL, *tb = NULL;
    PyObject *msg = args[1] == Py_None || b->any_owner == Py_False
                        ? Py_NewRef(unpublished)
                        : exit_message_of(args[0], args[1], &et, &ev, &tb);
    PyObject *r = batch_close_with(b, msg, et, ev, tb);
    Py_DECREF(msg);
    return r;
}

static PyObject *batch_close(BatchBase *b, PyObject *unused)
{
    if (!IS_OPEN(b->closed)) Py_RETURN_NONE;
    if (tier_owner(b->any_owner, b->cache))
        return PyObject_CallMethodOneArg((PyObject *)b, s_close_with, unpublished);
    return batch_close_with(b, unpublished, NULL, NULL, NULL);
}

static PyObject *batch_drop_pins(BatchBase *b, PyObject *msg)
{
    if (!PyBytes_Check(msg)) {
        PyErr_SetString(PyExc_TypeError, "_drop_pins(message): message must be bytes");
        return NULL;
    }
    int r = batch_drop(b, msg);
    if (r < 0) return NULL;
    return Py_NewRef(r ? Py_True : Py_False);
}

/* Position i's read-only view (Ready when pinned: the payload, pinned by itself), one per
 * position, made once.  NULL with no exception: Python code run by an allocation closed b or
 * its cache (the full path says so). */
static PyObject *batch_view(BatchBase *b, CacheBase *c, Py_ssize_t i)
{
    ucm_ctx *ctx = c->ctx;
    PyObject *views = NULL, *region = NULL, *v = NULL;
    if (HAS(b->views) && PyList_CheckExact(b->views) && PyList_GET_SIZE(b->views) == b->n) {
        PyObject *had = PyList_GET_ITEM(b->views, i);
        if (had != Py_None) return Py_NewRef(had);
    } else {
        PyObject *fresh = PyList_New(b->n);
        if (!fresh) return NULL;
        for (Py_ssize_t k = 0; k < b->n; k++) PyList_SET_ITEM(fresh, k, Py_NewRef(Py_None));
        Py_XSETREF(b->views, fresh);
    }
    views = Py_NewRef(b->views);
    if (CLOSED_MEANWHILE(still_open(b->closed, c), ctx)) goto done;
    if (!HAS(b->region)) {
        PyObject *made = batch_region_view(c, ctx, b->slot_at, (uint32_t)b->n);
        if (!made) goto done; /* an exception, or none: no longer pinned (the full path) */
        Py_XSETREF(b->region, made);
        if (CLOSED_MEANWHILE(still_open(b->closed, c), ctx)) goto done;
    }
    region = Py_NewRef(b->region);
    v = narrow_view(region, (Py_ssize_t)b->slot_at[i] * c->stride, (Py_ssize_t)b->len_at[i]);
    if (v && (CLOSED_MEANWHILE(still_open(b->closed, c), ctx) || b->views != views))
        Py_CLEAR(v); /* making it ran a finalizer that closed b: not ours to give */
    if (v) PyList_SetItem(b->views, i, Py_NewRef(v)); /* (steals; drops the None) */
done:
    Py_XDECREF(views);
    Py_XDECREF(region);
    return v;
}

static PyObject *batch_data(BatchBase *b, PyObject *pos)
{
    CacheBase *c = batch_usable(b);
    Py_ssize_t i = c && PyLong_CheckExact(pos) ? PyLong_AsSsize_t(pos) : -1;
    if (i == -1) PyErr_Clear(); /* -1, or an index too large: the full path says so */
    if (i >= 0 && i < b->n && b->len_at[i] >= 0) {
        PyObject *v = batch_view(b, c, i);
        if (v || PyErr_Occurred()) return v;
    }
    return PyObject_CallMethodOneArg((PyObject *)b, s_data_slow, pos);
}

/* gather's copies, as SlotCache.read_many's: the rows of out (made by out_rows), one core call
 * with the GIL released. */
static PyObject *batch_gather(BatchBase *b, PyObject *out)
{
    CacheBase *c = batch_usable(b);
    if (!c || b->n == 0) return PyObject_CallMethodOneArg((PyObject *)b, s_gather_full, out);
    ucm_ctx *ctx = c->ctx;
    Py_buffer ob, lb = {0};
    Py_ssize_t row = out_rows(out, b->n, &ob);
    if (row == -1) return NULL; /* rows that cannot take the payloads: said */
    if (row < 0) /* a tensor, or not writable/contiguous: the full path says so */
        return PyObject_CallMethodOneArg((PyObject *)b, s_gather_full, out);
    uint32_t small[64], *slots = small, n = (uint32_t)b->n;
    PyObject *lens = NULL, *result = NULL;
    int full = 0;
    if (!(lens = call_n(new_lengths, b->n)) ||
        PyObject_GetBuffer(lens, &lb, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0)
        goto done;
    if (n > 64 && !(slots = PyMem_Malloc(sizeof(uint32_t) * n))) {
        PyErr_NoMemory();
        goto done;
    }
    /* The copy's own slots and holds on them (the process-local count), taken with the GIL
     * held: a close of the batch by another thread while the GIL is released drops only the
     * batch's pins (and sets its positions to NIL as it goes), so every row copied is its
     * key's bytes and this call releases exactly what it took.  None taken: making lens ran
     * a finalizer that closed b (or its cache): the full path says so. */
    if (CLOSED_MEANWHILE(batch_usable(b), ctx) || b->n != n) {
        full = 1;
        goto done;
    }
    memcpy(slots, b->slot_at, sizeof(uint32_t) * n);
    if (core.pin_again_many(ctx, slots, n) != UCM_OK) {
        full = 1;
        goto done;
    }
    int64_t *lp = lb.buf;
    WITHOUT_GIL(c, core.gather(ctx, slots, n, ob.buf, (uint64_t)row, lp));
    /* c->ctx is still ctx (close() does not take it while calls_out > 0), and the holds are
     * dropped before any Python code runs (after which it might not be). */
    release_pins(c, ctx, slots, n);
    result = checked_lengths(c, UCM_OK, lens, lp, n, row);
done:
    if (slots != small) PyMem_Free(slots);
    PyBuffer_Release(&lb); /* (a no-op if none was taken) */
    PyBuffer_Release(&ob);
    Py_XDECREF(lens);
    if (full) return PyObject_CallMethodOneArg((PyObject *)b, s_gather_full, out);
    return result;
}

static void batch_finalize(PyObject *self)
{
    BatchBase *b = (BatchBase *)self;
    if (IS_OPEN(b->closed)) finalize_by_close(self, &b->closed, b->cache);
}

static int batch_traverse(BatchBase *o, visitproc visit, void *arg)
{
    BATCH_FIELDS(FIELD_VISIT)
    return 0;
}

static int batch_clear(BatchBase *o)
{
    if (o->kept_owned) { /* as kept_owned_discard: the token among the fields drops the pins */
        o->kept_owned = 0;
        batch_owned_discard(o);
    }
    o->slot_at = NULL; /* first: C's views of the arrays go with them */
    o->len_at = NULL;
    o->n_slot_at = o->n_len_at = 0;
    BATCH_FIELDS(FIELD_CLEAR)
    return 0;
}

static void batch_dealloc(BatchBase *b)
{
    PyObject_GC_UnTrack(b);
    if (b->weakreflist) PyObject_ClearWeakRefs((PyObject *)b);
    batch_clear(b);
    Py_TYPE(b)->tp_free((PyObject *)b);
}

static PyObject *batch_new(PyTypeObject *type, PyObject *args, PyObject *kw)
{
    BatchBase *b = (BatchBase *)type->tp_alloc(type, 0);
    if (b) batch_init(b); /* inert: SlotCache._get_many_full stores the fields */
    return (PyObject *)b;
}

static PyMethodDef batch_methods[] = {
    {"__enter__", batch_enter, METH_NOARGS, NULL},
    {"__exit__", (PyCFunction)(void (*)(void))batch_exit, METH_FASTCALL, NULL},
    {"close", (PyCFunction)batch_close, METH_NOARGS,
     "Unpin every position (idempotent); owned positions not published publish Failed."},
    {"_drop_pins", (PyCFunction)batch_drop_pins, METH_O,
     "Close and drop every pin in one C step (failing owned positions still Loading with the\n"
     "message); True if there is bookkeeping to do (_after_drop)."},
    {"data", (PyCFunction)batch_data, METH_O,
     "data($self, i, /)\n--\n\n"
     "Position i's bytes, as Handle.data: the owner's writable slot while it loads, else\n"
     "the Ready payload, read-only (made once per position, with no core call for a position\n"
     "that was Ready when pinned).  The view, and everything made from it, keeps the slot\n"
     "pinned while it lives."},
    {"gather", (PyCFunction)batch_gather, METH_O,
     "gather($self, out, /)\n--\n\n"
     "Copy every Ready position's payload into row i of ``out`` in one C call (the GIL is\n"
     "released during the copies) and return the lengths (int64; -1 for a position that is\n"
     "not Ready, its row untouched).  ``out``: a writable C-contiguous buffer of plain\n"
     "numbers or bytes (numpy, bytearray, memoryview, a CPU torch tensor); 2-D or more: rows\n"
     "by its first dimension (at least n; key i into out[i]); 1-D: n equal rows.  A payload\n"
     "longer than a row raises ValueError and nothing is copied."},
    {NULL},
};

#define FIELDS_OF BatchBase
static PyMemberDef batch_members[] = {
    BATCH_FIELDS(FIELD_MEMBER)
    {NULL},
};
static const field_row batch_fields[] = {BATCH_FIELDS(FIELD_ROW)};
#undef FIELDS_OF

static PyObject *batch_get_n(BatchBase *b, void *c) { return PyLong_FromSsize_t(b->n); }

static int batch_set_n(BatchBase *b, PyObject *v, void *closure)
{
    /* The positions the C paths walk: never more than _slots and _lens hold. */
    Py_ssize_t n = v ? PyLong_AsSsize_t(v) : -1;
    if (n == -1 && PyErr_Occurred()) return -1;
    if (n < 0 || n > b->n_slot_at || n > b->n_len_at) {
        PyErr_Format(PyExc_ValueError, "_n must be in [0, %zd] (set _slots and _lens first)",
                     b->n_slot_at < b->n_len_at ? b->n_slot_at : b->n_len_at);
        return -1;
    }
    b->n = n;
    return 0;
}

/* A copy: close() trusts the batch's own array, so no caller may change it. */
static PyObject *batch_get_owner(BatchBase *b, void *closure)
{
    if (!HAS(b->owner)) Py_RETURN_NONE;
    return PyObject_CallMethodNoArgs(b->owner, s_copy);
}

static PyGetSetDef batch_getset[] = {
    {"owner", (getter)batch_get_owner, NULL,
     "Which positions this caller must fill and publish (a copy: a numpy bool array).", NULL},
    {"_n", (getter)batch_get_n, (setter)batch_set_n, NULL, NULL},
    {"_slots", (getter)batch_get_slots, (setter)batch_set_slots, NULL, NULL},
    {"_lens", (getter)batch_get_lens, (setter)batch_set_lens, NULL, NULL},
    {NULL},
};

static PyTypeObject BatchBase_Type = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "ucmcache._hit.BatchBase",
    .tp_basicsize = sizeof(BatchBase),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "HandleBatch's fields and its hit path (data, gather, exit) in C.",
    .tp_new = batch_new,
    .tp_dealloc = (destructor)batch_dealloc,
    .tp_traverse = (traverseproc)batch_traverse,
    .tp_clear = (inquiry)batch_clear,
    .tp_finalize = batch_finalize,
    .tp_weaklistoffset = offsetof(BatchBase, weakreflist),
    .tp_methods = batch_methods,
    .tp_members = batch_members,
    .tp_getset = batch_getset,
};

/* ---------------------------------------------------------------- module */

static int bind_step(PyObject *steps, const char *name, void **slot)
{
    PyObject *a = PyDict_GetItemString(steps, name);
    if (!a) {
        PyErr_Format(PyExc_KeyError, "bind(): no address for the core step %s", name);
        return -1;
    }
    *slot = PyLong_AsVoidPtr(a);
    if (!*slot && !PyErr_Occurred())
        PyErr_Format(PyExc_ValueError, "bind(): the core step %s is at address 0", name);
    return *slot ? 0 : -1;
}

static PyObject *mod_bind(PyObject *m, PyObject *args, PyObject *kw)
{
    static char *names[] = {"steps", "addr_of", "handle_type", "batch_type",
                            "new_lengths", "new_slots", "new_owner", "no_owned", "unpublished",
                            "token_drop", "batch_token_drop", NULL};
    PyObject *steps, *a, *ht, *bt, *nl, *ns, *no, *nw, *up, *td, *btd;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "O!OO!O!OOOOOOO", names, &PyDict_Type, &steps,
                                     &a, &PyType_Type, &ht, &PyType_Type, &bt, &nl, &ns, &no,
                                     &nw, &up, &td, &btd))
        return NULL;
    if (!PyType_IsSubtype((PyTypeObject *)ht, &HandleBase_Type) ||
        !PyType_IsSubtype((PyTypeObject *)bt, &BatchBase_Type)) {
        PyErr_SetString(PyExc_TypeError, "handle_type and batch_type must subclass HandleBase "
                        "and BatchBase");
        return NULL;
    }
#define STEP(f) if (bind_step(steps, "ucm_" #f, (void **)&core.f) < 0) return NULL
    STEP(lookup_pin); STEP(release); STEP(slot_data); STEP(copy_payload); STEP(ctx_points_set);
    STEP(read_many); STEP(read_count); STEP(claimant_dead); STEP(gather); STEP(pin_all_ready);
    STEP(release_many); STEP(pin_again);
    STEP(pin_again_many); STEP(hold_pins);
#undef STEP
    Py_XSETREF(addr_of, Py_NewRef(a));
    Py_XSETREF(handle_type, (PyTypeObject *)Py_NewRef(ht));
    Py_XSETREF(new_lengths, Py_NewRef(nl));
    Py_XSETREF(batch_type, (PyTypeObject *)Py_NewRef(bt));
    Py_XSETREF(new_slots, Py_NewRef(ns));
    Py_XSETREF(new_owner, Py_NewRef(no));
    Py_XSETREF(no_owned, Py_NewRef(nw));
    Py_XSETREF(unpublished, Py_NewRef(up));
    Py_XSETREF(token_drop, Py_NewRef(td));
    Py_XSETREF(batch_token_drop, Py_NewRef(btd));
    bound = 1;
    Py_RETURN_NONE;
}

static PyObject *mod_bind_loads(PyObject *m, PyObject *args, PyObject *kw)
{
    static char *names[] = {"steps", "owning", "owned_slots", "owns_load", "as_value_view",
                            "hooks_armed", "hooks_fire", "slow_spin", "max_rollbacks",
                            "stripe_wait", "liveness_ns", "life_byte0", NULL};
    PyObject *steps, *ow, *own_set_fn, *owns_fn, *avv, *ha, *hf;
    unsigned int spin, rollbacks;
    double wait;
    long long live;
    unsigned long long byte0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "O!OOOOO!OIIdLK", names, &PyDict_Type, &steps,
                                     &ow, &own_set_fn, &owns_fn, &avv, &PyDict_Type, &ha, &hf,
                                     &spin, &rollbacks, &wait, &live, &byte0))
        return NULL;
    if (live <= 0) {
        PyErr_SetString(PyExc_ValueError, "bind_loads(): liveness_ns must be > 0");
        return NULL;
    }
    if (!PyContextVar_CheckExact(ow) || !PyCallable_Check(own_set_fn) ||
        !PyCallable_Check(owns_fn) || !PyCallable_Check(avv) || !PyCallable_Check(hf)) {
        PyErr_SetString(PyExc_TypeError, "bind_loads(): owning must be a ContextVar, "
                        "owned_slots, owns_load, as_value_view and hooks_fire callables");
        return NULL;
    }
#define STEP(f) if (bind_step(steps, "ucm_" #f, (void **)&core.f) < 0) return NULL
    STEP(get_slow); STEP(load_finish); STEP(token_drop); STEP(now_ns); STEP(token_publish);
    STEP(token_release); STEP(wait_ready); STEP(slot_state); STEP(stat_add);
    STEP(observe); STEP(load_serial);
#undef STEP
    Py_XSETREF(owning, Py_NewRef(ow));
    Py_XSETREF(owned_slots, Py_NewRef(own_set_fn));
    Py_XSETREF(owns_load, Py_NewRef(owns_fn));
    Py_XSETREF(as_value_view, Py_NewRef(avv));
    Py_XSETREF(hooks_armed, Py_NewRef(ha));
    Py_XSETREF(hooks_fire, Py_NewRef(hf));
    slow_spin = spin;
    max_rollbacks = rollbacks;
    stripe_wait_ns = (int64_t)(wait * 1e9);
    liveness_ns = live;
    life_byte0 = byte0;
    loads_bound = bound;
    Py_RETURN_NONE;
}

static PyObject *mod_row_size(PyObject *m, PyObject *const *args, Py_ssize_t nargs)
{
    Py_ssize_t v[4];
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "row_size(nbytes, ndim, rows, n)");
        return NULL;
    }
    for (int i = 0; i < 4; i++)
        if ((v[i] = PyLong_AsSsize_t(args[i])) == -1 && PyErr_Occurred()) return NULL;
    Py_ssize_t row = row_size(v[0], (int)v[1], v[2], v[3]);
    return row < 0 ? NULL : PyLong_FromSsize_t(row);
}

static PyObject *mod_buffer_row(PyObject *m, PyObject *const *args, Py_ssize_t nargs)
{
    Py_ssize_t n;
    if (nargs != 2 || ((n = PyLong_AsSsize_t(args[1])) == -1 && PyErr_Occurred())) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "buffer_row(out, n)");
        return NULL;
    }
    Py_buffer ob;
    Py_ssize_t row = out_rows(args[0], n, &ob);
    if (row == -2) {
        PyErr_SetString(PyExc_TypeError, "out must be a writable C-contiguous buffer");
        return NULL;
    }
    if (row < 0) return NULL;
    PyBuffer_Release(&ob);
    return PyLong_FromSsize_t(row);
}

/* plain_format(format): whether a buffer's item format (memoryview.format) is one of plain
 * numbers or bytes, by the rule out buffers are held to (plain_format): a value stored in a
 * slot is held to it too (ucmcache/_slots.as_value_view), so no PyObject* address reaches
 * shared memory. */
static PyObject *mod_plain_format(PyObject *m, PyObject *arg)
{
    if (!PyUnicode_Check(arg)) {
        PyErr_Format(PyExc_TypeError, "plain_format(format): format must be a str, got %s",
                     Py_TYPE(arg)->tp_name);
        return NULL;
    }
    const char *f = PyUnicode_AsUTF8(arg);
    if (!f) return NULL;
    return PyBool_FromLong(plain_format(f));
}

static PyMethodDef mod_methods[] = {
    {"plain_format", (PyCFunction)mod_plain_format, METH_O,
     "plain_format(format): whether items of this buffer format (memoryview.format) are plain\n"
     "numbers or bytes, the rule out buffers and stored values are held to."},
    {"row_size", (PyCFunction)(void (*)(void))mod_row_size, METH_FASTCALL,
     "row_size(nbytes, ndim, rows, n): the row size of a destination of nbytes for n keys\n"
     "(rows: its first dimension), or ValueError (the rule of gather and read_many)."},
    {"buffer_row", (PyCFunction)(void (*)(void))mod_buffer_row, METH_FASTCALL,
     "buffer_row(out, n): row_size of a buffer-protocol out, its item format checked."},
    {"bind_loads", (PyCFunction)(void (*)(void))mod_bind_loads, METH_VARARGS | METH_KEYWORDS,
     "bind_loads(steps, owning, owned_slots, owns_load, as_value_view, hooks_armed, hooks_fire,\n"
     "slow_spin, max_rollbacks, stripe_wait, liveness_ns, life_byte0): what the cold\n"
     "get_or_load needs (after bind(); called once by ucmcache/_cache.py, where the slow\n"
     "path's budgets are)."},
    {"bind", (PyCFunction)(void (*)(void))mod_bind, METH_VARARGS | METH_KEYWORDS,
     "bind(steps, addr_of, handle_type, batch_type, new_lengths, new_slots, new_owner,\n"
     "no_owned, unpublished, token_drop, batch_token_drop): the core's step addresses and the\n"
     "Python pieces the hit path needs\n"
     "(ucmcache/_handle.py calls it once, when Handle and HandleBatch exist)."},
    {NULL},
};

/* _hit.FIELDS: {type name: ((Python name, access), ...)}, the field tables as data (what
 * tests/test_layout.py checks ucmcache/_hit.pyi against). */
static int add_fields(PyObject *fields, const char *type, const field_row *rows, size_t n)
{
    PyObject *t = PyTuple_New((Py_ssize_t)n);
    for (size_t i = 0; t && i < n; i++) {
        PyObject *row = Py_BuildValue("(ss)", rows[i].name, rows[i].access);
        if (!row) Py_CLEAR(t);
        else PyTuple_SET_ITEM(t, (Py_ssize_t)i, row);
    }
    int r = t ? PyDict_SetItemString(fields, type, t) : -1;
    Py_XDECREF(t);
    return r;
}

static struct PyModuleDef hit_module = {
    PyModuleDef_HEAD_INIT, "ucmcache._hit",
    "The hit path as CPython types (see csrc/ucm_hit.c).", -1, mod_methods,
};

PyMODINIT_FUNC PyInit__hit(void)
{
    if (PyType_Ready(&CacheBase_Type) < 0 || PyType_Ready(&HandleBase_Type) < 0 ||
        PyType_Ready(&BatchBase_Type) < 0 || PyType_Ready(&Ready_Type) < 0 ||
        PyType_Ready(&SlotBuffer_Type) < 0)
        return NULL;
#define INTERN(v, s) if (!(v = PyUnicode_InternFromString(s))) return NULL
    INTERN(s_get_full, "_get_full"); INTERN(s_hit_bytes_full, "_hit_bytes_full");
    INTERN(s_get_or_load_full, "_get_or_load_full"); INTERN(s_read_many_full, "_read_many_full");
    INTERN(s_data_slow, "_data_slow");
    INTERN(s_exit_slow, "_exit_slow"); INTERN(s_close, "close"); INTERN(s_release, "release");
    INTERN(s_timeout, "timeout"); INTERN(s_get_many_full, "_get_many_full");
    INTERN(s_gather_full, "_gather_full"); INTERN(s_close_with, "_close");
    INTERN(s_get_or_load_missed, "_get_or_load_missed");
    INTERN(s_aget_or_load_full, "_aget_or_load_full");
    INTERN(s_aget_or_load_missed, "_aget_or_load_missed");
    INTERN(s_get_missed, "_get_missed"); INTERN(s_after_drop, "_after_drop");
    INTERN(s_tier, "_tier"); INTERN(s_copy, "copy");
    INTERN(s_get_or_load_cold, "_get_or_load_cold");
    INTERN(s_get_or_load_joined, "_get_or_load_joined");
    INTERN(s_check_usable, "_check_usable"); INTERN(s_inside_loader, "inside_loader");
    INTERN(s_why_unusable, "_why_unusable");
    INTERN(s_before_ready, "before_ready"); INTERN(s_after_ready, "after_ready");
    INTERN(s_ready_full, "_ready_full"); INTERN(s_wait_full, "_wait_full");
#undef INTERN
    PyObject *m = PyModule_Create(&hit_module);
    if (!m) return NULL;
    if (PyModule_AddObjectRef(m, "CacheBase", (PyObject *)&CacheBase_Type) < 0 ||
        PyModule_AddObjectRef(m, "HandleBase", (PyObject *)&HandleBase_Type) < 0 ||
        PyModule_AddObjectRef(m, "BatchBase", (PyObject *)&BatchBase_Type) < 0 ||
        PyModule_AddObjectRef(m, "Ready", (PyObject *)&Ready_Type) < 0 ||
        PyModule_AddObjectRef(m, "SlotBuffer", (PyObject *)&SlotBuffer_Type) < 0)
        goto error;
    PyObject *fields = PyDict_New();
    if (!fields ||
#define ROWS(t) t, sizeof t / sizeof *t
        add_fields(fields, "HandleBase", ROWS(handle_fields)) < 0 ||
        add_fields(fields, "BatchBase", ROWS(batch_fields)) < 0 ||
#undef ROWS
        PyModule_AddObjectRef(m, "FIELDS", fields) < 0) {
        Py_XDECREF(fields);
        goto error;
    }
    Py_DECREF(fields);
    return m;
error:
    Py_DECREF(m);
    return NULL;
}
