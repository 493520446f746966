/*
 * fakeworld.c - fake connections and a fake engine under the daemon's real
 * jobs and exports; see fakeworld.h.
 */
#include <check.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include "daemon/conn.h"
#include "daemon/consumer.h"
#include "daemon/ops.h"
#include "daemon/pool.h"
#include "daemon/xfer/engine.h"
#include "daemon/xfer/thread.h"
#include "daemon/metrics.h"
#include "proto/wire.h"
#include "shardport.h"
#include "tests/unit/daemon/fakeworld.h"

/* The engine of the export that started last (engine_start), and whether
 * the next start fails as pthread_create would. */
static struct engine *last_engine;
static unsigned engine_starts;
static bool refuse_start;

/* ---- the world ---------------------------------------------------------- */

void fake_world_init(struct fake_world *w, uint64_t pool_bytes) {
  memset(w, 0, sizeof *w);
  last_engine = NULL;
  engine_starts = 0;
  refuse_start = false;
  tserver_init(&w->t, pool_bytes);
}

static bool all_gone(void *arg) {
  const struct fake_world *w = arg;
  return w->t.srv.njobs == 0 && pool_used(w->t.srv.pool) == 0;
}

void fake_world_free(struct fake_world *w) {
  for (struct job *job = w->t.srv.jobs; job != NULL; job = job->next)
    job_end(job);
  for (size_t i = 0; i < w->nconns; i++)
    if (!w->conns[i]->closed)
      conn_close(w->conns[i]);
  fake_spawn_release();
  /* Every segment goes back to the pool with the jobs. */
  fake_run_until(w, all_gone, w);
  tserver_free(&w->t);
  for (size_t i = 0; i < w->nconns; i++)
    free(w->conns[i]);
}

/* A turn of the loop, and the pool's inotify events as the server polls
 * them (server.c). */
void fake_turn(struct fake_world *w) {
  uv_run(&w->t.loop, UV_RUN_NOWAIT);
  pool_collect(w->t.srv.pool);
}

void fake_run_until(struct fake_world *w, bool (*done)(void *arg),
                    void *arg) {
  /* Ten seconds of short naps: a test that waits longer is broken. */
  for (int i = 0; i < 10000; i++) {
    fake_turn(w);
    if (done(arg))
      return;
    nanosleep(&(struct timespec){.tv_nsec = 1000000}, NULL);
  }
  ck_abort_msg("the loop never got there");
}

/* ---- connections --------------------------------------------------------- */

struct conn *fake_conn(struct fake_world *w) {
  ck_assert_uint_lt(w->nconns, sizeof w->conns / sizeof w->conns[0]);
  struct conn *c = calloc(1, sizeof *c);
  ck_assert_ptr_nonnull(c);
  c->srv = &w->t.srv;
  c->id = ++w->t.srv.next_conn_id;
  c->peer = (struct peer){.pid = getpid(), .uid = getuid(), .gid = getgid()};
  c->reading = true;
  c->next = w->t.srv.conns;
  w->t.srv.conns = c;
  w->t.srv.nclients++;
  w->conns[w->nconns++] = c;
  return c;
}

static struct fake_reply *next_reply(struct conn *c) {
  ck_assert_uint_lt(c->nreplies, FAKE_MAX_REPLIES);
  struct fake_reply *r = &c->replies[c->nreplies++];
  memset(r, 0, sizeof *r);
  return r;
}

/* Reads what the tests look at out of a reply the daemon packed. */
static void record(struct conn *c, const struct sp_frame_tx *tx) {
  struct sp_limits limits;
  sp__limits_default(&limits);
  limits.max_frame = UINT32_MAX;
  msgpack_zone zone;
  msgpack_object map;
  struct sp_msg_head head;
  ck_assert(msgpack_zone_init(&zone, 4096));
  ck_assert_int_eq(sp__wire_decode(tx->buf + SP_FRAME_HEADER,
                                   tx->len - SP_FRAME_HEADER, &limits, &zone,
                                   &map),
                   0);
  ck_assert_int_eq(sp__msg_head(&map, &head), 0);
  struct fake_reply *r = next_reply(c);
  snprintf(r->op, sizeof r->op, "%s", head.op);
  r->id = head.id;
  r->nfds = tx->nfds;
  sp__msg_get_strbuf(&map, "phase", true, r->phase, sizeof r->phase);
  sp__msg_get_u64(&map, "export_id", true, &r->export_id);
  sp__msg_get_u64(&map, "part", true, &r->part);
  sp__msg_get_u64(&map, "parts", true, &r->parts);
  const msgpack_object *t = sp__msg_field(&map, "ticket");
  if (t != NULL && t->type == MSGPACK_OBJECT_BIN &&
      t->via.bin.size <= sizeof r->ticket) {
    memcpy(r->ticket, t->via.bin.ptr, t->via.bin.size);
    r->ticket_len = t->via.bin.size;
  }
  msgpack_zone_destroy(&zone);
}

int conn_send(struct conn *c, struct sp_frame_tx *tx) {
  if (c->closed) {
    sp__frame_tx_free(tx);
    return SP_ECLOSED;
  }
  record(c, tx);
  if (!c->reading)
    c->out_bytes += tx->len;
  sp__frame_tx_free(tx);
  return 0;
}

int conn_send_msgbuf(struct conn *c, struct sp_msgbuf *mb) {
  struct sp_frame_tx *tx = calloc(1, sizeof *tx);
  ck_assert_ptr_nonnull(tx);
  ck_assert_int_eq(sp__msgbuf_finish(mb, tx), 0);
  return conn_send(c, tx);
}

int conn_send_error(struct conn *c, uint64_t id, int code, const char *fmt,
                    ...) {
  if (c->closed)
    return SP_ECLOSED;
  struct fake_reply *r = next_reply(c);
  snprintf(r->op, sizeof r->op, "error");
  r->id = id;
  r->code = code;
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(r->message, sizeof r->message, fmt, ap);
  va_end(ap);
  return 0;
}

void conn_close(struct conn *c) {
  if (c->closed)
    return;
  c->closed = true;
  c->drained = NULL;
  /* As conn.c does: the job notes the loss, and acts on its wake-up. */
  if (c->member != NULL) {
    job_conn_closed(c->member);
    c->member = NULL;
  }
  if (c->consumer != NULL) {
    consumer_conn_closed(c->consumer);
    c->consumer = NULL;
  }
}

void conn_finish(struct conn *c, int code, const char *fmt, ...) {
  if (c->closed)
    return;
  char message[SP_ERRMSG_MAX + 1];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(message, sizeof message, fmt, ap);
  va_end(ap);
  conn_send_error(c, 0, code, "%s", message);
  c->finished = code;
  conn_close(c);
}

void fake_conn_read(struct conn *c) {
  c->out_bytes = 0;
  if (c->drained != NULL)
    c->drained(c, c->drained_arg);
}

void fake_conn_drop(struct conn *c) { conn_close(c); }

struct server *conn_server(const struct conn *c) { return c->srv; }
uid_t conn_uid(const struct conn *c) { return c->peer.uid; }
const struct peer *conn_peer(const struct conn *c) { return &c->peer; }
struct conn *conn_next(const struct conn *c) { return c->next; }
uint64_t conn_id(const struct conn *c) { return c->id; }
struct job_member *conn_member(const struct conn *c) { return c->member; }

struct conn *conn_find(const struct server *srv, uint64_t id) {
  for (struct conn *c = srv->conns; c != NULL; c = c->next)
    if (c->id == id && !c->closed)
      return c;
  return NULL;
}

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
  return c->closed || c->out_bytes >= max ? 0 : max - c->out_bytes;
}

void conn_on_drained(struct conn *c, void (*fn)(struct conn *c, void *arg),
                     void *arg) {
  c->drained = fn;
  c->drained_arg = arg;
}

/* The fake world never listens: every connection is a fake_conn. */
int conn_open(struct server *srv, int sock, const struct peer *peer) {
  (void)srv;
  (void)peer;
  close(sock);
  ck_abort_msg("a socket reached the fake world");
  return SP_EINTERNAL;
}

/* The tests' connections said hello already; the table still names it. */
int conn_op_hello(struct conn *c, const struct sp_msg_head *head,
                  const msgpack_object *map, struct sp_frame *frame) {
  (void)map;
  (void)frame;
  return conn_send_error(c, head->id, SP_ESTATE,
                         "hello was already exchanged on this connection");
}

const struct fake_reply *fake_last(const struct conn *c) {
  return c->nreplies > 0 ? &c->replies[c->nreplies - 1] : NULL;
}

const struct fake_reply *fake_last_op(const struct conn *c, const char *op) {
  for (size_t i = c->nreplies; i > 0; i--)
    if (strcmp(c->replies[i - 1].op, op) == 0)
      return &c->replies[i - 1];
  return NULL;
}

size_t fake_count_op(const struct conn *c, const char *op) {
  size_t n = 0;
  for (size_t i = 0; i < c->nreplies; i++)
    n += strcmp(c->replies[i].op, op) == 0;
  return n;
}

int fake_request(struct conn *c, const char *op, uint32_t nfields,
                 void (*pack)(msgpack_packer *pk, const void *arg),
                 const void *arg, const int *fds, size_t nfds) {
  static uint64_t next_id = 100;
  struct sp_msgbuf mb;
  sp__msgbuf_begin(&mb, op, ++next_id, nfields);
  if (pack != NULL)
    pack(&mb.pk, arg);
  struct sp_limits limits;
  sp__limits_default(&limits);
  msgpack_zone zone;
  msgpack_object map;
  struct sp_msg_head head;
  ck_assert(msgpack_zone_init(&zone, 4096));
  ck_assert_int_eq(
      sp__wire_decode((const uint8_t *)mb.sbuf.data + SP_FRAME_HEADER,
                      mb.sbuf.size - SP_FRAME_HEADER, &limits, &zone, &map),
      0);
  ck_assert_int_eq(sp__msg_head(&map, &head), 0);
  struct sp_frame frame = {0};
  ck_assert_uint_le(nfds, SP_FDS_MAX);
  for (size_t i = 0; i < nfds; i++)
    frame.fds[i] = dup(fds[i]);
  frame.nfds = nfds;
  const struct op *entry = ops_find(op);
  ck_assert_ptr_nonnull(entry);
  int rc = entry->handle(c, &head, &map, &frame);
  /* What conn.c replies for a handler that returned a code. */
  if (rc < 0)
    conn_send_error(c, head.id, rc, "%s: %s", op, sp_strerror(rc));
  sp__frame_release(&frame);
  msgpack_zone_destroy(&zone);
  sp__msgbuf_discard(&mb);
  return rc;
}

/* ---- the engine ---------------------------------------------------------- */

static pthread_mutex_t gate_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t gate_cond = PTHREAD_COND_INITIALIZER;
static bool hold_next, gate_shut;

struct engine *fake_engine(void) { return last_engine; }

void fake_engine_refuse_start(void) { refuse_start = true; }

int engine_start(struct engine *e) {
  if (refuse_start)
    return SP_ENOMEM;
  last_engine = e;
  engine_starts++;
  return 0;
}

unsigned fake_engine_starts(void) { return engine_starts; }

void engine_join(struct engine *e) {
  ck_assert(atomic_load(&e->done));
}

void fake_engine_end(int rc, const char *msg) {
  struct engine *e = last_engine;
  ck_assert_ptr_nonnull(e);
  e->rc = rc;
  e->lost_node = PLAN_NONE;
  snprintf(e->msg, sizeof e->msg, "%s", rc != 0 ? msg : "");
  atomic_store(&e->done, true);
  if (e->notify != NULL)
    e->notify(e->notify_arg);
}

void fake_spawn_hold(void) {
  pthread_mutex_lock(&gate_lock);
  hold_next = true;
  pthread_mutex_unlock(&gate_lock);
}

void fake_spawn_release(void) {
  pthread_mutex_lock(&gate_lock);
  hold_next = false;
  gate_shut = false;
  pthread_cond_broadcast(&gate_cond);
  pthread_mutex_unlock(&gate_lock);
}

struct spawned {
  void *(*fn)(void *);
  void *arg;
  bool held;
};

static void *spawned_main(void *p) {
  struct spawned s = *(struct spawned *)p;
  free(p);
  if (s.held) {
    pthread_mutex_lock(&gate_lock);
    while (gate_shut)
      pthread_cond_wait(&gate_cond, &gate_lock);
    pthread_mutex_unlock(&gate_lock);
  }
  return s.fn(s.arg);
}

int xfer_spawn(pthread_t *thread, void *(*fn)(void *), void *arg) {
  struct spawned *s = malloc(sizeof *s);
  if (s == NULL)
    return SP_ENOMEM;
  pthread_mutex_lock(&gate_lock);
  *s = (struct spawned){.fn = fn, .arg = arg, .held = hold_next};
  if (hold_next)
    gate_shut = true;
  hold_next = false;
  pthread_mutex_unlock(&gate_lock);
  if (pthread_create(thread, NULL, spawned_main, s) != 0) {
    free(s);
    return SP_ENOMEM;
  }
  return 0;
}

/* The planner's replica comparison reads the ranks' memfds, which no test
 * truncates: nothing to guard. */
int xfer_guarded(void (*fn)(void *arg), void *arg, const void **fault) {
  (void)fault;
  fn(arg);
  return 0;
}

/* ---- clients ------------------------------------------------------------- */

static void pack_world(msgpack_packer *pk, const void *arg) {
  sp__pack_kv_u64(pk, "world", *(const uint32_t *)arg);
}

int fake_create(struct conn *c, uint32_t world, uint8_t *ticket,
                size_t *len) {
  size_t before = c->nreplies;
  int rc = fake_request(c, "job_create", 1, pack_world, &world, NULL, 0);
  const struct fake_reply *r = fake_last(c);
  ck_assert_uint_eq(c->nreplies, before + 1);
  if (strcmp(r->op, "job_create") != 0)
    return r->code;
  memcpy(ticket, r->ticket, r->ticket_len);
  *len = r->ticket_len;
  return rc;
}

struct join_args {
  const uint8_t *ticket;
  size_t len;
  uint32_t rank, world;
};

static void pack_join(msgpack_packer *pk, const void *arg) {
  const struct join_args *a = arg;
  sp__pack_str(pk, "ticket");
  sp__pack_bin(pk, a->ticket, a->len);
  sp__pack_kv_u64(pk, "rank", a->rank);
  sp__pack_kv_u64(pk, "world", a->world);
  sp__pack_kv_str(pk, "device", "cpu");
}

/* The code the last reply carries: 0 unless it is an error. */
static int replied(const struct conn *c, size_t before, int rc) {
  if (rc < 0)
    return rc;
  ck_assert_uint_gt(c->nreplies, before);
  return fake_last(c)->code;
}

int fake_join(struct conn *c, const uint8_t *ticket, size_t len,
              uint32_t rank, uint32_t world) {
  struct join_args a = {ticket, len, rank, world};
  size_t before = c->nreplies;
  return replied(c, before,
                 fake_request(c, "join", 4, pack_join, &a, NULL, 0));
}

struct storage_args {
  uint64_t bytes, base;
};

static void pack_storage(msgpack_packer *pk, const void *arg) {
  const struct storage_args *a = arg;
  sp__pack_str(pk, "storages");
  msgpack_pack_array(pk, 1);
  msgpack_pack_map(pk, 6);
  sp__pack_kv_u64(pk, "sid", 1);
  sp__pack_kv_str(pk, "kind", "memfd");
  sp__pack_kv_u64(pk, "fd", 0);
  sp__pack_kv_u64(pk, "offset", 0);
  sp__pack_kv_u64(pk, "length", a->bytes);
  sp__pack_kv_u64(pk, "base", a->base);
}

int fake_storage(struct conn *c, int fd, uint64_t bytes, uint64_t base) {
  struct storage_args a = {bytes, base};
  size_t before = c->nreplies;
  return replied(c, before,
                 fake_request(c, "storage_add", 1, pack_storage, &a, &fd, 1));
}

struct tensor_args {
  const char *key, *placement;
  int64_t rows, global_rows;
};

static void pack_dim(msgpack_packer *pk, const char *key, int64_t v) {
  sp__pack_str(pk, key);
  msgpack_pack_array(pk, 1);
  msgpack_pack_uint64(pk, (uint64_t)v);
}

static void pack_tensor(msgpack_packer *pk, const void *arg) {
  const struct tensor_args *a = arg;
  sp__pack_str(pk, "tensors");
  msgpack_pack_array(pk, 1);
  msgpack_pack_map(pk, 8);
  sp__pack_kv_str(pk, "key", a->key);
  sp__pack_kv_u64(pk, "sid", 1);
  sp__pack_kv_str(pk, "dtype", "float32");
  pack_dim(pk, "shape", a->rows);
  pack_dim(pk, "stride", 1);
  sp__pack_kv_u64(pk, "offset", 0);
  sp__pack_kv_str(pk, "placement", a->placement);
  pack_dim(pk, "global_shape", a->global_rows);
}

int fake_tensor(struct conn *c, const char *key, int64_t rows,
                int64_t global_rows, const char *placement) {
  struct tensor_args a = {key, placement, rows, global_rows};
  size_t before = c->nreplies;
  return replied(c, before,
                 fake_request(c, "tensor_add", 1, pack_tensor, &a, NULL, 0));
}

struct ask_args {
  uint32_t timeout_ms, max_keys;
};

static void pack_ask(msgpack_packer *pk, const void *arg) {
  const struct ask_args *a = arg;
  sp__pack_kv_bool(pk, "progress", true);
  sp__pack_kv_u64(pk, "timeout_ms", a->timeout_ms);
  sp__pack_kv_u64(pk, "max_keys", a->max_keys);
}

int fake_ask(struct conn *c, uint32_t timeout_ms, uint32_t max_keys) {
  struct ask_args a = {timeout_ms, max_keys};
  size_t before = c->nreplies;
  return replied(c, before,
                 fake_request(c, "export", 3, pack_ask, &a, NULL, 0));
}

static void pack_release(msgpack_packer *pk, const void *arg) {
  sp__pack_kv_u64(pk, "export_id", *(const uint64_t *)arg);
}

int fake_release(struct conn *c, uint64_t export_id) {
  size_t before = c->nreplies;
  return replied(c, before, fake_request(c, "release", 1, pack_release,
                                         &export_id, NULL, 0));
}

void fake_job_up(struct fake_job *fj, struct fake_world *w, uint32_t world,
                 uint64_t rows) {
  ck_assert_uint_le(world, FAKE_MAX_RANKS);
  memset(fj, 0, sizeof *fj);
  fj->w = w;
  fj->world = world;
  fj->rows = rows;
  for (uint32_t r = 0; r < world; r++)
    fj->rank[r] = fake_conn(w);
  ck_assert_int_eq(fake_create(fj->rank[0], world, fj->ticket,
                               &fj->ticket_len),
                   0);
  fj->job = w->t.srv.jobs;
  for (uint32_t r = 0; r < world; r++) {
    ck_assert_int_eq(
        fake_join(fj->rank[r], fj->ticket, fj->ticket_len, r, world), 0);
    fj->fd[r] = memfd_create("fakeworld", MFD_CLOEXEC);
    ck_assert_int_ge(fj->fd[r], 0);
    ck_assert_int_eq(ftruncate(fj->fd[r], (off_t)(rows * 4)), 0);
    ck_assert_int_eq(
        fake_storage(fj->rank[r], fj->fd[r], rows * 4, 0x100000ull * (r + 1)),
        0);
    ck_assert_int_eq(fake_tensor(fj->rank[r], "w", (int64_t)rows,
                                 (int64_t)(rows * world), "shard0"),
                     0);
  }
}

void fake_job_free(struct fake_job *fj) {
  for (uint32_t r = 0; r < fj->world; r++)
    close(fj->fd[r]);
}

enum job_phase fake_phase(const struct fake_job *fj) {
  struct export_view v;
  export_view(fj->job, &v);
  return v.phase;
}
