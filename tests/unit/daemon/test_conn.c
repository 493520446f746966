/*
 * test_conn.c - conn.c's dispatch through the table (ops.c), with no
 * daemon: a real connection over one end of a socketpair on a test server
 * (tserver.h), the test the client on the other end.  Before hello only a
 * good hello is served, and anything else ends the connection after its
 * error; after it every op reaches its handler, an unknown one is refused
 * and the connection stays; a draining daemon refuses exactly the ops that
 * start new work.
 */
#include <check.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "build_config.h"
#include "daemon/conn.h"
#include "daemon/peer.h"
#include "proto/frame.h"
#include "proto/msg.h"
#include "proto/wire.h"
#include "shardport.h"
#include "tests/unit/daemon/tserver.h"

static struct tserver ts;
static int client = -1;
static struct sp_frame_rx rx;

static void setup(void) {
  tserver_init(&ts, 1u << 20);
  int sv[2];
  ck_assert_int_eq(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv), 0);
  ck_assert_int_eq(fcntl(sv[0], F_SETFL, O_NONBLOCK), 0);
  ck_assert_int_eq(fcntl(sv[1], F_SETFL, O_NONBLOCK), 0);
  struct peer peer = {.pid = getpid(), .uid = getuid(), .gid = getgid()};
  ck_assert_int_eq(conn_open(&ts.srv, sv[0], &peer), 0);
  client = sv[1];
  struct sp_limits limits;
  sp__limits_default(&limits);
  sp__frame_rx_init(&rx, &limits);
}

static void teardown(void) {
  while (ts.srv.conns != NULL)
    conn_close(ts.srv.conns);
  sp__frame_rx_reset(&rx);
  close(client);
  tserver_free(&ts);
}

struct reply {
  char op[SP_OP_MAX + 1];
  int code; /* an error reply's, else 0 */
  char message[SP_ERRMSG_MAX + 1];
  uint64_t version; /* hello */
};

/* Sends {"op":op,"id":1} with a "version" field when version > 0. */
static void send_op(const char *op, uint64_t version) {
  struct sp_msgbuf mb;
  sp__msgbuf_begin(&mb, op, 1, version > 0 ? 1 : 0);
  if (version > 0)
    sp__pack_kv_u64(&mb.pk, "version", version);
  struct sp_frame_tx tx = {0};
  ck_assert_int_eq(sp__msgbuf_finish(&mb, &tx), 0);
  ck_assert_int_eq(sp__frame_send(client, tx.buf, tx.len, NULL, 0), 0);
  free(tx.buf);
}

/* Runs the loop until the next reply arrives: 0 and the reply, or the
 * code sp__frame_rx_read ended the stream with (SP_ECLOSED: the daemon
 * closed the connection). */
static int next_reply(struct reply *r) {
  for (int i = 0; i < 5000; i++) {
    uv_run(&ts.loop, UV_RUN_NOWAIT);
    struct sp_frame frame;
    int rc = sp__frame_rx_read(&rx, client, &frame);
    if (rc < 0)
      return rc;
    if (rc == 0) {
      nanosleep(&(struct timespec){.tv_nsec = 1000000}, NULL);
      continue;
    }
    struct sp_limits limits;
    sp__limits_default(&limits);
    msgpack_zone zone;
    msgpack_object map;
    struct sp_msg_head head;
    ck_assert(msgpack_zone_init(&zone, 4096));
    ck_assert_int_eq(
        sp__wire_decode(frame.data, frame.len, &limits, &zone, &map), 0);
    ck_assert_int_eq(sp__msg_head(&map, &head), 0);
    memset(r, 0, sizeof *r);
    snprintf(r->op, sizeof r->op, "%s", head.op);
    if (strcmp(head.op, "error") == 0)
      r->code = sp__msg_error_code(&map, r->message, sizeof r->message);
    sp__msg_get_u64(&map, "version", true, &r->version);
    msgpack_zone_destroy(&zone);
    sp__frame_release(&frame);
    return 0;
  }
  ck_abort_msg("no reply came");
  return SP_ETIMEOUT;
}

static void expect(const char *op, int code) {
  struct reply r;
  ck_assert_int_eq(next_reply(&r), 0);
  ck_assert_str_eq(r.op, code != 0 ? "error" : op);
  ck_assert_int_eq(r.code, code);
}

START_TEST(the_first_frame_must_be_hello) {
  send_op("ping", 0);
  struct reply r;
  ck_assert_int_eq(next_reply(&r), 0);
  ck_assert_int_eq(r.code, SP_EHELLO);
  ck_assert_msg(strstr(r.message, "not \"ping\"") != NULL, "%s", r.message);
  /* The reply was the last: the daemon ends the connection. */
  ck_assert_int_eq(next_reply(&r), SP_ECLOSED);
}
END_TEST

START_TEST(another_protocol_version_is_answered_then_the_connection_ends) {
  send_op("hello", SP_PROTOCOL_VERSION + 1);
  struct reply r;
  ck_assert_int_eq(next_reply(&r), 0);
  ck_assert_int_eq(r.code, SP_EVERSION);
  char want[96];
  snprintf(want, sizeof want,
           "protocol version mismatch (client %d, daemon %d)",
           SP_PROTOCOL_VERSION + 1, SP_PROTOCOL_VERSION);
  ck_assert_str_eq(r.message, want);
  ck_assert_int_eq(next_reply(&r), SP_ECLOSED);
}
END_TEST

START_TEST(after_hello_each_op_reaches_its_handler) {
  send_op("hello", SP_PROTOCOL_VERSION);
  struct reply r;
  ck_assert_int_eq(next_reply(&r), 0);
  ck_assert_str_eq(r.op, "hello");
  ck_assert_uint_eq(r.version, SP_PROTOCOL_VERSION);
  send_op("ping", 0);
  expect("ping", 0);
  send_op("status", 0);
  expect("status", 0);
  send_op("jobs", 0);
  expect("jobs", 0);
  /* A handler's own refusal. */
  send_op("leave", 0);
  expect("leave", SP_ESTATE);
  send_op("hello", SP_PROTOCOL_VERSION);
  expect("hello", SP_ESTATE);
  /* An op the table lacks is refused; the connection serves on. */
  send_op("frobnicate", 0);
  ck_assert_int_eq(next_reply(&r), 0);
  ck_assert_int_eq(r.code, SP_EUNKNOWNOP);
  ck_assert_str_eq(r.message, "unknown operation \"frobnicate\"");
  send_op("ping", 0);
  expect("ping", 0);
}
END_TEST

START_TEST(a_draining_daemon_refuses_only_new_work) {
  send_op("hello", SP_PROTOCOL_VERSION);
  expect("hello", 0);
  ts.srv.draining = true;
  snprintf(ts.srv.stop_reason, sizeof ts.srv.stop_reason, "SIGTERM");
  static const char *const new_work[] = {"job_create", "join", "storage_add",
                                         "tensor_add", "export"};
  for (size_t i = 0; i < sizeof new_work / sizeof new_work[0]; i++) {
    send_op(new_work[i], 0);
    struct reply r;
    ck_assert_int_eq(next_reply(&r), 0);
    ck_assert_int_eq(r.code, SP_EDAEMONSTOPPING);
    ck_assert_msg(strncmp(r.message, new_work[i], strlen(new_work[i])) == 0,
                  "%s", r.message);
  }
  /* What starts nothing is still served. */
  send_op("ping", 0);
  expect("ping", 0);
  send_op("jobs", 0);
  expect("jobs", 0);
  send_op("leave", 0);
  expect("leave", SP_ESTATE);
}
END_TEST

static Suite *suite(void) {
  Suite *s = suite_create("daemon-conn");
  TCase *tc = tcase_create("dispatch");
  tcase_set_timeout(tc, 30);
  tcase_add_checked_fixture(tc, setup, teardown);
  tcase_add_test(tc, the_first_frame_must_be_hello);
  tcase_add_test(tc,
                 another_protocol_version_is_answered_then_the_connection_ends);
  tcase_add_test(tc, after_hello_each_op_reaches_its_handler);
  tcase_add_test(tc, a_draining_daemon_refuses_only_new_work);
  suite_add_tcase(s, tc);
  return s;
}

int main(void) {
  SRunner *sr = srunner_create(suite());
  srunner_run_all(sr, CK_NORMAL);
  int failed = srunner_ntests_failed(sr);
  srunner_free(sr);
  return failed == 0 ? 0 : 1;
}
