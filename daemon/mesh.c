/*
 * mesh.c - a job across nodes: its daemons, how they find each other, and
 * how they agree on each export; see daemon.h and docs/protocol.md
 * ("Between daemons").
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
#include <errno.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "daemon/config.h"
#include "daemon/conn.h"
#include "daemon/daemon.h"
#include "daemon/export.h"
#include "daemon/job.h"
#include "daemon/log.h"
#include "daemon/metrics.h"
#include "daemon/quota.h"
#include "daemon/registry.h"
#include "daemon/request.h"
#include "daemon/server.h"
#include "proto/monotonic.h"
#include "shardport.h"

/* While an export is under way, each side says it is alive this often. */
#define MESH_BEAT_MS 500
/* How much longer than its ranks' timeout a member waits for the root to
 * decide a gather before it gives up on it. */
#define MESH_GRACE_MS 2000

struct mesh_node {
  struct mesh *mesh;
  uint32_t node;
  uint64_t node_id;
  char addr[NODE_ADDR_MAX];
  bool present;          /* part of the job now */
  struct nodelink *ctl;  /* root: the node's control link */
  struct nodelink *dlink; /* a data link in its handshake */
  bool dlink_hello_sent;  /* dialled: its peer_data answered the challenge */
  int data;              /* the data socket, or -1 */
  int data_next;         /* a newer one, taken at the next export */
  uint32_t nranks;       /* root: ranks joined there */
  /* Root: the node's part in the export being agreed, and its lowest
   * rank's digests of the replicated and plain keys (none when it
   * compares none). */
  bool in_export, planned, moved;
  uint64_t digest;
  uint32_t replica_rank;
  size_t nreplicas;
  uint64_t *replicas;
  uint64_t heard_ms;
  bool ask_pending; /* its next frame is the meta of ask */
  struct nodemsg ask;
  _Atomic uint64_t sent, received;
};

struct pending_join {
  struct pending_join *next;
  uint64_t seq;
  uint64_t conn_id;
  uint64_t request_id;
  struct req_join req; /* its ticket pointer is not kept */
  int device;
};

struct inbox_item {
  struct inbox_item *next;
  bool to_root;
  uint32_t from; /* the sending node, for the root */
  struct nodemsg msg;
  struct nodeblob **blobs;
  size_t nblobs;
};

struct mesh_ask {
  bool asked;
  uint32_t max_keys;
  uint64_t max_bytes;
  uint32_t timeout_ms;
  uint64_t deadline_ms;
  struct nodeblob *meta;
};

/* What one export takes from the mesh (daemon.h). */
struct mesh_export {
  struct mesh *mesh;
  uint64_t gather, export_id;
  uint32_t world;
  uint32_t max_keys, timeout_ms;
  uint64_t max_bytes;
  uint32_t *rank_nodes;
  struct nodemsg_node *nodes;
  size_t nnodes;
  struct nodeblob **metas;
  uint32_t nmetas;
  /* The job's communicators for it: their generation and, from 1 on, the
   * fresh NCCL id the root sent (generation 0 is the ticket's id). */
  uint64_t comm_gen;
  uint8_t nccl_id[NODE_NCCL_ID_BYTES];
  /* Filled on the planning thread. */
  struct registry *shadow;
  struct req_groups *groups;
  struct plan_rank_in *rin;
  struct remote *remote;
  /* The root said go: the engine may use the data sockets. */
  bool moving;
  /* The root said publish: the root has no more to say about it. */
  bool published;
};

struct mesh {
  struct job *job;
  struct server *srv;
  bool root;
  uint32_t self;
  struct mesh_node **nodes; /* by node number; NULL where none */
  uint32_t nnodes;
  /* Member side. */
  struct nodelink *root_link;
  char root_addr[NODE_ADDR_MAX];
  bool hello_sent; /* peer_hello answered the root's challenge */
  bool hello_done; /* the root proved it knows the job's secret */
  bool broken;
  int broken_code;
  char broken_msg[SP_ERRMSG_MAX + 1];
  uint64_t next_seq;
  struct pending_join *joins;
  uint64_t gather;
  uint64_t *ask_sent; /* [world]: ask id + 1 sent in this gather */
  /* [world]: the registrations this node last sent for each of its ranks.
   * The root relays every rank's back to every node; a node plans on them
   * but reads its own ranks' memory, so what comes back for its own ranks
   * must be exactly what it sent, or a peer could point its reads outside
   * what the trainers registered. */
  struct nodeblob **sent_meta;
  struct mesh_export *incoming, *ready, *current;
  bool awaiting_links;
  uint64_t planned_digest;
  /* What `planned` tells the root of this node's replicated keys. */
  uint32_t planned_replica_rank;
  size_t planned_nreplicas;
  uint64_t *planned_replicas;
  uint64_t heard_ms, beat_ms;
  uint32_t timeout_ms; /* of the export under way */
  /* Root. */
  uint32_t *rank_node; /* [world] */
  struct mesh_ask *asks;
  uint32_t nasked;
  uint64_t cgather;
  enum { COORD_IDLE, COORD_PLANNING, COORD_MOVING } cstate;
  uint64_t cexport_gather, cexport_id;
  uint32_t ctimeout;
  uint64_t next_export_id;
  uint64_t cbeat_ms;
  /* The job's NCCL communicators across nodes: their generation and its
   * id (a fresh ncclGetUniqueId from 1 on; 0 is the ticket's), whether
   * the export planned last across nodes has not published (its failure
   * may have aborted them), and whether the next one needs a new
   * generation because of that. */
  uint64_t comm_gen;
  uint8_t comm_id[NODE_NCCL_ID_BYTES];
  bool comm_pending, comm_stale;
  struct inbox_item *inbox_head, *inbox_tail;
};

static void member_handle(struct mesh *ms, const struct nodemsg *m,
                          struct nodeblob **blobs, size_t nblobs);
static void coord_handle(struct mesh *ms, uint32_t from, const struct nodemsg *m,
                         struct nodeblob *blob);
static void root_lost(struct mesh *ms, const char *why);
static void root_ended(struct mesh *ms, const struct nodemsg *m);
static void node_lost(struct mesh *ms, struct mesh_node *n, const char *why);
static void maybe_send_planned(struct mesh *ms);
static void data_fail(struct mesh_node *n, const char *why);

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

/* ---- nodes ---- */

static struct mesh_node *node_get(struct mesh *ms, uint32_t node) {
  return node < ms->nnodes ? ms->nodes[node] : NULL;
}

/* The node numbered node, made when new. */
static struct mesh_node *node_make(struct mesh *ms, uint32_t node) {
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
    n->data = n->data_next = -1;
    snprintf(n->addr, sizeof n->addr, "?");
    ms->nodes[node] = n;
  }
  return ms->nodes[node];
}

static void node_close_data(struct mesh_node *n) {
  nodelink_close(n->dlink);
  n->dlink = NULL;
  if (n->data >= 0)
    close(n->data);
  if (n->data_next >= 0)
    close(n->data_next);
  n->data = n->data_next = -1;
}

/* ---- messages ---- */

static void inbox_push(struct mesh *ms, bool to_root, uint32_t from,
                       const struct nodemsg *m, struct nodeblob **blobs,
                       size_t nblobs) {
  struct inbox_item *it = calloc(1, sizeof *it);
  if (it == NULL || (nblobs > 0 &&
                     (it->blobs = calloc(nblobs, sizeof *it->blobs)) == NULL)) {
    free(it);
    log_with(LOG_LEVEL_ERROR, LOG_JOB(ms->job->hex),
             "job %s: out of memory queueing a message", ms->job->hex);
    return;
  }
  it->to_root = to_root;
  it->from = from;
  it->msg = *m;
  /* The message's arrays are the item's own copies. */
  it->msg.nodes = NULL;
  it->msg.rank_nodes = NULL;
  if (m->nnodes > 0) {
    it->msg.nodes = malloc(m->nnodes * sizeof *m->nodes);
    it->msg.rank_nodes = malloc(m->world * sizeof *m->rank_nodes);
    if (it->msg.nodes == NULL || it->msg.rank_nodes == NULL) {
      nodemsg_free(&it->msg);
      free(it->blobs);
      free(it);
      log_with(LOG_LEVEL_ERROR, LOG_JOB(ms->job->hex),
               "job %s: out of memory queueing a message", ms->job->hex);
      return;
    }
    memcpy(it->msg.nodes, m->nodes, m->nnodes * sizeof *m->nodes);
    memcpy(it->msg.rank_nodes, m->rank_nodes,
           m->world * sizeof *m->rank_nodes);
  }
  it->msg.replicas = NULL;
  if (m->nreplicas > 0) {
    it->msg.replicas = malloc(m->nreplicas * sizeof *m->replicas);
    if (it->msg.replicas == NULL) {
      nodemsg_free(&it->msg);
      free(it->blobs);
      free(it);
      log_with(LOG_LEVEL_ERROR, LOG_JOB(ms->job->hex),
               "job %s: out of memory queueing a message", ms->job->hex);
      return;
    }
    memcpy(it->msg.replicas, m->replicas,
           m->nreplicas * sizeof *m->replicas);
  }
  for (size_t i = 0; i < nblobs; i++)
    it->blobs[i] = nodeblob_ref(blobs[i]);
  it->nblobs = nblobs;
  if (ms->inbox_tail != NULL)
    ms->inbox_tail->next = it;
  else
    ms->inbox_head = it;
  ms->inbox_tail = it;
  job_wake(ms->job);
}

static void inbox_free(struct inbox_item *it) {
  for (size_t i = 0; i < it->nblobs; i++)
    nodeblob_unref(it->blobs[i]);
  free(it->blobs);
  nodemsg_free(&it->msg);
  free(it);
}

void mesh_advance(struct job *job) {
  struct mesh *ms = job->mesh;
  /* A shadow nobody joins, or is joining, has nothing to wait for. */
  if (!ms->root && !job->ever_joined && ms->joins == NULL) {
    job_end(job);
    return;
  }
  while (ms->inbox_head != NULL) {
    struct inbox_item *it = ms->inbox_head;
    ms->inbox_head = it->next;
    if (ms->inbox_head == NULL)
      ms->inbox_tail = NULL;
    if (it->to_root)
      coord_handle(ms, it->from, &it->msg, it->nblobs > 0 ? it->blobs[0] : NULL);
    else
      member_handle(ms, &it->msg, it->blobs, it->nblobs);
    inbox_free(it);
  }
}

static int link_send_msg(struct nodelink *l, const struct nodemsg *m) {
  struct sp_msgbuf mb;
  nodemsg_pack(m, &mb);
  return nodelink_send(l, &mb);
}

/* A member's message to the root: by the inbox on the root's own node. */
static void to_root(struct mesh *ms, const struct nodemsg *m,
                    struct nodeblob *blob) {
  if (ms->root) {
    inbox_push(ms, true, 0, m, blob != NULL ? &blob : NULL, blob != NULL);
    return;
  }
  if (ms->root_link == NULL || !ms->hello_done)
    return;
  if (link_send_msg(ms->root_link, m) == 0 && blob != NULL)
    nodelink_send_blob(ms->root_link, blob);
}

/* The root's message to a node. */
static void to_node(struct mesh *ms, uint32_t node, const struct nodemsg *m,
                    struct nodeblob **blobs, size_t nblobs) {
  if (node == ms->self) {
    inbox_push(ms, false, 0, m, blobs, nblobs);
    return;
  }
  struct mesh_node *n = node_get(ms, node);
  if (n == NULL || n->ctl == NULL)
    return;
  if (link_send_msg(n->ctl, m) != 0)
    return;
  for (size_t i = 0; i < nblobs; i++)
    nodelink_send_blob(n->ctl, blobs[i]);
}

/* ---- creating and ending ---- */

static struct mesh *mesh_alloc(struct job *job, bool root) {
  struct mesh *ms = calloc(1, sizeof *ms);
  if (ms == NULL)
    return NULL;
  ms->job = job;
  ms->srv = job->srv;
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
  struct mesh_node *self = ms->rank_node != NULL && ms->asks != NULL
                               ? node_make(ms, 0)
                               : NULL;
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

static void export_free_inputs(struct mesh_export *mx) {
  for (uint32_t r = 0; r < mx->world; r++) {
    if (mx->shadow != NULL)
      registry_free(&mx->shadow[r]);
    if (mx->groups != NULL)
      request_groups_free(&mx->groups[r]);
  }
  free(mx->shadow);
  free(mx->groups);
  free(mx->rin);
  mx->shadow = NULL;
  mx->groups = NULL;
  mx->rin = NULL;
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
  remote_free(mx->remote);
  export_free_inputs(mx);
  for (uint32_t r = 0; r < mx->nmetas; r++)
    nodeblob_unref(mx->metas[r]);
  free(mx->metas);
  free(mx->rank_nodes);
  free(mx->nodes);
  free(mx);
}

static void joins_refuse(struct mesh *ms, int code, const char *message) {
  while (ms->joins != NULL) {
    struct pending_join *pj = ms->joins;
    ms->joins = pj->next;
    struct conn *c = conn_find(ms->srv, pj->conn_id);
    if (c != NULL)
      conn_send_error(c, pj->request_id, code, "join: %s", message);
    free(pj);
  }
}

void mesh_free(struct mesh *ms) {
  if (ms == NULL)
    return;
  if (ms->root_link != NULL) {
    if (ms->hello_done) {
      struct nodemsg bye = {.op = NODEMSG_BYE};
      link_send_msg(ms->root_link, &bye);
      nodelink_close_after_flush(ms->root_link);
    } else {
      nodelink_close(ms->root_link);
    }
  }
  joins_refuse(ms, SP_ETICKET, "the job ended");
  for (uint32_t i = 0; i < ms->nnodes; i++) {
    struct mesh_node *n = ms->nodes[i];
    if (n == NULL)
      continue;
    nodelink_close(n->ctl);
    node_close_data(n);
    free(n->replicas);
    free(n);
  }
  free(ms->nodes);
  while (ms->inbox_head != NULL) {
    struct inbox_item *it = ms->inbox_head;
    ms->inbox_head = it->next;
    inbox_free(it);
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
    link_send_msg(n->ctl, &a);
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
  node_lost(ms, ms->nodes[node], why);
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

/* ---- joins ---- */

static const struct nodelink_ops root_ops;

static void send_join(struct mesh *ms, struct pending_join *pj) {
  struct nodemsg m = {.op = NODEMSG_JOIN,
                      .id = pj->seq,
                      .rank = pj->req.rank,
                      .world = pj->req.world,
                      .device_type = pj->req.device_type};
  if (link_send_msg(ms->root_link, &m) == 0)
    nodelink_await(ms->root_link, true);
}

static int queue_join(struct mesh *ms, struct conn *c, uint64_t request_id,
                      const struct req_join *req, int device) {
  for (struct pending_join *p = ms->joins; p != NULL; p = p->next) {
    if (p->conn_id == conn_id(c))
      return conn_send_error(c, request_id, SP_ESTATE,
                             "join: this connection is already joining");
    if (p->req.rank == req->rank)
      return conn_send_error(c, request_id, SP_ERANK,
                             "join: rank %" PRIu32 " of job %s is joining "
                             "already",
                             req->rank, ms->job->hex);
  }
  struct pending_join *pj = calloc(1, sizeof *pj);
  if (pj == NULL)
    return conn_send_error(c, request_id, SP_ENOMEM, "join: out of memory");
  pj->seq = ++ms->next_seq;
  pj->conn_id = conn_id(c);
  pj->request_id = request_id;
  pj->req = *req;
  pj->req.ticket = NULL;
  pj->req.ticket_len = 0;
  pj->device = device;
  pj->next = ms->joins;
  ms->joins = pj;
  if (ms->hello_done)
    send_join(ms, pj);
  return 0;
}

int mesh_shadow_job(struct conn *c, const struct sp_msg_head *head,
                    const struct req_ticket *t, struct job **out) {
  struct server *srv = conn_server(c);
  *out = NULL;
  if (srv->peer_fd < 0)
    return conn_send_error(c, head->id, SP_ETICKET,
                           "join: the job's root daemon is %s; this daemon "
                           "does not take part in jobs across nodes "
                           "(peer_listen is off)",
                           t->root);
  if (srv->njobs >= srv->cfg->max_jobs)
    return conn_send_error(c, head->id, SP_ELIMIT,
                           "join: %" PRIu32 " jobs exist, the most max_jobs "
                           "allows",
                           srv->cfg->max_jobs);
  /* A shadow takes one of max_jobs as a created job does, so it counts
   * against the joining user's max_user_jobs: otherwise one user's joins
   * of jobs rooted elsewhere (or of tickets they wrote) could take every
   * job of this daemon. */
  char msg[256];
  struct quota_user *owner = quota_hold(srv, conn_uid(c), QUOTA_JOB);
  if (owner == NULL)
    return conn_send_error(c, head->id, SP_ENOMEM, "join: out of memory");
  int rc = quota_job_admit(owner, msg, sizeof msg);
  if (rc != 0) {
    quota_release(owner, QUOTA_JOB);
    return conn_send_error(c, head->id, rc, "join: %s", msg);
  }
  struct job *job = job_new(srv, t->job, t->secret, t->world);
  if (job == NULL) {
    quota_release(owner, QUOTA_JOB);
    return conn_send_error(c, head->id, SP_ENOMEM, "join: out of memory");
  }
  job->owner = owner;
  struct mesh *ms = mesh_alloc(job, false);
  if (ms == NULL) {
    job_end(job);
    return conn_send_error(c, head->id, SP_ENOMEM, "join: out of memory");
  }
  job->mesh = ms;
  snprintf(ms->root_addr, sizeof ms->root_addr, "%s", t->root);
  /* The id of the job's NCCL communicators, when its root serves GPUs. */
  job->has_nccl_id = t->has_nccl_id;
  if (t->has_nccl_id)
    memcpy(job->nccl_id, t->nccl_id, GPU_NCCL_ID_BYTES);
  /* A shadow whose join is refused before the root hears of it ends at
   * its next wake-up (mesh_advance). */
  job_wake(job);
  *out = job;
  return 0;
}

int mesh_join(struct job *job, struct conn *c, const struct sp_msg_head *head,
              const struct req_join *req, int device) {
  struct mesh *ms = job->mesh;
  if (ms->broken) {
    int rc = conn_send_error(c, head->id, ms->broken_code, "join: %s",
                             ms->broken_msg);
    return rc == 0 ? 1 : rc;
  }
  if (!ms->root) {
    if (ms->root_link == NULL) {
      if (nodelink_connect(ms->srv, ms->root_addr, &root_ops, ms,
                           &ms->root_link) != 0) {
        ms->root_link = NULL;
        int rc = conn_send_error(c, head->id, SP_ENODELOST,
                                 "join: cannot reach the job's root daemon "
                                 "at %s",
                                 ms->root_addr);
        return rc == 0 ? 1 : rc;
      }
      log_with(LOG_LEVEL_INFO, LOG_JOB(job->hex),
               "job %s: joining through its root daemon at "
               "%s",
               job->hex, ms->root_addr);
    }
    int rc = queue_join(ms, c, head->id, req, device);
    return rc == 0 ? 1 : rc;
  }
  uint32_t node = ms->rank_node[req->rank];
  if (node != PLAN_NONE) {
    struct mesh_node *n = node_get(ms, node);
    int rc = conn_send_error(c, head->id, SP_ERANK,
                             "join: rank %" PRIu32 " of job %s has already "
                             "joined on node %u (%s)",
                             req->rank, job->hex, node,
                             n != NULL ? n->addr : "?");
    return rc == 0 ? 1 : rc;
  }
  return 0;
}

void mesh_rank_joined(struct job *job, uint32_t rank) {
  struct mesh *ms = job->mesh;
  if (!ms->root)
    return;
  ms->rank_node[rank] = 0;
  ms->nodes[0]->nranks++;
}

/* The root's answer to a member's join. */
static void member_join_verdict(struct mesh *ms, const struct nodemsg *m) {
  struct pending_join **pp = &ms->joins;
  while (*pp != NULL && (*pp)->seq != m->id)
    pp = &(*pp)->next;
  struct pending_join *pj = *pp;
  if (pj == NULL)
    return;
  *pp = pj->next;
  /* The root's answers are awaited anew for the joins still out. */
  if (ms->root_link != NULL) {
    nodelink_await(ms->root_link, false);
    if (ms->joins != NULL)
      nodelink_await(ms->root_link, true);
  }
  struct conn *c = conn_find(ms->srv, pj->conn_id);
  struct job *job = ms->job;
  struct nodemsg left = {.op = NODEMSG_LEFT, .rank = pj->req.rank,
                         .disconnected = true};
  if (m->op == NODEMSG_ERROR) {
    if (c != NULL)
      conn_send_error(c, pj->request_id, m->code, "%s", m->message);
  } else if (c == NULL || conn_member(c) != NULL ||
             job->members[pj->req.rank] != NULL) {
    /* Joined at the root, but nobody is here to be it. */
    to_root(ms, &left, NULL);
    if (c != NULL)
      conn_send_error(c, pj->request_id, SP_ESTATE,
                      "join: this connection or rank joined meanwhile");
  } else if (job_admit(job, c, pj->request_id, &pj->req, pj->device) ==
             NULL) {
    to_root(ms, &left, NULL);
    conn_send_error(c, pj->request_id, SP_ENOMEM, "join: out of memory");
  }
  free(pj);
  job_wake(job);
}

void mesh_rank_left(struct job *job, uint32_t rank, bool disconnected,
                    const char *reason) {
  struct mesh *ms = job->mesh;
  ms->ask_sent[rank] = 0;
  struct nodemsg m = {.op = NODEMSG_LEFT, .rank = rank,
                      .disconnected = disconnected};
  if (reason != NULL)
    snprintf(m.message, sizeof m.message, "%s", reason);
  to_root(ms, &m, NULL);
}

/* ---- the member side of an export ---- */

void mesh_asks(struct job *job) {
  struct mesh *ms = job->mesh;
  /* The root's silence counts from the first ask of a quiet job. */
  if (!mesh_active(job))
    ms->heard_ms = monotonic_ms();
  for (uint32_t r = 0; r < job->world; r++) {
    struct job_member *m = job->members[r];
    if (m == NULL || m->lost || !m->asked || ms->ask_sent[r] == m->ask_id + 1)
      continue;
    if (ms->broken) {
      job_answer_ask(m, ms->broken_code, ms->broken_msg);
      continue;
    }
    struct sp_msgbuf mb;
    struct sp_frame_tx tx;
    nodemsg_pack_meta(r, &m->reg, &m->ask.groups, &mb);
    struct nodeblob *meta = NULL;
    if (sp_msgbuf_finish(&mb, &tx) == 0) {
      meta = nodeblob_wrap(tx.buf, tx.buf + SP_FRAME_HEADER,
                           tx.len - SP_FRAME_HEADER);
      if (meta == NULL)
        free(tx.buf);
    }
    if (meta == NULL) {
      job_answer_ask(m, SP_ENOMEM, "out of memory sending the rank's "
                                   "registrations to the job's root");
      continue;
    }
    struct nodemsg a = {.op = NODEMSG_ASK,
                        .gather = ms->gather,
                        .rank = r,
                        .max_keys = m->ask.max_keys,
                        .max_bytes = m->ask.max_bytes,
                        .timeout_ms = m->ask.timeout_ms};
    nodeblob_unref(ms->sent_meta[r]);
    ms->sent_meta[r] = nodeblob_ref(meta);
    to_root(ms, &a, meta);
    nodeblob_unref(meta);
    ms->ask_sent[r] = m->ask_id + 1;
  }
}

static void new_gather(struct mesh *ms, uint64_t next) { ms->gather = next; }

/* The local asks were answered (failed): new asks go to the root again. */
static void forget_asks(struct mesh *ms) {
  memset(ms->ask_sent, 0, ms->job->world * sizeof *ms->ask_sent);
}

/* Brings the node table in line with a plan's roster. */
static int apply_roster(struct mesh *ms, const struct mesh_export *mx) {
  for (size_t i = 0; i < mx->nnodes; i++) {
    const struct nodemsg_node *r = &mx->nodes[i];
    struct mesh_node *n = node_make(ms, r->node);
    if (n == NULL)
      return SP_ENOMEM;
    if (n->node_id != r->node_id && n->node_id != 0)
      node_close_data(n);
    n->node_id = r->node_id;
    n->present = true;
    snprintf(n->addr, sizeof n->addr, "%s", r->addr);
  }
  return 0;
}

static bool in_roster(const struct mesh_export *mx, uint32_t node) {
  for (size_t i = 0; i < mx->nnodes; i++)
    if (mx->nodes[i].node == node)
      return true;
  return false;
}

/* A socket kept between exports may have died quietly: one that reads as
 * closed, failed, or holding bytes nobody sent it in an export, goes. */
static bool data_alive(int sock) {
  char byte;
  ssize_t n = recv(sock, &byte, 1, MSG_PEEK | MSG_DONTWAIT);
  return n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK);
}

static const struct nodelink_ops data_ops;

/* A dialled link's answer to the listener's challenge: this daemon's nonce
 * and proof in m, and in the link the proof the listener must send back. */
static void answer_challenge(struct nodelink *l, const struct job *job,
                             enum peerauth_link kind,
                             const uint8_t listener_nonce[PEERAUTH_NONCE_BYTES],
                             struct nodemsg *m) {
  m->version = NODE_PROTOCOL_VERSION;
  memcpy(m->job, job->id, JOB_ID_BYTES);
  peerauth_proof(job->secret, PEERAUTH_DIALER, kind, job->id, listener_nonce,
                 m->nonce, m->proof);
  peerauth_proof(job->secret, PEERAUTH_LISTENER, kind, job->id,
                 listener_nonce, m->nonce, nodelink_handshake(l));
}

static void on_data_detached(void *arg, int sock) {
  struct mesh_node *n = arg;
  n->dlink = NULL;
  if (sock < 0) {
    data_fail(n, "the handshake did not finish");
    return;
  }
  if (n->data >= 0)
    close(n->data);
  n->data = sock;
  log_with(LOG_LEVEL_DEBUG, LOG_JOB(n->mesh->job->hex),
           "job %s: data link to node %u (%s) up", n->mesh->job->hex, n->node,
           n->addr);
  maybe_send_planned(n->mesh);
}

/* The handshake of a data link this node dialled: the listener's
 * challenge, answered with peer_data, then its reply and proof; the bare
 * socket is the exchanges' once that proof holds. */
static void on_data_frame(struct nodelink *l, void *arg,
                          const struct sp_msg_head *head,
                          const msgpack_object *map) {
  struct mesh_node *n = arg;
  struct mesh *ms = n->mesh;
  struct nodemsg m;
  char why[256];
  const char *bad = NULL;
  if (nodemsg_parse(head, map, &m, why, sizeof why) != 0)
    bad = why;
  else if (m.op == NODEMSG_ERROR)
    bad = m.message;
  else if (!n->dlink_hello_sent && m.op == NODEMSG_CHALLENGE &&
           m.version != NODE_PROTOCOL_VERSION)
    bad = "protocol version mismatch";
  else if (!n->dlink_hello_sent && m.op == NODEMSG_CHALLENGE) {
    struct nodemsg h = {.op = NODEMSG_DATA,
                        .node = ms->self,
                        .node_id = ms->srv->node_id};
    if (peerauth_nonce(h.nonce) != 0) {
      bad = "no random nonce";
    } else {
      answer_challenge(l, ms->job, PEERAUTH_DATA, m.nonce, &h);
      link_send_msg(l, &h);
      n->dlink_hello_sent = true;
      return;
    }
  } else if (!n->dlink_hello_sent || m.op != NODEMSG_DATA || !m.reply)
    bad = "a bad handshake";
  else if (!peerauth_equal(m.proof, nodelink_handshake(l)))
    bad = "it did not prove it knows the job's secret";
  if (bad != NULL) {
    char what[SP_ERRMSG_MAX / 2];
    snprintf(what, sizeof what, "%.500s", bad);
    nodemsg_free(&m);
    nodelink_close(l);
    n->dlink = NULL;
    data_fail(n, what);
    return;
  }
  nodelink_hello_done(l);
  nodelink_detach(l, on_data_detached, n);
}

static void on_data_closed(struct nodelink *l, void *arg, int code) {
  (void)l;
  struct mesh_node *n = arg;
  n->dlink = NULL;
  data_fail(n, sp_strerror(code));
}

static const struct nodelink_ops data_ops = {
    .frame = on_data_frame,
    .closed = on_data_closed,
};

/* The data links the export needs: dialled to lower nodes, awaited from
 * higher ones. */
static int ensure_links(struct mesh *ms, const struct mesh_export *mx) {
  for (size_t i = 0; i < mx->nnodes; i++) {
    struct mesh_node *n = node_get(ms, mx->nodes[i].node);
    if (n == NULL || n->node == ms->self)
      continue;
    if (n->data_next >= 0) {
      if (n->data >= 0)
        close(n->data);
      n->data = n->data_next;
      n->data_next = -1;
    }
    if (n->data >= 0 && !data_alive(n->data)) {
      close(n->data);
      n->data = -1;
    }
    if (n->node > ms->self || n->data >= 0 || n->dlink != NULL)
      continue;
    n->dlink_hello_sent = false;
    int rc = nodelink_connect(ms->srv, n->addr, &data_ops, n, &n->dlink);
    if (rc != 0) {
      n->dlink = NULL;
      return (int)n->node + 1;
    }
  }
  return 0;
}

static bool links_ready(const struct mesh *ms, const struct mesh_export *mx) {
  for (size_t i = 0; i < mx->nnodes; i++) {
    const struct mesh_node *n = ms->nodes[mx->nodes[i].node];
    if (n->node != ms->self && n->data < 0)
      return false;
  }
  return true;
}

/* Fails what this node takes part in, and tells the root. */
static void member_fail(struct mesh *ms, int code, const char *message) {
  struct job *job = ms->job;
  if (ms->current != NULL) {
    uint64_t gather = ms->current->gather;
    export_fail(job, code, message);
    struct nodemsg f = {.op = NODEMSG_FAIL, .gather = gather, .code = code};
    snprintf(f.message, sizeof f.message, "%s", message);
    to_root(ms, &f, NULL);
  }
}

static void data_fail(struct mesh_node *n, const char *why) {
  struct mesh *ms = n->mesh;
  log_with(LOG_LEVEL_INFO, LOG_JOB(ms->job->hex),
           "job %s: data link to node %u (%s): %s", ms->job->hex, n->node,
           n->addr, why);
  if (ms->current == NULL || !in_roster(ms->current, n->node))
    return;
  char msg[SP_ERRMSG_MAX + 1];
  mesh_lost_message(ms->job->hex, n->node, n->addr, ms->current->export_id,
                    msg, sizeof msg);
  member_fail(ms, SP_ENODELOST, msg);
}

static void maybe_send_planned(struct mesh *ms) {
  struct mesh_export *mx = ms->current;
  if (mx == NULL || !ms->awaiting_links || !links_ready(ms, mx))
    return;
  ms->awaiting_links = false;
  struct nodemsg p = {.op = NODEMSG_PLANNED,
                      .gather = mx->gather,
                      .digest = ms->planned_digest,
                      .replica_rank = ms->planned_replica_rank,
                      .nreplicas = ms->planned_nreplicas,
                      .replicas = ms->planned_replicas};
  to_root(ms, &p, NULL);
}

void mesh_planned(struct job *job, uint64_t digest,
                  const struct replica_digests *replicas) {
  struct mesh *ms = job->mesh;
  ms->planned_digest = digest ^ ms->srv->test_digest_xor;
  /* The lowest local rank's digests stand for the node's: its other
   * ranks' copies were compared with them already (export.c). */
  free(ms->planned_replicas);
  ms->planned_replicas = NULL;
  ms->planned_nreplicas = 0;
  if (replicas->nkeys > 0 &&
      (ms->planned_replicas =
           malloc(replicas->nkeys * sizeof *replicas->digest)) != NULL) {
    memcpy(ms->planned_replicas, replicas->digest,
           replicas->nkeys * sizeof *replicas->digest);
    ms->planned_nreplicas = replicas->nkeys;
    ms->planned_replica_rank = replicas->ranks[0];
  }
  ms->awaiting_links = true;
  maybe_send_planned(ms);
}

void mesh_moved(struct job *job) {
  struct mesh *ms = job->mesh;
  if (ms->current == NULL)
    return;
  struct nodemsg m = {.op = NODEMSG_MOVED, .gather = ms->current->gather};
  to_root(ms, &m, NULL);
}

void mesh_failed(struct job *job, int code, const char *message) {
  struct mesh *ms = job->mesh;
  if (ms->current == NULL)
    return;
  struct nodemsg f = {.op = NODEMSG_FAIL, .gather = ms->current->gather,
                      .code = code};
  snprintf(f.message, sizeof f.message, "%s", message);
  to_root(ms, &f, NULL);
}

/* Fails a plan this node cannot start, on every node. */
static void refuse_start(struct mesh *ms, struct mesh_export *mx, int code,
                         const char *message) {
  struct nodemsg f = {.op = NODEMSG_FAIL, .gather = mx->gather, .code = code};
  snprintf(f.message, sizeof f.message, "%s", message);
  to_root(ms, &f, NULL);
  export_fail_asks(ms->job, code, message);
  forget_asks(ms);
  mesh_export_free(mx);
}

/* Starts the export the root announced once no export runs. */
void mesh_try_start(struct job *job) {
  struct mesh *ms = job->mesh;
  struct mesh_export *mx = ms->ready;
  if (mx == NULL || job->running != NULL)
    return;
  ms->ready = NULL;
  ms->timeout_ms = mx->timeout_ms;
  ms->heard_ms = monotonic_ms();
  ms->awaiting_links = false;
  if (apply_roster(ms, mx) != 0) {
    refuse_start(ms, mx, SP_ENOMEM, "out of memory starting the export");
    return;
  }
  /* A rank that left this node and joined again on another one is back:
   * this node heard it leave, but only the root heard it return, and says
   * so by placing it there.  Its departure would name it in place of a
   * rank that is gone.  (The root's own record is the job's, kept up to
   * date as ranks come and go, later than this announcement.) */
  for (uint32_t r = 0; r < job->world && !ms->root; r++)
    if (mx->rank_nodes[r] != ms->self && mx->rank_nodes[r] != PLAN_NONE)
      job_rank_returned(job, r);
  /* This node must still hold every rank the root placed here. */
  for (uint32_t r = 0; r < job->world; r++) {
    const struct job_member *m = job->members[r];
    if (mx->rank_nodes[r] != ms->self ||
        (m != NULL && !m->lost && m->asked))
      continue;
    char msg[SP_ERRMSG_MAX + 1];
    if (!job_departed(job, msg, sizeof msg))
      job_departure_text(job, r, m == NULL || m->disconnected, "", NULL, msg,
                         sizeof msg);
    refuse_start(ms, mx, SP_ERANKLOST, msg);
    return;
  }
  for (uint32_t r = 0; r < job->world; r++) {
    const struct nodeblob *sent = ms->sent_meta[r];
    const struct nodeblob *got = mx->metas[r];
    if (mx->rank_nodes[r] != ms->self ||
        (sent != NULL && got->len == sent->len &&
         memcmp(got->payload, sent->payload, sent->len) == 0))
      continue;
    char msg[256];
    snprintf(msg, sizeof msg, "the root relayed registrations of rank %"
             PRIu32 " that its node did not send", r);
    refuse_start(ms, mx, SP_EBADMSG, msg);
    return;
  }
  int bad = ensure_links(ms, mx);
  char msg[SP_ERRMSG_MAX + 1];
  /* Current first: a failure while starting reports this export. */
  ms->current = mx;
  int rc = export_start_gathered(job, mx, mx->export_id, mx->max_keys,
                                 mx->max_bytes, mx->timeout_ms, msg,
                                 sizeof msg);
  if (rc != 0) {
    ms->current = NULL;
    refuse_start(ms, mx, rc, msg);
    return;
  }
  /* Those asks are the export's now: the next ones go to the root. */
  for (uint32_t r = 0; r < job->world; r++)
    if (mx->rank_nodes[r] == ms->self)
      ms->ask_sent[r] = 0;
  if (bad > 0 && ms->current == mx)
    data_fail(ms->nodes[bad - 1], "cannot connect");
}

/* The metas of a plan arrive one frame each, in rank order. */
static void member_meta(struct mesh *ms, struct nodeblob *blob) {
  struct mesh_export *mx = ms->incoming;
  if (mx == NULL) {
    nodeblob_unref(blob);
    return;
  }
  mx->metas[mx->nmetas++] = blob;
  if (mx->nmetas < mx->world)
    return;
  ms->incoming = NULL;
  mesh_export_free(ms->ready);
  ms->ready = mx;
  mesh_try_start(ms->job);
}

static void member_plan(struct mesh *ms, const struct nodemsg *m,
                        struct nodeblob **blobs, size_t nblobs) {
  struct job *job = ms->job;
  bool listed = false;
  for (size_t i = 0; i < m->nnodes; i++)
    listed = listed || m->nodes[i].node == ms->self;
  if (m->world != job->world || !listed) {
    root_lost(ms, "its plan does not fit this job");
    return;
  }
  struct mesh_export *mx = calloc(1, sizeof *mx);
  if (mx != NULL) {
    mx->rank_nodes = malloc(m->world * sizeof *mx->rank_nodes);
    mx->nodes = malloc(m->nnodes * sizeof *mx->nodes);
    mx->metas = calloc(m->world, sizeof *mx->metas);
  }
  if (mx == NULL || mx->rank_nodes == NULL || mx->nodes == NULL ||
      mx->metas == NULL) {
    if (mx != NULL) {
      free(mx->rank_nodes);
      free(mx->nodes);
      free(mx->metas);
      free(mx);
    }
    root_lost(ms, "out of memory for its plan");
    return;
  }
  mx->mesh = ms;
  mx->gather = m->gather;
  mx->export_id = m->export_id;
  mx->world = m->world;
  mx->max_keys = m->max_keys;
  mx->max_bytes = m->max_bytes;
  mx->timeout_ms = m->timeout_ms;
  mx->comm_gen = m->comm_gen;
  memcpy(mx->nccl_id, m->comm_gen > 0 ? m->nccl_id : job->nccl_id,
         NODE_NCCL_ID_BYTES);
  memcpy(mx->rank_nodes, m->rank_nodes, m->world * sizeof *mx->rank_nodes);
  memcpy(mx->nodes, m->nodes, m->nnodes * sizeof *mx->nodes);
  mx->nnodes = m->nnodes;
  ms->timeout_ms = m->timeout_ms;
  new_gather(ms, m->gather + 1);
  mesh_export_free(ms->incoming);
  ms->incoming = mx;
  if (blobs != NULL) {
    for (size_t i = 0; i < nblobs; i++)
      member_meta(ms, nodeblob_ref(blobs[i]));
  } else {
    nodelink_expect_blobs(ms->root_link, m->world);
  }
}

static void member_fail_msg(struct mesh *ms, const struct nodemsg *m) {
  struct job *job = ms->job;
  if (ms->current != NULL && ms->current->gather == m->gather) {
    export_fail(job, m->code, m->message);
    return;
  }
  if (ms->ready != NULL && ms->ready->gather == m->gather) {
    mesh_export_free(ms->ready);
    ms->ready = NULL;
  }
  if (ms->incoming != NULL && ms->incoming->gather == m->gather) {
    mesh_export_free(ms->incoming);
    ms->incoming = NULL;
  }
  if (m->gather >= ms->gather) {
    export_fail_asks(job, m->code, m->message);
    forget_asks(ms);
    new_gather(ms, m->gather + 1);
  }
}

static void member_handle(struct mesh *ms, const struct nodemsg *m,
                          struct nodeblob **blobs, size_t nblobs) {
  struct job *job = ms->job;
  ms->heard_ms = monotonic_ms();
  switch (m->op) {
  case NODEMSG_JOIN:
  case NODEMSG_ERROR:
    member_join_verdict(ms, m);
    break;
  case NODEMSG_PLAN:
    member_plan(ms, m, blobs, nblobs);
    break;
  case NODEMSG_GO:
    if (ms->current != NULL && ms->current->gather == m->gather) {
      struct replica_differ differ = {.key = m->differ_key,
                                      .ranks = {m->differ_ranks[0],
                                                m->differ_ranks[1]},
                                      .digests = {m->differ_digests[0],
                                                  m->differ_digests[1]}};
      ms->current->moving = !m->differ;
      export_go(job, m->differ ? &differ : NULL);
    }
    break;
  case NODEMSG_PUBLISH:
    if (ms->current != NULL && ms->current->gather == m->gather) {
      ms->current->published = true;
      export_publish(job);
    }
    break;
  case NODEMSG_FAIL:
    member_fail_msg(ms, m);
    break;
  case NODEMSG_ABORT:
    root_ended(ms, m);
    break;
  case NODEMSG_BEAT:
    break;
  default:
    log_with(LOG_LEVEL_INFO, LOG_JOB(job->hex),
             "job %s: the root sent an unexpected %s", job->hex,
             nodemsg_op_name(m->op));
    break;
  }
}

/* The root is gone: nothing this node holds can export again. */
static void root_lost(struct mesh *ms, const char *why) {
  struct job *job = ms->job;
  if (ms->broken)
    return;
  uint64_t export_id = ms->current != NULL ? ms->current->export_id : 0;
  log_with(LOG_LEVEL_WARN, LOG_JOB(job->hex),
           "job %s: lost the root daemon %s: %s", job->hex, ms->root_addr, why);
  ms->broken = true;
  ms->broken_code = SP_ENODELOST;
  mesh_lost_message(job->hex, 0, ms->root_addr, export_id, ms->broken_msg,
                    sizeof ms->broken_msg);
  nodelink_close(ms->root_link);
  ms->root_link = NULL;
  if (ms->joins != NULL) {
    char msg[SP_ERRMSG_MAX + 1];
    snprintf(msg, sizeof msg, "the job's root daemon, node 0 (%s), was lost: "
             "%.512s", ms->root_addr, why);
    joins_refuse(ms, SP_ENODELOST, msg);
  }
  if (ms->current != NULL)
    export_fail(job, SP_ENODELOST, ms->broken_msg);
  mesh_export_free(ms->ready);
  mesh_export_free(ms->incoming);
  ms->ready = ms->incoming = NULL;
  export_fail_asks(job, SP_ENODELOST, ms->broken_msg);
  forget_asks(ms);
  if (!job->ever_joined)
    job_end(job);
  job_wake(job);
}

/* The root ended the job for good: this node ends its part with the
 * root's code and message, which every rank here hears, and every join
 * still waiting for the root's answer. */
static void root_ended(struct mesh *ms, const struct nodemsg *m) {
  struct job *job = ms->job;
  log_with(LOG_LEVEL_WARN,
           &(struct log_fields){.job = job->hex, .rank = LOG_NONE,
                                .node = LOG_NONE, .error = m->code},
           "job %s: the root daemon %s ended the job: %s: %s", job->hex,
           ms->root_addr, sp_err_name(m->code), m->message);
  ms->broken = true;
  ms->broken_code = m->code;
  snprintf(ms->broken_msg, sizeof ms->broken_msg, "%s", m->message);
  joins_refuse(ms, m->code, m->message);
  job_terminate(job, m->code, m->message);
}

/* The root refused this daemon, or did not prove it knows the job's secret,
 * before it gave it a node number: the shadow ends and its joins hear why. */
static void root_refused(struct mesh *ms, int code, const char *why) {
  log_with(LOG_LEVEL_WARN, LOG_JOB(ms->job->hex),
           "job %s: the root daemon %s refused this daemon: "
           "%s",
           ms->job->hex, ms->root_addr, why);
  char msg[SP_ERRMSG_MAX + 1];
  snprintf(msg, sizeof msg, "the job's root daemon %s refused: %.900s",
           ms->root_addr, why);
  nodelink_close(ms->root_link);
  ms->root_link = NULL;
  ms->broken = true;
  ms->broken_code = code;
  snprintf(ms->broken_msg, sizeof ms->broken_msg, "%s", msg);
  joins_refuse(ms, code, msg);
  job_end(ms->job);
}

/* The root's handshake: its challenge, answered with peer_hello; then its
 * reply, which holds only with the root's own proof. */
static void root_handshake(struct mesh *ms, struct nodelink *l,
                           const struct nodemsg *m) {
  if (m->op == NODEMSG_ERROR)
    return root_refused(ms, m->code, m->message);
  if (!ms->hello_sent) {
    if (m->op != NODEMSG_CHALLENGE)
      return root_refused(ms, SP_EBADMSG, "a bad handshake");
    if (m->version != NODE_PROTOCOL_VERSION) {
      char why[128];
      snprintf(why, sizeof why, "protocol version mismatch (root %" PRIu64
               ", daemon %d)", m->version, NODE_PROTOCOL_VERSION);
      return root_refused(ms, SP_EVERSION, why);
    }
    struct nodemsg h = {.op = NODEMSG_HELLO, .node_id = ms->srv->node_id};
    if (peerauth_nonce(h.nonce) != 0)
      return root_refused(ms, SP_EINTERNAL, "no random nonce");
    snprintf(h.addr, sizeof h.addr, "%s", ms->srv->peer_address);
    answer_challenge(l, ms->job, PEERAUTH_CONTROL, m->nonce, &h);
    link_send_msg(l, &h);
    ms->hello_sent = true;
    return;
  }
  if (m->op != NODEMSG_HELLO || !m->reply)
    return root_refused(ms, SP_EBADMSG, "a bad handshake");
  if (!peerauth_equal(m->proof, nodelink_handshake(l)))
    return root_refused(ms, SP_ETICKET,
                        "it did not prove it knows the job's secret");
  ms->hello_done = true;
  ms->self = m->node;
  nodelink_hello_done(l);
  struct mesh_node *self = node_make(ms, m->node);
  struct mesh_node *root = node_make(ms, 0);
  if (self != NULL && root != NULL) {
    self->node_id = ms->srv->node_id;
    self->present = true;
    snprintf(self->addr, sizeof self->addr, "%s", ms->srv->peer_address);
    root->node_id = m->node_id;
    root->present = true;
    snprintf(root->addr, sizeof root->addr, "%s", ms->root_addr);
  }
  log_with(LOG_LEVEL_INFO, LOG_JOB(ms->job->hex),
           "job %s: node %u of the job (root %s)", ms->job->hex, m->node,
           ms->root_addr);
  for (struct pending_join *p = ms->joins; p != NULL; p = p->next)
    send_join(ms, p);
}

static void on_root_frame(struct nodelink *l, void *arg,
                          const struct sp_msg_head *head,
                          const msgpack_object *map) {
  struct mesh *ms = arg;
  struct nodemsg m;
  char why[SP_ERRMSG_MAX / 2];
  if (nodemsg_parse(head, map, &m, why, sizeof why) != 0) {
    nodemsg_free(&m);
    if (ms->hello_done)
      root_lost(ms, why);
    else
      root_refused(ms, SP_EBADMSG, why);
    return;
  }
  if (ms->hello_done)
    member_handle(ms, &m, NULL, 0);
  else
    root_handshake(ms, l, &m);
  nodemsg_free(&m);
}

static void on_root_blob(struct nodelink *l, void *arg, struct nodeblob *b) {
  (void)l;
  struct mesh *ms = arg;
  ms->heard_ms = monotonic_ms();
  member_meta(ms, b);
}

static void on_root_closed(struct nodelink *l, void *arg, int code) {
  (void)l;
  struct mesh *ms = arg;
  ms->root_link = NULL;
  char why[128];
  if (code == SP_ETIMEOUT)
    snprintf(why, sizeof why, "it did not answer within %" PRIu32 " ms",
             ms->srv->cfg->peer_timeout_ms);
  else
    snprintf(why, sizeof why, "%s", sp_strerror(code));
  if (!ms->hello_done) {
    char msg[SP_ERRMSG_MAX + 1];
    snprintf(msg, sizeof msg, "cannot reach the job's root daemon, node 0 "
             "(%s): %s", ms->root_addr, why);
    ms->broken = true;
    ms->broken_code = SP_ENODELOST;
    snprintf(ms->broken_msg, sizeof ms->broken_msg, "%s", msg);
    joins_refuse(ms, SP_ENODELOST, msg);
    job_end(ms->job);
    return;
  }
  root_lost(ms, why);
}

static const struct nodelink_ops root_ops = {
    .frame = on_root_frame,
    .blob = on_root_blob,
    .closed = on_root_closed,
};

/* ---- planning (on the planning thread) ---- */

int mesh_plan_input(struct mesh_export *mx, struct plan_input *in, char *msg,
                    size_t msglen) {
  uint32_t world = mx->world;
  mx->shadow = calloc(world, sizeof *mx->shadow);
  mx->groups = calloc(world, sizeof *mx->groups);
  mx->rin = calloc(world, sizeof *mx->rin);
  if (mx->shadow == NULL || mx->groups == NULL || mx->rin == NULL) {
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
    registry_rank_in(&mx->shadow[r], r, &mx->rin[r]);
    mx->rin[r].node = mx->rank_nodes[r];
    mx->rin[r].ngroups = mx->groups[r].ngroups;
    mx->rin[r].groups = mx->groups[r].groups;
  }
  *in = (struct plan_input){.world = world,
                            .nranks = world,
                            .ranks = mx->rin,
                            .max_keys = mx->max_keys,
                            .max_bytes = mx->max_bytes};
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
    peers[n].sock = -1;
    struct mesh_node *node = node_get(ms, n);
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
    if (n != ms->self && in_roster(mx, n))
      peers[n].sock = node->data;
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

/* ---- the root ---- */

static void coord_fail(struct mesh *ms, uint64_t gather, int code,
                       const char *message, bool export_nodes_only) {
  struct nodemsg f = {.op = NODEMSG_FAIL, .gather = gather, .code = code};
  snprintf(f.message, sizeof f.message, "%s", message);
  for (uint32_t i = 0; i < ms->nnodes; i++) {
    struct mesh_node *n = ms->nodes[i];
    if (n == NULL || !n->present || (export_nodes_only && !n->in_export))
      continue;
    to_node(ms, i, &f, NULL, 0);
  }
}

static void clear_asks(struct mesh *ms) {
  for (uint32_t r = 0; r < ms->job->world; r++) {
    nodeblob_unref(ms->asks[r].meta);
    memset(&ms->asks[r], 0, sizeof ms->asks[r]);
  }
  ms->nasked = 0;
}

/* A gather that cannot complete: every node's waiting ranks hear why. */
static void gather_fail(struct mesh *ms, int code, const char *message) {
  /* Where ranks of the root's own node wait, export.c logs the failure as
   * it answers them (export_fail_asks, through the inbox); the root logs
   * it here only when none do, so that it is logged once, at warn, as
   * every failed export is. */
  if (!export_any_asked(ms->job))
    log_with(LOG_LEVEL_WARN, LOG_JOB(ms->job->hex),
             "job %s: export failed before it started: %s: %s", ms->job->hex,
             sp_err_name(code), message);
  coord_fail(ms, ms->cgather, code, message, false);
  clear_asks(ms);
  ms->cgather++;
}

static void export_over(struct mesh *ms) {
  ms->cstate = COORD_IDLE;
  for (uint32_t i = 0; i < ms->nnodes; i++)
    if (ms->nodes[i] != NULL)
      ms->nodes[i]->in_export = false;
}

/* "2, 5 (not joined) and 3 more": the ranks a timed-out gather waited for,
 * as export.c names them on one node. */
static void missing_ranks(const struct mesh *ms, char *buf, size_t len) {
  size_t used = 0, named = 0, count = 0;
  buf[0] = '\0';
  for (uint32_t r = 0; r < ms->job->world; r++) {
    if (ms->asks[r].asked)
      continue;
    count++;
    if (named < 8 && used < len) {
      used += (size_t)snprintf(buf + used, len - used, "%s%" PRIu32 "%s",
                               named > 0 ? ", " : "", r,
                               ms->rank_node[r] == PLAN_NONE ? " (not joined)"
                                                             : "");
      named++;
    }
  }
  if (count > named && used < len)
    snprintf(buf + used, len - used, " and %zu more", count - named);
}

static void gather_complete(struct mesh *ms) {
  struct job *job = ms->job;
  const struct config *cfg = ms->srv->cfg;
  uint32_t world = job->world;
  uint32_t keys0 = 0, timeout = UINT32_MAX;
  uint64_t bytes0 = 0;
  for (uint32_t r = 0; r < world; r++) {
    const struct mesh_ask *a = &ms->asks[r];
    uint32_t keys = a->max_keys > 0 ? a->max_keys : PLAN_DEFAULT_MAX_KEYS;
    uint64_t bytes = a->max_bytes > 0 ? a->max_bytes : cfg->max_bytes;
    uint32_t t = a->timeout_ms > 0 ? a->timeout_ms : cfg->export_timeout_ms;
    if (t < timeout)
      timeout = t;
    if (r == 0) {
      keys0 = keys;
      bytes0 = bytes;
    } else if (keys != keys0 || bytes != bytes0) {
      char msg[256];
      snprintf(msg, sizeof msg,
               "ranks disagree on the export options: rank 0 asked max_keys "
               "%" PRIu32 " and max_bytes %" PRIu64 ", rank %" PRIu32
               " asked %" PRIu32 " and %" PRIu64,
               keys0, bytes0, r, keys, bytes);
      gather_fail(ms, SP_EINVAL, msg);
      return;
    }
  }
  struct nodemsg p = {.op = NODEMSG_PLAN,
                      .gather = ms->cgather,
                      .export_id = ms->next_export_id++,
                      .max_keys = keys0,
                      .max_bytes = bytes0,
                      .timeout_ms = timeout,
                      .world = world};
  struct nodeblob **metas = malloc(world * sizeof *metas);
  p.rank_nodes = ms->rank_node;
  p.nodes = calloc(ms->nnodes, sizeof *p.nodes);
  if (metas == NULL || p.nodes == NULL) {
    free(metas);
    free(p.nodes);
    gather_fail(ms, SP_ENOMEM, "out of memory planning the export");
    return;
  }
  for (uint32_t i = 0; i < ms->nnodes; i++) {
    struct mesh_node *n = ms->nodes[i];
    if (n == NULL || !n->present || n->nranks == 0)
      continue;
    p.nodes[p.nnodes++] = (struct nodemsg_node){.node = n->node,
                                                .node_id = n->node_id};
    snprintf(p.nodes[p.nnodes - 1].addr, NODE_ADDR_MAX, "%s", n->addr);
    n->in_export = true;
    n->planned = n->moved = false;
    n->heard_ms = monotonic_ms();
  }
  /* The communicators across nodes: a failure since they were last used
   * may have aborted them, and a real NCCL id names the bootstrap listener
   * of the process that made it, so it cannot be used twice; the nodes
   * make a new generation from a fresh id (docs/gpu.md). */
  if (ms->comm_pending)
    ms->comm_stale = true;
  ms->comm_pending = false;
  if (p.nnodes > 1 && job->has_nccl_id) {
    if (ms->comm_stale) {
      char why[256];
      if (gpu_comms_unique_id(ms->srv->backend->gpu, ms->comm_id, why,
                              sizeof why) != 0) {
        for (uint32_t i = 0; i < ms->nnodes; i++)
          if (ms->nodes[i] != NULL)
            ms->nodes[i]->in_export = false;
        ms->cstate = COORD_IDLE;
        free(metas);
        free(p.nodes);
        char msg[384];
        snprintf(msg, sizeof msg, "cannot make a new NCCL id: %s", why);
        gather_fail(ms, SP_EBACKEND, msg);
        return;
      }
      ms->comm_gen++;
      ms->comm_stale = false;
      log_with(LOG_LEVEL_INFO, LOG_JOB(job->hex),
               "job %s: NCCL communicators of generation %" PRIu64
               " from a new id",
               job->hex, ms->comm_gen);
    }
    ms->comm_pending = true;
    p.comm_gen = ms->comm_gen;
    memcpy(p.nccl_id, ms->comm_id, NODE_NCCL_ID_BYTES);
  }
  for (uint32_t r = 0; r < world; r++)
    metas[r] = ms->asks[r].meta;
  log_with(LOG_LEVEL_INFO, LOG_JOB(job->hex),
           "job %s: export %" PRIu64 ": every rank asked; "
           "planning on %zu node(s)",
           job->hex, p.export_id, p.nnodes);
  ms->cstate = COORD_PLANNING;
  ms->cexport_gather = ms->cgather;
  ms->cexport_id = p.export_id;
  ms->ctimeout = timeout;
  for (size_t i = 0; i < p.nnodes; i++)
    to_node(ms, p.nodes[i].node, &p, metas, world);
  free(metas);
  free(p.nodes);
  clear_asks(ms);
  ms->cgather++;
}

static void coord_ask(struct mesh *ms, struct mesh_node *n,
                      const struct nodemsg *m, struct nodeblob *blob) {
  struct job *job = ms->job;
  if (m->gather != ms->cgather || m->rank >= job->world ||
      ms->rank_node[m->rank] != n->node || ms->asks[m->rank].asked)
    return; /* stale: the gather it belonged to is over */
  /* A rank left and has not joined again: the export cannot complete,
   * and every node's asking ranks hear why at once. */
  char gone[SP_ERRMSG_MAX + 1];
  if (job_departed(job, gone, sizeof gone)) {
    gather_fail(ms, SP_ERANKLOST, gone);
    return;
  }
  struct mesh_ask *a = &ms->asks[m->rank];
  uint32_t t = m->timeout_ms > 0 ? m->timeout_ms
                                 : ms->srv->cfg->export_timeout_ms;
  *a = (struct mesh_ask){.asked = true,
                         .max_keys = m->max_keys,
                         .max_bytes = m->max_bytes,
                         .timeout_ms = m->timeout_ms,
                         .deadline_ms = monotonic_ms() + t,
                         .meta = nodeblob_ref(blob)};
  ms->nasked++;
  job_schedule(job);
  if (ms->nasked == job->world && ms->cstate == COORD_IDLE)
    gather_complete(ms);
}

/* The nodes' digests of their replicated and plain keys: the first key
 * (in key order) on which two nodes differ goes in go (each node then
 * refuses the export with different_data naming it, and tells the root as
 * any failure).  Nodes that compare none are left out.  -1 when a node's
 * count does not match the others' (the export failed). */
static int compare_node_replicas(struct mesh *ms, struct nodemsg *go) {
  const struct mesh_node *base = NULL;
  for (uint32_t i = 0; i < ms->nnodes; i++) {
    const struct mesh_node *x = ms->nodes[i];
    if (x == NULL || !x->in_export || x->nreplicas == 0)
      continue;
    if (base == NULL) {
      base = x;
      continue;
    }
    if (x->nreplicas != base->nreplicas) {
      char msg[256];
      snprintf(msg, sizeof msg,
               "node %u compared %zu replicated keys and node %u %zu for "
               "export %" PRIu64 " of job %s",
               base->node, base->nreplicas, x->node, x->nreplicas,
               ms->cexport_id, ms->job->hex);
      coord_fail(ms, ms->cexport_gather, SP_EBADMSG, msg, true);
      export_over(ms);
      return -1;
    }
  }
  for (size_t k = 0; base != NULL && k < base->nreplicas && !go->differ; k++)
    for (uint32_t i = 0; i < ms->nnodes && !go->differ; i++) {
      const struct mesh_node *x = ms->nodes[i];
      if (x == NULL || !x->in_export || x->nreplicas == 0 ||
          x->replicas[k] == base->replicas[k])
        continue;
      go->differ = true;
      go->differ_key = (uint32_t)k;
      go->differ_ranks[0] = base->replica_rank;
      go->differ_ranks[1] = x->replica_rank;
      go->differ_digests[0] = base->replicas[k];
      go->differ_digests[1] = x->replicas[k];
    }
  return 0;
}

static void coord_planned(struct mesh *ms, struct mesh_node *n,
                          const struct nodemsg *m) {
  if (ms->cstate != COORD_PLANNING || m->gather != ms->cexport_gather ||
      !n->in_export)
    return;
  n->planned = true;
  n->digest = m->digest;
  free(n->replicas);
  n->replicas = NULL;
  n->nreplicas = 0;
  if (m->nreplicas > 0 &&
      (n->replicas = malloc(m->nreplicas * sizeof *m->replicas)) != NULL) {
    memcpy(n->replicas, m->replicas, m->nreplicas * sizeof *m->replicas);
    n->nreplicas = m->nreplicas;
    n->replica_rank = m->replica_rank;
  }
  uint64_t digest0 = 0;
  bool first = true, same = true;
  for (uint32_t i = 0; i < ms->nnodes; i++) {
    struct mesh_node *x = ms->nodes[i];
    if (x == NULL || !x->in_export)
      continue;
    if (!x->planned)
      return;
    if (first)
      digest0 = x->digest;
    same = same && x->digest == digest0;
    first = false;
  }
  if (!same) {
    char msg[SP_ERRMSG_MAX + 1];
    size_t used = (size_t)snprintf(msg, sizeof msg,
                                   "daemons computed different plans for "
                                   "export %" PRIu64 " of job %s:",
                                   ms->cexport_id, ms->job->hex);
    for (uint32_t i = 0; i < ms->nnodes && used < sizeof msg; i++)
      if (ms->nodes[i] != NULL && ms->nodes[i]->in_export)
        used += (size_t)snprintf(msg + used, sizeof msg - used,
                                 " node %u %016" PRIx64, i,
                                 ms->nodes[i]->digest);
    log_with(LOG_LEVEL_WARN, LOG_JOB(ms->job->hex), "job %s: %s", ms->job->hex,
             msg);
    coord_fail(ms, ms->cexport_gather, SP_EDIGEST, msg, true);
    export_over(ms);
    return;
  }
  ms->cstate = COORD_MOVING;
  struct nodemsg go = {.op = NODEMSG_GO, .gather = ms->cexport_gather};
  if (compare_node_replicas(ms, &go) != 0)
    return;
  for (uint32_t i = 0; i < ms->nnodes; i++)
    if (ms->nodes[i] != NULL && ms->nodes[i]->in_export)
      to_node(ms, i, &go, NULL, 0);
}

static void coord_moved(struct mesh *ms, struct mesh_node *n,
                        const struct nodemsg *m) {
  if (ms->cstate != COORD_MOVING || m->gather != ms->cexport_gather ||
      !n->in_export)
    return;
  n->moved = true;
  for (uint32_t i = 0; i < ms->nnodes; i++)
    if (ms->nodes[i] != NULL && ms->nodes[i]->in_export &&
        !ms->nodes[i]->moved)
      return;
  struct nodemsg pub = {.op = NODEMSG_PUBLISH, .gather = ms->cexport_gather};
  ms->comm_pending = false;
  for (uint32_t i = 0; i < ms->nnodes; i++)
    if (ms->nodes[i] != NULL && ms->nodes[i]->in_export)
      to_node(ms, i, &pub, NULL, 0);
  export_over(ms);
  if (ms->nasked == ms->job->world)
    gather_complete(ms);
}

static void coord_fail_msg(struct mesh *ms, const struct nodemsg *m) {
  if (ms->cstate != COORD_IDLE && m->gather == ms->cexport_gather) {
    coord_fail(ms, m->gather, m->code, m->message, true);
    export_over(ms);
    if (ms->nasked == ms->job->world)
      gather_complete(ms);
  } else if (m->gather == ms->cgather) {
    gather_fail(ms, m->code, m->message);
  }
}

static void coord_left(struct mesh *ms, struct mesh_node *n,
                       const struct nodemsg *m) {
  struct job *job = ms->job;
  if (m->rank >= job->world || ms->rank_node[m->rank] != n->node)
    return;
  ms->rank_node[m->rank] = PLAN_NONE;
  if (n->nranks > 0)
    n->nranks--;
  bool asked = ms->asks[m->rank].asked;
  if (asked) {
    nodeblob_unref(ms->asks[m->rank].meta);
    memset(&ms->asks[m->rank], 0, sizeof ms->asks[m->rank]);
    ms->nasked--;
  }
  /* Every export asked for from now on fails at once (coord_ask), with
   * the reason the rank's own daemon knew. */
  job_rank_departed(job, m->rank, m->disconnected,
                    m->message[0] != '\0' ? m->message : NULL);
  char gone[SP_ERRMSG_MAX + 1];
  if (ms->nasked > 0 && job_departed(job, gone, sizeof gone))
    gather_fail(ms, SP_ERANKLOST, gone);
  job_wake(job);
}

static void coord_join(struct mesh *ms, struct mesh_node *n,
                       const struct nodemsg *m) {
  struct job *job = ms->job;
  struct nodemsg reply = {.op = NODEMSG_JOIN, .id = m->id, .reply = true};
  if (m->world != job->world || m->rank >= job->world) {
    reply.op = NODEMSG_ERROR;
    reply.code = SP_ERANK;
    snprintf(reply.message, sizeof reply.message,
             "join: rank %" PRIu32 " of world %" PRIu32 " does not fit job "
             "%s's world %" PRIu32, m->rank, m->world, job->hex, job->world);
  } else if (ms->rank_node[m->rank] != PLAN_NONE) {
    struct mesh_node *where = node_get(ms, ms->rank_node[m->rank]);
    reply.op = NODEMSG_ERROR;
    reply.code = SP_ERANK;
    snprintf(reply.message, sizeof reply.message,
             "join: rank %" PRIu32 " of job %s has already joined on node "
             "%" PRIu32 " (%s)", m->rank, job->hex, ms->rank_node[m->rank],
             where != NULL ? where->addr : "?");
  } else {
    ms->rank_node[m->rank] = n->node;
    n->nranks++;
    job_rank_returned(job, m->rank);
    job_note_joined(job);
    log_with(LOG_LEVEL_INFO, LOG_JOB(job->hex),
             "job %s: rank %" PRIu32 " joined on node %u (%s)", job->hex,
             m->rank, n->node, n->addr);
  }
  to_node(ms, n->node, &reply, NULL, 0);
}

static void coord_handle(struct mesh *ms, uint32_t from, const struct nodemsg *m,
                         struct nodeblob *blob) {
  struct mesh_node *n = node_get(ms, from);
  if (n == NULL || !n->present)
    return;
  n->heard_ms = monotonic_ms();
  switch (m->op) {
  case NODEMSG_JOIN:
    coord_join(ms, n, m);
    break;
  case NODEMSG_LEFT:
    coord_left(ms, n, m);
    break;
  case NODEMSG_ASK:
    coord_ask(ms, n, m, blob);
    break;
  case NODEMSG_PLANNED:
    coord_planned(ms, n, m);
    break;
  case NODEMSG_MOVED:
    coord_moved(ms, n, m);
    break;
  case NODEMSG_FAIL:
    coord_fail_msg(ms, m);
    break;
  case NODEMSG_BEAT:
    break;
  case NODEMSG_BYE: {
    log_with(LOG_LEVEL_INFO, LOG_JOB(ms->job->hex),
             "job %s: node %u (%s) left the job", ms->job->hex, n->node,
             n->addr);
    nodelink_close(n->ctl);
    n->ctl = NULL;
    node_lost(ms, n, NULL);
    break;
  }
  default:
    log_with(LOG_LEVEL_INFO, LOG_JOB(ms->job->hex),
             "job %s: node %u sent an unexpected %s", ms->job->hex, n->node,
             nodemsg_op_name(m->op));
    break;
  }
}

/* A node is gone (why NULL: it said goodbye).  Its ranks are free again; an
 * export or gather it took part in fails everywhere. */
static void node_lost(struct mesh *ms, struct mesh_node *n, const char *why) {
  struct job *job = ms->job;
  if (!n->present)
    return;
  n->present = false;
  nodelink_close(n->ctl);
  n->ctl = NULL;
  n->ask_pending = false;
  bool had_asks = false;
  char reason[SP_ERRMSG_MAX / 2];
  if (why != NULL)
    snprintf(reason, sizeof reason, "node %u (%s) was lost: %s", n->node,
             n->addr, why);
  for (uint32_t r = 0; r < job->world; r++) {
    if (ms->rank_node[r] != n->node)
      continue;
    ms->rank_node[r] = PLAN_NONE;
    /* Its ranks are gone with it (a node that said goodbye had none). */
    if (why != NULL)
      job_rank_departed(job, r, true, reason);
    if (ms->asks[r].asked) {
      nodeblob_unref(ms->asks[r].meta);
      memset(&ms->asks[r], 0, sizeof ms->asks[r]);
      ms->nasked--;
      had_asks = true;
    }
  }
  n->nranks = 0;
  if (why != NULL) {
    char msg[SP_ERRMSG_MAX + 1];
    log_with(LOG_LEVEL_WARN, LOG_JOB(job->hex), "job %s: node %u (%s) lost: %s",
             job->hex, n->node, n->addr, why);
    if (ms->cstate != COORD_IDLE && n->in_export) {
      mesh_lost_message(job->hex, n->node, n->addr, ms->cexport_id, msg,
                        sizeof msg);
      n->in_export = false;
      coord_fail(ms, ms->cexport_gather, SP_ENODELOST, msg, true);
      export_over(ms);
    } else if (had_asks || ms->nasked > 0) {
      mesh_lost_message(job->hex, n->node, n->addr, 0, msg, sizeof msg);
      gather_fail(ms, SP_ENODELOST, msg);
    }
  }
  n->in_export = false;
  job_wake(job);
}

static void on_ctl_frame(struct nodelink *l, void *arg,
                         const struct sp_msg_head *head,
                         const msgpack_object *map) {
  (void)l;
  struct mesh_node *n = arg;
  struct mesh *ms = n->mesh;
  struct nodemsg m;
  char why[SP_ERRMSG_MAX / 2];
  if (nodemsg_parse(head, map, &m, why, sizeof why) != 0) {
    nodemsg_free(&m);
    node_lost(ms, n, why);
    return;
  }
  if (m.op == NODEMSG_ASK) {
    /* Its meta is the next frame, kept as bytes. */
    n->ask = m;
    n->ask_pending = true;
    nodelink_expect_blobs(n->ctl, 1);
    n->heard_ms = monotonic_ms();
    return;
  }
  coord_handle(ms, n->node, &m, NULL);
  nodemsg_free(&m);
}

static void on_ctl_blob(struct nodelink *l, void *arg, struct nodeblob *b) {
  (void)l;
  struct mesh_node *n = arg;
  if (n->ask_pending) {
    n->ask_pending = false;
    coord_handle(n->mesh, n->node, &n->ask, b);
  }
  nodeblob_unref(b);
}

static void on_ctl_closed(struct nodelink *l, void *arg, int code) {
  (void)l;
  struct mesh_node *n = arg;
  n->ctl = NULL;
  node_lost(n->mesh, n, sp_strerror(code));
}

static const struct nodelink_ops ctl_ops = {
    .frame = on_ctl_frame,
    .blob = on_ctl_blob,
    .closed = on_ctl_closed,
};

/* ---- links that arrive ---- */

static void refuse_link(struct nodelink *l, int code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

static void refuse_link(struct nodelink *l, int code, const char *fmt, ...) {
  char msg[SP_ERRMSG_MAX + 1];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  log_msg(LOG_LEVEL_WARN, "peer %s refused: %s", nodelink_peer(l), msg);
  nodelink_send_error(l, code, msg);
  nodelink_close_after_flush(l);
}

static void on_data_accepted(void *arg, int sock) {
  struct mesh_node *n = arg;
  n->dlink = NULL;
  if (sock < 0)
    return; /* the dialling node tries again, or its export fails */
  struct mesh_export *cur = n->mesh->current;
  if (cur != NULL && cur->moving && n->data >= 0) {
    /* The engine may be using the old one: swap at the next export. */
    if (n->data_next >= 0)
      close(n->data_next);
    n->data_next = sock;
    return;
  }
  if (n->data >= 0)
    close(n->data);
  n->data = sock;
  log_with(LOG_LEVEL_DEBUG, LOG_JOB(n->mesh->job->hex),
           "job %s: data link from node %u (%s) up", n->mesh->job->hex, n->node,
           n->addr);
  maybe_send_planned(n->mesh);
}

/* The listener's proof to the daemon whose peer_hello or peer_data m is. */
static void listener_proof(const struct job *job, struct nodelink *l,
                           enum peerauth_link kind, const struct nodemsg *m,
                           struct nodemsg *reply) {
  peerauth_proof(job->secret, PEERAUTH_LISTENER, kind, job->id,
                 nodelink_handshake(l), m->nonce, reply->proof);
}

static void hello_root(struct server *srv, struct nodelink *l,
                       const struct nodemsg *m, struct job *job) {
  struct mesh *ms = job->mesh;
  if (!ms->root)
    return refuse_link(l, SP_ETICKET, "job %s is not rooted on this daemon",
                       job->hex);
  if (m->node_id == srv->node_id)
    return refuse_link(l, SP_EINVAL, "a daemon cannot join itself");
  struct mesh_node *n = NULL;
  for (uint32_t i = 1; i < ms->nnodes && n == NULL; i++)
    if (ms->nodes[i] != NULL && ms->nodes[i]->node_id == m->node_id)
      n = ms->nodes[i];
  if (n != NULL && n->present)
    return refuse_link(l, SP_ESTATE, "the daemon %s is node %u of job %s "
                       "already", m->addr, n->node, job->hex);
  if (n == NULL)
    n = node_make(ms, ms->nnodes);
  if (n == NULL)
    return refuse_link(l, SP_ELIMIT, "job %s has too many nodes", job->hex);
  n->node_id = m->node_id;
  n->present = true;
  n->ctl = l;
  n->heard_ms = monotonic_ms();
  snprintf(n->addr, sizeof n->addr, "%s", m->addr);
  nodelink_set_ops(l, &ctl_ops, n);
  nodelink_hello_done(l);
  struct nodemsg reply = {.op = NODEMSG_HELLO, .reply = true, .node = n->node,
                          .node_id = srv->node_id};
  listener_proof(job, l, PEERAUTH_CONTROL, m, &reply);
  link_send_msg(l, &reply);
  log_with(LOG_LEVEL_INFO, LOG_JOB(job->hex),
           "job %s: node %u (%s) joined the job", job->hex, n->node, n->addr);
}

static void hello_data(struct nodelink *l, const struct nodemsg *m,
                       struct job *job) {
  struct mesh *ms = job->mesh;
  /* The higher node of a pair dials the lower. */
  if ((!ms->root && !ms->hello_done) || m->node <= ms->self)
    return refuse_link(l, SP_EINVAL, "node %u does not dial node %u", m->node,
                       ms->self);
  struct mesh_node *n = node_make(ms, m->node);
  if (n == NULL)
    return refuse_link(l, SP_ENOMEM, "out of memory");
  if (n->node_id != 0 && n->node_id != m->node_id)
    return refuse_link(l, SP_EINVAL, "node %u of job %s is another daemon",
                       m->node, job->hex);
  n->node_id = m->node_id;
  nodelink_close(n->dlink);
  n->dlink = l;
  nodelink_hello_done(l);
  struct nodemsg reply = {.op = NODEMSG_DATA, .reply = true};
  listener_proof(job, l, PEERAUTH_DATA, m, &reply);
  link_send_msg(l, &reply);
  nodelink_detach(l, on_data_accepted, n);
}

void mesh_link_accepted(struct server *srv, struct nodelink *l) {
  (void)srv;
  struct nodemsg c = {.op = NODEMSG_CHALLENGE,
                      .version = NODE_PROTOCOL_VERSION};
  if (peerauth_nonce(c.nonce) != 0) {
    log_msg(LOG_LEVEL_ERROR, "peer %s: no random nonce for its challenge",
            nodelink_peer(l));
    nodelink_close(l);
    return;
  }
  memcpy(nodelink_handshake(l), c.nonce, PEERAUTH_NONCE_BYTES);
  link_send_msg(l, &c);
}

/* The job whose secret made the dialer's proof over this link's challenge,
 * or NULL.  Every usable job of the id is tried (shadows of tickets that
 * name one id with different secrets may coexist, job.c), and a proof is
 * computed even when there is none, so that the time taken says nothing
 * about which jobs exist. */
static struct job *proven_job(struct server *srv, struct nodelink *l,
                              const struct nodemsg *m,
                              enum peerauth_link kind) {
  static const uint8_t no_secret[JOB_SECRET_BYTES];
  uint8_t want[PEERAUTH_PROOF_BYTES];
  struct job *found = NULL;
  bool tried = false;
  for (struct job *j = job_find(srv, NULL, m->job); j != NULL;
       j = job_find(srv, j, m->job)) {
    if (j->dying || j->mesh == NULL || j->mesh->broken)
      continue;
    tried = true;
    peerauth_proof(j->secret, PEERAUTH_DIALER, kind, m->job,
                   nodelink_handshake(l), m->nonce, want);
    if (peerauth_equal(want, m->proof))
      found = j;
  }
  if (!tried) {
    peerauth_proof(no_secret, PEERAUTH_DIALER, kind, m->job,
                   nodelink_handshake(l), m->nonce, want);
    (void)peerauth_equal(want, m->proof);
  }
  return found;
}

void mesh_link_hello(struct server *srv, struct nodelink *l,
                     const struct sp_msg_head *head,
                     const msgpack_object *map) {
  if (strcmp(head->op, "peer_hello") != 0 &&
      strcmp(head->op, "peer_data") != 0)
    return refuse_link(l, SP_EHELLO, "the first frame must be peer_hello or "
                       "peer_data, not %s", head->op);
  struct nodemsg m;
  char why[SP_ERRMSG_MAX / 2];
  int rc = nodemsg_parse(head, map, &m, why, sizeof why);
  /* Neither handshake carries arrays: nothing to free later. */
  nodemsg_free(&m);
  if (rc != 0)
    return refuse_link(l, rc, "%s", why);
  if (m.reply)
    return refuse_link(l, SP_EHELLO, "%s without who is asking", head->op);
  if (m.version != NODE_PROTOCOL_VERSION)
    return refuse_link(l, SP_EVERSION, "protocol version mismatch (peer "
                       "%" PRIu64 ", daemon %d)", m.version,
                       NODE_PROTOCOL_VERSION);
  enum peerauth_link kind =
      m.op == NODEMSG_HELLO ? PEERAUTH_CONTROL : PEERAUTH_DATA;
  struct job *job = proven_job(srv, l, &m, kind);
  /* An unknown job and a wrong proof read the same to the peer. */
  if (job == NULL)
    return refuse_link(l, SP_ETICKET, "no job of this id and secret on this "
                       "daemon");
  if (m.op == NODEMSG_HELLO)
    hello_root(srv, l, &m, job);
  else
    hello_data(l, &m, job);
}

/* ---- time ---- */

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
    uint32_t mt =
        m->ask.timeout_ms > 0 ? m->ask.timeout_ms : job->srv->cfg->export_timeout_ms;
    if (mt < t)
      t = mt;
  }
  return t;
}

void mesh_tick(struct job *job) {
  struct mesh *ms = job->mesh;
  uint64_t now = monotonic_ms();
  if (!mesh_active(job))
    return;
  /* Member: beats to the root, and the root's silence. */
  if (!ms->root && ms->root_link != NULL && ms->hello_done) {
    if (now - ms->beat_ms >= MESH_BEAT_MS) {
      struct nodemsg b = {.op = NODEMSG_BEAT, .gather = ms->gather};
      link_send_msg(ms->root_link, &b);
      ms->beat_ms = now;
    }
    uint32_t t = member_timeout(ms);
    if (t != UINT32_MAX && now - ms->heard_ms > (uint64_t)t + MESH_GRACE_MS) {
      char why[64];
      snprintf(why, sizeof why, "silent for %" PRIu64 " ms",
               now - ms->heard_ms);
      root_lost(ms, why);
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
        to_node(ms, i, &b, NULL, 0);
    ms->cbeat_ms = now;
  }
  uint64_t deadline = UINT64_MAX;
  uint32_t gather_timeout = UINT32_MAX;
  for (uint32_t r = 0; r < job->world; r++)
    if (ms->asks[r].asked) {
      if (ms->asks[r].deadline_ms < deadline)
        deadline = ms->asks[r].deadline_ms;
      uint32_t t = ms->asks[r].timeout_ms > 0 ? ms->asks[r].timeout_ms
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
      node_lost(ms, n, why);
    }
  }
  if (ms->nasked > 0 && ms->nasked < job->world && now >= deadline) {
    char who[200], msg[300];
    missing_ranks(ms, who, sizeof who);
    snprintf(msg, sizeof msg,
             "the export of job %s timed out waiting for rank(s) %s to ask "
             "for it",
             job->hex, who);
    gather_fail(ms, SP_ETIMEOUT, msg);
  }
}

/* ---- status ---- */

void mesh_status_pack(const struct job *job, msgpack_packer *pk) {
  const struct mesh *ms = job->mesh;
  uint32_t count = 0;
  for (uint32_t i = 0; ms != NULL && i < ms->nnodes; i++)
    count += ms->nodes[i] != NULL && ms->nodes[i]->present;
  sp_pack_str(pk, "nodes");
  msgpack_pack_array(pk, count);
  for (uint32_t i = 0; ms != NULL && i < ms->nnodes; i++) {
    const struct mesh_node *n = ms->nodes[i];
    if (n == NULL || !n->present)
      continue;
    bool self = n->node == ms->self;
    bool connected = self || n->data >= 0 || n->ctl != NULL ||
                     (n->node == 0 && ms->root_link != NULL && ms->hello_done);
    msgpack_pack_map(pk, 6);
    sp_pack_kv_u64(pk, "node", n->node);
    sp_pack_kv_str(pk, "address", n->addr);
    sp_pack_kv_bool(pk, "self", self);
    sp_pack_kv_bool(pk, "connected", connected);
    sp_pack_kv_u64(pk, "bytes_sent",
                   atomic_load_explicit(&n->sent, memory_order_relaxed));
    sp_pack_kv_u64(pk, "bytes_received",
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
