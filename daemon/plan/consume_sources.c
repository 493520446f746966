/*
 * consume_sources.c - the trainers' holdings of a key as the boxes their
 * senders send to consumers from.
 *
 * Each element of a key is sent by one rank, and the ranks share the work:
 *   shard0      every rank its rows (uneven and empty shards as registered);
 *   replicated, plain
 *               every rank holds the whole tensor, so rank r sends the r-th
 *               of `world` near-equal slices of dim 0 (the first
 *               rows % world ranks one row more); a 0-d tensor is sent by
 *               rank 0;
 *   expert      its one holder, the whole tensor;
 *   affine      every piece held by one rank; the pieces held by a set of
 *               ranks (replicas) by one rank of the set, the first at or
 *               after (sum of the set mod world) counting round the world,
 *               so that sets are spread over their holders and every daemon
 *               picks the same one whatever order a rank lists holders in.
 *               Holders may cut one replica at different boundaries, so the
 *               pieces chosen are checked to write every element of the
 *               whole tensor exactly once (cover.c); a layout whose chosen
 *               holders leave a gap is refused.  A piece must also land on
 *               a box of the whole tensor: each of its axes of more than
 *               one element steps one dim (its destination stride is that
 *               dim's row-major stride), no dim twice, and the box fits
 *               inside the shape.  Any other piece is refused.
 *
 * This is the only file of the consumer side that reads the trainers'
 * registrations (layout.h), and holding_of is where it reads them.
 */
#include <stdlib.h>
#include <string.h>

#include "shardport.h"
#include "daemon/plan/consume_internal.h"

/* Entry slot of the index: what its rank holds of the key. */
static void holding_of(const struct plan_index *ix, size_t slot,
                       struct plan_key_in *out) {
  plan_index_holding(ix, slot, out);
}

static void whole_box(const struct plan_key_in *e, uint32_t rank,
                      struct consume_box *out) {
  memset(out, 0, sizeof *out);
  out->side = rank;
  out->storage = e->storage;
  out->view = e->view;
}

/* Rank r's slice of dim 0 of a key every rank holds whole. */
static bool replica_slice(const struct plan_key *key,
                          const struct plan_key_in *e, uint32_t rank,
                          uint32_t world, struct consume_box *out) {
  uint64_t rows, each, extra, start, n;

  whole_box(e, rank, out);
  if (key->ndim == 0)
    return rank == 0;
  rows = (uint64_t)key->shape[0];
  each = rows / world;
  extra = rows % world;
  start = rank * each + (rank < extra ? rank : extra);
  n = each + (rank < extra);
  if (n == 0)
    return false;
  out->start[0] = (int64_t)start;
  out->view.shape[0] = (int64_t)n;
  out->view.offset += (int64_t)start * e->view.stride[0];
  return true;
}

static uint32_t replica_sender(const struct affine_piece *p, uint32_t world) {
  uint64_t sum = 0;
  uint32_t from, best = PLAN_NONE, best_distance = PLAN_NONE;

  for (uint32_t h = 0; h < p->nholders; h++)
    sum += p->holders[h];
  from = (uint32_t)(sum % world);
  for (uint32_t h = 0; h < p->nholders; h++) {
    uint32_t distance = (p->holders[h] + world - from) % world;
    if (distance < best_distance) {
      best_distance = distance;
      best = p->holders[h];
    }
  }
  return best;
}

/* The box an affine piece lands on, or false when it lands on none. */
static bool piece_box(const struct plan_key *key, const struct plan_key_in *e,
                      const struct affine_piece *p, uint32_t rank,
                      struct consume_box *out) {
  int64_t rowmajor[SP_MAX_DIMS];
  bool used[SP_MAX_DIMS] = {false};
  int64_t offset = p->dst_offset;

  memset(out, 0, sizeof *out);
  out->side = rank;
  out->storage = e->storage;
  out->view.dtype = key->dtype;
  out->view.ndim = key->ndim;
  out->view.offset = e->view.offset + p->src_offset;
  for (uint32_t d = key->ndim; d-- > 0;) {
    rowmajor[d] = d + 1 == key->ndim ? 1 : rowmajor[d + 1] * key->shape[d + 1];
    out->view.shape[d] = 1;
  }
  for (uint32_t a = 0; a < p->ndim; a++) {
    uint32_t d = 0;
    if (p->shape[a] == 1)
      continue;
    /* Dims of one element share the stride of the dim before them; the
     * piece's axis steps the one of more than one element. */
    while (d < key->ndim &&
           (rowmajor[d] != p->dst_stride[a] || key->shape[d] <= 1))
      d++;
    if (d == key->ndim || used[d])
      return false;
    used[d] = true;
    out->view.shape[d] = p->shape[a];
    out->view.stride[d] = p->src_stride[a];
  }
  for (uint32_t d = 0; d < key->ndim; d++) {
    out->start[d] = key->shape[d] > 0 ? offset / rowmajor[d] : 0;
    offset -= out->start[d] * rowmajor[d];
    if (out->start[d] + out->view.shape[d] > key->shape[d])
      return false;
  }
  return true;
}

static bool piece_sent(const struct affine_piece *p, uint32_t rank,
                       uint32_t world) {
  uint64_t numel = 0;

  sp__view_numel(p->ndim, p->shape, &numel);
  return numel > 0 && (p->nholders <= 1 || replica_sender(p, world) == rank);
}

/* The pieces chosen write every element of the whole tensor once. */
static int check_chosen(const struct consume_trainers *tr, uint32_t k, size_t n,
                        char *msg, size_t msglen) {
  const struct plan_index *ix = &tr->ix;
  const struct plan_key *key = &tr->keys.keys[k];
  struct cover_box *boxes = malloc((n > 0 ? n : 1) * sizeof *boxes);
  struct cover_defect defect;
  uint64_t numel = 0;
  size_t at = 0;
  char where[96];
  int rc;

  if (boxes == NULL)
    return sp__failf(msg, msglen, SP_ENOMEM, "out of memory");
  for (size_t slot = ix->first[k]; slot < ix->first[k + 1]; slot++) {
    struct plan_key_in held;
    const struct plan_key_in *e = &held;
    holding_of(ix, slot, &held);
    for (size_t pi = 0; pi < e->npieces; pi++) {
      const struct affine_piece *p = &e->pieces[pi];
      if (piece_sent(p, plan_index_rank(ix, slot), ix->world))
        boxes[at++] = (struct cover_box){.offset = p->dst_offset,
                                         .ndim = p->ndim,
                                         .shape = p->shape,
                                         .stride = p->dst_stride};
    }
  }
  sp__view_numel(key->ndim, key->shape, &numel);
  rc = cover_check(boxes, at, numel, true, ix->stop, &defect, NULL);
  free(boxes);
  if (rc == 0)
    return 0;
  if (rc == SP_ETIMEOUT || rc == SP_ENOMEM)
    return sp__failf(msg, msglen, rc, "%s",
                     rc == SP_ETIMEOUT ? "planning was stopped"
                                       : "out of memory");
  plan_refuse_index(key->ndim, key->shape, defect.element, where, sizeof where);
  return sp__failf(msg, msglen, SP_EUNSUPPORTED,
                   "key '%s': the holders chosen to send its replicas %s "
                   "element %s; consumers need every holder of a replica to "
                   "list all of it",
                   key->name, rc == SP_EUNCOVERED ? "leave out" : "write twice",
                   where);
}

static int affine_sources(const struct consume_trainers *tr, uint32_t k,
                          struct consume_box *out, size_t *n, char *msg,
                          size_t msglen) {
  const struct plan_index *ix = &tr->ix;
  const struct plan_key *key = &tr->keys.keys[k];

  for (size_t slot = ix->first[k]; slot < ix->first[k + 1]; slot++) {
    struct plan_key_in held;
    const struct plan_key_in *e = &held;
    uint32_t rank = plan_index_rank(ix, slot);
    holding_of(ix, slot, &held);
    for (size_t pi = 0; pi < e->npieces; pi++) {
      struct consume_box box;
      if (!piece_sent(&e->pieces[pi], rank, ix->world))
        continue;
      if (!piece_box(key, e, &e->pieces[pi], rank, &box))
        return sp__failf(msg, msglen, SP_EUNSUPPORTED,
                         "key '%s': piece %zu of rank %u lands on no box of "
                         "the whole tensor, which consumers need",
                         key->name, pi, rank);
      if (out != NULL)
        out[*n] = box;
      (*n)++;
    }
  }
  return out != NULL ? 0 : check_chosen(tr, k, *n, msg, msglen);
}

/* Dense keys have one entry per rank, in rank order; an expert one. */
static void dense_sources(const struct consume_trainers *tr, uint32_t k,
                          struct consume_box *out, size_t *n) {
  const struct plan_index *ix = &tr->ix;
  const struct plan_key *key = &tr->keys.keys[k];
  int64_t row = 0;

  for (size_t slot = ix->first[k]; slot < ix->first[k + 1]; slot++) {
    struct plan_key_in held;
    const struct plan_key_in *e = &held;
    uint32_t rank = plan_index_rank(ix, slot);
    struct consume_box box;
    bool sends = true;
    holding_of(ix, slot, &held);
    if (key->placement == PLAN_SHARD0) {
      whole_box(e, rank, &box);
      box.start[0] = row;
      row += e->view.shape[0];
      sends = e->view.shape[0] > 0;
    } else if (key->placement == PLAN_EXPERT) {
      whole_box(e, rank, &box);
    } else {
      sends = replica_slice(key, e, rank, ix->world, &box);
    }
    if (sends && out != NULL)
      out[*n] = box;
    *n += sends;
  }
}

int consume_sources_of_key(const struct consume_trainers *tr, uint32_t k,
                           struct consume_box *out, size_t *n, char *msg,
                           size_t msglen) {
  *n = 0;
  /* No default: a new placement must say here how it is sent. */
  switch (tr->keys.keys[k].placement) {
  case PLAN_AFFINE:
    return affine_sources(tr, k, out, n, msg, msglen);
  case PLAN_SHARD0:
  case PLAN_EXPERT:
  case PLAN_REPLICATED:
  case PLAN_PLAIN:
    dense_sources(tr, k, out, n);
    return 0;
  }
  return sp__failf(msg, msglen, SP_EUNSUPPORTED,
                   "key '%s' has a placement consumers cannot take",
                   tr->keys.keys[k].name);
}
