/*
 * pump.h - what an export's ranks hear: progress frames, and the replies
 * of a published export streamed to their owners in parts no faster than
 * each connection takes them (pump.c).
 */
#ifndef SP_DAEMON_PUMP_H
#define SP_DAEMON_PUMP_H

#include <stddef.h>
#include <stdint.h>

#include "daemon/job.h"
#include "daemon/layer.h"

struct conn;
struct export;

/* The one progress frame (docs/protocol.md, "export"): the export request
 * request_id's phase, round of rounds, bytes moved of total. */
void pump_progress_frame(struct conn *c, uint64_t request_id,
                         enum job_phase phase, uint32_t round,
                         uint32_t rounds, uint64_t moved, uint64_t total);
/* Tells every rank of ex that asked for progress what changed since it
 * last heard; a phase change always goes out. */
void pump_progress(struct export *ex);

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
