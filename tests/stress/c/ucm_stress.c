/*
 * ucm_stress.c: the C core's protocol steps driven by several threads at once, with no Python,
 * for ThreadSanitizer (and ASan/UBSan): scripts/tsan builds it with csrc/ucm_core.c and runs it.
 *
 * One segment in anonymous shared memory, laid out by ucm_layout_compute and initialised the way
 * ucmcache/core/segment.py's Segment._initialise does it (there is no C init step).  A tiny table (a
 * few ranks, a few slots per rank, few buckets and stripes), so that collisions, evictions, FULL
 * and arena moves are constant.  Threads stand for processes: each rank is one ucm_ctx, used by
 * one thread (rank 0: by --rank0-threads threads, threads of one process sharing its pins).
 *
 * Each thread runs a random mix of: ucm_lookup_pin, ucm_get_slow (claim, evict, install; MOVED,
 * FULL, ROLLBACK, BUSY handled the way ucmcache/core/cache.py's _pin_slow does, with a small arena
 * policy after ucmcache/core/arenas.py), the owner writing the payload and ucm_publish (Ready, or
 * Failed with a message), ucm_abandon_many, the C miss path's steps as ucmcache/_hit makes them
 * (get_or_load: ucm_get_slow into a stack token, then ucm_load_finish; get()'s owner handle:
 * ucm_get_slow into the token it keeps, ucm_token_publish, ucm_token_drop), waits
 * (ucm_wait_loaded, ucm_wait_ready) on other ranks' loads,
 * ucm_release, ucm_read_many (both row paths), ucm_lookup_pin_many + ucm_gather,
 * ucm_pin_all_ready, ucm_pin_again_many, ucm_exist1/_many/_prefix, ucm_touch_many, the prefetch
 * rings, and ucm_clear now and then.  Payload bytes are a function of the key, so every byte read
 * through a pin (or copied by read_many/gather) is checked: a wrong byte or length aborts with a
 * message naming the key, the slot and the offset.
 *
 * Deaths.  Life locks are OFD locks per process, which threads cannot stand for; here a rank's
 * death is a state word (life[r]) and its thread stops using its ctx for good, holding what it
 * held: pins on Ready and Loading slots, an owned Loading slot with half its payload written, a
 * claim from ucm_clock_claim (INSTALLING), a stripe mutex (the thread exits holding it: the robust
 * mutex hands the next locker EOWNERDEAD and the core repairs the stripe), or parked for good at
 * one of the core's named points (a GATE that is never opened: CLAIM_UNCHECKED, AFTER_PIN,
 * BEFORE_PIN_CAS, COUNTED_NOT_READY (reached through ucm_publish or ucm_token_publish),
 * BEFORE_COPY), or exited at one of the delete's points, which lie under the key's stripe
 * (UCM_ACT_EXIT: DELETE_USABLE, DELETE_MARKED, DELETE_CHECKED, MID_DELETE, DELETE_UNCOUNTED; the
 * mutex passes EOWNERDEAD as above), or at one of the finish's (LOAD_COPIED, LOAD_PUBLISHED,
 * inside ucm_load_finish: a token on the dead stack, its pin bit and loader word left).  A
 * context whose reference a dead thread's token still holds is kept, never freed (kept_ctx),
 * as a real death's memory goes with its process.  Another thread then recovers it with
 * ucm_recover_rank, which the core requires only to be exclusive for that rank and to run after
 * the rank's last write (Python: the life lock; here: a CAS on life[r], after an acquire of the
 * death word, or of the gate word the parked thread bumped: the happens-before the kernel gives
 * through the life lock).  A new thread with a new ctx then takes the rank again, as
 * _recovery.take_rank does, and carries on with the rank's remaining iterations.
 *
 * At the end: every rank's holds released, the remaining ranks closed the way SlotCache.close
 * does (ucm_ctx_close, then ucm_recover_rank of its own rank); checked: no reference word set (no
 * pin, no claim), no Loading slot (a Loading slot without a live loader pinning it), every
 * arena's accounting words equal to a recount of its slots, every chain well formed, every Ready
 * slot's bytes its key's, every stripe free, every arena free and every rank FREE.
 *
 * Usage: ucm_stress [--seed N] [--iterations N] [--ranks N] [--slots-per-rank N]
 *                   [--slot-size N] [--buckets N] [--stripes N] [--rank0-threads N]
 *                   [--deaths N] [--hold N] [--quiet]
 * Deterministic per seed in what each thread asks for; the interleaving is the scheduler's.
 */
#define _GNU_SOURCE
#include "ucm_core.h"

#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <sched.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

/* ------------------------------------------------------------------ a ThreadSanitizer gap */

#if defined(__SANITIZE_THREAD__)
/* gcc 12's libtsan records a lock taken by pthread_mutex_timedlock only when the call returns
 * 0.  A robust mutex whose holder died is taken with EOWNERDEAD (POSIX: the caller holds it
 * now, and must make it consistent), which the core's lock_stripe_repairing does; TSan then
 * reports the holder's unlock as "unlock of an unlocked mutex" and misses the lock's
 * happens-before edges.  Its pthread_mutex_lock and pthread_mutex_trylock interceptors do handle
 * EOWNERDEAD (MutexRepair), so under TSan this program's timed lock is a trylock loop with the
 * same contract (0, EOWNERDEAD, ETIMEDOUT at the absolute CLOCK_REALTIME deadline, as glibc's).
 * The executable's definition interposes on every call of the core linked into it.  A
 * two-thread reproducer of the gap: a thread locks a robust mutex and exits; the main thread's
 * pthread_mutex_timedlock answers EOWNERDEAD; consistent; unlock -> the TSan report. */
int pthread_mutex_timedlock(pthread_mutex_t *m, const struct timespec *abstime)
{
    for (;;) {
        int r = pthread_mutex_trylock(m);
        if (r != EBUSY) return r;
        struct timespec now;
        clock_gettime(CLOCK_REALTIME, &now);
        if (now.tv_sec > abstime->tv_sec || (now.tv_sec == abstime->tv_sec && now.tv_nsec >= abstime->tv_nsec))
            return ETIMEDOUT;
        struct timespec nap = {0, 20000};
        nanosleep(&nap, NULL);
    }
}
#endif

/* ------------------------------------------------------------------ parameters */

static uint64_t opt_seed = 1;
static uint64_t opt_iterations = 4000; /* per thread */
static uint32_t opt_ranks = 4;
static uint64_t opt_slots_per_rank = 10;
static uint64_t opt_slot_size = 200;
static uint64_t opt_buckets = 8;
static uint32_t opt_stripes = 4;
static uint32_t opt_rank0_threads = 2;
static uint32_t opt_deaths = 12;
static uint32_t opt_hold = 3;
static int opt_quiet = 0;

#define MAX_RANKS_HERE 16
#define MAX_HELD 8
#define MAX_BATCH 8
#define SPIN 16
#define STRIPE_WAIT_NS 200000000LL     /* one slow-path call's stripe wait */
#define GIVE_UP_NS 20000000000LL       /* a get that cannot allocate for this long gives up */
#define RECOVERY_STRIPE_NS 2000000000LL
#define PARK_NS (3600LL * 1000000000LL) /* a dead rank's gate: never opened */

static const char MSG_FAILED[] = "stress: the loader failed";
static const char MSG_ABANDONED[] = "stress: the owner abandoned its load";

/* ------------------------------------------------------------------ small helpers */

static void die(const char *fmt, ...) __attribute__((noreturn, format(printf, 1, 2)));
static void die(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "ucm_stress: FAIL: ");
    vfprintf(stderr, fmt, ap);
    fprintf(stderr, " (seed %" PRIu64 ")\n", opt_seed);
    va_end(ap);
    fflush(stderr);
    abort();
}

static uint64_t sm64(uint64_t x)
{
    x += 0x9e3779b97f4a7c15ULL;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
    return x ^ (x >> 31);
}

typedef struct { uint64_t s; } rng_t;
static uint64_t rnd(rng_t *r) { return sm64(r->s++); }
static uint32_t below(rng_t *r, uint32_t n) { return (uint32_t)(rnd(r) % n); }
static int chance(rng_t *r, uint32_t per_mille) { return below(r, 1000) < per_mille; }

static int64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static void nap_us(long us)
{
    struct timespec ts = {us / 1000000, (us % 1000000) * 1000};
    nanosleep(&ts, NULL);
}

/* ------------------------------------------------------------------ the segment */

static ucm_layout L;
static char *base;
static uint32_t n_keys;

static void segment_make(void)
{
    memset(&L, 0, sizeof L);
    L.max_ranks = opt_ranks;
    L.n_stripes = opt_stripes;
    L.slots_per_rank = opt_slots_per_rank;
    L.slot_size = opt_slot_size;
    L.n_buckets = opt_buckets;
    int r = ucm_layout_compute(&L);
    if (r != UCM_OK) die("ucm_layout_compute: parameter error %d", r);
    base = mmap(NULL, L.total_size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (base == MAP_FAILED) die("mmap %" PRIu64 " bytes: %s", L.total_size, strerror(errno));
    /* As Segment._initialise: every word but the magic in one step, then the magic. */
    int e = ucm_segment_init(base, &L, (uint32_t)getpid(), (uint32_t)getuid());
    if (e) die("pthread_mutex_init (robust, process-shared): %s", strerror(e));
    ucm_segment_publish(base);
    /* What an attacher checks first (Segment.attach / _validate), on our own header. */
    if (ucm_load64(base, UCM_H_MAGIC) != UCM_MAGIC || ucm_load32(base, UCM_H_VERSION) != UCM_LAYOUT_VERSION
        || ucm_load32(base, UCM_H_LAYOUT_FP) != ucm_layout_fingerprint()
        || ucm_load32(base, UCM_H_PARAMS_CRC) != ucm_params_crc(base))
        die("the header we wrote does not validate");
}

static uint64_t meta_off(uint32_t s) { return L.meta_off + (uint64_t)s * UCM_META_SIZE; }
static uint64_t rank_off(uint32_t r) { return L.rank_off + (uint64_t)r * UCM_RANK_SIZE; }
static uint32_t home_rank(uint32_t a)
{
    uint64_t h = (uint64_t)a * L.arena_slots / L.slots_per_rank;
    return h < L.max_ranks ? (uint32_t)h : L.max_ranks - 1;
}

/* ------------------------------------------------------------------ keys and payloads */

/* Key i: id = two words derived from i, offset i % 3.  Its payload: exp_len(i) bytes, byte j a
 * function of (i, j), so a reader that pinned key i can check every byte it sees. */
static void key_of(uint32_t i, char id[16], uint64_t *offset)
{
    uint64_t k0 = sm64((uint64_t)i * 2 + 0x5151), k1 = sm64((uint64_t)i ^ 0xa5a5a5a5a5ULL);
    memcpy(id, &k0, 8);
    memcpy(id + 8, &k1, 8);
    *offset = i % 3;
}

static uint32_t exp_len(uint32_t i)
{
    if (i % 5 == 0) return (uint32_t)L.slot_size; /* a full slot now and then */
    return 1 + (uint32_t)(sm64((uint64_t)i + 77) % L.slot_size);
}

static inline uint8_t exp_byte(uint32_t i, uint32_t j)
{
    return (uint8_t)(sm64(((uint64_t)i << 32) | (j >> 3)) >> ((j & 7) * 8)) ^ (uint8_t)i;
}

static void check_bytes(const char *what, uint32_t key, uint32_t slot, const uint8_t *p, uint64_t len)
{
    if (len != exp_len(key))
        die("%s: key %u (slot %u) has length %" PRIu64 ", its key's is %u", what, key, slot, len,
            exp_len(key));
    for (uint32_t j = 0; j < len; j++)
        if (p[j] != exp_byte(key, j))
            die("%s: key %u (slot %u) byte %u is %#x, its key's is %#x: another key's bytes", what,
                key, slot, j, p[j], exp_byte(key, j));
}

static uint32_t key_of_slot_words(uint32_t s, int *found)
{
    /* The key index whose words slot s holds (end checks only). */
    uint64_t k0 = ucm_load64(base, meta_off(s) + UCM_M_KEY), k1 = ucm_load64(base, meta_off(s) + UCM_M_KEY + 8);
    uint64_t k2 = ucm_load64(base, meta_off(s) + UCM_M_KEY + 16);
    for (uint32_t i = 0; i < n_keys; i++) {
        char id[16];
        uint64_t off, a, b;
        key_of(i, id, &off);
        memcpy(&a, id, 8);
        memcpy(&b, id + 8, 8);
        if (a == k0 && b == k1 && off == k2) {
            *found = 1;
            return i;
        }
    }
    *found = 0;
    return 0;
}

/* ------------------------------------------------------------------ counters */

enum {
    C_GETS, C_FAST_HITS, C_SLOW_HITS, C_LOADS, C_READY, C_FAILED_PUB, C_ABANDONED, C_JOINS,
    C_WAITS, C_WAIT_READY, C_WAIT_FAILED, C_WAIT_GAVE_UP, C_BYTES_CHECKED, C_READ_MANY,
    C_READ_ROWS, C_GATHERS, C_GATHER_ROWS, C_ALL_READY, C_EXISTS, C_CLEARS, C_FULL, C_ROLLBACK,
    C_BUSY, C_TIMEOUT, C_MOVED, C_GAVE_UP, C_TAKES, C_GIVEN_BACK, C_DEATHS, C_PARKED,
    C_RECOVERIES, C_REC_PINS, C_REC_LOADS, C_REC_CLAIMS, C_REC_TIMEOUT, C_RING_POSTED,
    C_RING_TAKEN, C_LIVES, C_DELETES, C_DELETE_TAKES, C_EXITED_AT_POINT, C_FINISHED,
    C_TOKEN_OWNERS, C_TOKEN_PUBLISHED, C_ROOM, C_ROOM_TAKES, C_N
};
static const char *counter_names[C_N] = {
    "gets", "fast_hits", "slow_hits", "loads", "ready", "failed_pub", "abandoned", "joins",
    "waits", "wait_ready", "wait_failed", "wait_gave_up", "bytes_checked", "read_many",
    "read_rows", "gathers", "gather_rows", "all_ready", "exists", "clears", "full", "rollback",
    "busy", "timeout", "moved", "gave_up", "arena_takes", "arenas_given_back", "deaths", "parked",
    "recoveries", "rec_pins", "rec_loads", "rec_claims", "rec_timeouts", "ring_posted",
    "ring_taken", "lives", "deletes", "delete_takes", "exited_at_point", "finished",
    "token_owners", "token_published", "room", "room_takes",
};
static uint64_t counters[C_N];
#define COUNT(i, n) __atomic_fetch_add(&counters[i], (n), __ATOMIC_RELAXED)

/* ------------------------------------------------------------------ ranks and lives */

enum { LIFE_ALIVE, LIFE_GATED, LIFE_DEAD, LIFE_RECOVERING, LIFE_FREE, LIFE_DONE };

enum {
    DEATH_HOLDS,        /* just stops, holding its pins and loads */
    DEATH_HALF_LOADED,  /* an owned load with half its payload written */
    DEATH_CLAIM,        /* an INSTALLING claim from ucm_clock_claim */
    DEATH_STRIPE,       /* the thread exits holding a stripe (EOWNERDEAD), maybe a claim too */
    DEATH_GATE_CLAIM_UNCHECKED,
    DEATH_GATE_AFTER_PIN,
    DEATH_GATE_BEFORE_PIN_CAS,
    DEATH_GATE_COUNTED,
    DEATH_GATE_BEFORE_COPY,
    DEATH_GATE_DELETE_MARKED,   /* a delete: marked, the arena's owner not yet checked again */
    DEATH_GATE_MID_DELETE,      /* a delete: unlinked, bucket word not yet INVALID */
    DEATH_GATE_DELETE_UNCOUNTED, /* a delete: uncounted, still marked */
    DEATH_GATE_DELETE_USABLE,   /* a delete: its arena found usable, not yet marked */
    DEATH_GATE_DELETE_CHECKED,  /* a delete: marked and checked, nothing unlinked */
    DEATH_GATE_LOAD_COPIED,     /* a cold load's finish: the value copied in, still Loading */
    DEATH_GATE_LOAD_PUBLISHED,  /* a cold load's finish: published and observed, still pinned */
    DEATH_KINDS
};
static const char *death_names[DEATH_KINDS] = {
    "holds", "half_loaded", "claim", "stripe", "gate_claim_unchecked", "gate_after_pin",
    "gate_before_pin_cas", "gate_counted_not_ready", "gate_before_copy", "gate_delete_marked",
    "gate_mid_delete", "gate_delete_uncounted", "gate_delete_usable", "gate_delete_checked",
    "gate_load_copied", "gate_load_published"};
static uint64_t death_counts[DEATH_KINDS];
static uint64_t exits_at[UCM_PT_COUNT]; /* threads that exited at each named point */

struct life {
    uint32_t rank;
    uint32_t number;       /* which life of the rank */
    ucm_ctx *ctx;
    uint32_t gate;         /* the named point's gate word, for a death at a point */
    int parked;            /* its thread stays parked inside the core for good */
    int exited_holding;    /* its thread exits (a stripe held: EOWNERDEAD for the next locker) */
    int ctx_kept;          /* a token of its dead thread still holds a reference on ctx */
    pthread_t threads[MAX_RANKS_HERE];
    uint32_t n_threads;
    uint64_t iterations;   /* per thread of this life */
    pthread_mutex_t policy; /* the arena policy, one thread of the rank at a time (_arenas.py) */
    uint32_t held_pins_at_end;
};

static struct {
    int life;              /* LIFE_*: the death word, see the header comment */
    struct life *cur;
    uint64_t left;         /* iterations the rank still has to run (mortal ranks) */
    int64_t dead_since;
} ranks[MAX_RANKS_HERE];

static uint32_t deaths_left;  /* deaths still allowed in this run */
static struct life *graveyard[4096]; /* lives whose ctx a parked thread keeps: never freed */
static ucm_ctx *kept_ctx[4096];     /* contexts a dead thread's token keeps: never freed */
static uint32_t n_kept_ctx;
static uint32_t n_graveyard;

static int life_state(uint32_t r) { return __atomic_load_n(&ranks[r].life, __ATOMIC_ACQUIRE); }

/* The rank's descriptor, as _recovery._take_locked: the rank is ours (our "life lock": no
 * other life of it runs); CAS FREE -> INITIALIZING, pid, attaches, READY, then the arena epoch
 * (the others leave us our share at their next allocation). */
static void take_rank(uint32_t r)
{
    uint64_t d = rank_off(r);
    if (!ucm_cas32(base, d + UCM_R_STATE, UCM_RANK_FREE, UCM_RANK_INITIALIZING))
        die("rank %u's state word is %u, not FREE, when its new life takes it", r,
            ucm_load32(base, d + UCM_R_STATE));
    ucm_store32(base, d + UCM_R_PID, (uint32_t)getpid());
    ucm_fetch_add64(base, d + UCM_R_ATTACHES, 1);
    ucm_store32(base, d + UCM_R_STATE, UCM_RANK_READY);
    ucm_fetch_add64(base, UCM_H_ARENA_EPOCH, 1);
}

/* ------------------------------------------------------------------ recovery */

/* Recover every rank that is dead and not being recovered: the CAS on its death word makes us
 * its only recoverer (the life lock's job), and its acquire (after the acquire of the death
 * word or the gate word) orders the dead rank's last writes before ours. */
static uint32_t try_recover(ucm_ctx *c, int32_t my_rank)
{
    uint32_t n = 0;
    for (uint32_t r = 0; r < L.max_ranks; r++) {
        if ((int32_t)r == my_rank) continue;
        int st = life_state(r);
        if (st == LIFE_GATED) {
            struct life *lf = __atomic_load_n(&ranks[r].cur, __ATOMIC_ACQUIRE);
            /* Acquire: pairs with point_slow's acq_rel add, the parked thread's last act. */
            if (!lf || __atomic_load_n(&lf->gate, __ATOMIC_ACQUIRE) == 0) continue;
        } else if (st != LIFE_DEAD) {
            continue;
        }
        if (!__atomic_compare_exchange_n(&ranks[r].life, &st, LIFE_RECOVERING, 0, __ATOMIC_ACQ_REL,
                                         __ATOMIC_RELAXED))
            continue;
        uint32_t counts[4] = {0, 0, 0, 0};
        int res = ucm_recover_rank(c, r, RECOVERY_STRIPE_NS, my_rank, counts);
        COUNT(C_REC_PINS, counts[0]);
        COUNT(C_REC_LOADS, counts[1]);
        COUNT(C_REC_CLAIMS, counts[2]);
        if (res == UCM_OK) {
            if (ucm_load32(base, rank_off(r) + UCM_R_STATE) != UCM_RANK_FREE)
                die("rank %u is not FREE after its recovery", r);
            COUNT(C_RECOVERIES, 1);
            n++;
            __atomic_store_n(&ranks[r].life, LIFE_FREE, __ATOMIC_RELEASE); /* for the successor */
        } else if (res == UCM_TIMEOUT) {
            COUNT(C_REC_TIMEOUT, 1); /* a stripe stayed held: the next recovery finishes it */
            __atomic_store_n(&ranks[r].life, LIFE_DEAD, __ATOMIC_RELEASE);
        } else {
            die("ucm_recover_rank(%u) answered %d", r, res);
        }
    }
    return n;
}

/* ------------------------------------------------------------------ the arena policy */

/* After ucmcache/core/arenas.py's plan: shares split evenly over READY ranks (remainder to the
 * lowest); take every free arena (home ones first), then up to the share from ranks that are not
 * READY, then from ranks above their share.  want_one: nothing claimable: give busy arenas back
 * and take at least one more.  Returns how many were taken. */
static uint32_t arena_policy(struct life *lf, ucm_ctx *c, int want_one)
{
    uint32_t me = lf->rank, na = (uint32_t)L.n_arenas, taken = 0;
    uint32_t owners[4096], busy[4096];
    if (na > 4096) die("too many arenas for the stress policy");
    pthread_mutex_lock(&lf->policy);
    for (int round = 0; round < 3; round++) {
        uint64_t epoch = ucm_load64(base, UCM_H_ARENA_EPOCH); /* read before looking */
        ucm_arena_owners(c, owners);
        ucm_arena_foreign(c, busy);
        uint32_t swaps = 0;
        if (want_one) {
            for (uint32_t a = 0; a < na; a++)
                if (owners[a] == me + 1 && busy[a] && ucm_arena_release(c, a) == UCM_OK) {
                    owners[a] = 0;
                    swaps++;
                }
            if (swaps) {
                ucm_fetch_add64(base, UCM_H_ARENA_EPOCH, 1);
                COUNT(C_GIVEN_BACK, swaps);
            }
        }
        uint32_t live[MAX_RANKS_HERE], n_live = 0, share[MAX_RANKS_HERE] = {0};
        for (uint32_t r = 0; r < L.max_ranks; r++)
            if (ucm_load32(base, rank_off(r) + UCM_R_STATE) == UCM_RANK_READY) live[n_live++] = r;
        for (uint32_t i = 0; i < n_live; i++) share[live[i]] = na / n_live + (i < na % n_live);
        int32_t counts[MAX_RANKS_HERE] = {0}, usable = 0;
        for (uint32_t a = 0; a < na; a++) {
            if (owners[a]) counts[owners[a] - 1]++;
            if (owners[a] == me + 1 && !busy[a]) usable++;
        }
        int32_t need = (int32_t)share[me] - usable;
        if (want_one && need < 1) need = 1;
        uint32_t picks[4096], expect[4096], n_picks = 0;
        for (int pass = 0; pass < 2; pass++) /* free arenas, our home range first */
            for (uint32_t a = 0; a < na; a++)
                if (owners[a] == 0 && !busy[a] && (home_rank(a) == me) == (pass == 0)) {
                    picks[n_picks] = a;
                    expect[n_picks++] = 0;
                    need--;
                }
        int32_t surplus[MAX_RANKS_HERE];
        for (uint32_t r = 0; r < L.max_ranks; r++) surplus[r] = counts[r] - (int32_t)share[r];
        uint8_t picked[4096];
        memset(picked, 0, na);
        while (need > 0) {
            int32_t victim = -1;
            for (uint32_t r = 0; r < L.max_ranks; r++) {
                if (r == me || !(surplus[r] > 0 || (swaps > 0 && surplus[r] == 0))) continue;
                int idle = 0;
                for (uint32_t a = 0; a < na && !idle; a++) idle = owners[a] == r + 1 && !busy[a] && !picked[a];
                if (!idle) continue;
                int not_live = share[r] == 0;
                if (victim < 0 || not_live > (share[victim] == 0)
                    || (not_live == (share[victim] == 0) && surplus[r] > surplus[victim]))
                    victim = (int32_t)r;
            }
            if (victim < 0) break;
            if (surplus[victim] <= 0) swaps--;
            uint32_t pick = UINT32_MAX;
            for (int pass = 0; pass < 3 && pick == UINT32_MAX; pass++)
                for (uint32_t a = 0; a < na; a++) {
                    if (owners[a] != (uint32_t)victim + 1 || busy[a] || picked[a]) continue;
                    int ours = home_rank(a) == me, theirs = home_rank(a) == (uint32_t)victim;
                    if ((pass == 0 && ours) || (pass == 1 && !theirs) || pass == 2) {
                        pick = a;
                        break;
                    }
                }
            picked[pick] = 1;
            picks[n_picks] = pick;
            expect[n_picks++] = (uint32_t)victim + 1;
            surplus[victim]--;
            need--;
        }
        ucm_arena_epoch_seen(c, epoch);
        if (!n_picks) break;
        uint32_t lost = 0, freed_taken = 0, mine = 0;
        for (uint32_t i = 0; i < n_picks; i++) {
            int r = ucm_arena_take(c, picks[i], expect[i]);
            if (r == UCM_OK) {
                taken++;
                owners[picks[i]] = me + 1;
                freed_taken += expect[i] == 0;
            } else if (r == UCM_BUSY) {
                lost++;
            } else {
                die("ucm_arena_take answered %d", r);
            }
        }
        for (uint32_t a = 0; a < na; a++) mine += owners[a] == me + 1;
        if (freed_taken && mine > share[me]) ucm_fetch_add64(base, UCM_H_ARENA_EPOCH, 1);
        if (!lost || (want_one && taken)) break;
    }
    pthread_mutex_unlock(&lf->policy);
    COUNT(C_TAKES, taken);
    return taken;
}

/* ------------------------------------------------------------------ a thread's holds */

struct held {
    uint32_t slot, key;
    int owner;        /* ours to load (still Loading) */
    uint32_t serial;  /* an owner's load's serial (ucm_load_serial), what its publish names */
    uint32_t written; /* payload bytes the owner wrote so far */
    int tokened;      /* the pin is tok's (get()'s owner handle made in C), else a bare pin */
    ucm_token tok;    /* tokened: published by ucm_token_publish, dropped by ucm_token_drop */
    int64_t t0;       /* tokened owner: its load's start, what ucm_token_publish observes */
};

struct worker {
    struct life *lf;
    ucm_ctx *c;
    uint32_t rank, index;
    rng_t rng;
    struct held held[MAX_HELD];
    uint32_t n_held;
    int mortal;
    int exit_point;   /* the named point armed to end this thread (UCM_ACT_EXIT), or 0 */
};

static uint32_t owned_loads(struct worker *w)
{
    uint32_t n = 0;
    for (uint32_t i = 0; i < w->n_held; i++) n += w->held[i].owner;
    return n;
}

static void drop_held(struct worker *w, uint32_t i)
{
    w->held[i] = w->held[--w->n_held];
}

static void release_or_die(ucm_ctx *c, uint32_t slot)
{
    int r = ucm_release(c, slot);
    if (r != UCM_OK) die("ucm_release(%u) answered %d", slot, r);
}

/* Hold i's pin dropped, and the hold with it: a token's drop (a published load's token only
 * unpins) or a bare pin's release. */
static void release_held(struct worker *w, uint32_t i)
{
    struct held *h = &w->held[i];
    if (h->tokened) {
        if (!h->tok.armed || h->tok.owner) die("slot %u's token is %s", h->slot,
                                               h->tok.armed ? "still an owner's" : "not armed");
        ucm_token_drop(&h->tok, NULL, 0);
    } else {
        release_or_die(w->c, h->slot);
    }
    drop_held(w, i);
}

static void check_pinned_ready(struct worker *w, const char *what, uint32_t key, uint32_t slot, uint64_t len)
{
    check_bytes(what, key, slot, (const uint8_t *)ucm_slot_data(w->c, slot), len);
    COUNT(C_BYTES_CHECKED, len);
}

static void write_payload(struct worker *w, struct held *h, uint32_t upto)
{
    uint8_t *p = (uint8_t *)ucm_slot_data(w->c, h->slot);
    for (uint32_t j = h->written; j < upto; j++) p[j] = exp_byte(h->key, j);
    h->written = upto;
}

/* The owner finishes its load: the payload, then Ready; or Failed with a message; or an abandon
 * (fail and unpin in one step).  Returns 1 if the pin is still held (to be released). */
static int finish_load(struct worker *w, uint32_t i)
{
    struct held *h = &w->held[i];
    uint32_t len = exp_len(h->key);
    uint32_t pick = below(&w->rng, 100);
    if (pick < 4) {
        if (h->tokened) { /* the handle closed unpublished: its token's drop fails the load */
            ucm_token_drop(&h->tok, MSG_ABANDONED, sizeof MSG_ABANDONED - 1);
        } else {
            uint32_t slot = h->slot;
            uint8_t own = 1;
            int r = ucm_abandon_many(w->c, &slot, &own, 1, MSG_ABANDONED, sizeof MSG_ABANDONED - 1);
            if (r != UCM_OK) die("ucm_abandon_many answered %d", r);
        }
        COUNT(C_ABANDONED, 1);
        drop_held(w, i);
        return 0;
    }
    uint32_t state = pick < 9 ? UCM_FAILED : UCM_READY, n = len;
    if (state == UCM_FAILED) {
        n = sizeof MSG_FAILED - 1;
        memcpy(ucm_slot_data(w->c, h->slot), MSG_FAILED, n);
    } else {
        write_payload(w, h, len);
    }
    /* The handle's ready() made in C publishes through its token (which stays armed, a
     * reader's now); the full path's through the slot and the load's serial. */
    int r = h->tokened ? ucm_token_publish(&h->tok, state, n, h->t0)
                       : ucm_publish(w->c, h->slot, h->serial, state, n);
    if (r != UCM_OK)
        die("%s(slot %u, key %u) answered %d", h->tokened ? "ucm_token_publish" : "ucm_publish",
            h->slot, h->key, r);
    if (h->tokened && (!h->tok.armed || h->tok.owner))
        die("ucm_token_publish left slot %u's token %s", h->slot,
            h->tok.armed ? "an owner's" : "disarmed");
    COUNT(state == UCM_READY ? C_READY : C_FAILED_PUB, 1);
    COUNT(C_TOKEN_PUBLISHED, h->tokened);
    h->owner = 0;
    if (state == UCM_READY && chance(&w->rng, 300)) {
        /* keep the pin a while, as a reader of its own entry */
        check_pinned_ready(w, "owner's own entry", h->key, h->slot, len);
        return 1;
    }
    release_held(w, i);
    return 0;
}

static void check_failed_message(struct worker *w, uint32_t key, uint32_t slot)
{
    uint32_t len = ucm_load32(base, meta_off(slot) + UCM_M_LENGTH);
    const char *p = ucm_slot_data(w->c, slot);
    char buf[128];
    if (len >= sizeof buf) die("key %u (slot %u): a Failed message of %u bytes", key, slot, len);
    memcpy(buf, p, len);
    buf[len] = 0;
    if (strcmp(buf, MSG_FAILED) && strcmp(buf, MSG_ABANDONED) && !strstr(buf, "died before publishing"))
        die("key %u (slot %u): Failed with an unknown message \"%s\"", key, slot, buf);
}

/* A pin on a Loading slot someone else loads: wait for it (only if we own no load, so no two
 * waits close a cycle), recovering its loader if it died.  Returns 1 if still pinned Ready. */
static int wait_for(struct worker *w, uint32_t key, uint32_t slot)
{
    if (owned_loads(w)) {
        release_or_die(w->c, slot);
        return 0;
    }
    COUNT(C_WAITS, 1);
    int64_t give_up = now_ns() + GIVE_UP_NS;
    for (;;) {
        uint32_t st = 0;
        /* The whole wait as one step (ucm_wait_ready: slices, deadline, counted) half the
         * time; no life locks here (threads as ranks), so lock_fd -1: the loop below recovers. */
        int r = chance(&w->rng, 500)
                    ? ucm_wait_ready(w->c, slot, ucm_now_ns() + 5000000, 1000000, -1, 0,
                                     ucm_now_ns(), &st)
                    : ucm_wait_loaded(w->c, slot, 5000000, &st);
        if (r == UCM_OK && st == UCM_READY) {
            COUNT(C_WAIT_READY, 1);
            uint64_t len = ucm_load32(base, meta_off(slot) + UCM_M_LENGTH);
            check_pinned_ready(w, "waiter", key, slot, len);
            return 1;
        }
        if (r == UCM_OK) {
            if (st != UCM_FAILED) die("key %u (slot %u) left Loading for state %u while pinned", key, slot, st);
            COUNT(C_WAIT_FAILED, 1);
            check_failed_message(w, key, slot);
            release_or_die(w->c, slot);
            return 0;
        }
        /* SLICE: ucm_wait_ready's slice ended with the loader alive (no signals here). */
        if (r != UCM_TIMEOUT && r != UCM_SLICE) die("ucm_wait_loaded answered %d", r);
        uint32_t loader = ucm_slot_loader(w->c, slot);
        if (loader < L.max_ranks && loader != w->rank) try_recover(w->c, (int32_t)w->rank);
        if (now_ns() > give_up) {
            COUNT(C_WAIT_GAVE_UP, 1);
            release_or_die(w->c, slot);
            return 0;
        }
    }
}

/* A pin answer for key: check it, keep it or release it. */
static void took(struct worker *w, uint32_t key, int64_t a, int slow)
{
    uint32_t slot = UCM_PIN_SLOT(a);
    if (slot >= L.n_slots) die("a pin answer names slot %u", slot);
    if (a & UCM_PIN_READY) {
        COUNT(slow ? C_SLOW_HITS : C_FAST_HITS, 1);
        check_pinned_ready(w, "hit", key, slot, UCM_PIN_LEN(a));
    } else if (a & UCM_PIN_OWNER) {
        COUNT(C_LOADS, 1);
        if (ucm_slot_state(w->c, slot) != UCM_LOADING || ucm_slot_loader(w->c, slot) != w->rank)
            die("an owner's slot %u is not Loading for us", slot);
        struct held *h = &w->held[w->n_held++];
        memset(h, 0, sizeof *h);
        h->slot = slot;
        h->key = key;
        h->owner = 1;
        h->serial = ucm_load_serial(w->c, slot); /* our pin keeps any other install off it */
        if (chance(&w->rng, 500)) {
            write_payload(w, h, exp_len(key) / 2);
            sched_yield(); /* half written: readers of other keys, joiners of this one run */
        }
        if (chance(&w->rng, 400)) finish_load(w, w->n_held - 1); /* else later: others join */
        return;
    } else {
        COUNT(C_JOINS, 1);
        if (!wait_for(w, key, slot)) return;
    }
    if (w->n_held < opt_hold && chance(&w->rng, 400)) {
        struct held *h = &w->held[w->n_held++];
        memset(h, 0, sizeof *h);
        h->slot = slot;
        h->key = key;
    } else {
        release_or_die(w->c, slot);
    }
}

/* After _arenas.py's make_room, once our share is ours (arena_policy): take the idle arena not
 * ours with the most room (free ones first), or tell the core there is none
 * (ucm_arena_room_gone).  Returns 1 if one was taken. */
static int room_policy(struct life *lf, ucm_ctx *c)
{
    uint32_t me = lf->rank, na = (uint32_t)L.n_arenas;
    uint32_t owners[4096], busy[4096], entries[4096];
    if (na > 4096) die("too many arenas for the stress policy");
    pthread_mutex_lock(&lf->policy);
    ucm_arena_owners(c, owners);
    ucm_arena_foreign(c, busy);
    ucm_arena_entries(c, entries);
    int64_t best = -1;
    uint64_t best_key = 0;
    for (uint32_t a = 0; a < na; a++) {
        uint64_t size = (a + 1) * L.arena_slots < L.n_slots ? L.arena_slots
                                                            : L.n_slots - a * L.arena_slots;
        if (owners[a] == me + 1 || busy[a] || entries[a] >= size) continue;
        uint64_t key = (owners[a] == 0 ? 1ULL << 40 : 0) + (size - entries[a]);
        if (best < 0 || key > best_key) {
            best = a;
            best_key = key;
        }
    }
    int taken = best >= 0 && ucm_arena_take(c, (uint32_t)best, owners[best]) == UCM_OK;
    if (!taken) ucm_arena_room_gone(c);
    pthread_mutex_unlock(&lf->policy);
    if (taken) COUNT(C_ROOM_TAKES, 1);
    return taken;
}

/* The slow path as _cache._pin_slow decides it.  Returns a pin answer, or -1 (gave up). */
static int64_t get_slow(struct worker *w, uint32_t key, ucm_token *tok)
{
    char id[16];
    uint64_t off;
    key_of(key, id, &off);
    uint32_t moved = 0, grown = 0, rollbacks = 0, roomed = 0;
    int tried_recovery = 0, recovered_once = 0, looked_again = 0;
    int64_t give_up = now_ns() + GIVE_UP_NS;
    for (;;) {
        uint32_t slot = UCM_NIL;
        uint8_t owner = 0;
        int64_t r = ucm_get_slow(w->c, id, off, 64, 64, STRIPE_WAIT_NS, tok, &slot, &owner);
        if (r >= 0) {
            if (tok && (!tok->armed || tok->slot != slot || tok->owner != owner))
                die("ucm_get_slow's token disagrees with its answer");
            if (slot != UCM_PIN_SLOT(r) || owner != !!((r & UCM_PIN_OWNER) && !(r & UCM_PIN_READY)))
                die("ucm_get_slow's slot_out/owner_out disagree with its answer");
            return r;
        }
        int code = (int)-r;
        if (now_ns() > give_up) {
            COUNT(C_GAVE_UP, 1);
            return -1;
        }
        switch (code) {
        case UCM_MOVED:
            COUNT(C_MOVED, 1);
            if (++moved <= 4) arena_policy(w->lf, w->c, 0);
            else ucm_arena_epoch_seen(w->c, ucm_load64(base, UCM_H_ARENA_EPOCH));
            continue;
        case UCM_ROOM:
            COUNT(C_ROOM, 1);
            if (++roomed > 4 || (!arena_policy(w->lf, w->c, 0) && !room_policy(w->lf, w->c)))
                ucm_arena_room_gone(w->c);
            continue;
        case UCM_TIMEOUT:
            COUNT(C_TIMEOUT, 1);
            continue;
        case UCM_BUSY:
            COUNT(C_BUSY, 1);
            if (!try_recover(w->c, (int32_t)w->rank)) nap_us(200);
            continue;
        case UCM_ROLLBACK:
            COUNT(C_ROLLBACK, 1);
            if (rollbacks++ < 8) continue;
            /* fall through */
        case UCM_FULL:
            if (code == UCM_FULL) COUNT(C_FULL, 1);
            if (!tried_recovery) {
                tried_recovery = 1;
                if (try_recover(w->c, (int32_t)w->rank)) continue;
            }
            if (code == UCM_FULL && grown < 8 && arena_policy(w->lf, w->c, 1)) {
                grown++;
                continue;
            }
            if (!recovered_once) {
                recovered_once = 1;
                if (try_recover(w->c, (int32_t)w->rank)) continue;
            }
            if (!looked_again) {
                looked_again = 1;
                continue;
            }
            COUNT(C_GAVE_UP, 1); /* CacheFull: every slot we can get is pinned or loading */
            return -1;
        default:
            die("ucm_get_slow answered %d for key %u", code, key);
        }
    }
}

static void exited_at_point(void *arg);

/* ucmcache/_hit's cold get_or_load: the slow step into a token, and for an owner the finish
 * at once (ucm_load_finish: copy, publish, observe, unpin); any other pin moves from the token
 * to this thread's holds (pin_again, then the token dropped) and is taken as a get's.  Returns
 * 1 if it owned the load.  A thread whose context has LOAD_COPIED or LOAD_PUBLISHED armed to
 * exit ends inside the finish (exited_at_point writes its death). */
static int cold_load(struct worker *w, uint32_t key)
{
    ucm_token tok = {0};
    int64_t r = get_slow(w, key, &tok);
    if (r < 0) return 0;
    uint32_t slot = UCM_PIN_SLOT(r);
    if (!(r & UCM_PIN_READY) && (r & UCM_PIN_OWNER)) { /* (a Ready length overlaps OWNER) */
        COUNT(C_LOADS, 1);
        if (ucm_slot_state(w->c, slot) != UCM_LOADING || ucm_slot_loader(w->c, slot) != w->rank)
            die("a cold load's slot %u is not Loading for us", slot);
        char buf[4096];
        uint32_t len = exp_len(key);
        if (len > sizeof buf) die("slot_size %u is above the cold load's buffer", len);
        int fail = chance(&w->rng, 20);
        if (fail) {
            len = sizeof MSG_FAILED - 1;
            memcpy(buf, MSG_FAILED, len);
        } else {
            for (uint32_t j = 0; j < len; j++) buf[j] = (char)exp_byte(key, j);
        }
        int f;
        pthread_cleanup_push(exited_at_point, w);
        f = ucm_load_finish(&tok, fail ? UCM_FAILED : UCM_READY, buf, len, ucm_now_ns());
        pthread_cleanup_pop(0);
        if (f != UCM_OK || tok.armed) die("ucm_load_finish(slot %u) answered %d", slot, f);
        COUNT(fail ? C_FAILED_PUB : C_READY, 1);
        COUNT(C_FINISHED, 1);
        return 1;
    }
    if (ucm_pin_again(w->c, slot) != UCM_OK) die("ucm_pin_again(slot %u) of a token's pin", slot);
    ucm_token_drop(&tok, NULL, 0);
    took(w, key, r, 1);
    return 0;
}

/* ucmcache/_hit's get() of a cold key (cold_handle): the slow step into the token the Handle
 * embeds.  An owner's handle keeps it among this thread's holds: its load is finished later,
 * by ucm_token_publish (ready()) or ucm_token_drop with a message (closed unpublished), and a
 * published one's token dropped (only unpins).  Any other pin moves to a bare hold, as
 * cold_load's does. */
static void cold_handle(struct worker *w, uint32_t key)
{
    struct held *h = &w->held[w->n_held]; /* op_get keeps n_held <= opt_hold < MAX_HELD */
    memset(h, 0, sizeof *h);
    int64_t r = get_slow(w, key, &h->tok);
    if (r < 0) return;
    uint32_t slot = UCM_PIN_SLOT(r);
    if (!(r & UCM_PIN_READY) && (r & UCM_PIN_OWNER)) {
        COUNT(C_LOADS, 1);
        COUNT(C_TOKEN_OWNERS, 1);
        if (ucm_slot_state(w->c, slot) != UCM_LOADING || ucm_slot_loader(w->c, slot) != w->rank)
            die("an owner's handle's slot %u is not Loading for us", slot);
        h->slot = slot;
        h->key = key;
        h->owner = 1;
        h->tokened = 1;
        h->serial = h->tok.serial;
        h->t0 = ucm_now_ns();
        w->n_held++;
        if (chance(&w->rng, 500)) {
            write_payload(w, h, exp_len(key) / 2);
            sched_yield(); /* half written: joiners of this key run */
        }
        if (chance(&w->rng, 400)) finish_load(w, w->n_held - 1); /* else later */
        return;
    }
    if (ucm_pin_again(w->c, slot) != UCM_OK) die("ucm_pin_again(slot %u) of a token's pin", slot);
    ucm_token_drop(&h->tok, NULL, 0);
    took(w, key, r, 1);
}

static void op_get(struct worker *w, uint32_t key)
{
    if (w->n_held >= opt_hold + 1) return;
    char id[16];
    uint64_t off;
    key_of(key, id, &off);
    COUNT(C_GETS, 1);
    int64_t r = ucm_lookup_pin(w->c, id, off, SPIN, UCM_OUTER_REQUEST, 0);
    if (r >= 0) {
        took(w, key, r, 0);
        return;
    }
    if (-r != UCM_MISS && -r != UCM_BUSY) die("ucm_lookup_pin answered %" PRId64, r);
    if (owned_loads(w) >= 2) return; /* no more loads of ours at once */
    /* The C miss path's two shapes (get_or_load, get()'s owner handle), or the full path's
     * (a bare pin, ucm_publish), a third each. */
    uint32_t path = below(&w->rng, 3);
    if (path == 0) {
        cold_load(w, key);
        return;
    }
    if (path == 1) {
        cold_handle(w, key);
        return;
    }
    r = get_slow(w, key, NULL);
    if (r >= 0) took(w, key, r, 1);
}

static void pack(uint32_t *keys, uint32_t n, char *ids, uint64_t *offs)
{
    for (uint32_t i = 0; i < n; i++) key_of(keys[i], ids + 16 * i, &offs[i]);
}

static void op_read_many(struct worker *w, uint32_t *keys, uint32_t n)
{
    char ids[16 * MAX_BATCH];
    uint64_t offs[MAX_BATCH];
    int64_t lens[MAX_BATCH];
    pack(keys, n, ids, offs);
    /* rows of slot_size (the chunked path) or shorter (every key pinned before any copy) */
    uint64_t row = chance(&w->rng, 500) ? L.slot_size : L.slot_size / 2 + 1;
    uint8_t *out = malloc(row * n);
    memset(out, 0xee, row * n);
    int r = ucm_read_many(w->c, ids, offs, n, (char *)out, row, lens);
    if (r != UCM_OK && r != UCM_BUSY) die("ucm_read_many answered %d", r);
    int fits = 1;
    for (uint32_t i = 0; i < n; i++)
        if (lens[i] > (int64_t)row) fits = 0;
    for (uint32_t i = 0; i < n; i++) {
        if (lens[i] < 0) continue;
        if (fits) {
            check_bytes("read_many", keys[i], UCM_NIL, out + i * row, (uint64_t)lens[i]);
            COUNT(C_READ_ROWS, 1);
            COUNT(C_BYTES_CHECKED, (uint64_t)lens[i]);
        } else if ((uint64_t)lens[i] != exp_len(keys[i])) {
            die("read_many: key %u reported length %" PRId64 ", its key's is %u", keys[i], lens[i], exp_len(keys[i]));
        }
    }
    if (!fits)
        for (uint64_t j = 0; j < row * n; j++)
            if (out[j] != 0xee) die("read_many copied a row although a payload did not fit");
    free(out);
    COUNT(C_READ_MANY, 1);
}

static void op_batch(struct worker *w, uint32_t *keys, uint32_t n, int gated)
{
    char ids[16 * MAX_BATCH];
    uint64_t offs[MAX_BATCH];
    uint32_t slots[MAX_BATCH];
    uint8_t states[MAX_BATCH], codes[MAX_BATCH];
    int64_t lens[MAX_BATCH], glens[MAX_BATCH];
    pack(keys, n, ids, offs);
    int r = ucm_lookup_pin_many(w->c, ids, offs, n, SPIN, slots, states, codes, lens);
    if (r != UCM_OK && r != UCM_MISS) die("ucm_lookup_pin_many answered %d", r);
    for (uint32_t i = 0; i < n; i++) {
        if (codes[i] != UCM_OK) {
            if (slots[i] != UCM_NIL) die("a batch position without a pin names slot %u", slots[i]);
            continue;
        }
        if (states[i] == UCM_READY)
            check_pinned_ready(w, "batch", keys[i], slots[i], (uint64_t)lens[i]);
    }
    if (!gated && chance(&w->rng, 300)) {
        if (ucm_pin_again_many(w->c, slots, n) != UCM_OK) die("ucm_pin_again_many failed on our own pins");
        if (ucm_release_many(w->c, slots, n) != UCM_OK) die("ucm_release_many of the extra holds failed");
    }
    uint8_t *out = malloc(L.slot_size * n);
    r = ucm_gather(w->c, slots, n, (char *)out, L.slot_size, glens); /* gated: may park here */
    if (r != UCM_OK) die("ucm_gather answered %d", r);
    if (gated) { free(out); return; } /* the point was not reached: the caller dies anyway */
    for (uint32_t i = 0; i < n; i++) {
        if (glens[i] < 0) {
            if (codes[i] == UCM_OK && states[i] == UCM_READY) die("gather lost a pinned Ready slot");
            continue;
        }
        /* Ready now: pinned Ready, or a Loading one we joined published meanwhile. */
        check_bytes("gather", keys[i], slots[i], out + i * L.slot_size, (uint64_t)glens[i]);
        COUNT(C_GATHER_ROWS, 1);
        COUNT(C_BYTES_CHECKED, (uint64_t)glens[i]);
    }
    free(out);
    if (ucm_release_many(w->c, slots, n) != UCM_OK) die("ucm_release_many failed");
    COUNT(C_GATHERS, 1);
}

static void op_all_ready(struct worker *w, uint32_t *keys, uint32_t n)
{
    char ids[16 * MAX_BATCH];
    uint64_t offs[MAX_BATCH];
    uint32_t slots[MAX_BATCH];
    int64_t lens[MAX_BATCH];
    pack(keys, n, ids, offs);
    int r = ucm_pin_all_ready(w->c, ids, offs, n, 0, slots, lens);
    if (r == UCM_MISS) {
        for (uint32_t i = 0; i < n; i++)
            if (slots[i] != UCM_NIL) die("ucm_pin_all_ready missed but left slot %u", slots[i]);
        return;
    }
    if (r != UCM_OK) die("ucm_pin_all_ready answered %d", r);
    for (uint32_t i = 0; i < n; i++) check_pinned_ready(w, "pin_all_ready", keys[i], slots[i], (uint64_t)lens[i]);
    if (ucm_release_many(w->c, slots, n) != UCM_OK) die("ucm_release_many failed");
    COUNT(C_ALL_READY, 1);
}

static void op_exist(struct worker *w, uint32_t *keys, uint32_t n)
{
    char ids[16 * MAX_BATCH];
    uint64_t offs[MAX_BATCH];
    uint8_t out[MAX_BATCH];
    pack(keys, n, ids, offs);
    switch (below(&w->rng, 4)) { /* hints: nothing to check but that they run clean */
    case 0: ucm_exist1(w->c, ids, offs[0]); break;
    case 1: ucm_exist_many(w->c, ids, offs, n, out); break;
    case 2: if (ucm_exist_prefix(w->c, ids, offs, n) > n) die("exist_prefix past n"); break;
    default: ucm_touch_many(w->c, ids, offs, n); break;
    }
    COUNT(C_EXISTS, 1);
}

/* A delete (ucm_delete): when the entry's arena is not ours, take it for the delete and give it
 * back after, as the Python layer does (announcing the change); a reader elsewhere may hold the
 * slot pinned and keeps checking its bytes. */
static void op_delete(struct worker *w, uint32_t key)
{
    char id[16];
    uint64_t off;
    key_of(key, id, &off);
    uint32_t arena, taken = UCM_NIL;
    for (int tries = 0; tries < 3; tries++) {
        int r = ucm_delete(w->c, id, off, SPIN, 1000000000LL, &arena);
        if (r == UCM_OK) COUNT(C_DELETES, 1);
        if (r != UCM_NOT_HELD || arena == UCM_NIL) break;
        uint32_t owner = ucm_load32(base, L.arena_off + (uint64_t)arena * UCM_ARENA_SIZE + UCM_A_OWNER);
        if (owner == w->rank + 1 || ucm_arena_take(w->c, arena, owner) != UCM_OK) break;
        COUNT(C_DELETE_TAKES, 1);
        taken = arena;
    }
    if (taken != UCM_NIL && ucm_arena_release(w->c, taken) == UCM_OK)
        ucm_fetch_add64(base, UCM_H_ARENA_EPOCH, 1);
}

static void op_ring(struct worker *w, uint32_t *keys, uint32_t n)
{
    char ids[16 * MAX_BATCH];
    uint64_t offs[MAX_BATCH];
    pack(keys, n, ids, offs);
    if (chance(&w->rng, 600)) {
        uint32_t posted = 0;
        int r = ucm_ring_post(w->c, below(&w->rng, L.max_ranks), ids, offs, n, &posted);
        if (r != UCM_OK && r != UCM_BUSY && r != UCM_FULL) die("ucm_ring_post answered %d", r);
        COUNT(C_RING_POSTED, posted);
    } else if (w->index == 0) { /* the rank's one consumer */
        uint32_t got = 0;
        int r = ucm_ring_take(w->c, ids, offs, MAX_BATCH, 0, &got);
        if (r != UCM_OK) die("ucm_ring_take answered %d", r);
        COUNT(C_RING_TAKEN, got);
    }
}

/* ------------------------------------------------------------------ deaths */

/* A thread that exits at a named point (UCM_ACT_EXIT): its death word, written last, as
 * die_now's end does for a thread that returns.  Its context is kept: a token on its stack (the
 * finish's) or among its holds keeps a reference that no drop will ever give back. */
static void exited_at_point(void *arg)
{
    struct worker *w = arg;
    COUNT(C_EXITED_AT_POINT, 1);
    __atomic_fetch_add(&exits_at[w->exit_point], 1, __ATOMIC_RELAXED);
    w->lf->ctx_kept = 1; /* read by the supervisor only after the rank was recovered */
    __atomic_store_n(&ranks[w->rank].dead_since, now_ns(), __ATOMIC_RELAXED);
    /* Release: our last writes happen before the recoverer's acquire of the death word. */
    __atomic_store_n(&ranks[w->rank].life, LIFE_DEAD, __ATOMIC_RELEASE);
    free(w);
}

/* A delete that may end this thread at its armed point (exited_at_point writes the death). */
static void delete_or_exit(struct worker *w, uint32_t key)
{
    pthread_cleanup_push(exited_at_point, w);
    op_delete(w, key);
    pthread_cleanup_pop(0);
}

/* The thread stops using its ctx for good, holding what it holds; it returns (and its thread
 * exits) unless it parks at a named point for good, or exits at one. */
static void die_now(struct worker *w)
{
    struct life *lf = w->lf;
    uint32_t kind = below(&w->rng, DEATH_KINDS);
    __atomic_fetch_add(&death_counts[kind], 1, __ATOMIC_RELAXED);
    COUNT(C_DEATHS, 1);
    /* An armed token among our holds keeps a reference on the context for good (read by the
     * supervisor only after the rank was recovered). */
    for (uint32_t i = 0; i < w->n_held; i++)
        if (w->held[i].tokened && w->held[i].tok.armed) lf->ctx_kept = 1;
    if (kind == DEATH_HALF_LOADED) {
        for (uint32_t i = 0; i < w->n_held; i++)
            if (w->held[i].owner) write_payload(w, &w->held[i], exp_len(w->held[i].key) / 2);
    } else if (kind == DEATH_CLAIM) {
        uint32_t slot;
        ucm_clock_claim(w->c, 2 * L.n_slots + 1, &slot); /* FULL: dies without a claim */
    } else if (kind == DEATH_STRIPE) {
        uint32_t st = below(&w->rng, L.n_stripes), slot;
        if (ucm_stripe_lock(w->c, st, 1000000000LL) == UCM_OK) {
            lf->exited_holding = 1;
            if (chance(&w->rng, 500)) ucm_clock_claim(w->c, 2 * L.n_slots + 1, &slot);
        }
    } else if (kind >= DEATH_GATE_CLAIM_UNCHECKED) {
        static const int point[] = {UCM_PT_CLAIM_UNCHECKED, UCM_PT_AFTER_PIN, UCM_PT_BEFORE_PIN_CAS,
                                    UCM_PT_COUNTED_NOT_READY, UCM_PT_BEFORE_COPY,
                                    UCM_PT_DELETE_MARKED, UCM_PT_MID_DELETE,
                                    UCM_PT_DELETE_UNCOUNTED, UCM_PT_DELETE_USABLE,
                                    UCM_PT_DELETE_CHECKED, UCM_PT_LOAD_COPIED,
                                    UCM_PT_LOAD_PUBLISHED};
        _Static_assert(sizeof point / sizeof point[0] == DEATH_KINDS - DEATH_GATE_CLAIM_UNCHECKED,
                       "a named point for every death at a point");
        int p = point[kind - DEATH_GATE_CLAIM_UNCHECKED];
        /* The delete's points are under the key's stripe: parked there, the thread would hold
         * its robust mutex for good with a live owner (no EOWNERDEAD for anyone), which no real
         * death does; it exits at the point instead (UCM_ACT_EXIT), as DEATH_STRIPE's thread
         * exits holding its stripe, and its cleanup handler writes the death word.  The
         * finish's points hold no stripe; the thread exits there too, as a killed process
         * would leave them: its token and stack gone, its pin bit and loader word left. */
        int exits = p == UCM_PT_DELETE_MARKED || p == UCM_PT_MID_DELETE || p == UCM_PT_DELETE_UNCOUNTED
                    || p == UCM_PT_DELETE_USABLE || p == UCM_PT_DELETE_CHECKED
                    || p == UCM_PT_LOAD_COPIED || p == UCM_PT_LOAD_PUBLISHED;
        lf->parked = !exits; /* read by the supervisor only after the rank was recovered */
        w->exit_point = exits ? p : 0;
        if (exits) ucm_ctx_set_point(w->c, p, UCM_ACT_EXIT, NULL, 0);
        else ucm_ctx_set_point(w->c, p, UCM_ACT_GATE, &lf->gate, PARK_NS);
        /* A parked life is GATED (its struct is kept for good: recoverers read its gate word);
         * an exiting one stays ALIVE until its cleanup handler writes DEAD, and its struct is
         * freed after its recovery like any returned life's. */
        if (!exits) __atomic_store_n(&ranks[w->rank].life, LIFE_GATED, __ATOMIC_RELEASE);
        uint32_t keys[MAX_BATCH], n = 1 + below(&w->rng, 4);
        for (uint32_t i = 0; i < n; i++) keys[i] = below(&w->rng, n_keys);
        char id[16];
        uint64_t off;
        key_of(keys[0], id, &off);
        switch (p) {
        case UCM_PT_CLAIM_UNCHECKED: {
            uint32_t slot;
            ucm_clock_claim(w->c, 2 * L.n_slots + 1, &slot);
            break;
        }
        case UCM_PT_AFTER_PIN:
        case UCM_PT_BEFORE_PIN_CAS:
            ucm_lookup_pin(w->c, id, off, SPIN, UCM_OUTER_REQUEST, 0); /* a pin taken here is held at death */
            break;
        case UCM_PT_COUNTED_NOT_READY:
            for (uint32_t i = 0; i < w->n_held; i++)
                if (w->held[i].owner) { /* a C-made owner handle's ready(), or the full path's */
                    struct held *h = &w->held[i];
                    write_payload(w, h, exp_len(h->key));
                    if (h->tokened) ucm_token_publish(&h->tok, UCM_READY, exp_len(h->key), h->t0);
                    else ucm_publish(w->c, h->slot, h->serial, UCM_READY, exp_len(h->key));
                    break;
                }
            break;
        case UCM_PT_LOAD_COPIED:
        case UCM_PT_LOAD_PUBLISHED:
            /* A cold get_or_load that owns its key exits inside its finish; a key found
             * Ready or loaded by another (a hit, a join) is taken as a get's and the next
             * one tried, up to 8; one that never made us an owner dies as it is, below. */
            for (uint32_t i = 0; i < 8; i++)
                if (cold_load(w, below(&w->rng, n_keys))) break;
            break;
        case UCM_PT_DELETE_MARKED:
        case UCM_PT_MID_DELETE:
        case UCM_PT_DELETE_UNCOUNTED:
        case UCM_PT_DELETE_USABLE:
        case UCM_PT_DELETE_CHECKED: {
            /* Exits at the point, holding the stripe, its pin and its mark; a miss or a key in
             * flight never reaches it and dies as it is, below.  A key it holds Ready (not
             * its own load) is there to delete; else a random one, which often misses. */
            uint32_t victim = keys[0];
            for (uint32_t i = 0; i < w->n_held; i++)
                if (!w->held[i].owner) { victim = w->held[i].key; break; }
            delete_or_exit(w, victim);
            break;
        }
        default:
            op_batch(w, keys, n, 1);
            break;
        }
        /* Not parked (the point was not reached): die as we are.  The point stays armed on a
         * ctx nobody uses again. */
        lf->parked = 0;
    }
    __atomic_store_n(&ranks[w->rank].dead_since, now_ns(), __ATOMIC_RELAXED);
    /* Release: our last writes happen before the recoverer's acquire of the death word. */
    __atomic_store_n(&ranks[w->rank].life, LIFE_DEAD, __ATOMIC_RELEASE);
}

/* ------------------------------------------------------------------ a thread of a life */

static void *worker_main(void *arg)
{
    struct worker *w = arg;
    struct life *lf = w->lf;
    for (uint64_t it = 0; it < lf->iterations; it++) {
        /* about opt_deaths deaths spread over the mortal ranks' iterations */
        if (w->mortal && rnd(&w->rng) % (opt_iterations * (opt_ranks - 1) + 1) < opt_deaths) {
            uint32_t d = __atomic_load_n(&deaths_left, __ATOMIC_RELAXED);
            if (d && __atomic_compare_exchange_n(&deaths_left, &d, d - 1, 0, __ATOMIC_RELAXED,
                                                 __ATOMIC_RELAXED)) {
                __atomic_store_n(&ranks[w->rank].left, lf->iterations - it, __ATOMIC_RELAXED);
                die_now(w);
                free(w);
                return NULL; /* a parked death never gets here */
            }
        }
        if (it % 64 == 0) try_recover(w->c, (int32_t)w->rank);
        if (chance(&w->rng, 20)) sched_yield(); /* more interleavings on few cores */
        uint32_t keys[MAX_BATCH], n = 1 + below(&w->rng, MAX_BATCH);
        /* a hot set and a cold tail: hits, joins and evictions all the time */
        for (uint32_t i = 0; i < n; i++)
            keys[i] = chance(&w->rng, 600) ? below(&w->rng, (uint32_t)L.n_slots / 2 + 1) : below(&w->rng, n_keys);
        uint32_t op = below(&w->rng, 1000);
        if (op < 420) {
            op_get(w, keys[0]);
        } else if (op < 520) {
            for (uint32_t i = 0; i < w->n_held; i++)
                if (w->held[i].owner) {
                    finish_load(w, i);
                    break;
                }
        } else if (op < 600) {
            if (w->n_held) {
                uint32_t i = below(&w->rng, w->n_held);
                if (w->held[i].owner) {
                    finish_load(w, i);
                } else {
                    check_pinned_ready(w, "held pin", w->held[i].key, w->held[i].slot,
                                       ucm_load32(base, meta_off(w->held[i].slot) + UCM_M_LENGTH));
                    release_held(w, i);
                }
            }
        } else if (op < 700) {
            op_read_many(w, keys, n);
        } else if (op < 800) {
            op_batch(w, keys, n, 0);
        } else if (op < 850) {
            op_all_ready(w, keys, n);
        } else if (op < 940) {
            op_exist(w, keys, n);
        } else if (op < 980) {
            op_ring(w, keys, n);
        } else if (op < 998) {
            op_delete(w, keys[0]);
        } else {
            ucm_clear(w->c);
            COUNT(C_CLEARS, 1);
        }
    }
    /* The end of the life's work: every load finished, every pin dropped. */
    while (w->n_held) {
        if (!w->held[0].owner || finish_load(w, 0)) release_held(w, 0);
    }
    free(w);
    return NULL;
}

/* ------------------------------------------------------------------ lives */

static struct life *life_start(uint32_t r, uint32_t number, uint64_t iterations)
{
    struct life *lf = calloc(1, sizeof *lf);
    lf->rank = r;
    lf->number = number;
    lf->iterations = iterations;
    pthread_mutex_init(&lf->policy, NULL);
    lf->ctx = ucm_ctx_new(base, L.total_size, &L);
    if (!lf->ctx) die("ucm_ctx_new failed");
    take_rank(r);
    ucm_ctx_set_rank(lf->ctx, (int32_t)r);
    lf->n_threads = r == 0 ? opt_rank0_threads : 1;
    __atomic_store_n(&ranks[r].cur, lf, __ATOMIC_RELEASE);
    __atomic_store_n(&ranks[r].life, LIFE_ALIVE, __ATOMIC_RELEASE);
    COUNT(C_LIVES, 1);
    for (uint32_t t = 0; t < lf->n_threads; t++) {
        struct worker *w = calloc(1, sizeof *w);
        w->lf = lf;
        w->c = lf->ctx;
        w->rank = r;
        w->index = t;
        w->mortal = r != 0;
        w->rng.s = sm64(opt_seed ^ sm64(((uint64_t)r << 40) | ((uint64_t)number << 20) | t));
        if (pthread_create(&lf->threads[t], NULL, worker_main, w)) die("pthread_create failed");
    }
    return lf;
}

/* ------------------------------------------------------------------ end checks */

static uint64_t acc_value_of(uint64_t word, uint64_t gen)
{
    uint64_t g = gen & ((1ULL << UCM_ACC_GEN_BITS) - 1);
    return (word >> UCM_ACC_VALUE_BITS) == g ? word & ((1ULL << UCM_ACC_VALUE_BITS) - 1) : 0;
}

static void check_quiescent(ucm_ctx *c, const char *when)
{
    uint64_t gen = ucm_load64(base, UCM_H_GENERATION);
    uint64_t total_e = 0, total_b = 0;
    /* no pin, no claim; no Loading slot (a Loading slot is pinned by its live loader, and
     * nothing is pinned any more) */
    for (uint32_t s = 0; s < L.n_slots; s++) {
        uint64_t ref = ucm_load64(base, meta_off(s));
        uint32_t st = ucm_load32(base, meta_off(s) + UCM_M_STATE);
        if (ref) die("%s: slot %u's reference is %#" PRIx64 " with every hold released", when, s, ref);
        if ((st & UCM_STATE_MASK) == UCM_LOADING)
            die("%s: slot %u is Loading (loader rank %u) with nobody loading it", when, s,
                ucm_slot_loader(c, s));
        if (st & UCM_WAITERS && (st & UCM_STATE_MASK) != UCM_LOADING) { /* harmless leftover */ }
    }
    /* accounting words against a recount (what ucm_recount_arena counts) */
    for (uint32_t a = 0; a < L.n_arenas; a++) {
        uint64_t ao = L.arena_off + (uint64_t)a * UCM_ARENA_SIZE;
        uint64_t e = acc_value_of(ucm_load64(base, ao + UCM_A_ACC_ENTRIES), gen);
        uint64_t b = acc_value_of(ucm_load64(base, ao + UCM_A_ACC_BYTES), gen);
        uint64_t re = 0, rb = 0;
        uint64_t end = ((uint64_t)a + 1) * L.arena_slots;
        if (end > L.n_slots) end = L.n_slots;
        for (uint64_t s = (uint64_t)a * L.arena_slots; s < end; s++) {
            uint64_t m = meta_off((uint32_t)s);
            uint32_t flags = __atomic_load_n((uint16_t *)(base + m + UCM_M_FLAGS), __ATOMIC_ACQUIRE);
            if ((ucm_load32(base, m + UCM_M_STATE) & UCM_STATE_MASK) == UCM_READY && (flags & UCM_F_COUNTED)
                && ucm_load32(base, m + UCM_M_GENERATION) == (uint32_t)gen) {
                re++;
                rb += ucm_load32(base, m + UCM_M_LENGTH);
            }
            if (flags & UCM_F_INSTALLING) die("%s: slot %" PRIu64 " is INSTALLING unclaimed", when, s);
        }
        if (e != re || b != rb)
            die("%s: arena %u's words say %" PRIu64 " entries / %" PRIu64 " bytes, its slots %" PRIu64
                " / %" PRIu64, when, a, e, b, re, rb);
        total_e += e;
        total_b += b;
    }
    if (ucm_acc_value(c, UCM_A_ACC_ENTRIES) != total_e || ucm_acc_value(c, UCM_A_ACC_BYTES) != total_b)
        die("%s: ucm_acc_value disagrees with the arenas' words", when);
    /* chains: in range, bucket words, prev mirrors next, no slot twice, every linked slot
     * reachable; every Ready slot's bytes are its key's */
    uint8_t *seen = calloc(L.n_slots, 1);
    for (uint32_t b = 0; b < L.n_buckets; b++) {
        uint32_t prev = UCM_NIL, s = ucm_load32(base, L.bucket_off + 4ULL * b), steps = 0;
        while (s != UCM_NIL) {
            if (s >= L.n_slots) die("%s: bucket %u's chain leaves the table (%u)", when, b, s);
            if (seen[s]) die("%s: slot %u is in a chain twice", when, s);
            if (++steps > L.n_slots) die("%s: bucket %u's chain loops", when, b);
            seen[s] = 1;
            if (ucm_load32(base, meta_off(s) + UCM_M_BUCKET) != b)
                die("%s: slot %u in bucket %u's chain names bucket %u", when, s, b,
                    ucm_load32(base, meta_off(s) + UCM_M_BUCKET));
            if (ucm_load32(base, meta_off(s) + UCM_M_PREV) != prev)
                die("%s: slot %u's prev is %u, not %u", when, s, ucm_load32(base, meta_off(s) + UCM_M_PREV), prev);
            prev = s;
            s = ucm_load32(base, meta_off(s) + UCM_M_NEXT);
        }
    }
    uint32_t ready = 0, unlinked_ready = 0;
    for (uint32_t s = 0; s < L.n_slots; s++) {
        uint32_t bw = ucm_load32(base, meta_off(s) + UCM_M_BUCKET);
        if (bw != UCM_INVALID_BUCKET && !seen[s]) die("%s: slot %u names bucket %u but is not in its chain", when, s, bw);
        if ((ucm_load32(base, meta_off(s) + UCM_M_STATE) & UCM_STATE_MASK) == UCM_READY) {
            int found;
            uint32_t k = key_of_slot_words(s, &found);
            if (!found) die("%s: Ready slot %u holds no key of ours", when, s);
            check_bytes("end check", k, s, (const uint8_t *)ucm_slot_data(c, s),
                        ucm_load32(base, meta_off(s) + UCM_M_LENGTH));
            ready++;
            unlinked_ready += !seen[s];
        }
    }
    free(seen);
    for (uint32_t st = 0; st < L.n_stripes; st++) {
        int r = ucm_stripe_lock(c, st, 0); /* a dead holder's is repaired here */
        if (r != UCM_OK) die("%s: stripe %u is held (%d) with every thread done", when, st, r);
        ucm_stripe_unlock(c, st);
    }
    if (!opt_quiet)
        printf("ucm_stress: %s: %u Ready (%u unlinked), %" PRIu64 " entries / %" PRIu64
               " bytes counted, generation %" PRIu64 "\n", when, ready, unlinked_ready, total_e,
               total_b, gen);
}

/* ------------------------------------------------------------------ main */

static uint64_t parse_u64(const char *flag, const char *v)
{
    char *end;
    errno = 0;
    unsigned long long x = strtoull(v, &end, 0);
    if (errno || *end || !*v) {
        fprintf(stderr, "ucm_stress: %s needs a number, got \"%s\"\n", flag, v);
        exit(2);
    }
    return x;
}

int main(int argc, char **argv)
{
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--quiet")) { opt_quiet = 1; continue; }
        if (i + 1 >= argc) { fprintf(stderr, "ucm_stress: %s needs a value\n", a); return 2; }
        uint64_t v = parse_u64(a, argv[++i]);
        if (!strcmp(a, "--seed")) opt_seed = v;
        else if (!strcmp(a, "--iterations")) opt_iterations = v;
        else if (!strcmp(a, "--ranks")) opt_ranks = (uint32_t)v;
        else if (!strcmp(a, "--slots-per-rank")) opt_slots_per_rank = v;
        else if (!strcmp(a, "--slot-size")) opt_slot_size = v;
        else if (!strcmp(a, "--buckets")) opt_buckets = v;
        else if (!strcmp(a, "--stripes")) opt_stripes = (uint32_t)v;
        else if (!strcmp(a, "--rank0-threads")) opt_rank0_threads = (uint32_t)v;
        else if (!strcmp(a, "--deaths")) opt_deaths = (uint32_t)v;
        else if (!strcmp(a, "--hold")) opt_hold = (uint32_t)v;
        else { fprintf(stderr, "ucm_stress: unknown flag %s\n", a); return 2; }
    }
    if (opt_ranks < 2 || opt_ranks > MAX_RANKS_HERE || opt_rank0_threads < 1
        || opt_rank0_threads > MAX_RANKS_HERE || opt_hold < 1 || opt_hold + 2 > MAX_HELD
        || opt_slot_size < 2 || opt_slot_size > 65536) {
        fprintf(stderr, "ucm_stress: --ranks 2..%d, --rank0-threads 1..%d, --hold 1..%d, "
                        "--slot-size 2..65536\n", MAX_RANKS_HERE, MAX_RANKS_HERE, MAX_HELD - 2);
        return 2;
    }
    int64_t t0 = now_ns();
    segment_make();
    n_keys = (uint32_t)(3 * L.n_slots);
    deaths_left = opt_deaths;

    for (uint32_t r = 0; r < L.max_ranks; r++) life_start(r, 0, opt_iterations);

    /* The supervisor: a recovered rank gets a new life (a new thread and ctx take it again and
     * run what is left of its iterations); a dead rank nobody recovered for 100 ms (everyone
     * else finished, say) is recovered here, with a ctx of no rank. */
    ucm_ctx *sup = ucm_ctx_new(base, L.total_size, &L);
    uint32_t lives[MAX_RANKS_HERE] = {0};
    uint64_t sweeps = 0;
    for (;;) {
        int running = 0;
        for (uint32_t r = 0; r < L.max_ranks; r++) {
            int st = life_state(r);
            struct life *lf = ranks[r].cur;
            if (st != LIFE_DONE) running = 1;
            if (st == LIFE_ALIVE && lf) {
                /* finished? (a thread that returns without dying) */
                int done = 1;
                for (uint32_t t = 0; t < lf->n_threads && done; t++) {
                    /* pthread_tryjoin_np: done when every thread of the life returned */
                    if (lf->threads[t] && pthread_tryjoin_np(lf->threads[t], NULL) == 0) lf->threads[t] = 0;
                    done = !lf->threads[t];
                }
                if (done && life_state(r) == LIFE_ALIVE) /* (a death stores DEAD before it returns) */
                    __atomic_store_n(&ranks[r].life, LIFE_DONE, __ATOMIC_RELEASE);
            }
            if (st == LIFE_DEAD && now_ns() - __atomic_load_n(&ranks[r].dead_since, __ATOMIC_RELAXED) > 100000000LL)
                try_recover(sup, -1); /* left to the others for 100 ms */
            if (st == LIFE_GATED && lf && __atomic_load_n(&lf->gate, __ATOMIC_ACQUIRE) && ++sweeps % 100 == 0)
                try_recover(sup, -1); /* parked: left to the others for about 100 ms */
            if (life_state(r) == LIFE_FREE) {
                /* the old life's threads: joined if they returned, else parked for good */
                if (lf->parked) {
                    for (uint32_t t = 0; t < lf->n_threads; t++) pthread_detach(lf->threads[t]);
                    __atomic_fetch_add(&counters[C_PARKED], 1, __ATOMIC_RELAXED);
                    if (n_graveyard < sizeof graveyard / sizeof graveyard[0]) graveyard[n_graveyard++] = lf;
                } else {
                    for (uint32_t t = 0; t < lf->n_threads; t++)
                        if (lf->threads[t]) pthread_join(lf->threads[t], NULL);
                    if (!lf->ctx_kept) ucm_ctx_free(lf->ctx);
                    else if (n_kept_ctx < sizeof kept_ctx / sizeof kept_ctx[0]) kept_ctx[n_kept_ctx++] = lf->ctx;
                    else die("more than %u contexts kept by dead threads' tokens", n_kept_ctx);
                    pthread_mutex_destroy(&lf->policy);
                    free(lf);
                }
                uint64_t left = __atomic_load_n(&ranks[r].left, __ATOMIC_RELAXED);
                life_start(r, ++lives[r], left);
                running = 1;
            }
        }
        if (!running) break;
        nap_us(1000);
    }

    /* Quiescent: every live rank finished its work and dropped its holds; every dead one was
     * recovered.  First as they are, then after closing every rank as SlotCache.close does. */
    for (uint32_t r = 0; r < L.max_ranks; r++) {
        struct life *lf = ranks[r].cur;
        uint32_t slots[4096];
        if (L.n_slots > 4096) die("too many slots for the end check");
        uint32_t k = ucm_hold_pins(lf->ctx, slots);
        if (k) die("rank %u's ctx still counts %u local pins at the end", r, k);
    }
    check_quiescent(sup, "after the run");
    for (uint32_t r = 0; r < L.max_ranks; r++) {
        struct life *lf = ranks[r].cur;
        uint32_t counts[4];
        ucm_ctx_close(lf->ctx);
        int res = ucm_recover_rank(lf->ctx, r, RECOVERY_STRIPE_NS, -1, counts);
        if (res != UCM_OK) die("closing rank %u: ucm_recover_rank answered %d", r, res);
        if (counts[0] || counts[1] || counts[2])
            die("closing rank %u found %u pins, %u loads, %u claims", r, counts[0], counts[1], counts[2]);
        ucm_ctx_free(lf->ctx);
    }
    check_quiescent(sup, "after every rank closed");
    for (uint32_t a = 0; a < L.n_arenas; a++)
        if (ucm_load32(base, L.arena_off + (uint64_t)a * UCM_ARENA_SIZE + UCM_A_OWNER))
            die("arena %u is owned after every rank closed", a);
    for (uint32_t r = 0; r < L.max_ranks; r++)
        if (ucm_load32(base, rank_off(r) + UCM_R_STATE) != UCM_RANK_FREE) die("rank %u is not FREE at the end", r);
    ucm_ctx_free(sup);

    /* The core's own counters, summed over the ranks' stats lines. */
    uint64_t repairs = 0, evictions = 0, core_rollbacks = 0;
    for (uint32_t r = 0; r < L.max_ranks; r++) {
        uint64_t st = rank_off(r) + UCM_R_STATS;
        repairs += ucm_load64(base, st + 8 * UCM_ST_STRIPE_REPAIRS);
        evictions += ucm_load64(base, st + 8 * UCM_ST_EVICTIONS);
        core_rollbacks += ucm_load64(base, st + 8 * UCM_ST_CLAIM_ROLLBACKS);
    }
    double secs = (double)(now_ns() - t0) / 1e9;
    if (!opt_quiet) {
        printf("ucm_stress: counters:");
        for (int i = 0; i < C_N; i++) printf(" %s=%" PRIu64, counter_names[i], counters[i]);
        printf("\nucm_stress: core: stripe_repairs=%" PRIu64 " evictions=%" PRIu64
               " claim_rollbacks=%" PRIu64 " (the supervisor's recoveries' repairs not counted)",
               repairs, evictions, core_rollbacks);
        printf("\nucm_stress: deaths by kind:");
        for (int i = 0; i < DEATH_KINDS; i++) printf(" %s=%" PRIu64, death_names[i], death_counts[i]);
        printf("\nucm_stress: exits at a point:");
        for (int p = 0; p < UCM_PT_COUNT; p++)
            if (exits_at[p]) printf(" point %d=%" PRIu64, p, exits_at[p]);
        printf("\n");
    }
    printf("ucm_stress: OK seed=%" PRIu64 " ranks=%u (rank 0: %u threads) slots=%" PRIu64
           " arenas=%" PRIu64 "x%" PRIu64 " buckets=%" PRIu64 " stripes=%u iterations=%" PRIu64
           "/thread gets=%" PRIu64 " loads=%" PRIu64 " bytes_checked=%" PRIu64 " deaths=%" PRIu64
           " recoveries=%" PRIu64 " parked=%" PRIu64 " exited_at_point=%" PRIu64
           " (load_copied=%" PRIu64 " load_published=%" PRIu64 ") stripe_repairs=%" PRIu64
           " clears=%" PRIu64 " in %.2f s\n",
           opt_seed, L.max_ranks, opt_rank0_threads, L.n_slots, L.n_arenas, L.arena_slots,
           L.n_buckets, L.n_stripes, opt_iterations, counters[C_GETS], counters[C_LOADS],
           counters[C_BYTES_CHECKED], counters[C_DEATHS], counters[C_RECOVERIES],
           counters[C_PARKED], counters[C_EXITED_AT_POINT], exits_at[UCM_PT_LOAD_COPIED],
           exits_at[UCM_PT_LOAD_PUBLISHED], repairs, counters[C_CLEARS], secs);
    fflush(stdout);
    return 0; /* parked threads stay parked (dead ranks) until the process exits */
}
