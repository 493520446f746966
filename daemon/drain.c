/*
 * drain.c - stopping without breaking what runs (docs/operations.md,
 * "Stopping and restarting").
 *
 * SIGTERM or SIGINT starts a drain: the daemon keeps serving status and
 * the requests that finish what exists (leave, release), answers every
 * request that would start something new with daemon_stopping, fails at
 * once the exports still gathering asks (they could never start: their
 * missing ranks would be refused), and gives each running export until
 * drain_timeout to finish.  One that has not finished by then is failed
 * with daemon_stopping on every rank.  Once no export runs, server_stop
 * ends every connection with a last error: daemon_restarted to a job's
 * ranks (the job is gone with the daemon), daemon_stopping to the others.
 * A second signal stops at once, as before draining existed.
 *
 * A GPU whose context a sticky CUDA error ended (an illegal address, a
 * launch failure) cannot be used again by this process, so the daemon
 * drains the same way, once, and then exits with failure: systemd's
 * Restart=on-failure starts a fresh one with fresh contexts.  Until then
 * the other GPUs finish their running exports.
 *
 * The service manager is told how long the stop may take
 * (EXTEND_TIMEOUT_USEC), so that a drain_timeout longer than the unit's
 * TimeoutStopSec is not cut short by SIGKILL.
 */
#include <inttypes.h>
#include <stdio.h>

#include "daemon/backend.h"
#include "daemon/conn.h"
#include "daemon/cuda/gpu.h"
#include "daemon/drain.h"
#include "daemon/export.h"
#include "daemon/job.h"
#include "daemon/log.h"
#include "daemon/notify.h"
#include "daemon/server.h"
#include "proto/monotonic.h"
#include "shardport.h"

/* How often a drain looks whether the running exports have finished. */
#define DRAIN_TICK_MS 50
/* What the stop may take beyond drain_timeout: the connections' last
 * replies (CONN_DRAIN_TIMEOUT_MS in conn.c) and the engines' winding down,
 * with room to spare. */
#define DRAIN_STOP_MARGIN_MS 15000u

static uint32_t exports_running(const struct server *srv) {
  uint32_t n = 0;
  for (const struct job *job = srv->jobs; job != NULL; job = job->next)
    n += export_busy(job);
  return n;
}

/* The drain ran out of time: what still runs fails on every rank, and the
 * stop follows once the engine threads have ended. */
static void expire(struct server *srv) {
  srv->drain_expired = true;
  for (struct job *job = srv->jobs; job != NULL; job = job->next) {
    if (!export_busy(job))
      continue;
    struct export_view v;
    export_view(job, &v);
    char msg[SP_ERRMSG_MAX + 1];
    snprintf(msg, sizeof msg,
             "shardportd is stopping (%s) and export %" PRIu64
             " of job %s did not finish within drain_timeout (%" PRIu32
             " ms)",
             srv->stop_reason, v.export_id, job->hex,
             srv->cfg->drain_timeout_ms);
    log_with(LOG_LEVEL_WARN, LOG_JOB(job->hex), "job %s: %s", job->hex, msg);
    export_abort(job, SP_EDAEMONSTOPPING, msg);
  }
}

static void on_drain_tick(uv_timer_t *timer) {
  struct server *srv = timer->data;
  if (exports_running(srv) == 0) {
    uv_timer_stop(timer);
    server_stop(srv, false, SP_EDAEMONRESTARTED, SP_EDAEMONSTOPPING,
                srv->stop_reason);
    return;
  }
  if (!srv->drain_expired && monotonic_ms() >= srv->drain_deadline_ms)
    expire(srv);
}

void drain_begin(struct server *srv, const char *why) {
  if (srv->stopping)
    return;
  if (srv->draining) {
    log_msg(LOG_LEVEL_WARN, "%s while draining: stopping at once", why);
    server_stop(srv, true, 0, 0, why);
    return;
  }
  srv->draining = true;
  snprintf(srv->stop_reason, sizeof srv->stop_reason, "%s", why);
  uint32_t running = exports_running(srv);
  log_msg(LOG_LEVEL_INFO,
          "%s: draining: no new jobs, ranks or exports; %" PRIu32
          " running export(s) have drain_timeout (%" PRIu32
          " ms) to finish; a second signal stops at once",
          why, running, srv->cfg->drain_timeout_ms);
  char status[128];
  snprintf(status, sizeof status, "draining: %" PRIu32 " export(s) running",
           running);
  notify_stopping(status, ((uint64_t)srv->cfg->drain_timeout_ms +
                           DRAIN_STOP_MARGIN_MS) * 1000u);
  for (struct job *job = srv->jobs; job != NULL; job = job->next) {
    char msg[SP_ERRMSG_MAX + 1];
    snprintf(msg, sizeof msg,
             "shardportd is stopping (%s): the export job %s's ranks asked "
             "for will not start",
             why, job->hex);
    export_fail_asks(job, SP_EDAEMONSTOPPING, msg);
  }
  srv->drain_deadline_ms = monotonic_ms() + srv->cfg->drain_timeout_ms;
  uv_timer_start(&srv->drain_timer, on_drain_tick, 0, DRAIN_TICK_MS);
}

void drain_check_gpus(struct server *srv) {
  struct gpu *gpu = srv->backend->gpu;
  if (gpu == NULL)
    return;
  char why[SP_ERRMSG_MAX + 1];
  int failed = 0;
  for (int d = gpu_failure(gpu, 0, why, sizeof why); d >= 0;
       d = gpu_failure(gpu, d + 1, why, sizeof why))
    if (++failed > srv->gpus_failed)
      log_msg(LOG_LEVEL_ERROR,
              "%s; a restart of shardportd is needed: it stops once the "
              "running exports finished and exits with failure, so that "
              "its service manager starts it again",
              why);
  if (failed <= srv->gpus_failed)
    return;
  srv->gpus_failed = failed;
  srv->exit_failure = true;
  if (!srv->draining)
    drain_begin(srv, "GPU failed");
}

bool drain_refuse(struct server *srv, struct conn *c, uint64_t id,
                  const char *op) {
  if (!srv->draining && !srv->stopping)
    return false;
  conn_send_error(c, id, SP_EDAEMONSTOPPING,
                  "%s: shardportd is stopping (%s): it takes no new jobs, "
                  "ranks, registrations or exports; create the job again "
                  "once the daemon is back",
                  op, srv->stop_reason);
  return true;
}
