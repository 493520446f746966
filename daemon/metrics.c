/*
 * metrics.c - the daemon's counters and their Prometheus text exposition
 * (version 0.0.4, docs/operations.md "Monitoring").  metrics.h says who
 * writes what and why the labels stay bounded.
 */
#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "build_config.h"
#include "daemon/metrics.h"
#include "proto/text.h"
#include "shardport.h"

/* Every code of the error table, in its order: the label values of the
 * per-code counters (slot NCODES counts a code the table lacks). */
static const int codes[] = {
#define METRICS_CODE(name, num, wire, msg) -(num),
    SP_ERROR_MAP(METRICS_CODE)
#undef METRICS_CODE
};
#define NCODES (sizeof codes / sizeof codes[0])

/* Bucket bounds in seconds of both duration histograms: from a small
 * export on one node to the longest timeout an export may ask for. */
static const double bounds[] = {0.005, 0.01, 0.025, 0.05, 0.1,  0.25,
                                0.5,   1,    2.5,   5,    10,   30,
                                60,    120,  300,   600,  3600, 86400};
#define NBOUNDS (sizeof bounds / sizeof bounds[0])

struct histogram {
  uint64_t bucket[NBOUNDS]; /* observations <= bounds[i], not cumulative */
  uint64_t count;
  double sum;
};

/* What the mutex guards: copied whole by a scrape. */
struct counters {
  uint64_t published;
  uint64_t failed[NCODES + 1];
  uint64_t refused[NCODES + 1];
  uint64_t bytes_moved, rounds, keys;
  uint64_t plans_reused;
  struct histogram duration, planning;
  struct metrics_gauges gauges;
  uint64_t gauges_gen;
};

struct metrics {
  pthread_mutex_t lock;
  pthread_cond_t fresh; /* gauges_gen moved, or stop_waiting set */
  bool stop_waiting;    /* guarded by lock */
  struct counters c;
  char backend[32];
  char reason[512];
  double start_time_s;
  void (*refresh)(void *arg);
  void *refresh_arg;
  /* Peers: entries [0, npeers) are complete before npeers counts them
   * (release), so a scrape reads them without the lock. */
  struct metrics_peer peers[METRICS_MAX_PEERS];
  _Atomic uint32_t npeers;
  /* The addresses past the table's, summed; shown once one came. */
  struct metrics_peer other;
  _Atomic bool other_used;
  /* Control links' bytes, added by the loop without the lock. */
  struct metrics_bytes control;
};

struct metrics *metrics_new(const char *backend, const char *reason,
                            void (*refresh)(void *arg), void *arg) {
  struct metrics *m = calloc(1, sizeof *m);
  if (m == NULL)
    return NULL;
  pthread_condattr_t ca;
  pthread_condattr_init(&ca);
  pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
  if (pthread_mutex_init(&m->lock, NULL) != 0) {
    free(m);
    return NULL;
  }
  if (pthread_cond_init(&m->fresh, &ca) != 0) {
    pthread_mutex_destroy(&m->lock);
    free(m);
    return NULL;
  }
  pthread_condattr_destroy(&ca);
  snprintf(m->backend, sizeof m->backend, "%s", backend);
  snprintf(m->reason, sizeof m->reason, "%s", reason);
  snprintf(m->other.addr, sizeof m->other.addr, "other");
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  m->start_time_s = (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
  m->refresh = refresh;
  m->refresh_arg = arg;
  return m;
}

void metrics_free(struct metrics *m) {
  if (m == NULL)
    return;
  pthread_cond_destroy(&m->fresh);
  pthread_mutex_destroy(&m->lock);
  free(m);
}

static size_t code_slot(int code) {
  for (size_t i = 0; i < NCODES; i++)
    if (codes[i] == code)
      return i;
  return NCODES;
}

static void observe(struct histogram *h, double v) {
  size_t i = 0;
  while (i < NBOUNDS && v > bounds[i])
    i++;
  if (i < NBOUNDS)
    h->bucket[i]++;
  h->count++;
  h->sum += v;
}

void metrics_export_done(struct metrics *m, const struct metrics_export *e) {
  pthread_mutex_lock(&m->lock);
  if (e->code == 0)
    m->c.published++;
  else
    m->c.failed[code_slot(e->code)]++;
  m->c.bytes_moved += e->bytes_moved;
  m->c.rounds += e->rounds;
  m->c.keys += e->keys;
  observe(&m->c.duration, e->duration_s);
  pthread_mutex_unlock(&m->lock);
}

void metrics_planning_done(struct metrics *m, double seconds) {
  pthread_mutex_lock(&m->lock);
  observe(&m->c.planning, seconds);
  pthread_mutex_unlock(&m->lock);
}

void metrics_plan_reused(struct metrics *m) {
  pthread_mutex_lock(&m->lock);
  m->c.plans_reused++;
  pthread_mutex_unlock(&m->lock);
}

struct metrics_bytes *metrics_control(struct metrics *m) { return &m->control; }

void metrics_refused(struct metrics *m, int code) {
  pthread_mutex_lock(&m->lock);
  m->c.refused[code_slot(code)]++;
  pthread_mutex_unlock(&m->lock);
}

void metrics_stop_waiting(struct metrics *m) {
  pthread_mutex_lock(&m->lock);
  m->stop_waiting = true;
  pthread_cond_broadcast(&m->fresh);
  pthread_mutex_unlock(&m->lock);
}

void metrics_set_gauges(struct metrics *m, const struct metrics_gauges *g) {
  pthread_mutex_lock(&m->lock);
  m->c.gauges = *g;
  m->c.gauges_gen++;
  pthread_cond_broadcast(&m->fresh);
  pthread_mutex_unlock(&m->lock);
}

struct metrics_peer *metrics_peer(struct metrics *m, const char *addr) {
  uint32_t n = atomic_load_explicit(&m->npeers, memory_order_relaxed);
  for (uint32_t i = 0; i < n; i++)
    if (strcmp(m->peers[i].addr, addr) == 0)
      return &m->peers[i];
  if (n == METRICS_MAX_PEERS) {
    atomic_store_explicit(&m->other_used, true, memory_order_relaxed);
    return &m->other;
  }
  snprintf(m->peers[n].addr, sizeof m->peers[n].addr, "%s", addr);
  atomic_store_explicit(&m->npeers, n + 1, memory_order_release);
  return &m->peers[n];
}

/* ---- the exposition ---- */

/* The text grows in one buffer; a failed allocation is remembered and
 * reported once at the end. */
struct text {
  char *buf;
  size_t len, cap;
  bool oom;
};

static void put(struct text *t, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));

static void put(struct text *t, const char *fmt, ...) {
  for (;;) {
    if (t->oom)
      return;
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(t->buf + t->len, t->cap - t->len, fmt, ap);
    va_end(ap);
    if (n < 0) {
      t->oom = true;
      return;
    }
    if ((size_t)n < t->cap - t->len) {
      t->len += (size_t)n;
      return;
    }
    size_t cap = t->cap * 2 + (size_t)n;
    char *b = realloc(t->buf, cap);
    if (b == NULL) {
      t->oom = true;
      return;
    }
    t->buf = b;
    t->cap = cap;
  }
}

/* A label value as the format escapes it: backslash, quote, newline.  A
 * byte that is not UTF-8 (a path in another encoding, a message cut
 * mid-character) is shown as \xNN: Prometheus refuses a whole scrape over
 * one label value that is not UTF-8. */
static void put_label(struct text *t, const char *v) {
  const unsigned char *s = (const unsigned char *)v;
  size_t n = strlen(v);
  while (n > 0) {
    uint32_t cp;
    size_t k = sp__utf8_len(s, n, &cp);
    if (k == 0) {
      put(t, "\\\\x%02x", *s);
      k = 1;
    } else if (*s == '\\') {
      put(t, "\\\\");
    } else if (*s == '"') {
      put(t, "\\\"");
    } else if (*s == '\n') {
      put(t, "\\n");
    } else {
      put(t, "%.*s", (int)k, (const char *)s);
    }
    s += k;
    n -= k;
  }
}

static void head(struct text *t, const char *name, const char *type,
                 const char *help) {
  put(t, "# HELP %s %s\n# TYPE %s %s\n", name, help, name, type);
}

static void put_histogram(struct text *t, const char *name, const char *help,
                          const struct histogram *h) {
  head(t, name, "histogram", help);
  uint64_t below = 0;
  for (size_t i = 0; i < NBOUNDS; i++) {
    below += h->bucket[i];
    put(t, "%s_bucket{le=\"%g\"} %" PRIu64 "\n", name, bounds[i], below);
  }
  put(t, "%s_bucket{le=\"+Inf\"} %" PRIu64 "\n", name, h->count);
  put(t, "%s_sum %.9g\n", name, h->sum);
  put(t, "%s_count %" PRIu64 "\n", name, h->count);
}

/* One series per code of the table, zeros included, so that a rate over a
 * code that has not happened yet is 0 rather than absent. */
static void put_by_code(struct text *t, const char *name, const char *label,
                        const uint64_t *by_code) {
  for (size_t i = 0; i <= NCODES; i++) {
    if (i == NCODES && by_code[i] == 0)
      continue;
    put(t, "%s{%s=\"%s\"} %" PRIu64 "\n", name, label,
        i < NCODES ? sp_err_name(codes[i]) : "unknown", by_code[i]);
  }
}

static void put_pool(struct text *t, const char *name, const char *help,
                     uint64_t host, const struct metrics_gauges *g,
                     const uint64_t *gpu, uint64_t gpu_each) {
  head(t, name, "gauge", help);
  put(t, "%s{device=\"host\"} %" PRIu64 "\n", name, host);
  for (uint32_t i = 0; i < g->ngpus; i++)
    put(t, "%s{device=\"cuda:%" PRIu32 "\"} %" PRIu64 "\n", name, i,
        gpu != NULL ? gpu[i] : gpu_each);
}

static void put_peers(struct text *t, const struct metrics *m, bool sent) {
  const char *name = sent ? "shardport_peer_sent_bytes_total"
                          : "shardport_peer_received_bytes_total";
  head(t, name, "counter",
       sent ? "Bytes this daemon sent to a peer daemon in exports."
            : "Bytes this daemon received from a peer daemon in exports.");
  uint32_t n = atomic_load_explicit(&m->npeers, memory_order_acquire);
  for (uint32_t i = 0; i <= n; i++) {
    const struct metrics_peer *p = i < n ? &m->peers[i] : &m->other;
    uint64_t v = atomic_load_explicit(sent ? &p->sent : &p->received,
                                      memory_order_relaxed);
    if (i == n && !atomic_load_explicit(&m->other_used, memory_order_relaxed))
      continue;
    put(t, "%s{peer=\"", name);
    put_label(t, p->addr);
    put(t, "\"} %" PRIu64 "\n", v);
  }
}

static void put_all(struct text *t, const struct metrics *m,
                    const struct counters *c) {
  head(t, "shardport_build_info", "gauge",
       "The daemon's version and protocol version (always 1).");
  put(t, "shardport_build_info{version=\"%s\",protocol=\"%d\"} 1\n",
      SP_VERSION, SP_PROTOCOL_VERSION);
  head(t, "shardport_backend_info", "gauge",
       "The backend that serves and why it was chosen (always 1).");
  put(t, "shardport_backend_info{backend=\"");
  put_label(t, m->backend);
  put(t, "\",reason=\"");
  put_label(t, m->reason);
  put(t, "\"} 1\n");
  head(t, "shardport_start_time_seconds", "gauge",
       "When the daemon started, in seconds since the Unix epoch.");
  put(t, "shardport_start_time_seconds %.3f\n", m->start_time_s);

  head(t, "shardport_exports_total", "counter",
       "Exports this daemon took part in that ended, by result: published, "
       "or the error code they failed with.");
  put(t, "shardport_exports_total{result=\"published\"} %" PRIu64 "\n",
      c->published);
  put_by_code(t, "shardport_exports_total", "result", c->failed);
  head(t, "shardport_export_moved_bytes_total", "counter",
       "Bytes this daemon's exports moved (copied, sent and received).");
  put(t, "shardport_export_moved_bytes_total %" PRIu64 "\n", c->bytes_moved);
  head(t, "shardport_export_rounds_total", "counter",
       "Rounds of the exports that ended.");
  put(t, "shardport_export_rounds_total %" PRIu64 "\n", c->rounds);
  head(t, "shardport_export_keys_total", "counter",
       "Keys planned by the exports that ended.");
  put(t, "shardport_export_keys_total %" PRIu64 "\n", c->keys);
  put_histogram(t, "shardport_export_duration_seconds",
                "How long exports took, from the first rank's ask to the "
                "end.",
                &c->duration);
  put_histogram(t, "shardport_export_planning_duration_seconds",
                "How long planning took (a reused plan is only compared).",
                &c->planning);
  head(t, "shardport_requests_refused_total", "counter",
       "Requests answered with an error, by error code.");
  put_by_code(t, "shardport_requests_refused_total", "code", c->refused);

  const struct metrics_gauges *g = &c->gauges;
  head(t, "shardport_clients", "gauge", "Client connections open.");
  put(t, "shardport_clients %" PRIu64 "\n", g->clients);
  head(t, "shardport_jobs", "gauge", "Jobs this daemon holds.");
  put(t, "shardport_jobs %" PRIu64 "\n", g->jobs);
  head(t, "shardport_ranks", "gauge", "Ranks joined to this daemon's jobs.");
  put(t, "shardport_ranks %" PRIu64 "\n", g->ranks);
  head(t, "shardport_loop_max_busy_seconds", "gauge",
       "The longest time the event loop was busy in one iteration since "
       "the previous scrape: the longest any client waited.");
  put(t, "shardport_loop_max_busy_seconds %.6f\n",
      (double)g->loop_max_busy_ns / 1e9);
  put_pool(t, "shardport_pool_used_bytes",
           "Pool bytes in use (published tensors, kept included).",
           g->pool_used, g, g->gpu_used, 0);
  put_pool(t, "shardport_pool_kept_bytes",
           "Released pool bytes that ranks still hold mapped.", g->pool_kept,
           g, NULL, 0);
  put_pool(t, "shardport_pool_capacity_bytes",
           "Pool bytes the daemon may hold (0 on a GPU: as much as it has).",
           g->pool_capacity, g, NULL, g->gpu_capacity);
  put_peers(t, m, true);
  put_peers(t, m, false);
  head(t, "shardport_node_control_sent_bytes_total", "counter",
       "Bytes of node-protocol frames sent on jobs' control links.");
  put(t, "shardport_node_control_sent_bytes_total %" PRIu64 "\n",
      atomic_load_explicit(&m->control.sent, memory_order_relaxed));
  head(t, "shardport_node_control_received_bytes_total", "counter",
       "Bytes of node-protocol frames received on jobs' control links.");
  put(t, "shardport_node_control_received_bytes_total %" PRIu64 "\n",
      atomic_load_explicit(&m->control.received, memory_order_relaxed));
  head(t, "shardport_plans_reused_total", "counter",
       "Exports across nodes that reused the job's previous plan.");
  put(t, "shardport_plans_reused_total %" PRIu64 "\n", c->plans_reused);
}

int metrics_render(struct metrics *m, uint32_t wait_ms, char **out,
                   size_t *len) {
  struct counters *c = malloc(sizeof *c);
  if (c == NULL)
    return SP_ENOMEM;
  pthread_mutex_lock(&m->lock);
  uint64_t gen = m->c.gauges_gen;
  pthread_mutex_unlock(&m->lock);
  m->refresh(m->refresh_arg);
  struct timespec until;
  clock_gettime(CLOCK_MONOTONIC, &until);
  until.tv_sec += wait_ms / 1000;
  until.tv_nsec += (long)(wait_ms % 1000) * 1000000L;
  if (until.tv_nsec >= 1000000000L) {
    until.tv_sec++;
    until.tv_nsec -= 1000000000L;
  }
  pthread_mutex_lock(&m->lock);
  while (m->c.gauges_gen == gen && !m->stop_waiting &&
         pthread_cond_timedwait(&m->fresh, &m->lock, &until) != ETIMEDOUT)
    ;
  *c = m->c;
  pthread_mutex_unlock(&m->lock);
  struct text t = {.cap = 16384};
  t.buf = malloc(t.cap);
  t.oom = t.buf == NULL;
  put_all(&t, m, c);
  free(c);
  if (t.oom) {
    free(t.buf);
    return SP_ENOMEM;
  }
  *out = t.buf;
  *len = t.len;
  return 0;
}
