/*
 * client.c - the connection to shardportd: connect, hello, one request at a
 * time, ping, close.
 *
 * The socket is blocking.  Each request has one deadline, taken from the
 * client's timeout when it starts; before every blocking call the socket's
 * SO_SNDTIMEO or SO_RCVTIMEO is set to what is left of it, so a daemon that
 * stops answering costs at most the timeout and never a hang.
 */
#include <errno.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "build_config.h"
#include "client/client.h"
#include "proto/monotonic.h"
#include "proto/wire.h"

/* How long a request whose write failed keeps reading: the daemon may have
 * answered with an error reply and closed before our frame went out, and
 * that reply says more than "closed". */
#define CLIENT_GRACE_MS 100

/* The one clock (proto/monotonic.h), signed for deadline arithmetic. */
static int64_t now_ms(void) { return (int64_t)monotonic_ms(); }

/* INT64_MAX stands for "no deadline". */
static int64_t deadline_after(uint32_t ms) {
  return ms == 0 ? INT64_MAX : now_ms() + ms;
}

/* Sets the socket's timeout for the next blocking call to what is left
 * before deadline.  Returns SP_ETIMEOUT when nothing is left. */
static int arm_timeout(int sock, int optname, int64_t deadline) {
  struct timeval tv = {0, 0};
  if (deadline != INT64_MAX) {
    int64_t left = deadline - now_ms();
    if (left <= 0)
      return SP_ETIMEOUT;
    tv.tv_sec = (time_t)(left / 1000);
    tv.tv_usec = (suseconds_t)(left % 1000) * 1000;
  }
  if (setsockopt(sock, SOL_SOCKET, optname, &tv, sizeof tv) != 0)
    return SP_EIO;
  return 0;
}

static int connect_error(int err) {
  switch (err) {
  case ENOENT:
  case ECONNREFUSED:
  case ENOTDIR:
    return SP_ENODAEMON;
  case EACCES:
  case EPERM:
    return SP_EPERM;
  case EAGAIN:
  case ETIMEDOUT:
    return SP_ETIMEOUT;
  case ENOMEM:
  case ENOBUFS:
    return SP_ENOMEM;
  default:
    return SP_EIO;
  }
}

/* A connected, close-on-exec, blocking Unix stream socket, or a code (and
 * the errno behind it in *err). */
static int open_socket(const char *path, int64_t deadline, int *err) {
  struct sockaddr_un sa = {.sun_family = AF_UNIX};
  size_t len = strlen(path);
  if (len == 0 || len >= sizeof sa.sun_path)
    return SP_EINVAL;
  memcpy(sa.sun_path, path, len + 1);

  int sock = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (sock < 0) {
    *err = errno;
    return connect_error(errno);
  }
  /* A Unix-socket connect waits on a full listen backlog for as long as
   * SO_SNDTIMEO allows. */
  int rc = arm_timeout(sock, SO_SNDTIMEO, deadline);
  if (rc == 0) {
    while (connect(sock, (struct sockaddr *)&sa, sizeof sa) != 0) {
      if (errno != EINTR) {
        *err = errno;
        rc = connect_error(errno);
        break;
      }
    }
  }
  if (rc < 0) {
    close(sock);
    return rc;
  }
  return sock;
}

uint64_t client_begin(sp_client *c, struct sp_msgbuf *mb, const char *op,
                      uint32_t nfields) {
  uint64_t id = c->next_id++;
  /* Id 0 is the daemon's "whatever you sent last"; never use it. */
  if (c->next_id == 0)
    c->next_id = 1;
  sp__msgbuf_begin(mb, op, id, nfields);
  return id;
}

void client_reply_release(struct client_reply *reply) {
  msgpack_zone_destroy(&reply->zone);
  sp__frame_release(&reply->frame);
}

/* Sends the request in mb with nfds descriptors attached to its first byte
 * (the caller keeps them).  A request the daemon would refuse by closing the
 * connection (over its frame or descriptor limit) fails here instead, with
 * the client still usable. */
static int send_request(sp_client *c, struct sp_msgbuf *mb, const int *fds,
                        size_t nfds, int64_t deadline) {
  if (nfds > c->rx.limits.max_fds) {
    sp__msgbuf_discard(mb);
    return SP_ETOOMANYFDS;
  }
  struct sp_frame_tx tx;
  int rc = sp__msgbuf_finish(mb, &tx);
  if (rc < 0)
    return rc;
  if (tx.len - SP_FRAME_HEADER > c->rx.limits.max_frame) {
    free(tx.buf);
    return SP_EFRAMETOOBIG;
  }
  /* tx only borrows the descriptors: it is never passed to
   * sp__frame_tx_free, which would close them. */
  tx.nfds = nfds;
  if (nfds > 0)
    memcpy(tx.fds, fds, nfds * sizeof *fds);
  for (;;) {
    rc = arm_timeout(c->sock, SO_SNDTIMEO, deadline);
    if (rc < 0)
      break;
    rc = sp__frame_tx_write(&tx, c->sock);
    /* 1 is a blocking socket whose SO_SNDTIMEO ran out; loop to check the
     * deadline, which ends the request once it has passed. */
    if (rc <= 0)
      break;
  }
  /* A frame written in part leaves the daemon mid-frame for good. */
  if (rc < 0 && tx.off > 0)
    c->broken = rc;
  free(tx.buf);
  return rc;
}

/* The error codes a daemon sends with id 0 just before it closes the
 * connection (docs/protocol.md, "Connections the daemon ends"). */
static bool ends_connection(int code) {
  return code == SP_EDAEMONRESTARTED || code == SP_EDAEMONSTOPPING ||
         code == SP_EABORTED;
}

/* The connection ended (rc: the transport's code).  For a rank of a job
 * that is the end of the job: the daemon stopped, restarted or died, and
 * whatever it said last (or this sentence) is what every later call
 * reports, rather than a bare "closed". */
static int connection_lost(sp_client *c, int rc) {
  if (c->joined && rc == SP_ECLOSED) {
    rc = SP_EDAEMONRESTARTED;
    snprintf(c->message, sizeof c->message,
             "the connection to shardportd ended without a reason while it "
             "was a rank of a job: the daemon stopped, restarted or died, "
             "and the job is gone; create a new job and register again");
  }
  if (!c->broken)
    c->broken = rc;
  return c->broken;
}

/* Decodes a frame into reply (taking the frame) and sets head.  Unless
 * keep_fds, descriptors that came with the frame are closed: only the
 * replies a caller reads with client_next may carry them, and a stray one
 * would otherwise leak into the caller's process. */
static int decode_reply(sp_client *c, struct sp_frame *frame, bool keep_fds,
                        struct client_reply *reply, struct sp_msg_head *head) {
  if (!keep_fds)
    sp__frame_close_fds(frame);
  reply->frame = *frame;
  if (!msgpack_zone_init(&reply->zone, 2048)) {
    sp__frame_release(&reply->frame);
    return SP_ENOMEM;
  }
  int rc = sp__wire_decode(reply->frame.data, reply->frame.len, &c->rx.limits,
                           &reply->zone, &reply->map);
  if (rc == 0)
    rc = sp__msg_head(&reply->map, head);
  if (rc < 0)
    client_reply_release(reply);
  return rc;
}

/* Reads frames until one that answers id and carries op (any op when op is
 * NULL; its envelope then in *head).  An error reply with id 0 answers too:
 * the daemon sends one when it refuses the connection before reading our
 * frame (permission_denied) or could not read the request's id.  *refused
 * tells whether the result is the code of an error reply. */
static int wait_reply(sp_client *c, uint64_t id, const char *op, bool keep_fds,
                      int64_t deadline, struct client_reply *reply,
                      struct sp_msg_head *head, bool *refused) {
  *refused = false;
  for (;;) {
    int rc = arm_timeout(c->sock, SO_RCVTIMEO, deadline);
    if (rc < 0)
      return rc;
    struct sp_frame frame = {0};
    rc = sp__frame_rx_read(&c->rx, c->sock, &frame);
    if (rc == 0)
      continue; /* SO_RCVTIMEO ran out or a signal came; check the deadline */
    if (rc < 0)
      return connection_lost(c, rc);

    rc = decode_reply(c, &frame, keep_fds, reply, head);
    if (rc < 0)
      return rc;
    bool is_error = strcmp(head->op, "error") == 0;
    if (head->id != id && !(is_error && head->id == 0)) {
      /* A late reply to a request that timed out. */
      client_reply_release(reply);
      continue;
    }
    if (is_error) {
      rc = sp__msg_error_code(&reply->map, c->message, sizeof c->message);
      client_reply_release(reply);
      *refused = rc < 0;
      /* The daemon's last word before it closes: every later call on this
       * client reports it too. */
      if (head->id == 0 && ends_connection(rc))
        c->broken = rc;
      return rc < 0 ? rc : SP_EBADMSG;
    }
    if (op && strcmp(head->op, op) != 0) {
      client_reply_release(reply);
      return SP_EBADMSG;
    }
    return 0;
  }
}

/* Sends a request.  When the connection turns out to be gone, reads for a
 * moment more and returns the daemon's reason when it sent one. */
static int start_request(sp_client *c, struct sp_msgbuf *mb, uint64_t id,
                         const int *fds, size_t nfds, int64_t deadline) {
  if (c->broken) {
    sp__msgbuf_discard(mb);
    return c->broken;
  }
  c->message[0] = '\0';
  int rc = send_request(c, mb, fds, nfds, deadline);
  if (rc == SP_ECLOSED || rc == SP_EIO) {
    struct client_reply reply;
    struct sp_msg_head head;
    bool refused;
    int answer = wait_reply(c, id, NULL, false, now_ms() + CLIENT_GRACE_MS,
                            &reply, &head, &refused);
    if (answer == 0)
      client_reply_release(&reply);
    if (!refused)
      return connection_lost(c, rc);
    if (!c->broken)
      c->broken = rc;
    return answer;
  }
  return rc;
}

int client_call_fds(sp_client *c, struct sp_msgbuf *mb, uint64_t id,
                    const char *op, const int *fds, size_t nfds,
                    struct client_reply *reply) {
  int64_t deadline = deadline_after(c->timeout_ms);
  int rc = start_request(c, mb, id, fds, nfds, deadline);
  if (rc < 0)
    return rc;
  struct sp_msg_head head;
  bool refused;
  return wait_reply(c, id, op, false, deadline, reply, &head, &refused);
}

int client_call(sp_client *c, struct sp_msgbuf *mb, uint64_t id,
                const char *op, struct client_reply *reply) {
  return client_call_fds(c, mb, id, op, NULL, 0, reply);
}

int client_start(sp_client *c, struct sp_msgbuf *mb, uint64_t id) {
  return start_request(c, mb, id, NULL, 0, deadline_after(c->timeout_ms));
}

int client_next(sp_client *c, uint64_t id, uint64_t wait_ms,
                struct client_reply *reply, struct sp_msg_head *head) {
  if (c->broken)
    return c->broken;
  int64_t deadline = INT64_MAX;
  if (wait_ms > 0 && wait_ms < (uint64_t)INT64_MAX / 2)
    deadline = now_ms() + (int64_t)wait_ms;
  bool refused;
  return wait_reply(c, id, NULL, true, deadline, reply, head, &refused);
}

static int hello(sp_client *c) {
  struct sp_msgbuf mb;
  uint64_t id = client_begin(c, &mb, "hello", 2);
  sp__pack_kv_u64(&mb.pk, "version", SP_PROTOCOL_VERSION);
  sp__pack_kv_str(&mb.pk, "client", "libshardport " SP_VERSION);
  struct client_reply reply;
  int rc = client_call(c, &mb, id, "hello", &reply);
  if (rc < 0)
    return rc;
  uint64_t version;
  const char *daemon;
  size_t daemon_len;
  rc = sp__msg_get_u64(&reply.map, "version", false, &version);
  if (rc == 0)
    rc = sp__msg_get_str(&reply.map, "daemon", false, &daemon, &daemon_len);
  if (rc == 0 && version != SP_PROTOCOL_VERSION)
    rc = SP_EVERSION;
  client_reply_release(&reply);
  return rc;
}

SP_EXPORT int sp_connect_explain(const char *path, sp_client **out, char *why,
                                 size_t whylen) {
  if (why != NULL && whylen > 0)
    why[0] = '\0';
  if (!out)
    return SP_EINVAL;
  char default_path[sizeof(struct sockaddr_un)];
  const char *origin = NULL;
  if (!path) {
    int rc = sp_default_socket_origin(default_path, sizeof default_path,
                                      &origin);
    if (rc < 0) {
      client_explain(why, whylen, "the default socket path", origin, rc, 0,
                     NULL);
      return rc;
    }
    path = default_path;
  }

  sp_client *c = calloc(1, sizeof *c);
  if (!c)
    return SP_ENOMEM;
  c->next_id = 1;
  c->timeout_ms = CLIENT_DEFAULT_TIMEOUT_MS;
  struct sp_limits limits;
  sp__limits_default(&limits);
  sp__frame_rx_init(&c->rx, &limits);

  int64_t deadline = deadline_after(c->timeout_ms);
  int err = 0;
  c->sock = open_socket(path, deadline, &err);
  if (c->sock < 0) {
    int rc = c->sock;
    free(c);
    client_explain(why, whylen, path, origin, rc, err, NULL);
    return rc;
  }
  int rc = hello(c);
  if (rc < 0) {
    client_explain(why, whylen, path, origin, rc, 0, c->message);
    sp_close(c);
    return rc;
  }
  *out = c;
  return 0;
}

SP_EXPORT int sp_connect(const char *path, sp_client **out) {
  return sp_connect_explain(path, out, NULL, 0);
}

SP_EXPORT void sp_close(sp_client *client) {
  if (!client)
    return;
  client_exports_detach(client);
  client_storages_clear(&client->storages);
  sp__frame_rx_reset(&client->rx);
  close(client->sock);
  free(client);
}

SP_EXPORT int sp_set_timeout(sp_client *client, uint32_t timeout_ms) {
  if (!client)
    return SP_EINVAL;
  client->timeout_ms = timeout_ms;
  return 0;
}

SP_EXPORT const char *sp_last_message(const sp_client *client) {
  return client ? client->message : "";
}

SP_EXPORT int sp_ping(sp_client *client, uint64_t *rtt_ns) {
  if (!client)
    return SP_EINVAL;
  struct timespec t0, t1;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  struct sp_msgbuf mb;
  uint64_t id = client_begin(client, &mb, "ping", 0);
  struct client_reply reply;
  int rc = client_call(client, &mb, id, "ping", &reply);
  if (rc < 0)
    return rc;
  clock_gettime(CLOCK_MONOTONIC, &t1);
  client_reply_release(&reply);
  if (rtt_ns) {
    int64_t ns = (int64_t)(t1.tv_sec - t0.tv_sec) * 1000000000 +
                 (t1.tv_nsec - t0.tv_nsec);
    *rtt_ns = ns > 0 ? (uint64_t)ns : 0;
  }
  return 0;
}
