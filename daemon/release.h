/*
 * release.h - release: a rank gives back an export published to it
 * (release.c).
 */
#ifndef SP_DAEMON_RELEASE_H
#define SP_DAEMON_RELEASE_H

#include <msgpack.h>

#include "daemon/layer.h"
#include "proto/frame.h"
#include "proto/msg.h"

struct conn;

/* The handler of the dispatch table (ops.c). */
int release_op_release(struct conn *c, const struct sp_msg_head *head,
                       const msgpack_object *map, struct sp_frame *frame);

#endif /* SP_DAEMON_RELEASE_H */
