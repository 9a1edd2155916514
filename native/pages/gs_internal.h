/* What the page library's files share (internal: not installed, not exported beyond gs_*):
 * the export marker, the page size, docs/format.md §3's codec ids, and the functions one
 * file calls in another. */
#ifndef GS_INTERNAL_H
#define GS_INTERNAL_H

#include <stddef.h>
#include <stdint.h>

#define GS_EXPORT __attribute__((visibility("default")))

#define GS_PAGE 4096u

/* stored codec ids (docs/format.md §3) */
#define GS_CODEC_NONE 0
#define GS_CODEC_LZ4 1
#define GS_CODEC_ZSTD 2
#define GS_CODEC_SHUF4 3
#define GS_CODEC_SHUF2 4

/* gs_shuffle.c */
int gs_shuffle(const uint8_t *src, size_t n, unsigned k, uint8_t *dst, unsigned flags);
int gs_unshuffle(const uint8_t *src, size_t n, unsigned k, uint8_t *dst, unsigned flags);
int gs_plane_bits(const uint8_t *buf, size_t plane_stride, unsigned nplanes, size_t step,
                  size_t count, uint32_t *out);
/* gs_pages.c */
long gs_verify(const uint8_t *buf, size_t npages, const uint8_t *ids, const uint8_t *kinds);

#endif
