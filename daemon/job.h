/*
 * job.h - jobs: ranks join, ask, leave; the job ends (job.c).
 */
#ifndef SP_DAEMON_JOB_H
#define SP_DAEMON_JOB_H

#include <msgpack.h>
#include <stdbool.h>
#include <stdint.h>
#include <sys/types.h>
#include <uv.h>

#include "daemon/comms.h"
#include "daemon/consumer_buffer.h"
#include "daemon/cuda/gpu.h"
#include "daemon/history.h"
#include "daemon/layer.h"
#include "daemon/plancache.h"
#include "daemon/publish.h"
#include "daemon/push.h"
#include "daemon/registry.h"
#include "daemon/request.h"
#include "proto/frame.h"
#include "proto/msg.h"

struct conn;
struct gpu_comms;
struct mesh;
struct peer;
struct pool_segment;
struct quota_user;
struct server;

enum job_phase {
  JOB_WAITING,    /* for ranks to join and to ask for an export */
  JOB_PLANNING,   /* plan_build on a worker thread */
  /* Status only (export_view): moving, but the engine is still preparing
   * the owners' pool segments (populating their pages) before round 1. */
  JOB_ALLOCATING,
  JOB_MOVING,     /* the engine runs the rounds */
  JOB_PUBLISHING, /* replies streaming to the owners */
  JOB_WRITING,    /* a save: the owners write their files (save.c) */
  JOB_PUBLISHED,  /* the last export succeeded */
  JOB_FAILED,     /* the last export failed (job->error) */
};

/* An export a rank still holds, until it releases it or leaves. */
struct job_published {
  struct job_published *next;
  uint64_t export_id;
  struct pool_segment *segment; /* NULL when it owns no pool memory */
};

struct job_member {
  struct job *job;
  struct conn *conn; /* NULL once the connection is gone */
  uint32_t rank;
  struct registry reg;
  /* The user of its connection, whose quotas its registrations count in. */
  struct quota_user *user;
  /* Its process (SO_PEERCRED) as a descriptor taken when it joined (a
   * pidfd, or its /proc directory), or -1: an export it never released is
   * freed only once that process ended (pool.h). */
  int pidfd;
  /* The rank asked for the next export and waits for its reply. */
  bool asked;
  uint64_t ask_id;
  uint64_t asked_ms;
  uint64_t ask_deadline_ms;
  struct req_export ask;
  /* Part of the running export. */
  bool in_export;
  /* The rank sent push and waits for its reply (push.c); part of the
   * running push. */
  bool push_asked;
  uint64_t push_request;
  uint64_t push_deadline_ms;
  struct req_push push;
  bool in_push;
  /* Left or disconnected; freed once no export uses its storages. */
  bool lost;
  bool lost_handled; /* export_member_lost ran for it */
  bool disconnected;
  /* Its first refused registration ("rank 2's registration was refused:
   * <code>: <message>"), or NULL: why it left, when it leaves. */
  char *refused;
  struct job_published *published;
};

struct export;

/* A rank that left and has not joined again. */
struct job_departure {
  bool gone;
  bool disconnected;
  uint64_t seq; /* job->departures when it left: their order */
  char *reason; /* why, when its daemon knew (and had the memory), or NULL */
};

struct job {
  struct server *srv;
  struct job *next;
  /* The user that created it, or whose join made this shadow of a job
   * rooted on another daemon (max_user_jobs). */
  struct quota_user *owner;
  uint8_t id[JOB_ID_BYTES];
  uint8_t secret[JOB_SECRET_BYTES];
  char hex[2 * JOB_ID_BYTES + 1];
  uint32_t world;
  uint32_t joined;
  bool ever_joined;
  /* Who made it (SO_PEERCRED of job_create, or of the first rank that
   * joined a shadow of a job rooted elsewhere): the one user besides root
   * who may abort it.  When. */
  bool has_owner;
  uid_t owner_uid;
  pid_t owner_pid;
  uint64_t created_ms;
  /* Its last finished exports (status), and how many finished. */
  struct history history;
  struct job_member **members; /* [world], NULL where not joined */
  uint64_t next_export_id;
  struct export *running;
  /* The outcome of the last export, for status. */
  enum job_phase last_phase;
  char error[SP_ERRMSG_MAX + 1];
  uint32_t last_round, last_rounds;
  uint64_t last_bytes_moved, last_bytes_total;
  /* The last plan and its layout, reused by an export with the same
   * registrations, groups and options (plancache.c). */
  struct plancache cache;
  /* The digest of the last plan built, for status (has_plan_digest). */
  uint64_t plan_digest;
  bool has_plan_digest;
  /* [world]: the ranks that left and have not joined again; every export
   * asked for meanwhile fails with rank_lost (job_departed): a job cannot
   * export without all of its ranks.  The daemon that decides exports
   * reads it: one node's, or across nodes the root's. */
  struct job_departure *departed;
  uint64_t departures; /* numbers them in the order they happened */
  /* Its consumers (consumer.c): [nconsumers], NULL where not joined; the
   * consumers that left and have not joined again, as departed for ranks;
   * the files their buffers lie in (their memory ids). */
  uint32_t nconsumers;
  struct job_consumer **consumers;
  struct job_departure *consumer_departed;
  struct consumer_files consumer_files;
  /* The running push (push.c), its last plan, and the pushes so far. */
  struct push *pushing;
  struct push_cache push_cache;
  uint64_t last_push_id;
  uint64_t pushes;     /* finished, delivered or failed */
  uint64_t push_plans; /* plans built for them */
  /* A job that may span nodes (mesh.c), or NULL. */
  struct mesh *mesh;
  /* A job on GPUs across nodes (daemon/cuda/gpu.h, docs/gpu.md): the NCCL
   * unique id its root made (in its ticket), and this node's
   * communicators, made by the first export and kept for the next ones
   * (an export that fails aborts them, and the job cannot export again). */
  bool has_nccl_id;
  uint8_t nccl_id[GPU_NCCL_ID_BYTES];
  struct gpu_comms *gpu_comms;
  uint64_t gpu_comms_gen; /* the generation they were made for */
  /* Where the communicators are in their life (comms.c): started as the
   * ranks join, then the exports'. */
  enum comms_state comms_state;
  uv_timer_t tick;
  uv_async_t wake;
  int open_handles;
  bool ticking;
  bool dying;
};

/* Handlers of the dispatch table (ops.c): they reply themselves. */
int job_op_create(struct conn *c, const struct sp_msg_head *head,
                  const msgpack_object *map, struct sp_frame *frame);
int job_op_join(struct conn *c, const struct sp_msg_head *head,
                const msgpack_object *map, struct sp_frame *frame);
int job_op_leave(struct conn *c, const struct sp_msg_head *head,
                 const msgpack_object *map, struct sp_frame *frame);
/* The connection of member closed: the job notices on its next wake-up. */
void job_conn_closed(struct job_member *member);
/* Ends every job at shutdown, after the connections closed. */
void job_shutdown(struct server *srv);
/* Runs the job's state machine soon, from the loop (never re-entered). */
void job_wake(struct job *job);
/* Keeps the tick timer running while the job has something to watch. */
void job_schedule(struct job *job);
/* Sends the error reply to a member's pending ask and forgets the ask. */
void job_answer_ask(struct job_member *m, int code, const char *message);
/* "rank R left job J<when>" (or "disconnected from"), then "; <reason>"
 * when there is one: how every daemon names a rank that left. */
void job_departure_text(const struct job *job, uint32_t rank,
                        bool disconnected, const char *when,
                        const char *reason, char *buf, size_t len);
/* Rank left the job (reason: why, when its daemon knows, or NULL): every
 * export asked for until it joins again fails at once, naming it. */
void job_rank_departed(struct job *job, uint32_t rank, bool disconnected,
                       const char *reason);
/* Rank joined (again): exports no longer wait in vain for it. */
void job_rank_returned(struct job *job, uint32_t rank);
/* Whether a rank left and has not joined again: then buf says so, naming
 * the first of them to leave (the cause; ranks that left after hearing of
 * it are not) and why; the one sentence the exports asked for fail with. */
bool job_departed(const struct job *job, char *buf, size_t len);
/* The jobs array of the status reply. */
void job_status_pack(const struct server *srv, msgpack_packer *pk);
/* One job map of the status reply (docs/protocol.md), its header counting
 * extra more pairs that the caller packs after it. */
void job_pack(const struct job *job, msgpack_packer *pk, uint32_t extra);
/* Ranks joined now, and of those the ones waiting for the next export. */
void job_count_ranks(const struct job *job, uint32_t *joined,
                     uint32_t *asked);
void job_set_owner(struct job *job, const struct peer *peer);
/* Ends the job for good (an abort, the daemon stopping): its running
 * export and its waiting ranks fail with code and message, every rank's
 * connection is ended with them (conn_finish), and the job is freed once
 * no thread uses it.  On the root of a job across nodes, every other node
 * ends it too, its ranks with the same code and message. */
void job_terminate(struct job *job, int code, const char *message);
/* For jobs across nodes (mesh.c): the next job of an id after prev (NULL:
 * the first), or NULL (an id names one job, but shadows of tickets that
 * name it with different secrets may coexist until their roots refuse
 * them); a new job of that id and secret (a shadow of a job rooted on
 * another daemon); a rank admitted after the root said so (replies to the
 * join; NULL when out of memory, nothing replied); a rank joined elsewhere
 * (the job no longer waits for a first rank); the job's end, as soon as no
 * export runs. */
struct job *job_find(const struct server *srv, const struct job *prev,
                     const uint8_t *id);
/* The job a ticket names on this daemon (its id and secret), or NULL. */
struct job *job_find_ticket(const struct server *srv,
                            const struct req_ticket *t);
struct job *job_new(struct server *srv, const uint8_t *id,
                    const uint8_t *secret, uint32_t world);
/* Gives a new job its n consumers' places: 0, or SP_ENOMEM. */
int job_set_consumers(struct job *job, uint32_t n);
struct job_member *job_admit(struct job *job, struct conn *c,
                             uint64_t request_id, const struct req_join *req,
                             int device);
void job_note_joined(struct job *job);
void job_end(struct job *job);

#endif /* SP_DAEMON_JOB_H */
