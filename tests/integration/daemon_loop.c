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
#include <dirent.h>
#include <poll.h>
#include <errno.h>
#include <sched.h>
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

static void start_with(const char *conf) {
  char dir[256], path[300];
  ck_assert_int_eq(sp_test_mkdtemp(dir, sizeof dir), 0);
  snprintf(path, sizeof path, "%s/shardportd.conf", dir);
  ck_assert_int_eq(sp_test_write_file(path, conf), 0);
  const char *args[] = {"--config", path, NULL};
  ck_assert_int_eq(sp_test_daemon_start(&daemon_, args), 0);
  sp_test_rmdir(dir);
}

static void start(void) { start_with(REG_CONF); }

/* A daemon whose large frames wait on a worker, before their decoding and
 * before each later step, until hold_gate's descriptor is closed. */
static void start_gated_with(const char *conf) {
  ck_assert_int_eq(sp_test_mkdtemp(gate_dir, sizeof gate_dir), 0);
  snprintf(gate, sizeof gate, "%s/gate", gate_dir);
  ck_assert_int_eq(mkfifo(gate, 0600), 0);
  setenv("SHARDPORTD_TEST_WORKER_GATE", gate, 1);
  start_with(conf);
  unsetenv("SHARDPORTD_TEST_WORKER_GATE");
}

static void start_gated(void) { start_gated_with(REG_CONF); }

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

/* How many of the daemon's descriptors are the gate: one per worker past
 * its open, that is, one per frame at the gate while the test holds it. */
static int at_gate(void) {
  char dir[64], link[320], target[300];
  snprintf(dir, sizeof dir, "/proc/%d/fd", (int)daemon_.pid);
  DIR *d = opendir(dir);
  ck_assert_ptr_nonnull(d);
  int n = 0;
  for (struct dirent *e; (e = readdir(d)) != NULL;) {
    snprintf(link, sizeof link, "%s/%s", dir, e->d_name);
    ssize_t len = readlink(link, target, sizeof target - 1);
    if (len <= 0)
      continue;
    target[len] = '\0';
    n += strcmp(target, gate) == 0;
  }
  closedir(d);
  return n;
}

/* Waits until n frames are at the held gate; fails if they never come. */
static void wait_at_gate(int n) {
  uint64_t deadline = sp_now_ns() + (uint64_t)SP_TEST_TIMEOUT_MS * 1000000;
  while (at_gate() != n) {
    ck_assert_msg(sp_now_ns() < deadline,
                  "%d frame(s) at the gate, not %d", at_gate(), n);
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

static int raw_rank(sp_client *creator) {
  int sock = sp_test_raw_rank(daemon_.socket, creator, next_id++);
  ck_assert_int_ge(sock, 0);
  return sock;
}

static int memfd_of(size_t size) {
  int fd = sp_test_memfd("loop", size);
  ck_assert_int_ge(fd, 0);
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


/* Clients, each one rank with one large frame in flight at once, and the
 * daemon's worker threads. */
#define STAGED_CLIENTS 16
#define STAGED_WORKERS 4
#define STAGED_WORKERS_TEXT "4"

/* Sends a storage_add of REG_N storages on each of n ranks at once and
 * reads every reply, each a refusal by max_user_registrations: checked in
 * steps, then refused at admission, the frames leave nothing registered.
 * Returns by how much the daemon's peak resident memory grew meanwhile. */
static long staged_growth_kb(sp_client *creator, size_t n) {
  int socks[STAGED_CLIENTS], fds[STAGED_CLIENTS];
  struct sp_msgbuf mbs[STAGED_CLIENTS];
  for (size_t k = 0; k < n; k++) {
    socks[k] = raw_rank(creator);
    fds[k] = memfd_of((size_t)REG_N * REG_LENGTH);
  }
  for (size_t k = 0; k < n; k++)
    sp_pack_many_storages(&mbs[k], next_id + k, 1, REG_N, REG_LENGTH);
  long before = sp_test_vm_kb(daemon_.pid, "VmHWM");
  for (size_t k = 0; k < n; k++)
    ck_assert_int_eq(sp_test_send_msgbuf(socks[k], &mbs[k], &fds[k], 1), 0);
  for (size_t k = 0; k < n; k++) {
    struct sp_test_reply r;
    ck_assert_int_eq(sp_test_recv(socks[k], &r, 120000), 0);
    ck_assert_msg(r.code == SP_ELIMIT, "%s: %s", sp_err_name(r.code),
                  r.message);
    ck_assert_uint_eq(r.head.id, next_id + k);
    sp_test_reply_free(&r);
    close(socks[k]);
    close(fds[k]);
  }
  next_id += n;
  return sp_test_vm_kb(daemon_.pid, "VmHWM") - before;
}

/* Many clients' large frames at once hold no more than max_staged_bytes
 * of them decoded (here one frame's worth): the daemon grows by the
 * others' bytes as they came, and one frame's decoding per worker thread
 * (the allocator keeps what each thread freed), where every frame used to
 * be decoded and held at once (16 clients: 880 MiB, 13 times one). */
START_TEST(staged_frames_are_bounded_daemon_wide) {
  setenv("UV_THREADPOOL_SIZE", STAGED_WORKERS_TEXT, 1);
  start_with(REG_CONF "max_user_registrations = 1000\n"
                      "max_staged_bytes = 64K\n");
  unsetenv("UV_THREADPOOL_SIZE");
  sp_client *creator = NULL;
  ck_assert_int_eq(sp_connect(daemon_.socket, &creator), 0);
  long one_kb = staged_growth_kb(creator, 1);
  long many_kb = staged_growth_kb(creator, STAGED_CLIENTS);
  struct sp_msgbuf mb;
  sp_pack_many_storages(&mb, 0, 1, REG_N, REG_LENGTH);
  long frame_kb = (long)(mb.sbuf.size / 1024);
  sp__msgbuf_discard(&mb);
  long bound_kb = STAGED_WORKERS * one_kb + STAGED_CLIENTS * frame_kb;
  printf("one frame of %ld KiB: the daemon grew by %ld KiB; %d at once: by "
         "%ld KiB (bound %ld KiB)\n",
         frame_kb, one_kb, STAGED_CLIENTS, many_kb, bound_kb);
  fflush(stdout);
  ck_assert_msg(many_kb <= bound_kb,
                "%d frames at once grew the daemon by %ld KiB, more than "
                "one frame's %ld KiB per worker and their %ld KiB of bytes",
                STAGED_CLIENTS, many_kb, one_kb, STAGED_CLIENTS * frame_kb);
  sp_close(creator);
  stop();
}
END_TEST


/* Reads the reply to frame id: accepted. */
static void expect_served(int sock, uint64_t id) {
  struct sp_test_reply r;
  ck_assert_int_eq(sp_test_recv(sock, &r, 120000), 0);
  ck_assert_msg(r.code == 0, "%s: %s", sp_err_name(r.code), r.message);
  ck_assert_uint_eq(r.head.id, id);
  sp_test_reply_free(&r);
}

/* Reads both frames' replies, each accepted, letting every frame past the
 * gate each time it stops there (before its decoding and its steps). */
static void expect_both_served(int first, uint64_t first_id, int second,
                               uint64_t second_id) {
  int done = 0;
  while (done < 2) {
    struct pollfd p[2] = {{.fd = first, .events = POLLIN},
                          {.fd = second, .events = POLLIN}};
    int n = poll(p, 2, 10);
    ck_assert_int_ge(n, 0);
    if (n > 0) {
      if (p[0].revents & POLLIN)
        expect_served(first, first_id);
      if (p[1].revents & POLLIN)
        expect_served(second, second_id);
      done += (p[0].revents & POLLIN ? 1 : 0) + (p[1].revents & POLLIN ? 1 : 0);
      continue;
    }
    int fd = open_gate();
    if (fd >= 0)
      close(fd);
  }
}

/* With one frame's worth of max_staged_bytes, the frames of two more
 * clients wait undecoded behind the first, held at the gate.  One of them
 * closes its socket meanwhile (unread while its frame waits, the close is
 * seen once the frame is served, and the frame is still counted in
 * max_clients until then).  Each is served in turn once the first goes
 * on, and the daemon stops cleanly (nothing leaked or freed twice: the
 * sanitizer builds run this too). */
START_TEST(frames_wait_their_turn) {
  start_gated_with(REG_CONF "max_staged_bytes = 64K\n");
  sp_client *creator = NULL;
  ck_assert_int_eq(sp_connect(daemon_.socket, &creator), 0);
  int first = raw_rank(creator), second = raw_rank(creator);
  int gone = raw_rank(creator);
  uint64_t first_id = next_id++, second_id = next_id++;
  send_large_storage_add(first, first_id);
  int held = hold_gate();
  send_large_storage_add(gone, next_id++);
  send_large_storage_add(second, second_id);
  /* The last bytes of each frame that the socket buffered reach the
   * daemon within a few of its turns; a ping takes one. */
  for (int i = 0; i < 100; i++)
    ck_assert_int_eq(sp_ping(creator, NULL), 0);
  close(gone);
  ck_assert_int_eq(sp_ping(creator, NULL), 0);
  close(held);
  expect_both_served(first, first_id, second, second_id);
  close(first);
  close(second);
  sp_close(creator);
  stop();
  remove_gate();
}
END_TEST

/* The daemon stops while one frame is held at the gate and another
 * waits behind it, undecoded: both connections end at once, both frames
 * are dropped (the waiting one without being decoded) and the daemon
 * exits cleanly. */
START_TEST(stopped_while_waiting) {
  start_gated_with(REG_CONF "max_staged_bytes = 64K\n");
  sp_client *creator = NULL;
  ck_assert_int_eq(sp_connect(daemon_.socket, &creator), 0);
  int first = raw_rank(creator), second = raw_rank(creator);
  send_large_storage_add(first, next_id++);
  int held = hold_gate();
  send_large_storage_add(second, next_id++);
  for (int i = 0; i < 100; i++)
    ck_assert_int_eq(sp_ping(creator, NULL), 0);
  ck_assert_int_eq(kill(daemon_.pid, SIGTERM), 0);
  struct sp_test_reply r;
  ck_assert_int_eq(sp_test_recv(second, &r, 120000), 0);
  ck_assert_msg(r.head.id == 0 && r.code == SP_EDAEMONRESTARTED,
                "the waiting frame was served: reply %s id %llu code %s",
                r.head.op, (unsigned long long)r.head.id, sp_err_name(r.code));
  sp_test_reply_free(&r);
  expect_ended(first, SP_EDAEMONRESTARTED, held);
  ck_assert_int_eq(sp_test_wait_closed(second, SP_TEST_TIMEOUT_MS), 0);
  ck_assert_int_eq(sp_test_wait(daemon_.pid, 120000), 0);
  daemon_.pid = 0;
  sp_test_rmdir(daemon_.dir);
  remove_gate();
  close(first);
  close(second);
  sp_close(creator);
}
END_TEST

/* Lets the next daemon run on two CPUs at most (it takes this thread's
 * affinity), so that its large frames decode one at a time.  Returns the
 * affinity to give back (restore_cpus). */
static cpu_set_t two_cpus(void) {
  cpu_set_t was, two;
  ck_assert_int_eq(sched_getaffinity(0, sizeof was, &was), 0);
  CPU_ZERO(&two);
  for (int cpu = 0, kept = 0; cpu < CPU_SETSIZE && kept < 2; cpu++)
    if (CPU_ISSET(cpu, &was)) {
      CPU_SET(cpu, &two);
      kept++;
    }
  ck_assert_int_eq(sched_setaffinity(0, sizeof two, &two), 0);
  return was;
}

static void restore_cpus(const cpu_set_t *was) {
  ck_assert_int_eq(sched_setaffinity(0, sizeof *was, was), 0);
}

/* Sends frame id on sock, and waits until the daemon has read all of it
 * (each ping takes a turn of the loop). */
static void send_and_settle(sp_client *creator, int sock, uint64_t id) {
  send_large_storage_add(sock, id);
  for (int i = 0; i < 100; i++)
    ck_assert_int_eq(sp_ping(creator, NULL), 0);
}

/* On two CPUs a second large frame is not decoded while the first is, so
 * that the loop keeps a CPU of its own (docs/operations.md, "Large
 * frames"): with the first held at the gate before its decoding, the
 * second, all read and within max_staged_bytes, stays away from it (as
 * many frames as the thread pool had threads decoded at once).  Both are
 * served once the gate lets them go. */
START_TEST(one_decoding_at_a_time_on_two_cpus) {
  cpu_set_t was = two_cpus();
  start_gated();
  restore_cpus(&was);
  sp_client *creator = NULL;
  ck_assert_int_eq(sp_connect(daemon_.socket, &creator), 0);
  int first = raw_rank(creator), second = raw_rank(creator);
  uint64_t first_id = next_id++, second_id = next_id++;
  send_large_storage_add(first, first_id);
  int held = hold_gate();
  wait_at_gate(1);
  send_and_settle(creator, second, second_id);
  /* A worker given the second frame opens the gate at once: the test
   * holds its other end. */
  usleep(500 * 1000);
  ck_assert_msg(at_gate() == 1, "%d frames decoding at once on two CPUs",
                at_gate());
  close(held);
  expect_both_served(first, first_id, second, second_id);
  close(first);
  close(second);
  sp_close(creator);
  stop();
  remove_gate();
}
END_TEST

/* A reload that raises max_staged_bytes takes in a frame that waited for
 * it at once, not when the frame before it is done: the first frame, held
 * between two of its steps, holds all of the old bound; after the reload
 * the second comes to the gate to be decoded while the first is still
 * held. */
START_TEST(reload_raising_the_bound_takes_waiting_frames) {
  char dir[256], path[300];
  ck_assert_int_eq(sp_test_mkdtemp(dir, sizeof dir), 0);
  snprintf(path, sizeof path, "%s/shardportd.conf", dir);
  ck_assert_int_eq(
      sp_test_write_file(path, REG_CONF "max_staged_bytes = 64K\n"), 0);
  ck_assert_int_eq(sp_test_mkdtemp(gate_dir, sizeof gate_dir), 0);
  snprintf(gate, sizeof gate, "%s/gate", gate_dir);
  ck_assert_int_eq(mkfifo(gate, 0600), 0);
  setenv("SHARDPORTD_TEST_WORKER_GATE", gate, 1);
  const char *args[] = {"--config", path, NULL};
  ck_assert_int_eq(sp_test_daemon_start(&daemon_, args), 0);
  unsetenv("SHARDPORTD_TEST_WORKER_GATE");
  sp_client *creator = NULL;
  ck_assert_int_eq(sp_connect(daemon_.socket, &creator), 0);
  int first = raw_rank(creator), second = raw_rank(creator);
  uint64_t first_id = next_id++, second_id = next_id++;
  send_large_storage_add(first, first_id);
  release_gate(hold_gate()); /* decoded, and the first step served */
  int held = hold_gate();
  wait_at_gate(1);
  send_and_settle(creator, second, second_id);
  ck_assert_int_eq(at_gate(), 1);
  ck_assert_int_eq(
      sp_test_write_file(path, REG_CONF "max_staged_bytes = 64M\n"), 0);
  ck_assert_int_eq(kill(daemon_.pid, SIGHUP), 0);
  wait_at_gate(2);
  close(held);
  expect_both_served(first, first_id, second, second_id);
  close(first);
  close(second);
  sp_close(creator);
  stop();
  remove_gate();
  sp_test_rmdir(dir);
}
END_TEST

/* Names in one export's together-group: a frame of about 3.7 MiB. */
#define GROUP_NAMES 500000u

/* An export whose groups list is large is parsed on a worker: the loop is
 * not busy a quarter of the time the frame took (on the loop, 500,000
 * names held it 220 ms, nearly all of it).  The names are registered by
 * no rank, so the planner refuses the export. */
START_TEST(large_export_leaves_the_loop_free) {
  start();
  sp_client *creator = NULL;
  ck_assert_int_eq(sp_connect(daemon_.socket, &creator), 0);
  int sock = raw_rank(creator);
  struct sp_msgbuf mb;
  uint64_t id = next_id++;
  sp__msgbuf_begin(&mb, "export", id, 1);
  sp__pack_str(&mb.pk, "groups");
  msgpack_pack_array(&mb.pk, 1);
  msgpack_pack_array(&mb.pk, GROUP_NAMES);
  for (uint32_t i = 0; i < GROUP_NAMES; i++) {
    char key[32];
    snprintf(key, sizeof key, "k%u", i);
    sp__pack_str(&mb.pk, key);
  }
  loop_max_busy_us();
  uint64_t from = sp_now_ns();
  ck_assert_int_eq(sp_test_send_msgbuf(sock, &mb, NULL, 0), 0);
  struct sp_test_reply r;
  ck_assert_int_eq(sp_test_recv(sock, &r, 120000), 0);
  uint64_t took = sp_now_ns() - from;
  uint64_t busy_ns = loop_max_busy_us() * 1000;
  ck_assert_msg(r.code == SP_EGROUPS, "%s: %s", sp_err_name(r.code),
                r.message);
  ck_assert_uint_eq(r.head.id, id);
  sp_test_reply_free(&r);
  printf("export of %u group names: answered in %.1f ms; loop busy %.1f ms "
         "at most\n",
         GROUP_NAMES, took / 1e6, busy_ns / 1e6);
  fflush(stdout);
  ck_assert_msg(4 * busy_ns <= took,
                "the loop was busy %.1f ms in one iteration, more than a "
                "quarter of the %.1f ms the export's frame took",
                busy_ns / 1e6, took / 1e6);
  close(sock);
  sp_close(creator);
  stop();
}
END_TEST

int main(void) {
  Suite *s = suite_create("daemon-loop");
  TCase *tc = tcase_create("loop");
  tcase_set_timeout(tc, 300);
  tcase_add_test(tc, largest_frames_leave_the_loop_free);
  tcase_add_test(tc, closed_while_served);
  tcase_add_test(tc, job_aborted_while_served);
  tcase_add_test(tc, staged_frames_are_bounded_daemon_wide);
  tcase_add_test(tc, frames_wait_their_turn);
  tcase_add_test(tc, stopped_while_waiting);
  tcase_add_test(tc, one_decoding_at_a_time_on_two_cpus);
  tcase_add_test(tc, reload_raising_the_bound_takes_waiting_frames);
  tcase_add_test(tc, large_export_leaves_the_loop_free);
  suite_add_tcase(s, tc);
  SRunner *sr = srunner_create(s);
  srunner_run_all(sr, CK_NORMAL);
  int failed = srunner_ntests_failed(sr);
  srunner_free(sr);
  return failed == 0 ? EXIT_SUCCESS : EXIT_FAILURE;
}
