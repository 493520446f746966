/*
 * stream.h - moving one round's bytes over stream sockets to and from every
 * peer at once.
 *
 * Each peer has a list of regions to send and a list to receive into, in the
 * order both sides derived from the plan.  All peers are served together
 * from one thread with non-blocking sockets and poll(), so that two daemons
 * sending large buckets to each other never deadlock on full socket buffers.
 * Sends gather straight from the registered storages and receives scatter
 * straight into the owners' tensors (writev/readv): there is no packing copy.
 */
#ifndef SP_XFER_STREAM_H
#define SP_XFER_STREAM_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/uio.h>

#include "daemon/xfer/layer.h"

/* A list of regions and how far it has been moved.  The last optional
 * regions are moved only while the exchange lasts for the others (the next
 * round's, moved ahead): the exchange ends without them. */
struct xfer_iovs {
  struct iovec *iov;
  size_t n;
  size_t optional;
  size_t next; /* first region not yet fully moved */
  size_t done; /* bytes of iov[next] already moved */
};

struct xfer_peer {
  int sock; /* non-blocking */
  struct xfer_iovs send;
  struct xfer_iovs recv;
  uint64_t sent;
  uint64_t received;
};

struct xfer_watch {
  /* Set by another thread to stop the exchange (checked at least every
   * XFER_POLL_MS). */
  const atomic_bool *cancel;
  /* Give up when no byte moved in either direction for this long: a slow
   * peer keeps the exchange alive, a silent one ends it. */
  uint32_t idle_timeout_ms;
  /* Shared by exchanges that run side by side on several threads (the
   * streams of a node pair, remote.c): the first that fails sets it, and
   * the others stop as if cancelled.  May be NULL. */
  atomic_bool *halt;
  /* Called after every successful read or write with the peer's index,
   * its direction and the bytes it moved. */
  void (*progress)(void *arg, size_t peer, bool sending, uint64_t bytes);
  void *arg;
};

#define XFER_POLL_MS 100

/* Marks the first bytes of the list as moved (they were, ahead of it). */
void xfer_iovs_skip(struct xfer_iovs *v, uint64_t bytes);

/*
 * Moves every region of every peer, and of the optional ones what the
 * sockets take meanwhile.  Returns 0 when all are moved; 1 when
 * cancelled or halted by a sibling; SP_ETIMEOUT after idle_timeout_ms without progress; SP_ECLOSED
 * or SP_EIO when a peer's connection ends or fails, with *failed set to that
 * peer's index (for SP_ETIMEOUT, to a peer that still had bytes to move);
 * SP_EBADFD when a region to send cannot be read (EFAULT), with *failed set
 * to the peer whose send.next is that region.  Any result but 0 and 1 also
 * sets watch->halt.
 */
int xfer_exchange(struct xfer_peer *peers, size_t npeers,
                  const struct xfer_watch *watch, size_t *failed);

#endif /* SP_XFER_STREAM_H */
