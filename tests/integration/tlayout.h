/*
 * tlayout.h - affine layouts of the synthetic model (model.h) for the
 * export suites: which pieces of a key each rank holds, where each piece is
 * read in the rank's shard and written in the full tensor, and who else
 * holds it (docs/planner.md, "Affine layouts").
 *
 * A rank's shard is one contiguous run of numel elements; its pieces read
 * it with any strides, so a piece's source may be strided (a column block
 * of a rank's whole copy, a fused tensor's half).  The builders cover what
 * trainers hold: tensor parallel splits of rows or columns, of plain or
 * fused tensors, replicated over data parallel groups, and pieces added one
 * by one for anything else.  tlayout_fill writes a rank's shard from the
 * model's original, so every process can build its own without exchanging
 * data, and the owner checks what it received against model_element.
 */
#ifndef SP_TEST_TLAYOUT_H
#define SP_TEST_TLAYOUT_H

#include <stddef.h>
#include <stdint.h>

#include "shardport.h"

#define TLAYOUT_MAX_RANKS 8
#define TLAYOUT_MAX_PIECES 64
#define TLAYOUT_MAX_DIMS 3

struct tlayout {
  uint32_t world;
  uint32_t ndim;
  int64_t shape[TLAYOUT_MAX_DIMS];
  int64_t numel[TLAYOUT_MAX_RANKS]; /* each rank's shard */
  size_t npieces[TLAYOUT_MAX_RANKS];
  sp_piece pieces[TLAYOUT_MAX_RANKS][TLAYOUT_MAX_PIECES];
  /* The pieces' holder lists point in here. */
  uint32_t holders[TLAYOUT_MAX_RANKS * TLAYOUT_MAX_PIECES * TLAYOUT_MAX_RANKS];
  size_t nholders;
};

/* An empty layout of a full tensor of ndim dims: no rank holds anything. */
void tlayout_init(struct tlayout *l, uint32_t world, uint32_t ndim,
                  const int64_t *shape);

/* Rank holds the box of the full tensor at origin of extent size, read from
 * its shard at src_offset with src_stride; holders (ascending, rank among
 * them) hold it too.  The rank's shard grows to what the piece reads. */
void tlayout_piece(struct tlayout *l, uint32_t rank, const int64_t *origin,
                   const int64_t *size, int64_t src_offset,
                   const int64_t *src_stride, const uint32_t *holders,
                   uint32_t nholders);

/* A 2-D tensor made of `fused` equal blocks along dim (a fused gate_up
 * weight: fused 2), each block split along dim over tp tensor parallel
 * ranks (uneven widths allowed), and the split replicated over world / tp
 * data parallel groups: rank r holds part (r / tp_stride) % tp of every
 * block, its parts side by side along dim in one row-major shard, and the
 * ranks holding the same part are its replicas (tp_stride 1: tensor
 * parallel ranks are neighbours; world / tp: data parallel ones are).  With
 * dim 1 and more than one block, each piece's source is strided. */
void tlayout_tp_dp(struct tlayout *l, uint32_t world, uint32_t tp,
                   uint32_t tp_stride, uint32_t dim, uint32_t fused,
                   const int64_t *shape);

/* The layouts of tensor parallel splits replicated over data parallel
 * ranks that the across-nodes suites export, for four ranks two per node
 * (0 and 1, 2 and 3): fused and plain tensors split by columns and by rows
 * with their replicas on the other node, tensor parallel ranks on both
 * nodes with replicas on one, and a whole copy on one node against two
 * column pieces of a whole copy on the other (both ways round). */
#define TLAYOUT_FAMILY 7
struct tlayout_key {
  const char *name;
  const char *dtype;
  uint32_t es;
  struct tlayout layout;
};
void tlayout_family(struct tlayout_key keys[TLAYOUT_FAMILY]);

/* Writes every element rank's pieces read, es bytes each, into shard (the
 * rank's numel elements) from the original of the key named name;
 * elements no piece reads are left as they are. */
void tlayout_fill(const struct tlayout *l, uint32_t rank, const char *name,
                  size_t es, uint8_t *shard);

#endif /* SP_TEST_TLAYOUT_H */
