/*
 * peer.c - who is on the other end of a connection.
 *
 * SO_PEERCRED gives the uid, primary gid and pid the peer had when it
 * connected; SO_PEERGROUPS adds its supplementary groups, so a user who is
 * in the shardport group only as a supplementary group is still recognised
 * without an NSS lookup on the event loop.
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

#include "daemon/config.h"
#include "daemon/peer.h"
#include "shardport.h"

/* Enough for almost every user; the kernel tells the size when a peer has
 * more (directory-service users may), and the groups are read again. */
#define PEER_USUAL_GROUPS 256

static bool in_groups(int sock, gid_t gid) {
  gid_t usual[PEER_USUAL_GROUPS];
  gid_t *groups = usual;
  socklen_t len = sizeof(usual);
  int rc = getsockopt(sock, SOL_SOCKET, SO_PEERGROUPS, groups, &len);
  if (rc != 0 && errno == ERANGE) {
    groups = malloc(len);
    if (!groups)
      return false;
    rc = getsockopt(sock, SOL_SOCKET, SO_PEERGROUPS, groups, &len);
  }
  bool found = false;
  for (size_t i = 0; rc == 0 && i < len / sizeof(gid_t) && !found; i++)
    found = groups[i] == gid;
  if (groups != usual)
    free(groups);
  return found;
}

int peer_check(const struct config *cfg, int sock, struct peer *out) {
  struct ucred cred;
  socklen_t len = sizeof(cred);
  if (getsockopt(sock, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0 ||
      len != sizeof(cred))
    return SP_EIO;
  out->pid = cred.pid;
  out->uid = cred.uid;
  out->gid = cred.gid;
  for (size_t i = 0; i < cfg->nallowed_uids; i++)
    if (cfg->allowed_uids[i] == cred.uid)
      return 0;
  if (cfg->allowed_gid_set &&
      (cred.gid == cfg->allowed_gid || in_groups(sock, cfg->allowed_gid)))
    return 0;
  return SP_EPERM;
}
