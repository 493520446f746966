/*
 * netaddr.h - the numeric addresses daemons listen on and dial, parsed and
 * written in one place (netaddr.c).
 */
#ifndef SP_DAEMON_NETADDR_H
#define SP_DAEMON_NETADDR_H

#include <stdbool.h>
#include <stddef.h>
#include <sys/socket.h>

#include "daemon/layer.h"

/* "a.b.c.d:port" or "[v6]:port", numeric only (port_optional: "addr"
 * alone means port 0): 0 or SP_EINVAL. */
int netaddr_parse(const char *s, size_t len, bool port_optional,
                  struct sockaddr_storage *out, socklen_t *outlen);
void netaddr_format(const struct sockaddr *sa, char *buf, size_t len);
bool netaddr_wildcard(const struct sockaddr_storage *sa);

#endif /* SP_DAEMON_NETADDR_H */
