/*
 * plan.c - the planner's entry point: gathered metadata in, one plan or
 * one refusal out.
 */
#include <stdlib.h>
#include <string.h>

#include "shardport.h"
#include "daemon/plan/internal.h"

int plan_build(const struct plan_input *in, struct plan **out, char *msg,
               size_t msglen) {
  struct plan_index ix;
  struct plan_groups groups = {0};
  struct plan *plan;
  int rc;

  *out = NULL;
  if (msg != NULL && msglen > 0)
    msg[0] = '\0';
  rc = plan_index_build(in, &ix, msg, msglen);
  if (rc != 0)
    return rc;
  plan = calloc(1, sizeof *plan);
  if (plan == NULL) {
    plan_index_free(&ix);
    return sp__failf(msg, msglen, SP_ENOMEM, "out of memory");
  }
  plan->in = in;
  plan->world = in->world;
  plan->max_keys = in->max_keys > 0 ? in->max_keys : PLAN_DEFAULT_MAX_KEYS;
  plan->max_bytes = in->max_bytes > 0 ? in->max_bytes : UINT64_MAX;
  plan->threads = in->threads;
  plan->nkeys = ix.nkeys;
  plan->keys = calloc(ix.nkeys > 0 ? ix.nkeys : 1, sizeof *plan->keys);
  plan->node = malloc((size_t)in->world * sizeof *plan->node);
  plan->rank_in = malloc((size_t)in->world * sizeof *plan->rank_in);
  if (plan->keys == NULL || plan->node == NULL || plan->rank_in == NULL) {
    rc = sp__failf(msg, msglen, SP_ENOMEM, "out of memory");
    goto out;
  }
  for (uint32_t r = 0; r < in->world; r++) {
    plan->node[r] = ix.rank[r]->node;
    plan->rank_in[r] = ix.rank[r];
  }
  /* The stop flag is looked at between steps and, where one step's work
   * grows with the data (keys, affine runs), inside it. */
  rc = plan_validate_keys(&ix, plan, msg, msglen);
  if (rc == 0)
    rc = plan_validate_groups(&ix, plan, &groups, msg, msglen);
  if (rc == 0)
    rc = plan_check_stop(in->stop, msg, msglen);
  if (rc == 0)
    rc = plan_units_build(&ix, &groups, plan, msg, msglen);
  if (rc == 0)
    rc = plan_owners_assign(plan, msg, msglen);
  if (rc == 0)
    rc = plan_check_stop(in->stop, msg, msglen);
  if (rc == 0)
    rc = plan_moves_classify(&ix, plan, msg, msglen);
  if (rc == 0)
    rc = plan_check_stop(in->stop, msg, msglen);
  if (rc == 0)
    rc = plan_rounds_build(&ix, plan, msg, msglen);
  if (rc == 0)
    plan->digest = plan_digest_compute(plan);
out:
  plan_groups_free(&groups);
  plan_index_free(&ix);
  if (rc != 0) {
    plan_free(plan);
    return rc;
  }
  *out = plan;
  return 0;
}

void plan_free(struct plan *plan) {
  if (plan == NULL)
    return;
  for (size_t r = 0; r < plan->nrounds; r++) {
    struct plan_round *round = &plan->rounds[r];
    free(round->buckets);
    free(round->recv_order);
    free(round->moves);
    free(round->local);
    free(round->ranks);
  }
  free(plan->rounds);
  free(plan->transfer);
  free(plan->load);
  free(plan->unit_keys);
  free(plan->units);
  free(plan->keys);
  free(plan->node);
  free(plan->rank_in);
  free(plan);
}

uint32_t plan_find_key(const struct plan *plan, const char *name) {
  size_t lo = 0, hi = plan->nkeys;

  while (lo < hi) {
    size_t mid = lo + (hi - lo) / 2;
    int c = strcmp(plan->keys[mid].name, name);
    if (c == 0)
      return (uint32_t)mid;
    if (c < 0)
      lo = mid + 1;
    else
      hi = mid;
  }
  return PLAN_NONE;
}

void plan_entry_holding(const struct plan *plan, uint32_t rank, uint32_t entry,
                        struct plan_key_in *out) {
  const struct plan_rank_in *r = plan->rank_in[rank];
  plan_input_holding(plan->in, r, &r->entries[entry], out);
}

void plan_key_holding(const struct plan *plan, uint32_t key,
                      struct plan_key_in *out) {
  const struct plan_key *k = &plan->keys[key];
  plan_entry_holding(plan, k->owner, k->held, out);
}
