/*
 * daemon.h - the interfaces of the links between daemons (nodelink.c,
 * peerhost.c, peerauth.c, nodemsg.c, mesh.c), one section per file; every
 * other file of the daemon has a header of its own (log.h for log.c, and so
 * on), and the movers theirs under daemon/xfer/.
 *
 * Nothing here is public; the daemon's only interface to the world is the
 * socket protocol in docs/protocol.md.  Functions carry their file's name as
 * prefix (mesh_remote is in mesh.c); everything else is static there.
 */
#ifndef SP_DAEMON_H
#define SP_DAEMON_H

#include <msgpack.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <uv.h>

#include "daemon/config.h"
#include "daemon/cuda/gpu.h"
#include "daemon/layer.h"
#include "daemon/plan/plan.h"
#include "daemon/registry.h"
#include "daemon/request.h"
#include "daemon/xfer/engine.h"
#include "daemon/xfer/remote.h"
#include "daemon/xfer/replicas.h"
#include "daemon/xfer/thread.h"
#include "proto/frame.h"
#include "proto/limits.h"
#include "proto/msg.h"

struct conn;
struct job;
struct mesh_export;
struct metrics_peer;
struct server;

/* ---- nodelink.c ------------------------------------------------------- */

/* The most bytes of one frame between daemons: a rank's registrations
 * travel in one, and the most items it may hold. */
#define NODE_MAX_FRAME (1u << 30)
#define NODE_MAX_ITEMS (1u << 26)
#define NODE_MAX_NODES 4096u
/* Bump when a message between daemons changes (docs/protocol.md). */
#define NODE_PROTOCOL_VERSION 3

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

/* "a.b.c.d:port" or "[v6]:port", numeric only (port_optional: "addr"
 * alone means port 0): 0 or SP_EINVAL. */
int nodelink_addr_parse(const char *s, size_t len, bool port_optional,
                        struct sockaddr_storage *out, socklen_t *outlen);
void nodelink_addr_format(const struct sockaddr *sa, char *buf, size_t len);
bool nodelink_addr_wildcard(const struct sockaddr_storage *sa);
/* Keepalive, TCP_USER_TIMEOUT and TCP_NODELAY on a socket to a daemon. */
void nodelink_tune(int sock);
/* The limits a rank's registrations are decoded with. */
void nodelink_meta_limits(struct sp_limits *l);
/* Listens on peer_listen (when set): 0 or -1 (logged). */
int nodelink_listen_open(struct server *srv);
void nodelink_listen_close(struct server *srv);
/* Closes every link at shutdown. */
void nodelink_shutdown(struct server *srv);
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

/* ---- peerhost.c ------------------------------------------------------- */

/* The host a peer address belongs to: an IPv4 address (IPv4-mapped IPv6
 * ones included), or an IPv6 /64 prefix; zero for any other family. */
#define PEERHOST_PREFIX_BYTES 8
struct peer_host {
  sa_family_t family;
  uint8_t prefix[PEERHOST_PREFIX_BYTES]; /* IPv4: 4 bytes, then zeros */
};

void peerhost_of(const struct sockaddr_storage *sa, struct peer_host *out);
/* A total order: 0 when both are one host. */
int peerhost_cmp(const struct peer_host *a, const struct peer_host *b);

/* A link in its handshake, as the choice of one to drop sees it. */
struct peerhost_entry {
  struct peer_host host;
  uint64_t id; /* smaller is older */
  void *link;
};

/* Which of n > 0 links to drop at peer_handshakes: the oldest of the host
 * that holds the most (ties: the host whose oldest is oldest).  Sorts e
 * and returns the victim's index in it. */
size_t peerhost_victim(struct peerhost_entry *e, size_t n);

/* ---- peerauth.c ------------------------------------------------------- */

/* The handshake between daemons proves the job's secret without sending
 * it (docs/protocol.md, "Handshakes"). */
#define PEERAUTH_NONCE_BYTES 32
#define PEERAUTH_PROOF_BYTES 32

/* Who proves: the daemon that dialled the link, or the one that listened. */
enum peerauth_side { PEERAUTH_DIALER = 1, PEERAUTH_LISTENER = 2 };
/* Which link the proof opens: a control link (peer_hello) or a data link
 * (peer_data). */
enum peerauth_link { PEERAUTH_CONTROL = 1, PEERAUTH_DATA = 2 };

/* A fresh random nonce from getrandom: 0 or SP_EINTERNAL. */
int peerauth_nonce(uint8_t nonce[PEERAUTH_NONCE_BYTES]);
/* HMAC-SHA-256 keyed by the job's secret over "shardport-peer-2", side,
 * link, the job id, the listener's nonce and the dialer's nonce. */
void peerauth_proof(const uint8_t secret[JOB_SECRET_BYTES],
                    enum peerauth_side side, enum peerauth_link link,
                    const uint8_t job[JOB_ID_BYTES],
                    const uint8_t listener_nonce[PEERAUTH_NONCE_BYTES],
                    const uint8_t dialer_nonce[PEERAUTH_NONCE_BYTES],
                    uint8_t proof[PEERAUTH_PROOF_BYTES]);
/* Compares two proofs in time independent of where they differ. */
bool peerauth_equal(const uint8_t a[PEERAUTH_PROOF_BYTES],
                    const uint8_t b[PEERAUTH_PROOF_BYTES]);

/* ---- nodemsg.c -------------------------------------------------------- */

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
  uint32_t rank, world, device_type;
  bool disconnected;
  uint64_t gather, export_id;
  uint32_t max_keys, timeout_ms;
  uint64_t max_bytes;
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
/* A rank's registrations and groups as one `meta` map, and back into a
 * registry of that rank without memory (on a planning thread). */
void nodemsg_pack_meta(uint32_t rank, const struct registry *reg,
                       const struct req_groups *groups, struct sp_msgbuf *mb);
int nodemsg_parse_meta(const uint8_t *data, size_t len, uint32_t rank,
                       struct registry *reg, struct req_groups *groups,
                       char *msg, size_t msglen);

/* ---- mesh.c ----------------------------------------------------------- */

struct mesh;

/* job_create on a daemon that listens for peers: the job's root. */
int mesh_create_root(struct job *job);
void mesh_free(struct mesh *ms);
bool mesh_is_root(const struct mesh *ms);
uint32_t mesh_self(const struct job *job);
/* A ticket of a job rooted on another daemon: makes the job's shadow here
 * (*out), or replies with the error (*out NULL). */
int mesh_shadow_job(struct conn *c, const struct sp_msg_head *head,
                    const struct req_ticket *t, struct job **out);
/* A join that passed the local checks: 1 when the mesh took it (queued for
 * the root's word, or refused), 0 to admit it here now, or a code. */
int mesh_join(struct job *job, struct conn *c, const struct sp_msg_head *head,
              const struct req_join *req, int device);
void mesh_rank_joined(struct job *job, uint32_t rank);
/* Rank left this node (reason: why, when known, or NULL): the root hears. */
void mesh_rank_left(struct job *job, uint32_t rank, bool disconnected,
                    const char *reason);
/* Sends the root the asks of local ranks it has not heard. */
void mesh_asks(struct job *job);
/* Starts an export the root announced, once none runs. */
void mesh_try_start(struct job *job);
/* Messages the root's own node queued for itself; beats and silences. */
void mesh_advance(struct job *job);
void mesh_tick(struct job *job);
/* Something to watch (asks out, an export under way); may the job end. */
bool mesh_active(const struct job *job);
bool mesh_may_end(const struct job *job);
/* On the root: tells every node that the job ended for good, with the code
 * and message its ranks there are to hear. */
void mesh_job_ended(struct job *job, int code, const char *message);
/* A link another daemon opened: its challenge, then its first frame. */
void mesh_link_accepted(struct server *srv, struct nodelink *l);
void mesh_link_hello(struct server *srv, struct nodelink *l,
                     const struct sp_msg_head *head,
                     const msgpack_object *map);
/* The export's part (export.c): its plan input from the gathered bytes
 * (on the planning thread), the plan's digest, the rounds done, a failure
 * found here, the data plane, and the end. */
int mesh_plan_input(struct mesh_export *mx, struct plan_input *in, char *msg,
                    size_t msglen);
void mesh_planned(struct job *job, uint64_t digest,
                  const struct replica_digests *replicas);
void mesh_moved(struct job *job);
void mesh_failed(struct job *job, int code, const char *message);
/* The data plane lost node: on the root, the node leaves the job as if its
 * control link had closed, so that its ranks no longer keep the job alive
 * while a cut link waits for TCP to give up. */
void mesh_data_lost(struct job *job, uint32_t node, const char *why);
int mesh_remote(struct job *job, struct mesh_export *mx,
                const struct plan *plan, const struct xfer_storage *const *src,
                uint8_t *const *dst, const uint64_t *key_offset,
                struct remote **out);
void mesh_export_free(struct mesh_export *mx);
/* The NCCL id and communicator generation an export's plan names: the
 * ticket's id at generation 0, else the fresh one the root sent.  false
 * when the job has none. */
bool mesh_nccl_id(const struct mesh_export *mx, uint8_t id[NODE_NCCL_ID_BYTES],
                  uint64_t *gen);
/* "node N (ADDR) was lost during export E of job J" (export_id 0: while
 * the ranks waited): the one text every node shows for a lost node. */
void mesh_lost_message(const char *job_hex, uint32_t node, const char *addr,
                       uint64_t export_id, char *buf, size_t len);
/* The job's nodes for status: "nodes" and its array. */
void mesh_status_pack(const struct job *job, msgpack_packer *pk);
/* How many daemons the job spans (0 for a job on one daemon). */
uint32_t mesh_node_count(const struct job *job);
/* On the job's root, for a rank joined on any node: that node, and whether
 * the rank asked for the next export.  false elsewhere, or when the rank
 * is not in the job. */
bool mesh_rank_where(const struct job *job, uint32_t rank, uint32_t *node,
                     bool *asked);

#endif /* SP_DAEMON_H */
