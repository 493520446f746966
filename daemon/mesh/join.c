/*
 * join.c - ranks joining and leaving a job across nodes.  A member queues
 * each join until the root's word (a rank joins once in the whole job) and
 * tells the root of every rank that leaves; the root decides joins and
 * frees the ranks that leave.
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "daemon/mesh/internal.h"
#include "shardport.h"

void join_refuse_all(struct mesh *ms, int code, const char *message) {
  while (ms->joins != NULL) {
    struct pending_join *pj = ms->joins;
    ms->joins = pj->next;
    struct conn *c = conn_find(ms->srv, pj->conn_id);
    if (c != NULL)
      conn_send_error(c, pj->request_id, code, "join: %s", message);
    free(pj);
  }
}

void join_send(struct mesh *ms, struct pending_join *pj) {
  struct nodemsg m = {.op = NODEMSG_JOIN,
                      .id = pj->seq,
                      .rank = pj->req.rank,
                      .world = pj->req.world,
                      .device_type = pj->req.device_type};
  if (inbox_send(ms->root_link, &m) == 0)
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
    join_send(ms, pj);
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
  struct job *job = srv->mesh_ops->shadow(srv, t->job, t->secret, t->world);
  if (job == NULL) {
    quota_release(owner, QUOTA_JOB);
    return conn_send_error(c, head->id, SP_ENOMEM, "join: out of memory");
  }
  job->owner = owner;
  struct mesh *ms = mesh_alloc(job, false);
  if (ms == NULL) {
    srv->mesh_ops->end(job);
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
  ms->ops->wake(job);
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
      if (nodelink_connect(ms->srv, ms->root_addr, &rootlink_ops, ms,
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
    struct mesh_node *n = mesh_node_get(ms, node);
    int rc =
        conn_send_error(c, head->id, SP_ERANK,
                        "join: rank %" PRIu32 " of job %s has already "
                        "joined on node %u (%s)",
                        req->rank, job->hex, node, n != NULL ? n->addr : "?");
    return rc == 0 ? 1 : rc;
  }
  return 0;
}

void mesh_rank_joined(struct job *job, uint32_t rank) {
  struct mesh *ms = job->mesh;
  /* Back, it asks with its registrations in full: the root forgot the
   * ones it kept for it when it left.  (Kept while it is gone, they let a
   * plan already confirmed fail naming the rank that left.) */
  member_forget_kept(ms, rank);
  if (!ms->root)
    return;
  coord_forget_plan(ms, rank);
  ms->rank_node[rank] = 0;
  ms->nodes[0]->nranks++;
}

/* The root's answer to a member's join. */
void join_verdict(struct mesh *ms, const struct nodemsg *m) {
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
    inbox_to_root(ms, &left, NULL);
    if (c != NULL)
      conn_send_error(c, pj->request_id, SP_ESTATE,
                      "join: this connection or rank joined meanwhile");
  } else if (ms->ops->admit(job, c, pj->request_id, &pj->req, pj->device) ==
             NULL) {
    inbox_to_root(ms, &left, NULL);
    conn_send_error(c, pj->request_id, SP_ENOMEM, "join: out of memory");
  }
  free(pj);
  ms->ops->wake(job);
}

void mesh_rank_left(struct job *job, uint32_t rank, bool disconnected,
                    const char *reason) {
  struct mesh *ms = job->mesh;
  ms->ask_sent[rank] = 0;
  struct nodemsg m = {.op = NODEMSG_LEFT, .rank = rank,
                      .disconnected = disconnected};
  if (reason != NULL)
    snprintf(m.message, sizeof m.message, "%s", reason);
  inbox_to_root(ms, &m, NULL);
}

void join_left_at_root(struct mesh *ms, struct mesh_node *n,
                       const struct nodemsg *m) {
  struct job *job = ms->job;
  if (m->rank >= job->world || ms->rank_node[m->rank] != n->node)
    return;
  ms->rank_node[m->rank] = PLAN_NONE;
  coord_forget_plan(ms, m->rank);
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
  ms->ops->rank_departed(job, m->rank, m->disconnected,
                         m->message[0] != '\0' ? m->message : NULL);
  char gone[SP_ERRMSG_MAX + 1];
  if (ms->nasked > 0 && ms->ops->departed(job, gone, sizeof gone))
    coord_gather_fail(ms, SP_ERANKLOST, gone);
  ms->ops->wake(job);
}

void join_at_root(struct mesh *ms, struct mesh_node *n,
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
    struct mesh_node *where = mesh_node_get(ms, ms->rank_node[m->rank]);
    reply.op = NODEMSG_ERROR;
    reply.code = SP_ERANK;
    snprintf(reply.message, sizeof reply.message,
             "join: rank %" PRIu32 " of job %s has already joined on node "
             "%" PRIu32 " (%s)",
             m->rank, job->hex, ms->rank_node[m->rank],
             where != NULL ? where->addr : "?");
  } else {
    ms->rank_node[m->rank] = n->node;
    coord_forget_plan(ms, m->rank);
    n->nranks++;
    ms->ops->rank_returned(job, m->rank);
    ms->ops->note_joined(job);
    log_with(LOG_LEVEL_INFO, LOG_JOB(job->hex),
             "job %s: rank %" PRIu32 " joined on node %u (%s)", job->hex,
             m->rank, n->node, n->addr);
  }
  inbox_to_node(ms, n->node, &reply, NULL, 0);
}
