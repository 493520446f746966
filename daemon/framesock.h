/*
 * framesock.h - a stream socket that carries frames (proto/frame.h),
 * driven by a uv_poll_t on the loop: the one framed-socket path of the
 * daemon, which a client connection (conn.c) and a link to another daemon
 * (daemon/mesh/nodelink.c) both run on.  It knows sockets, frames and
 * descriptors; its owner knows what the frames mean, when to read, and
 * when the socket ends.  Loop thread only.
 */
#ifndef SP_DAEMON_FRAMESOCK_H
#define SP_DAEMON_FRAMESOCK_H

#include <stdbool.h>
#include <stdint.h>
#include <uv.h>

#include "proto/frame.h"

struct framesock {
  int sock;
  uv_poll_t poll; /* poll.data is the owner's */
  int events;     /* the events asked for now */
  struct sp_frame_rx rx;
  struct sp_frame_tx *out_head, *out_tail;
  uint64_t out_bytes; /* of the frames queued, sp__frame_tx_size each */
};

/* Takes a non-blocking sock, which frames of at most limits arrive on;
 * poll.data is owner, for the callback framesock_want names.  0, or a
 * libuv error (nothing to close; the socket is still the caller's). */
int framesock_init(struct framesock *fs, uv_loop_t *loop, int sock,
                   const struct sp_limits *limits, void *owner);
/* Asks for exactly the events the owner can use, to be told through cb:
 * writable alone while a connect is under way, else readable when read
 * and writable while frames are queued.  0, or a libuv error (the owner
 * ends the socket). */
int framesock_want(struct framesock *fs, uv_poll_cb cb, bool read,
                   bool connecting);
/* Queues tx, which fs then owns, after the frames queued before it. */
void framesock_queue(struct framesock *fs, struct sp_frame_tx *tx);
/* Writes queued frames until the socket is full or none are left: 0, or
 * SP_EIO / SP_ECLOSED (the owner ends the socket). */
int framesock_flush(struct framesock *fs);
/* The next frame, as sp__frame_rx_read returns it. */
int framesock_read(struct framesock *fs, struct sp_frame *out);
/* Stops polling: cb runs once libuv let go of the socket, which can then
 * be closed without libuv ever seeing a reused descriptor. */
void framesock_close(struct framesock *fs, uv_close_cb cb);
/* After the close: frees the partly read frame and the frames queued
 * (their descriptors closed).  The socket is the owner's, to close or
 * hand over. */
void framesock_release(struct framesock *fs);

#endif /* SP_DAEMON_FRAMESOCK_H */
