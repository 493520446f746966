/*
 * consume_digest.c - a 64-bit hash of a canonical serialization of a
 * consume_plan, which daemons compare before moving anything, as they do
 * an export's (digest.c).  It covers every key, round, bucket and move with
 * both of its views; pointers and input order are never hashed.
 */
#include "daemon/plan/consume_internal.h"

static void hash_view(struct plan_hash *h, const struct sp_view *v) {
  plan_hash_u64(h, v->dtype);
  plan_hash_u64(h, v->ndim);
  for (uint32_t d = 0; d < v->ndim; d++) {
    plan_hash_u64(h, (uint64_t)v->shape[d]);
    plan_hash_u64(h, (uint64_t)v->stride[d]);
  }
  plan_hash_u64(h, (uint64_t)v->offset);
}

static void hash_move(struct plan_hash *h, const struct consume_move *m) {
  plan_hash_u64(h, m->key);
  plan_hash_u64(h, m->src);
  plan_hash_u64(h, m->dst);
  plan_hash_u64(h, m->src_storage);
  plan_hash_u64(h, m->dst_storage);
  plan_hash_u64(h, m->device_type);
  hash_view(h, &m->from);
  hash_view(h, &m->to);
  plan_hash_u64(h, m->nbytes);
  plan_hash_u64(h, m->bucket_offset);
}

static void hash_round(struct plan_hash *h, const struct consume_round *round) {
  plan_hash_u64(h, round->first);
  plan_hash_u64(h, round->nkeys);
  plan_hash_u64(h, round->nbytes);
  plan_hash_u64(h, round->nbuckets);
  for (size_t b = 0; b < round->nbuckets; b++) {
    const struct consume_bucket *bk = &round->buckets[b];
    plan_hash_u64(h, bk->src);
    plan_hash_u64(h, bk->dst);
    plan_hash_u64(h, bk->device_type);
    plan_hash_u64(h, bk->dtype);
    plan_hash_u64(h, bk->nbytes);
    plan_hash_u64(h, bk->first);
    plan_hash_u64(h, bk->nmoves);
  }
  plan_hash_u64(h, round->nmoves);
  for (size_t i = 0; i < round->nmoves; i++)
    hash_move(h, &round->moves[i]);
  plan_hash_u64(h, round->nlocal);
  for (size_t i = 0; i < round->nlocal; i++)
    hash_move(h, &round->local[i]);
}

uint64_t consume_digest_compute(const struct consume_plan *plan) {
  struct plan_hash h;

  plan_hash_init(&h);
  plan_hash_u64(&h, plan->world);
  plan_hash_u64(&h, plan->nconsumers);
  plan_hash_u64(&h, plan->max_keys);
  plan_hash_u64(&h, plan->max_bytes);
  for (uint32_t r = 0; r < plan->world; r++)
    plan_hash_u64(&h, plan->rank_node[r]);
  for (uint32_t c = 0; c < plan->nconsumers; c++) {
    plan_hash_u64(&h, plan->consumer_node[c]);
    plan_hash_u64(&h, plan->received[c]);
  }
  plan_hash_u64(&h, plan->nkeys);
  for (size_t k = 0; k < plan->nkeys; k++) {
    const struct consume_key *key = &plan->keys[k];
    plan_hash_str(&h, key->name);
    plan_hash_u64(&h, key->dtype);
    plan_hash_u64(&h, key->device_type);
    plan_hash_u64(&h, key->ndim);
    for (uint32_t d = 0; d < key->ndim; d++)
      plan_hash_u64(&h, (uint64_t)key->shape[d]);
    plan_hash_u64(&h, key->traffic);
    plan_hash_u64(&h, key->round);
  }
  plan_hash_u64(&h, plan->nrounds);
  for (size_t r = 0; r < plan->nrounds; r++)
    hash_round(&h, &plan->rounds[r]);
  return plan_hash_final(&h);
}
