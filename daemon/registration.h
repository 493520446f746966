/*
 * registration.h - storage_add and tensor_add, registered in steps
 * (registration.c).
 */
#ifndef SP_DAEMON_REGISTRATION_H
#define SP_DAEMON_REGISTRATION_H

#include <msgpack.h>

#include "daemon/layer.h"
#include "proto/frame.h"
#include "proto/msg.h"

struct conn;
struct conn_prepared_op;

/* A storage_add or tensor_add read out of its frame and checked against
 * itself; what registering it still needs is the loop's. */
struct registration;

/* storage_add and tensor_add in two parts (conn.h).  A prepared
 * registration points into the frame's decoded objects and lives no
 * longer than they do; serve takes one step of registering it with the
 * connection's rank; close closes what it opened on a GPU and no registry
 * kept. */
extern const struct conn_prepared_op registration_storages_op;
extern const struct conn_prepared_op registration_tensors_op;
/* Handlers of the dispatch table: both steps at once. */
int job_op_storage_add(struct conn *c, const struct sp_msg_head *head,
                       const msgpack_object *map, struct sp_frame *frame);
int job_op_tensor_add(struct conn *c, const struct sp_msg_head *head,
                      const msgpack_object *map, struct sp_frame *frame);

#endif /* SP_DAEMON_REGISTRATION_H */
