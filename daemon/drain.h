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
/* Looks for GPUs whose context a sticky CUDA error ended
 * (daemon/cuda/gpu.h, gpu_failure) since the last look: logs each, with
 * the restart it needs, and drains the daemon, which then exits with
 * failure so that its service manager restarts it (docs/operations.md).
 * Called where a CUDA failure surfaces: a failed export, status. */
void drain_check_gpus(struct server *srv);
/* Answers a request that would start new work with daemon_stopping while
 * the daemon drains: true when it did (the request is done). */
bool drain_refuse(struct server *srv, struct conn *c, uint64_t id,
                  const char *op);

#endif /* SP_DAEMON_DRAIN_H */
