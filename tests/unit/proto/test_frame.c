/*
 * test_frame.c - frames over a real socket pair: lengths, partial reads,
 * descriptors attached to their frame, and every framing limit.
 */
#include <check.h>
#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>

#include "shardport.h"
#include "proto/frame.h"
#include "proto/msg.h"

static int sv[2];
static struct sp_limits limits;
static struct sp_frame_rx rx;

static void setup(void) {
  ck_assert_int_eq(socketpair(AF_UNIX, SOCK_STREAM, 0, sv), 0);
  sp__limits_default(&limits);
  sp__frame_rx_init(&rx, &limits);
}

static void teardown(void) {
  sp__frame_rx_reset(&rx);
  close(sv[0]);
  close(sv[1]);
}

static void set_nonblocking(int fd) {
  ck_assert_int_ne(fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK), -1);
}

static void write_all(int fd, const void *buf, size_t len) {
  ck_assert_int_eq(write(fd, buf, len), (ssize_t)len);
}

static bool fd_is_open(int fd) { return fcntl(fd, F_GETFD) != -1; }

static int make_memfd(void) {
  int fd = memfd_create("test", MFD_CLOEXEC);
  ck_assert_int_ge(fd, 0);
  return fd;
}

START_TEST(frame_round_trips_with_its_fds) {
  struct sp_msgbuf mb;
  struct sp_frame_tx tx;
  sp__msgbuf_begin(&mb, "ping", 1, 0);
  ck_assert_int_eq(sp__msgbuf_finish(&mb, &tx), 0);
  int fds[2] = {make_memfd(), make_memfd()};
  ck_assert_int_eq(sp__frame_send(sv[0], tx.buf, tx.len, fds, 2), 0);
  /* A second frame without fds must not receive any. */
  ck_assert_int_eq(sp__frame_send(sv[0], tx.buf, tx.len, NULL, 0), 0);

  struct sp_frame f;
  ck_assert_int_eq(sp__frame_rx_read(&rx, sv[1], &f), 1);
  ck_assert_uint_eq(f.len, tx.len - SP_FRAME_HEADER);
  ck_assert_mem_eq(f.data, tx.buf + SP_FRAME_HEADER, f.len);
  ck_assert_uint_eq(f.nfds, 2);
  int received = f.fds[0];
  ck_assert(fd_is_open(received));
  ck_assert_int_eq(fcntl(received, F_GETFD) & FD_CLOEXEC, FD_CLOEXEC);
  sp__frame_release(&f);
  ck_assert(!fd_is_open(received));

  ck_assert_int_eq(sp__frame_rx_read(&rx, sv[1], &f), 1);
  ck_assert_uint_eq(f.nfds, 0);
  sp__frame_release(&f);

  close(fds[0]);
  close(fds[1]);
  free(tx.buf);
}
END_TEST

START_TEST(stray_fds_are_closed) {
  static const uint8_t frame[] = {0, 0, 0, 1, 0x80};
  int fd = make_memfd();
  ck_assert_int_eq(sp__frame_send(sv[0], frame, sizeof frame, &fd, 1), 0);
  struct sp_frame f;
  ck_assert_int_eq(sp__frame_rx_read(&rx, sv[1], &f), 1);
  int received = f.fds[0];
  ck_assert_uint_eq(sp__frame_close_fds(&f), 1);
  ck_assert(!fd_is_open(received));
  ck_assert_uint_eq(f.nfds, 0);
  sp__frame_release(&f);
  close(fd);
}
END_TEST

START_TEST(frame_arrives_in_pieces) {
  static const uint8_t frame[] = {0, 0, 0, 3, 0x81, 0xa0, 0xc0};
  struct sp_frame f;
  set_nonblocking(sv[1]);
  for (size_t i = 0; i < sizeof frame; i++) {
    ck_assert_int_eq(sp__frame_rx_read(&rx, sv[1], &f), 0);
    write_all(sv[0], frame + i, 1);
  }
  ck_assert_int_eq(sp__frame_rx_read(&rx, sv[1], &f), 1);
  ck_assert_uint_eq(f.len, 3);
  ck_assert_mem_eq(f.data, frame + 4, 3);
  sp__frame_release(&f);
  ck_assert_int_eq(sp__frame_rx_read(&rx, sv[1], &f), 0);
}
END_TEST

START_TEST(length_of_four_gib_is_refused_before_allocation) {
  static const uint8_t header[] = {0xff, 0xff, 0xff, 0xff};
  write_all(sv[0], header, sizeof header);
  struct sp_frame f;
  ck_assert_int_eq(sp__frame_rx_read(&rx, sv[1], &f), SP_EFRAMETOOBIG);
  ck_assert_ptr_null(rx.buf);
}
END_TEST

START_TEST(a_stalled_large_frame_holds_only_what_arrived) {
  /* 16 MiB announced, 100 bytes sent: the buffer follows the bytes. */
  static const uint8_t header[] = {0x00, 0xff, 0xff, 0xff};
  uint8_t body[100] = {0x80};
  write_all(sv[0], header, sizeof header);
  write_all(sv[0], body, sizeof body);
  set_nonblocking(sv[1]);
  struct sp_frame f;
  ck_assert_int_eq(sp__frame_rx_read(&rx, sv[1], &f), 0);
  ck_assert_uint_eq(rx.have, sizeof body);
  ck_assert_uint_le(rx.cap, 65536 + 1);
}
END_TEST

START_TEST(configured_frame_limit_is_applied) {
  limits.max_frame = 8;
  sp__frame_rx_init(&rx, &limits);
  static const uint8_t ok[] = {0, 0, 0, 8, 0x80, 0, 0, 0, 0, 0, 0, 0};
  static const uint8_t big[] = {0, 0, 0, 9};
  write_all(sv[0], ok, sizeof ok);
  write_all(sv[0], big, sizeof big);
  struct sp_frame f;
  ck_assert_int_eq(sp__frame_rx_read(&rx, sv[1], &f), 1);
  sp__frame_release(&f);
  ck_assert_int_eq(sp__frame_rx_read(&rx, sv[1], &f), SP_EFRAMETOOBIG);
}
END_TEST

START_TEST(too_many_fds_are_all_closed) {
  limits.max_fds = 2;
  sp__frame_rx_init(&rx, &limits);
  static const uint8_t frame[] = {0, 0, 0, 1, 0x80};
  int fds[3] = {make_memfd(), make_memfd(), make_memfd()};
  int before = make_memfd(); /* the next free descriptor number, as a probe */
  close(before);
  ck_assert_int_eq(sp__frame_send(sv[0], frame, sizeof frame, fds, 3), 0);
  struct sp_frame f;
  ck_assert_int_eq(sp__frame_rx_read(&rx, sv[1], &f), SP_ETOOMANYFDS);
  sp__frame_rx_reset(&rx);
  /* Nothing received stays open: the lowest free number is free again. */
  int after = make_memfd();
  ck_assert_int_eq(after, before);
  close(after);
  for (int i = 0; i < 3; i++)
    close(fds[i]);
}
END_TEST

START_TEST(end_of_stream_is_reported) {
  struct sp_frame f;
  close(sv[0]);
  ck_assert_int_eq(sp__frame_rx_read(&rx, sv[1], &f), SP_ECLOSED);
  sv[0] = -1;
}
END_TEST

START_TEST(stream_cut_inside_a_frame_is_an_error) {
  static const uint8_t partial[] = {0, 0, 0, 9, 0x80};
  write_all(sv[0], partial, sizeof partial);
  close(sv[0]);
  sv[0] = -1;
  struct sp_frame f;
  ck_assert_int_eq(sp__frame_rx_read(&rx, sv[1], &f), SP_EIO);
}
END_TEST

START_TEST(writer_resumes_on_a_full_socket) {
  /* A frame larger than the socket buffer goes out in several writes. */
  size_t len = 4u << 20;
  uint8_t *buf = calloc(1, len);
  buf[0] = (uint8_t)((len - 4) >> 24);
  buf[1] = (uint8_t)((len - 4) >> 16);
  buf[2] = (uint8_t)((len - 4) >> 8);
  buf[3] = (uint8_t)(len - 4);
  buf[4] = 0x80;
  set_nonblocking(sv[0]);
  set_nonblocking(sv[1]);
  struct sp_frame_tx tx = {.buf = buf, .len = len};
  struct sp_frame f;
  int got = 0;
  int writes = 0;
  while (!got) {
    int rc = sp__frame_tx_write(&tx, sv[0]);
    ck_assert_int_ge(rc, 0);
    writes++;
    got = sp__frame_rx_read(&rx, sv[1], &f);
    ck_assert_int_ge(got, 0);
  }
  ck_assert_int_gt(writes, 1);
  ck_assert_uint_eq(tx.off, len);
  ck_assert_uint_eq(f.len, len - 4);
  sp__frame_release(&f);
  free(buf);
}
END_TEST

static int released;
static void count_release(void *arg) { released += *(int *)arg; }

START_TEST(shared_payload_follows_the_header_and_is_released) {
  /* A frame whose payload is shared: the header is the frame's own, the
   * payload another's bytes, written after it across several writes, and
   * released (never freed) when the frame is. */
  size_t plen = 3u << 20;
  uint8_t *payload = malloc(plen);
  for (size_t i = 0; i < plen; i++)
    payload[i] = (uint8_t)(i * 7 + 1);
  struct sp_frame_tx *tx = calloc(1, sizeof *tx);
  tx->buf = malloc(4);
  tx->buf[0] = (uint8_t)(plen >> 24);
  tx->buf[1] = (uint8_t)(plen >> 16);
  tx->buf[2] = (uint8_t)(plen >> 8);
  tx->buf[3] = (uint8_t)plen;
  tx->len = 4;
  tx->shared = payload;
  tx->shared_len = plen;
  int weight = 5;
  tx->release = count_release;
  tx->release_arg = &weight;
  ck_assert_uint_eq(sp__frame_tx_size(tx), plen + 4);
  set_nonblocking(sv[0]);
  set_nonblocking(sv[1]);
  struct sp_limits l;
  sp__limits_default(&l);
  l.max_frame = 4u << 20;
  sp__frame_rx_reset(&rx);
  sp__frame_rx_init(&rx, &l);
  struct sp_frame f;
  int got = 0, writes = 0;
  while (!got) {
    int rc = sp__frame_tx_write(tx, sv[0]);
    ck_assert_int_ge(rc, 0);
    writes++;
    got = sp__frame_rx_read(&rx, sv[1], &f);
    ck_assert_int_ge(got, 0);
  }
  ck_assert_int_gt(writes, 1);
  ck_assert_uint_eq(f.len, plen);
  ck_assert_mem_eq(f.data, payload, plen);
  sp__frame_release(&f);
  released = 0;
  sp__frame_tx_free(tx);
  ck_assert_int_eq(released, 5);
  free(payload);
}
END_TEST

static Suite *frame_suite(void) {
  Suite *s = suite_create("frame");
  TCase *tc = tcase_create("socketpair");
  tcase_add_checked_fixture(tc, setup, teardown);
  tcase_add_test(tc, frame_round_trips_with_its_fds);
  tcase_add_test(tc, stray_fds_are_closed);
  tcase_add_test(tc, frame_arrives_in_pieces);
  tcase_add_test(tc, length_of_four_gib_is_refused_before_allocation);
  tcase_add_test(tc, a_stalled_large_frame_holds_only_what_arrived);
  tcase_add_test(tc, configured_frame_limit_is_applied);
  tcase_add_test(tc, too_many_fds_are_all_closed);
  tcase_add_test(tc, end_of_stream_is_reported);
  tcase_add_test(tc, stream_cut_inside_a_frame_is_an_error);
  tcase_add_test(tc, writer_resumes_on_a_full_socket);
  tcase_add_test(tc, shared_payload_follows_the_header_and_is_released);
  suite_add_tcase(s, tc);
  return s;
}

int main(void) {
  SRunner *sr = srunner_create(frame_suite());
  srunner_run_all(sr, CK_NORMAL);
  int failed = srunner_ntests_failed(sr);
  srunner_free(sr);
  return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
