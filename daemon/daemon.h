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
#include <sys/socket.h>
#include <sys/types.h>
#include <sys/un.h>
#include <uv.h>

#include "daemon/cuda/gpu.h"
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
/* The one logging call: one line to stderr, or one journal entry. */
void log_msg(enum log_level level, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));
/* What a line is about, as journal fields (log.c): a job's line carries
 * them so that `journalctl SHARDPORT_JOB=ID` finds it.  LOG_NONE, NULL or
 * 0 leaves a field out. */
#define LOG_NONE (-1)
struct log_fields {
  const char *job; /* SHARDPORT_JOB: the job's id in hex */
  int64_t rank;    /* SHARDPORT_RANK */
  int64_t node;    /* SHARDPORT_NODE: the job's node on this daemon */
  uint64_t export_id; /* SHARDPORT_EXPORT */
  int error;       /* SHARDPORT_ERROR: the code's wire name */
};
/* A job's fields: rank and node LOG_NONE, no export, no error. */
#define LOG_JOB(hex) \
  (&(struct log_fields){.job = (hex), .rank = LOG_NONE, .node = LOG_NONE})
void log_with(enum log_level level, const struct log_fields *f,
              const char *fmt, ...) __attribute__((format(printf, 3, 4)));
/* An event that may repeat as fast as the loop turns (an accept failing at
 * EMFILE, links dropped at a cap) is logged with log_limited: at most one
 * line per LOG_LIMIT_MS, which says how many were not logged since the
 * last.  Zero-initialise one per event. */
#define LOG_LIMIT_MS 1000u
struct log_limit {
  bool logged;
  uint64_t last_ms;
  uint64_t suppressed;
};
void log_limited(struct log_limit *lim, enum log_level level,
                 const char *fmt, ...) __attribute__((format(printf, 3, 4)));
/* "error", "warn", "info", "debug" <-> level; -1 for an unknown name. */
int log_level_parse(const char *name);
const char *log_level_name(enum log_level level);

/* ---- backend.c -------------------------------------------------------- */

enum backend_kind { BACKEND_AUTO, BACKEND_HOST, BACKEND_CUDA };

/* Which backend serves, and why, in words for status and the log. */
struct backend_choice {
  const char *active;
  char reason[512];
  /* The CUDA backend when it serves (daemon/cuda/gpu.h), else NULL. */
  struct gpu *gpu;
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
/* Releases what backend_select loaded (the CUDA backend). */
void backend_release(struct backend_choice *choice);

/* ---- config.c --------------------------------------------------------- */

#define CONFIG_MAX_UIDS 64
#define CONFIG_DEFAULT_MAX_CLIENTS 1024u
#define CONFIG_DEFAULT_MAX_OUTPUT (32u << 20)
#define CONFIG_DEFAULT_MAX_BYTES (UINT64_C(1) << 30)
#define CONFIG_DEFAULT_EXPORT_TIMEOUT_MS 60000u
#define CONFIG_DEFAULT_JOB_TIMEOUT_MS 300000u
#define CONFIG_DEFAULT_MAX_JOBS 256u
/* Per user and per client (quota.c, docs/operations.md "Quotas"). */
#define CONFIG_DEFAULT_MAX_USER_JOBS 64u
#define CONFIG_DEFAULT_MAX_USER_REGISTRATIONS (UINT64_C(1) << 23)
#define CONFIG_DEFAULT_MAX_USER_REGISTRATION_BYTES (UINT64_C(1) << 30)
#define CONFIG_DEFAULT_MAX_USER_MAPPINGS 32768u
#define CONFIG_DEFAULT_MAX_CLIENT_MAPPINGS 8192u
/* A sixteenth of x86-64's 128 TiB of user address space. */
#define CONFIG_DEFAULT_MAX_USER_MAPPED_BYTES (UINT64_C(8) << 40)
#define CONFIG_DEFAULT_PEER_TIMEOUT_MS 10000u
#define CONFIG_DEFAULT_PEER_HANDSHAKES 64u
#define CONFIG_DEFAULT_DRAIN_TIMEOUT_MS 60000u
#define CONFIG_DEFAULT_EXPORT_HISTORY 8u
#define CONFIG_MAX_EXPORT_HISTORY 256u
/* Scrapers of the metrics endpoint connected at once (metrics_http.c). */
#define CONFIG_DEFAULT_METRICS_CONNECTIONS 64u
#define CONFIG_MAX_METRICS_CONNECTIONS 1024u
/* "addr:port" of a daemon, numeric (IPv6 in brackets), with its NUL. */
#define NODE_ADDR_MAX 64

struct config {
  /* The configuration file config_load was given (NULL before), and
   * whether it was there to read. */
  const char *file;
  bool file_read;
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
  /* Device bytes the pool may hold per GPU; 0 means as much as it has. */
  uint64_t gpu_pool_capacity;
  /* An export's traffic per round when the request names none. */
  uint64_t max_bytes;
  /* How long an export waits for its ranks, and for progress, when the
   * request names no timeout. */
  uint32_t export_timeout_ms;
  /* How long a job may wait for its first rank to join. */
  uint32_t job_timeout_ms;
  uint32_t max_jobs;
  /* What one uid may hold: jobs it created, registrations of its ranks
   * (storages and tensors, their bytes), host mappings and the address
   * space they take; and the host mappings of one client (quota.c). */
  uint32_t max_user_jobs;
  uint64_t max_user_registrations;
  uint64_t max_user_registration_bytes;
  uint32_t max_user_mappings;
  uint32_t max_client_mappings;
  uint64_t max_user_mapped_bytes;
  /* Threads copying one export's data; 0 means min(4, online CPUs). */
  uint32_t engine_threads;
  /* Read and compare every rank's copy of replicated and plain keys
   * before an export moves (replicas.c). */
  bool compare_replicas;
  /* How long a stopping daemon lets running exports finish (drain.c). */
  uint32_t drain_timeout_ms;
  /* Finished exports each job keeps for status (history.c). */
  uint32_t export_history;
  /* Jobs across nodes: where this daemon listens for other daemons (off
   * unless set), and the address they dial (default: the listen address;
   * a port of 0 in either means the port the kernel gives). */
  bool peer_listen_set;
  char peer_listen[NODE_ADDR_MAX];
  struct sockaddr_storage peer_listen_addr;
  socklen_t peer_listen_len;
  bool peer_advertise_set;
  char peer_advertise[NODE_ADDR_MAX];
  struct sockaddr_storage peer_advertise_addr;
  /* How long a link to another daemon may take to connect and prove who
   * it is, and how long a node waits for the root's answer to a join. */
  uint32_t peer_timeout_ms;
  /* Links accepted from other daemons that have not yet proved who they
   * are, at most (nodelink.c). */
  uint32_t peer_handshakes;
  /* Where GET /metrics is served (off unless set; docs/operations.md,
   * "Monitoring"), and how many scrapers may be connected at once. */
  bool metrics_listen_set;
  char metrics_listen[NODE_ADDR_MAX];
  struct sockaddr_storage metrics_listen_addr;
  uint32_t metrics_connections;
};

/* Built-in defaults: root and the daemon's own uid, its own gid. */
void config_default(struct config *cfg);
/*
 * Reads a `key = value` file over cfg and notes it (cfg->file, file_read).
 * A missing file is an error when must_exist, else the defaults stand.  On
 * failure returns -1 with a message naming the file and line in err.
 */
int config_load(struct config *cfg, const char *path, bool must_exist,
                char *err, size_t errsize);
/* Sets one key from text, as a config line would: 0, or -1 with err. */
int config_set(struct config *cfg, const char *key, const char *value,
               char *err, size_t errsize);
/* Fills in the default socket path when none was configured: 0, or -1 when
 * none can be derived (not root and no XDG_RUNTIME_DIR). */
int config_resolve_socket(struct config *cfg, char *err, size_t errsize);
/* Prints every key with its effective value, in config file syntax, after
 * a comment naming the file read. */
void config_print(const struct config *cfg, FILE *out);
/* The file read, for the start log, -n and --print-config: its path, or
 * "none (PATH does not exist; built-in defaults)". */
void config_describe_file(const struct config *cfg, char *buf, size_t len);
/* Checks what no single key can (peer_listen on a wildcard address needs
 * peer_advertise): 0, or -1 with err. */
int config_check(const struct config *cfg, char *err, size_t errsize);

/* Where the daemon's settings come from, lowest first: the built-in
 * defaults, the file, SHARDPORT_SOCKET (the socket only), the flags.  Kept
 * for the daemon's life, so that a reload (SIGHUP) layers them alike. */
#define CONFIG_MAX_FLAGS 8
struct config_origin {
  const char *path;
  bool must_exist;
  struct config_flag {
    const char *key;
    const char *value;
  } flags[CONFIG_MAX_FLAGS];
  size_t nflags;
};

#define CONFIG_EFILE (-1) /* the file, the environment or a cross-check */
#define CONFIG_EFLAG (-2) /* a flag's value */
/* Builds cfg from o: 0, or CONFIG_EFILE or CONFIG_EFLAG with err. */
int config_build(const struct config_origin *o, struct config *cfg, char *err,
                 size_t errsize);

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
/* What listen_open would refuse about cfg->socket's directory, without
 * making it (`shardportd -n`): 0, or -1 with what to do in err. */
int listen_check(const struct config *cfg, char *err, size_t errsize);

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
/* STOPPING=1 with a status line, and how long the stop may still take
 * (EXTEND_TIMEOUT_USEC), so that a drain longer than the unit's
 * TimeoutStopSec is not cut short. */
void notify_stopping(const char *status, uint64_t extend_usec);
/* RELOADING=1 (with MONOTONIC_USEC) as a reload starts; notify_ready when
 * it is done. */
void notify_reloading(void);
void notify_watchdog(void);
/* The watchdog interval systemd asked for in microseconds, or 0. */
uint64_t notify_watchdog_usec(void);

/* ---- detach.c --------------------------------------------------------- */

/* `--detach`: forks; the parent exits once the child is ready (printing
 * its pid) or with the child's status when it exits first.  Returns 0 in
 * the child (in a session of its own, stdin and stdout on /dev/null), or
 * -1 when it cannot fork.  Call before anything starts threads or CUDA. */
int detach_start(void);
/* Tells a waiting parent the daemon serves; a no-op when not detached. */
void detach_ready(void);

/* ---- server.c --------------------------------------------------------- */

struct conn;
struct job;
struct pool;
struct metrics;
struct metrics_http;

/* Who reads the loop's longest iteration (loopwatch.c): each reader's
 * window runs from its own previous read. */
enum loopwatch_window {
  LOOPWATCH_STATUS,  /* status loop_max_busy_us */
  LOOPWATCH_METRICS, /* shardport_loop_max_busy_seconds */
  LOOPWATCH_WINDOWS
};

struct server {
  uv_loop_t *loop;
  /* The running configuration (a reload changes what may change live)
   * and where it came from. */
  struct config *cfg;
  const struct config_origin *origin;
  const struct backend_choice *backend;
  struct listener listener;
  uv_poll_t listen_poll;
  uv_signal_t sig_term;
  uv_signal_t sig_int;
  uv_signal_t sig_hup;
  uv_timer_t watchdog;
  bool watchdog_on;
  /* Stopping (drain.c): draining refuses new work while the running
   * exports finish, until drain_deadline_ms; stopping closes everything. */
  bool draining;
  bool drain_expired;
  char stop_reason[16];
  uv_timer_t drain_timer;
  uint64_t drain_deadline_ms;
  bool stopping;
  /* Kept open so that accept() can be answered even at EMFILE. */
  int reserve_fd;
  struct log_limit accept_log;
  uint64_t started_ns;
  uint64_t next_conn_id;
  struct conn *conns;
  uint32_t nclients;
  struct job *jobs;
  uint32_t njobs;
  /* What each user holds (quota.c). */
  struct quota_user *users;
  struct pool *pool;
  uv_poll_t pool_poll; /* the pool's inotify descriptor */
  bool pool_poll_on;
  /* Copying threads per export: engine_threads, resolved. */
  uint32_t engine_threads;
  /* Test seam (docs/operations.md): SHARDPORTD_TEST_ROUND_DELAY_MS makes
   * the engine pause after preparing the pool and after every round, so
   * tests can act mid-export. */
  uint32_t test_round_delay_ms;
  /* Test seam: SHARDPORTD_TEST_DIGEST_XOR flips bits of the plan digests
   * this daemon reports to a job's root, to test the mismatch path. */
  uint64_t test_digest_xor;
  /* Test seam: SHARDPORTD_TEST_WORKER_GATE names a FIFO that holds each
   * large frame on a worker, before its decoding and each later step,
   * until a test opens and closes it, so tests can end a connection or job
   * while a frame is there; NULL when unset. */
  const char *test_worker_gate;
  /* Other daemons (nodelink.c): the peer listener (-1 when peer_listen is
   * off), the address they dial, this daemon's random id among them, and
   * the links not yet closed. */
  int peer_fd;
  uv_poll_t peer_poll;
  char peer_address[NODE_ADDR_MAX];
  uint64_t node_id;
  uint64_t next_link_id;
  struct nodelink *links;
  /* Accepted links that have not proved who they are, and the most there
   * may be (peer_handshakes, at most a quarter of the descriptor limit). */
  uint32_t peer_unidentified;
  uint32_t peer_handshake_cap;
  /* Room to choose a link to drop among peer_handshake_cap (nodelink.c). */
  struct peerhost_entry *peer_evict_scratch;
  struct log_limit peer_accept_log, peer_evict_log;
  /* The loop's iterations (loopwatch.c): when the last one ended, the
   * loop's idle time then, and the longest busy time in each window: since
   * the last status, and since the last scrape. */
  uv_check_t loop_check;
  uint64_t loop_last_ns, loop_last_idle_ns;
  uint64_t loop_max_busy_ns[LOOPWATCH_WINDOWS];
  /* What Prometheus scrapes (daemon/metrics.h): the counters, always; the
   * HTTP endpoint when metrics_listen is set, and the async handle its
   * thread asks the loop for fresh gauges with. */
  struct metrics *metrics;
  struct metrics_http *metrics_http;
  uv_async_t metrics_async;
};

/* Listens, serves until SIGTERM/SIGINT (drained, drain.c) and shuts down
 * cleanly; SIGHUP reloads cfg from origin (reload.c).  Returns 0, or -1
 * when the daemon could not start serving. */
int server_run(const struct config_origin *origin, struct config *cfg,
               const struct backend_choice *backend);
/* Closes the listener, the signals and every connection and ends every
 * job: each connection is sent a last error of code with the reason, and
 * each rank of a job job_code (conn_finish), unless at_once, which closes
 * them without a word.  The loop then ends once every handle closed. */
void server_stop(struct server *srv, bool at_once, int job_code, int code,
                 const char *why);
/* At EMFILE: takes one waiting connection off listen_fd with the spare
 * descriptor and closes it, so that the listener stops being readable;
 * false when no spare descriptor could be had. */
bool server_shed(struct server *srv, int listen_fd);
/* engine_threads resolved: 0 means min(4, online CPUs). */
uint32_t server_engine_threads(const struct config *cfg);

/* ---- drain.c ---------------------------------------------------------- */

/* SIGTERM or SIGINT (why): the daemon refuses new work, fails the exports
 * still gathering asks, lets the running exports finish within
 * drain_timeout, then stops.  A second signal stops at once. */
void drain_begin(struct server *srv, const char *why);
/* Answers a request that would start new work with daemon_stopping while
 * the daemon drains: true when it did (the request is done). */
bool drain_refuse(struct server *srv, struct conn *c, uint64_t id,
                  const char *op);

/* ---- reload.c --------------------------------------------------------- */

/* SIGHUP: reads the configuration again from srv->origin and applies the
 * keys that may change live; logs which keys changed, which took effect
 * and which need a restart.  A configuration that does not load changes
 * nothing. */
void reload_run(struct server *srv);

/* ---- loopwatch.c ------------------------------------------------------ */

/* Starts timing the loop's iterations; before the loop runs. */
void loopwatch_start(struct server *srv);
/* Closes the watch; with the server's other handles. */
void loopwatch_stop(struct server *srv);
/* The longest iteration's busy time, in nanoseconds, since the last call
 * for the same window; starts a new one.  The windows are independent: a
 * status does not shorten a scrape's, nor a scrape a status's. */
uint64_t loopwatch_take_max_ns(struct server *srv, enum loopwatch_window w);

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
/* The peer's uid, as SO_PEERCRED gave it. */
uid_t conn_uid(const struct conn *c);
/* The peer's credentials, read when it connected (SO_PEERCRED). */
const struct peer *conn_peer(const struct conn *c);
/* The next of the server's open connections (srv->conns first), or NULL. */
struct conn *conn_next(const struct conn *c);
/* Ends the connection with a last error reply of id 0 (docs/protocol.md,
 * "Connections the daemon ends"): nothing more is read, the queued replies
 * and this one are written (or the drain timeout passes), then it closes.
 * A rank on it leaves its job as if it had disconnected. */
void conn_finish(struct conn *c, int code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
/* The connection's number, and the open connection of that number (NULL
 * once it closed): a reference that cannot dangle. */
uint64_t conn_id(const struct conn *c);
struct conn *conn_find(const struct server *srv, uint64_t id);

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

/* ---- quota.c ---------------------------------------------------------- */

/* What holds a user's entry: its connections, the jobs it created, its
 * connections' ranks (which hold the registrations). */
enum quota_kind { QUOTA_CLIENT, QUOTA_JOB, QUOTA_RANK, QUOTA_KINDS };

struct quota_user;
struct reg_usage;
struct reg_quota_ops;

/* The entry of uid, made when it has none, held once more by kind: NULL
 * when out of memory. */
struct quota_user *quota_hold(struct server *srv, uid_t uid,
                              enum quota_kind kind);
/* One holder of kind is gone; the entry goes with its last holder. */
void quota_release(struct quota_user *u, enum quota_kind kind);
/* job_create, or a join that makes a shadow, for u, which holds the new job
 * already: 0, or SP_ELIMIT past
 * max_user_jobs with a sentence. */
int quota_job_admit(const struct quota_user *u, char *msg, size_t msglen);
/* The registry quota of a rank of user u (quota_arg is u): max_client_mappings
 * on the registry, the max_user_* bounds on u. */
extern const struct reg_quota_ops quota_registry_ops;
/* A rank's registry is freed: what it held no longer counts for u. */
void quota_unregister(struct quota_user *u, const struct reg_usage *used);
/* The users array of the status reply. */
void quota_status_pack(const struct server *srv, msgpack_packer *pk);

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
/* SipHash-2-4 under a random key of this process (idxset.c says why):
 * the only hashes a table of client-chosen values may use. */
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
/* An NCCL unique id (ncclUniqueId), reserved in version 2 tickets. */
#define NODE_NCCL_ID_BYTES 128

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
  uint32_t version; /* 1, or 2 for a job that may span nodes */
  uint8_t job[JOB_ID_BYTES];
  uint8_t secret[JOB_SECRET_BYTES];
  uint32_t world;
  /* Version 2: the root daemon's peer address ("" in version 1), and the
   * job's NCCL unique id when the root made one. */
  char root[NODE_ADDR_MAX];
  bool has_nccl_id;
  uint8_t nccl_id[NODE_NCCL_ID_BYTES];
};

enum req_storage_kind {
  REQ_STORAGE_MEMFD,    /* a memfd or shm file: fd, offset */
  REQ_STORAGE_CUDA_IPC, /* a CUDA IPC handle of the allocation base: handle */
  REQ_STORAGE_CUDA_FD,  /* a cuMem POSIX descriptor of the allocation: fd */
};

struct req_storage {
  uint32_t sid;
  enum req_storage_kind kind;
  uint32_t fd; /* index among the frame's descriptors (memfd, cuda_fd) */
  uint64_t offset;
  uint64_t length;
  uint64_t base;
  uint8_t handle[GPU_IPC_HANDLE_BYTES]; /* cuda_ipc, decoded */
  /* cuda kinds: "cuda:<GPU UUID>" the storage lives on; "" for the
   * rank's own device. */
  char device[REQ_MAX_DEVICE + 1];
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
  /* 0: an export; else a save (daemon/save.h) whose files hold at most
   * this many bytes of tensors. */
  uint64_t save_limit;
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
/* job_status, job_abort: "job", a job id or a unique prefix of one (1 to
 * 32 hex digits), lowercased into out. */
int request_parse_job_ref(const msgpack_object *map,
                          char out[2 * JOB_ID_BYTES + 1], char *msg,
                          size_t msglen);
/* jobs: "after", a whole job id, or "" when absent. */
int request_parse_jobs(const msgpack_object *map,
                       char after[2 * JOB_ID_BYTES + 1], char *msg,
                       size_t msglen);
/* UTF-8 without NUL bytes, overlong forms or surrogates. */
bool request_utf8_valid(const char *s, size_t len);

/* ---- registry.c ------------------------------------------------------- */

struct registry;

/* What the daemon keeps of a storage besides the planner's sp_storage. */
struct reg_storage {
  uint32_t sid;
  /* The storage's first byte, in a read-only mapping of its file that the
   * registry holds (reg_map, maps[map]); NULL when empty. */
  const uint8_t *data;
  uint32_t map;
  /* A CUDA storage: its opened allocation and device address (gpu.data;
   * data is then NULL: it is not host memory). */
  struct gpu_mapping gpu;
};

/* A read-only mapping of pages of a file, shared by every storage of the
 * registry that lies in it (regmap.c says which pages and why). */
struct reg_map {
  void *addr;      /* the mapping's first byte */
  size_t len;      /* bytes mapped, whole pages */
  uint64_t offset; /* the file offset addr maps, a page boundary */
  uint32_t file;   /* index into the registry's files */
  /* The pages of the storages in it, counted once per storage. */
  uint64_t covered;
};

/* A file the registry maps, known by its identity. */
struct reg_file {
  dev_t dev;
  ino_t ino;
};

/* A registry's mappings in file order: sorted by (file, offset), and for
 * each the mapping that reaches furthest into its file among it and the
 * ones of its file before it, so finding one that holds a range takes one
 * binary search (regmap.c). */
struct reg_place {
  uint64_t offset; /* the mapping's, copied: the sort key with file */
  uint32_t file;
  uint32_t map;   /* index into maps */
  uint32_t reach; /* index into maps */
};

/* What a registry holds, as the quotas count it (docs/operations.md,
 * "Quotas"). */
struct reg_usage {
  uint64_t mappings;      /* host mappings, reg_map */
  uint64_t mapped_bytes;  /* the address space they take */
  uint64_t registrations; /* storages and tensors */
  uint64_t bytes;         /* registration bytes: registry.c's *_cost */
};

/* Bounds on what a registry may take, checked before a frame is kept. */
struct reg_quota_ops {
  /* 0 to let the registry take more, else a code and a sentence. */
  int (*admit)(void *arg, const struct registry *reg,
               const struct reg_usage *more, char *msg, size_t msglen);
  /* The registry took more. */
  void (*charge)(void *arg, const struct reg_usage *more);
  /* The registry gave some back (mappings a larger one replaced). */
  void (*release)(void *arg, const struct reg_usage *less);
};

/* One rank's registrations, in the planner's form.  Used from the loop
 * thread, and read (never changed) by an engine while an export runs. */
struct registry {
  uint32_t device_type; /* the rank's device, declared at join */
  /* For a CUDA rank: the backend and the local ordinal of its GPU, which
   * storages live on unless they name another. */
  struct gpu *gpu;
  int device;
  size_t nstorages;
  size_t storage_cap_s, storage_cap_i;
  struct sp_storage *storages;
  struct reg_storage *info;
  struct idxset by_sid;
  struct idxset by_base;
  size_t nkeys, key_cap;
  struct plan_key_in *keys; /* names and pieces owned */
  struct idxset by_name;
  /* Every mapping made (unmapped with the registry), in file order too,
   * and the files. */
  size_t nmaps, map_cap;
  struct reg_map *maps;
  size_t place_cap;
  struct reg_place *places; /* nmaps of them */
  size_t nfiles, file_cap;
  struct reg_file *files;
  struct idxset by_file;
  struct reg_usage used;
  /* The quotas of the rank's connection and user; NULL: none. */
  const struct reg_quota_ops *quota;
  void *quota_arg;
};

void registry_init(struct registry *reg, uint32_t device_type);
/* Unmaps every storage and frees everything. */
void registry_free(struct registry *reg);
/* registry_free, on a worker thread for a large host registry: the
 * registry is emptied at once, and no one may use what it held. */
void registry_drop(uv_loop_t *loop, struct registry *reg);
/* Maps and registers n storages whose fds are frame's (the frame keeps
 * them); all or none.  Only the pages the storages lie in are mapped,
 * and a mapping is shared by every storage in it (regmap.c).
 * SP_EBADFD, SP_EINVAL, SP_ELIMIT (the quota's code), SP_ENOMEM. */
int registry_add_storages(struct registry *reg, const struct req_storage *s,
                          size_t n, const struct sp_frame *frame, char *msg,
                          size_t msglen);
/*
 * A frame's storages or tensors registered in steps (registration.c), so
 * that no step holds the loop long.  The batch is made from the request
 * alone, on any thread: the entries checked against each other (a sid,
 * base or key twice) and hashed for the registry's tables, the names
 * copied.  Each step then runs on the loop, on at most budget entries:
 * checked against the registry, then (in the step where the last is
 * checked) admitted by the quotas with room made and files mapped, then
 * indexed past the registry's count, and kept, all at once, by the step
 * that indexes the last.  Until then the registry reads as before, and a
 * refusal leaves it so.  While a batch is stepped, nothing else may add to
 * its registry; a batch dropped before its end needs its registry no more.
 */
struct reg_batch;
/* 0 and *out (free it with registry_batch_free), or a refusal.  The batch
 * points into s or t, which must outlive it. */
int registry_batch_storages(const struct req_storage *s, size_t n,
                            struct reg_batch **out, char *msg, size_t msglen);
int registry_batch_tensors(struct req_tensor *t, size_t n,
                           struct reg_batch **out, char *msg, size_t msglen);
/* One step: 1 while entries remain, 0 once kept (each tensor's pieces then
 * belong to the registry), or a refusal.  frame: the storages' own. */
int registry_batch_step(struct registry *reg, struct reg_batch *b,
                        const struct sp_frame *frame, size_t budget, char *msg,
                        size_t msglen);
/* Frees a batch, and what it took that the registry did not keep; never
 * touches a registry. */
void registry_batch_free(struct reg_batch *b);
/* Checks and registers n tensors; all or none.  On success each tensor's
 * pieces belong to the registry (t[i].pieces is NULL). */
int registry_add_tensors(struct registry *reg, struct req_tensor *t, size_t n,
                         char *msg, size_t msglen);
/* The storage index of sid, or IDXSET_NONE. */
uint32_t registry_find_sid(const struct registry *reg, uint32_t sid);
/* The rank's part of a plan_input, pointing into reg (no groups). */
void registry_rank_in(const struct registry *reg, uint32_t rank,
                      struct plan_rank_in *out);
/* Registers n storages of a rank on another node (mesh.c): what the
 * planner needs (sid, base, length, device), no memory; the same checks
 * as registry_add_storages.  All or none. */
int registry_add_remote_storages(struct registry *reg,
                                 const struct req_storage *s,
                                 const struct sp_device *device, size_t n,
                                 char *msg, size_t msglen);

/* ---- registration.c ---------------------------------------------------- */

/* A storage_add or tensor_add read out of its frame and checked against
 * itself; what registering it still needs is the loop's. */
struct registration;

/* Prepares a registration from the decoded frame alone, so on any thread;
 * NULL when out of memory.  The registration points into the frame's
 * decoded objects and lives no longer than they do. */
struct registration *registration_prepare_storages(
    const msgpack_object *map, const struct sp_frame *frame);
struct registration *registration_prepare_tensors(
    const msgpack_object *map, const struct sp_frame *frame);
/* On the loop: one step of registering a prepared registration (NULL: out
 * of memory) with the connection's rank.  Returns 1 when it wants another
 * step, in a later turn of the loop; else it has replied (0, or a negative
 * code to reply).  The caller still frees it. */
int registration_serve(struct conn *c, const struct sp_msg_head *head,
                       struct sp_frame *frame, struct registration *r);
void registration_free(struct registration *r);
/* Handlers of the dispatch table: both steps at once. */
int job_op_storage_add(struct conn *c, const struct sp_msg_head *head,
                       const msgpack_object *map, struct sp_frame *frame);
int job_op_tensor_add(struct conn *c, const struct sp_msg_head *head,
                      const msgpack_object *map, struct sp_frame *frame);

/* ---- regmap.c --------------------------------------------------------- */

/* The host mappings one storage_add frame needs (registry_add_storages):
 * planned, then mapped, then committed to the registry, or freed at any
 * step with nothing kept. */
struct regmap_frame;

/* Checks the frame's memfd storages against their files and plans their
 * mappings: 0, or SP_EBADFD / SP_ENOMEM with a sentence.  *out is set
 * either way, for regmap_frame_free. */
int regmap_plan(const struct registry *reg, const struct req_storage *s,
                size_t n, const struct sp_frame *frame,
                struct regmap_frame **out, char *msg, size_t msglen);
/* What the plan's new mappings take (more: mappings, mapped_bytes) and
 * what the mappings they replace give back once committed (less). */
void regmap_usage(const struct regmap_frame *fm, struct reg_usage *more,
                  struct reg_usage *less);
/* Makes the planned mappings, read-only: 0, or SP_ENOMEM / SP_EBADFD with
 * none of them left. */
int regmap_map(struct regmap_frame *fm, const struct sp_frame *frame,
               char *msg, size_t msglen);
/* Keeps the new mappings in reg (whose arrays have room for them) and
 * drops the ones they replace, moving registered storages into the new
 * ones; cannot fail. */
void regmap_commit(struct registry *reg, struct regmap_frame *fm,
                   const struct req_storage *s, size_t n);
/* After regmap_commit: the mapping in reg->maps the frame's non-empty
 * memfd storage i lies in. */
uint32_t regmap_map_of(const struct regmap_frame *fm, size_t i);
void regmap_frame_free(struct regmap_frame *fm);

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
  /* The CUDA backend's part of the run (gpu.h): set, the rounds run on the
   * GPUs (gpu_engine_run) and src[r][i].gpu and dst are device memory. */
  const struct gpu_run *gpu_run;
  /* A job across nodes (remote.c): this node's part of each round, moves
   * to and from other nodes included; NULL on one node. */
  struct remote *remote;
  /* Called from the engine thread when a round starts and when it ends. */
  void (*notify)(void *arg);
  void *notify_arg;
  _Atomic uint32_t round; /* 1-based; 0 before the first */
  _Atomic uint64_t bytes_moved;
  /* Bytes of the owners' segments populated before round 1. */
  _Atomic uint64_t bytes_prepared;
  _Atomic bool cancel;
  _Atomic bool done;
  /* Valid once done: 0, or a code and a sentence naming key and ranks. */
  int rc;
  char msg[SP_ERRMSG_MAX + 1];
  /* With rc SP_ENODELOST from the data plane: the node it lost, else
   * PLAN_NONE. */
  uint32_t lost_node;
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
/* For the device engine's replica comparison (daemon/cuda/copy.c), as the
 * host engine names a difference: "[2, 5]", the multi-index of element
 * flat of key's row-major tensor; and whether region r reaches element
 * elem (its strides passed the planner's overlap check). */
void engine_format_index(const struct plan_key *key, uint64_t flat, char *buf,
                         size_t len);
bool engine_region_contains(const struct plan_region *r, int64_t elem);
void engine_join(struct engine *e);
/* pthread_create with the asynchronous signals blocked in the thread. */
int engine_spawn(pthread_t *thread, void *(*fn)(void *), void *arg);
/* Runs fn(arg) on this thread with the engine's SIGBUS guard: a read of a
 * trainer's mapping that faults (a file truncated after registering) ends
 * fn early and returns -1 with the address in *fault, instead of killing
 * the daemon.  For readers of the mappings outside the rounds
 * (replicas.c).  0 when fn returned. */
int engine_guarded(void (*fn)(void *arg), void *arg, const void **fault);

/* ---- replicas.c ------------------------------------------------------- */

/* The digests of the replicated and plain keys this node's ranks hold, for
 * one export: digest[j * nkeys + i] is the XXH3-64 of rank ranks[j]'s copy
 * of plan key keys[i], its elements in row-major order.  Keys on GPUs are
 * not read (their device memory is not mapped here). */
struct replica_digests {
  size_t nkeys;
  uint32_t *keys;  /* plan key indices, in key order */
  uint32_t nranks;
  uint32_t *ranks; /* the local ranks, ascending */
  uint64_t *digest;
};

/* Reads every local rank's copy (src[r] its storages, NULL for a rank on
 * another node) on threads threads, this one included, under the engine's
 * SIGBUS guard: 0, or SP_ENOMEM or SP_EBADFD (an unreadable copy, named)
 * with a sentence.  *out is empty when nothing is to compare. */
int replicas_hash(const struct plan *plan, const struct plan_input *in,
                  const struct reg_storage *const *src, uint32_t threads,
                  struct replica_digests *out, char *msg, size_t msglen);
/* SP_EDIFFERENT naming the first key (in key order) whose local copies
 * differ, the lowest rank and the first rank that differs from it; or 0. */
int replicas_compare(const struct plan *plan, const struct replica_digests *d,
                     char *msg, size_t msglen);
/* The one refusal text: rank_b's copy of key differs from rank_a's, and
 * more further ranks' too.  Returns SP_EDIFFERENT. */
int replicas_refuse(const struct plan *plan, uint32_t key, uint32_t rank_a,
                    uint64_t digest_a, uint32_t rank_b, uint64_t digest_b,
                    size_t more, char *msg, size_t msglen);
void replicas_free(struct replica_digests *d);
/* The plan index of the n-th replicated or plain key on the CPU (the
 * order of replica_digests.keys), or PLAN_NONE. */
uint32_t replicas_key_at(const struct plan *plan, size_t n);

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
/* A rank's segment on a GPU, as part 0 of its reply names it. */
struct publish_device {
  const char *device;    /* "cuda:<GPU UUID>" */
  const uint8_t *handle; /* GPU_IPC_HANDLE_BYTES: cudaIpcMemHandle_t */
  const uint8_t *event;  /* GPU_IPC_HANDLE_BYTES: cudaIpcEventHandle_t */
  uint64_t size;
};

/* Packs one part of rank's export reply; owner is rank's registry (for
 * identity tensors' sids); dev is the rank's segment when it is on a GPU
 * (part 0 lists it in cuda_segments and carries no descriptor), else NULL. */
/* files: a save's numbering (daemon/save.h), or NULL for an export. */
struct save_files;
void publish_pack(const struct plan *plan, const struct publish_layout *l,
                  const struct registry *owner, uint32_t rank,
                  uint64_t request_id, uint64_t export_id, size_t part,
                  size_t nparts, size_t first, size_t end,
                  const struct publish_device *dev,
                  const struct save_files *files, struct sp_msgbuf *mb);

/* ---- history.c -------------------------------------------------------- */

/* One finished export, as job_status shows it. */
struct history_entry {
  uint64_t export_id; /* 0: it failed while its ranks asked, unstarted */
  bool failed;
  char *error; /* "<code>: <message>" when failed, else NULL */
  uint64_t started_ms, ended_ms;
  uint32_t rounds;
  uint64_t bytes_moved, bytes_total;
  double rate_bps;
};

/* The last cap finished exports of a job. */
struct history {
  struct history_entry *ring; /* [cap] once the first is recorded */
  uint32_t cap, count, next;
  uint64_t total; /* every export recorded, kept or not */
};

void history_init(struct history *h, uint32_t cap);
void history_free(struct history *h);
/* Records e (its error is copied); the oldest entry goes when full. */
void history_add(struct history *h, const struct history_entry *e);
/* The i-th newest entry (0: the last one), for i < count. */
const struct history_entry *history_at(const struct history *h, uint32_t i);

/* ---- job.c ------------------------------------------------------------ */

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
  /* The rank asked for the next export and waits for its reply. */
  bool asked;
  uint64_t ask_id;
  uint64_t asked_ms;
  uint64_t ask_deadline_ms;
  struct req_export ask;
  /* Part of the running export. */
  bool in_export;
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
   * registrations, groups and options (export.c). */
  struct plan *cached_plan;
  struct publish_layout cached_layout;
  uint64_t cached_max_bytes;
  uint32_t cached_max_keys;
  char **cached_groups; /* [world] group blobs */
  size_t *cached_groups_len;
  /* Registrations or members changed while an export used the cache. */
  bool cache_stale;
  /* The digest of the last plan built, for status (has_plan_digest). */
  uint64_t plan_digest;
  bool has_plan_digest;
  /* [world]: the ranks that left and have not joined again; every export
   * asked for meanwhile fails with rank_lost (job_departed): a job cannot
   * export without all of its ranks.  The daemon that decides exports
   * reads it: one node's, or across nodes the root's. */
  struct job_departure *departed;
  uint64_t departures; /* numbers them in the order they happened */
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
  /* Generation 0's communicators are started as the ranks join (before
   * any export, export_comms_join): gpu_comms is that set, not warmed yet,
   * while comms_early; comms_ready once every one was seen set up (logged
   * once); comms_join_over once the first export took them over, or a
   * rank left or an init failed before it (the export then makes them as
   * after a failure). */
  bool comms_early, comms_ready, comms_join_over;
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
uint64_t job_now_ms(void);
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
struct job *job_new(struct server *srv, const uint8_t *id,
                    const uint8_t *secret, uint32_t world);
struct job_member *job_admit(struct job *job, struct conn *c,
                             uint64_t request_id, const struct req_join *req,
                             int device);
void job_note_joined(struct job *job);
void job_end(struct job *job);

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
/* Starts generation 0's NCCL communicators of the local ranks that joined
 * since the last call (all in one group), and notes when every one is set
 * up; before the job's first export only (docs/gpu.md).  On the loop. */
void export_comms_join(struct job *job);
/* Rank r is leaving before the first export: the join-time communicators
 * are aborted (the world cannot complete without it). */
void export_comms_rank_left(struct job *job, uint32_t r);
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
  /* The owners' segments on this node, and how much of them the engine
   * has prepared (phase allocating). */
  uint64_t bytes_prepared, bytes_to_prepare;
  /* A save: the bytes this daemon's ranks wrote, and will. */
  uint64_t bytes_written, bytes_to_write;
  double rate_bps;
  uint64_t pool_used;
};
void export_view(const struct job *job, struct export_view *out);
const char *export_phase_name(enum job_phase phase);
/* Jobs across nodes (mesh.c).  Starts the export the root announced, from
 * the local ranks that asked and the gathered metadata of every rank, with
 * the options the root resolved: 0 (the export owns mx), or a code and a
 * message to fail it everywhere with (mx stays the caller's). */
struct mesh_export;
int export_start_gathered(struct job *job, struct mesh_export *mx,
                          uint64_t export_id, uint32_t max_keys,
                          uint64_t max_bytes, uint64_t save_limit,
                          uint32_t timeout_ms, char *msg, size_t msglen);
/* The running export's save (daemon/save.h), or NULL. */
struct save *export_save(const struct job *job);
/* Fails the running export on every rank, and across nodes on every node. */
void export_fail_running(struct job *job, int code, const char *message);
/* The sentence for two ranks that disagree on whether, or how, to save. */
void export_save_disagree(uint32_t rank0, uint64_t limit0, uint32_t rank,
                          uint64_t limit, char *msg, size_t msglen);
/* Two nodes' copies of the key-th replicated or plain key (in key order)
 * that differ, as the root found them (mesh.c, go). */
struct replica_differ {
  uint32_t key;
  uint32_t ranks[2];
  uint64_t digests[2];
};
/* The root's go (every node planned alike; differ: but two nodes' copies
 * of a replicated key differ, and the export is refused) and publish
 * (every node moved its data). */
void export_go(struct job *job, const struct replica_differ *differ);
void export_publish(struct job *job);
/* Fails the running export, or the ranks waiting for one, with the root's
 * code and message (nothing is reported back to the root). */
void export_fail(struct job *job, int code, const char *message);
/* Fails the ranks of this node waiting for an export, and logs the failure
 * (once, at warn) when there are any. */
void export_fail_asks(struct job *job, int code, const char *message);
/* Whether a rank of this node waits for an export. */
bool export_any_asked(const struct job *job);
/* Fails the running export (across nodes, the root hears it and fails it
 * on every node) and the ranks waiting for one, with code and message:
 * an abort, a drain that ran out of time. */
void export_abort(struct job *job, int code, const char *message);

/* ---- nodelink.c ------------------------------------------------------- */

/* The most bytes of one frame between daemons: a rank's registrations
 * travel in one, and the most items it may hold. */
#define NODE_MAX_FRAME (1u << 30)
#define NODE_MAX_ITEMS (1u << 26)
#define NODE_MAX_NODES 4096u
/* Bump when a message between daemons changes (docs/protocol.md). */
#define NODE_PROTOCOL_VERSION 4

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
  uint32_t rank, world, device_type;
  bool disconnected;
  uint64_t gather, export_id;
  uint32_t max_keys, timeout_ms;
  uint64_t max_bytes;
  /* ask, plan: a save's file limit (0: an export); saved, commit: the step
   * of the save's commit (daemon/save.h). */
  uint64_t save_limit;
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
/* A save: every rank of this node reported step of its commit. */
void mesh_saved(struct job *job, uint32_t step);
void mesh_failed(struct job *job, int code, const char *message);
/* The data plane lost node: on the root, the node leaves the job as if its
 * control link had closed, so that its ranks no longer keep the job alive
 * while a cut link waits for TCP to give up. */
void mesh_data_lost(struct job *job, uint32_t node, const char *why);
int mesh_remote(struct job *job, struct mesh_export *mx,
                const struct plan *plan, const struct reg_storage *const *src,
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

/* ---- remote.c --------------------------------------------------------- */

struct remote;

struct remote_peer_setup {
  int sock; /* the data link, or -1 (this node, or none) */
  char addr[NODE_ADDR_MAX];
  _Atomic uint64_t *sent, *received; /* the node's counters, or NULL */
  /* The daemon's counters of that peer address (metrics.h), or NULL. */
  struct metrics_peer *metrics;
};

struct remote_setup {
  const struct plan *plan;
  uint32_t self;
  uint32_t nnodes;
  const struct remote_peer_setup *peers; /* [nnodes], copied */
  const struct reg_storage *const *src;  /* [world]: local ranks' storages */
  uint8_t *const *dst;                   /* [world]: local owners' segments */
  const uint64_t *key_offset;
  const char *job_hex;
  uint64_t export_id;
  uint32_t timeout_ms; /* a peer that moves nothing this long is lost */
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
/* Sends and receives the round's buckets; 0, 1 when cancelled, or a code
 * and a sentence (SP_ENODELOST names the node, also set in *lost_node). */
int remote_exchange(struct remote *r, const atomic_bool *cancel,
                    _Atomic uint64_t *bytes_moved, uint32_t *lost_node,
                    char *msg, size_t msglen);
/* For a move of the round's lists that goes through staging: its bytes
 * there, and the view rewritten as the contiguous box; NULL otherwise. */
const uint8_t *remote_source(const struct remote *r, const struct plan_move *m,
                             struct sp_view *sv);
uint8_t *remote_dest(const struct remote *r, const struct plan_move *m,
                     struct plan_region *dr);

/* ---- joblist.c -------------------------------------------------------- */

/* The job whose id is ref or starts with it (ref: 1 to 32 lowercase hex
 * digits): 0, SP_ENOJOB, or SP_EINVAL when ref fits several ids; with a
 * sentence in msg.  A daemon keeps one shadow of a job rooted elsewhere
 * per secret (job.c), so one id may name several jobs: *named says how
 * many, and *out is one of them. */
int joblist_find(const struct server *srv, const char *ref, struct job **out,
                 uint32_t *named, char *msg, size_t msglen);
/* Handlers of the dispatch table (conn.c). */
int joblist_op_jobs(struct conn *c, const struct sp_msg_head *head,
                    const msgpack_object *map, struct sp_frame *frame);
int joblist_op_job_status(struct conn *c, const struct sp_msg_head *head,
                          const msgpack_object *map, struct sp_frame *frame);

/* ---- abort.c ---------------------------------------------------------- */

int abort_op_job_abort(struct conn *c, const struct sp_msg_head *head,
                       const msgpack_object *map, struct sp_frame *frame);

/* ---- status.c --------------------------------------------------------- */

/* Builds the status reply for request id into mb; starts a new window
 * of loop_max_busy_us. */
void status_pack(struct server *srv, uint64_t id, struct sp_msgbuf *mb);

#endif /* SP_DAEMON_H */
