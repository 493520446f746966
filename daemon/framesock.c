/*
 * framesock.c - a poll-driven framed socket; see framesock.h.
 *
 * uv_poll is level-triggered: asking for writable with nothing queued
 * would wake the loop at once, again and again, so the events follow the
 * queue, and an owner that stops reading (a frame on a worker, a socket
 * draining) stops asking for readable.
 */
#include <stdlib.h>

#include "daemon/framesock.h"

int framesock_init(struct framesock *fs, uv_loop_t *loop, int sock,
                   const struct sp_limits *limits, void *owner) {
  *fs = (struct framesock){.sock = sock};
  int rc = uv_poll_init(loop, &fs->poll, sock);
  if (rc != 0)
    return rc;
  fs->poll.data = owner;
  sp__frame_rx_init(&fs->rx, limits);
  return 0;
}

int framesock_want(struct framesock *fs, uv_poll_cb cb, bool read,
                   bool connecting) {
  int want = connecting ? UV_WRITABLE
                        : (read ? UV_READABLE : 0) |
                              (fs->out_head != NULL ? UV_WRITABLE : 0);
  if (want == fs->events)
    return 0;
  fs->events = want;
  return want != 0 ? uv_poll_start(&fs->poll, want, cb)
                   : uv_poll_stop(&fs->poll);
}

void framesock_queue(struct framesock *fs, struct sp_frame_tx *tx) {
  tx->next = NULL;
  if (fs->out_tail != NULL)
    fs->out_tail->next = tx;
  else
    fs->out_head = tx;
  fs->out_tail = tx;
  fs->out_bytes += sp__frame_tx_size(tx);
}

int framesock_flush(struct framesock *fs) {
  while (fs->out_head != NULL) {
    struct sp_frame_tx *tx = fs->out_head;
    int rc = sp__frame_tx_write(tx, fs->sock);
    if (rc == 1)
      return 0;
    if (rc < 0)
      return rc;
    fs->out_head = tx->next;
    if (fs->out_head == NULL)
      fs->out_tail = NULL;
    fs->out_bytes -= sp__frame_tx_size(tx);
    sp__frame_tx_free(tx);
  }
  return 0;
}

int framesock_read(struct framesock *fs, struct sp_frame *out) {
  return sp__frame_rx_read(&fs->rx, fs->sock, out);
}

void framesock_close(struct framesock *fs, uv_close_cb cb) {
  uv_close((uv_handle_t *)&fs->poll, cb);
}

void framesock_release(struct framesock *fs) {
  sp__frame_rx_reset(&fs->rx);
  while (fs->out_head != NULL) {
    struct sp_frame_tx *tx = fs->out_head;
    fs->out_head = tx->next;
    sp__frame_tx_free(tx);
  }
  fs->out_tail = NULL;
  fs->out_bytes = 0;
}
