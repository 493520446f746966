/*
 * daemon_drain.c - a daemon stopped or reloaded while it serves jobs
 * (docs/operations.md, "Stopping and restarting" and "Reloading the
 * configuration"): SIGTERM drains (running exports finish, or fail at
 * drain_timeout; new work is refused with daemon_stopping; every rank
 * then hears daemon_restarted), a second signal stops at once, the
 * library reports a daemon that went away as daemon_restarted, and SIGHUP
 * applies what may change live.
 *
 * The ranks are threads with their own sp_client (ranks.c); the engine is
 * slowed down by the test seam so that a signal lands mid-export.  The
 * daemon's log goes to a file the tests read.
 */
#include <check.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "build_config.h"
#include "tests/integration/harness.h"
#include "tests/integration/ranks.h"

static struct sp_test_daemon daemon_;
static char conf_dir[256], conf_path[300], log_path[300];

static void sleep_ms(long ms) {
  struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
  nanosleep(&ts, NULL);
}

static void start_logged(const char *const *args, const char *delay_ms);

/* Starts a daemon on the configuration conf (kept at conf_path, for
 * reloads), its stderr in log_path, the engine pausing delay_ms per round
 * (NULL: no pause). */
static void start_with(const char *conf, const char *delay_ms) {
  ck_assert_int_eq(sp_test_mkdtemp(conf_dir, sizeof conf_dir), 0);
  snprintf(conf_path, sizeof conf_path, "%s/shardportd.conf", conf_dir);
  snprintf(log_path, sizeof log_path, "%s/log", conf_dir);
  ck_assert_int_eq(sp_test_write_file(conf_path, conf), 0);
  const char *args[] = {"--config", conf_path, NULL};
  start_logged(args, delay_ms);
}

/* Starts a daemon with its stderr in log_path: through the harness with
 * args added, or, with args NULL, with nothing but its socket (so that it
 * reads its default configuration file, if there is one). */
static void start_logged(const char *const *args, const char *delay_ms) {
  int log = open(log_path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  ck_assert_int_ge(log, 0);
  int saved = dup(2);
  ck_assert_int_ge(saved, 0);
  dup2(log, 2);
  if (delay_ms != NULL)
    setenv("SHARDPORTD_TEST_ROUND_DELAY_MS", delay_ms, 1);
  int rc = 0;
  if (args != NULL) {
    rc = sp_test_daemon_start(&daemon_, args);
  } else {
    memset(&daemon_, 0, sizeof daemon_);
    ck_assert_int_eq(sp_test_mkdtemp(daemon_.dir, sizeof daemon_.dir), 0);
    snprintf(daemon_.socket, sizeof daemon_.socket, "%s/s.sock", daemon_.dir);
    const char *bare[] = {"--socket", daemon_.socket, NULL};
    daemon_.pid = sp_test_spawn(bare);
    int sock = -1;
    for (int waited = 0; daemon_.pid > 0 && sock < 0 &&
                         waited < SP_TEST_TIMEOUT_MS; waited += 10) {
      sleep_ms(10);
      sock = sp_test_connect(daemon_.socket);
    }
    rc = sock >= 0 ? 0 : -1;
    if (sock >= 0)
      close(sock);
  }
  unsetenv("SHARDPORTD_TEST_ROUND_DELAY_MS");
  dup2(saved, 2);
  close(saved);
  close(log);
  ck_assert_int_eq(rc, 0);
}

static void teardown(void) {
  if (daemon_.pid > 0)
    sp_test_daemon_stop(&daemon_);
  if (conf_dir[0] != '\0')
    sp_test_rmdir(conf_dir);
  conf_dir[0] = '\0';
}

/* Whether the daemon's log has words within timeout_ms. */
static bool log_has(const char *words, int timeout_ms) {
  for (int waited = 0;; waited += 20) {
    FILE *f = fopen(log_path, "re");
    if (f != NULL) {
      static char text[1 << 16];
      size_t n = fread(text, 1, sizeof text - 1, f);
      fclose(f);
      text[n] = '\0';
      if (strstr(text, words) != NULL)
        return true;
    }
    if (waited >= timeout_ms)
      return false;
    sleep_ms(20);
  }
}

/* The daemon exits by itself (a drain ends in a stop): its exit status. */
static int daemon_exit(void) {
  int status = sp_test_wait(daemon_.pid, SP_TEST_TIMEOUT_MS);
  if (status != SP_ETIMEOUT)
    daemon_.pid = -1;
  return status;
}

/* A request of op on sock with no fields; the reply's error code (0 for
 * success), the reply kept in r when not NULL. */
static int call_op(int sock, const char *op, uint64_t id,
                   struct sp_test_reply *r) {
  struct sp_test_reply local;
  struct sp_test_reply *out = r != NULL ? r : &local;
  ck_assert_int_eq(sp_test_send_op(sock, op, id, NULL, 0), 0);
  ck_assert_int_eq(sp_test_recv(sock, out, SP_TEST_TIMEOUT_MS), 0);
  ck_assert_uint_eq(out->head.id, id);
  int code = out->code;
  if (r == NULL)
    sp_test_reply_free(&local);
  return code;
}

static int job_create(int sock, uint64_t id, struct sp_test_reply *r) {
  struct sp_msgbuf mb;
  sp__msgbuf_begin(&mb, "job_create", id, 1);
  sp__pack_kv_u64(&mb.pk, "world", 2);
  ck_assert_int_eq(sp_test_send_msgbuf(sock, &mb, NULL, 0), 0);
  ck_assert_int_eq(sp_test_recv(sock, r, SP_TEST_TIMEOUT_MS), 0);
  ck_assert_uint_eq(r->head.id, id);
  return r->code;
}

static bool status_draining(int sock) {
  struct sp_test_reply r;
  ck_assert_int_eq(call_op(sock, "status", 90, &r), 0);
  bool draining;
  ck_assert_int_eq(sp__msg_get_bool(&r.map, "draining", false, &draining), 0);
  sp_test_reply_free(&r);
  return draining;
}

/* SIGTERM mid-export: the export finishes and is exact, status still
 * answers (draining) and new work is refused with daemon_stopping; then
 * every rank hears daemon_restarted and the daemon exits 0. */
START_TEST(drain_lets_the_running_export_finish) {
  start_with("", "100");
  struct ranks_job j = {.socket = daemon_.socket, .world = 2, .nkeys = 12,
                        .max_keys = 1};
  j.rank[0].asks = j.rank[1].asks = true;
  ranks_start(&j);
  ranks_wait_moving(&j, 0);
  ck_assert_int_eq(kill(daemon_.pid, SIGTERM), 0);
  ck_assert(log_has("SIGTERM: draining", SP_TEST_TIMEOUT_MS));

  int sock = sp_test_connect_hello(daemon_.socket);
  ck_assert_int_ge(sock, 0);
  ck_assert(status_draining(sock));
  struct sp_test_reply r;
  ck_assert_int_eq(job_create(sock, 91, &r), SP_EDAEMONSTOPPING);
  ck_assert_ptr_nonnull(strstr(r.message, "stopping (SIGTERM)"));
  sp_test_reply_free(&r);
  ck_assert_int_eq(sp_test_ping(sock, 92), 0);

  ranks_wait_exported(&j);
  ck_assert_int_eq(daemon_exit(), 0);
  /* The status connection was told why it ends. */
  ck_assert_int_eq(sp_test_recv(sock, &r, SP_TEST_TIMEOUT_MS), 0);
  ck_assert_uint_eq(r.head.id, 0);
  ck_assert_int_eq(r.code, SP_EDAEMONSTOPPING);
  sp_test_reply_free(&r);
  close(sock);
  ranks_finish(&j);
  uint32_t owned = 0;
  for (uint32_t i = 0; i < 2; i++) {
    const struct ranks_rank *rk = &j.rank[i];
    ck_assert_msg(rk->export_rc == 0, "rank %u: %s: %s", i,
                  sp_strerror(rk->export_rc), rk->export_message);
    ck_assert_msg(rk->data_ok, "rank %u: owned data differs", i);
    owned += rk->owned;
    /* Its release raced the stop; either way nothing more is served. */
    ck_assert(rk->release_rc == 0 || rk->release_rc == SP_EDAEMONRESTARTED);
    ck_assert_int_eq(rk->last_rc, SP_EDAEMONRESTARTED);
    ck_assert_msg(strstr(rk->last_message, "create a new job") != NULL,
                  "%s", rk->last_message);
  }
  ck_assert_uint_eq(owned, j.nkeys);
}
END_TEST

/* An export that outlasts drain_timeout fails on every rank with
 * daemon_stopping, and the daemon still exits 0. */
START_TEST(drain_timeout_fails_the_export) {
  start_with("drain_timeout = 300ms\n", "400");
  struct ranks_job j = {.socket = daemon_.socket, .world = 2, .nkeys = 20,
                        .max_keys = 1};
  j.rank[0].asks = j.rank[1].asks = true;
  ranks_start(&j);
  ranks_wait_moving(&j, 0);
  ck_assert_int_eq(kill(daemon_.pid, SIGTERM), 0);
  ranks_wait_exported(&j);
  ck_assert_int_eq(daemon_exit(), 0);
  ranks_finish(&j);
  for (uint32_t i = 0; i < 2; i++) {
    const struct ranks_rank *rk = &j.rank[i];
    ck_assert_msg(rk->export_rc == SP_EDAEMONSTOPPING, "rank %u: %s: %s", i,
                  sp_strerror(rk->export_rc), rk->export_message);
    ck_assert_msg(strstr(rk->export_message, "drain_timeout (300 ms)"), "%s",
                  rk->export_message);
    ck_assert_int_eq(rk->last_rc, SP_EDAEMONRESTARTED);
  }
  ck_assert(log_has("did not finish within drain_timeout", 0));
}
END_TEST

/* Ranks waiting for the others when the daemon is told to stop are
 * answered at once: the export could never start. */
START_TEST(drain_fails_the_waiting_asks) {
  start_with("", NULL);
  struct ranks_job j = {.socket = daemon_.socket, .world = 2, .nkeys = 2};
  j.rank[0].asks = true;
  ranks_start(&j);
  ranks_wait_asked(&j, 0);
  ck_assert_int_eq(kill(daemon_.pid, SIGTERM), 0);
  ranks_wait_exported(&j);
  ck_assert_int_eq(daemon_exit(), 0);
  ranks_finish(&j);
  ck_assert_int_eq(j.rank[0].export_rc, SP_EDAEMONSTOPPING);
  ck_assert_ptr_nonnull(strstr(j.rank[0].export_message, "will not start"));
  for (uint32_t i = 0; i < 2; i++)
    ck_assert_int_eq(j.rank[i].last_rc, SP_EDAEMONRESTARTED);
}
END_TEST

/* A second SIGTERM ends the drain: the daemon stops at once, and the rank
 * whose export was cut hears daemon_restarted from its library. */
START_TEST(second_signal_stops_at_once) {
  start_with("", "1000");
  struct ranks_job j = {.socket = daemon_.socket, .world = 2, .nkeys = 30,
                        .max_keys = 1};
  j.rank[0].asks = j.rank[1].asks = true;
  ranks_start(&j);
  ranks_wait_moving(&j, 0);
  ck_assert_int_eq(kill(daemon_.pid, SIGTERM), 0);
  int sock = sp_test_connect_hello(daemon_.socket);
  ck_assert_int_ge(sock, 0);
  ck_assert(status_draining(sock));
  close(sock);
  ck_assert_int_eq(kill(daemon_.pid, SIGTERM), 0);
  ck_assert_int_eq(daemon_exit(), 0);
  ranks_wait_exported(&j);
  ranks_finish(&j);
  for (uint32_t i = 0; i < 2; i++)
    ck_assert_msg(j.rank[i].export_rc == SP_EDAEMONRESTARTED, "rank %u: %s",
                  i, sp_strerror(j.rank[i].export_rc));
  ck_assert(log_has("SIGTERM while draining: stopping at once", 0));
}
END_TEST

/* The library's side: a rank's calls report daemon_restarted for good
 * once its daemon stopped (with its reason) or died (without one); a
 * connection in no job hears daemon_stopping. */
START_TEST(library_reports_daemon_restarted) {
  start_with("", NULL);
  sp_client *rank, *idle;
  sp_ticket t;
  ck_assert_int_eq(sp_connect(daemon_.socket, &rank), 0);
  ck_assert_int_eq(sp_connect(daemon_.socket, &idle), 0);
  ck_assert_int_eq(sp_job_create(rank, 2, &t), 0);
  ck_assert_int_eq(sp_job_join(rank, &t, 0, 2, "cpu"), 0);
  ck_assert_int_eq(kill(daemon_.pid, SIGTERM), 0);
  ck_assert_int_eq(daemon_exit(), 0);
  for (int i = 0; i < 2; i++) {
    ck_assert_int_eq(sp_ping(rank, NULL), SP_EDAEMONRESTARTED);
    ck_assert_ptr_nonnull(strstr(sp_last_message(rank), "stopped (SIGTERM)"));
  }
  ck_assert_int_eq(sp_ping(idle, NULL), SP_EDAEMONSTOPPING);
  sp_close(rank);
  sp_close(idle);
  teardown();

  /* A daemon that dies says nothing; the rank's library still tells. */
  start_with("", NULL);
  ck_assert_int_eq(sp_connect(daemon_.socket, &rank), 0);
  ck_assert_int_eq(sp_job_create(rank, 2, &t), 0);
  ck_assert_int_eq(sp_job_join(rank, &t, 0, 2, "cpu"), 0);
  ck_assert_int_eq(kill(daemon_.pid, SIGKILL), 0);
  ck_assert_int_eq(daemon_exit(), -1);
  ck_assert_int_eq(sp_ping(rank, NULL), SP_EDAEMONRESTARTED);
  ck_assert_ptr_nonnull(strstr(sp_last_message(rank), "without a reason"));
  sp_close(rank);
}
END_TEST

/* SIGHUP: keys that may change live take effect, keys that need a restart
 * keep their running value, the log says which; a configuration that does
 * not load changes nothing. */
START_TEST(reload_applies_what_may_change_live) {
  start_with("max_jobs = 1\npool_capacity = 64M\nmetrics_connections = 8\n",
             NULL);
  int sock = sp_test_connect_hello(daemon_.socket);
  ck_assert_int_ge(sock, 0);
  struct sp_test_reply r;
  ck_assert_int_eq(job_create(sock, 1, &r), 0);
  sp_test_reply_free(&r);
  ck_assert_int_eq(job_create(sock, 2, &r), SP_ELIMIT);
  sp_test_reply_free(&r);

  ck_assert_int_eq(sp_test_write_file(conf_path, "max_jobs = 2\n"
                                                 "pool_capacity = 128M\n"
                                                 "metrics_connections = 16\n"
                                                 "log_level = debug\n"),
                   0);
  ck_assert_int_eq(kill(daemon_.pid, SIGHUP), 0);
  ck_assert(log_has("applied: log_level (info -> debug), max_jobs (1 -> 2)",
                    SP_TEST_TIMEOUT_MS));
  ck_assert(log_has("need a restart (systemctl restart shardportd): "
                    "pool_capacity (64M -> 128M), metrics_connections (8 -> "
                    "16)",
                    0));
  ck_assert_int_eq(job_create(sock, 3, &r), 0);
  sp_test_reply_free(&r);
  ck_assert_int_eq(call_op(sock, "status", 4, &r), 0);
  uint64_t capacity;
  ck_assert_int_eq(sp__msg_get_u64(&r.map, "pool_capacity", false, &capacity),
                   0);
  ck_assert_uint_eq(capacity, 64u << 20);
  sp_test_reply_free(&r);

  ck_assert_int_eq(sp_test_write_file(conf_path, "max_jobs = 5\nbogus = 1\n"),
                   0);
  ck_assert_int_eq(kill(daemon_.pid, SIGHUP), 0);
  ck_assert(log_has("unknown key \"bogus\"; the running configuration stays",
                    SP_TEST_TIMEOUT_MS));
  ck_assert_int_eq(job_create(sock, 5, &r), SP_ELIMIT);
  sp_test_reply_free(&r);
  close(sock);
  ck_assert_int_eq(sp_test_daemon_stop(&daemon_), 0);
}
END_TEST

/* SIGHUP on a daemon without a configuration file (no --config, and the
 * default file missing) says that no file was read, not that one was. */
START_TEST(reload_without_a_file_says_so) {
  static const char def[] = "/etc/shardport/shardportd.conf";
  ck_assert_int_eq(sp_test_mkdtemp(conf_dir, sizeof conf_dir), 0);
  snprintf(log_path, sizeof log_path, "%s/log", conf_dir);
  start_logged(NULL, NULL);
  ck_assert_int_eq(kill(daemon_.pid, SIGHUP), 0);
  /* Whether this machine has the file or not, the line is true. */
  if (access(def, F_OK) == 0)
    ck_assert(log_has("reload: /etc/shardport/shardportd.conf read; "
                      "nothing changed",
                      SP_TEST_TIMEOUT_MS));
  else
    ck_assert(log_has("reload: no configuration file read "
                      "(/etc/shardport/shardportd.conf does not exist; "
                      "built-in defaults and flags); nothing changed",
                      SP_TEST_TIMEOUT_MS));
  ck_assert_int_eq(sp_test_daemon_stop(&daemon_), 0);
}
END_TEST

static Suite *suite(void) {
  Suite *s = suite_create("daemon-drain");
  TCase *tc = tcase_create("drain");
  tcase_add_checked_fixture(tc, NULL, teardown);
  tcase_set_timeout(tc, 60);
  tcase_add_test(tc, drain_lets_the_running_export_finish);
  tcase_add_test(tc, drain_timeout_fails_the_export);
  tcase_add_test(tc, drain_fails_the_waiting_asks);
  tcase_add_test(tc, second_signal_stops_at_once);
  tcase_add_test(tc, library_reports_daemon_restarted);
  tcase_add_test(tc, reload_applies_what_may_change_live);
  tcase_add_test(tc, reload_without_a_file_says_so);
  suite_add_tcase(s, tc);
  return s;
}

int main(void) {
  signal(SIGPIPE, SIG_IGN);
  SRunner *sr = srunner_create(suite());
  srunner_run_all(sr, CK_NORMAL);
  int failed = srunner_ntests_failed(sr);
  srunner_free(sr);
  return failed == 0 ? EXIT_SUCCESS : EXIT_FAILURE;
}
