/*
 * index.c - gathers every rank's entries per key, in rank order.
 *
 * Entries name their row of the job's key table, so no name is hashed or
 * compared per entry: the rows are sorted by name once, and a counting sort
 * by key then gathers the entries, which costs O(entries + rows log rows):
 * ranks are never compared pairwise.  Whatever order ranks and keys arrive
 * in, the index is the same: keys in strcmp order, each key's entries in
 * rank order.
 */
#include <stdlib.h>
#include <string.h>

#include "shardport.h"
#include "daemon/plan/internal.h"

static int order_ranks(const struct plan_input *in, struct plan_index *ix,
                       char *msg, size_t msglen) {
  uint32_t outside = PLAN_NONE;

  if (in->world == 0)
    return sp__failf(msg, msglen, SP_ERANK, "a job needs at least one rank");
  if (in->nranks != in->world)
    return sp__failf(msg, msglen, SP_ERANK,
                     "%zu ranks registered for a world of %u", in->nranks,
                     in->world);
  ix->rank = calloc(in->world, sizeof *ix->rank);
  if (ix->rank == NULL)
    return sp__failf(msg, msglen, SP_ENOMEM, "out of memory");
  /* The smallest offending number is named, whatever the input order. */
  for (size_t i = 0; i < in->nranks; i++)
    if (in->ranks[i].rank >= in->world && in->ranks[i].rank < outside)
      outside = in->ranks[i].rank;
  if (outside != PLAN_NONE)
    return sp__failf(msg, msglen, SP_ERANK,
                     "rank %u is outside the world of %u", outside, in->world);
  for (size_t i = 0; i < in->nranks; i++)
    ix->rank[in->ranks[i].rank] = &in->ranks[i];
  for (uint32_t r = 0; r < in->world; r++)
    if (ix->rank[r] == NULL)
      return sp__failf(msg, msglen, SP_ERANK,
                       "rank %u is missing: another rank registered twice", r);
  return 0;
}

/* Rows sorted by name, then by row: equal names become one key. */
struct named {
  const char *name;
  uint32_t row;
};

static int named_cmp(const void *pa, const void *pb) {
  const struct named *a = pa, *b = pb;
  int c = strcmp(a->name, b->name);
  if (c != 0)
    return c;
  return a->row < b->row ? -1 : a->row > b->row;
}

/* Counts each row's entries, checking that every entry names a row of the
 * key table and a full one a place in its rank's side table, and that every
 * row a rank uses has a name (the first such rank is named). */
static int count_rows(const struct plan_index *ix, size_t *per_row, char *msg,
                      size_t msglen) {
  const struct plan_input *in = ix->in;

  for (uint32_t r = 0; r < ix->world; r++) {
    const struct plan_rank_in *rank = ix->rank[r];
    for (size_t j = 0; j < rank->nentries; j++) {
      const struct plan_entry *e = &rank->entries[j];
      if (e->key >= in->nkeys ||
          (e->storage == PLAN_ENTRY_FULL && e->offset >= rank->nfull))
        return sp__failf(msg, msglen, SP_EINVAL,
                         "rank %u's entry %zu names no key or holding", r, j);
      per_row[e->key]++;
    }
  }
  for (size_t row = 0; row < in->nkeys; row++) {
    const char *name = in->keys[row].name;
    if (per_row[row] == 0 || (name != NULL && name[0] != '\0'))
      continue;
    for (uint32_t r = 0; r < ix->world; r++)
      for (size_t j = 0; j < ix->rank[r]->nentries; j++)
        if (ix->rank[r]->entries[j].key == row)
          return sp__failf(msg, msglen, SP_EINVAL,
                           "rank %u registers a key without a name", r);
  }
  return 0;
}

/* Sorts the rows a rank uses by name: ix->name, ix->key_of, and each
 * key's entry count in ix->first[k + 1]. */
static int name_keys(struct plan_index *ix, const size_t *per_row, char *msg,
                     size_t msglen) {
  const struct plan_input *in = ix->in;
  size_t n = in->nkeys > 0 ? in->nkeys : 1, nused = 0;
  struct named *sorted = malloc(n * sizeof *sorted);

  ix->key_of = malloc(n * sizeof *ix->key_of);
  ix->name = malloc(n * sizeof *ix->name);
  ix->first = calloc(n + 1, sizeof *ix->first);
  if (sorted == NULL || ix->key_of == NULL || ix->name == NULL ||
      ix->first == NULL) {
    free(sorted);
    return sp__failf(msg, msglen, SP_ENOMEM, "out of memory");
  }
  /* A row no rank uses (a hand-made table) is no key. */
  for (uint32_t row = 0; row < in->nkeys; row++) {
    ix->key_of[row] = PLAN_NONE;
    if (per_row[row] > 0)
      sorted[nused++] = (struct named){in->keys[row].name, row};
  }
  qsort(sorted, nused, sizeof *sorted, named_cmp);
  for (size_t i = 0; i < nused; i++) {
    if (i == 0 || strcmp(sorted[i - 1].name, sorted[i].name) != 0)
      ix->name[ix->nkeys++] = sorted[i].name;
    ix->key_of[sorted[i].row] = (uint32_t)(ix->nkeys - 1);
    ix->first[ix->nkeys] += per_row[sorted[i].row];
  }
  free(sorted);
  return 0;
}

/* Whether every rank lists every key once, in rank 0's order: then
 * ix->pos is that order and nothing needs gathering.  Any other input
 * (experts, a rank that lacks a key, a key listed twice, another order) is
 * gathered, and refused there where it must be. */
static int align(struct plan_index *ix, char *msg, size_t msglen) {
  const struct plan_rank_in *r0 = ix->rank[0];
  uint32_t *pos;

  if (r0->nentries != ix->nkeys)
    return 0;
  for (uint32_t r = 1; r < ix->world; r++)
    if (ix->rank[r]->nentries != r0->nentries)
      return 0;
  pos = malloc((ix->nkeys > 0 ? ix->nkeys : 1) * sizeof *pos);
  if (pos == NULL)
    return sp__failf(msg, msglen, SP_ENOMEM, "out of memory");
  for (size_t k = 0; k < ix->nkeys; k++)
    pos[k] = PLAN_NONE;
  for (size_t j = 0; j < r0->nentries; j++) {
    uint32_t k = ix->key_of[r0->entries[j].key];
    if (pos[k] != PLAN_NONE) {
      free(pos);
      return 0;
    }
    pos[k] = (uint32_t)j;
  }
  for (uint32_t r = 1; r < ix->world; r++) {
    const struct plan_entry *e = ix->rank[r]->entries;
    for (size_t j = 0; j < r0->nentries; j++)
      if (ix->key_of[e[j].key] != ix->key_of[r0->entries[j].key]) {
        free(pos);
        return 0;
      }
  }
  ix->pos = pos;
  return 0;
}

/* Counting sort by key, ranks taken in order: each key's entries end up
 * in rank order.  A key a rank lists twice is refused, the smallest name
 * first, so the refusal does not depend on the order the rank listed its
 * keys in. */
static int gather(struct plan_index *ix, char *msg, size_t msglen) {
  size_t total;
  uint32_t *last_rank =
      malloc((ix->nkeys > 0 ? ix->nkeys : 1) * sizeof *last_rank);
  size_t *cursor = malloc((ix->nkeys > 0 ? ix->nkeys : 1) * sizeof *cursor);
  int rc = 0;

  total = ix->first[ix->nkeys];
  ix->entry = malloc((total > 0 ? total : 1) * sizeof *ix->entry);
  ix->entry_rank = malloc((total > 0 ? total : 1) * sizeof *ix->entry_rank);
  if (last_rank == NULL || cursor == NULL || ix->entry == NULL ||
      ix->entry_rank == NULL) {
    rc = sp__failf(msg, msglen, SP_ENOMEM, "out of memory");
    goto out;
  }
  for (size_t k = 0; k < ix->nkeys; k++) {
    last_rank[k] = PLAN_NONE;
    cursor[k] = ix->first[k];
  }
  for (uint32_t r = 0; r < ix->world; r++) {
    const struct plan_rank_in *rank = ix->rank[r];
    uint32_t dup = PLAN_NONE;
    for (size_t j = 0; j < rank->nentries; j++) {
      uint32_t k = ix->key_of[rank->entries[j].key];
      size_t slot;
      if (last_rank[k] == r) {
        if (dup == PLAN_NONE || k < dup)
          dup = k;
        continue;
      }
      last_rank[k] = r;
      slot = cursor[k]++;
      ix->entry[slot] = &rank->entries[j];
      ix->entry_rank[slot] = r;
    }
    if (dup != PLAN_NONE) {
      rc = sp__failf(msg, msglen, SP_EDUPKEY,
                     "key '%s' is registered twice by rank %u", ix->name[dup],
                     r);
      goto out;
    }
  }
out:
  free(last_rank);
  free(cursor);
  return rc;
}

int plan_index_build(const struct plan_input *in, struct plan_index *ix,
                     char *msg, size_t msglen) {
  int rc;

  memset(ix, 0, sizeof *ix);
  ix->world = in->world;
  ix->in = in;
  ix->stop = in->stop;
  rc = order_ranks(in, ix, msg, msglen);
  if (rc == 0) {
    size_t *per_row = calloc(in->nkeys > 0 ? in->nkeys : 1, sizeof *per_row);
    rc = per_row == NULL ? sp__failf(msg, msglen, SP_ENOMEM, "out of memory")
                         : count_rows(ix, per_row, msg, msglen);
    if (rc == 0)
      rc = name_keys(ix, per_row, msg, msglen);
    free(per_row);
  }
  for (size_t k = 0; rc == 0 && k < ix->nkeys; k++)
    ix->first[k + 1] += ix->first[k];
  if (rc == 0)
    rc = align(ix, msg, msglen);
  if (rc == 0 && ix->pos == NULL)
    rc = gather(ix, msg, msglen);
  if (rc != 0)
    plan_index_free(ix);
  return rc;
}

void plan_index_free(struct plan_index *ix) {
  free(ix->rank);
  free(ix->name);
  free(ix->key_of);
  free(ix->first);
  free(ix->pos);
  free(ix->entry);
  free(ix->entry_rank);
  memset(ix, 0, sizeof *ix);
}

uint32_t plan_index_find(const struct plan_index *ix, const char *name) {
  size_t lo = 0, hi = ix->nkeys;

  while (lo < hi) {
    size_t mid = lo + (hi - lo) / 2;
    int c = strcmp(ix->name[mid], name);
    if (c == 0)
      return (uint32_t)mid;
    if (c < 0)
      lo = mid + 1;
    else
      hi = mid;
  }
  return PLAN_NONE;
}
