/*
 * reload.c - SIGHUP (ExecReload= of the unit): the configuration is read
 * again and what may change while the daemon runs takes effect at once
 * (docs/operations.md, "Reloading the configuration").
 *
 * The settings are layered as at start (config_build: the defaults, the
 * file, SHARDPORT_SOCKET, the flags), so a flag still wins over the file.
 * What the daemon set up once at start keeps its running value until a
 * restart: the socket and its group, the backend, the memory pool, the
 * listener for other daemons, the address it advertises and the streams it
 * dials per data link, the watchdog, the metrics endpoint.
 * Every other key applies from the next connection, job, export or frame.
 *
 * Which keys changed is found by comparing config_print of the running
 * and the new configuration line by line (each key is one line, in one
 * order), and a key that needs a restart gets its running value back by
 * setting that printed value again: config_print is a valid configuration
 * file, so the one parser restores it and no key's fields are listed twice.
 */
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "daemon/config.h"
#include "daemon/log.h"
#include "daemon/notify.h"
#include "daemon/pool.h"
#include "daemon/reload.h"
#include "daemon/server.h"
#include "daemon/stage.h"

/* The keys that take a restart. */
static const char *const restart_keys[] = {
    "socket",        "socket_group",      "backend",     "watchdog",
    "pool_capacity", "gpu_pool_capacity", "peer_listen", "peer_advertise",
    "peer_streams", "metrics_listen", "metrics_connections",
};

static bool needs_restart(const char *key) {
  for (size_t i = 0; i < sizeof restart_keys / sizeof restart_keys[0]; i++)
    if (strcmp(restart_keys[i], key) == 0)
      return true;
  return false;
}

/* cfg as config_print writes it, or NULL when out of memory. */
static char *printed(const struct config *cfg) {
  char *text = NULL;
  size_t len = 0;
  FILE *f = open_memstream(&text, &len);
  if (f == NULL)
    return NULL;
  config_print(cfg, f);
  if (fclose(f) != 0) {
    free(text);
    return NULL;
  }
  return text;
}

/* The value printed for key in text (a copy of config_print's output, cut
 * into lines in place), or NULL. */
static const char *value_of(char *const *lines, size_t n, const char *key) {
  size_t klen = strlen(key);
  for (size_t i = 0; i < n; i++)
    if (strncmp(lines[i], key, klen) == 0 &&
        strncmp(lines[i] + klen, " = ", 3) == 0)
      return lines[i] + klen + 3;
  return NULL;
}

/* Cuts text into at most max lines; returns their count. */
static size_t split_lines(char *text, char **lines, size_t max) {
  size_t n = 0;
  for (char *save = NULL, *l = strtok_r(text, "\n", &save);
       l != NULL && n < max; l = strtok_r(NULL, "\n", &save))
    lines[n++] = l;
  return n;
}

/* Appends "key (old -> new)" to a list in buf. */
static void note(char *buf, size_t size, const char *key, const char *from,
                 const char *to) {
  size_t used = strlen(buf);
  if (used < size)
    snprintf(buf + used, size - used, "%s%s (%s -> %s)", used > 0 ? ", " : "",
             key, from, to);
}

#define RELOAD_MAX_KEYS 64

void reload_run(struct server *srv) {
  if (srv->draining || srv->stopping) {
    log_msg(LOG_LEVEL_INFO, "reload: ignored while stopping");
    return;
  }
  notify_reloading();
  struct config next;
  char err[512];
  const char *path = srv->origin->path;
  if (config_build(srv->origin, &next, err, sizeof err) != 0) {
    log_msg(LOG_LEVEL_ERROR,
            "reload: %s; the running configuration stays as it was", err);
    notify_ready("serving; the last reload failed (see the log)");
    return;
  }
  char *old_text = printed(srv->cfg), *new_text = printed(&next);
  if (old_text == NULL || new_text == NULL) {
    free(old_text);
    free(new_text);
    log_msg(LOG_LEVEL_ERROR, "reload: out of memory; nothing changed");
    notify_ready("serving; the last reload failed (see the log)");
    return;
  }
  char *old_lines[RELOAD_MAX_KEYS], *new_lines[RELOAD_MAX_KEYS];
  size_t nold = split_lines(old_text, old_lines, RELOAD_MAX_KEYS);
  size_t nnew = split_lines(new_text, new_lines, RELOAD_MAX_KEYS);
  char applied[2048] = "", restart[2048] = "";
  bool restored = true;
  for (size_t i = 0; i < nnew; i++) {
    char *eq = strstr(new_lines[i], " = ");
    if (eq == NULL)
      continue;
    *eq = '\0';
    const char *key = new_lines[i], *value = eq + 3;
    const char *was = value_of(old_lines, nold, key);
    if (was == NULL || strcmp(was, value) == 0)
      continue;
    if (!needs_restart(key)) {
      note(applied, sizeof applied, key, was, value);
      continue;
    }
    note(restart, sizeof restart, key, was, value);
    restored = restored && config_set(&next, key, was, err, sizeof err) == 0;
  }
  if (!restored) {
    /* The running value always parses: it was printed from a
     * configuration; failing here is a bug, and nothing is applied. */
    log_msg(LOG_LEVEL_ERROR, "reload: cannot keep a running value (%s); "
            "nothing changed", err);
  } else {
    *srv->cfg = next;
    stage_bound_changed(srv);
    log_set_level(next.log_level);
    srv->engine_threads = server_engine_threads(&next);
    pool_use_huge_pages(srv->pool, next.pool_huge_pages);
    /* What was read, as the start line says it: a default file that does
     * not exist was not read, and the defaults and flags were applied. */
    char source[PATH_MAX + 96];
    if (next.file_read)
      snprintf(source, sizeof source, "%s read", path);
    else
      snprintf(source, sizeof source,
               "no configuration file read (%s does not exist; built-in "
               "defaults and flags)",
               path);
    if (applied[0] == '\0' && restart[0] == '\0')
      log_msg(LOG_LEVEL_INFO, "reload: %s; nothing changed", source);
    else
      log_msg(LOG_LEVEL_INFO,
              "reload: %s; applied: %s; need a restart "
              "(systemctl restart shardportd): %s",
              source, applied[0] ? applied : "none",
              restart[0] ? restart : "none");
  }
  free(old_text);
  free(new_text);
  char status[256];
  snprintf(status, sizeof status, "serving on %s", srv->listener.path);
  notify_ready(status);
}
