/*
 * config.c - the configuration file: one `key = value` per line, `#` starts
 * a comment, blank lines are ignored.  Every key and its default is printed
 * by `shardportd --print-config`; docs/operations.md describes each one.
 */
#include <ctype.h>
#include <errno.h>
#include <grp.h>
#include <inttypes.h>
#include <limits.h>
#include <pwd.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "daemon/backend.h"
#include "daemon/config.h"
#include "daemon/log.h"
#include "daemon/netaddr.h"
#include "daemon/request.h"
#include "proto/socket_path.h"

static int fail(char *err, size_t errsize, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

static int fail(char *err, size_t errsize, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(err, errsize, fmt, ap);
  va_end(ap);
  return -1;
}

void config_default(struct config *cfg) {
  memset(cfg, 0, sizeof(*cfg));
  cfg->socket_is_default = true;
  cfg->allowed_uids[cfg->nallowed_uids++] = 0;
  if (geteuid() != 0)
    cfg->allowed_uids[cfg->nallowed_uids++] = geteuid();
  cfg->allowed_gid_set = true;
  cfg->allowed_gid = getegid();
  cfg->log_level = LOG_LEVEL_INFO;
  sp__limits_default(&cfg->limits);
  cfg->max_clients = CONFIG_DEFAULT_MAX_CLIENTS;
  cfg->max_output = CONFIG_DEFAULT_MAX_OUTPUT;
  cfg->max_staged_bytes = CONFIG_DEFAULT_MAX_STAGED_BYTES;
  cfg->backend = BACKEND_AUTO;
  cfg->watchdog = true;
  cfg->compare_replicas = true;
  cfg->pool_huge_pages = true;
  cfg->pool_capacity = 0;
  cfg->gpu_pool_capacity = 0;
  cfg->max_bytes = CONFIG_DEFAULT_MAX_BYTES;
  cfg->export_timeout_ms = CONFIG_DEFAULT_EXPORT_TIMEOUT_MS;
  cfg->job_timeout_ms = CONFIG_DEFAULT_JOB_TIMEOUT_MS;
  cfg->max_jobs = CONFIG_DEFAULT_MAX_JOBS;
  cfg->max_user_jobs = CONFIG_DEFAULT_MAX_USER_JOBS;
  cfg->max_user_registrations = CONFIG_DEFAULT_MAX_USER_REGISTRATIONS;
  cfg->max_user_registration_bytes = CONFIG_DEFAULT_MAX_USER_REGISTRATION_BYTES;
  cfg->max_user_mappings = CONFIG_DEFAULT_MAX_USER_MAPPINGS;
  cfg->max_client_mappings = CONFIG_DEFAULT_MAX_CLIENT_MAPPINGS;
  cfg->max_user_mapped_bytes = CONFIG_DEFAULT_MAX_USER_MAPPED_BYTES;
  cfg->engine_threads = 0;
  cfg->peer_timeout_ms = CONFIG_DEFAULT_PEER_TIMEOUT_MS;
  cfg->peer_handshakes = CONFIG_DEFAULT_PEER_HANDSHAKES;
  cfg->peer_streams = CONFIG_DEFAULT_PEER_STREAMS;
  cfg->drain_timeout_ms = CONFIG_DEFAULT_DRAIN_TIMEOUT_MS;
  cfg->export_history = CONFIG_DEFAULT_EXPORT_HISTORY;
  cfg->metrics_connections = CONFIG_DEFAULT_METRICS_CONNECTIONS;
}

/* Binary size suffixes, largest first (config_print's choice). */
static const struct {
  const char *suffix;
  unsigned shift;
} size_units[] = {{"T", 40}, {"G", 30}, {"M", 20}, {"k", 10}};

/* The shift of a size suffix: k (or K), M, G, T, each alone or followed by
 * "iB" (KiB, MiB, ...).  -1 for anything else: "MB" would be ambiguous. */
static int size_shift(const char *suffix) {
  if (suffix[0] == '\0')
    return 0;
  char unit = suffix[0] == 'K' ? 'k' : suffix[0];
  if (suffix[1] != '\0' && strcmp(suffix + 1, "iB") != 0)
    return -1;
  for (size_t i = 0; i < sizeof size_units / sizeof size_units[0]; i++)
    if (size_units[i].suffix[0] == unit)
      return (int)size_units[i].shift;
  return -1;
}

/* A decimal number with an optional binary suffix (size_shift). */
static int parse_size(const char *s, uint64_t lo, uint64_t hi, uint64_t *out) {
  if (!isdigit((unsigned char)s[0]))
    return -1;
  errno = 0;
  char *end;
  unsigned long long v = strtoull(s, &end, 10);
  int shift = errno == 0 ? size_shift(end) : -1;
  if (shift < 0 || v > (UINT64_MAX >> shift))
    return -1;
  v <<= shift;
  if (v < lo || v > hi)
    return -1;
  *out = v;
  return 0;
}

/* How config_print writes a byte size: the largest suffix that is exact. */
static void print_size(FILE *out, const char *key, uint64_t bytes) {
  for (size_t i = 0; bytes > 0 && i < sizeof size_units / sizeof size_units[0];
       i++) {
    uint64_t unit = UINT64_C(1) << size_units[i].shift;
    if (bytes % unit == 0) {
      fprintf(out, "%s = %" PRIu64 "%s\n", key, bytes / unit,
              size_units[i].suffix);
      return;
    }
  }
  fprintf(out, "%s = %" PRIu64 "\n", key, bytes);
}

/* Duration units, largest first (config_print's choice). */
static const struct {
  const char *unit;
  uint64_t ms;
} duration_units[] = {{"h", 3600000}, {"m", 60000}, {"s", 1000}, {"ms", 1}};

/* A duration: a decimal number with the unit ms, s, m or h (seconds when
 * none is given), in milliseconds from lo to hi. */
static int parse_duration(const char *s, uint64_t lo, uint64_t hi,
                          uint64_t *out) {
  if (!isdigit((unsigned char)s[0]))
    return -1;
  errno = 0;
  char *end;
  unsigned long long v = strtoull(s, &end, 10);
  if (errno != 0 || v > UINT32_MAX)
    return -1;
  uint64_t scale = *end == '\0' ? 1000 : 0;
  for (size_t i = 0; i < sizeof duration_units / sizeof duration_units[0]; i++)
    if (strcmp(end, duration_units[i].unit) == 0)
      scale = duration_units[i].ms;
  if (scale == 0)
    return -1;
  v *= scale;
  if (v < lo || v > hi)
    return -1;
  *out = v;
  return 0;
}

/* How config_print writes a duration: the largest unit that is exact. */
static void print_duration(FILE *out, const char *key, uint64_t ms) {
  for (size_t i = 0; i < sizeof duration_units / sizeof duration_units[0];
       i++)
    if (ms % duration_units[i].ms == 0) {
      fprintf(out, "%s = %" PRIu64 "%s\n", key, ms / duration_units[i].ms,
              duration_units[i].unit);
      return;
    }
}

static int parse_bool(const char *s, bool *out) {
  if (strcmp(s, "yes") == 0 || strcmp(s, "true") == 0 || strcmp(s, "1") == 0)
    *out = true;
  else if (strcmp(s, "no") == 0 || strcmp(s, "false") == 0 ||
           strcmp(s, "0") == 0)
    *out = false;
  else
    return -1;
  return 0;
}

static bool all_digits(const char *s) {
  return s[0] != '\0' && strspn(s, "0123456789") == strlen(s);
}

/* A user or group as a number or a name.  Names are looked up once, here,
 * so that the event loop never waits on NSS. */
static int parse_uid(const char *s, uid_t *out) {
  uint64_t v;
  if (all_digits(s)) {
    if (parse_size(s, 0, UINT32_MAX - 1, &v) != 0)
      return -1;
    *out = (uid_t)v;
    return 0;
  }
  struct passwd *pw = getpwnam(s);
  if (pw == NULL)
    return -1;
  *out = pw->pw_uid;
  return 0;
}

static int parse_gid(const char *s, gid_t *out) {
  uint64_t v;
  if (all_digits(s)) {
    if (parse_size(s, 0, UINT32_MAX - 1, &v) != 0)
      return -1;
    *out = (gid_t)v;
    return 0;
  }
  struct group *gr = getgrnam(s);
  if (gr == NULL)
    return -1;
  *out = gr->gr_gid;
  return 0;
}

static int set_uids(struct config *cfg, const char *value, char *err,
                    size_t errsize) {
  cfg->nallowed_uids = 0;
  if (strcmp(value, "none") == 0 || value[0] == '\0')
    return 0;
  char buf[1024];
  if (strlen(value) >= sizeof(buf))
    return fail(err, errsize, "allowed_uids: list too long");
  memcpy(buf, value, strlen(value) + 1);
  char *save = NULL;
  for (char *tok = strtok_r(buf, ", \t", &save); tok != NULL;
       tok = strtok_r(NULL, ", \t", &save)) {
    if (cfg->nallowed_uids == CONFIG_MAX_UIDS)
      return fail(err, errsize, "allowed_uids: more than %d entries",
                  CONFIG_MAX_UIDS);
    uid_t uid;
    if (parse_uid(tok, &uid) != 0)
      return fail(err, errsize, "allowed_uids: unknown user \"%s\"", tok);
    cfg->allowed_uids[cfg->nallowed_uids++] = uid;
  }
  return 0;
}

/* One row per key that takes a number: where it lives and its bounds. */
struct size_key {
  const char *key;
  uint64_t lo, hi;
};

static const struct size_key size_keys[] = {
    {"max_frame", 64, 1u << 30},
    {"max_depth", 1, SP_LIMITS_MAX_DEPTH},
    {"max_items", 16, 1u << 28},
    {"max_string", 64, 1u << 30},
    {"max_fds", 0, SP_FDS_MAX},
    {"max_clients", 1, 1u << 20},
    {"max_output", 4096, UINT64_C(1) << 40},
    {"max_staged_bytes", 64u << 10, UINT64_C(1) << 40},
    {"pool_capacity", 0, UINT64_C(1) << 50},
    {"gpu_pool_capacity", 0, UINT64_C(1) << 50},
    {"max_bytes", 4096, UINT64_C(1) << 50},
    {"max_jobs", 1, 1u << 16},
    {"max_user_jobs", 1, 1u << 16},
    {"max_user_registrations", 1, UINT64_C(1) << 32},
    {"max_user_registration_bytes", 4096, UINT64_C(1) << 50},
    {"max_user_mappings", 1, 1u << 24},
    {"max_client_mappings", 1, 1u << 24},
    {"max_user_mapped_bytes", 4096, UINT64_C(1) << 50},
    {"engine_threads", 0, 64},
    {"peer_handshakes", 1, 1u << 16},
    {"peer_streams", 1, CONFIG_MAX_PEER_STREAMS},
    {"export_history", 0, CONFIG_MAX_EXPORT_HISTORY},
    {"metrics_connections", 1, CONFIG_MAX_METRICS_CONNECTIONS},
};

/* Keys that take a duration, with their bounds in milliseconds. */
static const struct size_key duration_keys[] = {
    {"export_timeout", 100, REQ_MAX_TIMEOUT_MS},
    {"job_timeout", 1000, REQ_MAX_TIMEOUT_MS},
    {"peer_timeout", 100, REQ_MAX_TIMEOUT_MS},
    {"drain_timeout", 0, REQ_MAX_TIMEOUT_MS},
};

static void store_size(struct config *cfg, const char *key, uint64_t v) {
  if (strcmp(key, "max_frame") == 0)
    cfg->limits.max_frame = (uint32_t)v;
  else if (strcmp(key, "max_depth") == 0)
    cfg->limits.max_depth = (uint32_t)v;
  else if (strcmp(key, "max_items") == 0)
    cfg->limits.max_items = (uint32_t)v;
  else if (strcmp(key, "max_string") == 0)
    cfg->limits.max_string = (uint32_t)v;
  else if (strcmp(key, "max_fds") == 0)
    cfg->limits.max_fds = (uint32_t)v;
  else if (strcmp(key, "max_clients") == 0)
    cfg->max_clients = (uint32_t)v;
  else if (strcmp(key, "max_staged_bytes") == 0)
    cfg->max_staged_bytes = v;
  else if (strcmp(key, "pool_capacity") == 0)
    cfg->pool_capacity = v;
  else if (strcmp(key, "gpu_pool_capacity") == 0)
    cfg->gpu_pool_capacity = v;
  else if (strcmp(key, "max_bytes") == 0)
    cfg->max_bytes = v;
  else if (strcmp(key, "max_jobs") == 0)
    cfg->max_jobs = (uint32_t)v;
  else if (strcmp(key, "max_user_jobs") == 0)
    cfg->max_user_jobs = (uint32_t)v;
  else if (strcmp(key, "max_user_registrations") == 0)
    cfg->max_user_registrations = v;
  else if (strcmp(key, "max_user_registration_bytes") == 0)
    cfg->max_user_registration_bytes = v;
  else if (strcmp(key, "max_user_mappings") == 0)
    cfg->max_user_mappings = (uint32_t)v;
  else if (strcmp(key, "max_client_mappings") == 0)
    cfg->max_client_mappings = (uint32_t)v;
  else if (strcmp(key, "max_user_mapped_bytes") == 0)
    cfg->max_user_mapped_bytes = v;
  else if (strcmp(key, "engine_threads") == 0)
    cfg->engine_threads = (uint32_t)v;
  else if (strcmp(key, "export_timeout") == 0)
    cfg->export_timeout_ms = (uint32_t)v;
  else if (strcmp(key, "job_timeout") == 0)
    cfg->job_timeout_ms = (uint32_t)v;
  else if (strcmp(key, "peer_timeout") == 0)
    cfg->peer_timeout_ms = (uint32_t)v;
  else if (strcmp(key, "peer_handshakes") == 0)
    cfg->peer_handshakes = (uint32_t)v;
  else if (strcmp(key, "peer_streams") == 0)
    cfg->peer_streams = (uint32_t)v;
  else if (strcmp(key, "drain_timeout") == 0)
    cfg->drain_timeout_ms = (uint32_t)v;
  else if (strcmp(key, "export_history") == 0)
    cfg->export_history = (uint32_t)v;
  else if (strcmp(key, "metrics_connections") == 0)
    cfg->metrics_connections = (uint32_t)v;
  else
    cfg->max_output = v;
}

/* peer_listen = ADDR:PORT and peer_advertise = ADDR[:PORT], numeric
 * addresses (IPv6 in brackets), or none.  Other daemons dial the advertised
 * address, so it must be one they can reach: never a wildcard. */
static int set_peer(struct config *cfg, const char *key, const char *value,
                    char *err, size_t errsize) {
  bool listen = strcmp(key, "peer_listen") == 0;
  bool *set = listen ? &cfg->peer_listen_set : &cfg->peer_advertise_set;
  char *text = listen ? cfg->peer_listen : cfg->peer_advertise;
  struct sockaddr_storage *sa =
      listen ? &cfg->peer_listen_addr : &cfg->peer_advertise_addr;
  socklen_t len;
  *set = false;
  text[0] = '\0';
  if (value[0] == '\0' || strcmp(value, "none") == 0)
    return 0;
  if (netaddr_parse(value, strlen(value), !listen, sa, &len) != 0)
    return fail(err, errsize,
                "%s: \"%s\" is not a numeric address%s (\"10.0.0.1:7070\", "
                "\"[fd00::1]:7070\") or none",
                key, value, listen ? " and port" : ", with or without a port");
  if (!listen && netaddr_wildcard(sa))
    return fail(err, errsize, "%s: \"%s\" is a wildcard; other daemons need "
                "an address they can dial", key, value);
  if (listen)
    cfg->peer_listen_len = len;
  snprintf(text, NODE_ADDR_MAX, "%s", value);
  *set = true;
  return 0;
}

/* metrics_listen = ADDR:PORT, numeric (IPv6 in brackets), or none. */
static int set_metrics_listen(struct config *cfg, const char *value,
                              char *err, size_t errsize) {
  socklen_t len;
  cfg->metrics_listen_set = false;
  cfg->metrics_listen[0] = '\0';
  if (value[0] == '\0' || strcmp(value, "none") == 0)
    return 0;
  if (netaddr_parse(value, strlen(value), false,
                    &cfg->metrics_listen_addr, &len) != 0)
    return fail(err, errsize,
                "metrics_listen: \"%s\" is not a numeric address and port "
                "(\"127.0.0.1:9464\", \"[::1]:9464\") or none",
                value);
  snprintf(cfg->metrics_listen, NODE_ADDR_MAX, "%s", value);
  cfg->metrics_listen_set = true;
  return 0;
}

int config_check(const struct config *cfg, char *err, size_t errsize) {
  if (cfg->peer_listen_set && !cfg->peer_advertise_set &&
      netaddr_wildcard(&cfg->peer_listen_addr))
    return fail(err, errsize,
                "peer_listen %s is a wildcard address: set peer_advertise to "
                "the address other daemons dial",
                cfg->peer_listen);
  return 0;
}

int config_set(struct config *cfg, const char *key, const char *value,
               char *err, size_t errsize) {
  for (size_t i = 0; i < sizeof(size_keys) / sizeof(size_keys[0]); i++) {
    if (strcmp(key, size_keys[i].key) != 0)
      continue;
    uint64_t v;
    if (parse_size(value, size_keys[i].lo, size_keys[i].hi, &v) != 0)
      return fail(err, errsize,
                  "%s: \"%s\" is not a number from %" PRIu64 " to %" PRIu64
                  " (suffixes k, M, G, T or KiB, MiB, GiB, TiB)",
                  key, value, size_keys[i].lo, size_keys[i].hi);
    store_size(cfg, key, v);
    return 0;
  }
  for (size_t i = 0; i < sizeof(duration_keys) / sizeof(duration_keys[0]);
       i++) {
    if (strcmp(key, duration_keys[i].key) != 0)
      continue;
    uint64_t v;
    if (parse_duration(value, duration_keys[i].lo, duration_keys[i].hi, &v) !=
        0)
      return fail(err, errsize,
                  "%s: \"%s\" is not a duration from %" PRIu64
                  "ms to %" PRIu64 "ms (units ms, s, m, h)",
                  key, value, duration_keys[i].lo, duration_keys[i].hi);
    store_size(cfg, key, v);
    return 0;
  }
  if (strcmp(key, "socket") == 0) {
    if (value[0] == '\0') {
      cfg->socket[0] = '\0';
      cfg->socket_is_default = true;
      return 0;
    }
    if (value[0] != '/')
      return fail(err, errsize, "socket: \"%s\" is not an absolute path",
                  value);
    if (strlen(value) >= sizeof(cfg->socket))
      return fail(err, errsize, "socket: path longer than %zu bytes",
                  sizeof(cfg->socket) - 1);
    memcpy(cfg->socket, value, strlen(value) + 1);
    cfg->socket_is_default = false;
    return 0;
  }
  if (strcmp(key, "socket_group") == 0) {
    cfg->socket_group_set = false;
    if (value[0] == '\0' || strcmp(value, "none") == 0)
      return 0;
    if (parse_gid(value, &cfg->socket_group) != 0)
      return fail(err, errsize, "socket_group: unknown group \"%s\"", value);
    cfg->socket_group_set = true;
    return 0;
  }
  if (strcmp(key, "allowed_uids") == 0)
    return set_uids(cfg, value, err, errsize);
  if (strcmp(key, "allowed_gid") == 0) {
    cfg->allowed_gid_set = false;
    if (value[0] == '\0' || strcmp(value, "none") == 0)
      return 0;
    if (parse_gid(value, &cfg->allowed_gid) != 0)
      return fail(err, errsize, "allowed_gid: unknown group \"%s\"", value);
    cfg->allowed_gid_set = true;
    return 0;
  }
  if (strcmp(key, "log_level") == 0) {
    int level = log_level_parse(value);
    if (level < 0)
      return fail(err, errsize,
                  "log_level: \"%s\" is not error, warn, info or debug", value);
    cfg->log_level = (enum log_level)level;
    return 0;
  }
  if (strcmp(key, "backend") == 0) {
    int kind = backend_parse(value);
    if (kind < 0)
      return fail(err, errsize, "backend: \"%s\" is not auto, host or cuda",
                  value);
    cfg->backend = (enum backend_kind)kind;
    return 0;
  }
  if (strcmp(key, "watchdog") == 0 || strcmp(key, "compare_replicas") == 0 ||
      strcmp(key, "pool_huge_pages") == 0) {
    bool *flag = key[0] == 'w'   ? &cfg->watchdog
                 : key[0] == 'c' ? &cfg->compare_replicas
                                 : &cfg->pool_huge_pages;
    if (parse_bool(value, flag) != 0)
      return fail(err, errsize, "%s: \"%s\" is not yes or no", key, value);
    return 0;
  }
  if (strcmp(key, "peer_listen") == 0 || strcmp(key, "peer_advertise") == 0)
    return set_peer(cfg, key, value, err, errsize);
  if (strcmp(key, "metrics_listen") == 0)
    return set_metrics_listen(cfg, value, err, errsize);
  return fail(err, errsize, "unknown key \"%s\"", key);
}

static char *trim(char *s) {
  while (isspace((unsigned char)*s))
    s++;
  size_t n = strlen(s);
  while (n > 0 && isspace((unsigned char)s[n - 1]))
    s[--n] = '\0';
  return s;
}

int config_load(struct config *cfg, const char *path, bool must_exist,
                char *err, size_t errsize) {
  cfg->file = path;
  cfg->file_read = false;
  FILE *f = fopen(path, "re");
  if (f == NULL) {
    if (errno == ENOENT && !must_exist)
      return 0;
    return fail(err, errsize, "%s: %s", path, strerror(errno));
  }
  cfg->file_read = true;
  char line[4096];
  char msg[512];
  unsigned lineno = 0;
  int rc = 0;
  while (rc == 0 && fgets(line, sizeof(line), f) != NULL) {
    lineno++;
    size_t len = strlen(line);
    if (len == sizeof(line) - 1 && line[len - 1] != '\n' && !feof(f)) {
      rc = fail(err, errsize, "%s:%u: line too long", path, lineno);
      break;
    }
    char *hash = strchr(line, '#');
    if (hash != NULL)
      *hash = '\0';
    char *text = trim(line);
    if (text[0] == '\0')
      continue;
    char *eq = strchr(text, '=');
    if (eq == NULL) {
      rc = fail(err, errsize, "%s:%u: expected key = value", path, lineno);
      break;
    }
    *eq = '\0';
    char *key = trim(text);
    char *value = trim(eq + 1);
    if (config_set(cfg, key, value, msg, sizeof(msg)) != 0)
      rc = fail(err, errsize, "%s:%u: %s", path, lineno, msg);
  }
  if (rc == 0 && ferror(f))
    rc = fail(err, errsize, "%s: read error", path);
  fclose(f);
  return rc;
}

int config_resolve_socket(struct config *cfg, char *err, size_t errsize) {
  if (cfg->socket[0] != '\0')
    return 0;
  if (sp__socket_path_for_user(cfg->socket, sizeof(cfg->socket)) != 0)
    return fail(err, errsize,
                geteuid() == 0 ? "the default socket path is too long"
                               : "no socket path: not root and XDG_RUNTIME_DIR "
                                 "is not an absolute path (use --socket)");
  cfg->socket_is_default = true;
  return 0;
}

void config_describe_file(const struct config *cfg, char *buf, size_t len) {
  if (cfg->file == NULL)
    snprintf(buf, len, "none");
  else if (cfg->file_read)
    snprintf(buf, len, "%s", cfg->file);
  else
    snprintf(buf, len, "none (%s does not exist; built-in defaults)",
             cfg->file);
}

void config_print(const struct config *cfg, FILE *out) {
  char file[PATH_MAX + 64];
  config_describe_file(cfg, file, sizeof file);
  /* A comment, so that the output stays a valid configuration file. */
  fprintf(out, "# configuration file: %s\n", file);
  fprintf(out, "socket = %s\n", cfg->socket);
  if (cfg->socket_group_set)
    fprintf(out, "socket_group = %u\n", (unsigned)cfg->socket_group);
  else
    fprintf(out, "socket_group = none\n");
  fprintf(out, "allowed_uids =");
  for (size_t i = 0; i < cfg->nallowed_uids; i++)
    fprintf(out, "%s%u", i == 0 ? " " : ",", (unsigned)cfg->allowed_uids[i]);
  fprintf(out, "%s\n", cfg->nallowed_uids == 0 ? " none" : "");
  if (cfg->allowed_gid_set)
    fprintf(out, "allowed_gid = %u\n", (unsigned)cfg->allowed_gid);
  else
    fprintf(out, "allowed_gid = none\n");
  fprintf(out, "log_level = %s\n", log_level_name(cfg->log_level));
  print_size(out, "max_frame", cfg->limits.max_frame);
  fprintf(out, "max_depth = %" PRIu32 "\n", cfg->limits.max_depth);
  fprintf(out, "max_items = %" PRIu32 "\n", cfg->limits.max_items);
  print_size(out, "max_string", cfg->limits.max_string);
  fprintf(out, "max_fds = %" PRIu32 "\n", cfg->limits.max_fds);
  fprintf(out, "max_clients = %" PRIu32 "\n", cfg->max_clients);
  print_size(out, "max_output", cfg->max_output);
  print_size(out, "max_staged_bytes", cfg->max_staged_bytes);
  fprintf(out, "backend = %s\n", backend_name(cfg->backend));
  fprintf(out, "watchdog = %s\n", cfg->watchdog ? "yes" : "no");
  print_size(out, "pool_capacity", cfg->pool_capacity);
  print_size(out, "gpu_pool_capacity", cfg->gpu_pool_capacity);
  print_size(out, "max_bytes", cfg->max_bytes);
  print_duration(out, "export_timeout", cfg->export_timeout_ms);
  print_duration(out, "job_timeout", cfg->job_timeout_ms);
  fprintf(out, "max_jobs = %" PRIu32 "\n", cfg->max_jobs);
  fprintf(out, "max_user_jobs = %" PRIu32 "\n", cfg->max_user_jobs);
  fprintf(out, "max_user_registrations = %" PRIu64 "\n",
          cfg->max_user_registrations);
  print_size(out, "max_user_registration_bytes",
             cfg->max_user_registration_bytes);
  fprintf(out, "max_user_mappings = %" PRIu32 "\n", cfg->max_user_mappings);
  fprintf(out, "max_client_mappings = %" PRIu32 "\n",
          cfg->max_client_mappings);
  print_size(out, "max_user_mapped_bytes", cfg->max_user_mapped_bytes);
  fprintf(out, "engine_threads = %" PRIu32 "\n", cfg->engine_threads);
  fprintf(out, "compare_replicas = %s\n", cfg->compare_replicas ? "yes" : "no");
  fprintf(out, "pool_huge_pages = %s\n", cfg->pool_huge_pages ? "yes" : "no");
  print_duration(out, "drain_timeout", cfg->drain_timeout_ms);
  fprintf(out, "export_history = %" PRIu32 "\n", cfg->export_history);
  fprintf(out, "peer_listen = %s\n",
          cfg->peer_listen_set ? cfg->peer_listen : "none");
  fprintf(out, "peer_advertise = %s\n",
          cfg->peer_advertise_set ? cfg->peer_advertise : "none");
  print_duration(out, "peer_timeout", cfg->peer_timeout_ms);
  fprintf(out, "peer_handshakes = %" PRIu32 "\n", cfg->peer_handshakes);
  fprintf(out, "peer_streams = %" PRIu32 "\n", cfg->peer_streams);
  fprintf(out, "metrics_listen = %s\n",
          cfg->metrics_listen_set ? cfg->metrics_listen : "none");
  fprintf(out, "metrics_connections = %" PRIu32 "\n",
          cfg->metrics_connections);
}

int config_build(const struct config_origin *o, struct config *cfg, char *err,
                 size_t errsize) {
  config_default(cfg);
  if (config_load(cfg, o->path, o->must_exist, err, errsize) != 0)
    return CONFIG_EFILE;
  const char *env_socket = getenv("SHARDPORT_SOCKET");
  char msg[512];
  if (env_socket != NULL && env_socket[0] != '\0' &&
      config_set(cfg, "socket", env_socket, msg, sizeof msg) != 0) {
    fail(err, errsize, "SHARDPORT_SOCKET: %s", msg);
    return CONFIG_EFILE;
  }
  for (size_t i = 0; i < o->nflags; i++)
    if (config_set(cfg, o->flags[i].key, o->flags[i].value, err, errsize) !=
        0)
      return CONFIG_EFLAG;
  if (config_check(cfg, err, errsize) != 0 ||
      config_resolve_socket(cfg, err, errsize) != 0)
    return CONFIG_EFILE;
  return 0;
}
