/*
 * ucm_core.h: the words of a ucmcache segment and the protocol steps over them.
 *
 * The block between CDEF-BEGIN and CDEF-END is read by csrc/_build.py and handed to cffi as
 * it stands, so it holds only plain declarations.  Every `#define UCM_*` in this file reaches
 * Python through cffi's `...`, so no constant is typed twice.
 */
#ifndef UCM_CORE_H
#define UCM_CORE_H
#include <stdint.h>

/* Identity and limits of the layout. */
#define UCM_MAGIC            0x31484341434d4355ULL /* "UCMCACH1" little endian */
#define UCM_LAYOUT_VERSION   7   /* bump on every layout change (the fingerprint catches a miss) */
#define UCM_LINE             64
#define UCM_PAGE             4096
#define UCM_MAX_RANKS        63    /* one pin bit per rank in a 64-bit reference, top bit = claim */
#define UCM_MAX_STRIPES      65536
#define UCM_MIN_BUCKETS_DEFAULT (1u << 14)
#define UCM_MAX_BUCKETS      (1u << 24)
#define UCM_MAX_SLOT_SIZE    ((1ULL << 31) - 1) /* a length fits the 31 bits of a pin answer */
#define UCM_MAX_SLOTS        (1ULL << 31)
#define UCM_RING_DEPTH       4096
#define UCM_ARENAS_PER_RANK  8     /* arenas per rank of max_ranks (fewer when slots are few) */
#define UCM_NIL              0xffffffffu           /* no slot: chain end, empty bucket */
#define UCM_INVALID_BUCKET   0xffffffffu           /* an unlinked slot's bucket word */
#define UCM_CLAIMED          0x8000000000000000ULL /* reference: claimed, rank in low bits */
/* A pinning step's answer (>= 0; < 0 is -code): what a reader needs, in one int64, so the
 * Python hit path reads a Ready slot's bytes with no further C call.
 *   READY: UCM_PIN_READY | length << UCM_PIN_LEN_SHIFT | slot
 *   Loading, joined: slot;  Loading, ours to load: UCM_PIN_OWNER | slot */
#define UCM_PIN_SLOT_MASK    0x7fffffffLL
#define UCM_PIN_LEN_SHIFT    31
#define UCM_PIN_OWNER        (1LL << 31)
#define UCM_PIN_READY        (1LL << 62)
#define UCM_PIN_SLOT(r)      ((uint32_t)((r) & UCM_PIN_SLOT_MASK))
#define UCM_PIN_LEN(r)       ((uint32_t)(((r) >> UCM_PIN_LEN_SHIFT) & UCM_PIN_SLOT_MASK))

/* The shared layouts: header, RankDesc, ArenaDesc, SlotMeta and PrefetchRing, each declared
 * once, here.
 *
 * A table is one row per word: F(prefix, NAME, type, count, align), in address order.  The
 * compiler lays each table out as a struct (ucm_header, ucm_rank_desc, ucm_arena_desc,
 * ucm_slot_meta, ucm_ring: members NAME[count], `align` = UCM_LINE starts a new cache line, 0
 * keeps the type's own alignment) and from it come:
 *   - the offsets UCM_<prefix>_<NAME> (offsetof), which C, cffi (`...`) and Python use;
 *   - the checks below: each struct is exactly its region's size (a word past UCM_META_SIZE, or
 *     a line that grew, does not compile), aligned no wider than a line;
 *   - ucm_layout_fields(): the rows as data, from which ucmcache/_layout.py builds the numpy
 *     dtypes every whole-table reader uses, and ucm_layout_fingerprint() its digest;
 *   - the typed accessors in ucm_core.c (a word read with the wrong width does not compile).
 * Adding a word is one row here, plus the code that uses it.  Who writes each word and why a
 * lock-free read of it is safe: the essay at the top of ucm_core.c. */

/* Header: line 0 identity and params (params_crc covers bytes [8, 64)), line 1 the generation
 * (only clear() writes it), line 2 the arena epoch (bumped when the set of ranks changes:
 * attach, close, recovery; ranks then look at their share of arenas again), line 3 the
 * checksums: the params' crc32 and ucm_layout_fingerprint() of the build that made it. */
#define UCM_HEADER_TABLE(F) \
    F(H, MAGIC,          uint64_t, 1, 0) \
    F(H, VERSION,        uint32_t, 1, 0) \
    F(H, FEATURES,       uint32_t, 1, 0) \
    F(H, CREATOR_PID,    uint32_t, 1, 0) \
    F(H, CREATOR_UID,    uint32_t, 1, 0) \
    F(H, MAX_RANKS,      uint32_t, 1, 0) \
    F(H, N_STRIPES,      uint32_t, 1, 0) \
    F(H, SLOTS_PER_RANK, uint64_t, 1, 0) \
    F(H, SLOT_SIZE,      uint64_t, 1, 0) \
    F(H, N_BUCKETS,      uint64_t, 1, 0) \
    F(H, TOTAL_SIZE,     uint64_t, 1, 0) \
    F(H, GENERATION,     uint64_t, 1, UCM_LINE) \
    F(H, ARENA_EPOCH,    uint64_t, 1, UCM_LINE) \
    F(H, PARAMS_CRC,     uint32_t, 1, UCM_LINE) \
    F(H, LAYOUT_FP,      uint32_t, 1, 0)
#define UCM_HEADER_SIZE      256

/* RankDesc: line 0 identity and the CLOCK hand, then the rank's own counters (UCM_ST_*),
 * written only by that rank. */
#define UCM_RANK_TABLE(F) \
    F(R, STATE,          uint32_t, 1, UCM_LINE) \
    F(R, PID,            uint32_t, 1, 0) \
    F(R, CLOCK_HAND,     uint64_t, 1, 0) \
    F(R, ATTACHES,       uint64_t, 1, 0) \
    F(R, STATS,          uint64_t, UCM_ST_COUNT, UCM_LINE)
#define UCM_RANK_SIZE        768 /* line 0 identity + 11 lines of 8 counters */
#define UCM_RANK_FREE        0
#define UCM_RANK_INITIALIZING 1
#define UCM_RANK_READY       2
#define UCM_RANK_STOPPED     3

/* Accounting words pack (generation low bits, value).  There is one pair per arena, in its
 * ArenaDesc: every slot is installed and published by the one rank that writes its arena's
 * words (the arena's owner, or the previous owner while its own install or load there is still
 * in flight: see "Arenas" in ucm_core.c), so a pair counts exactly its arena's entries, and
 * recovery can recount an arena a dead rank was writing. */
#define UCM_ACC_GEN_BITS     20
#define UCM_ACC_VALUE_BITS   44

/* ArenaDesc: one line per arena (slots [a * arena_slots, (a + 1) * arena_slots)).  OWNER is 0
 * when free, else rank + 1; ACC_ENTRIES and ACC_BYTES are packed (generation, Ready entries of
 * this arena) and (generation, their payload bytes). */
#define UCM_ARENA_TABLE(F) \
    F(A, OWNER,          uint32_t, 1, UCM_LINE) \
    F(A, ACC_ENTRIES,    uint64_t, 1, 0) \
    F(A, ACC_BYTES,      uint64_t, 1, 0)
#define UCM_ARENA_SIZE       64

/* SlotMeta: one 64-byte line per slot (who writes which word: the top of ucm_core.c).  LOADER
 * is the rank of the owner that loads it; FLAGS holds UCM_F_*. */
#define UCM_SLOT_META_TABLE(F) \
    F(M, REFERENCE,      uint64_t, 1, UCM_LINE) \
    F(M, KEY,            uint64_t, 3, 0) \
    F(M, BUCKET,         uint32_t, 1, 0) \
    F(M, STATE,          uint32_t, 1, 0) \
    F(M, PREV,           uint32_t, 1, 0) \
    F(M, NEXT,           uint32_t, 1, 0) \
    F(M, GENERATION,     uint32_t, 1, 0) \
    F(M, LENGTH,         uint32_t, 1, 0) \
    F(M, ACCESSED,       uint32_t, 1, 0) \
    F(M, LOADER,         uint16_t, 1, 0) \
    F(M, FLAGS,          uint16_t, 1, 0)
#define UCM_META_SIZE        64
#define UCM_F_COUNTED        1  /* the slot's bytes are in its arena's accounting words */
#define UCM_F_INSTALLING     2  /* claimed by its arena's writer, past the ownership check: the
                                 * claimant may have changed the arena's words (recovery) */
#define UCM_F_DELETING       4  /* a delete of this Ready slot is in flight: its deleter (the
                                 * rank in the loader word, stored before this flag) holds a pin
                                 * on it; no taker of its arena verifies meanwhile (ucm_delete) */
#define UCM_F_DELETE_CHECKED 8  /* with DELETING: the deleter saw itself the arena's owner after
                                 * its mark, so it is the writer of its arena's words and may have
                                 * changed the chain (recovery finishes such a delete; a mark
                                 * without it changed nothing and is only cleared) */

/* PrefetchRing: one per rank (DESIGN 4.9).  Line 0 the consumer's HEAD; line 1 the TAIL (a
 * futex word), the producers' LOCK (0 free, else rank + 1 of the posting producer) and the
 * consumer's SLEEPING flag (it sleeps on the tail word); line 2 the counters; then
 * UCM_RING_DEPTH entries of UCM_RING_ENTRY_WORDS words each: a key's k0, k1, offset.  HEAD and
 * TAIL are free-running positions; each sits on a line of its own, as the consumer and the
 * producers write them. */
#define UCM_RING_ENTRY_WORDS 3
#define UCM_RING_TABLE(F) \
    F(RING, HEAD,        uint64_t, 1, UCM_LINE) \
    F(RING, TAIL,        uint32_t, 1, UCM_LINE) \
    F(RING, LOCK,        uint32_t, 1, 0) \
    F(RING, SLEEPING,    uint32_t, 1, 0) \
    F(RING, POSTED,      uint64_t, 1, UCM_LINE) \
    F(RING, DROPPED,     uint64_t, 1, 0) \
    F(RING, PRESENT,     uint64_t, 1, 0) \
    F(RING, ENTRIES,     uint64_t, UCM_RING_DEPTH * UCM_RING_ENTRY_WORDS, UCM_LINE)
#define UCM_RING_SIZE        (3 * UCM_LINE + UCM_RING_DEPTH * UCM_RING_ENTRY_WORDS * 8)

/* Slot states (low bits of the state word); the top bit says a waiter sleeps on it. */
#define UCM_EMPTY            0
#define UCM_LOADING          1
#define UCM_READY            2
#define UCM_FAILED           3
#define UCM_STATE_MASK       0x7fffffffu
#define UCM_WAITERS          0x80000000u

/* Step results: RESULT(NAME, value) makes UCM_<NAME>, and ucm_result_name() names it (for
 * messages: "UCM_BUSY"). */
#define UCM_RESULT_TABLE(RESULT) \
    RESULT(OK,           0) \
    RESULT(MISS,         1) \
    RESULT(BUSY,         2) \
    RESULT(FULL,         3) \
    RESULT(CORRUPT,      4) \
    RESULT(TIMEOUT,      5) \
    RESULT(ROLLBACK,     6) \
    RESULT(OWNERDEAD,    7) \
    RESULT(NOT_HELD,     8) \
    RESULT(PUBLISHED,    9)  /* publish: the slot left Loading already */ \
    RESULT(MOVED,        10) /* the slow path: the arena epoch moved since we last looked */ \
    RESULT(IN_FLIGHT,    11) /* delete: the key is being loaded (Loading): not deleted */ \
    RESULT(SLICE,        12) /* wait_ready: a slice ended, or a signal came, still Loading: the
                                caller runs its signal handlers and calls again */ \
    RESULT(ROOM,         13) /* the claim: no free slot in our arenas: the policy takes our
                                share or an arena with room (or says none) before we evict */
#define UCM_RESULT_ENUM_(name, value) UCM_##name = value,
enum { UCM_RESULT_TABLE(UCM_RESULT_ENUM_) };

/* Parameter errors from ucm_layout_compute (which field is out of range). */
#define UCM_EP_MAX_RANKS     101
#define UCM_EP_SLOTS_PER_RANK 102
#define UCM_EP_SLOT_SIZE     103
#define UCM_EP_N_BUCKETS     104
#define UCM_EP_N_STRIPES     105
#define UCM_EP_TOO_LARGE     106


/* Per-rank stats counters, each a u64 in the rank's stats lines.  A lock-free hit adds one
 * counter only (FAST_HITS); the outer requests and hits that stats() reports are
 * GETS + FAST_HITS and HITS + FAST_HITS (GETS and HITS count what took the slow path). */
#define UCM_ST_GETS          0
#define UCM_ST_HITS          1
#define UCM_ST_FAST_HITS     26
#define UCM_ST_STRIPE_REPAIRS 27 /* chains rebuilt after a stripe's holder died */
#define UCM_ST_DELETES       28  /* entries this rank deleted (ucm_delete answered UCM_OK) */
#define UCM_ST_MISSES        2
#define UCM_ST_JOINS         3
#define UCM_ST_LOADS_STARTED 4
#define UCM_ST_LOADS_READY   5
#define UCM_ST_LOADS_FAILED  6
#define UCM_ST_WAITS         7
#define UCM_ST_WAIT_NS       8
#define UCM_ST_WAIT_TIMEOUTS 9
#define UCM_ST_BYPASSES      10
#define UCM_ST_EVICTIONS     11
#define UCM_ST_CLAIM_ROLLBACKS 12
#define UCM_ST_SPINS_EXHAUSTED 13
#define UCM_ST_CLEARS        14
#define UCM_ST_RECOVERED_RANKS 15
#define UCM_ST_EXIST_KEYS    16
#define UCM_ST_TOUCHES       17
#define UCM_ST_PREFETCHED    18
#define UCM_ST_PREFETCH_SKIPPED 19
#define UCM_ST_T2_HITS       20  /* tier 2: a local miss served from the second tier */
#define UCM_ST_T2_MISSES     21
#define UCM_ST_T2_WRITES     22  /* write-throughs */
#define UCM_ST_T2_BYPASSES   23  /* tier 2 skipped: down, slow, or its breaker open */
#define UCM_ST_T2_LEASE_WAITS 24 /* waits for another node's load */
#define UCM_ST_T2_BAD_VALUES 25  /* corrupt, truncated or foreign values (counted as misses) */
/* Histograms of load time (an owner's get to its publish) and wait time (a join's wait), in
 * nanoseconds: UCM_HIST_BUCKETS counters each, bucket k counting values <= FIRST * FACTOR^k
 * (the last: everything above), then their sum and count.  A hit touches none of them. */
#define UCM_HIST_BUCKETS     24   /* 10 us .. 41.9 s, then everything above */
#define UCM_HIST_FIRST_NS    10000 /* 10 us */
#define UCM_HIST_FACTOR      2    /* no bucket wider than 2x: a quantile read from them is off
                                   * by at most 2x (4x buckets said 37.7 ms for 0.1-10 ms) */
#define UCM_ST_LOAD_HIST     32   /* .. 55 */
#define UCM_ST_LOAD_SUM_NS   56
#define UCM_ST_LOAD_COUNT    57
#define UCM_ST_WAIT_HIST     58   /* .. 81 */
#define UCM_ST_WAIT_SUM_NS   82
#define UCM_ST_WAIT_COUNT    83
#define UCM_HIST_LOAD        0
#define UCM_HIST_WAIT        1
#define UCM_ST_COUNT         88

/* Named points in the protocol where a test may hold (gate) or kill the process. */
#define UCM_PT_AFTER_MATCH   1  /* reader: MatchKey held, pin CAS not yet tried */
#define UCM_PT_AFTER_PIN     2  /* reader: pinned, not yet revalidated */
#define UCM_PT_AFTER_CLAIM   3  /* writer: victim claimed, not yet isolated */
#define UCM_PT_AFTER_UNLINK  4  /* writer: victim unlinked, key not yet rewritten */
#define UCM_PT_MID_PUBLISH   5  /* writer: bucket word stored, chain head not yet */
#define UCM_PT_BEFORE_HANDOVER 6 /* writer: linked, still claimed */
#define UCM_PT_BEFORE_PIN_CAS 7 /* reader: reference read, pin CAS not yet tried */
#define UCM_PT_HOLDING_STRIPE 8 /* slow path: the key's stripe is held, nothing looked up yet */
#define UCM_PT_COUNTED_NOT_READY 9 /* owner's publish: counted (COUNTED set), still Loading */
#define UCM_PT_CLAIM_UNCHECKED 10 /* writer: victim claimed, its arena's owner not yet checked */
#define UCM_PT_BEFORE_COPY   11 /* a batch's gather: lengths read under its pins, nothing copied */
#define UCM_PT_MID_DELETE    12 /* delete: pinned, marked, unlinked from its chain, bucket word
                                 * not yet INVALID, nothing uncounted yet */
#define UCM_PT_DELETE_MARKED 13 /* delete: pinned, marked DELETING, the arena's owner not yet
                                 * checked again, nothing unlinked */
#define UCM_PT_DELETE_UNCOUNTED 14 /* delete: unlinked, INVALID, uncounted, still marked */
#define UCM_PT_DELETE_USABLE 15 /* delete: pinned, its arena found ours and verified, not marked */
#define UCM_PT_DELETE_CHECKED 16 /* delete: marked, the owner check passed (DELETE_CHECKED set),
                                  * nothing unlinked */
#define UCM_PT_LOAD_COPIED   17 /* an owner's finish (ucm_load_finish): the value copied into the
                                 * slot, still Loading, nothing counted or published */
#define UCM_PT_LOAD_PUBLISHED 18 /* an owner's finish: published (Ready or Failed) and observed,
                                 * its pin not yet dropped */
#define UCM_PT_BEFORE_STRIPE 19 /* slow path: the caller's lock-free look done, the arena epoch
                                 * looked at, the key's stripe not yet taken; the step holds nothing */
#define UCM_PT_FREE_LOOK     20 /* claim_free's look at an arena of ours not verified: its verified
                                 * bit read, its accounting words not yet */
#define UCM_PT_COUNT         21
#define UCM_ACT_NONE         0
#define UCM_ACT_GATE         1
#define UCM_ACT_KILL         2
#define UCM_ACT_EXIT         3 /* the C stress driver's thread death: pthread_exit at the
                                 * point (a stripe held passes EOWNERDEAD to its next locker) */

/* The tables as structs (never instantiated as values: the words are reached through pointers
 * into the mapping, with atomics), and their offsets as constants. */
#define UCM_MEMBER_(prefix, name, type, count, align) _Alignas(align) type name[count];
#define UCM_OFFSET_(prefix, name, type, count, align) \
    UCM_##prefix##_##name = __builtin_offsetof(ucm_struct_of_##prefix, name),
typedef struct { UCM_HEADER_TABLE(UCM_MEMBER_) } ucm_header;
typedef struct { UCM_RANK_TABLE(UCM_MEMBER_) } ucm_rank_desc;
typedef struct { UCM_ARENA_TABLE(UCM_MEMBER_) } ucm_arena_desc;
typedef struct { UCM_SLOT_META_TABLE(UCM_MEMBER_) } ucm_slot_meta;
typedef struct { UCM_RING_TABLE(UCM_MEMBER_) } ucm_ring;
#define ucm_struct_of_H ucm_header /* lower case: not constants, so not handed to cffi */
#define ucm_struct_of_R ucm_rank_desc
#define ucm_struct_of_A ucm_arena_desc
#define ucm_struct_of_M ucm_slot_meta
#define ucm_struct_of_RING ucm_ring
enum {
    UCM_HEADER_TABLE(UCM_OFFSET_)
    UCM_RANK_TABLE(UCM_OFFSET_)
    UCM_ARENA_TABLE(UCM_OFFSET_)
    UCM_SLOT_META_TABLE(UCM_OFFSET_)
    UCM_RING_TABLE(UCM_OFFSET_)
};
/* Every bound of every table, checked by the compiler. */
_Static_assert(sizeof(ucm_header) == UCM_HEADER_SIZE, "the header's words must fill exactly UCM_HEADER_SIZE");
_Static_assert(sizeof(ucm_rank_desc) == UCM_RANK_SIZE, "a RankDesc's words must fill exactly UCM_RANK_SIZE");
_Static_assert(sizeof(ucm_arena_desc) == UCM_ARENA_SIZE, "an ArenaDesc's words must fill exactly UCM_ARENA_SIZE");
_Static_assert(sizeof(ucm_slot_meta) == UCM_META_SIZE, "a SlotMeta's words must fill exactly UCM_META_SIZE");
_Static_assert(sizeof(ucm_ring) == UCM_RING_SIZE, "a PrefetchRing's words must fill exactly UCM_RING_SIZE");
_Static_assert(UCM_RING_SIZE % UCM_LINE == 0, "rings follow each other: each starts on a line");
_Static_assert((1ULL << 32) % UCM_RING_DEPTH == 0,
               "the depth divides 2^32, so tail - head of the free-running u32 positions is the fill");
_Static_assert(_Alignof(ucm_header) == UCM_LINE && _Alignof(ucm_rank_desc) == UCM_LINE
               && _Alignof(ucm_arena_desc) == UCM_LINE && _Alignof(ucm_slot_meta) == UCM_LINE
               && _Alignof(ucm_ring) == UCM_LINE,
               "each table starts on its own line (its first row says UCM_LINE)");
_Static_assert(UCM_H_PARAMS_CRC == 3 * UCM_LINE && UCM_H_GENERATION == UCM_LINE,
               "the params crc covers line 0 from VERSION on, and nothing else is on line 0");

/* CDEF-BEGIN */
typedef struct {
    uint32_t max_ranks;
    uint32_t n_stripes;
    uint64_t slots_per_rank;
    uint64_t slot_size;
    uint64_t n_buckets;
    uint64_t n_slots;
    uint64_t slot_stride;
    uint64_t arena_slots;
    uint64_t n_arenas;
    uint64_t rank_off;
    uint64_t arena_off;
    uint64_t bucket_off;
    uint64_t stripe_off;
    uint64_t meta_off;
    uint64_t ring_off;
    uint64_t ring_size;
    uint64_t data_off;
    uint64_t total_size;
} ucm_layout;

typedef struct ucm_ctx ucm_ctx;

/* The owner object of the pins one slow-path get or one batch took (see "Pin tokens" in
 * ucm_core.c).  Allocated by the Python layer before the pinning step, armed by C. */
typedef struct {
    ucm_ctx *c;
    uint32_t slot;   /* single key: the slot pinned, UCM_NIL for none */
    uint32_t owner;  /* single key: 1 if the step made us the owner of a Loading slot */
    uint32_t n;      /* batch: positions in the arrays given to ucm_batch_token_* */
    uint32_t armed;  /* 1 while it holds what it names */
    uint32_t serial; /* single key, owner: its load's serial (ucm_load_serial), the right's */
} ucm_token;

/* One row of the layout tables above (UCM_HEADER_TABLE, ...), as data for Python's readers. */
typedef struct {
    const char *table;     /* "header", "rank", "arena", "slot_meta" or "ring" */
    uint32_t table_size;   /* UCM_HEADER_SIZE, UCM_RANK_SIZE, UCM_ARENA_SIZE, UCM_META_SIZE or
                            * UCM_RING_SIZE */
    const char *name;      /* the row's NAME ("SLOTS_PER_RANK"); its offset is UCM_<prefix>_NAME */
    uint32_t offset;
    uint32_t item_size;    /* bytes of one item (an unsigned little-endian int) */
    uint32_t count;        /* items: 1 for a word, more for an array (KEY, STATS) */
} ucm_field;

const char *ucm_result_name(int32_t code);
uint64_t ucm_default_buckets(uint64_t n_slots);
int ucm_layout_compute(ucm_layout *l);
uint32_t ucm_layout_fingerprint(void);
const ucm_field *ucm_layout_fields(uint32_t *n_out);
uint32_t ucm_params_crc(const char *base);
int ucm_segment_init(char *base, const ucm_layout *l, uint32_t creator_pid, uint32_t creator_uid);
void ucm_segment_publish(char *base);
uint64_t ucm_mix(uint64_t k0, uint64_t k1);

ucm_ctx *ucm_ctx_new(char *base, uint64_t map_size, const ucm_layout *l);
void ucm_ctx_free(ucm_ctx *c);
void ucm_ctx_forget(ucm_ctx *c);
void ucm_ctx_close(ucm_ctx *c);
void ucm_ctx_set_rank(ucm_ctx *c, int32_t rank);
void ucm_ctx_set_point(ucm_ctx *c, int32_t point, int32_t action, uint32_t *gate_word,
                       int64_t timeout_ns);
int ucm_ctx_points_set(ucm_ctx *c);

uint32_t ucm_load32(char *base, uint64_t off);
uint64_t ucm_load64(char *base, uint64_t off);
void ucm_store32(char *base, uint64_t off, uint32_t v);
void ucm_store64(char *base, uint64_t off, uint64_t v);
int ucm_cas32(char *base, uint64_t off, uint32_t expected, uint32_t desired);
uint32_t ucm_fetch_add32(char *base, uint64_t off, uint32_t v);
uint64_t ucm_fetch_add64(char *base, uint64_t off, uint64_t v);

int ucm_mutex_init(char *base, uint64_t off);
uint32_t ucm_mutex_holder(char *base, uint64_t off);

int ucm_futex_wait(char *base, uint64_t off, uint32_t expected, int64_t timeout_ns);
int ucm_futex_wake(char *base, uint64_t off, int32_t n);
int ucm_gate_wait(uint32_t *word, uint32_t expected, int64_t timeout_ns);
int ucm_gate_wake(uint32_t *word);

/* A process-local lock that a Python exception cannot leave held: it remembers which call
 * (thread and ticket) holds it, and release names the ticket (see ucm_core.c). */
typedef struct ucm_plock ucm_plock;
ucm_plock *ucm_plock_new(void);
void ucm_plock_free(ucm_plock *p);
int ucm_plock_acquire(ucm_plock *p, int64_t timeout_ns, uint64_t ticket);
void ucm_plock_release(ucm_plock *p, uint64_t ticket);

int ucm_ofd_trylock(int fd, uint64_t byte);
int ucm_ofd_unlock(int fd, uint64_t byte);
int ucm_ofd_held_by_other(int fd, uint64_t byte);

uint32_t ucm_bucket_of(ucm_ctx *c, const char *id, uint64_t offset);
uint32_t ucm_stripe_of(ucm_ctx *c, uint32_t bucket);
uint64_t ucm_generation(ucm_ctx *c);
void ucm_stat_add(ucm_ctx *c, int32_t counter, uint64_t n);
void ucm_observe(ucm_ctx *c, int32_t hist, uint64_t ns);

/* The counting contract of a look: what ucm_lookup_pin counts, by its `outer`, so that every
 * public request is counted once as a request and each of its outcomes once, whichever path
 * (the C hit path, the Python full path, the slow step) finishes it.  Requests are GETS +
 * FAST_HITS and hits HITS + FAST_HITS (see UCM_ST_GETS); the slow step (ucm_get_slow) counts
 * what it finds under the stripe but never the request, which its caller's look counted.
 *   UCM_OUTER_INSIDE    a look inside a request its caller counts (as ucm_get_slow's look
 *                       under the stripe counts; bench/floor.c's copy of the old slow path
 *                       passes it): a Ready hit in HITS, a join in JOINS, a slot still claimed
 *                       in SPINS_EXHAUSTED; never GETS.
 *   UCM_OUTER_REQUEST   the request's one look: a Ready hit in FAST_HITS; anything else in
 *                       GETS (the request: its caller goes on to the slow step without looking
 *                       again, or waits with the join's pin), a join also in JOINS, a slot
 *                       still claimed when the spin budget ran out also in SPINS_EXHAUSTED.
 *                       ucm_lookup_pin_many counts each key of a batch so.
 *   UCM_OUTER_HIT_ONLY  a first try whose caller takes the full path on anything but a hit,
 *                       which counts the request there: a Ready hit in FAST_HITS, nothing
 *                       else.  ucm_pin_all_ready counts a batch so (all Ready, or nothing).
 * ucm_read_many, which elects nobody, counts each key as a request: a Ready copy in
 * FAST_HITS, anything else in GETS; with a UCM_BUSY answer it counts nothing, and its caller
 * counts the read it settles on (ucm_read_count), once. */
typedef enum {
    UCM_OUTER_INSIDE = 0,
    UCM_OUTER_REQUEST = 1,
    UCM_OUTER_HIT_ONLY = 2
} ucm_outer;
int64_t ucm_lookup_pin(ucm_ctx *c, const char *id, uint64_t offset, uint32_t spin_budget,
                       ucm_outer outer, uint64_t ticket);
int ucm_lookup_pin_many(ucm_ctx *c, const char *ids, const uint64_t *offsets, uint32_t n,
                        uint32_t spin_budget, uint32_t *slots_out, uint8_t *states_out,
                        uint8_t *codes_out, int64_t *lens_out);
int ucm_pin_all_ready(ucm_ctx *c, const char *ids, const uint64_t *offsets, uint32_t n,
                      uint32_t spin_budget, uint32_t *slots_out, int64_t *lens_out);
char *ucm_slot_data(ucm_ctx *c, uint32_t slot);
void ucm_copy_payload(char *dst, const char *src, uint64_t n);
int ucm_exist1(ucm_ctx *c, const char *id, uint64_t offset);
int ucm_exist_many(ucm_ctx *c, const char *ids, const uint64_t *offsets, uint32_t n, uint8_t *out);
uint32_t ucm_exist_prefix(ucm_ctx *c, const char *ids, const uint64_t *offsets, uint32_t n);
int ucm_touch_many(ucm_ctx *c, const char *ids, const uint64_t *offsets, uint32_t n);
int ucm_release(ucm_ctx *c, uint32_t slot);
int ucm_read_many(ucm_ctx *c, const char *ids, const uint64_t *offsets, uint32_t n, char *out,
                  uint64_t row, int64_t *lens_out);
void ucm_read_count(ucm_ctx *c, const int64_t *lens, uint32_t n);
int ucm_claimant_dead(ucm_ctx *c, const char *ids, const uint64_t *offsets, uint32_t n,
                      int lock_fd, uint64_t life_byte0);
int ucm_gather(ucm_ctx *c, const uint32_t *slots, uint32_t n, char *out, uint64_t row,
               int64_t *lens_out);
int ucm_release_many(ucm_ctx *c, const uint32_t *slots, uint32_t n);
int ucm_pin_again(ucm_ctx *c, uint32_t slot);
int ucm_pin_again_many(ucm_ctx *c, const uint32_t *slots, uint32_t n);
int64_t ucm_privatize_pins(ucm_ctx *c);
uint32_t ucm_hold_pins(ucm_ctx *c, uint32_t *slots_out);
uint32_t ucm_slot_state(ucm_ctx *c, uint32_t slot);
uint32_t ucm_slot_loader(ucm_ctx *c, uint32_t slot);

int64_t ucm_get_slow(ucm_ctx *c, const char *id, uint64_t offset, uint32_t spin_budget,
                     uint32_t max_rollbacks, int64_t timeout_ns, ucm_token *tok,
                     uint32_t *slot_out, uint8_t *owner_out);
/* ucm_get_slow for each position of a batch whose first look missed (codes[i] != 0), from
 * ``from`` on, each position's load serial asked where it became the owner; stops at the
 * first step that answers no pin and returns its position (its answer, positive, in
 * *answer_out; the step's start in *since_out); n when all are pinned. */
uint32_t ucm_get_slow_many(ucm_ctx *c, const char *ids, const uint64_t *offsets, uint32_t n,
                           uint32_t from, const uint8_t *codes, uint32_t spin_budget,
                           uint32_t max_rollbacks, int64_t timeout_ns, uint32_t *slots_out,
                           uint8_t *owner_out, int64_t *lens_out, uint32_t *serials_out,
                           int64_t *answer_out, int64_t *since_out);
int ucm_clock_claim(ucm_ctx *c, uint64_t max_scan, uint32_t *slot_out);
int ucm_install(ucm_ctx *c, uint32_t slot, const char *id, uint64_t offset, uint32_t held_stripe);
/* The owner's load's serial, asked right after the step that made it the owner (its pin
 * held); ucm_publish and ucm_fail_load finish only the load of that serial (a stale one:
 * UCM_NOT_HELD). */
uint32_t ucm_load_serial(ucm_ctx *c, uint32_t slot);
int ucm_publish(ucm_ctx *c, uint32_t slot, uint32_t serial, uint32_t state, uint32_t length);
/* ucm_publish(slots[i], serials[i], UCM_READY, lengths[i]) for each i, every answer in
 * answers_out; returns how many were published. */
int ucm_publish_many(ucm_ctx *c, const uint32_t *slots, const uint32_t *serials, uint32_t n,
                     const uint32_t *lengths, int32_t *answers_out);
/* fail() of an owner: the right to finish, the message copied in (cut to the slot), Failed. */
int ucm_fail_load(ucm_ctx *c, uint32_t slot, uint32_t serial, const char *msg, uint32_t len);
int ucm_wait_loaded(ucm_ctx *c, uint32_t slot, int64_t timeout_ns, uint32_t *state_out);
int ucm_wait_ready(ucm_ctx *c, uint32_t slot, int64_t deadline_ns, int64_t slice_ns,
                   int lock_fd, uint64_t life_byte0, int64_t t0_ns, uint32_t *state_out);
/* A wait whose ucm_wait_ready steps counted nothing (t0_ns < 0) ends: its time (from t0_ns,
 * ucm_now_ns's clock, read here) into wait_ns and the wait histogram, and a timeout if
 * timed_out, in one step (the Python wait's `finally`: counted exactly once). */
int ucm_wait_end(ucm_ctx *c, int64_t t0_ns, int timed_out);
int64_t ucm_now_ns(void);
int ucm_load_finish(ucm_token *t, uint32_t state, const char *src, uint64_t n, int64_t t0_ns);
int ucm_token_publish(ucm_token *t, uint32_t state, uint32_t n, int64_t t0_ns);
int ucm_abandon_many(ucm_ctx *c, uint32_t *slots, const uint8_t *owner, uint32_t n,
                     const char *msg, uint32_t len);
int ucm_abandon_inflight(ucm_ctx *c, uint64_t ticket);
void ucm_token_drop(ucm_token *t, const char *msg, uint32_t len);
void ucm_token_release(void *keep, ucm_token *t);
void ucm_batch_token_arm(ucm_ctx *c, ucm_token *t, uint32_t n);
void ucm_batch_token_drop(uint32_t *slots, uint8_t *owner, ucm_token *t, const char *msg,
                          uint32_t len);
void ucm_batch_token_release(void *keep, uint32_t *slots, uint8_t *owner, ucm_token *t);

uint64_t ucm_clear(ucm_ctx *c);
uint64_t ucm_acc_value(ucm_ctx *c, uint64_t off);
int ucm_delete(ucm_ctx *c, const char *id, uint64_t offset, uint32_t spin_budget,
               int64_t timeout_ns, uint32_t *arena_out);
int ucm_recount_arena(ucm_ctx *c, uint32_t arena, uint64_t *entries_out, uint64_t *bytes_out);

int ucm_arena_take(ucm_ctx *c, uint32_t arena, uint32_t expected_owner);
void ucm_arena_epoch_seen(ucm_ctx *c, uint64_t epoch);
int ucm_arena_release(ucm_ctx *c, uint32_t arena);
uint32_t ucm_arena_foreign(ucm_ctx *c, uint32_t *counts_out);
uint32_t ucm_arena_owners(ucm_ctx *c, uint32_t *owners_out);
int ucm_arena_usable(ucm_ctx *c, uint32_t arena);
uint32_t ucm_arena_entries(ucm_ctx *c, uint32_t *entries_out);
void ucm_arena_room_gone(ucm_ctx *c);
uint64_t ucm_arena_room_mark(ucm_ctx *c);
void ucm_arena_room_gone_at(ucm_ctx *c, uint64_t mark, uint32_t owned);

int ucm_stripe_lock(ucm_ctx *c, uint32_t stripe, int64_t timeout_ns);
int ucm_stripe_unlock(ucm_ctx *c, uint32_t stripe);
int ucm_stripe_repair(ucm_ctx *c, uint32_t stripe, uint32_t *dropped_out);

int ucm_ring_post(ucm_ctx *c, uint32_t ring, const char *ids, const uint64_t *offsets,
                  uint32_t n, uint32_t *posted_out);
int ucm_ring_take(ucm_ctx *c, char *ids_out, uint64_t *offsets_out, uint32_t max,
                  int64_t timeout_ns, uint32_t *n_out);
int ucm_ring_wake(ucm_ctx *c, uint32_t ring);

int ucm_recover_rank(ucm_ctx *c, uint32_t dead_rank, int64_t stripe_timeout_ns,
                     int32_t count_in_rank, uint32_t *counts_out);
/* CDEF-END */

#endif
