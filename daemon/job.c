/*
 * job.c - the job table: creating a job and its ticket, ranks joining and
 * leaving with their connections, their registrations, and the job's end.
 *
 * A job is `world` ranks that export together, again and again: its members
 * and their registrations (and the last plan, export.c) stay until the
 * ranks leave, and the job ends when its last rank has left, or when no
 * rank joins it within job_timeout.
 *
 * Lost ranks: a connection that closes only marks its member lost and wakes
 * the job (conn_close may run deep inside another reply's write, where the
 * job must not change under its caller).  The job's wake-up then fails what
 * the rank took part in, and frees the member once no engine thread reads
 * its storages any more.  Everything that changes a job runs on the loop.
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>

#include "daemon/daemon.h"
#include "daemon/pool.h"
#include "shardport.h"

/* While an export is gathered or runs, the tick watches deadlines and sends
 * progress this often. */
#define JOB_TICK_MS 50

uint64_t job_now_ms(void) { return uv_hrtime() / 1000000u; }

static int random_bytes(uint8_t *buf, size_t len) {
  size_t got = 0;
  while (got < len) {
    ssize_t n = getrandom(buf + got, len - got, 0);
    if (n < 0)
      return SP_EINTERNAL;
    got += (size_t)n;
  }
  return 0;
}

/* Compares secrets in time independent of where they first differ, so a
 * peer cannot find a job's secret byte by byte from reply times. */
static bool secret_equal(const uint8_t *a, const uint8_t *b, size_t len) {
  volatile uint8_t diff = 0;
  for (size_t i = 0; i < len; i++)
    diff |= (uint8_t)(a[i] ^ b[i]);
  return diff == 0;
}

static struct job *find_job(const struct server *srv, const uint8_t *id) {
  for (struct job *j = srv->jobs; j != NULL; j = j->next)
    if (memcmp(j->id, id, JOB_ID_BYTES) == 0)
      return j;
  return NULL;
}

static void on_job_handle_closed(uv_handle_t *handle) {
  struct job *job = handle->data;
  if (--job->open_handles > 0)
    return;
  free(job->members);
  free(job);
}

/* Frees the member's published exports, returning their pool memory. */
static void member_release_all(struct job_member *m) {
  struct pool *pool = m->job->srv->pool;
  while (m->published != NULL) {
    struct job_published *p = m->published;
    m->published = p->next;
    pool_segment_free(pool, p->segment);
    free(p);
  }
}

static void member_free(struct job_member *m) {
  member_release_all(m);
  request_groups_free(&m->ask.groups);
  registry_free(&m->reg);
  if (m->conn != NULL)
    conn_set_member(m->conn, NULL);
  free(m);
}

/* Takes the job off the table and frees it; no thread may use it. */
static void job_destroy(struct job *job) {
  struct server *srv = job->srv;
  for (struct job **p = &srv->jobs; *p != NULL; p = &(*p)->next)
    if (*p == job) {
      *p = job->next;
      break;
    }
  srv->njobs--;
  log_msg(LOG_LEVEL_INFO, "job %s: ended", job->hex);
  for (uint32_t r = 0; r < job->world; r++)
    if (job->members[r] != NULL) {
      member_free(job->members[r]);
      job->members[r] = NULL;
    }
  export_drop_cache(job);
  uv_close((uv_handle_t *)&job->tick, on_job_handle_closed);
  uv_close((uv_handle_t *)&job->wake, on_job_handle_closed);
}

void job_answer_ask(struct job_member *m, int code, const char *message) {
  if (!m->asked)
    return;
  m->asked = false;
  request_groups_free(&m->ask.groups);
  if (m->conn != NULL)
    conn_send_error(m->conn, m->ask_id, code, "%s", message);
}

/* Lost members are failed out of what they take part in once, then freed
 * when no thread reads their storages. */
static void process_lost(struct job *job) {
  for (uint32_t r = 0; r < job->world; r++) {
    struct job_member *m = job->members[r];
    if (m != NULL && m->lost)
      export_member_lost(job, m);
  }
}

static void free_lost(struct job *job) {
  if (export_busy(job))
    return;
  for (uint32_t r = 0; r < job->world; r++) {
    struct job_member *m = job->members[r];
    if (m == NULL || !m->lost)
      continue;
    log_msg(LOG_LEVEL_INFO, "job %s: rank %u %s", job->hex, r,
            m->disconnected ? "disconnected" : "left");
    member_free(m);
    job->members[r] = NULL;
    job->joined--;
    export_drop_cache(job);
  }
}

static void on_wake(uv_async_t *handle) {
  struct job *job = handle->data;
  process_lost(job);
  export_advance(job);
  free_lost(job);
  if ((job->dying || (job->ever_joined && job->joined == 0)) &&
      !export_busy(job)) {
    job_destroy(job);
    return;
  }
  job_schedule(job);
}

void job_wake(struct job *job) { uv_async_send(&job->wake); }

static void on_tick(uv_timer_t *timer) {
  struct job *job = timer->data;
  if (!job->ever_joined) {
    log_msg(LOG_LEVEL_INFO, "job %s: no rank joined within job_timeout",
            job->hex);
    job->ticking = false;
    job_destroy(job);
    return;
  }
  export_tick(job);
  job_schedule(job);
}

void job_schedule(struct job *job) {
  if (!job->ever_joined || job->dying)
    return;
  bool active = job->running != NULL;
  for (uint32_t r = 0; r < job->world && !active; r++)
    active = job->members[r] != NULL && job->members[r]->asked;
  if (active && !job->ticking) {
    uv_timer_start(&job->tick, on_tick, JOB_TICK_MS, JOB_TICK_MS);
    job->ticking = true;
  } else if (!active && job->ticking) {
    uv_timer_stop(&job->tick);
    job->ticking = false;
  }
}

void job_conn_closed(struct job_member *m) {
  m->conn = NULL;
  m->lost = true;
  m->disconnected = true;
  job_wake(m->job);
}

void job_shutdown(struct server *srv) {
  for (struct job *job = srv->jobs; job != NULL; job = job->next) {
    job->dying = true;
    for (uint32_t r = 0; r < job->world; r++)
      if (job->members[r] != NULL)
        job->members[r]->lost = true;
    if (job->ticking) {
      uv_timer_stop(&job->tick);
      job->ticking = false;
    }
    job_wake(job);
  }
}

/* {"v":1,"job":<bin>,"secret":<bin>,"world":W} (docs/protocol.md). */
static int ticket_pack(const struct job *job, msgpack_sbuffer *sb) {
  msgpack_packer pk;
  msgpack_sbuffer_init(sb);
  msgpack_packer_init(&pk, sb, msgpack_sbuffer_write);
  msgpack_pack_map(&pk, 4);
  sp_pack_kv_u64(&pk, "v", 1);
  sp_pack_str(&pk, "job");
  sp_pack_bin(&pk, job->id, JOB_ID_BYTES);
  sp_pack_str(&pk, "secret");
  sp_pack_bin(&pk, job->secret, JOB_SECRET_BYTES);
  sp_pack_kv_u64(&pk, "world", job->world);
  if (sb->data == NULL || sb->size > SP_TICKET_MAX) {
    msgpack_sbuffer_destroy(sb);
    return SP_ENOMEM;
  }
  return 0;
}

int job_op_create(struct conn *c, const struct sp_msg_head *head,
                  const msgpack_object *map, struct sp_frame *frame) {
  (void)frame;
  struct server *srv = conn_server(c);
  struct req_job_create req;
  char msg[256];
  int rc = request_parse_job_create(map, &req, msg, sizeof msg);
  if (rc != 0)
    return conn_send_error(c, head->id, rc, "job_create: %s", msg);
  if (srv->njobs >= srv->cfg->max_jobs)
    return conn_send_error(c, head->id, SP_ELIMIT,
                           "job_create: %" PRIu32 " jobs exist, the most "
                           "max_jobs allows",
                           srv->cfg->max_jobs);
  struct job *job = calloc(1, sizeof *job);
  struct job_member **members = calloc(req.world, sizeof *members);
  if (job == NULL || members == NULL ||
      random_bytes(job->id, JOB_ID_BYTES) != 0 ||
      random_bytes(job->secret, JOB_SECRET_BYTES) != 0) {
    free(job);
    free(members);
    return conn_send_error(c, head->id, SP_ENOMEM,
                           "job_create: cannot make a job");
  }
  job->srv = srv;
  job->members = members;
  job->world = req.world;
  job->next_export_id = 1;
  for (size_t i = 0; i < JOB_ID_BYTES; i++)
    snprintf(job->hex + 2 * i, 3, "%02x", job->id[i]);
  msgpack_sbuffer ticket;
  if (ticket_pack(job, &ticket) != 0) {
    free(job);
    free(members);
    return conn_send_error(c, head->id, SP_ENOMEM,
                           "job_create: cannot make a ticket");
  }
  uv_timer_init(srv->loop, &job->tick);
  uv_async_init(srv->loop, &job->wake, on_wake);
  job->tick.data = job;
  job->wake.data = job;
  job->open_handles = 2;
  /* A job nobody joins would stay forever: it has job_timeout. */
  uv_timer_start(&job->tick, on_tick, srv->cfg->job_timeout_ms, 0);
  job->ticking = true;
  job->next = srv->jobs;
  srv->jobs = job;
  srv->njobs++;
  log_msg(LOG_LEVEL_INFO, "job %s: created for %" PRIu32 " ranks", job->hex,
          job->world);

  struct sp_msgbuf mb;
  sp_msgbuf_begin(&mb, "job_create", head->id, 2);
  sp_pack_kv_str(&mb.pk, "job_id", job->hex);
  sp_pack_str(&mb.pk, "ticket");
  sp_pack_bin(&mb.pk, ticket.data, ticket.size);
  msgpack_sbuffer_destroy(&ticket);
  return conn_send_msgbuf(c, &mb);
}

int job_op_join(struct conn *c, const struct sp_msg_head *head,
                const msgpack_object *map, struct sp_frame *frame) {
  (void)frame;
  struct server *srv = conn_server(c);
  struct job_member *have = conn_member(c);
  if (have != NULL)
    return conn_send_error(c, head->id, SP_ESTATE,
                           "join: this connection is already rank %" PRIu32
                           " of job %s",
                           have->rank, have->job->hex);
  struct req_join req;
  struct req_ticket ticket;
  char msg[256];
  int rc = request_parse_join(map, &req, msg, sizeof msg);
  if (rc != 0)
    return conn_send_error(c, head->id, rc, "join: %s", msg);
  if (request_parse_ticket(req.ticket, req.ticket_len, &srv->cfg->limits,
                           &ticket) != 0)
    return conn_send_error(c, head->id, SP_ETICKET,
                           "join: the ticket is not a shardport job ticket");
  struct job *job = find_job(srv, ticket.job);
  if (job == NULL || job->dying)
    return conn_send_error(c, head->id, SP_ETICKET,
                           "join: no job of this ticket on this daemon (it "
                           "ended, or was never created here)");
  if (!secret_equal(ticket.secret, job->secret, JOB_SECRET_BYTES) ||
      ticket.world != job->world)
    return conn_send_error(c, head->id, SP_ETICKET,
                           "join: the ticket's secret does not match job %s",
                           job->hex);
  if (req.world != job->world)
    return conn_send_error(c, head->id, SP_ERANK,
                           "join: world %" PRIu32 " differs from job %s's "
                           "world %" PRIu32,
                           req.world, job->hex, job->world);
  if (req.rank >= job->world)
    return conn_send_error(c, head->id, SP_ERANK,
                           "join: rank %" PRIu32 " is not below the world "
                           "size %" PRIu32,
                           req.rank, job->world);
  if (job->members[req.rank] != NULL)
    return conn_send_error(c, head->id, SP_ERANK,
                           "join: rank %" PRIu32 " of job %s has already "
                           "joined%s",
                           req.rank, job->hex,
                           job->members[req.rank]->lost
                               ? " (it is leaving; try again shortly)"
                               : "");
  if (req.device_type != SP_DEVICE_CPU)
    return conn_send_error(c, head->id, SP_EBACKEND,
                           "join: device \"%s\" needs the CUDA backend; this "
                           "daemon serves the %s backend",
                           req.device, srv->backend->active);
  struct job_member *m = calloc(1, sizeof *m);
  if (m == NULL)
    return conn_send_error(c, head->id, SP_ENOMEM, "join: out of memory");
  m->job = job;
  m->conn = c;
  m->rank = req.rank;
  registry_init(&m->reg, req.device_type);
  job->members[req.rank] = m;
  job->joined++;
  conn_set_member(c, m);
  if (!job->ever_joined) {
    job->ever_joined = true;
    uv_timer_stop(&job->tick);
    job->ticking = false;
  }
  export_drop_cache(job);
  log_msg(LOG_LEVEL_INFO,
          "job %s: rank %" PRIu32 " joined (%" PRIu32 " of %" PRIu32 ")",
          job->hex, req.rank, job->joined, job->world);
  struct sp_msgbuf mb;
  sp_msgbuf_begin(&mb, "join", head->id, 1);
  sp_pack_kv_str(&mb.pk, "job_id", job->hex);
  rc = conn_send_msgbuf(c, &mb);
  /* An export may have waited for this rank's registrations only. */
  job_wake(job);
  return rc;
}

int job_op_leave(struct conn *c, const struct sp_msg_head *head,
                 const msgpack_object *map, struct sp_frame *frame) {
  (void)map;
  (void)frame;
  struct job_member *m = conn_member(c);
  if (m == NULL)
    return conn_send_error(c, head->id, SP_ESTATE,
                           "leave: this connection is not in a job");
  /* The leaver's own pending export hears the same error as its peers. */
  m->lost = true;
  export_member_lost(m->job, m);
  conn_set_member(c, NULL);
  m->conn = NULL;
  job_wake(m->job);
  struct sp_msgbuf mb;
  sp_msgbuf_begin(&mb, "leave", head->id, 0);
  return conn_send_msgbuf(c, &mb);
}

/* A registration needs a member, and no export running on its storages. */
static struct job_member *registering_member(struct conn *c, uint64_t id,
                                             const char *op) {
  struct job_member *m = conn_member(c);
  if (m == NULL) {
    conn_send_error(c, id, SP_ESTATE, "%s: join a job first", op);
    return NULL;
  }
  if (m->job->running != NULL) {
    conn_send_error(c, id, SP_EEXPORTING,
                    "%s: job %s is running an export; register before or "
                    "after it",
                    op, m->job->hex);
    return NULL;
  }
  return m;
}

int job_op_storage_add(struct conn *c, const struct sp_msg_head *head,
                       const msgpack_object *map, struct sp_frame *frame) {
  struct job_member *m = registering_member(c, head->id, "storage_add");
  if (m == NULL)
    return 0;
  struct req_storage *s;
  size_t n;
  char msg[512];
  int rc = request_parse_storages(map, frame->nfds, &s, &n, msg, sizeof msg);
  if (rc == 0) {
    rc = registry_add_storages(&m->reg, s, n, frame, msg, sizeof msg);
    free(s);
  }
  if (rc != 0)
    return conn_send_error(c, head->id, rc, "storage_add: %s", msg);
  export_drop_cache(m->job);
  struct sp_msgbuf mb;
  sp_msgbuf_begin(&mb, "storage_add", head->id, 1);
  sp_pack_kv_u64(&mb.pk, "count", n);
  return conn_send_msgbuf(c, &mb);
}

int job_op_tensor_add(struct conn *c, const struct sp_msg_head *head,
                      const msgpack_object *map, struct sp_frame *frame) {
  (void)frame;
  struct job_member *m = registering_member(c, head->id, "tensor_add");
  if (m == NULL)
    return 0;
  struct req_tensor *t;
  size_t n;
  char msg[512];
  int rc = request_parse_tensors(map, &t, &n, msg, sizeof msg);
  if (rc == 0) {
    rc = registry_add_tensors(&m->reg, t, n, msg, sizeof msg);
    request_tensors_free(t, n);
  }
  if (rc != 0)
    return conn_send_error(c, head->id, rc, "tensor_add: %s", msg);
  export_drop_cache(m->job);
  struct sp_msgbuf mb;
  sp_msgbuf_begin(&mb, "tensor_add", head->id, 1);
  sp_pack_kv_u64(&mb.pk, "count", n);
  return conn_send_msgbuf(c, &mb);
}

void job_status_pack(const struct server *srv, msgpack_packer *pk) {
  msgpack_pack_array(pk, srv->njobs);
  for (const struct job *job = srv->jobs; job != NULL; job = job->next) {
    struct export_view v;
    uint32_t joined = 0, asked = 0;
    export_view(job, &v);
    for (uint32_t r = 0; r < job->world; r++) {
      const struct job_member *m = job->members[r];
      joined += m != NULL && !m->lost;
      asked += m != NULL && !m->lost && m->asked;
    }
    bool failed = v.phase == JOB_FAILED;
    msgpack_pack_map(pk, failed ? 13 : 12);
    sp_pack_kv_str(pk, "job_id", job->hex);
    sp_pack_kv_str(pk, "phase", export_phase_name(v.phase));
    if (failed)
      sp_pack_kv_str(pk, "error", job->error);
    sp_pack_kv_u64(pk, "world", job->world);
    sp_pack_kv_u64(pk, "joined", joined);
    sp_pack_kv_u64(pk, "asked", asked);
    sp_pack_kv_u64(pk, "export_id", v.export_id);
    sp_pack_kv_u64(pk, "round", v.round);
    sp_pack_kv_u64(pk, "rounds", v.rounds);
    sp_pack_kv_u64(pk, "bytes_moved", v.bytes_moved);
    sp_pack_kv_u64(pk, "bytes_total", v.bytes_total);
    sp_pack_kv_f64(pk, "rate_bps", v.rate_bps);
    sp_pack_kv_u64(pk, "pool_used", v.pool_used);
  }
}
