/*
 * export.h - one export of a job, from the ranks' requests to their replies
 * (export.c).
 */
#ifndef SP_DAEMON_EXPORT_H
#define SP_DAEMON_EXPORT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "daemon/job.h"
#include "daemon/layer.h"
#include "proto/frame.h"
#include "proto/msg.h"

struct conn;
struct conn_prepared_op;

/* An export request in two parts (conn.h): a large groups list is parsed
 * on a worker thread. */
extern const struct conn_prepared_op export_ask_op;
int export_op_request(struct conn *c, const struct sp_msg_head *head,
                      const msgpack_object *map, struct sp_frame *frame);
int export_op_release(struct conn *c, const struct sp_msg_head *head,
                      const msgpack_object *map, struct sp_frame *frame);
/* Advances the job's exports: starts one when every rank asked, moves a
 * running one on when its thread finished, fails them for lost ranks. */
void export_advance(struct job *job);
/* Periodic work: gather deadlines, stalls, progress frames, the rate. */
void export_tick(struct job *job);
/* Starts generation 0's NCCL communicators of the local ranks that joined
 * since the last call (all in one group), and notes when every one is set
 * up; before the job's first export only (docs/gpu.md).  On the loop. */
void export_comms_join(struct job *job);
/* Rank r is leaving before the first export: the join-time communicators
 * are aborted (the world cannot complete without it). */
void export_comms_rank_left(struct job *job, uint32_t r);
/* A member is lost (left or disconnected): fails what it takes part in. */
void export_member_lost(struct job *job, struct job_member *m);
/* Whether an export runs: its thread may read the members' storages and
 * its plan borrows their registrations, so members are freed only after. */
bool export_busy(const struct job *job);
/* Frees the cached plan (registrations or members changed). */
void export_drop_cache(struct job *job);
/* Progress and phase of the job for status. */
struct export_view {
  enum job_phase phase;
  uint64_t export_id;
  uint32_t round, rounds;
  uint64_t bytes_moved, bytes_total;
  /* The owners' segments on this node, and how much of them the engine
   * has prepared (phase allocating). */
  uint64_t bytes_prepared, bytes_to_prepare;
  /* A save: the bytes this daemon's ranks wrote, and will. */
  uint64_t bytes_written, bytes_to_write;
  double rate_bps;
  uint64_t pool_used;
};
void export_view(const struct job *job, struct export_view *out);
const char *export_phase_name(enum job_phase phase);
/* Fails the ranks of this node waiting for an export, and logs the failure
 * (once, at warn) when there are any. */
void export_fail_asks(struct job *job, int code, const char *message);
/* Whether a rank of this node waits for an export. */
bool export_any_asked(const struct job *job);
/* Fails the running export (across nodes, the root hears it and fails it
 * on every node) and the ranks waiting for one, with code and message:
 * an abort, a drain that ran out of time. */
void export_abort(struct job *job, int code, const char *message);
/* The running export's save (daemon/save.h), or NULL. */
struct save *export_save(const struct job *job);
/* Fails the running export on every rank, and across nodes on every node
 * (a save's rank that could not write, save.c). */
void export_fail_running(struct job *job, int code, const char *message);
/* The wing's way back into jobs and exports (daemon/mesh/mesh.h), which
 * the server hands it. */
struct mesh_ops;
extern const struct mesh_ops export_mesh_ops;

#endif /* SP_DAEMON_EXPORT_H */
