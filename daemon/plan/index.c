/*
 * index.c - gathers every rank's keys per key, in rank order.
 *
 * Each name is hashed once per rank that lists it, and the distinct names
 * are sorted once, so indexing costs O(entries + keys log keys): ranks are
 * never compared pairwise.  Whatever order ranks and keys arrive in, the
 * index is the same: keys in strcmp order, each key's entries in rank order.
 */
#include <stdlib.h>
#include <string.h>

#include "shardport.h"
#include "daemon/plan/internal.h"

/* FNV-1a: the table's only job is speed, and names come from the job's own
 * trainers, so no keyed hash is needed. */
static uint64_t name_hash(const char *s) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (; *s != '\0'; s++) {
    h ^= (uint8_t)*s;
    h *= 0x100000001b3ull;
  }
  return h;
}

/* The table holds (hash >> 32) << 32 | (id + 1); zero marks a free slot. */
static uint64_t slot_make(uint64_t hash, uint32_t id) {
  return (hash & 0xffffffff00000000ull) | ((uint64_t)id + 1);
}

static uint32_t slot_id(uint64_t slot) {
  return (uint32_t)(slot & 0xffffffffu) - 1;
}

struct builder {
  struct plan_index *ix;
  const char **names;  /* by id */
  uint32_t *last_rank; /* by id: the last rank that listed it, to find a key
                          a rank lists twice */
  size_t nids;
  size_t cap;
};

static int table_grow(struct plan_index *ix, const struct builder *b) {
  size_t cap = (ix->table_mask + 1) * 2;
  uint64_t *table = calloc(cap, sizeof *table);

  if (table == NULL)
    return SP_ENOMEM;
  for (size_t id = 0; id < b->nids; id++) {
    uint64_t h = name_hash(b->names[id]);
    size_t i = (size_t)h & (cap - 1);
    while (table[i] != 0)
      i = (i + 1) & (cap - 1);
    table[i] = slot_make(h, (uint32_t)id);
  }
  free(ix->table);
  ix->table = table;
  ix->table_mask = cap - 1;
  return 0;
}

/* The id of name, added when new; PLAN_NONE when out of memory. */
static uint32_t builder_intern(struct builder *b, const char *name) {
  struct plan_index *ix = b->ix;
  uint64_t h = name_hash(name);
  size_t i = (size_t)h & ix->table_mask;

  for (; ix->table[i] != 0; i = (i + 1) & ix->table_mask) {
    uint64_t slot = ix->table[i];
    if ((slot >> 32) == (h >> 32) && strcmp(b->names[slot_id(slot)], name) == 0)
      return slot_id(slot);
  }
  if (b->nids == b->cap) {
    size_t cap = b->cap * 2;
    const char **names = realloc(b->names, cap * sizeof *names);
    uint32_t *last;
    if (names == NULL)
      return PLAN_NONE;
    b->names = names;
    last = realloc(b->last_rank, cap * sizeof *last);
    if (last == NULL)
      return PLAN_NONE;
    b->last_rank = last;
    b->cap = cap;
  }
  if (b->nids >= PLAN_NONE - 1)
    return PLAN_NONE;
  b->names[b->nids] = name;
  b->last_rank[b->nids] = PLAN_NONE;
  ix->table[i] = slot_make(h, (uint32_t)b->nids);
  b->nids++;
  /* Half full at most, so probes stay short. */
  if (b->nids * 2 > ix->table_mask + 1 && table_grow(ix, b) != 0)
    return PLAN_NONE;
  return (uint32_t)(b->nids - 1);
}

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

struct named {
  const char *name;
  uint32_t id;
};

static int named_cmp(const void *pa, const void *pb) {
  return strcmp(((const struct named *)pa)->name,
                ((const struct named *)pb)->name);
}

/* Interns every rank's names in rank order; *entry_key receives the id of
 * each entry, ranks after one another. */
static int intern_all(struct builder *b, uint32_t **entry_key, char *msg,
                      size_t msglen) {
  struct plan_index *ix = b->ix;
  size_t total = 0, at = 0;

  for (uint32_t r = 0; r < ix->world; r++)
    if (__builtin_add_overflow(total, ix->rank[r]->nkeys, &total))
      return sp__failf(msg, msglen, SP_EOVERFLOW, "too many keys");
  *entry_key = malloc((total > 0 ? total : 1) * sizeof **entry_key);
  if (*entry_key == NULL)
    return sp__failf(msg, msglen, SP_ENOMEM, "out of memory");
  for (uint32_t r = 0; r < ix->world; r++) {
    const struct plan_rank_in *rank = ix->rank[r];
    const char *dup = NULL;
    for (size_t j = 0; j < rank->nkeys; j++) {
      const char *name = rank->keys[j].name;
      uint32_t id;
      if (name == NULL || name[0] == '\0')
        return sp__failf(msg, msglen, SP_EINVAL,
                         "rank %u registers a key without a name", r);
      id = builder_intern(b, name);
      if (id == PLAN_NONE)
        return sp__failf(msg, msglen, SP_ENOMEM,
                         "out of memory indexing %zu keys", b->nids);
      /* The smallest duplicated name is reported, so the refusal does not
       * depend on the order the rank listed its keys in. */
      if (b->last_rank[id] == r && (dup == NULL || strcmp(name, dup) < 0))
        dup = name;
      b->last_rank[id] = r;
      (*entry_key)[at++] = id;
    }
    if (dup != NULL)
      return sp__failf(msg, msglen, SP_EDUPKEY,
                       "key '%s' is registered twice by rank %u", dup, r);
  }
  return 0;
}

static int gather(struct builder *b, const uint32_t *entry_key, char *msg,
                  size_t msglen) {
  struct plan_index *ix = b->ix;
  size_t n = b->nids > 0 ? b->nids : 1;
  struct named *sorted = malloc(n * sizeof *sorted);
  uint32_t *pos = malloc(n * sizeof *pos);
  size_t total = 0, at = 0;
  int rc = 0;

  for (uint32_t r = 0; r < ix->world; r++)
    total += ix->rank[r]->nkeys;
  ix->nkeys = b->nids;
  ix->name = malloc(n * sizeof *ix->name);
  ix->first = calloc(b->nids + 1, sizeof *ix->first);
  ix->entry = malloc((total > 0 ? total : 1) * sizeof *ix->entry);
  ix->entry_rank = malloc((total > 0 ? total : 1) * sizeof *ix->entry_rank);
  if (sorted == NULL || pos == NULL || ix->name == NULL || ix->first == NULL ||
      ix->entry == NULL || ix->entry_rank == NULL) {
    rc = sp__failf(msg, msglen, SP_ENOMEM, "out of memory");
    goto out;
  }
  for (uint32_t id = 0; id < b->nids; id++)
    sorted[id] = (struct named){b->names[id], id};
  qsort(sorted, b->nids, sizeof *sorted, named_cmp);
  for (uint32_t p = 0; p < b->nids; p++) {
    pos[sorted[p].id] = p;
    ix->name[p] = sorted[p].name;
  }
  /* The table now answers sorted positions. */
  for (size_t i = 0; i <= ix->table_mask; i++)
    if (ix->table[i] != 0)
      ix->table[i] = slot_make(ix->table[i], pos[slot_id(ix->table[i])]);
  for (size_t e = 0; e < total; e++)
    ix->first[pos[entry_key[e]] + 1]++;
  for (size_t k = 0; k < b->nids; k++)
    ix->first[k + 1] += ix->first[k];
  /* Counting sort by key, ranks taken in order: each key's entries end up
   * in rank order.  first[k] serves as the fill cursor and is restored. */
  for (uint32_t r = 0; r < ix->world; r++) {
    for (size_t j = 0; j < ix->rank[r]->nkeys; j++) {
      size_t slot = ix->first[pos[entry_key[at++]]]++;
      ix->entry[slot] = &ix->rank[r]->keys[j];
      ix->entry_rank[slot] = r;
    }
  }
  for (size_t k = b->nids; k > 0; k--)
    ix->first[k] = ix->first[k - 1];
  ix->first[0] = 0;
out:
  free(sorted);
  free(pos);
  return rc;
}

int plan_index_build(const struct plan_input *in, struct plan_index *ix,
                     char *msg, size_t msglen) {
  struct builder b = {.ix = ix, .cap = 64};
  uint32_t *entry_key = NULL;
  size_t widest = 0;
  size_t cap = 64;
  int rc;

  memset(ix, 0, sizeof *ix);
  ix->world = in->world;
  ix->stop = in->stop;
  rc = order_ranks(in, ix, msg, msglen);
  if (rc != 0)
    goto fail;
  /* Dense keys are listed by every rank, so the widest rank's key count is
   * a good first size; the table grows if experts add more. */
  for (uint32_t r = 0; r < ix->world; r++)
    if (ix->rank[r]->nkeys > widest)
      widest = ix->rank[r]->nkeys;
  while (cap < widest * 2 && cap < ((size_t)1 << 40))
    cap *= 2;
  ix->table = calloc(cap, sizeof *ix->table);
  ix->table_mask = cap - 1;
  b.names = malloc(b.cap * sizeof *b.names);
  b.last_rank = malloc(b.cap * sizeof *b.last_rank);
  if (ix->table == NULL || b.names == NULL || b.last_rank == NULL) {
    rc = sp__failf(msg, msglen, SP_ENOMEM, "out of memory");
    goto fail;
  }
  rc = intern_all(&b, &entry_key, msg, msglen);
  if (rc == 0)
    rc = gather(&b, entry_key, msg, msglen);
fail:
  free(entry_key);
  free(b.names);
  free(b.last_rank);
  if (rc != 0)
    plan_index_free(ix);
  return rc;
}

void plan_index_free(struct plan_index *ix) {
  free(ix->rank);
  free(ix->name);
  free(ix->first);
  free(ix->entry);
  free(ix->entry_rank);
  free(ix->table);
  memset(ix, 0, sizeof *ix);
}

uint32_t plan_index_find(const struct plan_index *ix, const char *name) {
  uint64_t h = name_hash(name);

  for (size_t i = (size_t)h & ix->table_mask; ix->table[i] != 0;
       i = (i + 1) & ix->table_mask) {
    uint64_t slot = ix->table[i];
    if ((slot >> 32) == (h >> 32) && strcmp(ix->name[slot_id(slot)], name) == 0)
      return slot_id(slot);
  }
  return PLAN_NONE;
}
