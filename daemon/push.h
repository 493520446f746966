/*
 * push.h - a job's pushes (push.c): every trainer rank's push and every
 * consumer's receive gathered, the consumer plan built or reused, and the
 * moves run on an engine thread straight from the trainers' storages into
 * the consumers' buffers; then every rank and consumer is answered, with
 * the push's bytes or its one error (docs/protocol.md, "push").
 */
#ifndef SP_DAEMON_PUSH_H
#define SP_DAEMON_PUSH_H

#include <msgpack.h>
#include <stdbool.h>
#include <stdint.h>

#include "daemon/layer.h"
#include "proto/frame.h"
#include "proto/msg.h"

struct conn;
struct consume_plan;
struct job;
struct job_consumer;
struct job_member;

/* The job's last consumer plan, reused by a push with the same options
 * while no rank or consumer registered, joined or left. */
struct push_cache {
  struct consume_plan *plan; /* NULL: none kept */
  uint32_t max_keys;
  uint64_t max_bytes;
  bool stale; /* dropped while a push ran on it */
};

int push_op_push(struct conn *c, const struct sp_msg_head *head,
                 const msgpack_object *map, struct sp_frame *frame);
int push_op_receive(struct conn *c, const struct sp_msg_head *head,
                    const msgpack_object *map, struct sp_frame *frame);
/* Starts a push once everyone came, finishes one whose thread ended. */
void push_advance(struct job *job);
/* Deadlines of the waiting and the running push. */
void push_tick(struct job *job);
/* A rank or consumer was lost: the push it waits for or runs in fails,
 * naming it (rank_lost, consumer_lost), on every rank and consumer. */
void push_member_lost(struct job *job, const struct job_member *m);
void push_consumer_lost(struct job *job, const struct job_consumer *k);
/* Whether a push runs (its thread reads and writes registered memory). */
bool push_busy(const struct job *job);
/* Whether someone waits for a push (the job's tick watches it). */
bool push_waiting(const struct job *job);
/* Registrations or members changed: the cached plan goes (once no push
 * runs on it). */
void push_cache_drop(struct job *job);
/* Fails the waiting and running push (an abort, a job's end). */
void push_abort(struct job *job, int code, const char *message);

#endif /* SP_DAEMON_PUSH_H */
