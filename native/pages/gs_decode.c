/* gpusnap read path: one job's pages blobs read, checked and decoded in one native call
 * (gpusnap/repo/reader.py assemble(); ctypes releases the GIL for its duration).
 *
 * For each piece (a run: pages slot .. slot+count-1 of one blob) the blob is read with one
 * pread/preadv, its 16-byte header checked against the piece's record exactly as
 * gpusnap/repo/store.py decode_blob does, and its payload decoded (docs/format.md §3):
 * straight into the job's buffer when the whole blob is used, else into scratch and the
 * used pages copied. Then every page of the job is checked against its id (gs_verify).
 *
 * Everything read is untrusted: lengths are bounded by the format's limits before any
 * buffer is touched, a zstd frame must produce exactly the expected bytes (a frame that
 * declares another size is refused), lz4 must produce exactly raw_len, and the shuffle
 * codecs' plane lengths must tile the payload. Errors come back as a code, the failing
 * piece (or page) and, for format errors, the message the Python decoder gives (for a
 * payload that does not decode, GS_DEC_CODEC, the libraries' reasons may be worded
 * differently from python-zstandard's: the caller asks the Python decoder for its words).
 *
 * Scratch buffers and the zstd context are per thread (kept between calls, freed when the
 * thread exits): no allocation per blob.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>
#include <sys/uio.h>
#include <unistd.h>

#include <lz4.h>
#include <zstd.h>
#include <zstd_errors.h>

#include "gs_internal.h"

#define GS_HDR 16u
#define GS_MAX_GROUP_PAGES 256u            /* format.MAX_GROUP_PAGES */
#define GS_MAX_BLOB_RAW (4u << 20)         /* format.MAX_BLOB_RAW */
#define GS_SCRATCH (GS_MAX_GROUP_PAGES * GS_PAGE) /* the largest pages blob */
#define GS_KIND_PAGES 1
#define GS_KIND_DATA 2

/* return codes of gs_decode_job (gpusnap/repo/native.py DECODE_*) */
#define GS_DEC_OK 0
#define GS_DEC_IO (-1)     /* err[1] = errno */
#define GS_DEC_FORMAT (-2) /* msg = what is wrong (FormatError text) */
#define GS_DEC_PAGE (-3)   /* err[1] = index of the first page failing its checksum */
#define GS_DEC_ARGS (-4)   /* the caller's arrays are inconsistent (a bug, not the disk) */
#define GS_DEC_NOMEM (-5)
#define GS_DEC_CODEC (-6)  /* the payload does not decode: msg = why (wording of its own) */

#define GS_PIECE_FIELDS 11 /* fd, key, offset, kind, codec, n_pages, raw_len, stored_len, slot, count, dst */


/* ---- per-thread state ---------------------------------------------------------------- */
struct gs_tls {
  uint8_t *in;    /* header + payload as read: GS_HDR + GS_SCRATCH */
  uint8_t *out;   /* a whole decoded blob (partial use): GS_SCRATCH */
  uint8_t *sh;    /* the byte planes of a shuffle codec, or the skipped part of a raw blob */
  ZSTD_DCtx *dctx;
  /* which blob `out` holds (a blob split between two jobs is decoded once): valid when
   * token != 0; the caller's token names its reader (pack numbers are its own) */
  int64_t token, key, off;
};

static pthread_key_t tls_key;
static pthread_once_t tls_once = PTHREAD_ONCE_INIT;
static int tls_key_ok;

static void tls_free(void *p) {
  struct gs_tls *t = p;
  if (!t)
    return;
  free(t->in);
  free(t->out);
  free(t->sh);
  ZSTD_freeDCtx(t->dctx);
  free(t);
}

static void tls_init(void) { tls_key_ok = pthread_key_create(&tls_key, tls_free) == 0; }

static struct gs_tls *tls_get(void) {
  pthread_once(&tls_once, tls_init);
  if (!tls_key_ok)
    return NULL;
  struct gs_tls *t = pthread_getspecific(tls_key);
  if (t)
    return t;
  t = calloc(1, sizeof *t);
  if (!t)
    return NULL;
  /* only pages blobs are decoded here (a record of another kind is refused before any
   * buffer is touched): at most MAX_GROUP_PAGES pages */
  t->in = malloc(GS_HDR + GS_SCRATCH);
  t->out = malloc(GS_SCRATCH);
  t->sh = malloc(GS_SCRATCH);
  t->dctx = ZSTD_createDCtx();
  if (!t->in || !t->out || !t->sh || !t->dctx || pthread_setspecific(tls_key, t) != 0) {
    tls_free(t);
    return NULL;
  }
  return t;
}

/* ---- errors ---------------------------------------------------------------------------- */
struct gs_err {
  char *msg;
  size_t msg_len;
};

__attribute__((format(printf, 2, 3))) static int fmt_err(struct gs_err *e, const char *f, ...) {
  if (e->msg && e->msg_len) {
    va_list ap;
    va_start(ap, f);
    vsnprintf(e->msg, e->msg_len, f, ap);
    va_end(ap);
  }
  return GS_DEC_FORMAT;
}

/* format.check_blob_fields, with its messages */
static int check_fields(struct gs_err *e, unsigned kind, unsigned codec, unsigned n_pages, uint64_t raw_len,
                        uint64_t stored_len) {
  if (kind != GS_KIND_PAGES && kind != GS_KIND_DATA)
    return fmt_err(e, "unknown blob kind %u", kind);
  if (codec > GS_CODEC_SHUF2)
    return fmt_err(e, "unknown codec id %u", codec);
  if (kind == GS_KIND_PAGES) {
    if (n_pages < 1 || n_pages > GS_MAX_GROUP_PAGES || raw_len != (uint64_t)n_pages * GS_PAGE)
      return fmt_err(e, "page blob with inconsistent page count / length");
  } else if (n_pages != 0 || raw_len < 1 || raw_len > GS_MAX_BLOB_RAW) {
    return fmt_err(e, "data blob with bad length / page count");
  }
  if (codec == GS_CODEC_NONE) {
    if (stored_len != raw_len)
      return fmt_err(e, "uncompressed blob whose stored length differs from its length");
  } else if (stored_len < 1 || stored_len >= raw_len) {
    return fmt_err(e, "compressed blob not smaller than its raw length");
  }
  return GS_DEC_OK;
}

static uint16_t le16(const uint8_t *p) { return (uint16_t)(p[0] | p[1] << 8); }
static uint32_t le32(const uint8_t *p) {
  return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

/* store.decode_blob's header check: the header parsed (format.parse_blob_header), then
 * compared with the record */
static int check_header(struct gs_err *e, const uint8_t *h, int64_t offset, unsigned kind, unsigned codec,
                        unsigned n_pages, uint64_t raw_len, uint64_t stored_len) {
  if (h[0] != 'G' || h[1] != 'B' || le16(h + 6) != 0)
    return fmt_err(e, "bad blob header magic");
  unsigned hk = h[2], hc = h[3], hn = le16(h + 4);
  uint32_t hr = le32(h + 8), hs = le32(h + 12);
  int rc = check_fields(e, hk, hc, hn, hr, hs);
  if (rc)
    return rc;
  if (hk != kind || hc != codec || hn != n_pages || hr != raw_len || hs != stored_len)
    return fmt_err(e, "blob header at offset %lld disagrees with the index", (long long)offset);
  return GS_DEC_OK;
}

/* ---- reading ----------------------------------------------------------------------------- */
/* Read exactly `want` bytes at off into iov (short only at the end of the file): 0, the
 * truncation message, or GS_DEC_IO with errno in *err_no. */
static int read_fully(int fd, struct iovec *iov, int niov, size_t want, int64_t off, int64_t blob_off,
                      struct gs_err *e, int64_t *err_no) {
  size_t got = 0;
  while (got < want) {
    ssize_t r = preadv(fd, iov, niov, (off_t)(off + (int64_t)got));
    if (r < 0) {
      if (errno == EINTR)
        continue;
      *err_no = errno;
      return GS_DEC_IO;
    }
    if (r == 0)
      return fmt_err(e, "pack truncated: blob at offset %lld cut short", (long long)blob_off);
    got += (size_t)r;
    /* advance the iovecs past what was read */
    size_t adv = (size_t)r;
    while (niov && adv >= iov->iov_len) {
      adv -= iov->iov_len;
      iov++;
      niov--;
    }
    if (niov) {
      iov->iov_base = (uint8_t *)iov->iov_base + adv;
      iov->iov_len -= adv;
    }
  }
  return GS_DEC_OK;
}

/* ---- codecs ------------------------------------------------------------------------------ */
/* codec._zstd_into: one zstd frame into exactly m bytes */
static int zstd_exact(struct gs_err *e, ZSTD_DCtx *d, const uint8_t *src, size_t n, uint8_t *dst, size_t m,
                      const char *what) {
  unsigned long long fcs = ZSTD_getFrameContentSize(src, n);
  if (fcs == ZSTD_CONTENTSIZE_ERROR)
    return fmt_err(e, "cannot decompress %s: error when determining content size", what);
  if (fcs != ZSTD_CONTENTSIZE_UNKNOWN && fcs != m)
    return fmt_err(e, "zstd frame of %s declares a different size", what);
  size_t r = ZSTD_decompressDCtx(d, dst, m, src, n);
  if (ZSTD_isError(r)) {
    if (ZSTD_getErrorCode(r) == ZSTD_error_dstSize_tooSmall)
      return fmt_err(e, "%s decompressed to another size than %zu bytes", what, m);
    return fmt_err(e, "cannot decompress %s: zstd decompress error: %s", what, ZSTD_getErrorName(r));
  }
  if (r != m)
    return fmt_err(e, "%s decompressed to another size than %zu bytes", what, m);
  return GS_DEC_OK;
}

/* codec.decode_shuffled_into: planes into sh (raw_len bytes of scratch), unshuffled into dst */
static int shuffled(struct gs_err *e, ZSTD_DCtx *dctx, uint8_t *sh, const uint8_t *p, size_t n, unsigned k,
                    size_t raw_len, uint8_t *dst) {
  size_t m = raw_len / k, tail = raw_len - m * k, hdr = 4u * k;
  if (m == 0)
    return fmt_err(e, "shuffle%u blob shorter than one element", k);
  if (n < hdr + tail)
    return fmt_err(e, "shuffle payload shorter than its header");
  uint64_t sum = 0;
  uint32_t lens[4];
  for (unsigned i = 0; i < k; i++) {
    lens[i] = le32(p + 4 * i);
    sum += lens[i];
    if (lens[i] < 1 || lens[i] > m)
      return fmt_err(e, "shuffle payload: bad plane lengths");
  }
  if (hdr + sum + tail != n)
    return fmt_err(e, "shuffle payload: bad plane lengths");
  size_t pos = hdr;
  for (unsigned i = 0; i < k; i++) {
    if (lens[i] == m) {
      memcpy(sh + i * m, p + pos, m);
    } else {
      char what[16];
      snprintf(what, sizeof what, "plane %u", i);
      int rc = zstd_exact(e, dctx, p + pos, lens[i], sh + i * m, m, what);
      if (rc)
        return rc;
    }
    pos += lens[i];
  }
  memcpy(sh + m * k, p + pos, tail);
  gs_unshuffle(sh, raw_len, k, dst, 0);
  return GS_DEC_OK;
}

/* the payload p (n bytes, codec != none) decoded into exactly raw_len bytes at dst; sh:
 * raw_len bytes of scratch for the shuffle codecs */
static int decode(struct gs_err *e, struct gs_tls *t, uint8_t *sh, unsigned codec, const uint8_t *p, size_t n,
                  size_t raw_len, uint8_t *dst) {
  switch (codec) {
  case GS_CODEC_ZSTD:
    return zstd_exact(e, t->dctx, p, n, dst, raw_len, "blob");
  case GS_CODEC_LZ4: {
    int r = LZ4_decompress_safe((const char *)p, (char *)dst, (int)n, (int)raw_len);
    if (r < 0)
      return fmt_err(e,
                     "cannot decompress blob: Decompression failed: corrupt input or insufficient space in "
                     "destination buffer. Error code: %d",
                     -r);
    if ((size_t)r != raw_len)
      return fmt_err(e, "blob decompressed to %d bytes, expected %zu", r, raw_len);
    return GS_DEC_OK;
  }
  case GS_CODEC_SHUF4:
    return shuffled(e, t->dctx, sh, p, n, 4, raw_len, dst);
  case GS_CODEC_SHUF2:
    return shuffled(e, t->dctx, sh, p, n, 2, raw_len, dst);
  default:
    return fmt_err(e, "unknown codec %u", codec);
  }
}

/* ---- one payload ------------------------------------------------------------------------- */
/* The payload p (n bytes, stored with codec, not none) of one blob whose header the caller
 * has checked against its record (store.decode_blob), decoded into exactly raw_len bytes at
 * dst. The data blobs of a restore come this way: python-lz4 and zstandard are then never
 * loaded by a restore (their extension modules cost 30-50 ms from a cold page cache).
 * Returns GS_DEC_OK, GS_DEC_FORMAT (lengths out of the format's bounds), GS_DEC_CODEC (the
 * payload does not decode; msg = why), or GS_DEC_NOMEM. */
GS_EXPORT int gs_decode_payload(unsigned codec, const uint8_t *p, size_t n, uint8_t *dst, size_t raw_len, char *msg,
                                size_t msg_len) {
  struct gs_err e = {msg, msg_len};
  uint8_t *big = NULL;
  int rc;
  if (msg && msg_len)
    msg[0] = 0;
  if (codec == GS_CODEC_NONE || codec > GS_CODEC_SHUF2)
    return fmt_err(&e, "unknown codec %u", codec);
  if (raw_len < 1 || raw_len > GS_MAX_BLOB_RAW || n < 1 || n >= raw_len)
    return fmt_err(&e, "compressed blob not smaller than its raw length");
  struct gs_tls *t = tls_get();
  if (!t)
    return GS_DEC_NOMEM;
  uint8_t *sh = t->sh;
  if ((codec == GS_CODEC_SHUF4 || codec == GS_CODEC_SHUF2) && raw_len > GS_SCRATCH) {
    /* a data blob larger than the per-thread scratch (up to MAX_BLOB_RAW): rare */
    sh = big = malloc(raw_len);
    if (!big)
      return GS_DEC_NOMEM;
  }
  rc = decode(&e, t, sh, codec, p, n, raw_len, dst);
  free(big);
  return rc ? GS_DEC_CODEC : GS_DEC_OK;
}

/* ---- the job ----------------------------------------------------------------------------- */
/* Decode npieces pieces (GS_PIECE_FIELDS int64 each: pack fd, the pack's key (its number
 * in the caller's locations), offset of the blob header in the pack, kind, codec, n_pages,
 * raw_len, stored_len, first slot used, pages used, offset of those pages in buf) into buf
 * (buf_len bytes), then check npages pages of buf against ids (16 bytes each; pages with
 * kinds[i] == 0 are skipped, as gs_verify; npages 0: no check).
 * token: names the caller's reader (its keys): the last blob decoded for a partial piece
 * is kept for the next call of the same token in this thread; 0 keeps nothing.
 * Returns GS_DEC_OK or a GS_DEC_* code with err[0] = the failing piece (-1 for none),
 * err[1] = errno (GS_DEC_IO) or the failing page (GS_DEC_PAGE), and for GS_DEC_FORMAT and
 * GS_DEC_CODEC the message in msg (NUL-terminated, cut to msg_len). */
GS_EXPORT int gs_decode_job(const int64_t *pieces, size_t npieces, uint8_t *buf, size_t buf_len, size_t npages,
                            const uint8_t *ids, const uint8_t *kinds, int64_t token, int64_t *err, char *msg,
                            size_t msg_len) {
  struct gs_err e = {msg, msg_len};
  err[0] = -1;
  err[1] = 0;
  if (msg && msg_len)
    msg[0] = 0;
  if (npages > buf_len / GS_PAGE)
    return GS_DEC_ARGS;
  struct gs_tls *t = npieces ? tls_get() : NULL;
  if (npieces && !t)
    return GS_DEC_NOMEM;
  if (t && (t->token != token || token == 0))
    t->token = t->key = t->off = -1;   /* another reader's blob (or none kept): forget it */

  for (size_t i = 0; i < npieces; i++) {
    const int64_t *f = pieces + i * GS_PIECE_FIELDS;
    int64_t fd = f[0], key = f[1], off = f[2], kind = f[3], codec = f[4], n_pages = f[5], raw_len = f[6],
            stored_len = f[7], slot = f[8], count = f[9], dst_off = f[10];
    int rc;
    err[0] = (int64_t)i;
    if (fd < 0 || fd > INT32_MAX || off < 0 || off > INT64_MAX / 2 || kind < 0 || kind > 255 || codec < 0 ||
        codec > 255 || n_pages < 0 || n_pages > 65535 || raw_len < 0 || raw_len > UINT32_MAX || stored_len < 0 ||
        stored_len > UINT32_MAX)
      return fmt_err(&e, "locations run malformed");
    rc = check_fields(&e, (unsigned)kind, (unsigned)codec, (unsigned)n_pages, (uint64_t)raw_len, (uint64_t)stored_len);
    if (rc)
      return rc;
    if (kind != GS_KIND_PAGES)
      return fmt_err(&e, "locations run of another kind than pages");
    if (count < 1 || slot < 0 || slot + count > n_pages)
      return fmt_err(&e, "locations run slots out of range");
    if (dst_off < 0 || (uint64_t)dst_off > buf_len || (uint64_t)count * GS_PAGE > buf_len - (uint64_t)dst_off)
      return GS_DEC_ARGS;
    /* from here: raw_len = n_pages pages <= GS_SCRATCH, stored_len <= raw_len */
    size_t rl = (size_t)raw_len, sl = (size_t)stored_len, s = (size_t)slot * GS_PAGE,
           used = (size_t)count * GS_PAGE;
    uint8_t *dst = buf + dst_off;
    int whole = s == 0 && used == rl;

    if (codec == GS_CODEC_NONE) {
      /* stored raw: the used pages read straight into place, the rest into scratch */
      struct iovec iov[4];
      int n = 0;
      iov[n++] = (struct iovec){t->in, GS_HDR};
      if (s)
        iov[n++] = (struct iovec){t->sh, s};
      iov[n++] = (struct iovec){dst, used};
      if (s + used < rl)
        iov[n++] = (struct iovec){t->sh, rl - s - used};
      rc = read_fully((int)fd, iov, n, GS_HDR + sl, off, off, &e, &err[1]);
      if (rc)
        return rc;
      rc = check_header(&e, t->in, off, (unsigned)kind, (unsigned)codec, (unsigned)n_pages, raw_len, stored_len);
      if (rc)
        return rc;
      continue;
    }
    if (!whole && t->key == key && t->off == off) {
      memcpy(dst, t->out + s, used);
      continue;
    }
    struct iovec iov = {t->in, GS_HDR + sl};
    rc = read_fully((int)fd, &iov, 1, GS_HDR + sl, off, off, &e, &err[1]);
    if (rc)
      return rc;
    rc = check_header(&e, t->in, off, (unsigned)kind, (unsigned)codec, (unsigned)n_pages, raw_len, stored_len);
    if (rc)
      return rc;
    if (whole) {
      rc = decode(&e, t, t->sh, (unsigned)codec, t->in + GS_HDR, sl, rl, dst);
      if (rc)
        return GS_DEC_CODEC;
    } else {
      t->key = t->off = -1;
      rc = decode(&e, t, t->sh, (unsigned)codec, t->in + GS_HDR, sl, rl, t->out);
      if (rc)
        return GS_DEC_CODEC;
      t->token = token;
      t->key = key;
      t->off = off;
      memcpy(dst, t->out + s, used);
    }
  }
  err[0] = -1;
  if (npages) {
    long bad = gs_verify(buf, npages, ids, kinds);
    if (bad >= 0) {
      err[1] = bad;
      return GS_DEC_PAGE;
    }
  }
  return GS_DEC_OK;
}
