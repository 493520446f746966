/*
 * gathered.c - what one export takes from the mesh: the roster and every
 * rank's registrations the root relayed, read into the planner's input on
 * the planning thread, and the data plane to the other nodes.
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "daemon/mesh/internal.h"
#include "daemon/metrics.h"
#include "shardport.h"

static void gathered_free_inputs(struct mesh_export *mx) {
  for (uint32_t r = 0; r < mx->world; r++) {
    if (mx->shadow != NULL)
      registry_free(&mx->shadow[r]);
    if (mx->groups != NULL)
      request_groups_free(&mx->groups[r]);
  }
  free(mx->shadow);
  free(mx->groups);
  mx->shadow = NULL;
  mx->groups = NULL;
}

bool mesh_nccl_id(const struct mesh_export *mx, uint8_t id[NODE_NCCL_ID_BYTES],
                  uint64_t *gen) {
  *gen = mx->comm_gen;
  memcpy(id, mx->nccl_id, NODE_NCCL_ID_BYTES);
  return mx->comm_gen > 0 || mx->mesh->job->has_nccl_id;
}

void mesh_export_free(struct mesh_export *mx) {
  if (mx == NULL)
    return;
  struct mesh *ms = mx->mesh;
  if (ms != NULL && ms->current == mx)
    ms->current = NULL;
  for (size_t i = 0; ms != NULL && !mx->published && i < mx->nnodes; i++) {
    struct mesh_node *n = mesh_node_get(ms, mx->nodes[i].node);
    if (n != NULL && n->failed_export < mx->export_id)
      n->failed_export = mx->export_id;
  }
  remote_free(mx->remote);
  gathered_free_inputs(mx);
  for (uint32_t r = 0; r < mx->nmetas; r++)
    nodeblob_unref(mx->metas[r]);
  free(mx->metas);
  free(mx->rank_nodes);
  free(mx->nodes);
  free(mx);
}

bool gathered_in_roster(const struct mesh_export *mx, uint32_t node) {
  for (size_t i = 0; i < mx->nnodes; i++)
    if (mx->nodes[i].node == node)
      return true;
  return false;
}

int mesh_plan_input(struct mesh_export *mx, struct plan_input_store *store,
                    char *msg, size_t msglen) {
  uint32_t world = mx->world;
  mx->shadow = calloc(world, sizeof *mx->shadow);
  mx->groups = calloc(world, sizeof *mx->groups);
  if (mx->shadow == NULL || mx->groups == NULL) {
    snprintf(msg, msglen, "out of memory reading the ranks' registrations");
    return SP_ENOMEM;
  }
  for (uint32_t r = 0; r < world; r++)
    registry_init(&mx->shadow[r], SP_DEVICE_CPU);
  for (uint32_t r = 0; r < world; r++) {
    char why[SP_ERRMSG_MAX / 2];
    const struct nodeblob *b = mx->metas[r];
    int rc = nodemsg_parse_meta(b->payload, b->len, r, &mx->shadow[r],
                                &mx->groups[r], why, sizeof why);
    if (rc != 0) {
      /* The same bytes give the same refusal on every node. */
      snprintf(msg, msglen, "the registrations of rank %" PRIu32
               " (node %" PRIu32 ") cannot be read: %s", r,
               mx->rank_nodes[r], why);
      return rc;
    }
    rc = registry_plan_rank(&mx->shadow[r], r, mx->rank_nodes[r],
                            &mx->groups[r], store, msg, msglen);
    if (rc != 0)
      return rc;
  }
  struct plan_input *in = plan_input_of(store);
  in->max_keys = mx->max_keys;
  in->max_bytes = mx->max_bytes;
  return 0;
}

/* The exchange's lost peer (remote.h), on the engine's thread: arg is the
 * job's id in hex, which lives as long as the job. */
static void remote_node_lost(void *arg, uint32_t node, const char *addr,
                             uint64_t export_id, int why, char *msg,
                             size_t msglen) {
  const char *job_hex = arg;
  if (why != 0)
    log_with(LOG_LEVEL_INFO, LOG_JOB(job_hex),
             "job %s: export %" PRIu64 ": node %" PRIu32 " (%s): %s", job_hex,
             export_id, node, addr,
             why == SP_ETIMEOUT ? "moved nothing within the export's timeout"
                                : sp_strerror(why));
  mesh_lost_message(job_hex, node, addr, export_id, msg, msglen);
}

int mesh_remote(struct job *job, struct mesh_export *mx,
                const struct plan *plan, const struct xfer_storage *const *src,
                uint8_t *const *dst, const uint64_t *key_offset,
                struct remote **out) {
  struct mesh *ms = job->mesh;
  uint32_t nnodes = 0;
  for (size_t i = 0; i < mx->nnodes; i++)
    if (mx->nodes[i].node + 1 > nnodes)
      nnodes = mx->nodes[i].node + 1;
  struct remote_peer_setup *peers = calloc(nnodes, sizeof *peers);
  if (peers == NULL)
    return SP_ENOMEM;
  for (uint32_t n = 0; n < nnodes; n++) {
    for (uint32_t i = 0; i < REMOTE_STREAMS_MAX; i++)
      peers[n].socks[i] = -1;
    struct mesh_node *node = mesh_node_get(ms, n);
    if (node == NULL)
      continue;
    _Static_assert(sizeof peers[n].addr >= NODE_ADDR_MAX,
                   "a node's address fits the exchange's copy");
    snprintf(peers[n].addr, sizeof peers[n].addr, "%s", node->addr);
    peers[n].sent[0] = &node->sent;
    peers[n].received[0] = &node->received;
    struct metrics_peer *mp =
        n != ms->self ? metrics_peer(job->srv->metrics, node->addr) : NULL;
    if (mp != NULL) {
      peers[n].sent[1] = &mp->sent;
      peers[n].received[1] = &mp->received;
    }
    if (n != ms->self && gathered_in_roster(mx, n)) {
      peers[n].nsocks = node->nstreams > 0 ? node->nstreams : 1;
      for (uint32_t i = 0; i < node->nstreams; i++)
        peers[n].socks[i] = node->streams[i].data;
    }
  }
  struct remote_setup s = {
      .plan = plan,
      .self = ms->self,
      .nnodes = nnodes,
      .peers = peers,
      .src = src,
      .dst = dst,
      .key_offset = key_offset,
      .export_id = mx->export_id,
      .timeout_ms = mx->timeout_ms,
      .ops = {.node_lost = remote_node_lost, .arg = job->hex}};
  int rc = remote_new(&s, &mx->remote);
  free(peers);
  if (rc == 0)
    *out = mx->remote;
  return rc;
}
