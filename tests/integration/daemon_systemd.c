/*
 * daemon_systemd.c - shardportd under a service manager, without one: the
 * notify protocol through a datagram socket this test binds as
 * NOTIFY_SOCKET, and socket activation through systemd-socket-activate.
 *
 * usage: test-daemon-systemd notify | activation
 * (meson runs each as its own test; activation needs the path of
 * systemd-socket-activate in $SYSTEMD_SOCKET_ACTIVATE).
 */
#include <check.h>
#include <poll.h>
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

static int64_t now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static char notify_dir[256];
static char notify_path[300];
static int notify_sock = -1;

/* Binds the datagram socket a service manager would listen on. */
static void notify_setup(void) {
  ck_assert_int_eq(sp_test_mkdtemp(notify_dir, sizeof(notify_dir)), 0);
  snprintf(notify_path, sizeof(notify_path), "%s/notify", notify_dir);
  notify_sock = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  ck_assert_int_ge(notify_sock, 0);
  struct sockaddr_un sa = {.sun_family = AF_UNIX};
  ck_assert_uint_lt(strlen(notify_path), sizeof(sa.sun_path));
  memcpy(sa.sun_path, notify_path, strlen(notify_path) + 1);
  ck_assert_int_eq(bind(notify_sock, (struct sockaddr *)&sa, sizeof(sa)), 0);
  ck_assert_int_eq(setenv("NOTIFY_SOCKET", notify_path, 1), 0);
  unsetenv("WATCHDOG_PID");
  unsetenv("WATCHDOG_USEC");
}

static void notify_teardown(void) {
  if (notify_sock >= 0)
    close(notify_sock);
  notify_sock = -1;
  unsetenv("NOTIFY_SOCKET");
  sp_test_rmdir(notify_dir);
}

/* Reads notify datagrams until one contains line (a whole line such as
 * "READY=1"), appending everything read to log.  1 when seen, 0 after
 * timeout_ms. */
static int await_line(const char *line, int timeout_ms, char *log,
                      size_t logsize) {
  int64_t deadline = now_ms() + timeout_ms;
  for (;;) {
    int64_t left = deadline - now_ms();
    if (left <= 0)
      return 0;
    struct pollfd p = {.fd = notify_sock, .events = POLLIN};
    if (poll(&p, 1, (int)left) <= 0)
      continue;
    char msg[4096];
    ssize_t n = recv(notify_sock, msg, sizeof(msg) - 1, 0);
    if (n <= 0)
      continue;
    msg[n] = '\0';
    size_t used = strlen(log);
    snprintf(log + used, logsize - used, "%s\n", msg);
    char *save = NULL;
    for (char *l = strtok_r(msg, "\n", &save); l != NULL;
         l = strtok_r(NULL, "\n", &save))
      if (strcmp(l, line) == 0)
        return 1;
  }
}

START_TEST(ready_status_watchdog_stopping) {
  /* 200 ms: the daemon must ping every 100 ms. */
  ck_assert_int_eq(setenv("WATCHDOG_USEC", "200000", 1), 0);
  struct sp_test_daemon d;
  ck_assert_int_eq(sp_test_daemon_start(&d, NULL), 0);
  char log[16384] = "";
  ck_assert_msg(await_line("READY=1", SP_TEST_TIMEOUT_MS, log, sizeof(log)),
                "no READY=1; got:\n%s", log);
  char expect[400];
  snprintf(expect, sizeof(expect), "STATUS=serving on %s", d.socket);
  ck_assert_msg(strstr(log, expect) != NULL, "no \"%s\" in:\n%s", expect, log);
  /* Several pings arrive, so the timer repeats. */
  for (int i = 0; i < 3; i++)
    ck_assert_msg(
        await_line("WATCHDOG=1", SP_TEST_TIMEOUT_MS, log, sizeof(log)),
        "no WATCHDOG=1; got:\n%s", log);
  /* The daemon is serving while it notifies. */
  int sock = sp_test_connect_hello(d.socket);
  ck_assert_int_ge(sock, 0);
  ck_assert_int_eq(sp_test_ping(sock, 1), 0);
  close(sock);

  ck_assert_int_eq(kill(d.pid, SIGTERM), 0);
  ck_assert_msg(await_line("STOPPING=1", SP_TEST_TIMEOUT_MS, log, sizeof(log)),
                "no STOPPING=1; got:\n%s", log);
  ck_assert_int_eq(sp_test_wait(d.pid, SP_TEST_TIMEOUT_MS), 0);
  d.pid = -1;
  sp_test_daemon_stop(&d);
}
END_TEST

/* Reads notify datagrams until one holds a line starting with prefix;
 * copies that line into found.  1 when seen, 0 after timeout_ms. */
static int await_prefix(const char *prefix, int timeout_ms, char *found,
                        size_t size) {
  int64_t deadline = now_ms() + timeout_ms;
  for (;;) {
    int64_t left = deadline - now_ms();
    if (left <= 0)
      return 0;
    struct pollfd p = {.fd = notify_sock, .events = POLLIN};
    if (poll(&p, 1, (int)left) <= 0)
      continue;
    char msg[4096];
    ssize_t n = recv(notify_sock, msg, sizeof(msg) - 1, 0);
    if (n <= 0)
      continue;
    msg[n] = '\0';
    char *save = NULL;
    for (char *l = strtok_r(msg, "\n", &save); l != NULL;
         l = strtok_r(NULL, "\n", &save))
      if (strncmp(l, prefix, strlen(prefix)) == 0) {
        snprintf(found, size, "%s", l);
        return 1;
      }
  }
}

/* SIGHUP: RELOADING=1 with the monotonic time, then READY=1.  SIGTERM:
 * STOPPING=1 with how long the drain may take (drain_timeout plus 15 s for
 * the last replies), so that systemd does not kill it mid-drain. */
START_TEST(reloading_and_stop_timeout) {
  char conf[320];
  snprintf(conf, sizeof(conf), "%s/d.conf", notify_dir);
  ck_assert_int_eq(sp_test_write_file(conf, "drain_timeout = 100s\n"), 0);
  const char *args[] = {"--config", conf, NULL};
  struct sp_test_daemon d;
  ck_assert_int_eq(sp_test_daemon_start(&d, args), 0);
  char log[16384] = "", line[256];
  ck_assert(await_line("READY=1", SP_TEST_TIMEOUT_MS, log, sizeof(log)));
  ck_assert_int_eq(kill(d.pid, SIGHUP), 0);
  ck_assert_msg(await_line("RELOADING=1", SP_TEST_TIMEOUT_MS, log, sizeof(log)),
                "no RELOADING=1; got:\n%s", log);
  /* Sent in the same datagram as RELOADING=1. */
  ck_assert_msg(strstr(log, "RELOADING=1\nSTATUS=reloading the configuration"
                            "\nMONOTONIC_USEC=") != NULL,
                "no MONOTONIC_USEC; got:\n%s", log);
  ck_assert_msg(await_line("READY=1", SP_TEST_TIMEOUT_MS, log, sizeof(log)),
                "no READY=1 after the reload; got:\n%s", log);
  ck_assert_int_eq(kill(d.pid, SIGTERM), 0);
  ck_assert_msg(await_prefix("EXTEND_TIMEOUT_USEC=", SP_TEST_TIMEOUT_MS, line,
                             sizeof line),
                "no EXTEND_TIMEOUT_USEC");
  ck_assert_str_eq(line, "EXTEND_TIMEOUT_USEC=115000000");
  ck_assert_int_eq(sp_test_wait(d.pid, SP_TEST_TIMEOUT_MS), 0);
  d.pid = -1;
  sp_test_daemon_stop(&d);
}
END_TEST

START_TEST(watchdog_off_by_config) {
  ck_assert_int_eq(setenv("WATCHDOG_USEC", "200000", 1), 0);
  char conf[320];
  snprintf(conf, sizeof(conf), "%s/d.conf", notify_dir);
  ck_assert_int_eq(sp_test_write_file(conf, "watchdog = no\n"), 0);
  const char *args[] = {"--config", conf, NULL};
  struct sp_test_daemon d;
  ck_assert_int_eq(sp_test_daemon_start(&d, args), 0);
  char log[16384] = "";
  ck_assert(await_line("READY=1", SP_TEST_TIMEOUT_MS, log, sizeof(log)));
  ck_assert_msg(!await_line("WATCHDOG=1", 600, log, sizeof(log)),
                "WATCHDOG=1 although watchdog = no:\n%s", log);
  ck_assert_int_eq(sp_test_daemon_stop(&d), 0);
}
END_TEST

START_TEST(no_watchdog_unless_asked) {
  struct sp_test_daemon d;
  ck_assert_int_eq(sp_test_daemon_start(&d, NULL), 0);
  char log[16384] = "";
  ck_assert(await_line("READY=1", SP_TEST_TIMEOUT_MS, log, sizeof(log)));
  ck_assert(!await_line("WATCHDOG=1", 600, log, sizeof(log)));
  ck_assert_int_eq(sp_test_daemon_stop(&d), 0);
}
END_TEST

START_TEST(socket_activation) {
  const char *activate = getenv("SYSTEMD_SOCKET_ACTIVATE");
  ck_assert_msg(activate != NULL && activate[0] != '\0',
                "SYSTEMD_SOCKET_ACTIVATE is not set");
  char dir[256], path[300];
  ck_assert_int_eq(sp_test_mkdtemp(dir, sizeof(dir)), 0);
  snprintf(path, sizeof(path), "%s/s.sock", dir);

  /* --socket names a directory that does not exist: a daemon that ignored
   * the passed socket and made its own would fail to start. */
  pid_t pid = fork();
  ck_assert_int_ge(pid, 0);
  if (pid == 0) {
    execl(activate, activate, "-l", path, sp_test_daemon_path(), "--config",
          "/dev/null", "--socket", "/nonexistent/shardport.sock", (char *)NULL);
    _exit(127);
  }
  int sock = -1;
  for (int i = 0; i < 1000 && sock < 0; i++) {
    sock = sp_test_connect(path);
    if (sock < 0) {
      struct timespec ts = {0, 10 * 1000 * 1000};
      nanosleep(&ts, NULL);
    }
  }
  ck_assert_int_ge(sock, 0);
  /* The first connection makes systemd-socket-activate exec the daemon,
   * which finds the connection waiting on the socket it was given. */
  ck_assert_int_eq(sp_test_hello(sock, SP_PROTOCOL_VERSION), 0);
  ck_assert_int_eq(sp_test_ping(sock, 2), 0);
  ck_assert_int_eq(sp_test_send_op(sock, "status", 3, NULL, 0), 0);
  struct sp_test_reply r;
  ck_assert_int_eq(sp_test_recv(sock, &r, SP_TEST_TIMEOUT_MS), 0);
  ck_assert_str_eq(r.head.op, "status");
  sp_test_reply_free(&r);
  close(sock);
  int again = sp_test_connect_hello(path);
  ck_assert_int_ge(again, 0);
  ck_assert_int_eq(sp_test_ping(again, 4), 0);
  close(again);

  ck_assert_int_eq(kill(pid, SIGTERM), 0);
  ck_assert_int_eq(sp_test_wait(pid, SP_TEST_TIMEOUT_MS), 0);
  /* The socket is systemd's: the daemon leaves it in place. */
  struct stat st;
  ck_assert_int_eq(lstat(path, &st), 0);
  ck_assert(S_ISSOCK(st.st_mode));
  ck_assert_int_eq(stat("/nonexistent/shardport.sock", &st), -1);
  sp_test_rmdir(dir);
}
END_TEST

int main(int argc, char **argv) {
  if (argc != 2 ||
      (strcmp(argv[1], "notify") != 0 && strcmp(argv[1], "activation") != 0)) {
    fprintf(stderr, "usage: %s notify|activation\n", argv[0]);
    return 2;
  }
  if (!SP_HAVE_SYSTEMD) {
    printf("daemon-systemd: SKIPPED: built without libsystemd\n");
    return 77;
  }
  Suite *s = suite_create("daemon-systemd");
  TCase *notify = tcase_create("notify");
  tcase_add_checked_fixture(notify, notify_setup, notify_teardown);
  tcase_set_timeout(notify, 50);
  tcase_add_test(notify, ready_status_watchdog_stopping);
  tcase_add_test(notify, watchdog_off_by_config);
  tcase_add_test(notify, no_watchdog_unless_asked);
  tcase_add_test(notify, reloading_and_stop_timeout);
  suite_add_tcase(s, notify);
  TCase *activation = tcase_create("activation");
  tcase_set_timeout(activation, 50);
  tcase_add_test(activation, socket_activation);
  suite_add_tcase(s, activation);
  SRunner *sr = srunner_create(s);
  srunner_run(sr, NULL, argv[1], CK_NORMAL);
  int failed = srunner_ntests_failed(sr);
  int run = srunner_ntests_run(sr);
  srunner_free(sr);
  return failed == 0 && run > 0 ? EXIT_SUCCESS : EXIT_FAILURE;
}
