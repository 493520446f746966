/*
 * tick.c - time in a job across nodes: beats flow every MESH_BEAT_MS
 * while an export is under way, a member gives up on a root silent past
 * the export's timeout, and the root on a node or a gather that waits
 * past it.
 */
#include <inttypes.h>
#include <stdio.h>

#include "daemon/mesh/internal.h"
#include "shardport.h"

static uint32_t member_timeout(const struct mesh *ms) {
  const struct job *job = ms->job;
  if ((ms->current != NULL && !ms->current->published) || ms->ready != NULL ||
      ms->incoming != NULL)
    return ms->timeout_ms;
  uint32_t t = UINT32_MAX;
  for (uint32_t r = 0; r < job->world; r++) {
    const struct job_member *m = job->members[r];
    if (m == NULL || !m->asked || ms->ask_sent[r] == 0)
      continue;
    uint32_t mt = m->ask.timeout_ms > 0 ? m->ask.timeout_ms
                                        : job->srv->cfg->export_timeout_ms;
    if (mt < t)
      t = mt;
  }
  return t;
}

void mesh_tick(struct job *job) {
  struct mesh *ms = job->mesh;
  uint64_t now = ms->ops->now_ms();
  if (!mesh_active(job))
    return;
  /* Member: beats to the root, and the root's silence. */
  if (!ms->root && ms->root_link != NULL && ms->hello_done) {
    if (now - ms->beat_ms >= MESH_BEAT_MS) {
      struct nodemsg b = {.op = NODEMSG_BEAT, .gather = ms->gather};
      inbox_send(ms->root_link, &b);
      ms->beat_ms = now;
    }
    uint32_t t = member_timeout(ms);
    if (t != UINT32_MAX && now - ms->heard_ms > (uint64_t)t + MESH_GRACE_MS) {
      char why[64];
      snprintf(why, sizeof why, "silent for %" PRIu64 " ms",
               now - ms->heard_ms);
      rootlink_lost(ms, why);
      return;
    }
  }
  if (!ms->root)
    return;
  /* Root: beats to every node, and theirs. */
  if (now - ms->cbeat_ms >= MESH_BEAT_MS) {
    struct nodemsg b = {.op = NODEMSG_BEAT, .gather = ms->cgather};
    for (uint32_t i = 1; i < ms->nnodes; i++)
      if (ms->nodes[i] != NULL && ms->nodes[i]->present)
        inbox_to_node(ms, i, &b, NULL, 0);
    ms->cbeat_ms = now;
  }
  uint32_t gather_timeout = UINT32_MAX;
  for (uint32_t r = 0; r < job->world; r++)
    if (ms->asks[r].asked) {
      uint32_t t = ms->asks[r].timeout_ms > 0
                       ? ms->asks[r].timeout_ms
                       : job->srv->cfg->export_timeout_ms;
      if (t < gather_timeout)
        gather_timeout = t;
    }
  for (uint32_t i = 1; i < ms->nnodes; i++) {
    struct mesh_node *n = ms->nodes[i];
    if (n == NULL || !n->present)
      continue;
    /* Only a node the export waits on must keep talking. */
    bool asking = false;
    for (uint32_t r = 0; r < job->world && !asking; r++)
      asking = ms->asks[r].asked && ms->rank_node[r] == n->node;
    uint32_t t = n->in_export && ms->cstate != COORD_IDLE ? ms->ctimeout
                 : asking                                  ? gather_timeout
                                                           : UINT32_MAX;
    if (t != UINT32_MAX && now - n->heard_ms > t) {
      char why[64];
      snprintf(why, sizeof why, "silent for %" PRIu64 " ms",
               now - n->heard_ms);
      coord_node_lost(ms, n, why);
    }
  }
  struct gather_ranks g = coord_gather_ranks(ms);
  char msg[300];
  int rc = gather_overdue(&g, now, job->hex, msg, sizeof msg);
  if (rc != 0)
    coord_gather_fail(ms, rc, msg);
}
