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
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <sys/types.h>
#include <sys/un.h>
#include <uv.h>

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

/* ---- status.c --------------------------------------------------------- */

/* Builds the status reply for request id into mb. */
void status_pack(const struct server *srv, uint64_t id, struct sp_msgbuf *mb);

#endif /* SP_DAEMON_H */
