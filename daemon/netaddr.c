/*
 * netaddr.c - the numeric addresses daemons listen on and dial
 * ("a.b.c.d:port", "[v6]:port"), parsed and written in one place for the
 * configuration, tickets, the metrics endpoint and the links between
 * daemons; see netaddr.h.
 */
#include <arpa/inet.h>
#include <netinet/in.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>

#include "daemon/config.h"
#include "daemon/netaddr.h"
#include "shardport.h"

int netaddr_parse(const char *s, size_t len, bool port_optional,
                  struct sockaddr_storage *out, socklen_t *outlen) {
  char host[NODE_ADDR_MAX];
  const char *port = NULL;
  size_t hlen;
  if (len == 0 || len >= NODE_ADDR_MAX || memchr(s, '\0', len) != NULL)
    return SP_EINVAL;
  if (s[0] == '[') {
    const char *end = memchr(s, ']', len);
    if (end == NULL)
      return SP_EINVAL;
    hlen = (size_t)(end - s - 1);
    memcpy(host, s + 1, hlen);
    size_t rest = len - (size_t)(end - s) - 1;
    if (rest > 0) {
      if (end[1] != ':')
        return SP_EINVAL;
      port = end + 2;
    }
  } else {
    const char *colon = memchr(s, ':', len);
    hlen = colon != NULL ? (size_t)(colon - s) : len;
    memcpy(host, s, hlen);
    if (colon != NULL)
      port = colon + 1;
  }
  host[hlen] = '\0';
  unsigned long p = 0;
  if (port != NULL) {
    size_t plen = len - (size_t)(port - s);
    if (plen == 0 || plen > 5)
      return SP_EINVAL;
    for (size_t i = 0; i < plen; i++) {
      if (port[i] < '0' || port[i] > '9')
        return SP_EINVAL;
      p = p * 10 + (unsigned long)(port[i] - '0');
    }
    if (p > 65535)
      return SP_EINVAL;
  } else if (!port_optional) {
    return SP_EINVAL;
  }
  memset(out, 0, sizeof *out);
  struct sockaddr_in *v4 = (struct sockaddr_in *)out;
  struct sockaddr_in6 *v6 = (struct sockaddr_in6 *)out;
  if (s[0] != '[' && inet_pton(AF_INET, host, &v4->sin_addr) == 1) {
    v4->sin_family = AF_INET;
    v4->sin_port = htons((uint16_t)p);
    *outlen = sizeof *v4;
    return 0;
  }
  if (s[0] == '[' && inet_pton(AF_INET6, host, &v6->sin6_addr) == 1) {
    v6->sin6_family = AF_INET6;
    v6->sin6_port = htons((uint16_t)p);
    *outlen = sizeof *v6;
    return 0;
  }
  return SP_EINVAL;
}

void netaddr_format(const struct sockaddr *sa, char *buf, size_t len) {
  char host[INET6_ADDRSTRLEN] = "?";
  unsigned port = 0;
  if (sa->sa_family == AF_INET) {
    const struct sockaddr_in *v4 = (const struct sockaddr_in *)sa;
    inet_ntop(AF_INET, &v4->sin_addr, host, sizeof host);
    port = ntohs(v4->sin_port);
    snprintf(buf, len, "%s:%u", host, port);
  } else if (sa->sa_family == AF_INET6) {
    const struct sockaddr_in6 *v6 = (const struct sockaddr_in6 *)sa;
    inet_ntop(AF_INET6, &v6->sin6_addr, host, sizeof host);
    port = ntohs(v6->sin6_port);
    snprintf(buf, len, "[%s]:%u", host, port);
  } else {
    snprintf(buf, len, "?");
  }
}

bool netaddr_wildcard(const struct sockaddr_storage *sa) {
  if (sa->ss_family == AF_INET)
    return ((const struct sockaddr_in *)sa)->sin_addr.s_addr ==
           htonl(INADDR_ANY);
  const struct in6_addr *a = &((const struct sockaddr_in6 *)sa)->sin6_addr;
  return IN6_IS_ADDR_UNSPECIFIED(a);
}
