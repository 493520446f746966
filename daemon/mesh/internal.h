/*
 * internal.h - what the files of the across-nodes wing share: the mesh of
 * one job, its nodes, the joins it waits on, its inbox, the export being
 * agreed, and the functions one file of the wing calls in another.  Only
 * daemon/mesh/ includes it; the rest of the daemon sees mesh.h.
 *
 *   mesh.c      the mesh of a job: made, ended, its node table, status
 *   inbox.c     how a member and the root talk: links, or the inbox on
 *               the root's own node
 *   join.c      ranks joining and leaving, on a member and at the root
 *   member.c    a member's side of an export: asks, plan, planned, moved
 *   gathered.c  what an export takes from the mesh: its plan input from
 *               the gathered metadata, its data plane
 *   coord.c     the root's coordination of an export, and its nodes lost
 *   rootlink.c  a member's control link to the root and its handshake
 *   datalink.c  the data links between nodes and their handshakes
 *   hello.c     links that arrive: their challenge and first frame
 *   tick.c      time: beats and silences
 *   nodelink.c, nodemsg.c, peerauth.c, peerhost.c: links, messages,
 *               proofs and hosts (their own headers)
 */
#ifndef SP_DAEMON_MESH_INTERNAL_H
#define SP_DAEMON_MESH_INTERNAL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "daemon/config.h"
#include "daemon/conn.h"
#include "daemon/cuda/gpu.h"
#include "daemon/gather.h"
#include "daemon/job.h"
#include "daemon/log.h"
#include "daemon/netaddr.h"
#include "daemon/quota.h"
#include "daemon/registry.h"
#include "daemon/request.h"
#include "daemon/server.h"
#include "daemon/xfer/remote.h"
#include "daemon/xfer/replicas.h"
#include "daemon/mesh/mesh.h"
#include "daemon/mesh/nodelink.h"
#include "daemon/mesh/nodemsg.h"
#include "daemon/mesh/peerauth.h"

/* While an export is under way, each side says it is alive this often. */
#define MESH_BEAT_MS 500
/* How much longer than its ranks' timeout a member waits for the root to
 * decide a gather before it gives up on it. */
#define MESH_GRACE_MS 2000

/* One connection of the data link to a node: a pair of nodes moves its
 * bytes over peer_streams of them (remote.h). */
struct mesh_stream {
  struct mesh_node *node;
  uint32_t index;
  struct nodelink *dlink; /* in its handshake */
  bool hello_sent;        /* dialled: its peer_data answered the challenge */
  int data;               /* the socket, or -1 */
  int data_next;          /* a newer one, taken at the next export */
  /* The export each was dialled for, its session (docs/protocol.md, "The
   * data stream"): dlink's, data's and data_next's. */
  uint64_t dlink_session, session, session_next;
};

struct mesh_node {
  struct mesh *mesh;
  uint32_t node;
  uint64_t node_id;
  char addr[NODE_ADDR_MAX];
  bool present;          /* part of the job now */
  struct nodelink *ctl;  /* root: the node's control link */
  /* The data link: how many streams (the dialling node's peer_streams, 0
   * until one is dialled or accepted), and each. */
  uint32_t nstreams;
  struct mesh_stream streams[REMOTE_STREAMS_MAX];
  /* The last export with the node in its roster that did not publish: it
   * may have left bytes of its rounds on any stream, either way, so no
   * stream of its session or an older one is used again (both nodes of a
   * pair hear every export's end alike). */
  uint64_t failed_export;
  uint32_t nranks;       /* root: ranks joined there */
  /* Root: the node's part in the export being agreed, and its lowest
   * rank's digests of the replicated and plain keys (none when it
   * compares none). */
  bool in_export, planned, moved;
  /* A save: the last step of its commit the node's ranks all reported. */
  uint32_t saved;
  uint64_t digest;
  uint32_t replica_rank;
  size_t nreplicas;
  uint64_t *replicas;
  uint64_t heard_ms;
  bool ask_pending; /* its next frame is the meta of ask */
  struct nodemsg ask;
  _Atomic uint64_t sent, received;
};

struct pending_join {
  struct pending_join *next;
  uint64_t seq;
  uint64_t conn_id;
  uint64_t request_id;
  struct req_join req; /* its ticket pointer is not kept */
  int device;
};

struct inbox_item {
  struct inbox_item *next;
  bool to_root;
  uint32_t from; /* the sending node, for the root */
  struct nodemsg msg;
  struct nodeblob **blobs;
  size_t nblobs;
};

struct mesh_ask {
  bool asked;
  uint32_t max_keys;
  uint64_t max_bytes;
  struct req_save save;
  uint32_t timeout_ms;
  uint64_t deadline_ms;
  struct nodeblob *meta;
};

/* What one export takes from the mesh (mesh.h). */
struct mesh_export {
  struct mesh *mesh;
  uint64_t gather, export_id;
  uint32_t world;
  uint32_t max_keys, timeout_ms;
  uint64_t max_bytes;
  uint64_t save_limit; /* a save (daemon/save.h), or 0 */
  uint32_t *rank_nodes;
  struct nodemsg_node *nodes;
  size_t nnodes;
  struct nodeblob **metas;
  uint32_t nmetas;
  /* The job's communicators for it: their generation and, from 1 on, the
   * fresh NCCL id the root sent (generation 0 is the ticket's id). */
  uint64_t comm_gen;
  uint8_t nccl_id[NODE_NCCL_ID_BYTES];
  /* Filled on the planning thread. */
  struct registry *shadow;
  struct req_groups *groups;
  struct remote *remote;
  /* The root said go: the engine may use the data sockets. */
  bool moving;
  /* The root said publish: the root has no more to say about it. */
  bool published;
};

struct mesh {
  struct job *job;
  struct server *srv;
  /* The way back into the job and its export (srv->mesh_ops). */
  const struct mesh_ops *ops;
  bool root;
  uint32_t self;
  struct mesh_node **nodes; /* by node number; NULL where none */
  uint32_t nnodes;
  /* Member side. */
  struct nodelink *root_link;
  char root_addr[NODE_ADDR_MAX];
  bool hello_sent; /* peer_hello answered the root's challenge */
  bool hello_done; /* the root proved it knows the job's secret */
  bool broken;
  int broken_code;
  char broken_msg[SP_ERRMSG_MAX + 1];
  uint64_t next_seq;
  struct pending_join *joins;
  uint64_t gather;
  uint64_t *ask_sent; /* [world]: ask id + 1 sent in this gather */
  /* [world]: the registrations this node last sent for each of its ranks.
   * The root relays every rank's back to every node; a node plans on them
   * but reads its own ranks' memory, so what comes back for its own ranks
   * must be exactly what it sent, or a peer could point its reads outside
   * what the trainers registered. */
  struct nodeblob **sent_meta;
  struct mesh_export *incoming, *ready, *current;
  bool awaiting_links;
  uint64_t planned_digest;
  /* What `planned` tells the root of this node's replicated keys. */
  uint32_t planned_replica_rank;
  size_t planned_nreplicas;
  uint64_t *planned_replicas;
  uint64_t heard_ms, beat_ms;
  uint32_t timeout_ms; /* of the export under way */
  /* Root. */
  uint32_t *rank_node; /* [world] */
  struct mesh_ask *asks;
  uint32_t nasked;
  uint64_t cgather;
  /* SAVING: a save's owners write and pass its commit (daemon/save.h). */
  enum { COORD_IDLE, COORD_PLANNING, COORD_MOVING, COORD_SAVING } cstate;
  uint64_t csave_limit;
  uint64_t cexport_gather, cexport_id;
  uint32_t ctimeout;
  uint64_t next_export_id;
  uint64_t cbeat_ms;
  /* The job's NCCL communicators across nodes: their generation and its
   * id (a fresh ncclGetUniqueId from 1 on; 0 is the ticket's), whether
   * the export planned last across nodes has not published (its failure
   * may have aborted them), and whether the next one needs a new
   * generation because of that. */
  uint64_t comm_gen;
  uint8_t comm_id[NODE_NCCL_ID_BYTES];
  bool comm_pending, comm_stale;
  struct inbox_item *inbox_head, *inbox_tail;
};


/* ---- mesh.c ---- */

/* A mesh for job, as its root or as a member (a shadow); NULL when out of
 * memory. */
struct mesh *mesh_alloc(struct job *job, bool root);
/* The node numbered node, or NULL; made when new (NULL past
 * NODE_MAX_NODES or out of memory); its data sockets closed. */
struct mesh_node *mesh_node_get(struct mesh *ms, uint32_t node);
struct mesh_node *mesh_node_make(struct mesh *ms, uint32_t node);
void mesh_node_close_data(struct mesh_node *n);

/* ---- inbox.c ---- */

/* One message on a link. */
int inbox_send(struct nodelink *l, const struct nodemsg *m);
/* A member's message to the root, and the root's to a node: over the
 * link, or through the inbox when the root is this node (handled on the
 * job's next wake-up, never re-entering the caller). */
void inbox_to_root(struct mesh *ms, const struct nodemsg *m,
                   struct nodeblob *blob);
void inbox_to_node(struct mesh *ms, uint32_t node, const struct nodemsg *m,
                   struct nodeblob **blobs, size_t nblobs);
void inbox_item_free(struct inbox_item *it);

/* ---- join.c ---- */

/* Refuses every join still waiting for the root's answer. */
void join_refuse_all(struct mesh *ms, int code, const char *message);
/* A member: sends the root one waiting join, and handles its verdict. */
void join_send(struct mesh *ms, struct pending_join *pj);
void join_verdict(struct mesh *ms, const struct nodemsg *m);
/* The root: a node's rank joins, or left. */
void join_at_root(struct mesh *ms, struct mesh_node *n,
                  const struct nodemsg *m);
void join_left_at_root(struct mesh *ms, struct mesh_node *n,
                       const struct nodemsg *m);

/* ---- member.c ---- */

/* A message from the root (blobs: the plan's metas when it came through
 * the inbox), and a meta that came on the root link. */
void member_handle(struct mesh *ms, const struct nodemsg *m,
                   struct nodeblob **blobs, size_t nblobs);
void member_meta(struct mesh *ms, struct nodeblob *blob);
/* The local asks were answered: new asks go to the root again. */
void member_forget_asks(struct mesh *ms);
/* Fails what this node takes part in, and tells the root. */
void member_fail(struct mesh *ms, int code, const char *message);
/* Tells the root the plan's digest once every data link is up. */
void member_send_planned(struct mesh *ms);

/* ---- gathered.c ---- */

/* Whether node is in the export's roster. */
bool gathered_in_roster(const struct mesh_export *mx, uint32_t node);

/* ---- coord.c ---- */

/* A member's message to the root, from node from. */
void coord_handle(struct mesh *ms, uint32_t from, const struct nodemsg *m,
                  struct nodeblob *blob);
/* A gather that cannot complete: every node's waiting ranks hear why. */
void coord_gather_fail(struct mesh *ms, int code, const char *message);
/* The ranks of the gather under way, as gather.h reads them. */
struct gather_ranks coord_gather_ranks(const struct mesh *ms);
/* A node is gone (why NULL: it said goodbye). */
void coord_node_lost(struct mesh *ms, struct mesh_node *n, const char *why);
/* What a node's control link tells the root. */
extern const struct nodelink_ops coord_ctl_ops;

/* ---- rootlink.c ---- */

/* The root is gone, or ended the job for good. */
void rootlink_lost(struct mesh *ms, const char *why);
void rootlink_ended(struct mesh *ms, const struct nodemsg *m);
/* What the control link to the root tells a member. */
extern const struct nodelink_ops rootlink_ops;

/* ---- datalink.c ---- */

/* Dials the data links the export needs (0, or 1 + the node that could
 * not be dialled); whether every one is up. */
int datalink_ensure(struct mesh *ms, const struct mesh_export *mx);
bool datalink_ready(const struct mesh *ms, const struct mesh_export *mx);
/* A data link to n failed: the export it serves fails. */
void datalink_fail(struct mesh_node *n, const char *why);
/* A stream of a data link accepted from a node finished its handshake
 * (arg: its struct mesh_stream; sock, or -1). */
void datalink_accepted(void *arg, int sock);
/* Whether the node's data link has any stream up. */
bool datalink_up(const struct mesh_node *n);

/* ---- hello.c ---- */

/* A dialled link's answer to the listener's challenge: this daemon's nonce
 * and proof in m, and in the link the proof the listener must send back. */
void hello_answer_challenge(struct nodelink *l, const struct job *job,
                            enum peerauth_link kind,
                            const uint8_t listener_nonce[PEERAUTH_NONCE_BYTES],
                            struct nodemsg *m);
/* A link another daemon opened: its challenge, then its first frame
 * (nodelink.c). */
void hello_accepted(struct server *srv, struct nodelink *l);
void hello_first_frame(struct server *srv, struct nodelink *l,
                       const struct sp_msg_head *head,
                       const msgpack_object *map);

#endif /* SP_DAEMON_MESH_INTERNAL_H */
