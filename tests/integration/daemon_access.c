/*
 * daemon_access.c - who may connect, and where the socket may live.
 *
 * Peers are checked with SO_PEERCRED against the allowed uids and gid; the
 * socket directory must belong to the daemon's uid and not be writable by
 * everyone; a stale socket is removed, a live one or a non-socket is not.
 * A job may be aborted by the user who created it and by root only.
 * These tests need root (to chown and to become other users), and the
 * suite says it skipped when it is not root.
 */
#include <check.h>
#include <errno.h>
#include <grp.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "build_config.h"
#include "tests/integration/harness.h"

#define OTHER_ID 12345
#define NOBODY 65534

static struct sp_test_daemon daemon_;
static char conf_dir[256];

static void sleep_ms(int ms) {
  struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
  nanosleep(&ts, NULL);
}

/* Starts a daemon with the given configuration text; the socket and its
 * directory are then opened to everyone, so that only the SO_PEERCRED check
 * stands between other users and the daemon. */
static void start_with(const char *conf) {
  ck_assert_int_eq(sp_test_mkdtemp(conf_dir, sizeof(conf_dir)), 0);
  char path[300];
  snprintf(path, sizeof(path), "%s/d.conf", conf_dir);
  ck_assert_int_eq(sp_test_write_file(path, conf), 0);
  const char *args[] = {"--config", path, NULL};
  ck_assert_int_eq(sp_test_daemon_start(&daemon_, args), 0);
  ck_assert_int_eq(chmod(daemon_.dir, 0755), 0);
  ck_assert_int_eq(chmod(daemon_.socket, 0666), 0);
}

static void stop_daemon(void) {
  if (daemon_.pid > 0)
    ck_assert_int_eq(sp_test_daemon_stop(&daemon_), 0);
  if (conf_dir[0] != '\0')
    sp_test_rmdir(conf_dir);
  conf_dir[0] = '\0';
}

/* In a child that became uid/gid (with one supplementary group when
 * supp >= 0): the result of connect + hello, 0 or a negative code. */
static int hello_as(uid_t uid, gid_t gid, int supp) {
  pid_t pid = fork();
  ck_assert_int_ge(pid, 0);
  if (pid == 0) {
    gid_t groups[1] = {(gid_t)supp};
    if (setgroups(supp >= 0 ? 1 : 0, groups) != 0 || setgid(gid) != 0 ||
        setuid(uid) != 0)
      _exit(100);
    int sock = sp_test_connect(daemon_.socket);
    if (sock < 0)
      _exit(101);
    int rc = sp_test_hello(sock, SP_PROTOCOL_VERSION);
    if (rc == 0)
      rc = sp_test_ping(sock, 2);
    if (rc == SP_EPERM && sp_test_wait_closed(sock, SP_TEST_TIMEOUT_MS) != 0)
      _exit(102);
    _exit(rc == 0 ? 0 : rc == SP_EPERM ? 1 : 103);
  }
  int status = sp_test_wait(pid, 2 * SP_TEST_TIMEOUT_MS);
  ck_assert_msg(status == 0 || status == 1, "child failed with %d", status);
  return status == 0 ? 0 : SP_EPERM;
}

START_TEST(uid_not_allowed) {
  start_with("allowed_uids = 12345\nallowed_gid = 12345\n");
  /* Root is not special, and neither is the daemon's own uid: the
   * configuration says who may connect. */
  int sock = sp_test_connect(daemon_.socket);
  ck_assert_int_ge(sock, 0);
  ck_assert_int_eq(sp_test_hello(sock, SP_PROTOCOL_VERSION), SP_EPERM);
  ck_assert_int_eq(sp_test_wait_closed(sock, SP_TEST_TIMEOUT_MS), 0);
  close(sock);
  /* The allowed uid gets in. */
  ck_assert_int_eq(hello_as(OTHER_ID, NOBODY, -1), 0);
  ck_assert_int_eq(hello_as(NOBODY, NOBODY, -1), SP_EPERM);
}
END_TEST

START_TEST(default_allows_root_and_own_group_only) {
  start_with("");
  int sock = sp_test_connect_hello(daemon_.socket);
  ck_assert_int_ge(sock, 0);
  close(sock);
  ck_assert_int_eq(hello_as(NOBODY, NOBODY, -1), SP_EPERM);
  /* The daemon's own gid (root's here) lets a member in. */
  ck_assert_int_eq(hello_as(NOBODY, getegid(), -1), 0);
}
END_TEST

START_TEST(allowed_by_group) {
  start_with("allowed_uids = none\nallowed_gid = 12345\n");
  ck_assert_int_eq(hello_as(NOBODY, OTHER_ID, -1), 0);
  /* A supplementary group counts (SO_PEERGROUPS). */
  ck_assert_int_eq(hello_as(NOBODY, NOBODY, OTHER_ID), 0);
  ck_assert_int_eq(hello_as(NOBODY, NOBODY, -1), SP_EPERM);
  int sock = sp_test_connect(daemon_.socket);
  ck_assert_int_ge(sock, 0);
  ck_assert_int_eq(sp_test_hello(sock, SP_PROTOCOL_VERSION), SP_EPERM);
  close(sock);
}
END_TEST

/* A child that became uid (and gid) runs fn(arg, out) with out the write
 * end of a pipe to the test; the test reads what it wrote into buf.  The
 * child's exit status (fn's result), or -1. */
static int as_user(uid_t uid, int (*fn)(const char *arg, int out),
                   const char *arg, char *buf, size_t size, pid_t *child) {
  int p[2];
  ck_assert_int_eq(pipe(p), 0);
  pid_t pid = fork();
  ck_assert_int_ge(pid, 0);
  if (pid == 0) {
    close(p[0]);
    if (setgroups(0, NULL) != 0 || setgid(uid) != 0 || setuid(uid) != 0)
      _exit(100);
    _exit(fn(arg, p[1]));
  }
  close(p[1]);
  size_t got = 0;
  ssize_t n;
  while (got + 1 < size && (n = read(p[0], buf + got, size - 1 - got)) > 0)
    got += (size_t)n;
  buf[got] = '\0';
  close(p[0]);
  if (child != NULL) {
    *child = pid;
    return 0;
  }
  return sp_test_wait(pid, 2 * SP_TEST_TIMEOUT_MS);
}

/* A request {"op": op, "job": job} on a new connection: the reply's error
 * code (0 for success) and its message in msg. */
static int job_request(const char *op, const char *job, char *msg,
                       size_t size) {
  int sock = sp_test_connect_hello(daemon_.socket);
  if (sock < 0)
    return sock;
  struct sp_msgbuf mb;
  sp__msgbuf_begin(&mb, op, 7, 1);
  sp__pack_kv_str(&mb.pk, "job", job);
  struct sp_test_reply r;
  int rc = sp_test_send_msgbuf(sock, &mb, NULL, 0);
  if (rc == 0)
    rc = sp_test_recv(sock, &r, SP_TEST_TIMEOUT_MS);
  if (rc == 0) {
    rc = r.code;
    snprintf(msg, size, "%s", r.message);
    sp_test_reply_free(&r);
  }
  close(sock);
  return rc;
}

/* Creates a job of world 2 and joins it as rank 0; writes its id on out,
 * then waits for the daemon's last word: 0 when it is `aborted` naming the
 * uid arg as the one who aborted, 1 otherwise. */
static int own_a_job(const char *arg, int out) {
  int sock = sp_test_connect_hello(daemon_.socket);
  if (sock < 0)
    return 2;
  struct sp_msgbuf mb;
  struct sp_test_reply r;
  sp__msgbuf_begin(&mb, "job_create", 1, 1);
  sp__pack_kv_u64(&mb.pk, "world", 2);
  char hex[33];
  const uint8_t *ticket;
  size_t len;
  if (sp_test_send_msgbuf(sock, &mb, NULL, 0) != 0 ||
      sp_test_recv(sock, &r, SP_TEST_TIMEOUT_MS) != 0 || r.code != 0 ||
      sp__msg_get_strbuf(&r.map, "job_id", false, hex, sizeof hex) != 0 ||
      sp__msg_get_bin(&r.map, "ticket", false, &ticket, &len) != 0)
    return 3;
  sp__msgbuf_begin(&mb, "join", 2, 4);
  sp__pack_str(&mb.pk, "ticket");
  sp__pack_bin(&mb.pk, ticket, len);
  sp__pack_kv_u64(&mb.pk, "rank", 0);
  sp__pack_kv_u64(&mb.pk, "world", 2);
  sp__pack_kv_str(&mb.pk, "device", "cpu");
  sp_test_reply_free(&r);
  if (sp_test_send_msgbuf(sock, &mb, NULL, 0) != 0 ||
      sp_test_recv(sock, &r, SP_TEST_TIMEOUT_MS) != 0 || r.code != 0)
    return 4;
  sp_test_reply_free(&r);
  if (write(out, hex, 32) != 32)
    return 5;
  close(out);
  if (sp_test_recv(sock, &r, 2 * SP_TEST_TIMEOUT_MS) != 0)
    return 6;
  char who[64];
  snprintf(who, sizeof who, "aborted by uid %s ", arg);
  int ok = r.head.id == 0 && r.code == SP_EABORTED &&
           strstr(r.message, who) != NULL;
  sp_test_reply_free(&r);
  close(sock);
  return ok ? 0 : 1;
}

/* Aborts the job arg; writes the reply's code and message on out. */
static int try_abort(const char *arg, int out) {
  char msg[1100];
  int rc = job_request("job_abort", arg, msg, sizeof msg);
  dprintf(out, "%d %s", rc, msg);
  return 0;
}

/* Only the user who created a job, or root, may abort it; the ranks hear
 * who did. */
START_TEST(abort_only_by_owner_or_root) {
  start_with("allowed_uids = 0, 12345, 65534\n");
  char hex[64], answer[1200];
  pid_t owner;
  ck_assert_int_eq(as_user(NOBODY, own_a_job, "0", hex, sizeof hex, &owner),
                   0);
  ck_assert_uint_eq(strlen(hex), 32);

  /* Another user may look but not abort. */
  char msg[1100];
  ck_assert_int_eq(job_request("job_status", hex, msg, sizeof msg), 0);
  ck_assert_int_eq(
      as_user(OTHER_ID, try_abort, hex, answer, sizeof answer, NULL), 0);
  char want[64];
  snprintf(want, sizeof want, "%d ", SP_EPERM);
  ck_assert_msg(strncmp(answer, want, strlen(want)) == 0, "%s", answer);
  ck_assert_ptr_nonnull(strstr(answer, "belongs to uid 65534"));

  /* The owner may, from any of its processes. */
  char second[64];
  pid_t owner2;
  ck_assert_int_eq(
      as_user(NOBODY, own_a_job, "65534", second, sizeof second, &owner2), 0);
  ck_assert_int_eq(
      as_user(NOBODY, try_abort, second, answer, sizeof answer, NULL), 0);
  ck_assert_msg(strncmp(answer, "0 ", 2) == 0, "%s", answer);
  ck_assert_int_eq(sp_test_wait(owner2, 2 * SP_TEST_TIMEOUT_MS), 0);

  /* Root may abort anyone's. */
  ck_assert_int_eq(job_request("job_abort", hex, msg, sizeof msg), 0);
  ck_assert_int_eq(sp_test_wait(owner, 2 * SP_TEST_TIMEOUT_MS), 0);
}
END_TEST

START_TEST(socket_mode_and_group) {
  char conf[128];
  snprintf(conf, sizeof(conf), "socket_group = %d\n", OTHER_ID);
  ck_assert_int_eq(sp_test_mkdtemp(conf_dir, sizeof(conf_dir)), 0);
  char path[300];
  snprintf(path, sizeof(path), "%s/d.conf", conf_dir);
  ck_assert_int_eq(sp_test_write_file(path, conf), 0);
  const char *args[] = {"--config", path, NULL};
  ck_assert_int_eq(sp_test_daemon_start(&daemon_, args), 0);
  struct stat st;
  ck_assert_int_eq(lstat(daemon_.socket, &st), 0);
  ck_assert(S_ISSOCK(st.st_mode));
  ck_assert_uint_eq(st.st_mode & 07777, 0660);
  ck_assert_uint_eq(st.st_gid, OTHER_ID);
}
END_TEST

/* Runs a daemon on path that is expected to refuse to start: exit 3. */
static int run_refused(const char *path) {
  const char *args[] = {"--config", "/dev/null", "--socket", path, NULL};
  pid_t pid = sp_test_spawn(args);
  ck_assert_int_gt(pid, 0);
  int status = sp_test_wait(pid, SP_TEST_TIMEOUT_MS);
  if (status == SP_ETIMEOUT) {
    kill(pid, SIGKILL);
    waitpid(pid, NULL, 0);
  }
  return status;
}

START_TEST(world_writable_dir_refused) {
  char dir[256], path[300];
  ck_assert_int_eq(sp_test_mkdtemp(dir, sizeof(dir)), 0);
  snprintf(path, sizeof(path), "%s/s.sock", dir);
  struct stat st;
  ck_assert_int_eq(chmod(dir, 0777), 0);
  ck_assert_int_eq(run_refused(path), 3);
  ck_assert_int_ne(lstat(path, &st), 0);
  /* The sticky bit does not make a shared directory safe. */
  ck_assert_int_eq(chmod(dir, 01777), 0);
  ck_assert_int_eq(run_refused(path), 3);
  ck_assert_int_ne(lstat(path, &st), 0);
  sp_test_rmdir(dir);
}
END_TEST

START_TEST(foreign_dir_refused) {
  char dir[256], path[300];
  ck_assert_int_eq(sp_test_mkdtemp(dir, sizeof(dir)), 0);
  snprintf(path, sizeof(path), "%s/s.sock", dir);
  ck_assert_int_eq(chown(dir, OTHER_ID, OTHER_ID), 0);
  ck_assert_int_eq(run_refused(path), 3);
  struct stat st;
  ck_assert_int_ne(lstat(path, &st), 0);
  sp_test_rmdir(dir);
}
END_TEST

START_TEST(missing_dir_not_created) {
  char dir[256], path[320], sub[300];
  ck_assert_int_eq(sp_test_mkdtemp(dir, sizeof(dir)), 0);
  snprintf(sub, sizeof(sub), "%s/nope", dir);
  snprintf(path, sizeof(path), "%s/s.sock", sub);
  ck_assert_int_eq(run_refused(path), 3);
  struct stat st;
  ck_assert_int_ne(stat(sub, &st), 0);
  sp_test_rmdir(dir);
}
END_TEST

START_TEST(non_socket_kept) {
  char dir[256], path[300];
  ck_assert_int_eq(sp_test_mkdtemp(dir, sizeof(dir)), 0);
  snprintf(path, sizeof(path), "%s/s.sock", dir);
  ck_assert_int_eq(sp_test_write_file(path, "precious"), 0);
  ck_assert_int_eq(run_refused(path), 3);
  FILE *f = fopen(path, "r");
  ck_assert_ptr_nonnull(f);
  char buf[16] = "";
  ck_assert_ptr_nonnull(fgets(buf, sizeof(buf), f));
  fclose(f);
  ck_assert_str_eq(buf, "precious");
  sp_test_rmdir(dir);
}
END_TEST

START_TEST(live_socket_kept) {
  ck_assert_int_eq(sp_test_daemon_start(&daemon_, NULL), 0);
  ck_assert_int_eq(run_refused(daemon_.socket), 3);
  /* The first daemon still owns its socket and serves. */
  int sock = sp_test_connect_hello(daemon_.socket);
  ck_assert_int_ge(sock, 0);
  ck_assert_int_eq(sp_test_ping(sock, 1), 0);
  close(sock);
}
END_TEST

START_TEST(stale_socket_removed) {
  char dir[256], path[300];
  ck_assert_int_eq(sp_test_mkdtemp(dir, sizeof(dir)), 0);
  snprintf(path, sizeof(path), "%s/s.sock", dir);
  /* A socket file nobody listens on, as a killed daemon leaves it. */
  int stale = socket(AF_UNIX, SOCK_STREAM, 0);
  struct sockaddr_un sa = {.sun_family = AF_UNIX};
  ck_assert_uint_lt(strlen(path), sizeof(sa.sun_path));
  memcpy(sa.sun_path, path, strlen(path) + 1);
  ck_assert_int_eq(bind(stale, (struct sockaddr *)&sa, sizeof(sa)), 0);
  close(stale);

  const char *args[] = {"--config", "/dev/null", "--socket", path, NULL};
  pid_t pid = sp_test_spawn(args);
  ck_assert_int_gt(pid, 0);
  int sock = -1;
  for (int i = 0; i < 1000 && sock < 0; i++) {
    sock = sp_test_connect_hello(path);
    if (sock < 0)
      sleep_ms(10);
  }
  ck_assert_int_ge(sock, 0);
  ck_assert_int_eq(sp_test_ping(sock, 1), 0);
  close(sock);
  ck_assert_int_eq(kill(pid, SIGTERM), 0);
  ck_assert_int_eq(sp_test_wait(pid, SP_TEST_TIMEOUT_MS), 0);
  struct stat st;
  ck_assert_int_ne(lstat(path, &st), 0);
  sp_test_rmdir(dir);
}
END_TEST

int main(void) {
  if (geteuid() != 0) {
    printf("daemon-access: SKIPPED: needs root to chown and to connect as "
           "other users\n");
    return 77;
  }
  Suite *s = suite_create("daemon-access");
  TCase *peers = tcase_create("peers");
  tcase_add_checked_fixture(peers, NULL, stop_daemon);
  tcase_set_timeout(peers, 50);
  tcase_add_test(peers, uid_not_allowed);
  tcase_add_test(peers, default_allows_root_and_own_group_only);
  tcase_add_test(peers, allowed_by_group);
  tcase_add_test(peers, socket_mode_and_group);
  tcase_add_test(peers, abort_only_by_owner_or_root);
  suite_add_tcase(s, peers);
  TCase *dirs = tcase_create("socket path");
  tcase_add_checked_fixture(dirs, NULL, stop_daemon);
  tcase_set_timeout(dirs, 50);
  tcase_add_test(dirs, world_writable_dir_refused);
  tcase_add_test(dirs, foreign_dir_refused);
  tcase_add_test(dirs, missing_dir_not_created);
  tcase_add_test(dirs, non_socket_kept);
  tcase_add_test(dirs, live_socket_kept);
  tcase_add_test(dirs, stale_socket_removed);
  suite_add_tcase(s, dirs);
  SRunner *sr = srunner_create(s);
  srunner_run_all(sr, CK_NORMAL);
  int failed = srunner_ntests_failed(sr);
  srunner_free(sr);
  return failed == 0 ? EXIT_SUCCESS : EXIT_FAILURE;
}
