/*
 * plancache.h - a job's last plan and its layout, kept for the next
 * export (plancache.c).
 */
#ifndef SP_DAEMON_PLANCACHE_H
#define SP_DAEMON_PLANCACHE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "daemon/layer.h"
#include "daemon/publish.h"

struct export;
struct job;
struct plan;
struct plan_input_store;

/* The plan an export with the same registrations, groups and options
 * reuses (job->cache): planning a big job takes long, and a trainer
 * exports the same tensors at every checkpoint. */
struct plancache {
  struct plan *plan; /* NULL: none kept */
  struct plan_input_store *input; /* what plan borrows */
  struct publish_layout layout;
  uint64_t max_bytes;
  uint32_t max_keys;
  char **groups; /* [world] group blobs */
  size_t *groups_len;
  /* Registrations or members changed while an export used it. */
  bool stale;
};

/* Registrations or members of the job changed: the cache goes, once no
 * export reads it. */
void plancache_drop(struct job *job);
/* The job's running export ended: a cache that went stale meanwhile goes
 * now. */
void plancache_export_ended(struct job *job);
/* Whether the cache holds the plan of export ex: the same options, and
 * every rank asked with the same groups. */
bool plancache_applies(const struct export *ex);
/* The plan ex built becomes the job's cache (ex then reads it there): 0,
 * or SP_ENOMEM with the cache and ex's plan as they were. */
int plancache_install(struct export *ex);

#endif /* SP_DAEMON_PLANCACHE_H */
