/*
 * abort.h - job_abort: ending a job for good (abort.c).
 */
#ifndef SP_DAEMON_ABORT_H
#define SP_DAEMON_ABORT_H

#include <msgpack.h>

#include "daemon/layer.h"
#include "proto/frame.h"
#include "proto/msg.h"

struct conn;

int abort_op_job_abort(struct conn *c, const struct sp_msg_head *head,
                       const msgpack_object *map, struct sp_frame *frame);

#endif /* SP_DAEMON_ABORT_H */
