/*
 * test_stream.c - the all-peers exchange over socket pairs: full-duplex
 * volume without deadlock, scatter/gather of many regions, and the ways an
 * exchange ends early (peer closed, silent peer, cancel), while a slow peer
 * is not mistaken for a lost one; and rounds that overlap (optional
 * regions: the next round's, moved ahead as far as the peer takes them).
 */
#include <check.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "shardport.h"
#include "daemon/xfer/stream.h"

static void nonblocking_pair(int sv[2]) {
  ck_assert_int_eq(socketpair(AF_UNIX, SOCK_STREAM, 0, sv), 0);
  for (int i = 0; i < 2; i++)
    fcntl(sv[i], F_SETFL, O_NONBLOCK);
}

static uint8_t *pattern(size_t len, unsigned seed) {
  uint8_t *p = malloc(len ? len : 1);
  for (size_t i = 0; i < len; i++)
    p[i] = (uint8_t)(i * 2654435761u + seed);
  return p;
}

static const struct xfer_watch patient = {.idle_timeout_ms = 10000};

struct side {
  struct xfer_peer peer;
  int rc;
};

static void *run_side(void *arg) {
  struct side *s = arg;
  size_t failed;
  s->rc = xfer_exchange(&s->peer, 1, &patient, &failed);
  return NULL;
}

START_TEST(both_sides_send_volumes_larger_than_socket_buffers) {
  int sv[2];
  nonblocking_pair(sv);
  size_t len = 16u << 20;
  uint8_t *a_out = pattern(len, 1), *b_out = pattern(len, 2);
  uint8_t *a_in = calloc(1, len), *b_in = calloc(1, len);
  struct iovec a_send = {a_out, len}, a_recv = {a_in, len};
  struct iovec b_send = {b_out, len}, b_recv = {b_in, len};
  struct side a = {.peer = {.sock = sv[0], .send = {&a_send, 1}, .recv = {&a_recv, 1}}};
  struct side b = {.peer = {.sock = sv[1], .send = {&b_send, 1}, .recv = {&b_recv, 1}}};
  pthread_t t;
  pthread_create(&t, NULL, run_side, &b);
  run_side(&a);
  pthread_join(t, NULL);
  ck_assert_int_eq(a.rc, 0);
  ck_assert_int_eq(b.rc, 0);
  ck_assert_mem_eq(a_in, b_out, len);
  ck_assert_mem_eq(b_in, a_out, len);
  ck_assert_uint_eq(a.peer.sent, len);
  ck_assert_uint_eq(a.peer.received, len);
  free(a_out), free(b_out), free(a_in), free(b_in);
  close(sv[0]), close(sv[1]);
}
END_TEST

START_TEST(many_regions_scatter_and_gather_exactly) {
  int sv[2];
  nonblocking_pair(sv);
  /* More regions than one writev takes, some of them empty. */
  enum { REGIONS = 3000 };
  size_t total = 0;
  struct iovec *send = calloc(REGIONS, sizeof *send);
  struct iovec *recv = calloc(REGIONS, sizeof *recv);
  uint8_t *src = pattern(REGIONS * 40, 3), *dst = calloc(1, REGIONS * 40);
  for (size_t i = 0; i < REGIONS; i++) {
    size_t len = (i * 7) % 40;
    send[i] = (struct iovec){src + i * 40, len};
    /* The receiver cuts the same stream at other boundaries. */
    recv[i] = (struct iovec){dst + i * 40, ((i * 7) % 40)};
    total += len;
  }
  struct side a = {.peer = {.sock = sv[0], .send = {send, REGIONS}}};
  struct side b = {.peer = {.sock = sv[1], .recv = {recv, REGIONS}}};
  pthread_t t;
  pthread_create(&t, NULL, run_side, &b);
  run_side(&a);
  pthread_join(t, NULL);
  ck_assert_int_eq(a.rc, 0);
  ck_assert_int_eq(b.rc, 0);
  ck_assert_uint_eq(b.peer.received, total);
  for (size_t i = 0; i < REGIONS; i++)
    ck_assert_mem_eq(dst + i * 40, src + i * 40, (i * 7) % 40);
  free(send), free(recv), free(src), free(dst);
  close(sv[0]), close(sv[1]);
}
END_TEST

START_TEST(a_peer_that_closes_is_named) {
  int good[2], gone[2];
  nonblocking_pair(good);
  nonblocking_pair(gone);
  uint8_t buf[64];
  struct iovec r0 = {buf, 32}, r1 = {buf + 32, 32};
  struct xfer_peer peers[2] = {
      {.sock = good[0], .recv = {&r0, 1}},
      {.sock = gone[0], .recv = {&r1, 1}},
  };
  ck_assert_int_eq(write(good[1], buf, 32), 32);
  ck_assert_int_eq(write(gone[1], buf, 5), 5);
  close(gone[1]);
  size_t failed = 99;
  ck_assert_int_eq(xfer_exchange(peers, 2, &patient, &failed), SP_ECLOSED);
  ck_assert_uint_eq(failed, 1);
  ck_assert_uint_eq(peers[1].received, 5);
  close(good[0]), close(good[1]), close(gone[0]);
}
END_TEST

/* One stream of a pair on a thread of its own, sharing halt. */
struct sibling {
  struct xfer_peer peer;
  atomic_bool *halt;
  int rc;
};

static void *run_sibling(void *arg) {
  struct sibling *s = arg;
  struct xfer_watch watch = {.halt = s->halt, .idle_timeout_ms = 10000};
  size_t failed;
  s->rc = xfer_exchange(&s->peer, 1, &watch, &failed);
  return NULL;
}

/* Two streams of one pair, each exchanged on its own thread: when one's
 * connection ends, it fails with closed and halts the other, which waits
 * on a silent peer: halted (1), not timed out after its idle timeout; a
 * halt set beforehand stops an exchange before it moves anything. */
START_TEST(a_lost_stream_halts_its_siblings) {
  int lost[2], silent[2];
  nonblocking_pair(lost);
  nonblocking_pair(silent);
  uint8_t a[16], b[16];
  struct iovec ra = {a, sizeof a}, rb = {b, sizeof b};
  atomic_bool halt = false;
  struct sibling one = {.peer = {.sock = lost[0], .recv = {&ra, 1}},
                        .halt = &halt};
  struct sibling two = {.peer = {.sock = silent[0], .recv = {&rb, 1}},
                        .halt = &halt};
  pthread_t t1, t2;
  pthread_create(&t2, NULL, run_sibling, &two);
  pthread_create(&t1, NULL, run_sibling, &one);
  struct timespec pause = {0, 50 * 1000 * 1000};
  nanosleep(&pause, NULL);
  close(lost[1]);
  pthread_join(t1, NULL);
  pthread_join(t2, NULL);
  ck_assert_int_eq(one.rc, SP_ECLOSED);
  ck_assert_int_eq(two.rc, 1);
  ck_assert(atomic_load(&halt));
  struct sibling late = {.peer = {.sock = silent[0], .recv = {&rb, 1}},
                         .halt = &halt};
  run_sibling(&late);
  ck_assert_int_eq(late.rc, 1);
  ck_assert_uint_eq(late.peer.received, 0);
  close(lost[0]), close(silent[0]), close(silent[1]);
}
END_TEST

START_TEST(a_silent_peer_times_out) {
  int sv[2];
  nonblocking_pair(sv);
  uint8_t buf[8];
  struct iovec r = {buf, sizeof buf};
  struct xfer_peer peer = {.sock = sv[0], .recv = {&r, 1}};
  struct xfer_watch watch = {.idle_timeout_ms = 200};
  struct timespec t0, t1;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  size_t failed = 99;
  ck_assert_int_eq(xfer_exchange(&peer, 1, &watch, &failed), SP_ETIMEOUT);
  clock_gettime(CLOCK_MONOTONIC, &t1);
  ck_assert_uint_eq(failed, 0);
  double waited = (double)(t1.tv_sec - t0.tv_sec) + (double)(t1.tv_nsec - t0.tv_nsec) / 1e9;
  ck_assert(waited >= 0.19);
  close(sv[0]), close(sv[1]);
}
END_TEST

struct trickle {
  int sock;
  const uint8_t *data;
  size_t len;
};

/* Sends in small pieces with pauses shorter than the idle timeout. */
static void *trickle_out(void *arg) {
  struct trickle *t = arg;
  for (size_t off = 0; off < t->len; off += 10) {
    struct timespec pause = {0, 60 * 1000 * 1000};
    nanosleep(&pause, NULL);
    ck_assert_int_eq(write(t->sock, t->data + off, 10), 10);
  }
  return NULL;
}

START_TEST(a_slow_peer_is_not_a_lost_peer) {
  int sv[2];
  nonblocking_pair(sv);
  uint8_t *src = pattern(100, 4), dst[100];
  struct iovec r = {dst, sizeof dst};
  struct xfer_peer peer = {.sock = sv[0], .recv = {&r, 1}};
  /* 10 pauses of 60 ms: longer than the timeout in all, shorter each. */
  struct xfer_watch watch = {.idle_timeout_ms = 250};
  struct trickle t = {sv[1], src, 100};
  pthread_t th;
  pthread_create(&th, NULL, trickle_out, &t);
  size_t failed;
  ck_assert_int_eq(xfer_exchange(&peer, 1, &watch, &failed), 0);
  pthread_join(th, NULL);
  ck_assert_mem_eq(dst, src, 100);
  free(src);
  close(sv[0]), close(sv[1]);
}
END_TEST

static atomic_bool cancel_flag;

static void *cancel_later(void *arg) {
  (void)arg;
  struct timespec pause = {0, 150 * 1000 * 1000};
  nanosleep(&pause, NULL);
  atomic_store(&cancel_flag, true);
  return NULL;
}

START_TEST(cancel_stops_the_exchange) {
  int sv[2];
  nonblocking_pair(sv);
  uint8_t buf[8];
  struct iovec r = {buf, sizeof buf};
  struct xfer_peer peer = {.sock = sv[0], .recv = {&r, 1}};
  atomic_store(&cancel_flag, false);
  struct xfer_watch watch = {.cancel = &cancel_flag, .idle_timeout_ms = 10000};
  pthread_t th;
  pthread_create(&th, NULL, cancel_later, NULL);
  size_t failed;
  ck_assert_int_eq(xfer_exchange(&peer, 1, &watch, &failed), 1);
  pthread_join(th, NULL);
  close(sv[0]), close(sv[1]);
}
END_TEST

/* A round ends when its own bytes are moved, whatever of the next round's
 * (optional) the peer has not taken: here it takes none. */
START_TEST(optional_regions_do_not_hold_the_round) {
  int sv[2];
  nonblocking_pair(sv);
  size_t own = 1u << 20, next = 16u << 20;
  uint8_t *out = pattern(own + next, 4), *in = calloc(1, own);
  struct iovec send[2] = {{out, own}, {out + own, next}};
  struct iovec recv = {in, own};
  struct side a = {
      .peer = {.sock = sv[0], .send = {.iov = send, .n = 2, .optional = 1}}};
  struct side b = {.peer = {.sock = sv[1], .recv = {&recv, 1}}};
  pthread_t t;
  pthread_create(&t, NULL, run_side, &b);
  run_side(&a);
  pthread_join(t, NULL);
  ck_assert_int_eq(a.rc, 0);
  ck_assert_int_eq(b.rc, 0);
  ck_assert_mem_eq(in, out, own);
  /* The socket took some of the next round, not all 16 MiB of it. */
  ck_assert_uint_ge(a.peer.sent, own);
  ck_assert_uint_lt(a.peer.sent, own + next);
  free(out), free(in);
  close(sv[0]), close(sv[1]);
}
END_TEST

/* Two rounds on one stream, each side listing the next round's regions
 * after its own: the second exchange starts where the first left the
 * stream (xfer_iovs_skip), and every byte lands where the plan says,
 * although the sides cut the stream at other boundaries. */
START_TEST(rounds_overlap_on_one_stream) {
  int sv[2];
  nonblocking_pair(sv);
  size_t r1 = 3u << 20, r2 = 5u << 20;
  uint8_t *a_out = pattern(r1 + r2, 5), *b_out = pattern(r1, 6);
  uint8_t *b_in = calloc(1, r1 + r2), *a_in = calloc(1, r1);
  /* Round 1: A sends r1 and B sends r1 back; A goes on into round 2. */
  struct iovec a_send[3] = {{a_out, r1}, {a_out + r1, r2 / 2},
                            {a_out + r1 + r2 / 2, r2 - r2 / 2}};
  struct iovec b_send = {b_out, r1}, a_recv = {a_in, r1};
  /* B cuts round 1 elsewhere; round 2 follows as its optional region. */
  struct iovec b_recv1[3] = {{b_in, r1 / 3},
                             {b_in + r1 / 3, r1 - r1 / 3},
                             {b_in + r1, r2}};
  struct side a = {.peer = {.sock = sv[0],
                            .send = {.iov = a_send, .n = 3, .optional = 2},
                            .recv = {&a_recv, 1}}};
  struct side b = {.peer = {.sock = sv[1],
                            .send = {&b_send, 1},
                            .recv = {.iov = b_recv1, .n = 3, .optional = 1}}};
  pthread_t t;
  pthread_create(&t, NULL, run_side, &b);
  run_side(&a);
  pthread_join(t, NULL);
  ck_assert_int_eq(a.rc, 0);
  ck_assert_int_eq(b.rc, 0);
  ck_assert_mem_eq(a_in, b_out, r1);
  uint64_t a_ahead = a.peer.sent - r1, b_ahead = b.peer.received - r1;
  ck_assert_uint_le(b_ahead, a_ahead);
  /* Round 2: its own regions, less what moved ahead. */
  struct iovec a_send2[2] = {{a_out + r1, r2 / 2},
                             {a_out + r1 + r2 / 2, r2 - r2 / 2}};
  struct iovec b_recv2 = {b_in + r1, r2};
  struct side a2 = {.peer = {.sock = sv[0], .send = {a_send2, 2}}};
  struct side b2 = {.peer = {.sock = sv[1], .recv = {&b_recv2, 1}}};
  xfer_iovs_skip(&a2.peer.send, a_ahead);
  xfer_iovs_skip(&b2.peer.recv, b_ahead);
  pthread_create(&t, NULL, run_side, &b2);
  run_side(&a2);
  pthread_join(t, NULL);
  ck_assert_int_eq(a2.rc, 0);
  ck_assert_int_eq(b2.rc, 0);
  ck_assert_uint_eq(a_ahead + a2.peer.sent, r2);
  ck_assert_uint_eq(b_ahead + b2.peer.received, r2);
  ck_assert_mem_eq(b_in, a_out, r1 + r2);
  free(a_out), free(b_out), free(a_in), free(b_in);
  close(sv[0]), close(sv[1]);
}
END_TEST

START_TEST(nothing_to_move_returns_at_once) {
  struct iovec empty = {NULL, 0};
  struct xfer_peer peer = {.sock = -1, .send = {&empty, 1}};
  size_t failed;
  ck_assert_int_eq(xfer_exchange(&peer, 1, &patient, &failed), 0);
  ck_assert_int_eq(xfer_exchange(NULL, 0, &patient, &failed), 0);
}
END_TEST

int main(void) {
  Suite *s = suite_create("stream");
  TCase *tc = tcase_create("core");
  tcase_set_timeout(tc, 30);
  tcase_add_test(tc, both_sides_send_volumes_larger_than_socket_buffers);
  tcase_add_test(tc, many_regions_scatter_and_gather_exactly);
  tcase_add_test(tc, a_peer_that_closes_is_named);
  tcase_add_test(tc, a_silent_peer_times_out);
  tcase_add_test(tc, a_slow_peer_is_not_a_lost_peer);
  tcase_add_test(tc, cancel_stops_the_exchange);
  tcase_add_test(tc, optional_regions_do_not_hold_the_round);
  tcase_add_test(tc, rounds_overlap_on_one_stream);
  tcase_add_test(tc, nothing_to_move_returns_at_once);
  tcase_add_test(tc, a_lost_stream_halts_its_siblings);
  suite_add_tcase(s, tc);
  SRunner *sr = srunner_create(s);
  srunner_run_all(sr, CK_NORMAL);
  int failed = srunner_ntests_failed(sr);
  srunner_free(sr);
  return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
