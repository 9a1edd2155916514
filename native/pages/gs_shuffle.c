/* gpusnap byte shuffle for the float-aware codecs (docs/format.md §3, codecs 3 and 4), for
 * gpusnap/repo/native.py (ctypes; the GIL is released during every call).
 *
 * shuffle(k): n bytes seen as m = n / k elements of k bytes; byte i of element j goes to
 * dst[i*m + j] ("byte planes": plane i holds byte i of every element), and the last
 * n mod k bytes are copied unchanged after the planes. unshuffle(k) is the inverse.
 * For little-endian fp32 (k = 4) plane 3 holds sign + 7 exponent bits, plane 2 the last
 * exponent bit + the top of the mantissa: those planes compress well on their own, the
 * low mantissa planes are close to random. bf16/fp16: k = 2.
 *
 * Implementations: AVX2 (x86-64, chosen at run time) and portable C; both give the same
 * bytes (checked in tests/test_codec_shuffle.py, also against the pure-Python reference).
 *
 * gs_plane_bits(): a sampled order-0 entropy estimate (milli-bits per byte) of each plane,
 * used by the codec to skip planes that zstd could not shrink.
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define GS_HAVE_AVX2 1
#else
#define GS_HAVE_AVX2 0
#endif

#include "gs_internal.h"

#define GS_SHUF_PORTABLE 1u /* flags: force the portable implementation */

/* ---- portable ------------------------------------------------------------------------ */
static void shuffle_portable(const uint8_t *src, size_t m, unsigned k, uint8_t *dst,
                             size_t from) {
  if (k == 4) {
    uint8_t *d0 = dst, *d1 = dst + m, *d2 = dst + 2 * m, *d3 = dst + 3 * m;
    for (size_t j = from; j < m; j++) {
      const uint8_t *s = src + 4 * j;
      d0[j] = s[0];
      d1[j] = s[1];
      d2[j] = s[2];
      d3[j] = s[3];
    }
  } else {
    uint8_t *d0 = dst, *d1 = dst + m;
    for (size_t j = from; j < m; j++) {
      d0[j] = src[2 * j];
      d1[j] = src[2 * j + 1];
    }
  }
}

static void unshuffle_portable(const uint8_t *src, size_t m, unsigned k, uint8_t *dst,
                               size_t from) {
  if (k == 4) {
    const uint8_t *s0 = src, *s1 = src + m, *s2 = src + 2 * m, *s3 = src + 3 * m;
    for (size_t j = from; j < m; j++) {
      uint8_t *d = dst + 4 * j;
      d[0] = s0[j];
      d[1] = s1[j];
      d[2] = s2[j];
      d[3] = s3[j];
    }
  } else {
    const uint8_t *s0 = src, *s1 = src + m;
    for (size_t j = from; j < m; j++) {
      dst[2 * j] = s0[j];
      dst[2 * j + 1] = s1[j];
    }
  }
}

/* ---- AVX2 ---------------------------------------------------------------------------- */
#if GS_HAVE_AVX2
#define GS_AVX2 __attribute__((target("avx2")))

/* 32 elements of 4 bytes (128 bytes) per step; returns the number of elements done. */
GS_AVX2 static size_t shuffle4_avx2(const uint8_t *src, size_t m, uint8_t *dst) {
  /* in each 128-bit lane: bytes of plane 0 of its 4 elements, then plane 1, 2, 3 */
  const __m256i bytes = _mm256_setr_epi8(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15,
                                         0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  /* then qword p = plane p of the vector's 8 elements */
  const __m256i dwords = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  size_t j = 0;
  for (; j + 32 <= m; j += 32) {
    const uint8_t *s = src + 4 * j;
    __m256i v0 = _mm256_loadu_si256((const __m256i *)(s + 0));
    __m256i v1 = _mm256_loadu_si256((const __m256i *)(s + 32));
    __m256i v2 = _mm256_loadu_si256((const __m256i *)(s + 64));
    __m256i v3 = _mm256_loadu_si256((const __m256i *)(s + 96));
    v0 = _mm256_permutevar8x32_epi32(_mm256_shuffle_epi8(v0, bytes), dwords);
    v1 = _mm256_permutevar8x32_epi32(_mm256_shuffle_epi8(v1, bytes), dwords);
    v2 = _mm256_permutevar8x32_epi32(_mm256_shuffle_epi8(v2, bytes), dwords);
    v3 = _mm256_permutevar8x32_epi32(_mm256_shuffle_epi8(v3, bytes), dwords);
    /* 4x4 transpose of qwords */
    __m256i t0 = _mm256_unpacklo_epi64(v0, v1); /* v0.q0 v1.q0 v0.q2 v1.q2 */
    __m256i t1 = _mm256_unpackhi_epi64(v0, v1); /* v0.q1 v1.q1 v0.q3 v1.q3 */
    __m256i t2 = _mm256_unpacklo_epi64(v2, v3);
    __m256i t3 = _mm256_unpackhi_epi64(v2, v3);
    _mm256_storeu_si256((__m256i *)(dst + j), _mm256_permute2x128_si256(t0, t2, 0x20));
    _mm256_storeu_si256((__m256i *)(dst + m + j), _mm256_permute2x128_si256(t1, t3, 0x20));
    _mm256_storeu_si256((__m256i *)(dst + 2 * m + j), _mm256_permute2x128_si256(t0, t2, 0x31));
    _mm256_storeu_si256((__m256i *)(dst + 3 * m + j), _mm256_permute2x128_si256(t1, t3, 0x31));
  }
  return j;
}

GS_AVX2 static size_t unshuffle4_avx2(const uint8_t *src, size_t m, uint8_t *dst) {
  const __m256i bytes = _mm256_setr_epi8(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15,
                                         0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  const __m256i dwords = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
  size_t j = 0;
  for (; j + 32 <= m; j += 32) {
    __m256i p0 = _mm256_loadu_si256((const __m256i *)(src + j));
    __m256i p1 = _mm256_loadu_si256((const __m256i *)(src + m + j));
    __m256i p2 = _mm256_loadu_si256((const __m256i *)(src + 2 * m + j));
    __m256i p3 = _mm256_loadu_si256((const __m256i *)(src + 3 * m + j));
    __m256i t0 = _mm256_permute2x128_si256(p0, p2, 0x20);
    __m256i t2 = _mm256_permute2x128_si256(p0, p2, 0x31);
    __m256i t1 = _mm256_permute2x128_si256(p1, p3, 0x20);
    __m256i t3 = _mm256_permute2x128_si256(p1, p3, 0x31);
    __m256i v0 = _mm256_unpacklo_epi64(t0, t1);
    __m256i v1 = _mm256_unpackhi_epi64(t0, t1);
    __m256i v2 = _mm256_unpacklo_epi64(t2, t3);
    __m256i v3 = _mm256_unpackhi_epi64(t2, t3);
    uint8_t *d = dst + 4 * j;
    _mm256_storeu_si256((__m256i *)(d + 0), _mm256_shuffle_epi8(_mm256_permutevar8x32_epi32(v0, dwords), bytes));
    _mm256_storeu_si256((__m256i *)(d + 32), _mm256_shuffle_epi8(_mm256_permutevar8x32_epi32(v1, dwords), bytes));
    _mm256_storeu_si256((__m256i *)(d + 64), _mm256_shuffle_epi8(_mm256_permutevar8x32_epi32(v2, dwords), bytes));
    _mm256_storeu_si256((__m256i *)(d + 96), _mm256_shuffle_epi8(_mm256_permutevar8x32_epi32(v3, dwords), bytes));
  }
  return j;
}

/* 32 elements of 2 bytes (64 bytes) per step. */
GS_AVX2 static size_t shuffle2_avx2(const uint8_t *src, size_t m, uint8_t *dst) {
  const __m256i bytes = _mm256_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15,
                                         0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
  size_t j = 0;
  for (; j + 32 <= m; j += 32) {
    const uint8_t *s = src + 2 * j;
    __m256i v0 = _mm256_loadu_si256((const __m256i *)(s + 0));
    __m256i v1 = _mm256_loadu_si256((const __m256i *)(s + 32));
    /* qwords: lane0.p0 lane0.p1 lane1.p0 lane1.p1 -> p0 p0 p1 p1 */
    v0 = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(v0, bytes), 0xD8);
    v1 = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(v1, bytes), 0xD8);
    _mm256_storeu_si256((__m256i *)(dst + j), _mm256_permute2x128_si256(v0, v1, 0x20));
    _mm256_storeu_si256((__m256i *)(dst + m + j), _mm256_permute2x128_si256(v0, v1, 0x31));
  }
  return j;
}

GS_AVX2 static size_t unshuffle2_avx2(const uint8_t *src, size_t m, uint8_t *dst) {
  const __m256i bytes = _mm256_setr_epi8(0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15,
                                         0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15);
  size_t j = 0;
  for (; j + 32 <= m; j += 32) {
    __m256i p0 = _mm256_loadu_si256((const __m256i *)(src + j));
    __m256i p1 = _mm256_loadu_si256((const __m256i *)(src + m + j));
    __m256i v0 = _mm256_permute2x128_si256(p0, p1, 0x20);
    __m256i v1 = _mm256_permute2x128_si256(p0, p1, 0x31);
    v0 = _mm256_shuffle_epi8(_mm256_permute4x64_epi64(v0, 0xD8), bytes);
    v1 = _mm256_shuffle_epi8(_mm256_permute4x64_epi64(v1, 0xD8), bytes);
    _mm256_storeu_si256((__m256i *)(dst + 2 * j), v0);
    _mm256_storeu_si256((__m256i *)(dst + 2 * j + 32), v1);
  }
  return j;
}

static int have_avx2(void) {
  static int cached = -1;
  if (cached < 0) {
    __builtin_cpu_init();
    cached = __builtin_cpu_supports("avx2") ? 1 : 0;
  }
  return cached;
}
#endif

/* src and dst: n bytes each, not overlapping. k: 2 or 4. Returns 0, or -1 for a bad k. */
GS_EXPORT int gs_shuffle(const uint8_t *src, size_t n, unsigned k, uint8_t *dst, unsigned flags) {
  if (k != 2 && k != 4)
    return -1;
  size_t m = n / k, done = 0;
#if GS_HAVE_AVX2
  if (!(flags & GS_SHUF_PORTABLE) && have_avx2())
    done = k == 4 ? shuffle4_avx2(src, m, dst) : shuffle2_avx2(src, m, dst);
#else
  (void)flags;
#endif
  shuffle_portable(src, m, k, dst, done);
  memcpy(dst + m * k, src + m * k, n - m * k);
  return 0;
}

GS_EXPORT int gs_unshuffle(const uint8_t *src, size_t n, unsigned k, uint8_t *dst, unsigned flags) {
  if (k != 2 && k != 4)
    return -1;
  size_t m = n / k, done = 0;
#if GS_HAVE_AVX2
  if (!(flags & GS_SHUF_PORTABLE) && have_avx2())
    done = k == 4 ? unshuffle4_avx2(src, m, dst) : unshuffle2_avx2(src, m, dst);
#else
  (void)flags;
#endif
  unshuffle_portable(src, m, k, dst, done);
  memcpy(dst + m * k, src + m * k, n - m * k);
  return 0;
}

/* c * log2(c) for small counts, filled when the library is loaded (a log2() per histogram
 * bin per call would cost more than the counting). */
#define GS_CLOG_MAX 4096u
static double clog_tab[GS_CLOG_MAX + 1];

__attribute__((constructor)) static void clog_init(void) {
  for (unsigned c = 2; c <= GS_CLOG_MAX; c++)
    clog_tab[c] = (double)c * log2((double)c);
}

/* Order-0 entropy in milli-bits per byte of cnt samples counted in h (sub == NULL), or in
 * the four sub-histograms sub[0..3] added up; 8000 when cnt is 0.
 * H = log2(cnt) - sum(c * log2(c)) / cnt */
static uint32_t entropy_mbits(const uint32_t *h, const uint32_t (*sub)[256], size_t cnt) {
  if (cnt == 0)
    return 8000;
  double acc = 0;
  for (unsigned b = 0; b < 256; b++) {
    uint32_t c = sub ? sub[0][b] + sub[1][b] + sub[2][b] + sub[3][b] : h[b];
    if (c > 1)
      acc += c <= GS_CLOG_MAX ? clog_tab[c] : (double)c * log2((double)c);
  }
  double bits = log2((double)cnt) - acc / (double)cnt;
  long mb = (long)(bits * 1000.0);
  return (uint32_t)(mb < 0 ? 0 : mb > 8000 ? 8000 : mb);
}

/* Entropy estimate of nplanes byte planes: plane p's samples are the count bytes
 * buf[p*plane_stride + j*step], j = 0 .. count-1 (the caller keeps them inside its buffer).
 * Planes laid out one after the other (shuffled data): plane_stride = plane length; planes
 * still interleaved as k-byte elements (raw data): plane_stride = 1, step = a multiple of k.
 * out[p] = the order-0 entropy of the samples in milli-bits per byte (0 .. 8000), rounded
 * down; 8000 when count is 0. Returns 0, or -1 when step is 0. (The pure-Python reference
 * in tests/page_reference.py computes the same formula in the same order.) */
GS_EXPORT int gs_plane_bits(const uint8_t *buf, size_t plane_stride, unsigned nplanes, size_t step,
                            size_t count, uint32_t *out) {
  if (step == 0)
    return -1;
  uint32_t h[4][256];
  if (plane_stride == 1 && nplanes == 4 && step >= 4) {
    /* the planes of 4-byte elements (the codec's estimate and its sample): one pass reads
     * each sampled element once and counts its 4 bytes, one histogram per plane (the four
     * planes' counts interleave, which hides the store-to-load latency of repeated bytes) */
    memset(h, 0, sizeof h);
    for (size_t cnt = 0, i = 0; cnt < count; cnt++, i += step) {
      h[0][buf[i]]++;
      h[1][buf[i + 1]]++;
      h[2][buf[i + 2]]++;
      h[3][buf[i + 3]]++;
    }
    for (unsigned p = 0; p < 4; p++)
      out[p] = entropy_mbits(h[p], NULL, count);
    return 0;
  }
  for (unsigned p = 0; p < nplanes; p++) {
    const uint8_t *s = buf + (size_t)p * plane_stride;
    memset(h, 0, sizeof h);
    size_t cnt = 0, i = 0;
    /* four sub-histograms hide the store-to-load latency of repeated bytes */
    for (; cnt + 4 <= count; i += 4 * step, cnt += 4) {
      h[0][s[i]]++;
      h[1][s[i + step]]++;
      h[2][s[i + 2 * step]]++;
      h[3][s[i + 3 * step]]++;
    }
    for (; cnt < count; i += step, cnt++)
      h[0][s[i]]++;
    out[p] = entropy_mbits(h[0], h, cnt);
  }
  return 0;
}
