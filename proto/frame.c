/*
 * frame.c - length-prefixed frames with file descriptors over a stream
 * socket.  See frame.h for the invariants this file keeps.
 */
#include <errno.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "shardport.h"
#include "proto/frame.h"

/* Control buffer big enough for SP_FDS_MAX descriptors, aligned for cmsghdr. */
union fd_control {
  char buf[CMSG_SPACE(sizeof(int) * SP_FDS_MAX)];
  struct cmsghdr align;
};

static void close_fds(int *fds, size_t *nfds) {
  for (size_t i = 0; i < *nfds; i++)
    if (fds[i] >= 0)
      close(fds[i]);
  *nfds = 0;
}

size_t sp_frame_close_fds(struct sp_frame *frame) {
  size_t closed = 0;
  for (size_t i = 0; i < frame->nfds; i++)
    if (frame->fds[i] >= 0) {
      close(frame->fds[i]);
      frame->fds[i] = -1;
      closed++;
    }
  frame->nfds = 0;
  return closed;
}

void sp_frame_release(struct sp_frame *frame) {
  sp_frame_close_fds(frame);
  free(frame->data);
  frame->data = NULL;
  frame->len = 0;
}

void sp_frame_rx_init(struct sp_frame_rx *rx, const struct sp_limits *limits) {
  memset(rx, 0, sizeof *rx);
  rx->limits = *limits;
  if (rx->limits.max_fds > SP_FDS_MAX)
    rx->limits.max_fds = SP_FDS_MAX;
}

void sp_frame_rx_reset(struct sp_frame_rx *rx) {
  close_fds(rx->fds, &rx->nfds);
  free(rx->buf);
  rx->buf = NULL;
  rx->cap = 0;
  rx->header_have = 0;
  rx->need = 0;
  rx->have = 0;
}

/* Keeps the descriptors of one control message, up to the limit; the rest are
 * closed at once.  Returns false when any had to be closed. */
static bool take_fds(struct sp_frame_rx *rx, struct msghdr *msg) {
  bool fit = (msg->msg_flags & MSG_CTRUNC) == 0;
  for (struct cmsghdr *c = CMSG_FIRSTHDR(msg); c; c = CMSG_NXTHDR(msg, c)) {
    if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS)
      continue;
    size_t n = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
    const unsigned char *data = CMSG_DATA(c);
    for (size_t i = 0; i < n; i++) {
      int fd;
      memcpy(&fd, data + i * sizeof fd, sizeof fd);
      if (rx->nfds < rx->limits.max_fds) {
        rx->fds[rx->nfds++] = fd;
      } else {
        close(fd);
        fit = false;
      }
    }
  }
  return fit;
}

static uint32_t read_be32(const uint8_t *p) {
  return (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 |
         (uint32_t)p[3];
}

/* The first allocation for a payload; it doubles as bytes arrive. */
#define FRAME_FIRST_ALLOC 65536u

/* Called once the header is complete: checks the length before allocating. */
static int start_payload(struct sp_frame_rx *rx) {
  uint32_t len = read_be32(rx->header);
  if (len > rx->limits.max_frame)
    return SP_EFRAMETOOBIG;
  /* One spare byte so that an empty payload still owns a buffer. */
  rx->cap = (len < FRAME_FIRST_ALLOC ? len : FRAME_FIRST_ALLOC) + 1;
  rx->buf = malloc(rx->cap);
  if (!rx->buf)
    return SP_ENOMEM;
  rx->need = len;
  rx->have = 0;
  return 0;
}

/* Makes room for more of the payload once the buffer is full. */
static int grow_payload(struct sp_frame_rx *rx) {
  if (rx->have < rx->cap)
    return 0;
  size_t cap = rx->cap * 2 > rx->need + 1 ? rx->need + 1 : rx->cap * 2;
  uint8_t *p = realloc(rx->buf, cap);
  if (!p)
    return SP_ENOMEM;
  rx->buf = p;
  rx->cap = cap;
  return 0;
}

static bool frame_complete(const struct sp_frame_rx *rx) {
  return rx->header_have == SP_FRAME_HEADER && rx->buf && rx->have == rx->need;
}

int sp_frame_rx_read(struct sp_frame_rx *rx, int sock, struct sp_frame *out) {
  for (size_t taken = 0;;) {
    if (rx->header_have == SP_FRAME_HEADER && !rx->buf) {
      int rc = start_payload(rx);
      if (rc < 0)
        return rc;
    }
    if (frame_complete(rx)) {
      out->data = rx->buf;
      out->len = rx->need;
      memcpy(out->fds, rx->fds, rx->nfds * sizeof(int));
      out->nfds = rx->nfds;
      rx->buf = NULL;
      rx->nfds = 0;
      sp_frame_rx_reset(rx);
      return 1;
    }
    if (rx->max_read != 0 && taken >= rx->max_read)
      return 0;

    struct iovec iov;
    if (rx->header_have < SP_FRAME_HEADER) {
      iov.iov_base = rx->header + rx->header_have;
      iov.iov_len = SP_FRAME_HEADER - rx->header_have;
    } else {
      int rc = grow_payload(rx);
      if (rc < 0)
        return rc;
      size_t room = rx->cap - rx->have;
      size_t left = rx->need - rx->have;
      iov.iov_base = rx->buf + rx->have;
      iov.iov_len = left < room ? left : room;
    }
    union fd_control control;
    struct msghdr msg = {.msg_iov = &iov,
                         .msg_iovlen = 1,
                         .msg_control = control.buf,
                         .msg_controllen = sizeof control.buf};
    ssize_t n = recvmsg(sock, &msg, MSG_CMSG_CLOEXEC);
    bool between_frames = rx->header_have == 0 && rx->nfds == 0;
    if (n < 0 && (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK))
      return 0;
    /* A peer that died with bytes of ours unread resets the connection
     * instead of closing it: between frames that is the same end. */
    if (n < 0)
      return errno == ECONNRESET && between_frames ? SP_ECLOSED : SP_EIO;
    if (!take_fds(rx, &msg))
      return SP_ETOOMANYFDS;
    if (n == 0)
      return between_frames ? SP_ECLOSED : SP_EIO;
    taken += (size_t)n;
    if (rx->header_have < SP_FRAME_HEADER)
      rx->header_have += (size_t)n;
    else
      rx->have += (size_t)n;
  }
}

size_t sp_frame_tx_size(const struct sp_frame_tx *tx) {
  return tx->len + tx->shared_len;
}

int sp_frame_tx_write(struct sp_frame_tx *tx, int sock) {
  size_t size = sp_frame_tx_size(tx);
  while (tx->off < size) {
    struct iovec iov[2];
    size_t n = 0;
    if (tx->off < tx->len)
      iov[n++] = (struct iovec){.iov_base = tx->buf + tx->off,
                                .iov_len = tx->len - tx->off};
    size_t soff = tx->off > tx->len ? tx->off - tx->len : 0;
    if (tx->shared_len > soff)
      iov[n++] = (struct iovec){.iov_base = (void *)(tx->shared + soff),
                                .iov_len = tx->shared_len - soff};
    /* Zeroed: the kernel reads the padding around the descriptors too. */
    union fd_control control = {0};
    struct msghdr msg = {.msg_iov = iov, .msg_iovlen = n};
    if (tx->off == 0 && tx->nfds > 0) {
      msg.msg_control = control.buf;
      msg.msg_controllen = CMSG_SPACE(sizeof(int) * tx->nfds);
      struct cmsghdr *c = CMSG_FIRSTHDR(&msg);
      c->cmsg_level = SOL_SOCKET;
      c->cmsg_type = SCM_RIGHTS;
      c->cmsg_len = CMSG_LEN(sizeof(int) * tx->nfds);
      memcpy(CMSG_DATA(c), tx->fds, sizeof(int) * tx->nfds);
    }
    ssize_t w = sendmsg(sock, &msg, MSG_NOSIGNAL);
    if (w < 0) {
      if (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK)
        return 1;
      return errno == EPIPE || errno == ECONNRESET ? SP_ECLOSED : SP_EIO;
    }
    tx->off += (size_t)w;
  }
  return 0;
}

void sp_frame_tx_free(struct sp_frame_tx *tx) {
  if (!tx)
    return;
  close_fds(tx->fds, &tx->nfds);
  free(tx->buf);
  if (tx->release != NULL)
    tx->release(tx->release_arg);
  free(tx);
}

int sp_frame_send(int sock, const uint8_t *buf, size_t len, const int *fds,
                  size_t nfds) {
  if (nfds > SP_FDS_MAX)
    return SP_ETOOMANYFDS;
  struct sp_frame_tx tx = {.buf = (uint8_t *)buf, .len = len, .nfds = nfds};
  if (nfds)
    memcpy(tx.fds, fds, nfds * sizeof(int));
  int rc;
  /* On a blocking socket only a signal makes the write return early. */
  while ((rc = sp_frame_tx_write(&tx, sock)) == 1)
    ;
  return rc;
}
