/*
 * fakeworld.h - the daemon's jobs and exports on a real loop, without
 * sockets or processes: the real job.c, export.c and everything they call,
 * with two fakes linked in their place (docs/fakes.md, "The daemon's
 * connections and engine"):
 *
 *   - connections (conn.h): a client is a struct conn that records every
 *     reply it was sent, and reads them at once or not at all, as the test
 *     says; closing it tells its job as conn.c does;
 *   - the engine (engine_start, engine_join) and the movers' threads
 *     (xfer_spawn, xfer_guarded): an export's engine runs no thread and
 *     moves nothing; the test sets its round and bytes and ends it with a
 *     code.  Threads spawned for planning are real, and the test may hold
 *     the next one at a gate before it runs.
 *
 * Requests go through the daemon's dispatch table (ops.c), as conn.c
 * serves them.
 */
#ifndef SP_TESTS_UNIT_DAEMON_FAKEWORLD_H
#define SP_TESTS_UNIT_DAEMON_FAKEWORLD_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <uv.h>

#include "daemon/backend.h"
#include "daemon/config.h"
#include "daemon/export.h"
#include "daemon/job.h"
#include "daemon/peer.h"
#include "daemon/server.h"
#include "proto/msg.h"
#include "tests/unit/daemon/tserver.h"

/* One reply a fake connection was sent. */
struct fake_reply {
  char op[SP_OP_MAX + 1]; /* "error" for an error reply */
  uint64_t id;
  int code; /* an error reply's code */
  char message[SP_ERRMSG_MAX + 1];
  char phase[16];               /* progress */
  uint64_t export_id, part, parts; /* export */
  size_t nfds;
  uint8_t ticket[SP_TICKET_MAX]; /* job_create */
  size_t ticket_len;
};

#define FAKE_MAX_REPLIES 256

struct conn {
  struct server *srv;
  struct conn *next;
  uint64_t id;
  struct peer peer;
  struct job_member *member;
  struct job_consumer *consumer;
  /* Reading: replies are taken as soon as they are queued; else they stay
   * queued (out_bytes) until fake_conn_read. */
  bool reading;
  uint64_t out_bytes;
  bool closed;
  int finished; /* conn_finish's code, or 0 */
  void (*drained)(struct conn *c, void *arg);
  void *drained_arg;
  size_t nreplies;
  struct fake_reply replies[FAKE_MAX_REPLIES];
};

/* A daemon's state with no socket (tserver.h), and the fake connections
 * made on it. */
struct fake_world {
  struct tserver t;
  size_t nconns;
  struct conn *conns[64];
};

/* pool_bytes: the pool's capacity. */
void fake_world_init(struct fake_world *w, uint64_t pool_bytes);
/* Ends every job, runs the loop until they are gone and checks that every
 * handle closed and the pool is empty. */
void fake_world_free(struct fake_world *w);
/* A connection of the test's own user, as if it said hello. */
struct conn *fake_conn(struct fake_world *w);
/* The rank takes its queued replies; a drain callback runs as after a
 * write. */
void fake_conn_read(struct conn *c);
/* As if the peer closed its socket. */
void fake_conn_drop(struct conn *c);
/* The last reply, or the last of op; NULL when none. */
const struct fake_reply *fake_last(const struct conn *c);
const struct fake_reply *fake_last_op(const struct conn *c, const char *op);
/* How many replies of op it got. */
size_t fake_count_op(const struct conn *c, const char *op);

/* Serves one request on c through the dispatch table: op and the fields
 * packed by pack (NULL: none; nfields of them), with fds as the frame's
 * descriptors.  Returns the handler's code, as conn.c would reply it. */
int fake_request(struct conn *c, const char *op, uint32_t nfields,
                 void (*pack)(msgpack_packer *pk, const void *arg),
                 const void *arg, const int *fds, size_t nfds);

/* Runs the loop once without blocking, or until done(arg) holds (at most
 * a few seconds, then the test fails). */
void fake_turn(struct fake_world *w);
void fake_run_until(struct fake_world *w, bool (*done)(void *arg), void *arg);

/* The engine of the export that started last (NULL before any), and how
 * many engines started. */
struct engine *fake_engine(void);
unsigned fake_engine_starts(void);
/* Ends that engine's run with rc (and msg when rc != 0), as its thread
 * would. */
void fake_engine_end(int rc, const char *msg);
/* engine_start fails from now on (SP_ENOMEM, no thread). */
void fake_engine_refuse_start(void);
/* The next thread xfer_spawn starts waits at a gate until released. */
void fake_spawn_hold(void);
void fake_spawn_release(void);

/* ---- clients ----
 *
 * Each sends one request through the dispatch table and returns the code
 * its reply carries: 0, or the error reply's code. */

#define FAKE_MAX_RANKS 4

/* job_create of world ranks on c; on success the ticket into ticket
 * (SP_TICKET_MAX bytes) and its length into *len. */
int fake_create(struct conn *c, uint32_t world, uint8_t *ticket,
                size_t *len);
int fake_join(struct conn *c, const uint8_t *ticket, size_t len,
              uint32_t rank, uint32_t world);
/* storage_add of storage sid 1: bytes of memfd fd from offset 0, at
 * trainer address base. */
int fake_storage(struct conn *c, int fd, uint64_t bytes, uint64_t base);
/* tensor_add of a 1-D float32 tensor key in storage 1 from element 0:
 * rows of it here, global_rows in all, as placement ("shard0",
 * "replicated", ...). */
int fake_tensor(struct conn *c, const char *key, int64_t rows,
                int64_t global_rows, const char *placement);
/* export, with progress frames; timeout_ms and max_keys 0: the defaults. */
int fake_ask(struct conn *c, uint32_t timeout_ms, uint32_t max_keys);
/* release of export_id. */
int fake_release(struct conn *c, uint64_t export_id);

/* A job of world ranks on w, each joined on its own connection with a
 * memfd of rows float32 elements as storage 1 and rows of "w", a shard0
 * tensor of world * rows rows. */
struct fake_job {
  struct fake_world *w;
  struct job *job;
  uint32_t world;
  uint64_t rows;
  struct conn *rank[FAKE_MAX_RANKS];
  int fd[FAKE_MAX_RANKS];
  uint8_t ticket[SP_TICKET_MAX];
  size_t ticket_len;
};

void fake_job_up(struct fake_job *fj, struct fake_world *w, uint32_t world,
                 uint64_t rows);
/* Rank r's memfd and the job's ticket; fake_world_free ends the job. */
void fake_job_free(struct fake_job *fj);
/* The job's phase as status shows it (export_view). */
enum job_phase fake_phase(const struct fake_job *fj);

#endif
