/*
 * registry.h - one rank's registrations, in the planner's form (registry.c).
 */
#ifndef SP_DAEMON_REGISTRY_H
#define SP_DAEMON_REGISTRY_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>
#include <uv.h>

#include "daemon/cuda/gpu.h"
#include "daemon/idxset.h"
#include "daemon/layer.h"
#include "daemon/plan/plan.h"
#include "daemon/request.h"
#include "daemon/xfer/engine.h"
#include "proto/frame.h"

struct sp_device;

struct registry;

/* What the daemon keeps of a storage besides the planner's sp_storage is
 * a struct xfer_storage (daemon/xfer/engine.h), the form the movers read.
 */

/* A read-only mapping of pages of a file, shared by every storage of the
 * registry that lies in it (regmap.c says which pages and why). */
struct reg_map {
  void *addr;      /* the mapping's first byte */
  size_t len;      /* bytes mapped, whole pages */
  uint64_t offset; /* the file offset addr maps, a page boundary */
  uint32_t file;   /* index into the registry's files */
  /* The pages of the storages in it, counted once per storage. */
  uint64_t covered;
};

/* A file the registry maps, known by its identity. */
struct reg_file {
  dev_t dev;
  ino_t ino;
};

/* A registry's mappings in file order: sorted by (file, offset), and for
 * each the mapping that reaches furthest into its file among it and the
 * ones of its file before it, so finding one that holds a range takes one
 * binary search (regmap.c). */
struct reg_place {
  uint64_t offset; /* the mapping's, copied: the sort key with file */
  uint32_t file;
  uint32_t map;   /* index into maps */
  uint32_t reach; /* index into maps */
};

/* What a registry holds, as the quotas count it (docs/operations.md,
 * "Quotas"). */
struct reg_usage {
  uint64_t mappings;      /* host mappings, reg_map */
  uint64_t mapped_bytes;  /* the address space they take */
  uint64_t registrations; /* storages and tensors */
  uint64_t bytes;         /* registration bytes: registry.c's *_cost */
};

/* Bounds on what a registry may take, checked before a frame is kept. */
struct reg_quota_ops {
  /* 0 to let the registry take more, else a code and a sentence. */
  int (*admit)(void *arg, const struct registry *reg,
               const struct reg_usage *more, char *msg, size_t msglen);
  /* The registry took more. */
  void (*charge)(void *arg, const struct reg_usage *more);
  /* The registry gave some back (mappings a larger one replaced). */
  void (*release)(void *arg, const struct reg_usage *less);
};

/* One rank's registrations, in the planner's form.  Used from the loop
 * thread, and read (never changed) by an engine while an export runs. */
struct registry {
  uint32_t device_type; /* the rank's device, declared at join */
  /* For a CUDA rank: the backend and the local ordinal of its GPU, which
   * storages live on unless they name another. */
  struct gpu *gpu;
  int device;
  size_t nstorages;
  size_t storage_cap_s, storage_cap_i;
  struct sp_storage *storages;
  struct xfer_storage *info;
  struct idxset by_sid;
  struct idxset by_base;
  size_t nkeys, key_cap;
  struct plan_key_in *keys; /* names and pieces owned */
  struct idxset by_name;
  /* Every mapping made (unmapped with the registry), in file order too,
   * and the files. */
  size_t nmaps, map_cap;
  struct reg_map *maps;
  size_t place_cap;
  struct reg_place *places; /* nmaps of them */
  size_t nfiles, file_cap;
  struct reg_file *files;
  struct idxset by_file;
  struct reg_usage used;
  /* The quotas of the rank's connection and user; NULL: none. */
  const struct reg_quota_ops *quota;
  void *quota_arg;
};

void registry_init(struct registry *reg, uint32_t device_type);
/* Unmaps every storage and frees everything. */
void registry_free(struct registry *reg);
/* registry_free, on a worker thread for a large host registry: the
 * registry is emptied at once, and no one may use what it held. */
void registry_drop(uv_loop_t *loop, struct registry *reg);
/* Maps and registers n storages whose fds are frame's (the frame keeps
 * them); all or none.  Only the pages the storages lie in are mapped,
 * and a mapping is shared by every storage in it (regmap.c).
 * SP_EBADFD, SP_EINVAL, SP_ELIMIT (the quota's code), SP_ENOMEM. */
int registry_add_storages(struct registry *reg, const struct req_storage *s,
                          size_t n, const struct sp_frame *frame, char *msg,
                          size_t msglen);
/*
 * A frame's storages or tensors registered in steps (registration.c), so
 * that no step holds the loop long.  The batch is made from the request
 * alone, on any thread: the entries checked against each other (a sid,
 * base or key twice) and hashed for the registry's tables, the names
 * copied.  Each step then runs on the loop, on at most budget entries:
 * checked against the registry, then (in the step where the last is
 * checked) admitted by the quotas with room made and files mapped, then
 * indexed past the registry's count, and kept, all at once, by the step
 * that indexes the last.  Until then the registry reads as before, and a
 * refusal leaves it so.  While a batch is stepped, nothing else may add to
 * its registry; a batch dropped before its end needs its registry no more.
 */
struct reg_batch;
/* 0 and *out (free it with registry_batch_free), or a refusal.  The batch
 * points into s or t, which must outlive it. */
int registry_batch_storages(const struct req_storage *s, size_t n,
                            struct reg_batch **out, char *msg, size_t msglen);
int registry_batch_tensors(struct req_tensor *t, size_t n,
                           struct reg_batch **out, char *msg, size_t msglen);
/* One step: 1 while entries remain, 0 once kept (each tensor's pieces then
 * belong to the registry), or a refusal.  frame: the storages' own. */
int registry_batch_step(struct registry *reg, struct reg_batch *b,
                        const struct sp_frame *frame, size_t budget, char *msg,
                        size_t msglen);
/* Frees a batch, and what it took that the registry did not keep; never
 * touches a registry. */
/* Closes the CUDA storages the batch opened and no registry kept: on the
 * loop's thread, where they were opened, before the batch may be freed on
 * another. */
void registry_batch_close_opened(struct reg_batch *b);
void registry_batch_free(struct reg_batch *b);
/* Checks and registers n tensors; all or none.  On success each tensor's
 * pieces belong to the registry (t[i].pieces is NULL). */
int registry_add_tensors(struct registry *reg, struct req_tensor *t, size_t n,
                         char *msg, size_t msglen);
/* The storage index of sid, or IDXSET_NONE. */
uint32_t registry_find_sid(const struct registry *reg, uint32_t sid);
/* Adds the rank's registrations, with its together-groups, to the
 * planner's input (plan_input_add_rank): the one way a registry, a local
 * rank's or a remote rank's shadow, becomes what the planner reads.  The
 * input borrows names, storages and pieces from reg. */
int registry_plan_rank(const struct registry *reg, uint32_t rank, uint64_t node,
                       const struct req_groups *groups,
                       struct plan_input_store *store, char *msg,
                       size_t msglen);
/* Registers n storages of a rank on another node (mesh.c): what the
 * planner needs (sid, base, length, device), no memory; the same checks
 * as registry_add_storages.  All or none. */
int registry_add_remote_storages(struct registry *reg,
                                 const struct req_storage *s,
                                 const struct sp_device *device, size_t n,
                                 char *msg, size_t msglen);

#endif /* SP_DAEMON_REGISTRY_H */
