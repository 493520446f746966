/*
 * moving.h - an export's engine made ready to move (moving.c).
 */
#ifndef SP_DAEMON_MOVING_H
#define SP_DAEMON_MOVING_H

#include <stddef.h>

#include "daemon/layer.h"

struct export;

/* Fills in the export's engine from its plan: the local ranks' storages,
 * the owners' pool segments (device memory for ranks on GPUs), the data
 * plane of a job across nodes.  0, or a code with a sentence in msg to fail
 * the export with (what was taken is freed with it). */
int moving_prepare(struct export *ex, char *msg, size_t msglen);

#endif /* SP_DAEMON_MOVING_H */
