/*
 * validate.c - cross-rank validation of the gathered metadata.
 *
 * Every check runs on the one gathered metadata, key after key in name
 * order and rank after rank in rank order, and each rank is compared with
 * the key's first holder, never with every other rank: the first failing
 * check is the refusal, the same on every daemon and whichever rank's point
 * of view the metadata was gathered from.
 */
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "shardport.h"
#include "daemon/plan/internal.h"

static const char *device_type_name(uint32_t type) {
  switch (type) {
  case SP_DEVICE_CPU:
    return "cpu";
  case SP_DEVICE_CUDA:
    return "cuda";
  default:
    return "unknown";
  }
}

static void format_shape(char *buf, size_t len, uint32_t ndim,
                         const int64_t *shape) {
  size_t used = (size_t)snprintf(buf, len, "(");
  for (uint32_t d = 0; d < ndim && d < SP_MAX_DIMS && used < len; d++)
    used += (size_t)snprintf(buf + used, len - used, "%s%lld",
                             d > 0 ? ", " : "", (long long)shape[d]);
  if (used < len)
    snprintf(buf + used, len - used, ")");
}

/* Dims past SP_MAX_DIMS are not compared: check_global refuses them. */
static bool shape_equal(uint32_t ndim_a, const int64_t *a, uint32_t ndim_b,
                        const int64_t *b) {
  if (ndim_a != ndim_b)
    return false;
  for (uint32_t d = 0; d < ndim_a && d < SP_MAX_DIMS; d++)
    if (a[d] != b[d])
      return false;
  return true;
}

/* One key's entries, as index.c gathered them, in full form. */
struct key_view {
  const struct plan_index *ix;
  const char *name;
  size_t first;
  size_t n;
  const struct plan_key_in *held; /* [n] */
};

static const struct plan_key_in *kv_entry(const struct key_view *kv, size_t i) {
  return &kv->held[i];
}

static uint32_t kv_rank(const struct key_view *kv, size_t i) {
  return plan_index_rank(kv->ix, kv->first + i);
}

static const struct sp_storage *kv_storage(const struct key_view *kv,
                                           size_t i) {
  return &kv->ix->rank[kv_rank(kv, i)]->storages[kv_entry(kv, i)->storage];
}

/* Names the ranks that list the key and those that do not. */
static int refuse_keyset(const struct key_view *kv, char *msg, size_t msglen) {
  uint32_t world = kv->ix->world;
  uint32_t *missing = malloc((size_t)world * sizeof *missing);
  uint32_t *holders = malloc((kv->n > 0 ? kv->n : 1) * sizeof *holders);
  char have[160], lack[160];
  size_t nmissing = 0, i = 0;

  if (missing == NULL || holders == NULL) {
    free(missing);
    free(holders);
    return sp__failf(msg, msglen, SP_EKEYSET,
                     "key '%s' is registered by %zu of %u ranks", kv->name,
                     kv->n, world);
  }
  for (uint32_t r = 0; r < world; r++) {
    if (i < kv->n && kv_rank(kv, i) == r)
      holders[i++] = r;
    else
      missing[nmissing++] = r;
  }
  plan_refuse_ranks(have, sizeof have, holders, kv->n);
  plan_refuse_ranks(lack, sizeof lack, missing, nmissing);
  free(missing);
  free(holders);
  return sp__failf(msg, msglen, SP_EKEYSET,
                   "key '%s' is registered by %s but not by %s", kv->name, have,
                   lack);
}

static int check_expert(const struct key_view *kv, char *msg, size_t msglen) {
  for (size_t i = 0; i < kv->n; i++)
    if (kv_entry(kv, i)->placement != PLAN_EXPERT)
      for (size_t j = 0; j < kv->n; j++)
        if (kv_entry(kv, j)->placement == PLAN_EXPERT)
          return sp__failf(
              msg, msglen, SP_EPLACEMENT,
              "key '%s' is an expert on rank %u but %s on rank %u", kv->name,
              kv_rank(kv, j),
              plan_layout_placement_name(kv_entry(kv, i)->placement),
              kv_rank(kv, i));
  if (kv->n > 1) {
    uint32_t *ranks = malloc(kv->n * sizeof *ranks);
    char who[160] = "more than one rank";
    if (ranks != NULL) {
      for (size_t i = 0; i < kv->n; i++)
        ranks[i] = kv_rank(kv, i);
      plan_refuse_ranks(who, sizeof who, ranks, kv->n);
      free(ranks);
    }
    return sp__failf(msg, msglen, SP_EEXPERT,
                     "expert key '%s' is held by %s; an expert must be "
                     "held by one rank",
                     kv->name, who);
  }
  return 0;
}

/* Every rank against the first holder. */
static int check_agreement(const struct key_view *kv, char *msg,
                           size_t msglen) {
  const struct plan_key_in *e0 = kv_entry(kv, 0);
  uint32_t r0 = kv_rank(kv, 0);

  for (size_t i = 1; i < kv->n; i++) {
    const struct plan_key_in *e = kv_entry(kv, i);
    uint32_t r = kv_rank(kv, i);
    if (e->placement != e0->placement)
      return sp__failf(msg, msglen, SP_EPLACEMENT,
                       "key '%s' is %s on rank %u but %s on rank %u", kv->name,
                       plan_layout_placement_name(e0->placement), r0,
                       plan_layout_placement_name(e->placement), r);
    if (e->view.dtype != e0->view.dtype)
      return sp__failf(msg, msglen, SP_EDTYPEMISMATCH,
                       "key '%s' is %s on rank %u but %s on rank %u", kv->name,
                       sp__dtype_name(e0->view.dtype), r0,
                       sp__dtype_name(e->view.dtype), r);
    if (e->device_type != e0->device_type)
      return sp__failf(msg, msglen, SP_EDEVICEMISMATCH,
                       "key '%s' is declared on %s by rank %u but on %s by "
                       "rank %u",
                       kv->name, device_type_name(e0->device_type), r0,
                       device_type_name(e->device_type), r);
    if (!shape_equal(e->ndim, e->shape, e0->ndim, e0->shape)) {
      char a[128], b[128];
      format_shape(a, sizeof a, e0->ndim, e0->shape);
      format_shape(b, sizeof b, e->ndim, e->shape);
      return sp__failf(msg, msglen, SP_ESHAPE,
                       "key '%s' has global shape %s on rank %u but %s on "
                       "rank %u",
                       kv->name, a, r0, b, r);
    }
  }
  return 0;
}

static int check_global(const struct key_view *kv, struct plan_key *out,
                        char *msg, size_t msglen) {
  const struct plan_key_in *e0 = kv_entry(kv, 0);
  uint64_t numel;

  if (sp__dtype_size(e0->view.dtype) == 0)
    return sp__failf(msg, msglen, SP_EDTYPE, "key '%s' has no known dtype",
                     kv->name);
  if (e0->device_type >= SP_DEVICE_TYPE_COUNT)
    return sp__failf(msg, msglen, SP_EINVAL,
                     "key '%s' is declared on unknown device type %u", kv->name,
                     e0->device_type);
  if (e0->ndim > SP_MAX_DIMS)
    return sp__failf(msg, msglen, SP_EINVAL,
                     "key '%s' has %u dims, more than %d", kv->name, e0->ndim,
                     SP_MAX_DIMS);
  if (sp__view_numel(e0->ndim, e0->shape, &numel) != 0 ||
      __builtin_mul_overflow(numel, sp__dtype_size(e0->view.dtype),
                             &out->nbytes))
    return sp__failf(msg, msglen, SP_EOVERFLOW,
                     "key '%s' has a negative or overflowing global shape",
                     kv->name);
  return 0;
}

static int check_entries(const struct key_view *kv, char *msg, size_t msglen) {
  uint32_t first_type = PLAN_NONE;
  uint32_t first_rank = 0;

  for (size_t i = 0; i < kv->n; i++) {
    const struct plan_key_in *e = kv_entry(kv, i);
    uint32_t r = kv_rank(kv, i);
    const struct sp_storage *s;
    uint64_t nbytes;
    char why[192];
    int rc;
    if (e->storage >= kv->ix->rank[r]->nstorages)
      return sp__failf(msg, msglen, SP_ENOSTORAGE,
                       "key '%s' on rank %u names storage %u of %zu", kv->name,
                       r, e->storage, kv->ix->rank[r]->nstorages);
    s = kv_storage(kv, i);
    rc = sp__view_check(&e->view, s->nbytes, why, sizeof why);
    if (rc != 0)
      return sp__failf(msg, msglen, rc, "key '%s' on rank %u: %s", kv->name, r,
                       why);
    if (sp__view_nbytes(&e->view, &nbytes) != 0 || nbytes != e->nbytes)
      return sp__failf(msg, msglen, SP_EBYTES,
                       "key '%s': rank %u reports %llu bytes but its view "
                       "holds %llu",
                       kv->name, r, (unsigned long long)e->nbytes,
                       (unsigned long long)nbytes);
    if (s->device.type >= SP_DEVICE_TYPE_COUNT)
      return sp__failf(msg, msglen, SP_EINVAL,
                       "key '%s' on rank %u: storage %u is on unknown "
                       "device type %u",
                       kv->name, r, e->storage, s->device.type);
    /* A round's transfers cannot mix devices, so a key whose holdings sit
     * on two device types (a CPU-offloaded shard beside GPU ones) is
     * refused before anything moves. */
    if (first_type == PLAN_NONE) {
      first_type = s->device.type;
      first_rank = r;
    } else if (s->device.type != first_type) {
      return sp__failf(msg, msglen, SP_EMIXEDDEVICE,
                       "key '%s' is held on %s by rank %u but on %s by "
                       "rank %u",
                       kv->name, device_type_name(first_type), first_rank,
                       device_type_name(s->device.type), r);
    }
  }
  return 0;
}

static int check_whole(const struct key_view *kv, char *msg, size_t msglen) {
  const struct plan_key_in *e0 = kv_entry(kv, 0);

  for (size_t i = 0; i < kv->n; i++) {
    const struct plan_key_in *e = kv_entry(kv, i);
    if (!shape_equal(e->view.ndim, e->view.shape, e0->ndim, e0->shape)) {
      char held[128], global[128];
      format_shape(held, sizeof held, e->view.ndim, e->view.shape);
      format_shape(global, sizeof global, e0->ndim, e0->shape);
      return sp__failf(msg, msglen, SP_ESHAPE,
                       "key '%s' is %s but rank %u holds shape %s, not the "
                       "global shape %s",
                       kv->name, plan_layout_placement_name(e0->placement),
                       kv_rank(kv, i), held, global);
    }
  }
  return 0;
}

static int check_shard0(const struct key_view *kv, char *msg, size_t msglen) {
  const struct plan_key_in *e0 = kv_entry(kv, 0);
  uint64_t rows = 0;

  if (e0->ndim == 0)
    return sp__failf(msg, msglen, SP_EUNSUPPORTED,
                     "key '%s' is a 0-d tensor and cannot be sharded along "
                     "dim 0",
                     kv->name);
  for (size_t i = 0; i < kv->n; i++) {
    const struct plan_key_in *e = kv_entry(kv, i);
    if (e->view.ndim != e0->ndim ||
        memcmp(&e->view.shape[1], &e0->shape[1],
               (e0->ndim - 1) * sizeof e0->shape[0]) != 0) {
      char held[128], global[128];
      format_shape(held, sizeof held, e->view.ndim, e->view.shape);
      format_shape(global, sizeof global, e0->ndim, e0->shape);
      return sp__failf(msg, msglen, SP_ETILING,
                       "key '%s': rank %u's shard has shape %s, which is no "
                       "dim-0 slice of %s",
                       kv->name, kv_rank(kv, i), held, global);
    }
    /* Each shard's rows are below 2^63, and there are fewer than 2^32
     * shards, but the sum is still checked. */
    if (__builtin_add_overflow(rows, (uint64_t)e->view.shape[0], &rows))
      return sp__failf(msg, msglen, SP_EOVERFLOW,
                       "key '%s': its shards' rows overflow", kv->name);
  }
  if (rows != (uint64_t)e0->shape[0])
    return sp__failf(msg, msglen, SP_ETILING,
                     "key '%s': the dim-0 shards of ranks 0 to %u hold "
                     "%llu rows but the global shape has %lld",
                     kv->name, kv->ix->world - 1, (unsigned long long)rows,
                     (long long)e0->shape[0]);
  return 0;
}

static int check_affine(const struct key_view *kv, char *msg, size_t msglen) {
  const struct plan_key_in *e0 = kv_entry(kv, 0);
  struct affine_shard *shards;
  struct affine_map map;
  int rc;

  for (size_t i = 0; i < kv->n; i++)
    if (!sp__view_is_contiguous(&kv_entry(kv, i)->view))
      return sp__failf(msg, msglen, SP_EUNSUPPORTED,
                       "key '%s': rank %u's affine shard is not "
                       "contiguous",
                       kv->name, kv_rank(kv, i));
  shards = calloc(kv->n, sizeof *shards);
  if (shards == NULL)
    return sp__failf(msg, msglen, SP_ENOMEM, "out of memory");
  /* A dense key has one entry per rank, in rank order. */
  for (size_t i = 0; i < kv->n; i++) {
    const struct plan_key_in *e = kv_entry(kv, i);
    sp__view_numel(e->view.ndim, e->view.shape, &shards[i].numel);
    shards[i].npieces = e->npieces;
    shards[i].pieces = e->pieces;
  }
  map = (struct affine_map){.key = kv->name,
                            .ndim = e0->ndim,
                            .shape = e0->shape,
                            .nranks = (uint32_t)kv->n,
                            .shards = shards,
                            .stop = kv->ix->stop};
  rc = affine_validate(&map, msg, msglen);
  free(shards);
  return rc;
}

/* The checks of the full form, for a key the fast path could not pass:
 * they decide the refusal, the first failing check in a fixed order. */
static int validate_full(const struct key_view *kv, struct plan_key *out,
                         char *msg, size_t msglen) {
  const struct plan_key_in *e0 = kv_entry(kv, 0);
  bool expert = false;
  int rc;

  for (size_t i = 0; i < kv->n; i++) {
    enum plan_placement p = kv_entry(kv, i)->placement;
    if (p < PLAN_SHARD0 || p > PLAN_AFFINE)
      return sp__failf(msg, msglen, SP_EUNSUPPORTED,
                       "key '%s': rank %u gives it unknown placement %d",
                       kv->name, kv_rank(kv, i), (int)p);
    expert = expert || p == PLAN_EXPERT;
  }
  if (expert)
    rc = check_expert(kv, msg, msglen);
  else if (kv->n != kv->ix->world)
    rc = refuse_keyset(kv, msg, msglen);
  else
    rc = check_agreement(kv, msg, msglen);
  if (rc == 0)
    rc = check_global(kv, out, msg, msglen);
  if (rc == 0)
    rc = check_entries(kv, msg, msglen);
  if (rc != 0)
    return rc;
  switch (e0->placement) {
  case PLAN_SHARD0:
    return check_shard0(kv, msg, msglen);
  case PLAN_AFFINE:
    return check_affine(kv, msg, msglen);
  default:
    return check_whole(kv, msg, msglen);
  }
}

/* The common case, read from the compact entries alone: every rank holds
 * the key through one row of the key table (so they agree), a dense
 * placement, views inside their storages on one device type, and rows that
 * tile (shard0) or are whole.  True when the key passes; false sends it to
 * validate_full, which also names what is wrong.  It may refuse to judge
 * what validate_full passes, never the reverse. */
static bool validate_fast(const struct plan_index *ix, uint32_t k,
                          uint64_t *nbytes) {
  size_t first = ix->first[k], n = ix->first[k + 1] - first;
  const struct plan_entry *e0 = plan_index_entry(ix, first);
  const struct plan_key_decl *d;
  uint64_t numel, row_elems = 1, rows = 0;
  uint32_t size, type = PLAN_NONE;

  if (n != ix->world || e0->storage == PLAN_ENTRY_FULL)
    return false;
  d = &ix->in->keys[e0->key];
  size = sp__dtype_size(d->dtype);
  if ((d->placement != PLAN_SHARD0 && d->placement != PLAN_REPLICATED &&
       d->placement != PLAN_PLAIN) ||
      size == 0 || d->device_type >= SP_DEVICE_TYPE_COUNT ||
      d->ndim > SP_MAX_DIMS || (d->placement == PLAN_SHARD0 && d->ndim == 0) ||
      sp__view_numel(d->ndim, d->shape, &numel) != 0 ||
      __builtin_mul_overflow(numel, size, nbytes))
    return false;
  /* Rows of no element would give a zero stride: validate_full judges. */
  for (uint32_t i = 1; i < d->ndim; i++)
    if (d->shape[i] == 0 ||
        __builtin_mul_overflow(row_elems, (uint64_t)d->shape[i], &row_elems))
      return false;
  for (size_t i = 0; i < n; i++) {
    const struct plan_entry *e = plan_index_entry(ix, first + i);
    const struct plan_rank_in *rank = ix->rank[plan_index_rank(ix, first + i)];
    const struct sp_storage *s;
    uint64_t held, bytes, extent;
    if (e->key != e0->key || e->storage >= rank->nstorages)
      return false;
    s = &rank->storages[e->storage];
    if (type == PLAN_NONE)
      type = s->device.type;
    if (s->device.type != type || type >= SP_DEVICE_TYPE_COUNT)
      return false;
    if (d->ndim == 0) {
      held = 1;
    } else if (__builtin_mul_overflow((uint64_t)e->rows, row_elems, &held) ||
               held > (uint64_t)INT64_MAX) {
      return false;
    }
    if (__builtin_mul_overflow(held, size, &bytes))
      return false;
    extent = held > 0 ? (uint64_t)e->offset + held : 0;
    if (extent > sp__view_whole_elements(s->nbytes, d->dtype))
      return false;
    if (d->placement != PLAN_SHARD0 && d->ndim > 0 &&
        (int64_t)e->rows != d->shape[0])
      return false;
    rows += e->rows;
  }
  return d->placement != PLAN_SHARD0 || rows == (uint64_t)d->shape[0];
}

static void key_fill(const struct plan_index *ix, uint32_t k, bool expert,
                     struct plan_key *out) {
  size_t first = ix->first[k];
  const struct plan_entry *e0 = plan_index_entry(ix, first);
  const struct plan_rank_in *r0 = ix->rank[plan_index_rank(ix, first)];
  const struct plan_key_decl *d = &ix->in->keys[e0->key];

  out->name = ix->name[k];
  out->placement = d->placement;
  out->dtype = d->dtype;
  out->device_type =
      r0->storages[e0->storage == PLAN_ENTRY_FULL ? r0->full[e0->offset].storage
                                                  : e0->storage]
          .device.type;
  out->ndim = d->ndim;
  memset(out->shape, 0, sizeof out->shape);
  memcpy(out->shape, d->shape, d->ndim * sizeof out->shape[0]);
  out->owner = expert ? plan_index_rank(ix, first) : PLAN_NONE;
  out->unit = PLAN_NONE;
  out->alias_of = PLAN_NONE;
  out->round = PLAN_NONE;
  out->held = expert ? plan_index_entry_of(ix, first) : PLAN_NONE;
}

static int validate_key(const struct plan_index *ix, uint32_t k,
                        struct plan_key_in *scratch, struct plan_key *out,
                        char *msg, size_t msglen) {
  struct key_view kv = {ix, ix->name[k], ix->first[k],
                        ix->first[k + 1] - ix->first[k], scratch};
  int rc;

  if (validate_fast(ix, k, &out->nbytes)) {
    key_fill(ix, k, false, out);
    return 0;
  }
  for (size_t i = 0; i < kv.n; i++)
    plan_index_holding(ix, kv.first + i, &scratch[i]);
  rc = validate_full(&kv, out, msg, msglen);
  if (rc == 0)
    key_fill(ix, k, kv_entry(&kv, 0)->placement == PLAN_EXPERT, out);
  return rc;
}

/* Keys are validated in runs of this many, one run per task: each run
 * looks at the stop flag first. */
#define KEYS_PER_TASK 1024u
/* A refusal's sentence, as long as the daemon sends (proto/msg.h). */
#define REFUSAL_BYTES 1025u

struct validate_worker {
  struct plan_key_in *scratch; /* [widest key] */
  size_t failed;               /* its failed task */
  char msg[REFUSAL_BYTES];
};

struct validate_work {
  const struct plan_index *ix;
  struct plan *plan;
  struct validate_worker *workers;
};

static int validate_task(void *ctx, uint32_t worker, size_t task) {
  struct validate_work *vw = ctx;
  struct validate_worker *w = &vw->workers[worker];
  size_t end = (task + 1) * KEYS_PER_TASK;
  int rc = plan_check_stop(vw->ix->stop, w->msg, sizeof w->msg);

  if (end > vw->ix->nkeys)
    end = vw->ix->nkeys;
  for (size_t k = task * KEYS_PER_TASK; rc == 0 && k < end; k++)
    rc = validate_key(vw->ix, (uint32_t)k, w->scratch, &vw->plan->keys[k],
                      w->msg, sizeof w->msg);
  if (rc != 0)
    w->failed = task;
  return rc;
}

/* Keys in runs on plan->threads threads; the refusal is the first failing
 * key's in name order, as on one thread: the failed run of lowest index
 * (workers.c) is the one that holds it. */
int plan_validate_keys(const struct plan_index *ix, struct plan *plan,
                       char *msg, size_t msglen) {
  size_t widest = 1, tasks = (ix->nkeys + KEYS_PER_TASK - 1) / KEYS_PER_TASK;
  uint32_t nworkers = plan_workers_count(plan->threads, tasks);
  struct validate_work vw = {ix, plan, calloc(nworkers, sizeof *vw.workers)};
  int rc = vw.workers == NULL ? SP_ENOMEM : 0;

  for (size_t k = 0; k < ix->nkeys; k++)
    if (ix->first[k + 1] - ix->first[k] > widest)
      widest = ix->first[k + 1] - ix->first[k];
  for (uint32_t t = 0; rc == 0 && t < nworkers; t++) {
    vw.workers[t].scratch = malloc(widest * sizeof *vw.workers[t].scratch);
    vw.workers[t].failed = SIZE_MAX;
    rc = vw.workers[t].scratch == NULL ? SP_ENOMEM : 0;
  }
  if (rc != 0) {
    rc = sp__failf(msg, msglen, SP_ENOMEM, "out of memory");
  } else {
    rc = plan_workers_run(plan->threads, tasks, validate_task, &vw);
    const struct validate_worker *first = NULL;
    for (uint32_t t = 0; rc != 0 && t < nworkers; t++)
      if (first == NULL || vw.workers[t].failed < first->failed)
        first = &vw.workers[t];
    if (rc != 0)
      sp__failf(msg, msglen, rc, "%s", first->msg);
  }
  for (uint32_t t = 0; vw.workers != NULL && t < nworkers; t++)
    free(vw.workers[t].scratch);
  free(vw.workers);
  return rc;
}

static int u32_cmp(const void *pa, const void *pb) {
  uint32_t a = *(const uint32_t *)pa, b = *(const uint32_t *)pb;
  return a < b ? -1 : a > b;
}

static int group_cmp(const void *pa, const void *pb) {
  const struct plan_group_keys *a = pa, *b = pb;
  for (size_t i = 0; i < a->nkeys && i < b->nkeys; i++)
    if (a->keys[i] != b->keys[i])
      return a->keys[i] < b->keys[i] ? -1 : 1;
  return a->nkeys < b->nkeys ? -1 : a->nkeys > b->nkeys;
}

void plan_groups_free(struct plan_groups *groups) {
  free(groups->keys);
  free(groups->groups);
  memset(groups, 0, sizeof *groups);
}

/* rank's groups in canonical form, so that two ranks listing the same
 * groups in another order agree. */
static int canon_build(const struct plan_index *ix, const struct plan *plan,
                       uint32_t r, struct plan_groups *out, char *msg,
                       size_t msglen) {
  const struct plan_rank_in *rank = ix->rank[r];
  size_t total = 0, at = 0, ng = 0;

  memset(out, 0, sizeof *out);
  for (size_t g = 0; g < rank->ngroups; g++)
    if (__builtin_add_overflow(total, rank->groups[g].nkeys, &total))
      return sp__failf(msg, msglen, SP_EOVERFLOW,
                       "rank %u's together-groups overflow", r);
  out->keys = malloc((total > 0 ? total : 1) * sizeof *out->keys);
  out->groups =
      malloc((rank->ngroups > 0 ? rank->ngroups : 1) * sizeof *out->groups);
  if (out->keys == NULL || out->groups == NULL) {
    plan_groups_free(out);
    return sp__failf(msg, msglen, SP_ENOMEM, "out of memory");
  }
  for (size_t g = 0; g < rank->ngroups; g++) {
    size_t start = at, n = 0;
    for (size_t j = 0; j < rank->groups[g].nkeys; j++) {
      const char *name = rank->groups[g].keys[j];
      uint32_t k = name != NULL ? plan_index_find(ix, name) : PLAN_NONE;
      if (k == PLAN_NONE || plan->keys[k].placement == PLAN_EXPERT) {
        plan_groups_free(out);
        return sp__failf(msg, msglen, SP_EGROUPS,
                         "rank %u's together-group %zu names %s '%s'", r, g,
                         k == PLAN_NONE ? "unregistered key" : "expert key",
                         name != NULL ? name : "(null)");
      }
      out->keys[at++] = k;
    }
    qsort(out->keys + start, at - start, sizeof *out->keys, u32_cmp);
    for (size_t j = start; j < at; j++)
      if (n == 0 || out->keys[start + n - 1] != out->keys[j])
        out->keys[start + n++] = out->keys[j];
    at = start + n;
    /* A group of one key asks for nothing. */
    if (n > 1)
      out->groups[ng++] = (struct plan_group_keys){out->keys + start, n};
    else
      at = start;
  }
  qsort(out->groups, ng, sizeof *out->groups, group_cmp);
  out->ngroups = 0;
  for (size_t g = 0; g < ng; g++)
    if (out->ngroups == 0 ||
        group_cmp(&out->groups[out->ngroups - 1], &out->groups[g]) != 0)
      out->groups[out->ngroups++] = out->groups[g];
  return 0;
}

int plan_validate_groups(const struct plan_index *ix, const struct plan *plan,
                         struct plan_groups *out, char *msg, size_t msglen) {
  int rc = canon_build(ix, plan, 0, out, msg, msglen);

  for (uint32_t r = 1; rc == 0 && r < ix->world; r++) {
    struct plan_groups other;
    size_t g = 0;
    rc = canon_build(ix, plan, r, &other, msg, msglen);
    if (rc != 0)
      break;
    while (g < out->ngroups && g < other.ngroups &&
           group_cmp(&out->groups[g], &other.groups[g]) == 0)
      g++;
    if (g < out->ngroups || g < other.ngroups) {
      const struct plan_groups *at = g < out->ngroups ? out : &other;
      rc = sp__failf(msg, msglen, SP_EGROUPS,
                     "ranks 0 and %u disagree on the together-groups: the "
                     "group of key '%s' differs",
                     r, plan->keys[at->groups[g].keys[0]].name);
    }
    plan_groups_free(&other);
  }
  if (rc != 0)
    plan_groups_free(out);
  return rc;
}
