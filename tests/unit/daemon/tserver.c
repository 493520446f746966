/*
 * tserver.c - a daemon's server state for unit tests; see tserver.h.
 */
#include <check.h>
#include <string.h>
#include <time.h>

#include "daemon/log.h"
#include "daemon/metrics.h"
#include "daemon/pool.h"
#include "tests/unit/daemon/tserver.h"

void tserver_init(struct tserver *t, uint64_t pool_bytes) {
  memset(t, 0, sizeof *t);
  ck_assert_int_eq(uv_loop_init(&t->loop), 0);
  config_default(&t->cfg);
  /* The tests read what the daemon decides, not its words. */
  t->cfg.log_level = LOG_LEVEL_ERROR;
  log_init(LOG_LEVEL_ERROR);
  t->backend.active = "host";
  struct server *srv = &t->srv;
  srv->loop = &t->loop;
  srv->cfg = &t->cfg;
  srv->backend = &t->backend;
  srv->peer_fd = -1;
  srv->engine_threads = 1;
  ck_assert_int_eq(pool_create(pool_bytes, 0, &srv->pool), 0);
  srv->metrics = metrics_new("host", "", NULL, NULL);
  ck_assert_ptr_nonnull(srv->metrics);
}

void tserver_free(struct tserver *t) {
  pool_destroy(t->srv.pool);
  metrics_free(t->srv.metrics);
  /* Handles closed last close in the next turns, and work queued on the
   * loop's workers (registries freed there) ends: then the loop closes. */
  for (int i = 0; i < 10000 && uv_run(&t->loop, UV_RUN_NOWAIT) != 0; i++)
    nanosleep(&(struct timespec){.tv_nsec = 1000000}, NULL);
  ck_assert_int_eq(uv_loop_close(&t->loop), 0);
}
