/*
 * save.h - the daemon's part of a save: an export whose owners write their
 * tensors as a checkpoint (docs/checkpoints.md), then meet at the commit.
 *
 * The daemon never writes a checkpoint: each rank writes its own files in
 * its own process.  What the daemon does is what the ranks cannot do
 * alone: number the files so that every rank agrees (daemon/plan/files.h),
 * tell each owner the files of its tensors with its publication, follow
 * their writing for status, and hold the commit, three barriers that every
 * rank of the job passes together or not at all:
 *
 *   step 1  every rank's files are written and fsynced under temporary
 *           names (and rank 0 found no checkpoint in the way, or removed
 *           the old index when asked to overwrite);
 *   step 2  every rank renamed its files to their final names and fsynced
 *           the directory; rank 0's reply carries the weight map;
 *   step 3  rank 0's index is durable: the save is done.
 *
 * A rank reports each step with save_step and is answered once every rank
 * of the job (on every node: the root gathers them, daemon/mesh/coord.c) has reported
 * it.  A failure anywhere fails the export as any failure does, and every
 * rank still in the save hears it: with the reply it waits for, or, while
 * it writes, as an error carrying its export request's id.
 *
 * Runs on the loop; owned by the running export (export.c).
 */
#ifndef SP_DAEMON_SAVE_H
#define SP_DAEMON_SAVE_H

#include <msgpack.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "daemon/layer.h"
#include "daemon/plan/plan.h"
#include "proto/frame.h"
#include "proto/msg.h"

/* The one key a save refuses: safetensors keeps it for the metadata. */
#define SAVE_RESERVED_KEY "__metadata__"
/* The barriers of the commit. */
#define SAVE_STEPS 3u
/* Keys of the weight map per reply frame: 4,096 keys of at most 1,024
 * bytes fit the protocol's default frame. */
#define SAVE_MAP_PART_KEYS 4096u

struct job;
struct conn;
struct save;

/* The file of each key, as the publication tells its owner. */
struct save_files {
  const uint32_t *file; /* [plan->nkeys] */
  uint32_t nfiles;
  uint64_t total_size; /* the tensor bytes of every file */
};

/* A save of export_id under plan with files of at most limit bytes: the
 * numbering, and SP_EDTYPE (with msg naming the key) for a key whose dtype
 * safetensors cannot name, SP_EINVAL for a key named SAVE_RESERVED_KEY,
 * or SP_ENOMEM. */
int save_new(struct job *job, uint64_t export_id, const struct plan *plan,
             uint64_t limit, struct save **out, char *msg, size_t msglen);
void save_free(struct save *s);
struct save_files save_files(const struct save *s);

/* Rank r (a rank of this daemon) has its whole publication: from now on it
 * writes, and its next word from the daemon answers request_id (its
 * export request) until it reports step 1. */
void save_rank_published(struct save *s, uint32_t r, uint64_t request_id,
                         uint64_t bytes_to_write);
/* The export failed: every local rank in the save that has no answer yet
 * hears code and message. */
void save_fail(struct save *s, int code, const char *message);
/* The rank is gone (its connection closed): nothing more is sent to it. */
void save_rank_gone(struct save *s, uint32_t r);
/* Streams what waits for room (rank 0's weight map); true once the last
 * step is answered on every local rank. */
bool save_pump(struct save *s);
/* Its last step is passed on this node: the save is done. */
bool save_committed(const struct save *s);
/* When the save last advanced (a rank wrote or reported), for the
 * export's timeout. */
uint64_t save_progress_ms(const struct save *s);
/* The bytes this daemon's ranks wrote and will write, for status. */
void save_bytes(const struct save *s, uint64_t *written, uint64_t *to_write);

/* Across nodes (daemon/mesh/member.c): the root says every node's ranks reached step
 * (their reports gathered). */
void save_commit(struct job *job, uint32_t step);

/* The ops of docs/protocol.md, in conn.c's table; save_progress is a
 * notification, never answered. */
int save_op_step(struct conn *c, const struct sp_msg_head *head,
                 const msgpack_object *map, struct sp_frame *frame);
int save_op_progress(struct conn *c, const struct sp_msg_head *head,
                     const msgpack_object *map, struct sp_frame *frame);

#endif /* SP_DAEMON_SAVE_H */
