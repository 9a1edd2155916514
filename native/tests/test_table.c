/* gpusnap: host test of the locations file's native helpers (native/pages/gs_table.c):
 * gs_table_fill completes a lookup that a first table left partly unanswered, and
 * gs_run_starts splits a batch of page locations into runs of consecutive slots exactly as
 * a plain loop over the pages does (checked on random batches against that loop). */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

struct gs_table;
struct gs_table *gs_table_new(size_t hint);
void gs_table_free(struct gs_table *t);
long gs_table_add_run(struct gs_table *t, const uint8_t *ids, size_t n, int64_t base);
void gs_table_get(struct gs_table *t, const uint8_t *ids, size_t n, int64_t *out);
size_t gs_table_fill(struct gs_table *t, const uint8_t *ids, size_t n, int64_t *out);
int64_t gs_run_starts(const int64_t *locs, size_t n, int64_t cur, int64_t length, int64_t *starts);

static int failures, checks;
#define CHECK(cond)                                                                                                    \
  do {                                                                                                                 \
    checks++;                                                                                                          \
    if (!(cond)) {                                                                                                     \
      failures++;                                                                                                      \
      fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond);                                       \
    }                                                                                                                  \
  } while (0)

#define N 5000

static uint64_t rng = 88172645463325252ull;
static uint64_t next(void) {
  rng ^= rng << 13;
  rng ^= rng >> 7;
  rng ^= rng << 17;
  return rng;
}

static void make_id(uint8_t *id, uint64_t k) {
  uint64_t a = k * 0x9E3779B97F4A7C15ull, b = ~k;
  memcpy(id, &a, 8);
  memcpy(id + 8, &b, 8);
}

static void test_fill(void) {
  static uint8_t ids[N * 16];
  static int64_t out[N];
  for (size_t i = 0; i < N; i++)
    make_id(ids + i * 16, i);
  struct gs_table *first = gs_table_new(0), *second = gs_table_new(0);
  CHECK(first && second);
  /* first: ids [0, 2000) -> 1000 + i; second: ids [1500, 4000) -> 100000 + i (the overlap
   * must keep the first table's answer); ids >= 4000 are in neither */
  CHECK(gs_table_add_run(first, ids, 2000, 1000) == 2000);
  CHECK(gs_table_add_run(second, ids + 1500 * 16, 2500, 100000 + 1500) == 2500);
  gs_table_get(first, ids, N, out);
  CHECK(gs_table_fill(second, ids, N, out) == N - 4000);
  int ok = 1;
  for (size_t i = 0; i < N; i++) {
    int64_t want = i < 2000 ? 1000 + (int64_t)i : i < 4000 ? 100000 + (int64_t)i : -1;
    ok &= out[i] == want;
  }
  CHECK(ok);
  /* entries already >= 0 are never looked at, nor changed: 0 included */
  for (size_t i = 0; i < N; i++)
    out[i] = i % 2 ? 0 : -1;
  CHECK(gs_table_fill(second, ids, N, out) == N / 2 - 1250);
  ok = 1;
  for (size_t i = 0; i < N; i++)
    ok &= out[i] == (i % 2 ? 0 : (i >= 1500 && i < 4000) ? 100000 + (int64_t)i : -1);
  CHECK(ok);
  CHECK(gs_table_fill(second, ids, 0, out) == 0);
  gs_table_free(first);
  gs_table_free(second);
}

/* The rule written out page by page: the reference gs_run_starts must equal. */
static int64_t ref_starts(const int64_t *locs, size_t n, int64_t cur, int64_t length, int64_t *starts) {
  int64_t k = 0;
  for (size_t i = 0; i < n; i++) {
    if (locs[i] < 0)
      return -1 - (int64_t)i;
    int cont = (locs[i] & 0xFF) != 0 && (i ? locs[i] == locs[i - 1] + 1 : (length > 0 && locs[i] == cur + length));
    if (!cont)
      starts[k++] = (int64_t)i;
  }
  return k;
}

static void test_run_starts(void) {
  int64_t s[16];
  /* blob 3 slots 4..6, blob 3 slot 8 (a gap), blob 4 slots 0..1 (slot 0 starts a run) */
  int64_t a[] = {3 << 8 | 4, 3 << 8 | 5, 3 << 8 | 6, 3 << 8 | 8, 4 << 8, 4 << 8 | 1};
  CHECK(gs_run_starts(a, 6, -2, 0, s) == 3 && s[0] == 0 && s[1] == 3 && s[2] == 4);
  /* the pending run (blob 3 slots 1..3) goes on into the batch */
  CHECK(gs_run_starts(a, 6, 3 << 8 | 1, 3, s) == 2 && s[0] == 3 && s[1] == 4);
  /* ... but not when it ends elsewhere */
  CHECK(gs_run_starts(a, 6, 3 << 8 | 1, 2, s) == 3 && s[0] == 0);
  /* slot 255 then the next blob's slot 0: consecutive numbers, two runs */
  int64_t b[] = {7 << 8 | 254, 7 << 8 | 255, 8 << 8, 8 << 8 | 1};
  CHECK(gs_run_starts(b, 4, -2, 0, s) == 2 && s[0] == 0 && s[1] == 2);
  CHECK(gs_run_starts(b + 2, 2, 7 << 8 | 254, 2, s) == 1 && s[0] == 0);
  /* every page continues the pending run: no start */
  CHECK(gs_run_starts(b, 2, 7 << 8 | 250, 4, s) == 0);
  /* a page without a location: -1 - its index, the first one */
  int64_t c[] = {5, 6, -1, 7, -1};
  CHECK(gs_run_starts(c, 5, -2, 0, s) == -3);
  CHECK(gs_run_starts(c, 0, -2, 0, s) == 0);
  /* random batches against the page-by-page rule */
  static int64_t locs[N], s1[N], s2[N];
  int same = 1;
  for (int round = 0; round < 200; round++) {
    size_t n = 1 + next() % N;
    int64_t v = (int64_t)(next() % 1000) << 8 | (int64_t)(next() % 256);
    for (size_t i = 0; i < n; i++) {
      uint64_t x = next() % 16;
      v = x < 11 ? v + 1 : x < 15 ? (int64_t)(next() % 1000) << 8 | (int64_t)(next() % 4) : v;
      locs[i] = v;
    }
    if (round % 10 == 0)
      locs[next() % n] = -1;
    int64_t cur = round % 3 ? locs[0] - 1 - (int64_t)(next() % 3) : -2, length = round % 3 ? 1 + next() % 3 : 0;
    int64_t k1 = gs_run_starts(locs, n, cur, length, s1), k2 = ref_starts(locs, n, cur, length, s2);
    same &= k1 == k2 && (k1 <= 0 || memcmp(s1, s2, (size_t)k1 * sizeof *s1) == 0);
  }
  CHECK(same);
}

int main(void) {
  test_fill();
  test_run_starts();
  printf("%d checks, %d failures\n", checks, failures);
  return failures ? 1 : 0;
}
