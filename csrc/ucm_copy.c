/* Segment copies (see ucm_copy.h).  A copy with a CRC is ucm_crc32c_copy's one pass (ucm_crc.c:
 * each 64-byte line summed as it is copied, three crc32 streams over 3 x 4 KiB chunks on
 * x86-64); a copy without one is memcpy, or streaming stores (move_streaming). */
#include "ucm_copy.h"

#include <string.h>

#if defined(__x86_64__) || defined(__SSE2__)
#include <emmintrin.h>
#define HAVE_STREAM 1
#endif

#include "ucm_crc.h"

typedef void (*mover)(unsigned char *dst, const unsigned char *src, size_t len);

static void move_cached(unsigned char *dst, const unsigned char *src, size_t len)
{
    memcpy(dst, src, len);
}

/* Stores that bypass the cache (movntdq): the destination's lines are written whole, never
 * read from memory for ownership first, and left out of this core's caches: for a
 * destination this process does not read next (a slot another process loads later) and no
 * cache holds (an engine's forward streams weights and KV through the caches between two
 * saves).  bench/kv_io.py --evict-mb measures the save with and without them
 * (bench/results/kv-io.md).  The head up to 16-byte alignment and the tail under 64 bytes go
 * by memcpy. */
static void move_streaming(unsigned char *dst, const unsigned char *src, size_t len)
{
#ifdef HAVE_STREAM
    size_t head = (size_t)(-(uintptr_t)dst & 15);
    if (head > len)
        head = len;
    memcpy(dst, src, head);
    dst += head;
    src += head;
    len -= head;
    for (; len >= 64; len -= 64, dst += 64, src += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)src);
        __m128i b = _mm_loadu_si128((const __m128i *)(src + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(src + 32));
        __m128i d = _mm_loadu_si128((const __m128i *)(src + 48));
        _mm_stream_si128((__m128i *)dst, a);
        _mm_stream_si128((__m128i *)(dst + 16), b);
        _mm_stream_si128((__m128i *)(dst + 32), c);
        _mm_stream_si128((__m128i *)(dst + 48), d);
    }
#endif
    memcpy(dst, src, len);
}

static void copy_all(uint64_t n, const uint64_t *dst, const uint64_t *src, const uint64_t *len,
                     uint32_t *crc, uint64_t per, int streaming)
{
    mover move = streaming ? move_streaming : move_cached;
    if (per == 0)
        per = 1;
    for (uint64_t i = 0; i < n; i++) {
        unsigned char *d = (unsigned char *)(uintptr_t)dst[i];
        const unsigned char *s = (const unsigned char *)(uintptr_t)src[i];
        if (crc)
            crc[i / per] = ucm_crc32c_copy(crc[i / per], d, s, (size_t)len[i], streaming);
        else
            move(d, s, (size_t)len[i]);
    }
}

void ucm_copy_segments(uint64_t n, const uint64_t *dst, const uint64_t *src,
                       const uint64_t *len, uint32_t *crc, uint64_t per)
{
    copy_all(n, dst, src, len, crc, per, 0);
}

void ucm_copy_segments_streaming(uint64_t n, const uint64_t *dst, const uint64_t *src,
                                 const uint64_t *len, uint32_t *crc, uint64_t per)
{
    copy_all(n, dst, src, len, crc, per, 1);
#ifdef HAVE_STREAM
    /* Streaming stores are weakly ordered: a later store of this thread, even the publish's
     * release exchange, is not guaranteed to stay behind them without a fence.  The fence
     * makes every byte copied here globally visible before any store this thread makes after
     * the call (the head and tail's ordinary stores are ordered anyway), so a reader that
     * acquires the Ready state after our publish (design/protocols.md: the publish's release
     * against the reader's acquire) reads these bytes, not the slot's old ones; and a forward
     * thread that takes the load's lock after our notify reads the KV copied here. */
    _mm_sfence();
#endif
}
