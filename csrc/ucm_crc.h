/* CRC-32C (Castagnoli), the checksum of ucmcache.vllm's block format: no protocol, no shared
 * word; a utility beside the core, built as its own module (ucmcache._crc).  On x86-64 with
 * SSE4.2 it runs on the crc32 instruction (chosen once, at run time); elsewhere, and as the
 * reference the tests compare it with, slicing-by-8 tables. */
#ifndef UCM_CRC_H
#define UCM_CRC_H
#include <stddef.h>
#include <stdint.h>

/* CDEF-BEGIN */
uint32_t ucm_crc32c(uint32_t crc, const void *buf, size_t len);
uint32_t ucm_crc32c_soft(uint32_t crc, const void *buf, size_t len);
int ucm_crc32c_hardware(void);
/* CDEF-END */

/* Copy ``len`` bytes from ``src`` to ``dst`` (not overlapping) and return the CRC-32C of them
 * continuing ``crc``, in one pass over the source (x86-64 with SSE4.2: each line summed from
 * L1 as it is copied); ``streaming``: the destination written with stores that bypass the
 * cache where the machine has them (the caller fences).  ucm_copy.c's copies with a CRC. */
uint32_t ucm_crc32c_copy(uint32_t crc, void *dst, const void *src, size_t len, int streaming);

#endif
