/*
 * test_copy.c - strided box copies against an element-by-element oracle.
 */
#include <check.h>
#include <stdlib.h>
#include <string.h>

#include "daemon/xfer/copy.h"

/* The oracle: one element at a time, no merging. */
static void copy_slow(uint8_t *dst, const uint8_t *src, const struct xfer_box *b) {
  int64_t total = 1;
  for (int d = 0; d < b->ndim; d++)
    total *= b->shape[d];
  for (int64_t flat = 0; flat < total; flat++) {
    int64_t rest = flat, so = 0, doff = 0;
    for (int d = b->ndim - 1; d >= 0; d--) {
      int64_t i = rest % b->shape[d];
      rest /= b->shape[d];
      so += i * b->src_stride[d];
      doff += i * b->dst_stride[d];
    }
    memcpy(dst + doff * (int64_t)b->elem_size, src + so * (int64_t)b->elem_size,
           b->elem_size);
  }
}

static void run_case(const struct xfer_box *b, size_t region) {
  uint8_t *src = malloc(region), *fast = calloc(1, region), *slow = calloc(1, region);
  for (size_t i = 0; i < region; i++)
    src[i] = (uint8_t)(i * 131 + 7);
  xfer_copy(fast, src, b);
  copy_slow(slow, src, b);
  ck_assert_mem_eq(fast, slow, region);
  free(src);
  free(fast);
  free(slow);
}

START_TEST(dense_rows_copy_as_one_block) {
  struct xfer_box b = {.ndim = 2, .elem_size = 4, .shape = {3, 5},
                       .src_stride = {5, 1}, .dst_stride = {5, 1}};
  run_case(&b, 3 * 5 * 4);
  uint8_t src[60], dst[60];
  memset(src, 0xab, sizeof src);
  ck_assert_uint_eq(xfer_copy(dst, src, &b), 60);
}
END_TEST

START_TEST(column_split_lands_in_its_columns) {
  /* A 4x3 shard copied into columns 2..4 of a 4x8 tensor. */
  struct xfer_box b = {.ndim = 2, .elem_size = 2, .shape = {4, 3},
                       .src_stride = {3, 1}, .dst_stride = {8, 1}};
  run_case(&b, 4 * 8 * 2);
}
END_TEST

START_TEST(transposed_and_strided_views_copy_exactly) {
  struct xfer_box t = {.ndim = 2, .elem_size = 8, .shape = {6, 4},
                       .src_stride = {1, 6}, .dst_stride = {4, 1}};
  run_case(&t, 6 * 4 * 8);
  struct xfer_box s = {.ndim = 3, .elem_size = 1, .shape = {2, 3, 5},
                       .src_stride = {40, 10, 2}, .dst_stride = {15, 5, 1}};
  run_case(&s, 80);
}
END_TEST

START_TEST(empty_and_scalar_boxes) {
  struct xfer_box e = {.ndim = 2, .elem_size = 4, .shape = {0, 7},
                       .src_stride = {7, 1}, .dst_stride = {7, 1}};
  uint8_t a[4] = {1, 2, 3, 4}, z[4] = {0};
  ck_assert_uint_eq(xfer_copy(z, a, &e), 0);
  ck_assert_int_eq(z[0], 0);
  struct xfer_box s = {.ndim = 0, .elem_size = 4};
  ck_assert_uint_eq(xfer_copy(z, a, &s), 4);
  ck_assert_mem_eq(z, a, 4);
}
END_TEST

START_TEST(unit_dims_do_not_break_merging) {
  struct xfer_box b = {.ndim = 4, .elem_size = 2, .shape = {1, 3, 1, 4},
                       .src_stride = {12, 4, 4, 1}, .dst_stride = {99, 4, 7, 1}};
  run_case(&b, 12 * 2);
}
END_TEST

int main(void) {
  Suite *s = suite_create("copy");
  TCase *tc = tcase_create("core");
  tcase_add_test(tc, dense_rows_copy_as_one_block);
  tcase_add_test(tc, column_split_lands_in_its_columns);
  tcase_add_test(tc, transposed_and_strided_views_copy_exactly);
  tcase_add_test(tc, empty_and_scalar_boxes);
  tcase_add_test(tc, unit_dims_do_not_break_merging);
  suite_add_tcase(s, tc);
  SRunner *sr = srunner_create(s);
  srunner_run_all(sr, CK_NORMAL);
  int failed = srunner_ntests_failed(sr);
  srunner_free(sr);
  return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
