/*
 * layout.h - the planner's input: the gathered metadata of every rank of a
 * job, as a daemon fills it from the ranks' registration messages.
 *
 * Per rank: its number, its node (ranks on one node are local to each
 * other), its unique storages (the codec's output, proto/view.h), its keys
 * and its together-groups.  Per key: how the rank holds it (placement), the
 * device type it declares, the global shape, the storage and view of what it
 * holds, and the byte count it reports.  The key's dtype is its view's.
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
 * plan.
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

struct plan_rank_in {
  uint32_t rank;
  uint64_t node;
  size_t nstorages;
  const struct sp_storage *storages;
  size_t nkeys;
  const struct plan_key_in *keys;
  size_t ngroups;
  const struct plan_group *groups;
};

struct plan_input {
  uint32_t world;
  size_t nranks; /* must equal world: each rank once, in any order */
  const struct plan_rank_in *ranks;
  uint32_t max_keys;  /* keys per round; 0 means PLAN_DEFAULT_MAX_KEYS */
  uint64_t max_bytes; /* traffic per round; 0 means no byte budget */
  /* Set by another thread when planning must stop (the export's time is
   * up): plan_build then returns SP_ETIMEOUT soon, having freed what it
   * took.  NULL: never stopped.  The planner reads no clock itself. */
  const _Atomic bool *stop;
};

/* "shard0", "replicated", "plain", "expert", "affine"; "unknown" else. */
const char *plan_layout_placement_name(enum plan_placement placement);
/* The placement named by name[0..len); SP_EUNSUPPORTED for any other. */
int plan_layout_placement_from_name(const char *name, size_t len,
                                    enum plan_placement *out);

#endif /* SP_DAEMON_PLAN_LAYOUT_H */
