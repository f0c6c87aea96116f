/* Segment copies (see ucm_copy.h).  The CRC is folded in by chunks of FOLD bytes: the chunk is
 * summed first (ucm_crc32c: three crc32 streams over 3 x 8 KiB on x86-64, which brings it into
 * L1), then copied from L1 with memcpy.  FOLD is three of ucm_crc.c's 8 KiB stretches, so every
 * whole chunk takes the three-stream path, and 24 KiB of source fits in any L1 data cache this
 * runs on next to the destination's lines. */
#include "ucm_copy.h"

#include <string.h>

#include "ucm_crc.h"

#define FOLD (3 * 8192)

static void copy_fold(unsigned char *dst, const unsigned char *src, uint64_t len, uint32_t *crc)
{
    uint32_t c = *crc;
    while (len) {
        size_t k = len < FOLD ? (size_t)len : FOLD;
        c = ucm_crc32c(c, src, k);
        memcpy(dst, src, k);
        dst += k;
        src += k;
        len -= k;
    }
    *crc = c;
}

void ucm_copy_segments(uint64_t n, const uint64_t *dst, const uint64_t *src,
                       const uint64_t *len, uint32_t *crc, uint64_t per)
{
    if (per == 0)
        per = 1;
    for (uint64_t i = 0; i < n; i++) {
        unsigned char *d = (unsigned char *)(uintptr_t)dst[i];
        const unsigned char *s = (const unsigned char *)(uintptr_t)src[i];
        if (crc)
            copy_fold(d, s, len[i], crc + i / per);
        else
            memcpy(d, s, (size_t)len[i]);
    }
}
