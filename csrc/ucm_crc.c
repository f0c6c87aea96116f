/* CRC-32C (Castagnoli, reflected polynomial 0x82F63B78), as iSCSI, ext4 and RocksDB use it.
 * ``crc`` is the value of the bytes before ``buf`` (0 to start), so a checksum can be summed
 * piece by piece: ucm_crc32c(ucm_crc32c(0, a, n), b, m) == ucm_crc32c(0, a || b, n + m). */
#include "ucm_crc.h"

#include <pthread.h>
#include <string.h>

static uint32_t table[8][256];
static pthread_once_t table_once = PTHREAD_ONCE_INIT;

static void make_table(void)
{
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++)
            c = (c >> 1) ^ (0x82F63B78u & (0u - (c & 1u)));
        table[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; i++)
        for (int t = 1; t < 8; t++)
            table[t][i] = (table[t - 1][i] >> 8) ^ table[0][table[t - 1][i] & 0xFF];
}

uint32_t ucm_crc32c_soft(uint32_t crc, const void *buf, size_t len)
{
    const unsigned char *p = buf;
    uint32_t c = ~crc;
    pthread_once(&table_once, make_table);
    while (len && ((uintptr_t)p & 7)) {
        c = (c >> 8) ^ table[0][(c ^ *p++) & 0xFF];
        len--;
    }
    while (len >= 8) {
        uint64_t v;
        memcpy(&v, p, 8);   /* aligned here; memcpy keeps the compiler honest about it */
        v ^= c;             /* little-endian: the low 4 bytes take the running value */
        c = table[7][v & 0xFF] ^ table[6][(v >> 8) & 0xFF] ^ table[5][(v >> 16) & 0xFF] ^
            table[4][(v >> 24) & 0xFF] ^ table[3][(v >> 32) & 0xFF] ^
            table[2][(v >> 40) & 0xFF] ^ table[1][(v >> 48) & 0xFF] ^ table[0][v >> 56];
        p += 8;
        len -= 8;
    }
    while (len--)
        c = (c >> 8) ^ table[0][(c ^ *p++) & 0xFF];
    return ~c;
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__)) && \
    __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
#define UCM_CRC_X86 1
/* Three independent streams over the three thirds of each 3 x 8 KiB stretch keep the crc32
 * instruction's pipeline full (latency 3, one a cycle: three_streams); their values are
 * joined by the software shift below, which costs a few hundred cycles per 24 KiB.  Shorter
 * tails run one stream. */
#define STRETCH 8192
/* The copy's stretch (ucm_crc32c_copy): 3 x 4 KiB chunks; a 64 KiB segment (a layer of a
 * block) is five chunks and a 4 KiB tail.  copy_segments of 32 MiB in 64 KiB segments with
 * streaming stores, here: 7.3-8.3 GB/s at 4 KiB, 5.9 at 2 KiB (the join's cost per chunk),
 * 9-10 with no CRC (bench/results/kv-io.md); 8 KiB was tried only in a first version (a
 * standalone C test, registers in an array), where it ran slower than 4 KiB (7.3 to 8.4). */
#define COPY_STRETCH 4096

#include <emmintrin.h>

__attribute__((target("sse4.2")))
static uint64_t one_stream(uint64_t c, const unsigned char *p, size_t len)
{
    while (len >= 8) {
        uint64_t v;
        memcpy(&v, p, 8);
        c = __builtin_ia32_crc32di(c, v);
        p += 8;
        len -= 8;
    }
    while (len--)
        c = __builtin_ia32_crc32qi((uint32_t)c, *p++);
    return c;
}

/* The CRC register after ``len`` zero bytes are fed to register value ``c`` (no pre/post
 * inversion): a GF(2) matrix power, squared up as zlib's crc32_combine does. */
static void gf2_square(uint32_t *sq, const uint32_t *m)
{
    for (int n = 0; n < 32; n++) {
        uint32_t v = m[n], s = 0;
        for (int i = 0; v; i++, v >>= 1)
            if (v & 1)
                s ^= m[i];
        sq[n] = s;
    }
}

static uint32_t gf2_times(const uint32_t *m, uint32_t v)
{
    uint32_t s = 0;
    for (int i = 0; v; i++, v >>= 1)
        if (v & 1)
            s ^= m[i];
    return s;
}

static uint32_t shift_op[32];     /* the operator for STRETCH zero bytes */
static uint32_t copy_shift_op[32];   /* the operator for COPY_STRETCH zero bytes */
static pthread_once_t shift_once = PTHREAD_ONCE_INIT;

static void make_shift(void)
{
    uint32_t odd[32], even[32];
    odd[0] = 0x82F63B78u;        /* one zero bit */
    for (int n = 1; n < 32; n++)
        odd[n] = 1u << (n - 1);
    gf2_square(even, odd);       /* 2 bits */
    gf2_square(odd, even);       /* 4 bits */
    gf2_square(even, odd);       /* 1 byte */
    uint32_t *cur = even, *next = odd;
    /* both stretches are powers of two, COPY_STRETCH the smaller */
    for (size_t bytes = 1; bytes < STRETCH; bytes *= 2) {
        if (bytes == COPY_STRETCH)
            memcpy(copy_shift_op, cur, sizeof copy_shift_op);
        gf2_square(next, cur);
        uint32_t *t = cur;
        cur = next;
        next = t;
    }
    memcpy(shift_op, cur, sizeof shift_op);
}

/* The register after three streams over consecutive stretches of the length ``op`` shifts
 * over, a then b then d: a shifted over b's bytes plus b, then the same over d's (the register
 * is linear, and b's and d's streams started from 0: a register of 0, not an inverted one). */
static uint64_t join_streams(const uint32_t *op, uint64_t a, uint64_t b, uint64_t d)
{
    return gf2_times(op, gf2_times(op, (uint32_t)a) ^ (uint32_t)b) ^ (uint32_t)d;
}

/* Three registers over the three thirds of a 3 x STRETCH stretch, fed in one loop so that the
 * three dependency chains overlap in the pipeline. */
__attribute__((target("sse4.2")))
static void three_streams(uint64_t *a, uint64_t *b, uint64_t *d, const unsigned char *p)
{
    uint64_t ra = *a, rb = 0, rd = 0;
    for (size_t i = 0; i < STRETCH; i += 8) {
        uint64_t va, vb, vd;
        memcpy(&va, p + i, 8);
        memcpy(&vb, p + STRETCH + i, 8);
        memcpy(&vd, p + 2 * STRETCH + i, 8);
        ra = __builtin_ia32_crc32di(ra, va);
        rb = __builtin_ia32_crc32di(rb, vb);
        rd = __builtin_ia32_crc32di(rd, vd);
    }
    *a = ra;
    *b = rb;
    *d = rd;
}

static uint32_t crc32c_x86(uint32_t crc, const unsigned char *p, size_t len)
{
    uint64_t c = ~crc;
    pthread_once(&shift_once, make_shift);
    while (len >= 3 * STRETCH) {
        uint64_t a = c, b, d;
        three_streams(&a, &b, &d, p);
        c = join_streams(shift_op, a, b, d);
        p += 3 * STRETCH;
        len -= 3 * STRETCH;
    }
    return ~(uint32_t)one_stream(c, p, len);
}
/* One 16-byte store: bypassing the cache (movntdq, ``dst`` 16-byte aligned) or not. */
__attribute__((always_inline))
static inline void store16(unsigned char *dst, __m128i v, int streaming)
{
    if (streaming)
        _mm_stream_si128((__m128i *)dst, v);
    else
        _mm_storeu_si128((__m128i *)dst, v);
}

/* Copy one 64-byte line (four 16-byte loads and stores). */
__attribute__((always_inline))
static inline void copy_line(unsigned char *dst, const unsigned char *src, int streaming)
{
#pragma GCC unroll 4
    for (int k = 0; k < 64; k += 16)
        store16(dst + k, _mm_loadu_si128((const __m128i *)(src + k)), streaming);
}

static inline uint64_t word_at(const unsigned char *p)
{
    uint64_t v;
    memcpy(&v, p, 8);
    return v;
}

__attribute__((target("sse4.2"), always_inline))
static inline uint32_t copy_x86(uint32_t crc, unsigned char *dst, const unsigned char *src,
                                size_t len, int streaming)
{
    uint64_t c = ~crc;
    pthread_once(&shift_once, make_shift);
    if (streaming) {   /* the head, to the destination's 16-byte alignment (movntdq's) */
        size_t head = (size_t)(-(uintptr_t)dst & 15);
        if (head > len)
            head = len;
        c = one_stream(c, src, head);
        memcpy(dst, src, head);
        dst += head;
        src += head;
        len -= head;
    }
    while (len >= 3 * COPY_STRETCH) {   /* three streams over a chunk's thirds */
        /* Each stream's register a local and a line's words unrolled (written as an array
         * of registers in a loop, GCC -O2 kept the loops: 18% slower, 32 MiB in 64 KiB
         * segments), the eight words of a line summed right after the line is copied (from
         * L1), so the sums run while the next lines' loads and stores wait on memory. */
        uint64_t a = c, b = 0, d = 0;
        const unsigned char *pa = src, *pb = src + COPY_STRETCH, *pd = src + 2 * COPY_STRETCH;
        unsigned char *qa = dst, *qb = dst + COPY_STRETCH, *qd = dst + 2 * COPY_STRETCH;
        for (size_t i = 0; i < COPY_STRETCH; i += 64) {
            copy_line(qa + i, pa + i, streaming);
            copy_line(qb + i, pb + i, streaming);
            copy_line(qd + i, pd + i, streaming);
#pragma GCC unroll 8
            for (size_t k = i; k < i + 64; k += 8) {
                a = __builtin_ia32_crc32di(a, word_at(pa + k));
                b = __builtin_ia32_crc32di(b, word_at(pb + k));
                d = __builtin_ia32_crc32di(d, word_at(pd + k));
            }
        }
        c = join_streams(copy_shift_op, a, b, d);
        dst += 3 * COPY_STRETCH;
        src += 3 * COPY_STRETCH;
        len -= 3 * COPY_STRETCH;
    }
    for (; len >= 64; len -= 64, dst += 64, src += 64) {   /* the tail, one stream */
        copy_line(dst, src, streaming);
#pragma GCC unroll 8
        for (int k = 0; k < 64; k += 8)
            c = __builtin_ia32_crc32di(c, word_at(src + k));
    }
    c = one_stream(c, src, len);
    memcpy(dst, src, len);
    return ~(uint32_t)c;
}

__attribute__((target("sse4.2")))
static uint32_t copy_x86_streaming(uint32_t crc, unsigned char *dst, const unsigned char *src,
                                   size_t len)
{
    return copy_x86(crc, dst, src, len, 1);
}

__attribute__((target("sse4.2")))
static uint32_t copy_x86_cached(uint32_t crc, unsigned char *dst, const unsigned char *src,
                                size_t len)
{
    return copy_x86(crc, dst, src, len, 0);
}
#endif


static int hardware = -1;   /* -1: not looked at yet */

int ucm_crc32c_hardware(void)
{
#ifdef UCM_CRC_X86
    /* Relaxed load and store: every thread that looks writes the same answer, and nothing
     * else is published with it; atomic only so that two first callers do not race. */
    int h = __atomic_load_n(&hardware, __ATOMIC_RELAXED);
    if (h < 0) {
        h = __builtin_cpu_supports("sse4.2") ? 1 : 0;
        __atomic_store_n(&hardware, h, __ATOMIC_RELAXED);
    }
    return h;
#else
    return 0;
#endif
}

uint32_t ucm_crc32c(uint32_t crc, const void *buf, size_t len)
{
#ifdef UCM_CRC_X86
    if (ucm_crc32c_hardware())
        return crc32c_x86(crc, buf, len);
#endif
    return ucm_crc32c_soft(crc, buf, len);
}

uint32_t ucm_crc32c_copy(uint32_t crc, void *dst, const void *src, size_t len, int streaming)
{
#ifdef UCM_CRC_X86
    if (ucm_crc32c_hardware())
        return (streaming ? copy_x86_streaming : copy_x86_cached)(crc, dst, src, len);
#endif
    /* no crc32 instruction: the sum then the copy (stores through the cache), by 24 KiB
     * chunks that stay in L1 between the two */
    const unsigned char *s = src;
    unsigned char *d = dst;
    while (len) {
        size_t k = len < 24576 ? len : 24576;
        crc = ucm_crc32c_soft(crc, s, k);
        memcpy(d, s, k);
        d += k;
        s += k;
        len -= k;
    }
    return crc;
}
