/*
 * tjob.c - planner inputs for the tests.
 */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tests/unit/plan/tjob.h"

struct trank {
  uint64_t node;
  struct sp_storage *storages;
  size_t nstorages;
  struct plan_key_in *keys;
  size_t nkeys;
  struct plan_group *groups;
  size_t ngroups;
  struct plan_key_in *shuffled;
};

struct tjob {
  uint32_t world;
  struct trank *ranks;
  struct plan_rank_desc *descs;
  /* Every input built, kept until tjob_free: plans borrow them. */
  struct plan_input_store **stores;
  size_t nstores;
  struct plan_input *in; /* the last one */
  uint32_t max_keys;
  uint64_t max_bytes;
  uint32_t threads;
  uint64_t next_base;
  void **owned;
  size_t nowned;
};

static void *xrealloc(void *p, size_t n) {
  void *q = realloc(p, n > 0 ? n : 1);
  if (q == NULL)
    abort();
  return q;
}

/* Room for one more of n items of size bytes, doubling, so that building
 * thousands of keys stays linear (ASan's realloc always copies). */
static void *grow(void *p, size_t n, size_t size) {
  if (n == 0 || (n & (n - 1)) == 0)
    return xrealloc(p, (n == 0 ? 1 : 2 * n) * size);
  return p;
}

static void *own(struct tjob *job, void *p) {
  job->owned = grow(job->owned, job->nowned, sizeof *job->owned);
  job->owned[job->nowned++] = p;
  return p;
}

uint64_t tjob_rand(uint64_t *state) {
  uint64_t z = (*state += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

struct tjob *tjob_new(uint32_t world) {
  struct tjob *job = calloc(1, sizeof *job);
  if (job == NULL)
    abort();
  job->world = world;
  job->ranks = xrealloc(NULL, world * sizeof *job->ranks);
  memset(job->ranks, 0, world * sizeof *job->ranks);
  job->descs = xrealloc(NULL, world * sizeof *job->descs);
  job->next_base = 0x10000;
  for (uint32_t r = 0; r < world; r++)
    job->ranks[r].node = r;
  return job;
}

void tjob_free(struct tjob *job) {
  for (uint32_t r = 0; r < job->world; r++) {
    free(job->ranks[r].storages);
    free(job->ranks[r].keys);
    free(job->ranks[r].groups);
    free(job->ranks[r].shuffled);
  }
  for (size_t i = 0; i < job->nowned; i++)
    free(job->owned[i]);
  free(job->owned);
  for (size_t i = 0; i < job->nstores; i++)
    plan_input_store_free(job->stores[i]);
  free(job->stores);
  free(job->ranks);
  free(job->descs);
  free(job);
}

const char *tjob_name(struct tjob *job, const char *fmt, ...) {
  char buf[256];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(buf, sizeof buf, fmt, ap);
  va_end(ap);
  return own(job, strdup(buf));
}

void tjob_node(struct tjob *job, uint32_t rank, uint64_t node) {
  job->ranks[rank].node = node;
}

static struct plan_key_in *
add_entry(struct tjob *job, uint32_t r, const char *name,
          enum plan_placement placement, enum sp_dtype dtype, uint32_t ndim,
          const int64_t *shape, uint32_t vndim, const int64_t *vshape) {
  struct trank *rank = &job->ranks[r];
  struct plan_key_in *e;
  struct sp_storage *s;
  uint64_t numel = 1;
  int64_t stride = 1;

  for (uint32_t d = 0; d < vndim; d++)
    numel *= (uint64_t)vshape[d];
  rank->storages =
      grow(rank->storages, rank->nstorages, sizeof *rank->storages);
  s = &rank->storages[rank->nstorages];
  memset(s, 0, sizeof *s);
  s->device.type = SP_DEVICE_CPU;
  s->base = job->next_base;
  s->nbytes = numel * sp__dtype_size(dtype);
  job->next_base += s->nbytes + 0x1000;
  rank->keys = grow(rank->keys, rank->nkeys, sizeof *rank->keys);
  e = &rank->keys[rank->nkeys++];
  memset(e, 0, sizeof *e);
  e->name = name;
  e->placement = placement;
  e->device_type = SP_DEVICE_CPU;
  e->ndim = ndim;
  memcpy(e->shape, shape, ndim * sizeof *shape);
  e->storage = (uint32_t)rank->nstorages++;
  e->view.dtype = dtype;
  e->view.ndim = vndim;
  for (uint32_t d = vndim; d-- > 0;) {
    e->view.shape[d] = vshape[d];
    e->view.stride[d] = stride;
    stride *= vshape[d];
  }
  e->nbytes = s->nbytes;
  return e;
}

void tjob_shard0(struct tjob *job, const char *name, enum sp_dtype dtype,
                 uint32_t ndim, const int64_t *shape, const int64_t *rows) {
  for (uint32_t r = 0; r < job->world; r++) {
    int64_t vshape[SP_MAX_DIMS];
    memcpy(vshape, shape, ndim * sizeof *shape);
    vshape[0] = rows[r];
    add_entry(job, r, name, PLAN_SHARD0, dtype, ndim, shape, ndim, vshape);
  }
}

void tjob_whole(struct tjob *job, const char *name,
                enum plan_placement placement, enum sp_dtype dtype,
                uint32_t ndim, const int64_t *shape) {
  for (uint32_t r = 0; r < job->world; r++)
    add_entry(job, r, name, placement, dtype, ndim, shape, ndim, shape);
}

void tjob_expert(struct tjob *job, uint32_t rank, const char *name,
                 enum sp_dtype dtype, uint32_t ndim, const int64_t *shape) {
  add_entry(job, rank, name, PLAN_EXPERT, dtype, ndim, shape, ndim, shape);
}

void tjob_affine(struct tjob *job, const char *name, enum sp_dtype dtype,
                 uint32_t ndim, const int64_t *shape, const uint64_t *numel,
                 const struct affine_piece *const *pieces,
                 const size_t *npieces) {
  for (uint32_t r = 0; r < job->world; r++) {
    int64_t n = (int64_t)numel[r];
    struct plan_key_in *e =
        add_entry(job, r, name, PLAN_AFFINE, dtype, ndim, shape, 1, &n);
    e->pieces = pieces[r];
    e->npieces = npieces[r];
  }
}

static struct plan_key_in *find(struct tjob *job, uint32_t rank,
                                const char *name) {
  struct trank *tr = &job->ranks[rank];
  for (size_t i = 0; i < tr->nkeys; i++)
    if (strcmp(tr->keys[i].name, name) == 0)
      return &tr->keys[i];
  abort();
}

void tjob_tie(struct tjob *job, const char *name, const char *existing) {
  for (uint32_t r = 0; r < job->world; r++) {
    struct trank *tr = &job->ranks[r];
    struct plan_key_in copy = *find(job, r, existing);
    copy.name = name;
    tr->keys = grow(tr->keys, tr->nkeys, sizeof *tr->keys);
    tr->keys[tr->nkeys++] = copy;
  }
}

void tjob_group(struct tjob *job, uint32_t rank, size_t n,
                const char *const *names) {
  for (uint32_t r = 0; r < job->world; r++) {
    struct trank *tr = &job->ranks[r];
    const char **copy;
    if (rank != PLAN_NONE && r != rank)
      continue;
    copy = own(job, xrealloc(NULL, n * sizeof *copy));
    memcpy(copy, names, n * sizeof *copy);
    tr->groups = grow(tr->groups, tr->ngroups, sizeof *tr->groups);
    tr->groups[tr->ngroups++] = (struct plan_group){n, copy};
  }
}

struct plan_key_in *tjob_key(struct tjob *job, uint32_t rank,
                             const char *name) {
  return find(job, rank, name);
}

struct sp_storage *tjob_storage(struct tjob *job, uint32_t rank,
                                const char *name) {
  return &job->ranks[rank].storages[find(job, rank, name)->storage];
}

void tjob_duplicate(struct tjob *job, uint32_t rank, const char *name) {
  struct trank *tr = &job->ranks[rank];
  struct plan_key_in copy = *find(job, rank, name);
  tr->keys = grow(tr->keys, tr->nkeys, sizeof *tr->keys);
  tr->keys[tr->nkeys++] = copy;
}

void tjob_drop(struct tjob *job, uint32_t rank, const char *name) {
  struct trank *tr = &job->ranks[rank];
  struct plan_key_in *e = find(job, rank, name);
  size_t i = (size_t)(e - tr->keys);
  memmove(e, e + 1, (tr->nkeys - i - 1) * sizeof *e);
  tr->nkeys--;
}

void tjob_limits(struct tjob *job, uint32_t max_keys, uint64_t max_bytes) {
  job->max_keys = max_keys;
  job->max_bytes = max_bytes;
}

void tjob_threads(struct tjob *job, uint32_t threads) {
  job->threads = threads;
}

const struct plan_input *tjob_input(struct tjob *job, uint32_t first,
                                    uint64_t seed) {
  for (uint32_t i = 0; i < job->world; i++) {
    uint32_t r = (first + i) % job->world;
    struct trank *tr = &job->ranks[r];
    const struct plan_key_in *keys = tr->keys;
    if (seed != 0) {
      uint64_t state = seed * 1000003u + r;
      tr->shuffled = xrealloc(tr->shuffled, tr->nkeys * sizeof *tr->keys);
      for (size_t j = 0; j < tr->nkeys; j++)
        tr->shuffled[j] = tr->keys[j];
      for (size_t j = tr->nkeys; j > 1; j--) {
        size_t k = (size_t)(tjob_rand(&state) % j);
        struct plan_key_in t = tr->shuffled[j - 1];
        tr->shuffled[j - 1] = tr->shuffled[k];
        tr->shuffled[k] = t;
      }
      keys = tr->shuffled;
    }
    job->descs[i] = (struct plan_rank_desc){.rank = r,
                                            .node = tr->node,
                                            .nstorages = tr->nstorages,
                                            .storages = tr->storages,
                                            .nkeys = tr->nkeys,
                                            .keys = keys,
                                            .ngroups = tr->ngroups,
                                            .groups = tr->groups};
  }
  /* As a daemon reads its registries: one rank after another. */
  struct plan_input_store *store = plan_input_store_new(job->world);
  char msg[256];
  if (store == NULL)
    abort();
  job->stores = grow(job->stores, job->nstores, sizeof *job->stores);
  job->stores[job->nstores++] = store;
  for (uint32_t i = 0; i < job->world; i++)
    if (plan_input_add_rank(store, &job->descs[i], msg, sizeof msg) != 0)
      abort();
  job->in = plan_input_of(store);
  job->in->max_keys = job->max_keys;
  job->in->max_bytes = job->max_bytes;
  job->in->threads = job->threads;
  return job->in;
}

struct plan_rank_in *tjob_ranks(struct tjob *job) {
  /* The tests that corrupt the rank table own the input they asked for. */
  return (struct plan_rank_in *)job->in->ranks;
}
