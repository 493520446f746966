/*
 * daemon_loop.c - one client's large frames must not hold the event loop
 * that serves every other client (docs/operations.md, "Large frames").
 *
 * The frames are the largest ordinary registrations: one storage_add of
 * REG_N storages over one memfd, then one tensor_add of a tensor per
 * storage.  Times are compared within the run, never with fixed limits:
 * the longest loop iteration (status loop_max_busy_us) and the longest
 * wait of a second, pinging client against the time the frame took to be
 * served.  Served on the loop, the frame was one iteration nearly as long
 * as the whole frame, and a ping waited as long.
 *
 * The frame's work runs on a worker thread while its connection may end:
 * the daemon stops, or the rank's job is aborted, while the frame is
 * there.  The frame is then dropped when the worker is done, and nothing
 * is used after it was freed (the sanitizer and valgrind builds run these
 * tests too).  The test seam SHARDPORTD_TEST_WORKER_GATE holds the frame on
 * a worker, before its decoding or between two of its steps, until the
 * connection has ended, however fast the machine.
 */
#include <check.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "build_config.h"
#include "shardport.h"
#include "tests/integration/harness.h"
#include "tests/integration/loadprobe.h"

/* Entries per frame: about 6 MiB of storages and 11 MiB of tensors, under
 * the default max_frame (16 MiB).  The default max_items allows a frame
 * about 40,000 storages or 26,000 tensors; these are larger, so that the
 * frame's time is large against a busy machine's noise. */
#define REG_N 100000u
#define REG_LENGTH 64u
#define REG_CONF "max_items = 1048576\n"

static struct sp_test_daemon daemon_;
static uint64_t next_id = 1;
/* The FIFO of SHARDPORTD_TEST_WORKER_GATE, in its own directory. */
static char gate_dir[256], gate[300];

static void start(void) {
  char dir[256], path[300];
  ck_assert_int_eq(sp_test_mkdtemp(dir, sizeof dir), 0);
  snprintf(path, sizeof path, "%s/shardportd.conf", dir);
  ck_assert_int_eq(sp_test_write_file(path, REG_CONF), 0);
  const char *args[] = {"--config", path, NULL};
  ck_assert_int_eq(sp_test_daemon_start(&daemon_, args), 0);
  sp_test_rmdir(dir);
}

/* A daemon whose large frames wait on a worker, before their decoding and
 * before each later step, until hold_gate's descriptor is closed. */
static void start_gated(void) {
  ck_assert_int_eq(sp_test_mkdtemp(gate_dir, sizeof gate_dir), 0);
  snprintf(gate, sizeof gate, "%s/gate", gate_dir);
  ck_assert_int_eq(mkfifo(gate, 0600), 0);
  setenv("SHARDPORTD_TEST_WORKER_GATE", gate, 1);
  start();
  unsetenv("SHARDPORTD_TEST_WORKER_GATE");
}

/* Without a reader (a worker at the gate) the open fails with ENXIO. */
static int open_gate(void) {
  int fd = open(gate, O_WRONLY | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0)
    ck_assert_int_eq(errno, ENXIO);
  return fd;
}

/* Returns once a large frame waits at the gate: before its decoding, the
 * daemon has read all of it; before a later step, it served the previous
 * one.  Closing the descriptor (release_gate) lets the worker go on. */
static int hold_gate(void) {
  uint64_t deadline = sp_now_ns() + (uint64_t)SP_TEST_TIMEOUT_MS * 1000000;
  int fd;
  while ((fd = open_gate()) < 0) {
    ck_assert_msg(sp_now_ns() < deadline, "no frame came to the gate");
    usleep(1000);
  }
  return fd;
}

/* Lets the held worker go on, and returns once it has left the gate: the
 * next hold_gate then holds the frame's next step, not this one again. */
static void release_gate(int held) {
  close(held);
  uint64_t deadline = sp_now_ns() + (uint64_t)SP_TEST_TIMEOUT_MS * 1000000;
  int fd;
  while ((fd = open_gate()) >= 0) {
    close(fd);
    ck_assert_msg(sp_now_ns() < deadline, "the worker stayed at the gate");
    usleep(1000);
  }
}

static void remove_gate(void) {
  ck_assert_int_eq(unlink(gate), 0);
  sp_test_rmdir(gate_dir);
}

static void stop(void) {
  if (daemon_.pid > 0)
    ck_assert_int_eq(sp_test_daemon_stop(&daemon_), 0);
  daemon_.pid = 0;
}

/* The daemon's loop_max_busy_us; starts a new window. */
static uint64_t loop_max_busy_us(void) {
  sp_client *c = NULL;
  sp_status_info *st = NULL;
  ck_assert_int_eq(sp_connect(daemon_.socket, &c), 0);
  ck_assert_int_eq(sp_status(c, &st), 0);
  uint64_t us = st->loop_max_busy_us;
  sp_status_free(st);
  sp_close(c);
  return us;
}

/* A raw connection joined as the one rank of a new job of creator's. */
static int raw_rank(sp_client *creator) {
  sp_ticket t;
  ck_assert_int_eq(sp_job_create(creator, 1, &t), 0);
  int sock = sp_test_connect_hello(daemon_.socket);
  ck_assert_int_ge(sock, 0);
  ck_assert_int_eq(sp_test_join(sock, next_id++, t.bytes, t.len, 0, 1), 0);
  return sock;
}

static int memfd_of(size_t size) {
  int fd = memfd_create("loop", MFD_CLOEXEC);
  ck_assert_int_ge(fd, 0);
  ck_assert_int_eq(ftruncate(fd, (off_t)size), 0);
  return fd;
}

/* Sends a packed frame and reads its reply: how long that took. */
static uint64_t served_in_ns(int sock, struct sp_msgbuf *mb, uint64_t id,
                             const int *fds, size_t nfds, uint64_t *from) {
  *from = sp_now_ns();
  ck_assert_int_eq(sp_test_send_msgbuf(sock, mb, fds, nfds), 0);
  struct sp_test_reply r;
  ck_assert_int_eq(sp_test_recv(sock, &r, 120000), 0);
  uint64_t took = sp_now_ns() - *from;
  ck_assert_msg(r.code == 0, "%s: %s", r.head.op, r.message);
  ck_assert_uint_eq(r.head.id, id);
  sp_test_reply_free(&r);
  return took;
}

/* One frame against the loop: no iteration longer than a quarter of the
 * frame's time, no ping that waited half of it. */
static void check_frame(const char *what, int sock, struct sp_msgbuf *mb,
                        uint64_t id, const int *fds, size_t nfds) {
  struct sp_prober p;
  sp_prober_start(&p, daemon_.socket);
  ck_assert_int_eq(p.failed, 0);
  loop_max_busy_us();
  uint64_t from;
  uint64_t took = served_in_ns(sock, mb, id, fds, nfds, &from);
  uint64_t busy_ns = loop_max_busy_us() * 1000;
  ck_assert_int_eq(sp_prober_stop(&p), 0);
  struct sp_ping_stats s = sp_prober_window(&p, from, from + took);
  sp_prober_free(&p);
  printf("%s of %u entries: served in %.1f ms; loop busy %.1f ms at most; "
         "%zu pings meanwhile, p50 %.2f ms, p99 %.2f ms, max %.2f ms\n",
         what, REG_N, took / 1e6, busy_ns / 1e6, s.count, s.p50_ns / 1e6,
         s.p99_ns / 1e6, s.max_ns / 1e6);
  fflush(stdout);
  ck_assert_msg(4 * busy_ns <= took,
                "%s: the loop was busy %.1f ms in one iteration, more than a "
                "quarter of the %.1f ms the frame took",
                what, busy_ns / 1e6, took / 1e6);
  ck_assert_msg(2 * s.max_ns <= took,
                "%s: a ping waited %.1f ms, more than half of the %.1f ms "
                "the frame took",
                what, s.max_ns / 1e6, took / 1e6);
}

START_TEST(largest_frames_leave_the_loop_free) {
  start();
  sp_client *creator = NULL;
  ck_assert_int_eq(sp_connect(daemon_.socket, &creator), 0);
  int sock = raw_rank(creator);
  int fd = memfd_of((size_t)REG_N * REG_LENGTH);
  struct sp_msgbuf mb;
  uint64_t id = next_id++;
  sp_pack_many_storages(&mb, id, 1, REG_N, REG_LENGTH);
  check_frame("storage_add", sock, &mb, id, &fd, 1);
  id = next_id++;
  sp_pack_many_tensors(&mb, id, 1, REG_N, REG_LENGTH);
  check_frame("tensor_add", sock, &mb, id, NULL, 0);
  close(fd);
  close(sock);
  sp_close(creator);
  stop();
}
END_TEST

/* Sends a storage_add of REG_N storages and returns once the daemon has
 * read nearly all of it: the socket's buffer holds the rest. */
static void send_large_storage_add(int sock, uint64_t id) {
  int fd = memfd_of((size_t)REG_N * REG_LENGTH);
  struct sp_msgbuf mb;
  sp_pack_many_storages(&mb, id, 1, REG_N, REG_LENGTH);
  ck_assert_int_eq(sp_test_send_msgbuf(sock, &mb, &fd, 1), 0);
  close(fd);
}

/* The rank's next reply is its connection's end (an error of id 0 with
 * code), not the frame's answer.  Then the frame held at the gate goes on,
 * and the daemon closes the socket once the worker is done with it. */
static void expect_ended(int sock, int code, int held) {
  struct sp_test_reply r;
  ck_assert_int_eq(sp_test_recv(sock, &r, 120000), 0);
  ck_assert_msg(r.head.id == 0 && r.code == code,
                "the frame was served before the connection ended: reply "
                "%s id %llu code %s",
                r.head.op, (unsigned long long)r.head.id, sp_err_name(r.code));
  sp_test_reply_free(&r);
  release_gate(held);
  ck_assert_int_eq(sp_test_wait_closed(sock, SP_TEST_TIMEOUT_MS), 0);
}

/* The daemon stops while the frame is on a worker: the connection ends at
 * once, the frame is dropped when the worker is done, and the daemon exits
 * cleanly (stop checks its status). */
START_TEST(closed_while_served) {
  start_gated();
  sp_client *creator = NULL;
  ck_assert_int_eq(sp_connect(daemon_.socket, &creator), 0);
  int sock = raw_rank(creator);
  send_large_storage_add(sock, next_id++);
  int held = hold_gate();
  ck_assert_int_eq(kill(daemon_.pid, SIGTERM), 0);
  expect_ended(sock, SP_EDAEMONRESTARTED, held);
  /* It exits once the worker is done, with no error (a sanitizer's or
   * valgrind's would change its status). */
  ck_assert_int_eq(sp_test_wait(daemon_.pid, 120000), 0);
  daemon_.pid = 0;
  sp_test_rmdir(daemon_.dir);
  remove_gate();
  close(sock);
  sp_close(creator);
}
END_TEST

/* The rank's job is aborted between two steps of the frame, its first
 * 4096 storages added to the registry: the rank's connection ends with
 * aborted, the frame is dropped with the job's registry gone, and the
 * daemon serves on. */
START_TEST(job_aborted_while_served) {
  start_gated();
  sp_client *creator = NULL;
  ck_assert_int_eq(sp_connect(daemon_.socket, &creator), 0);
  int sock = raw_rank(creator);
  sp_status_info *st = NULL;
  ck_assert_int_eq(sp_status(creator, &st), 0);
  ck_assert_uint_eq(st->njobs, 1);
  char job[2 * 16 + 1];
  snprintf(job, sizeof job, "%s", st->jobs[0].job_id);
  sp_status_free(st);
  send_large_storage_add(sock, next_id++);
  release_gate(hold_gate()); /* decoded, and the first step served */
  int held = hold_gate();
  ck_assert_int_eq(sp_job_abort(creator, job, NULL, 0), 0);
  expect_ended(sock, SP_EABORTED, held);
  close(sock);
  /* The daemon goes on: a new job registers as before. */
  sock = raw_rank(creator);
  int fd = memfd_of(REG_LENGTH);
  struct sp_msgbuf mb;
  uint64_t id = next_id++;
  sp_pack_many_storages(&mb, id, 1, 1, REG_LENGTH);
  uint64_t from;
  served_in_ns(sock, &mb, id, &fd, 1, &from);
  close(fd);
  close(sock);
  sp_close(creator);
  stop();
  remove_gate();
}
END_TEST

int main(void) {
  Suite *s = suite_create("daemon-loop");
  TCase *tc = tcase_create("loop");
  tcase_set_timeout(tc, 300);
  tcase_add_test(tc, largest_frames_leave_the_loop_free);
  tcase_add_test(tc, closed_while_served);
  tcase_add_test(tc, job_aborted_while_served);
  suite_add_tcase(s, tc);
  SRunner *sr = srunner_create(s);
  srunner_run_all(sr, CK_NORMAL);
  int failed = srunner_ntests_failed(sr);
  srunner_free(sr);
  return failed == 0 ? EXIT_SUCCESS : EXIT_FAILURE;
}
