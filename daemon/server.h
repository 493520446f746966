/*
 * server.h - the server: the loop, its signals, its listener, its lists
 * (server.c).
 */
#ifndef SP_DAEMON_SERVER_H
#define SP_DAEMON_SERVER_H

#include <stdbool.h>
#include <stdint.h>
#include <uv.h>

#include "daemon/config.h"
#include "daemon/layer.h"
#include "daemon/listen.h"
#include "daemon/log.h"
#include "daemon/loopwatch.h"

struct backend_choice;
struct conn;
struct job;
struct metrics;
struct metrics_http;
struct mesh_ops;
struct nodelink;
struct peerhost_entry;
struct pool;
struct quota_user;

struct server {
  uv_loop_t *loop;
  /* The running configuration (a reload changes what may change live)
   * and where it came from. */
  struct config *cfg;
  const struct config_origin *origin;
  const struct backend_choice *backend;
  struct listener listener;
  uv_poll_t listen_poll;
  uv_signal_t sig_term;
  uv_signal_t sig_int;
  uv_signal_t sig_hup;
  uv_timer_t watchdog;
  bool watchdog_on;
  /* Stopping (drain.c): draining refuses new work while the running
   * exports finish, until drain_deadline_ms; stopping closes everything. */
  bool draining;
  bool drain_expired;
  char stop_reason[16];
  uv_timer_t drain_timer;
  uint64_t drain_deadline_ms;
  bool stopping;
  /* GPUs a sticky CUDA error ended (drain.c, drain_check_gpus): how many
   * were reported, and whether the daemon exits with failure for it. */
  int gpus_failed;
  bool exit_failure;
  /* Kept open so that accept() can be answered even at EMFILE. */
  int reserve_fd;
  struct log_limit accept_log;
  uint64_t started_ns;
  uint64_t next_conn_id;
  struct conn *conns;
  uint32_t nclients;
  /* The connections' large frames, daemon-wide (stage.c). */
  struct stage *stage;
  struct job *jobs;
  uint32_t njobs;
  /* What each user holds (quota.c). */
  struct quota_user *users;
  struct pool *pool;
  uv_poll_t pool_poll; /* the pool's inotify descriptor */
  bool pool_poll_on;
  /* Copying threads per export: engine_threads, resolved. */
  uint32_t engine_threads;
  /* Test seam (docs/operations.md): SHARDPORTD_TEST_ROUND_DELAY_MS makes
   * the engine pause after preparing the pool and after every round, so
   * tests can act mid-export. */
  uint32_t test_round_delay_ms;
  /* Test seam: SHARDPORTD_TEST_DIGEST_XOR flips bits of the plan digests
   * this daemon reports to a job's root, to test the mismatch path. */
  uint64_t test_digest_xor;
  /* Test seam: SHARDPORTD_TEST_WORKER_GATE names a FIFO that holds each
   * large frame on a worker, before its decoding and each later step,
   * until a test opens and closes it, so tests can end a connection or job
   * while a frame is there; NULL when unset. */
  const char *test_worker_gate;
  /* Other daemons (nodelink.c): the peer listener (-1 when peer_listen is
   * off), the address they dial, this daemon's random id among them, and
   * the links not yet closed. */
  int peer_fd;
  uv_poll_t peer_poll;
  char peer_address[NODE_ADDR_MAX];
  uint64_t node_id;
  uint64_t next_link_id;
  struct nodelink *links;
  /* Accepted links that have not proved who they are, and the most there
   * may be (peer_handshakes, at most a quarter of the descriptor limit). */
  uint32_t peer_unidentified;
  uint32_t peer_handshake_cap;
  /* Room to choose a link to drop among peer_handshake_cap (nodelink.c). */
  struct peerhost_entry *peer_evict_scratch;
  struct log_limit peer_accept_log, peer_evict_log;
  /* What the across-nodes wing calls back (daemon/mesh/mesh.h). */
  const struct mesh_ops *mesh_ops;
  /* The loop's iterations (loopwatch.c): when the last one ended, the
   * loop's idle time then, and the longest busy time in each window: since
   * the last status, and since the last scrape. */
  uv_check_t loop_check;
  uint64_t loop_last_ns, loop_last_idle_ns;
  uint64_t loop_max_busy_ns[LOOPWATCH_WINDOWS];
  /* What Prometheus scrapes (daemon/metrics.h): the counters, always; the
   * HTTP endpoint when metrics_listen is set, and the async handle its
   * thread asks the loop for fresh gauges with. */
  struct metrics *metrics;
  struct metrics_http *metrics_http;
  uv_async_t metrics_async;
};

/* Listens, serves until SIGTERM/SIGINT (drained, drain.c) and shuts down
 * cleanly; SIGHUP reloads cfg from origin (reload.c).  Returns 0, or -1
 * when the daemon could not start serving. */
int server_run(const struct config_origin *origin, struct config *cfg,
               const struct backend_choice *backend);
/* Closes the listener, the signals and every connection and ends every
 * job: each connection is sent a last error of code with the reason, and
 * each rank of a job job_code (conn_finish), unless at_once, which closes
 * them without a word.  The loop then ends once every handle closed. */
void server_stop(struct server *srv, bool at_once, int job_code, int code,
                 const char *why);
/* At EMFILE: takes one waiting connection off listen_fd with the spare
 * descriptor and closes it, so that the listener stops being readable;
 * false when no spare descriptor could be had. */
bool server_shed(struct server *srv, int listen_fd);
/* The CPUs this daemon may run on (a cpuset or taskset may give it fewer
 * than the machine has), at least one. */
uint32_t server_cpus(void);
/* engine_threads resolved: 0 means the CPUs the daemon may run on. */
uint32_t server_engine_threads(const struct config *cfg);

#endif /* SP_DAEMON_SERVER_H */
