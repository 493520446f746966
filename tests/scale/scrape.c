/*
 * scrape.c - one GET of a daemon's /metrics; see scrape.h.
 */
#include "tests/scale/scrape.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

/* The exposition of one daemon is a few KiB (its peers' series are capped
 * at 64 addresses each way). */
#define SCRAPE_MAX_REPLY (1u << 20)

uint16_t scrape_free_port(void) {
  struct sockaddr_in sa = {.sin_family = AF_INET,
                           .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
  socklen_t len = sizeof sa;
  int s = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (s < 0)
    return 0;
  uint16_t port = 0;
  if (bind(s, (struct sockaddr *)&sa, sizeof sa) == 0 &&
      getsockname(s, (struct sockaddr *)&sa, &len) == 0)
    port = ntohs(sa.sin_port);
  close(s);
  return port;
}

/* The reply to one request, NUL-terminated, or NULL. */
static char *get(uint16_t port, int timeout_ms) {
  struct sockaddr_in sa = {.sin_family = AF_INET,
                           .sin_port = htons(port),
                           .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
  int s = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (s < 0)
    return NULL;
  static const char request[] =
      "GET /metrics HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n";
  char *buf = malloc(SCRAPE_MAX_REPLY + 1);
  size_t have = 0;
  if (buf == NULL || connect(s, (struct sockaddr *)&sa, sizeof sa) != 0 ||
      send(s, request, sizeof request - 1, MSG_NOSIGNAL) !=
          (ssize_t)(sizeof request - 1))
    goto fail;
  for (;;) {
    struct pollfd p = {.fd = s, .events = POLLIN};
    if (poll(&p, 1, timeout_ms) != 1)
      goto fail;
    ssize_t n = recv(s, buf + have, SCRAPE_MAX_REPLY - have, 0);
    if (n < 0)
      goto fail;
    if (n == 0)
      break;
    have += (size_t)n;
    if (have == SCRAPE_MAX_REPLY)
      goto fail;
  }
  close(s);
  buf[have] = '\0';
  return buf;
fail:
  close(s);
  free(buf);
  return NULL;
}

/* The value of the series named exactly name (no labels), or -1. */
static double series(const char *text, const char *name) {
  size_t n = strlen(name);
  for (const char *line = text; line != NULL && *line != '\0';) {
    if (strncmp(line, name, n) == 0 && line[n] == ' ')
      return strtod(line + n + 1, NULL);
    line = strchr(line, '\n');
    if (line != NULL)
      line++;
  }
  return -1;
}

int scrape_metrics(uint16_t port, int timeout_ms, struct scrape *out) {
  char *text = get(port, timeout_ms);
  if (text == NULL)
    return -1;
  double sent = series(text, "shardport_node_control_sent_bytes_total"),
         received =
             series(text, "shardport_node_control_received_bytes_total"),
         published =
             series(text, "shardport_exports_total{result=\"published\"}"),
         planning =
             series(text, "shardport_export_planning_duration_seconds_sum"),
         duration = series(text, "shardport_export_duration_seconds_sum");
  free(text);
  if (sent < 0 || received < 0 || published < 0 || planning < 0 ||
      duration < 0)
    return -1;
  *out = (struct scrape){.control_sent = (uint64_t)sent,
                         .control_received = (uint64_t)received,
                         .published = (uint64_t)published,
                         .planning_s = planning,
                         .duration_s = duration};
  return 0;
}
