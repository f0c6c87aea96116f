/*
 * oldlock.c: the OLD locking design (UCM's TransBuffer, seed 002), rebuilt on ucmcache's segment
 * layout as a benchmark baseline.  Never used by ucmcache itself.
 *
 * What the old design does, and what this file therefore does on every operation:
 *   - a robust, process-shared, adaptive mutex per bucket, taken on EVERY lookup (get and exist)
 *     and held for the whole chain walk;
 *   - a process-shared spin lock per slot ("node lock"), taken for each chain node the walk
 *     inspects (to read its key and ready flag) and around every reference change, because the
 *     reference count and the ready flag are plain fields;
 *   - one global allocation lock around victim selection (FetchNode under header->lock), with one
 *     global CLOCK hand over the whole table (no per-rank ranges);
 *   - the old bucket's lock by trylock when a victim moves between buckets (rollback on failure);
 *   - no futex: a reader of a not-ready slot polls the ready flag under the node lock.
 * The lock arrays are packed as in TransBuffer (bucketLocks[], nodeLocks[] contiguous), so
 * neighbouring locks share cache lines: that false sharing is part of the old design's cost.
 *
 * Same layout as ucmcache (ucm_layout_compute): header, bucket heads, SlotMeta lines, data; the
 * old design's locks live in an extra region after layout.total_size (old_extra_size()).  The
 * same bucket hash (ucm_mix) and the same SlotMeta word offsets are used, so chains have the same
 * lengths as in ucmcache.  Key match: bucket word, three key words, state Loading/Ready.
 *
 * Needs ucm_core.h and, linked or included before it, ucm_core.c (ucm_mix, ucm_layout_compute).
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include "ucm_core.h"

#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define OLD_CLAIMED 0x8000000000000000ULL /* a victim chosen by FetchNode, not yet rewritten */
#define OLD_OWNER_FLAG (1LL << 62)      /* old_get: the caller got a fresh slot and must fill it */
#define OLD_ALLOC_TRIES 64

typedef struct old_ctx {
    char *base;
    ucm_layout l;
    uint32_t bucket_mask;
    pthread_mutex_t *alloc_lock;  /* the one global allocation lock */
    uint64_t *hand;               /* the one global CLOCK hand */
    pthread_mutex_t *bucket_locks; /* packed, one per bucket */
    pthread_spinlock_t *node_locks; /* packed, one per slot */
} old_ctx;

static uint64_t o_round_up(uint64_t v, uint64_t a) { return (v + a - 1) / a * a; }

uint64_t old_extra_size(const ucm_layout *l)
{
    return o_round_up(2 * UCM_LINE + l->n_buckets * sizeof(pthread_mutex_t) +
                          l->n_slots * sizeof(pthread_spinlock_t),
                      UCM_PAGE);
}

static void o_bind(old_ctx *c, char *base, const ucm_layout *l)
{
    c->base = base;
    c->l = *l;
    c->bucket_mask = (uint32_t)(l->n_buckets - 1);
    char *x = base + l->total_size;
    c->alloc_lock = (pthread_mutex_t *)x;
    c->hand = (uint64_t *)(x + UCM_LINE);
    c->bucket_locks = (pthread_mutex_t *)(x + 2 * UCM_LINE);
    c->node_locks = (pthread_spinlock_t *)(x + 2 * UCM_LINE + l->n_buckets * sizeof(pthread_mutex_t));
}

static int o_mutex_init(pthread_mutex_t *m)
{
    pthread_mutexattr_t a;
    int r = pthread_mutexattr_init(&a);
    if (r) return r;
    /* TransBuffer's bucket locks: PROCESS_SHARED + ROBUST + ADAPTIVE_NP. */
    pthread_mutexattr_setpshared(&a, PTHREAD_PROCESS_SHARED);
    pthread_mutexattr_setrobust(&a, PTHREAD_MUTEX_ROBUST);
    pthread_mutexattr_settype(&a, PTHREAD_MUTEX_ADAPTIVE_NP);
    r = pthread_mutex_init(m, &a);
    pthread_mutexattr_destroy(&a);
    return r;
}

/* Initialise the whole mapping (base must map total_size + old_extra_size bytes, zeroed). */
int old_init(char *base, const ucm_layout *l)
{
    old_ctx c;
    o_bind(&c, base, l);
    uint32_t *heads = (uint32_t *)(base + l->bucket_off);
    for (uint64_t b = 0; b < l->n_buckets; b++) heads[b] = UCM_NIL;
    for (uint64_t s = 0; s < l->n_slots; s++) {
        char *m = base + l->meta_off + s * UCM_META_SIZE;
        memset(m, 0, UCM_META_SIZE);
        *(uint32_t *)(m + UCM_M_BUCKET) = UCM_INVALID_BUCKET;
        *(uint32_t *)(m + UCM_M_PREV) = UCM_NIL;
        *(uint32_t *)(m + UCM_M_NEXT) = UCM_NIL;
        *(uint32_t *)(m + UCM_M_GENERATION) = 1;
        int r = pthread_spin_init(&c.node_locks[s], PTHREAD_PROCESS_SHARED);
        if (r) return r;
    }
    for (uint64_t b = 0; b < l->n_buckets; b++) {
        int r = o_mutex_init(&c.bucket_locks[b]);
        if (r) return r;
    }
    *c.hand = 0;
    return o_mutex_init(c.alloc_lock);
}

old_ctx *old_ctx_new(char *base, const ucm_layout *l)
{
    old_ctx *c = calloc(1, sizeof *c);
    if (c) o_bind(c, base, l);
    return c;
}

void old_ctx_free(old_ctx *c) { free(c); }

/* ---------------------------------------------------------------- words */

static inline char *o_meta(old_ctx *c, uint32_t s) { return c->base + c->l.meta_off + (uint64_t)s * UCM_META_SIZE; }
#define O_REF(c, s) (*(volatile uint64_t *)(o_meta(c, s) + UCM_M_REFERENCE))
#define O_KEY(c, s) ((volatile uint64_t *)(o_meta(c, s) + UCM_M_KEY))
#define O_BUCKET(c, s) (*(volatile uint32_t *)(o_meta(c, s) + UCM_M_BUCKET))
#define O_STATE(c, s) (*(volatile uint32_t *)(o_meta(c, s) + UCM_M_STATE))
#define O_PREV(c, s) (*(volatile uint32_t *)(o_meta(c, s) + UCM_M_PREV))
#define O_NEXT(c, s) (*(volatile uint32_t *)(o_meta(c, s) + UCM_M_NEXT))
#define O_LEN(c, s) (*(volatile uint32_t *)(o_meta(c, s) + UCM_M_LENGTH))
#define O_ACC(c, s) (*(volatile uint32_t *)(o_meta(c, s) + UCM_M_ACCESSED))
#define O_HEAD(c, b) (*(volatile uint32_t *)((c)->base + (c)->l.bucket_off + (uint64_t)(b) * 4))

static inline void o_bucket_lock(old_ctx *c, uint32_t b)
{
    pthread_mutex_t *m = &c->bucket_locks[b];
    if (pthread_mutex_lock(m) == EOWNERDEAD) pthread_mutex_consistent(m); /* nobody dies here */
}
static inline int o_bucket_trylock(old_ctx *c, uint32_t b)
{
    pthread_mutex_t *m = &c->bucket_locks[b];
    int r = pthread_mutex_trylock(m);
    if (r == EOWNERDEAD) {
        pthread_mutex_consistent(m);
        r = 0;
    }
    return r == 0;
}
static inline void o_bucket_unlock(old_ctx *c, uint32_t b) { pthread_mutex_unlock(&c->bucket_locks[b]); }
static inline void o_node_lock(old_ctx *c, uint32_t s) { pthread_spin_lock(&c->node_locks[s]); }
static inline void o_node_unlock(old_ctx *c, uint32_t s) { pthread_spin_unlock(&c->node_locks[s]); }

static inline void o_load_key(const char *id, uint64_t offset, uint64_t k[3])
{
    memcpy(&k[0], id, 8);
    memcpy(&k[1], id + 8, 8);
    k[2] = offset;
}

static inline uint32_t o_bucket_of(old_ctx *c, const uint64_t *k) { return (uint32_t)ucm_mix(k[0], k[1]) & c->bucket_mask; }

/* Under the bucket lock and the node lock: does slot s hold key? */
static inline int o_match(old_ctx *c, uint32_t s, uint32_t b, const uint64_t *k)
{
    if (O_BUCKET(c, s) != b) return 0;
    if (O_REF(c, s) & OLD_CLAIMED) return 0; /* a victim being moved: its key is going away */
    volatile uint64_t *w = O_KEY(c, s);
    if (w[0] != k[0] || w[1] != k[1] || w[2] != k[2]) return 0;
    uint32_t st = O_STATE(c, s);
    return st == UCM_LOADING || st == UCM_READY;
}

/* FindAt: with bucket b locked, walk its chain taking each node's lock to compare its key; on a
 * match take a reference (++reference under the node lock).  Returns the slot or UCM_NIL. */
static uint32_t o_find_ref(old_ctx *c, uint32_t b, const uint64_t *k, int take_ref, uint32_t *state_out)
{
    uint32_t s = O_HEAD(c, b);
    uint64_t steps = 0;
    while (s != UCM_NIL && s < c->l.n_slots && steps++ <= c->l.n_slots) {
        o_node_lock(c, s);
        int hit = o_match(c, s, b, k);
        if (hit) {
            *state_out = O_STATE(c, s);
            if (take_ref) {
                O_REF(c, s) = O_REF(c, s) + 1;
                if (!O_ACC(c, s)) O_ACC(c, s) = 1;
            }
        }
        uint32_t n = O_NEXT(c, s);
        o_node_unlock(c, s);
        if (hit) return s;
        s = n;
    }
    return UCM_NIL;
}

/* Remove s from bucket ob's chain (ob locked): node locks on s and its neighbours. */
static void o_unlink(old_ctx *c, uint32_t s, uint32_t ob)
{
    o_node_lock(c, s);
    uint32_t p = O_PREV(c, s), n = O_NEXT(c, s);
    if (p != UCM_NIL) {
        o_node_lock(c, p);
        O_NEXT(c, p) = n;
        o_node_unlock(c, p);
    } else {
        O_HEAD(c, ob) = n;
    }
    if (n != UCM_NIL) {
        o_node_lock(c, n);
        O_PREV(c, n) = p;
        o_node_unlock(c, n);
    }
    O_PREV(c, s) = UCM_NIL;
    O_NEXT(c, s) = UCM_NIL;
    O_BUCKET(c, s) = UCM_INVALID_BUCKET;
    o_node_unlock(c, s);
}

static void o_link_head(old_ctx *c, uint32_t s, uint32_t b)
{
    uint32_t h = O_HEAD(c, b);
    if (h != UCM_NIL) {
        o_node_lock(c, h);
        O_PREV(c, h) = s;
        o_node_unlock(c, h);
    }
    o_node_lock(c, s);
    O_PREV(c, s) = UCM_NIL;
    O_NEXT(c, s) = h;
    O_BUCKET(c, s) = b;
    o_node_unlock(c, s);
    O_HEAD(c, b) = s;
}

/* FetchNode: the global allocation lock, the global CLOCK hand, node locks to read each
 * candidate's reference.  The victim is marked OLD_CLAIMED.  Returns the slot or UCM_NIL. */
static uint32_t o_fetch_node(old_ctx *c)
{
    uint32_t found = UCM_NIL;
    if (pthread_mutex_lock(c->alloc_lock) == EOWNERDEAD) pthread_mutex_consistent(c->alloc_lock);
    uint64_t hand = *c->hand, n = c->l.n_slots;
    for (uint64_t i = 0; i < 2 * n + 1; i++) {
        uint32_t s = (uint32_t)(hand++ % n);
        o_node_lock(c, s);
        if (O_REF(c, s) == 0) {
            if (O_ACC(c, s) && O_STATE(c, s) == UCM_READY) {
                O_ACC(c, s) = 0; /* second chance */
            } else {
                O_REF(c, s) = OLD_CLAIMED;
                found = s;
            }
        }
        o_node_unlock(c, s);
        if (found != UCM_NIL) break;
    }
    *c->hand = hand;
    pthread_mutex_unlock(c->alloc_lock);
    return found;
}

/* Alloc, bucket b held: fetch a victim, move it from its old bucket (trylock), rewrite it, link
 * it at b's head and hand it over with one reference.  UCM_OK / UCM_FULL. */
static int o_alloc(old_ctx *c, uint32_t b, const uint64_t *k, uint32_t *slot_out)
{
    for (int t = 0; t < OLD_ALLOC_TRIES; t++) {
        uint32_t s = o_fetch_node(c);
        if (s == UCM_NIL) return UCM_FULL;
        uint32_t ob = O_BUCKET(c, s);
        if (ob != UCM_INVALID_BUCKET && ob != b) {
            if (ob >= c->l.n_buckets) return UCM_CORRUPT;
            if (!o_bucket_trylock(c, ob)) {
                o_node_lock(c, s);
                O_REF(c, s) = 0; /* roll back, try another victim */
                o_node_unlock(c, s);
                continue;
            }
            o_unlink(c, s, ob);
            o_bucket_unlock(c, ob);
        }
        o_node_lock(c, s);
        volatile uint64_t *w = O_KEY(c, s);
        w[0] = k[0];
        w[1] = k[1];
        w[2] = k[2];
        O_STATE(c, s) = UCM_LOADING;
        O_LEN(c, s) = 0;
        O_ACC(c, s) = 1;
        O_REF(c, s) = 1;
        o_node_unlock(c, s);
        if (ob != b) o_link_head(c, s, b);
        *slot_out = s;
        return UCM_OK;
    }
    return UCM_FULL;
}

/* ---------------------------------------------------------------- the API the bench calls */

uint32_t old_slot_state(old_ctx *c, uint32_t s);


/* Get: bucket lock, FindAt (+reference), else Alloc under the bucket lock.  Returns
 * (state << 32 | slot), with OLD_OWNER_FLAG when the caller must fill it, or -code. */
int64_t old_get(old_ctx *c, const char *id, uint64_t offset)
{
    uint64_t k[3];
    o_load_key(id, offset, k);
    uint32_t b = o_bucket_of(c, k), st = 0, s;
    o_bucket_lock(c, b);
    s = o_find_ref(c, b, k, 1, &st);
    if (s != UCM_NIL) {
        o_bucket_unlock(c, b);
        /* Handle::Ready(): the ready flag is read again, under the node lock, by the handle. */
        st = old_slot_state(c, s);
        return ((int64_t)st << 32) | s;
    }
    int r = o_alloc(c, b, k, &s);
    o_bucket_unlock(c, b);
    if (r != UCM_OK) return -(int64_t)r;
    return OLD_OWNER_FLAG | ((int64_t)UCM_LOADING << 32) | s;
}

/* Release: --reference under the node lock. */
int old_release(old_ctx *c, uint32_t s)
{
    if (s >= c->l.n_slots) return UCM_CORRUPT;
    o_node_lock(c, s);
    O_REF(c, s) = O_REF(c, s) - 1;
    o_node_unlock(c, s);
    return UCM_OK;
}

/* Ready / failed: the ready flag under the node lock (no futex in the old design). */
int old_publish(old_ctx *c, uint32_t s, uint32_t state, uint32_t length)
{
    if (s >= c->l.n_slots) return UCM_CORRUPT;
    o_node_lock(c, s);
    O_LEN(c, s) = length;
    O_STATE(c, s) = state;
    o_node_unlock(c, s);
    return UCM_OK;
}

uint32_t old_slot_state(old_ctx *c, uint32_t s)
{
    o_node_lock(c, s);
    uint32_t st = O_STATE(c, s);
    o_node_unlock(c, s);
    return st;
}

/* A reader of a Loading slot polls its ready flag under the node lock: yield 64 times, then
 * sleep 50 us between polls (the old design has no wait/wake mechanism). */
int old_wait_ready(old_ctx *c, uint32_t s, int64_t timeout_ns, uint32_t *state_out)
{
    struct timespec t0, t;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (uint32_t i = 0;; i++) {
        uint32_t st = old_slot_state(c, s);
        if (st != UCM_LOADING) {
            *state_out = st;
            return UCM_OK;
        }
        if (timeout_ns >= 0) {
            clock_gettime(CLOCK_MONOTONIC, &t);
            int64_t el = (int64_t)(t.tv_sec - t0.tv_sec) * 1000000000LL + (t.tv_nsec - t0.tv_nsec);
            if (el >= timeout_ns) {
                *state_out = st;
                return UCM_TIMEOUT;
            }
        }
        if (i < 64) {
            sched_yield();
        } else {
            struct timespec d = {0, 50000};
            nanosleep(&d, NULL);
        }
    }
}

/* Exist: for each key, bucket lock + node lock per inspected node (BufferManager::Lookup calls
 * Exist block by block; the loop runs here, in C, as it did in C++). */
int old_exist_many(old_ctx *c, const char *ids, const uint64_t *offsets, uint32_t n, uint8_t *out)
{
    for (uint32_t i = 0; i < n; i++) {
        uint64_t k[3];
        o_load_key(ids + 16 * (uint64_t)i, offsets[i], k);
        uint32_t b = o_bucket_of(c, k), st = 0;
        o_bucket_lock(c, b);
        uint32_t s = o_find_ref(c, b, k, 0, &st);
        o_bucket_unlock(c, b);
        out[i] = s != UCM_NIL && st == UCM_READY;
    }
    return UCM_OK;
}

/* A batch of gets in one call (the old design had none; this only removes the Python call
 * overhead, the locking per key is the old design's).  owner_out[i] = 1: fill it.
 * codes_out[i] != 0: that position holds nothing (slot UCM_NIL). */
int old_get_many(old_ctx *c, const char *ids, const uint64_t *offsets, uint32_t n,
                 uint32_t *slots_out, uint8_t *states_out, uint8_t *owner_out, uint8_t *codes_out)
{
    int worst = UCM_OK;
    for (uint32_t i = 0; i < n; i++) {
        int64_t r = old_get(c, ids + 16 * (uint64_t)i, offsets[i]);
        if (r < 0) {
            slots_out[i] = UCM_NIL;
            states_out[i] = 0;
            owner_out[i] = 0;
            codes_out[i] = (uint8_t)(-r);
            worst = (int)(-r);
            continue;
        }
        slots_out[i] = (uint32_t)(r & 0xffffffffu);
        states_out[i] = (uint8_t)((r >> 32) & 0xff);
        owner_out[i] = (r & OLD_OWNER_FLAG) ? 1 : 0;
        codes_out[i] = 0;
    }
    return worst;
}

int old_release_many(old_ctx *c, const uint32_t *slots, uint32_t n)
{
    for (uint32_t i = 0; i < n; i++)
        if (slots[i] != UCM_NIL) old_release(c, slots[i]);
    return UCM_OK;
}
