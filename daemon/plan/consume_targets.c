/*
 * consume_targets.c - every consumer's targets checked against the
 * trainers' keys and their own storages, and turned into the boxes each
 * consumer receives.
 *
 * The checks run consumer after consumer in index order and, within one,
 * target after target in key name order; the shard tiling then runs key
 * after key.  The first failing check is the refusal, so it is the same
 * whatever order consumers and targets arrive in.
 */
#include <stdlib.h>
#include <string.h>

#include "shardport.h"
#include "daemon/plan/consume_internal.h"

/* One target of one consumer. */
struct ref {
  uint32_t key;
  uint32_t consumer;
  const struct consume_target *t;
};

static int ref_by_name(const void *pa, const void *pb) {
  const struct ref *a = pa, *b = pb;
  return strcmp(a->t->key, b->t->key);
}

static int ref_by_key(const void *pa, const void *pb) {
  const struct ref *a = pa, *b = pb;
  if (a->key != b->key)
    return a->key < b->key ? -1 : 1;
  return a->consumer < b->consumer ? -1 : a->consumer > b->consumer;
}

static int index_consumers(const struct consume_input *in,
                           const struct consume_in **by_index, char *msg,
                           size_t msglen) {
  uint32_t outside = PLAN_NONE, twice = PLAN_NONE;

  if (in->nconsumers == 0)
    return sp__failf(msg, msglen, SP_ERANK,
                     "a push needs at least one consumer");
  if (in->nconsumer_in != in->nconsumers)
    return sp__failf(msg, msglen, SP_ERANK,
                     "%zu consumers joined a job of %u consumers",
                     in->nconsumer_in, in->nconsumers);
  for (size_t i = 0; i < in->nconsumer_in; i++) {
    uint32_t c = in->consumers[i].index;
    if (c >= in->nconsumers) {
      outside = c < outside ? c : outside;
    } else if (by_index[c] != NULL) {
      twice = c < twice ? c : twice;
    } else {
      by_index[c] = &in->consumers[i];
    }
  }
  if (outside != PLAN_NONE)
    return sp__failf(msg, msglen, SP_ERANK,
                     "consumer %u is outside the job's %u consumers", outside,
                     in->nconsumers);
  if (twice != PLAN_NONE)
    return sp__failf(msg, msglen, SP_ERANK, "consumer %u joined twice", twice);
  return 0;
}

static const char *device_type_name(uint32_t type) {
  return type == SP_DEVICE_CUDA ? "cuda" : "cpu";
}

/* One destination view in one of the consumer's storages. */
static int check_dest(const struct plan_key *key, const struct consume_in *c,
                      const struct consume_target *t, uint32_t storage,
                      const struct sp_view *view, char *msg, size_t msglen) {
  const struct consume_storage *s;
  char why[192];
  int rc;

  if (storage >= c->nstorages)
    return sp__failf(msg, msglen, SP_ENOSTORAGE,
                     "consumer %u's target for key '%s' names storage %u of "
                     "%zu",
                     c->index, key->name, storage, c->nstorages);
  s = &c->storages[storage];
  if (s->device.type != key->device_type)
    return sp__failf(msg, msglen, SP_EDEVICEMISMATCH,
                     "consumer %u wants key '%s' on %s but the trainers hold "
                     "it on %s",
                     c->index, key->name, device_type_name(s->device.type),
                     device_type_name(key->device_type));
  if (view->dtype != t->dtype)
    return sp__failf(msg, msglen, SP_EDTYPEMISMATCH,
                     "consumer %u's target for key '%s' is %s but a view of "
                     "it is %s",
                     c->index, key->name, sp__dtype_name(t->dtype),
                     sp__dtype_name(view->dtype));
  if (view->ndim != key->ndim)
    return sp__failf(msg, msglen, SP_ESHAPE,
                     "consumer %u's view for key '%s' has %u dims, the key %u",
                     c->index, key->name, view->ndim, key->ndim);
  rc = sp__view_check(view, s->nbytes, why, sizeof why);
  if (rc != 0)
    return sp__failf(msg, msglen, rc, "consumer %u's target for key '%s': %s",
                     c->index, key->name, why);
  return 0;
}

static int check_pieces(const struct plan_key *key, const struct consume_in *c,
                        const struct consume_target *t, char *msg,
                        size_t msglen) {
  for (size_t i = 0; i < t->npieces; i++) {
    const struct consume_piece *p = &t->pieces[i];
    int rc = check_dest(key, c, t, p->storage, &p->dst, msg, msglen);
    if (rc != 0)
      return rc;
    for (uint32_t d = 0; d < key->ndim; d++) {
      int64_t end;
      if (p->start[d] < 0 ||
          __builtin_add_overflow(p->start[d], p->dst.shape[d], &end) ||
          end > key->shape[d])
        return sp__failf(msg, msglen, SP_EDESTBOUNDS,
                         "consumer %u's piece %zu of key '%s' starts at %lld "
                         "in dim %u and holds %lld, outside the key's %lld",
                         c->index, i, key->name, (long long)p->start[d], d,
                         (long long)p->dst.shape[d], (long long)key->shape[d]);
    }
  }
  return 0;
}

static int check_target(const struct plan_key *key, const struct consume_in *c,
                        const struct consume_target *t, char *msg,
                        size_t msglen) {
  int rc;

  if (t->dtype != key->dtype)
    return sp__failf(msg, msglen, SP_EDTYPEMISMATCH,
                     "consumer %u wants key '%s' as %s but the trainers hold "
                     "%s",
                     c->index, key->name, sp__dtype_name(t->dtype),
                     sp__dtype_name(key->dtype));
  if (t->ndim != key->ndim)
    return sp__failf(msg, msglen, SP_ESHAPE,
                     "consumer %u expects key '%s' with %u dims but the "
                     "trainers' has %u",
                     c->index, key->name, t->ndim, key->ndim);
  for (uint32_t d = 0; d < key->ndim; d++)
    if (t->shape[d] != key->shape[d])
      return sp__failf(msg, msglen, SP_ESHAPE,
                       "consumer %u expects key '%s' with %lld in dim %u but "
                       "the trainers' has %lld",
                       c->index, key->name, (long long)t->shape[d], d,
                       (long long)key->shape[d]);
  switch (t->part) {
  case CONSUME_WHOLE:
  case CONSUME_SHARD:
    if (t->part == CONSUME_SHARD && t->dim >= key->ndim)
      return sp__failf(msg, msglen, SP_EINVAL,
                       "consumer %u shards key '%s' along dim %u of %u",
                       c->index, key->name, t->dim, key->ndim);
    rc = check_dest(key, c, t, t->storage, &t->view, msg, msglen);
    if (rc != 0)
      return rc;
    for (uint32_t d = 0; d < key->ndim; d++)
      if (t->view.shape[d] != key->shape[d] &&
          (t->part == CONSUME_WHOLE || d != t->dim))
        return sp__failf(
            msg, msglen, t->part == CONSUME_WHOLE ? SP_ESHAPE : SP_ETILING,
            "consumer %u's %s of key '%s' has %lld in dim %u, "
            "the key %lld",
            c->index, consume_part_name(t->part), key->name,
            (long long)t->view.shape[d], d, (long long)key->shape[d]);
    return 0;
  case CONSUME_PIECES:
    return check_pieces(key, c, t, msg, msglen);
  default:
    return sp__failf(msg, msglen, SP_EUNSUPPORTED,
                     "consumer %u gives key '%s' unknown part %d", c->index,
                     key->name, (int)t->part);
  }
}

/* Resolves and checks one consumer's targets; refs[0..n) are its own. */
static int check_consumer(const struct consume_trainers *tr,
                          const struct consume_in *c, struct ref *refs,
                          char *msg, size_t msglen) {
  for (size_t i = 0; i < c->ntargets; i++) {
    if (c->targets[i].key == NULL)
      return sp__failf(msg, msglen, SP_EINVAL,
                       "consumer %u lists a target without a key", c->index);
    refs[i] = (struct ref){.consumer = c->index, .t = &c->targets[i]};
  }
  qsort(refs, c->ntargets, sizeof *refs, ref_by_name);
  for (size_t i = 0; i < c->ntargets; i++) {
    const char *name = refs[i].t->key;
    int rc;
    if (i > 0 && strcmp(refs[i - 1].t->key, name) == 0)
      return sp__failf(msg, msglen, SP_EDUPKEY,
                       "consumer %u lists key '%s' twice", c->index, name);
    refs[i].key = plan_index_find(&tr->ix, name);
    if (refs[i].key == PLAN_NONE)
      return sp__failf(msg, msglen, SP_EKEYSET,
                       "consumer %u wants key '%s', which no trainer "
                       "registered",
                       c->index, name);
    rc = check_target(&tr->keys.keys[refs[i].key], c, refs[i].t, msg, msglen);
    if (rc != 0)
      return rc;
  }
  return 0;
}

/* The shards of one key, refs[0..n) in consumer order, tile its dim. */
static int check_tiling(const struct plan_key *key, const struct ref *refs,
                        size_t n, char *msg, size_t msglen) {
  const struct ref *first = NULL;
  uint64_t held = 0;
  size_t nshards = 0;

  for (size_t i = 0; i < n; i++) {
    const struct consume_target *t = refs[i].t;
    if (t->part != CONSUME_SHARD)
      continue;
    if (first == NULL)
      first = &refs[i];
    if (t->dim != first->t->dim)
      return sp__failf(msg, msglen, SP_EPLACEMENT,
                       "key '%s' is sharded along dim %u by consumer %u but "
                       "along dim %u by consumer %u",
                       key->name, first->t->dim, first->consumer, t->dim,
                       refs[i].consumer);
    held += (uint64_t)t->view.shape[t->dim];
    nshards++;
  }
  if (first != NULL && held != (uint64_t)key->shape[first->t->dim])
    return sp__failf(msg, msglen, SP_ETILING,
                     "key '%s': the dim-%u shards of its %zu consumers hold "
                     "%llu but the key has %lld",
                     key->name, first->t->dim, nshards,
                     (unsigned long long)held,
                     (long long)key->shape[first->t->dim]);
  return 0;
}

static size_t boxes_of(const struct consume_target *t) {
  return t->part == CONSUME_PIECES ? t->npieces : 1;
}

/* Writes the boxes of refs[0..n), one key's targets in consumer order. */
static size_t fill_boxes(const struct ref *refs, size_t n,
                         struct consume_box *out) {
  int64_t shard_start = 0;
  size_t at = 0;

  for (size_t i = 0; i < n; i++) {
    const struct consume_target *t = refs[i].t;
    if (t->part == CONSUME_PIECES) {
      for (size_t p = 0; p < t->npieces; p++) {
        out[at] = (struct consume_box){.side = refs[i].consumer,
                                       .storage = t->pieces[p].storage,
                                       .view = t->pieces[p].dst};
        memcpy(out[at].start, t->pieces[p].start, sizeof out[at].start);
        at++;
      }
      continue;
    }
    out[at] = (struct consume_box){
        .side = refs[i].consumer, .storage = t->storage, .view = t->view};
    if (t->part == CONSUME_SHARD) {
      out[at].start[t->dim] = shard_start;
      shard_start += t->view.shape[t->dim];
    }
    at++;
  }
  return at;
}

static int gather_wants(const struct consume_trainers *tr, struct ref *refs,
                        size_t nrefs, struct consume_wants *out, char *msg,
                        size_t msglen) {
  size_t nboxes = 0, k = 0;

  qsort(refs, nrefs, sizeof *refs, ref_by_key);
  for (size_t i = 0; i < nrefs; i++) {
    out->nkeys += i == 0 || refs[i].key != refs[i - 1].key;
    if (__builtin_add_overflow(nboxes, boxes_of(refs[i].t), &nboxes))
      return sp__failf(msg, msglen, SP_EOVERFLOW, "too many target pieces");
  }
  out->key = malloc((out->nkeys > 0 ? out->nkeys : 1) * sizeof *out->key);
  out->first = malloc((out->nkeys + 1) * sizeof *out->first);
  out->box = malloc((nboxes > 0 ? nboxes : 1) * sizeof *out->box);
  out->box_key = malloc((nboxes > 0 ? nboxes : 1) * sizeof *out->box_key);
  if (out->key == NULL || out->first == NULL || out->box == NULL ||
      out->box_key == NULL)
    return sp__failf(msg, msglen, SP_ENOMEM, "out of memory");
  out->first[0] = 0;
  for (size_t i = 0; i < nrefs; k++) {
    size_t j = i, nbox;
    int rc;
    while (j < nrefs && refs[j].key == refs[i].key)
      j++;
    rc =
        check_tiling(&tr->keys.keys[refs[i].key], refs + i, j - i, msg, msglen);
    if (rc != 0)
      return rc;
    nbox = fill_boxes(refs + i, j - i, out->box + out->first[k]);
    for (size_t b = 0; b < nbox; b++)
      out->box_key[out->first[k] + b] = refs[i].key;
    out->key[k] = refs[i].key;
    out->first[k + 1] = out->first[k] + nbox;
    i = j;
  }
  return 0;
}

int consume_targets_check(const struct consume_input *in,
                          const struct consume_trainers *tr,
                          const struct consume_in **by_index,
                          struct consume_wants *out, char *msg, size_t msglen) {
  struct ref *refs;
  size_t nrefs = 0, at = 0;
  int rc;

  memset(out, 0, sizeof *out);
  rc = index_consumers(in, by_index, msg, msglen);
  if (rc != 0)
    return rc;
  for (uint32_t c = 0; c < in->nconsumers; c++)
    if (__builtin_add_overflow(nrefs, by_index[c]->ntargets, &nrefs))
      return sp__failf(msg, msglen, SP_EOVERFLOW, "too many targets");
  refs = malloc((nrefs > 0 ? nrefs : 1) * sizeof *refs);
  if (refs == NULL)
    return sp__failf(msg, msglen, SP_ENOMEM, "out of memory");
  for (uint32_t c = 0; c < in->nconsumers && rc == 0; c++) {
    rc = check_consumer(tr, by_index[c], refs + at, msg, msglen);
    at += by_index[c]->ntargets;
  }
  if (rc == 0)
    rc = gather_wants(tr, refs, nrefs, out, msg, msglen);
  free(refs);
  if (rc != 0)
    consume_wants_free(out);
  return rc;
}

void consume_wants_free(struct consume_wants *wants) {
  free(wants->key);
  free(wants->first);
  free(wants->box);
  free(wants->box_key);
  memset(wants, 0, sizeof *wants);
}
