/*
 * member.c - a member's side of an export (every node's, the root's own
 * included): it sends its ranks' asks and registrations to the root,
 * starts the export the root's plan announces once its data links are
 * dialled, says planned and moved, and follows the root's go, publish and
 * fail.
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "daemon/mesh/internal.h"
#include "daemon/save.h"
#include "shardport.h"

void mesh_asks(struct job *job) {
  struct mesh *ms = job->mesh;
  /* The root's silence counts from the first ask of a quiet job. */
  if (!mesh_active(job))
    ms->heard_ms = ms->ops->now_ms();
  for (uint32_t r = 0; r < job->world; r++) {
    struct job_member *m = job->members[r];
    if (m == NULL || m->lost || !m->asked || ms->ask_sent[r] == m->ask_id + 1)
      continue;
    if (ms->broken) {
      ms->ops->answer_ask(m, ms->broken_code, ms->broken_msg);
      continue;
    }
    struct sp_msgbuf mb;
    struct sp_frame_tx tx;
    nodemsg_pack_meta(r, &m->reg, &m->ask.groups, &mb);
    struct nodeblob *meta = NULL;
    if (sp__msgbuf_finish(&mb, &tx) == 0) {
      meta = nodeblob_wrap(tx.buf, tx.buf + SP_FRAME_HEADER,
                           tx.len - SP_FRAME_HEADER);
      if (meta == NULL)
        free(tx.buf);
    }
    if (meta == NULL) {
      ms->ops->answer_ask(m, SP_ENOMEM,
                          "out of memory sending the rank's "
                          "registrations to the job's root");
      continue;
    }
    /* Registrations the root relayed last travel as their digest. */
    const struct nodeblob *kept = ms->kept_metas[r];
    bool same = kept != NULL && kept->len == meta->len &&
                memcmp(kept->payload, meta->payload, meta->len) == 0;
    struct nodemsg a = {.op = NODEMSG_ASK,
                        .gather = ms->gather,
                        .rank = r,
                        .max_keys = m->ask.max_keys,
                        .max_bytes = m->ask.max_bytes,
                        .save = m->ask.save,
                        .timeout_ms = m->ask.timeout_ms,
                        .has_meta_digest = same,
                        .meta_digest = same ? nodeblob_digest(kept) : 0};
    nodeblob_unref(ms->sent_meta[r]);
    ms->sent_meta[r] = nodeblob_ref(meta);
    inbox_to_root(ms, &a, same ? NULL : meta);
    nodeblob_unref(meta);
    ms->ask_sent[r] = m->ask_id + 1;
  }
}

static void member_new_gather(struct mesh *ms, uint64_t next) {
  ms->gather = next;
}

/* The local asks were answered (failed): new asks go to the root again. */
void member_forget_asks(struct mesh *ms) {
  memset(ms->ask_sent, 0, ms->job->world * sizeof *ms->ask_sent);
}

void member_forget_kept(struct mesh *ms, uint32_t rank) {
  nodeblob_unref(ms->kept_metas[rank]);
  ms->kept_metas[rank] = NULL;
}

static void forget_kept_plan(struct mesh *ms) {
  for (uint32_t r = 0; r < ms->job->world; r++)
    member_forget_kept(ms, r);
  free(ms->kept_nodes);
  free(ms->kept_rank_nodes);
  ms->kept_nodes = NULL;
  ms->kept_rank_nodes = NULL;
  ms->kept_nnodes = 0;
}

/* A plan received in full is the one the next confirmed plan names; out
 * of memory, none is kept, and the next asks send their registrations. */
static void keep_plan(struct mesh *ms, const struct mesh_export *mx) {
  forget_kept_plan(ms);
  ms->kept_nodes = malloc(mx->nnodes * sizeof *mx->nodes);
  ms->kept_rank_nodes = malloc(mx->world * sizeof *mx->rank_nodes);
  if (ms->kept_nodes == NULL || ms->kept_rank_nodes == NULL) {
    forget_kept_plan(ms);
    return;
  }
  memcpy(ms->kept_nodes, mx->nodes, mx->nnodes * sizeof *mx->nodes);
  memcpy(ms->kept_rank_nodes, mx->rank_nodes,
         mx->world * sizeof *mx->rank_nodes);
  ms->kept_nnodes = mx->nnodes;
  for (uint32_t r = 0; r < mx->world; r++)
    ms->kept_metas[r] = nodeblob_ref(mx->metas[r]);
}

/* Brings the node table in line with a plan's roster. */
static int apply_roster(struct mesh *ms, const struct mesh_export *mx) {
  for (size_t i = 0; i < mx->nnodes; i++) {
    const struct nodemsg_node *r = &mx->nodes[i];
    struct mesh_node *n = mesh_node_make(ms, r->node);
    if (n == NULL)
      return SP_ENOMEM;
    if (n->node_id != r->node_id && n->node_id != 0)
      mesh_node_close_data(n);
    n->node_id = r->node_id;
    n->present = true;
    snprintf(n->addr, sizeof n->addr, "%s", r->addr);
  }
  return 0;
}

/* Fails what this node takes part in, and tells the root. */
void member_fail(struct mesh *ms, int code, const char *message) {
  struct job *job = ms->job;
  if (ms->current != NULL) {
    uint64_t gather = ms->current->gather;
    ms->ops->fail(job, code, message);
    struct nodemsg f = {.op = NODEMSG_FAIL, .gather = gather, .code = code};
    snprintf(f.message, sizeof f.message, "%s", message);
    inbox_to_root(ms, &f, NULL);
  }
}

void member_send_planned(struct mesh *ms) {
  struct mesh_export *mx = ms->current;
  if (mx == NULL || !ms->awaiting_links || !datalink_ready(ms, mx))
    return;
  ms->awaiting_links = false;
  struct nodemsg p = {.op = NODEMSG_PLANNED,
                      .gather = mx->gather,
                      .digest = ms->planned_digest,
                      .replica_rank = ms->planned_replica_rank,
                      .nreplicas = ms->planned_nreplicas,
                      .replicas = ms->planned_replicas};
  inbox_to_root(ms, &p, NULL);
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
  member_send_planned(ms);
}

void mesh_moved(struct job *job) {
  struct mesh *ms = job->mesh;
  if (ms->current == NULL)
    return;
  struct nodemsg m = {.op = NODEMSG_MOVED, .gather = ms->current->gather};
  inbox_to_root(ms, &m, NULL);
}

void mesh_saved(struct job *job, uint32_t step) {
  struct mesh *ms = job->mesh;
  if (ms->current == NULL)
    return;
  struct nodemsg m = {.op = NODEMSG_SAVED, .gather = ms->current->gather,
                      .step = step};
  inbox_to_root(ms, &m, NULL);
}

void mesh_failed(struct job *job, int code, const char *message) {
  struct mesh *ms = job->mesh;
  if (ms->current == NULL)
    return;
  struct nodemsg f = {.op = NODEMSG_FAIL, .gather = ms->current->gather,
                      .code = code};
  snprintf(f.message, sizeof f.message, "%s", message);
  inbox_to_root(ms, &f, NULL);
}

/* Fails the plan of gather this node cannot start, on every node. */
static void refuse_plan(struct mesh *ms, uint64_t gather, int code,
                        const char *message) {
  struct nodemsg f = {.op = NODEMSG_FAIL, .gather = gather, .code = code};
  snprintf(f.message, sizeof f.message, "%s", message);
  inbox_to_root(ms, &f, NULL);
  ms->ops->fail_asks(ms->job, code, message);
  member_forget_asks(ms);
}

static void refuse_start(struct mesh *ms, struct mesh_export *mx, int code,
                         const char *message) {
  refuse_plan(ms, mx->gather, code, message);
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
  ms->heard_ms = ms->ops->now_ms();
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
      ms->ops->rank_returned(job, r);
  /* This node must still hold every rank the root placed here. */
  for (uint32_t r = 0; r < job->world; r++) {
    const struct job_member *m = job->members[r];
    if (mx->rank_nodes[r] != ms->self ||
        (m != NULL && !m->lost && m->asked))
      continue;
    char msg[SP_ERRMSG_MAX + 1];
    if (!ms->ops->departed(job, msg, sizeof msg))
      ms->ops->departure_text(job, r, m == NULL || m->disconnected, "", NULL,
                              msg, sizeof msg);
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
  int bad = datalink_ensure(ms, mx);
  char msg[SP_ERRMSG_MAX + 1];
  /* Current first: a failure while starting reports this export. */
  ms->current = mx;
  struct gather_options o = {.max_keys = mx->max_keys,
                             .max_bytes = mx->max_bytes,
                             .timeout_ms = mx->timeout_ms,
                             .save_limit = mx->save_limit};
  int rc = ms->ops->start(job, mx, mx->export_id, &o, msg, sizeof msg);
  if (rc != 0) {
    ms->current = NULL;
    refuse_start(ms, mx, rc, msg);
    return;
  }
  /* Those asks are the export's now: the next ones go to the root. */
  for (uint32_t r = 0; r < job->world; r++)
    if (mx->rank_nodes[r] == ms->self)
      ms->ask_sent[r] = 0;
  if (mx->reused) {
    ms->plans_reused++;
    metrics_plan_reused(ms->srv->metrics);
  }
  if (bad > 0 && ms->current == mx)
    datalink_fail(ms->nodes[bad - 1], "cannot connect");
}

/* The metas of a plan arrive one frame each, in rank order. */
void member_meta(struct mesh *ms, struct nodeblob *blob) {
  struct mesh_export *mx = ms->incoming;
  if (mx == NULL) {
    nodeblob_unref(blob);
    return;
  }
  mx->metas[mx->nmetas++] = blob;
  if (mx->nmetas < mx->world)
    return;
  ms->incoming = NULL;
  keep_plan(ms, mx);
  mesh_export_free(ms->ready);
  ms->ready = mx;
  mesh_try_start(ms->job);
}

/* A plan the root confirmed by digest starts from the plan this node
 * kept: 0, or a code and a sentence (nothing changed). */
static int plan_from_kept(struct mesh *ms, const struct nodemsg *m,
                          char *msg, size_t msglen) {
  struct job *job = ms->job;
  if (ms->kept_rank_nodes == NULL || m->reuse != ms->planned_digest) {
    snprintf(msg, msglen,
             "node %" PRIu32 " does not hold the plan %016" PRIx64
             " the root confirmed for export %" PRIu64 " of job %s",
             ms->self, m->reuse, m->export_id, job->hex);
    return SP_ESTATE;
  }
  for (uint32_t r = 0; r < job->world; r++)
    if (ms->kept_metas[r] == NULL) {
      snprintf(msg, msglen,
               "node %" PRIu32 " no longer holds the registrations of rank "
               "%" PRIu32 " the root confirmed for export %" PRIu64,
               ms->self, r, m->export_id);
      return SP_ESTATE;
    }
  return 0;
}

static void member_plan(struct mesh *ms, const struct nodemsg *m,
                        struct nodeblob **blobs, size_t nblobs) {
  struct job *job = ms->job;
  if (m->has_reuse) {
    char msg[SP_ERRMSG_MAX + 1];
    int rc = plan_from_kept(ms, m, msg, sizeof msg);
    if (rc != 0) {
      member_new_gather(ms, m->gather + 1);
      refuse_plan(ms, m->gather, rc, msg);
      return;
    }
  }
  const struct nodemsg_node *nodes = m->has_reuse ? ms->kept_nodes : m->nodes;
  size_t nnodes = m->has_reuse ? ms->kept_nnodes : m->nnodes;
  const uint32_t *rank_nodes =
      m->has_reuse ? ms->kept_rank_nodes : m->rank_nodes;
  uint32_t world = m->has_reuse ? job->world : m->world;
  bool listed = false;
  for (size_t i = 0; i < nnodes; i++)
    listed = listed || nodes[i].node == ms->self;
  if (world != job->world || !listed) {
    rootlink_lost(ms, "its plan does not fit this job");
    return;
  }
  struct mesh_export *mx = calloc(1, sizeof *mx);
  if (mx != NULL) {
    mx->rank_nodes = malloc(world * sizeof *mx->rank_nodes);
    mx->nodes = malloc(nnodes * sizeof *mx->nodes);
    mx->metas = calloc(world, sizeof *mx->metas);
  }
  if (mx == NULL || mx->rank_nodes == NULL || mx->nodes == NULL ||
      mx->metas == NULL) {
    if (mx != NULL) {
      free(mx->rank_nodes);
      free(mx->nodes);
      free(mx->metas);
      free(mx);
    }
    rootlink_lost(ms, "out of memory for its plan");
    return;
  }
  mx->mesh = ms;
  mx->gather = m->gather;
  mx->export_id = m->export_id;
  mx->world = world;
  mx->max_keys = m->max_keys;
  mx->max_bytes = m->max_bytes;
  mx->save_limit = m->save_limit;
  mx->timeout_ms = m->timeout_ms;
  mx->comm_gen = m->comm_gen;
  memcpy(mx->nccl_id, m->comm_gen > 0 ? m->nccl_id : job->nccl_id,
         NODE_NCCL_ID_BYTES);
  memcpy(mx->rank_nodes, rank_nodes, world * sizeof *mx->rank_nodes);
  memcpy(mx->nodes, nodes, nnodes * sizeof *mx->nodes);
  mx->nnodes = nnodes;
  ms->timeout_ms = m->timeout_ms;
  member_new_gather(ms, m->gather + 1);
  mesh_export_free(ms->incoming);
  ms->incoming = NULL;
  if (m->has_reuse) {
    mx->reused = true;
    for (uint32_t r = 0; r < world; r++)
      mx->metas[mx->nmetas++] = nodeblob_ref(ms->kept_metas[r]);
    mesh_export_free(ms->ready);
    ms->ready = mx;
    mesh_try_start(job);
    return;
  }
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
    ms->ops->fail(job, m->code, m->message);
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
    ms->ops->fail_asks(job, m->code, m->message);
    member_forget_asks(ms);
    member_new_gather(ms, m->gather + 1);
  }
}

void member_handle(struct mesh *ms, const struct nodemsg *m,
                   struct nodeblob **blobs, size_t nblobs) {
  struct job *job = ms->job;
  ms->heard_ms = ms->ops->now_ms();
  switch (m->op) {
  case NODEMSG_JOIN:
  case NODEMSG_ERROR:
    join_verdict(ms, m);
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
      ms->ops->go(job, m->differ ? &differ : NULL);
    }
    break;
  case NODEMSG_PUBLISH:
    if (ms->current != NULL && ms->current->gather == m->gather) {
      /* A save is not over until the last step of its commit. */
      ms->current->published = ms->current->save_limit == 0;
      ms->ops->publish(job);
    }
    break;
  case NODEMSG_COMMIT:
    if (ms->current != NULL && ms->current->gather == m->gather &&
        ms->current->save_limit != 0) {
      if (m->step == SAVE_STEPS)
        ms->current->published = true;
      ms->ops->commit(job, m->step);
    }
    break;
  case NODEMSG_FAIL:
    member_fail_msg(ms, m);
    break;
  case NODEMSG_ABORT:
    rootlink_ended(ms, m);
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
