/*
 * remote.h - the part of each round that crosses nodes, for the engine
 * (engine.h): this node's buckets sent to and received from every peer
 * daemon over its data socket (stream.h), with the moves that go through
 * staging packed before the exchange and unpacked after it.
 *
 * The exchange knows peers by node number, socket and address; the
 * sentence that names a lost peer is its caller's (remote_ops), who knows
 * the job.
 */
#ifndef SP_DAEMON_XFER_REMOTE_H
#define SP_DAEMON_XFER_REMOTE_H

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#include "daemon/plan/plan.h"
#include "daemon/xfer/engine.h"
#include "daemon/xfer/layer.h"
#include "proto/view.h"

/* Bytes of a peer's address as the setup copies it, NUL included. */
#define REMOTE_ADDR_MAX 64
/* Counters each peer's bytes add to (the node's, the metrics' of its
 * address). */
#define REMOTE_PEER_COUNTERS 2
/* The most connections (streams) one pair of nodes moves its bytes over
 * (peer_streams, docs/operations.md). */
#define REMOTE_STREAMS_MAX 8
/* A pair's byte stream of each round is dealt over its streams in stripes
 * of this many bytes, the first stripe to stream 0 (docs/protocol.md, "The
 * data stream"): both sides cut the same bytes the same way whatever their
 * runs in memory. */
#define REMOTE_STRIPE_BYTES (64u << 10)

struct remote;

struct remote_peer_setup {
  /* The data link's streams, in the order of their handshakes; none for
   * this node, or a peer without a link (its socks -1). */
  int socks[REMOTE_STREAMS_MAX];
  uint32_t nsocks;
  char addr[REMOTE_ADDR_MAX];
  /* Counters every byte sent to or received from the peer adds to; each
   * may be NULL. */
  _Atomic uint64_t *sent[REMOTE_PEER_COUNTERS];
  _Atomic uint64_t *received[REMOTE_PEER_COUNTERS];
};

/* What the exchange asks of its caller, on the engine's thread. */
struct remote_ops {
  /* Writes the sentence of a node lost to export export_id into msg:
   * node, at addr, had no data link when the exchange began (why 0), or
   * its exchange ended with why (SP_ETIMEOUT: it moved nothing within the
   * timeout, another code: its connection failed). */
  void (*node_lost)(void *arg, uint32_t node, const char *addr,
                    uint64_t export_id, int why, char *msg, size_t msglen);
  void *arg;
};

struct remote_setup {
  const struct plan *plan;
  uint32_t self;
  uint32_t nnodes;
  const struct remote_peer_setup *peers; /* [nnodes], copied */
  const struct xfer_storage *const *src; /* [world]: local ranks' storages */
  uint8_t *const *dst;                   /* [world]: local owners' segments */
  const uint64_t *key_offset;
  uint64_t export_id;
  uint32_t timeout_ms; /* a peer that moves nothing this long is lost */
  struct remote_ops ops;
};

/* One round as the engine runs it: pack (copy into staging) before the
 * exchange, early (local copies) during it, late (from staging, and keys
 * whose replicas crossed nodes) after it. */
struct remote_round {
  const struct plan_move *pack, *early, *late;
  size_t npack, nearly, nlate;
};

int remote_new(const struct remote_setup *s, struct remote **out);
void remote_free(struct remote *r);
/* The bytes this node copies, sends and receives over all rounds. */
uint64_t remote_bytes_total(const struct remote *r);
int remote_round(struct remote *r, size_t round, struct remote_round *out,
                 char *msg, size_t msglen);
/* Sends and receives the round's buckets, each pair's streams on a thread
 * of their own past the first (this one); 0, 1 when cancelled, or a code
 * and a sentence (SP_ENODELOST names the node, also set in *lost_node). */
int remote_exchange(struct remote *r, const atomic_bool *cancel,
                    _Atomic uint64_t *bytes_moved, uint32_t *lost_node,
                    char *msg, size_t msglen);
/* When the last exchange sent its first byte of the next round's (moved
 * ahead), in nanoseconds of CLOCK_MONOTONIC; 0 when it sent none. */
uint64_t remote_ahead_began_ns(const struct remote *r);
/* For a move of the round's lists that goes through staging: its bytes
 * there, and the view rewritten as the contiguous box; NULL otherwise. */
const uint8_t *remote_source(const struct remote *r, const struct plan_move *m,
                             struct sp_view *sv);
uint8_t *remote_dest(const struct remote *r, const struct plan_move *m,
                     struct plan_region *dr);

#endif /* SP_DAEMON_XFER_REMOTE_H */
