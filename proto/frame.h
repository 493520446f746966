/*
 * frame.h - the framing layer: a 4-byte big-endian length N, then N bytes
 * of payload (one msgpack map), optionally with file descriptors attached
 * through SCM_RIGHTS.
 *
 * A sender attaches a frame's fds to the frame's first byte; a receiver never
 * reads past the end of the frame it is assembling, so every fd that arrives
 * while a frame is being read belongs to that frame.  This is the only code
 * that reads or writes a shardport socket.
 */
#ifndef SP_PROTO_FRAME_H
#define SP_PROTO_FRAME_H

#include <stddef.h>
#include <stdint.h>

#include "proto/limits.h"

#define SP_FRAME_HEADER 4

/* A received frame.  The frame owns data and every fd in fds that is not -1;
 * a consumer takes an fd by copying it out and storing -1 in its place. */
struct sp_frame {
  uint8_t *data;
  size_t len;
  int fds[SP_FDS_MAX];
  size_t nfds;
};

/* Frees the payload and closes every fd the frame still owns. */
void sp__frame_release(struct sp_frame *frame);

/* Closes every fd still owned by the frame: used by handlers of messages that
 * carry no fds, so that a stray fd never stays open in the daemon. */
size_t sp__frame_close_fds(struct sp_frame *frame);

/* Incremental receiver for one stream socket, blocking or not. */
struct sp_frame_rx {
  struct sp_limits limits;
  uint8_t header[SP_FRAME_HEADER];
  size_t header_have;
  uint8_t *buf;
  size_t cap; /* bytes allocated: grows with what arrives, up to need */
  size_t need;
  size_t have;
  int fds[SP_FDS_MAX];
  size_t nfds;
  /* Bytes one sp__frame_rx_read takes at most before it returns 0 as if the
   * socket were empty (0: no bound), so that a server does not spend the
   * whole transfer of a large frame in one call. */
  size_t max_read;
};

void sp__frame_rx_init(struct sp_frame_rx *rx, const struct sp_limits *limits);
/* Frees a partly read frame and closes its fds. */
void sp__frame_rx_reset(struct sp_frame_rx *rx);

/*
 * Reads what the socket offers, never past the end of the current frame.
 * The payload buffer grows with the bytes that actually arrive, so a peer
 * that announces a large frame and stalls holds little memory.
 * Returns 1 and moves a complete frame into *out; 0 when a non-blocking
 * socket has nothing more now, max_read bytes were taken, or a signal
 * interrupted the read (the caller checks its deadline and calls again);
 * or a negative code: SP_ECLOSED on an orderly end of stream between frames, SP_EIO on a stream cut inside a frame or a
 * socket error, SP_EFRAMETOOBIG when the header announces more than
 * limits.max_frame (checked before the payload is allocated),
 * SP_ETOOMANYFDS when more than limits.max_fds arrive (all of them closed),
 * SP_ENOMEM.  After an error the stream is out of step: close it.
 */
int sp__frame_rx_read(struct sp_frame_rx *rx, int sock, struct sp_frame *out);

/* A frame on its way out.  buf holds header and payload (see msg.h), or
 * the header only when the payload is shared: bytes tx does not own,
 * written after buf, which several frames may send (the daemon relays one
 * rank's registrations to every other daemon of its job); release(arg)
 * runs when tx is freed. */
struct sp_frame_tx {
  uint8_t *buf;
  size_t len;
  size_t off; /* bytes written, of buf and shared together */
  int fds[SP_FDS_MAX];
  size_t nfds;
  const uint8_t *shared;
  size_t shared_len;
  void (*release)(void *arg);
  void *release_arg;
  struct sp_frame_tx *next;
};

/* The bytes tx puts on the socket: buf's and the shared payload's. */
size_t sp__frame_tx_size(const struct sp_frame_tx *tx);

/*
 * Writes as much of tx as the socket takes, attaching the fds to the first
 * byte.  Returns 0 when the whole frame is written, 1 when a non-blocking
 * socket is full or a signal interrupted the write (call again), or SP_EIO /
 * SP_ECLOSED.  The
 * fds stay owned by tx; the peer receives duplicates.
 */
int sp__frame_tx_write(struct sp_frame_tx *tx, int sock);

/* Frees a heap-allocated tx with its buffer, closing the fds it owns and
 * releasing a shared payload. */
void sp__frame_tx_free(struct sp_frame_tx *tx);

/* Writes a whole frame to a blocking socket. */
int sp__frame_send(int sock, const uint8_t *buf, size_t len, const int *fds,
                   size_t nfds);

#endif /* SP_PROTO_FRAME_H */
