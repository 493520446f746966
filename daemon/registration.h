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

/* A storage_add or tensor_add read out of its frame and checked against
 * itself; what registering it still needs is the loop's. */
struct registration;

/* Prepares a registration from the decoded frame alone, so on any thread;
 * NULL when out of memory.  The registration points into the frame's
 * decoded objects and lives no longer than they do. */
struct registration *registration_prepare_storages(
    const msgpack_object *map, const struct sp_frame *frame);
struct registration *registration_prepare_tensors(
    const msgpack_object *map, const struct sp_frame *frame);
/* On the loop: one step of registering a prepared registration (NULL: out
 * of memory) with the connection's rank.  Returns 1 when it wants another
 * step, in a later turn of the loop; else it has replied (0, or a negative
 * code to reply).  The caller still frees it. */
int registration_serve(struct conn *c, const struct sp_msg_head *head,
                       struct sp_frame *frame, struct registration *r);
void registration_free(struct registration *r);
/* Handlers of the dispatch table: both steps at once. */
int registration_op_storage_add(struct conn *c,
                                const struct sp_msg_head *head,
                                const msgpack_object *map,
                                struct sp_frame *frame);
int registration_op_tensor_add(struct conn *c,
                               const struct sp_msg_head *head,
                               const msgpack_object *map,
                               struct sp_frame *frame);

#endif /* SP_DAEMON_REGISTRATION_H */
