/*
 * plan.h - the planner's entry point and its plan.
 *
 * plan_build() takes the gathered metadata of every rank of a job
 * (layout.h) and returns either one plan or one refusal.  It is pure: no
 * sockets, no clocks, no globals, no printing.  Every daemon of a job calls
 * it on the same gathered metadata and gets the same plan, whatever order
 * ranks and keys arrive in, or the same refusal (code and message, naming
 * the key and the ranks), so no rank is left waiting in a transfer its peers
 * never join.  plan->digest is a hash of a canonical serialization of the
 * plan that daemons compare before moving anything.  docs/planner.md states
 * the rules and the refusals.
 *
 * What the plan decides:
 *   - units: keys merged transitively through together-groups and through
 *     identical views on every rank (tied weights, which move once);
 *   - one owner per unit: units by bytes descending then name, each to the
 *     rank with the least load so far (ties to the lowest rank), loads seeded
 *     with each rank's expert bytes;
 *   - per key, what happens: moved to its owner, identity (the owner already
 *     holds it whole and publishes its own storage), empty (the owner
 *     creates it) or alias (shares another key's buffer);
 *   - rounds: the keys that move, in name order, cut into rounds of at most
 *     max_keys keys and max_bytes of traffic.  A key whose traffic alone
 *     exceeds max_bytes travels alone in a round of its own: it is never
 *     split, so staging is bounded by max(max_bytes, largest key);
 *   - per round: moves between ranks on one node (local, copied directly
 *     from the source storage) listed apart from moves between nodes, which
 *     are bucketed per (source, destination, device type, dtype).  Each rank
 *     sends its buckets in order of (peer, device type, dtype) and receives
 *     in the same order of its peers, and a send and its receive are one
 *     bucket, so every send meets a receive of its length.
 *
 * Ownership: the caller frees a plan with plan_free().  A plan borrows key
 * names and the registrations it names (plan_key.held, plan_move.entry)
 * from the input, which must outlive it.
 */
#ifndef SP_DAEMON_PLAN_PLAN_H
#define SP_DAEMON_PLAN_PLAN_H

#include <stddef.h>
#include <stdint.h>

#include "daemon/plan/layout.h"
#include "proto/view.h"

#define PLAN_NONE UINT32_MAX
#define PLAN_DEFAULT_MAX_KEYS 4096u

enum plan_key_kind {
  PLAN_KEY_MOVE = 1, /* assembled on its owner from moves */
  PLAN_KEY_IDENTITY, /* the owner holds it whole: its own storage, no copy */
  PLAN_KEY_EMPTY,    /* no elements: the owner creates it */
  PLAN_KEY_ALIAS,    /* views identical to alias_of's on every rank */
};

struct plan_key {
  const char *name; /* borrowed from the input */
  enum plan_placement placement;
  enum sp_dtype dtype;
  uint32_t device_type; /* of the storages holding it */
  uint32_t ndim;
  int64_t shape[SP_MAX_DIMS];
  uint64_t nbytes;  /* the whole tensor */
  uint64_t traffic; /* bytes its moves carry; replicas of affine pieces each
                       travel, so the owner can compare them */
  enum plan_key_kind kind;
  uint32_t owner;
  uint32_t unit;     /* PLAN_NONE for experts, which are not balanced */
  uint32_t alias_of; /* PLAN_NONE unless kind is ALIAS */
  uint32_t round;    /* PLAN_NONE unless kind is MOVE */
  uint32_t held;     /* IDENTITY: the owner's entry (plan_key_holding), else
                       PLAN_NONE */
};

struct plan_unit {
  uint32_t owner;
  uint64_t nbytes; /* aliases counted once */
  size_t first;    /* its keys are plan->unit_keys[first .. first + nkeys) */
  size_t nkeys;
};

enum { PLAN_MOVE_REPLICA = 1u };

/* One box of elements from a source rank's storage to its owner's tensor,
 * in 48 bytes: a plan holds millions.  plan_moves_regions() spells out both
 * sides. */
struct plan_move {
  uint32_t key;
  uint32_t src;
  uint32_t dst;
  /* Affine: index into the holding's pieces, which one frame of at most
   * 4 GiB lists (proto/limits.h), so far fewer than 2^31; 0 otherwise. */
  uint32_t piece : 31;
  uint32_t flags : 1; /* PLAN_MOVE_REPLICA: compare with other replicas */
  uint32_t storage;   /* the source rank's storage it is read from */
  uint32_t entry;     /* the source rank's entry it carries (layout.h) */
  uint64_t nbytes;
  uint64_t dst_offset; /* first element of the region in the owner's tensor */
  uint64_t bucket_offset; /* byte offset in its bucket; 0 for local moves */
};

struct plan_bucket {
  uint32_t src;
  uint32_t dst;
  uint32_t device_type;
  enum sp_dtype dtype;
  uint64_t nbytes;
  size_t first; /* its moves are round->moves[first .. first + nmoves) */
  size_t nmoves;
};

struct plan_rank_round {
  size_t send_first; /* round->buckets[send_first .. + nsend) */
  size_t nsend;
  size_t recv_first; /* round->recv_order[recv_first .. + nrecv) */
  size_t nrecv;
  size_t local_first; /* round->local[local_first .. + nlocal): what this */
  size_t nlocal;      /* rank receives from ranks of its own node */
};

struct plan_round {
  size_t first; /* its keys are plan->transfer[first .. first + nkeys) */
  size_t nkeys;
  uint64_t nbytes; /* traffic, local and remote */
  size_t nbuckets;
  struct plan_bucket *buckets; /* by (src, dst, device type, dtype) */
  uint32_t *recv_order;        /* bucket indices by (dst, src, ...) */
  size_t nmoves;
  struct plan_move *moves; /* between nodes, bucket after bucket; within a
                              bucket by key, source rank, piece */
  size_t nlocal;
  struct plan_move *local; /* within a node, by owner, key, source, piece */
  struct plan_rank_round *ranks; /* [world] */
  uint64_t digest; /* of its buckets and moves; plan->digest covers it */
};

/* A strided region of the owner's row-major tensor, in elements. */
struct plan_region {
  uint32_t ndim;
  int64_t shape[SP_MAX_DIMS];
  int64_t stride[SP_MAX_DIMS];
  int64_t offset;
};

struct plan {
  const struct plan_input *in;         /* borrowed */
  const struct plan_rank_in **rank_in; /* [world]: in's ranks by number */
  uint32_t world;
  uint32_t max_keys;
  uint64_t max_bytes; /* UINT64_MAX when no budget was given */
  uint32_t threads;   /* the input's: threads that built it */
  uint64_t *node;     /* [world] */
  size_t nkeys;
  struct plan_key *keys; /* by name (strcmp order) */
  size_t nunits;
  struct plan_unit *units; /* by key order of their first key */
  uint32_t *unit_keys;
  uint64_t *load; /* [world]: bytes each rank owns, experts included */
  size_t ntransfer;
  uint32_t *transfer; /* MOVE keys in name order */
  size_t nrounds;
  struct plan_round *rounds;
  uint64_t digest;
};

/* Returns 0 and a plan in *out, or a negative SP_E* code and a sentence in
 * msg (which may be NULL) naming the key and the ranks; *out is then NULL. */
int plan_build(const struct plan_input *in, struct plan **out, char *msg,
               size_t msglen);
void plan_free(struct plan *plan);

/* The key named name, or PLAN_NONE. */
uint32_t plan_find_key(const struct plan *plan, const char *name);

/* The source view (in the source rank's storage move->storage) and the
 * destination region of a move; both have the move's shape. */
void plan_moves_regions(const struct plan *plan, const struct plan_move *move,
                        struct sp_view *src, struct plan_region *dst);

/* The full form (layout.h) of what rank holds as entry, and of the owner's
 * registration of an IDENTITY key. */
void plan_entry_holding(const struct plan *plan, uint32_t rank, uint32_t entry,
                        struct plan_key_in *out);
void plan_key_holding(const struct plan *plan, uint32_t key,
                      struct plan_key_in *out);

/* "[2, 5]": the multi-index of element flat of a row-major tensor of
 * shape[0..ndim), as every refusal that names an element writes it (the
 * planner's and the engines'; refuse.c). */
void plan_refuse_index(uint32_t ndim, const int64_t *shape, uint64_t flat,
                       char *buf, size_t len);

#endif /* SP_DAEMON_PLAN_PLAN_H */
