/*
 * consumer.h - a job's consumers (consumer.c): processes outside the
 * trainer ranks that join with the job's ticket and an index, grant the
 * daemon write access to their buffers (storage_add on their connection)
 * and register their targets (target_add), docs/protocol.md, "Consumers".
 */
#ifndef SP_DAEMON_CONSUMER_H
#define SP_DAEMON_CONSUMER_H

#include <msgpack.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "daemon/consumer_buffer.h"
#include "daemon/layer.h"
#include "daemon/request.h"
#include "proto/frame.h"
#include "proto/msg.h"

struct conn;
struct job;

struct job_consumer {
  struct job *job;
  struct conn *conn; /* NULL once the connection is gone */
  uint32_t index;
  uint32_t device_type;
  char device[REQ_MAX_DEVICE + 1];
  uint32_t pid; /* its process, SO_PEERCRED */
  /* Its buffers, mapped writable, in registration order: a target's
   * storage is an index here. */
  struct consumer_buffer *buffers;
  size_t nbuffers, buffers_cap;
  /* Its targets, their storages resolved to indices into buffers. */
  struct req_target *targets;
  size_t ntargets, targets_cap;
  /* It sent receive and waits for the next push, or takes part in it. */
  bool receiving;
  uint64_t receive_id;
  uint32_t timeout_ms;
  uint64_t receive_deadline_ms;
  bool in_push;
  /* Left or disconnected; freed once no push writes its buffers. */
  bool lost;
  bool lost_handled;
  bool disconnected;
  uint64_t bytes_received; /* every push together */
};

/* Handlers of the dispatch table (ops.c). */
int consumer_op_join(struct conn *c, const struct sp_msg_head *head,
                     const msgpack_object *map, struct sp_frame *frame);
int consumer_op_target_add(struct conn *c, const struct sp_msg_head *head,
                           const msgpack_object *map, struct sp_frame *frame);
/* storage_add on a consumer's connection (registration.c hands it the
 * parsed storages): its buffers checked against this node's trainers and
 * mapped writable, all or none.  Replies itself. */
int consumer_add_storages(struct conn *c, struct job_consumer *k,
                          uint64_t request_id, const struct req_storage *s,
                          size_t n, const struct sp_frame *frame);
/* The consumer leaves (leave on its connection): replies itself. */
int consumer_leave(struct conn *c, struct job_consumer *k,
                   uint64_t request_id);
/* Its connection closed: the job notices on its next wake-up. */
void consumer_conn_closed(struct job_consumer *k);
/* Every lost consumer of the job departs (fails its push once), and is
 * freed once no push runs. */
void consumer_process_lost(struct job *job);
void consumer_free_lost(struct job *job);
/* Frees every consumer of the job (its end). */
void consumer_free_all(struct job *job);
/* "consumer C left job J<when>" (or "disconnected from"). */
void consumer_departure_text(const struct job *job, uint32_t index,
                             bool disconnected, const char *when, char *buf,
                             size_t len);
/* Whether a consumer left and has not joined again: then buf names the
 * first of them, as job_departed does for ranks. */
bool consumer_departed(const struct job *job, char *buf, size_t len);
/* The consumers array of a job map of status (docs/protocol.md). */
void consumer_status_pack(const struct job *job, msgpack_packer *pk);

#endif /* SP_DAEMON_CONSUMER_H */
