/*
 * socket_path.c - where the daemon listens when nobody says otherwise.
 *
 * The rule is the daemon's (docs/operations.md): $SHARDPORT_SOCKET, else the
 * system socket for root, else the user's runtime directory.  Both sides must
 * derive the same path or a default client never finds a default daemon.
 */
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include "shardport.h"

#define SYSTEM_SOCKET "/run/shardport/shardport.sock"

static const char *nonempty_env(const char *name) {
  const char *value = getenv(name);
  return value && value[0] != '\0' ? value : NULL;
}

SP_EXPORT int sp_default_socket_path(char *buf, size_t size) {
  if (!buf || size == 0)
    return SP_EINVAL;
  const char *explicit_path = nonempty_env("SHARDPORT_SOCKET");
  const char *runtime_dir = nonempty_env("XDG_RUNTIME_DIR");
  /* The XDG base directory rules: a relative path there is invalid and
   * ignored, as the daemon ignores it. */
  if (runtime_dir && runtime_dir[0] != '/')
    runtime_dir = NULL;
  int n;
  if (explicit_path)
    n = snprintf(buf, size, "%s", explicit_path);
  else if (geteuid() == 0)
    n = snprintf(buf, size, "%s", SYSTEM_SOCKET);
  else if (runtime_dir)
    n = snprintf(buf, size, "%s/shardport.sock", runtime_dir);
  else
    n = -1;
  if (n < 0 || (size_t)n >= size) {
    buf[0] = '\0';
    return SP_EINVAL;
  }
  return 0;
}
