/*
 * loopwatch.c - how long the event loop's iterations keep it from polling.
 *
 * Every client is served from one loop, so the longest iteration is the
 * longest any client may wait for an answer however little it asks: the
 * figure that shows one client's work stalling the others (status
 * loop_max_busy_us, docs/protocol.md).  An iteration's busy time is its
 * whole time less what it spent waiting in the poll for events, which
 * libuv counts itself (UV_METRICS_IDLE_TIME); it is taken at the end of
 * each iteration, from a check handle.  Status requests and metrics
 * scrapes each see the longest since their own previous one.
 */
#include "daemon/log.h"
#include "daemon/loopwatch.h"
#include "daemon/server.h"

static void on_check(uv_check_t *check) {
  struct server *srv = check->data;
  uint64_t now = uv_hrtime();
  uint64_t idle = uv_metrics_idle_time(srv->loop);
  uint64_t busy = (now - srv->loop_last_ns) - (idle - srv->loop_last_idle_ns);
  /* The idle count can run ahead of hrtime by a clock tick. */
  if (busy > now - srv->loop_last_ns)
    busy = 0;
  for (int w = 0; w < LOOPWATCH_WINDOWS; w++)
    if (busy > srv->loop_max_busy_ns[w])
      srv->loop_max_busy_ns[w] = busy;
  srv->loop_last_ns = now;
  srv->loop_last_idle_ns = idle;
}

void loopwatch_start(struct server *srv) {
  int rc = uv_loop_configure(srv->loop, UV_METRICS_IDLE_TIME);
  if (rc != 0)
    log_msg(LOG_LEVEL_WARN,
            "uv_loop_configure: %s; loop_max_busy_us counts waiting too",
            uv_strerror(rc));
  uv_check_init(srv->loop, &srv->loop_check);
  srv->loop_check.data = srv;
  srv->loop_last_ns = uv_hrtime();
  srv->loop_last_idle_ns = uv_metrics_idle_time(srv->loop);
  uv_check_start(&srv->loop_check, on_check);
  /* Watching alone must not keep the loop running at shutdown. */
  uv_unref((uv_handle_t *)&srv->loop_check);
}

void loopwatch_stop(struct server *srv) {
  uv_close((uv_handle_t *)&srv->loop_check, NULL);
}

uint64_t loopwatch_take_max_ns(struct server *srv, enum loopwatch_window w) {
  uint64_t ns = srv->loop_max_busy_ns[w];
  srv->loop_max_busy_ns[w] = 0;
  return ns;
}
