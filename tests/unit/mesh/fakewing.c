/*
 * fakewing.c - the fakes the wing's unit tests run it on; see fakewing.h.
 *
 * The links follow what daemon/mesh/nodelink.h promises its owner: a frame
 * goes to ops->frame, or to hello_first_frame while an accepted link has no
 * owner; a frame announced with nodelink_expect_blobs goes to ops->blob; a
 * link the wing closed or handed over calls it no more.  What the wing
 * sends is decoded with nodemsg_parse, as the daemon at the other end
 * would read it.
 */
#include <check.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "proto/wire.h"
#include "shardport.h"
#include "tests/unit/mesh/fakewing.h"

struct fake F;

/* ---- links (nodelink.c's place) ---- */

static struct nodelink *link_new(const char *peer) {
  struct nodelink *l = calloc(1, sizeof *l);
  ck_assert_ptr_nonnull(l);
  snprintf(l->peer, sizeof l->peer, "%s", peer);
  l->next = F.links;
  F.links = l;
  return l;
}

static void record(struct nodelink *l, const struct fake_sent *s) {
  if (l->nsent == l->cap) {
    l->cap = l->cap > 0 ? 2 * l->cap : 16;
    l->sent = realloc(l->sent, l->cap * sizeof *l->sent);
    ck_assert_ptr_nonnull(l->sent);
  }
  l->sent[l->nsent++] = *s;
}

/* Decodes a frame's payload as a peer would, and hands it to fn. */
static void decode(const uint8_t *payload, size_t len,
                   void (*fn)(void *arg, const struct sp_msg_head *head,
                              const msgpack_object *map),
                   void *arg) {
  struct sp_limits limits;
  sp__limits_default(&limits);
  limits.max_fds = 0;
  msgpack_zone zone;
  ck_assert(msgpack_zone_init(&zone, MSGPACK_ZONE_CHUNK_SIZE));
  msgpack_object map;
  struct sp_msg_head head;
  ck_assert_int_eq(sp__wire_decode(payload, len, &limits, &zone, &map), 0);
  ck_assert_int_eq(sp__msg_head(&map, &head), 0);
  fn(arg, &head, &map);
  msgpack_zone_destroy(&zone);
}

static void record_decoded(void *arg, const struct sp_msg_head *head,
                           const msgpack_object *map) {
  struct fake_sent s = {.is_blob = false};
  char why[256];
  ck_assert_msg(nodemsg_parse(head, map, &s.m, why, sizeof why) == 0,
                "the wing sent a %s that does not parse: %s", head->op, why);
  record(arg, &s);
}

int nodelink_connect(struct server *srv, const char *addr,
                     const struct nodelink_ops *ops, void *arg,
                     struct nodelink **out) {
  ck_assert_ptr_eq(srv, &F.srv);
  struct nodelink *l = link_new(addr);
  l->dialled = true;
  l->ops = ops;
  l->arg = arg;
  *out = l;
  return 0;
}

void nodelink_set_ops(struct nodelink *l, const struct nodelink_ops *ops,
                      void *arg) {
  l->ops = ops;
  l->arg = arg;
}

void nodelink_hello_done(struct nodelink *l) { l->identified = true; }

void nodelink_await(struct nodelink *l, bool waiting) {
  l->awaiting = waiting;
}

uint8_t *nodelink_handshake(struct nodelink *l) { return l->handshake; }

void nodelink_count_into(
    struct nodelink *l, struct metrics_bytes *const counts[NODELINK_COUNTERS]) {
  memcpy(l->counts, counts, sizeof l->counts);
}

void nodelink_expect_blobs(struct nodelink *l, uint32_t n) {
  l->expect_blobs = n;
}

int nodelink_send(struct nodelink *l, struct sp_msgbuf *mb) {
  struct sp_frame_tx tx;
  ck_assert_int_eq(sp__msgbuf_finish(mb, &tx), 0);
  ck_assert_msg(!l->closed && !l->closing, "a frame sent on a closed link");
  decode(tx.buf + SP_FRAME_HEADER, tx.len - SP_FRAME_HEADER, record_decoded,
         l);
  free(tx.buf);
  return 0;
}

int nodelink_send_blob(struct nodelink *l, struct nodeblob *b) {
  ck_assert_msg(!l->closed && !l->closing, "a blob sent on a closed link");
  record(l, &(struct fake_sent){.is_blob = true, .blob = nodeblob_ref(b)});
  return 0;
}

int nodelink_send_error(struct nodelink *l, int code, const char *message) {
  struct fake_sent s = {.m = {.op = NODEMSG_ERROR, .code = code}};
  snprintf(s.m.message, sizeof s.m.message, "%s", message);
  record(l, &s);
  return 0;
}

void nodelink_close(struct nodelink *l) {
  if (l == NULL)
    return;
  l->closed = true;
  l->ops = NULL;
  l->detach_fn = NULL;
}

void nodelink_close_after_flush(struct nodelink *l) {
  l->closing = true;
  l->ops = NULL;
}

void nodelink_detach(struct nodelink *l, void (*fn)(void *arg, int sock),
                     void *arg) {
  l->closing = true;
  l->ops = NULL;
  l->detach_fn = fn;
  l->detach_arg = arg;
}

const char *nodelink_peer(const struct nodelink *l) { return l->peer; }

struct nodelink *fake_accept(void) { return link_new("10.0.0.9:40000"); }

struct nodelink *fake_dialled(const char *addr, size_t nth) {
  for (struct nodelink *l = F.links; l != NULL; l = l->next)
    if (l->dialled && strcmp(l->peer, addr) == 0 && nth-- == 0)
      return l;
  return NULL;
}

static void dispatch(void *arg, const struct sp_msg_head *head,
                     const msgpack_object *map) {
  struct nodelink *l = arg;
  if (l->ops != NULL && l->ops->frame != NULL)
    l->ops->frame(l, l->arg, head, map);
  else
    hello_first_frame(&F.srv, l, head, map);
}

void fake_deliver(struct nodelink *l, const struct nodemsg *m) {
  ck_assert_msg(!l->closed && !l->closing, "a frame on a closed link");
  struct sp_msgbuf mb;
  struct sp_frame_tx tx;
  nodemsg_pack(m, &mb);
  ck_assert_int_eq(sp__msgbuf_finish(&mb, &tx), 0);
  decode(tx.buf + SP_FRAME_HEADER, tx.len - SP_FRAME_HEADER, dispatch, l);
  free(tx.buf);
}

void fake_deliver_blob(struct nodelink *l, const uint8_t *bytes, size_t len) {
  ck_assert_uint_gt(l->expect_blobs, 0);
  ck_assert(l->ops != NULL && l->ops->blob != NULL);
  uint8_t *mem = malloc(len > 0 ? len : 1);
  ck_assert_ptr_nonnull(mem);
  memcpy(mem, bytes, len);
  struct nodeblob *b = nodeblob_wrap(mem, mem, len);
  ck_assert_ptr_nonnull(b);
  l->expect_blobs--;
  l->ops->blob(l, l->arg, b);
}

void fake_detach(struct nodelink *l, int sock) {
  ck_assert_ptr_nonnull(l->detach_fn);
  void (*fn)(void *, int) = l->detach_fn;
  l->detach_fn = NULL;
  l->closed = true;
  fn(l->detach_arg, sock);
}

void fake_close(struct nodelink *l, int code) {
  const struct nodelink_ops *ops = l->ops;
  void *arg = l->arg;
  l->closed = true;
  l->ops = NULL;
  if (ops != NULL && ops->closed != NULL)
    ops->closed(l, arg, code);
}

const struct nodemsg *fake_last(const struct nodelink *l, enum nodemsg_op op) {
  for (size_t i = l->nsent; i-- > 0;)
    if (!l->sent[i].is_blob && l->sent[i].m.op == op)
      return &l->sent[i].m;
  return NULL;
}

size_t fake_count(const struct nodelink *l, enum nodemsg_op op) {
  size_t n = 0;
  for (size_t i = 0; i < l->nsent; i++)
    n += !l->sent[i].is_blob && l->sent[i].m.op == op;
  return n;
}

const struct nodeblob *fake_blob_after(const struct nodelink *l,
                                       enum nodemsg_op op, size_t i) {
  size_t at = l->nsent;
  while (at-- > 0)
    if (!l->sent[at].is_blob && l->sent[at].m.op == op)
      break;
  ck_assert_uint_lt(at, l->nsent);
  ck_assert_uint_lt(at + 1 + i, l->nsent);
  ck_assert(l->sent[at + 1 + i].is_blob);
  return l->sent[at + 1 + i].blob;
}

/* ---- client connections (conn.c's place) ---- */

struct conn *fake_conn(void) {
  struct conn *c = calloc(1, sizeof *c);
  ck_assert_ptr_nonnull(c);
  c->id = ++F.next_conn;
  c->next = F.conns;
  F.conns = c;
  return c;
}

struct server *conn_server(const struct conn *c) {
  (void)c;
  return &F.srv;
}

uid_t conn_uid(const struct conn *c) {
  (void)c;
  return 1000;
}

uint64_t conn_id(const struct conn *c) { return c->id; }

struct conn *conn_find(const struct server *srv, uint64_t id) {
  (void)srv;
  for (struct conn *c = F.conns; c != NULL; c = c->next)
    if (c->id == id)
      return c;
  return NULL;
}

struct job_member *conn_member(const struct conn *c) { return c->member; }

int conn_send_error(struct conn *c, uint64_t id, int code, const char *fmt,
                    ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(c->error, sizeof c->error, fmt, ap);
  va_end(ap);
  c->nerrors++;
  c->error_id = id;
  c->error_code = code;
  return 0;
}

/* ---- jobs and exports (struct mesh_ops) ---- */

static struct job *job_make(const uint8_t *id, const uint8_t *secret,
                            uint32_t world) {
  ck_assert_uint_lt(F.njobs, sizeof F.jobs / sizeof F.jobs[0]);
  ck_assert_uint_le(world, sizeof F.departed / sizeof F.departed[0]);
  struct job *job = calloc(1, sizeof *job);
  ck_assert_ptr_nonnull(job);
  job->srv = &F.srv;
  job->world = world;
  memcpy(job->id, id, JOB_ID_BYTES);
  memcpy(job->secret, secret, JOB_SECRET_BYTES);
  for (int i = 0; i < JOB_ID_BYTES; i++)
    snprintf(job->hex + 2 * i, 3, "%02x", id[i]);
  job->members = calloc(world, sizeof *job->members);
  ck_assert_ptr_nonnull(job->members);
  F.jobs[F.njobs++] = job;
  F.srv.njobs++;
  return job;
}

struct job *fake_job(uint32_t world, bool root) {
  uint8_t id[JOB_ID_BYTES], secret[JOB_SECRET_BYTES];
  for (int i = 0; i < JOB_ID_BYTES; i++)
    id[i] = (uint8_t)(0x10 * (F.njobs + 1) + i);
  for (int i = 0; i < JOB_SECRET_BYTES; i++)
    secret[i] = (uint8_t)(0xa0 + i);
  struct job *job = job_make(id, secret, world);
  if (root)
    ck_assert_int_eq(mesh_create_root(job), 0);
  return job;
}

struct job_member *fake_member(struct job *job, uint32_t rank) {
  struct job_member *m = calloc(1, sizeof *m);
  ck_assert_ptr_nonnull(m);
  m->job = job;
  m->rank = rank;
  registry_init(&m->reg, SP_DEVICE_CPU);
  job->members[rank] = m;
  job->joined++;
  job->ever_joined = true;
  return m;
}

void fake_ask(struct job_member *m, uint32_t max_keys, uint32_t timeout_ms) {
  m->asked = true;
  m->ask_id = 100 + m->rank;
  m->ask.max_keys = max_keys;
  m->ask.timeout_ms = timeout_ms;
  m->asked_ms = F.now;
  m->ask_deadline_ms =
      F.now + (timeout_ms > 0 ? timeout_ms : F.cfg.export_timeout_ms);
}

static uint64_t fake_now(void) { return F.now; }

static void fake_wake(struct job *job) {
  (void)job;
  F.wakes++;
}

static void fake_schedule(struct job *job) { (void)job; }

static void fake_end(struct job *job) {
  (void)job;
  F.ends++;
}

static void fake_terminate(struct job *job, int code, const char *message) {
  (void)job;
  (void)message;
  F.terminates++;
  F.terminate_code = code;
}

static struct job *fake_find(const struct server *srv, const struct job *prev,
                             const uint8_t *id) {
  (void)srv;
  bool past = prev == NULL;
  for (size_t i = 0; i < F.njobs; i++) {
    if (!past) {
      past = F.jobs[i] == prev;
      continue;
    }
    if (memcmp(F.jobs[i]->id, id, JOB_ID_BYTES) == 0)
      return F.jobs[i];
  }
  return NULL;
}

static struct job *fake_shadow(struct server *srv, const uint8_t *id,
                               const uint8_t *secret, uint32_t world) {
  (void)srv;
  return job_make(id, secret, world);
}

static struct job_member *fake_admit(struct job *job, struct conn *c,
                                     uint64_t request_id,
                                     const struct req_join *req, int device) {
  (void)request_id;
  (void)device;
  F.admits++;
  struct job_member *m = fake_member(job, req->rank);
  m->conn = c;
  c->member = m;
  return m;
}

static void fake_note_joined(struct job *job) { job->ever_joined = true; }

static void fake_rank_departed(struct job *job, uint32_t rank,
                               bool disconnected, const char *reason) {
  (void)job;
  (void)disconnected;
  F.departed[rank] = true;
  snprintf(F.departed_reason[rank], sizeof F.departed_reason[rank], "%s",
           reason != NULL ? reason : "");
}

static void fake_rank_returned(struct job *job, uint32_t rank) {
  (void)job;
  F.returned++;
  F.departed[rank] = false;
}

static bool fake_departed(const struct job *job, char *buf, size_t len) {
  for (uint32_t r = 0; r < job->world; r++)
    if (F.departed[r]) {
      snprintf(buf, len, "rank %u left job %s", r, job->hex);
      return true;
    }
  return false;
}

static void fake_departure_text(const struct job *job, uint32_t rank,
                                bool disconnected, const char *when,
                                const char *reason, char *buf, size_t len) {
  (void)reason;
  snprintf(buf, len, "rank %u %s job %s%s", rank,
           disconnected ? "disconnected from" : "left", job->hex, when);
}

static void fake_answer_ask(struct job_member *m, int code,
                            const char *message) {
  (void)message;
  m->asked = false;
  F.answers++;
  F.answer_code = code;
}

static int fake_start(struct job *job, struct mesh_export *mx,
                      uint64_t export_id, const struct gather_options *o,
                      char *msg, size_t msglen) {
  F.starts++;
  if (F.start_rc != 0) {
    snprintf(msg, msglen, "the export cannot start");
    return F.start_rc;
  }
  /* The export owns mx from here; the test frees it at its end. */
  ck_assert_ptr_null(F.mx);
  F.mx = mx;
  F.start_id = export_id;
  F.start_keys = o->max_keys;
  F.start_bytes = o->max_bytes;
  F.start_timeout = o->timeout_ms;
  for (uint32_t r = 0; r < job->world; r++)
    if (job->members[r] != NULL && job->members[r]->asked) {
      job->members[r]->asked = false;
      job->members[r]->in_export = true;
    }
  return 0;
}

static void fake_go(struct job *job, const struct replica_differ *differ) {
  (void)job;
  F.gos++;
  F.go_differ = differ != NULL;
}

static void fake_publish(struct job *job) {
  (void)job;
  F.publishes++;
}

static void fake_fail(struct job *job, int code, const char *message) {
  (void)job;
  F.fails++;
  F.fail_code = code;
  snprintf(F.fail_msg, sizeof F.fail_msg, "%s", message);
}

static void fake_fail_asks(struct job *job, int code, const char *message) {
  F.fail_asks++;
  F.fail_asks_code = code;
  snprintf(F.fail_asks_msg, sizeof F.fail_asks_msg, "%s", message);
  for (uint32_t r = 0; r < job->world; r++)
    if (job->members[r] != NULL)
      job->members[r]->asked = false;
}

static void fake_commit(struct job *job, uint32_t step) {
  (void)job;
  F.committed = step;
}

static bool fake_any_asked(const struct job *job) {
  for (uint32_t r = 0; r < job->world; r++)
    if (job->members[r] != NULL && job->members[r]->asked)
      return true;
  return false;
}

static const struct mesh_ops fake_ops = {
    .now_ms = fake_now,
    .wake = fake_wake,
    .schedule = fake_schedule,
    .end = fake_end,
    .terminate = fake_terminate,
    .find = fake_find,
    .shadow = fake_shadow,
    .admit = fake_admit,
    .note_joined = fake_note_joined,
    .rank_departed = fake_rank_departed,
    .rank_returned = fake_rank_returned,
    .departed = fake_departed,
    .departure_text = fake_departure_text,
    .answer_ask = fake_answer_ask,
    .start = fake_start,
    .go = fake_go,
    .publish = fake_publish,
    .fail = fake_fail,
    .fail_asks = fake_fail_asks,
    .any_asked = fake_any_asked,
    .commit = fake_commit,
};

/* ---- the daemon ---- */

void fake_setup(void) {
  memset(&F, 0, sizeof F);
  log_init(LOG_LEVEL_ERROR);
  config_default(&F.cfg);
  F.srv.cfg = &F.cfg;
  F.srv.backend = &F.backend;
  F.srv.mesh_ops = &fake_ops;
  F.srv.node_id = 1;
  F.srv.metrics = metrics_new("fake", "the wing's unit tests", NULL, NULL);
  ck_assert_ptr_nonnull(F.srv.metrics);
  /* Any descriptor number: the wing only asks whether peers are heard. */
  F.srv.peer_fd = 1000;
  snprintf(F.srv.peer_address, sizeof F.srv.peer_address, "10.0.0.1:7000");
  F.now = 1000;
}

void fake_teardown(void) {
  /* The export owned its part of the mesh (fake_start). */
  mesh_export_free(F.mx);
  for (size_t i = 0; i < F.njobs; i++) {
    struct job *job = F.jobs[i];
    mesh_free(job->mesh);
    for (uint32_t r = 0; r < job->world; r++) {
      if (job->members[r] == NULL)
        continue;
      registry_free(&job->members[r]->reg);
      free(job->members[r]);
    }
    free(job->members);
    if (job->owner != NULL)
      quota_release(job->owner, QUOTA_JOB);
    free(job);
  }
  while (F.links != NULL) {
    struct nodelink *l = F.links;
    F.links = l->next;
    for (size_t i = 0; i < l->nsent; i++) {
      if (l->sent[i].is_blob)
        nodeblob_unref(l->sent[i].blob);
      else
        nodemsg_free(&l->sent[i].m);
    }
    free(l->sent);
    free(l);
  }
  while (F.conns != NULL) {
    struct conn *c = F.conns;
    F.conns = c->next;
    free(c);
  }
  ck_assert_ptr_null(F.srv.users);
  metrics_free(F.srv.metrics);
}
