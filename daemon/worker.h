/*
 * worker.h - libuv's worker threads run below the event loop (worker.c).
 */
#ifndef SP_DAEMON_WORKER_H
#define SP_DAEMON_WORKER_H

#include "daemon/layer.h"

/* Called first by every job the daemon gives libuv's worker threads: the
 * thread runs below the loop's priority from then on (once per thread). */
void worker_background(void);

#endif /* SP_DAEMON_WORKER_H */
