/*
 * config.h - the daemon's settings: defaults, the file, the flags (config.c).
 */
#ifndef SP_DAEMON_CONFIG_H
#define SP_DAEMON_CONFIG_H

#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <sys/un.h>

#include "daemon/backend.h"
#include "daemon/layer.h"
#include "daemon/log.h"
#include "proto/limits.h"

#define CONFIG_MAX_UIDS 64
#define CONFIG_DEFAULT_MAX_CLIENTS 1024u
#define CONFIG_DEFAULT_MAX_OUTPUT (32u << 20)
#define CONFIG_DEFAULT_MAX_STAGED_BYTES (64u << 20)
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
/* Connections per pair of nodes (peer_streams): the default, and the most
 * (REMOTE_STREAMS_MAX, daemon/xfer/remote.h). */
#define CONFIG_DEFAULT_PEER_STREAMS 2u
#define CONFIG_MAX_PEER_STREAMS 8u
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
  /* Bytes of large frames decoded or being registered at once, daemon-wide
   * (stage.c). */
  uint64_t max_staged_bytes;
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
  /* Threads copying one export's data; 0 means the CPUs the daemon may
   * run on (sched_getaffinity). */
  uint32_t engine_threads;
  /* Ask for transparent huge pages for pool segments (pool.h). */
  bool pool_huge_pages;
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
  /* Connections a node dials for each data link to a lower node; a pair
   * of nodes moves its bytes over all of them (remote.c). */
  uint32_t peer_streams;
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

#endif /* SP_DAEMON_CONFIG_H */
