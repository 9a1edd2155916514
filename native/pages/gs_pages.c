/* gpusnap page hot loop: zero detection and blake3-128 page ids (docs/format.md), for
 * gpusnap/repo/native.py (ctypes; the GIL is released during every call).
 *
 * Page ids are BLAKE3 of one 4 KiB page truncated to 16 bytes. A 4 KiB input is 4 chunks
 * of 1 KiB, 2 parent nodes and a root parent node. blake3_hasher_update() on one page
 * uses only 4 SIMD lanes (and pays the setup per page); here the pages of a batch are
 * hashed side by side instead: chunk k of up to GS_LANES pages in one blake3_hash_many()
 * call (all with chunk counter k), then the parent levels the same way, so AVX2/AVX-512
 * run with all lanes busy. The result is checked at load time against the reference
 * blake3_hasher (gs_selftest) and in tests/test_native_pages.py against the Python
 * blake3 module.
 */
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "blake3.h"
#include "blake3_impl.h"

#include "gs_internal.h"

#define GS_ID 16u
#define GS_CHUNKS (GS_PAGE / BLAKE3_CHUNK_LEN) /* 4 */
#define GS_LANES 16u                          /* pages hashed side by side */

_Static_assert(GS_CHUNKS == 4, "a page is 4 BLAKE3 chunks");

/* 4: every gs_* function of native/pages in one library, gs_decode_job included;
 * 5: gs_table_fill and gs_run_starts;
 * 6: gs_index_parse and gs_index_runs;
 * 7: gs_decode_payload
 * 8: gs_plane_new/compress/free; gs_enc_new takes PLANE_ACCEL (gpusnap/repo/native.py ABI_VERSION) */
GS_EXPORT int gs_abi_version(void) { return 8; }

static bool page_is_zero(const uint8_t *p) {
  static const uint8_t zero[GS_PAGE];
  uint64_t w;
  memcpy(&w, p, sizeof w); /* most data pages differ in their first bytes */
  if (w)
    return false;
  return memcmp(p, zero, GS_PAGE) == 0;
}

/* ids of n (<= GS_LANES) pages: out + i*GS_ID. */
static void hash_lanes(const uint8_t *const *pages, size_t n, uint8_t *out) {
  const uint8_t *in[GS_LANES * 2];
  uint8_t cv[GS_LANES * GS_CHUNKS * BLAKE3_OUT_LEN]; /* page i chunk k at (i*4 + k)*32 */
  uint8_t tmp[GS_LANES * BLAKE3_OUT_LEN];
  uint8_t par[GS_LANES * 2 * BLAKE3_OUT_LEN]; /* page i: [left, right] at i*64 */
  uint8_t root[GS_LANES * BLAKE3_OUT_LEN];

  for (unsigned k = 0; k < GS_CHUNKS; k++) {
    for (size_t i = 0; i < n; i++)
      in[i] = pages[i] + (size_t)k * BLAKE3_CHUNK_LEN;
    blake3_hash_many(in, n, BLAKE3_CHUNK_LEN / BLAKE3_BLOCK_LEN, IV, k, false, 0, CHUNK_START,
                     CHUNK_END, tmp);
    for (size_t i = 0; i < n; i++)
      memcpy(cv + (i * GS_CHUNKS + k) * BLAKE3_OUT_LEN, tmp + i * BLAKE3_OUT_LEN, BLAKE3_OUT_LEN);
  }
  /* parents of chunks (0,1) and (2,3): block j = cv + j*64 */
  for (size_t j = 0; j < 2 * n; j++)
    in[j] = cv + j * BLAKE3_BLOCK_LEN;
  blake3_hash_many(in, 2 * n, 1, IV, 0, false, PARENT, 0, 0, par);
  /* the root: first 32 output bytes of the root node = its chaining value with ROOT set */
  for (size_t i = 0; i < n; i++)
    in[i] = par + i * BLAKE3_BLOCK_LEN;
  blake3_hash_many(in, n, 1, IV, 0, false, PARENT | ROOT, 0, 0, root);
  for (size_t i = 0; i < n; i++)
    memcpy(out + i * GS_ID, root + i * BLAKE3_OUT_LEN, GS_ID);
}

/* Scan npages whole pages at buf. kinds[i] = 0 (all zero) or 1 (data); for data pages
 * ids[16*i .. 16*i+15] = blake3-128 of the page, for zero pages 16 zero bytes.
 * Returns the number of data pages. */
GS_EXPORT size_t gs_scan(const uint8_t *buf, size_t npages, uint8_t *kinds, uint8_t *ids) {
  const uint8_t *lane[GS_LANES];
  size_t lane_no[GS_LANES];
  uint8_t out[GS_LANES * GS_ID];
  size_t n = 0, ndata = 0;

  for (size_t i = 0; i < npages; i++) {
    const uint8_t *p = buf + i * GS_PAGE;
    if (page_is_zero(p)) {
      kinds[i] = 0;
      memset(ids + i * GS_ID, 0, GS_ID);
      continue;
    }
    kinds[i] = 1;
    ndata++;
    lane[n] = p;
    lane_no[n] = i;
    if (++n == GS_LANES) {
      hash_lanes(lane, n, out);
      for (size_t j = 0; j < n; j++)
        memcpy(ids + lane_no[j] * GS_ID, out + j * GS_ID, GS_ID);
      n = 0;
    }
  }
  if (n) {
    hash_lanes(lane, n, out);
    for (size_t j = 0; j < n; j++)
      memcpy(ids + lane_no[j] * GS_ID, out + j * GS_ID, GS_ID);
  }
  return ndata;
}

/* ids of npages pages (zero pages hashed like any other): the batched hash, for the self test. */
static void gs_hash_pages(const uint8_t *buf, size_t npages, uint8_t *ids) {
  const uint8_t *lane[GS_LANES];
  for (size_t i = 0; i < npages; i += GS_LANES) {
    size_t n = npages - i < GS_LANES ? npages - i : GS_LANES;
    for (size_t j = 0; j < n; j++)
      lane[j] = buf + (i + j) * GS_PAGE;
    hash_lanes(lane, n, ids + i * GS_ID);
  }
}

/* Check npages pages at buf against ids (16 bytes each): the index of the first page
 * whose blake3-128 differs, or -1. kinds (may be NULL = all data): pages with kinds[i] == 0
 * are skipped (zero pages the reader produced itself). */
GS_EXPORT long gs_verify(const uint8_t *buf, size_t npages, const uint8_t *ids, const uint8_t *kinds) {
  const uint8_t *lane[GS_LANES];
  size_t lane_no[GS_LANES];
  uint8_t out[GS_LANES * GS_ID];
  size_t n = 0;
  for (size_t i = 0; i < npages; i++) {
    if (kinds && !kinds[i])
      continue;
    lane[n] = buf + i * GS_PAGE;
    lane_no[n] = i;
    if (++n == GS_LANES || i + 1 == npages) {
      hash_lanes(lane, n, out);
      for (size_t j = 0; j < n; j++)
        if (memcmp(out + j * GS_ID, ids + lane_no[j] * GS_ID, GS_ID) != 0)
          return (long)lane_no[j];
      n = 0;
    }
  }
  if (n) {
    hash_lanes(lane, n, out);
    for (size_t j = 0; j < n; j++)
      if (memcmp(out + j * GS_ID, ids + lane_no[j] * GS_ID, GS_ID) != 0)
        return (long)lane_no[j];
  }
  return -1;
}

/* Full blake3 (32 bytes) of len bytes: the reference implementation, for the self test. */
static void gs_blake3(const uint8_t *buf, size_t len, uint8_t *out32) {
  blake3_hasher h;
  blake3_hasher_init(&h);
  blake3_hasher_update(&h, buf, len);
  blake3_hasher_finalize(&h, out32, BLAKE3_OUT_LEN);
}

/* 0 when the batched page hash agrees with blake3_hasher on a few pseudo-random and
 * patterned pages, for every batch width; else -1 (the loader then refuses the library). */
GS_EXPORT int gs_selftest(void) {
  /* on the stack, not static: loads in several threads run it side by side */
  uint8_t buf[(GS_LANES + 3) * GS_PAGE];
  uint8_t ids[(GS_LANES + 3) * GS_ID], ref[BLAKE3_OUT_LEN];
  uint64_t x = 0x9E3779B97F4A7C15ull;
  for (size_t i = 0; i < sizeof buf; i++) {
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    buf[i] = (uint8_t)x;
  }
  memset(buf + 2 * GS_PAGE, 0, GS_PAGE);
  memset(buf + 5 * GS_PAGE + 100, 0xff, GS_PAGE - 100);
  size_t total = GS_LANES + 3;
  for (size_t n = 1; n <= total; n++) {
    gs_hash_pages(buf, n, ids);
    for (size_t i = 0; i < n; i++) {
      gs_blake3(buf + i * GS_PAGE, GS_PAGE, ref);
      if (memcmp(ref, ids + i * GS_ID, GS_ID) != 0)
        return -1;
    }
  }
  return 0;
}
