/*
 * mesh.c - a job across nodes: its daemons, how they find each other, and
 * how they agree on each export; see mesh.h, internal.h (which file of the
 * wing does what) and docs/protocol.md ("Between daemons").  This file
 * makes and ends a job's mesh, keeps its node table and reports it.
 *
 * The daemon that created the job is its root (node 0).  Its ticket names
 * the root's peer address; a daemon whose rank joins with that ticket keeps
 * a shadow of the job and a control link to the root; the two prove to
 * each other that they know the job's secret (peerauth.c: a challenge and
 * an HMAC each way, the secret never on the wire), the root gives the
 * daemon a node number, and decides every join (a rank joins once in the
 * whole job).  A shadow is a ticket's claim until its root proves it, so
 * shadows are kept per job id and secret (job.c), and a root's answers
 * are awaited for peer_timeout at most.  Data links, one per pair of nodes,
 * are opened when an export needs them (the higher node dials the lower)
 * and kept for the job's next exports.
 *
 * An export, in messages (member = every node, the root's own included):
 *   member -> root   ask + meta     a rank asked: its options, then its
 *                                   registrations as one opaque frame
 *   root -> member   plan + metas   every rank asked: the roster (nodes,
 *                                   addresses, each rank's node) and every
 *                                   rank's meta, the same bytes to all
 *   member -> root   planned        the plan's digest, once the data links
 *                                   to every other node are up
 *   root -> member   go             every digest is equal
 *   member -> root   moved          this node's rounds are done
 *   root -> member   publish        every node's are: owners get replies
 *   either way       fail           one code and message for every rank
 *   root -> member   abort          the job ended for good on the root
 *                                   (job_abort, or the root stopping):
 *                                   every node ends it with that error
 * The root relays and compares, so every daemon plans from the same bytes
 * and no rank is published to unless every node moved its data.  The
 * root's own node talks to the root through an inbox handled on the job's
 * next wake-up, never re-entering the caller.
 *
 * Faults: a control link that ends, a node that sends nothing for the
 * export's timeout (beats flow every MESH_BEAT_MS while an export is under
 * way), and a data link that fails mid-round (remote.c) fail the export on
 * every node with node_lost naming the node.  A node whose root is lost
 * cannot export again; the root frees a lost node's ranks.
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "daemon/mesh/internal.h"
#include "shardport.h"

bool mesh_is_root(const struct mesh *ms) { return ms->root; }

void mesh_lost_message(const char *job_hex, uint32_t node, const char *addr,
                       uint64_t export_id, char *buf, size_t len) {
  if (export_id > 0)
    snprintf(buf, len, "node %u (%s) was lost during export %" PRIu64
             " of job %s", node, addr, export_id, job_hex);
  else
    snprintf(buf, len, "node %u (%s) was lost while job %s's ranks waited "
             "for an export", node, addr, job_hex);
}

struct mesh_node *mesh_node_get(struct mesh *ms, uint32_t node) {
  return node < ms->nnodes ? ms->nodes[node] : NULL;
}

/* The node numbered node, made when new. */
struct mesh_node *mesh_node_make(struct mesh *ms, uint32_t node) {
  if (node >= NODE_MAX_NODES)
    return NULL;
  if (node >= ms->nnodes) {
    struct mesh_node **p = realloc(ms->nodes, (node + 1) * sizeof *p);
    if (p == NULL)
      return NULL;
    for (uint32_t i = ms->nnodes; i <= node; i++)
      p[i] = NULL;
    ms->nodes = p;
    ms->nnodes = node + 1;
  }
  if (ms->nodes[node] == NULL) {
    struct mesh_node *n = calloc(1, sizeof *n);
    if (n == NULL)
      return NULL;
    n->mesh = ms;
    n->node = node;
    for (uint32_t i = 0; i < REMOTE_STREAMS_MAX; i++)
      n->streams[i] = (struct mesh_stream){
          .node = n, .index = i, .data = -1, .data_next = -1};
    snprintf(n->addr, sizeof n->addr, "?");
    ms->nodes[node] = n;
  }
  return ms->nodes[node];
}

void mesh_node_close_data(struct mesh_node *n) {
  for (uint32_t i = 0; i < REMOTE_STREAMS_MAX; i++) {
    struct mesh_stream *st = &n->streams[i];
    nodelink_close(st->dlink);
    st->dlink = NULL;
    if (st->data >= 0)
      close(st->data);
    if (st->data_next >= 0)
      close(st->data_next);
    st->data = st->data_next = -1;
  }
}

struct mesh *mesh_alloc(struct job *job, bool root) {
  struct mesh *ms = calloc(1, sizeof *ms);
  if (ms == NULL)
    return NULL;
  ms->job = job;
  ms->srv = job->srv;
  ms->ops = job->srv->mesh_ops;
  ms->root = root;
  ms->gather = 1;
  ms->cgather = 1;
  ms->next_export_id = 1;
  ms->ask_sent = calloc(job->world, sizeof *ms->ask_sent);
  ms->sent_meta = calloc(job->world, sizeof *ms->sent_meta);
  if (ms->ask_sent == NULL || ms->sent_meta == NULL) {
    free(ms->ask_sent);
    free(ms->sent_meta);
    free(ms);
    return NULL;
  }
  return ms;
}

int mesh_create_root(struct job *job) {
  struct server *srv = job->srv;
  struct mesh *ms = mesh_alloc(job, true);
  if (ms == NULL)
    return SP_ENOMEM;
  ms->rank_node = malloc(job->world * sizeof *ms->rank_node);
  ms->asks = calloc(job->world, sizeof *ms->asks);
  struct mesh_node *self =
      ms->rank_node != NULL && ms->asks != NULL ? mesh_node_make(ms, 0) : NULL;
  if (self == NULL) {
    mesh_free(ms);
    return SP_ENOMEM;
  }
  for (uint32_t r = 0; r < job->world; r++)
    ms->rank_node[r] = PLAN_NONE;
  self->node_id = srv->node_id;
  self->present = true;
  snprintf(self->addr, sizeof self->addr, "%s", srv->peer_address);
  job->mesh = ms;
  return 0;
}

void mesh_free(struct mesh *ms) {
  if (ms == NULL)
    return;
  if (ms->root_link != NULL) {
    if (ms->hello_done) {
      struct nodemsg bye = {.op = NODEMSG_BYE};
      inbox_send(ms->root_link, &bye);
      nodelink_close_after_flush(ms->root_link);
    } else {
      nodelink_close(ms->root_link);
    }
  }
  join_refuse_all(ms, SP_ETICKET, "the job ended");
  for (uint32_t i = 0; i < ms->nnodes; i++) {
    struct mesh_node *n = ms->nodes[i];
    if (n == NULL)
      continue;
    nodelink_close(n->ctl);
    mesh_node_close_data(n);
    free(n->replicas);
    free(n);
  }
  free(ms->nodes);
  while (ms->inbox_head != NULL) {
    struct inbox_item *it = ms->inbox_head;
    ms->inbox_head = it->next;
    inbox_item_free(it);
  }
  for (uint32_t r = 0; ms->asks != NULL && r < ms->job->world; r++)
    nodeblob_unref(ms->asks[r].meta);
  if (ms->incoming != NULL)
    ms->incoming->mesh = NULL;
  if (ms->ready != NULL)
    ms->ready->mesh = NULL;
  mesh_export_free(ms->incoming);
  mesh_export_free(ms->ready);
  /* The running export owns its part and outlives nothing here: the job
   * ends only once no export runs. */
  if (ms->current != NULL)
    ms->current->mesh = NULL;
  free(ms->asks);
  free(ms->rank_node);
  free(ms->ask_sent);
  for (uint32_t r = 0; r < ms->job->world; r++)
    nodeblob_unref(ms->sent_meta[r]);
  free(ms->sent_meta);
  free(ms->planned_replicas);
  free(ms);
}

/* The root ends the job for good (job_abort, or its daemon stopping): each
 * node hears it before its control link closes, so that the ranks there
 * fail with the root's code and message, not with node_lost.  The nodes
 * leave the job at once, as if they had said goodbye, so that the root's
 * part of it may end. */
void mesh_job_ended(struct job *job, int code, const char *message) {
  struct mesh *ms = job->mesh;
  if (ms == NULL || !ms->root)
    return;
  struct nodemsg a = {.op = NODEMSG_ABORT, .code = code};
  snprintf(a.message, sizeof a.message, "%s", message);
  for (uint32_t i = 1; i < ms->nnodes; i++) {
    struct mesh_node *n = ms->nodes[i];
    if (n == NULL || !n->present || n->ctl == NULL)
      continue;
    inbox_send(n->ctl, &a);
    nodelink_close_after_flush(n->ctl);
    n->ctl = NULL;
    n->present = false;
    n->in_export = false;
    n->nranks = 0;
  }
}

void mesh_data_lost(struct job *job, uint32_t node, const char *why) {
  struct mesh *ms = job->mesh;
  if (ms == NULL || !ms->root || node == 0 || node >= ms->nnodes ||
      ms->nodes[node] == NULL)
    return;
  struct mesh_node *n = ms->nodes[node];
  /* A node whose control link spoke within two beats is alive: one of its
   * data streams failed (reset, closed), the export with it, and the next
   * export dials the link again.  One silent as long is cut off, and goes
   * at once rather than when TCP gives up on its control link. */
  if (n->ctl != NULL && ms->ops->now_ms() - n->heard_ms <= 2 * MESH_BEAT_MS)
    return;
  coord_node_lost(ms, n, why);
}

bool mesh_may_end(const struct job *job) {
  const struct mesh *ms = job->mesh;
  if (ms->joins != NULL)
    return false;
  if (!ms->root)
    return true;
  for (uint32_t i = 1; i < ms->nnodes; i++)
    if (ms->nodes[i] != NULL && ms->nodes[i]->present &&
        ms->nodes[i]->nranks > 0)
      return false;
  return true;
}

bool mesh_active(const struct job *job) {
  const struct mesh *ms = job->mesh;
  if (ms->incoming != NULL || ms->ready != NULL ||
      (ms->current != NULL && !ms->current->published))
    return true;
  if (ms->root && (ms->nasked > 0 || ms->cstate != COORD_IDLE))
    return true;
  for (uint32_t r = 0; r < job->world; r++)
    if (ms->ask_sent[r] != 0)
      return true;
  return false;
}

void mesh_status_pack(const struct job *job, msgpack_packer *pk) {
  const struct mesh *ms = job->mesh;
  uint32_t count = 0;
  for (uint32_t i = 0; ms != NULL && i < ms->nnodes; i++)
    count += ms->nodes[i] != NULL && ms->nodes[i]->present;
  sp__pack_str(pk, "nodes");
  msgpack_pack_array(pk, count);
  for (uint32_t i = 0; ms != NULL && i < ms->nnodes; i++) {
    const struct mesh_node *n = ms->nodes[i];
    if (n == NULL || !n->present)
      continue;
    bool self = n->node == ms->self;
    bool connected = self || datalink_up(n) || n->ctl != NULL ||
                     (n->node == 0 && ms->root_link != NULL && ms->hello_done);
    msgpack_pack_map(pk, 6);
    sp__pack_kv_u64(pk, "node", n->node);
    sp__pack_kv_str(pk, "address", n->addr);
    sp__pack_kv_bool(pk, "self", self);
    sp__pack_kv_bool(pk, "connected", connected);
    sp__pack_kv_u64(pk, "bytes_sent",
                    atomic_load_explicit(&n->sent, memory_order_relaxed));
    sp__pack_kv_u64(pk, "bytes_received",
                    atomic_load_explicit(&n->received, memory_order_relaxed));
  }
}

uint32_t mesh_self(const struct job *job) {
  return job->mesh != NULL ? job->mesh->self : 0;
}

uint32_t mesh_node_count(const struct job *job) {
  const struct mesh *ms = job->mesh;
  uint32_t count = 0;
  for (uint32_t i = 0; ms != NULL && i < ms->nnodes; i++)
    count += ms->nodes[i] != NULL && ms->nodes[i]->present;
  return count;
}

bool mesh_rank_where(const struct job *job, uint32_t rank, uint32_t *node,
                     bool *asked) {
  const struct mesh *ms = job->mesh;
  if (ms == NULL || !ms->root || ms->rank_node[rank] == PLAN_NONE)
    return false;
  *node = ms->rank_node[rank];
  *asked = ms->asks[rank].asked;
  return true;
}
