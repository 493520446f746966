/*
 * socket_path.c - where the daemon listens when nobody says otherwise.
 *
 * The rule (docs/operations.md): $SHARDPORT_SOCKET, else the system socket
 * for root, else the user's runtime directory.  The daemon and the library
 * both derive it here, or a default client would miss a default daemon.
 */
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include "shardport.h"
#include "proto/socket_path.h"

static const char *nonempty_env(const char *name) {
  const char *value = getenv(name);
  return value && value[0] != '\0' ? value : NULL;
}

/* Writes the formatted path or, when it does not fit, an empty string. */
static int put_path(char *buf, size_t size, const char *dir, const char *name) {
  int n = snprintf(buf, size, "%s%s", dir, name);
  if (n < 0 || (size_t)n >= size) {
    buf[0] = '\0';
    return SP_EINVAL;
  }
  return 0;
}

int sp_socket_path_for_user(char *buf, size_t size) {
  if (!buf || size == 0)
    return SP_EINVAL;
  if (geteuid() == 0)
    return put_path(buf, size, SP_SYSTEM_SOCKET, "");
  /* The XDG base directory rules: a relative path there is invalid and
   * ignored. */
  const char *runtime_dir = nonempty_env("XDG_RUNTIME_DIR");
  if (!runtime_dir || runtime_dir[0] != '/') {
    buf[0] = '\0';
    return SP_EINVAL;
  }
  return put_path(buf, size, runtime_dir, "/shardport.sock");
}

SP_EXPORT int sp_default_socket_path(char *buf, size_t size) {
  if (!buf || size == 0)
    return SP_EINVAL;
  const char *explicit_path = nonempty_env("SHARDPORT_SOCKET");
  if (explicit_path)
    return put_path(buf, size, explicit_path, "");
  return sp_socket_path_for_user(buf, size);
}
