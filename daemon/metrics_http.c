/*
 * metrics_http.c - GET /metrics over HTTP (config metrics_listen), served
 * by libmicrohttpd from its own thread, never the event loop.
 *
 * libmicrohttpd parses the requests and answers the malformed ones (400,
 * 413, 431) itself; this file answers the well-formed ones: GET or HEAD of
 * /metrics with the exposition (metrics.c), another path 404, another
 * method 405.  At most metrics_connections are open at once (more wait in
 * the listen backlog, unaccepted, until one closes) and a connection idle for
 * METRICS_HTTP_IDLE_S is closed, so scrapers cannot hold the thread.
 */
#include <arpa/inet.h>
#include <microhttpd.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "daemon/metrics.h"
#include "daemon/netaddr.h"

/* How long a scrape waits for the loop's fresh gauges. */
#define METRICS_HTTP_GAUGE_WAIT_MS 250
#define METRICS_HTTP_IDLE_S 10
/* Bytes of one connection's request (line and headers) at most. */
#define METRICS_HTTP_CONN_MEMORY (32u * 1024u)

struct metrics_http {
  struct MHD_Daemon *daemon;
  struct metrics *metrics;
  /* What libmicrohttpd said while starting: why it could not (the address
   * in use, not this host's). */
  char why[256];
  _Atomic bool started;
};

/* libmicrohttpd's messages.  Once it serves, they are about clients (a
 * connection reset, the limit reached) and are not logged, so that no
 * client can flood the log. */
static void on_mhd_log(void *cls, const char *fmt, va_list ap)
    __attribute__((format(printf, 2, 0)));

static void on_mhd_log(void *cls, const char *fmt, va_list ap) {
  struct metrics_http *h = cls;
  if (atomic_load_explicit(&h->started, memory_order_relaxed))
    return;
  vsnprintf(h->why, sizeof h->why, fmt, ap);
  h->why[strcspn(h->why, "\n")] = '\0';
}

static enum MHD_Result reply(struct MHD_Connection *conn, unsigned status,
                             const char *text, const char *allow) {
  struct MHD_Response *r = MHD_create_response_from_buffer(
      strlen(text), (void *)text, MHD_RESPMEM_PERSISTENT);
  if (r == NULL)
    return MHD_NO;
  MHD_add_response_header(r, MHD_HTTP_HEADER_CONTENT_TYPE,
                          "text/plain; charset=utf-8");
  if (allow != NULL)
    MHD_add_response_header(r, MHD_HTTP_HEADER_ALLOW, allow);
  enum MHD_Result rc = MHD_queue_response(conn, status, r);
  MHD_destroy_response(r);
  return rc;
}

static enum MHD_Result on_request(void *cls, struct MHD_Connection *conn,
                                  const char *url, const char *method,
                                  const char *version, const char *upload,
                                  size_t *upload_size, void **req_cls) {
  struct metrics *m = cls;
  (void)version;
  (void)upload;
  (void)req_cls;
  bool get = strcmp(method, MHD_HTTP_METHOD_GET) == 0;
  bool head = strcmp(method, MHD_HTTP_METHOD_HEAD) == 0;
  /* A body is never read: the answer is queued at the first call and the
   * connection closes after it. */
  *upload_size = 0;
  if (!get && !head)
    return reply(conn, MHD_HTTP_METHOD_NOT_ALLOWED,
                 "only GET and HEAD are served\n", "GET, HEAD");
  if (strcmp(url, "/metrics") != 0)
    return reply(conn, MHD_HTTP_NOT_FOUND, "the metrics are at /metrics\n",
                 NULL);
  char *text;
  size_t len;
  if (metrics_render(m, METRICS_HTTP_GAUGE_WAIT_MS, &text, &len) != 0)
    return reply(conn, MHD_HTTP_INTERNAL_SERVER_ERROR, "out of memory\n",
                 NULL);
  struct MHD_Response *r =
      MHD_create_response_from_buffer(len, text, MHD_RESPMEM_MUST_FREE);
  if (r == NULL) {
    free(text);
    return MHD_NO;
  }
  MHD_add_response_header(r, MHD_HTTP_HEADER_CONTENT_TYPE,
                          "text/plain; version=0.0.4; charset=utf-8");
  enum MHD_Result rc = MHD_queue_response(conn, MHD_HTTP_OK, r);
  MHD_destroy_response(r);
  return rc;
}

int metrics_http_start(struct metrics *m, const struct sockaddr *addr,
                       uint32_t max_connections, struct metrics_http **out) {
  struct metrics_http *h = calloc(1, sizeof *h);
  if (h == NULL) {
    log_msg(LOG_LEVEL_ERROR, "metrics: out of memory");
    return -1;
  }
  unsigned flags =
      MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_AUTO | MHD_USE_ERROR_LOG;
  if (addr->sa_family == AF_INET6)
    flags |= MHD_USE_IPv6;
  /* The thread inherits this mask: the loop's signals (SIGTERM, SIGHUP)
   * are taken by the loop, never by the HTTP thread. */
  sigset_t all, old;
  sigfillset(&all);
  pthread_sigmask(SIG_BLOCK, &all, &old);
  /* The port is addr's: libmicrohttpd binds addr and names this port in
   * its messages. */
  uint16_t port = ntohs(addr->sa_family == AF_INET6
                            ? ((const struct sockaddr_in6 *)addr)->sin6_port
                            : ((const struct sockaddr_in *)addr)->sin_port);
  h->daemon = MHD_start_daemon(
      flags, port, NULL, NULL, on_request, m, MHD_OPTION_SOCK_ADDR, addr,
      MHD_OPTION_CONNECTION_LIMIT, (unsigned)max_connections,
      MHD_OPTION_CONNECTION_TIMEOUT, (unsigned)METRICS_HTTP_IDLE_S,
      MHD_OPTION_CONNECTION_MEMORY_LIMIT, (size_t)METRICS_HTTP_CONN_MEMORY,
      MHD_OPTION_EXTERNAL_LOGGER, on_mhd_log, h, MHD_OPTION_END);
  atomic_store_explicit(&h->started, true, memory_order_relaxed);
  pthread_sigmask(SIG_SETMASK, &old, NULL);
  if (h->daemon == NULL) {
    char where[NODE_ADDR_MAX];
    netaddr_format(addr, where, sizeof where);
    log_msg(LOG_LEVEL_ERROR, "metrics: cannot serve HTTP on %s: %s", where,
            h->why[0] != '\0' ? h->why : "libmicrohttpd did not say why");
    free(h);
    return -1;
  }
  const union MHD_DaemonInfo *info =
      MHD_get_daemon_info(h->daemon, MHD_DAEMON_INFO_BIND_PORT);
  struct sockaddr_storage bound;
  memcpy(&bound, addr,
         addr->sa_family == AF_INET6 ? sizeof(struct sockaddr_in6)
                                     : sizeof(struct sockaddr_in));
  if (info != NULL) {
    if (addr->sa_family == AF_INET6)
      ((struct sockaddr_in6 *)&bound)->sin6_port = htons(info->port);
    else
      ((struct sockaddr_in *)&bound)->sin_port = htons(info->port);
  }
  char where[NODE_ADDR_MAX];
  netaddr_format((const struct sockaddr *)&bound, where, sizeof where);
  log_msg(LOG_LEVEL_INFO,
          "metrics: serving http://%s/metrics (at most %u connections)",
          where, (unsigned)max_connections);
  h->metrics = m;
  *out = h;
  return 0;
}

void metrics_http_stop(struct metrics_http *h) {
  if (h == NULL)
    return;
  /* The loop calls this and answers no scrape until it returns: a scrape
   * waiting for it ends now rather than after its wait. */
  metrics_stop_waiting(h->metrics);
  MHD_stop_daemon(h->daemon);
  free(h);
}
