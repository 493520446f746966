/*
 * replicas_bench.c - what comparing replicated and plain copies costs
 * (daemon/xfer/replicas.c, docs/operations.md "Replicated and plain keys").
 *
 * Four ranks each hold the same plain key of 64 MiB (float32) in a memfd,
 * mapped read-only as the daemon maps it; replicas_hash() reads all four
 * copies (256 MiB) on 1 and on 4 threads.  The limit measured in the same
 * run: one thread's memcpy of the same 256 MiB out of the same mappings
 * (reading every byte once is what the comparison cannot do without).
 * Printed, never asserted: these machines are shared.  It runs as a Check
 * test only because the job helpers (tmodel) assert with Check.
 */
#include <check.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "daemon/registry.h"
#include "daemon/xfer/replicas.h"
#include "shardport.h"
#include "tests/unit/daemon/tmodel.h"

#define RANKS 4
#define ELEMS (16u << 20) /* 64 MiB of float32 per copy */

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

START_TEST(compare_copies) {
  struct tmodel m;
  tmodel_init(&m, RANKS, (size_t)ELEMS * 4 + 4096);
  int64_t shape[1] = {ELEMS};
  for (uint32_t r = 0; r < RANKS; r++) {
    uint64_t off = tmodel_dense(&m, r, "w", SP_DTYPE_FLOAT32, PLAN_PLAIN, 1,
                                shape, shape);
    float *p = (float *)(m.map[r] + off);
    for (uint32_t i = 0; i < ELEMS; i++)
      p[i] = (float)i;
  }
  char msg[512];
  struct plan *plan;
  ck_assert_msg(plan_build(tmodel_input(&m, 0, 0), &plan, msg, sizeof msg) ==
                    0,
                "%s", msg);
  const struct xfer_storage *src[RANKS];
  for (uint32_t r = 0; r < RANKS; r++)
    src[r] = m.reg[r].info;
  double bytes = (double)RANKS * ELEMS * 4;
  double gib = bytes / (1u << 30);

  /* The limit: one thread reading every copy once, out of the daemon's
   * own read-only mappings; after a first pass that faults every page in
   * (the copies' and the sink's), as the daemon's mappings are warm once a
   * job has exported. */
  char *sink = malloc((size_t)ELEMS * 4);
  double t0 = 0, copy_s = 0;
  for (int pass = 0; pass < 2; pass++) {
    t0 = now_s();
    for (uint32_t r = 0; r < RANKS; r++)
      memcpy(sink, src[r][0].data, (size_t)ELEMS * 4);
    copy_s = now_s() - t0;
  }
  printf("memcpy of %.0f MiB, 1 thread: %.3f s, %.2f GiB/s (the limit)\n",
         bytes / (1u << 20), copy_s, gib / copy_s);

  for (uint32_t threads = 1; threads <= 4; threads *= 4) {
    struct replica_digests d;
    t0 = now_s();
    int rc = replicas_hash(plan, tmodel_input(&m, 0, 0), src, threads, &d,
                           msg, sizeof msg);
    double s = now_s() - t0;
    if (rc == 0)
      rc = replicas_compare(plan, &d, msg, sizeof msg);
    ck_assert_msg(rc == 0, "%s", msg);
    printf("comparing %u copies of %.0f MiB, %u thread(s): %.3f s, "
           "%.2f GiB/s, %.2fx the memcpy limit\n",
           RANKS, (double)ELEMS * 4 / (1u << 20), threads, s, gib / s,
           copy_s / s);
    replicas_free(&d);
  }
  free(sink);
  plan_free(plan);
  tmodel_free(&m);
}
END_TEST

int main(void) {
  Suite *s = suite_create("replicas_bench");
  TCase *tc = tcase_create("bench");
  tcase_set_timeout(tc, 600);
  tcase_add_test(tc, compare_copies);
  suite_add_tcase(s, tc);
  SRunner *sr = srunner_create(s);
  srunner_set_fork_status(sr, CK_NOFORK);
  srunner_run_all(sr, CK_SILENT);
  int failed = srunner_ntests_failed(sr);
  if (failed) {
    TestResult **r = srunner_failures(sr);
    fprintf(stderr, "replicas_bench: %s:%d: %s\n", tr_lfile(r[0]),
            tr_lno(r[0]), tr_msg(r[0]));
    free(r);
  }
  srunner_free(sr);
  return failed == 0 ? 0 : 1;
}
