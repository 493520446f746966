/*
 * server.c - the event loop: accepting, signals, readiness and the
 * watchdog, and a shutdown that closes every handle.  SIGTERM and SIGINT
 * start a drain (drain.c), which ends in server_stop; SIGHUP reloads the
 * configuration (reload.c).
 *
 * The loop never blocks.  Peers are checked as they are accepted, before
 * anything is read from them; a refused peer and a peer beyond max_clients
 * get one error reply, written without waiting, and are closed.
 */
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <limits.h>
#include <signal.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include "build_config.h"
#include "daemon/backend.h"
#include "daemon/config.h"
#include "daemon/conn.h"
#include "daemon/detach.h"
#include "daemon/drain.h"
#include "daemon/export.h"
#include "daemon/job.h"
#include "daemon/listen.h"
#include "daemon/log.h"
#include "daemon/loopwatch.h"
#include "daemon/mesh/mesh.h"
#include "daemon/metrics.h"
#include "daemon/notify.h"
#include "daemon/peer.h"
#include "daemon/pool.h"
#include "daemon/reload.h"
#include "daemon/server.h"
#include "daemon/stage.h"
#include "shardport.h"

/* Connections accepted per wakeup, so that a burst of connects cannot keep
 * the loop from serving the clients it already has. */
#define SERVER_ACCEPT_BATCH 64

/* Answers a peer that will not be served with one error reply and closes it.
 * The reply is small and the socket new, so one non-blocking write takes it;
 * if it does not, the peer just sees the close. */
static void refuse(int sock, int code, const char *message) {
  struct sp_frame_tx tx;
  if (sp__msg_error(&tx, 0, code, "%s", message) == 0) {
    sp__frame_tx_write(&tx, sock);
    free(tx.buf);
  }
  close(sock);
}

/* Implements a best effort approach to mitigating accept() EMFILE errors:
 * a spare descriptor is given up to accept the waiting connection and close
 * it, so that the listen socket does not stay readable forever.  Both
 * listeners (clients here, other daemons in nodelink.c) shed this way. */
bool server_shed(struct server *srv, int listen_fd) {
  if (srv->reserve_fd < 0)
    srv->reserve_fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
  if (srv->reserve_fd < 0)
    return false;
  close(srv->reserve_fd);
  int sock = accept4(listen_fd, NULL, NULL, SOCK_CLOEXEC);
  if (sock >= 0)
    close(sock);
  srv->reserve_fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
  return true;
}

static void on_listen(uv_poll_t *handle, int status, int events) {
  struct server *srv = handle->data;
  (void)events;
  if (status < 0) {
    log_msg(LOG_LEVEL_ERROR, "listen socket: %s", uv_strerror(status));
    return;
  }
  for (int i = 0; i < SERVER_ACCEPT_BATCH; i++) {
    int sock = accept4(srv->listener.fd, NULL, NULL,
                       SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (sock < 0) {
      if (errno == EINTR || errno == ECONNABORTED)
        continue;
      if (errno == EMFILE || errno == ENFILE) {
        log_limited(&srv->accept_log, LOG_LEVEL_WARN,
                    "accept: %s; dropping a connection", strerror(errno));
        if (!server_shed(srv, srv->listener.fd))
          return;
        continue;
      }
      if (errno != EAGAIN && errno != EWOULDBLOCK)
        log_limited(&srv->accept_log, LOG_LEVEL_WARN, "accept: %s",
                    strerror(errno));
      return;
    }
    struct peer peer;
    int rc = peer_check(srv->cfg, sock, &peer);
    if (rc == SP_EPERM) {
      log_msg(LOG_LEVEL_WARN,
              "refused peer pid %d uid %u gid %u: not an allowed uid or gid",
              (int)peer.pid, (unsigned)peer.uid, (unsigned)peer.gid);
      refuse(sock, SP_EPERM,
             "permission denied: this uid is not allowed by shardportd");
      continue;
    }
    if (rc < 0) {
      log_msg(LOG_LEVEL_WARN, "cannot read peer credentials: %s",
              strerror(errno));
      close(sock);
      continue;
    }
    if (srv->nclients >= srv->cfg->max_clients) {
      log_msg(LOG_LEVEL_WARN, "refused pid %d: max_clients (%" PRIu32
                              ") connections open",
              (int)peer.pid, srv->cfg->max_clients);
      refuse(sock, SP_EBUSY, "too many clients connected (max_clients)");
      continue;
    }
    conn_open(srv, sock, &peer);
  }
}

static void on_pool_watch(uv_poll_t *handle, int status, int events) {
  struct server *srv = handle->data;
  (void)status;
  (void)events;
  pool_collect(srv->pool);
}

/* Polls the pool's inotify descriptor, so that a released segment is
 * freed as soon as its rank closes it (pool.h). */
static void start_pool_watch(struct server *srv) {
  int fd = pool_watch_fd(srv->pool);
  if (fd < 0 || uv_poll_init(srv->loop, &srv->pool_poll, fd) != 0)
    return;
  srv->pool_poll.data = srv;
  uv_poll_start(&srv->pool_poll, UV_READABLE, on_pool_watch);
  srv->pool_poll_on = true;
}

static void report_status(struct server *srv) {
  char status[256];
  snprintf(status, sizeof(status), "serving on %s, %" PRIu32 " client(s)",
           srv->listener.path, srv->nclients);
  notify_status(status);
}

static void on_watchdog(uv_timer_t *timer) {
  struct server *srv = timer->data;
  notify_watchdog();
  report_status(srv);
}

/* On the loop, when a scrape asked: what the loop holds now. */
static void on_metrics_refresh(uv_async_t *async) {
  struct server *srv = async->data;
  struct metrics_gauges g = {
      .clients = srv->nclients,
      .jobs = srv->njobs,
      .loop_max_busy_ns = loopwatch_take_max_ns(srv, LOOPWATCH_METRICS)};
  for (const struct job *job = srv->jobs; job != NULL; job = job->next) {
    uint32_t joined, asked;
    job_count_ranks(job, &joined, &asked);
    g.ranks += joined;
  }
  /* Segments whose ranks closed them are freed before they are counted,
   * as status counts them. */
  pool_collect(srv->pool);
  /* The host series is the host's own bytes: the GPUs' are theirs, and
   * pool_capacity bounds the host's alone. */
  g.pool_used = pool_host_used(srv->pool);
  g.pool_kept = pool_held(srv->pool);
  g.pool_capacity = pool_capacity(srv->pool);
  if (srv->backend->gpu != NULL) {
    int n = gpu_device_count(srv->backend->gpu);
    g.ngpus = n < 0 ? 0 : n > METRICS_MAX_GPUS ? METRICS_MAX_GPUS : (uint32_t)n;
    for (uint32_t i = 0; i < g.ngpus; i++)
      g.gpu_used[i] = pool_device_used(srv->pool, (int)i);
    g.gpu_capacity = pool_gpu_capacity(srv->pool);
  }
  metrics_set_gauges(srv->metrics, &g);
}

/* From the HTTP thread: uv_async_send is the one libuv call any thread
 * may make. */
static void metrics_refresh(void *arg) {
  uv_async_send(arg);
}

/* Serves GET /metrics when metrics_listen is set: 0, or -1 (logged). */
static int start_metrics(struct server *srv) {
  if (!srv->cfg->metrics_listen_set)
    return 0;
  int rc = uv_async_init(srv->loop, &srv->metrics_async, on_metrics_refresh);
  if (rc != 0) {
    log_msg(LOG_LEVEL_ERROR, "uv_async_init: %s", uv_strerror(rc));
    return -1;
  }
  srv->metrics_async.data = srv;
  if (metrics_http_start(srv->metrics,
                         (const struct sockaddr *)&srv->cfg->metrics_listen_addr,
                         srv->cfg->metrics_connections,
                         &srv->metrics_http) != 0) {
    uv_close((uv_handle_t *)&srv->metrics_async, NULL);
    return -1;
  }
  return 0;
}

/* The HTTP thread is joined before the handle it wakes closes. */
static void stop_metrics(struct server *srv) {
  if (srv->metrics_http == NULL)
    return;
  metrics_http_stop(srv->metrics_http);
  srv->metrics_http = NULL;
  uv_close((uv_handle_t *)&srv->metrics_async, NULL);
}

void server_stop(struct server *srv, bool at_once, int job_code, int code,
                 const char *why) {
  if (srv->stopping)
    return;
  srv->stopping = true;
  log_msg(LOG_LEVEL_INFO, "%s; stopping", why);
  notify_status("stopping");
  if (srv->listener.fd >= 0) {
    uv_close((uv_handle_t *)&srv->listen_poll, NULL);
    listen_close(&srv->listener);
  }
  uv_close((uv_handle_t *)&srv->sig_term, NULL);
  uv_close((uv_handle_t *)&srv->sig_int, NULL);
  uv_close((uv_handle_t *)&srv->sig_hup, NULL);
  uv_close((uv_handle_t *)&srv->drain_timer, NULL);
  loopwatch_stop(srv);
  if (srv->watchdog_on)
    uv_close((uv_handle_t *)&srv->watchdog, NULL);
  if (srv->pool_poll_on)
    uv_close((uv_handle_t *)&srv->pool_poll, NULL);
  stop_metrics(srv);
  if (at_once) {
    while (srv->conns != NULL)
      conn_close(srv->conns);
  } else {
    /* Every client learns why its connection ends: a job's ranks that the
     * job is gone, the others that the daemon stopped. */
    for (struct job *job = srv->jobs; job != NULL; job = job->next) {
      char msg[SP_ERRMSG_MAX + 1];
      snprintf(msg, sizeof msg,
               "shardportd stopped (%s) and job %s ended with it: once the "
               "daemon is back, create a new job and register every rank "
               "again",
               why, job->hex);
      job_terminate(job, job_code, msg);
    }
    for (struct conn *c = srv->conns, *next; c != NULL; c = next) {
      next = conn_next(c);
      conn_finish(c, code, "shardportd stopped (%s)", why);
    }
  }
  stage_close(srv);
  /* Jobs end from their own wake-ups, once any engine thread has stopped;
   * the loop runs until they have closed their handles (and their links
   * to other daemons), and the connections theirs. */
  job_shutdown(srv);
  nodelink_listen_close(srv);
  nodelink_shutdown(srv);
}

static void on_signal(uv_signal_t *handle, int signum) {
  struct server *srv = handle->data;
  if (signum == SIGHUP)
    reload_run(srv);
  else
    drain_begin(srv, signum == SIGTERM ? "SIGTERM" : "SIGINT");
}

/* Signals are caught before the socket exists: a client may connect and a
 * supervisor may signal as soon as the socket accepts. */
static int start_signals(struct server *srv) {
  uv_signal_init(srv->loop, &srv->sig_term);
  uv_signal_init(srv->loop, &srv->sig_int);
  uv_signal_init(srv->loop, &srv->sig_hup);
  uv_timer_init(srv->loop, &srv->drain_timer);
  srv->sig_term.data = srv;
  srv->sig_int.data = srv;
  srv->sig_hup.data = srv;
  srv->drain_timer.data = srv;
  int rc = uv_signal_start(&srv->sig_term, on_signal, SIGTERM);
  if (rc == 0)
    rc = uv_signal_start(&srv->sig_int, on_signal, SIGINT);
  if (rc == 0)
    rc = uv_signal_start(&srv->sig_hup, on_signal, SIGHUP);
  if (rc != 0)
    log_msg(LOG_LEVEL_ERROR, "uv_signal_start: %s", uv_strerror(rc));
  return rc;
}

static void start_watchdog(struct server *srv) {
  uint64_t usec = srv->cfg->watchdog ? notify_watchdog_usec() : 0;
  if (usec == 0)
    return;
  /* Half the interval, as sd_watchdog_enabled(3) recommends. */
  uint64_t ms = usec / 2000;
  if (ms == 0)
    ms = 1;
  uv_timer_init(srv->loop, &srv->watchdog);
  srv->watchdog.data = srv;
  uv_timer_start(&srv->watchdog, on_watchdog, ms, ms);
  srv->watchdog_on = true;
  log_msg(LOG_LEVEL_INFO, "watchdog: pinging every %" PRIu64 " ms", ms);
}

/* The test seam of docs/operations.md: SHARDPORTD_TEST_ROUND_DELAY_MS=N
 * makes the engine pause N ms after preparing the pool and after every
 * round (at most a minute), so that tests can watch or break an export
 * while it moves. */
static uint32_t test_round_delay(void) {
  const char *v = getenv("SHARDPORTD_TEST_ROUND_DELAY_MS");
  if (v == NULL || v[0] == '\0')
    return 0;
  char *end;
  unsigned long ms = strtoul(v, &end, 10);
  if (*end != '\0' || ms > 60000) {
    log_msg(LOG_LEVEL_WARN, "SHARDPORTD_TEST_ROUND_DELAY_MS=%s ignored", v);
    return 0;
  }
  log_msg(LOG_LEVEL_WARN, "test seam: the engine pauses %lu ms per round", ms);
  return (uint32_t)ms;
}

/* The test seam of docs/operations.md: SHARDPORTD_TEST_DIGEST_XOR=N
 * (decimal or 0x hex) is xored into every plan digest this daemon reports
 * to a job's root, so that tests see daemons disagree. */
static uint64_t test_digest_xor(void) {
  const char *v = getenv("SHARDPORTD_TEST_DIGEST_XOR");
  if (v == NULL || v[0] == '\0')
    return 0;
  char *end;
  unsigned long long x = strtoull(v, &end, 0);
  if (*end != '\0') {
    log_msg(LOG_LEVEL_WARN, "SHARDPORTD_TEST_DIGEST_XOR=%s ignored", v);
    return 0;
  }
  log_msg(LOG_LEVEL_WARN, "test seam: plan digests reported with 0x%llx "
          "xored in", x);
  return x;
}

/* The test seam of docs/operations.md: SHARDPORTD_TEST_WORKER_GATE=PATH
 * names a FIFO that holds every large frame on a worker thread (conn.c),
 * before its decoding and before each of its later steps, until a test has
 * opened PATH for writing and closed it again, so that tests can end the
 * frame's connection or job while the frame is surely there. */
static const char *test_worker_gate(void) {
  const char *v = getenv("SHARDPORTD_TEST_WORKER_GATE");
  if (v == NULL || v[0] == '\0')
    return NULL;
  /* Checked here, on the loop, so that the workers need not log. */
  struct stat st;
  if (stat(v, &st) != 0 || !S_ISFIFO(st.st_mode)) {
    log_msg(LOG_LEVEL_WARN, "SHARDPORTD_TEST_WORKER_GATE=%s ignored: not a "
            "FIFO", v);
    return NULL;
  }
  log_msg(LOG_LEVEL_WARN, "test seam: large frames wait on their worker for "
          "the FIFO %s", v);
  return v;
}

/* Runs the loop until every handle is closed and checks that none leaked. */
static int finish_loop(uv_loop_t *loop) {
  uv_run(loop, UV_RUN_DEFAULT);
  int rc = uv_loop_close(loop);
  if (rc != 0)
    log_msg(LOG_LEVEL_ERROR, "event loop closed with handles open: %s",
            uv_strerror(rc));
  return rc;
}

uint32_t server_cpus(void) {
  cpu_set_t set;
  int cpus = sched_getaffinity(0, sizeof set, &set) == 0 ? CPU_COUNT(&set)
                                                          : 1;
  return cpus > 1 ? (uint32_t)cpus : 1;
}

uint32_t server_engine_threads(const struct config *cfg) {
  if (cfg->engine_threads > 0)
    return cfg->engine_threads;
  /* At most the engine's 64. */
  uint32_t cpus = server_cpus();
  return cpus > 64 ? 64 : cpus;
}

int server_run(const struct config_origin *origin, struct config *cfg,
               const struct backend_choice *backend) {
  uv_loop_t loop;
  int rc = uv_loop_init(&loop);
  if (rc != 0) {
    log_msg(LOG_LEVEL_ERROR, "uv_loop_init: %s", uv_strerror(rc));
    return -1;
  }
  struct server srv = {
      .loop = &loop,
      .cfg = cfg,
      .origin = origin,
      .backend = backend,
      .started_ns = uv_hrtime(),
      .listener = {.fd = -1},
      .peer_fd = -1,
      .mesh_ops = &export_mesh_ops,
  };
  /* Tells this daemon apart from others of a job (and from itself). */
  if (getrandom(&srv.node_id, sizeof srv.node_id, 0) != sizeof srv.node_id)
    srv.node_id = uv_hrtime() ^ ((uint64_t)getpid() << 32);
  srv.reserve_fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
  srv.test_round_delay_ms = test_round_delay();
  srv.test_digest_xor = test_digest_xor();
  srv.test_worker_gate = test_worker_gate();
  srv.engine_threads = server_engine_threads(cfg);
  srv.metrics = metrics_new(backend->active, backend->reason,
                            metrics_refresh, &srv.metrics_async);
  if (srv.metrics == NULL ||
      pool_create(cfg->pool_capacity, cfg->gpu_pool_capacity, &srv.pool) != 0 ||
      stage_init(&srv) != 0) {
    log_msg(LOG_LEVEL_ERROR, srv.metrics == NULL ? "out of memory for the metrics"
                             : srv.pool == NULL  ? "cannot create the memory pool"
                                                 : "cannot stage large frames");
    pool_destroy(srv.pool);
    metrics_free(srv.metrics);
    if (srv.reserve_fd >= 0)
      close(srv.reserve_fd);
    uv_loop_close(&loop);
    return -1;
  }

  if (start_signals(&srv) != 0 || listen_open(cfg, &srv.listener) != 0 ||
      (rc = uv_poll_init(&loop, &srv.listen_poll, srv.listener.fd)) != 0 ||
      nodelink_listen_open(&srv) != 0 || start_metrics(&srv) != 0) {
    if (rc != 0)
      log_msg(LOG_LEVEL_ERROR, "uv_poll_init: %s", uv_strerror(rc));
    else if (srv.listener.fd >= 0 && srv.listen_poll.type == UV_POLL)
      uv_close((uv_handle_t *)&srv.listen_poll, NULL);
    listen_close(&srv.listener);
    uv_close((uv_handle_t *)&srv.sig_term, NULL);
    uv_close((uv_handle_t *)&srv.sig_int, NULL);
    uv_close((uv_handle_t *)&srv.sig_hup, NULL);
    uv_close((uv_handle_t *)&srv.drain_timer, NULL);
    nodelink_listen_close(&srv);
    stage_close(&srv);
    finish_loop(&loop);
    stage_free(&srv);
    pool_destroy(srv.pool);
    metrics_free(srv.metrics);
    if (srv.reserve_fd >= 0)
      close(srv.reserve_fd);
    return -1;
  }
  srv.listen_poll.data = &srv;
  uv_poll_start(&srv.listen_poll, UV_READABLE, on_listen);
  pool_free_on_workers(srv.pool, &loop);
  pool_use_huge_pages(srv.pool, cfg->pool_huge_pages);
  loopwatch_start(&srv);
  start_watchdog(&srv);
  start_pool_watch(&srv);

  char file[PATH_MAX + 64];
  config_describe_file(cfg, file, sizeof file);
  log_msg(LOG_LEVEL_INFO,
          "listening on %s%s (protocol %d, configuration %s, backend %s: %s)",
          srv.listener.path,
          srv.listener.from_systemd ? " (from systemd)" : "",
          SP_PROTOCOL_VERSION, file, backend->active, backend->reason);
  char status[256];
  snprintf(status, sizeof(status), "serving on %s", srv.listener.path);
  notify_ready(status);
  detach_ready();

  rc = finish_loop(&loop);
  stage_free(&srv);
  pool_destroy(srv.pool);
  metrics_free(srv.metrics);
  if (srv.reserve_fd >= 0)
    close(srv.reserve_fd);
  log_msg(LOG_LEVEL_INFO, "stopped");
  return rc == 0 && !srv.exit_failure ? 0 : -1;
}
