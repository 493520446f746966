/*
 * stream.c - the all-peers scatter/gather exchange; see stream.h.
 */
#include <errno.h>
#include <limits.h>
#include <poll.h>
#include <stdbool.h>
#include <stdlib.h>
#include <sys/socket.h>

#include "daemon/xfer/stream.h"
#include "proto/monotonic.h"
#include "shardport.h"

static bool iovs_finished(const struct xfer_iovs *v) { return v->next >= v->n; }

/* Regions left that the exchange must move. */
static bool iovs_needed(const struct xfer_iovs *v) {
  return v->next < v->n - v->optional;
}

/* Skips empty regions so that a list of only empty ones counts as moved. */
static void iovs_skip_empty(struct xfer_iovs *v) {
  while (v->next < v->n && v->iov[v->next].iov_len == v->done) {
    v->next++;
    v->done = 0;
  }
}

/* The pending part of the list as at most IOV_MAX iovecs in scratch. */
static int iovs_pending(const struct xfer_iovs *v, struct iovec *scratch) {
  int n = 0;
  for (size_t i = v->next; i < v->n && n < IOV_MAX; i++, n++) {
    scratch[n] = v->iov[i];
    if (i == v->next) {
      scratch[n].iov_base = (char *)scratch[n].iov_base + v->done;
      scratch[n].iov_len -= v->done;
    }
  }
  return n;
}

static void iovs_advance(struct xfer_iovs *v, size_t bytes) {
  while (bytes > 0) {
    size_t left = v->iov[v->next].iov_len - v->done;
    size_t step = bytes < left ? bytes : left;
    v->done += step;
    bytes -= step;
    iovs_skip_empty(v);
  }
}

void xfer_iovs_skip(struct xfer_iovs *v, uint64_t bytes) {
  iovs_skip_empty(v);
  iovs_advance(v, (size_t)bytes);
}

/* One non-blocking write or read: bytes moved, 0 when the socket is not
 * ready, or a negative code. */
static ssize_t move_some(int sock, struct xfer_iovs *v, bool sending) {
  static __thread struct iovec scratch[IOV_MAX];
  int n = iovs_pending(v, scratch);
  struct msghdr msg = {.msg_iov = scratch, .msg_iovlen = (size_t)n};
  for (;;) {
    ssize_t r = sending ? sendmsg(sock, &msg, MSG_NOSIGNAL | MSG_DONTWAIT)
                        : recvmsg(sock, &msg, MSG_DONTWAIT);
    if (r > 0) {
      iovs_advance(v, (size_t)r);
      return r;
    }
    if (r == 0)
      return SP_ECLOSED; /* only a read returns 0: the peer closed */
    if (errno == EINTR)
      continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK)
      return 0;
    /* EFAULT: a region could not be read (a trainer cut its registered
     * file short); that is the region's fault, not the peer's. */
    if (errno == EFAULT)
      return SP_EBADFD;
    return errno == EPIPE || errno == ECONNRESET ? SP_ECLOSED : SP_EIO;
  }
}

/* Moves what one direction of one peer can move now and accounts for it. */
static int step(struct xfer_peer *peers, struct xfer_peer *p, bool sending,
                const struct xfer_watch *watch, uint64_t *last_progress) {
  struct xfer_iovs *v = sending ? &p->send : &p->recv;
  if (iovs_finished(v))
    return 0;
  ssize_t r = move_some(p->sock, v, sending);
  if (r <= 0)
    return (int)r;
  *(sending ? &p->sent : &p->received) += (uint64_t)r;
  if (watch->progress)
    watch->progress(watch->arg, (size_t)(p - peers), sending, (uint64_t)r);
  *last_progress = monotonic_ms();
  return 0;
}

int xfer_exchange(struct xfer_peer *peers, size_t npeers,
                  const struct xfer_watch *watch, size_t *failed) {
  struct pollfd *pfd = calloc(npeers ? npeers : 1, sizeof *pfd);
  if (!pfd) {
    if (watch->halt != NULL)
      atomic_store(watch->halt, true);
    return SP_ENOMEM;
  }
  for (size_t i = 0; i < npeers; i++) {
    iovs_skip_empty(&peers[i].send);
    iovs_skip_empty(&peers[i].recv);
  }

  uint64_t last_progress = monotonic_ms();
  int rc = 0;
  for (;;) {
    size_t busy = 0;
    for (size_t i = 0; i < npeers; i++) {
      short events = 0;
      if (!iovs_finished(&peers[i].send))
        events |= POLLOUT;
      if (!iovs_finished(&peers[i].recv))
        events |= POLLIN;
      pfd[i] = (struct pollfd){.fd = events ? peers[i].sock : -1,
                               .events = events};
      if (iovs_needed(&peers[i].send) || iovs_needed(&peers[i].recv)) {
        busy++;
        *failed = i;
      }
    }
    if (busy == 0)
      break;
    if ((watch->cancel && atomic_load(watch->cancel)) ||
        (watch->halt && atomic_load(watch->halt))) {
      rc = 1;
      break;
    }
    uint64_t idle = monotonic_ms() - last_progress;
    if (idle >= watch->idle_timeout_ms) {
      rc = SP_ETIMEOUT;
      break;
    }
    uint64_t wait = watch->idle_timeout_ms - idle;
    int n = poll(pfd, npeers, (int)(wait < XFER_POLL_MS ? wait : XFER_POLL_MS));
    if (n < 0 && errno != EINTR) {
      rc = SP_EIO;
      break;
    }
    for (size_t i = 0; i < npeers && n > 0 && rc == 0; i++) {
      /* Read first: a peer that closed after sending its last bytes still
       * delivers them before the close is seen. */
      if (pfd[i].revents & (POLLIN | POLLHUP | POLLERR))
        rc = step(peers, &peers[i], false, watch, &last_progress);
      if (rc == 0 && pfd[i].revents & (POLLOUT | POLLHUP | POLLERR))
        rc = step(peers, &peers[i], true, watch, &last_progress);
      if (rc != 0)
        *failed = i;
    }
    if (rc != 0)
      break;
  }
  free(pfd);
  if (rc != 0 && rc != 1 && watch->halt != NULL)
    atomic_store(watch->halt, true);
  return rc;
}
