/*
 * mesh.h - the across-nodes wing's one face: a job that spans daemons
 * (daemon/mesh/, docs/protocol.md "Between daemons").  The rest of the
 * daemon includes this header only; the wing's own files share the
 * headers beside it.
 */
#ifndef SP_DAEMON_MESH_MESH_H
#define SP_DAEMON_MESH_MESH_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <msgpack.h>

#include "daemon/gather.h"
#include "daemon/layer.h"
#include "daemon/request.h"
#include "proto/msg.h"

struct conn;
struct job;
struct job_member;
struct nodelink;
struct plan;
struct plan_input_store;
struct remote;
struct replica_digests;
struct server;
struct xfer_storage;

/* ---- the peer listener (nodelink.c) ---- */

/* Listens on peer_listen (when set): 0 or -1 (logged). */
int nodelink_listen_open(struct server *srv);
void nodelink_listen_close(struct server *srv);
/* Closes every link at shutdown. */
void nodelink_shutdown(struct server *srv);

/* ---- the way back: what the wing asks of jobs and exports ---- */

struct mesh_export;

/* Two nodes' copies of the key-th replicated or plain key (in key order)
 * that differ, as the root found them (the root's go). */
struct replica_differ {
  uint32_t key;
  uint32_t ranks[2];
  uint64_t digests[2];
};

/*
 * The wing never calls into job.c or export.c: it calls back through this
 * table, which the daemon hands it in srv->mesh_ops (export.c fills it;
 * the wing's unit tests hand it a fake).  Every entry runs on the loop,
 * from the job's wake-up or a link's callback, and may not free the mesh
 * it was called from, except end and terminate, after which the caller
 * touches the job no more.
 */
struct mesh_ops {
  /* The job's clock, in milliseconds. */
  uint64_t (*now_ms)(void);
  /* Runs the job's state machine soon (never re-entered), and keeps its
   * tick timer running while it has something to watch. */
  void (*wake)(struct job *job);
  void (*schedule)(struct job *job);
  /* The job's end, as soon as no export runs; and its end for good, its
   * ranks told code and message (job_terminate). */
  void (*end)(struct job *job);
  void (*terminate)(struct job *job, int code, const char *message);
  /* The next job of an id after prev (NULL: the first), or NULL; a new
   * job of that id and secret, a shadow of one rooted elsewhere. */
  struct job *(*find)(const struct server *srv, const struct job *prev,
                      const uint8_t *id);
  struct job *(*shadow)(struct server *srv, const uint8_t *id,
                        const uint8_t *secret, uint32_t world);
  /* A rank the root admitted (the join is answered; NULL when out of
   * memory, nothing answered); a rank joined elsewhere. */
  struct job_member *(*admit)(struct job *job, struct conn *c,
                              uint64_t request_id, const struct req_join *req,
                              int device);
  void (*note_joined)(struct job *job);
  /* Rank left the job (reason: why, when known, or NULL), or joined again;
   * whether a rank left and has not come back (buf names it); how every
   * daemon names a rank that left (job_departure_text). */
  void (*rank_departed)(struct job *job, uint32_t rank, bool disconnected,
                        const char *reason);
  void (*rank_returned)(struct job *job, uint32_t rank);
  bool (*departed)(const struct job *job, char *buf, size_t len);
  void (*departure_text)(const struct job *job, uint32_t rank,
                         bool disconnected, const char *when,
                         const char *reason, char *buf, size_t len);
  /* Answers a member's pending ask with an error. */
  void (*answer_ask)(struct job_member *m, int code, const char *message);
  /* Starts the export the root announced from the local ranks that asked
   * and the gathered metadata of every rank, with the options the root
   * resolved: 0 (the export owns mx), or a code and a message to fail it
   * everywhere with (mx stays the caller's). */
  int (*start)(struct job *job, struct mesh_export *mx, uint64_t export_id,
               const struct gather_options *o, char *msg, size_t msglen);
  /* The root's go (every node planned alike; differ: but two nodes'
   * copies of a replicated key differ, and the export is refused) and
   * publish (every node moved its data). */
  void (*go)(struct job *job, const struct replica_differ *differ);
  void (*publish)(struct job *job);
  /* Fails the running export with the root's code and message (nothing
   * is reported back to the root). */
  void (*fail)(struct job *job, int code, const char *message);
  /* Fails the ranks of this node waiting for an export, logged once at
   * warn when there are any; whether any waits. */
  void (*fail_asks)(struct job *job, int code, const char *message);
  bool (*any_asked)(const struct job *job);
  /* A save: every node's ranks reported step of its commit (the root's
   * word, daemon/save.h). */
  void (*commit)(struct job *job, uint32_t step);
};

/* ---- jobs across nodes (the wing's files, internal.h says which) ---- */

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
/* The export's part (export.c): its plan input from the gathered bytes
 * (on the planning thread), the plan's digest, the rounds done, a failure
 * found here, the data plane, and the end. */
int mesh_plan_input(struct mesh_export *mx, struct plan_input_store *store,
                    char *msg, size_t msglen);
void mesh_planned(struct job *job, uint64_t digest,
                  const struct replica_digests *replicas);
void mesh_moved(struct job *job);
/* A save: every rank of this node reported step of its commit. */
void mesh_saved(struct job *job, uint32_t step);
void mesh_failed(struct job *job, int code, const char *message);
/* The data plane lost node: on the root, a node silent on its control link
 * too leaves the job as if that link had closed, so that its ranks no
 * longer keep the job alive while a cut link waits for TCP to give up; one
 * heard from within two beats stays for the job's next export. */
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

#endif /* SP_DAEMON_MESH_MESH_H */
