/*
 * datalink.c - the data links between the nodes of a job, one per pair
 * (the higher node dials the lower), each a link only for its handshake
 * and then a bare socket for the exchanges (remote.c); kept for the job's
 * next exports while they stay alive.
 */
#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "daemon/mesh/internal.h"
#include "shardport.h"

/* A socket kept between exports may have died quietly: one that reads as
 * closed, failed, or holding bytes nobody sent it in an export, goes. */
static bool data_alive(int sock) {
  char byte;
  ssize_t n = recv(sock, &byte, 1, MSG_PEEK | MSG_DONTWAIT);
  return n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK);
}

static void on_data_detached(void *arg, int sock) {
  struct mesh_node *n = arg;
  n->dlink = NULL;
  if (sock < 0) {
    datalink_fail(n, "the handshake did not finish");
    return;
  }
  if (n->data >= 0)
    close(n->data);
  n->data = sock;
  log_with(LOG_LEVEL_DEBUG, LOG_JOB(n->mesh->job->hex),
           "job %s: data link to node %u (%s) up", n->mesh->job->hex, n->node,
           n->addr);
  member_send_planned(n->mesh);
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
    struct nodemsg h = {
        .op = NODEMSG_DATA, .node = ms->self, .node_id = ms->srv->node_id};
    if (peerauth_nonce(h.nonce) != 0) {
      bad = "no random nonce";
    } else {
      hello_answer_challenge(l, ms->job, PEERAUTH_DATA, m.nonce, &h);
      inbox_send(l, &h);
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
    datalink_fail(n, what);
    return;
  }
  nodelink_hello_done(l);
  nodelink_detach(l, on_data_detached, n);
}

static void on_data_closed(struct nodelink *l, void *arg, int code) {
  (void)l;
  struct mesh_node *n = arg;
  n->dlink = NULL;
  datalink_fail(n, sp_strerror(code));
}

static const struct nodelink_ops data_ops = {
    .frame = on_data_frame,
    .closed = on_data_closed,
};

/* The data links the export needs: dialled to lower nodes, awaited from
 * higher ones. */
int datalink_ensure(struct mesh *ms, const struct mesh_export *mx) {
  for (size_t i = 0; i < mx->nnodes; i++) {
    struct mesh_node *n = mesh_node_get(ms, mx->nodes[i].node);
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

bool datalink_ready(const struct mesh *ms, const struct mesh_export *mx) {
  for (size_t i = 0; i < mx->nnodes; i++) {
    const struct mesh_node *n = ms->nodes[mx->nodes[i].node];
    if (n->node != ms->self && n->data < 0)
      return false;
  }
  return true;
}

void datalink_fail(struct mesh_node *n, const char *why) {
  struct mesh *ms = n->mesh;
  log_with(LOG_LEVEL_INFO, LOG_JOB(ms->job->hex),
           "job %s: data link to node %u (%s): %s", ms->job->hex, n->node,
           n->addr, why);
  if (ms->current == NULL || !gathered_in_roster(ms->current, n->node))
    return;
  char msg[SP_ERRMSG_MAX + 1];
  mesh_lost_message(ms->job->hex, n->node, n->addr, ms->current->export_id, msg,
                    sizeof msg);
  member_fail(ms, SP_ENODELOST, msg);
}

void datalink_accepted(void *arg, int sock) {
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
  member_send_planned(n->mesh);
}
