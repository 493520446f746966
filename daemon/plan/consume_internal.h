/*
 * consume_internal.h - what the consumer side of the planner shares between
 * its files; nothing outside daemon/plan/ includes it.  One section per
 * file.
 */
#ifndef SP_DAEMON_PLAN_CONSUME_INTERNAL_H
#define SP_DAEMON_PLAN_CONSUME_INTERNAL_H

#include <stddef.h>
#include <stdint.h>

#include "daemon/plan/consume.h"
#include "daemon/plan/internal.h"

/* A box of a whole tensor and where its elements lie in one storage of one
 * side (a sending rank, or a receiving consumer): view.shape is the box's
 * shape, view.ndim the key's; `start` is the box's first element. */
struct consume_box {
  uint32_t side;
  uint32_t storage;
  int64_t start[SP_MAX_DIMS];
  struct sp_view view;
};

/* The trainers, validated as for an export: the index of their keys and
 * each key's facts (plan_key: placement, dtype, device type, shape, the
 * rank of an expert). */
struct consume_trainers {
  struct plan_index ix;
  struct plan keys; /* only world, nkeys and keys are filled */
};

/* consume_sources.c: the trainers' holdings of a key as the boxes their
 * senders send from.  The one file of the consumer side that reads the
 * trainers' registrations (layout.h), through the index. */

/* Counts key k's sending boxes into *n (out NULL), refusing with
 * SP_EUNSUPPORTED an affine piece whose destination is no box of the whole
 * tensor and replicas whose chosen senders do not write every element
 * once; or, once counted, writes them to out. */
int consume_sources_of_key(const struct consume_trainers *tr, uint32_t k,
                           struct consume_box *out, size_t *n, char *msg,
                           size_t msglen);

/* consume_targets.c: every consumer's targets checked, and turned into the
 * boxes they receive, gathered per wanted key. */

struct consume_wants {
  size_t nkeys;
  uint32_t *key;           /* [nkeys]: trainer key indices, in name order */
  size_t *first;           /* [nkeys + 1] */
  struct consume_box *box; /* key i: box[first[i] .. first[i+1]), by
                              consumer, then target piece; side is the
                              consumer */
  uint32_t *box_key;       /* [total]: the trainer key of each box */
};

/* by_index[c] is consumer c's input once consume_targets_check returns 0. */
int consume_targets_check(const struct consume_input *in,
                          const struct consume_trainers *tr,
                          const struct consume_in **by_index,
                          struct consume_wants *out, char *msg, size_t msglen);
void consume_wants_free(struct consume_wants *wants);

/* consume_alias.c: refuses two destinations that share a byte of one
 * memory object, within one consumer or across two (SP_EDOUBLEWRITE). */
int consume_alias_check(const struct consume_trainers *tr,
                        const struct consume_in *const *by_index,
                        const struct consume_wants *wants, char *msg,
                        size_t msglen);

/* consume_moves.c: the moves by box intersection, the rounds, buckets and
 * each side's share. */
int consume_moves_build(const struct consume_trainers *tr,
                        const struct consume_wants *wants,
                        struct consume_plan *plan, char *msg, size_t msglen);

/* consume_digest.c */
uint64_t consume_digest_compute(const struct consume_plan *plan);

#endif /* SP_DAEMON_PLAN_CONSUME_INTERNAL_H */
