/*
 * test_replicas.c - every rank's copy of a replicated or plain key is read
 * from its read-only mapping and compared by digest: copies with the same
 * values in any layout agree, one that differs is refused naming the key
 * and the ranks, only such keys are read, and a truncated trainer file
 * fails the comparison instead of killing the process.
 */
#include <check.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "daemon/registry.h"
#include "daemon/xfer/replicas.h"
#include "shardport.h"
#include "tests/unit/daemon/tmodel.h"

#define ROWS 4
#define COLS 6

/* Registers "r" (placement) as a 4 x 6 float32 on rank r in one of three
 * layouts holding the same values: dense, transposed (column-major), or
 * rows padded to 8 elements; value v(y, x) = 10 * y + x + bias. */
static void add_copy(struct tmodel *m, uint32_t r, const char *key,
                     enum plan_placement placement, int layout, float bias) {
  static const int64_t shape[2] = {ROWS, COLS};
  int64_t stride[2];
  size_t elems;
  if (layout == 0) {
    stride[0] = COLS, stride[1] = 1, elems = ROWS * COLS;
  } else if (layout == 1) {
    stride[0] = 1, stride[1] = ROWS, elems = ROWS * COLS;
  } else {
    stride[0] = 8, stride[1] = 1, elems = ROWS * 8;
  }
  uint64_t off = tmodel_alloc(m, r, elems * sizeof(float));
  float *p = (float *)(m->map[r] + off);
  for (int64_t y = 0; y < ROWS; y++)
    for (int64_t x = 0; x < COLS; x++)
      p[y * stride[0] + x * stride[1]] = (float)(10 * y + x) + bias;
  tmodel_tensor(m, r, key, SP_DTYPE_FLOAT32, placement, 2, shape, 2, shape,
                stride, (int64_t)(off / sizeof(float)), NULL, 0);
}

/* Plans m and compares the copies of the ranks in local (a bit per rank). */
static int compare(struct tmodel *m, uint32_t local, struct replica_digests *d,
                   char *msg, size_t msglen) {
  struct plan *plan;
  ck_assert_int_eq(plan_build(tmodel_input(m, 0, 0), &plan, msg, msglen), 0);
  const struct xfer_storage *src[TMODEL_MAX_RANKS] = {0};
  for (uint32_t r = 0; r < m->world; r++)
    if (local & (1u << r))
      src[r] = m->reg[r].info;
  int rc = replicas_hash(plan, tmodel_input(m, 0, 0), src, 2, d, msg, msglen);
  if (rc == 0)
    rc = replicas_compare(plan, d, msg, msglen);
  plan_free(plan);
  return rc;
}

START_TEST(same_values_in_any_layout_agree) {
  struct tmodel m;
  tmodel_init(&m, 3, 1 << 16);
  for (uint32_t r = 0; r < 3; r++) {
    add_copy(&m, r, "r", PLAN_REPLICATED, (int)r, 0);
    add_copy(&m, r, "p", PLAN_PLAIN, 2 - (int)r, 0.5f);
  }
  /* Keys of other placements are not read. */
  tmodel_shard0(&m, "s", SP_DTYPE_FLOAT32, 2, (int64_t[]){6, 2},
                (int64_t[]){1, 2, 3});
  tmodel_whole(&m, "e", SP_DTYPE_INT16, PLAN_EXPERT, 1, (int64_t[]){5}, 1);
  struct replica_digests d;
  char msg[512];
  ck_assert_msg(compare(&m, 7, &d, msg, sizeof msg) == 0, "%s", msg);
  ck_assert_uint_eq(d.nkeys, 2);
  ck_assert_uint_eq(d.nranks, 3);
  for (uint32_t j = 1; j < 3; j++)
    for (size_t i = 0; i < 2; i++)
      ck_assert_uint_eq(d.digest[j * d.nkeys + i], d.digest[i]);
  /* "p" and "r" differ in their values: so do their digests. */
  ck_assert_uint_ne(d.digest[0], d.digest[1]);
  replicas_free(&d);
  tmodel_free(&m);
}
END_TEST

START_TEST(a_copy_that_differs_is_refused) {
  struct tmodel m;
  tmodel_init(&m, 4, 1 << 16);
  for (uint32_t r = 0; r < 4; r++)
    add_copy(&m, r, "norm", PLAN_REPLICATED, (int)(r % 3), 0);
  /* Rank 2's copy has padded rows: bytes past each row's end are not
   * the tensor's and do not count. */
  float *p = (float *)(m.map[2] + tmodel_offset(&m, 2, "norm"));
  p[2 * 8 + 7] = 1234;
  struct replica_digests d;
  char msg[512];
  ck_assert_msg(compare(&m, 15, &d, msg, sizeof msg) == 0, "%s", msg);
  replicas_free(&d);
  /* Its last element does. */
  p[3 * 8 + 5] += 1;
  ck_assert_int_eq(compare(&m, 15, &d, msg, sizeof msg), SP_EDIFFERENT);
  static const char want[] =
      "key 'norm' (replicated): rank 2's copy differs from rank 0's (xxh3 ";
  ck_assert_msg(strncmp(msg, want, strlen(want)) == 0 &&
                    strstr(msg, ", rank 0's "),
                "%s", msg);
  ck_assert_ptr_null(strstr(msg, "more"));
  replicas_free(&d);
  /* Two ranks that differ: the first is named, the other counted. */
  p = (float *)(m.map[3] + tmodel_offset(&m, 3, "norm"));
  p[0] = -1;
  ck_assert_int_eq(compare(&m, 15, &d, msg, sizeof msg), SP_EDIFFERENT);
  ck_assert_msg(strstr(msg, "rank 2's copy differs from rank 0's") &&
                    strstr(msg, "and 1 more rank's too"),
                "%s", msg);
  replicas_free(&d);
  /* Only the local ranks are read: ranks 0 and 1 agree. */
  ck_assert_msg(compare(&m, 3, &d, msg, sizeof msg) == 0, "%s", msg);
  ck_assert_uint_eq(d.nranks, 2);
  ck_assert_uint_eq(d.ranks[1], 1);
  replicas_free(&d);
  tmodel_free(&m);
}
END_TEST

START_TEST(one_rank_reads_nothing) {
  struct tmodel m;
  tmodel_init(&m, 1, 1 << 12);
  add_copy(&m, 0, "r", PLAN_REPLICATED, 0, 0);
  struct replica_digests d;
  char msg[512];
  ck_assert_int_eq(compare(&m, 1, &d, msg, sizeof msg), 0);
  ck_assert_uint_eq(d.nkeys, 0);
  ck_assert_ptr_null(d.digest);
  replicas_free(&d);
  tmodel_free(&m);
}
END_TEST

START_TEST(truncated_file_fails_the_comparison) {
  struct tmodel m;
  tmodel_init(&m, 2, 1 << 16);
  for (uint32_t r = 0; r < 2; r++)
    add_copy(&m, r, "r", PLAN_PLAIN, 0, 0);
  /* The trainer shrinks its memfd after registering: the daemon's read
   * faults. */
  ck_assert_int_eq(ftruncate(m.fd[1], 0), 0);
  struct replica_digests d;
  char msg[512];
  ck_assert_int_eq(compare(&m, 3, &d, msg, sizeof msg), SP_EBADFD);
  ck_assert_msg(strstr(msg, "rank 1's copy of key 'r' could not be read"),
                "%s", msg);
  ck_assert_ptr_null(d.digest);
  tmodel_free(&m);
}
END_TEST

int main(void) {
  Suite *s = suite_create("replicas");
  TCase *tc = tcase_create("replicas");
  tcase_add_test(tc, same_values_in_any_layout_agree);
  tcase_add_test(tc, a_copy_that_differs_is_refused);
  tcase_add_test(tc, one_rank_reads_nothing);
  tcase_add_test(tc, truncated_file_fails_the_comparison);
  suite_add_tcase(s, tc);
  SRunner *sr = srunner_create(s);
  srunner_run_all(sr, CK_NORMAL);
  int failed = srunner_ntests_failed(sr);
  srunner_free(sr);
  return failed == 0 ? 0 : 1;
}
