/*
 * push.c - a job's pushes into its consumers (push.h, docs/protocol.md,
 * "push").
 *
 * A push starts once every trainer rank sent push and every consumer
 * receive.  Then one thread of its own plans it (consume_plan_build; the
 * job's last plan is reused while nobody registered, joined or left) and
 * runs its moves (consume_run_local, with the engine's copying threads):
 * the loop does nothing proportional to the bytes or the keys.  When the
 * thread ended, every rank and consumer is answered with the push's bytes,
 * or every one of them with the push's one error.
 *
 * While a push runs, nobody registers (registration.c refuses it), no
 * export starts and no member is freed: the thread reads the trainers'
 * registries and writes the consumers' buffers.  A member that is lost
 * meanwhile cancels the run, and is freed once the thread has ended.
 */
#include <inttypes.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "daemon/config.h"
#include "daemon/conn.h"
#include "daemon/consumer.h"
#include "daemon/gather.h"
#include "daemon/job.h"
#include "daemon/log.h"
#include "daemon/mesh/mesh.h"
#include "daemon/plan/consume.h"
#include "daemon/push.h"
#include "daemon/regoverlap.h"
#include "daemon/registry.h"
#include "daemon/request.h"
#include "daemon/server.h"
#include "daemon/xfer/consume_run.h"
#include "daemon/xfer/thread.h"
#include "proto/fail.h"
#include "proto/monotonic.h"
#include "shardport.h"

struct push {
  struct job *job;
  uint64_t id;
  struct gather_options opts;
  bool reuse;
  /* The planner's input, built on the loop from the registries (which do
   * not change while the push runs) when the plan is not reused. */
  struct plan_input_store *store; /* the trainers' registrations */
  struct consume_in *cin;
  struct consume_storage *cstorages; /* every consumer's, back to back */
  struct consume_target *ctargets;   /* every consumer's, back to back */
  _Atomic bool plan_stop;
  struct consume_plan *plan; /* the new one, or the job's cached one */
  /* The run's buffers: every rank's storages, every consumer's writable
   * mappings. */
  const struct xfer_storage **src;
  uint8_t **dst_flat;
  uint8_t *const **dst;
  _Atomic uint64_t *received;
  struct consume_run run;
  pthread_t thread;
  bool thread_alive;
  _Atomic bool done;
  int rc;
  char msg[SP_ERRMSG_MAX + 1];
  /* Failed on the loop (a lost member, a timeout): the answer everyone
   * gets once the thread ended. */
  bool failed;
  int fail_code;
  char fail_msg[SP_ERRMSG_MAX + 1];
  uint64_t progress_ms;
  uint64_t last_moved;
};

bool push_busy(const struct job *job) { return job->pushing != NULL; }

static void free_cache(struct job *job) {
  consume_plan_free(job->push_cache.plan);
  job->push_cache = (struct push_cache){0};
}

void push_cache_drop(struct job *job) {
  if (job->pushing != NULL)
    job->push_cache.stale = true;
  else
    free_cache(job);
}

bool push_waiting(const struct job *job) {
  for (uint32_t r = 0; r < job->world; r++)
    if (job->members[r] != NULL && job->members[r]->push_asked)
      return true;
  for (uint32_t c = 0; c < job->nconsumers; c++)
    if (job->consumers[c] != NULL && job->consumers[c]->receiving)
      return true;
  return false;
}

static void answer_error(struct conn *conn, uint64_t id, int code,
                         const char *message) {
  if (conn != NULL)
    conn_send_error(conn, id, code, "%s", message);
}

/* Fails every rank and consumer waiting for a push, not in a running one. */
static void fail_waiting(struct job *job, int code, const char *message) {
  bool any = false;
  for (uint32_t r = 0; r < job->world; r++) {
    struct job_member *m = job->members[r];
    if (m != NULL && m->push_asked && !m->in_push) {
      m->push_asked = false;
      answer_error(m->conn, m->push_request, code, message);
      any = true;
    }
  }
  for (uint32_t c = 0; c < job->nconsumers; c++) {
    struct job_consumer *k = job->consumers[c];
    if (k != NULL && k->receiving && !k->in_push) {
      k->receiving = false;
      answer_error(k->conn, k->receive_id, code, message);
      any = true;
    }
  }
  if (any) {
    job->pushes++;
    log_with(LOG_LEVEL_WARN, LOG_JOB(job->hex), "job %s: push failed: %s: %s",
             job->hex, sp_err_name(code), message);
  }
}

static void fail_push(struct push *p, int code, const char *message) {
  if (p->failed)
    return;
  p->failed = true;
  p->fail_code = code;
  snprintf(p->fail_msg, sizeof p->fail_msg, "%s", message);
  atomic_store(&p->plan_stop, true);
  atomic_store(&p->run.cancel, true);
}

static void free_push(struct push *p) {
  if (!p->reuse)
    consume_plan_free(p->plan);
  plan_input_store_free(p->store);
  free(p->cin);
  free(p->cstorages);
  free(p->ctargets);
  free(p->src);
  free(p->dst_flat);
  free(p->dst);
  free(p->received);
  free(p);
}

/* Plans (unless reused) and runs the push, off the loop. */
static void *push_main(void *arg) {
  struct push *p = arg;
  p->rc = 0;
  if (!p->reuse) {
    struct plan_input *in = plan_input_of(p->store);
    in->max_keys = p->opts.max_keys;
    in->max_bytes = p->opts.max_bytes;
    in->stop = &p->plan_stop;
    p->rc = consume_plan_build(
        &(struct consume_input){
            .trainers = in,
            .nconsumers = p->job->nconsumers,
            .nconsumer_in = p->job->nconsumers,
            .consumers = p->cin},
        &p->plan, p->msg, sizeof p->msg);
  }
  if (p->rc == 0) {
    p->run.plan = p->plan;
    p->rc = consume_run_local(&p->run);
    if (p->rc != 0)
      snprintf(p->msg, sizeof p->msg, "%s", p->run.msg);
  }
  atomic_store(&p->done, true);
  job_wake(p->job);
  return NULL;
}

/* The planner's view of every rank's registry and every consumer's
 * buffers and targets. */
static int build_input(struct push *p) {
  struct job *job = p->job;
  size_t nstorages = 0, ntargets = 0;
  for (uint32_t c = 0; c < job->nconsumers; c++) {
    nstorages += job->consumers[c]->nbuffers;
    ntargets += job->consumers[c]->ntargets;
  }
  p->store = plan_input_store_new(job->world);
  p->cin = calloc(job->nconsumers, sizeof *p->cin);
  p->cstorages = calloc(nstorages + 1, sizeof *p->cstorages);
  p->ctargets = calloc(ntargets + 1, sizeof *p->ctargets);
  if (p->store == NULL || p->cin == NULL || p->cstorages == NULL ||
      p->ctargets == NULL)
    return SP_ENOMEM;
  for (uint32_t r = 0; r < job->world; r++) {
    int rc = registry_plan_rank(&job->members[r]->reg, r, 0, NULL, p->store,
                                p->msg, sizeof p->msg);
    if (rc != 0)
      return rc;
  }
  size_t s = 0, t = 0;
  for (uint32_t c = 0; c < job->nconsumers; c++) {
    const struct job_consumer *k = job->consumers[c];
    p->cin[c] = (struct consume_in){.index = c,
                                    .nstorages = k->nbuffers,
                                    .storages = p->cstorages + s,
                                    .ntargets = k->ntargets,
                                    .targets = p->ctargets + t};
    for (size_t b = 0; b < k->nbuffers; b++)
      p->cstorages[s++] = k->buffers[b].s;
    for (size_t i = 0; i < k->ntargets; i++)
      p->ctargets[t++] = k->targets[i].t;
  }
  return 0;
}

/* The buffers the run reads and writes. */
static int build_buffers(struct push *p) {
  struct job *job = p->job;
  size_t nbuffers = 0;
  for (uint32_t c = 0; c < job->nconsumers; c++)
    nbuffers += job->consumers[c]->nbuffers;
  p->src = calloc(job->world, sizeof *p->src);
  p->dst = calloc(job->nconsumers, sizeof *p->dst);
  p->dst_flat = calloc(nbuffers + 1, sizeof *p->dst_flat);
  p->received = calloc(job->nconsumers, sizeof *p->received);
  if (p->src == NULL || p->dst == NULL || p->dst_flat == NULL ||
      p->received == NULL)
    return SP_ENOMEM;
  for (uint32_t r = 0; r < job->world; r++)
    p->src[r] = job->members[r]->reg.info;
  size_t b = 0;
  for (uint32_t c = 0; c < job->nconsumers; c++) {
    const struct job_consumer *k = job->consumers[c];
    p->dst[c] = p->dst_flat + b;
    for (size_t i = 0; i < k->nbuffers; i++)
      p->dst_flat[b++] = k->buffers[i].data;
  }
  p->run = (struct consume_run){.node = 0,
                                .src = p->src,
                                .dst = p->dst,
                                .threads = job->srv->engine_threads,
                                .received = p->received};
  return 0;
}

/* A trainer's storage registered over a consumer's buffer after the
 * buffer was granted (consumer_buffer.c refuses the other order): the
 * push is refused before anything is written.  Every trainer registry of
 * this daemon is asked, as when the buffer was mapped. */
static int check_trainer_overlap(const struct job *job, char *msg,
                                 size_t msglen) {
  for (uint32_t c = 0; c < job->nconsumers; c++) {
    const struct job_consumer *k = job->consumers[c];
    for (size_t b = 0; b < k->nbuffers; b++) {
      const struct consume_storage *s = &k->buffers[b].s;
      const struct reg_file *f = &job->consumer_files.files[s->memory - 1];
      for (const struct job *j = job->srv->jobs; j != NULL; j = j->next)
        for (uint32_t r = 0; r < j->world; r++) {
          const struct job_member *m = j->members[r];
          uint32_t sid = m == NULL ? 0
                                   : regoverlap_sid(&m->reg, f->dev, f->ino,
                                                    s->memory_offset,
                                                    s->nbytes);
          if (sid != 0)
            return sp__failf(msg, msglen, SP_EPERM,
                             "consumer %u's buffer sid %u shares bytes with "
                             "rank %u's storage sid %u of job %s: a "
                             "trainer's memory is never written",
                             c, k->buffers[b].sid, r, sid, j->hex);
        }
    }
  }
  return 0;
}

/* A rank's part in the gather of a push (gather.h). */
static void member_push_ask(const void *ctx, uint32_t r,
                            struct gather_ask *out) {
  const struct job *job = ctx;
  const struct job_member *m = job->members[r];
  *out = (struct gather_ask){.joined = m != NULL};
  if (m == NULL || !m->push_asked)
    return;
  out->asked = true;
  out->max_keys = m->push.max_keys;
  out->max_bytes = m->push.max_bytes;
  out->timeout_ms = m->push.timeout_ms;
  out->deadline_ms = m->push_deadline_ms;
}

static bool everyone_came(const struct job *job) {
  for (uint32_t r = 0; r < job->world; r++) {
    const struct job_member *m = job->members[r];
    if (m == NULL || m->lost || !m->push_asked)
      return false;
  }
  for (uint32_t c = 0; c < job->nconsumers; c++) {
    const struct job_consumer *k = job->consumers[c];
    if (k == NULL || k->lost || !k->receiving)
      return false;
  }
  return true;
}

static void start(struct job *job) {
  char msg[SP_ERRMSG_MAX + 1];
  if (job_departed(job, msg, sizeof msg)) {
    fail_waiting(job, SP_ERANKLOST, msg);
    return;
  }
  if (consumer_departed(job, msg, sizeof msg)) {
    fail_waiting(job, SP_ECONSUMERLOST, msg);
    return;
  }
  /* Across nodes, a rank joined on another daemon: its bytes would need
   * the data links, which carry no pushes yet. */
  for (uint32_t r = 0; r < job->world; r++) {
    uint32_t node;
    bool asked;
    if (job->members[r] == NULL && push_waiting(job) &&
        mesh_rank_where(job, r, &node, &asked)) {
      snprintf(msg, sizeof msg,
               "rank %" PRIu32 " of job %s joined on node %" PRIu32
               "; this version pushes from the ranks of the root's node "
               "only",
               r, job->hex, node);
      fail_waiting(job, SP_EUNSUPPORTED, msg);
      return;
    }
  }
  if (!everyone_came(job))
    return;
  struct gather_options o;
  int rc = gather_agree(&(struct gather_ranks){.world = job->world,
                                               .ask = member_push_ask,
                                               .ctx = job},
                        job->srv->cfg, &o, msg, sizeof msg);
  for (uint32_t c = 0; rc == 0 && c < job->nconsumers; c++) {
    uint32_t t = job->consumers[c]->timeout_ms;
    if (t > 0 && t < o.timeout_ms)
      o.timeout_ms = t;
  }
  if (rc == 0)
    rc = check_trainer_overlap(job, msg, sizeof msg);
  if (rc != 0) {
    fail_waiting(job, rc, msg);
    return;
  }
  struct push *p = calloc(1, sizeof *p);
  if (p == NULL) {
    fail_waiting(job, SP_ENOMEM, "out of memory starting the push");
    return;
  }
  p->job = job;
  p->id = ++job->last_push_id;
  p->opts = o;
  const struct push_cache *cache = &job->push_cache;
  p->reuse = cache->plan != NULL && cache->max_keys == o.max_keys &&
             cache->max_bytes == o.max_bytes;
  rc = p->reuse ? 0 : build_input(p);
  if (rc == 0)
    rc = build_buffers(p);
  if (rc != 0) {
    /* Reading a rank's registrations may fail for another reason than
     * memory, in words of its own. */
    char why[sizeof p->msg];
    snprintf(why, sizeof why, "%s",
             rc == SP_ENOMEM || p->msg[0] == '\0'
                 ? "out of memory starting the push"
                 : p->msg);
    free_push(p);
    job->last_push_id--;
    fail_waiting(job, rc, why);
    return;
  }
  if (p->reuse)
    p->plan = cache->plan;
  for (uint32_t r = 0; r < job->world; r++)
    job->members[r]->in_push = true;
  for (uint32_t c = 0; c < job->nconsumers; c++)
    job->consumers[c]->in_push = true;
  p->progress_ms = monotonic_ms();
  job->pushing = p;
  if (xfer_spawn(&p->thread, push_main, p) != 0) {
    fail_push(p, SP_ENOMEM, "cannot start the push's thread");
    atomic_store(&p->done, true);
    return;
  }
  p->thread_alive = true;
  log_with(LOG_LEVEL_INFO, LOG_JOB(job->hex),
           "job %s: push %" PRIu64 " started (%s plan)", job->hex, p->id,
           p->reuse ? "the last" : "a new");
}

/* The bytes each rank sends in the plan, into sent[world]. */
static void rank_bytes(const struct consume_plan *plan, uint64_t *sent) {
  for (size_t i = 0; i < plan->nrounds; i++) {
    const struct consume_round *round = &plan->rounds[i];
    for (size_t m = 0; m < round->nlocal; m++)
      sent[round->local[m].src] += round->local[m].nbytes;
    for (size_t m = 0; m < round->nmoves; m++)
      sent[round->moves[m].src] += round->moves[m].nbytes;
  }
}

static void answer(struct conn *conn, const char *op, uint64_t id,
                   uint64_t push_id, uint64_t bytes, bool reused) {
  if (conn == NULL)
    return;
  struct sp_msgbuf mb;
  sp__msgbuf_begin(&mb, op, id, 3);
  sp__pack_kv_u64(&mb.pk, "push_id", push_id);
  sp__pack_kv_u64(&mb.pk, "bytes", bytes);
  sp__pack_kv_bool(&mb.pk, "plan_reused", reused);
  conn_send_msgbuf(conn, &mb);
}

/* The thread ended: everyone hears the outcome, the plan is kept. */
static void finish(struct push *p) {
  struct job *job = p->job;
  bool reused = p->reuse;
  if (p->thread_alive)
    pthread_join(p->thread, NULL);
  p->thread_alive = false;
  if (!p->failed && p->rc != 0)
    fail_push(p, p->rc, p->msg);
  for (uint32_t c = 0; c < job->nconsumers; c++)
    if (job->consumers[c] != NULL)
      job->consumers[c]->bytes_received += atomic_load(&p->received[c]);
  if (!p->failed && !p->reuse) {
    free_cache(job);
    job->push_cache = (struct push_cache){.plan = p->plan,
                                          .max_keys = p->opts.max_keys,
                                          .max_bytes = p->opts.max_bytes};
    job->push_plans++;
    p->reuse = true; /* the cache owns it now */
  }
  job->pushing = NULL;
  if (job->push_cache.stale)
    free_cache(job);
  uint64_t *sent = p->failed ? NULL : calloc(job->world, sizeof *sent);
  if (!p->failed && sent == NULL)
    fail_push(p, SP_ENOMEM, "out of memory answering the push");
  if (sent != NULL)
    rank_bytes(p->plan, sent);
  for (uint32_t r = 0; r < job->world; r++) {
    struct job_member *m = job->members[r];
    if (m == NULL || !m->in_push)
      continue;
    m->in_push = false;
    m->push_asked = false;
    if (p->failed)
      answer_error(m->conn, m->push_request, p->fail_code, p->fail_msg);
    else
      answer(m->conn, "push", m->push_request, p->id, sent[r], reused);
  }
  for (uint32_t c = 0; c < job->nconsumers; c++) {
    struct job_consumer *k = job->consumers[c];
    if (k == NULL || !k->in_push)
      continue;
    k->in_push = false;
    k->receiving = false;
    if (p->failed)
      answer_error(k->conn, k->receive_id, p->fail_code, p->fail_msg);
    else
      answer(k->conn, "receive", k->receive_id, p->id, p->plan->received[c],
             reused);
  }
  free(sent);
  job->pushes++;
  if (p->failed)
    log_with(LOG_LEVEL_WARN, LOG_JOB(job->hex),
             "job %s: push %" PRIu64 " failed: %s: %s", job->hex, p->id,
             sp_err_name(p->fail_code), p->fail_msg);
  else
    log_with(LOG_LEVEL_INFO, LOG_JOB(job->hex),
             "job %s: push %" PRIu64 " delivered %" PRIu64 " bytes", job->hex,
             p->id, atomic_load(&p->run.bytes_moved));
  free_push(p);
}

void push_advance(struct job *job) {
  if (job->pushing != NULL) {
    if (!atomic_load(&job->pushing->done))
      return;
    finish(job->pushing);
  }
  if (job->running == NULL && !job->dying)
    start(job);
}

/* "rank(s) 1, 3 and consumer(s) 0": who a push waits for. */
static void who_is_missing(const struct job *job, char *buf, size_t len) {
  size_t used = 0;
  buf[0] = '\0';
  for (uint32_t r = 0; r < job->world && used < len; r++) {
    const struct job_member *m = job->members[r];
    if (m == NULL || !m->push_asked)
      used += (size_t)snprintf(buf + used, len - used, "%srank %" PRIu32,
                               used > 0 ? ", " : "", r);
  }
  for (uint32_t c = 0; c < job->nconsumers && used < len; c++) {
    const struct job_consumer *k = job->consumers[c];
    if (k == NULL || !k->receiving)
      used += (size_t)snprintf(buf + used, len - used, "%sconsumer %" PRIu32,
                               used > 0 ? ", " : "", c);
  }
}

void push_tick(struct job *job) {
  uint64_t now = monotonic_ms();
  char msg[SP_ERRMSG_MAX + 1];
  struct push *p = job->pushing;
  if (p != NULL) {
    uint64_t moved = atomic_load(&p->run.bytes_moved);
    if (moved != p->last_moved) {
      p->last_moved = moved;
      p->progress_ms = now;
    } else if (now - p->progress_ms > p->opts.timeout_ms) {
      snprintf(msg, sizeof msg,
               "push %" PRIu64 " of job %s moved nothing for %" PRIu32 " ms",
               p->id, job->hex, p->opts.timeout_ms);
      fail_push(p, SP_ETIMEOUT, msg);
    }
    return;
  }
  uint64_t deadline = UINT64_MAX;
  for (uint32_t r = 0; r < job->world; r++) {
    const struct job_member *m = job->members[r];
    if (m != NULL && m->push_asked && m->push_deadline_ms < deadline)
      deadline = m->push_deadline_ms;
  }
  for (uint32_t c = 0; c < job->nconsumers; c++) {
    const struct job_consumer *k = job->consumers[c];
    if (k != NULL && k->receiving && k->receive_deadline_ms < deadline)
      deadline = k->receive_deadline_ms;
  }
  if (now < deadline)
    return;
  char who[256];
  who_is_missing(job, who, sizeof who);
  snprintf(msg, sizeof msg, "the push of job %s timed out waiting for %s",
           job->hex, who);
  fail_waiting(job, SP_ETIMEOUT, msg);
}

void push_member_lost(struct job *job, const struct job_member *m) {
  char msg[SP_ERRMSG_MAX + 1];
  if (!m->push_asked && !m->in_push && !push_waiting(job))
    return;
  job_departure_text(job, m->rank, m->disconnected,
                     job->pushing != NULL ? " during a push" : "", m->refused,
                     msg, sizeof msg);
  if (job->pushing != NULL)
    fail_push(job->pushing, SP_ERANKLOST, msg);
  fail_waiting(job, SP_ERANKLOST, msg);
}

void push_consumer_lost(struct job *job, const struct job_consumer *k) {
  char msg[SP_ERRMSG_MAX + 1];
  if (!k->receiving && !k->in_push && !push_waiting(job))
    return;
  consumer_departure_text(job, k->index, k->disconnected,
                          job->pushing != NULL ? " during a push" : "", msg,
                          sizeof msg);
  if (job->pushing != NULL)
    fail_push(job->pushing, SP_ECONSUMERLOST, msg);
  fail_waiting(job, SP_ECONSUMERLOST, msg);
}

void push_abort(struct job *job, int code, const char *message) {
  if (job->pushing != NULL)
    fail_push(job->pushing, code, message);
  fail_waiting(job, code, message);
}

int push_op_push(struct conn *c, const struct sp_msg_head *head,
                 const msgpack_object *map, struct sp_frame *frame) {
  (void)frame;
  struct job_member *m = conn_member(c);
  if (m == NULL)
    return conn_send_error(c, head->id, SP_ESTATE,
                           conn_consumer(c) != NULL
                               ? "push: this connection is a consumer; "
                                 "trainer ranks push, consumers receive"
                               : "push: join a job first");
  struct job *job = m->job;
  if (job->mesh != NULL && !mesh_is_root(job->mesh))
    return conn_send_error(c, head->id, SP_EUNSUPPORTED,
                           "push: rank %" PRIu32 " joined job %s on a daemon "
                           "other than the job's root; this version pushes "
                           "from the ranks of the root's node only",
                           m->rank, job->hex);
  if (job->nconsumers == 0)
    return conn_send_error(c, head->id, SP_ESTATE,
                           "push: job %s was created without consumers",
                           job->hex);
  if (m->push_asked || m->asked)
    return conn_send_error(c, head->id, SP_EEXPORTING,
                           "push: rank %" PRIu32 " already waits for a push "
                           "or an export",
                           m->rank);
  char msg[256];
  int rc = request_parse_push(map, &m->push, msg, sizeof msg);
  if (rc != 0)
    return conn_send_error(c, head->id, rc, "push: %s", msg);
  m->push_asked = true;
  m->push_request = head->id;
  uint32_t t = m->push.timeout_ms ? m->push.timeout_ms
                                  : job->srv->cfg->export_timeout_ms;
  m->push_deadline_ms = monotonic_ms() + t;
  job_wake(job);
  job_schedule(job);
  return 0;
}

int push_op_receive(struct conn *c, const struct sp_msg_head *head,
                    const msgpack_object *map, struct sp_frame *frame) {
  (void)frame;
  struct job_consumer *k = conn_consumer(c);
  if (k == NULL)
    return conn_send_error(c, head->id, SP_ESTATE,
                           conn_member(c) != NULL
                               ? "receive: this connection is a trainer "
                                 "rank; consumers receive, ranks push"
                               : "receive: join a job as a consumer first");
  if (k->receiving)
    return conn_send_error(c, head->id, SP_EEXPORTING,
                           "receive: consumer %" PRIu32 " already waits for "
                           "a push",
                           k->index);
  struct req_push req;
  char msg[256];
  int rc = request_parse_push(map, &req, msg, sizeof msg);
  if (rc != 0)
    return conn_send_error(c, head->id, rc, "receive: %s", msg);
  struct job *job = k->job;
  k->receiving = true;
  k->receive_id = head->id;
  k->timeout_ms = req.timeout_ms;
  uint32_t t = req.timeout_ms ? req.timeout_ms
                              : job->srv->cfg->export_timeout_ms;
  k->receive_deadline_ms = monotonic_ms() + t;
  job_wake(job);
  job_schedule(job);
  return 0;
}
