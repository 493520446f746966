/*
 * socket_path.c - where the daemon listens and where clients look when
 * nobody says otherwise (docs/operations.md, "Socket paths").
 *
 * The daemon listens on $SHARDPORT_SOCKET, else the system socket when it
 * runs as root, else $XDG_RUNTIME_DIR/shardport.sock.  A client looks at
 * $SHARDPORT_SOCKET, else the system socket when it runs as root; a user's
 * client takes the user's own socket when one is there, else the system
 * socket when one is there (the systemd service's, which batch jobs without
 * XDG_RUNTIME_DIR must reach too), and otherwise names the path it would
 * have used, so that the error says where it looked and why.
 */
#include <errno.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/stat.h>
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

/* The XDG base directory rules: a relative runtime directory is invalid
 * and ignored. */
static const char *runtime_dir(void) {
  const char *dir = nonempty_env("XDG_RUNTIME_DIR");
  return dir && dir[0] == '/' ? dir : NULL;
}

int sp__socket_path_for_user(char *buf, size_t size) {
  if (!buf || size == 0)
    return SP_EINVAL;
  if (geteuid() == 0)
    return put_path(buf, size, SP_SYSTEM_SOCKET, "");
  const char *dir = runtime_dir();
  if (!dir) {
    buf[0] = '\0';
    return SP_EINVAL;
  }
  return put_path(buf, size, dir, "/shardport.sock");
}

/* Whether a socket may be at path: one is there, or the file system does
 * not let this user see (the system socket's directory is open to the
 * shardport group only; connecting then says so). */
static bool socket_there(const char *path) {
  struct stat st;
  if (stat(path, &st) == 0)
    return S_ISSOCK(st.st_mode);
  return errno == EACCES;
}

SP_EXPORT int sp_default_socket_origin(char *buf, size_t size,
                                       const char **origin) {
  const char *unused;
  if (!origin)
    origin = &unused;
  *origin = "";
  if (!buf || size == 0)
    return SP_EINVAL;
  const char *explicit_path = nonempty_env("SHARDPORT_SOCKET");
  if (explicit_path) {
    *origin = "from $SHARDPORT_SOCKET";
    return put_path(buf, size, explicit_path, "");
  }
  if (geteuid() == 0) {
    *origin = "the system socket, the default for root";
    return put_path(buf, size, SP_SYSTEM_SOCKET, "");
  }
  const char *dir = runtime_dir();
  if (dir) {
    int rc = put_path(buf, size, dir, "/shardport.sock");
    if (rc != 0)
      return rc;
    if (socket_there(buf)) {
      *origin = "$XDG_RUNTIME_DIR/shardport.sock, this user's own daemon";
      return 0;
    }
  }
  if (socket_there(SP_SYSTEM_SOCKET)) {
    *origin = dir ? "the system socket: $XDG_RUNTIME_DIR/shardport.sock "
                    "does not exist"
                  : "the system socket: XDG_RUNTIME_DIR is not set";
    return put_path(buf, size, SP_SYSTEM_SOCKET, "");
  }
  if (dir) {
    *origin = "$XDG_RUNTIME_DIR/shardport.sock; the system socket "
              SP_SYSTEM_SOCKET " does not exist either";
    return 0;
  }
  *origin = "the system socket, since XDG_RUNTIME_DIR is not set";
  return put_path(buf, size, SP_SYSTEM_SOCKET, "");
}

SP_EXPORT int sp_default_socket_path(char *buf, size_t size) {
  return sp_default_socket_origin(buf, size, NULL);
}
