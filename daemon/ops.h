/*
 * ops.h - the operations a client may send, each with its handler
 * (ops.c); conn.c looks a frame's op up here and serves it.
 */
#ifndef SP_DAEMON_OPS_H
#define SP_DAEMON_OPS_H

#include <msgpack.h>
#include <stdbool.h>

#include "daemon/layer.h"
#include "proto/frame.h"
#include "proto/msg.h"

struct conn;
struct conn_prepared_op;

typedef int (*op_handler)(struct conn *c, const struct sp_msg_head *head,
                          const msgpack_object *map, struct sp_frame *frame);

/* One entry of the dispatch table (ops.c says what each field promises). */
struct op {
  const char *name;
  bool takes_fds;
  bool new_work;
  op_handler handle;
  /* An op whose frames may be large: its two parts (conn.h). */
  const struct conn_prepared_op *prepared;
};

/* The entry of the op called name, or NULL when there is none. */
const struct op *ops_find(const char *name);

#endif /* SP_DAEMON_OPS_H */
