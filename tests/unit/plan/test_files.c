/*
 * test_files.c - the numbering of a save's files (daemon/plan/files.h).
 */
#include <check.h>
#include <stdlib.h>

#include "daemon/plan/files.h"

#define MIB (UINT64_C(1) << 20)

static uint32_t number(size_t n, const uint32_t *owner, const uint64_t *bytes,
                       uint32_t world, uint64_t limit, uint32_t *file) {
  uint32_t nfiles = UINT32_MAX;
  ck_assert_int_eq(
      plan_files_number(n, owner, bytes, world, limit, file, &nfiles), 0);
  return nfiles;
}

/* Everything on one owner, within the limit: one file. */
START_TEST(one_owner_within_the_limit_is_one_file) {
  uint32_t owner[] = {1, 1, 1};
  uint64_t bytes[] = {MIB, 2 * MIB, 0};
  uint32_t file[3];
  ck_assert_uint_eq(number(3, owner, bytes, 2, 3 * MIB, file), 1);
  ck_assert_uint_eq(file[0], 0);
  ck_assert_uint_eq(file[1], 0);
  ck_assert_uint_eq(file[2], 0);
}
END_TEST

/* Two owners never share a file, however small their keys; rank 0's
 * files come first, whatever the key order. */
START_TEST(owners_never_share_a_file) {
  uint32_t owner[] = {1, 0, 1, 0};
  uint64_t bytes[] = {8, 8, 8, 8};
  uint32_t file[4];
  ck_assert_uint_eq(number(4, owner, bytes, 2, MIB, file), 2);
  ck_assert_uint_eq(file[0], 1);
  ck_assert_uint_eq(file[1], 0);
  ck_assert_uint_eq(file[2], 1);
  ck_assert_uint_eq(file[3], 0);
}
END_TEST

/* The limit cuts an owner's keys into several files, in key order; a file
 * reaches the limit exactly and not one byte past it. */
START_TEST(the_limit_cuts_at_its_edge) {
  uint32_t owner[] = {0, 0, 0, 0, 0};
  uint64_t bytes[] = {40, 60, 1, 100, 99};
  uint32_t file[5];
  ck_assert_uint_eq(number(5, owner, bytes, 1, 100, file), 4);
  ck_assert_uint_eq(file[0], 0); /* 40 */
  ck_assert_uint_eq(file[1], 0); /* 100: exactly the limit */
  ck_assert_uint_eq(file[2], 1); /* 101 would pass it */
  ck_assert_uint_eq(file[3], 2); /* 1 + 100 would pass it */
  ck_assert_uint_eq(file[4], 3); /* 100 + 99 would pass it */
}
END_TEST

/* A key larger than the limit gets a file of its own, and the next key
 * starts another. */
START_TEST(a_key_past_the_limit_is_alone) {
  uint32_t owner[] = {0, 0, 0};
  uint64_t bytes[] = {10, 500, 10};
  uint32_t file[3];
  ck_assert_uint_eq(number(3, owner, bytes, 1, 100, file), 3);
  ck_assert_uint_eq(file[0], 0);
  ck_assert_uint_eq(file[1], 1);
  ck_assert_uint_eq(file[2], 2);
}
END_TEST

/* Empty tensors never start a file of their own once one is open; a
 * rank that owns nothing has no file. */
START_TEST(empty_keys_and_idle_owners) {
  uint32_t owner[] = {2, 2, 0, 2};
  uint64_t bytes[] = {100, 0, 0, 0};
  uint32_t file[4];
  ck_assert_uint_eq(number(4, owner, bytes, 3, 100, file), 2);
  ck_assert_uint_eq(file[2], 0); /* rank 0: one file, its empty key */
  ck_assert_uint_eq(file[0], 1); /* rank 1 owns nothing */
  ck_assert_uint_eq(file[1], 1);
  ck_assert_uint_eq(file[3], 1);
  ck_assert_uint_eq(number(0, owner, bytes, 3, 100, file), 0);
}
END_TEST

/* Over many owners and keys: files are numbered without gaps, each holds
 * one owner's keys, in key order, and stays within the limit unless one
 * key alone passes it. */
START_TEST(the_rules_hold_over_many_keys) {
  enum { N = 5000, WORLD = 7 };
  uint32_t *owner = malloc(N * sizeof *owner), *file = malloc(N * sizeof *file);
  uint64_t *bytes = malloc(N * sizeof *bytes);
  ck_assert_ptr_nonnull(owner);
  ck_assert_ptr_nonnull(file);
  ck_assert_ptr_nonnull(bytes);
  uint64_t seed = 12345;
  for (size_t k = 0; k < N; k++) {
    seed = seed * 6364136223846793005u + 1442695040888963407u;
    owner[k] = (uint32_t)(seed >> 33) % WORLD;
    bytes[k] = (seed >> 20) % 3000;
  }
  const uint64_t limit = 2048;
  uint32_t nfiles = number(N, owner, bytes, WORLD, limit, file);
  uint32_t *file_owner = malloc(nfiles * sizeof *file_owner);
  uint64_t *file_bytes = calloc(nfiles, sizeof *file_bytes);
  size_t *file_keys = calloc(nfiles, sizeof *file_keys);
  ck_assert_ptr_nonnull(file_owner);
  ck_assert_ptr_nonnull(file_bytes);
  ck_assert_ptr_nonnull(file_keys);
  uint32_t last_file[WORLD];
  for (uint32_t r = 0; r < WORLD; r++)
    last_file[r] = UINT32_MAX;
  for (size_t k = 0; k < N; k++) {
    ck_assert_uint_lt(file[k], nfiles);
    if (file_keys[file[k]] == 0)
      file_owner[file[k]] = owner[k];
    ck_assert_uint_eq(file_owner[file[k]], owner[k]);
    /* An owner's files follow each other in key order. */
    ck_assert(last_file[owner[k]] == UINT32_MAX ||
              file[k] == last_file[owner[k]] ||
              file[k] == last_file[owner[k]] + 1);
    last_file[owner[k]] = file[k];
    file_bytes[file[k]] += bytes[k];
    file_keys[file[k]]++;
  }
  for (uint32_t f = 0; f < nfiles; f++) {
    ck_assert_uint_gt(file_keys[f], 0);
    ck_assert(file_bytes[f] <= limit || file_keys[f] == 1);
    /* Files go by owner: rank order. */
    if (f > 0)
      ck_assert_uint_le(file_owner[f - 1], file_owner[f]);
  }
  free(owner);
  free(file);
  free(bytes);
  free(file_owner);
  free(file_bytes);
  free(file_keys);
}
END_TEST

int main(void) {
  Suite *s = suite_create("plan-files");
  TCase *tc = tcase_create("files");
  tcase_add_test(tc, one_owner_within_the_limit_is_one_file);
  tcase_add_test(tc, owners_never_share_a_file);
  tcase_add_test(tc, the_limit_cuts_at_its_edge);
  tcase_add_test(tc, a_key_past_the_limit_is_alone);
  tcase_add_test(tc, empty_keys_and_idle_owners);
  tcase_add_test(tc, the_rules_hold_over_many_keys);
  suite_add_tcase(s, tc);
  SRunner *sr = srunner_create(s);
  srunner_run_all(sr, CK_NORMAL);
  int failed = srunner_ntests_failed(sr);
  srunner_free(sr);
  return failed == 0 ? EXIT_SUCCESS : EXIT_FAILURE;
}
