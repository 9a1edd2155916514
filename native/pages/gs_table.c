/* gpusnap page table: page id (16 bytes) -> int64 location, for gpusnap/repo/pipeline/pagetable.py.
 *
 * A dump must know every page id already in the repository. As a Python dict that costs
 * about 110 bytes and 0.7 us per page to build (a 20 M-page repository: over 2 GB and
 * 15 s before the dump starts). Here a page is one 24-byte slot of an open-addressing
 * table (linear probing, at most 3/4 full), filled a blob at a time. Page ids are
 * BLAKE3 output, so their first 8 bytes are already a uniform hash.
 *
 * Every call takes the table's mutex: ctypes releases the GIL, and the pages images of one
 * dump claim their new pages from several threads at once.
 */
#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "gs_internal.h"
#define GS_ID 16u
#define GS_EMPTY INT64_MIN /* value of a free slot; stored values are never INT64_MIN */
#define GS_MIN_CAP 1024u

struct gs_slot {
  uint64_t k0, k1;
  int64_t v;
};

struct gs_table {
  struct gs_slot *slots;
  size_t cap; /* a power of two */
  size_t n;
  pthread_mutex_t mu;
};

static void key_of(const uint8_t *id, uint64_t *k0, uint64_t *k1) {
  memcpy(k0, id, 8);
  memcpy(k1, id + 8, 8);
}

static struct gs_slot *alloc_slots(size_t cap) {
  struct gs_slot *s = malloc(cap * sizeof *s);
  if (!s)
    return NULL;
  for (size_t i = 0; i < cap; i++)
    s[i].v = GS_EMPTY;
  return s;
}

/* The slot holding (k0, k1), or the free slot where it belongs. */
static struct gs_slot *find(struct gs_slot *slots, size_t cap, uint64_t k0, uint64_t k1) {
  size_t mask = cap - 1;
  for (size_t i = (size_t)k0 & mask;; i = (i + 1) & mask) {
    struct gs_slot *s = &slots[i];
    if (s->v == GS_EMPTY || (s->k0 == k0 && s->k1 == k1))
      return s;
  }
}

/* Make room for `more` insertions without passing 3/4 full. 0 or -1 (out of memory). */
static int reserve(struct gs_table *t, size_t more) {
  size_t cap = t->cap;
  if (more > SIZE_MAX / 8 - t->n)
    return -1;
  while ((t->n + more) * 4 > cap * 3)
    cap *= 2;
  if (cap == t->cap)
    return 0;
  struct gs_slot *ns = alloc_slots(cap);
  if (!ns)
    return -1;
  for (size_t i = 0; i < t->cap; i++) {
    struct gs_slot *o = &t->slots[i];
    if (o->v != GS_EMPTY)
      *find(ns, cap, o->k0, o->k1) = *o;
  }
  free(t->slots);
  t->slots = ns;
  t->cap = cap;
  return 0;
}

/* Insert if absent (the first location of an id wins). 1 inserted, 0 present. */
static int put(struct gs_table *t, const uint8_t *id, int64_t v) {
  uint64_t k0, k1;
  key_of(id, &k0, &k1);
  struct gs_slot *s = find(t->slots, t->cap, k0, k1);
  if (s->v != GS_EMPTY)
    return 0;
  s->k0 = k0;
  s->k1 = k1;
  s->v = v;
  t->n++;
  return 1;
}

static int64_t get(const struct gs_table *t, const uint8_t *id) {
  uint64_t k0, k1;
  key_of(id, &k0, &k1);
  int64_t v = find(t->slots, t->cap, k0, k1)->v;
  return v == GS_EMPTY ? -1 : v;
}

GS_EXPORT struct gs_table *gs_table_new(size_t hint) {
  struct gs_table *t = calloc(1, sizeof *t);
  if (!t)
    return NULL;
  t->cap = GS_MIN_CAP;
  while (t->cap < hint / 3 * 4 + 1 && t->cap < ((size_t)1 << 40))
    t->cap *= 2;
  t->slots = alloc_slots(t->cap);
  if (!t->slots || pthread_mutex_init(&t->mu, NULL) != 0) {
    free(t->slots);
    free(t);
    return NULL;
  }
  return t;
}

GS_EXPORT void gs_table_free(struct gs_table *t) {
  if (!t)
    return;
  pthread_mutex_destroy(&t->mu);
  free(t->slots);
  free(t);
}

GS_EXPORT size_t gs_table_len(struct gs_table *t) {
  pthread_mutex_lock(&t->mu);
  size_t n = t->n;
  pthread_mutex_unlock(&t->mu);
  return n;
}

GS_EXPORT size_t gs_table_bytes(struct gs_table *t) {
  pthread_mutex_lock(&t->mu);
  size_t b = t->cap * sizeof(struct gs_slot) + sizeof *t;
  pthread_mutex_unlock(&t->mu);
  return b;
}

/* ids[i] -> base + i for i < n, each only if absent. Returns how many were new, or -1
 * when out of memory (the table is unchanged then). */
GS_EXPORT long gs_table_add_run(struct gs_table *t, const uint8_t *ids, size_t n, int64_t base) {
  long added = -1;
  pthread_mutex_lock(&t->mu);
  if (n > (size_t)INT64_MAX || base < 0 || base > INT64_MAX - (int64_t)n || reserve(t, n) != 0)
    goto out;
  added = 0;
  for (size_t i = 0; i < n; i++)
    added += put(t, ids + i * GS_ID, base + (int64_t)i);
out:
  pthread_mutex_unlock(&t->mu);
  return added;
}

/* Many runs at once (an index file's blobs): run r is counts[r] ids from `ids` onwards
 * (runs follow each other), id j of run r -> bases[r] + j. As gs_table_add_run otherwise. */
GS_EXPORT long gs_table_add_runs(struct gs_table *t, const uint8_t *ids, size_t nruns, const int64_t *bases,
                                 const uint32_t *counts) {
  long added = -1;
  size_t total = 0;
  pthread_mutex_lock(&t->mu);
  for (size_t r = 0; r < nruns; r++) {
    if (bases[r] < 0 || bases[r] > INT64_MAX - (int64_t)counts[r])
      goto out;
    total += counts[r];
  }
  if (reserve(t, total) != 0)
    goto out;
  added = 0;
  for (size_t r = 0; r < nruns; r++) {
    for (uint32_t j = 0; j < counts[r]; j++)
      added += put(t, ids + j * GS_ID, bases[r] + (int64_t)j);
    ids += (size_t)counts[r] * GS_ID;
  }
out:
  pthread_mutex_unlock(&t->mu);
  return added;
}

/* out[i] = location of ids[i], or -1 when absent. */
GS_EXPORT void gs_table_get(struct gs_table *t, const uint8_t *ids, size_t n, int64_t *out) {
  pthread_mutex_lock(&t->mu);
  for (size_t i = 0; i < n; i++)
    out[i] = get(t, ids + i * GS_ID);
  pthread_mutex_unlock(&t->mu);
}

/* The dump's dedup decision for one batch of npages pages: page i with kinds[i] != 0 is
 * new when its id is neither in `known` (the repository, read only here) nor in `claimed`
 * (pages this dump already stores); a new page is put into `claimed` (value `mark`) and
 * its index written to new_idx. Returns the number of new pages, or -1 when out of memory
 * (`claimed` unchanged). Locks `claimed`, then `known` (always in that order). */
GS_EXPORT long gs_table_claim(struct gs_table *known, struct gs_table *claimed, const uint8_t *kinds,
                              const uint8_t *ids, size_t npages, int64_t mark, uint32_t *new_idx) {
  long nnew = -1;
  if (known == claimed)
    return -1;
  pthread_mutex_lock(&claimed->mu);
  if (known)
    pthread_mutex_lock(&known->mu);
  if (npages > UINT32_MAX || mark < 0 || reserve(claimed, npages) != 0)
    goto out;
  nnew = 0;
  for (size_t i = 0; i < npages; i++) {
    const uint8_t *id = ids + i * GS_ID;
    if (!kinds[i] || (known && get(known, id) >= 0))
      continue;
    if (put(claimed, id, mark))
      new_idx[nnew++] = (uint32_t)i;
  }
out:
  if (known)
    pthread_mutex_unlock(&known->mu);
  pthread_mutex_unlock(&claimed->mu);
  return nnew;
}

/* For each i with out[i] < 0: out[i] = location of ids[i], or left as it is when absent (a
 * second table fills in what the first did not have; Python never visits a page). Returns
 * how many out[i] are still < 0. */
GS_EXPORT size_t gs_table_fill(struct gs_table *t, const uint8_t *ids, size_t n, int64_t *out) {
  size_t left = 0;
  pthread_mutex_lock(&t->mu);
  for (size_t i = 0; i < n; i++) {
    if (out[i] >= 0)
      continue;
    int64_t v = get(t, ids + i * GS_ID);
    if (v >= 0)
      out[i] = v;
    else
      left++;
  }
  pthread_mutex_unlock(&t->mu);
  return left;
}

/* Where runs start in a batch of page locations (blob_no << 8 | slot, in page-list order), for
 * the locations file (gpusnap/repo/locations.py build): a run goes on while the next page is
 * the next slot of the same blob, i.e. its location is the previous one + 1 and its slot is not
 * 0. `cur`, `length`: the run pending before locs[0] (length 0: none), which locs[0] may
 * continue. Writes the indices i where a new run starts to starts[] (at most n) and returns
 * how many; or -1 - i when locs[i] < 0 (the first page without a location), starts unused. */
GS_EXPORT int64_t gs_run_starts(const int64_t *locs, size_t n, int64_t cur, int64_t length, int64_t *starts) {
  for (size_t i = 0; i < n; i++)
    if (locs[i] < 0)
      return -1 - (int64_t)i;
  int64_t k = 0;
  int64_t prev = length > 0 && cur >= 0 && cur <= INT64_MAX - length ? cur + length - 1 : -2;
  for (size_t i = 0; i < n; i++) {
    int64_t v = locs[i];
    if (v != prev + 1 || (v & 0xFF) == 0)
      starts[k++] = (int64_t)i;
    prev = v;
  }
  return k;
}
