/*
 * explain.c - why a connection to shardportd failed, in a sentence a
 * person can act on (sp_connect_explain).
 *
 * "permission denied" alone hides two different problems: the file system
 * may keep this user from the socket (its directory and the socket are
 * open to the daemon's group only), or the daemon may refuse the user it
 * sees on the socket (allowed_uids, allowed_gid).  The fixes differ, so the
 * sentences do too.  docs/operations.md ("Socket permissions") is where
 * both point.
 */
#include <errno.h>
#include <grp.h>
#include <pwd.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include "client/client.h"

/* "alice" or "uid 1000". */
static void user_name(char *buf, size_t len) {
  uid_t uid = geteuid();
  struct passwd *pw = getpwuid(uid);
  if (pw != NULL)
    snprintf(buf, len, "%s (uid %u)", pw->pw_name, (unsigned)uid);
  else
    snprintf(buf, len, "uid %u", (unsigned)uid);
}

static void group_name(gid_t gid, char *buf, size_t len) {
  struct group *gr = getgrgid(gid);
  if (gr != NULL)
    snprintf(buf, len, "%s", gr->gr_name);
  else
    snprintf(buf, len, "%u", (unsigned)gid);
}

/* The file system refused: the socket's directory is not open to this
 * user, or the socket itself is not.  Names the group that is let in. */
static void explain_fs(char *why, size_t len, const char *where,
                       const char *path) {
  char user[96], group[64], dir[sizeof(((struct sockaddr_un *)0)->sun_path)];
  user_name(user, sizeof user);
  snprintf(dir, sizeof dir, "%s", path);
  char *slash = strrchr(dir, '/');
  if (slash != NULL)
    slash[slash == dir ? 1 : 0] = '\0';
  struct stat st;
  const char *what;
  if (stat(path, &st) == 0) {
    what = "the socket";
  } else if (stat(dir, &st) == 0) {
    what = "its directory";
  } else {
    snprintf(why, len,
             "cannot reach %s: the file system denies %s access to it or a "
             "directory above it",
             where, user);
    return;
  }
  group_name(st.st_gid, group, sizeof group);
  /* Root's group lets its members do far more than reach a socket: nobody
   * should join it for this.  The daemon's configuration names the group
   * it opens the socket to instead. */
  if (st.st_gid == 0) {
    snprintf(why, len,
             "cannot reach %s: the file system denies %s access (%s is mode "
             "%04o, group %s); it is open to root's group only, which no "
             "user should join for this: set socket_group and allowed_gid "
             "in shardportd's configuration to a group of its users (such "
             "as shardport), give the socket's directory that group too, "
             "restart shardportd and add USER to the group "
             "(docs/operations.md, \"Socket permissions\")",
             where, user, what, (unsigned)(st.st_mode & 07777), group);
    return;
  }
  snprintf(why, len,
           "cannot reach %s: the file system denies %s access (%s is mode "
           "%04o, group %s); members of group %s may connect: usermod -aG "
           "%s USER, then log in again (docs/operations.md, \"Socket "
           "permissions\")",
           where, user, what, (unsigned)(st.st_mode & 07777), group, group,
           group);
}

void client_explain(char *why, size_t len, const char *path,
                    const char *origin, int code, int err,
                    const char *daemon_msg) {
  if (why == NULL || len == 0)
    return;
  char where[512];
  if (origin != NULL && origin[0] != '\0')
    snprintf(where, sizeof where, "%s (%s)", path, origin);
  else
    snprintf(where, sizeof where, "%s", path);
  char user[96];
  switch (code) {
  case SP_ENODAEMON:
    snprintf(why, len, "no shardportd listens at %s: %s", where,
             err == ECONNREFUSED
                 ? "the socket file is there but nobody answers (the "
                   "daemon stopped or died); start shardportd again"
             : err == ENOTDIR
                 ? "a part of the path is not a directory; point "
                   "SHARDPORT_SOCKET at the socket shardportd listens on"
                 : "nothing is there; start shardportd (docs/operations.md), "
                   "or point SHARDPORT_SOCKET at the socket it listens on");
    return;
  case SP_EPERM:
    /* connect() itself failed: the file system's permissions. */
    if (err != 0) {
      explain_fs(why, len, where, path);
      return;
    }
    user_name(user, sizeof user);
    snprintf(why, len,
             "shardportd at %s refused %s: %s; it admits the users in its "
             "allowed_uids and the members of its allowed_gid (by default "
             "root, its own user and its own group, shardport under "
             "systemd): add the user to allowed_uids in shardportd's "
             "configuration, or set allowed_gid to a group of its users "
             "(such as shardport, never root) and add the user to that "
             "group (docs/operations.md, \"Socket permissions\")",
             where, user,
             daemon_msg != NULL && daemon_msg[0] != '\0' ? daemon_msg
                                                        : sp_strerror(code));
    return;
  case SP_EINVAL:
    snprintf(why, len,
             "%s is not a usable socket path: it is empty or longer than "
             "%zu bytes",
             where, sizeof(((struct sockaddr_un *)0)->sun_path) - 1);
    return;
  case SP_ETIMEOUT:
    snprintf(why, len, "shardportd at %s did not answer in time", where);
    return;
  default:
    if (daemon_msg != NULL && daemon_msg[0] != '\0')
      snprintf(why, len, "connecting to %s: %s (%s)", where, sp_strerror(code),
               daemon_msg);
    else if (err != 0)
      snprintf(why, len, "connecting to %s: %s (%s)", where, sp_strerror(code),
               strerror(err));
    else
      snprintf(why, len, "connecting to %s: %s", where, sp_strerror(code));
  }
}
