/*
 * export.c - one export of a job, from the ranks' requests to their
 * replies: its state machine; see export.h and docs/protocol.md ("export").
 *
 *   waiting     ranks ask; the export starts when every rank of the job has
 *               asked (each ask has a deadline; the first to pass fails
 *               every asking rank with `timeout`).
 *   planning    plan_build and the publication layout run on a worker
 *               thread (a big job's plan takes long enough to stall the
 *               loop); skipped when the job's cached plan still applies
 *               (plancache.c).  A job on GPUs across nodes gets its NCCL
 *               communicators there too (comms.c).
 *               The same thread then compares the copies of replicated
 *               and plain keys (replicas.c), cached plan or not: the data
 *               may have changed since the last export.
 *               Bounded by the export's timeout: past it the export fails
 *               with `timeout` and the planner is told to stop.
 *   moving      the owners' pool segments are allocated (moving.c), then
 *               the engine thread runs the rounds (engine.c); status calls
 *               the time before round 1 allocating.
 *   publishing  each rank's owned tensors are streamed to it in parts, no
 *               faster than its connection takes them (pump.c).
 *   published / failed   the outcome, kept for status.
 *
 * Fail closed and together: a refusal or failure sends every rank of the
 * export the same code and message, at once, even while a thread still
 * winds down; the export's memory is freed when that thread has stopped.
 * A rank lost before publishing fails the export for all (`rank_lost`
 * naming it); a rank lost while publishing only stops its own stream.
 * Everything here runs on the loop, but for the planning thread's part.
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "daemon/comms.h"
#include "daemon/config.h"
#include "daemon/conn.h"
#include "daemon/drain.h"
#include "daemon/export.h"
#include "daemon/export_run.h"
#include "daemon/gather.h"
#include "daemon/history.h"
#include "daemon/job.h"
#include "daemon/log.h"
#include "daemon/mesh/mesh.h"
#include "daemon/metrics.h"
#include "daemon/moving.h"
#include "daemon/plancache.h"
#include "daemon/pool.h"
#include "daemon/publish.h"
#include "daemon/pump.h"
#include "daemon/registry.h"
#include "daemon/request.h"
#include "daemon/server.h"
#include "daemon/xfer/engine.h"
#include "daemon/xfer/replicas.h"
#include "daemon/xfer/thread.h"
#include "daemon/save.h"
#include "proto/fail.h"
#include "proto/monotonic.h"
#include "proto/text.h"
#include "shardport.h"

const char *export_phase_name(enum job_phase phase) {
  switch (phase) {
  case JOB_WAITING:
    return "waiting";
  case JOB_PLANNING:
    return "planning";
  case JOB_ALLOCATING:
    return "allocating";
  case JOB_MOVING:
    return "moving";
  case JOB_PUBLISHING:
    return "publishing";
  case JOB_WRITING:
    return "writing";
  case JOB_PUBLISHED:
    return "published";
  case JOB_FAILED:
    return "failed";
  }
  return "unknown";
}

bool export_busy(const struct job *job) { return job->running != NULL; }

uint32_t export_rounds(const struct export *ex) {
  return ex->plan != NULL ? (uint32_t)ex->plan->nrounds : 0;
}

static void free_export(struct export *ex) {
  struct pool *pool = ex->job->srv->pool;
  for (uint32_t r = 0; r < ex->job->world; r++) {
    struct export_rank *er = &ex->ranks[r];
    pool_segment_free(pool, er->segment);
    if (er->segment_fd >= 0)
      close(er->segment_fd);
    free(er->part_first);
    request_groups_free(&er->groups);
    /* A rank on another node has no member here. */
    if (er->m == NULL)
      continue;
    if (er->m->conn != NULL)
      conn_on_drained(er->m->conn, NULL, NULL);
    er->m->in_export = false;
  }
  replicas_free(&ex->replicas);
  save_free(ex->save);
  /* The plan borrows the gathered metadata: it goes first. */
  plan_free(ex->new_plan);
  plan_input_store_free(ex->store);
  publish_layout_free(&ex->new_layout);
  mesh_export_free(ex->mx);
  free(ex->ranks);
  free(ex->src);
  free(ex->dst);
  free(ex->dst_size);
  free(ex->dst_warm);
  free(ex->gpu_segments);
  free(ex);
}

/* The journal fields of a line about export ex (log.c), with code when it
 * failed; node is this daemon's node of a job across nodes. */
static struct log_fields export_fields(const struct export *ex, int code) {
  return (struct log_fields){
      .job = ex->job->hex,
      .rank = LOG_NONE,
      .node = ex->job->mesh != NULL ? (int64_t)mesh_self(ex->job) : LOG_NONE,
      .export_id = ex->id,
      .error = code};
}

/* The export is over and no thread runs: record the outcome, free it. */
static void finish(struct export *ex) {
  struct job *job = ex->job;
  uint64_t now = monotonic_ms();
  job->last_round = export_rounds(ex);
  job->last_rounds = export_rounds(ex);
  job->last_bytes_total = ex->bytes_total;
  job->last_bytes_moved = atomic_load(&ex->engine.bytes_moved);
  /* A failed export's history keeps the last rate it moved at. */
  double rate_bps = ex->rate_bps;
  if (!ex->failed) {
    job->last_phase = JOB_PUBLISHED;
    /* The export's figure, as status showed it while it moved (TOTAL, in
     * the same units): the bytes this node moved, and their rate. */
    uint64_t ms = now - ex->moving_ms;
    if (ms > 0)
      rate_bps = (double)ex->bytes_total * 1000.0 / (double)ms;
    char moved[32], rate[32];
    sp_format_bytes(ex->bytes_total, moved, sizeof moved);
    sp_format_bytes(ms > 0 ? ex->bytes_total * 1000 / ms : 0, rate,
                    sizeof rate);
    struct log_fields fields = export_fields(ex, 0);
    log_with(LOG_LEVEL_INFO, &fields,
            "job %s: export %" PRIu64 " published: moved %s in %" PRIu32
            " round(s), %" PRIu64 " ms (%s/s)",
            job->hex, ex->id, moved, export_rounds(ex), now - ex->started_ms,
            rate);
  }
  metrics_export_done(
      job->srv->metrics,
      &(struct metrics_export){
          .code = ex->failed ? ex->fail_code : 0,
          .duration_s = (double)(now - ex->started_ms) / 1000.0,
          .bytes_moved = job->last_bytes_moved,
          .rounds = export_rounds(ex),
          .keys = ex->plan != NULL ? ex->plan->nkeys : 0});
  history_add(&job->history,
              &(struct history_entry){
                  .export_id = ex->id,
                  .failed = ex->failed,
                  .error = ex->failed ? job->error : NULL,
                  .started_ms = ex->started_ms,
                  .ended_ms = now,
                  .rounds = export_rounds(ex),
                  .bytes_moved = job->last_bytes_moved,
                  .bytes_total = ex->bytes_total,
                  .rate_bps = rate_bps});
  job->running = NULL;
  free_export(ex);
  plancache_export_ended(job);
}

/* Fails the export on every rank still waiting for it, with one code and
 * message; stops its thread.  The memory goes when the thread has ended.
 * A failure found on this node of a job across nodes is reported to the
 * job's root, which fails the export on every other node alike. */
static void fail_export_as(struct export *ex, int code, const char *message,
                           bool report);

static void fail_export(struct export *ex, int code, const char *message) {
  fail_export_as(ex, code, message, true);
}

/* The failure status shows.  Its message may carry another daemon's
 * words, which status (a msgpack str) must hold as UTF-8. */
static void set_job_error(struct job *job, int code, const char *message) {
  char text[sizeof job->error];
  snprintf(text, sizeof text, "%s: %s", sp_err_name(code), message);
  sp__text_sanitize(text, job->error, sizeof job->error);
}

static void fail_export_as(struct export *ex, int code, const char *message,
                           bool report) {
  struct job *job = ex->job;
  if (ex->failed)
    return;
  if (report && job->mesh != NULL)
    mesh_failed(job, code, message);
  ex->failed = true;
  ex->fail_code = code;
  job->last_phase = JOB_FAILED;
  set_job_error(job, code, message);
  struct log_fields fields = export_fields(ex, code);
  log_with(LOG_LEVEL_WARN, &fields,
           "job %s: export %" PRIu64 " failed: %s", job->hex,
          ex->id, job->error);
  atomic_store(&ex->engine.cancel, true);
  atomic_store(&ex->plan_stop, true);
  /* The owners writing a save hear it too, whatever they wait for. */
  save_fail(ex->save, code, message);
  for (uint32_t r = 0; r < job->world; r++) {
    struct export_rank *er = &ex->ranks[r];
    if (er->answered)
      continue;
    er->answered = true;
    /* Its reply is complete: the rank may ask for the job's next export
     * at once (docs/protocol.md), which waits for this one to end. */
    if (er->m == NULL)
      continue;
    er->m->in_export = false;
    if (er->m->conn != NULL)
      conn_send_error(er->m->conn, er->request_id, code, "%s", message);
  }
  /* A GPU whose context the failure ended drains the daemon to restart. */
  if (code == SP_EBACKEND)
    drain_check_gpus(job->srv);
}

bool export_any_asked(const struct job *job) {
  for (uint32_t r = 0; r < job->world; r++)
    if (job->members[r] != NULL && job->members[r]->asked)
      return true;
  return false;
}

/* Fails every ask of a gathering export, for status too. */
static void fail_gather(struct job *job, int code, const char *message) {
  job->last_phase = JOB_FAILED;
  set_job_error(job, code, message);
  log_with(LOG_LEVEL_WARN,
           &(struct log_fields){.job = job->hex,
                                .rank = LOG_NONE,
                                .node = job->mesh != NULL
                                            ? (int64_t)mesh_self(job)
                                            : LOG_NONE,
                                .error = code},
           "job %s: export failed before it started: %s",
          job->hex, job->error);
  uint64_t now = monotonic_ms(), first_ask = now;
  for (uint32_t r = 0; r < job->world; r++)
    if (job->members[r] != NULL && job->members[r]->asked &&
        job->members[r]->asked_ms < first_ask)
      first_ask = job->members[r]->asked_ms;
  metrics_export_done(job->srv->metrics,
                      &(struct metrics_export){
                          .code = code,
                          .duration_s = (double)(now - first_ask) / 1000.0});
  history_add(&job->history, &(struct history_entry){.failed = true,
                                                     .error = job->error,
                                                     .started_ms = first_ask,
                                                     .ended_ms = now});
  job->last_round = job->last_rounds = 0;
  job->last_bytes_moved = job->last_bytes_total = 0;
  for (uint32_t r = 0; r < job->world; r++)
    if (job->members[r] != NULL)
      job_answer_ask(job->members[r], code, message);
}

/* The export's communicators, for a job on GPUs across nodes (comms.c):
 * made once every node has the roster (all nodes' planning threads meet
 * in NCCL's set-up) and warmed before the pool is carved.  On the planning
 * thread. */
static int make_comms(struct export *ex) {
  struct comms_want w = {.spans_nodes = ex->mx != NULL,
                         .timeout_ms = ex->timeout_ms,
                         .plan = ex->new_plan};
  for (uint32_t r = 0; r < ex->job->world; r++)
    if (ex->ranks[r].m != NULL)
      comms_want_rank(&w, r, ex->ranks[r].m);
  w.has_id = ex->mx != NULL && mesh_nccl_id(ex->mx, w.id, &w.gen);
  return comms_for_export(ex->job, &w, ex->plan_msg, sizeof ex->plan_msg);
}

/* Reads and compares every local copy of the replicated and plain keys
 * (replicas.c): on one node, every rank's; across nodes, this node's,
 * whose lowest rank's digests then go to the root with `planned`.  On the
 * planning thread: the job's registrations and cached plan do not change
 * while an export runs. */
static int compare_replicas(struct export *ex, const struct plan *plan) {
  struct job *job = ex->job;
  if (!ex->compare)
    return 0;
  const struct xfer_storage **src = calloc(job->world, sizeof *src);
  if (src == NULL)
    return sp__failf(ex->plan_msg, sizeof ex->plan_msg, SP_ENOMEM,
                     "out of memory comparing replicated keys");
  for (uint32_t r = 0; r < job->world; r++)
    if (ex->ranks[r].m != NULL)
      src[r] = ex->ranks[r].m->reg.info;
  int rc = replicas_hash(plan, plan->in, src, ex->compare_threads,
                         &ex->replicas, ex->plan_msg, sizeof ex->plan_msg);
  free(src);
  if (rc == 0)
    rc = replicas_compare(plan, &ex->replicas, ex->plan_msg,
                          sizeof ex->plan_msg);
  return rc;
}

/* The planner's input, on the planning thread: across nodes read from the
 * bytes every node got, on one node from the registries as they are. */
static int plan_input_fill(struct export *ex) {
  struct job *job = ex->job;
  struct plan_input *in;
  int rc = 0;

  ex->store = plan_input_store_new(job->world);
  if (ex->store == NULL) {
    snprintf(ex->plan_msg, sizeof ex->plan_msg,
             "out of memory reading the ranks' registrations");
    return SP_ENOMEM;
  }
  if (ex->mx != NULL)
    rc = mesh_plan_input(ex->mx, ex->store, ex->plan_msg, sizeof ex->plan_msg);
  /* A rank that did not ask is left out, and the planner refuses. */
  for (uint32_t r = 0; ex->mx == NULL && rc == 0 && r < job->world; r++)
    if (ex->ranks[r].m != NULL)
      rc = registry_plan_rank(&ex->ranks[r].m->reg, r, 0, &ex->ranks[r].groups,
                              ex->store, ex->plan_msg, sizeof ex->plan_msg);
  in = plan_input_of(ex->store);
  if (ex->mx == NULL) {
    in->max_keys = ex->max_keys;
    in->max_bytes = ex->max_bytes;
  }
  /* Planning is the export's work until its rounds start: as wide as the
   * copying that follows. */
  in->threads = job->srv->engine_threads;
  in->stop = &ex->plan_stop;
  return rc;
}

static void *plan_main(void *arg) {
  struct export *ex = arg;
  if (!ex->reuse_plan) {
    ex->plan_rc = plan_input_fill(ex);
    if (ex->plan_rc == 0)
      ex->plan_rc = plan_build(plan_input_of(ex->store), &ex->new_plan,
                               ex->plan_msg, sizeof ex->plan_msg);
    if (ex->plan_rc == 0 &&
        publish_layout_build(ex->new_plan, &ex->new_layout) != 0) {
      ex->plan_rc = SP_ENOMEM;
      snprintf(ex->plan_msg, sizeof ex->plan_msg,
               "out of memory laying out the owned tensors");
    }
    if (ex->plan_rc == 0)
      ex->plan_rc = make_comms(ex);
  }
  /* From here the communicators' set-up bounds itself (make_comms). */
  atomic_store(&ex->plan_built, true);
  if (ex->plan_rc == 0)
    ex->plan_rc = compare_replicas(
        ex, ex->reuse_plan ? ex->job->cache.plan : ex->new_plan);
  atomic_store(&ex->planned, true);
  job_wake(ex->job);
  return NULL;
}

/* The owners' tensors go to device segments when the ranks are on GPUs,
 * and the engine runs on the GPUs. */
struct gpu *export_gpu(const struct export *ex) {
  for (uint32_t r = 0; r < ex->job->world; r++)
    if (ex->ranks[r].m != NULL)
      return ex->ranks[r].m->reg.gpu;
  return NULL;
}

static void start_moving(struct export *ex) {
  char msg[512];
  int rc = moving_prepare(ex, msg, sizeof msg);
  if (rc != 0) {
    fail_export(ex, rc, msg);
    return;
  }
  struct engine *e = &ex->engine;
  ex->phase = JOB_MOVING;
  ex->moving_ms = ex->sample_ms = ex->progress_ms = monotonic_ms();
  if (engine_start(e) != 0) {
    fail_export(ex, SP_ENOMEM, "cannot start the engine thread");
    return;
  }
  ex->thread_alive = true;
  pump_progress(ex);
}

/* Every owner's reply streams in parts from here (pump.c). */
static void start_publishing(struct export *ex) {
  ex->phase = JOB_PUBLISHING;
  pump_progress(ex);
  char msg[320];
  int rc = pump_start(ex, msg, sizeof msg);
  if (rc != 0) {
    fail_export(ex, rc, msg);
    return;
  }
  pump_run(ex);
}

/* A save numbers its files from the plan it runs, and refuses a dtype
 * safetensors cannot name, before anything moves (save.c).  0, or fails
 * the export. */
static int prepare_save(struct export *ex, const struct plan *plan) {
  if (ex->save_limit == 0)
    return 0;
  char msg[SP_ERRMSG_MAX + 1];
  int rc = save_new(ex->job, ex->id, plan, ex->save_limit, &ex->save, msg,
                    sizeof msg);
  if (rc != 0)
    fail_export(ex, rc, msg);
  return rc;
}

/* Moves a running export on after its thread finished or its connections
 * drained. */
static void step(struct export *ex) {
  /* Across nodes, the root's go or publish: nothing runs meanwhile. */
  if (ex->await != AWAIT_NONE) {
    if (ex->failed)
      finish(ex);
    return;
  }
  switch (ex->phase) {
  case JOB_PLANNING:
    if (!atomic_load(&ex->planned))
      return;
    pthread_join(ex->planner, NULL);
    ex->thread_alive = false;
    metrics_planning_done(ex->job->srv->metrics,
                          (double)(monotonic_ms() - ex->planning_ms) / 1000.0);
    if (ex->failed)
      break;
    if (ex->plan_rc != 0) {
      fail_export(ex, ex->plan_rc, ex->plan_msg);
      break;
    }
    if (prepare_save(ex, ex->reuse_plan ? ex->job->cache.plan
                                        : ex->new_plan) != 0)
      break;
    if (!ex->reuse_plan) {
      ex->job->plan_digest = ex->new_plan->digest;
      ex->job->has_plan_digest = true;
    }
    if (ex->mx != NULL) {
      /* The export keeps its plan; the root compares digests first. */
      ex->plan = ex->new_plan;
      ex->layout = &ex->new_layout;
      ex->await = AWAIT_GO;
      mesh_planned(ex->job, ex->new_plan->digest, &ex->replicas);
      return;
    }
    if (!ex->reuse_plan && plancache_install(ex) != 0) {
      fail_export(ex, SP_ENOMEM, "out of memory keeping the plan");
      break;
    }
    start_moving(ex);
    if (ex->failed && !ex->thread_alive)
      break;
    return;
  case JOB_MOVING:
    if (!atomic_load(&ex->engine.done)) {
      pump_progress(ex);
      return;
    }
    engine_join(&ex->engine);
    ex->thread_alive = false;
    if (ex->mx != NULL) {
      /* How far the rounds overlapped on the wire (remote.c), for who
       * tunes or tests the data path: counted for the rounds that ended,
       * whether or not the export did. */
      struct log_fields fields = export_fields(ex, 0);
      log_with(LOG_LEVEL_DEBUG, &fields,
               "job %s: export %" PRIu64 ": %" PRIu32 " of %" PRIu32
               " round(s) sent the next round's first bytes before their "
               "own last local copy ended",
               ex->job->hex, ex->id, ex->engine.rounds_overlapped,
               export_rounds(ex));
    }
    if (ex->failed)
      break;
    if (ex->engine.rc != 0) {
      fail_export(ex, ex->engine.rc, ex->engine.msg);
      if (ex->engine.rc == SP_ENODELOST && ex->engine.lost_node != PLAN_NONE)
        mesh_data_lost(ex->job, ex->engine.lost_node, ex->engine.msg);
      break;
    }
    if (ex->mx != NULL) {
      /* Published only once every node moved its data. */
      ex->await = AWAIT_PUBLISH;
      mesh_moved(ex->job);
      return;
    }
    start_publishing(ex);
    if (ex->failed)
      break;
    /* Every reply may already be queued. */
    __attribute__((fallthrough));
  case JOB_PUBLISHING:
    pump_run(ex);
    for (uint32_t r = 0; r < ex->job->world; r++)
      if (!ex->ranks[r].answered)
        return;
    if (ex->save != NULL && !ex->failed) {
      ex->phase = JOB_WRITING;
      pump_progress(ex);
      return;
    }
    break;
  case JOB_WRITING:
    if (!ex->failed && !save_pump(ex->save))
      return;
    break;
  default:
    break;
  }
  if (!ex->thread_alive)
    finish(ex);
}

/* A member's part in the gather (gather.h). */
static void member_ask(const void *ctx, uint32_t r, struct gather_ask *out) {
  const struct job *job = ctx;
  const struct job_member *m = job->members[r];
  *out = (struct gather_ask){.joined = m != NULL};
  if (m == NULL || !m->asked)
    return;
  out->asked = true;
  out->max_keys = m->ask.max_keys;
  out->max_bytes = m->ask.max_bytes;
  out->timeout_ms = m->ask.timeout_ms;
  out->save = m->ask.save;
  out->deadline_ms = m->ask_deadline_ms;
}

static struct gather_ranks gather_of(const struct job *job) {
  return (struct gather_ranks){.world = job->world, .ask = member_ask,
                               .ctx = job};
}

/* The export a gather made, on one node or across nodes (mx): the asks of
 * this node's ranks become its own (a rank of another node is answered by
 * its daemon), with the options every rank agreed on.  NULL when out of
 * memory. */
static struct export *begin_export(struct job *job, struct mesh_export *mx,
                                   uint64_t id,
                                   const struct gather_options *o) {
  struct export *ex = calloc(1, sizeof *ex);
  if (ex != NULL) {
    ex->ranks = calloc(job->world, sizeof *ex->ranks);
  }
  if (ex == NULL || ex->ranks == NULL) {
    if (ex != NULL)
      free(ex->ranks);
    free(ex);
    return NULL;
  }
  ex->job = job;
  ex->mx = mx;
  ex->id = id;
  job->next_export_id = id + 1;
  ex->max_keys = o->max_keys;
  ex->max_bytes = o->max_bytes;
  ex->save_limit = o->save_limit;
  ex->timeout_ms = o->timeout_ms;
  ex->started_ms = monotonic_ms();
  for (uint32_t r = 0; r < job->world; r++) {
    struct job_member *m = job->members[r];
    struct export_rank *er = &ex->ranks[r];
    er->segment_fd = -1;
    er->sent_phase = JOB_WAITING;
    if (m == NULL || m->lost || !m->asked) {
      er->answered = true;
      continue;
    }
    er->m = m;
    er->request_id = m->ask_id;
    er->progress = m->ask.progress;
    er->groups = m->ask.groups;
    memset(&m->ask.groups, 0, sizeof m->ask.groups);
    m->asked = false;
    m->in_export = true;
  }
  job->running = ex;
  job->error[0] = '\0';
  struct log_fields fields = export_fields(ex, 0);
  if (mx != NULL)
    log_with(LOG_LEVEL_INFO, &fields,
             "job %s: export %" PRIu64 " started (node %" PRIu32 ")",
             job->hex, ex->id, mesh_self(job));
  else
    log_with(LOG_LEVEL_INFO, &fields, "job %s: export %" PRIu64 " started",
             job->hex, ex->id);
  ex->compare = job->srv->cfg->compare_replicas;
  ex->compare_threads = job->srv->engine_threads;
  return ex;
}

/* The planning thread starts (plan_main), one node or many. */
static void start_planning(struct export *ex) {
  ex->phase = JOB_PLANNING;
  pump_progress(ex);
  ex->planning_ms = monotonic_ms();
  if (xfer_spawn(&ex->planner, plan_main, ex) != 0) {
    fail_export(ex, SP_ENOMEM, "cannot start the planning thread");
    finish(ex);
    return;
  }
  ex->thread_alive = true;
}

static void maybe_start(struct job *job) {
  /* A push reads the same registries: one of them runs at a time. */
  if (job->dying || job->running != NULL || job->pushing != NULL)
    return;
  /* Across nodes the root gathers the asks and announces the export. */
  if (job->mesh != NULL) {
    mesh_asks(job);
    mesh_try_start(job);
    return;
  }
  /* A rank left and has not joined again: the export cannot complete. */
  char gone[SP_ERRMSG_MAX + 1];
  if (job_departed(job, gone, sizeof gone)) {
    if (export_any_asked(job))
      fail_gather(job, SP_ERANKLOST, gone);
    return;
  }
  for (uint32_t r = 0; r < job->world; r++) {
    const struct job_member *m = job->members[r];
    if (m == NULL || m->lost || !m->asked)
      return;
  }
  struct gather_ranks g = gather_of(job);
  struct gather_options o;
  char msg[256];
  int rc = gather_agree(&g, job->srv->cfg, &o, msg, sizeof msg);
  if (rc != 0) {
    fail_gather(job, rc, msg);
    return;
  }
  struct export *ex = begin_export(job, NULL, job->next_export_id, &o);
  if (ex == NULL) {
    fail_gather(job, SP_ENOMEM, "out of memory starting the export");
    return;
  }
  ex->reuse_plan = plancache_applies(ex);
  if (ex->reuse_plan && !ex->compare) {
    if (prepare_save(ex, job->cache.plan) == 0)
      start_moving(ex);
    if (ex->failed && !ex->thread_alive)
      finish(ex);
    return;
  }
  start_planning(ex);
}

void export_advance(struct job *job) {
  if (job->running != NULL)
    step(job->running);
  if (job->running == NULL)
    maybe_start(job);
}

void export_member_lost(struct job *job, struct job_member *m) {
  if (m->lost_handled)
    return;
  m->lost_handled = true;
  char stopping[128];
  snprintf(stopping, sizeof stopping, "shardportd is stopping; job %s ends",
           job->hex);
  struct export *ex = job->running;
  if (ex != NULL)
    save_rank_gone(ex->save, m->rank);
  /* A save needs every rank until its commit is passed: one lost while
   * it writes fails it everywhere; one that leaves once it has its last
   * reply fails nothing. */
  bool saving = ex != NULL && ex->save_limit != 0 && !save_committed(ex->save);
  if (ex != NULL && (!ex->ranks[m->rank].answered || saving)) {
    if (ex->phase < JOB_PUBLISHING || saving) {
      char during[64], msg[SP_ERRMSG_MAX + 1];
      snprintf(during, sizeof during, " during export %" PRIu64, ex->id);
      job_departure_text(job, m->rank, m->disconnected, during, m->refused,
                         msg, sizeof msg);
      fail_export(ex, SP_ERANKLOST, job->dying ? stopping : msg);
    } else {
      /* The data is whole; only this rank's own stream stops. */
      ex->ranks[m->rank].answered = true;
      m->in_export = false;
    }
  }
  /* Across nodes the root hears of the loss (mesh_rank_left) and fails
   * the ranks waiting on every node alike. */
  if (job->mesh != NULL) {
    job_wake(job);
    return;
  }
  /* Ranks waiting for the next export would wait for this one in vain
   * (ranks that ask later hear it from maybe_start). */
  char gone[SP_ERRMSG_MAX + 1];
  if (export_any_asked(job) &&
      (job->dying || job_departed(job, gone, sizeof gone)))
    fail_gather(job, SP_ERANKLOST, job->dying ? stopping : gone);
  job_wake(job);
}

void export_tick(struct job *job) {
  uint64_t now = monotonic_ms();
  struct export *ex = job->running;
  if (ex == NULL) {
    /* Across nodes the root watches the asks' deadlines (mesh/coord.c). */
    struct gather_ranks g = gather_of(job);
    char msg[300];
    int rc;
    if (job->mesh == NULL &&
        (rc = gather_overdue(&g, now, job->hex, msg, sizeof msg)) != 0)
      fail_gather(job, rc, msg);
    return;
  }
  if (ex->phase == JOB_PLANNING && !ex->failed &&
      !atomic_load(&ex->plan_built) && now - ex->planning_ms > ex->timeout_ms) {
    /* The planner stops at its next look at plan_stop and frees what it
     * took; the export's memory goes once its thread has ended. */
    char msg[200];
    snprintf(msg, sizeof msg,
             "export %" PRIu64 " of job %s: planning took longer than the "
             "export's timeout of %" PRIu32 " ms",
             ex->id, job->hex, ex->timeout_ms);
    fail_export(ex, SP_ETIMEOUT, msg);
  }
  if (ex->phase == JOB_MOVING && !ex->failed) {
    uint64_t moved = atomic_load(&ex->engine.bytes_moved);
    if (moved != ex->sample_bytes || atomic_load(&ex->engine.done)) {
      double inst = now > ex->sample_ms
                        ? (double)(moved - ex->sample_bytes) * 1000.0 /
                              (double)(now - ex->sample_ms)
                        : 0.0;
      ex->rate_bps = ex->rate_bps > 0 ? 0.5 * ex->rate_bps + 0.5 * inst : inst;
      ex->sample_bytes = moved;
      ex->sample_ms = ex->progress_ms = now;
    } else if (now - ex->progress_ms > ex->timeout_ms &&
               ex->engine.round_delay_ms == 0 && job->mesh == NULL) {
      /* Across nodes, the exchange's own idle timeout names the node that
       * stalled (remote.c), and the root's beats its silence. */
      char msg[200];
      snprintf(msg, sizeof msg,
               "export %" PRIu64 " of job %s moved nothing for %" PRIu32 " ms",
               ex->id, job->hex, ex->timeout_ms);
      fail_export(ex, SP_ETIMEOUT, msg);
    }
    pump_progress(ex);
  }
  if (ex->phase == JOB_WRITING && !ex->failed &&
      now - save_progress_ms(ex->save) > ex->timeout_ms) {
    char msg[200];
    snprintf(msg, sizeof msg,
             "export %" PRIu64 " of job %s: the save's ranks on this daemon "
             "wrote and reported nothing for %" PRIu32 " ms",
             ex->id, job->hex, ex->timeout_ms);
    fail_export(ex, SP_ETIMEOUT, msg);
  }
  if (ex->phase == JOB_PUBLISHING && now - ex->progress_ms > ex->timeout_ms) {
    /* A rank that does not read its reply would hold the job forever. */
    for (uint32_t r = 0; r < job->world; r++) {
      struct export_rank *er = &ex->ranks[r];
      if (!er->answered && er->m->conn != NULL) {
        log_with(LOG_LEVEL_WARN, LOG_JOB(job->hex),
                 "job %s: rank %" PRIu32 " did not read its export reply in "
                 "%" PRIu32 " ms; disconnecting it",
                 job->hex, r, ex->timeout_ms);
        conn_close(er->m->conn);
      }
    }
  }
}

void export_view(const struct job *job, struct export_view *out) {
  memset(out, 0, sizeof *out);
  for (uint32_t r = 0; r < job->world; r++) {
    const struct job_member *m = job->members[r];
    for (const struct job_published *p = m != NULL ? m->published : NULL;
         p != NULL; p = p->next)
      out->pool_used += p->segment != NULL ? p->segment->size : 0;
  }
  const struct export *ex = job->running;
  if (ex != NULL) {
    out->phase = ex->failed ? JOB_FAILED : ex->phase;
    out->export_id = ex->id;
    out->rounds = export_rounds(ex);
    /* A save's writing comes after every round. */
    bool moved = ex->phase == JOB_PUBLISHING || ex->phase == JOB_WRITING;
    out->round = ex->phase == JOB_MOVING ? atomic_load(&ex->engine.round)
                 : moved                 ? out->rounds
                                         : 0;
    /* Before round 1 the engine prepares the owners' segments; on a big
     * first export that is most of the time, and must not read as a
     * stall. */
    out->bytes_to_prepare = ex->bytes_to_prepare;
    out->bytes_prepared = out->round > 0 || moved
                              ? ex->bytes_to_prepare
                              : atomic_load(&ex->engine.bytes_prepared);
    if (out->phase == JOB_MOVING && out->round == 0)
      out->phase = JOB_ALLOCATING;
    out->bytes_total = ex->bytes_total;
    out->bytes_moved =
        ex->phase >= JOB_MOVING ? atomic_load(&ex->engine.bytes_moved) : 0;
    out->rate_bps = ex->rate_bps;
    if (ex->save != NULL)
      save_bytes(ex->save, &out->bytes_written, &out->bytes_to_write);
    for (uint32_t r = 0; r < job->world; r++)
      out->pool_used +=
          ex->ranks[r].segment != NULL ? ex->ranks[r].segment->size : 0;
    return;
  }
  out->export_id = job->next_export_id - 1;
  /* An export that failed while its ranks asked is an outcome too, also
   * before the job's first export id. */
  if (export_any_asked(job) || job->history.total == 0) {
    out->phase = JOB_WAITING;
    return;
  }
  out->phase = job->last_phase;
  out->round = job->last_round;
  out->rounds = job->last_rounds;
  out->bytes_moved = job->last_bytes_moved;
  out->bytes_total = job->last_bytes_total;
  /* Nothing moves now: no rate (the log has the export's own). */
  out->rate_bps = 0;
}

/* The wing's callbacks (daemon/mesh/mesh.h, struct mesh_ops). */
static int on_mesh_start(struct job *job, struct mesh_export *mx,
                         uint64_t export_id, const struct gather_options *o,
                         char *msg, size_t msglen) {
  if (job->running != NULL) {
    snprintf(msg, msglen, "job %s is still running export %" PRIu64,
             job->hex, job->running->id);
    return SP_ESTATE;
  }
  struct export *ex = begin_export(job, mx, export_id, o);
  if (ex == NULL) {
    snprintf(msg, msglen, "out of memory starting the export");
    return SP_ENOMEM;
  }
  start_planning(ex);
  return 0;
}

static void on_mesh_go(struct job *job,
                       const struct replica_differ *differ) {
  struct export *ex = job->running;
  if (ex == NULL || ex->await != AWAIT_GO || ex->failed)
    return;
  if (differ != NULL) {
    /* Every node names the key from its own plan, which is every node's:
     * one message everywhere, which the root passes on as any failure.
     * The export still awaits go, so the next step frees it. */
    char msg[SP_ERRMSG_MAX + 1];
    uint32_t key = replicas_key_at(ex->plan, differ->key);
    if (key == PLAN_NONE)
      fail_export(ex, SP_EBADMSG,
                  "the root named a replicated key this plan does not have");
    else
      fail_export(ex, replicas_refuse(ex->plan, key, differ->ranks[0],
                                      differ->digests[0], differ->ranks[1],
                                      differ->digests[1], 0, msg, sizeof msg),
                  msg);
    job_wake(job);
    return;
  }
  ex->await = AWAIT_NONE;
  start_moving(ex);
  if (ex->failed && !ex->thread_alive)
    finish(ex);
}

static void on_mesh_publish(struct job *job) {
  struct export *ex = job->running;
  if (ex == NULL || ex->await != AWAIT_PUBLISH || ex->failed)
    return;
  ex->await = AWAIT_NONE;
  start_publishing(ex);
  /* Replies stream, and the export ends, from the job's wake-ups. */
  job_wake(job);
}

static void on_mesh_fail(struct job *job, int code, const char *message) {
  if (job->running == NULL)
    return;
  fail_export_as(job->running, code, message, false);
  job_wake(job);
}

void export_abort(struct job *job, int code, const char *message) {
  if (job->running != NULL)
    fail_export(job->running, code, message);
  export_fail_asks(job, code, message);
  job_wake(job);
}

void export_fail_asks(struct job *job, int code, const char *message) {
  if (export_any_asked(job))
    fail_gather(job, code, message);
}

struct save *export_save(const struct job *job) {
  return job->running != NULL ? job->running->save : NULL;
}

void export_fail_running(struct job *job, int code, const char *message) {
  if (job->running == NULL)
    return;
  fail_export(job->running, code, message);
  job_wake(job);
}

/* What the wing calls back: the job's own functions, and the export's
 * above (one table, handed to the wing in srv->mesh_ops). */
const struct mesh_ops export_mesh_ops = {
    .now_ms = monotonic_ms,
    .wake = job_wake,
    .schedule = job_schedule,
    .end = job_end,
    .terminate = job_terminate,
    .find = job_find,
    .shadow = job_new,
    .admit = job_admit,
    .note_joined = job_note_joined,
    .rank_departed = job_rank_departed,
    .rank_returned = job_rank_returned,
    .departed = job_departed,
    .departure_text = job_departure_text,
    .answer_ask = job_answer_ask,
    .start = on_mesh_start,
    .go = on_mesh_go,
    .publish = on_mesh_publish,
    .fail = on_mesh_fail,
    .fail_asks = export_fail_asks,
    .any_asked = export_any_asked,
    .commit = save_commit,
};
