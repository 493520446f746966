/*
 * daemon_basic.c - shardportd's messages over a real socket, its command
 * line and its clean shutdown.
 */
#include <check.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <unistd.h>

#include "build_config.h"
#include "tests/integration/harness.h"

static struct sp_test_daemon daemon_;

static void start(void) {
  ck_assert_int_eq(sp_test_daemon_start(&daemon_, NULL), 0);
}

static void stop(void) {
  if (daemon_.pid > 0)
    ck_assert_int_eq(sp_test_daemon_stop(&daemon_), 0);
}

START_TEST(hello_ping_status) {
  int sock = sp_test_connect(daemon_.socket);
  ck_assert_int_ge(sock, 0);

  /* The hello reply carries the request's id and the daemon's versions. */
  struct sp_msgbuf mb;
  sp__msgbuf_begin(&mb, "hello", 41, 2);
  sp__pack_kv_u64(&mb.pk, "version", SP_PROTOCOL_VERSION);
  sp__pack_kv_str(&mb.pk, "client", "daemon_basic");
  ck_assert_int_eq(sp_test_send_msgbuf(sock, &mb, NULL, 0), 0);
  struct sp_test_reply r;
  ck_assert_int_eq(sp_test_recv(sock, &r, SP_TEST_TIMEOUT_MS), 0);
  ck_assert_str_eq(r.head.op, "hello");
  ck_assert_uint_eq(r.head.id, 41);
  uint64_t version;
  ck_assert_int_eq(sp__msg_get_u64(&r.map, "version", false, &version), 0);
  ck_assert_uint_eq(version, SP_PROTOCOL_VERSION);
  char daemon_version[32];
  ck_assert_int_eq(sp__msg_get_strbuf(&r.map, "daemon", false, daemon_version,
                                      sizeof(daemon_version)),
                   0);
  ck_assert_str_eq(daemon_version, SP_VERSION);
  sp_test_reply_free(&r);

  for (uint64_t id = 100; id < 110; id++)
    ck_assert_int_eq(sp_test_ping(sock, id), 0);

  ck_assert_int_eq(sp_test_send_op(sock, "status", 7, NULL, 0), 0);
  ck_assert_int_eq(sp_test_recv(sock, &r, SP_TEST_TIMEOUT_MS), 0);
  ck_assert_str_eq(r.head.op, "status");
  ck_assert_uint_eq(r.head.id, 7);
  ck_assert_int_eq(sp__msg_get_strbuf(&r.map, "daemon_version", false,
                                      daemon_version, sizeof(daemon_version)),
                   0);
  ck_assert_str_eq(daemon_version, SP_VERSION);
  ck_assert_int_eq(sp__msg_get_u64(&r.map, "protocol_version", false, &version),
                   0);
  ck_assert_uint_eq(version, SP_PROTOCOL_VERSION);
  const msgpack_object_array *built;
  ck_assert_int_eq(sp__msg_get_array(&r.map, "backends_built", false, &built),
                   0);
  ck_assert_uint_ge(built->size, 1);
  ck_assert_int_eq(built->ptr[0].type, MSGPACK_OBJECT_STR);
  ck_assert_uint_eq(built->ptr[0].via.str.size, 4);
  ck_assert_mem_eq(built->ptr[0].via.str.ptr, "host", 4);
  char active[16], reason[256];
  ck_assert_int_eq(sp__msg_get_strbuf(&r.map, "backend_active", false, active,
                                      sizeof(active)),
                   0);
  ck_assert_str_eq(active, "host");
  ck_assert_int_eq(sp__msg_get_strbuf(&r.map, "backend_reason", false, reason,
                                      sizeof(reason)),
                   0);
  ck_assert_uint_gt(strlen(reason), 0);
  double uptime;
  ck_assert_int_eq(sp__msg_get_f64(&r.map, "uptime_s", false, &uptime), 0);
  ck_assert(uptime >= 0.0 && uptime < 3600.0);
  uint64_t clients, pool_used, pool_capacity;
  ck_assert_int_eq(sp__msg_get_u64(&r.map, "clients", false, &clients), 0);
  ck_assert_uint_ge(clients, 1);
  ck_assert_int_eq(sp__msg_get_u64(&r.map, "pool_used", false, &pool_used), 0);
  ck_assert_int_eq(
      sp__msg_get_u64(&r.map, "pool_capacity", false, &pool_capacity), 0);
  ck_assert_uint_le(pool_used, pool_capacity);
  const msgpack_object_array *jobs;
  ck_assert_int_eq(sp__msg_get_array(&r.map, "jobs", false, &jobs), 0);
  ck_assert_uint_eq(jobs->size, 0);
  sp_test_reply_free(&r);
  close(sock);
}
END_TEST

START_TEST(clients_counted) {
  int socks[5];
  for (int i = 0; i < 5; i++) {
    socks[i] = sp_test_connect_hello(daemon_.socket);
    ck_assert_int_ge(socks[i], 0);
  }
  ck_assert_int_eq(sp_test_send_op(socks[0], "status", 1, NULL, 0), 0);
  struct sp_test_reply r;
  ck_assert_int_eq(sp_test_recv(socks[0], &r, SP_TEST_TIMEOUT_MS), 0);
  uint64_t clients;
  ck_assert_int_eq(sp__msg_get_u64(&r.map, "clients", false, &clients), 0);
  /* The harness's readiness probe may still be open; nothing else is. */
  ck_assert(clients == 5 || clients == 6);
  sp_test_reply_free(&r);
  for (int i = 0; i < 5; i++)
    close(socks[i]);
}
END_TEST

START_TEST(version_mismatch) {
  int sock = sp_test_connect(daemon_.socket);
  ck_assert_int_ge(sock, 0);
  struct sp_msgbuf mb;
  sp__msgbuf_begin(&mb, "hello", 9, 1);
  sp__pack_kv_u64(&mb.pk, "version", SP_PROTOCOL_VERSION + 1);
  ck_assert_int_eq(sp_test_send_msgbuf(sock, &mb, NULL, 0), 0);
  struct sp_test_reply r;
  ck_assert_int_eq(sp_test_recv(sock, &r, SP_TEST_TIMEOUT_MS), 0);
  ck_assert_str_eq(r.head.op, "error");
  ck_assert_uint_eq(r.head.id, 9);
  ck_assert_int_eq(r.code, SP_EVERSION);
  char expect[128];
  snprintf(expect, sizeof(expect),
           "protocol version mismatch (client %d, daemon %d)",
           SP_PROTOCOL_VERSION + 1, SP_PROTOCOL_VERSION);
  ck_assert_str_eq(r.message, expect);
  sp_test_reply_free(&r);
  ck_assert_int_eq(sp_test_wait_closed(sock, SP_TEST_TIMEOUT_MS), 0);
  close(sock);

  /* The daemon serves the next client as if nothing happened. */
  sock = sp_test_connect_hello(daemon_.socket);
  ck_assert_int_ge(sock, 0);
  ck_assert_int_eq(sp_test_ping(sock, 1), 0);
  close(sock);
}
END_TEST

START_TEST(hello_required) {
  int sock = sp_test_connect(daemon_.socket);
  ck_assert_int_ge(sock, 0);
  ck_assert_int_eq(sp_test_send_op(sock, "ping", 3, NULL, 0), 0);
  struct sp_test_reply r;
  ck_assert_int_eq(sp_test_recv(sock, &r, SP_TEST_TIMEOUT_MS), 0);
  ck_assert_int_eq(r.code, SP_EHELLO);
  ck_assert_uint_eq(r.head.id, 3);
  sp_test_reply_free(&r);
  ck_assert_int_eq(sp_test_wait_closed(sock, SP_TEST_TIMEOUT_MS), 0);
  close(sock);
}
END_TEST

START_TEST(hello_without_version) {
  int sock = sp_test_connect(daemon_.socket);
  ck_assert_int_ge(sock, 0);
  ck_assert_int_eq(sp_test_send_op(sock, "hello", 4, NULL, 0), 0);
  struct sp_test_reply r;
  ck_assert_int_eq(sp_test_recv(sock, &r, SP_TEST_TIMEOUT_MS), 0);
  ck_assert_int_eq(r.code, SP_EBADMSG);
  sp_test_reply_free(&r);
  ck_assert_int_eq(sp_test_wait_closed(sock, SP_TEST_TIMEOUT_MS), 0);
  close(sock);
}
END_TEST

START_TEST(unknown_op_and_second_hello) {
  int sock = sp_test_connect_hello(daemon_.socket);
  ck_assert_int_ge(sock, 0);
  ck_assert_int_eq(sp_test_send_op(sock, "frobnicate", 5, NULL, 0), 0);
  struct sp_test_reply r;
  ck_assert_int_eq(sp_test_recv(sock, &r, SP_TEST_TIMEOUT_MS), 0);
  ck_assert_int_eq(r.code, SP_EUNKNOWNOP);
  ck_assert_uint_eq(r.head.id, 5);
  ck_assert_ptr_nonnull(strstr(r.message, "frobnicate"));
  sp_test_reply_free(&r);
  ck_assert_int_eq(sp_test_hello(sock, SP_PROTOCOL_VERSION), SP_ESTATE);
  /* Neither closes the connection. */
  ck_assert_int_eq(sp_test_ping(sock, 6), 0);
  close(sock);
}
END_TEST

START_TEST(sigterm_clean_shutdown) {
  int sock = sp_test_connect_hello(daemon_.socket);
  ck_assert_int_ge(sock, 0);
  char socket_path[sizeof(daemon_.socket)];
  memcpy(socket_path, daemon_.socket, sizeof(socket_path));
  /* Stop by hand so that the socket file can be checked before the
   * directory goes. */
  ck_assert_int_eq(kill(daemon_.pid, SIGTERM), 0);
  ck_assert_int_eq(sp_test_wait(daemon_.pid, SP_TEST_TIMEOUT_MS), 0);
  daemon_.pid = -1;
  struct stat st;
  ck_assert_int_ne(lstat(socket_path, &st), 0);
  /* Open connections are closed, not left hanging. */
  ck_assert_int_eq(sp_test_wait_closed(sock, SP_TEST_TIMEOUT_MS), 0);
  close(sock);
  sp_test_daemon_stop(&daemon_);
}
END_TEST

START_TEST(sigint_clean_shutdown) {
  ck_assert_int_eq(kill(daemon_.pid, SIGINT), 0);
  ck_assert_int_eq(sp_test_wait(daemon_.pid, SP_TEST_TIMEOUT_MS), 0);
  daemon_.pid = -1;
  struct stat st;
  ck_assert_int_ne(lstat(daemon_.socket, &st), 0);
  sp_test_daemon_stop(&daemon_);
}
END_TEST

static void read_file(const char *path, char *buf, size_t size) {
  FILE *f = fopen(path, "r");
  ck_assert_ptr_nonnull(f);
  size_t n = fread(buf, 1, size - 1, f);
  buf[n] = '\0';
  fclose(f);
}

/* Runs shardportd with args and returns its exit status; its stdout goes to
 * out and its stderr to err (each when not NULL). */
static int run_daemon_output(const char *const *args, char *out,
                             size_t outsize, char *err, size_t errsize) {
  char dir[256];
  ck_assert_int_eq(sp_test_mkdtemp(dir, sizeof(dir)), 0);
  char outpath[300], errpath[300];
  snprintf(outpath, sizeof(outpath), "%s/out", dir);
  snprintf(errpath, sizeof(errpath), "%s/err", dir);
  fflush(stdout);
  fflush(stderr);
  int saved_out = dup(STDOUT_FILENO), saved_err = dup(STDERR_FILENO);
  ck_assert(freopen(outpath, "w", stdout) != NULL);
  int errfd = open(errpath, O_WRONLY | O_CREAT | O_TRUNC, 0644);
  ck_assert_int_ge(errfd, 0);
  if (err != NULL)
    dup2(errfd, STDERR_FILENO);
  close(errfd);
  pid_t pid = sp_test_spawn(args);
  fflush(stdout);
  ck_assert_int_ge(dup2(saved_out, STDOUT_FILENO), 0);
  ck_assert_int_ge(dup2(saved_err, STDERR_FILENO), 0);
  close(saved_out);
  close(saved_err);
  ck_assert_int_gt(pid, 0);
  int status = sp_test_wait(pid, SP_TEST_TIMEOUT_MS);
  if (out != NULL)
    read_file(outpath, out, outsize);
  if (err != NULL)
    read_file(errpath, err, errsize);
  sp_test_rmdir(dir);
  return status;
}

static int run_daemon(const char *const *args, char *out, size_t outsize) {
  return run_daemon_output(args, out, outsize, NULL, 0);
}

START_TEST(check_config) {
  char dir[256], good[300], bad[300], badval[300];
  ck_assert_int_eq(sp_test_mkdtemp(dir, sizeof(dir)), 0);
  snprintf(good, sizeof(good), "%s/good.conf", dir);
  snprintf(bad, sizeof(bad), "%s/bad.conf", dir);
  snprintf(badval, sizeof(badval), "%s/badval.conf", dir);
  char good_text[1024];
  snprintf(good_text, sizeof(good_text),
           "# a comment\n"
           "\n"
           "socket = %s/s.sock\n"
           "log_level = debug   # trailing\n"
           "max_frame = 1M\n"
           "max_fds = 4\n"
           "allowed_uids = 0, 12345\n"
           "allowed_gid = none\n"
           "backend = host\n"
           "watchdog = no\n",
           dir);
  ck_assert_int_eq(sp_test_write_file(good, good_text), 0);
  ck_assert_int_eq(sp_test_write_file(bad, "max_frame = 1M\nno_such_key = 1\n"),
                   0);
  ck_assert_int_eq(sp_test_write_file(badval, "max_fds = 1000\n"), 0);

  const char *ok_args[] = {"-n", "--config", good, NULL};
  ck_assert_int_eq(run_daemon(ok_args, NULL, 0), 0);
  const char *bad_args[] = {"-n", "--config", bad, NULL};
  ck_assert_int_eq(run_daemon(bad_args, NULL, 0), 1);
  const char *badval_args[] = {"-n", "--config", badval, NULL};
  ck_assert_int_eq(run_daemon(badval_args, NULL, 0), 1);
  const char *missing_args[] = {"-n", "--config", "/nonexistent/x.conf", NULL};
  ck_assert_int_eq(run_daemon(missing_args, NULL, 0), 1);

  /* The effective values of the good file, in config syntax. */
  char out[4096];
  const char *print_args[] = {"--print-config", "--config", good, NULL};
  ck_assert_int_eq(run_daemon(print_args, out, sizeof(out)), 0);
  char want[512];
  snprintf(want, sizeof(want), "# configuration file: %s\n", good);
  ck_assert_msg(strncmp(out, want, strlen(want)) == 0, "%s", out);
  snprintf(want, sizeof(want), "socket = %s/s.sock\n", dir);
  ck_assert_ptr_nonnull(strstr(out, want));
  ck_assert_ptr_nonnull(strstr(out, "log_level = debug\n"));
  ck_assert_ptr_nonnull(strstr(out, "max_frame = 1M\n"));
  ck_assert_ptr_nonnull(strstr(out, "max_fds = 4\n"));
  ck_assert_ptr_nonnull(strstr(out, "allowed_uids = 0,12345\n"));
  ck_assert_ptr_nonnull(strstr(out, "allowed_gid = none\n"));
  ck_assert_ptr_nonnull(strstr(out, "backend = host\n"));
  ck_assert_ptr_nonnull(strstr(out, "watchdog = no\n"));
  /* Flags override the file. */
  const char *flag_args[] = {"--print-config", "--config", good, "--log-level",
                             "warn", "--socket", "/tmp/y.sock", NULL};
  ck_assert_int_eq(run_daemon(flag_args, out, sizeof(out)), 0);
  ck_assert_ptr_nonnull(strstr(out, "log_level = warn\n"));
  ck_assert_ptr_nonnull(strstr(out, "socket = /tmp/y.sock\n"));
  /* Listening for other daemons: numeric addresses, a wildcard only with
   * an address to advertise. */
  const char *peer_args[] = {"--print-config", "--config", good,
                             "--peer-listen", "[::1]:7070",
                             "--peer-advertise", "10.1.2.3", NULL};
  ck_assert_int_eq(run_daemon(peer_args, out, sizeof(out)), 0);
  ck_assert_ptr_nonnull(strstr(out, "peer_listen = [::1]:7070\n"));
  ck_assert_ptr_nonnull(strstr(out, "peer_advertise = 10.1.2.3\n"));
  const char *wild_args[] = {"-n", "--config", good, "--peer-listen",
                             "0.0.0.0:7070", NULL};
  ck_assert_int_eq(run_daemon(wild_args, NULL, 0), 1);
  const char *wild_ok[] = {"-n", "--config", good, "--peer-listen",
                           "0.0.0.0:7070", "--peer-advertise",
                           "192.168.1.5:7070", NULL};
  ck_assert_int_eq(run_daemon(wild_ok, NULL, 0), 0);
  const char *bad_peer[][6] = {
      {"-n", "--config", good, "--peer-listen", "localhost:7070", NULL},
      {"-n", "--config", good, "--peer-listen", "127.0.0.1", NULL},
      {"-n", "--config", good, "--peer-listen", "127.0.0.1:70000", NULL},
      {"-n", "--config", good, "--peer-advertise", "0.0.0.0", NULL},
  };
  for (size_t i = 0; i < sizeof bad_peer / sizeof bad_peer[0]; i++)
    ck_assert_int_eq(run_daemon(bad_peer[i], NULL, 0), 2);
  sp_test_rmdir(dir);
}
END_TEST

/* metrics_listen takes a numeric address with a port, or none, from the
 * file and from --metrics-listen; metrics_connections 1 to 1024. */
START_TEST(metrics_settings) {
  static const struct {
    const char *line;
    int status;
  } cases[] = {
      {"metrics_listen = 127.0.0.1:9464\n", 0},
      {"metrics_listen = [::1]:9464\n", 0},
      {"metrics_listen = none\n", 0},
      {"metrics_listen = localhost:9464\n", 1},
      {"metrics_listen = 127.0.0.1\n", 1},
      {"metrics_connections = 0\n", 1},
      {"metrics_connections = 1\n", 0},
      {"metrics_connections = 1024\n", 0},
      {"metrics_connections = 1025\n", 1},
  };
  char dir[256], path[300];
  ck_assert_int_eq(sp_test_mkdtemp(dir, sizeof(dir)), 0);
  snprintf(path, sizeof(path), "%s/m.conf", dir);
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    ck_assert_int_eq(sp_test_write_file(path, cases[i].line), 0);
    const char *args[] = {"-n", "--config", path, NULL};
    ck_assert_msg(run_daemon(args, NULL, 0) == cases[i].status, "%s",
                  cases[i].line);
  }
  ck_assert_int_eq(sp_test_write_file(path, ""), 0);
  char out[4096];
  const char *flag[] = {"--print-config", "--config", path,
                        "--metrics-listen", "127.0.0.1:9464", NULL};
  ck_assert_int_eq(run_daemon(flag, out, sizeof out), 0);
  ck_assert_ptr_nonnull(strstr(out, "metrics_listen = 127.0.0.1:9464\n"));
  const char *bad_flag[] = {"-n", "--config", path, "--metrics-listen",
                            "127.0.0.1:70000", NULL};
  ck_assert_int_eq(run_daemon(bad_flag, NULL, 0), 2);
  sp_test_rmdir(dir);
}
END_TEST

/* The bounds of drain_timeout and export_history, at their edges. */
START_TEST(drain_and_history_bounds) {
  static const struct {
    const char *line;
    int status;
  } cases[] = {
      {"drain_timeout = 0\n", 0},
      {"drain_timeout = 86400000ms\n", 0},
      {"drain_timeout = 86400001ms\n", 1},
      {"drain_timeout = soon\n", 1},
      {"export_history = 0\n", 0},
      {"export_history = 256\n", 0},
      {"export_history = 257\n", 1},
  };
  char dir[256], path[300];
  ck_assert_int_eq(sp_test_mkdtemp(dir, sizeof(dir)), 0);
  snprintf(path, sizeof(path), "%s/d.conf", dir);
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    ck_assert_int_eq(sp_test_write_file(path, cases[i].line), 0);
    const char *args[] = {"-n", "--config", path, NULL};
    ck_assert_msg(run_daemon(args, NULL, 0) == cases[i].status, "%s",
                  cases[i].line);
  }
  sp_test_rmdir(dir);
}
END_TEST

/* peer_streams is 1 to 8 (the streams an exchange serves), at its edges:
 * 0 and 9 are refused before the daemon starts. */
START_TEST(peer_streams_bounds) {
  static const struct {
    const char *line;
    int status;
  } cases[] = {
      {"peer_streams = 0\n", 1},
      {"peer_streams = 1\n", 0},
      {"peer_streams = 8\n", 0},
      {"peer_streams = 9\n", 1},
  };
  char dir[256], path[300];
  ck_assert_int_eq(sp_test_mkdtemp(dir, sizeof(dir)), 0);
  snprintf(path, sizeof(path), "%s/p.conf", dir);
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    ck_assert_int_eq(sp_test_write_file(path, cases[i].line), 0);
    const char *args[] = {"-n", "--config", path, NULL};
    ck_assert_msg(run_daemon(args, NULL, 0) == cases[i].status, "%s",
                  cases[i].line);
  }
  sp_test_rmdir(dir);
}
END_TEST

START_TEST(print_config_defaults) {
  char out[4096];
  const char *args[] = {"--print-config", "--config", "/dev/null", "--socket",
                        "/tmp/sp.sock", NULL};
  ck_assert_int_eq(run_daemon(args, out, sizeof(out)), 0);
  char uids[32] = "0";
  if (geteuid() != 0)
    snprintf(uids, sizeof(uids), "0,%u", (unsigned)geteuid());
  char expect[2048];
  snprintf(expect, sizeof(expect),
           "# configuration file: /dev/null\n"
           "socket = /tmp/sp.sock\n"
           "socket_group = none\n"
           "allowed_uids = %s\n"
           "allowed_gid = %u\n"
           "log_level = info\n"
           "max_frame = 16M\n"
           "max_depth = 16\n"
           "max_items = 262144\n"
           "max_string = 1M\n"
           "max_fds = 32\n"
           "max_clients = 1024\n"
           "max_output = 32M\n"
           "max_staged_bytes = 64M\n"
           "backend = auto\n"
           "watchdog = yes\n"
           "pool_capacity = 0\n"
           "gpu_pool_capacity = 0\n"
           "max_bytes = 1G\n"
           "export_timeout = 1m\n"
           "job_timeout = 5m\n"
           "max_jobs = 256\n"
           "max_user_jobs = 64\n"
           "max_user_registrations = 8388608\n"
           "max_user_registration_bytes = 1G\n"
           "max_user_mappings = 32768\n"
           "max_client_mappings = 8192\n"
           "max_user_mapped_bytes = 8T\n"
           "engine_threads = 0\n"
           "compare_replicas = yes\n"
           "pool_huge_pages = yes\n"
           "drain_timeout = 1m\n"
           "export_history = 8\n"
           "peer_listen = none\n"
           "peer_advertise = none\n"
           "peer_timeout = 10s\n"
           "peer_handshakes = 64\n"
           "peer_streams = 2\n"
           "metrics_listen = none\n"
           "metrics_connections = 64\n",
           uids, (unsigned)getegid());
  ck_assert_str_eq(out, expect);

  /* The printed configuration reads back to itself. */
  char dir[256], path[300], again[4096];
  ck_assert_int_eq(sp_test_mkdtemp(dir, sizeof(dir)), 0);
  snprintf(path, sizeof(path), "%s/printed.conf", dir);
  ck_assert_int_eq(sp_test_write_file(path, out), 0);
  const char *reread[] = {"--print-config", "--config", path, NULL};
  ck_assert_int_eq(run_daemon(reread, again, sizeof(again)), 0);
  /* All but the first line, which names the file read. */
  ck_assert_str_eq(strchr(again, '\n'), strchr(out, '\n'));
  sp_test_rmdir(dir);
}
END_TEST

/* Runs shardportd with stderr in a file; with journal, JOURNAL_STREAM names
 * that file as systemd would name the journal stream. */
static void run_logged(const char *const *args, bool journal, char *err,
                       size_t errsize) {
  char dir[256], path[300];
  ck_assert_int_eq(sp_test_mkdtemp(dir, sizeof(dir)), 0);
  snprintf(path, sizeof(path), "%s/err", dir);
  int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
  ck_assert_int_ge(fd, 0);
  struct stat st;
  ck_assert_int_eq(fstat(fd, &st), 0);
  char stream[64];
  snprintf(stream, sizeof(stream), "%llu:%llu", (unsigned long long)st.st_dev,
           (unsigned long long)st.st_ino);
  if (journal)
    ck_assert_int_eq(setenv("JOURNAL_STREAM", stream, 1), 0);
  int saved = dup(STDERR_FILENO);
  ck_assert_int_ge(dup2(fd, STDERR_FILENO), 0);
  close(fd);
  pid_t pid = sp_test_spawn(args);
  ck_assert_int_ge(dup2(saved, STDERR_FILENO), 0);
  close(saved);
  unsetenv("JOURNAL_STREAM");
  ck_assert_int_gt(pid, 0);
  ck_assert_int_eq(sp_test_wait(pid, SP_TEST_TIMEOUT_MS), 1);
  FILE *f = fopen(path, "r");
  ck_assert_ptr_nonnull(f);
  size_t n = fread(err, 1, errsize - 1, f);
  err[n] = '\0';
  fclose(f);
  sp_test_rmdir(dir);
}

START_TEST(log_prefixes) {
  char dir[256], bad[300];
  ck_assert_int_eq(sp_test_mkdtemp(dir, sizeof(dir)), 0);
  snprintf(bad, sizeof(bad), "%s/bad.conf", dir);
  ck_assert_int_eq(sp_test_write_file(bad, "no_such_key = 1\n"), 0);
  const char *args[] = {"-n", "--config", bad, NULL};
  char err[1024];
  /* Under systemd a line is a journal entry (libsystemd's socket; the
   * journal-fields test reads them); where that socket is missing, as on a
   * build machine, it goes to the stream and the journal takes the
   * priority from "<N>". */
  run_logged(args, true, err, sizeof(err));
  if (SP_HAVE_SYSTEMD && access("/run/systemd/journal/socket", F_OK) == 0) {
    ck_assert_msg(err[0] == '\0', "got: %s", err);
  } else {
    ck_assert_msg(strncmp(err, "<3>", 3) == 0, "got: %s", err);
    ck_assert_ptr_nonnull(strstr(err, "bad.conf:1: unknown key"));
  }
  /* On a terminal or in a file, plain words after the local time:
   * "2026-05-01T12:00:03.123 shardportd: error: ...". */
  run_logged(args, false, err, sizeof(err));
  int year, mon, day, hour, min, sec, ms, used = 0;
  ck_assert_msg(sscanf(err, "%4d-%2d-%2dT%2d:%2d:%2d.%3d %n", &year, &mon,
                       &day, &hour, &min, &sec, &ms, &used) == 7 &&
                    used == 24,
                "got: %s", err);
  ck_assert_msg(strncmp(err + 24, "shardportd: error: ", 19) == 0, "got: %s",
                err);
  sp_test_rmdir(dir);
}
END_TEST

START_TEST(command_line_errors) {
  const char *unknown[] = {"--no-such-flag", NULL};
  ck_assert_int_eq(run_daemon(unknown, NULL, 0), 2);
  const char *level[] = {"--config", "/dev/null", "--log-level", "loud", NULL};
  ck_assert_int_eq(run_daemon(level, NULL, 0), 2);
  const char *extra[] = {"stray", NULL};
  ck_assert_int_eq(run_daemon(extra, NULL, 0), 2);
  /* Asking for CUDA where it cannot serve fails closed: here a CUDA
   * runtime that is not there (the fakes' suite covers a machine without
   * a driver, and one with GPUs). */
  const char *cuda[] = {"-n", "--config", "/dev/null", "--backend", "cuda",
                        "--socket", "/tmp/sp.sock", NULL};
  setenv("SHARDPORT_CUDART_LIB", "/nonexistent/libcudart.so", 1);
  ck_assert_int_eq(run_daemon(cuda, NULL, 0), 1);
  unsetenv("SHARDPORT_CUDART_LIB");
  char out[4096];
  const char *version[] = {"--version", NULL};
  ck_assert_int_eq(run_daemon(version, out, sizeof(out)), 0);
  ck_assert_ptr_nonnull(strstr(out, SP_VERSION));
  const char *help[] = {"--help", NULL};
  ck_assert_int_eq(run_daemon(help, out, sizeof(out)), 0);
  ck_assert_ptr_nonnull(strstr(out, "--print-config"));
}
END_TEST

/* The daemon reads the one documented configuration file by default, and
 * says which file it read. */
START_TEST(default_config_file) {
  char out[4096];
  const char *help[] = {"--help", NULL};
  ck_assert_int_eq(run_daemon(help, out, sizeof(out)), 0);
  ck_assert_ptr_nonnull(
      strstr(out, "(default: /etc/shardport/shardportd.conf)"));
  const char *print[] = {"--print-config", "--socket", "/tmp/sp.sock", NULL};
  ck_assert_int_eq(run_daemon(print, out, sizeof(out)), 0);
  /* Whether this machine has the file or not, the first line names it. */
  static const char read[] =
      "# configuration file: /etc/shardport/shardportd.conf\n";
  static const char none[] = "# configuration file: none "
                             "(/etc/shardport/shardportd.conf does not exist; "
                             "built-in defaults)\n";
  ck_assert_msg(strncmp(out, read, strlen(read)) == 0 ||
                    strncmp(out, none, strlen(none)) == 0,
                "%s", out);
}
END_TEST

/* A socket directory the daemon would refuse is refused by -n too, and
 * both say what to do instead. */
START_TEST(socket_directory_refusals_say_what_to_do) {
  char err[4096], dir[256], sock[300];
  const char *open_dir[] = {"-n", "--config", "/dev/null", "--socket",
                            "/tmp/sp-basic.sock", NULL};
  ck_assert_int_eq(run_daemon_output(open_dir, NULL, 0, err, sizeof(err)), 3);
  ck_assert_msg(strstr(err, "refusing socket directory /tmp: it is writable "
                            "by others than its owner (mode 1777)") &&
                    strstr(err, "mkdir -m 0700 /tmp/shardport && shardportd "
                                "--socket /tmp/shardport/sp-basic.sock"),
                "%s", err);
  /* Starting says the same, and exits 3. */
  const char *start_args[] = {"--config", "/dev/null", "--socket",
                              "/tmp/sp-basic.sock", NULL};
  ck_assert_int_eq(run_daemon_output(start_args, NULL, 0, err, sizeof(err)),
                   3);
  ck_assert_msg(strstr(err, "mkdir -m 0700 /tmp/shardport"), "%s", err);
  ck_assert_int_eq(sp_test_mkdtemp(dir, sizeof(dir)), 0);
  snprintf(sock, sizeof(sock), "%s/missing/s.sock", dir);
  const char *missing[] = {"-n", "--config", "/dev/null", "--socket", sock,
                           NULL};
  ck_assert_int_eq(run_daemon_output(missing, NULL, 0, err, sizeof(err)), 3);
  ck_assert_msg(strstr(err, "does not exist") &&
                    strstr(err, "create it first: mkdir -m 0700 "),
                "%s", err);
  snprintf(sock, sizeof(sock), "%s/s.sock", dir);
  const char *fine[] = {"-n", "--config", "/dev/null", "--socket", sock, NULL};
  ck_assert_int_eq(run_daemon_output(fine, NULL, 0, err, sizeof(err)), 0);
  char want[512];
  snprintf(want, sizeof(want),
           "shardportd: configuration OK (file /dev/null; socket %s; ", sock);
  ck_assert_msg(strstr(err, want), "%s", err);
  sp_test_rmdir(dir);
}
END_TEST

/* Sizes take k, M, G, T and KiB ... TiB; durations ms, s, m and h; the
 * printed configuration uses the largest exact unit. */
START_TEST(size_and_duration_units) {
  char dir[256], path[300], out[4096], err[4096];
  ck_assert_int_eq(sp_test_mkdtemp(dir, sizeof(dir)), 0);
  snprintf(path, sizeof(path), "%s/units.conf", dir);
  ck_assert_int_eq(sp_test_write_file(path, "max_bytes = 2GiB\n"
                                            "max_output = 64KiB\n"
                                            "pool_capacity = 3T\n"
                                            "max_frame = 1536k\n"
                                            "export_timeout = 2h\n"
                                            "job_timeout = 24h\n"),
                   0);
  const char *print[] = {"--print-config", "--config", path, "--socket",
                         "/tmp/sp.sock", NULL};
  ck_assert_int_eq(run_daemon(print, out, sizeof(out)), 0);
  static const char *const lines[] = {
      "max_bytes = 2G\n", "max_output = 64k\n", "pool_capacity = 3T\n",
      "max_frame = 1536k\n", "export_timeout = 2h\n", "job_timeout = 24h\n"};
  for (size_t i = 0; i < sizeof lines / sizeof lines[0]; i++)
    ck_assert_msg(strstr(out, lines[i]), "no '%s' in\n%s", lines[i], out);
  /* SI-looking suffixes are ambiguous; a day and an hour is past the
   * bound. */
  static const char *const bad[] = {"max_bytes = 1MB\n", "max_bytes = 1m\n",
                                    "job_timeout = 25h\n",
                                    "export_timeout = 1d\n"};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    ck_assert_int_eq(sp_test_write_file(path, bad[i]), 0);
    const char *check[] = {"-n", "--config", path, "--socket", "/tmp/x.sock",
                           NULL};
    ck_assert_msg(run_daemon_output(check, NULL, 0, err, sizeof(err)) == 1,
                  "accepted %s", bad[i]);
  }
  sp_test_rmdir(dir);
}
END_TEST

/* --detach returns once the daemon serves, with its pid; or with the
 * daemon's error and exit status when it cannot start. */
START_TEST(detach_serves_in_the_background) {
  /* The detached daemon's parent exits: it becomes this process's child
   * again, so that it can be reaped here. */
  ck_assert_int_eq(prctl(PR_SET_CHILD_SUBREAPER, 1), 0);
  char dir[256], sock[300], out[256], err[4096];
  ck_assert_int_eq(sp_test_mkdtemp(dir, sizeof(dir)), 0);
  snprintf(sock, sizeof(sock), "%s/s.sock", dir);
  const char *args[] = {"--detach", "--config", "/dev/null", "--socket", sock,
                        NULL};
  ck_assert_int_eq(run_daemon_output(args, out, sizeof(out), err, sizeof(err)),
                   0);
  char *end;
  long pid = strtol(out, &end, 10);
  ck_assert_msg(pid > 0 && strcmp(end, "\n") == 0, "stdout: '%s'", out);
  /* It listens already: no waiting. */
  int s = sp_test_connect_hello(sock);
  ck_assert_int_ge(s, 0);
  ck_assert_int_eq(sp_test_ping(s, 7), 0);
  close(s);
  ck_assert_int_eq(kill((pid_t)pid, SIGTERM), 0);
  ck_assert_int_eq(sp_test_wait((pid_t)pid, SP_TEST_TIMEOUT_MS), 0);
  struct stat st;
  ck_assert_int_ne(lstat(sock, &st), 0);
  sp_test_rmdir(dir);
  /* A daemon that cannot start: its error, its status, no pid. */
  const char *refused[] = {"--detach", "--config", "/dev/null", "--socket",
                           "/tmp/sp-basic.sock", NULL};
  ck_assert_int_eq(
      run_daemon_output(refused, out, sizeof(out), err, sizeof(err)), 3);
  ck_assert_str_eq(out, "");
  ck_assert_msg(strstr(err, "mkdir -m 0700 /tmp/shardport"), "%s", err);
}
END_TEST

/* usage: test-daemon-basic [served | "command line"] (default: both) */
int main(int argc, char **argv) {
  Suite *s = suite_create("daemon-basic");
  TCase *served = tcase_create("served");
  tcase_add_checked_fixture(served, start, stop);
  tcase_set_timeout(served, 30);
  tcase_add_test(served, hello_ping_status);
  tcase_add_test(served, clients_counted);
  tcase_add_test(served, version_mismatch);
  tcase_add_test(served, hello_required);
  tcase_add_test(served, hello_without_version);
  tcase_add_test(served, unknown_op_and_second_hello);
  tcase_add_test(served, sigterm_clean_shutdown);
  tcase_add_test(served, sigint_clean_shutdown);
  suite_add_tcase(s, served);
  TCase *cli = tcase_create("command line");
  tcase_set_timeout(cli, 30);
  tcase_add_test(cli, check_config);
  tcase_add_test(cli, drain_and_history_bounds);
  tcase_add_test(cli, peer_streams_bounds);
  tcase_add_test(cli, metrics_settings);
  tcase_add_test(cli, print_config_defaults);
  tcase_add_test(cli, command_line_errors);
  tcase_add_test(cli, log_prefixes);
  tcase_add_test(cli, default_config_file);
  tcase_add_test(cli, socket_directory_refusals_say_what_to_do);
  tcase_add_test(cli, size_and_duration_units);
  tcase_add_test(cli, detach_serves_in_the_background);
  suite_add_tcase(s, cli);
  SRunner *sr = srunner_create(s);
  srunner_run(sr, NULL, argc > 1 ? argv[1] : NULL, CK_NORMAL);
  int failed = srunner_ntests_failed(sr);
  int run = srunner_ntests_run(sr);
  srunner_free(sr);
  return failed == 0 && run > 0 ? EXIT_SUCCESS : EXIT_FAILURE;
}
