/*
 * rootlink.c - a member's control link to its job's root: the handshake
 * that proves both know the job's secret (peerauth.c), the frames and
 * metas that come on it, and what follows when the root is lost, refuses
 * this daemon or ends the job.
 */
#include <inttypes.h>
#include <stdio.h>
#include <string.h>

#include "daemon/mesh/internal.h"
#include "shardport.h"

/* The root is gone: nothing this node holds can export again. */
void rootlink_lost(struct mesh *ms, const char *why) {
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
    join_refuse_all(ms, SP_ENODELOST, msg);
  }
  if (ms->current != NULL)
    ms->ops->fail(job, SP_ENODELOST, ms->broken_msg);
  mesh_export_free(ms->ready);
  mesh_export_free(ms->incoming);
  ms->ready = ms->incoming = NULL;
  ms->ops->fail_asks(job, SP_ENODELOST, ms->broken_msg);
  member_forget_asks(ms);
  if (!job->ever_joined)
    ms->ops->end(job);
  ms->ops->wake(job);
}

/* The root ended the job for good: this node ends its part with the
 * root's code and message, which every rank here hears, and every join
 * still waiting for the root's answer. */
void rootlink_ended(struct mesh *ms, const struct nodemsg *m) {
  struct job *job = ms->job;
  log_with(LOG_LEVEL_WARN,
           &(struct log_fields){.job = job->hex,
                                .rank = LOG_NONE,
                                .node = LOG_NONE,
                                .error = m->code},
           "job %s: the root daemon %s ended the job: %s: %s", job->hex,
           ms->root_addr, sp_err_name(m->code), m->message);
  ms->broken = true;
  ms->broken_code = m->code;
  snprintf(ms->broken_msg, sizeof ms->broken_msg, "%s", m->message);
  join_refuse_all(ms, m->code, m->message);
  ms->ops->terminate(job, m->code, m->message);
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
  join_refuse_all(ms, code, msg);
  ms->ops->end(ms->job);
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
    hello_answer_challenge(l, ms->job, PEERAUTH_CONTROL, m->nonce, &h);
    inbox_send(l, &h);
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
  struct mesh_node *self = mesh_node_make(ms, m->node);
  struct mesh_node *root = mesh_node_make(ms, 0);
  if (self != NULL && root != NULL) {
    self->node_id = ms->srv->node_id;
    self->present = true;
    snprintf(self->addr, sizeof self->addr, "%s", ms->srv->peer_address);
    root->node_id = m->node_id;
    root->present = true;
    snprintf(root->addr, sizeof root->addr, "%s", ms->root_addr);
  }
  nodelink_count_into(
      l, (struct metrics_bytes *const[NODELINK_COUNTERS]){
             root != NULL ? &root->ctl_bytes : NULL,
             metrics_control(ms->srv->metrics)});
  log_with(LOG_LEVEL_INFO, LOG_JOB(ms->job->hex),
           "job %s: node %u of the job (root %s)", ms->job->hex, m->node,
           ms->root_addr);
  for (struct pending_join *p = ms->joins; p != NULL; p = p->next)
    join_send(ms, p);
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
      rootlink_lost(ms, why);
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
  ms->heard_ms = ms->ops->now_ms();
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
    snprintf(msg, sizeof msg,
             "cannot reach the job's root daemon, node 0 "
             "(%s): %s",
             ms->root_addr, why);
    ms->broken = true;
    ms->broken_code = SP_ENODELOST;
    snprintf(ms->broken_msg, sizeof ms->broken_msg, "%s", msg);
    join_refuse_all(ms, SP_ENODELOST, msg);
    ms->ops->end(ms->job);
    return;
  }
  rootlink_lost(ms, why);
}

const struct nodelink_ops rootlink_ops = {
    .frame = on_root_frame,
    .blob = on_root_blob,
    .closed = on_root_closed,
};
