/*
 * comms.c - a job's NCCL communicators on this node; see comms.h and
 * docs/gpu.md.
 *
 * A job on GPUs across nodes needs one communicator per local rank.  They
 * are started as the ranks join (COMMS_JOINING), so that NCCL's set-up
 * overlaps the registrations, and the first export takes them over and
 * warms them on its planning thread (COMMS_EXPORTS).  When that cannot be
 * (a rank left, an init failed, the export's ranks are not the ones that
 * joined), the export makes them itself, as every later export does after
 * a failure aborted them: each such export carries a new generation and
 * the fresh NCCL id the root made for it.
 */
#include <inttypes.h>
#include <stdio.h>

#include "daemon/comms.h"
#include "daemon/job.h"
#include "daemon/log.h"
#include "shardport.h"

void comms_want_rank(struct comms_want *w, uint32_t r,
                     const struct job_member *m) {
  w->gpu = m->reg.gpu;
  if (w->n < COMMS_MAX_RANKS)
    w->ranks[w->n++] = (struct gpu_comm_rank){.rank = r,
                                              .device = m->reg.device};
}

/* Aborted, not finalized: a peer's may be gone.  Both on a helper
 * thread: whoever drops them (the loop, too) does not wait. */
static void drop(struct job *job) {
  gpu_comms_abort(job->gpu_comms);
  gpu_comms_free(job->gpu_comms);
  job->gpu_comms = NULL;
}

/* The join-time set serves the export when it holds exactly the export's
 * local ranks of generation 0. */
static bool join_set_fits(const struct job *job, const struct comms_want *w) {
  return w->spans_nodes && w->gpu != NULL && w->has_id && w->gen == 0 &&
         gpu_comms_match(job->gpu_comms, w->ranks, w->n);
}

/* Waits for the join-time set (bounded by the export's timeout) and warms
 * it. */
static int warm_join_set(struct job *job, const struct comms_want *w,
                         char *msg, size_t msglen) {
  int rc = gpu_comms_warm(job->gpu_comms, w->plan, w->timeout_ms, msg, msglen);
  if (rc != 0) {
    gpu_comms_free(job->gpu_comms);
    job->gpu_comms = NULL;
    return rc;
  }
  job->gpu_comms_gen = 0;
  log_with(LOG_LEVEL_INFO, LOG_JOB(job->hex),
           "job %s: %zu NCCL communicator(s) of %" PRIu32 " ranks, made "
           "as the ranks joined, warmed on this node (generation 0)",
           job->hex, w->n, job->world);
  return 0;
}

/* The current generation's communicators serve again unless a failure
 * aborted them and the root sent no new id.  A new plan (the job's
 * registrations changed) may need more staging: it grows here, between
 * exports, on this node alone (no NCCL call: another node may be reusing
 * its cached plan and issue nothing now). */
static int keep_generation(struct job *job, const struct comms_want *w,
                           char *msg, size_t msglen) {
  if (!gpu_comms_failed(job->gpu_comms))
    return gpu_comms_fit(job->gpu_comms, w->plan, msg, msglen);
  snprintf(msg, msglen,
           "job %s's NCCL communicators were aborted by an earlier "
           "failure and its root daemon sent no new NCCL id",
           job->hex);
  return SP_EBACKEND;
}

/* A new generation: an export since these were made failed (and may have
 * aborted them), so every node drops its own and makes new ones from the
 * fresh id the root sent. */
static void retire_generation(struct job *job, uint64_t gen) {
  log_with(LOG_LEVEL_INFO, LOG_JOB(job->hex),
           "job %s: NCCL communicators of generation %" PRIu64
           " replaced by generation %" PRIu64 "%s",
           job->hex, job->gpu_comms_gen, gen,
           gpu_comms_failed(job->gpu_comms) ? " (they were aborted)" : "");
  drop(job);
}

static int make_generation(struct job *job, const struct comms_want *w,
                           char *msg, size_t msglen) {
  if (!w->has_id) {
    snprintf(msg, msglen,
             "job %s spans nodes on GPUs, but its root daemon made no NCCL "
             "id (it does not serve the CUDA backend)",
             job->hex);
    return SP_EBACKEND;
  }
  /* The sets dropped before are aborted on helper threads: the new ones
   * (maybe of the same id) start once those ended, within the timeout. */
  if (!gpu_comms_wait_ended(w->gpu, w->timeout_ms)) {
    snprintf(msg, msglen,
             "job %s: earlier NCCL communicators on this node did not end "
             "within %" PRIu32 " ms (ncclCommAbort blocks)",
             job->hex, w->timeout_ms);
    return SP_ETIMEOUT;
  }
  int rc = gpu_comms_create(w->gpu, w->id, job->world, w->ranks, w->n,
                            w->plan, w->timeout_ms, &job->gpu_comms, msg,
                            msglen);
  if (rc == 0) {
    job->gpu_comms_gen = w->gen;
    log_with(LOG_LEVEL_INFO, LOG_JOB(job->hex),
             "job %s: %zu NCCL communicator(s) of %" PRIu32 " ranks made and "
             "warmed on this node (generation %" PRIu64 ")",
             job->hex, w->n, job->world, w->gen);
  }
  return rc;
}

int comms_for_export(struct job *job, const struct comms_want *w, char *msg,
                     size_t msglen) {
  /* No more communicators are started as ranks join (the loop does not
   * touch them while this export runs). */
  enum comms_state was = job->comms_state;
  job->comms_state = COMMS_EXPORTS;
  if (was == COMMS_JOINING || was == COMMS_JOINED) {
    if (join_set_fits(job, w))
      return warm_join_set(job, w, msg, msglen);
    drop(job);
  }
  if (!w->spans_nodes || w->gpu == NULL)
    return 0;
  if (job->gpu_comms != NULL) {
    if (job->gpu_comms_gen == w->gen)
      return keep_generation(job, w, msg, msglen);
    retire_generation(job, w->gen);
  }
  return make_generation(job, w, msg, msglen);
}

/* Drops the join-time communicators; the first export makes them. */
static void drop_join_set(struct job *job) {
  drop(job);
  job->comms_state = COMMS_EXPORTS;
}

void comms_join(struct job *job) {
  if (job->running != NULL || job->comms_state == COMMS_EXPORTS ||
      job->dying || job->mesh == NULL || !job->has_nccl_id)
    return;
  struct gpu *gpu = NULL;
  struct gpu_comm_rank ranks[COMMS_MAX_RANKS];
  size_t n = 0;
  for (uint32_t r = 0; r < job->world && n < COMMS_MAX_RANKS; r++) {
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
        job->comms_state = COMMS_EXPORTS;
        return;
      }
      job->gpu_comms_gen = 0;
    }
    rc = gpu_comms_add(job->gpu_comms, ranks, n, msg, sizeof msg);
    if (rc == 0)
      log_with(
          LOG_LEVEL_INFO, LOG_JOB(job->hex),
          "job %s: NCCL communicator(s) of %zu rank(s) starting, generation "
          "0, as the rank(s) joined",
          job->hex, n);
    job->comms_state = COMMS_JOINING;
  }
  if (rc == 0 && job->comms_state == COMMS_JOINING) {
    rc = gpu_comms_poll(job->gpu_comms, msg, sizeof msg);
    if (rc == 0) {
      job->comms_state = COMMS_JOINED;
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
    drop_join_set(job);
  }
}

void comms_rank_left(struct job *job, uint32_t r) {
  if ((job->comms_state != COMMS_JOINING &&
       job->comms_state != COMMS_JOINED) ||
      !gpu_comms_holds(job->gpu_comms, r))
    return;
  log_with(LOG_LEVEL_INFO, LOG_JOB(job->hex),
           "job %s: rank %" PRIu32 " left before the first export: its NCCL "
           "communicator and this node's others are aborted; the first "
           "export makes them",
           job->hex, r);
  drop_join_set(job);
}

bool comms_joining(const struct job *job) {
  return job->comms_state == COMMS_JOINING;
}
