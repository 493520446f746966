/*
 * consume_run.h - the movers' part of a push within one node: every local
 * move of a consumer plan (daemon/plan/consume.h) whose sender is on this
 * node, copied by the copy engine (copy.h) straight from the sending
 * rank's storage into the consumer's buffer, round after round, on a
 * number of threads, reading the trainers' mappings under the SIGBUS guard
 * (thread.h).
 *
 * The movers know buffers, never jobs: the caller hands the trainers'
 * storages as the registry keeps them (read-only mappings, engine.h's
 * struct xfer_storage) and each consumer's storages as writable mappings
 * of exactly the buffers it granted.  Nothing else is written.  The moves
 * between nodes (the plan's buckets) are not this run's: consume_pack.h
 * packs and unpacks them, and the mesh's data links carry the bytes.
 */
#ifndef SP_DAEMON_XFER_CONSUME_RUN_H
#define SP_DAEMON_XFER_CONSUME_RUN_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

#include "daemon/plan/consume.h"
#include "daemon/xfer/engine.h"
#include "daemon/xfer/layer.h"
#include "proto/msg.h"

/* The bytes one work item copies at most when no chunk is given: a move
 * larger than this is cut into slices of whole rows of its dim 0, so the
 * threads share one large tensor. */
#define CONSUME_RUN_CHUNK (4u << 20)

struct consume_run {
  const struct consume_plan *plan;
  uint64_t node; /* the local moves of this node's ranks are run */
  /* [world]: each rank's storages, indexed as its registration lists
   * them (a move's src_storage); ranks on other nodes may be NULL. */
  const struct xfer_storage *const *src;
  /* [nconsumers]: each consumer's storages as writable mappings, indexed
   * as its registration lists them (dst_storage); consumers on other
   * nodes may be NULL. */
  uint8_t *const *const *dst;
  uint32_t threads; /* copying threads, at least 1 */
  uint64_t chunk;   /* 0: CONSUME_RUN_CHUNK */
  /* [nconsumers] or NULL: the bytes each consumer has received so far,
   * added to as they land (status reads them). */
  _Atomic uint64_t *received;
  _Atomic uint64_t bytes_moved;
  _Atomic bool cancel; /* set by the caller: the run stops between items */
  /* Valid once consume_run_local returned: 0, or a code and a sentence
   * naming the key, the rank and the consumer. */
  int rc;
  char msg[SP_ERRMSG_MAX + 1];
};

/* Runs every round's local moves of run->node from the calling thread
 * (with run->threads - 1 helpers); returns run->rc: 0, SP_EBADFD when a
 * trainer's storage could not be read or a consumer's buffer could not be
 * written (its file shrank after it was registered), SP_EABORTED when
 * cancel was set, SP_ENOMEM. */
int consume_run_local(struct consume_run *run);

#endif /* SP_DAEMON_XFER_CONSUME_RUN_H */
