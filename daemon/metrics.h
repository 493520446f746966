/*
 * metrics.h - the daemon's counters for Prometheus (docs/operations.md,
 * "Monitoring"), and the HTTP endpoint that serves them.
 *
 * The loop records what happens (an export ends, a request is refused) and,
 * when a scrape asks, what it holds now (clients, jobs, pool bytes); engine
 * threads add the bytes they move to each peer daemon.  The endpoint's
 * thread only reads: it copies the counters under one mutex that the loop
 * holds for a few stores at a time, and formats the copy outside it, so a
 * scrape never waits on the loop's work nor the loop on a scrape.
 *
 * Labels are bounded: error codes (the table of include/shardport.h),
 * devices (POOL_MAX_DEVICES), and at most METRICS_MAX_PEERS peer addresses,
 * the rest summed under peer="other".  Job ids, export ids and keys are
 * never labels: each would make a new series per job or tensor, and the
 * journal (SHARDPORT_JOB) is where one job's story is read.
 */
#ifndef SP_DAEMON_METRICS_H
#define SP_DAEMON_METRICS_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "daemon/config.h"
#include "daemon/layer.h"

#define METRICS_MAX_PEERS 64
/* Devices the pool gauges name: the host and this many GPUs. */
#define METRICS_MAX_GPUS 16

struct metrics;

/* Bytes this daemon sent to and received from one peer daemon, over every
 * job; engine threads add to them while exports move. */
struct metrics_peer {
  char addr[NODE_ADDR_MAX];
  _Atomic uint64_t sent, received;
};

/* Bytes of node-protocol frames on control links between daemons
 * (daemon/mesh/nodelink.h), added from the loop. */
struct metrics_bytes {
  _Atomic uint64_t sent, received;
};

/* What the loop holds at the moment a scrape asked. */
struct metrics_gauges {
  uint64_t clients, jobs, ranks;
  uint64_t pool_used, pool_kept, pool_capacity; /* the host's */
  uint32_t ngpus;
  uint64_t gpu_used[METRICS_MAX_GPUS];
  uint64_t gpu_capacity; /* each GPU's share of the pool, 0: unbounded */
  /* The loop's longest iteration since the previous scrape (loopwatch.c). */
  uint64_t loop_max_busy_ns;
};

/* One finished export on this daemon (code 0: published). */
struct metrics_export {
  int code;
  double duration_s;
  uint64_t bytes_moved;
  uint32_t rounds;
  uint64_t keys;
};

/* backend and reason are copied.  refresh(arg) is called from a scraping
 * thread to ask the loop for fresh gauges (metrics_set_gauges); it must be
 * safe to call from any thread (uv_async_send).  NULL when out of memory. */
struct metrics *metrics_new(const char *backend, const char *reason,
                            void (*refresh)(void *arg), void *arg);
void metrics_free(struct metrics *m);

/* From the loop. */
void metrics_export_done(struct metrics *m, const struct metrics_export *e);
void metrics_planning_done(struct metrics *m, double seconds);
void metrics_refused(struct metrics *m, int code);
void metrics_set_gauges(struct metrics *m, const struct metrics_gauges *g);
/* The daemon's control-link counters, which every job's links add to; an
 * export across nodes that reused its job's previous plan. */
struct metrics_bytes *metrics_control(struct metrics *m);
void metrics_plan_reused(struct metrics *m);
/* The counters of peer addr, made at its first export: past
 * METRICS_MAX_PEERS addresses, the shared "other" entry.  From the loop. */
struct metrics_peer *metrics_peer(struct metrics *m, const char *addr);

/* From any thread: asks the loop for fresh gauges, waits for them at most
 * wait_ms (else the last ones are shown), and writes the exposition text
 * into a malloc'ed *out.  0, or SP_ENOMEM. */
int metrics_render(struct metrics *m, uint32_t wait_ms, char **out,
                   size_t *len);

/* Ends every wait of metrics_render, now and later, at once (the last
 * gauges are shown): the endpoint stops, and the loop that would answer
 * is the one joining its thread.  From any thread. */
void metrics_stop_waiting(struct metrics *m);

/* ---- metrics_http.c ---------------------------------------------------- */

struct metrics_http;

/* Serves GET /metrics on addr (config metrics_listen) from a thread of its
 * own, with at most max_connections at once: 0, or -1 (logged). */
int metrics_http_start(struct metrics *m, const struct sockaddr *addr,
                       uint32_t max_connections, struct metrics_http **out);
/* Stops serving and joins the thread; NULL allowed. */
void metrics_http_stop(struct metrics_http *h);

#endif /* SP_DAEMON_METRICS_H */
