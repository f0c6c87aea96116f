/* Segment copies for ucmcache.vllm's block moves: one call copies a list of (dst, src, len)
 * segments, between a paged KV cache and the slots of a segment, the GIL released around it
 * (cffi's API mode); optionally with the CRC-32C of the bytes folded into the same pass.  No
 * shared word, no protocol, no policy: the caller (ucmcache/_vllm_blocks.py) pins the slots,
 * checks lengths and headers and computes every address; this file only moves bytes.  Built
 * into ucmcache._crc beside ucm_crc.c, whose CRC it calls. */
#ifndef UCM_COPY_H
#define UCM_COPY_H
#include <stddef.h>
#include <stdint.h>

/* CDEF-BEGIN */
/* Copy segment i: len[i] bytes from address src[i] to address dst[i], for i in [0, n).  The
 * segments must not overlap one another's destinations.  With crc not NULL, the CRC-32C of
 * segment i's bytes continues crc[i / per] (per >= 1: consecutive segments of one block
 * continue one value, in order), summed in the same pass as the copy (ucm_crc32c_copy: each
 * line as it is copied), so the source is read from memory once. */
void ucm_copy_segments(uint64_t n, const uint64_t *dst, const uint64_t *src,
                       const uint64_t *len, uint32_t *crc, uint64_t per);
/* The same, the destination written with stores that bypass the cache (x86-64; elsewhere
 * memcpy), for a destination this process does not read next: a slot a save fills.  Every
 * byte is visible to other threads and processes before the call returns (a store fence). */
void ucm_copy_segments_streaming(uint64_t n, const uint64_t *dst, const uint64_t *src,
                                 const uint64_t *len, uint32_t *crc, uint64_t per);
/* CDEF-END */

#endif
