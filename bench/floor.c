/*
 * floor.c: the C-only floor of the ucmcache benchmarks (no Python anywhere).
 *
 * Built by bench/cbuild.py at bench time: gcc -O2 bench/floor.c (which includes csrc/ucm_core.c
 * and bench/baselines/oldlock.c), into a temporary directory.  Each run maps an anonymous shared
 * region (MAP_SHARED|MAP_ANONYMOUS, so forked children share it), lays it out with
 * ucm_layout_compute and initialises it as ucmcache/core/segment.py's Segment._initialise does,
 * with ucm_segment_init and ucm_segment_publish.  It then times the same protocol steps the Python layer calls:
 *
 *   new design: ucm_lookup_pin + ucm_release on a hit; on a miss the slow path of
 *               ucmcache/core/cache.py (_pin_slow/_alloc): stripe lock, second lookup, CLOCK claim,
 *               install, unlock, fill, publish, release; batches: ucm_exist_many,
 *               ucm_lookup_pin_many + ucm_release_many.
 *   old design: bench/baselines/oldlock.c (bucket mutex per lookup, node spin locks, global
 *               allocation lock).
 *
 * Usage: floor MODE DESIGN key=value...   (prints one JSON object)
 *   floor hit   new|old slot_size=4096 n_keys=1000 iters=2000000
 *   floor batch new|old n_keys=100000 batch=64 reqs=20000
 *   floor mix   new|old slot_size=4096 spr=4096 nprocs=2 duration_ms=1000 miss_pct=5
 *               hot=2048 preload=1          (hot: keys drawn uniformly; miss_pct: fresh keys)
 *   floor flight new|old n_keys=1000 nprocs=4 load_us=50 resident_mb=0   (cold single flight:
 *               wake latency and the waiter's CPU time per wake-up; resident_mb: memory each
 *               process holds resident, as a Python process does)
 * Key i is (splitmix64(seed + 2i), splitmix64(seed + 2i + 1)) as in bench/common.py.
 */
#define _GNU_SOURCE
#include "../csrc/ucm_core.c"
#include "baselines/oldlock.c"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#define KEY_SEED 0x5eedULL

static uint64_t splitmix64(uint64_t x)
{
    uint64_t z = x + 0x9e3779b97f4a7c15ULL;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

static void make_key(uint64_t seed, uint64_t i, char out[16])
{
    uint64_t a = splitmix64(seed + 2 * i), b = splitmix64(seed + 2 * i + 1);
    memcpy(out, &a, 8);
    memcpy(out + 8, &b, 8);
}

static inline uint64_t xs(uint64_t *s)
{
    uint64_t x = *s;
    x ^= x >> 12;
    x ^= x << 25;
    x ^= x >> 27;
    *s = x;
    return x * 0x2545f4914f6cdd1dULL;
}

static int64_t mono_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static uint64_t arg(int argc, char **argv, const char *name, uint64_t dflt)
{
    size_t n = strlen(name);
    for (int i = 3; i < argc; i++)
        if (!strncmp(argv[i], name, n) && argv[i][n] == '=') return strtoull(argv[i] + n + 1, NULL, 10);
    return dflt;
}

/* ---------------------------------------------------------------- a segment of either design */

typedef struct {
    int old;
    char *base;
    uint64_t map_size;
    ucm_layout l;
} seg_t;

static void die(const char *what)
{
    fprintf(stderr, "floor: %s\n", what);
    exit(2);
}

static seg_t seg_new(int old, uint32_t max_ranks, uint64_t spr, uint64_t slot_size)
{
    seg_t g;
    memset(&g, 0, sizeof g);
    g.old = old;
    g.l.max_ranks = max_ranks;
    g.l.slots_per_rank = spr;
    g.l.slot_size = slot_size;
    g.l.n_buckets = 0;
    g.l.n_stripes = 64; /* ucmcache's DEFAULT_STRIPES */
    if (ucm_layout_compute(&g.l) != UCM_OK) die("layout");
    g.map_size = g.l.total_size + (old ? old_extra_size(&g.l) : 0);
    g.base = mmap(NULL, g.map_size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (g.base == MAP_FAILED) die("mmap");
    if (old) {
        if (old_init(g.base, &g.l)) die("old_init");
        return g;
    }
    /* As Segment._initialise: the core's one step that makes a segment, then its magic. */
    if (ucm_segment_init(g.base, &g.l, (uint32_t)getpid(), (uint32_t)getuid()))
        die("ucm_segment_init");
    ucm_segment_publish(g.base);
    return g;
}

/* One process's handle on the segment: a ucm_ctx with a rank, or an old_ctx. */
typedef struct {
    seg_t *g;
    ucm_ctx *c;
    old_ctx *o;
} cli_t;

static cli_t cli_new(seg_t *g, int rank)
{
    cli_t k = {g, NULL, NULL};
    if (g->old) {
        k.o = old_ctx_new(g->base, &g->l);
    } else {
        k.c = ucm_ctx_new(g->base, g->map_size, &g->l);
        ucm_ctx_set_rank(k.c, rank);
        /* Every rank of the floor is attached: each takes the arenas of its own slot range,
         * as the Python layer's shares do with every rank attached. */
        for (uint64_t a = 0; a < g->l.n_arenas; a++)
            if (a * g->l.arena_slots / g->l.slots_per_rank == (uint64_t)rank)
                ucm_arena_take(k.c, (uint32_t)a, 0);
        /* Each rank at its share and nothing else to take: the arena policy's answer before
         * a first eviction (ucm_clock_claim's UCM_ROOM), given once up front. */
        ucm_arena_room_gone(k.c);
    }
    return k;
}

static void cli_free(cli_t *k)
{
    if (k->c) ucm_ctx_free(k->c);
    if (k->o) old_ctx_free(k->o);
}

static inline char *slot_data(seg_t *g, uint32_t s) { return g->base + g->l.data_off + (uint64_t)s * g->l.slot_stride; }

/* Pin key's slot the way SlotCache.get does (fast path, slow path, allocation): 0 with the
 * slot, owner and state outputs set, -1 when nothing is claimable. */
static int get_pin(cli_t *k, const char *id, uint32_t *slot, int *owner, uint32_t *state)
{
    if (k->o) {
        int64_t r = old_get(k->o, id, 0);
        if (r < 0) return -1;
        *slot = (uint32_t)(r & 0xffffffffu);
        *owner = (r & OLD_OWNER_FLAG) != 0;
        *state = (uint32_t)((r >> 32) & 0xff);
        return 0;
    }
    ucm_ctx *c = k->c;
    int64_t r = ucm_lookup_pin(c, id, 0, 64, UCM_OUTER_REQUEST, 0);
    if (r < 0) {
        uint32_t stripe = ucm_stripe_of(c, ucm_bucket_of(c, id, 0)), s = 0;
        ucm_stripe_lock(c, stripe, -1);
        r = ucm_lookup_pin(c, id, 0, 1u << 16, UCM_OUTER_INSIDE, 0);
        if (r < 0) {
            int ok = 0;
            if (-r == UCM_MISS) {
                for (int t = 0; t < 65; t++) {
                    if (ucm_clock_claim(c, 2 * k->g->l.slots_per_rank + 1, &s) != UCM_OK) break;
                    int ir = ucm_install(c, s, id, 0, stripe);
                    if (ir == UCM_OK) {
                        ok = 1;
                        break;
                    }
                    if (ir != UCM_ROLLBACK) break;
                }
            }
            ucm_stripe_unlock(c, stripe);
            if (!ok) return -1;
            *slot = s;
            *owner = 1;
            *state = UCM_LOADING;
            return 0;
        }
        ucm_stripe_unlock(c, stripe);
    }
    *slot = UCM_PIN_SLOT(r);
    *owner = 0;
    *state = (r & UCM_PIN_READY) ? UCM_READY : UCM_LOADING;
    return 0;
}

static void cli_publish(cli_t *k, uint32_t s, uint32_t len)
{
    if (k->o) old_publish(k->o, s, UCM_READY, len);
    /* One thread per client and its pin held since the install: the serial is its load's. */
    else ucm_publish(k->c, s, ucm_load_serial(k->c, s), UCM_READY, len);
}

static void cli_wait(cli_t *k, uint32_t s)
{
    uint32_t st;
    if (k->o) old_wait_ready(k->o, s, -1, &st);
    else ucm_wait_loaded(k->c, s, -1, &st);
}

static void cli_release(cli_t *k, uint32_t s)
{
    if (k->o) old_release(k->o, s);
    else ucm_release(k->c, s);
}

/* get-or-fill: 1 hit, 0 miss (loaded and published here), -1 full. */
static int op_fill(cli_t *k, const char *id, const char *payload, uint32_t len)
{
    if (k->o) {
        int64_t r = old_get(k->o, id, 0);
        if (r < 0) return -1;
        uint32_t s = (uint32_t)(r & 0xffffffffu), st;
        if (r & OLD_OWNER_FLAG) {
            memcpy(slot_data(k->g, s), payload, len);
            old_publish(k->o, s, UCM_READY, len);
            old_release(k->o, s);
            return 0;
        }
        if (((r >> 32) & 0xff) == UCM_LOADING) old_wait_ready(k->o, s, -1, &st);
        old_release(k->o, s);
        return 1;
    }
    ucm_ctx *c = k->c;
    int64_t r = ucm_lookup_pin(c, id, 0, 64, UCM_OUTER_REQUEST, 0);
    uint32_t s, st;
    if (r < 0) {
        /* The slow path of SlotCache._pin_slow / _alloc. */
        uint32_t stripe = ucm_stripe_of(c, ucm_bucket_of(c, id, 0));
        ucm_stripe_lock(c, stripe, -1);
        r = ucm_lookup_pin(c, id, 0, 1u << 16, UCM_OUTER_INSIDE, 0);
        if (r < 0) {
            int ok = 0;
            if (-r == UCM_MISS) {
                for (int t = 0; t < 65; t++) {
                    if (ucm_clock_claim(c, 2 * k->g->l.slots_per_rank + 1, &s) != UCM_OK) break;
                    int ir = ucm_install(c, s, id, 0, stripe);
                    if (ir == UCM_OK) {
                        ok = 1;
                        break;
                    }
                    if (ir != UCM_ROLLBACK) break;
                }
            }
            ucm_stripe_unlock(c, stripe);
            if (!ok) return -1;
            memcpy(slot_data(k->g, s), payload, len);
            ucm_publish(c, s, ucm_load_serial(c, s), UCM_READY, len); /* ours, pinned */
            ucm_release(c, s);
            return 0;
        }
        ucm_stripe_unlock(c, stripe);
    }
    s = UCM_PIN_SLOT(r);
    if (!(r & UCM_PIN_READY)) ucm_wait_loaded(c, s, -1, &st);
    ucm_release(c, s);
    return 1;
}

/* A hit: pin (or reference) and release, nothing else. */
static inline int op_hit(cli_t *k, const char *id)
{
    if (k->o) {
        int64_t r = old_get(k->o, id, 0);
        if (r < 0) return -1;
        old_release(k->o, (uint32_t)(r & 0xffffffffu));
        return 0;
    }
    int64_t r = ucm_lookup_pin(k->c, id, 0, 64, UCM_OUTER_REQUEST, 0);
    if (r < 0) return -1;
    ucm_release(k->c, UCM_PIN_SLOT(r));
    return 0;
}

static char *make_keys(uint64_t n, uint64_t seed)
{
    char *ids = malloc(16 * n);
    if (!ids) die("malloc");
    for (uint64_t i = 0; i < n; i++) make_key(seed, i, ids + 16 * i);
    return ids;
}

static void populate(cli_t *k, const char *ids, uint64_t n, const char *payload, uint32_t len)
{
    for (uint64_t i = 0; i < n; i++)
        if (op_fill(k, ids + 16 * i, payload, len) < 0) die("populate: cache full");
}

static int cmp_i64(const void *a, const void *b)
{
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

static int64_t pct(int64_t *v, uint64_t n, double p)
{
    if (!n) return 0;
    uint64_t i = (uint64_t)(p * (double)(n - 1) + 0.5);
    return v[i];
}

/* ---------------------------------------------------------------- modes */

static int mode_hit(int old, int argc, char **argv)
{
    uint64_t slot_size = arg(argc, argv, "slot_size", 4096), n = arg(argc, argv, "n_keys", 1000);
    uint64_t iters = arg(argc, argv, "iters", 2000000);
    const uint64_t chunk = 32;
    seg_t g = seg_new(old, 1, n + 64, slot_size);
    cli_t k = cli_new(&g, 0);
    char *ids = make_keys(n, KEY_SEED);
    char *payload = calloc(1, slot_size);
    populate(&k, ids, n, payload, (uint32_t)slot_size);
    uint64_t nchunks = iters / chunk, rng = 0x1234567;
    uint32_t *order = malloc(sizeof(uint32_t) * chunk * 4096);
    for (uint64_t i = 0; i < chunk * 4096; i++) order[i] = (uint32_t)(xs(&rng) % n);
    int64_t *t = malloc(sizeof(int64_t) * nchunks);
    /* warm-up */
    for (uint64_t i = 0; i < chunk * 4096; i++) op_hit(&k, ids + 16 * (uint64_t)order[i]);
    int64_t t0 = mono_ns(), fails = 0;
    for (uint64_t c = 0; c < nchunks; c++) {
        const uint32_t *o = order + (c % 4096) * chunk;
        int64_t a = mono_ns();
        for (uint64_t j = 0; j < chunk; j++) fails += op_hit(&k, ids + 16 * (uint64_t)o[j]) != 0;
        t[c] = mono_ns() - a;
    }
    int64_t total = mono_ns() - t0;
    qsort(t, nchunks, sizeof *t, cmp_i64);
    printf("{\"mode\":\"hit\",\"design\":\"%s\",\"slot_size\":%lu,\"n_keys\":%lu,\"ops\":%lu,"
           "\"mean_ns\":%.2f,\"p50_ns\":%.2f,\"p99_ns\":%.2f,\"fails\":%ld,"
           "\"note\":\"p50/p99 of %lu-op chunk averages\"}\n",
           old ? "old" : "new", slot_size, n, nchunks * chunk, (double)total / (double)(nchunks * chunk),
           (double)pct(t, nchunks, 0.5) / chunk, (double)pct(t, nchunks, 0.99) / chunk, (long)fails,
           chunk);
    cli_free(&k);
    munmap(g.base, g.map_size);
    return 0;
}

static int mode_batch(int old, int argc, char **argv)
{
    uint64_t n = arg(argc, argv, "n_keys", 100000), bs = arg(argc, argv, "batch", 64);
    uint64_t reqs = arg(argc, argv, "reqs", 20000), slot_size = arg(argc, argv, "slot_size", 4096);
    seg_t g = seg_new(old, 1, n + n / 4 + 64, slot_size);
    cli_t k = cli_new(&g, 0);
    char *ids = make_keys(n, KEY_SEED);
    char *payload = calloc(1, slot_size);
    populate(&k, ids, n, payload, 64);
    /* requests: bs random resident keys each, gathered into one contiguous id array */
    uint64_t nreq_distinct = 1024, rng = 0x9876543;
    char *req = malloc(16 * bs * nreq_distinct);
    for (uint64_t i = 0; i < bs * nreq_distinct; i++) memcpy(req + 16 * i, ids + 16 * (xs(&rng) % n), 16);
    uint64_t *offs = calloc(bs, sizeof(uint64_t));
    uint8_t *out = malloc(bs), *states = malloc(bs), *codes = malloc(bs), *own = malloc(bs);
    uint32_t *slots = malloc(sizeof(uint32_t) * bs);
    int64_t *lens = malloc(sizeof(int64_t) * bs);
    int64_t *te = malloc(sizeof(int64_t) * reqs), *tg = malloc(sizeof(int64_t) * reqs);
    uint64_t found = 0, got = 0;
    for (int pass = 0; pass < 2; pass++) { /* pass 0: warm-up over every distinct request */
        uint64_t m = pass ? reqs : nreq_distinct;
        for (uint64_t r = 0; r < m; r++) {
            const char *q = req + 16 * bs * (r % nreq_distinct);
            int64_t a = mono_ns();
            if (old) old_exist_many(k.o, q, offs, (uint32_t)bs, out);
            else ucm_exist_many(k.c, q, offs, (uint32_t)bs, out);
            int64_t b = mono_ns();
            if (old) {
                old_get_many(k.o, q, offs, (uint32_t)bs, slots, states, own, codes);
                old_release_many(k.o, slots, (uint32_t)bs);
            } else {
                ucm_lookup_pin_many(k.c, q, offs, (uint32_t)bs, 64, slots, states, codes, lens);
                ucm_release_many(k.c, slots, (uint32_t)bs);
            }
            int64_t e = mono_ns();
            if (pass) {
                te[r] = b - a;
                tg[r] = e - b;
                for (uint64_t j = 0; j < bs; j++) {
                    found += out[j];
                    got += codes[j] == 0;
                }
            }
        }
    }
    double se = 0, sg = 0;
    for (uint64_t r = 0; r < reqs; r++) {
        se += (double)te[r];
        sg += (double)tg[r];
    }
    qsort(te, reqs, sizeof *te, cmp_i64);
    qsort(tg, reqs, sizeof *tg, cmp_i64);
    printf("{\"mode\":\"batch\",\"design\":\"%s\",\"n_keys\":%lu,\"batch\":%lu,\"reqs\":%lu,"
           "\"exist_ns_per_key\":%.2f,\"exist_p50_ns_per_key\":%.2f,\"exist_p99_ns_per_key\":%.2f,"
           "\"get_many_ns_per_key\":%.2f,\"get_many_p50_ns_per_key\":%.2f,\"get_many_p99_ns_per_key\":%.2f,"
           "\"found\":%lu,\"pinned\":%lu,\"keys\":%lu}\n",
           old ? "old" : "new", n, bs, reqs, se / (double)(reqs * bs), (double)pct(te, reqs, 0.5) / bs,
           (double)pct(te, reqs, 0.99) / bs, sg / (double)(reqs * bs), (double)pct(tg, reqs, 0.5) / bs,
           (double)pct(tg, reqs, 0.99) / bs, found, got, reqs * bs);
    cli_free(&k);
    munmap(g.base, g.map_size);
    return 0;
}

typedef struct {
    volatile uint64_t arrived;
    volatile int64_t start_ns;
    uint64_t pad[6];
    struct {
        uint64_t ops, hits, misses, full;
        int64_t elapsed_ns;
        uint64_t pad[3];
    } res[64];
} mix_shared;

static int mode_mix(int old, int argc, char **argv)
{
    uint64_t slot_size = arg(argc, argv, "slot_size", 4096), spr = arg(argc, argv, "spr", 4096);
    uint64_t nprocs = arg(argc, argv, "nprocs", 2), dur = arg(argc, argv, "duration_ms", 1000);
    uint64_t miss_pct = arg(argc, argv, "miss_pct", 5), hot = arg(argc, argv, "hot", spr / 2);
    uint64_t preload = arg(argc, argv, "preload", 1), ranks = arg(argc, argv, "ranks", 2);
    if (nprocs > ranks || nprocs > 63 || ranks > 63) die("nprocs > ranks");
    seg_t g = seg_new(old, (uint32_t)ranks, spr, slot_size);
    char *ids = make_keys(hot, KEY_SEED);
    char *payload = calloc(1, slot_size);
    memset(payload, 0xab, slot_size);
    if (preload) {
        cli_t k = cli_new(&g, 0);
        populate(&k, ids, hot, payload, (uint32_t)slot_size);
        cli_free(&k);
    }
    mix_shared *sh = mmap(NULL, sizeof(mix_shared), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (sh == MAP_FAILED) die("mmap shared");
    memset(sh, 0, sizeof *sh);
    for (uint64_t p = 0; p < nprocs; p++) {
        pid_t pid = fork();
        if (pid < 0) die("fork");
        if (pid == 0) {
            cli_t k = cli_new(&g, (int)p);
            uint64_t rng = 0x1000 + 7919 * p, cold = 0, ops = 0, hits = 0, misses = 0, full = 0;
            char cold_id[16];
            __atomic_add_fetch(&sh->arrived, 1, __ATOMIC_SEQ_CST);
            while (__atomic_load_n(&sh->arrived, __ATOMIC_SEQ_CST) < nprocs) sched_yield();
            int64_t t0 = mono_ns(), deadline = t0 + (int64_t)dur * 1000000LL, now = t0;
            while (now < deadline) {
                for (int j = 0; j < 64; j++) {
                    uint64_t r = xs(&rng);
                    const char *id;
                    if (r % 100 < miss_pct) {
                        make_key(0xC01DULL + (p << 40), cold++, cold_id);
                        id = cold_id;
                    } else {
                        id = ids + 16 * ((r >> 8) % hot);
                    }
                    int x = op_fill(&k, id, payload, (uint32_t)slot_size);
                    if (x > 0) hits++;
                    else if (x == 0) misses++;
                    else full++;
                    ops++;
                }
                now = mono_ns();
            }
            sh->res[p].ops = ops;
            sh->res[p].hits = hits;
            sh->res[p].misses = misses;
            sh->res[p].full = full;
            sh->res[p].elapsed_ns = now - t0;
            cli_free(&k);
            _exit(0);
        }
    }
    int bad = 0;
    for (uint64_t p = 0; p < nprocs; p++) {
        int st;
        wait(&st);
        if (!WIFEXITED(st) || WEXITSTATUS(st)) bad = 1;
    }
    double ops_s = 0;
    uint64_t ops = 0, hits = 0, misses = 0, full = 0;
    for (uint64_t p = 0; p < nprocs; p++) {
        ops += sh->res[p].ops;
        hits += sh->res[p].hits;
        misses += sh->res[p].misses;
        full += sh->res[p].full;
        if (sh->res[p].elapsed_ns > 0) ops_s += (double)sh->res[p].ops * 1e9 / (double)sh->res[p].elapsed_ns;
    }
    printf("{\"mode\":\"mix\",\"design\":\"%s\",\"slot_size\":%lu,\"spr\":%lu,\"nprocs\":%lu,"
           "\"miss_pct\":%lu,\"hot\":%lu,\"ops\":%lu,\"hits\":%lu,\"misses\":%lu,\"full\":%lu,"
           "\"ops_per_s\":%.1f,\"ns_per_op_per_proc\":%.2f,\"child_failed\":%d}\n",
           old ? "old" : "new", slot_size, spr, nprocs, miss_pct, hot, ops, hits, misses, full, ops_s,
           ops_s > 0 ? 1e9 * (double)nprocs / ops_s : 0.0, bad);
    munmap(sh, sizeof *sh);
    munmap(g.base, g.map_size);
    return bad;
}

/* Cold single flight: nprocs processes walk the same n_keys cold keys in the same order; the
 * owner of each spins load_us, fills, stamps the time and publishes; a waiter measures from the
 * stamp to its return from the wait, the CPU time its thread spent inside the wait (user +
 * system, CLOCK_THREAD_CPUTIME_ID read just before and after it: what a waiter burns per
 * wake-up, the futex sleep costing nothing and every poll counted), and its lead: how long
 * before the publish its wait began (negative: it began after, the waiter having been off the
 * CPU between its get and its wait).  The leads say what a spin before the futex sleep could
 * catch: only the waits that begin within the spin's length of the publish.  Each wait's key
 * index and latency are printed too ("wakes": [key, ns] pairs), so the harness can put the
 * waiters of each key in their wake-up order (bench/run.py wake_orders) as it does for the
 * Python systems: the second and third waiters woken of a key also wait for a CPU behind the
 * first, and how often three waiters meet differs from run to run. */
typedef struct {
    volatile uint64_t arrived;
    uint64_t pad[7];
    struct {
        uint64_t runs, waits, hits, full;
        int64_t publish_cpu_ns; /* the owner's CPU time in its publishes (a wake's other half) */
        uint64_t pad[3];
    } res[64];
    int64_t lat[]; /* [nprocs][n_keys] each of wake latencies, waiter CPU times, leads, keys */
} flight_shared;

/* How many of the n sorted values v are below x. */
static uint64_t count_below(const int64_t *v, uint64_t n, int64_t x)
{
    uint64_t i = 0;
    while (i < n && v[i] < x) i++;
    return i;
}

static int64_t thread_cpu_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

/* The CPU time of a thread_cpu_ns() pair with nothing between (the median of 1001): taken off
 * every waiter CPU sample, so a sample is the wait's own cost. */
static int64_t thread_cpu_overhead_ns(void)
{
    int64_t v[1001];
    for (int i = 0; i < 1001; i++) {
        int64_t a = thread_cpu_ns();
        v[i] = thread_cpu_ns() - a;
    }
    qsort(v, 1001, sizeof *v, cmp_i64);
    return v[500];
}

static int mode_flight(int old, int argc, char **argv)
{
    uint64_t n = arg(argc, argv, "n_keys", 1000), nprocs = arg(argc, argv, "nprocs", 4);
    uint64_t load_us = arg(argc, argv, "load_us", 50), slot_size = arg(argc, argv, "slot_size", 4096);
    uint64_t resident_mb = arg(argc, argv, "resident_mb", 0);
    if (nprocs > 63) die("nprocs");
    seg_t g = seg_new(old, (uint32_t)nprocs, n + 64, slot_size);
    char *ids = make_keys(n, KEY_SEED + 4);
    size_t shsz = sizeof(flight_shared) + 4 * sizeof(int64_t) * nprocs * n;
    flight_shared *sh = mmap(NULL, shsz, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (sh == MAP_FAILED) die("mmap shared");
    int64_t cpu_overhead = thread_cpu_overhead_ns();
    for (uint64_t p = 0; p < nprocs; p++) {
        pid_t pid = fork();
        if (pid < 0) die("fork");
        if (pid == 0) {
            cli_t k = cli_new(&g, (int)p);
            /* resident_mb: each process holds that much memory resident (touched once, never
             * again), as large as a Python process with numpy: what the size of the woken
             * process alone costs its wake-up, with the same steps */
            if (resident_mb) {
                size_t sz = (size_t)resident_mb << 20;
                char *held = malloc(sz);
                if (!held) die("malloc resident");
                for (size_t o = 0; o < sz; o += 4096) held[o] = 1;
            }
            int64_t *lat = sh->lat + p * n, *cpu = sh->lat + (nprocs + p) * n;
            int64_t *lead = sh->lat + (2 * nprocs + p) * n, *key = sh->lat + (3 * nprocs + p) * n;
            uint64_t runs = 0, waits = 0, hits = 0, full = 0;
            __atomic_add_fetch(&sh->arrived, 1, __ATOMIC_SEQ_CST);
            while (__atomic_load_n(&sh->arrived, __ATOMIC_SEQ_CST) < nprocs) sched_yield();
            for (uint64_t i = 0; i < n; i++) {
                uint32_t s, st;
                int owner;
                if (get_pin(&k, ids + 16 * i, &s, &owner, &st) < 0) {
                    full++;
                    continue;
                }
                char *d = slot_data(&g, s);
                if (owner) {
                    int64_t end = mono_ns() + (int64_t)load_us * 1000;
                    while (mono_ns() < end) {
                    }
                    memset(d + 8, 0x5a, slot_size - 8);
                    int64_t ts = mono_ns();
                    memcpy(d, &ts, 8);
                    int64_t c0 = thread_cpu_ns();
                    cli_publish(&k, s, (uint32_t)slot_size);
                    sh->res[p].publish_cpu_ns += thread_cpu_ns() - c0 - cpu_overhead;
                    runs++;
                } else if (st == UCM_LOADING) {
                    int64_t w0 = mono_ns(), c0 = thread_cpu_ns();
                    cli_wait(&k, s);
                    int64_t t = mono_ns(), ts, used = thread_cpu_ns() - c0 - cpu_overhead;
                    memcpy(&ts, d, 8);
                    cpu[waits] = used > 0 ? used : 0;
                    lead[waits] = ts - w0;
                    key[waits] = (int64_t)i;
                    lat[waits++] = t - ts;
                } else {
                    hits++;
                }
                cli_release(&k, s);
            }
            sh->res[p].runs = runs;
            sh->res[p].waits = waits;
            sh->res[p].hits = hits;
            sh->res[p].full = full;
            cli_free(&k);
            _exit(0);
        }
    }
    int bad = 0;
    for (uint64_t p = 0; p < nprocs; p++) {
        int st;
        wait(&st);
        if (!WIFEXITED(st) || WEXITSTATUS(st)) bad = 1;
    }
    uint64_t runs = 0, waits = 0, hits = 0, full = 0;
    int64_t *all = malloc(sizeof(int64_t) * (nprocs * n + 1));
    int64_t *cpu = malloc(sizeof(int64_t) * (nprocs * n + 1)), cpu_sum = 0, publish_cpu = 0;
    int64_t *lead = malloc(sizeof(int64_t) * (nprocs * n + 1));
    for (uint64_t p = 0; p < nprocs; p++) {
        memcpy(all + waits, sh->lat + p * n, sizeof(int64_t) * sh->res[p].waits);
        memcpy(cpu + waits, sh->lat + (nprocs + p) * n, sizeof(int64_t) * sh->res[p].waits);
        memcpy(lead + waits, sh->lat + (2 * nprocs + p) * n, sizeof(int64_t) * sh->res[p].waits);
        runs += sh->res[p].runs;
        waits += sh->res[p].waits;
        hits += sh->res[p].hits;
        full += sh->res[p].full;
        publish_cpu += sh->res[p].publish_cpu_ns;
    }
    uint64_t lead_within_5us = 0; /* waits a 5 µs spin before the sleep could have caught */
    for (uint64_t i = 0; i < waits; i++) {
        cpu_sum += cpu[i];
        lead_within_5us += lead[i] >= 0 && lead[i] <= 5000;
    }
    qsort(all, waits, sizeof *all, cmp_i64);
    qsort(cpu, waits, sizeof *cpu, cmp_i64);
    qsort(lead, waits, sizeof *lead, cmp_i64);
    printf("{\"mode\":\"flight\",\"design\":\"%s\",\"n_keys\":%lu,\"nprocs\":%lu,\"load_us\":%lu,"
           "\"loader_runs\":%lu,\"waits\":%lu,\"hits\":%lu,\"full\":%lu,"
           "\"wake_p50_us\":%.2f,\"wake_p99_us\":%.2f,\"waiter_cpu_us\":%.2f,"
           "\"waiter_cpu_p50_us\":%.2f,\"publish_cpu_us\":%.2f,\"cpu_overhead_ns\":%ld,"
           "\"lead_p01_us\":%.2f,\"lead_p50_us\":%.2f,\"lead_within_5us\":%.4f,"
           "\"lead_negative\":%.4f,\"child_failed\":%d,\"wakes\":[",
           old ? "old" : "new", n, nprocs, load_us, runs, waits, hits, full,
           (double)pct(all, waits, 0.5) / 1000.0, (double)pct(all, waits, 0.99) / 1000.0,
           waits ? (double)cpu_sum / (double)waits / 1000.0 : 0.0,
           (double)pct(cpu, waits, 0.5) / 1000.0,
           runs ? (double)publish_cpu / (double)runs / 1000.0 : 0.0, (long)cpu_overhead,
           (double)pct(lead, waits, 0.01) / 1000.0, (double)pct(lead, waits, 0.5) / 1000.0,
           waits ? (double)lead_within_5us / (double)waits : 0.0,
           waits ? (double)count_below(lead, waits, 0) / (double)waits : 0.0, bad);
    const char *sep = "";
    for (uint64_t p = 0; p < nprocs; p++)
        for (uint64_t j = 0; j < sh->res[p].waits; j++, sep = ",")
            printf("%s[%ld,%ld]", sep, (long)sh->lat[(3 * nprocs + p) * n + j],
                   (long)sh->lat[p * n + j]);
    printf("]}\n");
    free(all);
    free(cpu);
    free(lead);
    munmap(sh, shsz);
    munmap(g.base, g.map_size);
    return bad;
}

int main(int argc, char **argv)
{
    if (argc < 3) {
        fprintf(stderr, "usage: floor hit|batch|mix new|old key=value...\n");
        return 2;
    }
    int old = !strcmp(argv[2], "old");
    if (!old && strcmp(argv[2], "new")) die("design must be new or old");
    if (!strcmp(argv[1], "hit")) return mode_hit(old, argc, argv);
    if (!strcmp(argv[1], "batch")) return mode_batch(old, argc, argv);
    if (!strcmp(argv[1], "mix")) return mode_mix(old, argc, argv);
    if (!strcmp(argv[1], "flight")) return mode_flight(old, argc, argv);
    die("unknown mode");
    return 2;
}
