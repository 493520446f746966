/*
 * pump.h - the replies of a published export, streamed to their owners in
 * parts no faster than each connection takes them (pump.c).
 */
#ifndef SP_DAEMON_PUMP_H
#define SP_DAEMON_PUMP_H

#include <stddef.h>

#include "daemon/layer.h"

struct export;

/* Cuts each owner's reply into parts and hands it the export (its segment
 * until it releases it): 0, or a code with a sentence in msg to fail the
 * export with. */
int pump_start(struct export *ex, char *msg, size_t msglen);
/* Queues the next parts of each owner's reply while its connection has
 * room for a whole one; the rest goes when it has drained (the job wakes).
 * An owner whose last part is queued, or whose connection is gone, is
 * answered. */
void pump_run(struct export *ex);

#endif /* SP_DAEMON_PUMP_H */
