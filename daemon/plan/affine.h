/*
 * affine.h - general layouts: a rank's holding of a key as affine pieces,
 * and their complete validation.  The tests' oracle, which rebuilds a full
 * tensor from the pieces and cuts them from it, is theirs
 * (tests/unit/plan/oracle.h).
 *
 * A piece is a box of elements: `shape`, read from the rank's shard at
 * src_offset + sum(i_k * src_stride[k]) and written to the full tensor at
 * dst_offset + sum(i_k * dst_stride[k]).  Both sides count elements of the
 * key's dtype: the shard as the rank's shard tensor laid out row-major, the
 * full tensor row-major in its global shape.  A piece held by more than one
 * rank is a replica; each holder lists it with its own source offset.
 *
 * Validation is complete, not sampled (seed 003).  For every piece:
 * non-negative offsets and strides, no zero stride and no view that reaches
 * one address twice on either side (sp__view_check_overlap), the source
 * inside the shard and the destination inside the full tensor, and no shard
 * element read by two pieces.  Across ranks: an element written by two
 * single holders or by a single holder and a replica is refused, whatever
 * order ranks are visited in, and so is an element nobody writes.  Both are
 * decided by a sweep over the pieces' runs of elements (cover.c), in memory
 * proportional to the pieces, never to the tensor: a layout of terabytes
 * costs what its pieces do.  Replicas are compared byte for byte at
 * assembly (replicas_merge, daemon/xfer/replicas.h).
 *
 * One limit, from the same seed: a corruption that turns the map into a
 * different valid layout (two equal pieces swapping destinations, a piece
 * reading shard padding no other piece reads) passes every map check; only
 * a digest of the data could catch it.
 */
#ifndef SP_DAEMON_PLAN_AFFINE_H
#define SP_DAEMON_PLAN_AFFINE_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "proto/view.h"

struct affine_piece {
  uint32_t ndim;
  int64_t shape[SP_MAX_DIMS];
  int64_t src_offset;
  int64_t src_stride[SP_MAX_DIMS];
  int64_t dst_offset;
  int64_t dst_stride[SP_MAX_DIMS];
  uint32_t nholders;
  const uint32_t *holders; /* the ranks holding this piece, own rank included */
};

/* One rank's holding of the key. */
struct affine_shard {
  uint64_t numel; /* elements of the rank's shard tensor */
  size_t npieces;
  const struct affine_piece *pieces;
};

struct affine_map {
  const char *key; /* named in messages */
  uint32_t ndim;
  const int64_t *shape; /* the full tensor */
  uint32_t nranks;
  const struct affine_shard *shards; /* [nranks], indexed by rank */
  /* Set by another thread to stop the checks: they then return
   * SP_ETIMEOUT.  NULL: never stopped. */
  const _Atomic bool *stop;
};

/* Checks one rank's pieces on their own: what extract needs. */
int affine_check_rank(const struct affine_map *map, uint32_t rank, char *msg,
                      size_t msglen);

/* Checks every rank's pieces, then every destination together: metadata
 * only, in memory proportional to the pieces (about 360 bytes each), freed
 * before returning. */
int affine_validate(const struct affine_map *map, char *msg, size_t msglen);

#endif /* SP_DAEMON_PLAN_AFFINE_H */
