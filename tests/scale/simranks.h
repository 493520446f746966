/*
 * simranks.h - the ranks of the scale simulation: one thread and one
 * sp_client per rank, rank r on the daemon of node r / per_node.
 *
 * Every rank holds one row of each of nkeys dim-0 keys ("k00000", ...;
 * float32, global shape [world, cols]) in one memfd storage, each element
 * the synthetic model's (tests/integration/model.h) for its key and flat
 * index, so every key's owner assembles it from every rank of every node
 * and checks it byte for byte against the unsharded original.  The ranks
 * and the main thread meet at one barrier before and after each export,
 * so that the main thread reads the daemons' counters while nothing moves
 * and every rank asks at once.  Threads never exit early: a rank whose
 * setup failed still meets every barrier, so that a failure is reported,
 * never a hang.
 */
#ifndef SP_TEST_SIMRANKS_H
#define SP_TEST_SIMRANKS_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

#include "proto/msg.h"
#include "shardport.h"

#define SIM_MAX_EXPORTS 8

struct sim_rank {
  pthread_t thread;
  int setup_rc;
  int export_rc[SIM_MAX_EXPORTS];
  /* The first failure this rank saw: its call's message or its checks. */
  char failure[SP_ERRMSG_MAX + 64];
  /* Monotonic seconds: just before sp_export, and when its first progress
   * frame of the moving phase came (0: none came). */
  double asked_s[SIM_MAX_EXPORTS], first_round_s[SIM_MAX_EXPORTS];
};

struct sim_job {
  uint32_t nodes, per_node, nkeys, cols, exports, timeout_ms;
  const char *const *sockets; /* one per node */
  /* Filled by sim_start. */
  uint32_t world;
  struct sim_rank *rank;
  /* Per key, the ranks that owned it in the running export: exactly one
   * after each. */
  _Atomic uint32_t *owners;
  pthread_barrier_t gate;
  sp_ticket ticket;
  _Atomic bool ticket_ready;
};

/* Starts the ranks and waits until each joined and registered (or failed
 * to: setup_rc).  0, or -1 when the threads could not be started. */
int sim_start(struct sim_job *j);
/* Lets every rank run the next export and waits until each one checked,
 * counted and released what it owned. */
void sim_export(struct sim_job *j);
/* Joins the threads (after the last sim_export) and frees the job. */
void sim_finish(struct sim_job *j);

double sim_now_s(void);

#endif /* SP_TEST_SIMRANKS_H */
