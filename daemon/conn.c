/*
 * conn.c - one client connection.
 *
 * libuv cannot pass a memfd or a cuMem fd through its streams, so the socket
 * is driven by a uv_poll_t and read and written by the framing layer
 * (framesock.c over sp__frame_rx_read / sp__frame_tx_write), which carries
 * SCM_RIGHTS fds.
 *
 * One misbehaving client must never affect another, so all state here is
 * per connection and every operation is non-blocking and bounded:
 *   - a wakeup reads at most CONN_FRAMES_PER_WAKEUP frames, so a client that
 *     floods requests cannot starve the others (uv_poll is level-triggered
 *     and calls back again while data is left);
 *   - replies wait in a queue of at most max_output bytes; a client that
 *     does not read its replies is disconnected rather than allowed to grow
 *     the daemon's memory;
 *   - a client must say hello within CONN_HELLO_TIMEOUT_MS, and a closing
 *     connection gets CONN_DRAIN_TIMEOUT_MS to take its last reply, so that
 *     idle sockets cannot hold max_clients slots forever.
 *
 * Every frame is decoded exactly once here, with sp__wire_decode; handlers
 * see only checked msgpack objects.
 *
 * Decoding costs a multiple of a frame's size, and a registration frame may
 * hold hundreds of thousands of entries: served on the loop, one such frame
 * held every other client for a tenth of a second and more.  So a frame of
 * CONN_WORKER_MIN_FRAME bytes or more is decoded on a libuv worker thread,
 * with the part of its op that needs nothing of the loop's state (the op's
 * prepare: a registration's parsing and its checks against itself), and
 * served on the loop when it comes back, in steps that each take a turn of
 * the loop if the op asks for them (registration.c); it is freed on a
 * worker too.  The connection reads nothing more meanwhile, so its frames
 * are still served in order, and it stays allocated until the worker is
 * done: a connection closed meanwhile (its job ended, the daemon stops)
 * drops the frame when it comes back.  Reads are bounded per wakeup
 * (CONN_READ_PER_WAKEUP), so receiving a large frame takes turns as well.
 *
 * A connection that joined a job carries its member (job.c); closing the
 * connection tells the job, which fails and frees what the rank took part
 * in from its own wake-up.
 */
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "build_config.h"
#include "daemon/conn.h"
#include "daemon/consumer.h"
#include "daemon/drain.h"
#include "daemon/framesock.h"
#include "daemon/job.h"
#include "daemon/log.h"
#include "daemon/metrics.h"
#include "daemon/ops.h"
#include "daemon/peer.h"
#include "daemon/quota.h"
#include "daemon/registration.h"
#include "daemon/server.h"
#include "daemon/stage.h"
#include "proto/wire.h"
#include "shardport.h"

#define CONN_FRAMES_PER_WAKEUP 32
/* Bytes of frames served per wakeup: decoding costs a multiple of a frame's
 * size, so the count alone would let one client hold the loop for long. */
#define CONN_BYTES_PER_WAKEUP (1u << 20)
/* The largest frame before hello: a hello is well under a hundred bytes, and
 * an unauthenticated peer must not make the daemon hold max_frame. */
#define CONN_HELLO_MAX_FRAME 4096u
/* A frame that has started must finish within this, or the peer is dropped:
 * a stalled partial frame holds memory and descriptors. */
#define CONN_FRAME_TIMEOUT_MS 30000
#define CONN_HELLO_TIMEOUT_MS 10000
#define CONN_DRAIN_TIMEOUT_MS 5000
/* Frames from this size on are decoded on a worker thread: decoding 64 KiB
 * takes well under a millisecond, so smaller ones cost the loop less than
 * the round trip to a worker. */
#define CONN_WORKER_MIN_FRAME (64u << 10)
/* Bytes read from one connection per wakeup: about what the socket buffers
 * hold, so that receiving a large frame costs the loop no more per turn. */
#define CONN_READ_PER_WAKEUP (256u << 10)

struct worker_frame;

struct conn {
  struct server *srv;
  struct conn *prev, *next;
  uint64_t id;
  struct peer peer;
  /* The peer's user, whose quotas its jobs and ranks count in. */
  struct quota_user *user;
  /* The socket, its poll, the frames in and out (framesock.h). */
  struct framesock fs;
  uv_timer_t timer;
  /* Handles not yet closed, and a frame on a worker; the conn is freed
   * when this reaches 0. */
  int open_handles;
  /* A large frame in the stage (waiting, on a worker, or between two
   * steps of its op): nothing more is read until it has been served. */
  struct worker_frame *staged;
  bool hello_done;
  /* Reading has stopped; the conn closes once its queue is written. */
  bool draining;
  bool closed;
  /* The job rank this connection joined as (job.c). */
  struct job_member *member;
  /* The job consumer it joined as (consumer.c), or NULL: a connection is
   * a rank or a consumer, never both. */
  struct job_consumer *consumer;
  /* Called when a write leaves the queue at most half full. */
  void (*drained)(struct conn *c, void *arg);
  void *drained_arg;
};

static void on_poll(uv_poll_t *handle, int status, int events);
static void unstage(struct conn *c);

struct server *conn_server(const struct conn *c) { return c->srv; }

uid_t conn_uid(const struct conn *c) { return c->peer.uid; }

uint64_t conn_id(const struct conn *c) { return c->id; }

struct conn *conn_find(const struct server *srv, uint64_t id) {
  for (struct conn *c = srv->conns; c != NULL; c = c->next)
    if (c->id == id)
      return c;
  return NULL;
}

const struct peer *conn_peer(const struct conn *c) { return &c->peer; }

struct conn *conn_next(const struct conn *c) { return c->next; }

struct job_member *conn_member(const struct conn *c) { return c->member; }

void conn_set_member(struct conn *c, struct job_member *member) {
  c->member = member;
}

struct job_consumer *conn_consumer(const struct conn *c) {
  return c->consumer;
}

void conn_set_consumer(struct conn *c, struct job_consumer *consumer) {
  c->consumer = consumer;
}

uint64_t conn_output_room(const struct conn *c) {
  uint64_t max = c->srv->cfg->max_output;
  return c->closed || c->fs.out_bytes >= max ? 0 : max - c->fs.out_bytes;
}

void conn_on_drained(struct conn *c, void (*fn)(struct conn *c, void *arg),
                     void *arg) {
  c->drained = fn;
  c->drained_arg = arg;
}

/* Drops one of the conn's handles or its frame on a worker; the last one
 * frees it. */
static void conn_unref(struct conn *c) {
  if (--c->open_handles > 0)
    return;
  close(c->fs.sock);
  framesock_release(&c->fs);
  free(c);
}

static void on_handle_closed(uv_handle_t *handle) { conn_unref(handle->data); }

void conn_close(struct conn *c) {
  if (c->closed)
    return;
  c->closed = true;
  log_msg(LOG_LEVEL_DEBUG, "client %" PRIu64 ": closed", c->id);
  if (c->prev != NULL)
    c->prev->next = c->next;
  else
    c->srv->conns = c->next;
  if (c->next != NULL)
    c->next->prev = c->prev;
  c->srv->nclients--;
  quota_release(c->user, QUOTA_CLIENT);
  c->user = NULL;
  /* The job only notes the loss here and acts on it from its own wake-up:
   * a close can happen inside another member's reply. */
  if (c->member != NULL) {
    job_conn_closed(c->member);
    c->member = NULL;
  }
  if (c->consumer != NULL) {
    consumer_conn_closed(c->consumer);
    c->consumer = NULL;
  }
  c->drained = NULL;
  unstage(c);
  /* uv_close stops the poll at once, so the socket can be closed in the
   * close callback without libuv ever seeing a reused descriptor. */
  framesock_close(&c->fs, on_handle_closed);
  uv_close((uv_handle_t *)&c->timer, on_handle_closed);
}

static void on_timeout(uv_timer_t *timer) {
  struct conn *c = timer->data;
  log_msg(LOG_LEVEL_INFO, "client %" PRIu64 " (pid %d): %s", c->id,
          (int)c->peer.pid,
          c->draining      ? "did not take its last reply in time"
          : !c->hello_done ? "no hello in time"
                           : "did not finish a frame in time");
  conn_close(c);
}

/* After hello the timer watches partial frames: it runs while one is being
 * received and stops once the stream is between frames. */
static void watch_partial_frame(struct conn *c) {
  if (!c->hello_done || c->draining || c->closed)
    return;
  bool partial = c->fs.rx.header_have > 0;
  if (partial && !uv_is_active((uv_handle_t *)&c->timer))
    uv_timer_start(&c->timer, on_timeout, CONN_FRAME_TIMEOUT_MS, 0);
  else if (!partial)
    uv_timer_stop(&c->timer);
}

/* Asks for exactly the events the connection can use now. */
static int update_events(struct conn *c) {
  int rc = framesock_want(&c->fs, on_poll, !c->draining && c->staged == NULL,
                          false);
  if (rc != 0) {
    log_msg(LOG_LEVEL_ERROR, "client %" PRIu64 ": uv_poll: %s", c->id,
            uv_strerror(rc));
    conn_close(c);
    return -1;
  }
  return 0;
}

/* Writes what the socket takes.  Returns 0 while the conn stays open, -1
 * when it was closed (by an error or because draining finished). */
static int flush(struct conn *c) {
  int rc = framesock_flush(&c->fs);
  if (rc < 0) {
    log_msg(LOG_LEVEL_DEBUG, "client %" PRIu64 ": write: %s", c->id,
            sp_strerror(rc));
    conn_close(c);
    return -1;
  }
  if (c->draining && c->fs.out_head == NULL) {
    conn_close(c);
    return -1;
  }
  if (c->drained != NULL && c->fs.out_bytes <= c->srv->cfg->max_output / 2)
    c->drained(c, c->drained_arg);
  return update_events(c);
}

/* Stops reading and closes once the queued replies are written. */
static void drain(struct conn *c) {
  if (c->draining || c->closed)
    return;
  c->draining = true;
  uv_timer_start(&c->timer, on_timeout, CONN_DRAIN_TIMEOUT_MS, 0);
}

void conn_finish(struct conn *c, int code, const char *fmt, ...) {
  if (c->draining || c->closed)
    return;
  char message[SP_ERRMSG_MAX + 1];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(message, sizeof(message), fmt, ap);
  va_end(ap);
  /* The rank leaves its job now, as if it had disconnected: nothing more
   * is read from it, and the job must not wait for its last bytes. */
  if (c->member != NULL) {
    job_conn_closed(c->member);
    c->member = NULL;
  }
  if (c->consumer != NULL) {
    consumer_conn_closed(c->consumer);
    c->consumer = NULL;
  }
  c->drained = NULL;
  conn_send_error(c, 0, code, "%s", message);
  if (!c->closed)
    drain(c);
}

int conn_send(struct conn *c, struct sp_frame_tx *tx) {
  tx->next = NULL;
  if (c->closed) {
    sp__frame_tx_free(tx);
    return SP_ECLOSED;
  }
  if (c->fs.out_bytes + sp__frame_tx_size(tx) > c->srv->cfg->max_output) {
    log_msg(LOG_LEVEL_WARN,
            "client %" PRIu64 " (pid %d): more than max_output (%" PRIu64
            " bytes) of replies unread; disconnecting",
            c->id, (int)c->peer.pid, c->srv->cfg->max_output);
    sp__frame_tx_free(tx);
    conn_close(c);
    return SP_ELIMIT;
  }
  framesock_queue(&c->fs, tx);
  /* Whoever queued it, the reply goes out as soon as the socket takes it. */
  return update_events(c) == 0 ? 0 : SP_ECLOSED;
}

int conn_send_msgbuf(struct conn *c, struct sp_msgbuf *mb) {
  struct sp_frame_tx *tx = calloc(1, sizeof(*tx));
  if (tx == NULL) {
    sp__msgbuf_discard(mb);
    return SP_ENOMEM;
  }
  int rc = sp__msgbuf_finish(mb, tx);
  if (rc < 0) {
    free(tx);
    return rc;
  }
  return conn_send(c, tx);
}

int conn_send_error(struct conn *c, uint64_t id, int code, const char *fmt,
                    ...) {
  char message[SP_ERRMSG_MAX + 1];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(message, sizeof(message), fmt, ap);
  va_end(ap);
  metrics_refused(c->srv->metrics, code);
  struct sp_frame_tx *tx = calloc(1, sizeof(*tx));
  if (tx == NULL)
    return SP_ENOMEM;
  int rc = sp__msg_error(tx, id, code, "%s", message);
  if (rc < 0) {
    free(tx);
    return rc;
  }
  return conn_send(c, tx);
}

int conn_op_hello(struct conn *c, const struct sp_msg_head *head,
                  const msgpack_object *map, struct sp_frame *frame) {
  (void)frame;
  if (c->hello_done)
    return conn_send_error(c, head->id, SP_ESTATE,
                           "hello was already exchanged on this connection");
  uint64_t version;
  if (sp__msg_get_u64(map, "version", false, &version) != 0) {
    drain(c);
    return conn_send_error(c, head->id, SP_EBADMSG,
                           "hello needs an unsigned \"version\"");
  }
  if (version != SP_PROTOCOL_VERSION) {
    log_msg(LOG_LEVEL_INFO,
            "client %" PRIu64 " (pid %d): protocol version %" PRIu64
            ", daemon speaks %d",
            c->id, (int)c->peer.pid, version, SP_PROTOCOL_VERSION);
    drain(c);
    return conn_send_error(c, head->id, SP_EVERSION,
                           "protocol version mismatch (client %" PRIu64
                           ", daemon %d)",
                           version, SP_PROTOCOL_VERSION);
  }
  char client[64] = "";
  if (sp__msg_get_strbuf(map, "client", true, client, sizeof(client)) < 0)
    snprintf(client, sizeof(client), "(unreadable)");
  log_msg(LOG_LEVEL_DEBUG, "client %" PRIu64 ": hello from %s", c->id,
          client[0] != '\0' ? client : "(unnamed)");
  c->hello_done = true;
  c->fs.rx.limits.max_frame = c->srv->cfg->limits.max_frame;
  uv_timer_stop(&c->timer);
  struct sp_msgbuf mb;
  sp__msgbuf_begin(&mb, "hello", head->id, 2);
  sp__pack_kv_u64(&mb.pk, "version", SP_PROTOCOL_VERSION);
  sp__pack_kv_str(&mb.pk, "daemon", SP_VERSION);
  return conn_send_msgbuf(c, &mb);
}

/* A frame decoded, and for an op with a prepare step, prepared. */
struct decoded {
  msgpack_zone zone;
  bool has_zone;
  msgpack_object map;
  struct sp_msg_head head;
  int rc; /* a frame that does not decode, or 0 */
  const struct op *op; /* prepared's, when set */
  void *prepared;
};

/* Decodes a frame and, when prepare is set and the frame names its op,
 * prepares it.  Touches nothing but its arguments, so it may run on a
 * worker thread. */
static void decode(const struct sp_limits *limits, const struct sp_frame *frame,
                   bool prepare, struct decoded *d) {
  memset(d, 0, sizeof *d);
  if (!msgpack_zone_init(&d->zone, MSGPACK_ZONE_CHUNK_SIZE)) {
    d->rc = SP_ENOMEM;
    return;
  }
  d->has_zone = true;
  d->rc = sp__wire_decode(frame->data, frame->len, limits, &d->zone, &d->map);
  if (d->rc == 0 && (d->rc = sp__msg_head(&d->map, &d->head)) < 0) {
    /* The envelope is broken, but an id that is there is still echoed. */
    d->head.id = 0;
    sp__msg_get_u64(&d->map, "id", false, &d->head.id);
  }
  const struct op *op = d->rc == 0 && prepare ? ops_find(d->head.op) : NULL;
  if (op != NULL && op->prepared != NULL) {
    d->op = op;
    d->prepared = op->prepared->prepare(&d->map, frame);
  }
}

static void decoded_free(struct decoded *d, struct sp_frame *frame) {
  if (d->prepared != NULL)
    d->op->prepared->free(d->prepared);
  if (d->has_zone)
    msgpack_zone_destroy(&d->zone);
  sp__frame_release(frame);
}

/* What an op's handler or step returned: true when it wants another step;
 * else a negative code is replied. */
static bool op_returned(struct conn *c, const struct decoded *d, int rc) {
  if (rc == 1)
    return true;
  if (rc < 0 && !c->closed)
    conn_send_error(c, d->head.id, rc, "%s: %s", d->head.op, sp_strerror(rc));
  return false;
}

/* Serves one decoded frame; true when its op wants another step
 * (serve_step).  The caller frees the frame and the decoding once served.
 * Before hello, anything but a good hello ends the connection once the
 * error reply is written. */
static bool serve(struct conn *c, struct sp_frame *frame, struct decoded *d) {
  const struct sp_msg_head *head = &d->head;
  int rc = d->rc;
  if (rc == SP_ENOMEM && !d->has_zone) {
    conn_send_error(c, 0, SP_ENOMEM, "out of memory decoding the frame");
    drain(c);
    return false;
  }
  if (rc < 0) {
    log_msg(LOG_LEVEL_DEBUG, "client %" PRIu64 ": bad frame: %s", c->id,
            sp_err_name(rc));
    conn_send_error(c, head->id, rc, "%s", sp_strerror(rc));
    if (!c->hello_done)
      drain(c);
    return false;
  }
  if (!c->hello_done && strcmp(head->op, "hello") != 0) {
    conn_send_error(c, head->id, SP_EHELLO,
                    "the first frame must be hello, not \"%s\"", head->op);
    drain(c);
    return false;
  }
  const struct op *op = ops_find(head->op);
  if (op == NULL) {
    conn_send_error(c, head->id, SP_EUNKNOWNOP, "unknown operation \"%s\"",
                    head->op);
    return false;
  }
  if (op->new_work && drain_refuse(c->srv, c, head->id, head->op))
    return false;
  if (!op->takes_fds && frame->nfds > 0) {
    size_t n = sp__frame_close_fds(frame);
    log_msg(LOG_LEVEL_DEBUG, "client %" PRIu64 ": closed %zu fd(s) sent with %s",
            c->id, n, head->op);
  }
  rc = d->prepared != NULL ? op->prepared->serve(c, head, frame, d->prepared)
                            : op->handle(c, head, &d->map, frame);
  return op_returned(c, d, rc);
}

/* The next step of a frame whose op asked for one. */
static bool serve_step(struct conn *c, struct sp_frame *frame,
                       struct decoded *d) {
  const struct op *op = ops_find(d->head.op);
  return op_returned(c, d,
                     op->prepared->serve(c, &d->head, frame, d->prepared));
}

/* Decodes and serves one complete frame on the loop. */
static void dispatch(struct conn *c, struct sp_frame *frame) {
  struct decoded d;
  decode(&c->srv->cfg->limits, frame, false, &d);
  /* Without a prepared request the op's handler takes every step. */
  serve(c, frame, &d);
  decoded_free(&d, frame);
}

/* A large frame on its way through the stage (stage.c): taken in, decoded
 * on a worker thread, then served in turns of the loop, one step of its op
 * each, and freed on a worker. */
struct worker_frame {
  uv_work_t work;
  struct stage_item item;
  struct conn *c;
  struct sp_limits limits; /* a copy: a reload may change the loop's */
  struct sp_frame frame;
  struct decoded d;
  bool decoded;  /* back from its worker */
  bool stepping; /* served once; its op wants more steps */
  const char *test_gate; /* the server's test_worker_gate, or NULL */
};

/* The test seam SHARDPORTD_TEST_WORKER_GATE (docs/operations.md), before
 * the decoding and before each later step: opening the FIFO for reading
 * waits for a test to open it for writing, and reading it waits for the
 * test to close it.  The server checked at start that it is a FIFO; should
 * it be gone since, the frame goes on (the test holding it then fails). */
static void wait_test_gate(const char *path) {
  int fd;
  while ((fd = open(path, O_RDONLY | O_CLOEXEC)) < 0 && errno == EINTR)
    ;
  if (fd < 0)
    return;
  char byte;
  ssize_t n;
  do
    n = read(fd, &byte, 1);
  while (n > 0 || (n < 0 && errno == EINTR));
  close(fd);
}

static void decode_on_worker(uv_work_t *work) {
  struct worker_frame *w = work->data;
  if (w->test_gate != NULL)
    wait_test_gate(w->test_gate);
  decode(&w->limits, &w->frame, true, &w->d);
}

/* Under the test seam, a step's turn first waits at the gate on a
 * worker. */
static void wait_on_worker(uv_work_t *work) {
  struct worker_frame *w = work->data;
  wait_test_gate(w->test_gate);
}

/* A served frame and its decoding are freed on a worker: a large one is
 * tens of megabytes in thousands of blocks.  What a registration opened on
 * a GPU is closed on the loop first (drop_frame). */
static void free_on_worker(uv_work_t *work) {
  struct worker_frame *w = work->data;
  decoded_free(&w->d, &w->frame);
}

/* Freed: its bytes go back to the stage, which may take in another. */
static void on_freed(uv_work_t *work, int status) {
  struct worker_frame *w = work->data;
  struct conn *c = w->c;
  (void)status;
  stage_give_back(c->srv, &w->item);
  free(w);
  conn_unref(c);
}

/* uv_queue_work fails only without a work callback. */
static void queue_work(uv_loop_t *loop, struct worker_frame *w, uv_work_cb cb,
                       uv_after_work_cb after) {
  int rc = uv_queue_work(loop, &w->work, cb, after);
  if (rc != 0) {
    log_msg(LOG_LEVEL_ERROR, "uv_queue_work: %s", uv_strerror(rc));
    abort();
  }
}

/* The frame is done with, served or not: it is freed on a worker, and
 * its connection reads again. */
static void release_frame(struct worker_frame *w) {
  w->c->staged = NULL;
  const struct decoded *d = &w->d;
  if (d->prepared != NULL && d->op->prepared->close != NULL)
    d->op->prepared->close(d->prepared);
  queue_work(w->c->srv->loop, w, free_on_worker, on_freed);
}

/* A frame whose connection ended, or began to end, is not served. */
static void drop_frame(struct worker_frame *w) {
  log_msg(LOG_LEVEL_DEBUG,
          "client %" PRIu64 ": a frame of %zu bytes was dropped: its "
          "connection %s",
          w->c->id, w->frame.len, w->c->closed ? "closed" : "began to close");
  release_frame(w);
}

static void on_worker_done(uv_work_t *work, int status);

/* The frame's next turn: its first serving, or a later step. */
static void take_turn(struct worker_frame *w) {
  struct conn *c = w->c;
  if (c->closed || c->draining) {
    drop_frame(w);
    return;
  }
  if (w->stepping ? serve_step(c, &w->frame, &w->d)
                  : serve(c, &w->frame, &w->d)) {
    w->stepping = true;
    if (w->test_gate != NULL)
      queue_work(c->srv->loop, w, wait_on_worker, on_worker_done);
    else
      stage_queue(c->srv, &w->item);
    return;
  }
  release_frame(w);
  if (!c->closed) {
    /* Frames that arrived meanwhile are read from the next wakeup. */
    watch_partial_frame(c);
    flush(c);
  }
}

/* Back from a worker: the frame's turn waits for the stage's. */
static void on_worker_done(uv_work_t *work, int status) {
  struct worker_frame *w = work->data;
  (void)status; /* never cancelled: uv_cancel is not called */
  w->decoded = true;
  stage_decoded(w->c->srv, &w->item);
  if (w->c->closed || w->c->draining)
    drop_frame(w);
  else
    stage_queue(w->c->srv, &w->item);
}

/* From the stage: taken in at last (to the worker that decodes it, unless
 * its connection is ending), or its turn of the loop. */
static void on_stage(struct stage_item *it) {
  struct worker_frame *w = (struct worker_frame *)((char *)it -
                                                   offsetof(struct worker_frame,
                                                            item));
  if (w->decoded || w->c->closed || w->c->draining)
    take_turn(w);
  else
    queue_work(w->c->srv->loop, w, decode_on_worker, on_worker_done);
}

/* Hands a large frame to the stage, which has it decoded on a worker now
 * or once others have been served; reading waits until it has been
 * served.  Returns false (the frame untouched) when out of memory. */
static bool serve_on_worker(struct conn *c, struct sp_frame *frame) {
  struct worker_frame *w = calloc(1, sizeof *w);
  if (w == NULL)
    return false;
  w->c = c;
  w->limits = c->srv->cfg->limits;
  w->frame = *frame;
  w->test_gate = c->srv->test_worker_gate;
  w->work.data = w;
  w->item.go = on_stage;
  c->open_handles++;
  c->staged = w;
  if (stage_take(c->srv, &w->item, frame->len))
    on_stage(&w->item);
  return true;
}

/* A closing connection's frame that waits in the stage goes now: one not
 * taken in holds only its bytes, one queued for its turn its decoding
 * too.  A frame on a worker, or being served, is dropped when it comes
 * back (take_turn). */
static void unstage(struct conn *c) {
  struct worker_frame *w = c->staged;
  if (w == NULL)
    return;
  if (w->item.where == STAGE_WAITING) {
    stage_remove(c->srv, &w->item);
    c->staged = NULL;
    sp__frame_release(&w->frame);
    free(w);
    conn_unref(c);
  } else if (w->item.where == STAGE_QUEUED) {
    stage_remove(c->srv, &w->item);
    drop_frame(w);
  }
}

/* Reads and serves frames.  Returns -1 when the conn was closed. */
static int read_frames(struct conn *c) {
  size_t bytes = 0;
  for (int i = 0; i < CONN_FRAMES_PER_WAKEUP && bytes < CONN_BYTES_PER_WAKEUP;
       i++) {
    struct sp_frame frame = {.data = NULL};
    int rc = framesock_read(&c->fs, &frame);
    if (rc == 0)
      return 0;
    if (rc == 1) {
      bytes += frame.len;
      if (c->hello_done && frame.len >= CONN_WORKER_MIN_FRAME &&
          serve_on_worker(c, &frame))
        return update_events(c);
      dispatch(c, &frame);
      if (c->closed)
        return -1;
      if (c->draining)
        return 0;
      continue;
    }
    /* The stream is out of step after a framing error: the error reply goes
     * out, then the connection closes. */
    switch (rc) {
    case SP_ECLOSED:
      log_msg(LOG_LEVEL_DEBUG, "client %" PRIu64 ": end of stream", c->id);
      break;
    case SP_EFRAMETOOBIG:
    case SP_ETOOMANYFDS:
      log_msg(LOG_LEVEL_INFO, "client %" PRIu64 " (pid %d): %s; closing",
              c->id, (int)c->peer.pid, sp_strerror(rc));
      sp__frame_rx_reset(&c->fs.rx);
      if (rc == SP_EFRAMETOOBIG)
        conn_send_error(c, 0, rc, "frame is larger than max_frame (%" PRIu32
                                  " bytes)",
                        c->srv->cfg->limits.max_frame);
      else
        conn_send_error(c, 0, rc,
                        "frame carries more than max_fds (%" PRIu32 ") fds",
                        c->srv->cfg->limits.max_fds);
      break;
    default:
      log_msg(LOG_LEVEL_DEBUG, "client %" PRIu64 ": read: %s", c->id,
              sp_strerror(rc));
      conn_close(c);
      return -1;
    }
    if (c->closed)
      return -1;
    drain(c);
    return 0;
  }
  return 0;
}

static void on_poll(uv_poll_t *handle, int status, int events) {
  struct conn *c = handle->data;
  if (status < 0) {
    log_msg(LOG_LEVEL_DEBUG, "client %" PRIu64 ": poll: %s", c->id,
            uv_strerror(status));
    conn_close(c);
    return;
  }
  if ((events & UV_READABLE) && !c->draining && c->staged == NULL &&
      read_frames(c) < 0)
    return;
  watch_partial_frame(c);
  flush(c);
}

int conn_open(struct server *srv, int sock, const struct peer *peer) {
  struct conn *c = calloc(1, sizeof(*c));
  struct quota_user *user = quota_hold(srv, peer->uid, QUOTA_CLIENT);
  if (c == NULL || user == NULL) {
    if (user != NULL)
      quota_release(user, QUOTA_CLIENT);
    free(c);
    close(sock);
    return SP_ENOMEM;
  }
  c->user = user;
  c->srv = srv;
  c->peer = *peer;
  c->id = ++srv->next_conn_id;
  struct sp_limits before_hello = srv->cfg->limits;
  if (before_hello.max_frame > CONN_HELLO_MAX_FRAME)
    before_hello.max_frame = CONN_HELLO_MAX_FRAME;
  int rc = framesock_init(&c->fs, srv->loop, sock, &before_hello, c);
  if (rc != 0) {
    log_msg(LOG_LEVEL_ERROR, "uv_poll_init: %s", uv_strerror(rc));
    quota_release(c->user, QUOTA_CLIENT);
    close(sock);
    free(c);
    return SP_EINTERNAL;
  }
  c->fs.rx.max_read = CONN_READ_PER_WAKEUP;
  uv_timer_init(srv->loop, &c->timer);
  c->timer.data = c;
  c->open_handles = 2;

  c->next = srv->conns;
  if (srv->conns != NULL)
    srv->conns->prev = c;
  srv->conns = c;
  srv->nclients++;

  uv_timer_start(&c->timer, on_timeout, CONN_HELLO_TIMEOUT_MS, 0);
  if (update_events(c) != 0)
    return SP_EINTERNAL;
  log_msg(LOG_LEVEL_DEBUG, "client %" PRIu64 ": connected (pid %d uid %u)",
          c->id, (int)peer->pid, (unsigned)peer->uid);
  return 0;
}
