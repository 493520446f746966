/*
 * replicas.h - copies that must agree, compared where they are read:
 * replicated and plain keys by digest before anything moves, and the
 * replicas of affine pieces element by element as a key is assembled, by
 * the host engine (engine.c) and the CUDA one (daemon/cuda/copy.c) alike.
 */
#ifndef SP_DAEMON_XFER_REPLICAS_H
#define SP_DAEMON_XFER_REPLICAS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "daemon/plan/plan.h"
#include "daemon/xfer/engine.h"
#include "daemon/xfer/layer.h"

/* ---- replicated and plain keys, by digest ---- */

/* The digests of the replicated and plain keys this node's ranks hold, for
 * one export: digest[j * nkeys + i] is the XXH3-64 of rank ranks[j]'s copy
 * of plan key keys[i], its elements in row-major order.  Keys on GPUs are
 * not read (their device memory is not mapped here). */
struct replica_digests {
  size_t nkeys;
  uint32_t *keys;  /* plan key indices, in key order */
  uint32_t nranks;
  uint32_t *ranks; /* the local ranks, ascending */
  uint64_t *digest;
};

/* Reads every local rank's copy (src[r] its storages, NULL for a rank on
 * another node) on threads threads, this one included, under the SIGBUS
 * guard (thread.h): 0, or SP_ENOMEM or SP_EBADFD (an unreadable copy,
 * named) with a sentence.  *out is empty when nothing is to compare. */
int replicas_hash(const struct plan *plan, const struct plan_input *in,
                  const struct xfer_storage *const *src, uint32_t threads,
                  struct replica_digests *out, char *msg, size_t msglen);
/* SP_EDIFFERENT naming the first key (in key order) whose local copies
 * differ, the lowest rank and the first rank that differs from it; or 0. */
int replicas_compare(const struct plan *plan, const struct replica_digests *d,
                     char *msg, size_t msglen);
/* The one refusal text: rank_b's copy of key differs from rank_a's, and
 * more further ranks' too.  Returns SP_EDIFFERENT. */
int replicas_refuse(const struct plan *plan, uint32_t key, uint32_t rank_a,
                    uint64_t digest_a, uint32_t rank_b, uint64_t digest_b,
                    size_t more, char *msg, size_t msglen);
void replicas_free(struct replica_digests *d);
/* The plan index of the n-th replicated or plain key on the CPU (the
 * order of replica_digests.keys), or PLAN_NONE. */
uint32_t replicas_key_at(const struct plan *plan, size_t n);

/* ---- replicas of affine pieces, as a key is assembled ---- */

/* Merges one replica into its key's image: each element of the box nobody
 * wrote yet takes the replica's bytes and is marked in seen (one bit per
 * element of the key), and an element written before must hold the same
 * bytes, so the first holder's bytes stand.  The box has shape[0..ndim),
 * read from src with src_stride and written at dr (both in elements of esz
 * bytes).  true when every element agreed, else false with *at the first
 * element of the key (row-major) that differs. */
bool replicas_merge(uint8_t *image, uint8_t *seen, size_t esz,
                    const uint8_t *src, uint32_t ndim, const int64_t *shape,
                    const int64_t *src_stride, const struct plan_region *dr,
                    int64_t *at);
/* Whether region r reaches element elem (its strides passed the planner's
 * overlap check): how both engines find the earlier replica that wrote an
 * element, to name its rank. */
bool replicas_region_contains(const struct plan_region *r, int64_t elem);
/* SP_EDIFFERENT with the one sentence of disagreeing replicas: key's
 * element at (its multi-index named) differs between rank earlier's
 * replica and rank later's. */
int replicas_disagree(const struct plan_key *key, int64_t at, uint32_t earlier,
                      uint32_t later, char *msg, size_t msglen);

#endif /* SP_DAEMON_XFER_REPLICAS_H */
