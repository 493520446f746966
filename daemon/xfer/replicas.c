/*
 * replicas.c - copies that must agree: replicated and plain keys compared
 * across ranks by digest before anything moves (docs/planner.md,
 * "Replicas"), and the replicas of affine pieces merged element by element
 * where their key is assembled; see replicas.h.
 *
 * Every rank holds such a key whole and only its owner's copy is
 * published: a rank whose copy differs (a sharded tensor registered as
 * plain by mistake) would otherwise go unnoticed, and the owner would
 * publish its own part as the whole.  So each daemon reads every copy its
 * local ranks hold, once per export, where it maps them (read-only), and
 * hashes the elements in row-major order with XXH3-64 (Debian's
 * libxxhash): two copies with the same values have the same digest
 * whatever their strides.  On one node every copy is compared here; a job
 * across nodes compares its local copies here and sends the root the
 * digests of its lowest rank, and the root compares the nodes'
 * (docs/protocol.md, "planned" and "go").  Every rank gets one
 * different_data naming the key and two ranks.
 *
 * The reading runs on the export's planning thread and up to
 * engine_threads - 1 helpers, never on the loop, under the SIGBUS guard
 * (thread.h).  Storages of the CUDA backend are device memory, which this does
 * not read: their keys are not compared.
 */
#include <inttypes.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <xxhash.h>

#include "daemon/xfer/replicas.h"
#include "daemon/xfer/thread.h"
#include "proto/fail.h"
#include "shardport.h"

/* Bytes gathered before each hash update, so that a strided view is not
 * hashed one element at a time. */
#define GATHER_BYTES (64u << 10)

/* One copy to hash. */
struct copy {
  const uint8_t *data; /* its storage's first byte */
  struct sp_view view;
  const char *name;
  uint32_t key;  /* index into d->keys */
  uint32_t slot; /* index into d->ranks */
};

struct hashing {
  const struct replica_digests *d;
  struct copy *copies;
  size_t ncopies;
  _Atomic size_t next;
  _Atomic bool failed;
  pthread_mutex_t lock;
  /* The first copy whose read faulted, and where. */
  const struct copy *fault_copy;
  const void *fault_addr;
};

/* One worker's state, kept across the copies it hashes. */
struct hasher {
  struct hashing *h;
  XXH3_state_t *state;
  uint8_t *buf;
  const struct copy *current;
};

static bool is_replica(const struct plan_key *k) {
  return k->placement == PLAN_REPLICATED || k->placement == PLAN_PLAIN;
}

/* Feeds len bytes at p through the gather buffer. */
static void feed(struct hasher *w, size_t *used, const uint8_t *p, size_t len) {
  if (*used + len > GATHER_BYTES) {
    XXH3_64bits_update(w->state, w->buf, *used);
    *used = 0;
  }
  if (len >= GATHER_BYTES) {
    XXH3_64bits_update(w->state, p, len);
    return;
  }
  memcpy(w->buf + *used, p, len);
  *used += len;
}

/* The digest of a view's elements in row-major order. */
static uint64_t hash_view(struct hasher *w, const uint8_t *data,
                          const struct sp_view *v) {
  XXH3_64bits_reset(w->state);
  size_t es = sp__dtype_size(v->dtype);
  /* Axes of one element go; axes that continue each other merge. */
  int64_t shape[SP_MAX_DIMS], stride[SP_MAX_DIMS];
  uint32_t n = 0;
  for (uint32_t d = 0; d < v->ndim; d++) {
    if (v->shape[d] == 0)
      return XXH3_64bits_digest(w->state);
    if (v->shape[d] == 1)
      continue;
    if (n > 0 && stride[n - 1] == v->shape[d] * v->stride[d]) {
      shape[n - 1] *= v->shape[d];
      stride[n - 1] = v->stride[d];
      continue;
    }
    shape[n] = v->shape[d];
    stride[n] = v->stride[d];
    n++;
  }
  const uint8_t *base = data + (size_t)v->offset * es;
  size_t used = 0;
  if (n == 0) {
    feed(w, &used, base, es);
  } else {
    /* The innermost axis is one run of bytes when it is dense. */
    bool dense = stride[n - 1] == 1;
    int64_t index[SP_MAX_DIMS] = {0};
    for (;;) {
      int64_t off = 0;
      for (uint32_t d = 0; d + 1 < n; d++)
        off += index[d] * stride[d];
      const uint8_t *row = base + (size_t)off * es;
      if (dense)
        feed(w, &used, row, (size_t)shape[n - 1] * es);
      else
        for (int64_t i = 0; i < shape[n - 1]; i++)
          feed(w, &used, row + (size_t)(i * stride[n - 1]) * es, es);
      int d = (int)n - 2;
      while (d >= 0 && ++index[d] == shape[d])
        index[d--] = 0;
      if (d < 0)
        break;
    }
  }
  XXH3_64bits_update(w->state, w->buf, used);
  return XXH3_64bits_digest(w->state);
}

/* Takes copies until none is left; runs under the SIGBUS guard. */
static void hash_copies(void *arg) {
  struct hasher *w = arg;
  struct hashing *h = w->h;
  while (!atomic_load_explicit(&h->failed, memory_order_relaxed)) {
    size_t i = atomic_fetch_add(&h->next, 1);
    if (i >= h->ncopies)
      return;
    const struct copy *c = &h->copies[i];
    w->current = c;
    h->d->digest[(size_t)c->slot * h->d->nkeys + c->key] =
        hash_view(w, c->data, &c->view);
  }
}

static void hasher_run(struct hasher *w) {
  const void *fault = NULL;
  if (xfer_guarded(hash_copies, w, &fault) == 0)
    return;
  struct hashing *h = w->h;
  pthread_mutex_lock(&h->lock);
  if (h->fault_copy == NULL) {
    h->fault_copy = w->current;
    h->fault_addr = fault;
  }
  pthread_mutex_unlock(&h->lock);
  atomic_store(&h->failed, true);
}

static void *hasher_main(void *arg) {
  hasher_run(arg);
  return NULL;
}

static int hasher_init(struct hasher *w, struct hashing *h) {
  *w = (struct hasher){.h = h};
  w->state = XXH3_createState();
  w->buf = malloc(GATHER_BYTES);
  return w->state != NULL && w->buf != NULL ? 0 : SP_ENOMEM;
}

static void hasher_free(struct hasher *w) {
  XXH3_freeState(w->state);
  free(w->buf);
}

void replicas_free(struct replica_digests *d) {
  free(d->keys);
  free(d->ranks);
  free(d->digest);
  memset(d, 0, sizeof *d);
}

/* Lists the copies: every replicated or plain key's view on every local
 * rank, found by name in that rank's registrations. */
static int list_copies(const struct plan *plan, const struct plan_input *in,
                       const struct xfer_storage *const *src,
                       struct replica_digests *d, struct hashing *h) {
  h->copies = calloc(d->nkeys * d->nranks + 1, sizeof *h->copies);
  uint32_t *slot_of = calloc(plan->nkeys + 1, sizeof *slot_of);
  if (h->copies == NULL || slot_of == NULL) {
    free(slot_of);
    return SP_ENOMEM;
  }
  for (size_t i = 0; i < d->nkeys; i++)
    slot_of[d->keys[i]] = (uint32_t)i + 1;
  for (uint32_t j = 0; j < d->nranks; j++) {
    const struct plan_rank_in *r = NULL;
    for (size_t x = 0; x < in->nranks && r == NULL; x++)
      if (in->ranks[x].rank == d->ranks[j])
        r = &in->ranks[x];
    for (size_t k = 0; r != NULL && k < r->nentries; k++) {
      struct plan_key_in e;
      uint32_t p = plan_find_key(plan, in->keys[r->entries[k].key].name);
      if (p == PLAN_NONE || slot_of[p] == 0)
        continue;
      plan_input_holding(in, r, &r->entries[k], &e);
      h->copies[h->ncopies++] =
          (struct copy){.data = src[d->ranks[j]][e.storage].data,
                        .view = e.view,
                        .name = e.name,
                        .key = slot_of[p] - 1,
                        .slot = j};
    }
  }
  free(slot_of);
  return 0;
}

/* Hashes the listed copies on up to threads threads, this one included. */
static int hash_all(struct hashing *h, uint32_t threads, uint32_t *fault_rank,
                    const char **fault_key) {
  struct hasher workers[64];
  uint32_t want = threads < 1 ? 1 : threads > 64 ? 64 : threads;
  if ((size_t)want > h->ncopies)
    want = h->ncopies > 0 ? (uint32_t)h->ncopies : 1;
  uint32_t made = 0, spawned = 0;
  int rc = 0;
  for (; made < want && rc == 0; made++)
    rc = hasher_init(&workers[made], h);
  pthread_t tids[64];
  for (uint32_t t = 1; rc == 0 && t < made; t++) {
    if (xfer_spawn(&tids[t], hasher_main, &workers[t]) != 0)
      break;
    spawned++;
  }
  if (rc == 0)
    hasher_run(&workers[0]);
  for (uint32_t t = 1; t <= spawned; t++)
    pthread_join(tids[t], NULL);
  for (uint32_t t = 0; t < made; t++)
    hasher_free(&workers[t]);
  if (rc == 0 && h->fault_copy != NULL) {
    *fault_rank = h->d->ranks[h->fault_copy->slot];
    *fault_key = h->fault_copy->name;
    rc = SP_EBADFD;
  }
  return rc;
}

/* Whether the key's copies are compared: replicated and plain keys whose
 * copies are host memory. */
static bool compared(const struct plan_key *k) {
  return is_replica(k) && k->device_type == SP_DEVICE_CPU;
}

uint32_t replicas_key_at(const struct plan *plan, size_t n) {
  for (size_t k = 0; k < plan->nkeys; k++)
    if (compared(&plan->keys[k]) && n-- == 0)
      return (uint32_t)k;
  return PLAN_NONE;
}

int replicas_hash(const struct plan *plan, const struct plan_input *in,
                  const struct xfer_storage *const *src, uint32_t threads,
                  struct replica_digests *out, char *msg, size_t msglen) {
  struct replica_digests *d = out;
  memset(d, 0, sizeof *d);
  /* One rank alone has nothing to compare with. */
  if (plan->world < 2)
    return 0;
  for (size_t k = 0; k < plan->nkeys; k++)
    d->nkeys += compared(&plan->keys[k]);
  for (uint32_t r = 0; r < plan->world; r++)
    d->nranks += src[r] != NULL;
  if (d->nkeys == 0 || d->nranks == 0) {
    d->nkeys = d->nranks = 0;
    return 0;
  }
  d->keys = malloc(d->nkeys * sizeof *d->keys);
  d->ranks = malloc(d->nranks * sizeof *d->ranks);
  d->digest = calloc(d->nkeys * d->nranks, sizeof *d->digest);
  if (d->keys == NULL || d->ranks == NULL || d->digest == NULL) {
    replicas_free(d);
    return sp__failf(msg, msglen, SP_ENOMEM,
                     "out of memory comparing replicated keys");
  }
  size_t n = 0;
  for (size_t k = 0; k < plan->nkeys; k++)
    if (compared(&plan->keys[k]))
      d->keys[n++] = (uint32_t)k;
  n = 0;
  for (uint32_t r = 0; r < plan->world; r++)
    if (src[r] != NULL)
      d->ranks[n++] = r;

  struct hashing h = {.d = d};
  pthread_mutex_init(&h.lock, NULL);
  uint32_t fault_rank = 0;
  const char *fault_key = "";
  int rc = list_copies(plan, in, src, d, &h);
  if (rc == 0)
    rc = hash_all(&h, threads, &fault_rank, &fault_key);
  pthread_mutex_destroy(&h.lock);
  free(h.copies);
  if (rc == SP_EBADFD)
    rc = sp__failf(msg, msglen, SP_EBADFD,
                   "rank %" PRIu32 "'s copy of key '%s' could not be read "
                   "(was its file truncated after it was registered?)",
                   fault_rank, fault_key);
  else if (rc != 0)
    rc = sp__failf(msg, msglen, rc, "out of memory comparing replicated keys");
  if (rc != 0)
    replicas_free(d);
  return rc;
}

int replicas_refuse(const struct plan *plan, uint32_t key, uint32_t rank_a,
                    uint64_t digest_a, uint32_t rank_b, uint64_t digest_b,
                    size_t more, char *msg, size_t msglen) {
  const struct plan_key *k = &plan->keys[key];
  char others[64] = "";
  if (more > 0)
    snprintf(others, sizeof others, ", and %zu more %s too", more,
             more == 1 ? "rank's" : "ranks'");
  return sp__failf(msg, msglen, SP_EDIFFERENT,
                   "key '%s' (%s): rank %" PRIu32 "'s copy differs from rank "
                   "%" PRIu32 "'s (xxh3 %016" PRIx64 ", rank %" PRIu32
                   "'s %016" PRIx64 ")%s; "
                   "a replicated or plain key must hold the same bytes on "
                   "every rank (a tensor that differs per rank is shard0, "
                   "affine or expert)",
                   k->name, plan_layout_placement_name(k->placement), rank_b,
                   rank_a, digest_b, rank_a, digest_a, others);
}

int replicas_compare(const struct plan *plan, const struct replica_digests *d,
                     char *msg, size_t msglen) {
  for (size_t i = 0; i < d->nkeys; i++) {
    uint64_t first = d->digest[i];
    size_t differ = 0, at = 0;
    for (uint32_t j = 1; j < d->nranks; j++)
      if (d->digest[(size_t)j * d->nkeys + i] != first && differ++ == 0)
        at = j;
    if (differ > 0)
      return replicas_refuse(plan, d->keys[i], d->ranks[0], first, d->ranks[at],
                             d->digest[at * d->nkeys + i], differ - 1, msg,
                             msglen);
  }
  return 0;
}

/* ---- replicas of affine pieces ---- */

bool replicas_merge(uint8_t *image, uint8_t *seen, size_t esz,
                    const uint8_t *src, uint32_t ndim, const int64_t *shape,
                    const int64_t *src_stride, const struct plan_region *dr,
                    int64_t *at) {
  int64_t idx[SP_MAX_DIMS] = {0};
  for (uint32_t d = 0; d < ndim; d++)
    if (shape[d] == 0)
      return true;
  for (;;) {
    int64_t s = 0, t = dr->offset;
    for (uint32_t d = 0; d < ndim; d++) {
      s += idx[d] * src_stride[d];
      t += idx[d] * dr->stride[d];
    }
    uint8_t bit = (uint8_t)(1u << (t & 7));
    if (!(seen[t >> 3] & bit)) {
      memcpy(image + (size_t)t * esz, src + (size_t)s * esz, esz);
      seen[t >> 3] |= bit;
    } else if (memcmp(image + (size_t)t * esz, src + (size_t)s * esz, esz) !=
               0) {
      *at = t;
      return false;
    }
    uint32_t d = ndim;
    while (d > 0 && ++idx[d - 1] == shape[d - 1])
      idx[--d] = 0;
    if (d == 0)
      return true;
  }
}

/* Its strides passed the overlap check (each clears the span of the
 * smaller ones), so dividing greedily by strides from the largest down
 * finds the one index that can match.  Used only to name the rank in a
 * different_data refusal. */
bool replicas_region_contains(const struct plan_region *r, int64_t elem) {
  uint32_t order[SP_MAX_DIMS];
  int64_t rest = elem - r->offset;
  if (rest < 0)
    return false;
  for (uint32_t d = 0; d < r->ndim; d++) {
    if (r->shape[d] == 0)
      return false;
    order[d] = d;
  }
  for (uint32_t i = 1; i < r->ndim; i++)
    for (uint32_t j = i; j > 0 && r->stride[order[j]] > r->stride[order[j - 1]];
         j--) {
      uint32_t t = order[j];
      order[j] = order[j - 1];
      order[j - 1] = t;
    }
  for (uint32_t i = 0; i < r->ndim; i++) {
    uint32_t d = order[i];
    if (r->shape[d] == 1 || r->stride[d] == 0)
      continue;
    int64_t at = rest / r->stride[d];
    if (at >= r->shape[d])
      at = r->shape[d] - 1;
    rest -= at * r->stride[d];
  }
  return rest == 0;
}

int replicas_disagree(const struct plan_key *key, int64_t at, uint32_t earlier,
                      uint32_t later, char *msg, size_t msglen) {
  char where[160];
  plan_refuse_index(key->ndim, key->shape, (uint64_t)at, where, sizeof where);
  return sp__failf(msg, msglen, SP_EDIFFERENT,
                   "key '%s': replicas hold different data at element %s: "
                   "rank %" PRIu32 " and rank %" PRIu32 " disagree",
                   key->name, where, earlier, later);
}
