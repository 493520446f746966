/*
 * loop_bench.c - what one client's largest registrations cost the others.
 *
 * A second client pings the daemon back to back; its latencies while a
 * rank registers the largest frames the default limits allow (about
 * 40,000 storages over one memfd, then 26,000 tensors) are compared with
 * its latencies while the daemon is idle, measured in the same run, with
 * the daemon's own loop_max_busy_us beside them.  Figures are printed,
 * never asserted (docs/benchmarks.md); daemon-loop asserts the bound.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "build_config.h"
#include "shardport.h"
#include "tests/integration/harness.h"
#include "tests/integration/loadprobe.h"

/* The most a frame may hold under the default max_items (262144 items per
 * container, twice that per frame): a storage is 13 items, a tensor 20. */
#define BENCH_STORAGES 40000u
#define BENCH_TENSORS 26000u
#define BENCH_LENGTH 64u
#define BENCH_ROUNDS 5
#define IDLE_NS (500 * UINT64_C(1000000))

static struct sp_test_daemon daemon_;

static void die(const char *what, int rc) {
  fprintf(stderr, "loop_bench: %s: %s\n", what, sp_err_name(rc));
  if (daemon_.pid > 0)
    sp_test_daemon_stop(&daemon_);
  exit(1);
}

static uint64_t loop_max_busy_us(sp_client *c) {
  sp_status_info *st = NULL;
  int rc = sp_status(c, &st);
  if (rc != 0)
    die("status", rc);
  uint64_t us = st->loop_max_busy_us;
  sp_status_free(st);
  return us;
}

static void call(int sock, struct sp_msgbuf *mb, const int *fds, size_t nfds) {
  struct sp_test_reply r;
  int rc = sp_test_send_msgbuf(sock, mb, fds, nfds);
  if (rc == 0)
    rc = sp_test_recv(sock, &r, 120000);
  if (rc != 0)
    die("registration", rc);
  rc = r.code;
  sp_test_reply_free(&r);
  if (rc != 0)
    die("registration refused", rc);
}

/* One rank of a new job registers both frames; the time it was served. */
static uint64_t register_rank(sp_client *creator, uint64_t *busy_us) {
  sp_ticket t;
  int rc = sp_job_create(creator, 1, &t);
  if (rc != 0)
    die("job_create", rc);
  int sock = sp_test_connect_hello(daemon_.socket);
  if (sock < 0 || (rc = sp_test_join(sock, 1, t.bytes, t.len, 0, 1)) != 0)
    die("join", sock < 0 ? sock : rc);
  int fd = memfd_create("bench", MFD_CLOEXEC);
  if (fd < 0 || ftruncate(fd, (off_t)BENCH_STORAGES * BENCH_LENGTH) != 0)
    die("memfd", SP_EIO);
  struct sp_msgbuf storages, tensors;
  sp_pack_many_storages(&storages, 2, 1, BENCH_STORAGES, BENCH_LENGTH);
  sp_pack_many_tensors(&tensors, 3, 1, BENCH_TENSORS, BENCH_LENGTH);
  loop_max_busy_us(creator);
  uint64_t t0 = sp_now_ns();
  call(sock, &storages, &fd, 1);
  call(sock, &tensors, NULL, 0);
  uint64_t took = sp_now_ns() - t0;
  *busy_us = loop_max_busy_us(creator);
  close(fd);
  close(sock);
  return took;
}

static void print(const char *what, struct sp_ping_stats s) {
  printf("%-28s %6zu pings  p50 %8.3f ms  p99 %8.3f ms  max %8.3f ms\n", what,
         s.count, s.p50_ns / 1e6, s.p99_ns / 1e6, s.max_ns / 1e6);
}

int main(void) {
  if (sp_test_daemon_start(&daemon_, NULL) != 0) {
    fprintf(stderr, "loop_bench: the daemon did not start\n");
    return 1;
  }
  sp_client *creator = NULL;
  int rc = sp_connect(daemon_.socket, &creator);
  if (rc != 0)
    die("connect", rc);
  struct sp_prober p;
  sp_prober_start(&p, daemon_.socket);
  if (p.failed != 0)
    die("prober", p.failed);
  uint64_t idle_from = sp_now_ns();
  usleep(IDLE_NS / 1000);
  uint64_t idle_to = sp_now_ns();
  uint64_t idle_busy_us = loop_max_busy_us(creator);
  uint64_t from[BENCH_ROUNDS], took[BENCH_ROUNDS], busy_us[BENCH_ROUNDS];
  for (int i = 0; i < BENCH_ROUNDS; i++) {
    from[i] = sp_now_ns();
    took[i] = register_rank(creator, &busy_us[i]);
  }
  if ((rc = sp_prober_stop(&p)) != 0)
    die("prober", rc);
  printf("a second client's ping while one rank registers %u storages and "
         "%u tensors (%d rounds)\n",
         BENCH_STORAGES, BENCH_TENSORS, BENCH_ROUNDS);
  struct sp_ping_stats idle = sp_prober_window(&p, idle_from, idle_to);
  print("idle", idle);
  uint64_t busy_max = 0;
  for (int i = 0; i < BENCH_ROUNDS; i++) {
    char what[64];
    snprintf(what, sizeof what, "registering, round %d", i + 1);
    print(what, sp_prober_window(&p, from[i], from[i] + took[i]));
    printf("%-28s served in %.1f ms; loop busy %.3f ms at most\n", "",
           took[i] / 1e6, busy_us[i] / 1e3);
    if (busy_us[i] > busy_max)
      busy_max = busy_us[i];
  }
  struct sp_ping_stats all = sp_prober_window(
      &p, from[0], from[BENCH_ROUNDS - 1] + took[BENCH_ROUNDS - 1]);
  print("registering, all rounds", all);
  printf("while registering / idle: p99 x%.2f, max x%.2f; loop busy at most "
         "%.3f ms (idle: %.3f ms)\n",
         idle.p99_ns > 0 ? (double)all.p99_ns / (double)idle.p99_ns : 0.0,
         idle.max_ns > 0 ? (double)all.max_ns / (double)idle.max_ns : 0.0,
         busy_max / 1e3, idle_busy_us / 1e3);
  sp_prober_free(&p);
  sp_close(creator);
  return sp_test_daemon_stop(&daemon_) == 0 ? 0 : 1;
}
