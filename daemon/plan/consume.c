/*
 * consume.c - the consumer side's entry point: the trainers' gathered
 * metadata and the consumers' targets in, one consume_plan or one refusal
 * out.
 */
#include <stdlib.h>
#include <string.h>

#include "shardport.h"
#include "daemon/plan/consume_internal.h"

static const char *const part_names[] = {
    [CONSUME_WHOLE] = "whole",
    [CONSUME_SHARD] = "shard",
    [CONSUME_PIECES] = "pieces",
};

const char *consume_part_name(enum consume_part part) {
  if (part < CONSUME_WHOLE || part > CONSUME_PIECES)
    return "unknown";
  return part_names[part];
}

/* The trainers' layouts are checked exactly as an export checks them. */
static int trainers_validate(const struct plan_input *in,
                             struct consume_trainers *tr, char *msg,
                             size_t msglen) {
  int rc = plan_index_build(in, &tr->ix, msg, msglen);

  if (rc != 0)
    return rc;
  tr->keys.world = in->world;
  tr->keys.nkeys = tr->ix.nkeys;
  tr->keys.keys =
      calloc(tr->ix.nkeys > 0 ? tr->ix.nkeys : 1, sizeof *tr->keys.keys);
  if (tr->keys.keys == NULL)
    return sp__failf(msg, msglen, SP_ENOMEM, "out of memory");
  return plan_validate_keys(&tr->ix, &tr->keys, msg, msglen);
}

static int plan_alloc(const struct consume_input *in,
                      const struct consume_trainers *tr,
                      const struct consume_in *const *by_index,
                      struct consume_plan *plan, char *msg, size_t msglen) {
  const struct plan_input *t = in->trainers;

  plan->world = t->world;
  plan->nconsumers = in->nconsumers;
  plan->max_keys = t->max_keys > 0 ? t->max_keys : PLAN_DEFAULT_MAX_KEYS;
  plan->max_bytes = t->max_bytes > 0 ? t->max_bytes : UINT64_MAX;
  plan->rank_node = malloc((size_t)t->world * sizeof *plan->rank_node);
  plan->consumer_node =
      malloc((size_t)in->nconsumers * sizeof *plan->consumer_node);
  plan->received = calloc(in->nconsumers, sizeof *plan->received);
  if (plan->rank_node == NULL || plan->consumer_node == NULL ||
      plan->received == NULL)
    return sp__failf(msg, msglen, SP_ENOMEM, "out of memory");
  for (uint32_t r = 0; r < t->world; r++)
    plan->rank_node[r] = tr->ix.rank[r]->node;
  for (uint32_t c = 0; c < in->nconsumers; c++)
    plan->consumer_node[c] = by_index[c]->node;
  return 0;
}

int consume_plan_build(const struct consume_input *in,
                       struct consume_plan **out, char *msg, size_t msglen) {
  struct consume_trainers tr = {0};
  struct consume_wants wants = {0};
  const struct consume_in **by_index = NULL;
  struct consume_plan *plan = NULL;
  int rc;

  *out = NULL;
  if (msg != NULL && msglen > 0)
    msg[0] = '\0';
  rc = trainers_validate(in->trainers, &tr, msg, msglen);
  if (rc == 0) {
    by_index =
        calloc(in->nconsumers > 0 ? in->nconsumers : 1, sizeof *by_index);
    plan = calloc(1, sizeof *plan);
    if (by_index == NULL || plan == NULL)
      rc = sp__failf(msg, msglen, SP_ENOMEM, "out of memory");
  }
  if (rc == 0)
    rc = consume_targets_check(in, &tr, by_index, &wants, msg, msglen);
  if (rc == 0)
    rc = plan_check_stop(tr.ix.stop, msg, msglen);
  if (rc == 0)
    rc = consume_alias_check(&tr, by_index, &wants, msg, msglen);
  if (rc == 0)
    rc = plan_alloc(in, &tr, by_index, plan, msg, msglen);
  if (rc == 0)
    rc = consume_moves_build(&tr, &wants, plan, msg, msglen);
  if (rc == 0)
    plan->digest = consume_digest_compute(plan);
  consume_wants_free(&wants);
  free(by_index);
  free(tr.keys.keys);
  plan_index_free(&tr.ix);
  if (rc != 0) {
    consume_plan_free(plan);
    return rc;
  }
  *out = plan;
  return 0;
}

void consume_plan_free(struct consume_plan *plan) {
  if (plan == NULL)
    return;
  for (size_t r = 0; r < plan->nrounds; r++) {
    struct consume_round *round = &plan->rounds[r];
    free(round->buckets);
    free(round->recv_order);
    free(round->moves);
    free(round->local);
    free(round->local_order);
    free(round->ranks);
    free(round->consumers);
  }
  free(plan->rounds);
  free(plan->transfer);
  free(plan->keys);
  free(plan->received);
  free(plan->consumer_node);
  free(plan->rank_node);
  free(plan);
}
