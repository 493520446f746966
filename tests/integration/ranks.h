/*
 * ranks.h - a job's ranks as threads of the test process, each with its own
 * sp_client, for tests that stop, abort or watch a daemon while an export
 * runs (daemon_drain.c, daemon_operator.c).
 *
 * Every rank holds one row of each of nkeys dim-0 keys ("k000", ...; float32,
 * global shape [world, 4], element (row, col) of key k is
 * k * 1000 + row * 10 + col), so every key's owner assembles it from every
 * rank and an export with max_keys 1 has nkeys rounds.  A rank records
 * what each call answered; the test asserts on it after ranks_finish.
 * Threads never call Check: they only record.
 */
#ifndef SP_TEST_RANKS_H
#define SP_TEST_RANKS_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

#include "proto/msg.h"
#include "shardport.h"

#define RANKS_MAX 4

struct ranks_rank {
  pthread_t thread;
  bool asks;       /* the test's choice: this rank asks for the export */
  int setup_rc;    /* connect, job_create, join, registration */
  int export_rc;   /* 1 until sp_export returned */
  char export_message[SP_ERRMSG_MAX + 1];
  bool data_ok;    /* every owned element is the original's */
  uint32_t owned;  /* keys it owns */
  int release_rc;
  int last_rc;     /* the ping made once the test lets the ranks go on */
  char last_message[SP_ERRMSG_MAX + 1];
  _Atomic bool asked, moving, exported;
};

struct ranks_job {
  const char *socket;
  uint32_t world;
  uint32_t nkeys;
  uint32_t max_keys;   /* 0: the daemon's default */
  uint32_t timeout_ms; /* the export's; 0: 10 s */
  struct ranks_rank rank[RANKS_MAX];
  /* Set by the threads. */
  sp_ticket ticket;
  _Atomic uint32_t ready;
  _Atomic bool ticket_ready, go_on;
};

/* Starts the ranks and waits until every one joined and registered (or
 * failed to: setup_rc).  The ranks whose asks is set ask for the export at
 * once. */
void ranks_start(struct ranks_job *j);
/* Waits until rank r's export request reached the daemon, or until data
 * moves for it (its progress said so); fails the test after a timeout. */
void ranks_wait_asked(struct ranks_job *j, uint32_t r);
void ranks_wait_moving(struct ranks_job *j, uint32_t r);
/* Waits until every asking rank's sp_export returned. */
void ranks_wait_exported(struct ranks_job *j);
/* Lets every rank make its last call (a ping) and joins the threads. */
void ranks_finish(struct ranks_job *j);

#endif /* SP_TEST_RANKS_H */
