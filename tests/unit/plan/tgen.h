/*
 * tgen.h - random affine layouts and their corruptions, for the property
 * of seed 003 (docs/planner.md, "Affine layouts"): the planner's suite
 * checks it on oracle_rebuild, the across-nodes suite through two real
 * daemons.
 *
 * With a seed, tgen_generate draws a layout of a 2-D or 3-D tensor over 2
 * to 8 ranks: row splits, column splits of uneven widths, block grids,
 * replicas (some holders cutting them at other boundaries: along dim 0
 * from separate copies, or along the last dim as column blocks of one
 * whole copy, which reads with strides), single holders that keep their
 * box column-major (strided sources again), interleaved columns, and
 * pieces listed in random order.  tgen_corrupt changes one offset or
 * stride of one piece.  Each rank's shard is its pieces' sources, in the
 * order drawn, with no gaps.
 */
#ifndef SP_TESTS_UNIT_PLAN_TGEN_H
#define SP_TESTS_UNIT_PLAN_TGEN_H

#include <stdint.h>

#include "daemon/plan/affine.h"

#define TGEN_MAX_RANKS 8
#define TGEN_MAX_PIECES 64
#define TGEN_MAX_HOLDERS (TGEN_MAX_RANKS * TGEN_MAX_PIECES * TGEN_MAX_RANKS)

struct tgen_layout {
  uint32_t nranks;
  uint32_t ndim;
  int64_t shape[3];
  int64_t fstride[3]; /* the full tensor's, row-major */
  uint64_t numel;
  uint64_t shard_numel[TGEN_MAX_RANKS];
  size_t npieces[TGEN_MAX_RANKS];
  struct affine_piece pieces[TGEN_MAX_RANKS][TGEN_MAX_PIECES];
  struct affine_shard shards[TGEN_MAX_RANKS];
  struct affine_map map; /* key "p" */
  uint32_t holders[TGEN_MAX_HOLDERS]; /* the pieces' holder lists */
  size_t nholders;
};

/* Draws the next layout of the sequence seed walks. */
void tgen_generate(struct tgen_layout *l, uint64_t *seed);

/* A copy of src whose map, shards, pieces and holders are its own. */
void tgen_copy(struct tgen_layout *dst, const struct tgen_layout *src);

/* Changes one offset or stride of one piece to a different value, which
 * may be negative. */
void tgen_corrupt(struct tgen_layout *l, uint64_t *seed);

#endif /* SP_TESTS_UNIT_PLAN_TGEN_H */
