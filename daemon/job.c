/*
 * job.c - the job table: creating a job and its ticket, ranks joining and
 * leaving with their connections, their registrations, and the job's end.
 *
 * A job is `world` ranks that export together, again and again: its members
 * and their registrations (and the last plan, plancache.c) stay until the
 * ranks leave, and the job ends when its last rank has left, or when no
 * rank joins it within job_timeout.
 *
 * Lost ranks: a connection that closes only marks its member lost and wakes
 * the job (conn_close may run deep inside another reply's write, where the
 * job must not change under its caller).  The job's wake-up then fails what
 * the rank took part in, and frees the member once no engine thread reads
 * its storages any more.  Everything that changes a job runs on the loop.
 *
 * A job cannot export without every one of its ranks, so it remembers each
 * rank that left (with why, when the daemon knows: its refused
 * registration) until that rank joins again: an export its ranks ask for
 * meanwhile fails at once with rank_lost, never after a timeout.
 */
#include <fcntl.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "daemon/comms.h"
#include "daemon/conn.h"
#include "daemon/consumer.h"
#include "daemon/export.h"
#include "daemon/history.h"
#include "daemon/job.h"
#include "daemon/log.h"
#include "daemon/mesh/mesh.h"
#include "daemon/peer.h"
#include "daemon/plancache.h"
#include "daemon/pool.h"
#include "daemon/push.h"
#include "daemon/quota.h"
#include "daemon/registry.h"
#include "daemon/request.h"
#include "daemon/server.h"
#include "proto/monotonic.h"
#include "shardport.h"

/* While an export is gathered or runs, the tick watches deadlines and sends
 * progress this often. */
#define JOB_TICK_MS 50

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

struct job *job_find(const struct server *srv, const struct job *prev,
                     const uint8_t *id) {
  for (struct job *j = prev != NULL ? prev->next : srv->jobs; j != NULL;
       j = j->next)
    if (memcmp(j->id, id, JOB_ID_BYTES) == 0)
      return j;
  return NULL;
}

/* The job a ticket names: of its id and secret (every job of the id is
 * compared, in constant time); with *same_id whether a job of that id
 * exists at all. */
static struct job *find_ticket(const struct server *srv,
                               const struct req_ticket *t, bool *same_id) {
  struct job *found = NULL;
  *same_id = false;
  for (struct job *j = job_find(srv, NULL, t->job); j != NULL;
       j = job_find(srv, j, t->job)) {
    *same_id = true;
    if (secret_equal(t->secret, j->secret, JOB_SECRET_BYTES))
      found = j;
  }
  return found;
}

struct job *job_find_ticket(const struct server *srv,
                            const struct req_ticket *t) {
  bool same_id;
  return find_ticket(srv, t, &same_id);
}

/* Whether a job of this id was created on this daemon (one on this daemon
 * only, or one across nodes rooted here): a shadow of that id would be
 * forged, since the root is here. */
static bool created_here(const struct server *srv, const uint8_t *id) {
  for (struct job *j = job_find(srv, NULL, id); j != NULL;
       j = job_find(srv, j, id))
    if (j->mesh == NULL || mesh_is_root(j->mesh))
      return true;
  return false;
}

static void on_job_handle_closed(uv_handle_t *handle) {
  struct job *job = handle->data;
  if (--job->open_handles > 0)
    return;
  for (uint32_t r = 0; r < job->world; r++)
    free(job->departed[r].reason);
  free(job->departed);
  free(job->members);
  free(job->consumer_departed);
  free(job->consumers);
  free(job);
}

/* Gives back the exports the member never released: the rank may still
 * have them open, so their pool memory stays counted until it let go
 * (pool.h). */
static void member_release_all(struct job_member *m) {
  struct pool *pool = m->job->srv->pool;
  while (m->published != NULL) {
    struct job_published *p = m->published;
    m->published = p->next;
    pool_segment_abandon(pool, p->segment, m->pidfd);
    free(p);
  }
}

static void member_free(struct job_member *m) {
  member_release_all(m);
  if (m->pidfd >= 0)
    close(m->pidfd);
  /* The device segments kept for its next export go now. */
  pool_owner_gone(m->job->srv->pool, m);
  request_groups_free(&m->ask.groups);
  quota_unregister(m->user, &m->reg.used);
  quota_release(m->user, QUOTA_RANK);
  registry_drop(m->job->srv->loop, &m->reg);
  if (m->conn != NULL)
    conn_set_member(m->conn, NULL);
  free(m->refused);
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
  if (job->owner != NULL)
    quota_release(job->owner, QUOTA_JOB);
  log_with(LOG_LEVEL_INFO, LOG_JOB(job->hex), "job %s: ended", job->hex);
  for (uint32_t r = 0; r < job->world; r++)
    if (job->members[r] != NULL) {
      member_free(job->members[r]);
      job->members[r] = NULL;
    }
  plancache_drop(job);
  consumer_free_all(job);
  push_cache_drop(job);
  consumer_files_free(&job->consumer_files);
  history_free(&job->history);
  mesh_free(job->mesh);
  job->mesh = NULL;
  /* Finalized and destroyed (idle peers see a goodbye, not an error), or
   * aborted when that does not finish, on a helper thread: the loop does
   * not wait (docs/gpu.md, Threads). */
  gpu_comms_free(job->gpu_comms);
  job->gpu_comms = NULL;
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

void job_departure_text(const struct job *job, uint32_t rank,
                        bool disconnected, const char *when,
                        const char *reason, char *buf, size_t len) {
  snprintf(buf, len, "rank %" PRIu32 " %s job %s%s%s%s", rank,
           disconnected ? "disconnected from" : "left", job->hex, when,
           reason != NULL ? "; " : "", reason != NULL ? reason : "");
}

void job_rank_departed(struct job *job, uint32_t rank, bool disconnected,
                       const char *reason) {
  struct job_departure *d = &job->departed[rank];
  /* Heard twice (on the root, from its own node's member and then from
   * the mesh), a departure keeps its place in the order. */
  if (!d->gone)
    d->seq = ++job->departures;
  d->gone = true;
  d->disconnected = disconnected;
  free(d->reason);
  /* Without memory, only why is forgotten. */
  d->reason = reason != NULL ? strdup(reason) : NULL;
}

void job_rank_returned(struct job *job, uint32_t rank) {
  struct job_departure *d = &job->departed[rank];
  free(d->reason);
  *d = (struct job_departure){0};
}

bool job_departed(const struct job *job, char *buf, size_t len) {
  uint32_t first = PLAN_NONE;
  for (uint32_t r = 0; r < job->world; r++) {
    const struct job_departure *d = &job->departed[r];
    if (d->gone && (first == PLAN_NONE || d->seq < job->departed[first].seq))
      first = r;
  }
  if (first == PLAN_NONE)
    return false;
  const struct job_departure *d = &job->departed[first];
  job_departure_text(job, first, d->disconnected,
                     ", which cannot export without it", d->reason, buf, len);
  return true;
}

/* A member left or disconnected: the job remembers it, and what it took
 * part in fails (once). */
static void member_departs(struct job_member *m) {
  struct job *job = m->job;
  if (m->lost_handled)
    return;
  if (!job->dying)
    job_rank_departed(job, m->rank, m->disconnected, m->refused);
  export_member_lost(job, m);
  push_member_lost(job, m);
}

/* Lost members are failed out of what they take part in once, then freed
 * when no thread reads their storages. */
static void process_lost(struct job *job) {
  for (uint32_t r = 0; r < job->world; r++) {
    struct job_member *m = job->members[r];
    if (m != NULL && m->lost)
      member_departs(m);
  }
}

static void free_lost(struct job *job) {
  if (export_busy(job) || push_busy(job))
    return;
  for (uint32_t r = 0; r < job->world; r++) {
    struct job_member *m = job->members[r];
    if (m == NULL || !m->lost)
      continue;
    log_with(LOG_LEVEL_INFO,
             &(struct log_fields){
                 .job = job->hex, .rank = r, .node = LOG_NONE},
             "job %s: rank %u %s", job->hex, r,
             m->disconnected ? "disconnected" : "left");
    if (job->mesh != NULL)
      mesh_rank_left(job, r, m->disconnected, m->refused);
    comms_rank_left(job, r);
    member_free(m);
    job->members[r] = NULL;
    job->joined--;
    plancache_drop(job);
    push_cache_drop(job);
  }
}

static void on_wake(uv_async_t *handle) {
  struct job *job = handle->data;
  if (job->mesh != NULL && !job->dying)
    mesh_advance(job);
  process_lost(job);
  consumer_process_lost(job);
  export_advance(job);
  push_advance(job);
  free_lost(job);
  consumer_free_lost(job);
  comms_join(job);
  /* A job across nodes ends on its root once no node holds a rank. */
  if ((job->dying || (job->ever_joined && job->joined == 0 &&
                      (job->mesh == NULL || mesh_may_end(job)))) &&
      !export_busy(job) && !push_busy(job)) {
    job_destroy(job);
    return;
  }
  job_schedule(job);
}

void job_wake(struct job *job) { uv_async_send(&job->wake); }

static void on_tick(uv_timer_t *timer) {
  struct job *job = timer->data;
  if (!job->ever_joined) {
    log_with(LOG_LEVEL_INFO, LOG_JOB(job->hex),
             "job %s: no rank joined within job_timeout", job->hex);
    job->ticking = false;
    job_destroy(job);
    return;
  }
  export_tick(job);
  push_tick(job);
  if (job->mesh != NULL)
    mesh_tick(job);
  comms_join(job);
  job_schedule(job);
}

void job_schedule(struct job *job) {
  if (!job->ever_joined || job->dying)
    return;
  bool active = job->running != NULL || push_busy(job) ||
                push_waiting(job) ||
                (job->mesh != NULL && mesh_active(job)) ||
                comms_joining(job);
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

void job_terminate(struct job *job, int code, const char *message) {
  /* The other nodes first: the root's own failure must not reach them as
   * the loss of its links. */
  if (job->mesh != NULL)
    mesh_job_ended(job, code, message);
  export_abort(job, code, message);
  push_abort(job, code, message);
  for (uint32_t r = 0; r < job->world; r++) {
    struct job_member *m = job->members[r];
    if (m != NULL && m->conn != NULL)
      conn_finish(m->conn, code, "%s", message);
  }
  for (uint32_t i = 0; i < job->nconsumers; i++) {
    struct job_consumer *k = job->consumers[i];
    if (k != NULL && k->conn != NULL)
      conn_finish(k->conn, code, "%s", message);
  }
  job_end(job);
}

void job_shutdown(struct server *srv) {
  for (struct job *job = srv->jobs; job != NULL; job = job->next) {
    job->dying = true;
    for (uint32_t r = 0; r < job->world; r++)
      if (job->members[r] != NULL)
        job->members[r]->lost = true;
    for (uint32_t i = 0; i < job->nconsumers; i++)
      if (job->consumers[i] != NULL)
        job->consumers[i]->lost = true;
    if (job->ticking) {
      uv_timer_stop(&job->tick);
      job->ticking = false;
    }
    job_wake(job);
  }
}

/* {"v":1,"job":<bin>,"secret":<bin>,"world":W}, and with "v":2 the root's
 * "root":"addr:port" for a job that may span nodes, and on a daemon serving
 * the CUDA backend the job's "nccl_id" (docs/protocol.md). */
static int ticket_pack(const struct job *job, msgpack_sbuffer *sb) {
  msgpack_packer pk;
  msgpack_sbuffer_init(sb);
  msgpack_packer_init(&pk, sb, msgpack_sbuffer_write);
  bool nodes = job->mesh != NULL;
  bool nccl = nodes && job->has_nccl_id;
  bool consumers = job->nconsumers > 0;
  msgpack_pack_map(&pk, (nodes ? 5 : 4) + (nccl ? 1 : 0) + (consumers ? 1 : 0));
  sp__pack_kv_u64(&pk, "v", nodes ? 2 : 1);
  if (consumers)
    sp__pack_kv_u64(&pk, "consumers", job->nconsumers);
  if (nodes)
    sp__pack_kv_str(&pk, "root", job->srv->peer_address);
  sp__pack_str(&pk, "job");
  sp__pack_bin(&pk, job->id, JOB_ID_BYTES);
  sp__pack_str(&pk, "secret");
  sp__pack_bin(&pk, job->secret, JOB_SECRET_BYTES);
  sp__pack_kv_u64(&pk, "world", job->world);
  if (nccl) {
    sp__pack_str(&pk, "nccl_id");
    sp__pack_bin(&pk, job->nccl_id, GPU_NCCL_ID_BYTES);
  }
  if (sb->data == NULL || sb->size > SP_TICKET_MAX) {
    msgpack_sbuffer_destroy(sb);
    return SP_ENOMEM;
  }
  return 0;
}

struct job *job_new(struct server *srv, const uint8_t *id,
                    const uint8_t *secret, uint32_t world) {
  struct job *job = calloc(1, sizeof *job);
  struct job_member **members = calloc(world, sizeof *members);
  struct job_departure *departed = calloc(world, sizeof *departed);
  if (job == NULL || members == NULL || departed == NULL ||
      (id == NULL && random_bytes(job->id, JOB_ID_BYTES) != 0) ||
      (secret == NULL && random_bytes(job->secret, JOB_SECRET_BYTES) != 0)) {
    free(job);
    free(members);
    free(departed);
    return NULL;
  }
  if (id != NULL)
    memcpy(job->id, id, JOB_ID_BYTES);
  if (secret != NULL)
    memcpy(job->secret, secret, JOB_SECRET_BYTES);
  job->srv = srv;
  job->members = members;
  job->departed = departed;
  job->world = world;
  job->next_export_id = 1;
  job->created_ms = monotonic_ms();
  history_init(&job->history, srv->cfg->export_history);
  for (size_t i = 0; i < JOB_ID_BYTES; i++)
    snprintf(job->hex + 2 * i, 3, "%02x", job->id[i]);
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
  return job;
}

int job_set_consumers(struct job *job, uint32_t n) {
  if (n == 0)
    return 0;
  job->consumers = calloc(n, sizeof *job->consumers);
  job->consumer_departed = calloc(n, sizeof *job->consumer_departed);
  if (job->consumers == NULL || job->consumer_departed == NULL)
    return SP_ENOMEM;
  job->nconsumers = n;
  return 0;
}

void job_end(struct job *job) {
  job->dying = true;
  job_wake(job);
}

void job_note_joined(struct job *job) {
  if (job->ever_joined)
    return;
  job->ever_joined = true;
  uv_timer_stop(&job->tick);
  job->ticking = false;
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
  /* Held before the check, so that the check counts the new job. */
  struct quota_user *owner = quota_hold(srv, conn_uid(c), QUOTA_JOB);
  if (owner == NULL)
    return conn_send_error(c, head->id, SP_ENOMEM,
                           "job_create: cannot make a job");
  if ((rc = quota_job_admit(owner, msg, sizeof msg)) != 0) {
    quota_release(owner, QUOTA_JOB);
    return conn_send_error(c, head->id, rc, "job_create: %s", msg);
  }
  struct job *job = job_new(srv, NULL, NULL, req.world);
  if (job == NULL) {
    quota_release(owner, QUOTA_JOB);
    return conn_send_error(c, head->id, SP_ENOMEM,
                           "job_create: cannot make a job");
  }
  job->owner = owner;
  job_set_owner(job, conn_peer(c));
  if (job_set_consumers(job, req.consumers) != 0) {
    job_end(job);
    return conn_send_error(c, head->id, SP_ENOMEM,
                           "job_create: cannot make a job");
  }
  /* A daemon that listens for peers roots its jobs: they may span nodes. */
  msgpack_sbuffer ticket;
  if (srv->peer_fd >= 0 && srv->backend->gpu != NULL) {
    /* The NCCL id of the job's communicators across nodes: made here, on
     * the root, whose process stays up for the rendezvous. */
    if (gpu_comms_unique_id(srv->backend->gpu, job->nccl_id, msg,
                            sizeof msg) != 0) {
      job_end(job);
      return conn_send_error(c, head->id, SP_EBACKEND, "job_create: %s", msg);
    }
    job->has_nccl_id = true;
  }
  if ((srv->peer_fd >= 0 && mesh_create_root(job) != 0) ||
      ticket_pack(job, &ticket) != 0) {
    job_end(job);
    return conn_send_error(c, head->id, SP_ENOMEM,
                           "job_create: cannot make a ticket");
  }
  log_with(LOG_LEVEL_INFO, LOG_JOB(job->hex),
          "job %s: created for %" PRIu32 " ranks by uid %u (pid %d)",
          job->hex, job->world, (unsigned)job->owner_uid,
          (int)job->owner_pid);

  struct sp_msgbuf mb;
  sp__msgbuf_begin(&mb, "job_create", head->id, 2);
  sp__pack_kv_str(&mb.pk, "job_id", job->hex);
  sp__pack_str(&mb.pk, "ticket");
  sp__pack_bin(&mb.pk, ticket.data, ticket.size);
  msgpack_sbuffer_destroy(&ticket);
  return conn_send_msgbuf(c, &mb);
}

int job_op_join(struct conn *c, const struct sp_msg_head *head,
                const msgpack_object *map, struct sp_frame *frame) {
  (void)frame;
  struct server *srv = conn_server(c);
  struct job_member *have = conn_member(c);
  if (conn_consumer(c) != NULL)
    return conn_send_error(c, head->id, SP_ESTATE,
                           "join: this connection is a consumer of a job "
                           "already");
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
  bool same_id;
  struct job *job = find_ticket(srv, &ticket, &same_id);
  /* A job rooted on another daemon gets its shadow here, one per secret:
   * a shadow's secret is only a claim until its root proves it, so a
   * ticket forged with a job's id and another secret gets a shadow of its
   * own, which its root refuses, and never stands in the way of the real
   * ticket's ranks.  Where the job was created here, such a ticket is
   * refused outright (below), so that the root has one job of its id. */
  if (job == NULL && ticket.root[0] != '\0' &&
      strcmp(ticket.root, srv->peer_address) != 0 &&
      !created_here(srv, ticket.job)) {
    rc = mesh_shadow_job(c, head, &ticket, &job);
    if (job == NULL)
      return rc;
  }
  if (job == NULL && same_id)
    return conn_send_error(c, head->id, SP_ETICKET,
                           "join: the ticket's secret does not match job "
                           "%s", job_find(srv, NULL, ticket.job)->hex);
  if (job == NULL || job->dying)
    return conn_send_error(c, head->id, SP_ETICKET,
                           "join: no job of this ticket on this daemon (it "
                           "ended, or was never created here)");
  if (ticket.world != job->world)
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
  int device = -1;
  if (req.device_type != SP_DEVICE_CPU) {
    if (srv->backend->gpu == NULL)
      return conn_send_error(c, head->id, SP_EBACKEND,
                             "join: device \"%s\" needs the CUDA backend; "
                             "this daemon serves the %s backend (%s)",
                             req.device, srv->backend->active,
                             srv->backend->reason);
    device = gpu_find_device(srv->backend->gpu, req.device, strlen(req.device));
    if (device < 0)
      return conn_send_error(c, head->id, SP_EINVAL,
                             "join: device \"%s\" is not a GPU of this node "
                             "(GPUs are named by UUID, as nvidia-smi -L "
                             "shows them)",
                             req.device);
  }
  /* One engine moves a job's data: its ranks are all on GPUs or all on
   * the host. */
  for (uint32_t r = 0; r < job->world; r++)
    if (job->members[r] != NULL &&
        job->members[r]->reg.device_type != req.device_type)
      return conn_send_error(c, head->id, SP_EDEVICEMISMATCH,
                             "join: rank %" PRIu32 " joined job %s on %s; "
                             "rank %" PRIu32 " on \"%s\" cannot join it",
                             r, job->hex,
                             job->members[r]->reg.device_type == SP_DEVICE_CPU
                                 ? "the host"
                                 : "a GPU",
                             req.rank, req.device);
  /* A job across nodes moves data between nodes through NCCL, one rank
   * per GPU: NCCL does not support one device as two ranks of a
   * communicator (it may hang; docs/gpu.md).  Merging two ranks' buckets
   * into one NCCL rank is not done, so the second rank is refused here,
   * before anything is set up. */
  for (uint32_t r = 0; job->mesh != NULL && device >= 0 && r < job->world; r++)
    if (job->members[r] != NULL && !job->members[r]->lost &&
        job->members[r]->reg.gpu != NULL && job->members[r]->reg.device == device)
      return conn_send_error(c, head->id, SP_EINVAL,
                             "join: rank %" PRIu32 " of job %s is on %s "
                             "already; a job across nodes takes one rank "
                             "per GPU (one NCCL rank each), so rank %" PRIu32
                             " needs a GPU of its own",
                             r, job->hex,
                             gpu_device_name(srv->backend->gpu, device),
                             req.rank);
  if (job->mesh != NULL) {
    /* Every rank of a job across nodes joins once, as its root decides. */
    rc = mesh_join(job, c, head, &req, device);
    if (rc != 0)
      return rc < 0 ? rc : 0;
  }
  if (job_admit(job, c, head->id, &req, device) == NULL)
    return conn_send_error(c, head->id, SP_ENOMEM, "join: out of memory");
  return 0;
}

/* A descriptor that tells when process pid ends (pool.h), taken at the
 * join while the process is surely the rank's (a pid may be reused once it
 * ended): its pidfd, or where the kernel gives none (before Linux 5.3, and
 * under valgrind, which does not know the call) its /proc directory; -1
 * when neither can be had, and then an export the rank never released is
 * freed when it leaves. */
static int process_handle(pid_t pid) {
  if (pid <= 0)
    return -1;
  int fd = (int)syscall(SYS_pidfd_open, pid, 0);
  if (fd >= 0)
    return fd;
  char path[32];
  snprintf(path, sizeof path, "/proc/%d", (int)pid);
  return open(path, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
}

struct job_member *job_admit(struct job *job, struct conn *c,
                             uint64_t request_id, const struct req_join *req,
                             int device) {
  struct server *srv = job->srv;
  struct job_member *m = calloc(1, sizeof *m);
  struct quota_user *user = quota_hold(srv, conn_uid(c), QUOTA_RANK);
  if (m == NULL || user == NULL) {
    if (user != NULL)
      quota_release(user, QUOTA_RANK);
    free(m);
    return NULL;
  }
  m->job = job;
  m->conn = c;
  m->rank = req->rank;
  m->user = user;
  m->pidfd = process_handle(conn_peer(c)->pid);
  registry_init(&m->reg, req->device_type);
  m->reg.quota = &quota_registry_ops;
  m->reg.quota_arg = user;
  if (device >= 0) {
    m->reg.gpu = srv->backend->gpu;
    m->reg.device = device;
  }
  job->members[req->rank] = m;
  job->joined++;
  job_rank_returned(job, req->rank);
  conn_set_member(c, m);
  /* A shadow of a job rooted elsewhere belongs to whoever joined it here
   * first. */
  if (!job->has_owner)
    job_set_owner(job, conn_peer(c));
  job_note_joined(job);
  if (job->mesh != NULL)
    mesh_rank_joined(job, req->rank);
  plancache_drop(job);
  push_cache_drop(job);
  log_with(LOG_LEVEL_INFO,
          &(struct log_fields){
              .job = job->hex, .rank = req->rank, .node = LOG_NONE},
          "job %s: rank %" PRIu32 " joined (%" PRIu32 " of %" PRIu32 ")",
          job->hex, req->rank, job->joined, job->world);
  struct sp_msgbuf mb;
  sp__msgbuf_begin(&mb, "join", request_id, 1);
  sp__pack_kv_str(&mb.pk, "job_id", job->hex);
  conn_send_msgbuf(c, &mb);
  /* An export may have waited for this rank's registrations only. */
  job_wake(job);
  return m;
}

int job_op_leave(struct conn *c, const struct sp_msg_head *head,
                 const msgpack_object *map, struct sp_frame *frame) {
  (void)map;
  (void)frame;
  struct job_member *m = conn_member(c);
  if (conn_consumer(c) != NULL)
    return consumer_leave(c, conn_consumer(c), head->id);
  if (m == NULL)
    return conn_send_error(c, head->id, SP_ESTATE,
                           "leave: this connection is not in a job");
  /* The leaver's own pending export hears the same error as its peers. */
  m->lost = true;
  member_departs(m);
  conn_set_member(c, NULL);
  m->conn = NULL;
  job_wake(m->job);
  struct sp_msgbuf mb;
  sp__msgbuf_begin(&mb, "leave", head->id, 0);
  return conn_send_msgbuf(c, &mb);
}

void job_set_owner(struct job *job, const struct peer *peer) {
  job->has_owner = true;
  job->owner_uid = peer->uid;
  job->owner_pid = peer->pid;
}

void job_count_ranks(const struct job *job, uint32_t *joined,
                     uint32_t *asked) {
  *joined = *asked = 0;
  for (uint32_t r = 0; r < job->world; r++) {
    const struct job_member *m = job->members[r];
    *joined += m != NULL && !m->lost;
    *asked += m != NULL && !m->lost && (m->asked || m->push_asked);
  }
}

void job_status_pack(const struct server *srv, msgpack_packer *pk) {
  msgpack_pack_array(pk, srv->njobs);
  for (const struct job *job = srv->jobs; job != NULL; job = job->next)
    job_pack(job, pk, 0);
}

void job_pack(const struct job *job, msgpack_packer *pk, uint32_t extra) {
  struct export_view v;
  uint32_t joined, asked;
  export_view(job, &v);
  job_count_ranks(job, &joined, &asked);
  bool failed = v.phase == JOB_FAILED;
  msgpack_pack_map(pk, (failed ? 23 : 22) + extra);
  sp__pack_kv_str(pk, "job_id", job->hex);
  sp__pack_kv_str(pk, "phase", export_phase_name(v.phase));
  if (failed)
    sp__pack_kv_str(pk, "error", job->error);
  sp__pack_kv_u64(pk, "world", job->world);
  sp__pack_kv_u64(pk, "joined", joined);
  sp__pack_kv_u64(pk, "asked", asked);
  sp__pack_kv_u64(pk, "export_id", v.export_id);
  sp__pack_kv_u64(pk, "round", v.round);
  sp__pack_kv_u64(pk, "rounds", v.rounds);
  sp__pack_kv_u64(pk, "bytes_moved", v.bytes_moved);
  sp__pack_kv_u64(pk, "bytes_total", v.bytes_total);
  sp__pack_kv_u64(pk, "bytes_prepared", v.bytes_prepared);
  sp__pack_kv_u64(pk, "bytes_to_prepare", v.bytes_to_prepare);
  sp__pack_kv_u64(pk, "bytes_written", v.bytes_written);
  sp__pack_kv_u64(pk, "bytes_to_write", v.bytes_to_write);
  sp__pack_kv_f64(pk, "rate_bps", v.rate_bps);
  sp__pack_kv_u64(pk, "pool_used", v.pool_used);
  /* Every daemon of a job across nodes shows the same digest. */
  char digest[17] = "";
  if (job->has_plan_digest)
    snprintf(digest, sizeof digest, "%016" PRIx64, job->plan_digest);
  sp__pack_kv_str(pk, "plan_digest", digest);
  sp__pack_kv_u64(pk, "node", mesh_self(job));
  mesh_status_pack(job, pk);
  sp__pack_str(pk, "consumers");
  consumer_status_pack(job, pk);
  sp__pack_kv_u64(pk, "pushes", job->pushes);
  sp__pack_kv_u64(pk, "push_plans", job->push_plans);
}
