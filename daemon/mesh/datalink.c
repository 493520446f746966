/*
 * datalink.c - the data links between the nodes of a job, one per pair
 * (the higher node dials the lower), each of peer_streams connections (the
 * dialling node's setting, which it names in every handshake), each a link
 * only for its handshake and then a bare socket for the exchanges
 * (remote.c); kept for the job's next exports while they stay alive.
 * Every stream is proven with the job's secret on its own, as a control
 * link is (hello.c).
 */
#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "daemon/mesh/internal.h"
#include "shardport.h"

_Static_assert(CONFIG_MAX_PEER_STREAMS == REMOTE_STREAMS_MAX,
               "peer_streams is bounded by the streams an exchange serves");
_Static_assert(REMOTE_STREAMS_MAX <= UINT8_MAX,
               "a data link's proof holds a stream's index and count in a "
               "byte each (peerauth.c)");

/* A socket kept between exports may have died quietly: one that reads as
 * closed, failed, or holding bytes nobody sent it in an export, goes. */
static bool data_alive(int sock) {
  char byte;
  ssize_t n = recv(sock, &byte, 1, MSG_PEEK | MSG_DONTWAIT);
  return n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK);
}

/* The connection's own end, "addr:port", for the log: which socket of the
 * daemon's (ss, /proc/net/tcp) carries which stream. */
static void own_end(int sock, char *buf, size_t len) {
  struct sockaddr_storage sa;
  socklen_t salen = sizeof sa;
  if (getsockname(sock, (struct sockaddr *)&sa, &salen) != 0)
    snprintf(buf, len, "?");
  else
    netaddr_format((const struct sockaddr *)&sa, buf, len);
}

static void on_data_detached(void *arg, int sock) {
  struct mesh_stream *st = arg;
  struct mesh_node *n = st->node;
  st->dlink = NULL;
  if (sock < 0) {
    datalink_fail(n, "the handshake did not finish");
    return;
  }
  if (st->data >= 0)
    close(st->data);
  st->data = sock;
  st->session = st->dlink_session;
  char end[NODE_ADDR_MAX];
  own_end(sock, end, sizeof end);
  log_with(LOG_LEVEL_DEBUG, LOG_JOB(n->mesh->job->hex),
           "job %s: data link to node %u (%s) up (stream %u of %u, from %s)",
           n->mesh->job->hex, n->node, n->addr, st->index + 1, n->nstreams,
           end);
  member_send_planned(n->mesh);
}

/* The handshake of a data link this node dialled: the listener's
 * challenge, answered with peer_data, then its reply and proof; the bare
 * socket is the exchanges' once that proof holds. */
static void on_data_frame(struct nodelink *l, void *arg,
                          const struct sp_msg_head *head,
                          const msgpack_object *map) {
  struct mesh_stream *st = arg;
  struct mesh_node *n = st->node;
  struct mesh *ms = n->mesh;
  struct nodemsg m;
  char why[256];
  const char *bad = NULL;
  if (nodemsg_parse(head, map, &m, why, sizeof why) != 0)
    bad = why;
  else if (m.op == NODEMSG_ERROR)
    bad = m.message;
  else if (!st->hello_sent && m.op == NODEMSG_CHALLENGE &&
           m.version != NODE_PROTOCOL_VERSION)
    bad = "protocol version mismatch";
  else if (!st->hello_sent && m.op == NODEMSG_CHALLENGE) {
    struct nodemsg h = {.op = NODEMSG_DATA,
                        .node = ms->self,
                        .node_id = ms->srv->node_id,
                        .stream = st->index,
                        .streams = n->nstreams,
                        .export_id = st->dlink_session};
    if (peerauth_nonce(h.nonce) != 0) {
      bad = "no random nonce";
    } else {
      hello_answer_challenge(l, ms->job, PEERAUTH_DATA, m.nonce, &h);
      inbox_send(l, &h);
      st->hello_sent = true;
      return;
    }
  } else if (!st->hello_sent || m.op != NODEMSG_DATA || !m.reply)
    bad = "a bad handshake";
  else if (!peerauth_equal(m.proof, nodelink_handshake(l)))
    bad = "it did not prove it knows the job's secret";
  if (bad != NULL) {
    char what[SP_ERRMSG_MAX / 2];
    snprintf(what, sizeof what, "%.500s", bad);
    nodemsg_free(&m);
    nodelink_close(l);
    st->dlink = NULL;
    datalink_fail(n, what);
    return;
  }
  nodelink_hello_done(l);
  nodelink_detach(l, on_data_detached, st);
}

static void on_data_closed(struct nodelink *l, void *arg, int code) {
  (void)l;
  struct mesh_stream *st = arg;
  st->dlink = NULL;
  datalink_fail(st->node, sp_strerror(code));
}

static const struct nodelink_ops data_ops = {
    .frame = on_data_frame,
    .closed = on_data_closed,
};

/* Whether a socket of this session may carry the next export's bytes: no
 * export since it was dialled ended without publishing. */
static bool session_fresh(const struct mesh_node *n, uint64_t session) {
  return session > n->failed_export;
}

/* Before an export: a newer socket accepted while the last one moved
 * takes the old one's place, and one of a stale session, or that died
 * quietly, goes; so does a dial of a stale session still in its
 * handshake. */
static void stream_refresh(struct mesh_stream *st) {
  const struct mesh_node *n = st->node;
  if (st->data_next >= 0) {
    if (st->data >= 0)
      close(st->data);
    st->data = st->data_next;
    st->session = st->session_next;
    st->data_next = -1;
  }
  if (st->data >= 0 &&
      (!session_fresh(n, st->session) || !data_alive(st->data))) {
    close(st->data);
    st->data = -1;
  }
  if (st->dlink != NULL && !session_fresh(n, st->dlink_session)) {
    nodelink_close(st->dlink);
    st->dlink = NULL;
  }
}

/* The data links the export needs: dialled to lower nodes (each stream
 * that is not up), awaited from higher ones. */
int datalink_ensure(struct mesh *ms, const struct mesh_export *mx) {
  for (size_t i = 0; i < mx->nnodes; i++) {
    struct mesh_node *n = mesh_node_get(ms, mx->nodes[i].node);
    if (n == NULL || n->node == ms->self)
      continue;
    for (uint32_t s = 0; s < REMOTE_STREAMS_MAX; s++)
      stream_refresh(&n->streams[s]);
    if (n->node > ms->self)
      continue;
    /* peer_streams takes a restart (reload.c): the count never changes
     * under a link. */
    n->nstreams = ms->srv->cfg->peer_streams;
    for (uint32_t s = 0; s < n->nstreams; s++) {
      struct mesh_stream *st = &n->streams[s];
      if (st->data >= 0 || st->dlink != NULL)
        continue;
      st->hello_sent = false;
      st->dlink_session = mx->export_id;
      int rc = nodelink_connect(ms->srv, n->addr, &data_ops, st, &st->dlink);
      if (rc != 0) {
        st->dlink = NULL;
        return (int)n->node + 1;
      }
    }
  }
  return 0;
}

bool datalink_ready(const struct mesh *ms, const struct mesh_export *mx) {
  for (size_t i = 0; i < mx->nnodes; i++) {
    const struct mesh_node *n = ms->nodes[mx->nodes[i].node];
    if (n->node == ms->self)
      continue;
    if (n->nstreams == 0)
      return false;
    for (uint32_t s = 0; s < n->nstreams; s++)
      if (n->streams[s].data < 0 || !session_fresh(n, n->streams[s].session))
        return false;
  }
  return true;
}

bool datalink_up(const struct mesh_node *n) {
  for (uint32_t s = 0; s < n->nstreams; s++)
    if (n->streams[s].data >= 0)
      return true;
  return false;
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
  struct mesh_stream *st = arg;
  struct mesh_node *n = st->node;
  st->dlink = NULL;
  if (sock < 0)
    return; /* the dialling node tries again, or its export fails */
  struct mesh_export *cur = n->mesh->current;
  if (cur != NULL && cur->moving && st->data >= 0) {
    /* The engine may be using the old one: swap at the next export. */
    if (st->data_next >= 0)
      close(st->data_next);
    st->data_next = sock;
    st->session_next = st->dlink_session;
    return;
  }
  if (st->data >= 0)
    close(st->data);
  st->data = sock;
  st->session = st->dlink_session;
  char end[NODE_ADDR_MAX];
  own_end(sock, end, sizeof end);
  log_with(LOG_LEVEL_DEBUG, LOG_JOB(n->mesh->job->hex),
           "job %s: data link from node %u (%s) up (stream %u of %u, at %s)",
           n->mesh->job->hex, n->node, n->addr, st->index + 1, n->nstreams,
           end);
  member_send_planned(n->mesh);
}
