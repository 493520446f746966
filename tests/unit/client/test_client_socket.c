/*
 * test_client_socket.c - the default socket path and every way sp_connect
 * can fail before a daemon answers, with the explanation of each, without
 * any daemon.  Where the system socket exists is tested in a mount
 * namespace of its own (tests/integration/cli, system-socket).
 */
#include <check.h>
#include <dirent.h>
#include <grp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include "shardport.h"

/* The uid and gid of "nobody" on Debian. */
#define NOBODY 65534

/* Runs fn in a child process, as nobody when we are root, and returns its
 * exit status.  A test that needs "not root" works either way. */
static int as_unprivileged(int (*fn)(void *), void *arg) {
  pid_t pid = fork();
  ck_assert_int_ge(pid, 0);
  if (pid == 0) {
    if (geteuid() == 0 &&
        (setgroups(0, NULL) != 0 || setresgid(NOBODY, NOBODY, NOBODY) != 0 ||
         setresuid(NOBODY, NOBODY, NOBODY) != 0))
      _exit(100);
    _exit(fn(arg));
  }
  int status;
  ck_assert_int_eq(waitpid(pid, &status, 0), pid);
  ck_assert(WIFEXITED(status));
  return WEXITSTATUS(status);
}

static int count_fds(void) {
  DIR *d = opendir("/proc/self/fd");
  ck_assert_ptr_nonnull(d);
  int n = 0;
  struct dirent *e;
  while ((e = readdir(d)) != NULL)
    n += e->d_name[0] != '.';
  closedir(d);
  return n;
}

static char tmpdir[64];

static void make_tmpdir(void) {
  snprintf(tmpdir, sizeof tmpdir, "/tmp/sp-client-XXXXXX");
  ck_assert_ptr_nonnull(mkdtemp(tmpdir));
}

static void remove_tmpdir(void) {
  char cmd[128];
  snprintf(cmd, sizeof cmd, "rm -rf '%s'", tmpdir);
  ck_assert_int_eq(system(cmd), 0);
}

/* ---- sp_default_socket_path ---- */

START_TEST(explicit_env_wins) {
  char buf[256];
  setenv("SHARDPORT_SOCKET", "/somewhere/else.sock", 1);
  setenv("XDG_RUNTIME_DIR", "/run/user/1000", 1);
  ck_assert_int_eq(sp_default_socket_path(buf, sizeof buf), 0);
  ck_assert_str_eq(buf, "/somewhere/else.sock");
}
END_TEST

START_TEST(root_uses_system_socket) {
  if (geteuid() != 0) {
    fprintf(stderr, "root_uses_system_socket: not root, the root branch "
                    "is checked only when the suite runs as root\n");
    return;
  }
  char buf[256];
  unsetenv("SHARDPORT_SOCKET");
  setenv("XDG_RUNTIME_DIR", "/run/user/0", 1);
  ck_assert_int_eq(sp_default_socket_path(buf, sizeof buf), 0);
  ck_assert_str_eq(buf, "/run/shardport/shardport.sock");
  /* An empty SHARDPORT_SOCKET counts as unset. */
  setenv("SHARDPORT_SOCKET", "", 1);
  ck_assert_int_eq(sp_default_socket_path(buf, sizeof buf), 0);
  ck_assert_str_eq(buf, "/run/shardport/shardport.sock");
}
END_TEST

/* Binds a socket at path (nobody listens): what a daemon leaves there. */
static void bind_at(const char *path) {
  struct sockaddr_un sa = {.sun_family = AF_UNIX};
  strcpy(sa.sun_path, path);
  int s = socket(AF_UNIX, SOCK_STREAM, 0);
  ck_assert_int_eq(bind(s, (struct sockaddr *)&sa, sizeof sa), 0);
  close(s);
}

/* A user whose own daemon's socket is in its runtime directory gets it,
 * whatever else exists. */
static int user_path(void *arg) {
  const char *dir = arg;
  char buf[256], want[256];
  const char *origin = NULL;
  unsetenv("SHARDPORT_SOCKET");
  setenv("XDG_RUNTIME_DIR", dir, 1);
  snprintf(want, sizeof want, "%s/shardport.sock", dir);
  if (sp_default_socket_origin(buf, sizeof buf, &origin) != 0 ||
      strcmp(buf, want) != 0)
    return 1;
  if (strstr(origin, "$XDG_RUNTIME_DIR/shardport.sock") == NULL)
    return 4;
  /* Too small a buffer is refused, never truncated. */
  if (sp_default_socket_path(buf, 10) != SP_EINVAL || buf[0] != '\0')
    return 2;
  setenv("SHARDPORT_SOCKET", "/x.sock", 1);
  if (sp_default_socket_origin(buf, sizeof buf, &origin) != 0 ||
      strcmp(buf, "/x.sock") != 0 ||
      strcmp(origin, "from $SHARDPORT_SOCKET") != 0)
    return 3;
  return 0;
}

START_TEST(user_uses_own_socket) {
  make_tmpdir();
  ck_assert_int_eq(chmod(tmpdir, 0755), 0);
  char path[128];
  snprintf(path, sizeof path, "%s/shardport.sock", tmpdir);
  bind_at(path);
  ck_assert_int_eq(as_unprivileged(user_path, tmpdir), 0);
  remove_tmpdir();
}
END_TEST

/* Without a usable XDG_RUNTIME_DIR (a batch job) a user looks at the
 * system socket, where the systemd service listens, and says why. */
static int no_runtime_dir(void *arg) {
  (void)arg;
  char buf[256] = "junk";
  const char *origin = NULL;
  unsetenv("SHARDPORT_SOCKET");
  unsetenv("XDG_RUNTIME_DIR");
  if (sp_default_socket_origin(buf, sizeof buf, &origin) != 0 ||
      strcmp(buf, "/run/shardport/shardport.sock") != 0)
    return 1;
  if (strncmp(origin, "the system socket", 17) != 0 ||
      strstr(origin, "XDG_RUNTIME_DIR is not set") == NULL)
    return 2;
  /* An empty or relative runtime directory is invalid (XDG base
   * directory rules): the same. */
  setenv("XDG_RUNTIME_DIR", "", 1);
  if (sp_default_socket_path(buf, sizeof buf) != 0 ||
      strcmp(buf, "/run/shardport/shardport.sock") != 0)
    return 3;
  setenv("XDG_RUNTIME_DIR", "run/user/4242", 1);
  if (sp_default_socket_path(buf, sizeof buf) != 0 ||
      strcmp(buf, "/run/shardport/shardport.sock") != 0)
    return 4;
  return 0;
}

START_TEST(user_without_runtime_dir_looks_at_system_socket) {
  ck_assert_int_eq(as_unprivileged(no_runtime_dir, NULL), 0);
}
END_TEST

START_TEST(bad_buffers) {
  char buf[4];
  ck_assert_int_eq(sp_default_socket_path(NULL, 100), SP_EINVAL);
  ck_assert_int_eq(sp_default_socket_path(buf, 0), SP_EINVAL);
}
END_TEST

/* ---- sp_connect failures ---- */

static void expect_connect(const char *path, int code) {
  sp_client *sentinel = (sp_client *)&tmpdir, *c = sentinel;
  ck_assert_int_eq(sp_connect(path, &c), code);
  /* On failure *out is untouched. */
  ck_assert_ptr_eq(c, sentinel);
}

START_TEST(missing_socket_is_no_daemon) {
  char path[128];
  make_tmpdir();
  snprintf(path, sizeof path, "%s/none.sock", tmpdir);
  expect_connect(path, SP_ENODAEMON);
  snprintf(path, sizeof path, "%s/no/such/dir.sock", tmpdir);
  expect_connect(path, SP_ENODAEMON);
  /* The default path too, when SHARDPORT_SOCKET points nowhere. */
  snprintf(path, sizeof path, "%s/none.sock", tmpdir);
  setenv("SHARDPORT_SOCKET", path, 1);
  expect_connect(NULL, SP_ENODAEMON);
  remove_tmpdir();
}
END_TEST

START_TEST(stale_socket_is_no_daemon) {
  char path[128];
  make_tmpdir();
  snprintf(path, sizeof path, "%s/stale.sock", tmpdir);
  struct sockaddr_un sa = {.sun_family = AF_UNIX};
  strcpy(sa.sun_path, path);
  int s = socket(AF_UNIX, SOCK_STREAM, 0);
  ck_assert_int_eq(bind(s, (struct sockaddr *)&sa, sizeof sa), 0);
  close(s); /* the file stays, nobody listens: ECONNREFUSED */
  expect_connect(path, SP_ENODAEMON);

  snprintf(path, sizeof path, "%s/plain-file", tmpdir);
  FILE *f = fopen(path, "w");
  ck_assert_ptr_nonnull(f);
  fclose(f);
  expect_connect(path, SP_ENODAEMON);
  remove_tmpdir();
}
END_TEST

START_TEST(bad_paths_are_invalid) {
  char path[300];
  memset(path, 'a', sizeof path - 1);
  path[0] = '/';
  path[sizeof path - 1] = '\0';
  expect_connect(path, SP_EINVAL);
  expect_connect("", SP_EINVAL);
  ck_assert_int_eq(sp_connect("/tmp/x.sock", NULL), SP_EINVAL);
}
END_TEST

static int forbidden(void *arg) {
  const char *path = arg;
  sp_client *c = NULL;
  int rc = sp_connect(path, &c);
  return rc == SP_EPERM && c == NULL ? 0 : 1;
}

START_TEST(forbidden_directory_is_permission_denied) {
  char path[128];
  make_tmpdir();
  snprintf(path, sizeof path, "%s/d", tmpdir);
  ck_assert_int_eq(mkdir(path, 0700), 0);
  snprintf(path, sizeof path, "%s/d/s.sock", tmpdir);
  struct sockaddr_un sa = {.sun_family = AF_UNIX};
  strcpy(sa.sun_path, path);
  int s = socket(AF_UNIX, SOCK_STREAM, 0);
  ck_assert_int_eq(bind(s, (struct sockaddr *)&sa, sizeof sa), 0);
  ck_assert_int_eq(listen(s, 1), 0);
  /* As root the child runs as nobody, whom 0700 keeps out; otherwise the
   * directory is closed to its owner too. */
  char dir[128];
  snprintf(dir, sizeof dir, "%s/d", tmpdir);
  if (geteuid() != 0)
    ck_assert_int_eq(chmod(dir, 0), 0);
  ck_assert_int_eq(as_unprivileged(forbidden, path), 0);
  chmod(dir, 0700);
  close(s);
  remove_tmpdir();
}
END_TEST

/* ---- sp_connect_explain ---- */

/* The explanation of connecting to path (NULL: the default) and its code. */
static int explain(const char *path, char *why, size_t len) {
  sp_client *c = NULL;
  int rc = sp_connect_explain(path, &c, why, len);
  ck_assert_ptr_null(c);
  return rc;
}

START_TEST(explanations_name_path_and_cause) {
  char path[128], why[1024];
  make_tmpdir();
  snprintf(path, sizeof path, "%s/none.sock", tmpdir);
  ck_assert_int_eq(explain(path, why, sizeof why), SP_ENODAEMON);
  ck_assert_msg(strstr(why, path) && strstr(why, "nothing is there") &&
                    strstr(why, "start shardportd"),
                "%s", why);
  /* A default path says where it came from. */
  setenv("SHARDPORT_SOCKET", path, 1);
  ck_assert_int_eq(explain(NULL, why, sizeof why), SP_ENODAEMON);
  unsetenv("SHARDPORT_SOCKET");
  ck_assert_msg(strstr(why, "(from $SHARDPORT_SOCKET)"), "%s", why);
  /* A socket file nobody answers on. */
  snprintf(path, sizeof path, "%s/stale.sock", tmpdir);
  bind_at(path);
  ck_assert_int_eq(explain(path, why, sizeof why), SP_ENODAEMON);
  ck_assert_msg(strstr(why, "nobody answers"), "%s", why);
  /* A short buffer gets a terminated prefix; none at all is fine. */
  ck_assert_int_eq(explain(path, why, 8), SP_ENODAEMON);
  ck_assert_uint_eq(strlen(why), 7);
  ck_assert_int_eq(explain(path, NULL, 0), SP_ENODAEMON);
  remove_tmpdir();
}
END_TEST

static int denied_by_file_system(void *arg) {
  char why[1024];
  sp_client *c = NULL;
  if (sp_connect_explain(arg, &c, why, sizeof why) != SP_EPERM)
    return 1;
  /* Not the daemon: the file system.  Its group is root's, which nobody
   * should join: the daemon's settings that name another are what to
   * change. */
  if (strstr(why, "the file system denies") == NULL ||
      strstr(why, "its directory is mode 0750, group root") == NULL ||
      strstr(why, "set socket_group and allowed_gid") == NULL ||
      strstr(why, "usermod") != NULL)
    return 2;
  return 0;
}

START_TEST(file_system_denial_names_the_group) {
  if (geteuid() != 0) {
    fprintf(stderr, "file_system_denial_names_the_group: not root; it needs "
                    "a directory another user cannot enter\n");
    return;
  }
  char path[160], dir[128];
  make_tmpdir();
  ck_assert_int_eq(chmod(tmpdir, 0755), 0);
  snprintf(dir, sizeof dir, "%s/d", tmpdir);
  ck_assert_int_eq(mkdir(dir, 0750), 0);
  ck_assert_int_eq(chmod(dir, 0750), 0);
  snprintf(path, sizeof path, "%s/s.sock", dir);
  bind_at(path);
  ck_assert_int_eq(as_unprivileged(denied_by_file_system, path), 0);
  remove_tmpdir();
}
END_TEST

START_TEST(failed_connects_leak_no_fd) {
  char path[128];
  make_tmpdir();
  snprintf(path, sizeof path, "%s/none.sock", tmpdir);
  int before = count_fds();
  for (int i = 0; i < 100; i++) {
    sp_client *c;
    ck_assert_int_eq(sp_connect(path, &c), SP_ENODAEMON);
  }
  ck_assert_int_eq(count_fds(), before);
  remove_tmpdir();
}
END_TEST

START_TEST(null_clients_are_refused) {
  sp_status_info *st = NULL;
  uint64_t rtt;
  ck_assert_int_eq(sp_ping(NULL, &rtt), SP_EINVAL);
  ck_assert_int_eq(sp_status(NULL, &st), SP_EINVAL);
  ck_assert_ptr_null(st);
  ck_assert_int_eq(sp_set_timeout(NULL, 5), SP_EINVAL);
  ck_assert_str_eq(sp_last_message(NULL), "");
  sp_close(NULL);
  sp_status_free(NULL);
}
END_TEST

int main(void) {
  Suite *s = suite_create("client_socket");
  TCase *path = tcase_create("default_path");
  tcase_add_test(path, explicit_env_wins);
  tcase_add_test(path, root_uses_system_socket);
  tcase_add_test(path, user_uses_own_socket);
  tcase_add_test(path, user_without_runtime_dir_looks_at_system_socket);
  tcase_add_test(path, bad_buffers);
  suite_add_tcase(s, path);
  TCase *conn = tcase_create("connect");
  tcase_add_test(conn, missing_socket_is_no_daemon);
  tcase_add_test(conn, stale_socket_is_no_daemon);
  tcase_add_test(conn, bad_paths_are_invalid);
  tcase_add_test(conn, forbidden_directory_is_permission_denied);
  tcase_add_test(conn, explanations_name_path_and_cause);
  tcase_add_test(conn, file_system_denial_names_the_group);
  tcase_add_test(conn, failed_connects_leak_no_fd);
  tcase_add_test(conn, null_clients_are_refused);
  suite_add_tcase(s, conn);
  SRunner *sr = srunner_create(s);
  srunner_run_all(sr, CK_NORMAL);
  int failed = srunner_ntests_failed(sr);
  srunner_free(sr);
  return failed == 0 ? 0 : 1;
}
