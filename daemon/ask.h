/*
 * ask.h - export: a rank asks for its job's next export (ask.c).
 */
#ifndef SP_DAEMON_ASK_H
#define SP_DAEMON_ASK_H

#include <msgpack.h>

#include "daemon/layer.h"
#include "proto/frame.h"
#include "proto/msg.h"

struct conn;
struct conn_prepared_op;

/* The export request in two parts (conn.h): a large groups list is parsed
 * on a worker thread. */
extern const struct conn_prepared_op ask_export_op;
/* The handler of the dispatch table (ops.c): both parts at once. */
int ask_op_export(struct conn *c, const struct sp_msg_head *head,
                  const msgpack_object *map, struct sp_frame *frame);

#endif /* SP_DAEMON_ASK_H */
