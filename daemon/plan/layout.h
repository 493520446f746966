/*
 * layout.h - the planner's input: the gathered metadata of every rank of a
 * job, in the compact form the planner reads, and the full form producers
 * describe a rank's registrations in.
 *
 * The compact form (docs/internals.md, "The planner's input"): a key table
 * held once per job (name, placement, device type, dtype and global shape:
 * one row per distinct declaration, so ranks that disagree on a key get
 * rows of their own and the planner can name the difference), and per rank
 * one 16-byte plan_entry per key it holds: key, storage, offset and rows.
 * That is all a shard0, replicated, plain or expert holding needs when its
 * view is row-major contiguous: dtype, the other dims and every stride
 * follow from the key.  Any other holding (affine pieces, a strided view, an
 * offset or a row count past 32 bits, a byte count that disagrees with the
 * view) keeps its full form in the rank's side table, and its entry points
 * there, so the planner refuses exactly what it refused of the full form.
 *
 * Placements (seed 002 and 003):
 *   shard0      rows of the global shape along dim 0; shards concatenate in
 *               rank order (uneven and empty shards allowed), so a rank's
 *               view has the global shape except in dim 0.
 *   replicated  every rank holds the whole tensor (a replicated DTensor);
 *   plain       every rank holds the whole tensor (not a DTensor at all);
 *               both are kept by their owner and dropped elsewhere.
 *   expert      whole on exactly one rank, which keeps it; other ranks do
 *               not list the key at all.
 *   affine      pieces (affine.h) of a contiguous shard tensor.
 * Every key but an expert is listed by every rank with the same placement.
 *
 * The planner only reads this structure.  The plan it returns borrows key
 * names and registrations from it (plan.h), so the input must outlive the
 * plan.  input.c builds it from the full form.
 */
#ifndef SP_DAEMON_PLAN_LAYOUT_H
#define SP_DAEMON_PLAN_LAYOUT_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "daemon/plan/affine.h"
#include "proto/view.h"

enum plan_placement {
  PLAN_SHARD0 = 1,
  PLAN_REPLICATED,
  PLAN_PLAIN,
  PLAN_EXPERT,
  PLAN_AFFINE,
};

/* A rank's holding of one key in full form: what producers describe, what
 * the side table keeps, and what plan_input_holding() rebuilds from a
 * compact entry. */
struct plan_key_in {
  const char *name;
  enum plan_placement placement;
  uint32_t device_type; /* enum sp_device_type the trainer declares */
  uint32_t ndim;        /* of the global shape */
  int64_t shape[SP_MAX_DIMS];
  uint32_t storage;    /* index into the rank's storages */
  struct sp_view view; /* what the rank holds: shard, whole, or affine shard */
  uint64_t nbytes;     /* bytes the rank reports for its holding */
  size_t npieces;      /* affine only */
  const struct affine_piece *pieces;
};

/* Keys that must end on one owner, e.g. the inputs of a merge. */
struct plan_group {
  size_t nkeys;
  const char *const *keys;
};

/* One rank's registrations in full form, as a producer describes them to
 * plan_input_add_rank(). */
struct plan_rank_desc {
  uint32_t rank;
  uint64_t node;
  size_t nstorages;
  const struct sp_storage *storages;
  size_t nkeys;
  const struct plan_key_in *keys;
  size_t ngroups;
  const struct plan_group *groups;
};

/* One row of the job's key table. */
struct plan_key_decl {
  const char *name;
  enum plan_placement placement;
  uint32_t device_type; /* enum sp_device_type */
  enum sp_dtype dtype;
  uint32_t ndim;
  int64_t shape[SP_MAX_DIMS];
};

/* In plan_entry.storage: the holding's full form is the rank's
 * full[offset], and the low bits mean nothing. */
#define PLAN_ENTRY_FULL 0x80000000u

/* A rank's holding of a key, compact: the view is row-major contiguous in
 * the key's dtype, with the key's shape but rows in dim 0 (nothing for a
 * 0-d key), starting offset elements into the storage. */
struct plan_entry {
  uint32_t key;     /* index into plan_input.keys */
  uint32_t storage; /* index into the rank's storages, or PLAN_ENTRY_FULL */
  uint32_t offset;  /* in elements; with PLAN_ENTRY_FULL, index into full */
  uint32_t rows;    /* dim 0 of the view; 0 for a 0-d key */
};

struct plan_rank_in {
  uint32_t rank;
  uint64_t node;
  size_t nstorages;
  const struct sp_storage *storages;
  size_t nentries;
  const struct plan_entry *entries;
  size_t nfull;
  const struct plan_key_in *full; /* the side table */
  size_t ngroups;
  const struct plan_group *groups;
};

struct plan_input {
  uint32_t world;
  size_t nranks; /* must equal world: each rank once, in any order */
  const struct plan_rank_in *ranks;
  size_t nkeys;
  const struct plan_key_decl *keys; /* the key table */
  uint32_t max_keys;  /* keys per round; 0 means PLAN_DEFAULT_MAX_KEYS */
  uint64_t max_bytes; /* traffic per round; 0 means no byte budget */
  /* Threads that build rounds, this one included; 0 and 1 mean this one
   * alone.  The plan and its digest are the same whatever the count. */
  uint32_t threads;
  /* Set by another thread when planning must stop (the export's time is
   * up): plan_build then returns SP_ETIMEOUT soon, having freed what it
   * took.  NULL: never stopped.  The planner reads no clock itself. */
  const _Atomic bool *stop;
};

/* Entry e of rank (one of in's ranks) in full form.  A compact entry's
 * name, placement, device type and shape are its key's, its view is
 * rebuilt (strides row-major), its byte count is the view's and it has no
 * pieces; a full entry is copied from the side table.  The entry's key and
 * side-table index must be in range (the planner's index checks them). */
void plan_input_holding(const struct plan_input *in,
                        const struct plan_rank_in *rank,
                        const struct plan_entry *e, struct plan_key_in *out);

/* input.c: builds the compact form from full forms, one rank at a time.
 * Key names, storages, pieces and groups are borrowed from the
 * descriptions, which must outlive the input; everything else is copied.
 * Interning a key costs one hash of its declaration per rank. */
struct plan_input_store;

/* NULL when out of memory. */
struct plan_input_store *plan_input_store_new(uint32_t world);
/* Adds one rank's registrations: 0, or SP_ENOMEM / SP_EOVERFLOW (more than
 * 2^31 keys or holdings) with a sentence in msg. */
int plan_input_add_rank(struct plan_input_store *s,
                        const struct plan_rank_desc *rank, char *msg,
                        size_t msglen);
/* The input so far; the caller sets its limits and stop flag.  Valid until
 * the next plan_input_add_rank or plan_input_store_free. */
struct plan_input *plan_input_of(struct plan_input_store *s);
/* Bytes the store holds, for the benchmarks. */
size_t plan_input_store_bytes(const struct plan_input_store *s);
void plan_input_store_free(struct plan_input_store *s);

/* "shard0", "replicated", "plain", "expert", "affine"; "unknown" else. */
const char *plan_layout_placement_name(enum plan_placement placement);
/* The placement named by name[0..len); SP_EUNSUPPORTED for any other. */
int plan_layout_placement_from_name(const char *name, size_t len,
                                    enum plan_placement *out);

#endif /* SP_DAEMON_PLAN_LAYOUT_H */
