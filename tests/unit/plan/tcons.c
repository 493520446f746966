/*
 * tcons.c - consumer inputs, host data and the consumer oracle for the
 * tests.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "proto/dtype.h"
#include "tests/unit/plan/tcons.h"

struct cstorage {
  struct consume_storage s;
  uint8_t *bytes;
};

struct tconsumer {
  uint64_t node;
  struct cstorage *storages;
  size_t nstorages;
  struct consume_target *targets;
  size_t ntargets;
  struct consume_storage *flat; /* what the input hands the planner */
  struct consume_target *shuffled;
};

struct tcons {
  uint32_t n;
  struct tconsumer *c;
  struct consume_in *in;
  struct consume_input input;
  uint64_t next_memory;
  void **owned;
  size_t nowned;
};

static void *xrealloc(void *p, size_t n) {
  void *q = realloc(p, n > 0 ? n : 1);
  if (q == NULL)
    abort();
  return q;
}

static void *grow(void *p, size_t n, size_t size) {
  if (n == 0 || (n & (n - 1)) == 0)
    return xrealloc(p, (n == 0 ? 1 : 2 * n) * size);
  return p;
}

struct tcons *tcons_new(uint32_t nconsumers) {
  struct tcons *cons = calloc(1, sizeof *cons);
  if (cons == NULL)
    abort();
  cons->n = nconsumers;
  cons->c = xrealloc(NULL, nconsumers * sizeof *cons->c);
  memset(cons->c, 0, nconsumers * sizeof *cons->c);
  cons->in = xrealloc(NULL, nconsumers * sizeof *cons->in);
  cons->next_memory = 1;
  for (uint32_t c = 0; c < nconsumers; c++)
    cons->c[c].node = c;
  return cons;
}

void tcons_free(struct tcons *cons) {
  for (uint32_t c = 0; c < cons->n; c++) {
    for (size_t s = 0; s < cons->c[c].nstorages; s++)
      free(cons->c[c].storages[s].bytes);
    free(cons->c[c].storages);
    free(cons->c[c].targets);
    free(cons->c[c].flat);
    free(cons->c[c].shuffled);
  }
  for (size_t i = 0; i < cons->nowned; i++)
    free(cons->owned[i]);
  free(cons->owned);
  free(cons->c);
  free(cons->in);
  free(cons);
}

void tcons_node(struct tcons *cons, uint32_t consumer, uint64_t node) {
  cons->c[consumer].node = node;
}

uint32_t tcons_storage_in(struct tcons *cons, uint32_t consumer,
                          uint64_t memory, uint64_t memory_offset,
                          uint64_t nbytes) {
  struct tconsumer *c = &cons->c[consumer];
  struct cstorage *s;

  c->storages = grow(c->storages, c->nstorages, sizeof *c->storages);
  s = &c->storages[c->nstorages];
  memset(s, 0, sizeof *s);
  s->s.nbytes = nbytes;
  s->s.memory = memory;
  s->s.memory_offset = memory_offset;
  s->bytes = xrealloc(NULL, nbytes);
  return (uint32_t)c->nstorages++;
}

uint32_t tcons_storage(struct tcons *cons, uint32_t consumer, uint64_t nbytes) {
  /* Memory objects the tests name themselves are below 1 << 32. */
  return tcons_storage_in(cons, consumer, (1ull << 32) + cons->next_memory++, 0,
                          nbytes);
}

struct consume_storage *tcons_storage_at(struct tcons *cons, uint32_t consumer,
                                         uint32_t storage) {
  return &cons->c[consumer].storages[storage].s;
}

static struct consume_target *add_target(struct tcons *cons, uint32_t consumer,
                                         const char *key, enum sp_dtype dtype,
                                         uint32_t ndim, const int64_t *shape,
                                         enum consume_part part) {
  struct tconsumer *c = &cons->c[consumer];
  struct consume_target *t;

  c->targets = grow(c->targets, c->ntargets, sizeof *c->targets);
  t = &c->targets[c->ntargets++];
  memset(t, 0, sizeof *t);
  t->key = key;
  t->part = part;
  t->dtype = dtype;
  t->ndim = ndim;
  for (uint32_t d = 0; d < ndim; d++)
    t->shape[d] = shape[d];
  return t;
}

/* A contiguous view of shape in a storage of its own. */
static void own_view(struct tcons *cons, uint32_t consumer,
                     struct consume_target *t, const int64_t *shape) {
  int64_t stride = 1;
  uint64_t numel = 1;
  uint32_t storage;

  t->view.dtype = t->dtype;
  t->view.ndim = t->ndim;
  for (uint32_t d = t->ndim; d-- > 0;) {
    t->view.shape[d] = shape[d];
    t->view.stride[d] = stride;
    stride *= shape[d] > 0 ? shape[d] : 1;
    numel *= (uint64_t)shape[d];
  }
  storage = tcons_storage(cons, consumer, numel * sp__dtype_size(t->dtype));
  t->storage = storage;
}

struct consume_target *tcons_whole(struct tcons *cons, uint32_t consumer,
                                   const char *key, enum sp_dtype dtype,
                                   uint32_t ndim, const int64_t *shape) {
  struct consume_target *t =
      add_target(cons, consumer, key, dtype, ndim, shape, CONSUME_WHOLE);
  own_view(cons, consumer, t, shape);
  return t;
}

struct consume_target *tcons_shard(struct tcons *cons, uint32_t consumer,
                                   const char *key, enum sp_dtype dtype,
                                   uint32_t ndim, const int64_t *shape,
                                   uint32_t dim, int64_t rows) {
  struct consume_target *t =
      add_target(cons, consumer, key, dtype, ndim, shape, CONSUME_SHARD);
  int64_t part[SP_MAX_DIMS];

  memcpy(part, shape, ndim * sizeof *shape);
  part[dim] = rows;
  t->dim = dim;
  own_view(cons, consumer, t, part);
  return t;
}

struct consume_target *tcons_pieces(struct tcons *cons, uint32_t consumer,
                                    const char *key, enum sp_dtype dtype,
                                    uint32_t ndim, const int64_t *shape,
                                    size_t npieces,
                                    const struct consume_piece *pieces) {
  struct consume_target *t =
      add_target(cons, consumer, key, dtype, ndim, shape, CONSUME_PIECES);
  struct consume_piece *copy = xrealloc(NULL, npieces * sizeof *copy);

  memcpy(copy, pieces, npieces * sizeof *copy);
  cons->owned = grow(cons->owned, cons->nowned, sizeof *cons->owned);
  cons->owned[cons->nowned++] = copy;
  t->npieces = npieces;
  t->pieces = copy;
  return t;
}

uint32_t tcons_count(const struct tcons *cons) { return cons->n; }

size_t tcons_target_count(const struct tcons *cons, uint32_t consumer) {
  return cons->c[consumer].ntargets;
}

struct consume_target *tcons_target(struct tcons *cons, uint32_t consumer,
                                    size_t i) {
  return &cons->c[consumer].targets[i];
}

static uint64_t rand_next(uint64_t *state) { return tjob_rand(state); }

const struct consume_input *tcons_input(struct tcons *cons,
                                        const struct plan_input *trainers,
                                        uint64_t seed) {
  for (uint32_t i = 0; i < cons->n; i++) {
    struct tconsumer *c = &cons->c[i];
    free(c->flat);
    free(c->shuffled);
    c->flat = xrealloc(NULL, c->nstorages * sizeof *c->flat);
    for (size_t s = 0; s < c->nstorages; s++)
      c->flat[s] = c->storages[s].s;
    c->shuffled = xrealloc(NULL, c->ntargets * sizeof *c->shuffled);
    for (size_t t = 0; t < c->ntargets; t++)
      c->shuffled[t] = c->targets[t];
    for (size_t t = c->ntargets; seed != 0 && t > 1; t--) {
      size_t j = (size_t)(rand_next(&seed) % t);
      struct consume_target x = c->shuffled[t - 1];
      c->shuffled[t - 1] = c->shuffled[j];
      c->shuffled[j] = x;
    }
    cons->in[i] = (struct consume_in){.index = i,
                                      .node = c->node,
                                      .nstorages = c->nstorages,
                                      .storages = c->flat,
                                      .ntargets = c->ntargets,
                                      .targets = c->shuffled};
  }
  for (uint32_t i = cons->n; seed != 0 && i > 1; i--) {
    uint32_t j = (uint32_t)(rand_next(&seed) % i);
    struct consume_in x = cons->in[i - 1];
    cons->in[i - 1] = cons->in[j];
    cons->in[j] = x;
  }
  cons->input = (struct consume_input){.trainers = trainers,
                                       .nconsumers = cons->n,
                                       .nconsumer_in = cons->n,
                                       .consumers = cons->in};
  return &cons->input;
}

/* The unsharded tensors: byte i of key name, for one set of values. */
static uint8_t full_byte(const char *name, uint64_t values, uint64_t i) {
  uint64_t h = 0xcbf29ce484222325ull ^ values;
  for (const char *s = name; *s != '\0'; s++)
    h = (h ^ (uint8_t)*s) * 0x100000001b3ull;
  h ^= i * 0x9e3779b97f4a7c15ull;
  h ^= h >> 29;
  h *= 0xbf58476d1ce4e5b9ull;
  return (uint8_t)(h >> 56);
}

/* Steps idx through shape (an odometer); false once past the end. */
static bool next_index(uint32_t ndim, const int64_t *shape, int64_t *idx) {
  for (uint32_t d = ndim; d-- > 0;) {
    if (++idx[d] < shape[d])
      return true;
    idx[d] = 0;
  }
  return false;
}

static uint64_t numel_of(uint32_t ndim, const int64_t *shape) {
  uint64_t n = 1;
  for (uint32_t d = 0; d < ndim; d++)
    n *= (uint64_t)shape[d];
  return n;
}

/* Writes the box of key's unsharded tensor that starts at start and has
 * view's shape into the buffer through view. */
static void box_to_view(const char *key, uint64_t values, uint32_t ndim,
                        const int64_t *shape, const int64_t *start,
                        const struct sp_view *view, uint8_t *buf) {
  uint32_t size = sp__dtype_size(view->dtype);
  int64_t idx[SP_MAX_DIMS] = {0};

  if (numel_of(ndim, view->shape) == 0)
    return;
  do {
    uint64_t flat = 0;
    int64_t at = view->offset;
    for (uint32_t d = 0; d < ndim; d++) {
      flat = flat * (uint64_t)shape[d] + (uint64_t)(start[d] + idx[d]);
      at += idx[d] * view->stride[d];
    }
    for (uint32_t b = 0; b < size; b++)
      buf[(uint64_t)at * size + b] = full_byte(key, values, flat * size + b);
  } while (next_index(ndim, view->shape, idx));
}

struct tdata {
  uint32_t world;
  uint64_t values;
  uint8_t ***bytes; /* [rank][storage] */
  size_t *nstorages;
};

/* Rank ri's holdings of the input: their number, and the i-th one with its
 * key's name (the one place the tests' data reads the registrations). */
static size_t holdings(const struct plan_rank_in *ri) { return ri->nentries; }

static const char *holding_at(const struct plan_input *in,
                              const struct plan_rank_in *ri, size_t i,
                              struct plan_key_in *out) {
  plan_input_holding(in, ri, &ri->entries[i], out);
  return out->name;
}

static void fill_affine(struct tdata *data, uint32_t rank, const char *name,
                        const struct plan_key_in *e) {
  uint32_t size = sp__dtype_size(e->view.dtype);
  uint8_t *buf = data->bytes[rank][e->storage];

  for (size_t pi = 0; pi < e->npieces; pi++) {
    const struct affine_piece *p = &e->pieces[pi];
    int64_t idx[SP_MAX_DIMS] = {0};
    if (numel_of(p->ndim, p->shape) == 0)
      continue;
    do {
      int64_t src = e->view.offset + p->src_offset, dst = p->dst_offset;
      for (uint32_t d = 0; d < p->ndim; d++) {
        src += idx[d] * p->src_stride[d];
        dst += idx[d] * p->dst_stride[d];
      }
      for (uint32_t b = 0; b < size; b++)
        buf[(uint64_t)src * size + b] =
            full_byte(name, data->values, (uint64_t)dst * size + b);
    } while (next_index(p->ndim, p->shape, idx));
  }
}

/* Where rank r's rows of the shard0 key name start: after the rows of the
 * ranks before it. */
static int64_t rows_before(const struct plan_input *in,
                           const struct plan_rank_in *const *by_rank,
                           uint32_t r, const char *name) {
  int64_t start = 0;

  for (uint32_t q = 0; q < r; q++)
    for (size_t j = 0; j < holdings(by_rank[q]); j++) {
      struct plan_key_in h;
      if (strcmp(holding_at(in, by_rank[q], j, &h), name) == 0)
        start += h.view.shape[0];
    }
  return start;
}

struct tdata *tdata_new(const struct plan_input *trainers, uint64_t values) {
  struct tdata *data = calloc(1, sizeof *data);
  const struct plan_rank_in **by_rank;

  if (data == NULL)
    abort();
  data->world = trainers->world;
  data->values = values;
  data->bytes = xrealloc(NULL, data->world * sizeof *data->bytes);
  data->nstorages = xrealloc(NULL, data->world * sizeof *data->nstorages);
  by_rank = xrealloc(NULL, data->world * sizeof *by_rank);
  for (size_t i = 0; i < trainers->nranks; i++)
    by_rank[trainers->ranks[i].rank] = &trainers->ranks[i];
  for (uint32_t r = 0; r < data->world; r++) {
    const struct plan_rank_in *ri = by_rank[r];
    data->nstorages[r] = ri->nstorages;
    data->bytes[r] = xrealloc(NULL, ri->nstorages * sizeof *data->bytes[r]);
    for (size_t s = 0; s < ri->nstorages; s++) {
      data->bytes[r][s] = xrealloc(NULL, ri->storages[s].nbytes);
      memset(data->bytes[r][s], 0, ri->storages[s].nbytes);
    }
  }
  for (uint32_t r = 0; r < data->world; r++) {
    const struct plan_rank_in *ri = by_rank[r];
    for (size_t k = 0; k < holdings(ri); k++) {
      struct plan_key_in e;
      const char *name = holding_at(trainers, ri, k, &e);
      int64_t start[SP_MAX_DIMS] = {0};
      if (e.placement == PLAN_AFFINE) {
        fill_affine(data, r, name, &e);
        continue;
      }
      if (e.placement == PLAN_SHARD0)
        start[0] = rows_before(trainers, by_rank, r, name);
      box_to_view(name, values, e.ndim, e.shape, start, &e.view,
                  data->bytes[r][e.storage]);
    }
  }
  free(by_rank);
  return data;
}

void tdata_free(struct tdata *data) {
  for (uint32_t r = 0; r < data->world; r++) {
    for (size_t s = 0; s < data->nstorages[r]; s++)
      free(data->bytes[r][s]);
    free(data->bytes[r]);
  }
  free(data->bytes);
  free(data->nstorages);
  free(data);
}

/* Copies the elements of view `from` in src to, or from, packed bytes. */
static void strided(const struct sp_view *v, uint8_t *buf, uint8_t *packed,
                    bool pack) {
  uint32_t size = sp__dtype_size(v->dtype);
  int64_t idx[SP_MAX_DIMS] = {0};
  uint64_t at = 0;

  if (numel_of(v->ndim, v->shape) == 0)
    return;
  do {
    int64_t e = v->offset;
    for (uint32_t d = 0; d < v->ndim; d++)
      e += idx[d] * v->stride[d];
    if (pack)
      memcpy(packed + at, buf + (uint64_t)e * size, size);
    else
      memcpy(buf + (uint64_t)e * size, packed + at, size);
    at += size;
  } while (next_index(v->ndim, v->shape, idx));
}

static void carry(struct tcons *cons, const struct tdata *data,
                  const struct consume_move *m, uint8_t *packed) {
  strided(&m->from, data->bytes[m->src][m->src_storage], packed, true);
  strided(&m->to, cons->c[m->dst].storages[m->dst_storage].bytes, packed,
          false);
}

void tcons_clear(struct tcons *cons) {
  for (uint32_t c = 0; c < cons->n; c++)
    for (size_t s = 0; s < cons->c[c].nstorages; s++)
      memset(cons->c[c].storages[s].bytes, TCONS_UNTOUCHED,
             cons->c[c].storages[s].s.nbytes);
}

uint8_t *tcons_bytes(struct tcons *cons, uint32_t consumer, uint32_t storage) {
  return cons->c[consumer].storages[storage].bytes;
}

size_t tcons_storage_count(const struct tcons *cons, uint32_t consumer) {
  return cons->c[consumer].nstorages;
}

const uint8_t *tdata_bytes(const struct tdata *data, uint32_t rank,
                           uint32_t storage) {
  return data->bytes[rank][storage];
}

size_t tdata_storage_count(const struct tdata *data, uint32_t rank) {
  return data->nstorages[rank];
}

void tcons_push(struct tcons *cons, const struct tdata *data,
                const struct consume_plan *plan) {
  tcons_clear(cons);
  for (size_t r = 0; r < plan->nrounds; r++) {
    const struct consume_round *round = &plan->rounds[r];
    /* Local moves as the consumers list them; buckets packed by their
     * senders at each move's bucket offset and unpacked by the consumer in
     * its receive order. */
    for (size_t i = 0; i < round->nlocal; i++) {
      const struct consume_move *m = &round->local[round->local_order[i]];
      uint8_t *packed = xrealloc(NULL, m->nbytes);
      carry(cons, data, m, packed);
      free(packed);
    }
    for (uint32_t c = 0; c < plan->nconsumers; c++) {
      const struct consume_side *side = &round->consumers[c];
      for (size_t i = 0; i < side->nbuckets; i++) {
        const struct consume_bucket *b =
            &round->buckets[round->recv_order[side->bucket_first + i]];
        uint8_t *packed = xrealloc(NULL, b->nbytes);
        for (size_t m = b->first; m < b->first + b->nmoves; m++)
          strided(&round->moves[m].from,
                  data->bytes[b->src][round->moves[m].src_storage],
                  packed + round->moves[m].bucket_offset, true);
        for (size_t m = b->first; m < b->first + b->nmoves; m++)
          strided(&round->moves[m].to,
                  cons->c[c].storages[round->moves[m].dst_storage].bytes,
                  packed + round->moves[m].bucket_offset, false);
        free(packed);
      }
    }
  }
}

/* Where consumer c's shard of key along dim starts: after the shards of
 * the consumers before it. */
static int64_t shard_start(const struct tcons *cons, uint32_t c,
                           const struct consume_target *t) {
  int64_t start = 0;
  for (uint32_t q = 0; q < c; q++)
    for (size_t i = 0; i < cons->c[q].ntargets; i++) {
      const struct consume_target *o = &cons->c[q].targets[i];
      if (o->part == CONSUME_SHARD && strcmp(o->key, t->key) == 0)
        start += o->view.shape[t->dim];
    }
  return start;
}

uint64_t tcons_compare(struct tcons *cons, const struct tdata *data, char *msg,
                       size_t msglen) {
  uint64_t wrong = 0;

  for (uint32_t c = 0; c < cons->n; c++) {
    struct tconsumer *tc = &cons->c[c];
    uint8_t **want = xrealloc(NULL, tc->nstorages * sizeof *want);
    for (size_t s = 0; s < tc->nstorages; s++) {
      want[s] = xrealloc(NULL, tc->storages[s].s.nbytes);
      memset(want[s], TCONS_UNTOUCHED, tc->storages[s].s.nbytes);
    }
    for (size_t i = 0; i < tc->ntargets; i++) {
      const struct consume_target *t = &tc->targets[i];
      int64_t start[SP_MAX_DIMS] = {0};
      if (t->part == CONSUME_PIECES) {
        for (size_t p = 0; p < t->npieces; p++)
          box_to_view(t->key, data->values, t->ndim, t->shape,
                      t->pieces[p].start, &t->pieces[p].dst,
                      want[t->pieces[p].storage]);
        continue;
      }
      if (t->part == CONSUME_SHARD)
        start[t->dim] = shard_start(cons, c, t);
      box_to_view(t->key, data->values, t->ndim, t->shape, start, &t->view,
                  want[t->storage]);
    }
    for (size_t s = 0; s < tc->nstorages; s++) {
      for (uint64_t b = 0; b < tc->storages[s].s.nbytes; b++) {
        if (want[s][b] == tc->storages[s].bytes[b])
          continue;
        if (wrong++ == 0)
          snprintf(msg, msglen,
                   "consumer %u storage %zu byte %llu: %#x, want %#x", c, s,
                   (unsigned long long)b, tc->storages[s].bytes[b], want[s][b]);
      }
      free(want[s]);
    }
    free(want);
  }
  return wrong;
}
