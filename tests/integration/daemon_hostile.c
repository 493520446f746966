/*
 * daemon_hostile.c - frames that bring other decoders down, stray and
 * excess fds, clients that flood or stall: each is refused with its error
 * code (or a close, per docs/protocol.md) while the daemon's memory stays
 * bounded and a second client keeps getting its ping replies.
 */
#include <check.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "build_config.h"
#include "tests/integration/harness.h"

static struct sp_test_daemon daemon_;

static void start(void) {
  /* The RSS bounds below would count a sanitizer's quarantine as growth. */
  sp_test_small_quarantine();
  ck_assert_int_eq(sp_test_daemon_start(&daemon_, NULL), 0);
}

static void stop(void) {
  if (daemon_.pid > 0)
    ck_assert_int_eq(sp_test_daemon_stop(&daemon_), 0);
}

/* Sends payload as one frame with a correct length prefix. */
static int send_frame(int sock, const void *payload, size_t len) {
  uint8_t *buf = malloc(len + 4);
  ck_assert_ptr_nonnull(buf);
  buf[0] = (uint8_t)(len >> 24);
  buf[1] = (uint8_t)(len >> 16);
  buf[2] = (uint8_t)(len >> 8);
  buf[3] = (uint8_t)len;
  memcpy(buf + 4, payload, len);
  int rc = sp_test_send_raw(sock, buf, len + 4, NULL, 0);
  free(buf);
  return rc;
}

/* {"op":"ping","id":ID,"x":<value>} with value given as raw bytes. */
static size_t ping_with(uint8_t *out, uint8_t id, const uint8_t *value,
                        size_t vlen) {
  static const uint8_t head[] = {0x83, 0xa2, 'o', 'p', 0xa4, 'p', 'i', 'n',
                                 'g',  0xa2, 'i', 'd'};
  size_t n = 0;
  memcpy(out, head, sizeof(head));
  n += sizeof(head);
  out[n++] = id; /* positive fixint */
  out[n++] = 0xa1;
  out[n++] = 'x';
  memcpy(out + n, value, vlen);
  return n + vlen;
}

/* Expects one error reply with code and id; the connection stays open. */
static void expect_error(int sock, int code, uint64_t id) {
  struct sp_test_reply r;
  ck_assert_int_eq(sp_test_recv(sock, &r, SP_TEST_TIMEOUT_MS), 0);
  ck_assert_str_eq(r.head.op, "error");
  ck_assert_msg(r.code == code, "expected %s, got %s (%s)", sp_err_name(code),
                sp_err_name(r.code), r.message);
  ck_assert_uint_eq(r.head.id, id);
  sp_test_reply_free(&r);
}

struct hostile {
  const char *name;
  uint8_t payload[64];
  size_t len;
  int code;
  uint64_t id;
};

static size_t nhostile;
static struct hostile hostile[16];

static void add(const char *name, const uint8_t *payload, size_t len, int code,
                uint64_t id) {
  ck_assert_uint_lt(nhostile, sizeof(hostile) / sizeof(hostile[0]));
  struct hostile *h = &hostile[nhostile++];
  h->name = name;
  memcpy(h->payload, payload, len);
  h->len = len;
  h->code = code;
  h->id = id;
}

static void build_hostile(void) {
  nhostile = 0;
  /* An array claiming 4,278,190,080 elements (msgpack-c asks for ~96 GB):
   * not a map, refused before anything is allocated. */
  add("dd ff 00 00 00", (const uint8_t[]){0xdd, 0xff, 0x00, 0x00, 0x00}, 5,
      SP_EMALFORMED, 0);
  /* A map claiming 4,294,967,295 pairs. */
  add("df ff ff ff ff", (const uint8_t[]){0xdf, 0xff, 0xff, 0xff, 0xff}, 5,
      SP_ETOOMANY, 0);
  uint8_t p[64], v[40];
  /* 20 nested arrays: depth 21 with the top-level map, limit 16. */
  memset(v, 0x91, 20);
  v[20] = 0xc0;
  add("nesting deeper than the limit", p, ping_with(p, 11, v, 21), SP_ETOODEEP,
      0);
  /* An array declaring 1,048,576 elements with two bytes behind it. */
  memcpy(v, (const uint8_t[]){0xdd, 0x00, 0x10, 0x00, 0x00, 0xc0, 0xc0}, 7);
  add("array count beyond the frame", p, ping_with(p, 12, v, 7), SP_ETOOMANY,
      0);
  /* An array declaring more than max_items. */
  memcpy(v, (const uint8_t[]){0xdd, 0x00, 0x20, 0x00, 0x00, 0xc0}, 6);
  add("array count beyond max_items", p, ping_with(p, 13, v, 6), SP_ETOOMANY,
      0);
  /* A str of 2 GiB. */
  memcpy(v, (const uint8_t[]){0xdb, 0x7f, 0xff, 0xff, 0xff, 'a'}, 6);
  add("string longer than the limit", p, ping_with(p, 14, v, 6),
      SP_ESTRTOOLONG, 0);
  add("empty frame", p, 0, SP_EMALFORMED, 0);
  add("not a map", (const uint8_t[]){0x2a}, 1, SP_EMALFORMED, 0);
  /* A good map followed by a stray byte. */
  v[0] = 0xc0;
  size_t n = ping_with(p, 15, v, 1);
  p[n] = 0xc0;
  add("bytes after the map", p, n + 1, SP_EMALFORMED, 0);
  add("0xc1 (never used)", (const uint8_t[]){0x81, 0xa1, 'x', 0xc1}, 4,
      SP_EMALFORMED, 0);
  /* Well-formed msgpack, broken envelope: the id is still echoed. */
  add("no op", (const uint8_t[]){0x81, 0xa2, 'i', 'd', 0x07}, 5, SP_EBADMSG, 7);
  uint8_t longop[64] = {0x82, 0xa2, 'o', 'p', 0xa0 | 31};
  memset(longop + 5, 'o', 31);
  memcpy(longop + 36, (const uint8_t[]){0xa2, 'i', 'd', 0x08}, 4);
  add("op of 31 bytes is fine, but unknown", longop, 40, SP_EUNKNOWNOP, 8);
  uint8_t toolong[64] = {0x82, 0xa2, 'o', 'p', 0xd9, 32};
  memset(toolong + 6, 'o', 32);
  memcpy(toolong + 38, (const uint8_t[]){0xa2, 'i', 'd', 0x09}, 4);
  add("op longer than 31 bytes", toolong, 42, SP_EBADMSG, 9);
  add("id not an integer",
      (const uint8_t[]){0x82, 0xa2, 'o', 'p', 0xa4, 'p', 'i', 'n', 'g', 0xa2,
                        'i', 'd', 0xa1, 'x'},
      14, SP_EBADMSG, 0);
}

START_TEST(hostile_frames_bounded) {
  build_hostile();
  int bad = sp_test_connect_hello(daemon_.socket);
  int good = sp_test_connect_hello(daemon_.socket);
  ck_assert_int_ge(bad, 0);
  ck_assert_int_ge(good, 0);
  ck_assert_int_eq(sp_test_ping(good, 1), 0);
  long rss_before = sp_test_rss_kb(daemon_.pid);
  long peak_before = sp_test_vm_kb(daemon_.pid, "VmPeak");
  ck_assert_int_gt(rss_before, 0);

  uint64_t ping_id = 2;
  for (int round = 0; round < 100; round++) {
    for (size_t i = 0; i < nhostile; i++) {
      ck_assert_int_eq(send_frame(bad, hostile[i].payload, hostile[i].len), 0);
      struct sp_test_reply r;
      ck_assert_int_eq(sp_test_recv(bad, &r, SP_TEST_TIMEOUT_MS), 0);
      ck_assert_msg(r.code == hostile[i].code && r.head.id == hostile[i].id,
                    "%s: expected %s id %llu, got %s id %llu (%s)",
                    hostile[i].name, sp_err_name(hostile[i].code),
                    (unsigned long long)hostile[i].id, sp_err_name(r.code),
                    (unsigned long long)r.head.id, r.message);
      sp_test_reply_free(&r);
      /* The refused frame left the connection in step. */
      ck_assert_int_eq(sp_test_ping(bad, ping_id++), 0);
      ck_assert_int_eq(sp_test_ping(good, ping_id++), 0);
    }
  }

  /* A length prefix of 4 GiB - 1: refused before any allocation, and the
   * connection closed because the stream cannot be resynchronised. */
  for (int i = 0; i < 50; i++) {
    int sock = sp_test_connect_hello(daemon_.socket);
    ck_assert_int_ge(sock, 0);
    static const uint8_t huge[] = {0xff, 0xff, 0xff, 0xff, 0x81};
    ck_assert_int_eq(sp_test_send_raw(sock, huge, sizeof(huge), NULL, 0), 0);
    expect_error(sock, SP_EFRAMETOOBIG, 0);
    ck_assert_int_eq(sp_test_wait_closed(sock, SP_TEST_TIMEOUT_MS), 0);
    close(sock);
    ck_assert_int_eq(sp_test_ping(good, ping_id++), 0);
  }

  long rss_after = sp_test_rss_kb(daemon_.pid);
  long peak_after = sp_test_vm_kb(daemon_.pid, "VmPeak");
  /* Thousands of refused frames cost no more than allocator noise, and no
   * declared size was ever reserved, even untouched (that would raise the
   * virtual peak by gigabytes). */
  ck_assert_msg(rss_after - rss_before < 32 * 1024,
                "RSS grew from %ld to %ld KiB", rss_before, rss_after);
  ck_assert_msg(peak_after - peak_before < 256 * 1024,
                "VmPeak grew from %ld to %ld KiB", peak_before, peak_after);
  ck_assert_int_eq(sp_test_ping(bad, ping_id++), 0);
  close(bad);
  close(good);
}
END_TEST

/* Before hello, a bad frame is answered and the connection closed. */
START_TEST(hostile_first_frame) {
  int sock = sp_test_connect(daemon_.socket);
  ck_assert_int_ge(sock, 0);
  ck_assert_int_eq(send_frame(sock, (const uint8_t[]){0xdd, 0xff, 0, 0, 0}, 5),
                   0);
  expect_error(sock, SP_EMALFORMED, 0);
  ck_assert_int_eq(sp_test_wait_closed(sock, SP_TEST_TIMEOUT_MS), 0);
  close(sock);
}
END_TEST

/* Before hello, a frame larger than a hello needs is refused unread, so
 * that a peer that never says hello cannot make the daemon hold max_frame. */
START_TEST(large_frame_before_hello_refused) {
  int sock = sp_test_connect(daemon_.socket);
  ck_assert_int_ge(sock, 0);
  static const uint8_t header[] = {0x00, 0x00, 0x10, 0x01}; /* 4097 bytes */
  ck_assert_int_eq(sp_test_send_raw(sock, header, sizeof(header), NULL, 0), 0);
  expect_error(sock, SP_EFRAMETOOBIG, 0);
  ck_assert_int_eq(sp_test_wait_closed(sock, SP_TEST_TIMEOUT_MS), 0);
  close(sock);
  /* After hello the configured max_frame applies again. */
  int good = sp_test_connect_hello(daemon_.socket);
  ck_assert_int_ge(good, 0);
  /* {"op":"ping","id":7,"pad":<bin of 4976 bytes>}: 4996 bytes of payload. */
  uint8_t ping[5000] = {0x00, 0x00, 0x13, 0x84, 0x83, 0xa2, 'o', 'p', 0xa4,
                        'p', 'i', 'n', 'g', 0xa2, 'i', 'd', 0x07, 0xa3,
                        'p', 'a', 'd', 0xc5, 0x13, 0x70};
  ck_assert_int_eq(sp_test_send_raw(good, ping, sizeof(ping), NULL, 0), 0);
  struct sp_test_reply reply;
  ck_assert_int_eq(sp_test_recv(good, &reply, SP_TEST_TIMEOUT_MS), 0);
  ck_assert_str_eq(reply.head.op, "ping");
  sp_test_reply_free(&reply);
  close(good);
}
END_TEST

/* A frame whose length is announced but whose payload never comes holds
 * only its own connection. */
START_TEST(stalled_frame_isolated) {
  int slow = sp_test_connect_hello(daemon_.socket);
  int good = sp_test_connect_hello(daemon_.socket);
  ck_assert_int_ge(slow, 0);
  ck_assert_int_ge(good, 0);
  static const uint8_t partial[] = {0x00, 0x00, 0x10, 0x00, 0x83, 0xa2};
  ck_assert_int_eq(sp_test_send_raw(slow, partial, sizeof(partial), NULL, 0),
                   0);
  for (uint64_t id = 1; id <= 20; id++)
    ck_assert_int_eq(sp_test_ping(good, id), 0);
  /* Cut inside the frame: that connection goes, the other stays. */
  close(slow);
  ck_assert_int_eq(sp_test_ping(good, 21), 0);
  close(good);
}
END_TEST

static int make_memfd(void) {
  int fd = memfd_create("sp-test", MFD_CLOEXEC);
  ck_assert_int_ge(fd, 0);
  ck_assert_int_eq(ftruncate(fd, 4096), 0);
  return fd;
}

/* Waits until the daemon holds want fds (closes are asynchronous). */
static int wait_fd_count(int want) {
  int n = -1;
  for (int i = 0; i < 1000; i++) {
    n = sp_test_count_fds(daemon_.pid);
    if (n == want)
      break;
    struct timespec ts = {0, 5 * 1000 * 1000};
    nanosleep(&ts, NULL);
  }
  return n;
}

START_TEST(stray_fds_closed) {
  int sock = sp_test_connect_hello(daemon_.socket);
  ck_assert_int_ge(sock, 0);
  ck_assert_int_eq(sp_test_ping(sock, 1), 0);
  int baseline = sp_test_count_fds(daemon_.pid);
  ck_assert_int_gt(baseline, 0);

  int fds[8];
  for (int i = 0; i < 8; i++)
    fds[i] = make_memfd();
  /* A ping takes no fds: they are closed and the ping is still served. */
  ck_assert_int_eq(sp_test_send_op(sock, "ping", 2, fds, 1), 0);
  struct sp_test_reply r;
  ck_assert_int_eq(sp_test_recv(sock, &r, SP_TEST_TIMEOUT_MS), 0);
  ck_assert_str_eq(r.head.op, "ping");
  sp_test_reply_free(&r);
  ck_assert_int_eq(sp_test_count_fds(daemon_.pid), baseline);

  ck_assert_int_eq(sp_test_send_op(sock, "status", 3, fds, 8), 0);
  ck_assert_int_eq(sp_test_recv(sock, &r, SP_TEST_TIMEOUT_MS), 0);
  ck_assert_str_eq(r.head.op, "status");
  sp_test_reply_free(&r);
  ck_assert_int_eq(sp_test_count_fds(daemon_.pid), baseline);

  /* fds that come with a frame the daemon refuses are closed too. */
  uint8_t frame[] = {0, 0, 0, 1, 0x2a};
  ck_assert_int_eq(sp_test_send_raw(sock, frame, sizeof(frame), fds, 8), 0);
  expect_error(sock, SP_EMALFORMED, 0);
  ck_assert_int_eq(sp_test_count_fds(daemon_.pid), baseline);
  for (int i = 0; i < 8; i++)
    close(fds[i]);
  close(sock);
}
END_TEST

START_TEST(too_many_fds) {
  int good = sp_test_connect_hello(daemon_.socket);
  ck_assert_int_ge(good, 0);
  ck_assert_int_eq(sp_test_ping(good, 1), 0);
  int baseline = sp_test_count_fds(daemon_.pid);

  int fds[SP_LIMITS_DEFAULT_MAX_FDS + 1];
  fds[0] = make_memfd();
  for (size_t i = 1; i < sizeof(fds) / sizeof(fds[0]); i++)
    fds[i] = fds[0];
  int sock = sp_test_connect_hello(daemon_.socket);
  ck_assert_int_ge(sock, 0);
  ck_assert_int_eq(
      sp_test_send_op(sock, "ping", 2, fds, sizeof(fds) / sizeof(fds[0])), 0);
  expect_error(sock, SP_ETOOMANYFDS, 0);
  ck_assert_int_eq(sp_test_wait_closed(sock, SP_TEST_TIMEOUT_MS), 0);
  close(sock);
  /* Every one of them closed, and the connection's socket too. */
  ck_assert_int_eq(wait_fd_count(baseline), baseline);

  /* Exactly max_fds is fine (and closed, since ping takes none). */
  sock = sp_test_connect_hello(daemon_.socket);
  ck_assert_int_ge(sock, 0);
  ck_assert_int_eq(sp_test_send_op(sock, "ping", 3, fds, SP_LIMITS_DEFAULT_MAX_FDS),
                   0);
  struct sp_test_reply r;
  ck_assert_int_eq(sp_test_recv(sock, &r, SP_TEST_TIMEOUT_MS), 0);
  ck_assert_str_eq(r.head.op, "ping");
  sp_test_reply_free(&r);
  close(sock);
  ck_assert_int_eq(wait_fd_count(baseline), baseline);
  close(fds[0]);
  ck_assert_int_eq(sp_test_ping(good, 4), 0);
  close(good);
}
END_TEST

/* A client that connects and says nothing is let go after the hello
 * timeout (10 s), so that idle sockets cannot hold max_clients slots; one
 * that said hello stays. */
START_TEST(silent_client_dropped) {
  int silent = sp_test_connect(daemon_.socket);
  int talker = sp_test_connect_hello(daemon_.socket);
  ck_assert_int_ge(silent, 0);
  ck_assert_int_ge(talker, 0);
  ck_assert_int_eq(sp_test_wait_closed(silent, 20000), 0);
  close(silent);
  ck_assert_int_eq(sp_test_ping(talker, 1), 0);
  close(talker);
}
END_TEST

/* A daemon with a small output queue and few connection slots. */
static struct sp_test_daemon small_;
static char small_dir[256];

static void start_small(void) {
  ck_assert_int_eq(sp_test_mkdtemp(small_dir, sizeof(small_dir)), 0);
  char path[300];
  snprintf(path, sizeof(path), "%s/small.conf", small_dir);
  ck_assert_int_eq(
      sp_test_write_file(path, "max_output = 4096\nmax_clients = 4\n"), 0);
  const char *args[] = {"--config", path, NULL};
  ck_assert_int_eq(sp_test_daemon_start(&small_, args), 0);
}

static void stop_small(void) {
  if (small_.pid > 0)
    ck_assert_int_eq(sp_test_daemon_stop(&small_), 0);
  sp_test_rmdir(small_dir);
}

START_TEST(unread_replies_disconnect) {
  int good = sp_test_connect_hello(small_.socket);
  int flood = sp_test_connect_hello(small_.socket);
  ck_assert_int_ge(good, 0);
  ck_assert_int_ge(flood, 0);
  /* Status requests, never reading a reply: once the socket buffer and
   * 4 KiB of queue are full, the daemon lets go of this client. */
  struct sp_frame_tx tx;
  struct sp_msgbuf mb;
  sp__msgbuf_begin(&mb, "status", 1, 0);
  ck_assert_int_eq(sp__msgbuf_finish(&mb, &tx), 0);
  int rc = 0;
  int sent;
  for (sent = 0; sent < 1000000 && rc == 0; sent++) {
    rc = sp_test_send_raw(flood, tx.buf, tx.len, NULL, 0);
    if (sent % 1000 == 0)
      ck_assert_int_eq(sp_test_ping(good, (uint64_t)sent + 1), 0);
  }
  free(tx.buf);
  ck_assert_msg(rc == SP_ECLOSED || rc == SP_EIO,
                "still connected after %d unread status replies (rc %d)", sent,
                rc);
  close(flood);
  ck_assert_int_eq(sp_test_ping(good, 2000000), 0);
  close(good);
}
END_TEST

START_TEST(max_clients) {
  int socks[4];
  for (int i = 0; i < 4; i++) {
    socks[i] = sp_test_connect_hello(small_.socket);
    ck_assert_int_ge(socks[i], 0);
  }
  /* The fifth is told why and closed. */
  int extra = sp_test_connect(small_.socket);
  ck_assert_int_ge(extra, 0);
  expect_error(extra, SP_EBUSY, 0);
  ck_assert_int_eq(sp_test_wait_closed(extra, SP_TEST_TIMEOUT_MS), 0);
  close(extra);
  for (int i = 0; i < 4; i++)
    ck_assert_int_eq(sp_test_ping(socks[i], 1), 0);
  /* A freed slot is usable again once the daemon saw the close. */
  close(socks[0]);
  int again = -1;
  for (int i = 0; i < 200 && again < 0; i++) {
    again = sp_test_connect_hello(small_.socket);
    if (again < 0) {
      struct timespec ts = {0, 10 * 1000 * 1000};
      nanosleep(&ts, NULL);
    }
  }
  ck_assert_int_ge(again, 0);
  ck_assert_int_eq(sp_test_ping(again, 2), 0);
  close(again);
  for (int i = 1; i < 4; i++)
    close(socks[i]);
}
END_TEST

int main(void) {
  Suite *s = suite_create("daemon-hostile");
  TCase *tc = tcase_create("hostile");
  tcase_add_checked_fixture(tc, start, stop);
  tcase_set_timeout(tc, 50);
  tcase_add_test(tc, hostile_frames_bounded);
  tcase_add_test(tc, hostile_first_frame);
  tcase_add_test(tc, large_frame_before_hello_refused);
  tcase_add_test(tc, stalled_frame_isolated);
  tcase_add_test(tc, stray_fds_closed);
  tcase_add_test(tc, too_many_fds);
  suite_add_tcase(s, tc);
  TCase *slow = tcase_create("timeouts");
  tcase_add_checked_fixture(slow, start, stop);
  tcase_set_timeout(slow, 50);
  tcase_add_test(slow, silent_client_dropped);
  suite_add_tcase(s, slow);
  TCase *small = tcase_create("small limits");
  tcase_add_checked_fixture(small, start_small, stop_small);
  tcase_set_timeout(small, 50);
  tcase_add_test(small, unread_replies_disconnect);
  tcase_add_test(small, max_clients);
  suite_add_tcase(s, small);
  SRunner *sr = srunner_create(s);
  srunner_run_all(sr, CK_NORMAL);
  int failed = srunner_ntests_failed(sr);
  srunner_free(sr);
  return failed == 0 ? EXIT_SUCCESS : EXIT_FAILURE;
}
