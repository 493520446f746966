/*
 * drain.h - stopping: running exports finish before the daemon stops
 * (drain.c).
 */
#ifndef SP_DAEMON_DRAIN_H
#define SP_DAEMON_DRAIN_H

#include <stdbool.h>
#include <stdint.h>

#include "daemon/layer.h"

struct conn;
struct server;

/* SIGTERM or SIGINT (why): the daemon refuses new work, fails the exports
 * still gathering asks, lets the running exports finish within
 * drain_timeout, then stops.  A second signal stops at once. */
void drain_begin(struct server *srv, const char *why);
/* Answers a request that would start new work with daemon_stopping while
 * the daemon drains: true when it did (the request is done). */
bool drain_refuse(struct server *srv, struct conn *c, uint64_t id,
                  const char *op);

#endif /* SP_DAEMON_DRAIN_H */
