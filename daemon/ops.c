/*
 * ops.c - the dispatch table: every operation a client may send, with its
 * handler (docs/protocol.md lists them).  conn.c decodes a frame, finds its
 * op here, applies the table's promises (hello first, descriptors, drain)
 * and calls the handler.
 */
#include <stddef.h>
#include <string.h>

#include "daemon/abort.h"
#include "daemon/ask.h"
#include "daemon/conn.h"
#include "daemon/consumer.h"
#include "daemon/job.h"
#include "daemon/joblist.h"
#include "daemon/ops.h"
#include "daemon/push.h"
#include "daemon/registration.h"
#include "daemon/release.h"
#include "daemon/save.h"
#include "daemon/status.h"

static int op_ping(struct conn *c, const struct sp_msg_head *head,
                   const msgpack_object *map, struct sp_frame *frame) {
  (void)map;
  (void)frame;
  struct sp_msgbuf mb;
  sp__msgbuf_begin(&mb, "ping", head->id, 0);
  return conn_send_msgbuf(c, &mb);
}

static int op_status(struct conn *c, const struct sp_msg_head *head,
                     const msgpack_object *map, struct sp_frame *frame) {
  (void)map;
  (void)frame;
  struct sp_msgbuf mb;
  status_pack(conn_server(c), head->id, &mb);
  return conn_send_msgbuf(c, &mb);
}

/* The dispatch table.  A handler replies itself and returns 0, or returns a
 * negative code that is sent back as an error reply; save_progress, a
 * notification, is never answered (docs/protocol.md).  Messages that do not
 * declare takes_fds have their fds closed before the handler runs.  Those
 * that declare new_work start something a stopping daemon would only have
 * to break: while it drains (drain.c) they are answered daemon_stopping
 * and never reach their handler.  An op whose frames may be large splits
 * its handler in two (struct conn_prepared_op): prepare, which reads the
 * request out of the decoded frame and may run on a worker thread, and
 * serve, which does the rest on the loop; its handler does both. */
static const struct op ops[] = {
    {"hello", false, false, conn_op_hello},
    {"ping", false, false, op_ping},
    {"status", false, false, op_status},
    {"job_create", false, true, job_op_create},
    {"join", false, true, job_op_join},
    {"leave", false, false, job_op_leave},
    {"storage_add", true, true, registration_op_storage_add,
     &registration_storages_op},
    {"tensor_add", false, true, registration_op_tensor_add,
     &registration_tensors_op},
    {"export", false, true, ask_op_export, &ask_export_op},
    {"release", false, false, release_op_release},
    {"consumer_join", false, true, consumer_op_join},
    {"target_add", false, true, consumer_op_target_add},
    {"push", false, true, push_op_push},
    {"receive", false, true, push_op_receive},
    {"save_step", false, false, save_op_step},
    {"save_progress", false, false, save_op_progress},
    {"jobs", false, false, joblist_op_jobs},
    {"job_status", false, false, joblist_op_job_status},
    {"job_abort", false, false, abort_op_job_abort},
};

const struct op *ops_find(const char *name) {
  for (size_t i = 0; i < sizeof(ops) / sizeof(ops[0]); i++)
    if (strcmp(ops[i].name, name) == 0)
      return &ops[i];
  return NULL;
}
