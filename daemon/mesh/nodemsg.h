/*
 * nodemsg.h - the messages between daemons, packed and parsed in one place
 * (nodemsg.c, docs/protocol.md "Between daemons").  Internal to
 * daemon/mesh/.
 */
#ifndef SP_DAEMON_MESH_NODEMSG_H
#define SP_DAEMON_MESH_NODEMSG_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <msgpack.h>

#include "daemon/config.h"
#include "daemon/layer.h"
#include "daemon/mesh/peerauth.h"
#include "daemon/registry.h"
#include "daemon/request.h"
#include "proto/msg.h"

enum nodemsg_op {
  NODEMSG_HELLO = 1, /* peer_hello: a node to the root, and its reply */
  NODEMSG_DATA,      /* peer_data: a data link's handshake, and its reply */
  NODEMSG_CHALLENGE, /* peer_challenge: a listener's nonce */
  NODEMSG_JOIN,      /* a rank joins on a node; the root's reply */
  NODEMSG_LEFT,
  NODEMSG_ASK,
  NODEMSG_PLAN,
  NODEMSG_PLANNED,
  NODEMSG_GO,
  NODEMSG_MOVED,
  NODEMSG_PUBLISH,
  NODEMSG_SAVED,     /* a save: a node's ranks all reported a step */
  NODEMSG_COMMIT,    /* a save: every node's did; the root's answer */
  NODEMSG_FAIL,
  NODEMSG_BEAT,
  NODEMSG_BYE,
  NODEMSG_ERROR,
  NODEMSG_ABORT, /* the root ended the job for good: every node ends it */
};

struct nodemsg_node {
  uint32_t node;
  uint64_t node_id;
  char addr[NODE_ADDR_MAX];
};

/* One message between daemons; which fields mean something depends on op
 * (docs/protocol.md, "Between daemons"). */
struct nodemsg {
  enum nodemsg_op op;
  uint64_t id;
  bool reply;
  uint64_t version;
  uint8_t job[JOB_ID_BYTES];
  /* Handshakes: the sender's nonce, and its proof (peerauth.c). */
  uint8_t nonce[PEERAUTH_NONCE_BYTES];
  uint8_t proof[PEERAUTH_PROOF_BYTES];
  char addr[NODE_ADDR_MAX];
  uint64_t node_id;
  uint32_t node;
  /* peer_data: which of the data link's streams this connection is, of
   * how many (the dialler's peer_streams); its export_id is the export the
   * stream was dialled for. */
  uint32_t stream, streams;
  uint32_t rank, world, device_type;
  bool disconnected;
  uint64_t gather, export_id;
  uint32_t max_keys, timeout_ms;
  uint64_t max_bytes;
  /* plan: a save's file limit (0: an export); saved, commit: the step
   * of the save's commit (daemon/save.h). */
  uint64_t save_limit;
  /* ask: the rank's save options and refusal (save.limit 0: an export). */
  struct req_save save;
  uint32_t step;
  size_t nnodes;
  struct nodemsg_node *nodes; /* plan: owned */
  uint32_t *rank_nodes;       /* plan: [world], owned */
  int code;
  uint64_t digest;
  char message[SP_ERRMSG_MAX + 1];
  /* plan: the generation of the job's NCCL communicators and, from 1 on,
   * the fresh NCCL id the root made for it (0: the ticket's id, not sent). */
  uint64_t comm_gen;
  uint8_t nccl_id[NODE_NCCL_ID_BYTES];
  /* planned: the node's lowest rank and its digests of the plan's
   * replicated and plain keys (replicas.c), in key order; owned, none when
   * the node compares none.  go: differ when the root found two nodes'
   * digests of the differ_key-th such key unequal (ranks and digests of
   * both). */
  uint32_t replica_rank;
  size_t nreplicas;
  uint64_t *replicas;
  bool differ;
  uint32_t differ_key;
  uint32_t differ_ranks[2];
  uint64_t differ_digests[2];
};

const char *nodemsg_op_name(enum nodemsg_op op);
/* 0, or a code and a sentence naming the field; free with nodemsg_free
 * either way. */
int nodemsg_parse(const struct sp_msg_head *head, const msgpack_object *map,
                  struct nodemsg *m, char *msg, size_t msglen);
void nodemsg_free(struct nodemsg *m);
void nodemsg_pack(const struct nodemsg *m, struct sp_msgbuf *mb);
/* The limits a rank's registrations are decoded with. */
void nodemsg_meta_limits(struct sp_limits *l);
/* A rank's registrations and groups as one `meta` map, and back into a
 * registry of that rank without memory (on a planning thread). */
void nodemsg_pack_meta(uint32_t rank, const struct registry *reg,
                       const struct req_groups *groups, struct sp_msgbuf *mb);
int nodemsg_parse_meta(const uint8_t *data, size_t len, uint32_t rank,
                       struct registry *reg, struct req_groups *groups,
                       char *msg, size_t msglen);


#endif /* SP_DAEMON_MESH_NODEMSG_H */
