/*
 * hello.c - links that other daemons open to this one: the listener's
 * challenge, then the dialer's first frame, peer_hello (a node joining a
 * job rooted here) or peer_data (a data link), proven with the job's
 * secret before anything else is read.
 */
#include <stdarg.h>
#include <inttypes.h>
#include <stdio.h>
#include <string.h>

#include "daemon/mesh/internal.h"
#include "shardport.h"

/* The stream a data link's handshake m (peer_data, asked or answered for
 * it) opens, or NULL for a control link: what its proofs bind. */
static const struct peerauth_stream *
hello_stream(enum peerauth_link kind, const struct nodemsg *m,
             struct peerauth_stream *st) {
  if (kind != PEERAUTH_DATA)
    return NULL;
  *st = (struct peerauth_stream){.node = m->node,
                                 .node_id = m->node_id,
                                 .stream = m->stream,
                                 .streams = m->streams,
                                 .export_id = m->export_id};
  return st;
}

/* A dialled link's answer to the listener's challenge: this daemon's nonce
 * and proof in m, and in the link the proof the listener must send back. */
void hello_answer_challenge(struct nodelink *l, const struct job *job,
                            enum peerauth_link kind,
                            const uint8_t listener_nonce[PEERAUTH_NONCE_BYTES],
                            struct nodemsg *m) {
  struct peerauth_stream st;
  const struct peerauth_stream *bound = hello_stream(kind, m, &st);
  m->version = NODE_PROTOCOL_VERSION;
  memcpy(m->job, job->id, JOB_ID_BYTES);
  peerauth_proof(job->secret, PEERAUTH_DIALER, kind, job->id, listener_nonce,
                 m->nonce, bound, m->proof);
  peerauth_proof(job->secret, PEERAUTH_LISTENER, kind, job->id,
                 listener_nonce, m->nonce, bound, nodelink_handshake(l));
}

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

/* The listener's proof to the daemon whose peer_hello or peer_data m is. */
static void hello_listener_proof(const struct job *job, struct nodelink *l,
                                 enum peerauth_link kind,
                                 const struct nodemsg *m,
                                 struct nodemsg *reply) {
  struct peerauth_stream st;
  peerauth_proof(job->secret, PEERAUTH_LISTENER, kind, job->id,
                 nodelink_handshake(l), m->nonce, hello_stream(kind, m, &st),
                 reply->proof);
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
    n = mesh_node_make(ms, ms->nnodes);
  if (n == NULL)
    return refuse_link(l, SP_ELIMIT, "job %s has too many nodes", job->hex);
  n->node_id = m->node_id;
  n->present = true;
  n->ctl = l;
  n->heard_ms = ms->ops->now_ms();
  snprintf(n->addr, sizeof n->addr, "%s", m->addr);
  nodelink_set_ops(l, &coord_ctl_ops, n);
  nodelink_hello_done(l);
  struct nodemsg reply = {.op = NODEMSG_HELLO,
                          .reply = true,
                          .node = n->node,
                          .node_id = srv->node_id};
  hello_listener_proof(job, l, PEERAUTH_CONTROL, m, &reply);
  inbox_send(l, &reply);
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
  struct mesh_node *n = mesh_node_make(ms, m->node);
  if (n == NULL)
    return refuse_link(l, SP_ENOMEM, "out of memory");
  if (n->node_id != 0 && n->node_id != m->node_id)
    return refuse_link(l, SP_EINVAL, "node %u of job %s is another daemon",
                       m->node, job->hex);
  /* A node dials as many streams as its peer_streams, which takes a
   * restart, and a restarted daemon is another node: a count that changes
   * is no daemon of this protocol. */
  if (n->nstreams != 0 && n->nstreams != m->streams)
    return refuse_link(l, SP_EINVAL, "node %u of job %s dials %u data "
                       "streams, not %u", m->node, job->hex, m->streams,
                       n->nstreams);
  /* A stream dialled for an export that is over without publishing would
   * be used by none (datalink.c). */
  if (m->export_id <= n->failed_export)
    return refuse_link(l, SP_ESTATE, "node %u of job %s dialled a data "
                       "stream for export %" PRIu64 ", which did not publish",
                       m->node, job->hex, m->export_id);
  n->node_id = m->node_id;
  n->nstreams = m->streams;
  struct mesh_stream *st = &n->streams[m->stream];
  nodelink_close(st->dlink);
  st->dlink = l;
  st->dlink_session = m->export_id;
  nodelink_hello_done(l);
  struct nodemsg reply = {.op = NODEMSG_DATA, .reply = true};
  hello_listener_proof(job, l, PEERAUTH_DATA, m, &reply);
  inbox_send(l, &reply);
  nodelink_detach(l, datalink_accepted, st);
}

void hello_accepted(struct server *srv, struct nodelink *l) {
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
  inbox_send(l, &c);
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
  struct peerauth_stream st;
  const struct peerauth_stream *bound = hello_stream(kind, m, &st);
  for (struct job *j = srv->mesh_ops->find(srv, NULL, m->job); j != NULL;
       j = srv->mesh_ops->find(srv, j, m->job)) {
    if (j->dying || j->mesh == NULL || j->mesh->broken)
      continue;
    tried = true;
    peerauth_proof(j->secret, PEERAUTH_DIALER, kind, m->job,
                   nodelink_handshake(l), m->nonce, bound, want);
    if (peerauth_equal(want, m->proof))
      found = j;
  }
  if (!tried) {
    peerauth_proof(no_secret, PEERAUTH_DIALER, kind, m->job,
                   nodelink_handshake(l), m->nonce, bound, want);
    (void)peerauth_equal(want, m->proof);
  }
  return found;
}

void hello_first_frame(struct server *srv, struct nodelink *l,
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
