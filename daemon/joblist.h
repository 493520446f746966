/*
 * joblist.h - jobs and job_status: finding a job by id or prefix (joblist.c).
 */
#ifndef SP_DAEMON_JOBLIST_H
#define SP_DAEMON_JOBLIST_H

#include <msgpack.h>
#include <stdint.h>

#include "daemon/layer.h"
#include "daemon/request.h"
#include "proto/frame.h"
#include "proto/msg.h"

struct conn;
struct job;
struct server;

/* The job whose id is ref or starts with it (ref: 1 to 32 lowercase hex
 * digits): 0, SP_ENOJOB, or SP_EINVAL when ref fits several ids; with a
 * sentence in msg.  A daemon keeps one shadow of a job rooted elsewhere
 * per secret (job.c), so one id may name several jobs: *named says how
 * many, and *out is one of them. */
int joblist_find(const struct server *srv, const char *ref, struct job **out,
                 uint32_t *named, char *msg, size_t msglen);
/* Handlers of the dispatch table (ops.c). */
int joblist_op_jobs(struct conn *c, const struct sp_msg_head *head,
                    const msgpack_object *map, struct sp_frame *frame);
int joblist_op_job_status(struct conn *c, const struct sp_msg_head *head,
                          const msgpack_object *map, struct sp_frame *frame);

#endif /* SP_DAEMON_JOBLIST_H */
