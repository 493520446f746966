/*
 * peerhost.c - which host a link to the peer port comes from, and which
 * link goes when links in their handshake are at peer_handshakes; see
 * peerhost.h and docs/operations.md, "Limits on peers and ranks".
 *
 * A host is what one machine cannot change by cycling addresses: an IPv4
 * address, or the /64 prefix of an IPv6 one (a host is given a /64 and
 * picks any address in it, privacy addresses included).  An IPv4-mapped
 * IPv6 address (::ffff:a.b.c.d, what a dual-stack listener sees from an
 * IPv4 peer) is that IPv4 address, so one host counts once whichever
 * family reached the listener.
 */
#include <stdlib.h>
#include <string.h>

#include "daemon/mesh/peerhost.h"

void peerhost_of(const struct sockaddr_storage *sa, struct peer_host *out) {
  static const uint8_t v4_mapped[12] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff,
                                        0xff};
  memset(out, 0, sizeof *out);
  if (sa->ss_family == AF_INET) {
    out->family = AF_INET;
    memcpy(out->prefix, &((const struct sockaddr_in *)sa)->sin_addr, 4);
    return;
  }
  if (sa->ss_family != AF_INET6)
    return;
  const uint8_t *a = ((const struct sockaddr_in6 *)sa)->sin6_addr.s6_addr;
  if (memcmp(a, v4_mapped, sizeof v4_mapped) == 0) {
    out->family = AF_INET;
    memcpy(out->prefix, a + 12, 4);
    return;
  }
  out->family = AF_INET6;
  memcpy(out->prefix, a, PEERHOST_PREFIX_BYTES);
}

int peerhost_cmp(const struct peer_host *a, const struct peer_host *b) {
  if (a->family != b->family)
    return a->family < b->family ? -1 : 1;
  return memcmp(a->prefix, b->prefix, PEERHOST_PREFIX_BYTES);
}

static int entry_cmp(const void *a, const void *b) {
  const struct peerhost_entry *x = a, *y = b;
  int c = peerhost_cmp(&x->host, &y->host);
  if (c != 0)
    return c;
  return x->id < y->id ? -1 : x->id > y->id;
}

/* Sorted by host, then age, each host's links are a run whose first is
 * its oldest: one pass finds the longest run, ties going to the run whose
 * oldest is oldest.  n log n, where comparing every link with every other
 * would stall the loop at tens of thousands of links. */
size_t peerhost_victim(struct peerhost_entry *e, size_t n) {
  qsort(e, n, sizeof *e, entry_cmp);
  size_t victim = 0, most = 0;
  for (size_t first = 0; first < n;) {
    size_t end = first + 1;
    while (end < n && peerhost_cmp(&e[end].host, &e[first].host) == 0)
      end++;
    if (end - first > most ||
        (end - first == most && e[first].id < e[victim].id)) {
      most = end - first;
      victim = first;
    }
    first = end;
  }
  return victim;
}
