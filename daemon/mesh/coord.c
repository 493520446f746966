/*
 * coord.c - the root's coordination of an export across nodes: it gathers
 * every rank's ask, announces one plan to every node, compares their
 * digests, says go once every node planned alike and publish once every
 * node moved, and fails the export everywhere when a node fails it or is
 * lost.
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "daemon/gather.h"
#include "daemon/mesh/internal.h"
#include "daemon/save.h"
#include "shardport.h"

void coord_forget_plan(struct mesh *ms, uint32_t rank) {
  ms->creuse = ms->ccandidate = false;
  if (rank == PLAN_NONE)
    return;
  nodeblob_unref(ms->ckept[rank]);
  ms->ckept[rank] = NULL;
}

static void coord_fail(struct mesh *ms, uint64_t gather, int code,
                       const char *message, bool export_nodes_only) {
  /* A plan that failed anywhere is confirmed to nobody. */
  coord_forget_plan(ms, PLAN_NONE);
  struct nodemsg f = {.op = NODEMSG_FAIL, .gather = gather, .code = code};
  snprintf(f.message, sizeof f.message, "%s", message);
  for (uint32_t i = 0; i < ms->nnodes; i++) {
    struct mesh_node *n = ms->nodes[i];
    if (n == NULL || !n->present || (export_nodes_only && !n->in_export))
      continue;
    inbox_to_node(ms, i, &f, NULL, 0);
  }
}

static void coord_clear_asks(struct mesh *ms) {
  for (uint32_t r = 0; r < ms->job->world; r++) {
    nodeblob_unref(ms->asks[r].meta);
    memset(&ms->asks[r], 0, sizeof ms->asks[r]);
  }
  ms->nasked = 0;
}

/* A gather that cannot complete: every node's waiting ranks hear why. */
void coord_gather_fail(struct mesh *ms, int code, const char *message) {
  /* Where ranks of the root's own node wait, export.c logs the failure as
   * it answers them (export_fail_asks, through the inbox); the root logs
   * it here only when none do, so that it is logged once, at warn, as
   * every failed export is. */
  if (!ms->ops->any_asked(ms->job))
    log_with(LOG_LEVEL_WARN, LOG_JOB(ms->job->hex),
             "job %s: export failed before it started: %s: %s", ms->job->hex,
             sp_err_name(code), message);
  coord_fail(ms, ms->cgather, code, message, false);
  coord_clear_asks(ms);
  ms->cgather++;
}

static void coord_export_over(struct mesh *ms) {
  ms->cstate = COORD_IDLE;
  for (uint32_t i = 0; i < ms->nnodes; i++)
    if (ms->nodes[i] != NULL)
      ms->nodes[i]->in_export = false;
}

/* A rank's part in the gather as the root knows it (gather.h). */
static void coord_rank_ask(const void *ctx, uint32_t r,
                           struct gather_ask *out) {
  const struct mesh *ms = ctx;
  const struct mesh_ask *a = &ms->asks[r];
  *out = (struct gather_ask){.joined = ms->rank_node[r] != PLAN_NONE,
                             .asked = a->asked,
                             .max_keys = a->max_keys,
                             .max_bytes = a->max_bytes,
                             .timeout_ms = a->timeout_ms,
                             .save = a->save,
                             .deadline_ms = a->deadline_ms};
}

struct gather_ranks coord_gather_ranks(const struct mesh *ms) {
  return (struct gather_ranks){
      .world = ms->job->world, .ask = coord_rank_ask, .ctx = ms};
}

/* The roster of the export: every node that holds ranks, each now in the
 * export, its planned and moved reset and its silence counted from now.
 * 0 or SP_ENOMEM (no node changed). */
static int coord_roster(struct mesh *ms, struct nodemsg *p) {
  p->nodes = calloc(ms->nnodes, sizeof *p->nodes);
  if (p->nodes == NULL)
    return SP_ENOMEM;
  for (uint32_t i = 0; i < ms->nnodes; i++) {
    struct mesh_node *n = ms->nodes[i];
    if (n == NULL || !n->present || n->nranks == 0)
      continue;
    p->nodes[p->nnodes++] =
        (struct nodemsg_node){.node = n->node, .node_id = n->node_id};
    snprintf(p->nodes[p->nnodes - 1].addr, NODE_ADDR_MAX, "%s", n->addr);
    n->in_export = true;
    n->planned = n->moved = false;
    n->saved = 0;
    n->heard_ms = ms->ops->now_ms();
  }
  return 0;
}

/* The communicators across nodes: a failure since they were last used may
 * have aborted them, and a real NCCL id names the bootstrap listener of
 * the process that made it, so it cannot be used twice; the nodes make a
 * new generation from a fresh id (docs/gpu.md), which the plan carries.
 * 0, or SP_EBACKEND with a sentence when no id can be made. */
static int coord_comm_generation(struct mesh *ms, struct nodemsg *p,
                                 char *msg, size_t msglen) {
  struct job *job = ms->job;
  if (ms->comm_pending)
    ms->comm_stale = true;
  ms->comm_pending = false;
  if (p->nnodes <= 1 || !job->has_nccl_id)
    return 0;
  if (ms->comm_stale) {
    char why[256];
    /* The last generation's root goes with it, whether it completed (its
     * ranks all checked in) or never will. */
    gpu_nccl_root_end(job->nccl_root);
    job->nccl_root = NULL;
    if (gpu_comms_unique_id(ms->srv->backend->gpu, ms->comm_id,
                            &job->nccl_root, why, sizeof why) != 0) {
      snprintf(msg, msglen, "cannot make a new NCCL id: %s", why);
      return SP_EBACKEND;
    }
    ms->comm_gen++;
    ms->comm_stale = false;
    log_with(LOG_LEVEL_INFO, LOG_JOB(job->hex),
             "job %s: NCCL communicators of generation %" PRIu64
             " from a new id",
             job->hex, ms->comm_gen);
  }
  ms->comm_pending = true;
  p->comm_gen = ms->comm_gen;
  memcpy(p->nccl_id, ms->comm_id, NODE_NCCL_ID_BYTES);
  return 0;
}

/* The plan goes to every node of its roster with every rank's meta, the
 * same bytes to all, which the root keeps for the next asks to name; or,
 * reused, with its digest alone.  The root awaits their planned. */
static void coord_announce(struct mesh *ms, const struct nodemsg *p,
                           struct nodeblob **metas) {
  struct job *job = ms->job;
  for (uint32_t r = 0; r < job->world && !p->has_reuse; r++) {
    metas[r] = ms->asks[r].meta;
    if (ms->ckept[r] != metas[r]) {
      nodeblob_unref(ms->ckept[r]);
      ms->ckept[r] = nodeblob_ref(metas[r]);
    }
  }
  if (p->has_reuse)
    log_with(LOG_LEVEL_INFO, LOG_JOB(job->hex),
             "job %s: export %" PRIu64 ": every rank asked, none changed; "
             "plan %016" PRIx64 " confirmed on %zu node(s)",
             job->hex, p->export_id, p->reuse, p->nnodes);
  else
    log_with(LOG_LEVEL_INFO, LOG_JOB(job->hex),
             "job %s: export %" PRIu64 ": every rank asked; "
             "planning on %zu node(s)",
             job->hex, p->export_id, p->nnodes);
  /* Every node's planned must agree before this plan may be confirmed. */
  ms->creuse = false;
  ms->ccandidate = true;
  ms->cstate = COORD_PLANNING;
  ms->cexport_gather = ms->cgather;
  ms->cexport_id = p->export_id;
  ms->ctimeout = p->timeout_ms;
  ms->csave_limit = p->save_limit;
  for (size_t i = 0; i < p->nnodes; i++)
    inbox_to_node(ms, p->nodes[i].node, p, metas,
                  p->has_reuse ? 0 : job->world);
}

/* Every rank asked: the options they agree on, the roster, the
 * communicators' generation, then the plan announced to every node; a
 * step that fails fails the gather everywhere.  The next asks belong to
 * the next gather. */
static void coord_gather_complete(struct mesh *ms) {
  struct job *job = ms->job;
  struct gather_ranks g = coord_gather_ranks(ms);
  struct gather_options o;
  char msg[384];
  int rc = gather_agree(&g, ms->srv->cfg, &o, msg, sizeof msg);
  if (rc != 0) {
    coord_gather_fail(ms, rc, msg);
    return;
  }
  struct nodemsg p = {.op = NODEMSG_PLAN,
                      .gather = ms->cgather,
                      .export_id = ms->next_export_id++,
                      .max_keys = o.max_keys,
                      .max_bytes = o.max_bytes,
                      .timeout_ms = o.timeout_ms,
                      .save_limit = o.save_limit,
                      .world = job->world,
                      .rank_nodes = ms->rank_node};
  /* No rank's registrations changed, and no rank or node came or went,
   * since every node planned alike: the root confirms that plan. */
  p.has_reuse = ms->creuse;
  for (uint32_t r = 0; r < job->world && p.has_reuse; r++)
    p.has_reuse = ms->asks[r].kept;
  p.reuse = ms->creuse_digest;
  struct nodeblob **metas = malloc(job->world * sizeof *metas);
  if (metas == NULL || coord_roster(ms, &p) != 0) {
    free(metas);
    coord_gather_fail(ms, SP_ENOMEM, "out of memory planning the export");
    return;
  }
  rc = coord_comm_generation(ms, &p, msg, sizeof msg);
  if (rc != 0) {
    coord_export_over(ms);
    free(metas);
    free(p.nodes);
    coord_gather_fail(ms, rc, msg);
    return;
  }
  coord_announce(ms, &p, metas);
  free(metas);
  free(p.nodes);
  coord_clear_asks(ms);
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
  if (ms->ops->departed(job, gone, sizeof gone)) {
    coord_gather_fail(ms, SP_ERANKLOST, gone);
    return;
  }
  /* Registrations named by digest are those the root relayed last. */
  struct nodeblob *meta = blob;
  if (m->has_meta_digest) {
    meta = ms->ckept[m->rank];
    if (meta == NULL || nodeblob_digest(meta) != m->meta_digest) {
      char msg[256];
      snprintf(msg, sizeof msg,
               "node %u named the registrations of rank %" PRIu32
               " by a digest (%016" PRIx64 ") that are not those the root "
               "relayed last",
               n->node, m->rank, m->meta_digest);
      coord_gather_fail(ms, SP_EBADMSG, msg);
      return;
    }
  }
  if (meta == NULL)
    return;
  struct mesh_ask *a = &ms->asks[m->rank];
  uint32_t t = m->timeout_ms > 0 ? m->timeout_ms
                                 : ms->srv->cfg->export_timeout_ms;
  *a = (struct mesh_ask){.asked = true,
                         .max_keys = m->max_keys,
                         .max_bytes = m->max_bytes,
                         .save = m->save,
                         .timeout_ms = m->timeout_ms,
                         .deadline_ms = ms->ops->now_ms() + t,
                         .kept = m->has_meta_digest,
                         .meta = nodeblob_ref(meta)};
  ms->nasked++;
  ms->ops->schedule(job);
  if (ms->nasked == job->world && ms->cstate == COORD_IDLE)
    coord_gather_complete(ms);
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
      coord_export_over(ms);
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
    coord_export_over(ms);
    return;
  }
  ms->cstate = COORD_MOVING;
  ms->creuse = ms->ccandidate;
  ms->creuse_digest = digest0;
  struct nodemsg go = {.op = NODEMSG_GO, .gather = ms->cexport_gather};
  if (compare_node_replicas(ms, &go) != 0)
    return;
  for (uint32_t i = 0; i < ms->nnodes; i++)
    if (ms->nodes[i] != NULL && ms->nodes[i]->in_export)
      inbox_to_node(ms, i, &go, NULL, 0);
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
      inbox_to_node(ms, i, &pub, NULL, 0);
  if (ms->csave_limit != 0) {
    /* A save goes on: its owners write, and the root holds the commit. */
    ms->cstate = COORD_SAVING;
    return;
  }
  coord_export_over(ms);
  if (ms->nasked == ms->job->world)
    coord_gather_complete(ms);
}

/* A save's commit: step s is passed once every node of the export has
 * reported it, and the root tells them all (daemon/save.h). */
static void coord_saved(struct mesh *ms, struct mesh_node *n,
                        const struct nodemsg *m) {
  if (ms->cstate != COORD_SAVING || m->gather != ms->cexport_gather ||
      !n->in_export || m->step != n->saved + 1)
    return;
  n->saved = m->step;
  for (uint32_t i = 0; i < ms->nnodes; i++)
    if (ms->nodes[i] != NULL && ms->nodes[i]->in_export &&
        ms->nodes[i]->saved < m->step)
      return;
  struct nodemsg commit = {.op = NODEMSG_COMMIT,
                           .gather = ms->cexport_gather,
                           .step = m->step};
  for (uint32_t i = 0; i < ms->nnodes; i++)
    if (ms->nodes[i] != NULL && ms->nodes[i]->in_export)
      inbox_to_node(ms, i, &commit, NULL, 0);
  if (m->step < SAVE_STEPS)
    return;
  coord_export_over(ms);
  if (ms->nasked == ms->job->world)
    coord_gather_complete(ms);
}

static void coord_fail_msg(struct mesh *ms, const struct nodemsg *m) {
  if (ms->cstate != COORD_IDLE && m->gather == ms->cexport_gather) {
    coord_fail(ms, m->gather, m->code, m->message, true);
    coord_export_over(ms);
    if (ms->nasked == ms->job->world)
      coord_gather_complete(ms);
  } else if (m->gather == ms->cgather) {
    coord_gather_fail(ms, m->code, m->message);
  }
}

void coord_handle(struct mesh *ms, uint32_t from, const struct nodemsg *m,
                  struct nodeblob *blob) {
  struct mesh_node *n = mesh_node_get(ms, from);
  if (n == NULL || !n->present)
    return;
  n->heard_ms = ms->ops->now_ms();
  switch (m->op) {
  case NODEMSG_JOIN:
    join_at_root(ms, n, m);
    break;
  case NODEMSG_LEFT:
    join_left_at_root(ms, n, m);
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
  case NODEMSG_SAVED:
    coord_saved(ms, n, m);
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
    coord_node_lost(ms, n, NULL);
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
void coord_node_lost(struct mesh *ms, struct mesh_node *n, const char *why) {
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
    coord_forget_plan(ms, r);
    /* Its ranks are gone with it (a node that said goodbye had none). */
    if (why != NULL)
      ms->ops->rank_departed(job, r, true, reason);
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
      coord_export_over(ms);
    } else if (had_asks || ms->nasked > 0) {
      mesh_lost_message(job->hex, n->node, n->addr, 0, msg, sizeof msg);
      coord_gather_fail(ms, SP_ENODELOST, msg);
    }
  }
  n->in_export = false;
  ms->ops->wake(job);
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
    coord_node_lost(ms, n, why);
    return;
  }
  if (m.op == NODEMSG_ASK && !m.has_meta_digest) {
    /* Its meta is the next frame, kept as bytes. */
    n->ask = m;
    n->ask_pending = true;
    nodelink_expect_blobs(n->ctl, 1);
    n->heard_ms = ms->ops->now_ms();
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
  coord_node_lost(n->mesh, n, sp_strerror(code));
}

const struct nodelink_ops coord_ctl_ops = {
    .frame = on_ctl_frame,
    .blob = on_ctl_blob,
    .closed = on_ctl_closed,
};
