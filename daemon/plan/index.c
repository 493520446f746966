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

/* Every entry names a row of the key table, and a full entry a place in
 * its rank's side table; every row a rank uses has a name. */
static int check_entries(const struct plan_index *ix, char *msg,
                         size_t msglen) {
  const struct plan_input *in = ix->in;

  for (uint32_t r = 0; r < ix->world; r++) {
    const struct plan_rank_in *rank = ix->rank[r];
    for (size_t j = 0; j < rank->nentries; j++) {
      const struct plan_entry *e = &rank->entries[j];
      const char *name;
      if (e->key >= in->nkeys ||
          (e->storage == PLAN_ENTRY_FULL && e->offset >= rank->nfull))
        return sp__failf(msg, msglen, SP_EINVAL,
                         "rank %u's entry %zu names no key or holding", r, j);
      name = in->keys[e->key].name;
      if (name == NULL || name[0] == '\0')
        return sp__failf(msg, msglen, SP_EINVAL,
                         "rank %u registers a key without a name", r);
    }
  }
  return 0;
}

/* Sorts the rows a rank uses by name; ix->name and ix->key_of. */
static int name_keys(struct plan_index *ix, char *msg, size_t msglen) {
  const struct plan_input *in = ix->in;
  size_t n = in->nkeys > 0 ? in->nkeys : 1, nused = 0;
  struct named *sorted = malloc(n * sizeof *sorted);
  uint8_t *used = calloc(n, 1);
  int rc = 0;

  ix->key_of = malloc(n * sizeof *ix->key_of);
  ix->name = malloc(n * sizeof *ix->name);
  if (sorted == NULL || used == NULL || ix->key_of == NULL ||
      ix->name == NULL) {
    rc = sp__failf(msg, msglen, SP_ENOMEM, "out of memory");
    goto out;
  }
  /* A row no rank uses (a hand-made table) is no key. */
  for (uint32_t r = 0; r < ix->world; r++)
    for (size_t j = 0; j < ix->rank[r]->nentries; j++)
      used[ix->rank[r]->entries[j].key] = 1;
  for (uint32_t row = 0; row < in->nkeys; row++) {
    ix->key_of[row] = PLAN_NONE;
    if (used[row])
      sorted[nused++] = (struct named){in->keys[row].name, row};
  }
  qsort(sorted, nused, sizeof *sorted, named_cmp);
  for (size_t i = 0; i < nused; i++) {
    if (i == 0 || strcmp(sorted[i - 1].name, sorted[i].name) != 0)
      ix->name[ix->nkeys++] = sorted[i].name;
    ix->key_of[sorted[i].row] = (uint32_t)(ix->nkeys - 1);
  }
out:
  free(sorted);
  free(used);
  return rc;
}

/* Counting sort by key, ranks taken in order: each key's entries end up
 * in rank order.  A key a rank lists twice is refused, the smallest name
 * first, so the refusal does not depend on the order the rank listed its
 * keys in. */
static int gather(struct plan_index *ix, char *msg, size_t msglen) {
  size_t total = 0;
  uint32_t *last_rank = malloc((ix->nkeys > 0 ? ix->nkeys : 1) *
                               sizeof *last_rank);
  int rc = 0;

  for (uint32_t r = 0; r < ix->world; r++)
    if (__builtin_add_overflow(total, ix->rank[r]->nentries, &total))
      return sp__failf(msg, msglen, SP_EOVERFLOW, "too many keys");
  ix->first = calloc(ix->nkeys + 1, sizeof *ix->first);
  ix->entry = malloc((total > 0 ? total : 1) * sizeof *ix->entry);
  ix->entry_rank = malloc((total > 0 ? total : 1) * sizeof *ix->entry_rank);
  if (last_rank == NULL || ix->first == NULL || ix->entry == NULL ||
      ix->entry_rank == NULL) {
    rc = sp__failf(msg, msglen, SP_ENOMEM, "out of memory");
    goto out;
  }
  for (size_t k = 0; k < ix->nkeys; k++)
    last_rank[k] = PLAN_NONE;
  for (uint32_t r = 0; r < ix->world; r++) {
    const struct plan_rank_in *rank = ix->rank[r];
    uint32_t dup = PLAN_NONE;
    for (size_t j = 0; j < rank->nentries; j++) {
      uint32_t k = ix->key_of[rank->entries[j].key];
      if (last_rank[k] == r && (dup == PLAN_NONE || k < dup))
        dup = k;
      last_rank[k] = r;
      ix->first[k + 1]++;
    }
    if (dup != PLAN_NONE) {
      rc = sp__failf(msg, msglen, SP_EDUPKEY,
                     "key '%s' is registered twice by rank %u", ix->name[dup],
                     r);
      goto out;
    }
  }
  for (size_t k = 0; k < ix->nkeys; k++)
    ix->first[k + 1] += ix->first[k];
  /* first[k] serves as the fill cursor and is restored. */
  for (uint32_t r = 0; r < ix->world; r++) {
    const struct plan_rank_in *rank = ix->rank[r];
    for (size_t j = 0; j < rank->nentries; j++) {
      size_t slot = ix->first[ix->key_of[rank->entries[j].key]]++;
      ix->entry[slot] = &rank->entries[j];
      ix->entry_rank[slot] = r;
    }
  }
  for (size_t k = ix->nkeys; k > 0; k--)
    ix->first[k] = ix->first[k - 1];
  ix->first[0] = 0;
out:
  free(last_rank);
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
  if (rc == 0)
    rc = check_entries(ix, msg, msglen);
  if (rc == 0)
    rc = name_keys(ix, msg, msglen);
  if (rc == 0)
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
