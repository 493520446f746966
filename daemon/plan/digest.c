/*
 * digest.c - a 64-bit hash of a canonical serialization of the plan.
 *
 * Daemons exchange it before moving anything (SP_EDIGEST when they
 * differ).  It covers every decision and every byte layout an engine acts
 * on: keys, owners, units, rounds, buckets and each move's source view and
 * destination region.  Each round is hashed on its own (plan_digest_round,
 * on the thread that built it) and the plan's digest covers the rounds'
 * digests in order, so it does not depend on how many threads planned.
 * Pointers and input order are never hashed, so the same gathered
 * metadata gives the same digest on every daemon.
 */
#include <string.h>

#include "daemon/plan/internal.h"

static void hash_dims(struct plan_hash *h, uint32_t ndim,
                      const int64_t *values) {
  for (uint32_t d = 0; d < ndim; d++)
    plan_hash_u64(h, (uint64_t)values[d]);
}

static void hash_key(struct plan_hash *h, const struct plan *plan, uint32_t k) {
  const struct plan_key *key = &plan->keys[k];

  plan_hash_str(h, key->name);
  plan_hash_u64(h, key->placement);
  plan_hash_u64(h, key->dtype);
  plan_hash_u64(h, key->device_type);
  plan_hash_u64(h, key->ndim);
  hash_dims(h, key->ndim, key->shape);
  plan_hash_u64(h, key->nbytes);
  plan_hash_u64(h, key->traffic);
  plan_hash_u64(h, key->kind);
  plan_hash_u64(h, key->owner);
  plan_hash_u64(h, key->unit);
  plan_hash_u64(h, key->alias_of);
  plan_hash_u64(h, key->round);
  if (key->held != PLAN_NONE) {
    struct plan_key_in held;
    plan_key_holding(plan, k, &held);
    plan_hash_u64(h, held.storage);
    plan_hash_u64(h, held.view.ndim);
    hash_dims(h, held.view.ndim, held.view.shape);
    hash_dims(h, held.view.ndim, held.view.stride);
    plan_hash_u64(h, (uint64_t)held.view.offset);
  }
}

/* A move's layout is hashed from what it is derived from: for a compact
 * entry its offset and rows (its dtype, other dims and strides are the
 * key's, hashed with it), for a full one the source view (shard0; its
 * destination follows from the key's shape and dst_offset) or the piece's
 * strides (affine). */
/* A move's layout is hashed from what it is derived from: for a compact
 * entry its offset and rows (its dtype, other dims and strides are the
 * key's, hashed with it), for a full one the source view (shard0; its
 * destination follows from the key's shape and dst_offset) or the piece's
 * strides (affine).  Fields of 32 bits go two to a word. */
static void hash_move(struct plan_hash *h, const struct plan *plan,
                      const struct plan_move *m) {
  const struct plan_rank_in *rank = plan->rank_in[m->src];
  const struct plan_entry *e = &rank->entries[m->entry];

  plan_hash_u64(h, (uint64_t)m->key << 32 | m->src);
  plan_hash_u64(h, (uint64_t)m->dst << 32 | m->piece);
  plan_hash_u64(h, (uint64_t)m->flags << 32 | m->storage);
  plan_hash_u64(h, m->nbytes);
  plan_hash_u64(h, m->dst_offset);
  plan_hash_u64(h, m->bucket_offset);
  if (e->storage != PLAN_ENTRY_FULL) {
    plan_hash_u64(h, (uint64_t)e->offset << 32 | e->rows);
    return;
  }
  const struct plan_key_in *from = &rank->full[e->offset];
  plan_hash_u64(h, (uint64_t)from->view.offset);
  if (plan->keys[m->key].placement == PLAN_AFFINE) {
    const struct affine_piece *p = &from->pieces[m->piece];
    plan_hash_u64(h, p->ndim);
    hash_dims(h, p->ndim, p->shape);
    plan_hash_u64(h, (uint64_t)p->src_offset);
    hash_dims(h, p->ndim, p->src_stride);
    hash_dims(h, p->ndim, p->dst_stride);
  } else {
    hash_dims(h, from->view.ndim, from->view.shape);
    hash_dims(h, from->view.ndim, from->view.stride);
  }
}

uint64_t plan_digest_round(const struct plan *plan,
                           const struct plan_round *round) {
  struct plan_hash h;

  plan_hash_init(&h);
  plan_hash_u64(&h, round->first);
  plan_hash_u64(&h, round->nkeys);
  plan_hash_u64(&h, round->nbytes);
  plan_hash_u64(&h, round->nbuckets);
  for (size_t b = 0; b < round->nbuckets; b++) {
    const struct plan_bucket *bk = &round->buckets[b];
    plan_hash_u64(&h, (uint64_t)bk->src << 32 | bk->dst);
    plan_hash_u64(&h, (uint64_t)bk->device_type << 32 | (uint32_t)bk->dtype);
    plan_hash_u64(&h, bk->nbytes);
    plan_hash_u64(&h, bk->first);
    plan_hash_u64(&h, bk->nmoves);
  }
  plan_hash_u64(&h, round->nmoves);
  for (size_t i = 0; i < round->nmoves; i++)
    hash_move(&h, plan, &round->moves[i]);
  plan_hash_u64(&h, round->nlocal);
  for (size_t i = 0; i < round->nlocal; i++)
    hash_move(&h, plan, &round->local[i]);
  return plan_hash_final(&h);
}

uint64_t plan_digest_compute(const struct plan *plan) {
  struct plan_hash h;

  plan_hash_init(&h);
  plan_hash_u64(&h, plan->world);
  plan_hash_u64(&h, plan->max_keys);
  plan_hash_u64(&h, plan->max_bytes);
  for (uint32_t r = 0; r < plan->world; r++) {
    plan_hash_u64(&h, plan->node[r]);
    plan_hash_u64(&h, plan->load[r]);
  }
  plan_hash_u64(&h, plan->nkeys);
  for (size_t k = 0; k < plan->nkeys; k++)
    hash_key(&h, plan, (uint32_t)k);
  plan_hash_u64(&h, plan->nunits);
  for (size_t u = 0; u < plan->nunits; u++) {
    plan_hash_u64(&h, plan->units[u].owner);
    plan_hash_u64(&h, plan->units[u].nbytes);
    plan_hash_u64(&h, plan->units[u].nkeys);
    for (size_t i = 0; i < plan->units[u].nkeys; i++)
      plan_hash_u64(&h, plan->unit_keys[plan->units[u].first + i]);
  }
  plan_hash_u64(&h, plan->nrounds);
  for (size_t r = 0; r < plan->nrounds; r++)
    plan_hash_u64(&h, plan->rounds[r].digest);
  return plan_hash_final(&h);
}
