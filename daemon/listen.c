/*
 * listen.c - the daemon's listening socket.
 *
 * Under systemd socket activation the socket is systemd's: taken as passed,
 * never unlinked.  Otherwise the path socket is made the way OpenBSD's
 * control sockets are: the directory must belong to the daemon's uid and
 * must not be writable by everyone (else another user could swap the socket
 * for their own); a stale socket is unlinked only when nobody answers on
 * it; the umask makes the socket 0660 from the moment it exists, and chmod
 * and chown then set the mode and group the configuration asks for.
 */
#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <sys/file.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include "build_config.h"
#include "daemon/config.h"
#include "daemon/listen.h"
#include "daemon/log.h"

#if SP_HAVE_SYSTEMD
#include <systemd/sd-daemon.h>
#endif

#define SOCKET_MODE 0660
#define DIR_MODE 0750

static int set_nonblock(int fd) {
  int flags = fcntl(fd, F_GETFL);
  if (flags < 0 || fcntl(fd, F_SETFL, flags | O_NONBLOCK) != 0)
    return -1;
  return 0;
}

#if SP_HAVE_SYSTEMD
/* 1 when systemd passed a socket (taken), 0 when it passed none, -1 on an
 * error.  LISTEN_* are unset so that no child inherits them. */
static int take_systemd_socket(struct listener *l) {
  int n = sd_listen_fds(1);
  if (n < 0) {
    log_msg(LOG_LEVEL_ERROR, "socket activation: %s", strerror(-n));
    return -1;
  }
  if (n == 0)
    return 0;
  if (n != 1) {
    log_msg(LOG_LEVEL_ERROR,
            "socket activation passed %d sockets; expected exactly one", n);
    return -1;
  }
  int fd = SD_LISTEN_FDS_START;
  if (sd_is_socket_unix(fd, SOCK_STREAM, 1, NULL, 0) <= 0) {
    log_msg(LOG_LEVEL_ERROR,
            "socket activation passed fd %d, which is not a listening Unix "
            "stream socket",
            fd);
    return -1;
  }
  if (set_nonblock(fd) != 0 || fcntl(fd, F_SETFD, FD_CLOEXEC) != 0) {
    log_msg(LOG_LEVEL_ERROR, "socket activation: fcntl: %s", strerror(errno));
    return -1;
  }
  struct sockaddr_un sa;
  socklen_t salen = sizeof(sa);
  memset(&sa, 0, sizeof(sa));
  if (getsockname(fd, (struct sockaddr *)&sa, &salen) == 0 &&
      sa.sun_path[0] != '\0')
    snprintf(l->path, sizeof(l->path), "%.*s", (int)sizeof(sa.sun_path),
             sa.sun_path);
  else
    snprintf(l->path, sizeof(l->path), "(fd %d)", fd);
  l->fd = fd;
  l->from_systemd = true;
  return 1;
}
#endif

static int fail(char *err, size_t errsize, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

static int fail(char *err, size_t errsize, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(err, errsize, fmt, ap);
  va_end(ap);
  return -1;
}

/* Splits an absolute socket path into its directory and file name. */
static int split_path(const char *path, char *dir, size_t dirlen,
                      const char **name, char *err, size_t errsize) {
  /* Set on every path: at -O3 GCC cannot see that a refusal keeps the
   * caller from reading it (-Wmaybe-uninitialized). */
  *name = "";
  const char *slash = strrchr(path, '/');
  if (path[0] != '/' || slash == NULL)
    return fail(err, errsize, "socket path %s is not absolute", path);
  size_t n = slash == path ? 1 : (size_t)(slash - path);
  if (n >= dirlen)
    return fail(err, errsize, "socket path %s is too long", path);
  memcpy(dir, path, n);
  dir[n] = '\0';
  *name = slash + 1;
  return 0;
}

/* Checks the socket's directory: it must belong to the daemon's uid and be
 * writable by nobody else.  A missing default directory is made when
 * create (else it passes: starting makes it).  A refusal says what to do
 * instead: a newcomer's first try is often a socket right in /tmp. */
static int check_dir(const struct config *cfg, const char *dir,
                     const char *name, bool create, char *err,
                     size_t errsize) {
  struct stat st;
  if (stat(dir, &st) != 0) {
    if (errno != ENOENT)
      return fail(err, errsize, "socket directory %s: %s", dir,
                  strerror(errno));
    /* Only the default directory is made, so that a mistyped --socket
     * fails loudly instead of creating directories where nobody looks. */
    if (!cfg->socket_is_default)
      return fail(err, errsize,
                  "socket directory %s does not exist (only the default "
                  "/run/shardport is made); create it first: mkdir -m 0700 "
                  "%s",
                  dir, dir);
    if (!create)
      return 0;
    if (mkdir(dir, DIR_MODE) != 0 && errno != EEXIST)
      return fail(err, errsize, "mkdir %s: %s", dir, strerror(errno));
    if (chmod(dir, DIR_MODE) != 0 ||
        (cfg->socket_group_set && chown(dir, (uid_t)-1, cfg->socket_group)) ||
        stat(dir, &st) != 0)
      return fail(err, errsize, "socket directory %s: %s", dir,
                  strerror(errno));
  }
  if (!S_ISDIR(st.st_mode))
    return fail(err, errsize, "socket directory %s is not a directory", dir);
  const char *parent = strcmp(dir, "/") == 0 ? "" : dir;
  if (st.st_uid != geteuid())
    return fail(err, errsize,
                "refusing socket directory %s: owned by uid %u, not by the "
                "daemon's uid %u; put the socket in a directory of the "
                "daemon's own: mkdir -m 0700 %s/shardport && shardportd "
                "--socket %s/shardport/%s",
                dir, (unsigned)st.st_uid, (unsigned)geteuid(), parent, parent,
                name);
  /* Anyone else who may write the directory may swap the socket for a link
   * between our bind and our chown. */
  if (st.st_mode & (S_IWGRP | S_IWOTH))
    return fail(err, errsize,
                "refusing socket directory %s: it is writable by others than "
                "its owner (mode %04o), who could put their own socket in "
                "its place; put the socket in a directory of its own: mkdir "
                "-m 0700 %s/shardport && shardportd --socket "
                "%s/shardport/%s",
                dir, (unsigned)(st.st_mode & 07777), parent, parent, name);
  return 0;
}

int listen_check(const struct config *cfg, char *err, size_t errsize) {
  char dir[sizeof(((struct sockaddr_un *)0)->sun_path)];
  const char *name;
  if (split_path(cfg->socket, dir, sizeof dir, &name, err, errsize) != 0)
    return -1;
  return check_dir(cfg, dir, name, false, err, errsize);
}

/* Removes a socket file left by a daemon that died, never a live one and
 * never anything that is not a socket. */
static int remove_stale(const char *path, const struct sockaddr_un *sa) {
  struct stat st;
  if (lstat(path, &st) != 0) {
    if (errno == ENOENT)
      return 0;
    log_msg(LOG_LEVEL_ERROR, "%s: %s", path, strerror(errno));
    return -1;
  }
  if (!S_ISSOCK(st.st_mode)) {
    log_msg(LOG_LEVEL_ERROR, "%s exists and is not a socket; not removing it",
            path);
    return -1;
  }
  int probe = socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (probe < 0) {
    log_msg(LOG_LEVEL_ERROR, "socket: %s", strerror(errno));
    return -1;
  }
  int rc = connect(probe, (const struct sockaddr *)sa, sizeof(*sa));
  int err = errno;
  close(probe);
  if (rc == 0 || err == EAGAIN) {
    log_msg(LOG_LEVEL_ERROR,
            "%s: another daemon is listening there (already running?)", path);
    return -1;
  }
  if (err != ECONNREFUSED) {
    log_msg(LOG_LEVEL_ERROR, "%s: cannot tell whether it is stale: %s", path,
            strerror(err));
    return -1;
  }
  if (unlink(path) != 0 && errno != ENOENT) {
    log_msg(LOG_LEVEL_ERROR, "removing stale socket %s: %s", path,
            strerror(errno));
    return -1;
  }
  log_msg(LOG_LEVEL_INFO, "removed stale socket %s", path);
  return 0;
}

/* Takes "<path>.lock" exclusively, or fails when another daemon holds it. */
static int take_lock(const char *path, struct listener *l) {
  char lock_path[sizeof(((struct sockaddr_un *)0)->sun_path) + 8];
  snprintf(lock_path, sizeof lock_path, "%s.lock", path);
  int fd = open(lock_path, O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0600);
  if (fd < 0) {
    log_msg(LOG_LEVEL_ERROR, "lock %s: %s", lock_path, strerror(errno));
    return -1;
  }
  if (flock(fd, LOCK_EX | LOCK_NB) != 0) {
    log_msg(LOG_LEVEL_ERROR, "%s: another daemon is starting or running there",
            path);
    close(fd);
    return -1;
  }
  l->lock_fd = fd;
  return 0;
}

static int release_lock(struct listener *l) {
  if (l->lock_fd >= 0)
    close(l->lock_fd);
  l->lock_fd = -1;
  return -1;
}

static int make_path_socket(const struct config *cfg, struct listener *l) {
  struct sockaddr_un sa = {.sun_family = AF_UNIX};
  size_t len = strlen(cfg->socket);
  if (len == 0 || len >= sizeof(sa.sun_path)) {
    log_msg(LOG_LEVEL_ERROR, "socket path \"%s\" is empty or too long",
            cfg->socket);
    return -1;
  }
  memcpy(sa.sun_path, cfg->socket, len + 1);
  const char *path = sa.sun_path;

  char dir[sizeof(sa.sun_path)], why[1024];
  const char *name;
  if (split_path(path, dir, sizeof dir, &name, why, sizeof why) != 0 ||
      check_dir(cfg, dir, name, true, why, sizeof why) != 0) {
    log_msg(LOG_LEVEL_ERROR, "%s", why);
    return -1;
  }
  if (take_lock(path, l) != 0)
    return -1;
  if (remove_stale(path, &sa) != 0)
    return release_lock(l);

  int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0) {
    log_msg(LOG_LEVEL_ERROR, "socket: %s", strerror(errno));
    return -1;
  }
  mode_t old = umask(0777 & ~SOCKET_MODE);
  int rc = bind(fd, (struct sockaddr *)&sa, sizeof(sa));
  int err = errno;
  umask(old);
  if (rc != 0) {
    log_msg(LOG_LEVEL_ERROR, "bind %s: %s", path, strerror(err));
    close(fd);
    return release_lock(l);
  }
  /* The umask above gave the socket its mode; the group is set without
   * following a link, whatever now stands at the path. */
  struct stat st;
  if ((cfg->socket_group_set &&
       fchownat(AT_FDCWD, path, (uid_t)-1, cfg->socket_group,
                AT_SYMLINK_NOFOLLOW) != 0) ||
      lstat(path, &st) != 0 || listen(fd, SOMAXCONN) != 0) {
    log_msg(LOG_LEVEL_ERROR, "socket %s: %s", path, strerror(errno));
    unlink(path);
    close(fd);
    return release_lock(l);
  }
  l->dev = st.st_dev;
  l->ino = st.st_ino;
  l->fd = fd;
  l->from_systemd = false;
  memcpy(l->path, path, len + 1);
  return 0;
}

int listen_open(const struct config *cfg, struct listener *l) {
  memset(l, 0, sizeof(*l));
  l->fd = -1;
  l->lock_fd = -1;
#if SP_HAVE_SYSTEMD
  int taken = take_systemd_socket(l);
  if (taken != 0)
    return taken > 0 ? 0 : -1;
#endif
  return make_path_socket(cfg, l);
}

void listen_close(struct listener *l) {
  if (l->fd < 0)
    return;
  close(l->fd);
  l->fd = -1;
  if (l->from_systemd)
    return;
  /* The lock file stays: removing it would let a third daemon lock a new
   * file while a second still holds the old one. */
  /* Only our own file: if the path was replaced meanwhile, it is not ours
   * to remove. */
  struct stat st;
  if (lstat(l->path, &st) == 0 && st.st_dev == l->dev &&
      st.st_ino == l->ino && unlink(l->path) != 0)
    log_msg(LOG_LEVEL_WARN, "removing %s: %s", l->path, strerror(errno));
  release_lock(l);
}
