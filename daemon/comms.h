/*
 * comms.h - a job's NCCL communicators on this node, from the ranks'
 * joins to the exports that use them (comms.c, docs/gpu.md).
 */
#ifndef SP_DAEMON_COMMS_H
#define SP_DAEMON_COMMS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "daemon/cuda/gpu.h"
#include "daemon/layer.h"

struct job;
struct job_member;

/* Where a job's communicators are in their life (job->comms_state).
 * Generation 0's are started as the ranks join, before any export, so
 * that the first export does not wait for NCCL's set-up; from the first
 * export on, the exports make and keep them. */
enum comms_state {
  COMMS_UNSTARTED, /* none started yet: the next rank that joins starts them */
  COMMS_JOINING,   /* started as ranks joined, not every one seen set up */
  COMMS_JOINED,    /* every one started as ranks joined is set up (logged) */
  /* The exports make and keep them: the first export took the join-time
   * set over, or a rank left or an init failed before it (the export then
   * makes them as after a failure). */
  COMMS_EXPORTS,
};

/* The most local ranks one set of communicators holds. */
#define COMMS_MAX_RANKS 64

/* What an export needs of the job's communicators: this node's ranks in
 * it, and the NCCL id and generation its plan names. */
struct comms_want {
  struct gpu *gpu; /* the backend of its ranks on GPUs, else NULL */
  struct gpu_comm_rank ranks[COMMS_MAX_RANKS];
  size_t n;
  bool spans_nodes;
  bool has_id;
  uint8_t id[GPU_NCCL_ID_BYTES];
  uint64_t gen;
  uint32_t timeout_ms;
  /* The export's plan: the warm-up connects the peers its rounds use and
   * sizes staging for its largest round. */
  const struct plan *plan;
};

/* Adds rank r of this node, member m, to what an export wants. */
void comms_want_rank(struct comms_want *w, uint32_t r,
                     const struct job_member *m);
/* The export's communicators, on its planning thread (the set-up blocks
 * until every node's ranks are in it, or w->timeout_ms): the join-time set
 * warmed when it is the export's, the current generation's kept, or new
 * ones made (a new generation replaces the old: an export since they were
 * made failed).  Nothing to do for a job on one node or on the host.  0,
 * or a code with a sentence in msg. */
int comms_for_export(struct job *job, const struct comms_want *w, char *msg,
                     size_t msglen);
/* Starts generation 0's communicators of the local ranks that joined
 * since the last call (all in one group), and notes when every one is set
 * up; before the job's first export only.  On the loop. */
void comms_join(struct job *job);
/* Rank r is leaving before the first export: the join-time communicators
 * are aborted (the world cannot complete without it). */
void comms_rank_left(struct job *job, uint32_t r);
/* Whether join-time communicators are still being set up (the job's tick
 * watches them). */
bool comms_joining(const struct job *job);

#endif /* SP_DAEMON_COMMS_H */
