/*
 * consume.h - the planner's consumer side: moves from the trainers' pieces
 * straight into the buffers of consumers (inference workers) laid out the
 * way each consumer asked, no whole tensor assembled unless a consumer asked
 * for one.
 *
 * Input: the trainers' gathered metadata as for an export (layout.h), and
 * per consumer its node, its storages (the buffers it granted the daemon
 * write access to) and its targets: per key it wants, which part of the
 * whole tensor it holds and where in its storages that part lands.
 *
 * A target's part is one of:
 *   whole   the whole tensor, at `view` in one storage;
 *   shard   a slice along dim `dim` at `view`, whose shape is the whole
 *           shape but in that dim: the consumers holding the key as a
 *           shard on one dim concatenate in consumer order and tile it
 *           (tensor parallel, rows or columns, uneven and empty allowed);
 *   pieces  boxes of the whole tensor, each (start, its destination view
 *           whose shape is the box's), anywhere in the consumer's storages:
 *           q, k and v land in one fused buffer at the engine's offsets.
 * A consumer lists any subset of the keys.
 *
 * Output: one consume_plan or one refusal (a code and a sentence naming
 * the key, the consumers and ranks), decided from the gathered metadata
 * alone, so every daemon of the job refuses identically.  The trainers'
 * layouts are validated exactly as for an export (plan.h); then every
 * target: its key is known, its dtype, global shape and device type are the
 * trainers', its views lie in their storages without reaching an element
 * twice, its boxes inside the whole tensor, its shards tile; no two
 * destinations of one consumer and no destinations of two consumers share a
 * byte of memory (storages name their memory, consume_storage.memory).  Every
 * wanted element is held by a trainer because the trainers' layouts are
 * complete (an uncovered element is refused as for an export).
 *
 * Moves are box intersections: every trainer holding (a shard0 slice, an
 * expert, an affine piece whose destination is a box) against every
 * destination box.  Each element travels once, from one sender: a key every
 * rank holds whole (replicated, plain) is sent by all of them, rank r its
 * r-th slice of dim 0, and the replicated affine pieces of one set of
 * holders by one rank of the set, chosen from the set (consume_sources.c),
 * so the senders share the bandwidth.  Moves
 * to a consumer on its sender's node are local copies; the others are
 * bucketed per (sender, consumer, device type, dtype) as an export's are.
 * Rounds walk the wanted keys in name order with the export's rules
 * (plan.h): at most max_keys keys and max_bytes of traffic, a larger key
 * alone.  docs/planner.md, "Consumers", states the rules and refusals.
 *
 * Ownership: the caller frees a plan with consume_plan_free().  It borrows
 * key names from the trainers' input, which must outlive it.
 */
#ifndef SP_DAEMON_PLAN_CONSUME_H
#define SP_DAEMON_PLAN_CONSUME_H

#include <stddef.h>
#include <stdint.h>

#include "daemon/plan/layout.h"
#include "daemon/plan/plan.h"
#include "proto/view.h"

enum consume_part {
  CONSUME_WHOLE = 1,
  CONSUME_SHARD,
  CONSUME_PIECES,
};

/* A buffer a consumer granted.  Storages with equal devices and equal
 * `memory` are parts of one memory object (one memfd, one CUDA
 * allocation), this one starting memory_offset bytes into it: the daemon
 * that mapped them fills both, and the planner refuses destinations that
 * share a byte of one object. */
struct consume_storage {
  struct sp_device device;
  uint64_t nbytes;
  uint64_t memory;
  uint64_t memory_offset;
};

/* A box of the whole tensor and where it lands: dst.shape is the box's
 * shape, dst.ndim the key's, dst.offset and strides count elements of the
 * key's dtype in the storage. */
struct consume_piece {
  int64_t start[SP_MAX_DIMS];
  uint32_t storage;
  struct sp_view dst;
};

struct consume_target {
  const char *key;
  enum consume_part part;
  enum sp_dtype dtype;
  uint32_t ndim; /* the whole tensor's shape as the consumer expects it */
  int64_t shape[SP_MAX_DIMS];
  uint32_t storage;    /* whole, shard */
  struct sp_view view; /* whole, shard: where the part lands */
  uint32_t dim;        /* shard */
  size_t npieces;      /* pieces */
  const struct consume_piece *pieces;
};

struct consume_in {
  uint32_t index; /* the consumer's number in the job */
  uint64_t node;
  size_t nstorages;
  const struct consume_storage *storages;
  size_t ntargets;
  const struct consume_target *targets;
};

struct consume_input {
  const struct plan_input *trainers; /* its limits and stop flag apply */
  uint32_t nconsumers;
  size_t nconsumer_in; /* must equal nconsumers: each once, in any order */
  const struct consume_in *consumers;
};

/* A wanted key.  traffic is the bytes its moves carry; a key with none
 * (no elements wanted) is in no round. */
struct consume_key {
  const char *name; /* borrowed from the trainers' input */
  enum sp_dtype dtype;
  uint32_t device_type;
  uint32_t ndim;
  int64_t shape[SP_MAX_DIMS];
  uint64_t traffic;
  uint32_t round; /* PLAN_NONE when traffic is 0 */
};

/* One box from a trainer's storage into a consumer's: `from` in the
 * sender's storage src_storage, `to` in the consumer's storage
 * dst_storage, both of the move's shape. */
struct consume_move {
  uint32_t key; /* index into plan->keys */
  uint32_t src; /* the sending rank */
  uint32_t dst; /* the receiving consumer */
  uint32_t src_storage;
  uint32_t dst_storage;
  uint32_t device_type; /* the key's; from.dtype is its dtype */
  struct sp_view from;
  struct sp_view to;
  uint64_t nbytes;
  uint64_t bucket_offset; /* byte offset in its bucket; 0 for local moves */
};

struct consume_bucket {
  uint32_t src;
  uint32_t dst;
  uint32_t device_type;
  enum sp_dtype dtype;
  uint64_t nbytes;
  size_t first; /* its moves are round->moves[first .. first + nmoves) */
  size_t nmoves;
};

/* What one side does in a round: a run of buckets (the rank's sends, or
 * through recv_order the consumer's receives) and a run of local moves
 * (those the rank copies, or those the consumer receives). */
struct consume_side {
  size_t bucket_first;
  size_t nbuckets;
  size_t local_first;
  size_t nlocal;
};

struct consume_round {
  size_t first; /* its keys are plan->transfer[first .. first + nkeys) */
  size_t nkeys;
  uint64_t nbytes; /* traffic, local and remote */
  size_t nbuckets;
  struct consume_bucket *buckets; /* by (src, dst, device type, dtype) */
  uint32_t *recv_order;           /* bucket indices by (dst, src, ...) */
  size_t nmoves;
  struct consume_move *moves; /* between nodes, bucket after bucket */
  size_t nlocal;
  struct consume_move *local;     /* within a node, by (src, dst) */
  size_t *local_order;            /* indices into local, by (dst, src) */
  struct consume_side *ranks;     /* [world]: sends, and local copies */
  struct consume_side *consumers; /* [nconsumers]: receives by recv_order,
                                     local moves by local_order */
};

struct consume_plan {
  uint32_t world;
  uint32_t nconsumers;
  uint32_t max_keys;
  uint64_t max_bytes;      /* UINT64_MAX when no budget was given */
  uint64_t *rank_node;     /* [world] */
  uint64_t *consumer_node; /* [nconsumers] */
  uint64_t *received;      /* [nconsumers]: bytes each consumer receives */
  size_t nkeys;
  struct consume_key *keys; /* wanted by a consumer, by name */
  size_t ntransfer;
  uint32_t *transfer; /* keys with traffic, in name order */
  size_t nrounds;
  struct consume_round *rounds;
  uint64_t digest;
};

/* Returns 0 and a plan in *out, or a negative SP_E* code and a sentence in
 * msg (which may be NULL); *out is then NULL. */
int consume_plan_build(const struct consume_input *in,
                       struct consume_plan **out, char *msg, size_t msglen);
void consume_plan_free(struct consume_plan *plan);

/* "whole", "shard", "pieces"; "unknown" else. */
const char *consume_part_name(enum consume_part part);

#endif /* SP_DAEMON_PLAN_CONSUME_H */
