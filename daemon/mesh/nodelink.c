/*
 * nodelink.c - connections between daemons: the peer listener, and one
 * framed connection over TCP per link; see nodelink.h.
 *
 * A link carries the same frames as a client connection (a 4-byte length,
 * one msgpack map) and runs on the same framed socket (framesock.c), so
 * that nothing here blocks the loop; a frame it relays to several links
 * shares its payload with them (struct sp_frame_tx).  Two kinds exist:
 * a control link from a daemon to its job's root, which stays a link, and
 * a data link between two daemons of a job, which is a link only for its
 * handshake and is then handed over as a bare socket to the job's
 * exchanges (remote.c), which run on the engine thread.
 *
 * Another daemon is a peer, not a trusted party: every frame is bounded by
 * the link's limits before anything is allocated for it and decoded with
 * the bounded decoder, and a link must prove who it is (mesh.c checks its
 * proof of the job's secret, peerauth.c) within peer_timeout.  Until then
 * its frames hold at most NODELINK_HANDSHAKE_MAX_FRAME bytes, and accepted
 * links in that state are capped (peer_handshakes): whoever can reach the
 * port costs the daemon a bounded number of descriptors and bytes.  Frames
 * a link was told to expect as blobs (the registrations the root relays)
 * are kept as bytes and decoded later, off the loop, on a planning
 * thread.
 *
 * Liveness: TCP keepalive probes an idle link and TCP_USER_TIMEOUT bounds
 * how long unacknowledged data may wait, so that a dead host or a cut link
 * ends the connection even when the daemons have nothing to say; during an
 * export the job's beats and timeouts (mesh.c) notice sooner.
 */
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include "daemon/framesock.h"
#include "daemon/mesh/internal.h"
#include "daemon/mesh/peerhost.h"
#include "proto/wire.h"
#include "shardport.h"

/* The largest frame a link may send before it proved who it is: every
 * handshake frame is a few hundred bytes, and an error reply at most
 * SP_ERRMSG_MAX and its names.  As a client before hello (conn.c). */
#define NODELINK_HANDSHAKE_MAX_FRAME 4096u
/* A link that cannot be written to for that long after a close was asked
 * for is dropped. */
#define NODELINK_DRAIN_MS 5000
/* Frames served per wakeup, as for clients (conn.c). */
#define NODELINK_FRAMES_PER_WAKEUP 32

/* Keepalive: probe after 5 s idle, every 2 s, give up after 3 misses. */
#define NODELINK_KEEPIDLE_S 5
#define NODELINK_KEEPINTVL_S 2
#define NODELINK_KEEPCNT 3
#define NODELINK_USER_TIMEOUT_MS 15000

struct nodelink {
  struct server *srv;
  struct nodelink *prev, *next;
  uint64_t id;
  /* The socket, its poll, the frames in and out (framesock.h). */
  struct framesock fs;
  uv_timer_t timer;
  int open_handles;
  bool connecting;
  bool closed;
  /* Reading has stopped; the link closes (or is handed over) once its
   * queue is written. */
  bool draining;
  /* A hand-over that cannot finish gives the owner -1 instead. */
  bool failed;
  /* Accepted by the peer listener (else dialled by this daemon), from
   * host, and whether the peer has proved who it is (nodelink_hello_done). */
  bool accepted;
  struct peer_host host;
  bool identified;
  /* The owner waits for an answer (nodelink_await). */
  bool awaiting;
  /* What the owner's handshake keeps with the link (mesh.c): the nonce a
   * listener sent, or the proof a dialer expects back. */
  uint8_t handshake[PEERAUTH_NONCE_BYTES];
  void (*detach_fn)(void *arg, int sock);
  void *detach_arg;
  uint32_t expect_blobs;
  struct metrics_bytes *counts[NODELINK_COUNTERS];
  const struct nodelink_ops *ops;
  void *arg;
  char peer[NODE_ADDR_MAX];
};

/* Frames that are not blobs are control messages: small. */
static void control_limits(struct sp_limits *l) {
  sp__limits_default(l);
  l->max_fds = 0;
}

/* Keepalive and a bound on unacknowledged data, so that a dead peer ends
 * the connection; TCP_NODELAY for the small control messages.  Failures
 * are only logged: the export's own timeouts still apply. */
void nodelink_tune(int sock) {
  int on = 1, idle = NODELINK_KEEPIDLE_S, intvl = NODELINK_KEEPINTVL_S,
      cnt = NODELINK_KEEPCNT;
  unsigned timeout = NODELINK_USER_TIMEOUT_MS;
  if (setsockopt(sock, SOL_SOCKET, SO_KEEPALIVE, &on, sizeof on) != 0 ||
      setsockopt(sock, IPPROTO_TCP, TCP_KEEPIDLE, &idle, sizeof idle) != 0 ||
      setsockopt(sock, IPPROTO_TCP, TCP_KEEPINTVL, &intvl, sizeof intvl) !=
          0 ||
      setsockopt(sock, IPPROTO_TCP, TCP_KEEPCNT, &cnt, sizeof cnt) != 0 ||
      setsockopt(sock, IPPROTO_TCP, TCP_USER_TIMEOUT, &timeout,
                 sizeof timeout) != 0 ||
      setsockopt(sock, IPPROTO_TCP, TCP_NODELAY, &on, sizeof on) != 0)
    log_msg(LOG_LEVEL_WARN, "peer socket options: %s", strerror(errno));
}

/* ---- links ---- */

static void on_poll(uv_poll_t *handle, int status, int events);

const char *nodelink_peer(const struct nodelink *l) { return l->peer; }

/* The handshake scratch holds a nonce or a proof, whichever the side
 * needs. */
_Static_assert(PEERAUTH_NONCE_BYTES == PEERAUTH_PROOF_BYTES,
               "a link's handshake bytes hold a nonce or a proof");

uint8_t *nodelink_handshake(struct nodelink *l) { return l->handshake; }

void nodelink_set_ops(struct nodelink *l, const struct nodelink_ops *ops,
                      void *arg) {
  l->ops = ops;
  l->arg = arg;
}

void nodelink_expect_blobs(struct nodelink *l, uint32_t n) {
  l->expect_blobs = n;
}

static void on_handle_closed(uv_handle_t *handle) {
  struct nodelink *l = handle->data;
  if (--l->open_handles > 0)
    return;
  if (l->detach_fn != NULL && !l->failed) {
    l->detach_fn(l->detach_arg, l->fs.sock);
  } else {
    close(l->fs.sock);
    if (l->detach_fn != NULL)
      l->detach_fn(l->detach_arg, -1);
  }
  framesock_release(&l->fs);
  free(l);
}

/* Takes the link off the server's list and closes its handles; the socket
 * is closed (or handed over) once libuv has let go of it. */
static void link_end(struct nodelink *l) {
  if (l->closed)
    return;
  l->closed = true;
  if (l->accepted && !l->identified)
    l->srv->peer_unidentified--;
  if (l->prev != NULL)
    l->prev->next = l->next;
  else
    l->srv->links = l->next;
  if (l->next != NULL)
    l->next->prev = l->prev;
  framesock_close(&l->fs, on_handle_closed);
  uv_close((uv_handle_t *)&l->timer, on_handle_closed);
}

void nodelink_close(struct nodelink *l) {
  if (l == NULL)
    return;
  /* A hand-over not yet done is cancelled too: the socket is closed. */
  l->detach_fn = NULL;
  l->ops = NULL;
  if (l->closed)
    return;
  log_msg(LOG_LEVEL_DEBUG, "peer %s: link closed", l->peer);
  link_end(l);
}

/* An error ends the link and tells its owner, once. */
static void link_fail(struct nodelink *l, int code) {
  if (l->closed)
    return;
  const struct nodelink_ops *ops = l->ops;
  void *arg = l->arg;
  l->failed = true;
  link_end(l);
  if (ops != NULL && ops->closed != NULL)
    ops->closed(l, arg, code);
}

static void on_timeout(uv_timer_t *timer) {
  struct nodelink *l = timer->data;
  log_msg(LOG_LEVEL_INFO, "peer %s: %s", l->peer,
          l->draining     ? "did not take its last frames in time"
          : l->connecting ? "connect timed out"
          : l->awaiting   ? "did not answer in time"
          : l->accepted   ? "did not say who it is in time"
                          : "did not finish the handshake in time");
  link_fail(l, SP_ETIMEOUT);
}

static int update_events(struct nodelink *l) {
  int rc = framesock_want(&l->fs, on_poll, !l->draining, l->connecting);
  if (rc != 0) {
    log_msg(LOG_LEVEL_ERROR, "peer %s: uv_poll: %s", l->peer, uv_strerror(rc));
    link_fail(l, SP_EIO);
    return -1;
  }
  return 0;
}

/* Writes what the socket takes.  -1 when the link ended. */
static int flush(struct nodelink *l) {
  int rc = framesock_flush(&l->fs);
  if (rc < 0) {
    log_msg(LOG_LEVEL_DEBUG, "peer %s: write: %s", l->peer, sp_strerror(rc));
    link_fail(l, rc);
    return -1;
  }
  if (l->draining && l->fs.out_head == NULL) {
    link_end(l);
    return -1;
  }
  return update_events(l);
}

void nodelink_count_into(
    struct nodelink *l, struct metrics_bytes *const counts[NODELINK_COUNTERS]) {
  memcpy(l->counts, counts, sizeof l->counts);
}

static void count(struct nodelink *l, bool sent, size_t bytes) {
  for (int i = 0; i < NODELINK_COUNTERS; i++)
    if (l->counts[i] != NULL)
      atomic_fetch_add_explicit(sent ? &l->counts[i]->sent
                                     : &l->counts[i]->received,
                                bytes, memory_order_relaxed);
}

static int queue(struct nodelink *l, struct sp_frame_tx *tx) {
  if (l->closed || l->draining) {
    sp__frame_tx_free(tx);
    return SP_ECLOSED;
  }
  /* A frame queued is a frame sent, unless the link fails first. */
  count(l, true, tx->len + tx->shared_len);
  framesock_queue(&l->fs, tx);
  return update_events(l) == 0 ? 0 : SP_ECLOSED;
}

static void release_blob(void *arg) { nodeblob_unref(arg); }

int nodelink_send_blob(struct nodelink *l, struct nodeblob *b) {
  /* The header is the link's own; the payload is shared with every link
   * that sends the blob. */
  struct sp_frame_tx *tx = calloc(1, sizeof *tx);
  uint8_t *hdr = malloc(sizeof b->hdr);
  if (tx == NULL || hdr == NULL) {
    free(tx);
    free(hdr);
    return SP_ENOMEM;
  }
  memcpy(hdr, b->hdr, sizeof b->hdr);
  tx->buf = hdr;
  tx->len = sizeof b->hdr;
  tx->shared = b->payload;
  tx->shared_len = b->len;
  tx->release = release_blob;
  tx->release_arg = nodeblob_ref(b);
  return queue(l, tx);
}

int nodelink_send(struct nodelink *l, struct sp_msgbuf *mb) {
  struct sp_frame_tx *tx = calloc(1, sizeof *tx);
  if (tx == NULL) {
    sp__msgbuf_discard(mb);
    return SP_ENOMEM;
  }
  int rc = sp__msgbuf_finish(mb, tx);
  if (rc != 0) {
    free(tx);
    return rc;
  }
  return queue(l, tx);
}

int nodelink_send_error(struct nodelink *l, int code, const char *message) {
  struct sp_frame_tx *tx = calloc(1, sizeof *tx);
  if (tx == NULL)
    return SP_ENOMEM;
  int rc = sp__msg_error(tx, 0, code, "%s", message);
  if (rc != 0) {
    free(tx);
    return rc;
  }
  return queue(l, tx);
}

/* Stops reading and ends the link once its queue is written. */
static void drain(struct nodelink *l) {
  if (l->draining || l->closed)
    return;
  l->draining = true;
  l->ops = NULL;
  /* Nothing is sent or read from here, and the owner of the counters may
   * be gone before the queue is written. */
  memset(l->counts, 0, sizeof l->counts);
  uv_timer_start(&l->timer, on_timeout, NODELINK_DRAIN_MS, 0);
  flush(l);
}

void nodelink_close_after_flush(struct nodelink *l) { drain(l); }

void nodelink_detach(struct nodelink *l, void (*fn)(void *arg, int sock),
                     void *arg) {
  l->detach_fn = fn;
  l->detach_arg = arg;
  drain(l);
}

void nodelink_hello_done(struct nodelink *l) {
  if (l->identified)
    return;
  uv_timer_stop(&l->timer);
  l->identified = true;
  if (l->accepted)
    l->srv->peer_unidentified--;
  /* Known now: the blobs it may relay can be as large as registrations. */
  l->fs.rx.limits.max_frame = NODE_MAX_FRAME;
}

void nodelink_await(struct nodelink *l, bool waiting) {
  if (l->closed || l->draining || !l->identified || waiting == l->awaiting)
    return;
  l->awaiting = waiting;
  if (waiting)
    uv_timer_start(&l->timer, on_timeout, l->srv->cfg->peer_timeout_ms, 0);
  else
    uv_timer_stop(&l->timer);
}

/* One complete frame: a blob the owner expects, or a control message
 * decoded here, once, with the control limits. */
static void dispatch(struct nodelink *l, struct sp_frame *frame) {
  count(l, false, SP_FRAME_HEADER + frame->len);
  if (l->expect_blobs > 0 && l->ops != NULL && l->ops->blob != NULL) {
    struct nodeblob *b = nodeblob_wrap(frame->data, frame->data, frame->len);
    if (b == NULL) {
      sp__frame_release(frame);
      link_fail(l, SP_ENOMEM);
      return;
    }
    frame->data = NULL;
    l->expect_blobs--;
    l->ops->blob(l, l->arg, b);
    return;
  }
  struct sp_limits limits;
  control_limits(&limits);
  msgpack_zone zone;
  if (frame->len > limits.max_frame ||
      !msgpack_zone_init(&zone, MSGPACK_ZONE_CHUNK_SIZE)) {
    sp__frame_release(frame);
    link_fail(l, frame->len > limits.max_frame ? SP_EFRAMETOOBIG : SP_ENOMEM);
    return;
  }
  msgpack_object map;
  struct sp_msg_head head;
  int rc = sp__wire_decode(frame->data, frame->len, &limits, &zone, &map);
  if (rc == 0)
    rc = sp__msg_head(&map, &head);
  if (rc != 0) {
    log_msg(LOG_LEVEL_INFO, "peer %s: bad frame: %s; closing", l->peer,
            sp_err_name(rc));
    nodelink_send_error(l, rc, sp_strerror(rc));
    drain(l);
  } else if (l->ops != NULL && l->ops->frame != NULL) {
    l->ops->frame(l, l->arg, &head, &map);
  } else {
    /* The first frame of an accepted link says who it is. */
    hello_first_frame(l->srv, l, &head, &map);
  }
  msgpack_zone_destroy(&zone);
  sp__frame_release(frame);
}

static int read_frames(struct nodelink *l) {
  for (int i = 0; i < NODELINK_FRAMES_PER_WAKEUP; i++) {
    struct sp_frame frame = {.data = NULL};
    int rc = framesock_read(&l->fs, &frame);
    if (rc == 0)
      return 0;
    if (rc < 0) {
      log_msg(LOG_LEVEL_DEBUG, "peer %s: read: %s", l->peer, sp_strerror(rc));
      link_fail(l, rc);
      return -1;
    }
    dispatch(l, &frame);
    if (l->closed)
      return -1;
    if (l->draining)
      return 0;
  }
  return 0;
}

static void finish_connect(struct nodelink *l) {
  int err = 0;
  socklen_t len = sizeof err;
  if (getsockopt(l->fs.sock, SOL_SOCKET, SO_ERROR, &err, &len) != 0)
    err = errno;
  if (err != 0) {
    log_msg(LOG_LEVEL_INFO, "peer %s: connect: %s", l->peer, strerror(err));
    link_fail(l, SP_ECLOSED);
    return;
  }
  /* The timer runs on: the handshake must finish within peer_timeout of
   * the dial, however quickly the connect was taken. */
  l->connecting = false;
  nodelink_tune(l->fs.sock);
  update_events(l);
}

static void on_poll(uv_poll_t *handle, int status, int events) {
  struct nodelink *l = handle->data;
  if (status < 0) {
    log_msg(LOG_LEVEL_DEBUG, "peer %s: poll: %s", l->peer, uv_strerror(status));
    link_fail(l, SP_EIO);
    return;
  }
  if (l->connecting) {
    finish_connect(l);
    return;
  }
  if ((events & UV_READABLE) && !l->draining && read_frames(l) < 0)
    return;
  flush(l);
}

static struct nodelink *link_new(struct server *srv, int sock) {
  struct nodelink *l = calloc(1, sizeof *l);
  if (l == NULL)
    return NULL;
  l->srv = srv;
  l->id = ++srv->next_link_id;
  /* Until the peer has proved who it is, only handshake frames. */
  struct sp_limits limits;
  control_limits(&limits);
  limits.max_frame = NODELINK_HANDSHAKE_MAX_FRAME;
  if (framesock_init(&l->fs, srv->loop, sock, &limits, l) != 0) {
    free(l);
    return NULL;
  }
  uv_timer_init(srv->loop, &l->timer);
  l->timer.data = l;
  l->open_handles = 2;
  l->next = srv->links;
  if (srv->links != NULL)
    srv->links->prev = l;
  srv->links = l;
  return l;
}

int nodelink_connect(struct server *srv, const char *addr,
                     const struct nodelink_ops *ops, void *arg,
                     struct nodelink **out) {
  struct sockaddr_storage sa;
  socklen_t salen;
  if (netaddr_parse(addr, strlen(addr), false, &sa, &salen) != 0)
    return SP_EINVAL;
  int sock =
      socket(sa.ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (sock < 0)
    return SP_EIO;
  if (connect(sock, (struct sockaddr *)&sa, salen) != 0 &&
      errno != EINPROGRESS) {
    int err = errno;
    close(sock);
    log_msg(LOG_LEVEL_INFO, "peer %s: connect: %s", addr, strerror(err));
    return SP_ECLOSED;
  }
  struct nodelink *l = link_new(srv, sock);
  if (l == NULL) {
    close(sock);
    return SP_ENOMEM;
  }
  snprintf(l->peer, sizeof l->peer, "%s", addr);
  l->ops = ops;
  l->arg = arg;
  l->connecting = true;
  uv_timer_start(&l->timer, on_timeout, srv->cfg->peer_timeout_ms, 0);
  if (update_events(l) != 0)
    return SP_EIO;
  *out = l;
  return 0;
}

/* ---- the listener ---- */

static bool in_handshake(const struct nodelink *l) {
  return l->accepted && !l->identified;
}

/* The link to drop when links in their handshake are at the cap: the
 * oldest of the host that holds the most of them (ties: the oldest of
 * those hosts' oldest; peerhost.c says what a host is), so that one host
 * flooding the port loses its own links first, and another daemon's
 * handshake, which takes one round trip, is not cut short. */
static struct nodelink *eviction_victim(struct server *srv) {
  size_t n = 0;
  for (struct nodelink *l = srv->links; l != NULL; l = l->next)
    if (in_handshake(l) && n < srv->peer_handshake_cap)
      srv->peer_evict_scratch[n++] =
          (struct peerhost_entry){l->host, l->id, l};
  if (n == 0)
    return NULL;
  return srv->peer_evict_scratch[peerhost_victim(srv->peer_evict_scratch, n)]
      .link;
}

/* Links in their handshake are capped: at the cap one goes
 * (eviction_victim) before another is taken. */
static void make_room(struct server *srv) {
  while (srv->peer_unidentified >= srv->peer_handshake_cap) {
    struct nodelink *old = eviction_victim(srv);
    if (old == NULL)
      return;
    log_limited(&srv->peer_evict_log, LOG_LEVEL_WARN,
                "peer %s: dropped: %" PRIu32 " links from other daemons "
                "were still in their handshake (peer_handshakes)",
                old->peer, srv->peer_unidentified);
    link_fail(old, SP_EBUSY);
  }
}

static void on_accept(uv_poll_t *handle, int status, int events) {
  struct server *srv = handle->data;
  (void)events;
  if (status < 0)
    return;
  for (int i = 0; i < 64; i++) {
    struct sockaddr_storage sa;
    socklen_t salen = sizeof sa;
    int sock = accept4(srv->peer_fd, (struct sockaddr *)&sa, &salen,
                       SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (sock < 0) {
      if (errno == EINTR || errno == ECONNABORTED)
        continue;
      if (errno == EMFILE || errno == ENFILE) {
        /* Retrying at once would spin: the connection is dropped, as the
         * client listener does (server.c). */
        log_limited(&srv->peer_accept_log, LOG_LEVEL_WARN,
                    "peer accept: %s; dropping a connection",
                    strerror(errno));
        if (!server_shed(srv, srv->peer_fd))
          return;
        continue;
      }
      if (errno != EAGAIN && errno != EWOULDBLOCK)
        log_limited(&srv->peer_accept_log, LOG_LEVEL_WARN,
                    "peer accept: %s", strerror(errno));
      return;
    }
    make_room(srv);
    nodelink_tune(sock);
    struct nodelink *l = link_new(srv, sock);
    if (l == NULL) {
      close(sock);
      continue;
    }
    l->accepted = true;
    peerhost_of(&sa, &l->host);
    srv->peer_unidentified++;
    netaddr_format((struct sockaddr *)&sa, l->peer, sizeof l->peer);
    log_msg(LOG_LEVEL_DEBUG, "peer %s: connected", l->peer);
    uv_timer_start(&l->timer, on_timeout, srv->cfg->peer_timeout_ms, 0);
    if (update_events(l) == 0)
      hello_accepted(srv, l);
  }
}

/* Links in their handshake hold a descriptor each: a quarter of the
 * descriptor limit at most, so that the peer port alone cannot take the
 * descriptors local clients need. */
static uint32_t handshake_cap(const struct config *cfg) {
  struct rlimit rl;
  uint32_t cap = cfg->peer_handshakes;
  if (getrlimit(RLIMIT_NOFILE, &rl) != 0 || rl.rlim_cur == RLIM_INFINITY ||
      rl.rlim_cur / 4 >= cap)
    return cap;
  uint32_t quarter = rl.rlim_cur >= 8 ? (uint32_t)(rl.rlim_cur / 4) : 1;
  log_msg(LOG_LEVEL_INFO, "peer_handshakes %" PRIu32 " is more than a "
          "quarter of the descriptor limit (%llu): at most %" PRIu32
          " links in their handshake", cap, (unsigned long long)rl.rlim_cur,
          quarter);
  return quarter;
}

int nodelink_listen_open(struct server *srv) {
  const struct config *cfg = srv->cfg;
  srv->peer_fd = -1;
  if (!cfg->peer_listen_set)
    return 0;
  int sock = socket(cfg->peer_listen_addr.ss_family,
                    SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  int on = 1;
  if (sock < 0 ||
      setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &on, sizeof on) != 0 ||
      bind(sock, (const struct sockaddr *)&cfg->peer_listen_addr,
           cfg->peer_listen_len) != 0 ||
      listen(sock, 128) != 0) {
    log_msg(LOG_LEVEL_ERROR, "peer_listen %s: %s", cfg->peer_listen,
            strerror(errno));
    if (sock >= 0)
      close(sock);
    return -1;
  }
  struct sockaddr_storage bound;
  socklen_t blen = sizeof bound;
  getsockname(sock, (struct sockaddr *)&bound, &blen);
  char where[NODE_ADDR_MAX];
  netaddr_format((struct sockaddr *)&bound, where, sizeof where);
  /* What other daemons dial: peer_advertise, or the listen address; a port
   * of 0 in either means the port the kernel gave. */
  struct sockaddr_storage adv =
      cfg->peer_advertise_set ? cfg->peer_advertise_addr : bound;
  uint16_t port = bound.ss_family == AF_INET
                      ? ((struct sockaddr_in *)&bound)->sin_port
                      : ((struct sockaddr_in6 *)&bound)->sin6_port;
  if (adv.ss_family == AF_INET && ((struct sockaddr_in *)&adv)->sin_port == 0)
    ((struct sockaddr_in *)&adv)->sin_port = port;
  if (adv.ss_family == AF_INET6 &&
      ((struct sockaddr_in6 *)&adv)->sin6_port == 0)
    ((struct sockaddr_in6 *)&adv)->sin6_port = port;
  netaddr_format((struct sockaddr *)&adv, srv->peer_address,
                       sizeof srv->peer_address);
  srv->peer_handshake_cap = handshake_cap(cfg);
  srv->peer_evict_scratch =
      calloc(srv->peer_handshake_cap, sizeof *srv->peer_evict_scratch);
  if (srv->peer_evict_scratch == NULL)
    log_msg(LOG_LEVEL_ERROR, "peer_listen %s: out of memory",
            cfg->peer_listen);
  if (srv->peer_evict_scratch == NULL ||
      uv_poll_init(srv->loop, &srv->peer_poll, sock) != 0) {
    free(srv->peer_evict_scratch);
    srv->peer_evict_scratch = NULL;
    close(sock);
    return -1;
  }
  srv->peer_fd = sock;
  srv->peer_poll.data = srv;
  uv_poll_start(&srv->peer_poll, UV_READABLE, on_accept);
  log_msg(LOG_LEVEL_INFO, "listening for peer daemons on %s (advertised as %s)",
          where, srv->peer_address);
  return 0;
}

static void on_listener_closed(uv_handle_t *handle) {
  struct server *srv = handle->data;
  close(srv->peer_fd);
  srv->peer_fd = -1;
  free(srv->peer_evict_scratch);
  srv->peer_evict_scratch = NULL;
}

void nodelink_listen_close(struct server *srv) {
  if (srv->peer_fd < 0 || uv_is_closing((uv_handle_t *)&srv->peer_poll))
    return;
  uv_close((uv_handle_t *)&srv->peer_poll, on_listener_closed);
}

void nodelink_shutdown(struct server *srv) {
  /* Links a job owns close with the job (mesh_free); these are the ones
   * nobody owns: still saying hello, or refused and draining. */
  struct nodelink *next;
  for (struct nodelink *l = srv->links; l != NULL; l = next) {
    next = l->next;
    if (l->ops == NULL && l->detach_fn == NULL)
      nodelink_close(l);
  }
}
