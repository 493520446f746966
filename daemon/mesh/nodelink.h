/*
 * nodelink.h - links between daemons (nodelink.c): framed connections over
 * TCP, and the frame bytes they share.  Internal to daemon/mesh/.
 */
#ifndef SP_DAEMON_MESH_NODELINK_H
#define SP_DAEMON_MESH_NODELINK_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <msgpack.h>

#include "daemon/layer.h"
#include "daemon/mesh/peerauth.h"
#include "proto/frame.h"
#include "proto/msg.h"

struct server;

/* The most bytes of one frame between daemons: a rank's registrations
 * travel in one, and the most items it may hold. */
#define NODE_MAX_FRAME (1u << 30)
#define NODE_MAX_ITEMS (1u << 26)
#define NODE_MAX_NODES 4096u
/* Bump when a message between daemons changes (docs/protocol.md). */
#define NODE_PROTOCOL_VERSION 6

/* Frame bytes shared by the links that send them (the root relays one
 * rank's registrations to every node): refcounted, loop thread only. */
struct nodeblob {
  uint32_t refs;
  uint8_t hdr[SP_FRAME_HEADER];
  uint8_t *mem; /* freed with the last reference */
  const uint8_t *payload;
  size_t len;
};

struct nodeblob *nodeblob_wrap(uint8_t *mem, const uint8_t *payload,
                               size_t len);
struct nodeblob *nodeblob_ref(struct nodeblob *b);
void nodeblob_unref(struct nodeblob *b);

struct nodelink;

/* What a link tells its owner.  A callback may close the link. */
struct nodelink_ops {
  /* A control frame, decoded (valid during the call). */
  void (*frame)(struct nodelink *l, void *arg, const struct sp_msg_head *head,
                const msgpack_object *map);
  /* A frame announced with nodelink_expect_blobs; the callee owns b. */
  void (*blob)(struct nodelink *l, void *arg, struct nodeblob *b);
  /* The link ended by the peer or an error (not by nodelink_close). */
  void (*closed)(struct nodelink *l, void *arg, int code);
};

/* Keepalive, TCP_USER_TIMEOUT and TCP_NODELAY on a socket to a daemon. */
void nodelink_tune(int sock);
/* Dials addr; the listener speaks first (its challenge comes to
 * ops->frame), or ops->closed follows. */
int nodelink_connect(struct server *srv, const char *addr,
                     const struct nodelink_ops *ops, void *arg,
                     struct nodelink **out);
void nodelink_set_ops(struct nodelink *l, const struct nodelink_ops *ops,
                      void *arg);
/* The peer proved who it is: no handshake deadline, blobs may be large,
 * and the link no longer counts against peer_handshakes. */
void nodelink_hello_done(struct nodelink *l);
/* The owner waits for the peer's answer (true), for at most peer_timeout
 * from the first call, after which the link fails with SP_ETIMEOUT; or no
 * longer (false). */
void nodelink_await(struct nodelink *l, bool waiting);
/* PEERAUTH_NONCE_BYTES the owner's handshake keeps with the link. */
uint8_t *nodelink_handshake(struct nodelink *l);
/* The next n frames are blobs. */
void nodelink_expect_blobs(struct nodelink *l, uint32_t n);
/* Queue a message (mb is left empty), a shared blob, an error reply. */
int nodelink_send(struct nodelink *l, struct sp_msgbuf *mb);
int nodelink_send_blob(struct nodelink *l, struct nodeblob *b);
int nodelink_send_error(struct nodelink *l, int code, const char *message);
/* Closes at once (a pending hand-over is cancelled); NULL allowed. */
void nodelink_close(struct nodelink *l);
/* Stops reading; closes once the queue is written. */
void nodelink_close_after_flush(struct nodelink *l);
/* Stops reading; once the queue is written, hands the bare socket to
 * fn(arg, sock) instead of closing it (fn(arg, -1) when the link failed
 * first; never once nodelink_close cancelled it). */
void nodelink_detach(struct nodelink *l, void (*fn)(void *arg, int sock),
                     void *arg);
const char *nodelink_peer(const struct nodelink *l);


#endif /* SP_DAEMON_MESH_NODELINK_H */
