/*
 * ucm_core.c: every load, store and read-modify-write on a ucmcache segment's shared words.
 *
 * The shared table, and who touches what
 * --------------------------------------
 * A segment is mapped by several processes at once; any of them can be SIGKILLed at any
 * instruction.  Each slot has one 64-byte SlotMeta line:
 *
 *   reference  The only coordination word (invariant I1).  Bit r (r < 63) set: rank r pins the
 *              slot.  UCM_CLAIMED | r: rank r claims it to rewrite it.  Pins and claims both start
 *              from 0 with a CAS, so a slot is pinned by readers or claimed by one writer, never
 *              both.  A process pins a slot at most once; handles in one process share that bit
 *              through a process-local count (ucm_ctx.local_pins), changed together with the bit
 *              under a process-local lock striped by slot (DESIGN 5, trap b).  Because the holder
 *              is named in the word itself, a dead rank's holds are found exactly (I5).
 *   key[3], generation, loader, flags, length
 *              Written only by the claimant (or, for state/length/flags, by the owner while it
 *              holds its pin in Loading; for loader/flags, by a deleter holding the stripe and
 *              a pin on a Ready slot, see ucm_delete).  Readers read them without a lock, so every read is an
 *              atomic (relaxed unless stated) and a hit is trusted only after it is read again
 *              under the pin (I3).
 *   bucket     The bucket the slot is linked in, or UCM_INVALID_BUCKET.  Stored with release
 *              before the chain head that makes the slot reachable (I2); read with acquire first
 *              in MatchKey, so a walker who reaches the slot sees the whole key.
 *   prev/next  Chain links, changed only under the bucket's stripe lock.  Lock-free walkers
 *              follow next with acquire loads and may run into a slot that has since moved; the
 *              bucket word makes it not match, and every walk is bounded.
 *   state      Empty / Loading / Ready / Failed plus a WAITERS bit; the futex word of waiters.
 *   accessed   CLOCK's reference bit; set by readers only when clear, so a hot slot's line is not
 *              written by every hit.
 *
 * Everything read from shared memory is untrusted: slot and bucket indices are bounds-checked
 * and every walk is bounded, so a corrupt segment yields UCM_CORRUPT, never a wild access.
 *
 * Protocol steps live here whole (one C call per step, DESIGN 3); decisions about what to do
 * after a step's answer (slow path, budgets, CacheFull, recovery) live in ucmcache/_cache.py.
 * Step numbers in comments are DESIGN.md section 4's.
 */
#define _GNU_SOURCE
#include "ucm_core.h"

#include <errno.h>
#include <fcntl.h>
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

/* A stripe's robust mutex lives in one line of the stripe region. */
_Static_assert(sizeof(pthread_mutex_t) <= UCM_LINE, "a stripe's mutex must fit its line");

#define LOCAL_LOCKS 64
#define WALK_LIMIT_MIN 64

/* The owned-arena hint's words: n_arenas <= max_ranks * UCM_ARENAS_PER_RANK (ucm_layout_compute). */
#define OWNED_HINT_WORDS ((UCM_MAX_RANKS * UCM_ARENAS_PER_RANK + 63) / 64)

struct ucm_ctx {
    char *base;
    uint64_t map_size;
    ucm_layout l;
    uint32_t bucket_mask;
    uint32_t stripe_mask;
    int32_t rank;            /* -1: not attached to a rank (inspection only) */
    uint64_t rank_bit;
    uint64_t *stats;         /* this rank's stats lines, or a private sink when rank < 0 */
    uint64_t stats_sink[UCM_ST_COUNT];
    uint64_t walk_limit;
    uint32_t *local_pins;    /* process-local: how many handles of this process share our pin */
    uint8_t *local_done;     /* process-local, per slot: 1 once a thread of ours took the right
                              * to finish the load our install began (take_finish), 0 from the
                              * install's handover; changed under the local lock */
    uint32_t *local_serial;  /* process-local, per slot: bumped by each install's handover under
                              * the local lock; the owner of that load is handed it, and only
                              * a finisher naming it may take the right (take_finish): a stale
                              * ready()/fail() can never finish a later install's load */
    uint32_t *arena_seen;    /* process-local, per arena: serial << 1 | verified (see "Arenas") */
    uint64_t owned_hint[OWNED_HINT_WORDS]; /* process-local, a bit per arena: every arena our rank
                              * owns has its bit (set at ucm_ctx_set_rank and after each take's
                              * CAS, cleared by a look that finds the arena not ours: see
                              * owned_hint_drop), so the free-first look walks these bits, not
                              * every arena */
    uint64_t frees;          /* process-local: bumped (release) after each step of ours that can
                              * leave a slot of our arenas unheld and not a live entry, or adds an
                              * arena to ours (see frees_bump) */
    uint64_t full_mark;      /* process-local: full_mark_now() when a free-first look of ours last
                              * found every arena of ours full by its words and verified; while
                              * it is still the mark, claims skip that look (UINT64_MAX: none) */
    uint64_t epoch_seen;     /* the arena epoch our rank last looked at its share in */
    uint64_t room_gone;      /* room_mark(epoch, generation) | arenas we owned, under which the
                              * policy found nothing to take before evicting
                              * (ucm_arena_room_gone_at): our claims evict without asking it
                              * again while those hold and we own no fewer (UINT64_MAX: ask) */
    uint32_t local_locks[LOCAL_LOCKS]; /* process-local spinlocks, see local_lock() */
    uint8_t *repair_seen;    /* process-local visited set for stripe repair, made up front */
    pthread_mutex_t repair_lock;
    uint32_t refs;           /* 1 for the cache + 1 per armed token; freed at 0 */
    uint32_t closed;         /* the cache closed (or this is a forked child's copy): no token
                              * may touch shared memory through this context any more */
    uint32_t epoch;          /* fork_epoch when made: a forked child's copy is another epoch */
    int32_t point_action[UCM_PT_COUNT];
    int32_t points_set;      /* a point was ever set here: the hit path releases the GIL (its
                              * gate would otherwise hold every thread of the process) */
    uint32_t *point_gate[UCM_PT_COUNT];
    int64_t point_timeout[UCM_PT_COUNT];
};

static inline uint32_t *owner_w(ucm_ctx *c, uint32_t a);

/* A step of ours that may have made room in our arenas (a slot freed, an arena taken): the
 * free-first look runs again at our next claim.  Release: a claimant whose acquire load of the
 * count reads this bump also sees the step's words (full_mark_now). */
static inline void frees_bump(ucm_ctx *c)
{
    __atomic_fetch_add(&c->frees, 1, __ATOMIC_RELEASE);
}

static inline void owned_hint_add(ucm_ctx *c, uint32_t a)
{
    /* seq_cst: the other half of owned_hint_drop's pair (a take's CAS, then this OR); an
     * atomic OR, so that two threads of ours never lose each other's bit. */
    __atomic_fetch_or(&c->owned_hint[a >> 6], 1ULL << (a & 63), __ATOMIC_SEQ_CST);
}

/* A look found arena a's owner word not ours: drop its bit, then read the owner again and put
 * the bit back if a take of ours won it meanwhile.  All four steps seq_cst: either our second
 * read comes after that take's CAS (it sees us, the bit goes back), or it comes before, and
 * then the take's OR (after its CAS) comes after our AND: the bit of an arena we own is never
 * lost.  A bit kept for an arena not ours costs one owner load per look. */
static inline void owned_hint_drop(ucm_ctx *c, uint32_t a, uint32_t me)
{
    __atomic_fetch_and(&c->owned_hint[a >> 6], ~(1ULL << (a & 63)), __ATOMIC_SEQ_CST);
    if (__atomic_load_n(owner_w(c, a), __ATOMIC_SEQ_CST) == me) owned_hint_add(c, a);
}

/* The pins single-key C steps handed to the Python layer, per thread, by ticket (process-local
 * memory, no atomics).  Between the moment a C call that pins returns and the moment a Handle
 * owns that pin, Python can raise at its next eval-breaker check (a signal handler,
 * KeyboardInterrupt) and the returned value is lost with the exception.  The caller draws a
 * ticket (unique per call) before the call; the step records (ticket, slot) here; if the pin
 * never reached its owner object, the except path asks ucm_abandon_inflight(ticket) to drop
 * it.  A ring, not one record, because a signal handler can run a nested get between the outer
 * call and its except path: each finds its own ticket.  Records of calls that succeeded are
 * never looked up again (tickets are not reused); a nesting deeper than the ring loses the
 * outermost record, which can leak a pin, never drop one that a Handle owns. */
#define INFLIGHT 16
static __thread struct {
    uint64_t ticket; /* 0: none */
    ucm_ctx *c;
    uint32_t slot;   /* UCM_NIL: the step pinned nothing */
} inflight[INFLIGHT];
static __thread uint32_t inflight_next;

static inline uint32_t inflight_open(ucm_ctx *c, uint64_t ticket)
{
    uint32_t i = inflight_next++ % INFLIGHT;
    inflight[i].ticket = ticket;
    inflight[i].c = c;
    inflight[i].slot = UCM_NIL;
    return i;
}

/* A forked child copies every context and every Python object of its parent, and its garbage
 * collector may finalize a copied Handle before any Python after-fork hook runs: it must not
 * drop the parent's pins (its rank bit is the parent's).  The child handler bumps the epoch
 * inside fork() itself, before any Python code; a context made in another epoch writes
 * nothing shared. */
static uint32_t fork_epoch;
static pthread_once_t fork_hook_once = PTHREAD_ONCE_INIT;
static void on_fork_child(void) { fork_epoch++; } /* the child is single-threaded here */
static void install_fork_hook(void) { pthread_atfork(NULL, NULL, on_fork_child); }

/* ---------------------------------------------------------------- layout */

static uint64_t round_up(uint64_t v, uint64_t a) { return (v + a - 1) / a * a; }

static uint64_t next_pow2(uint64_t v)
{
    uint64_t p = 1;
    while (p < v) p <<= 1;
    return p;
}

uint64_t ucm_default_buckets(uint64_t n_slots)
{
    /* DESIGN 2: average chain at most 2 with every slot in use, clamped to [2^14, 2^24]. */
    uint64_t b = next_pow2((n_slots + 1) / 2);
    if (b < UCM_MIN_BUCKETS_DEFAULT) b = UCM_MIN_BUCKETS_DEFAULT;
    if (b > UCM_MAX_BUCKETS) b = UCM_MAX_BUCKETS;
    return b;
}

static int is_pow2(uint64_t v) { return v && !(v & (v - 1)); }

int ucm_layout_compute(ucm_layout *l)
{
    if (l->max_ranks < 1 || l->max_ranks > UCM_MAX_RANKS) return UCM_EP_MAX_RANKS;
    if (l->slots_per_rank < 1 || l->slots_per_rank > UCM_MAX_SLOTS) return UCM_EP_SLOTS_PER_RANK;
    if (l->slot_size < 1 || l->slot_size > UCM_MAX_SLOT_SIZE) return UCM_EP_SLOT_SIZE;
    if (!is_pow2(l->n_stripes) || l->n_stripes > UCM_MAX_STRIPES) return UCM_EP_N_STRIPES;
    l->n_slots = (uint64_t)l->max_ranks * l->slots_per_rank;
    if (l->n_slots >= UCM_MAX_SLOTS) return UCM_EP_SLOTS_PER_RANK;
    if (l->n_buckets == 0) l->n_buckets = ucm_default_buckets(l->n_slots);
    if (!is_pow2(l->n_buckets) || l->n_buckets > UCM_MAX_BUCKETS) return UCM_EP_N_BUCKETS;
    /* Each region starts on its own line so that no two regions' hot words share one. */
    l->slot_stride = round_up(l->slot_size, UCM_LINE);
    /* Arenas: UCM_ARENAS_PER_RANK per rank of max_ranks, fewer and of one slot when slots are
     * few; the last may be shorter.  Small enough that a share moves in fine steps when ranks
     * come and go, large enough that a CLOCK sweep skips other ranks' arenas a line at a time. */
    uint64_t want = (uint64_t)l->max_ranks * UCM_ARENAS_PER_RANK;
    l->arena_slots = (l->n_slots + want - 1) / want;
    l->n_arenas = (l->n_slots + l->arena_slots - 1) / l->arena_slots;
    l->rank_off = UCM_HEADER_SIZE;
    l->arena_off = l->rank_off + (uint64_t)l->max_ranks * UCM_RANK_SIZE;
    l->bucket_off = l->arena_off + l->n_arenas * UCM_ARENA_SIZE;
    l->stripe_off = l->bucket_off + round_up(l->n_buckets * 4, UCM_LINE);
    l->meta_off = l->stripe_off + (uint64_t)l->n_stripes * UCM_LINE;
    l->ring_size = UCM_RING_SIZE; /* a whole number of lines (ucm_core.h) */
    l->ring_off = l->meta_off + l->n_slots * UCM_META_SIZE;
    l->data_off = round_up(l->ring_off + (uint64_t)l->max_ranks * l->ring_size, UCM_PAGE);
    if (l->n_slots > (UINT64_MAX - l->data_off) / l->slot_stride) return UCM_EP_TOO_LARGE;
    l->total_size = round_up(l->data_off + l->n_slots * l->slot_stride, UCM_PAGE);
    return UCM_OK;
}

/* The layout tables of ucm_core.h as data: one row per word, in table order. */
#define UCM_FIELD_ROW_(prefix, name, type, count, align) \
    {ucm_table_name_##prefix, sizeof(ucm_struct_of_##prefix), #name, UCM_##prefix##_##name, \
     sizeof(type), count},
#define ucm_table_name_H "header"
#define ucm_table_name_R "rank"
#define ucm_table_name_A "arena"
#define ucm_table_name_M "slot_meta"
#define ucm_table_name_RING "ring"
static const ucm_field layout_fields[] = {
    UCM_HEADER_TABLE(UCM_FIELD_ROW_)
    UCM_RANK_TABLE(UCM_FIELD_ROW_)
    UCM_ARENA_TABLE(UCM_FIELD_ROW_)
    UCM_SLOT_META_TABLE(UCM_FIELD_ROW_)
    UCM_RING_TABLE(UCM_FIELD_ROW_)
};
#define N_LAYOUT_FIELDS (sizeof layout_fields / sizeof layout_fields[0])

const char *ucm_result_name(int32_t code)
{
#define UCM_RESULT_CASE_(name, value) case value: return "UCM_" #name;
    switch (code) { UCM_RESULT_TABLE(UCM_RESULT_CASE_) }
#undef UCM_RESULT_CASE_
    return NULL;
}

const ucm_field *ucm_layout_fields(uint32_t *n_out)
{
    *n_out = (uint32_t)N_LAYOUT_FIELDS;
    return layout_fields;
}

uint32_t ucm_layout_fingerprint(void)
{
    /* Every word of every table (its place, width and count) and every other offset and size
     * this build lays a segment out with.  Two builds that disagree on any of them must not
     * share a segment even if someone forgot to bump the version. */
    static const uint64_t parts[] = {
        UCM_HEADER_SIZE, UCM_RANK_SIZE, UCM_ARENA_SIZE, UCM_META_SIZE, UCM_RING_SIZE,
        UCM_ST_COUNT, UCM_ARENAS_PER_RANK, UCM_ACC_GEN_BITS,
        /* how the ring's ENTRIES words divide into entries */
        UCM_RING_DEPTH, UCM_RING_ENTRY_WORDS,
        UCM_CLAIMED, UCM_NIL, UCM_LINE, UCM_PAGE, sizeof(pthread_mutex_t),
        /* what the flags word's bits mean (a build without DELETING would misread a slot) */
        UCM_F_COUNTED, UCM_F_INSTALLING, UCM_F_DELETING, UCM_F_DELETE_CHECKED,
        /* the histograms' counters and what their buckets mean live in the stats lines too */
        UCM_HIST_BUCKETS, UCM_HIST_FIRST_NS, UCM_HIST_FACTOR, UCM_ST_LOAD_HIST, UCM_ST_WAIT_HIST};
    uint64_t h = 0, i = 0;
    for (size_t p = 0; p < sizeof parts / sizeof parts[0]; p++) h = ucm_mix(h ^ parts[p], ++i);
    for (size_t f = 0; f < N_LAYOUT_FIELDS; f++) {
        const ucm_field *row = &layout_fields[f];
        h = ucm_mix(h ^ row->table_size, ++i);
        h = ucm_mix(h ^ row->offset, ++i);
        h = ucm_mix(h ^ row->item_size, ++i);
        h = ucm_mix(h ^ row->count, ++i);
    }
    return (uint32_t)(h ^ (h >> 32));
}

uint32_t ucm_params_crc(const char *base)
{
    /* zlib's crc32 of the header's param bytes, [VERSION, end of line 0): catches a param word
     * changed after the segment was made.  Read by the creator before the magic and by attachers
     * after it, when nobody writes these words any more. */
    const unsigned char *p = (const unsigned char *)base + UCM_H_VERSION;
    const unsigned char *end = (const unsigned char *)base + UCM_H_GENERATION;
    uint32_t crc = 0xffffffffu;
    for (; p < end; p++) {
        crc ^= *p;
        for (int k = 0; k < 8; k++) crc = (crc >> 1) ^ (0xedb88320u & (0u - (crc & 1)));
    }
    return crc ^ 0xffffffffu;
}

uint64_t ucm_mix(uint64_t k0, uint64_t k1)
{
    /* Both halves of the block id feed the index (callers' ids are not always uniform);
     * the splitmix64/murmur3 finalizer spreads them. */
    uint64_t x = k0 ^ (k1 * 0x9e3779b97f4a7c15ULL);
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdULL;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ULL;
    x ^= x >> 33;
    return x;
}

/* ---------------------------------------------------------------- raw words */

#define W32(base, off) ((uint32_t *)((base) + (off)))
#define W64(base, off) ((uint64_t *)((base) + (off)))

/* Generic word access for the Python layer (header bootstrap, inspection, tests).  Loads are
 * acquire and stores release: these calls are off the hot path, and acquire/release makes any
 * use of them (e.g. the magic written last, read first) safe without further argument. */
uint32_t ucm_load32(char *base, uint64_t off) { return __atomic_load_n(W32(base, off), __ATOMIC_ACQUIRE); }
uint64_t ucm_load64(char *base, uint64_t off) { return __atomic_load_n(W64(base, off), __ATOMIC_ACQUIRE); }
void ucm_store32(char *base, uint64_t off, uint32_t v) { __atomic_store_n(W32(base, off), v, __ATOMIC_RELEASE); }
void ucm_store64(char *base, uint64_t off, uint64_t v) { __atomic_store_n(W64(base, off), v, __ATOMIC_RELEASE); }
/* Read-modify-writes are seq_cst: the Python layer uses them for rank registration and
 * recovery hand-offs, where a total order is the simplest correct argument. */
int ucm_cas32(char *base, uint64_t off, uint32_t expected, uint32_t desired)
{
    return __atomic_compare_exchange_n(W32(base, off), &expected, desired, 0, __ATOMIC_SEQ_CST,
                                       __ATOMIC_SEQ_CST);
}
uint32_t ucm_fetch_add32(char *base, uint64_t off, uint32_t v) { return __atomic_fetch_add(W32(base, off), v, __ATOMIC_SEQ_CST); }
uint64_t ucm_fetch_add64(char *base, uint64_t off, uint64_t v) { return __atomic_fetch_add(W64(base, off), v, __ATOMIC_SEQ_CST); }

/* ---------------------------------------------------------------- time, futex, gates */

static int64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static int futex_wait_intr(uint32_t *w, uint32_t expected, int64_t timeout_ns)
{
    /* timeout_ns < 0: no timeout.  Returns 0 (woken or value changed), UCM_TIMEOUT, or
     * UCM_SLICE (a signal interrupted the sleep: its handler, if Python's, wants to run). */
    struct timespec ts, *tsp = NULL;
    if (timeout_ns >= 0) {
        ts.tv_sec = timeout_ns / 1000000000LL;
        ts.tv_nsec = timeout_ns % 1000000000LL;
        tsp = &ts;
    }
    /* Shared (not FUTEX_PRIVATE) futex: waiters and wakers are in different processes. */
    long r = syscall(SYS_futex, w, FUTEX_WAIT, expected, tsp, NULL, 0);
    if (r == -1 && errno == ETIMEDOUT) return UCM_TIMEOUT;
    if (r == -1 && errno == EINTR) return UCM_SLICE;
    return UCM_OK;
}

static int futex_wait_word(uint32_t *w, uint32_t expected, int64_t timeout_ns)
{
    /* As futex_wait_intr, a signal taken as a wake-up (the callers look at the word again). */
    int r = futex_wait_intr(w, expected, timeout_ns);
    return r == UCM_SLICE ? UCM_OK : r;
}

static void futex_wake_word(uint32_t *w, int32_t n)
{
    syscall(SYS_futex, w, FUTEX_WAKE, n, NULL, NULL, 0);
}

int64_t ucm_now_ns(void) { return now_ns(); } /* the clock of the load and wait histograms */

int ucm_futex_wait(char *base, uint64_t off, uint32_t expected, int64_t timeout_ns)
{
    return futex_wait_word(W32(base, off), expected, timeout_ns);
}

int ucm_futex_wake(char *base, uint64_t off, int32_t n)
{
    futex_wake_word(W32(base, off), n);
    return UCM_OK;
}

/* A gate word used by tests: waits (bounded) until the word differs from `expected`. */
int ucm_gate_wait(uint32_t *word, uint32_t expected, int64_t timeout_ns)
{
    int64_t deadline = now_ns() + timeout_ns;
    for (;;) {
        /* Acquire pairs with the release in ucm_gate_wake: what the opener did before opening
         * is visible after the wait. */
        if (__atomic_load_n(word, __ATOMIC_ACQUIRE) != expected) return UCM_OK;
        int64_t left = deadline - now_ns();
        if (left <= 0) return UCM_TIMEOUT;
        futex_wait_word(word, expected, left);
    }
}

int ucm_gate_wake(uint32_t *word)
{
    /* Release: publishes the opener's prior writes to the woken side (pairs with ucm_gate_wait). */
    __atomic_fetch_add(word, 1, __ATOMIC_RELEASE);
    futex_wake_word(word, INT32_MAX);
    return UCM_OK;
}

/* A named point: no cost but one predictable branch when unused.  GATE: bump the gate word by
 * one (arrived) and wait until the test bumps it again (released), bounded.  KILL: SIGKILL this
 * process right here, the way a crash would.  EXIT: this thread exits right here (the C stress
 * driver's death of a rank that is a thread: a parked thread would keep a stripe's robust mutex
 * held by a live owner for good, where a dead one passes EOWNERDEAD to the next locker). */
static void point_slow(ucm_ctx *c, int p)
{
    if (c->point_action[p] == UCM_ACT_KILL) raise(SIGKILL);
    if (c->point_action[p] == UCM_ACT_EXIT) pthread_exit(NULL);
    uint32_t *g = c->point_gate[p];
    c->point_action[p] = UCM_ACT_NONE; /* one-shot: a gate holds the first thread that comes */
    if (!g) return;
    uint32_t arrived = __atomic_add_fetch(g, 1, __ATOMIC_ACQ_REL);
    futex_wake_word(g, INT32_MAX);
    ucm_gate_wait(g, arrived, c->point_timeout[p]);
}
#define POINT(c, p)                                                                   \
    do {                                                                              \
        if (__builtin_expect((c)->point_action[p] != UCM_ACT_NONE, 0)) point_slow(c, p); \
    } while (0)

void ucm_ctx_set_point(ucm_ctx *c, int32_t point, int32_t action, uint32_t *gate_word,
                       int64_t timeout_ns)
{
    if (point <= 0 || point >= UCM_PT_COUNT) return;
    c->point_gate[point] = gate_word;
    c->point_timeout[point] = timeout_ns;
    /* Release, and before the action: a thread that sees the action armed through this
     * context (after its own acquire load of points_set) has released the GIL first. */
    __atomic_store_n(&c->points_set, 1, __ATOMIC_RELEASE);
    c->point_action[point] = action;
}

int ucm_ctx_points_set(ucm_ctx *c)
{
    return __atomic_load_n(&c->points_set, __ATOMIC_ACQUIRE); /* pairs with set_point's store */
}

/* ---------------------------------------------------------------- robust mutexes */

int ucm_mutex_init(char *base, uint64_t off)
{
    pthread_mutexattr_t a;
    pthread_mutex_t *m = (pthread_mutex_t *)(base + off);
    int r;
    if ((r = pthread_mutexattr_init(&a))) return r;
    /* Process-shared so every attached process can use it; robust so a holder that dies hands
     * the next locker EOWNERDEAD instead of a lock held forever. */
    if ((r = pthread_mutexattr_setpshared(&a, PTHREAD_PROCESS_SHARED))) goto out;
    if ((r = pthread_mutexattr_setrobust(&a, PTHREAD_MUTEX_ROBUST))) goto out;
    r = pthread_mutex_init(m, &a);
out:
    pthread_mutexattr_destroy(&a);
    return r;
}

static int mutex_result(int r)
{
    if (r == 0) return UCM_OK;
    if (r == EOWNERDEAD) return UCM_OWNERDEAD;
    if (r == EBUSY) return UCM_BUSY;
    if (r == ETIMEDOUT) return UCM_TIMEOUT;
    if (r == EPERM) return UCM_NOT_HELD;
    return UCM_CORRUPT; /* ENOTRECOVERABLE, EINVAL: the mutex word is not a mutex any more */
}

uint32_t ucm_mutex_holder(char *base, uint64_t off)
{
    /* The thread id a robust mutex's lock word names (Linux robust futex ABI: the owner's TID in
     * the low 30 bits of the futex word, the first int of glibc's pthread_mutex_t), 0 when free.
     * Relaxed: a diagnostic read for an error message or verify; nothing is ordered by it. */
    return __atomic_load_n(W32(base, off), __ATOMIC_RELAXED) & 0x3fffffffu;
}


/* ---------------------------------------------------------------- making a segment */

int ucm_segment_init(char *base, const ucm_layout *l, uint32_t creator_pid, uint32_t creator_uid)
{
    /* Every word of a new segment but the magic, on a zeroed mapping that nobody else trusts
     * yet (the bootstrap protocol: ucmcache/_segment.py).  Arenas (zero: generation 0, owner
     * free) and RankDescs (zero: FREE) stay as the zeroed mapping has them.  Returns 0, or the
     * errno of a stripe's pthread_mutex_init. */
    ucm_header *h = (ucm_header *)base;
    /* The pid first, release: a prober that sees a free creator lock reads it (before any
     * magic) to tell "being made" from "its creator died". */
    __atomic_store_n(h->CREATOR_PID, creator_pid, __ATOMIC_RELEASE);
    /* The rest relaxed: no one reads them before the magic, whose release store in
     * ucm_segment_publish orders them all before an attacher's acquire load of it. */
    __atomic_store_n(h->CREATOR_UID, creator_uid, __ATOMIC_RELAXED);
    __atomic_store_n(h->VERSION, UCM_LAYOUT_VERSION, __ATOMIC_RELAXED);
    __atomic_store_n(h->FEATURES, 0, __ATOMIC_RELAXED);
    __atomic_store_n(h->MAX_RANKS, l->max_ranks, __ATOMIC_RELAXED);
    __atomic_store_n(h->N_STRIPES, l->n_stripes, __ATOMIC_RELAXED);
    __atomic_store_n(h->SLOTS_PER_RANK, l->slots_per_rank, __ATOMIC_RELAXED);
    __atomic_store_n(h->SLOT_SIZE, l->slot_size, __ATOMIC_RELAXED);
    __atomic_store_n(h->N_BUCKETS, l->n_buckets, __ATOMIC_RELAXED);
    __atomic_store_n(h->TOTAL_SIZE, l->total_size, __ATOMIC_RELAXED);
    __atomic_store_n(h->PARAMS_CRC, ucm_params_crc(base), __ATOMIC_RELAXED);
    __atomic_store_n(h->LAYOUT_FP, ucm_layout_fingerprint(), __ATOMIC_RELAXED);
    __atomic_store_n(h->GENERATION, 1, __ATOMIC_RELAXED); /* generation 0 is the arenas' "none" */
    uint32_t *heads = W32(base, l->bucket_off);
    for (uint64_t b = 0; b < l->n_buckets; b++) heads[b] = UCM_NIL;
    for (uint64_t s = 0; s < l->n_slots; s++) {
        ucm_slot_meta *m = (ucm_slot_meta *)(base + l->meta_off + s * UCM_META_SIZE);
        m->BUCKET[0] = UCM_INVALID_BUCKET;
        m->PREV[0] = UCM_NIL;
        m->NEXT[0] = UCM_NIL;
    }
    for (uint32_t st = 0; st < l->n_stripes; st++) {
        int r = ucm_mutex_init(base, l->stripe_off + (uint64_t)st * UCM_LINE);
        if (r) return r;
    }
    return 0;
}

void ucm_segment_publish(char *base)
{
    /* The magic last, release: pairs with an attacher's acquire load of it (ucm_load64), after
     * which every word ucm_segment_init stored is visible.  Then wake attachers sleeping on it. */
    __atomic_store_n(((ucm_header *)base)->MAGIC, UCM_MAGIC, __ATOMIC_RELEASE);
    futex_wake_word(W32(base, UCM_H_MAGIC), INT32_MAX);
}

/* ---------------------------------------------------------------- process-local locks */

/* Recovery in one process is serialised by this lock (threads share the life locks' file
 * description, so the OFD lock alone cannot).  A threading.Lock taken from Python can be left
 * held by an exception that a signal handler raises right after acquire() returns, before any
 * try block owns it; this one records the holder (thread id and the caller's ticket) inside the
 * acquire, and the caller's `finally` releases by ticket, which is a no-op unless that very
 * call holds it.  A nested call on the holding thread (a signal handler recovering while its
 * thread recovers) gets UCM_BUSY instead of a second, overlapping recovery.  Freed by
 * ucm_plock_free when the Python object owning it is collected (a Segment, an arena policy).  The holder fields are written only by the
 * holder with the mutex held, and read by other threads only to compare with their own id:
 * relaxed atomics. */
struct ucm_plock {
    pthread_mutex_t m;
    int32_t tid;     /* holder's thread id, 0 when free */
    uint64_t ticket; /* holder call's ticket */
};

ucm_plock *ucm_plock_new(void)
{
    ucm_plock *p = calloc(1, sizeof *p);
    if (p) pthread_mutex_init(&p->m, NULL);
    return p;
}

void ucm_plock_free(ucm_plock *p)
{
    /* When its owner object is collected: nobody can hold it any more. */
    if (!p) return;
    pthread_mutex_destroy(&p->m);
    free(p);
}

int ucm_plock_acquire(ucm_plock *p, int64_t timeout_ns, uint64_t ticket)
{
    int32_t me = (int32_t)syscall(SYS_gettid);
    if (__atomic_load_n(&p->tid, __ATOMIC_RELAXED) == me) return UCM_BUSY;
    int r;
    if (timeout_ns <= 0) {
        r = pthread_mutex_trylock(&p->m);
    } else {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        int64_t ns = ts.tv_nsec + timeout_ns;
        ts.tv_sec += ns / 1000000000LL;
        ts.tv_nsec = ns % 1000000000LL;
        r = pthread_mutex_timedlock(&p->m, &ts);
    }
    if (r != 0) return r == ETIMEDOUT || r == EBUSY ? UCM_TIMEOUT : UCM_CORRUPT;
    __atomic_store_n(&p->ticket, ticket, __ATOMIC_RELAXED);
    __atomic_store_n(&p->tid, me, __ATOMIC_RELAXED);
    return UCM_OK;
}

void ucm_plock_release(ucm_plock *p, uint64_t ticket)
{
    int32_t me = (int32_t)syscall(SYS_gettid);
    if (__atomic_load_n(&p->tid, __ATOMIC_RELAXED) != me
        || __atomic_load_n(&p->ticket, __ATOMIC_RELAXED) != ticket) return;
    __atomic_store_n(&p->tid, 0, __ATOMIC_RELAXED);
    pthread_mutex_unlock(&p->m);
}

/* ---------------------------------------------------------------- OFD life locks */

/* A rank's life lock is an open-file-description lock on one byte of the segment's fd.  The
 * kernel drops it when the last fd of that description closes, i.e. when the process dies, and
 * it belongs to the process, not to a thread (DESIGN 5, trap a). */
static int ofd(int fd, int cmd, short type, uint64_t byte, struct flock *out)
{
    struct flock fl;
    memset(&fl, 0, sizeof fl);
    fl.l_type = type;
    fl.l_whence = SEEK_SET;
    fl.l_start = (off_t)byte;
    fl.l_len = 1;
    int r = fcntl(fd, cmd, &fl);
    if (out) *out = fl;
    return r == 0 ? 0 : errno;
}

int ucm_ofd_trylock(int fd, uint64_t byte)
{
    int e = ofd(fd, F_OFD_SETLK, F_WRLCK, byte, NULL);
    if (e == 0) return UCM_OK;
    if (e == EAGAIN || e == EACCES) return UCM_BUSY;
    return -e;
}

int ucm_ofd_unlock(int fd, uint64_t byte)
{
    int e = ofd(fd, F_OFD_SETLK, F_UNLCK, byte, NULL);
    return e ? -e : UCM_OK;
}

int ucm_ofd_held_by_other(int fd, uint64_t byte)
{
    /* 1: another open file description holds it (a live process); 0: free or ours. */
    struct flock fl;
    int e = ofd(fd, F_OFD_GETLK, F_WRLCK, byte, &fl);
    if (e) return -e;
    return fl.l_type != F_UNLCK;
}

/* ---------------------------------------------------------------- context */

ucm_ctx *ucm_ctx_new(char *base, uint64_t map_size, const ucm_layout *l)
{
    if (!base || !l || l->total_size > map_size || l->n_slots == 0 || l->arena_slots == 0
        || l->n_arenas * l->arena_slots < l->n_slots
        || l->n_arenas > (uint64_t)OWNED_HINT_WORDS * 64) return NULL;
    ucm_ctx *c = calloc(1, sizeof *c);
    if (!c) return NULL;
    c->base = base;
    c->map_size = map_size;
    c->l = *l;
    c->bucket_mask = (uint32_t)(l->n_buckets - 1);
    c->stripe_mask = l->n_stripes - 1;
    c->rank = -1;
    c->stats = c->stats_sink;
    c->epoch_seen = UINT64_MAX; /* never: the first slow path looks at its share */
    c->room_gone = UINT64_MAX;  /* never: the policy looks before our first eviction */
    c->full_mark = UINT64_MAX;  /* never: the first claim looks for a free slot */
    /* A walk longer than this on the lock-free path gives up and takes the slow path; under
     * the lock a chain can never be longer than the number of slots. */
    c->walk_limit = l->n_slots + 1;
    c->local_pins = calloc(l->n_slots, sizeof(uint32_t));
    c->local_done = calloc(l->n_slots, 1);
    c->local_serial = calloc(l->n_slots, sizeof(uint32_t));
    c->arena_seen = calloc(l->n_arenas, sizeof(uint32_t));
    if (!c->local_pins || !c->local_done || !c->local_serial || !c->arena_seen) {
        free(c->local_pins);
        free(c->local_done);
        free(c->local_serial);
        free(c->arena_seen);
        free(c);
        return NULL;
    }
    /* Allocated now so that repairing a dead holder's stripe can never fail for memory. */
    c->repair_seen = calloc((l->n_slots + 7) / 8, 1);
    if (!c->repair_seen) {
        free(c->local_pins);
        free(c->local_done);
        free(c->local_serial);
        free(c->arena_seen);
        free(c);
        return NULL;
    }
    pthread_mutex_init(&c->repair_lock, NULL);
    c->refs = 1;
    pthread_once(&fork_hook_once, install_fork_hook);
    c->epoch = fork_epoch;
    return c;
}

static void ctx_put(ucm_ctx *c)
{
    /* Acq_rel: the last holder sees every other holder's writes before it frees. */
    if (__atomic_sub_fetch(&c->refs, 1, __ATOMIC_ACQ_REL) != 0) return;
    pthread_mutex_destroy(&c->repair_lock);
    free(c->repair_seen);
    free(c->local_pins);
    free(c->local_done);
    free(c->local_serial);
    free(c->arena_seen);
    free(c);
}

/* May this context still change shared words on its rank's behalf (drop pins, fail loads)?
 * Not once the cache closed it, and never in a forked child.  Acquire: pairs with the release
 * store of `closed` in ucm_ctx_close/forget (a drop that starts after it sees it). */
static inline int ctx_live(ucm_ctx *c)
{
    return !__atomic_load_n(&c->closed, __ATOMIC_ACQUIRE) && c->epoch == fork_epoch;
}

void ucm_ctx_close(ucm_ctx *c)
{
    /* close(): first of all, before the rank is freed for another process to take: from here
     * no pin drop or token through this context touches the segment (the rank's holds are
     * removed by free_rank's recovery instead).  Release: pairs with ctx_live's acquire. */
    if (c) __atomic_store_n(&c->closed, 1, __ATOMIC_RELEASE);
}

void ucm_ctx_free(ucm_ctx *c)
{
    /* The cache is done with it; a token that outlives the cache (a handle kept by a
     * traceback, collected later) keeps the memory alive but touches nothing through it.
     * Release: pairs with the token's acquire load of `closed`. */
    if (!c) return;
    __atomic_store_n(&c->closed, 1, __ATOMIC_RELEASE);
    ctx_put(c);
}

void ucm_ctx_forget(ucm_ctx *c)
{
    /* In a forked child (its epoch already says so; this states it for the Python layer too):
     * the parent's rank and pins are not ours.  The copy is never freed (the parent owns the
     * original).  Release: pairs with ctx_live's acquire. */
    if (c) __atomic_store_n(&c->closed, 1, __ATOMIC_RELEASE);
}

void ucm_ctx_set_rank(ucm_ctx *c, int32_t rank)
{
    if (rank < 0 || (uint32_t)rank >= c->l.max_ranks) {
        c->rank = -1;
        c->rank_bit = 0;
        c->stats = c->stats_sink;
        return;
    }
    c->rank = rank;
    c->rank_bit = 1ULL << rank;
    c->stats = W64(c->base, c->l.rank_off + (uint64_t)rank * UCM_RANK_SIZE + UCM_R_STATS);
    /* The hint starts as the arenas the rank owns now (a rank taken over after recovery owns
     * none; a rank of ours re-set keeps what it had); from here only our takes add to it.
     * Relaxed: set before the rank is used by any thread of ours (the caller publishes the
     * context after this), and an owner word moved by another rank only makes a bit stale. */
    uint32_t me = (uint32_t)rank + 1;
    for (uint32_t a = 0; a < c->l.n_arenas; a++)
        if (__atomic_load_n(owner_w(c, a), __ATOMIC_RELAXED) == me) owned_hint_add(c, a);
}

void ucm_stat_add(ucm_ctx *c, int32_t counter, uint64_t n)
{
    /* Relaxed: a counter orders nothing; only this rank (its threads) writes its stats line. */
    if (counter >= 0 && counter < UCM_ST_COUNT) __atomic_fetch_add(&c->stats[counter], n, __ATOMIC_RELAXED);
}
#define STAT(c, i, n) __atomic_fetch_add(&(c)->stats[i], (n), __ATOMIC_RELAXED) /* see ucm_stat_add */

void ucm_observe(ucm_ctx *c, int32_t hist, uint64_t ns)
{
    /* One observation into a histogram of this rank (UCM_HIST_*): its bucket, sum and count.
     * Relaxed, as every counter: a scrape reads each counter exactly, not the three as one. */
    int32_t base = hist == UCM_HIST_LOAD ? UCM_ST_LOAD_HIST : UCM_ST_WAIT_HIST;
    uint32_t k = 0;
    for (uint64_t bound = UCM_HIST_FIRST_NS; k < UCM_HIST_BUCKETS - 1 && ns > bound; k++)
        bound *= UCM_HIST_FACTOR;
    STAT(c, base + (int32_t)k, 1);
    STAT(c, base + UCM_HIST_BUCKETS, ns);      /* _SUM_NS */
    STAT(c, base + UCM_HIST_BUCKETS + 1, 1);   /* _COUNT */
}

/* ---------------------------------------------------------------- slot words */

/* Each table's words through its struct (ucm_core.h), so a word's width is the table's: a
 * pointer of another width here does not compile. */
static inline ucm_header *header(ucm_ctx *c) { return (ucm_header *)c->base; }
static inline ucm_rank_desc *rank_desc(ucm_ctx *c, uint32_t r) { return (ucm_rank_desc *)(c->base + c->l.rank_off + (uint64_t)r * UCM_RANK_SIZE); }
static inline ucm_arena_desc *arena_desc(ucm_ctx *c, uint32_t a) { return (ucm_arena_desc *)(c->base + c->l.arena_off + (uint64_t)a * UCM_ARENA_SIZE); }
static inline ucm_slot_meta *meta(ucm_ctx *c, uint32_t s) { return (ucm_slot_meta *)(c->base + c->l.meta_off + (uint64_t)s * UCM_META_SIZE); }
static inline uint64_t *ref_w(ucm_ctx *c, uint32_t s) { return meta(c, s)->REFERENCE; }
static inline uint64_t *key_w(ucm_ctx *c, uint32_t s) { return meta(c, s)->KEY; }
static inline uint32_t *bucket_w(ucm_ctx *c, uint32_t s) { return meta(c, s)->BUCKET; }
static inline uint32_t *state_w(ucm_ctx *c, uint32_t s) { return meta(c, s)->STATE; }
static inline uint32_t *prev_w(ucm_ctx *c, uint32_t s) { return meta(c, s)->PREV; }
static inline uint32_t *next_w(ucm_ctx *c, uint32_t s) { return meta(c, s)->NEXT; }
static inline uint32_t *gen_w(ucm_ctx *c, uint32_t s) { return meta(c, s)->GENERATION; }
static inline uint32_t *len_w(ucm_ctx *c, uint32_t s) { return meta(c, s)->LENGTH; }
static inline uint32_t *acc_w(ucm_ctx *c, uint32_t s) { return meta(c, s)->ACCESSED; }
static inline uint16_t *loader_w(ucm_ctx *c, uint32_t s) { return meta(c, s)->LOADER; }
static inline uint16_t *flags_w(ucm_ctx *c, uint32_t s) { return meta(c, s)->FLAGS; }
static inline uint32_t *head_w(ucm_ctx *c, uint32_t b) { return W32(c->base, c->l.bucket_off + (uint64_t)b * 4); }
static inline char *stripe_mutex(ucm_ctx *c, uint32_t st) { return c->base + c->l.stripe_off + (uint64_t)st * UCM_LINE; }
static inline uint64_t *rank_hand_w(ucm_ctx *c) { return rank_desc(c, (uint32_t)c->rank)->CLOCK_HAND; }

#define RLX(p) __atomic_load_n((p), __ATOMIC_RELAXED)
#define ACQ(p) __atomic_load_n((p), __ATOMIC_ACQUIRE)
#define SET_RLX(p, v) __atomic_store_n((p), (v), __ATOMIC_RELAXED)
#define SET_REL(p, v) __atomic_store_n((p), (v), __ATOMIC_RELEASE)

static inline void load_key(const char *id, uint64_t offset, uint64_t key[3])
{
    memcpy(&key[0], id, 8); /* the id's bytes as two little-endian words, then the offset */
    memcpy(&key[1], id + 8, 8);
    key[2] = offset;
}

static inline uint32_t bucket_of_key(ucm_ctx *c, const uint64_t *key) { return (uint32_t)ucm_mix(key[0], key[1]) & c->bucket_mask; }

uint32_t ucm_bucket_of(ucm_ctx *c, const char *id, uint64_t offset)
{
    uint64_t key[3];
    load_key(id, offset, key);
    return bucket_of_key(c, key);
}
uint32_t ucm_stripe_of(ucm_ctx *c, uint32_t bucket) { return bucket & c->stripe_mask; }

uint64_t ucm_generation(ucm_ctx *c)
{
    /* Acquire pairs with clear()'s fetch-add: entries published after a clear are stamped with
     * a generation no older than the one we read. */
    return __atomic_load_n(header(c)->GENERATION, __ATOMIC_ACQUIRE);
}

uint32_t ucm_slot_loader(ucm_ctx *c, uint32_t s)
{
    /* The rank loading a slot, for a waiter's liveness check.  Relaxed: a hint read again
     * every slice; a stale value only delays the check by one slice. */
    if (s >= c->l.n_slots) return UCM_NIL;
    return RLX(loader_w(c, s));
}

uint32_t ucm_slot_state(ucm_ctx *c, uint32_t s)
{
    if (s >= c->l.n_slots) return UCM_EMPTY;
    return ACQ(state_w(c, s)) & UCM_STATE_MASK; /* acquire: the owner's release in publish */
}

/* MatchKey (DESIGN 4, read step 1): bucket word first (acquire: pairs with the release store in
 * link_at_head, so seeing our bucket means seeing the key written before it), then generation,
 * then the three key words, then a live state.  Empty and Failed slots match nothing, so a get
 * after a failure elects a new owner. */
static inline int match_key(ucm_ctx *c, uint32_t s, uint32_t b, uint32_t gen, const uint64_t *key)
{
    if (ACQ(bucket_w(c, s)) != b) return 0;
    if (RLX(gen_w(c, s)) != gen) return 0;
    const uint64_t *k = key_w(c, s);
    if (RLX(&k[0]) != key[0] || RLX(&k[1]) != key[1] || RLX(&k[2]) != key[2]) return 0;
    /* Acquire fence: pairs with the release fence in ucm_install between its state store and
     * its key stores.  If we read any rewritten key word, the state we read next is at least
     * that rewrite's Loading, so an in-place rewrite never shows as the old Ready entry. */
    __atomic_thread_fence(__ATOMIC_ACQUIRE);
    uint32_t st = RLX(state_w(c, s)) & UCM_STATE_MASK;
    return st == UCM_LOADING || st == UCM_READY;
}

/* Walk bucket b for key; returns a slot index, UCM_NIL for none, or n_slots for corruption. */
static uint32_t find(ucm_ctx *c, uint32_t b, uint32_t gen, const uint64_t *key, uint64_t limit)
{
    /* Acquire on the head and on each next: pairs with the release stores that linked them. */
    uint32_t s = ACQ(head_w(c, b));
    for (uint64_t steps = 0; s != UCM_NIL; steps++) {
        if (s >= c->l.n_slots) return (uint32_t)c->l.n_slots;
        if (steps >= limit) return UCM_NIL; /* a walker led astray by concurrent moves */
        if (match_key(c, s, b, gen, key)) return s;
        s = ACQ(next_w(c, s));
    }
    return UCM_NIL;
}

/* The process-local lock that makes a slot's local pin count and our shared pin bit change
 * together (DESIGN 5, trap b).  Held for a few instructions, contended only by threads of this
 * process on slots of the same stripe: a spinlock (one atomic to take, a store to drop) costs
 * half of an uncontended pthread mutex on the hit path. */
static inline void local_lock(ucm_ctx *c, uint32_t s)
{
    uint32_t *l = &c->local_locks[s % LOCAL_LOCKS];
    /* Acquire: the count and bit as the previous holder left them are visible to us. */
    while (__atomic_exchange_n(l, 1, __ATOMIC_ACQUIRE)) {
        while (__atomic_load_n(l, __ATOMIC_RELAXED)) sched_yield();
    }
}

static inline void local_unlock(ucm_ctx *c, uint32_t s)
{
    /* Release: our count and bit changes are visible to the next holder. */
    __atomic_store_n(&c->local_locks[s % LOCAL_LOCKS], 0, __ATOMIC_RELEASE);
}

/* Pin (read step 2).  Our process's count and our bit change together under the local lock.
 * Returns UCM_OK, UCM_BUSY (claimed past the budget). */
static int pin(ucm_ctx *c, uint32_t s, uint32_t spin_budget)
{
    for (uint32_t spins = 0;; spins++) {
        local_lock(c, s);
        if (c->local_pins[s] > 0) {
            /* Our bit is set, so no writer can claim the slot: sharing it needs no CAS. */
            c->local_pins[s]++;
            local_unlock(c, s);
            return UCM_OK;
        }
        uint64_t r = RLX(ref_w(c, s));
        if (spins == 0) POINT(c, UCM_PT_BEFORE_PIN_CAS);
        while (!(r & UCM_CLAIMED)) {
            /* Acquire on success pairs with the claimant's release in handover/unclaim and with
             * other pinners' release in ucm_release: the slot's words as they left them are
             * visible before we revalidate (I1: pins start only from a non-claimed value). */
            if (__atomic_compare_exchange_n(ref_w(c, s), &r, r | c->rank_bit, 1, __ATOMIC_ACQUIRE,
                                            __ATOMIC_RELAXED)) {
                c->local_pins[s] = 1;
                local_unlock(c, s);
                return UCM_OK;
            }
        }
        local_unlock(c, s);
        if (spins >= spin_budget) return UCM_BUSY;
        sched_yield();
    }
}

static int unpin(ucm_ctx *c, uint32_t s)
{
    if (__builtin_expect(!ctx_live(c), 0)) return UCM_OK; /* closed, or a forked child's copy */
    local_lock(c, s);
    if (c->local_pins[s] == 0) {
        local_unlock(c, s);
        return UCM_NOT_HELD;
    }
    if (--c->local_pins[s] == 0) {
        /* Release: our reads of the slot happen before a writer's claim (its acquire CAS) lets
         * it rewrite the slot; a release sequence carries it through other pinners' RMWs. */
        __atomic_fetch_and(ref_w(c, s), ~c->rank_bit, __ATOMIC_RELEASE);
    }
    local_unlock(c, s);
    return UCM_OK;
}

static inline void mark_accessed(ucm_ctx *c, uint32_t s)
{
    /* Read first: a hot slot's line is not dirtied by every hit.  Relaxed: CLOCK's bit is a
     * hint; a lost set costs one extra eviction chance, never correctness. */
    if (!RLX(acc_w(c, s))) SET_RLX(acc_w(c, s), 1);
}

/* One whole optimistic/locked lookup: walk, match, pin, revalidate (read steps 1-3). */
static int lookup_pin_one(ucm_ctx *c, const uint64_t *key, uint32_t gen, uint32_t spin_budget,
                          uint32_t *slot_out, uint32_t *state_out)
{
    uint32_t b = bucket_of_key(c, key);
    uint32_t s = find(c, b, gen, key, c->walk_limit);
    if (s == UCM_NIL) return UCM_MISS;
    if (s >= c->l.n_slots) return UCM_CORRUPT;
    POINT(c, UCM_PT_AFTER_MATCH);
    int r = pin(c, s, spin_budget);
    if (r != UCM_OK) return r;
    POINT(c, UCM_PT_AFTER_PIN);
    /* Revalidate under the pin (I3): the slot may have been reclaimed for another key between
     * MatchKey and the CAS; only a match read again now is a hit. */
    if (!match_key(c, s, b, gen, key)) {
        unpin(c, s);
        return UCM_MISS;
    }
    mark_accessed(c, s);
    *slot_out = s;
    /* Acquire: pairs with the owner's release in publish, so a Ready slot's data and length
     * are visible; both stay as they are while we hold the pin (only a claimant rewrites). */
    *state_out = ACQ(state_w(c, s)) & UCM_STATE_MASK;
    return UCM_OK;
}

/* The answer of a pinning step for a pinned slot (see UCM_PIN_* in the header). */
static inline int64_t pin_answer(ucm_ctx *c, uint32_t s, uint32_t state, int owner)
{
    if (state == UCM_READY) {
        uint64_t len = RLX(len_w(c, s)); /* relaxed: ordered by the acquire of the state */
        if (len > c->l.slot_size) len = c->l.slot_size; /* a corrupt length stays in its slot */
        return UCM_PIN_READY | (int64_t)(len << UCM_PIN_LEN_SHIFT) | s;
    }
    return (owner ? UCM_PIN_OWNER : 0) | s;
}

static inline uint64_t ready_len(ucm_ctx *c, uint32_t s)
{
    uint64_t len = RLX(len_w(c, s)); /* relaxed: ordered by the caller's acquire of the state */
    return len > c->l.slot_size ? c->l.slot_size : len;
}

static inline char *slot_bytes(ucm_ctx *c, uint32_t s) { return c->base + c->l.data_off + (uint64_t)s * c->l.slot_stride; }

char *ucm_slot_data(ucm_ctx *c, uint32_t s)
{
    /* For ucmcache/_hit's copies out of a slot it holds pinned; NULL for no slot. */
    return s < c->l.n_slots ? slot_bytes(c, s) : NULL;
}

int64_t ucm_lookup_pin(ucm_ctx *c, const char *id, uint64_t offset, uint32_t spin_budget,
                       ucm_outer outer, uint64_t ticket)
{
    /* One call for the whole read step; the answer is a pin answer (UCM_PIN_*), or -code, so the
     * Python hit path allocates nothing.  What it counts is `outer`'s contract (ucm_outer). */
    uint64_t key[3];
    uint32_t slot = 0, state = 0;
    uint32_t rec = ticket ? inflight_open(c, ticket) : 0;
    load_key(id, offset, key);
    int r = lookup_pin_one(c, key, (uint32_t)ucm_generation(c), spin_budget, &slot, &state);
    if (r == UCM_OK && ticket) inflight[rec].slot = slot;
    if (r == UCM_OK && state == UCM_READY) {
        /* one counter: the hit path's, or a second look's */
        STAT(c, outer == UCM_OUTER_INSIDE ? UCM_ST_HITS : UCM_ST_FAST_HITS, 1);
        return pin_answer(c, slot, state, 0);
    }
    if (outer == UCM_OUTER_HIT_ONLY)
        return r == UCM_OK ? pin_answer(c, slot, state, 0) : -(int64_t)r;
    if (outer == UCM_OUTER_REQUEST) STAT(c, UCM_ST_GETS, 1);
    if (r == UCM_BUSY) STAT(c, UCM_ST_SPINS_EXHAUSTED, 1);
    if (r != UCM_OK) return -(int64_t)r;
    STAT(c, UCM_ST_JOINS, 1);
    return pin_answer(c, slot, state, 0);
}

int ucm_pin_all_ready(ucm_ctx *c, const char *ids, const uint64_t *offsets, uint32_t n,
                      uint32_t spin_budget, uint32_t *slots_out, int64_t *lens_out)
{
    /* The batch hit path (ucmcache/_hit): every key pinned and Ready, or nothing pinned and
     * nothing counted (UCM_MISS, or UCM_CORRUPT): UCM_OUTER_HIT_ONLY's contract for the whole
     * batch, so the caller can take the full path and be counted there.  offsets NULL: every
     * offset 0. */
    uint32_t gen = (uint32_t)ucm_generation(c);
    for (uint32_t i = 0; i < n; i++) {
        uint64_t key[3];
        uint32_t state = 0;
        load_key(ids + 16 * (uint64_t)i, offsets ? offsets[i] : 0, key);
        int r = lookup_pin_one(c, key, gen, spin_budget, &slots_out[i], &state);
        if (r == UCM_OK && state == UCM_READY) {
            lens_out[i] = (int64_t)ready_len(c, slots_out[i]);
            continue;
        }
        if (r == UCM_OK) unpin(c, slots_out[i]);
        for (uint32_t j = 0; j < i; j++) unpin(c, slots_out[j]);
        for (uint32_t j = 0; j < n; j++) slots_out[j] = UCM_NIL;
        return r == UCM_CORRUPT ? UCM_CORRUPT : UCM_MISS;
    }
    STAT(c, UCM_ST_FAST_HITS, n);
    return UCM_OK;
}

int ucm_lookup_pin_many(ucm_ctx *c, const char *ids, const uint64_t *offsets, uint32_t n,
                        uint32_t spin_budget, uint32_t *slots_out, uint8_t *states_out,
                        uint8_t *codes_out, int64_t *lens_out)
{
    /* The batch form: the same step for each key, counted as UCM_OUTER_REQUEST counts it; a
     * position that is not OK holds no pin and its slot is UCM_NIL, so ucm_release_many can
     * take the array as it is. */
    uint32_t gen = (uint32_t)ucm_generation(c);
    uint64_t hits = 0, joins = 0, busy = 0;
    int worst = UCM_OK;
    for (uint32_t i = 0; i < n; i++) {
        uint64_t key[3];
        uint32_t state = 0;
        load_key(ids + 16 * (uint64_t)i, offsets[i], key);
        int r = lookup_pin_one(c, key, gen, spin_budget, &slots_out[i], &state);
        states_out[i] = (uint8_t)state;
        codes_out[i] = (uint8_t)r;
        lens_out[i] = r == UCM_OK && state == UCM_READY ? (int64_t)ready_len(c, slots_out[i]) : -1;
        if (r != UCM_OK) slots_out[i] = UCM_NIL;
        else if (state == UCM_READY) hits++;
        else joins++;
        if (r == UCM_BUSY) busy++;
        if (r == UCM_CORRUPT) worst = UCM_CORRUPT;
        else if (r != UCM_OK && worst == UCM_OK) worst = UCM_MISS;
    }
    STAT(c, UCM_ST_FAST_HITS, hits);
    if (n - hits) STAT(c, UCM_ST_GETS, n - hits);
    if (joins) STAT(c, UCM_ST_JOINS, joins);
    if (busy) STAT(c, UCM_ST_SPINS_EXHAUSTED, busy);
    return worst;
}

/* exist: no pin.  A Ready match read twice around the state is a consistent snapshot; it is a
 * hint by nature (the entry may be evicted right after). */
static int exist_one(ucm_ctx *c, const char *id, uint64_t offset, uint32_t gen)
{
    uint64_t key[3];
    load_key(id, offset, key);
    uint32_t b = bucket_of_key(c, key);
    uint32_t s = find(c, b, gen, key, c->walk_limit);
    if (s >= c->l.n_slots) return 0;
    if ((ACQ(state_w(c, s)) & UCM_STATE_MASK) != UCM_READY) return 0;
    return match_key(c, s, b, gen, key);
}

int ucm_exist1(ucm_ctx *c, const char *id, uint64_t offset)
{
    /* One key, no arrays: a handful of keys costs a call each instead of a batch's setup. */
    STAT(c, UCM_ST_EXIST_KEYS, 1);
    return exist_one(c, id, offset, (uint32_t)ucm_generation(c));
}

int ucm_exist_many(ucm_ctx *c, const char *ids, const uint64_t *offsets, uint32_t n, uint8_t *out)
{
    uint32_t gen = (uint32_t)ucm_generation(c);
    for (uint32_t i = 0; i < n; i++) out[i] = (uint8_t)exist_one(c, ids + 16 * (uint64_t)i, offsets[i], gen);
    STAT(c, UCM_ST_EXIST_KEYS, n);
    return UCM_OK;
}

uint32_t ucm_exist_prefix(ucm_ctx *c, const char *ids, const uint64_t *offsets, uint32_t n)
{
    uint32_t gen = (uint32_t)ucm_generation(c), i = 0;
    while (i < n && exist_one(c, ids + 16 * (uint64_t)i, offsets[i], gen)) i++;
    STAT(c, UCM_ST_EXIST_KEYS, n);
    return i;
}

int ucm_touch_many(ucm_ctx *c, const char *ids, const uint64_t *offsets, uint32_t n)
{
    uint32_t gen = (uint32_t)ucm_generation(c);
    for (uint32_t i = 0; i < n; i++) {
        uint64_t key[3];
        load_key(ids + 16 * (uint64_t)i, offsets[i], key);
        uint32_t s = find(c, bucket_of_key(c, key), gen, key, c->walk_limit);
        if (s < c->l.n_slots) mark_accessed(c, s); /* best effort: no pin, a wrong bit is harmless */
    }
    STAT(c, UCM_ST_TOUCHES, n);
    return UCM_OK;
}

int ucm_release(ucm_ctx *c, uint32_t s)
{
    if (s >= c->l.n_slots) return UCM_CORRUPT;
    return unpin(c, s);
}

/* One more hold on a slot this process pins already, for whatever outlives the holder that
 * pinned it (a buffer exported from a handle's data, a copy running without the GIL): the
 * process-local count only, no shared word (our bit already keeps every writer out, I1).
 * UCM_NOT_HELD when this process holds no pin on it (nothing counted), or when the context may
 * not touch the segment any more (closed, a forked child's copy). */
int ucm_pin_again(ucm_ctx *c, uint32_t s)
{
    if (s >= c->l.n_slots) return UCM_CORRUPT;
    if (!ctx_live(c)) return UCM_NOT_HELD;
    local_lock(c, s);
    int held = c->local_pins[s] > 0;
    if (held) c->local_pins[s]++;
    local_unlock(c, s);
    return held ? UCM_OK : UCM_NOT_HELD;
}

/* ucm_pin_again for a batch's positions (UCM_NIL: no pin, skipped): all of them, or none. */
int ucm_pin_again_many(ucm_ctx *c, const uint32_t *slots, uint32_t n)
{
    for (uint32_t i = 0; i < n; i++) {
        if (slots[i] == UCM_NIL) continue;
        int r = ucm_pin_again(c, slots[i]);
        if (r != UCM_OK) {
            ucm_release_many(c, slots, i);
            return r;
        }
    }
    return UCM_OK;
}

/* One more hold (ucm_pin_again) on every slot this process pins now, their indices into
 * slots_out (n_slots of room); returns how many.  A fork's parent takes them before the fork
 * and drops them (ucm_release_many) once the child has made its copies (ucm_privatize_pins):
 * no pin the child's views rely on can drop meanwhile, in any thread of the parent. */
uint32_t ucm_hold_pins(ucm_ctx *c, uint32_t *slots_out)
{
    uint32_t k = 0;
    if (!ctx_live(c)) return 0;
    for (uint32_t s = 0; s < c->l.n_slots; s++) {
        if (!__atomic_load_n(&c->local_pins[s], __ATOMIC_RELAXED)) continue; /* a hint: */
        local_lock(c, s);                                /* decided under the lock below */
        if (c->local_pins[s] > 0) {
            c->local_pins[s]++;
            slots_out[k++] = s;
        }
        local_unlock(c, s);
    }
    return k;
}

/* A forked child, before any of its Python runs (os.register_at_fork): every slot this
 * process pinned gets a private copy of its pages in the child's mapping, so a view or array
 * the child inherited keeps showing its key's bytes after the parent drops its pin and the
 * slot is reused (the child's copy of the context writes nothing shared: ctx_live).  Pages
 * shared with a neighbouring slot are copied too; the child never reads that mapping through
 * the cache again (it must attach for itself).  Returns the bytes made private, or -errno. */
int64_t ucm_privatize_pins(ucm_ctx *c)
{
    uint64_t page = (uint64_t)sysconf(_SC_PAGESIZE), done = 0;
    uint64_t start = 0, end = 0; /* the run of pages being gathered: [start, end) */
    for (uint32_t s = 0; s <= c->l.n_slots; s++) {
        int last = s == c->l.n_slots;
        uint64_t lo = 0, hi = 0;
        if (!last) {
            if (c->local_pins[s] == 0) continue; /* single-threaded here: no lock needed */
            lo = (c->l.data_off + (uint64_t)s * c->l.slot_stride) / page * page;
            hi = (c->l.data_off + (uint64_t)s * c->l.slot_stride + c->l.slot_size + page - 1) /
                 page * page;
            if (hi > c->map_size) hi = c->map_size;
            if (end > start && lo <= end) { /* overlaps or touches the run: extend it */
                if (hi > end) end = hi;
                continue;
            }
        }
        if (end > start) {
            uint64_t len = end - start;
            char *tmp = malloc(len);
            if (!tmp) return -ENOMEM;
            memcpy(tmp, c->base + start, len);
            void *p = mmap(c->base + start, len, PROT_READ | PROT_WRITE,
                           MAP_FIXED | MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
            if (p == MAP_FAILED) {
                int e = errno;
                free(tmp);
                return -e;
            }
            memcpy(c->base + start, tmp, len);
            free(tmp);
            done += len;
        }
        start = lo;
        end = hi;
    }
    return (int64_t)done;
}

int ucm_release_many(ucm_ctx *c, const uint32_t *slots, uint32_t n)
{
    int worst = UCM_OK;
    for (uint32_t i = 0; i < n; i++) {
        if (slots[i] == UCM_NIL) continue; /* a batch position that holds no pin */
        int r = ucm_release(c, slots[i]);
        if (r != UCM_OK) worst = r;
    }
    return worst;
}

/* A payload's bytes to a caller's buffer.  glibc's memcpy copies large blocks with `rep movsb`,
 * which on this machine (AMD EPYC, ERMS/FSRM) runs at half speed when source and destination
 * differ in alignment mod 64, as a slot (page-aligned) and a numpy row or a bytes object's data
 * (16 or 32 bytes into a line) do: 64 KiB rows took 2x the aligned time.  A loop of 64-byte
 * moves (unaligned vector loads and stores) is not slowed by it (bench/results: the "@al"
 * rows).  Aligned alike, memcpy is as fast or faster. */
/* Before copying several slots out: ask for the first lines of each at once, so their misses
 * overlap instead of each copy starting on one (the hardware prefetcher carries on within a
 * slot).  A hint: no access, no fault.  Measured on 64 random 4 KiB slots: copies 17-19%
 * faster (64 KiB rows: within noise). */
#define PREFETCH_LINES 4
static inline void prefetch_payload(const char *src, uint64_t n)
{
    for (uint64_t o = 0; o < n && o < PREFETCH_LINES * UCM_LINE; o += UCM_LINE)
        __builtin_prefetch(src + o);
}

void ucm_copy_payload(char *dst, const char *src, uint64_t n)
{
    if ((((uintptr_t)dst ^ (uintptr_t)src) & 63) == 0) {
        memcpy(dst, src, n);
        return;
    }
    uint64_t i = 0;
    for (; i + 64 <= n; i += 64) memcpy(dst + i, src + i, 64);
    memcpy(dst + i, src + i, n - i);
}

/* Reads that copy: pin, copy a Ready slot's payload out, release, in one call, so the copy
 * is made while the pin keeps the slot from being reclaimed (I1) and only for a key matched
 * again under the pin (I3).  Nothing is allocated or elected: a missing or Loading key is
 * reported, not loaded.  cffi releases the GIL around these calls, so copies overlap threads. */


/* read_many works in chunks of this many keys: every key of a chunk looked up and pinned
 * first, then every copy, then every release, so the lookups' cache misses (bucket, meta) are
 * not serialized behind 4 KiB copies, and the copies run back to back. */
#define READ_CHUNK 32

/* ucm_read_many when a row may be too small for a payload (row < slot_size): every key pinned
 * before anything is copied, so a payload that does not fit leaves out untouched (the caller
 * raises).  lens_out holds each position's pin meanwhile: -1 none, -2 - slot pinned but not
 * Ready, len << 32 | slot pinned Ready (slot < 2^31 and len <= 2^31 - 1: both fit, >= 0). */
/* A copying read's answer so far, given one key's look: UCM_CORRUPT over UCM_BUSY (a slot
 * that stayed claimed: the caller may recover a dead claimant and read again) over UCM_OK. */
static inline int read_worst(int worst, int r)
{
    if (r == UCM_CORRUPT || worst == UCM_CORRUPT) return UCM_CORRUPT;
    return r == UCM_BUSY ? UCM_BUSY : worst;
}

/* A copying read's counts (ucm_outer: each key a request, a Ready copy in FAST_HITS, anything
 * else in GETS), unless its answer is UCM_BUSY: then the caller counts the answer it settles
 * on (ucm_read_count), after it has recovered a dead claimant and read again or not, so that a
 * read that looks twice counts each key once. */
static inline void read_counted(ucm_ctx *c, int worst, uint64_t hits, uint32_t n)
{
    if (worst == UCM_BUSY) return;
    STAT(c, UCM_ST_FAST_HITS, hits);
    if (n - hits) STAT(c, UCM_ST_GETS, n - hits);
}

void ucm_read_count(ucm_ctx *c, const int64_t *lens, uint32_t n)
{
    /* The counts of a copying read whose answer was UCM_BUSY, as ucm_read_many counts any
     * other answer: each key a request, a copied one (lens[i] >= 0) a hit. */
    uint64_t hits = 0;
    for (uint32_t i = 0; i < n; i++) hits += lens[i] >= 0;
    read_counted(c, UCM_OK, hits, n);
}

static int read_all_pinned(ucm_ctx *c, const char *ids, const uint64_t *offsets, uint32_t n,
                           char *out, uint64_t row, int64_t *lens_out, uint32_t gen)
{
    uint64_t hits = 0;
    int worst = UCM_OK, fits = 1;
    for (uint32_t i = 0; i < n; i++) {
        uint64_t key[3];
        uint32_t slot = 0, state = 0;
        load_key(ids + 16 * (uint64_t)i, offsets ? offsets[i] : 0, key);
        int r = lookup_pin_one(c, key, gen, 64, &slot, &state);
        lens_out[i] = -1;
        worst = read_worst(worst, r);
        if (r != UCM_OK) continue;
        if (state != UCM_READY) {
            lens_out[i] = -2 - (int64_t)slot;
            continue;
        }
        uint64_t len = ready_len(c, slot);
        if (len > row) fits = 0;
        lens_out[i] = (int64_t)(len << 32 | slot);
        hits++;
    }
    /* The pins keep every slot as matched (I1) while its bytes are copied (I3 held). */
    for (uint32_t i = 0; i < n; i++) {
        int64_t v = lens_out[i];
        if (v == -1) continue;
        uint32_t slot = v < 0 ? (uint32_t)(-2 - v) : (uint32_t)(v & 0xffffffffu);
        int64_t len = v < 0 ? -1 : v >> 32;
        if (fits && len >= 0)
            ucm_copy_payload(out + (uint64_t)i * row, slot_bytes(c, slot), (uint64_t)len);
        unpin(c, slot);
        lens_out[i] = len;
    }
    read_counted(c, worst, hits, n);
    return worst;
}

int ucm_read_many(ucm_ctx *c, const char *ids, const uint64_t *offsets, uint32_t n, char *out,
                  uint64_t row, int64_t *lens_out)
{
    /* Row i of out (row bytes) gets key i's payload; lens_out[i] is its length, or -1 when the
     * key is not Ready now (its row untouched).  A payload longer than row is not copied and
     * its true length is reported (> row): the caller raises.  offsets NULL: every offset 0.
     * Answers UCM_OK, UCM_BUSY (some key's slot stayed claimed through the spin: -1 for it; a
     * dead claimant's claim stays until a recovery, which the caller may run and read again:
     * ucm_claimant_dead; nothing counted, see read_counted), or UCM_CORRUPT. */
    uint32_t gen = (uint32_t)ucm_generation(c);
    uint64_t hits = 0;
    int worst = UCM_OK;
    if (row < c->l.slot_size) return read_all_pinned(c, ids, offsets, n, out, row, lens_out, gen);
    for (uint32_t base = 0; base < n; base += READ_CHUNK) {
        uint32_t m = n - base < READ_CHUNK ? n - base : READ_CHUNK;
        uint64_t keys[READ_CHUNK][3];
        uint32_t slots[READ_CHUNK];
        for (uint32_t k = 0; k < m; k++) {
            uint32_t i = base + k;
            load_key(ids + 16 * (uint64_t)i, offsets ? offsets[i] : 0, keys[k]);
            __builtin_prefetch(head_w(c, bucket_of_key(c, keys[k]))); /* a hint, no access */
        }
        for (uint32_t k = 0; k < m; k++) {
            uint32_t i = base + k, state = 0;
            int r = lookup_pin_one(c, keys[k], gen, 64, &slots[k], &state);
            lens_out[i] = -1;
            worst = read_worst(worst, r);
            if (r != UCM_OK) {
                slots[k] = UCM_NIL;
                continue;
            }
            if (state == UCM_READY) {
                lens_out[i] = (int64_t)ready_len(c, slots[k]);
                hits++;
            }
        }
        /* The pins keep every slot as matched (I1) while its bytes are copied (I3 held). */
        for (uint32_t k = 0; k < m; k++)
            if (lens_out[base + k] >= 0)
                prefetch_payload(slot_bytes(c, slots[k]), (uint64_t)lens_out[base + k]);
        for (uint32_t k = 0; k < m; k++) {
            int64_t len = lens_out[base + k];
            if (len >= 0 && (uint64_t)len <= row)
                ucm_copy_payload(out + (uint64_t)(base + k) * row, slot_bytes(c, slots[k]),
                                 (uint64_t)len);
        }
        for (uint32_t k = 0; k < m; k++)
            if (slots[k] != UCM_NIL) unpin(c, slots[k]);
    }
    read_counted(c, worst, hits, n);
    return worst;
}

int ucm_claimant_dead(ucm_ctx *c, const char *ids, const uint64_t *offsets, uint32_t n,
                      int lock_fd, uint64_t life_byte0)
{
    /* After a read answered UCM_BUSY: is some key's slot (found lock-free in the current
     * generation) claimed by a rank, not ours, whose life lock no open file description holds?
     * Such a claim stays until a recovery (crash window `claim_unchecked`), which the caller
     * may run and read again; a live claimant's ends by itself, and a recovery would find
     * nothing.  1 yes, 0 no, -errno the probe failed.  offsets NULL: every offset 0. */
    uint32_t gen = (uint32_t)ucm_generation(c);
    for (uint32_t i = 0; i < n; i++) {
        uint64_t key[3];
        load_key(ids + 16 * (uint64_t)i, offsets ? offsets[i] : 0, key);
        uint32_t s = find(c, bucket_of_key(c, key), gen, key, c->walk_limit);
        if (s >= c->l.n_slots) continue; /* no entry (or a corrupt link: the read said so) */
        /* Relaxed: a hint for whether to recover; the recovery decides under the life lock. */
        uint64_t r = RLX(ref_w(c, s));
        uint64_t who = r & ~UCM_CLAIMED;
        if (!(r & UCM_CLAIMED) || who == (uint64_t)c->rank || who >= c->l.max_ranks) continue;
        int held = ucm_ofd_held_by_other(lock_fd, life_byte0 + who);
        if (held < 0) return held;
        if (!held) return 1;
    }
    return 0;
}

int ucm_gather(ucm_ctx *c, const uint32_t *slots, uint32_t n, char *out, uint64_t row,
               int64_t *lens_out)
{
    /* A batch's pinned slots (UCM_NIL: no pin) into rows, as ucm_read_many; the caller's pins
     * keep every slot as it is during the copy. */
    /* Every length first, then the copies only if every payload fits its row: a row too small
     * for any payload is an error that leaves out untouched. */
    int fits = 1;
    for (uint32_t i = 0; i < n; i++) {
        uint32_t s = slots[i];
        lens_out[i] = -1;
        if (s >= c->l.n_slots) continue;
        prefetch_payload(slot_bytes(c, s), c->l.slot_size);
        /* Acquire: pairs with publish's release exchange (the payload is visible).  A pinned
         * Ready slot stays Ready with this length while the pin lasts (I1). */
        if ((ACQ(state_w(c, s)) & UCM_STATE_MASK) != UCM_READY) continue;
        lens_out[i] = (int64_t)ready_len(c, s);
        if ((uint64_t)lens_out[i] > row) fits = 0;
    }
    if (!fits) return UCM_OK; /* the caller sees a length > row and raises */
    POINT(c, UCM_PT_BEFORE_COPY);
    for (uint32_t i = 0; i < n; i++)
        if (lens_out[i] >= 0)
            ucm_copy_payload(out + (uint64_t)i * row, slot_bytes(c, slots[i]),
                             (uint64_t)lens_out[i]);
    return UCM_OK;
}

/* ---------------------------------------------------------------- accounting (I4) */

#define ACC_GEN_MASK ((1ULL << UCM_ACC_GEN_BITS) - 1)
#define ACC_VAL_MASK ((1ULL << UCM_ACC_VALUE_BITS) - 1)

static inline int gen_older(uint64_t a, uint64_t b)
{
    /* a older than b in the accounting word's wrapping generation space */
    uint64_t d = (b - a) & ACC_GEN_MASK;
    return d != 0 && d < (1ULL << (UCM_ACC_GEN_BITS - 1));
}

static inline uint64_t *acc_word(ucm_ctx *c, uint32_t arena, uint64_t off)
{
    return W64(c->base, c->l.arena_off + (uint64_t)arena * UCM_ARENA_SIZE + off);
}

/* "Check the generation and add" as one CAS on the arena's packed word: counted only if the word
 * is in the slot's generation, or older (no entry of a newer generation counted yet: the word
 * moves forward to the slot's).  A slot of a cleared generation is never counted (I4). */
static int acc_add(ucm_ctx *c, uint32_t arena, uint64_t off, uint32_t slot_gen, uint64_t delta)
{
    uint64_t *w = acc_word(c, arena, off);
    uint64_t sg = slot_gen & ACC_GEN_MASK;
    uint64_t a = __atomic_load_n(w, __ATOMIC_RELAXED); /* a first guess: the CAS below decides */
    for (;;) {
        uint64_t ag = a >> UCM_ACC_VALUE_BITS, nv;
        if (ag == sg) nv = a + delta;
        else if (gen_older(ag, sg)) nv = (sg << UCM_ACC_VALUE_BITS) | delta;
        else return 0; /* the slot's generation was cleared: never counted in a newer one */
        /* seq_cst: the accounting words and the generation word form one total order with
         * clear(), which is what makes size_bytes() exact at every instant. */
        if (__atomic_compare_exchange_n(w, &a, nv, 0, __ATOMIC_SEQ_CST, __ATOMIC_RELAXED)) return 1;
    }
}

static void acc_sub(ucm_ctx *c, uint32_t arena, uint64_t off, uint32_t slot_gen, uint64_t delta)
{
    uint64_t *w = acc_word(c, arena, off);
    uint64_t sg = slot_gen & ACC_GEN_MASK;
    uint64_t a = __atomic_load_n(w, __ATOMIC_RELAXED); /* a first guess: the CAS below decides */
    for (;;) {
        if ((a >> UCM_ACC_VALUE_BITS) != sg) return; /* counted in a generation since cleared */
        uint64_t v = a & ACC_VAL_MASK;
        uint64_t nv = (a & ~ACC_VAL_MASK) | (v >= delta ? v - delta : 0);
        /* seq_cst: see acc_add. */
        if (__atomic_compare_exchange_n(w, &a, nv, 0, __ATOMIC_SEQ_CST, __ATOMIC_RELAXED)) return;
    }
}

uint64_t ucm_acc_value(ucm_ctx *c, uint64_t off)
{
    /* The sum of every arena's word that is in the current generation (a word of an older one
     * counts 0).  Each word is exact; the sum is of words read one after another, so with
     * publishes running in other ranks it is a value the cache had at some instant of the
     * call only per arena, not as a whole.  seq_cst loads: see acc_add. */
    if (off != UCM_A_ACC_ENTRIES && off != UCM_A_ACC_BYTES) return 0;
    uint64_t g = __atomic_load_n(header(c)->GENERATION, __ATOMIC_SEQ_CST) & ACC_GEN_MASK;
    uint64_t sum = 0;
    for (uint32_t r = 0; r < c->l.n_arenas; r++) {
        uint64_t a = __atomic_load_n(acc_word(c, r, off), __ATOMIC_SEQ_CST);
        if ((a >> UCM_ACC_VALUE_BITS) == g) sum += a & ACC_VAL_MASK;
    }
    return sum;
}

uint64_t ucm_clear(ucm_ctx *c)
{
    /* seq_cst: one total order with the publishers' acc_add CASes (I4): an add ordered before
     * this lands in the old generation's words, one after it sees the new generation. */
    uint64_t g = __atomic_add_fetch(header(c)->GENERATION, 1, __ATOMIC_SEQ_CST);
    /* Move every arena's words on to the new generation (value 0), so no word ever lags more
     * than a clear behind and the wrapping generation compare in acc_add stays exact.  A word
     * a publisher already moved forward is left alone. */
    uint64_t ng = g & ACC_GEN_MASK;
    for (uint32_t r = 0; r < c->l.n_arenas; r++) {
        uint64_t offs[2] = {UCM_A_ACC_ENTRIES, UCM_A_ACC_BYTES};
        for (int i = 0; i < 2; i++) {
            uint64_t *w = acc_word(c, r, offs[i]);
            uint64_t a = __atomic_load_n(w, __ATOMIC_RELAXED); /* a first guess: the CAS below decides */
            /* seq_cst: see acc_add. */
            while (gen_older(a >> UCM_ACC_VALUE_BITS, ng) &&
                   !__atomic_compare_exchange_n(w, &a, ng << UCM_ACC_VALUE_BITS, 0, __ATOMIC_SEQ_CST,
                                                __ATOMIC_RELAXED)) {
            }
        }
    }
    STAT(c, UCM_ST_CLEARS, 1);
    return g;
}

/* ---------------------------------------------------------------- arenas

   The slot space is cut into n_arenas arenas.  A rank allocates only in arenas it owns (owner
   word = rank + 1) and has verified; ownership moves by CAS on the owner word: a free arena is
   taken, a live or dead rank's arena is taken from it (policy: the Python layer, _arenas.py),
   and recovery frees a dead rank's arenas.  The arena's accounting words have one writer at a
   time (I6): the rank whose install or load in it is in flight, else its verified owner.

   - A claim in arena a is real only if, after the claim CAS, the owner word still names the
     claimant and its process did not take the arena again meanwhile (arena_seen unchanged).
     Both are seq_cst and so is the taker's owner CAS and its verification's reference loads
     (Dekker): either the claimant sees the new owner and gives its claim back untouched, or
     the new owner's verification sees the claim.  A real claim is marked UCM_F_INSTALLING
     before anything is written; a claim without it changed nothing (recovery only unclaims).
   - A new owner writes nothing in an arena before verifying it: no slot claimed by another
     rank, none Loading for another rank (a previous owner's install or load still in flight:
     it still writes the words, at publish).  Verification is per take (arena_seen's serial,
     bumped by the take before its CAS), repeated at each pass of the CLOCK hand until clean.
   - So recovery of a dead rank recounts exactly the arenas where it was the writer (it holds
     an INSTALLING claim or a Loading slot there: nobody else can be writing them), before it
     releases those holds (after which a new owner may verify and write), and frees the
     arenas it owned. */

static inline uint32_t arena_of(ucm_ctx *c, uint32_t s) { return (uint32_t)(s / c->l.arena_slots); }
static inline uint32_t *owner_w(ucm_ctx *c, uint32_t a) { return arena_desc(c, a)->OWNER; }
static inline uint64_t arena_end(ucm_ctx *c, uint32_t a)
{
    uint64_t e = ((uint64_t)a + 1) * c->l.arena_slots;
    return e < c->l.n_slots ? e : c->l.n_slots;
}

/* Does `rank` write slot s's arena words through this slot (an install past its ownership
 * check, or a load it owns)?  Acquire: the holder's words before its claim or handover. */
static int writes_through(ucm_ctx *c, uint32_t s, uint32_t rank)
{
    uint64_t r = ACQ(ref_w(c, s));
    uint32_t st = ACQ(state_w(c, s)) & UCM_STATE_MASK;
    /* A delete in flight: only its deleter's (the loader word names it), never a pinner's.
     * Acquire on the flags: pairs with the deleter's seq_cst mark store, which follows its
     * store of the loader word; a mark read here comes with its deleter's rank, never the
     * loader word from before (on a weakly ordered CPU two relaxed loads could give a live
     * deleter's mark with a dead loader's rank).  The loader word itself relaxed: ordered by
     * that acquire. */
    uint16_t f = ACQ(flags_w(c, s));
    /* Only a checked mark: a deleter that died before its owner check changed nothing, and a
     * taker that took the arena before the mark may be its verified writer now (I6). */
    if ((f & UCM_F_DELETING) && (f & UCM_F_DELETE_CHECKED) && RLX(loader_w(c, s)) == rank)
        return 1;
    if (r == (UCM_CLAIMED | rank)) return (RLX(flags_w(c, s)) & UCM_F_INSTALLING) || st == UCM_LOADING;
    return !(r & UCM_CLAIMED) && (r & (1ULL << rank)) && st == UCM_LOADING && RLX(loader_w(c, s)) == rank;
}

int ucm_recount_arena(ucm_ctx *c, uint32_t a, uint64_t *entries_out, uint64_t *bytes_out)
{
    /* Set an arena's words from its slots.  Exact only when nobody else writes them: called by
     * recovery for an arena the dead rank (its life lock held by the caller) was the writer of
     * (I6).  A slot counts when it is Ready, counted and of the current generation and not
     * claimed by an installer (whose uncount may or may not have happened: recovery empties
     * it).  A claim without INSTALLING changed nothing: its slot counts as it stands. */
    if (a >= c->l.n_arenas) return UCM_CORRUPT;
    uint64_t g = ucm_generation(c);
    uint64_t entries = 0, bytes = 0;
    for (uint64_t i = (uint64_t)a * c->l.arena_slots; i < arena_end(c, a); i++) {
        uint32_t s = (uint32_t)i;
        /* Acquire: the writer died (its last writes visible through the life lock the kernel
         * handed us) or is not writing; pairs with claimants' and publishers' releases. */
        if ((ACQ(ref_w(c, s)) & UCM_CLAIMED) && (RLX(flags_w(c, s)) & UCM_F_INSTALLING)) continue;
        if ((ACQ(state_w(c, s)) & UCM_STATE_MASK) == UCM_READY && (RLX(flags_w(c, s)) & UCM_F_COUNTED)
            && RLX(gen_w(c, s)) == (uint32_t)g) {
            entries++;
            bytes += RLX(len_w(c, s));
        }
    }
    uint64_t tag = (g & ACC_GEN_MASK) << UCM_ACC_VALUE_BITS;
    /* seq_cst: see acc_add; a clear() racing this leaves a word of an older generation (0). */
    __atomic_store_n(acc_word(c, a, UCM_A_ACC_ENTRIES), tag | (entries & ACC_VAL_MASK), __ATOMIC_SEQ_CST);
    __atomic_store_n(acc_word(c, a, UCM_A_ACC_BYTES), tag | (bytes & ACC_VAL_MASK), __ATOMIC_SEQ_CST);
    *entries_out = entries;
    *bytes_out = bytes;
    return UCM_OK;
}

int ucm_arena_take(ucm_ctx *c, uint32_t a, uint32_t expected)
{
    /* Make our rank the owner of arena a if its owner word still says `expected` (0 free, or
     * rank + 1 of the rank we take it from).  UCM_OK: ours, to be verified before any write;
     * UCM_BUSY: the word changed. */
    if (c->rank < 0 || !ctx_live(c)) return UCM_NOT_HELD;
    if (a >= c->l.n_arenas) return UCM_CORRUPT;
    uint32_t me = (uint32_t)c->rank + 1;
    /* Already ours (ours without a break since our last take, which bumped the serial): keep
     * its serial, so our claimants there are not sent back for nothing.  seq_cst: as the CAS
     * below. */
    if (__atomic_load_n(owner_w(c, a), __ATOMIC_SEQ_CST) == me) return UCM_OK;
    /* A new serial, unverified, before the CAS (seq_cst, as the CAS): a claimant of ours that
     * sees our CAS's owner word also sees the serial moved (see "Arenas").  The relaxed load
     * is a first guess for the CAS loop, which decides. */
    uint32_t v = __atomic_load_n(&c->arena_seen[a], __ATOMIC_RELAXED);
    while (!__atomic_compare_exchange_n(&c->arena_seen[a], &v, ((v >> 1) + 1) << 1, 0,
                                        __ATOMIC_SEQ_CST, __ATOMIC_RELAXED)) {
    }
    /* seq_cst: the Dekker pair with a claimant's claim CAS and owner load. */
    if (!__atomic_compare_exchange_n(owner_w(c, a), &expected, me, 0, __ATOMIC_SEQ_CST,
                                     __ATOMIC_RELAXED))
        return UCM_BUSY;
    /* The hint's bit after the CAS (see owned_hint_drop for why after): from here a free-first
     * look of ours walks the arena. */
    owned_hint_add(c, a);
    frees_bump(c);
    return UCM_OK;
}

int ucm_arena_release(ucm_ctx *c, uint32_t a)
{
    /* Give arena a up (free), if we own it: done only for an arena another rank's install or
     * load keeps us from verifying, so that its writer's rank can take it back at once.  Safe
     * with installs or loads of ours still in flight there: we stay their words' writer until
     * they end, and a new owner verifies before it writes. */
    if (c->rank < 0 || !ctx_live(c)) return UCM_NOT_HELD;
    if (a >= c->l.n_arenas) return UCM_CORRUPT;
    uint32_t me = (uint32_t)c->rank + 1;
    /* seq_cst: as a take (a claimant of ours checks the owner word after its claim). */
    return __atomic_compare_exchange_n(owner_w(c, a), &me, 0, 0, __ATOMIC_SEQ_CST,
                                       __ATOMIC_RELAXED) ? UCM_OK : UCM_NOT_HELD;
}

/* Does slot s hold another rank's install or load (what keeps us from verifying its arena)? */
static inline int foreign_activity(ucm_ctx *c, uint32_t s, uint64_t ref)
{
    if ((ref & UCM_CLAIMED) && (ref & ~UCM_CLAIMED) != (uint64_t)c->rank) return 1;
    /* Another rank's delete in flight (it writes the words: ucm_delete).  seq_cst: the Dekker
     * pair with the deleter's seq_cst DELETING store and owner load, as the reference load is
     * for a claim; its deleter (the loader word) was stored before the flag, so it is seen. */
    if ((__atomic_load_n(flags_w(c, s), __ATOMIC_SEQ_CST) & UCM_F_DELETING)
        && RLX(loader_w(c, s)) != c->rank)
        return 1;
    /* Acquire: a publish's release exchange (its words are written before it). */
    return (ACQ(state_w(c, s)) & UCM_STATE_MASK) == UCM_LOADING && RLX(loader_w(c, s)) != c->rank;
}

uint32_t ucm_arena_foreign(ucm_ctx *c, uint32_t *out)
{
    /* For the balancing policy: per arena, how many of its slots hold another rank's install or
     * load now (an arena we could not verify yet).  A hint: relaxed references. */
    for (uint32_t a = 0; a < c->l.n_arenas; a++) {
        uint32_t n = 0;
        for (uint64_t i = (uint64_t)a * c->l.arena_slots; i < arena_end(c, a); i++)
            n += (uint32_t)foreign_activity(c, (uint32_t)i, RLX(ref_w(c, (uint32_t)i)));
        out[a] = n;
    }
    return (uint32_t)c->l.n_arenas;
}

void ucm_arena_epoch_seen(ucm_ctx *c, uint64_t epoch)
{
    /* The policy looked at our share in this epoch (threads of ours may race here: any of
     * their values makes the next slow path look again or not, both fine).  Relaxed: a hint. */
    __atomic_store_n(&c->epoch_seen, epoch, __ATOMIC_RELAXED);
}

uint32_t ucm_arena_owners(ucm_ctx *c, uint32_t *out)
{
    /* Every arena's owner word (a snapshot for the balancing policy and for inspection).
     * Acquire: cheap here, and a reader that acts on an owner sees what its taker wrote. */
    for (uint32_t a = 0; a < c->l.n_arenas; a++) out[a] = ACQ(owner_w(c, a));
    return (uint32_t)c->l.n_arenas;
}

/* May we allocate in arena a?  Owned by us and verified under the current take; verifies it
 * now if not.  *seen_out: the arena_seen value the claimant must find unchanged. */
static int arena_usable(ucm_ctx *c, uint32_t a, uint32_t *seen_out)
{
    uint32_t me = (uint32_t)c->rank + 1;
    /* Relaxed: a hint for skipping; the seq_cst load after a claim decides. */
    if (RLX(owner_w(c, a)) != me) return 0;
    /* seq_cst: read before our owner check below, so a re-take by another thread of ours
     * (serial bump, then CAS) is not half seen. */
    uint32_t v = __atomic_load_n(&c->arena_seen[a], __ATOMIC_SEQ_CST);
    if (!(v & 1)) {
        /* seq_cst: after our take's CAS in the total order, so a claim that our owner word
         * did not stop is seen below. */
        if (__atomic_load_n(owner_w(c, a), __ATOMIC_SEQ_CST) != me) return 0;
        for (uint64_t i = (uint64_t)a * c->l.arena_slots; i < arena_end(c, a); i++) {
            uint32_t s = (uint32_t)i;
            uint64_t r = __atomic_load_n(ref_w(c, s), __ATOMIC_SEQ_CST); /* Dekker, as above */
            if (foreign_activity(c, s, r)) return 0;
        }
        /* Another thread of ours may have taken it again meanwhile: then its serial wins. */
        if (!__atomic_compare_exchange_n(&c->arena_seen[a], &v, v | 1, 0, __ATOMIC_SEQ_CST,
                                         __ATOMIC_RELAXED))
            return 0;
        v |= 1;
    }
    *seen_out = v;
    return 1;
}

int ucm_arena_usable(ucm_ctx *c, uint32_t a)
{
    /* 1 if our rank may allocate in arena a now (verifying it if needed), else 0. */
    uint32_t seen;
    if (c->rank < 0 || a >= c->l.n_arenas) return 0;
    return arena_usable(c, a, &seen);
}

/* ---------------------------------------------------------------- write path

   Write steps 1-2, the claim: a victim slot in an arena we may allocate in, claimed by CAS
   from 0, then the ownership check ("Arenas").  In three phases, so that no live entry is
   evicted while the rank can have a free slot (DESIGN 4.12, "The CLOCK's order"):
     1. free first (claim_free): from our hand, a slot that is unheld and holds no live entry
        (Empty, Failed, deleted, or of a cleared generation), skipping whole every arena whose
        accounting words count all its slots as live entries;
     2. the policy first (policy_looked): none free in ours, and the policy (_arenas.py) has
        not looked since the arena epoch or the generation moved: UCM_ROOM, and it takes our
        share from ranks above theirs, or an arena not ours with room, or says there is none
        (ucm_arena_room_gone), before we evict;
     3. CLOCK (claim_clock): the hand's two sweeps among live entries, as always. */

/* Ready entries of the current generation `g` that arena a's words count (a word of an older
 * generation counts none).  Relaxed: a hint for skipping; the claim and its checks decide,
 * and a stale count costs at most one look too many or one eviction beside a slot freed that
 * instant. */
static inline uint64_t arena_entries(ucm_ctx *c, uint32_t a, uint64_t g)
{
    uint64_t w = __atomic_load_n(acc_word(c, a, UCM_A_ACC_ENTRIES), __ATOMIC_RELAXED);
    return (w >> UCM_ACC_VALUE_BITS) == (g & ACC_GEN_MASK) ? (w & ACC_VAL_MASK) : 0;
}

static inline uint64_t arena_size(ucm_ctx *c, uint32_t a) { return arena_end(c, a) - (uint64_t)a * c->l.arena_slots; }

/* A live entry: Ready, counted, of generation g (what an install over it counts as an
 * eviction).  Relaxed: a hint read before the claim, read again after it (claim_free). */
static inline int live_entry(ucm_ctx *c, uint32_t s, uint32_t g)
{
    return (RLX(state_w(c, s)) & UCM_STATE_MASK) == UCM_READY && RLX(gen_w(c, s)) == g
        && (RLX(flags_w(c, s)) & UCM_F_COUNTED);
}

/* Claim slot s (read unheld: r) of arena a, usable under serial `seen`: the CAS, then the
 * ownership check.  1: claimed and ours to write; 0: the CAS lost (someone pinned or claimed
 * it); -1: the arena was taken from us, the claim given back untouched. */
static int claim_checked(ucm_ctx *c, uint32_t s, uint32_t a, uint32_t seen, uint64_t r)
{
    uint32_t me = (uint32_t)c->rank + 1;
    /* seq_cst: acquire pairs with the last pinner's release (its reads of the old contents
     * are done before we rewrite them, I1); seq_cst with the owner load below and a
     * taker's owner CAS is the Dekker pair of "Arenas". */
    if (!__atomic_compare_exchange_n(ref_w(c, s), &r, UCM_CLAIMED | (uint64_t)c->rank, 0,
                                     __ATOMIC_SEQ_CST, __ATOMIC_RELAXED))
        return 0;
    POINT(c, UCM_PT_CLAIM_UNCHECKED);
    if (__atomic_load_n(owner_w(c, a), __ATOMIC_SEQ_CST) != me
        || __atomic_load_n(&c->arena_seen[a], __ATOMIC_SEQ_CST) != seen) {
        SET_REL(ref_w(c, s), 0); /* taken from us: nothing written, give it back (release) */
        return -1;
    }
    return 1;
}

/* The claim passed its check: mark it ours to install (recovery recounts for an INSTALLING
 * claim, I6), move the hand past it. */
static int claim_done(ucm_ctx *c, uint32_t s, uint64_t *handp, uint64_t hand, uint32_t *slot_out)
{
    /* Relaxed: read by recovery after our death (through the life lock) or by ourselves. */
    SET_RLX(flags_w(c, s), RLX(flags_w(c, s)) | UCM_F_INSTALLING);
    SET_RLX(handp, hand);
    *slot_out = s;
    POINT(c, UCM_PT_AFTER_CLAIM);
    return UCM_OK;
}

/* Phase 1: a free slot in our usable arenas, from the hand on, one revolution at most: the
 * hand's arena from the hand, every other arena whole, the hand's arena's start last.  Only
 * the arenas in our owned hint are visited; one is looked into only if it is ours and its words
 * count fewer entries than slots (both relaxed hints, so a full cache costs a load or two per
 * arena of ours here), then verified.  *owned_out: how many arenas of ours the walk saw, for
 * policy_looked (one walk serves both); *full_out: 1 if the walk found every arena of ours
 * verified and full by its words (what full_mark records), else 0. */
static int claim_free(ucm_ctx *c, uint64_t max_scan, uint32_t *slot_out, uint32_t *owned_out,
                      int *full_out)
{
    uint64_t *handp = rank_hand_w(c);
    /* Relaxed: only this rank's threads move its hand (see claim_clock). */
    uint64_t hand = RLX(handp) % c->l.n_slots;
    uint64_t g = ucm_generation(c);
    uint32_t me = (uint32_t)c->rank + 1, na = (uint32_t)c->l.n_arenas, owned = 0;
    uint32_t a0 = (uint32_t)(hand / c->l.arena_slots);
    uint64_t examined = 0;
    int full = 1;
    *full_out = 0; /* a walk that returns a slot found room: no mark */
    /* Two passes over the hint's bits: [a0, na) with a0 from the hand, then [0, a0] with a0's
     * start before the hand (pass 1 counts no arena twice: a0 is counted in pass 0). */
    for (int pass = 0; pass < 2; pass++) {
        uint32_t from = pass ? 0 : a0, to = pass ? a0 + 1 : na;
        for (uint32_t w = from >> 6; w <= (to - 1) >> 6; w++) {
            /* Relaxed: see owned_hint. */
            uint64_t bits = __atomic_load_n(&c->owned_hint[w], __ATOMIC_RELAXED);
            if (w == from >> 6) bits &= ~0ULL << (from & 63);
            if (w == (to - 1) >> 6 && ((to - 1) & 63) != 63) bits &= (2ULL << ((to - 1) & 63)) - 1;
            for (; bits; bits &= bits - 1) {
                uint32_t a = w * 64 + (uint32_t)__builtin_ctzll(bits), seen = 0;
                /* Relaxed: hints for skipping; arena_usable and the claim's check decide. */
                if (RLX(owner_w(c, a)) != me) {
                    owned_hint_drop(c, a, me);
                    continue;
                }
                owned += !(pass && a == a0);
                /* Full by its words counts for the mark only once verified: no other rank's
                 * install, load or delete left in it that could still free a slot (I6).  The
                 * verified bit BEFORE the words, acquire: it pairs with our verification's
                 * seq_cst CAS, whose loads read the last foreign writer's release (a
                 * deleter's mark cleared, a recovery's unclaim) made after that writer's
                 * uncount; so words read after a verified bit count that uncount (read the
                 * other way round, a look could pair words from before a foreign uncount with
                 * a verification after it).  A take of ours clears the bit before its CAS and
                 * bumps frees after, so a mark recorded on a stale bit is stale itself. */
                uint32_t verified = __atomic_load_n(&c->arena_seen[a], __ATOMIC_ACQUIRE) & 1;
                if (!verified) POINT(c, UCM_PT_FREE_LOOK);
                if (arena_entries(c, a, g) >= arena_size(c, a)) {
                    full &= (int)verified;
                    continue;
                }
                full = 0;
                if (examined >= max_scan || !arena_usable(c, a, &seen)) continue;
                uint64_t lo = (uint64_t)a * c->l.arena_slots, hi = arena_end(c, a);
                if (a == a0) {
                    if (pass == 0) lo = hand; /* the hand's arena: from the hand on ... */
                    else hi = hand;           /* ... and its start, last */
                }
                for (uint64_t pos = lo; pos < hi && examined < max_scan; pos++) {
                    uint32_t s = (uint32_t)pos;
                    examined++;
                    uint64_t r = RLX(ref_w(c, s));
                    if (r != 0 || live_entry(c, s, (uint32_t)g)) continue; /* held, or a live entry */
                    int got = claim_checked(c, s, a, seen, r);
                    if (got < 0) break; /* the arena was taken from us */
                    if (got == 0) continue;
                    /* Read again under the claim (its acquire CAS ordered the last writer's
                     * words before us): another thread of ours may have installed and
                     * published here since our look.  Nothing is written yet, so it is given
                     * back as an unpassed claim is. */
                    if (live_entry(c, s, (uint32_t)g)) {
                        SET_REL(ref_w(c, s), 0); /* release: pairs with the next claimant's acquire CAS */
                        continue;
                    }
                    return claim_done(c, s, handp, pos + 1, slot_out);
                }
            }
        }
    }
    *owned_out = owned;
    *full_out = full;
    return UCM_FULL;
}

/* The mark full_mark is compared with: the arena epoch (a recovery's recount, a release),
 * the generation (a clear() frees every slot) and our frees count, packed into 63 bits (15,
 * 20, 28).  Every walk rewrites full_mark (its mark, or none), so to alias, one of them would
 * have to move by exactly 2^15, 2^20 or 2^28 between two claims of ours that skip the walk.  Acquire: pairs with the release of each (the epoch's and the generation's
 * seq_cst bumps, frees_bump), so a walk after this read sees the words of the step it names. */
static inline uint64_t full_mark_now(ucm_ctx *c)
{
    uint64_t f = __atomic_load_n(&c->frees, __ATOMIC_ACQUIRE);
    uint64_t e = ACQ(header(c)->ARENA_EPOCH), g = ACQ(header(c)->GENERATION);
    return (e & 0x7fffu) << 48 | (g & 0xfffffu) << 28 | (f & 0xfffffffu);
}

/* room_gone's value: an arena epoch, a generation (its low 20 bits, as the accounting words
 * carry it) and how many arenas we owned, in one word so that threads of ours racing on it
 * never mix two marks (UINT64_MAX never: 2^32 epochs; n_arenas <= 63 * 8 fits ROOM_OWNED). */
#define ROOM_OWNED 0xfffu
_Static_assert(UCM_MAX_RANKS * UCM_ARENAS_PER_RANK < ROOM_OWNED, "an arena count fits");
static inline uint64_t room_mark(uint64_t epoch, uint64_t g)
{
    return epoch << 32 | (g & 0xfffffu) << 12;
}

/* How many arenas our rank owns now (those of the owned hint whose owner word says us).
 * Relaxed: a hint, the policy's take decides. */
static uint32_t arenas_owned(ucm_ctx *c)
{
    uint32_t me = (uint32_t)c->rank + 1, owned = 0, words = (uint32_t)(c->l.n_arenas + 63) / 64;
    for (uint32_t w = 0; w < words; w++)
        for (uint64_t bits = RLX(&c->owned_hint[w]); bits; bits &= bits - 1)
            owned += RLX(owner_w(c, w * 64 + (uint32_t)__builtin_ctzll(bits))) == me;
    return owned;
}

static inline void mark_room_gone(ucm_ctx *c, uint64_t mark, uint32_t owned)
{
    /* Relaxed: see policy_looked. */
    __atomic_store_n(&c->room_gone, (mark & ~(uint64_t)ROOM_OWNED)
                     | (owned < ROOM_OWNED ? owned : ROOM_OWNED), __ATOMIC_RELAXED);
}

/* Phase 2: has the policy looked, since the arena epoch or the generation last moved, at what
 * we could obtain before evicting (our share, room in arenas not ours), and found nothing to
 * take (ucm_arena_room_gone_at), and do we own as many arenas as it saw?  If not, it looks
 * first (UCM_ROOM), unless every arena is ours already.  A rank whose room look takes one of
 * our arenas moves no epoch: our count tells us, and our look takes our share back from its
 * surplus before we evict, not before we need it. */
static int policy_looked(ucm_ctx *c, uint32_t owned)
{
    /* Relaxed: the epoch and the generation are hints here (a move only makes the policy look
     * again); room_gone is a process-local hint that threads of ours may race on, any of
     * their values safe (one look too many, or one eviction in a move's instant). */
    uint64_t mark = room_mark(RLX(header(c)->ARENA_EPOCH), RLX(header(c)->GENERATION));
    if (owned == c->l.n_arenas) { /* every arena ours (one rank attached, say): nothing to take */
        mark_room_gone(c, mark, owned);
        return 1;
    }
    uint64_t gone = __atomic_load_n(&c->room_gone, __ATOMIC_RELAXED);
    return gone != UINT64_MAX && (gone & ~(uint64_t)ROOM_OWNED) == mark
        && owned >= (gone & ROOM_OWNED);
}

uint64_t ucm_arena_room_mark(ucm_ctx *c)
{
    /* The arena epoch and the generation now, as one mark, read by the policy before it looks
     * (ucm_arena_room_gone_at).  Acquire: pairs with the seq_cst bump of either word (an epoch
     * bump after the take or release it announces, clear()'s add), so a mark that names a
     * move is followed by a look that sees what came before that move. */
    return room_mark(ACQ(header(c)->ARENA_EPOCH), ACQ(header(c)->GENERATION));
}

void ucm_arena_room_gone_at(ucm_ctx *c, uint64_t mark, uint32_t owned)
{
    /* The policy looked, under `mark` (ucm_arena_room_mark, read before its look) with
     * `owned` arenas ours (its snapshot), for our share and for room in arenas not ours, and
     * could take none: evict (CLOCK) without asking again while the epoch and the generation
     * are those and we own no fewer arenas.  If either moved during the look (an attach, a
     * clear()), the mark is already stale: the next claim asks again rather than taking a
     * pair nobody looked under as looked at. */
    mark_room_gone(c, mark, owned);
}

void ucm_arena_room_gone(ucm_ctx *c)
{
    /* As ucm_arena_room_gone_at under the pair and the arenas now: for a caller that stops
     * asking whatever it looked at (an allocation past MAX_ROOMS looks). */
    mark_room_gone(c, ucm_arena_room_mark(c), arenas_owned(c));
}

uint32_t ucm_arena_entries(ucm_ctx *c, uint32_t *out)
{
    /* For the policy: per arena, the entries its words count in the current generation (a
     * hint: relaxed, see arena_entries). */
    uint64_t g = ucm_generation(c);
    for (uint32_t a = 0; a < c->l.n_arenas; a++) {
        /* A corrupt count above the arena's size says full (as claim_free reads it), never a
         * count cut to 32 bits that would say room. */
        uint64_t e = arena_entries(c, a, g), size = arena_size(c, a);
        out[a] = (uint32_t)(e < size ? e : size);
    }
    return (uint32_t)c->l.n_arenas;
}

/* Phase 3: the rank's CLOCK hand over the arenas it may allocate in (others' are skipped an
 * arena at a time), examining at most max_scan slots. */
static int claim_clock(ucm_ctx *c, uint64_t max_scan, uint32_t *slot_out)
{
    uint64_t n = c->l.n_slots;
    uint64_t *handp = rank_hand_w(c);
    /* Relaxed: only this rank's threads move its hand; two of them allocating under different
     * stripes may lose an update, which only shifts where the next scan starts. */
    uint64_t hand = RLX(handp) % n;
    uint32_t gen = (uint32_t)ucm_generation(c);
    uint32_t cur = UCM_NIL, seen = 0;
    int usable = 0;
    /* Two sweeps: the first clears accessed bits, the second takes the first unheld slot. */
    for (uint64_t travelled = 0, examined = 0; travelled <= 2 * n && examined < max_scan;) {
        uint64_t pos = (hand + travelled) % n;
        uint32_t a = (uint32_t)(pos / c->l.arena_slots);
        if (a != cur) {
            cur = a;
            usable = arena_usable(c, a, &seen);
        }
        if (!usable) {
            travelled += arena_end(c, a) - pos;
            continue;
        }
        uint32_t s = (uint32_t)pos;
        travelled++;
        examined++;
        uint64_t r = RLX(ref_w(c, s));
        if (r != 0) continue; /* pinned or claimed: not ours to take */
        uint32_t st = RLX(state_w(c, s)) & UCM_STATE_MASK;
        int live = st == UCM_READY && RLX(gen_w(c, s)) == gen;
        if (live && travelled <= n && RLX(acc_w(c, s))) { /* after one full sweep: no second chances */
            SET_RLX(acc_w(c, s), 0); /* second chance; relaxed: a hint, as in mark_accessed */
            continue;
        }
        int k = claim_checked(c, s, a, seen, r);
        if (k < 0) usable = 0;
        if (k <= 0) continue;
        return claim_done(c, s, handp, hand + travelled, slot_out);
    }
    return UCM_FULL;
}

int ucm_clock_claim(ucm_ctx *c, uint64_t max_scan, uint32_t *slot_out)
{
    /* Write steps 1-2, the three phases above: UCM_OK (*slot_out claimed, checked, marked
     * INSTALLING), UCM_ROOM (nothing free in our arenas, and the policy has not looked since
     * the epoch or the generation moved: it looks first), UCM_FULL (nothing claimable in our
     * arenas). */
    if (c->rank < 0) return UCM_NOT_HELD;
    /* Phase 1 is skipped while nothing could have made room since a look that found every
     * arena of ours full and verified (full_mark): a slot of ours is freed only by a step of
     * ours (I6: we are our arenas' writer; a deleter of another rank takes the arena first),
     * which bumps frees, or by a recovery or a clear(), which move the epoch or the generation.
     * Relaxed: threads of ours may race on the mark, any of their values honest (each was the
     * mark of a walk that found it so). */
    uint64_t mark = full_mark_now(c);
    uint32_t owned = 0;
    int r = UCM_FULL, full = 0;
    if (__atomic_load_n(&c->full_mark, __ATOMIC_RELAXED) == mark) {
        owned = arenas_owned(c);
    } else {
        r = claim_free(c, max_scan, slot_out, &owned, &full);
        __atomic_store_n(&c->full_mark, full ? mark : UINT64_MAX, __ATOMIC_RELAXED);
        if (r != UCM_FULL) return r;
    }
    if (!policy_looked(c, owned)) return UCM_ROOM;
    return claim_clock(c, max_scan, slot_out);
}

/* ---------------------------------------------------------------- stripes */

/* Lock a stripe, repairing a dead holder: the one way every C step and the Python layer take a
 * stripe.  timeout_ns < 0 waits without bound, 0 only tries, > 0 waits that long.  A holder that
 * died hands us EOWNERDEAD: its chains are rebuilt before the mutex is marked consistent, all in
 * this call, so no exception or signal in the Python layer can fall between the two and leave
 * the mutex ENOTRECOVERABLE.  Returns UCM_OK (held), UCM_BUSY (try only), UCM_TIMEOUT, or
 * UCM_CORRUPT (not a usable mutex any more; not held). */
static int lock_stripe_repairing(ucm_ctx *c, uint32_t stripe, int64_t timeout_ns)
{
    pthread_mutex_t *m = (pthread_mutex_t *)stripe_mutex(c, stripe);
    int r;
    if (timeout_ns < 0) {
        r = pthread_mutex_lock(m);
    } else if (timeout_ns == 0) {
        r = pthread_mutex_trylock(m);
    } else {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts); /* timedlock's clock */
        int64_t ns = ts.tv_nsec + timeout_ns;
        ts.tv_sec += ns / 1000000000LL;
        ts.tv_nsec = ns % 1000000000LL;
        r = pthread_mutex_timedlock(m, &ts);
    }
    r = mutex_result(r);
    if (r == UCM_OWNERDEAD) {
        uint32_t dropped;
        ucm_stripe_repair(c, stripe, &dropped);
        if (pthread_mutex_consistent(m) != 0) {
            pthread_mutex_unlock(m);
            return UCM_CORRUPT;
        }
        return UCM_OK;
    }
    return r;
}

static void unlock_stripe(ucm_ctx *c, uint32_t stripe)
{
    pthread_mutex_unlock((pthread_mutex_t *)stripe_mutex(c, stripe));
}

int ucm_stripe_lock(ucm_ctx *c, uint32_t stripe, int64_t timeout_ns)
{
    if (stripe >= c->l.n_stripes) return UCM_CORRUPT;
    return lock_stripe_repairing(c, stripe, timeout_ns);
}

int ucm_stripe_unlock(ucm_ctx *c, uint32_t stripe)
{
    if (stripe >= c->l.n_stripes) return UCM_CORRUPT;
    return mutex_result(pthread_mutex_unlock((pthread_mutex_t *)stripe_mutex(c, stripe)));
}


static int unlink_slot_at(ucm_ctx *c, uint32_t s, uint32_t b, int point);
static int unlink_slot(ucm_ctx *c, uint32_t s, uint32_t b) { return unlink_slot_at(c, s, b, UCM_PT_AFTER_UNLINK); }

static int unlink_slot_at(ucm_ctx *c, uint32_t s, uint32_t b, int point)
{
    /* Caller holds b's stripe.  The unlinked slot keeps its next pointer, so a lock-free walker
     * standing on it walks on; its bucket word is then set INVALID so it matches nothing (I2).
     * The neighbours must agree that s sits between them: a link that does not is corruption,
     * and writing through it could change a chain under a stripe we do not hold. */
    uint32_t p = RLX(prev_w(c, s)), n = RLX(next_w(c, s));
    int p_ok = p == UCM_NIL ? RLX(head_w(c, b)) == s
                            : p < c->l.n_slots && RLX(bucket_w(c, p)) == b && RLX(next_w(c, p)) == s;
    int n_ok = n == UCM_NIL || (n < c->l.n_slots && RLX(bucket_w(c, n)) == b && RLX(prev_w(c, n)) == s);
    if (!p_ok || !n_ok) return UCM_CORRUPT;
    /* Release on the link a walker may follow: it sees the successor's fields as linked. */
    if (p == UCM_NIL) SET_REL(head_w(c, b), n);
    else SET_REL(next_w(c, p), n);
    if (n != UCM_NIL) SET_RLX(prev_w(c, n), p); /* prev: read only by stripe holders */
    POINT(c, point); /* after_unlink (an install), mid_delete (a delete) */
    /* Walkers that read the old bucket word before this store are kept from a false hit by
     * pin-and-revalidate (I3), not by this store's order. */
    SET_REL(bucket_w(c, s), UCM_INVALID_BUCKET);
    return UCM_OK;
}

static void link_at_head(ucm_ctx *c, uint32_t s, uint32_t b)
{
    /* Publish (write step 5): bucket word with release before the head store with release,
     * so whoever reaches s through the head sees its key and bucket (I2). */
    uint32_t h = RLX(head_w(c, b));
    SET_RLX(prev_w(c, s), UCM_NIL);
    SET_RLX(next_w(c, s), h);
    SET_REL(bucket_w(c, s), b);
    POINT(c, UCM_PT_MID_PUBLISH);
    if (h != UCM_NIL && h < c->l.n_slots) SET_RLX(prev_w(c, h), s);
    SET_REL(head_w(c, b), s);
}

static void unclaim(ucm_ctx *c, uint32_t s)
{
    /* Relaxed: only the claimant writes the flags of a claimed slot.  Release: our (rolled
     * back) reads and any words we touched are done before the next claimant or pinner
     * acquires the slot. */
    SET_RLX(flags_w(c, s), RLX(flags_w(c, s)) & ~UCM_F_INSTALLING);
    SET_REL(ref_w(c, s), 0);
}

/* Write step 3, isolate: unlink a claimed slot from its old bucket (not the key's), taking that
 * bucket's stripe by trylock only (we already hold one stripe; a blocking lock could close a
 * cycle with a writer that holds the other).  Anything but UCM_OK gives the claim back. */
static int isolate(ucm_ctx *c, uint32_t s, uint32_t old_b, uint32_t held_stripe)
{
    if (old_b >= c->l.n_buckets) {
        /* A bucket word no writer could have left: make the slot match nothing, give it
         * back, and report the corruption (the chain holding it, if any, is repaired by
         * ucm_stripe_repair; walkers skip it meanwhile). */
        SET_REL(bucket_w(c, s), UCM_INVALID_BUCKET);
        unclaim(c, s);
        return UCM_CORRUPT;
    }
    uint32_t os = ucm_stripe_of(c, old_b);
    int locked_other = 0;
    if (os != held_stripe) {
        int r = lock_stripe_repairing(c, os, 0);
        if (r == UCM_CORRUPT) {
            unclaim(c, s);
            return UCM_CORRUPT;
        } else if (r != UCM_OK) {
            unclaim(c, s);
            STAT(c, UCM_ST_CLAIM_ROLLBACKS, 1);
            return UCM_ROLLBACK;
        }
        locked_other = 1;
    }
    int ur = unlink_slot(c, s, old_b);
    if (locked_other) unlock_stripe(c, os);
    if (ur != UCM_OK) {
        unclaim(c, s); /* still reachable where it was: it must not be rewritten (I2) */
        return UCM_CORRUPT;
    }
    return UCM_OK;
}

int ucm_install(ucm_ctx *c, uint32_t s, const char *id, uint64_t offset, uint32_t held_stripe)
{
    /* Write steps 3-6 for a slot we claimed, with the stripe of key's bucket held; step 3 is
     * isolate() when the slot is linked in another bucket. */
    if (c->rank < 0 || s >= c->l.n_slots) return UCM_CORRUPT;
    if (RLX(ref_w(c, s)) != (UCM_CLAIMED | (uint64_t)c->rank)) return UCM_NOT_HELD;
    uint64_t key[3];
    load_key(id, offset, key);
    uint32_t b = bucket_of_key(c, key);
    if (ucm_stripe_of(c, b) != held_stripe) {
        unclaim(c, s);
        return UCM_NOT_HELD;
    }
    uint32_t old_b = RLX(bucket_w(c, s));
    int relink = old_b != b;

    if (old_b != UCM_INVALID_BUCKET && relink) {
        int r = isolate(c, s, old_b, held_stripe);
        if (r != UCM_OK) return r; /* the claim was given back */
    }

    /* The old entry leaves the accounting if it is counted in the current generation (I4); an
     * older generation's count was dropped by clear() moving the words on. */
    /* Relaxed: our claim's acquire CAS ordered every earlier writer's words before us. */
    uint32_t old_gen = RLX(gen_w(c, s));
    uint32_t old_state = RLX(state_w(c, s)) & UCM_STATE_MASK;
    /* Only a Ready entry is in the words (publish sets COUNTED just before its Ready exchange;
     * recovery clears COUNTED when it fails a Loading slot): a Failed slot is never uncounted. */
    if (old_state == UCM_READY && (RLX(flags_w(c, s)) & UCM_F_COUNTED)
        && old_gen == (uint32_t)ucm_generation(c)) {
        STAT(c, UCM_ST_EVICTIONS, 1);
        acc_sub(c, arena_of(c, s), UCM_A_ACC_ENTRIES, old_gen, 1);
        acc_sub(c, arena_of(c, s), UCM_A_ACC_BYTES, old_gen, RLX(len_w(c, s)));
    }

    /* Step 4, rewrite: unreachable (unlinked) or claimed in its own bucket, so no one can pin
     * it; walkers that read a half-written key fail the pin or the revalidation (I2, I3).
     * State first, then a release fence, then the key: a lock-free exist() that reads a new
     * key word also reads Loading (see the acquire fence in match_key), never the old Ready. */
    SET_RLX(state_w(c, s), UCM_LOADING);
    __atomic_thread_fence(__ATOMIC_RELEASE);
    uint64_t *k = key_w(c, s);
    SET_RLX(&k[0], key[0]);
    SET_RLX(&k[1], key[1]);
    SET_RLX(&k[2], key[2]);
    SET_RLX(gen_w(c, s), (uint32_t)ucm_generation(c));
    SET_RLX(loader_w(c, s), (uint16_t)c->rank);
    SET_RLX(flags_w(c, s), 0);
    SET_RLX(len_w(c, s), 0);
    SET_RLX(acc_w(c, s), 1);

    /* Step 5, publish. */
    if (relink) link_at_head(c, s, b);
    POINT(c, UCM_PT_BEFORE_HANDOVER);

    /* Step 6, hand over: claimed-by-me becomes pinned-by-me in one release store, so a pinner
     * that acquires the reference sees every word written above. */
    local_lock(c, s);
    c->local_pins[s] = 1;
    c->local_done[s] = 0; /* nobody has finished this load yet (take_finish) */
    c->local_serial[s]++; /* this load's serial: only its owner names it (take_finish) */
    SET_REL(ref_w(c, s), c->rank_bit);
    local_unlock(c, s);
    STAT(c, UCM_ST_MISSES, 1);
    STAT(c, UCM_ST_LOADS_STARTED, 1);
    return UCM_OK;
}

/* The right to finish a load: an owner's publish (Ready or Failed, ucm_publish, ucm_fail_load,
 * so ucm_token_publish and ucm_load_finish too) and the fail of an owner's drop (abandon_one)
 * may run at once in two threads of the owner's process (h.ready() and h.close() on one
 * handle); each checks "pinned and Loading" and then swaps the state, so without this the
 * second could overwrite the first's answer (a Failed message published over a Ready value
 * already counted: I4).  Whichever side finishes first sets the slot's process-local done byte
 * (reset by the install's handover) under the local lock, so exactly one of them runs; the
 * publish also takes one more local hold for its duration, so a drop that lost the right
 * (it only unpins) cannot leave the slot unpinned, claimable, under the publish.  Answers
 * UCM_OK (taken, with the hold: the caller drops it by unpin), UCM_NOT_HELD (we hold no pin,
 * the context is closed or a forked child's copy, or `serial` is not the slot's install's:
 * a stale finisher whose load ended and whose slot another get of ours installed again),
 * UCM_PUBLISHED (another thread of ours took it).  The done byte belongs to the slot, so the
 * serial (handed to the load's owner at the handover: ucm_load_serial, a token's field) is
 * what ties the right to one load: a ready() that passed its checks before its handle's close
 * freed the slot must not finish the next key's load on it (I4, I5). */
static int take_finish(ucm_ctx *c, uint32_t s, uint32_t serial, int hold)
{
    if (!ctx_live(c)) return UCM_NOT_HELD;
    local_lock(c, s);
    /* Relaxed: our own bit, set by this process (ordered by the local lock). */
    int held = (RLX(ref_w(c, s)) & c->rank_bit) && c->local_pins[s] != 0
               && c->local_serial[s] == serial;
    int r = !held ? UCM_NOT_HELD : c->local_done[s] ? UCM_PUBLISHED : UCM_OK;
    if (r == UCM_OK) {
        c->local_done[s] = 1;
        if (hold) c->local_pins[s]++;
    }
    local_unlock(c, s);
    return r;
}

/* The owner's publish once it holds the right (take_finish): Ready (counted if its generation
 * is still current) or Failed, waking waiters only if one said it sleeps. */
static int publish_taken(ucm_ctx *c, uint32_t s, uint32_t state, uint32_t length)
{
    /* Relaxed: the right is ours, and only its holder moves a live rank's Loading slot on
     * (recovery acts on dead ranks' slots); a slot not Loading was finished by an earlier
     * install's right and is not ours to write. */
    if ((RLX(state_w(c, s)) & UCM_STATE_MASK) != UCM_LOADING) return UCM_PUBLISHED;
    SET_RLX(len_w(c, s), length);
    if (state == UCM_READY) {
        uint32_t g = RLX(gen_w(c, s));
        uint32_t arena = arena_of(c, s); /* we installed it: we write its words (I6) */
        /* Only a slot of the current generation is counted; one that a clear() overtook is
         * not (its 20-bit tag could even alias a far newer word's).  A clear() racing this is
         * decided by acc_add's CAS against the word clear() moves on. */
        if (g == (uint32_t)ucm_generation(c) && acc_add(c, arena, UCM_A_ACC_ENTRIES, g, 1)) {
            if (!acc_add(c, arena, UCM_A_ACC_BYTES, g, length)) {
                /* clear() ran between the two adds: the entry is not in this generation. */
                acc_sub(c, arena, UCM_A_ACC_ENTRIES, g, 1);
            } else {
                SET_RLX(flags_w(c, s), UCM_F_COUNTED);
                POINT(c, UCM_PT_COUNTED_NOT_READY);
            }
        }
        STAT(c, UCM_ST_LOADS_READY, 1);
    } else {
        STAT(c, UCM_ST_LOADS_FAILED, 1);
    }
    /* Release: the data and length written by the owner are visible to whoever acquires the
     * state (waiters, and pinners via lookup's acquire on the state). */
    uint32_t old = __atomic_exchange_n(state_w(c, s), state, __ATOMIC_RELEASE);
    if (old & UCM_WAITERS) futex_wake_word(state_w(c, s), INT32_MAX);
    /* Not a live entry (Failed, or a clear() overtook it): a free slot once unpinned. */
    if (!(RLX(flags_w(c, s)) & UCM_F_COUNTED)) frees_bump(c);
    return UCM_OK;
}

uint32_t ucm_load_serial(ucm_ctx *c, uint32_t s)
{
    /* The serial of the slot's latest install by this process (take_finish).  Asked by an
     * owner right after the step that made it the owner, while its pin keeps the slot from
     * any other install, so the answer is its own load's. */
    if (s >= c->l.n_slots) return 0;
    local_lock(c, s);
    uint32_t serial = c->local_serial[s];
    local_unlock(c, s);
    return serial;
}

int ucm_publish(ucm_ctx *c, uint32_t s, uint32_t serial, uint32_t state, uint32_t length)
{
    /* The owner, holding its pin on a Loading slot, makes it Ready or Failed, once: the right
     * to finish first (take_finish), its extra hold dropped after. */
    if (s >= c->l.n_slots || (state != UCM_READY && state != UCM_FAILED)
        || (uint64_t)length > c->l.slot_size)
        return UCM_CORRUPT;
    int r = take_finish(c, s, serial, 1);
    if (r != UCM_OK) return r;
    r = publish_taken(c, s, state, length);
    unpin(c, s);
    return r;
}

int ucm_fail_load(ucm_ctx *c, uint32_t s, uint32_t serial, const char *msg, uint32_t len)
{
    /* fail() of an owner's handle: the right to finish first, then the message copied into
     * the slot (cut to the slot) and the Failed publish, so a ready() of another thread that
     * took the right is never written over.  Answers as ucm_publish. */
    if (s >= c->l.n_slots) return UCM_CORRUPT;
    if ((uint64_t)len > c->l.slot_size) len = (uint32_t)c->l.slot_size;
    int r = take_finish(c, s, serial, 1);
    if (r != UCM_OK) return r;
    /* Relaxed: the slot is pinned by us and the finish right is ours (take_finish); a Loading
     * slot of a live rank leaves Loading only through that right, so what we read is our own
     * last store (publish_taken reads it again, as every finish does). */
    if ((RLX(state_w(c, s)) & UCM_STATE_MASK) != UCM_LOADING) {
        r = UCM_PUBLISHED;
    } else {
        /* Plain stores: the slot is Loading and ours to finish; readers acquire the state. */
        if (len) memcpy(slot_bytes(c, s), msg, len);
        r = publish_taken(c, s, UCM_FAILED, len);
    }
    unpin(c, s);
    return r;
}

/* A Loading slot becomes Failed with a message, waking its waiters.  Called by its owner (an
 * abandon) or by recovery, either way by whoever the slot's pin or loader rank makes
 * responsible for it.  COUNTED is cleared first: an owner that died inside publish after
 * setting it and before its Ready exchange left a slot that is not in the words (recount skips
 * it), and a later install must not subtract it. */
static void fail_loading(ucm_ctx *c, uint32_t s, const char *msg, uint32_t len)
{
    uint64_t n = (uint64_t)len < c->l.slot_size ? (uint64_t)len : c->l.slot_size;
    if (n) memcpy(c->base + c->l.data_off + (uint64_t)s * c->l.slot_stride, msg, n);
    SET_RLX(len_w(c, s), (uint32_t)n);
    SET_RLX(flags_w(c, s), 0);
    /* Release: the message, length and flags are visible to whoever acquires the state. */
    uint32_t old = __atomic_exchange_n(state_w(c, s), UCM_FAILED, __ATOMIC_RELEASE);
    if (old & UCM_WAITERS) futex_wake_word(state_w(c, s), INT32_MAX);
    frees_bump(c); /* a free slot once unpinned (a recoverer's bump is its own, and harmless) */
}

static int abandon_one(ucm_ctx *c, uint32_t s, int owner, uint32_t serial, const char *msg,
                       uint32_t len)
{
    /* Drop a pin that no Handle will drop; for the owner of a load that was never published,
     * publish Failed first, while the pin still keeps the slot from being reclaimed.  One step,
     * so nothing between the two can leave a Loading slot whose owner holds no pin.  `serial`:
     * the owner's load's (take_finish). */
    if (s >= c->l.n_slots) return UCM_CORRUPT;
    if (!ctx_live(c)) return UCM_OK; /* closed, or a forked child's copy: not ours to touch */
    if (owner && c->rank >= 0) {
        /* The right to finish (take_finish): a publish of another thread of ours that took it
         * first finishes the load; this drop then only unpins. */
        int held = take_finish(c, s, serial, 0) == UCM_OK;
        /* Acquire: pairs with a publish's release exchange by another thread of ours.  The
         * loader word is relaxed: written by our own install before the handover that gave us
         * this pin (ordered by it). */
        if (held && (ACQ(state_w(c, s)) & UCM_STATE_MASK) == UCM_LOADING
            && RLX(loader_w(c, s)) == (uint16_t)c->rank) {
            fail_loading(c, s, msg, len);
            STAT(c, UCM_ST_LOADS_FAILED, 1);
        }
    }
    return unpin(c, s);
}

int ucm_abandon_many(ucm_ctx *c, uint32_t *slots, const uint8_t *owner, uint32_t n,
                     const char *msg, uint32_t len)
{
    /* A batch that never reached its HandleBatch (or a batch's close): every pinned position is
     * dropped, owned ones failed first; positions are set to UCM_NIL as they go, so a second
     * call (an interrupted close retried by the finalizer) drops nothing twice. */
    int worst = UCM_OK;
    for (uint32_t i = 0; i < n; i++) {
        uint32_t s = slots[i];
        if (s == UCM_NIL) continue;
        slots[i] = UCM_NIL;
        /* The serial is the slot's current one: the batch's pin, held from the install that
         * made this position the owner to here, kept every other install off the slot. */
        int own = owner ? owner[i] : 0;
        /* Only a live context reads the serial: it takes the slot's local lock, which a forked
         * child may have inherited held by another thread of the parent (it would spin for
         * ever); abandon_one leaves a child's copy untouched anyway. */
        uint32_t serial = own && s < c->l.n_slots && ctx_live(c) ? ucm_load_serial(c, s) : 0;
        int r = abandon_one(c, s, own, serial, msg, len);
        if (r != UCM_OK) worst = r;
    }
    return worst;
}

int ucm_abandon_inflight(ucm_ctx *c, uint64_t ticket)
{
    /* The except path of a single-key read whose pin never reached its owner: drop the pin the
     * step with this ticket took, if it took one.  1: dropped, 0: none.  Those steps are hits
     * or joins, never owners (an owner's pin goes to a token). */
    for (uint32_t k = 1; k <= INFLIGHT; k++) {
        uint32_t i = (inflight_next - k) % INFLIGHT; /* newest first */
        if (inflight[i].ticket != ticket || inflight[i].c != c) continue;
        uint32_t s = inflight[i].slot;
        inflight[i].ticket = 0;
        if (s == UCM_NIL) return 0;
        unpin(c, s);
        return 1;
    }
    return 0;
}

/* Pin tokens.  A Python object's death can be interrupted at any Python call (a signal
 * handler raising inside __exit__ or __del__), so a hold whose loss would wedge others (an
 * owner's Loading slot) or that a batch took must be released by something that runs no
 * Python: a token, allocated before the pinning step and handed the pins inside it, whose
 * cffi destructor (ucm_token_release, called from C when the token is collected) drops them.
 * Closing a handle drops its token explicitly; dropping is idempotent (`armed`).  Tokens are
 * process-local memory used by one handle's holder at a time: plain loads and stores, except
 * the context's reference count. */
static void token_arm(ucm_ctx *c, ucm_token *t, uint32_t slot, uint32_t owner)
{
    __atomic_add_fetch(&c->refs, 1, __ATOMIC_RELAXED); /* relaxed: we hold a reference already */
    t->c = c;
    t->slot = slot;
    t->owner = owner;
    /* The load's serial (take_finish): read while our pin keeps the slot from another install. */
    t->serial = owner && slot < c->l.n_slots ? ucm_load_serial(c, slot) : 0;
    t->armed = 1;
}

void ucm_token_drop(ucm_token *t, const char *msg, uint32_t len)
{
    if (!t->armed) return;
    ucm_ctx *c = t->c;
    t->armed = 0;
    abandon_one(c, t->slot, (int)t->owner, t->serial, msg, len); /* nothing if !ctx_live(c) */
    ctx_put(c);
}

static const char collected_msg[] = "the owner's handle was collected without ready()";

void ucm_token_release(void *keep, ucm_token *t)
{
    /* The cffi destructor.  `keep` is a handle on the Python Segment, held by the destructor
     * object itself, so the mapping is still there whatever order the holder's fields are
     * cleared in. */
    ucm_token_drop(t, collected_msg, sizeof collected_msg - 1);
}

void ucm_batch_token_arm(ucm_ctx *c, ucm_token *t, uint32_t n)
{
    /* Armed before any pin: the batch's arrays (all UCM_NIL) are what it covers from now on. */
    token_arm(c, t, UCM_NIL, 0);
    t->n = n;
}

void ucm_batch_token_drop(uint32_t *slots, uint8_t *owner, ucm_token *t, const char *msg,
                          uint32_t len)
{
    if (!t->armed) return;
    ucm_ctx *c = t->c;
    t->armed = 0;
    ucm_abandon_many(c, slots, owner, t->n, msg, len); /* each drop checks ctx_live */
    ctx_put(c);
}

void ucm_batch_token_release(void *keep, uint32_t *slots, uint8_t *owner, ucm_token *t)
{
    /* The cffi destructor; `keep` as in ucm_token_release. */
    ucm_batch_token_drop(slots, owner, t, collected_msg, sizeof collected_msg - 1);
}

/* The far side of an owner's load in one call (DESIGN 4.4, "finish"): ucmcache/_hit's
 * get_or_load took the slot by ucm_get_slow into a token of its own (its C frame is the owner
 * object, DESIGN 5.5) and ran the loader; here the loader's value (Ready) or its error's
 * message (Failed) is copied into the slot, published (counted: ucm_publish), its load time
 * observed (t0_ns: ucm_now_ns when the slot was ours), the pin dropped and the token
 * disarmed.  The steps in order, each prefix safe for a survivor (5.8):
 *   the right to finish (take_finish) -> copy -> [load_copied] -> publish (COUNTED,
 *   [counted_not_ready], state exchange, wake) -> observe -> [load_published] -> unpin.
 * A kill before the exchange leaves a pinned Loading slot whose loader is dead: waiters
 * recover it (Failed, uncounted); after it, a pin bit on a published entry: recovery clears
 * it.  A context closed under the loader (its close's recovery failed the load and dropped the
 * pin) or a forked child's copy touches nothing shared: UCM_NOT_HELD.  One cleanup path: the
 * token is disarmed and its context reference dropped whatever the answer. */
int ucm_load_finish(ucm_token *t, uint32_t state, const char *src, uint64_t n, int64_t t0_ns)
{
    if (!t->armed) return UCM_NOT_HELD;
    ucm_ctx *c = t->c;
    uint32_t s = t->slot;
    int r = UCM_NOT_HELD;
    t->armed = 0;
    if (!ctx_live(c)) goto out;
    if (state == UCM_FAILED && n > c->l.slot_size) n = c->l.slot_size; /* a message, cut */
    if (!t->owner || s >= c->l.n_slots || (state != UCM_READY && state != UCM_FAILED)
        || n > c->l.slot_size) {
        r = UCM_CORRUPT;
        abandon_one(c, s, (int)t->owner, t->serial, NULL, 0); /* fails it unpublished, unpins */
        goto out;
    }
    /* The right to finish first (take_finish, with one more hold), then the copy. */
    r = take_finish(c, s, t->serial, 1);
    if (r != UCM_OK) { /* not held (closed under us), or finished already: only unpins */
        abandon_one(c, s, (int)t->owner, t->serial, NULL, 0);
        goto out;
    }
    /* Plain stores: the slot is Loading and ours (no reader reads its bytes before acquiring
     * the state our publish releases). */
    if (n) memcpy(slot_bytes(c, s), src, n);
    POINT(c, UCM_PT_LOAD_COPIED);
    r = publish_taken(c, s, state, (uint32_t)n);
    if (r == UCM_OK) {
        ucm_observe(c, UCM_HIST_LOAD, (uint64_t)(now_ns() - t0_ns));
        POINT(c, UCM_PT_LOAD_PUBLISHED);
    }
    unpin(c, s); /* take_finish's hold */
    unpin(c, s); /* the token's pin (published, or left Loading by nobody: ours took the right) */
out:
    ctx_put(c);
    return r;
}

static int wait_loaded(ucm_ctx *c, uint32_t s, int64_t timeout_ns, int stop_on_signal,
                       uint32_t *state_out)
{
    /* Block on the state word until it leaves Loading.  The WAITERS bit is set before sleeping
     * so that publish, which swaps the whole word, knows a wake is needed.  stop_on_signal: a
     * sleep a signal interrupts answers UCM_SLICE (still Loading) instead of sleeping again. */
    if (s >= c->l.n_slots) return UCM_CORRUPT;
    int64_t deadline = timeout_ns >= 0 ? now_ns() + timeout_ns : -1;
    uint32_t *w = state_w(c, s);
    for (;;) {
        uint32_t v = ACQ(w); /* acquire: pairs with publish's release exchange */
        if ((v & UCM_STATE_MASK) != UCM_LOADING) {
            *state_out = v & UCM_STATE_MASK;
            return UCM_OK;
        }
        if (!(v & UCM_WAITERS)) {
            /* Relaxed: the futex syscall re-reads the word; a lost race just loops. */
            if (!__atomic_compare_exchange_n(w, &v, v | UCM_WAITERS, 0, __ATOMIC_RELAXED, __ATOMIC_RELAXED))
                continue;
            v |= UCM_WAITERS;
        }
        int64_t left = -1;
        if (deadline >= 0) {
            left = deadline - now_ns();
            if (left <= 0) {
                *state_out = UCM_LOADING;
                return UCM_TIMEOUT;
            }
        }
        if (futex_wait_intr(w, v, left) == UCM_SLICE && stop_on_signal) {
            /* Acquire: as above; the load may have ended while the handler's signal came. */
            v = ACQ(w);
            *state_out = v & UCM_STATE_MASK;
            return (v & UCM_STATE_MASK) != UCM_LOADING ? UCM_OK : UCM_SLICE;
        }
    }
}

int ucm_wait_loaded(ucm_ctx *c, uint32_t s, int64_t timeout_ns, uint32_t *state_out)
{
    return wait_loaded(c, s, timeout_ns, 0, state_out);
}

/* ready() of an owner's Handle whose pin its token holds (ucmcache/_hit's get of a cold key):
 * ucm_publish (Ready or Failed, counted) and the load time observed in one call; the token
 * stays armed (the handle stays open, a reader of its entry) but no longer owns a load, so its
 * drop only unpins.  Answers ucm_publish's (nothing changed unless UCM_OK), or UCM_NOT_HELD for
 * a token that holds nothing or whose context is closed or another epoch's. */
int ucm_token_publish(ucm_token *t, uint32_t state, uint32_t n, int64_t t0_ns)
{
    if (!t->armed || !t->owner || !ctx_live(t->c)) return UCM_NOT_HELD;
    int r = ucm_publish(t->c, t->slot, t->serial, state, n);
    if (r == UCM_OK) {
        ucm_observe(t->c, UCM_HIST_LOAD, (uint64_t)(now_ns() - t0_ns));
        t->owner = 0;
    }
    return r;
}

/* A joined caller's wait, one slice per call with no Python in it (DESIGN 4.5): the futex
 * wait for at most slice_ns (or to the deadline: deadline_ns on ucm_now_ns's clock, < 0:
 * none); a slice that ends with the slot still Loading looks at the loader's life lock (its
 * OFD lock on lock_fd, byte life_byte0 + rank: free means the loader died).  Answers: UCM_OK
 * with the final state (Ready or Failed; Empty once a recovery reclaimed it); UCM_TIMEOUT
 * (still Loading at the deadline); UCM_SLICE (still Loading, the loader alive (its life lock is
 * looked at on every still-Loading answer, a signal's too), at the slice's end or when a signal
 * interrupted the sleep: the caller runs its signal handlers, with the
 * GIL, and calls again with the same t0_ns and deadline, so a thread waiting with no deadline
 * can still be interrupted); UCM_OWNERDEAD (the loader's life lock is free, or could not be
 * read: the caller recovers, or finds it alive, and calls again; the state then answers at
 * once); UCM_CORRUPT.  Counted when t0_ns >= 0 (the wait's start, on the same clock) and the
 * answer is final (OK, TIMEOUT): its time into wait_ns and the wait histogram, and a timeout;
 * SLICE and OWNERDEAD are not.  The caller counts the wait itself (`waits`) when it begins, so
 * a wait of many calls is still one wait, and counts its time (wait_ns, the histogram) itself
 * when it ends on no final answer (an exception of its own: a handler's, a recovery's). */
int ucm_wait_ready(ucm_ctx *c, uint32_t s, int64_t deadline_ns, int64_t slice_ns,
                   int lock_fd, uint64_t life_byte0, int64_t t0_ns, uint32_t *state_out)
{
    if (s >= c->l.n_slots || slice_ns <= 0) return UCM_CORRUPT;
    int64_t now = now_ns(), wait = slice_ns;
    if (deadline_ns >= 0 && deadline_ns - now < wait) wait = deadline_ns - now;
    int r = wait_loaded(c, s, wait > 0 ? wait : 0, 1, state_out);
    if (r == UCM_CORRUPT) return r;
    if (r != UCM_OK) { /* TIMEOUT (the slice ended) or SLICE (a signal), still Loading */
        if (deadline_ns >= 0 && now_ns() >= deadline_ns) {
            r = UCM_TIMEOUT;
            if (t0_ns >= 0) STAT(c, UCM_ST_WAIT_TIMEOUTS, 1);
            goto counted;
        }
        /* A signal's SLICE looks too: a new slice starts at every call, so with signals
         * faster than a slice a check only at a slice's end would never run, and a dead
         * loader would hold its waiters to their deadline (or forever).  One fcntl per
         * signal, so a dead loader is found within a slice however many signals come. */
        uint32_t loader = ucm_slot_loader(c, s);
        if (loader != (uint32_t)c->rank && loader < c->l.max_ranks && lock_fd >= 0
            && ucm_ofd_held_by_other(lock_fd, life_byte0 + loader) != 1)
            return UCM_OWNERDEAD; /* uncounted: the caller calls again */
        return UCM_SLICE; /* uncounted: the caller runs its signal handlers and calls again */
    }
counted:
    if (t0_ns >= 0) {
        uint64_t waited = (uint64_t)(now_ns() - t0_ns);
        STAT(c, UCM_ST_WAIT_NS, waited);
        ucm_observe(c, UCM_HIST_WAIT, waited);
    }
    return r;
}

int ucm_wait_end(ucm_ctx *c, int64_t t0_ns, int timed_out)
{
    /* The end of a wait whose steps (ucm_wait_ready with t0_ns < 0) counted nothing: its time
     * into wait_ns and the wait histogram, and a timeout, in one step that reads the clock
     * itself, so a caller in Python counts the wait exactly once from its `finally` (no
     * signal handler can run between a count in C and the Python that would record it). */
    uint64_t waited = (uint64_t)(now_ns() - t0_ns);
    STAT(c, UCM_ST_WAIT_NS, waited);
    ucm_observe(c, UCM_HIST_WAIT, waited);
    if (timed_out) STAT(c, UCM_ST_WAIT_TIMEOUTS, 1);
    return UCM_OK;
}

/* ---------------------------------------------------------------- the slow path, whole */

int64_t ucm_get_slow(ucm_ctx *c, const char *id, uint64_t offset, uint32_t spin_budget,
                     uint32_t max_rollbacks, int64_t timeout_ns, ucm_token *tok,
                     uint32_t *slot_out, uint8_t *owner_out)
{
    /* Read step 4 and write steps 1-6 as one call: lock the key's stripe (bounded by timeout_ns,
     * see lock_stripe_repairing), look again (exact now: nobody else changes this chain), and on
     * a miss claim a victim with our CLOCK hand and install the key, handing the slot over
     * pinned by us.  The stripe is released before returning, always.  Answers: a pin answer
     * (UCM_PIN_*, with UCM_PIN_OWNER if ours to load), or -UCM_MOVED (the arena epoch moved: the
     * caller looks at its share, then calls again), -UCM_ROOM (nothing free in our arenas: the
     * caller's policy takes an arena or says there is none, then calls again), -UCM_FULL
     * (nothing claimable: the caller decides), -UCM_ROLLBACK (every victim's old stripe was
     * busy: try again), -UCM_BUSY (the
     * key's slot stays claimed under our stripe: its claimant died), -UCM_TIMEOUT (the stripe
     * stayed held), -UCM_CORRUPT.  A pin taken is also handed, inside this step, to whatever
     * will own it: the token (a single key), or slot_out/owner_out (a batch's arrays, which its
     * token covers). */
    if (c->rank < 0) return -(int64_t)UCM_NOT_HELD;
    /* The set of ranks changed since our rank looked at its share of the arenas: the Python
     * layer looks first (one load here instead of a call per miss there).  Relaxed: the epoch
     * is a hint that only says when to look; the owner words decide. */
    if (RLX(header(c)->ARENA_EPOCH) != __atomic_load_n(&c->epoch_seen, __ATOMIC_RELAXED))
        return -(int64_t)UCM_MOVED;
    uint64_t key[3];
    load_key(id, offset, key);
    uint32_t b = bucket_of_key(c, key), stripe = ucm_stripe_of(c, b);
    POINT(c, UCM_PT_BEFORE_STRIPE);
    int r = lock_stripe_repairing(c, stripe, timeout_ns);
    if (r != UCM_OK) return -(int64_t)r;
    POINT(c, UCM_PT_HOLDING_STRIPE);
    int64_t answer;
    uint32_t slot = 0, state = 0, owner = 0;
    r = lookup_pin_one(c, key, (uint32_t)ucm_generation(c), spin_budget, &slot, &state);
    if (r == UCM_OK) {
        STAT(c, state == UCM_READY ? UCM_ST_HITS : UCM_ST_JOINS, 1);
        answer = pin_answer(c, slot, state, 0);
    } else if (r != UCM_MISS) {
        if (r == UCM_BUSY) STAT(c, UCM_ST_SPINS_EXHAUSTED, 1);
        answer = -(int64_t)r;
    } else {
        /* One full sweep clears accessed bits, the second takes the first unpinned slot. */
        uint64_t budget = 2 * c->l.n_slots + 1;
        answer = -(int64_t)UCM_ROLLBACK; /* every candidate's old stripe was busy */
        for (uint32_t attempt = 0; attempt <= max_rollbacks; attempt++) {
            r = ucm_clock_claim(c, budget, &slot);
            if (r != UCM_OK) {
                answer = -(int64_t)(r == UCM_ROOM ? UCM_ROOM : UCM_FULL);
                break;
            }
            r = ucm_install(c, slot, id, offset, stripe);
            if (r == UCM_OK) {
                owner = 1;
                answer = pin_answer(c, slot, UCM_LOADING, 1);
                break;
            }
            if (r != UCM_ROLLBACK) {
                answer = -(int64_t)r; /* the claim was given back */
                break;
            }
        }
    }
    if (answer >= 0) {
        if (slot_out) {
            *slot_out = slot;
            *owner_out = (uint8_t)owner;
        }
        if (tok) token_arm(c, tok, slot, owner);
    }
    unlock_stripe(c, stripe);
    return answer;
}

uint32_t ucm_get_slow_many(ucm_ctx *c, const char *ids, const uint64_t *offsets, uint32_t n,
                           uint32_t from, const uint8_t *codes, uint32_t spin_budget,
                           uint32_t max_rollbacks, int64_t timeout_ns, uint32_t *slots_out,
                           uint8_t *owner_out, int64_t *lens_out, uint32_t *serials_out,
                           int64_t *answer_out, int64_t *since_out)
{
    /* ucm_get_slow for each position of a batch its first look missed (codes[i] != 0), in
     * order from ``from``, each a whole step of its own (its stripe, its timeout), the pin
     * handed to slots_out/owner_out as ucm_get_slow hands it; and, for a position it made the
     * owner of, the load's serial asked at once (ucm_load_serial, the pin held).  It stops at
     * the first position whose step answers anything but a pin (a caller's decision: MOVED,
     * ROOM, FULL, BUSY, ...) and returns that position, the answer (positive: -r) in
     * *answer_out and the step's start in *since_out, so the caller goes on from there with
     * the step already counted as its first; a first look that found a corrupt chain runs no
     * step (*answer_out 0).  n when every position is pinned. */
    *answer_out = 0;
    for (uint32_t i = from; i < n; i++) {
        if (!codes[i]) continue;
        if (codes[i] == UCM_CORRUPT) return i;
        int64_t since = now_ns();
        int64_t r = ucm_get_slow(c, ids + 16 * (size_t)i, offsets[i], spin_budget,
                                 max_rollbacks, timeout_ns, NULL, slots_out + i, owner_out + i);
        if (r < 0) {
            *answer_out = -r;
            *since_out = since;
            return i;
        }
        lens_out[i] = (r & UCM_PIN_READY) ? (int64_t)UCM_PIN_LEN(r) : -1;
        if (owner_out[i]) serials_out[i] = ucm_load_serial(c, slots_out[i]);
    }
    return n;
}

int ucm_publish_many(ucm_ctx *c, const uint32_t *slots, const uint32_t *serials, uint32_t n,
                     const uint32_t *lengths, int32_t *answers_out)
{
    /* ucm_publish(slot, serial, UCM_READY, length) for each of n owned loads, each a step of
     * its own; every answer in answers_out (a refused one leaves the others published).
     * Returns how many were published. */
    int published = 0;
    for (uint32_t i = 0; i < n; i++) {
        answers_out[i] = ucm_publish(c, slots[i], serials[i], UCM_READY, lengths[i]);
        published += answers_out[i] == UCM_OK;
    }
    return published;
}

/* ---------------------------------------------------------------- delete, whole

   A delete makes a Ready entry unreachable at once (I2) and takes it out of its arena's words
   (I4), in one step under the key's stripe.  Its slot is not claimed (readers may pin it, and
   keep its bytes: I1); it stays Ready, uncounted, linked nowhere, so the CLOCK of its arena's
   owner reuses it once its last pin drops (step 1 of 4.3 takes any unheld slot; the install's
   uncount finds no COUNTED flag and its isolate no bucket).
   The words have one writer (I6): the deleter must be the arena's verified owner, so the
   Python layer takes the arena first when it is not (UCM_NOT_HELD names it).  While the step
   writes, the slot carries the deleter's pin (so nothing reuses it, even after a kill) and
   UCM_F_DELETING with the deleter's rank in the loader word, stored before the flag: a taker's
   verification sees the flag as another rank's write in flight (the Dekker pair of "Arenas",
   the flag playing the claim's part), and recovery acts on the mark only for its deleter.
   The loader word keeps the deleter's rank after the step (it is only a record on a Ready
   slot), so while a mark can be read, the loader word names its deleter or a later installer
   (whose claim rewrote the flags too), never an earlier rank.
   The stores in order, each prefix safe for a survivor before any recovery:
     pin (the slot cannot be reused) -> arena usable -> [delete_usable] -> loader = us,
     DELETING (seq_cst) -> [delete_marked] -> owner check -> DELETE_CHECKED ->
     [delete_checked] -> predecessor's link (unreachable) -> [mid_delete] -> bucket INVALID
     (matches nothing) -> uncount, COUNTED cleared -> accessed 0 -> [delete_uncounted] ->
     DELETING and DELETE_CHECKED cleared -> unpin.
   A kill anywhere after the mark leaves the dead rank's pin and mark; the stripe's next locker
   repairs its chains (a slot unlinked but naming the bucket is made INVALID, one linked but
   INVALID is dropped from the chain).  A checked mark: recovery (finish_deletes) finishes the
   delete under the stripe, recounts the arena, then drops the mark and the pin.  A mark not
   checked changed nothing: recovery drops it and the pin, and the entry stays. */
int ucm_delete(ucm_ctx *c, const char *id, uint64_t offset, uint32_t spin_budget,
               int64_t timeout_ns, uint32_t *arena_out)
{
    /* Answers: UCM_OK (deleted), UCM_MISS (no entry), UCM_IN_FLIGHT (Loading: not deleted),
     * UCM_NOT_HELD (*arena_out: the entry's arena is not ours and verified; UCM_NIL: no rank),
     * UCM_BUSY (the key's slot stays claimed under our stripe: a dead claimant, as in
     * ucm_get_slow), UCM_TIMEOUT (the stripe stayed held), UCM_CORRUPT. */
    *arena_out = UCM_NIL;
    if (c->rank < 0 || !ctx_live(c)) return UCM_NOT_HELD;
    uint64_t key[3];
    load_key(id, offset, key);
    uint32_t b = bucket_of_key(c, key), stripe = ucm_stripe_of(c, b);
    int r = lock_stripe_repairing(c, stripe, timeout_ns);
    if (r != UCM_OK) return r;
    uint32_t s = 0, state = 0, seen = 0;
    /* Exact under the stripe (nobody else links or unlinks in this chain); the pin keeps the
     * slot ours to finish, whatever happens to us (I1, I3). */
    r = lookup_pin_one(c, key, (uint32_t)ucm_generation(c), spin_budget, &s, &state);
    if (r != UCM_OK) {
        unlock_stripe(c, stripe);
        return r; /* MISS, BUSY, CORRUPT */
    }
    if (state != UCM_READY) { /* Loading: its owner publishes as usual */
        unpin(c, s);
        unlock_stripe(c, stripe);
        return UCM_IN_FLIGHT;
    }
    /* Marked already: under our stripe a mark is a dead deleter's (a live one clears its mark
     * before it unlocks), which its recovery finishes or drops without the stripe's holder
     * (clear_deletes).  Marking over it would let that recovery's clearing erase our mark
     * while we write (I6): BUSY, and the caller recovers dead ranks and calls again.
     * Acquire: pairs with a mark's seq_cst store, as in writes_through. */
    if (ACQ(flags_w(c, s)) & UCM_F_DELETING) {
        unpin(c, s);
        unlock_stripe(c, stripe);
        return UCM_BUSY;
    }
    uint32_t a = arena_of(c, s), me = (uint32_t)c->rank + 1;
    *arena_out = a;
    if (!arena_usable(c, a, &seen)) {
        unpin(c, s);
        unlock_stripe(c, stripe);
        return UCM_NOT_HELD;
    }
    POINT(c, UCM_PT_DELETE_USABLE);
    /* The deleter first (relaxed: published by the flag's store below), then the mark.
     * seq_cst store, then seq_cst loads of the owner word and our serial: the Dekker pair with
     * a taker's owner CAS and its verification's seq_cst flags load (foreign_activity).  Only
     * we write this slot's flags now: it is Ready and pinned (no claimant, no publisher). */
    SET_RLX(loader_w(c, s), (uint16_t)c->rank); /* a Ready slot's loader is only a record */
    __atomic_store_n(flags_w(c, s), (uint16_t)(RLX(flags_w(c, s)) | UCM_F_DELETING), __ATOMIC_SEQ_CST);
    POINT(c, UCM_PT_DELETE_MARKED);
    if (__atomic_load_n(owner_w(c, a), __ATOMIC_SEQ_CST) != me
        || __atomic_load_n(&c->arena_seen[a], __ATOMIC_SEQ_CST) != seen) {
        /* Taken from us meanwhile: nothing written but the mark, which goes (release: a taker
         * that sees it gone may verify).  The loader word keeps our rank: put back, a recoverer
         * of the old loader that read the mark before this store could read that rank after
         * it and take our delete for its own (the two words are not read as one). */
        __atomic_store_n(flags_w(c, s), (uint16_t)(RLX(flags_w(c, s)) & ~UCM_F_DELETING), __ATOMIC_RELEASE);
        unpin(c, s);
        unlock_stripe(c, stripe);
        return UCM_NOT_HELD;
    }
    /* Checked: the owner word and our serial read after our mark still say ours, so a taker
     * either came before our arena_usable (we would have seen it) or sees our mark and does
     * not verify: we are the arena's only writer (I6) from here.  A kill before this store
     * leaves a mark that changed nothing, which recovery only clears: a taker that verified
     * between our arena_usable and our mark may be writing the arena's words, and recounting
     * them under it would lose its count (I4).  Only we write these flags now (pinned, Ready,
     * marked).  Release: a recovery of another rank whose acquire load of the flags reads
     * CHECKED reads our loader word too by this store alone (not through the release sequence
     * of our mark; recovery of us reads it through the life lock). */
    SET_REL(flags_w(c, s), (uint16_t)(RLX(flags_w(c, s)) | UCM_F_DELETE_CHECKED));
    POINT(c, UCM_PT_DELETE_CHECKED);
    /* Unreachable at once (I2): the predecessor's link (release, in unlink_slot_at), then the
     * bucket word INVALID.  The neighbours are checked before anything is written. */
    r = unlink_slot_at(c, s, b, UCM_PT_MID_DELETE);
    if (r != UCM_OK) {
        /* Corrupt links: nothing written; the slot stays linked, counted and Ready. */
        /* Release, and the loader word left as it is: as when the arena was taken, above. */
        __atomic_store_n(flags_w(c, s),
                         (uint16_t)(RLX(flags_w(c, s)) & ~(UCM_F_DELETING | UCM_F_DELETE_CHECKED)),
                         __ATOMIC_RELEASE);
        unpin(c, s);
        unlock_stripe(c, stripe);
        return r;
    }
    /* Out of the words if counted in the current generation (I4; we are their writer, I6).
     * Relaxed reads: lookup_pin_one's acquire load of the Ready state (pairs with publish's
     * release exchange) ordered the publisher's words before us. */
    uint32_t g = RLX(gen_w(c, s));
    uint16_t f = RLX(flags_w(c, s));
    if ((f & UCM_F_COUNTED) && g == (uint32_t)ucm_generation(c)) {
        acc_sub(c, a, UCM_A_ACC_ENTRIES, g, 1);
        acc_sub(c, a, UCM_A_ACC_BYTES, g, RLX(len_w(c, s)));
    }
    /* Relaxed: read by recovery after our death (through the life lock) or by a later
     * claimant (after our unpin's release). */
    SET_RLX(flags_w(c, s), (uint16_t)(f & ~UCM_F_COUNTED));
    SET_RLX(acc_w(c, s), 0); /* CLOCK takes it at its first look once unpinned (a hint) */
    frees_bump(c);           /* a free slot once unpinned: our next claim looks for it */
    POINT(c, UCM_PT_DELETE_UNCOUNTED);
    /* Release: the step is done; a taker that sees the mark gone sees the words as we left
     * them (its verification's seq_cst load reads this store or a later one). */
    __atomic_store_n(flags_w(c, s),
                     (uint16_t)(f & ~(UCM_F_COUNTED | UCM_F_DELETING | UCM_F_DELETE_CHECKED)),
                     __ATOMIC_RELEASE);
    unpin(c, s);
    STAT(c, UCM_ST_DELETES, 1);
    unlock_stripe(c, stripe);
    return UCM_OK;
}

/* ---------------------------------------------------------------- stripe repair */

int ucm_stripe_repair(ucm_ctx *c, uint32_t stripe, uint32_t *dropped_out)
{
    /* The stripe's holder died mid-operation; we hold it now (EOWNERDEAD).  Rebuild every chain
     * it guards from the head by next pointers alone: keep slots whose bucket word names this
     * bucket and that we have not seen yet, rewrite prev links, stop at anything out of range.
     * Then every unclaimed slot that names one of these buckets but was not reached is made to
     * name none (INVALID), so no later install rewrites it in place as if it were linked.  A
     * slot half-linked by the dead holder is still claimed by it: rank recovery frees it. */
    if (stripe >= c->l.n_stripes) return UCM_CORRUPT;
    uint32_t dropped = 0;
    pthread_mutex_lock(&c->repair_lock);
    uint8_t *seen = c->repair_seen;
    memset(seen, 0, (c->l.n_slots + 7) / 8);
    for (uint64_t b = stripe; b < c->l.n_buckets; b += c->l.n_stripes) {
        uint32_t s = RLX(head_w(c, (uint32_t)b)), prev = UCM_NIL;
        uint64_t steps = 0;
        while (s != UCM_NIL && steps++ <= c->l.n_slots) {
            if (s >= c->l.n_slots) {
                dropped++;
                break;
            }
            uint32_t n = RLX(next_w(c, s));
            if (RLX(bucket_w(c, s)) != b || (seen[s / 8] & (1u << (s % 8)))) {
                dropped++;
                s = n;
                continue;
            }
            seen[s / 8] |= (uint8_t)(1u << (s % 8));
            SET_RLX(prev_w(c, s), prev);
            /* Release: as in unlink_slot, a walker following the new link sees s's fields. */
            if (prev == UCM_NIL) SET_REL(head_w(c, (uint32_t)b), s);
            else SET_REL(next_w(c, prev), s);
            prev = s;
            s = n;
        }
        if (prev == UCM_NIL) SET_REL(head_w(c, (uint32_t)b), UCM_NIL);
        else SET_REL(next_w(c, prev), UCM_NIL);
    }
    for (uint32_t s = 0; s < c->l.n_slots; s++) {
        uint32_t b = RLX(bucket_w(c, s));
        if (b == UCM_INVALID_BUCKET || (b < c->l.n_buckets && (b & c->stripe_mask) != stripe)) continue;
        if (seen[s / 8] & (1u << (s % 8))) continue;
        if (RLX(ref_w(c, s)) & UCM_CLAIMED) continue; /* its claimant's (or recovery's) business */
        SET_REL(bucket_w(c, s), UCM_INVALID_BUCKET); /* release: as in unlink_slot */
        dropped++;
    }
    pthread_mutex_unlock(&c->repair_lock);
    STAT(c, UCM_ST_STRIPE_REPAIRS, 1);
    *dropped_out = dropped;
    return UCM_OK;
}

/* ---------------------------------------------------------------- prefetch rings */

/* One ring per rank: many producers (any process), one consumer (the rank's prefetcher).
 * Producers serialise on a lock word that names the holder (rank + 1), taken only by CAS:
 * posting never blocks, a busy lock or a full ring drops the batch and counts it.  Positions
 * are free-running u32 counters; DEPTH divides 2^32 (checked in ucm_core.h), so tail - head is
 * the fill level. */
static inline ucm_ring *ring_at(ucm_ctx *c, uint32_t ring) { return (ucm_ring *)(c->base + c->l.ring_off + (uint64_t)ring * UCM_RING_SIZE); }
/* The words of the entry at a free-running position. */
static inline uint64_t *ring_entry(ucm_ring *r, uint32_t position) { return r->ENTRIES + (uint64_t)(position % UCM_RING_DEPTH) * UCM_RING_ENTRY_WORDS; }

int ucm_ring_post(ucm_ctx *c, uint32_t ring, const char *ids, const uint64_t *offsets,
                  uint32_t n, uint32_t *posted_out)
{
    *posted_out = 0;
    if (ring >= c->l.max_ranks || c->rank < 0) return UCM_CORRUPT;
    ucm_ring *r = ring_at(c, ring);
    uint32_t gen = (uint32_t)ucm_generation(c);
    /* Keys already Ready or Loading need no prefetch: skipped before taking the lock. */
    uint32_t keep = 0, present = 0;
    uint32_t *lock = r->LOCK;
    uint32_t free_lock = 0;
    /* Acquire: pairs with the previous holder's release in the unlock below, so its entry and
     * tail writes are visible before we write after them. */
    if (!__atomic_compare_exchange_n(lock, &free_lock, (uint32_t)c->rank + 1, 0, __ATOMIC_ACQUIRE,
                                     __ATOMIC_RELAXED)) {
        __atomic_fetch_add(r->DROPPED, n, __ATOMIC_RELAXED); /* a counter */
        return UCM_BUSY;
    }
    uint32_t *tailp = r->TAIL;
    uint32_t tail = RLX(tailp); /* only the lock holder writes the tail */
    /* Acquire: pairs with the consumer's release of head, so the entries it consumed are free. */
    uint32_t head = (uint32_t)ACQ(r->HEAD);
    int result = UCM_OK;
    for (uint32_t i = 0; i < n; i++) {
        uint64_t key[3];
        load_key(ids + 16 * (uint64_t)i, offsets[i], key);
        uint32_t s = find(c, bucket_of_key(c, key), gen, key, c->walk_limit);
        if (s < c->l.n_slots) {
            present++;
            continue;
        }
        if ((uint32_t)(tail - head) >= UCM_RING_DEPTH) {
            __atomic_fetch_add(r->DROPPED, n - i, __ATOMIC_RELAXED); /* a counter */
            result = UCM_FULL;
            break;
        }
        uint64_t *e = ring_entry(r, tail);
        SET_RLX(&e[0], key[0]);
        SET_RLX(&e[1], key[1]);
        SET_RLX(&e[2], key[2]);
        tail++;
        keep++;
    }
    /* Release: the entries written above are visible to the consumer that acquires the tail. */
    SET_REL(tailp, tail);
    /* Release: hands the ring (and our tail) to the next producer's acquire CAS. */
    SET_REL(lock, 0);
    __atomic_fetch_add(r->POSTED, keep, __ATOMIC_RELAXED);   /* counters */
    __atomic_fetch_add(r->PRESENT, present, __ATOMIC_RELAXED);
    /* seq_cst pairs with the consumer's seq_cst store of SLEEPING before its re-check of the
     * tail: either it sees our tail, or we see it sleeping and wake it (no lost wakeup). */
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    if (keep && __atomic_load_n(r->SLEEPING, __ATOMIC_RELAXED))
        futex_wake_word(tailp, INT32_MAX);
    *posted_out = keep;
    return result;
}

int ucm_ring_take(ucm_ctx *c, char *ids_out, uint64_t *offsets_out, uint32_t max,
                  int64_t timeout_ns, uint32_t *n_out)
{
    /* The consumer: our own rank's ring only.  Blocks (futex on the tail) while it is empty. */
    *n_out = 0;
    if (c->rank < 0) return UCM_NOT_HELD;
    ucm_ring *r = ring_at(c, (uint32_t)c->rank);
    uint32_t *tailp = r->TAIL;
    uint64_t *headp = r->HEAD;
    uint32_t head = (uint32_t)RLX(headp); /* only the consumer writes the head */
    /* Acquire: pairs with the producer's release of the tail (entries visible). */
    uint32_t tail = ACQ(tailp);
    if (tail == head) {
        if (timeout_ns == 0) return UCM_OK;
        __atomic_store_n(r->SLEEPING, 1, __ATOMIC_SEQ_CST); /* see ucm_ring_post */
        __atomic_thread_fence(__ATOMIC_SEQ_CST);
        tail = ACQ(tailp);
        if (tail == head) futex_wait_word(tailp, tail, timeout_ns);
        __atomic_store_n(r->SLEEPING, 0, __ATOMIC_RELAXED); /* only a hint now */
        tail = ACQ(tailp);
    }
    uint32_t avail = tail - head;
    if (avail > UCM_RING_DEPTH) return UCM_CORRUPT; /* positions from a corrupt ring */
    uint32_t n = avail < max ? avail : max;
    for (uint32_t i = 0; i < n; i++) {
        const uint64_t *e = ring_entry(r, head + i);
        uint64_t k0 = RLX(&e[0]), k1 = RLX(&e[1]);
        memcpy(ids_out + 16 * (uint64_t)i, &k0, 8);
        memcpy(ids_out + 16 * (uint64_t)i + 8, &k1, 8);
        offsets_out[i] = RLX(&e[2]);
    }
    /* Release: our reads of the entries are done before a producer reuses their places. */
    SET_REL(headp, (uint64_t)(head + n));
    *n_out = n;
    return UCM_OK;
}

int ucm_ring_wake(ucm_ctx *c, uint32_t ring)
{
    /* Wake a consumer sleeping on its ring (used to stop it promptly). */
    if (ring >= c->l.max_ranks) return UCM_CORRUPT;
    futex_wake_word(ring_at(c, ring)->TAIL, INT32_MAX);
    return UCM_OK;
}

/* ---------------------------------------------------------------- recovery (I5) */

static uint32_t recover_pins(ucm_ctx *c, uint32_t dead, uint32_t *pins_out, uint32_t *loading_out)
{
    /* Phase 1 of a rank's recovery: its Loading slots become Failed while its pin still keeps
     * them from being reclaimed, waking their waiters; then its pin bits are cleared.  Returns
     * how many slots it still claims (freed in phase 2, each under its stripe). */
    uint64_t bit = 1ULL << dead, claim = UCM_CLAIMED | dead;
    uint32_t n_claimed = 0, pins = 0, loading = 0;
    char msg[64];
    int msg_len = snprintf(msg, sizeof msg, "the loader (rank %u) died before publishing", dead);
    for (uint32_t s = 0; s < c->l.n_slots; s++) {
        uint64_t r = ACQ(ref_w(c, s)); /* acquire: the dead rank's last writes to the slot */
        if (r == claim) {
            n_claimed++;
            continue;
        }
        if (r & UCM_CLAIMED || !(r & bit)) continue;
        /* Relaxed: the state and loader of a slot the dead rank pins as its loader were last
         * written by that rank (visible: see ucm_recover_rank); publish by others needs its
         * pin, which it does not hold. */
        if ((RLX(state_w(c, s)) & UCM_STATE_MASK) == UCM_LOADING && RLX(loader_w(c, s)) == dead) {
            fail_loading(c, s, msg, (uint32_t)msg_len);
            loading++;
        }
        /* Release: as in unpin; our writes above happen before a claimant's acquire. */
        __atomic_fetch_and(ref_w(c, s), ~bit, __ATOMIC_RELEASE);
        pins++;
    }
    /* A producer that died holding a ring's lock: the lock names it, so release it. */
    for (uint32_t ring = 0; ring < c->l.max_ranks; ring++) {
        uint32_t held = dead + 1;
        /* Release: as the producer's own unlock would have. */
        __atomic_compare_exchange_n(ring_at(c, ring)->LOCK, &held, 0, 0,
                                    __ATOMIC_RELEASE, __ATOMIC_RELAXED);
    }
    *pins_out = pins;
    *loading_out = loading;
    return n_claimed;
}

static int reclaim_claimed(ucm_ctx *c, uint32_t s, uint32_t dead, uint32_t held_stripe)
{
    /* A slot the dead rank claimed: it may be anywhere between claim and handover.  With the
     * stripe of its bucket word held (or any stripe, for INVALID), unlink it if it is reachable,
     * make it Empty and unclaim it.  A slot that a half-done link left unreachable but with a
     * bucket word is freed the same way. */
    if (ACQ(ref_w(c, s)) != (UCM_CLAIMED | dead)) return UCM_NOT_HELD;
    uint32_t b = RLX(bucket_w(c, s));
    if (b != UCM_INVALID_BUCKET) {
        if (b >= c->l.n_buckets) {
            SET_REL(bucket_w(c, s), UCM_INVALID_BUCKET);
        } else {
            if (ucm_stripe_of(c, b) != held_stripe) return UCM_NOT_HELD;
            uint32_t x = ACQ(head_w(c, b));
            uint64_t steps = 0;
            while (x != UCM_NIL && x < c->l.n_slots && x != s && steps++ <= c->l.n_slots) x = RLX(next_w(c, x));
            if (x != s || unlink_slot(c, s, b) != UCM_OK) {
                /* Not reachable from its bucket (a half-done link), or its neighbours disagree:
                 * rebuild the stripe's chains without it. */
                SET_REL(bucket_w(c, s), UCM_INVALID_BUCKET);
                uint32_t dropped;
                ucm_stripe_repair(c, held_stripe, &dropped);
            }
        }
    }
    SET_RLX(flags_w(c, s), 0); /* its arena was recounted without it (ucm_recover_rank) */
    uint32_t old = __atomic_exchange_n(state_w(c, s), UCM_EMPTY, __ATOMIC_RELEASE); /* as in publish */
    if (old & UCM_WAITERS) futex_wake_word(state_w(c, s), INT32_MAX);
    frees_bump(c); /* the recoverer's own; the others learn of it by the arena epoch's bump */
    unclaim(c, s);
    return UCM_OK;
}

/* A dead rank's deletes in flight past their owner check (UCM_F_DELETING and
 * UCM_F_DELETE_CHECKED with the loader word naming it; a pinner's death never counts, nor another
 * deleter's mark, nor a mark made before its check, which changed nothing and is only dropped
 * in clear_deletes): each is finished, under the stripe of its
 * bucket word (taken here with lock_stripe_repairing, which first repairs the chains the dead
 * deleter's stripe guarded): unlinked if still reachable, INVALID, COUNTED cleared.  The mark
 * and the dead rank's pin stay: the arena is recounted next (ucm_recover_rank) while the mark
 * keeps a new owner from verifying it (I6); only then are they dropped (clear_deletes, then
 * recover_pins).  UCM_TIMEOUT (*stripe_out): a stripe stayed held; nothing was released. */
static int finish_deletes(ucm_ctx *c, uint32_t dead, int64_t stripe_timeout_ns, uint32_t *stripe_out)
{
    for (uint32_t s = 0; s < c->l.n_slots; s++) {
        /* The dead rank's writes are visible because the kernel handed us its life lock after
         * its death (see ucm_recover_rank).  A live deleter may be marking meanwhile: acquire
         * on the flags pairs with its seq_cst mark store, made after its loader store, so a
         * mark read here comes with the rank that made it (as in writes_through). */
        uint16_t f = ACQ(flags_w(c, s));
        if (!(f & UCM_F_DELETING) || RLX(loader_w(c, s)) != dead) continue;
        /* Not checked: it died before it saw itself the arena's owner after its mark, having
         * written nothing but the mark; the entry stays, the mark goes in clear_deletes. */
        if (!(f & UCM_F_DELETE_CHECKED)) continue;
        uint32_t b = RLX(bucket_w(c, s));
        if (b != UCM_INVALID_BUCKET && b >= c->l.n_buckets) {
            SET_REL(bucket_w(c, s), UCM_INVALID_BUCKET); /* linked nowhere: as in isolate */
        } else if (b != UCM_INVALID_BUCKET) {
            uint32_t stripe = ucm_stripe_of(c, b);
            int r = lock_stripe_repairing(c, stripe, stripe_timeout_ns);
            if (r != UCM_OK) {
                *stripe_out = stripe;
                return r == UCM_CORRUPT ? UCM_CORRUPT : UCM_TIMEOUT;
            }
            b = RLX(bucket_w(c, s)); /* a repair may have made it INVALID */
            if (b != UCM_INVALID_BUCKET) {
                /* Acquire head, relaxed links: we hold the stripe, so nobody else changes them. */
                uint32_t x = ACQ(head_w(c, b));
                uint64_t steps = 0;
                while (x != UCM_NIL && x < c->l.n_slots && x != s && steps++ <= c->l.n_slots)
                    x = RLX(next_w(c, x));
                if (x != s || unlink_slot_at(c, s, b, 0) != UCM_OK) {
                    /* Killed between the predecessor's link and the INVALID store (mid_delete),
                     * or neighbours disagreeing: rebuild the stripe's chains without it, as
                     * reclaim_claimed does. */
                    SET_REL(bucket_w(c, s), UCM_INVALID_BUCKET); /* release: as in unlink_slot */
                    uint32_t dropped;
                    ucm_stripe_repair(c, stripe, &dropped);
                }
            }
            unlock_stripe(c, stripe);
        }
        /* Out of the words: the recount that follows counts it no more (relaxed: only the
         * recoverer writes a dead deleter's marked slot; its pin keeps claimants away). */
        SET_RLX(flags_w(c, s), (uint16_t)(RLX(flags_w(c, s)) & ~UCM_F_COUNTED));
        SET_RLX(acc_w(c, s), 0); /* relaxed: CLOCK's hint, as in ucm_delete */
    }
    return UCM_OK;
}

static void clear_deletes(ucm_ctx *c, uint32_t dead, int checked_too)
{
    /* After the recount: the dead deleter's marks go, checked or not (release: a taker that
     * sees one gone sees the recounted words), then recover_pins drops its pins and the slots
     * can be reused.  checked_too 0: only the unchecked ones (finish_deletes timed out).  An
     * atomic and: the flags' other bits are never rewritten from a stale read (a live deleter
     * never marks over a mark, ucm_delete: BUSY, so the mark we clear is the dead rank's). */
    for (uint32_t s = 0; s < c->l.n_slots; s++) { /* acquire, then relaxed: as in finish_deletes */
        uint16_t f = ACQ(flags_w(c, s));
        if (!(f & UCM_F_DELETING) || RLX(loader_w(c, s)) != dead) continue;
        if (!checked_too && (f & UCM_F_DELETE_CHECKED)) continue;
        __atomic_fetch_and(flags_w(c, s), (uint16_t)~(UCM_F_DELETING | UCM_F_DELETE_CHECKED),
                           __ATOMIC_RELEASE);
    }
}

int ucm_recover_rank(ucm_ctx *c, uint32_t dead, int64_t stripe_timeout_ns, int32_t count_in_rank,
                     uint32_t *counts_out)
{
    /* Every hold of a dead rank, removed in one step (I5); the caller holds the rank's life
     * lock, so the rank cannot come back meanwhile.  counts_out: [pins, failed loads, claims
     * freed, the stripe that stayed held (UCM_NIL if none)].  Each claimed slot is freed under
     * its bucket's stripe, taken and dropped here, so the Python layer never holds a stripe.
     * The arenas it was writing are recounted first (exact whatever step it died in: I4, I5,
     * I6), the arenas it owned are freed, and the rank is made FREE and counted last.  UCM_TIMEOUT: a stripe stayed held past the
     * deadline; what was done stays done and the rest is found again by the next recovery. */
    if (dead >= c->l.max_ranks) return UCM_CORRUPT;
    uint32_t pins = 0, loading = 0, freed = 0;
    counts_out[0] = counts_out[1] = counts_out[2] = 0;
    counts_out[3] = UCM_NIL;
    /* Its deletes in flight are finished first, under their stripes, while its pins and marks
     * keep their slots from reuse; a stripe past the deadline leaves everything held. */
    int dr = finish_deletes(c, dead, stripe_timeout_ns, &counts_out[3]);
    if (dr != UCM_OK) {
        /* A stripe stayed held: its unchecked marks go anyway (they changed nothing, need no
         * stripe and no recount), so they keep no taker from verifying their arenas while the
         * next recovery waits for that stripe; checked ones and every pin stay. */
        clear_deletes(c, dead, 0);
        return dr;
    }
    /* First the arenas it was writing, while its holds there still keep a new owner from
     * verifying them and writing too (I6); the holds are released below. */
    for (uint32_t a = 0; a < c->l.n_arenas; a++) {
        for (uint64_t i = (uint64_t)a * c->l.arena_slots; i < arena_end(c, a); i++) {
            if (writes_through(c, (uint32_t)i, dead)) {
                uint64_t entries, bytes;
                ucm_recount_arena(c, a, &entries, &bytes);
                break;
            }
        }
    }
    clear_deletes(c, dead, 1);
    uint32_t claimed = recover_pins(c, dead, &pins, &loading);
    int result = UCM_OK;
    counts_out[3] = UCM_NIL;
    for (uint32_t s = 0; claimed && s < c->l.n_slots; s++) {
        /* Relaxed: the dead rank's writes are visible because the kernel handed us its life
         * lock after its death (fcntl), not through this word; only we change its claims. */
        if (RLX(ref_w(c, s)) != (UCM_CLAIMED | dead)) continue;
        claimed--;
        if (!(RLX(flags_w(c, s)) & UCM_F_INSTALLING) && (RLX(state_w(c, s)) & UCM_STATE_MASK) != UCM_LOADING) {
            /* Claimed, not installing (before or after a failed ownership check): nothing was
             * written, the slot is as its last owner left it. */
            unclaim(c, s);
            freed++;
            continue;
        }
        uint32_t b = RLX(bucket_w(c, s)); /* relaxed: as above; only the claimant wrote it */
        if (b >= c->l.n_buckets) { /* linked nowhere (INVALID, or a bad word): no chain to fix */
            if (reclaim_claimed(c, s, dead, 0) == UCM_OK) freed++;
            continue;
        }
        uint32_t stripe = ucm_stripe_of(c, b);
        int r = lock_stripe_repairing(c, stripe, stripe_timeout_ns);
        if (r != UCM_OK) {
            counts_out[3] = stripe;
            result = r == UCM_CORRUPT ? UCM_CORRUPT : UCM_TIMEOUT;
            break;
        }
        if (reclaim_claimed(c, s, dead, stripe) == UCM_OK) freed++;
        unlock_stripe(c, stripe);
    }
    /* Its arenas are free for the others to take (a hold left by a cut-short phase 2 keeps
     * them from verifying one until the next recovery frees it).  seq_cst: as a take. */
    uint32_t owned = 0;
    for (uint32_t a = 0; a < c->l.n_arenas; a++) {
        uint32_t expected = dead + 1;
        owned += __atomic_compare_exchange_n(owner_w(c, a), &expected, 0, 0, __ATOMIC_SEQ_CST,
                                             __ATOMIC_RELAXED);
    }
    /* Announced at once (the others take free arenas at their next allocation whatever the
     * shares), and again after FREE below (the shares changed): a recoverer killed between
     * the two still announced the arenas.  seq_cst, though it orders nothing: ranks only
     * compare it with the value they saw. */
    if (owned) __atomic_fetch_add(header(c)->ARENA_EPOCH, 1, __ATOMIC_SEQ_CST);
    counts_out[0] = pins;
    counts_out[1] = loading;
    counts_out[2] = freed;
    if (result == UCM_OK) {
        /* Done: the rank is FREE (for the caller to take, or for anyone once the caller drops
         * its life lock), and counted, in this same step, so no exception in the caller can
         * leave a recovered rank looking dead (recovered twice) or uncounted.  Release: our
         * writes above happen before a taker's acquire of the state.  The count goes in
         * count_in_rank's stats line (the recoverer's rank, or the rank it is taking; < 0:
         * not counted, as for a close of our own rank); relaxed: a counter. */
        ucm_rank_desc *desc = rank_desc(c, dead);
        SET_REL(desc->PID, 0);
        SET_REL(desc->STATE, UCM_RANK_FREE);
        if (count_in_rank >= 0 && (uint32_t)count_in_rank < c->l.max_ranks)
            __atomic_fetch_add(&rank_desc(c, (uint32_t)count_in_rank)->STATS[UCM_ST_RECOVERED_RANKS],
                               1, __ATOMIC_RELAXED);
    }
    /* After FREE: a rank that looks at its share now sees one rank fewer.  seq_cst: as above. */
    if (result == UCM_OK) __atomic_fetch_add(header(c)->ARENA_EPOCH, 1, __ATOMIC_SEQ_CST);
    return result;
}
