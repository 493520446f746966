/*
 * daemon_planner.c - the planner against hostile affine layouts, through a
 * real shardportd and the client library.
 *
 * A key of 2^32 sparse elements costs the daemon what its one piece costs,
 * not a byte per element; a layout whose plan takes longer than the
 * export's timeout fails the export with `timeout` on every rank, and the
 * planner stops and frees what it took.  Meanwhile status is answered and
 * another job exports.  Memory is the daemon's peak resident set (VmHWM),
 * read before and after.
 */
#include <check.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include "shardport.h"
#include "tests/integration/harness.h"

/* What the daemon's peak resident set may grow by while an attack runs:
 * allocator noise and the metadata, far below the attack's sizes. */
#define PEAK_GROWTH_KIB (64 * 1024)

static struct sp_test_daemon daemon_;

/* libuv's worker threads, set for the daemon so that the test knows how
 * many threads it has between exports: these and the loop's. */
#define WORKERS 4
#define WORKERS_TEXT "4"

static void start(void) {
#if defined(__SANITIZE_ADDRESS__)
  /* AddressSanitizer's quarantine would count freed memory as growth (see
   * daemon_hostile.c). */
  const char *opts = getenv("ASAN_OPTIONS");
  char buf[512];
  snprintf(buf, sizeof buf, "%s%squarantine_size_mb=4",
           opts != NULL ? opts : "",
           opts != NULL && opts[0] != '\0' ? ":" : "");
  ck_assert_int_eq(setenv("ASAN_OPTIONS", buf, 1), 0);
#endif
  setenv("UV_THREADPOOL_SIZE", WORKERS_TEXT, 1);
  ck_assert_int_eq(sp_test_daemon_start(&daemon_, NULL), 0);
  unsetenv("UV_THREADPOOL_SIZE");
}

static void stop(void) {
  if (daemon_.pid > 0)
    ck_assert_int_eq(sp_test_daemon_stop(&daemon_), 0);
}

static uint64_t now_us(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000u + (uint64_t)ts.tv_nsec / 1000u;
}

/* One rank's holding of one uint8 key: a sparse memfd of `bytes`, the
 * rank's shard of `shard` elements at its start, and its pieces. */
struct holding {
  const char *key;
  uint64_t bytes;
  int64_t shard;
  int64_t global;
  size_t npieces;
  sp_piece pieces[32];
  int fd;
  void *map;
};

static void holding_open(struct holding *h) {
  h->fd = memfd_create("planner-test", MFD_CLOEXEC);
  ck_assert_int_ge(h->fd, 0);
  ck_assert_int_eq(ftruncate(h->fd, (off_t)h->bytes), 0);
  h->map = mmap(NULL, h->bytes, PROT_READ, MAP_SHARED, h->fd, 0);
  ck_assert_ptr_ne(h->map, MAP_FAILED);
}

static void holding_close(struct holding *h) {
  munmap(h->map, h->bytes);
  close(h->fd);
}

static int holding_register(sp_client *c, const struct holding *h) {
  sp_storage_desc s = {.id = 1,
                       .fd = h->fd,
                       .length = h->bytes,
                       .addr = h->map,
                       .kind = SP_STORAGE_MEMFD};
  sp_tensor_desc t = {.key = h->key,
                      .storage = 1,
                      .dtype = "uint8",
                      .ndim = 1,
                      .shape = {h->shard},
                      .stride = {1},
                      .placement = SP_PLACEMENT_AFFINE,
                      .global_ndim = 1,
                      .global_shape = {h->global},
                      .npieces = h->npieces,
                      .pieces = h->pieces};
  int rc = sp_register_storages(c, &s, 1);
  return rc != 0 ? rc : sp_register_tensors(c, &t, 1);
}

static sp_piece piece(int64_t n, int64_t src, int64_t dst, int64_t dst_stride,
                      const uint32_t *holder) {
  sp_piece p = {.ndim = 1,
                .shape = {n},
                .src_offset = src,
                .src_stride = {1},
                .dst_offset = dst,
                .dst_stride = {dst_stride},
                .nholders = 1,
                .holders = holder};
  return p;
}

/* A rank on its own thread: joins, registers its holding, exports once. */
struct rank {
  pthread_t thread;
  const sp_ticket *ticket;
  uint32_t rank, world;
  uint32_t timeout_ms;
  struct holding h;
  int rc;
  char msg[SP_ERRMSG_MAX + 1];
  _Atomic bool done;
};

static void *rank_main(void *arg) {
  struct rank *r = arg;
  sp_client *c = NULL;
  sp_owned_set *set = NULL;
  sp_export_opts opts = {.timeout_ms = r->timeout_ms};

  r->rc = sp_connect(daemon_.socket, &c);
  if (r->rc == 0)
    r->rc = sp_job_join(c, r->ticket, r->rank, r->world, "cpu");
  if (r->rc == 0)
    r->rc = holding_register(c, &r->h);
  if (r->rc == 0)
    r->rc = sp_export(c, &opts, &set);
  if (c != NULL)
    snprintf(r->msg, sizeof r->msg, "%s", sp_last_message(c));
  sp_release(c, set);
  sp_close(c);
  atomic_store(&r->done, true);
  return NULL;
}

/* The phase status reports for the first job of the snapshot, or "". */
static void status_phase(sp_client *c, char *phase, size_t len,
                         uint64_t *worst_us) {
  sp_status_info *st = NULL;
  uint64_t t0 = now_us();

  ck_assert_int_eq(sp_status(c, &st), 0);
  if (now_us() - t0 > *worst_us)
    *worst_us = now_us() - t0;
  snprintf(phase, len, "%s", st->njobs > 0 ? st->jobs[0].phase : "");
  sp_status_free(st);
}

/* The attack: one rank, a 4 GiB sparse memfd and one affine uint8
 * piece of one element of a 2^32-element key.  The export is refused
 * (`uncovered`) from the piece alone; the daemon's peak resident set does
 * not grow by the key's size. */
START_TEST(huge_sparse_affine_key_costs_its_pieces) {
  static const uint32_t R0[] = {0};
  const int64_t n = (int64_t)1 << 32;
  struct rank r = {.rank = 0, .world = 1, .timeout_ms = 30000};
  sp_client *c;
  sp_ticket ticket;
  long peak_before = sp_test_vm_kb(daemon_.pid, "VmHWM");

  ck_assert_int_gt(peak_before, 0);
  r.h = (struct holding){.key = "huge",
                         .bytes = (uint64_t)n,
                         .shard = n,
                         .global = n,
                         .npieces = 1};
  r.h.pieces[0] = piece(1, 0, 0, 1, R0);
  holding_open(&r.h);
  ck_assert_int_eq(sp_connect(daemon_.socket, &c), 0);
  ck_assert_int_eq(sp_job_create(c, 1, &ticket), 0);
  r.ticket = &ticket;
  rank_main(&r);
  ck_assert_msg(r.rc == SP_EUNCOVERED, "export: %s (%s)", sp_err_name(r.rc),
                r.msg);
  ck_assert_ptr_nonnull(strstr(r.msg, "element [1] is held by no rank"));
  long peak_after = sp_test_vm_kb(daemon_.pid, "VmHWM");
  printf("huge affine key: the daemon's peak resident set %ld -> %ld KiB "
         "(bound: +%d KiB)\n",
         peak_before, peak_after, PEAK_GROWTH_KIB);
  ck_assert_msg(peak_after - peak_before < PEAK_GROWTH_KIB,
                "the daemon's peak resident set grew from %ld to %ld KiB",
                peak_before, peak_after);
  sp_close(c);
  holding_close(&r.h);
}
END_TEST

/* A job of one rank that exports one small affine key whole: the job that
 * runs beside an attack and must complete. */
static void legitimate_export(void) {
  static const uint32_t R0[] = {0};
  struct rank r = {.rank = 0, .world = 1, .timeout_ms = 30000};
  sp_client *c;
  sp_ticket ticket;

  r.h = (struct holding){
      .key = "small", .bytes = 4096, .shard = 4096, .global = 4096};
  r.h.npieces = 1;
  r.h.pieces[0] = piece(4096, 0, 0, 1, R0);
  holding_open(&r.h);
  ck_assert_int_eq(sp_connect(daemon_.socket, &c), 0);
  ck_assert_int_eq(sp_job_create(c, 1, &ticket), 0);
  r.ticket = &ticket;
  rank_main(&r);
  ck_assert_msg(r.rc == 0, "the job beside the attack: %s (%s)",
                sp_err_name(r.rc), r.msg);
  sp_close(c);
  holding_close(&r.h);
}

/* Two ranks hold a valid key of 2^30 uint8 elements whose every element is
 * a run of its own (element e in piece z of the lowest zero bit z of e,
 * periods 2 to 2^30; the last element alone), so that checking it visits a
 * billion runs: far longer than the export's timeout of 3 s.  The export
 * fails with `timeout` on both ranks, naming planning; the planner's thread
 * ends soon after; status is answered and another job exports while it
 * plans; the daemon's peak resident set stays put. */
START_TEST(plan_longer_than_the_timeout_fails_and_stops) {
  static const uint32_t R0[] = {0}, R1[] = {1};
  const int64_t n = (int64_t)1 << 30;
  static struct rank ranks[2];
  sp_client *c;
  sp_ticket ticket;
  char phase[32] = "";
  uint64_t worst_us = 0, answered = 0;
  /* libuv's worker threads start with the first work the daemon queues (a
   * departed rank's registry is freed on one) and stay: one export first,
   * and its ranks gone, so that they are counted before.  The ranks leave,
   * and the export's threads end, a moment after its reply: the count
   * waits for the loop's and the workers' alone. */
  legitimate_export();
  long threads_before = sp_test_vm_kb(daemon_.pid, "Threads");
  for (int i = 0; i < 500 && threads_before != 1 + WORKERS; i++) {
    usleep(10000);
    threads_before = sp_test_vm_kb(daemon_.pid, "Threads");
  }
  ck_assert_int_eq(threads_before, 1 + WORKERS);
  long peak_before = sp_test_vm_kb(daemon_.pid, "VmHWM");

  ck_assert_int_gt(threads_before, 0);
  for (uint32_t r = 0; r < 2; r++) {
    ranks[r] = (struct rank){.rank = r, .world = 2, .timeout_ms = 3000};
    ranks[r].h = (struct holding){.key = "dyadic", .global = n};
  }
  for (int z = 0; z < 30; z++) {
    struct holding *h = &ranks[z % 2].h;
    int64_t count = n >> (z + 1);
    h->pieces[h->npieces++] = piece(count, h->shard, ((int64_t)1 << z) - 1,
                                    (int64_t)2 << z, z % 2 ? R1 : R0);
    h->shard += count;
  }
  ranks[1].h.pieces[ranks[1].h.npieces++] =
      piece(1, ranks[1].h.shard++, n - 1, 1, R1);
  ck_assert_int_eq(sp_connect(daemon_.socket, &c), 0);
  ck_assert_int_eq(sp_job_create(c, 2, &ticket), 0);
  for (uint32_t r = 0; r < 2; r++) {
    ranks[r].h.bytes = (uint64_t)ranks[r].h.shard;
    holding_open(&ranks[r].h);
    ranks[r].ticket = &ticket;
    ck_assert_int_eq(
        pthread_create(&ranks[r].thread, NULL, rank_main, &ranks[r]), 0);
  }
  /* The job beside starts once this one plans. */
  while (strcmp(phase, "planning") != 0) {
    status_phase(c, phase, sizeof phase, &worst_us);
    answered++;
    ck_assert_msg(strcmp(phase, "failed") != 0 && strcmp(phase, "moving"),
                  "the export reached %s before it was seen planning", phase);
    usleep(5000);
  }
  legitimate_export();
  while (!atomic_load(&ranks[0].done) || !atomic_load(&ranks[1].done)) {
    status_phase(c, phase, sizeof phase, &worst_us);
    answered++;
    usleep(20000);
  }
  for (uint32_t r = 0; r < 2; r++)
    ck_assert_int_eq(pthread_join(ranks[r].thread, NULL), 0);
  for (uint32_t r = 0; r < 2; r++) {
    ck_assert_msg(ranks[r].rc == SP_ETIMEOUT, "rank %u: %s (%s)", r,
                  sp_err_name(ranks[r].rc), ranks[r].msg);
    ck_assert_ptr_nonnull(strstr(ranks[r].msg, "planning took longer than "
                                               "the export's timeout of "
                                               "3000 ms"));
  }
  ck_assert_str_eq(ranks[0].msg, ranks[1].msg);
  /* The planner looks at its stop flag every few thousand runs: its
   * thread is gone long before the billion runs could be. */
  for (int i = 0;
       i < 200 && sp_test_vm_kb(daemon_.pid, "Threads") > threads_before; i++) {
    status_phase(c, phase, sizeof phase, &worst_us);
    answered++;
    usleep(50000);
  }
  ck_assert_int_eq(sp_test_vm_kb(daemon_.pid, "Threads"), threads_before);
  long peak_after = sp_test_vm_kb(daemon_.pid, "VmHWM");
  printf("plan past its timeout: %llu status replies, the slowest %llu us; "
         "peak resident set %ld -> %ld KiB (bound: +%d KiB)\n",
         (unsigned long long)answered, (unsigned long long)worst_us,
         peak_before, peak_after, PEAK_GROWTH_KIB);
  ck_assert_msg(peak_after - peak_before < PEAK_GROWTH_KIB,
                "the daemon's peak resident set grew from %ld to %ld KiB",
                peak_before, peak_after);
  sp_close(c);
  for (uint32_t r = 0; r < 2; r++)
    holding_close(&ranks[r].h);
}
END_TEST

int main(void) {
  Suite *s = suite_create("daemon-planner");
  TCase *tc = tcase_create("planner");
  SRunner *sr;
  int failed;

  tcase_add_checked_fixture(tc, start, stop);
  tcase_set_timeout(tc, 60);
  tcase_add_test(tc, huge_sparse_affine_key_costs_its_pieces);
  tcase_add_test(tc, plan_longer_than_the_timeout_fails_and_stops);
  suite_add_tcase(s, tc);
  sr = srunner_create(s);
  srunner_run_all(sr, CK_NORMAL);
  failed = srunner_ntests_failed(sr);
  srunner_free(sr);
  return failed == 0 ? EXIT_SUCCESS : EXIT_FAILURE;
}
