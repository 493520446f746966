/*
 * test_client_fake.c - libshardport against a scripted fake daemon: every
 * reply a real daemon should never send, and some it may.
 */
#include <check.h>
#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "shardport.h"
#include "tests/unit/client/fake_daemon.h"

static int64_t now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* What a script saw, for the test to assert on the main thread. */
struct seen {
  int rc;            /* first failing helper's code, 0 if none */
  char client[64];   /* the hello's client string */
  uint64_t version;  /* the hello's version */
  int stray_read_fd; /* stray_fd: the read end the test keeps */
  const char *corrupt;
};

static void note(struct seen *s, int rc) {
  if (s && s->rc == 0 && rc < 0)
    s->rc = rc;
}

/* Answers one request of op (after the hello) with a good reply. */
static int answer(int conn, const char *op) {
  struct fake_request req;
  int rc = fake_recv(conn, &req);
  if (rc < 0)
    return rc;
  uint64_t id = req.head.id;
  bool match = strcmp(req.head.op, op) == 0;
  fake_request_free(&req);
  if (!match)
    return SP_EBADMSG;
  if (strcmp(op, "status") == 0)
    return fake_send_status(conn, id, NULL);
  return fake_send_op(conn, op, id);
}

/* ---- hello ---- */

static void script_hello_ping(int conn, void *arg) {
  struct seen *s = arg;
  struct fake_request req;
  int rc = fake_recv(conn, &req);
  note(s, rc);
  if (rc < 0)
    return;
  sp__msg_get_strbuf(&req.map, "client", false, s->client, sizeof s->client);
  sp__msg_get_u64(&req.map, "version", false, &s->version);
  struct sp_msgbuf mb;
  sp__msgbuf_begin(&mb, "hello", req.head.id, 2);
  sp__pack_kv_u64(&mb.pk, "version", SP_PROTOCOL_VERSION_NUMBER);
  sp__pack_kv_str(&mb.pk, "daemon", "0.1.0-fake");
  fake_request_free(&req);
  note(s, fake_send(conn, &mb, NULL, 0));
  note(s, answer(conn, "ping"));
}

START_TEST(hello_then_ping) {
  struct seen s = {0};
  struct fake_daemon d;
  ck_assert_int_eq(fake_daemon_start(&d, script_hello_ping, &s), 0);
  sp_client *c = NULL;
  ck_assert_int_eq(sp_connect(d.socket, &c), 0);
  uint64_t rtt = 0;
  ck_assert_int_eq(sp_ping(c, &rtt), 0);
  ck_assert_uint_gt(rtt, 0);
  ck_assert_str_eq(sp_last_message(c), "");
  sp_close(c);
  fake_daemon_stop(&d);
  ck_assert_int_eq(s.rc, 0);
  ck_assert_uint_eq(s.version, SP_PROTOCOL_VERSION_NUMBER);
  ck_assert_int_eq(strncmp(s.client, "libshardport ", 13), 0);
}
END_TEST

static void script_version_mismatch(int conn, void *arg) {
  struct fake_request req;
  int rc = fake_recv(conn, &req);
  note(arg, rc);
  if (rc < 0)
    return;
  note(arg, fake_send_error(conn, req.head.id, "version_mismatch",
                            "protocol version mismatch (client 1, daemon 2)"));
  fake_request_free(&req);
}

START_TEST(version_mismatch_error_is_eversion) {
  struct seen s = {0};
  struct fake_daemon d;
  ck_assert_int_eq(fake_daemon_start(&d, script_version_mismatch, &s), 0);
  sp_client *c = NULL;
  ck_assert_int_eq(sp_connect(d.socket, &c), SP_EVERSION);
  ck_assert_ptr_null(c);
  fake_daemon_stop(&d);
  ck_assert_int_eq(s.rc, 0);
}
END_TEST

/* A daemon that answers hello with its own, different version. */
static void script_other_version(int conn, void *arg) {
  struct fake_request req;
  int rc = fake_recv(conn, &req);
  note(arg, rc);
  if (rc < 0)
    return;
  struct sp_msgbuf mb;
  sp__msgbuf_begin(&mb, "hello", req.head.id, 2);
  sp__pack_kv_u64(&mb.pk, "version", SP_PROTOCOL_VERSION_NUMBER + 1);
  sp__pack_kv_str(&mb.pk, "daemon", "9.0.0");
  fake_request_free(&req);
  note(arg, fake_send(conn, &mb, NULL, 0));
}

START_TEST(hello_with_other_version_is_eversion) {
  struct seen s = {0};
  struct fake_daemon d;
  ck_assert_int_eq(fake_daemon_start(&d, script_other_version, &s), 0);
  sp_client *c = NULL;
  ck_assert_int_eq(sp_connect(d.socket, &c), SP_EVERSION);
  fake_daemon_stop(&d);
  ck_assert_int_eq(s.rc, 0);
}
END_TEST

static void script_hello_without_daemon(int conn, void *arg) {
  struct fake_request req;
  int rc = fake_recv(conn, &req);
  note(arg, rc);
  if (rc < 0)
    return;
  struct sp_msgbuf mb;
  sp__msgbuf_begin(&mb, "hello", req.head.id, 1);
  sp__pack_kv_u64(&mb.pk, "version", SP_PROTOCOL_VERSION_NUMBER);
  fake_request_free(&req);
  note(arg, fake_send(conn, &mb, NULL, 0));
}

START_TEST(hello_missing_field_is_ebadmsg) {
  struct seen s = {0};
  struct fake_daemon d;
  ck_assert_int_eq(fake_daemon_start(&d, script_hello_without_daemon, &s), 0);
  sp_client *c = NULL;
  ck_assert_int_eq(sp_connect(d.socket, &c), SP_EBADMSG);
  fake_daemon_stop(&d);
  ck_assert_int_eq(s.rc, 0);
}
END_TEST

/* The daemon refuses a peer before reading anything: an error with id 0,
 * then close.  Whether our hello went out first or not, the client must
 * report the refusal, not "closed". */
static void script_refuse_peer(int conn, void *arg) {
  note(arg, fake_send_error(conn, 0, "permission_denied",
                            "uid 1000 is not allowed"));
}

START_TEST(refused_peer_is_eperm) {
  for (int i = 0; i < 20; i++) {
    struct seen s = {0};
    struct fake_daemon d;
    ck_assert_int_eq(fake_daemon_start(&d, script_refuse_peer, &s), 0);
    sp_client *c = NULL;
    ck_assert_int_eq(sp_connect(d.socket, &c), SP_EPERM);
    fake_daemon_stop(&d);
    ck_assert_int_eq(s.rc, 0);
  }
}
END_TEST

static void script_close_at_once(int conn, void *arg) {
  (void)conn;
  (void)arg;
}

/* SIGPIPE keeps its default action here: a write without MSG_NOSIGNAL to
 * the closed socket would kill the test process. */
START_TEST(daemon_closing_is_an_error_not_a_signal) {
  signal(SIGPIPE, SIG_DFL);
  for (int i = 0; i < 20; i++) {
    struct fake_daemon d;
    ck_assert_int_eq(fake_daemon_start(&d, script_close_at_once, NULL), 0);
    sp_client *c = NULL;
    int rc = sp_connect(d.socket, &c);
    ck_assert_msg(rc == SP_ECLOSED || rc == SP_EIO, "rc %d", rc);
    fake_daemon_stop(&d);
  }
}
END_TEST

static void script_hello_then_close(int conn, void *arg) {
  note(arg, fake_hello(conn));
}

START_TEST(requests_after_close_fail_cleanly) {
  signal(SIGPIPE, SIG_DFL);
  struct seen s = {0};
  struct fake_daemon d;
  ck_assert_int_eq(fake_daemon_start(&d, script_hello_then_close, &s), 0);
  sp_client *c = NULL;
  ck_assert_int_eq(sp_connect(d.socket, &c), 0);
  fake_daemon_stop(&d); /* the script has returned: the connection is closed */
  for (int i = 0; i < 3; i++) {
    int rc = sp_ping(c, NULL);
    ck_assert_msg(rc == SP_ECLOSED || rc == SP_EIO, "rc %d", rc);
  }
  sp_close(c);
  ck_assert_int_eq(s.rc, 0);
}
END_TEST

/* ---- status ---- */

static void script_status(int conn, void *arg) {
  struct seen *s = arg;
  note(s, fake_hello(conn));
  struct fake_request req;
  int rc = fake_recv(conn, &req);
  note(s, rc);
  if (rc < 0)
    return;
  note(s, fake_send_status(conn, req.head.id, s->corrupt));
  fake_request_free(&req);
}

START_TEST(status_is_decoded) {
  struct seen s = {0};
  struct fake_daemon d;
  ck_assert_int_eq(fake_daemon_start(&d, script_status, &s), 0);
  sp_client *c = NULL;
  ck_assert_int_eq(sp_connect(d.socket, &c), 0);
  sp_status_info *st = NULL;
  ck_assert_int_eq(sp_status(c, &st), 0);
  sp_close(c);
  fake_daemon_stop(&d);
  ck_assert_int_eq(s.rc, 0);

  ck_assert_str_eq(st->daemon_version, "0.1.0-fake");
  ck_assert_uint_eq(st->protocol_version, SP_PROTOCOL_VERSION_NUMBER);
  ck_assert_str_eq(st->backends_built, "host,cuda");
  ck_assert_str_eq(st->backend_active, "host");
  ck_assert_str_eq(st->backend_reason, fake_backend_reason);
  ck_assert_double_eq(st->uptime_s, 93784.5);
  ck_assert_uint_eq(st->clients, 2);
  ck_assert_uint_eq(st->pool_used, 1536);
  ck_assert_uint_eq(st->pool_capacity, UINT64_C(1) << 30);
  ck_assert_uint_eq(st->njobs, 2);
  const sp_job_status *j = &st->jobs[0];
  ck_assert_str_eq(j->job_id, "00ff00ff");
  ck_assert_str_eq(j->phase, "moving");
  ck_assert_ptr_null(j->error); /* sent, but the job has not failed */
  ck_assert_uint_eq(j->world, 8);
  ck_assert_uint_eq(j->joined, 8);
  ck_assert_uint_eq(j->round, 3);
  ck_assert_uint_eq(j->rounds, 10);
  ck_assert_uint_eq(j->bytes_moved, UINT64_C(1) << 20);
  ck_assert_uint_eq(j->bytes_total, UINT64_C(1) << 30);
  ck_assert_double_eq(j->rate_bps, 5e8);
  j = &st->jobs[1];
  ck_assert_str_eq(j->job_id, "a1");
  ck_assert_str_eq(j->phase, "failed");
  ck_assert_str_eq(j->error, "rank 3 lost");
  ck_assert_uint_eq(j->world, 2);
  ck_assert_uint_eq(j->joined, 1);
  sp_status_free(st);
}
END_TEST

/* Each of these makes the status reply bad in one way. */
static const char *const corruptions[] = {
    "daemon_version", "protocol_version", "protocol_version:big",
    "backends_built", "backend_active",   "backend_reason",
    "uptime_s",       "uptime_s:nan",     "clients",
    "missing:clients", "pool_used",       "pool_capacity",
    "jobs[0]",        "job_id",           "world",
    "rate_bps",       "error",
};

START_TEST(bad_status_is_ebadmsg) {
  struct seen s = {.corrupt = corruptions[_i]};
  struct fake_daemon d;
  ck_assert_int_eq(fake_daemon_start(&d, script_status, &s), 0);
  sp_client *c = NULL;
  ck_assert_int_eq(sp_connect(d.socket, &c), 0);
  sp_status_info *st = NULL;
  ck_assert_msg(sp_status(c, &st) == SP_EBADMSG, "corrupt %s", s.corrupt);
  ck_assert_ptr_null(st);
  /* The stream is still in step: the client could go on. */
  sp_close(c);
  fake_daemon_stop(&d);
  ck_assert_int_eq(s.rc, 0);
}
END_TEST

static void script_status_busy(int conn, void *arg) {
  note(arg, fake_hello(conn));
  struct fake_request req;
  int rc = fake_recv(conn, &req);
  note(arg, rc);
  if (rc < 0)
    return;
  note(arg, fake_send_error(conn, req.head.id, "busy", "try again later"));
  fake_request_free(&req);
  rc = fake_recv(conn, &req);
  note(arg, rc);
  if (rc < 0)
    return;
  note(arg, fake_send_error(conn, req.head.id, "frobnicated", "new code"));
  fake_request_free(&req);
}

START_TEST(error_replies_carry_code_and_text) {
  struct seen s = {0};
  struct fake_daemon d;
  ck_assert_int_eq(fake_daemon_start(&d, script_status_busy, &s), 0);
  sp_client *c = NULL;
  ck_assert_int_eq(sp_connect(d.socket, &c), 0);
  sp_status_info *st = NULL;
  ck_assert_int_eq(sp_status(c, &st), SP_EBUSY);
  ck_assert_str_eq(sp_last_message(c), "try again later");
  /* A code this build does not know is internal, with the daemon's text. */
  ck_assert_int_eq(sp_ping(c, NULL), SP_EINTERNAL);
  ck_assert_str_eq(sp_last_message(c), "new code");
  sp_close(c);
  fake_daemon_stop(&d);
  ck_assert_int_eq(s.rc, 0);
}
END_TEST

/* ---- replies out of the ordinary ---- */

static void script_stray_fd(int conn, void *arg) {
  struct seen *s = arg;
  note(s, fake_hello(conn));
  struct fake_request req;
  int rc = fake_recv(conn, &req);
  note(s, rc);
  if (rc < 0)
    return;
  int p[2];
  if (pipe2(p, O_CLOEXEC) != 0) {
    note(s, SP_EIO);
    fake_request_free(&req);
    return;
  }
  s->stray_read_fd = p[0];
  struct sp_msgbuf mb;
  sp__msgbuf_begin(&mb, "ping", req.head.id, 0);
  note(s, fake_send(conn, &mb, &p[1], 1));
  close(p[1]); /* the only write end left is the one in flight */
  fake_request_free(&req);
}

START_TEST(stray_fd_is_closed) {
  struct seen s = {0};
  struct fake_daemon d;
  ck_assert_int_eq(fake_daemon_start(&d, script_stray_fd, &s), 0);
  sp_client *c = NULL;
  ck_assert_int_eq(sp_connect(d.socket, &c), 0);
  ck_assert_int_eq(sp_ping(c, NULL), 0);
  fake_daemon_stop(&d);
  ck_assert_int_eq(s.rc, 0);
  /* Once every write end is closed the read end sees end of file; a write
   * end kept open by the library would make this read wait instead. */
  ck_assert_int_eq(fcntl(s.stray_read_fd, F_SETFL, O_NONBLOCK), 0);
  char byte;
  ck_assert_int_eq(read(s.stray_read_fd, &byte, 1), 0);
  close(s.stray_read_fd);
  sp_close(c);
}
END_TEST

/* Late replies to old requests and errors for other ids are skipped. */
static void script_stale_replies(int conn, void *arg) {
  note(arg, fake_hello(conn));
  struct fake_request req;
  int rc = fake_recv(conn, &req);
  note(arg, rc);
  if (rc < 0)
    return;
  note(arg, fake_send_op(conn, "ping", req.head.id + 100));
  note(arg, fake_send_error(conn, req.head.id + 7, "busy", "not yours"));
  note(arg, fake_send_op(conn, "ping", req.head.id));
  fake_request_free(&req);
}

START_TEST(replies_to_other_ids_are_skipped) {
  struct seen s = {0};
  struct fake_daemon d;
  ck_assert_int_eq(fake_daemon_start(&d, script_stale_replies, &s), 0);
  sp_client *c = NULL;
  ck_assert_int_eq(sp_connect(d.socket, &c), 0);
  ck_assert_int_eq(sp_ping(c, NULL), 0);
  sp_close(c);
  fake_daemon_stop(&d);
  ck_assert_int_eq(s.rc, 0);
}
END_TEST

static void script_wrong_op(int conn, void *arg) {
  note(arg, fake_hello(conn));
  struct fake_request req;
  int rc = fake_recv(conn, &req);
  note(arg, rc);
  if (rc < 0)
    return;
  note(arg, fake_send_op(conn, "status", req.head.id));
  fake_request_free(&req);
}

START_TEST(reply_with_other_op_is_ebadmsg) {
  struct seen s = {0};
  struct fake_daemon d;
  ck_assert_int_eq(fake_daemon_start(&d, script_wrong_op, &s), 0);
  sp_client *c = NULL;
  ck_assert_int_eq(sp_connect(d.socket, &c), 0);
  ck_assert_int_eq(sp_ping(c, NULL), SP_EBADMSG);
  sp_close(c);
  fake_daemon_stop(&d);
  ck_assert_int_eq(s.rc, 0);
}
END_TEST

/* A frame whose payload is not a map, then one that claims 4 GiB. */
static void script_bad_frames(int conn, void *arg) {
  note(arg, fake_hello(conn));
  struct fake_request req;
  int rc = fake_recv(conn, &req);
  note(arg, rc);
  if (rc < 0)
    return;
  fake_request_free(&req);
  static const uint8_t not_a_map[] = {0, 0, 0, 1, 0x01};
  note(arg, sp__frame_send(conn, not_a_map, sizeof not_a_map, NULL, 0));
  rc = fake_recv(conn, &req);
  note(arg, rc);
  if (rc < 0)
    return;
  fake_request_free(&req);
  static const uint8_t huge[] = {0xff, 0xff, 0xff, 0xff};
  note(arg, sp__frame_send(conn, huge, sizeof huge, NULL, 0));
}

START_TEST(bad_frames_are_refused) {
  struct seen s = {0};
  struct fake_daemon d;
  ck_assert_int_eq(fake_daemon_start(&d, script_bad_frames, &s), 0);
  sp_client *c = NULL;
  ck_assert_int_eq(sp_connect(d.socket, &c), 0);
  ck_assert_int_eq(sp_ping(c, NULL), SP_EMALFORMED);
  ck_assert_int_eq(sp_ping(c, NULL), SP_EFRAMETOOBIG);
  /* The stream is out of step now: every later request says so at once. */
  ck_assert_int_eq(sp_ping(c, NULL), SP_EFRAMETOOBIG);
  sp_close(c);
  fake_daemon_stop(&d);
  ck_assert_int_eq(s.rc, 0);
}
END_TEST

/* Answers the first ping only after the client gave up on it, then answers
 * the second at once. */
static void script_slow(int conn, void *arg) {
  note(arg, fake_hello(conn));
  struct fake_request req;
  int rc = fake_recv(conn, &req);
  note(arg, rc);
  if (rc < 0)
    return;
  uint64_t first = req.head.id;
  fake_request_free(&req);
  rc = fake_recv(conn, &req); /* the second ping comes after the timeout */
  note(arg, rc);
  if (rc < 0)
    return;
  note(arg, fake_send_op(conn, "ping", first));
  note(arg, fake_send_op(conn, "ping", req.head.id));
  fake_request_free(&req);
}

START_TEST(timeout_then_late_reply_is_dropped) {
  struct seen s = {0};
  struct fake_daemon d;
  ck_assert_int_eq(fake_daemon_start(&d, script_slow, &s), 0);
  sp_client *c = NULL;
  ck_assert_int_eq(sp_connect(d.socket, &c), 0);
  ck_assert_int_eq(sp_set_timeout(c, 200), 0);
  int64_t t0 = now_ms();
  ck_assert_int_eq(sp_ping(c, NULL), SP_ETIMEOUT);
  int64_t took = now_ms() - t0;
  ck_assert_int_ge(took, 150);
  ck_assert_int_lt(took, 5000);
  ck_assert_int_eq(sp_set_timeout(c, 5000), 0);
  ck_assert_int_eq(sp_ping(c, NULL), 0);
  sp_close(c);
  fake_daemon_stop(&d);
  ck_assert_int_eq(s.rc, 0);
}
END_TEST

/* The library's socket must not survive an exec in the caller. */
static void script_hello_wait(int conn, void *arg) {
  note(arg, fake_hello(conn));
  note(arg, answer(conn, "ping"));
}

START_TEST(sockets_are_close_on_exec) {
  struct seen s = {0};
  struct fake_daemon d;
  ck_assert_int_eq(fake_daemon_start(&d, script_hello_wait, &s), 0);
  sp_client *c = NULL;
  ck_assert_int_eq(sp_connect(d.socket, &c), 0);
  DIR *dir = opendir("/proc/self/fd");
  ck_assert_ptr_nonnull(dir);
  int sockets = 0;
  struct dirent *e;
  while ((e = readdir(dir)) != NULL) {
    if (e->d_name[0] == '.')
      continue;
    int fd = atoi(e->d_name);
    struct stat st;
    if (fd == dirfd(dir) || fstat(fd, &st) != 0 || !S_ISSOCK(st.st_mode))
      continue;
    sockets++;
    ck_assert_msg(fcntl(fd, F_GETFD) & FD_CLOEXEC, "fd %d lacks CLOEXEC", fd);
  }
  closedir(dir);
  /* The fake's listener and connection, and the client's socket. */
  ck_assert_int_ge(sockets, 3);
  ck_assert_int_eq(sp_ping(c, NULL), 0);
  sp_close(c);
  fake_daemon_stop(&d);
  ck_assert_int_eq(s.rc, 0);
}
END_TEST

int main(void) {
  Suite *s = suite_create("client_fake_daemon");
  TCase *hello = tcase_create("hello");
  tcase_add_test(hello, hello_then_ping);
  tcase_add_test(hello, version_mismatch_error_is_eversion);
  tcase_add_test(hello, hello_with_other_version_is_eversion);
  tcase_add_test(hello, hello_missing_field_is_ebadmsg);
  tcase_add_test(hello, refused_peer_is_eperm);
  tcase_add_test(hello, daemon_closing_is_an_error_not_a_signal);
  tcase_add_test(hello, requests_after_close_fail_cleanly);
  suite_add_tcase(s, hello);
  TCase *status = tcase_create("status");
  tcase_add_test(status, status_is_decoded);
  tcase_add_loop_test(status, bad_status_is_ebadmsg, 0,
                      sizeof corruptions / sizeof corruptions[0]);
  tcase_add_test(status, error_replies_carry_code_and_text);
  suite_add_tcase(s, status);
  TCase *odd = tcase_create("odd_replies");
  tcase_add_test(odd, stray_fd_is_closed);
  tcase_add_test(odd, replies_to_other_ids_are_skipped);
  tcase_add_test(odd, reply_with_other_op_is_ebadmsg);
  tcase_add_test(odd, bad_frames_are_refused);
  tcase_add_test(odd, timeout_then_late_reply_is_dropped);
  tcase_add_test(odd, sockets_are_close_on_exec);
  suite_add_tcase(s, odd);
  SRunner *sr = srunner_create(s);
  srunner_run_all(sr, CK_NORMAL);
  int failed = srunner_ntests_failed(sr);
  srunner_free(sr);
  return failed == 0 ? 0 : 1;
}
