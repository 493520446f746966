/*
 * loopwatch.h - the loop's longest iteration, per reader (loopwatch.c).
 */
#ifndef SP_DAEMON_LOOPWATCH_H
#define SP_DAEMON_LOOPWATCH_H

#include <stdint.h>

#include "daemon/layer.h"

struct server;

/* Who reads the loop's longest iteration (loopwatch.c): each reader's
 * window runs from its own previous read. */
enum loopwatch_window {
  LOOPWATCH_STATUS,  /* status loop_max_busy_us */
  LOOPWATCH_METRICS, /* shardport_loop_max_busy_seconds */
  LOOPWATCH_WINDOWS
};

/* Starts timing the loop's iterations; before the loop runs. */
void loopwatch_start(struct server *srv);
/* Closes the watch; with the server's other handles. */
void loopwatch_stop(struct server *srv);
/* The longest iteration's busy time, in nanoseconds, since the last call
 * for the same window; starts a new one.  The windows are independent: a
 * status does not shorten a scrape's, nor a scrape a status's. */
uint64_t loopwatch_take_max_ns(struct server *srv, enum loopwatch_window w);

#endif /* SP_DAEMON_LOOPWATCH_H */
