/*
 * peerhost.h - which host a peer address belongs to, and which link in its
 * handshake to drop at peer_handshakes (peerhost.c).  Internal to
 * daemon/mesh/.
 */
#ifndef SP_DAEMON_MESH_PEERHOST_H
#define SP_DAEMON_MESH_PEERHOST_H

#include <stddef.h>
#include <stdint.h>
#include <netinet/in.h>
#include <sys/socket.h>

/* The host a peer address belongs to: an IPv4 address (IPv4-mapped IPv6
 * ones included), or an IPv6 /64 prefix; zero for any other family. */
#define PEERHOST_PREFIX_BYTES 8
struct peer_host {
  sa_family_t family;
  uint8_t prefix[PEERHOST_PREFIX_BYTES]; /* IPv4: 4 bytes, then zeros */
};

void peerhost_of(const struct sockaddr_storage *sa, struct peer_host *out);
/* A total order: 0 when both are one host. */
int peerhost_cmp(const struct peer_host *a, const struct peer_host *b);

/* A link in its handshake, as the choice of one to drop sees it. */
struct peerhost_entry {
  struct peer_host host;
  uint64_t id; /* smaller is older */
  void *link;
};

/* Which of n > 0 links to drop at peer_handshakes: the oldest of the host
 * that holds the most (ties: the host whose oldest is oldest).  Sorts e
 * and returns the victim's index in it. */
size_t peerhost_victim(struct peerhost_entry *e, size_t n);


#endif /* SP_DAEMON_MESH_PEERHOST_H */
