/* gpusnap: host test of gs_decode_job (native/pages/gs_decode.c): a pack file written here
 * with one blob per codec decodes to the original pages, whole and in part; then every
 * single-byte change of the file, one at a time, is either refused with a code or still
 * gives pages that pass their checksums -- never a crash, never a write outside the job's
 * buffer (checked with guard bytes around it). The same for gs_decode_payload (one payload
 * in memory, as data blobs are decoded), and a 4 MiB shuffled payload, larger than the
 * per-thread scratch. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <lz4.h>
#include <zstd.h>

#define PAGE 4096u
#define NP 16u /* pages per blob */
#define RAW (NP * PAGE)
#define FIELDS 11
#define GUARD 64

int gs_decode_job(const int64_t *pieces, size_t npieces, uint8_t *buf, size_t buf_len, size_t npages,
                  const uint8_t *ids, const uint8_t *kinds, int64_t token, int64_t *err, char *msg, size_t msg_len);
size_t gs_scan(const uint8_t *buf, size_t npages, uint8_t *kinds, uint8_t *ids);
int gs_shuffle(const uint8_t *src, size_t n, unsigned k, uint8_t *dst, unsigned flags);
int gs_decode_payload(unsigned codec, const uint8_t *p, size_t n, uint8_t *dst, size_t raw_len, char *msg,
                      size_t msg_len);

static int failures, checks;
#define CHECK(cond)                                                                                                    \
  do {                                                                                                                 \
    checks++;                                                                                                          \
    if (!(cond)) {                                                                                                     \
      failures++;                                                                                                      \
      fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond);                                       \
    }                                                                                                                  \
  } while (0)

struct blob {
  int64_t off;
  unsigned codec;
  uint32_t stored;
};

static uint8_t pages[RAW];
static uint8_t ids[NP * 16], kinds[NP];

static void put_header(uint8_t *h, unsigned codec, uint32_t stored) {
  uint32_t raw = RAW;
  h[0] = 'G', h[1] = 'B', h[2] = 1, h[3] = (uint8_t)codec, h[4] = NP, h[5] = 0, h[6] = 0, h[7] = 0;
  memcpy(h + 8, &raw, 4);
  memcpy(h + 12, &stored, 4);
}

/* payload of codec c of `pages` into out; -> its length */
static uint32_t encode(unsigned c, uint8_t *out) {
  if (c == 0) {
    memcpy(out, pages, RAW);
    return RAW;
  }
  if (c == 1)
    return (uint32_t)LZ4_compress_default((const char *)pages, (char *)out, RAW, (int)RAW);
  if (c == 2)
    return (uint32_t)ZSTD_compress(out, RAW, pages, RAW, 3);
  /* shuffle4-zstd: plane lengths, then each plane as a zstd frame */
  static uint8_t sh[RAW];
  gs_shuffle(pages, RAW, 4, sh, 0);
  uint32_t m = RAW / 4, pos = 16;
  for (unsigned i = 0; i < 4; i++) {
    size_t z = ZSTD_compress(out + pos, RAW - pos, sh + i * m, m, 1);
    uint32_t ln = (uint32_t)z;
    if (ZSTD_isError(z) || z >= m) {
      memcpy(out + pos, sh + i * m, m);
      ln = m;
    }
    memcpy(out + 4 * i, &ln, 4);
    pos += ln;
  }
  return pos;
}

static int decode(int fd, const struct blob *b, unsigned slot, unsigned count, uint8_t *buf, size_t npages_check,
                  int64_t *err) {
  int64_t p[FIELDS] = {fd, 0, b->off, 1, b->codec, NP, RAW, b->stored, slot, count, 0};
  char msg[256];
  return gs_decode_job(p, 1, buf, count * PAGE, npages_check, ids + slot * 16, kinds + slot, 0, err, msg, sizeof msg);
}

int main(void) {
  /* fp32-like pages: small floats (compress under every codec) */
  uint32_t x = 12345;
  for (size_t i = 0; i < RAW / 4; i++) {
    x = x * 1103515245u + 12345u;
    float f = (float)((int)(x >> 16) - 32768) / 65536.0f;
    memcpy(pages + 4 * i, &f, 4);
  }
  gs_scan(pages, NP, kinds, ids);

  char path[] = "/tmp/gs-decode-test-XXXXXX";
  int fd = mkstemp(path);
  CHECK(fd >= 0);
  unlink(path);
  static uint8_t file[16 + 4 * (16 + RAW + 64)];
  size_t len = 16;
  struct blob blobs[4];
  for (unsigned c = 0; c < 4; c++) {
    uint32_t n = encode(c, file + len + 16);
    CHECK(n > 0 && (c == 0 || n < RAW));
    put_header(file + len, c, n);
    blobs[c] = (struct blob){(int64_t)len, c, n};
    len += 16 + n;
  }
  CHECK(pwrite(fd, file, len, 0) == (ssize_t)len);

  static uint8_t area[GUARD + RAW + GUARD];
  uint8_t *buf = area + GUARD;
  int64_t err[2];
  for (unsigned c = 0; c < 4; c++) {
    memset(buf, 0, RAW);
    CHECK(decode(fd, &blobs[c], 0, NP, buf, NP, err) == 0);
    CHECK(memcmp(buf, pages, RAW) == 0);
    memset(buf, 0, RAW);
    CHECK(decode(fd, &blobs[c], 5, 3, buf, 3, err) == 0);
    CHECK(memcmp(buf, pages + 5 * PAGE, 3 * PAGE) == 0);
  }

  /* every byte of every blob changed, one at a time */
  size_t refused = 0, passed = 0;
  for (unsigned c = 0; c < 4; c++) {
    const struct blob *b = &blobs[c];
    for (size_t o = 0; o < 16 + b->stored; o += (c == 0 ? 97 : 1)) {
      uint8_t old = file[b->off + o], new = old ^ (uint8_t)(0x5A + o);
      if (new == old)
        new ^= 1;
      CHECK(pwrite(fd, &new, 1, b->off + (int64_t)o) == 1);
      memset(area, 0xEE, sizeof area);
      unsigned slot = o % 3 ? 0 : 2, count = o % 3 ? NP : 9;
      int rc = decode(fd, b, slot, count, buf, count, err);
      CHECK(rc == 0 || rc == -2 || rc == -3 || rc == -6);
      if (rc == 0) {
        passed++;
        CHECK(memcmp(buf, pages + slot * PAGE, count * PAGE) == 0);
      } else {
        refused++;
      }
      for (unsigned g = 0; g < GUARD; g++)
        CHECK(area[g] == 0xEE && area[GUARD + count * PAGE + g] == 0xEE);
      CHECK(pwrite(fd, &old, 1, b->off + (int64_t)o) == 1);
    }
  }
  CHECK(refused > passed);

  /* gs_decode_payload: each compressed payload, whole, then with every byte changed */
  char msg[256];
  size_t prefused = 0;
  for (unsigned c = 1; c < 4; c++) {
    const struct blob *b = &blobs[c];
    uint8_t *payload = file + b->off + 16;
    memset(area, 0xEE, sizeof area);
    CHECK(gs_decode_payload(c, payload, b->stored, buf, RAW, msg, sizeof msg) == 0);
    CHECK(memcmp(buf, pages, RAW) == 0);
    for (size_t o = 0; o < b->stored; o++) {
      uint8_t old = payload[o];
      payload[o] ^= (uint8_t)(0x5A + o) | 1;
      memset(area, 0xEE, sizeof area);
      int rc = gs_decode_payload(c, payload, b->stored, buf, RAW, msg, sizeof msg);
      CHECK(rc == 0 || ((rc == -6 || rc == -2) && msg[0]));
      prefused += rc != 0;
      for (unsigned g = 0; g < GUARD; g++)
        CHECK(area[g] == 0xEE && area[GUARD + RAW + g] == 0xEE);
      payload[o] = old;
    }
  }
  CHECK(prefused > 0);
  /* lengths outside the format: refused before anything is decoded */
  CHECK(gs_decode_payload(1, file, 64, buf, 64, msg, sizeof msg) == -2);                  /* not smaller */
  CHECK(gs_decode_payload(9, file, 16, buf, 64, msg, sizeof msg) == -2);                  /* no such codec */
  CHECK(gs_decode_payload(2, file, 16, buf, (4u << 20) + 1, msg, sizeof msg) == -2);      /* > MAX_BLOB_RAW */
  /* a 4 MiB shuffle4 data blob: its planes do not fit the thread's 1 MiB scratch */
  {
    size_t big = 4u << 20, m = big / 4, pos = 16;
    uint8_t *raw = malloc(big), *sh = malloc(big), *enc = malloc(big), *out = malloc(big);
    CHECK(raw && sh && enc && out);
    if (raw && sh && enc && out) {
      for (size_t i = 0; i < big; i += RAW)
        memcpy(raw + i, pages, RAW);
      gs_shuffle(raw, big, 4, sh, 0);
      for (unsigned i = 0; i < 4; i++) {
        size_t z = ZSTD_compress(enc + pos, big - pos, sh + i * m, m, 1);
        uint32_t ln = (uint32_t)z;
        if (ZSTD_isError(z) || z >= m) {
          memcpy(enc + pos, sh + i * m, m);
          ln = (uint32_t)m;
        }
        memcpy(enc + 4 * i, &ln, 4);
        pos += ln;
      }
      CHECK(pos < big);
      CHECK(gs_decode_payload(3, enc, pos, out, big, msg, sizeof msg) == 0);
      CHECK(memcmp(out, raw, big) == 0);
    }
    free(raw);
    free(sh);
    free(enc);
    free(out);
  }

  /* a pack cut short */
  CHECK(ftruncate(fd, blobs[2].off + 100) == 0);
  CHECK(decode(fd, &blobs[2], 0, NP, buf, NP, err) == -2);
  close(fd);
  /* a read error: a closed fd */
  CHECK(decode(fd, &blobs[0], 0, NP, buf, NP, err) == -1 && err[1] > 0);

  printf("gs_decode: %d checks, %d failures (%zu changes refused, %zu unfelt; payloads: %zu refused)\n", checks,
         failures, refused, passed, prefused);
  return failures != 0;
}
