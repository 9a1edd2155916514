/* Index files (docs/format.md §4) parsed without a Python object per blob: the records of
 * one file checked and written as fixed-size entries (gs_index_rec), and the page ids of
 * the kept page blobs gathered for the page table (gpusnap/repo/index.py).
 *
 * The file is untrusted: every field is checked in the order of the Python reference parse
 * (gpusnap/repo/format/index.py parse_index, format/pack.py check_blob_fields), so that a
 * damaged file gets the same error. The caller has checked the header, the pack list and the
 * checksum, and that n_blobs records could fit (which sizes `out`). */
#include <stdint.h>
#include <string.h>

#include "gs_internal.h"

#define GS_IDX_RECORD 20u /* pack_no u32, offset u32, kind u8, codec u8, n_pages u16, raw_len u32, stored_len u32 */
#define GS_PAGE_ID 16u
#define GS_BLOB_ID 32u
#define GS_KIND_PAGES 1u

/* one parsed record (32 bytes, little-endian host layout, read by index.py as "<QIIIIIBBxx") */
typedef struct {
  uint64_t ids_off; /* offset of the record's ids in the file */
  uint32_t offset, n_pages, raw_len, stored_len, pack_no;
  uint8_t kind, codec;
  uint16_t pad;
} gs_index_rec;

_Static_assert(sizeof(gs_index_rec) == 32, "gs_index_rec is 32 bytes");

/* errors, reported as -code; *err_val holds the offending value where the message names one */
enum {
  GS_IDX_TRUNC_RECORD = 1,
  GS_IDX_BAD_KIND,
  GS_IDX_BAD_CODEC,
  GS_IDX_BAD_PAGES,
  GS_IDX_BAD_DATA,
  GS_IDX_BAD_STORED_NONE,
  GS_IDX_BAD_STORED,
  GS_IDX_PACK_RANGE,
  GS_IDX_OFFSET_RANGE,
  GS_IDX_TRUNC_IDS,
  GS_IDX_TRAILING,
};

/* the format's limits, passed by index.py from format/common.py (one source of truth) */
enum {
  P_KINDS_MASK,     /* bit k set: blob kind k is known (k < 64) */
  P_CODECS_MASK,    /* bit c set: codec id c is known */
  P_KIND_PAGES,
  P_CODEC_NONE,
  P_MAX_GROUP_PAGES,
  P_PAGE_SIZE,
  P_MAX_BLOB_RAW,
  P_MAX_PACK_SIZE,
  P_PACK_HEADER,
  P_BLOB_HEADER,
  P_PACK_TRAILER,
  P_COUNT
};

static uint32_t rd32(const uint8_t *p) {
  uint32_t v;
  memcpy(&v, p, 4);
  return v; /* the format is little-endian, as every host gpusnap builds for */
}

static uint16_t rd16(const uint8_t *p) {
  uint16_t v;
  memcpy(&v, p, 2);
  return v;
}

/* Check the records of one index file (body: the file without its checksum, len bytes;
 * records from `pos`) and write the kept ones to out[] (room for n_blobs). pack_size
 * (n_packs entries, -1 = missing) or NULL: with it, a record whose pack is missing or
 * shorter than the record's end is left out and flagged in pack_flags[pack_no] (1 missing,
 * 2 short). pack_end[pack_no] (zeroed by the caller): the largest end of a kept record.
 * -> number of records kept, or -error (*err_val: the value the message names). */
GS_EXPORT int64_t gs_index_parse(const uint8_t *body, uint64_t len, uint64_t pos, uint32_t n_packs,
                                 uint32_t n_blobs, const uint64_t *params, const int64_t *pack_size,
                                 uint8_t *pack_flags, uint64_t *pack_end, gs_index_rec *out,
                                 uint64_t *out_pages, uint64_t *err_val) {
  uint64_t kept = 0, pages = 0;
  *err_val = 0;
  if (pos > len)
    return -GS_IDX_TRUNC_RECORD;
  for (uint32_t i = 0; i < n_blobs; i++) {
    if (len - pos < GS_IDX_RECORD)
      return -GS_IDX_TRUNC_RECORD;
    const uint8_t *r = body + pos;
    uint32_t pack_no = rd32(r), offset = rd32(r + 4);
    uint32_t kind = r[8], codec = r[9], n_pages = rd16(r + 10);
    uint32_t raw_len = rd32(r + 12), stored_len = rd32(r + 16);
    pos += GS_IDX_RECORD;
    if (kind >= 64 || !((params[P_KINDS_MASK] >> kind) & 1)) {
      *err_val = kind;
      return -GS_IDX_BAD_KIND;
    }
    if (codec >= 64 || !((params[P_CODECS_MASK] >> codec) & 1)) {
      *err_val = codec;
      return -GS_IDX_BAD_CODEC;
    }
    int is_pages = kind == params[P_KIND_PAGES];
    if (is_pages) {
      if (n_pages < 1 || n_pages > params[P_MAX_GROUP_PAGES] ||
          (uint64_t)raw_len != (uint64_t)n_pages * params[P_PAGE_SIZE])
        return -GS_IDX_BAD_PAGES;
    } else if (n_pages != 0 || raw_len < 1 || raw_len > params[P_MAX_BLOB_RAW]) {
      return -GS_IDX_BAD_DATA;
    }
    if (codec == params[P_CODEC_NONE]) {
      if (stored_len != raw_len)
        return -GS_IDX_BAD_STORED_NONE;
    } else if (stored_len < 1 || stored_len >= raw_len) {
      return -GS_IDX_BAD_STORED;
    }
    if (pack_no >= n_packs)
      return -GS_IDX_PACK_RANGE;
    if (offset < params[P_PACK_HEADER] ||
        (uint64_t)offset + params[P_BLOB_HEADER] + stored_len > params[P_MAX_PACK_SIZE])
      return -GS_IDX_OFFSET_RANGE;
    uint64_t idlen = is_pages ? (uint64_t)n_pages * GS_PAGE_ID : GS_BLOB_ID;
    if (len - pos < idlen)
      return -GS_IDX_TRUNC_IDS;
    uint64_t ids_off = pos;
    pos += idlen;
    uint64_t end = (uint64_t)offset + params[P_BLOB_HEADER] + stored_len + params[P_PACK_TRAILER];
    if (pack_size) {
      if (pack_size[pack_no] < 0) {
        pack_flags[pack_no] |= 1;
        continue;
      }
      if (end > (uint64_t)pack_size[pack_no]) {
        pack_flags[pack_no] |= 2;
        continue;
      }
    }
    if (end > pack_end[pack_no])
      pack_end[pack_no] = end;
    gs_index_rec *o = &out[kept++];
    o->ids_off = ids_off;
    o->offset = offset;
    o->n_pages = n_pages;
    o->raw_len = raw_len;
    o->stored_len = stored_len;
    o->pack_no = pack_no;
    o->kind = (uint8_t)kind;
    o->codec = (uint8_t)codec;
    o->pad = 0;
    if (is_pages)
      pages += n_pages;
  }
  if (pos != len)
    return -GS_IDX_TRAILING;
  *out_pages = pages;
  return (int64_t)kept;
}

/* The page blobs among recs[0..n) (as gs_index_parse wrote them for `body`), numbered from
 * bno0: their ids appended to ids_out, and per blob bases[] = bno << 8, counts[] = n_pages
 * (the arguments of gs_table_add_runs). Only the page records are written; data records
 * have their index in data_no[] (room for n). kind_pages: the page blob kind. ids_out NULL:
 * only data_no (bases and counts are not written).
 * -> number of page blobs; *n_data: number of data blobs. */
GS_EXPORT int64_t gs_index_runs(const uint8_t *body, const gs_index_rec *recs, uint64_t n, int64_t bno0,
                                uint32_t kind_pages, uint8_t *ids_out, int64_t *bases, uint32_t *counts,
                                uint32_t *data_no, uint64_t *n_data) {
  int64_t runs = 0;
  uint64_t nd = 0;
  for (uint64_t i = 0; i < n; i++) {
    const gs_index_rec *r = &recs[i];
    if (r->kind != kind_pages) {
      data_no[nd++] = (uint32_t)i;
      continue;
    }
    if (!ids_out)
      continue;
    size_t sz = (size_t)r->n_pages * GS_PAGE_ID;
    memcpy(ids_out, body + r->ids_off, sz);
    ids_out += sz;
    bases[runs] = (bno0 + (int64_t)i) << 8;
    counts[runs] = r->n_pages;
    runs++;
  }
  *n_data = nd;
  return runs;
}
