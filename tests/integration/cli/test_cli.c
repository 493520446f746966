/*
 * test_cli.c - the `shardport` command as an operator runs it: against a
 * private shardportd for the table, the JSON, ping and --watch; against the
 * scripted fake daemon for error replies and for jobs and hostile strings a
 * fresh daemon does not have.  The binary comes from $SHARDPORT_CLI, the
 * JSON checker from $SHARDPORT_JSON_CHECK run by $PYTHON3.
 */
#include <check.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "build_config.h"
#include "shardport.h"
#include "tests/integration/harness.h"
#include "tests/unit/client/fake_daemon.h"

#define RUN_TIMEOUT_MS 20000

static const char *env_or_die(const char *name) {
  const char *v = getenv(name);
  if (!v || !v[0]) {
    fprintf(stderr, "test_cli: %s is not set (run through meson test)\n", name);
    abort();
  }
  return v;
}

static int64_t now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

struct run {
  int status; /* exit status, or -1 when killed by a signal */
  char out[1 << 16];
  size_t out_len;
  char err[1 << 13];
  size_t err_len;
};

static void append(int fd, char *buf, size_t size, size_t *len, bool *open) {
  char tmp[4096];
  ssize_t n = read(fd, tmp, sizeof tmp);
  if (n <= 0) {
    if (n == 0 || (errno != EINTR && errno != EAGAIN))
      *open = false;
    return;
  }
  size_t take = (size_t)n < size - 1 - *len ? (size_t)n : size - 1 - *len;
  memcpy(buf + *len, tmp, take);
  *len += take;
  buf[*len] = '\0';
}

/*
 * Runs argv[0] with argv, stdin from in_text (or /dev/null), collecting
 * stdout and stderr.  When sigint_after_ms > 0 the child gets SIGINT after
 * that long.  Fails the test when the child outlives RUN_TIMEOUT_MS.
 */
static void run_argv(const char *const *argv, const char *in_text,
                     int sigint_after_ms, struct run *r) {
  memset(r, 0, sizeof *r);
  int out[2], err[2], in[2];
  ck_assert_int_eq(pipe2(out, O_CLOEXEC), 0);
  ck_assert_int_eq(pipe2(err, O_CLOEXEC), 0);
  ck_assert_int_eq(pipe2(in, O_CLOEXEC), 0);
  pid_t pid = fork();
  ck_assert_int_ge(pid, 0);
  if (pid == 0) {
    dup2(in[0], 0);
    dup2(out[1], 1);
    dup2(err[1], 2);
    execv(argv[0], (char *const *)argv);
    _exit(127);
  }
  close(in[0]);
  close(out[1]);
  close(err[1]);
  if (in_text) {
    /* Small enough for the pipe buffer: written whole before reading. */
    ck_assert_int_eq(write(in[1], in_text, strlen(in_text)),
                     (ssize_t)strlen(in_text));
  }
  close(in[1]);

  int64_t start = now_ms();
  bool out_open = true, err_open = true, signalled = false;
  while (out_open || err_open) {
    int64_t elapsed = now_ms() - start;
    ck_assert_msg(elapsed < RUN_TIMEOUT_MS, "%s did not finish", argv[0]);
    if (sigint_after_ms > 0 && !signalled && elapsed >= sigint_after_ms) {
      kill(pid, SIGINT);
      signalled = true;
    }
    struct pollfd p[2] = {{.fd = out_open ? out[0] : -1, .events = POLLIN},
                          {.fd = err_open ? err[0] : -1, .events = POLLIN}};
    if (poll(p, 2, 50) < 0)
      continue;
    if (p[0].revents)
      append(out[0], r->out, sizeof r->out, &r->out_len, &out_open);
    if (p[1].revents)
      append(err[0], r->err, sizeof r->err, &r->err_len, &err_open);
  }
  close(out[0]);
  close(err[0]);
  int status;
  ck_assert_int_eq(waitpid(pid, &status, 0), pid);
  r->status = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

/* Runs the CLI with args (NULL-terminated, without argv[0]). */
static void run_cli(const char *const *args, struct run *r) {
  const char *argv[16] = {env_or_die("SHARDPORT_CLI")};
  size_t n = 1;
  for (; args[n - 1]; n++) {
    ck_assert_uint_lt(n, 15);
    argv[n] = args[n - 1];
  }
  argv[n] = NULL;
  run_argv(argv, NULL, 0, r);
}

/* Checks text with check_json.py in the given mode, for socket and (jobs,
 * job, abort) a job id; fails the test with the checker's complaint. */
static void check_json(const char *mode, const char *socket, const char *job,
                       const char *text) {
  const char *argv[] = {env_or_die("PYTHON3"), env_or_die("SHARDPORT_JSON_CHECK"),
                        mode, socket, job, NULL};
  static struct run r;
  run_argv(argv, text, 0, &r);
  ck_assert_msg(r.status == 0, "check_json %s failed: %s%s\non: %s", mode,
                r.out, r.err, text);
}

static size_t count(const char *haystack, const char *needle) {
  size_t n = 0;
  for (const char *p = haystack; (p = strstr(p, needle)) != NULL; p++)
    n++;
  return n;
}

static bool has_line_starting(const char *text, const char *prefix) {
  size_t len = strlen(prefix);
  for (const char *p = text; p; p = strchr(p, '\n')) {
    if (*p == '\n')
      p++;
    if (strncmp(p, prefix, len) == 0)
      return true;
  }
  return false;
}

static struct sp_test_daemon daemon_;
static struct run r;

static void start(void) {
  ck_assert_int_eq(sp_test_daemon_start(&daemon_, NULL), 0);
}

static void stop(void) {
  if (daemon_.pid > 0)
    ck_assert_int_eq(sp_test_daemon_stop(&daemon_), 0);
}

/* ---- against a real daemon ---- */

START_TEST(status_table) {
  run_cli((const char *[]){"--socket", daemon_.socket, "status", NULL}, &r);
  ck_assert_msg(r.status == 0, "exit %d: %s", r.status, r.err);
  ck_assert_uint_eq(r.err_len, 0);
  static const char *const rows[] = {
      "daemon version    " SP_VERSION "\n", "protocol version  4\n",
      "backends built    host", "backend active    host",
      "uptime            ", "clients           ",
      "pool              ", "loop busy         ",
      "jobs              no jobs\n"};
  for (size_t i = 0; i < sizeof rows / sizeof rows[0]; i++)
    ck_assert_msg(has_line_starting(r.out, rows[i]), "no row '%s' in:\n%s",
                  rows[i], r.out);
  /* This connection counts; the harness's probe may still be counted. */
  const char *clients = strstr(r.out, "\nclients           ");
  ck_assert_ptr_nonnull(clients);
  ck_assert_int_ge(atoi(clients + 19), 1);
  /* Printed to a pipe: no screen clearing, no escape sequences at all. */
  ck_assert_ptr_null(strchr(r.out, '\033'));
}
END_TEST

START_TEST(status_json) {
  /* Options after the command work as well. */
  run_cli((const char *[]){"status", "--json", "--socket", daemon_.socket,
                           NULL},
          &r);
  ck_assert_msg(r.status == 0, "exit %d: %s", r.status, r.err);
  ck_assert_uint_eq(r.err_len, 0);
  check_json("status", daemon_.socket, NULL, r.out);
}
END_TEST

START_TEST(ping) {
  run_cli((const char *[]){"-s", daemon_.socket, "ping", NULL}, &r);
  ck_assert_msg(r.status == 0, "exit %d: %s", r.status, r.err);
  ck_assert_msg(strncmp(r.out, "pong from ", 10) == 0, "%s", r.out);
  ck_assert_ptr_nonnull(strstr(r.out, " ms\n"));
  run_cli((const char *[]){"--socket=" "", "ping", NULL}, &r);
  ck_assert_int_eq(r.status, 1); /* an empty path is an invalid argument */
  run_cli((const char *[]){"-s", daemon_.socket, "-j", "ping", NULL}, &r);
  ck_assert_msg(r.status == 0, "exit %d: %s", r.status, r.err);
  check_json("ping", daemon_.socket, NULL, r.out);
}
END_TEST

START_TEST(default_socket_from_env) {
  setenv("SHARDPORT_SOCKET", daemon_.socket, 1);
  run_cli((const char *[]){"ping", NULL}, &r);
  ck_assert_msg(r.status == 0, "exit %d: %s", r.status, r.err);
  unsetenv("SHARDPORT_SOCKET");
}
END_TEST

/* Runs `--watch` for about 2.5 s into a pipe, then SIGINT. */
static void watch_for(const char *const *extra, struct run *out) {
  const char *argv[12] = {env_or_die("SHARDPORT_CLI"), "--socket",
                          daemon_.socket, "--watch", "1", "status"};
  size_t n = 6;
  for (; extra && extra[n - 6]; n++)
    argv[n] = extra[n - 6];
  argv[n] = NULL;
  run_argv(argv, NULL, 2500, out);
}

START_TEST(watch_refreshes) {
  watch_for(NULL, &r);
  ck_assert_msg(r.status == 0, "exit %d: %s", r.status, r.err);
  size_t snapshots = count(r.out, "daemon version");
  ck_assert_msg(snapshots >= 2 && snapshots <= 4, "%zu snapshots:\n%s",
                snapshots, r.out);
  ck_assert_ptr_null(strchr(r.out, '\033'));

  watch_for((const char *[]){"--json", NULL}, &r);
  ck_assert_msg(r.status == 0, "exit %d: %s", r.status, r.err);
  ck_assert_uint_ge(count(r.out, "\n"), 2);
  check_json("status-lines", daemon_.socket, NULL, r.out);
}
END_TEST

/* A job of world 2 made and joined as rank 0 on a raw connection (the
 * job lasts while it stays open): the connection, its id in hex. */
static int job_joined(char *hex) {
  int sock = sp_test_connect_hello(daemon_.socket);
  ck_assert_int_ge(sock, 0);
  struct sp_msgbuf mb;
  struct sp_test_reply t, joined;
  sp__msgbuf_begin(&mb, "job_create", 1, 1);
  sp__pack_kv_u64(&mb.pk, "world", 2);
  ck_assert_int_eq(sp_test_send_msgbuf(sock, &mb, NULL, 0), 0);
  ck_assert_int_eq(sp_test_recv(sock, &t, SP_TEST_TIMEOUT_MS), 0);
  ck_assert_int_eq(sp__msg_get_strbuf(&t.map, "job_id", false, hex, 33), 0);
  const uint8_t *ticket;
  size_t len;
  ck_assert_int_eq(sp__msg_get_bin(&t.map, "ticket", false, &ticket, &len), 0);
  sp__msgbuf_begin(&mb, "join", 2, 4);
  sp__pack_str(&mb.pk, "ticket");
  sp__pack_bin(&mb.pk, ticket, len);
  sp__pack_kv_u64(&mb.pk, "rank", 0);
  sp__pack_kv_u64(&mb.pk, "world", 2);
  sp__pack_kv_str(&mb.pk, "device", "cpu");
  ck_assert_int_eq(sp_test_send_msgbuf(sock, &mb, NULL, 0), 0);
  ck_assert_int_eq(sp_test_recv(sock, &joined, SP_TEST_TIMEOUT_MS), 0);
  ck_assert_int_eq(joined.code, 0);
  sp_test_reply_free(&joined);
  sp_test_reply_free(&t);
  return sock;
}

START_TEST(jobs_show_and_abort) {
  run_cli((const char *[]){"-s", daemon_.socket, "jobs", NULL}, &r);
  ck_assert_msg(r.status == 0, "exit %d: %s", r.status, r.err);
  ck_assert_str_eq(r.out, "no jobs\n");

  char hex[33], prefix[7];
  int rank0 = job_joined(hex);
  snprintf(prefix, sizeof prefix, "%.6s", hex);
  run_cli((const char *[]){"-s", daemon_.socket, "jobs", NULL}, &r);
  ck_assert_msg(r.status == 0, "exit %d: %s", r.status, r.err);
  ck_assert_msg(has_line_starting(r.out, "JOB  ") &&
                    strstr(r.out, "  USER  PHASE    RANKS  ASKED  EXPORTS  "
                                  "AGE  NODE\n") != NULL,
                "%s", r.out);
  char line[128];
  snprintf(line, sizeof line, "%s  root  waiting  1/2    0      0        ",
           hex);
  ck_assert_msg(has_line_starting(r.out, line), "no '%s' in:\n%s", line,
                r.out);
  run_cli((const char *[]){"-s", daemon_.socket, "jobs", "--json", NULL}, &r);
  ck_assert_msg(r.status == 0, "exit %d: %s", r.status, r.err);
  check_json("jobs", daemon_.socket, hex, r.out);

  /* One job in full, by a prefix of its id. */
  run_cli((const char *[]){"-s", daemon_.socket, "status", prefix, NULL}, &r);
  ck_assert_msg(r.status == 0, "exit %d: %s", r.status, r.err);
  char owner[128];
  snprintf(owner, sizeof owner, "owner             root (uid 0, pid %d)\n",
           (int)getpid());
  snprintf(line, sizeof line, "job               %s\n", hex);
  const char *const rows[] = {line,
                              owner,
                              "phase             waiting\n",
                              "ranks             1 of 2 joined, 0 asked\n",
                              "exports           0 finished\n",
                              "  RANK  STATE   PID",
                              "history           no export finished yet\n"};
  for (size_t i = 0; i < sizeof rows / sizeof rows[0]; i++)
    ck_assert_msg(strstr(r.out, rows[i]), "no '%s' in:\n%s", rows[i], r.out);
  /* The PID column is as wide as this process's pid (at least "PID"). */
  char rank_row[128], pid[16];
  int width = snprintf(pid, sizeof pid, "%d", (int)getpid());
  width = width < 3 ? 3 : width;
  snprintf(rank_row, sizeof rank_row, "  0     joined  %-*s  0\n", width, pid);
  ck_assert_msg(strstr(r.out, rank_row), "no '%s' in:\n%s", rank_row, r.out);
  snprintf(rank_row, sizeof rank_row, "  1     absent  %-*s  -\n", width, "-");
  ck_assert_msg(strstr(r.out, rank_row), "no '%s' in:\n%s", rank_row, r.out);
  run_cli((const char *[]){"-s", daemon_.socket, "--json", "status", hex,
                           NULL},
          &r);
  ck_assert_msg(r.status == 0, "exit %d: %s", r.status, r.err);
  check_json("job", daemon_.socket, hex, r.out);

  /* Abort: the rank hears it; the job is gone for the next abort. */
  run_cli((const char *[]){"-s", daemon_.socket, "abort", prefix, "--json",
                           NULL},
          &r);
  ck_assert_msg(r.status == 0, "exit %d: %s", r.status, r.err);
  check_json("abort", daemon_.socket, hex, r.out);
  struct sp_test_reply notice;
  ck_assert_int_eq(sp_test_recv(rank0, &notice, SP_TEST_TIMEOUT_MS), 0);
  ck_assert_int_eq(notice.code, SP_EABORTED);
  sp_test_reply_free(&notice);
  close(rank0);
  run_cli((const char *[]){"-s", daemon_.socket, "abort", hex, NULL}, &r);
  ck_assert_int_eq(r.status, 1);
  ck_assert_uint_eq(r.out_len, 0);
  ck_assert_msg(strstr(r.err, "shardport: abort: no such job (job_abort: "
                               "no job ") == r.err,
                "%s", r.err);
  run_cli((const char *[]){"-s", daemon_.socket, "status", hex, NULL}, &r);
  ck_assert_int_eq(r.status, 1);

  rank0 = job_joined(hex);
  run_cli((const char *[]){"-s", daemon_.socket, "abort", hex, NULL}, &r);
  ck_assert_msg(r.status == 0, "exit %d: %s", r.status, r.err);
  snprintf(line, sizeof line, "aborted job %s\n", hex);
  ck_assert_str_eq(r.out, line);
  close(rank0);
}
END_TEST

/* --watch over a daemon restart: each text snapshot starts with the
 * time; while the daemon is away the watch says so and goes on, and it
 * shows the new daemon once it listens on the same socket. */
START_TEST(watch_survives_a_restart) {
  char outpath[320];
  snprintf(outpath, sizeof outpath, "%s.watch", daemon_.socket);
  pid_t pid = fork();
  ck_assert_int_ge(pid, 0);
  if (pid == 0) {
    int fd = open(outpath, O_WRONLY | O_CREAT | O_TRUNC, 0600);
    dup2(fd, 1);
    dup2(fd, 2);
    execl(env_or_die("SHARDPORT_CLI"), "shardport", "--socket",
          daemon_.socket, "--watch", "0.2", "status", (char *)NULL);
    _exit(127);
  }
  struct timespec pause = {0, 700 * 1000000L};
  nanosleep(&pause, NULL);
  /* Stopped: the socket goes; a new daemon then listens on the same path
   * (the directory stays). */
  ck_assert_int_eq(kill(daemon_.pid, SIGTERM), 0);
  ck_assert_int_eq(sp_test_wait(daemon_.pid, SP_TEST_TIMEOUT_MS), 0);
  nanosleep(&pause, NULL);
  const char *args[] = {"--socket", daemon_.socket, "--config", "/dev/null",
                        NULL};
  daemon_.pid = sp_test_spawn(args);
  ck_assert_int_gt(daemon_.pid, 0);
  for (int i = 0; i < 200 && access(daemon_.socket, F_OK) != 0; i++)
    nanosleep(&(struct timespec){0, 10 * 1000000L}, NULL);
  nanosleep(&pause, NULL);
  ck_assert_int_eq(kill(pid, SIGINT), 0);
  ck_assert_int_eq(sp_test_wait(pid, RUN_TIMEOUT_MS), 0);
  static char out[1 << 16];
  FILE *f = fopen(outpath, "r");
  ck_assert_ptr_nonnull(f);
  out[fread(out, 1, sizeof out - 1, f)] = '\0';
  fclose(f);
  unlink(outpath);
  const char *away = strstr(out, "; connecting again every 0.2s\n");
  ck_assert_msg(away != NULL, "%s", out);
  ck_assert_msg(strstr(away, "daemon version") != NULL,
                "no snapshot after the restart:\n%s", out);
  /* "every 0.2s  2026-05-01 12:00:03" heads every snapshot. */
  int year, mon, day, hour, min, sec;
  ck_assert_msg(sscanf(out, "every 0.2s  %4d-%2d-%2d %2d:%2d:%2d", &year, &mon,
                       &day, &hour, &min, &sec) == 6,
                "%s", out);
  ck_assert_uint_eq(count(out, "every 0.2s  "), count(out, "\n\nevery") + 1);
}
END_TEST

/* ---- exit statuses without a daemon ---- */

START_TEST(no_daemon_is_exit_3) {
  char path[256];
  snprintf(path, sizeof path, "/tmp/sp-cli-none-%d/none.sock", (int)getpid());
  run_cli((const char *[]){"--socket", path, "status", NULL}, &r);
  ck_assert_int_eq(r.status, 3);
  ck_assert_uint_eq(r.out_len, 0);
  /* The path tried and what to do. */
  char want[512];
  snprintf(want, sizeof want,
           "shardport: no shardportd listens at %s: nothing is there; start "
           "shardportd (docs/operations.md), or point SHARDPORT_SOCKET at "
           "the socket it listens on\n",
           path);
  ck_assert_str_eq(r.err, want);
  /* A default path says where it came from. */
  setenv("SHARDPORT_SOCKET", path, 1);
  run_cli((const char *[]){"status", NULL}, &r);
  unsetenv("SHARDPORT_SOCKET");
  ck_assert_int_eq(r.status, 3);
  snprintf(want, sizeof want, "%s (from $SHARDPORT_SOCKET): nothing is there",
           path);
  ck_assert_msg(strstr(r.err, want) != NULL, "%s", r.err);
  run_cli((const char *[]){"--socket", path, "--json", "status", NULL}, &r);
  ck_assert_int_eq(r.status, 3);
  run_cli((const char *[]){"--socket", path, "ping", NULL}, &r);
  ck_assert_int_eq(r.status, 3);
}
END_TEST

START_TEST(usage_errors_are_exit_2) {
  static const char *const cases[][5] = {
      {NULL},
      {"bogus", NULL},
      {"status", "extra", NULL},
      {"--frobnicate", "status", NULL},
      {"status", "--watch", NULL},
      {"--watch", "0", "status", NULL},
      {"--watch", "-1", "status", NULL},
      {"--watch", "abc", "status", NULL},
      {"--watch", "1x", "status", NULL},
      {"--watch", "nan", "status", NULL},
      {"--watch", "1", "ping", NULL},
      {"--json=yes", "status", NULL},
      {"abort", NULL},
      {"abort", "xyz", NULL},
      {"abort", "0123456789abcdef0123456789abcdef0", NULL},
      {"abort", "ab", "cd", NULL},
      {"ping", "ab", NULL},
      {"jobs", "ab", NULL},
      {"abort", "ab", "--watch", "1", NULL},
      {"--socket", NULL},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    const char *args[8] = {"--socket", "/nonexistent/s.sock"};
    size_t n = 2;
    for (size_t j = 0; cases[i][j]; j++)
      args[n++] = cases[i][j];
    args[n] = NULL;
    /* The last case must not get a socket in front. */
    run_cli(i == sizeof cases / sizeof cases[0] - 1 ? cases[i] : args, &r);
    ck_assert_msg(r.status == 2, "case %zu: exit %d, %s", i, r.status, r.err);
    ck_assert_msg(strncmp(r.err, "shardport: ", 11) == 0, "case %zu: %s", i,
                  r.err);
    ck_assert_uint_eq(r.out_len, 0);
  }
}
END_TEST

START_TEST(help_and_version) {
  run_cli((const char *[]){"--help", NULL}, &r);
  ck_assert_int_eq(r.status, 0);
  ck_assert_ptr_nonnull(strstr(r.out, "usage: shardport"));
  ck_assert_ptr_nonnull(strstr(r.out, "exit status"));
  run_cli((const char *[]){"help", NULL}, &r);
  ck_assert_int_eq(r.status, 0);
  ck_assert_ptr_nonnull(strstr(r.out, "  status [JOB] "));
  ck_assert_ptr_nonnull(strstr(r.out, "  jobs "));
  ck_assert_ptr_nonnull(strstr(r.out, "  abort JOB "));
  ck_assert_ptr_nonnull(strstr(r.out, "  ping "));
  run_cli((const char *[]){"--version", NULL}, &r);
  ck_assert_int_eq(r.status, 0);
  ck_assert_str_eq(r.out, "shardport " SP_VERSION " (protocol 4)\n");
}
END_TEST

/* ---- against the fake daemon ---- */

static void script_status_error(int conn, void *arg) {
  (void)arg;
  if (fake_hello(conn) < 0)
    return;
  struct fake_request req;
  if (fake_recv(conn, &req) < 0)
    return;
  fake_send_error(conn, req.head.id, "busy", "try again later");
  fake_request_free(&req);
}

START_TEST(error_reply_is_exit_1) {
  struct fake_daemon d;
  ck_assert_int_eq(fake_daemon_start(&d, script_status_error, NULL), 0);
  run_cli((const char *[]){"--socket", d.socket, "status", NULL}, &r);
  fake_daemon_stop(&d);
  ck_assert_int_eq(r.status, 1);
  ck_assert_uint_eq(r.out_len, 0);
  ck_assert_str_eq(r.err,
                   "shardport: status: the resource is busy (try again later)\n");
}
END_TEST

static void script_version_mismatch(int conn, void *arg) {
  (void)arg;
  struct fake_request req;
  if (fake_recv(conn, &req) < 0)
    return;
  fake_send_error(conn, req.head.id, "version_mismatch",
                  "protocol version mismatch (client 1, daemon 2)");
  fake_request_free(&req);
}

START_TEST(version_mismatch_is_exit_1) {
  struct fake_daemon d;
  ck_assert_int_eq(fake_daemon_start(&d, script_version_mismatch, NULL), 0);
  run_cli((const char *[]){"--socket", d.socket, "ping", NULL}, &r);
  fake_daemon_stop(&d);
  ck_assert_int_eq(r.status, 1);
  ck_assert_ptr_nonnull(strstr(r.err, sp_strerror(SP_EVERSION)));
}
END_TEST

static void script_status_jobs(int conn, void *arg) {
  (void)arg;
  if (fake_hello(conn) < 0)
    return;
  struct fake_request req;
  if (fake_recv(conn, &req) < 0)
    return;
  fake_send_status(conn, req.head.id, NULL);
  fake_request_free(&req);
}

START_TEST(jobs_table_and_hostile_strings) {
  struct fake_daemon d;
  ck_assert_int_eq(fake_daemon_start(&d, script_status_jobs, NULL), 0);
  run_cli((const char *[]){"--socket", d.socket, "status", NULL}, &r);
  fake_daemon_stop(&d);
  ck_assert_msg(r.status == 0, "exit %d: %s", r.status, r.err);
  static const char *const want[] = {
      "backends built    host,cuda\n",
      "uptime            1d 2h 3m 4s\n",
      "clients           2\n",
      "pool              1.5 KiB used of 1.0 GiB (0.0%)\n",
      "jobs              2\n",
      "00ff00ff", "moving", "8/8", "3 of 10", "1.0 MiB of 1.0 GiB",
      "476.8 MiB/s", "failed", "1/2", "error: rank 3 lost",
      /* The daemon's escape sequence and bad byte are shown, not obeyed. */
      "\\x1b[31m", "\\xff", "\\x09", "driver \xc3\xa9 ",
  };
  for (size_t i = 0; i < sizeof want / sizeof want[0]; i++)
    ck_assert_msg(strstr(r.out, want[i]), "no '%s' in:\n%s", want[i], r.out);
  ck_assert_ptr_null(strchr(r.out, '\033'));
  /* "ignored" was sent as the error of a job that has not failed. */
  ck_assert_ptr_null(strstr(r.out, "ignored"));

  ck_assert_int_eq(fake_daemon_start(&d, script_status_jobs, NULL), 0);
  run_cli((const char *[]){"--socket", d.socket, "status", "--json", NULL},
          &r);
  fake_daemon_stop(&d);
  ck_assert_msg(r.status == 0, "exit %d: %s", r.status, r.err);
  check_json("status-fake", d.socket, NULL, r.out);
}
END_TEST

int main(void) {
  Suite *s = suite_create("cli");
  TCase *live = tcase_create("live_daemon");
  tcase_add_checked_fixture(live, start, stop);
  tcase_set_timeout(live, 60);
  tcase_add_test(live, status_table);
  tcase_add_test(live, status_json);
  tcase_add_test(live, ping);
  tcase_add_test(live, default_socket_from_env);
  tcase_add_test(live, watch_refreshes);
  tcase_add_test(live, watch_survives_a_restart);
  tcase_add_test(live, jobs_show_and_abort);
  suite_add_tcase(s, live);
  TCase *exits = tcase_create("exit_statuses");
  tcase_set_timeout(exits, 60);
  tcase_add_test(exits, no_daemon_is_exit_3);
  tcase_add_test(exits, usage_errors_are_exit_2);
  tcase_add_test(exits, help_and_version);
  tcase_add_test(exits, error_reply_is_exit_1);
  tcase_add_test(exits, version_mismatch_is_exit_1);
  tcase_add_test(exits, jobs_table_and_hostile_strings);
  suite_add_tcase(s, exits);
  SRunner *sr = srunner_create(s);
  srunner_run_all(sr, CK_NORMAL);
  int failed = srunner_ntests_failed(sr);
  srunner_free(sr);
  return failed == 0 ? 0 : 1;
}
