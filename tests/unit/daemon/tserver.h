/*
 * tserver.h - a daemon's server state for unit tests, without a listening
 * socket: its loop, its configuration (the defaults), the host backend, a
 * pool and the metrics.  The caller owns the structures; tserver fills them
 * in and takes them down.
 */
#ifndef SP_TESTS_UNIT_DAEMON_TSERVER_H
#define SP_TESTS_UNIT_DAEMON_TSERVER_H

#include <stdint.h>
#include <uv.h>

#include "daemon/backend.h"
#include "daemon/config.h"
#include "daemon/server.h"

struct tserver {
  uv_loop_t loop;
  struct config cfg;
  struct backend_choice backend;
  struct server srv;
};

/* pool_bytes: the pool's capacity. */
void tserver_init(struct tserver *t, uint64_t pool_bytes);
/* Frees the pool and the metrics, runs the loop until its last handle
 * closed and the work queued on it ended, and checks that it closes. */
void tserver_free(struct tserver *t);

#endif
