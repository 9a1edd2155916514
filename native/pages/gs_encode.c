/* gpusnap's storing-phase compress loop: one call encodes a whole batch of page groups
 * (gpusnap/repo/pipeline/sinks.py PagesSink) without the GIL, with the system's liblz4 and
 * libzstd.
 *
 * It makes exactly the decisions of the Python codec (gpusnap/repo/codec.py compress(),
 * _auto(), encode_shuffled()) and of the sink's per-thread heuristics (skip after a group
 * that did not compress, lz4 tried first or not), and writes the same payloads
 * (docs/format.md §3): lz4 block without size; zstd frame at ZSTD_LEVEL without content
 * size; shuffle<k>-zstd = k u32 LE plane lengths, each plane a zstd frame with the plane
 * parameters (codec.PLANE_PARAMS and PLANE_ACCEL; the Python codec compresses its planes
 * through gs_plane_compress) or raw, then the tail. tests/test_native_encode.py compares the
 * two group by group: byte for byte, except plain zstd frames, which libzstd versions
 * (the system's vs python-zstandard's bundled one) may make a few bytes apart. The
 * constants come from Python (gs_enc_new) so codec.py and sinks.py stay their one
 * definition.
 *
 * An encoder (gs_enc_new) holds one thread's compression contexts and scratch buffers:
 * one encoder per compressor thread, never used by two threads at once. Attempts are made
 * straight in the group's place in the caller's output when it has room (gs_enc_out_cap),
 * so the chosen payload is not copied again.
 */
#include <lz4.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
/* for ZSTD_c_literalCompressionMode (an "experimental" parameter of libzstd >= 1.4.0, set
 * through the stable ZSTD_CCtx_setParameter; a libzstd that refuses it keeps the plain plane
 * parameters, see gs_enc_new) */
#define ZSTD_STATIC_LINKING_ONLY
#include <zstd.h>

#include "gs_internal.h"

/* "auto": chosen per group, never stored (the stored ids are gs_internal.h's) */
enum { C_AUTO = -1 };

/* gs_enc_new's params[], in this order (gpusnap/repo/native.py ENC_PARAM_NAMES) */
enum {
  P_GAIN_LIMIT, P_AUTO_LZ4_GOOD, P_AUTO_EST_GAIN, P_PLANE_TRY_BITS, P_PLANE_SAMPLES,
  P_ZSTD_LEVEL, P_SKIP_MAX, P_LZ4_FUTILE, P_LZ4_PROBE,
  P_WINDOW_LOG, P_HASH_LOG, P_CHAIN_LOG, P_SEARCH_LOG, P_MIN_MATCH, P_TARGET_LENGTH, P_STRATEGY,
  P_SAMPLE_PART, P_SAMPLE_SLICES, P_SAMPLE_BYTES, P_PLANE_ACCEL,
  P_COUNT
};

/* the heuristic state (int64[4], in/out): sinks.py _CompressState */
enum { S_SKIP, S_SKIP_NEXT, S_LZ4_FUTILE, S_SINCE_PROBE, S_COUNT };

/* the encoder's counters (gs_enc_stats, in this order: gpusnap/repo/encoder.py STAT_NAMES):
 * groups compressed in full, groups stored raw on the sample's word alone (auto), groups
 * stored raw by the skip heuristic without a look */
enum { T_TRIED, T_SAMPLED_RAW, T_SKIPPED, T_COUNT };

enum { E_ARGS = -1, E_NOMEM = -2, E_SPACE = -3, E_CODEC = -4 };

typedef struct {
  double gain_limit, lz4_good, est_gain;
  int64_t try_bits, samples, skip_max, lz4_futile, lz4_probe;
  int64_t sample_part, sample_slices, sample_bytes; /* codec.SAMPLE_* */
  int64_t stats[T_COUNT];
  ZSTD_CCtx *plane; /* codec.PLANE_PARAMS, no content size */
  ZSTD_CCtx *zstd;  /* ZSTD_LEVEL, no content size */
  void *lz4_state;
  uint8_t *shuf; /* a plane's zstd frame being made */
  uint8_t *sp;   /* the shuffle payload being built */
  uint8_t *lz;   /* lz4 or zstd output */
  uint8_t *smp;  /* the sample of sample_says_raw */
  size_t shuf_cap, sp_cap, lz_cap, smp_cap;
  uint8_t *place; /* the current group's payload in the caller's output, when it has room */
  size_t place_cap;
} gs_enc;

/* The output buffers of gs_encode_groups as the Python binding allocates them (uninitialized,
 * owned by the payloads' views, freed when the last of them is gone). */
GS_EXPORT void *gs_enc_buf_new(size_t n) { return malloc(n ? n : 1); }
GS_EXPORT void gs_enc_buf_free(void *p) { free(p); }

GS_EXPORT void gs_enc_free(void *h) {
  gs_enc *e = h;
  if (!e)
    return;
  ZSTD_freeCCtx(e->plane);
  ZSTD_freeCCtx(e->zstd);
  free(e->lz4_state);
  free(e->shuf);
  free(e->sp);
  free(e->lz);
  free(e->smp);
  free(e);
}

static int set(ZSTD_CCtx *c, ZSTD_cParameter p, int v) {
  return ZSTD_isError(ZSTD_CCtx_setParameter(c, p, v)) ? -1 : 0;
}

/* The plane compressor's parameters: p = window_log, hash_log, chain_log, search_log,
 * min_match, target_length, strategy (codec.PLANE_PARAMS, as python-zstandard's
 * ZstdCompressionParameters takes them), no content size, checksum or dictionary id; then,
 * with accel > 0 (codec.PLANE_ACCEL), the match finder accelerated with every literal still
 * Huffman-coded. A float plane compresses by its literals (exponents); matches of 7 bytes
 * are rare there, and looking for them cost about a quarter of the plane's time. (ZSTD_fast
 * with a targetLength stops compressing literals unless told otherwise; where libzstd
 * refuses the mode, the plain parameters stay.) -> 0, or -1. */
static int plane_setup(ZSTD_CCtx *c, const double *p, double accel) {
  if (set(c, ZSTD_c_windowLog, (int)p[0]) || set(c, ZSTD_c_hashLog, (int)p[1]) ||
      set(c, ZSTD_c_chainLog, (int)p[2]) || set(c, ZSTD_c_searchLog, (int)p[3]) ||
      set(c, ZSTD_c_minMatch, (int)p[4]) || set(c, ZSTD_c_targetLength, (int)p[5]) ||
      set(c, ZSTD_c_strategy, (int)p[6]) || set(c, ZSTD_c_contentSizeFlag, 0) ||
      set(c, ZSTD_c_checksumFlag, 0) || set(c, ZSTD_c_dictIDFlag, 0))
    return -1;
  if (accel > 0 && set(c, ZSTD_c_literalCompressionMode, ZSTD_ps_enable) == 0 &&
      set(c, ZSTD_c_targetLength, (int)accel))
    return -1;
  return 0;
}

/* A plane compressor alone (codec.encode_shuffled's, so that the Python codec writes the
 * payloads the encoder writes): params = the 7 plane parameters of plane_setup, then accel.
 * -> a handle, or NULL (bad arguments, out of memory, parameters zstd refuses). */
GS_EXPORT void *gs_plane_new(const double *params, size_t nparams) {
  if (!params || nparams != 8)
    return NULL;
  ZSTD_CCtx *c = ZSTD_createCCtx();
  if (c && plane_setup(c, params, params[7])) {
    ZSTD_freeCCtx(c);
    c = NULL;
  }
  return c;
}

GS_EXPORT void gs_plane_free(void *h) { ZSTD_freeCCtx(h); }

/* -> a new encoder, or NULL (out of memory, or parameters zstd refuses). */
GS_EXPORT void *gs_enc_new(const double *params, size_t nparams) {
  if (!params || nparams != P_COUNT)
    return NULL;
  gs_enc *e = calloc(1, sizeof *e);
  if (!e)
    return NULL;
  e->gain_limit = params[P_GAIN_LIMIT];
  e->lz4_good = params[P_AUTO_LZ4_GOOD];
  e->est_gain = params[P_AUTO_EST_GAIN];
  e->try_bits = (int64_t)params[P_PLANE_TRY_BITS];
  e->samples = (int64_t)params[P_PLANE_SAMPLES];
  e->skip_max = (int64_t)params[P_SKIP_MAX];
  e->lz4_futile = (int64_t)params[P_LZ4_FUTILE];
  e->lz4_probe = (int64_t)params[P_LZ4_PROBE];
  e->sample_part = (int64_t)params[P_SAMPLE_PART];
  e->sample_slices = (int64_t)params[P_SAMPLE_SLICES];
  e->sample_bytes = (int64_t)params[P_SAMPLE_BYTES];
  e->plane = ZSTD_createCCtx();
  e->zstd = ZSTD_createCCtx();
  e->lz4_state = malloc(sizeof(LZ4_stream_t));
  if (!e->plane || !e->zstd || !e->lz4_state || e->samples < 1 || e->sample_part < 0 ||
      e->sample_slices < 0 || e->sample_slices > 1024 || e->sample_bytes < 0 || e->sample_bytes > 1 << 16)
    goto fail;
  if (plane_setup(e->plane, params + P_WINDOW_LOG, params[P_PLANE_ACCEL]))
    goto fail;
  /* as ZstdCompressor(level=ZSTD_LEVEL, write_content_size=False) */
  if (set(e->zstd, ZSTD_c_compressionLevel, (int)params[P_ZSTD_LEVEL]) ||
      set(e->zstd, ZSTD_c_contentSizeFlag, 0) || set(e->zstd, ZSTD_c_checksumFlag, 0))
    goto fail;
  return e;
fail:
  gs_enc_free(e);
  return NULL;
}

static int grow(uint8_t **b, size_t *cap, size_t need) {
  if (*cap >= need)
    return 0;
  uint8_t *n = malloc(need);
  if (!n)
    return -1;
  free(*b);
  *b = n;
  *cap = need;
  return 0;
}

/* One zstd frame of src with c (session reset, parameters kept); -> its size, or < 0. */
static int64_t zframe(ZSTD_CCtx *c, uint8_t *dst, size_t cap, const uint8_t *src, size_t n) {
  if (ZSTD_isError(ZSTD_CCtx_reset(c, ZSTD_reset_session_only)))
    return E_CODEC;
  size_t r = ZSTD_compress2(c, dst, cap, src, n);
  return ZSTD_isError(r) ? E_CODEC : (int64_t)r;
}

/* One byte plane as a zstd frame (a gs_plane_new handle) -> its size, or < 0 (E_SPACE: cap
 * below ZSTD_compressBound(n)). */
GS_EXPORT int64_t gs_plane_compress(void *h, const uint8_t *src, size_t n, uint8_t *dst, size_t cap) {
  if (!h || (!src && n) || !dst)
    return E_ARGS;
  if (cap < ZSTD_compressBound(n))
    return E_SPACE;
  return zframe(h, dst, cap, src, n);
}

/* Where an attempt of up to need bytes is written: straight into the group's place in the
 * output when it has room (the chosen payload is then not copied again), else buf. */
static uint8_t *target(gs_enc *e, size_t need, uint8_t *buf) { return e->place_cap >= need ? e->place : buf; }

/* lz4 block of src into *dst (the group's place when use_place and it has room, else
 * e->lz); -> its size, or < 0 */
static int64_t lz4_block(gs_enc *e, const uint8_t *src, size_t n, int use_place, uint8_t **dst) {
  if (n > LZ4_MAX_INPUT_SIZE)
    return E_ARGS;
  size_t bound = (size_t)LZ4_compressBound((int)n);
  if ((!use_place || e->place_cap < bound) && grow(&e->lz, &e->lz_cap, bound))
    return E_NOMEM;
  uint8_t *d = *dst = use_place ? target(e, bound, e->lz) : e->lz;
  /* as python-lz4's lz4.block.compress (mode "default"): a fresh stream, no dictionary,
   * acceleration 1 (its output differs from LZ4_compress_default's for small inputs) */
  LZ4_stream_t *s = LZ4_initStream(e->lz4_state, sizeof(LZ4_stream_t));
  if (!s)
    return E_CODEC;
  int r = LZ4_compress_fast_continue(s, (const char *)src, (char *)d, (int)n, (int)bound, 1);
  return r > 0 ? r : E_CODEC;
}

/* codec.estimate_planes(data, 4) */
static void estimate4(gs_enc *e, const uint8_t *src, size_t n, uint32_t bits[4]) {
  size_t m = n / 4;
  if (m == 0) {
    for (int i = 0; i < 4; i++)
      bits[i] = 8000;
    return;
  }
  size_t step = m / (size_t)e->samples;
  if (step < 1)
    step = 1;
  size_t count = (m - 1) / step + 1;
  gs_plane_bits(src, 1, 4, step * 4, count, bits);
}

/* The bytes a shuffle<k> payload of n bytes may need. */
static size_t shuffled_bound(size_t n, unsigned k) {
  size_t m = n / k;
  return 4 * k + k * ZSTD_compressBound(m) + (n - m * k);
}

/* codec.encode_shuffled(data, k, bits) into *dst (the group's place or e->sp); -> its size,
 * 0 when n < k ("None"), or < 0. bits NULL: every plane is tried with zstd. */
static int64_t shuffled(gs_enc *e, const uint8_t *src, size_t n, unsigned k, const uint32_t *bits,
                        uint8_t **dst) {
  size_t m = n / k;
  if (m == 0)
    return 0;
  size_t tail = n - m * k, need = shuffled_bound(n, k), zcap = ZSTD_compressBound(m);
  if (grow(&e->shuf, &e->shuf_cap, zcap) || (e->place_cap < need && grow(&e->sp, &e->sp_cap, need)))
    return E_NOMEM;
  uint8_t *d = *dst = target(e, need, e->sp);
  /* shuffled straight into the payload (need >= 4k + n): a plane stored raw where it lies
   * is not copied again (float groups: the mantissa planes). What is written at pos never
   * reaches plane i's bytes: pos <= 4k + i*m. A frame is made in e->shuf (not over its
   * source) and copied into place. */
  uint8_t *planes = d + 4 * k;
  gs_shuffle(src, n, k, planes, 0);
  size_t pos = 4 * k;
  for (unsigned i = 0; i < k; i++) {
    const uint8_t *plane = planes + i * m;
    size_t len = m;
    if (!bits || (int64_t)bits[i] < e->try_bits) {
      int64_t z = zframe(e->plane, e->shuf, zcap, plane, m);
      if (z < 0)
        return z;
      if ((size_t)z < m) {
        len = (size_t)z;
        memcpy(d + pos, e->shuf, len);
      }
    }
    if (len == m && d + pos != plane)
      memmove(d + pos, plane, m);
    uint32_t le = (uint32_t)len;
    uint8_t *h = d + 4 * i;
    h[0] = (uint8_t)le;
    h[1] = (uint8_t)(le >> 8);
    h[2] = (uint8_t)(le >> 16);
    h[3] = (uint8_t)(le >> 24);
    pos += len;
  }
  memmove(d + pos, planes + m * k, tail);
  return (int64_t)(pos + tail);
}

/* The payload chosen for one group: codec, and where its bytes are (NULL for GS_CODEC_NONE). */
typedef struct {
  int codec;
  const uint8_t *p;
  size_t len;
} choice;

static int fits(gs_enc *e, int64_t len, size_t n) { return (double)len <= (double)n * e->gain_limit; }

/* codec.sample_says_raw(data): 1 when a cheap sample shows that the group will not
 * compress, so that auto stores it raw without an attempt. The sample: k = min(n /
 * sample_part, sample_slices) slices, together about sample_bytes (each a multiple of 4),
 * one in the middle of each of k equal parts of the group (one per page of a 16-page
 * group), copied one after the other. The group counts as incompressible when each of the
 * sample's 4 byte planes has an order-0 entropy at or above try_bits (floats' exponents,
 * text or zeros in the sampled pages keep one below) and lz4 (block mode, as python-lz4's)
 * gains nothing at all on it. Groups shorter than twice sample_bytes are always attempted.
 * -> 1, 0, or < 0 */
static int sample_says_raw(gs_enc *e, const uint8_t *src, size_t n) {
  size_t part = (size_t)e->sample_part, k = part ? n / part : 0;
  if (k > (size_t)e->sample_slices)
    k = (size_t)e->sample_slices;
  size_t len = k ? (size_t)e->sample_bytes / k / 4 * 4 : 0;
  if (!len || n < 2 * (size_t)e->sample_bytes)
    return 0;
  size_t tot = k * len, step = n / k, bound = (size_t)LZ4_compressBound((int)tot);
  if (grow(&e->smp, &e->smp_cap, tot) || grow(&e->lz, &e->lz_cap, bound))
    return E_NOMEM;
  for (size_t i = 0; i < k; i++)
    memcpy(e->smp + i * len, src + i * step + (step - len) / 2, len);
  /* the entropies first, plane by plane from the last (floats' sign and exponent on
   * little-endian machines): compressible memory mostly stops here, after a quarter of the
   * sample; the decision is the same in whatever order the planes are looked at */
  for (int i = 3; i >= 0; i--) {
    uint32_t b;
    gs_plane_bits(e->smp + i, 1, 1, 4, tot / 4, &b);
    if ((int64_t)b < e->try_bits)
      return 0;
  }
  LZ4_stream_t *s = LZ4_initStream(e->lz4_state, sizeof(LZ4_stream_t));
  if (!s)
    return E_CODEC;
  int r = LZ4_compress_fast_continue(s, (const char *)e->smp, (char *)e->lz, (int)tot, (int)bound, 1);
  if (r <= 0)
    return E_CODEC;
  if ((size_t)r < tot)
    return 0;
  return 1;
}

/* codec._auto(data, lz4_first); lz4's attempt goes to e->lz, shuffle4-zstd's to the place.
 * With lz4 first, a group that sample_says_raw is stored raw without an attempt (after
 * groups where shuffle4-zstd won, float-like memory, the sample would seldom pay). */
static int auto_codec(gs_enc *e, const uint8_t *src, size_t n, int lz4_first, choice *c) {
  uint32_t bits[4];
  uint8_t *sd, *ld;
  int r = lz4_first ? sample_says_raw(e, src, n) : 0;
  if (r < 0)
    return r;
  if (r) {
    e->stats[T_SAMPLED_RAW]++;
    return 0;
  }
  e->stats[T_TRIED]++;
  if (!lz4_first && n >= 4) {
    estimate4(e, src, n, bits);
    int64_t sp = shuffled(e, src, n, 4, bits, &sd);
    if (sp < 0)
      return (int)sp;
    if (sp > 0 && fits(e, sp, n)) {
      *c = (choice){GS_CODEC_SHUF4, sd, (size_t)sp};
      return 0;
    }
  }
  int64_t lz = lz4_block(e, src, n, 0, &ld);
  if (lz < 0)
    return (int)lz;
  if ((double)lz <= (double)n * e->lz4_good) {
    *c = (choice){GS_CODEC_LZ4, ld, (size_t)lz};
    return 0;
  }
  int64_t best_len = (int64_t)n;
  *c = (choice){GS_CODEC_NONE, NULL, n};
  if (fits(e, lz, n)) {
    *c = (choice){GS_CODEC_LZ4, ld, (size_t)lz};
    best_len = lz;
  }
  if (n < 4 || !lz4_first)
    return 0;
  estimate4(e, src, n, bits);
  int64_t m = (int64_t)(n / 4), est = 16 + (int64_t)(n - 4 * (size_t)m);
  for (int i = 0; i < 4; i++)
    est += (int64_t)bits[i] >= e->try_bits ? m : m * (int64_t)bits[i] / 8000 + 64;
  if ((double)est < (double)best_len * e->est_gain) {
    int64_t sp = shuffled(e, src, n, 4, bits, &sd);
    if (sp < 0)
      return (int)sp;
    if (sp > 0 && sp < best_len && fits(e, sp, n))
      *c = (choice){GS_CODEC_SHUF4, sd, (size_t)sp};
  }
  return 0;
}

/* codec.compress(data, codec, lz4_first) */
static int compress_one(gs_enc *e, const uint8_t *src, size_t n, int codec, int lz4_first, choice *c) {
  *c = (choice){GS_CODEC_NONE, NULL, n};
  if (codec == C_AUTO)
    return auto_codec(e, src, n, lz4_first, c);
  e->stats[T_TRIED]++;
  int64_t len;
  uint8_t *p;
  if (codec == GS_CODEC_LZ4) {
    len = lz4_block(e, src, n, 1, &p);
  } else if (codec == GS_CODEC_ZSTD) {
    size_t bound = ZSTD_compressBound(n);
    if (e->place_cap < bound && grow(&e->lz, &e->lz_cap, bound))
      return E_NOMEM;
    p = target(e, bound, e->lz);
    len = zframe(e->zstd, p, bound, src, n);
  } else if (codec == GS_CODEC_SHUF4 || codec == GS_CODEC_SHUF2) {
    len = shuffled(e, src, n, codec == GS_CODEC_SHUF4 ? 4 : 2, NULL, &p);
    if (len == 0)
      return 0;
  } else {
    return 0;
  }
  if (len < 0)
    return (int)len;
  if (fits(e, len, n))
    *c = (choice){codec, p, (size_t)len};
  return 0;
}

/* The encoder's counters since gs_enc_new (T_*: tried, sampled_raw, skipped) into out[n];
 * -> how many it has. */
GS_EXPORT size_t gs_enc_stats(void *h, int64_t *out, size_t n) {
  gs_enc *e = h;
  for (size_t i = 0; e && out && i < n && i < T_COUNT; i++)
    out[i] = e->stats[i];
  return T_COUNT;
}

/* The output capacity with which gs_encode_groups writes every payload in its place (no
 * copy): the groups' bytes plus the most any attempt may need beyond a group's size. */
GS_EXPORT size_t gs_enc_out_cap(const size_t *lens, size_t ngroups) {
  size_t total = 0, slack = 0;
  for (size_t g = 0; g < ngroups; g++) {
    size_t n = lens[g], need = ZSTD_compressBound(n);
    if (n <= LZ4_MAX_INPUT_SIZE && (size_t)LZ4_compressBound((int)n) > need)
      need = (size_t)LZ4_compressBound((int)n);
    for (unsigned k = 2; k <= 4; k += 2)
      if (shuffled_bound(n, k) > need)
        need = shuffled_bound(n, k);
    total += n;
    if (need - n > slack)
      slack = need - n;
  }
  return total + slack;
}

/* Encode ngroups groups (src[g]: lens[g] bytes) with codec (-1 auto, or a stored codec id),
 * carrying the sink's heuristic state (int64[4]: skip, skip_next, lz4_futile, since_probe)
 * from group to group exactly as PagesSink did per group in Python.
 * res: int64[2 * ngroups]: per group the codec used and the payload's length. The payloads
 * of compressed groups are written one after the other into out (out_cap bytes; the sum of
 * lens always suffices: a compressed payload is smaller than its group; with
 * gs_enc_out_cap's capacity every attempt is made in place, none is copied); a GS_CODEC_NONE
 * group's payload is its raw bytes and takes no room in out.
 * -> bytes used in out, or < 0: -1 bad arguments, -2 out of memory, -3 out too small,
 * -4 a compression library failed. On an error the state and res are unspecified. */
GS_EXPORT int64_t gs_encode_groups(void *h, const uint8_t *const *src, const size_t *lens,
                                   size_t ngroups, int codec, int64_t *state, uint8_t *out,
                                   size_t out_cap, int64_t *res) {
  gs_enc *e = h;
  if (!e || !state || !res || (ngroups && (!src || !lens)) || codec < C_AUTO || codec > GS_CODEC_SHUF2)
    return E_ARGS;
  int64_t *st = state;
  size_t used = 0;
  for (size_t g = 0; g < ngroups; g++) {
    size_t n = lens[g];
    choice c = {GS_CODEC_NONE, NULL, n};
    if (st[S_SKIP] || codec == GS_CODEC_NONE) {
      if (st[S_SKIP])
        e->stats[T_SKIPPED]++;
      st[S_SKIP] = st[S_SKIP] > 1 ? st[S_SKIP] - 1 : 0;
    } else {
      int lz4_first = codec != C_AUTO || st[S_LZ4_FUTILE] < e->lz4_futile ||
                      st[S_SINCE_PROBE] >= e->lz4_probe;
      e->place = out + used;
      e->place_cap = out_cap - used;
      int r = compress_one(e, src[g], n, codec, lz4_first, &c);
      if (r < 0)
        return r;
      st[S_SINCE_PROBE] = lz4_first ? 0 : st[S_SINCE_PROBE] + 1;
      if (c.codec == GS_CODEC_NONE) {
        st[S_SKIP] = st[S_SKIP_NEXT];
        st[S_SKIP_NEXT] = st[S_SKIP_NEXT] * 2 < e->skip_max ? st[S_SKIP_NEXT] * 2 : e->skip_max;
      } else {
        st[S_SKIP_NEXT] = 1;
      }
      st[S_LZ4_FUTILE] = c.codec == GS_CODEC_SHUF4 ? st[S_LZ4_FUTILE] + 1 : 0;
    }
    res[2 * g] = c.codec;
    res[2 * g + 1] = (int64_t)c.len;
    if (c.codec != GS_CODEC_NONE) {
      if (c.len > out_cap - used)
        return E_SPACE;
      if (c.p != out + used)
        memcpy(out + used, c.p, c.len);
      used += c.len;
    }
  }
  return (int64_t)used;
}
