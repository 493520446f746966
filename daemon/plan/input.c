/*
 * input.c - the planner's compact input (layout.h), built from full forms
 * one rank at a time, and a compact entry turned back into its full form.
 *
 * A declaration (name, placement, device type, dtype, global shape) is
 * interned once per job in a hash table; each rank's holding becomes a
 * 16-byte entry naming its row.  Whether a holding is compact is decided
 * here and only here: it must be rebuilt exactly by plan_input_holding(),
 * so that every check of the planner sees what the producer described.
 */
#include <stdlib.h>
#include <string.h>

#include "shardport.h"
#include "daemon/plan/internal.h"

_Static_assert(sizeof(struct plan_entry) == 16,
               "a shard entry is 16 bytes (layout.h)");

struct rank_tables {
  struct plan_entry *entries;
  struct plan_key_in *full;
};

struct plan_input_store {
  struct plan_input in;
  struct plan_rank_in *ranks;
  struct rank_tables *tables; /* beside ranks, what the store owns */
  size_t rank_cap;
  struct plan_key_decl *keys;
  size_t key_cap;
  uint64_t *table; /* (hash >> 32) << 32 | (row + 1); zero is free */
  size_t table_mask;
  size_t bytes; /* what the tables take, for plan_input_store_bytes */
};

struct plan_input_store *plan_input_store_new(uint32_t world) {
  struct plan_input_store *s = calloc(1, sizeof *s);

  if (s == NULL)
    return NULL;
  s->table_mask = 63;
  s->table = calloc(s->table_mask + 1, sizeof *s->table);
  if (s->table == NULL) {
    free(s);
    return NULL;
  }
  s->in.world = world;
  return s;
}

void plan_input_store_free(struct plan_input_store *s) {
  if (s == NULL)
    return;
  for (size_t r = 0; r < s->in.nranks; r++) {
    free(s->tables[r].entries);
    free(s->tables[r].full);
  }
  free(s->ranks);
  free(s->tables);
  free(s->keys);
  free(s->table);
  free(s);
}

struct plan_input *plan_input_of(struct plan_input_store *s) {
  s->in.ranks = s->ranks;
  s->in.keys = s->keys;
  return &s->in;
}

size_t plan_input_store_bytes(const struct plan_input_store *s) {
  return s->bytes + (s->table_mask + 1) * sizeof *s->table +
         s->key_cap * sizeof *s->keys +
         s->rank_cap * (sizeof *s->ranks + sizeof *s->tables);
}

static uint64_t decl_hash(const struct plan_key_decl *d) {
  struct plan_hash h;

  plan_hash_init(&h);
  plan_hash_str(&h, d->name != NULL ? d->name : "");
  plan_hash_u64(&h, (uint64_t)d->placement);
  plan_hash_u64(&h, d->device_type);
  plan_hash_u64(&h, (uint64_t)d->dtype);
  plan_hash_u64(&h, d->ndim);
  for (uint32_t i = 0; i < d->ndim && i < SP_MAX_DIMS; i++)
    plan_hash_u64(&h, (uint64_t)d->shape[i]);
  return plan_hash_final(&h);
}

static bool decl_equal(const struct plan_key_decl *a,
                       const struct plan_key_decl *b) {
  if (a->placement != b->placement || a->device_type != b->device_type ||
      a->dtype != b->dtype || a->ndim != b->ndim ||
      memcmp(a->shape, b->shape, sizeof a->shape) != 0)
    return false;
  if (a->name == b->name)
    return true;
  if (a->name == NULL || b->name == NULL)
    return false;
  return strcmp(a->name, b->name) == 0;
}

static int table_grow(struct plan_input_store *s) {
  size_t cap = (s->table_mask + 1) * 2;
  uint64_t *table = calloc(cap, sizeof *table);

  if (table == NULL)
    return SP_ENOMEM;
  for (size_t row = 0; row < s->in.nkeys; row++) {
    uint64_t h = decl_hash(&s->keys[row]);
    size_t i = (size_t)h & (cap - 1);
    while (table[i] != 0)
      i = (i + 1) & (cap - 1);
    table[i] = (h & 0xffffffff00000000ull) | (row + 1);
  }
  free(s->table);
  s->table = table;
  s->table_mask = cap - 1;
  return 0;
}

/* The row of d in the key table, added when new; PLAN_NONE when out of
 * memory or past 2^31 rows. */
static uint32_t intern(struct plan_input_store *s,
                       const struct plan_key_decl *d) {
  uint64_t h = decl_hash(d);
  size_t i = (size_t)h & s->table_mask;

  for (; s->table[i] != 0; i = (i + 1) & s->table_mask) {
    uint64_t slot = s->table[i];
    uint32_t row = (uint32_t)(slot & 0xffffffffu) - 1;
    if ((slot >> 32) == (h >> 32) && decl_equal(&s->keys[row], d))
      return row;
  }
  if (s->in.nkeys >= PLAN_ENTRY_FULL)
    return PLAN_NONE;
  if (s->in.nkeys == s->key_cap) {
    size_t cap = s->key_cap > 0 ? s->key_cap * 2 : 64;
    struct plan_key_decl *keys = realloc(s->keys, cap * sizeof *keys);
    if (keys == NULL)
      return PLAN_NONE;
    s->keys = keys;
    s->key_cap = cap;
  }
  s->keys[s->in.nkeys] = *d;
  s->table[i] = (h & 0xffffffff00000000ull) | (s->in.nkeys + 1);
  s->in.nkeys++;
  /* Half full at most, so probes stay short. */
  if (s->in.nkeys * 2 > s->table_mask + 1 && table_grow(s) != 0)
    return PLAN_NONE;
  return (uint32_t)(s->in.nkeys - 1);
}

/* Row-major strides of shape[0..ndim); false when they overflow. */
static bool row_major(uint32_t ndim, const int64_t *shape, int64_t *stride) {
  int64_t s = 1;

  for (uint32_t d = ndim; d-- > 0;) {
    stride[d] = s;
    if (__builtin_mul_overflow(s, shape[d], &s))
      return false;
  }
  return true;
}

/* Whether plan_input_holding() rebuilds e exactly from a compact entry. */
static bool compactable(const struct plan_key_in *e) {
  int64_t stride[SP_MAX_DIMS];
  uint64_t nbytes;

  if (e->placement == PLAN_AFFINE || e->npieces > 0 || e->pieces != NULL ||
      e->storage >= PLAN_ENTRY_FULL || e->ndim > SP_MAX_DIMS ||
      e->view.ndim != e->ndim || e->view.offset < 0 ||
      e->view.offset > (int64_t)UINT32_MAX)
    return false;
  for (uint32_t d = 0; d < e->ndim; d++)
    if (e->shape[d] < 0 || (d > 0 && e->view.shape[d] != e->shape[d]))
      return false;
  if (e->ndim > 0 &&
      (e->view.shape[0] < 0 || e->view.shape[0] > (int64_t)UINT32_MAX))
    return false;
  if (sp__dtype_size(e->view.dtype) == 0 ||
      !row_major(e->view.ndim, e->view.shape, stride) ||
      memcmp(stride, e->view.stride, e->ndim * sizeof stride[0]) != 0)
    return false;
  return sp__view_nbytes(&e->view, &nbytes) == 0 && nbytes == e->nbytes;
}

static int reserve_rank(struct plan_input_store *s) {
  if (s->in.nranks < s->rank_cap)
    return 0;
  size_t cap = s->rank_cap > 0 ? s->rank_cap * 2 : 8;
  struct plan_rank_in *ranks = realloc(s->ranks, cap * sizeof *ranks);
  if (ranks == NULL)
    return SP_ENOMEM;
  s->ranks = ranks;
  struct rank_tables *tables = realloc(s->tables, cap * sizeof *tables);
  if (tables == NULL)
    return SP_ENOMEM;
  s->tables = tables;
  s->rank_cap = cap;
  return 0;
}

int plan_input_add_rank(struct plan_input_store *s,
                        const struct plan_rank_desc *rank, char *msg,
                        size_t msglen) {
  struct rank_tables t = {0};
  size_t nfull = 0, at = 0;
  uint8_t *compact = NULL;

  if (rank->nkeys >= PLAN_ENTRY_FULL)
    return sp__failf(msg, msglen, SP_EOVERFLOW,
                     "rank %u registers %zu keys, more than the planner "
                     "indexes",
                     rank->rank, rank->nkeys);
  if (reserve_rank(s) != 0)
    return sp__failf(msg, msglen, SP_ENOMEM, "out of memory");
  /* Ranks of one job mostly list the same keys in the same order: the row
   * the rank before used at the same place is tried before the table. */
  const struct rank_tables *before =
      s->in.nranks > 0 ? &s->tables[s->in.nranks - 1] : NULL;
  size_t nbefore = s->in.nranks > 0 ? s->ranks[s->in.nranks - 1].nentries : 0;
  compact = malloc(rank->nkeys > 0 ? rank->nkeys : 1);
  if (compact == NULL)
    goto nomem;
  for (size_t i = 0; i < rank->nkeys; i++) {
    compact[i] = compactable(&rank->keys[i]);
    nfull += !compact[i];
  }
  t.entries = malloc((rank->nkeys > 0 ? rank->nkeys : 1) * sizeof *t.entries);
  t.full = malloc((nfull > 0 ? nfull : 1) * sizeof *t.full);
  if (t.entries == NULL || t.full == NULL)
    goto nomem;
  for (size_t i = 0; i < rank->nkeys; i++) {
    const struct plan_key_in *e = &rank->keys[i];
    struct plan_key_decl d = {.name = e->name,
                              .placement = e->placement,
                              .device_type = e->device_type,
                              .dtype = e->view.dtype,
                              .ndim = e->ndim};
    /* Dims past ndim are not part of the declaration. */
    for (uint32_t dim = 0; dim < e->ndim && dim < SP_MAX_DIMS; dim++)
      d.shape[dim] = e->shape[dim];
    uint32_t row = PLAN_NONE;
    if (i < nbefore && decl_equal(&s->keys[before->entries[i].key], &d))
      row = before->entries[i].key;
    if (row == PLAN_NONE && (row = intern(s, &d)) == PLAN_NONE)
      goto nomem;
    if (compact[i]) {
      t.entries[i] = (struct plan_entry){
          .key = row,
          .storage = e->storage,
          .offset = (uint32_t)e->view.offset,
          .rows = e->ndim > 0 ? (uint32_t)e->view.shape[0] : 0};
    } else {
      t.full[at] = *e;
      t.entries[i] = (struct plan_entry){
          .key = row, .storage = PLAN_ENTRY_FULL, .offset = (uint32_t)at};
      at++;
    }
  }
  s->tables[s->in.nranks] = t;
  s->ranks[s->in.nranks++] = (struct plan_rank_in){.rank = rank->rank,
                                                   .node = rank->node,
                                                   .nstorages = rank->nstorages,
                                                   .storages = rank->storages,
                                                   .nentries = rank->nkeys,
                                                   .entries = t.entries,
                                                   .nfull = nfull,
                                                   .full = t.full,
                                                   .ngroups = rank->ngroups,
                                                   .groups = rank->groups};
  s->bytes += rank->nkeys * sizeof *t.entries + nfull * sizeof *t.full;
  free(compact);
  return 0;
nomem:
  free(compact);
  free(t.entries);
  free(t.full);
  return sp__failf(msg, msglen, SP_ENOMEM,
                   "out of memory reading rank %u's registrations", rank->rank);
}

void plan_input_holding(const struct plan_input *in,
                        const struct plan_rank_in *rank,
                        const struct plan_entry *e, struct plan_key_in *out) {
  const struct plan_key_decl *d = &in->keys[e->key];

  if (e->storage == PLAN_ENTRY_FULL) {
    *out = rank->full[e->offset];
    return;
  }
  memset(out, 0, sizeof *out);
  out->name = d->name;
  out->placement = d->placement;
  out->device_type = d->device_type;
  out->ndim = d->ndim;
  memcpy(out->shape, d->shape, sizeof out->shape);
  out->storage = e->storage;
  out->view.dtype = d->dtype;
  out->view.ndim = d->ndim;
  memcpy(out->view.shape, d->shape, sizeof out->view.shape);
  if (d->ndim > 0)
    out->view.shape[0] = e->rows;
  row_major(d->ndim, out->view.shape, out->view.stride);
  out->view.offset = e->offset;
  sp__view_nbytes(&out->view, &out->nbytes);
}
