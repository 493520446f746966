/*
 * moves.c - what each key needs once it has an owner, and the moves that
 * carry it there.
 *
 * A key whose owner already holds it whole is identity: the owner publishes
 * its own storage and nothing is copied (seed 004).  That is every
 * replicated, plain and expert key, and a shard0 key whose owner holds all
 * the rows.  A key with no elements is created by its owner.  A shard0 key
 * moves one box per non-empty shard, to rows [start, start + rows) of the
 * owner's row-major tensor, start being the rows of the ranks before; an
 * affine key moves one box per non-empty piece, replicas included, so the
 * owner can compare them.
 */
#include <string.h>

#include "shardport.h"
#include "daemon/plan/internal.h"

_Static_assert(sizeof(struct plan_move) == 48, "a move is 48 bytes (plan.h)");

static uint64_t piece_numel(const struct affine_piece *p) {
  uint64_t numel = 0;
  sp__view_numel(p->ndim, p->shape, &numel);
  return numel;
}

/* Rows of the entry in slot: dim 0 of its view. */
static uint64_t rows_of(const struct plan_index *ix, size_t slot) {
  const struct plan_key_in *full = plan_index_full(ix, slot);
  if (full != NULL)
    return full->view.ndim > 0 ? (uint64_t)full->view.shape[0] : 0;
  return plan_index_entry(ix, slot)->rows;
}

int plan_moves_classify(const struct plan_index *ix, struct plan *plan,
                        char *msg, size_t msglen) {
  for (uint32_t k = 0; k < plan->nkeys; k++) {
    struct plan_key *key = &plan->keys[k];
    size_t first = ix->first[k];
    uint32_t size = sp__dtype_size(key->dtype);

    if (key->placement == PLAN_EXPERT) {
      key->kind = PLAN_KEY_IDENTITY;
      continue;
    }
    if (key->alias_of != PLAN_NONE) {
      key->kind = PLAN_KEY_ALIAS;
      continue;
    }
    /* Dense keys have one entry per rank, in rank order. */
    switch (key->placement) {
    case PLAN_SHARD0:
      if (key->nbytes == 0) {
        key->kind = PLAN_KEY_EMPTY;
      } else if (rows_of(ix, first + key->owner) == (uint64_t)key->shape[0]) {
        key->kind = PLAN_KEY_IDENTITY;
        key->held = plan_index_entry_of(ix, first + key->owner);
      } else {
        key->kind = PLAN_KEY_MOVE;
        key->traffic = key->nbytes;
      }
      break;
    case PLAN_AFFINE:
      key->kind = key->nbytes == 0 ? PLAN_KEY_EMPTY : PLAN_KEY_MOVE;
      for (size_t slot = first; key->nbytes > 0 && slot < ix->first[k + 1];
           slot++) {
        /* Affine holdings are always kept in full. */
        const struct plan_key_in *e = plan_index_full(ix, slot);
        for (size_t pi = 0; pi < e->npieces; pi++) {
          uint64_t bytes = piece_numel(&e->pieces[pi]) * size;
          if (__builtin_add_overflow(key->traffic, bytes, &key->traffic))
            return sp__failf(msg, msglen, SP_EOVERFLOW,
                             "key '%s': its pieces' bytes overflow", key->name);
        }
      }
      break;
    default:
      key->kind = PLAN_KEY_IDENTITY;
      key->held = plan_index_entry_of(ix, first + key->owner);
      break;
    }
  }
  return 0;
}

size_t plan_moves_of_key(const struct plan_index *ix, const struct plan *plan,
                         uint32_t k, struct plan_move *out) {
  const struct plan_key *key = &plan->keys[k];
  uint32_t size = sp__dtype_size(key->dtype);
  uint64_t row_elems = 1, row = 0;
  size_t count = 0;

  for (uint32_t d = 1; d < key->ndim; d++)
    row_elems *= (uint64_t)key->shape[d];
  for (size_t slot = ix->first[k]; slot < ix->first[k + 1]; slot++) {
    const struct plan_key_in *full = plan_index_full(ix, slot);
    uint32_t src = plan_index_rank(ix, slot);
    uint32_t entry = plan_index_entry_of(ix, slot);
    if (key->placement == PLAN_SHARD0) {
      uint64_t rows = rows_of(ix, slot);
      if (rows > 0 && out != NULL)
        out[count] = (struct plan_move){
            .key = k,
            .src = src,
            .dst = key->owner,
            .storage = full != NULL ? full->storage
                                    : plan_index_entry(ix, slot)->storage,
            .entry = entry,
            .nbytes = full != NULL ? full->nbytes : rows * row_elems * size,
            .dst_offset = row * row_elems};
      count += rows > 0;
      row += rows;
      continue;
    }
    for (size_t pi = 0; pi < full->npieces; pi++) {
      const struct affine_piece *p = &full->pieces[pi];
      uint64_t numel = piece_numel(p);
      if (numel > 0 && out != NULL)
        out[count] =
            (struct plan_move){.key = k,
                               .src = src,
                               .dst = key->owner,
                               .piece = (uint32_t)pi,
                               .flags = p->nholders > 1 ? PLAN_MOVE_REPLICA : 0,
                               .storage = full->storage,
                               .entry = entry,
                               .nbytes = numel * size,
                               .dst_offset = (uint64_t)p->dst_offset};
      count += numel > 0;
    }
  }
  return count;
}

void plan_moves_regions(const struct plan *plan, const struct plan_move *move,
                        struct sp_view *src, struct plan_region *dst) {
  const struct plan_key *key = &plan->keys[move->key];
  struct plan_key_in held;
  const struct plan_key_in *e = &held;

  plan_entry_holding(plan, move->src, move->entry, &held);
  memset(dst, 0, sizeof *dst);
  if (key->placement == PLAN_SHARD0) {
    int64_t stride = 1;
    *src = e->view;
    dst->ndim = key->ndim;
    for (uint32_t d = key->ndim; d-- > 0;) {
      dst->shape[d] = e->view.shape[d];
      dst->stride[d] = stride;
      stride *= key->shape[d];
    }
    dst->offset = (int64_t)move->dst_offset;
    return;
  }
  const struct affine_piece *p = &e->pieces[move->piece];
  memset(src, 0, sizeof *src);
  src->dtype = key->dtype;
  src->ndim = p->ndim;
  src->offset = e->view.offset + p->src_offset;
  dst->ndim = p->ndim;
  dst->offset = p->dst_offset;
  for (uint32_t d = 0; d < p->ndim; d++) {
    src->shape[d] = dst->shape[d] = p->shape[d];
    src->stride[d] = p->src_stride[d];
    dst->stride[d] = p->dst_stride[d];
  }
}
