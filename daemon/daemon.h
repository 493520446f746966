/*
 * daemon.h - shardportd's internal interfaces, one section per file.
 *
 * Nothing here is public; the daemon's only interface to the world is the
 * socket protocol in docs/protocol.md.  Functions carry their file's name as
 * prefix (config_load is in config.c); everything else is static there.
 */
#ifndef SP_DAEMON_H
#define SP_DAEMON_H

#include <msgpack.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <sys/types.h>
#include <sys/un.h>
#include <uv.h>

#include "daemon/plan/plan.h"
#include "proto/frame.h"
#include "proto/limits.h"
#include "proto/msg.h"

/* ---- log.c ------------------------------------------------------------ */

/* The values are syslog priorities, so they double as the journal prefix. */
enum log_level {
  LOG_LEVEL_ERROR = 3,
  LOG_LEVEL_WARN = 4,
  LOG_LEVEL_INFO = 6,
  LOG_LEVEL_DEBUG = 7,
};

/* Messages above level are dropped.  Detects whether stderr is the journal
 * (JOURNAL_STREAM names it) to choose "<N>" prefixes over plain text. */
void log_init(enum log_level level);
void log_set_level(enum log_level level);
/* The one logging call: one line to stderr. */
void log_msg(enum log_level level, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));
/* "error", "warn", "info", "debug" <-> level; -1 for an unknown name. */
int log_level_parse(const char *name);
const char *log_level_name(enum log_level level);

/* ---- backend.c -------------------------------------------------------- */

enum backend_kind { BACKEND_AUTO, BACKEND_HOST, BACKEND_CUDA };

/* Which backend serves, and why, in words for status and the log. */
struct backend_choice {
  const char *active;
  char reason[128];
};

/* "auto", "host", "cuda" <-> kind; -1 for an unknown name. */
int backend_parse(const char *name);
const char *backend_name(enum backend_kind kind);
/* The backends compiled into this build, in status order. */
extern const char *const backend_built[];
extern const size_t backend_nbuilt;
/* Picks the backend for want; SP_EBACKEND with a reason in err when the
 * requested one cannot serve. */
int backend_select(enum backend_kind want, struct backend_choice *out,
                   char *err, size_t errsize);

/* ---- config.c --------------------------------------------------------- */

#define CONFIG_MAX_UIDS 64
#define CONFIG_DEFAULT_MAX_CLIENTS 1024u
#define CONFIG_DEFAULT_MAX_OUTPUT (32u << 20)
#define CONFIG_DEFAULT_MAX_BYTES (UINT64_C(1) << 30)
#define CONFIG_DEFAULT_EXPORT_TIMEOUT_MS 60000u
#define CONFIG_DEFAULT_JOB_TIMEOUT_MS 300000u
#define CONFIG_DEFAULT_MAX_JOBS 256u

struct config {
  char socket[sizeof(((struct sockaddr_un *)0)->sun_path)];
  /* True when socket is the built-in default (its directory may be made). */
  bool socket_is_default;
  bool socket_group_set;
  gid_t socket_group;
  uid_t allowed_uids[CONFIG_MAX_UIDS];
  size_t nallowed_uids;
  bool allowed_gid_set;
  gid_t allowed_gid;
  enum log_level log_level;
  struct sp_limits limits;
  uint32_t max_clients;
  uint64_t max_output;
  enum backend_kind backend;
  bool watchdog;
  /* Bytes the memory pool may hold; 0 means half the physical memory. */
  uint64_t pool_capacity;
  /* An export's traffic per round when the request names none. */
  uint64_t max_bytes;
  /* How long an export waits for its ranks, and for progress, when the
   * request names no timeout. */
  uint32_t export_timeout_ms;
  /* How long a job may wait for its first rank to join. */
  uint32_t job_timeout_ms;
  uint32_t max_jobs;
  /* Threads copying one export's data; 0 means min(4, online CPUs). */
  uint32_t engine_threads;
};

/* Built-in defaults: root and the daemon's own uid, its own gid. */
void config_default(struct config *cfg);
/*
 * Reads a `key = value` file over cfg.  A missing file is an error when
 * must_exist, else the defaults stand.  On failure returns -1 with a message
 * naming the file and line in err.
 */
int config_load(struct config *cfg, const char *path, bool must_exist,
                char *err, size_t errsize);
/* Sets one key from text, as a config line would: 0, or -1 with err. */
int config_set(struct config *cfg, const char *key, const char *value,
               char *err, size_t errsize);
/* Fills in the default socket path when none was configured: 0, or -1 when
 * none can be derived (not root and no XDG_RUNTIME_DIR). */
int config_resolve_socket(struct config *cfg, char *err, size_t errsize);
/* Prints every key with its effective value, in config file syntax. */
void config_print(const struct config *cfg, FILE *out);

/* ---- listen.c --------------------------------------------------------- */

struct listener {
  int fd;
  /* A socket systemd passed in is systemd's to remove, not ours. */
  bool from_systemd;
  char path[sizeof(((struct sockaddr_un *)0)->sun_path)];
  /* The socket file we made, so that shutdown removes that file only. */
  dev_t dev;
  ino_t ino;
  /* An flock on "<path>.lock", held while the daemon runs, so that two
   * daemons started on one path cannot both decide the socket is stale. */
  int lock_fd;
};

/* Takes the socket from systemd socket activation when there is one, else
 * creates cfg->socket the safe way.  Returns 0 or -1 (logged). */
int listen_open(const struct config *cfg, struct listener *l);
/* Closes the socket and removes its file unless systemd owns it. */
void listen_close(struct listener *l);

/* ---- peer.c ----------------------------------------------------------- */

struct peer {
  pid_t pid;
  uid_t uid;
  gid_t gid;
};

/* Reads the peer's credentials and checks them against the allowed uids and
 * gid (the peer's primary and supplementary groups).  Returns 0 when allowed,
 * SP_EPERM when not, SP_EIO when the credentials cannot be read. */
int peer_check(const struct config *cfg, int sock, struct peer *out);

/* ---- notify.c --------------------------------------------------------- */

/* Thin sd_notify glue; every call is a no-op without systemd or when the
 * daemon was not started by a service manager. */
void notify_ready(const char *status);
void notify_status(const char *status);
void notify_stopping(void);
void notify_watchdog(void);
/* The watchdog interval systemd asked for in microseconds, or 0. */
uint64_t notify_watchdog_usec(void);

/* ---- server.c --------------------------------------------------------- */

struct conn;
struct job;
struct pool;

struct server {
  uv_loop_t *loop;
  const struct config *cfg;
  const struct backend_choice *backend;
  struct listener listener;
  uv_poll_t listen_poll;
  uv_signal_t sig_term;
  uv_signal_t sig_int;
  uv_timer_t watchdog;
  bool watchdog_on;
  bool stopping;
  /* Kept open so that accept() can be answered even at EMFILE. */
  int reserve_fd;
  uint64_t started_ns;
  uint64_t next_conn_id;
  struct conn *conns;
  uint32_t nclients;
  struct job *jobs;
  uint32_t njobs;
  struct pool *pool;
  /* Copying threads per export: engine_threads, resolved. */
  uint32_t engine_threads;
  /* Test seam (docs/operations.md): SHARDPORTD_TEST_ROUND_DELAY_MS makes
   * the engine pause after every round, so tests can act mid-export. */
  uint32_t test_round_delay_ms;
};

/* Listens, serves until SIGTERM/SIGINT and shuts down cleanly.  Returns 0,
 * or -1 when the daemon could not start serving. */
int server_run(const struct config *cfg, const struct backend_choice *backend);

/* ---- conn.c ----------------------------------------------------------- */

/* Takes an accepted, checked, non-blocking socket.  Returns 0 or a negative
 * code (the socket is then closed). */
int conn_open(struct server *srv, int sock, const struct peer *peer);
/* Closes the connection at once, dropping unsent replies, and takes it off
 * the server's list. */
void conn_close(struct conn *c);
/* Queues a complete reply (the conn takes tx and its buffer). */
int conn_send(struct conn *c, struct sp_frame_tx *tx);
/* Queues an error reply.  Returns 0 or a negative code. */
int conn_send_error(struct conn *c, uint64_t id, int code, const char *fmt,
                    ...) __attribute__((format(printf, 4, 5)));
/* Finishes mb and queues it. */
int conn_send_msgbuf(struct conn *c, struct sp_msgbuf *mb);
struct server *conn_server(const struct conn *c);

struct job_member;
/* The job rank this connection joined as, or NULL. */
struct job_member *conn_member(const struct conn *c);
void conn_set_member(struct conn *c, struct job_member *member);
/* Bytes of replies the connection may still queue before max_output. */
uint64_t conn_output_room(const struct conn *c);
/* Calls fn(c, arg) whenever a write leaves the reply queue at most half
 * full, until set to NULL: how long replies are streamed without letting
 * them pile up past max_output. */
void conn_on_drained(struct conn *c, void (*fn)(struct conn *c, void *arg),
                     void *arg);

/* ---- idxset.c --------------------------------------------------------- */

/* A set of indices into the caller's array, looked up by a 64-bit hash and
 * a match function over the caller's items (sids, base addresses, keys). */
struct idxset {
  uint64_t *slot;
  size_t mask;
  size_t count;
};

#define IDXSET_NONE UINT32_MAX

typedef bool (*idxset_match)(const void *ctx, uint32_t idx);

void idxset_init(struct idxset *s);
void idxset_free(struct idxset *s);
/* Makes room for more insertions: 0 or SP_ENOMEM. */
int idxset_reserve(struct idxset *s, size_t more);
/* The index whose hash is hash and for which match(ctx, index) holds, or
 * IDXSET_NONE. */
uint32_t idxset_find(const struct idxset *s, uint64_t hash,
                     idxset_match match, const void *ctx);
/* Adds idx; room must have been reserved. */
void idxset_insert(struct idxset *s, uint64_t hash, uint32_t idx);
uint64_t idxset_hash_bytes(const void *data, size_t len);
uint64_t idxset_hash_u64(uint64_t v);

/* ---- request.c -------------------------------------------------------- */

/* Bounds from docs/protocol.md, "Jobs". */
#define REQ_MAX_WORLD 65536u
#define REQ_MAX_KEY 1024u
#define REQ_MAX_VALUE ((UINT64_C(1) << 62) - 1)
#define REQ_MAX_PER_RANK 1048576u
#define REQ_MAX_DEVICE 64u
#define REQ_MAX_TIMEOUT_MS 86400000u

#define JOB_ID_BYTES 16
#define JOB_SECRET_BYTES 16

struct req_job_create {
  uint32_t world;
};

struct req_join {
  const uint8_t *ticket; /* into the frame */
  size_t ticket_len;
  uint32_t rank;
  uint32_t world;
  uint32_t device_type; /* enum sp_device_type */
  char device[REQ_MAX_DEVICE + 1];
};

/* What a ticket holds (docs/protocol.md, "job_create"). */
struct req_ticket {
  uint8_t job[JOB_ID_BYTES];
  uint8_t secret[JOB_SECRET_BYTES];
  uint32_t world;
};

struct req_storage {
  uint32_t sid;
  uint32_t fd; /* index among the frame's descriptors */
  uint64_t offset;
  uint64_t length;
  uint64_t base;
};

struct req_tensor {
  const char *key; /* into the frame, not terminated */
  size_t key_len;
  uint32_t sid;
  struct sp_view view;
  enum plan_placement placement;
  uint32_t ndim; /* of the global shape */
  int64_t shape[SP_MAX_DIMS];
  size_t npieces;
  struct affine_piece *pieces; /* one block with the holders; owned */
};

/* Together-groups: names in one blob (each ended by NUL, each group by an
 * empty name) that plan_group arrays point into; the blob's bytes compare
 * equal exactly when the groups are the same list. */
struct req_groups {
  size_t ngroups;
  struct plan_group *groups;
  const char **names;
  char *blob;
  size_t blob_len;
};

struct req_export {
  uint32_t max_keys;   /* 0: the planner's default */
  uint64_t max_bytes;  /* 0: the daemon's default */
  uint32_t timeout_ms; /* 0: the daemon's default */
  bool progress;
  struct req_groups groups;
};

/* Each returns 0, or a negative code with a sentence in msg naming the
 * field.  Arrays come back malloc'ed; free them with the matching call. */
int request_parse_job_create(const msgpack_object *map,
                             struct req_job_create *out, char *msg,
                             size_t msglen);
int request_parse_join(const msgpack_object *map, struct req_join *out,
                       char *msg, size_t msglen);
/* A ticket's bytes, decoded with the bounded decoder: 0 or SP_ETICKET. */
int request_parse_ticket(const uint8_t *data, size_t len,
                         const struct sp_limits *limits,
                         struct req_ticket *out);
/* "cpu" or "cuda:<GPU UUID>": 0 and the device type, or SP_EINVAL. */
int request_parse_device(const char *s, size_t len, uint32_t *type);
/* nfds: the descriptors the frame carries (each storage names one). */
int request_parse_storages(const msgpack_object *map, size_t nfds,
                           struct req_storage **out, size_t *n, char *msg,
                           size_t msglen);
int request_parse_tensors(const msgpack_object *map, struct req_tensor **out,
                          size_t *n, char *msg, size_t msglen);
void request_tensors_free(struct req_tensor *t, size_t n);
int request_parse_export(const msgpack_object *map, struct req_export *out,
                         char *msg, size_t msglen);
void request_groups_free(struct req_groups *g);
int request_parse_release(const msgpack_object *map, uint64_t *export_id,
                          char *msg, size_t msglen);
/* UTF-8 without NUL bytes, overlong forms or surrogates. */
bool request_utf8_valid(const char *s, size_t len);

/* ---- registry.c ------------------------------------------------------- */

/* What the daemon keeps of a storage besides the planner's sp_storage. */
struct reg_storage {
  uint32_t sid;
  void *map; /* the read-only mapping, page-aligned; NULL when empty */
  size_t map_len;
  const uint8_t *data; /* the storage's first byte */
};

/* One rank's registrations, in the planner's form.  Used from the loop
 * thread, and read (never changed) by an engine while an export runs. */
struct registry {
  uint32_t device_type; /* the rank's device, declared at join */
  size_t nstorages;
  size_t storage_cap_s, storage_cap_i;
  struct sp_storage *storages;
  struct reg_storage *info;
  struct idxset by_sid;
  struct idxset by_base;
  size_t nkeys, key_cap;
  struct plan_key_in *keys; /* names and pieces owned */
  struct idxset by_name;
};

void registry_init(struct registry *reg, uint32_t device_type);
/* Unmaps every storage and frees everything. */
void registry_free(struct registry *reg);
/* Maps and registers n storages whose fds are frame's (the frame keeps
 * them); all or none.  SP_EBADFD, SP_EINVAL, SP_ELIMIT, SP_ENOMEM. */
int registry_add_storages(struct registry *reg, const struct req_storage *s,
                          size_t n, const struct sp_frame *frame, char *msg,
                          size_t msglen);
/* Checks and registers n tensors; all or none.  On success each tensor's
 * pieces belong to the registry (t[i].pieces is NULL). */
int registry_add_tensors(struct registry *reg, struct req_tensor *t, size_t n,
                         char *msg, size_t msglen);
/* The storage index of sid, or IDXSET_NONE. */
uint32_t registry_find_sid(const struct registry *reg, uint32_t sid);
/* The rank's part of a plan_input, pointing into reg (no groups). */
void registry_rank_in(const struct registry *reg, uint32_t rank,
                      struct plan_rank_in *out);

/* ---- engine.c --------------------------------------------------------- */

struct engine_item;

/* One run of a plan's rounds.  The caller fills the inputs; the engine's
 * threads write only the segments, the progress atomics and the result. */
struct engine {
  const struct plan *plan;
  const struct reg_storage *const *src; /* [world]: each rank's storages */
  uint8_t *const *dst;                  /* [world]: owner's segment */
  const uint64_t *dst_size;             /* [world] */
  const uint64_t *key_offset;           /* [nkeys]: publish_layout offsets */
  uint32_t threads;                     /* copying threads, at least 1 */
  uint32_t round_delay_ms;              /* test seam */
  /* Called from the engine thread when a round starts and when it ends. */
  void (*notify)(void *arg);
  void *notify_arg;
  _Atomic uint32_t round; /* 1-based; 0 before the first */
  _Atomic uint64_t bytes_moved;
  _Atomic bool cancel;
  _Atomic bool done;
  /* Valid once done: 0, or a code and a sentence naming key and ranks. */
  int rc;
  char msg[SP_ERRMSG_MAX + 1];
  pthread_t thread;
  /* The current round's work, shared by its copying threads. */
  struct engine_item *items;
  size_t nitems;
  _Atomic size_t next_item;
  _Atomic bool failed;
  pthread_mutex_t fail_lock;
};

/* Runs every round from the calling thread (with e->threads - 1 helpers);
 * returns e->rc. */
int engine_run(struct engine *e);
/* Runs engine_run on a new thread, which sets done and notifies at the
 * end; 0 or SP_ENOMEM. */
int engine_start(struct engine *e);
void engine_join(struct engine *e);
/* pthread_create with the asynchronous signals blocked in the thread. */
int engine_spawn(pthread_t *thread, void *(*fn)(void *), void *arg);

/* ---- publish.c -------------------------------------------------------- */

#define PUBLISH_ALIGN 256u
#define PUBLISH_IDENTITY UINT64_MAX

struct publish_layout {
  uint32_t world;
  size_t nkeys;
  uint64_t *offset;    /* [nkeys]: byte offset in the owner's segment, or
                          PUBLISH_IDENTITY */
  uint64_t *seg_size;  /* [world]: 0 when the rank needs no segment */
  size_t *owned_first; /* [world + 1] */
  uint32_t *owned;     /* keys by owner, each owner's in name order */
};

int publish_layout_build(const struct plan *plan, struct publish_layout *out);
void publish_layout_free(struct publish_layout *l);
/* Cuts rank's owned keys into parts whose frames pass a peer's wire check
 * with frame_limit and max_items (sp_limits: items per container, and twice
 * that in the whole frame): part i lists owned[(*first)[i] ..
 * (*first)[i + 1]) (the last up to owned_first[rank + 1]).  There is always
 * at least one part. */
int publish_parts(const struct plan *plan, const struct publish_layout *l,
                  uint32_t rank, uint64_t frame_limit, uint32_t max_items,
                  size_t **first, size_t *nparts);
/* Packs one part of rank's export reply; owner is rank's registry (for
 * identity tensors' sids). */
void publish_pack(const struct plan *plan, const struct publish_layout *l,
                  const struct registry *owner, uint32_t rank,
                  uint64_t request_id, uint64_t export_id, size_t part,
                  size_t nparts, size_t first, size_t end,
                  struct sp_msgbuf *mb);

/* ---- job.c ------------------------------------------------------------ */

enum job_phase {
  JOB_WAITING,    /* for ranks to join and to ask for an export */
  JOB_PLANNING,   /* plan_build on a worker thread */
  JOB_MOVING,     /* the engine runs the rounds */
  JOB_PUBLISHING, /* replies streaming to the owners */
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
  /* The rank asked for the next export and waits for its reply. */
  bool asked;
  uint64_t ask_id;
  uint64_t ask_deadline_ms;
  struct req_export ask;
  /* Part of the running export. */
  bool in_export;
  /* Left or disconnected; freed once no export uses its storages. */
  bool lost;
  bool lost_handled; /* export_member_lost ran for it */
  bool disconnected;
  struct job_published *published;
};

struct export;

struct job {
  struct server *srv;
  struct job *next;
  uint8_t id[JOB_ID_BYTES];
  uint8_t secret[JOB_SECRET_BYTES];
  char hex[2 * JOB_ID_BYTES + 1];
  uint32_t world;
  uint32_t joined;
  bool ever_joined;
  struct job_member **members; /* [world], NULL where not joined */
  uint64_t next_export_id;
  struct export *running;
  /* The outcome of the last export, for status. */
  enum job_phase last_phase;
  char error[SP_ERRMSG_MAX + 1];
  uint32_t last_round, last_rounds;
  uint64_t last_bytes_moved, last_bytes_total;
  double rate_bps;
  /* The last plan and its layout, reused by an export with the same
   * registrations, groups and options (export.c). */
  struct plan *cached_plan;
  struct publish_layout cached_layout;
  uint64_t cached_max_bytes;
  uint32_t cached_max_keys;
  char **cached_groups; /* [world] group blobs */
  size_t *cached_groups_len;
  /* Registrations or members changed while an export used the cache. */
  bool cache_stale;
  uv_timer_t tick;
  uv_async_t wake;
  int open_handles;
  bool ticking;
  bool dying;
};

/* Handlers of the dispatch table (conn.c): they reply themselves. */
int job_op_create(struct conn *c, const struct sp_msg_head *head,
                  const msgpack_object *map, struct sp_frame *frame);
int job_op_join(struct conn *c, const struct sp_msg_head *head,
                const msgpack_object *map, struct sp_frame *frame);
int job_op_leave(struct conn *c, const struct sp_msg_head *head,
                 const msgpack_object *map, struct sp_frame *frame);
int job_op_storage_add(struct conn *c, const struct sp_msg_head *head,
                       const msgpack_object *map, struct sp_frame *frame);
int job_op_tensor_add(struct conn *c, const struct sp_msg_head *head,
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
uint64_t job_now_ms(void);
/* The jobs array of the status reply. */
void job_status_pack(const struct server *srv, msgpack_packer *pk);

/* ---- export.c --------------------------------------------------------- */

int export_op_request(struct conn *c, const struct sp_msg_head *head,
                      const msgpack_object *map, struct sp_frame *frame);
int export_op_release(struct conn *c, const struct sp_msg_head *head,
                      const msgpack_object *map, struct sp_frame *frame);
/* Advances the job's exports: starts one when every rank asked, moves a
 * running one on when its thread finished, fails them for lost ranks. */
void export_advance(struct job *job);
/* Periodic work: gather deadlines, stalls, progress frames, the rate. */
void export_tick(struct job *job);
/* A member is lost (left or disconnected): fails what it takes part in. */
void export_member_lost(struct job *job, struct job_member *m);
/* Whether an export runs: its thread may read the members' storages and
 * its plan borrows their registrations, so members are freed only after. */
bool export_busy(const struct job *job);
/* Frees the cached plan (registrations or members changed). */
void export_drop_cache(struct job *job);
/* Progress and phase of the job for status. */
struct export_view {
  enum job_phase phase;
  uint64_t export_id;
  uint32_t round, rounds;
  uint64_t bytes_moved, bytes_total;
  double rate_bps;
  uint64_t pool_used;
};
void export_view(const struct job *job, struct export_view *out);
const char *export_phase_name(enum job_phase phase);

/* ---- status.c --------------------------------------------------------- */

/* Builds the status reply for request id into mb. */
void status_pack(const struct server *srv, uint64_t id, struct sp_msgbuf *mb);

#endif /* SP_DAEMON_H */
