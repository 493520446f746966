/*
 * peer.h - a client's credentials, checked against the allowed users (peer.c).
 */
#ifndef SP_DAEMON_PEER_H
#define SP_DAEMON_PEER_H

#include <sys/types.h>

#include "daemon/layer.h"

struct config;

struct peer {
  pid_t pid;
  uid_t uid;
  gid_t gid;
};

/* Reads the peer's credentials and checks them against the allowed uids and
 * gid (the peer's primary and supplementary groups).  Returns 0 when allowed,
 * SP_EPERM when not, SP_EIO when the credentials cannot be read. */
int peer_check(const struct config *cfg, int sock, struct peer *out);

#endif /* SP_DAEMON_PEER_H */
