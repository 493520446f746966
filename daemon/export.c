/*
 * export.c - one export of a job, from the ranks' requests to their
 * replies; see export.h and docs/protocol.md ("export").
 *
 *   waiting     ranks ask; the export starts when every rank of the job has
 *               asked (each ask has a deadline; the first to pass fails
 *               every asking rank with `timeout`).
 *   planning    plan_build and the publication layout run on a worker
 *               thread (a big job's plan takes long enough to stall the
 *               loop); skipped when the job's cached plan still applies.
 *               The same thread then compares the copies of replicated
 *               and plain keys (replicas.c), cached plan or not: the data
 *               may have changed since the last export.
 *               Bounded by the export's timeout: past it the export fails
 *               with `timeout` and the planner is told to stop.
 *   moving      the owners' pool segments are allocated, then the engine
 *               thread runs the rounds (engine.c).
 *   publishing  each rank's owned tensors are streamed to it in parts, no
 *               faster than its connection takes them.
 *   writing     a save only (save.c): the owners write their files and
 *               meet at the commit's barriers; the export ends when the
 *               last one is passed.
 *   published / failed   the outcome, kept for status.
 *
 * Fail closed and together: a refusal or failure sends every rank of the
 * export the same code and message, at once, even while a thread still
 * winds down; the export's memory is freed when that thread has stopped.
 * A rank lost before publishing fails the export for all (`rank_lost`
 * naming it); a rank lost while publishing only stops its own stream.
 * Everything here runs on the loop.
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "daemon/config.h"
#include "daemon/conn.h"
#include "daemon/drain.h"
#include "daemon/export.h"
#include "daemon/gather.h"
#include "daemon/history.h"
#include "daemon/job.h"
#include "daemon/log.h"
#include "daemon/mesh/mesh.h"
#include "daemon/metrics.h"
#include "daemon/pool.h"
#include "daemon/publish.h"
#include "daemon/registry.h"
#include "daemon/request.h"
#include "daemon/server.h"
#include "daemon/xfer/engine.h"
#include "daemon/xfer/remote.h"
#include "daemon/xfer/replicas.h"
#include "daemon/xfer/thread.h"
#include "daemon/save.h"
#include "proto/fail.h"
#include "proto/monotonic.h"
#include "proto/text.h"
#include "shardport.h"

struct export_rank {
  struct job_member *m;
  uint64_t request_id;
  bool progress;
  /* Got its error or every part of its reply. */
  bool answered;
  struct req_groups groups;
  struct pool_segment *segment; /* until handed to a job_published */
  int segment_fd;               /* a duplicate for part 0 of the reply, or -1 */
  /* A device segment's handles for part 0 of the reply (copied: the rank
   * may release the export before part 0 is written). */
  bool device_segment;
  struct gpu_segment_info device_info;
  size_t *part_first;
  size_t nparts;
  size_t next_part;
  /* What the last progress frame said. */
  uint32_t sent_round;
  uint64_t sent_bytes;
  enum job_phase sent_phase;
};

struct export {
  struct job *job;
  uint64_t id;
  enum job_phase phase;
  uint32_t max_keys;
  uint64_t max_bytes;
  uint32_t timeout_ms; /* the smallest the ranks asked for */
  /* A save: its files' limit (0 for an export), and once planned its
   * numbering and commit (save.c). */
  uint64_t save_limit;
  struct save *save;
  struct export_rank *ranks;
  bool failed;
  int fail_code; /* the code it failed with, once failed */
  /* Planning: the worker's input and output. */
  struct plan_rank_in *rin;
  struct plan_input in;
  struct plan *new_plan;
  struct publish_layout new_layout;
  int plan_rc;
  char plan_msg[SP_ERRMSG_MAX + 1];
  uint64_t planning_ms;    /* when the planning thread started */
  _Atomic bool plan_stop;  /* read by plan_build (plan_input.stop) */
  _Atomic bool plan_built; /* plan_build and the layout are done */
  _Atomic bool planned;
  pthread_t planner;
  bool thread_alive;
  /* The job's cached plan applies: the planning thread only compares. */
  bool reuse_plan;
  /* The digests of the local ranks' replicated and plain keys. */
  struct replica_digests replicas;
  /* compare_replicas and engine_threads as the export started: a reload
   * (reload.c) rewrites the configuration on the loop while the planning
   * thread runs. */
  bool compare;
  uint32_t compare_threads;
  /* The plan used, owned by the job's cache. */
  const struct plan *plan;
  const struct publish_layout *layout;
  uint64_t bytes_total;
  uint64_t bytes_to_prepare; /* the owners' segments on this node */
  uint64_t part_limit; /* the most bytes of one reply frame */
  /* Moving. */
  struct engine engine;
  const struct xfer_storage **src;
  uint8_t **dst;
  uint64_t *dst_size;
  bool *dst_warm;
  /* On the CUDA backend: the owners' device segments and the engine's
   * GPU part (daemon/cuda/gpu.h). */
  struct gpu_segment **gpu_segments;
  struct gpu_run gpu_run;
  /* A job across nodes (daemon/mesh/): the gathered metadata and data plane,
   * and which word of the root the export waits for. */
  struct mesh_export *mx;
  enum { AWAIT_NONE, AWAIT_GO, AWAIT_PUBLISH } await;
  /* Watching. */
  uint64_t started_ms, moving_ms, sample_ms, progress_ms;
  uint64_t sample_bytes;
  double rate_bps;
};

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

static void drop_cache_now(struct job *job) {
  plan_free(job->cached_plan);
  job->cached_plan = NULL;
  publish_layout_free(&job->cached_layout);
  if (job->cached_groups != NULL)
    for (uint32_t r = 0; r < job->world; r++)
      free(job->cached_groups[r]);
  free(job->cached_groups);
  free(job->cached_groups_len);
  job->cached_groups = NULL;
  job->cached_groups_len = NULL;
  job->cache_stale = false;
}

void export_drop_cache(struct job *job) {
  /* The running export reads the cached plan until it finishes. */
  if (job->running != NULL)
    job->cache_stale = true;
  else
    drop_cache_now(job);
}

static bool cache_applies(const struct export *ex) {
  const struct job *job = ex->job;
  if (job->cached_plan == NULL || job->cached_max_keys != ex->max_keys ||
      job->cached_max_bytes != ex->max_bytes)
    return false;
  for (uint32_t r = 0; r < job->world; r++) {
    const struct req_groups *g = &ex->ranks[r].groups;
    if (job->cached_groups_len[r] != g->blob_len ||
        (g->blob_len > 0 &&
         memcmp(job->cached_groups[r], g->blob, g->blob_len) != 0))
      return false;
  }
  return true;
}

/* The new plan becomes the job's cache; the export reads it from there. */
static int cache_install(struct export *ex) {
  struct job *job = ex->job;
  char **groups = calloc(job->world, sizeof *groups);
  size_t *lens = calloc(job->world, sizeof *lens);
  bool ok = groups != NULL && lens != NULL;
  for (uint32_t r = 0; ok && r < job->world; r++) {
    const struct req_groups *g = &ex->ranks[r].groups;
    lens[r] = g->blob_len;
    groups[r] = malloc(g->blob_len > 0 ? g->blob_len : 1);
    ok = groups[r] != NULL;
    if (ok && g->blob_len > 0)
      memcpy(groups[r], g->blob, g->blob_len);
  }
  if (!ok) {
    for (uint32_t r = 0; groups != NULL && r < job->world; r++)
      free(groups[r]);
    free(groups);
    free(lens);
    return SP_ENOMEM;
  }
  drop_cache_now(job);
  job->cached_plan = ex->new_plan;
  job->cached_layout = ex->new_layout;
  job->cached_max_keys = ex->max_keys;
  job->cached_max_bytes = ex->max_bytes;
  job->cached_groups = groups;
  job->cached_groups_len = lens;
  ex->new_plan = NULL;
  memset(&ex->new_layout, 0, sizeof ex->new_layout);
  return 0;
}

static void send_progress(struct export *ex, struct export_rank *er,
                          uint32_t round, uint32_t rounds, uint64_t moved) {
  if (!er->progress || er->answered || er->m->conn == NULL)
    return;
  struct sp_msgbuf mb;
  sp_msgbuf_begin(&mb, "progress", er->request_id, 5);
  sp_pack_kv_str(&mb.pk, "phase", export_phase_name(ex->phase));
  sp_pack_kv_u64(&mb.pk, "round", round);
  sp_pack_kv_u64(&mb.pk, "rounds", rounds);
  sp_pack_kv_u64(&mb.pk, "bytes_moved", moved);
  sp_pack_kv_u64(&mb.pk, "bytes_total", ex->bytes_total);
  conn_send_msgbuf(er->m->conn, &mb);
  er->sent_round = round;
  er->sent_bytes = moved;
  er->sent_phase = ex->phase;
}

static uint32_t plan_rounds(const struct export *ex) {
  return ex->plan != NULL ? (uint32_t)ex->plan->nrounds : 0;
}

/* Tells every rank that asked for progress what changed since it last
 * heard; a phase change always goes out. */
static void progress_all(struct export *ex) {
  uint32_t round = ex->phase == JOB_MOVING ? atomic_load(&ex->engine.round)
                   : ex->phase == JOB_PUBLISHING ? plan_rounds(ex)
                                                 : 0;
  uint64_t moved =
      ex->phase >= JOB_MOVING ? atomic_load(&ex->engine.bytes_moved) : 0;
  for (uint32_t r = 0; r < ex->job->world; r++) {
    struct export_rank *er = &ex->ranks[r];
    if (er->sent_phase != ex->phase || er->sent_round != round ||
        er->sent_bytes != moved)
      send_progress(ex, er, round, plan_rounds(ex), moved);
  }
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
  publish_layout_free(&ex->new_layout);
  mesh_export_free(ex->mx);
  free(ex->ranks);
  free(ex->rin);
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
  job->last_round = plan_rounds(ex);
  job->last_rounds = plan_rounds(ex);
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
            job->hex, ex->id, moved, plan_rounds(ex), now - ex->started_ms,
            rate);
  }
  metrics_export_done(
      job->srv->metrics,
      &(struct metrics_export){
          .code = ex->failed ? ex->fail_code : 0,
          .duration_s = (double)(now - ex->started_ms) / 1000.0,
          .bytes_moved = job->last_bytes_moved,
          .rounds = plan_rounds(ex),
          .keys = ex->plan != NULL ? ex->plan->nkeys : 0});
  history_add(&job->history,
              &(struct history_entry){
                  .export_id = ex->id,
                  .failed = ex->failed,
                  .error = ex->failed ? job->error : NULL,
                  .started_ms = ex->started_ms,
                  .ended_ms = now,
                  .rounds = plan_rounds(ex),
                  .bytes_moved = job->last_bytes_moved,
                  .bytes_total = ex->bytes_total,
                  .rate_bps = rate_bps});
  job->running = NULL;
  free_export(ex);
  if (job->cache_stale)
    drop_cache_now(job);
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
  sp_text_sanitize(text, job->error, sizeof job->error);
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

/* A job on GPUs across nodes: this node's communicators, one per local
 * rank, made by the first export once every node has the roster (all
 * nodes' planning threads meet in NCCL's set-up) and warmed before the
 * pool is carved; kept for the job's next exports.  Runs on the planning
 * thread: the set-up blocks until every node's ranks joined, or the
 * export's timeout. */
static int make_comms(struct export *ex) {
  struct job *job = ex->job;
  struct gpu *gpu = NULL;
  struct gpu_comm_rank ranks[64];
  size_t n = 0;
  for (uint32_t r = 0; r < job->world; r++) {
    const struct job_member *m = ex->ranks[r].m;
    if (m == NULL)
      continue;
    gpu = m->reg.gpu;
    if (n == sizeof ranks / sizeof ranks[0])
      break;
    ranks[n++] = (struct gpu_comm_rank){.rank = r, .device = m->reg.device};
  }
  uint8_t id[GPU_NCCL_ID_BYTES];
  uint64_t gen = 0;
  bool has_id = ex->mx != NULL && mesh_nccl_id(ex->mx, id, &gen);
  /* No more communicators are started as ranks join (the loop does not
   * touch them while this export runs). */
  job->comms_join_over = true;
  if (job->comms_early) {
    /* Generation 0's, started as the ranks joined: waited for (bounded by
     * the export's timeout) and warmed when they are this export's local
     * ranks, else dropped and made as below. */
    job->comms_early = false;
    if (ex->mx != NULL && gpu != NULL && has_id && gen == 0 &&
        gpu_comms_match(job->gpu_comms, ranks, n)) {
      int rc = gpu_comms_warm(job->gpu_comms, ex->timeout_ms, ex->plan_msg,
                              sizeof ex->plan_msg);
      if (rc != 0) {
        gpu_comms_free(job->gpu_comms);
        job->gpu_comms = NULL;
        return rc;
      }
      job->gpu_comms_gen = 0;
      log_with(LOG_LEVEL_INFO, LOG_JOB(job->hex),
               "job %s: %zu NCCL communicator(s) of %" PRIu32 " ranks, made "
               "as the ranks joined, warmed on this node (generation 0)",
               job->hex, n, job->world);
      return 0;
    }
    gpu_comms_abort(job->gpu_comms);
    gpu_comms_free(job->gpu_comms);
    job->gpu_comms = NULL;
  }
  if (ex->mx == NULL || gpu == NULL)
    return 0;
  if (job->gpu_comms != NULL) {
    if (job->gpu_comms_gen == gen) {
      if (!gpu_comms_failed(job->gpu_comms))
        return 0;
      snprintf(ex->plan_msg, sizeof ex->plan_msg,
               "job %s's NCCL communicators were aborted by an earlier "
               "failure and its root daemon sent no new NCCL id",
               job->hex);
      return SP_EBACKEND;
    }
    /* A new generation: an export since these were made failed (and may
     * have aborted them), so every node drops its own and makes new ones
     * from the fresh id the root sent.  Aborted, not finalized: a peer's
     * may be gone. */
    log_with(LOG_LEVEL_INFO, LOG_JOB(job->hex),
             "job %s: NCCL communicators of generation %" PRIu64
             " replaced by generation %" PRIu64 "%s",
             job->hex, job->gpu_comms_gen, gen,
             gpu_comms_failed(job->gpu_comms) ? " (they were aborted)" : "");
    gpu_comms_abort(job->gpu_comms);
    gpu_comms_free(job->gpu_comms);
    job->gpu_comms = NULL;
  }
  if (!has_id) {
    snprintf(ex->plan_msg, sizeof ex->plan_msg,
             "job %s spans nodes on GPUs, but its root daemon made no NCCL "
             "id (it does not serve the CUDA backend)",
             job->hex);
    return SP_EBACKEND;
  }
  int rc = gpu_comms_create(gpu, id, job->world, ranks, n, ex->timeout_ms,
                            &job->gpu_comms, ex->plan_msg,
                            sizeof ex->plan_msg);
  if (rc == 0) {
    job->gpu_comms_gen = gen;
    log_with(LOG_LEVEL_INFO, LOG_JOB(job->hex),
             "job %s: %zu NCCL communicator(s) of %" PRIu32 " ranks made and "
             "warmed on this node (generation %" PRIu64 ")",
             job->hex, n, job->world, gen);
  }
  return rc;
}

/* Drops the join-time communicators; the first export makes them. */
static void drop_early_comms(struct job *job) {
  gpu_comms_abort(job->gpu_comms);
  gpu_comms_free(job->gpu_comms);
  job->gpu_comms = NULL;
  job->comms_early = false;
  job->comms_join_over = true;
}

void export_comms_join(struct job *job) {
  if (job->running != NULL || job->comms_join_over || job->dying ||
      job->mesh == NULL || !job->has_nccl_id ||
      (job->gpu_comms != NULL && !job->comms_early))
    return;
  struct gpu *gpu = NULL;
  struct gpu_comm_rank ranks[64];
  size_t n = 0;
  for (uint32_t r = 0; r < job->world && n < 64; r++) {
    const struct job_member *m = job->members[r];
    if (m == NULL || m->lost || m->reg.gpu == NULL ||
        (job->gpu_comms != NULL && gpu_comms_holds(job->gpu_comms, r)))
      continue;
    gpu = m->reg.gpu;
    ranks[n++] = (struct gpu_comm_rank){.rank = r, .device = m->reg.device};
  }
  char msg[SP_ERRMSG_MAX + 1] = "";
  int rc = 0;
  if (n > 0) {
    if (job->gpu_comms == NULL) {
      rc = gpu_comms_begin(gpu, job->nccl_id, job->world, &job->gpu_comms,
                           msg, sizeof msg);
      if (rc != 0) {
        job->gpu_comms = NULL;
        job->comms_join_over = true;
        return;
      }
      job->comms_early = true;
      job->gpu_comms_gen = 0;
    }
    rc = gpu_comms_add(job->gpu_comms, ranks, n, msg, sizeof msg);
    if (rc == 0)
      log_with(
          LOG_LEVEL_INFO, LOG_JOB(job->hex),
          "job %s: NCCL communicator(s) of %zu rank(s) starting, generation "
          "0, as the rank(s) joined",
          job->hex, n);
    job->comms_ready = false;
  }
  if (rc == 0 && job->comms_early && !job->comms_ready) {
    rc = gpu_comms_poll(job->gpu_comms, msg, sizeof msg);
    if (rc == 0) {
      job->comms_ready = true;
      log_with(LOG_LEVEL_INFO, LOG_JOB(job->hex),
               "job %s: communicators ready on this node (made as the ranks "
               "joined; the first export warms them)",
               job->hex);
    }
  }
  if (rc < 0) {
    log_with(LOG_LEVEL_INFO, LOG_JOB(job->hex),
             "job %s: the NCCL communicators started as ranks joined failed "
             "(%s); the first export makes them",
             job->hex, msg);
    drop_early_comms(job);
  }
}

void export_comms_rank_left(struct job *job, uint32_t r) {
  if (!job->comms_early || !gpu_comms_holds(job->gpu_comms, r))
    return;
  log_with(LOG_LEVEL_INFO, LOG_JOB(job->hex),
           "job %s: rank %" PRIu32 " left before the first export: its NCCL "
           "communicator and this node's others are aborted; the first "
           "export makes them",
           job->hex, r);
  drop_early_comms(job);
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
    return sp_failf(ex->plan_msg, sizeof ex->plan_msg, SP_ENOMEM,
                    "out of memory comparing replicated keys");
  for (uint32_t r = 0; r < job->world; r++)
    if (ex->ranks[r].m != NULL)
      src[r] = ex->ranks[r].m->reg.info;
  int rc = replicas_hash(plan, &ex->in, src, ex->compare_threads,
                         &ex->replicas, ex->plan_msg, sizeof ex->plan_msg);
  free(src);
  if (rc == 0)
    rc = replicas_compare(plan, &ex->replicas, ex->plan_msg,
                          sizeof ex->plan_msg);
  return rc;
}

static void *plan_main(void *arg) {
  struct export *ex = arg;
  if (!ex->reuse_plan) {
    /* Across nodes, the input is read from the bytes every node got. */
    ex->plan_rc = ex->mx != NULL ? mesh_plan_input(ex->mx, &ex->in,
                                                   ex->plan_msg,
                                                   sizeof ex->plan_msg)
                                 : 0;
    ex->in.stop = &ex->plan_stop;
    if (ex->plan_rc == 0)
      ex->plan_rc = plan_build(&ex->in, &ex->new_plan, ex->plan_msg,
                               sizeof ex->plan_msg);
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
        ex, ex->reuse_plan ? ex->job->cached_plan : ex->new_plan);
  atomic_store(&ex->planned, true);
  job_wake(ex->job);
  return NULL;
}

static void engine_notify(void *arg) { job_wake(arg); }

/* The job's ranks are on GPUs (job.c admits no mix): the owners' tensors
 * go to device segments, and the engine runs on the GPUs. */
static struct gpu *job_gpu(const struct export *ex) {
  for (uint32_t r = 0; r < ex->job->world; r++)
    if (ex->ranks[r].m != NULL)
      return ex->ranks[r].m->reg.gpu;
  return NULL;
}

/* An owner's segment: device memory on its GPU for a CUDA job, else a
 * memfd.  0, or fails the export. */
static int new_segment(struct export *ex, uint32_t r, uint64_t need) {
  struct job *job = ex->job;
  struct server *srv = job->srv;
  struct gpu *gpu = job_gpu(ex);
  char why[256] = "";
  int rc = gpu != NULL
               ? pool_segment_new_device(srv->pool, gpu,
                                         ex->ranks[r].m->reg.device,
                                         ex->layout->seg_size[r],
                                         ex->ranks[r].m, &ex->ranks[r].segment,
                                         why,
                                         sizeof why)
               : pool_segment_new(srv->pool, ex->layout->seg_size[r],
                                  ex->ranks[r].m, &ex->ranks[r].segment);
  if (rc == 0)
    return 0;
  char msg[512];
  snprintf(msg, sizeof msg,
           "export %" PRIu64 " of job %s needs %" PRIu64
           " bytes of pool (rank %" PRIu32 ": %" PRIu64 "); %" PRIu64
           " of %" PRIu64 " bytes are in use%s%s",
           ex->id, job->hex, need, r, ex->layout->seg_size[r],
           pool_used(srv->pool), pool_capacity(srv->pool),
           why[0] != '\0' ? ": " : "", why);
  fail_export(ex, rc, msg);
  return rc;
}

static void start_moving(struct export *ex) {
  struct job *job = ex->job;
  struct server *srv = job->srv;
  uint32_t world = job->world;
  if (ex->mx == NULL) {
    ex->plan = job->cached_plan;
    ex->layout = &job->cached_layout;
  }
  ex->bytes_total = 0;
  for (size_t r = 0; r < ex->plan->nrounds; r++)
    ex->bytes_total += ex->plan->rounds[r].nbytes;
  ex->src = calloc(world, sizeof *ex->src);
  ex->dst = calloc(world, sizeof *ex->dst);
  ex->dst_size = calloc(world, sizeof *ex->dst_size);
  ex->dst_warm = calloc(world, sizeof *ex->dst_warm);
  ex->gpu_segments = calloc(world, sizeof *ex->gpu_segments);
  if (ex->src == NULL || ex->dst == NULL || ex->dst_size == NULL ||
      ex->dst_warm == NULL || ex->gpu_segments == NULL) {
    fail_export(ex, SP_ENOMEM, "out of memory starting the export");
    return;
  }
  uint64_t need = 0;
  for (uint32_t r = 0; r < world; r++)
    if (ex->ranks[r].m != NULL)
      need += ex->layout->seg_size[r];
  for (uint32_t r = 0; r < world; r++) {
    /* Ranks on other nodes: their storages and segments are theirs. */
    if (ex->ranks[r].m == NULL)
      continue;
    ex->src[r] = ex->ranks[r].m->reg.info;
    ex->dst_size[r] = ex->layout->seg_size[r];
    if (ex->layout->seg_size[r] == 0)
      continue;
    if (new_segment(ex, r, need) != 0)
      return;
    /* A host segment kept from the owner's earlier export may be larger
     * than this one needs: the engine prepares all of it (the CUDA
     * backend zeroes the layout's part of a device segment). */
    ex->dst[r] = ex->ranks[r].segment->base;
    if (ex->ranks[r].segment->dev == NULL)
      ex->dst_size[r] = ex->ranks[r].segment->size;
    ex->dst_warm[r] = ex->ranks[r].segment->warm;
    ex->gpu_segments[r] = ex->ranks[r].segment->dev;
  }
  ex->bytes_to_prepare = 0;
  for (uint32_t r = 0; r < world; r++)
    ex->bytes_to_prepare += ex->dst_size[r];
  struct engine *e = &ex->engine;
  e->plan = ex->plan;
  e->src = ex->src;
  e->dst = ex->dst;
  e->dst_size = ex->dst_size;
  e->dst_warm = ex->dst_warm;
  e->key_offset = ex->layout->offset;
  e->threads = srv->engine_threads;
  e->round_delay_ms = srv->test_round_delay_ms;
  e->notify = engine_notify;
  e->notify_arg = job;
  if (ex->mx != NULL) {
    if (mesh_remote(job, ex->mx, ex->plan, ex->src, ex->dst,
                    ex->layout->offset, &e->remote) != 0) {
      fail_export(ex, SP_ENOMEM, "out of memory starting the export");
      return;
    }
    /* What this node copies, sends and receives. */
    ex->bytes_total = remote_bytes_total(e->remote);
  }
  if (job_gpu(ex) != NULL) {
    /* The moves between this node's ranks are device copies, the moves
     * between nodes go through the job's communicators (docs/gpu.md). */
    ex->gpu_run = (struct gpu_run){.gpu = job_gpu(ex),
                                   .segments = ex->gpu_segments,
                                   .node = ex->mx != NULL ? mesh_self(job) : 0,
                                   .comms = job->gpu_comms,
                                   .timeout_ms = ex->timeout_ms};
    e->gpu_run = &ex->gpu_run;
    e->run = gpu_engine_run;
  }
  ex->phase = JOB_MOVING;
  ex->moving_ms = ex->sample_ms = ex->progress_ms = monotonic_ms();
  if (engine_start(e) != 0) {
    fail_export(ex, SP_ENOMEM, "cannot start the engine thread");
    return;
  }
  ex->thread_alive = true;
  progress_all(ex);
}

static void on_conn_drained(struct conn *c, void *arg) {
  (void)c;
  job_wake(arg);
}

/* The bytes of the tensors rank r owns: what it writes in a save, where
 * every key is written, tied ones too (docs/checkpoints.md). */
static uint64_t owned_bytes(const struct export *ex, uint32_t r) {
  uint64_t n = 0;
  for (size_t i = ex->layout->owned_first[r]; i < ex->layout->owned_first[r + 1];
       i++)
    n += ex->plan->keys[ex->layout->owned[i]].nbytes;
  return n;
}

/* Queues the next parts of each rank's reply while its connection has room
 * for a whole part; the rest goes when it has drained. */
static void pump(struct export *ex) {
  struct job *job = ex->job;
  for (uint32_t r = 0; r < job->world; r++) {
    struct export_rank *er = &ex->ranks[r];
    if (er->answered)
      continue;
    struct conn *c = er->m->conn;
    if (c == NULL) {
      er->answered = true;
      continue;
    }
    while (er->next_part < er->nparts &&
           conn_output_room(c) >= ex->part_limit) {
      size_t p = er->next_part;
      size_t end = p + 1 < er->nparts ? er->part_first[p + 1]
                                      : ex->layout->owned_first[r + 1];
      struct sp_msgbuf mb;
      struct publish_device dev = {
          .device = er->device_segment
                        ? gpu_device_name(job_gpu(ex), er->device_info.device)
                        : NULL,
          .handle = er->device_info.handle,
          .event = er->device_info.event,
          .size = er->device_info.size};
      struct save_files files =
          ex->save != NULL ? save_files(ex->save) : (struct save_files){0};
      publish_pack(ex->plan, ex->layout, &er->m->reg, r, er->request_id, ex->id,
                   p, er->nparts, er->part_first[p], end,
                   er->device_segment ? &dev : NULL,
                   ex->save != NULL ? &files : NULL, &mb);
      /* A reply that cannot be built would leave the rank waiting: its
       * connection closes instead, which it sees at once. */
      struct sp_frame_tx *tx = calloc(1, sizeof *tx);
      if (tx == NULL) {
        sp_msgbuf_discard(&mb);
        conn_close(c);
        break;
      }
      if (sp_msgbuf_finish(&mb, tx) != 0) {
        free(tx);
        conn_close(c);
        break;
      }
      if (p == 0 && er->segment_fd >= 0) {
        /* The frame takes the duplicate and closes it once written. */
        tx->fds[0] = er->segment_fd;
        tx->nfds = 1;
        er->segment_fd = -1;
      }
      er->next_part++;
      ex->progress_ms = monotonic_ms();
      if (conn_send(c, tx) != 0)
        break;
    }
    if (er->m->conn == NULL || er->next_part == er->nparts) {
      er->answered = true;
      if (ex->save != NULL)
        /* A save's owner goes on to write: it stays in the export. */
        save_rank_published(ex->save, r, er->request_id,
                            owned_bytes(ex, r));
      else
        er->m->in_export = false;
      if (er->m->conn != NULL)
        conn_on_drained(er->m->conn, NULL, NULL);
    } else {
      conn_on_drained(c, on_conn_drained, job);
    }
  }
}

static void start_publishing(struct export *ex) {
  struct job *job = ex->job;
  const struct config *cfg = job->srv->cfg;
  /* A part must fit the client's frame limit (the protocol's default), the
   * daemon's own, and half the reply queue, so that a queue at most half
   * full always has room for one. */
  uint64_t limit = SP_LIMITS_DEFAULT_MAX_FRAME;
  if (cfg->limits.max_frame < limit)
    limit = cfg->limits.max_frame;
  if (cfg->max_output / 2 < limit)
    limit = cfg->max_output / 2;
  uint32_t items = cfg->limits.max_items < SP_LIMITS_DEFAULT_MAX_ITEMS
                       ? cfg->limits.max_items
                       : SP_LIMITS_DEFAULT_MAX_ITEMS;
  ex->part_limit = limit;
  ex->phase = JOB_PUBLISHING;
  progress_all(ex);
  for (uint32_t r = 0; r < job->world; r++) {
    struct export_rank *er = &ex->ranks[r];
    if (er->answered)
      continue;
    struct job_published *pub = calloc(1, sizeof *pub);
    if (er->segment != NULL && er->segment->dev != NULL) {
      er->device_segment = true;
      er->device_info = *gpu_segment_info(er->segment->dev);
    }
    if (pub == NULL ||
        publish_parts(ex->plan, ex->layout, r, limit, items, &er->part_first,
                      &er->nparts) != 0) {
      free(pub);
      fail_export(ex, SP_ENOMEM, "out of memory publishing");
      return;
    }
    /* The rank's own description of its segment, so that the pool can
     * tell when the rank has closed it everywhere (pool.h). */
    char why[256];
    if (er->segment != NULL && !er->device_segment &&
        (er->segment_fd = pool_segment_share(job->srv->pool, er->segment,
                                             why, sizeof why)) < 0) {
      int code = er->segment_fd;
      er->segment_fd = -1;
      free(pub);
      char msg[320];
      snprintf(msg, sizeof msg, "publishing: %s", why);
      fail_export(ex, code, msg);
      return;
    }
    /* From here the rank holds the export until it releases it. */
    pub->export_id = ex->id;
    pub->segment = er->segment;
    er->segment = NULL;
    pub->next = er->m->published;
    er->m->published = pub;
  }
  pump(ex);
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
    if (prepare_save(ex, ex->reuse_plan ? ex->job->cached_plan
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
    if (!ex->reuse_plan && cache_install(ex) != 0) {
      fail_export(ex, SP_ENOMEM, "out of memory keeping the plan");
      break;
    }
    start_moving(ex);
    if (ex->failed && !ex->thread_alive)
      break;
    return;
  case JOB_MOVING:
    if (!atomic_load(&ex->engine.done)) {
      progress_all(ex);
      return;
    }
    engine_join(&ex->engine);
    ex->thread_alive = false;
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
    pump(ex);
    for (uint32_t r = 0; r < ex->job->world; r++)
      if (!ex->ranks[r].answered)
        return;
    if (ex->save != NULL && !ex->failed) {
      ex->phase = JOB_WRITING;
      progress_all(ex);
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
  out->save_limit = m->ask.save_limit;
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
    /* On one node the planner reads the registries as they are; across
     * nodes, the gathered bytes (mesh_plan_input). */
    if (mx == NULL)
      ex->rin = calloc(job->world, sizeof *ex->rin);
  }
  if (ex == NULL || ex->ranks == NULL || (mx == NULL && ex->rin == NULL)) {
    if (ex != NULL) {
      free(ex->ranks);
      free(ex->rin);
    }
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
    if (mx != NULL)
      continue;
    registry_rank_in(&m->reg, r, &ex->rin[r]);
    ex->rin[r].ngroups = er->groups.ngroups;
    ex->rin[r].groups = er->groups.groups;
  }
  if (mx == NULL)
    ex->in = (struct plan_input){.world = job->world,
                                 .nranks = job->world,
                                 .ranks = ex->rin,
                                 .max_keys = ex->max_keys,
                                 .max_bytes = ex->max_bytes};
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
  progress_all(ex);
  ex->planning_ms = monotonic_ms();
  if (xfer_spawn(&ex->planner, plan_main, ex) != 0) {
    fail_export(ex, SP_ENOMEM, "cannot start the planning thread");
    finish(ex);
    return;
  }
  ex->thread_alive = true;
}

static void maybe_start(struct job *job) {
  if (job->dying || job->running != NULL)
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
  ex->reuse_plan = cache_applies(ex);
  if (ex->reuse_plan && !ex->compare) {
    if (prepare_save(ex, job->cached_plan) == 0)
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
    progress_all(ex);
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
    out->rounds = plan_rounds(ex);
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

/* An export request read out of its frame (conn.h): a large groups list
 * is parsed on a worker (on the loop, 500,000 names held it 220 ms). */
struct export_ask {
  int rc; /* a request that does not parse: its code, and msg */
  char msg[256];
  struct req_export req;
};

static void *prepare_ask(const msgpack_object *map,
                         const struct sp_frame *frame) {
  (void)frame;
  struct export_ask *a = calloc(1, sizeof *a);
  if (a != NULL)
    a->rc = request_parse_export(map, &a->req, a->msg, sizeof a->msg);
  return a;
}

static void free_ask(void *prepared) {
  struct export_ask *a = prepared;
  if (a == NULL)
    return;
  request_groups_free(&a->req.groups);
  free(a);
}

static int serve_ask(struct conn *c, const struct sp_msg_head *head,
                     struct sp_frame *frame, void *prepared) {
  (void)frame;
  struct export_ask *a = prepared;
  if (a == NULL)
    return conn_send_error(c, head->id, SP_ENOMEM, "export: out of memory");
  struct job_member *m = conn_member(c);
  if (m == NULL)
    return conn_send_error(c, head->id, SP_ESTATE, "export: join a job first");
  struct job *job = m->job;
  if (m->asked || m->in_export)
    return conn_send_error(c, head->id, SP_EEXPORTING,
                           "export: rank %" PRIu32 " of job %s already asked "
                           "for an export that has not finished",
                           m->rank, job->hex);
  if (a->rc != 0)
    return conn_send_error(c, head->id, a->rc, "export: %s", a->msg);
  const struct req_export req = a->req;
  /* The rank's ask holds the groups from now on. */
  memset(&a->req.groups, 0, sizeof a->req.groups);
  m->ask = req;
  m->asked = true;
  m->ask_id = head->id;
  m->asked_ms = monotonic_ms();
  m->ask_deadline_ms =
      monotonic_ms() +
      (req.timeout_ms > 0 ? req.timeout_ms : job->srv->cfg->export_timeout_ms);
  if (req.progress) {
    struct sp_msgbuf mb;
    sp_msgbuf_begin(&mb, "progress", head->id, 5);
    sp_pack_kv_str(&mb.pk, "phase", "waiting");
    sp_pack_kv_u64(&mb.pk, "round", 0);
    sp_pack_kv_u64(&mb.pk, "rounds", 0);
    sp_pack_kv_u64(&mb.pk, "bytes_moved", 0);
    sp_pack_kv_u64(&mb.pk, "bytes_total", 0);
    conn_send_msgbuf(c, &mb);
  }
  job_wake(job);
  job_schedule(job);
  return 0;
}

const struct conn_prepared_op export_ask_op = {prepare_ask, serve_ask, NULL,
                                               free_ask};

int export_op_request(struct conn *c, const struct sp_msg_head *head,
                      const msgpack_object *map, struct sp_frame *frame) {
  void *a = prepare_ask(map, frame);
  int rc = serve_ask(c, head, frame, a);
  free_ask(a);
  return rc;
}

int export_op_release(struct conn *c, const struct sp_msg_head *head,
                      const msgpack_object *map, struct sp_frame *frame) {
  (void)frame;
  struct job_member *m = conn_member(c);
  if (m == NULL)
    return conn_send_error(c, head->id, SP_ESTATE, "release: join a job first");
  uint64_t export_id;
  char msg[128];
  int rc = request_parse_release(map, &export_id, msg, sizeof msg);
  if (rc != 0)
    return conn_send_error(c, head->id, rc, "release: %s", msg);
  for (struct job_published **p = &m->published; *p != NULL; p = &(*p)->next) {
    if ((*p)->export_id != export_id)
      continue;
    struct job_published *pub = *p;
    /* A reply still streaming keeps its part 0 until it is written; the
     * segment's descriptor in it is a duplicate. */
    *p = pub->next;
    /* A device segment is kept for this rank's next export. */
    pool_segment_put(m->job->srv->pool, pub->segment);
    free(pub);
    struct sp_msgbuf mb;
    sp_msgbuf_begin(&mb, "release", head->id, 0);
    return conn_send_msgbuf(c, &mb);
  }
  return conn_send_error(c, head->id, SP_ENOEXPORT,
                         "release: export %" PRIu64 " is not published to "
                         "rank %" PRIu32 " of job %s",
                         export_id, m->rank, m->job->hex);
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
