/*
 * plancache.c - a job's last plan, reused by its next export when nothing
 * the plan depends on changed; see plancache.h.
 *
 * The registrations are part of the key without being compared: any
 * change to them or to the members drops the cache (plancache_drop, from
 * job.c and registration.c).  What remains to compare are the options and
 * every rank's groups, byte for byte (request.c keeps them as one blob).
 */
#include <stdlib.h>
#include <string.h>

#include "daemon/export_run.h"
#include "daemon/job.h"
#include "daemon/plan/plan.h"
#include "daemon/plancache.h"
#include "shardport.h"

static void free_cache(struct job *job) {
  struct plancache *c = &job->cache;
  plan_free(c->plan);
  c->plan = NULL;
  plan_input_store_free(c->input);
  c->input = NULL;
  publish_layout_free(&c->layout);
  if (c->groups != NULL)
    for (uint32_t r = 0; r < job->world; r++)
      free(c->groups[r]);
  free(c->groups);
  free(c->groups_len);
  c->groups = NULL;
  c->groups_len = NULL;
  c->stale = false;
}

void plancache_drop(struct job *job) {
  /* The running export reads the cached plan until it finishes. */
  if (job->running != NULL)
    job->cache.stale = true;
  else
    free_cache(job);
}

void plancache_export_ended(struct job *job) {
  if (job->cache.stale)
    free_cache(job);
}

bool plancache_applies(const struct export *ex) {
  const struct job *job = ex->job;
  const struct plancache *c = &job->cache;
  if (c->plan == NULL || c->max_keys != ex->max_keys ||
      c->max_bytes != ex->max_bytes)
    return false;
  for (uint32_t r = 0; r < job->world; r++) {
    const struct req_groups *g = &ex->ranks[r].groups;
    if (c->groups_len[r] != g->blob_len ||
        (g->blob_len > 0 && memcmp(c->groups[r], g->blob, g->blob_len) != 0))
      return false;
  }
  return true;
}

int plancache_install(struct export *ex) {
  struct job *job = ex->job;
  char **groups = calloc(job->world, sizeof *groups);
  size_t *lens = calloc(job->world, sizeof *lens);
  bool ok = groups != NULL && lens != NULL;
  for (uint32_t r = 0; ok && r < job->world; r++) {
    const struct req_groups *g = &ex->ranks[r].groups;
    lens[r] = g->blob_len;
    groups[r] = malloc(g->blob_len > 0 ? g->blob_len : 1);
    ok = groups[r] != NULL;
    if (ok && g->blob_len > 0)
      memcpy(groups[r], g->blob, g->blob_len);
  }
  if (!ok) {
    for (uint32_t r = 0; groups != NULL && r < job->world; r++)
      free(groups[r]);
    free(groups);
    free(lens);
    return SP_ENOMEM;
  }
  free_cache(job);
  struct plancache *c = &job->cache;
  c->plan = ex->new_plan;
  c->input = ex->store;
  c->layout = ex->new_layout;
  c->max_keys = ex->max_keys;
  c->max_bytes = ex->max_bytes;
  c->groups = groups;
  c->groups_len = lens;
  ex->new_plan = NULL;
  ex->store = NULL;
  memset(&ex->new_layout, 0, sizeof ex->new_layout);
  return 0;
}
